"""Comparing a worker's answer with the coordinator's own (shell helper, numpy; DESIGN §12).

Equal means bit-equal when the worker's Hello announces our kernel id and the wire is float32;
otherwise every pair's output must be within ``VERIFY_RTOL`` of ours (relative L2 error).
"""

from __future__ import annotations

import numpy as np

__all__ = ["VERIFY_RTOL", "verify_outputs"]

# Tolerance of a comparison that cannot be bit-exact (another kernel id, a 16-bit wire): the largest
# relative L2 error of one pair's output. Measured on the golden fixtures (Q4_K_M, Q8_0, F32; 64 rows
# x 2 pairs per layer): ggml vs torch kernels <= 2.5e-2 (ggml rounds activations to q8 for quantised
# weights, torch does not); the same ggml kernel on a float16 / bfloat16 wire <= 1.5e-2 / 2.1e-2.
# Twice the worst case: a liar can hide changes below this only from workers we cannot compare exactly.
VERIFY_RTOL = 0.05


def verify_outputs(remote: np.ndarray, local: np.ndarray, *, exact: bool) -> tuple[bool, str, float | None]:
    """Are a worker's per-pair outputs ours? ``(equal, detail, error)``: bit-equal when ``exact``, else
    each pair within ``VERIFY_RTOL`` (relative L2); ``detail`` is the evidence, ``error`` a tolerance
    comparison's largest relative error (None when exact)."""
    a = np.asarray(remote, dtype=np.float32)
    b = np.asarray(local, dtype=np.float32)
    if a.shape != b.shape:
        return False, f"shape {a.shape} for {b.shape}", None
    if not bool(np.isfinite(a).all()):
        return False, "non-finite outputs", None
    if exact:
        if np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            return True, "bit-equal", None
        diff = (a.view(np.uint32) != b.view(np.uint32)).any(axis=1)
        first = int(np.flatnonzero(diff)[0])
        return False, (
            f"{int(diff.sum())} of {a.shape[0]} pair outputs differ (bit-exact comparison); first at pair "
            f"{first}: max |diff| {float(np.abs(a[first] - b[first]).max()):.3g}"
        ), None
    norms = np.linalg.norm(b, axis=1)
    floor = max(float(np.median(norms)) * 1e-3, 1e-30) if norms.size else 1e-30
    rel = np.linalg.norm(a - b, axis=1) / np.maximum(norms, floor)
    worst = int(rel.argmax()) if rel.size else 0
    err = float(rel[worst]) if rel.size else 0.0
    if err <= VERIFY_RTOL:
        return True, f"within tolerance (max relative error {err:.3g})", err
    return False, f"pair {worst}: relative error {err:.3g} > {VERIFY_RTOL:g} (tolerance comparison)", err
