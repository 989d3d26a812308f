"""ggml CPU kernels (shell over native code): routed-expert slices and dense matmuls on raw GGUF bytes.

Built on ggml-python==0.0.45's raw ctypes API (ggml 0.15.3). Pin that version: the bindings'
ctypes structs (ggml_tensor, ggml_cplan, ggml_threadpool_params, ...) must match the C library
exactly, and a mismatch segfaults rather than raising.

Rules this module keeps:
- Weights are never copied: ggml tensors point straight at the caller's uint8 arrays (typically
  zero-copy views of a memory-mapped GGUF or slice file). The kernel keeps a reference to them;
  the caller must not close the mmap while the kernel lives. The one exception: the types ggml's
  CPU backend repacks into an interleaved layout for faster kernels (``repack``: Q4_0, Q4_K,
  IQ4_NL, MXFP4 where that keeps batch invariance) are computed from a repacked copy, made once
  per weight (``_weight``); ``MOE_SWARM_REPACK=0`` keeps them as stored.
- Batch invariance: a row's (a pair's) result never depends on the other rows in the call, the
  bucket size, the chunking, or the thread count. This holds for a build with
  GGML_LLAMAFILE=OFF and no BLAS (see REPORT.md); `tests` check it for every type.
- Expert slices follow the project's summation rule (swarm.model.experts.slice_partial_sum):
  per row, ``acc = 0; for e ascending: acc = acc + (y_e * w_e)`` in float32, where
  ``y_e = down_e @ (silu(gate_e @ x) * (up_e @ x))``. ggml computes the per-pair ``y_e``; the
  weighting and the fixed-order adds are done here in numpy (exact float32 ops, no FMA).
- Every ggml shape/type precondition is checked in Python first: a GGML_ASSERT aborts the
  process.
- Graphs are built once per size bucket and reused. Inputs live in tensors allocated inside the
  bucket's context (never views, never re-pointed), so the "a view copies its source's data
  pointer at creation" gotcha cannot bite. The compute plan is made once per bucket with
  ggml_graph_plan; the work buffer is a numpy array we own; ggml_graph_compute is called with a
  persistent threadpool (no per-call thread creation, no per-call context allocation).
- A kernel object is thread-safe (one lock per kernel; computations sharing a threadpool are
  serialised on the pool's lock) but not re-entrant from ggml callbacks.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import ggml
import ggml.ggml as g
import numpy as np

from swarm.errors import KernelError
from swarm.model.combine import add_in_expert_order
from swarm.model.kernels import repack
from swarm.model.kernels.affinity import WorkerPlacement, started_threads

__all__ = [
    "GGML_PYTHON_VERSION",
    "SUPPORTED_TYPES",
    "GgmlExpertKernel",
    "GgmlMatmul",
    "KernelError",
    "build_info",
    "kernel_id",
    "quantize",
    "row_nbytes",
    "rest_workers",
    "set_poll",
    "activation_type",
    "graph_time",
    "host_supported",
    "numeric_fingerprint",
]

GGML_PYTHON_VERSION = "0.0.45"
EXPECTED_GGML_VERSION = "0.15.3"
ALGO_VERSION = "moe-pairs-v1"  # bump when the graph or the accumulation changes

SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
)
_TYPE_ID = {name: getattr(g, f"GGML_TYPE_{name}") for name in SUPPORTED_TYPES}
_TYPE_NAME = {v: k for k, v in _TYPE_ID.items()}

# the type llama.cpp's CPU backend converts float32 activations to before the dot product
_ACT_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "IQ4_NL": "Q8_0", "MXFP4": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "IQ4_XS": "Q8_K",
}


if ggml.__version__ != GGML_PYTHON_VERSION:  # struct layouts are version-specific
    raise ImportError(f"ggml_kernels needs ggml-python=={GGML_PYTHON_VERSION}, found {ggml.__version__}")
if g.ggml_version().decode() != EXPECTED_GGML_VERSION:
    raise ImportError(f"ggml_kernels needs ggml {EXPECTED_GGML_VERSION}, found {g.ggml_version().decode()}")

# cheap ABI checks: the C library's own size of a tensor struct (+ its object header) and a struct
# returned by value must agree with the bindings, or field offsets are wrong (segfaults later)
if g.ggml_tensor_overhead() != ctypes.sizeof(g.ggml_tensor) + 32:
    raise ImportError("ggml_tensor struct size mismatch between ggml-python and the loaded library")
_tp_probe = g.ggml_threadpool_params_default(3)
if _tp_probe.n_threads != 3 or _tp_probe.poll != 50:
    raise ImportError("ggml_threadpool_params layout mismatch between ggml-python and the loaded library")
del _tp_probe

g.ggml_cpu_init()

_REQUIRED_HOST_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2")


def host_supported(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU can run the loaded build (x86-64-v3 flags the library was compiled with).

    ggml_cpu_has_* report the *build*; a v3 build on a pre-AVX2 CPU dies with SIGILL on first use,
    so a volunteer should call this (or read /proc/cpuinfo itself) before computing anything."""
    try:
        with open(cpuinfo) as f:
            flags = set()
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    need = [fl for fl in _REQUIRED_HOST_FLAGS if getattr(g, f"ggml_cpu_has_{fl}")()]
    if g.ggml_cpu_has_avx512():
        need.append("avx512f")
    return all(fl in flags for fl in need)


