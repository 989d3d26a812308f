"""``swarm.p2p.patches.yamux``: fewer frames per call, a larger window, prompt window waits, stock interop.

Real host pairs on loopback (``open_libp2p_transport``, tuned), a stock-muxer host built by the same
function with the tuning switched off, and an in-memory muxer pair under ``MockClock`` for timing.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, TYPE_WINDOW_UPDATE, Yamux

import swarm.p2p.patches.yamux
from swarm.p2p.libp2p import Libp2pTransport, open_libp2p_transport
from swarm.p2p.patches.yamux import TunedYamux, YamuxTuning
from swarm.p2p.transport import Stream
from swarm.protocol.expert import (
    PROTOCOL_ID,
    ExpertRequest,
    ExpertResponse,
    Pairs,
    RequestId,
    encode_frame,
    encode_request_payload,
    make_pairs,
)
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import expert_stream_handler
from swarm.rpc.tensors import tensor_to_payload

ECHO = "/test/echo/1"
D_MODEL = 1024
_HEADER = struct.Struct("!BBHII")


# -- helpers --------------------------------------------------------------------------------------
@asynccontextmanager
async def transport(monkeypatch: pytest.MonkeyPatch, *, tuned: bool) -> AsyncIterator[Libp2pTransport]:
    """Our libp2p transport; ``tuned=False`` builds the same host with the library's own Yamux."""
    with monkeypatch.context() as patch:
        if not tuned:
            patch.setattr(swarm.p2p.patches.yamux, "apply_yamux_tuning", lambda upgrader, tuning=None: None)
        cm = open_libp2p_transport(key_path=None)
        t = await cm.__aenter__()
    try:
        yield t
    finally:
        await cm.__aexit__(None, None, None)


def muxer(t: Libp2pTransport, peer_id: str) -> Any:
    (conn,) = [c for c in t.host.get_network().get_connections(ID.from_base58(peer_id)) if not c.is_closed]
    return conn.muxed_conn


