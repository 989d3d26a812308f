"""A ``make-model`` tiny model loads in the coordinator's engine and generates (both architectures)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from coordinator.core.scheduler import Emit, Finish, FinishReason, GenParams
from coordinator.runtime import EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer
from swarm.tools.makemodel import make_model


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
async def test_tiny_model_generates(tmp_path: Path, arch: str) -> None:
    path = make_model(arch=arch, size="tiny", seed=3, out=tmp_path / f"{arch}.gguf")  # type: ignore[arg-type]
    model = GGUFModel(path)
    assert model.config.arch == ("qwen3moe" if arch == "qwen3moe" else "llama")
    assert model.config.spec.rope_neox == (arch == "qwen3moe")
    tok = Tokenizer.from_gguf_fields(model.fields)
    rt = EngineRuntime(model, tok, n_slots=2)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        prompt = tok.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
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
