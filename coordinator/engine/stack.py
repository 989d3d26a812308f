"""A step's layers as one ggml graph (shell over native code), as llama.cpp computes its forward.

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
- Decode steps and prefill chunks alike: each sequence's rows take a *slot* of the graph's rows, cut
  as the per-layer attention cuts them (``Attention``: blocks of its ``max_rows``, the last one
  bucketed, ``_bucket``); its rows first, then the padding rows of its last block, whose results
  nobody reads (every op but the attention is row by row; the attention of a padding row is its
  own, its mask the block's last row's). Each block's attention has the per-layer path's shapes. All
  slots together <= ``max_rows``. The head computes the rows asked for only (``get_rows`` of them,
  as many as the per-layer head's bucket).
- Built once per (layers, blocks and context of each sequence, cache type, threads, head rows) and
  reused, least recently used dropped past ``max_graphs`` or ``max_bytes`` of allocator memory: per
  step only data is rebound, never a graph rebuilt. The rows' token ids and positions and
  each block's causal mask are written into input tensors; the cache writes' destinations
  (``tensor->data`` of the ``ggml_cpy`` nodes) move to the step's positions and take the step's row
  count (a prefill chunk of any length in its bucket: ``ne`` of the cpy nodes and their views); the
  attention's cache views, mask, scores and softmax take the step's ``n_kv`` (the used rows rounded
  up to ``KV_PAD``) by setting their ``ne``/``nb`` -- their memory is sized for the whole context.
- gpt-oss's attention sinks: each layer's sink logits join its softmax (``ggml_soft_max_add_sinks``,
  as ``Attention``'s).
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

from coordinator.engine.attention import Attention
from coordinator.engine.block import AttnIn, AttnOut, AttnOutMoE, DenseWeight, Head, MlaIn, _Graphs
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

__all__ = ["LayerSpec", "StackGraph"]

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
    sinks: np.ndarray | None = None  # gpt-oss: one attention-sink logit per head


class _Blk:
    """One attention block of a sequence (the per-layer path's: ``Attention.many`` on up to its
    ``max_rows`` rows, bucketed): per layer its cache views and scores (structs taken once), a mask
    per window."""

    def __init__(self, b: int, start: int) -> None:
        self.b, self.start = b, start  # graph rows; its first row within the sequence
        self.kread: list[Any] = []  # [hdk, n_kv, Hkv] strided views of the K cache
        self.vread: list[Any] = []  # [n_kv, hdv, Hkv] of the transposed V cache
        self.scores: list[Any] = []  # kq and its softmax [n_kv, b, H]
        self.masks: dict[int, tuple[Any, np.ndarray]] = {}  # window -> (mask tensor, its memory as float32)
        self.n_kv = -1


class _Seq:
    """One sequence's tensors in a built graph: its slot of graph rows (its rows, then its last block's
    padding), per layer the cache-write nodes (and the views whose row count a step sets), its blocks."""

    def __init__(self, blocks: tuple[int, ...], cap: int, n_ctx: int, off: int) -> None:
        self.n_ctx, self.off = n_ctx, off
        self.blocks = [_Blk(b, j * cap) for j, b in enumerate(blocks)]
        self.slot = sum(blocks)
        self.kdst: list[Any] = []  # ggml_cpy results (views of the cache): data = where the rows go
        self.vdst: list[Any] = []
        self.krows: list[tuple[Any, ...]] = []  # per layer (k rows view, K destination) [Hkv*hdk, n]
        self.vrows: list[tuple[Any, ...]] = []  # per layer (v rows view [hdv, Hkv, n], its permutation, V destination)
        self.n = -1  # the rows the cache writes are shaped for
        self.bound: tuple[int, int] | None = None  # the (K, V) cache addresses the views point into


class _Built:
    def __init__(self, ctx: _Ctx, galloc: Any, plan: _Plan, x: np.ndarray, pos: np.ndarray, out: np.ndarray,
                 ids: list[tuple[int, np.ndarray]], seqs: list[_Seq], sel: np.ndarray | None) -> None:
        self.ctx, self.galloc, self.plan = ctx, galloc, plan
        self.x, self.pos, self.out, self.ids, self.seqs, self.sel = x, pos, out, ids, seqs, sel
        self.nbytes = int(g.ggml_gallocr_get_buffer_size(galloc, 0)) if galloc else 0

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


def _set_rows(st: Any, dim: int, n: int) -> None:
    """Tensor ``st`` with ``n`` along ``dim`` (its later strides follow when they are packed)."""
    st.ne[dim] = n
    for i in range(dim + 1, 4):
        st.nb[i] = st.nb[i - 1] * st.ne[i - 1]


class StackGraph:
    """A step in one graph, from token ids to logits: the embedding's rows (``get_rows`` on the
    stored table, as ``swarm.model.kernels.ggml.GgmlGetRows``), every layer, the head (``Head``'s ops,
    on the rows asked for). Returns ``(logits [rows, n_vocab], [(expert layer, experts [n, k] int64,
    ascending)])``."""

    def __init__(self, layers: list[LayerSpec], attn: Attention, head: Head, embd: DenseWeight, *, max_rows: int,
                 max_graphs: int = 16, max_bytes: int = 768 << 20) -> None:
        if not layers:
            raise KernelError("a stack needs layers")
        d = embd.in_features
        if head.d != d:
            raise KernelError("the embedding and the head differ in width")
        self.layers, self.attn, self.head, self.d, self.n_vocab = layers, attn, head, d, head.n_vocab
        self.max_rows, self.max_graphs, self.max_bytes = int(max_rows), int(max_graphs), int(max_bytes)
        self.macs = sum(s.attn_in.macs + (s.moe.macs if s.moe is not None else s.dense.macs if s.dense is not None else 0)
                        for s in layers) + head.macs
        tid = _type_id(embd.qtype)
        self._embd_raw = _as_raw(embd.raw, row_nbytes(tid, d) * embd.out_features, "token_embd")
        self._wctx = _Ctx((4 + len(layers)) * g.ggml_tensor_overhead() + 1024, no_alloc=True)
        self._embd = _weight_tensor(self._wctx, tid, (d, embd.out_features), self._embd_raw, "token_embd")
        self._sinks: list[Any] = []  # per layer: its sinks as a leaf [H] (None without)
        self._keep: list[np.ndarray] = []
        for s in layers:
            if s.sinks is None:
                self._sinks.append(None)
                continue
            arr = np.ascontiguousarray(s.sinks, dtype=np.float32).reshape(-1)
            if arr.shape != (attn.H,):
                raise KernelError(f"sinks must be {attn.H} float32 values")
            self._keep.append(arr)
            st = g.ggml_new_tensor_1d(self._wctx.ctx, g.GGML_TYPE_F32, attn.H)
            st.contents.data = arr.ctypes.data
            self._sinks.append(st)
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

    def blocks(self, n: int) -> tuple[int, ...]:
        """A sequence's ``n`` rows as the per-layer attention takes them: blocks of its ``max_rows``, the
        last bucketed (``_bucket``)."""
        cap = self.attn.max_rows
        full, rem = divmod(n, cap)
        return (cap,) * full + ((_bucket(rem, cap),) if rem else ())

    def fits(self, rows: list[int]) -> bool:
        return all(n > 0 for n in rows) and sum(sum(self.blocks(n)) for n in rows) <= self.max_rows

    # -- build ------------------------------------------------------------------------------------
    def _build(self, span: tuple[int, int], blks: tuple[tuple[int, ...], ...], ns: tuple[int, ...],
               n_ctxs: tuple[int, ...], tid: int, n_threads: int, n_sel: int,
               ptrs: list[tuple[list[int], list[int]]]) -> _Built:
        at, d = self.attn, self.d
        H, Hkv, hdk, hdv = at.H, at.Hkv, at.hdk, at.hdv
        es = 2 if tid == g.GGML_TYPE_F16 else 4
        lo, hi = span
        whole = span == (0, len(self.layers))
        seqs: list[_Seq] = []
        off = 0
        for bl, n_ctx in zip(blks, n_ctxs, strict=True):
            seqs.append(_Seq(bl, at.max_rows, n_ctx, off))
            off += seqs[-1].slot
        b = off  # the graph's rows: every sequence's slot
        n_layer, n_blk = hi - lo, sum(len(sq.blocks) for sq in seqs)
        k_max = max((s.moe.ex.k for s in self.layers if s.moe is not None), default=0)
        nodes = 128 + n_layer * (160 + 4 * k_max + 12 * len(seqs) + 16 * n_blk)
        ctx = _Ctx(2 * nodes * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(nodes, False) + 4096,
                   no_alloc=True)
        c = ctx.ctx
        graph = g.ggml_new_graph_custom(c, nodes, False)

        def io(t: Any) -> Any:  # inputs and outputs: never reused by the allocator
            g.ggml_set_input(t)
            g.ggml_set_output(t)
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
        windows = sorted({s.window for s in self.layers[lo:hi]})
        for sq in seqs:
            for bk in sq.blocks:
                for w in windows:
                    bk.masks[w] = (io(g.ggml_new_tensor_2d(c, g.GGML_TYPE_F32, sq.n_ctx, bk.b)), np.empty(0, np.float32))
        ids_out: list[tuple[int, Any]] = []
        # the rows asked for (the per-layer path's head takes only them); as llama.cpp, the last layer
        # computes its FFN on them alone (its attention, KV writes and router on every row) -- unless
        # their bucket is no smaller than the graph's rows (a few 1-row sequences beside a drafted one:
        # 5 rows asked for, bucket 8, in 6 graph rows), then the head takes them after it
        sel = io(g.ggml_new_tensor_1d(c, g.GGML_TYPE_I32, n_sel)) if whole and n_sel else None
        narrow = sel is not None and n_sel < b
        cur = x
        for li in range(lo, hi):
            last = sel if narrow and li == hi - 1 else None
            spec = self.layers[li]
            q, k, v = spec.attn_in.ops(c, cur, pos, b)
            outs = []
            for si, (sq, n) in enumerate(zip(seqs, ns, strict=True)):
                n_ctx, s0 = sq.n_ctx, sq.off
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
                vperm = g.ggml_permute(c, vrows, 1, 2, 0, 3)
                vc = g.ggml_cpy(c, vperm, vd)
                g.ggml_build_forward_expand(graph, kc)
                g.ggml_build_forward_expand(graph, vc)
                sq.kdst.append(kc.contents)
                sq.vdst.append(vc.contents)
                sq.krows.append((krows.contents, kd.contents))
                sq.vrows.append((vrows.contents, vperm.contents, vd.contents))
                # each block's attention over the whole context's views; n_kv is set per step
                for bk in sq.blocks:
                    kr = g.ggml_new_tensor_3d(c, tid, hdk, n_ctx, Hkv)
                    _set_shape(kr.contents, (hdk, n_ctx, Hkv), (es, Hkv * hdk * es, hdk * es, Hkv * hdk * es * n_ctx))
                    kr.contents.data = kptr
                    vt = g.ggml_new_tensor_3d(c, tid, n_ctx, hdv, Hkv)
                    _set_shape(vt.contents, (n_ctx, hdv, Hkv), (es, n_ctx * es, hdv * n_ctx * es, Hkv * hdv * n_ctx * es))
                    vt.contents.data = vptr
                    qs = g.ggml_view_3d(c, q, hdk, H, bk.b, q.contents.nb[1], q.contents.nb[2],
                                        (s0 + bk.start) * q.contents.nb[2])
                    kq = g.ggml_mul_mat(c, kr, g.ggml_permute(c, qs, 0, 2, 1, 3))  # [n_ctx, b, H]
                    sm = g.ggml_soft_max_ext(c, kq, bk.masks[spec.window][0], ctypes.c_float(at.scale), ctypes.c_float(0.0))
                    if self._sinks[li] is not None:  # as Attention's: a sink logit per head joins the softmax
                        g.ggml_soft_max_add_sinks(sm, self._sinks[li])
                    kqv = g.ggml_mul_mat(c, vt, sm)  # [hdv, b, H]
                    outs.append(g.ggml_cont(c, g.ggml_permute(c, kqv, 0, 2, 1, 3)))  # [hdv, H, b]
                    bk.kread.append(kr.contents)
                    bk.vread.append(vt.contents)
                    bk.scores += [kq.contents, sm.contents]
            a = outs[0]
            for o in outs[1:]:
                a = g.ggml_concat(c, a, o, 2)
            a = g.ggml_reshape_2d(c, a, H * hdv, b)
            if spec.moe is not None and spec.moe_layer is not None:
                outs = spec.moe.ops(c, a, cur, b)
                xo, ids = (spec.moe.moe_ops(c, outs, ar, zero, b) if last is None
                           else spec.moe.moe_ops_rows(c, outs, ar, zero, b, last, n_sel))
                g.ggml_set_output(ids)
                ids_out.append((spec.moe_layer, ids))
                cur = xo
            else:
                assert spec.dense is not None
                if last is not None:  # a dense block's rows are independent: select before it
                    a, cur = g.ggml_get_rows(c, a, last), g.ggml_get_rows(c, cur, last)
                o = spec.dense.ops(c, a, cur, n_sel if last is not None else b)
                cur = g.ggml_add(c, o[0], o[-1])  # a dense block: x2 + its FFN
        if whole:
            if sel is not None and not narrow:
                cur = g.ggml_get_rows(c, cur, sel)
            logits = self.head.ops(c, cur)  # [n_vocab, rows]
        else:
            logits = cur  # the residual [d, b]
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
        n_out = n_sel or b
        built = _Built(ctx, galloc, _Plan(ctx, graph, n_threads, 0),
                       _i32_view(tok, (b,)) if whole else _f32_view(tok, (b, d)), _i32_view(pos, (b,)),
                       _f32_view(logits, (n_out, self.n_vocab if whole else d)),
                       [(ml, _f32_view(t, (b, int(g.ggml_nelements(t)) // b))) for ml, t in ids_out], seqs,
                       _i32_view(sel, (n_sel,)) if sel is not None else None)
        built.x[:] = 0
        built.pos[:] = 0
        if built.sel is not None:
            built.sel[:] = 0
        if ar is not None and zero is not None:  # written once: inputs and outputs, so the allocator never reuses
            # their memory and no op writes into them (a per-step rewrite measured 0.16 ms a step at 4 sessions)
            _f32_view(ar, (b, self._n_expert))[:] = np.arange(self._n_expert, dtype=np.float32)
            _f32_view(zero, (b, d))[:] = 0.0
        for sq, n in zip(seqs, ns, strict=True):
            sq.n = n
            for bk in sq.blocks:
                for w, (t, _) in list(bk.masks.items()):
                    mem = _f32_view(t, (bk.b * sq.n_ctx,))
                    mem[:] = 0
                    bk.masks[w] = (t.contents, mem)
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
        if whole and n_tok:
            tl = tokens.tolist() if n_tok <= 64 else [int(tokens.min()), int(tokens.max())]  # (a decode step: no numpy reductions)
            if min(tl) < 0 or max(tl) >= self.n_vocab:
                raise KernelError(f"token id out of range 0..{self.n_vocab - 1}")
        dt = {kc.dtype for _, _, kc, _ in seqs} | {vc.dtype for _, _, _, vc in seqs}
        if len(dt) != 1 or next(iter(dt)) not in (np.float16, np.float32):
            raise KernelError(f"KV caches of one type (f16 or f32), got {dt}")
        tid = g.GGML_TYPE_F16 if next(iter(dt)) == np.float16 else g.GGML_TYPE_F32
        at, n_layer = self.attn, hi - lo
        for n, p0, kc, vc in seqs:
            if kc.shape[0] != n_all or kc.shape[2:] != (at.Hkv, at.hdk) or vc.shape != (n_all, at.Hkv, at.hdv, kc.shape[1]) \
                    or not kc.flags.c_contiguous or not vc.flags.c_contiguous or p0 < 0:
                raise KernelError("stack caches do not match the attention's shapes")
            if p0 + n > kc.shape[1]:
                raise KernelError("rows beyond the cache")
        n_ctxs = tuple(int(kc.shape[1]) for _, _, kc, _ in seqs)
        blks = tuple(self.blocks(n) for n in ns)
        slots = [sum(bl) for bl in blks]
        packed = all(s == n for s, n in zip(slots, ns, strict=True))  # no padding rows: graph row i is row i
        gmap = None if packed else np.concatenate([o + np.arange(n) for o, n in
                                                   zip(np.cumsum([0, *slots[:-1]]), ns, strict=True)])
        sel_rows: np.ndarray | None = None  # graph rows into the head
        if whole and (rows is not None or gmap is not None):
            r = np.arange(n_tok) if rows is None else np.asarray(rows, dtype=np.int64)
            sel_rows = r if gmap is None else gmap[r]
        n_sel = 0 if sel_rows is None else _bucket(len(sel_rows), at.max_rows) if len(sel_rows) <= at.max_rows \
            else len(sel_rows)
        key = (span, blks, n_ctxs, int(tid), n_threads, n_sel)
        built = self._graphs.pop(key, None)
        es = 2 if tid == g.GGML_TYPE_F16 else 4
        if built is None:
            while self._graphs and (len(self._graphs) >= self.max_graphs
                                    or sum(bt.nbytes for bt in self._graphs.values()) > self.max_bytes):
                self._graphs.pop(next(iter(self._graphs))).free()  # the least recently used
            ptrs = [([kc.ctypes.data + li * kc[0].nbytes for li in range(n_all)],
                     [vc.ctypes.data + li * vc[0].nbytes for li in range(n_all)]) for _, _, kc, vc in seqs]
            built = self._build(span, blks, ns, n_ctxs, int(tid), n_threads, n_sel, ptrs)
        self._graphs[key] = built  # (re)inserted last: the most recently used
        if gmap is None:
            built.x[:n_tok] = tokens
            built.pos[:n_tok] = pos
        else:
            built.x[gmap] = tokens
            built.pos[gmap] = pos
        if sel_rows is not None and built.sel is not None:
            built.sel[: len(sel_rows)] = sel_rows
        H = at.H
        for sq, (n, p0, kc, vc) in zip(built.seqs, seqs, strict=True):
            n_ctx = sq.n_ctx
            kl, vl = kc[0].nbytes, vc[0].nbytes
            kbase, vbase = kc.ctypes.data + lo * kl, vc.ctypes.data + lo * vl  # the segment's first layer
            if sq.bound != (kbase, vbase):  # another sequence's caches: the views move
                for bk in sq.blocks:
                    for li in range(n_layer):
                        bk.kread[li].data = kbase + li * kl
                        bk.vread[li].data = vbase + li * vl
                sq.bound = (kbase, vbase)
            if n != sq.n:  # another row count in the same bucket: the cache writes take n rows
                for (kv, kd), (vv, vp, vd), kcpy, vcpy in zip(sq.krows, sq.vrows, sq.kdst, sq.vdst, strict=True):
                    for st in (kv, kd, kcpy):
                        _set_rows(st, 1, n)
                    _set_rows(vv, 2, n)
                    vp.ne[0] = n
                    vd.ne[0] = n
                    vcpy.ne[0] = n
                sq.n = n
            krow = at.Hkv * at.hdk * es
            for li in range(n_layer):
                sq.kdst[li].data = kbase + li * kl + p0 * krow
                sq.vdst[li].data = vbase + li * vl + p0 * es
            for bk in sq.blocks:
                p = p0 + bk.start
                used = p + min(bk.b, n - bk.start)
                n_kv = at.n_kv(used, n_ctx)
                if n_kv != bk.n_kv:
                    nb_k = (es, at.Hkv * at.hdk * es, at.hdk * es, at.Hkv * at.hdk * es * n_kv)
                    for li in range(n_layer):
                        kr, vt = bk.kread[li], bk.vread[li]
                        kr.ne[1] = n_kv
                        kr.nb[3] = nb_k[3]
                        vt.ne[0] = n_kv
                    for st in bk.scores:
                        _set_shape(st, (n_kv, bk.b, H), (4, 4 * n_kv, 4 * n_kv * bk.b, 4 * n_kv * bk.b * H))
                    for mt, _ in bk.masks.values():
                        _set_shape(mt, (n_kv, bk.b), (4, 4 * n_kv, 4 * n_kv * bk.b, 4 * n_kv * bk.b))
                    bk.n_kv = n_kv
                for w, (_, mem) in bk.masks.items():
                    if bk.b == 1:  # a decode row (at position used - 1): its keys 0 .. used-1 (in its window)
                        mem[:n_kv] = 0.0
                        mem[used:n_kv] = -np.inf
                        if w > 0 and used > w:
                            mem[: used - w] = -np.inf
                    else:
                        mem[: bk.b * n_kv] = at._mask(bk.b, p, used, n_kv, w).reshape(-1)
        with ExitStack() as es_:
            for lock in self._locks:
                es_.enter_context(lock)
            for blk in self._builders:
                blk._bind()
            built.plan.compute(n_threads)
        if sel_rows is not None:
            out = built.out[: len(sel_rows)].copy()
        elif whole:
            out = built.out[:n_tok].copy() if rows is None else built.out[rows]
        else:
            out = built.out[:n_tok].copy() if gmap is None else built.out[gmap]
        return out, [(ml, (v[:n_tok] if gmap is None else v[gmap]).astype(np.int64)) for ml, v in built.ids]

    def close(self) -> None:
        for b in self._graphs.values():
            b.free()
        self._graphs.clear()
        self._wctx.free()
