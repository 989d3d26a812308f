"""Loopback round trip of one expert call: ExpertClient over py-libp2p vs the same protocol over raw TCP.

    python benchmarks/_rpc_probe.py [--calls N] [--profile]

Prints the median (and p90) round-trip ms of an echo call with rows [batch, 1024] float32, for
batch 1 and 8, over: py-libp2p (Noise + Yamux + TCP), our framing over a plain trio TCP stream,
and a bare TCP echo of the same bytes (no framing, no torch) as the floor. ``--profile`` runs
cProfile over the libp2p case and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.errors import (
    BrokenError,  # noqa: E402
    DialError,
)
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.p2p.transport import Stream, StreamHandler, Transport
from swarm.protocol.expert import PROTOCOL_ID, ExpertRequest, Pairs, RequestId, make_hello, make_pairs  # noqa: E402
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import expert_stream_handler

D_MODEL = 1024


KERNEL_ID = "echo"  # the echo handler computes nothing
HELLO = make_hello(kernel_id=KERNEL_ID)


async def echo_rows(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    return rows


class _TcpStream(Stream):
    def __init__(self, sock: trio.SocketStream, remote: str) -> None:
        self._sock = sock
        self._remote = remote

    @property
    def remote_peer_id(self) -> str:
        return self._remote

    async def read(self, max_bytes: int) -> bytes:
        try:
            return await self._sock.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            raise BrokenError(str(exc)) from exc

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._sock.send_all(data)
        except trio.BrokenResourceError as exc:
            raise BrokenError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._sock.aclose()


class _TcpTransport(Transport):
    """Plain TCP, one protocol per port: the baseline without Noise, Yamux or multistream."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._port = 0

    @property
    def peer_id(self) -> str:
        return f"tcp-{self._port}"

    @property
    def listen_addrs(self) -> list[str]:
        return [f"127.0.0.1:{self._port}"]

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def on_conn(sock: trio.SocketStream) -> None:
            sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
            await handler(_TcpStream(sock, "client"))

        async def serve(*, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
            await trio.serve_tcp(on_conn, 0, host="127.0.0.1", task_status=task_status)

        self._serve = serve

    async def start(self) -> None:
        listeners = await self._nursery.start(self._serve)
        self._port = listeners[0].socket.getsockname()[1]

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> Stream:
        host, port = addrs[0].rsplit(":", 1)
        try:
            sock = await trio.open_tcp_stream(host, int(port))
        except OSError as exc:
            raise DialError(str(exc)) from exc
        return _TcpStream(sock, peer_id)


def request(rid: int, batch: int) -> ExpertRequest:
    return ExpertRequest(
        request_id=RequestId(rid),
        attempt=0,
        model_id="probe",
        layer=0,
        lo=0,
        hi=8,
        n_rows=batch,
        d_model=D_MODEL,
        n_pairs=2 * batch,
        dtype="float32",
    )


def pairs_of(batch: int) -> Pairs:
    """Two experts per row (0 and 1), weight 0.5 each."""
    return make_pairs(np.repeat(np.arange(batch), 2), np.tile([0, 1], batch), np.full(2 * batch, 0.5))


async def time_calls(client_call: Callable[[int], Awaitable[None]], calls: int) -> list[float]:
    for rid in range(20):  # warm up
        await client_call(rid)
    out = []
    for rid in range(calls):
        t0 = time.perf_counter()
        await client_call(1000 + rid)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def expert_rtts(server: Transport, me: Transport, batch: int, calls: int) -> list[float]:
    rows = torch.randn(batch, D_MODEL)
    pairs = pairs_of(batch)
    async with open_expert_client(me, server.peer_id, server.listen_addrs, kernel_id=KERNEL_ID) as client:

        async def one(rid: int) -> None:
            out = await client.call(request(rid, batch), rows, pairs, timeout=10)
            assert out.shape == rows.shape

        return await time_calls(one, calls)


async def bare_tcp_rtts(batch: int, calls: int) -> list[float]:
    size = batch * D_MODEL * 4

    async def echo(sock: trio.SocketStream) -> None:
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
        while data := await sock.receive_some(1 << 20):
            await sock.send_all(data)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, echo, 0)
        port = listeners[0].socket.getsockname()[1]
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        payload = bytes(size)

        async def one(_: int) -> None:
            await sock.send_all(payload)
            got = 0
            while got < size:
                got += len(await sock.receive_some(1 << 20))

        rtts = await time_calls(one, calls)
        await sock.aclose()
        nursery.cancel_scope.cancel()
    return rtts


def local_compute_ms(batch: int, calls: int) -> list[float]:
    """The local alternative: one expert-sized FFN ([batch,1024] x [1024,768] x2 + down) on this CPU.

    One torch thread: on a busy 2-core machine a second intra-op thread waits ~24 ms for a core.
    """
    torch.set_num_threads(1)
    x = torch.randn(batch, D_MODEL)
    gate, up, down = torch.randn(768, D_MODEL), torch.randn(768, D_MODEL), torch.randn(D_MODEL, 768)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
        _ = h @ down.T
        out.append((time.perf_counter() - t0) * 1000)
    return out


def summary(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    return f"{name:<34} median {statistics.median(ms):7.3f} ms   p90 {p90:7.3f} ms"


async def main(calls: int, profile: bool) -> None:
    print(f"expert echo call, rows [batch, {D_MODEL}] float32, {calls} sequential calls, loopback\n")
    async with open_libp2p_transport(key_path=None) as server, open_libp2p_transport(key_path=None) as me:
        server.set_stream_handler(PROTOCOL_ID, expert_stream_handler(echo_rows, hello=HELLO))
        async with trio.open_nursery() as nursery:
            tcp_server, tcp_client = _TcpTransport(nursery), _TcpTransport(nursery)
            tcp_server.set_stream_handler(PROTOCOL_ID, expert_stream_handler(echo_rows, hello=HELLO))
            await tcp_server.start()
            results = {}
            for batch in (1, 8):
                libp2p_ms = await expert_rtts(server, me, batch, calls)
                tcp_ms = await expert_rtts(tcp_server, tcp_client, batch, calls)
                bare_ms = await bare_tcp_rtts(batch, calls)
                local_ms = local_compute_ms(batch, calls)
                results[batch] = (libp2p_ms, tcp_ms, bare_ms)
                print(f"batch {batch} ({batch * D_MODEL * 4} payload bytes each way)")
                print("  " + summary("ExpertClient over py-libp2p", libp2p_ms))
                print("  " + summary("ExpertClient over raw TCP", tcp_ms))
                print("  " + summary("bare TCP echo (floor)", bare_ms))
                print("  " + summary("local expert FFN (d_ff 768, 1 thr)", local_ms))
                extra = statistics.median(libp2p_ms) - statistics.median(tcp_ms)
                print(f"  -> Noise + Yamux + py-libp2p add {extra:.3f} ms per call over raw TCP\n")
            nursery.cancel_scope.cancel()
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await expert_rtts(server, me, 8, calls)
            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
            stats.print_stats(25)
            print(f"cProfile of {calls} libp2p calls at batch 8 (top 25 by own time):")
            print(text.getvalue())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    trio.run(main, args.calls, args.profile)
