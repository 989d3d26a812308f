"""py-libp2p 0.8.1 Yamux and Noise tuned for request/response traffic (shell).

``apply_yamux_tuning(upgrader)`` makes one host's ``TransportUpgrader`` mux its Yamux connections
with ``TunedYamux``. Importing this module changes nothing; other hosts in the process (and every
peer on the network) keep whatever muxer they have.

What the stock muxer costs (loopback, one expert call of 4 KiB each way, both ends in one process):
4 Yamux frames per call -- request, response, and a window update after each of the two reads --
but ~61 trio task steps and ~1.2 ms, against ~0.3 ms for the same framing over plain TCP. The
frames are few; the steps are many: every uncontended ``trio.Lock`` (stream, window, connection and
streams locks) yields to the scheduler, every Noise message takes two socket reads (length, then
body), every read sends a window update (one more Noise message, send and wake-up on each side),
and a writer that runs out of send window polls for an update every 10 ms.

Changes, each wire-compatible with stock py-libp2p and go-yamux (frames follow the Yamux spec):

1. Window updates as in go-yamux: the receiver grants credit once the application has consumed at
   least half of the window, not after every read. A small call sends none.
2. A larger window (``YamuxTuning.window_bytes``, 16 MiB by default, go-yamux's maximum; expert
   frames reach 64 MiB): the extra credit over the spec's initial 256 KiB rides on the SYN (opener)
   or ACK (acceptor) frame as a window delta, which every Yamux honours.
3. A writer out of send window sleeps on an event that the next window update sets (stock: 10 ms
   polling, so a 256 KiB response stalled up to 10 ms per window).
4. A write's DATA frames, each sized to fill one Noise message at most, are sealed and sent with
   one socket write. The Noise reader reads the socket in chunks of up to 96 KiB and cuts
   messages from its buffer (stock: two reads per message, length then body).
5. The receive loop parses frames from a plaintext buffer and takes no lock on paths that do not
   await (trio runs one task at a time; the stock locks only add a scheduler trip each).

Rules:
- Flow control is never violated: a DATA frame never exceeds the credit the peer granted, and a
  peer that sends beyond ours is logged and clamped, as in the stock muxer.
- Stream semantics are the stock ones (EOF, reset, half-close, the backlog of 256 opened streams,
  the 5 s wait for send window before a write fails, the 60 s bound on a DATA body), including the
  0.8.1 quirk that a reset arriving before a read surfaces as end of stream.
- A connection closes on any receive error, GO_AWAY or oversized DATA frame; unknown frame types
  are ignored. FIN/RST flags are honoured on every frame type (stock ignores them on ACK frames).
- Only the objects of a tuned connection change: the library's classes and module globals are not
  patched. The Noise fast path is taken only for the exact stock ``SecureSession`` +
  ``NoiseTransportReadWriter`` pair; any other security transport is used as it is.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final, cast

import msgspec
import trio
from libp2p.abc import IMuxedConn, IRawConnection, ISecureConn
from libp2p.io.exceptions import IncompleteReadError
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoisePacketReadWriter, NoiseTransportReadWriter
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamError, MuxedStreamReset
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import (
    DEFAULT_WINDOW_SIZE,
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    GO_AWAY_NORMAL,
    HEADER_SIZE,
    MAX_WINDOW_SIZE,
    PROTOCOL_ID,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)
from libp2p.transport.upgrader import TransportUpgrader

__all__ = ["DEFAULT_TUNING", "TunedYamux", "TunedYamuxStream", "YamuxTuning", "apply_yamux_tuning"]

log = logging.getLogger(__name__)

_HEADER: Final = struct.Struct(YAMUX_HEADER_FORMAT)
# A DATA frame (header + body) fills one Noise message at most, so a frame never straddles two
# (the stock writer's 64 KiB frames always do): the receiver then has a frame's body as soon as
# its header, without waiting under the body timeout.
_MAX_DATA_BODY: Final = MAX_PLAINTEXT_LENGTH - HEADER_SIZE
# Socket reads of up to 96 KiB: CPython's recv(n) allocates n bytes, and glibc serves allocations
# from 128 KiB up with a fresh mmap -- a 256 KiB recv cost ~20 us more for a 4 KiB message and
# ~200 us more (page faults) for a 192 KiB one.
_NOISE_READ_BYTES: Final = 96 * 1024
_U32_MAX: Final = 2**32 - 1
_GO_AWAY_REASONS: Final = {0: "normal", 1: "protocol error", 2: "internal error", 4101: "garbage collected"}


class YamuxTuning(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a tuned connection sizes its windows and writes.

    ``window_bytes``: receive window per stream (the spec's 256 KiB initial window plus a delta
    granted on SYN/ACK); credit is returned once half of it has been consumed.
    ``write_batch_bytes``: DATA bytes coalesced into one secure write.
    ``window_wait_s``: how long a write waits for send window before it fails (stock: 5 s).
    ``data_body_timeout_s``: how long the rest of an announced DATA frame may take (stock: 60 s).
    """

    window_bytes: Annotated[int, msgspec.Meta(ge=DEFAULT_WINDOW_SIZE, le=_U32_MAX)] = 16 * 1024 * 1024
    write_batch_bytes: Annotated[int, msgspec.Meta(ge=1)] = 1024 * 1024
    window_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    data_body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


