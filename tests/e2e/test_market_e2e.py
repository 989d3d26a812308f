"""The whole loop with real processes on loopback: market (SQLite) + coordinator + three pull-mode
volunteers. Load saturates the coordinator -> the market boosts the target -> an idle volunteer is
recruited and serves; tokens stay identical to all-local; the load stops -> it ages out.

Bounds stated here (measured ~3-8 s for recruitment and ~8 s for age-out on this 2-core machine, with the
market's saturation hysteresis: saturated after --rise-s 2 (the default) of saturated polls, unsaturated
after --hold-s 2 without one): recruited volunteer serving within 30 s of the first saturated poll;
released within 30 s of the load's end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import GOLDEN_GGUF, eventually
from tests.e2e.test_process_e2e import UNVERIFIED, Proc, cli, procs, wait_for_line, wait_for_text  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

RECRUIT_BOUND_S = 30.0
AGE_OUT_BOUND_S = 30.0


async def recruitment(h: httpx.AsyncClient, market: str) -> dict[str, Any]:
    model: dict[str, Any] = (await h.get(f"{market}/api/moe/recruitment")).json()["models"][0]
    return model


async def test_saturation_recruits_then_ages_out(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    mport, cport = 0, 0
    market = Proc(cli("market", "--db", str(tmp_path / "market.db"), "--port", str(mport), "--token", "t0k",
                      "--poll-interval", "0.5", "--hold-s", "2", "--cooldown-s", "2"), tmp_path / "market.log")
    procs.append(market)
    murl = (await wait_for_line(market, "market ready at ")).split()[3]
    coord = Proc(cli("coordinator", "--dispatch", "offload", *UNVERIFIED, "--model", str(GOLDEN_GGUF), "--port", str(cport), "--market", murl, "--token", "t0k",
                     "--data-dir", str(tmp_path / "c")), tmp_path / "coordinator.log")
    procs.append(coord)
    curl = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    async with httpx.AsyncClient(timeout=60) as h:
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        body: dict[str, Any] = {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 60, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}
        local = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]

        async def registered() -> bool:
            return (await h.get(f"{curl}/health")).json().get("market", {}).get("registered", False)

        await eventually(registered, within=20)
        for i in range(3):
            procs.append(Proc(cli("volunteer", "--market", murl, "--max-experts", "8", "--data-dir", str(tmp_path / f"v{i}"),
                                  "--no-progress", "--poll-interval", "1"), tmp_path / f"volunteer{i}.log"))
        # base target 1: two volunteers cover both layers, the third has nothing to do
        async def base_covered() -> bool:
            m = await recruitment(h, murl)
            return len(m["workers"]) == 2 and m["replicas_min"] >= 1

        await eventually(base_covered, within=60)
        base_workers = {w["peer_id"] for w in (await recruitment(h, murl))["workers"]}

        async def attached() -> bool:
            return len((await h.get(f"{curl}/dispatch")).json()["workers"]) == 2

        await eventually(attached, within=10)
        assert not (await recruitment(h, murl))["saturated"]

        # saturate: 3 concurrent streams on a threshold of 2
        stop = trio.Event()
        onset: float | None = None

        async def load() -> None:
            while not stop.is_set():
                await h.post(f"{curl}/v1/completions", json={**body, "max_tokens": 100, "return_token_ids": False})

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(load)

            async def saturated_now() -> bool:
                return bool((await recruitment(h, murl))["saturated_now"])

            await eventually(saturated_now, within=20)
            onset = time.monotonic()

            # the market's saturation signal follows once the polls said saturated for --rise-s (2 s, the
            # default): hysteresis, so the boost does not flap with the load
            async def saturated() -> bool:
                return bool((await recruitment(h, murl))["saturated"])

            await eventually(saturated, within=10)
            rise = time.monotonic() - onset

            async def new_worker_serving() -> str | None:
                rep = (await h.get(f"{curl}/dispatch")).json()
                for w in rep["workers"]:
                    if w["peer_id"] not in base_workers and w["last_serve_ms"] > 0:
                        return str(w["peer_id"])
                return None

            recruit = await eventually(new_worker_serving, within=RECRUIT_BOUND_S)
            recruited_after = time.monotonic() - onset
            m = await recruitment(h, murl)
            assert m["recruiting"] and m["effective_target"] == 2
            # tokens under load, with three volunteers serving, equal the all-local ones
            remote = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
            assert remote == local
            stop.set()
        print(f"saturated (after hysteresis) {rise:.1f} s and recruited volunteer serving {recruited_after:.1f} s "
              f"after the first saturated poll")

        # the load has ended: the extra volunteer is undispatched and released
        t_end = time.monotonic()

        async def aged_out() -> bool:
            m = await recruitment(h, murl)
            return all(w["peer_id"] != recruit for w in m["workers"]) and not m["recruiting"]

        await eventually(aged_out, within=AGE_OUT_BOUND_S)
        print(f"aged out {time.monotonic() - t_end:.1f} s after the load ended")

        async def detached() -> bool:
            rep = (await h.get(f"{curl}/dispatch")).json()
            return recruit not in {w["peer_id"] for w in rep["workers"]}

        await eventually(detached, within=5)
        after = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert after == local
        rec = await recruitment(h, murl)
        assert json.dumps(rec) and rec["effective_target"] == rec["base_target"] == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_market_outage_changes_nothing(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    """kill -9 of the market: the coordinator keeps its map, volunteers keep serving; the market
    restarted on the same database picks everything up again without restarting anyone."""
    port = _free_port()
    murl = f"http://127.0.0.1:{port}"
    margs = cli("market", "--db", str(tmp_path / "market.db"), "--port", str(port), "--token", "t0k", "--poll-interval", "0.5")
    market = Proc(margs, tmp_path / "market.log")
    procs.append(market)
    await wait_for_line(market, "market ready at ")
    coord = Proc(cli("coordinator", "--dispatch", "offload", *UNVERIFIED, "--model", str(GOLDEN_GGUF), "--port", "0", "--market", murl, "--token", "t0k",
                     "--data-dir", str(tmp_path / "c")), tmp_path / "coordinator.log")
    procs.append(coord)
    curl = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    async with httpx.AsyncClient(timeout=60) as h:
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        body: dict[str, Any] = {"model": model_id, "prompt": "Hello world", "max_tokens": 30, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}
        local = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        vols = []
        for i in range(2):
            v = Proc(cli("volunteer", "--market", murl, "--max-experts", "8", "--data-dir", str(tmp_path / f"v{i}"),
                         "--no-progress", "--poll-interval", "1"), tmp_path / f"volunteer{i}.log")
            procs.append(v)
            vols.append(v)

        async def two_attached() -> bool:
            return len((await h.get(f"{curl}/dispatch")).json()["workers"]) == 2

        await eventually(two_attached, within=60)
        version = (await h.get(f"{curl}/dispatch")).json()["map_version"]

        market.p.kill()  # kill -9
        market.p.wait()
        calls_before = sum(w["calls"] for w in (await h.get(f"{curl}/dispatch")).json()["workers"])
        for _ in range(2):
            out = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
            assert out == local
        rep = (await h.get(f"{curl}/dispatch")).json()
        assert rep["map_version"] == version and len(rep["workers"]) == 2
        assert sum(w["calls"] for w in rep["workers"]) > calls_before  # still served remotely
        rep_calls = sum(w["calls"] for w in rep["workers"])
        assert all(w["state"] == "up" for w in rep["workers"])
        for v in vols:  # each volunteer's heartbeats fail meanwhile (it says so once); it keeps serving
            await wait_for_text(v, "heartbeat to the market failed")
        assert all(v.p.poll() is None for v in vols)
        out = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert out == local
        assert sum(w["calls"] for w in (await h.get(f"{curl}/dispatch")).json()["workers"]) > rep_calls

        market2 = Proc(margs, tmp_path / "market2.log")
        procs.append(market2)
        await wait_for_line(market2, "market ready at ")

        async def recovered() -> bool:
            m = await recruitment(h, murl)
            return len(m["workers"]) == 2 and all(w["dispatched"] for w in m["workers"]) and m["replicas_min"] >= 1

        await eventually(recovered, within=30)

        async def coordinator_reconnected() -> bool:
            m = (await h.get(f"{curl}/health")).json()["market"]
            return bool(m["registered"] and not m["last_error"])

        await eventually(coordinator_reconnected, within=10, interval=0.5)
        rep = (await h.get(f"{curl}/dispatch")).json()
        assert len(rep["workers"]) == 2 and rep["map_version"] >= version
        out = (await h.post(f"{curl}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert out == local
        assert all(v.p.poll() is None for v in vols) and coord.p.poll() is None
