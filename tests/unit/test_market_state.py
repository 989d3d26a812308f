"""``market.state.Market`` without an event loop: registration, pull, heartbeats, directives,
restore-on-deficit, map versions across restarts, incremental counts vs a recount, and the
views (``market.views``) built on the same core rules."""

from __future__ import annotations

import random

import msgspec
import pytest

from market.core.assign import NoOfferReason
from market.core.records import CoverageRow, HeldState, ModelManifest, SliceRef
from market.core.recruit import SpeedReport
from market.policy import MarketPolicy
from market.state import Market, NoOffer, Offer
from market.store import InMemoryStore, MemoryBacking, Put
from market.views import state_name
from swarm.errors import RequestError
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageHeartbeat,
    DownloadProgress,
    EvidenceMethod,
    HeldSlice,
    ProvenSlice,
    QuarantineEvidence,
    RegisterModels,
    ReportedWorker,
    RoutedRange,
    VolunteerRequest,
)

MID = "state-0123456789ab"
URL = "http://c1.test"
# these tables report coverage directly: the lease rule (coverage only from assignment) is off here and
# has its own test below, and is on in the scenario, API and process tests (their volunteers poll first)
POLICY = MarketPolicy(heartbeat_ttl_s=6.0, cooldown_s=5.0, lease_s=10.0, hold_s=10.0, poll_stale_s=5.0,
                      header_allowance=0, coverage_requires_lease=False)


def evidence(layer: int, lo: int, hi: int) -> QuarantineEvidence:
    """Quarantine evidence as a coordinator sends it (bit-exact comparison: the hashes differ)."""
    return QuarantineEvidence(layer=layer, lo=lo, hi=hi, input_sha256="a" * 64, remote_sha256="b" * 64,
                              local_sha256="c" * 64, method=EvidenceMethod.BIT_EXACT)


def manifest(model_id: str = MID, n_layer: int = 2, n_expert: int = 8, bpe: int = 1000) -> ModelManifest:
    return ModelManifest(model_id=model_id, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert,
                         bytes_per_expert=[bpe] * n_layer)


def new_market(backing: MemoryBacking | None = None, now: float = 0.0, seed: int = 0) -> Market:
    return Market(InMemoryStore(backing), POLICY, now=now, rng=random.Random(seed))


def registered(backing: MemoryBacking | None = None) -> Market:
    m = new_market(backing)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    return m


def hb(peer: str, seq: int, *slices: tuple[int, int, int, HeldState], epoch: int = 1, serve_ms: int = 0,
       addrs: list[str] | None = None, load: float = 0.0, protocols: list[int] | None = None) -> CoverageHeartbeat:
    return CoverageHeartbeat(peer, epoch, seq, addrs if addrs is not None else [f"/ip4/10.0.0.1/tcp/1/p2p/{peer}"],
                             [HeldSlice(MID, la, lo, hi, st, serve_ms) for la, lo, hi, st in slices], load,
                             protocols=[2] if protocols is None else protocols)


SERVING = HeldState.SERVING
LOADING = HeldState.LOADING


def codes(fn: object) -> str:
    with pytest.raises(RequestError) as ei:
        fn()  # type: ignore[operator]
    return f"{ei.value.status} {ei.value.code}"


def test_registration_rules() -> None:
    m = registered()
    assert m.ix.hosts_of(MID) == [URL]
    assert codes(lambda: m.register(RegisterModels(URL, [manifest()], epoch=9), 1.0)) == "409 stale_registration"
    assert codes(lambda: m.register(RegisterModels("http://c2.test", [manifest(n_expert=16)]), 1.0)) == (
        "409 manifest_conflict")
    bad = msgspec.structs.replace(manifest(), bytes_per_expert=[1000])
    assert codes(lambda: m.register(RegisterModels(URL, [bad], epoch=11), 1.0)) == "400 bad_manifest"
    assert codes(lambda: m.register(RegisterModels(URL, [manifest(), manifest()], epoch=11), 1.0)) == "400 bad_manifest"
    # several coordinators may host one model; an equal epoch is a retry
    m.register(RegisterModels("http://c2.test", [manifest()], epoch=1), 1.0)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 1.0)
    assert sorted(m.ix.hosts_of(MID)) == [URL, "http://c2.test"]
    # a coordinator that stops hosting the model drops out of its sources
    m.register(RegisterModels(URL, [], epoch=12), 2.0)
    assert m.ix.hosts_of(MID) == ["http://c2.test"]


def test_pull_needs_a_budget_and_a_host() -> None:
    m = new_market()
    assert codes(lambda: m.volunteer(VolunteerRequest("p"), 0.0)) == "400 missing_budget"
    res = m.volunteer(VolunteerRequest("p", max_experts=4), 0.0)
    assert isinstance(res, NoOffer) and res.reason.value == "no_models"
    assert 4.0 <= res.retry_after_s <= 6.0
    m = registered()
    res = m.volunteer(VolunteerRequest("p", max_experts=4, models=["other-model"]), 0.0)
    assert isinstance(res, NoOffer) and res.reason.value == "no_models"
    res = m.volunteer(VolunteerRequest("p", max_bytes=999), 0.0)
    assert isinstance(res, NoOffer) and res.reason.value == "budget_too_small"


