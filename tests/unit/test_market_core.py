"""The market's pure cores, table-driven: demand, assignment, recruitment + age-out, registry, wiring,
heartbeat directives and download-source ranking."""

from __future__ import annotations

import random
from typing import Any

import pytest

from market.core.activity import CallWindow, SliceActivity, activity
from market.core.assign import (
    Budget,
    ModelSupply,
    NoOfferReason,
    Pick,
    choose_slice,
    experts_that_fit,
    jittered,
)
from market.core.demand import (
    CoverageCounts,
    Segment,
    contribution,
    effective_target,
    expert_targets,
    hot_extra,
    scarcity,
    segments,
)
from market.core.directive import Action, Directive, Reason, directive, in_cooldown, slice_refusal
from market.core.records import CoverageRow, HeldState, SliceRef
from market.core.recruit import (
    Holding,
    Observation,
    PollView,
    RecruitPolicy,
    RecruitState,
    coordinator_saturated,
    is_saturated,
    observe,
    plan_ageout,
    step,
)
from market.core.registry import (
    ACCEPTED,
    HeartbeatVerdict,
    check_heartbeat,
    diff_coverage,
    is_expired,
    registration_is_stale,
)
from market.core.sources import Source, rank_sources
from market.core.wiring import ServingSlice, build_layers, load_bucket, preference
from swarm.dispatch_map import DispatchMap, LayerRanges, RangeReplicas, Replica

M = "tiny-0123456789ab"


def counts_from(n_layer: int, n_expert: int, replicas: dict[tuple[int, int, int], int] | None = None,
                pending: dict[tuple[int, int, int], int] | None = None) -> CoverageCounts:
    c = CoverageCounts(n_layer, n_expert)
    for (layer, lo, hi), n in (replicas or {}).items():
        c.add("replica", layer, lo, hi, n)
    for (layer, lo, hi), n in (pending or {}).items():
        c.add("pending", layer, lo, hi, n)
    return c


# -- demand -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "boost", "recruiting", "want"),
    [(1, 1, False, 1), (1, 1, True, 2), (2, 3, True, 5), (0, 1, False, 0), (0, 0, True, 0), (3, 0, True, 3)],
)
def test_effective_target(base: int, boost: int, recruiting: bool, want: int) -> None:
    assert effective_target(base, boost, recruiting) == want


@pytest.mark.parametrize(
    ("target", "replicas", "want"),
    [(1, 0, 1.0), (2, 1, 0.5), (2, 2, 0.0), (0, 0, 0.0), (0, 3, 0.0), (1, 2, -1.0), (4, 1, 0.75)],
)
def test_scarcity(target: int, replicas: int, want: float) -> None:
    assert scarcity(target, replicas) == want


def _row(state: HeldState, retiring: float | None = None) -> CoverageRow:
    return CoverageRow("p", SliceRef(M, 0, 0, 1), state, 0.0, retiring_since=retiring)


@pytest.mark.parametrize(
    ("row", "want"),
    [
        (_row(HeldState.SERVING), "replica"),
        (_row(HeldState.LOADING), "pending"),
        (_row(HeldState.DRAINING), None),
        (_row(HeldState.SERVING, retiring=5.0), None),
        (_row(HeldState.LOADING, retiring=5.0), None),
    ],
    ids=["serving", "loading", "draining", "retiring-serving", "retiring-loading"],
)
def test_contribution(row: CoverageRow, want: str | None) -> None:
    assert contribution(row) == want


def test_counts_add_remove_and_guard_rails() -> None:
    c = counts_from(2, 4, replicas={(0, 1, 3): 1}, pending={(1, 0, 4): 2})
    assert c.replicas == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert c.pending == [[0, 0, 0, 0], [2, 2, 2, 2]]
    assert c.min_replicas() == 0
    c.add("replica", 0, 1, 3, -1)
    assert c.replicas[0] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="negative"):
        c.add("replica", 0, 0, 1, -1)
    for bad in [(2, 0, 1), (0, 3, 5), (0, 2, 2), (-1, 0, 1)]:
        with pytest.raises(ValueError, match="outside"):
            c.add("pending", *bad, 1)
    assert c.copy() == c and c.copy() is not c


@pytest.mark.parametrize(
    ("replicas", "pending", "target", "want"),
    [
        ({}, {}, 1, [Segment(0, 0, 4, 0, 0, 1, 1.0), Segment(1, 0, 4, 0, 0, 1, 1.0)]),
        (
            {(0, 0, 2): 1},
            {(1, 3, 4): 1},
            2,
            [
                Segment(0, 0, 2, 1, 0, 2, 0.5),
                Segment(0, 2, 4, 0, 0, 2, 1.0),
                Segment(1, 0, 3, 0, 0, 2, 1.0),
                Segment(1, 3, 4, 0, 1, 2, 1.0),
            ],
        ),
        (
            {(0, 0, 4): 2, (1, 0, 4): 1},
            {},
            1,
            [Segment(0, 0, 4, 2, 0, 1, -1.0), Segment(1, 0, 4, 1, 0, 1, 0.0)],
        ),
        ({}, {}, 0, [Segment(0, 0, 4, 0, 0, 0, 0.0), Segment(1, 0, 4, 0, 0, 0, 0.0)]),
    ],
    ids=["seeded-from-zero", "mixed", "surplus", "zero-target"],
)
def test_segments(replicas: Any, pending: Any, target: int, want: list[Segment]) -> None:
    assert segments(counts_from(2, 4, replicas, pending), target) == want


