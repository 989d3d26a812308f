"""A request's (row, expert, weight) pairs on the expert wire (pure): the arrays, their wire order and
the checks every receiver makes (``swarm.protocol.expert`` re-exports these names).

Rules: pairs are sorted by (row, expert), unique, every row has at least one, indices within
the request's ``n_rows`` and ``hi - lo``, weights finite; a defect is a ``WireError`` attributed
to the request (``BadShape``, ``BadIndex``, ``NonFinite``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from swarm.errors import BadIndex, BadShape, NonFinite, WireError

if TYPE_CHECKING:
    from swarm.protocol.expert import ExpertRequest, ExpertResponse

__all__ = ["Pairs", "attributed", "check_pairs", "make_pairs"]


def attributed(cls: type[WireError], message: str, req: ExpertRequest | ExpertResponse) -> WireError:
    return cls(message, request_id=req.request_id, attempt=req.attempt)


@dataclass(frozen=True, slots=True)
class Pairs:
    """A request's (row, expert, weight) pairs as flat arrays: ``rows`` and ``experts`` (relative
    to ``lo``) uint32, ``weights`` float32, sorted by (row, expert). Received pairs are views of
    the receive buffer."""

    rows: npt.NDArray[np.uint32]
    experts: npt.NDArray[np.uint32]
    weights: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def parts(self) -> tuple[memoryview, memoryview, memoryview]:
        """The three arrays' bytes, in payload order (little-endian)."""
        return (self.rows.data.cast("B"), self.experts.data.cast("B"), self.weights.data.cast("B"))


_SMALL: Final = 64  # up to this many pairs a Python loop beats numpy's per-call overhead (~1 us a call)


def make_pairs(rows: npt.ArrayLike, experts: npt.ArrayLike, weights: npt.ArrayLike) -> Pairs:
    """Pairs in wire order from arrays in any order (e.g. the router's); raises ``BadShape`` if the
    lengths differ and ``BadIndex`` for a negative index. Duplicates are kept (``check_pairs`` refuses them)."""
    r = np.asarray(rows).reshape(-1)
    e = np.asarray(experts).reshape(-1)
    w = np.asarray(weights, dtype=np.float32).reshape(-1)
    if not r.shape == e.shape == w.shape:
        raise BadShape(f"pair arrays of lengths {r.shape[0]}, {e.shape[0]}, {w.shape[0]}")
    n = r.shape[0]
    if 0 < n <= _SMALL:  # lists: no numpy call per check (about a microsecond each)
        rl, el = r.tolist(), e.tolist()
        if min(rl) < 0 or min(el) < 0:
            raise BadIndex("negative pair index")
        keys = list(zip(rl, el, strict=True))
        if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
            order = sorted(range(n), key=keys.__getitem__)
            r, e, w = r[order], e[order], w[order]
    elif n:
        if int(r.min()) < 0 or int(e.min()) < 0:
            raise BadIndex("negative pair index")
        key = r.astype(np.int64) * (int(e.max()) + 1) + e.astype(np.int64)
        if not bool((key[1:] > key[:-1]).all()):  # already sorted (the common case): no copy
            order_a = np.argsort(key, kind="stable")
            r, e, w = r[order_a], e[order_a], w[order_a]
    return Pairs(
        np.ascontiguousarray(r, dtype="<u4"),
        np.ascontiguousarray(e, dtype="<u4"),
        np.ascontiguousarray(w, dtype="<f4"),
    )


def check_pairs(req: ExpertRequest, pairs: Pairs) -> None:
    """Raise the ``WireError`` naming the first defect of ``pairs`` for ``req`` (module rules)."""
    n = len(pairs)
    if n != req.n_pairs or pairs.experts.shape[0] != n or pairs.weights.shape[0] != n:
        raise attributed(
            BadShape,
            f"n_pairs={req.n_pairs} but {n} rows, {pairs.experts.shape[0]} experts and "
            f"{pairs.weights.shape[0]} weights",
            req,
        )
    if n == 0:
        raise attributed(BadIndex, "no pairs: every row needs at least one", req)
    if n <= _SMALL:
        _check_small(req, pairs.rows.tolist(), pairs.experts.tolist(), pairs.weights.tolist())
    else:
        _check_large(req, pairs)


