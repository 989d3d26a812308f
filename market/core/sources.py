"""Where a volunteer downloads its slice from (pure: no I/O, no clock; randomness is injected).

Rules:
- Every coordinator hosting the model is a source; the volunteer gets them all, best first, and
  tries them in that order.
- A coordinator whose last poll succeeded comes before one whose last poll failed or that was
  never polled.
- Then the less busy one: ``busy / max(1, slots)`` of its last successful poll, however old; a
  coordinator that never answered a poll counts as fully busy (1.0).
- Then a uniform draw from the injected RNG, so volunteers spread over equal coordinators;
  exactly one draw per source, in the order given (the caller's seeded runs stay reproducible).
  Then the URL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from market.core.recruit import PollView
from swarm.core.rng import Rng

__all__ = ["Source", "rank_sources"]


@dataclass(frozen=True)
class Source:
    """One coordinator hosting the model, as its polls left it."""

    url: str
    ok: bool  # its last poll succeeded
    last_ok: PollView | None = None  # its last successful poll


def rank_sources(sources: Sequence[Source], rng: Rng) -> list[str]:
    """The URLs of ``sources``, best first (see the rules)."""
    ranked: list[tuple[int, float, float, str]] = []
    for s in sources:
        busy = s.last_ok.busy / max(1, s.last_ok.slots) if s.last_ok is not None else 1.0
        ranked.append((0 if s.ok else 1, busy, rng.uniform(0.0, 1.0), s.url))
    return [url for *_, url in sorted(ranked)]