# -- assignment -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "bpe", "allowance", "want"),
    [
        (Budget(max_experts=4), 100, 0, 4),
        (Budget(max_bytes=1000), 100, 0, 10),
        (Budget(max_bytes=1000), 100, 150, 8),
        (Budget(max_bytes=1000, max_experts=3), 100, 0, 3),
        (Budget(max_bytes=99), 100, 0, 0),
        (Budget(max_bytes=100), 100, 200, 0),
    ],
)
def test_experts_that_fit(budget: Budget, bpe: int, allowance: int, want: int) -> None:
    assert experts_that_fit(budget, bpe, allowance) == want


def supply(c: CoverageCounts, target: int = 1, bpe: list[int] | None = None, model_id: str = M) -> ModelSupply:
    return ModelSupply(model_id, bpe or [100] * c.n_layer, c, target)


def S(layer: int, lo: int, hi: int, model_id: str = M) -> SliceRef:
    return SliceRef(model_id, layer, lo, hi)


@pytest.mark.parametrize(
    ("models", "budget", "held", "want"),
    [
        ([], Budget(max_experts=4), [], NoOfferReason.NO_MODELS),
        ([supply(counts_from(2, 8, {(0, 0, 8): 1, (1, 0, 8): 1}))], Budget(max_experts=4), [],
         NoOfferReason.NOTHING_SCARCE),
        ([supply(counts_from(2, 8, pending={(0, 0, 8): 1, (1, 0, 8): 1}))], Budget(max_experts=4), [],
         NoOfferReason.NOTHING_SCARCE),
        ([supply(counts_from(1, 8), target=0)], Budget(max_experts=4), [], NoOfferReason.NOTHING_SCARCE),
        ([supply(counts_from(1, 8))], Budget(max_bytes=50), [], NoOfferReason.BUDGET_TOO_SMALL),
        # only expert 5 of layer 0 lacks a replica: its chunk [4, 8) is trimmed to [5, 6)
        ([supply(counts_from(1, 8, {(0, 0, 5): 1, (0, 6, 8): 1}))], Budget(max_experts=4), [], S(0, 5, 6)),
        # boosted target 2: layer 1 (no replica, scarcity 1) beats layer 0 (one replica, 0.5)
        ([supply(counts_from(2, 4, {(0, 0, 4): 1}), target=2)], Budget(max_experts=4), [], S(1, 0, 4)),
        # pending [0, 4) makes [4, 8) the only need left
        ([supply(counts_from(1, 8, pending={(0, 0, 4): 1}))], Budget(max_experts=4), [], S(0, 4, 8)),
        # the volunteer holds 2-4: the chunk splits around it and the bigger side wins
        ([supply(counts_from(1, 8))], Budget(max_experts=8), [S(0, 2, 4)], S(0, 4, 8)),
        # ... a slice of another model does not split anything
        ([supply(counts_from(1, 8))], Budget(max_experts=8), [S(0, 2, 4, "other-model")], S(0, 0, 8)),
        # byte budget per layer: only layer 0's small experts fit (4 x 100 bytes)
        ([supply(counts_from(2, 8), bpe=[100, 1000])], Budget(max_bytes=450), [], None),
        # the scarcest expert across models wins: model b has an uncovered expert, model a a thin one
        (
            [supply(counts_from(1, 4, {(0, 0, 4): 1}), target=2, model_id="a"),
             supply(counts_from(1, 4, {(0, 0, 3): 1}), target=1, model_id="b")],
            Budget(max_experts=4),
            [],
            S(0, 3, 4, "b"),
        ),
    ],
    ids=[
        "no-models", "all-covered", "all-pending", "zero-target", "budget-too-small", "trim", "boosted-layer",
        "pending", "held-splits", "held-other-model", "bytes-per-layer", "across-models",
    ],
)
def test_choose_slice(models: list[ModelSupply], budget: Budget, held: list[SliceRef], want: Any) -> None:
    got = choose_slice(models, budget, held, random.Random(1))
    if want is None:  # bytes-per-layer: any aligned 4-chunk of layer 0
        assert isinstance(got, Pick)
        assert got.slice.layer == 0 and got.slice.n_expert == 4 and got.slice.lo % 4 == 0
        assert got.est_bytes == 400
    elif isinstance(want, NoOfferReason):
        assert got == want
    else:
        assert isinstance(got, Pick)
        assert got.slice == want


def test_choose_slice_header_allowance_counts_against_bytes() -> None:
    got = choose_slice([supply(counts_from(1, 8))], Budget(max_bytes=450), [], random.Random(0), header_allowance=100)
    assert isinstance(got, Pick)
    assert got.slice.n_expert == 3 and got.est_bytes == 400


def test_ties_are_broken_by_the_rng_and_reproducibly() -> None:
    c = counts_from(4, 16)
    picks = {choose_slice([supply(c)], Budget(max_experts=4), [], random.Random(seed)) for seed in range(60)}
    slices = {p.slice for p in picks if isinstance(p, Pick)}
    assert len(slices) > 8  # 16 equally scarce aligned chunks: the RNG spreads volunteers over them
    assert all(s.lo % 4 == 0 and s.n_expert == 4 for s in slices)
    a = choose_slice([supply(c)], Budget(max_experts=4), [], random.Random(7))
    b = choose_slice([supply(c)], Budget(max_experts=4), [], random.Random(7))
    assert a == b


