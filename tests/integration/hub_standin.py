"""A local stand-in for the Hugging Face hub (test support): just the endpoints huggingface_hub calls
to list a model repository and download a file from it, served on loopback (``HF_ENDPOINT`` or the
``endpoint`` argument points at it). Nothing reaches the internet.

- ``GET /api/models/{org}/{repo}[/revision/{rev}]``: the repository's commit and files, with each LFS
  file's size and sha256 (``?blobs=true``, as ``model_info(files_metadata=True)`` asks).
- ``HEAD|GET /{org}/{repo}/resolve/{rev}/{path}``: the file, with the headers the client needs
  (``X-Repo-Commit``, ``ETag`` / ``X-Linked-Etag`` = the sha256, ``X-Linked-Size``, ``Accept-Ranges``),
  ``Range`` honoured (206 + ``Content-Range``); a 404 carries ``X-Error-Code`` as the hub's do.

Faults, per file: ``cut_once`` (the first GET stops halfway: the connection breaks), ``truncated``
(the body is shorter than the size the hub announces), ``corrupt`` (one byte differs: same size,
another sha256). Every request is recorded.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["Hub", "HubFileSpec", "HubRequest", "start_hub"]

Fault = Literal["cut_once", "truncated", "corrupt"] | None
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubFileSpec:
    data: bytes
    lfs: bool = True
    fault: Fault = None
    gets: int = 0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def served(self) -> bytes:
        if self.fault == "truncated":
            return self.data[: len(self.data) * 2 // 3]
        if self.fault == "corrupt":
            b = bytearray(self.data)
            b[len(b) // 2] ^= 0xFF
            return bytes(b)
        return self.data


@dataclass(frozen=True)
class HubRequest:
    method: str
    path: str
    range: str | None


@dataclass
class Hub:
    url: str = ""
    repos: dict[str, dict[str, HubFileSpec]] = field(default_factory=dict)
    requests: list[HubRequest] = field(default_factory=list)

    def downloads(self, filename: str) -> list[HubRequest]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename) and "/resolve/" in r.path]


def _not_found(code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=404, headers={"X-Error-Code": code})


def _app(hub: Hub) -> Starlette:
    async def model_info(request: Request) -> Response:
        p = request.path_params
        hub.requests.append(HubRequest("GET", request.url.path, None))
        repo = f"{p['org']}/{p['repo']}"
        files = hub.repos.get(repo)
        if files is None:
            return _not_found("RepoNotFound", "Repository not found")
        siblings = []
        for name, f in sorted(files.items()):
            s: dict[str, object] = {"rfilename": name}
            if request.query_params.get("blobs") in ("true", "True", "1"):
                s["size"] = len(f.data)
                s["blobId"] = hashlib.sha1(f.data).hexdigest()
                if f.lfs:
                    s["lfs"] = {"size": len(f.data), "sha256": f.sha256, "pointerSize": 134}
            siblings.append(s)
        return JSONResponse({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings})

    async def resolve(request: Request) -> Response:
        p = request.path_params
        rng = request.headers.get("range")
        hub.requests.append(HubRequest(request.method, request.url.path, rng))
        files = hub.repos.get(f"{p['org']}/{p['repo']}")
        if files is None:
            return _not_found("RepoNotFound", "Repository not found")
        f = files.get(p["path"])
        if f is None or p["rev"] not in ("main", COMMIT):
            return _not_found("EntryNotFound", "Entry not found")
        body = f.served()
        etag = f'"{f.sha256}"' if f.lfs else f'"{hashlib.sha1(f.data).hexdigest()}"'
        headers = {"X-Repo-Commit": COMMIT, "ETag": etag, "Accept-Ranges": "bytes"}
        if f.lfs:
            headers |= {"X-Linked-Etag": etag, "X-Linked-Size": str(len(f.data))}
        if request.method == "HEAD":
            return Response(b"", headers=headers | {"Content-Length": str(len(body))})
        f.gets += 1
        start, status = 0, 200
        if rng is not None and rng.startswith("bytes=") and rng.endswith("-"):
            start, status = int(rng[6:-1]), 206
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        part = body[start:]
        cut = f.fault == "cut_once" and f.gets == 1

        async def chunks() -> AsyncIterator[bytes]:
            step = 64 << 10
            for i in range(0, len(part), step):
                if cut and i >= len(part) // 2:
                    raise ConnectionAbortedError("the stand-in hub cuts this transfer halfway")
                yield part[i:i + step]

        return StreamingResponse(chunks(), status_code=status, headers=headers | {"Content-Length": str(len(part))},
                                 media_type="application/octet-stream")

    return Starlette(routes=[
        Route("/api/models/{org}/{repo}", model_info, methods=["GET"]),
        Route("/api/models/{org}/{repo}/revision/{rev}", model_info, methods=["GET"]),
        Route("/{org}/{repo}/resolve/{rev}/{path:path}", resolve, methods=["GET", "HEAD"]),
    ])


async def start_hub(nursery: trio.Nursery, repos: dict[str, dict[str, HubFileSpec]]) -> Hub:
    hub = Hub(repos=repos)
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    binds = await nursery.start(serve, _app(hub), hc)
    hub.url = str(binds[0])
    return hub
