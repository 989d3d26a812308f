"""A ``make-model`` tiny model loads in the coordinator's engine and generates (every architecture,
and Mixtral with its SentencePiece vocabulary); its chat template renders."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from coordinator.core.scheduler import Emit, Finish, FinishReason, GenParams
from coordinator.engine.runtime import EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.text.chat import render_chat
from swarm.text.tokenizer import Tokenizer
from swarm.tools.makemodel import GGUF_ARCH, make_model


@pytest.mark.parametrize(("arch", "vocab"), [("qwen3moe", "bpe"), ("mixtral", "bpe"), ("mixtral", "spm"),
                                             ("qwen2moe", "bpe"), ("olmoe", "bpe"), ("deepseek2", "bpe"),
                                             ("gpt-oss", "bpe")])
async def test_tiny_model_generates(tmp_path: Path, arch: str, vocab: str) -> None:
    path = make_model(arch=arch, size="tiny", seed=3, out=tmp_path / f"{arch}.gguf", vocab=vocab)  # type: ignore[arg-type]
    model = GGUFModel(path)
    assert model.config.arch == GGUF_ARCH[arch]
    assert model.config.spec.rope_neox == (arch in ("qwen3moe", "qwen2moe", "olmoe", "gpt-oss"))
    tok = Tokenizer.from_gguf_fields(model.fields)
    rt = EngineRuntime(model, tok, n_slots=2)
    text = render_chat(model.fields["tokenizer.chat_template"], [{"role": "user", "content": "Hello there"}])
    if tok.add_bos and text.startswith("<s>"):  # as the chat endpoint: the tokenizer adds the bos
        text = text[len("<s>"):]
    assert ("[INST] Hello there [/INST]" if vocab == "spm" else "<|im_start|>user\nHello there<|im_end|>") in text
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        prompt = tok.encode(text)
        outs = []
        for seed in (None, 5):
            h = rt.submit(prompt, GenParams(max_tokens=20, temperature=0.0 if seed is None else 0.8, seed=seed, ignore_eos=True))
            ids: list[int] = []
            fin = None
            async for ev in h.events:
                if isinstance(ev, Emit):
                    ids.extend(ev.token_ids)
                elif isinstance(ev, Finish):
                    fin = ev
            assert fin is not None and fin.reason is FinishReason.LENGTH and fin.n_decoded == 20
            assert len(ids) == 20 and all(0 <= t < model.config.n_vocab for t in ids)
            outs.append(ids)
        n.cancel_scope.cancel()
    greedy, sampled = outs
    assert len(set(greedy)) > 3  # not collapsed onto one token
    assert greedy != sampled
