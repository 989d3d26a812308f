"""The HTTP error body every moe-swarm service answers with (pure: one definition, no I/O).

``{"error": {"message", "type", "param", "code"}}`` -- OpenAI's shape, so the official ``openai``
client reports our errors as it reports OpenAI's. ``code`` is stable (clients branch on it);
``type`` is ``invalid_request_error`` below 500 and ``server_error`` from 500 on.
"""

from __future__ import annotations

import msgspec

__all__ = ["ErrorBody", "ErrorDetail", "encode_error", "error_code", "error_message"]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ErrorBody)


def encode_error(status: int, code: str, message: str, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _encoder.encode(ErrorBody(ErrorDetail(message, kind, code, param)))


def error_message(body: bytes) -> str:
    """The ``message`` of an error body, or the body's start when it is not one (a proxy's page)."""
    try:
        return _decoder.decode(body).error.message
    except msgspec.DecodeError:
        return body[:200].decode("utf-8", "replace")


def error_code(body: bytes) -> str | None:
    """The ``code`` of an error body, or None when it is not one."""
    try:
        return _decoder.decode(body).error.code
    except msgspec.DecodeError:
        return None
