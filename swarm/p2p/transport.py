"""Byte-stream transport between peers (shell): one small interface, a py-libp2p and a fake implementation.

Everything above this module (the expert protocol, the dispatcher, the volunteer) sees only
``Transport`` and ``Stream``; ``tests/test_transport_conformance.py`` runs one suite against both
implementations.

Rules:
- ``Stream.read(max_bytes)`` returns 1..max_bytes bytes, or ``b""`` once the peer has closed its side.
  ``aclose()`` is graceful (data already written is delivered, then end-of-stream) and idempotent;
  after it, our own ``read``/``write`` raise ``ClosedError``. A reset, a dead connection or a
  partition raises ``BrokenError`` -- except that py-libp2p 0.8.1 reports a stream reset by the
  peer as end of stream when the reset arrives before the read, so callers must treat an
  unexpected ``b""`` as a broken stream too. Only errors from ``swarm.errors`` escape: library
  exceptions are translated at this boundary.
- ``open_stream`` raises ``DialError`` (a ``TransportError``) when the peer is unknown,
  unreachable, partitioned away or does not speak the protocol, ``TransportTimeout`` when the dial
  outlasts the transport's dial timeout, ``ClosedError`` once the transport is closed.
- Inbound streams run their handler in a task owned by the transport; when the handler returns the
  stream is closed, when it raises the stream is reset and the error logged. The listener keeps
  serving every other stream. At most ``max_inbound_streams_per_peer`` inbound streams per peer are
  open at once; more are reset on arrival.
- The fake uses only trio primitives and ``trio.sleep``, so it runs under ``trio.testing.MockClock``
  (virtual time); its randomness comes from an injected ``random.Random``.
- The py-libp2p 0.8.1 workarounds are listed in one comment block ("py-libp2p 0.8.1 workarounds"
  below) and applied when ``open_libp2p_transport`` builds and closes its host; importing this
  module changes nothing in the library.
"""

from __future__ import annotations

import logging
import os
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import trio

from swarm.errors import BrokenError, ClosedError, ConfigError, TransportError, TransportTimeout

if TYPE_CHECKING:
    from libp2p.abc import INetStream
    from libp2p.crypto.keys import KeyPair
    from libp2p.host.basic_host import BasicHost

