"""Slice HTTP routes on a real hypercorn (trio) server, and ``fetch_slice`` against it."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.slices import ByteRange, RangeVerdict, etag_matches, plan_range, slice_routes
from swarm.errors import SliceError
from swarm.model.fetch import fetch_slice
from swarm.model.gguf import GGUFModel
from swarm.model.slices import SliceCache, build_manifest, cut_slice
from swarm.progress import Transfers, TransferView
from swarm.protocol.manifest import ModelManifest

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden" / "qwen3moe-tiny-f32.gguf"
LAYER, LO, HI = 1, 2, 6


# -- pure range decisions -------------------------------------------------------------------------

E = '"abc"'


@pytest.mark.parametrize(
    ("range_", "if_range", "want"),
    [
        (None, None, RangeVerdict.FULL),
        ("bytes=0-99", None, ByteRange(0, 100)),
        ("bytes=10-", None, ByteRange(10, 1000)),
        ("bytes=990-5000", None, ByteRange(990, 1000)),
        ("bytes=999-999", None, ByteRange(999, 1000)),
        ("bytes=-10", None, ByteRange(990, 1000)),
        ("bytes=-5000", None, ByteRange(0, 1000)),
        ("BYTES=1-2", None, ByteRange(1, 3)),
        ("bytes=1000-", None, RangeVerdict.UNSATISFIABLE),
        ("bytes=1000-2000", None, RangeVerdict.UNSATISFIABLE),
        ("bytes=-0", None, RangeVerdict.UNSATISFIABLE),
        ("bytes=5-3", None, RangeVerdict.FULL),  # invalid: ignored
        ("bytes=0-1,5-6", None, RangeVerdict.FULL),  # several ranges: ignored
        ("items=0-1", None, RangeVerdict.FULL),
        ("bytes=-", None, RangeVerdict.FULL),
        ("bytes=x-1", None, RangeVerdict.FULL),
        ("bytes=10-", E, ByteRange(10, 1000)),
        ("bytes=10-", '"other"', RangeVerdict.FULL),
        ("bytes=10-", "W/" + E, RangeVerdict.FULL),  # If-Range needs a strong match
        ("bytes=10-", "Sat, 01 Jan 2000 00:00:00 GMT", RangeVerdict.FULL),
        ("bytes=2000-", '"other"', RangeVerdict.FULL),  # a mismatched If-Range wins over a 416
    ],
)
def test_plan_range(range_: str | None, if_range: str | None, want: ByteRange | RangeVerdict) -> None:
    assert plan_range(range_, if_range, E, 1000) == want


@pytest.mark.parametrize(
    ("header", "want"),
    [(None, False), (E, True), ("W/" + E, True), ('"x", ' + E, True), ("*", True), ('"x"', False), ('"ab"', False)],
)
def test_etag_matches(header: str | None, want: bool) -> None:
    assert etag_matches(header, E) is want


# -- a real server --------------------------------------------------------------------------------


@dataclass
class Served:
    method: str
    path: str
    headers: dict[str, str]
    status: int = 0
    body_bytes: int = 0


@dataclass
class Recorder:
    """ASGI middleware that records every request and counts the body bytes sent back."""

    app: ASGIApp
    requests: list[Served] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rec = Served(scope["method"], scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]})
        self.requests.append(rec)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
            elif message["type"] == "http.response.body":
                rec.body_bytes += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counting_send)

    def slice_requests(self) -> list[Served]:
        return [r for r in self.requests if "/slices/" in r.path or r.path.startswith(("/corrupt", "/flaky"))]


@dataclass
class Server:
    url: str
    recorder: Recorder
    model: GGUFModel
    data: bytes  # the slice file LAYER:LO-HI

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def slice_url(self, prefix: str = "/v1/slices") -> str:
        return f"{self.url}{prefix}/{self.model.model_id}/{LAYER}/{LO}-{HI}"


class _HalfThenDie(Response):
    """Announces the whole file, sends half of it, then fails: the connection drops mid-body."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.status_code = 200
        self.background = None
        self.init_headers({"etag": f'"{hashlib.sha256(data).hexdigest()}"', "content-length": str(len(data))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.data[: len(self.data) // 2], "more_body": True})
        raise RuntimeError("simulated crash mid-body")


def build_app(model: GGUFModel, cache: SliceCache, data: bytes) -> Recorder:
    sha = hashlib.sha256(data).hexdigest()
    corrupted = bytearray(data)
    corrupted[len(data) // 3] ^= 0x01
    flaky_calls = 0

    async def corrupt(request: Request) -> Response:
        return Response(bytes(corrupted), headers={"etag": f'"{sha}"'}, media_type="application/octet-stream")

    async def flaky(request: Request) -> Response:
        nonlocal flaky_calls
        flaky_calls += 1
        if flaky_calls == 1:
            return _HalfThenDie(data)
        plan = plan_range(request.headers.get("range"), request.headers.get("if-range"), f'"{sha}"', len(data))
        assert isinstance(plan, ByteRange)
        return Response(data[plan.start : plan.end], status_code=206, headers={
            "etag": f'"{sha}"', "content-range": f"bytes {plan.start}-{plan.end - 1}/{len(data)}"})

    routes = [
        *slice_routes({model.model_id: model}, {model.model_id: cache}),
        Route("/corrupt/{model_id}/{layer}/{span}", corrupt),
        Route("/flaky/{model_id}/{layer}/{span}", flaky),
    ]
    return Recorder(Starlette(routes=routes))


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(GOLDEN)


@pytest.fixture
async def server(nursery: trio.Nursery, model: GGUFModel, tmp_path: Path) -> AsyncIterator[Server]:
    data = cut_slice(model, LAYER, LO, HI)
    recorder = build_app(model, SliceCache(model, tmp_path / "cache"), data)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1
    shutdown = trio.Event()
    binds = await nursery.start(partial(serve, recorder, config, shutdown_trigger=shutdown.wait))  # type: ignore[arg-type]
    yield Server(binds[0], recorder, model, data)
    shutdown.set()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


# -- routes ---------------------------------------------------------------------------------------


async def test_manifest_route(server: Server, client: httpx.AsyncClient) -> None:
    r = await client.get(f"{server.url}/v1/models/{server.model.model_id}/manifest")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert msgspec.json.decode(r.content, type=ModelManifest) == build_manifest(server.model)
    r = await client.get(f"{server.url}/v1/models/nope-000000000000/manifest")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_model"
    assert set(r.json()["error"]) >= {"message", "type", "code"}


async def test_full_download(server: Server, client: httpx.AsyncClient) -> None:
    r = await client.get(server.slice_url())
    assert r.status_code == 200
    assert r.content == server.data
    assert r.headers["etag"] == f'"{server.sha}"'
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["content-length"] == str(len(server.data))
    r = await client.head(server.slice_url())
    assert (r.status_code, r.content, r.headers["content-length"]) == (200, b"", str(len(server.data)))
    assert r.headers["etag"] == f'"{server.sha}"'


async def test_ranges_and_conditionals(server: Server, client: httpx.AsyncClient) -> None:
    url, data, n, etag = server.slice_url(), server.data, len(server.data), f'"{server.sha}"'
    for header, (a, b) in [("bytes=100-4195", (100, 4196)), (f"bytes={n - 7}-", (n - 7, n)), ("bytes=-50", (n - 50, n))]:
        r = await client.get(url, headers={"Range": header})
        assert r.status_code == 206, header
        assert r.content == data[a:b]
        assert r.headers["content-range"] == f"bytes {a}-{b - 1}/{n}"
        assert r.headers["content-length"] == str(b - a)
    r = await client.get(url, headers={"Range": f"bytes={n}-"})
    assert r.status_code == 416
    assert r.headers["content-range"] == f"bytes */{n}"
    assert r.json()["error"]["code"] == "range_not_satisfiable"
    r = await client.get(url, headers={"Range": "bytes=10-", "If-Range": etag})
    assert (r.status_code, r.content) == (206, data[10:])
    r = await client.get(url, headers={"Range": "bytes=10-", "If-Range": '"stale"'})
    assert (r.status_code, r.content) == (200, data)
    r = await client.get(url, headers={"If-None-Match": etag})
    assert (r.status_code, r.content, r.headers["etag"]) == (304, b"", etag)
    r = await client.get(url, headers={"If-None-Match": '"stale"'})
    assert (r.status_code, r.content) == (200, data)


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/slices/nope-000000000000/0/0-1", 404, "unknown_model"),
        ("/v1/slices/{id}/0/4-2", 400, "bad_slice_range"),
        ("/v1/slices/{id}/0/0-9", 400, "bad_slice_range"),
        ("/v1/slices/{id}/2/0-1", 400, "bad_slice_range"),
        ("/v1/slices/{id}/x/0-1", 400, "bad_slice_range"),
        ("/v1/slices/{id}/0/0_1", 400, "bad_slice_range"),
        ("/v1/slices/{id}/0/" + "9" * 5000 + "-1", 400, "bad_slice_range"),  # no int() of 5,000 digits
        ("/v1/slices/{id}/" + "1" * 5000 + "/0-1", 400, "bad_slice_range"),
    ],
)
async def test_slice_errors(server: Server, client: httpx.AsyncClient, path: str, status: int, code: str) -> None:
    r = await client.get(server.url + path.format(id=server.model.model_id))
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


# -- fetch_slice ----------------------------------------------------------------------------------


def sibling(dest: Path, suffix: str) -> Path:
    return dest.with_name(dest.name + suffix)


async def test_fetch_downloads_verifies_and_caches(server: Server, client: httpx.AsyncClient, tmp_path: Path) -> None:
    dest = tmp_path / "dl" / "slice.safetensors"
    seen: list[tuple[str, TransferView]] = []
    progress = Transfers(lambda v, event: seen.append((event, v)), min_interval_s=0)
    assert await fetch_slice(client, server.slice_url(), dest, expected_sha256=server.sha, progress=progress) == dest
    assert dest.read_bytes() == server.data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["slice.safetensors"]
    # the progress: counted from zero to the whole file, under the slice's name
    assert seen[0][0] == "start" and seen[0][1].name == "slice.safetensors" and seen[0][1].total == len(server.data)
    assert seen[-1][0] == "end" and seen[-1][1].done == len(server.data) and progress.running() == []
    served = server.recorder.slice_requests()
    assert [(r.status, r.body_bytes) for r in served] == [(200, len(server.data))]

    # cached: with a known digest no request at all; without one, a conditional GET answered 304
    await fetch_slice(client, server.slice_url(), dest, expected_sha256=server.sha.upper())
    assert len(server.recorder.slice_requests()) == 1
    await fetch_slice(client, server.slice_url(), dest, expected_sha256=None)
    last = server.recorder.slice_requests()[-1]
    assert (last.status, last.body_bytes, last.headers["if-none-match"]) == (304, 0, f'"{server.sha}"')
    assert dest.read_bytes() == server.data


async def test_fetch_resumes_a_part_file(server: Server, client: httpx.AsyncClient, tmp_path: Path) -> None:
    dest = tmp_path / "slice.safetensors"
    half = len(server.data) // 2
    sibling(dest, ".part").write_bytes(server.data[:half])
    await fetch_slice(client, server.slice_url(), dest, expected_sha256=server.sha)
    assert dest.read_bytes() == server.data
    assert not sibling(dest, ".part").exists()
    (r,) = server.recorder.slice_requests()
    assert r.headers["range"] == f"bytes={half}-"
    assert r.headers["if-range"] == f'"{server.sha}"'
    assert (r.status, r.body_bytes) == (206, len(server.data) - half)


async def test_fetch_restarts_when_the_part_is_stale(server: Server, client: httpx.AsyncClient,
                                                     tmp_path: Path) -> None:
    n, half = len(server.data), len(server.data) // 2
    # 1. the part was started against another file (its recorded ETag differs): the server answers 200
    dest = tmp_path / "a.safetensors"
    sibling(dest, ".part").write_bytes(b"\xee" * half)
    sibling(dest, ".part.etag").write_text('"' + "0" * 64 + '"')
    await fetch_slice(client, server.slice_url(), dest, expected_sha256=None)
    assert dest.read_bytes() == server.data
    assert [(r.status, r.body_bytes) for r in server.recorder.slice_requests()] == [(200, n)]
    # 2. the part is garbage under the right ETag: resuming fails the check, so it starts again from zero
    dest = tmp_path / "b.safetensors"
    sibling(dest, ".part").write_bytes(b"\xee" * half)
    await fetch_slice(client, server.slice_url(), dest, expected_sha256=server.sha)
    assert dest.read_bytes() == server.data
    assert [(r.status, r.body_bytes) for r in server.recorder.slice_requests()[1:]] == [(206, n - half), (200, n)]
    assert not sibling(dest, ".part").exists() and not sibling(dest, ".part.etag").exists()


async def test_fetch_retries_an_interrupted_transfer(server: Server, client: httpx.AsyncClient,
                                                     tmp_path: Path) -> None:
    dest = tmp_path / "slice.safetensors"
    n, half = len(server.data), len(server.data) // 2
    await fetch_slice(client, server.slice_url("/flaky"), dest, expected_sha256=None, backoff=0.01)
    assert dest.read_bytes() == server.data
    first, second = server.recorder.slice_requests()
    assert (first.status, first.body_bytes) == (200, half)
    assert second.headers["range"] == f"bytes={half}-"
    assert second.headers["if-range"] == f'"{server.sha}"'  # the ETag recorded when the part was started
    assert (second.status, second.body_bytes) == (206, n - half)


@pytest.mark.parametrize("expected", [None, "known"])
async def test_fetch_rejects_corrupted_bytes(server: Server, client: httpx.AsyncClient, tmp_path: Path,
                                             expected: str | None) -> None:
    dest = tmp_path / "dl" / "slice.safetensors"
    with pytest.raises(SliceError, match="sha256"):
        await fetch_slice(client, server.slice_url("/corrupt"), dest,
                          expected_sha256=server.sha if expected else None)
    assert list(dest.parent.iterdir()) == []
    assert len(server.recorder.slice_requests()) == 1


async def test_fetch_wrong_expected_digest_and_http_errors(server: Server, client: httpx.AsyncClient,
                                                           tmp_path: Path) -> None:
    dest = tmp_path / "dl" / "slice.safetensors"
    with pytest.raises(SliceError, match="expected"):
        await fetch_slice(client, server.slice_url(), dest, expected_sha256="0" * 64)
    with pytest.raises(SliceError, match="404.*not hosted"):
        await fetch_slice(client, f"{server.url}/v1/slices/nope-000000000000/0/0-1", dest,
                          expected_sha256=None)
    assert [r.status for r in server.recorder.slice_requests()] == [200, 404]  # no retries of a 4xx
    assert list(dest.parent.iterdir()) == []
    with pytest.raises(SliceError, match="64 hex"):
        await fetch_slice(client, server.slice_url(), dest, expected_sha256="abc")
