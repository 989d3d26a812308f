"""Micro-batch overlap in the engine: when the expert backend says a step may go remote
(``overlap``), the step's sequences run as two micro-batches that alternate layer by layer --
each layer's MoE of one is started (``moe_begin``) before the other's dense half computes and is
waited for (``result``) only after it. The logits have the bits of the step computed whole."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.engine.model import KVCache, LocalExperts, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from tests.conftest import FIXTURES


class Whole:
    """Every expert here, through ``moe`` only (no fused layer, no overlap)."""

    def __init__(self, model: GGUFModel) -> None:
        self.local = LocalExperts(model)

    def moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.local.moe(layer, x, ids, w)


class _Later:
    def __init__(self, owner: Deferred, layer: int, args: tuple[torch.Tensor, ...]) -> None:
        self.owner, self.layer, self.args = owner, layer, args

    def result(self) -> torch.Tensor:
        self.owner.log.append(("result", self.layer, int(self.args[0].shape[0])))
        return self.owner.local.moe(self.layer, *self.args)


class Deferred(Whole):
    """A backend whose layers compute only when their result is asked for (a remote share in
    flight), logging the engine's order of starts and waits."""

    def __init__(self, model: GGUFModel, allow: bool = True) -> None:
        super().__init__(model)
        self.allow = allow
        self.log: list[tuple[str, int, int]] = []

    def overlap(self, n_pairs: int) -> bool:
        return self.allow

    def moe_begin(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> _Later:
        self.log.append(("begin", layer, int(x.shape[0])))
        # the engine may reuse its buffers once begin returns only if nothing aliases them: copies
        return _Later(self, layer, (x.clone(), ids.clone(), w.clone()))


def steps(tr: Transformer, prompts: list[list[int]], n_decode: int) -> list[list[torch.Tensor]]:
    """A prefill of every prompt in one step, then ``n_decode`` decode steps of every sequence."""
    caches = [KVCache(tr.cfg, 64) for _ in prompts]
    out = [tr.forward([SeqChunk(c, list(p), 0, all_logits=True) for c, p in zip(caches, prompts, strict=True)])]
    pos = [len(p) for p in prompts]
    for _ in range(n_decode):
        toks = [int(lg[-1].argmax()) for lg in out[-1]]
        out.append(tr.forward([SeqChunk(c, [t], q) for c, t, q in zip(caches, toks, pos, strict=True)]))
        pos = [q + 1 for q in pos]
    return out


@pytest.mark.parametrize("name", ["qwen3moe-tiny-q8_0", "qwen2moe-tiny-q8_0", "deepseek2-tiny-q8_0"])
@pytest.mark.parametrize("n_seq", [2, 3, 5])
def test_two_micro_batches_give_the_bits_of_one_step(name: str, n_seq: int) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    prompts = [[(7 * i + 3 * j + 1) % (model.config.n_vocab - 3) for j in range(2 + i)] for i in range(n_seq)]
    whole = steps(Transformer(model, Whole(model)), prompts, 3)
    be = Deferred(model)
    split = steps(Transformer(model, be), prompts, 3)
    for a, b in zip(whole, split, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # it did alternate: per layer, both micro-batches start before the first one's result is taken
    first = [e for e in be.log if e[1] == 0][:3]
    assert [e[0] for e in first] == ["begin", "begin", "result"], be.log[:6]
    assert sum(1 for e in be.log if e[0] == "begin") == 2 * model.config.n_moe_layer * 4


def test_one_sequence_or_no_overlap_is_one_batch() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    for allow, n_seq in ((True, 1), (False, 3)):
        be: Any = Deferred(model, allow)
        steps(Transformer(model, be), [[1, 2, 3]] * n_seq, 1)
        starts = [e for e in be.log if e[0] == "begin"]
        assert len(starts) == model.config.n_moe_layer * 2  # one start per layer and step
        assert all(a[0] == "begin" and b[0] == "result" for a, b in zip(be.log[::2], be.log[1::2], strict=True))