def _type_id(qtype: str | int) -> int:
    if isinstance(qtype, str):
        if qtype not in _TYPE_ID:
            raise KernelError(f"unsupported ggml type {qtype!r}; supported: {', '.join(SUPPORTED_TYPES)}")
        return int(_TYPE_ID[qtype])
    if int(qtype) not in _TYPE_NAME:
        raise KernelError(f"unsupported ggml type id {qtype}")
    return int(qtype)


def activation_type(qtype: str | int) -> str:
    """The type ggml rounds float32 activations to for a weight of ``qtype`` (Q8_0, Q8_K, F16, ...)."""
    return _ACT_TYPE[_TYPE_NAME[_type_id(qtype)]]


def row_nbytes(qtype: str | int, n: int) -> int:
    """Bytes of one row of ``n`` elements; raises if ``n`` is not a whole number of blocks."""
    t = _type_id(qtype)
    blck = g.ggml_blck_size(t)
    if n <= 0 or n % blck:
        raise KernelError(f"{_TYPE_NAME[t]} rows must be a positive multiple of {blck} elements, got {n}")
    return int(g.ggml_row_size(t, n))


# ----------------------------------------------------------------------------- build identity

_LIBDIR = os.path.join(os.path.dirname(g.__file__), "lib")
_HAS_FLAGS = ("sse3", "ssse3", "avx", "avx2", "bmi2", "fma", "f16c", "avx_vnni", "avx512",
              "avx512_vbmi", "avx512_vnni", "avx512_bf16", "amx_int8", "llamafile")


def _lib_bytes(name: str) -> bytes:
    with open(os.path.join(_LIBDIR, name), "rb") as f:
        return f.read()


_BUILD_INFO: dict[str, Any] | None = None


def build_info() -> dict[str, Any]:
    """What the loaded ggml library was built with (compile-time ISA flags, OpenMP, compiler)."""
    global _BUILD_INFO
    if _BUILD_INFO is None:
        cpu = _lib_bytes("libggml-cpu.so")
        base = _lib_bytes("libggml-base.so")
        comp = b""
        i = cpu.find(b"GCC: (")
        if i >= 0:
            comp = cpu[i:cpu.index(b"\0", i)]
        else:
            i = cpu.find(b"clang version")
            if i >= 0:
                comp = cpu[i:cpu.index(b"\0", i)]
        _BUILD_INFO = {
            "ggml_python": ggml.__version__,
            "ggml": g.ggml_version().decode(),
            "flags": {f: int(getattr(g, f"ggml_cpu_has_{f}")()) for f in _HAS_FLAGS},
            "openmp": b"libgomp" in cpu or b"libomp" in cpu,
            "compiler": comp.decode(errors="replace"),
            "lib_sha256": {
                "libggml-cpu.so": hashlib.sha256(cpu).hexdigest(),
                "libggml-base.so": hashlib.sha256(base).hexdigest(),
            },
            "algo": ALGO_VERSION,
            "repack": repack.available(),
        }
    return dict(_BUILD_INFO)


def kernel_id() -> str:
    """A short id for 'same bits': ggml version, ISA flags, llamafile/OpenMP, compiler, algorithm,
    and the repacked weight types (``repack``) when repacking is on.

    Two hosts with equal kernel_id run the same C code paths with the same compiler, so (by the
    batch-invariance property) they produce identical bits. The library sha256 is not part of it
    (an identical build at another path differs in bytes); see ``build_info()`` for it.
    """
    bi = build_info()
    fl = bi["flags"]
    isa = "+".join(f for f in ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512", "avx512_vbmi",
                               "avx512_vnni", "avx512_bf16", "amx_int8") if fl[f])
    key = f"ggml{bi['ggml']}|gp{bi['ggml_python']}|{isa}|lf{fl['llamafile']}|omp{int(bi['openmp'])}|{bi['compiler']}|{bi['algo']}"
    mm, mmid = repack.repacked_types()
    if mm or mmid:  # repacked weights compute other bits (ids without repacking stay as they were)
        key += f"|repack:{','.join(map(str, mm))}/{','.join(map(str, mmid))}"
    return f"ggml-{bi['ggml']}-{isa}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _det_array(shape: tuple[int, ...], salt: int) -> np.ndarray:
    """Deterministic float32 test data from integer hashing (no RNG, no libm: same on every host)."""
    i = np.arange(int(np.prod(shape)), dtype=np.uint64) + np.uint64(salt * 1000003)
    h = (i * np.uint64(2654435761) + np.uint64(0x9E3779B9)) % np.uint64(1 << 32)
    return ((h.astype(np.float64) / 2.0**32 - 0.5) / 16).astype(np.float32).reshape(shape)


def numeric_fingerprint(types: Sequence[str] = SUPPORTED_TYPES) -> str:
    """sha256 over the output bits of a fixed small problem per type (quantise, matmul, expert slice).

    Equal fingerprints mean two hosts computed these problems bit-identically; a coordinator can
    compare a volunteer's fingerprint with its own before trusting its kernel_id. ~0.5 s."""
    hsh = hashlib.sha256()
    d, f, e = 256, 256, 2
    x = _det_array((3, d), 1)
    for t in types:
        w = quantize(_det_array((64, d), 2), t)
        hsh.update(t.encode() + GgmlMatmul(w, t, 64, d)(x).tobytes())
        raws = [quantize(_det_array(shp, 3 + j), t) for j, shp in enumerate(((e, f, d), (e, f, d), (e, d, f)))]
        k = GgmlExpertKernel(raws[0], raws[1], raws[2], t, d, f, e)
        hsh.update(k.compute(x, [0, 1, 1, 2], [1, 0, 1, 1], [0.75, 0.5, 0.25, 1.0]).tobytes())
        k.close()
    return hsh.hexdigest()


