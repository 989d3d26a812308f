"""The engine runtime survives failing steps and broken numbers, and never loses text at the end."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from coordinator.core.scheduler import Emit, Finish, GenParams
from coordinator.dispatch.layer import LayerCall
from coordinator.engine.model import LocalExperts
from coordinator.engine.runtime import EngineFailed, EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer


class Flaky(LocalExperts):
    """Local experts (never a fused layer), except while ``mode`` says to raise or to return inf."""

    def __init__(self, model: GGUFModel) -> None:
        super().__init__(model)
        self.mode = "ok"

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        return False

    def result(self, call: LayerCall) -> np.ndarray:
        if self.mode == "raise":
            raise RuntimeError("expert backend exploded")
        out = super().result(call)
        return np.full_like(out, float("inf")) if self.mode == "inf" else out


async def run(rt: EngineRuntime, prompt: list[int], **kw: Any) -> tuple[list[int], str, object]:
    h = rt.submit(prompt, GenParams(**kw))
    ids: list[int] = []
    text = ""
    last: object = None
    async for ev in h.events:
        if isinstance(ev, Emit):
            ids.extend(ev.token_ids)
            text += ev.text
        last = ev
    return ids, text, last


async def test_engine_outlives_failures(golden_model: GGUFModel, golden: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf_fields(golden_model.fields)
    backend = Flaky(golden_model)
    rt = EngineRuntime(golden_model, tok, n_slots=2, experts=backend)
    g = golden["greedy"][0]
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        for mode, temperature in (("raise", 0.0), ("inf", 0.0), ("inf", 0.8)):
            backend.mode = mode
            with trio.fail_after(10):
                _, _, last = await run(rt, g["prompt_ids"], max_tokens=5, temperature=temperature)
            assert isinstance(last, EngineFailed), mode
            backend.mode = "ok"
            with trio.fail_after(10):
                ids, _, last = await run(rt, g["prompt_ids"], max_tokens=24, temperature=0.0)
            assert isinstance(last, Finish) and ids == g["greedy_ids"]
            assert rt.busy() == 0
        n.cancel_scope.cancel()


async def test_text_equals_decode_at_every_cut(golden_model: GGUFModel, golden: dict[str, Any]) -> None:
    """Random weights emit broken UTF-8; whatever max_tokens cuts it at, the streamed text is the
    detokenisation of the ids (an incomplete tail becomes U+FFFD, it is not dropped)."""
    tok = Tokenizer.from_gguf_fields(golden_model.fields)
    rt = EngineRuntime(golden_model, tok, n_slots=2)
    g = golden["greedy"][0]
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        for cut in range(1, 25):
            ids, text, _ = await run(rt, g["prompt_ids"], max_tokens=cut, temperature=0.0)
            assert ids == g["greedy_ids"][:cut]
            assert text == tok.decode(ids), cut
        n.cancel_scope.cancel()


async def test_incomplete_utf8_tail_is_flushed_at_max_tokens(golden_model: GGUFModel, monkeypatch: Any) -> None:
    import coordinator.engine.runtime as runtime_mod

    tok = Tokenizer.from_gguf_fields(golden_model.fields)
    lead = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\xe4")  # starts a 3-byte character
    plain = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"a")
    forced = iter([plain, lead])
    monkeypatch.setattr(runtime_mod, "sample", lambda *a, **k: next(forced))
    rt = EngineRuntime(golden_model, tok, n_slots=1)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        ids, text, last = await run(rt, [1, 2, 3], max_tokens=2, temperature=0.0)
        n.cancel_scope.cancel()
    assert ids == [plain, lead] and isinstance(last, Finish)
    assert text == "a\ufffd" == tok.decode(ids)
