"""Repacked weights: ggml-cpu's ``CPU_REPACK`` layouts for the ggml kernels (shell over native code).

A ggml build with ``GGML_CPU_REPACK=ON`` (``ops/ggml-cmake-args``) has an "extra buffer type" in its
CPU backend: a weight stored there has its rows interleaved 8 at a time (Q4_0, Q4_K, IQ4_NL and MXFP4
on AVX2), and ``MUL_MAT``/``MUL_MAT_ID`` on it run gemv/gemm kernels that stream it once for 8
output rows -- llama.cpp's CPU default, and most of its lead over the plain dot products on
Q4_K_M decode. ggml dispatches on the weight tensor's ``buffer`` (of that type) and ``extra`` (the
layout's kernels); ``ggml_backend_tensor_set`` through that buffer type repacks.

Rules this module keeps:
- Only where the bits stay batch- and thread-invariant (``tests/unit/test_repack.py``): ``MUL_MAT_ID``
  computes every (row, expert) pair with the gemv on its own row's activations (quantised row by row,
  as the plain path), so its types are all four; ``MUL_MAT`` computes a plane's rows 4 at a time with
  the gemm and the rest with the gemv, so only the types whose gemm gives the gemv's bits: Q4_0,
  IQ4_NL, MXFP4 (Q4_K's gemm differs from its gemv in the last bits: its 2-D weights stay as
  stored). A row's bits never depend on the other rows, the bucket, the chunking or the threads.
- The repacked kernels' bits differ from the plain kernels' in the last bits (another summation
  order), so whether repacking is on is part of ``kernel_id``; hosts with equal ids compute equal bits.
- A repacked weight is a copy (memory: the repacked weights once more, as llama.cpp's repack
  buffers). Per array of stored bytes (its root: a memory-mapped GGUF or slice file, or an array in
  memory) one anonymous "mirror" of the same size, whose pages exist only where something was
  repacked, at the same offsets: a view of experts ``lo..hi`` of a repacked stack is the same
  range of the mirror (the rows are interleaved within each expert matrix, and a repacked matrix
  has the stored size). Each expert matrix is repacked once (under a lock), when a kernel first
  binds it; the mirror lives as long as the root array. So stored bytes are taken as immutable: a
  caller that rewrites an array in place (``coordinator.dispatch.disk``'s read buffers) calls
  ``changed`` on it, and its matrices are repacked again when next bound.
- Off with ``MOE_SWARM_REPACK=0`` in the environment, or ``set_repack(False)`` before any weight is
  bound (a kernel keeps the layout it was built with); off by itself on a build without the buffer
  type (e.g. ``GGML_CPU_REPACK=OFF``) or a CPU without AVX2.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import ggml.ggml as g
import numpy as np

__all__ = ["MUL_MAT_TYPES", "MUL_MAT_ID_TYPES", "Q4_K_TYPES", "available", "changed", "mark", "packed", "packs", "repack_active",
           "repacked_types", "set_repack"]

# type ids, not names: this module must not import the kernel module (it imports this one)
MUL_MAT_TYPES: frozenset[int] = frozenset(int(getattr(g, f"GGML_TYPE_{n}")) for n in ("Q4_0", "IQ4_NL", "MXFP4"))
Q4_K_TYPES: frozenset[int] = frozenset({int(g.GGML_TYPE_Q4_K)})  # opt-in for MUL_MAT_ID: see the module rules
MUL_MAT_ID_TYPES: frozenset[int] = MUL_MAT_TYPES


def _mode(value: str) -> str:
    v = value.strip().lower()
    return "off" if v in ("0", "false", "no", "off") else "all" if v == "all" else "on"


_MODE = _mode(os.environ.get("MOE_SWARM_REPACK", "1"))
_LOCK = threading.Lock()
_BUFT: list[Any] = []  # [the CPU_REPACK buffer type or None], resolved once
_TRAITS: dict[tuple[int, int], tuple[int, int] | None] = {}  # (type, rows) -> (a buffer of the type, layout)


def _buft() -> Any | None:
    """The CPU backend's ``CPU_REPACK`` buffer type, found through the official extra-buffer API."""
    if not _BUFT:
        found = None
        reg = g.ggml_backend_cpu_reg()
        fp = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
        if fp and g.ggml_cpu_has_avx2():
            get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fp)
            arr = get(g.ggml_backend_reg_dev_get(reg, 0))
            i = 0
            while arr and arr[i]:
                if g.ggml_backend_buft_name(arr[i]) == b"CPU_REPACK":
                    found = arr[i]
                i += 1
        _BUFT.append(found)
    return _BUFT[0]


