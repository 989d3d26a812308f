"""A coordinator that holds no expert (``--local-experts none``), with real processes on loopback:
market (SQLite), coordinator, three pull-mode volunteers. Two volunteers cover the model; the only
replica of one layer is killed (-9) in the middle of a streamed completion; the layer waits for
coverage (``--on-missing wait``), the market drops the dead volunteer after its heartbeat TTL and
assigns its slice to the idle one, which downloads it, passes the coordinator's hold challenge and
serves. The completion finishes with the all-local tokens (the stall is not asserted as a time)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from coordinator.dispatcher import Dispatcher
from coordinator.model import Transformer
from swarm.model.gguf import GGUFModel
from tests.conftest import GOLDEN_GGUF, eventually
from tests.e2e.test_process_e2e import Proc, cli, procs, stream_with_fault, wait_for_line  # noqa: F401 - fixture
from tests.integration.test_remote_experts import greedy

pytestmark = pytest.mark.slow


async def test_killing_the_only_replica_mid_generation_loses_no_token(
    procs: list[Proc], tmp_path: Path, golden: dict[str, Any]  # noqa: F811
) -> None:
    market = Proc(cli("market", "--db", str(tmp_path / "market.db"), "--port", "0", "--token", "t0k",
                      "--poll-interval", "0.5", "--remote-base-target", "1", "--heartbeat-ttl-s", "3"),
                  tmp_path / "market.log")
    procs.append(market)
    murl = (await wait_for_line(market, "market ready at ")).split()[3]
    coord = Proc(cli("coordinator", "--local-experts", "none", "--missing-wait", "60", "--model", str(GOLDEN_GGUF),
                     "--port", "0", "--market", murl, "--token", "t0k", "--data-dir", str(tmp_path / "c")),
                 tmp_path / "coordinator.log")
    procs.append(coord)
    curl = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    g = golden["greedy"][1]
    n = 48
    ref, _ = await greedy(Transformer(GGUFModel(GOLDEN_GGUF), Dispatcher(GGUFModel(GOLDEN_GGUF), None)), g["prompt_ids"], n)
    async with httpx.AsyncClient(timeout=120) as h:
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        vols = []
        for i in range(3):
            v = Proc(cli("volunteer", "--market", murl, "--max-experts", "8", "--data-dir", str(tmp_path / f"v{i}"),
                         "--no-progress", "--poll-interval", "0.5"), tmp_path / f"volunteer{i}.log")
            procs.append(v)
            vols.append(v)
            await wait_for_line(v, "volunteer ready ")

        async def covered() -> bool:  # both layers served by proved volunteers, the third idle
            rep = (await h.get(f"{curl}/dispatch")).json()
            return rep["holes"] == 0 and rep["hold_passes"] >= 2

        await eventually(covered, within=60)
        rep = (await h.get(f"{curl}/dispatch")).json()
        serving = {w["peer_id"] for w in rep["workers"]}
        assert len(serving) == 2
        body = {"model": model_id, "prompt": g["prompt_ids"], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        victim = next(v for v in vols if _peer(v) in serving)

        async def kill_it() -> None:
            victim.p.send_signal(signal.SIGKILL)

        async with httpx.AsyncClient(base_url=curl, timeout=120) as hc:
            tokens, killed_at = await stream_with_fault(hc, body, after_tokens=8, fault=kill_it)
        assert killed_at is not None and killed_at < n
        assert tokens == ref  # no token lost, duplicated or changed
        rep = (await h.get(f"{curl}/dispatch")).json()
        assert rep["missing_waits"] >= 1 and rep["missing_failed"] == 0 and rep["holes"] == 0
        now_serving = {w["peer_id"] for w in rep["workers"] if w["state"] == "up"}
        assert _peer(victim) not in now_serving and len(now_serving) == 2  # the idle volunteer took its place
        assert all(L["local_rows"] == 0 and L["fallback_rows"] == 0 for L in rep["layers"])  # nothing computed here
    await trio.lowlevel.checkpoint()


def _peer(v: Proc) -> str:
    for line in v.text().splitlines():
        if "volunteer ready peer_id=" in line:
            return line.split("peer_id=")[1].split()[0]
    raise AssertionError("no peer id in the volunteer's log")
