"""The client side of the expert stream ``/moe-swarm/expert/2`` (shell: trio tasks, no policy).

``open_expert_client`` keeps one long-lived stream per peer and pipelines calls over it (a stream
per call would cost a multistream negotiation each: py-libp2p fact (c)). The server side is
``swarm.rpc.server``; the two share only the wire (``swarm.protocol.expert``).

Rules:
- One stream per peer, opened lazily under the first caller's deadline and re-opened by the next
  call after it breaks. A reader task routes answers to waiting callers by
  ``(request_id, attempt)``; an answer nobody waits for (late, expired, duplicate) is dropped.
  A writer task sends frames whole, so a caller's cancellation never cuts a frame in half (a call
  that finds nothing being written or queued writes its frame itself, shielded: one hop less); a
  frame whose caller gave up before it was sent is not sent at all; a call abandoned after its
  frame left (the caller's cancel scope -- a hedge's loser -- or its timeout) sends a ``Cancel``
  for it, best effort (dropped if the send queue is full), and the ``cancelled`` answer is dropped.
- Answer bytes are bounded by what we asked: the reader buffers an answer's payload only if it
  is no larger than the largest answer a pending call expects (``n_pairs x d_model x itemsize``);
  a larger one is discarded as it arrives and fails its call (``busy``).
- ``prove_hold`` sends a ``HoldChallenge`` and returns its ``HoldProof``; to a peer whose Hello
  does not offer ``FEATURE_HOLD_PROOF`` (an older volunteer) it sends nothing and answers
  ``unsupported`` at once.
- A call is a header, the rows and the pairs as flat arrays (``Pairs``, from
  ``swarm.rpc.tensors.pairs_from_tensors``): validated here exactly as the server validates them.
- Errors: ``TransportTimeout`` (deadline), ``BrokenError`` (the stream died under the call),
  ``ClosedError`` (client closed), ``DialError`` (could not open), ``Refused`` (the peer declined
  on purpose: ``draining``, ``slice_not_held``, ``not_authorized``), ``RemoteProtocolError`` (error answer, wrong
  shape, NaN/inf, bad frame), ``LocalProtocolError`` (the request itself is invalid or beyond the
  peer's limits). Retry and hedging policy belongs to the caller.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import numpy as np
import torch
import trio

from swarm.errors import (
    BadShape,
    BrokenError,
    ClosedError,
    LocalProtocolError,
    NonFinite,
    ReceiverBusy,
    RemoteProtocolError,
    SwarmError,
    TransportTimeout,
    UnexpectedMessage,
    VersionMismatch,
    WireError,
    remote_error,
)
from swarm.p2p.transport import Stream, Transport, quietly
from swarm.protocol.expert import (
    DEFAULT_AGENT,
    DEFAULT_LIMITS,
    FEATURE_HOLD_PROOF,
    FEATURE_LANE,
    PROTOCOL_ID,
    PROTOCOL_VERSION,
    SUPPORTED_DTYPES,
    Cancel,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    FrameReader,
    Hello,
    HoldChallenge,
    HoldProof,
    LaneAnswer,
    LaneOffer,
    Pairs,
    RequestId,
    RequestKey,
    Status,
    WireLimits,
    answer_rows,
    check_pairs,
    choose_dtype,
    encode_frame,
    encode_request_payload,
    itemsize,
    make_hello,
    request_payload_len,
    validate_request,
    version_mismatch_message,
)
from swarm.rpc.tensors import payload_to_array, rows_to_payload

log = logging.getLogger(__name__)

__all__ = ["ExpertClient", "answer_array", "encode_call", "open_expert_client"]



_A = TypeVar("_A", HoldProof, LaneAnswer)


@dataclass(eq=False)
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    response: ExpertResponse | HoldProof | LaneAnswer | ErrorReply | None = None
    payload: bytearray | None = None
    error: SwarmError | None = None
    sent: bool = False  # the request frame went (or is going) out: abandoning it sends a Cancel


@dataclass(eq=False)
class _Outgoing:
    key: RequestKey
    waiter: _Waiter | None  # None: a Cancel frame, always sent
    frame: bytes


def _copy(error: SwarmError) -> SwarmError:
    """A fresh exception per caller: one instance raised in several tasks would tangle tracebacks."""
    return type(error)(error.message, code=error.code)


class _Session:
    """One open stream: its peer's Hello, callers waiting for answers, and the tasks serving it."""

    def __init__(self, stream: Stream, server_hello: Hello, reader: FrameReader, queue_size: int,
                 expected: dict[RequestKey, int]) -> None:
        self.stream = stream
        self.hello = server_hello
        self.reader = reader
        self.pending: dict[RequestKey, _Waiter] = {}
        self.expected = expected  # answer payload bytes of each pending call (what the reader admits)
        self.send_channel, self.receive_channel = trio.open_memory_channel[_Outgoing](queue_size)
        self.dead: SwarmError | None = None
        self.cancel_scope = trio.CancelScope()
        self.writing = False  # a frame is being written (by the writer task or a caller)

    def kill(self, error: SwarmError) -> None:
        """Mark dead, fail every waiting caller with its own copy of ``error``, stop the tasks."""
        if self.dead is None:
            self.dead = error
        for waiter in self.pending.values():
            waiter.error = _copy(error)
            waiter.event.set()
        self.pending.clear()
        self.send_channel.close()
        self.cancel_scope.cancel()

    async def run(self, peer: str) -> None:
        with self.cancel_scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._guarded, self._write_loop(), peer)
                    await self._guarded(self._read_loop(peer), peer)
            finally:
                self.kill(BrokenError(f"stream to {peer} closed"))
                await quietly(self.stream.aclose, f"closing the expert stream to {peer}", timeout_s=1, shield=True)

    async def _guarded(self, loop: Awaitable[None], peer: str) -> None:
        try:
            await loop
        except SwarmError as exc:
            log.debug("expert stream to %s failed: %r", peer, exc)
            self.kill(exc)

    async def _write_loop(self) -> None:
        async for item in self.receive_channel:
            if item.waiter is not None:
                if self.pending.get(item.key) is not item.waiter:
                    continue  # the caller gave up before the frame left: do not send it
                item.waiter.sent = True
            self.writing = True  # set before the first checkpoint: a caller never writes in between
            try:
                await self.stream.write(item.frame)
            finally:
                self.writing = False

    def can_write_now(self) -> bool:
        """No frame is being written or waiting: a caller may write its own frame at once."""
        return (not self.writing and self.dead is None
                and self.receive_channel.statistics().current_buffer_used == 0)

    async def write_now(self, waiter: _Waiter, frame: bytes) -> None:
        """Write one frame from the caller's task (shielded: a frame is never cut in half); a
        broken stream kills the session like the writer's failure would."""
        self.writing = True
        waiter.sent = True
        try:
            with trio.CancelScope(shield=True):
                await self.stream.write(frame)
        except SwarmError as exc:
            self.kill(exc)
        finally:
            self.writing = False

    def cancel_nowait(self, key: RequestKey) -> bool:
        """Queue a ``Cancel`` for ``key`` (best effort: False if the stream is dead or the queue full)."""
        if self.dead is not None:
            return False
        frame = encode_frame(Cancel(request_id=RequestId(key[0]), attempt=key[1]))
        try:
            self.send_channel.send_nowait(_Outgoing(key, None, frame))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    async def _read_loop(self, peer: str) -> None:
        while True:
            try:
                got = await self.reader.receive_message()
            except ReceiverBusy as exc:  # an answer larger than any we wait for: discarded unread
                self.reader.take_admitted()
                if exc.request_id is not None and exc.attempt is not None:
                    self._resolve((exc.request_id, exc.attempt), error=BadShape(
                        f"{peer} sent an answer larger than asked for ({exc.message})", code="bad_shape"))
                continue
            except WireError as exc:
                if exc.request_id is not None and exc.attempt is not None and not exc.fatal:
                    self._resolve((exc.request_id, exc.attempt), error=exc)
                    continue
                raise
            if got is None:
                raise BrokenError(f"{peer} closed the expert stream")
            self.reader.take_admitted()
            msg, payload = got
            match msg:
                case ExpertResponse():
                    self._resolve((msg.request_id, msg.attempt), response=msg, payload=payload)
                case HoldProof() | LaneAnswer():
                    self._resolve((msg.request_id, msg.attempt), response=msg)
                case ErrorReply(request_id=int() as rid, attempt=int() as attempt) if not msg.fatal:
                    self._resolve((rid, attempt), response=msg)
                case ErrorReply():
                    log.warning("%s sent an error: %s (%s)", peer, msg.message, msg.code)
                    if msg.fatal:
                        raise RemoteProtocolError(f"{peer}: {msg.message}", code=msg.code)
                case Hello() | ExpertRequest() | Cancel() | HoldChallenge() | LaneOffer():
                    raise UnexpectedMessage(f"{peer} sent a {type(msg).__name__} on an open expert stream")

    def _resolve(
        self,
        key: RequestKey,
        *,
        response: ExpertResponse | HoldProof | LaneAnswer | ErrorReply | None = None,
        payload: bytearray | None = None,
        error: SwarmError | None = None,
    ) -> None:
        waiter = self.pending.pop(key, None)
        self.expected.pop(key, None)
        if waiter is None:
            log.debug("dropping an answer for %s that nobody waits for", key)
            return
        waiter.response, waiter.payload, waiter.error = response, payload, error
        waiter.event.set()


