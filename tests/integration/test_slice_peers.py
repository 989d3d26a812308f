"""``/moe-swarm/slice/1`` between real libp2p hosts on loopback (Noise, Yamux, TCP): a volunteer's
``SliceServer`` holding two slice files, downloaders with ``PeerSource`` / ``SliceClient``. The
lease check is injected here (a table); ``test_slice_sources_market`` runs it against a real market."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from swarm.errors import SliceRefused
from swarm.model.gguf import GGUFModel
from swarm.model.slices import build_manifest, cut_slice, plan_slice
from swarm.model.sources import fetch_slice_from
from swarm.p2p.libp2p import Libp2pTransport, open_libp2p_transport
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import LeaseView
from swarm.protocol.slice import SLICE_PROTOCOL_ID, SliceErrorReply, decode_slice_message
from swarm.rpc.slice_client import PeerSource, SliceClient, open_slice_client
from swarm.rpc.slice_server import DEFAULT_SHARE_CONFIG, SliceServer, SliceShareConfig, set_slice_handler
from tests.conftest import GOLDEN_GGUF, eventually

GATE = 64 * 128 * 4  # one golden expert's gate bytes (F32 [64, 128])


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(GOLDEN_GGUF)


@pytest.fixture(scope="module")
def manifest(model: GGUFModel) -> ModelManifest:
    return build_manifest(model)


@dataclass
class Leases:
    """The market's answers, as a table (and how often it was asked)."""

    table: dict[str, LeaseView]
    asked: int = 0

    async def check(self, lease_id: str) -> LeaseView | None:
        self.asked += 1
        return self.table.get(lease_id)


@dataclass
class Holder:
    transport: Libp2pTransport
    server: SliceServer
    leases: Leases

    @property
    def addrs(self) -> list[str]:
        return self.transport.listen_addrs


def write_held(model: GGUFModel, directory: Path, corrupt_at: int | None) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for layer, lo, hi in [(0, 0, 8), (1, 2, 6)]:  # a volunteer may hold several slices
        path = directory / f"held-{layer}-{lo}-{hi}.safetensors"
        data = bytearray(cut_slice(model, layer, lo, hi))
        if corrupt_at is not None and layer == 0:
            data[corrupt_at] ^= 0x40
        path.write_bytes(bytes(data))
        out.append(path)
    return out


@asynccontextmanager
async def holder(model: GGUFModel, tmp_path: Path, config: SliceShareConfig = DEFAULT_SHARE_CONFIG, *,
                 corrupt_at: int | None = None) -> AsyncIterator[Holder]:
    """A volunteer holding 0:0-8 and 1:2-6; ``corrupt_at``: a byte of its 0:0-8 file flipped there."""
    leases = Leases({})
    server = SliceServer(leases.check, config)
    for path in write_held(model, tmp_path, corrupt_at):
        server.add_slice(path)
    async with open_libp2p_transport(key_path=None) as t:
        set_slice_handler(t, server)
        yield Holder(t, server, leases)


def lease(lease_id: str, peer: str, model: GGUFModel, layer: int, lo: int, hi: int) -> LeaseView:
    return LeaseView(lease_id=lease_id, peer_id=peer, model_id=model.model_id, layer=layer, lo=lo, hi=hi,
                     expires_in_s=30.0)


async def ask(c: SliceClient, model: GGUFModel, *, layer: int = 0, e_lo: int = 2, e_hi: int = 6, offset: int = 0,
              length: int = GATE, lease_id: str = "L1") -> bytes | str:
    """The bytes, or the refusal's code."""
    try:
        return bytes(await c.read(model_id=model.model_id, layer=layer, kind="gate", e_lo=e_lo, e_hi=e_hi,
                                  offset=offset, length=length, lease_id=lease_id))
    except SliceRefused as exc:
        return exc.code


