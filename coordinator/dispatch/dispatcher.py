"""Remote experts: the coordinator's dispatcher (shell around ``coordinator.core.dispatch``).

Rules:
- Every decision is the core's (``DispatchCore.handle(event, now)``, ``now`` = ``trio.current_time()``):
  where a range runs, hedges, retries, fallbacks, deadlines, marking workers down, when a layer is
  complete. This module only moves tensors and bytes: it groups a layer's routed pairs by the
  dispatch map's ranges, reports what happened as events, and executes the effects (expert calls
  in the nursery, the local kernel on the local runner, timers as sleeping tasks, cancellation by
  cancel scope). It runs on the trio thread only, so the core needs no lock.
- ``dispatch_layer`` dispatches one MoE layer from a trio task; ``Dispatcher`` is also the engine's
  ``ExpertBackend`` (``moe``, or ``moe_begin`` then ``result``), called in the engine thread
  (DESIGN §5): it groups the pairs by range there and hands the step to the trio thread
  (``run_sync_soon``), where the core places the ranges and the remote calls go out; the ranges
  placed here come back to the engine thread, which computes them itself while the calls are in
  flight, and ``result`` waits for the core's ``Combine``. Between ``moe_begin`` and ``result`` the
  engine may compute the other micro-batch (``overlap``). Without a running loop (``serve`` not
  started) every range is computed locally, in the same partition.
- Fast path: while the core says every held range of a layer this size would run here
  (``local_only_pairs``: idle, or under load when no worker could finish earlier and no trial is
  due), the engine thread computes a layer whose ranges are all held itself, with no trip to the
  trio thread, and reports it afterwards (``LayerRanLocally``, with its reason and kernel time); the
  bits are those of the same partition.
- The local share computes while the remote calls are in flight: on the engine thread for the
  ranges of the core's first placement of an engine step; any later local work (a hedge's local
  copy, a step from ``dispatch_layer``) on one worker thread (``trio.to_thread.run_sync`` under a
  ``CapacityLimiter(1)``: the local ranges queue, which is what the core's backlog estimate
  models). Tests under virtual time plug in an async runner (then the engine path is off).
- A range's partial sum is computed by the same ``ExpertKernel`` on exactly the rows that have pairs
  in it, locally or on a volunteer; partial sums are added in ascending ``lo`` (DESIGN §3): the
  output does not depend on who won a hedge. The core's ``Cancel`` of a remote call (a hedge's
  loser) cancels its task; the expert client then sends the v2 ``Cancel`` frame, so the volunteer
  drops the request if it has not computed it yet, and its ``cancelled`` answer is dropped here.
- Requests carry the range's pairs as flat arrays in wire order (``Pairs``: sorted by (row,
  expert), built once per range with numpy), never as per-row lists; our Hello announces the
  kernel id the local path computes with.
- Load: every ``sample_interval_s`` the ``load_probe`` (busy slots, slots) runs on a worker thread
  under ``sample_timeout_s``; a hung or failed probe is abandoned and reported
  (``LoadSampleTimeout``), it never blocks dispatch.
- Verification (the core samples; DESIGN §12): the answers of calls the core marks ``keep`` are held
  until its ``Compare`` (then compared and dropped) or ``Forget`` (dropped). The request of a sampled
  call is the request of any other. Equal means bit-equal when the worker's Hello announces our
  kernel id and the wire is float32; otherwise every pair's output is within ``VERIFY_RTOL`` of ours
  (relative L2 error; measured across kernels and wire dtypes in ``verify_outputs``). A quarantine is
  logged, listed in the report with its evidence, and handed to ``on_quarantine`` (the market link).
- Clocks: the trio clock for every decision and measurement; the wall clock only for the Unix-ms
  stamps of the report (``last_serve_ms``, error and mode-change times).
- Volunteers behind NATs are reached through ``/p2p-circuit`` addresses and upgraded to direct
  connections by DCUtR hole punching (``swarm.p2p.nat``, attached to a libp2p transport while the
  dispatcher serves). A worker's expert stream that may have opened on the relayed connection
  moves once the connection turned direct (``swarm.core.paths.should_migrate``): new calls open a
  new stream, calls in flight finish on the old one, which is closed after ``timeout_s``. The
  report gives each worker's path: ``direct``, ``relayed`` or ``hole-punched`` (null: not
  connected), and ``relayed_bytes``: the expert-stream payload bytes that have crossed a relay to
  and from it (``Transport.relayed_bytes``; it stops growing once the stream has moved).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import queue
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.core.dispatch import (
    CallId,
    Cancel,
    CancelTimer,
    Combine,
    Compare,
    Compared,
    DispatchConfig,
    DispatchCore,
    DispatchMode,
    Effect,
    Event,
    Fail,
    FailureKind,
    Forget,
    Hedge,
    HoldRefuted,
    LayerRanLocally,
    LayerReady,
    LoadSample,
    LoadSampleTimeout,
    LocalDone,
    LocalFailed,
    MarkDown,
    MarkProven,
    ModeChanged,
    Quarantine,
    RangeWork,
    Reason,
    RemoteDone,
    RemoteFailed,
    RunLocal,
    SendRemote,
    Settle,
    Settled,
    SplitChecked,
    StartTimer,
    StepId,
    Timer,
    TimerFired,
    WorkersListed,
    WorkerTable,
)
from coordinator.core.holdings import HoldBook, Holding
from coordinator.engine.model import ReadyMoe
from swarm.core.histogram import Histogram
from swarm.core.paths import Path as ConnPath
from swarm.core.paths import session_path, should_migrate
from swarm.dispatch_map import DispatchMap, RangeReplicas, decode_dispatch_map, partition_layer
from swarm.errors import (
    BrokenError,
    ClosedError,
    ConfigError,
    DialError,
    DispatchFailed,
    ProtocolError,
    Refused,
    SwarmError,
    TransportTimeout,
)
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend, combine_pairs, expert_kernel, kernel_id
from swarm.model.slices import hold_digest_from_file
from swarm.p2p.libp2p import Libp2pTransport
from swarm.p2p.nat import Nat, NatConfig, open_nat
from swarm.p2p.transport import Transport
from swarm.protocol.coordinator import (
    DispatchErrorReport,
    DispatchReport,
    LayerRows,
    ModeChange,
    WorkerReport,
)
from swarm.protocol.expert import (
    PROTOCOL_ID,
    ExpertRequest,
    HoldChallenge,
    Pairs,
    RequestId,
    Status,
    make_pairs,
)
from swarm.rpc.client import ExpertClient
from swarm.rpc.tensors import pairs_to_tensors

__all__ = [
    "DispatchCollector",
    "Dispatcher",
    "HostedModel",
    "LocalJob",
    "LocalKernel",
    "LocalRunner",
    "LoadProbe",
    "watch_dispatch_map_file",
]

log = logging.getLogger(__name__)

# Tolerance of a comparison that cannot be bit-exact (another kernel id, a 16-bit wire): the largest
# relative L2 error of one pair's output. Measured on the golden fixtures (Q4_K_M, Q8_0, F32; 64 rows
# x 2 pairs per layer): ggml vs torch kernels <= 2.5e-2 (ggml rounds activations to q8 for quantised
# weights, torch does not); the same ggml kernel on a float16 / bfloat16 wire <= 1.5e-2 / 2.1e-2.
# Twice the worst case: a liar can hide changes below this only from workers we cannot compare exactly.
VERIFY_RTOL = 0.05
# A hold challenge: this many random windows of this many bytes of the slice's tensor data. A worker
# holding a share f of the file answers right with probability about f**4.
HOLD_WINDOWS = 4
HOLD_WINDOW_BYTES = 4096


def verify_outputs(remote: torch.Tensor, local: torch.Tensor, *, exact: bool) -> tuple[bool, str]:
    """Are a worker's per-pair outputs ours? ``(equal, detail)``: bit-equal when ``exact``, else each
    pair within ``VERIFY_RTOL`` (relative L2); ``detail`` is the evidence."""
    if tuple(remote.shape) != tuple(local.shape):
        return False, f"shape {tuple(remote.shape)} for {tuple(local.shape)}"
    a, b = remote.to(torch.float32), local.to(torch.float32)
    if not bool(torch.isfinite(a).all()):
        return False, "non-finite outputs"
    if exact:
        if torch.equal(a, b):
            return True, "bit-equal"
        diff = (a != b).any(dim=1)
        first = int(diff.nonzero()[0, 0])
        return False, (
            f"{int(diff.sum())} of {a.shape[0]} pair outputs differ (bit-exact comparison); first at pair "
            f"{first}: max |diff| {float((a[first] - b[first]).abs().max()):.3g}"
        )
    norms = b.norm(dim=1)
    floor = max(float(norms.median()) * 1e-3, 1e-30) if norms.numel() else 1e-30
    rel = (a - b).norm(dim=1) / norms.clamp_min(floor)
    worst = int(rel.argmax()) if rel.numel() else 0
    err = float(rel[worst]) if rel.numel() else 0.0
    if err <= VERIFY_RTOL:
        return True, f"within tolerance (max relative error {err:.3g})"
    return False, f"pair {worst}: relative error {err:.3g} > {VERIFY_RTOL:g} (tolerance comparison)"


@dataclass(frozen=True)
class LocalJob:
    """One range's share of a layer: ``x`` = the rows with pairs in ``[lo, hi)``, the pairs (row into
    ``x``, expert relative to ``lo``, weight) in wire order (sorted by (row, expert)). Its result is
    each pair's weighted expert output ``[n_pairs, d_model]`` in that order (``pair_outputs``)."""

    layer: int
    lo: int
    hi: int
    x: torch.Tensor
    pair_rows: torch.Tensor
    pair_experts: torch.Tensor
    pair_weights: torch.Tensor


