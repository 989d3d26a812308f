"""Demand per ``(model, layer, expert)`` (pure: no I/O, no clock).

Rules (DESIGN §6, §11):
- ``effective_target = base + boost`` while the model is recruiting (its coordinators are
  saturated, smoothed by ``market.core.recruit``), else ``base``.
- ``replicas`` = live coverage that is dispatched: volunteers whose heartbeat is fresh, holding
  the expert in a slice they report as serving and that the market has not retired. The
  coordinator's own copy is not a replica.
- ``pending`` = coverage on its way: unexpired leases and slices reported as loading. It is not a
  replica (nothing is served yet) but assignment counts it so that two volunteers polling at the
  same moment do not take the same scarce expert.
- ``scarcity = (target - replicas) / target``; 0 when the target is 0; negative means surplus.
- A model with no workers at all is seeded from its metadata: counts exist for every layer and
  expert from registration on, so demand is visible from zero.
- Targets are per expert (``Targets``: per layer, per expert) or one number for all. An expert some
  coordinator hosting the model does not compute itself (``--local-experts``) has no last resort
  there, so its base is ``remote_base`` instead of ``base`` (``expert_targets``); the boost adds to
  either while recruiting.
- Hot experts get more replicas: an expert whose share of a layer's routed rows (coordinator
  reports, decayed) is at least twice the mean gets ``floor(share / mean) - 1`` extra, at most
  ``max_extra`` (``hot_extra``) -- capacity where the traffic is.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal

from market.core.records import CoverageRow
from swarm.protocol.market import Segment

__all__ = ["CountKind", "CoverageCounts", "Segment", "Targets", "contribution", "effective_target", "expert_targets",
           "hot_extra", "layer_targets", "scarcity", "segments"]

CountKind = Literal["replica", "pending"]
Targets = int | Sequence[Sequence[int]]  # one target for every expert, or per layer, per expert


def layer_targets(targets: Targets, layer: int, n_expert: int) -> Sequence[int]:
    return [targets] * n_expert if isinstance(targets, int) else targets[layer]


def hot_extra(heat: Sequence[float], max_extra: int, min_ratio: float = 2.0) -> list[int]:
    """Extra replicas per expert of one layer from its routed-row heat (see the rules)."""
    n = len(heat)
    total = float(sum(heat))
    if n == 0 or max_extra <= 0 or total <= 0:
        return [0] * n
    mean = total / n
    return [min(max_extra, int(h / mean) - 1) if h >= min_ratio * mean else 0 for h in heat]


def expert_targets(n_layer: int, n_expert: int, *, base: int, remote_base: int, boost: int, recruiting: bool,
                   held_by_all: Sequence[Sequence[bool]] | None,
                   extra: Sequence[Sequence[int]] | None = None) -> Targets:
    """Per-expert targets: ``base`` where every coordinator hosting the model computes the expert
    itself, ``remote_base`` elsewhere, plus ``boost`` while recruiting, plus the hot experts'
    ``extra``. One number when uniform."""
    local = effective_target(base, boost, recruiting)
    uniform_held = held_by_all is None or all(all(row) for row in held_by_all)
    no_extra = extra is None or not any(any(row) for row in extra)
    if uniform_held and no_extra:
        return local
    remote = effective_target(remote_base, boost, recruiting)
    return [[(local if held_by_all is None or held_by_all[layer][e] else remote) + (extra[layer][e] if extra else 0)
             for e in range(n_expert)] for layer in range(n_layer)]


def effective_target(base: int, boost: int, recruiting: bool) -> int:
    return max(0, base + (boost if recruiting else 0))


def scarcity(target: int, replicas: int) -> float:
    return 0.0 if target <= 0 else (target - replicas) / target


def contribution(row: CoverageRow) -> CountKind | None:
    """How a coverage row counts towards demand: a replica, pending, or not at all (retiring, draining)."""
    if row.dispatched:
        return "replica"
    if row.pending:
        return "pending"
    return None


class CoverageCounts:
    """Replica and pending counts of every expert of one model, updated incrementally.

    ``replicas[layer][expert]`` and ``pending[layer][expert]`` never go negative: removing more than
    was added is a bug in the caller and raises ``ValueError``. ``version[layer]`` grows on every
    change of the layer, so derived per-layer results can be memoised in ``memo`` (assignment
    does); the memo is not part of the counts' value.
    """

    __slots__ = ("memo", "n_expert", "n_layer", "pending", "replicas", "version")

    def __init__(self, n_layer: int, n_expert: int) -> None:
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.replicas: list[list[int]] = [[0] * n_expert for _ in range(n_layer)]
        self.pending: list[list[int]] = [[0] * n_expert for _ in range(n_layer)]
        self.version: list[int] = [0] * n_layer
        self.memo: dict[Hashable, tuple[int, Any]] = {}

    def add(self, kind: CountKind, layer: int, lo: int, hi: int, delta: int) -> None:
        if not (0 <= layer < self.n_layer and 0 <= lo < hi <= self.n_expert):
            raise ValueError(f"slice {layer}:{lo}-{hi} outside a {self.n_layer}x{self.n_expert} model")
        row = (self.replicas if kind == "replica" else self.pending)[layer]
        for e in range(lo, hi):
            v = row[e] + delta
            if v < 0:
                raise ValueError(f"{kind} count of {layer}:{e} would go negative")
            row[e] = v
        self.version[layer] += 1

    def copy(self) -> CoverageCounts:
        c = CoverageCounts(self.n_layer, self.n_expert)
        c.replicas = [list(r) for r in self.replicas]
        c.pending = [list(r) for r in self.pending]
        return c

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CoverageCounts):
            return NotImplemented
        return self.replicas == other.replicas and self.pending == other.pending

    __hash__ = None  # type: ignore[assignment]  # mutable

    def min_replicas(self) -> int:
        return min((min(r) for r in self.replicas), default=0)


def segments(counts: CoverageCounts, targets: Targets) -> list[Segment]:
    """The model's demand, layer by layer, as maximal runs of equal ``(replicas, pending, target)``."""
    out: list[Segment] = []
    for layer in range(counts.n_layer):
        reps, pend = counts.replicas[layer], counts.pending[layer]
        tl = layer_targets(targets, layer, counts.n_expert)
        lo = 0
        for e in range(1, counts.n_expert + 1):
            if e == counts.n_expert or reps[e] != reps[lo] or pend[e] != pend[lo] or tl[e] != tl[lo]:
                out.append(Segment(layer, lo, e, reps[lo], pend[lo], tl[lo], scarcity(tl[lo], reps[lo])))
                lo = e
    return out