async def test_a_peer_serves_a_slice_it_holds_within_a_larger_one(model: GGUFModel, manifest: ModelManifest,
                                                                  tmp_path: Path) -> None:
    async with holder(model, tmp_path) as h, open_libp2p_transport(key_path=None) as me:
        h.leases.table["L1"] = lease("L1", me.peer_id, model, 0, 2, 6)
        src = PeerSource(me, h.transport.peer_id, h.addrs, "L1", max_request_bytes=100_000)
        dest = tmp_path / "got" / "0-2-6.safetensors"
        plan = plan_slice(manifest, 0, 2, 6)
        res = await fetch_slice_from([src], manifest, 0, 2, 6, dest, group_bytes=plan.bytes_per_expert)
        assert dest.read_bytes() == cut_slice(model, 0, 2, 6)
        assert res.bytes_from == {src.name: 4 * plan.bytes_per_expert} and not res.failed
        # four groups, each kind in requests of at most 100,000 bytes, on ONE stream; the market asked once
        assert h.server.streams == 1 and h.leases.asked == 1
        assert h.server.requests_served == 4 * sum(-(-n // 100_000) for n in plan.kind_bytes.values())
        await eventually(_no_uploads(h.server))  # the download's stream closed: its place is free again


async def test_a_lying_peer_is_dropped_and_the_next_peer_completes(model: GGUFModel, manifest: ModelManifest,
                                                                   tmp_path: Path) -> None:
    plan8 = plan_slice(manifest, 0, 0, 8)  # where the holders' 0:0-8 file keeps expert 4's down bytes
    async with holder(model, tmp_path / "liar", corrupt_at=plan8.file_offset("down", 4) + 99) as liar, \
            holder(model, tmp_path / "good") as good, open_libp2p_transport(key_path=None) as me:
        for h in (liar, good):
            h.leases.table["L1"] = lease("L1", me.peer_id, model, 0, 2, 6)
        sources = [PeerSource(me, h.transport.peer_id, h.addrs, "L1") for h in (liar, good)]
        plan = plan_slice(manifest, 0, 2, 6)
        dest = tmp_path / "0-2-6.safetensors"
        res = await fetch_slice_from(sources, manifest, 0, 2, 6, dest, group_bytes=plan.bytes_per_expert)
        assert dest.read_bytes() == cut_slice(model, 0, 2, 6)
        assert res.lied == [sources[0].name] and "expert 4" in res.failed[sources[0].name]
        bpe = plan.bytes_per_expert
        assert res.bytes_from == {sources[0].name: 2 * bpe, sources[1].name: 2 * bpe}
        assert liar.server.requests_served == 3 * 3  # experts 2, 3 and the lie; never asked again


def _no_uploads(server: SliceServer) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return server.uploading_peers == 0

    return check


async def test_refusals_keep_the_stream_serving(model: GGUFModel, tmp_path: Path) -> None:
    async with holder(model, tmp_path) as h, open_libp2p_transport(key_path=None) as me, \
            open_libp2p_transport(key_path=None) as other:
        h.leases.table.update({
            "L1": lease("L1", me.peer_id, model, 0, 2, 6),
            "theirs": lease("theirs", other.peer_id, model, 0, 2, 6),  # another volunteer's lease
            "L3": lease("L3", me.peer_id, model, 1, 0, 8),  # layer 1: experts 0-2 are not held here
        })
        stack = model.expert_stack(0, 2, 6)
        want = stack.gate_t.raw.tobytes()
        async with open_slice_client(me, h.transport.peer_id, h.addrs) as c:
            assert await ask(c, model, lease_id="unknown") == "not_assigned"
            assert await ask(c, model, lease_id="theirs") == "not_assigned"
            assert await ask(c, model, e_lo=1, lease_id="L1") == "not_assigned"  # outside the lease's range
            assert await ask(c, model, layer=1, e_lo=0, e_hi=3, lease_id="L3") == "not_held"
            assert await ask(c, model, length=(8 << 20) + 1) == "too_large"
            assert await ask(c, model, length=4 * GATE + 1) == "bad_request"  # past experts 2-5's gate bytes
            assert await ask(c, model, e_lo=4, e_hi=4) == "bad_request"
            # the same stream still serves: byte ranges within experts 2-5 of the held 0:0-8 file
            assert await ask(c, model, offset=GATE + 10, length=GATE) == want[GATE + 10 : 2 * GATE + 10]
            got = await ask(c, model, layer=1, e_lo=3, e_hi=5, length=2 * GATE, lease_id="L3")
            assert got == model.expert_stack(1, 3, 5).gate_t.raw.tobytes()  # from the 1:2-6 file
            h.server.set_sharing(False)
            assert await ask(c, model) == "opted_out"
            h.server.set_sharing(True)
            assert await ask(c, model) == want[:GATE]
        assert h.server.streams == 1
        assert dict(h.server.refusals) == {"not_assigned": 3, "not_held": 1, "too_large": 1, "bad_request": 2,
                                           "opted_out": 1}


async def test_malformed_frames_get_error_frames_and_lost_framing_ends_the_stream(model: GGUFModel,
                                                                                  tmp_path: Path) -> None:
    async with holder(model, tmp_path) as h, open_libp2p_transport(key_path=None) as me:
        h.leases.table["L1"] = lease("L1", me.peer_id, model, 0, 2, 6)
        stream = await me.open_stream(h.transport.peer_id, h.addrs, SLICE_PROTOCOL_ID)
        c = SliceClient(stream)
        for junk in (b"\x93\x01\x02", b"\x81\xa4type\xaaslice_data"):  # not msgpack of a request / the wrong message
            await stream.write(struct.pack("<II", len(junk), 0) + junk)
            frame = await c._reader.receive_frame()
            assert frame is not None
            reply = decode_slice_message(frame.header)
            assert isinstance(reply, SliceErrorReply) and reply.code == "bad_request" and not reply.fatal
        await stream.write(struct.pack("<II", 3, 5) + b"abcde123")  # a payload on a request
        frame = await c._reader.receive_frame()
        assert frame is not None and decode_slice_message(frame.header).code == "bad_request"  # type: ignore[union-attr]
        assert await ask(c, model) == model.expert_stack(0, 2, 6).gate_t.raw.tobytes()[:GATE]  # still serving
        await stream.write(struct.pack("<II", 1 << 20, 0))  # a header length beyond the limit: framing lost
        frame = await c._reader.receive_frame()
        assert frame is not None
        reply = decode_slice_message(frame.header)
        assert isinstance(reply, SliceErrorReply) and reply.fatal
        with trio.fail_after(5):
            assert await stream.read(1) == b""  # closed by the server


async def test_downloading_peers_are_capped_and_uploads_rate_limited(model: GGUFModel, tmp_path: Path) -> None:
    config = SliceShareConfig(max_peers=1, rate_bytes_per_s=2e5, burst_bytes=4 * GATE, max_wait_s=0.2)
    async with holder(model, tmp_path, config) as h, open_libp2p_transport(key_path=None) as a, \
            open_libp2p_transport(key_path=None) as b:
        h.leases.table.update({"A": lease("A", a.peer_id, model, 0, 0, 8), "B": lease("B", b.peer_id, model, 0, 0, 8)})
        async with open_slice_client(b, h.transport.peer_id, h.addrs) as cb:
            async with open_slice_client(a, h.transport.peer_id, h.addrs) as ca:
                assert isinstance(await ask(ca, model, lease_id="A"), bytes)  # A holds the one place
                assert await ask(cb, model, lease_id="B") == "busy"
                # 8 experts' gate bytes at once: more than the bucket gives within 0.2 s
                try:
                    await ca.read(model_id=model.model_id, layer=0, kind="gate", e_lo=0, e_hi=8, offset=0,
                                  length=8 * GATE, lease_id="A")
                except SliceRefused as exc:
                    assert exc.code == "rate_limited" and exc.retry_after_s is not None and exc.retry_after_s > 0
                else:
                    raise AssertionError("not rate limited")
                assert isinstance(await ask(ca, model, lease_id="A"), bytes)  # nothing was taken for the refusal
            await eventually(_no_uploads(h.server))
            assert isinstance(await ask(cb, model, lease_id="B"), bytes)  # A left: B's turn