def encode_call(req: ExpertRequest, rows: torch.Tensor | np.ndarray, pairs: Pairs, our_dtypes: Sequence[str],
                peer: Hello, limits: WireLimits) -> tuple[ExpertRequest, bytes]:
    """One request frame for a peer whose Hello is ``peer`` (on a stream or a data lane): the dtype both
    speak, checked against the peer's limits exactly as the server checks it (``LocalProtocolError``)."""
    peer_limits = WireLimits(max_header_bytes=limits.max_header_bytes,
                             max_frame_bytes=min(limits.max_frame_bytes, peer.max_frame_bytes),
                             max_rows=peer.max_rows, max_in_flight=peer.max_in_flight)
    try:
        dtype = choose_dtype(req.dtype, list(our_dtypes), peer.dtypes)
        if dtype != req.dtype:
            req = msgspec.structs.replace(req, dtype=dtype)
        validate_request(req, request_payload_len(req), limits=peer_limits, dtypes=peer.dtypes)
        check_pairs(req, pairs)
        payload = encode_request_payload(req, rows_to_payload(rows, dtype), pairs)
    except WireError as exc:
        raise LocalProtocolError(exc.message, code=exc.code) from exc
    return req, encode_frame(req, payload, max_frame_bytes=peer.max_frame_bytes)


