"""The discrete-event simulator (a shell of the real cores in logical time: no clock, no trio, no I/O).

What it drives, unchanged: the market's request handling (``market.state.Market`` over an
``InMemoryStore``: assignment, leases, heartbeats, recruitment hysteresis, age-out, proofs, map wiring)
and each volunteer's pull lifecycle (``volunteer.core.lifecycle.Lifecycle``). What it declares instead
of running: the coordinator's ``/slots`` busy count (the scenario's load curve), slice downloads (size /
the volunteer's link + an overhead), the coordinator's map follow and hold challenge (a latency, and a
dial that succeeds with the volunteer's NAT class's rate), churn (session and offline lengths drawn from
the scenario's distributions), requests reaching the market at once (no network delay to the market).

Rules:
- Time is a float of simulated seconds from 0; events sit in one heap ordered by ``(time, sequence)``,
  ``sequence`` growing with every push, so equal times run in the order they were scheduled.
- Randomness comes from ``random.Random`` streams derived from the seed (the world's draws, the
  lifecycles', the market's): the same scenario and seed run the same events, byte for byte.
- The shells' loop timings are the real ones: the market ticks every ``tick_s`` and polls ``/slots``
  every ``poll_interval_s``; a volunteer's daemon ticks its lifecycle every 0.2 s (here only when the
  lifecycle has something due, on the same 0.2 s grid), polls when its lifecycle asks, heartbeats when
  it says so, with the one (epoch, sequence) counter polls and heartbeats share.
- An event of a volunteer's earlier session (its process exited) is dropped: each carries the session.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from market.core.records import HeldState, SliceRef
from market.journal import Journal
from market.policy import MarketPolicy
from market.state import Market, NoOffer
from market.store import InMemoryStore, MemoryBacking
from sim.metrics import Metrics
from sim.scenario import Const, Dist, Exponential, LogNormal, Population, Scenario, Uniform, Weibull
from swarm.errors import RequestError
from swarm.protocol.expert import PROTOCOL_VERSION
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageHeartbeat,
    HeldSlice,
    ProvenSlice,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)
from volunteer.core.lifecycle import (
    Deregister,
    Effect,
    Fetch,
    Lifecycle,
    Offer,
    Poll,
    SendHeartbeat,
    SliceKey,
    Unload,
)

__all__ = ["DAEMON_TICK_S", "Simulation", "draw"]

DAEMON_TICK_S = 0.2  # volunteer.daemon's loop: the lifecycle's tick every 0.2 s
_NAT_CLASSES = ("direct", "hole_punchable", "relay_only")


def draw(d: Dist, rng: random.Random) -> float:
    """One sample of ``d``."""
    match d:
        case Const():
            return d.value
        case Uniform():
            return rng.uniform(d.lo, d.hi)
        case Exponential():
            return rng.expovariate(1.0 / d.mean)
        case Weibull():
            return rng.weibullvariate(d.scale, d.shape)
        case LogNormal():
            return d.median * math.exp(d.sigma * rng.gauss(0.0, 1.0))
    raise AssertionError(d)


@dataclass(eq=False)
class Vol:
    """One simulated volunteer machine: its fixed traits and its current process (``lc``)."""

    idx: int
    peer: str
    pop: Population
    memory: int
    bandwidth: float
    nat: str
    dial_success: float
    session: int = 0  # grows when a process starts or exits: older events are dropped
    lc: Lifecycle | None = None
    epoch: int = 0
    wire_seq: int = 0
    t0: float = 0.0  # the process's start: its daemon ticks on t0 + k * DAEMON_TICK_S
    tick_at: float | None = None
    addrs: list[str] = field(default_factory=list)
    # the coordinator's view of it: slices in its map and dialled, being dialled, proved by a hold challenge
    attached: set[SliceKey] = field(default_factory=set)
    dialling: set[SliceKey] = field(default_factory=set)
    proven: set[SliceKey] = field(default_factory=set)


class _TapJournal(Journal):
    """The market's own event log, also handed to the metrics (the market decides; we only watch)."""

    def __init__(self, on_event: Callable[[str, float, str | None, SliceRef | None, str], None]) -> None:
        super().__init__()
        self._on_event = on_event

    def event(self, kind: str, now: float, *, model_id: str | None = None, peer_id: str | None = None,
              s: SliceRef | None = None, detail: str = "") -> None:
        super().event(kind, now, model_id=model_id, peer_id=peer_id, s=s, detail=detail)
        self._on_event(kind, now, peer_id, s, detail)


