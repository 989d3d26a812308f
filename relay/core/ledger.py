"""Relay admission and accounting (pure core: no I/O, no clock; ``now`` is given).

The hop service (``relay.service``) asks this ledger before it grants a reservation or opens a
circuit, and reports every byte it forwards and every circuit it ends.

Rules:
- A reservation belongs to a peer and lasts ``reservation_ttl_s`` from its last (re)grant; a
  RESERVE from a peer that holds one extends it (one reservation per identity). Reservations are
  refused beyond ``max_reservations`` in all, beyond ``max_reservations_per_address`` from one IP
  address (an IPv6 /64 counts as one) and beyond ``max_reservations_per_prefix`` from one network
  (IPv4 /24, IPv6 /48): throwaway identities from one machine or network cannot take every slot,
  and peers elsewhere still get theirs. A peer renewing from another address moves there (if that
  address has room). A reservation is valid only while its peer is connected to the relay
  (circuit relay v2 spec): when the peer's last connection closes, the slot is freed at once
  instead of lingering until expiry.
- A circuit needs a live reservation of its destination. Each circuit has its own id; ending
  one never touches another (py-libp2p 0.8.1 keyed circuits by peer, so ending one closed others
  to the same peer). Caps: ``max_circuits`` in total and ``max_circuits_per_peer`` per
  destination and per source.
- ``circuit_max_bytes`` (per direction) and ``circuit_max_duration_s`` of 0 mean unlimited --
  the default, since an expert circuit carries activations for as long as the volunteer serves.
- While draining (graceful shutdown) every new reservation and circuit is refused.
- Every refusal carries a ``Refusal`` reason; counters explain the relay's decisions.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "Admitted",
    "Direction",
    "Refusal",
    "Refused",
    "RelayLedger",
    "RelayLimits",
    "RelayStats",
    "Reserved",
    "address_keys",
]


@dataclass(frozen=True)
class RelayLimits:
    max_reservations: int = 128
    max_circuits: int = 1024
    max_circuits_per_peer: int = 16
    reservation_ttl_s: int = 3600
    circuit_max_bytes: int = 0  # per direction; 0 = unlimited
    circuit_max_duration_s: int = 0  # 0 = unlimited
    max_reservations_per_address: int = 16  # from one IP address (an IPv6 /64)
    max_reservations_per_prefix: int = 64  # from one IPv4 /24 or IPv6 /48

    def __post_init__(self) -> None:
        if min(self.max_reservations, self.max_circuits, self.max_circuits_per_peer, self.reservation_ttl_s,
               self.max_reservations_per_address, self.max_reservations_per_prefix) < 1:
            raise ValueError(f"relay limits must be >= 1: {self}")
        if self.circuit_max_bytes < 0 or self.circuit_max_duration_s < 0:
            raise ValueError(f"circuit caps must be >= 0 (0 = unlimited): {self}")


class Refusal(StrEnum):
    RESERVATION_LIMIT = "reservation_limit"  # every reservation slot is taken
    ADDRESS_LIMIT = "address_limit"  # the peer's IP address (or its network) holds its share of the slots
    NO_RESERVATION = "no_reservation"  # the destination holds no live reservation
    CIRCUIT_LIMIT = "circuit_limit"  # the relay carries max_circuits
    PEER_CIRCUIT_LIMIT = "peer_circuit_limit"  # the source or destination has max_circuits_per_peer
    SELF_CIRCUIT = "self_circuit"  # source == destination
    DRAINING = "draining"  # the relay is shutting down


class Direction(StrEnum):
    TO_DST = "to_dst"
    TO_SRC = "to_src"


@dataclass(frozen=True)
class Reserved:
    expires_at: float
    renewed: bool  # True if the peer already held a reservation


@dataclass(frozen=True)
class Refused:
    reason: Refusal


@dataclass(frozen=True)
class Admitted:
    circuit_id: int
    deadline: float | None  # the circuit ends at this time; None = no duration cap
    max_bytes: int | None  # per direction; None = unlimited


@dataclass
class _Circuit:
    src: str
    dst: str
    opened_at: float
    deadline: float | None
    bytes: dict[Direction, int] = field(default_factory=lambda: {Direction.TO_DST: 0, Direction.TO_SRC: 0})


@dataclass(frozen=True)
class RelayStats:
    reservations: int
    circuits: int
    reservations_granted_total: int
    circuits_opened_total: int
    bytes_relayed_total: int
    refusals: dict[str, int]


def address_keys(address: str | None) -> tuple[str, str]:
    """What the per-address and per-network limits count ``address`` as: ``(address key, prefix key)``
    -- an IPv4 address and its /24, an IPv6 address's /64 and its /48 (IPv4-mapped ones as IPv4);
    ``("", "")`` for no address or a string that is no IP address (counted under none)."""
    if not address:
        return ("", "")
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return ("", "")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return (str(ip), str(ipaddress.IPv4Network((ip, 24), strict=False)))
    return (str(ipaddress.IPv6Network((ip, 64), strict=False)), str(ipaddress.IPv6Network((ip, 48), strict=False)))


class RelayLedger:
    def __init__(self, limits: RelayLimits) -> None:
        self.limits = limits
        self.draining = False
        self._reservations: dict[str, float] = {}  # peer -> expires_at
        self._where: dict[str, tuple[str, str]] = {}  # peer -> (address key, prefix key) of its reservation
        self._per_address: Counter[str] = Counter()
        self._per_prefix: Counter[str] = Counter()
        self._circuits: dict[int, _Circuit] = {}
        self._next_id = 1
        self._per_peer: Counter[str] = Counter()
        self._granted_total = 0
        self._opened_total = 0
        self._bytes_total = 0
        self._refusals: Counter[Refusal] = Counter()

    # -- reservations ------------------------------------------------------------------------------
    def reserve(self, peer: str, now: float, address: str | None = None) -> Reserved | Refused:
        """Grant or refresh ``peer``'s reservation; ``address``: the IP its connection comes from (None:
        unknown, counted under no address)."""
        if self.draining:
            return self._refuse(Refusal.DRAINING)
        self.expire(now)
        renewed = peer in self._reservations
        if not renewed and len(self._reservations) >= self.limits.max_reservations:
            return self._refuse(Refusal.RESERVATION_LIMIT)
        where = address_keys(address)
        if where != self._where.get(peer):
            a, p = where
            if a and (self._per_address[a] >= self.limits.max_reservations_per_address
                      or self._per_prefix[p] >= self.limits.max_reservations_per_prefix):
                return self._refuse(Refusal.ADDRESS_LIMIT)
            self._unplace(peer)
            if a:
                self._where[peer] = where
                self._per_address[a] += 1
                self._per_prefix[p] += 1
        expires_at = now + self.limits.reservation_ttl_s
        self._reservations[peer] = expires_at
        self._granted_total += 1
        return Reserved(expires_at, renewed)

    def _unplace(self, peer: str) -> None:
        where = self._where.pop(peer, None)
        if where is None:
            return
        a, p = where
        for counter, key in ((self._per_address, a), (self._per_prefix, p)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]

    def reservations_from(self, address: str) -> int:
        return self._per_address.get(address_keys(address)[0], 0)

    def has_reservation(self, peer: str, now: float) -> bool:
        exp = self._reservations.get(peer)
        return exp is not None and now < exp

    def peer_disconnected(self, peer: str) -> bool:
        """The peer's last connection to the relay closed: its reservation ends. True if it had one."""
        self._unplace(peer)
        return self._reservations.pop(peer, None) is not None

    def expire(self, now: float) -> list[str]:
        gone = [p for p, exp in self._reservations.items() if now >= exp]
        for p in gone:
            del self._reservations[p]
            self._unplace(p)
        return gone

    # -- circuits ----------------------------------------------------------------------------------
    def open_circuit(self, src: str, dst: str, now: float) -> Admitted | Refused:
        if self.draining:
            return self._refuse(Refusal.DRAINING)
        if src == dst:
            return self._refuse(Refusal.SELF_CIRCUIT)
        if not self.has_reservation(dst, now):
            return self._refuse(Refusal.NO_RESERVATION)
        if len(self._circuits) >= self.limits.max_circuits:
            return self._refuse(Refusal.CIRCUIT_LIMIT)
        cap = self.limits.max_circuits_per_peer
        if self._per_peer[dst] >= cap or self._per_peer[src] >= cap:
            return self._refuse(Refusal.PEER_CIRCUIT_LIMIT)
        cid = self._next_id
        self._next_id += 1
        duration = self.limits.circuit_max_duration_s
        self._circuits[cid] = _Circuit(src, dst, now, now + duration if duration else None)
        self._per_peer[src] += 1
        self._per_peer[dst] += 1
        self._opened_total += 1
        return Admitted(cid, self._circuits[cid].deadline, self.limits.circuit_max_bytes or None)

    def record_bytes(self, circuit_id: int, direction: Direction, n: int) -> bool:
        """Account ``n`` forwarded bytes; False if that would pass the circuit's data cap (end it)."""
        c = self._circuits.get(circuit_id)
        if c is None:
            return False
        cap = self.limits.circuit_max_bytes
        if cap and c.bytes[direction] + n > cap:
            return False
        c.bytes[direction] += n
        self._bytes_total += n
        return True

    def close_circuit(self, circuit_id: int) -> None:
        c = self._circuits.pop(circuit_id, None)
        if c is None:
            return
        for p in (c.src, c.dst):
            self._per_peer[p] -= 1
            if self._per_peer[p] <= 0:
                del self._per_peer[p]

    def circuits_of(self, peer: str) -> list[int]:
        return [cid for cid, c in self._circuits.items() if peer in (c.src, c.dst)]

    def drain(self) -> None:
        self.draining = True

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> RelayStats:
        return RelayStats(
            reservations=len(self._reservations),
            circuits=len(self._circuits),
            reservations_granted_total=self._granted_total,
            circuits_opened_total=self._opened_total,
            bytes_relayed_total=self._bytes_total,
            refusals={r.value: self._refusals[r] for r in Refusal},
        )

    def _refuse(self, reason: Refusal) -> Refused:
        self._refusals[reason] += 1
        return Refused(reason)
