"""A dispatcher's view of its workers (pure core: no I/O, no clock; ``now`` is given).

Rules:
- A worker is ``up`` until a call to it fails (error, timeout, wrong shape, NaN, or the core's
  ``max_hedge_losses`` hedges lost in a row); then it is ``down`` with exponential backoff
  (``backoff_base_s * 2**(k-1)``, capped) and is live again once the backoff passes. A verification
  failure **quarantines** it: never live again in this process, not even after a re-listing.
- A worker is **proven** once one of its answers passed verification since it attached; that is
  sticky until it detaches or fails. Each attach and each failure makes it due for one **trial**
  and starts a **probation** of ``probation_calls`` verified answers.
- Estimates: a latency EWMA and a p95 over the last ``LATENCY_WINDOW`` samples (answers and lost
  hedges); once the samples' sizes vary (``fit_per_pair``) the estimate of a call is size-aware:
  the EWMA moved along the worker's per-pair slope from the EWMA's own call size to the call's.
- Policies order a range's live replicas (``StaticPolicy``: the map's order; ``BalancedPolicy``:
  untried first, then fewest in flight, lowest latency, least often picked).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

__all__ = [
    "LATENCY_WINDOW",
    "MIN_SIZED",
    "BalancedPolicy",
    "Choice",
    "ChoiceReason",
    "DispatchPolicy",
    "StaticPolicy",
    "WorkerHealth",
    "WorkerState",
    "WorkerTable",
    "WorkerView",
    "fit_per_pair",
    "p95",
]


class WorkerState(StrEnum):
    UP = "up"
    DOWN = "down"
    QUARANTINED = "quarantined"  # an answer failed verification: no more work, in this process


class ChoiceReason(StrEnum):
    REMOTE = "remote"  # at least one live replica
    NO_REPLICA = "no_replica"  # the map lists none for this range
    ALL_DOWN = "all_down"  # replicas listed, all in backoff


@dataclass(frozen=True)
class Choice:
    candidates: tuple[str, ...]
    reason: ChoiceReason


LATENCY_WINDOW = 64  # recent latencies kept per worker for its p95
MIN_SIZED = 8  # (pairs, latency) samples before a worker's per-pair slope is fitted


@dataclass
class WorkerHealth:
    peer_id: str
    attached_at: float
    state: WorkerState = WorkerState.UP
    calls: int = 0
    rows: int = 0
    pairs: int = 0  # (row, expert) pairs answered: the work its credit counts
    failures: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    latency_ewma_ms: float = 0.0
    last_serve_ms: int = 0  # Unix ms of the last successful call; 0 = never served
    last_error: str = ""
    in_flight: int = 0
    picks: int = 0  # times chosen first (round-robin tie-break)
    proven: bool = False  # an answer passed verification since it attached (sticky until detached or failed)
    trial_due: bool = True  # one hedged trial at the first loaded dispatch after it attached
    verified: int = 0  # answers that passed verification
    probation_left: int = 0  # verified answers still due at rate 1.0
    hedge_losses: int = 0  # hedges lost in a row
    sampled_at: float | None = None  # its last latency sample: an answer or a lost hedge (None: none; counts from attach)
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    pairs_ewma: float = 0.0  # the routed pairs of its sampled calls (the EWMA's call size)
    sized: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))  # (pairs, seconds)
    per_pair_s: float | None = None  # the slope fitted to ``sized`` (``fit_per_pair``), refitted per sample


@dataclass(frozen=True)
class WorkerView:
    peer_id: str
    state: str
    calls: int
    rows: int
    failures: int
    latency_ewma_ms: float
    last_serve_ms: int
    last_error: str
    retry_in_s: float
    proven: bool = False
    p95_ms: float = 0.0
    in_flight: int = 0
    verified: int = 0
    probation_left: int = 0
    quarantine: str = ""  # the evidence, when quarantined
    pairs: int = 0
    per_pair_ms: float | None = None  # its fitted per-pair slope (None: size-blind so far)


def fit_per_pair(sized: deque[tuple[int, float]]) -> float | None:
    """The least-squares slope (seconds per routed pair, floored at 0) of (pairs, latency) samples,
    or None while they are too few (< ``MIN_SIZED``) or too alike in size (largest < twice the
    smallest) to tell a per-pair cost from the per-call overhead."""
    if len(sized) < MIN_SIZED:
        return None
    ps = [p for p, _ in sized]
    if max(ps) < 2 * min(ps):
        return None
    mp = sum(ps) / len(ps)
    ml = sum(lat for _, lat in sized) / len(sized)
    var = sum((p - mp) ** 2 for p in ps)
    cov = sum((p - mp) * (lat - ml) for p, lat in sized)
    return max(0.0, cov / var)


def p95(samples: deque[float] | list[float]) -> float | None:
    """The 95th percentile (nearest rank) of ``samples``; with fewer than 8, twice their maximum
    (too few to tell a tail from the bulk); None without any."""
    if not samples:
        return None
    if len(samples) < 8:
        return 2.0 * max(samples)
    s = sorted(samples)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


class WorkerTable:
    def __init__(
        self,
        *,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        ewma_alpha: float = 0.2,
        probation_calls: int = 0,
    ) -> None:
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.ewma_alpha = ewma_alpha
        self.probation_calls = probation_calls
        self.workers: dict[str, WorkerHealth] = {}
        self.quarantined: dict[str, str] = {}  # peer -> evidence; outlives detaching

    def sync(self, peer_ids: set[str], now: float) -> tuple[set[str], set[str]]:
        """Attach workers newly listed, detach those no longer listed; returns (added, removed)."""
        added = peer_ids - self.workers.keys()
        removed = self.workers.keys() - peer_ids
        for p in added:
            w = WorkerHealth(p, attached_at=now, probation_left=self.probation_calls)
            if p in self.quarantined:
                w.state, w.trial_due, w.last_error = WorkerState.QUARANTINED, False, self.quarantined[p]
            self.workers[p] = w
        for p in removed:
            del self.workers[p]
        return added, removed

    def is_live(self, peer_id: str, now: float) -> bool:
        w = self.workers.get(peer_id)
        return w is not None and (
            w.state is WorkerState.UP or (w.state is WorkerState.DOWN and now >= w.down_until)
        )

    def verified(self, peer_id: str, equal: bool, evidence: str = "") -> None:
        """One of the worker's answers was compared with the coordinator's: equal counts (and proves
        it); unequal quarantines it for good."""
        w = self.workers.get(peer_id)
        if not equal:
            self.quarantined[peer_id] = evidence
            if w is not None:
                w.state, w.proven, w.trial_due, w.last_error = WorkerState.QUARANTINED, False, False, evidence
            return
        if w is None or w.state is WorkerState.QUARANTINED:
            return
        w.verified += 1
        w.probation_left = max(0, w.probation_left - 1)
        w.proven = True
        w.trial_due = False

    def is_proven(self, peer_id: str) -> bool:
        w = self.workers.get(peer_id)
        return w is not None and w.proven

    def started(self, peer_id: str) -> None:
        w = self.workers.get(peer_id)
        if w is not None:
            w.in_flight += 1

    def finished(self, peer_id: str) -> None:
        w = self.workers.get(peer_id)
        if w is not None and w.in_flight > 0:
            w.in_flight -= 1

    def succeeded(self, peer_id: str, *, rows: int, latency_s: float, wall_ms: int, pairs: int = 0,
                  restart: bool = False) -> None:
        """An answer came after ``latency_s``; ``restart``: the estimate was stale (see the core's
        probes), so this sample replaces the EWMA instead of joining it."""
        w = self.workers.get(peer_id)
        if w is None:
            return
        if w.state is not WorkerState.QUARANTINED:
            w.state = WorkerState.UP
        w.consecutive_failures = 0
        w.hedge_losses = 0
        w.calls += 1
        w.rows += rows
        w.pairs += pairs
        if restart:
            w.latency_ewma_ms = 0.0
            w.sized.clear()
            w.per_pair_s = None
        self._sample(w, latency_s, pairs)
        w.last_serve_ms = wall_ms

    def _sample(self, w: WorkerHealth, latency_s: float, pairs: int) -> None:
        ms = latency_s * 1000.0
        first = w.latency_ewma_ms == 0.0
        a = self.ewma_alpha
        w.latency_ewma_ms = ms if first else (1 - a) * w.latency_ewma_ms + a * ms
        w.pairs_ewma = float(pairs) if first else (1 - a) * w.pairs_ewma + a * pairs
        w.latencies_s.append(latency_s)
        if pairs > 0:
            w.sized.append((pairs, latency_s))
            w.per_pair_s = fit_per_pair(w.sized)  # once per answer, not per placement

    def per_pair_s(self, peer_id: str) -> float | None:
        """A worker's marginal seconds per routed pair (``fit_per_pair`` of its recent samples)."""
        w = self.workers.get(peer_id)
        return w.per_pair_s if w is not None else None

    def call_estimate_s(self, peer_id: str, pairs: float | None, default_s: float) -> float:
        """Seconds a call of ``pairs`` routed pairs to this worker is expected to take, queue
        excluded: its latency EWMA, moved along its per-pair slope from the EWMA's call size to
        ``pairs`` (size-blind while the slope is unknown, or for ``pairs=None``), never below the
        slope's share alone; ``default_s`` without any sample."""
        w = self.workers.get(peer_id)
        if w is None or w.latency_ewma_ms <= 0:
            return default_s
        lat = w.latency_ewma_ms / 1000.0
        b = w.per_pair_s
        if b is None or pairs is None:
            return lat
        return max(lat + b * (pairs - w.pairs_ewma), b * pairs)

    def lost_hedge(self, peer_id: str, elapsed_s: float, pairs: int) -> int:
        """A call of this worker (of ``pairs`` routed pairs) lost a hedge after ``elapsed_s`` (a
        lower bound of its latency, recorded as a sample so its estimates rise); returns the losses
        in a row."""
        w = self.workers.get(peer_id)
        if w is None:
            return 0
        w.hedge_losses += 1
        self._sample(w, elapsed_s, pairs)
        return w.hedge_losses

    def failed(self, peer_id: str, reason: str, now: float) -> float:
        """Mark down with backoff; returns when it is live again (``now`` if unknown)."""
        w = self.workers.get(peer_id)
        if w is None:
            return now
        w.failures += 1
        w.consecutive_failures += 1
        w.hedge_losses = 0
        w.probation_left = self.probation_calls  # verified at rate 1.0 again
        if w.state is WorkerState.QUARANTINED:
            return now
        w.state = WorkerState.DOWN
        w.proven = False
        w.trial_due = True  # it proves itself again with a trial, once its backoff passes
        w.down_until = now + min(self.backoff_max_s, self.backoff_base_s * 2 ** (w.consecutive_failures - 1))
        w.last_error = reason
        return w.down_until

    def views(self, now: float) -> list[WorkerView]:
        out = []
        for w in sorted(self.workers.values(), key=lambda w: w.peer_id):
            q = p95(w.latencies_s)
            out.append(
                WorkerView(
                    peer_id=w.peer_id,
                    state=w.state.value,
                    calls=w.calls,
                    rows=w.rows,
                    failures=w.failures,
                    latency_ewma_ms=round(w.latency_ewma_ms, 3),
                    last_serve_ms=w.last_serve_ms,
                    last_error=w.last_error,
                    retry_in_s=round(max(0.0, w.down_until - now), 3) if w.state is WorkerState.DOWN else 0.0,
                    proven=w.proven,
                    p95_ms=round(q * 1000.0, 3) if q is not None else 0.0,
                    in_flight=w.in_flight,
                    verified=w.verified,
                    probation_left=w.probation_left,
                    quarantine=self.quarantined.get(w.peer_id, ""),
                    pairs=w.pairs,
                    per_pair_ms=round(w.per_pair_s * 1000.0, 4) if w.per_pair_s is not None else None,
                )
            )
        return out


