"""The typed wire of the expert stream ``/moe-swarm/expert/1`` (pure: no sockets, no clock).

Frame (DESIGN §11)::

    u32 header_len | u32 payload_len | header | payload        (little-endian lengths)

``header`` is the msgpack encoding of one ``Message`` (a tagged union, tag field ``"type"``);
``payload`` is raw tensor bytes, row-major, little-endian, in the dtype the header names.

Rules:
- Each side's first frame is a ``Hello``. The caller then sends ``ExpertRequest`` frames and the
  server answers each with an ``ExpertResponse`` (status ``"ok"`` or an error code), tagged with
  the request's ``(request_id, attempt)``; answers may arrive in any order. ``ErrorReply`` answers
  a frame that could not be decoded or is not allowed at that point; ``fatal=True`` means the
  sender closes the stream after it.
- Peer input never trips an ``assert``. Every defect is a ``WireError`` (a ``RemoteProtocolError``)
  with a stable ``code``; ``fatal`` on the error says the framing is lost and the stream must be
  closed, otherwise the next frame can still be read.
- Hard limits (``WireLimits``) are checked before memory is committed: a header length beyond
  ``max_header_bytes`` is fatal (nothing of it is read); a frame beyond ``max_frame_bytes`` has
  its payload read and discarded in bounded chunks, so the stream stays usable.
- Schema evolution: new fields get defaults. ``Hello`` and the answers tolerate unknown fields (a
  newer peer's Hello must still decode so that versions can be compared; extra facts in an answer
  are safe to ignore). ``ExpertRequest`` forbids them: a field we do not know could change what
  the peer expects us to compute, so it is refused rather than silently ignored.
- Tensors: float32 and bfloat16 (bfloat16 travels as its raw 16-bit pattern). Encoding and
  decoding share memory with the tensor or receive buffer wherever the dtype allows.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Annotated, Final, NewType, Protocol

import msgspec

from swarm.errors import (
    BadIndex,
    BadShape,
    BrokenError,
    FrameTooLarge,
    LocalProtocolError,
    MalformedHeader,
    NonFinite,
    TooManyRows,
    UnsupportedDtype,
    WireError,
)

__all__ = [
    "DEFAULT_AGENT",
    "RequestKey",
    "make_hello",
    "version_mismatch_message",
    "DEFAULT_LIMITS",
    "PREFIX_BYTES",
    "PROTOCOL_ID",
    "PROTOCOL_VERSION",
    "SUPPORTED_DTYPES",
    "Dtype",
    "Status",
    "ErrorReply",
    "ExpertRequest",
    "ExpertResponse",
    "Frame",
    "FrameDecoder",
    "FrameReader",
    "Hello",
    "Message",
    "RequestId",
    "WireLimits",
    "choose_dtype",
    "decode_message",
    "encode_frame",
    "encode_message",
    "itemsize",
    "validate_request",
]

PROTOCOL_ID: Final = "/moe-swarm/expert/1"
PROTOCOL_VERSION: Final = 1



class Dtype(enum.StrEnum):
    """Activations on the wire (bfloat16 travels as its raw 16-bit pattern)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


SUPPORTED_DTYPES: Final[tuple[Dtype, ...]] = (Dtype.FLOAT32, Dtype.BFLOAT16)
_ITEMSIZE: Final[dict[str, int]] = {Dtype.FLOAT32: 4, Dtype.BFLOAT16: 2}


class Status(enum.StrEnum):
    """``ExpertResponse.status``: ``ok`` or the stable code of what went wrong (``swarm.errors``).

    The codes this version emits and acts on. Refusals (``draining``, ``slice_not_held``) are
    distinct from breaches and failures (``swarm.errors.remote_error``). The wire field stays an open
    string: a handler's ``SwarmError`` keeps its own code, and a newer peer's code is still reported.
    """

    OK = "ok"
    DRAINING = "draining"
    SLICE_NOT_HELD = "slice_not_held"
    INTERNAL_ERROR = "internal_error"
    REMOTE_PROTOCOL_ERROR = "remote_protocol_error"
    FRAME_TOO_LARGE = "frame_too_large"
    MALFORMED_HEADER = "malformed_header"
    UNEXPECTED_MESSAGE = "unexpected_message"
    BAD_SHAPE = "bad_shape"
    BAD_INDEX = "bad_index"
    NON_FINITE = "non_finite"
    TOO_MANY_ROWS = "too_many_rows"
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    VERSION_MISMATCH = "version_mismatch"

_PREFIX = struct.Struct("<II")
PREFIX_BYTES: Final = _PREFIX.size
_U32_MAX: Final = 2**32 - 1

RequestId = NewType("RequestId", int)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


