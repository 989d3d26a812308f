"""``GET /api/coordinators[?model=ID]``: the coordinators of every model, for gateways (shell view over
``market.indexes``; decides nothing: ``hosting`` is the indexes' ``down`` flag).

Rules: one entry per known model (or only ``model``; an unknown one is an empty list, not an error: a
gateway asks before any coordinator registered), coordinators sorted by URL.
"""

from __future__ import annotations

from market.indexes import Indexes
from swarm.protocol.gateway import CoordinatorDirectory, DirectoryEntry, ListedCoordinator

__all__ = ["directory_view"]


def directory_view(ix: Indexes, now: float, model: str | None = None) -> CoordinatorDirectory:
    out: list[DirectoryEntry] = []
    for mid in sorted(ix.models) if model is None else ([model] if model in ix.models else []):
        coords = []
        for url in sorted(ix.registered_hosts_of(mid)):
            p = ix.polls.get(url)
            coords.append(ListedCoordinator(url, hosting=not (p is not None and p.down), ok=p is not None and p.ok,
                                            last_poll_age_s=None if p is None or p.at is None else round(now - p.at, 3)))
        out.append(DirectoryEntry(mid, coords))
    return CoordinatorDirectory(out)