def answer_array(peer: str, req: ExpertRequest, resp: ExpertResponse, payload: bytearray) -> np.ndarray:
    """The outputs of an answer to ``req`` (on a stream or a lane): its status an error unless ``ok``
    (``remote_error``: refusals keep their codes), its shape the request's, every value finite."""
    if resp.status != Status.OK:
        raise remote_error(resp.status, f"{peer} answered {resp.status}: {resp.message}")
    if (resp.n_rows, resp.n_pairs, resp.d_model) != (req.n_rows, req.n_pairs, req.d_model):
        raise RemoteProtocolError(
            f"{peer} answered {resp.n_pairs} pairs of [{resp.n_rows}, {resp.d_model}] to a request of "
            f"{req.n_pairs} pairs of [{req.n_rows}, {req.d_model}]",
            code="bad_shape",
        )
    out = payload_to_array(payload, resp.dtype, answer_rows(req), resp.d_model)
    if not bool(np.isfinite(out).all()):
        raise NonFinite(f"{peer} answered request {req.request_id}/{req.attempt} with NaN/inf")
    return out


class ExpertClient:
    """Calls one peer's experts over one long-lived, pipelined stream. Use ``open_expert_client``."""

    def __init__(
        self,
        transport: Transport,
        peer_id: str,
        addrs: Sequence[str],
        nursery: trio.Nursery,
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        agent: str = DEFAULT_AGENT,
        dtypes: Sequence[str] = SUPPORTED_DTYPES,
        kernel_id: str | None = None,
    ) -> None:
        """``kernel_id``: what our Hello announces (default: this process's default kernel)."""
        self.peer_id = peer_id
        self.addrs = list(addrs)
        self._transport = transport
        self._nursery = nursery
        self._limits = limits
        if kernel_id is None:
            from swarm.model.kernels import kernel_id as default_kernel_id

            kernel_id = default_kernel_id()
        self._hello = make_hello(limits, kernel_id=kernel_id, agent=agent, dtypes=dtypes)
        self.cancels_sent = 0
        self._session: _Session | None = None
        self._session_lock = trio.Lock()
        self._closed = False
        self.sessions_opened = 0

    @property
    def peer_hello(self) -> Hello | None:
        """The Hello of the current stream's peer (None before the first call)."""
        return self._session.hello if self._session is not None else None

    # The deadline is part of the call's contract (expiry raises TransportTimeout, a TransportError the
    # dispatcher handles like any other failure), hence a parameter rather than the caller's cancel scope.
    async def call(
        self, req: ExpertRequest, rows: torch.Tensor | np.ndarray, pairs: Pairs, *, timeout: float  # noqa: ASYNC109
    ) -> torch.Tensor:
        """The weighted per-pair outputs ``[n_pairs, d_model]`` (float32, in ``pairs``' order) for
        ``req`` over ``rows`` and ``pairs`` (``req.n_pairs`` of them, in wire order: ``make_pairs``
        sorts); ``swarm.model.kernels.combine_pairs`` adds them into a layer's result.

        ``req.dtype`` is the preferred wire dtype (e.g. float32 for exactness, bfloat16 for
        bandwidth); the one actually used is the best both peers support. Abandoning the call
        (cancellation, timeout) after its frame left sends a ``Cancel``.
        """
        y, _ = await self.call_np(req, rows, pairs, timeout=timeout)
        return torch.from_numpy(y)

    # The deadline is part of the call's contract (expiry raises TransportTimeout, a TransportError the
    # dispatcher handles like any other failure), hence a parameter rather than the caller's cancel scope.
    async def call_np(
        self, req: ExpertRequest, rows: torch.Tensor | np.ndarray, pairs: Pairs, *, timeout: float  # noqa: ASYNC109
    ) -> tuple[np.ndarray, ExpertResponse]:
        """``call``'s outputs as a numpy array, with the answer's header (the server's own times)."""
        if rows.ndim != 2 or tuple(rows.shape) != (req.n_rows, req.d_model):
            raise LocalProtocolError(
                f"rows of shape {tuple(rows.shape)} for a request of [{req.n_rows}, {req.d_model}]"
            )
        if not math.isfinite(timeout) or timeout <= 0:
            raise LocalProtocolError(f"bad timeout {timeout}")
        with trio.move_on_after(timeout):
            return await self._call(req, rows, pairs)
        raise TransportTimeout(
            f"no answer from {self.peer_id} to request {req.request_id}/{req.attempt} within {timeout}s"
        )

    async def _call(self, req: ExpertRequest, rows: torch.Tensor | np.ndarray, pairs: Pairs
                    ) -> tuple[np.ndarray, ExpertResponse]:
        session = self._session
        if session is None or session.dead is not None or self._closed:
            session = await self._get_session()
        req, frame = encode_call(req, rows, pairs, self._hello.dtypes, session.hello, self._limits)
        waiter = await self._exchange(session, (req.request_id, req.attempt), frame,
                                      answer_rows(req) * req.d_model * itemsize(req.dtype))
        return self._result(req, waiter)

    async def _exchange(self, session: _Session, key: RequestKey, frame: bytes, expected: int) -> _Waiter:
        """Send ``frame`` for ``key`` and wait for its answer (``expected``: the largest answer payload
        accepted). Abandoning the wait after the frame left sends a ``Cancel``."""
        if key in session.pending:
            raise LocalProtocolError(f"request {key} is already in flight to {self.peer_id}", code="duplicate_request")
        if session.dead is not None:
            raise _copy(session.dead)
        waiter = _Waiter()
        session.pending[key] = waiter
        session.expected[key] = expected
        try:
            if session.can_write_now():  # nothing ahead of it: written from this task, no hop to the writer
                await session.write_now(waiter, frame)
                if session.dead is not None and not waiter.event.is_set():
                    raise _copy(session.dead)
            else:
                try:
                    item = _Outgoing(key, waiter, frame)
                    try:
                        session.send_channel.send_nowait(item)  # no scheduler trip while the queue has room
                    except trio.WouldBlock:
                        await session.send_channel.send(item)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    if not waiter.event.is_set():
                        raise _copy(session.dead or BrokenError(f"stream to {self.peer_id} broke")) from None
            await waiter.event.wait()
        finally:
            if session.pending.get(key) is waiter:
                del session.pending[key]
                session.expected.pop(key, None)
                if waiter.sent and not waiter.event.is_set() and session.cancel_nowait(key):
                    self.cancels_sent += 1  # abandoned after it left: the server may drop it
        return waiter

    async def prove_hold(self, ch: HoldChallenge, *, timeout: float) -> HoldProof:  # noqa: ASYNC109
        """Send a hold challenge and return its ``HoldProof`` (any status: judging it is the
        caller's). Errors as for ``call``."""
        return await self._control(ch, HoldProof, FEATURE_HOLD_PROOF, "hold challenge", timeout)

    async def offer_lane(self, offer: LaneOffer, *, timeout: float) -> LaneAnswer:  # noqa: ASYNC109
        """Offer the peer a data lane (``swarm.rpc.lane``) and return its ``LaneAnswer`` (any status);
        ``unsupported`` at once, nothing sent, to a peer whose Hello does not offer ``FEATURE_LANE``.
        Errors as for ``call``."""
        return await self._control(offer, LaneAnswer, FEATURE_LANE, "lane offer", timeout)

    async def _control(self, msg: HoldChallenge | LaneOffer, answer: type[_A], feature: str, what: str,
                       timeout: float) -> _A:  # noqa: ASYNC109
        """One control message and its one answer of type ``answer`` (sent only to a peer whose
        Hello offers ``feature``: an older one could not decode it)."""
        if not math.isfinite(timeout) or timeout <= 0:
            raise LocalProtocolError(f"bad timeout {timeout}")
        with trio.move_on_after(timeout):
            session = self._session
            if session is None or session.dead is not None or self._closed:
                session = await self._get_session()
            if feature not in session.hello.features:
                return answer(request_id=msg.request_id, attempt=msg.attempt, status=Status.UNSUPPORTED,
                              message=f"{self.peer_id} answers no {what}s (its Hello offers "
                                      f"{session.hello.features or 'no features'}): an older volunteer, upgrade it")
            waiter = await self._exchange(session, (msg.request_id, msg.attempt), encode_frame(msg), 0)
            if waiter.error is not None:
                raise waiter.error
            resp = waiter.response
            if isinstance(resp, ErrorReply):
                raise RemoteProtocolError(f"{self.peer_id}: {resp.message}", code=resp.code)
            if isinstance(resp, ExpertResponse) and resp.status != Status.OK:  # refused at the framing level
                return answer(request_id=msg.request_id, attempt=msg.attempt, status=resp.status, message=resp.message)
            if not isinstance(resp, answer):
                raise RemoteProtocolError(f"{self.peer_id} answered a {what} with {type(resp).__name__}",
                                          code="unexpected_message")
            return resp
        raise TransportTimeout(f"no answer from {self.peer_id} to {what} {msg.request_id} within {timeout}s")

    def _result(self, req: ExpertRequest, waiter: _Waiter) -> tuple[np.ndarray, ExpertResponse]:
        if waiter.error is not None:
            raise waiter.error
        resp = waiter.response
        if resp is None:  # only reachable if the session died without an error: treat as broken
            raise BrokenError(f"stream to {self.peer_id} broke")
        if isinstance(resp, ErrorReply):
            raise RemoteProtocolError(f"{self.peer_id}: {resp.message}", code=resp.code)
        if not isinstance(resp, ExpertResponse):
            raise RemoteProtocolError(f"{self.peer_id} answered an expert request with a {type(resp).__name__}",
                                      code="unexpected_message")
        return answer_array(self.peer_id, req, resp, waiter.payload if waiter.payload is not None else bytearray()), resp

    async def _get_session(self) -> _Session:
        async with self._session_lock:
            if self._closed:
                raise ClosedError(f"expert client for {self.peer_id} is closed")
            session = self._session
            if session is not None and session.dead is None:
                return session
            self._session = None
            session = await self._open_session()
            self._session = session
            self.sessions_opened += 1
            self._nursery.start_soon(session.run, self.peer_id)
            return session

    async def _open_session(self) -> _Session:
        stream = await self._transport.open_stream(self.peer_id, self.addrs, PROTOCOL_ID)
        try:
            await stream.write(encode_frame(self._hello))
            expected: dict[RequestKey, int] = {}
            # an answer's payload is buffered only up to the largest answer we wait for: a peer
            # cannot make us hold more than we asked for (bytes past it are discarded as they come)
            reader = FrameReader(stream, self._limits,
                                 admit=lambda n: n <= max(expected.values(), default=0))
            got = await reader.receive_message()
            if got is None:
                raise BrokenError(f"{self.peer_id} closed the expert stream before its Hello")
            msg, _ = got
            if isinstance(msg, ErrorReply):
                raise RemoteProtocolError(f"{self.peer_id}: {msg.message}", code=msg.code)
            if not isinstance(msg, Hello):
                raise UnexpectedMessage(f"{self.peer_id} sent {type(msg).__name__} instead of a Hello")
            if msg.protocol_version != PROTOCOL_VERSION:
                raise VersionMismatch(version_mismatch_message(msg.protocol_version))
            queue_size = max(1, min(msg.max_in_flight, self._limits.max_in_flight))
            return _Session(stream, msg, reader, queue_size, expected)
        except BaseException:
            await quietly(stream.aclose, f"closing a failed expert stream to {self.peer_id}", timeout_s=1, shield=True)
            raise

    async def aclose(self) -> None:
        """Close the stream; calls still waiting get ``ClosedError``."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            session.kill(ClosedError(f"expert client for {self.peer_id} is closed"))
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def open_expert_client(
    transport: Transport,
    peer_id: str,
    addrs: Sequence[str],
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    agent: str = DEFAULT_AGENT,
    dtypes: Sequence[str] = SUPPORTED_DTYPES,
    kernel_id: str | None = None,
) -> AsyncIterator[ExpertClient]:
    """An ``ExpertClient`` for ``peer_id`` whose tasks live in this context; closed on exit."""
    async with trio.open_nursery() as nursery:
        client = ExpertClient(
            transport, peer_id, addrs, nursery, limits=limits, agent=agent, dtypes=dtypes, kernel_id=kernel_id
        )
        try:
            yield client
        finally:
            await client.aclose()
