"""``fetch_slice_from`` over real HTTP servers on loopback (hypercorn, trio): an origin mirror serving
the GGUF file with Range (Starlette's ``FileResponse``), the coordinator's slice routes, a mirror
whose copy is corrupted, one that ignores Range and one that is briefly unavailable. The file
rebuilt from the manifest alone is byte-identical to ``cut_slice``."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from coordinator.api.slices import slice_routes
from swarm.errors import SliceError
from swarm.model.gguf import GGUFModel
from swarm.model.slices import SliceCache, SlicePlan, build_manifest, cut_slice, plan_slice
from swarm.model.sources import CoordinatorSource, OriginSource, fetch_slice_from
from swarm.progress import Transfers
from swarm.protocol.manifest import ModelManifest
from tests.conftest import FIXTURES

GGUF = FIXTURES / "golden" / "qwen3moe-small-w224-q4_k_m.gguf"  # 4 layers x 16 experts, Q4_K / Q5_0
LAYER, LO, HI = 2, 3, 11
GROUP = 260_000  # two experts of layer 2 (125,440 bytes each) a group: four groups


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(GGUF)


@pytest.fixture(scope="module")
def manifest(model: GGUFModel) -> ModelManifest:
    return build_manifest(model)


@pytest.fixture(scope="module")
def want(model: GGUFModel) -> bytes:
    return cut_slice(model, LAYER, LO, HI)


async def serve_app(nursery: trio.Nursery, app: Starlette) -> str:
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    binds = await nursery.start(serve, app, hc)
    return str(binds[0])


def file_app(path: Path, *, before: Callable[[Request], Awaitable[Response | None]] | None = None) -> Starlette:
    async def gguf(request: Request) -> Response:
        if before is not None and (early := await before(request)) is not None:
            return early
        return FileResponse(path)

    return Starlette(routes=[Route("/models/m.gguf", gguf)])


def corrupted_copy(tmp_path: Path, plan: SlicePlan, expert: int) -> Path:
    """The GGUF with one byte of ``expert``'s up data flipped."""
    data = bytearray(GGUF.read_bytes())
    at = (plan.gguf_offset("up", expert) or 0) + 17
    data[at] ^= 0xFF
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.fixture
async def coordinator_url(nursery: trio.Nursery, model: GGUFModel, tmp_path: Path) -> str:
    caches = {model.model_id: SliceCache(model, tmp_path / "slices")}
    base = await serve_app(nursery, Starlette(routes=slice_routes({model.model_id: model}, caches)))
    return f"{base}/v1/slices/{model.model_id}/{LAYER}/{LO}-{HI}"


def overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def names(directory: Path, prefix: str = "") -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_an_origin_mirror_gives_the_coordinators_file(nursery: trio.Nursery, manifest: ModelManifest, want: bytes,
                                                            tmp_path: Path) -> None:
    origin = await serve_app(nursery, file_app(GGUF)) + "/models/m.gguf"
    dest = tmp_path / "out" / "s.safetensors"
    async with httpx.AsyncClient() as client:
        src = OriginSource(client, origin)
        res = await fetch_slice_from([src], manifest, LAYER, LO, HI, dest, expected_sha256=sha(want), group_bytes=GROUP)
        assert dest.read_bytes() == want
        plan = plan_slice(manifest, LAYER, LO, HI)
        assert res.bytes_from == {src.name: len(want) - len(plan.header)}
        assert (res.failed, res.lied, res.resumed_bytes, res.cached) == ({}, [], 0, False)
        assert names(dest.parent) == ["s.safetensors"]  # no part left behind
        # already there: nothing is downloaded, with or without the expected digest
        for expected in (sha(want), None):
            again = await fetch_slice_from([src], manifest, LAYER, LO, HI, dest, expected_sha256=expected)
            assert again.cached and again.bytes_from == {}


async def test_wrong_bytes_and_a_mirror_without_range_are_dropped_and_the_next_source_continues(
        nursery: trio.Nursery, manifest: ModelManifest, want: bytes, coordinator_url: str, tmp_path: Path) -> None:
    plan = plan_slice(manifest, LAYER, LO, HI)
    liar = await serve_app(nursery, file_app(corrupted_copy(tmp_path, plan, LO + 2))) + "/models/m.gguf"

    async def whole_file(_: Request) -> Response:
        return Response(GGUF.read_bytes(), media_type="application/octet-stream")  # ignores Range: 200

    no_range = await serve_app(nursery, Starlette(routes=[Route("/models/m.gguf", whole_file)])) + "/models/m.gguf"
    dest = tmp_path / "s.safetensors"
    async with httpx.AsyncClient() as client:
        sources = [OriginSource(client, liar), OriginSource(client, no_range),
                   CoordinatorSource(client, coordinator_url, expected_sha256=sha(want))]
        names: set[str] = set()
        progress = Transfers(lambda v, _: names.add(v.name), min_interval_s=0)
        res = await fetch_slice_from(sources, manifest, LAYER, LO, HI, dest, expected_sha256=sha(want),
                                     group_bytes=GROUP, backoff_s=0.01, progress=progress)
    assert dest.read_bytes() == want
    # the progress names the source it reads from (cut to 40 characters)
    assert {n.split(" ")[2] for n in names if " from " in n} == {"origin", "coordinator"}, names
    group = 2 * plan.bytes_per_expert
    # the liar gave the first group (experts 3-4), sent a wrong expert 5 in the second, and was never asked again
    assert res.lied == [sources[0].name]
    assert res.bytes_from == {sources[0].name: group, sources[2].name: len(want) - len(plan.header) - group}
    assert "expert 5" in res.failed[sources[0].name]
    assert res.failed[sources[1].name].startswith("no_range")


