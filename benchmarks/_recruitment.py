"""Recruitment reaction and age-out times in the demo topology (used by ``benchmarks/market.py``).

Real processes on loopback, as in ``make demo``: a market (SQLite; /slots polled every 0.5 s,
hold 2 s, cooldown 2 s), a coordinator on the tiny golden model, three pull-mode volunteers with
8-expert budgets (base target 1 needs two of them). Each round:

- reaction: 3 concurrent streams saturate the coordinator (threshold 2); the clock starts when the
  market first reports ``saturated`` and stops when the coordinator's ``/dispatch`` shows a
  worker outside the base set with ``last_serve_ms > 0``;
- age-out: the streams stop; the clock starts at the end of the last request and stops when that
  worker has left the market's recruitment view (undispatched, then released after the cooldown).
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "tests" / "fixtures" / "golden" / "qwen3moe-tiny-f32.gguf"
T = TypeVar("T")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = fn()
        except httpx.HTTPError:
            v = None
        if v:
            return v
        time.sleep(interval)
    raise RuntimeError(f"timed out waiting for {what}")


def measure_recruitment(rounds: int = 2) -> list[dict[str, Any]]:
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory(prefix="moe-swarm-bench-recruit-")
    d = Path(tmp.name)

    def start(name: str, *args: str) -> None:
        log = open(d / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen([sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", *args],
                                      stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))

    reactions: list[float] = []
    ageouts: list[float] = []
    try:
        mport, cport = _port(), _port()
        market, coord = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{cport}"
        start("market", "market", "--db", str(d / "market.db"), "--port", str(mport), "--token", "b",
              "--poll-interval", "0.5", "--hold-s", "2", "--cooldown-s", "2")
        _wait(lambda: httpx.get(market + "/health").status_code == 200, 60, "market")
        start("coordinator", "coordinator", "--model", str(GGUF), "--port", str(cport), "--market", market, "--token", "b",
              "--data-dir", str(d / "c"))
        _wait(lambda: httpx.get(coord + "/health").json().get("market", {}).get("registered"), 60, "coordinator")
        model_id = httpx.get(coord + "/v1/models").json()["data"][0]["id"]
        for i in range(3):
            start(f"v{i}", "volunteer", "--market", market, "--max-experts", "8", "--data-dir", str(d / f"v{i}"),
                  "--no-progress", "--poll-interval", "1")

        def rec() -> dict[str, Any]:
            m: dict[str, Any] = httpx.get(market + "/api/moe/recruitment", timeout=5).json()["models"][0]
            return m

        _wait(lambda: len(rec()["workers"]) == 2 and len(httpx.get(coord + "/dispatch").json()["workers"]) == 2,
              120, "base coverage")
        base = {w["peer_id"] for w in rec()["workers"]}
        body = {"model": model_id, "prompt": "load", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        for _ in range(rounds):
            stop = threading.Event()
            ended: list[float] = []

            def load(stop: threading.Event = stop, ended: list[float] = ended) -> None:
                with httpx.Client(timeout=60) as c:
                    while not stop.is_set():
                        c.post(coord + "/v1/completions", json=body)
                ended.append(time.monotonic())

            threads = [threading.Thread(target=load) for _ in range(3)]
            for t in threads:
                t.start()
            _wait(lambda: rec()["saturated"], 30, "saturation", 0.05)
            onset = time.monotonic()

            def new_serving(base: set[str] = base) -> str | None:
                for w in httpx.get(coord + "/dispatch", timeout=5).json()["workers"]:
                    if w["peer_id"] not in base and w["last_serve_ms"] > 0:
                        return str(w["peer_id"])
                return None

            recruit = _wait(new_serving, 60, "a recruited worker serving", 0.05)
            reactions.append(time.monotonic() - onset)
            stop.set()
            for t in threads:
                t.join()
            end = max(ended)
            _wait(lambda recruit=recruit: all(w["peer_id"] != recruit for w in rec()["workers"]) and not rec()["recruiting"],
                  60, "age-out", 0.05)
            ageouts.append(time.monotonic() - end)
            _wait(lambda: len(rec()["workers"]) == 2, 30, "back to base")
            base = {w["peer_id"] for w in rec()["workers"]}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        tmp.cleanup()

    def case(name: str, xs: list[float]) -> dict[str, Any]:
        return {"case": name, "rounds": len(xs), "median_ms": round(statistics.median(xs) * 1000, 1),
                "max_ms": round(max(xs) * 1000, 1)}

    return [case("recruitment_reaction", reactions), case("age_out", ageouts)]