DEFAULT_TUNING: Final = YamuxTuning()


def apply_yamux_tuning(upgrader: TransportUpgrader, tuning: YamuxTuning = DEFAULT_TUNING) -> None:
    """Make ``upgrader`` mux Yamux connections with ``TunedYamux``; other muxers are unchanged.

    py-libp2p's ``MuxerMultistream.new_conn`` builds the library's ``Yamux`` for ``/yamux/1.0.0``
    whatever class was registered, so the upgrader gets a multistream that honours ours.
    """
    upgrader.muxer_multistream = _TunedMuxerMultistream(upgrader.muxer_multistream, tuning)


class _TunedMuxerMultistream(MuxerMultistream):
    def __init__(self, stock: MuxerMultistream, tuning: YamuxTuning) -> None:
        super().__init__(OrderedDict(stock.transports), stock.negotiate_timeout)
        self.tuning = tuning

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        protocol, transport_class = await self._selector.select(
            conn, conn.is_initiator, self.negotiate_timeout
        )
        muxed: IMuxedConn
        if protocol == PROTOCOL_ID:
            muxed = TunedYamux(conn, peer_id, is_initiator=conn.is_initiator, tuning=self.tuning)
        else:
            muxed = transport_class(conn, peer_id)
        return self._annotate_connection(muxed, conn, protocol)


# ============================================================================================
# Noise: one socket write per secure write, buffered socket reads


class _BufferedNoisePackets(NoisePacketReadWriter):
    """Cuts length-prefixed Noise packets from large socket reads (stock: two reads per packet)."""

    def __init__(self, stock: NoisePacketReadWriter) -> None:
        super().__init__(stock.read_write_closer)
        self._buf = bytearray()

    async def read_msg(self) -> bytes:
        buf = self._buf
        while True:
            if len(buf) >= 2:
                end = 2 + ((buf[0] << 8) | buf[1])
                if len(buf) >= end:
                    msg = _take(buf, 2, end)
                    return msg
            chunk = await self.read_write_closer.read(_NOISE_READ_BYTES)
            if not chunk:
                need = 2 + ((buf[0] << 8) | buf[1]) if len(buf) >= 2 else 2
                raise IncompleteReadError(
                    f"Connection closed during read operation: expected {need} bytes but "
                    f"received {len(buf)} bytes",
                    expected_bytes=need,
                    received_bytes=len(buf),
                )
            buf += chunk


