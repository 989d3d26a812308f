"""How long an idle volunteer waits before asking again (pure: no clock, no I/O; ``now`` is given).

Rules:
- Every "nothing needed" answer (nothing scarce, or nothing that fits the volunteer's budget) is noted with
  the volunteer's id and the time; the idle pollers are the ids noted within the last ``window_s``.
- The retry the answer carries is ``max(base_s, idle / rate)``, at most ``max_s``: with ``idle`` volunteers
  each asking every ``retry`` seconds, the market hears about ``rate`` such polls a second however many
  volunteers wait (at 10^5 volunteers a fixed 5 s retry was ~14,000 requests a second of "nothing needed":
  ``benchmarks/scenarios/volunteers-100k.toml``). ``rate`` 0 turns the pacing off (always ``base_s``).
- ``window_s`` is ``max_s`` plus slack, so a volunteer told to wait ``max_s`` still counts while it waits;
  ids older than the window are forgotten (``prune``), so the count follows the swarm as it shrinks.
- A recruitment boost needs idle volunteers back soon: ``max_s`` bounds the wait, and at the paced rate the
  first of ``idle`` volunteers polls within ``1 / rate`` seconds on average.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["IdlePacing"]


class IdlePacing:
    def __init__(self, *, rate: float, max_s: float) -> None:
        self.rate, self.max_s = rate, max_s
        self.window_s = max_s * 1.5 + 10.0
        self._seen: OrderedDict[str, float] = OrderedDict()  # peer id -> its last "nothing needed", oldest first

    @property
    def idle(self) -> int:
        return len(self._seen)

    def retry_after(self, peer_id: str, base_s: float, now: float) -> float:
        """Note ``peer_id``'s "nothing needed" at ``now`` and the seconds it should wait."""
        self._seen[peer_id] = now
        self._seen.move_to_end(peer_id)
        self.prune(now)
        if self.rate <= 0:
            return base_s
        return max(base_s, min(self.max_s, len(self._seen) / self.rate))

    def prune(self, now: float) -> None:
        while self._seen:
            peer, at = next(iter(self._seen.items()))
            if now - at <= self.window_s:
                break
            del self._seen[peer]
