"""The gateway for real: a market, two coordinators of the golden model and ``moe-swarm gateway`` as
processes on loopback. A prefix posted to one coordinator draws a request starting with it there; ``kill -9``
of the chosen coordinator before its first token gives the answer of the other, token for token; the
official ``openai`` client works through the gateway; bad input gets the coordinator's 4xx (and 503 naming
a model no coordinator serves)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.conftest import GOLDEN_GGUF, eventually
from tests.e2e.test_process_e2e import Proc, cli, procs, start_market, wait_for_line, wait_for_text  # noqa: F401

pytestmark = pytest.mark.slow

SYSTEM = [20 + (i * 37) % 300 for i in range(48)]  # a shared "system prompt" as token ids


async def start_coordinator(procs: list[Proc], tmp_path: Path, market: str, name: str) -> str:  # noqa: F811
    p = Proc(cli("coordinator", "--model", str(GOLDEN_GGUF), "--port", "0", "--market", market, "--token", "t0k",
                 "--data-dir", str(tmp_path / name), "--draft", "none"), tmp_path / f"{name}.log")
    procs.append(p)
    return (await wait_for_line(p, "coordinator ready at ")).split()[-1].rstrip("/")


async def start_gateway(procs: list[Proc], tmp_path: Path, market: str) -> tuple[Proc, str]:  # noqa: F811
    g = Proc(cli("--log-level", "INFO", "gateway", "--market", market, "--port", "0", "--model", str(GOLDEN_GGUF),
                 "--poll-interval", "0.2", "--poll-timeout", "2"), tmp_path / "gateway.log")
    procs.append(g)
    return g, (await wait_for_line(g, "gateway ready at ")).split()[-1]


async def two_behind_a_gateway(procs: list[Proc], tmp_path: Path) -> tuple[Proc, str, dict[str, Proc], str]:  # noqa: F811
    market = await start_market(procs, tmp_path)
    urls = [await start_coordinator(procs, tmp_path, market, n) for n in ("c1", "c2")]
    coords = {u: p for u, p in zip(urls, procs[-2:], strict=True)}
    gw, gurl = await start_gateway(procs, tmp_path, market)
    async with httpx.AsyncClient(timeout=10) as h:
        listing = (await h.get(market + "/api/coordinators")).json()
        [entry] = listing["models"]
        assert sorted(c["url"].rstrip("/") for c in entry["coordinators"]) == sorted(urls)

        async def both_polled() -> bool:
            health = (await h.get(gurl + "/health")).json()
            return sorted(c["url"] for c in health["coordinators"]) == sorted(urls)

        await eventually(both_polled)
    return gw, gurl, coords, entry["model_id"]


def body(model: str, prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


async def stream_ids(h: httpx.AsyncClient, url: str, b: dict[str, Any]) -> tuple[list[int], list[str], httpx.Headers]:
    ids: list[int] = []
    datas: list[str] = []
    async with h.stream("POST", url + "/v1/completions", json={**b, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                datas.append(line[6:])
                if line != "data: [DONE]" and "choices" in json.loads(line[6:]):
                    for ch in json.loads(line[6:])["choices"]:
                        ids.extend(ch.get("token_ids", []))
        return ids, datas, r.headers


async def test_prefix_locality_and_kill_9_before_the_first_token(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    gw, gurl, coords, model = await two_behind_a_gateway(procs, tmp_path)
    holder = max(coords)  # the URL a tie would not choose: only its prefix can draw the request there
    other = min(coords)
    prompt = SYSTEM + [7, 8, 9]
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(holder + "/v1/prefixes", json={"tokens": SYSTEM})
        assert r.status_code == 201, r.text

        async def advertised() -> bool:
            health = (await h.get(gurl + "/health")).json()
            return any(c["url"] == holder and c["kept_prefixes"] > 0 for c in health["coordinators"])

        await eventually(advertised)
        r = await h.post(gurl + "/v1/completions", json=body(model, prompt))
        assert r.status_code == 200, r.text
        assert r.headers["x-moe-swarm-coordinator"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(SYSTEM)
        first = r.json()["choices"][0]["token_ids"]
        direct = (await h.post(other + "/v1/completions", json=body(model, prompt))).json()["choices"][0]["token_ids"]
        assert first == direct and len(direct) == 12

        # the holder is stopped before the request is sent: it cannot produce a first token; once the gateway's
        # log says it routed there, kill -9 it; the answer must come from the other, token for token
        victim = coords[holder]
        victim.p.send_signal(signal.SIGSTOP)
        async with trio.open_nursery() as nursery:
            result: dict[str, Any] = {}

            async def client() -> None:
                result["ids"], result["datas"], result["headers"] = await stream_ids(h, gurl, body(model, prompt))

            nursery.start_soon(client)
            await wait_for_text(gw, f"rid=2 attempt=1 -> {holder}", within=10)  # rid 1 was the first request
            victim.p.send_signal(signal.SIGKILL)
            victim.p.wait()
        assert result["headers"]["x-moe-swarm-coordinator"] == other
        assert result["ids"] == direct
        assert result["datas"][-1] == "[DONE]"
        assert "rid=2 attempt=1: AttemptFailed" in gw.text()
        await wait_for_text(gw, f"rid=2 attempt=2 -> {other}", within=1)
        metrics = (await h.get(gurl + "/metrics")).text
        assert "moe_swarm_gateway_failovers_total 1.0" in metrics

        # the last coordinator dies mid-stream: the stream ends with an error event, never silently
        events: list[str] = []
        async with h.stream("POST", gurl + "/v1/completions", json={**body(model, prompt, max_tokens=2000),
                                                                    "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        coords[other].p.send_signal(signal.SIGKILL)
        assert "[DONE]" not in events and len(events) < 2000
        assert json.loads(events[-1])["error"]["code"] == "coordinator_failed"
        assert "moe_swarm_gateway_stream_errors_total 1.0" in (await h.get(gurl + "/metrics")).text


async def test_openai_client_and_bad_input_through_the_gateway(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    _, gurl, coords, model = await two_behind_a_gateway(procs, tmp_path)
    some = min(coords)

    def run() -> tuple[list[str], str, str, int, list[str], int]:
        c = openai.OpenAI(base_url=gurl + "/v1", api_key="none", max_retries=0)
        ids = [m.id for m in c.models.list().data]
        chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                         max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        text = chat.choices[0].message.content or ""
        streamed = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                             max_tokens=8, temperature=0.0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        parts, usage = [], 0
        for chunk in streamed:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        assert chat.usage is not None
        try:
            c.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        except openai.APIStatusError as exc:
            status, msg = exc.status_code, str(exc) + " " + str(exc.code)
        return ids, text, "".join(parts), usage, [str(status), msg], chat.usage.prompt_tokens

    ids, text, streamed, usage, (status, msg), n_prompt = await trio.to_thread.run_sync(run)
    assert ids == [model]
    assert text and text == streamed and usage == 8
    assert status == "503" and "no-such-model" in msg and "no_coordinator" in msg, msg
    async with httpx.AsyncClient(timeout=30) as h:
        # the gateway's tokenisation is the coordinator's: the same prompt token count
        direct = (await h.post(some + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1})).json()
        assert direct["usage"]["prompt_tokens"] == n_prompt
        def post(url: str, raw: bytes) -> httpx.Response:  # a sync client: a refused upload leaves no async generator
            with httpx.Client(timeout=30) as sc:
                return sc.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})

        for raw, status_code, code in ((b"{not json", 400, "invalid_json"), (b'{"prompt": 5}', 400, "invalid_parameter"),
                                       (b'{"model": "' + model.encode() + b'", "prompt": "x", "n": 3}', 400, "invalid_parameter"),
                                       (b"x" * (9 << 20), 413, "body_too_large")):
            via = await trio.to_thread.run_sync(post, gurl, raw)
            to = await trio.to_thread.run_sync(post, some, raw)
            assert (via.status_code, via.json()["error"]["code"]) == (status_code, code) == \
                (to.status_code, to.json()["error"]["code"]), (raw[:40], via.text, to.text)
        assert (await h.get(gurl + "/health")).json()["status"] == "ok"

        # a client that goes away mid-stream: the coordinator's slot is freed (the cancellation passed through)
        def leave_after_3_events() -> str:  # a sync client: leaving mid-stream leaves no async generator behind
            with httpx.Client(timeout=30) as sc, sc.stream("POST", gurl + "/v1/completions", json={
                    **body(model, [5, 6, 7], max_tokens=4000), "stream": True}) as r:
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: ")
                    if n == 3:
                        break
                return r.headers["x-moe-swarm-coordinator"]

        chosen = await trio.to_thread.run_sync(leave_after_3_events)

        async def slot_freed() -> bool:
            return not any(s["is_processing"] for s in (await h.get(chosen + "/slots")).json())

        await eventually(slot_freed, within=10)
        assert "moe_swarm_gateway_cancelled_total 1.0" in (await h.get(gurl + "/metrics")).text
