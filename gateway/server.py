"""The gateway service (shell): one OpenAI endpoint for every coordinator its markets list, over the pure
router (``gateway.core.router``) on hypercorn's trio worker.

Rules:
- ``serve_gateway`` is a trio service: ``task_status.started(url)`` once its socket is bound. Two loops feed
  the router: every ``poll_interval_s`` the markets' ``GET /api/coordinators`` (the union over markets;
  a market that does not answer keeps the last list) and every listed coordinator's ``GET /capacity``
  (``/slots`` when it answers 404: older coordinators) and ``GET /v1/prefixes`` (``kept_hashes``,
  ``hash_salt``), each bounded by ``poll_timeout_s``; ``/capacity`` is asked again every ``REPROBE_POLLS``
  polls of a coordinator that lacked it. The router's clock is ``trio.current_time()``.
- A request is read as the coordinator reads it (``max_body``: 413 ``body_too_large``; malformed JSON 400
  ``invalid_json``; a body of the wrong shape 400 ``invalid_parameter``), forwarded byte for byte, and its
  answer passed through unchanged (status, body, SSE events), with ``x-moe-swarm-coordinator`` naming the
  coordinator that answered. A 4xx from a coordinator other than 429 is its answer (no failover).
- One attempt at a time per request (the router's ``Send``): nothing reaches the client before the
  attempt's first token (a streamed event with text, token ids or a finish reason; a whole answer when not
  streamed); a 429/503 is a refusal (``Retry-After``), a transport error, a 5xx, an error event or a stream
  ending early is a failure, and the deadline of ``Send`` a timeout: the router then moves on or answers.
  After the first token, a failure ends the stream with an OpenAI-shaped error event (and no ``[DONE]``);
  so does a coordinator that sends nothing for ``stream_idle_timeout_s`` (``--stream-idle-timeout``:
  stalled mid-stream): the error event names the stall, and the upstream is closed (which cancels the
  request there). It must exceed the coordinators' ``--max-park-time`` (a parked session's stream waits).
- A client that goes away closes the upstream connection (the coordinator cancels the request).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, cast

import httpx
import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.core.router import (
    Abort,
    Answer,
    Arrive,
    AttemptFailed,
    Capacity,
    ClientGone,
    Commit,
    Effect,
    EndStream,
    Event,
    Finished,
    FirstToken,
    Listed,
    Load,
    Polled,
    PollFailed,
    Rearm,
    Refused,
    Router,
    RouterPolicy,
    Send,
    Timeout,
)
from gateway.text import ModelText, load_model_text
from swarm.config import Port, PosFloat
from swarm.errors import RequestError
from swarm.http_io import close_if_unread, read_body
from swarm.protocol.coordinator import slots_decoder
from swarm.protocol.gateway import directory_decoder
from swarm.protocol.http import encode_error

__all__ = ["GatewayConfig", "build_gateway_app", "serve_gateway"]

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY = 8 << 20  # the coordinator's (coordinator.api.app.DEFAULT_MAX_BODY)
COORDINATOR_HEADER = "x-moe-swarm-coordinator"
REPROBE_POLLS = 30  # a coordinator without /capacity is asked again after this many polls through /slots


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    markets: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
    host: str = "127.0.0.1"
    port: Port = 8000
    models: tuple[str, ...] = ()  # GGUF files whose tokenizers give prefix locality
    poll_interval_s: PosFloat = 1.0
    poll_timeout_s: PosFloat = 2.0
    offer_timeout_s: PosFloat = 10.0
    stream_idle_timeout_s: PosFloat = 60.0  # after the first token: the longest gap between upstream events
    stale_after_s: PosFloat = 5.0
    backoff_s: PosFloat = 5.0
    max_body: Annotated[int, msgspec.Meta(ge=1024)] = DEFAULT_MAX_BODY


class _Peek(msgspec.Struct):
    """The fields the gateway reads of an OpenAI body (the rest passes through untouched)."""

    model: str = ""
    stream: bool = False
    prompt: str | list[str | int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_peek = msgspec.json.Decoder(_Peek)


class _CapacityBody(msgspec.Struct):
    can_admit: bool = True
    admission: str = "advisory"
    settling: bool = False
    settle_remaining_ms: float = 0.0
    headroom_sessions: int = 0
    mean_active_tps: float | None = None  # null before the coordinator measured a session
    active_sessions: int = 0
    slots: int = 1
    queue: int = 0


class _PrefixList(msgspec.Struct):
    kept_hashes: list[str] = []
    hash_salt: str = ""


_capacity = msgspec.json.Decoder(_CapacityBody)
_prefixes = msgspec.json.Decoder(_PrefixList)


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   param: str | None = None) -> Response:
    return Response(encode_error(status, code, message, param), status_code=status, headers=headers,
                    media_type="application/json")


@dataclass
class Gateway:
    """The router and what the loops learnt, shared by the HTTP handlers (one trio thread)."""

    router: Router
    texts: dict[str, ModelText]
    client: httpx.AsyncClient
    cfg: GatewayConfig
    ids: itertools.count[int]
    no_capacity: dict[str, int]  # coordinators whose /capacity answered 404 -> polls since (through /slots)
    kept: dict[str, int]  # coordinator -> advertised prefixes at the last poll
    stalls: int = 0  # streams ended by --stream-idle-timeout

    def handle(self, ev: Event) -> list[Effect]:
        if isinstance(ev, AttemptFailed | Timeout | Refused):
            log.info("rid=%d attempt=%d: %s", ev.rid, ev.attempt, ev)
        out = self.router.handle(ev, trio.current_time())
        for e in out:
            if isinstance(e, Send):
                log.info("rid=%d attempt=%d -> %s (predicted ttft %.3f s, cached %d; scores %s)", e.rid, e.attempt,
                         e.url, e.predicted_ttft_s, e.cached_tokens, e.scores)
            elif isinstance(e, Abort | EndStream | Answer):
                log.info("rid=%d %s", e.rid, e)
        return out


# the loops -----------------------------------------------------------------------------------------------

async def poll_markets(gw: Gateway) -> None:
    while True:
        hosts: dict[str, set[str]] = {}
        answered = False
        for market in gw.cfg.markets:
            try:
                with trio.fail_after(gw.cfg.poll_timeout_s):
                    r = await gw.client.get(market.rstrip("/") + "/api/coordinators")
                r.raise_for_status()
                d = directory_decoder.decode(r.content)
            except (httpx.HTTPError, trio.TooSlowError, msgspec.DecodeError) as exc:
                log.warning("market %s: %s", market, exc or type(exc).__name__)
                continue
            answered = True
            for entry in d.models:
                hosts.setdefault(entry.model_id, set()).update(c.url.rstrip("/") for c in entry.coordinators if c.hosting)
        if answered:
            for model in set(hosts) | set(gw.router.hosts):
                gw.handle(Listed(model, tuple(sorted(hosts.get(model, set())))))
        await trio.sleep(gw.cfg.poll_interval_s)


async def poll_one(gw: Gateway, url: str) -> None:
    try:
        with trio.fail_after(gw.cfg.poll_timeout_s):
            load = await _load_of(gw, url)
    except (httpx.HTTPError, trio.TooSlowError, msgspec.DecodeError, ValueError) as exc:
        gw.handle(PollFailed(url, str(exc) or type(exc).__name__))
        return
    gw.kept[url] = len(load.kept)
    gw.handle(Polled(url, load))


async def _load_of(gw: Gateway, url: str) -> Load:
    cap: Capacity | None = None
    since = gw.no_capacity.get(url)
    if since is not None:
        gw.no_capacity[url] = since + 1
    if since is None or since >= REPROBE_POLLS:  # an upgraded coordinator is found again
        r = await gw.client.get(url + "/capacity")
        if r.status_code == 404:
            gw.no_capacity[url] = 0
        else:
            gw.no_capacity.pop(url, None)
            r.raise_for_status()
            c = _capacity.decode(r.content)
            cap = Capacity(c.can_admit, "enforced" if c.admission == "enforced" else "advisory",
                           c.settle_remaining_ms / 1000.0, c.headroom_sessions)
            slots, active, queue, tps = c.slots, c.active_sessions, c.queue, c.mean_active_tps or 0.0
    if cap is None:
        r = await gw.client.get(url + "/slots")
        r.raise_for_status()
        slot_list = slots_decoder.decode(r.content)
        busy = [s for s in slot_list if s.is_processing]
        rates = [s.tps_ewma for s in busy if s.tps_ewma > 0]
        slots, active, queue, tps = len(slot_list), len(busy), 0, (sum(rates) / len(rates) if rates else 0.0)
    r = await gw.client.get(url + "/v1/prefixes")
    kept: frozenset[bytes] = frozenset()
    salt = b""
    if r.status_code == 200:
        p = _prefixes.decode(r.content)
        kept, salt = frozenset(bytes.fromhex(h) for h in p.kept_hashes), p.hash_salt.encode()
    return Load(slots=max(1, slots), active=active, queue=queue, mean_active_tps=tps, capacity=cap, salt=salt, kept=kept)


async def poll_coordinators(gw: Gateway) -> None:
    while True:
        async with trio.open_nursery() as nursery:
            for url in gw.router.coordinators():
                nursery.start_soon(poll_one, gw, url)
        await trio.sleep(gw.cfg.poll_interval_s)


# one request ---------------------------------------------------------------------------------------------

@dataclass
class _Upstream:
    resp: httpx.Response
    buffered: list[bytes]
    rest: AsyncGenerator[bytes, None] | None  # streamed: the events after the buffered ones
    done: bool  # the buffered events already hold the end ([DONE])


def _split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    parts = buf.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]], parts[-1]


def _event_kind(event: bytes) -> str:
    """``token`` (text, token ids or a finish reason), ``done``, ``error``, or ``other`` (a role chunk)."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if data == b"[DONE]":
        return "done"
    try:
        obj = json.loads(data)
    except ValueError:
        return "other"
    if not isinstance(obj, dict):
        return "other"
    if "error" in obj:
        return "error"
    for ch in obj.get("choices") or ():
        delta = ch.get("delta") or {}
        if ch.get("text") or ch.get("token_ids") or ch.get("finish_reason") or delta.get("content"):
            return "token"
    return "other"


