"""What a hostile stranger or a careless operator could still do to the market (issue 31), at the
state level (``market.state.Market`` over an in-memory store, no event loop):

- a store that refuses a batch leaves memory as the store has it (item 8); one that cannot be read back
  either fails every call that may commit until it can (issue 29);
- a holding counts only while it can be proven: ``loading`` has a download deadline, the per-address cap
  counts holdings (item 2);
- throwaway identities cost no rows and are forgotten soon; identities per address are bounded (item 5);
- a dead coordinator's model stops attracting volunteers, and goes (item 7);
- an operator token's reports are bounded: credit for holders only, within caps, quarantines with
  evidence; epochs and models bounded (item 9).
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pytest

from market.core.records import HeldState, ModelManifest, SliceRef
from market.policy import MarketPolicy
from market.state import Market, Offer
from market.store import Change, InMemoryStore, MemoryBacking
from swarm.errors import RequestError, StoreError
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageHeartbeat,
    EvidenceMethod,
    HeldSlice,
    QuarantineEvidence,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)

MID = "hard-0123456789ab"
URL = "http://c1.test"
SERVING, LOADING = HeldState.SERVING, HeldState.LOADING
POLICY = MarketPolicy(heartbeat_ttl_s=6.0, cooldown_s=5.0, lease_s=10.0, hold_s=10.0, poll_stale_s=5.0,
                      header_allowance=0, proof_grace_s=0.0)


class FlakyStore(InMemoryStore):
    """An in-memory store whose next ``apply`` fails while ``fail`` is set (a full disk, say)."""

    def __init__(self, backing: MemoryBacking | None = None) -> None:
        super().__init__(backing)
        self.fail = False

    def apply(self, changes: Sequence[Change]) -> None:
        if self.fail and changes:
            raise StoreError("database or disk is full", code="store_error")
        super().apply(changes)


def manifest(model_id: str = MID, n_layer: int = 2, n_expert: int = 8, bpe: int = 1000) -> ModelManifest:
    return ModelManifest(model_id=model_id, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert, d_model=16,
                         d_expert=8, bytes_per_expert=[bpe] * n_layer)


def market(policy: MarketPolicy = POLICY, store: InMemoryStore | None = None) -> Market:
    return Market(store if store is not None else InMemoryStore(), policy, now=0.0, rng=random.Random(0))


def hb(peer: str, seq: int, *slices: tuple[int, int, int, HeldState], epoch: int = 1) -> CoverageHeartbeat:
    return CoverageHeartbeat(peer, epoch, seq, [f"/ip4/10.0.0.1/tcp/1/p2p/{peer}"],
                             [HeldSlice(MID, la, lo, hi, st) for la, lo, hi, st in slices], protocols=[2])


def leased(m: Market, peer: str, now: float, *, address: str = "", max_experts: int = 4) -> SliceRef:
    got = m.volunteer(VolunteerRequest(peer, max_experts=max_experts), now, address=address)
    assert isinstance(got, Offer), got
    return got.lease.slice


def durable(m: Market) -> dict[str, Any]:
    """Everything the store holds, as memory has it (runtime facts left out)."""
    ix = m.ix
    return {
        "models": sorted(ix.models), "coordinators": dict(ix.coordinators),
        "volunteers": {p: (v.row.addrs, v.row.max_bytes) for p, v in ix.volunteers.items() if getattr(v, "stored", True)},
        "coverage": {p: dict(r) for p, r in ix.coverage.items()}, "leases": dict(ix.leases),
        "lease_of": dict(ix.lease_of), "quarantined": dict(ix.quarantined), "credit": dict(ix.credit),
        "maps": dict(ix.maps), "recruiting": {mid: ix.recruiting(mid) for mid in ix.models},
        "counts": {mid: copy.deepcopy((c.replicas, c.pending)) for mid, c in ix.counts.items()},
    }


# -- item 8: memory and store change together or not at all ------------------------------------------------


def _setup() -> tuple[Market, FlakyStore, SliceRef]:
    store = FlakyStore()
    m = market(store=store)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    s = leased(m, "a", 1.0)
    m.heartbeat(hb("a", 1, (s.layer, s.lo, s.hi, SERVING)), 1.5)
    m.tick(2.0)
    return m, store, s


SEQ = itertools.count(2)
CALLS: dict[str, Callable[[Market, SliceRef], object]] = {
    "register": lambda m, s: m.register(RegisterModels(URL, [manifest(), manifest("two-0123456789ab")], epoch=11), 3.0),
    "register another coordinator": lambda m, s: m.register(RegisterModels("http://c2.test", [manifest()], epoch=1), 3.0),
    "poll": lambda m, s: m.volunteer(VolunteerRequest("b", max_experts=4), 3.0),
    # releases everything; a new sequence each time (a refused heartbeat's counter stays used: replays stay refused)
    "heartbeat": lambda m, s: m.heartbeat(hb("a", next(SEQ)), 3.0),
    "report": lambda m, s: m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="a", calls=5, rows=5, verified=5, pairs=10)]), 3.0),
    "tick": lambda m, s: m.tick(100.0),  # "a" has been silent past its TTL: expired
}


@pytest.mark.parametrize("call", CALLS)
def test_a_refused_batch_leaves_memory_as_the_store_has_it(call: str) -> None:
    m, store, s = _setup()
    before = durable(m)
    events = m.events().last_seq
    store.fail = True
    with pytest.raises(StoreError):
        CALLS[call](m, s)
    assert durable(m) == before
    assert m.ix.counts == m.ix.recount()
    assert [e.seq for e in m.events().events if e.seq > events] == []
    # the same call succeeds once the store takes writes again, and then memory matches a restart
    store.fail = False
    CALLS[call](m, s)
    m.tick(100.5)
    restarted = market(store=FlakyStore(store.backing))
    restarted.tick(100.5)
    after, again = durable(m), durable(restarted)
    for k in ("models", "coordinators", "coverage", "leases", "quarantined", "credit", "maps"):
        assert after[k] == again[k], k


def test_a_refused_registration_is_not_hosted_and_the_volunteer_counter_survives_a_refused_heartbeat() -> None:
    m, store, s = _setup()
    store.fail = True
    with pytest.raises(StoreError):
        m.register(RegisterModels("http://c2.test", [manifest("two-0123456789ab")], epoch=1), 3.0)
    assert "two-0123456789ab" not in m.ix.models and "http://c2.test" not in m.ix.coordinators
    assert m.ix.hosts_of(MID) == [URL]
    with pytest.raises(StoreError):
        m.heartbeat(hb("a", 7), 3.5)
    assert m.ix.coverage["a"] and m.ix.volunteers["a"].row.sequence == 7  # a replay of 7 stays refused
    store.fail = False
    with pytest.raises(Exception, match="not newer"):
        m.heartbeat(hb("a", 7), 4.0)
    m.heartbeat(hb("a", 8, (s.layer, s.lo, s.hi, SERVING)), 4.0)
    assert list(m.ix.coverage["a"]) == [s]


class DownStore(FlakyStore):
    """A store whose server is gone while ``down`` is set: writes and reads fail (PostgreSQL unreachable)."""

    def __init__(self, backing: MemoryBacking | None = None) -> None:
        super().__init__(backing)
        self.down = False

    def load(self) -> Any:
        if self.down:
            raise StoreError("connection refused", code="store_error")
        return super().load()

    def apply(self, changes: Sequence[Change]) -> None:
        if self.down and changes:
            raise StoreError("connection refused", code="store_error")
        super().apply(changes)


def test_a_store_that_cannot_be_read_back_fails_every_call_that_may_commit_until_it_can() -> None:
    """The refused batch cannot be undone by reloading while the store is unreadable: no later call decides
    from that memory (each raises ``StoreError``: 503); once the store answers, memory is the store's."""
    store = DownStore()
    m = market(store=store)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    s = leased(m, "a", 1.0)
    m.heartbeat(hb("a", 1, (s.layer, s.lo, s.hi, SERVING)), 1.5)
    m.tick(2.0)
    store.down = True
    with pytest.raises(StoreError):
        m.volunteer(VolunteerRequest("b", max_experts=4), 3.0)  # a lease decided, its write refused
    for call in (lambda: m.volunteer(VolunteerRequest("c", max_experts=4), 3.1),
                 lambda: m.heartbeat(hb("a", 2, (s.layer, s.lo, s.hi, SERVING)), 3.2),
                 lambda: m.register(RegisterModels(URL, [manifest()], epoch=11), 3.3),
                 lambda: m.tick(3.4)):
        with pytest.raises(StoreError):
            call()
    store.down = False
    got = m.volunteer(VolunteerRequest("c", max_experts=4), 4.0)
    assert isinstance(got, Offer)
    assert "b" not in m.ix.lease_of and list(m.ix.lease_of) == ["c"]
    assert m.ix.counts == m.ix.recount()
    restarted = market(store=DownStore(store.backing))
    after, again = durable(m), durable(restarted)
    for k in ("models", "coordinators", "coverage", "leases", "quarantined", "maps"):
        assert after[k] == again[k], k


