"""The data lane's records (``swarm.rpc.lane``): sealed frames out, opened frames in, and every way a
record can be wrong ending the lane -- altered, replayed, reordered, dropped, from the other
direction's key, too long -- before anything of it is buffered past its declared size."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.errors import BadShape, FrameTooLarge, MalformedHeader
from swarm.protocol.expert import (
    DEFAULT_LIMITS,
    Cancel,
    ExpertRequest,
    RequestId,
    WireLimits,
    encode_frame,
)
from swarm.rpc.lane import (
    HANDSHAKE_BYTES,
    LaneBroken,
    Opener,
    Sealer,
    derive_keys,
    handshake,
    parse_frame,
    parse_handshake,
)


def keys() -> tuple[bytes, bytes]:
    return os.urandom(32), os.urandom(16)


def frame(i: int, payload: bytes = b"") -> bytes:
    if payload:
        req = ExpertRequest(request_id=RequestId(i), attempt=0, model_id="m", layer=0, lo=0, hi=4, n_rows=1, d_model=2,
                            n_pairs=1, dtype="float32")
        return encode_frame(req, payload)
    return encode_frame(Cancel(request_id=RequestId(i), attempt=1))


def test_records_open_in_order_whatever_the_chunks() -> None:
    secret, lane_id = keys()
    sealer, opener = Sealer(derive_keys(secret, lane_id)[0]), Opener(derive_keys(secret, lane_id)[0], 1 << 20)
    frames = [frame(i, os.urandom(i * 7)) for i in range(6)]
    wire = b"".join(sealer.seal(f) for f in frames)
    got: list[bytes] = []
    for k in range(0, len(wire), 5):  # 5 bytes at a time: no record is ever whole before its last chunk
        opener.feed(wire[k : k + 5])
        got += [bytes(f) for f in opener.frames()]
    assert got == frames and opener.buffered == 0 and opener.wanted() == 4


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8), st.data())
def test_any_cut_of_the_stream_gives_the_same_frames(payloads: list[bytes], data: st.DataObject) -> None:
    secret, lane_id = b"s" * 32, b"i" * 16
    a, _ = derive_keys(secret, lane_id)
    sealer, opener = Sealer(a), Opener(derive_keys(secret, lane_id)[0], 1 << 20)
    frames = [frame(i, p) for i, p in enumerate(payloads)]
    wire = b"".join(sealer.seal(f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    got: list[bytes] = []
    for lo, hi in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        opener.feed(wire[lo:hi])
        got += [bytes(f) for f in opener.frames()]
    assert got == frames


@pytest.mark.parametrize("attack", ["flip_a_bit", "flip_the_length", "replay", "reorder", "drop", "other_direction",
                                    "other_lane"])
def test_a_record_that_was_tampered_with_ends_the_lane(attack: str) -> None:
    secret, lane_id = keys()
    c2v, v2c = derive_keys(secret, lane_id)
    sealer = Sealer(c2v)
    recs = [bytes(sealer.seal(frame(i, os.urandom(40)))) for i in range(3)]
    key = c2v
    match attack:
        case "flip_a_bit":
            r = bytearray(recs[1])
            r[20] ^= 1
            recs[1] = bytes(r)
        case "flip_the_length":  # the length is the associated data: a record re-cut differently fails
            r = bytearray(recs[1])
            n = struct.unpack_from("<I", r)[0]
            struct.pack_into("<I", r, 0, n - 1)
            recs[1] = bytes(r[:-1])
        case "replay":
            recs[2] = recs[1]
        case "reorder":
            recs[1], recs[2] = recs[2], recs[1]
        case "drop":
            del recs[1]
        case "other_direction":  # a record sealed for the other way round
            key = v2c
        case "other_lane":
            key = derive_keys(secret, os.urandom(16))[0]
    opener = Opener(key, 1 << 20)
    opener.feed(b"".join(recs))
    with pytest.raises(LaneBroken):
        list(opener.frames())


def test_a_declared_length_past_the_limit_ends_the_lane_before_it_is_buffered() -> None:
    secret, lane_id = keys()
    c2v, _ = derive_keys(secret, lane_id)
    opener = Opener(c2v, 4096)
    opener.feed(struct.pack("<I", 64 << 20) + b"x" * 10)
    with pytest.raises(LaneBroken, match="limit 4096"):
        list(opener.frames())
    short = Opener(c2v, 4096)
    short.feed(struct.pack("<I", 3) + b"abc")  # shorter than a tag: no record
    with pytest.raises(LaneBroken):
        list(short.frames())


def test_the_handshake_names_the_lane_or_nothing() -> None:
    lane_id = os.urandom(16)
    assert parse_handshake(handshake(lane_id)) == lane_id and len(handshake(lane_id)) == HANDSHAKE_BYTES
    for bad in (b"", handshake(lane_id)[:-1], b"GET / HTTP/1.1\r\nHost: x\r\n", b"x" * HANDSHAKE_BYTES):
        with pytest.raises(LaneBroken):
            parse_handshake(bad)


def test_frames_are_parsed_like_the_streams_and_bad_ones_are_errors_of_their_own() -> None:
    good = bytearray(frame(7, b"\0" * 8))
    msg, payload = parse_frame(good, DEFAULT_LIMITS)
    assert isinstance(msg, ExpertRequest) and msg.request_id == 7 and len(payload) == 8
    with pytest.raises(BadShape):
        parse_frame(bytearray(b"abc"), DEFAULT_LIMITS)
    with pytest.raises(BadShape):  # the lengths disagree with the record
        parse_frame(good + b"x", DEFAULT_LIMITS)
    with pytest.raises(FrameTooLarge):
        parse_frame(good, WireLimits(max_frame_bytes=len(good) - 9))
    junk = bytearray(struct.pack("<II", 3, 0) + b"\xc1\xc1\xc1")
    with pytest.raises(MalformedHeader):
        parse_frame(junk, DEFAULT_LIMITS)
