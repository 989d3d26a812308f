"""Small helpers of the relay's libp2p handlers (shell): peer ids, IPs of addresses, quiet stream ends."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from swarm.p2p.nat import is_relayed_conn
from swarm.p2p.transport import quietly

if TYPE_CHECKING:
    from libp2p.abc import INetStream

__all__ = ["close_stream", "ip_of", "norm_ip", "over_relay", "peer_of", "reset_stream"]


def peer_of(peer: str) -> Any:
    from libp2p.peer.id import ID

    return ID.from_base58(peer)


def norm_ip(ip: str) -> str | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


def ip_of(maddr: Any) -> str | None:
    for proto in ("ip4", "ip6"):
        try:
            return norm_ip(str(maddr.value_for_protocol(proto)))
        except Exception:
            continue
    return None


async def close_stream(stream: Any) -> None:
    await quietly(stream.close, "closing a stream", shield=True)


async def reset_stream(stream: Any) -> None:
    await quietly(stream.reset, "resetting a stream", shield=True)


def over_relay(host: Any, stream: INetStream) -> bool:
    """True if ``stream`` came over a relayed connection (no hop or dial-back over a relay)."""
    for conn in host.get_network().get_connections(stream.muxed_conn.peer_id):
        if getattr(conn, "muxed_conn", None) is stream.muxed_conn:
            return is_relayed_conn(conn)
    return False
