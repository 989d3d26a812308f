"""The coordinator's data lanes (shell): the listener volunteers dial, the offers that invite them,
and each lane driven by the engine's thread (``swarm.rpc.lane`` has the wire and why).

Rules:
- Trio side (``LaneHub``): ``serve`` listens; a connection has ``handshake_timeout_s`` to present the
  id of an offer this hub made (``offer``: a fresh id and secret per offer, for one peer, valid for
  ``offer_ttl_s``, used once) -- anything else is closed unanswered; at most ``max_handshakes`` at
  once. A matched connection becomes its peer's lane (an older lane of the peer is dropped).
- Driver side (``LaneDriver``, the engine's thread: once a lane is live, no other thread reads or
  writes its socket): ``send`` seals a wire call and writes it (``write_timeout_s`` bounds a blocked
  write); the driver's waker (``coordinator.dispatch.layer.ThreadWaker``) selects on the lanes'
  sockets and hands the readable ones to ``poll``, which reads the answers and turns them into the
  core's events (``Executor.finish``: the same as an answer on the stream); ``poll`` also fires the
  dispatch timers that are due (``Executor.due_timers``), so a layer on lanes needs no trio thread.
- A lane that fails (closed, a record that does not open, an answer nobody asked for, a write that
  times out) is dropped; its calls in flight fail (``BrokenError``: the core falls back as for any
  failed call). Trio may ``drop`` a lane (the map dropped its peer); the driver closes it at its
  next wait. A dropped peer is offered a new lane after ``retry_s``.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from coordinator.core.events import Event
from coordinator.dispatch.executor import Executor, WireCall
from swarm.errors import BrokenError, LocalProtocolError, RemoteProtocolError, SwarmError, WireError
from swarm.protocol.expert import (
    DEFAULT_LIMITS,
    LANE_ID_BYTES,
    LANE_SECRET_BYTES,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    Hello,
    RequestKey,
    WireLimits,
)
from swarm.rpc.client import answer_array, encode_call
from swarm.rpc.lane import (
    HANDSHAKE_BYTES,
    LaneBroken,
    Opener,
    Sealer,
    derive_keys,
    parse_frame,
    parse_handshake,
)

__all__ = ["Lane", "LaneDriver", "LaneHub"]

log = logging.getLogger(__name__)

_READ = 1 << 20


@dataclass(eq=False)
class _Pending:
    wire: WireCall
    req: ExpertRequest  # as sent (its dtype the one both sides speak)
    sent_at: float  # perf_counter


@dataclass(eq=False)
class Lane:
    peer: str
    sock: socket.socket
    sealer: Sealer
    opener: Opener
    hello: Hello  # the peer's Hello on its expert stream: the dtypes and limits it accepts
    pending: dict[RequestKey, _Pending] = field(default_factory=dict)
    # one driver at a time reads or writes it (the engine's thread; a second driving thread, as tests
    # may have, waits here instead of interleaving records)
    io: threading.Lock = field(default_factory=threading.Lock)
    dead: str = ""  # why it ended ("": live)
    sent: int = 0
    answered: int = 0
    opened_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Offer:
    peer: str
    secret: bytes
    hello: Hello
    expires: float  # trio clock


class LaneHub:
    def __init__(self, *, host: str, port: int = 0, announce_host: str | None = None, announce_port: int | None = None,
                 limits: WireLimits = DEFAULT_LIMITS, offer_ttl_s: float = 15.0, handshake_timeout_s: float = 5.0,
                 max_handshakes: int = 16, retry_s: float = 10.0) -> None:
        """``host``/``port``: where to listen (port 0: any free one); ``announce_host``/``announce_port``:
        the address offers name (default: ``host`` and the bound port)."""
        self.host, self.port = host, port
        self.announce_host, self.announce_port = announce_host, announce_port
        self.limits = limits
        self.offer_ttl_s = offer_ttl_s
        self.handshake_timeout_s = handshake_timeout_s
        self.retry_s = retry_s
        self.lock = threading.Lock()  # ``lanes``: trio adds and marks, the driver reads and closes
        self.lanes: dict[str, Lane] = {}
        self.address: tuple[str, int] | None = None  # what offers name, once listening
        self.opened = 0
        self.refused = 0  # connections closed without a lane (no, stale or reused offer id; too slow)
        self.lane_opened = trio.Event()  # set (and replaced) whenever a lane opens
        self._offers: dict[bytes, _Offer] = {}
        self._handshakes = trio.CapacityLimiter(max_handshakes)
        self._retry_at: dict[str, float] = {}

    # -- trio side ----------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        bound = listeners[0].socket.getsockname()
        self.address = (self.announce_host or self.host, self.announce_port or int(bound[1]))
        log.info("data lanes: listening on %s:%d, offering %s:%d", self.host, bound[1], *self.address)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self.address)
                await trio.serve_listeners(self._accept, listeners, handler_nursery=nursery)
        finally:
            with self.lock:
                for lane in self.lanes.values():
                    lane.dead = lane.dead or "the coordinator stopped"
                    _close(lane.sock)

    def offer(self, peer: str, hello: Hello, now: float) -> tuple[bytes, bytes, str, int] | None:
        """A fresh (lane id, secret, host, port) for ``peer``'s next lane; None while not listening or
        while a failed peer waits out ``retry_s``."""
        if self.address is None or now < self._retry_at.get(peer, 0.0):
            return None
        for k in [k for k, o in self._offers.items() if o.expires <= now]:
            del self._offers[k]
        lane_id, secret = secrets.token_bytes(LANE_ID_BYTES), secrets.token_bytes(LANE_SECRET_BYTES)
        self._offers[lane_id] = _Offer(peer, secret, hello, now + self.offer_ttl_s)
        self._retry_at[peer] = now + self.retry_s
        return lane_id, secret, self.address[0], self.address[1]

    def live(self, peer: str) -> Lane | None:
        lane = self.lanes.get(peer)
        return lane if lane is not None and not lane.dead else None

    def wants_offer(self, peer: str, now: float) -> bool:
        return self.live(peer) is None and now >= self._retry_at.get(peer, 0.0) and self.address is not None

    def drop(self, peer: str, why: str) -> None:
        """(Trio) ``peer``'s lane is to end: marked here, closed by the driver."""
        with self.lock:
            lane = self.lanes.get(peer)
            if lane is not None and not lane.dead:
                lane.dead = why

    async def _accept(self, stream: trio.SocketStream) -> None:
        async with self._handshakes:
            data = b""
            with trio.move_on_after(self.handshake_timeout_s):
                try:
                    while len(data) < HANDSHAKE_BYTES:
                        got = await stream.receive_some(HANDSHAKE_BYTES - len(data))
                        if not got:
                            break
                        data += got
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            try:
                lane_id = parse_handshake(data)
            except LaneBroken:
                lane_id = b""
            off = self._offers.pop(lane_id, None)
            if off is None or off.expires <= trio.current_time():
                self.refused += 1
                await stream.aclose()
                return
            sock = socket.socket(fileno=stream.socket.detach())  # the driver's from here
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c2v, v2c = derive_keys(off.secret, lane_id)
        lane = Lane(off.peer, sock, Sealer(c2v), Opener(v2c, self.limits.max_frame_bytes + 64), off.hello)
        with self.lock:
            old = self.lanes.get(off.peer)
            if old is not None and not old.dead:
                old.dead = "replaced by a newer lane"
            self.lanes[off.peer] = lane  # an old lane's socket is closed by the driver (it may be polling it)
            self._retry_at.pop(off.peer, None)
            self.opened += 1
        log.info("data lane from %s open", off.peer)
        self.lane_opened.set()
        self.lane_opened = trio.Event()