async def _events(resp: httpx.Response, rest: bytes) -> AsyncGenerator[bytes, None]:
    """The upstream's SSE events, whole, as they arrive; ``rest``: bytes read already."""
    buf = rest
    async with aclosing(cast(AsyncGenerator[bytes, None], resp.aiter_raw())) as raw:
        async for chunk in raw:
            events, buf = _split_events(buf + chunk)
            for e in events:
                yield e
    if buf.strip():
        yield buf


async def _offer(gw: Gateway, s: Send, path: str, raw: bytes, headers: dict[str, str], stream: bool
                 ) -> tuple[Event, _Upstream | None]:
    """One attempt until its first token: the event for the router and, for a first token, the open upstream.
    Its deadline is kept by the caller's watchdog (cancelled: the upstream is closed)."""
    req = gw.client.build_request("POST", s.url + path, content=raw, headers=headers,
                                  timeout=httpx.Timeout(None, connect=gw.cfg.offer_timeout_s))
    resp: httpx.Response | None = None
    try:
        resp = await gw.client.send(req, stream=True)
        if resp.status_code in (429, 503):
            retry = resp.headers.get("retry-after", "1")
            await resp.aclose()
            return Refused(s.rid, s.attempt, resp.status_code, float(retry) if _number(retry) else 1.0), None
        if resp.status_code >= 500:
            body = await resp.aread()
            await resp.aclose()
            return AttemptFailed(s.rid, s.attempt, f"{resp.status_code}: {body[:200]!r}"), None
        if resp.status_code != 200 or not stream:
            await resp.aread()
            return FirstToken(s.rid, s.attempt), _Upstream(resp, [resp.content], None, True)
        buffered: list[bytes] = []
        it: AsyncGenerator[bytes, None] | None = _events(resp, b"")
        try:
            assert it is not None
            async for ev in it:
                kind = _event_kind(ev)
                if kind == "error":
                    break
                buffered.append(ev)
                if kind in ("token", "done"):
                    up = _Upstream(resp, buffered, it, kind == "done")
                    it = None  # handed over
                    return FirstToken(s.rid, s.attempt), up
            else:
                ev = b"the stream ended before its first token"
        finally:
            if it is not None:
                await _close(resp, it)
        return AttemptFailed(s.rid, s.attempt, ev.decode(errors="replace")[:300]), None
    except httpx.HTTPError as exc:
        if resp is not None:
            await _close(resp)
        return AttemptFailed(s.rid, s.attempt, f"{type(exc).__name__}: {exc}"), None
    except BaseException:  # cancelled (the client went away): the upstream connection is closed, not leaked
        if resp is not None:
            await _close(resp)
        raise
    raise AssertionError("unreachable")  # pragma: no cover


