"""Remote expert round trip vs local compute, over real py-libp2p on loopback (DESIGN §11 format).

    python benchmarks/expert_rtt.py [--quick] [--json OUT] [--calls N]

One SwiGLU expert, d_model 1024, width 2816, float32 (the size of the public hivemind comparison).
A server process hosts it on ``/moe-swarm/expert/1`` (the volunteer's ``ExpertServer``) and runs a
raw TCP echo server. The client process measures, at batch 1, 8 and 64 tokens:

- ``local``: ``slice_partial_sum`` in this process (the coordinator's local path);
- ``remote``: an ``ExpertClient`` call (request + rows out, partial sums back, compute included);
- ``tcp_floor``: echo of the same request/response byte counts over a plain TCP socket;
- ``remote_concurrent8``: 8 concurrent callers at batch 8 over one pipelined stream (tokens/s).

Overhead = remote − local (medians). Target on loopback: <= 2 ms at batch 1 and 8.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.expert_rpc import expert_stream_handler, make_hello, open_expert_client  # noqa: E402
from swarm.experts import slice_partial_sum  # noqa: E402
from swarm.transport import open_libp2p_transport  # noqa: E402
from swarm.wire import PROTOCOL_ID, ExpertRequest, RequestId  # noqa: E402

D_MODEL, WIDTH = 1024, 2816
MODEL_ID = "bench-expert"


class OneExpert:
    """A single random float32 SwiGLU expert (``ExpertWeights``)."""

    n_expert = 1
    d_model = D_MODEL

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w_gate = torch.randn(WIDTH, D_MODEL, generator=g) / D_MODEL**0.5
        self.w_up = torch.randn(WIDTH, D_MODEL, generator=g) / D_MODEL**0.5
        self.w_down = torch.randn(D_MODEL, WIDTH, generator=g) / WIDTH**0.5

    def gate(self, e: int) -> torch.Tensor:
        return self.w_gate

    def up(self, e: int) -> torch.Tensor:
        return self.w_up

    def down(self, e: int) -> torch.Tensor:
        return self.w_down


def compute(w: OneExpert, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    return slice_partial_sum(x, torch.arange(n), torch.zeros(n, dtype=torch.long), torch.ones(n), w)


# -- server process -------------------------------------------------------------------------------
async def serve(threads: int) -> None:
    w = OneExpert()
    limiter = trio.CapacityLimiter(threads)

    async def handler(req: ExpertRequest, rows: torch.Tensor) -> torch.Tensor:
        return await trio.to_thread.run_sync(compute, w, rows, limiter=limiter)

    async def echo(stream: trio.SocketStream) -> None:
        # framing-free floor: read a u32 length + body, answer the same number of bytes
        buf = bytearray()
        while True:
            while len(buf) < 4:
                data = await stream.receive_some(1 << 20)
                if not data:
                    return
                buf += data
            n = int.from_bytes(buf[:4], "little")
            while len(buf) < 4 + n:
                data = await stream.receive_some(1 << 20)
                if not data:
                    return
                buf += data
            await stream.send_all(buf[: 4 + n])
            del buf[: 4 + n]

    async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
        t.set_stream_handler(PROTOCOL_ID, expert_stream_handler(handler, hello=make_hello()))
        listeners = await n.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        print(json.dumps({"peer_id": t.peer_id, "addrs": t.listen_addrs, "tcp_port": port}), flush=True)
        await trio.sleep_forever()


# -- client ---------------------------------------------------------------------------------------
def stats(samples: list[float], batch: int) -> dict[str, float]:
    s = sorted(samples)
    med = statistics.median(s)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"median_ms": round(med * 1000, 3), "p99_ms": round(p99 * 1000, 3), "tokens_per_s": round(batch / med, 1)}


async def measure(info: dict[str, Any], calls: int, batches: list[int]) -> list[dict[str, Any]]:
    w = OneExpert()
    cases: list[dict[str, Any]] = []
    ids = iter(range(1, 10**9))

    def request(batch: int) -> ExpertRequest:
        return ExpertRequest(request_id=RequestId(next(ids)), attempt=0, model_id=MODEL_ID, layer=0, lo=0, hi=1,
                             n_rows=batch, dtype="float32", d_model=D_MODEL, experts=[[0]] * batch, weights=[[1.0]] * batch)

    for batch in batches:
        x = torch.randn(batch, D_MODEL)
        for _ in range(5):
            compute(w, x)
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            compute(w, x)
            samples.append(time.perf_counter() - t0)
        cases.append({"case": "local", "batch": batch, **stats(samples, batch)})

    async with open_libp2p_transport(key_path=None) as t, open_expert_client(t, info["peer_id"], info["addrs"]) as client:
        for batch in batches:
            x = torch.randn(batch, D_MODEL)
            for _ in range(5):
                await client.call(request(batch), x, timeout=30)
            samples = []
            for _ in range(calls):
                t0 = time.perf_counter()
                out = await client.call(request(batch), x, timeout=30)
                samples.append(time.perf_counter() - t0)
            assert torch.equal(out, compute(w, x)), "remote result differs from local"
            cases.append({"case": "remote", "batch": batch, **stats(samples, batch)})

        # 8 concurrent callers, batch 8 each, over the one pipelined stream
        x8 = torch.randn(8, D_MODEL)
        per_caller = max(5, calls // 4)
        lat: list[float] = []

        async def caller() -> None:
            for _ in range(per_caller):
                t0 = time.perf_counter()
                await client.call(request(8), x8, timeout=30)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(caller)
        wall = time.perf_counter() - t0
        st = stats(lat, 8)
        st["tokens_per_s"] = round(8 * 8 * per_caller / wall, 1)
        cases.append({"case": "remote_concurrent8", "batch": 8, **st})

    stream = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
    async with stream:
        for batch in batches:
            body = bytes(batch * D_MODEL * 4 + 200)  # rows + a header's worth
            frame = len(body).to_bytes(4, "little") + body
            samples = []
            for i in range(calls + 5):
                t0 = time.perf_counter()
                await stream.send_all(frame)
                got = 0
                while got < len(frame):
                    got += len(await stream.receive_some(1 << 20))
                if i >= 5:
                    samples.append(time.perf_counter() - t0)
            cases.append({"case": "tcp_floor", "batch": batch, **stats(samples, batch)})
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help="server compute threads")
    args = ap.parse_args()
    if args.serve:
        trio.run(serve, args.threads)
        return
    calls = args.calls or (20 if args.quick else 200)
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--threads", str(args.threads)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        info = json.loads(server.stdout.readline())
        cases = trio.run(measure, info, calls, [1, 8, 64])
    finally:
        server.terminate()
        server.wait(timeout=10)
    result = {"benchmark": "expert_rtt", "d_model": D_MODEL, "width": WIDTH, "calls": calls, "cases": cases}
    print(f"\nexpert_rtt: one SwiGLU expert d_model {D_MODEL} width {WIDTH} float32, {calls} calls per case")
    print(f"{'case':<20} {'batch':>5} {'median ms':>10} {'p99 ms':>8} {'tokens/s':>10}")
    for c in cases:
        print(f"{c['case']:<20} {c['batch']:>5} {c['median_ms']:>10.3f} {c['p99_ms']:>8.3f} {c['tokens_per_s']:>10.1f}")
    local = {c["batch"]: c["median_ms"] for c in cases if c["case"] == "local"}
    print("overhead (remote - local median):",
          ", ".join(f"batch {c['batch']}: {c['median_ms'] - local[c['batch']]:.3f} ms" for c in cases if c["case"] == "remote"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
