"""Relay and NAT traversal (shell): reach peers behind NATs and be reachable from behind one.

- ``addrs``: relay/circuit addresses, protocol ids, ``NatConfig``.
- ``circuit``: circuit relay v2 as a client (HOP CONNECT out, STOP CONNECT in).
- ``autonat``: AutoNAT v1 dial-back requests (are we reachable?).
- ``reservations``: holding a slot on a relay, driven by ``swarm.core.reservation``.
- ``service``: ``Nat`` (dialing, DCUtR hole punching, paths, advertised addresses), ``open_nat``,
  ``open_listener_host``.
"""

from swarm.p2p.nat.addrs import (
    AUTONAT_PROTOCOL,
    DCUTR_PROTOCOL,
    HOP_PROTOCOL,
    STOP_PROTOCOL,
    NatConfig,
    RelayAddr,
    is_relayed_conn,
    parse_relay_addr,
)
from swarm.p2p.nat.reservations import RelayStatus
from swarm.p2p.nat.service import Nat, open_listener_host, open_nat

__all__ = [
    "AUTONAT_PROTOCOL",
    "DCUTR_PROTOCOL",
    "HOP_PROTOCOL",
    "STOP_PROTOCOL",
    "Nat",
    "NatConfig",
    "RelayAddr",
    "RelayStatus",
    "is_relayed_conn",
    "open_listener_host",
    "open_nat",
    "parse_relay_addr",
]
