"""The coordinator's HTTP bodies are exactly their ``coordinator.api.schemas`` Structs: every response
kind, taken from a real HTTP response, decodes strictly to its Struct and re-encodes to the same
bytes, and the official ``openai`` types read back every key and value we sent."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import httpx
import msgspec
import numpy as np
import openai.types
import openai.types.chat
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from coordinator.api.app import build_app
from coordinator.api.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceFinishReason,
    Completion,
    CompletionChunk,
    ModelList,
    PromptTokensDetails,
)
from coordinator.dispatch.layer import LayerCall
from coordinator.engine.model import LocalExperts
from coordinator.engine.runtime import EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.protocol.coordinator import Health, SlotInfo
from swarm.protocol.http import ErrorBody
from swarm.text.tokenizer import Tokenizer

T = TypeVar("T")

PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]


def strict(body: bytes, typ: type[T]) -> T:
    """``body`` decoded as ``typ``; re-encoding gives ``body`` back, so no key was dropped, added or renamed."""
    obj = msgspec.json.decode(body, type=typ)
    assert msgspec.json.encode(obj) == body
    return obj


def openai_reads_all(body: bytes, model: Any) -> None:
    """The official client's type validates ``body`` and holds every key and value of it."""
    assert model.model_validate_json(body).model_dump(mode="json", exclude_unset=True) == msgspec.json.decode(body)


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text.removesuffix("\n\n").split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


async def model_id(h: httpx.AsyncClient) -> str:
    r = await h.get("/v1/models")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    models = strict(r.content, ModelList)
    assert [m.object for m in models.data] == ["model"] and models.data[0].owned_by == "moe-swarm"
    openai_reads_all(msgspec.json.encode(models.data[0]), openai.types.Model)
    return models.data[0].id


async def test_models_health_slots(coordinator_url: str) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url) as h:
        mid = await model_id(h)
        assert mid.startswith("qwen3moe-tiny-f32-")
        slots = strict((await h.get("/slots")).content, list[SlotInfo])
        assert [s.id for s in slots] == [0, 1, 2, 3] and not any(s.is_processing for s in slots)
        r = await h.get("/health")
        health = msgspec.json.decode(r.content, type=Health)  # the server's extras follow our fields
        assert (health.status, health.model, health.slots_idle, health.slots_processing) == ("ok", mid, 4, 0)
        assert list(r.json())[:4] == ["status", "model", "slots_idle", "slots_processing"]