# ----------------------------------------------------------------------------- threadpools

_POOLS: dict[tuple[int, int, int], tuple[int, threading.Lock]] = {}
_POOLS_LOCK = threading.Lock()
_PLACEMENT: dict[int, WorkerPlacement] = {}  # pool -> its workers, kept off the caller's CPU (affinity.py)


_POLL = 0  # the default spin level of multi-threaded computes (set_poll)
_GRAPH_TIME: dict[int, list[float]] = {}  # thread ident -> [seconds inside ggml_graph_compute, graphs]


def graph_time(ident: int | None = None) -> tuple[float, int]:
    """The seconds a thread (default: the calling one) has spent inside ``ggml_graph_compute`` and the
    graphs it computed, since the process started: what a step spends in ggml's own compute, against
    everything around it (``benchmarks/engine.py``'s breakdown). Each thread writes only its own entry;
    a new thread may get a finished one's ident and go on from its count, so readers take differences."""
    acc = _GRAPH_TIME.get(threading.get_ident() if ident is None else ident)
    return (acc[0], int(acc[1])) if acc is not None else (0.0, 0)


def set_poll(poll: int) -> None:
    """How long a threadpool's workers spin for the next graph before sleeping (ggml's ``poll``,
    0..100; 0 = sleep at once). The coordinator's engine computes many small graphs in a row: with 0
    every multi-threaded graph pays a wake-up (measured ~20 us here, 26 vs 6 us for a tiny graph on 2
    threads), with 1 the worker spins ~0.1 ms and picks the next one up (7-11 us); higher levels
    spin for milliseconds and take the core from the process's other threads. Bits do not depend on
    it."""
    global _POLL
    if not 0 <= poll <= 100:
        raise KernelError(f"poll must be in 0..100, got {poll}")
    _POLL = int(poll)


def rest_workers() -> int:
    """Stop the spinning of the calling thread's threadpools' workers now: a thread about to wait on
    something outside ggml (a remote layer's answers) calls it, so the workers that spin for its next
    graph (``set_poll``) leave the other cores to the processes and threads that must run meanwhile
    (the volunteers, the network thread). They sleep (ggml's ``ggml_threadpool_pause``) until this
    thread's next compute on the pool, whose kick-off resumes them (a wake-up, ~20 us). Pools that
    never spin (poll 0, one thread) are left alone. Returns how many were paused."""
    me = threading.get_ident()
    with _POOLS_LOCK:
        pools = [v for k, v in _POOLS.items() if k[2] == me and k[0] > 1 and k[1] > 0]
    for tp, lock in pools:
        with lock:
            g.ggml_threadpool_pause(tp)
    return len(pools)


def _threadpool(n_threads: int, poll: int) -> tuple[int, threading.Lock]:
    """The calling thread's persistent ggml threadpool for (n_threads, poll); never freed.

    One per calling thread, so kernels computing in different threads (a volunteer's workers) run
    at the same time instead of queueing on one pool; a pool of one thread has no worker threads.
    """
    if not 1 <= n_threads <= 64:
        raise KernelError(f"n_threads must be in 1..64, got {n_threads}")
    if not 0 <= poll <= 100:
        raise KernelError(f"poll must be in 0..100, got {poll}")
    key = (n_threads, poll, threading.get_ident())
    with _POOLS_LOCK:
        if key not in _POOLS:
            p = g.ggml_threadpool_params_default(n_threads)
            p.poll = poll  # 0: workers sleep on a condvar between graphs (no spinning on the other core)
            tp, workers = started_threads(lambda: g.ggml_threadpool_new(ctypes.byref(p)))
            if not tp:
                raise RuntimeError("ggml_threadpool_new failed")
            _PLACEMENT[tp] = WorkerPlacement(workers, n_threads - 1)
            _POOLS[key] = (tp, threading.Lock())
        return _POOLS[key]


# ----------------------------------------------------------------------------- helpers