class FrameLog:
    """Counts the DATA and window-update frames a connection writes (wraps its frame writer).

    Not counted: window updates carrying a flag (SYN, ACK, FIN, RST: stream open and close) and
    pings (the library measures the RTT 0.5 s after connecting, then every 30 s).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, muxed: Any) -> None:
        self.counts: Counter[int] = Counter()
        name = "_write_frames" if isinstance(muxed, TunedYamux) else "_write_frame"
        write: Callable[[Any], Awaitable[None]] = getattr(muxed, name)

        async def logged(data: Any) -> None:
            for frame in data if isinstance(data, list) else [data]:
                self._parse(frame)
            await write(data)

        monkeypatch.setattr(muxed, name, logged)

    def _parse(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            _, typ, flags, _, length = _HEADER.unpack_from(data, pos)
            if typ == TYPE_DATA or (typ == TYPE_WINDOW_UPDATE and not flags):
                self.counts[typ] += 1
            pos += _HEADER.size + (length if typ == TYPE_DATA else 0)
        assert pos == len(data), "a write ended inside a frame"

    def take(self) -> Counter[int]:
        counts, self.counts = self.counts, Counter()
        return counts


async def echo_rows(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    return rows


def request(rid: int, n_rows: int) -> ExpertRequest:
    return ExpertRequest(
        request_id=RequestId(rid), attempt=0, model_id="m", layer=0, lo=0, hi=1, n_rows=n_rows,
        d_model=D_MODEL, n_pairs=n_rows, dtype="float32",
    )


def one_pair_per_row(n_rows: int) -> Pairs:
    return make_pairs(np.arange(n_rows), np.zeros(n_rows), np.ones(n_rows))


async def echo_stream(stream: Stream) -> None:
    while data := await stream.read(1 << 20):
        await stream.write(data)


async def echo_roundtrip(stream: Stream, payload: bytes) -> bytes:
    """Send ``payload`` while reading the echo (a stock peer's 256 KiB window needs both at once)."""
    got = bytearray()

    async def send() -> None:
        for i in range(0, len(payload), 1 << 20):
            await stream.write(payload[i : i + (1 << 20)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        while len(got) < len(payload):
            data = await stream.read(1 << 20)
            assert data, f"EOF after {len(got)} of {len(payload)} bytes"
            got += data
    return bytes(got)


# -- frames per call --------------------------------------------------------------------------------
@pytest.mark.parametrize("n_rows", [1, 8, 64])
async def test_a_call_is_one_data_frame_each_way_and_no_window_update(
    monkeypatch: pytest.MonkeyPatch, n_rows: int
) -> None:
    calls = 25  # 25 x 256 KiB stays below half the 16 MiB window: no window update at all
    async with transport(monkeypatch, tuned=True) as server, transport(monkeypatch, tuned=True) as me:
        server.set_stream_handler(PROTOCOL_ID, expert_stream_handler(echo_rows))
        async with open_expert_client(me, server.peer_id, server.listen_addrs) as client:
            rows = torch.randn(n_rows, D_MODEL)
            await client.call(request(0, n_rows), rows, one_pair_per_row(n_rows), timeout=10)  # opens the connection and stream
            ours, theirs = muxer(me, server.peer_id), muxer(server, me.peer_id)
            assert isinstance(ours, TunedYamux) and isinstance(theirs, TunedYamux)
            assert ours.noise_tuned and theirs.noise_tuned
            sent, answered = FrameLog(monkeypatch, ours), FrameLog(monkeypatch, theirs)
            for rid in range(1, calls + 1):
                assert torch.equal(await client.call(request(rid, n_rows), rows, one_pair_per_row(n_rows), timeout=10), rows)
            sent_counts, answered_counts = sent.take(), answered.take()
    # each message is cut into DATA frames of one Noise message each (65507 bytes of body at most)
    payload = tensor_to_payload(rows, "float32")
    answer = ExpertResponse(request_id=RequestId(1), attempt=0, status="ok", n_rows=n_rows, d_model=D_MODEL)
    req = request(1, n_rows)
    request_frames = -(-len(encode_frame(req, encode_request_payload(req, payload, one_pair_per_row(n_rows)))) // 65507)
    answer_frames = -(-len(encode_frame(answer, payload)) // 65507)
    assert request_frames == answer_frames == (5 if n_rows == 64 else 1)
    assert dict(sent_counts) == {TYPE_DATA: calls * request_frames}
    assert dict(answered_counts) == {TYPE_DATA: calls * answer_frames}


async def test_canary_the_stock_muxer_sends_a_window_update_per_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """When this fails, py-libp2p's Yamux changed its window updates: re-measure ``swarm.p2p.patches.yamux``."""
    calls = 20
    async with transport(monkeypatch, tuned=False) as server, transport(monkeypatch, tuned=False) as me:
        server.set_stream_handler(PROTOCOL_ID, expert_stream_handler(echo_rows))
        async with open_expert_client(me, server.peer_id, server.listen_addrs) as client:
            rows = torch.randn(1, D_MODEL)
            await client.call(request(0, 1), rows, one_pair_per_row(1), timeout=10)
            ours = muxer(me, server.peer_id)
            assert type(ours) is Yamux
            log = FrameLog(monkeypatch, ours)
            for rid in range(1, calls + 1):
                await client.call(request(rid, 1), rows, one_pair_per_row(1), timeout=10)
            counts = log.take()
    assert counts[TYPE_DATA] == calls
    assert counts[TYPE_WINDOW_UPDATE] >= calls


# -- interoperability and the large window ------------------------------------------------------
@pytest.mark.parametrize(("client_tuned", "server_tuned"), [(True, False), (False, True), (True, True)])
async def test_expert_calls_between_tuned_and_stock_peers(
    monkeypatch: pytest.MonkeyPatch, client_tuned: bool, server_tuned: bool
) -> None:
    async with (
        transport(monkeypatch, tuned=server_tuned) as server,
        transport(monkeypatch, tuned=client_tuned) as me,
    ):
        server.set_stream_handler(PROTOCOL_ID, expert_stream_handler(echo_rows))
        async with open_expert_client(me, server.peer_id, server.listen_addrs) as client:
            with trio.fail_after(60):
                for rid, n_rows in enumerate([1, 8, 64, 2200, 1, 64]):  # 2200 rows: 8.6 MiB each way
                    rows = torch.randn(n_rows, D_MODEL)
                    assert torch.equal(await client.call(request(rid, n_rows), rows, one_pair_per_row(n_rows), timeout=30), rows)
                assert client.sessions_opened == 1
            assert isinstance(muxer(me, server.peer_id), TunedYamux) == client_tuned
            assert isinstance(muxer(server, me.peer_id), TunedYamux) == server_tuned


@pytest.mark.parametrize("peer_tuned", [True, False])
async def test_12_mib_arrive_intact_with_few_window_updates(
    monkeypatch: pytest.MonkeyPatch, peer_tuned: bool
) -> None:
    payload = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    data = payload.numpy().tobytes()
    async with transport(monkeypatch, tuned=peer_tuned) as peer, transport(monkeypatch, tuned=True) as me:
        peer.set_stream_handler(ECHO, echo_stream)
        first = await me.open_stream(peer.peer_id, peer.listen_addrs, ECHO)  # connects
        await first.aclose()
        ours, theirs = FrameLog(monkeypatch, muxer(me, peer.peer_id)), FrameLog(monkeypatch, muxer(peer, me.peer_id))
        stream = await me.open_stream(peer.peer_id, peer.listen_addrs, ECHO)
        with trio.fail_after(60):
            assert await echo_roundtrip(stream, data) == data
        our_updates, their_updates = ours.take()[TYPE_WINDOW_UPDATE], theirs.take()[TYPE_WINDOW_UPDATE]
        await stream.aclose()
    # each side received 12 MiB: a tuned side sends one update, once 8 MiB (half its window) were
    # consumed -- the 16 MiB window was granted on SYN/ACK; the stock muxer sends one per read
    # (21 here: the echo reads up to 1 MiB at a time)
    assert our_updates == 1
    if peer_tuned:
        assert their_updates == 1
    else:
        assert their_updates > 5


# -- send-window waits, in virtual time -----------------------------------------------------------
class _MemorySecureConn:
    """The ``ISecureConn`` surface a muxer uses, over an in-memory stream (no Noise)."""

    def __init__(self, stream: trio.abc.Stream, *, is_initiator: bool) -> None:
        self.stream = stream
        self.is_initiator = is_initiator

    async def read(self, n: int | None = None) -> bytes:
        return await self.stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()

    def get_remote_address(self) -> None:
        return None


@pytest.mark.parametrize("muxers", ["tuned", "stock", "tuned-to-stock"])
async def test_a_writer_out_of_window_resumes_when_the_update_arrives(
    autojump_clock: trio.testing.MockClock, muxers: str
) -> None:
    """1 MiB through 256 KiB windows: the tuned writer waits for no timer; the stock one polls every 10 ms."""
    small = YamuxTuning(window_bytes=256 * 1024)
    a_end, b_end = trio.testing.memory_stream_pair()
    peer = ID.from_pubkey(create_new_key_pair().public_key)

    def make(end: trio.abc.Stream, initiator: bool, tuned: bool) -> Yamux:
        conn: Any = _MemorySecureConn(end, is_initiator=initiator)
        return TunedYamux(conn, peer, tuning=small) if tuned else Yamux(conn, peer)

    a = make(a_end, True, muxers != "stock")
    b = make(b_end, False, muxers == "tuned")
    data = bytes(range(256)) * 4096
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.start)
        nursery.start_soon(b.start)
        await trio.lowlevel.checkpoint()
        sender = await a.open_stream()
        receiver = await b.accept_stream()
        got = bytearray()
        async with trio.open_nursery() as inner:
            inner.start_soon(sender.write, data)
            await trio.testing.wait_all_tasks_blocked()  # the writer has used up its window
            t0 = trio.current_time()
            while len(got) < len(data):
                got += await receiver.read(1 << 16)
        elapsed = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert bytes(got) == data
    if muxers == "stock":
        assert elapsed >= 0.01  # canary: the library's writer sleeps 10 ms per empty window
    else:
        assert elapsed == 0.0