LocalKernel = Callable[[LocalJob], torch.Tensor]  # synchronous: the weighted per-pair outputs [pairs, d_model]
LocalRunner = Callable[[LocalJob], Awaitable[torch.Tensor]]  # runs a LocalJob from the trio thread
LoadProbe = Callable[[], tuple[int, int]]  # (busy slots, slots)


class _Dims(Protocol):
    @property
    def n_moe_layer(self) -> int: ...
    @property
    def n_expert(self) -> int: ...
    @property
    def d_model(self) -> int: ...


class HostedModel(Protocol):
    """What the dispatcher needs of the hosted model (a ``GGUFModel``; tests pass a small fake)."""

    @property
    def model_id(self) -> str: ...
    @property
    def config(self) -> _Dims: ...


@dataclass
class _Job:
    lo: int
    hi: int
    replicas: tuple[str, ...]
    rows: torch.Tensor  # indices into the layer's rows, ascending
    local: LocalJob
    wire: Pairs  # ``local``'s pairs as sent (built once: retries and hedges reuse them)


@dataclass(eq=False)
class _StepRun:
    layer: int
    jobs: list[_Job]
    done: trio.Event = field(default_factory=trio.Event)
    results: dict[CallId, torch.Tensor] = field(default_factory=dict)
    combine: Combine | None = None
    fail: Fail | None = None
    # a step the engine thread started (``moe_begin``) waits on ``ended``; with ``engine`` (it holds a
    # range here) the local ranges of the core's first placement are handed to it (``placed``)
    # instead of a worker thread
    engine: bool = False
    step: StepId = StepId(0)
    capture: list[tuple[CallId, int]] | None = None
    placed: queue.SimpleQueue[list[tuple[CallId, int]]] = field(default_factory=queue.SimpleQueue)
    ended: threading.Event = field(default_factory=threading.Event)
    error: str = ""  # a bug on the trio side of an engine step: the layer fails, the loop goes on


