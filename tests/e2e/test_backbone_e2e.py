"""A coordinator that holds no expert (``--local-experts none``), with real processes on loopback:
market (SQLite), coordinator, three pull-mode volunteers. Two volunteers cover the model; the only
replica of one layer is killed (-9) in the middle of a streamed completion; the layer waits for
coverage (``--on-missing wait``), the market drops the dead volunteer after its heartbeat TTL and
assigns its slice to the idle one, which downloads it from the origin mirror the coordinator names
(``--origin``: a plain HTTP server with the GGUF, read with Range requests), passes the coordinator's
hold challenge and serves. The completion finishes with the all-local tokens (the stall is measured
in ``benchmarks/capacity.py``, not asserted as a time here).

A second test: a volunteer that joins later downloads its slices from the one already serving them
(``/moe-swarm/slice/1``), not from the coordinator; one started with ``--no-share`` is no source."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.engine.model import Transformer
from swarm.model.gguf import GGUFModel
from tests.conftest import GOLDEN_GGUF, eventually
from tests.e2e.test_process_e2e import Proc, cli, procs, stream_with_fault, wait_for_line  # noqa: F401 - fixture
from tests.integration.support import greedy
from tests.integration.test_slice_download import file_app, serve_app

pytestmark = pytest.mark.slow


def _info(*args: str) -> list[str]:
    return cli("--log-level", "INFO", *args)  # the volunteer logs where each download came from at INFO


async def test_killing_the_only_replica_mid_generation_loses_no_token(
    procs: list[Proc], tmp_path: Path, golden: dict[str, Any], nursery: trio.Nursery  # noqa: F811
) -> None:
    origin = await serve_app(nursery, file_app(GOLDEN_GGUF))
    market = Proc(cli("market", "--db", str(tmp_path / "market.db"), "--port", "0", "--token", "t0k",
                      "--poll-interval", "0.5", "--remote-base-target", "1", "--heartbeat-ttl-s", "3"),
                  tmp_path / "market.log")
    procs.append(market)
    murl = (await wait_for_line(market, "market ready at ")).split()[3]
    coord = Proc(cli("coordinator", "--local-experts", "none", "--missing-wait", "60", "--model", str(GOLDEN_GGUF),
                     "--port", "0", "--market", murl, "--token", "t0k", "--data-dir", str(tmp_path / "c"),
                     "--origin", f"{origin}/models/m.gguf"), tmp_path / "coordinator.log")
    procs.append(coord)
    curl = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    g = golden["greedy"][1]
    n = 48
    ref, _ = await greedy(Transformer(GGUFModel(GOLDEN_GGUF), Dispatcher(GGUFModel(GOLDEN_GGUF), None)), g["prompt_ids"], n)
    async with httpx.AsyncClient(timeout=120) as h:
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        vols = []
        for i in range(3):
            v = Proc(_info("volunteer", "--market", murl, "--max-experts", "8", "--data-dir", str(tmp_path / f"v{i}"),
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
    heir = next(v for v in vols if _peer(v) in now_serving and _peer(v) not in serving)
    # the dead replica is no source and no other volunteer held the slice: it came from the origin mirror
    assert "from origin" in heir.text() and "from coordinator" not in heir.text(), heir.text()[-3000:]
    await trio.lowlevel.checkpoint()


async def test_a_volunteer_that_joins_later_downloads_from_the_one_serving(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    market = Proc(cli("market", "--db", str(tmp_path / "market.db"), "--port", "0", "--token", "t0k",
                      "--poll-interval", "0.5", "--remote-base-target", "2"), tmp_path / "market.log")
    procs.append(market)
    murl = (await wait_for_line(market, "market ready at ")).split()[3]
    coord = Proc(cli("coordinator", "--local-experts", "none", "--model", str(GOLDEN_GGUF), "--port", "0",
                     "--market", murl, "--token", "t0k", "--data-dir", str(tmp_path / "c")), tmp_path / "coordinator.log")
    procs.append(coord)
    curl = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]

    def volunteer(name: str, *extra: str) -> Proc:
        v = Proc(_info("volunteer", "--market", murl, "--max-experts", "16", "--data-dir", str(tmp_path / name),
                       "--no-progress", "--poll-interval", "0.5", *extra), tmp_path / f"{name}.log")
        procs.append(v)
        return v

    first = volunteer("first", "--no-share")
    await wait_for_line(first, "volunteer ready ")
    async with httpx.AsyncClient(timeout=60) as h:
        async def holds(n: int) -> bool:
            return (await h.get(f"{curl}/dispatch")).json()["hold_passes"] >= n

        await eventually(lambda: holds(2), within=60)  # both layers, from the coordinator
        second = volunteer("second")
        await wait_for_line(second, "volunteer ready ")
        await eventually(lambda: holds(4), within=60)
        # ``first`` opted out: ``second`` got nothing from it, so it fetched from the coordinator too
        assert "from peer" not in second.text() and second.text().count("from coordinator") == 2, second.text()[-3000:]
        first.p.send_signal(signal.SIGKILL)  # the second replica goes: the market recruits a third volunteer
        third = volunteer("third")
        await wait_for_line(third, "volunteer ready ")
        await eventually(lambda: holds(6), within=90)
    text = third.text()
    assert text.count("from peer") == 2 and "from coordinator" not in text, text[-3000:]  # both slices, from ``second``
    assert _peer(second) in text


def _peer(v: Proc) -> str:
    for line in v.text().splitlines():
        if "volunteer ready peer_id=" in line:
            return line.split("peer_id=")[1].split()[0]
    raise AssertionError("no peer id in the volunteer's log")