def test_idle_volunteers_are_told_to_wait_longer_the_more_of_them_wait() -> None:
    """market.core.pacing in the market: "nothing needed" answers carry a retry that grows with the idle
    pollers (policy.idle_poll_rate), so their polls stay near that rate however many there are."""
    m = new_market()
    first = m.volunteer(VolunteerRequest("p0", max_experts=4), 0.0)
    assert isinstance(first, NoOffer) and 4.0 <= first.retry_after_s <= 6.0
    for i in range(1, 4000):
        res = m.volunteer(VolunteerRequest(f"p{i}", max_experts=4), i * 0.001)
    assert isinstance(res, NoOffer) and res.reason.value == "no_models"
    want = 4000 / m.policy.idle_poll_rate  # 20 s at the default 200/s
    assert 0.8 * want <= res.retry_after_s <= 1.2 * want  # jittered by +-20 %


def test_lease_is_renewed_not_duplicated_then_consumed_by_coverage() -> None:
    m = registered()
    a = m.volunteer(VolunteerRequest("p", max_experts=4), 1.0)
    b = m.volunteer(VolunteerRequest("p", max_experts=4), 2.0)
    assert isinstance(a, Offer) and isinstance(b, Offer)
    assert b.renewed and b.lease == a.lease and b.sources == [URL]
    assert len(m.ix.leases) == 1
    s = a.lease.slice
    ack = m.heartbeat(hb("p", 1, (s.layer, s.lo, s.hi, LOADING)), 3.0)
    assert m.ix.leases == {}  # converted into a loading holding
    assert [(d.action, d.dispatched) for d in ack.slices] == [("keep", False)]
    assert m.ix.counts[MID].pending[s.layer][s.lo] == 1
    ack = m.heartbeat(hb("p", 2, (s.layer, s.lo, s.hi, SERVING)), 4.0)
    assert [(d.action, d.dispatched) for d in ack.slices] == [("keep", True)]
    assert m.ix.counts[MID].replicas[s.layer][s.lo] == 1 and m.ix.counts[MID].pending[s.layer][s.lo] == 0
    # the next pull never hands it an expert it holds
    c = m.volunteer(VolunteerRequest("p", max_experts=8), 5.0)
    assert isinstance(c, Offer) and not c.lease.slice.overlaps(s)
    assert m.ix.counts == m.ix.recount()


def test_heartbeat_refuses_unknown_slices_and_duplicates() -> None:
    m = registered()
    body = hb("p", 1, (0, 0, 4, SERVING))
    body = msgspec.structs.replace(body, slices=[*body.slices, HeldSlice("nope-model", 0, 0, 1),
                                                 HeldSlice(MID, 5, 0, 1), HeldSlice(MID, 0, 4, 99),
                                                 HeldSlice(MID, 0, 3, 3)])
    ack = m.heartbeat(body, 1.0)
    assert [(d.action, d.reason) for d in ack.slices] == [
        ("keep", ""), ("release", "unknown_model"), ("release", "bad_slice_range"), ("release", "bad_slice_range"),
        ("release", "bad_slice_range"),
    ]
    assert set(m.ix.coverage["p"]) == {SliceRef(MID, 0, 0, 4)}
    assert codes(lambda: m.heartbeat(hb("p", 2, (0, 0, 4, SERVING), (0, 0, 4, LOADING)), 2.0)) == "400 duplicate_slice"
    # the rejected heartbeat changed nothing, not even the sequence
    m.heartbeat(hb("p", 2), 3.0)
    assert "p" not in m.ix.coverage  # an empty holding deregisters


def test_map_version_grows_only_on_change_and_survives_restart() -> None:
    backing = MemoryBacking()
    m = registered(backing)
    m.tick(0.5)
    assert m.dispatch_map(MID).version == 0 and m.dispatch_map(MID).layers == []
    m.heartbeat(hb("a", 1, (0, 0, 4, SERVING)), 1.0)
    m.tick(1.25)
    v1 = m.dispatch_map(MID)
    assert v1.version == 1 and v1.peers() == {"a": ["/ip4/10.0.0.1/tcp/1/p2p/a"]}
    m.heartbeat(hb("a", 2, (0, 0, 4, SERVING)), 2.0)  # nothing changed
    m.tick(2.25)
    assert m.dispatch_map(MID).version == 1
    m.heartbeat(hb("a", 3, (0, 0, 4, SERVING), load=0.5), 3.0)  # same load bucket: no reorder
    m.tick(3.25)
    assert m.dispatch_map(MID).version == 1
    m.heartbeat(hb("a", 4, (0, 0, 4, SERVING), addrs=["/ip4/10.0.0.2/tcp/1/p2p/a"]), 4.0)
    m.tick(4.25)
    assert m.dispatch_map(MID).version == 2
    # restart: same content -> same version; a change afterwards -> version 3, never back to 1
    m2 = new_market(backing, now=5.0)
    m2.tick(5.25)
    assert m2.dispatch_map(MID) == m.dispatch_map(MID)
    m2.heartbeat(hb("a", 5), 6.0)
    m2.tick(6.25)
    assert m2.dispatch_map(MID).version == 3 and m2.dispatch_map(MID).layers == []
    assert codes(lambda: m2.dispatch_map("nope")) == "404 unknown_model"


