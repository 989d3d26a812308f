"""What a volunteer is doing, for people (pure: no I/O, no clock; ``now`` is given).

Rules:
- Call rate (``CallWindow``): coordinators report each volunteer's answered calls per report period
  (``POST /api/coordinator-report``, every 5 s by default); a report's calls are spread evenly over
  its period (from that coordinator's previous report, or ``FIRST_PERIOD_S`` before it for its
  first). The rate at ``now`` is the calls whose periods fall in the last ``window_s`` over the time
  covered, so it comes from coordinators' words only (never the volunteer's own count), follows the
  load within a window and falls to 0 one window after the last reported call. At most
  ``MAX_SAMPLES`` periods are kept per volunteer.
- Activity (``activity``): one short line per volunteer from its holdings' states (as
  ``market.views.state_name`` names them), download progress and call rate:
  * ``serving N calls/s`` -- a dispatched slice and calls in the window (N at least ``MIN_RATE``);
  * ``idle`` -- dispatched, no call in the window (``idle, not proven yet`` before any coordinator saw
    proof of a holding: a hold challenge or verified answers);
  * ``downloading P %`` (``downloading`` without a progress report) -- a slice reported loading;
    with other slices the slice is named: ``downloading 1:0-8 40 %``;
  * ``draining`` (the volunteer is leaving), ``retiring`` (surplus: out of the map, released after
    the cooldown), ``released`` -- when nothing else applies;
  * parts are joined with ``; `` (dispatched work first); no holding at all: ``idle``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = ["FIRST_PERIOD_S", "MAX_SAMPLES", "MIN_RATE", "CallWindow", "SliceActivity", "activity", "format_rate"]

FIRST_PERIOD_S: Final = 5.0  # a coordinator's first report is taken to cover its default report period
MAX_SAMPLES: Final = 64
MIN_RATE: Final = 0.05  # calls/s below this show as idle (one call in 20 s)


@dataclass
class CallWindow:
    """The report periods of one volunteer's calls: ``(start, end, calls)``, oldest first."""

    window_s: float = 15.0
    periods: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def add(self, start: float, end: float, calls: int) -> None:
        if calls > 0:
            self.periods.append((min(start, end), end, calls))

    def rate(self, now: float) -> float:
        """Calls per second over the last ``window_s`` (see the rules)."""
        lo = now - self.window_s
        total = 0.0
        earliest = now
        for start, end, calls in self.periods:
            if end <= lo or start > now:
                continue
            span = end - start
            if span <= 0:  # an instant: counts whole
                total += calls
            else:
                total += calls * (min(end, now) - max(start, lo)) / span
            earliest = min(earliest, max(start, lo))
        covered = now - earliest
        return total / covered if covered > 0 else 0.0

    def prune(self, now: float) -> None:
        while self.periods and self.periods[0][1] <= now - self.window_s:
            self.periods.popleft()


@dataclass(frozen=True)
class SliceActivity:
    slice: str  # "LAYER:LO-HI"
    state: str  # dispatched | loading | draining | retiring | released (market.views.state_name)
    progress: float | None = None  # of a loading slice, 0..1, as its volunteer last reported
    proved: bool = False  # a coordinator saw proof it holds the slice


def format_rate(calls_per_s: float) -> str:
    return f"{calls_per_s:.0f}" if calls_per_s >= 10 else f"{calls_per_s:.1f}"


def activity(slices: Sequence[SliceActivity], calls_per_s: float) -> str:
    """What the volunteer does, in a few words (see the rules)."""
    parts: list[str] = []
    dispatched = [s for s in slices if s.state == "dispatched"]
    if dispatched:
        if calls_per_s >= MIN_RATE:
            parts.append(f"serving {format_rate(calls_per_s)} calls/s")
        else:
            parts.append("idle" if any(s.proved for s in dispatched) else "idle, not proven yet")
    loading = [s for s in slices if s.state == "loading"]
    for s in loading:
        name = f" {s.slice}" if len(slices) > 1 else ""
        pct = f" {min(100.0, max(0.0, s.progress * 100)):.0f} %" if s.progress is not None else ""
        parts.append(f"downloading{name}{pct}")
    if not parts:
        for state in ("draining", "retiring", "released"):
            if any(s.state == state for s in slices):
                parts.append(state)
                break
    return "; ".join(parts) or "idle"
