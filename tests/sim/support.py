"""Helpers of the virtual-time scenarios: a fake swarm on the in-memory network, the real dispatcher
and expert stream on both sides, synchronous fake kernels whose compute takes virtual time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import trio
import trio.testing

from coordinator.dispatch.dispatcher import Dispatcher, LocalJob
from swarm.dispatch_map import DispatchMap, LayerRanges, RangeReplicas, Replica
from swarm.p2p.memory import FakeNetwork, open_fake_transport
from swarm.protocol.expert import ExpertRequest, Pairs, make_hello
from swarm.rpc.server import set_expert_handlers
from swarm.rpc.tensors import pairs_to_tensors
from tests.conftest import eventually

D = 16
N_EXPERT = 8
MODEL_ID = "fake-0123456789ab"
LOCAL_S_PER_PAIR = 1e-3  # the coordinator's local kernel: 1 ms per (row, expert) pair
REMOTE_S_PER_PAIR = 0.5e-3  # a volunteer's
LATENCY_S = 0.5e-3  # one way


@dataclass(frozen=True)
class Dims:
    n_moe_layer: int = 2
    n_expert: int = N_EXPERT
    d_model: int = D


@dataclass(frozen=True)
class FakeModel:
    model_id: str = MODEL_ID
    config: Dims = Dims()


def partial_sum(
    layer: int, lo: int, x: torch.Tensor, pr: torch.Tensor, pe: torch.Tensor, pw: torch.Tensor
) -> torch.Tensor:
    """The fake expert kernel: each pair's weighted output, in pair order (what v2 answers)."""
    out = torch.empty(int(pr.shape[0]), x.shape[1])
    for i, (r, e, w) in enumerate(zip(pr.tolist(), pe.tolist(), pw.tolist(), strict=True)):
        out[i] = w * torch.tanh(x[r] * (lo + e + 1) * 0.1 + layer)
    return out


def fake_kernel(job: LocalJob) -> np.ndarray:
    return partial_sum(job.layer, job.lo, torch.from_numpy(job.x), torch.from_numpy(job.pair_rows),
                       torch.from_numpy(job.pair_experts), torch.from_numpy(job.pair_weights)).numpy()


async def local_runner(job: LocalJob) -> np.ndarray:
    await trio.sleep(LOCAL_S_PER_PAIR * int(job.pair_rows.shape[0]))
    return fake_kernel(job)


def routing(n_tok: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token t goes to experts t % 4 and 4 + t % 4: both halves get n_tok pairs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, D, generator=g)
    ids = torch.tensor([[t % 4, 4 + t % 4] for t in range(n_tok)])
    w = torch.rand(n_tok, 2, generator=g)
    return x, ids, w / w.sum(dim=1, keepdim=True)


Behaviour = Callable[[ExpertRequest], Awaitable[float | None]]  # extra delay; None: answer garbage


