"""The volunteer's pull lifecycle (pure core: events in, effects out; ``now`` and RNG injected).

    idle --poll--> fetching --fetched--> serving --(drain)--> draining --(release)--> (dropped)
      ^               |                    |  \\--poll (room left)--> fetching another slice ...
      +-- nothing ----+-- fetch failed ----+------------- release / lease lapsed ---+

Rules:
- A volunteer holds up to ``max_slices`` slices whose sizes add up to at most ``max_bytes`` and
  whose experts number at most ``max_experts`` (either budget may be absent); it fetches one at a
  time. While it has room (fewer than ``max_slices``, something left of each budget it has) and no
  download runs, it polls the market for another slice, offering what it has left
  (``budget_left``, ``experts_left``). Without either budget it holds one slice.
- Polls are jittered (``±jitter`` of the interval) so volunteers started together spread out;
  "nothing needed" waits the market's ``retry_after_s``; a failed poll backs off exponentially. A
  ``budget_too_small`` answer while holding slices means "full": no more polls until a slice is
  dropped.
- ``fetched``/``fetch_failed`` name the offer they finish; one for an offer that is no longer being
  fetched is ignored. While fetching, heartbeats report the slice ``loading`` so the market converts
  the lease; once loaded it is ``serving``. A slice whose lease lapses before any heartbeat listing
  it was acknowledged has been forgotten by the market: it is dropped and polling resumes.
- Directives from each heartbeat answer, per slice: ``keep`` carries on; ``drain`` keeps serving
  calls in flight but the slice is no longer dispatched (reported ``serving`` still, the market
  decides); ``release`` drops that slice and polling resumes.
- Heartbeats go out every ``heartbeat_s`` (the market's value once known) while something is held;
  ``sequence`` strictly grows within the ``epoch``; a failed heartbeat (market outage) changes
  nothing: keep serving, try again next period.
- A stuck request budget (``volunteer.core.health``: requests refused while nothing comes back)
  is reported, not hidden: while ``stuck``, every loaded slice is reported ``draining`` (the market
  stops dispatching it and recruits in its place); the heartbeat goes out at once when that changes,
  and the slices are ``serving`` again once the budget moves.
- Paused (``paused``: the owner's preferences, ``volunteer.core.preferences``): every loaded slice is
  reported ``draining`` (not counted, not dispatched, kept), no polls, and heartbeats go on -- even
  holding nothing -- so the market knows it is paused, not gone (the shell puts the reason on the
  wire). A change is reported at once; on resuming the slices are ``serving`` again and polling
  resumes after that heartbeat.
- Shutdown: report every slice ``draining``, wait for in-flight calls (the shell), then send an
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
    "SliceKey",
    "Unload",
]

SliceKey = tuple[str, int, int, int]  # (model_id, layer, lo, hi)


class Phase(StrEnum):
    IDLE = "idle"  # holding nothing: polling the market
    FETCHING = "fetching"  # downloading / loading an offered slice
    SERVING = "serving"  # holding slices (and polling for more while there is room)
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
    lease_id: str = ""

    @property
    def key(self) -> SliceKey:
        return (self.model_id, self.layer, self.lo, self.hi)


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
    max_bytes: int | None = None  # the slice budget in bytes
    max_experts: int | None = None  # ... and in experts
    max_slices: int = 1
    holdings: dict[SliceKey, Held] = field(default_factory=dict)  # in the order they were offered
    fetching: SliceKey | None = None
    stopping: bool = False
    full: bool = False  # the market said nothing more fits: no polls until a slice is dropped
    sequence: int = 0
    next_poll: float | None = None
    next_heartbeat: float | None = None
    poll_failures: int = 0
    stuck: bool = False  # the request budget refuses while nothing comes back (``budget_stuck``)
    paused: bool = False  # the owner's preferences say not now (``set_paused``)
    log: list[str] = field(default_factory=list)

    # -- views --------------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        if self.stopping:
            return Phase.STOPPING
        if self.fetching is not None:
            return Phase.FETCHING
        return Phase.SERVING if self.holdings else Phase.IDLE

    @property
    def held_bytes(self) -> int:
        return sum(h.offer.size for h in self.holdings.values())

    def budget_left(self) -> int | None:
        """The bytes a new slice may take (None: no byte budget)."""
        return None if self.max_bytes is None else max(0, self.max_bytes - self.held_bytes)

    def experts_left(self) -> int | None:
        """The experts a new slice may have (None: no budget in experts)."""
        if self.max_experts is None:
            return None
        return max(0, self.max_experts - sum(h.offer.hi - h.offer.lo for h in self.holdings.values()))

    def has_room(self) -> bool:
        """May we take another slice now?"""
        if self.stopping or self.paused or self.fetching is not None or self.full or len(self.holdings) >= self.max_slices:
            return False
        if self.max_bytes is None and self.max_experts is None:
            return not self.holdings
        return all(left is None or left > 0 for left in (self.budget_left(), self.experts_left()))

    def reported(self) -> list[tuple[Held, str]]:
        """Each held slice with the state to report (every one ``draining`` while stopping; a slice
        the market asked to drain is still answered and reported ``serving``: the market tracks that)."""
        out = []
        for h in self.holdings.values():
            if h.state == "loading":
                state = "draining" if self.stopping else "loading"
            else:
                state = "draining" if self.stopping or self.stuck or self.paused else "serving"
            out.append((h, state))
        return out

    def budget_stuck(self, stuck: bool, now: float) -> list[Effect]:
        """The request budget's verdict (``volunteer.core.health.BudgetWatch``); a change is reported at once."""
        if stuck == self.stuck or self.stopping:
            return []
        self.stuck = stuck
        self.log.append("request budget stuck: reporting draining" if stuck else "request budget moves again")
        if not self.holdings:
            return []
        self.next_heartbeat = now + self.heartbeat_s
        return self._heartbeat()

    def set_paused(self, paused: bool, now: float) -> list[Effect]:
        """The owner's preferences changed the verdict: report it at once; polling resumes after that."""
        if paused == self.paused or self.stopping:
            return []
        self.paused = paused
        self.log.append("paused" if paused else "resumed")
        self.next_heartbeat = now + self.heartbeat_s
        out = self._heartbeat()
        if not paused:
            out += self._poll_after(now, self.poll_interval_s * self.jitter)
        return out

    # -- polling ------------------------------------------------------------------------------------
    def _jittered(self, s: float) -> float:
        return s * (1.0 + self.jitter * (2.0 * self.rng.random() - 1.0))

    def _poll_after(self, now: float, s: float) -> list[Effect]:
        if not self.has_room():
            self.next_poll = None
            return []
        self.next_poll = now + self._jittered(s)
        return [Poll(self.next_poll)]

    def start(self, now: float) -> list[Effect]:
        # a first poll within one interval, spread out
        self.next_poll = now + self.rng.random() * self.poll_interval_s * self.jitter
        return [Poll(self.next_poll)]

    def wants_poll(self, at: float) -> bool:
        """Is the poll scheduled for ``at`` still due (not superseded, and room for a slice)?"""
        return self.next_poll == at and self.has_room()

    # -- market answers -----------------------------------------------------------------------------
    def offered(self, offer: Offer, now: float) -> list[Effect]:
        if not self.has_room() or offer.key in self.holdings:
            return []
        self.poll_failures = 0
        self.fetching = offer.key
        self.holdings[offer.key] = Held(offer, lease_deadline=now + offer.lease_expires_in_s)
        self.heartbeat_s = offer.heartbeat_s
        self.next_poll = None
        self.next_heartbeat = now  # report "loading" at once: converts the lease
        return [Fetch(offer), *self._heartbeat()]

    def nothing_needed(self, retry_after_s: float, now: float, reason: str = "") -> list[Effect]:
        if not self.has_room():
            return []
        self.poll_failures = 0
        if reason == "budget_too_small" and self.holdings:
            self.full = True  # what is left of the budget fits nothing the market needs
            self.next_poll = None
            return []
        return self._poll_after(now, max(0.1, retry_after_s))

    def poll_failed(self, now: float) -> list[Effect]:
        if not self.has_room():
            return []
        self.poll_failures += 1
        return self._poll_after(now, min(self.max_backoff_s, self.poll_interval_s * 2 ** (self.poll_failures - 1)))

    # -- fetching -------------------------------------------------------------------------------------
    def _fetching(self, offer: Offer) -> bool:
        h = self.holdings.get(offer.key)
        return not self.stopping and self.fetching == offer.key and h is not None and h.offer == offer

    def fetched(self, offer: Offer, now: float) -> list[Effect]:
        """``offer``'s slice is loaded. A fetch that finishes after its offer was dropped (released,
        lease lapsed) changes nothing: the shell must not load it."""
        if not self._fetching(offer):
            return []
        self.fetching = None
        self.holdings[offer.key].state = "serving"
        self.next_heartbeat = now
        return [*self._heartbeat(), *self._poll_after(now, self.poll_interval_s)]

    def fetch_failed(self, offer: Offer, reason: str, now: float) -> list[Effect]:
        if not self._fetching(offer):
            return []
        self.log.append(f"fetch failed: {reason}")
        return self._drop(offer.key, "fetch_failed", now)

    def _drop(self, key: SliceKey, reason: str, now: float) -> list[Effect]:
        h = self.holdings.pop(key)
        if self.fetching == key:
            self.fetching = None
        self.full = False
        self.next_heartbeat = now  # tell the market at once
        return [Unload(h.offer, reason), *self._heartbeat(), *self._poll_after(now, self.poll_interval_s)]

    # -- heartbeats -----------------------------------------------------------------------------------
    def _heartbeat(self) -> list[Effect]:
        self.sequence += 1
        return [SendHeartbeat(self.sequence)]

    def heartbeat_acked(self, directives: Sequence[tuple[str, int, int, int, str, bool, float | None]], heartbeat_s: float,
                        sequence: int, now: float) -> list[Effect]:
        """``directives``: (model_id, layer, lo, hi, action, dispatched, release_in_s) per listed slice."""
        self.heartbeat_s = heartbeat_s
        if self.stopping:
            return []
        out: list[Effect] = []
        for model_id, layer, lo, hi, action, dispatched, release_in_s in directives:
            key = (model_id, layer, lo, hi)
            h = self.holdings.get(key)
            if h is None:
                continue
            h.acked = True
            h.dispatched = dispatched
            if action == "release":
                out += self._drop(key, "released_by_market", now)
            elif action == "drain":
                h.release_in_s = release_in_s
                if h.state == "serving":
                    h.state = "draining"
            elif action == "keep" and h.state == "draining":
                h.state = "serving"
                h.release_in_s = None
        return _one_poll(out)

    def heartbeat_failed(self, now: float) -> list[Effect]:
        return []  # market outage: keep serving; the next period tries again

    def tick(self, now: float) -> list[Effect]:
        if self.stopping:
            return []
        out: list[Effect] = []
        for key, h in list(self.holdings.items()):
            if not h.acked and now >= h.lease_deadline:
                out += self._drop(key, "lease_lapsed", now)
        if (self.holdings or self.paused) and self.next_heartbeat is not None and now >= self.next_heartbeat:
            self.next_heartbeat = now + self.heartbeat_s
            if not any(isinstance(e, SendHeartbeat) for e in out):
                out += self._heartbeat()
        return _one_poll(out)

    # -- shutdown -------------------------------------------------------------------------------------
    def stop(self, now: float) -> list[Effect]:
        self.stopping = True
        self.next_poll = None
        return self._heartbeat() if self.holdings else []

    def drained(self, now: float) -> list[Effect]:
        out: list[Effect] = [Unload(h.offer, "shutdown") for h in self.holdings.values()]
        self.holdings.clear()
        self.fetching = None
        self.sequence += 1
        return [*out, Deregister(self.sequence)]


def _one_poll(effects: list[Effect]) -> list[Effect]:
    """Several drops in one event send one heartbeat and schedule one poll: the last of each (the
    heartbeat with the newest sequence; the poll at the core's ``next_poll``)."""
    beats = [e for e in effects if isinstance(e, SendHeartbeat)]
    polls = [e for e in effects if isinstance(e, Poll)]
    if len(beats) <= 1 and len(polls) <= 1:
        return effects
    rest = [e for e in effects if not isinstance(e, SendHeartbeat | Poll)]
    return rest + beats[-1:] + polls[-1:]
