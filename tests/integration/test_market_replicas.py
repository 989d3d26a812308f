"""Several ``Market`` replicas on one real PostgreSQL database (``market.replica``, ``--replica``).

Each replica is a ``Market`` over its own ``PostgresStore(shared=True)``; they run in threads of their own
where the test is about concurrency. What must hold across replicas: a lease is granted once (no two
volunteers sent for the same scarce slice), a replayed signed counter is refused by every replica, credit
reports through either replica add up, one leader runs the tick and the others read its boosts and maps,
heartbeat marks travel so the leader does not expire a volunteer another replica hears, and a database
restart loses nothing.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import msgspec
import pytest

from market.core.records import HeldState, ModelManifest
from market.policy import MarketPolicy
from market.state import Market, NoOffer, Offer
from market.store_pg import PostgresStore, open_postgres_store
from swarm.errors import RequestError, StoreError
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageHeartbeat,
    HeldSlice,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)

MID = "replica-0123456789ab"
URL = "http://c1.test"
POLICY = MarketPolicy(heartbeat_ttl_s=30.0, lease_s=600.0, header_allowance=0, hold_s=10.0, poll_stale_s=5.0,
                      max_leases_per_address=1000, max_identities_per_address=1000)


def manifest() -> ModelManifest:
    # 2 layers x 8 experts, 4 experts a volunteer: 4 slices, target 1 -> exactly 4 leases to give
    return ModelManifest(model_id=MID, arch="qwen3moe", n_layer=2, n_expert=8, bytes_per_expert=[1000, 1000])


def replica(url: str, seed: int, now: float = 0.0) -> tuple[Market, PostgresStore]:
    store = open_postgres_store(url, shared=True)
    return Market(store, POLICY, now=now, rng=random.Random(seed), link=store), store


@pytest.fixture
def pair(pg_url: str) -> Any:
    a, sa = replica(pg_url, 1)
    b, sb = replica(pg_url, 2)
    yield a, b
    sa.close()
    sb.close()


def poll(peer: str, seq: int) -> VolunteerRequest:
    return VolunteerRequest(peer, max_experts=4, epoch=1, sequence=seq)


def hb(peer: str, seq: int, s: Any, state: HeldState = HeldState.LOADING) -> CoverageHeartbeat:
    return CoverageHeartbeat(peer, 1, seq, [f"/ip4/10.0.0.1/tcp/1/p2p/{peer}"],
                             [HeldSlice(MID, s.layer, s.lo, s.hi, state)], 0.0, protocols=[2])


def test_replicas_share_a_second_market_and_a_lone_market_still_excludes_them(pg_url: str) -> None:
    a = open_postgres_store(pg_url, shared=True)
    b = open_postgres_store(pg_url, shared=True)  # replicas: both open
    with pytest.raises(StoreError) as ei:  # a market without --replica (or migrate) is refused meanwhile
        open_postgres_store(pg_url)
    assert ei.value.code == "store_in_use" and "--replica" in str(ei.value)
    a.close()
    b.close()
    lone = open_postgres_store(pg_url)
    with pytest.raises(StoreError) as ei:
        open_postgres_store(pg_url, shared=True)
    assert ei.value.code == "store_in_use"
    lone.close()


def test_concurrent_polls_through_two_replicas_lease_each_scarce_slice_once(pair: Any) -> None:
    a, b = pair
    a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    offers: list[Offer] = []
    nothing = Counter[str]()
    lock = threading.Lock()
    start = threading.Barrier(2)

    def run(m: Market, tag: str) -> None:
        start.wait()
        for i in range(12):
            got = m.volunteer(poll(f"12D3Koo{tag}{i}", 1), 1.0 + i / 100)
            with lock:
                if isinstance(got, Offer):
                    offers.append(got)
                else:
                    assert isinstance(got, NoOffer)
                    nothing[got.reason.value] += 1

    threads = [threading.Thread(target=run, args=(m, tag)) for m, tag in ((a, "A"), (b, "B"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    slices = sorted(str(o.lease.slice) for o in offers)
    assert len(slices) == 4 and len(set(slices)) == 4, slices  # each slice once, never twice
    assert sum(nothing.values()) == 20 and set(nothing) == {"nothing_scarce"}, nothing
    for m in (a, b):  # both replicas know every lease once their next call caught up
        m.tick(2.0)
        assert sorted(str(x.slice) for x in m.ix.leases.values()) == slices
        assert m.ix.counts == m.ix.recount()


def test_a_replayed_counter_is_refused_by_the_other_replica(pair: Any) -> None:
    a, b = pair
    a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    first = a.volunteer(poll("12D3KooWp", 5), 1.0)
    assert isinstance(first, Offer)
    with pytest.raises(RequestError) as ei:  # the same signed poll, replayed to the other replica
        b.volunteer(poll("12D3KooWp", 5), 1.5)
    assert (ei.value.status, ei.value.code) == (409, "replayed_sequence")
    renewed = b.volunteer(poll("12D3KooWp", 6), 2.0)  # the next one is fine there, and it is the same lease
    assert isinstance(renewed, Offer) and renewed.lease == first.lease
    b.heartbeat(hb("12D3KooWp", 7, first.lease.slice), 3.0)
    with pytest.raises(RequestError) as ei:
        a.heartbeat(hb("12D3KooWp", 7, first.lease.slice), 3.5)
    assert (ei.value.status, ei.value.code) == (409, "replayed_sequence")
    a.heartbeat(hb("12D3KooWp", 8, first.lease.slice, HeldState.SERVING), 4.0)
    assert a.ix.coverage["12D3KooWp"][first.lease.slice].state is HeldState.SERVING


def test_credit_reported_through_both_replicas_adds_up(pair: Any) -> None:
    a, b = pair
    a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    got = b.volunteer(poll("12D3KooWw", 1), 1.0)
    assert isinstance(got, Offer)

    def report(m: Market, n: int, now: float) -> None:
        for i in range(n):
            m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
                ReportedWorker(peer_id="12D3KooWw", calls=1, rows=1, pairs=10)]), now + i / 1000)

    threads = [threading.Thread(target=report, args=(m, 25, 2.0)) for m in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for m in (a, b):
        m.tick(3.0)
        assert m.ix.credit["12D3KooWw"].pairs == 500  # 50 reports of 10 pairs: none lost, none twice


def test_one_leader_ticks_and_the_others_read_its_boost_and_maps(pg_url: str) -> None:
    a, sa = replica(pg_url, 1)
    b, sb = replica(pg_url, 2)
    try:
        a.tick(0.0)
        b.tick(0.0)
        assert (a.leading, b.leading) == (True, False)
        a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
        for t in range(0, 30):  # the coordinator saturated, as a's polls see it
            a.record_poll(URL, 4, 4, float(t))
            b.record_poll(URL, 0, 4, float(t))  # b's own polls would say otherwise: only the leader decides
            a.tick(float(t))
            b.tick(float(t))
        assert a.ix.recruiting(MID) and b.ix.recruiting(MID)
        # the same targets and scarcities whichever replica answers (only the raw signal of each one's own
        # last poll, ``saturated_now``, is its own)
        da, db = (msgspec.structs.replace(m.demand(30.0), models=[msgspec.structs.replace(x, saturated_now=False)
                                                                   for x in m.demand(30.0).models]) for m in (a, b))
        assert da == db and {s.target for x in da.models for s in x.segments} == {2}
        got = b.volunteer(poll("12D3KooWm", 1), 30.0)
        assert isinstance(got, Offer)
        b.heartbeat(hb("12D3KooWm", 2, got.lease.slice, HeldState.SERVING), 31.0)
        assert MID in a.tick(31.5).changed_maps  # the leader builds the map; b reads it as a row
        assert MID in b.tick(31.6).changed_maps  # (and wakes its map long polls)
        assert a.dispatch_map(MID) == b.dispatch_map(MID) and a.map_version(MID) == b.map_version(MID) > 0
        assert [r.replicas[0].peer_id for la in b.dispatch_map(MID).layers for r in la.ranges if r.replicas] == \
            ["12D3KooWm"]
        sa.close()  # the leader goes: b takes over at its next tick
        b.tick(32.0)
        assert b.leading
    finally:
        sa.close()
        sb.close()


def test_heartbeats_heard_by_one_replica_keep_the_volunteer_alive_at_the_leader(pair: Any) -> None:
    a, b = pair
    a.tick(0.0)
    b.tick(0.0)
    assert a.leading and not b.leading
    a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    got = b.volunteer(poll("12D3KooWh", 1), 1.0)
    assert isinstance(got, Offer)
    seq = 2
    for t in range(2, 80, 5):  # every 5 s to b only, for longer than the 30 s TTL
        b.heartbeat(hb("12D3KooWh", seq, got.lease.slice, HeldState.SERVING), float(t))
        seq += 1
        b.tick(float(t) + 1.1)  # b shares its marks (at most every share_s)
        a.tick(float(t) + 1.2)
    assert "12D3KooWh" in a.ix.coverage  # the leader never expired it
    for t in range(80, 125, 5):  # silent now: the leader expires it after the TTL
        b.tick(float(t))
        a.tick(float(t) + 0.5)
    assert "12D3KooWh" not in a.ix.coverage
    b.tick(126.0)
    assert "12D3KooWh" not in b.ix.coverage  # and b learns it from the feed


def test_a_database_restart_mid_run_loses_nothing_and_both_replicas_carry_on(pg_server: Any) -> None:
    url = pg_server.database()
    a, sa = replica(url, 1)
    b, sb = replica(url, 2)
    try:
        a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
        first = a.volunteer(poll("12D3KooWr1", 1), 1.0)
        assert isinstance(first, Offer)
        pg_server.restart()
        second = b.volunteer(poll("12D3KooWr2", 1), 2.0)  # a fresh connection, the lock taken again
        assert isinstance(second, Offer) and second.lease.slice != first.lease.slice
        third = a.volunteer(poll("12D3KooWr3", 1), 3.0)
        assert isinstance(third, Offer)
        assert len({str(o.lease.slice) for o in (first, second, third)}) == 3
        with pytest.raises(RequestError):  # the counters survived the restart too
            b.volunteer(poll("12D3KooWr1", 1), 4.0)
        fresh, sf = replica(url, 3, now=5.0)
        try:
            assert sorted(x.peer_id for x in fresh.ix.leases.values()) == ["12D3KooWr1", "12D3KooWr2", "12D3KooWr3"]
        finally:
            sf.close()
    finally:
        sa.close()
        sb.close()


def test_a_numbered_report_resent_to_the_other_replica_is_counted_once(pair: Any) -> None:
    """A coordinator whose report's answer was lost (the replica died after committing it) sends it again, as
    it is, to another replica: refused as replayed there, so its pairs count once; the next one counts."""
    a, b = pair
    a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    got = a.volunteer(poll("12D3KooWc", 1), 1.0)
    assert isinstance(got, Offer)
    rep = CoordinatorReport(url=URL, model_id=MID, epoch=7, sequence=1,
                            workers=[ReportedWorker(peer_id="12D3KooWc", calls=1, rows=1, pairs=10)])
    a.report(rep, 2.0)
    with pytest.raises(RequestError) as ei:
        b.report(rep, 2.5)
    assert (ei.value.status, ei.value.code) == (409, "replayed_sequence")
    b.report(msgspec.structs.replace(rep, sequence=2), 3.0)
    a.tick(4.0)
    assert a.ix.credit["12D3KooWc"].pairs == 20


def test_replicas_seeded_alike_never_give_two_leases_one_id(pg_url: str) -> None:
    """``--seed`` makes lease ids reproducible; two replicas with the same seed draw the same ids, and a
    second lease under the first one's id would replace it: the id is drawn again while it is taken."""
    a, sa = replica(pg_url, 7)
    b, sb = replica(pg_url, 7)
    try:
        a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
        x = a.volunteer(poll("12D3KooWx", 1), 1.0)
        y = b.volunteer(poll("12D3KooWy", 1), 1.0)
        assert isinstance(x, Offer) and isinstance(y, Offer) and x.lease.lease_id != y.lease.lease_id
        again = b.volunteer(poll("12D3KooWx", 2), 2.0)
        assert isinstance(again, Offer) and again.lease == x.lease  # x's lease stands
        assert b.ix.counts == b.ix.recount()
    finally:
        sa.close()
        sb.close()


def test_a_re_poll_takes_no_lock_but_its_counter_is_still_shared(pair: Any) -> None:
    a, b = pair
    a.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    first = a.volunteer(poll("12D3KooWq", 1), 1.0)
    assert isinstance(first, Offer)
    b.tick(1.1)  # b catches up (as every tick does)
    calls = b.store.calls  # type: ignore[attr-defined]
    again = b.volunteer(poll("12D3KooWq", 2), 1.5)
    assert isinstance(again, Offer) and again.renewed and again.lease == first.lease
    assert b.counters["offers_renewed_unlocked"] == 1 and b.store.calls == calls  # type: ignore[attr-defined]
    with pytest.raises(RequestError) as ei:
        a.volunteer(poll("12D3KooWq", 2), 1.6)
    assert ei.value.code == "replayed_sequence"
    late = b.volunteer(poll("12D3KooWq", 3), 1.1 + POLICY.fresh_s + 0.5)  # memory too old: the locked way
    assert isinstance(late, Offer) and late.lease == first.lease and b.counters["offers_renewed_unlocked"] == 1
