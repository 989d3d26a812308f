"""From a wrong answer to the market's refusal, with real components: a real market (HTTP, SQLite),
a coordinator's dispatcher with the engine on the golden model and its ``MarketLink``, and a lying
volunteer on a real libp2p host that took a lease like any volunteer (signed poll) and reported it. The
coordinator verifies the liar's first answer, quarantines it (the output stays all-local) and reports
it; the market drops its coverage (the next map leaves it out) and refuses its heartbeats and polls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import torch
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from coordinator.api.slices import slice_routes
from coordinator.core.dispatch import DispatchConfig, DispatchMode
from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.dispatch.market_link import MarketLink
from coordinator.engine.model import Transformer
from market.policy import MarketPolicy
from market.server import MarketConfig, serve_market
from swarm.model.gguf import GGUFModel
from swarm.model.slices import SliceCache, build_manifest, cut_slice, load_slice
from swarm.p2p.identity import SIGNATURE_HEADER, load_or_create_identity, peer_id_of, sign_body, sign_request
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.protocol.expert import ExpertRequest, Pairs, make_hello
from swarm.protocol.market import CoverageHeartbeat, HeldSlice, HeldState
from swarm.rpc.server import set_expert_handlers
from tests.conftest import eventually
from tests.integration.support import greedy
from volunteer.server import ExpertServer

TOKEN = "t0k"


async def test_a_liar_is_quarantined_reported_and_refused_by_the_market(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], tmp_path: Path
) -> None:
    model = golden_model
    # hold challenges off: this liar holds its slices (it answers x1.5); verification is what catches it
    market_url, d, link, coord_t = await _coordinator_and_market(
        nursery, model, tmp_path, MarketPolicy(heartbeat_ttl_s=30.0, flush_s=0.2), prove_holdings=False)
    # the liar: a volunteer host answering x1.5, with the key its heartbeats are signed with
    key_path = tmp_path / "liar.key"
    kp = load_or_create_identity(key_path)
    server = ExpertServer([load_slice(cut_slice(model, L, 0, 8)) for L in (0, 1)], threads=1)

    async def lie(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        return (await server.handle(req, rows, pairs)) * 1.5

    liar_t = await nursery.start(_host, key_path)
    await nursery.start(server.serve)
    set_expert_handlers(liar_t, lie, hello=make_hello(kernel_id=server.kernel_id))
    seq = 0

    async def poll() -> httpx.Response:
        nonlocal seq
        seq += 1
        raw = msgspec.json.encode({"peer_id": peer_id_of(kp), "max_experts": 8, "epoch": 1, "sequence": seq,
                                   "sent_at_ms": int(time.time() * 1000)})
        async with httpx.AsyncClient(base_url=market_url) as h:
            return await h.post("/api/expert-volunteer", content=raw, headers={
                "content-type": "application/json", SIGNATURE_HEADER: sign_request(kp, "POST", "/api/expert-volunteer", raw)})

    # coverage comes from assignment: the liar first takes a lease like any volunteer
    a = (await poll()).json()
    assert a["kind"] == "assignment", a
    layer = a["layer"]

    async def beat() -> httpx.Response:
        nonlocal seq
        seq += 1
        body = CoverageHeartbeat(peer_id_of(kp), 1, seq, list(liar_t.listen_addrs),
                                 [HeldSlice(model.model_id, layer, a["lo"], a["hi"], HeldState.SERVING)], protocols=[2])
        raw = msgspec.json.encode(msgspec.structs.replace(body, signature=sign_body(kp, body)))
        async with httpx.AsyncClient(base_url=market_url) as h:
            return await h.post("/api/expert-coverage", content=raw, headers={"content-type": "application/json"})

    r = await beat()
    assert r.status_code == 200 and r.json()["coordinators"] == [coord_t.peer_id]

    async def mapped() -> bool:
        return d.map is not None and peer_id_of(kp) in d.map.peers()

    await eventually(mapped)
    ref = Dispatcher(model, None)
    g = golden["greedy"][2]
    toks, lgs = await greedy(Transformer(model, d), g["prompt_ids"], 6)
    ref_toks, ref_lgs = await greedy(Transformer(model, ref), g["prompt_ids"], 6)
    assert toks == ref_toks and all(torch.equal(a, b) for a, b in zip(lgs, ref_lgs, strict=True))

    async def refused() -> bool:
        return (await beat()).status_code == 403

    await eventually(refused)  # reported and refused: its coverage is gone, its heartbeats are too
    r = await beat()
    assert r.json()["error"]["code"] == "quarantined" and "experts" in r.json()["error"]["message"]

    async def unmapped() -> bool:
        return d.map is not None and peer_id_of(kp) not in d.map.peers()

    await eventually(unmapped)
    assert (await poll()).json()["reason"] == "quarantined"
    assert [w.state for w in d.report().workers if w.peer_id == peer_id_of(kp)] in ([], ["quarantined"])
    assert link.reports_sent >= 1


async def _host(key_path: Path | None, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    async with open_libp2p_transport(key_path=key_path) as t:
        task_status.started(t)
        await trio.sleep_forever()


async def _coordinator_and_market(
    nursery: trio.Nursery, model: GGUFModel, tmp_path: Path, policy: MarketPolicy, *, prove_holdings: bool = True
) -> tuple[str, Dispatcher, MarketLink, Any]:
    """A real market and a coordinator's dispatcher (every range remote) with its MarketLink; the
    coordinator's HTTP side as far as the market needs it: /slots and the slice files it describes."""
    market_url = await nursery.start(serve_market, MarketConfig(db=str(tmp_path / "market.db"), port=0, token=TOKEN,
                                                                poll_interval_s=0.2, tick_s=0.05, policy=policy))
    coord_t = await nursery.start(_host, None)
    d = Dispatcher(model, coord_t, config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False),
                   prove_holdings=prove_holdings)
    await nursery.start(d.serve)
    app = Starlette(routes=[*slice_routes({model.model_id: model}, {model.model_id: SliceCache(model, tmp_path / "sl")}),
                            Route("/slots", lambda _: JSONResponse([]))])
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    coord_url = (await nursery.start(hypercorn_serve, app, hc))[0]
    link = MarketLink(market_url, d, build_manifest(model), advertise_url=coord_url, token=TOKEN, poll_s=0.1, report_s=0.2)
    await nursery.start(link.serve)

    async def registered() -> bool:
        return link.registered

    await eventually(registered)
    return market_url, d, link, coord_t


