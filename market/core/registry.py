"""Who is registered, and whether a heartbeat or registration is fresh (pure: no I/O, no clock).

Rules (DESIGN §6, §11):
- A volunteer's heartbeats carry ``(epoch, sequence)``: ``epoch`` grows on every volunteer
  restart, ``sequence`` strictly grows within an epoch. A heartbeat is accepted when it is the
  peer's first, opens a newer epoch (any sequence), or has the current epoch and a higher
  sequence. An older epoch is ``stale_epoch``; the current epoch with a sequence at or below the
  last accepted one is ``replayed_sequence``. Rejected heartbeats change nothing.
- A volunteer silent for longer than the heartbeat TTL expires: its coverage is dropped (its
  identity row, with the epoch high-water mark, is kept so old heartbeats stay rejected).
- A coordinator registration carries an ``epoch`` too (its start time): a registration older than
  the stored one never replaces it; an equal epoch is a retry and is accepted.
- Per-address limits count an IPv4 address as itself and an IPv6 one by its /64 (one host is
  given a whole /64 to pick from) (``address_key``); a string that is no IP address counts as itself.
- A heartbeat's slice list is the volunteer's whole holding: ``diff_coverage`` says which rows to
  add, which to change and which to drop (a slice no longer listed was released).
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from market.core.records import CoverageRow, HeldState, SliceRef
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import QuarantineEvidence

__all__ = [
    "ACCEPTED",
    "CoverageDiff",
    "address_key",
    "HeartbeatVerdict",
    "check_heartbeat",
    "diff_coverage",
    "is_expired",
    "registration_is_stale",
    "epoch_bound_ms",
    "evidence_problem",
    "manifest_shape",
]


class HeartbeatVerdict(enum.StrEnum):
    FIRST = "first"
    NEXT = "next"
    NEW_EPOCH = "new_epoch"
    STALE_EPOCH = "stale_epoch"
    REPLAYED_SEQUENCE = "replayed_sequence"


ACCEPTED = frozenset({HeartbeatVerdict.FIRST, HeartbeatVerdict.NEXT, HeartbeatVerdict.NEW_EPOCH})


def check_heartbeat(known: tuple[int, int] | None, epoch: int, sequence: int) -> HeartbeatVerdict:
    """Judge a heartbeat ``(epoch, sequence)`` against the last accepted ``known`` one."""
    if known is None:
        return HeartbeatVerdict.FIRST
    k_epoch, k_seq = known
    if epoch > k_epoch:
        return HeartbeatVerdict.NEW_EPOCH
    if epoch < k_epoch:
        return HeartbeatVerdict.STALE_EPOCH
    return HeartbeatVerdict.NEXT if sequence > k_seq else HeartbeatVerdict.REPLAYED_SEQUENCE


def address_key(address: str) -> str:
    """What per-address limits count ``address`` as: an IPv4 address (IPv4-mapped ones included) itself,
    an IPv6 address its /64 network, anything else itself (bounded in length)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:256]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def network_tag(address: str, salt: bytes) -> str:
    """An opaque tag of the network ``address`` speaks from -- its IPv4 /24 or IPv6 /48 (an IPv4-mapped
    address as IPv4), salted and hashed so the map names no address -- or "" when unknown. Replicas of
    one tag could be one party: a coordinator never lets one check the other."""
    if not address:
        return ""
    try:
        ip = ipaddress.ip_network(address, strict=False).network_address if "/" in address else ipaddress.ip_address(address)
    except ValueError:
        prefix = address[:256]
    else:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        bits = 24 if isinstance(ip, ipaddress.IPv4Address) else 48
        prefix = str(ipaddress.ip_network((ip, bits), strict=False))
    return hashlib.sha256(salt + prefix.encode()).hexdigest()[:16]


def is_expired(last_seen: float, now: float, ttl_s: float) -> bool:
    return now - last_seen > ttl_s


def epoch_bound_ms(now: float, ahead_s: float = 600.0) -> int:
    """The largest registration epoch accepted at ``now`` (s): a start time in ms, ``ahead_s`` of clock
    skew allowed (minutes). A larger one would lock the coordinator's URL out until the clock reaches it
    (2^63 - 1: for good; a day ahead: for a day)."""
    return int((now + ahead_s) * 1000)


def registration_is_stale(stored_epoch: int | None, epoch: int) -> bool:
    return stored_epoch is not None and epoch < stored_epoch


@dataclass
class CoverageDiff:
    added: list[tuple[SliceRef, HeldState]] = field(default_factory=list)
    changed: list[tuple[CoverageRow, HeldState]] = field(default_factory=list)  # (old row, new state)
    removed: list[CoverageRow] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def diff_coverage(rows: Mapping[SliceRef, CoverageRow], reported: Mapping[SliceRef, HeldState]) -> CoverageDiff:
    """What turns the stored ``rows`` of one volunteer into its ``reported`` holding."""
    d = CoverageDiff()
    for s, state in reported.items():
        old = rows.get(s)
        if old is None:
            d.added.append((s, state))
        elif old.state is not state:
            d.changed.append((old, state))
    for s, row in rows.items():
        if s not in reported:
            d.removed.append(row)
    return d


def evidence_problem(ev: QuarantineEvidence, m: ModelManifest) -> str:
    """What makes quarantine evidence unusable against model ``m`` ("" when it is fine)."""
    if not (ev.layer < m.n_layer and ev.lo < ev.hi <= m.n_expert):
        return f"slice {ev.layer}:{ev.lo}-{ev.hi} is not one of a {m.n_layer} x {m.n_expert} model"
    if ev.remote_sha256 == ev.local_sha256:
        return "the worker's output and the coordinator's have the same sha256: no divergence"
    return ""


def manifest_shape(m: ModelManifest) -> tuple[int, int, tuple[int, ...]]:
    """What a model's registrations must agree on: layers, experts, bytes per expert of each layer."""
    return (m.n_layer, m.n_expert, tuple(m.bytes_per_expert))