@pytest.mark.parametrize("seed", range(10))
def test_simultaneous_polls_get_disjoint_slices_until_everything_is_leased(seed: int) -> None:
    """Each pick becomes pending (a lease) before the next poll: no expert is handed out twice
    while another one still needs a replica, and every expert ends up covered exactly once."""
    rng = random.Random(seed)
    c = counts_from(3, 12)
    handed: list[SliceRef] = []
    budgets = [Budget(max_experts=rng.choice([1, 2, 3, 4, 5, 12])) for _ in range(100)]
    for b in budgets:
        got = choose_slice([supply(c)], b, [], rng)
        if got == NoOfferReason.NOTHING_SCARCE:
            break
        assert isinstance(got, Pick)
        for h in handed:
            assert not h.overlaps(got.slice), (h, got.slice)
        handed.append(got.slice)
        c.add("pending", got.slice.layer, got.slice.lo, got.slice.hi, 1)
    assert c.pending == [[1] * 12 for _ in range(3)]


def test_jitter_stays_within_its_spread() -> None:
    rng = random.Random(3)
    vals = [jittered(rng, 5.0) for _ in range(200)]
    assert min(vals) >= 4.0 and max(vals) <= 6.0
    assert len({round(v, 6) for v in vals}) > 100


# -- recruitment ------------------------------------------------------------------------------


@pytest.mark.parametrize(("busy", "threshold", "want"), [(0, 2, False), (1, 2, False), (2, 2, True), (4, 2, True),
                                                        (1, 1, True)])
def test_is_saturated(busy: int, threshold: int, want: bool) -> None:
    assert is_saturated(busy, threshold) is want


P = RecruitPolicy(saturation_threshold=2, rise_s=0.0, hold_s=10.0, poll_stale_s=5.0)


@pytest.mark.parametrize(
    ("polls", "now", "want"),
    [
        ([], 10.0, None),
        ([None], 10.0, None),
        ([PollView(3, 4, 1.0)], 10.0, None),  # stale
        ([PollView(3, 4, 8.0)], 10.0, Observation(True, 8.0)),
        ([PollView(1, 4, 8.0)], 10.0, Observation(False, 8.0)),
        ([PollView(1, 4, 9.0), PollView(2, 4, 7.0)], 10.0, Observation(True, 7.0)),  # any saturated host
        ([PollView(1, 4, 9.0), PollView(2, 4, 2.0)], 10.0, Observation(False, 9.0)),  # the saturated one is stale
    ],
)
def test_observe(polls: list[PollView | None], now: float, want: Observation | None) -> None:
    assert observe(polls, now, P) == want


@pytest.mark.parametrize(
    ("poll", "now", "want"),
    [
        (None, 10.0, False),  # never answered
        (PollView(2, 4, 8.0), 10.0, True),
        (PollView(1, 4, 8.0), 10.0, False),  # below the threshold
        (PollView(4, 4, 5.0), 10.0, True),  # exactly poll_stale_s old: still fresh
        (PollView(4, 4, 4.9), 10.0, False),  # stale: says nothing
        # the speed signal (a coordinator reporting a floor and a mean) replaces busy >= threshold
        (PollView(4, 4, 8.0, mean_active_tps=12.0, tps_floor=5.0, projected_tps=9.0), 10.0, False),  # room at the floor
        (PollView(1, 4, 8.0, mean_active_tps=6.0, tps_floor=5.0, projected_tps=4.0), 10.0, True),  # one more: below
        (PollView(1, 4, 8.0, mean_active_tps=4.0, tps_floor=5.0), 10.0, True),  # below the floor now
        (PollView(1, 4, 4.9, mean_active_tps=4.0, tps_floor=5.0), 10.0, False),  # stale
        # no floor, or no measurement yet: busy >= threshold, as from an older coordinator
        (PollView(3, 4, 8.0, mean_active_tps=4.0, tps_floor=None), 10.0, True),
        (PollView(1, 4, 8.0, mean_active_tps=None, tps_floor=5.0), 10.0, False),
        (PollView(2, 4, 8.0, mean_active_tps=None, tps_floor=5.0), 10.0, True),
    ],
)
def test_coordinator_saturated(poll: PollView | None, now: float, want: bool) -> None:
    assert coordinator_saturated(poll, now, P) is want
    # the one rule: a model with this coordinator alone is observed saturated exactly when it is
    obs = observe([poll], now, P)
    assert (obs is not None and obs.saturated) is want


def _run(events: list[tuple[float, bool | None]], policy: RecruitPolicy = P) -> list[bool]:
    st = RecruitState()
    out: list[bool] = []
    for now, sat in events:
        st = step(st, None if sat is None else Observation(sat, now), now, policy)
        out.append(st.recruiting)
    return out


