"""The coordinator's HTTP bodies (pure: msgspec Structs, their validation and nothing else).

OpenAI-compatible requests (``/v1/chat/completions``, ``/v1/completions``) and responses
(``chat.completion``, ``chat.completion.chunk``, ``text_completion`` whole and streamed, the
``/v1/models`` list), plus the coordinator's own ``/health`` and ``/slots``. Errors are
``swarm.protocol.http``'s ``ErrorBody``, streamed or not.

Rules:
- Bodies are decoded by one typed decoder per endpoint; a type error names the offending field.
- Unknown request fields are ignored (clients send many optional fields) except those whose silent
  omission would change the meaning of the answer, which are refused by ``decode_*`` and
  ``gen_params``.
- Range checks raise ``RequestError`` with ``param`` set, mapped to HTTP 400 by the API shell.
- Responses carry the keys and values the official ``openai`` client reads, in a fixed order: a
  field the OpenAI shape always carries is always encoded (``null`` included); only the chat
  ``delta``'s fields, ``usage`` outside the last chunk and our ``token_ids`` extension are left out
  when absent.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from coordinator.core.scheduler import GenParams
from swarm.errors import RequestError

__all__ = [
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatDelta",
    "ChatMessage",
    "ChatRequest",
    "ChoiceFinishReason",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "PromptTokensDetails",
    "CompletionChunkChoice",
    "CompletionRequest",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "Usage",
    "decode_chat",
    "decode_completion",
    "gen_params",
]


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str = ""  # any name is the hosted model unless the coordinator runs with --strict-model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False
    user: str | None = None
    # speculative decoding's drafter for this request (an extension): none, ngram, model, self; default: the server's
    draft: Literal["none", "ngram", "model", "self"] | None = None
    # control tokens (``<|im_start|>``, ``<|im_end|>``) are left out of the text unless this is false (an
    # extension, vLLM's name; llama-server leaves them out too)
    skip_special_tokens: bool = True
    # admission (an extension): start even past the coordinator's tps floor (coordinator.core.admission)
    overcommit: bool = False


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str]
    echo: bool = False


# -- responses -------------------------------------------------------------------------------------


class ChoiceFinishReason(StrEnum):
    """Why a choice ended, as OpenAI spells it (the scheduler's ``CANCELLED`` never reaches a client)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context is full


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0  # prompt tokens whose KV came from a kept prefix (not computed for this request)


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: ChoiceFinishReason
    message: AssistantMessage
    logprobs: None = None
    token_ids: tuple[int, ...] | UnsetType = UNSET  # only when the request asked for ``return_token_ids``


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: tuple[ChatChoice, ...]
    usage: Usage


class ChatDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a chunk adds to the message: ``role`` in the first chunk only, no ``content`` in the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: ChoiceFinishReason | None = None
    delta: ChatDelta
    logprobs: None = None
    token_ids: tuple[int, ...] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: tuple[ChatChunkChoice, ...]
    usage: Usage | UnsetType = UNSET  # only in the extra last chunk of ``stream_options.include_usage``


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: ChoiceFinishReason
    text: str
    logprobs: None = None
    token_ids: tuple[int, ...] | UnsetType = UNSET


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: tuple[CompletionChoice, ...]
    usage: Usage


class CompletionChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    finish_reason: ChoiceFinishReason | None = None
    text: str
    logprobs: None = None
    token_ids: tuple[int, ...] | UnsetType = UNSET


class CompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A streamed ``text_completion``: OpenAI gives chunks the same ``object`` as the whole answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: tuple[CompletionChunkChoice, ...]
    usage: Usage | UnsetType = UNSET


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: tuple[ModelCard, ...]


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request body: {exc}", code="invalid_parameter") from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}", code="invalid_json") from exc


def decode_chat(body: bytes) -> ChatRequest:
    req: ChatRequest = _decode(_chat_decoder, body)
    if not req.messages:
        raise RequestError("'messages' must be a non-empty list", code="invalid_parameter", param="messages")
    for m in req.messages:
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise RequestError(f"unknown message role {m.role!r}", code="invalid_parameter", param="messages")
    return req


def decode_completion(body: bytes) -> CompletionRequest:
    req: CompletionRequest = _decode(_completion_decoder, body)
    p = req.prompt
    if isinstance(p, list):
        if len(p) == 0:
            raise RequestError("'prompt' must not be empty", code="invalid_parameter", param="prompt")
        n_str = sum(isinstance(x, str) for x in p)
        if n_str and (n_str != len(p) or len(p) != 1):
            raise RequestError(
                "'prompt' must be a string, a list of token ids, or a list holding one string",
                code="invalid_parameter",
                param="prompt",
            )
    return req


def gen_params(req: _Common, *, default_max_tokens: int, max_tokens_override: int | None = None) -> GenParams:
    if req.n != 1:
        raise RequestError("only n=1 is supported", code="invalid_parameter", param="n")
    if req.logprobs:
        raise RequestError("logprobs are not supported", code="unsupported_parameter", param="logprobs")
    max_tokens = max_tokens_override if max_tokens_override is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise RequestError("'max_tokens' must be >= 1", code="invalid_parameter", param="max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("'temperature' must be in [0, 2]", code="invalid_parameter", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise RequestError("'top_p' must be in (0, 1]", code="invalid_parameter", param="top_p")
    stops: tuple[str, ...]
    if req.stop is None:
        stops = ()
    elif isinstance(req.stop, str):
        stops = (req.stop,)
    else:
        stops = tuple(req.stop)
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError("'stop' must be up to 4 non-empty strings", code="invalid_parameter", param="stop")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise RequestError("'seed' is out of range", code="invalid_parameter", param="seed")
    return GenParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=req.seed,
        stop=stops,
        ignore_eos=req.ignore_eos,
        draft=req.draft,
        skip_special=req.skip_special_tokens,
    )
