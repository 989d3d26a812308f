"""Market replicas as real processes on one real PostgreSQL server, under faults (issue 29 item 4).

- ``kill -9`` of one replica while volunteers poll and heartbeat and a coordinator reports through both
  (clients hold both URLs: ``swarm.failover``): they carry on through the other; no slice is leased to two
  volunteers; every report's pairs are credited exactly once.
- A replica cut off from its database (a TCP proxy in front of PostgreSQL that the test cuts) answers
  writes with 503 ``store_error`` -- never from its stale memory -- while the other replica serves; once the
  proxy is back it catches up with what the other one decided meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from libp2p.crypto.ed25519 import create_new_key_pair
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from market.core.records import HeldState, ModelManifest
from swarm.failover import FailoverTransport
from swarm.p2p.identity import peer_id_of, sign_request

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0k"
MID = "faults-0123456789ab"
N_LAYER, N_EXPERT, SLICE = 4, 16, 4  # 16 slices of 4 experts, target 1: 16 leases to give in all


def fake_coordinator() -> Starlette:
    async def slots(_: Request) -> Response:
        return JSONResponse([{"id": i, "is_processing": False} for i in range(4)])

    async def slice_file(request: Request) -> Response:
        body = request.url.path.encode() * 16
        return Response(body, headers={"etag": f'"{hashlib.sha256(body).hexdigest()}"'})

    return Starlette(routes=[Route("/slots", slots), Route("/v1/slices/{m}/{layer}/{span}", slice_file)])


def start_market(db: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    fh = open(log, "wb")  # noqa: SIM115 -- the process writes it for its whole life
    p = subprocess.Popen([sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", "market", "--db", db, "--replica",
                          "--port", "0", "--token", TOKEN, "--lease-s", "600", "--heartbeat-ttl-s", "600",
                          "--max-leases-per-address", "100000", "--max-identities-per-address", "100000"],
                         stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    fh.close()
    deadline = time.monotonic() + 60
    while True:
        text = log.read_text(errors="replace")
        ready = [line for line in text.splitlines() if line.startswith("market ready at ")]
        if ready:
            return p, ready[0].split()[3]
        assert p.poll() is None, text
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


def stop(p: subprocess.Popen[bytes]) -> int:
    """Wait for a terminated market; one that does not end within 30 s is killed (never left behind)."""
    try:
        return p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)
        raise


class Proxy:
    """A TCP proxy in front of PostgreSQL that the test can cut (every connection closed, new ones refused)
    and restore (listening again on the same port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self._scope = trio.CancelScope()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._scope:
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            task_status.started()
            await trio.serve_listeners(self._pipe, listeners)

    async def _pipe(self, down: trio.SocketStream) -> None:
        try:
            up = await trio.open_tcp_stream(*self.upstream)
        except OSError:
            await down.aclose()
            return

        async def copy(a: trio.SocketStream, b: trio.SocketStream) -> None:
            try:
                while data := await a.receive_some(65536):
                    await b.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

        async with up, down, trio.open_nursery() as nursery:
            nursery.start_soon(copy, down, up)
            nursery.start_soon(copy, up, down)

    def cut(self) -> None:
        self._scope.cancel()
        self._scope = trio.CancelScope()


class Volunteer:
    def __init__(self, i: int) -> None:
        self.key = create_new_key_pair(i.to_bytes(4, "big") * 8)
        self.peer = peer_id_of(self.key)
        self.seq = 0
        self.got: dict[str, Any] = {}

    def signed(self, path: str, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        self.seq += 1
        raw = msgspec.json.encode({**body, "peer_id": self.peer, "epoch": 1, "sequence": self.seq,
                                   "sent_at_ms": int(time.time() * 1000)})
        return raw, {"x-moe-signature": sign_request(self.key, "POST", path, raw), "content-type": "application/json"}

    async def poll(self, c: httpx.AsyncClient) -> httpx.Response:
        raw, headers = self.signed("/api/expert-volunteer", {"max_experts": SLICE})
        return await c.post("/api/expert-volunteer", content=raw, headers=headers)

    async def heartbeat(self, c: httpx.AsyncClient, state: HeldState) -> httpx.Response:
        g = self.got
        raw, headers = self.signed("/api/expert-coverage", {
            "addrs": [f"/ip4/127.0.0.1/tcp/4000/p2p/{self.peer}"], "protocols": [2],
            "slices": [{"model_id": MID, "layer": g["layer"], "lo": g["lo"], "hi": g["hi"], "state": state.value}]})
        return await c.post("/api/expert-coverage", content=raw, headers=headers)


def manifest() -> bytes:
    return msgspec.json.encode(ModelManifest(model_id=MID, arch="qwen3moe", n_layer=N_LAYER, n_expert=N_EXPERT,
                                             bytes_per_expert=[1000] * N_LAYER))


async def register(base: str, coordinator: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{base}/api/models", headers={"authorization": f"Bearer {TOKEN}"},
                         content=b'{"url": "%s", "epoch": 1, "models": [%s]}' % (coordinator.encode(), manifest()))
        assert r.status_code == 200, r.text


async def coordinator_up(nursery: trio.Nursery) -> str:
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    return str((await nursery.start(serve, fake_coordinator(), hc))[0])


@pytest.fixture
async def replicas(pg_url: str, tmp_path: Path) -> AsyncIterator[tuple[list[subprocess.Popen[bytes]], list[str]]]:
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for name in ("a", "b"):
            p, u = await trio.to_thread.run_sync(start_market, pg_url, tmp_path / f"market-{name}.log")
            procs.append(p)
            urls.append(u)
        yield procs, urls
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            await trio.to_thread.run_sync(stop, p)


async def test_kill_9_of_one_replica_under_load_loses_no_lease_and_no_credit(
        replicas: tuple[list[subprocess.Popen[bytes]], list[str]], nursery: trio.Nursery) -> None:
    procs, (a, b) = replicas
    coord = await coordinator_up(nursery)
    await register(a, coord)
    volunteers = [Volunteer(i) for i in range(24)]
    granted: dict[str, set[str]] = {}  # slice -> the volunteers it was ever granted to
    counted = 0  # pairs the market acknowledged (answered 200, or 409 replayed for a resent report)
    killed, first_lease, six_leases = trio.Event(), trio.Event(), trio.Event()
    holders: list[Volunteer] = []  # the first volunteer granted a lease: the coordinator reports its work
    done = 0

    async def volunteer(v: Volunteer, bases: list[str]) -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=bases[0], transport=FailoverTransport(bases), timeout=10) as c:
            for _ in range(200):
                try:
                    r = await (v.poll(c) if not v.got else v.heartbeat(c, HeldState.SERVING))
                except httpx.TransportError:
                    continue  # maybe acted on: the next request has a fresh counter and goes to the other replica
                if r.status_code == 409:  # a resent counter another replica took: the next one
                    continue
                assert r.status_code == 200, r.text
                body = r.json()
                if not v.got and body.get("kind") == "assignment":
                    v.got = body
                    if not holders:  # 16 slices for 24 volunteers: which ones get one is a race
                        holders.append(v)
                        first_lease.set()
                    if sum(1 for x in volunteers if x.got) >= 6:
                        six_leases.set()
                    granted.setdefault(body["slice"], set()).add(v.peer)
                if v.got and "slices" in body:
                    break
                if killed.is_set() and not v.got and body.get("reason") == "nothing_scarce":
                    break
                await trio.sleep(0.01)
        done += 1

    async def coordinator(bases: list[str]) -> None:
        nonlocal counted
        async with httpx.AsyncClient(base_url=bases[0], transport=FailoverTransport(bases), timeout=10,
                                     headers={"authorization": f"Bearer {TOKEN}"}) as c:
            await first_lease.wait()
            holder = holders[0]
            for seq in range(1, 41):
                body = msgspec.json.encode({"url": coord, "model_id": MID, "epoch": 5, "sequence": seq,
                                            "workers": [{"peer_id": holder.peer, "calls": 1, "rows": 1, "pairs": 10}]})
                while True:  # the same numbered report until it is known to have landed
                    try:
                        r = await c.post("/api/coordinator-report", content=body,
                                         headers={"content-type": "application/json"})
                    except httpx.TransportError:
                        continue
                    if r.status_code == 200 or (r.status_code == 409 and r.json()["error"]["code"] == "replayed_sequence"):
                        counted += 10
                        break
                    assert r.status_code == 503, r.text
                await trio.sleep(0.01)

    with trio.fail_after(150):  # a wait that never ends fails here, not by the suite's timeout (which breaks trio)
        async with trio.open_nursery() as n:
            for i, v in enumerate(volunteers):
                n.start_soon(volunteer, v, [a, b] if i % 2 else [b, a])
            n.start_soon(coordinator, [a, b])
            await six_leases.wait()
            procs[0].send_signal(signal.SIGKILL)  # replica a dies mid-run, requests in flight
            killed.set()
    assert procs[0].wait(10) == -signal.SIGKILL
    assert done == len(volunteers)
    assert len(granted) == N_LAYER * N_EXPERT // SLICE  # every slice found a volunteer, through b after the kill
    assert all(len(peers) == 1 for peers in granted.values()), granted  # none granted twice
    async with httpx.AsyncClient(timeout=10) as c:
        credit = (await c.get(f"{b}/api/volunteers/{holders[0].peer}")).json()
        demand = (await c.get(f"{b}/api/expert-demand")).json()
    assert counted == 400 and credit["pairs"] == 400, credit  # none lost, none twice
    assert sum(s["replicas"] for m in demand["models"] for s in m["segments"]) > 0


async def test_a_replica_cut_off_from_the_database_answers_503_and_catches_up_after(
        pg_server: Any, tmp_path: Path, nursery: trio.Nursery) -> None:
    url = pg_server.database()
    host, port = "127.0.0.1", pg_server.port
    proxy = Proxy((host, port))
    await nursery.start(proxy.serve)
    cut_url = url.replace(f":{port}/", f":{proxy.port}/")
    pa, a = await trio.to_thread.run_sync(start_market, url, tmp_path / "a.log")
    pb, b = await trio.to_thread.run_sync(start_market, cut_url, tmp_path / "b.log")
    try:
        await register(a, await coordinator_up(nursery))
        v1, v2 = Volunteer(1), Volunteer(2)
        async with httpx.AsyncClient(base_url=b, timeout=30) as cb, httpx.AsyncClient(base_url=a, timeout=30) as ca:
            r = await v1.poll(cb)
            assert r.status_code == 200 and r.json()["kind"] == "assignment", r.text
            v1.got = r.json()
            proxy.cut()
            t0 = time.monotonic()
            r = await v2.poll(cb)
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_error", r.text
            assert time.monotonic() - t0 < 10
            r = await v1.heartbeat(cb, HeldState.LOADING)
            assert r.status_code == 503, r.text
            got = await v2.poll(ca)  # the other replica serves meanwhile (a fresh counter)
            assert got.status_code == 200 and got.json()["kind"] == "assignment", got.text
            await nursery.start(proxy.serve)
            deadline = time.monotonic() + 30
            while True:  # b answers again once its next try reaches the database
                r = await v2.poll(cb)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and time.monotonic() < deadline, r.text
                await trio.sleep(0.2)
            # b caught up: v2's lease, granted by a during the cut, is the one b renews (not a second slice)
            assert r.json()["lease_id"] == got.json()["lease_id"], (r.text, got.text)
            lease = (await cb.get(f"/api/leases/{got.json()['lease_id']}")).json()
            assert lease["peer_id"] == v2.peer
    finally:
        for p in (pa, pb):
            p.terminate()
        for p in (pa, pb):  # the proxy runs on this event loop: the markets close through it
            assert await trio.to_thread.run_sync(stop, p) == 0
