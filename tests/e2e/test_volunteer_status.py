"""The volunteer's own view (issue 13 item 5), with real processes: ``moe-swarm volunteer status``
asks the running daemon over its owner-only Unix socket and prints its slice, path, calls and
what it waits for; ``--json`` gives the same as data. The renderers are checked on their own too."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.conftest import eventually
from tests.e2e.test_process_e2e import (  # noqa: F401 - fixture
    UNVERIFIED,
    Proc,
    cli,
    procs,
    start_coordinator_on,
    start_market,
    wait_for_line,
)
from volunteer.status import SliceStatus, VolunteerStatus, plain_line, render_table

pytestmark = pytest.mark.slow

NAME = "desk [b]1"  # a display name that rich would read as markup if it were not shown as text


def status_cmd(data_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm.cli", "volunteer", "status", "--data-dir", str(data_dir), *extra],
                          capture_output=True, text=True, timeout=60)


async def serving(data_dir: Path, n: int, *, within: float = 90) -> VolunteerStatus:
    """The daemon's status once it serves ``n`` slices (read with ``volunteer status --json``)."""

    async def ready() -> VolunteerStatus | None:
        r = status_cmd(data_dir, "--json")
        st = msgspec.json.decode(r.stdout, type=VolunteerStatus) if r.returncode == 0 else None
        if st is None or len(st.slices) != n or any(s.state != "serving" for s in st.slices):
            return None
        return st

    st: VolunteerStatus = await eventually(ready, within=within, interval=0.5)
    return st


