"""The expert protocol end to end, on the fake transport (virtual time) and on real py-libp2p."""

from __future__ import annotations

import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import trio
import trio.testing

from swarm.errors import (
    BrokenError,
    Busy,
    ClosedError,
    LocalProtocolError,
    NotAuthorized,
    Refused,
    RemoteProtocolError,
    SliceError,
    TransportError,
    TransportTimeout,
)
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.p2p.memory import FakeNetwork, open_fake_transport
from swarm.p2p.transport import Stream, Transport
from swarm.protocol.expert import (
    DEFAULT_LIMITS,
    PROTOCOL_ID,
    V1_PROTOCOL_ID,
    Cancel,
    ErrorReply,
    ExpertRequest,
    ExpertResponse,
    FrameDecoder,
    FrameReader,
    Hello,
    Message,
    Pairs,
    RequestId,
    WireLimits,
    decode_message,
    encode_frame,
    encode_request_payload,
    make_hello,
)
from swarm.rpc.client import ExpertClient, open_expert_client
from swarm.rpc.server import ByteBudget, expert_stream_handler, set_expert_handlers
from swarm.rpc.tensors import tensor_to_payload
from tests.conftest import eventually

D = 16
KERNEL = "test-kernel-v1"


# --------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(params=["fake", "libp2p"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock(kind: str) -> trio.testing.MockClock | None:
    """Virtual time on the fake transport; real time (and real sockets) on libp2p."""
    return trio.testing.MockClock(autojump_threshold=0) if kind == "fake" else None


class Net:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fake = FakeNetwork()
        self._n = 0

    def open(
        self, *, name: str | None = None, key_path: Path | None = None, port: int = 0
    ) -> AbstractAsyncContextManager[Transport]:
        if self.kind == "fake":
            self._n += 1
            return open_fake_transport(self.fake, peer_id=name or f"peer-{self._n}")
        return open_libp2p_transport(key_path=key_path, listen_addrs=[f"/ip4/127.0.0.1/tcp/{port}"])


@pytest.fixture
def net(kind: str) -> Net:
    return Net(kind)


@dataclass(frozen=True)
class Req:
    """A request header and its pairs (what a call sends besides the rows)."""

    req: ExpertRequest
    pairs: Pairs

    @property
    def request_id(self) -> int:
        return self.req.request_id

    @property
    def attempt(self) -> int:
        return self.req.attempt


def make_request(
    rid: int,
    n_rows: int = 3,
    *,
    attempt: int = 0,
    dtype: str = "float32",
    lo: int = 4,
    hi: int = 8,
    experts: list[list[int]] | None = None,
    weights: list[list[float]] | None = None,
    n_pairs: int | None = None,
    d_model: int = D,
) -> Req:
    """Rows' (expert, weight) lists as a v2 header + pairs (in the order given: the defaults are
    sorted by (row, expert), as the wire wants)."""
    n_local = max(1, hi - lo)
    es = experts if experts is not None else [sorted({i % n_local, (i + 1) % n_local}) for i in range(n_rows)]
    ws = weights if weights is not None else [[0.75, 0.25 + i][: len(e)] for i, e in enumerate(es)]
    pr = [r for r, e in enumerate(es) for _ in e]
    pe = [x for e in es for x in e]
    pw = [float(x) for w in ws for x in w]
    pairs = Pairs(np.array(pr, dtype="<u4"), np.array(pe, dtype="<u4"), np.array(pw, dtype="<f4"))
    req = ExpertRequest(
        request_id=RequestId(rid),
        attempt=attempt,
        model_id="tiny-0123456789ab",
        layer=1,
        lo=lo,
        hi=hi,
        n_rows=n_rows,
        d_model=d_model,
        n_pairs=len(pr) if n_pairs is None else n_pairs,
        dtype=dtype,
    )
    return Req(req, pairs)


def wire(r: Req, rows: torch.Tensor) -> tuple[ExpertRequest, torch.Tensor, Pairs]:
    """The positional arguments of ``ExpertClient.call``."""
    return r.req, rows, r.pairs


def payload_of(r: Req, rows: torch.Tensor, dtype: str = "float32") -> bytes:
    """The whole request payload (rows, padding, pairs), for hand-driven streams."""
    return b"".join(bytes(p) for p in encode_request_payload(r.req, tensor_to_payload(rows, dtype), r.pairs))


def expected(r: Req | ExpertRequest, rows: torch.Tensor, pairs: Pairs | None = None) -> torch.Tensor:
    """What ``weighted`` computes, per pair (the v2 answer): its row times w * (expert + 1)."""
    p = r.pairs if isinstance(r, Req) else pairs
    assert p is not None
    scale = p.weights.astype(np.float64) * (p.experts.astype(np.float64) + 1)
    return rows[torch.from_numpy(p.rows.astype(np.int64))] * torch.from_numpy(scale).to(torch.float32)[:, None]