@pytest.mark.parametrize(
    ("events", "policy", "want"),
    [
        # saturated -> boost at once; unsaturated: the boost holds for hold_s, then falls
        ([(0, False), (2, True), (4, False), (11.9, False), (12, False)], P, [False, True, True, True, False]),
        # a flapping load keeps one steady boost (no thrash)
        ([(0, True), (2, False), (4, True), (6, False), (8, True), (10, False), (17, False), (18, False)], P,
         [True, True, True, True, True, True, True, False]),
        # no information (failed polls) does not extend the boost
        ([(0, True), (5, None), (9.9, None), (10, None)], P, [True, True, True, False]),
        # rise_s: a short spike does not recruit (the dip after it lasts rise_s); a sustained load does
        ([(0, True), (3, False), (6, True), (8, True), (10, True)], RecruitPolicy(rise_s=3.0, hold_s=10.0),
         [False, False, False, False, True]),
        ([(0, False), (2, False)], P, [False, False]),
        # rise_s with dips shorter than it: the count goes on (sampling noise, not the end of the load) ...
        ([(0, True), (1, False), (2, True), (3, False), (4, True)], RecruitPolicy(rise_s=3.0, hold_s=10.0),
         [False, False, False, False, True]),
        # ... and so does a gap with no observation longer than poll_stale_s (nothing is known in it)
        ([(0, True), (2, True), (6, True), (8, True), (9, True)], RecruitPolicy(rise_s=3.0, hold_s=10.0, poll_stale_s=3.0),
         [False, False, False, False, True]),
        # the market's real cadence: a poll every 2 s and a little (the poll's own time): steady load enters at
        # the second saturated poll, whatever the jitter
        ([(0, True), (2.03, True), (4.07, True)], RecruitPolicy(), [False, True, True]),
    ],
    ids=["boost-then-fall", "flapping", "no-info", "rise", "never", "rise-through-dips", "rise-restarts",
         "jittered-polls"],
)
def test_recruitment_hysteresis(events: list[tuple[float, bool | None]], policy: RecruitPolicy,
                                want: list[bool]) -> None:
    assert _run(events, policy) == want


# A flapping load in virtual time with the default hysteresis (S = rise_s = 2 s, U = hold_s = 10 s): one
# coordinator polled once a second (the market's default is every 2 s), one character per poll: "." idle,
# "1" busy below the threshold (2), "3" saturated; the market steps the signal at every poll. The raw
# signal is what the event log showed before (a saturated/unsaturated pair per flip).
FLAPPING = [
    # (load, the smoothed signal's transitions (t, on), flips of the raw signal)
    ("." * 10 + "3" * 20 + "." * 30, [(12, True), (39, False)], 2),  # steady load: on after 2 s, off 10 s after
    ("." * 10 + "31" * 15 + "." * 30, [(12, True), (48, False)], 30),  # saturated every other poll: the demo's flood
    ("." * 10 + "331" * 10 + "." * 30, [(13, True), (48, False)], 20),  # a dip every third poll
    ("." * 10 + "33" + "." * 30, [], 2),  # a 1 s burst is no load
    ("." * 10 + "3...3...3" + "." * 30, [], 6),  # single busy polls 4 s apart: each gap restarts the count
    ("." * 5 + "3" * 10 + "." * 8 + "3" * 10 + "." * 20, [(7, True), (42, False)], 4),  # a lull shorter than U
    ("." * 5 + "3" * 10 + "." * 15 + "3" * 10 + "." * 20, [(7, True), (24, False), (32, True), (49, False)], 4),
]


@pytest.mark.parametrize(("load", "want", "raw_flips"), FLAPPING,
                         ids=["steady", "every-other-poll", "dip-every-third", "burst", "sparse", "short-lull",
                              "long-lull"])
def test_a_flapping_load_gives_one_steady_saturation_signal(load: str, want: list[tuple[int, bool]],
                                                            raw_flips: int) -> None:
    policy = RecruitPolicy()
    assert (policy.rise_s, policy.hold_s) == (2.0, 10.0)
    st = RecruitState()
    got: list[tuple[int, bool]] = []
    raw: list[bool] = []
    for t, c in enumerate(load):
        poll = PollView({".": 0, "1": 1, "3": 3}[c], 4, float(t))
        obs = observe([poll], float(t), policy)
        assert obs is not None
        raw.append(obs.saturated)
        new = step(st, obs, float(t), policy)
        if new.recruiting != st.recruiting:
            got.append((t, new.recruiting))
        st = new
    assert got == want
    assert sum(a != b for a, b in zip([False, *raw], raw, strict=False)) == raw_flips


def H(key: str, lo: int, hi: int, since: float, *, serving: bool = True, proven: bool = False, counted: bool = True,
      restorable: bool = False, layer: int = 0) -> Holding[str]:
    return Holding(key, key, layer, lo, hi, since, serving, proven, counted, restorable)


