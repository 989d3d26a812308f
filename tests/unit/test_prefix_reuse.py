"""Reusable prefixes are exact: a kept prefix's KV rows copied into a slot, then the rest of the
prompt prefilled, gives the bits of one fresh prefill (every architecture ``make-model`` generates),
and the engine generates the same tokens with the prefix cache on and off (greedy and seeded)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import trio

from coordinator.core.scheduler import Emit, Finish, GenParams
from coordinator.engine.model import KVCache, SeqChunk, Transformer
from coordinator.engine.runtime import EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from swarm.text.tokenizer import Tokenizer
from swarm.tools.makemodel import make_model

ARCHS = ("qwen3moe", "mixtral", "qwen2moe", "olmoe", "deepseek2", "gpt-oss")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("models")
    return {a: make_model(arch=a, size="tiny", seed=3, out=out / f"{a}.gguf", vocab="bpe")  # type: ignore[arg-type]
            for a in ARCHS}


def _split_prefill(tr: Transformer, toks: list[int], m: int, dtype: torch.dtype, *, shift: int = 0
                   ) -> tuple[torch.Tensor, KVCache]:
    """Prefill ``toks[:m + shift]`` in one cache, copy its rows ``[shift, m + shift)`` into a second
    cache as rows ``[0, m)``, and prefill ``toks[m:]`` there (logits at every position)."""
    a = KVCache(tr.cfg, 128, dtype)
    tr.forward([SeqChunk(a, toks[: m + shift], 0)])
    k, v = a.copy_rows(m + shift)
    b = KVCache(tr.cfg, 128, dtype)
    b.load_rows(k[:, shift:], v[..., shift:], m)
    return tr.forward([SeqChunk(b, toks[m:], m, all_logits=True)])[0], b


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_rows_give_a_fresh_prefills_bits(models: dict[str, Path], arch: str) -> None:
    tr = Transformer(GGUFModel(models[arch]))
    rng = random.Random(1)
    toks = [rng.randrange(3, tr.cfg.n_vocab) for _ in range(60)]
    for dtype in (torch.float16, torch.float32):
        full = KVCache(tr.cfg, 128, dtype)
        want = tr.forward([SeqChunk(full, toks, 0, all_logits=True)])[0]
        # split points inside, at and after a KV_PAD boundary, the first and the last token
        for m in (1, 31, 32, 33, 59):
            got, cache = _split_prefill(tr, toks, m, dtype)
            assert torch.equal(got, want[m:]), (arch, dtype, m)
            assert torch.equal(cache.k, full.k) and torch.equal(cache.v, full.v), (arch, dtype, m)
        # the comparison sees a row one position off: the prefix's rows taken one token later differ
        off, _ = _split_prefill(tr, toks, 32, dtype, shift=1)
        assert not torch.equal(off, want[32:]), (arch, dtype)


def test_torch_backend_keeps_no_prefixes(models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The torch reference path is not batch-invariant (a prompt prefilled in two pieces differs from
    one piece by ~1e-4 in its logits), so reused rows would not be exact: the cache stays off."""
    model = GGUFModel(models["qwen3moe"], kernel=KernelBackend.TORCH)
    rt = EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=1, n_ctx=64, prefix_cache_bytes=1 << 20)
    assert rt.prefixes is None and rt.sched.prefixes is None
    assert "prefix cache is off" in caplog.text


async def _generate(rt: EngineRuntime, prompt: list[int], params: GenParams) -> tuple[list[int], Finish]:
    h = rt.submit(prompt, params)
    ids: list[int] = []
    fin: Finish | None = None
    async for ev in h.events:
        if isinstance(ev, Emit):
            ids.extend(ev.token_ids)
        elif isinstance(ev, Finish):
            fin = ev
    assert fin is not None, "the request ended without Finish"
    return ids, fin


async def _conversation(rt: EngineRuntime, rng: random.Random, params: GenParams) -> list[tuple[list[int], int]]:
    """A shared system prompt, two users, then the first user's next turn (its prompt: its first
    prompt, the reply as generated, more tokens): each request's tokens and cached token count."""
    n_vocab = rt.model.config.n_vocab
    system = [rng.randrange(3, n_vocab) for _ in range(40)]
    user1 = [rng.randrange(3, n_vocab) for _ in range(7)]
    user2 = [rng.randrange(3, n_vocab) for _ in range(9)]
    more = [rng.randrange(3, n_vocab) for _ in range(5)]
    out = []
    a, fa = await _generate(rt, system + user1, params)
    out.append((a, fa.n_cached))
    b, fb = await _generate(rt, system + user2, params)
    out.append((b, fb.n_cached))
    c, fc = await _generate(rt, system + user1 + a + more, params)
    out.append((c, fc.n_cached))
    d, fd = await _generate(rt, system + user2, params)  # the same prompt again: all but its last token
    out.append((d, fd.n_cached))
    return out


@pytest.mark.parametrize("arch", ARCHS)
async def test_engine_tokens_are_the_same_with_the_cache_on_and_off(models: dict[str, Path], arch: str) -> None:
    model = GGUFModel(models[arch])
    tok = Tokenizer.from_gguf_fields(model.fields)
    runs = {}
    for mem in (0, 64 << 20):
        rt = EngineRuntime(model, tok, n_slots=2, n_ctx=256, prefix_cache_bytes=mem)
        async with trio.open_nursery() as n:
            await n.start(rt.serve)
            for name, params in (("greedy", GenParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
                                 ("seeded", GenParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True))):
                runs[mem, name] = await _conversation(rt, random.Random(5), params)
            n.cancel_scope.cancel()
        runs[mem, "prompt_tokens"] = rt.stats.prompt_tokens_total  # type: ignore[assignment]
    for name in ("greedy", "seeded"):
        off, on = runs[0, name], runs[64 << 20, name]
        assert [t for t, _ in on] == [t for t, _ in off], (arch, name)
        assert [c for _, c in off] == [0, 0, 0, 0]
    # greedy first: nothing kept yet for its first request; then the system prompt, the whole first
    # conversation (prompt and reply fed: the 11 of 12 generated tokens whose rows were computed), and
    # all but the last token of a prompt seen before
    assert [c for _, c in runs[64 << 20, "greedy"]] == [0, 40, 40 + 7 + 11, 40 + 9 - 1]
    # seeded: the same prompts again (its first request finds the greedy run's whole third conversation)
    assert [c for _, c in runs[64 << 20, "seeded"]] == [40 + 7 - 1, 40 + 9 - 1, 40 + 7 + 11, 40 + 9 - 1]
    assert runs[64 << 20, "prompt_tokens"] < runs[0, "prompt_tokens"]  # type: ignore[operator]
