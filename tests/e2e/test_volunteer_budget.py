"""A volunteer fills its budget with several slices, and ``--max-memory`` is a peak-RSS budget
(issue 12 item 5), with real processes: one volunteer with room for two layers' experts ends up
serving one slice of each, the market lists both, and a completion runs on it with no expert
computed by the coordinator; a ``--max-memory`` below the process's own baseline is refused at
start with a clear error. The split itself (baseline, request reserve, slices) is checked on its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from swarm.errors import ConfigError
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
from tests.e2e.test_volunteer_status import serving
from volunteer.core.memory import MemoryPlan
from volunteer.daemon import rss_bytes


def test_the_memory_plan_leaves_the_slices_what_baseline_and_requests_do_not_take() -> None:
    mib = 1 << 20
    p = MemoryPlan.of(5 << 30, 300 * mib)
    assert (p.payload, p.slices) == (256 * mib, (5 << 30) - 300 * mib - 512 * mib)
    small = MemoryPlan.of(600 * mib, 300 * mib)
    assert small.payload == 37.5 * mib and small.slices == 600 * mib - 300 * mib - 75 * mib
    with pytest.raises(ConfigError, match="leaves nothing for slices"):
        MemoryPlan.of(320 * mib, 300 * mib)
    assert rss_bytes() > 10 * mib and rss_bytes("VmHWM") >= rss_bytes()


async def test_a_max_memory_below_the_baseline_is_refused_at_start(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    murl = await start_market(procs, tmp_path)  # the volunteer checks its market answers before anything else
    args = [sys.executable, "-m", "swarm.cli", "volunteer", "--market", murl, "--max-memory", "64M",
            "--data-dir", str(tmp_path / "v"), "--no-progress"]
    r = await trio.to_thread.run_sync(lambda: subprocess.run(args, capture_output=True, text=True, timeout=120))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "leaves nothing for slices" in r.stderr and "give at least" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
async def test_one_volunteer_serves_a_slice_of_every_layer_its_budget_holds(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    murl = await start_market(procs, tmp_path, "--remote-base-target", "1")
    curl = await start_coordinator_on(procs, tmp_path, murl, "--local-experts", "none", "--on-missing", "fail",
                                      *UNVERIFIED)
    vdir = tmp_path / "v"
    vol = Proc(cli("volunteer", "--market", murl, "--max-experts", "16", "--max-slices", "4", "--data-dir", str(vdir),
                   "--no-progress", "--poll-interval", "0.5"), tmp_path / "volunteer.log")
    procs.append(vol)
    await wait_for_line(vol, "volunteer ready ")

    st = await serving(vdir, 2)
    assert sorted(s.slice for s in st.slices) == ["0:0-8", "1:0-8"]  # the golden model: 2 layers x 8 experts
    async with httpx.AsyncClient(timeout=60) as h:
        credit = (await h.get(f"{murl}/api/volunteers/{st.peer_id}")).json()
        assert sorted(credit["slices"]) == ["0:0-8", "1:0-8"]

        async def dispatched() -> Any:
            health = (await h.get(f"{curl}/health")).json()
            return health if not health.get("coverage_holes") else None

        await eventually(dispatched, within=60, interval=0.5)
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]
        r = await h.post(f"{curl}/v1/completions", json={"model": model_id, "prompt": "hello", "max_tokens": 6,
                                                         "temperature": 0})
        assert r.status_code == 200, r.text
        d = (await h.get(f"{curl}/dispatch")).json()
    rows = d["layers"]
    assert sum(r["local_rows"] for r in rows) == 0 and all(r["remote_rows"] > 0 for r in rows), rows