async def test_an_interrupted_download_resumes_from_its_verified_groups(
        nursery: trio.Nursery, manifest: ModelManifest, want: bytes, coordinator_url: str, tmp_path: Path) -> None:
    origin = await serve_app(nursery, file_app(GGUF)) + "/models/m.gguf"
    plan = plan_slice(manifest, LAYER, LO, HI)
    group = 2 * plan.bytes_per_expert
    dest = tmp_path / "s.safetensors"
    part, done = tmp_path / "s.safetensors.part", tmp_path / "s.safetensors.part.done"
    async with httpx.AsyncClient() as client:
        origin_src = OriginSource(client, origin)

        class Interrupting:
            """The origin, with the download cancelled (a killed process) during its third group."""

            name = origin_src.name
            reads = 0

            async def read(self, plan: SlicePlan, kind: str, e_lo: int, e_hi: int) -> bytearray:
                self.reads += 1
                if self.reads > 6:
                    scope.cancel()
                    await trio.sleep_forever()
                return await origin_src.read(plan, kind, e_lo, e_hi)

            async def aclose(self) -> None:
                pass

        with trio.CancelScope() as scope:
            await fetch_slice_from([Interrupting()], manifest, LAYER, LO, HI, dest, group_bytes=GROUP)
        assert scope.cancelled_caught and not dest.exists()
        assert done.read_text().splitlines()[1:] == ["3-5", "5-7"]
        # damage the part in the second group: the record is a hint, the hashes decide
        overwrite(part, plan.file_offset("down", 6) + 5, b"\x00\x01\x02")
        coord = CoordinatorSource(client, coordinator_url, expected_sha256=sha(want))
        res = await fetch_slice_from([coord], manifest, LAYER, LO, HI, dest, expected_sha256=sha(want), group_bytes=GROUP)
    assert dest.read_bytes() == want
    assert res.resumed_bytes == group  # experts 3-4 kept; 5-6 failed its check and came again
    assert res.bytes_from == {coord.name: len(want) - len(plan.header) - group}
    assert not part.exists() and not done.exists()


async def test_transient_failures_are_retried_in_a_later_round_and_a_mismatch_is_never_kept(
        nursery: trio.Nursery, manifest: ModelManifest, want: bytes, coordinator_url: str, tmp_path: Path) -> None:
    calls = 0

    async def unavailable_at_first(_: Request) -> Response | None:
        nonlocal calls
        calls += 1
        return Response("busy", status_code=503) if calls <= 2 else None

    flaky = await serve_app(nursery, file_app(GGUF, before=unavailable_at_first)) + "/models/m.gguf"
    dest = tmp_path / "s.safetensors"
    async with httpx.AsyncClient() as client:
        src = OriginSource(client, flaky)
        res = await fetch_slice_from([src], manifest, LAYER, LO, HI, dest, group_bytes=GROUP, rounds=3, backoff_s=0.01)
        assert dest.read_bytes() == want
        assert res.failed[src.name].startswith("http_unavailable") and res.bytes_from[src.name] > 0
        # a coordinator serving another file (its ETag) is unusable; a digest nobody matches is never kept
        other = tmp_path / "t.safetensors"
        wrong = "0" * 64
        coord = CoordinatorSource(client, coordinator_url, expected_sha256=wrong)
        with pytest.raises(SliceError) as ei:
            await fetch_slice_from([coord], manifest, LAYER, LO, HI, other, expected_sha256=wrong, backoff_s=0.01)
        assert ei.value.code == "slice_unavailable" and "source_unusable" in ei.value.message
        with pytest.raises(SliceError) as ei:
            await fetch_slice_from([OriginSource(client, flaky)], manifest, LAYER, LO, HI, other, expected_sha256=wrong)
        assert ei.value.code == "slice_mismatch"
    assert names(tmp_path, "t.") == []


async def test_a_manifest_without_expert_hashes_is_refused(manifest: ModelManifest, tmp_path: Path) -> None:
    old = ModelManifest(model_id=manifest.model_id, arch=manifest.arch, n_layer=manifest.n_layer,
                        n_expert=manifest.n_expert, d_model=manifest.d_model, d_expert=manifest.d_expert,
                        tensor_types=manifest.tensor_types, bytes_per_expert=manifest.bytes_per_expert)
    with pytest.raises(SliceError) as ei:
        await fetch_slice_from([], old, LAYER, LO, HI, tmp_path / "s.safetensors")
    assert ei.value.code == "no_expert_hashes"


async def test_biased_experts_download_from_a_mirror(nursery: trio.Nursery, tmp_path: Path) -> None:
    """gpt-oss: a slice holds MXFP4 weights and F32 biases; each expert's six parts are fetched, hashed
    together against the manifest and assembled into the coordinator's file."""
    path = FIXTURES / "golden" / "gpt-oss-tiny-mxfp4_moe.gguf"
    m = GGUFModel(path)
    man = build_manifest(m)
    want = cut_slice(m, 1, 2, 7)
    origin = await serve_app(nursery, file_app(path)) + "/models/m.gguf"
    dest = tmp_path / "s.safetensors"
    async with httpx.AsyncClient() as client:
        res = await fetch_slice_from([OriginSource(client, origin)], man, 1, 2, 7, dest, expected_sha256=sha(want),
                                     group_bytes=2 * plan_slice(man, 1, 2, 7).bytes_per_expert)
    assert dest.read_bytes() == want and res.lied == []
    assert plan_slice(man, 1, 2, 7).kinds == ("gate", "up", "down", "gate_b", "up_b", "down_b")
