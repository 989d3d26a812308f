"""Which slice an idle volunteer should serve (pure: no I/O, no clock; randomness is injected).

Rules:
- Per expert, ``need = max(0, target - replicas - pending)`` (``market.core.demand``); its
  assignment scarcity is ``need / target``. Only experts with ``need > 0`` are handed out.
- A candidate segment is a contiguous expert range of one layer. Each layer is cut into aligned
  chunks of ``n`` experts, ``n`` = how many experts of that layer fit the volunteer's budget
  (``max_experts`` and/or ``max_bytes`` minus a header allowance); a chunk is split into its
  runs of needed experts (an expert the volunteer already holds has no need for it, so it is
  never asked to hold an expert twice, and a window never spans an expert that is covered or
  leased). Aligned chunks keep the number of distinct slice files small (the coordinator cuts
  and caches each one) and tile a layer when budgets agree.
- The chosen segment maximises ``(max scarcity, total scarcity)`` over every eligible model
  and layer: the scarcest expert first, then the most needed experts per download. Ties are
  broken by the injected RNG, so volunteers with equal budgets spread over equal needs.
- The caller turns the pick into a short lease that counts as pending; a second volunteer
  polling at the same moment therefore sees that segment as less scarce and gets another.
- When nothing is handed out the result says why (``NoOfferReason``).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

import msgspec

from market.core.demand import CoverageCounts, Targets, layer_targets
from market.core.records import SliceRef
from swarm.core.rng import Rng

__all__ = [
    "Budget",
    "ModelSupply",
    "NoOfferReason",
    "Pick",
    "choose_slice",
    "experts_that_fit",
    "jittered",
    "new_lease_id",
]

_UNBOUNDED = 1 << 62


class NoOfferReason(enum.StrEnum):
    NO_MODELS = "no_models"  # no hosted model (matching the volunteer's filter)
    NOTHING_SCARCE = "nothing_scarce"  # every expert has its replicas (or they are on their way)
    BUDGET_TOO_SMALL = "budget_too_small"  # experts are needed but not even one fits the budget
    COORDINATOR_UNREACHABLE = "coordinator_unreachable"  # set by the shell: no coordinator could describe the file
    QUARANTINED = "quarantined"  # a coordinator caught this volunteer answering wrongly: refused for a while
    ADDRESS_CAP = "address_cap"  # this IP address holds max_leases_per_address open leases already
    PAUSED = "paused"  # its last heartbeat said its owner paused it: no new slice until it resumes


class Budget(msgspec.Struct, frozen=True):
    max_bytes: int | None = None
    max_experts: int | None = None


def experts_that_fit(budget: Budget, bytes_per_expert: int, header_allowance: int) -> int:
    """How many experts of ``bytes_per_expert`` bytes a volunteer with ``budget`` can hold (>= 0)."""
    n = _UNBOUNDED
    if budget.max_experts is not None:
        n = min(n, budget.max_experts)
    if budget.max_bytes is not None:
        n = min(n, (budget.max_bytes - header_allowance) // max(1, bytes_per_expert))
    return max(0, n)


@dataclass(frozen=True)
class ModelSupply:
    """What assignment needs to know about one hosted model."""

    model_id: str
    bytes_per_expert: Sequence[int]  # per layer
    counts: CoverageCounts
    target: Targets  # one for every expert, or per layer, per expert


class Pick(msgspec.Struct, frozen=True):
    slice: SliceRef
    scarcity: float  # the highest need / target in the segment
    est_bytes: int  # experts' bytes plus the header allowance


_Key = tuple[float, float]
_MEMO_LIMIT = 8192


def _best_windows(need: list[int], n: int, target: Sequence[int]) -> tuple[_Key | None, list[tuple[int, int]]]:
    """The best-scoring windows of one layer: runs of needed experts inside aligned n-chunks."""
    best_key: _Key | None = None
    best: list[tuple[int, int]] = []
    n_expert = len(need)
    for chunk_lo in range(0, n_expert, n):
        chunk_hi = min(chunk_lo + n, n_expert)
        run_lo: int | None = None
        for e in range(chunk_lo, chunk_hi + 1):
            if e < chunk_hi and need[e] > 0:
                if run_lo is None:
                    run_lo = e
            elif run_lo is not None:
                window = [need[x] / target[x] for x in range(run_lo, e)]
                key = (max(window), sum(window))
                if best_key is None or key > best_key:
                    best_key, best = key, [(run_lo, e)]
                elif key == best_key:
                    best.append((run_lo, e))
                run_lo = None
    return best_key, best


def _model_windows(m: ModelSupply, budget: Budget, held: Collection[SliceRef], header_allowance: int
                   ) -> tuple[_Key | None, Sequence[tuple[str, int, int, int, int]], bool]:
    """One model's best windows (in layer order), their key, and whether any expert is needed.

    Per-layer results of layers where the volunteer holds nothing are memoised in the counts (keyed by
    layer, target and chunk size, checked against the layer's version); with a uniform target and a
    volunteer holding nothing of the model, so is the whole model's result (checked against the sum of
    the layers' versions, which grows with every change): a market polled by idle volunteers while
    nothing is scarce answers each poll without walking the layers."""
    counts = m.counts
    uniform = isinstance(m.target, int)
    held_here: dict[int, set[int]] = {}
    for s in held:
        if s.model_id == m.model_id:
            held_here.setdefault(s.layer, set()).update(range(s.lo, s.hi))
    if len(counts.memo) > _MEMO_LIMIT:
        counts.memo.clear()
    fits: dict[int, int] = {}
    for bpe in m.bytes_per_expert:
        if bpe not in fits:
            fits[bpe] = max(0, min(experts_that_fit(budget, bpe, header_allowance), counts.n_expert))
    whole: Hashable | None = None
    version = 0
    if uniform and not held_here:
        whole = ("model", m.target, tuple(sorted(fits.items())))
        version = sum(counts.version)
        hit = counts.memo.get(whole)
        if hit is not None and hit[0] == version:
            return hit[1]  # type: ignore[no-any-return]
    m_key: _Key | None = None
    m_best: list[tuple[str, int, int, int, int]] = []
    m_need = False
    for layer in range(counts.n_layer):
        bpe = m.bytes_per_expert[layer]
        n = fits[bpe]
        mine = held_here.get(layer)
        tl = layer_targets(m.target, layer, counts.n_expert)
        memo_key = (layer, m.target if uniform else tuple(tl), n)
        hit = None if mine else counts.memo.get(memo_key)
        if hit is not None and hit[0] == counts.version[layer]:
            layer_key, windows, layer_need = hit[1]
        else:
            need = [t - r - p if r + p < t else 0 for r, p, t in zip(
                counts.replicas[layer], counts.pending[layer], tl, strict=True)]
            if mine:
                for e in mine:
                    need[e] = 0
            layer_need = any(need)
            layer_key, windows = _best_windows(need, n, tl) if layer_need and n >= 1 else (None, [])
            if not mine:
                counts.memo[memo_key] = (counts.version[layer], (layer_key, windows, layer_need))
        m_need = m_need or layer_need
        if layer_key is None:
            continue
        if m_key is None or layer_key > m_key:
            m_key, m_best = layer_key, [(m.model_id, layer, lo, hi, bpe) for lo, hi in windows]
        elif layer_key == m_key:
            m_best.extend((m.model_id, layer, lo, hi, bpe) for lo, hi in windows)
    out = (m_key, tuple(m_best), m_need)
    if whole is not None:
        counts.memo[whole] = (version, out)
    return out


def choose_slice(
    models: Sequence[ModelSupply],
    budget: Budget,
    held: Collection[SliceRef],
    rng: Rng,
    *,
    header_allowance: int = 0,
) -> Pick | NoOfferReason:
    """The scarcest segment that fits ``budget`` and overlaps nothing in ``held`` (see the rules).

    Results are memoised in the counts (``_model_windows``), so a pull costs a scan of the layers
    that changed since the last one, and nothing when none did.
    """
    if not models:
        return NoOfferReason.NO_MODELS
    best_key: _Key | None = None
    best: list[tuple[str, int, int, int, int]] = []  # (model_id, layer, lo, hi, bytes_per_expert)
    any_need = False
    for m in models:
        if isinstance(m.target, int) and m.target <= 0:
            continue
        m_key, m_best, m_need = _model_windows(m, budget, held, header_allowance)
        any_need = any_need or m_need
        if m_key is None:
            continue
        if best_key is None or m_key > best_key:
            best_key, best = m_key, list(m_best)
        elif m_key == best_key:
            best.extend(m_best)
    if best_key is None:
        return NoOfferReason.BUDGET_TOO_SMALL if any_need else NoOfferReason.NOTHING_SCARCE
    model_id, layer, lo, hi, bpe = best[rng.randrange(len(best))] if len(best) > 1 else best[0]
    return Pick(SliceRef(model_id, layer, lo, hi), best_key[0], (hi - lo) * bpe + header_allowance)


def jittered(rng: Rng, base_s: float, spread: float = 0.2) -> float:
    """``base_s`` scaled by a uniform factor in ``[1 - spread, 1 + spread]``, so pollers do not march in step."""
    return max(0.0, base_s * rng.uniform(1.0 - spread, 1.0 + spread))


def new_lease_id(rng: Rng) -> str:
    return f"{rng.getrandbits(64):016x}"
