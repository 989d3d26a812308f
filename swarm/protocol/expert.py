"""The typed wire of the expert stream ``/moe-swarm/expert/2`` (pure: no sockets, no clock).

Frame (DESIGN §11)::

    u32 header_len | u32 payload_len | header | payload        (little-endian lengths)

``header`` is the msgpack encoding of one ``Message`` (a tagged union, tag field ``"type"``);
``payload`` is raw bytes, little-endian.

Request payload (v2), exactly ``request_payload_len(req)`` bytes::

    rows         [n_rows, d_model] in ``dtype``, row-major, zero-padded to a multiple of 8 bytes
    pair_row     u32[n_pairs]      row index into ``rows``
    pair_expert  u32[n_pairs]      expert index relative to ``lo``: in [0, hi - lo)
    pair_weight  f32[n_pairs]      router weight (always float32, whatever ``dtype``)

Pairs are sorted by (row, expert), unique, and every row has at least one pair (so
``n_rows <= n_pairs <= n_rows * (hi - lo)``). Response payload on ``ok``: each pair's weighted
expert output ``w * y_e(rows[r])`` ``[n_pairs, d_model]`` in ``dtype``, in the request's pair
order. Per pair, not per row: the coordinator adds all of a layer's pairs in ascending expert order
itself (``swarm.model.kernels.combine_pairs``), so the layer's result has the same bits however the
experts are split into ranges and whoever computed them (zero-started per-row sums of a range would
round differently under another partition). It costs ``n_pairs / n_rows`` times the bytes of
per-row sums (about 1-1.5 for top-k routing over a few ranges).

Rules:
- Each side's first frame is a ``Hello`` (``kernel_id`` required). The caller then sends
  ``ExpertRequest`` and ``Cancel`` frames; the server answers every request it accepted with
  exactly one ``ExpertResponse`` (status ``"ok"`` or an error code), tagged with the request's
  ``(request_id, attempt)``; answers may arrive in any order. ``Cancel`` of a request still
  queued or computing makes its one answer ``cancelled`` (no payload); a ``Cancel`` of a request
  already answered or never seen is ignored (the race is normal). ``ErrorReply`` answers a frame
  that could not be decoded or is not allowed at that point; ``fatal=True`` means the sender
  closes the stream after it.
- ``HoldChallenge`` (no payload) asks for a digest over random windows of a slice's tensor data;
  a server that answers it says so in its Hello (``features`` holds ``FEATURE_HOLD_PROOF``; a
  client sends none to a server whose Hello lacks it, an older one), and answers with exactly one
  ``HoldProof``, tagged like an expert answer (the coordinator's
  check that a volunteer really holds what its market lists, before it gets any work).
- ``LaneOffer`` (no payload; only to a server whose Hello offers ``FEATURE_LANE``) invites the
  volunteer to dial a direct data lane to the coordinator (``swarm.rpc.lane``): a TCP connection
  to ``host:port`` carrying the same frames, sealed with keys derived from the offer's ``secret``
  (sent over this authenticated, encrypted stream, so only this peer can open the lane). The
  answer is exactly one ``LaneAnswer`` (``ok`` once the lane's handshake is sent, or why not).
- Versions: a ``Hello`` of another ``protocol_version`` (even one that lacks fields this version
  requires) is refused with a fatal ``version_mismatch``; a v2 server answers a stream opened on
  ``V1_PROTOCOL_ID`` with one fatal ``version_mismatch`` ``ErrorReply`` and closes it.
- Peer input never trips an ``assert``. Every defect is a ``WireError`` (a ``RemoteProtocolError``)
  with a stable ``code``: ``bad_shape`` (lengths and counts), ``bad_index`` (a pair's row or
  expert out of range, pairs unsorted or repeated, a row without a pair), ``non_finite`` (a
  weight), ``unsupported_dtype``, ``too_many_rows``, ``frame_too_large``, ``malformed_header``,
  ``unexpected_message``, ``version_mismatch``; ``fatal`` on the error says the framing is lost
  and the stream must be closed, otherwise the next frame can still be read.
- Hard limits (``WireLimits``) are checked before memory is committed: a header length beyond
  ``max_header_bytes`` is fatal (nothing of it is read); a frame beyond ``max_frame_bytes`` has
  its payload read and discarded in bounded chunks, so the stream stays usable. A payload buffer
  grows with the bytes received, never by the declared length. A frame's header is decoded and
  judged (``FrameReader``'s ``screen``: authorisation, the header's own validity, a byte budget)
  before any of its payload is buffered; a refused payload is discarded as it arrives.
- Schema evolution: new fields get defaults. ``Hello``, ``Cancel`` and the answers tolerate
  unknown fields (a newer peer's Hello must still decode so that versions can be compared; extra
  facts in an answer are safe to ignore). ``ExpertRequest`` forbids them: a field we do not know
  could change what the peer expects us to compute, so it is refused rather than silently ignored.
- Tensors: float32 and bfloat16 (bfloat16 travels as its raw 16-bit pattern). Decoding shares
  memory with the receive buffer wherever the dtype allows (``swarm.rpc.tensors``).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Final, NewType, Protocol

import msgspec
import numpy as np

from swarm.errors import (
    BadShape,
    BrokenError,
    FrameTooLarge,
    LocalProtocolError,
    MalformedHeader,
    ReceiverBusy,
    TooManyRows,
    UnsupportedDtype,
    VersionMismatch,
    WireError,
)
from swarm.protocol.pairs import Pairs, attributed, check_pairs, make_pairs

__all__ = [
    "DEFAULT_AGENT",
    "DEFAULT_LIMITS",
    "PREFIX_BYTES",
    "PROTOCOL_ID",
    "PROTOCOL_VERSION",
    "SUPPORTED_DTYPES",
    "SUPPORTED_VERSIONS",
    "V1_PROTOCOL_ID",
    "Cancel",
    "Dtype",
    "ErrorReply",
    "ExpertRequest",
    "ExpertResponse",
    "Frame",
    "FrameDecoder",
    "FrameReader",
    "FEATURE_HOLD_PROOF",
    "FEATURE_LANE",
    "FEATURE_MULTI_RANGE",
    "FEATURE_ROW_SUMS",
    "LANE_ID_BYTES",
    "LANE_SECRET_BYTES",
    "LaneAnswer",
    "LaneOffer",
    "answer_rows",
    "Hello",
    "HoldChallenge",
    "HoldProof",
    "MAX_HOLD_WINDOWS",
    "MAX_HOLD_WINDOW_BYTES",
    "Message",
    "OnHeader",
    "Pairs",
    "RequestId",
    "RequestKey",
    "Screen",
    "Status",
    "WireLimits",
    "check_pairs",
    "choose_dtype",
    "decode_message",
    "decode_pairs",
    "encode_frame",
    "encode_message",
    "encode_request_payload",
    "itemsize",
    "make_hello",
    "make_pairs",
    "request_payload_len",
    "rows_nbytes",
    "rows_region",
    "validate_request",
    "version_mismatch_message",
]

PROTOCOL_ID: Final = "/moe-swarm/expert/2"
PROTOCOL_VERSION: Final = 2
V1_PROTOCOL_ID: Final = "/moe-swarm/expert/1"  # refused: one fatal ``version_mismatch``
SUPPORTED_VERSIONS: Final[tuple[int, ...]] = (PROTOCOL_VERSION,)  # what a volunteer's heartbeat lists


class Dtype(enum.StrEnum):
    """Activations on the wire (bfloat16 travels as its raw 16-bit pattern)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


