"""Data lanes on real sockets (``swarm.rpc.lane``, ``coordinator.dispatch.lanes``, ``volunteer.lanes``):
a volunteer dials the lane its coordinator offers over the libp2p stream, the engine thread's calls
go on it with no trio hop, and the bits are those of the same layer computed here. A lane that
dies, a call it never answers, a budget it overruns: the layer falls back as for any failed call.
Strangers get nothing from the lane port; a volunteer dials only for the coordinators it serves,
only to their hosts."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import trio

from coordinator.core.dispatch import DispatchConfig, DispatchMode
from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.dispatch.lanes import LaneHub
from coordinator.engine.model import Transformer
from swarm.model.gguf import GGUFModel
from swarm.p2p.transport import Transport
from swarm.protocol.expert import ExpertRequest, Pairs
from swarm.rpc.lane import handshake
from swarm.rpc.server import ByteBudget, Computed
from tests.integration.support import Vol, dmap, greedy, make_dispatcher, start_volunteer
from volunteer.lanes import VolunteerLanes
from volunteer.server import ExpertServer

WHOLE = [(0, 0, 8), (1, 0, 8)]


def lanes_for(hosts: set[str] | None = None, **kw: Any) -> Any:
    return lambda server: VolunteerLanes(server, authorize=kw.pop("authorize", lambda p: True),
                                         known_hosts=lambda: hosts if hosts is not None else {"127.0.0.1"}, **kw)


async def lane_world(nursery: trio.Nursery, model: GGUFModel, transport: Transport, *, hosts: set[str] | None = None,
                     config: DispatchConfig | None = None, server_factory: Any = None, retry_s: float = 10.0,
                     **lane_kw: Any) -> tuple[Dispatcher, LaneHub, Vol]:
    vol = await start_volunteer(nursery, model, WHOLE, today=True, lanes=lanes_for(hosts, **lane_kw),
                                server_factory=server_factory)
    hub = LaneHub(host="127.0.0.1", retry_s=retry_s)
    kw: dict[str, Any] = {"lanes": hub}
    if config is not None:
        kw["config"] = config
    d = await make_dispatcher(nursery, model, transport, **kw)
    d.set_map(dmap(model, 1, {k: [vol] for k in WHOLE}))
    return d, hub, vol


async def reference(nursery: trio.Nursery, model: GGUFModel, d: Dispatcher, prompt: list[int], n: int
                    ) -> tuple[list[int], list[torch.Tensor]]:
    ref = await make_dispatcher(nursery, model, None)
    assert d.map is not None
    ref.set_map(d.map)
    return await greedy(Transformer(model, ref), prompt, n)


async def open_lane(d: Dispatcher, hub: LaneHub, vol: Vol, model: GGUFModel, prompt: list[int]) -> None:
    """A first completion opens the volunteer's stream (its Hello offers lanes); the lane follows."""
    await greedy(Transformer(model, d), prompt, 1)
    with trio.fail_after(10):
        while hub.live(vol.peer_id) is None:
            await hub.lane_opened.wait()


