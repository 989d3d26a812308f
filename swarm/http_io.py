"""Reading request bodies in the services' Starlette apps (shell): bounded, and quiet when the client
goes away.

Rules:
- A body is read up to ``limit`` bytes: a larger declared ``Content-Length`` is refused before a byte
  is read, a longer stream as soon as it passes the limit -- 413 ``body_too_large`` either way.
- An answer to a body not read to its end closes the connection (``close_if_unread``): the rest of the
  body would otherwise be read as the next request on a kept-alive connection.
- A client that disconnects mid-body raises ``ClientGone`` (a ``RequestError``): the handler answers
  nobody, and nothing is logged as a server error.
"""

from __future__ import annotations

from contextlib import aclosing

from starlette.requests import ClientDisconnect, Request

from swarm.errors import RequestError

__all__ = ["ClientGone", "close_if_unread", "read_body"]


class ClientGone(RequestError):
    """The client disconnected before its body arrived."""

    code = "client_disconnected"


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"body larger than {limit} bytes", code="body_too_large", status=413)
    chunks: list[bytes] = []
    size = 0
    try:
        async with aclosing(request.stream()) as stream:  # close the generator when we stop early
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise RequestError(f"body larger than {limit} bytes", code="body_too_large", status=413)
                chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientGone("the client disconnected before its body arrived", status=499) from exc
    return b"".join(chunks)


def close_if_unread(exc: Exception, headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """The headers of an error answer: ``Connection: close`` added when ``exc`` left the body unread."""
    if isinstance(exc, RequestError) and exc.status == 413:
        return {**(headers or {}), "Connection": "close"}
    return headers
