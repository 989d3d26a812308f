"""The dispatch core's effects, executed (shell).

``Executor.split(effects)`` runs under the dispatcher's lock, on whichever thread handled the event
(the driver's or the trio thread), and sorts each effect by where it must run:

- **bookkeeping, at once, under the lock**: local work for a layer (``RunLocal``, a local
  ``Hedge``) goes to the layer's call for its driver; ``Combine`` / ``Fail`` end the call;
  ``Forget`` drops kept answers; a ``Cancel`` of local work not started yet removes it;
- **inline, outside the lock, on the same thread**: comparisons (``Compare``, ``Settle``: numpy on
  the kept answers; they answer with events) and the log lines (``MarkDown``, ``MarkProven``,
  ``ModeChanged``, ``SplitChecked``);
- **the trio thread**: remote calls (``SendRemote``, a remote ``Hedge``), cancelling them
  (``Cancel``), timers, ``Quarantine``'s hooks. A driver hands these over in one batch per handling
  (one thread crossing), with the remote calls already encoded.

Remote calls: the ``SendRemote``s of one handling that go to the same peer for adjacent ranges are
one wire request (``WireCall``; when the peer's Hello offers ``multi_range``): one call per peer per
layer. Its answer is split back into each range's per-pair outputs; a failure fails each range's
call; cancelling one range's call only drops its share (the request is cancelled once all are).

Timers: one heap, kept under the lock by ``split`` (``StartTimer``, ``CancelTimer``: bookkeeping, on
whichever thread); a cancelled timer is skipped when it comes up. They are fired by whoever waits for
them: a trio task (woken when the earliest changes on the trio thread; checking every
``OFF_TRIO_RECHECK_S`` while a driver's timers are in the heap) and a driver's waker, which fires the
due ones between its reads (``due_timers``), so a layer on data lanes needs no trio thread at all.

Remote calls go out on the trio thread (the expert stream: ``run_trio``) or, from a driver, on a data
lane (``coordinator.dispatch.lanes``: ``WireCall.lane``); either way their outcome is ``finish``'s.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from coordinator.core.events import (
    CallId,
    Cancel,
    CancelTimer,
    Combine,
    Compare,
    Compared,
    Effect,
    Event,
    Fail,
    FailureKind,
    Forget,
    Hedge,
    LocalDone,
    LocalFailed,
    MarkDown,
    MarkProven,
    ModeChanged,
    Proof,
    Quarantine,
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
)
from coordinator.dispatch.layer import LayerCall, LocalJob, job_of
from coordinator.dispatch.peers import Peers
from coordinator.dispatch.verify import verify_outputs
from swarm.core.histogram import Histogram
from swarm.errors import (
    BrokenError,
    ClosedError,
    DialError,
    ProtocolError,
    Refused,
    SwarmError,
    TransportTimeout,
)
from swarm.protocol.coordinator import ModeChange
from swarm.protocol.expert import (
    FEATURE_MULTI_RANGE,
    FEATURE_ROW_SUMS,
    ExpertRequest,
    ExpertResponse,
    Pairs,
    RequestId,
    encode_request_payload,
    make_pairs,
)
from swarm.rpc.tensors import rows_to_payload

__all__ = ["LATENCY_BOUNDS", "Executor", "WireCall"]

log = logging.getLogger(__name__)

# remote call latency buckets for /metrics (seconds)
LATENCY_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

_MISSING = frozenset({Reason.NO_REPLICA, Reason.ALL_DOWN, Reason.ALL_FAILED})
OFF_TRIO_RECHECK_S = 0.25  # the trio timer task's longest sleep while timers pushed off its thread are due


def failure_kind(exc: SwarmError) -> FailureKind:
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


def request_sha256(w: WireCall) -> str:
    """sha256 of a wire request's payload as encoded (rows in its dtype, padding, the pair arrays)."""
    h = hashlib.sha256()
    for part in encode_request_payload(w.req, rows_to_payload(w.x, w.req.dtype), w.pairs):
        h.update(part)
    return h.hexdigest()


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass(eq=False)
class WireCall:
    """One wire request: the core calls (one per range, ascending ``lo``) it answers for."""

    peer: str
    layer: int
    calls: list[CallId]
    req: ExpertRequest
    x: np.ndarray
    pairs: Pairs
    spans: list[tuple[int, int]]  # each call's share of the answer: indices into the pairs (merged: a gather)
    gather: list[np.ndarray] | None = None  # merged: each call's pair positions in the request's order
    call: LayerCall | None = None
    dropped: set[CallId] = field(default_factory=set)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    lane: bool = False  # sent on a data lane by a driver (not on the stream by the trio thread)


