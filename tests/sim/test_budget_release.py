"""The volunteer's request byte budget (``swarm.rpc.server.ByteBudget``) is given back on every way
a frame or a stream can end, and a peer that may not use the experts reserves nothing.

The regression (issue 31, item 1): a frame header declaring a 16 MiB payload reserved budget when the
header arrived, and a stream that ended mid-payload never gave it back; authorisation came only after
the whole payload. Four throwaway identities x two streams took a 128 MiB budget for good, and the
coordinator's calls were refused ``busy`` from then on.

The property: over random scripts of frames (valid requests, requests cut off mid-payload, undecodable
headers, payloads whose length does not match, oversized frames, payloads on frames that carry none,
cancels, hold challenges, duplicate ids, requests past the budget) from authorised and unauthorised
peers, ended in every way a stream can end (a clean close, a reset, the peer leaving, the peer falling
silent mid-frame, lost framing), the budget ends at zero -- and an unauthorised peer never held a byte.

Fake transport, virtual time (``MockClock``): the stall bound and handler delays cost nothing.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import Busy
from swarm.p2p.memory import FakeNetwork, FakeTransport, open_fake_transport
from swarm.p2p.transport import Stream
from swarm.protocol.expert import (
    PROTOCOL_ID,
    Cancel,
    ExpertRequest,
    HoldChallenge,
    Pairs,
    RequestId,
    WireLimits,
    encode_frame,
    encode_message,
    encode_request_payload,
    make_hello,
    make_pairs,
    request_payload_len,
)
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import ByteBudget, expert_stream_handler

KERNEL = "test-kernel-v1"
_PREFIX = struct.Struct("<II")  # the wire's byte order (DESIGN §11)
MIB = 1 << 20


class RecordingBudget(ByteBudget):
    """A ByteBudget that remembers the most each peer ever held."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.peak: dict[str, int] = {}

    def take(self, peer: str, n: int) -> bool:
        ok = super().take(peer, n)
        if ok:
            self.peak[peer] = max(self.peak.get(peer, 0), self.by_peer[peer])
        return ok


def call_args(rid: int, *, n_rows: int = 2, d_model: int = 8) -> tuple[ExpertRequest, torch.Tensor, Pairs]:
    """A valid request (every row paired with expert 0 of 0-4), its rows and pairs: ``ExpertClient.call``'s arguments."""
    req = ExpertRequest(request_id=RequestId(rid), attempt=0, model_id="m", layer=0, lo=0, hi=4, n_rows=n_rows,
                        d_model=d_model, n_pairs=n_rows, dtype="float32")
    pairs = make_pairs(np.arange(n_rows), np.zeros(n_rows, dtype=np.int64), np.ones(n_rows, dtype=np.float32))
    return req, torch.ones(n_rows, d_model), pairs


def request(rid: int, *, n_rows: int = 2, d_model: int = 8) -> tuple[ExpertRequest, bytes]:
    """A valid request and its exact payload."""
    req, rows, pairs = call_args(rid, n_rows=n_rows, d_model=d_model)
    payload = b"".join(bytes(p) for p in encode_request_payload(req, rows.numpy().tobytes(), pairs))
    assert len(payload) == request_payload_len(req)
    return req, payload


def frame(header: bytes, payload: bytes, *, declared: int | None = None) -> bytes:
    return _PREFIX.pack(len(header), len(payload) if declared is None else declared) + header + payload


