"""Which listed workers proved they hold their slices (pure: no I/O, no clock; ``now`` is given).

DESIGN §12 "the volunteer proved it holds it": a worker the market lists for a slice gets no work
for that slice until it answered a ``HoldChallenge`` for it with the right digest (random windows
of the slice's tensor data under a random nonce, checked against the coordinator's own GGUF). The
shell (``coordinator.dispatch.dispatcher``) asks ``due`` what to challenge, sends the challenges and reports
each outcome here; the dispatcher's range work lists only ``held`` replicas.

Rules:
- A holding is ``(peer, layer, lo, hi)``, exactly as listed. ``sync`` with the listed holdings
  forgets the ones no longer listed (a re-listed holding is challenged afresh).
- ``due(now, limit)``: listed holdings not proven, not being challenged, not refuted and past their
  retry time, in a stable order (oldest listing first), at most ``limit``; they become in flight.
- ``passed``: proven (sticky while listed). ``failed`` (an error, a timeout, a refusal such as
  ``slice_not_held`` while it is still loading): retried after ``retry_base_s * 2**(k-1)``, capped
  at ``retry_max_s``. ``refuted`` (a wrong digest): never challenged again (the worker is quarantined).
- Counters for ``/dispatch``: ``challenges``, ``passes``, ``failures``, ``refutations``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["HoldBook", "Holding"]


class Holding(NamedTuple):
    peer: str
    layer: int
    lo: int
    hi: int


@dataclass
class _Entry:
    listed_at: float
    proven: bool = False
    in_flight: bool = False
    refuted: bool = False
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""


class HoldBook:
    def __init__(self, *, retry_base_s: float = 1.0, retry_max_s: float = 60.0) -> None:
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._entries: dict[Holding, _Entry] = {}
        self.challenges = 0
        self.passes = 0
        self.failures = 0
        self.refutations = 0

    def sync(self, listed: set[Holding], now: float) -> None:
        for h in self._entries.keys() - listed:
            del self._entries[h]
        for h in sorted(listed - self._entries.keys()):
            self._entries[h] = _Entry(listed_at=now)

    def due(self, now: float, limit: int) -> list[Holding]:
        out: list[Holding] = []
        for h, e in self._entries.items():  # insertion order: oldest listing first
            if len(out) >= limit:
                break
            if e.proven or e.in_flight or e.refuted or now < e.retry_at:
                continue
            e.in_flight = True
            self.challenges += 1
            out.append(h)
        return out

    def passed(self, h: Holding) -> None:
        e = self._entries.get(h)
        self.passes += 1
        if e is not None:
            e.in_flight, e.proven, e.failures, e.last_error = False, True, 0, ""

    def failed(self, h: Holding, now: float, error: str) -> None:
        e = self._entries.get(h)
        self.failures += 1
        if e is not None:
            e.in_flight = False
            e.failures += 1
            e.last_error = error
            e.retry_at = now + min(self.retry_max_s, self.retry_base_s * 2 ** (e.failures - 1))

    def refuted(self, h: Holding, error: str) -> None:
        e = self._entries.get(h)
        self.refutations += 1
        if e is not None:
            e.in_flight, e.proven, e.refuted, e.last_error = False, False, True, error

    def held(self, peer: str, layer: int, lo: int, hi: int) -> bool:
        e = self._entries.get(Holding(peer, layer, lo, hi))
        return e is not None and e.proven

    def proven(self, peer: str) -> list[Holding]:
        return [h for h, e in self._entries.items() if h.peer == peer and e.proven]

    def pending(self, peer: str) -> int:
        """Listed holdings of ``peer`` not proven yet (for ``/dispatch``)."""
        return sum(1 for h, e in self._entries.items() if h.peer == peer and not e.proven)

    def next_retry(self) -> float | None:
        """The earliest retry time of a holding waiting for one (None if none waits)."""
        times = [e.retry_at for e in self._entries.values()
                 if not (e.proven or e.in_flight or e.refuted) and e.failures]
        return min(times) if times else None
