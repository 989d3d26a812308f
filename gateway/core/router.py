"""The gateway's router: which coordinator answers a request, and what happens when one fails (pure core:
no clock, I/O or trio; ``handle(event, now) -> list[Effect]``, the shell does the I/O and the timers).

Rules:
- **Candidates** for a request are the coordinators the market lists for its model (``Listed``) that are
  not down (``down_until``), not refusing (a 429/503 with ``Retry-After``), not already tried for this
  request, and not refusing by their own fresh ``/capacity`` under ``enforced`` admission. None: the request
  is answered 503 ``no_coordinator`` naming the model (429 ``all_refused`` with the smallest
  ``Retry-After`` when every candidate refused or reported it cannot admit).
- **Score** = predicted time to first token (seconds, the lowest wins, ties by URL):
  ``max(queue_delay, load) + uncached_prompt_tokens * prefill_s_per_token + decode_s_per_token`` where
  ``sessions = max(polled active + queued, this gateway's attempts in flight there)``,
  ``queue_delay = max(0, sessions + 1 - slots) / slots * request_s`` plus ``settle_remaining_s`` where the
  coordinator enforces admission (only then does it hold a new request while it settles),
  ``load = min(sessions, slots) * decode_s_per_token`` (a new prompt shares the batched step with the
  running sessions). ``uncached = n_prompt - cached``, ``cached`` = the longest prefix of the prompt whose
  chain hash (``swarm.core.prefix_hash``, salted with the coordinator's ``hash_salt``) the coordinator
  advertises, at most ``n_prompt - 1`` (the last token is always computed). ``prefill_s_per_token`` is
  measured (EWMA of first-token times of prompts with >= 16 uncached tokens, the predicted wait taken
  off), ``decode_s_per_token`` is ``1 / mean_active_tps`` when polled, ``request_s`` the EWMA of whole
  requests there; priors from ``RouterPolicy`` until measured.
- **Stale state**: a poll older than ``stale_after_s`` is not trusted: its ``/capacity`` answer is ignored
  (neither a refusal nor a headroom counts) and the score gets ``stale_penalty_s``; a coordinator never
  polled scores as idle plus that penalty. ``down_after_fails`` failed polls in a row mark it unreachable
  (a partition) until a poll succeeds. A coordinator whose attempt failed or timed out is left out for
  ``backoff_s`` whatever its polls say (one that answers polls but not requests must not flap).
- **Offers and fencing**: every attempt is ``(rid, attempt)`` with ``attempt`` growing per request; an
  event for another attempt than the request's current one, or for a finished request, changes nothing,
  except that a late first token of an old attempt is aborted (it can never complete a newer one).
  ``Send`` carries the attempt's deadline (``offer_timeout_s + ttft_slack * predicted``; a non-streamed
  request also waits for its tokens: ``+ ttft_slack * max_tokens * decode_s_per_token``); the shell reports
  ``Timeout`` at it. A timeout when no other candidate could take the request keeps the attempt (``Rearm``
  with a deadline ``offer_timeout_s`` later): a busy but working coordinator is better than a 503.
- **Before the first token** (nothing sent to the client yet) a failure, timeout or refusal moves the
  request to the next candidate, transparently (``Send`` with the next attempt); a failed or timed-out
  coordinator is down for ``backoff_s``. The first token ``Commit``s the attempt: from then on the shell
  passes its bytes through unchanged.
- **After the first token** a failure ends the stream with an error event (``EndStream``), never a silent
  truncation; the coordinator is down for ``backoff_s``.
- ``ClientGone`` aborts the current attempt (the coordinator frees the slot) and forgets the request.
- Same events, same ``now``s -> same effects (no randomness, sorted iteration): a recorded event log
  replays to the same decisions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from swarm.core.prefix_hash import prefix_hashes

__all__ = [
    "Abort", "Answer", "Arrive", "AttemptFailed", "Capacity", "ClientGone", "Commit", "Effect", "EndStream", "Event",
    "Finished", "FirstToken", "Listed", "Load", "PollFailed", "Polled", "Rearm", "Refused", "Router", "RouterPolicy",
    "Send",
    "Timeout",
]


@dataclass(frozen=True)
class RouterPolicy:
    offer_timeout_s: float = 10.0
    ttft_slack: float = 4.0
    stale_after_s: float = 5.0
    stale_penalty_s: float = 1.0
    down_after_fails: int = 2
    backoff_s: float = 5.0
    prefill_prior_s: float = 0.002  # seconds per uncached prompt token, until measured
    decode_prior_s: float = 0.05  # seconds per decode token, until polled
    request_prior_s: float = 2.0  # seconds per whole request, until measured
    advisory_penalty_s: float = 2.0  # a coordinator that says it cannot admit, under advisory admission
    ewma: float = 0.3
    min_prefill_sample: int = 16


@dataclass(frozen=True)
class Capacity:
    """A coordinator's ``GET /capacity`` (the fields the router uses)."""

    can_admit: bool
    admission: Literal["advisory", "enforced"] = "advisory"
    settle_remaining_s: float = 0.0
    headroom_sessions: int = 0


