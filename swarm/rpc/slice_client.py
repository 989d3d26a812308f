"""The client side of the slice stream ``/moe-swarm/slice/1`` and the sources of an assignment (shell).

``SliceClient`` sends requests on one stream and reads their answers, one at a time;
``PeerSource`` is a ``swarm.model.sources.SliceSource`` over it: ONE long-lived stream per peer for
the whole download (opened on first use), each kind of a group read in requests of at most
``MAX_REQUEST_BYTES``. ``sources_from_assignment`` turns the market's ranked ``Assignment.sources``
into sources for ``swarm.model.sources.fetch_slice_from``.

Rules:
- An error frame becomes ``SliceRefused`` with its code (and ``retry_after_s``); after a fatal one,
  or any transport failure or protocol breach (an answer to another request, more or fewer bytes
  than asked), the stream is closed and the next read opens a new one.
- Nothing a peer sends is trusted: the fetcher checks every expert against the manifest.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import cast

import httpx

from swarm.errors import BrokenError, MalformedHeader, RemoteProtocolError, SliceRefused, TransportError
from swarm.model.slices import SlicePlan
from swarm.model.sources import CoordinatorSource, OriginSource, SliceSource
from swarm.p2p.transport import Stream, Transport, quietly
from swarm.protocol.expert import FrameReader
from swarm.protocol.market import Assignment, SourceKind
from swarm.protocol.slice import (
    CLIENT_LIMITS,
    MAX_REQUEST_BYTES,
    SLICE_PROTOCOL_ID,
    SliceData,
    SliceErrorReply,
    SliceKind,
    SliceRequest,
    decode_slice_message,
    encode_slice_frame,
)

__all__ = ["PeerSource", "SliceClient", "open_slice_client", "sources_from_assignment"]

log = logging.getLogger(__name__)


class SliceClient:
    """Requests on one ``/moe-swarm/slice/1`` stream (not safe for concurrent use: one request at a time)."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._reader = FrameReader(stream, CLIENT_LIMITS)
        self._next_id = 0
        self.closed = False

    async def read(self, *, model_id: str, layer: int, kind: SliceKind, e_lo: int, e_hi: int, offset: int, length: int,
                   lease_id: str) -> bytearray:
        """Bytes ``[offset, offset + length)`` of experts ``e_lo .. e_hi-1``'s ``kind`` data."""
        if self.closed:
            raise BrokenError("the slice stream is closed")
        self._next_id = (self._next_id + 1) % (2**32)
        rid = self._next_id
        req = SliceRequest(request_id=rid, model_id=model_id, layer=layer, kind=kind, e_lo=e_lo, e_hi=e_hi,
                           offset=offset, length=length, lease_id=lease_id)
        try:
            await self.stream.write(encode_slice_frame(req))
            frame = await self._reader.receive_frame()
            if frame is None:
                raise BrokenError("the peer closed the slice stream")
            if frame.payload is None:
                raise RemoteProtocolError(f"answer of {frame.payload_len} bytes exceeds the limit", code="frame_too_large")
            try:
                msg = decode_slice_message(frame.header)
            except MalformedHeader as exc:
                raise RemoteProtocolError(exc.message, code="malformed_header") from exc
            match msg:
                case SliceErrorReply():
                    if msg.fatal:
                        await self.aclose()
                    raise SliceRefused(f"peer refused: {msg.message[:300]}", code=msg.code,
                                       retry_after_s=msg.retry_after_s)
                case SliceData() if msg.request_id == rid and msg.length == length == len(frame.payload):
                    return frame.payload
                case _:
                    raise RemoteProtocolError(f"unexpected answer to request {rid}: {type(msg).__name__} "
                                              f"({len(frame.payload)} payload bytes for {length} asked)",
                                              code="unexpected_message")
        except (TransportError, RemoteProtocolError):
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await quietly(self.stream.aclose, "closing a slice stream", timeout_s=2.0, shield=True)


@asynccontextmanager
async def open_slice_client(transport: Transport, peer_id: str, addrs: Sequence[str]) -> AsyncIterator[SliceClient]:
    """A ``SliceClient`` on a new stream to ``peer_id`` (``DialError`` when it cannot be opened)."""
    client = SliceClient(await transport.open_stream(peer_id, addrs, SLICE_PROTOCOL_ID))
    try:
        yield client
    finally:
        await client.aclose()


class PeerSource:
    """A volunteer holding the slice (``swarm.model.sources.SliceSource``); ``lease_id`` is OUR lease of
    the slice being downloaded, which the peer checks with the market."""

    def __init__(self, transport: Transport, peer_id: str, addrs: Sequence[str], lease_id: str, *,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.transport = transport
        self.peer_id = peer_id
        self.addrs = list(addrs)
        self.lease_id = lease_id
        self.max_request_bytes = max_request_bytes
        self._client: SliceClient | None = None

    @property
    def name(self) -> str:
        return f"peer {self.peer_id}"

    async def read(self, plan: SlicePlan, kind: str, e_lo: int, e_hi: int) -> bytearray:
        if kind not in plan.kinds:
            raise ValueError(f"no expert tensor kind {kind!r}")
        k = cast(SliceKind, kind)
        if self._client is None or self._client.closed:
            self._client = SliceClient(await self.transport.open_stream(self.peer_id, self.addrs, SLICE_PROTOCOL_ID))
        want = (e_hi - e_lo) * plan.kind_bytes[kind]
        out = bytearray()
        while len(out) < want:
            n = min(self.max_request_bytes, want - len(out))
            out += await self._client.read(model_id=plan.key.model_id, layer=plan.key.layer, kind=k,
                                           e_lo=e_lo, e_hi=e_hi, offset=len(out), length=n, lease_id=self.lease_id)
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def sources_from_assignment(a: Assignment, *, client: httpx.AsyncClient, transport: Transport | None,
                            self_peer_id: str | None = None) -> list[SliceSource]:
    """The sources of ``a``, in the market's order: peers (``transport`` given; never ourselves),
    origins, coordinators. Kinds this version does not know are skipped; a market that sends no
    ``sources`` (an older one) gives the coordinator's ``url`` alone. Peers are asked with
    ``a.lease_id``; the coordinator's ETag must be ``a.sha256``."""
    out: list[SliceSource] = []
    seen: set[str] = set()
    for s in a.sources:
        src: SliceSource | None = None
        if s.kind == SourceKind.PEER and transport is not None and s.peer_id and s.peer_id != self_peer_id:
            src = PeerSource(transport, s.peer_id, s.addrs, a.lease_id)
        elif s.kind == SourceKind.ORIGIN and s.url:
            src = OriginSource(client, s.url)
        elif s.kind == SourceKind.COORDINATOR and s.url:
            src = CoordinatorSource(client, s.url, expected_sha256=a.sha256)
        if src is not None and src.name not in seen:
            seen.add(src.name)
            out.append(src)
    if not any(isinstance(s, CoordinatorSource) for s in out) and a.url:
        out.append(CoordinatorSource(client, a.url, expected_sha256=a.sha256))
    return out
