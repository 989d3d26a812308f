"""The admission core under virtual time (``coordinator.core.admission``): speed, settling, projection,
decisions, continuations; hypothesis properties for the rules that must hold whatever happened before."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.admission import AdmissionCore, AdmissionPolicy, Reason, Verdict


def core(**kw: object) -> AdmissionCore:
    return AdmissionCore(AdmissionPolicy(**kw))  # type: ignore[arg-type]


def run_tokens(c: AdmissionCore, sids: list[int], tps: dict[int, float], t0: float, seconds: float) -> float:
    """Every session in ``sids`` decodes one token per 1/tps[sid] seconds for ``seconds``; returns the end time."""
    nxt = {sid: t0 for sid in sids}
    end = t0 + seconds
    while True:
        sid = min(nxt, key=lambda s: nxt[s])
        t = nxt[sid]
        if t > end:
            return end
        c.tokens(sid, 1, t)
        nxt[sid] = t + 1.0 / tps[sid]


def test_session_tps_is_an_ewma_of_token_intervals_and_the_first_token_only_starts_the_clock() -> None:
    c = core(alpha=0.5)
    c.started(1, 0.0)
    c.tokens(1, 1, 3.0)  # the prefill's token: no interval yet
    assert c.session_tps(1) is None
    c.tokens(1, 1, 3.5)
    assert c.session_tps(1) == pytest.approx(2.0)
    c.tokens(1, 3, 4.0)  # a speculative step: 3 tokens in 0.5 s; averaged as seconds per token
    assert c.session_tps(1) == pytest.approx(1 / (0.5 * 0.5 + 0.5 / 6))
    c.tokens(1, 2, 4.0)  # the same instant: counted, no interval
    assert c.session_tps(1) == pytest.approx(3.0)
    assert c.sessions[1].decoded == 6


def test_warming_sessions_are_left_out_of_the_mean_until_settle_tokens_or_settle_s() -> None:
    c = core(settle_tokens=4, settle_s=5.0)
    c.started(1, 0.0)
    for i in range(6):
        c.tokens(1, 1, 1.0 + i * 0.1)  # 5 decode tokens at 10 tps
    assert not c.warming(1, 1.5)
    assert c.mean_active_tps(1.5) == pytest.approx(10.0)
    c.started(2, 1.5)
    c.tokens(2, 1, 1.6)
    c.tokens(2, 1, 1.8)  # 5 tps, but warming: one decode token
    assert c.warming(2, 1.8)
    assert c.mean_active_tps(1.8) == pytest.approx(10.0)
    assert c.decode_tps() == pytest.approx(15.0)
    assert c.settle_remaining_s(1.8) == pytest.approx(4.7)
    assert not c.warming(2, 6.5)  # by time
    assert c.mean_active_tps(6.5) == pytest.approx(7.5)
    c.ended(1, 7.0)
    assert c.mean_active_tps(7.0) == pytest.approx(5.0)


def test_the_first_projection_is_the_aggregate_shared_by_one_more() -> None:
    c = core(tps_floor=3.0, mode="enforced", settle_tokens=8)
    c.started(1, 0.0)
    run_tokens(c, [1], {1: 10.0}, 0.0, 2.0)
    cap = c.capacity(2.0, free_slots=3)
    assert cap.mean_active_tps == pytest.approx(10.0)
    assert cap.projected_mean_tps_if_admitted == pytest.approx(5.0)
    assert (cap.can_admit, cap.reason, cap.headroom_sessions) == (True, Reason.ABOVE_FLOOR, 2)  # 5.0, 3.33, then 2.5


def test_an_observed_drop_replaces_the_model() -> None:
    """1 session at 10 tps; a second makes both 8 tps (the aggregate grew 1.6x): the projection learns it."""
    c = core(tps_floor=1.0, mode="enforced", settle_tokens=8, settle_s=100.0)
    c.started(1, 0.0)
    t = run_tokens(c, [1], {1: 10.0}, 0.0, 2.0)
    c.started(2, t)
    assert c.decide(t + 0.01).verdict is Verdict.HOLD  # settling
    t = run_tokens(c, [1, 2], {1: 8.0, 2: 8.0}, t, 3.0)
    assert not c.warming(2, t)
    assert c.observed == 1
    assert c.scaling == pytest.approx(0.6, abs=0.05)  # 8 * 2 / 10 - 1: the aggregate kept 60 % of a session's share
    m = c.mean_active_tps(t)
    assert m is not None
    assert c.projected(1, t) == pytest.approx(m * (2 + c.scaling) / 3)


def test_an_admit_is_not_observed_when_other_sessions_came_or_went() -> None:
    c = core(tps_floor=1.0, settle_tokens=4, settle_s=100.0)
    for sid in (1, 2):
        c.started(sid, 0.0)
    t = run_tokens(c, [1, 2], {1: 10.0, 2: 10.0}, 0.0, 2.0)
    c.started(3, t)
    c.ended(1, t + 0.1)
    run_tokens(c, [2, 3], {2: 5.0, 3: 5.0}, t + 0.1, 3.0)
    assert (c.observed, c.scaling) == (0, 0.0)


def test_enforced_reject_below_the_floor_with_retry_after() -> None:
    c = core(tps_floor=6.0, mode="enforced", settle_tokens=4, retry_after_s=2.0)
    c.started(1, 0.0)
    t = run_tokens(c, [1], {1: 10.0}, 0.0, 2.0)  # 10 tps; one more: 5 < 6
    d = c.decide(t)
    assert (d.verdict, d.reason, d.retry_after_s) == (Verdict.REJECT, Reason.BELOW_FLOOR, 2.0)
    cap = c.capacity(t, free_slots=3)
    assert (cap.can_admit, cap.headroom_sessions, cap.reason) == (False, 0, Reason.BELOW_FLOOR)
    assert c.decide(t, continuation=True).verdict is Verdict.ADMIT
    assert c.decide(t, overcommit=True).reason is Reason.OVERCOMMIT


@pytest.mark.parametrize(("on", "verdict", "reason", "remaining"), [
    ("reject", Verdict.REJECT, Reason.BELOW_FLOOR, None),
    ("warn", Verdict.ADMIT, Reason.BELOW_FLOOR, 0),
    ("queue", Verdict.HOLD, Reason.BELOW_FLOOR, None),
])
def test_on_saturation(on: str, verdict: Verdict, reason: Reason, remaining: int | None) -> None:
    c = core(tps_floor=6.0, mode="enforced", settle_tokens=4, on_saturation=on, hold_s=10.0)
    c.started(1, 0.0)
    t = run_tokens(c, [1], {1: 10.0}, 0.0, 2.0)
    d = c.decide(t)
    assert (d.verdict, d.reason, d.sessions_remaining) == (verdict, reason, remaining)
    if on == "queue":
        assert d.recheck_at == pytest.approx(t + 10.0)
        late = c.decide(t + 10.0, held_since=t)
        assert (late.verdict, late.reason) == (Verdict.REJECT, Reason.HOLD_EXPIRED)
        c.ended(1, t + 5.0)  # capacity opened while held: admitted
        assert c.decide(t + 5.0, held_since=t).verdict is Verdict.ADMIT


def test_settling_holds_a_new_request_bounded_then_decides_without_the_window() -> None:
    c = core(tps_floor=1.0, mode="enforced", settle_tokens=48, settle_s=5.0, hold_s=2.0)
    c.started(1, 0.0)
    d = c.decide(0.5)
    assert (d.verdict, d.reason, d.recheck_at) == (Verdict.HOLD, Reason.SETTLING, 2.5)
    assert c.decide(2.5, held_since=0.5).verdict is Verdict.ADMIT  # the hold's bound: rule 5 (unmeasured: admit)
    cap = c.capacity(1.0, free_slots=3)
    assert (cap.settling, cap.settle_remaining_ms, cap.can_admit, cap.reason) == (True, 4000, False, Reason.SETTLING)


def test_settle_ends_at_settle_tokens_before_settle_s() -> None:
    c = core(tps_floor=1.0, mode="enforced", settle_tokens=3, settle_s=5.0)
    c.started(1, 0.0)
    for i in range(4):
        c.tokens(1, 1, 0.1 * (i + 1))
    assert c.settle_remaining_s(0.4) == 0.0
    assert c.decide(0.4).verdict is Verdict.ADMIT


def test_no_floor_and_advisory_admit_everything_and_capacity_still_tells() -> None:
    for mode, reason in (("advisory", Reason.ADVISORY),):
        c = core(tps_floor=6.0, mode=mode, settle_tokens=4)
        c.started(1, 0.0)
        t = run_tokens(c, [1], {1: 10.0}, 0.0, 2.0)
        assert c.decide(t).reason is reason
        assert c.capacity(t, free_slots=2).can_admit is False
    c = core(settle_tokens=4)
    c.started(1, 0.0)
    assert c.decide(0.0).reason is Reason.NO_FLOOR
    cap = c.capacity(0.0, free_slots=3)
    assert (cap.can_admit, cap.headroom_sessions, cap.reason, cap.tps_floor) == (True, 3, Reason.NO_FLOOR, None)
    assert c.capacity(0.0, free_slots=0).reason is Reason.SLOTS_FULL


def test_idle_admits_and_guarantee_min_admits_below_the_floor() -> None:
    c = core(tps_floor=100.0, mode="enforced", guarantee_min_sessions=2, settle_tokens=4)
    assert c.decide(0.0).reason is Reason.GUARANTEED
    c.started(1, 0.0)
    assert c.decide(0.0).reason is Reason.GUARANTEED  # settling, but guaranteed
    run_tokens(c, [1], {1: 10.0}, 0.0, 2.0)
    c.started(2, 2.0)
    t = run_tokens(c, [1, 2], {1: 5.0, 2: 5.0}, 2.0, 3.0)
    assert c.decide(t).verdict is Verdict.REJECT
    assert core(tps_floor=100.0, mode="enforced").decide(0.0).reason is Reason.IDLE


def test_continuation_keys_expire_and_are_bounded() -> None:
    c = core(session_ttl_s=10.0, max_remembered=2)
    c.remember(("sid", "a"), 0.0)
    c.remember((5, b"h5"), 1.0, length=5)
    assert c.remembered_lengths() == [5]
    assert c.continues([("sid", "a")], 5.0)
    assert not c.continues([("sid", "b")], 5.0)
    c.remember((7, b"h7"), 6.0, length=7)  # the bound: the least recently used key (5, h5) goes
    assert c.remembered_lengths() == [7]
    assert not c.continues([(5, b"h5")], 6.0)
    assert c.continues([(7, b"h7")], 15.0)
    assert not c.continues([("sid", "a")], 15.1)  # 10 s since 5.0: expired
    assert not c.continues([(7, b"h7")], 25.1)
    assert c.remembered_lengths() == []


# -- properties -------------------------------------------------------------------------------------
ops = st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, 7)),
    st.tuples(st.just("tokens"), st.integers(0, 7), st.integers(1, 4)),
    st.tuples(st.just("end"), st.integers(0, 7)),
    st.tuples(st.just("wait"), st.floats(0.0, 3.0)),
), max_size=60)
policies = st.builds(AdmissionPolicy, tps_floor=st.one_of(st.none(), st.floats(0.5, 50.0)),
                     mode=st.sampled_from(["advisory", "enforced"]),
                     on_saturation=st.sampled_from(["reject", "warn", "queue"]),
                     guarantee_min_sessions=st.integers(0, 4), settle_tokens=st.integers(1, 20),
                     settle_s=st.floats(0.0, 5.0), hold_s=st.floats(0.0, 5.0))


def replay(policy: AdmissionPolicy, history: list[tuple[object, ...]]) -> tuple[AdmissionCore, float]:
    c = AdmissionCore(policy)
    now = 0.0
    for op in history:
        match op:
            case ("start", sid):
                c.started(sid, now)
            case ("tokens", sid, n):
                c.tokens(sid, int(n), now)  # type: ignore[call-overload]
            case ("end", sid):
                c.ended(sid, now)
            case ("wait", dt):
                now += float(dt)  # type: ignore[arg-type]
        now += 0.01
    return c, now


@settings(max_examples=200, deadline=None)
@given(policies, ops)
def test_property_a_continuation_or_overcommit_is_never_gated(policy: AdmissionPolicy, history: list[tuple[object, ...]]) -> None:
    c, now = replay(policy, history)
    assert c.decide(now, continuation=True).verdict is Verdict.ADMIT
    assert c.decide(now, overcommit=True, held_since=now - 100).verdict is Verdict.ADMIT


@settings(max_examples=200, deadline=None)
@given(policies, ops)
def test_property_guarantee_min_always_admits(policy: AdmissionPolicy, history: list[tuple[object, ...]]) -> None:
    c, now = replay(policy, history)
    if len(c.sessions) < policy.guarantee_min_sessions:
        assert c.decide(now).verdict is Verdict.ADMIT
        assert c.capacity(now, free_slots=0).can_admit


@settings(max_examples=200, deadline=None)
@given(policies, ops)
def test_property_holds_are_bounded_and_rejections_only_when_enforced_below_the_floor(
        policy: AdmissionPolicy, history: list[tuple[object, ...]]) -> None:
    c, now = replay(policy, history)
    d = c.decide(now + policy.hold_s, held_since=now)
    assert d.verdict is not Verdict.HOLD  # a hold never outlives its bound
    first = c.decide(now)
    if first.verdict is Verdict.HOLD:
        assert first.recheck_at is not None and now < first.recheck_at <= now + policy.hold_s
    if first.verdict is Verdict.REJECT:
        assert policy.mode == "enforced" and policy.tps_floor is not None
        assert first.retry_after_s is not None and first.retry_after_s >= policy.retry_after_s
        proj = c.projected(1, now)
        assert proj is not None and proj < policy.tps_floor
    cap = c.capacity(now, free_slots=2)
    assert cap.headroom_sessions >= 0 and cap.settle_remaining_ms >= 0
    if cap.can_admit:
        assert cap.headroom_sessions > 0
    else:
        assert cap.reason in (Reason.SETTLING, Reason.BELOW_FLOOR, Reason.SLOTS_FULL)


@settings(max_examples=200, deadline=None)
@given(policies, ops)
def test_property_capacity_says_what_an_enforced_decision_does(policy: AdmissionPolicy,
                                                               history: list[tuple[object, ...]]) -> None:
    enforced = dataclasses.replace(policy, mode="enforced", on_saturation="reject")
    c, now = replay(enforced, history)
    assert c.capacity(now, free_slots=64).can_admit == (c.decide(now).verdict is Verdict.ADMIT)


def test_policy_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="tps_floor"):
        AdmissionPolicy(tps_floor=0.0)
    with pytest.raises(ValueError, match="settle_tokens"):
        AdmissionPolicy(settle_tokens=0)


def test_warming_sessions_count_in_the_projection_though_not_in_the_mean() -> None:
    """A burst of admits past their hold's bound: each warming one is projected as an admit the mean does not
    show yet, so the burst stops where the floor does."""
    c = core(tps_floor=3.0, mode="enforced", settle_tokens=48, settle_s=5.0, hold_s=1.0)
    c.started(1, 0.0)
    t = run_tokens(c, [1], {1: 10.0}, 0.0, 6.0)  # 10 tps, settled
    admitted = 1
    for sid in range(2, 10):
        if c.decide(t, held_since=t - 1.0).verdict is not Verdict.ADMIT:  # past the hold: rule 5
            break
        c.started(sid, t)
        admitted += 1
    assert c.mean_active_tps(t) == pytest.approx(10.0)
    assert admitted == 3  # 10 * 1/3 = 3.33 >= 3; 10 * 1/4 = 2.5 < 3
    assert c.projected(1, t) == pytest.approx(2.5)


def test_a_noisy_window_never_makes_the_projection_exceed_the_mean() -> None:
    """1 session at 5 tps; with the second both read 9 tps (a burst of the machine, not the admit): the scaling
    is clamped to 1 and the projection stays at most the mean."""
    c = core(tps_floor=1.0, settle_tokens=8, settle_s=100.0)
    c.started(1, 0.0)
    t = run_tokens(c, [1], {1: 5.0}, 0.0, 3.0)
    c.started(2, t)
    t = run_tokens(c, [1, 2], {1: 9.0, 2: 9.0}, t, 3.0)
    assert (c.observed, c.scaling) == (1, 1.0)
    m = c.mean_active_tps(t)
    assert m is not None and c.projected(1, t) == pytest.approx(m) and c.projected(5, t) == pytest.approx(m)


@settings(max_examples=200, deadline=None)
@given(policies, ops, st.integers(1, 8))
def test_property_the_projection_never_exceeds_the_mean_and_falls_with_k(
        policy: AdmissionPolicy, history: list[tuple[object, ...]], k: int) -> None:
    c, now = replay(policy, history)
    m, p1, pk = c.mean_active_tps(now), c.projected(k, now), c.projected(k + 1, now)
    if m is not None and p1 is not None and pk is not None:
        assert pk <= p1 <= m * (1 + 1e-12)