def test_a_volunteer_that_cannot_speak_the_coordinators_protocol_is_never_mapped() -> None:
    """Heartbeats list the expert-stream versions a volunteer speaks; coordinators speak v2, so a
    v1-only volunteer (an old body without the list decodes as ``[1]``) is stored but not mapped,
    until it heartbeats again speaking v2; the list survives a market restart."""
    backing = MemoryBacking()
    m = registered(backing)
    old = CoverageHeartbeat("old", 1, 1, ["/ip4/10.0.0.1/tcp/1/p2p/old"], [HeldSlice(MID, 0, 0, 4, SERVING)])
    assert old.protocols == [1]
    m.heartbeat(old, 1.0)
    m.heartbeat(hb("new", 1, (0, 4, 8, SERVING)), 1.0)
    m.tick(1.25)
    assert m.dispatch_map(MID).peers().keys() == {"new"}
    assert m.ix.volunteers["old"].row.protocols == [1]
    m.heartbeat(hb("old", 2, (0, 0, 4, SERVING), protocols=[2, 1]), 2.0)  # upgraded
    m.tick(2.25)
    assert m.dispatch_map(MID).peers().keys() == {"old", "new"}
    assert m.ix.volunteers["old"].row.protocols == [1, 2]
    m2 = new_market(backing, now=3.0)
    m2.tick(3.25)
    assert m2.dispatch_map(MID).peers().keys() == {"old", "new"}
    m2.heartbeat(hb("old", 3, (0, 0, 4, SERVING), protocols=[1]), 4.0)  # downgraded: out again
    m2.tick(4.25)
    assert m2.dispatch_map(MID).peers().keys() == {"new"}


def test_draining_volunteer_leaves_the_map_and_retiring_one_comes_back_on_deficit() -> None:
    m = registered()
    m.heartbeat(hb("a", 1, (0, 0, 8, SERVING), serve_ms=1), 0.0)
    m.heartbeat(hb("b", 1, (0, 0, 8, SERVING), serve_ms=1), 0.1)  # its own word: proves nothing
    m.report(CoordinatorReport(url=URL, model_id=MID, workers=[ReportedWorker(peer_id="a", calls=1, rows=1, verified=1)]), 0.1)
    m.tick(0.25)
    # base target 1: b (unproven, younger) is surplus -> retired at once, out of the map
    assert m.dispatch_map(MID).peers().keys() == {"a"}
    ack = m.heartbeat(hb("b", 2, (0, 0, 8, SERVING)), 1.0)
    assert ack.slices[0].action == "drain" and ack.slices[0].release_in_s == pytest.approx(4.25)
    # a leaves (draining): b is needed again before its cooldown ends -> dispatched again
    m.heartbeat(hb("a", 2, (0, 0, 8, HeldState.DRAINING)), 2.0)
    m.tick(2.25)
    assert m.dispatch_map(MID).peers().keys() == {"b"}
    ack = m.heartbeat(hb("b", 3, (0, 0, 8, SERVING)), 3.0)
    assert (ack.slices[0].action, ack.slices[0].dispatched) == ("keep", True)
    assert m.counters["restored"] == 1
    assert m.ix.counts == m.ix.recount()


def test_release_after_cooldown_and_unknown_model_demand() -> None:
    m = registered()
    m.heartbeat(hb("a", 1, (0, 0, 8, SERVING)), 0.0)
    m.heartbeat(hb("b", 1, (0, 0, 8, SERVING)), 0.5)
    m.tick(1.0)
    assert m.heartbeat(hb("b", 2, (0, 0, 8, SERVING)), 5.9).slices[0].action == "drain"
    assert m.heartbeat(hb("b", 3, (0, 0, 8, SERVING)), 6.0).slices[0].action == "release"
    view = m.recruitment(6.0).models[0]
    assert {w.peer_id: w.slices[0].state for w in view.workers} == {"a": "dispatched", "b": "released"}
    m.heartbeat(hb("b", 4), 6.5)
    assert "b" not in m.ix.coverage
    assert codes(lambda: m.demand(7.0, ["nope"])) == "404 unknown_model"
    d = m.demand(7.0)
    assert d.models[0].segments[0].replicas == 1 and d.models[0].replicas_min == 0


def test_views_and_recruitment_share_one_saturation_rule() -> None:
    m = registered()
    m.record_poll(URL, 3, 4, 0.0)  # busy 3 >= threshold 2
    for now, want in [(5.0, True), (5.01, False)]:  # POLICY.poll_stale_s == 5.0
        view = m.recruitment(now).models[0]
        assert (view.coordinators[0].saturated, view.saturated_now) == (want, want)
        assert m.demand(now).models[0].saturated_now is want
        assert m.ix.saturated_now(MID, now) is want
        assert not view.saturated  # one poll is no sustained load (hysteresis: rise_s)


def test_the_speed_signal_of_a_coordinator_with_a_floor_replaces_busy() -> None:
    """A coordinator reporting its floor and mean active tps is saturated by them (busy 4 of 4 at 12 tps
    against a floor of 5, with room for one more: not saturated; 1 busy below the floor: saturated); a bad
    number in its report says nothing (busy decides)."""
    m = registered()
    m.record_poll(URL, 4, 4, 0.0, speed=SpeedReport(12.0, 5.0, 8.0))
    assert not m.ix.saturated_now(MID, 1.0)
    m.record_poll(URL, 1, 4, 2.0, speed=SpeedReport(4.5, 5.0, 3.0))
    assert m.ix.saturated_now(MID, 3.0) and m.recruitment(3.0).models[0].coordinators[0].saturated
    m.record_poll(URL, 1, 4, 4.0, speed=SpeedReport(float("nan"), 5.0, None))
    assert not m.ix.saturated_now(MID, 5.0)


