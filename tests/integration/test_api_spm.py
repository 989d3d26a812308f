"""The OpenAI API on a Mixtral-style model with a SentencePiece vocabulary (the llama.cpp golden):
llama.cpp's greedy tokens, one BOS in a chat prompt whose template writes ``<s>`` itself (as
llama.cpp's common_chat_templates_apply drops the rendered one), and completion text that keeps the
first token's leading space (a continuation of the prompt) while a chat reply starts its own text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio

from swarm.model.gguf import GGUFModel
from swarm.text.chat import render_chat
from swarm.text.tokenizer import Tokenizer
from tests.conftest import FIXTURES

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SPM = FIXTURES / "golden" / "mixtral-spm-tiny-f32.gguf"


@pytest.fixture
async def spm_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    from coordinator.server import CoordinatorConfig, serve_coordinator

    url = await nursery.start(serve_coordinator, CoordinatorConfig(model=str(SPM), port=0, slots=2, max_queue=2))
    yield url


async def in_thread(fn: Any, *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


async def test_spm_model_over_the_openai_api(spm_url: str) -> None:
    g: dict[str, Any] = json.loads((FIXTURES / "golden" / "mixtral-spm-tiny-f32.llamacpp.json").read_text())
    model = GGUFModel(SPM, compute_id=False)
    tok = Tokenizer.from_gguf_fields(model.fields)
    c = openai.OpenAI(base_url=spm_url + "/v1", api_key="none", max_retries=0)
    mid = (await in_thread(c.models.list)).data[0].id
    e = g["greedy"][2]  # its first generated token is "▁ch": a leading space a completion must keep
    r = await in_thread(c.completions.create, model=mid, prompt=e["prompt"], max_tokens=len(e["greedy_ids"]),
                        temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})  # llama.cpp's run went past </s>
    ch = r.choices[0]
    assert ch.model_extra is not None and ch.model_extra["token_ids"] == e["greedy_ids"]  # llama.cpp's tokens
    assert r.usage is not None and r.usage.prompt_tokens == len(e["prompt_ids"])  # <s> added once
    # the text is llama.cpp's: its detokenisation of prompt + continuation, less the prompt's
    full = bytes.fromhex(e["full_text_hex"])
    prompt_text = tok.decode_bytes(e["prompt_ids"])
    assert full.startswith(prompt_text)
    assert ch.text == full[len(prompt_text):].decode("utf-8", errors="replace")
    assert ch.text.startswith(" ch") and tok.decode(e["greedy_ids"]) != ch.text  # the space a chat reply drops

    msgs = [{"role": "user", "content": "Hello there"}]
    rendered = render_chat(model.fields["tokenizer.chat_template"], msgs, bos_token="<s>", eos_token="</s>")
    assert rendered.startswith("<s>[INST]")  # the template writes the bos the tokenizer adds too
    once = tok.encode(rendered[len("<s>"):])
    assert once[0] == tok.bos_id and once[1] != tok.bos_id and tok.encode(rendered)[:2] == [tok.bos_id] * 2
    chat = await in_thread(c.chat.completions.create, model=mid, messages=msgs, max_tokens=8, temperature=0,
                           extra_body={"return_token_ids": True})
    assert chat.usage is not None and chat.usage.prompt_tokens == len(once)
    ids = chat.choices[0].model_extra["token_ids"] if chat.choices[0].model_extra else None
    assert ids is not None and chat.choices[0].message.content == tok.decode(ids)  # a reply: its own first space