@pytest.mark.parametrize("token_ids", [False, True])
async def test_whole_responses(coordinator_url: str, golden: dict[str, Any], token_ids: bool) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=30) as h:
        mid = await model_id(h)
        extra = {"return_token_ids": True} if token_ids else {}
        r = await h.post("/v1/chat/completions", json={"model": mid, "messages": MESSAGES, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        chat = strict(r.content, ChatCompletion)
        openai_reads_all(r.content, openai.types.chat.ChatCompletion)
        assert chat.id.startswith("chatcmpl-") and chat.model == mid and len(chat.choices) == 1
        ch = chat.choices[0]
        assert ch.finish_reason is ChoiceFinishReason.LENGTH and ch.message.role == "assistant" and ch.logprobs is None
        assert (chat.usage.completion_tokens, chat.usage.total_tokens) == (6, chat.usage.prompt_tokens + 6)
        if token_ids:
            assert not isinstance(ch.token_ids, msgspec.UnsetType) and len(ch.token_ids) == 6
        else:
            assert ch.token_ids is msgspec.UNSET and "token_ids" not in r.text

        r = await h.post("/v1/completions", json={"model": mid, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True, **extra})
        assert r.status_code == 200
        cmpl = strict(r.content, Completion)
        openai_reads_all(r.content, openai.types.Completion)
        assert cmpl.id.startswith("cmpl-") and cmpl.object == "text_completion"
        c = cmpl.choices[0]
        assert c.finish_reason is ChoiceFinishReason.LENGTH and c.text and cmpl.usage.completion_tokens == 6
        if token_ids:
            assert c.token_ids == tuple(golden["greedy"][0]["greedy_ids"][:6])
        else:
            assert c.token_ids is msgspec.UNSET and "token_ids" not in r.text

        # a stop string ends the choice with "stop"
        full, stop = golden["greedy"][0]["greedy_text"], " routes"
        r = await h.post("/v1/completions", json={"model": mid, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                  "stop": [stop]})
        stopped = strict(r.content, Completion).choices[0]
        assert stopped.finish_reason is ChoiceFinishReason.STOP and stopped.text == full[: full.index(stop)]


async def test_streamed_chat_chunks(coordinator_url: str) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=30) as h:
        mid = await model_id(h)
        body = {"model": mid, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        plain = strict((await h.post("/v1/chat/completions", json=body)).content, ChatCompletion)
        r = await h.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *events, done = sse_events(r.text)
    assert done == "[DONE]"
    chunks = [strict(e.encode(), ChatCompletionChunk) for e in events]
    for e in events:
        openai_reads_all(e.encode(), openai.types.chat.ChatCompletionChunk)
    assert {(c.id, c.created, c.model, c.object) for c in chunks} == {(chunks[0].id, chunks[0].created, mid, "chat.completion.chunk")}
    first, *middle, last, usage = chunks
    assert first.choices[0].delta == ChatDelta(role="assistant", content="") and first.choices[0].finish_reason is None
    assert middle and all(c.choices[0].delta.role is None and c.choices[0].finish_reason is None for c in middle)
    assert last.choices[0].delta == ChatDelta() and last.choices[0].finish_reason is ChoiceFinishReason.LENGTH
    assert all(c.usage is msgspec.UNSET for c in chunks[:-1])
    assert usage.choices == () and plain.usage.prompt_tokens_details.cached_tokens == 0
    # the same prompt again: all but its last token's KV reused from the plain request's kept prefix
    assert usage.usage == msgspec.structs.replace(
        plain.usage, prompt_tokens_details=PromptTokensDetails(cached_tokens=plain.usage.prompt_tokens - 1))
    assert "".join(c.choices[0].delta.content or "" for c in middle) == plain.choices[0].message.content
    ids: list[int] = []
    for c in middle:
        assert not isinstance(c.choices[0].token_ids, msgspec.UnsetType)
        ids.extend(c.choices[0].token_ids)
    assert tuple(ids) == plain.choices[0].token_ids and len(ids) == 8


async def test_streamed_completion_chunks(coordinator_url: str) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=30) as h:
        mid = await model_id(h)
        body = {"model": mid, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain = strict((await h.post("/v1/completions", json=body)).content, Completion)
        r = await h.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    *events, done = sse_events(r.text)
    assert done == "[DONE]"
    chunks = [strict(e.encode(), CompletionChunk) for e in events]
    for e, c in zip(events, chunks, strict=True):
        # openai types a streamed text_completion as a whole Completion, whose finish_reason is not
        # nullable (its client builds stream chunks without validating): check the chunks it can type
        if not c.choices or c.choices[0].finish_reason is not None:
            openai_reads_all(e.encode(), openai.types.Completion)
    *texts, last, usage = chunks
    assert all(c.choices[0].finish_reason is None and c.choices[0].token_ids is msgspec.UNSET for c in texts)
    assert "".join(c.choices[0].text for c in texts) == plain.choices[0].text
    assert last.choices[0].text == "" and last.choices[0].finish_reason is ChoiceFinishReason.LENGTH
    assert usage.choices == () and plain.usage.prompt_tokens_details.cached_tokens == 0
    # the same prompt again: all but its last token's KV reused from the plain request's kept prefix
    assert usage.usage == msgspec.structs.replace(
        plain.usage, prompt_tokens_details=PromptTokensDetails(cached_tokens=plain.usage.prompt_tokens - 1))


class Exploding(LocalExperts):
    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        return False

    def result(self, call: LayerCall) -> np.ndarray:
        raise RuntimeError("expert backend exploded")


async def test_engine_failure_bodies(nursery: trio.Nursery, golden_model: GGUFModel) -> None:
    """An engine failure is the shared error body: a 500 when whole, an SSE event after the role chunk when streamed."""
    rt = EngineRuntime(golden_model, Tokenizer.from_gguf_fields(golden_model.fields), n_slots=1, experts=Exploding(golden_model))
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 0.5
    await nursery.start(rt.serve)
    binds = await nursery.start(hypercorn_serve, build_app(rt, model_id="m"), hc)
    async with httpx.AsyncClient(base_url=binds[0], timeout=30) as h:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 500
        err = strict(r.content, ErrorBody).error
        assert (err.type, err.code, err.param) == ("server_error", "engine_error", None) and "exploded" in err.message
        r = await h.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200
    first, event = sse_events(r.text)  # no [DONE] after an error
    assert strict(first.encode(), ChatCompletionChunk).choices[0].delta.role == "assistant"
    assert strict(event.encode(), ErrorBody).error == err
