"""Dense weights in their stored type: ``Linear`` (``y = x @ W.T``) and ``Embedding`` (row lookup).

Rules:
- ggml backend: the weight stays the raw GGUF bytes (zero-copy over the memory map; F16/BF16/Q*
  are never expanded to float32, so resident memory stays near the file size) and ggml's matmul
  computes ``x @ W.T`` the way llama.cpp does (activations rounded or quantised to the type the
  weight's dot product wants). Batch-invariant: a row's result does not depend on the other rows.
- torch backend (the reference, and tests): the weight is dequantised to float32 once, at first use.
- ``Embedding`` dequantises only the rows it is asked for (both backends give the same bits: the
  dequantisation is exact and the same code).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from swarm.model.quant import dequantize_raw

if TYPE_CHECKING:
    from swarm.model.gguf import QTensor
    from swarm.model.kernels import KernelBackend
    from swarm.model.kernels.ggml import GgmlMatmul

__all__ = ["Embedding", "Linear"]


class Linear:
    """``x[n, in] @ W.T -> [n, out]`` for a GGUF weight ``W`` of shape ``(out, in)``."""

    def __init__(self, weight: QTensor, backend: KernelBackend) -> None:
        from swarm.model.kernels import KernelBackend

        if len(weight.shape) != 2:
            raise ValueError(f"{weight.name}: a linear weight is 2-D, got {weight.shape}")
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.backend = backend
        self._ggml: dict[int, GgmlMatmul] = {}  # by thread count
        self._f32: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._use_ggml = backend is KernelBackend.GGML

    def _matmul(self, n_threads: int) -> GgmlMatmul:
        mm = self._ggml.get(n_threads)
        if mm is None:
            with self._lock:
                mm = self._ggml.get(n_threads)
                if mm is None:
                    from swarm.model.kernels.ggml import GgmlMatmul

                    raw = np.ascontiguousarray(self.weight.raw).reshape(-1)
                    mm = GgmlMatmul(raw, int(self.weight.qtype), self.out_features, self.in_features, n_threads=n_threads)
                    self._ggml[n_threads] = mm
        return mm

    def dense(self) -> torch.Tensor:
        """The weight as float32 ``[out, in]`` (dequantised once; the torch backend's copy)."""
        if self._f32 is None:
            self._f32 = self.weight.to_float()
        return self._f32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._use_ggml:
            return x @ self.dense().T
        from swarm.model.kernels import compute_threads

        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        work = flat.shape[0] * self.out_features * self.in_features
        out = torch.from_numpy(self._matmul(compute_threads(work))(flat.numpy()))
        return out.reshape(*x.shape[:-1], self.out_features)


class Embedding:
    """Rows of a GGUF embedding table ``(n_vocab, d_model)``, dequantised on lookup: by ggml's
    ``get_rows`` on the stored bytes with the ggml backend (one call, ~10 us, instead of the torch
    dequantiser's dozen ops), by the torch dequantiser otherwise; the same bits (tested)."""

    def __init__(self, table: QTensor, backend: KernelBackend | None = None) -> None:
        from swarm.model.kernels import KernelBackend

        self.table = table
        self._rows: Any = None
        if backend is KernelBackend.GGML:
            from swarm.model.kernels.ggml import GgmlGetRows

            self._rows = GgmlGetRows(np.ascontiguousarray(table.raw).reshape(-1), int(table.qtype), *table.shape)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        idx = ids.numpy()
        if self._rows is not None:
            return torch.from_numpy(self._rows(idx))
        rows = np.ascontiguousarray(self.table.raw[idx])
        return dequantize_raw(torch.from_numpy(rows), self.table.qtype, (len(idx), self.table.shape[1]))
