"""OpenAI-compatible request bodies (pure: msgspec Structs and their validation).

Rules:
- Bodies are decoded by one typed decoder per endpoint; a type error names the offending field.
- Unknown fields are ignored (clients send many optional fields) except those whose silent
  omission would change the meaning of the answer, which are refused by ``validate_*``.
- Range checks raise ``RequestError`` with ``param`` set, mapped to HTTP 400 by the API shell.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coordinator.core.scheduler import GenParams
from swarm.errors import RequestError

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "StreamOptions",
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
    model: str
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


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str]
    echo: bool = False


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
    )
