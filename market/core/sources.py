"""Where a volunteer downloads its slice from (pure: no I/O, no clock; randomness is injected).

An assignment lists its sources best first: volunteers holding the slice (``rank_peer_sources``),
then the model's origin mirrors (``rank_origins``), then the coordinators (``rank_sources``). The
volunteer tries them in that order and checks every byte against the manifest, so a ranking
mistake costs time, never integrity.

Rules for coordinators (``rank_sources``):
- Every coordinator hosting the model is a source; the volunteer gets them all, best first, and
  tries them in that order.
- A coordinator whose last poll succeeded comes before one whose last poll failed or that was
  never polled.
- Then the less busy one: ``busy / max(1, slots)`` of its last successful poll, however old; a
  coordinator that never answered a poll counts as fully busy (1.0).
- Then a uniform draw from the injected RNG, so volunteers spread over equal coordinators;
  exactly one draw per source, in the order given (the caller's seeded runs stay reproducible).
  Then the URL.

Rules for peers (``rank_peer_sources``):
- A candidate is a volunteer's holding; it qualifies when it is of the same model and layer, its
  range contains the wanted ``[lo, hi)``, it is serving and dispatched (not loading, draining or
  retiring: those may be gone before the download ends), its volunteer shares its slices (its
  heartbeat said ``share_slices``), is not the requester, is not quarantined and has a direct
  address: ``/p2p-circuit`` ones are left out (a relay is sized for expert traffic, not for
  gigabytes of slices, and circuit-relay v2 may cut a long transfer), so a volunteer reachable only
  through a relay is no source.
- One entry per volunteer (its first qualifying holding); proved holders (served or held: a
  coordinator checked them) first, then a uniform draw each (one per qualifying volunteer, in the
  order given), then the peer id; at most ``limit`` (default 4).

Rules for origins (``rank_origins``): the URLs in the order given (the hosting coordinators' lists
in their ranking order, then the manifest's), each once, at most ``limit`` (default 8).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final

from market.core.recruit import PollView
from swarm.core.rng import Rng

__all__ = ["MAX_ORIGIN_SOURCES", "MAX_PEER_SOURCES", "PeerCandidate", "Source", "rank_origins", "rank_peer_sources",
           "rank_sources"]

MAX_PEER_SOURCES: Final = 4
MAX_ORIGIN_SOURCES: Final = 8


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


@dataclass(frozen=True)
class PeerCandidate:
    """One volunteer's holding, as the market knows it."""

    peer_id: str
    model_id: str
    layer: int
    lo: int
    hi: int
    addrs: tuple[str, ...]
    dispatched: bool  # serving and not retiring
    shares: bool  # its last heartbeat said share_slices
    quarantined: bool
    proved: bool  # served (verified answers) or held (a hold challenge passed)


def rank_peer_sources(candidates: Iterable[PeerCandidate], *, model_id: str, layer: int, lo: int, hi: int,
                      requester: str, rng: Rng, limit: int = MAX_PEER_SOURCES) -> list[PeerCandidate]:
    """The volunteers to download ``(model_id, layer, lo, hi)`` from, best first, each with its direct
    addresses only (see the rules)."""
    chosen: dict[str, PeerCandidate] = {}
    for c in candidates:
        direct = tuple(a for a in c.addrs if "/p2p-circuit" not in a)
        if (c.model_id == model_id and c.layer == layer and c.lo <= lo and hi <= c.hi and c.dispatched and c.shares
                and not c.quarantined and c.peer_id != requester and direct and c.peer_id not in chosen):
            chosen[c.peer_id] = replace(c, addrs=direct)
    ranked = sorted((not c.proved, rng.uniform(0.0, 1.0), c.peer_id) for c in chosen.values())
    return [chosen[pid] for *_, pid in ranked[: max(0, limit)]]


def rank_origins(urls: Iterable[str], limit: int = MAX_ORIGIN_SOURCES) -> list[str]:
    """``urls`` in order, each once, at most ``limit``."""
    return list(dict.fromkeys(urls))[: max(0, limit)]