# --------------------------------------------------------------------------------------------
# Messages


class WireLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Hard limits one side enforces on what it receives (and advertises in its ``Hello``)."""

    max_header_bytes: Annotated[int, msgspec.Meta(ge=256, le=_U32_MAX)] = 1 << 20
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=256, le=2 * _U32_MAX)] = 64 << 20
    max_rows: Annotated[int, msgspec.Meta(ge=1)] = 4096
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 16


DEFAULT_LIMITS: Final = WireLimits()


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello", tag_field="type"):
    """First frame from each side: what this peer speaks and accepts."""

    protocol_version: int
    dtypes: list[str]
    max_frame_bytes: PosInt
    max_rows: PosInt
    max_in_flight: PosInt = 16
    agent: str = ""  # role and software, e.g. "moe-swarm/0.1 volunteer"; for logs only
    kernel_id: str = ""  # the expert kernel's id (swarm.model.kernels); "" from peers before it existed


class ExpertRequest(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag="expert_request",
    tag_field="type",
    forbid_unknown_fields=True,
):
    """Compute, per row, the weighted sum of the listed experts of slice ``(model_id, layer, lo, hi)``.

    ``experts[i]`` are row i's expert indices relative to ``lo`` (so in ``[0, hi - lo)``) and
    ``weights[i]`` their router weights. Payload: rows ``[n_rows, d_model]`` in ``dtype``.
    """

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    model_id: str
    layer: NonNegInt
    lo: NonNegInt
    hi: NonNegInt
    n_rows: PosInt
    dtype: str
    d_model: PosInt
    experts: list[list[int]]
    weights: list[list[float]]


class ExpertResponse(msgspec.Struct, frozen=True, kw_only=True, tag="expert_response", tag_field="type"):
    """The answer to one request. ``status`` is ``"ok"`` or an error code (then no payload).

    Payload on ``"ok"``: partial sums ``[n_rows, d_model]`` in ``dtype``.
    """

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    status: str  # a ``Status``; an open set on the wire (a newer peer's code still decodes and is reported)
    message: str = ""
    dtype: str = Dtype.FLOAT32  # open like ``status``: an unknown dtype is an UnsupportedDtype error, not an undecodable frame
    n_rows: NonNegInt = 0
    d_model: NonNegInt = 0


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """An answer to a frame that could not be decoded or was not allowed.

    ``request_id``/``attempt`` are set when the frame could be attributed to a request.
    ``fatal``: the sender closes the stream after this frame.
    """

    code: str
    message: str
    request_id: RequestId | None = None
    attempt: int | None = None
    fatal: bool = False


Message = Hello | ExpertRequest | ExpertResponse | ErrorReply

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)


def encode_message(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode_message(header: bytes | bytearray | memoryview) -> Message:
    """Decode one header; a defect raises ``MalformedHeader`` (not fatal: the framing is intact)."""
    try:
        return _DECODER.decode(header)
    except msgspec.ValidationError as exc:
        raise MalformedHeader(f"invalid header: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise MalformedHeader(f"undecodable header: {exc}") from exc


def encode_frame(
    msg: Message, payload: bytes | bytearray | memoryview = b"", *, max_frame_bytes: int | None = None
) -> bytes:
    """One frame as a single buffer. Raises ``LocalProtocolError`` if it exceeds a limit."""
    header = _ENCODER.encode(msg)
    n_payload = memoryview(payload).nbytes
    if n_payload > _U32_MAX or len(header) > _U32_MAX:
        raise LocalProtocolError(
            f"frame part beyond 4 GiB ({n_payload} payload bytes)", code="frame_too_large"
        )
    if max_frame_bytes is not None and len(header) + n_payload > max_frame_bytes:
        raise LocalProtocolError(
            f"frame of {len(header) + n_payload} bytes exceeds the peer's limit of {max_frame_bytes}",
            code="frame_too_large",
        )
    return b"".join((_PREFIX.pack(len(header), n_payload), header, payload))


# --------------------------------------------------------------------------------------------
# Framing: a sans-IO decoder and a thin async reader around it


@dataclass(frozen=True, slots=True)
class Frame:
    """One received frame. ``payload`` is ``None`` when it exceeded the limit and was discarded."""

    header: bytes
    payload: bytearray | None
    payload_len: int


class FrameDecoder:
    """Incremental frame decoder: ``feed`` bytes, then call ``next_frame`` until it returns None.

    ``next_frame`` raises ``FrameTooLarge(fatal=True)`` for a header length beyond the limit (the
    decoder is then unusable) and ``BrokenError`` if the input ended inside a frame.
    """

    _PREFIX_STATE = 0
    _HEADER_STATE = 1
    _PAYLOAD_STATE = 2
    _SKIP_STATE = 3

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._buf = bytearray()
        self._state = self._PREFIX_STATE
        self._header_len = 0
        self._payload_len = 0
        self._header = b""
        self._payload = bytearray()
        self._filled = 0
        self._eof = False
        self._error: WireError | None = None

    @property
    def at_frame_boundary(self) -> bool:
        return self._state == self._PREFIX_STATE and not self._buf

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            raise LocalProtocolError("feed() after feed_eof()")
        if self._state == self._PAYLOAD_STATE and not self._buf:
            # the common case for large payloads: copy straight into the payload buffer
            view = memoryview(data).cast("B")
            take = min(len(view), self._payload_len - self._filled)
            self._payload[self._filled : self._filled + take] = view[:take]
            self._filled += take
            data = view[take:]
        self._buf += data

    def feed_eof(self) -> None:
        self._eof = True

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more input is needed (or the input ended cleanly)."""
        if self._error is not None:
            raise self._error
        while True:
            if self._state == self._PREFIX_STATE:
                if len(self._buf) < PREFIX_BYTES:
                    return self._need_more()
                self._header_len, self._payload_len = _PREFIX.unpack_from(self._buf)
                del self._buf[:PREFIX_BYTES]
                if self._header_len > self._limits.max_header_bytes:
                    self._error = FrameTooLarge(
                        f"header of {self._header_len} bytes exceeds the limit of "
                        f"{self._limits.max_header_bytes}; framing lost",
                        fatal=True,
                    )
                    raise self._error
                self._state = self._HEADER_STATE
            elif self._state == self._HEADER_STATE:
                if len(self._buf) < self._header_len:
                    return self._need_more()
                self._header = bytes(self._buf[: self._header_len])
                del self._buf[: self._header_len]
                if self._header_len + self._payload_len > self._limits.max_frame_bytes:
                    self._state = self._SKIP_STATE
                    self._filled = 0
                else:
                    self._state = self._PAYLOAD_STATE
                    self._payload = bytearray(self._payload_len)
                    self._filled = 0
            elif self._state == self._PAYLOAD_STATE:
                take = min(len(self._buf), self._payload_len - self._filled)
                if take:
                    self._payload[self._filled : self._filled + take] = memoryview(self._buf)[:take]
                    del self._buf[:take]
                    self._filled += take
                if self._filled < self._payload_len:
                    return self._need_more()
                frame = Frame(self._header, self._payload, self._payload_len)
                self._reset_frame()
                return frame
            else:  # skipping an oversized payload
                take = min(len(self._buf), self._payload_len - self._filled)
                del self._buf[:take]
                self._filled += take
                if self._filled < self._payload_len:
                    return self._need_more()
                frame = Frame(self._header, None, self._payload_len)
                self._reset_frame()
                return frame

    def _reset_frame(self) -> None:
        self._state = self._PREFIX_STATE
        self._header = b""
        self._payload = bytearray()
        self._filled = 0

    def _need_more(self) -> Frame | None:
        if self._eof and not self.at_frame_boundary:
            raise BrokenError("stream ended inside a frame")
        return None