def test_the_recruitment_view_says_what_each_volunteer_does() -> None:
    """Download progress from the volunteer's heartbeat, calls/s from coordinator reports only."""
    m = registered()
    m.heartbeat(hb("a", 1, (0, 0, 8, SERVING)), 0.0)
    body = hb("b", 1, (1, 0, 8, LOADING))
    m.heartbeat(msgspec.structs.replace(body, download=DownloadProgress(MID, 1, 0, 8, 3000, 8000)), 0.0)
    m.tick(0.25)

    def doing(now: float) -> dict[str, tuple[str, float]]:
        return {w.peer_id: (w.activity, w.calls_per_s) for w in m.recruitment(now).models[0].workers}

    assert doing(1.0) == {"a": ("idle, not proven yet", 0.0), "b": ("downloading 38 %", 0.0)}
    assert [s.progress for w in m.recruitment(1.0).models[0].workers for s in w.slices] == [None, 0.375]
    # a coordinator reports 40 answered calls (verified: proof) -> 8 calls/s over its first 5 s period
    m.report(CoordinatorReport(url=URL, model_id=MID, workers=[ReportedWorker(peer_id="a", calls=40, rows=80,
                                                                              verified=40)]), 2.0)
    m.heartbeat(msgspec.structs.replace(hb("b", 2, (1, 0, 8, LOADING)),
                                        download=DownloadProgress(MID, 1, 0, 8, 8000, 8000)), 2.0)
    assert doing(2.0) == {"a": ("serving 8.0 calls/s", 8.0), "b": ("downloading 100 %", 0.0)}
    m.heartbeat(hb("b", 3, (1, 0, 8, SERVING)), 3.0)  # downloaded: no progress any more
    m.tick(3.25)
    assert doing(30.0)["a"] == ("idle", 0.0)  # no reported call for a window: idle
    assert doing(30.0)["b"][0] == "idle, not proven yet"
    # a progress report for a slice it does not report loading is ignored
    m.heartbeat(msgspec.structs.replace(hb("b", 4, (1, 0, 8, SERVING)),
                                        download=DownloadProgress(MID, 0, 0, 8, 1, 8000)), 31.0)
    assert [s.progress for w in m.recruitment(31.0).models[0].workers for s in w.slices] == [None, None]


def test_a_flapping_load_logs_one_saturated_and_one_unsaturated_event() -> None:
    """Saturated at every other poll for 40 s (the demo's load, which flooded the event log with a
    saturated/unsaturated pair every 1-3 s): one ``saturated`` once the load lasted rise_s, one
    ``unsaturated`` hold_s after its last saturated poll; the views say saturated throughout."""
    m = registered()
    sat_views, targets = [], []
    for k in range(60):
        now = float(k)
        m.record_poll(URL, (3 if k % 2 == 0 else 1) if k < 40 else 0, 4, now)
        m.tick(now)
        view = m.recruitment(now).models[0]
        sat_views.append(view.saturated)
        targets.append(view.effective_target)
    got = [(e.kind, e.at_ms, e.detail) for e in m.events().events if e.kind in ("saturated", "unsaturated")]
    assert [(k, at) for k, at, _ in got] == [("saturated", 2000), ("unsaturated", 48000)]
    assert got[0][2] == "busy >= 2 (or below a tps floor) for 2 s (--rise-s 2): target +1, recruiting"
    assert got[1][2] == "below 2 busy (and above any tps floor) for 10 s (--hold-s 10): boost ended"
    assert sat_views == [False] * 2 + [True] * 46 + [False] * 12
    assert targets == [1] * 2 + [2] * 46 + [1] * 12  # the boost follows the signal: one rise, one fall


@pytest.mark.parametrize(
    ("state", "retiring_since", "now", "want"),
    [
        (SERVING, None, 1.0, "dispatched"),
        (LOADING, None, 1.0, "loading"),
        (HeldState.DRAINING, None, 1.0, "draining"),
        (SERVING, 1.0, 5.9, "retiring"),  # the heartbeat answer is "drain"
        (LOADING, 1.0, 2.0, "retiring"),
        (SERVING, 1.0, 6.0, "released"),  # POLICY.cooldown_s == 5.0: the answer is "release"
    ],
)
def test_dashboard_state_name(state: HeldState, retiring_since: float | None, now: float, want: str) -> None:
    row = CoverageRow("p", SliceRef(MID, 0, 0, 4), state, 0.0, retiring_since)
    assert state_name(row, now, POLICY.cooldown_s) == want


@pytest.mark.parametrize("seed", range(5))
def test_incremental_counts_match_a_recount_after_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    backing = MemoryBacking()
    m = registered(backing)
    seqs: dict[str, int] = {}
    now = 0.0
    for _ in range(400):
        now += rng.uniform(0.0, 1.0)
        peer = f"p{rng.randrange(12)}"
        op = rng.random()
        if op < 0.3:
            m.volunteer(VolunteerRequest(peer, max_experts=rng.choice([1, 2, 4, 8])), now)
        elif op < 0.8:
            seqs[peer] = seqs.get(peer, 0) + 1
            held = []
            for _ in range(rng.randrange(3)):
                layer, lo = rng.randrange(2), rng.randrange(8)
                held.append((layer, lo, rng.randrange(lo + 1, 9), rng.choice(list(HeldState))))
            uniq = {(la, lo, hi): (la, lo, hi, st) for la, lo, hi, st in held}
            m.heartbeat(hb(peer, seqs[peer], *uniq.values()), now)
        elif op < 0.9:
            m.record_poll(URL, rng.randrange(5), 4, now)
        else:
            m.tick(now)
        assert m.ix.counts == m.ix.recount()
    m.tick(now + 1)
    m.dispatch_map(MID).validate(n_layer=2, n_expert=8)
    # and a restarted market rebuilds the same counts from the store
    m.flush(now)
    m2 = new_market(backing, now=now)
    assert m2.ix.counts == m.ix.counts