def available() -> bool:
    """Whether the loaded build has the repack buffer type (and this CPU its AVX2 kernels)."""
    return _buft() is not None


def set_repack(mode: bool | str) -> None:
    """Repacking for the weights bound from now on (``MOE_SWARM_REPACK``): True/"on" (the default
    types), False/"off", or "all" (Q4_K experts too)."""
    global _MODE
    _MODE = ("on" if mode else "off") if isinstance(mode, bool) else _mode(mode)


def repack_active() -> bool:
    """Whether weights bound now are repacked (on, and the build has it)."""
    return _MODE != "off" and available()


def _types(op: str) -> frozenset[int]:
    if not repack_active():
        return frozenset()
    if op == "mul_mat":
        return MUL_MAT_TYPES
    if op == "mul_mat_id":
        return MUL_MAT_ID_TYPES | Q4_K_TYPES if _MODE == "all" else MUL_MAT_ID_TYPES
    return frozenset()


def repacked_types() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The type ids repacked for ``MUL_MAT`` and for ``MUL_MAT_ID``, as bound now (empty when off)."""
    return tuple(sorted(_types("mul_mat"))), tuple(sorted(_types("mul_mat_id")))


def _traits(tid: int, rows: int) -> tuple[int, int] | None:
    """``(buffer, layout)`` for a ``tid`` weight with ``rows`` rows per matrix: a small buffer of the
    repack type (kept for the process) and the ``extra`` ggml's own ``init_tensor`` chose for that
    shape, or None where ggml has no repacked kernels for it."""
    key = (tid, rows)
    if key not in _TRAITS:
        res = None
        buft = _buft()
        if buft is not None:
            ctx = g.ggml_init(g.ggml_init_params(mem_size=2 * g.ggml_tensor_overhead() + 256, mem_buffer=None,
                                                 no_alloc=True))
            try:
                t = g.ggml_new_tensor_2d(ctx, tid, 256, rows)  # the layout depends on the type and the rows
                buf = g.ggml_backend_buft_alloc_buffer(buft, g.ggml_nbytes(t))
                if not buf:
                    raise MemoryError("ggml_backend_buft_alloc_buffer failed")
                if g.ggml_backend_tensor_alloc(buf, t, g.ggml_backend_buffer_get_base(buf)) != 0:
                    raise RuntimeError("ggml_backend_tensor_alloc failed")
                if t.contents.extra:
                    res = (int(buf), int(t.contents.extra))
                else:
                    g.ggml_backend_buffer_free(buf)
            finally:
                g.ggml_free(ctx)
        _TRAITS[key] = res
    return _TRAITS[key]


def packs(tid: int, ne: Sequence[int], op: str) -> bool:
    """Whether a weight of type ``tid`` and ggml shape ``ne`` (``[cols, rows(, experts)]``) used by
    ``op`` (``"mul_mat"``: 2-D, ``"mul_mat_id"``: 3-D) is repacked when bound now."""
    dims = 2 if op == "mul_mat" else 3
    if int(tid) not in _types(op) or len(ne) != dims:
        return False
    return _traits(int(tid), int(ne[1])) is not None


def mark(t: Any, tid: int, ne: Sequence[int]) -> None:
    """Make tensor ``t`` (its ``data`` pointing at repacked bytes) a repacked weight for ggml's dispatch."""
    tr = _traits(int(tid), int(ne[1]))
    if tr is None:
        raise ValueError("mark: no repacked layout for this weight")
    t.contents.buffer, t.contents.extra = tr


class _Mirror:
    """The repacked copy of one root array: an anonymous mapping of its size, and the
    ``(offset, type, cols, rows)`` of the matrices repacked into it."""

    def __init__(self, n: int) -> None:
        self.arr = np.frombuffer(mmap.mmap(-1, max(1, n)), dtype=np.uint8)
        self.done: set[tuple[int, int, int, int]] = set()
        self.ranges: set[tuple[int, int, int, int, int]] = set()  # (offset, bytes, type, cols, rows) all done


