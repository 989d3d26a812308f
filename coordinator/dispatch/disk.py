"""Experts computed from the GGUF file on disk, without holding them (shell: file reads; DESIGN §12).

A coordinator that holds no expert in memory still has its GGUF: a sampled remote call of a range it
does not hold is checked against the experts read from the file (``pread``, never through the memory
map, dropped from the page cache after: ``swarm.model.gguf.pread_chunks``), so two replicas that agree
on a lie are caught too.

Rules:
- Only the experts a call's pairs use are read (each one's gate, up and down rows), into a compact
  stack of those experts; the pairs are re-indexed onto it and computed by the same kernel the
  coordinator computes held experts with (the same kernel id: bit-exact against an honest volunteer's).
- The memory a check takes is that compact stack (``n_used`` experts), whatever the layer's size.
"""

from __future__ import annotations

import numpy as np

from coordinator.dispatch.layer import LocalJob
from swarm.model.gguf import ExpertStack, GGUFModel, QTensor, pread_chunks
from swarm.model.kernels import KernelBackend, expert_kernel

__all__ = ["DiskExperts"]


class DiskExperts:
    def __init__(self, model: GGUFModel, kernel: KernelBackend | None = None) -> None:
        self.model = model
        self.kernel = kernel if kernel is not None else model.kernel
        self.bytes_read = 0

    def _compact(self, layer: int, experts: list[int]) -> ExpertStack:
        """The experts ``experts`` (global indices, ascending) of ``layer`` read from the file."""
        stack = self.model.expert_stack(layer)
        tensors = []
        for t in (stack.gate_t, stack.up_t, stack.down_t):
            spans = [self.model.file_span(t.raw[e]) for e in experts]  # views: nothing is read through the map
            data = bytearray()
            for block in pread_chunks(self.model.path, spans):
                data += block
            self.bytes_read += len(data)
            raw = np.frombuffer(bytes(data), dtype=np.uint8).reshape(len(experts), *t.raw.shape[1:])
            tensors.append(QTensor(t.name, t.qtype, (len(experts), *t.shape[1:]), raw))
        biases = None
        if stack.biases is not None:
            biases = tuple(QTensor(b.name, b.qtype, (len(experts), *b.shape[1:]), np.ascontiguousarray(b.raw[experts]))
                           for b in stack.biases)
        return ExpertStack(tensors[0], tensors[1], tensors[2], biases=biases,  # type: ignore[arg-type]
                           activation=stack.activation)

    def pair_outputs(self, job: LocalJob) -> np.ndarray:
        """``job``'s per-pair outputs, its experts read from disk."""
        glob = job.pair_experts + job.lo
        used = sorted({int(e) for e in glob})
        stack = self._compact(job.layer, used)
        index = {e: i for i, e in enumerate(used)}
        local = np.array([index[int(e)] for e in glob], dtype=np.int64)
        k = expert_kernel(stack, self.kernel)
        return k.pair_outputs_np(job.x, job.pair_rows, local, job.pair_weights)