def _f32_view(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    ptr = ctypes.cast(t.contents.data, ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(ptr, shape=shape)


def _i32_view(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    ptr = ctypes.cast(t.contents.data, ctypes.POINTER(ctypes.c_int32))
    return np.ctypeslib.as_array(ptr, shape=shape)


def _as_raw(a: Any, nbytes: int, what: str) -> np.ndarray:
    arr: np.ndarray = a if isinstance(a, np.ndarray) else np.frombuffer(a, dtype=np.uint8)
    a = arr
    if a.dtype != np.uint8:
        raise KernelError(f"{what}: raw bytes must be a uint8 array, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise KernelError(f"{what}: raw bytes must be C-contiguous")
    if a.nbytes != nbytes:
        raise KernelError(f"{what}: expected {nbytes} bytes, got {a.nbytes}")
    return arr


class _Ctx:
    """A ggml context; freed with the owner."""

    _ggml_free = staticmethod(g.ggml_free)  # kept: at interpreter exit the module's globals are gone first

    def __init__(self, mem_size: int, no_alloc: bool) -> None:
        params = g.ggml_init_params(mem_size=mem_size, mem_buffer=None, no_alloc=no_alloc)
        self.ctx = g.ggml_init(params)
        if not self.ctx:
            raise MemoryError(f"ggml_init({mem_size}) failed")

    def free(self) -> None:
        if self.ctx:
            self._ggml_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        self.free()


def _weight_tensor(wctx: _Ctx, tid: int, ne: Sequence[int], raw: np.ndarray, name: str) -> Any:
    if len(ne) == 2:
        t = g.ggml_new_tensor_2d(wctx.ctx, tid, ne[0], ne[1])
    else:
        t = g.ggml_new_tensor_3d(wctx.ctx, tid, ne[0], ne[1], ne[2])
    if g.ggml_nbytes(t) != raw.nbytes:  # belt and braces: _as_raw checked the size already
        raise KernelError(f"{name}: ggml wants {g.ggml_nbytes(t)} bytes, got {raw.nbytes}")
    t.contents.data = raw.ctypes.data  # zero-copy; ggml never writes to src0 of a mul_mat
    g.ggml_set_name(t, name.encode())
    return t


def _weight(wctx: _Ctx, tid: int, ne: Sequence[int], raw: np.ndarray, name: str, op: str | None) -> tuple[Any, np.ndarray]:
    """A weight tensor for ``op`` (``"mul_mat"``, ``"mul_mat_id"``, or None: any other use) and the
    array its data points into, which the caller keeps (and re-points leaves at): ``raw`` itself
    (zero-copy), or, where ``repack.packs`` says so, ``raw``'s repacked copy (``repack.packed``)."""
    if op is None or not repack.packs(tid, ne, op):
        return _weight_tensor(wctx, tid, ne, raw, name), raw
    arr = repack.packed(raw, tid, ne)
    t = _weight_tensor(wctx, tid, ne, arr, name)
    repack.mark(t, tid, ne)
    return t, arr


class _Plan:
    """A built graph with its plan and owned work buffer."""

    def __init__(self, ctx: _Ctx, graph: Any, n_threads: int, pool: int) -> None:
        self.ctx = ctx
        self.graph = graph
        self.cplan = g.ggml_graph_plan(graph, n_threads, pool)
        self.work = np.empty(max(1, self.cplan.work_size), dtype=np.uint8)
        self.cplan.work_data = ctypes.cast(self.work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))

    def compute(self, n_threads: int, poll: int | None = None) -> None:
        """Compute on the calling thread's pool (the plan's work size depends only on n_threads);
        ``poll`` None: the module default (``set_poll``)."""
        pool, lock = _threadpool(n_threads, _POLL if poll is None else poll)
        with lock:
            _PLACEMENT[pool].before_compute()  # its workers never queue behind this thread's spin barrier
            self.cplan.threadpool = pool  # type: ignore[assignment]  # ctypes takes the raw pointer
            t0 = time.perf_counter()
            st = g.ggml_graph_compute(self.graph, ctypes.byref(self.cplan))
            dt = time.perf_counter() - t0
        acc = _GRAPH_TIME.get(ident := threading.get_ident())
        if acc is None:
            acc = _GRAPH_TIME[ident] = [0.0, 0.0]
        acc[0] += dt
        acc[1] += 1
        if st != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {st}")


def _bucket(n: int, cap: int) -> int:
    """Graph size for n items: exact up to 8, then 12, 16, 24, 32, 48, 64, ... capped."""
    if n <= 8:
        return n
    b = 8
    while True:
        for c in (b * 3 // 2, b * 2):
            if c >= n:
                return min(c, cap)
        b *= 2


_GRAPH_NODES = 16
_ACTIVATIONS = ("silu", "swiglu_oai")
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU (llama.cpp's constants)


# ----------------------------------------------------------------------------- expert kernel

class GgmlExpertKernel:
    """One (layer, expert-range) slice: SwiGLU experts on raw GGUF bytes.

    ``gate``/``up`` are the raw bytes of ``ffn_gate_exps``/``ffn_up_exps`` for the slice's
    ``n_expert`` experts, logical shape ``[n_expert, d_expert, d_model]`` (rows of ``d_model``);
    ``down`` is ``ffn_down_exps``, ``[n_expert, d_model, d_expert]``. ``qtype`` is one type for all
    three or a ``(gate, up, down)`` triple (llama.cpp often stores down in another type, e.g.
    when ``d_expert`` is not a multiple of 256 a Q4_K model has Q5_0 down). Expert indices in
    ``compute`` are local (0 .. n_expert-1).
    """

    def __init__(
        self,
        gate: np.ndarray,
        up: np.ndarray,
        down: np.ndarray,
        qtype: str | int | Sequence[str | int],
        d_model: int,
        d_expert: int,
        n_expert: int,
        *,
        n_threads: int = 1,
        poll: int | None = None,
        max_pairs: int = 512,
        activation: str = "silu",
        biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if activation not in _ACTIVATIONS:
            raise KernelError(f"activation {activation!r} is not computed here ({', '.join(_ACTIVATIONS)})")
        self.activation = activation
        if isinstance(qtype, (str, int)):
            qtype = (qtype, qtype, qtype)
        if len(qtype) != 3:
            raise KernelError("qtype must be one type or a (gate, up, down) triple")
        self.types = tuple(_type_id(t) for t in qtype)
        self.type_names = tuple(_TYPE_NAME[t] for t in self.types)
        if n_expert <= 0 or d_model <= 0 or d_expert <= 0:
            raise KernelError("n_expert, d_model and d_expert must be positive")
        if max_pairs <= 0:
            raise KernelError("max_pairs must be positive")
        self.d_model, self.d_expert, self.n_expert = int(d_model), int(d_expert), int(n_expert)
        rg = row_nbytes(self.types[0], d_model)
        ru = row_nbytes(self.types[1], d_model)
        rd = row_nbytes(self.types[2], d_expert)
        self._raw = (
            _as_raw(gate, rg * d_expert * n_expert, "gate"),
            _as_raw(up, ru * d_expert * n_expert, "up"),
            _as_raw(down, rd * d_model * n_expert, "down"),
        )
        self.n_threads, self.max_pairs = int(n_threads), int(max_pairs)
        self._pool, self._poll = _threadpool(self.n_threads, _POLL if poll is None else poll)[0], poll
        self._wctx = _Ctx(8 * g.ggml_tensor_overhead() + 1024, no_alloc=True)
        self._ne = ((d_model, d_expert, n_expert), (d_model, d_expert, n_expert), (d_expert, d_model, n_expert))
        made = [_weight(self._wctx, t, ne, r, name, "mul_mat_id")
                for t, ne, r, name in zip(self.types, self._ne, self._raw, ("gate_exps", "up_exps", "down_exps"),
                                          strict=True)]
        self._w = (made[0][0], made[1][0], made[2][0])
        self._packed = tuple(m[1] is not r for m, r in zip(made, self._raw, strict=True))
        self._raw = (made[0][1], made[1][1], made[2][1])  # what the tensors point into (repacked copies or raw)
        # gpt-oss: F32 bias rows per expert, added with ggml_add_id after each projection, as llama.cpp
        self._b: tuple[Any, Any, Any] | None = None
        self._braw: tuple[np.ndarray, ...] = ()
        if biases is not None:
            sizes = (d_expert, d_expert, d_model)
            self._braw = tuple(_as_raw(b, 4 * n * n_expert, f"{k}_bias")
                               for b, n, k in zip(biases, sizes, ("gate", "up", "down"), strict=True))
            self._b = tuple(_weight_tensor(self._wctx, g.GGML_TYPE_F32, (n, n_expert), r, f"{k}_bias")
                            for r, n, k in zip(self._braw, sizes, ("gate", "up", "down"), strict=True))
        self._plans: dict[int, tuple[_Plan, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._plans_c: dict[tuple[int, int], tuple[_Plan, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._raw)

    def rebind(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
               biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """Point the kernel at another stack of the same shape and types (e.g. another layer),
        keeping the built graphs and buffers: one kernel (and ~tens of MB of bucket buffers) can
        serve every layer. Safe because the weight tensors are graph leaves, not views: ggml
        reads ``tensor->data`` at compute time. Repacked weights are bound to the new bytes' repacked
        copy (made on the first bind of those bytes)."""
        def bound(i: int, arr: Any, what: str) -> np.ndarray:  # the stored bytes, or their repacked copy
            r = _as_raw(arr, self._raw[i].nbytes, what)
            return repack.packed(r, self.types[i], self._ne[i]) if self._packed[i] else r

        raws = (bound(0, gate, "gate"), bound(1, up, "up"), bound(2, down, "down"))
        if (biases is None) != (self._b is None):
            raise KernelError("rebind: biases must come exactly when the kernel was built with them")
        braws = () if biases is None else tuple(_as_raw(b, r.nbytes, "bias") for b, r in zip(biases, self._braw,
                                                                                             strict=True))
        with self._lock:
            for t, r in zip(self._w, raws, strict=True):
                t.contents.data = r.ctypes.data
            self._raw = raws
            if self._b is not None:
                for t, r in zip(self._b, braws, strict=True):
                    t.contents.data = r.ctypes.data
                self._braw = braws

    def _plan(self, b: int) -> tuple[_Plan, np.ndarray, np.ndarray, np.ndarray]:
        p = self._plans.get(b)
        if p is not None:
            return p
        d, f = self.d_model, self.d_expert
        data = 4 * b * (2 * d + 3 * f) + 4 * b + (4 * b * (2 * f + d) if self._b is not None else 0)
        mem = data + 24 * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(_GRAPH_NODES, False) + 24 * 64
        ctx = _Ctx(mem, no_alloc=False)
        c = ctx.ctx
        xp = g.ggml_new_tensor_3d(c, g.GGML_TYPE_F32, d, 1, b)  # one token per pair, one slot
        ids = g.ggml_new_tensor_2d(c, g.GGML_TYPE_I32, 1, b)
        g.ggml_set_input(xp)
        g.ggml_set_input(ids)
        gt = g.ggml_mul_mat_id(c, self._w[0], xp, ids)  # [f, 1, b]
        ut = g.ggml_mul_mat_id(c, self._w[1], xp, ids)
        if self._b is not None:
            ut = g.ggml_add_id(c, ut, self._b[1], ids)
            gt = g.ggml_add_id(c, gt, self._b[0], ids)
        if self.activation == "swiglu_oai":
            h = g.ggml_swiglu_oai(c, gt, ut, ctypes.c_float(OAI_ALPHA), ctypes.c_float(OAI_LIMIT))
        else:
            h = g.ggml_swiglu_split(c, gt, ut)  # silu(gate) * up
        y = g.ggml_mul_mat_id(c, self._w[2], h, ids)  # [d, 1, b]
        if self._b is not None:
            y = g.ggml_add_id(c, y, self._b[2], ids)
        g.ggml_set_output(y)
        graph = g.ggml_new_graph_custom(c, _GRAPH_NODES, False)
        g.ggml_build_forward_expand(graph, y)
        plan = _Plan(ctx, graph, self.n_threads, self._pool)
        xv, iv, yv = _f32_view(xp, (b, d)), _i32_view(ids, (b,)), _f32_view(y, (b, d))
        xv[:] = 0
        iv[:] = 0
        p = (plan, xv, iv, yv)
        self._plans[b] = p
        return p

    def _plan_combined(self, b: int, k: int) -> tuple[_Plan, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The whole routed MoE of ``b`` rows with ``k`` experts each in one graph: per-pair outputs
        as ``_plan`` computes them (mul_mat_id over ``[k, b]`` ids reads each row once; the dot
        products are the same, row by row), times the weight (``ggml_mul``, one float32 rounding),
        then added into a zero row slot by slot -- the caller sorts each row's experts ascending --
        so the bits are ``add_in_expert_order``'s over the per-pair outputs."""
        key = (b, k)
        p = self._plans_c.get(key)
        if p is not None:
            return p
        d, f = self.d_model, self.d_expert
        data = 4 * b * (2 * d + k * (3 * f + 2 * d) + 2 * k + d * k) + (4 * b * k * (2 * f + d) if self._b is not None else 0)
        nodes = 16 + 2 * k
        mem = data + (24 + 2 * k) * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(max(_GRAPH_NODES, nodes), False) + 64 * (24 + 2 * k)
        ctx = _Ctx(mem, no_alloc=False)
        c = ctx.ctx
        xp = g.ggml_new_tensor_3d(c, g.GGML_TYPE_F32, d, 1, b)  # one row, read by each of its k experts
        ids = g.ggml_new_tensor_2d(c, g.GGML_TYPE_I32, k, b)
        wt = g.ggml_new_tensor_3d(c, g.GGML_TYPE_F32, 1, k, b)
        zero = g.ggml_new_tensor_2d(c, g.GGML_TYPE_F32, d, b)
        for t in (xp, ids, wt, zero):
            g.ggml_set_input(t)
        gt = g.ggml_mul_mat_id(c, self._w[0], xp, ids)  # [f, k, b]
        ut = g.ggml_mul_mat_id(c, self._w[1], xp, ids)
        if self._b is not None:
            ut = g.ggml_add_id(c, ut, self._b[1], ids)
            gt = g.ggml_add_id(c, gt, self._b[0], ids)
        if self.activation == "swiglu_oai":
            h = g.ggml_swiglu_oai(c, gt, ut, ctypes.c_float(OAI_ALPHA), ctypes.c_float(OAI_LIMIT))
        else:
            h = g.ggml_swiglu_split(c, gt, ut)
        y = g.ggml_mul_mat_id(c, self._w[2], h, ids)  # [d, k, b]
        if self._b is not None:
            y = g.ggml_add_id(c, y, self._b[2], ids)
        yw = g.ggml_mul(c, y, wt)  # [d, k, b] * [1, k, b]
        acc = zero
        nb1, nb2 = yw.contents.nb[1], yw.contents.nb[2]
        for j in range(k):  # slot j holds each row's j-th smallest expert
            acc = g.ggml_add(c, acc, g.ggml_view_2d(c, yw, d, b, nb2, j * nb1))
        g.ggml_set_output(acc)
        graph = g.ggml_new_graph_custom(c, max(_GRAPH_NODES, nodes), False)
        g.ggml_build_forward_expand(graph, acc)
        plan = _Plan(ctx, graph, self.n_threads, self._pool)
        xv, iv, wv, ov = _f32_view(xp, (b, d)), _i32_view(ids, (b, k)), _f32_view(wt, (b, k)), _f32_view(acc, (b, d))
        xv[:] = 0
        iv[:] = 0
        wv[:] = 0
        _f32_view(zero, (b, d))[:] = 0
        p = (plan, xv, iv, wv, ov)
        self._plans_c[key] = p
        return p

    def combined(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The routed MoE output ``[n, d_model]`` float32 of rows ``x[n, d_model]``, each with ``k``
        distinct experts ``ids[n, k]`` (local indices) and weights ``w[n, k]``: the bits of
        ``compute`` (per row, weighted outputs added in ascending expert order), in one graph."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.asarray(ids)
        w = np.asarray(w, dtype=np.float32)
        n = x.shape[0]
        if x.ndim != 2 or x.shape[1] != self.d_model or ids.ndim != 2 or ids.shape[0] != n or w.shape != ids.shape:
            raise KernelError(f"combined: x [n, {self.d_model}], ids and w [n, k]; got {x.shape}, {ids.shape}, {w.shape}")
        k = ids.shape[1]
        out = np.empty((n, self.d_model), dtype=np.float32)
        if n == 0 or k == 0:
            out[:] = 0
            return out
        order = np.argsort(ids, axis=1, kind="stable")
        ids_s = np.take_along_axis(ids, order, axis=1)
        if ids_s.min() < 0 or ids_s.max() >= self.n_expert:
            raise KernelError(f"expert index out of range 0..{self.n_expert - 1}")
        if k > 1 and (ids_s[:, 1:] == ids_s[:, :-1]).any():
            raise KernelError("a row appears more than once for the same expert")
        w_s = np.take_along_axis(w, order, axis=1)
        cap = max(1, self.max_pairs // k)
        with self._lock:
            for s in range(0, n, cap):
                e = min(n, s + cap)
                m = e - s
                plan, xv, iv, wv, ov = self._plan_combined(_bucket(m, cap), k)
                xv[:m] = x[s:e]
                iv[:m] = ids_s[s:e]
                wv[:m] = w_s[s:e]
                if m < iv.shape[0]:  # padding rows: zero input and weight, the last row's experts
                    xv[m:] = 0
                    wv[m:] = 0
                    iv[m:] = ids_s[e - 1]
                plan.compute(self.n_threads, self._poll)
                out[s:e] = ov[:m]
        return out

    def _check_pairs(self, x: np.ndarray, pair_row: Any, pair_expert: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32) if not (
            isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous) else x
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise KernelError(f"x must be [n, {self.d_model}] float32, got {x.shape}")
        rows = np.asarray(pair_row).astype(np.int64, copy=False).reshape(-1)
        exps = np.asarray(pair_expert).astype(np.int64, copy=False).reshape(-1)
        if rows.shape != exps.shape:
            raise KernelError("pair_row and pair_expert differ in length")
        if rows.size:
            if rows.min() < 0 or rows.max() >= x.shape[0]:
                raise KernelError("pair_row out of range")
            if exps.min() < 0 or exps.max() >= self.n_expert:
                raise KernelError(f"pair_expert out of range 0..{self.n_expert - 1}")
        return x, rows, exps

    def expert_outputs(self, x: np.ndarray, pair_row: Any, pair_expert: Any) -> np.ndarray:
        """Unweighted per-pair expert outputs ``[P, d_model]`` float32, in the pairs' order.

        ``out[p] = down_e @ (silu(gate_e @ x[r]) * (up_e @ x[r]))`` for ``(r, e)`` = pair p.
        Each pair's bits are independent of the other pairs (batch invariance).
        """
        x, rows, exps = self._check_pairs(x, pair_row, pair_expert)
        return self._run(x, rows, exps)

    def _run(self, x: np.ndarray, rows: np.ndarray, exps: np.ndarray) -> np.ndarray:
        n_p = rows.size
        out = np.empty((n_p, self.d_model), dtype=np.float32)
        with self._lock:
            for s in range(0, n_p, self.max_pairs):
                e = min(n_p, s + self.max_pairs)
                m = e - s
                plan, xv, iv, yv = self._plan(_bucket(m, self.max_pairs))
                np.take(x, rows[s:e], axis=0, out=xv[:m])
                iv[:m] = exps[s:e]
                if m < iv.size:  # padding slots: repeat the last expert (its weights are hot)
                    iv[m:] = exps[e - 1]
                plan.compute(self.n_threads, self._poll)
                out[s:e] = yv[:m]
        return out

    def compute(
        self,
        x: np.ndarray,
        pair_row: Any,
        pair_expert: Any,
        pair_weight: Any,
        *,
        acc: np.ndarray | None = None,
    ) -> np.ndarray:
        """The slice's weighted partial sum ``[n, d_model]`` float32.

        Per row: ``acc = 0`` (or the given ``acc`` row, updated in place and returned); then for
        each of the row's pairs in ascending expert index: ``acc = acc + y_e * w_e`` (float32).
        A row appears at most once per expert; rows without pairs stay 0 (or unchanged).
        Chaining ``acc`` through contiguous slices in ascending ``lo`` gives the same bits as
        one call with all experts.
        """
        x, rows, exps = self._check_pairs(x, pair_row, pair_expert)
        w = np.asarray(pair_weight, dtype=np.float32).reshape(-1)
        if w.shape != rows.shape:
            raise KernelError("pair_weight differs in length from pair_row")
        n = x.shape[0]
        if acc is None:
            acc = np.zeros((n, self.d_model), dtype=np.float32)
        elif acc.shape != (n, self.d_model) or acc.dtype != np.float32:
            raise KernelError(f"acc must be [{n}, {self.d_model}] float32")
        if rows.size == 0:
            return acc
        y = self._run(x, rows, exps)  # per pair, batch-invariant: the order of the pairs does not matter
        y *= w[:, None]  # float32 product, rounded (no FMA), as torch's h * w
        return add_in_expert_order(acc, rows, exps, y)

    def close(self) -> None:
        with self._lock:
            for plan, *_ in self._plans.values():
                plan.ctx.free()
            for plan, *_ in self._plans_c.values():
                plan.ctx.free()
            self._plans.clear()
            self._plans_c.clear()
            self._wctx.free()


# ----------------------------------------------------------------------------- dense matmul

class _OneWeight:
    """One weight leaf (zero-copy, or repacked for ``op``) and one op over it, in graphs per row bucket, computed ``max_rows``
    rows at a time (``GgmlMatmul``, ``GgmlGetRows``). An input row is ``n_in`` float32 values, or
    one int32 index when ``n_in`` is 0; an output row is ``n_out`` float32 values."""

    def __init__(self, raw: np.ndarray, tid: int, ne: tuple[int, int], name: str, *, n_in: int, n_out: int,
                 n_threads: int, poll: int | None, max_rows: int, op: str | None) -> None:
        self.n_threads, self.max_rows, self._n_in, self._n_out = int(n_threads), int(max_rows), n_in, n_out
        self._pool, self._poll = _threadpool(self.n_threads, _POLL if poll is None else poll)[0], poll
        self._wctx = _Ctx(2 * g.ggml_tensor_overhead() + 1024, no_alloc=True)
        self._w, self._raw = _weight(self._wctx, tid, ne, raw, name, op)
        self._plans: dict[int, tuple[_Plan, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _op(self, ctx: Any, x: Any) -> Any:
        raise NotImplementedError

    def _plan(self, b: int) -> tuple[_Plan, np.ndarray, np.ndarray]:
        p = self._plans.get(b)
        if p is not None:
            return p
        k, m = max(1, self._n_in), self._n_out
        mem = 4 * b * (k + m) + 8 * g.ggml_tensor_overhead() + g.ggml_graph_overhead_custom(_GRAPH_NODES, False) + 8 * 64
        ctx = _Ctx(mem, no_alloc=False)
        if self._n_in:
            xt = g.ggml_new_tensor_2d(ctx.ctx, g.GGML_TYPE_F32, k, b)
        else:
            xt = g.ggml_new_tensor_1d(ctx.ctx, g.GGML_TYPE_I32, b)
        g.ggml_set_input(xt)
        y = self._op(ctx.ctx, xt)  # [m, b]
        g.ggml_set_output(y)
        graph = g.ggml_new_graph_custom(ctx.ctx, _GRAPH_NODES, False)
        g.ggml_build_forward_expand(graph, y)
        plan = _Plan(ctx, graph, self.n_threads, self._pool)
        xv = _f32_view(xt, (b, k)) if self._n_in else _i32_view(xt, (b,))
        xv[:] = 0
        p = (plan, xv, _f32_view(y, (b, m)))
        self._plans[b] = p
        return p

    def _rows(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        out = np.empty((n, self._n_out), dtype=np.float32)
        with self._lock:
            for s in range(0, n, self.max_rows):
                e = min(n, s + self.max_rows)
                m = e - s
                plan, xv, yv = self._plan(_bucket(m, self.max_rows))
                xv[:m] = x[s:e]
                plan.compute(self.n_threads, self._poll)
                out[s:e] = yv[:m]
        return out

    def close(self) -> None:
        with self._lock:
            for plan, *_ in self._plans.values():
                plan.ctx.free()
            self._plans.clear()
            self._wctx.free()


class GgmlMatmul(_OneWeight):
    """``y = x @ W.T`` for a dense GGUF weight ``W`` ``[out_features, in_features]`` in its stored type."""

    def __init__(
        self,
        w: np.ndarray,
        qtype: str | int,
        out_features: int,
        in_features: int,
        *,
        n_threads: int = 1,
        poll: int | None = None,
        max_rows: int = 256,
    ) -> None:
        self.type = _type_id(qtype)
        self.type_name = _TYPE_NAME[self.type]
        if out_features <= 0 or max_rows <= 0:
            raise KernelError("out_features and max_rows must be positive")
        self.out_features, self.in_features = int(out_features), int(in_features)
        raw = _as_raw(w, row_nbytes(self.type, in_features) * out_features, "W")
        super().__init__(raw, self.type, (self.in_features, self.out_features), "W", n_in=self.in_features,
                         n_out=self.out_features, n_threads=n_threads, poll=poll, max_rows=max_rows, op="mul_mat")

    def _op(self, ctx: Any, x: Any) -> Any:
        return g.ggml_mul_mat(ctx, self._w, x)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        if squeeze:
            x = x[None]
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise KernelError(f"x must be [n, {self.in_features}] float32, got {x.shape}")
        out = self._rows(x)
        return out[0] if squeeze else out


class GgmlGetRows(_OneWeight):
    """Rows ``ids`` of a GGUF table ``[n_rows, n_cols]`` (an embedding) as float32, dequantised by
    ggml's ``get_rows`` on the stored bytes (llama.cpp's embedding lookup; one thread)."""

    def __init__(self, w: np.ndarray, qtype: str | int, n_rows: int, n_cols: int, *, max_rows: int = 512) -> None:
        self.type = _type_id(qtype)
        self.n_rows, self.n_cols = int(n_rows), int(n_cols)
        raw = _as_raw(w, row_nbytes(self.type, n_cols) * n_rows, "table")
        super().__init__(raw, self.type, (self.n_cols, self.n_rows), "table", n_in=0, n_out=self.n_cols, n_threads=1,
                         poll=0, max_rows=max_rows, op=None)

    def _op(self, ctx: Any, x: Any) -> Any:
        return g.ggml_get_rows(ctx, self._w, x)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_rows):
            raise KernelError(f"row index out of range 0..{self.n_rows - 1}")
        return self._rows(ids)


# ----------------------------------------------------------------------------- quantiser (tests, tools)

def quantize(a: np.ndarray, qtype: str | int) -> np.ndarray:
    """float32 ``[..., n]`` -> raw GGUF bytes (uint8, 1-D) with ggml's own quantiser (no imatrix)."""
    t = _type_id(qtype)
    a = np.ascontiguousarray(a, dtype=np.float32)
    n = a.shape[-1]
    nrows = a.size // n
    rb = row_nbytes(t, n)
    if g.ggml_quantize_requires_imatrix(t):
        raise KernelError(f"{_TYPE_NAME[t]} needs an importance matrix")
    out = np.empty(rb * nrows, dtype=np.uint8)
    got = g.ggml_quantize_chunk(t, a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data, 0, nrows, n, None)
    if got != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {out.nbytes}")
    return out
