"""ggml graphs for the dense halves of a transformer layer (shell over native code).

A decode step used to cost ~30 small torch ops and five separate ggml matmuls per layer around
attention; on a 2-core machine that Python/dispatch overhead was a third of the step. Here each
half is one ggml graph, built once per row bucket (and thread count) and recomputed with new data:

- ``AttnIn``: ``x`` -> RMSNorm * ``attn_norm`` -> q, k, v projections (+ biases where the file
  has them) -> q/k RMSNorm per head or over the whole projection (where the architecture has it)
  -> RoPE (NEOX or adjacent pairs) at the given positions.
- ``AttnOut``: attention output, residual -> ``x2 = residual + W_o @ attn (+ b_o)`` -> RMSNorm *
  ``ffn_norm`` -> router logits -> softmax. Returns ``x2`` (the MoE residual), the normed rows
  (the experts' input) and the router probabilities; with a shared expert also its output
  ``down(silu(gate h) * up h)`` (times ``sigmoid(g . h)`` where it is gated; the sigmoid as
  llama.cpp computes it, ``silu(z) / z``).
- ``MlaIn``: DeepSeek-V2's multi-head latent attention input, as llama.cpp computes it with
  ``attn_k_b`` absorbed into the queries (an MQA over one latent head); ``AttnOut`` then takes the
  latent attention output through ``attn_v_b`` per head before ``W_o``. A dense block (no router)
  gets its whole FFN as ``shared``.
- ``Head``: RMSNorm * ``output_norm`` -> output projection.

These are llama.cpp's own ops (``ggml_rms_norm`` sums in double, ``ggml_rope_ext`` with its
theta recurrence, ``ggml_soft_max``), so the numbers are llama.cpp's, not an imitation of them.

Rules (as ``swarm.model.kernels.ggml``): weights are zero-copy views of the GGUF's bytes; every
op works row by row (a row's result never depends on the other rows or the bucket -- padding
rows are zeros); shapes are checked in Python before ggml sees them; a graph object is
thread-safe (one lock) and computes on the calling thread's threadpool.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ggml.ggml as g
import numpy as np

from swarm.errors import KernelError
from swarm.model.gguf import RopeScaling
from swarm.model.kernels.ggml import (
    OAI_ALPHA,
    OAI_LIMIT,
    _as_raw,
    _bucket,
    _Ctx,
    _f32_view,
    _i32_view,
    _Plan,
    _type_id,
    _weight,
    row_nbytes,
)

__all__ = ["AttnIn", "AttnOut", "AttnOutMoE", "DenseWeight", "Gate", "Head", "HeadWeights", "MlaIn", "RoutedExperts",
           "SharedFFN", "SharedOut"]

_NODES = 64


_NO_SCALING = RopeScaling()


def _rope_ext(ctx: Any, t: Any, pos: Any, n_rot: int, mode: int, base: float, r: RopeScaling) -> Any:
    """ggml_rope_ext with the model's scaling (``RopeScaling``: derived from the GGUF as llama.cpp does)."""
    return g.ggml_rope_ext(ctx, t, pos, None, n_rot, mode, r.n_ctx_orig, ctypes.c_float(base),
                           ctypes.c_float(r.freq_scale), ctypes.c_float(r.ext_factor), ctypes.c_float(r.attn_factor),
                           ctypes.c_float(r.beta_fast), ctypes.c_float(r.beta_slow))


@dataclass(frozen=True)
class DenseWeight:
    """A 2-D GGUF weight ``[out, in]`` as raw bytes in its stored type."""

    raw: np.ndarray
    qtype: int
    out_features: int
    in_features: int


