"""The market against strangers and careless operators, for real (issue 31): hypercorn on loopback,
a SQLite file, httpx clients, signed requests.

- ``--token ""`` (and a blank ``MOE_SWARM_TOKEN``) is refused like no token; an empty bearer never passes;
- a full disk (SQLite's page cap): a registration answered 503 ``store_error`` is not in memory either;
- 3,000 signed throwaway heartbeats (from 50 loopback addresses) do not grow the database;
- a quarantine report without evidence is refused 400 ``missing_evidence``;
- a registration at an unreachable URL stops being hosted (the real /slots poller);
- ``/metrics`` stays bounded and the event loop keeps running while it is computed.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from libp2p.crypto.ed25519 import create_new_key_pair

from market.api import METRICS_MAX_LAYER_SERIES, METRICS_MAX_MODELS, MarketApi, build_market_app
from market.cli import add_parser, config_from_args
from market.core.records import ModelManifest
from market.policy import MarketPolicy
from market.server import MarketConfig, serve_market
from market.state import Market
from market.store import open_sqlite_store
from swarm.errors import ConfigError, SliceError
from swarm.p2p.identity import peer_id_of, sign_body
from swarm.protocol.market import CoverageHeartbeat, HeldSlice, HeldState
from tests.conftest import eventually

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
POLICY = MarketPolicy(heartbeat_ttl_s=30.0, header_allowance=0, host_down_s=1.0)


def manifest(model_id: str, n_layer: int = 2, n_expert: int = 8) -> ModelManifest:
    return ModelManifest(model_id=model_id, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert, d_model=16, d_expert=8,
                         bytes_per_expert=[1000] * n_layer)


def cfg(tmp_path: Path, **kw: Any) -> MarketConfig:
    return MarketConfig(db=str(tmp_path / "market.db"), port=0, token=TOKEN, poll_interval_s=0.1, poll_timeout_s=0.2,
                        tick_s=0.05, seed=1, policy=kw.pop("policy", POLICY), **kw)


@asynccontextmanager
async def running(config: MarketConfig) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as n:
        url = await n.start(serve_market, config)
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            yield client
        n.cancel_scope.cancel()


def parse(*argv: str) -> MarketConfig:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    return config_from_args(p.parse_args(["market", "--db", ":memory:", *argv]))


# -- item 6 -----------------------------------------------------------------------------------------------


async def test_an_empty_token_is_refused_like_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MOE_SWARM_TOKEN", raising=False)
    for argv in (["--token", ""], ["--token", "   "]):
        c = parse(*argv)
        assert c.token is None
        with pytest.raises(ConfigError) as e:
            await serve_market(c)
        assert e.value.code == "token_required"
    monkeypatch.setenv("MOE_SWARM_TOKEN", "")
    assert parse().token is None
    monkeypatch.setenv("MOE_SWARM_TOKEN", " \t")
    assert parse().token is None
    with pytest.raises(ConfigError):
        parse("--token", " padded ")  # compared stripped, it could never match: refused, not silently useless
    with pytest.raises(ConfigError):  # a config built in code, past the flag parsing
        await serve_market(MarketConfig(db=":memory:", token=""))
    # a real token: an empty bearer is no bearer
    async with running(cfg(tmp_path)) as c:
        for header in ("Bearer", "", "bearer", "Basic Og=="):  # (httpx sends no trailing blanks)
            r = await c.post("/api/models", json={"url": "http://c.test", "models": []},
                             headers={"authorization": header})
            assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
        assert (await c.get("/health")).json()["auth"] == "token"


# -- item 8 -----------------------------------------------------------------------------------------------


async def _no_describe(url: str) -> tuple[str, int]:
    raise SliceError("not in this test", code="slice_unavailable")


async def test_a_full_disk_refuses_a_registration_in_memory_too(tmp_path: Path, nursery: trio.Nursery) -> None:
    store = open_sqlite_store(tmp_path / "market.db")
    market = Market(store, POLICY, now=time.time(), rng=random.Random(0))
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    url = (await nursery.start(serve, build_market_app(MarketApi(market, time.time, _no_describe, token=TOKEN)), hc))[0]
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as c:
        r = await c.post("/api/models", json={"url": "http://c1.test", "models": [msgspec.to_builtins(manifest("one-0123"))],
                                              "epoch": 1}, headers=AUTH)
        assert r.status_code == 200, r.text
        conn = store._c()  # the disk is full from now on: SQLite may use no page it does not have
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        conn.execute(f"PRAGMA max_page_count = {pages}")
        big = [msgspec.to_builtins(manifest(f"big{i}-0123", n_layer=512, n_expert=64)) for i in range(16)]
        r = await c.post("/api/models", json={"url": "http://c2.test", "models": big, "epoch": 1}, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "store_error"), r.text
        health = (await c.get("/health")).json()
        assert health["models"] == 1  # not 17: memory and disk agree
        assert (await c.get("/api/expert-demand", params={"model": "big0-0123"})).status_code == 404
        assert "http://c2.test" not in market.ix.coordinators
        r = await c.get("/api/moe/recruitment")  # and the market keeps serving
        assert r.status_code == 200 and [m["model_id"] for m in r.json()["models"]] == ["one-0123"]
        conn.execute("PRAGMA max_page_count = 1073741823")
        r = await c.post("/api/models", json={"url": "http://c2.test", "models": big, "epoch": 1}, headers=AUTH)
        assert r.status_code == 200 and (await c.get("/health")).json()["models"] == 17
    store.close()
    again = Market(open_sqlite_store(tmp_path / "market.db"), POLICY, now=time.time(), rng=random.Random(0))
    assert len(again.ix.models) == 17


# -- item 5 -----------------------------------------------------------------------------------------------


def _heartbeat(i: int, addr: str = "") -> bytes:
    kp = create_new_key_pair(i.to_bytes(4, "big") * 8)
    pid = peer_id_of(kp)
    hb = CoverageHeartbeat(pid, 1, 1, [addr or f"/ip4/10.1.{i // 250}.{i % 250}/tcp/4001/p2p/{pid}"],
                           [HeldSlice("one-0123", 0, 0, 4, HeldState.SERVING)], protocols=[2])
    return msgspec.json.encode(msgspec.structs.replace(hb, signature=sign_body(kp, hb)))


def _db_bytes(tmp_path: Path) -> int:
    return sum(p.stat().st_size for p in tmp_path.glob("market.db*"))


async def test_three_thousand_signed_throwaway_heartbeats_do_not_grow_the_database(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as c:
        r = await c.post("/api/models", json={"url": "http://127.0.0.1:9", "models": [msgspec.to_builtins(manifest("one-0123"))],
                                              "epoch": 1}, headers=AUTH)
        assert r.status_code == 200
        await trio.sleep(0.3)  # the first ticks and flushes are written
        before = _db_bytes(tmp_path)
        bodies = [_heartbeat(i) for i in range(3000)]
        url = str(c.base_url)
        codes: dict[int, int] = {}

        async def from_address(k: int) -> None:  # 50 loopback addresses x 60 identities
            async with httpx.AsyncClient(base_url=url, timeout=30.0,
                                         transport=httpx.AsyncHTTPTransport(local_address=f"127.0.0.{10 + k}")) as mine:
                for body in bodies[k * 60:(k + 1) * 60]:
                    r = await mine.post("/api/expert-coverage", content=body)
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                    assert r.status_code != 200 or [d["reason"] for d in r.json()["slices"]] == ["not_assigned"]

        async with trio.open_nursery() as n:
            for k in range(50):
                n.start_soon(from_address, k)
        assert codes == {200: 3000}
        # one address speaks for at most 64 identities
        one = [_heartbeat(10_000 + i) for i in range(70)]
        got = [(await c.post("/api/expert-coverage", content=b)).status_code for b in one]
        assert got.count(200) == 64 - 0 and got[64:] == [429] * 6
        # 500-character addresses are refused outright
        r = await c.post("/api/expert-coverage", content=_heartbeat(20_000, addr="/dns4/" + "x" * 500))
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_body")
        await trio.sleep(0.3)
        grown = _db_bytes(tmp_path) - before
        assert grown < 64 * 1024, grown  # was 25 MB for 3,000 identities: now not a row
    with sqlite3.connect(tmp_path / "market.db") as db:
        assert db.execute("SELECT count(*) FROM volunteers").fetchone() == (0,)


# -- item 9 -----------------------------------------------------------------------------------------------


async def test_a_quarantine_report_without_evidence_is_refused(tmp_path: Path) -> None:
    async with running(cfg(tmp_path)) as c:
        await c.post("/api/models", json={"url": "http://127.0.0.1:9", "models": [msgspec.to_builtins(manifest("one-0123"))],
                                          "epoch": 1}, headers=AUTH)
        body = {"url": "http://127.0.0.1:9", "model_id": "one-0123", "workers": [{"peer_id": "p", "quarantine": "lies"}]}
        r = await c.post("/api/coordinator-report", json=body, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "missing_evidence")
        body["workers"] = [{"peer_id": "p", "pairs": 2**64}]
        r = await c.post("/api/coordinator-report", json=body, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_body")
        body["workers"] = [{"peer_id": "p", "pairs": 10}]
        r = await c.post("/api/coordinator-report", json=body, headers=AUTH)
        assert r.status_code == 200 and r.json() == {"workers": 1, "quarantined": [], "ignored": ["p"]}
        r = await c.post("/api/models", json={"url": "http://c9.test", "models": [msgspec.to_builtins(manifest("two-0123"))],
                                              "epoch": int((time.time() + 86_400) * 1000)}, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_epoch")  # a day ahead would lock the URL


# -- item 7 -----------------------------------------------------------------------------------------------


async def test_a_registration_at_an_unreachable_url_stops_being_hosted(tmp_path: Path) -> None:
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with running(cfg(tmp_path)) as c:
        r = await c.post("/api/models", json={"url": dead, "models": [msgspec.to_builtins(manifest("one-0123"))],
                                              "epoch": 1}, headers=AUTH)
        assert r.status_code == 200

        async def unhosted() -> bool:
            d = (await c.get("/api/expert-demand")).json()
            return not d["models"][0]["hosted"]

        await eventually(unhosted, within=10.0)
        rec = (await c.get("/api/moe/recruitment")).json()["models"][0]
        assert rec["coordinators"][0]["hosting"] is False and rec["coordinators"][0]["error"]
        events = (await c.get("/api/events")).json()["events"]
        assert "host_down" in [e["kind"] for e in events]


# -- item 9: /metrics ---------------------------------------------------------------------------------------


async def test_metrics_stay_bounded_and_never_stall_the_event_loop(tmp_path: Path) -> None:
    """Four coordinators register 16 models of 4096 layers each (what took /metrics to 262,210 series
    and ~4 s of blocking before): the page has a bounded number of series, and a task that wakes every
    millisecond never waits long while it is computed."""
    policy = MarketPolicy(heartbeat_ttl_s=30.0, header_allowance=0)
    async with running(cfg(tmp_path, policy=policy)) as c:
        for k in range(4):
            models = [msgspec.to_builtins(manifest(f"wide{k}-{i:02d}-0123", n_layer=4096, n_expert=16)) for i in range(16)]
            r = await c.post("/api/models", json={"url": f"http://c{k}.test", "models": models, "epoch": 1}, headers=AUTH)
            assert r.status_code == 200, r.text
        worst = 0.0
        done = False

        async def heartbeat_of_the_loop() -> None:
            nonlocal worst
            last = time.perf_counter()
            while not done:
                await trio.sleep(0.001)
                now = time.perf_counter()
                worst = max(worst, now - last)
                last = now

        async with trio.open_nursery() as n:
            n.start_soon(heartbeat_of_the_loop)
            await trio.sleep(0.05)
            worst = 0.0
            text = (await c.get("/metrics")).text
            done = True
        series = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert len(series) < METRICS_MAX_MODELS * 8 + METRICS_MAX_LAYER_SERIES + 200, len(series)
        assert text.count("moe_swarm_market_layer_replicas_min{") == METRICS_MAX_LAYER_SERIES
        assert "moe_swarm_market_models 64.0" in text and "moe_swarm_market_models_omitted 0.0" in text
        assert worst < 1.0, worst  # was ~4 s; a model at a time now