def _take(buf: bytearray, start: int, end: int) -> bytes:
    """``bytes(buf[start:end])`` with one copy instead of two, then drop ``buf[:end]``."""
    with memoryview(buf) as view:
        out = view[start:end].tobytes()
    del buf[:end]  # O(1): CPython advances a bytearray's start on prefix deletes
    return out


class _TunedNoiseReadWriter(NoiseTransportReadWriter):
    """The stock transport read-writer (same cipher state), with one socket write per secure write."""

    read_writer: _BufferedNoisePackets

    def __init__(self, stock: NoiseTransportReadWriter) -> None:
        super().__init__(cast(IRawConnection, stock.conn), stock.noise_state)
        self.read_writer = _BufferedNoisePackets(stock.read_writer)

    async def write_msg(self, msg: bytes, prefix_encoded: bool = False) -> None:
        if prefix_encoded:  # handshake-style messages: the library's path
            await super().write_msg(msg, prefix_encoded)
            return
        await self.write_msgs([msg])

    async def write_msgs(self, msgs: list[bytes]) -> None:
        """Seal each message (one Noise message each, longer ones split) and send them in one write."""
        parts: list[bytes] = []
        for msg in msgs:
            for start in range(0, max(len(msg), 1), MAX_PLAINTEXT_LENGTH):
                sealed = self.encrypt(msg[start : start + MAX_PLAINTEXT_LENGTH])
                parts.append(len(sealed).to_bytes(2, "big"))
                parts.append(sealed)
        await self.read_writer.read_write_closer.write(b"".join(parts))


