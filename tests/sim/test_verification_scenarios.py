"""Verification end to end under virtual time (the real dispatcher shell and core, the real expert
stream on the fake network): liars of every kind are quarantined at their first lie and no layer's
output differs from the all-local one; honest workers are never quarantined; a sleeper is caught at
its first lie at ``verify_rate`` 1."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import trio
import trio.testing

from coordinator.core.dispatch import DispatchConfig, Reason
from coordinator.dispatch.dispatcher import Dispatcher
from swarm.errors import DispatchFailed
from swarm.model.kernels import KernelBackend, kernel_id
from swarm.p2p.memory import FakeNetwork, open_fake_transport
from swarm.protocol.expert import ExpertRequest, Pairs, make_hello
from swarm.rpc.server import set_expert_handlers
from swarm.rpc.tensors import pairs_to_tensors
from tests.sim.support import (
    HALVES,
    LATENCY_S,
    REMOTE_S_PER_PAIR,
    Load,
    Swarm,
    dmap,
    partial_sum,
    settled,
    step,
)

OURS = kernel_id(KernelBackend.TORCH)  # the coordinator's kernel id here: comparisons are bit-exact

Lie = Callable[[int, torch.Tensor], torch.Tensor | None]  # (call number from 0, honest answer) -> lie or None


def ulp(out: torch.Tensor) -> torch.Tensor:
    y = out.clone()
    y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf")))
    return y


def noise(out: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return out + 0.1 * out.abs().mean() * torch.randn(out.shape, generator=g)  # ~10 % relative: above 5 %


LIARS: dict[str, tuple[Lie, str]] = {
    "zeros": (lambda n, out: torch.zeros_like(out), OURS),
    "scaled": (lambda n, out: out * 1.5, OURS),
    "ulp": (lambda n, out: ulp(out), OURS),  # 1-ulp noise: caught only because kernel ids are equal
    "noise": (lambda n, out: noise(out), "another-kernel"),  # above tolerance, different kernel ids
    "intermittent": (lambda n, out: out * 1.5 if n % 20 == 19 else None, OURS),  # every 20th call
}


@dataclass
class Liar:
    lie: Lie
    calls: int = 0
    lies: list[int] = field(default_factory=list)

    async def handle(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        n = self.calls
        self.calls += 1
        pr, pe, pw = pairs_to_tensors(pairs)
        await trio.sleep(REMOTE_S_PER_PAIR * int(pr.shape[0]))
        out = partial_sum(req.layer, req.lo, rows, pr, pe, pw)
        bad = self.lie(n, out)
        if bad is None:
            return out
        self.lies.append(n)
        return bad


async def start_worker(sw: Swarm, name: str, handler: Liar, kid: str) -> None:
    async def run(task_status: trio.TaskStatus[None]) -> None:
        async with open_fake_transport(sw.net, peer_id=name) as t:
            set_expert_handlers(t, handler.handle, hello=make_hello(kernel_id=kid))
            task_status.started()
            await trio.sleep_forever()

    await sw.nursery.start(run)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def run_steps(d: Dispatcher, n: int, seed0: int = 0) -> None:
    m = d.map
    assert m is not None
    for i in range(n):
        await step(d, m, layer=i % 2, seed=seed0 + i)  # asserts the all-local bits, every step


@pytest.mark.parametrize("kind", sorted(LIARS))
async def test_a_liar_is_quarantined_at_its_first_lie_and_no_output_differs(
    kind: str, clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    lie, kid = LIARS[kind]
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    liar = Liar(lie)
    await start_worker(sw, "liar", liar, kid)
    # verification's defaults (0.05 after 50); earliest finish deciding alone (no split check)
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH,
                              config=DispatchConfig(split_check_s=0.0)) as d:
        d.set_map(dmap({k: ["liar"] for k in HALVES}))
        await trio.sleep(0.01)  # the first load sample: loaded
        await run_steps(d, 80)
        await settled(d)
        rep = d.report()
        [w] = rep.workers
        assert liar.lies, "the liar never lied"
        assert w.state == "quarantined" and not w.proven and rep.quarantines == 1
        # quarantined at its first lie: it never got to tell a second one; every other answer compared equal
        assert len(liar.lies) == 1 and rep.verifications == rep.verified_equal + 1
        assert rep.verified_equal >= liar.lies[0]  # the honest answers before it (one more may overlap it)
        assert w.quarantine and "experts" in w.quarantine
        assert [e.reason for e in rep.errors] == ["wrong_answer"]
        calls_at_quarantine = liar.calls
        await run_steps(d, 10, seed0=100)
        assert liar.calls == calls_at_quarantine  # no more work
        assert rep.layers[0].remote_rows + rep.layers[1].remote_rows == 0  # no liar answer was ever used


async def test_honest_workers_are_never_quarantined(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    """10^3 honest answers, every one compared (rate 1), bit-exact and by tolerance: 0 quarantines."""
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    exact, tol = Liar(lambda n, out: None), Liar(lambda n, out: None)
    await start_worker(sw, "exact", exact, OURS)
    await start_worker(sw, "tol", tol, "another-kernel")
    cfg = DispatchConfig(verify_rate=1.0, split_check_s=0.0)
    spec = {k: (["exact"] if k[1] == 0 else ["tol"]) for k in HALVES}
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH, config=cfg) as d:
        d.set_map(dmap(spec))
        await trio.sleep(0.01)
        await run_steps(d, 520)
        await settled(d)
        rep = d.report()
        assert exact.calls + tol.calls >= 1000 and rep.verifications == exact.calls + tol.calls
        assert rep.quarantines == 0 and rep.verified_equal == rep.verifications
        assert all(w.state == "up" and w.proven for w in rep.workers)


@pytest.mark.parametrize(("rate", "caught_at_first"), [(1.0, True), (0.05, False)])
async def test_a_sleeper_is_caught_at_its_first_lie_at_rate_1(
    rate: float, caught_at_first: bool, clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Honest for its first 120 calls, then scaled answers. At rate 1 the first lie quarantines it and no
    output differs; at the default rate its lies go unseen until a sample hits one -- the layer outputs
    of this test then differ from all-local, which is what sampling cannot catch (measured in
    benchmarks/verification.py)."""
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    sleeper = Liar(lambda n, out: out * 1.5 if n >= 120 else None)
    await start_worker(sw, "sleeper", sleeper, OURS)
    cfg = DispatchConfig(verify_rate=rate, verify_probation_calls=50, split_check_s=0.0)
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH, config=cfg,
                              rng=random.Random(3)) as d:
        d.set_map(dmap({k: ["sleeper"] for k in HALVES}))
        await trio.sleep(0.01)
        m = d.map
        assert m is not None
        differing = 0
        for i in range(400):
            try:
                await step(d, m, layer=i % 2, seed=i)
            except AssertionError:
                differing += 1
            if d.report().quarantines:
                break
        await settled(d)
        rep = d.report()
        assert rep.quarantines == 1  # caught, at the latest by a sample
        if caught_at_first:
            # its first lie quarantines it; the other half of that layer may be in flight beside it (also
            # verified, so never used either; the two calls may reach it in either order)
            assert differing == 0 and sorted(sleeper.lies) in ([120], [120, 121])
        else:  # the lies before the sampled one went into the outputs
            assert 1 <= differing <= len(sleeper.lies) - 1
        assert rep.decisions.get(Reason.VERIFY.value, 0) >= 50


