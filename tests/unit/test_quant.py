"""swarm.model.quant: torch dequantisers against gguf's numpy reference, and the numpy quantisers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from swarm.errors import ModelError, UnsupportedTensorType
from swarm.model import quant

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES

# Byte offsets of the fp16 scales inside one block of each type.
FP16_OFFSETS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = 20240601 + len(request.node.name)
    print(f"numpy seed: {seed}")
    return np.random.default_rng(seed)


def random_raw(rng: np.random.Generator, qtype: T, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random bytes for ``rows`` rows of a type: every bit pattern, except that fp16 scales are
    finite (random signs, exponents and mantissas) so the reference never meets inf or nan."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in FLOAT_TYPES:
        x = (rng.standard_normal(rows * blocks_per_row) * 10.0 ** rng.integers(-3, 4, rows * blocks_per_row))
        if qtype == T.F32:
            return x.astype(np.float32).view(np.uint8).reshape(rows, -1)
        if qtype == T.F16:
            return x.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for off in FP16_OFFSETS[qtype]:
        scales = (rng.standard_normal(raw.shape[0]) * 10.0 ** rng.integers(-4, 2, raw.shape[0])).astype("<f2")
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * size)


def logical_shape(qtype: T, raw: np.ndarray) -> tuple[int, ...]:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (raw.shape[0], raw.shape[1] // size * block)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_bitwise(rng: np.random.Generator, qtype: T) -> None:
    raw = random_raw(rng, qtype, rows=6, blocks_per_row=4 if qtype in BLOCK_TYPES else 96)
    shape = logical_shape(qtype, raw)
    expected = gguf.quants.dequantize(raw, qtype)
    raw_t = torch.from_numpy(raw.copy())
    got = quant.dequantize(raw_t, qtype, shape)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == shape
    assert np.isfinite(expected).all()
    # bit-identical: compare the float32 bit patterns, not values
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
    assert torch.equal(raw_t, torch.from_numpy(raw)), "dequantize must not write to raw"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_accepts_flat_and_stacked_layouts(rng: np.random.Generator, qtype: T) -> None:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    n_experts, rows, cols = 3, 4, 2 * max(block, 32)
    raw = random_raw(rng, qtype, rows=n_experts * rows, blocks_per_row=cols // block)
    expected = gguf.quants.dequantize(raw, qtype).reshape(n_experts, rows, cols)
    shape = (n_experts, rows, cols)
    flat = quant.dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape)
    stacked = quant.dequantize(torch.from_numpy(raw.reshape(n_experts, rows, -1)), qtype, shape)
    # a view at an odd byte offset (as inside a memory-mapped file) cannot be reinterpreted in place
    buf = np.zeros(raw.size + 1, dtype=np.uint8)
    buf[1:] = raw.reshape(-1)
    unaligned = quant.dequantize(torch.from_numpy(buf)[1:], qtype, shape)
    for got in (flat, stacked, unaligned):
        np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


# Upper bounds on rms(x - dequantize(quantize(x))) / rms(x) for standard normal data (measured:
# F16 2e-4, BF16 1.6e-3, Q8_0 5e-3, Q6_K 1.9e-2, Q5_K 3.9e-2, Q4_K 7.9e-2, Q4_0 8.7e-2).
ROUND_TRIP_RMS = {
    T.F32: 0.0,
    T.F16: 5e-4,
    T.BF16: 3e-3,
    T.Q8_0: 8e-3,
    T.Q6_K: 0.025,
    T.Q5_K: 0.05,
    T.Q4_K: 0.1,
    T.Q4_0: 0.11,
}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_round_trip_error_is_bounded(rng: np.random.Generator, qtype: T) -> None:
    x = (rng.standard_normal((16, 1024)) * 0.05).astype(np.float32)
    raw = quant.quantize(x, qtype)
    assert raw.dtype == np.uint8
    assert raw.shape == (16, quant.bytes_per_row(qtype, 1024))
    assert raw.nbytes == quant.tensor_nbytes(qtype, x.shape)
    # decode with gguf's reference, so the quantiser's block layout is checked independently
    y_ref = gguf.quants.dequantize(raw, qtype)
    y = quant.dequantize(torch.from_numpy(raw), qtype, x.shape).numpy()
    np.testing.assert_array_equal(y, y_ref)
    rel = float(np.sqrt(np.mean((x - y) ** 2) / np.mean(x**2)))
    assert rel <= ROUND_TRIP_RMS[qtype]
    if qtype != T.F32:
        assert rel > 0.0  # the bound is not vacuous: the type does lose precision


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quantisers_handle_degenerate_blocks(qtype: T) -> None:
    x = np.zeros((4, 256), dtype=np.float32)
    x[1] = 0.5  # constant positive block
    x[2] = -3.0  # constant negative block
    x[3, 7] = 1e-3  # a single spike
    y = gguf.quants.dequantize(quant.quantize(x, qtype), qtype)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_allclose(y[1:], x[1:], rtol=0.02, atol=2e-5)


def test_k_quantiser_uses_sub_block_scales(rng: np.random.Generator) -> None:
    # sub-blocks of very different ranges in one super-block each get their own scale (one scale
    # for all 256 values would round the small ones to zero: relative error 1)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    x[0, :32] *= 100.0
    y = gguf.quants.dequantize(quant.quantize(x, T.Q6_K), T.Q6_K)
    small = slice(128, 256)
    rel = np.sqrt(np.mean((x[0, small] - y[0, small]) ** 2) / np.mean(x[0, small] ** 2))
    assert rel < 0.1


def test_sizes() -> None:
    assert quant.bytes_per_row(T.F32, 7) == 28
    assert quant.bytes_per_row(T.BF16, 7) == 14
    assert quant.bytes_per_row(T.Q8_0, 64) == 68
    assert quant.bytes_per_row(T.Q4_0, 64) == 36
    assert quant.bytes_per_row(T.Q4_K, 512) == 288
    assert quant.bytes_per_row(T.Q5_K, 256) == 176
    assert quant.bytes_per_row(T.Q6_K, 256) == 210
    assert quant.tensor_nbytes(T.Q4_K, (4, 1408, 1024)) == 4 * 1408 * 4 * 144
    assert quant.SUPPORTED_TYPES == frozenset(ALL_TYPES)
    with pytest.raises(ModelError, match="multiple of 256"):
        quant.bytes_per_row(T.Q4_K, 128)


def test_unsupported_type_names_the_supported_ones() -> None:
    raw = torch.zeros(84, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorType) as info:
        quant.dequantize(raw, T.Q2_K, (256,))
    assert "Q2_K" in info.value.message
    for t in ALL_TYPES:
        assert t.name in info.value.message
    assert info.value.code == "unsupported_tensor_type"
    with pytest.raises(UnsupportedTensorType):
        quant.quantize(np.zeros((1, 256), dtype=np.float32), T.IQ4_XS)


def test_bad_raw_bytes_are_model_errors() -> None:
    with pytest.raises(ModelError, match="needs 68 bytes"):
        quant.dequantize(torch.zeros(67, dtype=torch.uint8), T.Q8_0, (64,))
    with pytest.raises(ModelError, match="uint8"):
        quant.dequantize(torch.zeros(17, dtype=torch.float32), T.Q8_0, (32,))
