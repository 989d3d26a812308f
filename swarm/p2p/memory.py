"""The in-memory fake ``Transport`` (shell): streams between fake peers of one ``FakeNetwork``.

Rules:
- Only trio primitives and ``trio.sleep``: it runs under ``trio.testing.MockClock`` (virtual time).
- Latency, loss (streams that break) and partitions are properties of the network; its randomness
  comes from an injected ``random.Random``.
- It keeps the interface's rules (``swarm.p2p.transport``) exactly as the libp2p adapter does: the
  same conformance suite runs against both.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import trio

from swarm.errors import BrokenError, ClosedError, ConfigError, DialError
from swarm.p2p.transport import (
    DEFAULT_MAX_INBOUND_STREAMS_PER_PEER,
    InboundGate,
    Stream,
    StreamHandler,
    Transport,
    run_inbound,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

__all__ = ["FakeNetwork", "FakeTransport", "open_fake_transport"]


_WINDOW_BYTES: Final = 256 * 1024  # per direction, like a muxer's flow-control window


class _Pipe:
    """One direction of a fake stream: timed chunks, a flow-control window, EOF and breakage."""

    def __init__(self, latency_s: float) -> None:
        self._latency = latency_s
        self._chunks: deque[tuple[float, bytes | None]] = deque()  # None marks end of stream
        self._buffered = 0
        self._readable = trio.lowlevel.ParkingLot()
        self._writable = trio.lowlevel.ParkingLot()
        self.broken: str | None = None
        self.reader_gone = False
        self.eof_sent = False

    def break_(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        self._readable.unpark_all()
        self._writable.unpark_all()

    def close_reader(self) -> None:
        self.reader_gone = True
        self._chunks.clear()
        self._buffered = 0
        self._writable.unpark_all()

    def send_eof(self) -> None:
        if not self.eof_sent:
            self.eof_sent = True
            self._chunks.append((trio.current_time() + self._latency, None))
            self._readable.unpark_all()

    async def write(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            if self.broken is not None:
                raise BrokenError(self.broken)
            if self.reader_gone:
                return  # the peer stopped reading: like TCP after the peer's close, data goes nowhere
            if self._buffered >= _WINDOW_BYTES:
                await self._writable.park()
                continue
            take = min(len(data) - pos, _WINDOW_BYTES - self._buffered)
            self._chunks.append((trio.current_time() + self._latency, bytes(data[pos : pos + take])))
            self._buffered += take
            pos += take
            self._readable.unpark_all()
        await trio.lowlevel.checkpoint()

    async def read(self, max_bytes: int) -> bytes:
        while True:
            if self.broken is not None:
                raise BrokenError(self.broken)
            if not self._chunks:
                await self._readable.park()
                continue
            deliver_at, chunk = self._chunks[0]
            now = trio.current_time()
            if deliver_at > now:
                with trio.move_on_at(deliver_at):
                    await self._readable.park()
                continue
            if chunk is None:
                await trio.lowlevel.checkpoint()
                return b""
            if len(chunk) > max_bytes:
                self._chunks[0] = (deliver_at, chunk[max_bytes:])
                chunk = chunk[:max_bytes]
            else:
                self._chunks.popleft()
            self._buffered -= len(chunk)
            self._writable.unpark_all()
            await trio.lowlevel.checkpoint()
            return chunk


class _FakeStream(Stream):
    def __init__(self, local: str, remote: str, inbox: _Pipe, outbox: _Pipe) -> None:
        self._local = local
        self._remote = remote
        self._inbox = inbox
        self._outbox = outbox
        self._closed = False

    @property
    def remote_peer_id(self) -> str:
        return self._remote

    def break_(self, reason: str) -> None:
        self._inbox.break_(reason)
        self._outbox.break_(reason)

    async def read(self, max_bytes: int) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if self._closed:
            raise ClosedError("stream closed locally")
        return await self._inbox.read(max_bytes)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise ClosedError("stream closed locally")
        await self._outbox.write(memoryview(data).cast("B"))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.send_eof()
            self._inbox.close_reader()
        await trio.lowlevel.checkpoint()


class FakeNetwork:
    """An in-memory network of fake transports with latency, loss and partitions.

    ``latency_s`` is the one-way delay of every write; opening a stream costs one round trip.
    ``loss`` is the probability that a dial or a write fails; a reliable stream cannot drop bytes
    silently, so a lost write breaks its stream (both ends then see ``BrokenError``).
    """

    def __init__(
        self, *, latency_s: float = 0.0, loss: float = 0.0, rng: random.Random | None = None
    ) -> None:
        if latency_s < 0 or not 0.0 <= loss <= 1.0:
            raise ConfigError(f"bad fake network parameters: latency_s={latency_s} loss={loss}")
        self.latency_s = latency_s
        self.loss = loss
        self._rng = rng if rng is not None else random.Random(0)
        self._peers: dict[str, FakeTransport] = {}
        self._partitions: set[frozenset[str]] = set()
        self._streams: set[tuple[_FakeStream, _FakeStream]] = set()

    def partition(self, a: str, b: str) -> None:
        """Cut a from b: open streams between them break, new dials fail, until ``heal()``."""
        self._partitions.add(frozenset((a, b)))
        for pair in list(self._streams):
            if {pair[0].remote_peer_id, pair[1].remote_peer_id} == {a, b}:
                self._drop_pair(pair, f"network partition between {a} and {b}")

    def heal(self) -> None:
        self._partitions.clear()

    def is_partitioned(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._partitions

    def _lost(self) -> bool:
        return self.loss > 0 and self._rng.random() < self.loss

    def _register(self, transport: FakeTransport) -> None:
        if transport.peer_id in self._peers:
            raise ConfigError(f"peer id {transport.peer_id} is already on this fake network")
        self._peers[transport.peer_id] = transport

    def _unregister(self, transport: FakeTransport) -> None:
        if self._peers.get(transport.peer_id) is transport:
            del self._peers[transport.peer_id]
        for pair in list(self._streams):
            if transport.peer_id in (pair[0].remote_peer_id, pair[1].remote_peer_id):
                self._drop_pair(pair, f"peer {transport.peer_id} went away")

    def _drop_pair(self, pair: tuple[_FakeStream, _FakeStream], reason: str) -> None:
        self._streams.discard(pair)
        pair[0].break_(reason)
        pair[1].break_(reason)

    def _connect(self, dialer: str, listener: str) -> tuple[_FakeStream, _FakeStream]:
        a_to_b, b_to_a = _Pipe(self.latency_s), _Pipe(self.latency_s)
        outbound = _LossyFakeStream(self, dialer, listener, inbox=b_to_a, outbox=a_to_b)
        inbound = _LossyFakeStream(self, listener, dialer, inbox=a_to_b, outbox=b_to_a)
        pair = (outbound, inbound)
        outbound.pair = inbound.pair = pair
        self._streams.add(pair)
        return pair


class _LossyFakeStream(_FakeStream):
    def __init__(self, network: FakeNetwork, local: str, remote: str, *, inbox: _Pipe, outbox: _Pipe) -> None:
        super().__init__(local, remote, inbox, outbox)
        self._network = network
        self.pair: tuple[_FakeStream, _FakeStream] | None = None

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closed and self.pair is not None and self._network._lost():
            self._network._drop_pair(self.pair, "connection lost (simulated loss)")
        await super().write(data)

    async def aclose(self) -> None:
        await super().aclose()
        if self.pair is not None and self._inbox.eof_sent and self._outbox.eof_sent:
            self._network._streams.discard(self.pair)


class FakeTransport(Transport):
    """A peer on a ``FakeNetwork``. Create with ``open_fake_transport``."""

    def __init__(
        self, network: FakeNetwork, peer_id: str, nursery: trio.Nursery, *, max_inbound_streams_per_peer: int
    ) -> None:
        self._network = network
        self._peer_id = peer_id
        self._nursery = nursery
        self._handlers: dict[str, StreamHandler] = {}
        self._gate = InboundGate(max_inbound_streams_per_peer)
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self._peer_id}"]

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> Stream:
        if self._closed:
            raise ClosedError("transport is closed")
        net = self._network
        if net.latency_s:
            await trio.sleep(2 * net.latency_s)  # connect + protocol negotiation: one round trip
        else:
            await trio.lowlevel.checkpoint()
        target = net._peers.get(peer_id)
        if target is None:
            raise DialError(f"unknown peer {peer_id}")
        if net.is_partitioned(self._peer_id, peer_id):
            raise DialError(f"peer {peer_id} unreachable (partitioned)")
        if net._lost():
            raise DialError(f"dial to {peer_id} failed (simulated loss)")
        handler = target._handlers.get(protocol)
        if handler is None:
            raise DialError(f"peer {peer_id} does not speak {protocol}")
        outbound, inbound = net._connect(self._peer_id, peer_id)
        target._nursery.start_soon(target._serve_inbound, handler, inbound)
        return outbound

    async def _serve_inbound(self, handler: StreamHandler, stream: _FakeStream) -> None:
        async def reset() -> None:
            stream.break_("stream reset by peer")
            await trio.lowlevel.checkpoint()

        await run_inbound(self._gate, handler, stream, reset)


@asynccontextmanager
async def open_fake_transport(
    network: FakeNetwork,
    *,
    peer_id: str,
    max_inbound_streams_per_peer: int = DEFAULT_MAX_INBOUND_STREAMS_PER_PEER,
) -> AsyncIterator[FakeTransport]:
    """Join ``network`` as ``peer_id``; leaving breaks every stream of this peer."""
    async with trio.open_nursery() as nursery:
        transport = FakeTransport(
            network, peer_id, nursery, max_inbound_streams_per_peer=max_inbound_streams_per_peer
        )
        network._register(transport)
        try:
            yield transport
        finally:
            transport._closed = True
            network._unregister(transport)
            nursery.cancel_scope.cancel()


