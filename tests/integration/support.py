"""Helpers of the integration tests that drive a dispatcher against real volunteers on libp2p."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import trio

from coordinator.core.dispatch import DispatchConfig, DispatchMode
from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.dispatch_map import DispatchMap, LayerRanges, RangeReplicas, Replica
from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice, load_slice
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.p2p.transport import Transport
from swarm.protocol.expert import ExpertRequest, Pairs, make_hello
from swarm.rpc.server import set_expert_handlers
from volunteer.lanes import VolunteerLanes
from volunteer.server import ExpertServer

__all__ = ["HALVES", "OFFLOAD", "Handler", "Vol", "assert_greedy_as_all_local", "dmap", "greedy", "make_dispatcher",
           "report", "run_forward", "start_volunteer"]


def report(d: Dispatcher) -> dict[str, Any]:
    """``/dispatch`` as its JSON readers see it."""
    out: dict[str, Any] = msgspec.to_builtins(d.report())
    return out


Handler = Callable[[ExpertRequest, torch.Tensor, Pairs], Awaitable[torch.Tensor]]


@dataclass
class Vol:
    peer_id: str
    addrs: list[str]
    server: ExpertServer
    transport: Transport
    cancel: trio.CancelScope
    lanes: VolunteerLanes | None = None


async def start_volunteer(
    nursery: trio.Nursery, model: GGUFModel, slices: list[tuple[int, int, int]], *, wrap: Callable[[Handler], Handler] | None = None,
    server_factory: Callable[[list[Any]], ExpertServer] | None = None, today: bool = False,
    lanes: VolunteerLanes | Callable[[ExpertServer], VolunteerLanes] | None = None,
) -> Vol:
    """A volunteer serving ``slices`` on a libp2p host of its own; ``today``: as the daemons plug it in
    (its Hello's features, the answers' compute times), else as a plain older server; ``lanes``: it
    dials the data lanes coordinators offer (a factory of its ``VolunteerLanes`` from the server)."""
    loaded = [load_slice(cut_slice(model, L, lo, hi)) for L, lo, hi in slices]
    server = server_factory(loaded) if server_factory is not None else ExpertServer(loaded, threads=1)

    async def run(task_status: trio.TaskStatus[Vol]) -> None:
        with trio.CancelScope() as cs:
            async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
                await n.start(server.serve)
                lanes_ = lanes(server) if callable(lanes) else lanes
                if lanes_ is not None:
                    await n.start(lanes_.serve)
                base: Any = server.handle_timed if today else server.handle
                handler = wrap(base) if wrap is not None else base
                hello = server.hello() if today else make_hello(kernel_id=server.kernel_id)
                set_expert_handlers(t, handler, hello=hello, prove=server.prove,
                                    lanes=lanes_.offer if lanes_ is not None else None)
                task_status.started(Vol(t.peer_id, t.listen_addrs, server, t, cs, lanes_))
                await trio.sleep_forever()

    vol: Vol = await nursery.start(run)
    return vol


def dmap(model: GGUFModel, version: int, spec: dict[tuple[int, int, int], list[Vol]]) -> DispatchMap:
    layers: dict[int, list[RangeReplicas]] = {}
    for (L, lo, hi), vols in spec.items():
        layers.setdefault(L, []).append(RangeReplicas(lo, hi, [Replica(v.peer_id, v.addrs) for v in vols]))
    return DispatchMap(model.model_id, version, [LayerRanges(L, r) for L, r in sorted(layers.items())])


async def run_forward(tr: Transformer, chunks: list[SeqChunk]) -> list[torch.Tensor]:
    # the dispatcher blocks its caller until remote answers arrive: call it off the trio thread,
    # as the engine thread does
    return await trio.to_thread.run_sync(tr.forward, chunks)


async def greedy(tr: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = KVCache(tr.cfg, 256)
    lg = (await run_forward(tr, [SeqChunk(cache, list(prompt), 0, all_logits=True)]))[0]
    logits = [lg]
    out = []
    pos = len(prompt)
    for _ in range(n):
        t = int(lg[-1].argmax())
        out.append(t)
        lg = (await run_forward(tr, [SeqChunk(cache, [t], pos)]))[0]
        logits.append(lg)
        pos += 1
    return out, logits


HALVES = [(L, lo, hi) for L in (0, 1) for lo, hi in ((0, 4), (4, 8))]


async def assert_greedy_as_all_local(
    nursery: trio.Nursery, model: GGUFModel, golden: dict[str, Any], d: Dispatcher, m: DispatchMap, n: int = 6
) -> None:
    """``d`` follows ``m``; 6 greedy tokens through it are llama.cpp's and every logit has the bits of
    a dispatcher that computes the same partition here."""
    d.set_map(m)
    ref = await make_dispatcher(nursery, model, None)
    ref.set_map(m)
    g = golden["greedy"][2]
    toks, lgs = await greedy(Transformer(model, d), g["prompt_ids"], n)
    ref_toks, ref_lgs = await greedy(Transformer(model, ref), g["prompt_ids"], n)
    assert toks == ref_toks == g["greedy_ids"][:n]
    assert all(torch.equal(x, y) for x, y in zip(lgs, ref_lgs, strict=True))


# These tests exercise the remote path: every range with a live replica goes remote whatever the load,
# and a slow call waits for its deadline (the adaptive policy and hedging: tests/sim/test_dispatcher_scenarios.py)
# the remote path itself, every answer used (verification, which would compute every range here too, has its own tests)
OFFLOAD = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=0.0, verify_probation_calls=0)


async def make_dispatcher(nursery: trio.Nursery, model: GGUFModel, transport: Transport | None, **kw: Any) -> Dispatcher:
    kw.setdefault("config", OFFLOAD)
    d = Dispatcher(model, transport, **kw)
    await nursery.start(d.serve)
    return d