SUPPORTED_DTYPES: Final[tuple[Dtype, ...]] = (Dtype.FLOAT32, Dtype.BFLOAT16)
_ITEMSIZE: Final[dict[str, int]] = {Dtype.FLOAT32: 4, Dtype.BFLOAT16: 2}


class Status(enum.StrEnum):
    """``ExpertResponse.status``: ``ok``, ``cancelled`` or the stable code of what went wrong.

    The codes this version emits and acts on. Refusals (``draining``, ``slice_not_held``,
    ``not_authorized``) are distinct from breaches and failures (``swarm.errors.remote_error``).
    The wire field stays an open string: a handler's ``SwarmError`` keeps its own code, and a
    newer peer's code is still reported.
    """

    OK = "ok"
    CANCELLED = "cancelled"
    DRAINING = "draining"
    SLICE_NOT_HELD = "slice_not_held"
    NOT_AUTHORIZED = "not_authorized"
    BUSY = "busy"  # the receiver holds all the request bytes it accepts now
    UNSUPPORTED = "unsupported"  # the peer's Hello does not offer the feature asked for (an older peer)
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
    DUPLICATE_REQUEST = "duplicate_request"


_PREFIX = struct.Struct("<II")
PREFIX_BYTES: Final = _PREFIX.size
_U32_MAX: Final = 2**32 - 1
_PAIR_BYTES: Final = 12  # u32 row + u32 expert + f32 weight