class _Stranger:
    """A volunteer identity speaking the market protocol correctly (signed polls and heartbeats)."""

    def __init__(self, market_url: str, key_path: Path, transport: Any, model_id: str) -> None:
        self.market_url, self.kp, self.t, self.model_id = market_url, load_or_create_identity(key_path), transport, model_id
        self.peer_id = peer_id_of(self.kp)
        self.seq = 0

    async def poll(self) -> dict[str, Any]:
        self.seq += 1
        raw = msgspec.json.encode({"peer_id": self.peer_id, "max_experts": 8, "epoch": 1, "sequence": self.seq,
                                   "sent_at_ms": int(time.time() * 1000)})
        async with httpx.AsyncClient(base_url=self.market_url) as h:
            r = await h.post("/api/expert-volunteer", content=raw, headers={
                "content-type": "application/json", SIGNATURE_HEADER: sign_request(self.kp, "POST", "/api/expert-volunteer", raw)})
        out: dict[str, Any] = r.json()
        return out

    async def beat(self, layer: int, lo: int, hi: int) -> httpx.Response:
        self.seq += 1
        body = CoverageHeartbeat(self.peer_id, 1, self.seq, list(self.t.listen_addrs),
                                 [HeldSlice(self.model_id, layer, lo, hi, HeldState.SERVING)], protocols=[2],
                                 sent_at_ms=int(time.time() * 1000))
        raw = msgspec.json.encode(body)
        async with httpx.AsyncClient(base_url=self.market_url) as h:
            return await h.post("/api/expert-coverage", content=raw, headers={
                "content-type": "application/json", SIGNATURE_HEADER: sign_request(self.kp, "POST", "/api/expert-coverage", raw)})