async def test_the_engines_calls_go_on_the_lane_with_the_bits_of_here(
        nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    d, hub, vol = await lane_world(nursery, golden_model, coord_transport)
    g = golden["greedy"][1]
    await open_lane(d, hub, vol, golden_model, g["prompt_ids"])
    lane = hub.live(vol.peer_id)
    assert lane is not None and vol.lanes is not None
    d.timings.clear()
    toks, lgs = await greedy(Transformer(golden_model, d), g["prompt_ids"], 5)
    ref_toks, ref_lgs = await reference(nursery, golden_model, d, g["prompt_ids"], 5)
    assert toks == ref_toks == g["greedy_ids"][:5]
    assert all(torch.equal(x, y) for x, y in zip(lgs, ref_lgs, strict=True))
    n_layers = 6 * golden_model.config.n_moe_layer
    assert lane.answered >= n_layers and vol.lanes.lanes[next(iter(vol.lanes.lanes))].requests >= n_layers
    # the whole layer on the engine thread: no hand-off to the trio thread, no wake from it
    assert len(d.timings) >= n_layers and all(t.crossings == 0 and t.calls == 1 for t in d.timings)
    assert d.report().layers[0].remote_rows > 0


async def test_a_lane_that_dies_falls_back_and_a_new_one_follows(
        nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    d, hub, vol = await lane_world(nursery, golden_model, coord_transport, retry_s=0.2)
    g = golden["greedy"][2]
    await open_lane(d, hub, vol, golden_model, g["prompt_ids"])
    assert vol.lanes is not None
    for lane in list(vol.lanes.lanes.values()):
        lane.shutdown()  # the volunteer's side goes away: the driver reads its end
    toks, lgs = await greedy(Transformer(golden_model, d), g["prompt_ids"], 6)
    ref_toks, ref_lgs = await reference(nursery, golden_model, d, g["prompt_ids"], 6)
    assert toks == ref_toks == g["greedy_ids"][:6]
    assert all(torch.equal(x, y) for x, y in zip(lgs, ref_lgs, strict=True))
    assert d.lane_driver is not None and d.lane_driver.failures >= 1
    with trio.fail_after(10):  # offered again after retry_s, dialled again
        while hub.opened < 2 or hub.live(vol.peer_id) is None:
            await hub.lane_opened.wait()


async def test_a_call_the_lane_never_answers_times_out_on_the_engine_thread(
        nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    """The deadline timer of a lane call fires on the driver (no trio thread needed); the layer falls
    back to the experts held here, with the same bits."""
    stuck = [False]

    class Stuck(ExpertServer):
        def compute_sync(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> Computed:
            if stuck[0]:
                time.sleep(1.5)  # the lane thread is busy far past the coordinator's deadline
            return super().compute_sync(req, rows, pairs)

    cfg = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=0.0, verify_probation_calls=0,
                         timeout_s=0.3)
    d, hub, vol = await lane_world(nursery, golden_model, coord_transport, config=cfg,
                                   server_factory=lambda sl: Stuck(sl, threads=1))
    g = golden["greedy"][1]
    await open_lane(d, hub, vol, golden_model, g["prompt_ids"])
    stuck[0] = True
    toks, lgs = await greedy(Transformer(golden_model, d), g["prompt_ids"], 1)
    stuck[0] = False
    ref_toks, ref_lgs = await reference(nursery, golden_model, d, g["prompt_ids"], 1)
    assert toks == ref_toks
    assert all(torch.equal(x, y) for x, y in zip(lgs, ref_lgs, strict=True))
    rep = d.report()
    assert rep.errors_total >= 1 and any(e.reason == "timeout" for e in rep.errors)


async def test_a_record_past_the_volunteers_byte_budget_closes_the_lane_and_the_layer_falls_back(
        nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    d, hub, vol = await lane_world(nursery, golden_model, coord_transport, budget=ByteBudget(per_peer=1500, total=1500))
    g = golden["greedy"][1]
    await open_lane(d, hub, vol, golden_model, g["prompt_ids"][:1])  # a one-token prompt: its calls fit
    assert vol.lanes is not None and vol.lanes.lanes
    toks, lgs = await greedy(Transformer(golden_model, d), g["prompt_ids"], 2)  # the prefill's rows do not
    ref_toks, ref_lgs = await reference(nursery, golden_model, d, g["prompt_ids"], 2)
    assert toks == ref_toks and all(torch.equal(x, y) for x, y in zip(lgs, ref_lgs, strict=True))
    assert d.lane_driver is not None and d.lane_driver.failures >= 1
    assert vol.lanes.budget.held == 0  # given back however the lane ended


@pytest.mark.parametrize("why", ["unknown_host", "not_authorized"])
async def test_a_volunteer_dials_only_its_coordinators_hosts(
        nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport,
        why: str) -> None:
    kw: dict[str, Any] = {"hosts": {"203.0.113.9"}} if why == "unknown_host" else {"authorize": lambda p: False}
    d, hub, vol = await lane_world(nursery, golden_model, coord_transport, **kw)
    assert vol.lanes is not None
    if why == "not_authorized":  # the stream's screen refuses the calls too: answered here then
        d.set_map(dmap(golden_model, 2, {k: [vol] for k in WHOLE}))
    g = golden["greedy"][1]
    toks, _ = await greedy(Transformer(golden_model, d), g["prompt_ids"], 2)
    assert toks == g["greedy_ids"][:2]
    with trio.move_on_after(1.5):  # three offer rounds: none dialled
        await hub.lane_opened.wait()
    assert hub.opened == 0 and vol.lanes.opened == 0 and hub.live(vol.peer_id) is None


async def test_strangers_get_nothing_from_the_lane_port(nursery: trio.Nursery, golden_model: GGUFModel,
                                                       coord_transport: Transport) -> None:
    """Junk, a made-up lane id, a reused one, silence: each connection is closed without a byte,
    and no lane exists for anyone."""
    hub = LaneHub(host="127.0.0.1", handshake_timeout_s=0.5)
    host, port = await nursery.start(hub.serve)
    from swarm.protocol.expert import make_hello

    hello = make_hello(kernel_id="k")
    got = hub.offer("peer-a", hello, trio.current_time())
    assert got is not None
    lane_id = got[0]

    async def attempt(data: bytes) -> bytes:
        s = await trio.open_tcp_stream(host, port)
        async with s:
            if data:
                await s.send_all(data)
            with trio.fail_after(5):
                try:
                    return await s.receive_some(100)
                except trio.BrokenResourceError:  # closed with our bytes unread: a reset, still nothing
                    return b""

    refused = hub.refused
    assert await attempt(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
    assert await attempt(handshake(b"\0" * 16)) == b""
    assert await attempt(b"") == b""  # silence past the handshake timeout
    assert hub.refused == refused + 3 and not hub.lanes
    # the real id opens the lane once; the same id again is a stranger's
    s = await trio.open_tcp_stream(host, port)
    await s.send_all(handshake(lane_id))
    with trio.fail_after(5):
        while hub.live("peer-a") is None:
            await hub.lane_opened.wait()
    assert await attempt(handshake(lane_id)) == b""
    assert hub.refused == refused + 4 and list(hub.lanes) == ["peer-a"]
    await s.aclose()