RequestId = NewType("RequestId", int)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
PosU32 = Annotated[int, msgspec.Meta(ge=1, le=_U32_MAX)]


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
    """First frame from each side: what this peer speaks and accepts.

    ``kernel_id`` (required from v2 on): the peer's expert kernel (``swarm.model.kernels``): name,
    version and every build flag that changes numerics. Equal ids give equal bits (DESIGN §3).
    """

    protocol_version: int
    kernel_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    dtypes: list[str]
    max_frame_bytes: PosInt
    max_rows: PosInt
    max_in_flight: PosInt = 16
    agent: str = ""  # role and software, e.g. "moe-swarm/0.2 volunteer"; for logs only
    # optional messages this peer answers (``FEATURE_HOLD_PROOF``); absent in older peers' Hellos
    features: Annotated[list[Annotated[str, msgspec.Meta(max_length=64)]], msgspec.Meta(max_length=32)] = []


class _HelloVersion(msgspec.Struct, frozen=True, tag="hello", tag_field="type"):
    """Just the version of a Hello that does not decode as ours (another version's shape)."""

    protocol_version: int


class ExpertRequest(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag="expert_request",
    tag_field="type",
    forbid_unknown_fields=True,
    omit_defaults=True,  # a field at its default is not sent: older servers, which forbid unknown fields, read it
):
    """Compute, per row, the weighted sum of its paired experts of slice ``(model_id, layer, lo, hi)``.

    The payload (module docstring) carries the rows and ``n_pairs`` (row, expert, weight) pairs.
    """

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    model_id: Annotated[str, msgspec.Meta(max_length=256)]
    layer: U32
    lo: U32
    hi: U32
    n_rows: PosU32
    d_model: PosU32
    n_pairs: PosU32
    dtype: str
    # answer each row's sum over its pairs (ascending expert, from zero: DESIGN §3) instead of the
    # per-pair outputs; only to a server whose Hello offers ``FEATURE_ROW_SUMS``, and only when the
    # request carries every routed pair of its rows (then the sum is the layer's output for them)
    sum_rows: bool = False


def answer_rows(req: ExpertRequest) -> int:
    """Rows of the answer to ``req``: one per pair, or one per row with ``sum_rows``."""
    return req.n_rows if req.sum_rows else req.n_pairs


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag="cancel", tag_field="type"):
    """The caller no longer wants the answer to ``(request_id, attempt)`` (a hedge's loser)."""

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt


class ExpertResponse(msgspec.Struct, frozen=True, kw_only=True, tag="expert_response", tag_field="type"):
    """The one answer to a request. ``status`` is ``"ok"``, ``"cancelled"`` or an error code.

    Payload on ``"ok"``: the weighted per-pair outputs ``[n_pairs, d_model]`` in ``dtype``, in the
    request's pair order (with ``sum_rows``: the rows' sums ``[n_rows, d_model]``); otherwise none. ``n_rows``/``n_pairs``/``d_model`` echo the request's.
    """

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    status: str  # a ``Status``; an open set on the wire (a newer peer's code still decodes and is reported)
    message: str = ""
    dtype: str = Dtype.FLOAT32  # open like ``status``: an unknown dtype is an UnsupportedDtype error, not an undecodable frame
    n_rows: NonNegInt = 0
    n_pairs: NonNegInt = 0
    d_model: NonNegInt = 0
    # how the server spent the call (facts for the caller's breakdown, never trusted for a decision):
    # microseconds from the request's arrival to its answer, and of those computing
    served_us: NonNegInt = 0
    compute_us: NonNegInt = 0


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """An answer to a frame that could not be decoded or was not allowed.

    ``request_id``/``attempt`` are set when the frame could be attributed to a request.
    ``fatal``: the sender closes the stream after this frame. (The same shape as in v1, so a v1
    peer can read the ``version_mismatch`` it gets.)
    """

    code: str
    message: str
    request_id: RequestId | None = None
    attempt: int | None = None
    fatal: bool = False


FEATURE_HOLD_PROOF: Final = "hold_proof"  # a Hello's ``features``: this server answers ``HoldChallenge``
# a Hello's ``features``: this server answers ``sum_rows`` requests (per-row sums instead of per-pair outputs)
FEATURE_ROW_SUMS: Final = "row_sums"
# a Hello's ``features``: this server answers a request whose ``[lo, hi)`` spans several slices it holds
# side by side (a coordinator sends one call per peer per layer instead of one per range)
FEATURE_MULTI_RANGE: Final = "multi_range"
# a Hello's ``features``: this server dials a direct data lane when offered one (``LaneOffer``)
FEATURE_LANE: Final = "lane"
LANE_ID_BYTES: Final = 16
LANE_SECRET_BYTES: Final = 32
MAX_HOLD_WINDOWS: Final = 16
MAX_HOLD_WINDOW_BYTES: Final = 1 << 20


class HoldChallenge(
    msgspec.Struct, frozen=True, kw_only=True, tag="hold_challenge", tag_field="type", forbid_unknown_fields=True
):
    """Prove you hold slice ``(model_id, layer, lo, hi)`` (DESIGN §12 "proved it holds it").

    The answer is a ``HoldProof`` whose ``digest`` is ``sha256(nonce || the slice's tensor data at
    each window)``; the tensor data is the slice file after its safetensors header (gate, up, down
    bytes in that order, then the experts' biases where they have them: ``swarm.model.slices.hold_digest``). The caller picks ``nonce`` and the
    windows at random, so no answer can be precomputed or replayed, and checks them against its
    own copy of the model. No payload.
    """

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    model_id: Annotated[str, msgspec.Meta(max_length=256)]
    layer: U32
    lo: U32
    hi: U32
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
    # (offset, length) into the tensor data; lengths 1 .. MAX_HOLD_WINDOW_BYTES
    windows: Annotated[list[tuple[NonNegInt, PosInt]], msgspec.Meta(min_length=1, max_length=MAX_HOLD_WINDOWS)]


class HoldProof(msgspec.Struct, frozen=True, kw_only=True, tag="hold_proof", tag_field="type"):
    """The one answer to a ``HoldChallenge``: ``status`` ``ok`` with the digest and the size of the
    slice's tensor data, or a refusal/error code (``slice_not_held``, ``bad_shape`` for a window
    past the data, ...). No payload."""

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    status: str
    message: str = ""
    data_bytes: NonNegInt = 0
    digest: bytes = b""


class LaneOffer(
    msgspec.Struct, frozen=True, kw_only=True, tag="lane_offer", tag_field="type", forbid_unknown_fields=True
):
    """Dial a data lane to ``host:port`` and present ``lane_id``; frames on it are sealed with keys
    derived from ``secret`` (``swarm.rpc.lane``). Sent by a coordinator over the authenticated expert
    stream, so the lane belongs to that stream's peer. No payload."""

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    lane_id: Annotated[bytes, msgspec.Meta(min_length=LANE_ID_BYTES, max_length=LANE_ID_BYTES)]
    secret: Annotated[bytes, msgspec.Meta(min_length=LANE_SECRET_BYTES, max_length=LANE_SECRET_BYTES)]
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]