class _Readable(Protocol):
    async def read(self, max_bytes: int) -> bytes: ...


class FrameReader:
    """Reads frames and messages from a stream (anything with ``async read(max_bytes)``)."""

    def __init__(
        self, stream: _Readable, limits: WireLimits = DEFAULT_LIMITS, *, read_size: int = 1 << 16
    ) -> None:
        self._stream = stream
        self._limits = limits
        self._decoder = FrameDecoder(limits)
        self._read_size = read_size
        self._eof = False

    async def receive_frame(self) -> Frame | None:
        """The next frame; None at a clean end of stream. Errors: ``WireError``, ``TransportError``."""
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                return frame
            if self._eof:
                return None
            data = await self._stream.read(self._read_size)
            if data:
                self._decoder.feed(data)
            else:
                self._eof = True
                self._decoder.feed_eof()

    async def receive_message(self) -> tuple[Message, bytearray] | None:
        """The next message and its payload; None at a clean end of stream.

        A payload beyond the limit raises ``FrameTooLarge`` and a request or answer with more than
        ``max_rows`` rows ``TooManyRows``, both attributed to the request and not fatal; an
        undecodable header raises ``MalformedHeader`` (not fatal).
        """
        frame = await self.receive_frame()
        if frame is None:
            return None
        msg = decode_message(frame.header)
        if isinstance(msg, ExpertRequest | ExpertResponse) and msg.n_rows > self._limits.max_rows:
            raise _attributed(
                TooManyRows, f"{msg.n_rows} rows exceed the limit of {self._limits.max_rows}", msg
            )
        if frame.payload is None:
            request_id = getattr(msg, "request_id", None)
            attempt = getattr(msg, "attempt", None)
            raise FrameTooLarge(
                f"frame of {len(frame.header) + frame.payload_len} bytes exceeds the limit of "
                f"{self._limits.max_frame_bytes}; payload discarded",
                request_id=request_id,
                attempt=attempt,
            )
        return msg, frame.payload