# -- item 2: a holding counts only while it can be proven ----------------------------------------------------

ONE_CHUNK = manifest(n_layer=1, n_expert=4)  # one slice of 4 experts: whoever holds it holds all there is
SQUAT = msgspec.structs.replace(POLICY, heartbeat_ttl_s=30.0, download_grace_s=60.0,
                                download_floor_bytes_per_s=1000.0, dropped_penalty_s=300.0)


def test_a_squatter_heartbeating_loading_stops_counting_at_its_download_deadline_and_an_honest_one_gets_it() -> None:
    """The deadline is the grace plus the slice's bytes at the floor rate: 60 s + 4 x 1000 B / 1000 B/s."""
    m = market(SQUAT)
    m.register(RegisterModels(URL, [ONE_CHUNK], epoch=10), 0.0)
    s = leased(m, "squatter", 1.0)
    t, seq = 2.0, 1
    while t < 65.0:  # heartbeats "loading" and never downloads
        ack = m.heartbeat(hb("squatter", seq, (s.layer, s.lo, s.hi, LOADING)), t)
        assert [d.action for d in ack.slices] == ["keep"]
        m.tick(t + 0.01)
        assert m.ix.counts[MID].pending[0] == [1, 1, 1, 1], t  # on its way (it says): nobody else is sent for it
        t, seq = t + 5.0, seq + 1
    assert m.volunteer(VolunteerRequest("honest", max_experts=4), 65.5).reason.value == "nothing_scarce"  # type: ignore[union-attr]
    m.tick(66.5)  # past 2 + 64 s: dropped
    assert "squatter" not in m.ix.coverage and m.ix.counts[MID].pending[0] == [0, 0, 0, 0]
    assert m.ix.counts == m.ix.recount()
    assert [e.kind for e in m.events().events][-1] == "download_overdue"
    # its next heartbeat is told why; its next poll does not get the same slice again (a while)
    ack = m.heartbeat(hb("squatter", seq, (s.layer, s.lo, s.hi, LOADING)), 67.0)
    assert [(d.action, d.reason) for d in ack.slices] == [("release", "download_overdue")]
    again = m.volunteer(VolunteerRequest("squatter", max_experts=4), 67.5)
    assert not isinstance(again, Offer)
    assert leased(m, "honest", 68.0) == s  # re-offered
    assert not isinstance(m.volunteer(VolunteerRequest("squatter", max_experts=4), 67.5 + 301.0), Offer)  # taken now