def _f32(a: np.ndarray, n: int, what: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    if a.size != n:
        raise KernelError(f"{what}: expected {n} float32 values, got {a.size}")
    return a


Family = dict[tuple[Any, ...], "_Graphs"]


class _Graphs:
    """Bucketed graphs over a set of weight tensors; subclasses define ``_build``.

    Objects built with the same ``family`` dict and an equal signature (class, weight types and
    shapes, op parameters) share one set of graphs (the first such object builds them): e.g. every
    layer of a model, whose graph buffers would otherwise be held once per layer. Before computing,
    an object points the shared graphs' weight leaves at its own arrays (leaves, not views: ggml
    reads ``tensor->data`` at compute time), under the shared lock.
    """

    nodes = _NODES  # graph nodes (and tensors) a graph of this class may have

    def __init__(self, max_rows: int = 256) -> None:
        self.max_rows = int(max_rows)
        self._keep: list[np.ndarray] = []  # arrays the weight tensors point into
        self._leaves: list[Any] = []  # the weight tensors, in creation order
        self._wctx = _Ctx(16 * g.ggml_tensor_overhead() + 1024, no_alloc=True)
        self._plans: dict[tuple[int, int], tuple[_Plan, dict[str, np.ndarray]]] = {}
        self._lock = threading.Lock()
        self._builder: _Graphs = self
        self._bound: _Graphs | None = None  # (on a family's builder) the member whose weights the leaves hold
        self._binds: list[tuple[Any, int]] | None = None

    def _share(self, family: Family | None, params: tuple[Any, ...]) -> None:
        """Join ``family`` (call at the end of a subclass's ``__init__``)."""
        if family is None:
            return
        sig = (type(self).__name__, params,
               tuple((int(t.contents.type), tuple(int(t.contents.ne[i]) for i in range(4))) for t in self._leaves))
        b = family.setdefault(sig, self)
        self._builder, self._plans, self._lock = b, b._plans, b._lock

    def _dense(self, w: DenseWeight, name: str) -> Any:
        tid = _type_id(w.qtype)
        raw = _as_raw(w.raw, row_nbytes(tid, w.in_features) * w.out_features, name)
        t, kept = _weight(self._wctx, tid, (w.in_features, w.out_features), raw, name, "mul_mat")
        self._keep.append(kept)
        self._leaves.append(t)
        return t

    def _dense3(self, w: HeadWeights, name: str, op: str | None = None) -> Any:
        tid = _type_id(w.qtype)
        raw = _as_raw(w.raw, row_nbytes(tid, w.in_features) * w.out_features * w.heads, name)
        t, kept = _weight(self._wctx, tid, (w.in_features, w.out_features, w.heads), raw, name, op)
        self._keep.append(kept)
        self._leaves.append(t)
        return t

    def _vec(self, a: np.ndarray, n: int, name: str) -> Any:
        arr = _f32(a, n, name)
        self._keep.append(arr)
        t = g.ggml_new_tensor_1d(self._wctx.ctx, g.GGML_TYPE_F32, n)
        t.contents.data = arr.ctypes.data
        g.ggml_set_name(t, name.encode())
        self._leaves.append(t)
        return t

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        """Inputs (name -> (tensor, numpy shape, dtype)) and the output tensors in order."""
        raise NotImplementedError

    def _mem(self, b: int) -> int:
        raise NotImplementedError

    def _plan(self, b: int, n_threads: int) -> tuple[_Plan, dict[str, np.ndarray]]:
        key = (b, n_threads)
        p = self._plans.get(key)
        if p is not None:
            return p
        nodes = self._builder.nodes
        ctx = _Ctx(self._mem(b) + nodes * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(nodes, False)
                   + nodes * 64, no_alloc=False)
        inputs, outputs = self._builder._build(ctx.ctx, b)
        graph = g.ggml_new_graph_custom(ctx.ctx, nodes, False)
        for t in outputs:
            g.ggml_set_output(t)
            g.ggml_build_forward_expand(graph, t)
        plan = _Plan(ctx, graph, n_threads, 0)
        views: dict[str, np.ndarray] = {}
        for name, (t, shape, kind) in inputs.items():
            v = _i32_view(t, shape) if kind == "i32" else _f32_view(t, shape)
            v[:] = 0
            views[name] = v
        for i, t in enumerate(outputs):
            views[f"out{i}"] = _f32_view(t, (b, int(g.ggml_nelements(t)) // b))  # rows are the last dim
        p = (plan, views)
        self._plans[key] = p
        return p

    def _bind(self) -> None:
        """Point the (possibly shared) graphs' weight leaves at this object's arrays; skipped when it
        is the family's last bound member. The leaves' structs and the arrays' addresses are taken
        once (ctypes builds a new object for every ``.contents`` and ``.ctypes``)."""
        b = self._builder
        if b._bound is self:
            return
        if self._binds is None:
            self._binds = [(leaf.contents, arr.ctypes.data) for leaf, arr in zip(b._leaves, self._keep, strict=True)]
        for st, ptr in self._binds:
            st.data = ptr
        b._bound = self

    def _run(self, n: int, n_threads: int, fill: Callable[[dict[str, np.ndarray], int, int], None],
             n_out: int) -> list[np.ndarray]:
        outs: list[np.ndarray] | None = None
        with self._lock:
            self._bind()
            for s in range(0, n, self.max_rows):
                e = min(n, s + self.max_rows)
                m = e - s
                plan, views = self._plan(_bucket(m, self.max_rows), n_threads)
                fill(views, s, e)
                plan.compute(n_threads)
                ov = [views[f"out{i}"] for i in range(n_out)]
                if outs is None:
                    if m == n:  # one chunk: the outputs are copies of the graph's rows
                        return [v[:m].copy() for v in ov]
                    outs = [np.empty((n, v.shape[1]), dtype=np.float32) for v in ov]
                for o, v in zip(outs, ov, strict=True):
                    o[s:e] = v[:m]
        assert outs is not None
        return outs

    def close(self) -> None:
        with self._lock:
            if self._builder is self:
                for plan, _ in self._plans.values():
                    plan.ctx.free()
                self._plans.clear()
            self._wctx.free()


def _rms(ctx: Any, x: Any, w: Any, eps: float) -> Any:
    return g.ggml_mul(ctx, g.ggml_rms_norm(ctx, x, ctypes.c_float(eps)), w)


def _biased(ctx: Any, x: Any, b: Any | None) -> Any:
    return x if b is None else g.ggml_add(ctx, x, b)


class _QkvIn(_Graphs):
    """A graph from rows ``x[n, d]`` at positions ``[n]`` to ``(q, k, v)`` (``AttnIn``, ``MlaIn``)."""

    d: int

    def __call__(self, x: np.ndarray, pos: np.ndarray, n_threads: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        p = np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        if x.ndim != 2 or x.shape[1] != self.d or p.shape[0] != x.shape[0]:
            raise KernelError(f"x must be [n, {self.d}] with n positions, got {x.shape} and {p.shape}")

        def fill(v: dict[str, np.ndarray], s: int, e: int) -> None:
            v["x"][: e - s] = x[s:e]
            v["pos"][: e - s] = p[s:e]

        q, k, v = self._run(x.shape[0], n_threads, fill, 3)
        return q, k, v


class AttnIn(_QkvIn):
    """``x[n, d]``, positions ``[n]`` -> roped ``q[n, H*hdk]``, roped ``k[n, Hkv*hdk]``, ``v[n, Hkv*hdv]``."""

    def __init__(self, *, attn_norm: np.ndarray, wq: DenseWeight, wk: DenseWeight, wv: DenseWeight,
                 q_norm: np.ndarray | None, k_norm: np.ndarray | None, n_head: int, n_head_kv: int,
                 head_dim_k: int, head_dim_v: int, n_rot: int, rope_neox: bool, rope_base: float, eps: float,
                 qk_norm_full: bool = False, bq: np.ndarray | None = None, bk: np.ndarray | None = None,
                 bv: np.ndarray | None = None, rope: RopeScaling = _NO_SCALING, max_rows: int = 256,
                 family: Family | None = None) -> None:
        super().__init__(max_rows)
        d = wq.in_features
        if (wq.out_features, wk.out_features, wv.out_features) != (n_head * head_dim_k, n_head_kv * head_dim_k,
                                                                   n_head_kv * head_dim_v):
            raise KernelError("q/k/v projection shapes do not match the head counts")
        if wk.in_features != d or wv.in_features != d:
            raise KernelError("q/k/v projections differ in input width")
        if (q_norm is None) != (k_norm is None):
            raise KernelError("q_norm and k_norm come together")
        if not 0 < n_rot <= head_dim_k or n_rot % 2:
            raise KernelError(f"n_rot {n_rot} must be even and at most head_dim_k {head_dim_k}")
        self.d, self.H, self.Hkv, self.hdk, self.hdv = d, n_head, n_head_kv, head_dim_k, head_dim_v
        self.n_rot, self.mode = n_rot, (2 if rope_neox else 0)  # GGML_ROPE_TYPE_NEOX / normal
        self.rope_base, self.eps, self.rope_args = float(rope_base), float(eps), rope
        self._norm = self._vec(attn_norm, d, "attn_norm")
        self._wq, self._wk, self._wv = self._dense(wq, "wq"), self._dense(wk, "wk"), self._dense(wv, "wv")
        self.qk_norm_full = bool(qk_norm_full)
        qn, kn = (wq.out_features, wk.out_features) if qk_norm_full else (head_dim_k, head_dim_k)
        self._qn = self._vec(q_norm, qn, "q_norm") if q_norm is not None else None
        self._kn = self._vec(k_norm, kn, "k_norm") if k_norm is not None else None
        self._bq = self._vec(bq, wq.out_features, "bq") if bq is not None else None
        self._bk = self._vec(bk, wk.out_features, "bk") if bk is not None else None
        self._bv = self._vec(bv, wv.out_features, "bv") if bv is not None else None
        self.macs = d * (wq.out_features + wk.out_features + wv.out_features)
        self._share(family, (n_head, n_head_kv, head_dim_k, head_dim_v, n_rot, self.mode, self.rope_base, self.eps,
                             q_norm is not None, self.qk_norm_full, bq is not None, bk is not None, bv is not None, rope))

    def _mem(self, b: int) -> int:
        q, kv = self.H * self.hdk, self.Hkv * max(self.hdk, self.hdv)
        return 4 * b * (3 * self.d + 4 * q + 8 * kv) + 4 * b

    def _rope(self, ctx: Any, t: Any, pos: Any) -> Any:
        return _rope_ext(ctx, t, pos, self.n_rot, self.mode, self.rope_base, self.rope_args)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        x = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, self.d, b)
        pos = g.ggml_new_tensor_1d(ctx, g.GGML_TYPE_I32, b)
        g.ggml_set_input(x)
        g.ggml_set_input(pos)
        return {"x": (x, (b, self.d), "f32"), "pos": (pos, (b,), "i32")}, list(self.ops(ctx, x, pos, b))

    def ops(self, ctx: Any, x: Any, pos: Any, b: int) -> tuple[Any, Any, Any]:
        """The graph's ops on given tensors ``x [d, b]`` and ``pos [b]``: ``(q, k, v)`` (``q [hdk, H, b]``,
        ``k [hdk, Hkv, b]``, ``v [Hkv*hdv, b]``; ``coordinator.engine.stack`` builds them into its own graph)."""
        h = _rms(ctx, x, self._norm, self.eps)
        q = _biased(ctx, g.ggml_mul_mat(ctx, self._wq, h), self._bq)
        k = _biased(ctx, g.ggml_mul_mat(ctx, self._wk, h), self._bk)
        v = _biased(ctx, g.ggml_mul_mat(ctx, self._wv, h), self._bv)
        if self.qk_norm_full and self._qn is not None and self._kn is not None:  # over the whole projection
            q = _rms(ctx, q, self._qn, self.eps)
            k = _rms(ctx, k, self._kn, self.eps)
        q = g.ggml_reshape_3d(ctx, q, self.hdk, self.H, b)
        k = g.ggml_reshape_3d(ctx, k, self.hdk, self.Hkv, b)
        if not self.qk_norm_full and self._qn is not None and self._kn is not None:  # per head
            q = _rms(ctx, q, self._qn, self.eps)
            k = _rms(ctx, k, self._kn, self.eps)
        return self._rope(ctx, q, pos), self._rope(ctx, k, pos), v

class MlaIn(_QkvIn):
    """Multi-head latent attention's input half (DeepSeek-V2), with llama.cpp's absorption of
    ``attn_k_b``: ``x[n, d]``, positions -> ``q[n, H*(kv_lora+d_rope)]`` (each head's nope part taken
    into the latent space by k_b, then its roped part), ``k[n, kv_lora+d_rope]`` (the normed latent,
    then the shared roped part) and ``v[n, kv_lora]`` (the normed latent): an MQA over one latent head.
    RoPE (``rope_neox`` False: adjacent pairs) acts on the last ``d_rope`` dims of q and k only."""

    def __init__(self, *, attn_norm: np.ndarray, wq: DenseWeight | None, wq_a: DenseWeight | None,
                 q_a_norm: np.ndarray | None, wq_b: DenseWeight | None, wkv_a: DenseWeight, kv_a_norm: np.ndarray,
                 wk_b: HeadWeights, n_head: int, kv_lora_rank: int, d_nope: int, d_rope: int, rope_neox: bool,
                 rope_base: float, eps: float, rope: RopeScaling = _NO_SCALING, max_rows: int = 256,
                 family: Family | None = None) -> None:
        super().__init__(max_rows)
        d = wkv_a.in_features
        self.rope_args = rope
        qk = d_nope + d_rope
        self.d, self.H, self.kvl, self.dn, self.dr = d, n_head, kv_lora_rank, d_nope, d_rope
        self.mode, self.rope_base, self.eps = (2 if rope_neox else 0), float(rope_base), float(eps)
        if wkv_a.out_features != kv_lora_rank + d_rope:
            raise KernelError("attn_kv_a_mqa must give kv_lora_rank + rope dims")
        if (wk_b.heads, wk_b.out_features, wk_b.in_features) != (n_head, kv_lora_rank, d_nope):
            raise KernelError("attn_k_b must be [heads, kv_lora_rank, nope dims]")
        if d_rope % 2:
            raise KernelError("the rope dims must be even")
        self._norm = self._vec(attn_norm, d, "attn_norm")
        self.low_rank = wq is None
        if wq is not None:
            if (wq.in_features, wq.out_features) != (d, n_head * qk):
                raise KernelError("attn_q must be [heads x (nope + rope), d_model]")
            self._wq: tuple[Any, ...] = (self._dense(wq, "wq"),)
            q_macs = d * wq.out_features
        else:
            if wq_a is None or wq_b is None or q_a_norm is None:
                raise KernelError("MLA needs attn_q or attn_q_a, attn_q_a_norm and attn_q_b")
            if wq_b.out_features != n_head * qk or wq_b.in_features != wq_a.out_features:
                raise KernelError("attn_q_b does not fit attn_q_a and the heads")
            self._wq = (self._dense(wq_a, "wq_a"), self._vec(q_a_norm, wq_a.out_features, "q_a_norm"),
                        self._dense(wq_b, "wq_b"))
            q_macs = d * wq_a.out_features + wq_a.out_features * wq_b.out_features
        self._wkv = self._dense(wkv_a, "wkv_a")
        self._kvn = self._vec(kv_a_norm, kv_lora_rank, "kv_a_norm")
        self._wkb = self._dense3(wk_b, "wk_b")
        self.macs = q_macs + d * wkv_a.out_features + n_head * d_nope * kv_lora_rank
        self._share(family, (n_head, kv_lora_rank, d_nope, d_rope, self.mode, self.rope_base, self.eps, self.low_rank,
                             rope))

    def _mem(self, b: int) -> int:
        qk, lat = self.dn + self.dr, self.kvl + self.dr
        return 4 * b * (4 * self.d + 4 * self.H * qk + 4 * self.H * lat + 6 * lat + 2 * self.H * self.kvl) + 4 * b

    def _rope(self, ctx: Any, t: Any, pos: Any) -> Any:
        return _rope_ext(ctx, t, pos, self.dr, self.mode, self.rope_base, self.rope_args)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        x = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, self.d, b)
        pos = g.ggml_new_tensor_1d(ctx, g.GGML_TYPE_I32, b)
        g.ggml_set_input(x)
        g.ggml_set_input(pos)
        return {"x": (x, (b, self.d), "f32"), "pos": (pos, (b,), "i32")}, list(self.ops(ctx, x, pos, b))

    def ops(self, ctx: Any, x: Any, pos: Any, b: int) -> tuple[Any, Any, Any]:
        """``AttnIn.ops`` of MLA: ``(q [kv_lora+dr, H, b], k [kv_lora+dr, 1, b], v [kv_lora, b])``."""
        H, kvl, dn, dr = self.H, self.kvl, self.dn, self.dr
        h = _rms(ctx, x, self._norm, self.eps)
        if len(self._wq) == 1:
            q = g.ggml_mul_mat(ctx, self._wq[0], h)
        else:
            wq_a, qn, wq_b = self._wq
            q = g.ggml_mul_mat(ctx, wq_b, _rms(ctx, g.ggml_mul_mat(ctx, wq_a, h), qn, self.eps))
        f4 = 4  # float32 rows
        q_nope = g.ggml_view_3d(ctx, q, dn, H, b, (dn + dr) * f4, (dn + dr) * f4 * H, 0)
        q_pe = g.ggml_view_3d(ctx, q, dr, H, b, (dn + dr) * f4, (dn + dr) * f4 * H, dn * f4)
        kv = g.ggml_mul_mat(ctx, self._wkv, h)  # [kv_lora + dr, b]
        kv_c = g.ggml_view_2d(ctx, kv, kvl, b, (kvl + dr) * f4, 0)
        k_pe = g.ggml_view_3d(ctx, kv, dr, 1, b, (kvl + dr) * f4, (kvl + dr) * f4, kvl * f4)
        q_pe = self._rope(ctx, q_pe, pos)
        k_pe = self._rope(ctx, k_pe, pos)
        kv_c = _rms(ctx, kv_c, self._kvn, self.eps)
        q_abs = g.ggml_mul_mat(ctx, self._wkb, g.ggml_permute(ctx, q_nope, 0, 2, 1, 3))  # [kv_lora, b, H]
        q_out = g.ggml_concat(ctx, g.ggml_permute(ctx, q_abs, 0, 2, 1, 3), q_pe, 0)  # [kv_lora + dr, H, b]
        k_out = g.ggml_concat(ctx, g.ggml_reshape_3d(ctx, kv_c, kvl, 1, b), k_pe, 0)  # [kv_lora + dr, 1, b]
        return q_out, k_out, kv_c

@dataclass(frozen=True)
class HeadWeights:
    """A stack of per-head matrices ``[heads, out, in]`` as raw GGUF bytes (MLA's attn_k_b / attn_v_b)."""

    raw: np.ndarray
    qtype: int
    heads: int
    out_features: int
    in_features: int


@dataclass(frozen=True)
class SharedFFN:
    """A shared expert's weights for ``AttnOut``: ``gate``/``up`` ``[width, d]``, ``down`` ``[d, width]``,
    ``gate_inp`` ``[d]`` float32 where its output is sigmoid-gated."""

    gate: DenseWeight
    up: DenseWeight
    down: DenseWeight
    gate_inp: np.ndarray | None = None


def _shared_ffn(ctx: Any, sh: tuple[Any, Any, Any, Any | None], h: Any) -> Any:
    """A shared expert on ``h``: ``down(silu(gate h) * up h)``, times ``sigmoid(gate_inp . h)`` where gated."""
    wg, wu, wd, gi = sh
    act = g.ggml_mul(ctx, g.ggml_silu(ctx, g.ggml_mul_mat(ctx, wg, h)), g.ggml_mul_mat(ctx, wu, h))
    out = g.ggml_mul_mat(ctx, wd, act)
    if gi is not None:
        z = g.ggml_mul_mat(ctx, gi, h)  # [1, b]
        out = g.ggml_mul(ctx, out, g.ggml_div(ctx, g.ggml_silu(ctx, z), z))
    return out


def _shared_leaves(gr: _Graphs, shared: SharedFFN, d: int) -> tuple[tuple[Any, Any, Any, Any | None], int]:
    w = shared.gate.out_features
    if (shared.gate.in_features, shared.up.out_features, shared.up.in_features, shared.down.out_features,
            shared.down.in_features) != (d, w, d, d, w):
        raise KernelError("shared expert shapes do not match")
    gi = None
    if shared.gate_inp is not None:
        arr = _f32(shared.gate_inp, d, "shexp_gate_inp")
        gi = gr._dense(DenseWeight(arr.view(np.uint8), int(g.GGML_TYPE_F32), 1, d), "shexp_gate_inp")
    return (gr._dense(shared.gate, "shexp_gate"), gr._dense(shared.up, "shexp_up"), gr._dense(shared.down, "shexp_down"),
            gi), w


class SharedOut(_Graphs):
    """A shared expert alone: ``h[n, d]`` -> its output ``[n, d]`` (the ops ``AttnOut`` computes it with,
    so the same bits), for the engine to compute while a layer's routed experts are remote."""

    def __init__(self, *, shared: SharedFFN, d: int, max_rows: int = 256, family: Family | None = None) -> None:
        super().__init__(max_rows)
        self.d = d
        self._sh, self.width = _shared_leaves(self, shared, d)
        self.macs = 3 * d * self.width + (d if self._sh[3] is not None else 0)
        self._share(family, ("shared", self.width, self._sh[3] is not None))

    def _mem(self, b: int) -> int:
        return 4 * b * (4 * self.d + 4 * self.width + 8)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        h = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, self.d, b)
        g.ggml_set_input(h)
        return {"h": (h, (b, self.d), "f32")}, [_shared_ffn(ctx, self._sh, h)]

    def __call__(self, h: np.ndarray, n_threads: int = 1) -> np.ndarray:
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim != 2 or h.shape[1] != self.d:
            raise KernelError(f"h must be [n, {self.d}], got {h.shape}")

        def fill(v: dict[str, np.ndarray], s: int, e: int) -> None:
            v["h"][: e - s] = h[s:e]

        return self._run(h.shape[0], n_threads, fill, 1)[0]


class AttnOut(_Graphs):
    """Attention output ``a[n, H*hdv]``, residual ``x[n, d]`` -> ``x2 = x + W_o a (+ b_o)``, ``h = RMSNorm(x2)
    * ffn_norm``, router probabilities ``softmax(W_r h)`` ``[n, n_expert]``, and with ``shared`` the
    shared expert's output ``[n, d]``."""

    def __init__(self, *, wo: DenseWeight, ffn_norm: np.ndarray, router: DenseWeight | None, eps: float,
                 bo: np.ndarray | None = None, shared: SharedFFN | None = None, v_b: HeadWeights | None = None,
                 router_b: np.ndarray | None = None, softmax: bool = True, max_rows: int = 256,
                 family: Family | None = None) -> None:
        super().__init__(max_rows)
        if router is not None and router.in_features != wo.out_features:
            raise KernelError("router input width differs from the output projection's")
        if router is None and shared is None:
            raise KernelError("a block without a router needs its dense FFN (shared)")
        self.d, self.n_expert, self.eps = wo.out_features, router.out_features if router is not None else 0, float(eps)
        # MLA: the attention output is per head in the latent space, decompressed by v_b before wo
        self.v_b = v_b
        self.a = v_b.heads * v_b.in_features if v_b is not None else wo.in_features
        if v_b is not None and v_b.heads * v_b.out_features != wo.in_features:
            raise KernelError("v_b's heads x value dims differ from the output projection's input")
        self._wvb = self._dense3(v_b, "v_b") if v_b is not None else None
        self._wo = self._dense(wo, "wo")
        self._wr = self._dense(router, "router") if router is not None else None
        self._norm = self._vec(ffn_norm, self.d, "ffn_norm")
        self._bo = self._vec(bo, self.d, "bo") if bo is not None else None
        self._br = self._vec(router_b, self.n_expert, "router_b") if router_b is not None else None
        self.softmax = bool(softmax)  # False: the router's (biased) logits, for a top-k-then-softmax gate
        self.macs = self.d * (wo.in_features + self.n_expert) + (self.a * v_b.out_features if v_b is not None else 0)
        self.width = 0
        self._sh: tuple[Any, Any, Any, Any | None] | None = None
        if shared is not None:
            self._sh, self.width = _shared_leaves(self, shared, self.d)
            self.macs += 3 * self.d * self.width + (self.d if self._sh[3] is not None else 0)
        # what, beside the leaves' types and shapes, makes two blocks' graphs the same
        self._sig: tuple[Any, ...] = (self.eps, bo is not None, self.width, shared is not None and shared.gate_inp is not None,
                                      router is not None, v_b is not None, router_b is not None, self.softmax)
        self._share(family, self._sig)

    def _mem(self, b: int) -> int:
        return 4 * b * (4 * self.a + 8 * self.d + 3 * self.n_expert + 4 * self.width + 8)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        a = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, self.a, b)
        x = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, self.d, b)
        g.ggml_set_input(a)
        g.ggml_set_input(x)
        return {"a": (a, (b, self.a), "f32"), "x": (x, (b, self.d), "f32")}, self.ops(ctx, a, x, b)

    def ops(self, ctx: Any, a: Any, x: Any, b: int) -> list[Any]:
        """The graph's ops on given tensors ``a [A, b]``, ``x [d, b]``: ``[x2, h, (probs), (shared)]``."""
        att = a
        if self.v_b is not None and self._wvb is not None:  # per head: [kv_lora] -> [d_v], as llama.cpp's v_mla
            vb = self.v_b
            lat = g.ggml_cont(ctx, g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, a, vb.in_features, vb.heads, b), 0, 2, 1, 3))
            o = g.ggml_mul_mat(ctx, self._wvb, lat)  # [d_v, b, H]
            att = g.ggml_cont_2d(ctx, g.ggml_permute(ctx, o, 0, 2, 1, 3), vb.out_features * vb.heads, b)
        x2 = g.ggml_add(ctx, _biased(ctx, g.ggml_mul_mat(ctx, self._wo, att), self._bo), x)
        h = _rms(ctx, x2, self._norm, self.eps)
        outs = [x2, h]
        if self._wr is not None:  # a dense block has no router
            logits = _biased(ctx, g.ggml_mul_mat(ctx, self._wr, h), self._br)
            outs.append(g.ggml_soft_max(ctx, logits) if self.softmax else logits)
        if self._sh is not None:
            outs.append(_shared_ffn(ctx, self._sh, h))
        return outs

    def __call__(self, a: np.ndarray, x: np.ndarray, n_threads: int = 1
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """``(x2, h, probs, shared)``; ``shared`` is None without a shared expert (or dense FFN),
        ``probs`` has no columns without a router."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if a.ndim != 2 or a.shape[1] != self.a or x.shape != (a.shape[0], self.d):
            raise KernelError(f"a must be [n, {self.a}] and x [n, {self.d}], got {a.shape} and {x.shape}")

        def fill(v: dict[str, np.ndarray], s: int, e: int) -> None:
            v["a"][: e - s] = a[s:e]
            v["x"][: e - s] = x[s:e]

        outs = self._run(a.shape[0], n_threads, fill, 2 + (self._wr is not None) + (self._sh is not None))
        probs = outs[2] if self._wr is not None else np.zeros((a.shape[0], 0), np.float32)
        return outs[0], outs[1], probs, (outs[-1] if self._sh is not None else None)


@dataclass(frozen=True)
class RoutedExperts:
    """A layer's routed experts for ``AttnOutMoE``: the raw GGUF bytes of ``ffn_{gate,up}_exps``
    (``[n_expert, width, d]``) and ``ffn_down_exps`` (``[n_expert, d, width]``), their types, and the
    gate as ``Transformer.select_np`` applies it (softmax probabilities, top ``k``, renormalised
    where ``norm_topk``, times ``scale``)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    types: tuple[int, int, int]
    n_expert: int
    width: int
    k: int
    norm_topk: bool
    scale: float = 1.0
    activation: str = "silu"
    gating: str = "softmax"  # "softmax_topk" (gpt-oss): top-k of the logits, a softmax over those k
    n_group: int = 0  # > 1: DeepSeek's grouped top-k (the n_group_used groups with the best two-expert sums)
    n_group_used: int = 0
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # gpt-oss: F32 gate/up/down rows per expert


def _gate_ops(ctx: Any, probs: Any, b: int, e: RoutedExperts) -> tuple[Any, Any]:
    """A router's top-k on ``probs [n_expert, b]`` (softmax probabilities; the logits for a
    "softmax_topk" gate): ``(ids [k, b] int32, weights [1, k, b])`` as llama.cpp's ``build_moe_ffn``
    selects them -- with groups (``n_group`` > 1) the experts outside the ``n_group_used`` groups with
    the largest sums of their two best are out (``set_rows`` of -inf rows), the weights are the
    chosen probabilities (or the softmax of the chosen logits), renormalised where ``norm_topk`` (the
    sum in double, one float32 division), times ``scale`` unless it is 1."""
    n, k = e.n_expert, e.k
    sel = probs
    if e.n_group > 1:
        per = n // e.n_group
        grouped = g.ggml_reshape_3d(ctx, probs, per, e.n_group, b)
        best = g.ggml_top_k(ctx, grouped, min(2, per))  # [2, groups, b]
        two = g.ggml_get_rows(ctx, g.ggml_reshape_4d(ctx, grouped, 1, per, e.n_group, b), best)  # [1, 2, groups, b]
        score = g.ggml_reshape_2d(ctx, g.ggml_sum_rows(ctx, g.ggml_reshape_3d(ctx, two, min(2, per), e.n_group, b)),
                                  e.n_group, b)
        keep = g.ggml_top_k(ctx, score, e.n_group_used)  # [n_group_used, b]
        kept = g.ggml_get_rows(ctx, grouped, keep)  # [per, n_group_used, b]
        out = g.ggml_scale_bias(ctx, grouped, ctypes.c_float(0.0), ctypes.c_float(-np.inf))
        sel = g.ggml_reshape_2d(ctx, g.ggml_set_rows(ctx, out, kept, keep), n, b)
    ids = g.ggml_top_k(ctx, sel, k)  # [k, b]
    w = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, probs, 1, n, b), ids)  # [1, k, b]
    if e.gating == "softmax_topk":
        w = g.ggml_reshape_3d(ctx, g.ggml_soft_max(ctx, g.ggml_reshape_2d(ctx, w, k, b)), 1, k, b)
    if e.norm_topk:
        w2 = g.ggml_reshape_2d(ctx, w, k, b)
        w = g.ggml_reshape_3d(ctx, g.ggml_div(ctx, w2, g.ggml_sum_rows(ctx, w2)), 1, k, b)
    if e.scale != 1.0:
        w = g.ggml_scale(ctx, w, ctypes.c_float(e.scale))
    return ids, w


