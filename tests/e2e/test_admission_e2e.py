"""Admission with a floor through a real coordinator process, real sockets, raw httpx and the official
``openai`` client: sessions ramping against a floor no second session can keep (two guaranteed), the
next request held while the last admit settles and then refused with 429 + ``Retry-After`` (a
``RateLimitError`` to the client), continuations and ``overcommit`` let through, ``/capacity``
consistent with ``/slots``, and the market's poller reading the speed signal from that ``/slots``."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from market.core.recruit import PollView, RecruitPolicy, coordinator_saturated
from market.server import make_slots_poller
from swarm.tools.makemodel import make_model
from tests.conftest import eventually
from tests.e2e.test_process_e2e import Proc, cli, procs, wait_for_line  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

FLOOR = 100000.0  # no two sessions reach it: the third request is over capacity


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 2,048 tokens of context: sessions that outlive the test's probes
    return make_model(arch="qwen3moe", size="small", seed=3, out=tmp_path_factory.mktemp("model") / "small.gguf")


async def start(procs: list[Proc], tmp_path: Path, model: Path, *extra: str) -> str:  # noqa: F811
    p = Proc(cli("coordinator", "--model", str(model), "--port", "0", "--data-dir", str(tmp_path / "c"),
                 "--draft", "none", "--threads", "1", "--slots", "4", *extra), tmp_path / "c.log")
    procs.append(p)
    return (await wait_for_line(p, "coordinator ready at ")).split()[-1]


def prompt(i: int) -> list[int]:
    return [30 + i * 50 + k for k in range(12)]


def refused(url: str, tokens: list[int]) -> openai.RateLimitError:
    """A request the official client sees refused (429: ``RateLimitError``, no retries)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError) as exc:
        c.completions.create(model="m", prompt=tokens, max_tokens=4)
    return exc.value


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