@pytest.mark.parametrize(
    ("target", "holdings", "restore", "retire"),
    [
        ([1, [H("a", 0, 4, 0)], [], []]),
        ([1, [H("a", 0, 4, 0, proven=True), H("b", 0, 4, 5)], [], ["b"]]),
        ([1, [H("a", 0, 4, 9, proven=True), H("b", 0, 4, 5)], [], ["b"]]),  # unproven goes first even if older
        ([1, [H("a", 0, 4, 0), H("b", 0, 4, 5)], [], ["b"]]),  # youngest first
        ([1, [H("a", 0, 4, 9), H("b", 0, 4, 5, serving=False)], [], ["b"]]),  # loading first
        ([2, [H("a", 0, 4, 0), H("b", 0, 4, 5)], [], []]),  # the boost still wants both
        # partial overlaps: c and b are surplus once a covers 0-4, a must stay
        ([1, [H("a", 0, 4, 0), H("b", 0, 2, 1), H("c", 2, 4, 2)], [], ["c", "b"]]),
        # a holding whose removal would leave one expert uncovered stays
        ([1, [H("a", 0, 4, 0), H("b", 2, 6, 5)], [], []]),
        # below target: a retiring holding comes back; a released one (not restorable) cannot
        ([2, [H("a", 0, 4, 0), H("b", 0, 4, 5, counted=False, restorable=True)], ["b"], []]),
        ([2, [H("a", 0, 4, 0), H("b", 0, 4, 5, counted=False, restorable=False)], [], []]),
        # no deficit: retiring stays retiring
        ([1, [H("a", 0, 4, 0), H("b", 0, 4, 5, counted=False, restorable=True)], [], []]),
        # restore prefers proven holdings; only as many as needed
        ([2, [H("a", 0, 4, 0), H("b", 0, 4, 5, counted=False, restorable=True),
              H("c", 0, 4, 6, counted=False, restorable=True, proven=True)], ["c"], []]),
        # other layers are independent
        ([1, [H("a", 0, 4, 0), H("b", 0, 4, 1, layer=1)], [], []]),
    ],
)
def test_plan_ageout(target: int, holdings: list[Holding[str]], restore: list[str], retire: list[str]) -> None:
    plan = plan_ageout(2, 8, target, holdings)
    assert plan.restore == restore
    assert plan.retire == retire


# -- registry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("known", "epoch", "seq", "want"),
    [
        (None, 0, 0, HeartbeatVerdict.FIRST),
        (None, 5, 100, HeartbeatVerdict.FIRST),
        ((1, 5), 1, 6, HeartbeatVerdict.NEXT),
        ((1, 5), 1, 1000, HeartbeatVerdict.NEXT),
        ((1, 5), 1, 5, HeartbeatVerdict.REPLAYED_SEQUENCE),
        ((1, 5), 1, 4, HeartbeatVerdict.REPLAYED_SEQUENCE),
        ((1, 5), 2, 0, HeartbeatVerdict.NEW_EPOCH),
        ((1, 5), 0, 99, HeartbeatVerdict.STALE_EPOCH),
    ],
)
def test_check_heartbeat(known: tuple[int, int] | None, epoch: int, seq: int, want: HeartbeatVerdict) -> None:
    got = check_heartbeat(known, epoch, seq)
    assert got == want
    assert (got in ACCEPTED) == (want in {HeartbeatVerdict.FIRST, HeartbeatVerdict.NEXT, HeartbeatVerdict.NEW_EPOCH})


@pytest.mark.parametrize(("last", "now", "ttl", "want"), [(0, 10, 15, False), (0, 15, 15, False), (0, 15.01, 15, True)])
def test_is_expired(last: float, now: float, ttl: float, want: bool) -> None:
    assert is_expired(last, now, ttl) is want


@pytest.mark.parametrize(("stored", "new", "want"), [(None, 0, False), (5, 5, False), (5, 6, False), (5, 4, True)])
def test_registration_is_stale(stored: int | None, new: int, want: bool) -> None:
    assert registration_is_stale(stored, new) is want


def test_diff_coverage() -> None:
    a, b, c = S(0, 0, 4), S(0, 4, 8), S(1, 0, 4)
    rows = {a: CoverageRow("p", a, HeldState.LOADING, 0.0), b: CoverageRow("p", b, HeldState.SERVING, 0.0)}
    d = diff_coverage(rows, {a: HeldState.SERVING, c: HeldState.LOADING})
    assert d.added == [(c, HeldState.LOADING)]
    assert d.changed == [(rows[a], HeldState.SERVING)]
    assert d.removed == [rows[b]]
    assert not diff_coverage(rows, {a: HeldState.LOADING, b: HeldState.SERVING})


# -- wiring -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("load", "want"), [(0.0, 0), (0.99, 0), (1.0, 1), (1.9, 1), (2.0, 2), (7.0, 3), (8.0, 4),
                                            (float("nan"), 0)])
def test_load_bucket(load: float, want: int) -> None:
    assert load_bucket(load) == want


