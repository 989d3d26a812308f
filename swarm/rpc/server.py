"""The server side of the expert stream ``/moe-swarm/expert/2`` (shell: trio tasks, no policy).

``serve_expert_stream`` answers the requests of one ``Stream``; ``set_expert_handlers`` plugs it
into a transport (``PROTOCOL_ID``, plus a refusal on the v1 protocol id). The client side is
``swarm.rpc.client``; the two share only the wire (``swarm.protocol.expert``).

Rules:
- Each side's first frame is its ``Hello``; a version mismatch is answered with a fatal
  ``ErrorReply`` naming both versions, then the stream is closed. A stream opened on
  ``V1_PROTOCOL_ID`` gets exactly one fatal ``version_mismatch`` ``ErrorReply`` and is closed
  (``refuse_v1_stream``), so a v1 coordinator learns why instead of timing out.
- The server reads a request only while fewer than ``limits.max_in_flight`` are being computed
  (back-pressure through the stream), runs each in its own task and answers as each finishes,
  tagged ``(request_id, attempt)``; answers may overtake each other. Every accepted request gets
  exactly one answer: a ``Cancel`` for a request in flight cancels its task (the handler stops
  waiting; a computation already running in a thread finishes and is dropped) and the answer is
  ``cancelled``; a ``Cancel`` for anything else is ignored.
- A frame is judged from its header before any of its payload is buffered (``_Screen``): a request
  or hold challenge from a peer ``authorize`` refuses is answered ``not_authorized`` at once and its
  payload discarded as it arrives, nothing reserved (the trust issue's "only registered coordinators
  use volunteers"; the stream stays open, so a coordinator that registers later is served without
  reconnecting); so is a request whose header fails ``validate_request`` against its declared length,
  or a payload on a message that carries none; a payload before the Hello ends the stream.
- Request bytes held at once are bounded per peer and in all (``ByteBudget``, shared by a server's
  streams; default 256 MiB a peer, 1 GiB in all): a payload past either bound is discarded as it
  arrives and answered ``busy`` (a refusal: the coordinator computes the range itself). Every byte
  taken is given back on every way a stream can end: each stream takes through its own
  ``BudgetAccount``, closed when the stream ends (cut off mid-payload, reset, cancelled, lost
  framing); inside a frame, a read that brings nothing for ``stall_timeout_s`` (30 s) ends the stream.
- Bad input never takes the server down: a request that fails validation (header or pair
  arrays), an undecodable header or an oversized frame is answered with an error and the next
  frame is served; only lost framing (a header length beyond the limit) ends the stream, after a
  fatal ``ErrorReply``. A handler's exception becomes an error response (a ``SwarmError`` keeps
  its code -- a refusal such as ``draining`` or ``slice_not_held`` included -- anything else is
  ``internal_error``); a handler's result of the wrong shape or with NaN/inf is never sent.
- A ``LaneOffer`` (authorised like a request) is answered with one ``LaneAnswer`` from ``lanes`` (the
  volunteer dials the lane, ``swarm.rpc.lane``); without ``lanes`` the answer is ``unsupported``, and
  the Hello offers ``FEATURE_LANE`` only with it.
- A ``HoldChallenge`` is answered with one ``HoldProof`` from ``prove`` (the digest; a
  ``SwarmError`` it raises becomes the status), in a slot like a request; without ``prove`` the
  answer is ``slice_not_held``.
- The handler gets the header, the rows as a float32 tensor and the pairs as flat arrays
  (``Pairs``, views of the receive buffer): nothing per row is built in Python.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import torch
import trio

from swarm.errors import (
    BadShape,
    BrokenError,
    NonFinite,
    ReceiverBusy,
    SwarmError,
    TransportError,
    UnexpectedMessage,
    VersionMismatch,
    WireError,
)
from swarm.p2p.transport import Stream, StreamHandler, Transport, acquire, quietly
from swarm.protocol.expert import (
    DEFAULT_LIMITS,
    FEATURE_HOLD_PROOF,
    FEATURE_LANE,
    PROTOCOL_ID,
    PROTOCOL_VERSION,
    V1_PROTOCOL_ID,
    Cancel,
    Dtype,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    FrameReader,
    Hello,
    HoldChallenge,
    HoldProof,
    LaneAnswer,
    LaneOffer,
    Message,
    Pairs,
    RequestId,
    RequestKey,
    Status,
    WireLimits,
    answer_rows,
    decode_pairs,
    encode_frame,
    make_hello,
    rows_region,
    validate_request,
    version_mismatch_message,
)
from swarm.rpc.tensors import all_finite, payload_to_tensor, tensor_to_payload

log = logging.getLogger(__name__)

__all__ = [
    "Authorize",
    "BudgetAccount",
    "ByteBudget",
    "ExpertHandler",
    "Lanes",
    "Computed",
    "Prove",
    "expert_answer",
    "expert_stream_handler",
    "refuse_v1_stream",
    "serve_expert_stream",
    "set_expert_handlers",
]

@dataclass(frozen=True)
class Computed:
    """A handler's answer with how long it computed (the answer's ``compute_us``; a bare tensor says 0)."""

    out: torch.Tensor
    compute_s: float


ExpertHandler = Callable[[ExpertRequest, torch.Tensor, Pairs], Awaitable["torch.Tensor | Computed"]]
Authorize = Callable[[str], bool]  # peer id -> may it use our experts
Prove = Callable[[HoldChallenge], Awaitable[bytes]]  # the digest (``swarm.model.slices.hold_digest``); SwarmError to refuse
Lanes = Callable[[LaneOffer, str], Awaitable[LaneAnswer]]  # (offer, peer) -> the answer, once dialled or refused


class ByteBudget:
    """Request bytes a server holds at once (buffered or being computed), per peer and in all: a
    payload that would pass either bound is discarded as it arrives and answered ``busy``, so peers
    that really send bytes cannot take more memory than this (declared sizes cost nothing anyway:
    frame buffers grow with the bytes received).

    Streams take and give through their own ``BudgetAccount`` (``account``), which gives back what
    the stream still holds when it ends, however it ends. ``given`` (bytes given back, in all) and
    ``refused`` only grow: together they tell a budget that is full of work from one that is stuck.
    """

    def __init__(self, *, per_peer: int = 256 << 20, total: int = 1 << 30) -> None:
        self.per_peer = per_peer
        self.total = total
        self.held = 0
        self.by_peer: dict[str, int] = {}
        self.refused = 0
        self.given = 0
        self._lock = threading.Lock()  # streams take on the event loop, lanes on their own threads

    def take(self, peer: str, n: int) -> bool:
        with self._lock:
            mine = self.by_peer.get(peer, 0)
            if mine + n > self.per_peer or self.held + n > self.total:
                self.refused += 1
                return False
            self.by_peer[peer] = mine + n
            self.held += n
            return True

    def give(self, peer: str, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            left = self.by_peer.get(peer, 0) - n
            if left > 0:
                self.by_peer[peer] = left
            else:
                self.by_peer.pop(peer, None)
            self.held = max(0, self.held - n)
            self.given += n

    def account(self, peer: str) -> BudgetAccount:
        return BudgetAccount(self, peer)


class BudgetAccount:
    """One stream's share of a ``ByteBudget``: it never gives back more than it took, and ``close``
    gives back whatever it still holds (a frame cut off mid-payload, a request still owed)."""

    def __init__(self, budget: ByteBudget, peer: str) -> None:
        self.budget = budget
        self.peer = peer
        self.held = 0

    def take(self, n: int) -> bool:
        if not self.budget.take(self.peer, n):
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        n = min(n, self.held)
        if n > 0:
            self.held -= n
            self.budget.give(self.peer, n)

    def close(self) -> None:
        self.give(self.held)


class _StallGuard:
    """The stream as the frame reader sees it: inside a frame, a read that brings nothing for
    ``timeout_s`` breaks the stream (a peer cannot keep a part-sent frame, and what was reserved for
    it, for ever); between frames an idle stream is fine."""

    def __init__(self, stream: Stream, timeout_s: float) -> None:
        self.stream = stream
        self.timeout_s = timeout_s
        self.reader: FrameReader | None = None

    async def read(self, max_bytes: int) -> bytes:
        if self.reader is None or not self.reader.mid_frame:
            return await self.stream.read(max_bytes)
        with trio.move_on_after(self.timeout_s):
            return await self.stream.read(max_bytes)
        raise BrokenError(f"no bytes for {self.timeout_s:g} s inside a frame")


def _default_hello(limits: WireLimits) -> Hello:
    from swarm.model.kernels import kernel_id  # loads the kernel library: only when nobody said

    return make_hello(limits, kernel_id=kernel_id())


async def serve_expert_stream(
    stream: Stream,
    handler: ExpertHandler,
    *,
    hello: Hello,
    limits: WireLimits = DEFAULT_LIMITS,
    authorize: Authorize | None = None,
    hello_timeout_s: float = 10.0,
    drain_timeout_s: float = 10.0,
    budget: ByteBudget | None = None,
    prove: Prove | None = None,
    stall_timeout_s: float = 30.0,
    lanes: Lanes | None = None,
) -> None:
    """Serve one expert stream until the peer closes it or it breaks; never raises for peer faults.

    After the peer closes its side, answers still being computed get ``drain_timeout_s`` to finish.
    ``budget`` (shared by the streams of one server) bounds the request bytes held at once; whatever
    this stream still holds of it when it ends is given back, however it ends. Inside a frame, a
    read that brings nothing for ``stall_timeout_s`` ends the stream.
    """
    peer = stream.remote_peer_id
    budget = budget if budget is not None else ByteBudget()
    account = budget.account(peer)
    if prove is not None and FEATURE_HOLD_PROOF not in hello.features:
        hello = msgspec.structs.replace(hello, features=[*hello.features, FEATURE_HOLD_PROOF])
    if lanes is not None and FEATURE_LANE not in hello.features:
        hello = msgspec.structs.replace(hello, features=[*hello.features, FEATURE_LANE])
    elif lanes is None and FEATURE_LANE in hello.features:
        hello = msgspec.structs.replace(hello, features=[f for f in hello.features if f != FEATURE_LANE])
    screen = _Screen(peer, account, limits=limits, dtypes=hello.dtypes, authorize=authorize)
    guarded = _StallGuard(stream, stall_timeout_s)
    reader = FrameReader(guarded, limits, screen=screen)
    guarded.reader = reader
    write_lock = trio.Lock()

    async def send(msg: Message, payload: bytes | bytearray | memoryview = b"") -> None:
        frame = encode_frame(msg, payload)
        await acquire(write_lock)
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
                    code=VersionMismatch.code, message=version_mismatch_message(first.protocol_version), fatal=True
                )
            )
            return
        screen.hello_seen = True
        log.debug("expert stream from %s (%s, kernel %s) open", peer, first.agent, first.kernel_id)
        await _serve_requests(
            stream,
            reader,
            handler,
            send,
            hello=hello,
            limits=limits,
            drain_timeout_s=drain_timeout_s,
            account=account,
            screen=screen,
            prove=prove,
            lanes=lanes,
        )
    except TransportError as exc:
        log.debug("expert stream from %s ended: %r", peer, exc)
    finally:
        account.close()  # a frame cut off mid-payload, or anything else still held: never kept past the stream


class _Screen:
    """What the server decides from a frame's header, before any of its payload is buffered
    (``FrameReader``'s ``screen``): a payload before the Hello or on a message that carries none is
    refused; a request or hold challenge from a peer ``authorize`` refuses is ``not_authorized``; a
    request's header must pass ``validate_request`` against the declared payload length; then the
    payload's bytes must fit the byte budget (``busy``). Refused payloads are discarded unbuffered,
    so an unauthorised or invalid peer reserves nothing."""

    def __init__(self, peer: str, account: BudgetAccount, *, limits: WireLimits, dtypes: list[str],
                 authorize: Authorize | None) -> None:
        self.peer = peer
        self.account = account
        self.limits = limits
        self.dtypes = dtypes
        self.authorize = authorize
        self.hello_seen = False
        self.refused: Message | None = None  # the message of the last refused frame (for the right kind of answer)

    def __call__(self, msg: Message, payload_len: int) -> WireError | None:
        self.refused = None
        refusal = self._judge(msg, payload_len)
        if refusal is not None:
            self.refused = msg
        return refusal

    def _judge(self, msg: Message, payload_len: int) -> WireError | None:
        rid, attempt = getattr(msg, "request_id", None), getattr(msg, "attempt", None)
        if isinstance(msg, ExpertRequest | HoldChallenge | LaneOffer):
            if not self.hello_seen:
                return UnexpectedMessage(f"the first frame must be a Hello, got {type(msg).__name__}", fatal=True)
            if self.authorize is not None and not self.authorize(self.peer):
                return WireError(f"peer {self.peer} is not a coordinator this volunteer serves",
                                 code=Status.NOT_AUTHORIZED, request_id=rid, attempt=attempt)
        if not payload_len:
            return None
        if not isinstance(msg, ExpertRequest):
            return BadShape(f"a {type(msg).__name__} frame has no payload, got {payload_len} bytes",
                            request_id=rid, attempt=attempt)
        try:
            validate_request(msg, payload_len, limits=self.limits, dtypes=self.dtypes)
        except WireError as exc:
            return exc
        if not self.account.take(payload_len):
            return ReceiverBusy(f"{payload_len} payload bytes are more than this volunteer holds for "
                                f"{self.peer} now; retry later", request_id=rid, attempt=attempt)
        return None


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


Send = Callable[[Message, bytes | bytearray | memoryview], Awaitable[None]]


async def _serve_requests(
    stream: Stream,
    reader: FrameReader,
    handler: ExpertHandler,
    send: Send,
    *,
    hello: Hello,
    limits: WireLimits,
    drain_timeout_s: float,
    account: BudgetAccount,
    screen: _Screen,
    prove: Prove | None,
    lanes: Lanes | None = None,
) -> None:
    peer = stream.remote_peer_id
    slots = trio.Semaphore(limits.max_in_flight)
    in_flight: dict[RequestKey, trio.CancelScope] = {}

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

        async def run_one(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs, scope: trio.CancelScope) -> None:
            key = (req.request_id, req.attempt)
            try:
                response: ExpertResponse | None = None
                payload: bytes | bytearray | memoryview = b""
                with scope:
                    response, payload = await _compute(handler, req, rows, pairs, peer)
                if response is None or scope.cancelled_caught:
                    response = ExpertResponse(
                        request_id=req.request_id,
                        attempt=req.attempt,
                        status=Status.CANCELLED,
                        message="cancelled by the caller",
                    )
                    payload = b""
                await send(response, payload)
            except TransportError as exc:  # the stream is gone: nobody left to answer
                log.debug("expert stream from %s broke while answering: %r", peer, exc)
                nursery.cancel_scope.cancel()
            finally:
                if in_flight.get(key) is scope:
                    del in_flight[key]
                slots.release()

        async def prove_one(ch: HoldChallenge) -> None:
            try:
                await send(await _prove(prove, ch, peer), b"")
            except TransportError as exc:
                log.debug("expert stream from %s broke while answering a hold challenge: %r", peer, exc)
                nursery.cancel_scope.cancel()
            finally:
                slots.release()

        async def lane_one(offer: LaneOffer) -> None:
            try:
                await send(await _lane(lanes, offer, peer), b"")
            except TransportError as exc:
                log.debug("expert stream from %s broke while answering a lane offer: %r", peer, exc)
                nursery.cancel_scope.cancel()
            finally:
                slots.release()

        try:
            await _read_requests(
                reader, slots, in_flight, answer_error, run_one, nursery, hello, limits, peer, account, screen,
                prove_one, lambda p: send(p, b""), lane_one,
            )
        except TransportError as exc:
            log.debug("expert stream from %s ended: %r", peer, exc)
            nursery.cancel_scope.cancel()
        else:  # the peer is done sending: finish what is in flight, then close
            nursery.cancel_scope.deadline = trio.current_time() + drain_timeout_s


async def _read_requests(
    reader: FrameReader,
    slots: trio.Semaphore,
    in_flight: dict[RequestKey, trio.CancelScope],
    answer_error: Callable[[WireError], Awaitable[None]],
    run_one: Callable[[ExpertRequest, torch.Tensor, Pairs, trio.CancelScope], Awaitable[None]],
    nursery: trio.Nursery,
    hello: Hello,
    limits: WireLimits,
    peer: str,
    account: BudgetAccount,
    screen: _Screen,
    prove_one: Callable[[HoldChallenge], Awaitable[None]],
    send_proof: Callable[[HoldProof | LaneAnswer], Awaitable[None]],
    lane_one: Callable[[LaneOffer], Awaitable[None]],
) -> None:
    """Read and dispatch requests until the peer closes its side (returns) or framing is lost. The
    payload bytes the budget took for a frame go back when its request is answered or refused (and
    whatever a frame cut off mid-payload took, when the stream ends: ``serve_expert_stream``)."""

    async def run_then_give(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs, scope: trio.CancelScope,
                            n: int) -> None:
        try:
            await run_one(req, rows, pairs, scope)
        finally:
            account.give(n)

    while True:
        await acquire(slots)
        try:
            got = await reader.receive_message()
        except WireError as exc:
            account.give(reader.take_admitted())
            slots.release()
            refused = screen.refused
            screen.refused = None
            if isinstance(refused, HoldChallenge) and not exc.fatal:  # a hold challenge is answered by a HoldProof
                await send_proof(HoldProof(request_id=refused.request_id, attempt=refused.attempt, status=exc.code,
                                           message=exc.message))
                continue
            if isinstance(refused, LaneOffer) and not exc.fatal:  # a lane offer by a LaneAnswer
                await send_proof(LaneAnswer(request_id=refused.request_id, attempt=refused.attempt, status=exc.code,
                                            message=exc.message))
                continue
            log.info("bad frame from %s: %s (%s)", peer, exc.message, exc.code)
            await answer_error(exc)
            if exc.fatal:
                nursery.cancel_scope.cancel()
                return
            continue
        except BaseException:
            account.give(reader.take_admitted())
            slots.release()
            raise
        held = reader.take_admitted()
        if got is None:
            account.give(held)
            slots.release()
            return
        msg, payload = got
        if not isinstance(msg, ExpertRequest):
            account.give(held)
        if isinstance(msg, Cancel):
            slots.release()
            scope = in_flight.get((msg.request_id, msg.attempt))
            if scope is not None:
                scope.cancel()
            continue
        if isinstance(msg, HoldChallenge):
            nursery.start_soon(prove_one, msg)  # authorised, no payload (the screen saw to both); releases the slot
            continue
        if isinstance(msg, LaneOffer):
            nursery.start_soon(lane_one, msg)  # authorised, no payload; releases the slot
            continue
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
                    code=Status.DUPLICATE_REQUEST,
                    request_id=msg.request_id,
                    attempt=msg.attempt,
                )
            pairs = decode_pairs(msg, payload)
            rows = payload_to_tensor(rows_region(msg, payload), msg.dtype, msg.n_rows, msg.d_model)
        except WireError as exc:
            account.give(held)
            slots.release()
            await answer_error(exc)
            continue
        scope = trio.CancelScope()
        in_flight[key] = scope
        nursery.start_soon(run_then_give, msg, rows, pairs, scope, held)


async def _lane(lanes: Lanes | None, offer: LaneOffer, peer: str) -> LaneAnswer:
    """Answer a lane offer; an error status for any failure."""
    if lanes is None:
        return LaneAnswer(request_id=offer.request_id, attempt=offer.attempt, status=Status.UNSUPPORTED,
                          message="this server dials no lanes")
    try:
        return await lanes(offer, peer)
    except SwarmError as exc:
        return LaneAnswer(request_id=offer.request_id, attempt=offer.attempt, status=exc.code, message=exc.message)
    except Exception as exc:
        log.exception("lane offer from %s failed", peer)
        return LaneAnswer(request_id=offer.request_id, attempt=offer.attempt, status=Status.INTERNAL_ERROR,
                          message=f"lane failed: {type(exc).__name__}")


async def _prove(prove: Prove | None, ch: HoldChallenge, peer: str) -> HoldProof:
    """Answer a hold challenge; an error status for any failure."""
    if prove is None:
        return HoldProof(request_id=ch.request_id, attempt=ch.attempt, status=Status.SLICE_NOT_HELD,
                         message="this server answers no hold challenges")
    try:
        digest = await prove(ch)
    except SwarmError as exc:
        return HoldProof(request_id=ch.request_id, attempt=ch.attempt, status=exc.code, message=exc.message)
    except Exception as exc:
        log.exception("hold proof for %s:%s-%s failed (challenge from %s)", ch.layer, ch.lo, ch.hi, peer)
        return HoldProof(request_id=ch.request_id, attempt=ch.attempt, status=Status.INTERNAL_ERROR,
                         message=f"hold proof failed: {type(exc).__name__}")
    return HoldProof(request_id=ch.request_id, attempt=ch.attempt, status=Status.OK, digest=digest)


async def _compute(
    handler: ExpertHandler, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs, peer: str
) -> tuple[ExpertResponse, bytes | bytearray | memoryview]:
    """Run the handler; an error response for any failure, never a bad tensor."""
    arrived = trio.current_time()
    try:
        answer: torch.Tensor | Computed | BaseException = await handler(req, rows, pairs)
    except Exception as exc:
        answer = exc
    return expert_answer(req, answer, peer, served_s=trio.current_time() - arrived)


def expert_answer(req: ExpertRequest, answer: torch.Tensor | Computed | BaseException, peer: str, *,
                  served_s: float) -> tuple[ExpertResponse, bytes | bytearray | memoryview]:
    """The answer frame's header and payload for a handler's result (any thread): an error response
    for an exception (a ``SwarmError`` keeps its code), a result of the wrong shape or with NaN/inf;
    never a bad tensor."""

    def failure(code: str, message: str) -> tuple[ExpertResponse, bytes]:
        return ExpertResponse(
            request_id=req.request_id, attempt=req.attempt, status=code, message=message
        ), b""

    if isinstance(answer, SwarmError):
        return failure(answer.code, answer.message)
    if isinstance(answer, BaseException):
        log.error("expert handler failed on request %s/%s from %s", req.request_id, req.attempt, peer,
                  exc_info=answer)
        return failure(Status.INTERNAL_ERROR, f"expert computation failed: {type(answer).__name__}")
    out, compute_s = (answer.out, answer.compute_s) if isinstance(answer, Computed) else (answer, 0.0)
    want = (answer_rows(req), req.d_model)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        log.error("expert handler returned %s for request of shape %s", got, want)
        return failure(Status.INTERNAL_ERROR, f"expert computation returned {got}, expected {want}")
    if not out.is_floating_point() or not all_finite(out):
        return failure(NonFinite.code, "expert computation produced non-finite values")
    payload = tensor_to_payload(out, req.dtype)
    response = ExpertResponse(
        request_id=req.request_id,
        attempt=req.attempt,
        status=Status.OK,
        dtype=Dtype(req.dtype),
        n_rows=req.n_rows,
        n_pairs=req.n_pairs,
        d_model=req.d_model,
        served_us=max(0, int(served_s * 1e6)),
        compute_us=max(0, int(compute_s * 1e6)),
    )
    return response, payload


def expert_stream_handler(
    handler: ExpertHandler,
    *,
    hello: Hello | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
    authorize: Authorize | None = None,
    budget: ByteBudget | None = None,
    prove: Prove | None = None,
    lanes: Lanes | None = None,
) -> StreamHandler:
    """A transport stream handler serving ``handler`` on each inbound expert stream (``hello``
    defaults to this process's kernel id and ``limits``)."""
    our_hello = hello if hello is not None else _default_hello(limits)
    shared = budget if budget is not None else ByteBudget()  # one budget for all of this server's streams

    async def on_stream(stream: Stream) -> None:
        await serve_expert_stream(stream, handler, hello=our_hello, limits=limits, authorize=authorize, budget=shared,
                                  prove=prove, lanes=lanes)

    return on_stream


async def refuse_v1_stream(stream: Stream) -> None:
    """Answer a stream opened on ``V1_PROTOCOL_ID``: one fatal ``version_mismatch``, then close."""
    try:
        await stream.write(
            encode_frame(
                ErrorReply(code=VersionMismatch.code, message=version_mismatch_message(1), fatal=True)
            )
        )
    except TransportError as exc:
        log.debug("v1 expert stream from %s ended before its refusal: %r", stream.remote_peer_id, exc)
    finally:
        await quietly(stream.aclose, "closing a refused v1 expert stream", timeout_s=1, shield=True)


def set_expert_handlers(
    transport: Transport,
    handler: ExpertHandler,
    *,
    hello: Hello | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
    authorize: Authorize | None = None,
    budget: ByteBudget | None = None,
    prove: Prove | None = None,
    lanes: Lanes | None = None,
) -> None:
    """Serve ``handler`` on ``PROTOCOL_ID`` and refuse v1 streams (what every volunteer does)."""
    transport.set_stream_handler(
        PROTOCOL_ID,
        expert_stream_handler(handler, hello=hello, limits=limits, authorize=authorize, budget=budget, prove=prove,
                              lanes=lanes),
    )
    transport.set_stream_handler(V1_PROTOCOL_ID, refuse_v1_stream)