class DispatchPolicy(Protocol):
    def choose(self, replicas: list[str], table: WorkerTable, now: float) -> Choice: ...


class StaticPolicy:
    """Remote whenever a live replica is listed (map order), local otherwise."""

    def choose(self, replicas: list[str], table: WorkerTable, now: float) -> Choice:
        if not replicas:
            return Choice((), ChoiceReason.NO_REPLICA)
        live = tuple(p for p in replicas if table.is_live(p, now))
        return Choice(live, ChoiceReason.REMOTE if live else ChoiceReason.ALL_DOWN)


class BalancedPolicy:
    """Remote whenever a live replica is listed; calls spread over the live replicas.

    Order: a worker that has never served gets the first trial (a newly attached replica proves
    itself at once instead of idling behind a proven one); then fewest calls in flight, then
    lowest latency EWMA, then least often picked (round robin among equals); the map's order
    breaks what is left. The rest follow as fallbacks in the same order.
    """

    def choose(self, replicas: list[str], table: WorkerTable, now: float) -> Choice:
        if not replicas:
            return Choice((), ChoiceReason.NO_REPLICA)
        live = [p for p in replicas if table.is_live(p, now)]
        if not live:
            return Choice((), ChoiceReason.ALL_DOWN)
        rank = {p: i for i, p in enumerate(replicas)}

        def key(p: str) -> tuple[int, int, float, int, int]:
            w = table.workers[p]
            untried = 0 if (w.calls == 0 and w.in_flight == 0) else 1
            return (untried, w.in_flight, round(w.latency_ewma_ms, 1), w.picks, rank[p])

        order = tuple(sorted(live, key=key))
        table.workers[order[0]].picks += 1
        return Choice(order, ChoiceReason.REMOTE)