NOT_HELD = {"held": lambda layer, lo, hi: False}  # the coordinator holds no expert (a backbone)


@pytest.mark.parametrize("kind", ["zeros", "scaled", "ulp", "intermittent"])
async def test_experts_not_held_here_are_checked_on_a_second_replica_and_disputes_settled_here(
    kind: str, clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """DESIGN §12 for ranges the coordinator does not hold: a sampled call also goes to a second
    replica; the range's result waits until both agree; when they disagree the coordinator computes
    the range from its own GGUF, uses that, and quarantines whoever differs from it. No output
    differs from all-local; the honest replica is never quarantined."""
    lie, kid = LIARS[kind]
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    liar, honest = Liar(lie), Liar(lambda n, out: None)
    await start_worker(sw, "liar", liar, kid)
    await start_worker(sw, "honest", honest, OURS)
    # every call of a range not held here is cross-checked (no probation: its disk checks have their own tests)
    cfg = DispatchConfig(verify_rate=1.0, split_check_s=0.0, verify_probation_calls=0)
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH, config=cfg, **NOT_HELD) as d:
        d.set_map(dmap({k: ["liar", "honest"] for k in HALVES}))
        await trio.sleep(0.01)
        await run_steps(d, 60)
        await settled(d)
        rep = d.report()
        # caught at its first lie: no lie after the step it first lied in (both ranges of it may be in flight)
        assert liar.lies and len(liar.lies) <= len(HALVES) // 2 and max(liar.lies) - min(liar.lies) <= 1
        states = {w.peer_id: w.state for w in rep.workers}
        assert states == {"liar": "quarantined", "honest": "up"} and rep.quarantines == 1
        [err] = rep.errors  # (a second dispute of the same step finds it quarantined already)
        assert err.peer == "liar" and err.reason == "wrong_answer" and "second replica" in err.message
        n = len(liar.lies)  # each lie was one dispute, settled here
        assert rep.decisions.get(Reason.VERIFY_SECOND.value, 0) >= 1 and rep.decisions[Reason.DISPUTE.value] == n
        assert d.core.disputes == n and d.core.cross_checks >= n
        calls = liar.calls
        await run_steps(d, 10, seed0=100)
        assert liar.calls == calls


