"""The split check (coordinator.core.split_check), table-driven, and its place in the dispatch core:
windows local / split / local, the decision with its margin, the hold, the watch, suspensions, the arm's placements."""

from __future__ import annotations

import pytest

from coordinator.core.dispatch import (
    DispatchConfig,
    DispatchCore,
    LayerRanLocally,
    LayerReady,
    LoadSample,
    RangeWork,
    Reason,
    RunLocal,
    SendRemote,
    SplitChecked,
    StepId,
    WorkersListed,
)
from coordinator.core.split_check import SplitArm, SplitCheck


def run(check: SplitCheck, rates: tuple[float, float, float], *, t0: float = 0.0, dt: float = 0.1):  # type: ignore[no-untyped-def]
    """Feed layers every ``dt`` s from ``t0``, the k-th window's at ``rates[k]`` pairs/s (windows of
    ``check.window_s`` from ``t0``), until the check ends; returns the arms that placed the layers
    (the last one: the decision's), the outcome and its time."""
    arms: list[SplitArm] = []
    for n in range(10_000):
        t = round(t0 + n * dt, 9)
        k = min(len(rates) - 1, int(round((t - t0) / check.window_s, 9)))
        o = check.observe(round(rates[k] * dt), t)
        arms.append(check.arm())
        if o is not None:
            return arms, o, t
    raise AssertionError("the check never ended")


@pytest.mark.parametrize(
    ("rates", "arm"),
    [
        ((1000.0, 1200.0, 1000.0), SplitArm.SPLIT),  # the split faster: kept
        ((1000.0, 1040.0, 1000.0), SplitArm.LOCAL),  # within the 5 % margin
        ((1000.0, 770.0, 1000.0), SplitArm.LOCAL),
        # a load ramping up: the split window sits between the two local ones, so the ramp cancels
        ((800.0, 1000.0, 1200.0), SplitArm.LOCAL),
        ((800.0, 1200.0, 1200.0), SplitArm.SPLIT),
    ],
)
def test_decision(rates: tuple[float, float, float], arm: SplitArm) -> None:
    check = SplitCheck(window_s=1.0, hold_s=10.0, margin=0.05)
    arms, o, t = run(check, rates)
    assert o is not None and o.arm is arm
    assert o.split_rate == pytest.approx(rates[1], rel=1e-6)
    assert o.local_rate == pytest.approx((rates[0] + rates[2]) / 2, rel=1e-6)
    # the windows ran in the order local, split, local; then the decision is in force
    runs = [a for i, a in enumerate(arms[:-1]) if i == 0 or arms[i - 1] is not a]
    assert runs == [SplitArm.LOCAL, SplitArm.SPLIT, SplitArm.LOCAL] and arms[-1] is arm
    assert not check.checking and check.arm() is arm and o.until == pytest.approx(t + 10.0)


def test_the_decision_holds_then_a_new_check_starts() -> None:
    check = SplitCheck(window_s=1.0, hold_s=10.0)
    _, o, t = run(check, (1000.0, 500.0, 1000.0))
    assert o is not None and o.arm is SplitArm.LOCAL
    assert check.observe(100, t + 9.9) is None and check.arm() is SplitArm.LOCAL and not check.checking
    assert check.observe(100, t + 10.0) is None
    assert check.checking and check.arm() is SplitArm.LOCAL  # the new check's first window
    _, o2, _ = run(check, (1000.0, 2000.0, 1000.0), t0=t + 10.1)
    assert o2 is not None and o2.arm is SplitArm.SPLIT and check.outcomes == [o, o2]


def test_a_held_split_that_falls_behind_is_dropped_at_once() -> None:
    check = SplitCheck(window_s=1.0, hold_s=10.0, margin=0.05)
    _, o, t = run(check, (1000.0, 1500.0, 1000.0))
    assert o is not None and o.arm is SplitArm.SPLIT
    # held: windows at 1100 pairs/s (above the 1000 it beat) change nothing ...
    for n in range(1, 31):
        assert check.observe(110, round(t + n * 0.1, 9)) is None
    assert check.arm() is SplitArm.SPLIT
    # ... one at 900 ends the hold
    t2 = round(t + 3.0, 9)
    out = None
    for n in range(1, 12):
        out = out or check.observe(90, round(t2 + n * 0.1, 9))
    assert out is not None and out.watched and out.arm is SplitArm.LOCAL
    assert out.split_rate == pytest.approx(900, rel=0.15) and out.local_rate == pytest.approx(1000)
    assert check.arm() is SplitArm.LOCAL and not check.checking and out.until == pytest.approx(out.at + 10.0)
    # a held local is not watched: nothing changes until its hold ends
    assert all(check.observe(1, out.at + 0.1 * n) is None for n in range(1, 99))


