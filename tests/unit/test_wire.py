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
from hypothesis import given, settings
from hypothesis import strategies as st

import swarm.protocol.pairs as pair_wire
from swarm.errors import (
    BrokenError,
    FrameTooLarge,
    LocalProtocolError,
    MalformedHeader,
    RemoteProtocolError,
    VersionMismatch,
    WireError,
)
from swarm.protocol.expert import (
    PROTOCOL_ID,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    V1_PROTOCOL_ID,
    Cancel,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    Frame,
    FrameDecoder,
    FrameReader,
    Hello,
    Message,
    Pairs,
    RequestId,
    WireLimits,
    check_pairs,
    choose_dtype,
    decode_message,
    decode_pairs,
    encode_frame,
    encode_message,
    encode_request_payload,
    make_hello,
    make_pairs,
    request_payload_len,
    rows_region,
    validate_request,
)
from swarm.rpc.tensors import payload_to_tensor, tensor_to_payload

KERNEL = "ggml-0.15.3-avx+avx2-0123456789ab"


def request(**changes: Any) -> ExpertRequest:
    base = ExpertRequest(
        request_id=RequestId(7),
        attempt=1,
        model_id="tiny-0123456789ab",
        layer=2,
        lo=8,
        hi=12,
        n_rows=2,
        d_model=3,
        n_pairs=3,
        dtype="float32",
    )
    return msgspec.structs.replace(base, **changes)


def pairs(rows: list[int], experts: list[int], weights: list[float]) -> Pairs:
    return Pairs(np.array(rows, dtype="<u4"), np.array(experts, dtype="<u4"), np.array(weights, dtype="<f4"))


PAIRS = pairs([0, 0, 1], [0, 3, 1], [0.6, 0.4, 1.0])  # row 0: experts 0, 3; row 1: expert 1


MESSAGES: list[Message] = [
    Hello(
        protocol_version=2,
        kernel_id=KERNEL,
        dtypes=["float32", "bfloat16"],
        max_frame_bytes=1 << 20,
        max_rows=64,
        agent="t",
    ),
    request(),
    Cancel(request_id=RequestId(7), attempt=1),
    ExpertResponse(request_id=RequestId(7), attempt=1, status="ok", dtype="float32", n_rows=2, d_model=3),
    ExpertResponse(request_id=RequestId(8), attempt=0, status="bad_index", message="row 0: ..."),
    ErrorReply(code="malformed_header", message="undecodable", fatal=True),
]


MESSAGES_OK = MESSAGES[3]
MESSAGES_ERR = MESSAGES[5]


def test_protocol_constants() -> None:
    assert PROTOCOL_ID == "/moe-swarm/expert/2"
    assert PROTOCOL_VERSION == 2
    assert V1_PROTOCOL_ID == "/moe-swarm/expert/1"
    assert SUPPORTED_VERSIONS == (2,)


def test_frame_layout_is_exactly_the_documented_one() -> None:
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    req = request()
    frame = encode_frame(req, encode_request_payload(req, tensor_to_payload(rows, "float32"), PAIRS))
    header_len, payload_len = struct.unpack_from("<II", frame)
    assert payload_len == request_payload_len(req) == 24 + 3 * 12  # 2x3 f32 rows: already 8-aligned
    assert len(frame) == 8 + header_len + payload_len
    header = msgspec.msgpack.decode(frame[8 : 8 + header_len])
    assert header == {
        "type": "expert_request", "request_id": 7, "attempt": 1, "model_id": "tiny-0123456789ab", "layer": 2,
        "lo": 8, "hi": 12, "n_rows": 2, "d_model": 3, "n_pairs": 3, "dtype": "float32",
    }
    payload = frame[8 + header_len :]
    assert payload[:24] == struct.pack("<6f", 0, 1, 2, 3, 4, 5)
    assert payload[24:36] == struct.pack("<3I", 0, 0, 1)  # pair_row
    assert payload[36:48] == struct.pack("<3I", 0, 3, 1)  # pair_expert, relative to lo
    assert payload[48:60] == struct.pack("<3f", 0.6, 0.4, 1.0)  # pair_weight, always f32


