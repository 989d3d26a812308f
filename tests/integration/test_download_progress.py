"""A volunteer's download progress (``volunteer.progress``), read back from the part files of the real
per-expert downloader (``swarm.model.sources``) stopped half-way, and from the single-file
downloader's growing ``.part``; what the heartbeat's ``download`` field carries to the dashboard."""

from __future__ import annotations

from pathlib import Path

import trio

from swarm.model.gguf import GGUFModel
from swarm.model.slices import SlicePlan, build_manifest, plan_slice
from swarm.model.sources import fetch_slice_from
from tests.conftest import FIXTURES
from volunteer.progress import downloaded_bytes


class StallingSource:
    """An origin that serves the GGUF's bytes for the first ``serve`` expert groups, then waits."""

    name = "origin test"

    def __init__(self, model: GGUFModel, serve: int) -> None:
        self.model, self.serve, self.groups = model, serve, 0
        self.stalled = trio.Event()
        self.go_on = trio.Event()

    async def read(self, plan: SlicePlan, kind: str, e_lo: int, e_hi: int) -> bytes:
        if kind == plan.kinds[0]:
            self.groups += 1
        if self.groups > self.serve:
            self.stalled.set()
            await self.go_on.wait()
        off = plan.gguf_offset(kind, e_lo)
        assert off is not None
        async with await trio.open_file(self.model.path, "rb") as f:
            await f.seek(off)
            return await f.read((e_hi - e_lo) * plan.kind_bytes[kind])

    async def aclose(self) -> None:
        pass


async def test_progress_of_a_per_expert_download_stopped_half_way(tmp_path: Path) -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-f32.gguf")
    manifest = build_manifest(model)
    plan = plan_slice(manifest, 0, 0, 8)
    dest = tmp_path / "0-0-8.safetensors"
    assert downloaded_bytes(dest, plan.size, 0, 8) == 0  # nothing on disk yet
    src = StallingSource(model, serve=3)
    async with trio.open_nursery() as n:
        n.start_soon(lambda: fetch_slice_from([src], manifest, 0, 0, 8, dest, group_bytes=plan.bytes_per_expert,
                                              timeout_s=60.0))
        await src.stalled.wait()  # three one-expert groups written and recorded, the fourth asked for
        assert downloaded_bytes(dest, plan.size, 0, 8) == plan.size * 3 // 8
        src.go_on.set()
    assert dest.is_file() and dest.stat().st_size == plan.size
    assert downloaded_bytes(dest, plan.size, 0, 8) == 0  # done: the part files are gone


def test_progress_of_a_single_file_download_and_bad_records(tmp_path: Path) -> None:
    dest = tmp_path / "s.safetensors"
    dest.with_name(dest.name + ".part").write_bytes(b"x" * 300)  # swarm.model.fetch: the part grows
    assert downloaded_bytes(dest, 1000, 0, 4) == 300
    assert downloaded_bytes(dest, 200, 0, 4) == 200  # never more than the slice
    done = dest.with_name(dest.name + ".part.done")
    done.write_text("header\n0-2\nnonsense\n2-x\n3-9\n")  # 0, 1, then 3 (clipped to the slice): 3 of 4
    assert downloaded_bytes(dest, 1000, 0, 4) == 750
