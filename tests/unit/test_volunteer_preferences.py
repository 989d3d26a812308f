"""A desktop volunteer's preferences (``volunteer.core.preferences``): run now or pause, and why; idle
tracking from samples; the CPU limit's threads and duty cycle. Table-driven, no clock."""

from __future__ import annotations

import pytest

from volunteer.core.preferences import (
    ActivityTracker,
    CpuPlan,
    Decision,
    IdleReading,
    PauseReason,
    Preferences,
    Schedule,
    cpu_plan,
    decide,
    parse_schedule,
    rest_after,
)

NIGHT = parse_schedule("22:00-07:00")
DAY = parse_schedule("09:30-17:00")
IDLE5 = Preferences(idle_s=300.0)


def hm(h: int, m: int = 0) -> int:
    return h * 60 + m


@pytest.mark.parametrize(("text", "schedule"), [
    ("22:00-07:00", Schedule(1320, 420)),
    ("9:30-17:00", Schedule(570, 1020)),
    (" 00:00 - 23:59 ", Schedule(0, 1439)),
])
def test_parse_schedule(text: str, schedule: Schedule) -> None:
    assert parse_schedule(text) == schedule


@pytest.mark.parametrize(("text", "why"), [
    ("22:00", "HH:MM-HH:MM"), ("24:00-07:00", "HH:MM-HH:MM"), ("22:60-07:00", "HH:MM-HH:MM"),
    ("10pm-7am", "HH:MM-HH:MM"), ("08:00-08:00", "starts where it ends"),
])
def test_parse_schedule_refuses(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_schedule(text)


@pytest.mark.parametrize(("schedule", "minute", "inside"), [
    (NIGHT, hm(22), True), (NIGHT, hm(23, 59), True), (NIGHT, hm(0), True), (NIGHT, hm(6, 59), True),
    (NIGHT, hm(7), False), (NIGHT, hm(12), False), (NIGHT, hm(21, 59), False),
    (DAY, hm(9, 30), True), (DAY, hm(16, 59), True), (DAY, hm(17), False), (DAY, hm(9, 29), False),
])
def test_schedule_window(schedule: Schedule, minute: int, inside: bool) -> None:
    assert schedule.contains(minute) is inside


QUIET = IdleReading(input_quiet_s=900.0, cpu_quiet_s=900.0)


@pytest.mark.parametrize(("minute", "reading", "prefs", "manual", "want"), [
    # no preference: always runs, whatever the readings
    (hm(12), IdleReading(0.0, 0.0), Preferences(), False, Decision(True)),
    (hm(12), None, Preferences(), False, Decision(True)),
    # a manual pause wins over everything
    (hm(23), QUIET, Preferences(schedule=NIGHT, idle_s=300.0), True, PauseReason.MANUAL),
    # the schedule
    (hm(12), QUIET, Preferences(schedule=NIGHT), False, PauseReason.SCHEDULE),
    (hm(23), QUIET, Preferences(schedule=NIGHT), False, Decision(True)),
    # idle: input first, then other programs' CPU
    (hm(12), IdleReading(10.0, 900.0), IDLE5, False, PauseReason.USER_ACTIVE),
    (hm(12), IdleReading(10.0, 10.0), IDLE5, False, PauseReason.USER_ACTIVE),
    (hm(12), IdleReading(900.0, 299.0), IDLE5, False, PauseReason.CPU_BUSY),
    (hm(12), IdleReading(300.0, 300.0), IDLE5, False, Decision(True)),  # exactly N minutes quiet: runs
    # what cannot be read does not pause
    (hm(12), IdleReading(None, 900.0), IDLE5, False, Decision(True)),
    (hm(12), IdleReading(None, None), IDLE5, False, Decision(True)),
    (hm(12), None, IDLE5, False, Decision(True)),
    # the schedule before idleness: outside it, idle or not
    (hm(12), IdleReading(5.0, 5.0), Preferences(schedule=NIGHT, idle_s=300.0), False, PauseReason.SCHEDULE),
    (hm(23), IdleReading(5.0, 900.0), Preferences(schedule=NIGHT, idle_s=300.0), False, PauseReason.USER_ACTIVE),
])
def test_decide(minute: int, reading: IdleReading | None, prefs: Preferences, manual: bool,
                want: Decision | PauseReason) -> None:
    got = decide(minute, reading, prefs, manual)
    if isinstance(want, Decision):
        assert got == want and got.wire == ""
    else:
        assert (got.run, got.reason, got.wire) == (False, want, want.value) and got.detail


def test_decide_says_why_in_words() -> None:
    assert decide(hm(12), IdleReading(90.0, 900.0), IDLE5, False).detail == \
        "keyboard or mouse used 2 min ago (waits for 5 min idle)"
    assert decide(hm(12), QUIET, Preferences(schedule=NIGHT), False).detail == "outside its schedule 22:00-07:00"


def test_activity_tracker() -> None:
    t = ActivityTracker(busy_fraction=0.25)
    assert t.observe(0.0, None, None) == IdleReading(None, None)  # nothing readable yet
    assert t.observe(10.0, 100, 0.05) == IdleReading(0.0, 0.0)  # first samples: quiet from now on
    assert t.observe(70.0, 100, 0.10) == IdleReading(60.0, 60.0)  # no input, others below the share
    assert t.observe(80.0, 103, 0.10) == IdleReading(0.0, 70.0)  # keys pressed
    assert t.observe(90.0, 103, 0.60) == IdleReading(10.0, 0.0)  # a compiler ran
    assert t.observe(400.0, 103, None) == IdleReading(320.0, 310.0)  # a sample missing changes nothing
    assert t.observe(401.0, None, 0.0) == IdleReading(321.0, 311.0)


@pytest.mark.parametrize(("pct", "cpus", "threads", "plan"), [
    (None, 8, 4, CpuPlan(4, 1.0)),
    (100, 8, 4, CpuPlan(4, 1.0)),  # the whole machine: as many threads as asked
    (50, 8, 8, CpuPlan(4, 1.0)),  # half of 8 cpus: 4 threads flat out
    (50, 8, 2, CpuPlan(2, 1.0)),  # never more threads than asked
    (75, 2, 4, CpuPlan(2, 0.75)),  # 1.5 cpus: 2 threads at a 75 % duty cycle
    (25, 2, 4, CpuPlan(1, 0.5)),  # half a cpu: 1 thread, half the time
    (10, 1, 1, CpuPlan(1, 0.1)),
])
def test_cpu_plan(pct: float | None, cpus: int, threads: int, plan: CpuPlan) -> None:
    got = cpu_plan(pct, cpus, threads)
    assert got.threads == plan.threads and got.duty == pytest.approx(plan.duty)


def test_cpu_plan_refuses_and_rest_holds_the_duty_cycle() -> None:
    for bad in (0, -5, 101):
        with pytest.raises(ValueError, match="--cpu-limit"):
            cpu_plan(bad, 4, 4)
    assert rest_after(0.2, 1.0) == 0.0 and rest_after(0.0, 0.5) == 0.0
    assert rest_after(0.2, 0.5) == pytest.approx(0.2)  # compute 0.2 s, rest 0.2 s: 50 %
    assert rest_after(0.1, 0.25) == pytest.approx(0.3)
    busy = 0.1 / (0.1 + rest_after(0.1, 0.2))
    assert busy == pytest.approx(0.2)
