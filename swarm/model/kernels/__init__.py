"""The ``ExpertKernel`` seam: how a slice's weighted partial sum is computed (shell over native code).

Every place that computes routed experts -- the coordinator's local path, the dispatcher's
fallback, a volunteer's server -- asks ``expert_kernel(stack, backend)`` for the kernel of one
``(slice, backend)`` and calls ``partial_sum``. Two backends:

- ``ggml`` (the default): ggml's own CPU kernels on the quantised bytes as stored
  (``swarm.model.kernels.ggml``): activations are quantised as llama.cpp quantises them
  (Q8_0/Q8_1/Q8_K, fp16/bf16) and dot products run in integer/SIMD code.
- ``torch``: dequantise each expert matrix, then float32 matmuls
  (``swarm.model.experts.slice_partial_sum``): the reference, and the fallback for tests.

Rules:
- ``partial_sum(x, pair_rows, pair_experts, pair_weights)`` returns ``[n, d_model]`` float32: per
  row, ``acc = 0`` then ``acc += y_e * w_e`` for its pairs in ascending local expert index (DESIGN
  §3), whatever the order the pairs come in. Rows without pairs are zero.
- The ggml kernels are batch-invariant: a row's result never depends on the other rows in the call
  (tested for n in {1, 2, 3, 8, 64} and every type), so a volunteer may batch calls from many
  coordinators. The torch reference promises no such thing (BLAS picks its paths by shape).
- ``kernel_id`` names the backend, its version and every build flag that changes numerics; equal
  ids and equal inputs give equal bits (local = remote). Different ids agree within a tolerance.
- ``EXPERT_ACTIVATIONS`` names the activations the kernels compute between an expert's gate/up and
  down projections ("silu": ``silu(gate) * up``; "swiglu_oai": gpt-oss's clamped variant, with the
  experts' biases); a slice of any other is refused at load.
- The ggml kernels are pooled per (types, shape): a pooled kernel is rebound to the slice's bytes
  for one call and returned, so concurrent callers each get their own and graph buffers are shared
  across layers; the bytes are never copied (zero-copy over the memory-mapped GGUF or slice file),
  except the types ggml's CPU backend repacks for its faster kernels (``swarm.model.kernels.repack``:
  Q4_0, IQ4_NL, MXFP4 by default; Q4_K experts with ``MOE_SWARM_REPACK=all``), computed from one
  repacked copy of the stored bytes (made on first use; part of ``kernel_id``).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from swarm.model.combine import add_in_expert_order
from swarm.model.experts import slice_pair_outputs, slice_partial_sum

EXPERT_ACTIVATIONS: tuple[str, ...] = ("silu", "swiglu_oai")

if TYPE_CHECKING:
    from swarm.model.gguf import ExpertStack
    from swarm.model.kernels.ggml import GgmlExpertKernel

__all__ = ["BIG_WORK", "DEFAULT_BACKEND", "EXPERT_ACTIVATIONS", "ExpertKernel", "KernelBackend", "add_in_expert_order",
           "combine_pairs", "compute_threads",
           "configure_threads",
           "expert_kernel", "kernel_id", "set_compute_threads"]

# ggml threads for big calls: the engine thread alternates torch and ggml, so the ggml kernels may
# use the same thread budget as torch. A call's size is its multiply-accumulates. Decode is
# memory-bound and one core streams only ~11.5 GB/s here against ~20 GB/s for two (the routed experts
# of one bench-model token: 12.8 vs 7.4 ms), while a 2-thread graph costs ~7-11 us more to start (with
# the workers' short spin, set_poll(1)): from ~256K multiply-accumulates (~0.25-0.5 MB of weights) the
# second thread pays. Bench model decode, engine benchmark: 0.65x -> 0.71x llama.cpp's rate.
# Results do not depend on the thread count (tested).
BIG_WORK = 256_000  # multiply-accumulates from which a call uses every compute thread
_THREADS = 1


def set_compute_threads(n: int) -> None:
    """The ggml threads big calls may use (the coordinator sets its ``--threads``; volunteers keep 1,
    their parallelism is one worker thread per call)."""
    global _THREADS
    _THREADS = max(1, int(n))


def configure_threads(threads: int, backend: KernelBackend) -> None:
    """The engine's thread budget (``--threads``): with ggml, the ggml kernels get every thread for
    big calls and torch (attention, norms, RoPE: small ops) one intra-op thread -- a second OpenMP
    thread costs a futex wake per op and gains nothing on these sizes (measured on the bench model,
    2 cores: decode 18.7 -> 16.0 ms per step, prefill 177 -> 214 tokens/s), and the ggml workers
    spin briefly between graphs (``set_poll(1)``: decode ~15.5-16.8 -> 12.7-15.4 ms per step). With the
    torch reference, torch gets them all."""
    n = max(1, int(threads))
    torch.set_num_threads(n if backend is KernelBackend.TORCH else 1)
    set_compute_threads(n)
    if backend is KernelBackend.GGML and n > 1:
        from swarm.model.kernels.ggml import set_poll

        set_poll(1)  # many small graphs in a row: a short spin instead of a wake-up per graph


def compute_threads(work: int, big: int | None = None) -> int:
    """Threads for a call of ``work`` multiply-accumulates (every thread from ``big`` on, default
    ``BIG_WORK``)."""
    return _THREADS if work >= (BIG_WORK if big is None else big) else 1


class KernelBackend(enum.StrEnum):
    GGML = "ggml"
    TORCH = "torch"


DEFAULT_BACKEND = KernelBackend.GGML


class ExpertKernel(Protocol):
    kernel_id: str

    def partial_sum(
        self, x: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor, pair_weights: torch.Tensor
    ) -> torch.Tensor: ...

    def pair_outputs(
        self, x: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor, pair_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each pair's weighted expert output ``y_e(x[r]) * w`` ``[P, d_model]`` float32, in the pairs'
        order; its bits depend only on that pair (batch invariance) and the kernel id."""
        ...

    def combined(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """The MoE output ``[n, d_model]`` of rows ``x`` whose experts ``topk_ids[n, k]`` (local,
        distinct per row) all lie in this slice, with weights ``topk_w[n, k]``: the bits of
        ``combine_pairs`` over ``pair_outputs`` (so of any partition of the slice), in one call."""
        ...

    def pair_outputs_np(self, x: np.ndarray, pair_rows: np.ndarray, pair_experts: np.ndarray,
                        pair_weights: np.ndarray) -> np.ndarray:
        """``pair_outputs`` on numpy arrays (the dispatch path: no torch in between)."""
        ...

    def combined_np(self, x: np.ndarray, topk_ids: np.ndarray, topk_w: np.ndarray) -> np.ndarray:
        """``combined`` on numpy arrays."""
        ...


def combine_pairs(n_rows: int, pair_rows: Any, pair_experts: Any, y: Any) -> torch.Tensor:
    """The MoE sum of a layer from its pairs' weighted outputs: per row, ``acc = 0`` then ``acc += y_p``
    for the row's pairs in ascending expert index (DESIGN §3), float32, one rounding per add.

    Whoever computed each pair (this machine, any volunteer, under any partition into ranges) the
    result has the same bits, as long as every pair's ``y`` has them (equal kernel ids): the
    order of the adds is fixed by the experts alone. ``pair_experts`` must be comparable across the
    pairs given (global indices when they come from several ranges). Rows without pairs are 0.
    """
    yv = y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y, dtype=np.float32)
    if yv.ndim != 2:
        raise ValueError("combine_pairs: one output row per pair")
    acc = np.zeros((n_rows, yv.shape[1]), dtype=np.float32)
    return torch.from_numpy(add_in_expert_order(acc, pair_rows, pair_experts, yv, error=ValueError))


