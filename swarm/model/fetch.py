"""Download a slice file: resumable, sha256-verified, cached (shell: HTTP + files, on trio).

Rules:
- ``dest`` only ever holds a complete, verified file: bytes arrive in ``<dest>.part`` and are renamed
  onto ``dest`` after the sha256 check. A failed check deletes the download and raises ``SliceError``.
- The expected digest is ``expected_sha256`` when given, else the server's strong ETag (DESIGN §11:
  the ETag of a slice is its sha256). Without either, the file is kept unverified.
- Resuming: a ``.part`` left by an interrupted download is continued with ``Range: bytes=N-`` and
  ``If-Range: <etag>``, the ETag being the expected digest or the one recorded in
  ``<dest>.part.etag`` when the part was started. A 200 answer means the file changed: start again
  from zero. A resumed download that fails the check is retried once from zero (the old part may be
  what was wrong).
- Cached: an existing ``dest`` with the expected digest is returned without a download; without an
  expected digest, a conditional GET (``If-None-Match``) asks the server whether it is current.
- Transient failures (connection errors, timeouts, 5xx, 408, 429) are retried with exponential
  backoff, resuming from what has arrived; other HTTP errors fail at once with the server's message.
- One fetch per ``dest`` at a time: concurrent fetches of one destination are the caller's to avoid.
- Progress: the bytes of each attempt are counted on ``progress`` (``swarm.progress.Transfers``) when
  given; drawing them is the caller's (a live view, plain log lines).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import httpx
import trio

from swarm.errors import SliceError
from swarm.progress import Transfers
from swarm.protocol.http import error_message

__all__ = ["fetch_slice"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")
_WRITE_CHUNK = 1 << 20
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class _Transient(Exception):
    """A failure worth retrying (after a backoff)."""


class _Restart(Exception):
    """The partial download cannot be continued: drop it and start from zero (no backoff)."""


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _strong_etag(value: str | None) -> str | None:
    if value is None or value.startswith("W/"):
        return None
    return value.strip()


def _digest_from_etag(etag: str | None) -> str | None:
    if etag is None:
        return None
    inner = etag.strip('"').lower()
    return inner if _SHA256.fullmatch(inner) else None


async def fetch_slice(
    client: httpx.AsyncClient,
    url: str,
    dest: Path,
    *,
    expected_sha256: str | None = None,
    progress: Transfers | None = None,
    attempts: int = 4,
    backoff: float = 0.5,
) -> Path:
    """Download ``url`` to ``dest`` (see the module rules) and return ``dest``."""
    target = trio.Path(dest)
    part = target.with_name(target.name + ".part")
    tag_file = target.with_name(target.name + ".part.etag")
    expected = expected_sha256.lower() if expected_sha256 is not None else None
    if expected is not None and _SHA256.fullmatch(expected) is None:
        raise SliceError(f"expected sha256 {expected_sha256!r} is not 64 hex digits")
    await target.parent.mkdir(parents=True, exist_ok=True)

    if_none_match = None
    if await target.is_file():
        have = await trio.to_thread.run_sync(_sha256_of, Path(dest))
        if have == expected:
            return Path(dest)
        if expected is None:
            if_none_match = f'"{have}"'

    retried_from_zero = False
    failures = restarts = 0
    while True:
        try:
            status, resumed, etag = await _download_once(
                client, url, part, tag_file, expected=expected, if_none_match=if_none_match, progress=progress
            )
        except _Restart as exc:
            await _discard(part, tag_file)
            restarts += 1
            if restarts > attempts:
                raise SliceError(f"download of {url} cannot be resumed: {exc}") from exc
            continue
        except _Transient as exc:
            failures += 1
            if failures >= attempts:
                raise SliceError(f"download of {url} failed after {attempts} attempts: {exc}") from exc
            await trio.sleep(backoff * 2 ** (failures - 1))
            continue
        if status == 304:
            return Path(dest)
        want = expected or _digest_from_etag(etag)
        if want is not None:
            got = await trio.to_thread.run_sync(_sha256_of, Path(part))
            if got != want:
                await _discard(part, tag_file)
                if resumed and not retried_from_zero:
                    retried_from_zero = True
                    continue
                raise SliceError(f"download of {url} has sha256 {got}, expected {want}: discarded")
        await part.replace(target)
        await _discard(tag_file)
        return Path(dest)


async def _discard(*paths: trio.Path) -> None:
    for p in paths:
        await trio.to_thread.run_sync(_unlink_if_present, Path(p))


def _unlink_if_present(path: Path) -> None:
    path.unlink(missing_ok=True)


async def _download_once(
    client: httpx.AsyncClient,
    url: str,
    part: trio.Path,
    tag_file: trio.Path,
    *,
    expected: str | None,
    if_none_match: str | None,
    progress: Transfers | None,
) -> tuple[int, bool, str | None]:
    """One GET into ``part``; returns (status, whether it continued a part, the response's strong ETag)."""
    offset = (await part.stat()).st_size if await part.is_file() else 0
    validator = f'"{expected}"' if expected is not None else None
    if validator is None and await tag_file.is_file():
        validator = (await tag_file.read_text()).strip() or None
    headers: dict[str, str] = {}
    if offset > 0 and validator is not None:
        headers["range"] = f"bytes={offset}-"
        headers["if-range"] = validator
    else:
        offset = 0
    if if_none_match is not None:
        headers["if-none-match"] = if_none_match
    try:
        async with client.stream("GET", url, headers=headers) as resp:
            etag = _strong_etag(resp.headers.get("etag"))
            if resp.status_code == 304 and if_none_match is not None:
                return 304, False, etag
            if resp.status_code == 416 and offset > 0:
                raise _Restart(f"the server refused to continue at byte {offset}")
            if resp.status_code in _TRANSIENT_STATUS:
                raise _Transient(f"HTTP {resp.status_code}")
            if resp.status_code not in (200, 206):
                body = await resp.aread()
                raise SliceError(f"GET {url}: HTTP {resp.status_code}: {error_message(body)}")
            server_digest = _digest_from_etag(etag)
            if expected is not None and server_digest is not None and server_digest != expected:
                await _discard(part, tag_file)
                raise SliceError(f"{url} serves sha256 {server_digest}, expected {expected}")
            if resp.status_code == 206:
                m = _CONTENT_RANGE.fullmatch(resp.headers.get("content-range", ""))
                if m is None or int(m.group(1)) != offset:
                    raise _Restart(f"asked for bytes {offset}-, got Content-Range {resp.headers.get('content-range')}")
                total = int(m.group(3)) if m.group(3) != "*" else None
                mode = "ab"
            else:
                offset = 0
                length = resp.headers.get("content-length")
                total = int(length) if length is not None and length.isdigit() else None
                mode = "wb"
                if etag is not None:
                    await tag_file.write_text(etag)
                else:
                    await _discard(tag_file)
            await _write_body(resp, part, mode, offset, total, progress=progress, desc=part.name[:-5])
            return resp.status_code, offset > 0, etag
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise _Transient(f"{type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise SliceError(f"GET {url}: {exc}") from exc


async def _write_body(
    resp: httpx.Response, part: trio.Path, mode: str, offset: int, total: int | None, *, progress: Transfers | None,
    desc: str,
) -> None:
    t = progress.start(desc, total, offset) if progress is not None else None
    size = offset
    try:
        async with await trio.open_file(part, mode) as f:
            buf = bytearray()
            try:
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) >= _WRITE_CHUNK:
                        await f.write(bytes(buf))
                        size += len(buf)
                        if t is not None:
                            t.advance(len(buf))
                        buf.clear()
            finally:
                # keep what arrived before a failure: the next attempt resumes after it
                with trio.CancelScope(shield=True):
                    await f.write(bytes(buf))
                size += len(buf)
                if t is not None:
                    t.advance(len(buf))
    finally:
        if progress is not None and t is not None:
            progress.finish(t, ok=total is None or size == total)
    if total is not None and size != total:
        raise _Transient(f"got {size} of {total} bytes")