class LaneAnswer(msgspec.Struct, frozen=True, kw_only=True, tag="lane_answer", tag_field="type"):
    """The one answer to a ``LaneOffer``: ``ok`` (the lane is dialled and its handshake sent) or why
    not (``not_authorized``, ``unsupported``, ``busy``, ``internal_error`` for a failed dial...)."""

    request_id: Annotated[RequestId, msgspec.Meta(ge=0)]
    attempt: NonNegInt
    status: str
    message: str = ""


Message = Hello | ExpertRequest | Cancel | ExpertResponse | ErrorReply | HoldChallenge | HoldProof | LaneOffer | LaneAnswer

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)
_VERSION_DECODER: Final = msgspec.msgpack.Decoder(_HelloVersion)


def encode_message(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode_message(header: bytes | bytearray | memoryview) -> Message:
    """Decode one header; a defect raises ``MalformedHeader`` (not fatal: the framing is intact).

    A Hello of another protocol version that does not decode as ours (v1 had no ``kernel_id``)
    raises ``VersionMismatch`` (fatal), so the peer learns why, not just that it was malformed.
    """
    try:
        return _DECODER.decode(header)
    except msgspec.ValidationError as exc:
        try:
            theirs = _VERSION_DECODER.decode(header).protocol_version
        except (msgspec.ValidationError, msgspec.DecodeError):
            theirs = PROTOCOL_VERSION
        if theirs != PROTOCOL_VERSION:
            raise VersionMismatch(version_mismatch_message(theirs), fatal=True) from exc
        raise MalformedHeader(f"invalid header: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise MalformedHeader(f"undecodable header: {exc}") from exc


Buffer = bytes | bytearray | memoryview


def encode_frame(
    msg: Message, payload: Buffer | Sequence[Buffer] = b"", *, max_frame_bytes: int | None = None
) -> bytes:
    """One frame as a single buffer; ``payload`` may be given in parts (joined, copied once).

    Raises ``LocalProtocolError`` if it exceeds a limit.
    """
    header = _ENCODER.encode(msg)
    parts: Sequence[Buffer] = (payload,) if isinstance(payload, bytes | bytearray | memoryview) else payload
    n_payload = sum(memoryview(p).nbytes for p in parts)
    if n_payload > _U32_MAX or len(header) > _U32_MAX:
        raise LocalProtocolError(
            f"frame part beyond 4 GiB ({n_payload} payload bytes)", code="frame_too_large"
        )
    if max_frame_bytes is not None and len(header) + n_payload > max_frame_bytes:
        raise LocalProtocolError(
            f"frame of {len(header) + n_payload} bytes exceeds the peer's limit of {max_frame_bytes}",
            code="frame_too_large",
        )
    return b"".join((_PREFIX.pack(len(header), n_payload), header, *parts))


# --------------------------------------------------------------------------------------------
# Framing: a sans-IO decoder and a thin async reader around it


@dataclass(frozen=True, slots=True)
class Frame:
    """One received frame. ``payload`` is ``None`` when it exceeded the limit and was discarded, or
    when the decoder's ``on_header`` refused it (``refusal``: the error to raise about the frame,
    its payload discarded unbuffered)."""

    header: bytes
    payload: bytearray | None
    payload_len: int
    refusal: WireError | None = None


# asked once a frame's header is in, before any of its payload is buffered: None buffers the payload
# (the hook may have reserved ``payload_len`` bytes for it); a ``WireError`` is the frame's ``refusal``,
# out at once, and its payload is discarded as it arrives
OnHeader = Callable[[bytes, int], WireError | None]


class FrameDecoder:
    """Incremental frame decoder: ``feed`` bytes, then call ``next_frame`` until it returns None.

    ``next_frame`` raises ``FrameTooLarge(fatal=True)`` for a header length beyond the limit (the
    decoder is then unusable) and ``BrokenError`` if the input ended inside a frame.
    """

    _PREFIX_STATE = 0
    _HEADER_STATE = 1
    _PAYLOAD_STATE = 2
    _SKIP_STATE = 3

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, *, on_header: OnHeader | None = None) -> None:
        """``on_header(header, payload_len)``, if given, is asked once a frame's header is in and
        before any of its payload is buffered (frames within the size limit only): ``None`` buffers
        the payload; a ``WireError`` makes the frame come out at once with that ``refusal`` (no
        payload), and its payload is discarded as it arrives."""
        self._limits = limits
        self._on_header = on_header
        self._skip_silently = False  # the frame being skipped was refused and already came out
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
            self._payload += view[:take]
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
                refusal = None
                if self._header_len + self._payload_len > self._limits.max_frame_bytes:
                    self._state = self._SKIP_STATE
                    self._filled = 0
                elif self._on_header is not None and (refusal := self._on_header(self._header, self._payload_len)):
                    # refused: out at once (the sender learns now, not after its payload), the payload
                    # skipped as it arrives by the next calls
                    self._state = self._SKIP_STATE
                    self._filled = 0
                    self._skip_silently = True
                    return Frame(self._header, None, self._payload_len, refusal=refusal)
                else:
                    self._state = self._PAYLOAD_STATE
                    self._payload = bytearray()  # grows with the bytes received, never by the declared length
                    self._filled = 0
            elif self._state == self._PAYLOAD_STATE:
                take = min(len(self._buf), self._payload_len - self._filled)
                if take:
                    self._payload += memoryview(self._buf)[:take]
                    del self._buf[:take]
                    self._filled += take
                if self._filled < self._payload_len:
                    return self._need_more()
                frame = Frame(self._header, self._payload, self._payload_len)
                self._reset_frame()
                return frame
            else:  # skipping an oversized or refused payload
                take = min(len(self._buf), self._payload_len - self._filled)
                del self._buf[:take]
                self._filled += take
                if self._filled < self._payload_len:
                    return self._need_more()
                if self._skip_silently:  # its frame came out when the header was refused
                    self._skip_silently = False
                    self._reset_frame()
                    continue
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


# a server's check of a request before its payload is buffered (authorisation, byte budget): None buffers it
# (and, for a payload, means the caller now owes ``payload_len`` bytes back), a ``WireError`` discards it
Screen = Callable[[Message, int], WireError | None]


class FrameReader:
    """Reads frames and messages from a stream (anything with ``async read(max_bytes)``).

    Each frame's header is decoded as soon as it is in, before any of its payload is buffered; then
    (frames within the size limit) the row limit is checked, ``screen(message, payload_len)`` is
    asked (the server's authorisation and byte budget: ``None`` buffers the payload, a ``WireError``
    is raised at once and the payload is discarded unbuffered as it arrives), then ``admit(n)`` for a payload
    of ``n > 0`` bytes (``False`` discards it and raises ``ReceiverBusy``). The bytes a ``screen``
    passed or ``admit`` accepted are owed back by the caller (``take_admitted``), counted from the
    moment they were admitted: a frame that never completes (the stream ended, broke or was
    cancelled mid-payload) is owed back too. Without ``screen`` or ``admit`` no header is decoded before
    its frame is complete (``receive_frame`` then serves other protocols' frames too: the slice stream).
    """

    def __init__(
        self,
        stream: _Readable,
        limits: WireLimits = DEFAULT_LIMITS,
        *,
        read_size: int = 1 << 16,
        admit: Callable[[int], bool] | None = None,
        screen: Screen | None = None,
    ) -> None:
        self._stream = stream
        self._limits = limits
        # headers are judged before their payloads only when someone judges them (``receive_frame`` alone --
        # the slice protocol's frames -- decodes nothing)
        self._judging = admit is not None or screen is not None
        self._decoder = FrameDecoder(limits, on_header=self._on_header if self._judging else None)
        self._admit = admit
        self._screen = screen
        self._admitted = 0  # bytes admitted (the frame in progress and returned ones), not yet claimed
        self._head: Message | None = None  # the decoded header of the frame in progress
        self._read_size = read_size
        self._eof = False

    def _on_header(self, header: bytes, payload_len: int) -> WireError | None:
        self._head = None
        try:
            msg = decode_message(header)
        except WireError as exc:  # undecodable: nothing to attribute or reserve; raised once the payload passed
            return exc
        self._head = msg
        if isinstance(msg, ExpertRequest | ExpertResponse) and msg.n_rows > self._limits.max_rows:
            return attributed(TooManyRows, f"{msg.n_rows} rows exceed the limit of {self._limits.max_rows}", msg)
        if self._screen is not None:
            refusal = self._screen(msg, payload_len)
            if refusal is not None:
                return refusal
            self._admitted += payload_len
        if self._admit is not None and payload_len:
            if not self._admit(payload_len):
                return ReceiverBusy(
                    f"{payload_len} payload bytes are more than this receiver accepts now; retry later",
                    request_id=getattr(msg, "request_id", None),
                    attempt=getattr(msg, "attempt", None),
                )
            self._admitted += payload_len
        return None

    @property
    def mid_frame(self) -> bool:
        """Part of a frame has arrived and the rest has not."""
        return not self._decoder.at_frame_boundary

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

    def take_admitted(self) -> int:
        """The payload bytes admitted since the last call (``screen``/``admit``), once: the caller owes
        them back when it is done with the payload (or with the stream)."""
        n, self._admitted = self._admitted, 0
        return n

    async def receive_message(self) -> tuple[Message, bytearray] | None:
        """The next message and its payload; None at a clean end of stream.

        A payload beyond the limit raises ``FrameTooLarge`` and a request or answer with more than
        ``max_rows`` rows ``TooManyRows``, both attributed to the request and not fatal; an
        undecodable header raises ``MalformedHeader`` (not fatal); a frame ``screen`` or ``admit``
        refused raises its refusal as soon as its header is in (its payload is skipped by the next calls,
    unbuffered); the others once the frame's payload has passed, unbuffered.
        """
        frame = await self.receive_frame()
        if frame is None:
            return None
        if frame.refusal is not None:
            self._head = None
            raise frame.refusal
        msg = self._head if self._head is not None else decode_message(frame.header)
        self._head = None
        if not self._judging and isinstance(msg, ExpertRequest | ExpertResponse) and msg.n_rows > self._limits.max_rows:
            raise attributed(TooManyRows, f"{msg.n_rows} rows exceed the limit of {self._limits.max_rows}", msg)
        if frame.payload is None:
            raise FrameTooLarge(
                f"frame of {len(frame.header) + frame.payload_len} bytes exceeds the limit of "
                f"{self._limits.max_frame_bytes}; payload discarded",
                request_id=getattr(msg, "request_id", None),
                attempt=getattr(msg, "attempt", None),
            )
        return msg, frame.payload


# --------------------------------------------------------------------------------------------
# Payload layout and validation


def itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise UnsupportedDtype(f"unsupported dtype {dtype!r}; supported: {list(SUPPORTED_DTYPES)}") from None


def rows_nbytes(n_rows: int, d_model: int, dtype: str) -> int:
    """Bytes of the rows ``[n_rows, d_model]`` in ``dtype`` (without the padding)."""
    return n_rows * d_model * itemsize(dtype)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def request_payload_len(req: ExpertRequest) -> int:
    """The exact payload length of ``req``: padded rows, then 12 bytes per pair."""
    return _pad8(rows_nbytes(req.n_rows, req.d_model, req.dtype)) + _PAIR_BYTES * req.n_pairs


def rows_region(req: ExpertRequest, payload: Buffer) -> memoryview:
    """The rows' bytes of a request payload (a view, no copy)."""
    return memoryview(payload)[: rows_nbytes(req.n_rows, req.d_model, req.dtype)]


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


def validate_request(
    req: ExpertRequest,
    payload_len: int,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    dtypes: list[str] | tuple[str, ...] = SUPPORTED_DTYPES,
) -> None:
    """Check a request's header against its payload length and the limits (``WireError`` naming
    the defect). The pair arrays themselves are checked by ``decode_pairs`` / ``check_pairs``."""
    if req.dtype not in dtypes or req.dtype not in _ITEMSIZE:
        raise attributed(
            UnsupportedDtype, f"unsupported dtype {req.dtype!r}; supported: {list(dtypes)}", req
        )
    if req.hi <= req.lo:
        raise attributed(BadShape, f"empty slice: lo={req.lo} hi={req.hi}", req)
    if req.n_rows > limits.max_rows:
        raise attributed(TooManyRows, f"{req.n_rows} rows exceed the limit of {limits.max_rows}", req)
    n_local = req.hi - req.lo
    if not req.n_rows <= req.n_pairs <= req.n_rows * n_local:
        raise attributed(
            BadShape,
            f"n_pairs={req.n_pairs} outside [{req.n_rows}, {req.n_rows * n_local}] for {req.n_rows} rows "
            f"of slice {req.lo}-{req.hi} (every row has a pair, no pair twice)",
            req,
        )
    expected = request_payload_len(req)
    if payload_len != expected:
        raise attributed(
            BadShape,
            f"payload of {payload_len} bytes, expected {expected} for [{req.n_rows}, {req.d_model}] "
            f"{req.dtype} (padded to 8) + {req.n_pairs} pairs of 12 bytes",
            req,
        )


def decode_pairs(req: ExpertRequest, payload: Buffer) -> Pairs:
    """The pairs of a request whose header passed ``validate_request`` (views of ``payload``),
    checked by ``check_pairs``."""
    off = _pad8(rows_nbytes(req.n_rows, req.d_model, req.dtype))
    n = req.n_pairs
    view = memoryview(payload)
    if view.nbytes != off + _PAIR_BYTES * n:
        raise attributed(BadShape, f"payload of {view.nbytes} bytes, expected {off + _PAIR_BYTES * n}", req)
    pairs = Pairs(
        np.frombuffer(view, dtype="<u4", count=n, offset=off),
        np.frombuffer(view, dtype="<u4", count=n, offset=off + 4 * n),
        np.frombuffer(view, dtype="<f4", count=n, offset=off + 8 * n),
    )
    check_pairs(req, pairs)
    return pairs


def encode_request_payload(req: ExpertRequest, rows: Buffer, pairs: Pairs) -> tuple[Buffer, ...]:
    """The payload parts of ``req``: rows, zero padding to 8 bytes, the three pair arrays."""
    pad = _pad8(memoryview(rows).nbytes) - memoryview(rows).nbytes
    return (rows, bytes(pad), *pairs.parts()) if pad else (rows, *pairs.parts())


# --------------------------------------------------------------------------------------------
# Hello


DEFAULT_AGENT: Final = "moe-swarm/0.2"
RequestKey = tuple[int, int]  # (request_id, attempt): what answers are routed by


def make_hello(
    limits: WireLimits = DEFAULT_LIMITS,
    *,
    kernel_id: str,
    agent: str = DEFAULT_AGENT,
    dtypes: Sequence[str] = SUPPORTED_DTYPES,
    features: Sequence[str] = (),
) -> Hello:
    """The Hello advertising ``limits``, ``dtypes``, the expert kernel ``kernel_id`` and ``features``."""
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        kernel_id=kernel_id,
        dtypes=list(dtypes),
        max_frame_bytes=limits.max_frame_bytes,
        max_rows=limits.max_rows,
        max_in_flight=limits.max_in_flight,
        agent=agent,
        features=list(features),
    )


def version_mismatch_message(theirs: int | str) -> str:
    return (
        f"expert protocol version mismatch: this peer speaks {PROTOCOL_ID} (version {PROTOCOL_VERSION}), "
        f"the other side sent version {theirs}"
    )