async def _drain(events: AsyncGenerator[bytes, None]) -> None:
    """Read what follows ``[DONE]`` (nothing: the coordinator closes the stream), so the readers end."""
    with trio.move_on_after(1.0):
        async for _ in events:
            pass


async def _close(resp: httpx.Response, events: AsyncGenerator[bytes, None] | None = None) -> None:
    """Close an upstream response (and the generator reading it) even while being cancelled (bounded: a
    stuck peer cannot hold us)."""
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        if events is not None:
            await events.aclose()
        await resp.aclose()


def _number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _answer(a: Answer) -> Response:
    headers = {"Retry-After": str(max(1, round(a.retry_after_s)))} if a.retry_after_s is not None else None
    return error_response(a.status, a.code, a.message, headers, param="model" if a.code == "no_coordinator" else None)


async def route_request(gw: Gateway, request: Request, path: str) -> Response:
    try:
        raw = await read_body(request, gw.cfg.max_body)
        try:
            peek = _peek.decode(raw)
        except msgspec.ValidationError as exc:
            raise RequestError(f"invalid request body: {exc}", code="invalid_parameter") from exc
        except msgspec.DecodeError as exc:
            raise RequestError(f"malformed JSON body: {exc}", code="invalid_json") from exc
    except RequestError as exc:
        return error_response(exc.status, exc.code, exc.message, close_if_unread(exc), exc.param)
    model = _resolve(gw, peek.model)
    tokens = await _tokens(gw, model, peek)
    n_prompt = len(tokens) if tokens is not None else max(1, len(raw) // 4)
    max_tokens = peek.max_completion_tokens or peek.max_tokens or 16
    rid = next(gw.ids)
    effects = gw.handle(Arrive(rid, model, n_prompt, tuple(tokens) if tokens is not None else None, max_tokens,
                               peek.stream))
    fwd = {"content-type": "application/json"}
    if "authorization" in request.headers:
        fwd["authorization"] = request.headers["authorization"]
    gone = False
    while True:
        send = next((e for e in effects if isinstance(e, Send)), None)
        answer = next((e for e in effects if isinstance(e, Answer)), None)
        if answer is not None:
            return _answer(answer)
        if send is None:  # pragma: no cover - the router always sends or answers
            return error_response(500, "router_error", "the router neither sent nor answered")
        outcome: tuple[Event, _Upstream | None] | None = None
        timed_out: list[Effect] | None = None
        offer_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                nonlocal gone
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                gone = True
                nursery.cancel_scope.cancel()

            async def watchdog(s: Send, offer_scope: trio.CancelScope) -> None:
                """The attempt's deadline: the router decides (give up on it, or Rearm: wait longer)."""
                nonlocal timed_out
                deadline = s.deadline
                while True:
                    await trio.sleep_until(deadline)
                    effs = gw.handle(Timeout(s.rid, s.attempt))
                    rearm = next((e for e in effs if isinstance(e, Rearm)), None)
                    if rearm is None:
                        timed_out = effs
                        offer_scope.cancel()
                        return
                    deadline = rearm.deadline

            nursery.start_soon(watch)
            nursery.start_soon(watchdog, send, offer_scope)
            with offer_scope:
                outcome = await _offer(gw, send, path, raw, fwd, peek.stream)
            nursery.cancel_scope.cancel()
        if timed_out is not None and not gone:
            if outcome is not None and outcome[1] is not None:  # it answered as its deadline passed: too late
                await _close(outcome[1].resp, outcome[1].rest)
            effects = timed_out
            continue
        if gone:
            if outcome is not None and outcome[1] is not None:
                await _close(outcome[1].resp, outcome[1].rest)
            gw.handle(ClientGone(rid))
            return Response(status_code=499)
        assert outcome is not None
        ev, up = outcome
        effects = gw.handle(ev)
        if any(isinstance(e, Commit) for e in effects) and up is not None:
            return _respond(gw, rid, send, up)
        if up is not None:  # aborted (stale): close it
            await _close(up.resp, up.rest)


def _respond(gw: Gateway, rid: int, send: Send, up: _Upstream) -> Response:
    headers = {COORDINATOR_HEADER: send.url}
    ctype = up.resp.headers.get("content-type", "application/json")
    if up.rest is None:
        gw.handle(Finished(rid, send.attempt))
        return Response(b"".join(up.buffered), status_code=up.resp.status_code, headers=headers, media_type=ctype)

    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            for e in up.buffered:
                yield e
            if up.done:
                finished = True
                if up.rest is not None:
                    await _drain(up.rest)
                return
            assert up.rest is not None
            idle = gw.cfg.stream_idle_timeout_s
            try:
                while True:
                    with trio.move_on_after(idle) as stall:
                        try:
                            e = await up.rest.__anext__()
                        except StopAsyncIteration:
                            reason = "the stream ended without [DONE]"
                            break
                    if stall.cancelled_caught:
                        reason = f"no event for {idle:g} s (stalled; --stream-idle-timeout)"
                        gw.stalls += 1
                        break
                    kind = _event_kind(e)
                    yield e
                    if kind == "done":
                        finished = True
                        await _drain(up.rest)
                        return
                    if kind == "error":  # the coordinator ended it with its own error event
                        finished = True
                        gw.handle(AttemptFailed(rid, send.attempt, "error event"))
                        return
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            finished = True
            for eff in gw.handle(AttemptFailed(rid, send.attempt, reason)):
                if isinstance(eff, EndStream):
                    yield b"data: " + encode_error(502, eff.code, eff.message) + b"\n\n"
        finally:
            if not finished:  # the client went away: the router first, then the upstream (closing it cancels)
                gw.handle(ClientGone(rid))
            elif gw.router.reqs.get(rid) is not None:
                gw.handle(Finished(rid, send.attempt))
            await _close(up.resp, up.rest)

    return StreamingResponse(body(), status_code=up.resp.status_code, media_type=ctype,
                             headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _resolve(gw: Gateway, name: str) -> str:
    """The model id a request names: its id, or a GGUF stem naming one model; "" with one model: it."""
    models = gw.router.models()
    if name in models:
        return name
    if not name and len(models) == 1:
        return models[0]
    stems = [m for m in models if m.rsplit("-", 1)[0] == name]
    return stems[0] if len(stems) == 1 else name


async def _tokens(gw: Gateway, model: str, peek: _Peek) -> list[int] | None:
    p = peek.prompt
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return [int(x) for x in p]
    text = gw.texts.get(model)
    if text is None:
        return None
    try:
        if peek.messages is not None:
            return await trio.to_thread.run_sync(text.chat_ids, peek.messages)
        if isinstance(p, str):
            return await trio.to_thread.run_sync(text.encode, p)
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            return await trio.to_thread.run_sync(text.encode, p[0])
    except Exception as exc:  # noqa: BLE001 - bad input is the coordinator's to refuse; we only lose locality
        log.debug("cannot tokenise a %s request: %s", model, exc)
    return None


# the app -------------------------------------------------------------------------------------------------

class _Collector(Collector):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def collect(self) -> Sequence[Metric]:
        c = self.gw.router.counters
        out: list[Metric] = []
        for name, doc, value in (
            ("routed", "Attempts sent to coordinators", c.routed),
            ("failovers", "Attempts moved to another coordinator before their first token", c.failovers),
            ("refused", "Attempts a coordinator refused (429/503)", c.refused),
            ("timeouts", "Attempts without a first token by their deadline", c.timeouts),
            ("stream_errors", "Streams ended with an error event after their first token", c.stream_errors),
            ("stream_stalls", "Of those, streams whose coordinator sent nothing for --stream-idle-timeout",
             self.gw.stalls),
            ("no_coordinator", "Requests answered 503: no coordinator for the model", c.no_coordinator),
            ("cancelled", "Requests whose client went away", c.cancelled),
            ("completed", "Requests answered", c.completed),
            ("predicted_cached_tokens", "Prompt tokens the chosen coordinators advertised as kept", c.cached_tokens),
        ):
            m = CounterMetricFamily(f"moe_swarm_gateway_{name}", doc)
            m.add_metric([], value)
            out.append(m)
        now = trio.current_time()
        inflight = GaugeMetricFamily("moe_swarm_gateway_inflight", "Attempts in flight per coordinator", labels=["url"])
        down = GaugeMetricFamily("moe_swarm_gateway_coordinator_down", "1 while a coordinator is marked down",
                                 labels=["url"])
        for url in self.gw.router.coordinators():
            inflight.add_metric([url], self.gw.router.inflight(url))
            down.add_metric([url], 1.0 if self.gw.router.is_down(url, now) else 0.0)
        return [*out, inflight, down]


def build_gateway_app(gw: Gateway) -> Starlette:
    registry = CollectorRegistry()
    registry.register(_Collector(gw))
    created = int(time.time())

    async def completions(request: Request) -> Response:
        return await route_request(gw, request, "/v1/completions")

    async def chat(request: Request) -> Response:
        return await route_request(gw, request, "/v1/chat/completions")

    async def models(_: Request) -> Response:
        data = [{"id": m, "object": "model", "created": created, "owned_by": "moe-swarm"} for m in gw.router.models()]
        return Response(msgspec.json.encode({"object": "list", "data": data}), media_type="application/json")

    async def health(_: Request) -> Response:
        now = trio.current_time()
        coords = [{"url": u, "down": gw.router.is_down(u, now), "inflight": gw.router.inflight(u),
                   "polled": gw.router.coords[u].polled_at is not None, "kept_prefixes": gw.kept.get(u, 0),
                   "capacity": u not in gw.no_capacity}
                  for u in gw.router.coordinators()]
        body = {"status": "ok" if gw.router.models() else "degraded", "models": gw.router.models(),
                "coordinators": coords, "tokenizers": sorted(gw.texts)}
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return error_response(status, code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}")

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: not_found})


async def serve_gateway(cfg: GatewayConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    texts: dict[str, ModelText] = {}
    for path in cfg.models:
        t = await trio.to_thread.run_sync(load_model_text, Path(path))
        texts[t.model_id] = t
    policy = RouterPolicy(offer_timeout_s=cfg.offer_timeout_s, stale_after_s=cfg.stale_after_s, backoff_s=cfg.backoff_s)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=cfg.poll_timeout_s, limits=limits) as client:
        gw = Gateway(Router(policy), texts, client, cfg, itertools.count(1), {}, {})
        hc = HyperConfig()
        hc.bind = [f"{cfg.host}:{cfg.port}"]
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = 1.0
        hc.keep_alive_timeout = 30.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_markets, gw)
            nursery.start_soon(poll_coordinators, gw)
            binds = await nursery.start(hypercorn_serve, build_gateway_app(gw), hc)
            task_status.started(binds[0] if binds else f"http://{cfg.host}:{cfg.port}")