@dataclass(frozen=True)
class Load:
    """One poll of a coordinator: its load (``/capacity`` or ``/slots``) and its advertised prefixes."""

    slots: int
    active: int
    queue: int = 0
    mean_active_tps: float = 0.0
    capacity: Capacity | None = None
    salt: bytes = b""
    kept: frozenset[bytes] = frozenset()


# events -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Listed:
    """The market's coordinators of ``model`` (replaces the previous list)."""

    model: str
    urls: tuple[str, ...]


@dataclass(frozen=True)
class Polled:
    url: str
    load: Load


@dataclass(frozen=True)
class PollFailed:
    url: str
    reason: str


@dataclass(frozen=True)
class Arrive:
    rid: int
    model: str
    n_prompt: int
    tokens: tuple[int, ...] | None = None  # None: not tokenised here (no prefix locality)
    max_tokens: int = 16
    stream: bool = True


@dataclass(frozen=True)
class FirstToken:
    """The attempt's first token (streamed), its whole answer (not streamed), or a final 4xx answer."""

    rid: int
    attempt: int


@dataclass(frozen=True)
class Finished:
    rid: int
    attempt: int


@dataclass(frozen=True)
class AttemptFailed:
    rid: int
    attempt: int
    reason: str


@dataclass(frozen=True)
class Refused:
    """429 (admission) or 503 (queue full) with ``Retry-After``."""

    rid: int
    attempt: int
    status: int
    retry_after_s: float


@dataclass(frozen=True)
class Timeout:
    rid: int
    attempt: int


@dataclass(frozen=True)
class ClientGone:
    rid: int


Event = Listed | Polled | PollFailed | Arrive | FirstToken | Finished | AttemptFailed | Refused | Timeout | ClientGone


# effects ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Send:
    rid: int
    attempt: int
    url: str
    deadline: float
    predicted_ttft_s: float
    cached_tokens: int
    scores: tuple[tuple[str, float], ...]  # every candidate's score, best first (for logs and tests)


@dataclass(frozen=True)
class Abort:
    rid: int
    attempt: int
    url: str
    reason: str


@dataclass(frozen=True)
class Rearm:
    """The attempt timed out but no other coordinator could take it: keep waiting until ``deadline``."""

    rid: int
    attempt: int
    deadline: float


@dataclass(frozen=True)
class Commit:
    rid: int
    attempt: int


@dataclass(frozen=True)
class Answer:
    """An error answer to the client (nothing was sent to it yet)."""

    rid: int
    status: int
    code: str
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True)
class EndStream:
    """The committed stream failed: end it with an SSE error event."""

    rid: int
    attempt: int
    code: str
    message: str


