"""The volunteer's pull lifecycle (pure core: events in, effects out; ``now`` and RNG injected).

    idle --poll--> offered --fetched--> serving --(drain)--> draining --(release)--> idle
      ^               |                    |                                          |
      +-- nothing ----+-- fetch failed ----+------------- release / lease lapsed -----+

Rules:
- Polls are jittered (``±jitter`` of the interval) so volunteers started together spread out;
  "nothing needed" waits the market's ``retry_after_s``; a failed poll backs off exponentially.
- One slice at a time; ``fetched``/``fetch_failed`` name the offer they finish, and one for an
  offer that is no longer the one being fetched is ignored. While fetching, heartbeats report it ``loading`` so the market converts
  the lease; once loaded it is ``serving``. A lease that lapses before any heartbeat was
  acknowledged means the market has forgotten the offer: the slice is dropped and polling resumes.
- Directives from each heartbeat answer: ``keep`` carries on; ``drain`` keeps serving calls in
  flight but the slice is no longer dispatched (reported ``serving`` still, the market decides);
  ``release`` drops it and polling resumes.
- Heartbeats go out every ``heartbeat_s`` (the market's value once known); ``sequence`` strictly
  grows within the ``epoch``; a failed heartbeat (market outage) changes nothing: keep serving,
  try again next period.
- Shutdown: report the slice ``draining``, wait for in-flight calls (the shell), then send an
  empty heartbeat (deregister).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

__all__ = [
    "Deregister",
    "Fetch",
    "Held",
    "Lifecycle",
    "Offer",
    "Phase",
    "Poll",
    "SendHeartbeat",
    "Unload",
]


class Phase(StrEnum):
    IDLE = "idle"  # polling the market
    FETCHING = "fetching"  # downloading / loading the offered slice
    SERVING = "serving"
    STOPPING = "stopping"


@dataclass(frozen=True)
class Offer:
    model_id: str
    layer: int
    lo: int
    hi: int
    url: str
    sha256: str
    size: int
    lease_expires_in_s: float
    heartbeat_s: float
    relays: tuple[str, ...] = ()


@dataclass
class Held:
    offer: Offer
    state: str = "loading"  # loading | serving | draining
    dispatched: bool = False
    acked: bool = False  # the market has acknowledged a heartbeat listing it
    lease_deadline: float = 0.0
    release_in_s: float | None = None


# -- effects ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Poll:
    at: float


@dataclass(frozen=True)
class Fetch:
    offer: Offer


@dataclass(frozen=True)
class Unload:
    offer: Offer
    reason: str


@dataclass(frozen=True)
class SendHeartbeat:
    sequence: int


@dataclass(frozen=True)
class Deregister:
    sequence: int


Effect = Poll | Fetch | Unload | SendHeartbeat | Deregister


class Rng(Protocol):
    """What the core needs of an injected ``random.Random``."""

    def random(self) -> float: ...


@dataclass
class Lifecycle:
    rng: Rng
    poll_interval_s: float = 2.0
    jitter: float = 0.3
    heartbeat_s: float = 2.0
    max_backoff_s: float = 30.0
    phase: Phase = Phase.IDLE
    held: Held | None = None
    sequence: int = 0
    next_poll: float | None = None
    next_heartbeat: float | None = None
    poll_failures: int = 0
    log: list[str] = field(default_factory=list)

    def _jittered(self, s: float) -> float:
        return s * (1.0 + self.jitter * (2.0 * self.rng.random() - 1.0))

    def _poll_after(self, now: float, s: float) -> list[Effect]:
        self.next_poll = now + self._jittered(s)
        return [Poll(self.next_poll)]

    def start(self, now: float) -> list[Effect]:
        # a first poll within one interval, spread out
        self.next_poll = now + self.rng.random() * self.poll_interval_s * self.jitter
        return [Poll(self.next_poll)]

    # -- market answers -----------------------------------------------------------------------------
    def offered(self, offer: Offer, now: float) -> list[Effect]:
        if self.phase is not Phase.IDLE:
            return []
        self.poll_failures = 0
        self.phase = Phase.FETCHING
        self.held = Held(offer, lease_deadline=now + offer.lease_expires_in_s)
        self.heartbeat_s = offer.heartbeat_s
        self.next_poll = None
        self.next_heartbeat = now  # report "loading" at once: converts the lease
        return [Fetch(offer), *self._heartbeat()]

    def nothing_needed(self, retry_after_s: float, now: float) -> list[Effect]:
        if self.phase is not Phase.IDLE:
            return []
        self.poll_failures = 0
        return self._poll_after(now, max(0.1, retry_after_s))

    def poll_failed(self, now: float) -> list[Effect]:
        if self.phase is not Phase.IDLE:
            return []
        self.poll_failures += 1
        return self._poll_after(now, min(self.max_backoff_s, self.poll_interval_s * 2 ** (self.poll_failures - 1)))

    # -- fetching -------------------------------------------------------------------------------------
    def _fetching(self, offer: Offer) -> bool:
        return self.phase is Phase.FETCHING and self.held is not None and self.held.offer == offer

    def fetched(self, offer: Offer, now: float) -> list[Effect]:
        """``offer``'s slice is loaded. A fetch that finishes after its offer was dropped (released,
        lease lapsed, another offer taken since) changes nothing: the shell must not load it."""
        if not self._fetching(offer):
            return []
        assert self.held is not None
        self.phase = Phase.SERVING
        self.held.state = "serving"
        self.next_heartbeat = now
        return self._heartbeat()

    def fetch_failed(self, offer: Offer, reason: str, now: float) -> list[Effect]:
        if not self._fetching(offer):
            return []
        self.log.append(f"fetch failed: {reason}")
        return self._drop("fetch_failed", now)

    def _drop(self, reason: str, now: float) -> list[Effect]:
        assert self.held is not None
        offer = self.held.offer
        self.held = None
        self.phase = Phase.IDLE
        self.next_heartbeat = now  # tell the market at once (an empty holding)
        return [Unload(offer, reason), *self._heartbeat(), *self._poll_after(now, self.poll_interval_s)]

    # -- heartbeats -----------------------------------------------------------------------------------
    def _heartbeat(self) -> list[Effect]:
        self.sequence += 1
        return [SendHeartbeat(self.sequence)]

    def heartbeat_acked(self, directives: Sequence[tuple[str, int, int, int, str, bool, float | None]], heartbeat_s: float,
                        sequence: int, now: float) -> list[Effect]:
        """``directives``: (model_id, layer, lo, hi, action, dispatched, release_in_s) per listed slice."""
        self.heartbeat_s = heartbeat_s
        h = self.held
        if h is None or self.phase is Phase.STOPPING:
            return []
        o = h.offer
        for model_id, layer, lo, hi, action, dispatched, release_in_s in directives:
            if (model_id, layer, lo, hi) != (o.model_id, o.layer, o.lo, o.hi):
                continue
            h.acked = True
            h.dispatched = dispatched
            if action == "release":
                return self._drop("released_by_market", now)
            if action == "drain":
                h.release_in_s = release_in_s
                if h.state == "serving":
                    h.state = "draining"
            elif action == "keep" and h.state == "draining":
                h.state = "serving"
                h.release_in_s = None
        return []

    def heartbeat_failed(self, now: float) -> list[Effect]:
        return []  # market outage: keep serving; the next period tries again

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        h = self.held
        if h is not None and not h.acked and now >= h.lease_deadline and self.phase is not Phase.STOPPING:
            return self._drop("lease_lapsed", now)
        if self.phase is not Phase.STOPPING and self.next_heartbeat is not None and now >= self.next_heartbeat and h is not None:
            self.next_heartbeat = now + self.heartbeat_s
            out += self._heartbeat()
        return out

    def reported_state(self) -> str | None:
        """The state to report for the held slice (``draining`` is reported while stopping)."""
        if self.held is None:
            return None
        if self.phase is Phase.STOPPING:
            return "draining"
        # a slice the market asked to drain is still answered; the market tracks that itself
        return "loading" if self.held.state == "loading" else "serving"

    # -- shutdown -------------------------------------------------------------------------------------
    def stop(self, now: float) -> list[Effect]:
        self.phase = Phase.STOPPING
        self.next_poll = None
        return self._heartbeat() if self.held is not None else []

    def drained(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if self.held is not None:
            out.append(Unload(self.held.offer, "shutdown"))
            self.held = None
        self.sequence += 1
        return [*out, Deregister(self.sequence)]
