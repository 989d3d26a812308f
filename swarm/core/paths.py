"""How peers reach each other through NATs: reachability, what to advertise, how to dial, which
path a connection is (pure core: no I/O, no clock; addresses are multiaddr strings).

Rules:
- An address is a *circuit* address if it has a ``/p2p-circuit`` component, else *direct*.
- Reachability comes from dial-back checks (AutoNAT v1): one successful dial-back of one of our
  addresses makes us ``public``; checks that all came back refused or failed make us ``private``;
  no answer at all (no relay spoke AutoNAT, every check errored) leaves us ``unknown``. With no
  dialable listen address at all we are ``private`` without asking anyone.
- A ``private`` volunteer reserves on its relays and advertises only its circuit addresses; a
  ``public`` one advertises only its direct addresses and reserves nothing; an ``unknown`` one
  does both (the coordinator tries direct first and falls back to the circuit).
- Dialing: direct addresses start at once; circuit addresses start after ``circuit_delay_s`` if
  there are direct ones (so a reachable peer is reached directly), at once if there are none.
  The first connection wins.
- Path of a connection: ``relayed`` if it runs through a circuit; ``hole-punched`` if it is direct
  but the peer was first reached through a relay (DCUtR or a dial-back upgraded it); otherwise
  ``direct``.
- An expert session that may have opened before the peer's connection turned direct (the call
  that opened it started no later than the upgrade) is moved to a new stream, which takes the
  direct connection. A needless move costs one stream; a missed one would keep the traffic on the
  relay. Until it moves, such a session is reported ``relayed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "DialPlan",
    "DialResult",
    "Path",
    "Reachability",
    "advertised_addrs",
    "classify_path",
    "dial_plan",
    "is_circuit",
    "reachability_verdict",
    "session_path",
    "should_migrate",
    "should_reserve",
]

CIRCUIT = "/p2p-circuit"


class Path(StrEnum):
    DIRECT = "direct"
    RELAYED = "relayed"
    HOLE_PUNCHED = "hole-punched"


class Reachability(StrEnum):
    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


class DialResult(StrEnum):
    """One dial-back check's outcome (AutoNAT v1 response status, or a transport failure)."""

    OK = "ok"  # the server dialled one of our addresses
    REFUSED = "refused"  # E_DIAL_REFUSED: none of our addresses is on the IP it sees us at
    FAILED = "failed"  # E_DIAL_ERROR: it dialled and could not connect
    ERROR = "error"  # no answer: the check itself failed (protocol not spoken, timeout, ...)


def is_circuit(addr: str) -> bool:
    return any(part == CIRCUIT[1:] for part in addr.split("/"))


def reachability_verdict(results: list[DialResult], *, has_dialable_addr: bool) -> Reachability:
    if not has_dialable_addr:
        return Reachability.PRIVATE
    if DialResult.OK in results:
        return Reachability.PUBLIC
    if any(r in (DialResult.REFUSED, DialResult.FAILED) for r in results):
        return Reachability.PRIVATE
    return Reachability.UNKNOWN


def should_reserve(reachability: Reachability) -> bool:
    return reachability is not Reachability.PUBLIC


def advertised_addrs(
    reachability: Reachability, direct: tuple[str, ...], circuit: tuple[str, ...]
) -> tuple[str, ...]:
    match reachability:
        case Reachability.PUBLIC:
            return direct
        case Reachability.PRIVATE:
            return circuit
        case Reachability.UNKNOWN:
            return direct + circuit
    return ()  # pragma: no cover - exhaustive


@dataclass(frozen=True)
class DialPlan:
    direct: tuple[str, ...]
    circuit: tuple[str, ...]
    circuit_delay_s: float  # when to start the circuit dials, relative to the direct ones


def dial_plan(addrs: list[str] | tuple[str, ...], *, circuit_delay_s: float) -> DialPlan:
    direct = tuple(a for a in addrs if not is_circuit(a))
    circuit = tuple(a for a in addrs if is_circuit(a))
    return DialPlan(direct, circuit, circuit_delay_s if direct else 0.0)


def classify_path(*, relayed: bool, reached_via_relay_before: bool) -> Path:
    if relayed:
        return Path.RELAYED
    return Path.HOLE_PUNCHED if reached_via_relay_before else Path.DIRECT


def should_migrate(*, opened_at: float | None, upgraded_at: float | None) -> bool:
    """Move an expert session to a new stream? ``opened_at``: when the call that opened it started;
    ``upgraded_at``: when the peer's relayed connection turned direct (None: it never did)."""
    return opened_at is not None and upgraded_at is not None and opened_at <= upgraded_at


def session_path(best: Path | None, *, opened_at: float | None, upgraded_at: float | None) -> Path | None:
    """The path an expert session's traffic takes, given the path a new stream would take."""
    if best is None:
        return None
    return Path.RELAYED if should_migrate(opened_at=opened_at, upgraded_at=upgraded_at) else best