async def test_a_squatter_with_a_lease_but_no_file_never_gets_work_and_is_refused(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 11 attack 3 beyond signing: a stranger takes a lease with a signed poll and reports the
    slice serving without downloading it. Its answers to the hold challenge are made up: the coordinator
    refutes it before giving it any work, quarantines it and reports it; the market refuses it."""
    model = golden_model
    market_url, d, link, _ = await _coordinator_and_market(nursery, model, tmp_path, MarketPolicy(heartbeat_ttl_s=30.0))
    t = await nursery.start(_host, tmp_path / "squatter.key")
    calls = 0

    async def compute(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return torch.zeros(req.n_pairs, req.d_model)

    async def made_up(ch: Any) -> bytes:
        return bytes(32)

    set_expert_handlers(t, compute, hello=make_hello(kernel_id="any"), prove=made_up)
    s = _Stranger(market_url, tmp_path / "squatter.key", t, model.model_id)
    a = await s.poll()
    assert a["kind"] == "assignment", a
    assert (await s.beat(a["layer"], a["lo"], a["hi"])).status_code == 200

    async def refused() -> bool:
        return (await s.beat(a["layer"], a["lo"], a["hi"])).status_code == 403

    await eventually(refused)
    assert d.holdings is not None and d.holdings.refutations == 1 and d.holdings.passes == 0
    [w] = [w for w in d.report().workers if w.peer_id == s.peer_id] or [None]
    assert w is None or (w.state == "quarantined" and "hold digest" in w.quarantine)
    # the output is all-local and the squatter never computed anything
    g = golden["greedy"][1]
    toks, _ = await greedy(Transformer(model, d), g["prompt_ids"], 4)
    assert toks == g["greedy_ids"][:4] and calls == 0
    assert (await s.poll())["reason"] == "quarantined"


async def test_a_holding_nobody_proves_stops_counting_after_the_grace_and_an_honest_one_is_held(
    nursery: trio.Nursery, golden_model: GGUFModel, tmp_path: Path
) -> None:
    """A volunteer that cannot answer hold challenges (here: no ``prove``) keeps its lease's slice only for
    ``proof_grace_s`` of serving: then the market drops it (heartbeat: release, ``unproven``) and hands
    the experts out again. An honest volunteer's slice is marked held (the coordinator's report) and stays."""
    model = golden_model
    market_url, d, link, _ = await _coordinator_and_market(
        nursery, model, tmp_path, MarketPolicy(heartbeat_ttl_s=30.0, proof_grace_s=1.0, lease_s=60.0))
    mute_t = await nursery.start(_host, tmp_path / "mute.key")
    honest_t = await nursery.start(_host, tmp_path / "honest.key")

    async def never(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        raise AssertionError("an unproven holder got work")

    set_expert_handlers(mute_t, never, hello=make_hello(kernel_id="any"))  # offers no hold proofs: never challenged
    mute = _Stranger(market_url, tmp_path / "mute.key", mute_t, model.model_id)
    honest = _Stranger(market_url, tmp_path / "honest.key", honest_t, model.model_id)
    a = await mute.poll()
    b = await honest.poll()
    assert a["kind"] == b["kind"] == "assignment", (a, b)
    server = ExpertServer([load_slice(cut_slice(model, b["layer"], b["lo"], b["hi"]))], threads=1)
    await nursery.start(server.serve)
    set_expert_handlers(honest_t, server.handle, hello=make_hello(kernel_id=server.kernel_id), prove=server.prove)
    assert (await mute.beat(a["layer"], a["lo"], a["hi"])).status_code == 200
    assert (await honest.beat(b["layer"], b["lo"], b["hi"])).status_code == 200

    async def dropped() -> Any:
        r = await mute.beat(a["layer"], a["lo"], a["hi"])
        [sd] = r.json()["slices"]
        return sd if sd["action"] == "release" else None

    sd = await eventually(dropped)
    assert sd["reason"] == "unproven"
    async with httpx.AsyncClient(base_url=market_url) as h:
        view = (await h.get("/api/moe/recruitment")).json()
    [m] = view["models"]
    mine = {w["peer_id"]: w["slices"] for w in m["workers"]}
    assert s_of(mine[honest.peer_id]) == [(b["layer"], b["lo"], b["hi"], True)] and mute.peer_id not in mine
    assert (await honest.beat(b["layer"], b["lo"], b["hi"])).json()["slices"][0]["action"] == "keep"
    assert d.holdings is not None and d.holdings.held(honest.peer_id, b["layer"], b["lo"], b["hi"])
    assert not d.holdings.held(mute.peer_id, a["layer"], a["lo"], a["hi"]) and d.holdings.failures >= 1
    assert d.holdings.refutations == 0  # not answering is no proof of lying: no quarantine
    # the experts it held are needed again: the next volunteer is assigned them
    again = await _Stranger(market_url, tmp_path / "next.key", mute_t, model.model_id).poll()
    assert again["kind"] == "assignment" and (again["layer"], again["lo"]) == (a["layer"], a["lo"])
    # the honest volunteer serves (offload: its range goes remote) and the coordinator's reports credit it
    await greedy(Transformer(model, d), [1, 2, 3], 3)
    per_pair = 6 * model.config.d_model * model.config.d_expert
    async with httpx.AsyncClient(base_url=market_url) as h:
        async def credited() -> Any:
            r = (await h.get(f"/api/volunteers/{honest.peer_id}")).json()
            return r if r["total_flops"] > 0 else None

        c = await eventually(credited)
        board = (await h.get("/api/volunteers")).json()["volunteers"]
        unknown = await h.get("/api/volunteers/12D3KooWnobody")
    assert c["pairs"] > 0 and c["total_flops"] == c["pairs"] * per_pair and c["rac_flops_per_day"] > 0
    assert [v["peer_id"] for v in board] == [honest.peer_id]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_volunteer"


def s_of(slices: list[dict[str, Any]]) -> list[tuple[int, int, int, bool]]:
    return [(x["layer"], x["lo"], x["hi"], x["held"]) for x in slices]


async def test_a_backbone_coordinator_registers_its_holdings_and_the_market_wants_two_replicas(
    nursery: trio.Nursery, golden_model: GGUFModel, tmp_path: Path
) -> None:
    """``--local-experts none`` through a real MarketLink and market: the registration says the coordinator
    computes no expert, so every expert is wanted twice (``--remote-base-target``) and all are holes."""
    model = golden_model
    market_url = await nursery.start(serve_market, MarketConfig(db=str(tmp_path / "m.db"), port=0, token=TOKEN,
                                                                poll_interval_s=0.2, tick_s=0.05))
    d = Dispatcher(model, None)
    link = MarketLink(market_url, d, build_manifest(model), advertise_url="http://127.0.0.1:9/", token=TOKEN,
                      poll_s=0.1, local_experts=[])
    await nursery.start(link.serve)

    async def registered() -> bool:
        return link.registered

    await eventually(registered)
    async with httpx.AsyncClient(base_url=market_url) as h:
        [m] = (await h.get("/api/expert-demand")).json()["models"]
    cfg = model.config
    assert (m["effective_target"], m["remote_target"], m["holes"]) == (1, 2, cfg.n_layer * cfg.n_expert)
    assert {s["target"] for s in m["segments"]} == {2}