async def weighted(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    return expected(req, rows, pairs)


def rows_for(rid: int, n_rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(rid)
    return torch.randn(n_rows, D, generator=g)


@asynccontextmanager
async def serving(
    net: Net,
    handler: Callable[[ExpertRequest, torch.Tensor, Pairs], Awaitable[torch.Tensor]] = weighted,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    hello: Hello | None = None,
    name: str | None = None,
    key_path: Path | None = None,
    port: int = 0,
) -> AsyncIterator[Transport]:
    async with net.open(name=name, key_path=key_path, port=port) as server:
        server.set_stream_handler(PROTOCOL_ID, expert_stream_handler(handler, hello=hello, limits=limits))
        yield server


@asynccontextmanager
async def client_of(transport: Transport, server: Transport) -> AsyncIterator[ExpertClient]:
    async with open_expert_client(transport, server.peer_id, server.listen_addrs, kernel_id=KERNEL) as client:
        yield client


class Raw:
    """A hand-driven expert stream, for sending what a well-behaved client never would."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.reader = FrameReader(stream)

    @classmethod
    async def open(cls, transport: Transport, server: Transport, *, hello: Hello | None | bool = True) -> Raw:
        """Open and exchange Hellos; ``hello=None`` sends none, a ``Hello`` sends that one."""
        raw = cls(await transport.open_stream(server.peer_id, server.listen_addrs, PROTOCOL_ID))
        their = await raw.receive()
        assert isinstance(their, Hello)
        if hello is True:
            hello = make_hello(kernel_id=KERNEL)
        if isinstance(hello, Hello):
            await raw.stream.write(encode_frame(hello))
        return raw

    async def send(self, msg: Message, payload: bytes | memoryview = b"") -> None:
        await self.stream.write(encode_frame(msg, payload))

    async def receive(self) -> Message | None:
        got = await self.reader.receive_message()
        return None if got is None else got[0]

    async def call(self, req: ExpertRequest, payload: bytes | memoryview) -> Message | None:
        await self.send(req, payload)
        return await self.receive()

    async def ends(self) -> bool:
        """True once the server has closed (or reset) the stream."""
        try:
            return await self.reader.receive_frame() is None
        except TransportError:
            return True


# --------------------------------------------------------------------------------------------
# The happy path


async def test_pipelined_concurrent_calls_return_their_own_rows(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    in_flight = max_in_flight = arrived = 0
    streams_seen = 0
    held: dict[int, trio.Event] = {}  # requests waiting for their batch to fill
    after: dict[int, trio.Event] = {}  # request id -> the event of the one to finish next

    async def slow_in_reverse(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        """Requests are held in batches of 4 (so calls must be pipelined to finish at all), then finish
        in reverse order of their ids, one after another: answers overtake each other."""
        nonlocal in_flight, max_in_flight, arrived
        in_flight += 1
        arrived += 1
        max_in_flight = max(max_in_flight, in_flight)
        go = held[req.request_id] = trio.Event()
        if len(held) == 4 or arrived == 20:
            order = sorted(held, reverse=True)
            events = [held.pop(r) for r in order]
            after.update(zip(order, events[1:], strict=False))
            events[0].set()
        await go.wait()
        in_flight -= 1
        nxt = after.pop(req.request_id, None)
        if nxt is not None:
            nxt.set()
        return expected(req, rows, pairs)

    serve = expert_stream_handler(slow_in_reverse)

    async def counting(stream: Stream) -> None:
        nonlocal streams_seen
        streams_seen += 1
        await serve(stream)

    results: dict[int, torch.Tensor] = {}
    async with net.open() as server, net.open() as me:
        server.set_stream_handler(PROTOCOL_ID, counting)
        async with client_of(me, server) as client:

            async def one(rid: int) -> None:
                n = 1 + rid % 4
                results[rid] = await client.call(*wire(make_request(rid, n), rows_for(rid, n)), timeout=10)

            async with trio.open_nursery() as nursery:
                for rid in range(20):
                    nursery.start_soon(one, rid)
            assert client.sessions_opened == 1
    assert sorted(results) == list(range(20))
    for rid, out in results.items():
        n = 1 + rid % 4
        assert out.dtype == torch.float32
        assert torch.equal(out, expected(make_request(rid, n), rows_for(rid, n)))
    assert streams_seen == 1
    assert max_in_flight > 1, "calls were not pipelined"


async def test_bfloat16_path_and_dtype_negotiation(net: Net, clock: trio.testing.MockClock | None) -> None:
    seen: list[tuple[str, torch.Tensor]] = []

    async def recording(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        seen.append((req.dtype, rows.clone()))
        return expected(req, rows, pairs)

    rows = rows_for(1)
    req = make_request(1, dtype="bfloat16")
    async with serving(net, recording) as server, net.open() as me, client_of(me, server) as client:
        out = await client.call(*wire(req, rows), timeout=10)
    assert seen[0][0] == "bfloat16"
    assert torch.equal(seen[0][1], rows.to(torch.bfloat16).float())  # the server got bf16-rounded rows
    assert out.dtype == torch.float32
    want = expected(req, rows.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    assert torch.equal(out, want)
    assert not torch.equal(out, expected(req, rows))  # bf16 really lost precision on the way

    # a server that only speaks float32: the bfloat16 preference falls back to float32
    seen.clear()
    f32_only = make_hello(kernel_id=KERNEL, dtypes=["float32"])
    async with (
        serving(net, recording, hello=f32_only) as server,
        net.open() as me,
        client_of(me, server) as client,
    ):
        out = await client.call(*wire(req, rows), timeout=10)
    assert seen[0][0] == "float32"
    assert torch.equal(out, expected(req, rows))


async def test_the_server_bounds_requests_in_flight_per_stream(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    running = peak = 0
    both_running, release = trio.Event(), trio.Event()

    async def slow(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        """The first two hold their slots until the test lets them go: eight calls are on their way
        meanwhile, and the server must not start a third."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 2:
            both_running.set()
        await release.wait()
        running -= 1
        return expected(req, rows, pairs)

    results: dict[int, torch.Tensor] = {}
    async with serving(net, slow, limits=WireLimits(max_in_flight=2)) as server, net.open() as me:
        async with client_of(me, server) as client:

            async def one(rid: int) -> None:
                results[rid] = await client.call(*wire(make_request(rid), rows_for(rid)), timeout=10)

            async with trio.open_nursery() as nursery:
                for rid in range(8):
                    nursery.start_soon(one, rid)
                await both_running.wait()
                await trio.testing.wait_all_tasks_blocked()  # every frame sent and read that could be
                assert running == 2
                release.set()
            assert client.peer_hello is not None and client.peer_hello.max_in_flight == 2
    assert peak == 2
    assert all(torch.equal(results[rid], expected(make_request(rid), rows_for(rid))) for rid in range(8))


# --------------------------------------------------------------------------------------------
# Bad input gets error answers; the server keeps serving


async def test_bad_requests_get_error_answers_and_the_stream_survives(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    limits = WireLimits(max_frame_bytes=64 * 1024, max_rows=8)
    release = trio.Event()

    async def handler(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        if req.request_id == 99:
            await release.wait()
        return expected(req, rows, pairs)

    good = make_request(1)
    rows = rows_for(1)
    async with serving(net, handler, limits=limits) as server, net.open() as me:
        raw = await Raw.open(me, server)

        async def status_of(r: Req, payload: bytes | memoryview | None = None) -> str:
            answer = await raw.call(r.req, payload_of(r, rows) if payload is None else payload)
            assert isinstance(answer, ExpertResponse), answer
            assert (answer.request_id, answer.attempt) == (r.request_id, r.attempt)
            if answer.status != "ok":
                assert answer.message  # every error says what is wrong
            return answer.status

        assert await status_of(good) == "ok"
        # the pair arrays: index ranges, order, uniqueness, coverage, weights
        assert await status_of(make_request(2, experts=[[0, 4], [1], [2]], weights=[[1, 1], [1], [1]])) == "bad_index"
        assert await status_of(make_request(3, experts=[[1, 0], [1], [2]], weights=[[1, 1], [1], [1]])) == "bad_index"
        assert await status_of(make_request(4, experts=[[1, 1], [1], [2]], weights=[[1, 1], [1], [1]])) == "bad_index"
        assert await status_of(make_request(5, experts=[[0, 1], [], [2, 3]], weights=[[1, 1], [], [1, 1]])) == "bad_index"
        assert await status_of(make_request(6, weights=[[1, math.nan], [1, 1], [1, 1]])) == "non_finite"
        # the header against the payload and the limits
        assert await status_of(good, payload_of(good, rows)[:-4]) == "bad_shape"
        assert await status_of(good, payload_of(good, rows) + bytes(4)) == "bad_shape"
        assert await status_of(make_request(7, n_pairs=7), payload_of(make_request(7), rows)) == "bad_shape"
        assert await status_of(make_request(8, n_pairs=2)) == "bad_shape"  # fewer pairs than rows
        three = make_request(9)
        assert await status_of(make_request(9, n_rows=2, experts=[[0, 1], [1, 2]]), payload_of(three, rows)) == "bad_shape"
        assert await status_of(make_request(10, dtype="float16")) == "unsupported_dtype"
        many = make_request(11, n_rows=9)
        assert await status_of(many, payload_of(many, rows_for(11, 9))) == "too_many_rows"
        big = make_request(12, n_rows=8, d_model=4096)
        assert await status_of(big, bytes(8 * 4096 * 4 + 16 * 12)) == "frame_too_large"  # read, discarded, answered
        empty_slice = make_request(13, lo=4, hi=4, experts=[[0]] * 3, weights=[[1.0]] * 3)
        assert await status_of(empty_slice) == "bad_shape"

        # an undecodable header with intact framing: an ErrorReply, then business as usual
        await raw.stream.write(struct.pack("<II", 5, 0) + b"\xc1\xc1\xc1\xc1\xc1")
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.code == "malformed_header" and not answer.fatal
        # a header that decodes but is not a request
        await raw.send(make_hello(kernel_id=KERNEL))
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.code == "unexpected_message"
        # the same (request_id, attempt) twice while the first is still computing
        slow = make_request(99)
        await raw.send(slow.req, payload_of(slow, rows))
        dup = await raw.call(slow.req, payload_of(slow, rows))
        assert isinstance(dup, ExpertResponse) and dup.status == "duplicate_request"
        release.set()
        first = await raw.receive()
        assert isinstance(first, ExpertResponse) and first.status == "ok" and first.request_id == 99

        assert await status_of(good) == "ok"

        # lost framing: a header length beyond the limit -> fatal ErrorReply, then this stream closes
        await raw.stream.write(struct.pack("<II", 2**31, 0))
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.code == "frame_too_large" and answer.fatal
        assert await raw.ends()

        # ... and the listener still serves a well-behaved client
        async with client_of(me, server) as client:
            assert torch.equal(await client.call(*wire(good, rows), timeout=10), expected(good, rows))


V1_HELLO = {"type": "hello", "protocol_version": 1, "dtypes": ["float32"], "max_frame_bytes": 1 << 20, "max_rows": 8}


async def test_garbage_and_wrong_version_are_refused_with_a_reason(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    async with serving(net) as server, net.open() as me:
        # garbage instead of a Hello
        raw = await Raw.open(me, server, hello=None)
        await raw.stream.write(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.fatal
        assert answer.code in {"frame_too_large", "malformed_header"}
        assert await raw.ends()

        # a Hello of a future version
        future = Hello(protocol_version=3, kernel_id=KERNEL, dtypes=["float32"], max_frame_bytes=1 << 20, max_rows=8)
        raw = await Raw.open(me, server, hello=future)
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.code == "version_mismatch" and answer.fatal
        assert "version 2" in answer.message and "version 3" in answer.message
        assert await raw.ends()

        # a v1 Hello on the v2 stream (no kernel_id: it does not even decode as a v2 Hello)
        raw = await Raw.open(me, server, hello=None)
        header = msgspec.msgpack.encode(V1_HELLO)
        await raw.stream.write(struct.pack("<II", len(header), 0) + header)
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.code == "version_mismatch" and answer.fatal
        assert "version 1" in answer.message
        assert await raw.ends()

        # a v2 Hello without the required kernel_id
        raw = await Raw.open(me, server, hello=None)
        header = msgspec.msgpack.encode({**V1_HELLO, "protocol_version": 2})
        await raw.stream.write(struct.pack("<II", len(header), 0) + header)
        answer = await raw.receive()
        assert isinstance(answer, ErrorReply) and answer.code == "malformed_header" and answer.fatal
        assert "kernel_id" in answer.message
        assert await raw.ends()

        # a request before any Hello
        raw = await Raw.open(me, server, hello=None)
        r = make_request(1)
        answer = await raw.call(r.req, payload_of(r, rows_for(1)))
        assert isinstance(answer, ErrorReply) and answer.code == "unexpected_message" and answer.fatal
        assert await raw.ends()

        async with client_of(me, server) as client:
            req = make_request(1)
            assert torch.equal(await client.call(*wire(req, rows_for(1)), timeout=10), expected(req, rows_for(1)))


async def test_a_v1_stream_gets_exactly_one_fatal_version_mismatch(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    """A v1 coordinator dialling a v2 volunteer learns why, in one frame, and the stream closes."""
    async with net.open() as server, net.open() as me:
        set_expert_handlers(server, weighted, hello=make_hello(kernel_id=KERNEL))
        stream = await me.open_stream(server.peer_id, server.listen_addrs, V1_PROTOCOL_ID)
        header = msgspec.msgpack.encode(V1_HELLO)
        await stream.write(struct.pack("<II", len(header), 0) + header)  # what a v1 client sends first
        reader = FrameReader(stream)
        frame = await reader.receive_frame()
        assert frame is not None and frame.payload == b""
        reply = msgspec.msgpack.decode(frame.header)  # decoded as a v1 peer would: a plain map
        assert reply["type"] == "error" and reply["code"] == "version_mismatch" and reply["fatal"] is True
        assert "/moe-swarm/expert/2" in reply["message"]
        try:
            assert await reader.receive_frame() is None  # ... and nothing else: closed
        except TransportError:
            pass
        # the v2 protocol on the same peer serves
        async with client_of(me, server) as client:
            r = make_request(2)
            assert torch.equal(await client.call(*wire(r, rows_for(2)), timeout=10), expected(r, rows_for(2)))


async def test_client_refuses_a_server_of_another_version(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    async def future_server(stream: Stream) -> None:
        await stream.write(
            encode_frame(Hello(protocol_version=3, kernel_id="k", dtypes=["float32"], max_frame_bytes=1 << 20, max_rows=8))
        )
        while await stream.read(1 << 16):
            pass

    async def v1_server(stream: Stream) -> None:
        header = msgspec.msgpack.encode(V1_HELLO)
        await stream.write(struct.pack("<II", len(header), 0) + header)
        while await stream.read(1 << 16):
            pass

    for fake in (future_server, v1_server):
        async with net.open() as server, net.open() as me:
            server.set_stream_handler(PROTOCOL_ID, fake)
            async with client_of(me, server) as client:
                with pytest.raises(RemoteProtocolError) as info:
                    await client.call(*wire(make_request(1), rows_for(1)), timeout=10)
        assert info.value.code == "version_mismatch"


# --------------------------------------------------------------------------------------------
# Cancel and authorization


async def test_cancel_drops_a_queued_request_and_its_one_answer_is_cancelled(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    started: list[int] = []
    finished: list[int] = []
    gate = trio.Event()

    async def gated(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        started.append(req.request_id)
        await gate.wait()
        finished.append(req.request_id)
        return expected(req, rows, pairs)

    async with serving(net, gated) as server, net.open() as me:
        raw = await Raw.open(me, server)
        a, b = make_request(1), make_request(2)
        await raw.send(a.req, payload_of(a, rows_for(1)))
        await raw.send(b.req, payload_of(b, rows_for(2)))
        await raw.send(Cancel(request_id=RequestId(1), attempt=0))
        await raw.send(Cancel(request_id=RequestId(77), attempt=0))  # never seen: ignored
        answer = await raw.receive()
        assert isinstance(answer, ExpertResponse)
        assert (answer.request_id, answer.status) == (1, "cancelled")
        gate.set()
        answer = await raw.receive()
        assert isinstance(answer, ExpertResponse) and (answer.request_id, answer.status) == (2, "ok")
        await raw.send(Cancel(request_id=RequestId(2), attempt=0))  # already answered: ignored
        c = make_request(3)
        answer = await raw.call(c.req, payload_of(c, rows_for(3)))  # the next answer is request 3's
        assert isinstance(answer, ExpertResponse) and (answer.request_id, answer.status) == (3, "ok")
    assert 1 not in finished and finished == [2, 3]


async def test_an_abandoned_call_sends_cancel_and_the_server_stops_waiting(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    """A hedge's loser: the caller's scope is cancelled after the frame left -> Cancel on the wire."""
    cancelled = trio.Event()
    entered = trio.Event()

    async def hangs(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        if req.request_id == 1:
            entered.set()
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()
        return expected(req, rows, pairs)

    async with serving(net, hangs) as server, net.open() as me, client_of(me, server) as client:
        with trio.move_on_after(5) as scope:
            async with trio.open_nursery() as nursery:

                async def loser() -> None:
                    await client.call(*wire(make_request(1), rows_for(1)), timeout=30)

                nursery.start_soon(loser)
                await entered.wait()
                nursery.cancel_scope.cancel()  # the hedge was won elsewhere
            await cancelled.wait()  # the server's handler was cancelled by the Cancel frame
        assert not scope.cancelled_caught
        assert client.cancels_sent == 1
        # a timeout abandons the call too
        entered = trio.Event()
        cancelled = trio.Event()
        with pytest.raises(TransportTimeout):
            await client.call(*wire(make_request(1, attempt=1), rows_for(1)), timeout=0.5)
        with trio.fail_after(5):
            await cancelled.wait()
        assert client.cancels_sent == 2
        r = make_request(2)  # the stream is fine; the dropped "cancelled" answers did not confuse it
        assert torch.equal(await client.call(*wire(r, rows_for(2)), timeout=10), expected(r, rows_for(2)))
        assert client.sessions_opened == 1


async def test_unauthorized_peers_are_refused_per_request(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    allowed: set[str] = set()
    async with net.open() as server, net.open() as me:
        server.set_stream_handler(
            PROTOCOL_ID, expert_stream_handler(weighted, hello=make_hello(kernel_id=KERNEL), authorize=allowed.__contains__)
        )
        async with client_of(me, server) as client:
            with pytest.raises(Refused) as info:
                await client.call(*wire(make_request(1), rows_for(1)), timeout=10)
            assert isinstance(info.value, NotAuthorized) and info.value.code == "not_authorized"
            allowed.add(me.peer_id)  # e.g. the market now lists it as a coordinator
            r = make_request(2)
            assert torch.equal(await client.call(*wire(r, rows_for(2)), timeout=10), expected(r, rows_for(2)))
            assert client.sessions_opened == 1


async def test_request_bytes_are_bounded_per_peer_and_given_back(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    """A request whose payload would pass the server's byte budget is discarded as it arrives and
    answered ``busy`` (a refusal); the budget is back at zero after every answer, failed ones too."""
    budget = ByteBudget(per_peer=4096, total=1 << 20)
    async with net.open() as server, net.open() as me:
        server.set_stream_handler(
            PROTOCOL_ID, expert_stream_handler(weighted, hello=make_hello(kernel_id=KERNEL), budget=budget)
        )
        async with client_of(me, server) as client:
            small = make_request(1)
            assert torch.equal(await client.call(*wire(small, rows_for(1)), timeout=10), expected(small, rows_for(1)))
            assert budget.held == 0 and budget.by_peer == {}
            big = make_request(2, n_rows=100)  # 100 rows x 16 floats + pairs: past 4 KiB
            with pytest.raises(Busy):
                await client.call(*wire(big, rows_for(2, 100)), timeout=10)
            assert budget.refused == 1 and budget.held == 0
            again = make_request(4)
            assert torch.equal(await client.call(*wire(again, rows_for(4)), timeout=10), expected(again, rows_for(4)))
            assert budget.held == 0 and client.sessions_opened == 1
        # what a client never sends: invalid requests (bad index, short payload) are answered and give back
        raw = await Raw.open(me, server)
        bad = make_request(5, experts=[[0, 4], [1], [2]], weights=[[1, 1], [1], [1]])
        short = make_request(6)
        for r, payload, status in ((bad, payload_of(bad, rows_for(5)), "bad_index"),
                                   (short, payload_of(short, rows_for(6))[:-4], "bad_shape")):
            answer = await raw.call(r.req, payload)
            assert isinstance(answer, ExpertResponse) and answer.status == status
        assert budget.held == 0 and budget.by_peer == {}


async def test_client_validates_before_sending(net: Net, clock: trio.testing.MockClock | None) -> None:
    calls = 0

    async def counting(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return expected(req, rows, pairs)

    async with serving(net, counting, limits=WireLimits(max_rows=4)) as server, net.open() as me:
        async with client_of(me, server) as client:
            with pytest.raises(LocalProtocolError) as info:
                await client.call(
                    *wire(make_request(1, experts=[[0, 9], [0], [0]], weights=[[1, 1], [1], [1]]), rows_for(1)),
                    timeout=10,
                )
            assert info.value.code == "bad_index"
            with pytest.raises(LocalProtocolError) as info:  # unsorted pairs are refused, not reordered
                await client.call(
                    *wire(make_request(5, experts=[[1, 0], [0], [0]], weights=[[1, 1], [1], [1]]), rows_for(1)),
                    timeout=10,
                )
            assert info.value.code == "bad_index"
            with pytest.raises(LocalProtocolError) as info:
                await client.call(*wire(make_request(2, n_rows=5), rows_for(2, 5)), timeout=10)
            assert info.value.code == "too_many_rows"  # the server's limit, learnt from its Hello
            with pytest.raises(LocalProtocolError):
                await client.call(*wire(make_request(3), rows_for(3, 2)), timeout=10)  # rows do not match n_rows
            assert calls == 0
            await client.call(*wire(make_request(4), rows_for(4)), timeout=10)
            assert calls == 1


async def test_handler_failures_become_error_answers(net: Net, clock: trio.testing.MockClock | None) -> None:
    async def flaky(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        match req.request_id:
            case 1:
                raise ValueError("secret internals")
            case 2:
                raise SliceError("slice 4-8 of layer 1 is not loaded", code="slice_not_loaded")
            case 3:
                return torch.zeros(req.n_pairs + 1, req.d_model)
            case 4:
                return torch.full((req.n_pairs, req.d_model), math.inf)
        return expected(req, rows, pairs)

    async with serving(net, flaky) as server, net.open() as me, client_of(me, server) as client:
        for rid, code in [
            (1, "internal_error"),
            (2, "slice_not_loaded"),
            (3, "internal_error"),
            (4, "non_finite"),
        ]:
            with pytest.raises(RemoteProtocolError) as info:
                await client.call(*wire(make_request(rid), rows_for(rid)), timeout=10)
            assert info.value.code == code
            assert "secret" not in info.value.message
        req = make_request(5)
        assert torch.equal(await client.call(*wire(req, rows_for(5)), timeout=10), expected(req, rows_for(5)))
        assert client.sessions_opened == 1


async def test_client_rejects_wrong_shapes_and_nan_from_the_server(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    async def lying_server(stream: Stream) -> None:
        reader = FrameReader(stream)
        await stream.write(encode_frame(make_hello(kernel_id=KERNEL)))
        while got := await reader.receive_message():
            msg, _ = got
            if not isinstance(msg, ExpertRequest):
                continue
            ids = {"request_id": msg.request_id, "attempt": msg.attempt, "status": "ok", "dtype": "float32"}
            shape = {"n_rows": msg.n_rows, "n_pairs": msg.n_pairs, "d_model": msg.d_model}
            if msg.request_id == 1:  # the header promises the right shape, the payload is short
                answer = ExpertResponse(**ids, **shape)
                await stream.write(encode_frame(answer, bytes(4)))
            elif msg.request_id == 2:  # a different shape
                answer = ExpertResponse(**ids, **{**shape, "n_pairs": msg.n_pairs + 1})
                await stream.write(encode_frame(answer, bytes(4 * (msg.n_pairs + 1) * msg.d_model)))
            elif msg.request_id == 3:  # NaN
                bad = torch.full((msg.n_pairs, msg.d_model), math.nan)
                answer = ExpertResponse(**ids, **shape)
                await stream.write(encode_frame(answer, tensor_to_payload(bad, "float32")))
            else:
                answer = ExpertResponse(**ids, **shape)
                await stream.write(encode_frame(answer, bytes(4 * msg.n_pairs * msg.d_model)))

    async with net.open() as server, net.open() as me:
        server.set_stream_handler(PROTOCOL_ID, lying_server)
        async with client_of(me, server) as client:
            for rid, code in [(1, "bad_shape"), (2, "bad_shape"), (3, "non_finite")]:
                with pytest.raises(RemoteProtocolError) as info:
                    await client.call(*wire(make_request(rid), rows_for(rid)), timeout=10)
                assert info.value.code == code
            req4 = make_request(4)
            out = await client.call(*wire(req4, rows_for(4)), timeout=10)
            assert torch.equal(out, torch.zeros(req4.req.n_pairs, D))


# --------------------------------------------------------------------------------------------
# Time, attempts, broken streams


async def test_hanging_handler_gives_a_client_timeout(net: Net, clock: trio.testing.MockClock | None) -> None:
    async def hangs_on_7(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        if req.request_id == 7:
            await trio.sleep_forever()
        return expected(req, rows, pairs)

    async with serving(net, hangs_on_7) as server, net.open() as me, client_of(me, server) as client:
        t0 = trio.current_time()
        with pytest.raises(TransportTimeout):
            await client.call(*wire(make_request(7), rows_for(7)), timeout=0.3)
        elapsed = trio.current_time() - t0
        if clock is not None:
            assert elapsed == pytest.approx(0.3)
        else:
            assert 0.3 <= elapsed < 1.0
        req = make_request(8)
        assert torch.equal(await client.call(*wire(req, rows_for(8)), timeout=10), expected(req, rows_for(8)))
        assert client.sessions_opened == 1  # a timeout is not a broken stream


async def test_late_answer_from_an_old_attempt_is_ignored(
    net: Net, clock: trio.testing.MockClock | None
) -> None:
    second_answered, late_answer_written = trio.Event(), trio.Event()

    async def slow_first_attempt(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        if (req.request_id, req.attempt) == (5, 0):
            # a computation that cannot be interrupted (a kernel in a thread): the client's Cancel
            # arrives too late, and the stale answer comes back after the second attempt's
            with trio.CancelScope(shield=True):
                await second_answered.wait()
            return -expected(req, rows, pairs)  # distinguishable from the real answer
        return expected(req, rows, pairs)

    class Watched(Stream):
        """The server's side of the stream, telling when the stale answer has been written."""

        def __init__(self, inner: Stream) -> None:
            self.inner = inner
            self.out = FrameDecoder()

        @property
        def remote_peer_id(self) -> str:
            return self.inner.remote_peer_id

        async def read(self, max_bytes: int) -> bytes:
            return await self.inner.read(max_bytes)

        async def write(self, data: bytes | bytearray | memoryview) -> None:
            await self.inner.write(data)
            self.out.feed(data)
            while (f := self.out.next_frame()) is not None:
                m = decode_message(f.header)
                if isinstance(m, ExpertResponse) and (m.request_id, m.attempt) == (5, 0):
                    late_answer_written.set()

        async def aclose(self) -> None:
            await self.inner.aclose()

    req0 = make_request(5, attempt=0)
    req1 = make_request(5, attempt=1)
    rows = rows_for(5)
    inner = expert_stream_handler(slow_first_attempt, hello=make_hello(kernel_id=KERNEL))

    async def watched(stream: Stream) -> None:
        await inner(Watched(stream))

    async with net.open() as server, net.open() as me, client_of(me, server) as client:
        server.set_stream_handler(PROTOCOL_ID, watched)
        with pytest.raises(TransportTimeout):
            await client.call(*wire(req0, rows), timeout=0.2)
        assert torch.equal(await client.call(*wire(req1, rows), timeout=10), expected(req1, rows))
        second_answered.set()
        await late_answer_written.wait()  # it is on the stream before anything the next call gets back
        req2 = make_request(6)
        assert torch.equal(await client.call(*wire(req2, rows_for(6)), timeout=10), expected(req2, rows_for(6)))
        assert client.sessions_opened == 1


async def test_server_killed_mid_call_then_reconnect_after_restart(
    net: Net, clock: trio.testing.MockClock | None, tmp_path: Path
) -> None:
    entered = trio.Event()

    async def hangs_on_1(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        if req.request_id == 1:
            entered.set()
            await trio.sleep_forever()
        return expected(req, rows, pairs)

    key = tmp_path / "worker.key"  # libp2p: the restarted worker keeps its identity ...
    where: list[tuple[str, list[str]]] = []

    async def run_worker(port: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with serving(net, hangs_on_1, name="worker", key_path=key, port=port) as server:
            where.append((server.peer_id, server.listen_addrs))
            task_status.started()
            await trio.sleep_forever()

    async with net.open() as me, trio.open_nursery() as nursery:
        kill = trio.CancelScope()

        async def killable_worker(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with kill:
                await run_worker(0, task_status=task_status)

        await nursery.start(killable_worker)
        peer_id, addrs = where[0]
        async with open_expert_client(me, peer_id, addrs) as client:
            outcome: list[BaseException] = []

            async def doomed() -> None:
                try:
                    await client.call(*wire(make_request(1), rows_for(1)), timeout=30)
                except TransportError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as calls:
                calls.start_soon(doomed)
                await entered.wait()
                kill.cancel()  # the worker dies with the call in flight
            assert len(outcome) == 1 and isinstance(outcome[0], BrokenError), outcome

            with pytest.raises(TransportError):  # while it is down
                await client.call(*wire(make_request(2), rows_for(2)), timeout=5)

            port = int(addrs[0].split("/tcp/")[1].split("/")[0]) if net.kind == "libp2p" else 0
            await nursery.start(run_worker, port)  # ... and its address
            assert where[1][0] == peer_id
            req = make_request(3)
            assert torch.equal(await client.call(*wire(req, rows_for(3)), timeout=10), expected(req, rows_for(3)))
            assert client.sessions_opened == 2
        nursery.cancel_scope.cancel()


async def test_client_aclose_fails_waiting_calls(net: Net, clock: trio.testing.MockClock | None) -> None:
    async def hangs(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        await trio.sleep_forever()
        raise AssertionError

    async with serving(net, hangs) as server, net.open() as me, client_of(me, server) as client:
        errors: list[BaseException] = []

        async def waiting(rid: int) -> None:
            try:
                await client.call(*wire(make_request(rid), rows_for(rid)), timeout=30)
            except ClosedError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for rid in range(3):
                nursery.start_soon(waiting, rid)
            async def all_pending() -> bool:  # all three are waiting for their answers (not still dialling)
                return client._session is not None and len(client._session.pending) == 3

            await eventually(all_pending, within=30)
            await client.aclose()
        assert len(errors) == 3
        with pytest.raises(ClosedError):
            await client.call(*wire(make_request(9), rows_for(9)), timeout=1)


async def test_unreachable_peer_is_a_transport_error(net: Net, clock: trio.testing.MockClock | None) -> None:
    async with serving(net) as server, net.open() as me:
        peer_id, addrs = server.peer_id, server.listen_addrs
    async with open_expert_client(me, peer_id, addrs) as client:
        with pytest.raises(TransportError):
            await client.call(*wire(make_request(1), rows_for(1)), timeout=5)
