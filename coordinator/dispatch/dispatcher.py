"""Remote experts: the coordinator's dispatcher (shell around ``coordinator.core.dispatch``).

Rules:
- Every decision is the core's (``DispatchCore.handle(event, now)``, ``now`` = the trio clock, read
  from any thread through the run's clock object): where a range runs, hedges, retries, fallbacks,
  deadlines, marking workers down, when a layer is complete. This shell only moves arrays and bytes.
- One path per layer (``coordinator.dispatch.layer``): ``begin`` groups the routed pairs by the
  dispatch map's ranges on the driver's thread, the core places them there, under the lock
  (``self.lock``: the core and the layers' state; never held while computing, sending or waiting),
  and the remote calls go to the trio thread in one hand-off; ``service`` computes the local work
  placed here on the driver's thread; ``result`` waits and combines. The engine thread drives it in
  production (``ExpertBackend``), trio tasks in the virtual-time suite (``dispatch_layer`` with an
  async local runner): the same calls, the same core. At most two thread crossings per remote layer.
- Whole layers here (``whole_layer_here``): while the core would place every held range of a layer
  this size here anyway (``local_only_pairs``: idle, or no worker could finish earlier and no trial
  or probe is due) and the layer is all held, the engine may compute it in its own graph; it reports
  them (``ran_here``, once per step: ``LayerRanLocally`` with its reason and kernel time).
- Not serving (no ``serve`` running): every range is computed locally by the driver, in the same
  partition -- the bits of any other placement.
- A range's partial sum is computed by the same kernel on exactly the rows that have pairs in it,
  locally or on a volunteer; the combine adds per-pair outputs in ascending expert order (DESIGN §3):
  the output does not depend on who won a hedge.
- Load: every ``sample_interval_s`` the ``load_probe`` (busy slots, slots) runs on a worker thread
  under ``sample_timeout_s``; a hung or failed probe is abandoned and reported (``LoadSampleTimeout``).
- Experts nobody serves (``missing_wait_s`` > 0, ``--on-missing wait``): a layer that failed for want
  of a live replica begins again whenever the map changes (or every 0.5 s: a worker's backoff may
  pass) until the deadline; then ``DispatchFailed``.
- Verification, effects and remote calls: ``coordinator.dispatch.executor``; peers, NAT migration
  and hold challenges: ``coordinator.dispatch.peers``; ``/dispatch`` and ``/metrics``:
  ``coordinator.dispatch.report``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np
import trio

from coordinator.core.dispatch import (
    CallId,
    DispatchConfig,
    DispatchCore,
    DispatchMode,
    Effect,
    Event,
    Hedge,
    LayerRanLocally,
    LayerReady,
    LoadSample,
    LoadSampleTimeout,
    LocalDone,
    LocalFailed,
    RangeWork,
    Reason,
    SendRemote,
    StepId,
    WorkersListed,
    WorkerTable,
)
from coordinator.core.holdings import HoldBook, Holding
from coordinator.core.pipeline import GroupArms, PipelineModel
from coordinator.dispatch import report as reports
from coordinator.dispatch.disk import DiskExperts
from coordinator.dispatch.executor import Executor, WireCall
from coordinator.dispatch.lanes import LaneDriver, LaneHub
from coordinator.dispatch.layer import (
    AsyncWaker,
    LayerCall,
    LayerTiming,
    LocalJob,
    RangeJob,
    ThreadWaker,
    Waker,
    job_of,
)
from coordinator.dispatch.peers import PeerHooks, Peers
from swarm.core.histogram import Histogram
from swarm.dispatch_map import DispatchMap, RangeReplicas, partition_layer
from swarm.errors import ConfigError, DispatchFailed, SwarmError
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend, add_in_expert_order, expert_kernel, kernel_id
from swarm.model.kernels.ggml import rest_workers
from swarm.p2p.transport import Transport
from swarm.protocol.coordinator import DispatchReport
from swarm.protocol.expert import (
    FEATURE_LANE,
    SUPPORTED_DTYPES,
    Hello,
    LaneOffer,
    RequestId,
    Status,
    make_pairs,
)
from swarm.rpc.client import ExpertClient

__all__ = ["Dispatcher", "HostedModel", "LoadProbe", "LocalJob", "LocalKernel", "LocalRunner"]

log = logging.getLogger(__name__)

LocalKernel = Callable[[LocalJob], np.ndarray]  # synchronous: the weighted per-pair outputs [pairs, d_model]
LocalRunner = Callable[[LocalJob], Awaitable[np.ndarray]]  # the same from a trio task (the virtual-time suite)
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
        disk_runner: LocalRunner | None = None,
        rng: random.Random | None = None,
        prove_holdings: bool = False,
        missing_wait_s: float = 0.0,
        lanes: LaneHub | None = None,
    ) -> None:
        """``config`` holds the policy (``timeout_s``, if given, overrides its deadline); ``held(layer,
        lo, hi)`` tells the ranges the coordinator holds; ``local_kernel`` computes a range here
        (default: the model's experts with ``kernel``); ``local_runner`` computes it for a trio driver
        (``dispatch_layer``: the virtual-time suite's, which take virtual time); ``load_probe`` gives (busy slots, slots), called
        on a worker thread unless ``probe_in_thread`` is False (tests under a virtual clock).
        ``prove_holdings``: a listed worker gets work for a slice only after it answered a hold
        challenge for it (``coordinator.core.holdings``; needs the GGUF model to check against).
        ``lanes``: data lanes to offer volunteers (``coordinator.dispatch.lanes``): a driver thread's
        calls to a peer with one go on it."""
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
        self.load_probe = load_probe
        self.probe_in_thread = probe_in_thread
        self.held = held
        if local_kernel is None and not isinstance(model, GGUFModel):
            raise ConfigError("a dispatcher without a GGUF model needs a local_kernel")
        self._model_kernel = local_kernel is None
        self.local_kernel: LocalKernel = local_kernel if local_kernel is not None else self._kernel_of_model
        self.local_runner = local_runner
        if prove_holdings and not isinstance(model, GGUFModel):
            raise ConfigError("hold challenges are checked against a GGUF model")
        self.holdings: HoldBook | None = HoldBook() if prove_holdings else None
        # the verification samples: seeded from the OS unless a test hands in its own generator
        self.core = DispatchCore(cfg, n_layer=self.cfg.n_moe_layer, n_expert=self.cfg.n_expert,
                                 rng=rng if rng is not None else random.Random(secrets.randbits(64)))
        self.lock = threading.Lock()
        self.peers = Peers(transport, kernel_id=self.our_kernel_id, timeout_s=self.timeout_s, hole_punch=hole_punch,
                           model=model, holdings=self.holdings)
        self.executor = Executor(peers=self.peers, model_id=model.model_id, d_model=self.cfg.d_model,
                                 n_expert=self.cfg.n_expert,
                                 wire_dtype=wire_dtype, timeout_s=self.timeout_s, our_kernel=self.our_kernel_id,
                                 handle=self._handle, lock=self.lock)
        self.executor.state_of = lambda: self.core.state.value
        self.executor.now = self._now
        # disk checks of ranges not held here (DESIGN §12): the GGUF read with pread, on a worker thread;
        # a fake model's tests hand in a runner of their own (virtual time)
        self.disk: DiskExperts | None = None
        if disk_runner is not None:
            self.executor.disk_runner = disk_runner
        elif isinstance(model, GGUFModel) and (cfg.verify_disk_rate > 0 or cfg.missing_disk):
            self.disk = DiskExperts(model, self.kernel)
            self.executor.disk_kernel = self.disk.pair_outputs
        self.lanes = lanes
        self.lane_driver = LaneDriver(lanes, self.executor, self._handle, self._now,
                                      our_dtypes=SUPPORTED_DTYPES) if lanes is not None else None
        self.on_hold_proven: list[Callable[[Holding], None]] = []
        self.map: DispatchMap | None = None
        self._step_ids = itertools.count(1)
        self._token: trio.lowlevel.TrioToken | None = None
        self._clock: trio.abc.Clock | None = None
        self._last_now = 0.0
        # read by the driver without the lock (one tuple, replaced whole: atomic)
        self._engine_local: tuple[float, Reason] = self.core.local_only_pairs(0.0)
        self._not_held = False  # the map lists a range this coordinator does not hold
        self._ran_here: list[Event] = []  # engine thread only: whole layers not yet reported
        self.missing_wait_s = missing_wait_s
        self.timings: deque[LayerTiming] = deque(maxlen=256)  # the last remote layers' stages (/dispatch)
        self.pipeline = PipelineModel()  # the session groups' costs, learnt from the remote layers
        self.group_arms = GroupArms()  # ... and its pick checked against measured steps
        self._layer_end: float | None = None  # when the last layer's output was combined (perf_counter)
        self._map_changed = threading.Event()  # for a driver thread
        self._map_event = trio.Event()  # for a trio driver (replaced at each change)
        self.missing_waits = 0  # layers that waited for coverage
        self.missing_failed = 0  # ... and still found none
        self._lane_offer_ids = itertools.count(1 << 61)  # apart from the core's request ids and hold challenges
        self.maps_rejected = 0  # map files or market maps that could not be adopted
        self.map_error = ""  # why the last one was not

    # -- compatibility views --------------------------------------------------------------------------
    @property
    def table(self) -> WorkerTable:
        return self.core.table

    @property
    def on_quarantine(self) -> list[Callable[..., None]]:
        return self.executor.on_quarantine

    @property
    def latency_hist(self) -> Histogram:
        return self.executor.latency_hist

    @functools.cached_property
    def our_kernel_id(self) -> str:
        """The kernel id our Hello announces and verification compares with (computed once)."""
        return kernel_id(self.kernel) if self.kernel is not None else kernel_id()

    def reject_map(self, reason: str) -> None:
        """A map from the file or the market was not adopted: count it, keep the reason for /dispatch."""
        self.maps_rejected += 1
        self.map_error = reason
        log.error("%s", reason)

    # -- trio side --------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        hooks = PeerHooks(quarantined=lambda p: p in self.core.table.quarantined,
                          refuted=lambda ev: self._handle([ev], True),
                          proven=self._hold_proven)
        async with trio.open_nursery() as nursery, self.peers.open(nursery, hooks):
            await nursery.start(self.executor.run, nursery)
            if self.load_probe is not None:
                nursery.start_soon(self._sample_load, self.load_probe)
            if self.lanes is not None:
                await nursery.start(self.lanes.serve)
                nursery.start_soon(self._offer_lanes, self.lanes)
            self._clock = trio.lowlevel.current_clock()
            self._token = trio.lowlevel.current_trio_token()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._token = None
                with self.lock:  # layers in flight end: their drivers must not wait for the trio side
                    self._fail_all("the dispatcher stopped")
                nursery.cancel_scope.cancel()

    async def _offer_lanes(self, hub: LaneHub, interval_s: float = 0.5) -> None:
        """Offer a data lane to every listed worker whose stream's Hello says it dials one and that
        has none (``LaneHub.offer`` spaces a peer's offers by its ``retry_s``)."""
        offering: set[str] = set()

        async def one(peer: str, client: ExpertClient, hello: Hello) -> None:
            try:
                got = hub.offer(peer, hello, trio.current_time())
                if got is None:
                    return
                lane_id, secret, host, port = got
                offer = LaneOffer(request_id=RequestId(next(self._lane_offer_ids)), attempt=0, lane_id=lane_id,
                                  secret=secret, host=host, port=port)
                try:
                    ans = await client.offer_lane(offer, timeout=hub.handshake_timeout_s * 2)
                except SwarmError as exc:
                    log.info("lane offer to %s failed: %s", peer, exc.message)
                    return
                if ans.status != Status.OK:
                    log.info("%s declined a data lane: %s (%s)", peer, ans.message, ans.status)
            finally:
                offering.discard(peer)

        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                for peer, client in list(self.peers.clients.items()):
                    hello = client.peer_hello
                    if (hello is None or FEATURE_LANE not in hello.features or peer in offering
                            or peer in self.core.table.quarantined or not hub.wants_offer(peer, now)):
                        continue
                    offering.add(peer)
                    nursery.start_soon(one, peer, client, hello)
                await trio.sleep(interval_s)

    def _hold_proven(self, h: Holding) -> None:
        for hook in self.on_hold_proven:
            hook(h)

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
        before = set(self.core.table.workers)
        self.map = m
        self._not_held = any(not self.held(lr.layer, r.lo, r.hi) for lr in m.layers for r in lr.ranges)
        added, removed = self.peers.adopt(m, before, self._now())
        if self.lanes is not None:
            for p in removed:
                self.lanes.drop(p, "no longer in the dispatch map")
        nets = {rep.peer_id: rep.net for lr in m.layers for r in lr.ranges for rep in r.replicas if rep.net}
        self._handle([WorkersListed(frozenset(m.peers()), tuple(sorted(nets.items())))], self._on_trio())
        self._map_changed.set()
        self._map_event.set()
        self._map_event = trio.Event()
        log.info("dispatch map v%d: %d workers (+%d -%d)", m.version, len(m.peers()), len(added), len(removed))
        return True

    def _on_trio(self) -> bool:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            return False
        return True

    def _now(self) -> float:
        """The trio clock (the core's only clock), from any thread; before serving, the last time seen."""
        clock = self._clock
        if clock is not None:
            self._last_now = clock.current_time()
        else:
            with contextlib.suppress(RuntimeError):
                self._last_now = trio.current_time()
        return self._last_now

    # -- events in, effects out ---------------------------------------------------------------------
    def _handle(self, events: list[Event], on_trio: bool) -> None:
        """Hand ``events`` to the core (under the lock) and execute its effects: bookkeeping at once,
        comparisons and logs here, the rest on the trio thread (handed over in one batch from a driver)."""
        todo = events
        while todo:
            with self.lock:
                now = self._now()
                try:
                    effects = [e for ev in todo for e in self.core.handle(ev, now)]
                except Exception as exc:  # a bug in the core: the layers in flight fail, dispatch goes on
                    log.exception("dispatch core failed on %s", type(todo[0]).__name__)
                    self._fail_all(f"{type(exc).__name__}: {exc}")
                    return
                placed_at = time.perf_counter()
                for ev in todo:
                    if isinstance(ev, LayerReady) and (c := self.executor.calls.get(ev.step)) is not None:
                        c.timing.placed = placed_at
                split = self.executor.split(effects)
                self._engine_local = self.core.local_only_pairs(now)
                wires = None
                if split.trio and not on_trio:
                    sends = [e for e in split.trio if isinstance(e, SendRemote | Hedge) and e.peer is not None]
                    calls = dict(self.executor.calls)
                if split.rearm and not on_trio:
                    self.executor.off_trio_timers = True
            todo = self.executor.run_inline(split.inline) if split.inline else []
            if on_trio and split.rearm:
                self.executor.rearm()
            if split.trio:
                if on_trio:
                    todo += self.executor.run_trio(split.trio)
                else:
                    wires = self.executor.wires_for(sends, calls)  # encoded here, off the trio thread
                    effects_trio, todo_lanes = self._on_lanes(split.trio, wires)
                    todo += todo_lanes
                    if effects_trio:
                        now_pc = time.perf_counter()
                        for c in {id(w.call): w.call for w in wires if w.call is not None}.values():
                            c.timing.handed = c.timing.handed or now_pc
                            c.timing.crossings += 1
                        self._to_trio(effects_trio, wires)

    def _on_lanes(self, effects: list[Effect], wires: list[WireCall]) -> tuple[list[Effect], list[Event]]:
        """(A driver's thread) the wire calls to peers with a live data lane sent on it; ``wires`` keeps
        the others. Returns the effects still for the trio thread and the events of failed sends.

        Only calls whose answers the layer waits for go on a lane (the driver reads a lane while it
        waits): a call kept for a comparison (a probe, a verification, a disk check: the layer's result
        is the copy computed here) goes on the stream, whose answers the trio thread reads whenever
        they come."""
        d = self.lane_driver
        if d is None or not wires:
            return effects, []
        events: list[Event] = []
        sent: set[CallId] = set()
        keep = self.executor.keep
        for w in list(wires):
            lane = d.lane_for(w.peer)
            if lane is None or any(c in keep for c in w.calls):
                continue
            wires.remove(w)
            sent.update(w.calls)
            now_pc = time.perf_counter()
            if w.call is not None:
                w.call.timing.handed = w.call.timing.handed or now_pc
            events += d.send(lane, w)
        if not sent:
            return effects, events
        return [e for e in effects if not (isinstance(e, SendRemote | Hedge) and e.call in sent)], events

    def _to_trio(self, effects: list[Effect], wires: list[WireCall]) -> None:
        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(self._trio_effects, effects, wires)
        except trio.RunFinishedError:
            pass

    def _trio_effects(self, effects: list[Effect], wires: list[WireCall]) -> None:
        try:
            for c in wires:
                if c.call is not None and not c.call.timing.sent:
                    c.call.timing.sent = time.perf_counter()
            evs = self.executor.run_trio(effects, wires)
            if evs:
                self._handle(evs, True)
        except Exception as exc:  # a callback of the loop must not raise: the layers in flight fail instead
            log.exception("dispatch effects failed")
            with self.lock:
                self._fail_all(f"{type(exc).__name__}: {exc}")

    def _fail_all(self, error: str) -> None:
        """Under the lock: every layer in flight ends with ``error`` (a bug on the dispatch side)."""
        for call in list(self.executor.calls.values()):
            call.end(error=error)
        self.executor.calls.clear()

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
            self._handle([ev], True)
            await trio.sleep(c.sample_interval_s)

    # -- one layer: begin ------------------------------------------------------------------------------
    def _ranges(self, layer: int) -> list[RangeReplicas]:
        m = self.map
        return partition_layer(m.ranges_of(layer) if m is not None else [], self.cfg.n_expert)

    def _replicas(self, layer: int, r: RangeReplicas) -> tuple[str, ...]:
        """A range's replicas that may get work: listed, and (``prove_holdings``) proved to hold it."""
        if self.transport is None:
            return ()
        book = self.holdings
        return tuple(rep.peer_id for rep in r.replicas if book is None or book.held(rep.peer_id, layer, r.lo, r.hi))

    def _jobs(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> list[RangeJob]:
        n_tok, k = ids.shape
        all_e = ids.reshape(-1)
        all_w = w.reshape(-1).astype(np.float32, copy=False)
        all_rows = np.repeat(np.arange(n_tok, dtype=np.int64), k)
        jobs: list[RangeJob] = []
        for r in self._ranges(layer):
            sel = (all_e >= r.lo) & (all_e < r.hi)
            if not sel.any():
                continue
            pr = all_rows[sel]
            rows = np.unique(pr)
            pairs = make_pairs(np.searchsorted(rows, pr), all_e[sel] - r.lo, all_w[sel])
            jobs.append(RangeJob(r.lo, r.hi, self._replicas(layer, r), self.held(layer, r.lo, r.hi), rows,
                                 np.ascontiguousarray(x[rows]), pairs))
        return jobs

    def _expert_pairs(self, ids: np.ndarray) -> tuple[int, ...]:
        """Routed pairs per expert (for the hot-expert cache; empty without it)."""
        if self.config.hot_experts <= 0:
            return ()
        return tuple(int(n) for n in np.bincount(ids.reshape(-1), minlength=self.cfg.n_expert))

    def begin(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, *, waker: Waker | None = None
              ) -> LayerCall:
        """Start one MoE layer (any thread; see the module rules): its placement is known when this
        returns, its local work is the call's ``work``, its remote calls are on their way."""
        t0 = time.perf_counter()
        if self._token is not None:  # serving: the layer waits on others (volunteers, the network thread),
            rest_workers()  # which need the cores the engine's ggml workers would spin on meanwhile
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.asarray(ids)
        w = np.asarray(w, dtype=np.float32)
        jobs = self._jobs(layer, x, ids, w)
        if waker is None:
            waker = ThreadWaker.current()
        if isinstance(waker, ThreadWaker):
            waker.source = self.lane_driver  # the driver reads its lanes' answers while it waits
        call = LayerCall(layer, int(ids.shape[0]), jobs, waker, x, ids, w)
        call.timing.begin = t0
        call.timing.grouped = time.perf_counter()
        self._flush_ran_here()
        if self._token is None:  # not serving: every range here, in the same partition
            call.work = [(CallId(-1 - i), i) for i in range(len(jobs))]
            call.timing.placed = time.perf_counter()
            if not jobs:
                call.end(winners=())
            return call
        works = tuple(RangeWork(j.lo, j.hi, j.n_rows, j.n_pairs, j.replicas, j.held) for j in jobs)
        step = StepId(next(self._step_ids))
        call.step = step
        with self.lock:
            self.executor.calls[step] = call
        self._handle([LayerReady(step, layer, works, self._expert_pairs(ids))], self._on_trio())
        call.timing.placed = call.timing.placed or time.perf_counter()
        return call

    # -- one layer: local work, result (the driver's thread) ---------------------------------------------
    def _job_of(self, call: LayerCall, indices: list[int]) -> LocalJob:
        return job_of(call, indices, self.cfg.n_expert)

    def _kernel_of_model(self, job: LocalJob) -> np.ndarray:
        assert isinstance(self.model, GGUFModel)
        stack = self.model.expert_stack(job.layer, job.lo, job.hi)
        k = expert_kernel(stack, self.kernel) if self.kernel is not None else expert_kernel(stack)
        return k.pair_outputs_np(job.x, job.pair_rows, job.pair_experts, job.pair_weights)

    def _take(self, call: LayerCall) -> tuple[list[tuple[CallId, int]], bool]:
        with self.lock:
            work, call.work = call.work, []
            return work, call.ended

    def _whole(self, call: LayerCall, work: list[tuple[CallId, int]]) -> bool:
        """Is ``work`` the whole layer, every pair, computed by the model's kernel (one graph then)?"""
        with self.lock:  # a kept call (a verification's copy) must have its per-pair outputs
            kept = any(cid in self.executor.keep for cid, _ in work)
        return (self._model_kernel and not kept and not call.results and len(work) == len(call.jobs)
                and sorted(i for _, i in work) == list(range(len(call.jobs))) and bool(call.jobs))

    def _report_local(self, call: LayerCall, work: list[tuple[CallId, int]], outs: list[np.ndarray] | BaseException,
                      seconds: float) -> None:
        call.timing.local_s += seconds
        if self._token is None or work[0][0] < 0:  # not serving: the driver ends the call itself
            with self.lock:
                if isinstance(outs, BaseException):
                    call.end(error=f"local experts failed: {type(outs).__name__}: {outs}")
                    return
                for (cid, _), y in zip(work, outs, strict=True):
                    call.results[cid] = y
                if len(call.results) == len(call.jobs):
                    call.end(winners=tuple(CallId(-1 - i) for i in range(len(call.jobs))))
            return
        n_pairs = [call.jobs[i].n_pairs for _, i in work]
        total = max(1, sum(n_pairs))
        events: list[Event] = []
        with self.lock:
            for k, ((cid, _), n) in enumerate(zip(work, n_pairs, strict=True)):
                if isinstance(outs, BaseException):
                    if cid in self.executor.local_calls:
                        self.executor.local_calls.discard(cid)
                        events.append(LocalFailed(cid, f"{type(outs).__name__}: {outs}"))
                    continue
                if self.executor.local_result(call, cid, outs[k]):
                    events.append(LocalDone(cid, seconds * n / total))
        if events:
            self._handle(events, self._on_trio())

    def service(self, call: LayerCall) -> bool:
        """Compute the call's pending local work on this thread (one kernel call for all of it) and
        report it; True once the layer has ended (``result`` then returns at once)."""
        work, ended = self._take(call)
        if work:
            t0 = time.perf_counter()
            try:
                if self._whole(call, work):
                    call.whole = self._combined(call)
                    outs: list[np.ndarray] | BaseException = [np.empty(0, np.float32)] * len(work)
                else:
                    y = self.local_kernel(self._job_of(call, [i for _, i in work]))
                    outs = np.split(y, np.cumsum([call.jobs[i].n_pairs for _, i in work])[:-1])
            except Exception as exc:  # a bug or a kernel error: reported, the layer fails
                log.exception("local experts failed (layer %d)", call.layer)
                outs = exc
            self._report_local(call, work, outs, time.perf_counter() - t0)
            with self.lock:
                ended = call.ended and not call.work
        return ended

    def _combined(self, call: LayerCall) -> np.ndarray:
        assert isinstance(self.model, GGUFModel)
        stack = self.model.expert_stack(call.layer)
        k = expert_kernel(stack, self.kernel) if self.kernel is not None else expert_kernel(stack)
        return k.combined_np(call.x, call.ids, call.w)

    def output(self, call: LayerCall) -> np.ndarray:
        """The ended layer's MoE output ``[n_tok, d_model]``; ``DispatchFailed`` if it failed."""
        t = call.timing
        t.woken = time.perf_counter()
        if call.error:
            raise DispatchFailed(call.error)
        if call.fail is not None:
            raise DispatchFailed(call.fail.message)
        assert call.winners is not None
        local_winners = call.winners and all(c < 0 or c in call.results for c in call.winners)
        if call.whole is not None and local_winners and not any(len(call.results[c]) for c in call.winners):
            out = call.whole
        elif len(call.winners) == 1 and call.winners[0] in call.summed:  # the layer's one range, summed remotely
            out = np.zeros((call.n_tok, self.cfg.d_model), dtype=np.float32)
            out[call.jobs[0].rows] = call.results[call.winners[0]]
        else:
            out = self._combine(call)
        t.combined = self._layer_end = time.perf_counter()
        if t.calls:
            self.timings.append(t)
            if t.handed and t.answered:  # what the session groups are chosen by
                self.pipeline.sample(call.n_tok, t.dense_s, t.volunteer_s,
                                     (t.woken - t.placed) - t.volunteer_s)
        return out

    def _combine(self, call: LayerCall) -> np.ndarray:
        """Per row, the pairs added in ascending expert order (``add_in_expert_order``), whoever
        computed them and however the layer was cut."""
        acc = np.zeros((call.n_tok, self.cfg.d_model), dtype=np.float32)
        assert call.winners is not None
        if not call.jobs:
            return acc
        ys = [call.results[c] for c in call.winners]
        for j, y in zip(call.jobs, ys, strict=True):
            if y.shape != (j.n_pairs, self.cfg.d_model):
                raise DispatchFailed(f"range {j.lo}-{j.hi}: {y.shape} outputs for {j.n_pairs} pairs")
        rows = np.concatenate([j.rows[j.pairs.rows] for j in call.jobs])
        exps = np.concatenate([j.pairs.experts.astype(np.int64) + j.lo for j in call.jobs])
        y = ys[0] if len(ys) == 1 else np.concatenate(ys)
        return add_in_expert_order(acc, rows, exps, y, error=DispatchFailed)

    def result(self, call: LayerCall) -> np.ndarray:
        """Wait for the layer (computing any local work that arrives meanwhile) and combine it; a layer
        that failed for want of experts nobody serves begins again while ``missing_wait_s`` lasts."""
        deadline: float | None = None
        while True:
            waker = call.waker
            assert isinstance(waker, ThreadWaker)
            while not self.service(call):
                if not waker.wait(1.0) and self._token is None and not call.ended:
                    with self.lock:
                        call.end(error="the dispatcher stopped")
            if not (call.fail is not None and call.missing):
                return self.output(call)
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.missing_wait_s
                if self.missing_wait_s > 0:
                    self.missing_waits += 1
                    log.warning("layer %d waits up to %.0f s for experts nobody serves: %s", call.layer,
                                self.missing_wait_s, call.fail.message)
            if now >= deadline or self._token is None:
                if self.missing_wait_s > 0:
                    self.missing_failed += 1
                return self.output(call)
            self._map_changed.clear()
            self._map_changed.wait(min(0.5, deadline - now))
            call = self.begin(call.layer, call.x, call.ids, call.w, waker=call.waker)

    async def result_async(self, call: LayerCall, runner: LocalRunner | None = None) -> np.ndarray:
        """``result`` for a trio task driving the call (the virtual-time suite): local work through
        ``runner`` (default: the local kernel, on this thread)."""
        deadline: float | None = None
        while True:
            waker = call.waker
            assert isinstance(waker, AsyncWaker)
            while True:
                work, ended = self._take(call)
                if work:
                    t0 = trio.current_time()
                    try:
                        job = self._job_of(call, [i for _, i in work])
                        y = await runner(job) if runner is not None else self.local_kernel(job)
                        outs: list[np.ndarray] | BaseException = np.split(
                            y, np.cumsum([call.jobs[i].n_pairs for _, i in work])[:-1])
                    except Exception as exc:
                        log.exception("local experts failed (layer %d)", call.layer)
                        outs = exc
                    self._report_local(call, work, outs, trio.current_time() - t0)
                    continue
                if ended:
                    break
                await waker.wait()
            if not (call.fail is not None and call.missing):
                return self.output(call)
            now = trio.current_time()
            if deadline is None:
                deadline = now + self.missing_wait_s
                if self.missing_wait_s > 0:
                    self.missing_waits += 1
                    log.warning("layer %d waits up to %.0f s for experts nobody serves: %s", call.layer,
                                self.missing_wait_s, call.fail.message)
            if now >= deadline:
                if self.missing_wait_s > 0:
                    self.missing_failed += 1
                return self.output(call)
            changed = self._map_event
            with trio.move_on_after(min(0.5, deadline - now)):
                await changed.wait()
            call = self.begin(call.layer, call.x, call.ids, call.w, waker=call.waker)

    async def dispatch_layer(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                             runner: LocalRunner | None = None) -> np.ndarray:
        """One MoE layer from a trio task: ``begin`` + ``result_async`` (the production path driven
        under virtual time)."""
        return await self.result_async(self.begin(layer, x, ids, w, waker=AsyncWaker()), runner or self.local_runner)

    def moe(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """One MoE layer from a thread that may block (the engine's, a test's): begin, local work, result."""
        return self.result(self.begin(layer, x, ids, w))

    # -- the engine's view (ExpertBackend) ----------------------------------------------------------------
    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        """May the engine compute this layer whole, its MoE inside its own graph (the bits of any
        partition)? When the core would place it all here anyway -- not serving, or ``n_pairs``
        within its local-only bound -- and every range of the layer is held here (all of them, not
        only the routed: decided before the routing is known); only with the model's own kernel."""
        if not self._model_kernel or self.kernel is KernelBackend.TORCH:
            return False  # a fake or the torch kernel computes local ranges: it must be the one called
        if self._token is None:
            return True
        if n_pairs > self._engine_local[0]:
            return False
        return all(self.held(layer, r.lo, r.hi) for r in self._ranges(layer))

    def ran_here(self, layer: int, ids: np.ndarray, seconds: float) -> None:
        """A layer ``whole_layer_here`` allowed was computed by the engine: the core hears of it as
        placements here (in one hand-off per step)."""
        if self._token is None:
            return
        e = ids.reshape(-1)
        rows = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
        works = []
        for r in self._ranges(layer):
            sel = (e >= r.lo) & (e < r.hi)
            n = int(sel.sum())
            if n:
                works.append(RangeWork(r.lo, r.hi, int(np.unique(rows[sel]).size), n, self._replicas(layer, r), True))
        self._ran_here.append(LayerRanLocally(layer, tuple(works), self._engine_local[1], seconds))
        if layer == self.cfg.n_moe_layer - 1 or len(self._ran_here) >= self.cfg.n_moe_layer:
            self._flush_ran_here()

    def _flush_ran_here(self) -> None:
        if self._ran_here and self._token is not None:
            evs, self._ran_here = self._ran_here, []
            self._handle(evs, self._on_trio())

    def may_go_remote(self, layer: int) -> bool:
        """Could a range of the layer go to a worker now: serving, and a listed replica for it."""
        m = self.map
        return self._token is not None and m is not None and any(r.replicas for r in m.ranges_of(layer))

    def groups(self, n_seqs: int, n_rows: int) -> int:
        """How many groups of sessions the engine advances independently through a step of ``n_seqs``
        sequences and ``n_rows`` rows (1: all together): where the layers wait for remote ranges
        whatever the load (``offload`` mode, or ranges this coordinator does not hold), as many as
        the measured round trip, dense and remote costs make fastest (``coordinator.core.pipeline``)."""
        if self._token is None or n_seqs < 2 or not (self._not_held or self.config.mode is DispatchMode.OFFLOAD):
            return 1
        return self.group_arms.pick(n_seqs, n_rows, self.pipeline.groups(n_seqs, n_rows), time.perf_counter(),
                                    self._layer_end)

    # -- reports -----------------------------------------------------------------------------------------
    def holes(self, now: float) -> int:
        return reports.holes(self, now)

    def report(self) -> DispatchReport:
        return reports.dispatch_report(self)

    def collector(self) -> reports.DispatchCollector:
        return reports.DispatchCollector(self)
