"""The typed wire of the slice stream ``/moe-swarm/slice/1`` (pure: no sockets, no clock).

A volunteer downloading a slice asks another volunteer that holds it for raw slice bytes. The
framing is the expert stream's (DESIGN §11): ``u32 header_len | u32 payload_len | header |
payload``, little-endian lengths, ``header`` = msgpack of one ``SliceMessage`` (tagged by
``"type"``), so ``swarm.protocol.expert.FrameDecoder`` reads it.

Rules:
- The client opens ONE stream per peer for a whole download (py-libp2p 0.8.1 costs a multistream
  negotiation per new stream) and sends ``SliceRequest`` frames one at a time; the server answers
  each with exactly one frame: ``SliceData`` (payload = the bytes) or ``SliceErrorReply``, tagged with
  the request's ``request_id``, and keeps serving the stream after a refusal.
- A request names bytes ``[offset, offset + length)`` of the concatenation of the ``kind`` tensor
  data of experts ``e_lo .. e_hi-1`` (absolute expert indices of ``layer``) as stored in the GGUF,
  which is also how a slice file holds them: an expert larger than the request cap is read in
  several requests. ``length <= MAX_REQUEST_BYTES``; requests carry no payload.
- ``lease_id`` is the requester's lease from the market for the slice it downloads; the server
  serves only a lease whose holder is the stream's authenticated remote peer and whose slice
  contains the requested experts (``swarm.rpc.slice_server``).
- Error codes (``SliceCode``) are stable: ``not_assigned``, ``not_held``, ``too_large``,
  ``rate_limited`` (``retry_after_s`` set), ``busy``, ``bad_request``, ``opted_out``,
  ``internal_error``. ``fatal=True``: the server closes the stream after the frame (framing lost).
- Every byte received is checked by the downloader against the manifest's per-expert sha256: this
  protocol carries no integrity of its own beyond the transport's.
- Schema evolution: new fields get defaults; ``SliceRequest`` forbids unknown fields (a field we do
  not know could change which bytes are asked for); the answers tolerate them.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Final, Literal

import msgspec

from swarm.errors import LocalProtocolError, MalformedHeader
from swarm.protocol.expert import WireLimits

__all__ = [
    "CLIENT_LIMITS",
    "MAX_REQUEST_BYTES",
    "SERVER_LIMITS",
    "SLICE_PROTOCOL_ID",
    "SliceCode",
    "SliceData",
    "SliceErrorReply",
    "SliceKind",
    "SliceMessage",
    "SliceRequest",
    "decode_slice_message",
    "encode_slice_frame",
]

SLICE_PROTOCOL_ID: Final = "/moe-swarm/slice/1"
MAX_REQUEST_BYTES: Final = 8 << 20

_U32_MAX: Final = 2**32 - 1
U32 = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
SliceKind = Literal["gate", "up", "down", "gate_b", "up_b", "down_b"]  # the biases: gpt-oss

# what each side accepts: requests are small headers without payload; answers carry one request's bytes
SERVER_LIMITS: Final = WireLimits(max_header_bytes=4096, max_frame_bytes=4096)
CLIENT_LIMITS: Final = WireLimits(max_header_bytes=65536, max_frame_bytes=MAX_REQUEST_BYTES + 65536)


class SliceCode(enum.StrEnum):
    NOT_ASSIGNED = "not_assigned"  # no lease of the caller's for a slice holding these experts
    NOT_HELD = "not_held"  # this volunteer holds no slice with these experts
    TOO_LARGE = "too_large"  # length beyond MAX_REQUEST_BYTES (or the server's own cap)
    RATE_LIMITED = "rate_limited"  # over the upload rate: retry after retry_after_s
    BUSY = "busy"  # as many peers downloading as it serves at once, or the market cannot be asked
    BAD_REQUEST = "bad_request"  # undecodable, inconsistent or out of range
    OPTED_OUT = "opted_out"  # this volunteer does not share its slices
    INTERNAL_ERROR = "internal_error"


class SliceRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag="slice_request", tag_field="type", forbid_unknown_fields=True
):
    """Send bytes ``[offset, offset + length)`` of experts ``e_lo .. e_hi-1``'s ``kind`` data."""

    request_id: U32
    model_id: Annotated[str, msgspec.Meta(max_length=256)]
    layer: U32
    kind: SliceKind
    e_lo: U32
    e_hi: U32
    offset: NonNeg
    length: Annotated[int, msgspec.Meta(ge=1, le=2**62)]
    lease_id: Annotated[str, msgspec.Meta(max_length=128)]


class SliceData(msgspec.Struct, frozen=True, kw_only=True, tag="slice_data", tag_field="type"):
    """The bytes of request ``request_id`` (payload, exactly ``length`` bytes)."""

    request_id: U32
    length: NonNeg


class SliceErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="slice_error", tag_field="type"):
    """A refusal or error answering ``request_id`` (None: the frame could not be attributed)."""

    code: Annotated[str, msgspec.Meta(max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    request_id: U32 | None = None
    retry_after_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] | None = None
    fatal: bool = False


SliceMessage = SliceRequest | SliceData | SliceErrorReply

_PREFIX: Final = struct.Struct("<II")
_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(SliceMessage)


def encode_slice_frame(msg: SliceMessage, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame as a single buffer; ``LocalProtocolError`` for a payload beyond the request cap."""
    header = _ENCODER.encode(msg)
    n = memoryview(payload).nbytes
    if n > MAX_REQUEST_BYTES:
        raise LocalProtocolError(f"slice payload of {n} bytes exceeds {MAX_REQUEST_BYTES}", code="frame_too_large")
    return b"".join((_PREFIX.pack(len(header), n), header, payload))


def decode_slice_message(header: bytes | bytearray | memoryview) -> SliceMessage:
    """Decode one header; a defect raises ``MalformedHeader`` (not fatal: the framing is intact)."""
    try:
        return _DECODER.decode(header)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedHeader(f"invalid slice-stream header: {exc}") from exc
