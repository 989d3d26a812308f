"""Reusable prefixes through real coordinator processes and the official ``openai`` client: a
second prompt sharing a first one's start reports the shared tokens as
``usage.prompt_tokens_details.cached_tokens`` (plain and streamed), its tokens are those of a
coordinator started with ``--prefix-cache-mem 0``, and /metrics counts the hits and reused tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.conftest import GOLDEN_GGUF
from tests.e2e.test_process_e2e import Proc, cli, procs, wait_for_line  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

SHARED = [20 + (i * 37) % 300 for i in range(48)]  # a "system prompt" given as token ids


async def start(procs: list[Proc], tmp_path: Path, name: str, mem: str) -> str:  # noqa: F811
    p = Proc(cli("coordinator", "--model", str(GOLDEN_GGUF), "--port", "0", "--data-dir", str(tmp_path / name),
                 "--prefix-cache-mem", mem, "--draft", "none"), tmp_path / f"{name}.log")
    procs.append(p)
    return (await wait_for_line(p, "coordinator ready at ")).split()[-1]


def run_requests(url: str) -> list[tuple[list[int], int, int]]:
    """Three completions (plain, plain, streamed with usage): each one's token ids, prompt tokens and
    cached tokens."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    mid = c.models.list().data[0].id
    kw: dict[str, Any] = {"model": mid, "max_tokens": 10, "temperature": 0.0,
                          "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    out = []
    for user in ([7, 8, 9, 10], [11, 12, 13]):
        r = c.completions.create(prompt=SHARED + user, **kw)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.choices[0].model_extra is not None
        out.append((r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens,
                    r.usage.prompt_tokens_details.cached_tokens or 0))
    ids: list[int] = []
    usage = None
    for chunk in c.completions.create(prompt=SHARED + [11, 12, 13, 14], stream=True,
                                      stream_options={"include_usage": True}, **kw):
        if chunk.choices and chunk.choices[0].model_extra:
            ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    out.append((ids, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


async def test_cached_tokens_reported_and_tokens_unchanged(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    on = await start(procs, tmp_path, "on", "64M")
    off = await start(procs, tmp_path, "off", "0")
    got_on = await trio.to_thread.run_sync(run_requests, on)
    got_off = await trio.to_thread.run_sync(run_requests, off)
    assert [ids for ids, _, _ in got_on] == [ids for ids, _, _ in got_off]
    assert all(len(ids) == 10 for ids, _, _ in got_on)
    assert [n for _, n, _ in got_on] == [52, 51, 52]
    assert [c for _, _, c in got_off] == [0, 0, 0]
    # nothing kept for the first; the shared 48 tokens; the whole second prompt (51: its 14 is new)
    assert [c for _, _, c in got_on] == [0, 48, 51]
    async with httpx.AsyncClient(timeout=30) as h:
        m_on = (await h.get(on + "/metrics")).text
        m_off = (await h.get(off + "/metrics")).text
    assert metric(m_on, "moe_swarm_prefix_cache_lookups_total", outcome="hit", tier="ram") == 2
    assert metric(m_on, "moe_swarm_prefix_cache_lookups_total", outcome="miss", tier="none") == 1
    assert metric(m_on, "moe_swarm_prefix_cache_reused_tokens_total", tier="ram") == 48 + 51
    assert metric(m_on, "moe_swarm_prefix_cache_reused_bytes_total", tier="ram") > 0
    assert metric(m_on, "moe_swarm_prefix_cache_capacity_bytes", tier="ram") == 64 << 20
    assert metric(m_on, "moe_swarm_prompt_tokens_total") == 52 + 51 + 52 - 48 - 51
    assert metric(m_off, "moe_swarm_prompt_tokens_total") == 52 + 51 + 52
    assert "moe_swarm_prefix_cache" not in m_off
