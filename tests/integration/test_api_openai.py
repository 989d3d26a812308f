"""The coordinator's OpenAI-compatible API, driven by the official ``openai`` client and raw httpx."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import trio

from tests.conftest import eventually

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

GOLDEN_PROMPT = "The quick brown fox jumps over the lazy dog."


async def in_thread(fn: Any, *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


async def model_id(url: str) -> str:
    c = client(url)
    models = await in_thread(c.models.list)
    return str(models.data[0].id)


async def test_models_and_completion_matches_golden(coordinator_url: str, golden: dict[str, Any]) -> None:
    c = client(coordinator_url)
    mid = await model_id(coordinator_url)
    assert mid.startswith("qwen3moe-tiny-f32-")
    g = golden["greedy"][0]
    r = await in_thread(
        c.completions.create, model=mid, prompt=GOLDEN_PROMPT, max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True},
    )
    ch = r.choices[0]
    assert ch.model_extra is not None and ch.model_extra["token_ids"] == g["greedy_ids"]
    assert ch.text == g["greedy_text"]
    assert ch.finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (10, 24)
    # a prompt given as token ids gives the same result
    r2 = await in_thread(c.completions.create, model=mid, prompt=g["prompt_ids"], max_tokens=24, temperature=0)
    assert r2.choices[0].text == g["greedy_text"]


async def test_streamed_completion_concatenates_to_plain(coordinator_url: str, golden: dict[str, Any]) -> None:
    c = client(coordinator_url)
    mid = await model_id(coordinator_url)

    def run() -> tuple[str, list[str | None]]:
        parts, reasons = [], []
        for ev in c.completions.create(model=mid, prompt=GOLDEN_PROMPT, max_tokens=24, temperature=0, stream=True):
            parts.append(ev.choices[0].text)
            reasons.append(ev.choices[0].finish_reason)
        return "".join(parts), reasons

    text, reasons = await in_thread(run)
    assert text == golden["greedy"][0]["greedy_text"]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


async def test_chat_plain_and_streamed_agree(coordinator_url: str) -> None:
    c = client(coordinator_url)
    mid = await model_id(coordinator_url)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    plain = await in_thread(c.chat.completions.create, model=mid, messages=msgs, max_tokens=12, temperature=0)
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage is not None and plain.usage.completion_tokens == len(
        (await in_thread(c.chat.completions.create, model=mid, messages=msgs, max_tokens=12, temperature=0,
                         extra_body={"return_token_ids": True})).choices[0].model_extra["token_ids"]  # type: ignore[index]
    )

    def run() -> tuple[str, Any]:
        parts, usage = [], None
        stream = c.chat.completions.create(
            model=mid, messages=msgs, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        for ev in stream:
            if ev.usage is not None:
                usage = ev.usage
            for ch in ev.choices:
                parts.append(ch.delta.content or "")
        return "".join(parts), usage

    text, usage = await in_thread(run)
    assert text == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


async def test_seeded_sampling_is_reproducible(coordinator_url: str) -> None:
    c = client(coordinator_url)
    mid = await model_id(coordinator_url)
    kw = dict(model=mid, prompt=GOLDEN_PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"return_token_ids": True})
    a = await in_thread(c.completions.create, **kw)
    b = await in_thread(c.completions.create, **kw)
    kw["seed"] = 8
    d = await in_thread(c.completions.create, **kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].model_extra["token_ids"] != d.choices[0].model_extra["token_ids"]


async def test_stop_string(coordinator_url: str, golden: dict[str, Any]) -> None:
    c = client(coordinator_url)
    mid = await model_id(coordinator_url)
    full = golden["greedy"][0]["greedy_text"]
    stop = " routes"
    r = await in_thread(c.completions.create, model=mid, prompt=GOLDEN_PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


async def test_concurrent_requests_equal_alone(coordinator_url: str, golden: dict[str, Any]) -> None:
    c = client(coordinator_url)
    mid = await model_id(coordinator_url)
    prompts = [g["prompt_ids"] for g in golden["greedy"]] + [golden["tokenize"][2]["ids"]]

    def one(p: list[int]) -> list[int]:
        r = c.completions.create(model=mid, prompt=p, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
        return list(r.choices[0].model_extra["token_ids"])  # type: ignore[index]

    alone = [await in_thread(one, p) for p in prompts]
    together: list[list[int]] = [[] for _ in prompts]

    async def run(i: int) -> None:
        together[i] = await in_thread(one, prompts[i])

    async with trio.open_nursery() as n:
        for i in range(len(prompts)):
            n.start_soon(run, i)
    assert together == alone
    for i, g in enumerate(golden["greedy"]):
        assert alone[i] == g["greedy_ids"][:12]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"model": "M", "messages": []}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": 7}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "wizard", "content": "x"}]}', 400, "invalid_parameter"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "' + b"word " * 400 + b'"}]}', 400, "context_length_exceeded"),
        (b'[1, 2, 3]', 400, "invalid_parameter"),
    ],
)
async def test_bad_chat_requests_get_openai_errors(coordinator_url: str, body: bytes, status: int, code: str) -> None:
    mid = await model_id(coordinator_url)
    async with httpx.AsyncClient(base_url=coordinator_url) as h:
        r = await h.post("/v1/chat/completions", content=body.replace(b'"M"', f'"{mid}"'.encode()),
                         headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["message"]
        # and the server keeps serving
        ok = await h.post("/v1/completions", json={"model": mid, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


async def test_model_names_lenient_by_default_strict_on_request(coordinator_url: str, nursery: trio.Nursery) -> None:
    from coordinator.server import CoordinatorConfig, serve_coordinator
    from tests.conftest import GOLDEN_GGUF

    mid = await model_id(coordinator_url)
    msgs = [{"role": "user", "content": "x"}]
    async with httpx.AsyncClient() as h:
        for body in ({"model": "nope", "messages": msgs}, {"messages": msgs}):  # one model hosted: any name is it
            r = await h.post(f"{coordinator_url}/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == mid, r.text
        strict = await nursery.start(serve_coordinator, CoordinatorConfig(
            model=str(GOLDEN_GGUF), port=0, slots=1, aliases=("tiny",), strict_model=True))
        for name, status in ((mid, 200), (GOLDEN_GGUF.stem, 200), ("tiny", 200), ("nope", 404), ("", 404)):
            r = await h.post(f"{strict}/v1/chat/completions", json={"model": name, "messages": msgs, "max_tokens": 2})
            assert r.status_code == status, (name, r.text)
            if status == 404:
                err = r.json()["error"]
                assert err["code"] == "model_not_found" and "'tiny'" in err["message"] and err["param"] == "model"


async def test_bad_completion_prompts(coordinator_url: str) -> None:
    mid = await model_id(coordinator_url)
    async with httpx.AsyncClient(base_url=coordinator_url) as h:
        for prompt, code in (([5, 100000], "invalid_token"), ([], "invalid_parameter"), (["a", "b"], "invalid_parameter"),
                             ([1, "a"], "invalid_parameter"), ("", "empty_prompt")):
            r = await h.post("/v1/completions", json={"model": mid, "prompt": prompt})
            assert r.status_code == 400, (prompt, r.text)
            assert r.json()["error"]["code"] == code
        r = await h.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_queue_full_gets_503_and_disconnect_frees_slot(coordinator_url: str) -> None:
    """4 slots + queue of 2: the 7th concurrent request gets 503; clients that leave free their slots."""
    mid = await model_id(coordinator_url)
    body = {"model": mid, "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=30) as h:

        async def all_idle() -> bool:
            return not any(s["is_processing"] for s in (await h.get("/slots")).json())

        async with trio.open_nursery() as n:
            started = trio.Semaphore(0)

            async def hold() -> None:
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    started.release()
                    await trio.sleep_forever()

            for _ in range(6):
                n.start_soon(hold)
            for _ in range(4):
                await started.acquire()
            async def queued() -> bool:
                return f'moe_swarm_queue_depth{{model="{mid}"}} 2.0' in (await h.get("/metrics")).text

            await eventually(queued)
            r = await h.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_busy"
            slots = (await h.get("/slots")).json()
            assert sum(s["is_processing"] for s in slots) == 4
            n.cancel_scope.cancel()  # every streaming client disconnects
        await eventually(all_idle)
        # a non-streamed client that disconnects also frees its slot
        with trio.move_on_after(0.5):
            await h.post("/v1/completions", json={**body, "stream": False, "max_tokens": 5000})
        await eventually(all_idle)


async def test_health_slots_metrics(coordinator_url: str) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url) as h:
        mid = await model_id(coordinator_url)
        await h.post("/v1/completions", json={"model": mid, "prompt": "abc", "max_tokens": 3})
        health = (await h.get("/health")).json()
        assert health["status"] == "ok" and health["slots_idle"] == 4
        slots = (await h.get("/slots")).json()
        assert [s["id"] for s in slots] == [0, 1, 2, 3]
        assert set(slots[0]) == {"id", "is_processing", "n_ctx", "n_prompt", "n_decoded", "tps_ewma", "draft",
                                 "draft_acceptance", "draft_length", "warming", "mean_active_tps", "decode_tps",
                                 "tps_floor", "projected_mean_tps_if_admitted", "parked"}
        assert slots[0]["draft"] is None  # an idle slot drafts nothing
        assert slots[0]["tps_floor"] is None and slots[0]["mean_active_tps"] is None  # no floor, no session
        cap = (await h.get("/capacity")).json()
        assert {k: cap[k] for k in ("can_admit", "reason", "admission", "active_sessions", "slots", "queue",
                                    "headroom_sessions", "kv_headroom_pct", "settling")} == {
            "can_admit": True, "reason": "no_floor", "admission": "advisory", "active_sessions": 0, "slots": 4,
            "queue": 0, "headroom_sessions": 4, "kv_headroom_pct": 100.0, "settling": False}
        m = (await h.get("/metrics")).text
        assert "moe_swarm_generated_tokens_total" in m and "moe_swarm_busy_slots" in m
        assert "moe_swarm_draft_tokens_total" in m and "moe_swarm_draft_acceptance" in m
        gen = [ln for ln in m.splitlines() if ln.startswith("moe_swarm_generated_tokens_total")]
        assert float(gen[0].split()[-1]) >= 3


async def test_bodies_are_bounded_and_huge_prompts_refused_before_tokenising(coordinator_url: str) -> None:
    """A body past --max-body (8 MiB default) is 413 whether declared or streamed; a prompt longer than
    the context can hold is refused from its length, without tokenising it (a 6 MB prompt answers at
    at once); the error names the field of each endpoint."""
    mid = await model_id(coordinator_url)
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=30) as h:
        big = b'{"model": "' + mid.encode() + b'", "prompt": "' + b"x" * (9 << 20) + b'"}'
        r = await h.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunks() -> Any:
            for _ in range(10):
                yield b"x" * (1 << 20)

        r = await h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        huge = "word " * 1_200_000  # 6 MB: under the body limit, far beyond a 256-token context
        for path, body, param in (
            ("/v1/completions", {"model": mid, "prompt": huge}, "prompt"),
            ("/v1/chat/completions", {"model": mid, "messages": [{"role": "user", "content": huge}]}, "messages"),
        ):
            r = await h.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("context_length_exceeded", param)
        # a prompt short enough to be tokenised but still too long: the engine's check names the same fields
        r = await h.post("/v1/completions", json={"model": mid, "prompt": "word " * 400})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        ok = await h.post("/v1/completions", json={"model": mid, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


async def test_a_client_leaving_mid_body_is_not_a_server_error(coordinator_url: str, caplog: pytest.LogCaptureFixture) -> None:
    mid = await model_id(coordinator_url)
    host, port = coordinator_url.removeprefix("http://").rstrip("/").split(":")
    for _ in range(3):
        s = await trio.open_tcp_stream(host, int(port))
        await s.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"model\": \"" + mid.encode())
        await s.aclose()
    async with httpx.AsyncClient(base_url=coordinator_url) as h:
        ok = await h.post("/v1/completions", json={"model": mid, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], [r.getMessage() for r in caplog.records]
