"""``moe-swarm relay``: a circuit relay v2 hop service sized for expert traffic (shell).

Speaks the standard protocols, so any libp2p circuit-relay-v2 client can use it and our clients
can use any standard relay:
- ``/libp2p/circuit/relay/0.2.0/hop``: RESERVE and CONNECT (then ``.../stop`` to the destination);
- ``/libp2p/autonat/1.0.0``: dial-back checks, so a volunteer learns whether it is reachable.
Admission and accounting are decided by ``relay.core.ledger``. This module wires the pieces to one
host: ``relay.hop`` (RESERVE, CONNECT, the splice), ``relay.autonat`` (dial-backs),
``relay.http`` (``/metrics``, ``/health``).

Rules:
- Defaults suit long-lived, high-volume expert circuits: no per-circuit byte or duration cap
  (the limit field is omitted, which the spec defines as "unlimited"), 128 reservations (16 from one
  IP address, 64 from one /24: ``relay.core.ledger``),
  16 circuits per peer, reservations valid 1 h and refreshed by their holders.
- Each circuit is two tasks copying bytes between two streams, in its own cancel scope; its end
  (EOF is forwarded as a half-close, an error as a reset) touches no other circuit.
- A reservation ends when its holder's last connection to the relay closes.
- AutoNAT dial-backs use a fresh TCP connection and a Noise handshake that must prove the
  requester's peer id, only to addresses on the IP the request came from, at most
  ``max_dialbacks`` at a time; requests over relayed connections are refused.
- ``/metrics`` (Prometheus) and ``/health`` (JSON) on ``--host``/``--port``.
- Shutdown (SIGINT/SIGTERM): refuse new reservations and circuits, end live circuits with a
  half-close (a reset after ``drain_timeout_s``), then close every connection and listener.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from relay.autonat import AutoNatServer
from relay.core.ledger import RelayLedger, RelayLimits
from relay.hop import HopService
from relay.http import build_app
from relay.streams import peer_of
from swarm.config import Multiaddr, NonNegFloat, NonNegInt, Port, PosFloat, PosInt
from swarm.errors import ConfigError
from swarm.p2p.libp2p import Libp2pTransport, connection_notifee, open_libp2p_transport
from swarm.p2p.nat import AUTONAT_PROTOCOL, HOP_PROTOCOL
from swarm.protocol.status import RelayInfo, encode_info

if TYPE_CHECKING:
    pass

__all__ = ["RelayConfig", "RelayHealth", "RelayService", "RelayStatus", "open_relay", "serve_relay"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 16


class RelayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``moe-swarm relay``'s settings (built by ``relay.cli``; 0 = unlimited where noted)."""

    listen: tuple[Multiaddr, ...] = ("/ip4/0.0.0.0/tcp/4001",)
    announce: tuple[Multiaddr, ...] = ()  # public addresses handed to volunteers (default: the listen ones)
    host: str = "127.0.0.1"  # /metrics and /health
    port: Port = 9090
    data_dir: str | None = None  # identity key; None = a fresh identity per run
    max_reservations: NonNegInt = 128
    max_reservations_per_address: NonNegInt = 16  # from one IP address (an IPv6 /64)
    max_reservations_per_prefix: NonNegInt = 64  # from one IPv4 /24 or IPv6 /48
    max_circuits: NonNegInt = 1024
    max_circuits_per_peer: NonNegInt = 16
    reservation_ttl_s: PosInt = 3600
    circuit_max_bytes: NonNegInt = 0  # per direction; 0 = unlimited
    circuit_max_duration_s: NonNegInt = 0  # 0 = unlimited
    timeout_s: PosFloat = 10.0  # one protocol exchange (reading a request, reaching a destination)
    max_dialbacks: PosInt = 8
    drain_timeout_s: NonNegFloat = 1.0
    # receive window per stream: what the relay holds of a circuit direction whose reader stalls (plus one
    # 64 KiB chunk); the spec's initial 256 KiB, not the 16 MiB our other hosts grant for throughput
    stream_window_bytes: Annotated[int, msgspec.Meta(ge=256 * 1024, le=16 * 1024 * 1024)] = 256 * 1024

    def limits(self) -> RelayLimits:
        try:
            return RelayLimits(
                max_reservations=self.max_reservations, max_circuits=self.max_circuits,
                max_circuits_per_peer=self.max_circuits_per_peer, reservation_ttl_s=self.reservation_ttl_s,
                circuit_max_bytes=self.circuit_max_bytes, circuit_max_duration_s=self.circuit_max_duration_s,
                max_reservations_per_address=self.max_reservations_per_address,
                max_reservations_per_prefix=self.max_reservations_per_prefix,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


class RelayStatus(StrEnum):
    OK = "ok"
    DRAINING = "draining"  # shutting down: new reservations and circuits are refused


class RelayHealth(msgspec.Struct, frozen=True, kw_only=True):
    """``/health``'s body."""

    status: RelayStatus
    peer_id: str
    addrs: tuple[str, ...]  # what volunteers are given (``announce_addrs``)
    reservations: int
    circuits: int
    bytes_relayed: int  # since start, both directions
    limits: RelayConfig  # the whole configuration this relay runs with


class RelayService:
    """The hop and AutoNAT handlers of one relay host."""

    def __init__(self, transport: Libp2pTransport, cfg: RelayConfig) -> None:
        self.transport = transport
        self.host = transport.host
        self.cfg = cfg
        self.ledger = RelayLedger(cfg.limits())
        self._ledger_changed = trio.Event()  # set and replaced whenever the ledger may have changed
        self.hop = HopService(self.host, cfg, self.ledger, self.announce_addrs, on_change=lambda: self._changed())
        self.autonat = AutoNatServer(self.host, timeout_s=cfg.timeout_s, max_dialbacks=cfg.max_dialbacks)
        self.metrics_url: str | None = None

    # -- wiring --------------------------------------------------------------------------------------
    def install(self) -> None:
        from libp2p.custom_types import TProtocol

        self.host.set_stream_handler(TProtocol(HOP_PROTOCOL), self.hop.on_stream)
        self.host.set_stream_handler(TProtocol(AUTONAT_PROTOCOL), self.autonat.on_stream)
        self.host.get_network().register_notifee(connection_notifee(lambda conn: None, self._on_disconnected))

    def announce_addrs(self) -> list[str]:
        """``--announce``, else the listen addresses with wildcards expanded to this host's
        interfaces (loopback last): what volunteers are given, each ending in ``/p2p/<relay id>``."""
        from libp2p.utils.address_validation import expand_wildcard_address
        from multiaddr import Multiaddr

        me = str(self.host.get_id())
        if self.cfg.announce:
            addrs = list(self.cfg.announce)
        else:
            addrs = []
            for a in self.transport.listen_addrs:
                bare = a.removesuffix(f"/p2p/{me}")
                if "/ip4/0.0.0.0/" in bare or "/ip6/::/" in bare:
                    addrs.extend(str(x) for x in expand_wildcard_address(Multiaddr(bare)))
                else:
                    addrs.append(bare)
            addrs.sort(key=lambda x: x.startswith(("/ip4/127.", "/ip6/::1/")))
        return list(dict.fromkeys(a if a.endswith(f"/p2p/{me}") else f"{a}/p2p/{me}" for a in addrs))

    def _on_disconnected(self, conn: Any) -> None:
        try:
            self.peer_disconnected(str(conn.muxed_conn.peer_id))
        except Exception as exc:
            log.debug("disconnect notification: %r", exc)

    def peer_disconnected(self, peer: str) -> None:
        live = [c for c in self.host.get_network().get_connections(peer_of(peer)) if not c.is_closed]
        if not live and self.ledger.peer_disconnected(peer):
            log.info("reservation of %s ended: disconnected", peer)
        self._changed()  # every disconnect: the last of a peer's connections may be the next one

    def _changed(self) -> None:
        self._ledger_changed.set()
        self._ledger_changed = trio.Event()

    async def wait_reservations(self, ready: Callable[[int], bool]) -> None:
        """Wait until ``ready(reservations held)``, looked at again whenever the ledger may have changed
        (a reservation asked for, a connection closed)."""
        while not ready(self.ledger.stats().reservations):
            await self._ledger_changed.wait()

    async def drain(self) -> None:
        """Refuse everything new, end live circuits gracefully, then reset what is left."""
        await self.hop.drain()

    @property
    def dialback_results(self) -> Counter[str]:
        return self.autonat.results

    def health(self) -> RelayHealth:
        self.ledger.expire(trio.current_time())
        s = self.ledger.stats()
        return RelayHealth(
            status=RelayStatus.DRAINING if self.ledger.draining else RelayStatus.OK,
            peer_id=self.transport.peer_id,
            addrs=tuple(self.announce_addrs()),
            reservations=s.reservations,
            circuits=s.circuits,
            bytes_relayed=s.bytes_relayed_total,
            limits=self.cfg,
        )


@asynccontextmanager
async def open_relay(cfg: RelayConfig) -> AsyncIterator[RelayService]:
    """A running relay (libp2p listeners and the HTTP endpoint); drained and closed on exit."""
    key_path = Path(cfg.data_dir) / "identity.key" if cfg.data_dir is not None else None
    if not cfg.listen:
        raise ConfigError("give at least one --listen multiaddr")
    async with open_libp2p_transport(key_path=key_path, listen_addrs=cfg.listen, dial_timeout_s=cfg.timeout_s,
                                     yamux_window_bytes=cfg.stream_window_bytes) as transport:
        service = RelayService(transport, cfg)
        service.install()
        hc = HyperConfig()
        hc.bind = [f"{cfg.host}:{cfg.port}"]
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = 1.0
        try:
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(hypercorn_serve, build_app(service), hc)
                service.metrics_url = f"{binds[0]}/metrics" if binds else None
                try:
                    yield service
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await service.drain()
                s = service.ledger.stats()
                log.info("relay stopped: %d circuits opened, %d bytes relayed", s.circuits_opened_total, s.bytes_relayed_total)


async def serve_relay(cfg: RelayConfig, *, task_status: trio.TaskStatus[RelayInfo] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the relay until cancelled; ``task_status.started(info)`` with its peer id, addresses and
    metrics URL once both the libp2p listeners and the HTTP endpoint are up (also written to
    ``DATA_DIR/relay.json``)."""
    async with open_relay(cfg) as service:
        info = RelayInfo(peer_id=service.transport.peer_id, addrs=service.announce_addrs(), metrics=service.metrics_url)
        if cfg.data_dir is not None:
            await trio.Path(cfg.data_dir, "relay.json").write_bytes(encode_info(info))
        log.info("relay %s listening on %s", info.peer_id, ", ".join(info.addrs))
        task_status.started(info)
        await trio.sleep_forever()
