"""Slices from many sources, end to end in one process with real components: a market (hypercorn,
SQLite), a coordinator on it (the golden model, ``--origin``), an origin mirror (Starlette's
``FileResponse``) and three volunteers on real libp2p hosts, each sharing what it holds over
``/moe-swarm/slice/1`` and checking leases with the market's ``GET /api/leases/{id}``.

The first two volunteers download whole layers from the mirror (no peer holds them yet) and serve
them; the third is assigned part of a layer and downloads it from the volunteer holding it, which
asks the market about the third one's lease while it is ``leased`` and again while it is
``loading``; once it serves, the lease no longer opens anything."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from coordinator.server import CoordinatorConfig, serve_coordinator
from market.policy import MarketPolicy
from market.server import MarketConfig, serve_market
from swarm.errors import SliceRefused
from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice
from swarm.model.sources import OriginSource, fetch_slice_from
from swarm.p2p.identity import SIGNATURE_HEADER, load_or_create_identity, sign_request
from swarm.p2p.libp2p import Libp2pTransport, open_libp2p_transport
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import (
    Assignment,
    CoverageHeartbeat,
    HeldSlice,
    HeldState,
    LeaseView,
    NothingNeeded,
    VolunteerRequest,
)
from swarm.rpc.slice_client import PeerSource, open_slice_client, sources_from_assignment
from swarm.rpc.slice_server import SliceServer, SliceShareConfig, market_lease_check, set_slice_handler
from tests.conftest import GOLDEN_GGUF, eventually
from tests.integration.test_slice_download import file_app, serve_app

TOKEN = "s3cret"
POLICY = MarketPolicy(base_target=2, boost=0, proof_grace_s=0.0, heartbeat_ttl_s=30.0, lease_s=30.0,
                      header_allowance=0, max_leases_per_address=64)
_answer = msgspec.json.Decoder(Assignment | NothingNeeded)


@dataclass
class Volunteer:
    transport: Libp2pTransport
    key: Any
    server: SliceServer
    seq: int = 0
    held: list[HeldSlice] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    async def post(self, c: httpx.AsyncClient, path: str, body: msgspec.Struct) -> httpx.Response:
        raw = msgspec.json.encode(body)
        return await c.post(path, content=raw, headers={"content-type": "application/json",
                                                        SIGNATURE_HEADER: sign_request(self.key, "POST", path, raw)})

    async def poll(self, c: httpx.AsyncClient, max_experts: int) -> Assignment:
        self.seq += 1
        r = await self.post(c, "/api/expert-volunteer", VolunteerRequest(
            self.peer_id, epoch=1, sequence=self.seq, sent_at_ms=int(time.time() * 1000), max_experts=max_experts))
        ans = _answer.decode(r.content)
        assert isinstance(ans, Assignment), r.text
        return ans

    async def heartbeat(self, c: httpx.AsyncClient, state: HeldState) -> None:
        self.seq += 1
        self.held = [msgspec.structs.replace(h, state=state) for h in self.held]
        r = await self.post(c, "/api/expert-coverage", CoverageHeartbeat(
            self.peer_id, 1, self.seq, self.transport.listen_addrs, self.held, protocols=[2],
            sent_at_ms=int(time.time() * 1000), share_slices=self.server.sharing))
        assert r.status_code == 200 and [d["action"] for d in r.json()["slices"]] == ["keep"] * len(self.held), r.text


async def lease_of(c: httpx.AsyncClient, lease_id: str) -> LeaseView | int:
    r = await c.get(f"/api/leases/{lease_id}")
    return msgspec.json.decode(r.content, type=LeaseView) if r.status_code == 200 else r.status_code


async def refusal(asker: Volunteer, holder: Volunteer, a: Assignment) -> str:
    """The code ``holder`` refuses ``asker``'s read of ``a``'s first gate bytes with (under ``a``'s lease)."""
    async with open_slice_client(asker.transport, holder.peer_id, holder.transport.listen_addrs) as sc:
        with pytest.raises(SliceRefused) as refused:
            await sc.read(model_id=a.model_id, layer=a.layer, kind="gate", e_lo=a.lo, e_hi=a.hi, offset=0,
                          length=1024, lease_id=a.lease_id)
    return refused.value.code


async def test_volunteers_download_from_the_mirror_then_from_each_other(nursery: trio.Nursery, tmp_path: Path) -> None:
    market_url = await nursery.start(serve_market, MarketConfig(
        db=str(tmp_path / "market.db"), port=0, token=TOKEN, poll_interval_s=0.2, tick_s=0.05, seed=3, policy=POLICY))
    origin = await serve_app(nursery, file_app(GOLDEN_GGUF)) + "/models/m.gguf"
    await nursery.start(serve_coordinator, CoordinatorConfig(
        model=str(GOLDEN_GGUF), port=0, slots=1, data_dir=str(tmp_path / "coordinator"), market=market_url,
        token=TOKEN, origins=(origin,)))
    model = GGUFModel(GOLDEN_GGUF)
    async with httpx.AsyncClient(base_url=market_url, timeout=10.0) as c, \
            open_libp2p_transport(key_path=tmp_path / "a.key") as ta, \
            open_libp2p_transport(key_path=tmp_path / "b.key") as tb, \
            open_libp2p_transport(key_path=tmp_path / "n.key") as tn:
        vols = {}
        for name, t in (("a", ta), ("b", tb), ("n", tn)):
            # every lease answer re-asked of the market: the loading rule below is really exercised
            server = SliceServer(market_lease_check(c, market_url), SliceShareConfig(lease_cache_s=1e-6))
            set_slice_handler(t, server)
            vols[name] = Volunteer(t, load_or_create_identity(tmp_path / f"{name}.key"), server)

        async def registered() -> ModelManifest | None:
            r = await c.get(f"/api/models/{model.model_id}/manifest")
            return msgspec.json.decode(r.content, type=ModelManifest) if r.status_code == 200 else None

        manifest = await eventually(registered)
        assert manifest.origins == [origin] and manifest.can_verify_experts

        async def download(v: Volunteer, a: Assignment) -> tuple[Path, dict[str, int]]:
            dest = tmp_path / v.peer_id / f"{a.layer}-{a.lo}-{a.hi}.safetensors"
            sources = sources_from_assignment(a, client=c, transport=v.transport, self_peer_id=v.peer_id)
            res = await fetch_slice_from(sources, manifest, a.layer, a.lo, a.hi, dest, expected_sha256=a.sha256)
            assert dest.read_bytes() == cut_slice(model, a.layer, a.lo, a.hi)
            assert res.failed == {} and res.lied == []
            return dest, res.bytes_from

        # two volunteers take the two layers: nobody holds them yet, so the mirror, then the coordinator
        for name in ("a", "b"):
            v = vols[name]
            a = await v.poll(c, max_experts=8)
            assert [(s.kind, s.url) for s in a.sources] == [("origin", origin), ("coordinator", a.url)]
            dest, got = await download(v, a)
            assert got == {f"origin {origin}": (a.hi - a.lo) * manifest.bytes_per_expert[a.layer]}
            v.server.add_slice(dest)
            v.held = [HeldSlice(a.model_id, a.layer, a.lo, a.hi, HeldState.LOADING)]
            await v.heartbeat(c, HeldState.LOADING)
            await v.heartbeat(c, HeldState.SERVING)
        holder = {s.layer: v for v in (vols["a"], vols["b"]) for s in v.held}
        assert sorted(holder) == [0, 1]

        # the newcomer gets half a layer: first the volunteer holding it, then the mirror and the coordinator
        n = vols["n"]
        a = await n.poll(c, max_experts=4)
        h = holder[a.layer]
        assert [s.kind for s in a.sources] == ["peer", "origin", "coordinator"]
        assert (a.sources[0].peer_id, a.sources[0].addrs) == (h.peer_id, h.transport.listen_addrs)
        view = await lease_of(c, a.lease_id)
        assert isinstance(view, LeaseView) and (view.peer_id, view.layer, view.lo, view.hi, view.state) == (
            n.peer_id, a.layer, a.lo, a.hi, "leased")
        dest, got = await download(n, a)
        assert got == {f"peer {h.peer_id}": 4 * manifest.bytes_per_expert[a.layer]}
        asked = h.server.requests_served

        # reported loading: the lease has become coverage, and the market still vouches for the download
        n.held = [HeldSlice(a.model_id, a.layer, a.lo, a.hi, HeldState.LOADING)]
        await n.heartbeat(c, HeldState.LOADING)
        view = await lease_of(c, a.lease_id)
        assert isinstance(view, LeaseView) and view.state == "loading" and view.peer_id == n.peer_id
        dest.unlink()
        peer_only = [PeerSource(n.transport, h.peer_id, h.transport.listen_addrs, a.lease_id)]
        res = await fetch_slice_from(peer_only, manifest, a.layer, a.lo, a.hi, dest, expected_sha256=a.sha256)
        assert res.bytes_from == got and h.server.requests_served == 2 * asked

        # the lease opens nothing for anyone else, nor for anything outside its slice
        other = vols["b" if h is vols["a"] else "a"]
        assert await refusal(other, h, a) == "not_assigned"  # another volunteer cannot use the newcomer's lease

        # serving: the download is over and the lease is no longer known
        await n.heartbeat(c, HeldState.SERVING)
        assert await lease_of(c, a.lease_id) == 404
        assert (await c.get("/api/leases/0123456789abcdef")).json()["error"]["code"] == "unknown_lease"
        assert await refusal(n, h, a) == "not_assigned"  # a lease of a served slice opens it no more
        # and the mirror alone gives the same file (OriginSource at the manifest's offsets)
        res = await fetch_slice_from([OriginSource(c, origin)], manifest, a.layer, a.lo, a.hi, tmp_path / "m.st",
                                     expected_sha256=a.sha256)
        assert (tmp_path / "m.st").read_bytes() == dest.read_bytes()
