"""Causal attention of new rows against a sequence's KV cache as one ggml graph (shell over native
code): llama.cpp's attention without flash attention, read in place from the caches. Split from
``coordinator.engine.block`` (the layers' dense halves); the same rules: a row's result never depends
on the other rows or the bucket, shapes are checked in Python before ggml sees them, a graph object is
thread-safe (one lock) and computes on the calling thread's threadpool.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import ggml.ggml as g
import numpy as np

from swarm.errors import KernelError
from swarm.model.kernels.ggml import _bucket, _Ctx, _f32_view, _Plan

__all__ = ["Attention"]

_NODES = 64


class Attention:
    """Causal grouped-query attention of one sequence's new rows against its KV cache, as llama.cpp
    computes it without flash attention: ``kq = K q`` (query head h reads kv head h // group),
    ``softmax(kq * scale + mask)``, ``V^T kq``, over ``n_kv`` cache rows -- the used rows rounded up
    to ``kv_pad`` (llama.cpp pads its KV view; the padding changes the dot products' summation
    order, never their terms: masked rows weigh exactly 0).

    Both are read in place (strided leaves over the caches, as llama.cpp's views): K
    ``[n_ctx, Hkv, hdk]``, V transposed ``[Hkv, hdv, n_ctx]``. The padding rows ``used .. n_kv``
    (not yet written for this sequence) are zeroed before each call, so a previous occupant's
    numbers -- even non-finite ones -- never meet a 0 weight as inf * 0.
    """

    def __init__(self, *, n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int, kv_pad: int = 256,
                 max_rows: int = 256, max_graphs: int = 32, scale: float = 0.0) -> None:
        if n_head % n_head_kv:
            raise KernelError("n_head must be a multiple of n_head_kv")
        self.H, self.Hkv, self.hdk, self.hdv = n_head, n_head_kv, head_dim_k, head_dim_v
        self.kv_pad, self.max_rows, self.max_graphs = int(kv_pad), int(max_rows), int(max_graphs)
        # the score scale: 1/sqrt(head_dim_k), or the architecture's (MLA: 1/sqrt(nope + rope dims))
        self.scale = float(np.float32(scale)) if scale else float(np.float32(1.0) / np.sqrt(np.float32(head_dim_k)))
        self._plans: dict[tuple[tuple[tuple[int, int], ...], int, int, bool], tuple[_Plan, list[dict[str, Any]], _Ctx]] = {}
        self._lock = threading.Lock()
        self._masks: dict[tuple[int, int, int, int, int], np.ndarray] = {}

    def n_kv(self, used: int, n_ctx: int) -> int:
        return min(n_ctx, -(-used // self.kv_pad) * self.kv_pad)

    def _sub(self, c: Any, lctx: Any, b: int, n_kv: int, tid: int, sinks: bool = False) -> tuple[dict[str, Any], Any]:
        """One sequence's attention inside a graph: its inputs and its output ``[hdv, H, b]``; with
        ``sinks``, a per-head sink logit (input ``sinks``, ``[H]``) joins every softmax."""
        H, Hkv, hdk, hdv = self.H, self.Hkv, self.hdk, self.hdv
        es = 2 if tid == g.GGML_TYPE_F16 else 4
        q = g.ggml_new_tensor_3d(c, g.GGML_TYPE_F32, hdk, H, b)
        mask = g.ggml_new_tensor_2d(c, g.GGML_TYPE_F32, n_kv, b)
        k = g.ggml_new_tensor_3d(lctx, tid, hdk, n_kv, Hkv)  # strided views of the caches, as llama.cpp's
        k.contents.nb[1] = Hkv * hdk * es
        k.contents.nb[2] = hdk * es
        k.contents.nb[3] = Hkv * hdk * es * n_kv
        vt = g.ggml_new_tensor_3d(lctx, tid, n_kv, hdv, Hkv)  # nb[1], nb[2] depend on n_ctx: set per call
        for t in (q, vt, mask, k):
            g.ggml_set_input(t)
        kq = g.ggml_mul_mat(c, k, g.ggml_permute(c, q, 0, 2, 1, 3))  # [n_kv, b, H]
        kq = g.ggml_soft_max_ext(c, kq, mask, ctypes.c_float(self.scale), ctypes.c_float(0.0))
        st = None
        if sinks:
            st = g.ggml_new_tensor_1d(c, g.GGML_TYPE_F32, H)
            g.ggml_set_input(st)
            g.ggml_soft_max_add_sinks(kq, st)
        kqv = g.ggml_mul_mat(c, vt, kq)  # [hdv, b, H]
        out = g.ggml_cont(c, g.ggml_permute(c, kqv, 0, 2, 1, 3))  # [hdv, H, b]
        g.ggml_set_output(out)
        views = {"q": _f32_view(q, (b, H * hdk)), "mask": _f32_view(mask, (b, n_kv)), "out": _f32_view(out, (b, H * hdv)),
                 "k": k.contents, "vt": vt.contents, "es": es}  # the leaves' structs, taken once
        if st is not None:
            views["sinks"] = _f32_view(st, (H,))
        return views, out

    def _plan(self, shape: tuple[tuple[int, int], ...], tid: int, n_threads: int, sinks: bool = False
              ) -> tuple[_Plan, list[dict[str, Any]], _Ctx]:
        key = (shape, tid, n_threads, sinks)
        p = self._plans.get(key)
        if p is not None:
            return p
        if len(self._plans) >= self.max_graphs:  # drop the oldest (dicts keep insertion order)
            old = self._plans.pop(next(iter(self._plans)))
            old[0].ctx.free()
            old[2].free()
        H, hdk, hdv = self.H, self.hdk, self.hdv
        mem = sum(4 * b * (H * hdk + 3 * H * n_kv + 2 * H * hdv) + 4 * n_kv * b for b, n_kv in shape)
        nodes = _NODES * len(shape)
        ctx = _Ctx(mem + 32 * len(shape) * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(nodes, False)
                   + 32 * 64 * len(shape), no_alloc=False)
        lctx = _Ctx(4 * len(shape) * g.ggml_tensor_overhead() + 256, no_alloc=True)
        graph = g.ggml_new_graph_custom(ctx.ctx, nodes, False)
        subs = []
        for b, n_kv in shape:
            views, out = self._sub(ctx.ctx, lctx.ctx, b, n_kv, tid, sinks)
            views["q"][:] = 0
            views["mask"][:] = 0
            g.ggml_build_forward_expand(graph, out)
            subs.append(views)
        p = (_Plan(ctx, graph, n_threads, 0), subs, lctx)
        self._plans[key] = p
        return p

    def _mask(self, b: int, pos: int, used: int, n_kv: int, window: int) -> np.ndarray:
        """The causal (and sliding-window) mask of rows ``pos .. used-1`` (padding rows repeat the
        last one) over ``n_kv`` keys; every layer of a step asks for the same ones, so they are kept
        (a few dozen, read-only)."""
        key = (b, pos, used, n_kv, window)
        m = self._masks.get(key)
        if m is None:
            qpos = np.minimum(pos + np.arange(b), used - 1)
            kpos = np.arange(n_kv)[None, :]
            masked = kpos > qpos[:, None]
            if window > 0:
                masked |= qpos[:, None] - kpos >= window
            m = np.where(masked, -np.inf, 0.0).astype(np.float32)
            m.flags.writeable = False
            if len(self._masks) >= 64:
                self._masks.clear()
            self._masks[key] = m
        return m

    def macs(self, n: int, n_kv: int) -> int:
        return n * n_kv * self.H * (self.hdk + self.hdv)

    def _check(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: int) -> int:
        n = q.shape[0]
        n_ctx = k_cache.shape[0]
        if q.shape != (n, self.H * self.hdk) or k_cache.shape[1:] != (self.Hkv, self.hdk) \
                or v_cache.shape != (self.Hkv, self.hdv, n_ctx) or k_cache.dtype != v_cache.dtype:
            raise KernelError("attention shapes do not match")
        if not k_cache.flags.c_contiguous or not v_cache.flags.c_contiguous:
            raise KernelError("KV caches must be C-contiguous")
        if k_cache.dtype == np.float16:
            tid = g.GGML_TYPE_F16
        elif k_cache.dtype == np.float32:
            tid = g.GGML_TYPE_F32
        else:
            raise KernelError(f"KV cache type {k_cache.dtype} is not supported")
        if pos < 0 or pos + n > n_ctx:
            raise KernelError("rows beyond the cache")
        return int(tid)

    def many(self, items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]], n_threads: int = 1, *,
             zero_tail: bool = True, sinks: np.ndarray | None = None, window: int = 0) -> list[np.ndarray]:
        """Several sequences' attention in one graph: ``items`` = ``(q, k_cache, v_cache, pos)`` as in
        ``__call__`` (all caches of one type). ``zero_tail=False``: the caller guarantees that cache
        rows past each sequence's end are zero (``coordinator.engine.model.KVCache`` does). ``sinks``: one
        logit per head joining each softmax (gpt-oss); ``window`` > 0: a query at position p sees
        the keys at p - window + 1 .. p only (llama.cpp's standard sliding window)."""
        tids = {self._check(q, kc, vc, pos) for q, kc, vc, pos in items}
        if len(tids) != 1:
            raise KernelError("the KV caches of one call must share a type")
        tid = tids.pop()
        if any(q.shape[0] > self.max_rows for q, *_ in items):  # long prefill chunks: one at a time
            return [self(q, kc, vc, pos, n_threads, zero_tail=zero_tail, sinks=sinks, window=window)
                    for q, kc, vc, pos in items]
        sk = None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
        if sk is not None and sk.shape != (self.H,):
            raise KernelError(f"sinks must be {self.H} float32 values")
        shape = tuple((_bucket(q.shape[0], self.max_rows), self.n_kv(pos + q.shape[0], kc.shape[0]))
                      for q, kc, _, pos in items)
        outs = []
        with self._lock:
            plan, subs, _ = self._plan(shape, tid, n_threads, sk is not None)
            for (q, kc, vc, pos), (b, n_kv), v in zip(items, shape, subs, strict=True):
                n, n_ctx, es = q.shape[0], kc.shape[0], v["es"]
                used = pos + n
                if zero_tail and n_kv > used:
                    kc[used:n_kv] = 0
                    vc[:, :, used:n_kv] = 0
                v["k"].data = kc.ctypes.data
                vt = v["vt"]
                vt.data = vc.ctypes.data
                vt.nb[1] = n_ctx * es
                vt.nb[2] = self.hdv * n_ctx * es
                vt.nb[3] = self.Hkv * self.hdv * n_ctx * es
                v["q"][:n] = q
                v["mask"][:] = self._mask(b, pos, used, n_kv, window)
                if sk is not None:
                    v["sinks"][:] = sk
            plan.compute(n_threads)
            for (q, *_), v in zip(items, subs, strict=True):
                outs.append(v["out"][: q.shape[0]].copy())
        return outs

    def __call__(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: int,
                 n_threads: int = 1, *, zero_tail: bool = True, sinks: np.ndarray | None = None,
                 window: int = 0) -> np.ndarray:
        """``q[n, H*hdk]`` (roped) of rows at positions ``pos .. pos+n-1``; ``k_cache`` ``[n_ctx, Hkv,
        hdk]`` and ``v_cache`` ``[Hkv, hdv, n_ctx]``, float32 or float16, already holding this step's
        rows. Returns ``[n, H*hdv]``."""
        self._check(q, k_cache, v_cache, pos)
        n = q.shape[0]
        if n <= self.max_rows:
            return self.many([(q, k_cache, v_cache, pos)], n_threads, zero_tail=zero_tail, sinks=sinks, window=window)[0]
        out = np.empty((n, self.H * self.hdv), dtype=np.float32)
        for s in range(0, n, self.max_rows):  # row blocks; each sees the cache up to its own last row
            e = min(n, s + self.max_rows)
            out[s:e] = self.many([(q[s:e], k_cache, v_cache, pos + s)], n_threads, zero_tail=zero_tail, sinks=sinks,
                                 window=window)[0]
        return out

    def close(self) -> None:
        with self._lock:
            for plan, _, lctx in self._plans.values():
                plan.ctx.free()
                lctx.free()
            self._plans.clear()