def SS(peer: str, layer: int, lo: int, hi: int, *, proven: bool = False, load: float = 0.0, since: float = 0.0,
       protocols: tuple[int, ...] = (2,)) -> ServingSlice:
    return ServingSlice(peer, layer, lo, hi, (f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",), preference(proven, load, since, peer),
                        protocols)


def R(*peers: str) -> list[Replica]:
    return [Replica(p, [f"/ip4/127.0.0.1/tcp/1/p2p/{p}"]) for p in peers]


@pytest.mark.parametrize(
    ("slices", "want"),
    [
        ([], []),
        ([SS("a", 0, 0, 4)], [LayerRanges(0, [RangeReplicas(0, 4, R("a"))])]),
        # overlapping holdings: cut at every boundary; no range without replicas is listed
        ([SS("a", 0, 0, 8), SS("b", 0, 4, 12)],
         [LayerRanges(0, [RangeReplicas(0, 4, R("a")), RangeReplicas(4, 8, R("a", "b")),
                          RangeReplicas(8, 12, R("b"))])]),
        ([SS("a", 0, 0, 2), SS("b", 0, 6, 8)],
         [LayerRanges(0, [RangeReplicas(0, 2, R("a")), RangeReplicas(6, 8, R("b"))])]),
        # adjacent slices of one volunteer are not merged (it cannot answer a 0-8 call)
        ([SS("a", 0, 0, 4), SS("a", 0, 4, 8)],
         [LayerRanges(0, [RangeReplicas(0, 4, R("a")), RangeReplicas(4, 8, R("a"))])]),
        # preference: proven first, then load bucket, then age, then peer id
        ([SS("a", 0, 0, 4, since=0), SS("b", 0, 0, 4, proven=True, since=9)],
         [LayerRanges(0, [RangeReplicas(0, 4, R("b", "a"))])]),
        ([SS("a", 0, 0, 4, load=5), SS("b", 0, 0, 4, since=9)], [LayerRanges(0, [RangeReplicas(0, 4, R("b", "a"))])]),
        ([SS("b", 0, 0, 4, since=1), SS("a", 0, 0, 4, since=2), SS("c", 0, 0, 4, since=1)],
         [LayerRanges(0, [RangeReplicas(0, 4, R("b", "c", "a"))])]),
        # a peer holding overlapping slices is listed once per range
        ([SS("a", 0, 0, 8), SS("a", 0, 4, 8)],
         [LayerRanges(0, [RangeReplicas(0, 4, R("a")), RangeReplicas(4, 8, R("a"))])]),
        # layers sorted
        ([SS("a", 2, 0, 4), SS("b", 0, 0, 4)],
         [LayerRanges(0, [RangeReplicas(0, 4, R("b"))]), LayerRanges(2, [RangeReplicas(0, 4, R("a"))])]),
    ],
    ids=["empty", "one", "overlap", "gap", "no-merge", "proven-first", "load", "age-then-id", "dup-peer", "layers"],
)
def test_build_layers(slices: list[ServingSlice], want: list[LayerRanges]) -> None:
    got = build_layers(slices, protocol=2)
    assert got == want
    DispatchMap(M, 1, got).validate(n_layer=4, n_expert=16)
    assert build_layers(list(reversed(slices)), protocol=2) == want  # canonical: input order does not matter


@pytest.mark.parametrize(
    ("slices", "protocol", "want"),
    [
        # a v1-only volunteer (an old heartbeat: no protocol list) cannot serve a v2 coordinator
        ([SS("old", 0, 0, 4, protocols=(1,))], 2, []),
        ([SS("old", 0, 0, 4, protocols=())], 2, []),
        ([SS("old", 0, 0, 4, protocols=(1,)), SS("new", 0, 0, 4)], 2, [LayerRanges(0, [RangeReplicas(0, 4, R("new"))])]),
        # ... even when it would be preferred (proven) and its slice boundaries would cut the layer
        ([SS("old", 0, 0, 8, proven=True, protocols=(1,)), SS("new", 0, 4, 8)], 2,
         [LayerRanges(0, [RangeReplicas(4, 8, R("new"))])]),
        # a volunteer speaking several versions serves the coordinators of any of them
        ([SS("both", 0, 0, 4, protocols=(1, 2)), SS("v3", 0, 0, 4, protocols=(3,))], 2,
         [LayerRanges(0, [RangeReplicas(0, 4, R("both"))])]),
        ([SS("both", 0, 0, 4, protocols=(1, 2)), SS("v3", 0, 0, 4, protocols=(3,))], 3,
         [LayerRanges(0, [RangeReplicas(0, 4, R("v3"))])]),
    ],
    ids=["v1-only", "none", "v1-beside-v2", "v1-proven", "multi-v2", "multi-v3"],
)
def test_build_layers_never_maps_a_volunteer_to_a_coordinator_it_cannot_serve(
    slices: list[ServingSlice], protocol: int, want: list[LayerRanges]
) -> None:
    assert build_layers(slices, protocol=protocol) == want


@pytest.mark.parametrize("seed", range(5))
def test_memoised_layers_give_the_same_picks_as_a_fresh_scan(seed: int) -> None:
    """The per-layer memo in the counts must never change a decision: the same pulls against a
    memo-less copy of the counts (same RNG seed) give the same slices, step by step."""
    rng_a, rng_b, traffic = random.Random(seed), random.Random(seed), random.Random(seed + 100)
    c = counts_from(6, 16)
    for _ in range(120):
        budget = Budget(max_experts=traffic.choice([1, 2, 4, 8]))
        target = traffic.choice([1, 2])
        held = [S(traffic.randrange(6), 0, 4)] if traffic.random() < 0.3 else []
        a = choose_slice([supply(c, target=target)], budget, held, rng_a)
        b = choose_slice([supply(c.copy(), target=target)], budget, held, rng_b)
        assert a == b
        if isinstance(a, Pick):
            c.add("pending", a.slice.layer, a.slice.lo, a.slice.hi, 1)
        if traffic.random() < 0.3:  # some coverage arrives, some leases lapse
            layer, lo = traffic.randrange(6), traffic.randrange(16)
            c.add("replica", layer, lo, min(16, lo + 4), 1)
    assert c.memo  # the memo was used


# -- heartbeat directives ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "layer", "lo", "hi", "want"),
    [
        ((2, 8), 0, 0, 8, None),
        ((2, 8), 1, 7, 8, None),
        (None, 0, 0, 4, Reason.UNKNOWN_MODEL),
        (None, 0, 3, 3, Reason.BAD_SLICE_RANGE),  # an empty range is refused first, whatever the model
        ((2, 8), 0, 5, 4, Reason.BAD_SLICE_RANGE),
        ((2, 8), 2, 0, 1, Reason.BAD_SLICE_RANGE),  # no such layer
        ((2, 8), 0, 4, 9, Reason.BAD_SLICE_RANGE),  # past the last expert
    ],
)
def test_slice_refusal(shape: tuple[int, int] | None, layer: int, lo: int, hi: int, want: Reason | None) -> None:
    assert slice_refusal(shape, layer, lo, hi) is want