@dataclass
class Volunteer:
    peer_id: str
    calls: list[ExpertRequest] = field(default_factory=list)
    answered: int = 0
    cancelled: int = 0  # calls whose computation stopped on the coordinator's Cancel
    behaviour: Behaviour | None = None
    uninterruptible: bool = False  # a kernel that cannot stop once started: a Cancel comes too late

    async def handle(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        self.calls.append(req)
        pr, pe, pw = pairs_to_tensors(pairs)
        garbage = False
        try:
            with trio.CancelScope(shield=self.uninterruptible):
                if self.behaviour is not None:
                    extra = await self.behaviour(req)
                    garbage = extra is None
                    if extra:
                        await trio.sleep(extra)
                await trio.sleep(REMOTE_S_PER_PAIR * int(pr.shape[0]))
        except trio.Cancelled:
            self.cancelled += 1
            raise
        self.answered += 1
        out = partial_sum(req.layer, req.lo, rows, pr, pe, pw)
        return out * 3.0 + 1.0 if garbage else out


class Swarm:
    def __init__(self, nursery: trio.Nursery, net: FakeNetwork) -> None:
        self.nursery = nursery
        self.net = net
        self.scopes: dict[str, trio.CancelScope] = {}

    async def volunteer(self, name: str, behaviour: Behaviour | None = None) -> Volunteer:
        vol = Volunteer(name, behaviour=behaviour)

        async def run(task_status: trio.TaskStatus[None]) -> None:
            with trio.CancelScope() as cs:
                self.scopes[name] = cs
                async with open_fake_transport(self.net, peer_id=name) as t:
                    set_expert_handlers(t, vol.handle, hello=make_hello(kernel_id="fake-kernel"))
                    task_status.started()
                    await trio.sleep_forever()

        await self.nursery.start(run)
        return vol

    @asynccontextmanager
    async def coordinator(self, **kw: object) -> AsyncIterator[Dispatcher]:
        async with open_fake_transport(self.net, peer_id="coordinator") as t:
            kw.setdefault("probe_in_thread", False)
            kw.setdefault("local_runner", local_runner)
            kw.setdefault("disk_runner", local_runner)  # "the GGUF on disk": the same experts, in virtual time
            d = Dispatcher(FakeModel(), t, local_kernel=fake_kernel, **kw)  # type: ignore[arg-type]
            async with trio.open_nursery() as n:
                await n.start(d.serve)
                yield d
                n.cancel_scope.cancel()


def dmap(spec: dict[tuple[int, int, int], list[str]], version: int = 1) -> DispatchMap:
    layers: dict[int, list[RangeReplicas]] = {}
    for (L, lo, hi), peers in spec.items():
        layers.setdefault(L, []).append(RangeReplicas(lo, hi, [Replica(p, []) for p in peers]))
    return DispatchMap(MODEL_ID, version, [LayerRanges(L, r) for L, r in sorted(layers.items())])


HALVES = [(L, lo, hi) for L in (0, 1) for lo, hi in ((0, 4), (4, 8))]


def reference(
    m: DispatchMap, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Every range computed here (a dispatcher that is not serving), in the same partition."""
    d = Dispatcher(FakeModel(), None, local_kernel=fake_kernel)
    d.set_map(m)
    return torch.from_numpy(d.moe(layer, x.numpy(), ids.numpy(), w.numpy()))


class Load:
    def __init__(self, busy: int = 0, n_slots: int = 4) -> None:
        self.busy = busy
        self.n_slots = n_slots

    def __call__(self) -> tuple[int, int]:
        return self.busy, self.n_slots


async def step(d: Dispatcher, m: DispatchMap, layer: int = 0, seed: int = 0, n_tok: int = 8) -> float:
    """One layer dispatched; asserts its bits equal the all-local ones; returns its virtual duration."""
    x, ids, w = routing(n_tok, seed)
    t0 = trio.current_time()
    out = torch.from_numpy(await d.dispatch_layer(layer, x.numpy(), ids.numpy(), w.numpy()))
    elapsed = trio.current_time() - t0
    assert torch.equal(out, reference(m, layer, x, ids, w))
    return elapsed


def decisions(d: Dispatcher) -> dict[str, int]:
    return dict(d.report().decisions)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def worker(d: Dispatcher, peer: str) -> dict[str, object]:
    [w] = [w for w in d.report().workers if w.peer_id == peer]
    return {
        "state": w.state,
        "calls": w.calls,
        "proven": w.proven,
        "failures": w.failures,
        "last_serve_ms": w.last_serve_ms,
        "last_error": w.last_error,
    }


# placement scenarios with every answer used after the trial (verification has its scenarios below),
# and earliest finish deciding alone (the split check has its scenarios below)
NO_SAMPLING = {"verify_rate": 0.0, "verify_probation_calls": 0, "split_check_s": 0.0}


async def settled(d: Dispatcher, within: float = 5.0) -> None:
    """Wait (virtual time) until every remote call has ended and its comparison, if any, is in."""
    async def idle() -> bool:
        return not (d.core.in_flight() or d.core._comparing or d.executor.kept)

    await eventually(idle, within=within, interval=0.001)


async def wait_sample(d: Dispatcher) -> None:
    """Let the 2-second load sampler take its next sample."""
    await trio.sleep(d.config.sample_interval_s + 0.01)
