"""The per-call cost of a remote layer, on real libp2p hosts: one call per peer per layer for adjacent
ranges, per-row sums for a layer's only range, requests spanning several slices of a volunteer,
small calls computed on the volunteer's event loop, and the breakdown of a remote layer -- every
output with the bits of the same layer computed here."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import trio

from coordinator.engine.model import Transformer
from swarm.errors import SliceNotHeld
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import add_in_expert_order
from swarm.model.slices import cut_slice, load_slice
from swarm.p2p.transport import Transport
from swarm.protocol.expert import ExpertRequest, RequestId, make_pairs
from tests.integration.support import dmap, greedy, make_dispatcher, report, start_volunteer
from volunteer import server as server_mod
from volunteer.server import ExpertServer


def recording(seen: list[ExpertRequest]) -> Any:
    """A handler wrapper that records each request."""

    def wrap(handle: Any) -> Any:
        async def spy(req: ExpertRequest, rows: torch.Tensor, pairs: Any) -> Any:
            seen.append(req)
            return await handle(req, rows, pairs)

        return spy

    return wrap


async def same_as_here(nursery: trio.Nursery, model: GGUFModel, golden: dict[str, Any], d: Any, m: Any) -> None:
    d.set_map(m)
    ref = await make_dispatcher(nursery, model, None)
    ref.set_map(m)
    g = golden["greedy"][1]
    toks, lgs = await greedy(Transformer(model, d), g["prompt_ids"], 5)
    ref_toks, ref_lgs = await greedy(Transformer(model, ref), g["prompt_ids"], 5)
    assert toks == ref_toks == g["greedy_ids"][:5]
    assert all(torch.equal(x, y) for x, y in zip(lgs, ref_lgs, strict=True))


@pytest.mark.parametrize("today", [True, False])
async def test_adjacent_ranges_of_one_peer_are_one_call(nursery: trio.Nursery, golden_model: GGUFModel,
                                                         golden: dict[str, Any], coord_transport: Transport,
                                                         today: bool) -> None:
    """A volunteer holding both halves of every layer as two slices gets one call per layer (its Hello
    offers ``multi_range``), an older one two; the bits are those of the same partition computed here."""
    halves = [(L, lo, hi) for L in (0, 1) for lo, hi in ((0, 4), (4, 8))]
    seen: list[ExpertRequest] = []
    a = await start_volunteer(nursery, golden_model, halves, today=today, wrap=recording(seen))
    d = await make_dispatcher(nursery, golden_model, coord_transport)
    m = dmap(golden_model, 1, {k: [a] for k in halves})
    await same_as_here(nursery, golden_model, golden, d, m)  # the first layer opens the stream: then it knows
    rep = report(d)
    calls = a.server.stats.calls
    layers = sum(1 for t in d.timings)
    per_layer = [t.calls for t in d.timings]
    if today:  # one request per layer (over both slices when both have pairs), but the first's two
        assert sum(1 for n in per_layer if n > 1) <= 1 and (0, 8) in {(r.lo, r.hi) for r in seen}
        # two ranges with pairs: per-pair outputs (the combine sums them here); one: its rows' sums
        assert all(r.sum_rows == (r.hi - r.lo == 4) for r in seen[2:])
        assert calls < 1.2 * layers
    else:
        assert sum(1 for n in per_layer if n > 1) > len(per_layer) / 2
        assert {(r.lo, r.hi) for r in seen} == {(0, 4), (4, 8)}
    assert all(L["remote_rows"] > 0 for L in rep["layers"])


async def test_a_layers_only_range_is_summed_by_the_volunteer(nursery: trio.Nursery, golden_model: GGUFModel,
                                                              golden: dict[str, Any], coord_transport: Transport) -> None:
    """A volunteer holding whole layers answers its rows' sums (``sum_rows``: an eighth of the bytes at
    top-8): the layer's output has the bits of the combine here."""
    whole = [(0, 0, 8), (1, 0, 8)]
    seen: list[ExpertRequest] = []
    a = await start_volunteer(nursery, golden_model, whole, today=True, wrap=recording(seen))
    d = await make_dispatcher(nursery, golden_model, coord_transport)
    await same_as_here(nursery, golden_model, golden, d, dmap(golden_model, 1, {k: [a] for k in whole}))
    assert seen and all(r.sum_rows for r in seen[2:])  # once the stream's Hello is known
    path = msgspec.to_builtins(d.report().layer_path)
    assert path["layers"] > 0 and path["crossings"] <= 2.0
    assert path["compute"] > 0 and path["total"] >= path["compute"]


