"""The market's ``/dashboard`` in a real headless Chromium (Debian's, driven through its ChromeDriver),
during a live scenario with real processes: market (SQLite), coordinator, three pull volunteers and a
load ramp. The heatmap shows the coverage ``/api/expert-demand`` reports; the recruitment badge turns
on under load and off after it; a volunteer's chosen name ``<script>...`` is shown as text, never run;
a killed volunteer's cells turn into a hole; the browser logs no error. Screenshots go to
``test-artifacts/``."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import eventually
from tests.e2e.test_process_e2e import (  # noqa: F401 - fixture
    UNVERIFIED,
    Proc,
    cli,
    procs,
    start_coordinator_on,
    start_market,
)

pytestmark = pytest.mark.slow

ARTIFACTS = Path("test-artifacts")
EVIL = "<script>document.title='pwned'</script><b>x</b>"


def _browser_missing() -> str | None:
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"`{exe}` is not installed (apt-get install -y chromium chromium-driver; .ci/run does)"
    return None


class Page:
    """A headless Chromium on one page (blocking calls: run them in a thread)."""

    def __init__(self, url: str, user_data: Path) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or "chromium"
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", "--window-size=1400,1000", f"--user-data-dir={user_data}"):
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)
        self.driver.get(url)

    def cells(self) -> dict[tuple[int, int], tuple[int, int]]:
        rows = self.driver.execute_script(
            "return [...document.querySelectorAll('td.cell')].map(c => [+c.dataset.layer, +c.dataset.expert, "
            "+c.dataset.replicas, +c.dataset.target])")
        return {(r[0], r[1]): (r[2], r[3]) for r in rows}

    def recruiting(self, model_id: str) -> str | None:
        got = self.driver.execute_script(
            "const e = document.getElementById(arguments[0]); return e ? e.dataset.recruiting : null", f"recruiting-{model_id}")
        return got if isinstance(got, str) else None

    def names(self) -> list[str]:
        got = self.driver.execute_script(
            "return [...document.querySelectorAll('#volunteers tbody tr')].map(r => r.children[1].textContent)")
        return list(got)

    def leaderboard(self) -> list[str]:
        got = self.driver.execute_script(
            "return [...document.querySelectorAll('#leaderboard tbody tr')].map(r => r.dataset.peer)")
        return list(got)

    def first_sample_ms(self, model_id: str) -> float | None:
        got = self.driver.execute_script(
            "const s = series[arguments[0]]; return s && s.length ? Math.min(...s.map(p => p.t)) : null", model_id)
        return float(got) if got is not None else None

    def title(self) -> str:
        return str(self.driver.title)

    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        self.driver.save_screenshot(str(ARTIFACTS / f"dashboard-{name}.png"))

    def close(self) -> None:
        self.driver.quit()


def coverage_from_demand(demand: dict[str, Any]) -> dict[tuple[int, int], tuple[int, int]]:
    return {(s["layer"], e): (s["replicas"], s["target"]) for s in demand["segments"] for e in range(s["lo"], s["hi"])}


async def test_the_dashboard_follows_the_network_in_a_real_browser(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    why = _browser_missing()
    if why is not None:
        pytest.skip(why)
    murl = await start_market(procs, tmp_path, "--hold-s", "2", "--cooldown-s", "2", "--heartbeat-ttl-s", "3")
    curl = await start_coordinator_on(procs, tmp_path, murl, "--dispatch", "offload", *UNVERIFIED)
    vols = []
    for i in range(3):
        name = EVIL if i == 0 else f"vol-{i}"
        v = Proc(cli("volunteer", "--market", murl, "--max-experts", "8", "--data-dir", str(tmp_path / f"v{i}"),
                     "--no-progress", "--poll-interval", "0.5", "--display-name", name), tmp_path / f"volunteer{i}.log")
        procs.append(v)
        vols.append(v)
    async with httpx.AsyncClient(timeout=60) as h:
        model_id = (await h.get(f"{curl}/v1/models")).json()["data"][0]["id"]

        async def recruitment() -> dict[str, Any]:
            m: dict[str, Any] = (await h.get(f"{murl}/api/moe/recruitment")).json()["models"][0]
            return m

        async def demand() -> dict[str, Any]:
            d: dict[str, Any] = (await h.get(f"{murl}/api/expert-demand")).json()["models"][0]
            return d

        async def covered() -> bool:
            m = await recruitment()
            return len(m["workers"]) == 2 and m["replicas_min"] >= 1

        await eventually(covered, within=60)
        opened_ms = time.time() * 1000
        page = await trio.to_thread.run_sync(Page, f"{murl}/dashboard", tmp_path / "chrome")
        try:
            async def heatmap_matches() -> bool:
                want = coverage_from_demand(await demand())
                return await trio.to_thread.run_sync(page.cells) == want

            await eventually(heatmap_matches, within=20, interval=0.25)
            assert len(await trio.to_thread.run_sync(page.cells)) == 16  # 2 layers x 8 experts
            assert len(await trio.to_thread.run_sync(page.names)) == 2  # the two serving volunteers
            # the charts start from the market's own history (/api/history), not from the page's first poll
            first = await trio.to_thread.run_sync(page.first_sample_ms, model_id)
            assert first is not None and first < opened_ms - 1000, (first, opened_ms)
            await trio.to_thread.run_sync(page.shot, "covered")

            # a load ramp: the coordinator saturates, the market recruits, the badge turns on
            body = {"model": model_id, "prompt": "load", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            stop = trio.Event()

            async def stream() -> None:
                while not stop.is_set():
                    await h.post(f"{curl}/v1/completions", json=body)

            async def badge(value: str) -> bool:
                return await trio.to_thread.run_sync(page.recruiting, model_id) == value

            async with trio.open_nursery() as n:
                for _ in range(3):
                    n.start_soon(stream)
                await eventually(lambda: badge("true"), within=30, interval=0.25)

                # boosted, all three volunteers serve: the stranger's name is on the page as text and ran nothing
                async def named() -> bool:
                    return EVIL in await trio.to_thread.run_sync(page.names)

                await eventually(named, within=30)
                assert await trio.to_thread.run_sync(page.title) == "moe-swarm market"
                await trio.to_thread.run_sync(page.shot, "recruiting")
                stop.set()
            await eventually(lambda: badge("false"), within=30, interval=0.25)

            # the volunteers that computed under load have credit (coordinator reports): the leaderboard lists them
            async def ranked() -> bool:
                return len(await trio.to_thread.run_sync(page.leaderboard)) >= 2

            await eventually(ranked, within=30, interval=0.5)

            # stop the idle one for good, then kill a serving volunteer: its cells become a hole
            m = await recruitment()
            serving = {w["peer_id"] for w in m["workers"] if w["dispatched"]}
            ids = [json.loads((tmp_path / f"v{i}" / "volunteer.json").read_text())["peer_id"] for i in range(3)]
            for v, pid in zip(vols, ids, strict=True):
                if pid not in serving:
                    v.stop()
            victim_id = sorted(serving)[0]
            victim = vols[ids.index(victim_id)]
            [layer] = {s["layer"] for w in m["workers"] if w["peer_id"] == victim_id for s in w["slices"]}
            victim.p.send_signal(signal.SIGKILL)

            async def hole() -> bool:
                cells = await trio.to_thread.run_sync(page.cells)
                return all(cells.get((layer, e), (1, 1))[0] == 0 for e in range(8))

            await eventually(hole, within=30, interval=0.25)
            await trio.to_thread.run_sync(page.shot, "hole")
            assert await trio.to_thread.run_sync(page.errors) == []
        finally:
            await trio.to_thread.run_sync(page.close)
