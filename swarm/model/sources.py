"""Download a slice from many sources, every byte checked against the manifest (shell: HTTP, files, trio).

The sources (``SliceSource``: read one kind's bytes of experts ``[e_lo, e_hi)``) are tried in the
order given (the market ranks them: peers holding the slice, origin mirrors of the GGUF, then the
coordinators). ``CoordinatorSource`` and ``OriginSource`` are here; the peer source
(``/moe-swarm/slice/1``) is ``swarm.rpc.slice_client.PeerSource``.

Rules:
- The file is rebuilt from the manifest (``swarm.model.slices.plan_slice``): its header is made
  here, byte-identical to the coordinator's, and its data is read in groups of consecutive experts
  (at most ``group_bytes`` for the three kinds together, at least one expert). A group is read
  whole from one source (its three kinds), then every expert of it is checked against the
  manifest's ``expert_sha256`` before a byte of it is written; so a wrong expert always names the
  source that sent it. One group is in memory at a time.
- A source that fails (error, refusal, timeout: ``timeout_s`` plus ``1 / min_rate_bytes_per_s`` a
  byte) is left, and the next source continues at the group it failed on. A source that sent wrong
  bytes (an expert whose sha256 differs), broke its protocol, refused for good (``opted_out``,
  ``not_assigned``, ``not_held``, an HTTP 4xx) or could not be dialled is never asked again in this
  download; one that failed otherwise (a timeout, a network error, ``busy``, ``rate_limited``, HTTP
  5xx) is asked again in a later round (at most ``rounds``, with exponential backoff from
  ``backoff_s``) once every other source has had its turn.
- ``dest`` only ever holds a complete, verified file: groups are written into ``<dest>.part`` at
  their offsets and recorded, once verified, in ``<dest>.part.done``; an interrupted download
  resumes from them (each recorded group is read back and checked again first: the record is a
  hint, the hashes decide). At the end the whole file's sha256 is compared with
  ``expected_sha256`` when given, then the part is fsynced and renamed onto ``dest``.
- An existing ``dest`` that checks out (its sha256 is ``expected_sha256``, or without one, its
  header and every expert match the manifest) is returned without a download.
- HTTP sources read with ``Range`` and require ``206`` with the matching ``Content-Range``; a
  coordinator's ``ETag`` must be the expected sha256 when one is given. Transient HTTP statuses
  (408, 429, 5xx) and network errors are ordinary failures; a ``200`` to a ranged request (Range
  not honoured) or another status makes the source unusable for this download.
- Every source is closed (``aclose``) when the download ends, whatever the outcome.
- A manifest without per-expert hashes (an older coordinator's) cannot be checked per expert:
  ``SliceError`` (code ``no_expert_hashes``); download from the coordinator with
  ``swarm.model.fetch.fetch_slice`` then.
- One download per ``dest`` at a time (the caller's to ensure).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import httpx
import trio

from swarm.errors import DialError, RemoteProtocolError, SliceError, SliceRefused, SwarmError, TransportError
from swarm.model.gguf import file_sha256
from swarm.model.slices import SlicePlan, plan_slice
from swarm.progress import Transfers
from swarm.protocol.manifest import ModelManifest

__all__ = ["CoordinatorSource", "FetchResult", "OriginSource", "SliceSource", "fetch_slice_from"]

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")
_TRANSIENT_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
# refusals that may clear within a download (the others will not: opted out, not assigned, ...)
_TRANSIENT_REFUSALS: Final = frozenset({"busy", "rate_limited", "internal_error"})
_DONE_MAGIC: Final = "moe-swarm-slice-part/1"


class SliceSource(Protocol):
    """One place slice bytes come from."""

    @property
    def name(self) -> str:
        """Who it is, e.g. ``peer 12D3Koo...`` or ``origin https://...`` (logs, progress, results)."""
        ...

    async def read(self, plan: SlicePlan, kind: str, e_lo: int, e_hi: int) -> bytes | bytearray:
        """The ``kind`` bytes of experts ``e_lo .. e_hi-1`` (``(e_hi - e_lo) * plan.kind_bytes[kind]``
        of them). Failures: ``TransportError`` (try again later), ``SliceRefused``, ``RemoteProtocolError``
        or ``SliceError`` (see the module rules for which are retried)."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class FetchResult:
    path: Path
    bytes_from: dict[str, int] = field(default_factory=dict)  # source name -> verified bytes it gave
    failed: dict[str, str] = field(default_factory=dict)  # source name -> its last failure
    lied: list[str] = field(default_factory=list)  # sources that sent wrong bytes
    resumed_bytes: int = 0  # data bytes found verified in an earlier run's part file
    cached: bool = False  # ``dest`` was already complete


class _Lie(Exception):
    """The source sent bytes that are not the manifest's experts."""


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, DialError):
        return False  # a peer we cannot reach now (NAT, gone) will not be reachable in seconds
    if isinstance(exc, trio.TooSlowError | TransportError):
        return True
    return isinstance(exc, SliceRefused) and exc.code in _TRANSIENT_REFUSALS


