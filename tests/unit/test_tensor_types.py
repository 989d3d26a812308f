"""Every tensor type of llama.cpp's common MoE quantisations loads and computes; anything else is a
clear error naming the tensor. The file is written here: d_model and expert width 256 (K-quants need
rows of 256), every tensor kind in a different type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.errors import UnsupportedTensorType
from swarm.model.gguf import SUPPORTED_TYPES, GGUFModel
from swarm.model.kernels import KernelBackend
from swarm.model.kernels import ggml as K

D, F, E, H, HD, VOCAB = 256, 256, 4, 2, 128, 64
# (gate, up, down) per layer, then (q, k, v, o, router) per layer: all 16 types appear
EXPERT_TYPES = [("Q4_1", "Q5_0", "Q5_1"), ("Q2_K", "Q3_K", "IQ4_NL"), ("IQ4_XS", "MXFP4", "Q6_K")]
DENSE_TYPES = [("Q8_0", "Q4_0", "F16", "BF16", "F32"), ("Q5_K", "Q8_0", "Q4_0", "F16", "F32"),
               ("Q6_K", "Q4_K", "Q5_0", "IQ4_NL", "F32")]


def write_model(path: Path, *, bad_type: str | None = None) -> None:
    rng = np.random.default_rng(11)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(len(EXPERT_TYPES))
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_head_count(H)
    w.add_head_count_kv(1)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(F)
    w.add_layer_norm_rms_eps(1e-6)

    def add(name: str, shape: tuple[int, ...], qtype: str, scale: float = 0.05) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, data)
            return
        t = gguf.GGMLQuantizationType[qtype]
        if qtype in K.SUPPORTED_TYPES:
            raw = K.quantize(data, qtype).reshape(*shape[:-1], -1)
        else:  # a type we cannot compute: bytes of the right size are all the loader may look at
            block, size = gguf.GGML_QUANT_SIZES[t]
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=t)

    add("token_embd.weight", (VOCAB, D), "Q8_0", 1.0)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    for i, (et, dt) in enumerate(zip(EXPERT_TYPES, DENSE_TYPES, strict=True)):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
        for name, shape, qtype in ((p + "attn_q.weight", (H * HD, D), dt[0]), (p + "attn_k.weight", (HD, D), dt[1]),
                                   (p + "attn_v.weight", (HD, D), dt[2]), (p + "attn_output.weight", (D, H * HD), dt[3]),
                                   (p + "ffn_gate_inp.weight", (E, D), dt[4])):
            add(name, shape, qtype)
        w.add_tensor(p + "attn_q_norm.weight", np.ones(HD, np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(HD, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
        add(p + "ffn_gate_exps.weight", (E, F, D), et[0])
        add(p + "ffn_up_exps.weight", (E, F, D), et[1])
        add(p + "ffn_down_exps.weight", (E, D, F), bad_type if (bad_type and i == 1) else et[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("types") / "types.gguf"
    write_model(p)
    return p


def test_the_file_holds_every_supported_type(path: Path) -> None:
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
    assert types == set(SUPPORTED_TYPES)


def logits(model: GGUFModel, tokens: list[int]) -> torch.Tensor:
    tr = Transformer(model)
    out: Any = tr.forward([SeqChunk(KVCache(tr.cfg, 64), tokens, 0, all_logits=True)])[0]
    return out


def test_both_backends_compute_every_type_and_agree(path: Path) -> None:
    """ggml quantises activations as llama.cpp does (Q8_0/Q8_1/Q8_K, fp16, bf16); the torch reference
    multiplies in float32: they agree to the activation rounding, about 1 % of the logits' scale."""
    tokens = [3, 17, 42, 5, 9, 60, 1, 33]
    a = logits(GGUFModel(path, kernel=KernelBackend.GGML), tokens)
    b = logits(GGUFModel(path, kernel=KernelBackend.TORCH), tokens)
    assert a.shape == b.shape == (len(tokens), VOCAB) and bool(torch.isfinite(a).all())
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= 0.05 * scale
    assert float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) > 0.999


@pytest.mark.parametrize("bad", ["Q8_1", "TQ2_0"])
def test_an_unsupported_type_names_the_tensor(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "bad.gguf"
    write_model(p, bad_type=bad)
    with pytest.raises(UnsupportedTensorType, match=rf"tensor blk\.1\.ffn_down_exps\.weight of bad\.gguf has type {bad}"):
        GGUFModel(p)


def test_slices_of_every_type_compute_the_same_bits_as_the_model(path: Path, tmp_path: Path) -> None:
    """A volunteer's slice file holds the stored bytes: its kernel gives the coordinator's bits."""
    from swarm.model.kernels import expert_kernel
    from swarm.model.slices import cut_slice, load_slice

    model = GGUFModel(path)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    rows, exps, ws = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 0, 1]), torch.tensor([1.0, 0.5, 0.25, 0.75])
    for layer in range(len(EXPERT_TYPES)):
        sl = load_slice(cut_slice(model, layer, 1, 3))
        remote = expert_kernel(sl.experts).partial_sum(x, rows, exps, ws)
        local = expert_kernel(model.expert_stack(layer, 1, 3)).partial_sum(x, rows, exps, ws)
        assert torch.equal(remote, local) and bool(remote.abs().sum() > 0)
