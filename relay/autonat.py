"""The relay's AutoNAT v1 server (shell): tells a volunteer whether it can be dialled.

Rules (py-libp2p workaround (h): the library's server dialled back over the requester's own
connection, so everyone looked reachable):
- A dial-back uses a fresh TCP connection and a Noise handshake that must prove the requester's
  peer id; success means "reachable at that address".
- Only addresses on the IP the request came from are dialled (no reflection onto third parties),
  at most 16 looked at and 4 tried, at most ``max_dialbacks`` dial-backs at a time.
- Requests over relayed connections are refused; every answer is counted by status.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from relay.streams import close_stream, ip_of, norm_ip, over_relay, reset_stream

if TYPE_CHECKING:
    from libp2p.abc import INetStream

__all__ = ["AutoNatServer"]

log = logging.getLogger(__name__)


class AutoNatServer:
    def __init__(self, host: Any, *, timeout_s: float, max_dialbacks: int) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._dialbacks = trio.CapacityLimiter(max_dialbacks)
        self.results: Counter[str] = Counter()

    async def on_stream(self, stream: INetStream) -> None:
        from libp2p.host.autonat.pb.autonat_pb2 import Message
        from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(self.timeout_s):
                request = Message()
                request.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 64 * 1024))
            response = Message(type=Message.DIAL_RESPONSE)
            status, text, addr = await self._dialback(stream, request)
            response.dialResponse.status = status
            response.dialResponse.statusText = text
            if addr is not None:
                response.dialResponse.addr = addr
            self.results[Message.ResponseStatus.Name(status)] += 1
            await stream.write(encode_varint_prefixed(response.SerializeToString()))
            await close_stream(stream)
        except Exception as exc:
            log.info("AutoNAT request from %s failed: %r", peer, exc)
            await reset_stream(stream)

    async def _dialback(self, stream: INetStream, request: Any) -> tuple[Any, str, bytes | None]:
        from libp2p.host.autonat.pb.autonat_pb2 import Message
        from libp2p.peer.id import ID
        from multiaddr import Multiaddr

        if request.type != Message.DIAL:
            return Message.E_BAD_REQUEST, "expected a DIAL", None
        if over_relay(self.host, stream):
            return Message.E_DIAL_REFUSED, "dial-back requests over relayed connections are refused", None
        peer = stream.muxed_conn.peer_id
        if request.dial.peer.id and ID(request.dial.peer.id) != peer:
            return Message.E_BAD_REQUEST, "the request names another peer", None
        remote = stream.get_remote_address()
        observed = norm_ip(remote[0]) if remote else None
        candidates = []
        for raw in list(request.dial.peer.addrs)[:16]:
            try:
                maddr = Multiaddr(bytes(raw))
            except Exception:
                continue
            ip = ip_of(maddr)
            if ip is not None and ip == observed and "tcp" in {p.name for p in maddr.protocols()} and "/p2p-circuit" not in str(maddr):
                candidates.append(maddr)
        if not candidates:
            return Message.E_DIAL_REFUSED, f"no address on the IP this request came from ({observed})", None
        async with self._dialbacks:
            for maddr in candidates[:4]:
                if await self._dial_fresh(peer, maddr):
                    return Message.OK, "", maddr.to_bytes()
        return Message.E_DIAL_ERROR, "dial-back failed", None

    async def _dial_fresh(self, peer: Any, maddr: Any) -> bool:
        """A new TCP connection and a Noise handshake that proves ``peer`` (the library's AutoNAT
        reused the requester's own connection and so told everyone they were reachable)."""
        network = self.host.get_network()
        transport = network.transport_manager.transport_for_dialing(maddr)
        if transport is None:
            return False
        raw = None
        with trio.move_on_after(min(5.0, self.timeout_s)):
            try:
                raw = await transport.dial(maddr)
                secured = await network.upgrader.upgrade_security(raw, True, peer)
                await secured.close()
                return True
            except Exception as exc:
                log.debug("dial-back to %s at %s failed: %r", peer, maddr, exc)
            finally:
                if raw is not None:
                    with trio.CancelScope(shield=True):
                        try:
                            await raw.close()
                        except Exception:
                            pass
        return False

