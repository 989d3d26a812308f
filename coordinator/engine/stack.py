"""A decode step's layers as one ggml graph (shell over native code), as llama.cpp computes its forward.

When every layer of a step is computed here (the idle path: the expert backend's ``whole_layer_here``
for every MoE layer), the engine runs the step as one graph instead of four per layer with Python,
ctypes and numpy between them: the token ids' embedding rows (``get_rows``), then per layer the ops of ``AttnIn``/``MlaIn`` (norm, q/k/v, q/k norms,
RoPE), the new K/V rows written into each sequence's cache (``ggml_cpy`` into views of it, f32 -> the
cache's type, as llama.cpp writes its cache), the attention of each sequence (``Attention``'s ops on
in-place views of its cache), and the ops of ``AttnOutMoE`` (output projection, residual, router,
top-k, experts, combine) or, in a dense block, ``AttnOut`` and its FFN; then ``Head``'s ops on every row.

A step where some expert layers may go elsewhere runs each run of consecutive local layers (a
*segment*, between two remote layers) as one graph from the residual rows to the next residual; a
remote layer ends a segment and runs on the per-layer graphs (its routed-expert inputs go to the
dispatcher, its combine is the next segment's input).

Rules:
- The same ops on the same shapes as the per-layer graphs, hence the same bits (tested against the
  per-layer path on every architecture it covers, f32 and f16 caches, 1-16 sequences). Each layer's
  ops come from its own block object (``ops``/``moe_ops``), on its own weight leaves: a leaf a family
  re-points (``_Graphs._bind``) is pointed back at its own weights before every compute.
- Decode-sized steps only: each sequence's rows <= ``MAX_SEQ_ROWS`` (their attention then has the
  exact row count the per-layer path uses: ``_bucket(n) == n``), all rows <= the fused MoE's bucket.
- Built once per (layers, row bucket, rows and context of each sequence, cache type, threads) and reused:
  per step only data is rebound, never a graph rebuilt. The rows' token ids and positions and
  each sequence's causal mask are written into input tensors; the cache writes' destinations
  (``tensor->data`` of the ``ggml_cpy`` nodes) move to the step's positions; the attention's
  cache views, mask, scores and softmax take the step's ``n_kv`` (the used rows rounded up to
  ``KV_PAD``) by setting their ``ne``/``nb`` -- their memory is sized for the whole context.
- Memory: ggml's graph allocator (``ggml_gallocr``) places the intermediate tensors, reusing
  memory across layers as llama.cpp does; inputs and outputs are never reused (flagged output).
- The cache writes are ordered before the attention that reads them: each layer's ``ggml_cpy``
  nodes join the graph before its attention's nodes (ggml computes nodes in graph order).
- One graph computes on the calling thread's persistent ggml threadpool (``_Plan.compute``).
"""

from __future__ import annotations

import ctypes
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import ggml.ggml as g
import numpy as np

from coordinator.engine.block import Attention, AttnIn, AttnOut, AttnOutMoE, DenseWeight, Head, MlaIn, _Graphs
from swarm.errors import KernelError
from swarm.model.kernels.ggml import (
    _as_raw,
    _bucket,
    _Ctx,
    _f32_view,
    _i32_view,
    _Plan,
    _type_id,
    _weight_tensor,
    row_nbytes,
)

__all__ = ["MAX_SEQ_ROWS", "LayerSpec", "StackGraph"]

MAX_SEQ_ROWS = 8  # rows of one sequence in a stacked step (the attention's bucket is then exact)

