"""The backbone forward against llama.cpp's golden logits and greedy continuations."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel, model_id_for
from swarm.model.kernels import KernelBackend
from tests.conftest import GOLDEN_GGUF

TOL_LLAMACPP = 1e-4
TOL_BATCHED = 1e-5


def greedy(tr: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = KVCache(tr.cfg, 256)
    lg = tr.forward([SeqChunk(cache, list(prompt), 0)])[0][-1]
    out, logits = [], [lg]
    pos = len(prompt)
    for _ in range(n):
        t = int(lg.argmax())
        out.append(t)
        lg = tr.forward([SeqChunk(cache, [t], pos)])[0][-1]
        logits.append(lg)
        pos += 1
    return out, logits


def test_model_id_and_metadata(golden_model: GGUFModel, golden: dict[str, Any]) -> None:
    assert golden_model.sha256 == golden["model_sha256"]
    assert golden_model.model_id == f"qwen3moe-tiny-f32-{golden['model_sha256'][:12]}"
    assert model_id_for(golden_model.path) == golden_model.model_id
    cfg = golden_model.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head_kv, cfg.head_dim_k) == (2, 128, 4, 2, 48)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_expert) == (8, 2, 64)


@pytest.fixture(scope="module")
def torch_model() -> GGUFModel:
    return GGUFModel(GOLDEN_GGUF, kernel=KernelBackend.TORCH)


@pytest.mark.parametrize("backend", list(KernelBackend))
@pytest.mark.parametrize("i", range(3))
def test_logits_match_llamacpp(
    golden_model: GGUFModel, torch_model: GGUFModel, golden: dict[str, Any], i: int, backend: KernelBackend
) -> None:
    """Both kernel backends (ggml's, the default, and the torch reference) on the F32 golden file."""
    seq = golden["sequences"][i]
    model = golden_model if backend is KernelBackend.GGML else torch_model
    assert model.kernel is backend
    tr = Transformer(model)
    logits = tr.forward([SeqChunk(KVCache(tr.cfg, 256), seq["tokens"], 0, all_logits=True)])[0]
    ref = torch.tensor(seq["logits"])
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= TOL_LLAMACPP


def test_chunked_prefill_matches_single_pass(golden_model: GGUFModel, golden: dict[str, Any]) -> None:
    seq = golden["sequences"][0]["tokens"]
    tr = Transformer(golden_model)
    cache = KVCache(tr.cfg, 256)
    parts = [tr.forward([SeqChunk(cache, seq[a:b], a, all_logits=True)])[0] for a, b in ((0, 5), (5, 11), (11, 16))]
    ref = torch.tensor(golden["sequences"][0]["logits"])
    assert (torch.cat(parts) - ref).abs().max().item() <= TOL_LLAMACPP


def test_greedy_continuations_match_llamacpp(golden_model: GGUFModel, golden: dict[str, Any]) -> None:
    tr = Transformer(golden_model)
    for g in golden["greedy"]:
        out, _ = greedy(tr, g["prompt_ids"], len(g["greedy_ids"]))
        assert out == g["greedy_ids"], g["prompt"]


def _margin(lg: torch.Tensor) -> float:
    top = torch.topk(lg, 2).values
    return float(top[0] - top[1])


def test_batched_decode_equals_alone(golden_model: GGUFModel, golden: dict[str, Any]) -> None:
    """Four sequences decoded in one batch give the tokens (and logits) each gives alone."""
    tr = Transformer(golden_model)
    prompts = [g["prompt_ids"] for g in golden["greedy"]] + [golden["tokenize"][2]["ids"]]
    n = 12
    alone = [greedy(tr, p, n) for p in prompts]
    # every step of every prompt must be decisive, or the comparison could flip on noise
    for _, lgs in alone:
        assert min(_margin(lg) for lg in lgs) > 1e-3
    caches = [KVCache(tr.cfg, 256) for _ in prompts]
    # staggered: prompts prefill together in one step, then all decode together
    first = tr.forward([SeqChunk(c, list(p), 0) for c, p in zip(caches, prompts, strict=True)])
    cur = [int(lg[-1].argmax()) for lg in first]
    toks: list[list[int]] = [[t] for t in cur]
    pos = [len(p) for p in prompts]
    for step in range(n):
        lgs = tr.forward([SeqChunk(c, [t], p) for c, t, p in zip(caches, cur, pos, strict=True)])
        for j, lg in enumerate(lgs):
            ref = alone[j][1][step + 1]
            assert (lg[-1] - ref).abs().max().item() <= TOL_BATCHED
        cur = [int(lg[-1].argmax()) for lg in lgs]
        for j, t in enumerate(cur):
            toks[j].append(t)
        pos = [p + 1 for p in pos]
    for j in range(len(prompts)):
        assert toks[j][:n] == alone[j][0][:n]


def test_unsupported_architecture(tmp_path: Any) -> None:
    import gguf

    from swarm.errors import UnsupportedArchitecture

    w = gguf.GGUFWriter(tmp_path / "x.gguf", "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match="supported: deepseek2, gpt-oss, llama, olmoe, qwen2moe, qwen3moe"):
        GGUFModel(tmp_path / "x.gguf")
