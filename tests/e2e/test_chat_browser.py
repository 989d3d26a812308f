"""The coordinator's chat page (``/``) in a real headless Chromium: a coordinator serving a generated
model with half of every layer's experts on a volunteer (a real libp2p host; ``--dispatch offload``).
A message sent from the page streams a reply, rendered as the official ``openai`` client gets it, with its
tokens/s and where its experts ran (here and on the one volunteer, as ``/dispatch`` counted them); the stop
button cancels the next reply mid-stream and the coordinator frees its slot (``/slots``). The page runs
under a strict Content-Security-Policy (hashes, no ``'unsafe-inline'``), so a blocked script or style
would show as a console error: none may. A screenshot goes to ``test-artifacts/chat.png``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import trio

from swarm.model.gguf import GGUFModel
from tests.conftest import eventually
from tests.e2e.browser import ARTIFACTS, browser_missing, open_chromium, severe_logs
from tests.integration.support import dmap, start_volunteer

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from swarm.tools.makemodel import make_model

    return make_model(arch="qwen3moe", size="small", seed=7, out=tmp_path_factory.mktemp("model") / "chat-small.gguf")


def _reply(driver: Any) -> dict[str, Any] | None:
    got = driver.execute_script(
        "const m = [...document.querySelectorAll('.msg.assistant')].pop(); if (!m) return null;"
        "return {text: m.querySelector('.text').textContent, stats: m.querySelector('.stats').textContent,"
        " ...m.dataset, n: document.querySelectorAll('.msg.assistant').length}")
    return dict(got) if got is not None else None


def _send(driver: Any, text: str, *, max_tokens: int, temperature: float) -> None:
    from selenium.webdriver.common.by import By

    driver.execute_script("document.getElementById('settings').open = true")
    for fid, value in (("max-tokens", str(max_tokens)), ("temperature", str(temperature))):
        el = driver.find_element(By.ID, fid)
        el.clear()
        el.send_keys(value)
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


async def test_chat_page_streams_a_reply_shows_its_speed_and_experts_and_stops(
    nursery: trio.Nursery, small_model: Path, tmp_path: Path
) -> None:
    why = browser_missing()
    if why is not None:
        pytest.skip(why)
    from coordinator.server import CoordinatorConfig, serve_coordinator

    model = GGUFModel(small_model)
    half = model.config.n_expert // 2
    ranges = [(layer, 0, half) for layer in range(model.config.n_moe_layer)]
    vol = await start_volunteer(nursery, model, ranges, today=True)
    map_path = tmp_path / "map.json"
    map_path.write_bytes(msgspec.json.encode(dmap(model, 1, {r: [vol] for r in ranges})))
    url = await nursery.start(serve_coordinator, CoordinatorConfig(
        model=str(small_model), port=0, slots=2, data_dir=str(tmp_path / "c"), dispatch_map=str(map_path),
        dispatch="offload"))
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        page = await h.get("/")
        csp = page.headers["content-security-policy"]
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "'unsafe-inline'" not in csp and "unsafe-eval" not in csp and "default-src 'none'" in csp
        assert "script-src 'sha256-" in csp and "style-src 'sha256-" in csp and "connect-src 'self'" in csp
        assert "http" not in page.text.replace(url, "")  # self-contained: no other origin named

        async def proved() -> bool:  # the volunteer answered the hold challenge of each of its ranges
            return bool((await h.get("/dispatch")).json()["hold_passes"] == len(ranges))

        await eventually(proved, within=30)

        async def slots_busy() -> int:
            return sum(bool(s["is_processing"]) for s in (await h.get("/slots")).json())

        driver = await trio.to_thread.run_sync(open_chromium, f"{url}/", tmp_path / "chrome")
        try:
            async def model_shown() -> bool:
                return bool(await trio.to_thread.run_sync(
                    lambda: driver.find_element("id", "model").text == model.model_id))

            await eventually(model_shown, within=20, interval=0.1)

            # 1. a message: the streamed reply is rendered as the openai client gets it, with its speed and experts
            await trio.to_thread.run_sync(lambda: _send(driver, "Hello there", max_tokens=48, temperature=0))

            async def finished() -> dict[str, Any] | None:
                r = await trio.to_thread.run_sync(_reply, driver)
                return r if r is not None and r.get("finish") in ("stop", "length", "stopped", "error") else None

            r = await eventually(finished, within=60, interval=0.1)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            want = await trio.to_thread.run_sync(lambda: client.chat.completions.create(
                model=model.model_id, messages=[{"role": "user", "content": "Hello there"}], max_tokens=48, temperature=0))
            assert r["finish"] == want.choices[0].finish_reason, r
            assert r["text"] == want.choices[0].message.content and r["text"]
            assert want.usage is not None and int(r["tokens"]) == want.usage.completion_tokens
            assert float(r["tps"]) > 0 and "tokens/s" in r["stats"]
            # half of every layer's experts is on the volunteer: rows were computed there and here
            assert int(r["remoteRows"]) > 0 and int(r["localRows"]) > 0 and r["volunteers"] == "1", r
            assert "on 1 volunteer" in r["stats"] and "here" in r["stats"], r["stats"]

            # 2. the stop button: the next reply stops mid-stream and its slot is freed
            max_tokens = 1500
            await trio.to_thread.run_sync(lambda: _send(driver, "Tell me more", max_tokens=max_tokens, temperature=0))

            async def streaming() -> dict[str, Any] | None:
                r = await trio.to_thread.run_sync(_reply, driver)
                ok = r is not None and r["n"] == 2 and int(r.get("tokens", 0)) >= 16
                return r if ok else None

            r = await eventually(streaming, within=60, interval=0.05)
            assert r["finish"] == "streaming", r  # still going: the precondition of stopping it
            assert await slots_busy() == 1
            clicked = time.monotonic()
            await trio.to_thread.run_sync(lambda: driver.find_element("id", "stop").click())

            async def freed() -> bool:
                return await slots_busy() == 0

            await eventually(freed, within=10, interval=0.02)
            freed_after_ms = (time.monotonic() - clicked) * 1000
            r = await eventually(finished, within=10, interval=0.05)
            assert r["finish"] == "stopped" and 16 <= int(r["tokens"]) < max_tokens, r
            assert "stopped" in r["stats"]
            metrics = (await h.get("/metrics")).text
            print(f"slot freed {freed_after_ms:.0f} ms after the stop click; {r['tokens']} tokens streamed "
                  f"({r['tps']} tokens/s)")
            # the conversation goes on: the stopped reply's text is part of the history
            send_enabled = await trio.to_thread.run_sync(lambda: driver.find_element("id", "send").is_enabled())
            assert send_enabled and "moe_swarm_requests_total" in metrics
            ARTIFACTS.mkdir(exist_ok=True)
            await trio.to_thread.run_sync(lambda: driver.save_screenshot(str(ARTIFACTS / "chat.png")))
            assert await trio.to_thread.run_sync(severe_logs, driver) == []
        finally:
            await trio.to_thread.run_sync(driver.quit)