def test_a_slice_that_loads_in_time_and_serves_is_not_dropped() -> None:
    m = market(SQUAT)
    m.register(RegisterModels(URL, [ONE_CHUNK], epoch=10), 0.0)
    s = leased(m, "v", 1.0)
    m.heartbeat(hb("v", 1, (s.layer, s.lo, s.hi, LOADING)), 2.0)
    m.heartbeat(hb("v", 2, (s.layer, s.lo, s.hi, SERVING)), 60.0)
    for t in range(61, 200, 5):
        m.heartbeat(hb("v", t, (s.layer, s.lo, s.hi, SERVING)), float(t))
        m.tick(t + 0.5)
    assert list(m.ix.coverage["v"]) == [s] and m.ix.counts[MID].replicas[0] == [1, 1, 1, 1]


def test_the_deadline_grows_with_the_slice() -> None:
    m = market(SQUAT)
    big = manifest(model_id="big-0123456789ab", n_layer=1, n_expert=4, bpe=1_000_000)  # 4 MB at 1000 B/s
    m.register(RegisterModels(URL, [big], epoch=10), 0.0)
    got = m.volunteer(VolunteerRequest("v", max_experts=4), 1.0)
    assert isinstance(got, Offer)
    s = got.lease.slice
    body = CoverageHeartbeat("v", 1, 1, [], [HeldSlice(s.model_id, s.layer, s.lo, s.hi, LOADING)], protocols=[2])
    m.heartbeat(body, 2.0)
    for t in range(10, 4000, 10):  # heartbeats keep it alive; 60 + 4000 s allowed
        m.heartbeat(msgspec.structs.replace(body, sequence=t), float(t))
        m.tick(t + 0.5)
    assert "v" in m.ix.coverage
    for t in range(4000, 4100, 10):
        m.heartbeat(msgspec.structs.replace(body, sequence=t), float(t))
        m.tick(t + 0.5)
    assert "v" not in m.ix.coverage


