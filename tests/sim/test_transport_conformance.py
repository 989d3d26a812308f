"""One conformance suite for every ``Transport``: the in-memory fake and real py-libp2p on loopback."""

from __future__ import annotations

import hashlib
import random
import socket
from contextlib import AbstractAsyncContextManager

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from swarm.errors import BrokenError, ClosedError, DialError, TransportError
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.p2p.memory import FakeNetwork, open_fake_transport
from swarm.p2p.transport import Stream, Transport

ECHO = "/test/echo/1"


class Peers:
    """Opens peers of one kind ("fake" or "libp2p") that can reach each other."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.network = FakeNetwork()
        self._names = iter(range(1_000_000))

    def open(self, *, max_inbound_streams_per_peer: int = 64) -> AbstractAsyncContextManager[Transport]:
        if self.kind == "fake":
            return open_fake_transport(
                self.network,
                peer_id=f"peer-{next(self._names)}",
                max_inbound_streams_per_peer=max_inbound_streams_per_peer,
            )
        return open_libp2p_transport(key_path=None, max_inbound_streams_per_peer=max_inbound_streams_per_peer)

    def nobody(self) -> tuple[str, list[str]]:
        """A peer id that never existed, and (for libp2p) an address where nothing listens."""
        if self.kind == "fake":
            return "nobody", []
        with socket.socket() as sock:  # a port that was free a moment ago: connection refused
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return str(ID.from_pubkey(create_new_key_pair().public_key)), [f"/ip4/127.0.0.1/tcp/{port}"]


@pytest.fixture(params=["fake", "libp2p"])
def peers(request: pytest.FixtureRequest) -> Peers:
    return Peers(request.param)


async def echo_handler(stream: Stream) -> None:
    while data := await stream.read(1 << 16):
        await stream.write(data)


async def stream_ends(stream: Stream) -> str:
    """Read until the stream ends; how it ended. A reset may surface as EOF on py-libp2p."""
    try:
        while await stream.read(1 << 16):
            pass
    except BrokenError:
        return "reset"
    return "eof"


async def read_exactly(stream: Stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.read(n - len(buf))
        if not data:
            raise AssertionError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


async def test_echo_and_peer_ids(peers: Peers) -> None:
    async with peers.open() as server, peers.open() as client:
        seen: list[str] = []

        async def handler(stream: Stream) -> None:
            seen.append(stream.remote_peer_id)
            await echo_handler(stream)

        server.set_stream_handler(ECHO, handler)
        with trio.fail_after(10):
            stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            assert stream.remote_peer_id == server.peer_id
            for msg in (b"hello", b"x" * 1000, bytes(range(256))):
                await stream.write(msg)
                assert await read_exactly(stream, len(msg)) == msg
            await stream.aclose()
        assert seen == [client.peer_id]
        assert server.peer_id != client.peer_id


async def test_many_concurrent_streams(peers: Peers) -> None:
    async with peers.open() as server, peers.open() as client:
        server.set_stream_handler(ECHO, echo_handler)
        results: dict[int, list[bytes]] = {}

        async def one(i: int) -> None:
            stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            got = []
            for j in range(5):
                msg = f"stream {i} message {j} ".encode() * (i + 1)
                await stream.write(msg)
                got.append(await read_exactly(stream, len(msg)))
            results[i] = got
            await stream.aclose()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, i)
        assert sorted(results) == list(range(20))
        for i, got in results.items():
            assert got == [f"stream {i} message {j} ".encode() * (i + 1) for j in range(5)]


async def test_large_payload_arrives_intact_both_ways(peers: Peers, rng: random.Random) -> None:
    async with peers.open() as server, peers.open() as client:
        server.set_stream_handler(ECHO, echo_handler)
        payload = rng.randbytes(9 * 1024 * 1024 + 7)
        with trio.fail_after(30):
            stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            received = bytearray()

            async def reader() -> None:
                while len(received) < len(payload):
                    data = await stream.read(1 << 20)
                    assert data, "unexpected EOF"
                    received.extend(data)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                await stream.write(payload)
            await stream.aclose()
        assert len(received) == len(payload)
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


async def test_close_is_graceful_and_final(peers: Peers) -> None:
    async with peers.open() as server, peers.open() as client:
        server_saw: list[bytes] = []
        server_done = trio.Event()

        async def handler(stream: Stream) -> None:
            while data := await stream.read(100):
                server_saw.append(data)
            server_saw.append(b"<EOF>")
            await stream.write(b"bye")
            await stream.aclose()
            with pytest.raises(ClosedError):
                await stream.read(10)
            server_done.set()

        server.set_stream_handler(ECHO, handler)
        with trio.fail_after(10):
            stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            await stream.write(b"last words")
            await stream.aclose()
            await stream.aclose()  # idempotent
            with pytest.raises(ClosedError):
                await stream.write(b"more")
            with pytest.raises(ClosedError):
                await stream.read(10)
            await server_done.wait()
        assert b"".join(server_saw) == b"last words<EOF>"


async def test_peer_sees_eof_after_remote_close(peers: Peers) -> None:
    async with peers.open() as server, peers.open() as client:

        async def handler(stream: Stream) -> None:
            await stream.write(b"one-shot")
            # returning closes the stream

        server.set_stream_handler(ECHO, handler)
        with trio.fail_after(10):
            stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            assert await read_exactly(stream, 8) == b"one-shot"
            assert await stream.read(100) == b""
            assert await stream.read(100) == b""
            await stream.aclose()


async def test_dial_failures_are_quick_and_harmless(peers: Peers) -> None:
    async with peers.open() as server, peers.open() as client:
        server.set_stream_handler(ECHO, echo_handler)
        nobody, nowhere = peers.nobody()
        with trio.fail_after(3):
            with pytest.raises(DialError):
                await client.open_stream(nobody, nowhere, ECHO)
            with pytest.raises(DialError):  # a peer that speaks, but not this protocol
                await client.open_stream(server.peer_id, server.listen_addrs, "/test/unknown/1")
            if peers.kind == "libp2p":
                with pytest.raises(DialError):  # someone else answers at the address: Noise catches it
                    await client.open_stream(nobody, server.listen_addrs, ECHO)
        with trio.fail_after(10):  # ... and the listener still serves the protocol it does speak
            stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            await stream.write(b"still here")
            assert await read_exactly(stream, 10) == b"still here"
            await stream.aclose()


async def test_dial_peer_that_went_away_fails_quickly(peers: Peers) -> None:
    async with peers.open() as client:
        async with peers.open() as peer:
            peer.set_stream_handler(ECHO, echo_handler)
            peer_id, addrs = peer.peer_id, peer.listen_addrs
            stream = await client.open_stream(peer_id, addrs, ECHO)
        with trio.fail_after(3):
            with pytest.raises(BrokenError):
                while await stream.read(10):
                    pass
            with pytest.raises(TransportError):
                await client.open_stream(peer_id, addrs, ECHO)


async def test_handler_that_raises_does_not_kill_the_listener(
    peers: Peers, caplog: pytest.LogCaptureFixture
) -> None:
    async with peers.open() as server, peers.open() as client:
        calls = 0

        async def handler(stream: Stream) -> None:
            nonlocal calls
            calls += 1
            data = await stream.read(100)
            if data == b"boom":
                raise RuntimeError("handler exploded")
            await stream.write(data)

        server.set_stream_handler(ECHO, handler)
        with trio.fail_after(10):
            bad = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            await bad.write(b"boom")
            assert await stream_ends(bad)
            await bad.aclose()
            for i in range(3):
                good = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
                await good.write(f"ok {i}".encode())
                assert await read_exactly(good, 4) == f"ok {i}".encode()
                await good.aclose()
        assert calls == 4
        assert "handler exploded" in caplog.text


async def test_inbound_streams_per_peer_are_capped(peers: Peers) -> None:
    async with peers.open(max_inbound_streams_per_peer=2) as server, peers.open() as client:
        release = trio.Event()

        async def handler(stream: Stream) -> None:
            await stream.write(b"in")
            await release.wait()

        server.set_stream_handler(ECHO, handler)
        with trio.fail_after(10):
            held = [await client.open_stream(server.peer_id, server.listen_addrs, ECHO) for _ in range(2)]
            for s in held:
                assert await read_exactly(s, 2) == b"in"
            try:  # refused: the open itself fails, or the stream ends at once
                third = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            except DialError:
                pass
            else:
                assert await stream_ends(third)
            release.set()
            for s in held:
                assert await s.read(10) == b""
                await s.aclose()
            # the slots came back
            again = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
            assert await read_exactly(again, 2) == b"in"
            await again.aclose()


# --------------------------------------------------------------------------------------------
# Fake-only behaviour (latency, loss, partitions) in virtual time


async def test_fake_latency_in_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    network = FakeNetwork(latency_s=0.05)
    async with open_fake_transport(network, peer_id="a") as a, open_fake_transport(network, peer_id="b") as b:
        b.set_stream_handler(ECHO, echo_handler)
        t0 = trio.current_time()
        stream = await a.open_stream("b", b.listen_addrs, ECHO)
        assert trio.current_time() - t0 == pytest.approx(0.1)
        t1 = trio.current_time()
        await stream.write(b"ping")
        assert await read_exactly(stream, 4) == b"ping"
        assert trio.current_time() - t1 == pytest.approx(0.1)


async def test_fake_partition_and_peer_leaving(autojump_clock: trio.testing.MockClock) -> None:
    network = FakeNetwork(latency_s=0.01)
    async with open_fake_transport(network, peer_id="a") as a:
        async with open_fake_transport(network, peer_id="b") as b:
            b.set_stream_handler(ECHO, echo_handler)
            stream = await a.open_stream("b", [], ECHO)
            network.partition("a", "b")
            with pytest.raises(BrokenError):
                await stream.read(10)
            t0 = trio.current_time()
            with pytest.raises(DialError):
                await a.open_stream("b", [], ECHO)
            assert trio.current_time() - t0 <= 0.02 + 1e-9
            network.heal()
            stream = await a.open_stream("b", [], ECHO)
            await stream.write(b"back")
            assert await read_exactly(stream, 4) == b"back"
        # b left the network: its streams broke, and it cannot be dialled
        with pytest.raises(BrokenError):
            await stream.read(10)
        with pytest.raises(DialError):
            await a.open_stream("b", [], ECHO)


async def test_fake_loss_breaks_streams_reproducibly(autojump_clock: trio.testing.MockClock) -> None:
    async def run(seed: int) -> list[str]:
        network = FakeNetwork(loss=0.3, rng=random.Random(seed))
        outcomes = []
        async with (
            open_fake_transport(network, peer_id="a") as a,
            open_fake_transport(network, peer_id="b") as b,
        ):
            b.set_stream_handler(ECHO, echo_handler)
            for _ in range(20):
                try:
                    stream = await a.open_stream("b", [], ECHO)
                    await stream.write(b"x")
                    await read_exactly(stream, 1)
                    outcomes.append("ok")
                except DialError:
                    outcomes.append("dial")
                except BrokenError:
                    outcomes.append("broken")
        return outcomes

    first, second = await run(7), await run(7)
    assert first == second
    assert {"ok", "dial", "broken"} <= set(first)
