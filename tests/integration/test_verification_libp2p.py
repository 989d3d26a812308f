"""Verification on real libp2p hosts with the real kernels: a lying volunteer (zeros, x1.5, 1-ulp
noise) is quarantined at its first answer and the greedy tokens and logits are the all-local ones;
honest volunteers are never quarantined, bit-exact with our kernel and within the stated tolerance
with the torch reference kernel on a quantised model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio

from coordinator.core.dispatch import DispatchConfig, DispatchMode
from coordinator.dispatch.verify import VERIFY_RTOL, verify_outputs
from coordinator.engine.model import Transformer
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from swarm.p2p.transport import Transport
from tests.conftest import FIXTURES, eventually
from tests.integration.support import (
    HALVES,
    Handler,
    assert_greedy_as_all_local,
    dmap,
    greedy,
    make_dispatcher,
    report,
    start_volunteer,
)
from volunteer.server import ExpertServer

# every range with a live replica goes remote; verification at its defaults (50 in probation, then 0.05)
VERIFIED_OFFLOAD = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False)


def lying(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Handler], Handler]:
    def wrap(inner: Handler) -> Handler:
        async def handler(req: Any, rows: torch.Tensor, pairs: Any) -> torch.Tensor:
            return f(await inner(req, rows, pairs))

        return handler

    return wrap


def one_ulp(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf")))
    return y


@pytest.mark.parametrize(
    "lie",
    [lambda y: torch.zeros_like(y), lambda y: y * 1.5, one_ulp],
    ids=["zeros", "scaled", "ulp"],
)
async def test_a_lying_volunteer_never_changes_the_output(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport,
    lie: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    liar = await start_volunteer(nursery, golden_model, HALVES, wrap=lying(lie))
    m = dmap(golden_model, 1, {k: [liar] for k in HALVES})
    d = await make_dispatcher(nursery, golden_model, coord_transport, config=VERIFIED_OFFLOAD)
    await assert_greedy_as_all_local(nursery, golden_model, golden, d, m)
    async def quarantined() -> bool:
        return bool(report(d)["quarantines"])

    await eventually(quarantined, within=10, interval=0.01)
    rep = report(d)
    [w] = rep["workers"]
    assert w["state"] == "quarantined" and w["quarantine"] and not w["proven"]
    assert rep["verified_equal"] == 0  # its very first compared answer was a lie
    assert sum(L["remote_rows"] for L in rep["layers"]) == 0  # none of its answers reached the output
    calls = w["calls"]
    await greedy(Transformer(golden_model, d), golden["greedy"][2]["prompt_ids"], 2)
    assert report(d)["workers"][0]["calls"] == calls  # no work after the quarantine


Q8 = FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf"


@pytest.mark.parametrize("kernel", [KernelBackend.GGML, KernelBackend.TORCH], ids=["same-kernel", "torch-kernel"])
async def test_honest_volunteers_pass_every_comparison(
    nursery: trio.Nursery, golden: dict[str, Any], coord_transport: Transport, kernel: KernelBackend,
) -> None:
    """A quantised model, every answer compared (rate 1): with our kernel id the comparison is bit-exact,
    with the torch reference (which keeps activations in f32 where ggml rounds them to q8) it is within
    VERIFY_RTOL; no quarantine either way."""
    model = GGUFModel(Q8)

    def torch_server(vol_slices: list[Any]) -> ExpertServer:
        return ExpertServer(vol_slices, threads=1, kernel=kernel)

    vol = await start_volunteer(nursery, model, HALVES, server_factory=torch_server)
    m = dmap(model, 1, {k: [vol] for k in HALVES})
    cfg = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=1.0)
    d = await make_dispatcher(nursery, model, coord_transport, config=cfg)
    d.set_map(m)
    g = golden["greedy"][2]
    await greedy(Transformer(model, d), g["prompt_ids"], 48)
    async def compared() -> bool:
        # every call answered (a verified call's local copy is the range's result, so the engine
        # moves on while the remote answer is still in flight) and compared
        r = report(d)
        return bool(r["workers"][0]["in_flight"] == 0 and r["verifications"] >= r["workers"][0]["calls"])

    await eventually(compared, within=10, interval=0.01)
    rep = report(d)
    [w] = rep["workers"]
    assert w["calls"] >= 120 and rep["verifications"] == w["calls"]
    assert rep["quarantines"] == 0 and rep["verified_equal"] == w["calls"] and w["state"] == "up"
    assert (w["kernel_id"] == rep["kernel_id"]) is (kernel is KernelBackend.GGML)


def test_tolerance_comparison_catches_what_the_kernels_cannot_explain() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.randn(32, 64, generator=g)
    assert verify_outputs(y.clone(), y, exact=True) == (True, "bit-equal", None)
    assert not verify_outputs(one_ulp(y), y, exact=True)[0]
    assert verify_outputs(one_ulp(y), y, exact=False)[0]  # 1 ulp is within any tolerance
    assert verify_outputs(y * (1 + VERIFY_RTOL / 2), y, exact=False)[0]
    ok, detail, err = verify_outputs(y * (1 + 2 * VERIFY_RTOL), y, exact=False)
    assert err is not None and err > VERIFY_RTOL
    assert not ok and "relative error" in detail
    assert not verify_outputs(torch.zeros_like(y), y, exact=False)[0]
    bad = y.clone()
    bad[3, 5] = float("nan")
    assert verify_outputs(bad, y, exact=False) == (False, "non-finite outputs", None)
    assert not verify_outputs(y[:31], y, exact=False)[0]


async def test_a_backbone_coordinator_settles_two_replicas_disagreeing_from_its_gguf(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport,
) -> None:
    """``--local-experts none`` (held: nothing): every call of the liar and the honest volunteer is
    cross-checked on the other; the disagreement is settled here, the liar quarantined, the honest one
    not, and the tokens and logits are the all-local ones."""
    from coordinator.core.local_experts import parse_local_experts

    cfg = golden_model.config
    none = parse_local_experts("none", cfg.n_layer, cfg.n_expert)
    liar = await start_volunteer(nursery, golden_model, HALVES, wrap=lying(lambda y: y * 1.5))
    honest = await start_volunteer(nursery, golden_model, HALVES)
    m = dmap(golden_model, 1, {k: [liar, honest] for k in HALVES})
    d = await make_dispatcher(nursery, golden_model, coord_transport, held=none.held,
                              config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=1.0))
    await assert_greedy_as_all_local(nursery, golden_model, golden, d, m)

    async def quarantined() -> bool:
        return bool(report(d)["quarantines"])

    await eventually(quarantined, within=10, interval=0.01)
    rep = report(d)
    states = {w["peer_id"]: w["state"] for w in rep["workers"]}
    assert states == {liar.peer_id: "quarantined", honest.peer_id: "up"}
    assert rep["decisions"].get("dispute", 0) >= 1 and d.core.disputes >= 1
    assert any("second replica" in e["message"] for e in rep["errors"] if e["peer"] == liar.peer_id)


async def test_a_backbone_catches_two_replicas_agreeing_on_a_lie_from_its_gguf_on_disk(
    nursery: trio.Nursery, golden_model: GGUFModel, golden: dict[str, Any], coord_transport: Transport,
) -> None:
    """Two volunteers telling the same lie pass every cross-check on each other; the coordinator,
    which holds no expert, recomputes their calls from its GGUF (pread: not through its memory map)
    in their probation, uses its copy, and quarantines both: the tokens and logits are the all-local ones."""
    from coordinator.core.local_experts import parse_local_experts

    cfg = golden_model.config
    none = parse_local_experts("none", cfg.n_layer, cfg.n_expert)
    a = await start_volunteer(nursery, golden_model, HALVES, wrap=lying(lambda y: y * 1.5))
    b = await start_volunteer(nursery, golden_model, HALVES, wrap=lying(lambda y: y * 1.5))
    honest = await start_volunteer(nursery, golden_model, HALVES)
    m = dmap(golden_model, 1, {k: [a, b, honest] for k in HALVES})
    d = await make_dispatcher(nursery, golden_model, coord_transport, held=none.held,
                              config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=1.0,
                                                    verify_disk_rate=0.5))
    await assert_greedy_as_all_local(nursery, golden_model, golden, d, m)

    async def both() -> bool:
        states = {w["peer_id"]: w["state"] for w in report(d)["workers"]}
        return states.get(a.peer_id) == states.get(b.peer_id) == "quarantined"

    await eventually(both, within=10, interval=0.01)
    rep = report(d)
    assert {w["peer_id"]: w["state"] for w in rep["workers"]}[honest.peer_id] == "up"
    assert rep["decisions"].get("verify_disk", 0) >= 2 and d.executor.disk_checks_done >= 2
    assert d.disk is not None and d.disk.bytes_read > 0  # read from the file, not through the memory map
