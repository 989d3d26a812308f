"""A volunteer warms each slice before its first call: every expert's weights are touched and the
kernel's graphs for calls of 1-8 pairs exist, so a coordinator's first calls (its trial, which sets
its latency estimate) are not the slow ones."""

from __future__ import annotations

import trio

from swarm.model import kernels as K
from swarm.model.gguf import ExpertStack, GGUFModel
from swarm.model.slices import cut_slice, load_slice
from tests.conftest import eventually
from volunteer.server import ExpertServer


def _plans_for(stack: ExpertStack) -> set[int]:
    """The call sizes (pairs) the pooled 1-thread kernels of ``stack``'s shape have graphs for."""
    return {b for k in K._POOL.get(K._pool_key(stack, 1), []) for b in k._plans}


async def test_serving_warms_every_slice_first(golden_model: GGUFModel) -> None:
    K._POOL.clear()
    slices = [load_slice(cut_slice(golden_model, 0, 0, 8)), load_slice(cut_slice(golden_model, 1, 0, 4))]
    server = ExpertServer(slices, threads=1)
    assert _plans_for(slices[0].experts) == set()
    async with trio.open_nursery() as n:
        await n.start(server.serve)

        async def warm() -> bool:
            return _plans_for(slices[0].experts) >= set(range(1, 9)) and _plans_for(slices[1].experts) >= {1, 2, 3, 4}

        await eventually(warm, within=30)
        n.cancel_scope.cancel()
