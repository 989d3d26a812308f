"""The py-libp2p adapter of ``Transport`` (shell): a host with Noise, Yamux and TCP (+ WebSocket).

Rules:
- Library exceptions never escape: they become ``swarm.errors`` at this boundary.
- Everything that changes py-libp2p's behaviour lives in ``swarm.p2p.patches`` (lettered
  workarounds, applied per host, nothing at import); building a host checks that the installed
  py-libp2p is the pinned version the patches were written for (``ConfigError`` otherwise).
- ``dial_timeout_s`` bounds ``open_stream`` (connect, security and muxer handshakes, protocol
  negotiation); relay and NAT traversal plug in through ``Libp2pTransport.nat`` (``swarm.p2p.nat``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from swarm.errors import BrokenError, ClosedError, ConfigError, DialError, TransportTimeout
from swarm.p2p.identity import load_or_create_identity
from swarm.p2p.patches.host import build_host, close_network, close_quietly
from swarm.p2p.transport import (
    DEFAULT_MAX_INBOUND_STREAMS_PER_PEER,
    InboundGate,
    NatHooks,
    Stream,
    StreamHandler,
    Transport,
    run_inbound,
)

if TYPE_CHECKING:
    from libp2p.abc import INetStream
    from libp2p.host.basic_host import BasicHost

__all__ = ["Libp2pTransport", "connection_notifee", "open_libp2p_transport"]

log = logging.getLogger(__name__)


class _Libp2pStream(Stream):
    def __init__(self, net_stream: INetStream, remote_peer_id: str, meter: Callable[[int], None] | None = None) -> None:
        self._s = net_stream
        self._remote = remote_peer_id
        self._meter = meter  # called with the payload bytes moved, on relayed connections only
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
        if self._meter is not None:
            self._meter(len(data))
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
        if self._meter is not None:
            self._meter(len(data))

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
        self._gate = InboundGate(max_inbound_streams_per_peer)
        self._closed = False
        self.nat: NatHooks | None = None  # set by swarm.p2p.nat: circuit dialing, hole punching, paths
        self._relayed_bytes: dict[tuple[str, str], int] = {}  # (peer, protocol) -> payload bytes via relays

    @property
    def peer_id(self) -> str:
        return str(self.host.get_id())

    @property
    def listen_addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs()]

    def path_to(self, peer_id: str) -> str | None:
        return self.nat.path_to(peer_id) if self.nat is not None else None

    def relayed_bytes(self, peer_id: str, protocol: str) -> int:
        return self._relayed_bytes.get((peer_id, protocol), 0)

    def _meter_for(self, net_stream: INetStream, peer_id: str, protocol: str) -> Callable[[int], None] | None:
        """A byte counter for ``net_stream`` if its connection runs through a relay, else None."""
        from libp2p.connection_types import ConnectionType

        try:
            relayed = net_stream.muxed_conn.get_connection_type() == ConnectionType.RELAYED
        except Exception:
            relayed = False
        if not relayed:
            return None
        key = (peer_id, protocol)

        def meter(n: int) -> None:
            self._relayed_bytes[key] = self._relayed_bytes.get(key, 0) + n

        return meter

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        from libp2p.custom_types import TProtocol

        async def on_stream(net_stream: INetStream) -> None:
            remote = str(net_stream.muxed_conn.peer_id)
            stream = _Libp2pStream(net_stream, remote, self._meter_for(net_stream, remote, protocol))
            await run_inbound(self._gate, handler, stream, stream.reset)

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
            return _Libp2pStream(net_stream, peer_id, self._meter_for(net_stream, peer_id, protocol))
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
            self._nursery.start_soon(close_quietly, conn)
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
    yamux_window_bytes: int | None = None,
) -> AsyncIterator[Libp2pTransport]:
    """A running libp2p host listening on ``listen_addrs``; closed cleanly on exit.

    The identity is loaded from ``key_path`` (created on first use); ``None`` means a fresh,
    unsaved identity (tests, one-off tools). No listen address means a dial-only host (a volunteer
    reachable only through a relay). ``websocket`` (implied by a ``/ws`` listen address) adds the
    WebSocket transport, for networks that only let web ports out. ``yamux_window_bytes``: the
    receive window per stream (default 16 MiB: throughput over long paths; a relay, which holds
    what it cannot pass on yet, takes a small one).
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
    host = build_host(key_pair, websocket=websocket or any("/ws" in a for a in listen_addrs),
                      yamux_window_bytes=yamux_window_bytes)
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
            await close_network(host)


def connection_notifee(on_connected: Callable[[Any], None], on_disconnected: Callable[[Any], None]) -> Any:
    """A py-libp2p swarm notifee calling ``on_connected(conn)`` / ``on_disconnected(conn)`` (sync,
    non-blocking callbacks); register it with ``host.get_network().register_notifee``."""
    from libp2p.abc import INotifee

    class Notifee(INotifee):
        async def opened_stream(self, network: Any, stream: Any) -> None:
            return None

        async def closed_stream(self, network: Any, stream: Any) -> None:
            return None

        async def connected(self, network: Any, conn: Any) -> None:
            on_connected(conn)

        async def disconnected(self, network: Any, conn: Any) -> None:
            on_disconnected(conn)

        async def listen(self, network: Any, multiaddr: Any) -> None:
            return None

        async def listen_close(self, network: Any, multiaddr: Any) -> None:
            return None

    return Notifee()
