"""The gateway's shell over real sockets with stand-in coordinators and a stand-in market (fault injection:
what a real coordinator does only by accident -- refuse by ``/capacity``, 429 with ``Retry-After``, hang
before its first token, end a stream without ``[DONE]`` -- and the ``/capacity`` endpoint main's
coordinators do not have yet)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.server import GatewayConfig, serve_gateway
from tests.conftest import eventually

MODEL = "standin-0123456789ab"
ADMITS = {"can_admit": True, "admission": "enforced", "settle_remaining_ms": 0, "slots": 4, "active_sessions": 0,
          "queue": 0, "mean_active_tps": 10.0, "reason": "ok"}


@dataclass
class StandIn:
    url: str = ""
    capacity: dict[str, Any] | None = field(default_factory=lambda: dict(ADMITS))  # None: 404 (an older one)
    mode: str = "ok"  # ok | refuse | hang | truncate | stall (after two tokens, sends nothing, keeps the socket)
    requests: int = 0
    stream_closed: trio.Event = field(default_factory=trio.Event)  # a stream's generator was closed (cancelled)
    polls: dict[str, int] = field(default_factory=dict)


def standin_app(s: StandIn) -> Starlette:
    def polled(name: str) -> None:
        s.polls[name] = s.polls.get(name, 0) + 1

    async def capacity(_: Request) -> Response:
        polled("capacity")
        if s.capacity is None:
            return JSONResponse({"error": {"code": "not_found"}}, status_code=404)
        return JSONResponse(s.capacity)

    async def slots(_: Request) -> Response:
        polled("slots")
        return JSONResponse([{"id": i, "is_processing": False} for i in range(4)])

    async def prefixes(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [], "kept_hashes": [], "hash_salt": "x"})

    async def completions(request: Request) -> Response:
        s.requests += 1
        body = await request.json()
        if s.mode == "refuse":
            return JSONResponse({"error": {"code": "over_capacity"}}, status_code=429, headers={"Retry-After": "3"})
        if s.mode == "hang":
            await trio.sleep_forever()

        def chunk(text: str, finish: str | None = None) -> bytes:
            return b"data: " + json.dumps({"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                                           "coordinator": s.url}).encode() + b"\n\n"

        if not body.get("stream"):
            return JSONResponse({"id": "x", "choices": [{"text": "abc", "finish_reason": "stop"}], "by": s.url})

        async def events() -> Any:
            try:
                for t in ("a", "b"):
                    yield chunk(t)
                if s.mode == "truncate":
                    return
                if s.mode == "stall":
                    await trio.sleep_forever()
                yield chunk("", "stop")
                yield b"data: [DONE]\n\n"
            finally:
                s.stream_closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/capacity", capacity), Route("/slots", slots), Route("/v1/prefixes", prefixes),
                             Route("/v1/completions", completions, methods=["POST"])])


async def serve_app(nursery: trio.Nursery, app: Starlette) -> str:
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    hc.graceful_timeout = 0.1
    binds: list[str] = await nursery.start(serve, app, hc)
    return binds[0]


@pytest.fixture
async def setup(nursery: trio.Nursery) -> tuple[str, list[StandIn]]:
    """Two stand-in coordinators (sorted by URL), a stand-in market listing both, and a gateway; its URL."""
    coords = [StandIn(), StandIn()]
    for c in coords:
        c.url = (await serve_app(nursery, standin_app(c))).rstrip("/")
    coords.sort(key=lambda c: c.url)

    async def directory(_: Request) -> Response:
        return JSONResponse({"models": [{"model_id": MODEL, "coordinators": [{"url": c.url} for c in coords]}]})

    market = await serve_app(nursery, Starlette(routes=[Route("/api/coordinators", directory)]))
    cfg = GatewayConfig(markets=(market,), port=0, poll_interval_s=0.05, poll_timeout_s=0.5, offer_timeout_s=0.5,
                        backoff_s=30.0, stream_idle_timeout_s=1.0)
    gw = await nursery.start(serve_gateway, cfg)
    async with httpx.AsyncClient(timeout=5) as h:
        async def polled() -> bool:
            health = (await h.get(gw + "/health")).json()
            return sum(c["polled"] for c in health["coordinators"]) == 2

        await eventually(polled)
    return gw, coords


async def test_capacity_refusals_and_429s_are_honoured(setup: tuple[str, list[StandIn]]) -> None:
    gw, (a, b) = setup
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=5) as h:
        # a says it cannot admit (enforced); b has no /capacity (as main's coordinators) and is polled via /slots
        a.capacity = {**ADMITS, "can_admit": False, "active_sessions": 4, "reason": "below_floor"}
        b.capacity = None

        async def seen() -> bool:
            h2 = (await h.get(gw + "/health")).json()
            return a.polls.get("capacity", 0) > 2 and not next(c for c in h2["coordinators"] if c["url"] == b.url)["capacity"]

        await eventually(seen)
        assert b.polls.get("slots", 0) > 0 and "slots" not in a.polls and b.polls["capacity"] <= 2  # not asked on every poll
        r = await h.post(gw + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["by"] == b.url and r.headers["x-moe-swarm-coordinator"] == b.url
        assert a.requests == 0
        # b refuses with 429 + Retry-After: nobody else can admit -> the client gets 429 and a Retry-After
        b.mode = "refuse"
        r = await h.post(gw + "/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "all_refused" and int(r.headers["retry-after"]) >= 1
        assert b.requests == 2 and a.requests == 0
        # a admits again (fresh capacity): the request goes there while b's Retry-After runs
        a.capacity = {**a.capacity, "can_admit": True, "active_sessions": 0}
        polls = a.polls["capacity"]
        await eventually(lambda: _after(a, polls))
        r = await h.post(gw + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["by"] == a.url and b.requests == 2
        m = (await h.get(gw + "/metrics")).text
        assert "moe_swarm_gateway_refused_total 1.0" in m


async def _after(s: StandIn, polls: int) -> bool:
    return s.polls["capacity"] > polls + 1


async def test_a_hang_falls_back_and_a_truncated_stream_ends_with_an_error(setup: tuple[str, list[StandIn]]) -> None:
    gw, (a, b) = setup
    a.mode = "hang"  # a sorts first: chosen on a tie, it never answers
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
    async with httpx.AsyncClient(timeout=10) as h:
        t0 = trio.current_time()
        async with h.stream("POST", gw + "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert trio.current_time() - t0 >= 0.5  # the offer timed out first
        assert a.requests == 1 and b.requests == 1
        assert r.headers["x-moe-swarm-coordinator"] == b.url and lines[-1] == "data: [DONE]"
        assert [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]] == ["a", "b", ""]  # unchanged
        # b now ends its stream early (a is down: no one to fail over to after the first token anyway)
        b.mode = "truncate"
        async with h.stream("POST", gw + "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert "data: [DONE]" not in lines and a.requests == 1
        assert [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]] == ["a", "b"]
        assert json.loads(lines[-1][6:])["error"]["code"] == "coordinator_failed"
        m = (await h.get(gw + "/metrics")).text
        assert "moe_swarm_gateway_timeouts_total 1.0" in m and "moe_swarm_gateway_stream_errors_total 1.0" in m


async def test_a_coordinator_stalled_mid_stream_ends_it_with_an_error_event_and_is_cancelled(
        setup: tuple[str, list[StandIn]]) -> None:
    gw, (a, b) = setup
    a.mode = b.mode = "stall"  # two tokens, then silence on an open socket
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
    async with httpx.AsyncClient(timeout=10) as h:
        t0 = trio.current_time()
        async with h.stream("POST", gw + "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        waited = trio.current_time() - t0
        assert r.status_code == 200 and 1.0 <= waited < 8.0  # --stream-idle-timeout 1 s, not forever
        assert "data: [DONE]" not in lines  # never a silent truncation: an error event ends it
        assert [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]] == ["a", "b"]
        err = json.loads(lines[-1][6:])["error"]
        assert err["code"] == "coordinator_failed" and "stalled" in err["message"], err
        stalled = a if a.requests else b
        with trio.fail_after(5):
            await stalled.stream_closed.wait()  # the upstream was closed: the coordinator's request is cancelled
        m = (await h.get(gw + "/metrics")).text
        assert "moe_swarm_gateway_stream_stalls_total 1.0" in m and "moe_swarm_gateway_stream_errors_total 1.0" in m