async def fetch_slice_from(
    sources: Sequence[SliceSource],
    manifest: ModelManifest,
    layer: int,
    lo: int,
    hi: int,
    dest: Path,
    *,
    expected_sha256: str | None = None,
    progress: Transfers | None = None,
    group_bytes: int = 8 << 20,
    rounds: int = 3,
    backoff_s: float = 0.5,
    timeout_s: float = 10.0,
    min_rate_bytes_per_s: float = 256 << 10,
) -> FetchResult:
    """Download slice ``(manifest.model_id, layer, lo, hi)`` to ``dest`` (see the module rules)."""
    try:
        return await _fetch(sources, manifest, layer, lo, hi, Path(dest), expected_sha256=expected_sha256,
                            progress=progress, group_bytes=group_bytes, rounds=rounds, backoff_s=backoff_s,
                            timeout_s=timeout_s, min_rate=min_rate_bytes_per_s)
    finally:
        with trio.CancelScope(shield=True):
            for s in sources:
                with trio.move_on_after(2.0):
                    try:
                        await s.aclose()
                    except Exception as exc:  # noqa: BLE001 - closing is best effort; the outcome stands
                        log.debug("closing slice source %s: %r", s.name, exc)


async def _fetch(sources: Sequence[SliceSource], manifest: ModelManifest, layer: int, lo: int, hi: int, dest: Path, *,
                 expected_sha256: str | None, progress: Transfers | None, group_bytes: int, rounds: int, backoff_s: float,
                 timeout_s: float, min_rate: float) -> FetchResult:
    plan = plan_slice(manifest, layer, lo, hi)
    if not plan.expert_sha256:
        raise SliceError(f"the manifest of {manifest.model_id} has no per-expert hashes (an older coordinator): "
                         "download the slice from the coordinator", code="no_expert_hashes")
    expected = expected_sha256.lower() if expected_sha256 is not None else None
    if expected is not None and _SHA256.fullmatch(expected) is None:
        raise SliceError(f"expected sha256 {expected_sha256!r} is not 64 hex digits")
    result = FetchResult(dest)
    await trio.Path(dest.parent).mkdir(parents=True, exist_ok=True)
    if await trio.Path(dest).is_file() and await trio.to_thread.run_sync(_complete, dest, plan, expected):
        result.cached = True
        return result
    part = dest.with_name(dest.name + ".part")
    done_path = dest.with_name(dest.name + ".part.done")
    done = await trio.to_thread.run_sync(_open_part, part, done_path, plan)
    pending = [g for g in plan.groups(group_bytes) if g not in done]
    result.resumed_bytes = sum((b - a) * plan.bytes_per_expert for a, b in done)
    transfers = progress if progress is not None else Transfers()  # counted either way; shown when given
    # the experts' bytes (the header is made here): those of verified groups a previous attempt left are done
    experts = plan.size - len(plan.header)
    bar = transfers.start(dest.name, experts, experts - sum((b - a) * plan.bytes_per_expert for a, b in pending))
    banned: set[str] = set()
    try:
        for round_no in range(max(1, rounds)):
            if round_no:
                await trio.sleep(backoff_s * 2 ** (round_no - 1))
            for src in sources:
                if not pending:
                    break
                if src.name in banned:
                    continue
                bar.rename(f"{dest.name} from {_short(src.name)}")
                while pending:
                    e_lo, e_hi = pending[0]
                    try:
                        parts = await _read_group(src, plan, e_lo, e_hi, timeout_s, min_rate)
                        await trio.to_thread.run_sync(_check_group, plan, e_lo, e_hi, parts)
                    except _Lie as exc:
                        log.warning("slice %s: %s sent wrong bytes (%s); never asking it again", plan.key, src.name, exc)
                        result.lied.append(src.name)
                        result.failed[src.name] = f"wrong bytes: {exc}"
                        banned.add(src.name)
                        break
                    except (SwarmError, trio.TooSlowError) as exc:
                        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, SwarmError) else \
                            f"{exc.code}: {exc.message}"
                        result.failed[src.name] = reason
                        log.info("slice %s: source %s failed at experts %d-%d (%s)", plan.key, src.name, e_lo, e_hi,
                                 reason)
                        if not _transient(exc):
                            banned.add(src.name)
                        break
                    await trio.to_thread.run_sync(_write_group, part, done_path, plan, e_lo, e_hi, parts)
                    n = sum(len(p) for p in parts.values())
                    result.bytes_from[src.name] = result.bytes_from.get(src.name, 0) + n
                    bar.advance(n)
                    pending.pop(0)
                    del parts
            if not pending or all(s.name in banned for s in sources):
                break
    finally:
        transfers.finish(bar, ok=not pending)
    if pending:
        why = "; ".join(f"{k}: {v}" for k, v in result.failed.items()) or "no sources"
        raise SliceError(f"slice {plan.key} of {manifest.model_id}: {len(pending)} expert groups could not be "
                         f"downloaded ({why})", code="slice_unavailable")
    got = await trio.to_thread.run_sync(file_sha256, part)
    if expected is not None and got != expected:
        await trio.to_thread.run_sync(_discard, part, done_path)
        raise SliceError(f"slice {plan.key} of {manifest.model_id} rebuilt from the manifest has sha256 {got}, "
                         f"expected {expected}: the manifest and the coordinator disagree; discarded",
                         code="slice_mismatch")
    await trio.to_thread.run_sync(_finish, part, done_path, dest)
    return result