__all__ = [
    "DialError",
    "FakeNetwork",
    "FakeTransport",
    "Libp2pTransport",
    "NatHooks",
    "Stream",
    "StreamHandler",
    "Transport",
    "load_or_create_identity",
    "open_fake_transport",
    "open_libp2p_transport",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_INBOUND_STREAMS_PER_PEER: Final = 64


class DialError(TransportError):
    """A stream could not be opened: unknown or unreachable peer, partition, protocol not spoken."""

    code = "dial_failed"


class Stream(ABC):
    """A reliable, ordered, bidirectional byte stream to one peer."""

    @property
    @abstractmethod
    def remote_peer_id(self) -> str: ...

    @abstractmethod
    async def read(self, max_bytes: int) -> bytes:
        """1..max_bytes bytes; ``b""`` at end of stream."""

    @abstractmethod
    async def write(self, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    async def aclose(self) -> None: ...


StreamHandler = Callable[[Stream], Awaitable[None]]


class Transport(ABC):
    """Opens streams to peers and hands inbound streams to per-protocol handlers."""

    @property
    @abstractmethod
    def peer_id(self) -> str: ...

    @property
    @abstractmethod
    def listen_addrs(self) -> list[str]: ...

    @abstractmethod
    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> Stream: ...

    @abstractmethod
    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None: ...

    def path_to(self, peer_id: str) -> str | None:
        """How a new stream to ``peer_id`` would travel ("direct", "relayed", "hole-punched"), or
        None when not connected or when the transport does not know (see ``swarm.core.paths``)."""
        return None


class NatHooks(Protocol):
    """Relay and NAT support attached to a ``Libp2pTransport`` by ``swarm.p2p.nat``."""

    async def connect(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Ensure a connection to ``peer_id``: direct addresses, then ``/p2p-circuit`` ones."""

    def path_to(self, peer_id: str) -> str | None: ...


class _InboundGate:
    """Counts open inbound streams per peer; refuses beyond the limit."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: dict[str, int] = {}

    def try_enter(self, peer_id: str) -> bool:
        n = self._open.get(peer_id, 0)
        if n >= self._limit:
            return False
        self._open[peer_id] = n + 1
        return True

    def leave(self, peer_id: str) -> None:
        n = self._open.get(peer_id, 0) - 1
        if n <= 0:
            self._open.pop(peer_id, None)
        else:
            self._open[peer_id] = n


async def _run_inbound(
    gate: _InboundGate, handler: StreamHandler, stream: Stream, reset: Callable[[], Awaitable[None]]
) -> None:
    """Run one inbound stream's handler: close on return, reset on error, never propagate Exceptions."""
    peer = stream.remote_peer_id
    if not gate.try_enter(peer):
        log.warning("peer %s has too many inbound streams open; resetting a new one", peer)
        await reset()
        return
    try:
        await handler(stream)
    except Exception:
        log.exception("stream handler failed for peer %s; resetting the stream", peer)
        with trio.CancelScope(shield=True):
            await reset()
    finally:
        gate.leave(peer)
        with trio.move_on_after(5) as scope:
            scope.shield = True
            try:
                await stream.aclose()
            except TransportError:
                pass


# ============================================================================================
# In-memory fake


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
        self._gate = _InboundGate(max_inbound_streams_per_peer)
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

        await _run_inbound(self._gate, handler, stream, reset)


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


# ============================================================================================
# py-libp2p


def load_or_create_identity(path: Path) -> KeyPair:
    """The Ed25519 identity stored at ``path`` (libp2p protobuf encoding); created on first use.

    Creation is atomic and safe against a concurrent creator: the key is written to a private
    temporary file (mode 0600), fsynced and hard-linked into place; if another process linked first,
    its key wins and is returned.
    """
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.keys import KeyPair, KeyType
    from libp2p.crypto.serialization import deserialize_private_key

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        key_pair = create_new_key_pair()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{random.SystemRandom().getrandbits(32):08x}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key_pair.private_key.serialize())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return load_or_create_identity(path)
        finally:
            tmp.unlink(missing_ok=True)
        return key_pair
    except OSError as exc:
        raise ConfigError(f"cannot read identity key {path}: {exc}") from exc
    try:
        private_key = deserialize_private_key(data)
    except Exception as exc:
        raise ConfigError(
            f"identity key {path} is corrupt ({exc}); move it away to create a new identity"
        ) from exc
    if private_key.get_type() != KeyType.Ed25519:
        raise ConfigError(f"identity key {path} is {private_key.get_type().name}, expected Ed25519")
    return KeyPair(private_key, private_key.get_public_key())


class _Libp2pStream(Stream):
    def __init__(self, net_stream: INetStream, remote_peer_id: str) -> None:
        self._s = net_stream
        self._remote = remote_peer_id
        self._closed = False
        self._eof = False
        self._leftover = b""

    @property
    def remote_peer_id(self) -> str:
        return self._remote

    async def read(self, max_bytes: int) -> bytes:
        from libp2p.network.stream.exceptions import StreamEOF

        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if self._closed:
            raise ClosedError("stream closed locally")
        if self._leftover:
            data, self._leftover = self._leftover[:max_bytes], self._leftover[max_bytes:]
            await trio.lowlevel.checkpoint()
            return data
        if self._eof:
            await trio.lowlevel.checkpoint()
            return b""
        try:
            data = await self._s.read(max_bytes)
        except StreamEOF:
            self._eof = True
            return b""
        except Exception as exc:  # StreamReset, StreamError, muxer errors: the stream is gone
            if self._closed:
                raise ClosedError("stream closed locally") from exc
            raise BrokenError(f"stream to {self._remote} broke: {exc!r}") from exc
        if not data:
            self._eof = True
            return b""
        if len(data) > max_bytes:
            data, self._leftover = data[:max_bytes], data[max_bytes:]
        return data

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise ClosedError("stream closed locally")
        try:
            await self._s.write(data if isinstance(data, bytes) else bytes(data))
        except Exception as exc:
            if self._closed:
                raise ClosedError("stream closed locally") from exc
            raise BrokenError(f"stream to {self._remote} broke: {exc!r}") from exc

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            await self._s.close()
        except Exception as exc:  # already reset or connection gone: nothing left to close
            log.debug("closing stream to %s: %r", self._remote, exc)

    async def reset(self) -> None:
        self._closed = True
        try:
            await self._s.reset()
        except Exception as exc:
            log.debug("resetting stream to %s: %r", self._remote, exc)


class Libp2pTransport(Transport):
    """A py-libp2p host (Noise, Yamux, TCP) behind the ``Transport`` interface.

    Create with ``open_libp2p_transport``. ``dial_timeout_s`` bounds ``open_stream`` (connect,
    security and muxer handshakes, protocol negotiation).
    """

    def __init__(
        self,
        host: BasicHost,
        nursery: trio.Nursery,
        *,
        dial_timeout_s: float,
        max_inbound_streams_per_peer: int,
    ) -> None:
        self.host = host
        self._nursery = nursery
        self._dial_timeout_s = dial_timeout_s
        self._gate = _InboundGate(max_inbound_streams_per_peer)
        self._closed = False
        self.nat: NatHooks | None = None  # set by swarm.p2p.nat: circuit dialing, hole punching, paths

    @property
    def peer_id(self) -> str:
        return str(self.host.get_id())

    @property
    def listen_addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()]

    def path_to(self, peer_id: str) -> str | None:
        return self.nat.path_to(peer_id) if self.nat is not None else None

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        from libp2p.custom_types import TProtocol

        async def on_stream(net_stream: INetStream) -> None:
            remote = str(net_stream.muxed_conn.peer_id)
            stream = _Libp2pStream(net_stream, remote)
            await _run_inbound(self._gate, handler, stream, stream.reset)

        self.host.set_stream_handler(TProtocol(protocol), on_stream)

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> Stream:
        if self._closed:
            raise ClosedError("transport is closed")
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        try:
            pid = ID.from_base58(peer_id)
            maddrs = [_strip_p2p(a, peer_id) for a in addrs]
        except (ValueError, TypeError) as exc:
            raise DialError(f"bad peer id or address for {peer_id}: {exc}") from exc
        network = self.host.get_network()
        if maddrs:
            self.host.get_peerstore().add_addrs(pid, maddrs, 3600)
        with trio.move_on_after(self._dial_timeout_s):
            try:
                # dial_peer skips connections that are closing and dials afresh; host.new_stream
                # alone would pick a dead connection that the swarm has not removed yet.
                # dial_peer skips /p2p-circuit addresses: swarm.p2p.nat dials those (workaround (e)).
                if self.nat is not None:
                    await self.nat.connect(peer_id, addrs)
                else:
                    await network.dial_peer(pid)
                net_stream = await self.host.new_stream(pid, [TProtocol(protocol)])
            except Exception as exc:
                raise DialError(f"cannot open {protocol} to {peer_id}: {exc!r}") from exc
            return _Libp2pStream(net_stream, peer_id)
        raise TransportTimeout(f"opening {protocol} to {peer_id} took longer than {self._dial_timeout_s}s")

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to ``peer_id``.

        Returns once they are closing (no new stream will pick them); the rest of each close runs
        in the background, since py-libp2p spends 0.2 s of sleeps in every connection close.
        """
        from libp2p.peer.id import ID

        conns = [
            c for c in self.host.get_network().get_connections(ID.from_base58(peer_id)) if not c.is_closed
        ]
        for conn in conns:
            self._nursery.start_soon(_close_quietly, conn)
        for _ in range(100):  # a close marks its connection closed in its first step
            await trio.lowlevel.checkpoint()
            if all(c.is_closed for c in conns):
                break


def _strip_p2p(addr: str, peer_id: str) -> Any:
    """A multiaddr without its trailing ``/p2p/<id>``; refuses one naming another peer."""
    from multiaddr import Multiaddr

    maddr = Multiaddr(addr)
    named = maddr.get_peer_id()
    if named is not None:
        if named != peer_id:
            raise ValueError(f"address {addr} names peer {named}, not {peer_id}")
        maddr = maddr.decapsulate(Multiaddr(f"/p2p/{named}"))
    return maddr


@asynccontextmanager
async def open_libp2p_transport(
    *,
    key_path: Path | None,
    listen_addrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    dial_timeout_s: float = 10.0,
    max_inbound_streams_per_peer: int = DEFAULT_MAX_INBOUND_STREAMS_PER_PEER,
    websocket: bool = False,
) -> AsyncIterator[Libp2pTransport]:
    """A running libp2p host listening on ``listen_addrs``; closed cleanly on exit.

    The identity is loaded from ``key_path`` (created on first use); ``None`` means a fresh,
    unsaved identity (tests, one-off tools). No listen address means a dial-only host (a volunteer
    reachable only through a relay). ``websocket`` (implied by a ``/ws`` listen address) adds the
    WebSocket transport, for networks that only let web ports out.
    """
    from libp2p.crypto.ed25519 import create_new_key_pair
    from multiaddr import Multiaddr

    if key_path is None:
        key_pair = create_new_key_pair()
    else:
        key_pair = await trio.to_thread.run_sync(load_or_create_identity, key_path)
    try:
        maddrs = [Multiaddr(a) for a in listen_addrs]
    except Exception as exc:
        raise ConfigError(f"bad listen address in {list(listen_addrs)}: {exc}") from exc
    host = _build_libp2p_host(key_pair, websocket=websocket or any("/ws" in a for a in listen_addrs))
    async with host.run(listen_addrs=maddrs):
        try:
            if maddrs and not host.get_addrs():
                raise ConfigError(f"could not listen on any of {list(listen_addrs)}")
            async with trio.open_nursery() as nursery:
                transport = Libp2pTransport(
                    host,
                    nursery,
                    dial_timeout_s=dial_timeout_s,
                    max_inbound_streams_per_peer=max_inbound_streams_per_peer,
                )
                try:
                    yield transport
                finally:
                    transport._closed = True
                    nursery.cancel_scope.cancel()
        finally:
            await _close_network(host)


# --------------------------------------------------------------------------------------------
# py-libp2p 0.8.1 workarounds: the one place where library behaviour is changed.
#
# (a) A listener refused every connection after its 250th inbound connection ever.
#     Cause: Swarm._handle_inbound_connection takes a slot of ``_inbound_limiter`` (a
#     CapacityLimiter of max_connections - min_connections = 300 - 50 = 250 tokens) and
#     _do_handle_inbound_connection then parks on ``self.manager.wait_finished()`` -- the whole
#     swarm's lifetime -- to keep the transport from closing the socket. The slot (and the task)
#     is released only at shutdown, not when the connection closes.
#     Fix: ``_WorkaroundSwarm`` overrides _do_handle_inbound_connection to park until *that*
#     connection's muxer reports it closed, so the slot is returned with the connection.
# (b) Every dial waited ~250 ms. Cause: Swarm.dial_peer's happy-eyeballs loop starts a dial and
#     then waits _HAPPY_EYEBALLS_DELAY (250 ms) for it to *fail* before moving on -- also after the
#     last address, and a success only ends the wait if it reaches max_connections_per_peer (3 by
#     default). Fix: max_connections_per_peer=1 (we want one connection per peer anyway), so the
#     first success cancels the wait, as happy eyeballs intends.
# (c) A stream per call costs a multistream-select round trip (~3.5 ms): not patched here;
#     swarm.rpc.expert keeps one long-lived, pipelined stream per peer instead.
# (d) Shutdown leaked sockets: the library closes connections and listeners in its service's
#     ``finally`` while being cancelled, so each close stops at its first checkpoint. The
#     listening socket lives in a trio system task and stays open; with SO_REUSEPORT a peer
#     restarted on the same port shares it with the dead listener, which swallows some of its
#     connections. Fix: ``_close_network`` closes listeners, then connections, shielded, before
#     the service stops; ``_close_quietly`` shields every connection close (an interrupted close
#     marks the connection closed, so a second close() returns without closing the socket).
# Also configured: no dial retries and no negative dial cache (a failed dial otherwise blocks
# that peer for 60 s even after it is back): retry policy belongs to the caller, who can see it.
# min_connections = low_watermark = 0 (fewer connections kept open by the auto-connector).
# Only Noise and Yamux are offered (new_host also offers TLS, SECIO and plaintext, and Mplex).
# No ResourceManager: its default circuit breaker, per-peer connection rate limit and
# memory-based admission fail connections in ways the caller cannot see or configure here; the
# limits that matter are max_connections (swarm) and max_inbound_streams_per_peer (ours).
# Relay and NAT traversal (swarm/p2p/nat.py, relay/service.py; tests/test_relay_workarounds.py):
# (e) host.connect() and Swarm.dial_peer skip /p2p-circuit addresses. Libp2pTransport.open_stream
#     calls swarm.p2p.nat's connect hook, which dials them itself (HOP CONNECT, then Noise + Yamux
#     over the relayed stream).
# (f) CircuitV2Protocol keys live circuits by peer id, so the end of one circuit closes another
#     circuit to the same peer, and RelayLimits(data=0) cuts a circuit at its first byte (0 is
#     meant as "unlimited" by the spec). relay.service is our own hop service (same wire format,
#     the library's protobufs): one id per circuit, 0 = unlimited, limits omitted when unlimited.
# (g) A dial-only node with the default RelayConfig roles (CLIENT) sends a RESERVE before every
#     circuit dial and takes a reservation slot it never uses; reservations also outlived their
#     peer's connection until expiry. Our dialer never reserves; the relay frees a reservation
#     when its peer disconnects.
# (h) The AutoNAT v1 server "dials back" with host.connect(), which returns the connection the
#     request came in on: every node is told it is reachable. relay.service answers AutoNAT with
#     a fresh TCP connection and a Noise handshake that proves the peer's identity.
# (i) The auto-connector re-dialled every peer in the peerstore after any disconnect, even with
#     min_connections = low_watermark = 0: its target is the midpoint of the low and high
#     watermarks (150). A NATed volunteer thus re-dialled its coordinator directly behind the
#     operator's back (--no-hole-punch), and a coordinator re-dialled volunteers it had dropped.
#     Fix: _WorkaroundSwarm disables it; connections are opened by the caller, who can see them.


def _workaround_swarm_class() -> type[Any]:
    from libp2p.abc import IMuxedConn
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.network.swarm import Swarm, _NegativePeerCache

    class _WorkaroundSwarm(Swarm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._negative_peer_cache = _NegativePeerCache(ttl=0.0)

            async def no_auto_connect() -> None:  # workaround (i)
                await trio.lowlevel.checkpoint()

            self.auto_connector.maybe_connect = no_auto_connect  # type: ignore[method-assign]

        async def _do_handle_inbound_connection(
            self, read_write_closer: Any, maddr: Any, failure_event: Any
        ) -> None:
            if isinstance(read_write_closer, IMuxedConn):  # QUIC-style transports: not used here
                await super()._do_handle_inbound_connection(
                    cast(Any, read_write_closer), maddr, failure_event
                )
                return
            remote = self._build_remote_multiaddr(read_write_closer)
            if remote is not None and not await self.connection_gate.is_allowed(remote):
                await read_write_closer.close()
                return
            raw_conn = RawConnection(read_write_closer, False)
            try:
                muxed_conn = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
            except Exception as exc:
                log.debug("inbound connection on %s failed to upgrade: %r", maddr, exc)
                try:
                    await raw_conn.close()
                except Exception:
                    pass
                return
            closed = getattr(muxed_conn, "event_closed", None)
            if isinstance(closed, trio.Event):
                await closed.wait()  # the fix: hold the slot only as long as the connection lives
            else:
                await self.manager.wait_finished()  # the library's behaviour for other muxers

    return _WorkaroundSwarm


def _build_libp2p_host(key_pair: KeyPair, *, websocket: bool = False) -> BasicHost:
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.host.basic_host import BasicHost
    from libp2p.network.config import ConnectionConfig, RetryConfig
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import PeerStore
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux
    from libp2p.transport.tcp.tcp import TCP
    from libp2p.transport.upgrader import TransportUpgrader

    from swarm.p2p.patches.yamux import apply_yamux_tuning

    peer_id = ID.from_pubkey(key_pair.public_key)
    peerstore = PeerStore()
    peerstore.add_key_pair(peer_id, key_pair)
    upgrader = TransportUpgrader(
        secure_transports_by_protocol={
            TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
                key_pair, noise_privkey=create_x25519_key_pair().private_key
            )
        },
        muxer_transports_by_protocol={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )
    apply_yamux_tuning(upgrader)  # go-yamux window updates, fewer scheduler trips per frame
    transports: list[Any] = [TCP()]
    if websocket:
        from libp2p.transport.websocket.transport import WebsocketTransport

        transports.append(WebsocketTransport(upgrader))
    swarm = _workaround_swarm_class()(
        peer_id,
        peerstore,
        upgrader,
        transports=transports,
        retry_config=RetryConfig(max_retries=0),
        connection_config=ConnectionConfig(max_connections_per_peer=1, min_connections=0, low_watermark=0),
    )
    return BasicHost(network=swarm)


async def _close_network(host: BasicHost) -> None:
    """Close listeners, then every connection (in parallel), shielded, before the service stops.

    py-libp2p 0.8.1 does this in the service's ``finally`` while being cancelled, so each close is
    interrupted at its first checkpoint: connection sockets leak, and the listening socket (served
    from a trio system task) stays open -- with SO_REUSEPORT a restarted peer on the same port then
    shares it with the dead listener, which takes some of its connections. Each connection close
    also sleeps 0.2 s inside the library, hence in parallel.
    """
    network = host.get_network()
    with trio.move_on_after(5) as scope:
        scope.shield = True
        for listener in list(network.listeners.values()):
            try:
                await listener.close()
            except Exception as exc:
                log.debug("closing listener: %r", exc)
        async with trio.open_nursery() as nursery:
            for conns in list(network.connections.values()):
                for conn in list(conns):
                    nursery.start_soon(_close_quietly, conn)


async def quietly(action: Callable[[], Awaitable[object]], what: str, *, timeout_s: float = 2.0,
                  shield: bool = False) -> None:
    """Best-effort teardown (a close or reset of a library object): bounded in time, shielded from
    cancellation if asked, failures logged at debug level and never raised."""
    with trio.move_on_after(timeout_s) as scope:
        scope.shield = shield
        try:
            await action()
        except Exception as exc:
            log.debug("%s: %r", what, exc)


async def _close_quietly(conn: Any) -> None:
    """Close a connection to the end, even when cancelled: an interrupted close marks the connection
    closed without closing its socket, and a later close() then returns at once (py-libp2p 0.8.1)."""
    await quietly(conn.close, "closing connection", timeout_s=5, shield=True)
