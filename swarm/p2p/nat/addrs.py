"""Relay and circuit addresses, protocol ids and small helpers shared by the NAT modules (shell helpers).

Rules:
- A relay address ends in ``/p2p/<relay id>``; a circuit address is
  ``<relay>/p2p/R/p2p-circuit/p2p/D``. Malformed ones are a ``ConfigError`` (our flags) or a
  ``DialError`` (a peer's advertisement), never a library exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgspec

from swarm.config import Multiaddr, NonNegFloat, PosFloat
from swarm.core.paths import is_circuit
from swarm.errors import ConfigError, DialError
from swarm.p2p.transport import quietly

if TYPE_CHECKING:
    from libp2p.peer.id import ID

__all__ = [
    "AUTONAT_PROTOCOL",
    "DCUTR_PROTOCOL",
    "HOP_PROTOCOL",
    "STOP_PROTOCOL",
    "NatConfig",
    "RelayAddr",
    "circuit_parts",
    "close_conn",
    "close_stream_quietly",
    "is_relayed_conn",
    "parse_relay_addr",
    "pid",
    "reset_quietly",
]

HOP_PROTOCOL: Final = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL: Final = "/libp2p/circuit/relay/0.2.0/stop"
DCUTR_PROTOCOL: Final = "/libp2p/dcutr"
AUTONAT_PROTOCOL: Final = "/libp2p/autonat/1.0.0"


class NatConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    relays: tuple[Multiaddr, ...] = ()  # listen through these (multiaddrs ending in /p2p/<relay id>)
    hole_punch: bool = True  # drive DCUtR after circuit dials / answer it as a listener
    circuit_delay_s: NonNegFloat = 0.3  # head start of direct addresses over circuit ones
    relay_timeout_s: PosFloat = 10.0  # one RESERVE, CONNECT or AutoNAT exchange
    hole_punch_timeout_s: PosFloat = 15.0  # how long a relayed connection may take to turn direct
    relayed_close_grace_s: NonNegFloat = 10.0  # keep the relayed connection this long after an upgrade
    check_reachability: bool = True  # ask the relays (AutoNAT); off = assume private
    backoff_base_s: PosFloat = 0.5
    backoff_max_s: PosFloat = 30.0


@dataclass(frozen=True)
class RelayAddr:
    addr: str  # as given, ending in /p2p/<relay id>
    peer_id: str
    transport_addr: str  # without /p2p/<relay id>

    def circuit_for(self, peer_id: str) -> str:
        return f"{self.addr}/p2p-circuit/p2p/{peer_id}"


def parse_relay_addr(addr: str) -> RelayAddr:
    """``/ip4/1.2.3.4/tcp/4001/p2p/<relay id>`` -> ``RelayAddr``; ``ConfigError`` if malformed."""
    from multiaddr import Multiaddr

    try:
        maddr = Multiaddr(addr)
        peer = maddr.get_peer_id()
    except Exception as exc:
        raise ConfigError(f"bad relay address {addr!r}: {exc}") from exc
    if peer is None or is_circuit(addr):
        raise ConfigError(f"relay address {addr!r} must end in /p2p/<relay peer id> (the relay prints it at start)")
    return RelayAddr(addr=str(maddr), peer_id=str(peer), transport_addr=str(maddr.decapsulate(Multiaddr(f"/p2p/{peer}"))))


def is_relayed_conn(conn: Any) -> bool:
    """True if a swarm connection runs through a relay."""
    from libp2p.connection_types import ConnectionType

    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
        return any(is_circuit(str(a)) for a in conn.get_transport_addresses() or [])
    except Exception:
        return False


def circuit_parts(addr: str) -> tuple[str, str, str]:
    """``<relay>/p2p/R/p2p-circuit/p2p/D`` -> (relay transport addr, relay id, destination id)."""
    relay_part, _, rest = addr.partition("/p2p-circuit")
    relay = parse_relay_addr(relay_part)
    dest = rest.removeprefix("/p2p/").split("/")[0]
    if not dest:
        raise ConfigError(f"circuit address {addr!r} does not name its destination peer")
    return relay.transport_addr, relay.peer_id, dest


def pid(peer_id: str) -> ID:
    from libp2p.peer.id import ID

    try:
        return ID.from_base58(peer_id)
    except Exception as exc:
        raise DialError(f"bad peer id {peer_id!r}: {exc}") from exc


async def close_stream_quietly(stream: Any) -> None:
    await quietly(stream.close, "closing a relay stream")


async def reset_quietly(stream: Any) -> None:
    await quietly(stream.reset, "resetting a relay stream")


async def close_conn(conn: Any) -> None:
    await quietly(conn.close, "closing a relayed connection", timeout_s=5, shield=True)
