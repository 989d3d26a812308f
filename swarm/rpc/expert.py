"""The expert protocol ``/moe-swarm/expert/1`` over one ``Stream`` (shell: trio tasks, no policy).

Server: ``serve_expert_stream`` answers the requests of one stream; plug it into a transport with
``transport.set_stream_handler(PROTOCOL_ID, expert_stream_handler(handler, hello=..., limits=...))``.
Client: ``open_expert_client`` keeps one long-lived stream per peer and pipelines calls over it.

Rules:
- Each side's first frame is its ``Hello``; a version mismatch is answered with a fatal
  ``ErrorReply`` naming both versions, then the stream is closed.
- The server reads a request only while fewer than ``limits.max_in_flight`` are being computed
  (back-pressure through the stream), runs each in its own task and answers as each finishes,
  tagged ``(request_id, attempt)``; answers may overtake each other.
- Bad input never takes the server down: a request that fails validation, an undecodable header
  or an oversized frame is answered with an error and the next frame is served; only lost framing
  (a header length beyond the limit) ends the stream, after a fatal ``ErrorReply``. A handler's
  exception becomes an error response (a ``SwarmError`` keeps its code, anything else is
  ``internal_error``); a handler's result of the wrong shape or with NaN/inf is never sent.
- Client: one stream per peer, opened lazily under the first caller's deadline and re-opened by
  the next call after it breaks. A reader task routes answers to waiting callers by
  ``(request_id, attempt)``; an answer nobody waits for (late, expired, duplicate) is dropped.
  A writer task sends frames whole, so a caller's cancellation never cuts a frame in half; a
  frame whose caller gave up before it was sent is not sent at all.
- Client errors: ``TransportTimeout`` (deadline), ``BrokenError`` (the stream died under the call),
  ``ClosedError`` (client closed), ``DialError`` (could not open), ``RemoteProtocolError`` (error
  answer, wrong shape, NaN/inf, bad frame), ``LocalProtocolError`` (the request itself is invalid or
  beyond the peer's limits). Retry and hedging policy belongs to the caller.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final

import msgspec
import torch
import trio

from swarm.errors import (
    BrokenError,
    ClosedError,
    LocalProtocolError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
    TransportTimeout,
)
from swarm.p2p.transport import Stream, StreamHandler, Transport
from swarm.protocol.expert import (
    DEFAULT_LIMITS,
    PROTOCOL_ID,
    PROTOCOL_VERSION,
    SUPPORTED_DTYPES,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    FrameReader,
    Hello,
    Message,
    NonFinite,
    RequestId,
    UnexpectedMessage,
    VersionMismatch,
    WireError,
    WireLimits,
    all_finite,
    choose_dtype,
    encode_frame,
    payload_to_tensor,
    tensor_to_payload,
    validate_request,
)

__all__ = [
    "DEFAULT_AGENT",
    "ExpertClient",
    "ExpertHandler",
    "expert_stream_handler",
    "make_hello",
    "open_expert_client",
    "serve_expert_stream",
]

log = logging.getLogger(__name__)

DEFAULT_AGENT: Final = "moe-swarm/0.1"

ExpertHandler = Callable[[ExpertRequest, torch.Tensor], Awaitable[torch.Tensor]]
_Key = tuple[int, int]  # (request_id, attempt)


def make_hello(
    limits: WireLimits = DEFAULT_LIMITS,
    *,
    agent: str = DEFAULT_AGENT,
    dtypes: Sequence[str] = SUPPORTED_DTYPES,
) -> Hello:
    """The Hello advertising ``limits`` and ``dtypes``."""
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        dtypes=list(dtypes),
        max_frame_bytes=limits.max_frame_bytes,
        max_rows=limits.max_rows,
        max_in_flight=limits.max_in_flight,
        agent=agent,
    )


def _version_error(theirs: int) -> str:
    return (
        f"protocol {PROTOCOL_ID} version mismatch: this peer speaks version {PROTOCOL_VERSION}, "
        f"the other side sent version {theirs}"
    )


async def _acquire(sync: trio.Lock | trio.Semaphore) -> None:
    """Acquire ``sync``; when it is free, without the scheduler trip of ``acquire()``.

    Every uncontended ``acquire()`` yields once; on the per-call path those trips add up (each is
    a pass through trio's run loop), and the awaits that follow are checkpoints anyway.
    """
    try:
        sync.acquire_nowait()
    except trio.WouldBlock:
        await sync.acquire()


# ============================================================================================
# Server


async def serve_expert_stream(
    stream: Stream,
    handler: ExpertHandler,
    *,
    hello: Hello,
    limits: WireLimits = DEFAULT_LIMITS,
    hello_timeout_s: float = 10.0,
    drain_timeout_s: float = 10.0,
) -> None:
    """Serve one expert stream until the peer closes it or it breaks; never raises for peer faults.

    After the peer closes its side, answers still being computed get ``drain_timeout_s`` to finish.
    """
    peer = stream.remote_peer_id
    reader = FrameReader(stream, limits)
    write_lock = trio.Lock()

    async def send(msg: Message, payload: bytes | bytearray | memoryview = b"") -> None:
        frame = encode_frame(msg, payload)
        await _acquire(write_lock)
        try:
            await stream.write(frame)
        finally:
            write_lock.release()

    first: Hello | WireError | None = None
    try:
        await send(hello)
        with trio.move_on_after(hello_timeout_s):
            first = await _receive_hello(reader)
        if first is None:
            return
        if isinstance(first, WireError):
            await send(ErrorReply(code=first.code, message=first.message, fatal=True))
            return
        if first.protocol_version != PROTOCOL_VERSION:
            await send(
                ErrorReply(
                    code=VersionMismatch.code, message=_version_error(first.protocol_version), fatal=True
                )
            )
            return
        log.debug("expert stream from %s (%s) open", peer, first.agent)
        await _serve_requests(
            stream, reader, handler, send, hello=hello, limits=limits, drain_timeout_s=drain_timeout_s
        )
    except TransportError as exc:
        log.debug("expert stream from %s ended: %r", peer, exc)


async def _receive_hello(reader: FrameReader) -> Hello | WireError | None:
    try:
        got = await reader.receive_message()
    except WireError as exc:
        return exc
    if got is None:
        return None
    msg, _ = got
    if not isinstance(msg, Hello):
        return UnexpectedMessage(f"the first frame must be a Hello, got {type(msg).__name__}", fatal=True)
    return msg


async def _serve_requests(
    stream: Stream,
    reader: FrameReader,
    handler: ExpertHandler,
    send: Callable[[Message, bytes | bytearray | memoryview], Awaitable[None]],
    *,
    hello: Hello,
    limits: WireLimits,
    drain_timeout_s: float,
) -> None:
    peer = stream.remote_peer_id
    slots = trio.Semaphore(limits.max_in_flight)
    in_flight: set[_Key] = set()

    async def answer_error(exc: WireError) -> None:
        if exc.request_id is not None and exc.attempt is not None:
            await send(
                ExpertResponse(
                    request_id=RequestId(exc.request_id),
                    attempt=exc.attempt,
                    status=exc.code,
                    message=exc.message,
                ),
                b"",
            )
        else:
            await send(ErrorReply(code=exc.code, message=exc.message, fatal=exc.fatal), b"")

    async with trio.open_nursery() as nursery:

        async def run_one(req: ExpertRequest, rows: torch.Tensor) -> None:
            key = (req.request_id, req.attempt)
            try:
                response, payload = await _compute(handler, req, rows, peer)
                await send(response, payload)
            except TransportError as exc:  # the stream is gone: nobody left to answer
                log.debug("expert stream from %s broke while answering: %r", peer, exc)
                nursery.cancel_scope.cancel()
            finally:
                in_flight.discard(key)
                slots.release()

        try:
            await _read_requests(
                reader, slots, in_flight, answer_error, run_one, nursery, hello, limits, peer
            )
        except TransportError as exc:
            log.debug("expert stream from %s ended: %r", peer, exc)
            nursery.cancel_scope.cancel()
        else:  # the peer is done sending: finish what is in flight, then close
            nursery.cancel_scope.deadline = trio.current_time() + drain_timeout_s


async def _read_requests(
    reader: FrameReader,
    slots: trio.Semaphore,
    in_flight: set[_Key],
    answer_error: Callable[[WireError], Awaitable[None]],
    run_one: Callable[[ExpertRequest, torch.Tensor], Awaitable[None]],
    nursery: trio.Nursery,
    hello: Hello,
    limits: WireLimits,
    peer: str,
) -> None:
    """Read and dispatch requests until the peer closes its side (returns) or framing is lost."""
    while True:
        await _acquire(slots)
        try:
            got = await reader.receive_message()
        except WireError as exc:
            slots.release()
            log.info("bad frame from %s: %s (%s)", peer, exc.message, exc.code)
            await answer_error(exc)
            if exc.fatal:
                nursery.cancel_scope.cancel()
                return
            continue
        except BaseException:
            slots.release()
            raise
        if got is None:
            slots.release()
            return
        msg, payload = got
        if not isinstance(msg, ExpertRequest):
            slots.release()
            await answer_error(UnexpectedMessage(f"unexpected {type(msg).__name__} after the Hello"))
            continue
        key = (msg.request_id, msg.attempt)
        try:
            validate_request(msg, len(payload), limits=limits, dtypes=hello.dtypes)
            if key in in_flight:
                raise WireError(
                    f"request {key} is already in flight on this stream",
                    code="duplicate_request",
                    request_id=msg.request_id,
                    attempt=msg.attempt,
                )
            rows = payload_to_tensor(payload, msg.dtype, msg.n_rows, msg.d_model)
        except WireError as exc:
            slots.release()
            await answer_error(exc)
            continue
        in_flight.add(key)
        nursery.start_soon(run_one, msg, rows)


async def _compute(
    handler: ExpertHandler, req: ExpertRequest, rows: torch.Tensor, peer: str
) -> tuple[ExpertResponse, bytes | bytearray | memoryview]:
    """Run the handler; an error response for any failure, never a bad tensor."""

    def failure(code: str, message: str) -> tuple[ExpertResponse, bytes]:
        return ExpertResponse(
            request_id=req.request_id, attempt=req.attempt, status=code, message=message
        ), b""

    try:
        out = await handler(req, rows)
    except SwarmError as exc:
        return failure(exc.code, exc.message)
    except Exception as exc:
        log.exception("expert handler failed on request %s/%s from %s", req.request_id, req.attempt, peer)
        return failure("internal_error", f"expert computation failed: {type(exc).__name__}")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (req.n_rows, req.d_model):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        log.error("expert handler returned %s for request of shape %s", got, (req.n_rows, req.d_model))
        return failure(
            "internal_error", f"expert computation returned {got}, expected {(req.n_rows, req.d_model)}"
        )
    if not out.is_floating_point() or not all_finite(out):
        return failure(NonFinite.code, "expert computation produced non-finite values")
    payload = tensor_to_payload(out, req.dtype)
    response = ExpertResponse(
        request_id=req.request_id,
        attempt=req.attempt,
        status="ok",
        dtype=req.dtype,
        n_rows=req.n_rows,
        d_model=req.d_model,
    )
    return response, payload


def expert_stream_handler(
    handler: ExpertHandler, *, hello: Hello | None = None, limits: WireLimits = DEFAULT_LIMITS
) -> StreamHandler:
    """A transport stream handler serving ``handler`` on each inbound expert stream."""
    our_hello = hello if hello is not None else make_hello(limits)

    async def on_stream(stream: Stream) -> None:
        await serve_expert_stream(stream, handler, hello=our_hello, limits=limits)

    return on_stream


# ============================================================================================
# Client


@dataclass(eq=False)
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    response: ExpertResponse | ErrorReply | None = None
    payload: bytearray | None = None
    error: SwarmError | None = None


@dataclass(eq=False)
class _Outgoing:
    key: _Key
    waiter: _Waiter
    frame: bytes


def _copy(error: SwarmError) -> SwarmError:
    """A fresh exception per caller: one instance raised in several tasks would tangle tracebacks."""
    return type(error)(error.message, code=error.code)


class _Session:
    """One open stream: its peer's Hello, callers waiting for answers, and the tasks serving it."""

    def __init__(self, stream: Stream, server_hello: Hello, reader: FrameReader, queue_size: int) -> None:
        self.stream = stream
        self.hello = server_hello
        self.reader = reader
        self.pending: dict[_Key, _Waiter] = {}
        self.send_channel, self.receive_channel = trio.open_memory_channel[_Outgoing](queue_size)
        self.dead: SwarmError | None = None
        self.cancel_scope = trio.CancelScope()

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
                with trio.move_on_after(1) as scope:
                    scope.shield = True
                    try:
                        await self.stream.aclose()
                    except TransportError:
                        pass

    async def _guarded(self, loop: Awaitable[None], peer: str) -> None:
        try:
            await loop
        except SwarmError as exc:
            log.debug("expert stream to %s failed: %r", peer, exc)
            self.kill(exc)

    async def _write_loop(self) -> None:
        async for item in self.receive_channel:
            if self.pending.get(item.key) is not item.waiter:
                continue  # the caller gave up before the frame left: do not send it
            await self.stream.write(item.frame)

    async def _read_loop(self, peer: str) -> None:
        while True:
            try:
                got = await self.reader.receive_message()
            except WireError as exc:
                if exc.request_id is not None and exc.attempt is not None and not exc.fatal:
                    self._resolve((exc.request_id, exc.attempt), error=exc)
                    continue
                raise
            if got is None:
                raise BrokenError(f"{peer} closed the expert stream")
            msg, payload = got
            match msg:
                case ExpertResponse():
                    self._resolve((msg.request_id, msg.attempt), response=msg, payload=payload)
                case ErrorReply(request_id=int() as rid, attempt=int() as attempt) if not msg.fatal:
                    self._resolve((rid, attempt), response=msg)
                case ErrorReply():
                    log.warning("%s sent an error: %s (%s)", peer, msg.message, msg.code)
                    if msg.fatal:
                        raise RemoteProtocolError(f"{peer}: {msg.message}", code=msg.code)
                case Hello() | ExpertRequest():
                    raise UnexpectedMessage(f"{peer} sent a {type(msg).__name__} on an open expert stream")

    def _resolve(
        self,
        key: _Key,
        *,
        response: ExpertResponse | ErrorReply | None = None,
        payload: bytearray | None = None,
        error: SwarmError | None = None,
    ) -> None:
        waiter = self.pending.pop(key, None)
        if waiter is None:
            log.debug("dropping an answer for %s that nobody waits for", key)
            return
        waiter.response, waiter.payload, waiter.error = response, payload, error
        waiter.event.set()


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
    ) -> None:
        self.peer_id = peer_id
        self.addrs = list(addrs)
        self._transport = transport
        self._nursery = nursery
        self._limits = limits
        self._hello = make_hello(limits, agent=agent, dtypes=dtypes)
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
    async def call(self, req: ExpertRequest, rows: torch.Tensor, *, timeout: float) -> torch.Tensor:  # noqa: ASYNC109
        """The per-row partial sums ``[n_rows, d_model]`` (float32) for ``req`` over ``rows``.

        ``req.dtype`` is the preferred wire dtype (e.g. float32 for exactness, bfloat16 for
        bandwidth); the one actually used is the best both peers support.
        """
        if rows.dim() != 2 or tuple(rows.shape) != (req.n_rows, req.d_model):
            raise LocalProtocolError(
                f"rows of shape {tuple(rows.shape)} for a request of [{req.n_rows}, {req.d_model}]"
            )
        if not math.isfinite(timeout) or timeout <= 0:
            raise LocalProtocolError(f"bad timeout {timeout}")
        with trio.move_on_after(timeout):
            return await self._call(req, rows)
        raise TransportTimeout(
            f"no answer from {self.peer_id} to request {req.request_id}/{req.attempt} within {timeout}s"
        )

    async def _call(self, req: ExpertRequest, rows: torch.Tensor) -> torch.Tensor:
        session = self._session
        if session is None or session.dead is not None or self._closed:
            session = await self._get_session()
        peer_limits = self._peer_limits(session.hello)
        try:
            dtype = choose_dtype(req.dtype, self._hello.dtypes, session.hello.dtypes)
            if dtype != req.dtype:
                req = msgspec.structs.replace(req, dtype=dtype)
            payload = tensor_to_payload(rows, dtype)
            validate_request(req, payload.nbytes, limits=peer_limits, dtypes=session.hello.dtypes)
        except WireError as exc:
            raise LocalProtocolError(exc.message, code=exc.code) from exc
        frame = encode_frame(req, payload, max_frame_bytes=session.hello.max_frame_bytes)
        key = (req.request_id, req.attempt)
        if key in session.pending:
            raise LocalProtocolError(
                f"request {key} is already in flight to {self.peer_id}", code="duplicate_request"
            )
        if session.dead is not None:
            raise _copy(session.dead)
        waiter = _Waiter()
        session.pending[key] = waiter
        try:
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
        return self._result(req, waiter)

    def _result(self, req: ExpertRequest, waiter: _Waiter) -> torch.Tensor:
        if waiter.error is not None:
            raise waiter.error
        resp = waiter.response
        if resp is None:  # only reachable if the session died without an error: treat as broken
            raise BrokenError(f"stream to {self.peer_id} broke")
        if isinstance(resp, ErrorReply):
            raise RemoteProtocolError(f"{self.peer_id}: {resp.message}", code=resp.code)
        if resp.status != "ok":
            raise RemoteProtocolError(
                f"{self.peer_id} answered {resp.status}: {resp.message}", code=resp.status
            )
        if (resp.n_rows, resp.d_model) != (req.n_rows, req.d_model):
            raise RemoteProtocolError(
                f"{self.peer_id} answered [{resp.n_rows}, {resp.d_model}] to a [{req.n_rows}, {req.d_model}] request",
                code="bad_shape",
            )
        payload = waiter.payload if waiter.payload is not None else bytearray()
        out = payload_to_tensor(payload, resp.dtype, resp.n_rows, resp.d_model)
        if not all_finite(out):
            raise NonFinite(f"{self.peer_id} answered request {req.request_id}/{req.attempt} with NaN/inf")
        return out

    def _peer_limits(self, hello: Hello) -> WireLimits:
        return WireLimits(
            max_header_bytes=self._limits.max_header_bytes,
            max_frame_bytes=min(self._limits.max_frame_bytes, hello.max_frame_bytes),
            max_rows=hello.max_rows,
            max_in_flight=hello.max_in_flight,
        )

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
            reader = FrameReader(stream, self._limits)
            got = await reader.receive_message()
            if got is None:
                raise BrokenError(f"{self.peer_id} closed the expert stream before its Hello")
            msg, _ = got
            if isinstance(msg, ErrorReply):
                raise RemoteProtocolError(f"{self.peer_id}: {msg.message}", code=msg.code)
            if not isinstance(msg, Hello):
                raise UnexpectedMessage(f"{self.peer_id} sent {type(msg).__name__} instead of a Hello")
            if msg.protocol_version != PROTOCOL_VERSION:
                raise VersionMismatch(_version_error(msg.protocol_version))
            queue_size = max(1, min(msg.max_in_flight, self._limits.max_in_flight))
            return _Session(stream, msg, reader, queue_size)
        except BaseException:
            with trio.move_on_after(1) as scope:
                scope.shield = True
                try:
                    await stream.aclose()
                except TransportError:
                    pass
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
) -> AsyncIterator[ExpertClient]:
    """An ``ExpertClient`` for ``peer_id`` whose tasks live in this context; closed on exit."""
    async with trio.open_nursery() as nursery:
        client = ExpertClient(transport, peer_id, addrs, nursery, limits=limits, agent=agent, dtypes=dtypes)
        try:
            yield client
        finally:
            await client.aclose()
