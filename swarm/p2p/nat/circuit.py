"""Circuit relay v2 as a client speaks it (shell): dial a peer through a relay (HOP CONNECT) and
accept a peer's circuit from one of our relays (STOP CONNECT).

Rules:
- Both ends run Noise + Yamux over the relayed stream, so the peer's identity is proven end to end;
  the relay sees only ciphertext. The connection is registered with the swarm as ``RELAYED``.
- A dialer never reserves a slot on a relay (py-libp2p workaround (g)); dialing takes the relay's
  address from the circuit address itself (workaround (e): the library skips circuit addresses).
- Inbound circuits are accepted only from our own relays; anything else gets PERMISSION_DENIED.
- Every failure is a ``DialError`` (dialing) or a logged refusal (accepting), bounded by
  ``timeout_s``; the relayed stream is reset, never leaked.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import trio

from swarm.errors import DialError
from swarm.p2p.nat.addrs import HOP_PROTOCOL, close_stream_quietly, pid, reset_quietly

if TYPE_CHECKING:
    from libp2p.abc import INetStream

__all__ = ["accept_circuit", "ensure_connection", "open_circuit"]

log = logging.getLogger(__name__)


async def ensure_connection(host: Any, peer_id: str, transport_addr: str) -> None:
    """A live connection to ``peer_id`` (a relay), dialled at ``transport_addr`` if there is none."""
    from multiaddr import Multiaddr

    if any(not c.is_closed for c in host.get_network().get_connections(pid(peer_id))):
        return
    await host.get_network().dial_addr(Multiaddr(transport_addr), pid(peer_id))


async def open_circuit(host: Any, relay_addr: str, relay_id: str, dest: str, *, timeout_s: float) -> None:
    """Connect ``host`` to ``dest`` through the relay ``relay_id`` at ``relay_addr``."""
    from libp2p.connection_types import ConnectionType
    from libp2p.custom_types import TProtocol
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PbPeerId
    from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
    from multiaddr import Multiaddr

    stream: INetStream | None = None
    with trio.move_on_after(timeout_s) as scope:
        try:
            await ensure_connection(host, relay_id, relay_addr)
            stream = await host.new_stream(pid(relay_id), [TProtocol(HOP_PROTOCOL)])
            await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT, peer=PbPeerId(id=pid(dest).to_bytes())))
            resp = await read_delimited_msg(stream, HopMessage)
            status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
            if resp.type != HopMessage.STATUS or status != StatusCode.OK:
                raise DialError(f"relay {relay_id} refused the circuit to {dest}: {status.name}")
            circuit = Multiaddr(f"/p2p/{relay_id}/p2p-circuit/p2p/{dest}")
            raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED, addresses=[circuit])
            conn = await host.upgrade_outbound_connection(raw, pid(dest))
            conn.set_transport_info([circuit], ConnectionType.RELAYED)
            stream = None
        except DialError:
            raise
        except Exception as exc:
            raise DialError(f"circuit to {dest} via {relay_id} failed: {exc!r}") from exc
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await reset_quietly(stream)
    if scope.cancelled_caught:
        raise DialError(f"circuit to {dest} via {relay_id} took longer than {timeout_s}s")


async def accept_circuit(host: Any, stream: INetStream, relay_ids: Collection[str], *, timeout_s: float) -> str | None:
    """Answer a STOP CONNECT on ``stream``; the source peer's id once its connection is up, else None."""
    from libp2p.connection_types import ConnectionType
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import StopMessage
    from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
    from multiaddr import Multiaddr

    relay = str(stream.muxed_conn.peer_id)
    try:
        with trio.fail_after(timeout_s):
            msg = await read_delimited_msg(stream, StopMessage)
            if relay not in relay_ids:
                await write_delimited_msg(stream, StopMessage(
                    type=StopMessage.STATUS, status=to_proto_status(StatusCode.PERMISSION_DENIED)))
                await close_stream_quietly(stream)
                log.warning("refused a circuit from %s: not one of our relays", relay)
                return None
            if msg.type != StopMessage.CONNECT or not msg.peer.id:
                await write_delimited_msg(stream, StopMessage(
                    type=StopMessage.STATUS, status=to_proto_status(StatusCode.MALFORMED_MESSAGE)))
                await close_stream_quietly(stream)
                return None
            src = ID(msg.peer.id)
            await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS, status=to_proto_status(StatusCode.OK)))
            circuit = Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{src}")
            raw = RawConnection(stream=stream, initiator=False, connection_type=ConnectionType.RELAYED, addresses=[circuit])
            muxed = await host.upgrade_inbound_connection(raw, circuit)
        for conn in host.get_network().get_connections(src):
            if getattr(conn, "muxed_conn", None) is muxed:
                conn.set_transport_info([circuit], ConnectionType.RELAYED)
        log.info("inbound circuit from %s through relay %s", src, relay)
        return str(src)
    except Exception as exc:
        log.info("inbound circuit through %s failed: %r", relay, exc)
        with trio.CancelScope(shield=True):
            await reset_quietly(stream)
        return None