def test_one_address_holds_at_most_the_cap_through_lease_to_coverage_conversion() -> None:
    """Each identity takes a lease and converts it into coverage at once: the cap counts holdings."""
    policy = msgspec.structs.replace(POLICY, max_leases_per_address=3, heartbeat_ttl_s=60.0)
    m = market(policy)
    m.register(RegisterModels(URL, [manifest(n_layer=8, n_expert=8)], epoch=10), 0.0)
    held = 0
    for i in range(10):
        peer = f"sybil-{i}"
        got = m.volunteer(VolunteerRequest(peer, max_experts=4), 1.0 + i, address="10.9.9.9")
        if isinstance(got, Offer):
            s = got.lease.slice
            m.heartbeat(hb(peer, 1, (s.layer, s.lo, s.hi, SERVING)), 1.5 + i, address="10.9.9.9")
            held += 1
        else:
            assert got.reason.value == "address_cap"
    assert held == 3 and sum(len(r) for r in m.ix.coverage.values()) == 3
    # one identity polling again and again is held to the same cap
    m2 = market(policy)
    m2.register(RegisterModels(URL, [manifest(n_layer=8, n_expert=8)], epoch=10), 0.0)
    slices = []
    for i in range(10):
        got = m2.volunteer(VolunteerRequest("greedy", max_experts=4), 1.0 + i, address="10.9.9.9")
        if isinstance(got, Offer):
            slices.append(got.lease.slice)
            m2.heartbeat(hb("greedy", 1 + i, *((x.layer, x.lo, x.hi, SERVING) for x in slices)), 1.5 + i,
                         address="10.9.9.9")
    assert len(slices) == 3 and len(m2.ix.coverage["greedy"]) == 3
    # another address is not affected
    assert isinstance(m2.volunteer(VolunteerRequest("other", max_experts=4), 20.0, address="10.1.1.1"), Offer)


# -- item 5: throwaway identities cost no rows, and not for long ---------------------------------------------


