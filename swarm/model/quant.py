"""GGML tensor types: vectorised torch dequantisers and numpy quantisers (pure: no I/O).

The dequantisers turn the raw bytes of a GGUF tensor (a ``uint8`` torch tensor, typically a
zero-copy view of the memory-mapped file or of a slice file) into float32, on every use of a
weight, so they are fully vectorised over blocks. The quantisers are numpy and serve the model
generator (``swarm.tools.makemodel``); K-quant quantisers are simple (no llama.cpp-style search) but
follow the ggml block layouts exactly.

Rules:
- ``shape`` is always the logical numpy-order shape: its last dimension is the contiguous row, and
  a row is a whole number of blocks (``bytes_per_row``).
- ``dequantize`` is bit-identical to ``gguf.quants.dequantize`` (the numpy reference): the same
  float32 operations in the same order, never a fused multiply-add.
- ``dequantize`` never writes to ``raw``. For F32 the result may share memory with ``raw``
  (it is a view when alignment allows): treat it as read-only.
- A type outside ``SUPPORTED_TYPES`` raises ``UnsupportedTensorType``; bytes that do not match the
  shape raise ``ModelError`` (the raw bytes may come from a peer, so this is not an assert).

Block layouts (ggml, little-endian, ``d``/``dmin`` are fp16):

=====  ======  =====  ===========================================================================
type   block   bytes  layout
=====  ======  =====  ===========================================================================
Q8_0   32      34     d, int8 q[32]; x = d*q
Q4_0   32      18     d, q[16] (low nibble: x[j], high: x[j+16]); x = d*(q-8)
Q4_K   256     144    d, dmin, scales[12] (8 x 6-bit scale + 6-bit min), q[128]; per 64 elements
                      32 bytes, low nibbles = first 32, high = next 32; x = d*sc*q - dmin*m
Q5_K   256     176    as Q4_K plus qh[32] after the scales: bit s of qh[l] is bit 4 of x[32s+l]
Q6_K   256     210    ql[128], qh[64], int8 scales[16] (one per 16 elements), d; x = d*sc*(q-32)
=====  ======  =====  ===========================================================================
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType as T

from swarm.errors import ModelError, UnsupportedTensorType

__all__ = [
    "SUPPORTED_TYPES",
    "block_shape",
    "bytes_per_row",
    "dequantize",
    "dequantize_raw",
    "quantize",
    "tensor_nbytes",
]

SUPPORTED_TYPES: frozenset[T] = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K})

_QK_K = 256
_SUPPORTED_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=lambda t: t.value))


def _check_type(qtype: T) -> None:
    if qtype not in SUPPORTED_TYPES:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorType(f"tensor type {name} is not supported (supported: {_SUPPORTED_NAMES})")


def block_shape(qtype: T) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type."""
    _check_type(qtype)
    return gguf.GGML_QUANT_SIZES[qtype]


