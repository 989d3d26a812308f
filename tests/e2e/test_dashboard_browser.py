"""The market's ``/dashboard`` in a real headless Chromium (Debian's, driven through its ChromeDriver).

1. A live scenario with real processes: market (SQLite), coordinator, three pull volunteers (display names
   given) and a load ramp. The heatmap (a canvas) draws the coverage ``/api/expert-demand`` reports, read
   back from its pixels; its axes and the charts' axes are there with their units; hovering a cell or a
   chart with the real mouse shows the values; the recruitment badge turns on under load and off after
   it; volunteers are listed by name with what they do; a volunteer's chosen name ``<script>...`` is shown
   as text, never run; a killed volunteer's cells turn into a hole; the browser logs no error.
2. The shape of Qwen3-30B-A3B, 48 layers x 128 experts (a market with that model registered, a stand-in
   coordinator answering ``/slots`` and slice ``HEAD``s, volunteers speaking the signed market API over
   HTTP): the heatmap stays legible (cells of at least 6 px, in the window) and right cell for cell;
   hover names the layer, expert, replicas and holders; a download shows its progress; no volunteer
   address reaches the page; stranger text is cut and escaped; the event log collapses repeats.
Screenshots go to ``test-artifacts/``."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from swarm.p2p.identity import SIGNATURE_HEADER, peer_id_of, sign_body, sign_request
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import CoverageHeartbeat, DownloadProgress, HeldSlice, HeldState
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
EVIL_IMG = "<img src=x onerror=\"document.title='pwned'\">" + "z" * 20  # 60 characters: cut to 32 on the page


def _browser_missing() -> str | None:
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"`{exe}` is not installed (apt-get install -y chromium chromium-driver; .ci/run does)"
    return None


def category(replicas: int, target: int) -> str:
    """The heatmap's colour classes (the page's ``category``)."""
    if target <= 0 and replicas <= 0:
        return "none"
    if replicas <= 0:
        return "hole"
    if replicas < target:
        return "below"
    return "above" if replicas > target else "at"


class Page:
    """A headless Chromium on one page (blocking calls: run them in a thread)."""

    def __init__(self, url: str, user_data: Path, size: str = "1400,1000") -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or "chromium"
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", f"--window-size={size}", f"--user-data-dir={user_data}"):
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)
        self.driver.get(url)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def grid(self, model_id: str) -> dict[tuple[int, int], tuple[int, int]]:
        """What the heatmap drew, cell by cell: (replicas, target)."""
        rows = self.js("return window.dashboardGrid(arguments[0])", model_id) or []
        return {(r[0], r[1]): (r[2], r[3]) for r in rows}

    def pixels(self, model_id: str) -> dict[tuple[int, int], str]:
        """The colour class of every cell, read back from the canvas's pixels."""
        rows = self.js("return window.dashboardPixels(arguments[0])", model_id) or []
        return {(r[0], r[1]): r[2] for r in rows}

    def canvas(self, model_id: str) -> dict[str, Any]:
        got: dict[str, Any] = self.js(
            "const c = document.querySelector(`canvas.heatmap[data-model='${arguments[0]}']`); if (!c) return null;"
            "const r = c.getBoundingClientRect();"
            "return {...c.dataset, width: r.width, height: r.height, right: r.right, vw: window.innerWidth}", model_id)
        return got

    def heat_ticks(self, model_id: str) -> dict[str, list[tuple[int, float]]]:
        got: dict[str, list[tuple[int, float]]] = self.js(
            "const s = document.querySelector(`svg.heat-axes[data-model='${arguments[0]}']`);"
            "const t = c => [...s.querySelectorAll('text.' + c)].map(e => [+e.textContent, +e.getAttribute(c === 'xtick' ? 'x' : 'y')]);"
            "return {x: t('xtick'), y: t('ytick'), titles: [...s.querySelectorAll('.xtitle, .ytitle')].map(e => e.textContent)}",
            model_id)
        return got

    def chart_axes(self, model_id: str) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = self.js(
            "return [...document.querySelectorAll(`section[data-model='${arguments[0]}'] .chart`)].map(c => ({"
            "unit: c.dataset.unit, title: c.querySelector('.title').textContent,"
            "x: [...c.querySelectorAll('text.xtick')].map(e => e.textContent),"
            "y: [...c.querySelectorAll('text.ytick')].map(e => +e.textContent),"
            "yunit: c.querySelector('text.yunit').textContent}))", model_id)
        return got

    def hover_cell(self, model_id: str, layer: int, expert: int) -> list[str]:
        """Move the real mouse over a heatmap cell; the tooltip's lines."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By

        c = self.driver.find_element(By.CSS_SELECTOR, f"canvas.heatmap[data-model='{model_id}']")
        d = self.canvas(model_id)
        x = float(d["x0"]) + (expert + 0.5) * float(d["cellW"]) - d["width"] / 2  # offsets from the element's centre
        y = float(d["y0"]) + (layer + 0.5) * float(d["cellH"]) - d["height"] / 2
        ActionChains(self.driver).move_to_element_with_offset(c, round(x), round(y)).perform()
        return self.tip()

    def hover_chart_end(self, model_id: str, index: int) -> list[str]:
        """Move the real mouse to the right end (now) of a chart's plot; the tooltip's lines."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By

        charts = self.driver.find_elements(By.CSS_SELECTOR, f"section[data-model='{model_id}'] .chart svg")
        w = float(charts[index].get_attribute("width") or 0)
        ActionChains(self.driver).move_to_element_with_offset(charts[index], round(w / 2 - 12), 0).perform()
        return self.tip()

    def tip(self) -> list[str]:
        got = self.js("const t = document.getElementById('tip'); return t.hidden ? [] : [...t.children].map(d => d.textContent)")
        return list(got)

    def unhover(self) -> None:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By

        ActionChains(self.driver).move_to_element(self.driver.find_element(By.TAG_NAME, "h1")).perform()

    def recruiting(self, model_id: str) -> str | None:
        got = self.js("const e = document.getElementById(arguments[0]); return e ? e.dataset.recruiting : null",
                      f"recruiting-{model_id}")
        return got if isinstance(got, str) else None

    def volunteers(self) -> list[dict[str, str]]:
        got: list[dict[str, str]] = self.js(
            "return [...document.querySelectorAll('#volunteers tbody tr')].map(r => Object.fromEntries("
            "[...r.children].map(td => [td.dataset.col, td.textContent]).concat([['peer_id', r.dataset.peer], "
            "['title', r.querySelector('td[data-col=name]').title]])))")
        return got

    def names(self) -> list[str]:
        return [v["name"] for v in self.volunteers()]

    def leaderboard(self) -> list[str]:
        got = self.js("return [...document.querySelectorAll('#leaderboard tbody tr')].map(r => r.dataset.peer)")
        return list(got)

    def events(self) -> list[str]:
        return list(self.js("return [...document.querySelectorAll('#events div')].map(d => d.textContent)"))

    def first_sample_ms(self, model_id: str) -> float | None:
        got = self.js("const s = series[arguments[0]]; return s && s.length ? Math.min(...s.map(p => p.t)) : null", model_id)
        return float(got) if got is not None else None

    def text(self) -> str:
        return str(self.js("return document.body.innerText"))

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


