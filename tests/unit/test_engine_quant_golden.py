"""The engine on a quantised GGUF made and run by llama.cpp (``benchmarks/make_goldens.py``): the
tiny golden quantised to Q8_0 by llama.cpp's own quantiser, its logits and greedy continuations from
llama.cpp with an F32 KV cache. ggml's kernels quantise activations as llama.cpp does, so the
engine reproduces them (measured: 6e-8); the torch reference path (dequantise, float32) does not."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from coordinator.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from tests.conftest import FIXTURES

NAME = "qwen3moe-tiny-q8_0"
TOL = 1e-3


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "golden" / f"{NAME}.llamacpp.json").read_text())
    return data


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(FIXTURES / "golden" / f"{NAME}.gguf")


def test_the_file_is_llamacpps_q8_0(model: GGUFModel, golden: dict[str, Any]) -> None:
    assert model.sha256 == golden["model_sha256"]
    types = {t.qtype.name for t in model.tensors.values()}
    assert "Q8_0" in types and {t.qtype.name for n, t in model.tensors.items() if "ffn_gate_exps" in n} == {"Q8_0"}


@pytest.mark.parametrize("i", range(3))
def test_logits_match_llamacpp(model: GGUFModel, golden: dict[str, Any], i: int) -> None:
    seq = golden["sequences"][i]
    tr = Transformer(model)
    logits = tr.forward([SeqChunk(KVCache(tr.cfg, 256), seq["tokens"], 0, all_logits=True)])[0]
    assert (logits - torch.tensor(seq["logits"])).abs().max().item() <= TOL


@pytest.mark.parametrize("i", range(3))
def test_greedy_continuations_match_llamacpp(model: GGUFModel, golden: dict[str, Any], i: int) -> None:
    g = golden["greedy"][i]
    tr = Transformer(model)
    cache = KVCache(tr.cfg, 256)
    lg = tr.forward([SeqChunk(cache, list(g["prompt_ids"]), 0)])[0][-1]
    out, pos = [], len(g["prompt_ids"])
    for _ in range(len(g["greedy_ids"])):
        t = int(lg.argmax())
        out.append(t)
        lg = tr.forward([SeqChunk(cache, [t], pos)])[0][-1]
        pos += 1
    assert out == g["greedy_ids"]


def test_the_torch_reference_does_not_reproduce_llamacpp_on_quantised_weights(golden: dict[str, Any]) -> None:
    """Why the default is ggml: dequantise-then-float32 skips llama.cpp's activation quantisation."""
    ref = GGUFModel(FIXTURES / "golden" / f"{NAME}.gguf", kernel=KernelBackend.TORCH)
    tr = Transformer(ref)
    seq = golden["sequences"][0]
    logits = tr.forward([SeqChunk(KVCache(tr.cfg, 256), seq["tokens"], 0, all_logits=True)])[0]
    assert (logits - torch.tensor(seq["logits"])).abs().max().item() > 10 * TOL