Effect = Send | Abort | Rearm | Commit | Answer | EndStream


class Phase(Enum):
    OFFERED = "offered"
    COMMITTED = "committed"


@dataclass
class _Coord:
    url: str
    load: Load | None = None
    polled_at: float | None = None
    poll_fails: int = 0
    down_until: float = float("-inf")  # an attempt failed or timed out there: left out until then
    unreachable: bool = False  # its last ``down_after_fails`` polls failed (a partition): left out until one answers
    refusing_until: float = float("-inf")
    inflight: int = 0
    prefill_s: float | None = None
    request_s: float | None = None


@dataclass
class _Req:
    arrive: Arrive
    attempt: int = 0
    url: str = ""
    phase: Phase = Phase.OFFERED
    sent_at: float = 0.0
    wait_s: float = 0.0  # predicted wait (queue/load) of the current attempt
    uncached: int = 0
    tried: set[str] = field(default_factory=set)
    refusals: list[float] = field(default_factory=list)  # retry-after seconds of candidates that refused


@dataclass
class Counters:
    routed: int = 0
    failovers: int = 0
    refused: int = 0
    timeouts: int = 0
    rearmed: int = 0
    stream_errors: int = 0
    no_coordinator: int = 0
    cancelled: int = 0
    completed: int = 0
    cached_tokens: int = 0