class Simulation:
    def __init__(self, sc: Scenario, seed: int) -> None:
        self.sc = sc
        self.seed = seed
        self.rng = random.Random(f"world/{seed}")
        self.lc_rng = random.Random(f"lifecycle/{seed}")
        mk = sc.market
        policy = msgspec.convert(mk.policy, MarketPolicy)
        # as market.server does: a poll is fresh for at least two intervals and a timeout
        policy = msgspec.structs.replace(policy, poll_stale_s=max(policy.poll_stale_s,
                                                                  2 * mk.poll_interval_s + mk.poll_timeout_s))
        self.policy = policy
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.metrics = Metrics(sc, policy)
        self.market = Market(InMemoryStore(MemoryBacking()), policy, now=0.0, rng=random.Random(f"market/{seed}"))
        self.market.journal = _TapJournal(self.metrics.on_market_event)
        self.model_id = sc.model.id
        self.manifest = ModelManifest(model_id=sc.model.id, arch="sim", n_layer=sc.model.n_layer,
                                      n_expert=sc.model.n_expert,
                                      bytes_per_expert=[sc.model.bytes_per_expert] * sc.model.n_layer)
        self.vols: list[Vol] = []
        self.busy = 0  # the coordinator's busy slots now
        self.rounds_left = sc.coordinator.rounds.count if sc.coordinator.rounds is not None else 0
        self.round_open = False  # a round's load ran; waiting for its surplus to be released

    # -- the event heap ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self) -> dict[str, Any]:
        sc = self.sc
        self.market.register(RegisterModels(sc.coordinator.url, [self.manifest], epoch=1), 0.0)
        self.at(0.0, self._market_tick)
        self.at(0.0, self._market_poll)
        self.at(sc.coordinator.report_s, self._coordinator_report)
        self.at(0.0, self._sample)
        for t, busy in sc.coordinator.load:
            self.at(t, self._set_busy, busy)
        if sc.coordinator.rounds is not None:
            self.at(sc.coordinator.rounds.start_s, self._round_start)
        idx = 0
        for pop in sc.volunteers:
            for _ in range(pop.count):
                v = self._make_vol(idx, pop)
                self.vols.append(v)
                self.at(self.rng.uniform(0.0, pop.arrive_over_s), self._session_start, v)
                idx += 1
        end = sc.duration_s
        heap = self._heap
        while heap and heap[0][0] <= end:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
        self.now = end
        return self.metrics.report(self.market, end)

    def _make_vol(self, idx: int, pop: Population) -> Vol:
        r = self.rng
        nat_draw = r.random()
        shares = (pop.nat.direct, pop.nat.hole_punchable, pop.nat.relay_only)
        nat = _NAT_CLASSES[-1]
        acc = 0.0
        for name, share in zip(_NAT_CLASSES, shares, strict=True):
            acc += share
            if nat_draw < acc:
                nat = name
                break
        success = {"direct": pop.nat.direct_success, "hole_punchable": pop.nat.hole_punch_success,
                   "relay_only": pop.nat.relay_success}[nat]
        peer = f"{pop.name}-{idx:07d}"
        v = Vol(idx, peer, pop, max(1, int(draw(pop.memory_bytes, r))), max(1.0, draw(pop.download_bytes_per_s, r)),
                nat, success)
        v.addrs = [f"/ip4/10.{idx >> 16 & 255}.{idx >> 8 & 255}.{idx & 255}/tcp/4001/p2p/{peer}"]
        return v

    # -- the market's loops (market.loops) ----------------------------------------------------------
    def _market_tick(self) -> None:
        rep = self.market.tick(self.now)
        if rep.changed_maps:
            self.metrics.request("GET /api/expert-dispatch-map", self.now)  # the coordinator's long-poll answers
        self.at(self.now + self.sc.market.tick_s, self._market_tick)

    def _set_busy(self, busy: int) -> None:
        self.busy = busy
        self.metrics.load(self.now, busy)

    def _round_start(self) -> None:
        r = self.sc.coordinator.rounds
        if r is None or self.rounds_left <= 0:
            return
        self.rounds_left -= 1
        self.round_open = True
        self._set_busy(r.busy)

    def _round_check(self) -> None:
        """Back to base (the benchmark's wait, every 0.05 s): the boost is off and the surplus released."""
        ep = self.metrics.episodes[-1] if self.metrics.episodes else None
        if ep is not None and ep.unsaturated_at is not None and not ep.retiring and ep.retired > 0 \
                and not self.market.ix.recruiting(self.model_id):
            self.round_open = False
            self._round_start()
            return
        self.at(self.now + 0.05, self._round_check)

    def _market_poll(self) -> None:
        self.market.record_poll(self.sc.coordinator.url, self.busy, self.sc.coordinator.slots, self.now)
        self.metrics.request("GET /slots", self.now)
        self.at(self.now + self.sc.market.poll_interval_s, self._market_poll)

    def _sample(self) -> None:
        self.metrics.sample(self.market, self.now, self.busy, sum(1 for v in self.vols if v.lc is not None))
        self.at(self.now + self.sc.sample_s, self._sample)

    # -- the coordinator (declared: map follow, hold challenge, reports) -----------------------------
    def _next_tick(self, t: float) -> float:
        step = self.sc.market.tick_s
        return math.ceil(t / step - 1e-9) * step

    def _attach(self, v: Vol, key: SliceKey) -> None:
        """The market dispatches ``key`` of ``v``: its map reaches the coordinator after the next tick."""
        if key in v.attached or key in v.dialling:
            return
        v.dialling.add(key)
        self.at(self._next_tick(self.now) + self.sc.coordinator.map_latency_s, self._dial, v, v.session, key)

    def _dial(self, v: Vol, session: int, key: SliceKey) -> None:
        if v.session != session or v.lc is None:
            return  # its process exited (and the coordinator forgot it)
        held = v.lc.holdings.get(key)
        if held is None or held.state != "serving":
            v.dialling.discard(key)
            return
        if self.rng.random() < v.dial_success:
            v.dialling.discard(key)
            v.attached.add(key)
            r = self.sc.coordinator.rounds
            if self.metrics.serving(v.peer, key, self.now) and r is not None and self.round_open:
                self.at(self.now + r.tail_s, self._set_busy, 0)  # the round's load stops (its last requests end)
                self.at(self.now + r.tail_s, self._round_check)
            if key not in v.proven:
                self.at(self.now + self.sc.coordinator.challenge_s, self._proved, v, session, key)
        else:
            self.metrics.dial_failed(v.nat)
            self.at(self.now + self.sc.coordinator.retry_s, self._dial, v, session, key)

    def _proved(self, v: Vol, session: int, key: SliceKey) -> None:
        if v.session != session or key not in v.attached:
            return
        v.proven.add(key)
        _, layer, lo, hi = key
        self._report([ReportedWorker(peer_id=v.peer, held=[ProvenSlice(layer, lo, hi)])])

    def _report(self, workers: list[ReportedWorker]) -> None:
        self.market.report(CoordinatorReport(url=self.sc.coordinator.url, model_id=self.model_id, workers=workers),
                           self.now)
        self.metrics.request("POST /api/coordinator-report", self.now)

    def _coordinator_report(self) -> None:
        self._report([])
        self.at(self.now + self.sc.coordinator.report_s, self._coordinator_report)

    # -- volunteers: sessions (churn) -------------------------------------------------------------------
    def _session_start(self, v: Vol) -> None:
        pop = v.pop
        v.session += 1
        v.lc = Lifecycle(rng=self.lc_rng, poll_interval_s=pop.poll_interval_s, max_bytes=v.memory,
                         max_slices=pop.max_slices)
        v.epoch = max(v.epoch + 1, int(self.now * 1000))
        v.wire_seq = 0
        v.t0 = self.now
        v.tick_at = None
        self.metrics.session_started(self.now)
        self._apply(v, v.lc.start(self.now))
        self.at(self.now + draw(pop.session_s, self.rng), self._session_end, v, v.session)

    def _session_end(self, v: Vol, session: int) -> None:
        if v.session != session or v.lc is None:
            return
        if self.rng.random() < v.pop.graceful:
            self._apply(v, v.lc.stop(self.now))
            self.at(self.now + v.pop.drain_s, self._drained, v, session)
        else:
            self._offline(v, graceful=False)

    def _drained(self, v: Vol, session: int) -> None:
        if v.session != session or v.lc is None:
            return
        self._apply(v, v.lc.drained(self.now))
        self._offline(v, graceful=True)

    def _offline(self, v: Vol, *, graceful: bool) -> None:
        v.session += 1
        v.lc = None
        v.tick_at = None
        v.proven.clear()  # the coordinator's connection to it is gone: a new process proves its slices again
        v.dialling.clear()
        v.attached.clear()
        self.metrics.session_ended(self.now, graceful)
        self.at(self.now + draw(v.pop.offline_s, self.rng), self._session_start, v)

    # -- volunteers: the daemon's shell around its lifecycle --------------------------------------------
    def _apply(self, v: Vol, effects: list[Effect]) -> None:
        lc = v.lc
        if lc is None:
            return
        for e in effects:
            match e:
                case Poll(at=at):
                    self.at(at, self._poll, v, v.session, at)
                case Fetch(offer=offer):
                    t = self.now + offer.size / v.bandwidth + v.pop.fetch_overhead_s
                    self.at(t, self._fetched, v, v.session, offer)
                case SendHeartbeat():
                    self._heartbeat(v, lc)
                case Deregister():
                    self._heartbeat(v, lc)  # an empty heartbeat: it holds nothing now
                case Unload(offer=offer):  # a slice fetched again later is dialled and proved anew
                    v.attached.discard(offer.key)
                    v.proven.discard(offer.key)
        if v.lc is lc:
            self._wake(v, lc)

    def _wake(self, v: Vol, lc: Lifecycle) -> None:
        """Schedule the daemon's next lifecycle tick that has something to do (on its 0.2 s grid)."""
        due: float | None = None
        if lc.holdings or lc.paused:
            due = lc.next_heartbeat
        for h in lc.holdings.values():
            if not h.acked and (due is None or h.lease_deadline < due):
                due = h.lease_deadline
        if due is None or lc.stopping:
            return
        due = max(due, self.now)
        t = v.t0 + math.ceil(max(0.0, due - v.t0) / DAEMON_TICK_S - 1e-9) * DAEMON_TICK_S
        if t < due:  # rounding put the grid point a hair early: the tick would find nothing due
            t += DAEMON_TICK_S
        if v.tick_at is not None and v.tick_at <= t and v.tick_at >= self.now:
            return
        v.tick_at = t
        self.at(t, self._tick, v, v.session, t)

    def _tick(self, v: Vol, session: int, t: float) -> None:
        if v.session != session or v.lc is None or v.tick_at != t:
            return
        v.tick_at = None
        self._apply(v, v.lc.tick(self.now))
        if v.lc is not None and v.tick_at is None:
            self._wake(v, v.lc)

    def _next_seq(self, v: Vol) -> int:
        v.wire_seq += 1
        return v.wire_seq

    def _poll(self, v: Vol, session: int, at: float) -> None:
        lc = v.lc
        if v.session != session or lc is None or not lc.wants_poll(at):
            return
        req = VolunteerRequest(peer_id=v.peer, epoch=v.epoch, sequence=self._next_seq(v), max_bytes=lc.budget_left(),
                               max_experts=lc.experts_left())
        self.metrics.request("POST /api/expert-volunteer", self.now)
        try:
            res = self.market.volunteer(req, self.now)
        except RequestError:
            self._apply(v, lc.poll_failed(self.now))
            return
        if isinstance(res, NoOffer):
            self._apply(v, lc.nothing_needed(res.retry_after_s, self.now, reason=res.reason.value))
            return
        s = res.lease.slice
        offer = Offer(model_id=s.model_id, layer=s.layer, lo=s.lo, hi=s.hi, url="", sha256="", size=res.est_bytes,
                      lease_expires_in_s=res.lease.expires_at - self.now, heartbeat_s=self.policy.heartbeat_s,
                      lease_id=res.lease.lease_id)
        self._apply(v, lc.offered(offer, self.now))

    def _fetched(self, v: Vol, session: int, offer: Offer) -> None:
        if v.session != session or v.lc is None:
            return
        self._apply(v, v.lc.fetched(offer, self.now))

    def _heartbeat(self, v: Vol, lc: Lifecycle) -> None:
        seq = lc.sequence
        slices = [HeldSlice(h.offer.model_id, h.offer.layer, h.offer.lo, h.offer.hi, HeldState(state))
                  for h, state in lc.reported()]
        hb = CoverageHeartbeat(v.peer, v.epoch, self._next_seq(v), v.addrs, slices, max_bytes=v.memory,
                               protocols=[PROTOCOL_VERSION])
        self.metrics.request("POST /api/expert-coverage", self.now)
        try:
            ack = self.market.heartbeat(hb, self.now)
        except RequestError as exc:
            self.metrics.refused(exc.code)
            self._apply(v, lc.heartbeat_failed(self.now))
            return
        directives = [(d.model_id, d.layer, d.lo, d.hi, d.action, d.dispatched, d.release_in_s) for d in ack.slices]
        effects = lc.heartbeat_acked(directives, ack.heartbeat_s, seq, self.now)
        for d in ack.slices:
            key = (d.model_id, d.layer, d.lo, d.hi)
            if d.dispatched:
                self._attach(v, key)
            else:
                v.attached.discard(key)  # out of the map (retiring, loading): attached again when dispatched
        self._apply(v, effects)
