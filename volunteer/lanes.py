"""The volunteer's data lanes (shell): dialled when an authorised coordinator offers one, each
served by a thread of its own (``swarm.rpc.lane`` has the wire and why).

Rules:
- An offer (``LaneOffer`` on an expert stream, answered with one ``LaneAnswer``) is taken only from a
  peer ``authorize`` allows (the stream's screen checked it too), to a host this volunteer knows as a
  coordinator's (``known_hosts``: the hosts of the coordinator URLs the market's assignments or
  ``--coordinator`` named; a lane cannot be aimed at anything else), while fewer than ``max_lanes``
  are open. A peer's new lane replaces its old one.
- The lane is dialled from trio (``connect_timeout_s``) and its handshake sent before the answer
  says ``ok``; then a worker thread serves the socket (``trio.to_thread``, a limiter of
  ``max_lanes``): records in, each request answered in order, computed at once on that thread
  (``ExpertServer.compute_sync``, under the server's one compute lock).
- Every request is judged as on a stream: the peer still authorised, the header valid for its
  payload, the pairs valid; a bad frame is answered with an error and the lane goes on. A record
  that does not open ends the lane. ``Cancel`` frames are read and dropped: a lane computes its
  requests in order, so by the time one is read its request has been answered.
- Bytes held are bounded by the server's ``ByteBudget`` as they arrive (a record's bytes are taken
  when received and given back once answered or when the lane ends, however it ends): past it the
  lane ends, and the coordinator's calls fall back to its stream.
- ``--cpu-limit``'s duty cycle holds on the lanes too: after a computation, no lane computes again
  before the rest it calls for.
- The lanes end with ``serve``: each socket is shut down, so its thread's read returns.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from swarm.errors import WireError
from swarm.protocol.expert import (
    DEFAULT_LIMITS,
    Cancel,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    Hello,
    LaneAnswer,
    LaneOffer,
    Pairs,
    Status,
    WireLimits,
    decode_pairs,
    encode_frame,
    rows_region,
    validate_request,
)
from swarm.rpc.lane import LaneBroken, Opener, Sealer, derive_keys, handshake, parse_frame
from swarm.rpc.server import Authorize, BudgetAccount, ByteBudget, Computed, expert_answer
from swarm.rpc.tensors import payload_to_tensor
from volunteer.core.preferences import rest_after

__all__ = ["LaneCompute", "VolunteerLanes"]

log = logging.getLogger(__name__)

_RECV = 1 << 16


@dataclass(eq=False)
class _Lane:
    peer: str
    sock: socket.socket
    sealer: Sealer
    opener: Opener
    account: BudgetAccount
    opened_at: float = field(default_factory=time.monotonic)
    requests: int = 0

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LaneCompute(Protocol):
    """What a lane computes with (an ``ExpertServer``): a request answered on the calling thread."""

    def compute_sync(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> Computed | torch.Tensor: ...

    def hello(self) -> Hello: ...


class VolunteerLanes:
    def __init__(self, server: LaneCompute, *, authorize: Authorize, known_hosts: Callable[[], set[str]],
                 budget: ByteBudget | None = None, limits: WireLimits = DEFAULT_LIMITS, max_lanes: int = 8,
                 connect_timeout_s: float = 5.0, duty: float = 1.0) -> None:
        """``duty`` (``--cpu-limit``): the share of the time a lane may compute; it rests after each
        computation to hold it (``volunteer.core.preferences.rest_after``, as the stream's ``DutyCycle``)."""
        self.server = server
        self.duty = duty
        self._resume_at = 0.0  # monotonic: no lane computes before (the duty cycle's rest; shared by the lanes)
        self.authorize = authorize
        self.known_hosts = known_hosts
        self.budget = budget if budget is not None else ByteBudget()
        self.limits = limits
        self.max_lanes = max_lanes
        self.connect_timeout_s = connect_timeout_s
        self.dtypes = list(server.hello().dtypes)
        self.lanes: dict[str, _Lane] = {}
        self.opened = 0  # lanes dialled, in all
        self._limiter = trio.CapacityLimiter(max_lanes)
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for lane in list(self.lanes.values()):
                    lane.shutdown()

    async def offer(self, offer: LaneOffer, peer: str) -> LaneAnswer:
        """The ``Lanes`` handler of the expert stream (``set_expert_handlers(lanes=...)``)."""

        def answer(status: str, message: str = "") -> LaneAnswer:
            return LaneAnswer(request_id=offer.request_id, attempt=offer.attempt, status=status, message=message)

        if self._nursery is None:
            return answer(Status.UNSUPPORTED, "this volunteer's lanes are not running")
        if not self.authorize(peer):
            return answer(Status.NOT_AUTHORIZED, f"peer {peer} is not a coordinator this volunteer serves")
        if offer.host not in self.known_hosts():
            return answer(Status.NOT_AUTHORIZED, f"{offer.host!r} is not the host of a coordinator this volunteer knows")
        if peer not in self.lanes and len(self.lanes) >= self.max_lanes:
            return answer(Status.BUSY, f"{len(self.lanes)} lanes open already")
        try:
            with trio.fail_after(self.connect_timeout_s):
                stream = await trio.open_tcp_stream(offer.host, offer.port)
        except (OSError, trio.TooSlowError) as exc:
            return answer(Status.INTERNAL_ERROR, f"could not dial {offer.host}:{offer.port}: {type(exc).__name__}")
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with trio.fail_after(self.connect_timeout_s):
                await stream.send_all(handshake(offer.lane_id))
        except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            await stream.aclose()
            return answer(Status.INTERNAL_ERROR, f"lane handshake to {offer.host}:{offer.port} failed: {type(exc).__name__}")
        sock = socket.socket(fileno=stream.socket.detach())  # the lane's thread owns it from here
        sock.setblocking(True)
        c2v, v2c = derive_keys(offer.secret, offer.lane_id)
        lane = _Lane(peer, sock, Sealer(v2c), Opener(c2v, self.limits.max_frame_bytes + 64),
                     self.budget.account(peer))
        old = self.lanes.pop(peer, None)
        if old is not None:
            old.shutdown()
        self.lanes[peer] = lane
        self.opened += 1
        self._nursery.start_soon(self._run, lane)
        log.info("data lane to coordinator %s open (%s:%d)", peer, offer.host, offer.port)
        return answer(Status.OK)

    async def _run(self, lane: _Lane) -> None:
        try:
            async with trio.open_nursery() as nursery:

                async def closer() -> None:
                    try:
                        await trio.sleep_forever()
                    finally:
                        lane.shutdown()  # the thread's read returns

                nursery.start_soon(closer)
                await trio.to_thread.run_sync(self._serve_blocking, lane, limiter=self._limiter)
                nursery.cancel_scope.cancel()
        finally:
            lane.account.close()
            lane.sock.close()
            if self.lanes.get(lane.peer) is lane:
                del self.lanes[lane.peer]
            log.info("data lane to coordinator %s closed after %d requests", lane.peer, lane.requests)

    def _serve_blocking(self, lane: _Lane) -> None:
        """The lane's thread: records in, answers out, until the lane ends."""
        buf = bytearray(_RECV)
        view = memoryview(buf)
        try:
            while True:
                n = lane.sock.recv_into(buf)
                if n == 0:
                    return
                if not lane.account.take(n):
                    log.warning("data lane of %s: over the byte budget; closing it", lane.peer)
                    return
                lane.opener.feed(view[:n])
                for frame in lane.opener.frames():
                    out = self._answer(lane, frame)
                    if out is not None:
                        lane.sock.sendall(lane.sealer.seal(out))
                lane.account.give(lane.account.held - lane.opener.buffered)  # answered records' bytes
        except LaneBroken as exc:
            log.warning("data lane of %s broken: %s", lane.peer, exc.message)
        except OSError as exc:
            log.debug("data lane of %s ended: %r", lane.peer, exc)

    def _answer(self, lane: _Lane, frame: bytearray) -> bytes | None:
        """One opened frame's answer (None for a ``Cancel``)."""
        arrived = time.perf_counter()
        try:
            msg, payload = parse_frame(frame, self.limits)
        except WireError as exc:
            return encode_frame(ErrorReply(code=exc.code, message=exc.message))
        if isinstance(msg, Cancel):
            return None
        if not isinstance(msg, ExpertRequest):
            return encode_frame(ErrorReply(code=Status.UNEXPECTED_MESSAGE,
                                           message=f"a {type(msg).__name__} on a data lane"))
        lane.requests += 1
        if not self.authorize(lane.peer):
            return encode_frame(ExpertResponse(request_id=msg.request_id, attempt=msg.attempt,
                                               status=Status.NOT_AUTHORIZED,
                                               message=f"peer {lane.peer} is not a coordinator this volunteer serves"))
        try:
            validate_request(msg, len(payload), limits=self.limits, dtypes=self.dtypes)
            pairs = decode_pairs(msg, payload)
            rows = payload_to_tensor(rows_region(msg, payload), msg.dtype, msg.n_rows, msg.d_model)
        except WireError as exc:
            return encode_frame(ExpertResponse(request_id=msg.request_id, attempt=msg.attempt, status=exc.code,
                                               message=exc.message))
        wait = self._resume_at - time.monotonic()
        if wait > 0:  # the duty cycle's rest after the last computation (the owner's --cpu-limit)
            time.sleep(wait)
        try:
            result = self.server.compute_sync(msg, rows, pairs)
        except Exception as exc:  # refusals keep their codes (draining, slice_not_held); the rest internal_error
            resp, out = expert_answer(msg, exc, lane.peer, served_s=0.0)
        else:
            resp, out = expert_answer(msg, result, lane.peer, served_s=time.perf_counter() - arrived)
            rest = rest_after(result.compute_s if isinstance(result, Computed) else 0.0, self.duty)
            self._resume_at = max(self._resume_at, time.monotonic() + rest)
        return encode_frame(resp, out)
