"""The dispatch map's layers from what volunteers serve (pure: no I/O, no clock).

Rules (DESIGN §11 dispatch map):
- Only dispatched holdings are listed: reported serving, not retired, volunteer alive, and the
  volunteer speaks the coordinators' expert-stream version (``protocol``; its heartbeat lists the
  versions it speaks): a volunteer is never mapped to a coordinator it cannot serve.
- Ranges never overlap. Where volunteers hold overlapping slices, the layer is cut at every
  slice boundary (the finest common ranges), so each listed range lies inside one held slice of
  every replica listed for it: a volunteer serves a request only from a slice containing it.
  Adjacent ranges are never merged, even with the same replicas (a volunteer holding ``0-4``
  and ``4-8`` cannot answer a ``0-8`` request). Ranges without replicas are left out (the
  coordinator computes them locally).
- Replicas are in preference order (``preference``): served (verified answers) first, then
  proved holders (hold challenge), then lower
  reported load (coarse buckets, so small load jitter does not reorder the map and bump its
  version), then older holdings, then peer id. A peer is listed at most once per range.
- The output is canonical: sorted by layer and ``lo``; equal inputs give equal maps, so the
  caller can bump ``version`` exactly when the content changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from swarm.dispatch_map import LayerRanges, RangeReplicas, Replica

__all__ = ["ServingSlice", "build_layers", "load_bucket", "preference"]


def load_bucket(load: float) -> int:
    """0 for less than one call in flight, then 1 + floor(log2(load))."""
    if not load >= 1.0:  # also NaN
        return 0
    return 1 + int(math.log2(min(load, 1e12)))


def preference(served: bool, load: float, since: float, peer_id: str, held: bool = True) -> tuple[bool, bool, int, float, str]:
    return (not served, not held, load_bucket(load), since, peer_id)


@dataclass(frozen=True)
class ServingSlice:
    peer_id: str
    layer: int
    lo: int
    hi: int
    addrs: tuple[str, ...]
    rank: tuple[bool, bool, int, float, str]
    protocols: tuple[int, ...]  # expert-stream versions the volunteer speaks (its heartbeat's list)
    net: str = ""  # the tag of the network it speaks from (``registry.network_tag``; "" unknown)


def build_layers(slices: Iterable[ServingSlice], *, protocol: int) -> list[LayerRanges]:
    """The map's layers for coordinators speaking expert-stream version ``protocol``."""
    by_layer: dict[int, list[ServingSlice]] = {}
    for s in slices:
        if s.lo < s.hi and protocol in s.protocols:
            by_layer.setdefault(s.layer, []).append(s)
    out: list[LayerRanges] = []
    for layer in sorted(by_layer):
        held = sorted(by_layer[layer], key=lambda s: (s.lo, s.rank))
        bounds = sorted({b for s in held for b in (s.lo, s.hi)})
        ranges: list[RangeReplicas] = []
        active: list[ServingSlice] = []
        i = 0
        for a, b in zip(bounds, bounds[1:], strict=False):
            while i < len(held) and held[i].lo <= a:
                active.append(held[i])
                i += 1
            active = [s for s in active if s.hi > a]
            if not active:
                continue
            seen: set[str] = set()
            reps: list[Replica] = []
            for s in sorted(active, key=lambda s: s.rank):
                if s.peer_id not in seen:
                    seen.add(s.peer_id)
                    reps.append(Replica(s.peer_id, list(s.addrs), s.net))
            ranges.append(RangeReplicas(a, b, reps))
        if ranges:
            out.append(LayerRanges(layer, ranges))
    return out