# ggml-python 0.0.45 declares this function's result as a NewType of int, so ctypes truncates the pointer
# to 32 bits (a segfault in ggml_gallocr_new): our own prototype returns the whole pointer
_cpu_buffer_type = ctypes.CFUNCTYPE(ctypes.c_void_p)(("ggml_backend_cpu_buffer_type", g.lib))


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the stack: its input half, and either its fused MoE half (``moe`` with its expert
    layer index) or a dense block's ``AttnOut`` (its FFN as the shared output); ``window`` > 0: a
    sliding-window layer."""

    attn_in: AttnIn | MlaIn
    moe: AttnOutMoE | None
    moe_layer: int | None
    dense: AttnOut | None
    window: int = 0


class _Seq:
    """One sequence's tensors in a built graph: per layer the cache-write nodes and the attention's
    cache views, scores and softmax (structs taken once), and a mask per window."""

    def __init__(self, n: int, n_ctx: int) -> None:
        self.n, self.n_ctx = n, n_ctx
        self.kdst: list[Any] = []  # ggml_cpy results (views of the cache): data = where the rows go
        self.vdst: list[Any] = []
        self.kread: list[Any] = []  # [hdk, n_kv, Hkv] strided views of the K cache
        self.vread: list[Any] = []  # [n_kv, hdv, Hkv] of the transposed V cache
        self.scores: list[Any] = []  # kq and its softmax [n_kv, n, H]
        self.masks: dict[int, tuple[Any, np.ndarray]] = {}  # window -> (mask tensor, its memory as float32)
        self.bound: tuple[int, int] | None = None  # the (K, V) cache addresses the views point into
        self.n_kv = -1


class _Built:
    def __init__(self, ctx: _Ctx, galloc: Any, plan: _Plan, x: np.ndarray, pos: np.ndarray, out: np.ndarray,
                 ids: list[tuple[int, np.ndarray]], seqs: list[_Seq]) -> None:
        self.ctx, self.galloc, self.plan = ctx, galloc, plan
        self.x, self.pos, self.out, self.ids, self.seqs = x, pos, out, ids, seqs
        self.consts: list[tuple[np.ndarray, np.ndarray | float]] = []

    def free(self) -> None:
        if self.galloc:
            g.ggml_gallocr_free(self.galloc)
            self.galloc = None
        self.ctx.free()


def _set_shape(st: Any, ne: tuple[int, ...], nb: tuple[int, ...]) -> None:
    for i, v in enumerate(ne):
        st.ne[i] = v
    for i, v in enumerate(nb):
        st.nb[i] = v


class StackGraph:
    """A decode step in one graph, from token ids to logits: the embedding's rows (``get_rows`` on the
    stored table, as ``swarm.model.kernels.ggml.GgmlGetRows``), every layer, the head (``Head``'s ops,
    on every row). Returns ``(logits [n, n_vocab], [(expert layer, experts [n, k] int64, ascending)])``."""

    def __init__(self, layers: list[LayerSpec], attn: Attention, head: Head, embd: DenseWeight, *, max_rows: int,
                 max_graphs: int = 16) -> None:
        if not layers:
            raise KernelError("a stack needs layers")
        d = embd.in_features
        if head.d != d:
            raise KernelError("the embedding and the head differ in width")
        self.layers, self.attn, self.head, self.d, self.n_vocab = layers, attn, head, d, head.n_vocab
        self.max_rows, self.max_graphs = int(max_rows), int(max_graphs)
        self.macs = sum(s.attn_in.macs + (s.moe.macs if s.moe is not None else s.dense.macs if s.dense is not None else 0)
                        for s in layers) + head.macs
        tid = _type_id(embd.qtype)
        self._embd_raw = _as_raw(embd.raw, row_nbytes(tid, d) * embd.out_features, "token_embd")
        self._wctx = _Ctx(4 * g.ggml_tensor_overhead() + 1024, no_alloc=True)
        self._embd = _weight_tensor(self._wctx, tid, (d, embd.out_features), self._embd_raw, "token_embd")
        blocks: list[_Graphs] = [head]
        for s in layers:
            blocks += [s.attn_in] + [b for b in (s.moe, s.dense) if b is not None]
        # the family builders among the layers' blocks: their leaves may point at another member's weights
        self._builders = [b for b in dict.fromkeys(blocks) if b._builder is b]
        self._locks = list(dict.fromkeys(b._lock for b in blocks))
        moe = [s.moe for s in layers if s.moe is not None]
        self._n_expert = moe[0].ex.n_expert if moe else 0
        if any(m.ex.n_expert != self._n_expert for m in moe):
            raise KernelError("a stack's MoE layers must have one expert count")
        self._graphs: dict[tuple[Any, ...], _Built] = {}

    def fits(self, rows: list[int]) -> bool:
        return sum(rows) <= self.max_rows and all(0 < n <= MAX_SEQ_ROWS for n in rows)

    # -- build ------------------------------------------------------------------------------------
    def _build(self, span: tuple[int, int], ns: tuple[int, ...], n_ctxs: tuple[int, ...], tid: int, n_threads: int,
               ptrs: list[tuple[list[int], list[int]]]) -> _Built:
        at, d = self.attn, self.d
        H, Hkv, hdk, hdv = at.H, at.Hkv, at.hdk, at.hdv
        es = 2 if tid == g.GGML_TYPE_F16 else 4
        b = _bucket(sum(ns), self.max_rows)
        n_tok = sum(ns)
        lo, hi = span
        whole = span == (0, len(self.layers))
        n_layer, n_seq = hi - lo, len(ns)
        k_max = max((s.moe.ex.k for s in self.layers if s.moe is not None), default=0)
        nodes = 64 + n_layer * (160 + 4 * k_max + 24 * n_seq)
        ctx = _Ctx(2 * nodes * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(nodes, False) + 4096,
                   no_alloc=True)
        c = ctx.ctx
        graph = g.ggml_new_graph_custom(c, nodes, False)
        keep: list[Any] = []  # inputs and outputs: never reused by the allocator

        def io(t: Any) -> Any:
            g.ggml_set_input(t)
            g.ggml_set_output(t)
            keep.append(t)
            return t

        if whole:  # token ids in
            tok = io(g.ggml_new_tensor_1d(c, g.GGML_TYPE_I32, b))
            x = g.ggml_get_rows(c, self._embd, tok)  # [d, b]
        else:  # a segment: the residual rows in
            tok = x = io(g.ggml_new_tensor_2d(c, g.GGML_TYPE_F32, d, b))
        pos = io(g.ggml_new_tensor_1d(c, g.GGML_TYPE_I32, b))
        moe = any(s.moe is not None for s in self.layers[lo:hi])  # (inputs no node reads get no memory)
        ar = io(g.ggml_new_tensor_3d(c, g.GGML_TYPE_F32, 1, self._n_expert, b)) if moe else None
        zero = io(g.ggml_new_tensor_2d(c, g.GGML_TYPE_F32, d, b)) if moe else None
        seqs = [_Seq(n, n_ctx) for n, n_ctx in zip(ns, n_ctxs, strict=True)]
        windows = sorted({s.window for s in self.layers[lo:hi]})
        for sq in seqs:
            for w in windows:
                sq.masks[w] = (io(g.ggml_new_tensor_2d(c, g.GGML_TYPE_F32, sq.n_ctx, sq.n)), np.empty(0, np.float32))
        ids_out: list[tuple[int, Any]] = []
        cur = x
        for li in range(lo, hi):
            spec = self.layers[li]
            q, k, v = spec.attn_in.ops(c, cur, pos, b)
            outs = []
            s0 = 0
            for si, sq in enumerate(seqs):
                n, n_ctx = sq.n, sq.n_ctx
                kptr, vptr = ptrs[si][0][li], ptrs[si][1][li]
                # the new rows into the caches (K rows [Hkv*hdk]; V transposed: [n, hdv, Hkv] over positions)
                krows = g.ggml_view_2d(c, k, Hkv * hdk, n, k.contents.nb[2], s0 * k.contents.nb[2])
                kd = g.ggml_new_tensor_2d(c, tid, Hkv * hdk, n)
                kd.contents.data = kptr
                vrows = g.ggml_view_3d(c, v, hdv, Hkv, n, hdv * 4, v.contents.nb[1], s0 * v.contents.nb[1])
                vd = g.ggml_new_tensor_3d(c, tid, n, hdv, Hkv)
                _set_shape(vd.contents, (n, hdv, Hkv), (es, n_ctx * es, hdv * n_ctx * es, Hkv * hdv * n_ctx * es))
                vd.contents.data = vptr
                kc = g.ggml_cpy(c, krows, kd)
                vc = g.ggml_cpy(c, g.ggml_permute(c, vrows, 1, 2, 0, 3), vd)
                g.ggml_build_forward_expand(graph, kc)
                g.ggml_build_forward_expand(graph, vc)
                sq.kdst.append(kc.contents)
                sq.vdst.append(vc.contents)
                # the attention over the whole context's views; n_kv is set per step
                kr = g.ggml_new_tensor_3d(c, tid, hdk, n_ctx, Hkv)
                _set_shape(kr.contents, (hdk, n_ctx, Hkv), (es, Hkv * hdk * es, hdk * es, Hkv * hdk * es * n_ctx))
                kr.contents.data = kptr
                vt = g.ggml_new_tensor_3d(c, tid, n_ctx, hdv, Hkv)
                _set_shape(vt.contents, (n_ctx, hdv, Hkv), (es, n_ctx * es, hdv * n_ctx * es, Hkv * hdv * n_ctx * es))
                vt.contents.data = vptr
                qs = g.ggml_view_3d(c, q, hdk, H, n, q.contents.nb[1], q.contents.nb[2], s0 * q.contents.nb[2])
                kq = g.ggml_mul_mat(c, kr, g.ggml_permute(c, qs, 0, 2, 1, 3))  # [n_ctx, n, H]
                sm = g.ggml_soft_max_ext(c, kq, sq.masks[spec.window][0], ctypes.c_float(at.scale), ctypes.c_float(0.0))
                kqv = g.ggml_mul_mat(c, vt, sm)  # [hdv, n, H]
                outs.append(g.ggml_cont(c, g.ggml_permute(c, kqv, 0, 2, 1, 3)))  # [hdv, H, n]
                sq.kread.append(kr.contents)
                sq.vread.append(vt.contents)
                sq.scores += [kq.contents, sm.contents]
                s0 += n
            a = outs[0]
            for o in outs[1:]:
                a = g.ggml_concat(c, a, o, 2)
            a = g.ggml_reshape_2d(c, a, H * hdv, n_tok)
            if n_tok < b:  # padding rows (zeros): the bucket the per-layer graphs compute
                a = g.ggml_pad(c, a, 0, b - n_tok, 0, 0)
            if spec.moe is not None and spec.moe_layer is not None:
                xo, ids = spec.moe.moe_ops(c, spec.moe.ops(c, a, cur, b), ar, zero, b)
                g.ggml_set_output(ids)
                ids_out.append((spec.moe_layer, ids))
                cur = xo
            else:
                assert spec.dense is not None
                o = spec.dense.ops(c, a, cur, b)
                cur = g.ggml_add(c, o[0], o[-1])  # a dense block: x2 + its FFN
        logits = self.head.ops(c, cur) if whole else cur  # [n_vocab, b] or the residual [d, b]
        g.ggml_set_output(logits)
        g.ggml_build_forward_expand(graph, logits)
        for _, t in ids_out:
            g.ggml_build_forward_expand(graph, t)
        galloc = g.ggml_gallocr_new(_cpu_buffer_type())
        if not galloc or not g.ggml_gallocr_alloc_graph(galloc, graph):
            if galloc:
                g.ggml_gallocr_free(galloc)
            ctx.free()
            raise MemoryError("ggml_gallocr_alloc_graph failed")
        built = _Built(ctx, galloc, _Plan(ctx, graph, n_threads, 0),
                       _i32_view(tok, (b,)) if whole else _f32_view(tok, (b, d)), _i32_view(pos, (b,)),
                       _f32_view(logits, (b, self.n_vocab if whole else d)), [(ml, _f32_view(t, (b, int(g.ggml_nelements(t)) // b))) for ml, t in ids_out],
                       seqs)
        built.x[:] = 0
        built.pos[:] = 0
        if ar is not None and zero is not None:
            built.consts = [(_f32_view(ar, (b, self._n_expert)), np.arange(self._n_expert, dtype=np.float32)),
                            (_f32_view(zero, (b, d)), 0.0)]
        for sq in seqs:
            for w, (t, _) in list(sq.masks.items()):
                mem = _f32_view(t, (sq.n * sq.n_ctx,))
                mem[:] = 0
                sq.masks[w] = (t.contents, mem)
        return built

    # -- compute ----------------------------------------------------------------------------------
    def __call__(self, tokens: np.ndarray, pos: np.ndarray, seqs: list[tuple[int, int, np.ndarray, np.ndarray]],
                 n_threads: int, rows: np.ndarray | None = None, span: tuple[int, int] | None = None
                 ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """``tokens [n]`` (in range), ``pos [n]``; ``rows``: the rows whose logits to return (default all).
        ``span`` ``(lo, hi)``, not all layers: a segment, layers ``lo .. hi-1`` only, from the residual
        rows ``tokens [n, d]`` (float32) to the next residual ``[n, d]`` (``rows`` unused).
        ``seqs`` per sequence (in row order): ``(rows, first
        position, K cache [n_layer, n_ctx, Hkv, hdk], V cache [n_layer, Hkv, hdv, n_ctx])``, caches
        C-contiguous, of one type, already holding zeros past the step's rows (``KVCache.begin``)."""
        ns = tuple(n for n, *_ in seqs)
        n_tok = sum(ns)
        n_all = len(self.layers)
        span = (0, n_all) if span is None else span
        lo, hi = span
        whole = span == (0, n_all)
        if not 0 <= lo < hi <= n_all:
            raise KernelError(f"layers {lo}..{hi} are not a segment of {n_all}")
        want = (n_tok,) if whole else (n_tok, self.d)
        if tokens.shape != want or pos.shape != (n_tok,) or not self.fits(list(ns)):
            raise KernelError(f"a stack step of {ns} rows does not fit {tokens.shape}")
        if whole and n_tok and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            raise KernelError(f"token id out of range 0..{self.n_vocab - 1}")
        dt = {kc.dtype for _, _, kc, _ in seqs} | {vc.dtype for _, _, _, vc in seqs}
        if len(dt) != 1 or next(iter(dt)) not in (np.float16, np.float32):
            raise KernelError(f"KV caches of one type (f16 or f32), got {dt}")
        tid = g.GGML_TYPE_F16 if next(iter(dt)) == np.float16 else g.GGML_TYPE_F32
        at, n_layer = self.attn, hi - lo
        for _, p0, kc, vc in seqs:
            if kc.shape[0] != n_all or kc.shape[2:] != (at.Hkv, at.hdk) or vc.shape != (n_all, at.Hkv, at.hdv, kc.shape[1]) \
                    or not kc.flags.c_contiguous or not vc.flags.c_contiguous or p0 < 0:
                raise KernelError("stack caches do not match the attention's shapes")
        n_ctxs = tuple(int(kc.shape[1]) for _, _, kc, _ in seqs)
        key = (span, ns, n_ctxs, int(tid), n_threads)
        built = self._graphs.get(key)
        es = 2 if tid == g.GGML_TYPE_F16 else 4
        if built is None:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs))).free()
            ptrs = [([kc.ctypes.data + li * kc[0].nbytes for li in range(n_all)],
                     [vc.ctypes.data + li * vc[0].nbytes for li in range(n_all)]) for _, _, kc, vc in seqs]
            built = self._graphs[key] = self._build(span, ns, n_ctxs, int(tid), n_threads, ptrs)
        built.x[:n_tok] = tokens
        built.pos[:n_tok] = pos
        for view, value in built.consts:  # rewritten every step: no allocator reuse can leave them stale
            view[:] = value
        H = at.H
        for sq, (n, p0, kc, vc) in zip(built.seqs, seqs, strict=True):
            used, n_ctx = p0 + n, sq.n_ctx
            if used > n_ctx:
                raise KernelError("rows beyond the cache")
            kl, vl = kc[0].nbytes, vc[0].nbytes
            kbase, vbase = kc.ctypes.data + lo * kl, vc.ctypes.data + lo * vl  # the segment's first layer
            if sq.bound != (kbase, vbase):  # another sequence's caches: the views move
                for li in range(n_layer):
                    sq.kread[li].data = kbase + li * kl
                    sq.vread[li].data = vbase + li * vl
                sq.bound = (kbase, vbase)
            krow = at.Hkv * at.hdk * es
            for li in range(n_layer):
                sq.kdst[li].data = kbase + li * kl + p0 * krow
                sq.vdst[li].data = vbase + li * vl + p0 * es
            n_kv = at.n_kv(used, n_ctx)
            if n_kv != sq.n_kv:
                nb_k = (es, at.Hkv * at.hdk * es, at.hdk * es, at.Hkv * at.hdk * es * n_kv)
                for li in range(n_layer):
                    kr, vt = sq.kread[li], sq.vread[li]
                    kr.ne[1] = n_kv
                    kr.nb[3] = nb_k[3]
                    vt.ne[0] = n_kv
                for st in sq.scores:
                    _set_shape(st, (n_kv, n, H), (4, 4 * n_kv, 4 * n_kv * n, 4 * n_kv * n * H))
                for mt, _ in sq.masks.values():
                    _set_shape(mt, (n_kv, n), (4, 4 * n_kv, 4 * n_kv * n, 4 * n_kv * n))
                sq.n_kv = n_kv
            for w, (_, mem) in sq.masks.items():
                mem[: n * n_kv] = at._mask(n, p0, used, n_kv, w).reshape(-1)
        with ExitStack() as es_:
            for lock in self._locks:
                es_.enter_context(lock)
            for blk in self._builders:
                blk._bind()
            built.plan.compute(n_threads)
        out = built.out[:n_tok].copy() if rows is None else built.out[rows]
        return out, [(ml, v[:n_tok].astype(np.int64)) for ml, v in built.ids]

    def close(self) -> None:
        for b in self._graphs.values():
            b.free()
        self._graphs.clear()
        self._wctx.free()
