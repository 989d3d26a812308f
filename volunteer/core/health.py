"""Is the volunteer's request byte budget stuck? (pure core: samples in, a verdict out; ``now`` given).

The expert server holds request payloads in a ``ByteBudget`` (``swarm.rpc.server``); a request past
it is refused ``busy`` and the coordinator computes the range itself. Refusals under real load are
normal: requests finish and give their bytes back. A budget that keeps refusing while nothing comes
back is stuck -- whatever holds it, the volunteer is not serving -- and a volunteer must not go on
heartbeating ``serving`` as if it were healthy.

Rules:
- Progress is a byte given back (``given`` grew) or nothing held (``held == 0``).
- The budget is *stuck* when at least one request was refused since the last progress and the last
  progress is ``window_s`` or more ago. It is unstuck at the next progress.
- The counters only grow (``ByteBudget.refused``, ``ByteBudget.given``); a sample that shows them
  smaller (a new budget) starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BudgetWatch"]


@dataclass
class BudgetWatch:
    window_s: float = 30.0
    _progress_at: float | None = None
    _refused_at_progress: int = 0
    _given: int = 0
    _refused: int = 0  # at the last sample

    def observe(self, now: float, *, held: int, refused: int, given: int) -> bool:
        """The verdict after one sample of the budget: True while stuck."""
        fresh = refused < self._refused or given < self._given  # a new budget
        self._refused = refused
        if self._progress_at is None or fresh or held == 0 or given > self._given:
            self._progress_at, self._refused_at_progress, self._given = now, refused, given
            return False
        return refused > self._refused_at_progress and now - self._progress_at >= self.window_s
