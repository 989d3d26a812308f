"""Slice downloads and model manifests over HTTP (shell: Starlette endpoints over ``SliceCache``,
which serves each slice file as its header plus ``pread`` ranges of the GGUF: no copy on disk).

Routes (DESIGN §11):

- ``GET /v1/models/{model_id}/manifest`` -> ``swarm.protocol.manifest.ModelManifest`` as JSON.
- ``GET|HEAD /v1/slices/{model_id}/{layer}/{lo}-{hi}`` -> the slice file.

Rules:
- ``ETag`` is the quoted sha256 of the file (a strong validator: the file is byte-deterministic).
  ``If-None-Match`` that matches -> 304. A single ``Range: bytes=a-b`` / ``bytes=a-`` /
  ``bytes=-n`` -> 206 with ``Content-Range``; a range starting past the end -> 416 with
  ``Content-Range: bytes */size``; ``If-Range`` that is not exactly our ETag -> the full 200. A Range
  header we do not understand (other unit, several ranges, bad syntax) is ignored, as RFC 9110
  allows, and the full file is sent.
- Describing a slice (its sha256, once per slice) and reading its bytes run in worker threads
  behind a ``CapacityLimiter``, never on the event loop; bytes are read 1 MiB at a time with
  ``pread`` and dropped from the page cache, so serving a 17 GB model's slices does not grow RSS.
- Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` with stable codes:
  ``unknown_model`` (404), ``bad_slice_range`` (400), ``range_not_satisfiable`` (416),
  ``slice_unavailable`` (500).
- The range decision (``plan_range``, ``etag_matches``) is pure and tested without a server.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from typing import NamedTuple

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from swarm.errors import SliceError, SwarmError
from swarm.model.gguf import GGUFModel
from swarm.model.slices import SliceCache, SliceFile, build_manifest, check_slice_range
from swarm.protocol.http import encode_error
from swarm.protocol.manifest import ModelManifest

__all__ = ["ByteRange", "RangeVerdict", "etag_matches", "plan_range", "slice_routes"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_CUT_THREADS = 2
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)", re.IGNORECASE)
_NUMBER = re.compile(r"[0-9]{1,9}")  # bounded: Python refuses to convert 4,300+ digits
_SPAN = re.compile(r"([0-9]{1,9})-([0-9]{1,9})")


class ByteRange(NamedTuple):
    start: int
    end: int  # exclusive


class RangeVerdict(enum.Enum):
    FULL = "full"  # no usable Range: send the whole file with 200
    UNSATISFIABLE = "unsatisfiable"  # 416


def etag_matches(header: str | None, etag: str) -> bool:
    """Weak comparison of an ``If-None-Match`` list (or ``*``) against ``etag``."""
    if header is None:
        return False
    want = etag.removeprefix("W/")
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/") == want:
            return True
    return False


def plan_range(range_header: str | None, if_range: str | None, etag: str, size: int) -> ByteRange | RangeVerdict:
    """What to send for a GET of a ``size``-byte file whose strong ETag is ``etag``."""
    if range_header is None:
        return RangeVerdict.FULL
    if if_range is not None and if_range.strip() != etag:  # strong comparison; we send no Last-Modified
        return RangeVerdict.FULL
    m = _RANGE.fullmatch(range_header.strip())
    if m is None:
        return RangeVerdict.FULL
    first, last = m.groups()
    if first:
        start = int(first)
        end = min(int(last) + 1, size) if last else size
        if last and int(last) < start:
            return RangeVerdict.FULL  # syntactically invalid: ignore it
        if start >= size:
            return RangeVerdict.UNSATISFIABLE
        return ByteRange(start, end)
    if not last:
        return RangeVerdict.FULL  # "bytes=-"
    suffix = int(last)
    if suffix == 0:
        return RangeVerdict.UNSATISFIABLE
    return ByteRange(max(0, size - suffix), size)


def _error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(encode_error(status, code, message), status_code=status, headers=dict(headers or {}), media_type="application/json")


class _FileSpan(Response):
    """Streams ``[start, end)`` of a slice file; stops early when the client goes away."""

    def __init__(self, sf: SliceFile, span: ByteRange, status: int, headers: Mapping[str, str],
                 limiter: trio.CapacityLimiter) -> None:
        self.sf = sf
        self.span = span
        self.limiter = limiter
        self.status_code = status
        self.background = None
        self.media_type = "application/octet-stream"
        self.init_headers({**headers, "content-length": str(span.end - span.start)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if scope["method"] == "HEAD" or self.span.start == self.span.end:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            await self._stream(send)
            nursery.cancel_scope.cancel()

    async def _stream(self, send: Send) -> None:
        pos, end = self.span
        pieces = self.sf.read(pos, end, _CHUNK)
        try:
            while pos < end:
                chunk = await trio.to_thread.run_sync(next, pieces, b"", limiter=self.limiter)
                if not chunk:
                    raise SliceError(f"slice {self.sf.path} ended early at byte {pos} of {end}")
                pos += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": pos < end})
        finally:
            pieces.close()  # its file descriptor, and the pages it read dropped


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class _SliceEndpoints:
    def __init__(self, models: Mapping[str, GGUFModel], caches: Mapping[str, SliceCache],
                 manifests: Mapping[str, ModelManifest] | None) -> None:
        self.models = models
        self.caches = caches
        self.limiter = trio.CapacityLimiter(_CUT_THREADS)
        self.manifests: dict[str, ModelManifest] = dict(manifests or {})

    def _unknown(self, model_id: str) -> Response:
        hosted = ", ".join(sorted(self.models)) or "none"
        return _error(404, "unknown_model", f"model {model_id!r} is not hosted here (hosted: {hosted})")

    async def manifest(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        model = self.models.get(model_id)
        if model is None:
            return self._unknown(model_id)
        manifest = self.manifests.get(model_id)
        if manifest is None:  # not built by the caller: hashing the experts reads them all (a worker thread)
            manifest = await trio.to_thread.run_sync(build_manifest, model, limiter=self.limiter)
            self.manifests[model_id] = manifest
        return Response(msgspec.json.encode(manifest), media_type="application/json")

    async def slice(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        model = self.models.get(model_id)
        cache = self.caches.get(model_id)
        if model is None or cache is None:
            return self._unknown(model_id)
        layer_s, span_s = request.path_params["layer"], request.path_params["span"]
        span = _SPAN.fullmatch(span_s)
        if _NUMBER.fullmatch(layer_s) is None or span is None:
            return _error(400, "bad_slice_range", f"bad slice path {layer_s}/{span_s}: expected LAYER/LO-HI, e.g. 0/0-4")
        layer, lo, hi = int(layer_s), int(span.group(1)), int(span.group(2))
        try:
            check_slice_range(model.config, layer, lo, hi)
        except SliceError as exc:
            return _error(400, "bad_slice_range", exc.message)
        try:
            sf: SliceFile = await trio.to_thread.run_sync(cache.get, layer, lo, hi, limiter=self.limiter)
        except SliceError as exc:  # e.g. larger than the whole cache
            return _error(400, "bad_slice_range", exc.message)
        except (SwarmError, OSError) as exc:
            log.exception("cannot cut slice %s %d:%d-%d", model_id, layer, lo, hi)
            return _error(500, "slice_unavailable", f"cannot produce slice {layer}:{lo}-{hi}: {exc}")
        etag = f'"{sf.sha256}"'
        headers = {
            "etag": etag,
            "accept-ranges": "bytes",
            "cache-control": "public, max-age=31536000, immutable",  # the model id pins the content
        }
        if etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        plan = plan_range(request.headers.get("range"), request.headers.get("if-range"), etag, sf.size)
        if plan is RangeVerdict.UNSATISFIABLE:
            return _error(416, "range_not_satisfiable", f"the slice file has {sf.size} bytes",
                          {**headers, "content-range": f"bytes */{sf.size}"})
        if isinstance(plan, ByteRange):
            headers["content-range"] = f"bytes {plan.start}-{plan.end - 1}/{sf.size}"
            return _FileSpan(sf, plan, 206, headers, self.limiter)
        return _FileSpan(sf, ByteRange(0, sf.size), 200, headers, self.limiter)


def slice_routes(models: Mapping[str, GGUFModel], caches: Mapping[str, SliceCache], *,
                 manifests: Mapping[str, ModelManifest] | None = None) -> list[Route]:
    """The manifest and slice-download routes for the hosted ``models`` (keyed by model id);
    ``manifests``: the models' manifests as built at start (else built on first request)."""
    ep = _SliceEndpoints(models, caches, manifests)
    return [
        Route("/v1/models/{model_id}/manifest", ep.manifest, methods=["GET"]),
        Route("/v1/slices/{model_id}/{layer}/{span}", ep.slice, methods=["GET", "HEAD"]),
    ]
