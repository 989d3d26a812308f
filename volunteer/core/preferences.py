"""When a desktop volunteer computes, and how much (pure: no clock, no /proc, no I/O; times are given).

People lend their own computer, as with BOINC: the volunteer serves only while its owner's
preferences allow, and says so to the market when they do not (a paused volunteer's slices are
reported ``draining``: not counted, not dispatched, not dropped).

Rules:
- ``decide(minute_of_day, reading, prefs, manual)`` is the one answer to "run now or pause", first
  reason wins: a manual pause (``moe-swarm volunteer pause``), outside the ``--schedule`` window,
  keyboard or mouse input within ``--only-when-idle`` minutes, other processes using more than
  ``busy_fraction`` of the machine's CPU within those minutes. Readings that cannot be taken
  (``None``: no input device interrupts to count, no /proc/stat) do not pause.
- A schedule ``HH:MM-HH:MM`` is a daily window in local time, start included, end excluded; a
  window whose end is before its start runs over midnight (``22:00-07:00``). Start equal to end is
  refused (say nothing instead of "always").
- ``ActivityTracker`` turns samples (an input event counter, the CPU share of other processes) into
  how long each has been quiet: a counter that moved, or a share above ``busy_fraction``, is
  activity at that sample's time. Before the first sample nothing is known; from the first sample on
  it has been quiet since that sample at least (so ``--only-when-idle N`` waits N minutes after a
  start: quiet before it cannot be known).
- ``cpu_plan(limit_pct, n_cpus, threads)``: ``--cpu-limit`` is a share of the whole machine. The
  volunteer computes with ``ceil(share x cpus)`` threads at most (at least one, never more than
  asked), and when that is more than the share, rests after each computation for as long as keeps
  its duty cycle at ``share x cpus / threads`` (``rest_after``): BOINC's "use at most N % of CPU time".
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

__all__ = [
    "ActivityTracker",
    "CpuPlan",
    "Decision",
    "IdleReading",
    "PauseReason",
    "Preferences",
    "Schedule",
    "cpu_plan",
    "decide",
    "parse_schedule",
    "rest_after",
]


class PauseReason(enum.StrEnum):
    MANUAL = "manual"  # moe-swarm volunteer pause
    SCHEDULE = "schedule"  # outside the --schedule window
    USER_ACTIVE = "user_active"  # keyboard or mouse input within --only-when-idle minutes
    CPU_BUSY = "cpu_busy"  # other processes used the CPU within --only-when-idle minutes


@dataclass(frozen=True)
class Schedule:
    start_min: int  # minutes after local midnight, 0..1439
    end_min: int

    def contains(self, minute_of_day: int) -> bool:
        m = minute_of_day % 1440
        if self.start_min < self.end_min:
            return self.start_min <= m < self.end_min
        return m >= self.start_min or m < self.end_min

    def __str__(self) -> str:
        return f"{self.start_min // 60:02d}:{self.start_min % 60:02d}-{self.end_min // 60:02d}:{self.end_min % 60:02d}"


_HHMM = re.compile(r"([01]?[0-9]|2[0-3]):([0-5][0-9])")


def parse_schedule(text: str) -> Schedule:
    """``HH:MM-HH:MM`` (``ValueError`` with the reason otherwise)."""
    start, sep, end = text.strip().partition("-")
    a, b = _HHMM.fullmatch(start.strip()), _HHMM.fullmatch(end.strip())
    if not sep or a is None or b is None:
        raise ValueError(f"{text!r} is not a daily window HH:MM-HH:MM (24-hour clock, e.g. 22:00-07:00)")
    s = Schedule(int(a.group(1)) * 60 + int(a.group(2)), int(b.group(1)) * 60 + int(b.group(2)))
    if s.start_min == s.end_min:
        raise ValueError(f"{text!r} starts where it ends: leave --schedule out to run at any time")
    return s


@dataclass(frozen=True)
class Preferences:
    schedule: Schedule | None = None
    idle_s: float | None = None  # --only-when-idle, in seconds (None: whatever the owner does)
    busy_fraction: float = 0.25  # other processes above this share of all CPUs count as use


@dataclass(frozen=True)
class IdleReading:
    """How long the keyboard/mouse and other processes' CPU use have been quiet (None: not known)."""

    input_quiet_s: float | None
    cpu_quiet_s: float | None