def test_a_held_split_must_confirm_its_win_in_its_first_window() -> None:
    check = SplitCheck(window_s=1.0, hold_s=10.0, margin=0.05)
    _, o, t = run(check, (1000.0, 1500.0, 1000.0))  # one window's win: it may be noise
    assert o is not None and o.arm is SplitArm.SPLIT
    out = None
    for n in range(1, 12):  # 1030 pairs/s: above the local rate, but not by the margin (1050)
        out = out or check.observe(103, round(t + n * 0.1, 9))
    assert out is not None and out.watched and out.arm is SplitArm.LOCAL
    assert out.split_rate == pytest.approx(1030, rel=0.05)


def test_a_suspended_check_drops_the_window_under_way_and_resumes() -> None:
    check = SplitCheck(window_s=1.0, hold_s=10.0, margin=0.05)
    assert check.arm() is SplitArm.SPLIT  # before any check: earliest finish as it was
    for n in range(11):  # the first local window at 1000 pairs/s, then into the split window
        check.observe(100, n * 0.1)
    assert check.checking and check.arm() is SplitArm.SPLIT
    check.observe(100, 1.1)
    check.suspend(1.2)  # the load left
    assert not check.checking and check.arm() is SplitArm.SPLIT and check.outcomes == []
    # loaded again 5 s later: the split window re-runs from scratch (at 2000 pairs/s), then local
    t = 6.2
    for n in range(11):
        assert check.observe(200 if n < 10 else 100, round(t + n * 0.1, 9)) is None
        assert check.arm() is (SplitArm.SPLIT if n < 10 else SplitArm.LOCAL)
    out = None
    for n in range(11, 22):
        out = out or check.observe(100, round(t + n * 0.1, 9))
    assert out is not None and out.arm is SplitArm.SPLIT
    assert out.split_rate == pytest.approx(2000) and out.local_rates == pytest.approx((1000, 1000))


def test_a_long_suspension_starts_the_check_over() -> None:
    check = SplitCheck(window_s=1.0, hold_s=10.0)
    for n in range(12):
        check.observe(100, n * 0.1)
    check.suspend(1.2)
    check.observe(100, 11.3)  # more than hold_s later
    assert check.checking and check.arm() is SplitArm.LOCAL  # the first window again


def test_a_held_splits_watch_window_is_dropped_when_the_load_leaves() -> None:
    check = SplitCheck(window_s=1.0, hold_s=30.0, margin=0.05)
    _, o, t = run(check, (1000.0, 1500.0, 1000.0))
    assert o is not None and o.arm is SplitArm.SPLIT
    check.observe(110, t + 0.1)
    check.suspend(t + 0.2)
    # 5 s without load would read as a rate near 0 -- the window is dropped instead
    for n in range(12):
        assert check.observe(110, round(t + 5.2 + n * 0.1, 9)) is None
    assert check.arm() is SplitArm.SPLIT


def test_off() -> None:
    check = SplitCheck(window_s=0.0)
    for i in range(100):
        assert check.observe(100, i * 0.1) is None
        assert check.arm() is SplitArm.SPLIT and not check.checking


# -- in the core ------------------------------------------------------------------------------------

MS = 1e-3


def core(**kw: object) -> DispatchCore:
    cfg = DispatchConfig(local_cost_prior_s=1 * MS, verify_rate=0.0, verify_probation_calls=0,
                         probe_interval_s=0.0, split_check_s=1.0, split_hold_s=10.0, **kw)  # type: ignore[arg-type]
    c = DispatchCore(cfg, n_layer=2, n_expert=8)
    c.handle(WorkersListed(frozenset({"p"})), 0.0)
    c.table.succeeded("p", rows=8, latency_s=2 * MS, wall_ms=1)  # 2 ms: earliest finish sends 8-pair ranges
    c.table.verified("p", True)
    return c