def kernel_id(backend: KernelBackend = DEFAULT_BACKEND) -> str:
    """The id of ``backend`` as built and loaded in this process."""
    if backend is KernelBackend.TORCH:
        return f"torch-{torch.__version__.split('+')[0]}-dequant-f32-v1"
    from swarm.model.kernels import ggml

    return ggml.kernel_id()


class TorchExpertKernel:
    """Dequantise-then-float32 matmuls: the reference path."""

    def __init__(self, stack: ExpertStack) -> None:
        self.stack = stack
        self.kernel_id = kernel_id(KernelBackend.TORCH)

    def partial_sum(
        self, x: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor, pair_weights: torch.Tensor
    ) -> torch.Tensor:
        return slice_partial_sum(x, pair_rows, pair_experts, pair_weights, self.stack)

    def pair_outputs(
        self, x: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor, pair_weights: torch.Tensor
    ) -> torch.Tensor:
        return slice_pair_outputs(x, pair_rows, pair_experts, pair_weights, self.stack)

    def combined(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        n, k = topk_ids.shape
        rows = torch.arange(n).repeat_interleave(k)
        return self.partial_sum(x, rows, topk_ids.reshape(-1), topk_w.reshape(-1))

    def pair_outputs_np(self, x: np.ndarray, pair_rows: np.ndarray, pair_experts: np.ndarray,
                        pair_weights: np.ndarray) -> np.ndarray:
        return self.pair_outputs(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                                 torch.from_numpy(np.asarray(pair_rows, dtype=np.int64)),
                                 torch.from_numpy(np.asarray(pair_experts, dtype=np.int64)),
                                 torch.from_numpy(np.array(pair_weights, dtype=np.float32))).numpy()

    def combined_np(self, x: np.ndarray, topk_ids: np.ndarray, topk_w: np.ndarray) -> np.ndarray:
        return self.combined(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                             torch.from_numpy(np.asarray(topk_ids, dtype=np.int64)),
                             torch.from_numpy(np.array(topk_w, dtype=np.float32))).numpy()


_PoolKey = tuple[tuple[int, int, int], int, int, int, int, str, bool, Any]
_POOL: dict[_PoolKey, list[GgmlExpertKernel]] = {}
_POOL_LOCK = threading.Lock()


def _pool_key(stack: ExpertStack, n_threads: int) -> _PoolKey:
    """Which pooled ggml kernels can compute ``stack`` (the same types, shapes and activation)."""
    from swarm.model.kernels import repack

    types = (int(stack.gate_t.qtype), int(stack.up_t.qtype), int(stack.down_t.qtype))
    return (types, stack.d_model, stack.d_expert, stack.n_expert, n_threads, stack.activation, stack.biases is not None,
            repack.repacked_types())  # a kernel keeps the layout it was built with


@contextmanager
def _pooled(stack: ExpertStack, n_threads: int = 1) -> Iterator[GgmlExpertKernel]:
    """A ggml kernel bound to ``stack``'s bytes, for the duration of one computation."""
    from swarm.model.kernels.ggml import GgmlExpertKernel

    key = _pool_key(stack, n_threads)
    types = key[0]
    raws = tuple(np.ascontiguousarray(t.raw).reshape(-1) for t in (stack.gate_t, stack.up_t, stack.down_t))
    braws = None if stack.biases is None else (np.ascontiguousarray(stack.biases[0].raw).reshape(-1),
                                               np.ascontiguousarray(stack.biases[1].raw).reshape(-1),
                                               np.ascontiguousarray(stack.biases[2].raw).reshape(-1))
    with _POOL_LOCK:
        free = _POOL.setdefault(key, [])
        k = free.pop() if free else None
    if k is None:
        k = GgmlExpertKernel(raws[0], raws[1], raws[2], types, stack.d_model, stack.d_expert, stack.n_expert,
                             n_threads=n_threads, activation=stack.activation, biases=braws)
    else:
        k.rebind(raws[0], raws[1], raws[2], braws)
    try:
        yield k
    finally:
        with _POOL_LOCK:
            _POOL[key].append(k)


class GgmlKernel:
    """ggml on the bytes as stored (see the module rules)."""

    def __init__(self, stack: ExpertStack) -> None:
        self.stack = stack
        self.kernel_id = kernel_id(KernelBackend.GGML)

    def partial_sum(
        self, x: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor, pair_weights: torch.Tensor
    ) -> torch.Tensor:
        xs = x.detach().to(torch.float32).contiguous().numpy()
        work = int(pair_rows.numel()) * 3 * self.stack.d_model * self.stack.d_expert
        with _pooled(self.stack, compute_threads(work)) as k:
            out = k.compute(xs, pair_rows.numpy(), pair_experts.numpy(), pair_weights.detach().to(torch.float32).numpy())
        return torch.from_numpy(out)

    def pair_outputs(
        self, x: torch.Tensor, pair_rows: torch.Tensor, pair_experts: torch.Tensor, pair_weights: torch.Tensor
    ) -> torch.Tensor:
        return torch.from_numpy(self.pair_outputs_np(x.detach().to(torch.float32).contiguous().numpy(),
                                                     pair_rows.numpy(), pair_experts.numpy(),
                                                     pair_weights.detach().to(torch.float32).numpy()))

    def combined(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        xs = x.detach().to(torch.float32).contiguous().numpy()
        return torch.from_numpy(self.combined_np(xs, topk_ids.numpy(), topk_w.detach().to(torch.float32).numpy()))

    def pair_outputs_np(self, x: np.ndarray, pair_rows: np.ndarray, pair_experts: np.ndarray,
                        pair_weights: np.ndarray) -> np.ndarray:
        xs = np.ascontiguousarray(x, dtype=np.float32)
        w = np.asarray(pair_weights, dtype=np.float32).reshape(-1)
        work = int(pair_rows.size) * 3 * self.stack.d_model * self.stack.d_expert
        with _pooled(self.stack, compute_threads(work)) as k:
            y = k.expert_outputs(xs, pair_rows, pair_experts)
        if w.shape[0] != y.shape[0]:
            raise ValueError("pair_weights differs in length from pair_rows")
        y *= w[:, None]  # float32 product, rounded (no FMA), as in GgmlExpertKernel.compute
        return y

    def combined_np(self, x: np.ndarray, topk_ids: np.ndarray, topk_w: np.ndarray) -> np.ndarray:
        xs = np.ascontiguousarray(x, dtype=np.float32)
        work = int(topk_ids.size) * 3 * self.stack.d_model * self.stack.d_expert
        with _pooled(self.stack, compute_threads(work)) as k:
            return k.combined(xs, np.asarray(topk_ids), np.asarray(topk_w, dtype=np.float32))


def expert_kernel(stack: ExpertStack, backend: KernelBackend = DEFAULT_BACKEND) -> ExpertKernel:
    """The kernel computing ``stack``'s experts with ``backend``."""
    if backend is KernelBackend.TORCH:
        return TorchExpertKernel(stack)
    return GgmlKernel(stack)
