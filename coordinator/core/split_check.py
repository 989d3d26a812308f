"""Does sending shares of a layer to volunteers pay *here*? A measured check (pure: ``now`` is given).

Earliest finish (``coordinator.core.dispatch``) compares estimates: the local backlog at the
measured seconds per pair against a worker's latency EWMA. What it cannot see is what a remote
share costs the rest of the step: the protocol work on the coordinator's threads, the combine,
and -- when the volunteer shares the machine's cores, or its memory bandwidth -- a slower local
share and a slower dense part. On one 2-core box (``benchmarks/offload.py``, 8 sessions) earliest
finish with fresh estimates sent about a fifth of the ranges remote and served 0.77x of
local-only. So under load the core does not trust the estimate alone; it measures:

- **Windows.** At a load onset (and again once a decision's hold has passed) the check runs three
  windows of ``window_s`` each: *local* (every held range here), *split* (earliest finish as
  usual), *local* again. A window's rate is the routed pairs of the layers that started in it per
  second (the load is the same in all three: the engine is saturated; the two local windows on
  either side cancel a load that ramps up or down linearly).
- **Decision.** Split is kept when its rate beats the mean of the two local rates by more than
  ``margin`` (``SPLIT_FASTER``), else local (``SPLIT_SLOWER``); either holds for ``hold_s``, then
  the next loaded layer starts a new check (a volunteer that got faster, a load that changed).
- **Watch.** A held split keeps being measured, window by window: the first must beat the local
  rate by the margin again (a confirmation: two windows of the same work differed by up to ~20 %
  on the 2-core box, so one win may be noise), every later one must at least equal it; one that
  falls short ends the split at once (``SPLIT_SLOWER``, ``watched``; local for ``hold_s``). A
  check's split window is short, and what a split costs can grow after it (earliest finish sends
  more as the local kernel, slowed by the volunteer beside it, looks slower): measured on the
  2-core box, a split that won its window by 16 % served 0.88x of local-only over the next 30 s.
- **Suspension.** When the load leaves (serve TTL) the check is suspended: the window under way is
  dropped (its rate would mix loaded and unloaded time), the finished ones are kept, and the arm
  in force is the last decision (split before any: the dispatch as it was before this check
  existed). The next loaded layer re-runs the dropped window -- unless the suspension lasted longer
  than ``hold_s``, then the check starts over. A held split's watch window is dropped the same way.
  (A load that dips below saturation every few seconds, as ``make demo``'s does, would otherwise
  never let a check end.)
- ``window_s <= 0`` turns the check off: always split (earliest finish decides alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["SplitArm", "SplitCheck", "SplitOutcome"]


class SplitArm(StrEnum):
    SPLIT = "split"  # earliest finish: ranges may go to proven workers
    LOCAL = "local"  # every held range here (trials and probes still go out)


@dataclass(frozen=True)
class SplitOutcome:
    """One finished check: the arm kept until ``until`` (split: the split was faster), and the rates
    (routed pairs per second)."""

    at: float
    arm: SplitArm
    split_rate: float
    local_rate: float  # the mean of the two local windows
    until: float
    local_rates: tuple[float, ...] = ()  # each local window's (their spread: the noise the margin must beat)
    watched: bool = False  # a held split's window fell below the local rate it had beaten (not a check)


_PLAN = (SplitArm.LOCAL, SplitArm.SPLIT, SplitArm.LOCAL)


class SplitCheck:
    def __init__(self, *, window_s: float = 3.0, hold_s: float = 30.0, margin: float = 0.10) -> None:
        self.window_s = window_s
        self.hold_s = hold_s
        self.margin = margin
        self.kept = SplitArm.SPLIT  # the last decision (split before any)
        self.hold_until: float | None = None  # the last decision holds until then
        self._plan: list[SplitArm] = []  # windows still to run in the check under way (first: running)
        self._since = 0.0
        self._pairs = 0
        self._rates: list[tuple[SplitArm, float]] = []
        self._suspended_at: float | None = None
        self._confirmed = False  # a held split's first watch window beat the local rate by the margin too
        self.outcomes: list[SplitOutcome] = []

    @property
    def checking(self) -> bool:
        """Is a check running (not suspended)?"""
        return bool(self._plan) and self._suspended_at is None

    def arm(self) -> SplitArm:
        """The arm in force: the running window's while checking, else the last decision."""
        return self._plan[0] if self.checking else self.kept

    def observe(self, pairs: int, now: float) -> SplitOutcome | None:
        """A layer of ``pairs`` routed pairs starts under load at ``now`` (call before placing it:
        it is placed by ``arm()`` afterwards, and counts in that arm's window); returns the outcome
        of a check this ends."""
        if self.window_s <= 0:
            return None
        out = None
        if self._suspended_at is not None:  # loaded again: the dropped window starts afresh
            if self._plan and now - self._suspended_at > self.hold_s:
                self._plan = []  # too long ago: the finished windows say little now
            self._suspended_at = None
            self._since, self._pairs = now, 0
        if not self._plan:
            if self.hold_until is not None and now < self.hold_until:
                return self._watch(pairs, now) if self.kept is SplitArm.SPLIT else None
            self._plan = list(_PLAN)
            self._since, self._pairs, self._rates = now, 0, []
        elif now - self._since >= self.window_s:
            self._rates.append((self._plan.pop(0), self._pairs / (now - self._since)))
            self._since, self._pairs = now, 0
            if not self._plan:
                out = self._decide(now)
        self._pairs += pairs  # the next window's (the watch's, after a decision) first layer
        return out

    def _watch(self, pairs: int, now: float) -> SplitOutcome | None:
        """While a split is held: each window's rate against the local rate it beat -- the first by
        the margin again (a confirmation), the others at least equal; one that falls short ends the
        hold (local, held in its turn)."""
        if now - self._since < self.window_s:
            self._pairs += pairs
            return None
        rate = self._pairs / (now - self._since)
        self._since, self._pairs = now, pairs
        ref = self.outcomes[-1].local_rate if self.outcomes else 0.0
        bar = ref if self._confirmed else ref * (1.0 + self.margin)
        if rate >= bar:
            self._confirmed = True
            return None
        self.kept = SplitArm.LOCAL
        self.hold_until = now + self.hold_s
        out = SplitOutcome(now, SplitArm.LOCAL, rate, ref, self.hold_until, (), watched=True)
        self.outcomes = [*self.outcomes[-15:], out]
        return out

    def _decide(self, now: float) -> SplitOutcome:
        split = next(r for a, r in self._rates if a is SplitArm.SPLIT)
        local_rates = [r for a, r in self._rates if a is SplitArm.LOCAL]
        local = sum(local_rates) / len(local_rates)
        faster = split > local * (1.0 + self.margin)
        self.kept = SplitArm.SPLIT if faster else SplitArm.LOCAL
        self._confirmed = False
        self.hold_until = now + self.hold_s
        out = SplitOutcome(now, self.kept, split, local, self.hold_until, tuple(local_rates))
        self.outcomes = [*self.outcomes[-15:], out]
        return out

    def suspend(self, now: float) -> None:
        """The load left: the window under way is dropped (see the rules); the last decision is in force."""
        self._suspended_at = now
