"""Expert math in torch: the reference of the ``ExpertKernel`` seam (``swarm.model.kernels``).

Rules:
- ``slice_partial_sum`` computes a slice's weighted partial sum for the rows routed to it, from
  dequantised float32 weights. It is the ``torch`` backend (``--kernel torch``) and the definition
  the ggml kernels follow (same summation order); the coordinator's local path, its fallback and
  every volunteer call their kernel through the seam, so equal kernel ids give equal bits.
- Fixed summation order: within a slice, experts are added in ascending local index; across slices
  the caller (``combine_partials``) adds partial sums in ascending ``lo`` order.
- An expert FFN is SwiGLU: ``down @ (silu(gate @ x) * (up @ x))``, scaled by the router weight
  after ``down`` (as llama.cpp does); gpt-oss's (activation ``swiglu_oai``): biases after each
  projection and ``min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)``, ggml's
  swiglu_oai.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from swarm.model.combine import add_in_expert_order

__all__ = ["OAI_ALPHA", "OAI_LIMIT", "ExpertWeights", "combine_partials", "swiglu_oai", "pairs_from_lists", "slice_pair_outputs", "slice_partial_sum"]


class ExpertWeights(Protocol):
    n_expert: int
    d_model: int
    activation: str

    def gate(self, e: int) -> torch.Tensor: ...
    def up(self, e: int) -> torch.Tensor: ...
    def down(self, e: int) -> torch.Tensor: ...
    def bias(self, kind: int, e: int) -> torch.Tensor | None: ...


OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU (llama.cpp: LLM_FFN_SWIGLU_OAI_MOE)


def swiglu_oai(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """ggml's swiglu_oai in float32: ``x / (1 + exp(-alpha x)) * (y + 1)``, x = min(g, limit),
    y = clamp(u, -limit, limit)."""
    x = torch.clamp(g, max=OAI_LIMIT)
    y = torch.clamp(u, -OAI_LIMIT, OAI_LIMIT)
    return x / (1.0 + torch.exp(-OAI_ALPHA * x)) * (y + 1.0)


def _biased(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b


def slice_partial_sum(
    x: torch.Tensor,
    pair_rows: torch.Tensor,
    pair_experts: torch.Tensor,
    pair_weights: torch.Tensor,
    weights: ExpertWeights,
) -> torch.Tensor:
    """Weighted sum over a slice's experts for each row of ``x``.

    ``x`` is ``[n, d_model]`` float32; the three pair tensors have one entry per (row, expert) pair
    that falls in this slice: row index into ``x``, local expert index, router weight. A row appears
    at most once per expert. Rows with no pair get zeros.
    """
    acc = np.zeros((x.shape[0], x.shape[1]), dtype=np.float32)
    if pair_rows.numel() == 0:
        return torch.from_numpy(acc)
    y = slice_pair_outputs(x, pair_rows, pair_experts, pair_weights, weights).numpy()
    return torch.from_numpy(add_in_expert_order(acc, pair_rows.numpy(), pair_experts.numpy(), y, error=ValueError))


def slice_pair_outputs(
    x: torch.Tensor,
    pair_rows: torch.Tensor,
    pair_experts: torch.Tensor,
    pair_weights: torch.Tensor,
    weights: ExpertWeights,
) -> torch.Tensor:
    """Each pair's weighted expert output ``[P, d_model]``, in the pairs' order (the same products as
    ``slice_partial_sum`` adds)."""
    out = torch.empty(pair_rows.shape[0], x.shape[1], dtype=torch.float32)
    if pair_rows.numel() == 0:
        return out
    for e in torch.unique(pair_experts).tolist():
        sel = pair_experts == e
        xe = x.index_select(0, pair_rows[sel])
        g = _biased(xe @ weights.gate(e).T, weights.bias(0, e))
        u = _biased(xe @ weights.up(e).T, weights.bias(1, e))
        act = swiglu_oai(g, u) if weights.activation == "swiglu_oai" else F.silu(g) * u
        h = _biased(act @ weights.down(e).T, weights.bias(2, e))
        out[sel] = h * pair_weights[sel].unsqueeze(1)
    return out


def pairs_from_lists(
    experts: Sequence[Sequence[int]], row_weights: Sequence[Sequence[float]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row lists of (local expert, weight) -> flat (rows, experts, weights) pair tensors."""
    rows: list[int] = []
    exps: list[int] = []
    ws: list[float] = []
    for r, (es, wts) in enumerate(zip(experts, row_weights, strict=True)):
        for e, w in zip(es, wts, strict=True):
            rows.append(r)
            exps.append(e)
            ws.append(w)
    return (
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(exps, dtype=torch.long),
        torch.tensor(ws, dtype=torch.float32),
    )


def combine_partials(n_rows: int, d_model: int, partials: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum ``(lo, rows, partial)`` contributions in ascending ``lo`` (the canonical order).

    ``rows`` are the indices (into the layer's token rows) that ``partial`` covers.
    """
    out = torch.zeros(n_rows, d_model, dtype=torch.float32)
    for _, rows, part in sorted(partials, key=lambda p: p[0]):
        out.index_add_(0, rows, part)
    return out
