"""Market scenarios under virtual time (trio ``MockClock``, autojump): the state machine with an
in-memory store, the real recruitment and housekeeping loops, a fake coordinator (``/slots`` load
plus a dispatcher that follows the dispatch map) and fake volunteers that pull, heartbeat and
release. No sockets, no threads: every time below is exact virtual seconds."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import pytest
import trio
import trio.testing

from market.core.records import HeldState, ModelManifest, SliceRef
from market.loops import MapWatch, run_housekeeping, run_recruitment_loop
from market.policy import MarketPolicy
from market.state import Market, NoOffer, Offer
from market.store import InMemoryStore, MemoryBacking
from swarm.dispatch_map import DispatchMap
from swarm.errors import RequestError, SwarmError, TransportError
from swarm.protocol.market import CoverageHeartbeat, HeldSlice, RegisterModels, VolunteerRequest

MID = "sim-0123456789ab"
COORD = "http://coordinator.test"
POLICY = MarketPolicy(
    base_target=1, boost=1, saturation_threshold=2, hold_s=10.0, poll_stale_s=5.0, lease_s=10.0,
    heartbeat_ttl_s=6.0, cooldown_s=5.0, retry_after_s=5.0, flush_s=2.0, header_allowance=0,
)
POLL_S = 2.0
TICK_S = 0.25
CALL_S = 1.0  # how long one expert call to a volunteer stays in flight
FOLLOW_S = 0.5  # how often the fake coordinator re-reads the dispatch map


def manifest(n_layer: int = 2, n_expert: int = 8) -> ModelManifest:
    return ModelManifest(model_id=MID, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert,
                         bytes_per_expert=[1000] * n_layer)


class MarketDown(SwarmError):
    code = "market_down"


@dataclass
class World:
    """Everything the fake nodes share; ``market`` is None while the market is down."""

    backing: MemoryBacking = field(default_factory=MemoryBacking)
    market: Market | None = None
    busy: int = 0
    hang_polls: bool = False
    in_flight: Counter[str] = field(default_factory=Counter)
    last_serve_ms: dict[str, int] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)  # released with calls in flight: must stay empty
    log: list[tuple[float, str, str]] = field(default_factory=list)
    coordinator_map: DispatchMap | None = None

    def m(self) -> Market:
        if self.market is None:
            raise MarketDown("market is down")
        return self.market


async def run_market(world: World, seed: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                     ) -> None:
    """One market process: state on the shared backing + its loops. Cancel it to 'kill' it."""
    market = Market(InMemoryStore(world.backing), POLICY, now=trio.current_time(), rng=random.Random(seed))
    world.market = market

    async def poll(url: str) -> tuple[int, int]:
        if world.hang_polls:
            await trio.sleep_forever()
        return world.busy, 4

    try:
        async with trio.open_nursery() as n:
            await n.start(partial(run_housekeeping, market, MapWatch(), clock=trio.current_time, tick_s=TICK_S))
            await n.start(partial(run_recruitment_loop, market, poll, clock=trio.current_time, interval_s=POLL_S,
                                  timeout_s=1.0))
            task_status.started()
    finally:
        world.market = None


async def fake_coordinator(world: World) -> None:
    """Follows the dispatch map (keeping the last one while the market is down) and sends calls
    round-robin to the listed replicas of every range; each call is in flight for CALL_S."""
    rr = 0

    async def call(peer: str) -> None:
        world.in_flight[peer] += 1
        await trio.sleep(CALL_S)
        world.in_flight[peer] -= 1
        world.calls[peer] += 1
        world.last_serve_ms[peer] = int(trio.current_time() * 1000)

    async with trio.open_nursery() as n:
        while True:
            try:
                world.coordinator_map = world.m().dispatch_map(MID)
            except SwarmError:
                pass  # market down: keep the last map
            if world.coordinator_map is not None:
                for layer in world.coordinator_map.layers:
                    for r in layer.ranges:
                        if r.replicas:
                            n.start_soon(call, r.replicas[rr % len(r.replicas)].peer_id)
            rr += 1
            await trio.sleep(FOLLOW_S)


async def fake_volunteer(world: World, peer: str, max_experts: int, *, download_s: float = 1.0,
                         epoch: int = 1) -> None:
    """Pulls one slice at a time, loads it, heartbeats every heartbeat_s, obeys drain/release."""
    seq = 0
    held: dict[SliceRef, HeldState] = {}

    def heartbeat() -> list[str]:
        nonlocal seq
        seq += 1
        serve = world.last_serve_ms.get(peer, 0)
        hb = CoverageHeartbeat(
            peer, epoch, seq, [f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}"],
            [HeldSlice(s.model_id, s.layer, s.lo, s.hi, st, serve if st is HeldState.SERVING else 0)
             for s, st in held.items()],
            load=float(world.in_flight[peer]),
            protocols=[2],
        )
        ack = world.m().heartbeat(hb, trio.current_time())
        actions = []
        for d in ack.slices:
            s = SliceRef(d.model_id, d.layer, d.lo, d.hi)
            if d.action == "release":
                if world.in_flight[peer]:
                    world.lost.append(peer)
                held.pop(s, None)
                world.log.append((trio.current_time(), peer, f"release {s}"))
            actions.append(d.action)
        return actions

    while True:
        try:
            if not held:
                res = world.m().volunteer(VolunteerRequest(peer, max_experts=max_experts), trio.current_time())
                if isinstance(res, NoOffer):
                    await trio.sleep(res.retry_after_s)
                    continue
                held[res.lease.slice] = HeldState.LOADING
                world.log.append((trio.current_time(), peer, f"assigned {res.lease.slice}"))
                heartbeat()
                await trio.sleep(download_s)
                held[res.lease.slice] = HeldState.SERVING
            heartbeat()
        except MarketDown:
            pass  # keep serving what we hold; try again later
        await trio.sleep(POLICY.heartbeat_s)


def replicas_per_range(dm: DispatchMap) -> list[int]:
    return [len(r.replicas) for L in dm.layers for r in L.ranges]


def serving_peers(market: Market) -> set[str]:
    return {peer for peer, rows in market.ix.coverage.items() if any(r.dispatched for r in rows.values())}


async def start_world(nursery: trio.Nursery, world: World, n_volunteers: int, seed: int) -> trio.CancelScope:
    cs = trio.CancelScope()

    async def market_task(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with cs:
            await run_market(world, seed, task_status=task_status)

    await nursery.start(market_task)
    world.m().register(RegisterModels(COORD, [manifest()], epoch=1), trio.current_time())
    nursery.start_soon(fake_coordinator, world)
    for i in range(n_volunteers):
        nursery.start_soon(fake_volunteer, world, f"vol-{i}", 4)
        await trio.sleep(0.1)
    return cs


async def test_saturation_boost_recruit_serve_then_age_out(autojump_clock: trio.testing.MockClock) -> None:
    world = World()
    async with trio.open_nursery() as nursery:
        await start_world(nursery, world, n_volunteers=8, seed=1)
        m = world.m()

        # base coverage from zero: 2 layers x 2 chunks of 4 experts -> 4 volunteers, 4 idle
        await trio.sleep_until(15.0)
        dm = m.dispatch_map(MID)
        assert replicas_per_range(dm) == [1, 1, 1, 1]
        base = serving_peers(m)
        assert len(base) == 4
        assert all(c > 0 for p, c in world.calls.items() if p in base)  # they serve
        assert not m.ix.recruiting(MID) and m.ix.target(MID) == 1

        # load: the polls at t=20 and t=22 see busy >= 2: saturated for rise_s (2 s) -> recruiting at t=22
        await trio.sleep_until(19.0)
        world.busy = 3
        await trio.sleep_until(21.9)
        assert not m.ix.recruiting(MID) and m.ix.saturated_now(MID, 21.9)
        await trio.sleep_until(22.3)
        assert m.ix.recruiting(MID) and m.ix.target(MID) == 2
        assert 22.0 <= m.ix.recruit[MID].changed_at <= 22.0 + TICK_S
        assert m.demand(22.3).recruiting

        # the idle volunteers come back within their retry-after (5 s +- 20%) and are wired in
        await trio.sleep_until(30.0)
        assert replicas_per_range(m.dispatch_map(MID)) == [2, 2, 2, 2]
        assert len(serving_peers(m)) == 8
        recruited = serving_peers(m) - base
        assert len(recruited) == 4
        await trio.sleep_until(38.0)
        assert all(world.calls[p] > 0 for p in recruited)  # the recruits serve

        # load ends: the last saturated poll is at t=38; the boost holds for hold_s = 10
        await trio.sleep_until(39.0)
        world.busy = 0
        await trio.sleep_until(47.9)
        assert m.ix.recruiting(MID)
        assert replicas_per_range(m.dispatch_map(MID)) == [2, 2, 2, 2]
        await trio.sleep_until(48.0 + TICK_S + 0.01)
        assert not m.ix.recruiting(MID) and m.ix.target(MID) == 1
        # the surplus (the youngest: the recruits) is out of the map at once, not yet released
        assert replicas_per_range(m.dispatch_map(MID)) == [1, 1, 1, 1]
        assert serving_peers(m) == base
        assert not any("release" in what for _, _, what in world.log)

        # released after the cooldown (5 s), at their next heartbeat; nothing in flight is lost
        await trio.sleep_until(56.0)
        released = {p for t, p, what in world.log if "release" in what}
        assert released == recruited
        assert all(53.0 <= t <= 48.25 + 5 + POLICY.heartbeat_s + 0.01 for t, _, what in world.log if "release" in what)
        assert world.lost == []
        assert m.ix.counts[MID].replicas == [[1] * 8, [1] * 8]
        assert m.ix.counts == m.ix.recount()
        # and they stay idle: nothing is scarce any more
        await trio.sleep_until(70.0)
        assert serving_peers(m) == base
        assert all(p not in m.ix.coverage for p in recruited)
        nursery.cancel_scope.cancel()


async def test_flapping_load_does_not_thrash(autojump_clock: trio.testing.MockClock) -> None:
    world = World()
    async with trio.open_nursery() as nursery:
        await start_world(nursery, world, n_volunteers=8, seed=2)
        m = world.m()
        await trio.sleep_until(15.0)
        members = []
        for k in range(10):  # saturated for one 4 s window in every two, for 40 s
            world.busy = 3 if k % 2 == 0 else 0
            await trio.sleep(4.0)
            members.append(frozenset(m.dispatch_map(MID).peers()))
            assert m.ix.recruiting(MID)
        world.busy = 0
        assert replicas_per_range(m.dispatch_map(MID)) == [2, 2, 2, 2]
        # once recruited (within two rounds), the membership stays put through the flapping
        assert len(members[2]) == 8 and len(set(members[2:])) == 1
        assert m.counters["retired"] == 0
        assert not any("release" in what for _, _, what in world.log)
        nursery.cancel_scope.cancel()


async def test_simultaneous_polls_get_different_slices(autojump_clock: trio.testing.MockClock) -> None:
    world = World()
    async with trio.open_nursery() as nursery:
        await nursery.start(run_market, world, 3)
        m = world.m()
        m.register(RegisterModels(COORD, [manifest(2, 16)], epoch=1), trio.current_time())
        offers: list[Offer] = []

        async def poll(peer: str) -> None:
            await trio.sleep_until(5.0)
            res = m.volunteer(VolunteerRequest(peer, max_experts=4), trio.current_time())
            assert isinstance(res, Offer)
            offers.append(res)

        async with trio.open_nursery() as polls:
            for i in range(8):
                polls.start_soon(poll, f"vol-{i}")
        assert trio.current_time() == 5.0  # all at the same virtual instant
        slices = [o.lease.slice for o in offers]
        assert len(slices) == 8
        for i, a in enumerate(slices):
            for b in slices[i + 1:]:
                assert not a.overlaps(b), (a, b)
        assert m.ix.counts[MID].pending == [[1] * 16, [1] * 16]
        # a ninth finds nothing scarce; the leases lapse after lease_s and the need comes back
        late = m.volunteer(VolunteerRequest("vol-late", max_experts=4), trio.current_time())
        assert isinstance(late, NoOffer) and late.reason.value == "nothing_scarce"
        await trio.sleep_until(5.0 + POLICY.lease_s + TICK_S + 0.01)
        assert m.ix.leases == {} and m.ix.counts[MID].pending == [[0] * 16, [0] * 16]
        again = m.volunteer(VolunteerRequest("vol-late", max_experts=4), trio.current_time())
        assert isinstance(again, Offer)
        nursery.cancel_scope.cancel()


async def test_stale_and_replayed_heartbeats_are_rejected(autojump_clock: trio.testing.MockClock) -> None:
    world = World()
    async with trio.open_nursery() as nursery:
        cs = trio.CancelScope()

        async def market_task(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with cs:
                await run_market(world, 4, task_status=task_status)

        await nursery.start(market_task)
        m = world.m()
        m.register(RegisterModels(COORD, [manifest()], epoch=1), trio.current_time())
        offer = m.volunteer(VolunteerRequest("vol-x", max_experts=4), trio.current_time())  # coverage comes from a lease
        assert isinstance(offer, Offer)
        ls = offer.lease.slice
        s = HeldSlice(MID, ls.layer, ls.lo, ls.hi)

        def hb(epoch: int, seq: int, slices: list[HeldSlice]) -> CoverageHeartbeat:
            return CoverageHeartbeat("vol-x", epoch, seq, ["/ip4/10.0.0.9/tcp/1"], slices, protocols=[2])

        world.m().heartbeat(hb(2, 5, [s]), trio.current_time())
        for bad, code in [(hb(2, 5, []), "replayed_sequence"), (hb(2, 4, []), "replayed_sequence"),
                          (hb(1, 99, []), "stale_epoch")]:
            with pytest.raises(RequestError) as ei:
                world.m().heartbeat(bad, trio.current_time())
            assert ei.value.code == code and ei.value.status == 409
        # the rejected (empty) heartbeats did not deregister anything
        assert set(world.m().ix.coverage["vol-x"]) == {ls}
        world.m().heartbeat(hb(2, 6, [s]), trio.current_time())
        await trio.sleep(POLICY.flush_s + TICK_S)  # the sequence is flushed to the store

        # restart the market on the same backing: the replay is still rejected
        cs.cancel()
        await trio.sleep(1.0)
        cs = trio.CancelScope()
        await nursery.start(market_task)
        with pytest.raises(RequestError) as ei:
            world.m().heartbeat(hb(2, 6, [s]), trio.current_time())
        assert ei.value.code == "replayed_sequence"
        # a restarted volunteer (new epoch) is accepted; a slice it was never assigned is refused, its own kept
        other = next(x for x in (HeldSlice(MID, 1, 0, 8), HeldSlice(MID, 0, 0, 8)) if (x.layer, x.lo) != (ls.layer, ls.lo))
        ack = world.m().heartbeat(hb(3, 0, [s, other]), trio.current_time())
        assert [(d.action, d.reason) for d in ack.slices] == [("keep", ""), ("release", "not_assigned")]
        assert set(world.m().ix.coverage["vol-x"]) == {ls}

        # a silent volunteer expires after the TTL and leaves the map
        await trio.sleep(1.0)
        assert world.m().dispatch_map(MID).peers() == {"vol-x": ["/ip4/10.0.0.9/tcp/1"]}
        await trio.sleep(POLICY.heartbeat_ttl_s + TICK_S)
        assert "vol-x" not in world.m().ix.coverage
        assert world.m().dispatch_map(MID).layers == []
        nursery.cancel_scope.cancel()


async def test_market_restart_mid_run(autojump_clock: trio.testing.MockClock) -> None:
    world = World()
    async with trio.open_nursery() as nursery:
        cs = await start_world(nursery, world, n_volunteers=8, seed=5)
        world.busy = 3
        await trio.sleep_until(30.0)
        m1 = world.m()
        assert m1.ix.recruiting(MID)
        assert replicas_per_range(m1.dispatch_map(MID)) == [2, 2, 2, 2]
        before = m1.dispatch_map(MID)
        peers_before = serving_peers(m1)
        calls_before = sum(world.calls.values())

        # kill the market (no graceful flush) and keep it down for 4 s
        cs.cancel()
        await trio.sleep(4.0)
        assert world.market is None
        # the coordinator kept its last map and the volunteers kept serving
        assert world.coordinator_map == before
        assert sum(world.calls.values()) > calls_before

        # a new market process on the same store: registrations, coverage, boost all survive
        cs2 = trio.CancelScope()

        async def market_task(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with cs2:
                await run_market(world, 6, task_status=task_status)

        await nursery.start(market_task)
        m2 = world.m()
        assert m2 is not m1
        assert COORD in m2.ix.coordinators and MID in m2.ix.models
        assert m2.ix.recruiting(MID)
        await trio.sleep(TICK_S + 0.01)
        after = m2.dispatch_map(MID)
        assert after.version >= before.version  # the version never goes back
        assert after.peers() == before.peers()
        assert serving_peers(m2) == peers_before
        # volunteers carry on (same epoch, higher sequence): no restart needed, nothing expires
        await trio.sleep(POLICY.heartbeat_ttl_s * 2)
        assert serving_peers(m2) == peers_before
        assert m2.counters["heartbeats_accepted"] > 0
        assert m2.counters["heartbeats_replayed_sequence"] == 0
        assert m2.counters["volunteers_expired"] == 0
        assert world.coordinator_map is not None and world.coordinator_map.version >= before.version
        # and the age-out still happens on the new market once the load ends
        world.busy = 0
        await trio.sleep(POLICY.hold_s + POLICY.cooldown_s + 3 * POLICY.heartbeat_s)
        assert replicas_per_range(m2.dispatch_map(MID)) == [1, 1, 1, 1]
        assert world.lost == []
        assert m2.ix.counts == m2.ix.recount()
        nursery.cancel_scope.cancel()


async def test_a_hung_coordinator_never_stalls_the_poll_loop(autojump_clock: trio.testing.MockClock) -> None:
    world = World()
    async with trio.open_nursery() as nursery:
        await nursery.start(run_market, world, 7)
        m = world.m()
        m.register(RegisterModels(COORD, [manifest()], epoch=1), trio.current_time())
        m.register(RegisterModels("http://other.test", [manifest()], epoch=1), trio.current_time())
        world.hang_polls = True
        await trio.sleep(10.0)
        # rounds start every 2 s (t = 2, 4, 6, 8: the t = 0 round found no coordinator yet) and each
        # ended at its 1 s timeout, recorded as a failed poll of both coordinators
        assert m.counters["polls_failed"] == 2 * 4
        assert m.ix.polls[COORD].error == "timeout"
        world.hang_polls = False
        world.busy = 2
        await trio.sleep(POLL_S + TICK_S)
        assert m.ix.polls[COORD].ok and m.ix.saturated_now(MID, trio.current_time())
        await trio.sleep(POLL_S)  # a second saturated poll rise_s (2 s) later: the smoothed signal is on
        assert m.ix.recruiting(MID)
        nursery.cancel_scope.cancel()


def test_poller_errors_are_swarm_errors() -> None:
    assert issubclass(TransportError, SwarmError)