def test_heartbeat_acks_name_the_coordinators_a_volunteer_may_answer() -> None:
    """DESIGN §12: a volunteer answers only the registered coordinators of the models it holds; the
    market names their peer ids in every heartbeat ack (and keeps them across a restart)."""
    backing = MemoryBacking()
    m = new_market(backing)
    m.register(RegisterModels(URL, [manifest()], epoch=10, peer_id="12D3KooWcoordA"), 0.0)
    m.register(RegisterModels("http://c2.test", [manifest("other-0123456789ab")], epoch=1, peer_id="12D3KooWcoordB"), 0.0)
    m.register(RegisterModels("http://c3.test", [manifest()], epoch=1), 0.0)  # an older coordinator: no peer id
    ack = m.heartbeat(hb("p", 1, (0, 0, 4, SERVING)), 1.0)
    assert ack.coordinators == ["12D3KooWcoordA"]  # not B: it hosts another model
    assert m.heartbeat(hb("q", 1), 1.0).coordinators == []  # holding nothing: nobody to answer
    again = new_market(backing, now=2.0)
    assert again.heartbeat(hb("p", 2, (0, 0, 4, SERVING)), 2.0).coordinators == ["12D3KooWcoordA"]
    # a coordinator that moves (new epoch, new identity) replaces its old id
    again.register(RegisterModels(URL, [manifest()], epoch=11, peer_id="12D3KooWcoordA2"), 3.0)
    assert again.heartbeat(hb("p", 3, (0, 0, 4, SERVING)), 3.0).coordinators == ["12D3KooWcoordA2"]


def test_a_reported_quarantine_drops_coverage_and_refuses_the_volunteer_for_a_while() -> None:
    backing = MemoryBacking()
    m = new_market(backing)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    m.heartbeat(hb("liar", 1, (0, 0, 4, SERVING)), 1.0)
    m.heartbeat(hb("honest", 1, (0, 4, 8, SERVING)), 1.0)
    m.tick(1.5)
    assert {s.peer_id for s in m.ix.by_model[MID].values()} == {"liar", "honest"}
    assert codes(lambda: m.report(CoordinatorReport(url="http://nobody.test", model_id=MID), 2.0)) == "404 unknown_coordinator"
    ack = m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="liar", calls=3, rows=9, verified=0, quarantine="layer 0 experts 0-4: 8 of 8 differ",
                       evidence=evidence(0, 0, 4)),
        ReportedWorker(peer_id="honest", calls=5, rows=20, verified=5)]), 2.0)
    assert ack.quarantined == ["liar"] and m.ix.served["honest"] == (5, 20, 5)
    assert "liar" not in m.ix.coverage and {s.peer_id for s in m.ix.by_model[MID].values()} == {"honest"}
    m.tick(2.5)
    assert all(r.replicas == [] or all(p.peer_id != "liar" for p in r.replicas)
               for L in m.dispatch_map(MID).layers for r in L.ranges)
    # refused: no lease, no coverage from its heartbeats -- also after a restart
    assert m.volunteer(VolunteerRequest("liar", max_experts=4), 3.0).reason is NoOfferReason.QUARANTINED  # type: ignore[union-attr]
    assert codes(lambda: m.heartbeat(hb("liar", 2, (0, 0, 4, SERVING)), 3.0)) == "403 quarantined"
    again = new_market(backing, now=4.0)
    assert codes(lambda: again.heartbeat(hb("liar", 3, (0, 0, 4, SERVING)), 4.0)) == "403 quarantined"
    assert again.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="liar", quarantine="again", evidence=evidence(0, 0, 4))]), 5.0).quarantined == []
    # ... for quarantine_s; then it may come back (and is verified from scratch by the coordinators)
    later = 2.0 + POLICY.quarantine_s + 1
    assert again.heartbeat(hb("liar", 4, (0, 0, 4, SERVING)), later).slices[0].action == "keep"


def test_open_leases_are_capped_per_address_and_polls_share_the_heartbeat_counter() -> None:
    m = Market(InMemoryStore(), msgspec.structs.replace(POLICY, max_leases_per_address=2), now=0.0, rng=random.Random(0))
    m.register(RegisterModels(URL, [manifest(n_expert=16)], epoch=1), 0.0)
    got = [m.volunteer(VolunteerRequest(f"v{i}", max_experts=2), 1.0, address="198.51.100.7") for i in range(3)]
    assert [type(g).__name__ for g in got] == ["Offer", "Offer", "NoOffer"]
    assert got[2].reason is NoOfferReason.ADDRESS_CAP  # type: ignore[union-attr]
    assert isinstance(m.volunteer(VolunteerRequest("w", max_experts=2), 1.0, address="203.0.113.9"), Offer)
    # (epoch, sequence): one counter for a volunteer's polls and heartbeats; a replay of either is refused
    assert isinstance(m.volunteer(VolunteerRequest("p", max_experts=2, epoch=1, sequence=5), 2.0), Offer)
    assert codes(lambda: m.volunteer(VolunteerRequest("p", max_experts=2, epoch=1, sequence=5), 2.0)) == "409 replayed_sequence"
    assert codes(lambda: m.heartbeat(hb("p", 4, epoch=1), 2.0)) == "409 replayed_sequence"
    m.heartbeat(hb("p", 6, epoch=1), 2.0)
    assert codes(lambda: m.volunteer(VolunteerRequest("p", max_experts=2, epoch=1, sequence=6), 3.0)) == "409 replayed_sequence"
    assert codes(lambda: m.volunteer(VolunteerRequest("p", max_experts=2, epoch=0, sequence=99), 3.0)) == "409 stale_epoch"