class _EagerLock:
    """A ``trio.Lock`` for ``async with`` whose uncontended acquire does not yield.

    Mutual exclusion and FIFO hand-over are the lock's own; only the scheduler trip of an
    uncontended ``acquire()`` is skipped (the socket operation inside is a checkpoint anyway).
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()


def _tune_noise_session(conn: ISecureConn) -> _TunedNoiseReadWriter | None:
    """Swap the read-writer of a stock Noise session for the tuned one; None if not one.

    Over TCP, the socket wrapper's read and write locks become ``_EagerLock``s: the tuned muxer
    already serialises both directions (one receive loop, one connection write lock), so they are
    never contended and only cost a scheduler trip per socket operation.
    """
    if type(conn) is not SecureSession or type(conn.conn) is not NoiseTransportReadWriter:
        return None
    tuned = _TunedNoiseReadWriter(conn.conn)
    raw = tuned.read_writer.read_write_closer
    if type(raw) is RawConnection and type(raw.stream) is TrioTCPStream:
        tcp: Any = raw.stream  # its locks are typed trio.Lock; ours has the same ``async with`` use
        tcp.read_lock, tcp.write_lock = _EagerLock(), _EagerLock()
    conn.conn = tuned
    return tuned


# ============================================================================================
# Yamux


class TunedYamuxStream(YamuxStream):
    """A Yamux stream with go-yamux window updates, event-driven send-window waits, batched writes."""

    conn: TunedYamux

    def __init__(self, stream_id: int, conn: TunedYamux, is_initiator: bool) -> None:
        super().__init__(stream_id, conn, is_initiator)
        self._tuning = conn.tuning
        self._window_opened: trio.Event | None = None

    # -- flow control --------------------------------------------------------------------------
    def _grant(self, *, force: bool = False) -> int:
        """go-yamux ``GrowTo``: the credit to return, once the consumed part reaches half the window."""
        window = self._tuning.window_bytes
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        delta = window - (self.recv_window + buffered)
        if delta <= 0 or (delta < window // 2 and not force):
            return 0
        self.recv_window += delta
        return delta

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        # the stock read(-1) path lands here: same policy as read(n)
        if not self.recv_closed:
            delta = self._grant()
            if delta:
                await self.send_window_update(delta)

    def _wake_writer(self) -> None:
        if self._window_opened is not None:
            self._window_opened.set()
            self._window_opened = None

    async def _wait_for_send_window(self) -> None:
        with trio.move_on_after(self._tuning.window_wait_s) as scope:
            while self.send_window <= 0 and not self.closed and not self.send_closed:
                if self._window_opened is None:
                    self._window_opened = trio.Event()
                await self._window_opened.wait()
        if scope.cancelled_caught:
            raise MuxedStreamError(
                f"Timed out waiting for window update after {self._tuning.window_wait_s} seconds."
            )

    # -- I/O -----------------------------------------------------------------------------------
    async def write(self, data: bytes) -> None:
        view = memoryview(data).cast("B")
        total, sent = len(view), 0
        while True:
            if self.send_closed:
                raise MuxedStreamError("Stream is closed for sending")
            if sent >= total:
                return
            if self.closed:
                raise MuxedStreamError("Stream is closed")
            if self.send_window <= 0:
                await self._wait_for_send_window()
                continue
            frames: list[bytes] = []
            batch = 0
            while sent < total and self.send_window > 0 and batch < self._tuning.write_batch_bytes:
                n = min(self.send_window, _MAX_DATA_BODY, total - sent)
                frames.append(b"".join((_HEADER.pack(0, TYPE_DATA, 0, self.stream_id, n), view[sent : sent + n])))
                self.send_window -= n
                sent += n
                batch += n
            await self.conn._write_frames(frames)

    async def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            return await super().read(n)
        conn, sid = self.conn, self.stream_id
        while True:
            buffer = conn.stream_buffers.get(sid)
            # the checks and their order are the stock read() + read_stream()
            if self.recv_closed and not buffer:
                raise MuxedStreamReset("Stream was reset") if self.reset_received else MuxedStreamEOF(
                    "Stream is closed for receiving"
                )
            if sid not in conn.streams:
                raise MuxedStreamEOF("Stream closed")
            if conn.event_shutting_down.is_set():
                raise MuxedStreamEOF("Connection shut down")
            if buffer is None:
                if self.reset_received:
                    raise MuxedStreamReset("Stream was reset")
                raise MuxedStreamEOF("Stream buffer closed")
            if buffer and (self.recv_closed or not self.reset_received):
                data = _take(buffer, 0, min(n, len(buffer)))
                if self.closed and not buffer:
                    conn._finalize_stream_locked(self, fully_closed=True)
                break
            if self.reset_received:
                raise MuxedStreamReset("Stream was reset")
            if self.recv_closed:
                raise MuxedStreamEOF("Stream is closed for receiving")
            if self.closed:
                raise MuxedStreamReset("Stream is reset or closed")
            event = conn.stream_events.get(sid)
            if event is None:
                raise MuxedStreamEOF("Stream was removed")
            await event.wait()
            if conn.stream_events.get(sid) is event:
                conn.stream_events[sid] = trio.Event()
        if not self.recv_closed:
            delta = self._grant()
            if delta:
                await self.send_window_update(delta)
        return data

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self._wake_writer()

    async def reset(self) -> None:
        try:
            await super().reset()
        finally:
            self._wake_writer()


class TunedYamux(Yamux):
    """``Yamux`` with a buffered receive loop, tuned streams and lock-free fast paths (see module doc)."""

    def __init__(
        self,
        secured_conn: ISecureConn,
        peer_id: ID,
        is_initiator: bool | None = None,
        on_close: Callable[[], Awaitable[Any]] | None = None,
        *,
        tuning: YamuxTuning = DEFAULT_TUNING,
    ) -> None:
        super().__init__(secured_conn, peer_id, is_initiator, on_close)
        self.tuning = tuning
        self._noise = _tune_noise_session(secured_conn)

    @property
    def noise_tuned(self) -> bool:
        return self._noise is not None

    def _new_stream(self, stream_id: int, *, is_initiator: bool) -> TunedYamuxStream:
        stream = TunedYamuxStream(stream_id, self, is_initiator)
        self.streams[stream_id] = stream
        self.stream_buffers[stream_id] = bytearray()
        self.stream_events[stream_id] = trio.Event()
        return stream

    async def _write_frame(self, data: bytes) -> None:
        await self._write_frames([data])

    async def _write_frames(self, frames: list[bytes]) -> None:
        """Frames in one secure write (one Noise message each when tuned), serialised.

        An uncontended connection lock does not yield (stock: a scheduler trip per frame, plus one
        after it).
        """
        lock = self._write_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            if self._noise is not None:
                await self._noise.write_msgs(frames)
            else:
                await self.secured_conn.write(frames[0] if len(frames) == 1 else b"".join(frames))
        finally:
            lock.release()

    async def open_stream(self) -> TunedYamuxStream:
        await self.stream_backlog_semaphore.acquire()
        async with self.streams_lock:
            if self.event_shutting_down.is_set():
                self.stream_backlog_semaphore.release()
                raise MuxedStreamError("Connection is shutting down")
            stream_id = self.next_stream_id
            self.next_stream_id += 2
            stream = self._new_stream(stream_id, is_initiator=True)
            stream._owns_backlog_slot = True
            delta = stream._grant(force=True)
        try:
            await self._write_frame(_HEADER.pack(0, TYPE_WINDOW_UPDATE, FLAG_SYN, stream_id, delta))
            return stream
        except Exception as exc:
            self.stream_backlog_semaphore.release()
            stream._backlog_slot_released = True
            self.streams.pop(stream_id, None)
            self.stream_buffers.pop(stream_id, None)
            self.stream_events.pop(stream_id, None)
            raise MuxedStreamError(f"Failed to send SYN: {exc}") from exc

    async def close(self, error_code: int = GO_AWAY_NORMAL) -> None:
        streams = list(self.streams.values())
        try:
            await super().close(error_code)
        finally:
            _wake_writers(streams)

    async def _cleanup_on_error(self) -> None:
        streams = list(self.streams.values())
        try:
            await super()._cleanup_on_error()
        finally:
            _wake_writers(streams)

    # -- receive loop ----------------------------------------------------------------------------
    async def handle_incoming(self) -> None:
        reader = _PlaintextReader(self.secured_conn, self.tuning.data_body_timeout_s)
        try:
            while not self.event_shutting_down.is_set():
                header = await reader.read_exactly(HEADER_SIZE, body=False)
                _version, typ, flags, stream_id, length = _HEADER.unpack(header)
                body = b""
                if typ == TYPE_DATA and length:
                    if length > MAX_WINDOW_SIZE:
                        log.warning(
                            "yamux: %s announced a DATA frame of %d bytes on stream %d; closing",
                            self.peer_id, length, stream_id,
                        )
                        break
                    body = await reader.read_exactly(length, body=True)
                if not await self._on_frame(typ, flags, stream_id, length, body):
                    break
            else:
                return  # shutting down: whoever set the flag closes the connection
        except IncompleteReadError as exc:
            if exc.is_clean_close:
                log.debug("yamux connection closed by %s", self.peer_id)
            else:
                log.warning("yamux connection to %s ended mid-frame: %s", self.peer_id, exc)
        except trio.TooSlowError:
            log.warning("yamux: timed out reading a DATA frame body from %s; closing", self.peer_id)
        except Exception as exc:  # socket, Noise or channel errors: the connection is gone
            log.debug("yamux connection to %s failed: %r", self.peer_id, exc)
        self.event_shutting_down.set()
        await self._cleanup_on_error()

    async def _on_frame(self, typ: int, flags: int, stream_id: int, length: int, body: bytes) -> bool:
        """Apply one frame; False when the connection must close."""
        if typ == TYPE_DATA or typ == TYPE_WINDOW_UPDATE:
            if flags & FLAG_SYN:
                await self._on_syn(typ, flags, stream_id, length, body)
                return True
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._apply(stream, typ, flags, length, body)
                if stream.closed:
                    self._finalize_stream_locked(stream, fully_closed=True)
            return True
        if typ == TYPE_PING:
            if flags & FLAG_SYN:
                await self._write_frame(_HEADER.pack(0, TYPE_PING, FLAG_ACK, 0, length))
            elif flags & FLAG_ACK:
                rtt = trio.current_time() - self._ping_sent_time
                self._rtt = rtt if self._rtt == 0.0 else (self._rtt + rtt) / 2
                self._ping_event.set()
            return True
        if typ == TYPE_GO_AWAY:
            log.debug("yamux: %s sent GO_AWAY (%s)", self.peer_id, _GO_AWAY_REASONS.get(length, length))
            return False
        return True  # unknown frame type: ignored, as the stock muxer does

    def _apply(self, stream: YamuxStream, typ: int, flags: int, length: int, body: bytes) -> None:
        """DATA payload, window credit, FIN and RST for a known stream (no await: no lock needed)."""
        sid = stream.stream_id
        if typ == TYPE_DATA:
            if body:
                self.stream_buffers[sid] += body
                stream.recv_window -= len(body)
                if stream.recv_window < 0:
                    log.warning("yamux stream %d: %s exceeded the receive window by %d bytes",
                                sid, self.peer_id, -stream.recv_window)
                    stream.recv_window = 0
        elif length:
            stream.send_window += length
            _wake_writers((stream,))
        if flags & FLAG_FIN:
            stream.recv_closed = True
            if stream.send_closed:
                stream.closed = True
        if flags & FLAG_RST:
            stream.closed = True
            stream.reset_received = True
            _wake_writers((stream,))
        if typ == TYPE_DATA or flags & (FLAG_FIN | FLAG_RST):
            event = self.stream_events.get(sid)
            if event is not None:
                event.set()

    async def _on_syn(self, typ: int, flags: int, stream_id: int, length: int, body: bytes) -> None:
        if stream_id in self.streams:  # a second SYN for a live stream: refuse it
            await self._write_frame(_HEADER.pack(0, TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0))
            return
        stream = self._new_stream(stream_id, is_initiator=False)
        self._apply(stream, typ, flags & (FLAG_FIN | FLAG_RST), length, body)
        if stream.closed:
            self._finalize_stream_locked(stream, fully_closed=True)
        if not flags & FLAG_RST:  # a stream reset on arrival is delivered but not acknowledged
            delta = stream._grant(force=True)
            await self._write_frame(_HEADER.pack(0, TYPE_WINDOW_UPDATE, FLAG_ACK, stream_id, delta))
        await self.new_stream_send_channel.send(stream)


def _wake_writers(streams: tuple[YamuxStream, ...] | list[YamuxStream]) -> None:
    for stream in streams:
        if isinstance(stream, TunedYamuxStream):
            stream._wake_writer()


class _PlaintextReader:
    """Exact reads from a secure connection's plaintext, buffered (no await when bytes are at hand)."""

    def __init__(self, conn: ISecureConn, body_timeout_s: float) -> None:
        self._conn = conn
        self._buf = bytearray()
        self._body_timeout_s = body_timeout_s

    async def read_exactly(self, n: int, *, body: bool) -> bytes:
        buf = self._buf
        if len(buf) < n:
            if body:  # an announced body must arrive within the bound, as in the stock muxer
                with trio.fail_after(self._body_timeout_s):
                    await self._fill(n)
            else:
                await self._fill(n)
        return _take(buf, 0, n)

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            chunk = await self._conn.read()  # one decrypted Noise message, or what is buffered
            if not chunk:
                raise IncompleteReadError(
                    f"Connection closed during read operation: expected {n} bytes but received "
                    f"{len(self._buf)} bytes",
                    expected_bytes=n,
                    received_bytes=len(self._buf),
                )
            self._buf += chunk
