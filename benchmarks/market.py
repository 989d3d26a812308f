"""Market API throughput with 1,000 simulated volunteers: requests/s and latency of
``POST /api/expert-volunteer`` and ``POST /api/expert-coverage`` (DESIGN §11 benchmark format).

    python benchmarks/market.py [--quick | --smoke] [--json OUT] [--volunteers N] [--concurrency C] [--postgresql]
                                [--replicas R [R ...] --db postgresql]

``--smoke`` (``make test``: ``tests/benchmarks``): 20 volunteers, 4 connections, 2 rounds, no demo topology.

The market runs as its own process (``moe-swarm market`` via ``market.cli``) on loopback, with a
SQLite database in a temporary directory (and once more with ``--db :memory:`` for comparison; with
``--postgresql`` also on a throwaway local PostgreSQL server, ``tests/pgserver.py``: Debian's binaries,
fsync and synchronous_commit off, like SQLite's WAL with synchronous=NORMAL no fsync per commit; with
``--replicas 1 2 4 --db postgresql`` also 1, 2 and 4 market replicas (``--replica``) on one fresh database each,
the client's connections spread over them: cases ``.../postgresql-rR``);
this process runs the simulated volunteers (httpx, ``--concurrency`` connections) and a fake
coordinator that answers ``/slots`` and the slice ``HEAD``s the market makes to learn each new
slice's size and sha256. The hosted model has 64 layers x 64 experts (enough 4-expert slices for
1,000 volunteers at base target 1). Heartbeats are signed (Ed25519, ``swarm.p2p.identity``) before
the clock starts: the market's verification is measured, the volunteers' signing is not.

Cases: ``health-baseline`` (``GET /health``: the HTTP stack alone, for scale), ``expert-volunteer`` (one pull per volunteer: scarcest-slice search over 4,096 experts,
a lease written, and a ``HEAD`` of the new slice file on the coordinator),
``expert-volunteer-repoll`` (the same volunteers asking again while their lease is open: the
same lease back, slice description cached), ``expert-coverage-first`` (each volunteer's first heartbeat: a coverage row
written), ``expert-coverage-steady`` (later heartbeats: signature check, epoch/sequence check, no
durable write).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from market.core.records import HeldState, ModelManifest  # noqa: E402
from swarm.p2p.identity import peer_id_of, sign_body, sign_request  # noqa: E402
from swarm.protocol.market import CoverageHeartbeat, HeldSlice  # noqa: E402

N_LAYER, N_EXPERT, SLICE = 64, 64, 4
MID = f"bench-{'0' * 12}"
RUNNER = (
    "import argparse, sys\n"
    "from market.cli import add_parser\n"
    "p = argparse.ArgumentParser(); add_parser(p.add_subparsers(dest='command'))\n"
    "ns = p.parse_args(sys.argv[1:]); sys.exit(ns.func(ns))\n"
)


def fake_coordinator() -> Starlette:
    async def slots(_: Request) -> Response:
        return JSONResponse([{"id": i, "is_processing": False} for i in range(4)])

    async def slice_file(request: Request) -> Response:
        body = request.url.path.encode() * 64
        return Response(body, headers={"etag": f'"{hashlib.sha256(body).hexdigest()}"'})

    return Starlette(routes=[Route("/slots", slots), Route("/v1/slices/{m}/{layer}/{span}", slice_file)])


def start_market(db: str, replica: bool = False) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, "market", "--db", db, "--port", "0", "--token", "bench", "--seed", "1",
         "--heartbeat-ttl-s", "600", "--lease-s", "600", "--max-leases-per-address", "100000",  # all on loopback
         "--max-identities-per-address", "100000", *(["--replica"] if replica else [])],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("market ready at "):
        proc.kill()
        raise SystemExit(f"market did not start: {line!r}")
    return proc, line.split()[3]


class RawConn:
    """A minimal HTTP/1.1 keep-alive client (the market answers with Content-Length): httpx costs ~3 ms
    of client CPU per request on trio, which would make this benchmark measure the client."""

    def __init__(self, stream: trio.SocketStream, addr: tuple[str, int] = ("", 0)) -> None:
        self.stream = stream
        self.addr = addr
        self.buf = bytearray()

    async def request(self, method: str, path: str, body: bytes = b"", extra: str = "") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n{extra}"
                f"content-length: {len(body)}\r\n\r\n").encode()
        await self.stream.send_all(head + body)
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self.buf += await self._more()
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        size = next(int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length:"))
        del self.buf[: end + 4]
        while len(self.buf) < size:
            self.buf += await self._more()
        out = bytes(self.buf[:size])
        del self.buf[:size]
        return status, out

    async def _more(self) -> bytes:
        data = await self.stream.receive_some(1 << 16)
        if not data:
            raise ConnectionError("market closed the connection")
        return data


class Pool:
    """Keep-alive connections, spread over the market replicas at ``addrs`` (connection i to replica
    i mod R); one that the server closed is replaced (same replica) and the request retried once (a
    server may close an idle keep-alive connection at any time; this happens rarely here)."""

    def __init__(self, addrs: list[tuple[str, int]]) -> None:
        self.addrs = addrs
        self.free: list[RawConn] = []
        self.reconnects = 0

    async def open(self, n: int) -> None:
        self.free = [RawConn(await trio.open_tcp_stream(*a), a)
                     for a in (self.addrs[i % len(self.addrs)] for i in range(max(n, len(self.addrs))))]

    async def request(self, method: str, path: str, body: bytes = b"", extra: str = "") -> tuple[int, bytes]:
        conn = self.free.pop()
        try:
            return await conn.request(method, path, body, extra)
        except (ConnectionError, trio.BrokenResourceError):
            await conn.stream.aclose()
            self.reconnects += 1
            conn = RawConn(await trio.open_tcp_stream(*conn.addr), conn.addr)
            return await conn.request(method, path, body, extra)
        finally:
            self.free.append(conn)


async def timed(n: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> tuple[float, list[float]]:
    lat: list[float] = []
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            t = time.perf_counter()
            await one(i)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - t0, lat


def case(name: str, store: str, wall: float, lat: list[float], **extra: Any) -> dict[str, Any]:
    lat = sorted(lat)
    return {
        "case": f"{name}/{store}",
        "requests": len(lat),
        "requests_per_s": round(len(lat) / wall, 1),
        "median_ms": round(statistics.median(lat) * 1000, 2),
        "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 2),
        **extra,
    }


async def run_store(store: str, db: str, n: int, concurrency: int, rounds: int, replicas: int = 0) -> list[dict[str, Any]]:
    """``replicas`` > 0: that many market processes with ``--replica`` on ``db`` (PostgreSQL), the
    connections spread over them."""
    keys = [create_new_key_pair(i.to_bytes(4, "big") * 8) for i in range(n)]
    peers = [peer_id_of(k) for k in keys]
    out: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        hc = Config()
        hc.bind = ["127.0.0.1:0"]
        hc.accesslog = None
        coord_url = (await nursery.start(serve, fake_coordinator(), hc))[0]
        started = [await trio.to_thread.run_sync(start_market, db, replicas > 0) for _ in range(max(1, replicas))]
        url = started[0][1]
        try:
            addrs = [(h, int(pt)) for h, pt in (u.removeprefix("http://").split(":") for _, u in started)]
            pool = Pool(addrs)
            await pool.open(concurrency)

            async def post(path: str, body: bytes, signature: str = "") -> bytes:
                status, resp = await pool.request("POST", path, body, f"x-moe-signature: {signature}\r\n" if signature else "")
                if status != 200:
                    raise SystemExit(f"{path}: HTTP {status}: {resp[:300]!r}")
                return resp

            async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
                manifest = ModelManifest(model_id=MID, arch="qwen3moe", n_layer=N_LAYER, n_expert=N_EXPERT,
                                         bytes_per_expert=[1 << 20] * N_LAYER)
                r = await c.post("/api/models", headers={"authorization": "Bearer bench"},
                                 content=msgspec.json.encode({"url": coord_url, "models": [manifest], "epoch": 1}))
                r.raise_for_status()
                # signed polls (DESIGN §11): (epoch 0, sequence 1) for the pull, 2 for the re-poll; heartbeats use epoch 1
                def poll_body(i: int, seq: int) -> tuple[bytes, str]:
                    raw = msgspec.json.encode({"peer_id": peers[i], "max_experts": SLICE, "epoch": 0, "sequence": seq,
                                               "sent_at_ms": int(time.time() * 1000)})
                    return raw, sign_request(keys[i], "POST", "/api/expert-volunteer", raw)

                bodies = [poll_body(i, 1) for i in range(n)]
                rebodies = [poll_body(i, 2) for i in range(n)]
                got: list[dict[str, Any]] = [{}] * n

                async def health(i: int) -> None:
                    status, _ = await pool.request("GET", "/health")
                    if status != 200:
                        raise SystemExit(f"/health: HTTP {status}")

                wall, lat = await timed(n, concurrency, health)
                out.append(case("health-baseline", store, wall, lat))

                async def pull(i: int) -> None:
                    got[i] = json.loads(await post("/api/expert-volunteer", *bodies[i]))

                wall, lat = await timed(n, concurrency, pull)
                assigned = sum(1 for g in got if g.get("kind") == "assignment")
                out.append(case("expert-volunteer", store, wall, lat, volunteers=n, assigned=assigned))

                async def repoll(i: int) -> None:
                    again = json.loads(await post("/api/expert-volunteer", *rebodies[i]))
                    if again.get("lease_id") != got[i].get("lease_id"):
                        raise SystemExit(f"volunteer {i} got a different lease on a re-poll: {got[i]} then {again}")

                wall, lat = await timed(n, concurrency, repoll)
                out.append(case("expert-volunteer-repoll", store, wall, lat, volunteers=n))

                def signed(i: int, seq: int) -> bytes:
                    g = got[i]
                    held = [HeldSlice(MID, g["layer"], g["lo"], g["hi"], HeldState.SERVING)] if "layer" in g else []
                    hb = CoverageHeartbeat(peers[i], 1, seq, [f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{peers[i]}"], held,
                                           protocols=[2])
                    return msgspec.json.encode(msgspec.structs.replace(hb, signature=sign_body(keys[i], hb)))

                steady_wall, steady_lat = 0.0, []
                for rnd in range(1, rounds + 1):
                    hbs = [signed(i, rnd) for i in range(n)]

                    async def beat(i: int, hbs: list[bytes] = hbs) -> None:
                        await post("/api/expert-coverage", hbs[i])

                    wall, lat = await timed(n, concurrency, beat)
                    if rnd == 1:
                        out.append(case("expert-coverage-first", store, wall, lat, volunteers=n))
                    else:
                        steady_wall += wall
                        steady_lat += lat
                if steady_lat:
                    out.append(case("expert-coverage-steady", store, steady_wall, steady_lat, volunteers=n,
                                    rounds=rounds - 1))
                alive = (await c.get("/health")).json()
                dm = (await c.get("/api/expert-dispatch-map", params={"model": MID},
                                  headers={"authorization": "Bearer bench"})).json()
                first = next(c_ for c_ in out if c_["case"].startswith("expert-coverage-first"))
                first["live_volunteers"] = alive["volunteers"]
                first["map_ranges"] = sum(len(layer["ranges"]) for layer in dm["layers"])
                for c_ in out:
                    c_["reconnects"] = pool.reconnects
        finally:
            for proc, _ in started:
                proc.terminate()
            for proc, _ in started:
                await trio.to_thread.run_sync(proc.wait)
        nursery.cancel_scope.cancel()
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    n = args.volunteers or (20 if args.smoke else 200 if args.quick else 1000)
    rounds = 2 if args.quick or args.smoke else 4
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moe-swarm-bench-market-") as tmp:
        cases += await run_store("sqlite", str(Path(tmp) / "market.db"), n, args.concurrency, rounds)
        if args.postgresql or args.replicas:
            from tests.pgserver import PgServer, find_bindir

            bindir = find_bindir()
            if bindir is None:
                raise SystemExit("--postgresql: no PostgreSQL server binaries (apt-get install postgresql)")
            server = PgServer(bindir)
            try:
                await trio.to_thread.run_sync(server.start)
                if args.postgresql:
                    url = await trio.to_thread.run_sync(server.database)
                    cases += await run_store("postgresql", url, n, args.concurrency, rounds)
                for r in args.replicas or []:  # a fresh database each: every lease is new again
                    url = await trio.to_thread.run_sync(server.database)
                    cases += await run_store(f"postgresql-r{r}", url, n, args.concurrency, rounds, replicas=r)
            finally:
                await trio.to_thread.run_sync(server.stop)
        cases += await run_store("memory", ":memory:", n, args.concurrency, rounds)
    return {"benchmark": "market", "volunteers": n, "concurrency": args.concurrency,
            "model_shape": f"{N_LAYER} layers x {N_EXPERT} experts, {SLICE}-expert slices", "cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="20 volunteers, 4 connections, no topology (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--volunteers", type=int, default=None, help="simulated volunteers (default 1000; 200 quick)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent client connections")
    ap.add_argument("--no-topology", action="store_true", help="skip the recruitment timings in the demo topology")
    ap.add_argument("--postgresql", action="store_true",
                    help="also run the market on a throwaway local PostgreSQL server (--db postgresql://...)")
    ap.add_argument("--replicas", type=int, nargs="+", default=None, metavar="R",
                    help="also R market replicas (--replica) on one throwaway PostgreSQL database, the client "
                         "connections spread over them, for each R given (e.g. --replicas 1 2 4)")
    ap.add_argument("--db", choices=["postgresql"], default=None,
                    help="the database of the --replicas cases (PostgreSQL: the only one replicas share)")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.no_topology = 4, True
    result = trio.run(main_async, args)
    timings: list[dict[str, Any]] = []
    if not args.no_topology:
        from _recruitment import measure_recruitment

        timings = measure_recruitment(rounds=1 if args.quick else 3)
        result["cases"] += timings
    print(f"\nmarket benchmark: {result['volunteers']} volunteers, {result['concurrency']} connections, "
          f"{result['model_shape']}")
    result["load_average"] = list(os.getloadavg())  # the machine is shared: what else ran beside it
    print(f"{'case':<40} {'requests':>8} {'req/s':>9} {'median ms':>10} {'p99 ms':>8}")
    for c in result["cases"]:
        if "requests" in c:
            print(f"{c['case']:<40} {c['requests']:>8} {c['requests_per_s']:>9.1f} {c['median_ms']:>10.2f} "
                  f"{c['p99_ms']:>8.2f}")
    print(f"load average after the run: {' '.join(f'{x:.2f}' for x in result['load_average'])}")
    if timings:
        print("\ndemo topology (market + coordinator + 3 volunteers, real processes):")
        print(f"{'case':<32} {'rounds':>8} {'median ms':>10} {'max ms':>8}")
        for c in timings:
            print(f"{c['case']:<32} {c['rounds']:>8} {c['median_ms']:>10.1f} {c['max_ms']:>8.1f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