def bytes_per_row(qtype: T, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` elements; the row must be a whole number of blocks."""
    block, size = block_shape(qtype)
    if n_cols <= 0 or n_cols % block:
        raise ModelError(f"a {qtype.name} row must be a positive multiple of {block} elements, got {n_cols}")
    return n_cols // block * size


def tensor_nbytes(qtype: T, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of the logical numpy-order ``shape``."""
    if not shape:
        raise ModelError("a tensor needs at least one dimension")
    return math.prod(shape[:-1]) * bytes_per_row(qtype, shape[-1])


# ---------------------------------------------------------------------------------------------
# torch dequantisers


def _as_dtype(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a flat uint8 tensor as ``dtype``, copying only if alignment forbids a view."""
    try:
        return flat.view(dtype)
    except RuntimeError:
        return flat.clone().view(dtype)


def _f16_column(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 of shape (n_blocks, 1)."""
    if offset % 2 == 0 and blocks.shape[1] % 2 == 0:
        try:
            # a strided fp16 view of the column: no gather copy of the scales before converting
            return blocks.view(torch.int16)[:, offset // 2 : offset // 2 + 1].view(torch.float16).float()
        except RuntimeError:
            pass  # storage not 2-byte aligned: gather first
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Split (..., k) bytes into (..., 2, k): low nibbles then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins (uint8, (n, 8))."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _deq_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16_column(blocks, 0)
    q = blocks[:, 2:].view(torch.int8).float()
    return q.mul_(d)


def _deq_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_column(blocks, 0)
    q = _nibbles(blocks[:, 2:]).reshape(n, 32).float().sub_(8.0)
    return q.mul_(d)


def _deq_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_column(blocks, 0)
    dmin = _f16_column(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return q.mul_(scale).sub_(offset).reshape(n, _QK_K)


def _deq_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16_column(blocks, 0)
    dmin = _f16_column(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    qh = blocks[:, 16:48].unsqueeze(1)  # (n, 1, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    high = ((qh >> shifts) & 1) << 4  # (n, 8, 32)
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (low | high).float()
    return q.mul_(scale).sub_(offset).reshape(n, _QK_K)


def _deq_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16_column(blocks, 208)
    low = _nibbles(ql).reshape(n, 2, 4, 32)  # (half, quarter, l): quarters 0,1 low nibbles; 2,3 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    high = ((qh >> shifts) & 3) << 4  # (n, 2, 4, 32)
    q = (low | high).view(torch.int8).float().sub_(32.0).reshape(n, 16, 16)
    return q.mul_((d * scales).unsqueeze(-1)).reshape(n, _QK_K)


_BLOCK_DEQUANTISERS = {
    T.Q8_0: _deq_q8_0,
    T.Q4_0: _deq_q4_0,
    T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k,
    T.Q6_K: _deq_q6_k,
}


def dequantize(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 tensor of ``shape`` from the raw uint8 bytes of a tensor of type ``qtype``.

    ``raw`` may be flat or shaped ``[rows, bytes_per_row]`` (any shape holding exactly
    ``tensor_nbytes(qtype, shape)`` bytes in row-major order).
    """
    shape = tuple(int(s) for s in shape)
    nbytes = tensor_nbytes(qtype, shape)
    if raw.dtype != torch.uint8:
        raise ModelError(f"raw tensor bytes must be uint8, got {raw.dtype}")
    if raw.numel() != nbytes:
        raise ModelError(f"{qtype.name} tensor of shape {shape} needs {nbytes} bytes, got {raw.numel()}")
    flat = raw.reshape(-1)
    if qtype == T.F32:
        return _as_dtype(flat, torch.float32).view(shape)
    if qtype == T.F16:
        return _as_dtype(flat, torch.float16).float().view(shape)
    if qtype == T.BF16:
        return _as_dtype(flat, torch.bfloat16).float().view(shape)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    return _BLOCK_DEQUANTISERS[qtype](flat.view(-1, size)).view(shape)


# ---------------------------------------------------------------------------------------------
# numpy quantisers

_F32Array = npt.NDArray[np.float32]
_U8Array = npt.NDArray[np.uint8]


def _round_away(x: _F32Array) -> _F32Array:
    """Round half away from zero (ggml's roundf), elementwise."""
    out: _F32Array = np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))
    return out


def _fp16_bytes(x: _F32Array) -> _U8Array:
    """(n,) float32 -> (n, 2) little-endian fp16 bytes."""
    out: _U8Array = x.astype("<f2").reshape(-1, 1).view(np.uint8)
    return out


def _safe_inverse(x: _F32Array) -> _F32Array:
    out = np.zeros_like(x)
    np.divide(np.float32(1.0), x, out=out, where=x != 0)
    return out


def _pack_scale_min_k4(sc: _U8Array, mn: _U8Array) -> _U8Array:
    """Inverse of ``_scale_min_k4``: 8 six-bit scales and mins per block -> 12 bytes."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_mn, hi_mn = mn[:, :4], mn[:, 4:]
    b0 = lo_sc | ((hi_sc >> 4) << 6)
    b1 = lo_mn | ((hi_mn >> 4) << 6)
    b2 = (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4)
    out: _U8Array = np.concatenate((b0, b1, b2), axis=1).astype(np.uint8)
    return out


def _quantize_affine_k(blocks: _F32Array, nmax: int) -> tuple[_U8Array, _U8Array, _U8Array, _U8Array]:
    """Shared Q4_K/Q5_K step: (d, dmin) fp16 bytes, packed scales and q in 0..nmax, (n, 8, 32)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), np.float32(0.0))  # ggml keeps the min <= 0
    hi = sub.max(axis=2)
    sub_scale = (hi - lo) / np.float32(nmax)
    sub_min = -lo
    d = (sub_scale.max(axis=1) / np.float32(63)).astype(np.float16).astype(np.float32)
    dmin = (sub_min.max(axis=1) / np.float32(63)).astype(np.float16).astype(np.float32)
    sc = np.clip(_round_away(sub_scale * _safe_inverse(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(_round_away(sub_min * _safe_inverse(dmin)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc.astype(np.float32)
    eff_min = dmin[:, None] * mn.astype(np.float32)
    q = _round_away((sub + eff_min[:, :, None]) * _safe_inverse(eff_scale)[:, :, None])
    q8 = np.clip(q, 0, nmax).astype(np.uint8)
    return _fp16_bytes(d), _fp16_bytes(dmin), _pack_scale_min_k4(sc, mn), q8


def _pack_nibbles_k(q: _U8Array) -> _U8Array:
    """(n, 8, 32) values < 16 -> (n, 128) bytes: per 64 elements, low nibbles first 32, high next."""
    n = q.shape[0]
    pairs = (q & 0x0F).reshape(n, 4, 2, 32)
    out: _U8Array = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128).astype(np.uint8, copy=False)
    return out


def _quantize_q4_k(blocks: _F32Array) -> _U8Array:
    d, dmin, scales, q = _quantize_affine_k(blocks, 15)
    out: _U8Array = np.concatenate((d, dmin, scales, _pack_nibbles_k(q)), axis=1)
    return out


def _quantize_q5_k(blocks: _F32Array) -> _U8Array:
    d, dmin, scales, q = _quantize_affine_k(blocks, 31)
    bits = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]  # (n, 8, 32)
    qh = np.bitwise_or.reduce(bits, axis=1).astype(np.uint8)
    out: _U8Array = np.concatenate((d, dmin, scales, qh, _pack_nibbles_k(q)), axis=1)
    return out


def _quantize_q6_k(blocks: _F32Array) -> _U8Array:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    # The signed value of largest magnitude maps to -32 (the int6 range is asymmetric).
    idx = np.abs(sub).argmax(axis=2)[:, :, None]
    extreme = np.take_along_axis(sub, idx, axis=2)[:, :, 0]
    sub_scale = extreme / np.float32(-32)
    d = (np.abs(sub_scale).max(axis=1) / np.float32(127)).astype(np.float16).astype(np.float32)
    sc = np.clip(_round_away(sub_scale * _safe_inverse(d)[:, None]), -127, 127).astype(np.int8)
    eff = d[:, None] * sc.astype(np.float32)
    q = np.clip(_round_away(sub * _safe_inverse(eff)[:, :, None]), -32, 31)
    q6 = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # (half, quarter, l)
    low = q6 & 0x0F
    ql = np.concatenate(
        (low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), axis=2
    ).reshape(n, 128)
    high = (q6 >> 4) << (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]
    qh = np.bitwise_or.reduce(high, axis=2).astype(np.uint8).reshape(n, 64)
    out: _U8Array = np.concatenate((ql, qh, sc.view(np.uint8), _fp16_bytes(d)), axis=1)
    return out


_K_QUANTISERS = {T.Q4_K: _quantize_q4_k, T.Q5_K: _quantize_q5_k, T.Q6_K: _quantize_q6_k}


def quantize(x: npt.NDArray[Any], qtype: T) -> _U8Array:
    """Raw bytes, shaped ``(*x.shape[:-1], bytes_per_row)``, of ``x`` stored as ``qtype``.

    F32/F16/BF16/Q8_0/Q4_0 are ggml's reference conversions (via ``gguf.quants``); the K-quants
    use a simple min/max fit per sub-block, exact in layout but not llama.cpp's optimal search.
    """
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if x32.ndim == 0:
        raise ModelError("cannot quantise a 0-d array")
    out_shape = (*x32.shape[:-1], bytes_per_row(qtype, x32.shape[-1]))
    if qtype == T.F32:
        return x32.view(np.uint8).reshape(out_shape)
    if qtype == T.F16:
        return x32.astype("<f2").view(np.uint8).reshape(out_shape)
    if qtype in _K_QUANTISERS:
        blocks = x32.reshape(-1, _QK_K)
        return _K_QUANTISERS[qtype](blocks).reshape(out_shape)
    raw: _U8Array = gguf.quants.quantize(x32, qtype).view(np.uint8)
    return raw.reshape(out_shape)


def dequantize_raw(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes of ``qtype`` -> float32 of ``shape`` (zero-copy for F32).

    Types without a torch dequantiser here (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4: ggml's
    kernels compute them on the engine's paths) go through gguf's numpy reference: exact, slower.
    """
    if qtype == T.F32:
        return raw.contiguous().view(torch.float32).reshape(shape)
    if qtype == T.F16:
        return raw.contiguous().view(torch.float16).reshape(shape).to(torch.float32)
    if qtype not in SUPPORTED_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = raw.reshape(-1, shape[-1] // block * size).numpy()
        try:
            values = gguf.quants.dequantize(rows, qtype)
        except NotImplementedError as exc:
            raise UnsupportedTensorType(f"no dequantiser for {qtype.name}: {exc}") from exc
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    return dequantize(raw, qtype, shape)
