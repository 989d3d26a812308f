"""The fixed order in which a layer's routed pairs are added (DESIGN §3), in numpy.

Rule: per row, ``acc = acc + y_p`` for each of the row's pairs in ascending expert index, one
float32 rounding per add. Every path that sums expert outputs -- the ggml slice kernel, the
coordinator's combine of per-pair answers (``swarm.model.kernels.combine_pairs``) -- calls this one
function, so they agree to the bit by construction.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from swarm.errors import KernelError

__all__ = ["add_in_expert_order"]


def add_in_expert_order(
    acc: np.ndarray, rows: Any, exps: Any, y: np.ndarray, *, error: type[Exception] = KernelError
) -> np.ndarray:
    """Add each pair's output ``y[p]`` into ``acc[rows[p]]`` in ascending ``exps`` per row (in place;
    returns ``acc``). ``exps`` must be comparable across the pairs (global indices when they come
    from several ranges). A row appearing twice for one expert raises ``error``."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    exps = np.asarray(exps, dtype=np.int64).reshape(-1)
    if y.ndim != 2 or y.shape[0] != rows.size or exps.size != rows.size:
        raise error("one output row per pair")
    if rows.size == 0:
        return acc
    if rows.size == 1 or (rows == rows[0]).all():  # one row (decode): ascending expert = a sort
        order = np.argsort(exps, kind="stable")
        es = exps[order]
        if es.size > 1 and (es[1:] == es[:-1]).any():
            raise error("a row appears more than once for the same expert")
        a = acc[rows[0]]
        for j in order.tolist():
            a += y[j]
        return acc
    order = np.lexsort((exps, rows))  # by row, then ascending expert
    rs, es = rows[order], exps[order]
    if ((rs[1:] == rs[:-1]) & (es[1:] == es[:-1])).any():
        raise error("a row appears more than once for the same expert")
    # the rank of each pair within its row (its position in ascending-expert order); the pairs of one
    # rank have distinct rows, so each rank is one vectorised float32 add
    idx = np.arange(rs.size)
    start = np.empty(rs.size, dtype=bool)
    start[0] = True
    np.not_equal(rs[1:], rs[:-1], out=start[1:])
    rank = idx - np.maximum.accumulate(np.where(start, idx, 0))
    g_order = np.argsort(rank, kind="stable")
    bounds = np.cumsum(np.bincount(rank))
    po = order[g_order]
    rg, ys = rows[po], y[po]
    s = 0
    for e in bounds.tolist():
        acc[rg[s:e]] += ys[s:e]
        s = e
    return acc