def test_registration_epochs_are_bounded_by_the_clock_even_from_an_old_database() -> None:
    """An epoch of 2^63 - 1 would lock the URL out for good: refused; one already stored is clamped."""
    backing = MemoryBacking()
    m = new_market(backing, now=1000.0)
    assert codes(lambda: m.register(RegisterModels(URL, [manifest()], epoch=2**63 - 1), 1000.0)) == "400 bad_epoch"
    m.register(RegisterModels(URL, [manifest()], epoch=999_000), 1000.0)
    # as an older market (no bound) would have stored it
    m.ix.coordinators[URL] = msgspec.structs.replace(m.ix.coordinators[URL], epoch=2**63 - 1)
    m.store.apply([Put(m.ix.coordinators[URL])])
    again = new_market(backing, now=2000.0)
    assert again.ix.coordinators[URL].epoch == 2_000_000
    again.register(RegisterModels(URL, [manifest()], epoch=2_000_001), 2000.0)  # the real coordinator gets back in
    # a model too big for the market's per-expert state is no model
    assert codes(lambda: again.register(RegisterModels("http://c9.test", [manifest("big-0123456789ab", n_layer=1024,
                                                                                  n_expert=16384)]), 2000.0)) == "400 bad_manifest"


def test_coverage_counts_only_once_proved_and_gets_one_grace_after_a_restart() -> None:
    """DESIGN §12: a leased slice reported serving keeps its place for ``proof_grace_s`` unless a
    coordinator reports it held (a passed hold challenge) or served (verified answers); then it is
    dropped (``release``, reason ``unproven``) and its experts are assigned again. After a restart every
    unproved holding gets a fresh grace (coverage from before the rule is not a hole at once)."""
    policy = msgspec.structs.replace(POLICY, coverage_requires_lease=True, proof_grace_s=3.0, lease_s=100.0)
    backing = MemoryBacking()
    m = Market(InMemoryStore(backing), policy, now=0.0, rng=random.Random(0))
    m.register(RegisterModels(URL, [manifest(n_layer=1, n_expert=12)], epoch=1), 0.0)
    offers = {p: m.volunteer(VolunteerRequest(p, max_experts=4, epoch=1, sequence=1), 0.0) for p in ("mute", "proved", "verified")}
    sl = {p: (o.lease.slice.layer, o.lease.slice.lo, o.lease.slice.hi) for p, o in offers.items()}  # type: ignore[union-attr]
    for p, (la, lo, hi) in sl.items():
        assert m.heartbeat(hb(p, 2, (la, lo, hi, SERVING)), 1.0).slices[0].action == "keep"
    m.tick(1.0)
    assert codes(lambda: m.report(CoordinatorReport(url=URL, model_id="other-0123456789ab"), 1.5)) == "404 unknown_model"
    m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="proved", held=[ProvenSlice(*sl["proved"])]),
        ReportedWorker(peer_id="verified", calls=2, rows=2, verified=2),
        ReportedWorker(peer_id="mute", held=[ProvenSlice(0, 0, 1)])]), 2.0)  # a slice it does not hold: nothing
    rows = {r.peer_id: r for r in m.ix.by_model[MID].values()}
    assert (rows["proved"].held, rows["proved"].served) == (True, False)
    assert (rows["verified"].held, rows["verified"].served) == (False, True) and not rows["mute"].proved
    m.tick(3.9)
    assert set(rows) == {r.peer_id for r in m.ix.by_model[MID].values()}  # 2.9 s of serving: still in grace
    m.tick(4.0)
    assert {r.peer_id for r in m.ix.by_model[MID].values()} == {"proved", "verified"} and m.counters["coverage_unproven"] == 1
    [d] = m.heartbeat(hb("mute", 3, (*sl["mute"], SERVING)), 4.5).slices
    assert (d.action, d.reason) == ("release", "unproven")
    # its experts are a hole again: the next volunteer gets them
    nxt = m.volunteer(VolunteerRequest("next", max_experts=4, epoch=1, sequence=1), 5.0)
    assert (nxt.lease.slice.layer, nxt.lease.slice.lo) == sl["mute"][:2]  # type: ignore[union-attr]
    # the proved holdings are preferred in the map (served, then held) and survive a restart; an
    # unproved one loaded from the database gets its grace from the restart
    m.heartbeat(hb("next", 2, (nxt.lease.slice.layer, nxt.lease.slice.lo, nxt.lease.slice.hi, SERVING)), 5.0)  # type: ignore[union-attr]
    m.flush(5.0)
    again = Market(InMemoryStore(backing), policy, now=100.0, rng=random.Random(0))
    for p in ("proved", "verified", "next"):
        again.heartbeat(hb(p, 9, (*sl.get(p, (nxt.lease.slice.layer, nxt.lease.slice.lo, nxt.lease.slice.hi)), SERVING)), 100.0)  # type: ignore[union-attr]
    again.tick(100.0)
    again.tick(102.9)
    assert {r.peer_id for r in again.ix.by_model[MID].values()} == {"proved", "verified", "next"}
    again.tick(103.1)
    assert {r.peer_id for r in again.ix.by_model[MID].values()} == {"proved", "verified"}


