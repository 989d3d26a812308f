"""The market service for real: hypercorn on loopback, a SQLite file in tmp_path, an httpx client,
and a fake coordinator (a tiny Starlette app serving ``/slots`` and slice ``HEAD``s) on loopback."""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from market.cli import add_parser, config_from_args
from market.core.records import HeldState, ModelManifest
from market.policy import MarketPolicy
from market.server import MarketConfig, serve_market
from swarm.errors import ConfigError
from swarm.p2p.identity import SIGNATURE_HEADER, peer_id_of, sign_body, sign_request
from swarm.protocol.market import CoverageHeartbeat, HeldSlice
from tests.conftest import eventually

MID = "apitest-0123456789ab"
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MANIFEST = ModelManifest(model_id=MID, arch="qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, d_model=16,
                         d_expert=8, bytes_per_expert=[1000, 1000])
POLICY = MarketPolicy(hold_s=0.6, cooldown_s=0.5, heartbeat_ttl_s=5.0, lease_s=5.0, flush_s=0.2,
                      header_allowance=0, retry_after_s=1.0)


def key(n: int) -> KeyPair:
    return create_new_key_pair(bytes([n]) * 32)


def slice_bytes(model: str, layer: str, span: str) -> bytes:
    return f"{model}/{layer}/{span};".encode() * 100


@dataclass
class FakeCoordinator:
    busy: int = 0
    url: str = ""
    polls: int = 0


def fake_coordinator_app(state: FakeCoordinator) -> Starlette:
    async def slots(_: Request) -> Response:
        state.polls += 1
        return JSONResponse([{"id": i, "is_processing": i < state.busy, "n_ctx": 512, "n_decoded": 0}
                             for i in range(4)])

    async def slice_file(request: Request) -> Response:
        p = request.path_params
        body = slice_bytes(p["model"], p["layer"], p["span"])
        return Response(body, headers={"etag": f'"{hashlib.sha256(body).hexdigest()}"'},
                        media_type="application/octet-stream")

    return Starlette(routes=[Route("/slots", slots), Route("/v1/slices/{model}/{layer}/{span}", slice_file)])


@pytest.fixture
async def coordinator(nursery: trio.Nursery) -> FakeCoordinator:
    state = FakeCoordinator()
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    binds = await nursery.start(serve, fake_coordinator_app(state), hc)
    state.url = binds[0]
    return state


@pytest.fixture(params=["sqlite", "postgresql"])
def market_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The market's ``--db`` for the tests run on both durable back-ends (PostgreSQL: ``pg_url``)."""
    if request.param == "sqlite":
        return str(tmp_path / "market.db")
    url: str = request.getfixturevalue("pg_url")
    return url


def market_cfg(tmp_path: Path, **kw: Any) -> MarketConfig:
    return MarketConfig(db=str(tmp_path / "market.db"), port=0, token=TOKEN, relays=("/ip4/127.0.0.1/tcp/4001/p2p/R",),
                        poll_interval_s=0.1, poll_timeout_s=0.5, tick_s=0.05, seed=1, policy=POLICY, **kw)


@asynccontextmanager
async def running_market(cfg: MarketConfig) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as n:
        url = await n.start(serve_market, cfg)
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            yield client
        n.cancel_scope.cancel()


def heartbeat(kp: KeyPair, epoch: int, seq: int, slices: list[HeldSlice], *, peer_id: str | None = None,
              addrs: list[str] | None = None) -> bytes:
    pid = peer_id or peer_id_of(kp)
    body = CoverageHeartbeat(pid, epoch, seq, addrs or [f"/ip4/127.0.0.1/tcp/5000/p2p/{pid}"], slices, protocols=[2])
    return msgspec.json.encode(msgspec.structs.replace(body, signature=sign_body(kp, body)))


_poll_seq = 0


def signed_poll_body(kp: KeyPair, **fields: Any) -> tuple[bytes, dict[str, str]]:
    """A poll as a volunteer sends it: (epoch, sequence) (epoch 0 here, below the heartbeats' 1, the
    sequence growing per process), sent_at_ms, and the X-Moe-Signature header over the raw body."""
    global _poll_seq
    _poll_seq += 1
    body = {"peer_id": peer_id_of(kp), "epoch": 0, "sequence": _poll_seq, "sent_at_ms": int(time.time() * 1000), **fields}
    raw = msgspec.json.encode(body)
    return raw, {"content-type": "application/json",
                 SIGNATURE_HEADER: sign_request(kp, "POST", "/api/expert-volunteer", raw)}


