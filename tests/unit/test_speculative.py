"""Speculative decoding in the engine gives the tokens (and text) of plain decoding, greedy and with
seeded sampling, on three architectures: whatever the drafter proposes -- always right, always wrong,
n-gram lookup, the model's own blocks -- and with drafted and plain sessions sharing steps."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from coordinator.core.scheduler import Emit, Finish, GenParams
from coordinator.engine.drafters import HeldOnlyExperts, ModelDrafter, NgramDrafter
from coordinator.engine.model import Transformer
from coordinator.engine.runtime import EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer
from tests.conftest import FIXTURES

ARCHS = ["qwen3moe-tiny-q8_0", "qwen2moe-tiny-q8_0", "deepseek2-tiny-q8_0"]
N_TOKENS = 20


class Oracle:
    """Drafts from known continuations: right (the reference's next tokens) or always wrong."""

    def __init__(self, name: str, refs: dict[tuple[int, ...], list[int]], right: bool, n_vocab: int) -> None:
        self.name, self.refs, self.right, self.n_vocab = name, refs, right, n_vocab
        self.proposed = 0

    def propose(self, slot: int, history: list[int], k: int) -> list[int]:
        for prompt, ref in self.refs.items():
            if tuple(history[: len(prompt)]) == prompt:
                nxt = ref[len(history) - len(prompt):][:k]
                self.proposed += len(nxt)
                return nxt if self.right else [(t + 1) % self.n_vocab for t in nxt]
        return []

    def reset(self, slot: int) -> None:
        pass


async def complete(rt: EngineRuntime, prompts: list[list[int]], **kw: Any) -> list[tuple[list[int], str]]:
    """The prompts' completions, all at once (their steps are shared)."""
    out: list[tuple[list[int], str]] = [([], "")] * len(prompts)

    async def one(i: int) -> None:
        h = rt.submit(prompts[i], GenParams(**kw))
        ids: list[int] = []
        text = ""
        async for ev in h.events:
            if isinstance(ev, Emit):
                ids.extend(ev.token_ids)
                text += ev.text
            elif not isinstance(ev, Finish):
                raise AssertionError(f"the request failed: {ev}")
        out[i] = (ids, text)

    async with trio.open_nursery() as n:
        for i in range(len(prompts)):
            n.start_soon(one, i)
    return out


def prompts_for(model: GGUFModel) -> list[list[int]]:
    v = model.config.n_vocab - 3
    repetitive = [(3 * j) % v + 1 for j in range(6)] * 3  # something for the n-gram lookup to find
    return [[(7 * j + 1) % v + 1 for j in range(5)], repetitive, [(11 * j + 5) % v + 1 for j in range(9)]]


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}],
                         ids=["greedy", "seeded"])
async def test_speculative_decoding_gives_the_tokens_of_plain_decoding(name: str, sampling: dict[str, Any]) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    tok = Tokenizer.from_gguf_fields(model.fields)
    prompts = prompts_for(model)
    kw = {"max_tokens": N_TOKENS, "ignore_eos": True, **sampling}
    plain_rt = EngineRuntime(model, tok, n_slots=3)
    async with trio.open_nursery() as n:
        await n.start(plain_rt.serve)
        plain = await complete(plain_rt, prompts, **kw)
        n.cancel_scope.cancel()
    refs = {tuple(p): ids for p, (ids, _) in zip(prompts, plain, strict=True)}
    right = Oracle("right", refs, True, model.config.n_vocab)
    wrong = Oracle("wrong", refs, False, model.config.n_vocab)
    n_ctx = 256
    selfd = ModelDrafter("self", Transformer(model, HeldOnlyExperts(model, {})), 3, n_ctx)
    drafters = {"right": right, "wrong": wrong, "ngram": NgramDrafter(), "self": selfd}
    for draft in ("right", "wrong", "ngram", "self"):
        rt = EngineRuntime(model, tok, n_slots=3, n_ctx=n_ctx, drafters=drafters, draft=draft, draft_max=4)  # type: ignore[arg-type]
        async with trio.open_nursery() as n:
            await n.start(rt.serve)
            got = await complete(rt, prompts, **kw)
            n.cancel_scope.cancel()
        assert got == plain, draft  # the same tokens and the same streamed text
        stats = rt.drafts[draft]
        if draft == "right":  # every draft accepted: fewer steps than tokens
            assert stats.proposed > 0 and stats.accepted == stats.proposed
            assert rt.stats.steps_total < 3 + N_TOKENS  # the prefills, then several tokens a step
        if draft == "wrong":  # every draft rejected; the length backs off to none
            assert stats.proposed > 0 and stats.accepted == 0
            assert stats.proposed < 3 * N_TOKENS


async def test_a_mixed_step_keeps_plain_sessions_plain() -> None:
    """A request that asks for no draft shares steps with drafted ones and gets its own tokens."""
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    tok = Tokenizer.from_gguf_fields(model.fields)
    prompts = prompts_for(model)
    rt = EngineRuntime(model, tok, n_slots=3, drafters={"ngram": NgramDrafter()}, draft="ngram")
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        mixed = await complete(rt, prompts, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        h = rt.submit(prompts[0], GenParams(max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0, draft="none"))
        ids: list[int] = []
        async for ev in h.events:
            if isinstance(ev, Emit):
                ids.extend(ev.token_ids)
        n.cancel_scope.cancel()
    assert ids == mixed[0][0]


async def test_a_drafter_not_available_is_a_clear_request_error() -> None:
    from swarm.errors import RequestError

    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    rt = EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=1, drafters={"ngram": NgramDrafter()})
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        with pytest.raises(RequestError, match="'draft' 'model' is not available here") as e:
            rt.submit([1, 2, 3], GenParams(draft="model"))
        assert e.value.code == "invalid_parameter" and e.value.param == "draft"
        n.cancel_scope.cancel()
