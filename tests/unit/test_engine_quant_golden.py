"""The engine on quantised GGUFs made and run by llama.cpp (``benchmarks/make_goldens.py``): the tiny
golden quantised to Q8_0 and Q4_0, and a d_model-256 model quantised to Q4_K_M with llama.cpp's
Q5_0/Q6_K/Q8_0 fallbacks; llama.cpp's logits and greedy continuations with an F32 KV cache and its
batch-invariant kernels (``GGML_CPU_TILED_MM=0``).

The engine computes each layer with llama.cpp's own ggml ops (RMSNorm, RoPE, attention over a
padded KV view, softmax; activations quantised to Q8_0/Q8_K for integer dot products), so it
reproduces them to the last bits (measured max |Δ|: 6e-8 -- the fixture's 7 decimals -- on Q8_0 and
Q4_0, 1.6e-6 on Q4_K_M). The one deliberate difference is DESIGN §3's combine order (ascending
expert index, so a layer's result does not depend on who computed which range; llama.cpp adds in
top-k rank order), worth ~1e-6; with rank order the Q4_K_M logits are bit-identical too. On these
tiny random models one activation crossing a Q8 rounding boundary moves logits by ~0.01-0.1, which
is why the tolerance would catch any real numeric difference. The torch reference (dequantise,
float32) misses every position by ~0.1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from tests.conftest import FIXTURES

NAMES = ["qwen3moe-tiny-q8_0", "qwen3moe-tiny-q4_0", "qwen3moe-small-w224-q4_k_m"]
TOL = 1e-3


def _golden(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "golden" / f"{name}.llamacpp.json").read_text())
    return data


@pytest.fixture(scope="module", params=NAMES)
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], Transformer]:
    name: str = request.param
    return name, _golden(name), Transformer(GGUFModel(FIXTURES / "golden" / f"{name}.gguf"))


def _max_dev(tr: Transformer, seq: dict[str, Any]) -> float:
    logits = tr.forward([SeqChunk(KVCache(tr.cfg, 256), seq["tokens"], 0, all_logits=True)])[0]
    return float((logits - torch.tensor(seq["logits"])).abs().max().item())


def test_the_files_are_llamacpps(case: tuple[str, dict[str, Any], Transformer]) -> None:
    name, golden, tr = case
    assert tr.model.sha256 == golden["model_sha256"]
    assert golden["settings"]["env"] == {"GGML_CPU_TILED_MM": "0"}
    types = {n: t.qtype.name for n, t in tr.model.tensors.items()}
    assert types == golden["tensor_types"]
    if name.endswith("q4_k_m"):  # llama.cpp's fallbacks load: Q5_0 and Q8_0 expert tensors beside Q4_K/Q6_K
        assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(types.values())
        assert types["blk.0.ffn_down_exps.weight"] == "Q5_0" and types["blk.3.ffn_down_exps.weight"] == "Q8_0"
    else:
        assert types["blk.0.ffn_gate_exps.weight"] == name.rsplit("-", 1)[1].upper()


@pytest.mark.parametrize("i", range(3))
def test_logits_match_llamacpp(case: tuple[str, dict[str, Any], Transformer], i: int) -> None:
    _, golden, tr = case
    assert _max_dev(tr, golden["sequences"][i]) <= TOL


@pytest.mark.parametrize("i", range(3))
def test_greedy_continuations_match_llamacpp(case: tuple[str, dict[str, Any], Transformer], i: int) -> None:
    _, golden, tr = case
    g = golden["greedy"][i]
    cache = KVCache(tr.cfg, 256)
    lg = tr.forward([SeqChunk(cache, list(g["prompt_ids"]), 0)])[0][-1]
    out, pos = [], len(g["prompt_ids"])
    for _ in range(len(g["greedy_ids"])):
        t = int(lg.argmax())
        out.append(t)
        lg = tr.forward([SeqChunk(cache, [t], pos)])[0][-1]
        pos += 1
    assert len(out) == 24 and out == g["greedy_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_the_torch_reference_does_not_reproduce_llamacpp_on_quantised_weights(name: str) -> None:
    """Why the default is ggml: dequantise-then-float32 skips llama.cpp's activation quantisation."""
    tr = Transformer(GGUFModel(FIXTURES / "golden" / f"{name}.gguf", kernel=KernelBackend.TORCH))
    assert _max_dev(tr, _golden(name)["sequences"][0]) > 10 * TOL


@pytest.mark.parametrize("name", ["qwen3moe-tiny-q8_0", "olmoe-tiny-q8_0", "qwen2moe-tiny-q8_0", "mixtral-spm-tiny-q8_0"])
def test_numpy_select_is_torch_select(name: str) -> None:
    """The numpy top-k (``select_np``, what ``select`` uses for these gates) gives the torch
    selection's experts and weight bits, across the renormalising and non-renormalising gates, on
    router probabilities of every shape."""
    import numpy as np

    tr = Transformer(GGUFModel(FIXTURES / "golden" / f"{name}.gguf"))
    assert tr._np_select
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 64):
        for _ in range(50):
            logits = rng.standard_normal((n, tr.cfg.n_expert)).astype(np.float32) * 3
            p = torch.softmax(torch.from_numpy(logits), -1).numpy()
            a_ids, a_w = tr.select_torch(torch.from_numpy(p))
            b_ids, b_w = tr.select_np(p)
            assert np.array_equal(a_ids.numpy(), b_ids)
            assert np.array_equal(a_w.numpy().view(np.uint32), b_w.view(np.uint32))