async def test_volunteer_status_reads_the_running_daemon(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    none = status_cmd(tmp_path / "nobody")
    assert none.returncode == 2 and "no volunteer answers" in none.stderr  # nothing running there: a clear error
    murl = await start_market(procs, tmp_path)
    curl = await start_coordinator_on(procs, tmp_path, murl, "--dispatch", "offload", *UNVERIFIED)
    vdir = tmp_path / "v"
    # progress on (the default), its output to a file: plain lines only (no \r, no escape sequence)
    vol = Proc(cli("volunteer", "--market", murl, "--max-experts", "16", "--data-dir", str(vdir), "--poll-interval", "0.5",
                   "--display-name", NAME), tmp_path / "volunteer.log")
    procs.append(vol)
    await wait_for_line(vol, "volunteer ready ")
    sock = vdir / "status.sock"
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600  # its owner only

    async def serving() -> Any:
        r = status_cmd(vdir, "--json")
        st = msgspec.json.decode(r.stdout, type=VolunteerStatus) if r.returncode == 0 else None
        return st if st is not None and st.slices and st.slices[0].state == "serving" and st.coordinators else None

    st = await eventually(serving, within=60, interval=0.5)
    async with httpx.AsyncClient(timeout=60) as h:

        async def proven() -> bool:  # a slice serves only once it passed the coordinator's hold challenge
            return bool((await h.get(f"{curl}/dispatch")).json()["hold_passes"] >= 1)

        await eventually(proven, within=60, interval=0.2)
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        await h.post(f"{curl}/v1/completions", json={"model": model_id, "prompt": "hello", "max_tokens": 8, "temperature": 0})

    async def computed() -> Any:
        s = msgspec.json.decode(status_cmd(vdir, "--json").stdout, type=VolunteerStatus)
        return s if s.calls > 0 and s.credit_flops else None  # its calls, and the market's credit for them

    st = await eventually(computed, within=60, interval=0.5)
    info = json.loads((vdir / "volunteer.json").read_text())
    assert st.peer_id == info["peer_id"] and st.path == "direct" and st.market == murl and st.rows > 0
    assert st.latency_ms > 0 and st.bytes_in > 0 and st.bytes_out > 0
    text = status_cmd(vdir)
    assert text.returncode == 0
    n = len(st.slices)
    for want in (info["peer_id"][-8:], st.slices[0].slice, "serving", "direct", "credit", NAME, f"{n} slice"):
        assert want in text.stdout, (want, text.stdout)
    assert st.display_name == NAME and st.held_bytes > 0 and st.downloads == []

    async def logged_status() -> str | None:  # the plain status line, every 5 s
        return next((line for line in vol.text().splitlines()
                     if line.startswith(f"[volunteer {NAME} (") and "| slices none" not in line), None)

    line = await eventually(logged_status, within=30, interval=0.5)
    assert f" slice{'s' if n > 1 else ''}, {st.held_bytes / 2**20:.1f} MiB" in line and "serving" in line, line
    log = vol.log.read_bytes()
    assert b"\r" not in log and b"\x1b" not in log, log[-2000:]
    file = st.slices[0].slice.replace(":", "-") + ".safetensors"
    assert f"[volunteer {NAME}] downloaded {file}".encode() in log, log[-2000:]  # one line per download


def test_the_renderers_show_what_a_volunteer_needs_to_know() -> None:
    from rich.console import Console

    st = VolunteerStatus(peer_id="12D3KooWabcdefghijklmnop", market="http://m.test", phase="serving",
                         waiting_for="serving 0:0-8 of m", market_reachable=False, reachability="private",
                         path="relayed", addrs=["/p2p-circuit"], slices=[SliceStatus("m", "0:0-8", "serving", 1)],
                         calls=12, calls_per_s=2.5, rows=48, errors=1, in_flight=2, payload_bytes=3 << 20,
                         latency_ms=4.25, bytes_in=5 << 20, bytes_out=6 << 20,
                         coordinators=["12D3KooWc"], credit_flops=1.5e12, credit_rac_flops_per_day=2e11, verified=7,
                         downloaded={"peer 12D3KooWa": 3 << 20, "peer 12D3KooWb": 1 << 20, "origin https://o/m.gguf": 2 << 20},
                         shared_bytes=5 << 19, held_bytes=24 << 20)
    line = plain_line(st)
    for want in ("serving 0:0-8 of m", "0:0-8:serving", "path relayed", "calls 12 (2.5/s, 4.2 ms)", "verified 7",
                 "1.5 TFLOP", "market unreachable"):
        assert want in line, (want, line)
    console = Console(record=True, width=120)
    console.print(render_table(st))
    out = console.export_text()
    for want in ("lmnop", "m 0:0-8 (serving)", "relayed (private)", "1 coordinator", "1 slice, 24.0 MiB held",
                 "requests in flight: 3.0 MiB", "5.0 MiB in",
                 "4.2 ms a call", "200.0 GFLOP a day", "2.0 MiB from origins, 4.0 MiB from peers; shared 2.5 MiB",
                 "market unreachable"):
        assert want in out, (want, out)


def control_cmd(data_dir: Path, action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm.cli", "volunteer", action, "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=60)


async def test_pause_and_resume_over_the_socket_reach_the_market_and_outlive_a_restart(
        procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    murl = await start_market(procs, tmp_path, "--heartbeat-ttl-s", "3")
    curl = await start_coordinator_on(procs, tmp_path, murl, "--dispatch", "offload", *UNVERIFIED)
    vdir = tmp_path / "v"
    # one listen port across the restart: py-libp2p 0.8.1 dials one TCP address of a peer, the first it
    # learnt, so a coordinator would not reach the restarted volunteer at a new port (reported separately)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = cli("volunteer", "--market", murl, "--max-experts", "16", "--data-dir", str(vdir), "--no-progress",
               "--poll-interval", "0.5", "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    vol = Proc(args, tmp_path / "volunteer.log")
    procs.append(vol)
    st = await serving(vdir, 2)
    async with httpx.AsyncClient(timeout=60) as h:
        async def market_says(paused: str, slice_state: str) -> bool:
            v = (await h.get(f"{murl}/api/volunteers/{st.peer_id}")).json()
            workers = [w for m in (await h.get(f"{murl}/api/moe/recruitment")).json()["models"] for w in m["workers"]
                       if w["peer_id"] == st.peer_id]
            return v.get("paused") == paused and len(workers) == 1 and workers[0]["paused"] == paused and \
                {s["state"] for s in workers[0]["slices"]} == {slice_state}

        await eventually(lambda: market_says("", "dispatched"), within=30, interval=0.2)
        paused = control_cmd(vdir, "pause")
        assert paused.returncode == 0 and "the volunteer is paused (manual)" in paused.stdout, paused
        await eventually(lambda: market_says("manual", "draining"), within=10, interval=0.1)
        assert (vdir / "paused").exists()
        # paused: its slices are out of the coordinator's map, so requests are served without it
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        before = msgspec.json.decode(status_cmd(vdir, "--json").stdout, type=VolunteerStatus).calls

        async def unmapped() -> bool:
            workers = (await h.get(f"{curl}/dispatch")).json()["workers"]
            return all(w["peer_id"] != st.peer_id for w in workers)

        await eventually(unmapped, within=10, interval=0.1)
        r = await h.post(f"{curl}/v1/completions", json={"model": model_id, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        assert msgspec.json.decode(status_cmd(vdir, "--json").stdout, type=VolunteerStatus).calls == before

        # stopped and started again: still paused (the owner said so), and the market hears it again
        vol.stop()
        vol2 = Proc(args, tmp_path / "volunteer2.log")
        procs.append(vol2)
        await wait_for_line(vol2, "volunteer ready ")

        async def restarted_paused() -> bool:  # it holds nothing yet (a restart releases), asks for nothing
            r = status_cmd(vdir, "--json")
            s = msgspec.json.decode(r.stdout, type=VolunteerStatus) if r.returncode == 0 else None
            v = (await h.get(f"{murl}/api/volunteers/{st.peer_id}")).json()
            return s is not None and s.paused == "manual" and not s.slices and v.get("paused") == "manual"

        await eventually(restarted_paused, within=30, interval=0.25)
        before = 0  # a new process: its counters start over

        resumed = control_cmd(vdir, "resume")
        assert resumed.returncode == 0 and "the volunteer is serving (not paused)" in resumed.stdout, resumed
        await eventually(lambda: market_says("", "dispatched"), within=15, interval=0.1)
        assert not (vdir / "paused").exists()

        async def computes_again() -> bool:  # the coordinator has it in its map again: calls reach it
            await h.post(f"{curl}/v1/completions", json={"model": model_id, "prompt": "hi", "max_tokens": 4})
            return msgspec.json.decode(status_cmd(vdir, "--json").stdout, type=VolunteerStatus).calls > before

        await eventually(computes_again, within=30, interval=0.5)
    bad = control_cmd(tmp_path / "nobody", "pause")
    assert bad.returncode == 2 and "no volunteer answers" in bad.stderr