class _Pending:
    """A layer the engine thread started under load (``Dispatcher.moe_begin``)."""

    def __init__(self, d: Dispatcher, run: _StepRun, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> None:
        self.d, self.run, self.args = d, run, (x, topk_ids, topk_w)

    def result(self) -> torch.Tensor:
        """Wait for the remote share and combine (the engine thread)."""
        return self.d._engine_result(self.run, *self.args)


# remote call latency buckets for /metrics (seconds)
LATENCY_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _MissingExperts(DispatchFailed):
    """A layer failed because experts it routed to are held by nobody live (wait mode may retry it)."""


_MISSING = frozenset({Reason.NO_REPLICA, Reason.ALL_DOWN, Reason.ALL_FAILED})


def _failure_kind(exc: SwarmError) -> FailureKind:
    match exc:
        case TransportTimeout():
            return FailureKind.TIMEOUT
        case DialError():
            return FailureKind.DIAL
        case BrokenError():
            return FailureKind.BROKEN
        case ClosedError():
            return FailureKind.CLOSED
        case Refused():
            return FailureKind.REFUSED
        case ProtocolError():
            return FailureKind.PROTOCOL
    return FailureKind.OTHER


def _wall_ms() -> int:
    return int(time.time() * 1000)


def _always_held(layer: int, lo: int, hi: int) -> bool:
    return True


class Dispatcher:
    def __init__(
        self,
        model: GGUFModel | HostedModel,
        transport: Transport | None,
        *,
        config: DispatchConfig | None = None,
        timeout_s: float | None = None,
        wire_dtype: str = "float32",
        hole_punch: bool = True,
        kernel: KernelBackend | None = None,
        load_probe: LoadProbe | None = None,
        probe_in_thread: bool = True,
        held: Callable[[int, int, int], bool] = _always_held,
        local_kernel: LocalKernel | None = None,
        local_runner: LocalRunner | None = None,
        rng: random.Random | None = None,
        prove_holdings: bool = False,
        missing_wait_s: float = 0.0,
    ) -> None:
        """``config`` holds the policy (``timeout_s``, if given, overrides its deadline); ``held(layer,
        lo, hi)`` tells the ranges the coordinator holds; ``local_kernel`` computes a range here
        (default: the model's experts with ``kernel``); ``local_runner`` runs it from the trio thread
        (default: ``local_kernel`` on a worker thread); ``load_probe`` gives (busy slots, slots), called on
        a worker thread unless ``probe_in_thread`` is False (tests under a virtual clock). ``prove_holdings``:
        a listed worker gets work for a slice only after it answered a hold challenge for it
        (``coordinator.core.holdings``; needs the GGUF model to check against)."""
        cfg = config if config is not None else DispatchConfig()
        if timeout_s is not None:
            cfg = dataclasses.replace(cfg, timeout_s=timeout_s)
        self.config = cfg
        self.model = model
        self.cfg = model.config
        self.kernel: KernelBackend | None = kernel if kernel is not None else getattr(model, "kernel", None)
        self.transport = transport
        self.timeout_s = cfg.timeout_s
        self.wire_dtype = wire_dtype
        self.hole_punch = hole_punch
        self.load_probe = load_probe
        self.probe_in_thread = probe_in_thread
        self.held = held
        if local_kernel is None:
            if not isinstance(model, GGUFModel):
                raise ConfigError("a dispatcher without a GGUF model needs a local_kernel")
            local_kernel = self._model_kernel
        self.local_kernel: LocalKernel = local_kernel
        self._local_runner: LocalRunner = local_runner if local_runner is not None else self._thread_runner
        self._local_limiter = trio.CapacityLimiter(1)
        # the verification samples: seeded from the OS unless a test hands in its own generator
        self.core = DispatchCore(cfg, n_layer=self.cfg.n_moe_layer, n_expert=self.cfg.n_expert,
                                 rng=rng if rng is not None else random.Random(secrets.randbits(64)))
        self.map: DispatchMap | None = None
        self._step_ids = itertools.count(1)
        self._steps: dict[StepId, _StepRun] = {}
        self._calls: dict[CallId, trio.CancelScope] = {}
        self._timers: dict[Timer, trio.CancelScope] = {}
        self._events: deque[Event] = deque()
        self._handling = False
        self._last_now = 0.0
        # read by the engine thread (one tuple, replaced whole: atomic)
        self._engine_local: tuple[float, Reason] = self.core.local_only_pairs(0.0)
        self._not_held = False  # the map lists a range this coordinator does not hold
        self._ran_here: list[Event] = []  # engine thread only: fast-path layers not yet reported
        self._clients: dict[str, ExpertClient] = {}
        self._addrs: dict[str, list[str]] = {}
        self._session_opened: dict[str, float] = {}  # peer -> start of the call that opened its stream
        self._sessions_seen: dict[str, tuple[int, int]] = {}  # peer -> (id(client), sessions_opened)
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._mode_changes: deque[ModeChange] = deque(maxlen=16)
        self._keep: set[CallId] = set()  # calls whose answers the core will compare
        self._kept: dict[CallId, torch.Tensor] = {}
        self.on_quarantine: list[Callable[[Quarantine], None]] = []  # e.g. the market link's report
        self.on_hold_proven: list[Callable[[Holding], None]] = []
        if prove_holdings and not isinstance(model, GGUFModel):
            raise ConfigError("hold challenges are checked against a GGUF model")
        self.holdings: HoldBook | None = HoldBook() if prove_holdings else None
        # --on-missing wait: a layer with experts nobody serves is retried while the map or a worker's
        # health may change, for up to this long, before the request fails (0: at once)
        self.missing_wait_s = missing_wait_s
        self._map_changed = trio.Event()
        self.latency_hist = Histogram(LATENCY_BOUNDS)
        self.missing_waits = 0  # layers that waited for coverage
        self.missing_failed = 0  # ... and still found none
        self._prove_wake = trio.Event()
        self._hold_ids = itertools.count(1 << 62)  # challenge ids: apart from the core's request ids
        self.maps_rejected = 0  # map files or market maps that could not be adopted
        self.map_error = ""  # why the last one was not

    @property
    def table(self) -> WorkerTable:
        return self.core.table

    def reject_map(self, reason: str) -> None:
        """A map from the file or the market was not adopted: count it, keep the reason for /dispatch."""
        self.maps_rejected += 1
        self.map_error = reason
        log.error("%s", reason)

    # -- trio side --------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._nat_support():
            await self._serve(task_status=task_status)

    @contextlib.asynccontextmanager
    async def _nat_support(self) -> AsyncIterator[None]:
        """Circuit dialing and hole punching on a libp2p transport (unless someone attached them)."""
        if isinstance(self.transport, Libp2pTransport) and self.transport.nat is None:
            async with open_nat(self.transport, NatConfig(hole_punch=self.hole_punch)):
                yield
        else:
            yield

    async def _serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            nursery.start_soon(self._watch_paths)
            if self.holdings is not None:
                nursery.start_soon(self._prove_loop)
            if self.load_probe is not None:
                nursery.start_soon(self._sample_load, self.load_probe)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._token = None
                for c in list(self._clients.values()):
                    with trio.CancelScope(shield=True):
                        await c.aclose()
                self._clients.clear()

    def set_map(self, m: DispatchMap, *, force: bool = False) -> bool:
        """Adopt ``m`` (trio side). Returns False if it is older than the current map (unless ``force``)."""
        if m.model_id != self.model.model_id:
            raise ConfigError(
                f"dispatch map is for {m.model_id!r}, this coordinator hosts {self.model.model_id!r}",
                code="bad_dispatch_map",
            )
        m.validate(n_layer=self.cfg.n_moe_layer, n_expert=self.cfg.n_expert)
        if self.map is not None and m.version < self.map.version and not force:
            return False
        peers = m.peers()
        before = set(self.core.table.workers)
        self.map = m
        self._not_held = any(not self.held(lr.layer, r.lo, r.hi) for lr in m.layers for r in lr.ranges)
        self._map_changed.set()
        self._map_changed = trio.Event()
        self._post(WorkersListed(frozenset(peers)))
        if self.holdings is not None:
            self.holdings.sync({Holding(rep.peer_id, lr.layer, r.lo, r.hi)
                                for lr in m.layers for r in lr.ranges for rep in r.replicas}, self._now())
            self._prove_wake.set()
        added, removed = peers.keys() - before, before - peers.keys()
        for p in removed:
            c = self._clients.pop(p, None)
            self._addrs.pop(p, None)
            self._session_opened.pop(p, None)
            if c is not None and self._nursery is not None:
                self._nursery.start_soon(c.aclose)
        for p, addrs in peers.items():
            if p in self._clients and self._addrs.get(p) != addrs:
                c = self._clients.pop(p)
                if self._nursery is not None:
                    self._nursery.start_soon(c.aclose)
            self._addrs[p] = addrs
        log.info("dispatch map v%d: %d workers (+%d -%d)", m.version, len(peers), len(added), len(removed))
        return True

    # -- events in, effects out ---------------------------------------------------------------------
    def _post(self, ev: Event) -> None:
        """Hand ``ev`` to the core and execute its effects (events raised meanwhile queue up)."""
        self._events.append(ev)
        if self._handling:
            return
        self._handling = True
        try:
            while self._events:
                e = self._events.popleft()
                local: dict[StepId, list[tuple[CallId, int]]] = {}
                for eff in self.core.handle(e, self._now()):
                    if isinstance(eff, RunLocal):  # one kernel call for all of a step's local ranges
                        if eff.keep:
                            self._keep.add(eff.call)
                        local.setdefault(eff.step, []).append((eff.call, eff.index))
                    else:
                        self._execute(eff)
                for step, calls in local.items():
                    run = self._steps.get(step)
                    if run is not None and run.capture is not None:  # the engine thread computes these
                        run.capture.extend(calls)
                    else:
                        self._start_local_group(step, calls)
        finally:
            self._handling = False
            self._engine_local = self.core.local_only_pairs(self._last_now)

    def _now(self) -> float:
        """The trio clock (the core's only clock); outside a trio run (a map set before serving) the
        last time seen."""
        try:
            self._last_now = trio.current_time()
        except RuntimeError:
            pass
        return self._last_now

    def _execute(self, eff: Effect) -> None:
        match eff:
            case SendRemote(
                call=call, step=step, index=index, peer=peer, request_id=rid, attempt=attempt, keep=keep
            ):
                if keep:
                    self._keep.add(call)
                self._start_remote(call, step, index, peer, rid, attempt)
            case Compare(remote=remote, local=local, peer=peer, peer_b=peer_b):
                self._keep.discard(remote)
                self._keep.discard(local)
                a, b = self._kept.pop(remote, None), self._kept.pop(local, None)
                if a is None or b is None:  # cannot happen: the core asks only once both answered
                    equal, detail = False, "an answer to compare is missing"
                    log.error("verification of %s: %s", peer, detail)
                else:
                    theirs = self._peer_kernel_id(peer_b) if peer_b is not None else self._our_kernel_id
                    exact = self.wire_dtype == "float32" and self._peer_kernel_id(peer) == theirs
                    equal, detail = verify_outputs(a, b, exact=exact)
                    if peer_b is not None and not equal:  # two replicas disagree: kept until settled here
                        self._kept[remote], self._kept[local] = a, b
                        log.warning("replicas %s and %s disagree on layer %d experts %d-%d (%s): computing it here",
                                    peer, peer_b, eff.layer, eff.lo, eff.hi, detail)
                self._events.append(Compared(remote, equal, detail))
            case Settle(a=ca, b=cb, local=cl, peer_a=pa, peer_b=pb):
                ours = self._kept.pop(cl, None)
                verdicts = []
                for call, peer in ((ca, pa), (cb, pb)):
                    theirs_t = self._kept.pop(call, None)
                    if ours is None or theirs_t is None:
                        verdicts.append((True, "an answer to settle with is missing"))  # no evidence: no quarantine
                        continue
                    exact = self.wire_dtype == "float32" and self._peer_kernel_id(peer) == self._our_kernel_id
                    verdicts.append(verify_outputs(theirs_t, ours, exact=exact))
                self._keep.difference_update((ca, cb, cl))
                (ea, da), (eb, db) = verdicts
                self._events.append(Settled(ca, ea, eb, da, db))
            case Forget(calls=calls):
                for c in calls:
                    self._keep.discard(c)
                    self._kept.pop(c, None)
            case Quarantine(peer=peer, evidence=evidence):
                log.error("worker %s quarantined: %s", peer, evidence)
                for hook in self.on_quarantine:
                    try:
                        hook(eff)
                    except Exception:  # a reporting hook must not stop dispatch
                        log.exception("quarantine hook failed")
            case Hedge(call=call, step=step, index=index, peer=None):
                self._start_local(call, step, index)
            case Hedge(
                call=call, step=step, index=index, peer=str() as peer, request_id=rid, attempt=attempt
            ):
                self._start_remote(call, step, index, peer, rid, attempt)
            case RunLocal(call=call, step=step, index=index):
                self._start_local(call, step, index)
            case Cancel(call=call):
                scope = self._calls.pop(call, None)
                if scope is not None:
                    scope.cancel()
            case StartTimer(timer=timer, at=at):
                self._start_timer(timer, at)
            case CancelTimer(timer=timer):
                scope = self._timers.pop(timer, None)
                if scope is not None:
                    scope.cancel()
            case MarkDown(peer=peer, kind=kind, message=message, retry_at=retry_at):
                log.warning(
                    "worker %s marked down (%s: %s), retry in %.1fs",
                    peer,
                    kind.value,
                    message,
                    max(0.0, retry_at - trio.current_time()),
                )
            case MarkProven(peer=peer):
                log.info("worker %s proven", peer)
            case Combine(step=step) | Fail(step=step):
                run = self._steps.get(step)
                if run is not None:
                    if isinstance(eff, Combine):
                        run.combine = eff
                    else:
                        run.fail = eff
                    run.done.set()
                    run.ended.set()
            case ModeChanged(state=state, reason=reason):
                log.info("dispatch: %s (%s)", state.value, reason.value)
                self._mode_changes.append(
                    ModeChange(at_ms=_wall_ms(), state=state.value, reason=reason.value)
                )
            case SplitChecked(outcome=o, reason=reason):
                windows = " / ".join(f"{r:.0f}" for r in o.local_rates) if o.local_rates else "the rate it beat"
                detail = (f"{'held split fell behind: ' if o.watched else ''}split {o.split_rate:.0f} vs local "
                          f"{o.local_rate:.0f} ({windows}) routed pairs/s: {o.arm.value} for {o.until - o.at:.0f} s")
                log.info("dispatch: %s (%s)", reason.value, detail)
                self._mode_changes.append(ModeChange(at_ms=_wall_ms(), state=self.core.state.value,
                                                     reason=reason.value, detail=detail))

    def _spawn(self, fn: Callable[[trio.CancelScope], Awaitable[None]], scope: trio.CancelScope) -> bool:
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, scope)
        return True

    def _start_timer(self, timer: Timer, at: float) -> None:
        scope = trio.CancelScope()
        self._timers[timer] = scope

        async def fire(scope: trio.CancelScope) -> None:
            with scope:
                await trio.sleep_until(at)
            if not scope.cancelled_caught and self._timers.get(timer) is scope:
                del self._timers[timer]
                self._post(TimerFired(timer))

        if not self._spawn(fire, scope):
            self._timers.pop(timer, None)

    def _start_remote(
        self, call: CallId, step: StepId, index: int, peer: str, rid: int, attempt: int
    ) -> None:
        run = self._steps.get(step)
        if run is None or self.transport is None or self._nursery is None:
            self._events.append(RemoteFailed(call, FailureKind.CLOSED, "the dispatcher is not serving"))
            return
        job = run.jobs[index]
        pairs = job.wire
        req = ExpertRequest(
            request_id=RequestId(rid),
            attempt=attempt,
            model_id=self.model.model_id,
            layer=run.layer,
            lo=job.lo,
            hi=job.hi,
            n_rows=int(job.local.x.shape[0]),
            d_model=self.cfg.d_model,
            n_pairs=len(pairs),
            dtype=self.wire_dtype,
        )
        scope = trio.CancelScope()
        self._calls[call] = scope

        async def remote(scope: trio.CancelScope) -> None:
            started = trio.current_time()
            ev: Event | None = None
            with scope:
                try:
                    out = await self._client(peer).call(req, job.local.x, pairs, timeout=self.timeout_s)
                except SwarmError as exc:
                    msg = f"{type(exc).__name__}[{exc.code}]: {exc.message}"
                    log.info(
                        "expert call to %s failed (layer %d %d-%d): %s", peer, run.layer, job.lo, job.hi, msg
                    )
                    ev = RemoteFailed(call, _failure_kind(exc), msg, _wall_ms())
                else:
                    run.results[call] = out
                    if call in self._keep:
                        self._kept[call] = out
                    self._note_session(peer, started)
                    self.latency_hist.observe(trio.current_time() - started)
                    ev = RemoteDone(call, _wall_ms())
            if self._calls.get(call) is scope:
                del self._calls[call]
            if ev is not None and not scope.cancelled_caught:
                self._post(ev)

        self._spawn(remote, scope)

    def _start_local(self, call: CallId, step: StepId, index: int) -> None:
        run = self._steps.get(step)
        if run is None or self._nursery is None:
            self._events.append(LocalFailed(call, "the dispatcher is not serving"))
            return
        job = run.jobs[index].local
        scope = trio.CancelScope()
        self._calls[call] = scope

        async def local(scope: trio.CancelScope) -> None:
            ev: Event | None = None
            with scope:
                async with self._local_limiter:  # one local range at a time: the core's backlog model
                    t0 = trio.current_time()
                    try:
                        out = await self._local_runner(job)
                    except Exception as exc:  # a bug or a kernel error: reported, the layer fails
                        log.exception("local experts failed (layer %d %d-%d)", job.layer, job.lo, job.hi)
                        ev = LocalFailed(call, f"{type(exc).__name__}: {exc}")
                    else:
                        run.results[call] = out
                        if call in self._keep:
                            self._kept[call] = out
                        ev = LocalDone(call, trio.current_time() - t0)
            if self._calls.get(call) is scope:
                del self._calls[call]
            if ev is not None and not scope.cancelled_caught:
                self._post(ev)

        self._spawn(local, scope)

    def _start_local_group(self, step: StepId, calls: list[tuple[CallId, int]]) -> None:
        """The ranges the core placed here in one decision, computed by one kernel call over the
        layer (per-pair outputs are batch-invariant: the bits of one call per range) and reported one
        by one, each with its share of the time. A ``Cancel`` of one of them drops only its answer."""
        if len(calls) == 1:
            self._start_local(calls[0][0], step, calls[0][1])
            return
        run = self._steps.get(step)
        if run is None or self._nursery is None:
            for call, _ in calls:
                self._events.append(LocalFailed(call, "the dispatcher is not serving"))
            return
        merged, n_pairs = self._merged(run, [i for _, i in calls])
        scopes = {call: trio.CancelScope() for call, _ in calls}
        self._calls.update(scopes)
        group = trio.CancelScope()

        async def local(group: trio.CancelScope) -> None:
            evs: list[Event] = []
            with group:
                async with self._local_limiter:  # one local computation at a time: the core's backlog model
                    t0 = trio.current_time()
                    try:
                        out = await self._local_runner(merged)
                    except Exception as exc:  # a bug or a kernel error: reported, the layer fails
                        log.exception("local experts failed (layer %d)", merged.layer)
                        evs = [LocalFailed(call, f"{type(exc).__name__}: {exc}") for call, _ in calls]
                    else:
                        dt = trio.current_time() - t0
                        total = max(1, sum(n_pairs))
                        for (call, _), y, n in zip(calls, torch.split(out, n_pairs), n_pairs, strict=True):
                            run.results[call] = y
                            if call in self._keep:
                                self._kept[call] = y
                            evs.append(LocalDone(call, dt * n / total))
            for (call, _), ev in zip(calls, evs, strict=False):
                sc = scopes[call]
                if self._calls.get(call) is sc:
                    del self._calls[call]
                if not sc.cancel_called and not group.cancelled_caught:
                    self._post(ev)

        self._spawn(local, group)

    def _merged(self, run: _StepRun, indices: list[int]) -> tuple[LocalJob, list[int]]:
        """One local job of the step's ranges ``indices`` (their pairs side by side) and each one's pair count."""
        jobs = [run.jobs[i].local for i in indices]
        n_pairs = [int(j.pair_rows.shape[0]) for j in jobs]
        if len(jobs) == 1:
            return jobs[0], n_pairs
        sizes = [int(j.x.shape[0]) for j in jobs]
        bases = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        merged = LocalJob(
            jobs[0].layer, 0, self.cfg.n_expert, torch.cat([j.x for j in jobs]),
            torch.cat([j.pair_rows + b for j, b in zip(jobs, bases.tolist(), strict=True)]),
            torch.cat([j.pair_experts + j.lo for j in jobs]), torch.cat([j.pair_weights for j in jobs]),
        )
        return merged, n_pairs

    def _model_kernel(self, job: LocalJob) -> torch.Tensor:
        assert isinstance(self.model, GGUFModel)
        sub = self.model.expert_stack(job.layer, job.lo, job.hi)
        k = expert_kernel(sub, self.kernel) if self.kernel is not None else expert_kernel(sub)
        return k.pair_outputs(job.x, job.pair_rows, job.pair_experts, job.pair_weights)

    def _compute_in_thread(self, job: LocalJob) -> torch.Tensor:
        with torch.no_grad():
            return self.local_kernel(job)

    async def _thread_runner(self, job: LocalJob) -> torch.Tensor:
        return await trio.to_thread.run_sync(self._compute_in_thread, job)

    async def _sample_load(self, probe: LoadProbe) -> None:
        c = self.config
        while True:
            ev: Event = LoadSampleTimeout(f"no load sample within {c.sample_timeout_s:g}s")
            with trio.move_on_after(c.sample_timeout_s):
                try:
                    if self.probe_in_thread:
                        busy, n_slots = await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
                    else:
                        busy, n_slots = probe()
                    ev = LoadSample(int(busy), int(n_slots))
                except Exception as exc:  # the probe is the engine's: whatever it raises, dispatch goes on
                    ev = LoadSampleTimeout(f"load sample failed: {type(exc).__name__}: {exc}")
            self._post(ev)
            await trio.sleep(c.sample_interval_s)

    # -- one layer -------------------------------------------------------------------------------------
    def _jobs(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> list[_Job]:
        n_tok, k = topk_ids.shape
        all_e = topk_ids.reshape(-1).numpy()
        all_w = topk_w.reshape(-1).to(torch.float32).numpy()
        all_rows = np.repeat(np.arange(n_tok, dtype=np.int64), k)
        m = self.map
        jobs: list[_Job] = []
        for r in partition_layer(m.ranges_of(layer) if m is not None else [], self.cfg.n_expert):
            sel = (all_e >= r.lo) & (all_e < r.hi)
            if not sel.any():
                continue
            pr = all_rows[sel]
            rows = np.unique(pr)
            wire = make_pairs(np.searchsorted(rows, pr), all_e[sel] - r.lo, all_w[sel])
            prs, pes, pws = pairs_to_tensors(wire)
            rows_t = torch.from_numpy(rows)
            local = LocalJob(layer, r.lo, r.hi, x.index_select(0, rows_t), prs, pes, pws)
            jobs.append(_Job(r.lo, r.hi, self._replicas(layer, r), rows_t, local, wire))
        return jobs

    def _combine(self, n_tok: int, jobs: list[_Job], results: Iterable[torch.Tensor]) -> torch.Tensor:
        """The layer's MoE output from every range's per-pair outputs: per token, the pairs added in
        ascending expert order (``combine_pairs``), whoever computed them and however the layer was cut."""
        ys = list(results)
        if not jobs:
            return torch.zeros(n_tok, self.cfg.d_model, dtype=torch.float32)
        for j, y in zip(jobs, ys, strict=True):
            if tuple(y.shape) != (int(j.local.pair_rows.shape[0]), self.cfg.d_model):
                raise DispatchFailed(f"range {j.lo}-{j.hi}: {tuple(y.shape)} outputs for {j.local.pair_rows.shape[0]} pairs")
        rows = torch.cat([j.rows[j.local.pair_rows] for j in jobs])
        exps = torch.cat([j.local.pair_experts + j.lo for j in jobs])
        return combine_pairs(n_tok, rows.numpy(), exps.numpy(), torch.cat(ys) if len(ys) > 1 else ys[0])

    def _works(self, layer: int, topk_ids: torch.Tensor) -> tuple[RangeWork, ...]:
        """The ranges' row and pair counts of a layer (what ``LayerReady`` carries), cheaply: numpy on
        the routed ids, no per-range tensors (the engine thread's idle fast path)."""
        ids = topk_ids.numpy()
        e = ids.reshape(-1)
        rows = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
        m = self.map
        out = []
        for r in partition_layer(m.ranges_of(layer) if m is not None else [], self.cfg.n_expert):
            sel = (e >= r.lo) & (e < r.hi)
            n_pairs = int(sel.sum())
            if not n_pairs:
                continue
            replicas = self._replicas(layer, r)
            out.append(RangeWork(r.lo, r.hi, int(np.unique(rows[sel]).size), n_pairs, replicas,
                                 self.held(layer, r.lo, r.hi)))
        return tuple(out)

    def _replicas(self, layer: int, r: RangeReplicas) -> tuple[str, ...]:
        """A range's replicas that may get work: listed, and (``prove_holdings``) proved to hold it."""
        if self.transport is None:
            return ()
        book = self.holdings
        return tuple(rep.peer_id for rep in r.replicas if book is None or book.held(rep.peer_id, layer, r.lo, r.hi))

    # -- hold challenges (DESIGN §12 "proved it holds it") -----------------------------------------
    async def _prove_loop(self, *, max_in_flight: int = 4) -> None:
        """Challenge listed holdings not proven yet, ``max_in_flight`` at a time, as the book says."""
        book = self.holdings
        assert book is not None
        running = 0

        async def one(h: Holding) -> None:
            nonlocal running
            try:
                await self._challenge(h)
            finally:
                running -= 1
                self._prove_wake.set()  # a slot is free

        async with trio.open_nursery() as nursery:
            while True:
                self._prove_wake = trio.Event()  # set by a new map or a finished challenge
                for h in book.due(self._now(), max_in_flight - running):
                    if h.peer in self.core.table.quarantined:
                        book.refuted(h, "quarantined")
                        continue
                    running += 1
                    nursery.start_soon(one, h)
                nxt = book.next_retry()
                with trio.move_on_after(5.0 if nxt is None else max(0.01, min(5.0, nxt - self._now()))):
                    await self._prove_wake.wait()

    async def _challenge(self, h: Holding) -> None:
        book = self.holdings
        assert book is not None and isinstance(self.model, GGUFModel)
        stack = self.model.expert_stack(h.layer, h.lo, h.hi)
        size = stack.nbytes
        n = min(HOLD_WINDOW_BYTES, size)
        windows = [(secrets.randbelow(size - n + 1), n) for _ in range(HOLD_WINDOWS)]
        nonce = secrets.token_bytes(16)
        ch = HoldChallenge(request_id=RequestId(next(self._hold_ids)), attempt=0, model_id=self.model.model_id,
                           layer=h.layer, lo=h.lo, hi=h.hi, nonce=nonce, windows=windows)
        try:
            spans = tuple(self.model.file_span(t.raw) for t in stack.tensors().values())  # the slice file's data order
            expected = await trio.to_thread.run_sync(hold_digest_from_file, self.model.path, spans, nonce, windows)
            started = trio.current_time()
            proof = await self._client(h.peer).prove_hold(ch, timeout=self.timeout_s)
            self._note_session(h.peer, started)  # the challenge may have opened the stream (path migration)
        except SwarmError as exc:
            book.failed(h, self._now(), f"{exc.code}: {exc.message}")
            log.info("hold challenge to %s for %d:%d-%d failed: %s", h.peer, h.layer, h.lo, h.hi, exc.message)
            return
        if proof.status != Status.OK:
            book.failed(h, self._now(), f"{proof.status}: {proof.message}")
            log.info("hold challenge to %s for %d:%d-%d answered %s: %s", h.peer, h.layer, h.lo, h.hi,
                     proof.status, proof.message)
            return
        if proof.digest != expected:
            detail = f"hold digest {proof.digest.hex()[:16]} is not {expected.hex()[:16]} (nonce {nonce.hex()})"
            book.refuted(h, detail)
            log.warning("worker %s does not hold %d:%d-%d: %s", h.peer, h.layer, h.lo, h.hi, detail)
            self._post(HoldRefuted(h.peer, h.layer, h.lo, h.hi, detail))
            return
        book.passed(h)
        log.info("worker %s proved it holds %d:%d-%d", h.peer, h.layer, h.lo, h.hi)
        for hook in self.on_hold_proven:
            hook(h)

    def _post_all(self, evs: list[Event]) -> None:
        for ev in evs:
            self._post(ev)

    def _all_here(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Every expert of the layer computed here in one kernel call: the bits of any partition
        (per-pair outputs are batch-invariant; the combine order is fixed by the experts)."""
        if self.local_kernel == self._model_kernel:  # one graph, the same bits (ExpertKernel.combined)
            assert isinstance(self.model, GGUFModel)
            stack = self.model.expert_stack(layer)
            kern = expert_kernel(stack, self.kernel) if self.kernel is not None else expert_kernel(stack)
            return kern.combined(x, topk_ids, topk_w)
        n_tok, k = topk_ids.shape
        job = LocalJob(layer, 0, self.cfg.n_expert, x, torch.arange(n_tok).repeat_interleave(k), topk_ids.reshape(-1),
                       topk_w.reshape(-1))
        y = self.local_kernel(job)
        return combine_pairs(n_tok, job.pair_rows.numpy(), job.pair_experts.numpy(), y)

    async def dispatch_layer(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
    ) -> torch.Tensor:
        """The routed-expert output ``[T, d_model]`` of one MoE layer (trio side). A layer that failed
        for want of experts nobody serves is retried, whole, whenever the map changes (or every
        0.5 s: a worker's backoff may pass) for up to ``missing_wait_s``; then it fails."""
        deadline: float | None = None
        while True:
            changed = self._map_changed  # taken before the attempt: a map adopted during it is not missed
            try:
                return await self._dispatch_layer_once(layer, x, topk_ids, topk_w)
            except _MissingExperts as exc:
                now = trio.current_time()
                if deadline is None:
                    deadline = now + self.missing_wait_s
                    if self.missing_wait_s > 0:
                        self.missing_waits += 1
                        log.warning("layer %d waits up to %.0f s for experts nobody serves: %s", layer,
                                    self.missing_wait_s, exc.message)
                if now >= deadline:
                    if self.missing_wait_s > 0:
                        self.missing_failed += 1
                    raise DispatchFailed(exc.message) from None
                with trio.move_on_after(min(0.5, deadline - now)):
                    await changed.wait()

    def _range_works(self, layer: int, jobs: list[_Job]) -> tuple[RangeWork, ...]:
        return tuple(RangeWork(j.lo, j.hi, int(j.local.x.shape[0]), int(j.local.pair_rows.shape[0]), j.replicas,
                               self.held(layer, j.lo, j.hi)) for j in jobs)

    def _expert_pairs(self, topk_ids: torch.Tensor) -> tuple[int, ...]:
        """Routed pairs per expert (for the hot-expert cache; empty without it)."""
        if self.config.hot_experts <= 0:
            return ()
        return tuple(int(n) for n in torch.bincount(topk_ids.reshape(-1), minlength=self.cfg.n_expert))

    async def _dispatch_layer_once(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
    ) -> torch.Tensor:
        jobs = self._jobs(layer, x, topk_ids, topk_w)
        works = self._range_works(layer, jobs)
        expert_pairs = self._expert_pairs(topk_ids)
        step = StepId(next(self._step_ids))
        run = _StepRun(layer, jobs)
        self._steps[step] = run
        try:
            self._post(LayerReady(step, layer, works, expert_pairs))
            # no deadline here: every remote call has the core's deadline, the local kernel returns
            await run.done.wait()
        finally:
            del self._steps[step]
        if run.fail is not None:
            if run.fail.reason in _MISSING:
                raise _MissingExperts(run.fail.message)
            raise DispatchFailed(run.fail.message)
        assert run.combine is not None
        return self._combine(int(topk_ids.shape[0]), jobs, (run.results[c] for c in run.combine.calls))

    # -- engine thread ------------------------------------------------------------------------------
    def local_layer(self, layer: int, n_pairs: int) -> bool:
        """``ExpertBackend.local_layer``: the engine may compute this layer whole, its MoE inside the
        layer's graph (the bits of ``_all_here``), when the fast path below would take it anyway --
        not serving, or ``n_pairs`` within the core's local-only bound -- and every range of the
        layer is held here (decided before the routing is known: all of them, not only the routed)."""
        if self.local_kernel != self._model_kernel or self.kernel is KernelBackend.TORCH:
            return False  # a fake or the torch kernel computes local ranges: it must be the one called
        if self._token is None:
            return True
        if n_pairs > self._engine_local[0]:
            return False
        m = self.map
        return all(self.held(layer, r.lo, r.hi)
                   for r in partition_layer(m.ranges_of(layer) if m is not None else [], self.cfg.n_expert))

    def ran_here(self, layer: int, experts: np.ndarray, seconds: float) -> None:
        """``ExpertBackend.ran_here``: a layer ``local_layer`` allowed was computed by the engine; the
        core hears of it as of the fast path's layers."""
        if self._token is None:
            return
        self._report_here(layer, self._works(layer, torch.from_numpy(experts)), self._engine_local[1], seconds)

    def _report_here(self, layer: int, works: tuple[RangeWork, ...], reason: Reason, seconds: float) -> None:
        token = self._token
        assert token is not None
        self._ran_here.append(LayerRanLocally(layer, works, reason, seconds))
        # the core hears of the step's layers in one hand-off (each one wakes the trio thread)
        if layer == self.cfg.n_moe_layer - 1 or len(self._ran_here) >= self.cfg.n_moe_layer:
            evs, self._ran_here = self._ran_here, []
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._post_all, evs)

    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        return self.moe_begin(layer, x, topk_ids, topk_w).result()

    def overlap(self, n_pairs: int) -> bool:
        """``ExpertBackend.overlap``: would the engine wait for remote ranges of a step of ``n_pairs``
        routed pairs per layer (``offload`` mode, or ranges this coordinator does not hold), with a
        round trip longer than the layer's compute here (the core's ``overlap_pays``)? Then it
        alternates two micro-batches, so one computes while the other's remote share is in flight."""
        token = self._token
        if token is None or not self._engine_path or not (self._not_held or self.config.mode is DispatchMode.OFFLOAD):
            return False
        try:  # the core lives on the trio thread: asked there (one hop per step, only in these modes)
            return bool(trio.from_thread.run_sync(
                lambda: self.core.overlap_pays(n_pairs, self._now(), not_held=self._not_held), trio_token=token))
        except trio.RunFinishedError:
            return False

    @functools.cached_property
    def _engine_path(self) -> bool:
        """The engine thread computes the local share of the steps it starts (not with a test's runner)."""
        return self._local_runner == self._thread_runner

    def moe_begin(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> ReadyMoe | _Pending:
        """``ExpertBackend.moe_begin``: start one MoE layer; ``.result()`` gives its output. Under load
        the core places the ranges (on the trio thread); the remote calls go out there while this
        thread computes the share placed here, then it returns: the engine may compute something
        else (the other micro-batch) before it asks for the result."""
        token = self._token
        if token is None:  # not serving: every expert here (the bits of any partition)
            return ReadyMoe(self._all_here(layer, x, topk_ids, topk_w))
        max_pairs, reason = self._engine_local
        if topk_ids.numel() <= max_pairs:
            # Fast path: the core would place every held range of this layer here (idle, or no worker
            # could finish earlier). Computing them on this thread spares the trip to the trio thread;
            # the core is told afterwards, without waiting. A change of state reaches this thread one
            # layer late at most.
            works = self._works(layer, topk_ids)
            if all(w.held for w in works):
                t0 = time.perf_counter()
                out = self._all_here(layer, x, topk_ids, topk_w)  # one kernel call, not one per range
                self._report_here(layer, works, reason, time.perf_counter() - t0)
                return ReadyMoe(out)
        if self._ran_here:  # the fast-path layers before this one first, in order
            evs, self._ran_here = self._ran_here, []
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._post_all, evs)
        if not self._engine_path:
            return ReadyMoe(trio.from_thread.run(self.dispatch_layer, layer, x, topk_ids, topk_w, trio_token=token))
        jobs = self._jobs(layer, x, topk_ids, topk_w)
        works = self._range_works(layer, jobs)
        # nothing held here (a backbone's layer): no local share to wait for -- any local work (a
        # missing range from disk, a fallback) runs on the worker thread
        run = _StepRun(layer, jobs, engine=any(w.held for w in works))
        try:
            token.run_sync_soon(self._begin_engine_step, run, works, self._expert_pairs(topk_ids))
        except trio.RunFinishedError:
            raise DispatchFailed("the dispatcher stopped") from None
        t0 = time.perf_counter()
        early = self._early_share(run, works, max_pairs) if run.engine else {}
        spent = time.perf_counter() - t0  # compute time only (for the local cost), not the wait below
        calls = self._engine_placed(run) if run.engine else []
        if calls:
            n_pairs = [int(run.jobs[i].local.pair_rows.shape[0]) for _, i in calls]
            todo = sorted({i for _, i in calls} - early.keys())
            t0 = time.perf_counter()
            try:
                done = dict(early)
                if todo:
                    merged, sizes = self._merged(run, todo)
                    done.update(zip(todo, torch.split(self._compute_in_thread(merged), sizes), strict=True))
                outs: list[torch.Tensor] | BaseException = [done[i] for _, i in calls]
            except Exception as exc:  # a bug or a kernel error: reported, the layer fails
                log.exception("local experts failed (layer %d)", layer)
                outs = exc
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._engine_local_done, run, calls, n_pairs, outs,
                                    spent + time.perf_counter() - t0)
        return _Pending(self, run, x, topk_ids, topk_w)

    def _early_share(self, run: _StepRun, works: tuple[RangeWork, ...], max_pairs: float) -> dict[int, torch.Tensor]:
        """While the core places the layer: compute the leading held ranges that it places here for
        sure -- together within ``local_only_pairs`` of the last snapshot, so that no worker could
        finish any of them earlier (earliest finish, ties local) and no trial or probe is due. The
        engine thread does not wait for the placement before it starts computing. Should the
        snapshot be a layer old and one of them go remote after all, its result here goes unused
        (the kernel is batch-invariant: the bits are the same either way). Keyed by job index."""
        prefix, total = [], 0
        for i, w in enumerate(works):
            total += w.pairs
            if not w.held or total > max_pairs:
                break
            prefix.append(i)
        if not prefix:
            return {}
        merged, sizes = self._merged(run, prefix)
        try:
            return dict(zip(prefix, torch.split(self._compute_in_thread(merged), sizes), strict=True))
        except Exception:  # computed again below with the placed calls (and reported there, if it fails again)
            log.exception("local experts failed (layer %d, before placement)", run.layer)
            return {}

    def _engine_placed(self, run: _StepRun) -> list[tuple[CallId, int]]:
        """The engine thread's wait for the core's placement of ``run`` (failing once dispatch stops)."""
        while True:
            try:
                return run.placed.get(timeout=0.5)
            except queue.Empty:
                if self._token is None:
                    raise DispatchFailed("the dispatcher stopped") from None

    def _begin_engine_step(self, run: _StepRun, works: tuple[RangeWork, ...], expert_pairs: tuple[int, ...]) -> None:
        """Trio side of ``moe_begin``: the core places the ranges; those placed here go back to the
        engine thread (any later local work -- a hedge -- runs on the worker thread as usual)."""
        run.step = StepId(next(self._step_ids))
        self._steps[run.step] = run
        run.capture = [] if run.engine else None
        try:
            self._post(LayerReady(run.step, run.layer, works, expert_pairs))
        except Exception as exc:  # a callback of the loop must not raise: the layer fails instead
            self._engine_step_broke(run, exc)
        finally:
            if run.engine:
                calls, run.capture = run.capture or [], None
                for call, _ in calls:  # a Cancel of one of them pops its scope: its answer is then dropped
                    self._calls[call] = trio.CancelScope()
                run.placed.put(calls)

    def _engine_local_done(self, run: _StepRun, calls: list[tuple[CallId, int]], n_pairs: list[int],
                           outs: list[torch.Tensor] | BaseException, seconds: float) -> None:
        total = max(1, sum(n_pairs))
        try:
            for k, ((call, _), n) in enumerate(zip(calls, n_pairs, strict=True)):
                sc = self._calls.get(call)
                if sc is None or sc.cancel_called:
                    continue
                del self._calls[call]
                if isinstance(outs, BaseException):
                    self._post(LocalFailed(call, f"{type(outs).__name__}: {outs}"))
                    continue
                y = outs[k]
                run.results[call] = y
                if call in self._keep:
                    self._kept[call] = y
                self._post(LocalDone(call, seconds * n / total))
        except Exception as exc:
            self._engine_step_broke(run, exc)

    def _engine_step_broke(self, run: _StepRun, exc: Exception) -> None:
        log.exception("dispatch of layer %d failed", run.layer, exc_info=exc)
        run.error = f"{type(exc).__name__}: {exc}"
        run.ended.set()

    def _end_engine_step(self, step: StepId) -> None:
        self._steps.pop(step, None)

    def _engine_result(self, run: _StepRun, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        while not run.ended.wait(0.5):
            if self._token is None:
                raise DispatchFailed("the dispatcher stopped")
        token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._end_engine_step, run.step)
        if run.error:
            raise DispatchFailed(run.error)
        if run.fail is not None:
            if run.fail.reason in _MISSING and token is not None:  # wait for coverage the usual way
                return trio.from_thread.run(self.dispatch_layer, run.layer, x, topk_ids, topk_w, trio_token=token)
            raise DispatchFailed(run.fail.message)
        assert run.combine is not None
        return self._combine(int(topk_ids.shape[0]), run.jobs, (run.results[c] for c in run.combine.calls))

    # -- NAT path migration ---------------------------------------------------------------------------
    @functools.cached_property
    def _our_kernel_id(self) -> str:
        """The kernel id our Hello announces and verification compares with (computed once)."""
        return kernel_id(self.kernel) if self.kernel is not None else kernel_id()

    def _client(self, peer: str) -> ExpertClient:
        c = self._clients.get(peer)
        if c is None:
            assert self._nursery is not None and self.transport is not None
            c = ExpertClient(
                self.transport,
                peer,
                self._addrs.get(peer, []),
                self._nursery,
                kernel_id=self._our_kernel_id,
            )
            self._clients[peer] = c
        return c

    def _note_session(self, peer: str, call_started: float) -> None:
        """Remember when the client's current stream opened: no later than the call that opened it."""
        c = self._clients.get(peer)
        if c is None:
            return
        key = (id(c), c.sessions_opened)
        if self._sessions_seen.get(peer) != key:
            self._sessions_seen[peer] = key
            self._session_opened[peer] = call_started

    def _upgraded_at(self, peer: str) -> float | None:
        nat = getattr(self.transport, "nat", None)
        return nat.upgraded_at.get(peer) if isinstance(nat, Nat) else None

    async def _watch_paths(self, interval_s: float = 1.0) -> None:
        """Move expert streams off relays once a direct connection to their worker exists (woken by
        the NAT layer's change event; ``interval_s`` bounds the wait for changes it does not see)."""
        while True:
            changed = getattr(getattr(self.transport, "nat", None), "changed", None)
            with trio.move_on_after(interval_s):
                if isinstance(changed, trio.Event):
                    await changed.wait()
                else:
                    await trio.sleep_forever()
            if self.transport is None:
                continue
            for peer, opened_at in list(self._session_opened.items()):
                if should_migrate(opened_at=opened_at, upgraded_at=self._upgraded_at(peer)):
                    old = self._clients.pop(peer, None)
                    self._sessions_seen.pop(peer, None)
                    del self._session_opened[peer]
                    log.info(
                        "worker %s: moving its expert stream from the relay to the %s connection",
                        peer,
                        self.transport.path_to(peer),
                    )
                    if old is not None and self._nursery is not None:
                        self._nursery.start_soon(self._close_later, old)

    async def _close_later(self, client: ExpertClient) -> None:
        await trio.sleep(self.timeout_s)  # calls in flight on the old stream finish first
        await client.aclose()

    # -- reporting ------------------------------------------------------------------------------------
    def _peer_kernel_id(self, peer: str) -> str:
        c = self._clients.get(peer)
        hello = c.peer_hello if c is not None else None
        return hello.kernel_id if hello is not None else ""

    def _path(self, peer: str) -> ConnPath | None:
        """The path of the worker's expert stream, else of its connection; None if not connected."""
        if self.transport is None:
            return None
        best = self.transport.path_to(peer)
        return session_path(
            ConnPath(best) if best else None,
            opened_at=self._session_opened.get(peer),
            upgraded_at=self._upgraded_at(peer),
        )

    def report(self) -> DispatchReport:
        """``/dispatch``: the map followed, every worker's health and path, rows per layer, the load
        state, decisions by reason and the last failures (trio side)."""
        now = self._now()
        core = self.core
        c = self.config
        m = self.map
        s = core.sample
        book = self.holdings
        return DispatchReport(
            model_id=self.model.model_id,
            map_version=m.version if m is not None else None,
            maps_rejected=self.maps_rejected,
            map_error=self.map_error,
            policy=c.mode.value,
            timeout_s=self.timeout_s,
            wire_dtype=str(self.wire_dtype),
            kernel_id=kernel_id(self.kernel) if self.kernel is not None else "",
            workers=[
                WorkerReport(
                    **v.__dict__,
                    addrs=self._addrs.get(v.peer_id, []),
                    path=self._path(v.peer_id),
                    relayed_bytes=self.transport.relayed_bytes(v.peer_id, PROTOCOL_ID)
                    if self.transport is not None
                    else 0,
                    kernel_id=self._peer_kernel_id(v.peer_id),
                    holdings_proven=len(book.proven(v.peer_id)) if book is not None else None,
                    holdings_pending=book.pending(v.peer_id) if book is not None else None,
                )
                for v in core.table.views(now)
            ],
            layers=[
                LayerRows(
                    layer=i,
                    local_rows=r.local_rows,
                    remote_rows=r.remote_rows,
                    fallback_rows=r.fallback_rows,
                    verified_rows=r.verified_rows,
                )
                for i, r in enumerate(core.rows)
            ],
            mode=c.mode.value,
            load_state=core.load_state(now).value,
            busy=s.busy if s is not None else None,
            n_slots=s.n_slots if s is not None else None,
            load_sample_age_s=round(now - s.at, 3) if s is not None else None,
            load_samples_failed=core.samples_failed,
            saturation_threshold=c.saturation_threshold,
            serve_ttl_s=c.serve_ttl_s,
            hedge_floor_ms=c.hedge_floor_s * 1000.0,
            hot_experts=c.hot_experts,
            decisions={r.value: n for r, n in sorted(core.decisions.items())},
            errors_total=core.errors_total,
            errors=[
                DispatchErrorReport(
                    at_ms=e.wall_ms,
                    peer=e.peer,
                    layer=e.layer,
                    lo=e.lo,
                    hi=e.hi,
                    attempt=e.attempt,
                    reason=e.kind.value,
                    message=e.message,
                )
                for e in core.errors
            ],
            stale_answers=core.stale_answers,
            mode_changes=list(self._mode_changes),
            split_arm=core.split.arm().value,
            split_checking=core.split.checking,
            split_rate=round(core.split.outcomes[-1].split_rate, 1) if core.split.outcomes else 0.0,
            local_rate=round(core.split.outcomes[-1].local_rate, 1) if core.split.outcomes else 0.0,
            verify_rate=c.verify_rate,
            verify_probation_calls=c.verify_probation_calls,
            verifications=core.verifications,
            verified_equal=core.verified_equal,
            quarantines=core.quarantines,
            hold_challenges=book.challenges if book is not None else 0,
            hold_passes=book.passes if book is not None else 0,
            hold_failures=book.failures if book is not None else 0,
            hold_refutations=book.refutations if book is not None else 0,
            holes=self.holes(now),
            missing_waits=self.missing_waits,
            missing_failed=self.missing_failed,
        )

    def holes(self, now: float) -> int:
        """Ranges of the current partition not held here with no live (and, if checked, proved) replica."""
        m = self.map
        n = 0
        for layer in range(self.cfg.n_moe_layer):
            for r in partition_layer(m.ranges_of(layer) if m is not None else [], self.cfg.n_expert):
                if not self.held(layer, r.lo, r.hi) and not any(
                        self.core.table.is_live(p, now) for p in self._replicas(layer, r)):
                    n += 1
        return n

    def collector(self) -> DispatchCollector:
        return DispatchCollector(self)


class DispatchCollector(Collector):
    """``/metrics``: dispatch decisions by reason, failures, rows by where they ran, the load state."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher

    def collect(self) -> Iterable[Metric]:
        core = self.d.core
        model = self.d.model.model_id
        dec = CounterMetricFamily(
            "moe_swarm_dispatch_decisions", "Dispatch decisions by reason", labels=["model", "reason"]
        )
        for r, n in sorted(core.decisions.items()):
            dec.add_metric([model, r.value], n)
        yield dec
        err = CounterMetricFamily(
            "moe_swarm_dispatch_errors", "Failed expert calls by reason", labels=["model", "reason"]
        )
        for k, n in sorted(core.errors_by_kind.items()):
            err.add_metric([model, k.value], n)
        yield err
        rows = CounterMetricFamily(
            "moe_swarm_dispatch_rows", "Expert rows by where they were computed", labels=["model", "where"]
        )
        rows.add_metric([model, "local"], sum(r.local_rows for r in core.rows))
        rows.add_metric([model, "remote"], sum(r.remote_rows for r in core.rows))
        rows.add_metric([model, "fallback"], sum(r.fallback_rows for r in core.rows))
        rows.add_metric([model, "verified"], sum(r.verified_rows for r in core.rows))
        yield rows
        ver = CounterMetricFamily(
            "moe_swarm_dispatch_verifications", "Remote answers compared with the coordinator's", labels=["model", "outcome"]
        )
        ver.add_metric([model, "equal"], core.verified_equal)
        ver.add_metric([model, "quarantined"], core.quarantines)
        yield ver
        state = GaugeMetricFamily(
            "moe_swarm_dispatch_loaded",
            "1 while dispatch treats the coordinator as loaded",
            labels=["model", "state"],
        )
        state.add_metric([model, core.load_state(self.d._now()).value], 1.0)
        yield state
        split = GaugeMetricFamily("moe_swarm_dispatch_split_arm",
                                  "1 for the split check's arm in force (split: earliest finish; local: all held here)",
                                  labels=["model", "arm"])
        split.add_metric([model, core.split.arm().value], 1.0)
        yield split
        now = self.d._now()
        holes = GaugeMetricFamily("moe_swarm_dispatch_holes",
                                  "Ranges not held here that no live volunteer serves now", labels=["model"])
        holes.add_metric([model], self.d.holes(now))
        yield holes
        book = self.d.holdings
        hold = CounterMetricFamily("moe_swarm_dispatch_hold_challenges", "Hold challenges by outcome",
                                   labels=["model", "outcome"])
        for outcome, n in (("passed", book.passes if book else 0), ("failed", book.failures if book else 0),
                           ("refuted", book.refutations if book else 0)):
            hold.add_metric([model, outcome], n)
        yield hold
        cross = CounterMetricFamily("moe_swarm_dispatch_cross_checks",
                                    "Second-replica checks of experts not held here, by outcome", labels=["model", "outcome"])
        cross.add_metric([model, "compared"], core.cross_checks)
        cross.add_metric([model, "disputed"], core.disputes)
        cross.add_metric([model, "unverifiable"], core.unverifiable)
        yield cross
        missing = CounterMetricFamily("moe_swarm_dispatch_missing", "Layers that waited for experts nobody served",
                                      labels=["model", "outcome"])
        missing.add_metric([model, "waited"], self.d.missing_waits)
        missing.add_metric([model, "failed"], self.d.missing_failed)
        yield missing
        lat = HistogramMetricFamily("moe_swarm_dispatch_remote_latency_seconds",
                                    "Latency of answered remote expert calls", labels=["model"])
        lat.add_metric([model], self.d.latency_hist.buckets(), sum_value=self.d.latency_hist.total)
        yield lat


async def watch_dispatch_map_file(
    path: Path,
    dispatcher: Dispatcher,
    *,
    interval_s: float = 0.25,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Follow ``--dispatch-map FILE``: re-read and adopt it whenever its contents change."""
    last: bytes | None = None
    first = True
    while True:
        try:
            data = await trio.Path(path).read_bytes()
        except OSError as exc:
            if first:
                raise ConfigError(f"cannot read dispatch map {path}: {exc}") from exc
            data = last or b""
        if data != last:
            last = data
            try:
                m = decode_dispatch_map(data)
                if not dispatcher.set_map(m):
                    log.warning("ignoring %s: version %d is older than the current map", path, m.version)
            except SwarmError as exc:
                if first:
                    raise
                dispatcher.reject_map(f"ignoring the changed dispatch map {path}: {exc}")
        if first:
            first = False
            task_status.started()
        await trio.sleep(interval_s)