async def poll(client: httpx.AsyncClient, kp: KeyPair, **fields: Any) -> httpx.Response:
    raw, headers = signed_poll_body(kp, **fields)
    return await client.post("/api/expert-volunteer", content=raw, headers=headers)


async def register(client: httpx.AsyncClient, coordinator_url: str, epoch: int = 1) -> httpx.Response:
    body = {"url": coordinator_url, "models": [msgspec.to_builtins(MANIFEST)], "epoch": epoch}
    return await client.post("/api/models", json=body, headers=AUTH)


def error_code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


async def test_register_pull_cover_and_dispatch(tmp_path: Path, coordinator: FakeCoordinator, market_db: str) -> None:
    async with running_market(msgspec.structs.replace(market_cfg(tmp_path), db=market_db)) as c:
        r = await register(c, coordinator.url)
        assert r.status_code == 200, r.text
        assert r.json()["dispatch_map_paths"] == {MID: f"/api/expert-dispatch-map?model={MID}"}
        m0 = (await c.get("/api/expert-dispatch-map", params={"model": MID}, headers=AUTH)).json()
        assert m0 == {"model_id": MID, "version": 0, "layers": []}

        kp = key(1)
        pid = peer_id_of(kp)
        r = await poll(c, kp, max_experts=4)
        a = r.json()
        assert a["kind"] == "assignment", a
        expected = slice_bytes(MID, str(a["layer"]), f"{a['lo']}-{a['hi']}")
        assert a["url"] == f"{coordinator.url}/v1/slices/{MID}/{a['layer']}/{a['lo']}-{a['hi']}"
        assert (a["size"], a["sha256"]) == (len(expected), hashlib.sha256(expected).hexdigest())
        assert a["hi"] - a["lo"] == 4 and a["slice"] == f"{a['layer']}:{a['lo']}-{a['hi']}"
        assert a["relays"] == ["/ip4/127.0.0.1/tcp/4001/p2p/R"] and a["coordinator"] == coordinator.url
        assert 0 < a["lease_expires_in_s"] <= POLICY.lease_s

        held = HeldSlice(MID, a["layer"], a["lo"], a["hi"], HeldState.LOADING)
        r = await c.post("/api/expert-coverage", content=heartbeat(kp, 1, 1, [held]))
        assert r.status_code == 200, r.text
        assert r.json()["slices"][0] == {"model_id": MID, "layer": a["layer"], "lo": a["lo"], "hi": a["hi"],
                                                "action": "keep", "dispatched": False, "release_in_s": None,
                                                "reason": ""}
        # serving: the map follows within about a second (long poll wakes on the change)
        with trio.fail_after(2.0):
            waiter = c.get("/api/expert-dispatch-map", params={"model": MID, "after": 0, "wait_s": 5}, headers=AUTH)
            r = await c.post("/api/expert-coverage", content=heartbeat(
                kp, 1, 2, [msgspec.structs.replace(held, state=HeldState.SERVING)]))
            assert r.json()["slices"][0]["dispatched"] is True
            m1 = (await waiter).json()
        assert m1["version"] == 1
        [rep] = m1["layers"][0]["ranges"][0]["replicas"]
        # the tag of the network it spoke from (127.0.0.0/24), salted with the market's secret: no address in it
        from market.core.registry import network_tag

        assert rep.pop("net") == network_tag("127.0.0.1", hashlib.sha256(b"moe-swarm-net\0" + TOKEN.encode()).digest())
        assert network_tag("127.0.0.1", b"") != network_tag("127.0.0.1", b"another secret")
        assert m1["layers"] == [{"layer": a["layer"], "ranges": [{"lo": a["lo"], "hi": a["hi"], "replicas": [
            {"peer_id": pid, "addrs": [f"/ip4/127.0.0.1/tcp/5000/p2p/{pid}"]}]}]}]
        r = await c.get("/api/expert-dispatch-map", params={"model": MID}, headers={"if-none-match": '"1"', **AUTH})
        assert r.status_code == 304

        d = (await c.get("/api/expert-demand")).json()
        seg = [s for s in d["models"][0]["segments"] if s["layer"] == a["layer"] and s["lo"] == a["lo"]][0]
        assert (seg["replicas"], seg["target"], seg["scarcity"], seg["hi"]) == (1, 1, 0.0, a["hi"])
        assert d["recruiting"] is False
        rec = (await c.get("/api/moe/recruitment")).json()["models"][0]
        assert rec["workers"][0]["peer_id"] == pid and rec["workers"][0]["dispatched"] is True
        assert rec["coordinators"][0]["url"] == coordinator.url
        metrics = (await c.get("/metrics")).text
        assert "moe_swarm_market_volunteers 1.0" in metrics
        assert f'moe_swarm_market_map_version{{model="{MID}"}} 1.0' in metrics