# --------------------------------------------------------------------------------------------
# Validation and dtype negotiation


def itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise UnsupportedDtype(f"unsupported dtype {dtype!r}; supported: {list(SUPPORTED_DTYPES)}") from None


def choose_dtype(preferred: str, ours: list[str] | tuple[str, ...], theirs: list[str]) -> Dtype:
    """The dtype to send: ``preferred`` if both sides support it, else float32, else any common one."""
    common = [d for d in SUPPORTED_DTYPES if d in ours and d in theirs]
    if not common:
        raise UnsupportedDtype(f"no common dtype: we support {list(ours)}, the peer supports {theirs}")
    for candidate in (preferred, Dtype.FLOAT32):
        for d in common:
            if d == candidate:
                return d
    return common[0]


def _attributed(cls: type[WireError], message: str, req: ExpertRequest | ExpertResponse) -> WireError:
    return cls(message, request_id=req.request_id, attempt=req.attempt)


def validate_request(
    req: ExpertRequest,
    payload_len: int,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    dtypes: list[str] | tuple[str, ...] = SUPPORTED_DTYPES,
) -> None:
    """Check a request against its payload and the limits; raise a ``WireError`` naming the defect."""
    if req.dtype not in dtypes or req.dtype not in _ITEMSIZE:
        raise _attributed(
            UnsupportedDtype, f"unsupported dtype {req.dtype!r}; supported: {list(dtypes)}", req
        )
    if req.hi <= req.lo:
        raise _attributed(BadShape, f"empty slice: lo={req.lo} hi={req.hi}", req)
    if req.n_rows > limits.max_rows:
        raise _attributed(TooManyRows, f"{req.n_rows} rows exceed the limit of {limits.max_rows}", req)
    if len(req.experts) != req.n_rows or len(req.weights) != req.n_rows:
        raise _attributed(
            BadShape,
            f"n_rows={req.n_rows} but {len(req.experts)} expert lists and {len(req.weights)} weight lists",
            req,
        )
    expected = req.n_rows * req.d_model * _ITEMSIZE[req.dtype]
    if payload_len != expected:
        raise _attributed(
            BadShape,
            f"payload of {payload_len} bytes, expected {expected} for [{req.n_rows}, {req.d_model}] {req.dtype}",
            req,
        )
    n_local = req.hi - req.lo
    if list(map(len, req.experts)) == list(map(len, req.weights)):
        # fast path over the flattened lists (C loops); the per-row loop below names the defect
        flat_experts = list(chain.from_iterable(req.experts))
        if (not flat_experts or (min(flat_experts) >= 0 and max(flat_experts) < n_local)) and all(
            map(math.isfinite, chain.from_iterable(req.weights))
        ):
            return
    for i, (experts, weights) in enumerate(zip(req.experts, req.weights, strict=True)):
        if len(experts) != len(weights):
            raise _attributed(BadShape, f"row {i}: {len(experts)} experts but {len(weights)} weights", req)
        for e in experts:
            if not 0 <= e < n_local:
                raise _attributed(
                    BadIndex,
                    f"row {i}: expert index {e} outside [0, {n_local}) of slice {req.lo}-{req.hi}",
                    req,
                )
        for w in weights:
            if not math.isfinite(w):
                raise _attributed(NonFinite, f"row {i}: non-finite router weight {w}", req)


# --------------------------------------------------------------------------------------------
# Hello


DEFAULT_AGENT: Final = "moe-swarm/0.1"
RequestKey = tuple[int, int]  # (request_id, attempt): what answers are routed by


def make_hello(
    limits: WireLimits = DEFAULT_LIMITS,
    *,
    agent: str = DEFAULT_AGENT,
    dtypes: Sequence[str] = SUPPORTED_DTYPES,
    kernel_id: str = "",
) -> Hello:
    """The Hello advertising ``limits`` and ``dtypes``."""
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        dtypes=list(dtypes),
        max_frame_bytes=limits.max_frame_bytes,
        max_rows=limits.max_rows,
        max_in_flight=limits.max_in_flight,
        agent=agent,
        kernel_id=kernel_id,
    )


def version_mismatch_message(theirs: int) -> str:
    return (
        f"protocol {PROTOCOL_ID} version mismatch: this peer speaks version {PROTOCOL_VERSION}, "
        f"the other side sent version {theirs}"
    )
