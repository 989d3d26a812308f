"""py-libp2p 0.8.1 host construction and shutdown with workarounds (a), (b), (d), (i) (shell).

The lettered list of every workaround is in ``swarm.p2p.patches``; this module holds the ones that
concern the host itself: the swarm subclass, the connection config, and the shutdown order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import msgspec
import trio

from swarm.p2p.patches import check_libp2p_version
from swarm.p2p.transport import quietly

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair
    from libp2p.host.basic_host import BasicHost

__all__ = ["build_host", "close_network", "close_quietly"]

log = logging.getLogger(__name__)


def _workaround_swarm_class() -> type[Any]:
    from libp2p.abc import IMuxedConn
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.network.swarm import Swarm, _NegativePeerCache

    class _WorkaroundSwarm(Swarm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._negative_peer_cache = _NegativePeerCache(ttl=0.0)

            async def no_auto_connect() -> None:  # workaround (i)
                await trio.lowlevel.checkpoint()

            self.auto_connector.maybe_connect = no_auto_connect  # type: ignore[method-assign]

        async def _do_handle_inbound_connection(
            self, read_write_closer: Any, maddr: Any, failure_event: Any
        ) -> None:
            if isinstance(read_write_closer, IMuxedConn):  # QUIC-style transports: not used here
                await super()._do_handle_inbound_connection(
                    cast(Any, read_write_closer), maddr, failure_event
                )
                return
            remote = self._build_remote_multiaddr(read_write_closer)
            if remote is not None and not await self.connection_gate.is_allowed(remote):
                await read_write_closer.close()
                return
            raw_conn = RawConnection(read_write_closer, False)
            try:
                muxed_conn = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
            except Exception as exc:
                log.debug("inbound connection on %s failed to upgrade: %r", maddr, exc)
                try:
                    await raw_conn.close()
                except Exception:
                    pass
                return
            closed = getattr(muxed_conn, "event_closed", None)
            if isinstance(closed, trio.Event):
                await closed.wait()  # the fix: hold the slot only as long as the connection lives
            else:
                await self.manager.wait_finished()  # the library's behaviour for other muxers

    return _WorkaroundSwarm


def build_host(key_pair: KeyPair, *, websocket: bool = False, yamux_window_bytes: int | None = None) -> BasicHost:
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.host.basic_host import BasicHost
    from libp2p.network.config import ConnectionConfig, RetryConfig
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import PeerStore
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux
    from libp2p.transport.tcp.tcp import TCP
    from libp2p.transport.upgrader import TransportUpgrader

    from swarm.p2p.patches.yamux import DEFAULT_TUNING, apply_yamux_tuning

    check_libp2p_version()
    peer_id = ID.from_pubkey(key_pair.public_key)
    peerstore = PeerStore()
    peerstore.add_key_pair(peer_id, key_pair)
    upgrader = TransportUpgrader(
        secure_transports_by_protocol={
            TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
                key_pair, noise_privkey=create_x25519_key_pair().private_key
            )
        },
        muxer_transports_by_protocol={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )
    tuning = DEFAULT_TUNING if yamux_window_bytes is None else msgspec.structs.replace(
        DEFAULT_TUNING, window_bytes=yamux_window_bytes)
    apply_yamux_tuning(upgrader, tuning)  # go-yamux window updates, fewer scheduler trips per frame
    transports: list[Any] = [TCP()]
    if websocket:
        from libp2p.transport.websocket.transport import WebsocketTransport

        transports.append(WebsocketTransport(upgrader))
    swarm = _workaround_swarm_class()(
        peer_id,
        peerstore,
        upgrader,
        transports=transports,
        retry_config=RetryConfig(max_retries=0),
        connection_config=ConnectionConfig(max_connections_per_peer=1, min_connections=0, low_watermark=0),
    )
    return BasicHost(network=swarm)


async def close_network(host: BasicHost) -> None:
    """Close listeners, then every connection (in parallel), shielded, before the service stops.

    py-libp2p 0.8.1 does this in the service's ``finally`` while being cancelled, so each close is
    interrupted at its first checkpoint: connection sockets leak, and the listening socket (served
    from a trio system task) stays open -- with SO_REUSEPORT a restarted peer on the same port then
    shares it with the dead listener, which takes some of its connections. Each connection close
    also sleeps 0.2 s inside the library, hence in parallel.
    """
    network = host.get_network()
    with trio.move_on_after(5) as scope:
        scope.shield = True
        for listener in list(network.listeners.values()):
            try:
                await listener.close()
            except Exception as exc:
                log.debug("closing listener: %r", exc)
        async with trio.open_nursery() as nursery:
            for conns in list(network.connections.values()):
                for conn in list(conns):
                    nursery.start_soon(close_quietly, conn)


async def close_quietly(conn: Any) -> None:
    """Close a connection to the end, even when cancelled: an interrupted close marks the connection
    closed without closing its socket, and a later close() then returns at once (py-libp2p 0.8.1)."""
    await quietly(conn.close, "closing connection", timeout_s=5, shield=True)