async def test_bad_input_gets_stable_4xx_and_the_market_keeps_serving(tmp_path: Path,
                                                                       coordinator: FakeCoordinator) -> None:
    kp, other = key(2), key(3)
    pid = peer_id_of(kp)
    good_manifest = msgspec.to_builtins(MANIFEST)
    cases: list[tuple[str, str, dict[str, Any], tuple[int, str]]] = [
        ("POST", "/api/models", {"content": b"{}"}, (401, "unauthorized")),
        ("POST", "/api/models", {"content": b"{}", "headers": {"authorization": "Bearer nope"}}, (401, "unauthorized")),
        ("POST", "/api/models", {"content": b"{not json", "headers": AUTH}, (400, "invalid_body")),
        ("POST", "/api/models", {"json": {"url": "ftp://x", "models": []}, "headers": AUTH}, (400, "invalid_body")),
        ("POST", "/api/models", {"json": {"url": "http://[::1", "models": []}, "headers": AUTH}, (400, "bad_url")),
        ("POST", "/api/models", {"json": {"url": "http://h/?q=1", "models": []}, "headers": AUTH}, (400, "bad_url")),
        ("POST", "/api/models", {"json": {"url": "http://user:pw@h/", "models": []}, "headers": AUTH}, (400, "bad_url")),
        ("POST", "/api/models", {"json": {"url": coordinator.url, "models": [], "epoch": 2**63 - 1}, "headers": AUTH},
         (400, "bad_epoch")),
        ("POST", "/api/models", {"json": {"url": coordinator.url, "models": [good_manifest | {"n_layer": 0}]},
                                 "headers": AUTH}, (400, "invalid_body")),
        ("POST", "/api/models", {"json": {"url": coordinator.url, "models": [good_manifest | {"bytes_per_expert": [1]}]},
                                 "headers": AUTH}, (400, "bad_manifest")),
        ("POST", "/api/models", {"json": {"url": coordinator.url, "models": [good_manifest | {"n_expert": 16}]},
                                 "headers": AUTH}, (409, "manifest_conflict")),
        ("POST", "/api/models", {"json": {"url": coordinator.url, "models": [good_manifest], "epoch": 0},
                                 "headers": AUTH}, (409, "stale_registration")),
        ("POST", "/api/expert-volunteer", dict(zip(("content", "headers"), signed_poll_body(kp), strict=True)),
         (400, "missing_budget")),
        # polls are signed (X-Moe-Signature over method, path and the raw body), fresh and never replayed
        ("POST", "/api/expert-volunteer", {"json": {"peer_id": pid, "max_experts": 2}}, (401, "signature_required")),
        ("POST", "/api/expert-volunteer", {"content": signed_poll_body(kp, max_experts=2)[0],
                                           "headers": signed_poll_body(other, peer_id=pid, max_experts=2)[1]},
         (401, "bad_signature")),
        ("POST", "/api/expert-volunteer", dict(zip(("content", "headers"), signed_poll_body(
            kp, max_experts=2, sent_at_ms=int(time.time() * 1000) - 600_000), strict=True)), (401, "stale_request")),

        ("POST", "/api/expert-volunteer", {"json": {"peer_id": pid, "max_experts": 0}}, (400, "invalid_body")),
        ("POST", "/api/expert-volunteer", {"json": {"peer_id": pid, "max_experts": 2, "extra": 1}},
         (400, "invalid_body")),
        ("POST", "/api/expert-volunteer", {"json": {"peer_id": "QmNotAnEd25519Id", "max_experts": 2}},
         (400, "bad_peer_id")),
        ("POST", "/api/expert-volunteer", {"content": b"[1, 2", }, (400, "invalid_body")),
        ("POST", "/api/expert-coverage", {"content": heartbeat(other, 1, 1, [], peer_id=pid)}, (401, "bad_signature")),
        ("POST", "/api/expert-coverage", {"json": {"peer_id": pid, "epoch": 1, "sequence": 1}},
         (401, "bad_signature")),
        ("POST", "/api/expert-coverage", {"json": {"peer_id": pid, "epoch": -1, "sequence": 1}},
         (400, "invalid_body")),
        ("POST", "/api/expert-coverage", {"content": heartbeat(kp, 1, 1, [HeldSlice(MID, 0, 0, 4),
                                                                          HeldSlice(MID, 0, 0, 4)])},
         (400, "duplicate_slice")),
        # the map names volunteers' addresses: coordinators (the operator token) only
        ("GET", "/api/expert-dispatch-map", {"params": {"model": MID}}, (401, "unauthorized")),
        ("GET", "/api/expert-dispatch-map", {"headers": AUTH}, (400, "missing_parameter")),
        ("GET", "/api/expert-dispatch-map", {"params": {"model": "nope"}, "headers": AUTH}, (404, "unknown_model")),
        ("GET", "/api/expert-dispatch-map", {"params": {"model": MID, "after": "-1"}, "headers": AUTH},
         (400, "bad_parameter")),
        ("GET", "/api/expert-dispatch-map", {"params": {"model": MID, "after": "1", "wait_s": "99"}, "headers": AUTH},
         (400, "bad_parameter")),
        ("GET", "/api/expert-demand", {"params": {"model": "nope"}}, (404, "unknown_model")),
        ("GET", "/api/nope", {}, (404, "not_found")),
        ("GET", "/api/expert-coverage", {}, (405, "method_not_allowed")),
    ]
    async with running_market(market_cfg(tmp_path)) as c:
        assert (await register(c, coordinator.url, epoch=5)).status_code == 200
        for method, path, kw, want in cases:
            r = await c.request(method, path, **kw)
            assert error_code(r) == want, (path, kw.keys(), r.text[:300])
            assert r.json()["error"]["message"]
        # a poll's (epoch, sequence) is the counter its heartbeats share: a replayed one is refused
        raw, headers = signed_poll_body(kp, max_experts=2)
        assert (await c.post("/api/expert-volunteer", content=raw, headers=headers)).status_code == 200
        assert error_code(await c.post("/api/expert-volunteer", content=raw, headers=headers)) == (409, "replayed_sequence")
        # oversized bodies, declared or streamed, are cut off with 413
        for chunked in (False, True):
            status, body = await raw_post(str(c.base_url), "/api/expert-coverage", 5 << 20, chunked=chunked)
            assert status == 413 and msgspec.json.decode(body)["error"]["code"] == "body_too_large"
        # still serving, and none of it registered anything
        assert (await c.get("/health")).json() == {"status": "ok", "models": 1, "volunteers": 0,
                                                  "relays": ["/ip4/127.0.0.1/tcp/4001/p2p/R"], "auth": "token"}
        assert (await c.get("/api/expert-dispatch-map", params={"model": MID}, headers=AUTH)).json()["version"] == 0


