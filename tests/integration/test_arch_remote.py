"""Every architecture's routed experts on volunteers over real libp2p hosts: the same bits as all-local.

The shared experts (qwen2moe, deepseek2) and deepseek2's leading dense block are not routed and stay on
the coordinator; the routed ranges are sliced and served exactly as qwen3moe's are (expert layer i is
block ``moe_layers[i]``), so a volunteer serves slices of every architecture.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import trio

from coordinator.engine.model import Transformer
from swarm.model.gguf import GGUFModel
from swarm.p2p.libp2p import open_libp2p_transport
from tests.conftest import FIXTURES
from tests.integration.support import dmap, greedy, make_dispatcher, report, start_volunteer

FILES = ["qwen2moe-tiny-f32", "qwen2moe-tiny-q8_0", "qwen2moe-tiny-mxfp4_moe", "olmoe-tiny-f32", "olmoe-tiny-q8_0",
         "gpt-oss-tiny-f32", "gpt-oss-tiny-mxfp4_moe",
         "deepseek2-tiny-f32", "deepseek2-tiny-q8_0"]


@pytest.mark.parametrize("name", FILES)
async def test_volunteers_give_the_bits_of_all_local(nursery: trio.Nursery, name: str) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    g: dict[str, Any] = json.loads((FIXTURES / "golden" / f"{name}.llamacpp.json").read_text())
    a = await start_volunteer(nursery, model, [(0, 0, 4), (1, 0, 4)])
    b = await start_volunteer(nursery, model, [(0, 4, 8), (1, 4, 8)])
    m = dmap(model, 1, {(0, 0, 4): [a], (0, 4, 8): [b], (1, 0, 4): [a], (1, 4, 8): [b]})
    async with open_libp2p_transport(key_path=None) as t:
        remote = await make_dispatcher(nursery, model, t)
        remote.set_map(m)
        e = g["greedy"][0]
        toks_r, lg_r = await greedy(Transformer(model, remote), e["prompt_ids"], 12)
        toks_l, lg_l = await greedy(Transformer(model), e["prompt_ids"], 12)
        assert toks_r == toks_l == e["greedy_ids"][:12]  # llama.cpp's tokens
        # every logit: the bits of the all-local forward (per-pair answers, combined in expert order)
        assert all(torch.equal(x, y) for x, y in zip(lg_r, lg_l, strict=True))
        rep = report(remote)
        assert all(L["local_rows"] == 0 and L["remote_rows"] > 0 for L in rep["layers"])
        assert a.server.stats.calls > 0 and b.server.stats.calls > 0