@pytest.mark.parametrize(
    ("retiring_since", "now", "cooldown", "want"),
    [(None, 0.0, 5.0, False), (10.0, 10.0, 5.0, True), (10.0, 14.99, 5.0, True), (10.0, 15.0, 5.0, False),
     (10.0, 10.0, 0.0, False)],
)
def test_in_cooldown(retiring_since: float | None, now: float, cooldown: float, want: bool) -> None:
    assert in_cooldown(retiring_since, now, cooldown) is want


@pytest.mark.parametrize(
    ("retiring_since", "now", "refusal", "want", "wire_reason"),
    [
        (None, 3.0, None, Directive(Action.KEEP, Reason.HELD), ""),
        (10.0, 10.0, None, Directive(Action.DRAIN, Reason.SURPLUS, 5.0), "surplus"),
        (10.0, 14.75, None, Directive(Action.DRAIN, Reason.SURPLUS, 0.25), "surplus"),
        (10.0, 9.0, None, Directive(Action.DRAIN, Reason.SURPLUS, 6.0), "surplus"),  # retired "in the future"
        (10.0, 15.0, None, Directive(Action.RELEASE, Reason.SURPLUS), "surplus"),  # the cooldown is over
        (10.0, 99.0, None, Directive(Action.RELEASE, Reason.SURPLUS), "surplus"),
        (None, 3.0, Reason.UNKNOWN_MODEL, Directive(Action.RELEASE, Reason.UNKNOWN_MODEL), "unknown_model"),
        (10.0, 11.0, Reason.BAD_SLICE_RANGE, Directive(Action.RELEASE, Reason.BAD_SLICE_RANGE), "bad_slice_range"),
    ],
    ids=["kept", "drain-start", "drain-end", "drain-early", "release-at-cooldown", "release-late", "unknown-model",
         "refusal-wins"],
)
def test_directive(retiring_since: float | None, now: float, refusal: Reason | None, want: Directive,
                   wire_reason: str) -> None:
    got = directive(retiring_since, now, 5.0, refusal)
    assert got == want
    assert got.wire_reason == wire_reason
    if refusal is None:  # drain is exactly the cooldown rule
        assert (got.action is Action.DRAIN) is in_cooldown(retiring_since, now, 5.0)


def test_zero_cooldown_releases_at_once() -> None:
    assert directive(10.0, 10.0, 0.0) == Directive(Action.RELEASE, Reason.SURPLUS)


# -- download sources -------------------------------------------------------------------------


class ScriptedRng:
    """Answers ``uniform`` from a script and counts the draws; any other call fails the test."""

    def __init__(self, draws: list[float]) -> None:
        self.draws = list(draws)
        self.calls = 0

    def uniform(self, a: float, b: float) -> float:
        assert (a, b) == (0.0, 1.0)
        self.calls += 1
        return self.draws.pop(0)

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        raise AssertionError("rank_sources draws only uniform")

    def getrandbits(self, k: int, /) -> int:
        raise AssertionError("rank_sources draws only uniform")


def src(url: str, ok: bool, busy: int | None = None, slots: int = 4) -> Source:
    return Source(url, ok, None if busy is None else PollView(busy, slots, 0.0))


@pytest.mark.parametrize(
    ("sources", "draws", "want"),
    [
        ([], [], []),
        ([src("a", False, 0), src("b", True, 3)], [0.5, 0.5], ["b", "a"]),  # a failed last poll ranks last
        ([src("a", True, 3), src("b", True, 1)], [0.0, 0.9], ["b", "a"]),  # less busy first
        ([src("a", True), src("b", True, 3)], [0.0, 0.9], ["b", "a"]),  # never answered counts as fully busy
        ([src("a", True, 1, slots=0), src("b", True, 3)], [0.0, 0.9], ["b", "a"]),  # 0 slots: busy / 1
        ([src("a", False), src("b", False, 4)], [0.7, 0.2], ["b", "a"]),  # equal (1.0): the draw decides
        ([src("a", True, 2), src("b", True, 2)], [0.7, 0.2], ["b", "a"]),
        ([src("b", True, 2), src("a", True, 2)], [0.3, 0.3], ["a", "b"]),  # equal draws: the URL
    ],
    ids=["none", "ok-first", "least-busy", "never-polled", "zero-slots", "tie-failed", "tie-ok", "tie-url"],
)
def test_rank_sources(sources: list[Source], draws: list[float], want: list[str]) -> None:
    rng = ScriptedRng(draws)
    assert rank_sources(sources, rng) == want
    assert rng.calls == len(sources)  # exactly one draw per source


def test_rank_sources_is_reproducible_from_a_seed() -> None:
    sources = [src(f"http://c{i}", True, 1) for i in range(6)]
    assert rank_sources(sources, random.Random(7)) == rank_sources(sources, random.Random(7))
    assert len({tuple(rank_sources(sources, random.Random(s))) for s in range(20)}) > 1  # equals are spread


# -- per-expert targets (experts not every coordinator computes: --local-experts) ---------------


