"""A local layer's routed MoE inside its AttnOut graph (``AttnOutMoE``): the same bits as the
separate path (AttnOut graph, numpy top-k, the layer path of ``coordinator.dispatch``, the residual add), on every
architecture whose gate it computes, for decode steps of 1-16 rows; each row's result does not
depend on the other rows; the engine uses it only when the expert backend says the layer is
computed here whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from coordinator.engine.model import FUSED_MAX_ROWS, KVCache, LocalExperts, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from tests.conftest import FIXTURES

FUSING = ["qwen3moe-tiny-q8_0", "qwen3moe-small-w224-q4_k_m", "qwen3moe-tiny-q4_0", "olmoe-tiny-q8_0", "qwen2moe-tiny-q8_0",
          "qwen2moe-tiny-mxfp4_moe", "mixtral-spm-tiny-q8_0", "deepseek2-tiny-q8_0", "qwen3moe-tiny-f32"]


class Unfused(LocalExperts):
    """The same local experts never computing a layer whole: the engine takes the separate path."""

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        return False


class Counting(LocalExperts):
    def __init__(self, model: GGUFModel, allow: bool) -> None:
        super().__init__(model)
        self.allow, self.asked, self.ran = allow, 0, []

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        self.asked += 1
        return self.allow

    def ran_here(self, layer: int, experts: np.ndarray, seconds: float) -> None:
        self.ran.append((layer, experts.copy()))


def _decode(tr: Transformer, n_seq: int, steps: int) -> list[list[torch.Tensor]]:
    vocab = tr.cfg.n_vocab
    caches = [KVCache(tr.cfg, 128) for _ in range(n_seq)]
    prompts = [[(7 * j + 5 * i + 1) % (vocab - 3) for j in range(FUSED_MAX_ROWS + 3)] for i in range(n_seq)]
    out = [tr.forward([SeqChunk(c, p, 0) for c, p in zip(caches, prompts, strict=True)])]
    toks = [int(o[-1].argmax()) for o in out[-1]]
    for s in range(steps):
        out.append(tr.forward([SeqChunk(c, [t], len(prompts[0]) + s) for c, t in zip(caches, toks, strict=True)]))
        toks = [int(o[-1].argmax()) for o in out[-1]]
    return out


@pytest.mark.parametrize("name", FUSING)
def test_fused_layers_give_the_separate_paths_bits(name: str) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    fused, plain = Transformer(model, LocalExperts(model)), Transformer(model, Unfused(model))
    assert fused._ggml is not None and any(m is not None for m in fused._ggml.attn_out_moe)
    for n_seq in (1, 3, 16):
        for a, b in zip(_decode(fused, n_seq, 4), _decode(plain, n_seq, 4), strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), (name, n_seq)


def test_a_fused_rows_result_does_not_depend_on_the_other_rows() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-small-w224-q4_k_m.gguf")
    tr = Transformer(model)
    assert tr._ggml is not None
    blk = tr._ggml.attn_out_moe[1]
    assert blk is not None
    rng = np.random.default_rng(3)
    a = rng.standard_normal((FUSED_MAX_ROWS, blk.a)).astype(np.float32) * 0.3
    x = rng.standard_normal((FUSED_MAX_ROWS, blk.d)).astype(np.float32)
    alone = [blk(a[i:i + 1], x[i:i + 1]) for i in range(FUSED_MAX_ROWS)]
    for n in (1, 2, 3, 8, 16):
        for threads in (1, 2):
            xn, ids = blk(a[:n], x[:n], threads)
            assert np.array_equal(xn.view(np.uint32), np.concatenate([r[0] for r in alone[:n]]).view(np.uint32))
            assert np.array_equal(ids, np.concatenate([r[1] for r in alone[:n]]))
            assert (np.diff(ids, axis=1) > 0).all()  # each row's experts, ascending and distinct


@pytest.mark.parametrize("allow", [True, False])
def test_the_backend_decides_and_hears(allow: bool) -> None:
    """Fused only where ``whole_layer_here`` allows; ``ran_here`` gets each fused layer's experts, which are
    the separate path's top-k."""
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    be = Counting(model, allow)
    tr = Transformer(model, be)
    out = _decode(tr, 2, 3)
    steps = 4  # the prompt (in the stack graph, asked too) and 3 decode steps
    assert be.asked == steps * model.config.n_moe_layer
    if not allow:
        assert be.ran == []
        return
    assert [layer for layer, _ in be.ran] == list(range(model.config.n_moe_layer)) * steps
    plain = Transformer(model, Unfused(model))
    seen: list[Any] = []
    plain.select_np = lambda p, f=plain.select_np: seen.append(f(p)[0]) or f(p)  # type: ignore[method-assign]
    assert all(torch.equal(x, y) for a, b in zip(out, _decode(plain, 2, 3), strict=True) for x, y in zip(a, b, strict=True))
    for (_, ids), want in zip(be.ran, seen, strict=True):
        assert np.array_equal(ids, np.sort(want, axis=1))


@pytest.mark.parametrize("name", ["deepseek2-groups-tiny-f32", "gpt-oss-tiny-q8_0"])
def test_the_gate_graph_selects_as_the_torch_gate(name: str) -> None:
    """``Gate`` (the ggml path's top-k for the gates ``select_np`` does not compute): the experts of
    ``select_torch``; DeepSeek's grouped weights bit for bit (gathered, renormalised in double, scaled),
    gpt-oss's softmax over the chosen logits within float32 rounding (ggml's exp, not torch's)."""
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    tr = Transformer(model, LocalExperts(model))
    assert tr._ggml is not None and tr._ggml.gate is not None
    rng = np.random.default_rng(3)
    n = model.config.n_expert
    logits = rng.standard_normal((40, n)).astype(np.float32) * 2
    probs = logits if model.config.spec.gating == "softmax_topk" else torch.softmax(torch.from_numpy(logits), -1).numpy()
    ids, w = tr._ggml.gate(probs)
    t_ids, t_w = tr.select_torch(torch.from_numpy(probs))
    order, t_order = np.argsort(ids, axis=1), np.argsort(t_ids.numpy(), axis=1)
    assert np.array_equal(np.take_along_axis(ids, order, 1), np.take_along_axis(t_ids.numpy(), t_order, 1))
    a, b = np.take_along_axis(w, order, 1), np.take_along_axis(t_w.numpy(), t_order, 1)
    if model.config.n_expert_groups > 1:
        assert np.array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
