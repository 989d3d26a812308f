"""The expert wire: frame format, sans-IO decoding under every chunking, limits, validation, tensors."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from swarm.errors import (
    BrokenError,
    FrameTooLarge,
    LocalProtocolError,
    MalformedHeader,
    RemoteProtocolError,
    WireError,
)
from swarm.protocol.expert import (
    PROTOCOL_ID,
    PROTOCOL_VERSION,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    Frame,
    FrameDecoder,
    FrameReader,
    Hello,
    Message,
    RequestId,
    WireLimits,
    choose_dtype,
    decode_message,
    encode_frame,
    encode_message,
    make_hello,
    validate_request,
)
from swarm.rpc.tensors import payload_to_tensor, tensor_to_payload


def request(**changes: Any) -> ExpertRequest:
    base = ExpertRequest(
        request_id=RequestId(7),
        attempt=1,
        model_id="tiny-0123456789ab",
        layer=2,
        lo=8,
        hi=12,
        n_rows=2,
        dtype="float32",
        d_model=3,
        experts=[[0, 3], [1]],
        weights=[[0.6, 0.4], [1.0]],
    )
    return msgspec.structs.replace(base, **changes)


MESSAGES: list[Message] = [
    Hello(
        protocol_version=1, dtypes=["float32", "bfloat16"], max_frame_bytes=1 << 20, max_rows=64, agent="t"
    ),
    request(),
    ExpertResponse(request_id=RequestId(7), attempt=1, status="ok", dtype="float32", n_rows=2, d_model=3),
    ExpertResponse(request_id=RequestId(8), attempt=0, status="bad_index", message="row 0: ..."),
    ErrorReply(code="malformed_header", message="undecodable", fatal=True),
]


def test_protocol_constants() -> None:
    assert PROTOCOL_ID == "/moe-swarm/expert/1"
    assert PROTOCOL_VERSION == 1


def test_frame_layout_is_exactly_the_documented_one() -> None:
    payload = bytes(range(24))
    frame = encode_frame(request(), payload)
    header_len, payload_len = struct.unpack_from("<II", frame)
    assert payload_len == 24
    assert len(frame) == 8 + header_len + payload_len
    assert frame[8 + header_len :] == payload
    header = msgspec.msgpack.decode(frame[8 : 8 + header_len])
    assert header["type"] == "expert_request"
    assert header["request_id"] == 7 and header["attempt"] == 1 and header["lo"] == 8 and header["hi"] == 12
    assert header["experts"] == [[0, 3], [1]]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_any_chunking(msg: Message, rng: random.Random) -> None:
    payload = rng.randbytes(rng.randrange(0, 300))
    stream = encode_frame(msg, payload) * 3
    for chunking in ("bytewise", "random", "whole"):
        decoder = FrameDecoder()
        frames: list[Frame] = []
        pos = 0
        while pos < len(stream):
            step = {"bytewise": 1, "random": rng.randrange(1, 64), "whole": len(stream)}[chunking]
            decoder.feed(stream[pos : pos + step])
            pos += step
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
        decoder.feed_eof()
        assert decoder.next_frame() is None
        assert len(frames) == 3
        for frame in frames:
            assert decode_message(frame.header) == msg
            assert frame.payload == payload and isinstance(frame.payload, bytearray)


def test_a_header_length_beyond_the_limit_is_fatal_before_reading_it() -> None:
    decoder = FrameDecoder(WireLimits(max_header_bytes=1024))
    decoder.feed(struct.pack("<II", 1025, 0))
    with pytest.raises(FrameTooLarge) as info:
        decoder.next_frame()
    assert info.value.fatal and info.value.code == "frame_too_large"
    assert isinstance(info.value, RemoteProtocolError)
    decoder.feed(b"more")
    with pytest.raises(FrameTooLarge):  # stays broken
        decoder.next_frame()


def test_an_oversized_payload_is_discarded_and_the_next_frame_still_decodes() -> None:
    decoder = FrameDecoder(WireLimits(max_frame_bytes=1000))
    big = encode_frame(request(), bytes(5000))
    small = encode_frame(MESSAGES[2], bytes(24))
    cut = 8 + struct.unpack_from("<I", big)[0] + 3000
    decoder.feed(big[:cut])
    assert decoder.next_frame() is None
    assert len(decoder._buf) == 0  # nothing of the oversized payload is kept
    decoder.feed(big[cut:] + small)
    skipped = decoder.next_frame()
    assert skipped is not None and skipped.payload is None and skipped.payload_len == 5000
    assert decode_message(skipped.header) == request()
    ok = decoder.next_frame()
    assert ok is not None and ok.payload == bytes(24)


def test_end_of_input_inside_a_frame_is_broken_not_silent() -> None:
    frame = encode_frame(request(), bytes(24))
    for cut in (3, 8, 20, len(frame) - 1):
        decoder = FrameDecoder()
        decoder.feed(frame[:cut])
        decoder.feed_eof()
        with pytest.raises(BrokenError):
            decoder.next_frame()
    decoder = FrameDecoder()
    decoder.feed(frame)
    decoder.feed_eof()
    assert decoder.next_frame() is not None
    assert decoder.next_frame() is None


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (b"\xc1", "reserved msgpack byte"),
        (msgspec.msgpack.encode({"type": "teapot"}), "unknown message type"),
        (msgspec.msgpack.encode({"request_id": 1}), "no type tag"),
        (
            msgspec.msgpack.encode(
                {**msgspec.to_builtins(request()), "type": "expert_request", "request_id": -1}
            ),
            "negative id",
        ),
        (
            msgspec.msgpack.encode({**msgspec.to_builtins(request()), "type": "expert_request", "n_rows": 0}),
            "zero rows",
        ),
        (
            msgspec.msgpack.encode({**msgspec.to_builtins(request()), "type": "expert_request", "lo": "8"}),
            "wrong type",
        ),
        (
            msgspec.msgpack.encode(
                {**msgspec.to_builtins(request()), "type": "expert_request", "activation": "gelu"}
            ),
            "a request field we do not know could change the computation",
        ),
    ],
)
def test_malformed_headers(header: bytes, why: str) -> None:
    with pytest.raises(MalformedHeader) as info:
        decode_message(header)
    assert not info.value.fatal, why
    assert info.value.code == "malformed_header"


def test_newer_hellos_and_answers_with_extra_fields_still_decode() -> None:
    hello = {
        **msgspec.to_builtins(MESSAGES[0]),
        "type": "hello",
        "protocol_version": 2,
        "compression": ["zstd"],
    }
    decoded = decode_message(msgspec.msgpack.encode(hello))
    assert isinstance(decoded, Hello) and decoded.protocol_version == 2
    answer = {**msgspec.to_builtins(MESSAGES[2]), "type": "expert_response", "compute_ms": 1.5}
    assert decode_message(msgspec.msgpack.encode(answer)) == MESSAGES[2]
    minimal_hello = {
        "type": "hello",
        "protocol_version": 1,
        "dtypes": ["float32"],
        "max_frame_bytes": 1000,
        "max_rows": 4,
    }
    decoded = decode_message(msgspec.msgpack.encode(minimal_hello))
    assert isinstance(decoded, Hello) and decoded.max_in_flight == 16 and decoded.agent == ""


def test_encode_frame_refuses_frames_beyond_the_peer_limit() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(request(), bytes(2000), max_frame_bytes=1000)
    assert info.value.code == "frame_too_large"


PAYLOAD_2x3_F32 = 2 * 3 * 4


@pytest.mark.parametrize(
    ("changes", "payload_len", "code"),
    [
        ({}, PAYLOAD_2x3_F32, None),
        ({"dtype": "bfloat16"}, 2 * 3 * 2, None),
        ({"dtype": "float16"}, PAYLOAD_2x3_F32, "unsupported_dtype"),
        ({}, PAYLOAD_2x3_F32 - 1, "bad_shape"),
        ({"dtype": "bfloat16"}, PAYLOAD_2x3_F32, "bad_shape"),
        ({"n_rows": 3}, 3 * 3 * 4, "bad_shape"),
        ({"experts": [[0, 3], [1, 2]]}, PAYLOAD_2x3_F32, "bad_shape"),
        ({"experts": [[0, 4], [1]]}, PAYLOAD_2x3_F32, "bad_index"),
        ({"lo": 8, "hi": 8}, PAYLOAD_2x3_F32, "bad_shape"),
        ({"weights": [[0.6, math.inf], [1.0]]}, PAYLOAD_2x3_F32, "non_finite"),
        ({"weights": [[0.6, 0.4], [math.nan]]}, PAYLOAD_2x3_F32, "non_finite"),
        ({"n_rows": 65, "experts": [[0]] * 65, "weights": [[1.0]] * 65}, 65 * 3 * 4, "too_many_rows"),
    ],
)
def test_validate_request(changes: dict[str, Any], payload_len: int, code: str | None) -> None:
    req = request(**changes)
    if code is None:
        validate_request(req, payload_len, limits=WireLimits(max_rows=64))
        return
    with pytest.raises(WireError) as info:
        validate_request(req, payload_len, limits=WireLimits(max_rows=64))
    assert info.value.code == code
    assert (info.value.request_id, info.value.attempt) == (7, 1)  # attributable: answered to the caller
    assert not info.value.fatal


def test_validate_request_honours_the_servers_dtypes() -> None:
    with pytest.raises(WireError) as info:
        validate_request(request(dtype="bfloat16"), 12, dtypes=["float32"])
    assert info.value.code == "unsupported_dtype"


@pytest.mark.parametrize(
    ("preferred", "ours", "theirs", "chosen"),
    [
        ("bfloat16", ["float32", "bfloat16"], ["float32", "bfloat16"], "bfloat16"),
        ("bfloat16", ["float32", "bfloat16"], ["float32"], "float32"),
        ("float32", ["float32", "bfloat16"], ["bfloat16"], "bfloat16"),
        ("float16", ["float32", "bfloat16"], ["float32", "bfloat16"], "float32"),
    ],
)
def test_choose_dtype(preferred: str, ours: list[str], theirs: list[str], chosen: str) -> None:
    assert choose_dtype(preferred, ours, theirs) == chosen


def test_choose_dtype_without_a_common_one() -> None:
    with pytest.raises(WireError) as info:
        choose_dtype("float32", ["float32"], ["float16"])
    assert info.value.code == "unsupported_dtype"


def test_float32_payload_round_trip_is_exact_and_zero_copy() -> None:
    t = torch.randn(5, 7)
    view = tensor_to_payload(t, "float32")
    assert view.nbytes == 5 * 7 * 4
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == t.data_ptr()  # shares the tensor's memory
    buf = bytearray(view)
    back = payload_to_tensor(buf, "float32", 5, 7)
    assert torch.equal(back, t)
    buf[:4] = struct.pack("<f", 42.0)
    assert back[0, 0].item() == 42.0  # shares the receive buffer
    assert bytes(view[:4]) == struct.pack("<f", t[0, 0].item())  # little-endian on the wire


def test_bfloat16_payload_round_trip() -> None:
    t = torch.randn(4, 6) * 100
    view = tensor_to_payload(t, "bfloat16")
    assert view.nbytes == 4 * 6 * 2
    bits = t.to(torch.bfloat16).view(torch.int16).flatten().tolist()
    assert bytes(view) == struct.pack(f"<{len(bits)}h", *bits)
    back = payload_to_tensor(bytearray(view), "bfloat16", 4, 6)
    assert back.dtype == torch.float32
    assert torch.equal(back, t.to(torch.bfloat16).float())


def test_payload_conversions_handle_views_and_read_only_buffers() -> None:
    t = torch.randn(6, 8)[:, ::2]  # not contiguous
    assert torch.equal(payload_to_tensor(bytes(tensor_to_payload(t, "float32")), "float32", 6, 4), t)
    with pytest.raises(WireError) as info:
        payload_to_tensor(bytearray(10), "float32", 1, 3)
    assert info.value.code == "bad_shape"


class ChunkedStream:
    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk, self.pos = data, chunk, 0

    async def read(self, max_bytes: int) -> bytes:
        n = min(self.chunk, max_bytes)
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


async def test_frame_reader_reads_messages_and_attributes_oversized_frames() -> None:
    data = (
        encode_frame(request(), bytes(24))
        + encode_frame(request(request_id=RequestId(9)), bytes(4000))
        + struct.pack("<II", 3, 0)
        + b"\xc1\xc1\xc1"
        + encode_frame(MESSAGES[4])
    )
    data += encode_frame(request(request_id=RequestId(10), n_rows=65), bytes(4))
    data += encode_frame(MESSAGES[4])
    reader = FrameReader(ChunkedStream(data, 7), WireLimits(max_frame_bytes=1024, max_rows=64))
    got = await reader.receive_message()
    assert got is not None and got[0] == request() and got[1] == bytes(24)
    with pytest.raises(FrameTooLarge) as info:
        await reader.receive_message()
    assert (info.value.request_id, info.value.attempt, info.value.fatal) == (9, 1, False)
    with pytest.raises(MalformedHeader):
        await reader.receive_message()
    got = await reader.receive_message()
    assert got is not None and got[0] == MESSAGES[4]
    with pytest.raises(WireError) as rows_info:
        await reader.receive_message()
    assert (rows_info.value.code, rows_info.value.request_id, rows_info.value.fatal) == (
        "too_many_rows",
        10,
        False,
    )
    got = await reader.receive_message()
    assert got is not None and got[0] == MESSAGES[4]
    assert await reader.receive_message() is None


def test_hello_kernel_id_is_optional_for_old_peers() -> None:
    """Schema evolution: a v1 Hello written before ``kernel_id`` existed still decodes (as "")."""
    old = msgspec.msgpack.encode({"type": "hello", "protocol_version": 1, "dtypes": ["float32"],
                                  "max_frame_bytes": 1 << 20, "max_rows": 64})
    hello = decode_message(old)
    assert isinstance(hello, Hello) and hello.kernel_id == ""
    new = make_hello(kernel_id="ggml-0.15.3-avx+avx2-0123456789ab")
    back = decode_message(encode_message(new))
    assert isinstance(back, Hello) and back.kernel_id == "ggml-0.15.3-avx+avx2-0123456789ab"