def test_expert_targets_are_one_number_unless_some_coordinator_lacks_an_expert() -> None:
    all_held = [[True] * 4, [True] * 4]
    assert expert_targets(2, 4, base=1, remote_base=2, boost=1, recruiting=False, held_by_all=None) == 1
    assert expert_targets(2, 4, base=1, remote_base=2, boost=1, recruiting=True, held_by_all=all_held) == 2
    held = [[True, True, False, False], [False] * 4]
    assert expert_targets(2, 4, base=1, remote_base=2, boost=1, recruiting=False, held_by_all=held) == [
        [1, 1, 2, 2], [2, 2, 2, 2]]
    assert expert_targets(2, 4, base=1, remote_base=2, boost=1, recruiting=True, held_by_all=held) == [
        [2, 2, 3, 3], [3, 3, 3, 3]]


def test_segments_split_where_the_target_changes() -> None:
    c = counts_from(1, 4, {(0, 0, 4): 1})
    assert segments(c, [[1, 1, 2, 2]]) == [Segment(0, 0, 2, 1, 0, 1, 0.0), Segment(0, 2, 4, 1, 0, 2, 0.5)]


def test_choose_slice_and_ageout_follow_per_expert_targets() -> None:
    # one replica everywhere: only the experts with target 2 (not held by the coordinator) are needed
    c = counts_from(1, 8, {(0, 0, 8): 1})
    targets = [[1, 1, 1, 1, 2, 2, 2, 2]]
    got = choose_slice([supply(c, target=targets)], Budget(max_experts=8), [], random.Random(1))  # type: ignore[arg-type]
    assert isinstance(got, Pick) and got.slice == S(0, 4, 8) and got.scarcity == 0.5
    # age-out keeps two holdings of the remote experts and one of the others
    hs = [H("a", 0, 4, 0), H("b", 0, 4, 1), H("c", 4, 8, 0), H("d", 4, 8, 1)]
    plan = plan_ageout(1, 8, targets, hs)
    assert plan.retire == ["b"] and plan.restore == []


def test_hot_experts_get_extra_replicas_in_proportion_and_bounded() -> None:
    assert hot_extra([1.0] * 8, 2) == [0] * 8  # uniform: nothing
    assert hot_extra([0.0] * 8, 2) == [0] * 8 and hot_extra([5.0, 1.0], 0) == [0, 0]
    # mean 10: 40 is 4x (+3, bounded at 2), 20 is 2x (+1), the rest below twice the mean
    heat = [40.0, 20.0, 5.0, 5.0, 5.0, 5.0, 0.0, 0.0]
    assert hot_extra(heat, 2) == [2, 1, 0, 0, 0, 0, 0, 0]
    assert hot_extra(heat, 5) == [3, 1, 0, 0, 0, 0, 0, 0]
    t = expert_targets(1, 4, base=1, remote_base=2, boost=0, recruiting=False, held_by_all=None, extra=[[2, 1, 0, 0]])
    assert t == [[3, 2, 1, 1]]
    assert expert_targets(1, 4, base=1, remote_base=2, boost=0, recruiting=False, held_by_all=None,
                          extra=[[0, 0, 0, 0]]) == 1


# -- what a volunteer does (the dashboard) ----------------------------------------------------------


def A(state: str, progress: float | None = None, proved: bool = True, name: str = "0:0-4") -> SliceActivity:
    return SliceActivity(name, state, progress, proved)


@pytest.mark.parametrize(
    ("slices", "rate", "want"),
    [
        ([A("dispatched")], 3.24, "serving 3.2 calls/s"),
        ([A("dispatched")], 41.6, "serving 42 calls/s"),
        ([A("dispatched")], 0.0, "idle"),
        ([A("dispatched")], 0.04, "idle"),  # below one call in 20 s
        ([A("dispatched", proved=False)], 0.0, "idle, not proven yet"),
        ([A("loading", 0.4)], 0.0, "downloading 40 %"),
        ([A("loading")], 0.0, "downloading"),  # no progress reported (an older volunteer)
        ([A("loading", 1.7)], 0.0, "downloading 100 %"),  # clamped
        ([A("dispatched"), A("loading", 0.25, name="1:0-4")], 2.0, "serving 2.0 calls/s; downloading 1:0-4 25 %"),
        ([A("draining")], 5.0, "draining"),
        ([A("retiring")], 0.0, "retiring"),
        ([A("released"), A("retiring", name="1:0-4")], 0.0, "retiring"),
        ([A("released")], 0.0, "released"),
        ([], 0.0, "idle"),
    ],
)
def test_a_volunteers_activity_in_a_few_words(slices: list[SliceActivity], rate: float, want: str) -> None:
    assert activity(slices, rate) == want


def test_call_rate_follows_coordinator_reports_and_falls_to_zero() -> None:
    w = CallWindow(window_s=15.0)
    assert w.rate(0.0) == 0.0
    w.add(0.0, 5.0, 50)  # 50 calls in a 5 s report period
    assert w.rate(5.0) == pytest.approx(10.0)
    w.add(5.0, 10.0, 100)
    assert w.rate(10.0) == pytest.approx(15.0)  # 150 calls over 10 s
    assert w.rate(15.0) == pytest.approx(10.0)  # no report since: 150 over the 15 s window
    assert w.rate(17.5) == pytest.approx((25 + 100) / 15.0)  # half the first period has left the window
    assert w.rate(25.0) == 0.0  # one window after the last reported call
    w.prune(25.0)
    assert not w.periods
    w.add(30.0, 35.0, 0)  # nothing answered: nothing kept
    assert not w.periods
