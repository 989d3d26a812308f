"""Every decoder of peer input, fuzzed (issue 11 item 7): expert-stream frames, the market's and the
coordinator's request bodies, dispatch maps and downloaded slice files. Random bytes and mutations of
valid inputs either decode or raise an error of the project's tree (``SwarmError``) -- no other
exception, no hang -- and never allocate far beyond the input (tracemalloc peak). Derandomised, with
bounded examples, so ``make test`` is reproducible."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api.schemas import decode_chat, decode_completion
from market.api import _decode as market_decode
from swarm.dispatch_map import decode_dispatch_map
from swarm.errors import SwarmError
from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice, load_slice
from swarm.protocol.expert import (
    Cancel,
    ExpertRequest,
    FrameDecoder,
    HoldChallenge,
    RequestId,
    WireLimits,
    decode_message,
    encode_frame,
    encode_message,
)
from swarm.protocol.market import coverage_decoder, register_decoder, report_decoder, volunteer_decoder
from tests.conftest import GOLDEN_GGUF

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
PEAK_BYTES = 8 << 20  # what any one decode may allocate for inputs of a few KB


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """``seed`` with bytes flipped, cut, repeated or spliced in; or any bytes at all."""

    @st.composite
    def one(draw: st.DrawFn) -> bytes:
        b = bytearray(seed)
        for _ in range(draw(st.integers(1, 6))):
            op = draw(st.sampled_from(["flip", "cut", "insert", "dup", "truncate"]))
            i = draw(st.integers(0, max(0, len(b) - 1)))
            if op == "flip" and b:
                b[i] ^= draw(st.integers(1, 255))
            elif op == "cut" and b:
                del b[i : i + draw(st.integers(1, 16))]
            elif op == "insert":
                b[i:i] = draw(st.binary(min_size=1, max_size=16))
            elif op == "dup" and b:
                b[i:i] = b[i : i + draw(st.integers(1, 64))]
            elif op == "truncate":
                del b[i:]
        return bytes(b)

    return st.one_of(one(), st.binary(max_size=512))


def check(decode: Callable[[bytes], Any], data: bytes) -> None:
    tracemalloc.start()
    try:
        decode(data)
    except SwarmError:
        pass  # the project's error tree: a clear, coded error
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < PEAK_BYTES + 64 * len(data), f"{peak} bytes allocated for {len(data)} bytes of input"


# -- expert stream frames --------------------------------------------------------------------------

LIMITS = WireLimits()


def frames(data: bytes) -> list[object]:
    """Feed ``data`` in uneven chunks, then the end of the stream; read every frame and decode its
    header as a message (the messages, in order)."""
    d = FrameDecoder(LIMITS)
    out: list[object] = []
    for i in range(0, len(data), 7):
        d.feed(data[i : i + 7])
        while (f := d.next_frame()) is not None:
            out.append(decode_message(f.header))
    d.feed_eof()
    while (f := d.next_frame()) is not None:
        out.append(decode_message(f.header))
    return out


# seeds are framed by the wire's own encoder (little-endian lengths, DESIGN §11): seeds packed in another
# byte order were refused at the length prefix, so frame headers were never fuzzed
REQUEST = ExpertRequest(request_id=RequestId(1), attempt=0, model_id="m-0123456789ab", layer=0, lo=0, hi=4, n_rows=1,
                        d_model=2, n_pairs=1, dtype="float32")
CHALLENGE = HoldChallenge(request_id=RequestId(1), attempt=0, model_id="m-0123456789ab", layer=0, lo=0, hi=4,
                          nonce=bytes(range(16)), windows=[(0, 4096), (100, 7)])
FRAME_SEED = encode_frame(REQUEST, b"\0" * 20) + encode_frame(Cancel(request_id=RequestId(1), attempt=0))
CHALLENGE_SEED = encode_frame(CHALLENGE)


def test_the_seeds_are_valid_frames() -> None:
    """A seed the decoder refuses would fuzz only the length prefix."""
    assert frames(FRAME_SEED) == [REQUEST, Cancel(request_id=RequestId(1), attempt=0)]
    assert frames(CHALLENGE_SEED) == [CHALLENGE]
    assert FRAME_SEED[:4] == struct.pack("<I", len(encode_message(REQUEST)))


@FUZZ
@given(mutated(FRAME_SEED))
def test_expert_frames(data: bytes) -> None:
    check(frames, data)


@FUZZ
@given(mutated(CHALLENGE_SEED))
def test_hold_challenge_frames(data: bytes) -> None:
    check(frames, data)


@FUZZ
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_a_declared_frame_size_is_never_allocated(header_len: int, payload_len: int) -> None:
    check(frames, struct.pack("<II", header_len, payload_len) + b"\x81\xa1k\xa1r")


# -- HTTP bodies -----------------------------------------------------------------------------------

PEER = "12D3KooWCjibu497SX9P8yX4LR7U8zTUmaYuaS4sqf7KX1oiXz6k"
MANIFEST = {"model_id": "m-0123456789ab", "arch": "qwen3moe", "n_layer": 2, "n_expert": 8, "bytes_per_expert": [10, 10]}
MARKET_BODIES = {
    "register": (register_decoder, {"url": "http://c.test", "models": [MANIFEST], "epoch": 1, "peer_id": PEER,
                                    "local_experts": {"m-0123456789ab": [[0, 0, 4], [1, 4, 8]]}}),
    "volunteer": (volunteer_decoder, {"peer_id": PEER, "max_experts": 4, "epoch": 1, "sequence": 2, "sent_at_ms": 5}),
    "coverage": (coverage_decoder, {"peer_id": PEER, "epoch": 1, "sequence": 2, "addrs": ["/ip4/1.2.3.4/tcp/1"],
                                    "slices": [{"model_id": "m-0123456789ab", "layer": 0, "lo": 0, "hi": 4}]}),
    "report": (report_decoder, {"url": "http://c.test", "model_id": "m-0123456789ab",
                                "workers": [{"peer_id": PEER, "calls": 1, "quarantine": "x", "held": [[0, 0, 4]],
                                             "evidence": {"layer": 0, "lo": 0, "hi": 4, "input_sha256": "a" * 64,
                                                          "remote_sha256": "b" * 64, "local_sha256": "c" * 64,
                                                          "method": "bit_exact", "detail": "d"}}],
                                "ranges": [{"layer": 0, "lo": 0, "hi": 4, "rows": 9}]}),
}


@pytest.mark.parametrize("name", sorted(MARKET_BODIES))
def test_market_bodies(name: str) -> None:
    decoder, good = MARKET_BODIES[name]
    seed = json.dumps(good).encode()
    market_decode(decoder, seed)  # the seed itself is valid

    @FUZZ
    @given(mutated(seed))
    def fuzz(data: bytes) -> None:
        check(lambda b: market_decode(decoder, b), data)

    fuzz()


COORDINATOR_BODIES: dict[str, tuple[Callable[[bytes], Any], dict[str, Any]]] = {
    "chat": (decode_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           "temperature": 0.5, "stream": True}),
    "completion": (decode_completion, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "return_token_ids": True}),
}


@pytest.mark.parametrize("name", sorted(COORDINATOR_BODIES))
def test_coordinator_bodies(name: str) -> None:
    decode, good = COORDINATOR_BODIES[name]
    seed = json.dumps(good).encode()
    decode(seed)

    @FUZZ
    @given(mutated(seed))
    def fuzz(data: bytes) -> None:
        check(decode, data)

    fuzz()


DMAP = {"model_id": "m-0123456789ab", "version": 3, "layers": [
    {"layer": 0, "ranges": [{"lo": 0, "hi": 4, "replicas": [{"peer_id": PEER, "addrs": ["/ip4/1.2.3.4/tcp/1"]}]},
                            {"lo": 4, "hi": 8, "replicas": []}]}]}


@FUZZ
@given(mutated(json.dumps(DMAP).encode()))
def test_dispatch_maps(data: bytes) -> None:
    decode_dispatch_map(json.dumps(DMAP).encode(), n_layer=2, n_expert=8)
    check(lambda b: decode_dispatch_map(b, n_layer=2, n_expert=8), data)


# -- downloaded slice files (safetensors header + tensors) ------------------------------------------

_SLICE: list[bytes] = []


def slice_seed() -> bytes:
    if not _SLICE:
        _SLICE.append(cut_slice(GGUFModel(GOLDEN_GGUF), 0, 0, 1))
    return _SLICE[0]


def test_slice_seed_loads() -> None:
    assert load_slice(slice_seed()).key.lo == 0


@FUZZ
@given(st.data())
def test_slice_files(data: st.DataObject) -> None:
    seed = slice_seed()
    head = seed[:2048]  # the header and the start of the data: where a mutation can mislead a parser
    got = data.draw(mutated(head))
    check(load_slice, got + seed[2048:])
