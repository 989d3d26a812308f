"""The prefix cache's disk tier with the real engine: prefixes RAM evicts are written to DIR and
read back bit-exact (the same tokens as with no cache), kept across a restart; a corrupt, cut-short,
foreign or garbage file is never loaded (one warning each) and the request prefills its whole prompt."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from coordinator.core.scheduler import Emit, Finish, GenParams
from coordinator.engine.model import KV_TYPES, KVCache
from coordinator.engine.runtime import EngineRuntime
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer
from tests.conftest import GOLDEN_GGUF

PARAMS = GenParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(GOLDEN_GGUF)


@asynccontextmanager
async def running(model: GGUFModel, directory: Path | None, *, rows: int = 70, kv_type: str = "f16",
                  mem: bool = True) -> AsyncIterator[EngineRuntime]:
    """A runtime whose RAM tier holds ``rows`` tokens' KV (one conversation of these tests)."""
    row = KVCache(model.config, 1, KV_TYPES[kv_type]).row_bytes
    rt = EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=1, n_ctx=128, kv_type=kv_type,
                       prefix_cache_bytes=rows * row if mem else 0,
                       prefix_cache_dir=directory, prefix_cache_disk_bytes=10 << 20)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        yield rt
        n.cancel_scope.cancel()


async def ask(rt: EngineRuntime, prompt: list[int]) -> tuple[list[int], int]:
    h = rt.submit(prompt, PARAMS)
    ids: list[int] = []
    cached = -1
    async for ev in h.events:
        if isinstance(ev, Emit):
            ids.extend(ev.token_ids)
        elif isinstance(ev, Finish):
            cached = ev.n_cached
    return ids, cached


def prompts(n_vocab: int) -> dict[str, list[int]]:
    rng = random.Random(11)
    s1 = [rng.randrange(3, n_vocab) for _ in range(50)]
    s2 = [rng.randrange(3, n_vocab) for _ in range(50)]
    return {"a": s1 + [5, 6], "b": s2 + [7, 8], "c": s1 + [9, 10, 11], "d": s2 + [12]}


async def fill_disk(model: GGUFModel, d: Path) -> dict[str, list[int]]:
    """Leave a's and b's conversations on disk in ``d`` (RAM holds one: b's push a's out, c's b's)."""
    p = prompts(model.config.n_vocab)
    async with running(model, d) as rt:
        for k in ("a", "b", "c"):
            await ask(rt, p[k])
        await ask(rt, p["c"])  # c's conversation offered: b's spilled
    return p


async def test_spilled_prefixes_come_back_exact_and_survive_a_restart(model: GGUFModel, tmp_path: Path) -> None:
    p = prompts(model.config.n_vocab)
    async with running(model, None, mem=False) as off:
        want = {k: (await ask(off, v))[0] for k, v in p.items()}
    d = tmp_path / "kv"
    async with running(model, d) as rt:
        got = {k: await ask(rt, p[k]) for k in ("a", "b", "c")}  # c: a's prefix, read from disk
        info = rt.prefix_cache()
        got["d"] = await ask(rt, p["d"])  # b's prefix, from disk
    assert {k: ids for k, (ids, _) in got.items()} == want
    assert {k: c for k, (_, c) in got.items()} == {"a": 0, "b": 0, "c": 50, "d": 50}
    assert info is not None and info.stats.tiers["disk"].hits == 1 and info.stats.tiers["disk"].hit_tokens == 50
    assert info.disk_entries == 2 and 0 < info.disk_used <= info.disk_capacity  # a, and b when c ended
    names = sorted(f.name for f in d.iterdir())
    assert names and all(n.endswith(".kv") and len(n) == 32 + 3 and int(n[:32], 16) >= 0 for n in names)  # no tmp left
    assert len(names) == 3  # a, b, and c (spilled when d ended, written at the stop)
    # a new process on the same directory finds them
    async with running(model, d) as rt2:
        assert (await ask(rt2, p["c"])) == (want["c"], 52)  # c's own conversation: all but its last token
        assert (await ask(rt2, p["d"])) == (want["d"], 50)
        info2 = rt2.prefix_cache()
    assert info2 is not None and info2.stats.tiers["disk"].hits == 2


def _files_by_size(d: Path) -> list[Path]:
    return sorted(d.glob("*.kv"), key=lambda f: f.stat().st_size)


async def test_a_corrupt_file_is_never_loaded(model: GGUFModel, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "kv"
    p = await fill_disk(model, d)
    async with running(model, None, mem=False) as off:
        want = (await ask(off, p["d"]))[0]
    files = list(d.glob("*.kv"))
    for f in files:  # one byte of the rows flipped, in every file
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0x40
        f.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING)
    async with running(model, d) as rt:
        assert await ask(rt, p["d"]) == (want, 0)  # found, refused at reading: the whole prompt computed
        assert await ask(rt, p["d"]) == (want, 50)  # its own rows, kept in RAM since
        info = rt.prefix_cache()
    assert info is not None and info.stats.failed == 1 and info.stats.misses == 1
    assert (info.stats.tiers["disk"].hits, info.stats.tiers["ram"].hits) == (0, 1)
    warnings = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert len(warnings) == 1 and "checksum" in warnings[0]


@pytest.mark.parametrize("damage", ["truncated", "foreign", "garbage", "renamed"])
async def test_bad_files_are_ignored_with_one_warning(model: GGUFModel, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      damage: str) -> None:
    d = tmp_path / "kv"
    p = await fill_disk(model, d)
    async with running(model, None, mem=False) as off:
        want = {k: (await ask(off, p[k]))[0] for k in ("c", "d")}
    before = {f.name: f.read_bytes() for f in d.glob("*.kv")}
    kv_type = "f16"
    for f in d.glob("*.kv"):
        if damage == "truncated":
            f.write_bytes(f.read_bytes()[:-100])
        elif damage == "garbage":
            f.write_bytes(random.Random(3).randbytes(4000))
        elif damage == "renamed":  # its name is not its tokens' hash
            f.rename(d / ("0" * 32 + ".kv"))
            break
    if damage == "foreign":
        kv_type = "f32"  # another KV type: another salt, another layout
    caplog.set_level(logging.WARNING)
    async with running(model, d, kv_type=kv_type) as rt:
        got = {k: await ask(rt, p[k]) for k in ("c", "d")}
        info = rt.prefix_cache()
    warnings = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert info is not None and info.stats.failed == 0  # refused at the start: never looked up
    if damage == "renamed":  # the other file is fine
        assert len(warnings) == 1 and "name" in warnings[0]
        assert sorted(c for _, c in got.values()) == [0, 50] and info.stats.tiers["disk"].hits == 1
    else:
        assert len(warnings) == len(before) == 2
        assert {k: c for k, (_, c) in got.items()} == {"c": 0, "d": 0} and info.stats.tiers["disk"].hits == 0
    if kv_type == "f16":
        assert {k: ids for k, (ids, _) in got.items()} == want
    if damage == "foreign":  # another model's files are left alone
        assert {f.name: f.read_bytes() for f in d.glob("*.kv") if f.name in before} == before
