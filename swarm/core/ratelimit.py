"""A token bucket on bytes per second (pure: given ``now``, no clock, no I/O).

Rules:
- The bucket holds at most ``burst`` tokens (bytes) and fills at ``rate`` tokens a second.
- ``reserve(n, now, max_wait_s)`` takes ``n`` tokens at once and says how long the caller must wait
  before sending them: 0 when the bucket held them; otherwise the time until the deficit is filled
  (the bucket goes into debt, so reservations queue fairly behind each other and the long-run rate
  never exceeds ``rate``, however large ``n`` is compared with ``burst``). When that wait would be
  longer than ``max_wait_s`` nothing is taken and the answer is None: refuse, and say when to retry
  (``wait_for``).
- Time never runs backwards for the bucket: a ``now`` earlier than the last one counts as the last.
"""

from __future__ import annotations

__all__ = ["TokenBucket"]


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs a positive rate and burst, got {rate} and {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def tokens(self, now: float) -> float:
        """Tokens available at ``now`` (negative: the debt of earlier reservations)."""
        self._refill(now)
        return self._tokens

    def wait_for(self, n: int, now: float) -> float:
        """Seconds from ``now`` until ``n`` tokens would be there (0: now)."""
        self._refill(now)
        return max(0.0, (n - self._tokens) / self.rate)

    def reserve(self, n: int, now: float, max_wait_s: float = float("inf")) -> float | None:
        """Take ``n`` tokens; the seconds to wait before using them, or None (nothing taken) when that
        would be more than ``max_wait_s``."""
        wait = self.wait_for(n, now)
        if wait > max_wait_s:
            return None
        self._tokens -= n
        return wait
