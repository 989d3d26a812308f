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

from coordinator.core.dispatch import DispatchConfig, DispatchMode
from coordinator.dispatcher import Dispatcher
from coordinator.market_link import MarketLink
from coordinator.model import Transformer
from coordinator.slices_http import slice_routes
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
from tests.integration.test_remote_experts import greedy
from volunteer.server import ExpertServer

TOKEN = "t0k"


async def test_a_liar_is_quarantined_reported_and_refused_by_the_market(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], tmp_path: Path
) -> None:
    model = golden_model
    policy = MarketPolicy(heartbeat_ttl_s=30.0, flush_s=0.2)
    market_url = await nursery.start(serve_market, MarketConfig(db=str(tmp_path / "market.db"), port=0, token=TOKEN,
                                                                poll_interval_s=0.2, tick_s=0.05, policy=policy))
    # the liar: a volunteer host answering x1.5, with the key its heartbeats are signed with
    key_path = tmp_path / "liar.key"
    kp = load_or_create_identity(key_path)
    server = ExpertServer([load_slice(cut_slice(model, L, 0, 8)) for L in (0, 1)], threads=1)

    async def lie(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        return (await server.handle(req, rows, pairs)) * 1.5

    liar_t = await nursery.start(_host, key_path)
    await nursery.start(server.serve)
    set_expert_handlers(liar_t, lie, hello=make_hello(kernel_id=server.kernel_id))

    coord_t = await nursery.start(_host, None)
    d = Dispatcher(model, coord_t, config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False))
    await nursery.start(d.serve)
    # the coordinator's HTTP side as far as the market needs it: /slots and the slice files it describes
    app = Starlette(routes=[*slice_routes({model.model_id: model}, {model.model_id: SliceCache(model, tmp_path / "sl")}),
                            Route("/slots", lambda _: JSONResponse([]))])
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    coord_url = (await nursery.start(hypercorn_serve, app, hc))[0]
    link = MarketLink(market_url, d, build_manifest(model), advertise_url=coord_url, token=TOKEN,
                      poll_s=0.1, report_s=0.2)
    await nursery.start(link.serve)

    async def registered() -> bool:
        return link.registered

    await eventually(registered)
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
