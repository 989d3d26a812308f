"""Remote experts end to end on real libp2p hosts: exactness, fallback on crashing, hanging and
lying workers, dispatch-map changes, and the ``/dispatch`` report."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import torch
import trio

from coordinator.core.dispatch import DispatchConfig
from coordinator.dispatch.mapfile import watch_dispatch_map_file
from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.dispatch_map import DispatchMap, LayerRanges, RangeReplicas
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import kernel_id
from swarm.p2p.transport import Transport
from swarm.protocol.coordinator import dispatch_decoder, health_decoder
from swarm.protocol.expert import ExpertRequest, Pairs
from tests.conftest import eventually
from tests.integration.support import (
    HALVES,
    OFFLOAD,
    Handler,
    assert_greedy_as_all_local,
    dmap,
    greedy,
    make_dispatcher,
    report,
    run_forward,
    start_volunteer,
)


async def test_remote_equals_local(nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    a = await start_volunteer(nursery, golden_model, [(0, 0, 4), (1, 0, 4)])
    b = await start_volunteer(nursery, golden_model, [(0, 4, 8), (1, 4, 8)])
    m = dmap(golden_model, 1, {(0, 0, 4): [a], (0, 4, 8): [b], (1, 0, 4): [a], (1, 4, 8): [b]})
    remote = await make_dispatcher(nursery, golden_model, coord_transport)
    remote.set_map(m)
    same_partition_local = await make_dispatcher(nursery, golden_model, None)
    same_partition_local.set_map(m)
    prompt = golden["greedy"][0]["prompt_ids"]
    n = len(golden["greedy"][0]["greedy_ids"])
    toks_r, lg_r = await greedy(Transformer(golden_model, remote), prompt, n)
    toks_p, lg_p = await greedy(Transformer(golden_model, same_partition_local), prompt, n)
    toks_l, lg_l = await greedy(Transformer(golden_model), prompt, n)
    assert toks_r == toks_l == golden["greedy"][0]["greedy_ids"]
    # the same partition computed here or on volunteers: bit-identical
    assert all(torch.equal(x, y) for x, y in zip(lg_r, lg_p, strict=True))
    # against the one-range all-local forward: only the summation grouping differs
    assert max((x - y).abs().max().item() for x, y in zip(lg_r, lg_l, strict=True)) <= 1e-5
    rep = report(remote)
    assert {w["peer_id"] for w in rep["workers"]} == {a.peer_id, b.peer_id}
    assert all(w["calls"] > 0 and w["last_serve_ms"] > 0 and w["state"] == "up" for w in rep["workers"])
    assert all(L["local_rows"] == 0 and L["remote_rows"] > 0 for L in rep["layers"])
    assert a.server.stats.calls > 0 and b.server.stats.calls > 0


async def test_local_remote_mix(nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    a = await start_volunteer(nursery, golden_model, [(0, 2, 6)])
    m = dmap(golden_model, 1, {(0, 2, 6): [a]})
    d = await make_dispatcher(nursery, golden_model, coord_transport)
    d.set_map(m)
    g = golden["greedy"][1]
    toks, lgs = await greedy(Transformer(golden_model, d), g["prompt_ids"], 12)
    ref_toks, ref = await greedy(Transformer(golden_model), g["prompt_ids"], 12)
    assert toks == ref_toks == g["greedy_ids"][:12]
    assert max((x - y).abs().max().item() for x, y in zip(lgs, ref, strict=True)) <= 1e-5
    rep = report(d)
    assert rep["layers"][0]["remote_rows"] > 0 and rep["layers"][0]["local_rows"] > 0
    assert rep["layers"][1]["remote_rows"] == 0


def nan_wrap(h: Handler) -> Handler:
    async def bad(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        out = await h(req, rows, pairs)
        return torch.full_like(out, float("nan"))
    return bad


def raise_wrap(h: Handler) -> Handler:
    async def bad(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        raise RuntimeError("disk on fire")
    return bad


def hang_wrap(h: Handler) -> Handler:
    async def bad(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        await trio.sleep_forever()
        raise AssertionError
    return bad


@pytest.mark.parametrize("wrap", [nan_wrap, raise_wrap, hang_wrap], ids=["nan", "error", "hang"])
async def test_misbehaving_worker_falls_back(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport,
    wrap: Callable[[Handler], Handler],
) -> None:
    bad = await start_volunteer(nursery, golden_model, HALVES, wrap=wrap)
    m = dmap(golden_model, 1, {k: [bad] for k in HALVES})
    d = await make_dispatcher(nursery, golden_model, coord_transport, timeout_s=0.3)
    await assert_greedy_as_all_local(nursery, golden_model, golden, d, m)
    [w] = report(d)["workers"]
    assert w["state"] == "down" and w["failures"] >= 1 and w["last_error"]
    assert w["last_serve_ms"] == 0
    assert sum(L["fallback_rows"] for L in report(d)["layers"]) > 0


async def test_next_replica_then_recovery(nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport) -> None:
    """A failing first replica hands its range to the second; after its backoff it is tried again."""
    bad = await start_volunteer(nursery, golden_model, HALVES, wrap=raise_wrap)
    good = await start_volunteer(nursery, golden_model, HALVES)
    m = dmap(golden_model, 1, {k: [bad, good] for k in HALVES})
    d = await make_dispatcher(nursery, golden_model, coord_transport)
    d.table.backoff_base_s = 0.2
    d.set_map(m)
    g = golden["greedy"][0]
    toks, _ = await greedy(Transformer(golden_model, d), g["prompt_ids"], 8)
    assert toks == g["greedy_ids"][:8]
    rep = {w["peer_id"]: w for w in report(d)["workers"]}
    assert rep[good.peer_id]["calls"] > 0 and rep[good.peer_id]["state"] == "up"
    assert rep[bad.peer_id]["failures"] >= 1
    assert sum(L["fallback_rows"] for L in report(d)["layers"]) == 0  # the good replica took everything


async def test_dead_worker_then_map_change(nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport, tmp_path: Path) -> None:
    a = await start_volunteer(nursery, golden_model, HALVES)
    path = tmp_path / "map.json"

    path.write_bytes(msgspec.json.encode(dmap(golden_model, 1, {k: [a] for k in HALVES})))
    d = await make_dispatcher(nursery, golden_model, coord_transport, timeout_s=1.0)
    await nursery.start(functools.partial(watch_dispatch_map_file, interval_s=0.05), path, d)
    assert d.map is not None and d.map.version == 1
    g = golden["greedy"][0]
    tr = Transformer(golden_model, d)
    toks, _ = await greedy(tr, g["prompt_ids"], 4)
    assert a.server.stats.calls > 0
    a.cancel.cancel()  # the volunteer dies (its host closes every connection)
    await trio.sleep(0.2)
    toks2, _ = await greedy(tr, g["prompt_ids"], 8)
    assert toks2 == g["greedy_ids"][:8] and toks == toks2[:4]
    assert report(d)["workers"][0]["state"] == "down"
    # the operator removes it from the map: the dispatcher detaches it
    path.write_bytes(msgspec.json.encode(DispatchMap(golden_model.model_id, 2, [])))
    for _ in range(100):
        if d.map.version == 2:
            break
        await trio.sleep(0.02)
    assert d.map.version == 2 and report(d)["workers"] == []
    # a broken file is read, rejected and ignored: the last good map stays
    assert report(d)["maps_rejected"] == 0
    path.write_text("{broken")
    async def rejected() -> bool:
        return bool(report(d)["maps_rejected"])

    await eventually(rejected)
    assert d.map.version == 2 and report(d)["workers"] == []
    assert report(d)["maps_rejected"] == 1 and str(path) in report(d)["map_error"]


async def test_map_for_other_model_rejected(nursery: trio.Nursery, golden_model: GGUFModel) -> None:
    from swarm.errors import ConfigError

    d = await make_dispatcher(nursery, golden_model, None)
    with pytest.raises(ConfigError, match="this coordinator hosts"):
        d.set_map(DispatchMap("other-model", 1, []))
    with pytest.raises(ConfigError, match="beyond 8 experts"):
        d.set_map(DispatchMap(golden_model.model_id, 1, [LayerRanges(0, [RangeReplicas(4, 9, [])])]))
    assert d.set_map(DispatchMap(golden_model.model_id, 5, []))
    assert not d.set_map(DispatchMap(golden_model.model_id, 4, []))  # older: ignored


async def test_coordinator_serves_dispatch_report_and_uses_map(nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], tmp_path: Path) -> None:
    """Through the real coordinator service: --dispatch-map file, /dispatch, tokens unchanged."""
    from coordinator.server import CoordinatorConfig, serve_coordinator

    a = await start_volunteer(nursery, golden_model, HALVES)
    path = tmp_path / "map.json"

    path.write_bytes(msgspec.json.encode(dmap(golden_model, 3, {k: [a] for k in HALVES})))
    url = await nursery.start(serve_coordinator, CoordinatorConfig(model=str(golden_model.path), port=0,
                                                                  data_dir=str(tmp_path / "c"), dispatch_map=str(path),
                                                                  dispatch="offload", token="op-secret"))
    g = golden["greedy"][0]
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        async def proved() -> bool:  # the volunteer answers the hold challenge of each of its slices first
            return bool((await h.get("/dispatch")).json()["hold_passes"] == len(HALVES))

        await eventually(proved)
        r = await h.post("/v1/completions", json={"model": golden_model.model_id, "prompt": g["prompt_ids"],
                                                  "max_tokens": 24, "temperature": 0, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == g["greedy_ids"]
        # volunteers' addresses only to the operator (DESIGN §12): not to a stranger, nor to a wrong token
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "op-secret"}):
            assert [w["addrs"] for w in (await h.get("/dispatch", headers=headers)).json()["workers"]] == [[]]
        authed = (await h.get("/dispatch", headers={"Authorization": "Bearer op-secret"})).json()
        assert [w["addrs"] for w in authed["workers"]] == [a.addrs]
        body = (await h.get("/dispatch")).content
        health = health_decoder.decode((await h.get("/health")).content)
    typed = dispatch_decoder.decode(body)  # the one definition of /dispatch decodes what is served
    assert msgspec.json.encode(typed) == body
    rep = json.loads(body)
    assert rep["map_version"] == typed.map_version == 3
    [w] = rep["workers"]
    assert w["peer_id"] == a.peer_id and w["calls"] > 0 and w["last_serve_ms"] > 0 and w["latency_ewma_ms"] > 0
    assert set(w) >= {"state", "calls", "rows", "last_serve_ms", "latency_ewma_ms", "failures", "path"}
    assert typed.workers[0].path == "direct" and health.peer_id and health.market is None
    # the volunteer's Hello announced its kernel: the same as the coordinator's, so results are bit-identical
    assert typed.kernel_id == kernel_id() and typed.workers[0].kernel_id == typed.kernel_id
    assert typed.mode == "offload" and typed.decisions.get("offload_remote", 0) > 0 and typed.errors == []


async def test_coordinator_adaptive_by_default_stays_local_when_idle(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], tmp_path: Path
) -> None:
    """Through the real coordinator service with its default dispatch: one session is below the
    saturation threshold (its load probe samples the runtime's busy slots), so the experts run here;
    /dispatch and /metrics say why."""
    from coordinator.server import CoordinatorConfig, serve_coordinator

    a = await start_volunteer(nursery, golden_model, HALVES)
    path = tmp_path / "map.json"
    path.write_bytes(msgspec.json.encode(dmap(golden_model, 1, {k: [a] for k in HALVES})))
    url = await nursery.start(serve_coordinator, CoordinatorConfig(model=str(golden_model.path), port=0,
                                                                  data_dir=str(tmp_path / "c"), dispatch_map=str(path)))
    g = golden["greedy"][0]
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        r = await h.post("/v1/completions", json={"model": golden_model.model_id, "prompt": g["prompt_ids"],
                                                  "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == g["greedy_ids"][:8]
        rep = dispatch_decoder.decode((await h.get("/dispatch")).content)
        metrics = (await h.get("/metrics")).text
    assert rep.mode == "adaptive" and rep.load_state == "idle" and rep.n_slots == 4 and rep.busy is not None
    assert rep.saturation_threshold == 2 and rep.serve_ttl_s == 20.0 and rep.hedge_floor_ms == 50.0
    assert set(rep.decisions) == {"idle_local"} and rep.decisions["idle_local"] > 0
    # every row of every step is counted, the decode steps' too (their layers run in the engine's
    # own graph, ExpertBackend.ran_here): each row lands in at least one range
    rows = len(g["prompt_ids"]) + 7
    assert all(L.remote_rows == 0 and L.local_rows >= rows for L in rep.layers)
    [w] = rep.workers
    assert w.calls == 0 and not w.proven and a.server.stats.calls == 0
    line = f'moe_swarm_dispatch_decisions_total{{model="{golden_model.model_id}",reason="idle_local"}}'
    assert line in metrics
    assert f'moe_swarm_dispatch_loaded{{model="{golden_model.model_id}",state="idle"}} 1.0' in metrics


@pytest.mark.parametrize("case", ["offload", "not-held"])
async def test_session_groups_overlap_remote_calls_with_the_same_bits(
    nursery: trio.Nursery, golden_model: GGUFModel, coord_transport: Transport, case: str
) -> None:
    """Three sequences per step with half of every layer on a volunteer -- sent there by ``offload``
    mode, or in adaptive mode because this coordinator does not hold it: the engine runs two session
    groups (one's dense half while the other's remote share is in flight; the engine thread computes
    the local share itself), and every logit has the bits of the whole step computed here in the
    same partition."""
    a = await start_volunteer(nursery, golden_model, [(0, 0, 4), (1, 4, 8)])
    m = dmap(golden_model, 1, {(0, 0, 4): [a], (1, 4, 8): [a]})
    if case == "offload":
        d = await make_dispatcher(nursery, golden_model, coord_transport, config=OFFLOAD)
    else:
        d = await make_dispatcher(nursery, golden_model, coord_transport, held=lambda L, lo, hi: (L, lo) not in {(0, 0), (1, 4)},
                                  config=DispatchConfig(verify_rate=0.0, verify_probation_calls=0))
    d.set_map(m)
    ref = await make_dispatcher(nursery, golden_model, None)  # the same partition, every range here
    ref.set_map(m)
    # the model's choice depends on this machine's timings (its rule has table tests): the steps after
    # the prefill run as three groups, one a sequence, whatever it would say
    asked: list[int] = []
    choose = d.pipeline.groups

    def forced(n_seqs: int, n_rows: int) -> int:
        asked.append(choose(n_seqs, n_rows))
        return 3 if d.pipeline.latency_s is not None else 1

    d.pipeline.groups = forced  # type: ignore[method-assign]
    prompts = [[(5 * i + 3 * j + 1) % 200 for j in range(3 + i)] for i in range(3)]

    async def run(tr: Transformer) -> list[list[torch.Tensor]]:
        caches = [KVCache(tr.cfg, 64) for _ in prompts]
        out = [await run_forward(tr, [SeqChunk(c, p, 0, all_logits=True) for c, p in zip(caches, prompts, strict=True)])]
        pos = [len(p) for p in prompts]
        for _ in range(4):
            toks = [int(lg[-1].argmax()) for lg in out[-1]]
            out.append(await run_forward(tr, [SeqChunk(c, [t], q) for c, t, q in zip(caches, toks, pos, strict=True)]))
            pos = [q + 1 for q in pos]
        return out

    got = await run(Transformer(golden_model, d))
    want = await run(Transformer(golden_model, ref))
    # the model was asked at every step (the prefill's before any remote layer was measured: one group)
    assert len(asked) == 5 and asked[0] == 1 and d.pipeline.latency_s is not None
    for x, y in zip(got, want, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
    rep = report(d)
    assert all(L["remote_rows"] > 0 and L["local_rows"] > 0 for L in rep["layers"])
    # more calls than steps x layers: the micro-batches called apart (one may route nothing to a range)
    assert a.server.stats.calls > 5 * 2


async def test_a_bug_in_an_engine_steps_dispatch_fails_the_layer_not_the_loop(
    nursery: trio.Nursery, golden_model: GGUFModel, coord_transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread's layer reaches the core under the dispatcher's lock: an exception there
    fails that layer (``DispatchFailed``) and the dispatcher goes on serving the next one."""
    from coordinator.core.dispatch import LayerReady
    from swarm.errors import DispatchFailed

    a = await start_volunteer(nursery, golden_model, [(0, 0, 4)])
    d = await make_dispatcher(nursery, golden_model, coord_transport)
    d.set_map(dmap(golden_model, 1, {(0, 0, 4): [a]}))
    handle = d.core.handle
    broken = [True]

    def once(ev: Any, now: float) -> Any:
        if isinstance(ev, LayerReady) and broken[0]:
            broken[0] = False
            raise RuntimeError("a bug")
        return handle(ev, now)

    monkeypatch.setattr(d.core, "handle", once)
    x = torch.randn(2, golden_model.config.d_model).numpy()
    ids = np.array([[0, 5], [1, 2]])
    w = np.full((2, 2), 0.5, dtype=np.float32)
    with pytest.raises(DispatchFailed, match="a bug"):
        await trio.to_thread.run_sync(d.moe, 0, x, ids, w)
    got = await trio.to_thread.run_sync(d.moe, 0, x, ids, w)
    ref = await make_dispatcher(nursery, golden_model, None)
    ref.set_map(dmap(golden_model, 1, {(0, 0, 4): [a]}))
    assert np.array_equal(got, await trio.to_thread.run_sync(ref.moe, 0, x, ids, w))
    assert a.server.stats.calls == 1


async def test_the_placement_is_known_at_begin_and_the_local_share_is_one_kernel_call(
    nursery: trio.Nursery, golden_model: GGUFModel, coord_transport: Transport
) -> None:
    """Under load, a layer too big for the engine's whole-layer path: ``begin`` returns with the core's
    placement made (here: two ranges remote, two here), the two remote calls on their way, and the
    ranges placed here computed by the driver in one kernel call before it waits; the bits are those
    of every range computed here."""
    quarters = [(0, lo, lo + 2) for lo in range(0, 8, 2)]
    a = await start_volunteer(nursery, golden_model, quarters)
    m = dmap(golden_model, 1, {k: [a] for k in quarters})
    cfg = DispatchConfig(verify_rate=0.0, verify_probation_calls=0, split_check_s=0.0, probe_interval_s=0.0,
                         hedge=False)
    d = await make_dispatcher(nursery, golden_model, coord_transport, config=cfg, load_probe=lambda: (4, 4))
    d.set_map(m)

    async def attached() -> bool:
        return d.core.load_state(trio.current_time()).value == "loaded" and a.peer_id in d.core.table.workers

    await eventually(attached, within=10)
    # proven, 2.5 ms; the local kernel 1 ms a pair
    d.core.table.succeeded(a.peer_id, rows=1, latency_s=2.5e-3, wall_ms=1)
    d.core.table.verified(a.peer_id, True)
    d.core.local_cost_s = 1e-3

    computed: list[list[int]] = []
    kernel = d.local_kernel

    def spy(job: Any) -> Any:
        computed.append(sorted(set((job.pair_experts + job.lo).tolist())))
        return kernel(job)

    d.local_kernel = spy
    x = torch.randn(4, golden_model.config.d_model, generator=torch.Generator().manual_seed(1)).numpy()
    ids = np.array([[0, 2], [4, 6], [1, 3], [5, 7]])  # two pairs in each quarter
    w = np.full((4, 2), 0.5, dtype=np.float32)

    def drive() -> tuple[list[int], np.ndarray]:
        call = d.begin(0, x, ids, w)
        placed = sorted(i for _, i in call.work)  # known when begin returns: no wait for the trio side
        return placed, d.result(call)

    placed, got = await trio.to_thread.run_sync(drive)
    # the core: 0 here (2 ms < 2.5), 1 remote (4 ms > 2.5), 2 here (4 < 5: one call in flight), 3 remote (6 > 5)
    assert placed == [0, 2]
    assert computed == [[0, 1, 4, 5]]  # one kernel call for both
    assert a.server.stats.calls == 2
    ref = await make_dispatcher(nursery, golden_model, None)
    ref.set_map(m)
    assert np.array_equal(got, await trio.to_thread.run_sync(ref.moe, 0, x, ids, w))