async def test_a_not_held_range_with_one_replica_is_served_unchecked_only_after_its_probation(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """With no second live replica and no disk checks a sampled call cannot be checked here: out of
    probation it is served as is and counted (``unverifiable``), never held up; in probation the
    worker gets no such range at all (its unchecked answers would be used)."""
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    only_one = Liar(lambda n, out: None)
    await start_worker(sw, "only", only_one, OURS)
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH,
                              config=DispatchConfig(verify_rate=1.0, split_check_s=0.0, verify_probation_calls=0),
                              **NOT_HELD) as d:
        d.set_map(dmap({k: ["only"] for k in HALVES}))
        await trio.sleep(0.01)
        await run_steps(d, 10)
        assert d.core.unverifiable == only_one.calls == 20 and d.core.cross_checks == 0
        assert d.report().quarantines == 0
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH,
                              config=DispatchConfig(verify_rate=1.0, split_check_s=0.0), **NOT_HELD) as d:
        d.set_map(dmap({k: ["only"] for k in HALVES}))
        await trio.sleep(0.01)
        calls = only_one.calls
        with pytest.raises(DispatchFailed):
            await run_steps(d, 1)
        assert only_one.calls == calls  # nothing sent that could not be checked




@pytest.mark.parametrize("disk_rate", [0.0, 0.05])
async def test_replicas_agreeing_on_a_lie_are_caught_from_the_disk(
    disk_rate: float, clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Two replicas that tell the same lie pass every cross-check; only a copy from the coordinator's
    own GGUF catches them. With disk checks (every call in probation, then ``verify_disk_rate``) no
    output differs and both are quarantined at once; without, their lies are the outputs (the known
    limit the disk checks close)."""
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    a, b = Liar(lambda n, out: out * 1.5), Liar(lambda n, out: out * 1.5)
    await start_worker(sw, "a", a, OURS)
    await start_worker(sw, "b", b, OURS)
    cfg = DispatchConfig(verify_rate=1.0, split_check_s=0.0, verify_disk_rate=disk_rate)
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH, config=cfg, **NOT_HELD) as d:
        d.set_map(dmap({k: ["a", "b"] for k in HALVES}))
        await trio.sleep(0.01)
        if disk_rate == 0:  # in probation, checked on each other: they agree, so their lie is the layer's
            with pytest.raises(AssertionError):
                await run_steps(d, 4)
            assert d.report().quarantines == 0 and d.core.disputes == 0 and d.core.cross_checks > 0
            return
        m = d.map
        assert m is not None
        for i in range(8):  # the all-local bits at every step, until no replica is left
            if all(w.state == "quarantined" for w in d.report().workers):
                break
            await step(d, m, layer=i % 2, seed=i)
            await settled(d)
        rep = d.report()
        assert {w.peer_id: w.state for w in rep.workers} == {"a": "quarantined", "b": "quarantined"}
        assert d.core.ledger.disk_checks >= 2 and rep.decisions[Reason.VERIFY_DISK.value] >= 2
        assert all("disk" in e.message or "experts" in e.message for e in rep.errors)


def drift(out: torch.Tensor) -> torch.Tensor:
    """~3 % relative noise: below the 5 % tolerance, far beyond the honest spread between kernels."""
    g = torch.Generator().manual_seed(int(out.abs().sum() * 1000) % 100_000)
    return out * (1 + 0.03 * torch.randn(out.shape, generator=g))


async def test_lies_below_the_tolerance_add_up_to_a_quarantine(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    """A worker of another kernel id whose answers differ by a few percent passes each comparison (the
    5 % tolerance) but its mean error is beyond the spread honest kernels show: quarantined after
    ``drift_calls`` comparisons; an honest worker of another kernel id never is."""
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    liar, honest = Liar(lambda n, out: drift(out)), Liar(lambda n, out: None)
    await start_worker(sw, "liar", liar, "another-kernel")
    await start_worker(sw, "honest", honest, "another-kernel")
    cfg = DispatchConfig(split_check_s=0.0, honest_error=0.005, drift_calls=16)
    async with sw.coordinator(load_probe=Load(busy=4), kernel=KernelBackend.TORCH, config=cfg) as d:
        d.set_map(dmap({(0, 0, 4): ["liar"], (0, 4, 8): ["honest"], (1, 0, 4): ["liar"], (1, 4, 8): ["honest"]}))
        await trio.sleep(0.01)
        await run_steps(d, 40)
        await settled(d)
        rep = d.report()
        states = {w.peer_id: w.state for w in rep.workers}
        assert states == {"liar": "quarantined", "honest": "up"}, states
        [err] = [e for e in rep.errors if e.peer == "liar"]
        assert "consistently" in err.message or "beyond" in err.message
        assert liar.calls <= cfg.drift_calls + 4  # caught within a bounded number of calls (in probation: all compared)