def test_throwaway_identities_store_no_row_and_are_forgotten_soon() -> None:
    store = InMemoryStore()
    m = market(msgspec.structs.replace(POLICY, identity_idle_s=600.0), store=store)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    rows_before = {t: len(r) for t, r in store.backing.tables.items()}
    for i in range(3000):  # one heartbeat each, claiming a slice nobody leased to them: refused
        ack = m.heartbeat(hb(f"throwaway-{i}", 1, (0, 0, 4, SERVING)), 1.0 + i * 0.01, address=f"10.{i // 250}.{i % 250}.1")
        assert [d.reason for d in ack.slices] == ["not_assigned"]
    assert {t: len(r) for t, r in store.backing.tables.items()} == rows_before  # not a row more
    assert len(m.ix.volunteers) == 3000
    m.tick(1.0 + 3000 * 0.01 + 601.0)
    assert len(m.ix.volunteers) == 0 and m.addresses.peer_addr == {}
    # an identity that gets something to hold is stored from then on, and outlives a restart
    s = leased(m, "real", 700.0, address="10.200.0.1")
    m.heartbeat(hb("real", 1, (s.layer, s.lo, s.hi, LOADING)), 701.0, address="10.200.0.1")
    assert set(store.backing.tables["volunteers"]) == {"real"}
    assert "real" in market(store=InMemoryStore(store.backing)).ix.volunteers


def test_one_address_speaks_for_a_bounded_number_of_identities() -> None:
    m = market(msgspec.structs.replace(POLICY, max_identities_per_address=8))
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    for i in range(8):
        m.heartbeat(hb(f"p{i}", 1), 1.0, address="10.0.0.7")
    with pytest.raises(RequestError) as e:
        m.heartbeat(hb("p8", 1), 1.0, address="10.0.0.7")
    assert (e.value.status, e.value.code) == (429, "too_many_identities")
    assert m.volunteer(VolunteerRequest("p9", max_experts=4), 1.0, address="10.0.0.7").reason.value == "address_cap"  # type: ignore[union-attr]
    m.heartbeat(hb("p0", 2), 2.0, address="10.0.0.7")  # a known one still is
    m.heartbeat(hb("q0", 1), 2.0, address="10.0.0.8")  # and another address
    # IPv6: one host picks from a whole /64, so the /64 is what counts
    for i in range(8):
        m.heartbeat(hb(f"v6-{i}", 1), 3.0, address=f"2001:db8::{i + 1:x}")
    with pytest.raises(RequestError):
        m.heartbeat(hb("v6-8", 1), 3.0, address="2001:db8::ffff:1")
    m.heartbeat(hb("v6-9", 1), 3.0, address="2001:db8:0:1::1")  # the next /64
    # ... until they fall silent
    m.tick(2.0 + 601.0)
    m.heartbeat(hb("p8", 1), 604.0, address="10.0.0.7")


# -- item 7: a dead coordinator's model stops attracting volunteers -----------------------------------------

GONE = msgspec.structs.replace(POLICY, host_down_s=30.0, coordinator_gc_s=600.0, model_gc_s=300.0)


