"""Serving in logical time: a coordinator decoding its sessions, the real dispatch core placing every MoE
layer's ranges on its own cores or on volunteers with their own (or shared) cores.

What it drives, unchanged: ``coordinator.core.dispatch.DispatchCore`` (placement, earliest finish, the split
check, trials, probation, verification, hedges, deadlines, quarantine) through its events and effects,
as ``coordinator.dispatch.dispatcher`` does (including the engine's whole-layer fast path:
``local_only_pairs``). What it declares: the seconds of work (``sim.costs.Costs``), the network (a round
trip and a bandwidth per link), the routing (each row's ``top_k`` experts drawn uniformly from the seed).

Rules:
- Every session decodes one token per step; a step is the ``n_layer`` MoE layers, each its dense work then
  its experts, then the head. One batch, unless the layers must wait for volunteers (a backbone:
  ``held=False``, or offload mode): then the sessions go in groups that advance through the layers on
  their own, as many as the real ``PipelineModel`` and ``GroupArms`` pick from what the simulated layers
  measured (the dispatcher's samples: dense half, volunteer time, the rest of the round trip). The
  engine thread (dense, head, whole local layers) runs one job at a time; so does the local runner.
- Machines share their cores by processor sharing: a job of ``threads`` threads measured alone at ``w``
  seconds progresses at ``min(1, cores / threads running)`` of its speed, so work on one machine slows
  what else runs there (``cores = "shared"``: the volunteers run on the coordinator's machine, as
  ``benchmarks/offload.py`` does; ``"own"``: each volunteer has a machine of one core).
- The coordinator runs one local expert call at a time (its local runner) and each volunteer one call
  at a time; the coordinator's network thread (one queue: ``sim.costs``' rules) streams each step's
  tokens (``stream_s`` each, while the engine goes on) and does a remote call's protocol: half of
  ``coord_call_s`` and half the loopback ``wire_s`` before it leaves, a wake-up and the other half of
  ``coord_call_s`` when its answer comes back; the volunteer pays a wake-up,
  ``worker_proto_s``, the other half of ``wire_s`` and the compute (the network stacks' work is CPU: on
  shared cores it slows with everything else); the round trip and the bytes over the bandwidth are delay.
- A cancelled call's answer is not delivered (the shell drops it); a call a volunteer has not started
  is removed from its queue.
- Range ``r`` of layer ``l`` is held by ``replicas`` volunteers in turn from ``(l x ranges + r) mod volunteers``
  (0: every volunteer holds every range).
- A liar answers wrongly after its first ``lie_after_calls`` calls (0: from the first; more: a sleeper): a
  ``Compare`` of such a call says unequal; a layer combined from one makes that step's tokens wrong (counted).
- Sessions arrive evenly over the first half of ``warmup_s`` (a step takes those that have arrived when it
  starts), then all decode until the end; tokens/s counts the steps that end in the measured window.
- Time: a heap ordered by ``(time, sequence)``; randomness from ``random.Random(seed)`` streams: the same
  point and seed give the same numbers.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.dispatch import DispatchCore
from coordinator.core.events import (
    CallId,
    Cancel,
    CancelTimer,
    Combine,
    Compare,
    Compared,
    DispatchConfig,
    DispatchMode,
    Effect,
    Event,
    Fail,
    Forget,
    Hedge,
    LayerRanLocally,
    LayerReady,
    LoadSample,
    LocalDone,
    Quarantine,
    RangeWork,
    RemoteDone,
    RunLocal,
    SendRemote,
    Settle,
    Settled,
    StartTimer,
    StepId,
    Timer,
    TimerFired,
    WorkersListed,
)
from coordinator.core.pipeline import GroupArms, PipelineModel, group_cuts
from sim.costs import Costs
from swarm.dispatch_map import RangeReplicas, Replica, partition_layer

__all__ = ["Point", "PointResult", "ServingSim"]



@dataclass(frozen=True)
class Point:
    """One configuration to simulate."""

    costs: Costs
    n_layer: int
    n_expert: int
    top_k: int
    ranges_per_layer: int
    sessions: int
    slots: int
    volunteers: int  # each holds every range (a replica of each)
    speed: float  # a volunteer thread's speed, relative to the calibration's
    rtt_s: float
    bandwidth: float  # bytes/s each way
    shared_cores: bool
    machine_cores: int  # the coordinator's machine
    coordinator_threads: int
    warmup_s: float
    measure_s: float
    liars: int = 0  # of the volunteers
    held: bool = True  # the coordinator holds every expert (False: a backbone, every range remote)
    rtt_sigma: float = 0.0  # each volunteer's round trip is rtt_s x lognormal(0, sigma)
    lie_after_calls: int = 0  # a liar answers its first N calls honestly (a sleeper), then lies
    replicas: int = 0  # volunteers holding each range, in turn over (layer, range) (0: every volunteer)
    # the map itself, when known (a measured run's): per MoE layer its ranges (lo, hi, volunteer indices); it
    # replaces ranges_per_layer and replicas (a gap in it is a range the coordinator computes, as partition_layer)
    layout: tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...] = ()
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    seed: int = 0


@dataclass
class PointResult:
    tokens_per_s: float
    steps: int
    wrong_tokens: int
    decisions: dict[str, int]
    remote_calls: int
    quarantined: int
    remote_rows: int
    local_rows: int
    fallback_rows: int
    groups: dict[int, int]  # steps per number of session groups
    failed_layers: int
    liars_quarantined: int = 0
    calls_to_quarantine: tuple[int, ...] = ()  # per quarantined liar: its calls from its first lie to the quarantine
    honest_quarantined: int = 0
    verified_rows: int = 0  # rows computed twice to check an answer (the honest work verification costs)
    def as_json(self) -> dict[str, Any]:
        return {"tokens_per_s": round(self.tokens_per_s, 3), "steps": self.steps, "wrong_tokens": self.wrong_tokens,
                "decisions": dict(sorted(self.decisions.items())), "remote_calls": self.remote_calls,
                "quarantined": self.quarantined, "remote_rows": self.remote_rows, "local_rows": self.local_rows,
                "fallback_rows": self.fallback_rows, "groups": {str(k): v for k, v in sorted(self.groups.items())},
                "failed_layers": self.failed_layers, "liars_quarantined": self.liars_quarantined,
                "calls_to_quarantine": list(self.calls_to_quarantine), "honest_quarantined": self.honest_quarantined,
                "verified_rows": self.verified_rows}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (max(t, self.now), self.seq, fn))


class _Machine:
    """Processor sharing over ``cores``: each job progresses at ``min(1, cores / threads running)``."""

    def __init__(self, clock: _Clock, cores: int) -> None:
        self.clock, self.cores = clock, cores
        self.jobs: dict[int, list[Any]] = {}  # id -> [remaining s, threads, on_done]
        self.last = 0.0
        self.version = 0
        self.ids = 0

    def _rate(self) -> float:
        n = sum(j[1] for j in self.jobs.values())
        return min(1.0, self.cores / n) if n else 1.0

    def _advance(self) -> None:
        now = self.clock.now
        r = self._rate()
        for j in self.jobs.values():
            j[0] -= (now - self.last) * r
        self.last = now

    def _schedule(self) -> None:
        self.version += 1
        if not self.jobs:
            return
        r = self._rate()
        t = self.clock.now + max(0.0, min(j[0] for j in self.jobs.values())) / r
        v = self.version
        self.clock.at(t, lambda: self._due(v))

    def _due(self, v: int) -> None:
        if v != self.version:
            return
        self._advance()
        done = [(k, j) for k, j in self.jobs.items() if j[0] <= 1e-9]
        for k, _ in done:
            del self.jobs[k]
        self._schedule()
        for _, j in done:
            j[2]()

    def run(self, seconds: float, threads: int, on_done: Callable[[], None]) -> None:
        self._advance()
        self.ids += 1
        self.jobs[self.ids] = [seconds, threads, on_done]
        self._schedule()


class _Fifo:
    """One job at a time on a machine (a runner thread): ``submit`` queues, ``drop`` removes a queued one. With
    ``gil`` (the process's interpreter lock, itself a ``_Fifo`` of one thread), a job's ``share`` of Python
    runs there first -- one thread of the process at a time -- and the rest (ggml's graphs, which release
    the lock) on the machine at ``threads``."""

    def __init__(self, machine: _Machine, threads: int, gil: _Fifo | None = None) -> None:
        self.machine, self.threads, self.gil = machine, threads, gil
        self.queue: list[tuple[Any, Callable[[], float], Callable[[float], None], float]] = []
        self.busy = False

    def submit(self, key: Any, work: Callable[[], float], on_done: Callable[[float], None], share: float = 0.0) -> None:
        self.queue.append((key, work, on_done, share))
        self._next()

    def drop(self, key: Any) -> bool:
        for i, q in enumerate(self.queue):
            if q[0] == key:
                del self.queue[i]
                return True
        return False

    def _next(self) -> None:
        if self.busy or not self.queue:
            return
        _, work, on_done, share = self.queue.pop(0)
        self.busy = True
        start = self.machine.clock.now

        def done() -> None:
            self.busy = False
            on_done(self.machine.clock.now - start)
            self._next()

        w = work()
        if self.gil is not None and share > 0.0:
            rest = w * (1.0 - share)
            self.gil.submit(None, lambda: w * share, lambda _s: self.machine.run(rest, self.threads, done))
        else:
            self.machine.run(w, self.threads, done)


@dataclass
class _Step:
    groups_left: int
    sessions: int
    tainted: bool = False  # a layer of it was combined from an unchecked liar's answer


@dataclass
class _Group:
    step: _Step
    rows: int
    dense_s: float = 0.0  # the dense half before the layer under way


@dataclass
class _Layer:
    step: StepId
    layer: int
    ranges: tuple[RangeWork, ...]
    group: _Group
    placed: float
    volunteer_s: float = 0.0  # the longest arrival-to-answer time at a volunteer
    answered: bool = False


class ServingSim:
    """One point: run ``warmup_s + measure_s`` simulated seconds, count the tokens of the measured window."""

    def __init__(self, p: Point) -> None:
        self.p = p
        self.clock = _Clock()
        self.rng = random.Random(p.seed)
        self.coord = _Machine(self.clock, p.machine_cores)
        # the network thread (the API's streams, the calls' protocol, the core): Python throughout, so it is the
        # interpreter lock's queue itself; the engine thread and the local runner take it for their Python share
        self.net = _Fifo(self.coord, 1)
        self.engine = _Fifo(self.coord, p.coordinator_threads, self.net)  # the engine thread: dense, head, whole layers
        self.local = _Fifo(self.coord, p.coordinator_threads, self.net)  # the local runner: RunLocal ranges
        self.peers = [f"v{i}" for i in range(p.volunteers)]
        self.liars = set(self.peers[: p.liars])
        self.lies: set[CallId] = set()  # calls a liar answered wrongly
        if p.shared_cores:
            self.vol_fifo = {v: _Fifo(self.coord, 1) for v in self.peers}
        else:
            self.vol_fifo = {v: _Fifo(_Machine(self.clock, 1), 1) for v in self.peers}
        spread = random.Random(p.seed + 2)
        self.rtt = {v: p.rtt_s * (spread.lognormvariate(0.0, p.rtt_sigma) if p.rtt_sigma else 1.0) for v in self.peers}
        self.pipeline = PipelineModel()
        self.arms = GroupArms()
        self.layer_end: float | None = None
        self.groups_used: Counter[int] = Counter()
        self.fails = 0
        self.core = DispatchCore(p.dispatch, n_layer=p.n_layer, n_expert=p.n_expert, rng=random.Random(p.seed + 1))
        self.timers: dict[Timer, int] = {}
        self.timer_seq = 0
        self.calls: dict[CallId, tuple[_Layer, int, str | None]] = {}  # call -> (layer, range index, peer)
        self.cancelled: set[CallId] = set()
        self.layers: dict[StepId, _Layer] = {}
        self.step_ids = 0
        self.tokens = 0
        self.steps = 0
        self.wrong = 0
        self.remote_calls = 0
        self.calls_to: Counter[str] = Counter()  # remote calls sent to each volunteer
        self.quarantined_after: dict[str, int] = {}  # a quarantined volunteer: the calls it had been sent
        # per layer: its ranges' lower bounds, (lo, hi) and holders (the map's, as the dispatcher partitions it)
        self.ranges: list[list[tuple[int, int, tuple[str, ...]]]] = []
        if p.layout:
            if len(p.layout) != p.n_layer:
                raise ValueError(f"layout: {len(p.layout)} layers for {p.n_layer}")
            for rs in p.layout:
                listed = [RangeReplicas(lo, hi, [Replica(self.peers[v]) for v in vols]) for lo, hi, vols in rs]
                self.ranges.append([(r.lo, r.hi, tuple(x.peer_id for x in r.replicas))
                                    for r in partition_layer(listed, p.n_expert)])
        else:
            width = p.n_expert // p.ranges_per_layer
            k = min(p.replicas or p.volunteers, p.volunteers)
            self.ranges = [[(r * width, (r + 1) * width, tuple(self.peers[(layer * p.ranges_per_layer + r + j) % p.volunteers]
                                                                for j in range(k)))
                            for r in range(p.ranges_per_layer)] for layer in range(p.n_layer)]
        self.lows = [[lo for lo, _, _ in rs] for rs in self.ranges]
        self.end = p.warmup_s + p.measure_s

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> PointResult:
        if self.peers:
            self._handle(WorkersListed(frozenset(self.peers)))
        self._sample()
        self._step()
        while self.clock.heap:
            t, _, fn = heapq.heappop(self.clock.heap)
            if t > self.end:
                break
            self.clock.now = t
            fn()
        rows = self.core.rows
        return PointResult(tokens_per_s=self.tokens / self.p.measure_s, steps=self.steps, wrong_tokens=self.wrong,
                           decisions={str(k): v for k, v in self.core.decisions.items()},
                           remote_calls=self.remote_calls, quarantined=self.core.quarantines,
                           remote_rows=sum(r.remote_rows for r in rows), local_rows=sum(r.local_rows for r in rows),
                           fallback_rows=sum(r.fallback_rows for r in rows), groups=dict(self.groups_used),
                           failed_layers=self.fails,
                           liars_quarantined=sum(1 for v in self.quarantined_after if v in self.liars),
                           calls_to_quarantine=tuple(sorted(n - self.p.lie_after_calls for v, n in self.quarantined_after.items()
                                                            if v in self.liars)),
                           honest_quarantined=sum(1 for v in self.quarantined_after if v not in self.liars),
                           verified_rows=sum(r.verified_rows for r in rows))

    def _active(self) -> int:
        """Sessions decoding now: they arrive evenly over the first half of the warm-up (as requests do: the
        dispatcher's cost models see layers of several sizes), then all of them."""
        ramp = self.p.warmup_s / 2
        return min(self.p.sessions, 1 + int(self.clock.now / ramp * self.p.sessions)) if ramp > 0 else self.p.sessions

    def _sample(self) -> None:
        self._handle(LoadSample(self._active(), self.p.slots))
        self.clock.at(self.clock.now + self.p.dispatch.sample_interval_s, self._sample)

    def _step(self) -> None:
        """A step: the sessions in ``G`` groups (one unless the layers must wait for volunteers: the
        dispatcher's ``groups``, the real ``PipelineModel`` and ``GroupArms``), each through the layers."""
        n = self._active()
        g = 1
        if self.peers and n >= 2 and (not self.p.held or self.p.dispatch.mode is DispatchMode.OFFLOAD):
            g = self.arms.pick(n, n, self.pipeline.groups(n, n), self.clock.now, self.layer_end)
        cuts = group_cuts([1] * n, g)
        st = _Step(groups_left=len(cuts) - 1, sessions=n)
        self.groups_used[len(cuts) - 1] += 1
        for i in range(len(cuts) - 1):
            self._layer(_Group(st, cuts[i + 1] - cuts[i]), 0)

    def _layer(self, grp: _Group, layer: int) -> None:
        if layer == self.p.n_layer:
            self.engine.submit(None, lambda: self.p.costs.head(grp.rows) + self.p.costs.step_s * grp.rows,
                               lambda _s: self._done(grp), self.p.costs.py_share_dense)
            if self.p.costs.stream_s > 0:  # each session's token streamed by the network thread (the engine goes on)
                self.net.submit(None, lambda: self.p.costs.stream_s * grp.rows, lambda _s: None)
            return

        def dense_done(seconds: float) -> None:
            grp.dense_s = seconds
            self._moe(grp, layer)

        self.engine.submit(None, lambda: self.p.costs.dense(grp.rows), dense_done, self.p.costs.py_share_dense)

    def _done(self, grp: _Group) -> None:
        st = grp.step
        st.groups_left -= 1
        if st.groups_left:
            return
        if st.tainted:
            self.wrong += st.sessions
        if self.clock.now >= self.p.warmup_s:
            self.tokens += st.sessions
            self.steps += 1
        self._step()

    def _route(self, layer: int, rows_n: int) -> tuple[RangeWork, ...]:
        k, n = self.p.top_k, self.p.n_expert
        rows: dict[int, set[int]] = {}
        pairs: Counter[int] = Counter()
        lows, ranges = self.lows[layer], self.ranges[layer]
        for row in range(rows_n):
            for e in self.rng.sample(range(n), k):
                r = bisect.bisect_right(lows, e) - 1
                rows.setdefault(r, set()).add(row)
                pairs[r] += 1
        return tuple(RangeWork(ranges[r][0], ranges[r][1], len(rows[r]), pairs[r], ranges[r][2],
                               self.p.held or not ranges[r][2]) for r in sorted(pairs))

    def _moe(self, grp: _Group, layer: int) -> None:
        ranges = self._route(layer, grp.rows)
        n_pairs = sum(r.pairs for r in ranges)
        bound, reason = self.core.local_only_pairs(self.clock.now)
        if self.p.held and n_pairs <= bound:  # the engine's fast path: the whole layer inside its own graph
            def ran(seconds: float) -> None:
                self._handle(LayerRanLocally(layer, ranges, reason, seconds))
                self._layer(grp, layer + 1)

            self.engine.submit(None, lambda: self.p.costs.fused_experts(grp.rows, n_pairs), ran, self.p.costs.py_share_local)
            return
        self.step_ids += 1
        sid = StepId(self.step_ids)
        self.layers[sid] = _Layer(sid, layer, ranges, grp, placed=self.clock.now)
        self._handle(LayerReady(sid, layer, ranges))

    def _combined(self, L: _Layer) -> None:
        now = self.clock.now
        self.layer_end = now
        if L.answered:  # what the session groups are chosen by (the dispatcher's sample)
            self.pipeline.sample(L.group.rows, L.group.dense_s, L.volunteer_s, (now - L.placed) - L.volunteer_s)
        if self.p.costs.coord_layer_s > 0:
            self.engine.submit(None, lambda: self.p.costs.coord_layer_s, lambda _s: self._layer(L.group, L.layer + 1), 1.0)
        else:
            self._layer(L.group, L.layer + 1)

    # -- events in, effects out ---------------------------------------------------------------------------
    def _handle(self, ev: Event) -> None:
        todo: list[Event] = [ev]
        while todo:
            e = todo.pop(0)
            for eff in self.core.handle(e, self.clock.now):
                todo += self._effect(eff)

    def _effect(self, e: Effect) -> list[Event]:
        now = self.clock.now
        if isinstance(e, RunLocal) or (isinstance(e, Hedge) and e.peer is None):
            L = self.layers[e.step]
            self.calls[e.call] = (L, e.index, None)
            pairs, call = L.ranges[e.index].pairs, e.call
            self.local.submit(call, lambda: self.p.costs.experts(pairs), lambda s: self._local_done(call, s),
                              self.p.costs.py_share_dense)
        elif isinstance(e, SendRemote | Hedge):
            assert e.peer is not None
            L = self.layers[e.step]
            self.calls[e.call] = (L, e.index, e.peer)
            self._send(e.call, L, L.ranges[e.index], e.peer)
        elif isinstance(e, Cancel):
            self.cancelled.add(e.call)
            got = self.calls.get(e.call)
            if got is not None:
                fifo = self.local if got[2] is None else self.vol_fifo[got[2]]
                fifo.drop(e.call)
        elif isinstance(e, StartTimer):
            self.timer_seq += 1
            timer, token = e.timer, self.timer_seq
            self.timers[timer] = token
            self.clock.at(e.at, lambda: self._timer(timer, token))
        elif isinstance(e, CancelTimer):
            self.timers.pop(e.timer, None)
        elif isinstance(e, Compare):
            return [Compared(e.remote, e.remote not in self.lies and e.local not in self.lies)]
        elif isinstance(e, Settle):
            return [Settled(e.a, e.a not in self.lies, e.b not in self.lies)]
        elif isinstance(e, Combine):
            L = self.layers.pop(e.step)
            for c in e.calls:
                got = self.calls.get(c)
                if c in self.lies:
                    L.group.step.tainted = True
            self.clock.at(now, lambda: self._combined(L))
        elif isinstance(e, Fail):  # the shell waits for coverage and retries; here: computed from the GGUF
            F = self.layers.pop(e.step)
            self.fails += 1
            self.engine.submit(None, lambda: self.p.costs.experts(sum(r.pairs for r in F.ranges)),
                               lambda _s: self._combined(F))
        elif isinstance(e, Quarantine):
            self.quarantined_after.setdefault(e.peer, self.calls_to.get(e.peer, 0))
        elif isinstance(e, Forget):
            pass
        return []

    def _timer(self, t: Timer, token: int) -> None:
        if self.timers.get(t) != token:
            return
        del self.timers[t]
        self._handle(TimerFired(t))

    def _local_done(self, call: CallId, seconds: float) -> None:
        if call in self.cancelled:
            return
        self._handle(LocalDone(call, seconds))

    def _send(self, call: CallId, L: _Layer, r: RangeWork, peer: str) -> None:
        p, c = self.p, self.p.costs
        self.remote_calls += 1
        self.calls_to[peer] += 1
        if peer in self.liars and self.calls_to[peer] > p.lie_after_calls:
            self.lies.add(call)
        one_way = self.rtt[peer] / 2 + r.rows * c.row_bytes / p.bandwidth  # the wire's loopback part is CPU: below

        def arrive() -> None:
            if call in self.cancelled:
                return
            t0 = self.clock.now
            self.vol_fifo[peer].submit(call, lambda: c.wake_s + c.worker_proto_s + c.wire_s / 2 + c.worker(r.pairs, p.speed),
                                       lambda _s: answered(self.clock.now - t0))

        def answered(volunteer_s: float) -> None:
            L.volunteer_s = max(L.volunteer_s, volunteer_s)
            self.clock.at(self.clock.now + one_way, back)

        def back() -> None:
            if call in self.cancelled:
                return
            L.answered = True
            if c.net_call_s > 0:
                self.net.submit(None, lambda: c.net_call_s / 2, lambda _s: None)
            self.net.submit(None, lambda: c.wake_s + c.coord_call_s / 2, lambda _s: None if call in self.cancelled else
                            self._handle(RemoteDone(call, int(self.clock.now * 1000))))

        self.net.submit(None, lambda: c.coord_call_s / 2 + c.wire_s / 2,
                        lambda _s: self.clock.at(self.clock.now + one_way, arrive))
        if c.net_call_s > 0:
            self.net.submit(None, lambda: c.net_call_s / 2, lambda _s: None)


def local_only(p: Point) -> Point:
    """The same point with nobody to offload to and every expert here (the baseline: all-local)."""
    return Point(**{**p.__dict__, "volunteers": 0, "liars": 0, "held": True})

