"""Relay admission and accounting (pure core: no I/O, no clock; ``now`` is given).

The hop service (``relay.service``) asks this ledger before it grants a reservation or opens a
circuit, and reports every byte it forwards and every circuit it ends.

Rules:
- A reservation belongs to a peer and lasts ``reservation_ttl_s`` from its last (re)grant; a
  RESERVE from a peer that holds one extends it. Reservations are refused beyond
  ``max_reservations``. A reservation is valid only while its peer is connected to the relay
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
]


@dataclass(frozen=True)
class RelayLimits:
    max_reservations: int = 128
    max_circuits: int = 1024
    max_circuits_per_peer: int = 16
    reservation_ttl_s: int = 3600
    circuit_max_bytes: int = 0  # per direction; 0 = unlimited
    circuit_max_duration_s: int = 0  # 0 = unlimited

    def __post_init__(self) -> None:
        if min(self.max_reservations, self.max_circuits, self.max_circuits_per_peer, self.reservation_ttl_s) < 1:
            raise ValueError(f"relay limits must be >= 1: {self}")
        if self.circuit_max_bytes < 0 or self.circuit_max_duration_s < 0:
            raise ValueError(f"circuit caps must be >= 0 (0 = unlimited): {self}")


class Refusal(StrEnum):
    RESERVATION_LIMIT = "reservation_limit"  # every reservation slot is taken
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


class RelayLedger:
    def __init__(self, limits: RelayLimits) -> None:
        self.limits = limits
        self.draining = False
        self._reservations: dict[str, float] = {}  # peer -> expires_at
        self._circuits: dict[int, _Circuit] = {}
        self._next_id = 1
        self._per_peer: Counter[str] = Counter()
        self._granted_total = 0
        self._opened_total = 0
        self._bytes_total = 0
        self._refusals: Counter[Refusal] = Counter()

    # -- reservations ------------------------------------------------------------------------------
    def reserve(self, peer: str, now: float) -> Reserved | Refused:
        if self.draining:
            return self._refuse(Refusal.DRAINING)
        self.expire(now)
        renewed = peer in self._reservations
        if not renewed and len(self._reservations) >= self.limits.max_reservations:
            return self._refuse(Refusal.RESERVATION_LIMIT)
        expires_at = now + self.limits.reservation_ttl_s
        self._reservations[peer] = expires_at
        self._granted_total += 1
        return Reserved(expires_at, renewed)

    def has_reservation(self, peer: str, now: float) -> bool:
        exp = self._reservations.get(peer)
        return exp is not None and now < exp

    def peer_disconnected(self, peer: str) -> bool:
        """The peer's last connection to the relay closed: its reservation ends. True if it had one."""
        return self._reservations.pop(peer, None) is not None

    def expire(self, now: float) -> list[str]:
        gone = [p for p, exp in self._reservations.items() if now >= exp]
        for p in gone:
            del self._reservations[p]
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
