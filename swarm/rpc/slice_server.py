"""The server side of the slice stream ``/moe-swarm/slice/1`` (shell: trio tasks and file reads).

A volunteer holding slice files answers other volunteers downloading them (the wire:
``swarm.protocol.slice``). ``set_slice_handler`` plugs a ``SliceServer`` into a transport.

Rules:
- Served only to a peer the market assigned the slice: the request names the requester's lease
  id; the server asks the injected ``check_lease(lease_id)`` (the market's ``GET
  /api/leases/{lease_id}``: ``market_lease_check``) and serves only when the lease's ``peer_id`` is
  the stream's authenticated remote peer and the requested experts lie in the lease's slice of the
  same model and layer; otherwise ``not_assigned``. Answers are cached until the lease's
  ``expires_in_s`` (at most ``lease_cache_s``), unknown leases for ``negative_ttl_s``; a market that
  cannot be asked means ``busy`` (nothing cached). At most ``max_cached_leases`` are kept.
- A server holds several slice files (``add_slice``/``remove_slice``); a request is served from any
  held file of that model and layer whose range contains the requested experts (expert indices are
  mapped into that file's offsets), else ``not_held``.
- Bounded: a request asks for at most ``max_request_bytes`` (``too_large`` above, checked before
  anything else is done for it); one request is answered at a time per stream (one buffer of at
  most that size in memory per stream); at most ``max_peers`` peers download at once (a peer holds
  its place from its first authorised request until its last stream closes; others get ``busy``);
  a stream idle for ``idle_timeout_s`` is closed. Uploads draw on one token bucket of
  ``rate_bytes_per_s`` (burst ``burst_bytes``): a request is delayed until its bytes fit, or refused
  ``rate_limited`` (with ``retry_after_s``) when that would take more than ``max_wait_s``.
- Opting out (``share=False`` or ``set_sharing(False)``): every request is answered ``opted_out``, and
  the volunteer's heartbeat says ``share_slices=False`` so the market never names it as a source.
- Bad input never takes the server down: an undecodable header, a request with a payload, a
  frame of the wrong type or inconsistent numbers get a ``bad_request`` frame and the next frame is
  served; only lost framing (a header length beyond the limit) ends the stream, after a fatal frame,
  and so do 8 ``not_assigned`` answers on one stream (each cost a question to the market).
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import httpx
import msgspec
import trio

from swarm.core.ratelimit import TokenBucket
from swarm.errors import MalformedHeader, SliceError, SwarmError, TransportError, WireError
from swarm.ids import SliceKey
from swarm.model.slices import SliceFileSpans, slice_file_spans
from swarm.p2p.transport import Stream, Transport
from swarm.protocol.expert import Frame, FrameReader
from swarm.protocol.market import LeaseView, lease_decoder
from swarm.protocol.slice import (
    MAX_REQUEST_BYTES,
    SERVER_LIMITS,
    SLICE_PROTOCOL_ID,
    SliceCode,
    SliceData,
    SliceErrorReply,
    SliceRequest,
    decode_slice_message,
    encode_slice_frame,
)

__all__ = ["DEFAULT_SHARE_CONFIG", "CheckLease", "SliceServer", "SliceShareConfig", "market_lease_check", "set_slice_handler"]

log = logging.getLogger(__name__)

# lease id -> the market's view of it, None for a lease the market does not know; raises SwarmError
# when it cannot tell (the market is unreachable)
CheckLease = Callable[[str], Awaitable[LeaseView | None]]

_MAX_UNASSIGNED = 8  # not_assigned answers a stream gets before it is closed

_PosFloat = Annotated[float, msgspec.Meta(gt=0)]
_NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
_PosInt = Annotated[int, msgspec.Meta(ge=1)]


class SliceShareConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a volunteer shares its slices (module rules)."""

    share: bool = True
    rate_bytes_per_s: _PosFloat = float(16 << 20)
    burst_bytes: _PosInt = 16 << 20
    max_peers: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_REQUEST_BYTES)] = MAX_REQUEST_BYTES
    max_wait_s: _NonNegFloat = 2.0
    idle_timeout_s: _PosFloat = 60.0
    lease_cache_s: _PosFloat = 60.0
    negative_ttl_s: _NonNegFloat = 5.0
    max_cached_leases: _PosInt = 4096


DEFAULT_SHARE_CONFIG = SliceShareConfig()


