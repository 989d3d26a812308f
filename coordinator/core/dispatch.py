"""Worker health and the dispatch policy (pure core: no I/O, no clock; ``now`` is given).

Rules:
- A worker is ``up`` until a call to it fails (error, timeout, wrong shape, NaN); then it is
  ``down`` with exponential backoff (``backoff_base * 2**(k-1)``, capped) and gets no work until
  the backoff passes; its next call is a trial — success makes it ``up``, failure doubles the wait.
- The policy decides, per expert range, the ordered list of workers to try; an empty list means
  "compute locally". The coordinator's own copy is always the last resort.
- ``StaticPolicy``: the range's replicas in the map's order, skipping workers that are down.
- ``BalancedPolicy`` (the default): the same live replicas, ordered to spread calls over them
  (untried first, then fewest in flight, lowest latency, round robin).
- Every decision is explainable: ``choose`` returns a reason alongside the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "Choice",
    "ChoiceReason",
    "DispatchPolicy",
    "BalancedPolicy",
    "StaticPolicy",
    "WorkerHealth",
    "WorkerState",
    "WorkerTable",
    "WorkerView",
]


class WorkerState(StrEnum):
    UP = "up"
    DOWN = "down"


class ChoiceReason(StrEnum):
    REMOTE = "remote"  # at least one live replica
    NO_REPLICA = "no_replica"  # the map lists none for this range
    ALL_DOWN = "all_down"  # replicas listed, all in backoff


@dataclass(frozen=True)
class Choice:
    candidates: tuple[str, ...]
    reason: ChoiceReason


@dataclass
class WorkerHealth:
    peer_id: str
    attached_at: float
    state: WorkerState = WorkerState.UP
    calls: int = 0
    rows: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    latency_ewma_ms: float = 0.0
    last_serve_ms: int = 0  # Unix ms of the last successful call; 0 = never served
    last_error: str = ""
    in_flight: int = 0
    picks: int = 0  # times chosen first (round-robin tie-break)


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


class WorkerTable:
    def __init__(self, *, backoff_base_s: float = 0.5, backoff_max_s: float = 30.0, ewma_alpha: float = 0.2) -> None:
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.ewma_alpha = ewma_alpha
        self.workers: dict[str, WorkerHealth] = {}

    def sync(self, peer_ids: set[str], now: float) -> tuple[set[str], set[str]]:
        """Attach workers newly listed, detach those no longer listed; returns (added, removed)."""
        added = peer_ids - self.workers.keys()
        removed = self.workers.keys() - peer_ids
        for p in added:
            self.workers[p] = WorkerHealth(p, attached_at=now)
        for p in removed:
            del self.workers[p]
        return added, removed

    def is_live(self, peer_id: str, now: float) -> bool:
        w = self.workers.get(peer_id)
        return w is not None and (w.state is WorkerState.UP or now >= w.down_until)

    def started(self, peer_id: str) -> None:
        w = self.workers.get(peer_id)
        if w is not None:
            w.in_flight += 1

    def finished(self, peer_id: str) -> None:
        w = self.workers.get(peer_id)
        if w is not None and w.in_flight > 0:
            w.in_flight -= 1

    def succeeded(self, peer_id: str, *, rows: int, latency_s: float, wall_ms: int) -> None:
        w = self.workers.get(peer_id)
        if w is None:
            return
        w.state = WorkerState.UP
        w.consecutive_failures = 0
        w.calls += 1
        w.rows += rows
        ms = latency_s * 1000.0
        w.latency_ewma_ms = ms if w.latency_ewma_ms == 0.0 else (1 - self.ewma_alpha) * w.latency_ewma_ms + self.ewma_alpha * ms
        w.last_serve_ms = wall_ms

    def failed(self, peer_id: str, reason: str, now: float) -> None:
        w = self.workers.get(peer_id)
        if w is None:
            return
        w.failures += 1
        w.consecutive_failures += 1
        w.state = WorkerState.DOWN
        w.down_until = now + min(self.backoff_max_s, self.backoff_base_s * 2 ** (w.consecutive_failures - 1))
        w.last_error = reason

    def views(self, now: float) -> list[WorkerView]:
        return [
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
            )
            for w in sorted(self.workers.values(), key=lambda w: w.peer_id)
        ]


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
