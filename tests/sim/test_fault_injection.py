"""Seeded fault injection under virtual time (issue 11 item 7): the real dispatcher shell and core
and the real expert stream on the fake network, three volunteers serving every range, the
coordinator under load with verification at its defaults, while a seeded schedule kills volunteers
(and restarts them), freezes them for 10 s (the SIGSTOP of a process: calls hang), and partitions
them from the coordinator (then heals). Every layer dispatched completes once, with the bits of the
all-local run (``step`` asserts them). ``run_seed`` is shared with ``benchmarks/faults.py`` (100
seeds); ``make test`` runs 5."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from coordinator.core.dispatch import DispatchConfig, DispatchMode
from swarm.p2p.memory import FakeNetwork
from swarm.protocol.expert import ExpertRequest
from tests.sim.support import HALVES, LATENCY_S, Load, Swarm, dmap, step

NAMES = ("w1", "w2", "w3")


@dataclass
class Faults:
    kills: int = 0
    restarts: int = 0
    freezes: int = 0
    partitions: int = 0
    frozen: set[str] = field(default_factory=set)
    thaw: dict[str, trio.Event] = field(default_factory=dict)


async def run_seed(seed: int, n_steps: int = 40, mode: DispatchMode = DispatchMode.ADAPTIVE) -> dict[str, Any]:
    """One seeded run; returns its counts. Raises if a layer's output differs from all-local."""
    rnd = random.Random(seed)
    net = FakeNetwork(latency_s=LATENCY_S)
    f = Faults()
    steps_done = 0
    async with trio.open_nursery() as nursery:
        sw = Swarm(nursery, net)

        def behaviour(name: str) -> Any:
            async def b(req: ExpertRequest) -> float | None:
                if name in f.frozen:
                    await f.thaw[name].wait()  # frozen like a SIGSTOPped process: the call hangs
                return 0.0

            return b

        for n in NAMES:
            await sw.volunteer(n, behaviour(n))
        m = dmap({k: list(NAMES) for k in HALVES})
        cfg = DispatchConfig(mode=mode, timeout_s=1.0, hedge_floor_s=0.05)
        async with sw.coordinator(load_probe=Load(busy=4), config=cfg, rng=random.Random(seed)) as d:
            d.set_map(m)
            await trio.sleep(0.01)
            down: set[str] = set()

            async def chaos() -> None:
                while True:
                    await trio.sleep(rnd.uniform(0.005, 0.08))
                    name = rnd.choice(NAMES)
                    kind = rnd.choice(["kill", "freeze", "partition"])
                    if kind == "kill" and name not in down:
                        sw.scopes[name].cancel()
                        down.add(name)
                        f.kills += 1

                        async def restart(name: str = name) -> None:
                            await trio.sleep(rnd.uniform(0.05, 0.5))
                            await sw.volunteer(name, behaviour(name))
                            down.discard(name)
                            f.restarts += 1

                        nursery.start_soon(restart)
                    elif kind == "freeze" and name not in f.frozen and name not in down:
                        f.frozen.add(name)
                        f.thaw[name] = trio.Event()
                        f.freezes += 1

                        async def thaw(name: str = name) -> None:
                            await trio.sleep(10.0)
                            f.frozen.discard(name)
                            f.thaw[name].set()

                        nursery.start_soon(thaw)
                    elif kind == "partition":
                        net.partition("coordinator", name)
                        f.partitions += 1

                        async def heal() -> None:
                            await trio.sleep(rnd.uniform(0.05, 0.3))
                            net.heal()

                        nursery.start_soon(heal)

            async with trio.open_nursery() as inner:
                inner.start_soon(chaos)
                for i in range(n_steps):
                    await step(d, m, layer=i % 2, seed=seed * 1000 + i)  # the all-local bits, or it raises
                    steps_done += 1
                inner.cancel_scope.cancel()
            rep = d.report()
        for t in f.thaw.values():
            t.set()
        nursery.cancel_scope.cancel()
    return {"seed": seed, "steps": steps_done, "kills": f.kills, "restarts": f.restarts, "freezes": f.freezes,
            "partitions": f.partitions, "errors": rep.errors_total, "decisions": dict(rep.decisions),
            "quarantines": rep.quarantines}


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.mark.parametrize("seed", range(5))
async def test_faults_never_change_or_lose_a_layer(seed: int, clock: trio.testing.MockClock) -> None:
    mode = DispatchMode.OFFLOAD if seed % 2 else DispatchMode.ADAPTIVE
    got = await run_seed(seed, 40, mode)
    assert got["steps"] == 40
    assert got["kills"] + got["freezes"] + got["partitions"] > 0, got  # faults did happen
    assert got["quarantines"] == 0  # honest volunteers under faults are never called liars