class _Refuse(Exception):
    def __init__(self, code: SliceCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class SliceServer:
    """Serves the slice files it holds over ``/moe-swarm/slice/1`` (module rules)."""

    def __init__(self, check_lease: CheckLease, config: SliceShareConfig = DEFAULT_SHARE_CONFIG, *,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.config = config
        self._check_lease = check_lease
        self._clock = clock
        self._sharing = config.share
        self._files: dict[SliceKey, tuple[Path, SliceFileSpans]] = {}
        self._leases: OrderedDict[str, tuple[LeaseView | None, float]] = OrderedDict()
        self._uploading: dict[str, int] = {}  # peer -> its streams holding its download place
        self._bucket: TokenBucket | None = None  # made on first use: the clock may need a running trio
        self.bytes_sent = 0
        self.streams = 0  # streams opened to this server
        self.requests_served = 0
        self.refusals: Counter[str] = Counter()

    # -- what is held and shared -------------------------------------------------------------------

    @property
    def sharing(self) -> bool:
        return self._sharing

    def set_sharing(self, share: bool) -> None:
        self._sharing = share

    def add_slice(self, path: str | Path) -> SliceKey:
        """Serve the slice file at ``path`` (its header is read and validated: ``SliceError``)."""
        spans = slice_file_spans(path)
        self._files[spans.key] = (Path(path), spans)
        return spans.key

    def remove_slice(self, key: SliceKey) -> None:
        self._files.pop(key, None)

    def held(self) -> list[SliceKey]:
        return sorted(self._files)

    @property
    def uploading_peers(self) -> int:
        return len(self._uploading)

    # -- the stream --------------------------------------------------------------------------------

    async def handle_stream(self, stream: Stream) -> None:
        """Answer one stream's requests until it closes, goes idle or loses its framing."""
        peer = stream.remote_peer_id
        reader = FrameReader(stream, SERVER_LIMITS)
        self.streams += 1
        placed = False
        unassigned = 0
        try:
            while True:
                frame = None
                with trio.move_on_after(self.config.idle_timeout_s):
                    try:
                        frame = await reader.receive_frame()
                    except WireError as exc:  # a header length beyond the limit: framing lost
                        await stream.write(encode_slice_frame(SliceErrorReply(
                            code=SliceCode.BAD_REQUEST, message=exc.message, fatal=True)))
                        return
                    except TransportError:
                        return
                if frame is None:
                    return  # the end of the stream, or idle for too long
                out, placed, code = await self._answer(peer, frame, placed)
                unassigned += code is SliceCode.NOT_ASSIGNED
                try:
                    await stream.write(out)
                    if unassigned >= _MAX_UNASSIGNED:  # each costs a question to the market: enough
                        await stream.write(encode_slice_frame(SliceErrorReply(
                            code=SliceCode.NOT_ASSIGNED, message="too many requests without a lease", fatal=True)))
                        return
                except TransportError:
                    return
        finally:
            if placed:
                n = self._uploading.get(peer, 0) - 1
                if n <= 0:
                    self._uploading.pop(peer, None)
                else:
                    self._uploading[peer] = n

    async def _answer(self, peer: str, frame: Frame, placed: bool) -> tuple[bytes, bool, SliceCode | None]:
        """The frame answering ``frame``, whether the stream now holds a download place, and the
        refusal's code (None: served)."""
        request_id: int | None = None
        try:
            if frame.payload is None or frame.payload_len:
                raise _Refuse(SliceCode.BAD_REQUEST, "slice requests carry no payload")
            try:
                msg = decode_slice_message(frame.header)
            except MalformedHeader as exc:
                raise _Refuse(SliceCode.BAD_REQUEST, exc.message) from None
            if not isinstance(msg, SliceRequest):
                raise _Refuse(SliceCode.BAD_REQUEST, f"expected a slice_request, got {type(msg).__name__}")
            request_id = msg.request_id
            placed = await self._authorise(peer, msg, placed)
            data = await self._read(msg)
        except _Refuse as r:
            self.refusals[r.code.value] += 1
            return encode_slice_frame(SliceErrorReply(code=r.code, message=r.message, request_id=request_id,
                                                      retry_after_s=r.retry_after_s)), placed, r.code
        self.bytes_sent += len(data)
        self.requests_served += 1
        return encode_slice_frame(SliceData(request_id=msg.request_id, length=len(data)), data), placed, None

    async def _authorise(self, peer: str, req: SliceRequest, placed: bool) -> bool:
        """Refuse (``_Refuse``) unless ``peer`` may have these bytes now; whether the stream now holds
        a download place."""
        cfg = self.config
        if req.e_lo >= req.e_hi:
            raise _Refuse(SliceCode.BAD_REQUEST, f"empty expert range {req.e_lo}-{req.e_hi}")
        if req.length > cfg.max_request_bytes:
            raise _Refuse(SliceCode.TOO_LARGE, f"{req.length} bytes asked for; at most {cfg.max_request_bytes} a request")
        if not self._sharing:
            raise _Refuse(SliceCode.OPTED_OUT, "this volunteer does not share its slices")
        lease = await self._lease(req.lease_id)
        if lease is None or lease.peer_id != peer:
            raise _Refuse(SliceCode.NOT_ASSIGNED, "no lease of yours for this slice is known to the market")
        if (lease.model_id, lease.layer) != (req.model_id, req.layer) or not lease.lo <= req.e_lo < req.e_hi <= lease.hi:
            raise _Refuse(SliceCode.NOT_ASSIGNED, f"your lease is for {lease.model_id} {lease.layer}:{lease.lo}-{lease.hi}, "
                          f"not experts {req.e_lo}-{req.e_hi} of layer {req.layer}")
        if self._find(req) is None:
            raise _Refuse(SliceCode.NOT_HELD, f"no slice with experts {req.e_lo}-{req.e_hi} of layer {req.layer} is held here")
        if not placed:
            if peer not in self._uploading and len(self._uploading) >= cfg.max_peers:
                raise _Refuse(SliceCode.BUSY, f"{cfg.max_peers} peers are downloading from this volunteer; try later")
            self._uploading[peer] = self._uploading.get(peer, 0) + 1
        return True

    def _find(self, req: SliceRequest) -> tuple[Path, SliceFileSpans] | None:
        for key, held in self._files.items():
            if key.model_id == req.model_id and key.layer == req.layer and key.lo <= req.e_lo and req.e_hi <= key.hi:
                return held
        return None

    async def _read(self, req: SliceRequest) -> bytes:
        held = self._find(req)
        if held is None:  # released while we checked
            raise _Refuse(SliceCode.NOT_HELD, "the slice was released")
        path, spans = held
        if req.kind not in spans.kind_bytes:
            raise _Refuse(SliceCode.BAD_REQUEST, f"the held slice has no {req.kind} tensor")
        per = spans.kind_bytes[req.kind]
        span = (req.e_hi - req.e_lo) * per
        if req.offset + req.length > span:
            raise _Refuse(SliceCode.BAD_REQUEST, f"bytes {req.offset}+{req.length} lie outside the {span} bytes of "
                          f"experts {req.e_lo}-{req.e_hi}'s {req.kind} data")
        now = self._clock()
        if self._bucket is None:
            self._bucket = TokenBucket(self.config.rate_bytes_per_s, self.config.burst_bytes, now)
        wait = self._bucket.reserve(req.length, now, self.config.max_wait_s)
        if wait is None:
            retry = self._bucket.wait_for(req.length, now) - self.config.max_wait_s
            raise _Refuse(SliceCode.RATE_LIMITED, f"over this volunteer's upload rate of "
                          f"{self.config.rate_bytes_per_s:.0f} bytes/s", retry_after_s=round(max(0.1, retry), 3))
        if wait > 0:
            await trio.sleep(wait)
        at = spans.start[req.kind] + (req.e_lo - spans.key.lo) * per + req.offset
        try:
            return await trio.to_thread.run_sync(_pread, path, at, req.length)
        except FileNotFoundError:
            raise _Refuse(SliceCode.NOT_HELD, "the slice was released") from None
        except OSError as exc:
            log.warning("cannot read slice file %s: %s", path, exc)
            raise _Refuse(SliceCode.INTERNAL_ERROR, "cannot read the slice file") from None

    async def _lease(self, lease_id: str) -> LeaseView | None:
        now = self._clock()
        hit = self._leases.get(lease_id)
        if hit is not None and hit[1] > now:
            self._leases.move_to_end(lease_id)
            return hit[0]
        try:
            lease = await self._check_lease(lease_id)
        except SwarmError as exc:
            raise _Refuse(SliceCode.BUSY, f"cannot check the lease with the market now: {exc.message}",
                          retry_after_s=1.0) from None
        cfg = self.config
        ttl = cfg.negative_ttl_s if lease is None else min(max(0.0, lease.expires_in_s), cfg.lease_cache_s)
        self._leases[lease_id] = (lease, now + ttl)
        self._leases.move_to_end(lease_id)
        while len(self._leases) > cfg.max_cached_leases:
            self._leases.popitem(last=False)
        return lease


def _pread(path: Path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n, offset)
    finally:
        os.close(fd)
    if len(data) != n:
        raise SliceError(f"{path}: short read at {offset} ({len(data)} of {n} bytes)")
    return data


def set_slice_handler(transport: Transport, server: SliceServer) -> None:
    """Serve ``server`` on ``/moe-swarm/slice/1`` (what a volunteer that holds slices does)."""
    transport.set_stream_handler(SLICE_PROTOCOL_ID, server.handle_stream)


def market_lease_check(client: httpx.AsyncClient, market_url: str, *, timeout_s: float = 5.0) -> CheckLease:
    """``check_lease`` over the market's ``GET /api/leases/{lease_id}``: the lease, None on 404
    (``unknown_lease``), ``TransportError`` when the market cannot answer."""
    base = market_url.rstrip("/")

    async def check(lease_id: str) -> LeaseView | None:
        if not lease_id or len(lease_id) > 128 or not all(c.isascii() and (c.isalnum() or c in "-_") for c in lease_id):
            return None  # not a lease id the market hands out: never put stranger text in a URL
        try:
            r = await client.get(f"{base}/api/leases/{lease_id}", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise TransportError(f"GET /api/leases: {exc!r}", code="lease_check_failed") from exc
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise TransportError(f"GET /api/leases: HTTP {r.status_code}", code="lease_check_failed")
        try:
            return lease_decoder.decode(r.content)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise TransportError(f"GET /api/leases: unexpected body: {exc}", code="lease_check_failed") from exc

    return check
