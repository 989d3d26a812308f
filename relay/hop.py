"""The circuit relay v2 hop (shell): RESERVE and CONNECT on ``/libp2p/circuit/relay/0.2.0/hop``,
then STOP to the destination, and the byte splice of each circuit.

Rules:
- Admission and accounting are ``relay.core.ledger``'s decisions; this module moves bytes.
- Defaults suit long-lived, high-volume expert circuits: a limit of 0 is omitted from the answer,
  which the spec defines as "unlimited" (py-libp2p's own hop cut circuits at the first byte:
  workaround (f)); dialing never takes a reservation slot (workaround (g)).
- Each circuit is two tasks copying bytes between two streams, in its own cancel scope; its end
  (EOF is forwarded as a half-close, an error as a reset) touches no other circuit.
- Hop requests over a relayed connection are refused (no relay chains).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import trio

from relay.core.ledger import Admitted, Direction, Refusal, Refused, RelayLedger
from relay.streams import close_stream, norm_ip, over_relay, peer_of, reset_stream
from swarm.p2p.nat import STOP_PROTOCOL

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from relay.service import RelayConfig

__all__ = ["HopService"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 16

_STATUS_FOR_REFUSAL = {
    Refusal.RESERVATION_LIMIT: "RESERVATION_REFUSED",
    Refusal.ADDRESS_LIMIT: "RESERVATION_REFUSED",
    Refusal.DRAINING: "RESERVATION_REFUSED",
    Refusal.NO_RESERVATION: "NO_RESERVATION",
    Refusal.CIRCUIT_LIMIT: "RESOURCE_LIMIT_EXCEEDED",
    Refusal.PEER_CIRCUIT_LIMIT: "RESOURCE_LIMIT_EXCEEDED",
    Refusal.SELF_CIRCUIT: "PERMISSION_DENIED",
}



class HopService:
    """The hop handler of one relay host; ``announce()`` gives the relay's public addresses."""

    def __init__(self, host: Any, cfg: RelayConfig, ledger: RelayLedger, announce: Callable[[], list[str]], *,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.on_change = on_change  # told after every reservation asked for (granted or not)
        self.host = host
        self.cfg = cfg
        self.ledger = ledger
        self.announce = announce
        self._scopes: dict[int, trio.CancelScope] = {}
        self._circuit_ended = trio.Event()  # set and replaced whenever a circuit ends

    async def drain(self) -> None:
        """Refuse everything new, end live circuits gracefully, then reset what is left."""
        self.ledger.drain()
        for scope in list(self._scopes.values()):
            scope.cancel()  # each circuit half-closes both ends (see _splice)
        with trio.move_on_after(self.cfg.drain_timeout_s + 1):
            while self._scopes:
                await self._circuit_ended.wait()

    async def on_stream(self, stream: INetStream) -> None:
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.utils import read_delimited_msg

        peer = str(stream.muxed_conn.peer_id)
        try:
            if over_relay(self.host, stream):
                await self._status(stream, "PERMISSION_DENIED")
                return
            with trio.fail_after(self.cfg.timeout_s):
                msg = await read_delimited_msg(stream, HopMessage)
            if msg.type == HopMessage.RESERVE:
                await self._reserve(stream, peer)
            elif msg.type == HopMessage.CONNECT:
                await self._connect(stream, peer, msg)
            else:
                await self._status(stream, "UNEXPECTED_MESSAGE")
        except Exception as exc:  # a peer's bad input or a dead stream: this request only
            log.info("hop request from %s failed: %r", peer, exc)
            await reset_stream(stream)

    async def _reserve(self, stream: INetStream, peer: str) -> None:
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Reservation
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import write_delimited_msg
        from multiaddr import Multiaddr

        now = trio.current_time()
        remote = stream.get_remote_address()  # (host, port) of the connection the request came on
        verdict = self.ledger.reserve(peer, now, norm_ip(str(remote[0])) if remote else None)
        self.on_change()
        if isinstance(verdict, Refused):
            log.info("reservation of %s refused: %s", peer, verdict.reason.value)
            await self._status(stream, _STATUS_FOR_REFUSAL[verdict.reason])
            return
        expire = int(time.time() + (verdict.expires_at - now))
        rsvp = Reservation(expire=expire, addrs=[Multiaddr(a).to_bytes() for a in self.announce()],
                           voucher=self._voucher(peer, expire))
        msg = HopMessage(type=HopMessage.STATUS, status=to_proto_status(StatusCode.OK), reservation=rsvp)
        self._add_limit(msg)
        await write_delimited_msg(stream, msg)
        await close_stream(stream)
        log.info("%s %s (%d/%d)", "refreshed reservation of" if verdict.renewed else "reserved a slot for",
                 peer, self.ledger.stats().reservations, self.cfg.max_reservations)

    async def _connect(self, stream: INetStream, src: str, msg: Any) -> None:
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PbPeerId
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        try:
            dst_id = ID(msg.peer.id)
        except Exception:
            await self._status(stream, "MALFORMED_MESSAGE")
            return
        dst = str(dst_id)
        if not [c for c in self.host.get_network().get_connections(dst_id) if not c.is_closed]:
            self.ledger.peer_disconnected(dst)
        adm = self.ledger.open_circuit(src, dst, trio.current_time())
        if isinstance(adm, Refused):
            log.info("circuit %s -> %s refused: %s", src, dst, adm.reason.value)
            await self._status(stream, _STATUS_FOR_REFUSAL[adm.reason])
            return
        dst_stream: INetStream | None = None
        try:
            with trio.fail_after(self.cfg.timeout_s):
                dst_stream = await self.host.new_stream(dst_id, [TProtocol(STOP_PROTOCOL)])
                stop = StopMessage(type=StopMessage.CONNECT, peer=PbPeerId(id=ID.from_base58(src).to_bytes()))
                self._add_limit(stop)
                await write_delimited_msg(dst_stream, stop)
                resp = await read_delimited_msg(dst_stream, StopMessage)
            if resp.type != StopMessage.STATUS or int(resp.status) != StatusCode.OK:
                raise ConnectionError(f"destination answered {StatusCode(resp.status).name}")
        except Exception as exc:
            log.info("circuit %s -> %s: destination unreachable: %r", src, dst, exc)
            self.ledger.close_circuit(adm.circuit_id)
            if dst_stream is not None:
                await reset_stream(dst_stream)
            await self._status(stream, "CONNECTION_FAILED")
            return
        ok = HopMessage(type=HopMessage.STATUS, status=to_proto_status(StatusCode.OK))
        self._add_limit(ok)
        try:
            await write_delimited_msg(stream, ok)
            log.info("circuit %d open: %s -> %s", adm.circuit_id, src, dst)
            await self._splice(adm, stream, dst_stream)
        finally:
            self.ledger.close_circuit(adm.circuit_id)
            log.info("circuit %d closed: %s -> %s", adm.circuit_id, src, dst)

    async def _splice(self, adm: Admitted, a: INetStream, b: INetStream) -> None:
        """Copy bytes both ways until both sides are done; this circuit only."""
        broken = False

        async def pipe(src: INetStream, dst: INetStream, direction: Direction) -> None:
            nonlocal broken
            from libp2p.network.stream.exceptions import StreamEOF

            while True:
                try:
                    data = await src.read(_CHUNK)
                except StreamEOF:
                    data = b""
                except Exception:
                    broken = True
                    scope.cancel()
                    return
                if not data:
                    try:
                        await cast(Any, dst).close_write()  # forward the half-close
                    except Exception:
                        broken = True
                        scope.cancel()
                    return
                if not self.ledger.record_bytes(adm.circuit_id, direction, len(data)):
                    log.info("circuit %d reached its data cap", adm.circuit_id)
                    broken = True
                    scope.cancel()
                    return
                try:
                    await dst.write(data)
                except Exception:
                    broken = True
                    scope.cancel()
                    return

        with trio.CancelScope() as scope:
            if adm.deadline is not None:
                scope.deadline = adm.deadline
            self._scopes[adm.circuit_id] = scope
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pipe, a, b, Direction.TO_DST)
                    nursery.start_soon(pipe, b, a, Direction.TO_SRC)
            finally:
                del self._scopes[adm.circuit_id]
                self._circuit_ended.set()
                self._circuit_ended = trio.Event()
        with trio.CancelScope(shield=True):
            if broken or (scope.cancelled_caught and not self.ledger.draining):
                await reset_stream(a)  # an error, a cap or the duration limit: both ends see a reset
                await reset_stream(b)
            else:  # both sides finished, or the relay is shutting down: both ends see end of stream
                with trio.move_on_after(self.cfg.drain_timeout_s):
                    await close_stream(a)
                    await close_stream(b)

    async def _status(self, stream: INetStream, name: str) -> None:
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import write_delimited_msg

        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS, status=to_proto_status(StatusCode[name])))
        except Exception as exc:
            log.debug("sending %s: %r", name, exc)
        await close_stream(stream)

    def _add_limit(self, msg: Any) -> None:
        """Spec: the limit field is omitted when the relay applies none (0 would also mean none)."""
        limits = self.ledger.limits
        if limits.circuit_max_bytes or limits.circuit_max_duration_s:
            msg.limit.duration = limits.circuit_max_duration_s
            msg.limit.data = limits.circuit_max_bytes

    def _voucher(self, peer: str, expire: int) -> bytes:
        """The signed reservation voucher (an Envelope, domain ``libp2p-relay-rsvp``)."""
        from libp2p.peer.envelope import Envelope, make_unsigned
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import Voucher
        from libp2p.relay.circuit_v2.resources import RELAY_RSVP_DOMAIN, VOUCHER_PAYLOAD_TYPE

        payload = Voucher(relay=self.host.get_id().to_bytes(), peer=peer_of(peer).to_bytes(), expiration=expire).SerializeToString()
        key = self.host.get_private_key()
        signature = key.sign(make_unsigned(RELAY_RSVP_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))
        return bytes(Envelope(public_key=key.get_public_key(), payload_type=VOUCHER_PAYLOAD_TYPE,
                              raw_payload=payload, signature=signature).marshal_envelope())