def _short(name: str) -> str:
    return name if len(name) <= 40 else name[:37] + "..."


async def _read_group(src: SliceSource, plan: SlicePlan, e_lo: int, e_hi: int, timeout_s: float,
                      min_rate: float) -> dict[str, bytes | bytearray]:
    parts: dict[str, bytes | bytearray] = {}
    for kind in plan.kinds:
        want = (e_hi - e_lo) * plan.kind_bytes[kind]
        with trio.fail_after(timeout_s + want / min_rate):
            data = await src.read(plan, kind, e_lo, e_hi)
        if len(data) != want:
            raise RemoteProtocolError(f"sent {len(data)} bytes of {kind} for experts {e_lo}-{e_hi}, not {want}",
                                      code="bad_length")
        parts[kind] = data
    return parts


def _expert_digest(plan: SlicePlan, parts: dict[str, bytes | bytearray], i: int) -> str:
    h = hashlib.sha256()
    for kind in plan.kinds:
        per = plan.kind_bytes[kind]
        h.update(memoryview(parts[kind])[i * per : (i + 1) * per])
    return h.hexdigest()


def _check_group(plan: SlicePlan, e_lo: int, e_hi: int, parts: dict[str, bytes | bytearray]) -> None:
    for i, e in enumerate(range(e_lo, e_hi)):
        got = _expert_digest(plan, parts, i)
        if got != plan.expert_sha256[e - plan.lo]:
            raise _Lie(f"expert {e} has sha256 {got[:16]}..., the manifest says {plan.expert_sha256[e - plan.lo][:16]}...")


