"""``/v1/prefixes``: explicit, pinned prefixes (shell over ``coordinator.core.prefix_pool``).

Rules:
- ``POST /v1/prefixes`` ``{tokens | messages, parent?, fork_at?}``: the prefix's KV is computed (what
  no kept prefix holds) and pinned in the prefix cache; the answer names it (``pfx-...``, derived from
  its tokens: posting the same tokens again answers the same prefix). ``messages`` are rendered with
  the model's chat template without the generation prompt, so a chat request with more messages
  starts with them.
- A fork (``parent`` + ``fork_at``) is checked by the pool (400 ``invalid_fork``, 404, 409
  ``prefix_mismatch``). ``DELETE /v1/prefixes/{id}`` releases the pin (409 while it has forks).
  ``GET /v1/prefixes`` lists them with own and subtree KV bytes, and ``kept_hashes``: the chain
  hashes of every kept prefix (``hash_salt`` names the chain's salt), what a router compares.
- Errors are OpenAI-shaped with stable codes; a body over ``max_body`` is 413, a malformed one 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from coordinator.api.schemas import ChatMessage
from coordinator.core.prefix_pool import PoolError, PrefixPool, PrefixView
from coordinator.engine.runtime import EngineRuntime
from swarm.errors import RequestError, SwarmError
from swarm.http_io import read_body

__all__ = ["PrefixCreate", "PrefixInfo", "PrefixList", "prefix_routes"]


class PrefixCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int] | None = None
    messages: list[ChatMessage] | None = None
    parent: str | None = None
    fork_at: int | None = None
    model: str = ""


class PrefixInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "prefix"
    n_tokens: int
    parent: str | None
    fork_at: int | None
    children: list[str]
    pinned: bool = True
    own_kv_bytes: int
    subtree_kv_bytes: int


class PrefixList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[PrefixInfo]
    kept_hashes: list[str]
    hash_salt: str


class Deleted(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "prefix"
    deleted: bool = True


_decode_create = msgspec.json.Decoder(PrefixCreate)
_encoder = msgspec.json.Encoder()


def _info(v: PrefixView) -> PrefixInfo:
    return PrefixInfo(id=v.id, n_tokens=v.n_tokens, parent=v.parent, fork_at=v.fork_at, children=list(v.children),
                      own_kv_bytes=v.own_kv_bytes, subtree_kv_bytes=v.subtree_kv_bytes)


def _json(body: msgspec.Struct, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


def prefix_routes(rt: EngineRuntime, *, max_body: int, render: Callable[[list[ChatMessage]], Awaitable[list[int]]],
                  error: Callable[[SwarmError], Response]) -> list[BaseRoute]:
    """``render``: messages -> token ids (the chat template, no generation prompt); ``error``: the app's
    error answer."""
    px = rt.prefixes
    pool = PrefixPool(px.salt if px is not None else b"", px.row_bytes if px is not None else 1)

    def pool_error(exc: PoolError) -> Response:
        return error(RequestError(exc.message, code=exc.code, status=exc.status, param=exc.param))

    async def create(request: Request) -> Response:
        try:
            raw = await read_body(request, max_body)
            try:
                body = _decode_create.decode(raw)
            except msgspec.ValidationError as exc:
                raise RequestError(f"invalid body: {exc}", code="invalid_request") from None
            except msgspec.DecodeError as exc:
                raise RequestError(f"the body is not JSON: {exc}", code="invalid_json") from None
            if (body.tokens is None) == (body.messages is None):
                raise RequestError("give exactly one of 'tokens' and 'messages'", code="invalid_request", param="tokens")
            if body.tokens is not None:
                tokens, param = body.tokens, "tokens"
            else:
                assert body.messages is not None
                tokens, param = await render(body.messages), "messages"
            if not tokens:
                raise RequestError("the prefix is empty", code="empty_prompt", param=param)
            pid = pool.check(tokens, body.parent, body.fork_at)
            if pool.has(pid):
                return _json(_info(pool.view(pid)))
            entry = await rt.pin_prefix(tokens, param=param)
            if pool.has(pid) or (body.parent is not None and not pool.has(body.parent)):  # raced while computing
                rt.unpin_prefix(entry)
                return _json(_info(pool.view(pid))) if pool.has(pid) else pool_error(pool_missing(body.parent))
            return _json(_info(pool.add(tokens, body.parent, body.fork_at, entry)), 201)
        except PoolError as exc:
            return pool_error(exc)
        except SwarmError as exc:
            return error(exc)

    async def listing(_: Request) -> Response:
        return _json(PrefixList(data=[_info(v) for v in pool.views()], kept_hashes=rt.kept_hashes(),
                                hash_salt=px.salt.decode() if px is not None else ""))

    async def one(request: Request) -> Response:
        try:
            return _json(_info(pool.view(request.path_params["pid"])))
        except PoolError as exc:
            return pool_error(exc)

    async def delete(request: Request) -> Response:
        pid = request.path_params["pid"]
        try:
            rt.unpin_prefix(pool.release(pid))
        except PoolError as exc:
            return pool_error(exc)
        return _json(Deleted(id=pid))

    return [
        Route("/v1/prefixes", create, methods=["POST"]),
        Route("/v1/prefixes", listing, methods=["GET"]),
        Route("/v1/prefixes/{pid}", one, methods=["GET"]),
        Route("/v1/prefixes/{pid}", delete, methods=["DELETE"]),
    ]


def pool_missing(pid: str | None) -> PoolError:
    return PoolError(f"no prefix {pid!r} here (released while the fork was computed)", code="prefix_not_found", status=404)
