"""Volunteers serve the new architectures end to end, with real processes: a market, a backbone
coordinator that holds no expert (``--local-experts none``) and one volunteer daemon that pulls a
slice of every expert layer through the market (manifest, ranked sources, per-expert hashes: for
gpt-oss six kinds a slice, its MXFP4 weights and F32 biases, and its activation) and serves them.
A greedy completion then gives exactly the tokens of the all-local engine, with every routed row
computed on the volunteer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from coordinator.engine.model import Transformer
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer
from tests.conftest import FIXTURES, eventually, greedy_tokens
from tests.e2e.test_process_e2e import (  # noqa: F401 - fixture
    UNVERIFIED,
    Proc,
    cli,
    procs,
    start_coordinator_on,
    start_market,
    wait_for_line,
)
from tests.e2e.test_volunteer_status import serving

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


def all_local_greedy(path: Path, n: int) -> list[int]:
    model = GGUFModel(path, compute_id=False)
    tok = Tokenizer.from_gguf_fields(model.fields)
    return greedy_tokens(Transformer(model), tok.encode(PROMPT), n, kv_dtype=torch.float16)  # the coordinator's KV type


@pytest.mark.parametrize("name", ["gpt-oss-tiny-mxfp4_moe", "deepseek2-tiny-q8_0"])
async def test_a_volunteer_serves_every_expert_layer_of_the_architecture(procs: list[Proc], tmp_path: Path,  # noqa: F811
                                                                         name: str) -> None:
    path = FIXTURES / "golden" / f"{name}.gguf"
    murl = await start_market(procs, tmp_path, "--remote-base-target", "1")
    curl = await start_coordinator_on(procs, tmp_path, murl, "--local-experts", "none", "--on-missing", "fail",
                                      *UNVERIFIED, model=path)
    vdir = tmp_path / "v"
    vol = Proc(cli("volunteer", "--market", murl, "--max-experts", "16", "--max-slices", "4", "--data-dir", str(vdir),
                   "--no-progress", "--poll-interval", "0.5"), tmp_path / "volunteer.log")
    procs.append(vol)
    await wait_for_line(vol, "volunteer ready ")

    st = await serving(vdir, 2)
    assert sorted(s.slice for s in st.slices) == ["0:0-8", "1:0-8"]  # 2 expert layers x 8 experts
    n = 12
    async with httpx.AsyncClient(timeout=60) as h:
        async def covered() -> Any:
            health = (await h.get(f"{curl}/health")).json()
            return health if not health.get("coverage_holes") else None

        await eventually(covered, within=60, interval=0.5)
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        r = await h.post(f"{curl}/v1/completions", json={"model": model_id, "prompt": PROMPT, "max_tokens": n,
                                                         "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True})
        assert r.status_code == 200, r.text
        d = (await h.get(f"{curl}/dispatch")).json()
    assert r.json()["choices"][0]["token_ids"] == all_local_greedy(path, n)
    rows = d["layers"]
    assert len(rows) == 2 and sum(x["local_rows"] for x in rows) == 0 and all(x["remote_rows"] > 0 for x in rows), rows