def test_experts_a_coordinator_does_not_compute_get_the_remote_target_and_holes_are_counted() -> None:
    """DESIGN §11: holdings travel in the registration; experts not held by every coordinator hosting the
    model get ``remote_base_target`` (2 here) replicas, the others ``base_target``; the views name the
    remote target and the experts nobody can compute now (holes)."""
    m = new_market()
    m.register(RegisterModels(URL, [manifest(n_layer=1, n_expert=8)], epoch=10,
                              local_experts={MID: [ProvenSlice(0, 0, 4)]}), 0.0)  # holds 0-3, not 4-7
    [d] = m.demand(0.0).models
    assert (d.effective_target, d.remote_target, d.holes) == (1, 2, 4)
    assert [(s.lo, s.hi, s.target) for s in d.segments] == [(0, 4, 1), (4, 8, 2)]
    # a second coordinator holding everything does not make 4-7 local: one that hosts it lacks them
    m.register(RegisterModels("http://c2.test", [manifest(n_layer=1, n_expert=8)], epoch=10), 0.0)
    assert m.demand(0.0).models[0].remote_target == 2
    # volunteers: 4-7 twice (scarcity 1, then 0.5) before anyone takes 0-3 (scarcity 1 too, but later)
    got = []
    for i, p in enumerate(("v1", "v2", "v3")):
        o = m.volunteer(VolunteerRequest(p, max_experts=4, epoch=1, sequence=1), 1.0 + i)
        assert isinstance(o, Offer)
        got.append((o.lease.slice.lo, o.lease.slice.hi))
        m.heartbeat(hb(p, 2, (0, o.lease.slice.lo, o.lease.slice.hi, SERVING)), 1.0 + i)
    assert sorted(got) == [(0, 4), (4, 8), (4, 8)]
    m.tick(5.0)
    [d] = m.demand(5.0).models
    assert d.holes == 0 and [(s.lo, s.hi, s.replicas, s.target) for s in d.segments] == [(0, 4, 1, 1), (4, 8, 2, 2)]
    [r] = m.recruitment(5.0).models
    assert (r.remote_target, r.holes) == (2, 0)
    # the registration is the whole list: re-registered holding all, the target is uniform again
    m.register(RegisterModels(URL, [manifest(n_layer=1, n_expert=8)], epoch=11), 6.0)
    [d] = m.demand(6.0).models
    assert (d.remote_target, d.holes) == (None, 0) and {s.target for s in d.segments} == {1}


def test_routed_rows_in_reports_give_hot_experts_more_replicas_until_the_heat_decays() -> None:
    policy = msgspec.structs.replace(POLICY, hot_extra_max=2, hot_half_life_s=60.0)
    m = Market(InMemoryStore(), policy, now=0.0, rng=random.Random(0))
    m.register(RegisterModels(URL, [manifest(n_layer=1, n_expert=8)], epoch=1), 0.0)
    m.heartbeat(hb("a", 1, (0, 0, 4, SERVING)), 0.0)
    m.heartbeat(hb("b", 1, (0, 4, 8, SERVING)), 0.0)
    # 0-1 carry 9 of every 10 routed rows: 3.6x the mean per expert (+2), the rest far below it
    ranges = [RoutedRange(layer=0, lo=0, hi=2, rows=900), RoutedRange(layer=0, lo=2, hi=8, rows=100)]
    for i in range(2):  # rows count once per report (not once per worker of it)
        m.report(CoordinatorReport(url=URL, model_id=MID, workers=[ReportedWorker(peer_id="a"), ReportedWorker(peer_id="b")],
                                   ranges=ranges), 1.0 + i)
    assert m.ix.routed[MID][(0, 0, 2)] == 1800
    [d] = m.demand(2.0).models
    assert [(s.lo, s.hi, s.target) for s in d.segments] == [(0, 2, 3), (2, 8, 1)]
    o = m.volunteer(VolunteerRequest("c", max_experts=4, epoch=1, sequence=1), 2.0)
    assert isinstance(o, Offer) and (o.lease.slice.lo, o.lease.slice.hi) == (0, 2)  # the hot experts first
    # an hour later, a report of uniform traffic: the old heat has decayed, the targets are even again
    m.report(CoordinatorReport(url=URL, model_id=MID, ranges=[RoutedRange(layer=0, lo=0, hi=8, rows=800)]), 3600.0)
    assert {s.target for s in m.demand(3600.0).models[0].segments} == {1}


