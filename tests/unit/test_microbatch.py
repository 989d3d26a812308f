"""Session groups in the engine: when the expert backend says so (``groups``), a step's sequences run
as that many groups, each advancing through the layers on its own -- a group whose layer is in
flight waits while the others compute their dense halves. The logits have the bits of the step
computed whole, whatever the number of groups and whatever order the layers end in."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from coordinator.dispatch.layer import LayerCall, Waker
from coordinator.engine.model import KVCache, LocalExperts, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from tests.conftest import FIXTURES


class Whole(LocalExperts):
    """Every expert here, never a fused layer, one group."""

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        return False


class Deferred(Whole):
    """A backend whose layers end only when serviced a second time (a remote share in flight: the
    engine must go on with other groups meanwhile), in reverse order of their starts when
    ``reverse``; logs the engine's order of starts and ends."""

    def __init__(self, model: GGUFModel, n_groups: int, reverse: bool = False) -> None:
        super().__init__(model)
        self.n_groups, self.reverse = n_groups, reverse
        self.log: list[tuple[str, int, int]] = []
        self.seen: dict[int, int] = {}
        self.open: list[LayerCall] = []

    def groups(self, n_seqs: int, n_pairs: int) -> int:
        return self.n_groups

    def begin(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, *, waker: Waker | None = None
              ) -> LayerCall:
        self.log.append(("begin", layer, int(x.shape[0])))
        call = super().begin(layer, x, ids, w, waker=waker)
        self.open.append(call)
        return call

    def service(self, call: LayerCall) -> bool:
        n = self.seen.get(id(call), 0) + 1
        self.seen[id(call)] = n
        if n == 1:
            return False  # in flight
        if self.reverse and self.open and self.open[-1] is not call and call in self.open:
            return False  # a later start ends first
        if call in self.open:
            self.open.remove(call)
            self.log.append(("end", call.layer, call.n_tok))
        return super().service(call)


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
@pytest.mark.parametrize(("n_seq", "n_groups", "reverse"), [(2, 2, False), (3, 2, True), (5, 3, False), (5, 5, True)])
def test_session_groups_give_the_bits_of_one_step(name: str, n_seq: int, n_groups: int, reverse: bool) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    prompts = [[(7 * i + 3 * j + 1) % (model.config.n_vocab - 3) for j in range(2 + i)] for i in range(n_seq)]
    whole = steps(Transformer(model, Whole(model)), prompts, 3)
    be = Deferred(model, n_groups, reverse)
    split = steps(Transformer(model, be), prompts, 3)
    for a, b in zip(whole, split, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # the groups advanced on their own: every group started layer 0 before the first one ended
    first = [e for e in be.log if e[1] == 0][: n_groups + 1]
    assert [e[0] for e in first] == ["begin"] * n_groups + ["end"], be.log[: 2 * n_groups]
    assert sum(1 for e in be.log if e[0] == "begin") == n_groups * model.config.n_moe_layer * 4
    assert sum(1 for e in be.log if e[0] == "end") == n_groups * model.config.n_moe_layer * 4


def test_one_sequence_or_one_group_is_one_batch() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    for n_groups, n_seq in ((4, 1), (1, 3)):
        be: Any = Deferred(model, n_groups)
        steps(Transformer(model, be), [[1, 2, 3]] * n_seq, 1)
        starts = [e for e in be.log if e[0] == "begin"]
        assert len(starts) == model.config.n_moe_layer * 2  # one start per layer and step
        assert all(a[0] == "begin" and b[0] == "end" for a, b in zip(be.log[::2], be.log[1::2], strict=True))