@dataclass
class _Split:
    trio: list[Effect] = field(default_factory=list)
    inline: list[Effect] = field(default_factory=list)
    rearm: bool = False  # the earliest timer changed: a trio timer task must look again


class Executor:
    def __init__(self, *, peers: Peers, model_id: str, d_model: int, n_expert: int, wire_dtype: str, timeout_s: float,
                 our_kernel: str, handle: Callable[[list[Event], bool], None], lock: threading.Lock) -> None:
        self.lock = lock
        self.n_expert = n_expert
        self.peers = peers
        self.model_id = model_id
        self.d_model = d_model
        self.wire_dtype = wire_dtype
        self.timeout_s = timeout_s
        self.our_kernel = our_kernel
        self._handle = handle  # the dispatcher's: events into the core, on the trio thread (True) or not
        self.calls: dict[StepId, LayerCall] = {}  # layers in flight
        self.keep: set[CallId] = set()  # calls whose answers the core will compare
        self.kept: dict[CallId, np.ndarray] = {}
        self.wires: dict[CallId, WireCall] = {}  # a remote call -> its wire request
        self.inputs: dict[CallId, str] = {}  # a kept remote call -> the sha256 of its request payload (evidence)
        self.local_calls: set[CallId] = set()  # local work handed to a driver, not reported yet
        self.on_quarantine: list[Callable[[Quarantine], None]] = []
        # disk checks (``Reason.VERIFY_DISK``): a kernel on the GGUF file run on a worker thread, one at a
        # time, or (tests under virtual time) an async runner
        self.disk_kernel: Callable[[LocalJob], np.ndarray] | None = None
        self.disk_runner: Callable[[LocalJob], Awaitable[np.ndarray]] | None = None
        self._disk_limiter = trio.CapacityLimiter(1)
        self.disk_checks_done = 0
        self.mode_changes: deque[ModeChange] = deque(maxlen=16)
        self.state_of: Callable[[], str] = lambda: ""
        self.latency_hist = Histogram(LATENCY_BOUNDS)
        self._nursery: trio.Nursery | None = None
        self._timers: list[tuple[float, int, Timer]] = []  # under the lock
        self._timer_live: dict[Timer, int] = {}
        self._timer_seq = 0
        self._timer_wake = trio.Event()
        self.off_trio_timers = False  # a timer was pushed off the trio thread (its task then rechecks)
        self.now: Callable[[], float] | None = None  # the core's clock, from any thread (set by the dispatcher)

    # -- lifetime (trio) ---------------------------------------------------------------------------
    async def run(self, nursery: trio.Nursery, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """The timer task; remote calls run in ``nursery`` (from ``started`` on)."""
        self._nursery = nursery
        task_status.started()
        try:
            while True:
                self._timer_wake = trio.Event()
                now = trio.current_time()
                at = self.next_timer()
                if at is None or (self.off_trio_timers and at > now + OFF_TRIO_RECHECK_S):
                    at = now + (OFF_TRIO_RECHECK_S if self.off_trio_timers else 3600.0)
                with trio.move_on_at(at):
                    await self._timer_wake.wait()
                fired = self.due_timers(trio.current_time())
                if fired:
                    self._handle(fired, True)
        finally:
            self._nursery = None

    def rearm(self) -> None:
        """(Trio thread) the earliest timer changed: the timer task looks again."""
        self._timer_wake.set()

    def next_timer(self) -> float | None:
        with self.lock:
            while self._timers and self._timer_live.get(self._timers[0][2]) != self._timers[0][1]:
                heapq.heappop(self._timers)  # cancelled
            if not self._timers:
                self.off_trio_timers = False
                return None
            return self._timers[0][0]

    def due_timers(self, now: float) -> list[Event]:
        """The timers due at ``now``, taken (each fires once, whoever takes it)."""
        fired: list[Event] = []
        with self.lock:
            while self._timers and self._timers[0][0] <= now:
                _, seq, t = heapq.heappop(self._timers)
                if self._timer_live.get(t) == seq:
                    del self._timer_live[t]
                    fired.append(TimerFired(t))
        return fired

    @property
    def serving(self) -> bool:
        return self._nursery is not None

    # -- sorting effects (under the lock) --------------------------------------------------------------
    def split(self, effects: list[Effect]) -> _Split:
        out = _Split()
        for eff in effects:
            match eff:
                case RunLocal(call=cid, keep=keep, reason=Reason.VERIFY_DISK):  # off the driver's thread
                    if keep:
                        self.keep.add(cid)
                    out.trio.append(eff)
                case RunLocal(call=cid, step=step, index=index, keep=keep):
                    if keep:
                        self.keep.add(cid)
                    self._local_work(step, cid, index)
                case Hedge(call=cid, step=step, index=index, peer=None):
                    self._local_work(step, cid, index)
                case Combine(step=step, calls=calls):
                    call = self.calls.pop(step, None)
                    if call is not None:
                        call.timing.ended = time.perf_counter()
                        call.end(winners=calls)
                case Fail(step=step, reason=reason):
                    call = self.calls.pop(step, None)
                    if call is not None:
                        call.timing.ended = time.perf_counter()
                        call.end(fail=eff, missing=reason in _MISSING)
                case Forget(calls=calls):
                    for c in calls:
                        self.keep.discard(c)
                        self.kept.pop(c, None)
                        self.inputs.pop(c, None)
                case Cancel(call=cid) if cid in self.local_calls:
                    self.local_calls.discard(cid)
                    self._drop_local(cid)
                case Cancel(call=cid) if (wc := self.wires.get(cid)) is not None and wc.lane:
                    wc.dropped.add(cid)  # its answer is dropped when it comes (a lane computes in order)
                    del self.wires[cid]
                case StartTimer(timer=timer, at=at):
                    self._timer_seq += 1
                    self._timer_live[timer] = self._timer_seq
                    heapq.heappush(self._timers, (at, self._timer_seq, timer))
                    if self._timers[0][2] is timer:
                        out.rearm = True
                case CancelTimer(timer=timer):
                    self._timer_live.pop(timer, None)
                case SendRemote(keep=True, call=cid):
                    self.keep.add(cid)
                    out.trio.append(eff)
                case Compare() | Settle() | MarkDown() | MarkProven() | ModeChanged() | SplitChecked():
                    out.inline.append(eff)
                case _:
                    out.trio.append(eff)
        return out

    def _local_work(self, step: StepId, cid: CallId, index: int) -> None:
        call = self.calls.get(step)
        if call is None:  # the layer ended meanwhile: nobody to compute it (the core expects nothing)
            return
        self.local_calls.add(cid)
        call.add_work([(cid, index)])

    def _drop_local(self, cid: CallId) -> None:
        for call in self.calls.values():
            if any(c == cid for c, _ in call.work):
                call.work = [(c, i) for c, i in call.work if c != cid]
                return

    def local_result(self, call: LayerCall, cid: CallId, y: np.ndarray) -> bool:
        """Under the lock: a driver computed ``cid``; False if the core no longer wants it."""
        if cid not in self.local_calls:
            return False
        self.local_calls.discard(cid)
        call.results[cid] = y
        if cid in self.keep:
            self.kept[cid] = y
        return True

    # -- inline effects (outside the lock, any thread) --------------------------------------------------
    def run_inline(self, effects: list[Effect]) -> list[Event]:
        events: list[Event] = []
        for eff in effects:
            match eff:
                case Compare(remote=remote, local=local, peer=peer, peer_b=peer_b, disk=disk):
                    a, b = self.kept.pop(remote, None), self.kept.pop(local, None)
                    self.keep.discard(remote)
                    self.keep.discard(local)
                    proof: Proof | None = None
                    error: float | None = None
                    if a is None or b is None:  # cannot happen: the core asks only once both answered
                        equal, detail = False, "an answer to compare is missing"
                        log.error("verification of %s: %s", peer, detail)
                    else:
                        theirs = self.peers.kernel_of(peer_b) if peer_b is not None else self.our_kernel
                        exact = self.wire_dtype == "float32" and self.peers.kernel_of(peer) == theirs
                        equal, detail, error = verify_outputs(a, b, exact=exact)
                        if peer_b is not None and not equal:  # two replicas disagree: kept until settled here
                            self.kept[remote], self.kept[local] = a, b
                            self.keep.update((remote, local))
                            log.warning("replicas %s and %s disagree on layer %d experts %d-%d (%s): computing it "
                                        "here", peer, peer_b, eff.layer, eff.lo, eff.hi, detail)
                        elif not equal:
                            method = "disk" if disk else "bit_exact" if exact else "tolerance"
                            proof = self._proof(remote, a, b, method)
                    self.inputs.pop(remote, None)
                    events.append(Compared(remote, equal, detail, proof, error))
                case Settle(a=ca, b=cb, local=cl, peer_a=pa, peer_b=pb):
                    ours = self.kept.pop(cl, None)
                    verdicts: list[tuple[bool, str, Proof | None]] = []
                    for call, peer in ((ca, pa), (cb, pb)):
                        theirs_t = self.kept.pop(call, None)
                        if ours is None or theirs_t is None:
                            verdicts.append((True, "an answer to settle with is missing", None))  # no evidence: no quarantine
                            continue
                        exact = self.wire_dtype == "float32" and self.peers.kernel_of(peer) == self.our_kernel
                        eq, det, _ = verify_outputs(theirs_t, ours, exact=exact)
                        verdicts.append((eq, det, None if eq else self._proof(call, theirs_t, ours, "second_replica")))
                        self.inputs.pop(call, None)
                    self.keep.difference_update((ca, cb, cl))
                    (ea, da, pa_), (eb, db, pb_) = verdicts
                    events.append(Settled(ca, ea, eb, da, db, pa_, pb_))
                case MarkDown(peer=peer, kind=kind, message=message, retry_at=retry_at):
                    log.warning("worker %s marked down (%s: %s), retry at +%.1fs", peer, kind.value, message,
                                max(0.0, retry_at - self._now_guess()))
                case MarkProven(peer=peer):
                    log.info("worker %s proven", peer)
                case ModeChanged(state=state, reason=reason):
                    log.info("dispatch: %s (%s)", state.value, reason.value)
                    self.mode_changes.append(ModeChange(at_ms=wall_ms(), state=state.value, reason=reason.value))
                case SplitChecked(outcome=o, reason=reason):
                    windows = " / ".join(f"{r:.0f}" for r in o.local_rates) if o.local_rates else "the rate it beat"
                    detail = (f"{'held split fell behind: ' if o.watched else ''}split {o.split_rate:.0f} vs local "
                              f"{o.local_rate:.0f} ({windows}) routed pairs/s: {o.arm.value} for {o.until - o.at:.0f} s")
                    log.info("dispatch: %s (%s)", reason.value, detail)
                    self.mode_changes.append(ModeChange(at_ms=wall_ms(), state=self.state_of(), reason=reason.value,
                                                        detail=detail))
        return events

    def _proof(self, remote: CallId, theirs: np.ndarray, ours: np.ndarray, method: str) -> Proof:
        """The hashes a quarantine report carries: the call's request payload as sent, the worker's
        outputs and ours (float32, little-endian, the answer's layout)."""
        return Proof(self.inputs.get(remote, hashlib.sha256(b"").hexdigest()),
                     hashlib.sha256(np.ascontiguousarray(theirs, dtype="<f4").tobytes()).hexdigest(),
                     hashlib.sha256(np.ascontiguousarray(ours, dtype="<f4").tobytes()).hexdigest(), method)

    def _now_guess(self) -> float:
        """The core's clock from any thread (the dispatcher's ``now``; the trio clock on its thread)."""
        if self.now is not None:
            return self.now()
        try:
            return trio.current_time()
        except RuntimeError:
            return 0.0

    # -- wire calls (built on the handling thread, outside the lock) -----------------------------------
    def wires_for(self, sends: list[SendRemote | Hedge], calls: dict[StepId, LayerCall]) -> list[WireCall]:
        """The wire requests of one handling's remote calls: adjacent ranges of one layer to the same
        peer (that offers ``multi_range``) merged, each request built once from the call's arrays."""
        groups: list[list[SendRemote | Hedge]] = []
        for s in sends:
            g = groups[-1] if groups else None
            if (g is not None and g[-1].peer == s.peer and g[-1].step == s.step and g[-1].hi == s.lo
                    and isinstance(s, SendRemote) and isinstance(g[-1], SendRemote)
                    and FEATURE_MULTI_RANGE in self.peers.features_of(s.peer or "")):
                g.append(s)
            else:
                groups.append([s])
        out = []
        for g in groups:
            call = calls.get(g[0].step)
            if call is None:
                continue
            out.append(self._wire(g, call))
        return out

    def _wire(self, g: list[SendRemote | Hedge], call: LayerCall) -> WireCall:
        first = g[0]
        assert first.peer is not None
        jobs = [call.jobs[s.index] for s in g]
        if len(g) == 1:
            j = jobs[0]
            x, pairs = j.x, j.pairs
            spans, gather = [(0, j.n_pairs)], None
        else:  # rows of every range, once; pairs re-indexed and in wire order; each range's share remembered
            rows = np.unique(np.concatenate([j.rows for j in jobs]))
            x = np.ascontiguousarray(call.x[rows])
            pr = np.concatenate([np.searchsorted(rows, j.rows[j.pairs.rows]) for j in jobs])
            pe = np.concatenate([j.pairs.experts.astype(np.int64) + (j.lo - first.lo) for j in jobs])
            pw = np.concatenate([j.pairs.weights for j in jobs])
            order = np.lexsort((pe, pr))
            pairs = make_pairs(pr[order], pe[order], pw[order])
            pos = np.empty_like(order)
            pos[order] = np.arange(order.shape[0])
            gather, at = [], 0
            for j in jobs:
                gather.append(pos[at:at + j.n_pairs])
                at += j.n_pairs
            spans = [(0, 0)] * len(g)
        # the request carries every pair of the layer (so of its rows) and its answer is used as it is
        # (not kept for a comparison with per-pair outputs): the volunteer may add them up itself
        summed = (len(g) == len(call.jobs) == 1 and g[0].call not in self.keep
                  and FEATURE_ROW_SUMS in self.peers.features_of(first.peer))
        req = ExpertRequest(request_id=RequestId(first.request_id), attempt=first.attempt, model_id=self.model_id,
                            layer=call.layer, lo=first.lo, hi=g[-1].hi, n_rows=int(x.shape[0]), d_model=self.d_model,
                            n_pairs=len(pairs), dtype=self.wire_dtype, sum_rows=summed)
        return WireCall(first.peer, call.layer, [s.call for s in g], req, x, pairs, spans, gather, call)

    # -- trio effects ------------------------------------------------------------------------------------
    def run_trio(self, effects: list[Effect], wires: list[WireCall] | None = None) -> list[Event]:
        """On the trio thread: start, cancel and time what the effects ask; events raised at once are
        returned (a call that cannot even start fails)."""
        events: list[Event] = []
        sends = [e for e in effects if isinstance(e, SendRemote | Hedge) and e.peer is not None]
        if wires is None:
            wires = self.wires_for(sends, self.calls)
        for w in wires:
            if self._nursery is None or self.peers.transport is None:
                events.extend(RemoteFailed(c, FailureKind.CLOSED, "the dispatcher is not serving") for c in w.calls)
                continue
            self.started(w, lane=False)
            self._nursery.start_soon(self._remote, w)
        started = {c for w in wires for c in w.calls}
        for s in sends:
            if s.call not in started:  # its layer ended before the call could be built
                events.append(RemoteFailed(s.call, FailureKind.CLOSED, "the layer ended"))
        for eff in effects:
            match eff:
                case RunLocal(call=cid, step=step, index=index, reason=Reason.VERIFY_DISK):
                    call = self.calls.get(step)
                    if call is None or self._nursery is None:
                        events.append(LocalFailed(cid, "the layer ended"))
                    else:
                        self._nursery.start_soon(self._disk, call, cid, index)
                case Cancel(call=cid):
                    with self.lock:
                        wc = self.wires.pop(cid, None)
                        if wc is not None:
                            wc.dropped.add(cid)
                    if wc is not None and not wc.lane and all(c in wc.dropped for c in wc.calls):
                        wc.scope.cancel()
                case Quarantine(peer=peer, evidence=evidence):
                    log.error("worker %s quarantined: %s", peer, evidence)
                    for hook in self.on_quarantine:
                        try:
                            hook(eff)
                        except Exception:  # a reporting hook must not stop dispatch
                            log.exception("quarantine hook failed")
        return events

    async def _disk(self, call: LayerCall, cid: CallId, index: int) -> None:
        """A disk check: the range recomputed from the GGUF file (its result is the range's)."""
        ev: Event
        try:
            job = job_of(call, [index], self.n_expert)
            if self.disk_runner is not None:
                y = await self.disk_runner(job)
            elif self.disk_kernel is not None:
                y = await trio.to_thread.run_sync(self.disk_kernel, job, limiter=self._disk_limiter)
            else:
                raise RuntimeError("this dispatcher has no GGUF file to check from")
        except Exception as exc:
            log.exception("disk check of layer %d experts %d-%d failed", call.layer, job.lo, job.hi)
            ev = LocalFailed(cid, f"disk check failed: {type(exc).__name__}: {exc}")
        else:
            with self.lock:
                call.results[cid] = y
                if cid in self.keep:
                    self.kept[cid] = y
            self.disk_checks_done += 1
            ev = LocalDone(cid, 0.0)  # not the engine's local cost
        self._handle([ev], True)

    def started(self, w: WireCall, *, lane: bool) -> None:
        """``w`` is going out (any thread): its calls find it (a ``Cancel``, the answer); a kept call's
        request payload is hashed (what was asked is part of a quarantine's evidence)."""
        w.lane = lane
        with self.lock:
            for c in w.calls:
                self.wires[c] = w
            kept = any(c in self.keep for c in w.calls)
        if kept:
            digest = request_sha256(w)
            with self.lock:
                for c in w.calls:
                    if c in self.keep:
                        self.inputs[c] = digest

    async def _remote(self, w: WireCall) -> None:
        started = trio.current_time()
        outcome: tuple[np.ndarray, ExpertResponse] | SwarmError
        with w.scope:
            try:
                outcome = await self.peers.client(w.peer).call_np(w.req, w.x, w.pairs, timeout=self.timeout_s)
            except SwarmError as exc:
                outcome = exc
            else:
                self.peers.note_session(w.peer, started)
        if w.scope.cancelled_caught:
            with self.lock:
                for c in w.calls:
                    if self.wires.get(c) is w:
                        del self.wires[c]
            return
        evs = self.finish(w, outcome, trio.current_time() - started)
        if evs:
            self._handle(evs, True)

    def finish(self, w: WireCall, outcome: tuple[np.ndarray, ExpertResponse] | SwarmError, latency_s: float
               ) -> list[Event]:
        """A wire call's outcome (any thread; the stream's or a lane's): answers stored for their layer
        and for verification, the core's events returned (none for calls cancelled meanwhile)."""
        results: list[tuple[CallId, np.ndarray]] = []
        if isinstance(outcome, SwarmError):
            msg = f"{type(outcome).__name__}[{outcome.code}]: {outcome.message}"
            log.info("expert call to %s failed (layer %d %d-%d): %s", w.peer, w.layer, w.req.lo, w.req.hi, msg)
            events: list[Event] = [RemoteFailed(c, failure_kind(outcome), msg, wall_ms()) for c in w.calls]
        else:
            y, resp = outcome
            for k, c in enumerate(w.calls):
                results.append((c, y if w.gather is None else y[w.gather[k]]))
            self.latency_hist.observe(latency_s)
            ms = wall_ms()
            events = [RemoteDone(c, ms) for c in w.calls]
            if w.call is not None:
                t = w.call.timing
                t.answered = time.perf_counter()
                t.calls += 1
                t.volunteer_s = max(t.volunteer_s, resp.served_us / 1e6)
                t.compute_s = max(t.compute_s, resp.compute_us / 1e6)
        with self.lock:
            for c in w.calls:
                if self.wires.get(c) is w:
                    del self.wires[c]
            dropped = set(w.dropped)
        keep = [(c, y) for c, y in results if c not in dropped]
        if w.req.sum_rows and w.call is not None:  # the layer's one range: its rows' sums, as they are
            w.call.summed.update(c for c, _ in keep)
        if keep:
            self.store(keep, w)
        return [e for e in events if getattr(e, "call", None) not in dropped]

    def store(self, results: list[tuple[CallId, np.ndarray]], w: WireCall) -> None:
        """Remote answers kept for their layer and for verification (before the core hears of them:
        a driver reads a layer's results only once the core combined it)."""
        with self.lock:
            for c, y in results:
                if w.call is not None:
                    w.call.results[c] = y
                if c in self.keep:
                    self.kept[c] = y

