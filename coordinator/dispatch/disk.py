"""Experts computed from the GGUF file on disk, without holding them (shell: file reads; DESIGN §12).

A coordinator that holds no expert in memory still has its GGUF: a sampled remote call of a range it
does not hold is checked against the experts read from the file (``pread``, never through the memory
map, dropped from the page cache after: ``swarm.model.gguf.pread_chunks``), so two replicas that agree
on a lie are caught too.

Rules:
- Only the experts a call's pairs use are read (each one's gate, up and down rows), into a compact
  stack of those experts; the pairs are re-indexed onto it and computed by the same kernel the
  coordinator computes held experts with (the same kernel id: bit-exact against an honest volunteer's).
- The compact stacks are a few buffers made once and read into in place: one per capacity, a power
  of two (1, 2, 4, ... experts: the unused slots are zero and no pair points at them). So the memory
  checks take is bounded by the largest call's experts (twice over), not by how many checks ran:
  the pooled ggml kernels are bound by shape, one per capacity. (With a fresh stack per check and
  per used-expert count, a 30b-a3b backbone coordinator grew by ~6.6 GB of kernels and their last
  stacks over a volunteer's probation, every call checked.)
- Checks run one at a time (a lock: the buffers are shared). A buffer read into again is ``repack.changed``:
  the kernels' repacked copy of it is made again (else a check computed the previous experts).
"""

from __future__ import annotations

import threading

import numpy as np

from coordinator.dispatch.layer import LocalJob
from swarm.model.gguf import ExpertStack, GGUFModel, QTensor, pread_chunks
from swarm.model.kernels import KernelBackend, expert_kernel, repack

__all__ = ["DiskExperts"]


def _padded(rows: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros((cap, *rows.shape[1:]), dtype=rows.dtype)
    out[: rows.shape[0]] = rows
    return out


def capacity(n: int) -> int:
    """The compact stack that holds ``n`` experts: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class DiskExperts:
    def __init__(self, model: GGUFModel, kernel: KernelBackend | None = None) -> None:
        self.model = model
        self.kernel = kernel if kernel is not None else model.kernel
        self.bytes_read = 0
        self._lock = threading.Lock()
        # (tensor kind, qtype, row shape, capacity) -> the buffer its experts are read into
        self._bufs: dict[tuple[int, int, tuple[int, ...], int], np.ndarray] = {}

    def _buffer(self, kind: int, t: QTensor, cap: int) -> np.ndarray:
        key = (kind, int(t.qtype), tuple(t.raw.shape[1:]), cap)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = np.zeros((cap, *t.raw.shape[1:]), dtype=np.uint8)
        return buf

    def _compact(self, layer: int, experts: list[int]) -> ExpertStack:
        """The experts ``experts`` (global indices, ascending) of ``layer`` read from the file into
        the buffers of their capacity (under the lock)."""
        stack = self.model.expert_stack(layer)
        cap = min(capacity(len(experts)), max(len(experts), stack.n_expert))
        tensors = []
        for kind, t in enumerate((stack.gate_t, stack.up_t, stack.down_t)):
            spans = [self.model.file_span(t.raw[e]) for e in experts]  # views: nothing is read through the map
            buf = self._buffer(kind, t, cap)
            flat = buf.reshape(-1)
            at = 0
            for block in pread_chunks(self.model.path, spans):
                flat[at : at + len(block)] = np.frombuffer(block, dtype=np.uint8)
                at += len(block)
            self.bytes_read += at
            if at < flat.size:  # slots past the used experts: zero (no pair points at them)
                flat[at:] = 0
            repack.changed(buf)  # other bytes in the same buffer: not the repacked copy of the last ones
            tensors.append(QTensor(t.name, t.qtype, (cap, *t.shape[1:]), buf))
        biases = None
        if stack.biases is not None:
            biases = tuple(QTensor(b.name, b.qtype, (cap, *b.shape[1:]), _padded(b.raw[experts], cap))
                           for b in stack.biases)
        return ExpertStack(tensors[0], tensors[1], tensors[2], biases=biases,  # type: ignore[arg-type]
                           activation=stack.activation)

    def pair_outputs(self, job: LocalJob) -> np.ndarray:
        """``job``'s per-pair outputs, its experts read from disk."""
        glob = job.pair_experts + job.lo
        used = sorted({int(e) for e in glob})
        index = {e: i for i, e in enumerate(used)}
        local = np.array([index[int(e)] for e in glob], dtype=np.int64)
        with self._lock:
            stack = self._compact(job.layer, used)
            k = expert_kernel(stack, self.kernel)
            return k.pair_outputs_np(job.x, job.pair_rows, local, job.pair_weights)
