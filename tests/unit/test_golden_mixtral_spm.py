"""The backbone forward and the tokenizer on the Mixtral-style SPM golden (arch llama, merged experts),
against llama.cpp's logits, greedy continuations and tokenisation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from swarm.text.tokenizer import StreamDecoder, Tokenizer
from tests.conftest import greedy_tokens

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden"
GGUF_PATH = GOLDEN / "mixtral-spm-tiny-f32.gguf"
LLAMACPP: dict[str, Any] = json.loads((GOLDEN / "mixtral-spm-tiny-f32.llamacpp.json").read_text(encoding="utf-8"))
TOL_LLAMACPP = 1e-4


@pytest.fixture(scope="module", params=list(KernelBackend), ids=lambda b: b.value)
def model(request: pytest.FixtureRequest) -> GGUFModel:
    """Both kernel backends: ggml's (the default) and the torch reference."""
    m = GGUFModel(GGUF_PATH, kernel=request.param)
    assert m.kernel is request.param
    return m


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_fields(GGUFModel(GGUF_PATH).fields)


def test_model_metadata(model: GGUFModel) -> None:
    assert model.sha256 == LLAMACPP["model_sha256"]
    c, cfg = LLAMACPP["config"], model.config
    assert cfg.arch == "llama" and cfg.spec.rope_neox is False  # adjacent-pair rope, as llama.cpp for llama
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head_kv, cfg.head_dim_k) == (
        c["n_layer"], c["d_model"], c["n_head"], c["n_head_kv"], c["head_dim"],
    )
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_expert, cfg.n_vocab) == (
        c["n_expert"], c["n_expert_used"], c["expert_width"], c["n_vocab"],
    )
    assert model.fields["tokenizer.ggml.model"] == "llama"


@pytest.mark.parametrize("i", range(len(LLAMACPP["sequences"])))
def test_logits_match_llamacpp(model: GGUFModel, i: int) -> None:
    seq = LLAMACPP["sequences"][i]
    tr = Transformer(model)
    logits = tr.forward([SeqChunk(KVCache(tr.cfg, LLAMACPP["settings"]["n_ctx"]), seq["tokens"], 0, all_logits=True)])[0]
    ref = torch.tensor(seq["logits"])
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= TOL_LLAMACPP


def test_chunked_prefill_matches_llamacpp(model: GGUFModel) -> None:
    seq = LLAMACPP["sequences"][0]["tokens"]
    tr = Transformer(model)
    cache = KVCache(tr.cfg, LLAMACPP["settings"]["n_ctx"])
    parts = [tr.forward([SeqChunk(cache, seq[a:b], a, all_logits=True)])[0] for a, b in ((0, 5), (5, 11), (11, 16))]
    ref = torch.tensor(LLAMACPP["sequences"][0]["logits"])
    assert (torch.cat(parts) - ref).abs().max().item() <= TOL_LLAMACPP


def test_greedy_fixture_is_decisive() -> None:
    assert len(LLAMACPP["greedy"]) == 3
    for g in LLAMACPP["greedy"]:
        assert len(g["greedy_ids"]) == g["n_requested"] and g["min_margin"] > LLAMACPP["settings"]["greedy_margin_threshold"]


@pytest.mark.parametrize("case", LLAMACPP["greedy"], ids=lambda c: c["prompt"][:24])
def test_greedy_continuation_matches_llamacpp(model: GGUFModel, tokenizer: Tokenizer, case: dict[str, Any]) -> None:
    """Text in (tokenised here), tokens out (decoded here, as the coordinator streams them)."""
    prompt_ids = tokenizer.encode(case["prompt"])
    assert prompt_ids == case["prompt_ids"]
    out = greedy_tokens(Transformer(model), prompt_ids, len(case["greedy_ids"]), n_ctx=LLAMACPP["settings"]["n_ctx"])
    assert out == case["greedy_ids"]
    stream = StreamDecoder(tokenizer)
    text = "".join(stream.push(t) for t in out) + stream.flush()
    assert text == case["greedy_text"]  # llama_detokenize of the generated ids: no leading space