def test_the_arm_places_the_ranges_and_the_outcome_is_an_effect() -> None:
    c = core()
    c.handle(LoadSample(4, 4), 0.0)
    step = 0
    seen: list[tuple[str, Reason]] = []
    checked: list[SplitChecked] = []
    t = 0.0
    while not checked:
        step += 1
        rws = (RangeWork(0, 4, 8, 8, ("p",), True),)
        # the local arm: the fast path may run the layer here (unbounded), the reason is the check's
        bound, reason = c.local_only_pairs(t)
        if c.split.arm() is SplitArm.LOCAL:
            assert (bound, reason) == (float("inf"), Reason.SPLIT_CHECK)
        eff = c.handle(LayerReady(StepId(step), 0, rws, ()), t)
        for e in eff:
            if isinstance(e, SendRemote | RunLocal):
                seen.append((type(e).__name__, e.reason))
            if isinstance(e, SplitChecked):
                checked.append(e)
        # the local windows 1000 pairs/s, the split 2000: layers end at once here (the core only counts)
        t = round(t + (0.004 if c.split.arm() is SplitArm.SPLIT else 0.008), 9)
        if step % 16 == 0:
            c.handle(LoadSample(4, 4), t)
    kinds = {k for k in seen}
    assert ("RunLocal", Reason.SPLIT_CHECK) in kinds
    assert ("SendRemote", Reason.LOAD_EARLIEST_FINISH_REMOTE) in kinds
    [sc] = checked
    assert sc.reason is Reason.SPLIT_FASTER and sc.outcome.arm is SplitArm.SPLIT
    assert Reason.SPLIT_FASTER not in c.decisions  # a verdict, not a placement


def test_a_slower_split_keeps_everything_here_and_the_fast_path_reports_it() -> None:
    c = core()
    c.handle(LoadSample(4, 4), 0.0)
    t, step = 0.0, 0
    while not c.split.outcomes:
        step += 1
        arm = c.split.arm()
        c.handle(LayerRanLocally(0, (RangeWork(0, 4, 8, 8, ("p",), True),), Reason.SPLIT_CHECK, 0.008), t)
        t = round(t + (0.016 if arm is SplitArm.SPLIT else 0.008), 9)  # the split window: half the rate
        if step % 16 == 0:
            c.handle(LoadSample(4, 4), t)
    assert c.split.outcomes[-1].arm is SplitArm.LOCAL
    assert c.local_only_pairs(t) == (float("inf"), Reason.SPLIT_SLOWER)
    eff = c.handle(LayerReady(StepId(99), 0, (RangeWork(0, 4, 8, 8, ("p",), True),), ()), t)
    assert [(type(e).__name__, e.reason) for e in eff if isinstance(e, SendRemote | RunLocal)] == [
        ("RunLocal", Reason.SPLIT_SLOWER)]


def test_the_load_ending_suspends_a_check() -> None:
    c = core()
    c.handle(LoadSample(4, 4), 0.0)
    c.handle(LayerReady(StepId(1), 0, (RangeWork(0, 4, 8, 8, ("p",), True),), ()), 0.0)
    assert c.split.checking and c.split.arm() is SplitArm.LOCAL
    c.handle(LoadSample(0, 4), 0.5)  # serve TTL
    assert not c.split.checking and c.split.arm() is SplitArm.SPLIT
    eff = c.handle(LayerReady(StepId(2), 0, (RangeWork(0, 4, 8, 8, ("p",), True),), ()), 0.6)
    assert [e.reason for e in eff if isinstance(e, SendRemote)] == [Reason.SERVE_TTL]
    c.handle(LoadSample(4, 4), 2.0)  # loaded again: the check goes on where it was
    eff = c.handle(LayerReady(StepId(3), 0, (RangeWork(0, 4, 8, 8, ("p",), True),), ()), 2.0)
    assert c.split.checking and [e.reason for e in eff if isinstance(e, RunLocal)] == [Reason.SPLIT_CHECK]