@dataclass(frozen=True)
class Decision:
    run: bool
    reason: PauseReason | None = None
    detail: str = ""

    @property
    def wire(self) -> str:
        """The heartbeat's ``paused`` value: the reason, or "" while it runs."""
        return self.reason.value if self.reason is not None else ""


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def decide(minute_of_day: int, reading: IdleReading | None, prefs: Preferences, manual: bool) -> Decision:
    """Run now, or pause and why (see the rules)."""
    if manual:
        return Decision(False, PauseReason.MANUAL, "paused by its owner (moe-swarm volunteer resume)")
    if prefs.schedule is not None and not prefs.schedule.contains(minute_of_day):
        return Decision(False, PauseReason.SCHEDULE, f"outside its schedule {prefs.schedule}")
    if prefs.idle_s is not None and reading is not None:
        if reading.input_quiet_s is not None and reading.input_quiet_s < prefs.idle_s:
            return Decision(False, PauseReason.USER_ACTIVE,
                            f"keyboard or mouse used {_minutes(reading.input_quiet_s)} ago "
                            f"(waits for {_minutes(prefs.idle_s)} idle)")
        if reading.cpu_quiet_s is not None and reading.cpu_quiet_s < prefs.idle_s:
            return Decision(False, PauseReason.CPU_BUSY,
                            f"other programs used the CPU {_minutes(reading.cpu_quiet_s)} ago "
                            f"(waits for {_minutes(prefs.idle_s)} idle)")
    return Decision(True)


@dataclass
class ActivityTracker:
    """Quiet times from samples (see the rules); ``now`` is any monotonic clock's."""

    busy_fraction: float = 0.25
    _input_count: int | None = None
    _input_at: float | None = None  # last input activity (or the first sample: quiet since then at least)
    _cpu_at: float | None = None

    def observe(self, now: float, input_count: int | None, others_cpu: float | None) -> IdleReading:
        if input_count is not None:
            if self._input_count is None or input_count != self._input_count:
                # the first count: no input seen yet, quiet from now on; a moved count: input now
                self._input_at = now
            self._input_count = input_count
        if others_cpu is not None and (self._cpu_at is None or others_cpu > self.busy_fraction):
            self._cpu_at = now  # the first sample (quiet from now on at least), or use now
        return IdleReading(
            input_quiet_s=None if self._input_at is None else max(0.0, now - self._input_at),
            cpu_quiet_s=None if self._cpu_at is None else max(0.0, now - self._cpu_at),
        )


@dataclass(frozen=True)
class CpuPlan:
    threads: int
    duty: float  # the share of wall time it may compute, 0 < duty <= 1


def cpu_plan(limit_pct: float | None, n_cpus: int, threads: int) -> CpuPlan:
    """Threads and duty cycle for ``--cpu-limit`` (see the rules); ``None``: no limit."""
    if limit_pct is None:
        return CpuPlan(threads, 1.0)
    if not 0 < limit_pct <= 100:
        raise ValueError(f"--cpu-limit must be in (0, 100], got {limit_pct}")
    cores = limit_pct / 100.0 * max(1, n_cpus)
    t = max(1, min(threads, math.ceil(cores - 1e-9)))
    return CpuPlan(t, min(1.0, cores / t))


def rest_after(compute_s: float, duty: float) -> float:
    """How long to rest after ``compute_s`` of computing to hold the duty cycle."""
    if duty >= 1.0 or compute_s <= 0:
        return 0.0
    return compute_s * (1.0 / duty - 1.0)