def test_a_coordinator_whose_polls_fail_stops_hosting_then_is_deregistered_and_its_model_dropped() -> None:
    m = market(GONE)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    m.record_poll(URL, 0, 4, 1.0)
    for t in range(2, 31):  # failing since 1 s: still hosting until 31 s
        m.record_poll_failure(URL, "poll_failed: connection refused", float(t))
    assert m.ix.hosts_of(MID) == [URL] and m.demand(30.0).models[0].hosted
    m.record_poll_failure(URL, "poll_failed: connection refused", 31.0)
    assert m.ix.hosts_of(MID) == []
    assert not m.demand(31.0).models[0].hosted
    assert m.volunteer(VolunteerRequest("v", max_experts=4), 31.5).reason.value == "no_models"  # type: ignore[union-attr]
    [c] = m.recruitment(31.5).models[0].coordinators
    assert (c.url, c.hosting, c.ok) == (URL, False, False)  # shown, marked
    assert [e.kind for e in m.events().events][-1] == "host_down"
    # it answers again: hosting again
    m.record_poll(URL, 0, 4, 40.0)
    assert m.ix.hosts_of(MID) == [URL] and isinstance(m.volunteer(VolunteerRequest("v", max_experts=4), 40.5), Offer)
    # silent for good: down after 30 s, deregistered 600 s after its last answer, its model 300 s after that
    for t in range(41, 700, 5):
        m.record_poll_failure(URL, "timeout", float(t))
        m.tick(t + 0.1)
    assert URL not in m.ix.coordinators and MID in m.ix.models  # gone at 40 + 600 s (+ the 10 s gc rhythm)
    for t in range(700, 1000, 5):
        m.tick(float(t))  # the model: 300 s after its last coordinator went
    assert MID not in m.ix.models and m.ix.leases == {} and m.ix.coverage == {}
    assert m.ix.counts == m.ix.recount()
    restarted = market(GONE, store=InMemoryStore(m.store.backing))  # type: ignore[attr-defined]
    assert restarted.ix.models == {} and restarted.ix.coordinators == {}


def test_a_live_second_coordinator_keeps_the_model_hosted() -> None:
    m = market(GONE)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    m.register(RegisterModels("http://c2.test", [manifest()], epoch=10), 0.0)
    for t in range(1, 60):
        m.record_poll_failure(URL, "timeout", float(t))
        m.record_poll("http://c2.test", 0, 4, float(t))
    assert m.ix.hosts_of(MID) == ["http://c2.test"] and m.download_sources(MID) == ["http://c2.test"]
    assert m.demand(60.0).models[0].hosted


def test_a_model_left_out_of_a_registration_is_dropped_after_model_gc_s() -> None:
    m = market(GONE)
    m.register(RegisterModels(URL, [manifest(), manifest("two-0123456789ab")], epoch=10), 0.0)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 1.0)
    m.tick(1.0)
    m.tick(250.0)
    assert "two-0123456789ab" in m.ix.models
    m.tick(320.0)
    assert set(m.ix.models) == {MID}


# -- item 9: what an operator token may do ----------------------------------------------------------------

def evidence(layer: int = 0, lo: int = 0, hi: int = 4, *, remote: str = "b" * 64) -> QuarantineEvidence:
    return QuarantineEvidence(layer=layer, lo=lo, hi=hi, input_sha256="a" * 64, remote_sha256=remote,
                              local_sha256="c" * 64, method=EvidenceMethod.BIT_EXACT, detail="8 of 8 rows differ")


def _two_volunteers() -> tuple[Market, SliceRef, SliceRef]:
    m = market()
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    a = leased(m, "a", 1.0)
    m.heartbeat(hb("a", 1, (a.layer, a.lo, a.hi, SERVING)), 1.5)
    b = leased(m, "b", 2.0)  # leased, not reported yet: holds it by the market's word
    return m, a, b


def test_credit_goes_only_to_workers_holding_the_coordinators_model_within_a_per_report_cap() -> None:
    m, a, b = _two_volunteers()
    huge = 2**62
    ack = m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="a", calls=3, rows=3, verified=3, pairs=huge),
        ReportedWorker(peer_id="b", calls=1, rows=1, pairs=10),
        ReportedWorker(peer_id="never-volunteered", calls=9, rows=9, verified=9, pairs=1000)]), 3.0)
    assert ack.ignored == ["never-volunteered"]
    assert m.volunteer_credit("a", 3.0).pairs == POLICY.max_report_pairs  # clamped
    assert m.volunteer_credit("b", 3.0).pairs == 10
    assert "never-volunteered" not in m.ix.credit and "never-volunteered" not in m.ix.served
    for _ in range(4):  # totals stay within int64 however many reports
        m.report(CoordinatorReport(url=URL, model_id=MID, workers=[ReportedWorker(peer_id="a", pairs=huge)]), 4.0)
    assert m.ix.credit["a"].pairs <= 2**63 - 1
    # the wire refuses counts past int64
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"peer_id": "a", "pairs": 9223372036854775808}', type=ReportedWorker)