def _plan_id(plan: SlicePlan) -> str:
    h = hashlib.sha256(plan.header)
    for d in plan.expert_sha256:
        h.update(d.encode())
    return h.hexdigest()


def _open_part(part: Path, done_path: Path, plan: SlicePlan) -> set[tuple[int, int]]:
    """The verified groups of an earlier run's part file (each read back and checked), after making
    sure the part has the plan's size and header; a fresh part (and record) otherwise."""
    groups: set[tuple[int, int]] = set()
    try:
        lines = done_path.read_text().splitlines()
        usable = part.stat().st_size == plan.size and lines[:1] == [f"{_DONE_MAGIC} {_plan_id(plan)}"]
    except (OSError, UnicodeDecodeError):
        usable = False
    if usable:
        with open(part, "rb") as f:
            if f.read(len(plan.header)) != plan.header:
                usable = False
        for line in lines[1:] if usable else ():
            a, sep, b = line.partition("-")
            if not (sep and a.isdigit() and b.isdigit() and plan.lo <= int(a) < int(b) <= plan.hi):
                continue
            g = (int(a), int(b))
            parts = _read_back(part, plan, *g)
            try:
                _check_group(plan, *g, parts)
            except _Lie:
                continue
            groups.add(g)
    if not usable:
        with open(part, "wb") as f:
            f.write(plan.header)
            f.truncate(plan.size)
        done_path.write_text(f"{_DONE_MAGIC} {_plan_id(plan)}\n")
    return groups


def _read_back(path: Path, plan: SlicePlan, e_lo: int, e_hi: int) -> dict[str, bytes | bytearray]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return {k: os.pread(fd, (e_hi - e_lo) * plan.kind_bytes[k], plan.file_offset(k, e_lo)) for k in plan.kinds}
    finally:
        os.close(fd)


def _write_group(part: Path, done_path: Path, plan: SlicePlan, e_lo: int, e_hi: int,
                 parts: dict[str, bytes | bytearray]) -> None:
    fd = os.open(part, os.O_WRONLY)
    try:
        for kind in plan.kinds:
            data = memoryview(parts[kind])
            at = plan.file_offset(kind, e_lo)
            while data:
                n = os.pwrite(fd, data, at)
                data, at = data[n:], at + n
    finally:
        os.close(fd)
    with open(done_path, "a") as f:
        f.write(f"{e_lo}-{e_hi}\n")


def _complete(path: Path, plan: SlicePlan, expected: str | None) -> bool:
    """Is ``path`` already the slice: its sha256 is ``expected``, or (without one) its size, header
    and every expert match the plan?"""
    if expected is not None:
        return file_sha256(path) == expected
    try:
        if path.stat().st_size != plan.size:
            return False
        with open(path, "rb") as f:
            if f.read(len(plan.header)) != plan.header:
                return False
        for e in range(plan.lo, plan.hi):
            _check_group(plan, e, e + 1, _read_back(path, plan, e, e + 1))
    except (OSError, _Lie):
        return False
    return True


def _discard(*paths: Path) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _finish(part: Path, done_path: Path, dest: Path) -> None:
    fd = os.open(part, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, dest)
    done_path.unlink(missing_ok=True)


# -- HTTP sources -------------------------------------------------------------------------------