class LaneDriver:
    """The engine thread's side of the lanes (and the ``WaitSource`` of its waker)."""

    def __init__(self, hub: LaneHub, executor: Executor, handle: Callable[[list[Event], bool], None],
                 now: Callable[[], float], *, our_dtypes: Iterable[str], write_timeout_s: float = 5.0) -> None:
        self.hub = hub
        self.executor = executor
        self._handle = handle
        self._now = now
        self.our_dtypes = list(our_dtypes)
        self.write_timeout_s = write_timeout_s
        self._closing: list[Lane] = []
        self.failures = 0

    # -- sending ------------------------------------------------------------------------------------
    def lane_for(self, peer: str) -> Lane | None:
        return self.hub.live(peer)

    def send(self, lane: Lane, w: WireCall) -> list[Event]:
        """Write ``w`` on ``lane`` (registered first, so its answer finds it); events if it failed."""
        try:
            req, frame = encode_call(w.req, w.x, w.pairs, self.our_dtypes, lane.hello, self.hub.limits)
        except LocalProtocolError as exc:
            return self.executor.finish(w, exc, 0.0)
        key = (req.request_id, req.attempt)
        self.executor.started(w, lane=True)
        with lane.io:
            lane.pending[key] = _Pending(w, req, time.perf_counter())
            try:
                _send_all(lane.sock, lane.sealer.seal(frame), self.write_timeout_s)
            except OSError as exc:
                failed = f"write failed: {type(exc).__name__}: {exc}"
            else:
                failed = ""
        if failed:
            return self._kill(lane, failed)
        lane.sent += 1
        if w.call is not None:
            w.call.timing.sent = w.call.timing.sent or time.perf_counter()
        return []

    # -- the waker's source -----------------------------------------------------------------------
    def sockets(self) -> list[socket.socket]:
        with self.hub.lock:
            out = []
            for lane in self.hub.lanes.values():
                if lane.dead:
                    if lane not in self._closing:
                        self._closing.append(lane)
                else:
                    out.append(lane.sock)
        return out

    def timeout(self) -> float | None:
        at = self.executor.next_timer()
        return None if at is None else max(0.0, at - self._now())

    def poll(self, ready: Iterable[socket.socket]) -> None:
        """Read the ready lanes' answers, close the dropped ones, fire the due timers."""
        events: list[Event] = []
        socks = set(ready)
        with self.hub.lock:
            lanes = [lane for lane in self.hub.lanes.values() if lane.sock in socks and not lane.dead]
        for lane in lanes:
            with lane.io:
                events += self._read(lane)
        for lane in self._closing:
            events += self._kill(lane, lane.dead or "dropped")
        self._closing.clear()
        if events:
            self._handle(events, False)
        due = self.executor.due_timers(self._now())
        if due:
            self._handle(due, False)

    def ready_now(self) -> list[socket.socket]:
        """The lanes with bytes waiting (a zero-timeout select): read before a driver blocks."""
        socks = self.sockets()
        if not socks:
            return []
        r, _, _ = select.select(socks, [], [], 0)
        return r

    # -- reading ------------------------------------------------------------------------------------
    def _read(self, lane: Lane) -> list[Event]:
        events: list[Event] = []
        try:
            while True:
                try:
                    data = lane.sock.recv(_READ)
                except BlockingIOError:
                    break
                if not data:
                    return events + self._kill(lane, "closed by the volunteer")
                lane.opener.feed(data)
                for frame in lane.opener.frames():
                    events += self._answer(lane, frame)
                if len(data) < _READ:
                    break
        except (OSError, LaneBroken) as exc:
            return events + self._kill(lane, f"{type(exc).__name__}: {exc}")
        except RemoteProtocolError as exc:  # an answer nobody asked for: the lane cannot be trusted to go on
            return events + self._kill(lane, exc.message)
        return events

    def _answer(self, lane: Lane, frame: bytearray) -> list[Event]:
        try:
            msg, payload = parse_frame(frame, self.hub.limits)
        except WireError as exc:
            raise RemoteProtocolError(f"{lane.peer} sent a bad frame on its lane: {exc.message}") from exc
        if isinstance(msg, ErrorReply) and msg.request_id is None:
            log.warning("%s sent an error on its lane: %s (%s)", lane.peer, msg.message, msg.code)
            return []
        if not isinstance(msg, ExpertResponse | ErrorReply) or msg.request_id is None or msg.attempt is None:
            raise RemoteProtocolError(f"{lane.peer} sent a {type(msg).__name__} on its lane")
        key = (int(msg.request_id), int(msg.attempt))
        p = lane.pending.pop(key, None)
        if p is None:  # a late answer of a call given up on, or one never asked: dropped
            return []
        lane.answered += 1
        latency = time.perf_counter() - p.sent_at
        if isinstance(msg, ErrorReply):
            return self.executor.finish(p.wire, RemoteProtocolError(f"{lane.peer}: {msg.message}", code=msg.code),
                                        latency)
        try:
            y = answer_array(lane.peer, p.req, msg, bytearray(payload))
        except SwarmError as exc:
            return self.executor.finish(p.wire, exc, latency)
        return self.executor.finish(p.wire, (y, msg), latency)

    def _kill(self, lane: Lane, why: str) -> list[Event]:
        """The lane is over: its calls in flight fail, its socket closes, its peer may be offered another."""
        with self.hub.lock:
            lane.dead = lane.dead or why
            if self.hub.lanes.get(lane.peer) is lane:
                del self.hub.lanes[lane.peer]
        _close(lane.sock)
        self.failures += 1
        log.info("data lane of %s closed: %s (%d sent, %d answered)", lane.peer, why, lane.sent, lane.answered)
        events: list[Event] = []
        pending, lane.pending = lane.pending, {}
        for p in pending.values():
            events += self.executor.finish(p.wire, BrokenError(f"the data lane of {lane.peer} ended: {why}"), 0.0)
        return events


def _send_all(sock: socket.socket, data: bytes | bytearray, timeout_s: float) -> None:
    """Write all of ``data`` on a non-blocking socket, waiting for room at most ``timeout_s`` in all."""
    view = memoryview(data)
    deadline: float | None = None
    while view:
        try:
            n = sock.send(view)
        except BlockingIOError:
            n = 0
        view = view[n:]
        if view:
            now = time.monotonic()
            deadline = deadline if deadline is not None else now + timeout_s
            if now >= deadline:
                raise TimeoutError(f"{len(view)} bytes not written within {timeout_s:g} s")
            select.select([], [sock], [], deadline - now)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