def test_a_quarantine_without_evidence_is_refused_whole_and_one_with_evidence_is_kept_and_shown() -> None:
    m, a, b = _two_volunteers()
    before = durable(m)
    for w, code in ((ReportedWorker(peer_id="a", quarantine="trust me"), "400 missing_evidence"),
                    (ReportedWorker(peer_id="a", quarantine="x", evidence=evidence(remote="c" * 64)), "400 bad_evidence"),
                    (ReportedWorker(peer_id="a", evidence=evidence(5, 0, 4)), "400 bad_evidence")):
        with pytest.raises(RequestError) as e:
            m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
                ReportedWorker(peer_id="b", pairs=10, verified=1), w]), 3.0)
        assert f"{e.value.status} {e.value.code}" == code
        assert durable(m) == before  # refused whole: b got no credit either
    with pytest.raises(msgspec.ValidationError):  # a method the market does not know
        msgspec.json.decode(msgspec.json.encode({**msgspec.to_builtins(evidence()), "method": "vibes"}),
                            type=QuarantineEvidence)
    # evidence for a range the worker does not hold: nothing happens to it
    other = (a.layer + 1) % 2
    ack = m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="a", quarantine="x", evidence=evidence(other, 0, 8))]), 3.0)
    assert ack.quarantined == [] and ack.ignored == ["a"] and "a" in m.ix.coverage
    ev = evidence(a.layer, a.lo, a.hi)
    ack = m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="a", quarantine="layer 1: 8 of 8 differ", evidence=ev)]), 4.0)
    assert ack.quarantined == ["a"] and "a" not in m.ix.coverage
    c = m.volunteer_credit("a", 5.0)
    assert c.quarantine_evidence == ev and c.quarantine_reason == "layer 1: 8 of 8 differ"
    assert "bit_exact" in m.events().events[-1].detail
    restarted = market(store=InMemoryStore(m.store.backing))  # type: ignore[attr-defined]
    assert restarted.volunteer_credit("a", 5.0).quarantine_evidence == ev
    # an older coordinator's report without quarantines still decodes and counts
    old = msgspec.json.decode(b'{"url": "http://c1.test", "model_id": "hard-0123456789ab", "workers": '
                              b'[{"peer_id": "b", "calls": 1, "rows": 1, "verified": 1, "pairs": 2}]}',
                              type=CoordinatorReport)
    assert m.report(old, 6.0).ignored == []


def test_registration_epochs_models_per_registration_and_in_all_are_bounded() -> None:
    m = market(msgspec.structs.replace(POLICY, max_models=20))
    now = 1_000_000.0
    m.register(RegisterModels(URL, [manifest()], epoch=int((now + 540) * 1000)), now)  # 9 min ahead: clock skew
    with pytest.raises(RequestError) as e:
        m.register(RegisterModels("http://c2.test", [manifest()], epoch=int((now + 660) * 1000)), now)
    assert e.value.code == "bad_epoch"
    with pytest.raises(msgspec.ValidationError):  # 16 models a registration, on the wire
        msgspec.json.decode(msgspec.json.encode(RegisterModels(URL, [manifest(f"m{i}-0123") for i in range(17)])),
                            type=RegisterModels)
    m.register(RegisterModels("http://c3.test", [manifest(f"m{i}-0123") for i in range(16)], epoch=1), now)
    with pytest.raises(RequestError) as e:
        m.register(RegisterModels("http://c4.test", [manifest(f"n{i}-0123") for i in range(4)], epoch=1), now)
    assert (e.value.status, e.value.code) == (409, "too_many_models")
    assert len(m.ix.models) == 17