async def test_enforced_floor_holds_then_rejects_and_lets_continuations_through(
        procs: list[Proc], tmp_path: Path, small_model: Path) -> None:  # noqa: F811
    url = await start(procs, tmp_path, small_model, "--tps-floor", str(FLOOR), "--admission", "enforced",
                      "--on-saturation", "reject", "--guarantee-min-sessions", "2", "--settle-tokens", "40",
                      "--settle-time", "4", "--admission-hold", "30")
    body: dict[str, Any] = {"max_tokens": 1900, "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h, trio.open_nursery() as nursery:
        first_token = [trio.Event(), trio.Event()]

        async def session(i: int, sid: str) -> None:
            async with h.stream("POST", "/v1/completions", json={**body, "prompt": prompt(i)},
                                headers={"X-Session-Id": sid}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        first_token[i].set()

        cap0 = (await h.get("/capacity")).json()
        assert (cap0["can_admit"], cap0["reason"], cap0["admission"], cap0["tps_floor"]) == (
            True, "guaranteed", "enforced", FLOOR)
        nursery.start_soon(session, 0, "alice")
        await first_token[0].wait()
        nursery.start_soon(session, 1, "bob")  # guaranteed: admitted while alice settles
        await first_token[1].wait()

        # bob is settling: a third request is held (not refused) until bob's window ends, then refused
        err = await trio.to_thread.run_sync(refused, url, prompt(2))
        assert err.status_code == 429 and err.code == "over_capacity"
        assert int(err.response.headers["retry-after"]) >= 1
        assert "below the floor" in err.message
        m = (await h.get("/metrics")).text
        assert metric(m, "moe_swarm_admission_decisions_total", verdict="hold", reason="settling") == 1
        assert metric(m, "moe_swarm_admission_decisions_total", verdict="reject", reason="projected_below_floor") == 1

        # settled, measured: /capacity says no, consistently with /slots
        async def measured() -> dict[str, Any] | None:
            c = (await h.get("/capacity")).json()
            return c if not c["settling"] and c["mean_active_tps"] is not None else None

        cap = await eventually(measured, within=30)
        slots = (await h.get("/slots")).json()
        busy = [s for s in slots if s["is_processing"]]
        assert (cap["can_admit"], cap["reason"], cap["headroom_sessions"]) == (False, "projected_below_floor", 0)
        assert cap["active_sessions"] == len(busy) == 2 and cap["slots"] == len(slots) == 4 and cap["queue"] == 0
        assert 0 < cap["kv_headroom_pct"] < 100
        assert all(s["tps_floor"] == FLOOR for s in slots)
        assert not any(s["warming"] for s in busy)
        assert slots[0]["mean_active_tps"] == pytest.approx(statistics.mean(s["tps_ewma"] for s in busy), abs=0.01)
        assert 0 < cap["projected_mean_tps_if_admitted"] <= cap["mean_active_tps"] < FLOOR
        # the market's poller reads the speed signal from this /slots: saturated by it (busy 2 would be too,
        # so check the signal itself)
        n_busy, n_slots, _, speed = await make_slots_poller(h)(url)
        assert speed is not None and speed.tps_floor == FLOOR and speed.mean_active_tps is not None
        assert coordinator_saturated(PollView(n_busy, n_slots, 0.0, speed.mean_active_tps, speed.tps_floor,
                                              speed.projected_tps), 0.0, RecruitPolicy(saturation_threshold=99))

        # never gated: a continuation by session id, one by prompt (it extends alice's), an overcommit
        short = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        for extra, headers in (({"prompt": prompt(3)}, {"X-Session-Id": "alice"}),
                               ({"prompt": [*prompt(0), 7, 8]}, {}),
                               ({"prompt": prompt(4), "overcommit": True}, {})):
            r = await h.post("/v1/completions", json={**short, **extra}, headers=headers)
            assert r.status_code == 200, r.text
        r = await h.post("/v1/completions", json={**short, "prompt": prompt(5)}, headers={"X-Session-Id": "x" * 257})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_session_id")
        m = (await h.get("/metrics")).text
        assert metric(m, "moe_swarm_admission_decisions_total", verdict="admit", reason="continuation") == 2
        assert metric(m, "moe_swarm_admission_decisions_total", verdict="admit", reason="overcommit") == 1
        assert metric(m, "moe_swarm_mean_active_tps") > 0 and metric(m, "moe_swarm_tps_floor") == FLOOR
        nursery.cancel_scope.cancel()


async def test_warn_admits_past_the_floor_with_a_header(procs: list[Proc], tmp_path: Path,  # noqa: F811
                                                         small_model: Path) -> None:
    url = await start(procs, tmp_path, small_model, "--tps-floor", str(FLOOR), "--admission", "enforced",
                      "--on-saturation", "warn", "--settle-tokens", "4", "--settle-time", "1")
    async with httpx.AsyncClient(base_url=url, timeout=60) as h, trio.open_nursery() as nursery:
        started = trio.Event()

        async def session() -> None:
            async with h.stream("POST", "/v1/completions", json={"prompt": prompt(0), "max_tokens": 1900,
                                                                  "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()

        nursery.start_soon(session)
        await started.wait()

        async def settled() -> bool:
            return (await h.get("/capacity")).json()["reason"] == "projected_below_floor"

        await eventually(settled, within=30)
        r = await h.post("/v1/completions", json={"prompt": prompt(1), "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-sessions-remaining"] == "0"
        nursery.cancel_scope.cancel()


async def test_a_parked_session_shows_on_capacity_slots_and_metrics_and_no_request_goes_ahead_of_it(
        procs: list[Proc], tmp_path: Path, small_model: Path) -> None:  # noqa: F811
    url = await start(procs, tmp_path, small_model, "--tps-floor", str(FLOOR), "--admission", "enforced",
                      "--guarantee-min-sessions", "1", "--settle-tokens", "4", "--settle-time", "0.5",
                      "--max-park-time", "600")
    body: dict[str, Any] = {"max_tokens": 1900, "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h, trio.open_nursery() as nursery:
        tokens = [0, 0]

        async def session(i: int, extra: dict[str, Any]) -> None:
            async with h.stream("POST", "/v1/completions", json={**body, "prompt": prompt(i), **extra}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        tokens[i] += 1

        def more(i: int, than: int) -> Any:
            async def check() -> bool:
                return tokens[i] > than
            return check

        nursery.start_soon(session, 0, {})
        await eventually(more(0, 0), within=30)
        nursery.start_soon(session, 1, {"overcommit": True})  # past the floor by request: the one to park

        async def parked() -> dict[str, Any] | None:
            c = (await h.get("/capacity")).json()
            return c if c["parked_sessions"] == 1 else None

        cap = await eventually(parked, within=30)
        assert (cap["can_admit"], cap["reason"], cap["headroom_sessions"], cap["active_sessions"]) == (
            False, "parked_waiting", 0, 2)
        slots = (await h.get("/slots")).json()
        assert [s["parked"] for s in slots if s["is_processing"]] == [False, True]  # the first admitted keeps going
        m = (await h.get("/metrics")).text
        assert metric(m, "moe_swarm_sessions", state="parked") == 1
        assert metric(m, "moe_swarm_admission_preemptions_total", event="parked") >= 1
        # the parked stream waits (its tokens stop) while the first one's go on
        await eventually(more(0, tokens[0] + 5), within=30)
        n1 = tokens[1]
        await eventually(more(0, tokens[0] + 5), within=30)
        assert tokens[1] == n1 and (await h.get("/capacity")).json()["parked_sessions"] == 1

        err = await trio.to_thread.run_sync(refused, url, prompt(2))
        assert err.status_code == 429 and "parked_waiting" in err.message
        nursery.cancel_scope.cancel()