def check_chart_axes(axes: list[dict[str, Any]]) -> None:
    """Three charts, each with a time axis of 15 minutes and a value axis in its unit, from 0 upwards."""
    assert [a["unit"] for a in axes] == ["slots", "replicas", "tokens/s"]
    assert [a["yunit"] for a in axes] == ["slots", "replicas", "tokens/s"]
    for a in axes:
        assert a["x"] == ["-15 min", "-10 min", "-5 min", "now"]
        assert a["y"][0] == 0 and len(a["y"]) >= 2 and a["y"] == sorted(a["y"]), a


async def test_the_dashboard_follows_the_network_in_a_real_browser(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    why = _browser_missing()
    if why is not None:
        pytest.skip(why)
    murl = await start_market(procs, tmp_path, "--rise-s", "1", "--hold-s", "2", "--cooldown-s", "2",
                              "--heartbeat-ttl-s", "3")
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
        history: list[int] = []

        async def sampled() -> bool:  # the market's own history has the model (a sample every 5 s)
            got = [m["samples"] for m in (await h.get(f"{murl}/api/history")).json() if m["model_id"] == model_id]
            history[:] = [got[0][0][0]] if got and got[0] else []
            return bool(history)

        await eventually(sampled, within=30, interval=0.25)
        opened_ms = time.time() * 1000
        page = await trio.to_thread.run_sync(Page, f"{murl}/dashboard", tmp_path / "chrome")
        try:
            async def heatmap_matches() -> bool:
                want = coverage_from_demand(await demand())
                return await trio.to_thread.run_sync(page.grid, model_id) == want

            await eventually(heatmap_matches, within=20, interval=0.25)
            drawn = await trio.to_thread.run_sync(page.pixels, model_id)
            assert len(drawn) == 16  # 2 layers x 8 experts
            grid = await trio.to_thread.run_sync(page.grid, model_id)
            assert drawn == {k: category(*v) for k, v in grid.items()}  # the pixels say what the data says
            ticks = await trio.to_thread.run_sync(page.heat_ticks, model_id)
            assert [t for t, _ in ticks["x"]] == list(range(8)) and [t for t, _ in ticks["y"]] == [0, 1]
            assert ticks["titles"] == ["expert →", "layer ↓"]
            # big cells for a small model: 32 px
            assert (await trio.to_thread.run_sync(page.canvas, model_id))["cellW"] == "32"
            assert len(await trio.to_thread.run_sync(page.names)) == 2  # the two serving volunteers
            check_chart_axes(await trio.to_thread.run_sync(page.chart_axes, model_id))
            # the charts start from the market's own history (/api/history), not from the page's first poll
            # (its oldest sample is from before the page opened: the page's own polls come after)
            first = await trio.to_thread.run_sync(page.first_sample_ms, model_id)
            assert first is not None and first <= history[0] < opened_ms, (first, history, opened_ms)
            # hover a held cell: its replicas and holders by name, as the API has them
            m = await recruitment()
            w0 = m["workers"][0]
            s0 = w0["slices"][0]
            lines = await trio.to_thread.run_sync(page.hover_cell, model_id, s0["layer"], s0["lo"])
            want = coverage_from_demand(await demand())[(s0["layer"], s0["lo"])]
            assert lines[:2] == [f"layer {s0['layer']}, expert {s0['lo']}", f"{want[0]} of {want[1]} replicas"]
            assert any(line.startswith((w0["display_name"][:31], )) for line in lines[2:]), lines
            # hover the busy chart at "now": the value and its unit
            lines = await trio.to_thread.run_sync(page.hover_chart_end, model_id, 0)
            assert len(lines) == 2 and lines[1] == "busy 0 of 4 slots", lines
            await trio.to_thread.run_sync(page.unhover)
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

                # boosted, all three volunteers serve: the stranger's name is on the page as text (cut to 32
                # characters, the whole of it in the cell's title) and ran nothing; each says what it does
                async def named() -> list[dict[str, str]] | None:
                    rows = await trio.to_thread.run_sync(page.volunteers)
                    return rows if any(r["title"] == EVIL for r in rows) and len(rows) == 3 else None

                rows = await eventually(named, within=30)
                evil = next(r for r in rows if r["title"] == EVIL)
                assert evil["name"] == EVIL[:31] + "…"
                assert {r["name"] for r in rows} - {evil["name"]} == {"vol-1", "vol-2"}
                assert await trio.to_thread.run_sync(page.title) == "moe-swarm market"

                async def someone_serves() -> bool:
                    rows = await trio.to_thread.run_sync(page.volunteers)
                    return any(r["doing"].startswith("serving ") and r["doing"].endswith(" calls/s") for r in rows)

                await eventually(someone_serves, within=30, interval=0.5)
                await trio.to_thread.run_sync(page.shot, "recruiting")
                stop.set()
            await eventually(lambda: badge("false"), within=30, interval=0.25)
            # one saturated and one unsaturated transition for the whole ramp (hysteresis), in the event log too
            kinds = [e["kind"] for e in (await h.get(f"{murl}/api/events")).json()["events"]]
            assert kinds.count("saturated") == 1 and kinds.count("unsaturated") == 1, kinds

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
                cells = await trio.to_thread.run_sync(page.pixels, model_id)
                return all(cells.get((layer, e)) == "hole" for e in range(8))

            await eventually(hole, within=30, interval=0.25)
            await trio.to_thread.run_sync(page.shot, "hole")
            assert "/ip4/" not in await trio.to_thread.run_sync(page.text)  # no volunteer address on the page
            assert await trio.to_thread.run_sync(page.errors) == []
        finally:
            await trio.to_thread.run_sync(page.close)


# -- the 30b shape ------------------------------------------------------------------------------------

@dataclass
class StandIn:
    """A coordinator as the market sees one: ``/slots`` (``busy`` of 4) and slice files (``HEAD``)."""

    busy: int = 0
    url: str = ""


def stand_in_app(state: StandIn) -> Starlette:
    async def slots(_: Request) -> Response:
        return JSONResponse([{"id": i, "is_processing": i < state.busy, "n_ctx": 512, "n_decoded": 0} for i in range(4)])

    async def slice_file(request: Request) -> Response:
        body = f"{request.path_params['model']}/{request.path_params['layer']}/{request.path_params['span']}".encode() * 64
        return Response(body, headers={"etag": f'"{hashlib.sha256(body).hexdigest()}"'},
                        media_type="application/octet-stream")

    return Starlette(routes=[Route("/slots", slots), Route("/v1/slices/{model}/{layer}/{span}", slice_file)])


class SignedVolunteer:
    """A volunteer speaking the market API over HTTP, signed with its own key (no expert server behind)."""

    def __init__(self, market: str, n: int, name: str) -> None:
        from libp2p.crypto.ed25519 import create_new_key_pair

        self.market, self.name = market, name
        self.kp = create_new_key_pair(bytes([n]) * 32)
        self.peer_id = peer_id_of(self.kp)
        self.seq = 0

    async def post(self, h: httpx.AsyncClient, path: str, raw: bytes) -> httpx.Response:
        return await h.post(self.market + path, content=raw, headers={
            "content-type": "application/json", SIGNATURE_HEADER: sign_request(self.kp, "POST", path, raw)})

    async def poll(self, h: httpx.AsyncClient, max_experts: int) -> dict[str, Any]:
        self.seq += 1
        raw = msgspec.json.encode({"peer_id": self.peer_id, "epoch": 1, "sequence": self.seq,
                                   "sent_at_ms": int(time.time() * 1000), "max_experts": max_experts})
        r = await self.post(h, "/api/expert-volunteer", raw)
        assert r.status_code == 200, r.text
        got: dict[str, Any] = r.json()
        return got

    async def heartbeat(self, h: httpx.AsyncClient, slices: list[HeldSlice], download: DownloadProgress | None = None
                        ) -> None:
        self.seq += 1
        body = CoverageHeartbeat(self.peer_id, 1, self.seq, [f"/ip4/127.0.0.1/tcp/4{self.seq:04d}/p2p/{self.peer_id}"],
                                 slices, protocols=[2], sent_at_ms=int(time.time() * 1000), display_name=self.name,
                                 download=download)
        raw = msgspec.json.encode(msgspec.structs.replace(body, signature=sign_body(self.kp, body)))
        r = await self.post(h, "/api/expert-coverage", raw)
        assert r.status_code == 200, r.text


async def test_a_48_by_128_model_stays_legible(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    why = _browser_missing()
    if why is not None:
        pytest.skip(why)
    stand_in = StandIn(busy=3)  # saturated (threshold 2): the target is 2 once the market's signal rises
    async with trio.open_nursery() as nursery:
        hc = Config()
        hc.bind = ["127.0.0.1:0"]
        hc.accesslog = None
        stand_in.url = (await nursery.start(serve, stand_in_app(stand_in), hc))[0]
        murl = await start_market(procs, tmp_path, "--rise-s", "1")
        manifest = ModelManifest(model_id="shape30b-0123456789ab", arch="qwen3moe", n_layer=48, n_expert=128,
                                 n_expert_used=8, d_model=2048, d_expert=768, bytes_per_expert=[2_654_208] * 48)
        mid = manifest.model_id
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(f"{murl}/api/models", headers={"authorization": "Bearer t0k"},
                             json={"url": stand_in.url, "models": [msgspec.to_builtins(manifest)], "epoch": 1})
            assert r.status_code == 200, r.text

            async def saturated() -> bool:
                return bool((await h.get(f"{murl}/api/moe/recruitment")).json()["models"][0]["saturated"])

            await eventually(saturated, within=20, interval=0.2)
            # three volunteers take a slice each; the second is still downloading it (40 %)
            vols = [SignedVolunteer(murl, 1, "alpha"), SignedVolunteer(murl, 2, "beta"), SignedVolunteer(murl, 3, EVIL_IMG)]
            held: list[HeldSlice] = []
            for i, v in enumerate(vols):
                a = await v.poll(h, 16)
                assert a["kind"] == "assignment", a
                loading = i == 1
                hs = HeldSlice(mid, a["layer"], a["lo"], a["hi"], state=HeldState.LOADING if loading else HeldState.SERVING)
                held.append(hs)
                dl = DownloadProgress(mid, a["layer"], a["lo"], a["hi"], 2 * a["size"] // 5, a["size"]) if loading else None
                await v.heartbeat(h, [hs], dl)
            # a coordinator report: alpha answered 60 calls (verified), which makes it "serving N calls/s"
            r = await h.post(f"{murl}/api/coordinator-report", headers={"authorization": "Bearer t0k"},
                             json={"url": stand_in.url, "model_id": mid,
                                   "workers": [{"peer_id": vols[0].peer_id, "calls": 60, "rows": 60, "verified": 60}]})
            assert r.status_code == 200, r.text
            demand = (await h.get(f"{murl}/api/expert-demand")).json()["models"][0]
            want = coverage_from_demand(demand)
            assert len(want) == 48 * 128
            page = await trio.to_thread.run_sync(Page, f"{murl}/dashboard", tmp_path / "chrome", "1400,1100")
            try:
                async def drawn() -> bool:
                    return await trio.to_thread.run_sync(page.grid, mid) == want

                await eventually(drawn, within=20, interval=0.25)
                pixels = await trio.to_thread.run_sync(page.pixels, mid)
                assert pixels == {k: category(*v) for k, v in want.items()}
                assert {"hole", "below"} <= set(pixels.values())  # the held slices and the rest, told apart
                c = await trio.to_thread.run_sync(page.canvas, mid)
                assert (c["layers"], c["experts"]) == ("48", "128")
                # legible: cells of at least 6 px, the whole map inside the window
                assert int(c["cellW"]) >= 6 and int(c["cellH"]) >= 6 and c["right"] <= c["vw"], c
                ticks = await trio.to_thread.run_sync(page.heat_ticks, mid)
                xs, ys = [t for t, _ in ticks["x"]], [t for t, _ in ticks["y"]]
                assert xs[0] == 0 and ys[0] == 0 and 4 <= len(xs) <= 40 and 4 <= len(ys) <= 48
                step = xs[1] - xs[0]
                assert xs == list(range(0, 128, step)) and step in (1, 2, 5, 10, 20, 50)
                for e, x in ticks["x"]:  # each label sits over its column's centre
                    assert abs(x - (int(c["x0"]) + (e + 0.5) * int(c["cellW"]))) < 1, (e, x)
                check_chart_axes(await trio.to_thread.run_sync(page.chart_axes, mid))

                # hover: a held cell names its holder; an uncovered one says so
                a0 = held[0]
                lines = await trio.to_thread.run_sync(page.hover_cell, mid, a0.layer, a0.lo + 1)
                r0 = want[(a0.layer, a0.lo + 1)]
                assert lines[0] == f"layer {a0.layer}, expert {a0.lo + 1}" and lines[1].startswith(f"{r0[0]} of {r0[1]} replicas")
                assert "alpha: dispatched" in lines[2:], lines
                hole = next(k for k, v in sorted(want.items()) if v[0] == 0 and k[0] == 47)
                lines = await trio.to_thread.run_sync(page.hover_cell, mid, *hole)
                assert lines == [f"layer {hole[0]}, expert {hole[1]}", f"0 of {want[hole][1]} replicas",
                                 "held by no volunteer"], lines
                lines = await trio.to_thread.run_sync(page.hover_chart_end, mid, 0)
                assert lines[1:] == ["busy 3 of 4 slots"], lines
                await trio.to_thread.run_sync(page.unhover)

                # what each does; the stranger's name cut, as text
                async def rows_ready() -> list[dict[str, str]] | None:
                    rows = await trio.to_thread.run_sync(page.volunteers)
                    return rows if len(rows) == 3 else None

                rows = {r["peer_id"]: r for r in await eventually(rows_ready, within=10)}
                assert rows[vols[0].peer_id]["doing"].startswith("serving ") and rows[vols[0].peer_id]["doing"].endswith(" calls/s")
                assert rows[vols[1].peer_id]["doing"] == "downloading 40 %"
                assert rows[vols[2].peer_id]["doing"] == "idle, not proven yet"
                assert rows[vols[2].peer_id]["name"] == EVIL_IMG[:31] + "…" and rows[vols[2].peer_id]["title"] == EVIL_IMG
                assert await trio.to_thread.run_sync(page.title) == "moe-swarm market"
                assert await trio.to_thread.run_sync(page.js, "return document.querySelectorAll('img').length") == 0
                text = await trio.to_thread.run_sync(page.text)
                assert "/ip4/" not in text and "127.0.0.1" not in text  # no volunteer (or any) address

                # the event log: one "saturated" for the sustained load; repeats collapse (the page's own function
                # on a flapping log, as the market wrote it before its hysteresis)
                assert any(e.startswith(tuple("0123456789")) and "saturated" in e for e in await trio.to_thread.run_sync(page.events))
                flapping = [{"seq": i, "at_ms": 1000 * 2 * i, "kind": "saturated" if i % 2 == 0 else "unsaturated",
                             "model_id": mid, "peer_id": None, "slice": None, "detail": ""} for i in range(24)]
                groups = await trio.to_thread.run_sync(page.js, "return collapseEvents(arguments[0]).map(g => [g.kind, g.count, g.last_ms - g.first_ms])", flapping)
                assert groups == [["saturated", 12, 44000], ["unsaturated", 12, 44000]]
                await trio.to_thread.run_sync(page.shot, "48x128")
                assert await trio.to_thread.run_sync(page.errors) == []
            finally:
                await trio.to_thread.run_sync(page.close)
        nursery.cancel_scope.cancel()
