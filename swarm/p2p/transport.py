"""Byte-stream transport between peers (shell): the one small interface every protocol sees.

Everything above ``swarm.p2p`` (the expert protocol, the dispatcher, the volunteer) sees only
``Transport`` and ``Stream``. Two implementations: ``swarm.p2p.memory`` (an in-memory fake with
latency, loss and partitions, for virtual-time tests) and ``swarm.p2p.libp2p`` (py-libp2p: Noise,
Yamux, TCP); ``tests/sim/test_transport_conformance.py`` runs one suite against both.

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
- Inbound streams run their handler in a task owned by the transport (``run_inbound``); when the
  handler returns the stream is closed, when it raises the stream is reset and the error logged.
  The listener keeps serving every other stream. At most ``max_inbound_streams_per_peer`` inbound
  streams per peer are open at once (``InboundGate``); more are reset on arrival.
- ``relayed_bytes(peer, protocol)`` counts what a stream on a relayed connection carried: the
  payload bytes its reads and writes moved (not the muxer's headers, window updates or pings), by
  the connection the stream actually runs on, not by what a new stream would take.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

import trio

if TYPE_CHECKING:
    pass

__all__ = [
    "DEFAULT_MAX_INBOUND_STREAMS_PER_PEER",
    "InboundGate",
    "run_inbound",
    "acquire",
    "quietly",
    "NatHooks",
    "Stream",
    "StreamHandler",
    "Transport",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_INBOUND_STREAMS_PER_PEER: Final = 64


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

    def relayed_bytes(self, peer_id: str, protocol: str) -> int:
        """Payload bytes (sent + received) of ``protocol`` streams with ``peer_id`` that ran through
        a relay circuit, since the transport started; 0 for a transport without relays."""
        return 0


class NatHooks(Protocol):
    """Relay and NAT support attached to a ``Libp2pTransport`` by ``swarm.p2p.nat``."""

    async def connect(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Ensure a connection to ``peer_id``: direct addresses, then ``/p2p-circuit`` ones."""

    def path_to(self, peer_id: str) -> str | None: ...


class InboundGate:
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


async def run_inbound(
    gate: InboundGate, handler: StreamHandler, stream: Stream, reset: Callable[[], Awaitable[None]]
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
        await quietly(stream.aclose, f"closing an inbound stream of {peer}", timeout_s=5, shield=True)


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


async def acquire(sync: trio.Lock | trio.Semaphore) -> None:
    """Acquire ``sync``; when it is free, without the scheduler trip of ``acquire()``.

    Every uncontended ``acquire()`` yields once; on the per-call path those trips add up (each is
    a pass through trio's run loop), and the awaits that follow are checkpoints anyway.
    """
    try:
        sync.acquire_nowait()
    except trio.WouldBlock:
        await sync.acquire()
