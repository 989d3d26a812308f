"""Generated text leaves control tokens out by default, as llama-server does; ``"skip_special_tokens":
false`` shows them. Through the official ``openai`` client against a real coordinator serving a
generated model (ChatML: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` are its control tokens)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def generated_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from swarm.tools.makemodel import make_model

    return make_model(arch="qwen3moe", size="tiny", seed=7, out=tmp_path_factory.mktemp("model") / "chatml-tiny.gguf")


@pytest.fixture
async def url(nursery: trio.Nursery, generated_model: Path) -> AsyncIterator[str]:
    from coordinator.server import CoordinatorConfig, serve_coordinator

    yield await nursery.start(serve_coordinator, CoordinatorConfig(model=str(generated_model), port=0, slots=2))


async def in_thread(fn: Any, *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


def _chat(c: openai.OpenAI, seed: int, extra: dict[str, Any]) -> Any:
    # ignore_eos: <|im_end|> (the eos) is sampled like any other token; temperature 2 flattens the random
    # model's distribution so control tokens come up within a few hundred tokens
    return c.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hello"}], max_tokens=300, temperature=2.0, seed=seed,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


async def test_control_tokens_are_left_out_unless_asked_for(url: str, generated_model: Path) -> None:
    import gguf

    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    tokens = gguf.GGUFReader(generated_model).fields["tokenizer.ggml.tokens"].contents()
    control_ids = {i for i, t in enumerate(tokens) if t in CONTROL}
    assert len(control_ids) == 3
    for seed in range(40):  # a seed whose reply samples a control token (precondition of the test)
        plain = await in_thread(_chat, c, seed, {})
        ids = plain.choices[0].model_extra["token_ids"]
        if control_ids & set(ids):
            break
    else:
        pytest.fail("no seed sampled a control token")
    shown = await in_thread(_chat, c, seed, {"skip_special_tokens": False})
    assert shown.choices[0].model_extra["token_ids"] == ids  # the same tokens: only their text differs
    text, raw = plain.choices[0].message.content, shown.choices[0].message.content
    assert not any(t in text for t in CONTROL), text
    assert any(t in raw for t in CONTROL), raw
    stripped = raw
    for t in CONTROL:
        stripped = stripped.replace(t, "")
    assert stripped == text

    def streamed(extra: dict[str, Any]) -> str:
        s = c.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hello"}], max_tokens=300, temperature=2.0, seed=seed,
            stream=True, extra_body={"ignore_eos": True, **extra})
        return "".join(ev.choices[0].delta.content or "" for ev in s if ev.choices)

    assert await in_thread(streamed, {}) == text
    assert await in_thread(streamed, {"skip_special_tokens": False}) == raw
    # completions too: the prompt's own control tokens are parsed, the generated ones left out
    comp = await in_thread(c.completions.create, model="any", prompt="<|im_start|>user\nHi<|im_end|>\n", max_tokens=300,
                           temperature=2.0, seed=seed, extra_body={"ignore_eos": True})
    assert not any(t in comp.choices[0].text for t in CONTROL)

