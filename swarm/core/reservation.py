"""A volunteer's reservation on one relay: reserve, refresh, re-reserve with backoff (pure core).

Events in, effects out: ``ReservationClient.handle(event, now) -> list[Effect]``. The shell
(``swarm.p2p.nat``) sends the RESERVE when asked (``SendReserve``), reports the outcome
(``ReserveSucceeded`` / ``ReserveFailed``), reports a lost connection to the relay
(``ConnectionLost``), fires the one timer (``SetTimer``; a new one replaces the old), and adds or
removes the relay's ``/p2p-circuit`` addresses from what the volunteer advertises
(``Advertise`` / ``Withdraw``).

Rules:
- A granted reservation is refreshed at ``refresh_fraction`` of its remaining lifetime (at least
  ``min_refresh_s`` from now), so it never lapses while the relay is reachable.
- A failed RESERVE is retried after ``backoff_base_s * 2**(k-1)`` (k = consecutive failures),
  capped at ``backoff_max_s``, each delay scaled by a random factor in ``[1 - jitter, 1 + jitter]``
  (so volunteers of a restarted relay do not all come back in the same instant).
- A failed *refresh* keeps the address advertised while the old reservation is still valid; the
  retry is never scheduled past its expiry, and at expiry the address is withdrawn.
- A lost connection means the relay forgot the reservation (it is tied to the connection, and a
  restarted relay has none): the address is withdrawn at once and the volunteer re-reserves with
  backoff. The first retry after a loss comes after ``backoff_base_s``.
- ``Stop`` withdraws the address and ends the machine; every later event is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "Advertise",
    "ConnectionLost",
    "Effect",
    "Event",
    "ReservationClient",
    "ReservationPolicy",
    "ReservationState",
    "ReserveFailed",
    "ReserveSucceeded",
    "SendReserve",
    "SetTimer",
    "Start",
    "Stop",
    "TimerFired",
    "Withdraw",
]


class Rng(Protocol):
    def uniform(self, a: float, b: float) -> float: ...


@dataclass(frozen=True)
class ReservationPolicy:
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    jitter: float = 0.2
    refresh_fraction: float = 0.5
    min_refresh_s: float = 1.0

    def __post_init__(self) -> None:
        if not (0 < self.backoff_base_s <= self.backoff_max_s and 0 <= self.jitter < 1
                and 0 < self.refresh_fraction < 1 and self.min_refresh_s > 0):
            raise ValueError(f"bad reservation policy {self}")


class ReservationState(StrEnum):
    IDLE = "idle"
    RESERVING = "reserving"
    RESERVED = "reserved"
    BACKOFF = "backoff"
    STOPPED = "stopped"


# -- events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class ReserveSucceeded:
    expires_at: float
    addrs: tuple[str, ...]  # this volunteer's /p2p-circuit addresses through the relay


@dataclass(frozen=True)
class ReserveFailed:
    reason: str


@dataclass(frozen=True)
class ConnectionLost:
    pass


@dataclass(frozen=True)
class TimerFired:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Event = Start | ReserveSucceeded | ReserveFailed | ConnectionLost | TimerFired | Stop


# -- effects -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SendReserve:
    refresh: bool  # True if a reservation is held and being extended


@dataclass(frozen=True)
class SetTimer:
    at: float


@dataclass(frozen=True)
class Advertise:
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class Withdraw:
    reason: str


Effect = SendReserve | SetTimer | Advertise | Withdraw


class ReservationClient:
    def __init__(self, policy: ReservationPolicy, rng: Rng) -> None:
        self.policy = policy
        self._rng = rng
        self.state = ReservationState.IDLE
        self.failures = 0  # consecutive
        self.expires_at: float | None = None  # of the reservation we hold, if any
        self.advertised: tuple[str, ...] = ()
        self.last_error = ""
        self.reservations = 0  # granted (first grants and refreshes)

    def backoff(self, failures: int) -> float:
        """The nominal delay after ``failures`` consecutive failures (before jitter)."""
        p = self.policy
        return float(min(p.backoff_max_s, p.backoff_base_s * 2 ** max(0, failures - 1)))

    def handle(self, event: Event, now: float) -> list[Effect]:
        if self.state is ReservationState.STOPPED:
            return []
        match event:
            case Start():
                if self.state is not ReservationState.IDLE:
                    return []
                return self._reserve()
            case ReserveSucceeded(expires_at=expires_at, addrs=addrs):
                if self.state is not ReservationState.RESERVING:
                    return []
                return self._granted(expires_at, addrs, now)
            case ReserveFailed(reason=reason):
                if self.state is not ReservationState.RESERVING:
                    return []
                return self._failed(reason, now)
            case ConnectionLost():
                if self.state is ReservationState.IDLE:
                    return []
                return self._lost(now)
            case TimerFired():
                if self.state not in (ReservationState.RESERVED, ReservationState.BACKOFF):
                    return []
                effects: list[Effect] = []
                if self.expires_at is not None and now >= self.expires_at:
                    effects += self._drop("reservation expired")
                return effects + self._reserve()
            case Stop():
                effects = self._drop("stopped")
                self.state = ReservationState.STOPPED
                return effects
        return []  # pragma: no cover - the match above is exhaustive

    # -- transitions ---------------------------------------------------------------------------------
    def _reserve(self) -> list[Effect]:
        refresh = self.expires_at is not None
        self.state = ReservationState.RESERVING
        return [SendReserve(refresh=refresh)]

    def _granted(self, expires_at: float, addrs: tuple[str, ...], now: float) -> list[Effect]:
        self.state = ReservationState.RESERVED
        self.failures = 0
        self.expires_at = expires_at
        self.reservations += 1
        effects: list[Effect] = []
        if addrs != self.advertised:
            self.advertised = addrs
            effects.append(Advertise(addrs))
        remaining = max(0.0, expires_at - now)
        effects.append(SetTimer(now + max(self.policy.min_refresh_s, remaining * self.policy.refresh_fraction)))
        return effects

    def _failed(self, reason: str, now: float) -> list[Effect]:
        self.failures += 1
        self.last_error = reason
        self.state = ReservationState.BACKOFF
        effects: list[Effect] = []
        at = now + self._jittered(self.backoff(self.failures))
        if self.expires_at is not None:
            if now >= self.expires_at:
                effects += self._drop("reservation expired")
            else:
                at = min(at, self.expires_at)  # never past the expiry of the reservation we still hold
        effects.append(SetTimer(at))
        return effects

    def _lost(self, now: float) -> list[Effect]:
        effects = self._drop("connection to the relay lost")
        self.failures += 1
        self.last_error = "connection to the relay lost"
        self.state = ReservationState.BACKOFF
        # the first retry after a loss comes after the base delay; repeated losses back off
        effects.append(SetTimer(now + self._jittered(self.backoff(self.failures))))
        return effects

    def _drop(self, reason: str) -> list[Effect]:
        self.expires_at = None
        if not self.advertised:
            return []
        self.advertised = ()
        return [Withdraw(reason)]

    def _jittered(self, delay: float) -> float:
        j = self.policy.jitter
        return delay * self._rng.uniform(1 - j, 1 + j) if j else delay