def _check_small(req: ExpertRequest, rows: list[int], exps: list[int], weights: list[float]) -> None:
    n_local = req.hi - req.lo
    prev_r, prev_e = 0, -1
    for i, (r, e) in enumerate(zip(rows, exps, strict=True)):
        if e >= n_local:
            raise attributed(
                BadIndex, f"pair {i}: expert index {e} outside [0, {n_local}) of slice {req.lo}-{req.hi}", req
            )
        if r >= req.n_rows:
            raise attributed(BadIndex, f"pair {i}: row {r} outside [0, {req.n_rows})", req)
        if r == prev_r and e > prev_e:
            prev_e = e
            continue
        if r == prev_r + 1 and i > 0:
            prev_r, prev_e = r, e
            continue
        if (r, e) == (prev_r, prev_e):
            raise attributed(BadIndex, f"pair {i} (row {r}, expert {e}) repeats pair {i - 1}", req)
        if (r, e) < (prev_r, prev_e):
            raise attributed(
                BadIndex,
                f"pair {i} (row {r}, expert {e}) is out of (row, expert) order after pair {i - 1} "
                f"(row {prev_r}, expert {prev_e})",
                req,
            )
        raise attributed(BadIndex, f"row {prev_r + 1 if i else 0} has no pair", req)
    if prev_r != req.n_rows - 1:
        raise attributed(BadIndex, f"row {prev_r + 1} has no pair", req)
    if not all(map(math.isfinite, weights)):
        i = next(j for j, w in enumerate(weights) if not math.isfinite(w))
        raise attributed(NonFinite, f"pair {i}: non-finite router weight {weights[i]}", req)


def _check_large(req: ExpertRequest, pairs: Pairs) -> None:
    rows, exps = pairs.rows, pairs.experts
    n_local = req.hi - req.lo
    if int(exps.max()) >= n_local:
        i = int(np.argmax(exps >= n_local))
        raise attributed(
            BadIndex, f"pair {i}: expert index {int(exps[i])} outside [0, {n_local}) of slice {req.lo}-{req.hi}", req
        )
    if int(rows.max()) >= req.n_rows:
        i = int(np.argmax(rows >= req.n_rows))
        raise attributed(BadIndex, f"pair {i}: row {int(rows[i])} outside [0, {req.n_rows})", req)
    # sorted by (row, expert) and unique <=> the combined key strictly increases
    key = rows.astype(np.int64) * n_local + exps
    if not bool((key[1:] > key[:-1]).all()):
        i = 1 + int(np.argmax(key[1:] <= key[:-1]))
        what = "repeats" if key[i] == key[i - 1] else "is out of (row, expert) order after"
        raise attributed(
            BadIndex,
            f"pair {i} (row {int(rows[i])}, expert {int(exps[i])}) {what} pair {i - 1} "
            f"(row {int(rows[i - 1])}, expert {int(exps[i - 1])})",
            req,
        )
    # sorted: every row has a pair <=> rows start at 0 and step by at most 1
    if int(rows[0]) != 0 or int(rows[-1]) != req.n_rows - 1 or int((rows[1:] - rows[:-1]).max(initial=0)) > 1:
        present = np.zeros(req.n_rows, dtype=bool)
        present[rows] = True
        raise attributed(BadIndex, f"row {int(np.argmin(present))} has no pair", req)
    if not bool(np.isfinite(pairs.weights).all()):
        i = int(np.argmin(np.isfinite(pairs.weights)))
        raise attributed(NonFinite, f"pair {i}: non-finite router weight {float(pairs.weights[i])}", req)