class Router:
    def __init__(self, policy: RouterPolicy = RouterPolicy()) -> None:
        self.policy = policy
        self.hosts: dict[str, tuple[str, ...]] = {}  # model -> coordinator urls
        self.coords: dict[str, _Coord] = {}
        self.reqs: dict[int, _Req] = {}
        self.counters = Counters()

    # queries ------------------------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(m for m, urls in self.hosts.items() if urls)

    def coordinators(self) -> list[str]:
        return sorted(self.coords)

    def salts(self) -> set[bytes]:
        return {c.load.salt for c in self.coords.values() if c.load is not None and c.load.salt}

    def inflight(self, url: str) -> int:
        c = self.coords.get(url)
        return c.inflight if c is not None else 0

    def is_down(self, url: str, now: float) -> bool:
        c = self.coords.get(url)
        return c is not None and (c.down_until > now or c.unreachable)

    def cached_tokens(self, url: str, tokens: Iterable[int] | None, n_prompt: int) -> int:
        """The longest advertised prefix of ``tokens`` at ``url`` (at most ``n_prompt - 1``)."""
        c = self.coords.get(url)
        if tokens is None or c is None or c.load is None or not c.load.kept or n_prompt < 2:
            return 0
        hashes = prefix_hashes(list(tokens), c.load.salt, limit=n_prompt - 1)
        for i in range(len(hashes) - 1, 0, -1):
            if hashes[i] in c.load.kept:
                return i
        return 0

    # the machine --------------------------------------------------------------------------------------

    def handle(self, ev: Event, now: float) -> list[Effect]:
        match ev:
            case Listed(model, urls):
                self.hosts[model] = tuple(sorted(set(urls)))
                for u in self.hosts[model]:
                    self.coords.setdefault(u, _Coord(u))
                listed = {u for us in self.hosts.values() for u in us}
                busy = {r.url for r in self.reqs.values() if r.url}
                for u in list(self.coords):
                    if u not in listed and u not in busy:
                        del self.coords[u]
                return []
            case Polled(url, load):
                c = self.coords.get(url)
                if c is not None:
                    c.load, c.polled_at, c.poll_fails, c.unreachable = load, now, 0, False
                return []
            case PollFailed(url, _):
                c = self.coords.get(url)
                if c is not None:
                    c.poll_fails += 1
                    if c.poll_fails >= self.policy.down_after_fails:
                        c.unreachable = True
                return []
            case Arrive():
                if ev.rid in self.reqs:
                    return []
                new = _Req(ev)
                self.reqs[ev.rid] = new
                return self._route(new, now)
            case ClientGone(rid):
                gone = self.reqs.pop(rid, None)
                if gone is None:
                    return []
                self.counters.cancelled += 1
                if not gone.url:
                    return []
                self._release(gone.url)
                return [Abort(rid, gone.attempt, gone.url, "client_gone")]
        r = self.reqs.get(ev.rid)
        if r is None or ev.attempt != r.attempt or not r.url:
            if isinstance(ev, FirstToken):
                return [Abort(ev.rid, ev.attempt, "", "stale_attempt")]
            return []
        match ev:
            case FirstToken():
                if r.phase is Phase.COMMITTED:
                    return []
                r.phase = Phase.COMMITTED
                self._learn_prefill(r, now)
                return [Commit(r.arrive.rid, r.attempt)]
            case Finished():
                self.reqs.pop(r.arrive.rid)
                c = self.coords.get(r.url)
                if c is not None:
                    c.request_s = _ewma(c.request_s, now - r.sent_at, self.policy.ewma)
                self._release(r.url)
                self.counters.completed += 1
                return []
            case AttemptFailed(_, _, reason):
                return self._fail(r, now, "coordinator_failed", reason, abort=False)
            case Timeout():
                if r.phase is Phase.COMMITTED:
                    return []  # the deadline is for the first token only
                if not any(u not in r.tried and self.score(u, r.arrive, now) is not None
                           for u in self.hosts.get(r.arrive.model, ())):
                    self.counters.rearmed += 1  # nobody else to ask: waiting beats a 503
                    return [Rearm(r.arrive.rid, r.attempt, now + self.policy.offer_timeout_s)]
                self.counters.timeouts += 1
                return self._fail(r, now, "timeout", f"no first token from {r.url} by its deadline", abort=True)
            case Refused(_, _, status, retry_after_s):
                url = r.url
                self._release(url)
                self.counters.refused += 1
                c = self.coords.get(url)
                if c is not None:
                    c.refusing_until = max(c.refusing_until, now + retry_after_s)
                r.refusals.append(retry_after_s)
                r.url = ""
                if r.phase is Phase.COMMITTED:  # cannot happen through the shell: a refusal is an answer's status
                    self.reqs.pop(r.arrive.rid)
                    return [EndStream(r.arrive.rid, r.attempt, "coordinator_refused", f"{url} answered {status}")]
                self.counters.failovers += 1
                return self._route(r, now)
        return []  # pragma: no cover - every event is matched above

    # helpers ------------------------------------------------------------------------------------------

    def _release(self, url: str) -> None:
        c = self.coords.get(url)
        if c is not None and c.inflight > 0:
            c.inflight -= 1

    def _fail(self, r: _Req, now: float, code: str, reason: str, *, abort: bool) -> list[Effect]:
        url = r.url
        self._release(url)
        c = self.coords.get(url)
        if c is not None:
            c.down_until = max(c.down_until, now + self.policy.backoff_s)
        out: list[Effect] = [Abort(r.arrive.rid, r.attempt, url, code)] if abort else []
        if r.phase is Phase.COMMITTED:
            self.reqs.pop(r.arrive.rid)
            self.counters.stream_errors += 1
            return [*out, EndStream(r.arrive.rid, r.attempt, code, f"the coordinator {url} failed mid-stream: {reason}")]
        r.url = ""
        self.counters.failovers += 1
        return [*out, *self._route(r, now)]

    def _learn_prefill(self, r: _Req, now: float) -> None:
        c = self.coords.get(r.url)
        if c is None or not r.arrive.stream or r.uncached < self.policy.min_prefill_sample:
            return
        sample = max(0.0, now - r.sent_at - r.wait_s - self._decode_s(c)) / r.uncached
        c.prefill_s = _ewma(c.prefill_s, sample, self.policy.ewma)

    def _decode_s(self, c: _Coord) -> float:
        if c.load is not None and c.load.mean_active_tps > 0:
            return 1.0 / c.load.mean_active_tps
        return self.policy.decode_prior_s

    def _fresh(self, c: _Coord, now: float) -> bool:
        return c.polled_at is not None and now - c.polled_at <= self.policy.stale_after_s

    def score(self, url: str, a: Arrive, now: float) -> tuple[float, float, int] | None:
        """(predicted TTFT, predicted wait, cached tokens) at ``url``, or None when it is no candidate now
        (down, refusing, or refusing by its fresh capacity under enforced admission)."""
        p = self.policy
        c = self.coords.get(url)
        if c is None or c.down_until > now or c.unreachable or c.refusing_until > now:
            return None
        fresh = self._fresh(c, now)
        cap = c.load.capacity if c.load is not None and fresh else None
        if cap is not None and not cap.can_admit and cap.admission == "enforced":
            return None
        decode_s = self._decode_s(c)
        if c.load is not None:
            slots = max(1, c.load.slots)
            sessions = max(c.load.active + c.load.queue, c.inflight)
        else:
            slots, sessions = 1, c.inflight
        request_s = c.request_s if c.request_s is not None else p.request_prior_s
        queue_s = max(0, sessions + 1 - slots) / slots * request_s
        if cap is not None and cap.admission == "enforced":  # an advisory coordinator admits while settling
            queue_s += cap.settle_remaining_s
        load_s = min(sessions, slots) * decode_s
        wait = max(queue_s, load_s)
        if not fresh:
            wait += p.stale_penalty_s
        if cap is not None and not cap.can_admit:
            wait += p.advisory_penalty_s
        cached = self.cached_tokens(url, a.tokens, a.n_prompt)
        prefill_s = c.prefill_s if c.prefill_s is not None else p.prefill_prior_s
        return wait + (a.n_prompt - cached) * prefill_s + decode_s, wait, cached

    def _route(self, r: _Req, now: float) -> list[Effect]:
        a = r.arrive
        p = self.policy
        urls = self.hosts.get(a.model, ())
        scored: list[tuple[float, str, float, int]] = []
        for u in urls:
            if u in r.tried:
                continue
            s = self.score(u, a, now)
            if s is None:
                c = self.coords.get(u)
                if c is not None and c.refusing_until > now:
                    r.refusals.append(c.refusing_until - now)
                elif c is not None and not self.is_down(u, now) and c.load is not None and c.load.capacity is not None:
                    r.refusals.append(max(c.load.capacity.settle_remaining_s, 1.0))  # its own capacity refused
                continue
            scored.append((s[0], u, s[1], s[2]))
        if not scored:
            self.reqs.pop(a.rid, None)
            if r.refusals:
                return [Answer(a.rid, 429, "all_refused", f"every coordinator of model {a.model!r} is at capacity",
                               retry_after_s=min(r.refusals))]
            self.counters.no_coordinator += 1
            why = "none is reachable now" if urls else "the market lists none"
            return [Answer(a.rid, 503, "no_coordinator", f"no coordinator can serve model {a.model!r}: {why}",
                           retry_after_s=1.0)]
        scored.sort()
        ttft, url, wait, cached = scored[0]
        c = self.coords[url]
        r.attempt += 1
        r.url, r.sent_at, r.wait_s, r.uncached = url, now, wait, a.n_prompt - cached
        r.tried.add(url)
        c.inflight += 1
        self.counters.routed += 1
        self.counters.cached_tokens += cached
        budget = p.ttft_slack * ttft
        if not a.stream:
            budget += p.ttft_slack * a.max_tokens * self._decode_s(c)
        return [Send(a.rid, r.attempt, url, now + p.offer_timeout_s + budget, ttft, cached,
                     tuple((u, round(s, 6)) for s, u, _, _ in scored))]


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1 - alpha) * old + alpha * sample