async def _get_range(client: httpx.AsyncClient, url: str, start: int, n: int, *, total: int | None,
                     etag_sha256: str | None) -> bytearray:
    """Bytes ``[start, start + n)`` of ``url`` with a Range request (module rules)."""
    headers = {"range": f"bytes={start}-{start + n - 1}", "accept-encoding": "identity"}
    try:
        async with client.stream("GET", url, headers=headers) as resp:
            if resp.status_code in _TRANSIENT_STATUS:
                raise TransportError(f"GET {url}: HTTP {resp.status_code}", code="http_unavailable")
            if resp.status_code == 200:
                raise RemoteProtocolError(f"GET {url}: Range not honoured (200 instead of 206)", code="no_range")
            if resp.status_code != 206:
                raise SliceError(f"GET {url} (bytes {start}-{start + n - 1}): HTTP {resp.status_code}",
                                 code="source_unusable")
            m = _CONTENT_RANGE.fullmatch(resp.headers.get("content-range", "").strip())
            if m is None or (int(m.group(1)), int(m.group(2))) != (start, start + n - 1) or (
                    total is not None and m.group(3) != str(total)):
                raise RemoteProtocolError(f"GET {url}: asked for bytes {start}-{start + n - 1}"
                                          f"{f'/{total}' if total is not None else ''}, got Content-Range "
                                          f"{resp.headers.get('content-range')!r}", code="bad_content_range")
            if etag_sha256 is not None:
                etag = resp.headers.get("etag", "")
                if not etag.startswith("W/") and etag.strip('"').lower() not in ("", etag_sha256):
                    raise SliceError(f"GET {url}: serves sha256 {etag.strip(chr(34))[:64]}, expected {etag_sha256}",
                                     code="source_unusable")
            buf = bytearray()
            async for chunk in resp.aiter_raw():
                buf += chunk
                if len(buf) > n:
                    raise RemoteProtocolError(f"GET {url}: more than the {n} bytes asked for", code="bad_length")
            if len(buf) != n:
                raise TransportError(f"GET {url}: got {len(buf)} of {n} bytes", code="short_body")
            return buf
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise TransportError(f"GET {url}: {type(exc).__name__}: {exc}", code="http_failed") from exc
    except httpx.HTTPError as exc:
        raise SliceError(f"GET {url}: {exc}", code="source_unusable") from exc


class CoordinatorSource:
    """The slice file on a coordinator (``GET /v1/slices/{model}/{layer}/{lo}-{hi}``, Range honoured):
    bytes in slice-file coordinates. ``expected_sha256``: its ETag must be this."""

    def __init__(self, client: httpx.AsyncClient, url: str, *, expected_sha256: str | None = None) -> None:
        self.client = client
        self.url = url
        self.expected_sha256 = expected_sha256.lower() if expected_sha256 else None

    @property
    def name(self) -> str:
        return f"coordinator {self.url}"

    async def read(self, plan: SlicePlan, kind: str, e_lo: int, e_hi: int) -> bytearray:
        n = (e_hi - e_lo) * plan.kind_bytes[kind]
        return await _get_range(self.client, self.url, plan.file_offset(kind, e_lo), n, total=plan.size,
                                etag_sha256=self.expected_sha256)

    async def aclose(self) -> None:
        pass  # the client is the caller's


class OriginSource:
    """A plain HTTP(S) server hosting the model's GGUF file at ``url``: bytes at the manifest's tensor
    offsets, with Range requests."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url

    @property
    def name(self) -> str:
        return f"origin {self.url}"

    async def read(self, plan: SlicePlan, kind: str, e_lo: int, e_hi: int) -> bytearray:
        start = plan.gguf_offset(kind, e_lo)
        if start is None:
            raise SliceError("the manifest has no tensor offsets: an origin cannot be read", code="source_unusable")
        return await _get_range(self.client, self.url, start, (e_hi - e_lo) * plan.kind_bytes[kind], total=None,
                                etag_sha256=None)

    async def aclose(self) -> None:
        pass
