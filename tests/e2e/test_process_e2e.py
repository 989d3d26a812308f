"""Real processes on loopback: a coordinator and a volunteer started from the command line;
``kill -9`` of the volunteer mid-generation leaves the output unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel

from swarm.model.gguf import model_id_for
from tests.conftest import GOLDEN_GGUF, eventually

pytestmark = pytest.mark.slow


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", *args]


# offload tests check the remote path itself, every answer used: verification (which computes sampled
# ranges here too and uses the coordinator's result) has its own tests
UNVERIFIED = ["--verify-rate", "0", "--verify-probation", "0"]


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self.fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(args, stdout=self.fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.fh.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """The test's processes, stopped at its end; their logs' tails go to the captured output, which
    pytest shows when the test fails (a process that died on its own says so first)."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        died = p.p.poll()
        p.stop()
        tail = "\n".join(p.text().splitlines()[-60:])
        print(f"--- {p.log.name} ({'exited ' + str(died) + ' before the end' if died is not None else 'stopped'}):\n{tail}")


async def wait_for_line(proc: Proc, prefix: str, within: float = 60) -> str:
    async def found() -> str | None:
        if proc.p.poll() is not None:
            raise AssertionError(f"process exited {proc.p.returncode}:\n{proc.text()}")
        for line in proc.text().splitlines():
            if line.startswith(prefix):
                return line
        return None

    line: str = await eventually(found, within=within, interval=0.05)
    return line


async def wait_for_text(proc: Proc, text: str, within: float = 60) -> str:
    """The first line of ``proc``'s output containing ``text`` (log lines start with a timestamp)."""

    async def found() -> str | None:
        if proc.p.poll() is not None:
            raise AssertionError(f"process exited {proc.p.returncode}:\n{proc.text()}")
        return next((line for line in proc.text().splitlines() if text in line), None)

    line: str = await eventually(found, within=within, interval=0.05)
    return line


async def start_market(procs: list[Proc], tmp_path: Path, *extra: str) -> str:
    """A market process (SQLite in ``tmp_path``, token ``t0k``, /slots polled every 0.5 s); its URL."""
    market = Proc(cli("market", "--db", str(tmp_path / "market.db"), "--port", "0", "--token", "t0k",
                      "--poll-interval", "0.5", *extra), tmp_path / "market.log")
    procs.append(market)
    return (await wait_for_line(market, "market ready at ")).split()[3]


async def start_coordinator_on(procs: list[Proc], tmp_path: Path, market_url: str, *extra: str,
                               model: Path = GOLDEN_GGUF) -> str:
    """A coordinator process on ``model`` (the golden one) registered with ``market_url``; its URL."""
    coord = Proc(cli("coordinator", *extra, "--model", str(model), "--port", "0", "--market", market_url,
                     "--token", "t0k", "--data-dir", str(tmp_path / "c")), tmp_path / "coordinator.log")
    procs.append(coord)
    return (await wait_for_line(coord, "coordinator ready at ")).split()[-1]


async def start_static_volunteer(procs: list[Proc], tmp_path: Path, coordinator_url: str) -> dict[str, Any]:
    """A static volunteer process serving both layers' experts to ``coordinator_url``; its volunteer.json."""
    vol = Proc(cli("volunteer", "--coordinator", coordinator_url, "--slice", "0:0-8", "--slice", "1:0-8",
                   "--data-dir", str(tmp_path / "v"), "--no-progress"), tmp_path / "volunteer.log")
    procs.append(vol)
    await wait_for_line(vol, "volunteer ready ")
    info: dict[str, Any] = json.loads((tmp_path / "v" / "volunteer.json").read_text())
    return info


async def attach_single_worker(h: httpx.AsyncClient, map_path: Path, model_id: str, info: dict[str, Any]) -> None:
    """Write a dispatch map giving every expert of both layers to one volunteer; wait until /dispatch
    lists it with both holdings challenged (a replica serves once it has proved it holds its range)."""
    layers = [{"layer": L, "ranges": [{"lo": 0, "hi": 8, "replicas": [{"peer_id": info["peer_id"], "addrs": info["addrs"]}]}]}
              for L in (0, 1)]
    await trio.Path(map_path).write_text(json.dumps({"model_id": model_id, "version": 1, "layers": layers}))

    async def attached() -> bool:
        workers = (await h.get("/dispatch")).json()["workers"]
        return len(workers) == 1 and workers[0]["holdings_pending"] == 0

    await eventually(attached)


async def stream_with_fault(
    h: httpx.AsyncClient, body: dict[str, Any], *, after_tokens: int, fault: Callable[[], Awaitable[None]]
) -> tuple[list[int], int | None]:
    """Stream a completion and inject ``fault`` once ``after_tokens`` tokens have arrived; returns all
    streamed token ids and how many had arrived when the fault was injected."""
    tokens: list[int] = []
    fault_at = None
    async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens.extend(json.loads(line[6:])["choices"][0].get("token_ids", []))
            if fault_at is None and len(tokens) >= after_tokens:
                await fault()
                fault_at = len(tokens)
    return tokens, fault_at


async def test_kill_9_volunteer_mid_generation(procs: list[Proc], tmp_path: Path) -> None:
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps({"model_id": model_id_for(GOLDEN_GGUF), "version": 0, "layers": []}))
    coord = Proc(cli("coordinator", "--dispatch", "offload", *UNVERIFIED, "--model", str(GOLDEN_GGUF), "--port", "0", "--data-dir", str(tmp_path / "c"),
                     "--expert-timeout", "1.0", "--dispatch-map", str(map_path)), tmp_path / "coordinator.log")
    procs.append(coord)
    url = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        model_id = (await h.get("/v1/models")).json()["data"][0]["id"]
        body: dict[str, Any] = {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}
        local = (await h.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert len(local) == 200

        vol = Proc(cli("volunteer", "--coordinator", url, "--slice", "0:0-8", "--slice", "1:0-8",
                       "--data-dir", str(tmp_path / "v"), "--no-progress"), tmp_path / "volunteer.log")
        procs.append(vol)
        await wait_for_line(vol, "volunteer ready ")
        info = json.loads((tmp_path / "v" / "volunteer.json").read_text())
        await attach_single_worker(h, map_path, model_id, info)

        async def kill_it() -> None:
            rep = (await h.get("/dispatch")).json()["workers"][0]
            assert rep["calls"] > 0 and rep["last_serve_ms"] > 0  # it really served before dying
            vol.p.send_signal(signal.SIGKILL)

        tokens, killed_at = await stream_with_fault(h, body, after_tokens=20, fault=kill_it)
        assert killed_at is not None and killed_at < 200
        assert tokens == local  # no token lost, duplicated or changed
        [w] = (await h.get("/dispatch")).json()["workers"]
        assert w["state"] == "down" and w["failures"] >= 1
        assert sum(L["fallback_rows"] + L["local_rows"] for L in (await h.get("/dispatch")).json()["layers"]) > 0
    await trio.lowlevel.checkpoint()