def test_rows_are_padded_to_8_bytes_before_the_pairs() -> None:
    """bfloat16 [1, 3] rows are 6 bytes: 2 zero bytes of padding, then the u32 arrays (aligned)."""
    req = request(n_rows=1, n_pairs=1, dtype="bfloat16")
    one = pairs([0], [2], [0.5])
    rows = torch.tensor([[1.0, 2.0, 3.0]])
    payload = b"".join(bytes(p) for p in encode_request_payload(req, tensor_to_payload(rows, "bfloat16"), one))
    assert len(payload) == request_payload_len(req) == 8 + 12
    assert payload[6:8] == b"\0\0"
    assert payload[8:] == struct.pack("<IIf", 0, 2, 0.5)
    got = decode_pairs(req, bytearray(payload))
    assert (got.rows.tolist(), got.experts.tolist(), got.weights.tolist()) == ([0], [2], [0.5])
    back = payload_to_tensor(rows_region(req, bytearray(payload)), "bfloat16", 1, 3)
    assert torch.equal(back, rows)


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
    small = encode_frame(MESSAGES_OK, bytes(24))
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
        "protocol_version": 3,
        "compression": ["zstd"],
    }
    decoded = decode_message(msgspec.msgpack.encode(hello))
    assert isinstance(decoded, Hello) and decoded.protocol_version == 3
    answer = {**msgspec.to_builtins(MESSAGES[3]), "type": "expert_response", "compute_ms": 1.5}
    assert decode_message(msgspec.msgpack.encode(answer)) == MESSAGES[3]
    cancel = {"type": "cancel", "request_id": 7, "attempt": 1, "reason": "hedge"}
    assert decode_message(msgspec.msgpack.encode(cancel)) == Cancel(request_id=RequestId(7), attempt=1)
    minimal_hello = {
        "type": "hello",
        "protocol_version": 2,
        "kernel_id": KERNEL,
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


PAYLOAD_2x3_F32 = 2 * 3 * 4 + 3 * 12


@pytest.mark.parametrize(
    ("changes", "payload_len", "code"),
    [
        ({}, PAYLOAD_2x3_F32, None),
        ({"dtype": "bfloat16"}, 2 * 3 * 2 + 4 + 3 * 12, None),  # 12 bytes of rows padded to 16
        ({"dtype": "float16"}, PAYLOAD_2x3_F32, "unsupported_dtype"),
        ({}, PAYLOAD_2x3_F32 - 1, "bad_shape"),
        ({}, PAYLOAD_2x3_F32 + 1, "bad_shape"),
        ({"dtype": "bfloat16"}, PAYLOAD_2x3_F32, "bad_shape"),
        ({"n_rows": 3}, PAYLOAD_2x3_F32, "bad_shape"),  # 2 rows of bytes for 3 rows
        ({"n_rows": 3}, 3 * 3 * 4 + 4 + 3 * 12, None),  # 36 bytes of rows padded to 40
        ({"n_pairs": 1}, 2 * 3 * 4 + 12, "bad_shape"),  # fewer pairs than rows: a row without a pair
        ({"n_pairs": 9}, 2 * 3 * 4 + 9 * 12, "bad_shape"),  # more than n_rows * (hi - lo): a repeat
        ({"lo": 8, "hi": 8}, PAYLOAD_2x3_F32, "bad_shape"),
        ({"n_rows": 65, "n_pairs": 65}, 65 * 3 * 4 + 4 + 65 * 12, "too_many_rows"),
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


@pytest.mark.parametrize(
    ("rows", "experts", "weights", "code", "says"),
    [
        ([0, 0, 1], [0, 3, 1], [0.6, 0.4, 1.0], None, ""),
        ([0, 0, 1], [0, 4, 1], [0.6, 0.4, 1.0], "bad_index", "expert index 4 outside [0, 4)"),
        ([0, 0, 2], [0, 3, 1], [0.6, 0.4, 1.0], "bad_index", "row 2 outside [0, 2)"),
        ([0, 0, 1], [3, 0, 1], [0.6, 0.4, 1.0], "bad_index", "out of (row, expert) order"),
        ([0, 1, 0], [0, 1, 3], [0.6, 0.4, 1.0], "bad_index", "out of (row, expert) order"),
        ([0, 0, 1], [3, 3, 1], [0.6, 0.4, 1.0], "bad_index", "repeats"),
        ([0, 0, 0], [0, 1, 3], [0.6, 0.4, 1.0], "bad_index", "row 1 has no pair"),
        ([1, 1, 1], [0, 1, 3], [0.6, 0.4, 1.0], "bad_index", "row 0 has no pair"),
        ([0, 0, 1], [0, 3, 1], [0.6, math.inf, 1.0], "non_finite", "pair 1"),
        ([0, 0, 1], [0, 3, 1], [0.6, 0.4, math.nan], "non_finite", "pair 2"),
    ],
    ids=["ok", "expert-range", "row-range", "expert-order", "row-order", "repeat", "row-gap", "row-0-missing",
         "inf", "nan"],
)
def test_check_pairs(
    rows: list[int], experts: list[int], weights: list[float], code: str | None, says: str
) -> None:
    req = request()
    p = pairs(rows, experts, weights)
    payload = bytearray(24) + b"".join(bytes(x) for x in p.parts())
    if code is None:
        check_pairs(req, p)
        got = decode_pairs(req, payload)
        assert got.rows.tolist() == rows and got.experts.tolist() == experts
        return
    for check in (lambda: check_pairs(req, p), lambda: decode_pairs(req, payload)):
        with pytest.raises(WireError) as info:
            check()
        assert info.value.code == code
        assert says in info.value.message
        assert (info.value.request_id, info.value.attempt, info.value.fatal) == (7, 1, False)


def test_make_pairs_sorts_the_routers_order_and_keeps_sorted_input_as_is() -> None:
    p = make_pairs(np.array([1, 0, 0]), np.array([2, 3, 1]), np.array([0.5, 0.25, 0.75]))
    assert (p.rows.tolist(), p.experts.tolist(), p.weights.tolist()) == ([0, 0, 1], [1, 3, 2], [0.75, 0.25, 0.5])
    assert p.rows.dtype == np.dtype("<u4") and p.weights.dtype == np.dtype("<f4")
    with pytest.raises(WireError) as info:
        make_pairs(np.array([0, 1]), np.array([0]), np.array([1.0, 1.0]))
    assert info.value.code == "bad_shape"
    with pytest.raises(WireError) as info:
        make_pairs(np.array([0, -1]), np.array([0, 0]), np.array([1.0, 1.0]))
    assert info.value.code == "bad_index"


# -- property tests of the payload validation -----------------------------------------------------


@st.composite
def valid_calls(draw: st.DrawFn) -> tuple[ExpertRequest, Pairs, bytes]:
    n_rows = draw(st.integers(1, 6))
    n_local = draw(st.integers(1, 6))
    d_model = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    rows: list[int] = []
    exps: list[int] = []
    for r in range(n_rows):
        chosen = draw(st.sets(st.integers(0, n_local - 1), min_size=1, max_size=n_local))
        for e in sorted(chosen):
            rows.append(r)
            exps.append(e)
    weights = draw(st.lists(st.floats(-4, 4, width=32), min_size=len(rows), max_size=len(rows)))
    p = pairs(rows, exps, weights)
    req = request(n_rows=n_rows, d_model=d_model, n_pairs=len(rows), dtype=dtype, lo=10, hi=10 + n_local)
    x = torch.randn(n_rows, d_model)
    payload = b"".join(bytes(part) for part in encode_request_payload(req, tensor_to_payload(x, dtype), p))
    return req, p, payload


@settings(max_examples=300, deadline=None)
@given(valid_calls())
def test_every_well_formed_call_validates_and_round_trips(call: tuple[ExpertRequest, Pairs, bytes]) -> None:
    req, p, payload = call
    validate_request(req, len(payload))
    got = decode_pairs(req, bytearray(payload))
    assert got.rows.tolist() == p.rows.tolist() and got.experts.tolist() == p.experts.tolist()
    assert got.weights.tobytes() == p.weights.tobytes()
    shuffled = make_pairs(p.rows[::-1], p.experts[::-1], p.weights[::-1])  # make_pairs restores wire order
    assert shuffled.rows.tolist() == p.rows.tolist() and shuffled.experts.tolist() == p.experts.tolist()


@settings(max_examples=500, deadline=None)
@given(valid_calls(), st.data())
def test_any_corruption_of_the_pair_arrays_is_a_clear_attributed_error_or_still_valid(
    call: tuple[ExpertRequest, Pairs, bytes], data: st.DataObject
) -> None:
    """Flip any byte of the pair arrays: either the result is still a valid call (and then it
    obeys every rule) or a non-fatal, attributed ``WireError`` with one of the documented codes."""
    req, _, payload = call
    off = len(payload) - 12 * req.n_pairs
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(off, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    p = Pairs(*(np.frombuffer(buf, dtype=t, count=req.n_pairs, offset=off + 4 * k * req.n_pairs)
                for k, t in enumerate(("<u4", "<u4", "<f4"))))
    verdicts = []
    for check in (pair_wire._check_small, pair_wire._check_large):  # the two paths agree
        try:
            if check is pair_wire._check_small:
                check(req, p.rows.tolist(), p.experts.tolist(), p.weights.tolist())
            else:
                check(req, p)
            verdicts.append(None)
        except WireError as exc:
            verdicts.append(exc.code)
    assert verdicts[0] == verdicts[1], verdicts
    try:
        got = decode_pairs(req, buf)
    except WireError as exc:
        assert exc.code in {"bad_index", "non_finite"}
        assert (exc.request_id, exc.attempt, exc.fatal) == (req.request_id, req.attempt, False)
        assert exc.message
        return
    r, e = got.rows.astype(np.int64), got.experts.astype(np.int64)
    assert r.max() < req.n_rows and e.max() < req.hi - req.lo
    assert (np.diff(r * (req.hi - req.lo) + e) > 0).all()
    assert set(r.tolist()) == set(range(req.n_rows))
    assert np.isfinite(got.weights).all()


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1), st.integers(1, 2**32 - 1),
    st.integers(1, 2**32 - 1), st.integers(0, 1 << 20), st.sampled_from(["float32", "bfloat16", "int8", ""]),
)
def test_any_header_is_accepted_only_with_its_exact_payload_length(
    lo: int, hi: int, n_rows: int, d_model: int, n_pairs: int, payload_len: int, dtype: str
) -> None:
    """No header makes validation raise anything but a WireError, or accept a wrong length."""
    req = request(lo=lo, hi=hi, n_rows=n_rows, d_model=d_model, n_pairs=n_pairs, dtype=dtype)
    try:
        validate_request(req, payload_len, limits=WireLimits(max_rows=64))
    except WireError as exc:
        assert exc.code in {"unsupported_dtype", "bad_shape", "too_many_rows"} and not exc.fatal
        return
    assert payload_len == request_payload_len(req)
    assert hi > lo and n_rows <= min(64, n_pairs) and n_pairs <= n_rows * (hi - lo)


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
        + encode_frame(MESSAGES_ERR)
    )
    data += encode_frame(request(request_id=RequestId(10), n_rows=65), bytes(4))
    data += encode_frame(MESSAGES_ERR)
    reader = FrameReader(ChunkedStream(data, 7), WireLimits(max_frame_bytes=1024, max_rows=64))
    got = await reader.receive_message()
    assert got is not None and got[0] == request() and got[1] == bytes(24)
    with pytest.raises(FrameTooLarge) as info:
        await reader.receive_message()
    assert (info.value.request_id, info.value.attempt, info.value.fatal) == (9, 1, False)
    with pytest.raises(MalformedHeader):
        await reader.receive_message()
    got = await reader.receive_message()
    assert got is not None and got[0] == MESSAGES_ERR
    with pytest.raises(WireError) as rows_info:
        await reader.receive_message()
    assert (rows_info.value.code, rows_info.value.request_id, rows_info.value.fatal) == (
        "too_many_rows",
        10,
        False,
    )
    got = await reader.receive_message()
    assert got is not None and got[0] == MESSAGES_ERR
    assert await reader.receive_message() is None


def test_hello_kernel_id_is_required_and_a_v1_hello_is_a_version_mismatch() -> None:
    """v2 requires ``kernel_id``; a v1 Hello (which had none) is refused as the version it is."""
    v1 = {"type": "hello", "protocol_version": 1, "dtypes": ["float32"], "max_frame_bytes": 1 << 20, "max_rows": 64}
    with pytest.raises(VersionMismatch) as info:
        decode_message(msgspec.msgpack.encode(v1))
    assert info.value.code == "version_mismatch" and info.value.fatal
    assert "version 1" in info.value.message and "version 2" in info.value.message
    for bad in ({**v1, "protocol_version": 2}, {**v1, "protocol_version": 2, "kernel_id": ""}):
        with pytest.raises(MalformedHeader) as malformed:
            decode_message(msgspec.msgpack.encode(bad))
        assert "kernel_id" in malformed.value.message
    new = make_hello(kernel_id=KERNEL)
    back = decode_message(encode_message(new))
    assert isinstance(back, Hello) and back.kernel_id == KERNEL and back.protocol_version == 2


def test_a_declared_payload_is_never_allocated_before_it_arrives() -> None:
    """A 154-byte frame declaring a 60 MiB payload must not cost 60 MiB (the trust issue's attack)."""
    decoder = FrameDecoder(WireLimits(max_frame_bytes=128 << 20))
    header = encode_message(request())
    decoder.feed(struct.pack("<II", len(header), 60 << 20) + header + bytes(100))
    assert decoder.next_frame() is None
    assert len(decoder._payload) == 100  # what arrived, not what was declared