async def test_verified_calls_keep_their_per_pair_outputs(nursery: trio.Nursery, golden_model: GGUFModel,
                                                          golden: dict[str, Any], coord_transport: Transport) -> None:
    """A call kept for a comparison is never summed: its per-pair outputs are compared with ours."""
    from coordinator.core.dispatch import DispatchConfig, DispatchMode

    whole = [(0, 0, 8), (1, 0, 8)]
    seen: list[ExpertRequest] = []
    a = await start_volunteer(nursery, golden_model, whole, today=True, wrap=recording(seen))
    d = await make_dispatcher(nursery, golden_model, coord_transport,
                              config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=1.0,
                                                    verify_probation_calls=0))
    await same_as_here(nursery, golden_model, golden, d, dmap(golden_model, 1, {k: [a] for k in whole}))
    assert seen and not any(r.sum_rows for r in seen)
    assert d.core.verified_equal > 0 and d.core.quarantines == 0


def request(model: GGUFModel, lo: int, hi: int, pairs: Any, n_rows: int, *, sum_rows: bool = False) -> ExpertRequest:
    return ExpertRequest(request_id=RequestId(1), attempt=0, model_id=model.model_id, layer=0, lo=lo, hi=hi,
                         n_rows=n_rows, d_model=model.config.d_model, n_pairs=len(pairs), dtype="float32",
                         sum_rows=sum_rows)


async def test_the_volunteer_serves_a_span_of_its_slices_and_row_sums(nursery: trio.Nursery, golden_model: GGUFModel) -> None:
    server = ExpertServer([load_slice(cut_slice(golden_model, 0, lo, hi)) for lo, hi in ((0, 3), (3, 8))], threads=1)
    await nursery.start(server.serve)
    whole = ExpertServer([load_slice(cut_slice(golden_model, 0, 0, 8))], threads=1)
    await nursery.start(whole.serve)
    x = torch.randn(3, golden_model.config.d_model, generator=torch.Generator().manual_seed(2))
    pairs = make_pairs(np.array([0, 0, 1, 1, 2, 2]), np.array([1, 5, 2, 3, 0, 7]), np.linspace(0.1, 0.6, 6))
    span = await server.handle_timed(request(golden_model, 0, 8, pairs, 3), x, pairs)
    one = await whole.handle_timed(request(golden_model, 0, 8, pairs, 3), x, pairs)
    assert torch.equal(span.out, one.out)  # per pair: wherever computed, the same bits
    assert span.compute_s > 0
    summed = await server.handle_timed(request(golden_model, 0, 8, pairs, 3, sum_rows=True), x, pairs)
    want = add_in_expert_order(np.zeros((3, golden_model.config.d_model), np.float32), pairs.rows, pairs.experts,
                               one.out.numpy())
    assert np.array_equal(summed.out.numpy(), want)
    gap = ExpertServer([load_slice(cut_slice(golden_model, 0, lo, hi)) for lo, hi in ((0, 3), (4, 8))], threads=1)
    await nursery.start(gap.serve)
    with pytest.raises(SliceNotHeld):
        await gap.handle_timed(request(golden_model, 0, 8, pairs, 3), x, pairs)


async def test_a_small_call_on_an_idle_slice_is_computed_on_the_event_loop(
    nursery: trio.Nursery, golden_model: GGUFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[bool] = []
    real = server_mod._SliceWorker._compute
    loop_thread = threading.get_ident()

    def spy(self: Any, batch: Any) -> Any:
        where.append(threading.get_ident() == loop_thread)
        return real(self, batch)

    monkeypatch.setattr(server_mod._SliceWorker, "_compute", spy)
    x = torch.randn(1, golden_model.config.d_model)
    pairs = make_pairs(np.array([0, 0]), np.array([1, 5]), np.array([0.5, 0.5]))
    for inline, want in ((8_000_000, True), (0, False)):
        server = ExpertServer([load_slice(cut_slice(golden_model, 0, 0, 8))], threads=1, inline_macs=inline)
        await nursery.start(server.serve)
        await server.workers[0].warmed.wait()  # the warm-up runs in a thread first
        where.clear()
        await server.handle_timed(request(golden_model, 0, 8, pairs, 1), x, pairs)
        assert where == [want]