async def test_forged_and_replayed_heartbeats_are_rejected(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    victim, attacker = key(4), key(5)
    vid = peer_id_of(victim)
    async with running_market(market_cfg(tmp_path)) as c:
        await register(c, coordinator.url)
        a = (await poll(c, victim, max_experts=8)).json()  # coverage comes from assignment: the victim's lease
        s = HeldSlice(MID, a["layer"], a["lo"], a["hi"])
        # the attacker signs a heartbeat in the victim's name: refused, nothing registered
        r = await c.post("/api/expert-coverage", content=heartbeat(attacker, 1, 1, [s], peer_id=vid))
        assert error_code(r) == (401, "bad_signature")
        # a genuine heartbeat whose body was altered after signing: refused too
        body = msgspec.json.decode(heartbeat(victim, 1, 1, [s]))
        body["addrs"] = ["/ip4/6.6.6.6/tcp/1"]
        assert error_code(await c.post("/api/expert-coverage", json=body)) == (401, "bad_signature")
        assert (await c.get("/health")).json()["volunteers"] == 0

        assert (await c.post("/api/expert-coverage", content=heartbeat(victim, 2, 7, [s]))).status_code == 200
        r = await c.post("/api/expert-coverage", content=heartbeat(victim, 2, 7, []))
        assert error_code(r) == (409, "replayed_sequence")
        r = await c.post("/api/expert-coverage", content=heartbeat(victim, 1, 100, []))
        assert error_code(r) == (409, "stale_epoch")
        m = await eventually(lambda: _map_with_version(c, 1))
        assert list(m["layers"][0]["ranges"][0]["replicas"][0].values())[0] == vid


async def raw_post(base: str, path: str, size: int, *, chunked: bool) -> tuple[int, bytes]:
    """POST ``size`` bytes over a raw socket (httpx would leave its body generator unclosed when the
    server answers before reading everything), reading the response until the server closes."""
    host, port = base.removeprefix("http://").rstrip("/").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    framing = b"transfer-encoding: chunked" if chunked else f"content-length: {size}".encode()
    head = b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + framing + b"\r\n\r\n"
    received = bytearray()

    async def send_body() -> None:
        chunk = b"x" * 65536
        try:
            for _ in range(size // len(chunk)):
                await stream.send_all(b"10000\r\n" + chunk + b"\r\n" if chunked else chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the server answered and closed: expected

    async with stream, trio.open_nursery() as n:
        await stream.send_all(head)
        n.start_soon(send_body)
        with trio.fail_after(10):
            while data := await stream.receive_some():
                received += data
        n.cancel_scope.cancel()
    status_line, _, rest = bytes(received).partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def _map_with_version(c: httpx.AsyncClient, version: int) -> dict[str, Any] | None:
    m: dict[str, Any] = (await c.get("/api/expert-dispatch-map", params={"model": MID}, headers=AUTH)).json()
    return m if m["version"] >= version else None


async def test_kill_and_restart_keeps_registrations(tmp_path: Path, coordinator: FakeCoordinator, market_db: str) -> None:
    kp = key(6)
    pid = peer_id_of(kp)
    cfg = msgspec.structs.replace(market_cfg(tmp_path), db=market_db)
    async with running_market(cfg) as c:
        await register(c, coordinator.url, epoch=3)
        a = (await poll(c, kp, max_experts=8)).json()
        s = HeldSlice(MID, a["layer"], a["lo"], a["hi"])
        assert (await c.post("/api/expert-coverage", content=heartbeat(kp, 1, 1, [s]))).status_code == 200
        before = await eventually(lambda: _map_with_version(c, 1))
        # a second volunteer holds a lease (not yet reported)
        b = (await poll(c, key(7), max_experts=8)).json()
        assert b["kind"] == "assignment"
        assert (await c.post("/api/expert-coverage", content=heartbeat(kp, 1, 2, [s]))).status_code == 200

    async with running_market(cfg) as c:
        # registrations, coverage, the map and its version, the open lease: all still there
        rec = (await c.get("/api/moe/recruitment")).json()["models"]
        assert [m["model_id"] for m in rec] == [MID]
        assert rec[0]["coordinators"][0]["url"] == coordinator.url
        assert [w["peer_id"] for w in rec[0]["workers"]] == [pid]
        after = (await c.get("/api/expert-dispatch-map", params={"model": MID}, headers=AUTH)).json()
        assert after == before
        b2 = (await poll(c, key(7), max_experts=8)).json()
        assert b2["lease_id"] == b["lease_id"]
        # the stale registration is still refused, the replayed heartbeat too (flushed at close)
        assert error_code(await register(c, coordinator.url, epoch=2)) == (409, "stale_registration")
        r = await c.post("/api/expert-coverage", content=heartbeat(kp, 1, 2, [s]))
        assert error_code(r) == (409, "replayed_sequence")
        # and the volunteer carries on without restarting
        r = await c.post("/api/expert-coverage", content=heartbeat(kp, 1, 3, [s]))
        assert r.status_code == 200 and r.json()["slices"][0]["dispatched"] is True


async def test_saturated_coordinator_drives_recruiting(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    async with running_market(market_cfg(tmp_path)) as c:
        await register(c, coordinator.url)

        async def recruitment() -> dict[str, Any]:
            body: dict[str, Any] = (await c.get("/api/moe/recruitment")).json()
            return body["models"][0]

        first = await eventually(lambda: _polled(recruitment))
        assert (first["busy"], first["slots"], first["saturated"], first["recruiting"]) == (0, 4, False, False)
        coordinator.busy = 2
        rec = await eventually(lambda: _when(recruitment, lambda m: m["recruiting"]))
        assert rec["saturated"] is True and rec["busy"] == 2
        assert (rec["base_target"], rec["effective_target"]) == (1, 2)
        d = (await c.get("/api/expert-demand", params={"model": MID})).json()
        assert d["recruiting"] is True and {s["target"] for s in d["models"][0]["segments"]} == {2}
        coordinator.busy = 1  # below the threshold: the boost ends after hold_s
        rec = await eventually(lambda: _when(recruitment, lambda m: not m["recruiting"]))
        assert rec["effective_target"] == 1 and rec["saturated"] is False
        assert coordinator.polls >= 3


async def _polled(get: Any) -> dict[str, Any] | None:
    m: dict[str, Any] = await get()
    return m if m["coordinators"][0]["ok"] else None


async def _when(get: Any, pred: Any) -> dict[str, Any] | None:
    m: dict[str, Any] = await get()
    return m if pred(m) else None


async def test_unreachable_coordinator_cancels_the_lease(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with running_market(market_cfg(tmp_path)) as c:
        await register(c, dead)
        r = await poll(c, key(8), max_experts=4)
        body = r.json()
        assert body["kind"] == "nothing_needed" and body["reason"] == "coordinator_unreachable"
        assert int(r.headers["retry-after"]) >= 1
        segs = (await c.get("/api/expert-demand")).json()["models"][0]["segments"]
        assert {s["pending"] for s in segs} == {0}
        rec = await eventually(lambda: _when(lambda: _first_model(c), lambda m: m["coordinators"][0]["error"]))
        assert rec["coordinators"][0]["ok"] is False


async def _first_model(c: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await c.get("/api/moe/recruitment")).json()
    return body["models"][0]


async def test_concurrent_polls_over_http_get_different_slices(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    got: list[dict[str, Any]] = []
    async with running_market(market_cfg(tmp_path)) as c:
        await register(c, coordinator.url)

        async def one(i: int) -> None:
            r = await poll(c, key(20 + i), max_experts=4)
            got.append(r.json())

        async with trio.open_nursery() as n:
            for i in range(5):
                n.start_soon(one, i)
    assignments = [g for g in got if g["kind"] == "assignment"]
    assert len(assignments) == 4  # 2 layers x 8 experts / 4 per volunteer
    assert len({(g["layer"], g["lo"]) for g in assignments}) == 4
    assert [g["reason"] for g in got if g["kind"] == "nothing_needed"] == ["nothing_scarce"]


def test_cli_flags_make_the_config() -> None:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    ns = p.parse_args(["market", "--db", "/tmp/x.db", "--port", "9001", "--token", "t", "--relay", "/ip4/1.2.3.4/tcp/1",
                       "--relay", "/ip4/5.6.7.8/tcp/2", "--poll-interval", "0.5", "--saturation-threshold", "3",
                       "--base-target", "2", "--boost", "2", "--lease-s", "7", "--heartbeat-ttl-s", "9",
                       "--cooldown-s", "4", "--rise-s", "1.5", "--hold-s", "6"])
    cfg = config_from_args(ns)
    assert cfg.db == "/tmp/x.db" and cfg.port == 9001 and cfg.token == "t"
    assert cfg.relays == ("/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/2") and cfg.poll_interval_s == 0.5
    assert cfg.policy == MarketPolicy(saturation_threshold=3, base_target=2, boost=2, lease_s=7.0,
                                      heartbeat_ttl_s=9.0, cooldown_s=4.0, rise_s=1.5, hold_s=6.0)
    assert ns.func.__name__ == "run" and ns.func.__module__ == "market.cli"
    with pytest.raises(ConfigError, match="^--boost: "):
        config_from_args(p.parse_args(["market", "--db", ":memory:", "--boost", "-1"]))
    with pytest.raises(ConfigError, match="^--poll-interval: "):
        config_from_args(p.parse_args(["market", "--db", ":memory:", "--poll-interval", "0"]))
    default = config_from_args(p.parse_args(["market", "--data-dir", "/tmp/mkt"]))
    assert default.db == "/tmp/mkt/market.db" and default.policy == MarketPolicy()


async def test_the_market_refuses_to_start_without_a_token_unless_told(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError) as exc:
        await serve_market(MarketConfig(db=":memory:", port=0))
    assert exc.value.code == "token_required" and "--insecure-no-token" in exc.value.message
    # told: it starts, says so in its log and on /health
    async with trio.open_nursery() as n:
        url = await n.start(serve_market, MarketConfig(db=":memory:", port=0, insecure_no_token=True))
        async with httpx.AsyncClient(base_url=url) as h:
            assert "insecure" in (await h.get("/health")).json()["auth"]
        n.cancel_scope.cancel()
    assert any("WITHOUT an operator token" in r.getMessage() for r in caplog.records)
    async with trio.open_nursery() as n:
        url = await n.start(serve_market, MarketConfig(db=":memory:", port=0, token="t"))
        async with httpx.AsyncClient(base_url=url) as h:
            assert (await h.get("/health")).json()["auth"] == "token"
        n.cancel_scope.cancel()
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    assert config_from_args(p.parse_args(["market", "--db", ":memory:", "--insecure-no-token"])).insecure_no_token


async def test_the_dashboard_is_self_contained_under_a_strict_csp(tmp_path: Path) -> None:
    """One file, nothing from elsewhere (no CDN: it works offline); its one inline script and style run by
    their sha256 only, so markup a stranger's text might become could run nothing."""
    async with running_market(market_cfg(tmp_path)) as c:
        r = await c.get("/dashboard")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "unsafe-inline" not in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp
        for tag in ("script", "style"):
            [body] = re.findall(f"<{tag}>(.*?)</{tag}>", r.text, re.S)
            digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
            assert f"{tag}-src 'sha256-{digest}'" in csp
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", r.text)  # no third-party resource
        assert not re.search(r"""\sstyle\s*=""", r.text)  # inline style attributes would be refused


async def test_an_idle_connection_outlives_the_heartbeat_interval(tmp_path: Path) -> None:
    """A volunteer's pooled connection, idle for its 5 s heartbeat interval, is still open when it is used again
    (hypercorn's default keep-alive is 5 s: the heartbeat raced the close and failed now and then)."""
    async with running_market(market_cfg(tmp_path)) as c:
        host, port = str(c.base_url.host), int(c.base_url.port or 80)
        stream = await trio.open_tcp_stream(host, port)
        request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()

        async def exchange() -> bytes:
            await stream.send_all(request)
            got = b""
            with trio.fail_after(5):
                while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                    chunk = await stream.receive_some(65536)
                    assert chunk, "the market closed the connection"
                    got += chunk
            return got

        assert (await exchange()).startswith(b"HTTP/1.1 200")
        await trio.sleep(MarketPolicy().heartbeat_s + 1.0)  # idle past a default heartbeat interval (5 s), hypercorn's default
        assert (await exchange()).startswith(b"HTTP/1.1 200")
        await stream.aclose()


async def test_a_database_outage_answers_503_then_the_market_carries_on(tmp_path: Path, coordinator: FakeCoordinator,
                                                                       pg_server: Any) -> None:
    """A real market on PostgreSQL; the server stops: requests that would change state answer 503
    ``store_error`` (nothing decided from memory the database lacks); it starts again: the market carries
    on, with what was committed before and nothing from the outage."""
    cfg = msgspec.structs.replace(market_cfg(tmp_path), db=pg_server.database(),
                                  policy=msgspec.structs.replace(POLICY, lease_s=600.0))  # outlives the outage
    async with running_market(cfg) as c:
        assert (await register(c, coordinator.url)).status_code == 200
        first = (await poll(c, key(30), max_experts=4)).json()
        assert first["kind"] == "assignment"
        await trio.to_thread.run_sync(pg_server.halt)
        try:
            for n in (31, 32):
                assert error_code(await poll(c, key(n), max_experts=4)) == (503, "store_error")
        finally:
            await trio.to_thread.run_sync(pg_server.resume)

        async def assigned() -> Any:
            r = await poll(c, key(33), max_experts=4)
            return r.json() if r.status_code == 200 else None

        later = await eventually(assigned, within=30, interval=0.2)
        assert later["kind"] == "assignment" and later["lease_id"] != first["lease_id"]
        again = (await poll(c, key(30), max_experts=4)).json()
        assert again["lease_id"] == first["lease_id"]  # the lease from before the outage
        leases = (await c.get(f"/api/leases/{first['lease_id']}")).json()
        assert leases["peer_id"] == peer_id_of(key(30))