def serving_handler(delays: list[float]) -> Callable[[ExpertRequest, torch.Tensor, Pairs], Awaitable[torch.Tensor]]:
    """An expert handler that answers zeros after a virtual delay taken in turn from ``delays``."""
    i = 0

    async def handle(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        nonlocal i
        delay = delays[i % len(delays)] if delays else 0.0
        i += 1
        await trio.sleep(delay)
        return torch.zeros(req.n_pairs, req.d_model)

    return handle


@dataclass
class Served:
    """Counts the server's streams that started and ended, with an event when all that began are over."""

    started: int = 0
    ended: int = 0

    def __post_init__(self) -> None:
        self.idle = trio.Event()

    def wrap(self, inner: Callable[[Stream], Awaitable[None]]) -> Callable[[Stream], Awaitable[None]]:
        async def on_stream(stream: Stream) -> None:
            self.started += 1
            self.idle = trio.Event() if self.idle.is_set() else self.idle
            try:
                await inner(stream)
            finally:
                self.ended += 1
                if self.ended == self.started:
                    self.idle.set()

        return on_stream


async def serve(transport: FakeTransport, budget: ByteBudget, allowed: set[str], delays: list[float],
                served: Served, limits: WireLimits) -> None:
    handler = expert_stream_handler(serving_handler(delays), hello=make_hello(limits, kernel_id=KERNEL), limits=limits,
                                    authorize=allowed.__contains__, budget=budget)
    transport.set_stream_handler(PROTOCOL_ID, served.wrap(handler))


# -- the regression -------------------------------------------------------------------------------------


async def test_headers_declaring_16_mib_then_closing_leave_the_budget_free(autojump_clock: trio.testing.MockClock) -> None:
    """4 throwaway identities x 2 streams each send a Hello and a request header declaring a 16 MiB
    payload, a few bytes of it, then close or reset: nothing stays reserved, and the coordinator the
    volunteer serves is answered, not refused ``busy``. The coordinator doing the same to itself
    (it may send payloads) gets its bytes back when its stream ends too."""
    net = FakeNetwork()
    budget = RecordingBudget(per_peer=64 * MIB, total=128 * MIB)
    served = Served()
    limits = WireLimits()
    async with open_fake_transport(net, peer_id="volunteer") as vol, open_fake_transport(net, peer_id="coord") as coord:
        await serve(vol, budget, {"coord"}, [0.0], served, limits)
        big, _ = request(1, n_rows=1024, d_model=4096)  # 16 MiB of rows
        declared = request_payload_len(big)
        assert declared > 16 * MIB
        for i in range(4):
            async with open_fake_transport(net, peer_id=f"stranger-{i}") as stranger:
                for j in range(2):
                    s = await stranger.open_stream("volunteer", [], PROTOCOL_ID)
                    await s.write(encode_frame(make_hello(kernel_id=KERNEL)))
                    await s.write(frame(encode_message(big), b"\0" * 100, declared=declared))
                    if j == 0:
                        await s.aclose()
            # leaving resets the second stream of each
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(300):
            await served.idle.wait()
        assert budget.held == 0 and budget.by_peer == {}
        assert not any(p.startswith("stranger") for p in budget.peak)  # not authorised: nothing was reserved
        # the coordinator itself cuts a frame off mid-payload: its reservation goes back when the stream ends
        s = await coord.open_stream("volunteer", [], PROTOCOL_ID)
        await s.write(encode_frame(make_hello(kernel_id=KERNEL)))
        await s.write(frame(encode_message(big), b"\0" * 100, declared=declared))
        await trio.sleep(1)
        assert budget.held == declared  # reserved while the payload is on its way
        await s.aclose()
        with trio.fail_after(300):
            await served.idle.wait()
        assert budget.held == 0 and budget.by_peer == {}
        # and it is served
        async with open_expert_client(coord, "volunteer", []) as client:
            req, rows, pairs = call_args(7)
            out = await client.call(req, rows, pairs, timeout=10)
            assert tuple(out.shape) == (req.n_pairs, req.d_model)


async def test_a_frame_left_half_sent_times_out_and_gives_its_bytes_back(autojump_clock: trio.testing.MockClock) -> None:
    """An authorised peer that sends a header and part of the payload, then nothing while keeping the
    stream open, holds the reservation for at most the stall bound (30 s), then the stream ends."""
    net = FakeNetwork()
    budget = ByteBudget(per_peer=64 * MIB, total=128 * MIB)
    served = Served()
    async with open_fake_transport(net, peer_id="volunteer") as vol, open_fake_transport(net, peer_id="coord") as coord:
        await serve(vol, budget, {"coord"}, [0.0], served, WireLimits())
        big, _ = request(1, n_rows=1024, d_model=4096)
        s = await coord.open_stream("volunteer", [], PROTOCOL_ID)
        await s.write(encode_frame(make_hello(kernel_id=KERNEL)))
        await s.write(frame(encode_message(big), b"\0" * 100, declared=request_payload_len(big)))
        t0 = trio.current_time()
        await trio.sleep(1)
        assert budget.held == request_payload_len(big)
        with trio.fail_after(300):
            await served.idle.wait()
        assert trio.current_time() - t0 == pytest.approx(30.0, abs=0.01)
        assert budget.held == 0
        await s.aclose()


async def test_a_busy_refusal_keeps_the_stream_and_the_budget(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork()
    budget = ByteBudget(per_peer=1024, total=1 << 20)
    served = Served()
    async with open_fake_transport(net, peer_id="volunteer") as vol, open_fake_transport(net, peer_id="coord") as coord:
        await serve(vol, budget, {"coord"}, [0.0], served, WireLimits())
        async with open_expert_client(coord, "volunteer", []) as client:
            with pytest.raises(Busy):  # 2 KiB of rows + pairs: past 1 KiB
                await client.call(*call_args(1, n_rows=64, d_model=8), timeout=10)
            assert budget.held == 0 and budget.refused == 1
            await client.call(*call_args(2), timeout=10)
        with trio.fail_after(300):
            await served.idle.wait()
        assert budget.held == 0


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


# -- the property ---------------------------------------------------------------------------------------

LIMITS = WireLimits(max_header_bytes=4096, max_frame_bytes=64 << 10, max_rows=64, max_in_flight=4)

Step = tuple[str, int]  # (kind, a parameter)
KINDS = ("ok", "ok", "ok", "bad_header", "bad_length", "oversized", "cancel", "hold", "hold_payload", "dup",
         "past_budget", "payload_on_cancel")
ENDINGS = ("close", "reset", "leave", "stall", "cut", "lost_framing", "no_hello")


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[bool, list[Step], str]]:
    """Streams: (authorised?, steps, how the stream ends)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        steps = [(draw(st.sampled_from(KINDS)), draw(st.integers(0, 1 << 16))) for _ in range(draw(st.integers(0, 6)))]
        out.append((draw(st.booleans()), steps, draw(st.sampled_from(ENDINGS))))
    return out


def step_bytes(kind: str, k: int, rid: int) -> bytes:
    match kind:
        case "ok":
            req, payload = request(rid, n_rows=1 + k % 8)
            return frame(encode_message(req), payload)
        case "dup":
            req, payload = request(rid - 1 if rid else 0)  # the previous id, perhaps still in flight
            return frame(encode_message(req), payload)
        case "bad_header":
            return frame(b"\xc1" * (1 + k % 32), b"\0" * (k % 500))
        case "bad_length":
            req, payload = request(rid)
            return frame(encode_message(req), payload[: len(payload) - 1 - k % 8])
        case "oversized":
            req, payload = request(rid)
            return frame(encode_message(req), b"\0" * (LIMITS.max_frame_bytes + 1 + k % 100))
        case "cancel":
            return encode_frame(Cancel(request_id=RequestId(max(0, rid - 1 - k % 3)), attempt=0))
        case "payload_on_cancel":
            return frame(encode_message(Cancel(request_id=RequestId(rid), attempt=0)), b"\0" * (1 + k % 64))
        case "hold" | "hold_payload":
            ch = HoldChallenge(request_id=RequestId(rid), attempt=0, model_id="m", layer=0, lo=0, hi=4,
                               nonce=b"\1" * 16, windows=[(0, 16)])
            return frame(encode_message(ch), b"\0" * (1 + k % 64) if kind == "hold_payload" else b"")
        case "past_budget":
            req, payload = request(rid, n_rows=64, d_model=16 + k % 16)  # 4 KiB+: past the per-peer budget
            return frame(encode_message(req), payload)
    raise AssertionError(kind)


async def run_script(streams: list[tuple[bool, list[Step], str]], delays: list[float]) -> RecordingBudget:
    net = FakeNetwork()
    budget = RecordingBudget(per_peer=4096, total=12 << 10)
    served = Served()
    allowed = {f"peer-{i}" for i, (ok, _, _) in enumerate(streams) if ok}
    async with open_fake_transport(net, peer_id="volunteer") as vol:
        await serve(vol, budget, allowed, delays, served, LIMITS)
        async with trio.open_nursery() as nursery:
            for i, (_, steps, ending) in enumerate(streams):
                nursery.start_soon(drive, net, f"peer-{i}", steps, ending)
        with trio.fail_after(300):
            await served.idle.wait()
        assert budget.held <= budget.total
    return budget


async def drive(net: FakeNetwork, peer: str, steps: list[Step], ending: str) -> None:
    async with open_fake_transport(net, peer_id=peer) as me:
        s = await me.open_stream("volunteer", [], PROTOCOL_ID)
        if ending != "no_hello":
            await s.write(encode_frame(make_hello(kernel_id=KERNEL)))
        for rid, (kind, k) in enumerate(steps):
            await s.write(step_bytes(kind, k, rid))
        match ending:
            case "close" | "no_hello":
                await s.aclose()
            case "reset":
                net.partition(peer, "volunteer")
            case "leave":
                pass  # leaving the network breaks the stream
            case "stall":  # a frame cut off mid-payload, the stream kept open: the volunteer's stall bound ends it
                req, payload = request(len(steps) + 1)
                await s.write(frame(encode_message(req), payload[: len(payload) // 2]))
                await trio.sleep(60)
                await s.aclose()
            case "cut":  # a frame cut off mid-payload, then a clean close
                req, payload = request(len(steps) + 1, n_rows=8)
                await s.write(frame(encode_message(req), payload[: len(payload) // 3]))
                await s.aclose()
            case "lost_framing":
                await s.write(_PREFIX.pack(LIMITS.max_header_bytes + 1, 100))
                await trio.sleep(1)
                await s.aclose()
        await trio.sleep(0.5)  # let answers in flight meet whatever state the stream is in


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams=scripts(), delays=st.lists(st.sampled_from([0.0, 0.1, 1.0, 5.0]), min_size=1, max_size=4))
def test_every_way_a_stream_ends_gives_the_budget_back(streams: list[tuple[bool, list[Step], str]],
                                                       delays: list[float]) -> None:
    budget = trio.run(run_script, streams, delays, clock=trio.testing.MockClock(autojump_threshold=0))
    assert budget.held == 0 and budget.by_peer == {}, (budget.held, budget.by_peer)
    unauthorised = {f"peer-{i}" for i, (ok, _, _) in enumerate(streams) if not ok}
    assert not unauthorised & set(budget.peak), budget.peak  # authorisation came before any reservation
