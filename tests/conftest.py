"""Shared fixtures: the golden model, a seeded RNG that prints its seed, a live coordinator."""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_GGUF = FIXTURES / "golden" / "qwen3moe-tiny-f32.gguf"
GOLDEN_JSON = FIXTURES / "golden" / "qwen3moe-tiny-f32.llamacpp.json"


@pytest.fixture(scope="session")
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN_JSON.read_text())
    return data


@pytest.fixture(scope="session")
def golden_model() -> Any:
    from swarm.model.gguf import GGUFModel

    return GGUFModel(GOLDEN_GGUF)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    """One throwaway PostgreSQL server for the session (``tests/pgserver.py``); skips, saying why, only
    where Debian's ``postgresql`` package (the ``postgres`` and ``initdb`` binaries) is absent."""
    from tests.pgserver import PgServer, find_bindir

    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (postgres, initdb) not found: apt-get install postgresql")
    server = PgServer(bindir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: Any) -> str:
    """A new empty database on the session's PostgreSQL server."""
    url: str = pg_server.database()
    return url


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int(os.environ.get("MOE_SWARM_TEST_SEED", random.randrange(2**32)))
    print(f"[rng seed for {request.node.name}: {seed}]")
    return random.Random(seed)


@pytest.fixture
async def coordinator_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    from coordinator.server import CoordinatorConfig, serve_coordinator

    url = await nursery.start(serve_coordinator, CoordinatorConfig(model=str(GOLDEN_GGUF), port=0, slots=4, max_queue=2))
    yield url


async def eventually(check: Any, *, within: float = 10.0, interval: float = 0.02) -> Any:
    """Poll an async ``check()`` until it returns a truthy value (for state seen only over HTTP)."""
    with trio.fail_after(within):
        for _ in range(int(within / interval) + 1):
            value = await check()
            if value:
                return value
            await trio.sleep(interval)
    raise AssertionError("condition not met in time")


def greedy_tokens(tr: Any, prompt: list[int], n: int, *, n_ctx: int = 256, kv_dtype: Any = None) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from a ``coordinator.engine.model.Transformer``: one prefill, then
    one decode step a token, with a KV cache of ``n_ctx`` rows (F32 unless ``kv_dtype``)."""
    import torch

    from coordinator.engine.model import KVCache, SeqChunk

    cache = KVCache(tr.cfg, n_ctx, dtype=kv_dtype if kv_dtype is not None else torch.float32)
    lg = tr.forward([SeqChunk(cache, list(prompt), 0)])[0][-1]
    out, pos = [], len(prompt)
    for _ in range(n):
        t = int(lg.argmax())
        out.append(t)
        lg = tr.forward([SeqChunk(cache, [t], pos)])[0][-1]
        pos += 1
    return out
