"""The engine on llama.cpp's Q4_0 and Q4_K_M files (``benchmarks/make_goldens.py``): the tiny golden
quantised to Q4_0, and a d_model-256 model quantised to Q4_K_M with its Q5_0/Q6_K/Q8_0 fallbacks.

What holds and what does not (measured; the closing note of issue 9 has the table):

- Most positions are reproduced to the last printed digit (median |Δ| 6e-8 on Q4_0, 1e-6 on Q4_K_M):
  ggml quantises the activations to Q8_0/Q8_K and does integer dot products as llama.cpp does.
- A few positions are off by up to 0.09 (Q4_0: one sequence from position 5 on; Q4_K_M: one
  position). Not a router tie (every top-k gap > 1e-4 there) and not the combine order (llama.cpp's
  rank order changes nothing): an activation lands on a Q8_0/Q8_K rounding boundary, where a
  difference in the last bit (our ggml is 0.15.3, llama-cpp-python 0.3.36 vendors 0.25.3, whose
  K-quant dot products differ by ~1e-6) moves one quantum; on these tiny random models one quantum
  moves the logits by ~0.01-0.1. The Q8_0 file has no such position (test_engine_quant_golden.py
  holds it to 1e-3 everywhere).

So these tests hold the engine to what is robust, and each still separates ggml from the torch
reference (dequantise, float32): torch misses every position by ~0.1 and disagrees with llama.cpp's
greedy token at steps whose margin is 0.06-0.2.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest
import torch

from coordinator.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from tests.conftest import FIXTURES

NAMES = ["qwen3moe-tiny-q4_0", "qwen3moe-small-w224-q4_k_m"]
MEDIAN_TOL = 1e-5  # median over positions of max |Δ logits|: exact arithmetic, not approximate
MAX_TOL = 0.12  # every position: one rounding-boundary flip at most (measured worst 0.092)
DECISIVE = 0.05  # teacher-forced argmax must equal llama.cpp's wherever its margin exceeds this


def _golden(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "golden" / f"{name}.llamacpp.json").read_text())
    return data


def _position_devs(tr: Transformer, golden: dict[str, Any]) -> list[float]:
    devs: list[float] = []
    for seq in golden["sequences"]:
        lg = tr.forward([SeqChunk(KVCache(tr.cfg, 256), seq["tokens"], 0, all_logits=True)])[0]
        devs += (lg - torch.tensor(seq["logits"])).abs().max(dim=1).values.tolist()
    return devs


def _teacher_forced(tr: Transformer, golden: dict[str, Any]) -> list[tuple[bool, float]]:
    """(our argmax == llama.cpp's greedy token, llama.cpp's margin) per greedy step, feeding
    llama.cpp's tokens (one flip does not cascade into a different continuation)."""
    out: list[tuple[bool, float]] = []
    for g in golden["greedy"]:
        toks = list(g["prompt_ids"]) + list(g["greedy_ids"])
        lg = tr.forward([SeqChunk(KVCache(tr.cfg, 256), toks, 0, all_logits=True)])[0]
        p = len(g["prompt_ids"])
        for i, (t, m) in enumerate(zip(g["greedy_ids"], g["margins"], strict=True)):
            out.append((int(lg[p - 1 + i].argmax()) == t, float(m)))
    return out


@pytest.fixture(scope="module", params=NAMES)
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], Transformer]:
    name: str = request.param
    return name, _golden(name), Transformer(GGUFModel(FIXTURES / "golden" / f"{name}.gguf"))


def test_the_files_are_llamacpps(case: tuple[str, dict[str, Any], Transformer]) -> None:
    name, golden, tr = case
    m = tr.model
    assert m.sha256 == golden["model_sha256"]
    types = {n: t.qtype.name for n, t in m.tensors.items()}
    assert types == golden["tensor_types"]
    if name.endswith("q4_k_m"):  # the fallbacks load: Q5_0 and Q8_0 expert tensors beside Q4_K/Q6_K
        assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(types.values())
        assert types["blk.0.ffn_down_exps.weight"] == "Q5_0" and types["blk.3.ffn_down_exps.weight"] == "Q8_0"
    else:
        assert types["blk.0.ffn_gate_exps.weight"] == "Q4_0"


def test_logits_match_llamacpp(case: tuple[str, dict[str, Any], Transformer]) -> None:
    _, golden, tr = case
    devs = _position_devs(tr, golden)
    assert len(devs) == 48
    assert statistics.median(devs) <= MEDIAN_TOL
    assert max(devs) <= MAX_TOL


def test_greedy_tokens_match_llamacpp(case: tuple[str, dict[str, Any], Transformer]) -> None:
    _, golden, tr = case
    steps = _teacher_forced(tr, golden)
    assert len(steps) == 72
    assert all(ok for ok, m in steps if m > DECISIVE)
    assert sum(ok for ok, _ in steps) >= 71  # measured: 72/72 (Q4_0), 71/72 (Q4_K_M; margin 0.009)


@pytest.mark.parametrize("name", NAMES)
def test_the_torch_reference_fails_the_same_checks(name: str) -> None:
    """The checks above can fail: dequantise-then-float32 skips llama.cpp's activation quantisation."""
    golden = _golden(name)
    tr = Transformer(GGUFModel(FIXTURES / "golden" / f"{name}.gguf", kernel=KernelBackend.TORCH))
    devs = _position_devs(tr, golden)
    assert statistics.median(devs) > 100 * MEDIAN_TOL
    steps = _teacher_forced(tr, golden)
    assert not all(ok for ok, m in steps if m > DECISIVE)