_MIRRORS: dict[int, tuple[weakref.ref[np.ndarray], _Mirror]] = {}


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _root(a: np.ndarray, addr: int) -> tuple[np.ndarray, int]:
    """The array at the bottom of ``a``'s views (``addr``: ``a``'s address) and its address; ``a``
    itself where that is not one contiguous block around ``a``."""
    r = a
    while isinstance(r.base, np.ndarray):
        r = r.base
    if r is a:
        return a, addr
    start = _addr(r)
    if not r.flags.c_contiguous or not start <= addr <= addr + a.nbytes <= start + r.nbytes:
        return a, addr
    return r, start


def _mirror(root: np.ndarray) -> _Mirror:
    key = id(root)
    got = _MIRRORS.get(key)
    if got is not None and got[0]() is root:
        return got[1]
    m = _Mirror(root.nbytes)
    _MIRRORS[key] = (weakref.ref(root), m)
    weakref.finalize(root, _drop, key, m)
    return m


def _drop(key: int, m: _Mirror) -> None:
    with _LOCK:
        got = _MIRRORS.get(key)
        if got is not None and got[1] is m:
            del _MIRRORS[key]


def _quiet(level: int, text: bytes | None, user_data: Any) -> None:
    """ggml's log while repacking: its debug line per repacked matrix dropped, the rest to stderr."""
    if level != g.GGML_LOG_LEVEL_DEBUG and text:
        sys.stderr.write(text.decode(errors="replace"))


_quiet_log: Any = g.ggml_log_callback(_quiet)


def _pack_one(dst: int, src: int, tid: int, cols: int, rows: int) -> None:
    """Repack one ``rows x cols`` matrix from ``src`` to ``dst`` (ggml's ``set_tensor`` of the repack buffer)."""
    ctx = g.ggml_init(g.ggml_init_params(mem_size=2 * g.ggml_tensor_overhead() + 256, mem_buffer=None, no_alloc=True))
    prev, prev_ud = g.ggml_log_callback(), ctypes.c_void_p()
    g.ggml_log_get(ctypes.byref(prev), ctypes.byref(prev_ud))
    g.ggml_log_set(_quiet_log, None)
    try:
        t = g.ggml_new_tensor_2d(ctx, tid, cols, rows)
        mark(t, tid, (cols, rows))
        t.contents.data = dst
        g.ggml_backend_tensor_set(t, src, 0, g.ggml_nbytes(t))
    finally:
        g.ggml_log_set(prev, prev_ud)
        g.ggml_free(ctx)


def changed(raw: np.ndarray) -> None:
    """``raw``'s bytes were rewritten in place: every matrix repacked from its root is made again when
    next bound (``packed``)."""
    with _LOCK:
        root, _ = _root(raw, _addr(raw))
        got = _MIRRORS.get(id(root))
        if got is not None and got[0]() is root:
            got[1].done.clear()
            got[1].ranges.clear()


def packed(raw: np.ndarray, tid: int, ne: Sequence[int]) -> np.ndarray:
    """The repacked bytes of the weight stored in ``raw`` (uint8, C-contiguous, type ``tid``, ggml shape
    ``ne``): a view of its root's mirror, every matrix in it repacked once. ``packs`` must hold."""
    cols, rows = int(ne[0]), int(ne[1])
    n_mat = math.prod(int(x) for x in ne[2:])
    addr = _addr(raw)
    with _LOCK:
        root, start = _root(raw, addr)
        m = _mirror(root)
        off = addr - start
        rng = (off, raw.nbytes, tid, cols, rows)
        if rng not in m.ranges:  # a pooled kernel rebinds to the same ranges call after call
            mat = int(g.ggml_row_size(tid, cols)) * rows
            if raw.nbytes != mat * n_mat:
                raise ValueError(f"packed: {raw.nbytes} bytes for {n_mat} matrices of {mat}")
            base = _addr(m.arr)
            for i in range(n_mat):
                key = (off + i * mat, tid, cols, rows)
                if key not in m.done:
                    _pack_one(base + key[0], addr + i * mat, tid, cols, rows)
                    m.done.add(key)
            m.ranges.add(rng)
        return m.arr[off:off + raw.nbytes]