def test_a_silent_sole_replica_of_experts_a_coordinator_lacks_expires_sooner() -> None:
    """Its slice is a hole the moment it is gone, and a backbone waits for it: re-offered after
    ``sole_replica_ttl_s`` instead of the heartbeat TTL. A volunteer with a second replica beside it,
    or one whose experts every coordinator holds, keeps the normal TTL."""
    policy = msgspec.structs.replace(POLICY, heartbeat_ttl_s=6.0, sole_replica_ttl_s=2.0)
    m = Market(InMemoryStore(), policy, now=0.0, rng=random.Random(0))
    m.register(RegisterModels(URL, [manifest(n_layer=1, n_expert=8)], epoch=1,
                              local_experts={MID: [ProvenSlice(0, 4, 8)]}), 0.0)  # holds 4-7, not 0-3
    m.heartbeat(hb("sole", 1, (0, 0, 4, SERVING)), 0.0)  # the only replica of 0-3 (not held)
    m.heartbeat(hb("twin1", 1, (0, 4, 8, SERVING)), 0.0)  # 4-7: held by the coordinator anyway
    m.tick(2.5)
    assert "sole" not in m.ix.coverage and "twin1" in m.ix.coverage
    assert m.demand(2.5).models[0].holes == 4
    m.tick(6.5)
    assert "twin1" not in m.ix.coverage  # the normal TTL
    # two replicas of the experts nobody else computes: neither is a sole replica
    m2 = Market(InMemoryStore(), policy, now=0.0, rng=random.Random(0))
    m2.register(RegisterModels(URL, [manifest(n_layer=1, n_expert=8)], epoch=1, local_experts={MID: []}), 0.0)
    m2.heartbeat(hb("a", 1, (0, 0, 4, SERVING)), 0.0)
    m2.heartbeat(hb("b", 1, (0, 0, 4, SERVING)), 0.0)
    m2.tick(2.5)
    assert {"a", "b"} <= set(m2.ix.coverage)


def test_the_dashboard_history_samples_every_5_s_for_15_minutes() -> None:
    m = registered()
    m.record_poll(URL, 3, 4, 0.0, tps=120.5)
    for i in range(400):  # 2,000 s of ticks every 5 s
        m.tick(float(i * 5))
    [h] = m.history()
    assert h.model_id == MID and len(h.samples) == 180  # 15 minutes
    last = h.samples[-1]
    assert (last.at_ms, last.effective_target, last.replicas_min) == (1995_000, 1, 0)
    assert h.samples[0].at_ms == (400 - 180) * 5000
    first = registered()
    first.record_poll(URL, 3, 4, 0.0, tps=120.5)
    first.tick(0.0)
    assert [(s.busy, s.slots, s.tokens_per_s) for s in first.history()[0].samples] == [(3, 4, 120.5)]


def test_a_paused_volunteer_is_not_counted_nor_assigned_nor_dropped_and_comes_back() -> None:
    """A volunteer whose owner paused it (``CoverageHeartbeat.paused``) reports its slices draining: they
    leave the map and the counts, its polls get nothing, its heartbeats keep it alive; resumed, it serves."""
    m = registered()
    m.heartbeat(hb("a", 1, (0, 0, 8, SERVING), serve_ms=1), 0.0)
    m.report(CoordinatorReport(url=URL, model_id=MID, workers=[ReportedWorker(peer_id="a", calls=1, rows=1, verified=1)]), 0.1)
    m.tick(0.2)
    assert m.dispatch_map(MID).peers().keys() == {"a"} and m.ix.counts[MID].replicas[0] == [1] * 8

    def paused(seq: int, now: float, why: str) -> None:
        m.heartbeat(msgspec.structs.replace(hb("a", seq, (0, 0, 8, HeldState.DRAINING)), paused=why), now)

    paused(2, 1.0, "user_active")
    m.tick(1.1)
    assert m.dispatch_map(MID).peers() == {} and m.ix.counts[MID].replicas[0] == [0] * 8  # not counted
    assert m.demand(1.1).models[0].segments[0].replicas == 0  # so its experts are in demand again
    no = m.volunteer(VolunteerRequest("a", max_bytes=10**6, epoch=1, sequence=3), 1.2)
    assert isinstance(no, NoOffer) and no.reason is NoOfferReason.PAUSED  # and it is not assigned
    credit = m.volunteer_credit("a", 1.2)
    assert credit.paused == "user_active" and credit.slices == [str(SliceRef(MID, 0, 0, 8))]  # still held
    [w] = m.recruitment(1.2).models[0].workers
    assert w.paused == "user_active" and w.slices[0].state == "draining" and not w.dispatched
    # paused for longer than the heartbeat TTL, heartbeating all along: never expired
    for i, now in enumerate((4.0, 7.0, 10.0, 13.0)):
        paused(4 + i, now, "user_active")
        assert m.tick(now + 0.1).expired_volunteers == []
    assert "a" in m.ix.volunteers and SliceRef(MID, 0, 0, 8) in m.ix.coverage["a"]
    # resumed: serving, counted and mapped again; its polls get answers again
    m.heartbeat(hb("a", 8, (0, 0, 8, SERVING)), 14.0)
    m.tick(14.1)
    assert m.dispatch_map(MID).peers().keys() == {"a"} and m.ix.counts[MID].replicas[0] == [1] * 8
    again = m.volunteer(VolunteerRequest("a", max_bytes=10**6, epoch=1, sequence=9), 14.2)
    assert not (isinstance(again, NoOffer) and again.reason is NoOfferReason.PAUSED)
    assert m.volunteer_credit("a", 14.2).paused == ""
    kinds = [(e.kind, e.detail) for e in m.events().events if e.kind in ("paused", "resumed")]
    assert kinds == [("paused", "user_active"), ("resumed", "")]
    assert m.ix.counts == m.ix.recount()
