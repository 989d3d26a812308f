"""Remote expert round trip vs local compute, over real py-libp2p on loopback (DESIGN §11 format).

    python benchmarks/expert_rtt.py [--quick | --smoke] [--json OUT] [--calls N] [--via-relay]

``--smoke`` (``make test``): 5 calls per case at batch 1 and 8, direct and through the relay.

One SwiGLU expert, d_model 1024, width 2816, float32 (the size of the public hivemind comparison).
A server process hosts it on ``/moe-swarm/expert/2`` (the expert stream server of ``swarm.rpc``, the
one the volunteer's ``ExpertServer`` plugs into) and runs a raw TCP echo server. The client process measures, at batch 1, 8 and 64 tokens:

- ``local``: ``slice_partial_sum`` in this process (the coordinator's local path);
- ``remote``: an ``ExpertClient`` call (request + rows out, per-pair outputs back, compute included);
- ``tcp_floor``: echo of the same request/response byte counts over a plain TCP socket;
- ``remote_concurrent8``: 8 concurrent callers at batch 8 over one pipelined stream (tokens/s);
- ``remote_null``: the same calls answered without computing (zeros, at once): the protocol's own
  cost (framing, Noise, Yamux, both event loops, the worker-thread hop);
- ``remote_sleep``: answered after the server's worker thread sleeps for the local median instead
  of computing: what two otherwise idle processes pay to wake up after a wait of that length
  (remote_sleep - local = the overhead a real call shows, with no compute in it).

- ``lane``, ``lane_null``, ``lane_sleep``: the same three on a data lane (``swarm.rpc.lane``: the
  server dials it when offered one over its expert stream, as a volunteer does; sealed records on a
  plain TCP connection), called from a blocking thread as the coordinator's engine calls it.

``--via-relay`` starts ``moe-swarm relay`` as a third process; the server also reserves a slot on
it, and the same remote cases run again through the circuit (client -> relay -> server, Noise +
Yamux end to end inside the relay's Yamux streams), named ``remote_relayed`` and
``remote_relayed_concurrent8``; the table then gives the relayed/direct ratio per case.

Overhead = remote − local (medians). Target on loopback (issue 10, expert stream v2): <= 1.2 ms at
batch 1 and <= 1.6 ms at batch 8. The table also splits it: protocol = remote_null; wait = remote_sleep
- local - remote_null (the idle wake-ups a call of that length costs on this machine).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402

from swarm.model.experts import slice_partial_sum  # noqa: E402
from swarm.p2p.libp2p import Libp2pTransport, open_libp2p_transport
from swarm.p2p.nat import NatConfig, open_listener_host, open_nat  # noqa: E402
from swarm.protocol.expert import (  # noqa: E402
    DEFAULT_LIMITS,
    FEATURE_LANE,
    PROTOCOL_ID,
    ExpertRequest,
    ExpertResponse,
    Hello,
    LaneOffer,
    Pairs,
    RequestId,
    make_hello,
    make_pairs,
)
from swarm.rpc.client import answer_array, encode_call, open_expert_client  # noqa: E402
from swarm.rpc.lane import HANDSHAKE_BYTES, Opener, Sealer, derive_keys, parse_frame, parse_handshake  # noqa: E402
from swarm.rpc.server import expert_stream_handler  # noqa: E402
from volunteer.lanes import VolunteerLanes  # noqa: E402

D_MODEL, WIDTH = 1024, 2816
MODEL_ID = "bench-expert"
WARMUP_S = 1.0  # remote calls before each measured case, at least (see remote_cases)
NULL_MODEL_ID = "bench-null"  # answered with zeros at once (the protocol's own cost)
SLEEP_MODEL_ID = "bench-sleep-"  # + microseconds: answered with zeros after the worker thread sleeps that long
KERNEL_ID = f"torch-{torch.__version__.split('+')[0]}-dequant-f32-v1"  # slice_partial_sum: the torch reference


class OneExpert:
    """A single random float32 SwiGLU expert (``ExpertWeights``)."""

    n_expert = 1
    d_model = D_MODEL
    activation = "silu"

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

    def bias(self, kind: int, e: int) -> torch.Tensor | None:
        return None  # unbiased (only gpt-oss's experts have biases)


def compute(w: OneExpert, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    return slice_partial_sum(x, torch.arange(n), torch.zeros(n, dtype=torch.long), torch.ones(n), w)


# -- server process -------------------------------------------------------------------------------
async def serve(threads: int, relay: str | None) -> None:
    w = OneExpert()
    limiter = trio.CapacityLimiter(threads)

    def idle(rows: torch.Tensor, us: int) -> torch.Tensor:
        time.sleep(us / 1e6)
        return torch.zeros(rows.shape[0], D_MODEL)

    async def handler(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        if req.model_id == NULL_MODEL_ID:
            return torch.zeros(rows.shape[0], D_MODEL)
        if req.model_id.startswith(SLEEP_MODEL_ID):
            return await trio.to_thread.run_sync(idle, rows, int(req.model_id[len(SLEEP_MODEL_ID):]), limiter=limiter)
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

    class LaneServer:
        """The same three answers computed on a data lane's thread (``volunteer.lanes``)."""

        def hello(self) -> Hello:
            return make_hello(kernel_id=KERNEL_ID)

        def compute_sync(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
            if req.model_id == NULL_MODEL_ID:
                return torch.zeros(rows.shape[0], D_MODEL)
            if req.model_id.startswith(SLEEP_MODEL_ID):
                return idle(rows, int(req.model_id[len(SLEEP_MODEL_ID):]))
            return compute(w, rows)

    lanes = VolunteerLanes(LaneServer(), authorize=lambda peer: True, known_hosts=lambda: {"127.0.0.1"})

    logging.getLogger("swarm.p2p.nat").setLevel(logging.ERROR)  # the relay may stop first at the end
    # with a relay: reserve on it even though we are reachable (check_reachability off), so the
    # same server can be measured directly and through the relay
    nat = NatConfig(relays=(relay,) if relay else (), hole_punch=False, check_reachability=False)
    async with open_listener_host(key_path=None, listen_addrs=["/ip4/127.0.0.1/tcp/0"], cfg=nat) as (t, n_), \
            trio.open_nursery() as n:
        await n.start(lanes.serve)
        t.set_stream_handler(PROTOCOL_ID, expert_stream_handler(handler, hello=make_hello(kernel_id=KERNEL_ID),
                                                                lanes=lanes.offer))
        listeners = await n.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        circuit = [a for a in n_.advertised if "/p2p-circuit" in a]
        print(json.dumps({"peer_id": t.peer_id, "addrs": t.listen_addrs, "circuit": circuit, "tcp_port": port}), flush=True)
        await trio.sleep_forever()


# -- client ---------------------------------------------------------------------------------------
async def remote_cases(
    t: Libp2pTransport, peer_id: str, addrs: list[str], name: str, w: OneExpert, calls: int, batches: list[int],
    request: Any, *, local_s: dict[int, float] | None = None,
) -> list[dict[str, Any]]:
    """``name`` at each batch, then ``name_concurrent8``: 8 callers at batch 8 over one stream.
    ``local_s`` (the local medians by batch, seconds): also ``remote_null`` and ``remote_sleep``."""
    cases: list[dict[str, Any]] = []
    async with open_expert_client(t, peer_id, addrs, kernel_id=KERNEL_ID) as client:
        for batch in batches:
            x = torch.randn(batch, D_MODEL)
            variants = [(name, MODEL_ID)]
            if local_s is not None:
                variants += [("remote_null", NULL_MODEL_ID), ("remote_sleep", f"{SLEEP_MODEL_ID}{round(local_s[batch] * 1e6)}")]
            for case, model_id in variants:
                # warm-up: a new stream's first calls run ~2x slower (measured: a median of 2.4 ms over
                # the first 200 back-to-back calls, 1.1 ms after 2,000), so warm for a second, not 5 calls
                t_warm, warm = time.perf_counter(), 0
                while warm < 5 or time.perf_counter() - t_warm < WARMUP_S:
                    await client.call(*call(request(batch, model_id), x), timeout=30)
                    warm += 1
                samples = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    out = await client.call(*call(request(batch, model_id), x), timeout=30)
                    samples.append(time.perf_counter() - t0)
                want = compute(w, x) if model_id == MODEL_ID else torch.zeros(batch, D_MODEL)
                assert torch.equal(out, want), f"{case}: remote result differs from the expected one"
                cases.append({"case": case, "batch": batch, **stats(samples, batch)})

        x8 = torch.randn(8, D_MODEL)
        per_caller = max(5, calls // 4)
        lat: list[float] = []

        async def caller() -> None:
            for _ in range(per_caller):
                t0 = time.perf_counter()
                await client.call(*call(request(8), x8), timeout=30)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(caller)
        wall = time.perf_counter() - t0
        st = stats(lat, 8)
        st["tokens_per_s"] = round(8 * 8 * per_caller / wall, 1)
        cases.append({"case": f"{name}_concurrent8", "batch": 8, **st})
    return cases



async def lane_cases(t: Libp2pTransport, info: dict[str, Any], w: OneExpert, calls: int, batches: list[int],
                     request: Any, local_s: dict[int, float]) -> list[dict[str, Any]]:
    """``lane``, ``lane_null``, ``lane_sleep``: the same calls on a data lane (``swarm.rpc.lane``) the
    server dials when offered one over its expert stream, made from a blocking thread as the
    coordinator's engine makes them (encode, seal, write; wait, read, open, check)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    lane_id, secret = secrets.token_bytes(16), secrets.token_bytes(32)
    async with open_expert_client(t, info["peer_id"], info["addrs"], kernel_id=KERNEL_ID) as client:
        await client.call(*call(request(1, NULL_MODEL_ID), torch.zeros(1, D_MODEL)), timeout=30)  # the stream's Hello
        hello = client.peer_hello
        assert hello is not None and FEATURE_LANE in hello.features
        ans = await client.offer_lane(LaneOffer(request_id=RequestId(1 << 40), attempt=0, lane_id=lane_id, secret=secret,
                                                host="127.0.0.1", port=listener.getsockname()[1]), timeout=10)
        assert ans.status == "ok", ans
    sock, _ = listener.accept()
    listener.close()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = b""
        while len(got) < HANDSHAKE_BYTES:
            got += sock.recv(HANDSHAKE_BYTES - len(got))
        assert parse_handshake(got) == lane_id
        c2v, v2c = derive_keys(secret, lane_id)
        sealer, opener = Sealer(c2v), Opener(v2c, 1 << 28)

        def one(req: ExpertRequest, pairs: Pairs, x: torch.Tensor) -> np.ndarray:
            req, frame = encode_call(req, x, pairs, ["float32"], hello, DEFAULT_LIMITS)
            sock.sendall(sealer.seal(frame))
            while True:
                for f in opener.frames():
                    msg, payload = parse_frame(f, DEFAULT_LIMITS)
                    assert isinstance(msg, ExpertResponse), msg
                    return answer_array("server", req, msg, bytearray(payload))
                opener.feed(sock.recv(1 << 20))

        def run() -> list[dict[str, Any]]:
            out = []
            for batch in batches:
                x = torch.randn(batch, D_MODEL)
                for case, model_id in (("lane", MODEL_ID), ("lane_null", NULL_MODEL_ID),
                                       ("lane_sleep", f"{SLEEP_MODEL_ID}{round(local_s[batch] * 1e6)}")):
                    t_warm, warm = time.perf_counter(), 0
                    while warm < 5 or time.perf_counter() - t_warm < WARMUP_S:
                        one(*request(batch, model_id), x)
                        warm += 1
                    samples = []
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        y = one(*request(batch, model_id), x)
                        samples.append(time.perf_counter() - t0)
                    want = compute(w, x) if model_id == MODEL_ID else torch.zeros(batch, D_MODEL)
                    assert torch.equal(torch.from_numpy(y), want), f"{case}: the lane's result differs"
                    out.append({"case": case, "batch": batch, **stats(samples, batch)})
            return out

        return await trio.to_thread.run_sync(run)


def call(rp: tuple[ExpertRequest, Pairs], x: torch.Tensor) -> tuple[ExpertRequest, torch.Tensor, Pairs]:
    """The positional arguments of ``ExpertClient.call``."""
    return rp[0], x, rp[1]


def stats(samples: list[float], batch: int) -> dict[str, float]:
    s = sorted(samples)
    med = statistics.median(s)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"median_ms": round(med * 1000, 3), "p99_ms": round(p99 * 1000, 3), "tokens_per_s": round(batch / med, 1)}


async def measure(info: dict[str, Any], calls: int, batches: list[int]) -> list[dict[str, Any]]:
    w = OneExpert()
    cases: list[dict[str, Any]] = []
    ids = iter(range(1, 10**9))

    pairs = {b: make_pairs(np.arange(b), np.zeros(b), np.ones(b)) for b in batches}  # built once, as the dispatcher does

    def request(batch: int, model_id: str = MODEL_ID) -> tuple[ExpertRequest, Pairs]:
        return ExpertRequest(request_id=RequestId(next(ids)), attempt=0, model_id=model_id, layer=0, lo=0, hi=1,
                             n_rows=batch, d_model=D_MODEL, n_pairs=batch, dtype="float32"), pairs[batch]

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

    async with open_libp2p_transport(key_path=None) as t:
        local_s = {c["batch"]: c["median_ms"] / 1000 for c in cases if c["case"] == "local"}
        cases += await remote_cases(t, info["peer_id"], info["addrs"], "remote", w, calls, batches, request, local_s=local_s)
    if info.get("circuit"):
        # a fresh host, so nothing but the circuit connects it to the server
        async with open_libp2p_transport(key_path=None) as t, open_nat(t, NatConfig(hole_punch=False)):
            cases += await remote_cases(t, info["peer_id"], info["circuit"], "remote_relayed", w, calls, batches, request)
            assert t.path_to(info["peer_id"]) == "relayed", "the relayed cases did not go through the relay"

    async with open_libp2p_transport(key_path=None) as t:
        local_s = {c["batch"]: c["median_ms"] / 1000 for c in cases if c["case"] == "local"}
        cases += await lane_cases(t, info, w, calls, batches, request, local_s)

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
    ap.add_argument("--smoke", action="store_true", help="5 calls per case at batch 1 and 8, with the relay (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help="server compute threads")
    ap.add_argument("--via-relay", action="store_true", help="also measure through a moe-swarm relay (third process)")
    ap.add_argument("--relay", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        trio.run(serve, args.threads, args.relay)
        return
    if args.smoke:
        args.via_relay = True  # the relayed path too: it is the one a benchmark change breaks unnoticed
    calls = args.calls or (5 if args.smoke else 20 if args.quick else 200)
    procs: list[subprocess.Popen[str]] = []
    try:
        server_cmd = [sys.executable, __file__, "--serve", "--threads", str(args.threads)]
        if args.via_relay:
            tmp = tempfile.mkdtemp(prefix="expert-rtt-relay-")
            relay = subprocess.Popen([sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", "relay", "--listen",
                                      "/ip4/127.0.0.1/tcp/0", "--port", "0", "--data-dir", tmp],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(relay)
            assert relay.stdout is not None
            line = relay.stdout.readline()
            assert line.startswith("relay ready "), line
            server_cmd += ["--relay", line.split("addrs=")[1].split()[0].split(",")[0]]
        server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, text=True)
        procs.append(server)
        assert server.stdout is not None
        info = json.loads(server.stdout.readline())
        cases = trio.run(measure, info, calls, [1, 8] if args.smoke else [1, 8, 64])
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=10)
    result = {"benchmark": "expert_rtt", "d_model": D_MODEL, "width": WIDTH, "calls": calls, "via_relay": args.via_relay,
              "cases": cases}
    print(f"\nexpert_rtt: one SwiGLU expert d_model {D_MODEL} width {WIDTH} float32, {calls} calls per case")
    direct = {(c["case"], c["batch"]): c for c in cases if c["case"].startswith("remote") and "relayed" not in c["case"]}
    print(f"{'case':<27} {'batch':>5} {'median ms':>10} {'p99 ms':>8} {'tokens/s':>10} {'relayed/direct':>15}")
    for c in cases:
        ratio = ""
        if "relayed" in c["case"]:
            d = direct[(c["case"].replace("_relayed", ""), c["batch"])]
            key = "tokens_per_s" if c["case"].endswith("concurrent8") else "median_ms"
            ratio = f"{c[key] / d[key]:.2f}x {'tok/s' if key == 'tokens_per_s' else 'time'}"
            c["relayed_over_direct"] = round(c[key] / d[key], 3)
        print(f"{c['case']:<27} {c['batch']:>5} {c['median_ms']:>10.3f} {c['p99_ms']:>8.3f} {c['tokens_per_s']:>10.1f} {ratio:>15}")
    local = {c["batch"]: c["median_ms"] for c in cases if c["case"] == "local"}
    print("overhead (remote - local median):",
          ", ".join(f"batch {c['batch']}: {c['median_ms'] - local[c['batch']]:.3f} ms" for c in cases if c["case"] == "remote"))
    null = {c["batch"]: c["median_ms"] for c in cases if c["case"] == "remote_null"}
    sleep = {c["batch"]: c["median_ms"] for c in cases if c["case"] == "remote_sleep"}
    split = {b: {"protocol_ms": round(null[b], 3), "wait_ms": round(sleep[b] - local[b] - null[b], 3)} for b in null}
    result["overhead_split"] = {str(b): v for b, v in split.items()}
    print("of which (medians): protocol = remote_null, wait = remote_sleep - local - remote_null:",
          ", ".join(f"batch {b}: protocol {v['protocol_ms']:.3f} ms, wait {v['wait_ms']:.3f} ms" for b, v in split.items()))
    lane = {c["batch"]: c["median_ms"] for c in cases if c["case"] == "lane"}
    lane_null = {c["batch"]: c["median_ms"] for c in cases if c["case"] == "lane_null"}
    result["lane_overhead"] = {str(b): {"overhead_ms": round(lane[b] - local[b], 3), "protocol_ms": round(lane_null[b], 3)}
                               for b in lane}
    print("on a data lane: overhead (lane - local), protocol (lane_null):",
          ", ".join(f"batch {b}: {v['overhead_ms']:.3f} / {v['protocol_ms']:.3f} ms"
                    for b, v in result["lane_overhead"].items()))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