def _ascending(ctx: Any, ar: Any, ids: Any, k: int, b: int) -> tuple[Any, Any]:
    """``(idxf [1, k, b], order [k, b])``: the chosen experts' indices as floats (exact; ``ar`` holds 0 ..
    n_expert-1 per row) and the slots' order by ascending index."""
    idxf = g.ggml_get_rows(ctx, ar, ids)
    return idxf, g.ggml_argsort(ctx, g.ggml_reshape_2d(ctx, idxf, k, b), g.GGML_SORT_ORDER_ASC)

class Gate(_Graphs):
    """``_gate_ops`` alone: router rows ``[n, n_expert]`` -> ``(experts [n, k] int64, weights [n, k])``,
    for the per-layer path of the gates ``Transformer.select_np`` does not compute (gpt-oss's top-k
    softmax, DeepSeek's groups): the ops the fused MoE computes them with, so the same bits."""

    def __init__(self, *, experts: RoutedExperts, max_rows: int = 256) -> None:
        super().__init__(max_rows)
        self.ex = experts
        self.nodes = _NODES + 32
        self._ar = np.arange(experts.n_expert, dtype=np.float32)

    def _mem(self, b: int) -> int:
        e = self.ex
        return 4 * b * (8 * e.n_expert + 8 * e.k + 16)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        n, k = self.ex.n_expert, self.ex.k
        p = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, n, b)
        ar = g.ggml_new_tensor_3d(ctx, g.GGML_TYPE_F32, 1, n, b)
        for t in (p, ar):
            g.ggml_set_input(t)
        ids, w = _gate_ops(ctx, p, b, self.ex)
        idxf = g.ggml_get_rows(ctx, ar, ids)  # [1, k, b]: the experts' indices as floats (exact)
        return ({"p": (p, (b, n), "f32"), "ar": (ar, (b, n), "f32")},
                [g.ggml_cont(ctx, g.ggml_reshape_2d(ctx, idxf, k, b)), g.ggml_cont(ctx, g.ggml_reshape_2d(ctx, w, k, b))])

    def __call__(self, probs: np.ndarray, n_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        p = np.ascontiguousarray(probs, dtype=np.float32)
        if p.ndim != 2 or p.shape[1] != self.ex.n_expert:
            raise KernelError(f"router rows must be [n, {self.ex.n_expert}], got {p.shape}")
        ar = self._ar

        def fill(v: dict[str, np.ndarray], s: int, e: int) -> None:
            v["p"][: e - s] = p[s:e]
            v["ar"][:] = ar

        ids, w = self._run(p.shape[0], n_threads, fill, 2)
        return ids.astype(np.int64), w


class AttnOutMoE(AttnOut):
    """``AttnOut`` with the layer's routed MoE in the same graph, for a layer whose every expert is
    computed here: ``x[n, d]`` (the residual) and ``a`` -> ``x + W_o a`` -> router probabilities ->
    top-k, weights (renormalised as ``Transformer.select_np``: the sum in double, one float32
    division; ``ggml_sum_rows`` accumulates in double) -> the experts (``mul_mat_id``, as
    ``GgmlExpertKernel``) -> each output times its weight -> added into a zero row in ascending
    expert order (the slots ordered by ``argsort`` of the experts' indices) -> (+ the shared expert)
    -> the new residual (gpt-oss: the top-k softmax gate, biases added with ``add_id``, its clamped
    SwiGLU, as ``GgmlExpertKernel``; DeepSeek's groups: ``_gate_ops``). The bits of ``AttnOut``,
    ``select_np`` (else ``Gate``), ``ExpertKernel.combined`` and the
    adds in ``Transformer``, in one graph: a decode step's layer costs two graph calls instead of
    four and no Python in between. Returns ``(x_next, experts)``: each row's ``k`` experts,
    ascending (for the dispatcher's report). Exact ties in the top-k may pick another of the tied
    experts than numpy's stable sort (float32 probabilities: practically never)."""

    def __init__(self, *, experts: RoutedExperts, max_rows: int = 16, **kw: Any) -> None:
        kw["max_rows"] = max_rows
        family = kw.pop("family", None)
        super().__init__(family=None, **kw)
        e = experts
        if self._wr is None or self.n_expert != e.n_expert or self.softmax != (e.gating == "softmax"):
            raise KernelError("a fused MoE block needs its router over the layer's experts (softmax, or the "
                              "logits for a top-k softmax)")
        if e.activation not in ("silu", "swiglu_oai") or not 0 < e.k <= e.n_expert \
                or e.gating not in ("softmax", "softmax_topk"):
            raise KernelError(f"fused MoE: activation {e.activation!r}, gating {e.gating!r}, k {e.k} of {e.n_expert}")
        if e.n_group > 1 and (e.n_expert % e.n_group or not 0 < e.n_group_used <= e.n_group
                              or e.k > e.n_group_used * (e.n_expert // e.n_group)):
            raise KernelError(f"fused MoE: {e.n_group} groups ({e.n_group_used} used) do not fit {e.n_expert} experts, k {e.k}")
        d, f, n = self.d, e.width, e.n_expert
        self.ex = e
        self._we = tuple(self._dense3(HeadWeights(raw, t, n, out, inn), name, "mul_mat_id") for raw, t, out, inn, name in (
            (e.gate, e.types[0], f, d, "gate_exps"), (e.up, e.types[1], f, d, "up_exps"), (e.down, e.types[2], d, f, "down_exps")))
        self._eb = None if e.biases is None else tuple(
            self._dense(DenseWeight(_as_raw(bias, 4 * m * n, name), int(g.GGML_TYPE_F32), n, m), name)
            for bias, m, name in zip(e.biases, (f, f, d), ("gate_b", "up_b", "down_b"), strict=True))
        self.macs += e.k * 3 * d * f
        self.nodes = _NODES + 4 * e.k + 48
        self._ar = np.arange(n, dtype=np.float32)  # the "ar" input of every row: 0 .. n_expert-1
        self._share(family, (*self._sig, e.k, e.norm_topk, float(e.scale), e.activation, e.gating, e.n_group,
                             e.n_group_used, e.biases is not None))

    def _mem(self, b: int) -> int:
        e = self.ex
        return super()._mem(b) + 4 * b * (e.k * (4 * e.width + 4 * self.d + 8) + 2 * e.n_expert + 4 * self.d + 16)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        inputs, outs = super()._build(ctx, b)
        n, d = self.ex.n_expert, self.d
        ar = g.ggml_new_tensor_3d(ctx, g.GGML_TYPE_F32, 1, n, b)  # each row: 0, 1, .., n_expert-1
        zero = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, d, b)
        for t in (ar, zero):
            g.ggml_set_input(t)
        inputs["ar"] = (ar, (b, n), "f32")
        inputs["zero"] = (zero, (b, d), "f32")
        return inputs, list(self.moe_ops(ctx, outs, ar, zero, b))

    def moe_ops(self, ctx: Any, outs: list[Any], ar: Any, zero: Any, b: int) -> tuple[Any, Any]:
        """The MoE on ``AttnOut.ops``'s ``outs``, with the inputs ``ar [1, n_expert, b]`` (each row 0 ..
        n_expert-1) and ``zero [d, b]`` (zeros): ``(x_next [d, b], experts [k, b] as floats, ascending)``."""
        x2, h, probs = outs[0], outs[1], outs[2]
        shared = outs[3] if self._sh is not None else None
        e, d, k = self.ex, self.d, self.ex.k
        ids, w = _gate_ops(ctx, probs, b, e)
        xp = g.ggml_reshape_3d(ctx, h, d, 1, b)
        wg, wu, wd = self._we
        gt = g.ggml_mul_mat_id(ctx, wg, xp, ids)  # [f, k, b]
        ut = g.ggml_mul_mat_id(ctx, wu, xp, ids)
        if self._eb is not None:  # as GgmlExpertKernel: add_id after each projection
            ut = g.ggml_add_id(ctx, ut, self._eb[1], ids)
            gt = g.ggml_add_id(ctx, gt, self._eb[0], ids)
        act = (g.ggml_swiglu_oai(ctx, gt, ut, ctypes.c_float(OAI_ALPHA), ctypes.c_float(OAI_LIMIT))
               if e.activation == "swiglu_oai" else g.ggml_swiglu_split(ctx, gt, ut))
        y = g.ggml_mul_mat_id(ctx, wd, act, ids)  # [d, k, b]
        if self._eb is not None:
            y = g.ggml_add_id(ctx, y, self._eb[2], ids)
        yw = g.ggml_mul(ctx, y, w)
        idxf, order = _ascending(ctx, ar, ids, k, b)
        ywa = g.ggml_get_rows(ctx, yw, order)  # [d, k, b], slots in ascending expert order
        acc = zero
        nb1, nb2 = ywa.contents.nb[1], ywa.contents.nb[2]
        for j in range(k):
            acc = g.ggml_add(ctx, acc, g.ggml_view_2d(ctx, ywa, d, b, nb2, j * nb1))
        if shared is not None:  # llama.cpp: (routed + shared) + residual
            acc = g.ggml_add(ctx, acc, shared)
        xn = g.ggml_add(ctx, x2, acc)
        sorted_ids = g.ggml_get_rows(ctx, idxf, order)  # [1, k, b]
        return xn, g.ggml_cont(ctx, sorted_ids)

    def moe_ops_rows(self, ctx: Any, outs: list[Any], ar: Any, zero: Any, b: int, sel: Any, n_sel: int
                     ) -> tuple[Any, Any]:
        """``moe_ops`` with the experts and the combine on the rows ``sel`` only (``[n_sel]`` int32, of the
        ``b`` rows), as llama.cpp's last layer computes only the rows whose logits are asked for; the
        router's top-k still for all ``b`` (the dispatcher hears of every row's experts). Returns
        ``(x_next [d, n_sel], experts [k, b] as floats, ascending)``; a selected row's bits are
        ``moe_ops``'s (every op here is per row, the kernels batch-invariant)."""
        e = self.ex
        ids, _ = _gate_ops(ctx, outs[2], b, e)
        idxf, order = _ascending(ctx, ar, ids, e.k, b)
        experts = g.ggml_cont(ctx, g.ggml_get_rows(ctx, idxf, order))
        picked = [g.ggml_get_rows(ctx, t, sel) for t in outs]  # x2, h, probs (, shared): [*, n_sel]
        ar_sel = g.ggml_view_3d(ctx, ar, 1, e.n_expert, n_sel, ar.contents.nb[1], ar.contents.nb[2], 0)
        zero_sel = g.ggml_view_2d(ctx, zero, self.d, n_sel, zero.contents.nb[1], 0)
        xn, _ = self.moe_ops(ctx, picked, ar_sel, zero_sel, n_sel)
        return xn, experts

    def __call__(self, a: np.ndarray, x: np.ndarray, n_threads: int = 1  # type: ignore[override]
                 ) -> tuple[np.ndarray, np.ndarray]:
        """``(x_next [n, d], experts [n, k] int64, ascending per row)``."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if a.ndim != 2 or a.shape[1] != self.a or x.shape != (a.shape[0], self.d):
            raise KernelError(f"a must be [n, {self.a}] and x [n, {self.d}], got {a.shape} and {x.shape}")
        ar = self._ar

        def fill(v: dict[str, np.ndarray], s: int, e: int) -> None:
            v["a"][: e - s] = a[s:e]
            v["x"][: e - s] = x[s:e]
            v["ar"][:] = ar

        xn, ids = self._run(a.shape[0], n_threads, fill, 2)
        return xn, ids.astype(np.int64)


class Head(_Graphs):
    """``x[n, d]`` -> ``W_out (RMSNorm(x) * output_norm)`` ``[n, n_vocab]``."""

    def __init__(self, *, output_norm: np.ndarray, output: DenseWeight, eps: float, max_rows: int = 256) -> None:
        super().__init__(max_rows)
        self.d, self.n_vocab, self.eps = output.in_features, output.out_features, float(eps)
        self._norm = self._vec(output_norm, self.d, "output_norm")
        self._w = self._dense(output, "output")
        self.macs = self.d * self.n_vocab

    def _mem(self, b: int) -> int:
        return 4 * b * (4 * self.d + self.n_vocab)

    def _build(self, ctx: Any, b: int) -> tuple[dict[str, tuple[Any, tuple[int, ...], str]], list[Any]]:
        x = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, self.d, b)
        g.ggml_set_input(x)
        return {"x": (x, (b, self.d), "f32")}, [self.ops(ctx, x)]

    def ops(self, ctx: Any, x: Any) -> Any:
        """The graph's ops on a given ``x [d, b]``: the logits ``[n_vocab, b]``."""
        return g.ggml_mul_mat(ctx, self._w, _rms(ctx, x, self._norm, self.eps))

    def __call__(self, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.d:
            raise KernelError(f"x must be [n, {self.d}], got {x.shape}")

        def fill(v: dict[str, np.ndarray], s: int, e: int) -> None:
            v["x"][: e - s] = x[s:e]

        return self._run(x.shape[0], n_threads, fill, 1)[0]
