"""Load-adaptive dispatch with real processes on loopback (a coordinator and a volunteer started from
the command line, the volunteer serving both layers in two ranges each): one session at a time stays
local; a burst of concurrent sessions puts the coordinator under load, where the volunteer gets its
hedged trial and is proven; the tokens are those of the all-local run throughout -- although the
volunteer's map partitions each layer into two ranges and the all-local run had one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from swarm.model.gguf import model_id_for
from tests.conftest import FIXTURES, eventually
from tests.e2e.test_process_e2e import Proc, cli, procs, wait_for_line  # noqa: F401 - procs is a fixture

pytestmark = pytest.mark.slow

# llama.cpp's Q4_K_M of a 4-layer, 16-expert top-4 model: with top-4 a row's pairs spread over both
# ranges of a layer, where zero-started per-range sums would round differently from one range
MODEL = FIXTURES / "golden" / "qwen3moe-small-w224-q4_k_m.gguf"
N_LAYER, HALF = 4, 8

PROMPTS = ["The quick brown fox", "Mixture of experts", "Volunteer compute", "Count to five"]


async def complete(h: httpx.AsyncClient, model_id: str, prompt: str) -> list[int]:
    body: dict[str, Any] = {"model": model_id, "prompt": prompt, "max_tokens": 48, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}
    r = await h.post("/v1/completions", json=body)
    r.raise_for_status()
    ids: list[int] = r.json()["choices"][0]["token_ids"]
    return ids


async def burst(h: httpx.AsyncClient, model_id: str) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        out[i] = await complete(h, model_id, PROMPTS[i])

    async with trio.open_nursery() as n:
        for i in range(len(PROMPTS)):
            n.start_soon(one, i)
    return out


def totals(rep: dict[str, Any]) -> tuple[int, int]:
    return (sum(L["local_rows"] for L in rep["layers"]), sum(L["remote_rows"] for L in rep["layers"]))


async def test_idle_stays_local_load_proves_the_volunteer_tokens_unchanged(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    map_path = tmp_path / "map.json"
    model_id = model_id_for(MODEL)
    map_path.write_text(json.dumps({"model_id": model_id, "version": 0, "layers": []}))
    coord = Proc(cli("coordinator", "--model", str(MODEL), "--port", "0", "--data-dir", str(tmp_path / "c"),
                     "--slots", "4", "--saturation-threshold", "2", "--serve-ttl", "2", "--dispatch-map", str(map_path)),
                 tmp_path / "coordinator.log")
    procs.append(coord)
    url = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        ref_one = await complete(h, model_id, PROMPTS[0])
        ref_burst = await burst(h, model_id)

        slices = [a for L in range(N_LAYER) for a in ("--slice", f"{L}:0-{HALF}", "--slice", f"{L}:{HALF}-{2 * HALF}")]
        vol = Proc(cli("volunteer", "--coordinator", url, *slices, "--data-dir", str(tmp_path / "v"), "--no-progress"),
                   tmp_path / "volunteer.log")
        procs.append(vol)
        await wait_for_line(vol, "volunteer ready ")
        info = json.loads((tmp_path / "v" / "volunteer.json").read_text())
        rep = [{"peer_id": info["peer_id"], "addrs": info["addrs"]}]
        layers = [{"layer": L, "ranges": [{"lo": 0, "hi": HALF, "replicas": rep}, {"lo": HALF, "hi": 2 * HALF, "replicas": rep}]}
                  for L in range(N_LAYER)]
        map_path.write_text(json.dumps({"model_id": model_id, "version": 1, "layers": layers}))

        async def attached() -> bool:
            return len((await h.get("/dispatch")).json()["workers"]) == 1

        await eventually(attached, within=30)

        # one session at a time: idle, every held range computed here
        before = (await h.get("/dispatch")).json()
        assert await complete(h, model_id, PROMPTS[0]) == ref_one
        after = (await h.get("/dispatch")).json()
        (l0, r0), (l1, r1) = totals(before), totals(after)
        assert l1 - l0 > 0 and r1 - r0 == 0
        assert after["decisions"].get("idle_local", 0) > before["decisions"].get("idle_local", 0)
        assert after["workers"][0]["calls"] == 0

        # bursts back to back: under load (seen by the dispatcher's own 2 s sample, whenever it lands);
        # at the load onset the volunteer gets its hedged trial and answers correctly -> proven
        with trio.fail_after(90):
            while True:
                assert await burst(h, model_id) == ref_burst
                rep_ = (await h.get("/dispatch")).json()
                if rep_["decisions"].get("trial_hedge", 0) >= 1 and rep_["workers"][0]["proven"]:
                    break
        [w] = rep_["workers"]
        assert rep_["decisions"].get("trial_hedge", 0) >= 1
        assert w["calls"] >= 1 and w["proven"] and w["failures"] == 0
        assert any(c["state"] == "loaded" for c in rep_["mode_changes"])

        # after the serve TTL: idle again, and still the same tokens
        async def idle_again() -> bool:
            return bool((await h.get("/dispatch")).json()["load_state"] == "idle")

        await eventually(idle_again, within=30, interval=0.2)
        assert await complete(h, model_id, PROMPTS[0]) == ref_one
