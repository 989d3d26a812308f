"""Load-adaptive expert dispatch (pure core: no I/O, no clock; ``now`` is given, DESIGN §5 "layer 1").

Events in, effects out: ``DispatchCore.handle(event, now) -> list[Effect]``. The shell
(``coordinator.dispatch.dispatcher``) reports what happened (a layer's routed pairs are ready, a remote
call answered or failed, a local computation finished, a timer fired, a load sample came in or
timed out) and does what the effects ask (send a call, run the local kernel, cancel a loser,
start or cancel a timer, combine a layer). Every placement carries a ``Reason``; the core counts
them (``decisions``), and keeps the last failures (``errors``) for ``/dispatch``.

Rules:
- Workers (``WorkerTable``): a worker is ``up`` until a call to it fails (error, timeout, wrong
  shape, NaN, or ``max_hedge_losses`` hedges lost in a row); then it is ``down`` with exponential
  backoff (``backoff_base_s * 2**(k-1)``, capped) and gets no work until the backoff passes.
  A worker is **proven** once one of its answers passed verification since it attached; that is
  sticky until it detaches or fails. Each attach makes it due for one **trial**.
- Verification (DESIGN §12): a remote call of a held range is *sampled* -- rate 1.0 while the worker
  is in probation (its first ``verify_probation_calls`` verified answers after it attached, and as
  many again after any failure), else ``verify_rate``, drawn from the ``rng`` the shell hands in
  (seeded at random), so a worker cannot tell sampled calls from others. A sampled call (and every trial) is *kept*
  (``SendRemote.keep``) and the range is computed here too (``RunLocal(keep=True)``, reason VERIFY
  beside a placement, TRIAL_HEDGE for a trial): the range's result is always the local one, the
  remote call runs to its end and is never cancelled as a loser, so the step does not wait for it.
  Once both sides ended the core asks the shell to ``Compare`` them (both answered) or to ``Forget``
  them (one failed or was cancelled): a kept result is held exactly until then. The shell answers
  ``Compared(equal)``: equal counts a verified call (the trial's proves the worker, ``MarkProven``);
  unequal **quarantines** the worker at once (``Quarantine`` with the evidence): never live again in
  this process, not even after a re-listing; its calls in flight are abandoned and their ranges
  recovered (next proven replica, else local). Not-held ranges are checked on a second replica
  (placement rules below). A wrong hold digest (``HoldRefuted``) quarantines the same way.
- Load: ``LoadSample(busy, n_slots)`` every ``sample_interval_s`` (the shell bounds the sample in
  time; a sample that hangs or fails is ``LoadSampleTimeout`` and changes nothing). ``busy >=
  saturation_threshold`` is *loaded*. A sample older than ``sample_max_age_s`` has aged out and
  says nothing. After the load ends (an idle sample, or the loaded one aged out) the state is
  ``serve_ttl`` for ``serve_ttl_s``, then ``idle``: hysteresis, so a flapping load does not thrash.
- Placement of a layer's ranges (``LayerReady``), in ascending ``lo``:
  - a range holding one of the layer's ``hot_experts`` most-routed experts runs locally (HOT_EXPERT)
    when the coordinator holds it; the partition is never changed, so the bits are not either;
  - ``offload`` mode (the pre-adaptive behaviour): a live replica gets it (OFFLOAD_REMOTE, replicas in
    ``BalancedPolicy`` order), else local (NO_REPLICA / ALL_DOWN);
  - idle: held ranges run locally (IDLE_LOCAL);
  - loaded: a live unproven replica due for its trial gets the range *and* the local copy computes
    it (TRIAL_HEDGE; first result wins, the remote call still runs to its end to prove the worker);
    otherwise the earliest estimated finish among local (its backlog of pairs plus these, at the
    measured seconds per pair) and each live proven replica wins: LOAD_EARLIEST_FINISH_LOCAL /
    _REMOTE. Ties go local. A replica's finish is its estimate for a call of the range's size plus
    one usual-size call per call in flight. The estimate is size-aware once its sizes vary: the
    latency EWMA moved along the worker's per-pair slope (least squares over its last 64
    (pairs, latency) samples, fitted from 8 on when the largest is at least twice the smallest)
    from the EWMA's own call size to the range's -- so a prefill-sized range is not sent on the
    strength of decode-sized answers -- and size-blind (the EWMA) before that;
    A worker's estimate is only refreshed by its answers, so a stale one is **probed**: under load,
    a live proven worker with nothing in flight and no latency sample (answer or lost hedge) for
    ``probe_interval_s`` gets the first of the layer's ranges that earliest finish placed here
    (PROBE): it is sent *and* computed here (the local copy is the result, reason VERIFY, the
    answer is compared like a sampled call), so a cold start (one slow early answer) cannot keep a
    worker idle for good, and the probe costs the step nothing but the call. A proven worker still
    in **probation** (every answer verified, i.e. computed here too) is no candidate of earliest
    finish -- a remote share would save nothing -- but is probed at every layer while it has
    nothing in flight, so its probation passes in a few dozen layers without slowing them; the
    split check (below) waits for it;
  - serve TTL: the same earliest-finish choice without trials, reason SERVE_TTL;
  - not held: remote only (NOT_HELD), proven replicas first; no live replica: ``Fail``
    (NO_REPLICA / ALL_DOWN; the shell may wait for coverage and retry the layer), or with
    ``missing_disk`` the coordinator computes it from its GGUF anyway (MISSING_DISK). A sampled call
    of such a range is checked on a second live replica (VERIFY_SECOND): neither answer is the
    range's until both agree; a disagreement is settled by computing it here (DISPUTE, ``Settle``),
    which is then the result, and whoever differs is quarantined; with no second replica the call is
    served unchecked (``unverifiable``).
- Split check (``coordinator.core.split_check``): under load the estimates alone do not decide.
  Windows local / split / local of ``split_check_s`` measure routed pairs per second; the split is
  kept for ``split_hold_s`` when it beats the local windows by ``split_margin``, else every held
  range stays here (SPLIT_CHECK in a local window, SPLIT_SLOWER after such a verdict; trials and
  probes still go out). The verdict is a ``SplitChecked`` effect. No check runs while a worker is
  in probation; a load that ends mid-check suspends it (the last verdict stays, split before any;
  the window under way is re-run at the next loaded layer).
- Hedging: every remote call (not a trial) gets a hedge timer at ``max(hedge_floor_s, p95)`` of its
  worker's recent latencies (no history: half the timeout). If it fires before any result for the
  range, the range is raced against the local copy (held) or the next live replica (HEDGE_SLOW).
  The first result wins; every other call of the range is cancelled (``Cancel``), a cancelled
  remote call counts as a lost hedge for its worker.
- Deadlines: every remote call has a deadline timer at ``timeout_s``; expiry is a failure.
- Failure of a remote call: its worker is marked down (``MarkDown``), the failure is recorded.
  If the range has no result and no other call in flight: the next live replica that has not
  been tried for this range (RETRY_NEXT; adaptive mode: proven ones only while the range is
  held), else the local copy (FALLBACK_LOCAL), else ``Fail`` (ALL_FAILED).
- Attempt numbers count a range's remote calls (0, 1, ...); the request id is the range's. An
  answer for a call that is no longer pending (cancelled, timed out, unknown) changes nothing
  (``stale_answers``).
- A layer the shell computed here on its own (``LayerRanLocally``) counts as the placements it
  would have been (its ``reason``: IDLE_LOCAL, LOAD_EARLIEST_FINISH_LOCAL or SERVE_TTL), and its
  compute time feeds the local cost estimate. The shell may do so for a layer of at most
  ``local_only_pairs()`` routed pairs whose ranges are all held: below that size every range would
  be placed here anyway -- idle (unbounded), or under load when no trial or probe is due and even the
  fastest live proven worker's estimate for the smallest call (its latency EWMA with the per-pair
  part taken out, once known; plus its calls in flight) is no earlier than the local finish of the
  whole layer (``(backlog + pairs) x seconds per pair``; ties go local).
- Micro-batches (``overlap_pays``): the engine alternates two micro-batches of a step only where
  it would otherwise wait for remote ranges whatever their round trip -- ``offload`` mode, or (the
  shell says) a map with ranges not held here -- and that round trip is long: the fastest live
  worker's latency EWMA is at least ``overlap_min_rtt_s`` (15 ms) and exceeds computing the whole
  layer here (``pairs x seconds per pair``).
  Then one micro-batch's dense half computes while the other's remote share is in flight. Not
  under earliest-finish: it sends a range remote only when that finishes before the local share
  would, so there is little wait to fill, and two micro-batches cost more than one step (less
  sharing of expert weights, twice the per-layer overhead). Measured on 2 cores
  (``benchmarks/offload.py``, 8 sessions; scratch patches): with half of each layer forced remote,
  micro-batches give 0.63x vs 0.76x of local-only at a 0 ms round trip, 0.61x vs 0.55x at 10 ms,
  0.30x vs 0.28x at 40 ms; a coordinator holding half of the experts (the rest on the volunteer,
  0 ms) 45.5 vs 47.5 tokens/s; a backbone coordinator (``benchmarks/capacity.py --quick``, loopback
  round trips of a few ms) 148 vs 172 tokens/s at 4 sessions. Hence the floor.
- ``Combine(step, calls)`` once every range of the layer has a result: the winning call of each
  range, in ascending ``lo`` (DESIGN §3: the same kernel on the same rows wherever it ran, summed
  in the same order, whoever won).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType, Protocol

from coordinator.core.split_check import SplitArm, SplitCheck, SplitOutcome
from swarm.core.rng import Rng

__all__ = [
    "BalancedPolicy",
    "CallId",
    "Cancel",
    "CancelTimer",
    "Choice",
    "ChoiceReason",
    "Combine",
    "Compare",
    "Compared",
    "DispatchConfig",
    "DispatchCore",
    "DispatchMode",
    "DispatchPolicy",
    "Effect",
    "ErrorRecord",
    "Event",
    "Fail",
    "Forget",
    "FailureKind",
    "Hedge",
    "HoldRefuted",
    "Settle",
    "Settled",
    "SplitChecked",
    "LayerRanLocally",
    "LayerReady",
    "LayerRowCounts",
    "LoadSample",
    "LoadSampleTimeout",
    "LoadState",
    "LocalDone",
    "LocalFailed",
    "MarkDown",
    "MarkProven",
    "ModeChanged",
    "Quarantine",
    "RangeWork",
    "Reason",
    "RemoteDone",
    "RemoteFailed",
    "RunLocal",
    "SendRemote",
    "StartTimer",
    "StaticPolicy",
    "StepId",
    "Timer",
    "TimerFired",
    "TimerKind",
    "WorkerHealth",
    "WorkerState",
    "WorkerTable",
    "WorkerView",
    "WorkersListed",
    "p95",
]

CallId = NewType("CallId", int)
StepId = NewType("StepId", int)


# -- worker health -------------------------------------------------------------------------------


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


# -- configuration, reasons ----------------------------------------------------------------------


class DispatchMode(StrEnum):
    ADAPTIVE = "adaptive"  # DESIGN §5 layer 1: local when idle, earliest finish under load
    OFFLOAD = "offload"  # every range with a live replica goes remote (the pre-adaptive behaviour)


class LoadState(StrEnum):
    IDLE = "idle"
    LOADED = "loaded"
    SERVE_TTL = "serve_ttl"


class Reason(StrEnum):
    """Why a range went where it went (or why a call was cancelled, a worker marked down)."""

    IDLE_LOCAL = "idle_local"
    LOAD_EARLIEST_FINISH_LOCAL = "load_earliest_finish_local"
    LOAD_EARLIEST_FINISH_REMOTE = "load_earliest_finish_remote"
    SERVE_TTL = "serve_ttl"
    TRIAL_HEDGE = "trial_hedge"
    SPLIT_CHECK = "split_check"  # RunLocal: under load, a local window of the split check (split_check.py)
    SPLIT_SLOWER = "split_slower"  # RunLocal: under load, held here: the last check found the split no faster
    SPLIT_FASTER = "split_faster"  # SplitChecked: the check found the split faster (earliest finish decides)
    PROBE = "probe"  # SendRemote: a proven worker's estimate is stale or it is in probation; kept, the local copy used
    HOT_EXPERT = "hot_expert"
    OFFLOAD_REMOTE = "offload_remote"
    NOT_HELD = "not_held"
    NO_REPLICA = "no_replica"
    ALL_DOWN = "all_down"
    HEDGE_SLOW = "hedge_slow"
    RETRY_NEXT = "retry_next"
    FALLBACK_LOCAL = "fallback_local"
    ALL_FAILED = "all_failed"
    VERIFY = "verify"  # RunLocal: the coordinator's copy of a sampled remote call (its result is used)
    VERIFY_SECOND = "verify_second"  # SendRemote: a second replica of a sampled call of a range not held here
    DISPUTE = "dispute"  # RunLocal: two replicas disagreed; the coordinator computes it from its GGUF
    LOCAL_FAILED = "local_failed"  # Fail: the coordinator's own kernel failed on a range
    MISSING_DISK = "missing_disk"  # RunLocal: not held, nobody serves it: computed from the GGUF (--on-missing disk)
    QUARANTINED = "quarantined"  # Cancel: the worker failed verification
    LOST_RACE = "lost_race"  # Cancel: another call of the range answered first
    DEADLINE = "deadline"  # Cancel: no answer within the timeout
    LOAD_ONSET = "load_onset"  # ModeChanged
    LOAD_ENDED = "load_ended"
    TTL_EXPIRED = "ttl_expired"


class FailureKind(StrEnum):
    TIMEOUT = "timeout"
    BROKEN = "broken"  # the stream or connection died under the call
    DIAL = "dial_failed"
    CLOSED = "closed"
    REFUSED = "refused"  # draining, slice not held
    PROTOCOL = "protocol"  # error answer, wrong shape, NaN, bad frame
    SLOW = "slow"  # lost ``max_hedge_losses`` hedges in a row
    LOCAL = "local"  # the coordinator's own kernel failed
    WRONG_ANSWER = "wrong_answer"  # failed verification: quarantined
    OTHER = "other"


@dataclass(frozen=True)
class DispatchConfig:
    mode: DispatchMode = DispatchMode.ADAPTIVE
    saturation_threshold: int = 2  # busy slots from which the coordinator is under load
    serve_ttl_s: float = 20.0
    sample_interval_s: float = 2.0
    sample_timeout_s: float = 1.0  # the shell's bound on one load sample
    sample_max_age_s: float = 6.0  # a sample older than this says nothing
    timeout_s: float = 3.0  # deadline of one remote call
    hedge: bool = True
    hedge_floor_s: float = 0.05
    max_hedge_losses: int = 3  # lost hedges in a row that mark a worker down
    hot_experts: int = 0  # the K most-routed experts of each layer always run locally
    hot_decay: float = 0.98  # per layer call: the routing counts' memory
    local_cost_prior_s: float = 20e-6  # seconds per (row, expert) pair before the first measurement
    # micro-batches only from this round trip on (see the module rules: measured on one 2-core box,
    # they cost more than they fill up to ~10 ms and paid from 10-20 ms)
    overlap_min_rtt_s: float = 0.015
    ewma_alpha: float = 0.2
    # under load, a proven worker without a latency sample for this long is probed (0: never): an
    # estimate is only refreshed by calls, so one slow early answer must not keep it idle for good
    probe_interval_s: float = 2.0
    # under load, measure whether remote shares pay here: windows local / split / local of this
    # length, the winner held for split_hold_s; the split must win by split_margin (0: no check)
    split_check_s: float = 3.0
    split_hold_s: float = 30.0
    split_margin: float = 0.10  # must win clearly (windows of the same work differed by up to ~20 % on the 2-core VM; the watch backs it)
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_errors: int = 32  # failures kept for /dispatch
    verify_rate: float = 0.05  # sampled share of a held range's remote calls after probation
    verify_probation_calls: int = 50  # verified answers at rate 1.0 after an attach and after any failure
    # a range not held here with no live replica (or all failed): "fail" the layer (the shell may wait and
    # retry it: --on-missing wait) or compute it here from the GGUF on disk anyway ("disk": slow but exact)
    missing_disk: bool = False


# -- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RangeWork:
    """One range of a layer with routed pairs: what the shell grouped, what the map lists."""

    lo: int
    hi: int
    rows: int
    pairs: int
    replicas: tuple[str, ...] = ()  # preference order (the map's)
    held: bool = True  # the coordinator holds these experts


@dataclass(frozen=True)
class WorkersListed:
    """The dispatch map changed: these workers are listed now (new ones attach, missing detach)."""

    peers: frozenset[str]


@dataclass(frozen=True)
class LayerReady:
    step: StepId
    layer: int
    ranges: tuple[RangeWork, ...]  # ascending lo, only ranges with pairs
    expert_pairs: tuple[int, ...] = ()  # routed pairs per expert of the layer (hot-expert counts)


@dataclass(frozen=True)
class LayerRanLocally:
    """The shell computed a whole layer here without asking (its fast path: every range held, at most
    ``local_only_pairs()`` pairs): counted as ``reason`` placements; ``compute_s`` > 0 is the kernel time."""

    layer: int
    ranges: tuple[RangeWork, ...]
    reason: Reason = Reason.IDLE_LOCAL
    compute_s: float = 0.0


@dataclass(frozen=True)
class RemoteDone:
    call: CallId
    wall_ms: int  # Unix ms (for last_serve_ms only)


@dataclass(frozen=True)
class RemoteFailed:
    call: CallId
    kind: FailureKind
    message: str
    wall_ms: int = 0


@dataclass(frozen=True)
class LocalDone:
    call: CallId
    compute_s: float  # time the kernel ran (not the wait for the local runner)


@dataclass(frozen=True)
class LocalFailed:
    call: CallId
    message: str


@dataclass(frozen=True)
class Compared:
    """The shell's answer to ``Compare``: were the remote call's outputs the coordinator's?"""

    remote: CallId
    equal: bool
    detail: str = ""  # what differed (the evidence), or how close it was


@dataclass(frozen=True)
class Settled:
    """The shell's answer to ``Settle``: did each replica's answer equal the coordinator's?"""

    a: CallId
    a_equal: bool
    b_equal: bool
    detail_a: str = ""
    detail_b: str = ""


@dataclass(frozen=True)
class HoldRefuted:
    """The shell's hold challenge (DESIGN §12 "proved it holds it") got a wrong digest from ``peer``
    for slice ``layer:lo-hi``: the worker does not hold what it claims, so it is quarantined like a
    wrong answer (a failed or unanswered challenge is not this: the shell just tries again later)."""

    peer: str
    layer: int
    lo: int
    hi: int
    detail: str


class TimerKind(StrEnum):
    HEDGE = "hedge"
    DEADLINE = "deadline"


@dataclass(frozen=True)
class Timer:
    kind: TimerKind
    call: CallId


@dataclass(frozen=True)
class TimerFired:
    timer: Timer


@dataclass(frozen=True)
class LoadSample:
    busy: int
    n_slots: int


@dataclass(frozen=True)
class LoadSampleTimeout:
    message: str = "load sample timed out"


Event = (
    WorkersListed
    | LayerReady
    | LayerRanLocally
    | RemoteDone
    | RemoteFailed
    | LocalDone
    | LocalFailed
    | Compared
    | Settled
    | HoldRefuted
    | TimerFired
    | LoadSample
    | LoadSampleTimeout
)


# -- effects ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendRemote:
    call: CallId
    step: StepId
    layer: int
    index: int  # the range's position in LayerReady.ranges
    lo: int
    hi: int
    peer: str
    request_id: int
    attempt: int
    reason: Reason
    keep: bool = False  # keep the answer until a Compare or Forget names this call


@dataclass(frozen=True)
class RunLocal:
    call: CallId
    step: StepId
    layer: int
    index: int
    lo: int
    hi: int
    reason: Reason
    keep: bool = False


@dataclass(frozen=True)
class Hedge:
    """Race a slow call: compute the range locally (``peer is None``) or on ``peer``."""

    call: CallId
    step: StepId
    layer: int
    index: int
    lo: int
    hi: int
    peer: str | None
    request_id: int
    attempt: int
    reason: Reason
    slow_call: CallId


@dataclass(frozen=True)
class Cancel:
    call: CallId
    reason: Reason


@dataclass(frozen=True)
class StartTimer:
    timer: Timer
    at: float


@dataclass(frozen=True)
class CancelTimer:
    timer: Timer


@dataclass(frozen=True)
class MarkDown:
    peer: str
    kind: FailureKind
    message: str
    retry_at: float


@dataclass(frozen=True)
class MarkProven:
    peer: str


@dataclass(frozen=True)
class Compare:
    """Compare the kept answers of ``remote`` (on ``peer``) and ``local``, then drop both; answer
    with ``Compared``."""

    remote: CallId
    local: CallId
    peer: str
    layer: int
    lo: int
    hi: int
    peer_b: str | None = None  # ``local`` is a second replica's call (a range not held here): keep both if unequal


@dataclass(frozen=True)
class Settle:
    """Two replicas disagreed on a range not held here: compare each kept answer with the coordinator's
    own (``local``, computed from its GGUF), then drop all three; answer with ``Settled``."""

    a: CallId
    b: CallId
    local: CallId
    peer_a: str
    peer_b: str
    layer: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Forget:
    """Drop the kept answers of these calls (one side of a verification did not answer)."""

    calls: tuple[CallId, ...]


@dataclass(frozen=True)
class Quarantine:
    peer: str
    layer: int
    lo: int
    hi: int
    evidence: str


@dataclass(frozen=True)
class Combine:
    step: StepId
    layer: int
    calls: tuple[CallId, ...]  # the winner of each range, ascending lo


@dataclass(frozen=True)
class Fail:
    step: StepId
    layer: int
    lo: int
    hi: int
    reason: Reason
    message: str


@dataclass(frozen=True)
class ModeChanged:
    state: LoadState
    reason: Reason


@dataclass(frozen=True)
class SplitChecked:
    """A split check ended (``coordinator.core.split_check``): the arm kept, and why."""

    outcome: SplitOutcome
    reason: Reason  # SPLIT_FASTER / SPLIT_SLOWER


Effect = (
    SendRemote
    | RunLocal
    | Hedge
    | Cancel
    | StartTimer
    | CancelTimer
    | MarkDown
    | MarkProven
    | Compare
    | Settle
    | Forget
    | Quarantine
    | Combine
    | Fail
    | ModeChanged
    | SplitChecked
)


# -- state -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorRecord:
    at: float  # core time
    wall_ms: int
    peer: str
    layer: int
    lo: int
    hi: int
    attempt: int
    kind: FailureKind
    message: str


@dataclass
class LayerRowCounts:
    local_rows: int = 0  # placed local and computed there
    remote_rows: int = 0  # answered by a worker
    fallback_rows: int = 0  # placed remote, computed locally (failure, hedge or trial won locally)
    verified_rows: int = 0  # placed remote and sampled: computed here too, the coordinator's result used


@dataclass
class _Call:
    call: CallId
    step: StepId
    layer: int
    index: int
    work: RangeWork
    peer: str | None  # None: local
    attempt: int
    started: float
    trial: bool = False
    verify: bool = False  # kept for a comparison: runs to its end, never wins (remote) / must win (local)
    done: bool = False


@dataclass
class _Range:
    work: RangeWork
    request_id: int
    planned_local: bool
    pending: set[CallId] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)
    attempts: int = 0
    winner: CallId | None = None
    failed: bool = False
    trusted_only: bool = False  # verified: only a local call's result may be the range's
    verified: bool = False  # placed remote, sampled (row counts)
    cross: _Cross | None = None  # not held here and sampled: checked against a second replica


@dataclass
class _Cross:
    """A sampled call of a range not held here and its copy on a second replica; each side pending,
    done or gone. Neither answer is the range's until they agree (or one side is gone); a disagreement
    is settled by the coordinator's own copy (``dispute``)."""

    a: _Call
    b: _Call
    a_side: str = "pending"
    b_side: str = "pending"
    dispute: CallId | None = None  # the local call settling a disagreement
    over: bool = False  # decided: agreed, one side won alone, or settled


@dataclass
class _Pair:
    """A verification: the remote call and the local copy; each side pending, done or gone."""

    remote: CallId
    local: CallId
    peer: str
    layer: int
    lo: int
    hi: int
    trial: bool
    remote_side: str = "pending"
    local_side: str = "pending"


@dataclass
class _Step:
    step: StepId
    layer: int
    ranges: list[_Range]


@dataclass(frozen=True)
class _Sample:
    busy: int
    n_slots: int
    at: float


class DispatchCore:
    """The dispatch state machine; ``handle`` is the only way in (queries are read-only)."""

    def __init__(
        self,
        config: DispatchConfig = DispatchConfig(),
        *,
        n_layer: int = 0,
        n_expert: int = 0,
        rng: Rng | None = None,
    ) -> None:
        """``rng`` draws the verification samples (a seeded ``random.Random``; the shell seeds it at
        random); it may be omitted only when the rate is 0 or 1."""
        if rng is None and 0.0 < config.verify_rate < 1.0:
            raise ValueError("a verify rate strictly between 0 and 1 needs an rng")
        self.config = config
        self.table = WorkerTable(
            backoff_base_s=config.backoff_base_s,
            backoff_max_s=config.backoff_max_s,
            ewma_alpha=config.ewma_alpha,
            probation_calls=config.verify_probation_calls,
        )
        self.rng = rng
        self._pairs: dict[CallId, _Pair] = {}  # by remote call and by local call
        self._cross: dict[CallId, _Cross] = {}  # by either replica's call and by the dispute's local call
        self.cross_checks = 0  # second-replica comparisons asked for
        self.disputes = 0  # second-replica comparisons that disagreed (settled here)
        self.unverifiable = 0  # sampled calls of ranges not held here with no second live replica
        self._comparing: dict[CallId, _Pair] = {}  # Compare sent, Compared not yet in (by remote call)
        self.verifications = 0  # comparisons asked for
        self.verified_equal = 0
        self.quarantines = 0
        self.balanced = BalancedPolicy()
        self.n_expert = n_expert
        self.decisions: Counter[Reason] = Counter()
        self.errors: deque[ErrorRecord] = deque(maxlen=config.max_errors)
        self.errors_total = 0
        self.errors_by_kind: Counter[FailureKind] = Counter()
        self.stale_answers = 0
        self.samples_failed = 0
        self.rows = [LayerRowCounts() for _ in range(n_layer)]
        self.routed: Counter[tuple[int, int, int]] = Counter()  # (layer, lo, hi) -> rows routed to it, wherever run
        self.local_cost_s = config.local_cost_prior_s  # per (row, expert) pair, EWMA
        self.local_backlog_pairs = 0
        self.sample: _Sample | None = None
        self.load_ended_at: float | None = None
        self.state = LoadState.IDLE
        self.split = SplitCheck(window_s=config.split_check_s, hold_s=config.split_hold_s,
                                margin=config.split_margin)
        self._steps: dict[StepId, _Step] = {}
        self._calls: dict[CallId, _Call] = {}
        self._ids = 0
        self._request_ids = 0
        self._hot: dict[int, list[float]] = {}
        self._winners: dict[CallId, bool] = {}  # winning call -> answered remotely (until its layer combines)
        self._last_now = 0.0  # the time of the event being handled (for cancels deep in a decision)

    # -- queries ---------------------------------------------------------------------------------
    def load_state(self, now: float) -> LoadState:
        """idle / loaded / serve_ttl at ``now`` (see the module rules)."""
        c = self.config
        s = self.sample
        ended: float | None
        if s is not None and s.busy >= c.saturation_threshold:
            if now - s.at <= c.sample_max_age_s:
                return LoadState.LOADED
            end = s.at + c.sample_max_age_s  # aged out: the load is not known to go on
            ended = end if self.load_ended_at is None else max(end, self.load_ended_at)
        else:
            ended = self.load_ended_at
        if ended is not None and now - ended < c.serve_ttl_s:
            return LoadState.SERVE_TTL
        return LoadState.IDLE

    def hot_experts(self, layer: int) -> frozenset[int]:
        """The layer's ``hot_experts`` most-routed experts so far (ties: the lower index)."""
        k = self.config.hot_experts
        counts = self._hot.get(layer)
        if k <= 0 or not counts:
            return frozenset()
        order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        return frozenset(e for e in order[:k] if counts[e] > 0)

    def local_only_pairs(self, now: float) -> tuple[float, Reason]:
        """The largest layer (in routed pairs) whose held ranges would all be placed here now without
        a decision, and the reason they would carry; 0 when the shell must ask (see the rules)."""
        c = self.config
        if c.mode is not DispatchMode.ADAPTIVE or c.hot_experts > 0:
            return 0.0, Reason.IDLE_LOCAL
        if self.state is LoadState.IDLE:
            return math.inf, Reason.IDLE_LOCAL
        local_arm = self.split.arm() is SplitArm.LOCAL
        reason = (self._split_reason() if local_arm else
                  Reason.SERVE_TTL if self.state is LoadState.SERVE_TTL else Reason.LOAD_EARLIEST_FINISH_LOCAL)
        best = math.inf
        for p, w in self.table.workers.items():
            if not self.table.is_live(p, now):
                continue
            if not w.proven:
                if self.state is LoadState.LOADED and w.trial_due:
                    return 0.0, reason  # its trial is due: the shell must ask
                continue
            if self._probe_due(w, now):
                return 0.0, reason  # its estimate is stale, or it is in probation: the shell must ask
            if w.probation_left > 0:
                continue  # not a candidate yet (below)
            best = min(best, self._remote_estimate(p, now, 0))  # the smallest call's: every range here for sure
        if best == math.inf or local_arm:
            return math.inf, reason  # nobody to offload to, or the check keeps it all here
        return max(0.0, best / max(self.local_cost_s, 1e-12) - self.local_backlog_pairs), reason

    def _split_reason(self) -> Reason:
        return Reason.SPLIT_CHECK if self.split.checking else Reason.SPLIT_SLOWER

    def _split_observe(self, pairs: int, now: float, out: list[Effect]) -> None:
        if self.state is not LoadState.LOADED or self.config.mode is not DispatchMode.ADAPTIVE:
            return
        if self._in_probation(now):  # a split now would compute every remote range here too
            self.split.suspend(now)
            return
        o = self.split.observe(pairs, now)
        if o is not None:
            out.append(SplitChecked(o, Reason.SPLIT_FASTER if o.arm is SplitArm.SPLIT else Reason.SPLIT_SLOWER))

    def _probe_due(self, w: WorkerHealth, now: float) -> bool:
        """Is this live proven worker due for a probe: loaded, nothing in flight to it, and in
        probation or without a latency sample for ``probe_interval_s``?"""
        if self.state is not LoadState.LOADED or not w.proven or w.in_flight > 0:
            return False
        if w.probation_left > 0:
            return True
        interval = self.config.probe_interval_s
        last = w.attached_at if w.sampled_at is None else w.sampled_at
        return interval > 0 and now - last >= interval

    def _in_probation(self, now: float) -> bool:
        """Is a live proven worker still in probation (every answer of it verified)?"""
        return any(w.proven and w.probation_left > 0 and self.table.is_live(p, now)
                   for p, w in self.table.workers.items())

    def overlap_pays(self, n_pairs: int, now: float, *, not_held: bool = False) -> bool:
        """Do two alternating micro-batches help a step of ``n_pairs`` routed pairs per layer now?
        ``not_held``: the shell's map lists ranges this coordinator does not hold. (See the module rules.)"""
        if not (not_held or self.config.mode is DispatchMode.OFFLOAD):
            return False
        rtts = [w.latency_ewma_ms / 1000.0 for p, w in self.table.workers.items()
                if self.table.is_live(p, now) and w.latency_ewma_ms > 0]
        return bool(rtts) and min(rtts) >= self.config.overlap_min_rtt_s and min(rtts) > n_pairs * self.local_cost_s

    def in_flight(self) -> int:
        return sum(1 for c in self._calls.values() if not c.done)

    def active_steps(self) -> int:
        return len(self._steps)

    # -- the machine -------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Effect]:
        out: list[Effect] = []
        self._last_now = now
        match event:
            case WorkersListed(peers=peers):
                self.table.sync(set(peers), now)
            case LayerReady(layer=layer, ranges=ranges):
                for rw in ranges:
                    self.routed[(layer, rw.lo, rw.hi)] += rw.rows
                self._mode(now, out)
                self._split_observe(sum(rw.pairs for rw in ranges), now, out)
                self._layer_ready(event, now, out)
            case LayerRanLocally(layer=layer, ranges=ranges, reason=reason, compute_s=compute_s):
                for rw in ranges:
                    self.routed[(layer, rw.lo, rw.hi)] += rw.rows
                self.decisions[reason] += len(ranges)
                if layer < len(self.rows):
                    self.rows[layer].local_rows += sum(r.rows for r in ranges)
                pairs = sum(r.pairs for r in ranges)
                if pairs > 0 and compute_s > 0:
                    a = self.config.ewma_alpha
                    self.local_cost_s = (1 - a) * self.local_cost_s + a * compute_s / pairs
                self._mode(now, out)
                self._split_observe(pairs, now, out)
            case RemoteDone(call=cid, wall_ms=wall_ms):
                self._remote_done(cid, wall_ms, now, out)
            case RemoteFailed(call=cid, kind=kind, message=message, wall_ms=wall_ms):
                self._remote_failed(cid, kind, message, wall_ms, now, out)
            case LocalDone(call=cid, compute_s=compute_s):
                self._local_done(cid, compute_s, now, out)
            case LocalFailed(call=cid, message=message):
                self._local_failed(cid, message, now, out)
            case Compared(remote=cid, equal=equal, detail=detail):
                self._compared(cid, equal, detail, now, out)
            case Settled(a=cid):
                self._settled(cid, event, now, out)
            case HoldRefuted(peer=peer, layer=layer, lo=lo, hi=hi, detail=detail):
                self._quarantine(peer, layer, lo, hi, f"layer {layer} experts {lo}-{hi}: {detail}", now, out)
            case TimerFired(timer=timer):
                self._timer(timer, now, out)
            case LoadSample(busy=busy, n_slots=n_slots):
                prev, thr = self.sample, self.config.saturation_threshold
                if prev is not None and prev.busy >= thr and busy < thr:
                    self.load_ended_at = min(now, prev.at + self.config.sample_max_age_s)
                self.sample = _Sample(busy, n_slots, now)
                self._mode(now, out)
            case LoadSampleTimeout():
                self.samples_failed += 1
                self._mode(now, out)
        for e in out:
            r = getattr(e, "reason", None)
            if isinstance(r, Reason) and not isinstance(e, ModeChanged | SplitChecked):
                self.decisions[r] += 1
        return out

    def _mode(self, now: float, out: list[Effect]) -> None:
        new = self.load_state(now)
        if new is self.state:
            return
        reason = {
            LoadState.LOADED: Reason.LOAD_ONSET,
            LoadState.SERVE_TTL: Reason.LOAD_ENDED,
            LoadState.IDLE: Reason.TTL_EXPIRED if self.state is LoadState.SERVE_TTL else Reason.LOAD_ENDED,
        }[new]
        if self.state is LoadState.LOADED:
            self.split.suspend(now)
        self.state = new
        out.append(ModeChanged(new, reason))

    def _new_call(
        self, st: _Step, index: int, peer: str | None, attempt: int, now: float, *, trial: bool = False
    ) -> _Call:
        self._ids += 1
        c = _Call(
            CallId(self._ids),
            st.step,
            st.layer,
            index,
            st.ranges[index].work,
            peer,
            attempt,
            now,
            trial=trial,
        )
        self._calls[c.call] = c
        return c

    def _layer_ready(self, ev: LayerReady, now: float, out: list[Effect]) -> None:
        st = _Step(ev.step, ev.layer, [])
        self._steps[ev.step] = st
        hot = self.hot_experts(ev.layer)
        state = self.state
        c = self.config
        probes = {p for p in {p for w in ev.ranges for p in w.replicas}
                  if self.table.is_live(p, now) and self._probe_due(self.table.workers[p], now)}
        for i, w in enumerate(ev.ranges):
            if st.step not in self._steps:
                break  # an earlier range failed the step (not held, no replica): place nothing more
            self._request_ids += 1
            r = _Range(w, self._request_ids, planned_local=True)
            st.ranges.append(r)
            live = [p for p in w.replicas if self.table.is_live(p, now)]
            proven = [p for p in live if self.table.is_proven(p)]
            if w.held and any(w.lo <= e < w.hi for e in hot):
                self._local(st, i, Reason.HOT_EXPERT, now, out)
            elif c.mode is DispatchMode.OFFLOAD:
                if live:
                    order = self.balanced.choose(list(w.replicas), self.table, now).candidates
                    self._send(st, i, order[0], Reason.OFFLOAD_REMOTE, now, out)
                elif w.held:
                    self._local(st, i, Reason.ALL_DOWN if w.replicas else Reason.NO_REPLICA, now, out)
                elif c.missing_disk:
                    self._local(st, i, Reason.MISSING_DISK, now, out)
                else:
                    self._fail(st, i, Reason.ALL_DOWN if w.replicas else Reason.NO_REPLICA, now, out)
            elif not w.held:
                if live:
                    self._send(st, i, self._best_remote(proven or live, now, w.pairs)[0], Reason.NOT_HELD, now, out)
                elif c.missing_disk:
                    self._local(st, i, Reason.MISSING_DISK, now, out)
                else:
                    self._fail(st, i, Reason.ALL_DOWN if w.replicas else Reason.NO_REPLICA, now, out)
            elif state is LoadState.IDLE:
                self._local(st, i, Reason.IDLE_LOCAL, now, out)
            else:
                trial = next(
                    (p for p in live if not self.table.is_proven(p) and self.table.workers[p].trial_due), None
                )
                if state is LoadState.LOADED and trial is not None:
                    self.table.workers[trial].trial_due = False
                    self._send(st, i, trial, Reason.TRIAL_HEDGE, now, out, trial=True)  # + the local copy
                    continue
                local_finish = (self.local_backlog_pairs + w.pairs) * self.local_cost_s
                local_arm = self.split.arm() is SplitArm.LOCAL
                # in probation every answer is verified (computed here too): no candidate, only probed
                ready = [p for p in proven if self.table.workers[p].probation_left == 0]
                if ready and not local_arm:
                    peer, remote_finish = self._best_remote(ready, now, w.pairs)
                    if remote_finish < local_finish:
                        probes.discard(peer)
                        self._send(
                            st,
                            i,
                            peer,
                            Reason.SERVE_TTL
                            if state is LoadState.SERVE_TTL
                            else Reason.LOAD_EARLIEST_FINISH_REMOTE,
                            now,
                            out,
                        )
                        continue
                probe = min((p for p in proven if p in probes), default=None)
                if probe is not None:  # its estimate is stale: sampled now, the local copy is the result
                    probes.discard(probe)
                    self._send(st, i, probe, Reason.PROBE, now, out, probe=True)
                    continue
                self._local(
                    st,
                    i,
                    self._split_reason() if local_arm
                    else Reason.SERVE_TTL if state is LoadState.SERVE_TTL else Reason.LOAD_EARLIEST_FINISH_LOCAL,
                    now,
                    out,
                )
        if ev.expert_pairs and c.hot_experts > 0:
            counts = self._hot.setdefault(ev.layer, [0.0] * len(ev.expert_pairs))
            for e, n in enumerate(ev.expert_pairs):
                counts[e] = counts[e] * c.hot_decay + n
        self._maybe_combine(st, out)

    def _remote_estimate(self, peer: str, now: float, pairs: float | None = None) -> float:
        """When a call of ``pairs`` routed pairs (None: of the worker's usual size) sent now would
        finish: its own estimate after the calls in flight (each at the usual size)."""
        w = self.table.workers[peer]
        default = self.config.timeout_s / 2
        return (self.table.call_estimate_s(peer, pairs, default)
                + w.in_flight * self.table.call_estimate_s(peer, None, default))

    def _best_remote(self, peers: list[str], now: float, pairs: float | None = None) -> tuple[str, float]:
        """The peer with the earliest estimated finish of a call of ``pairs`` (the map's order
        breaks ties)."""
        best = min(peers, key=lambda p: self._remote_estimate(p, now, pairs))
        return best, self._remote_estimate(best, now, pairs)

    def _hedge_after(self, peer: str) -> float:
        w = self.table.workers.get(peer)
        q = p95(w.latencies_s) if w is not None else None
        return max(self.config.hedge_floor_s, q if q is not None else self.config.timeout_s / 2)

    def _local(
        self,
        st: _Step,
        i: int,
        reason: Reason,
        now: float,
        out: list[Effect],
        *,
        hedge_of: CallId | None = None,
        keep: bool = False,
    ) -> _Call:
        r = st.ranges[i]
        call = self._new_call(st, i, None, -1, now)
        call.verify = keep
        r.pending.add(call.call)
        self.local_backlog_pairs += r.work.pairs
        w = r.work
        if hedge_of is not None:
            out.append(
                Hedge(call.call, st.step, st.layer, i, w.lo, w.hi, None, r.request_id, -1, reason, hedge_of)
            )
        else:
            out.append(RunLocal(call.call, st.step, st.layer, i, w.lo, w.hi, reason, keep))
        return call

    def _sampled(self, peer: str) -> bool:
        """Is this remote call verified? Always in probation, else at ``verify_rate``."""
        w = self.table.workers.get(peer)
        if w is None:
            return False
        if w.probation_left > 0:
            return True
        rate = self.config.verify_rate
        if rate >= 1.0:
            return True
        return rate > 0 and self.rng is not None and self.rng.uniform(0.0, 1.0) < rate

    def _send(
        self,
        st: _Step,
        i: int,
        peer: str,
        reason: Reason,
        now: float,
        out: list[Effect],
        *,
        trial: bool = False,
        probe: bool = False,
        hedge_of: CallId | None = None,
        second_of: _Call | None = None,
    ) -> None:
        r = st.ranges[i]
        r.planned_local = r.planned_local and reason is Reason.TRIAL_HEDGE
        verify = trial or probe or (r.work.held and hedge_of is None and self._sampled(peer))
        second: str | None = None
        if (second_of is None and hedge_of is None and not trial and not r.work.held and r.cross is None
                and self._sampled(peer)):  # not held here: checked on a second replica instead
            second = self._second_replica(r, peer, now)
            if second is None:
                self.unverifiable += 1
        keep = verify or second is not None or second_of is not None
        call = self._new_call(st, i, peer, r.attempts, now, trial=trial)
        call.verify = keep
        r.attempts += 1
        r.tried.add(peer)
        r.pending.add(call.call)
        self.table.started(peer)
        w = r.work
        head = (call.call, st.step, st.layer, i, w.lo, w.hi, peer, r.request_id, call.attempt, reason)
        out.append(Hedge(*head, hedge_of) if hedge_of is not None else SendRemote(*head, keep))
        out.append(StartTimer(Timer(TimerKind.DEADLINE, call.call), now + self.config.timeout_s))
        if self.config.hedge and not keep:
            out.append(StartTimer(Timer(TimerKind.HEDGE, call.call), now + self._hedge_after(peer)))
        if second_of is not None:
            cross = _Cross(second_of, call)
            r.cross = cross
            self._cross[second_of.call] = self._cross[call.call] = cross
        if second is not None:
            self._send(st, i, second, Reason.VERIFY_SECOND, now, out, second_of=call)
        if verify:  # the range's result will be the coordinator's own copy
            r.trusted_only = True
            r.verified = r.verified or not trial
            local = self._local(
                st, i, Reason.TRIAL_HEDGE if trial else Reason.VERIFY, now, out, keep=True
            )
            pair = _Pair(call.call, local.call, peer, st.layer, w.lo, w.hi, trial)
            self._pairs[call.call] = self._pairs[local.call] = pair

    def _second_replica(self, r: _Range, peer: str, now: float) -> str | None:
        """Another live replica of the range for a cross-check (proven ones first, then the earliest
        estimated finish), or None."""
        others = [p for p in r.work.replicas if p != peer and p not in r.tried and self.table.is_live(p, now)]
        if not others:
            return None
        proven = [p for p in others if self.table.is_proven(p)]
        return self._best_remote(proven or others, now, r.work.pairs)[0]

    def _cross_side(self, cross: _Cross, c: _Call, outcome: str, now: float, out: list[Effect]) -> None:
        """One replica of a cross-check ended (``done`` or ``gone``). Both answered: ``Compare`` them.
        One gone: the other's answer is the range's like any unchecked call (now, or when it comes)."""
        if c is cross.a:
            cross.a_side = outcome
        else:
            cross.b_side = outcome
        st = self._steps.get(c.step)
        if st is not None:
            st.ranges[c.index].pending.discard(c.call)  # ended: no longer a call that may still answer
        sides = (cross.a_side, cross.b_side)
        if sides == ("done", "done"):
            self.cross_checks += 1
            w = c.work
            out.append(Compare(cross.a.call, cross.b.call, cross.a.peer or "", c.layer, w.lo, w.hi,
                               peer_b=cross.b.peer))
            return
        if "pending" in sides and outcome == "done":
            return  # wait for the other replica: not the range's result yet
        cross.over = True
        self._drop_cross(cross)
        out.append(Forget((cross.a.call, cross.b.call)))
        if "done" in sides:
            self._win(cross.a if cross.a_side == "done" else cross.b, now, out)

    def _dispute_gone(self, cross: _Cross, out: list[Effect]) -> None:
        """The local copy settling a dispute failed or was cancelled: nothing to settle with, drop the answers."""
        cross.over = True
        self._drop_cross(cross)
        out.append(Forget((cross.a.call, cross.b.call, *((cross.dispute,) if cross.dispute is not None else ()))))

    def _drop_cross(self, cross: _Cross) -> None:
        for cid in (cross.a.call, cross.b.call, cross.dispute):
            if cid is not None and self._cross.get(cid) is cross:
                del self._cross[cid]

    def _cross_compared(self, cross: _Cross, equal: bool, detail: str, now: float, out: list[Effect]) -> None:
        a, b = cross.a, cross.b
        assert a.peer is not None and b.peer is not None
        if equal:
            self.verified_equal += 1
            for peer in (a.peer, b.peer):
                was = self.table.is_proven(peer)
                self.table.verified(peer, True)
                if not was and self.table.is_proven(peer):
                    out.append(MarkProven(peer))
            cross.over = True
            self._drop_cross(cross)
            self._win(a, now, out)
            return
        self.disputes += 1
        st = self._steps.get(a.step)
        if st is None:  # the step ended meanwhile (another range failed): nothing to settle it for
            cross.over = True
            self._drop_cross(cross)
            out.append(Forget((a.call, b.call)))
            return
        r = st.ranges[a.index]
        r.trusted_only = True  # from now on only the coordinator's copy may be the range's result
        local = self._local(st, a.index, Reason.DISPUTE, now, out, keep=True)
        cross.dispute = local.call
        self._cross[local.call] = cross

    def _settled(self, cid: CallId, ev: Settled, now: float, out: list[Effect]) -> None:
        cross = self._cross.get(cid)
        if cross is None or cross.dispute is None:
            self.stale_answers += 1
            return
        cross.over = True
        self._drop_cross(cross)
        w = cross.a.work
        for call, equal, detail in ((cross.a, ev.a_equal, ev.detail_a), (cross.b, ev.b_equal, ev.detail_b)):
            assert call.peer is not None
            if equal:
                self.table.verified(call.peer, True)
            else:
                evidence = (f"layer {call.layer} experts {w.lo}-{w.hi}: {detail or 'outputs differ'} "
                            f"(a second replica disagreed; settled from the coordinator's copy)")
                self._quarantine(call.peer, call.layer, w.lo, w.hi, evidence, now, out)

    def _fail(
        self, st: _Step, i: int, reason: Reason, now: float, out: list[Effect], message: str = ""
    ) -> None:
        r = st.ranges[i]
        r.failed = True
        w = r.work
        text = message or {
            Reason.NO_REPLICA: "no replica listed and the coordinator does not hold these experts",
            Reason.ALL_DOWN: "every listed replica is down and the coordinator does not hold these experts",
        }.get(reason, "every replica failed and the coordinator does not hold these experts")
        out.append(
            Fail(st.step, st.layer, w.lo, w.hi, reason, f"layer {st.layer} experts {w.lo}-{w.hi}: {text}")
        )
        self._end_step(st, out, cancel_reason=Reason.ALL_FAILED)

    def _end_step(self, st: _Step, out: list[Effect], *, cancel_reason: Reason) -> None:
        """Forget the step; cancel what is still pending (a trial's remote call runs on: it proves)."""
        for r in st.ranges:
            for cid in sorted(r.pending):
                c = self._calls[cid]
                if c.verify and c.peer is not None and not r.failed:
                    continue  # a kept remote call runs to its end: it is compared
                self._cancel(c, cancel_reason, out)
            r.pending.clear()
        self._steps.pop(st.step, None)

    def _cancel(self, c: _Call, reason: Reason, out: list[Effect]) -> None:
        if c.done:
            return
        c.done = True
        self._calls.pop(c.call, None)
        out.append(Cancel(c.call, reason))
        self._side(c.call, "gone", out)
        cross = self._cross.get(c.call)
        if cross is not None and not cross.over:
            if c.peer is not None:
                self._cross_side(cross, c, "gone", self._last_now, out)
            elif cross.dispute == c.call:
                self._dispute_gone(cross, out)
        if c.peer is None:
            self.local_backlog_pairs = max(0, self.local_backlog_pairs - c.work.pairs)
        else:
            self.table.finished(c.peer)
            out.append(CancelTimer(Timer(TimerKind.DEADLINE, c.call)))
            out.append(CancelTimer(Timer(TimerKind.HEDGE, c.call)))

    def _maybe_combine(self, st: _Step, out: list[Effect]) -> None:
        if st.step not in self._steps or any(r.winner is None for r in st.ranges):
            return
        counts = self.rows[st.layer] if st.layer < len(self.rows) else LayerRowCounts()
        for r in st.ranges:
            assert r.winner is not None
            if self._winners.pop(r.winner):
                counts.remote_rows += r.work.rows
            elif r.verified:
                counts.verified_rows += r.work.rows
            elif r.planned_local:
                counts.local_rows += r.work.rows
            else:
                counts.fallback_rows += r.work.rows
        out.append(Combine(st.step, st.layer, tuple(r.winner for r in st.ranges if r.winner is not None)))
        self._end_step(st, out, cancel_reason=Reason.LOST_RACE)

    def _win(self, c: _Call, now: float, out: list[Effect]) -> None:
        """``c`` answered: the range's result unless another call won first; losers are cancelled."""
        st = self._steps.get(c.step)
        if st is None:
            return
        r = st.ranges[c.index]
        r.pending.discard(c.call)
        if r.winner is not None or (c.peer is not None and r.trusted_only):
            return  # a kept remote answer is compared, never the range's result
        r.winner = c.call
        self._winners[c.call] = c.peer is not None
        for other in sorted(r.pending):
            o = self._calls.get(other)
            if o is None:
                continue
            if o.verify:  # a kept call runs to its end: its answer is compared
                continue
            if o.peer is not None:
                losses = self.table.lost_hedge(o.peer, now - o.started, o.work.pairs)
                self._sampled_now(o.peer, now)
                self._cancel(o, Reason.LOST_RACE, out)
                if losses >= self.config.max_hedge_losses:
                    self._mark_down(
                        o, FailureKind.SLOW, f"lost {losses} hedges in a row", 0, now, out, record=True
                    )
            else:
                self._cancel(o, Reason.LOST_RACE, out)
        r.pending = {p for p in r.pending if p in self._calls and self._calls[p].verify}
        self._maybe_combine(st, out)

    def _can_win(self, r: _Range, cid: CallId) -> bool:
        """May this pending call still give the range its result?"""
        c = self._calls.get(cid)
        return c is not None and not c.done and (c.peer is None or not r.trusted_only)

    def _side(self, cid: CallId, outcome: str, out: list[Effect]) -> None:
        """One side of a verification ended (``done``: answered, ``gone``: failed or cancelled); once
        both have: ``Compare`` or ``Forget``."""
        pair = self._pairs.get(cid)
        if pair is None:
            return
        if cid == pair.remote:
            pair.remote_side = outcome
        else:
            pair.local_side = outcome
        if "pending" in (pair.remote_side, pair.local_side):
            return
        self._pairs.pop(pair.remote, None)
        self._pairs.pop(pair.local, None)
        if pair.remote_side == pair.local_side == "done":
            self._comparing[pair.remote] = pair
            self.verifications += 1
            out.append(Compare(pair.remote, pair.local, pair.peer, pair.layer, pair.lo, pair.hi))
        else:
            out.append(Forget((pair.remote, pair.local)))

    def _compared(self, cid: CallId, equal: bool, detail: str, now: float, out: list[Effect]) -> None:
        cross = self._cross.get(cid)
        if cross is not None and cid == cross.a.call and not cross.over and cross.dispute is None:
            self._cross_compared(cross, equal, detail, now, out)
            return
        pair = self._comparing.pop(cid, None)
        if pair is None:
            self.stale_answers += 1
            return
        peer = pair.peer
        if equal:
            self.verified_equal += 1
            was = self.table.is_proven(peer)
            self.table.verified(peer, True)
            if not was and self.table.is_proven(peer):
                out.append(MarkProven(peer))
            return
        evidence = f"layer {pair.layer} experts {pair.lo}-{pair.hi}: {detail or 'outputs differ'}"
        self._quarantine(peer, pair.layer, pair.lo, pair.hi, evidence, now, out)

    def _quarantine(self, peer: str, layer: int, lo: int, hi: int, evidence: str, now: float,
                    out: list[Effect]) -> None:
        """Caught lying (a wrong answer or a wrong hold digest): no more work, ever, in this process;
        its calls in flight are abandoned and their ranges recovered."""
        if peer in self.table.quarantined:
            return
        self.quarantines += 1
        self.table.verified(peer, False, evidence)
        self.errors.append(ErrorRecord(now, 0, peer, layer, lo, hi, -1, FailureKind.WRONG_ANSWER, evidence))
        self.errors_total += 1
        self.errors_by_kind[FailureKind.WRONG_ANSWER] += 1
        out.append(Quarantine(peer, layer, lo, hi, evidence))
        for c in sorted((c for c in self._calls.values() if c.peer == peer and not c.done), key=lambda c: c.call):
            self._cancel(c, Reason.QUARANTINED, out)
            st = self._steps.get(c.step)
            if st is None:
                continue
            r = st.ranges[c.index]
            r.pending.discard(c.call)
            if r.winner is None and not r.failed and not any(self._can_win(r, p) for p in r.pending):
                self._recover(st, c.index, now, out)

    def _remote_done(self, cid: CallId, wall_ms: int, now: float, out: list[Effect]) -> None:
        c = self._calls.get(cid)
        if c is None or c.done or c.peer is None:
            self.stale_answers += 1
            return
        c.done = True
        del self._calls[cid]
        self.table.finished(c.peer)
        w = self.table.workers.get(c.peer)
        stale = (w is not None and self.config.probe_interval_s > 0
                 and c.started - (w.attached_at if w.sampled_at is None else w.sampled_at) >= self.config.probe_interval_s)
        self.table.succeeded(c.peer, rows=c.work.rows, latency_s=now - c.started, wall_ms=wall_ms,
                             pairs=c.work.pairs, restart=stale)
        self._sampled_now(c.peer, now)
        out.append(CancelTimer(Timer(TimerKind.DEADLINE, cid)))
        if not c.verify:
            out.append(CancelTimer(Timer(TimerKind.HEDGE, cid)))
        cross = self._cross.get(cid)
        if cross is not None and not cross.over:
            self._cross_side(cross, c, "done", now, out)
        else:
            self._win(c, now, out)
        self._side(cid, "done", out)

    def _sampled_now(self, peer: str, now: float) -> None:
        w = self.table.workers.get(peer)
        if w is not None:
            w.sampled_at = now

    def _mark_down(
        self,
        c: _Call,
        kind: FailureKind,
        message: str,
        wall_ms: int,
        now: float,
        out: list[Effect],
        *,
        record: bool,
    ) -> None:
        assert c.peer is not None
        retry_at = self.table.failed(c.peer, f"{kind.value}: {message}", now)
        out.append(MarkDown(c.peer, kind, message, retry_at))
        if record:
            self._record(c, kind, message, wall_ms, now)

    def _record(self, c: _Call, kind: FailureKind, message: str, wall_ms: int, now: float) -> None:
        self.errors.append(
            ErrorRecord(
                now, wall_ms, c.peer or "local", c.layer, c.work.lo, c.work.hi, c.attempt, kind, message
            )
        )
        self.errors_total += 1
        self.errors_by_kind[kind] += 1

    def _remote_failed(
        self, cid: CallId, kind: FailureKind, message: str, wall_ms: int, now: float, out: list[Effect]
    ) -> None:
        c = self._calls.get(cid)
        if c is None or c.done or c.peer is None:
            self.stale_answers += 1
            return
        c.done = True
        del self._calls[cid]
        self.table.finished(c.peer)
        out.append(CancelTimer(Timer(TimerKind.DEADLINE, cid)))
        if not c.verify:
            out.append(CancelTimer(Timer(TimerKind.HEDGE, cid)))
        self._record(c, kind, message, wall_ms, now)
        self._mark_down(c, kind, message, wall_ms, now, out, record=False)
        self._side(cid, "gone", out)
        cross = self._cross.get(cid)
        if cross is not None and not cross.over:
            self._cross_side(cross, c, "gone", now, out)
        st = self._steps.get(c.step)
        if st is None:
            return
        r = st.ranges[c.index]
        r.pending.discard(cid)
        if r.winner is not None or any(self._can_win(r, p) for p in r.pending):
            return  # another call (a hedge, the verified range's local copy) still runs for it
        self._recover(st, c.index, now, out)

    def _recover(self, st: _Step, i: int, now: float, out: list[Effect]) -> None:
        """A range lost its last call: the next live replica not tried yet, else local, else fail."""
        r = st.ranges[i]
        w = r.work
        untried = [p for p in w.replicas if p not in r.tried and self.table.is_live(p, now)]
        if self.config.mode is DispatchMode.ADAPTIVE and w.held:
            untried = [p for p in untried if self.table.is_proven(p)]
        if untried:
            peer = (
                self.balanced.choose(untried, self.table, now).candidates[0]
                if self.config.mode is DispatchMode.OFFLOAD
                else self._best_remote(untried, now, w.pairs)[0]
            )
            self._send(st, i, peer, Reason.RETRY_NEXT, now, out)
        elif w.held:
            r.planned_local = False
            self._local(st, i, Reason.FALLBACK_LOCAL, now, out)
        elif self.config.missing_disk:
            r.planned_local = False
            self._local(st, i, Reason.MISSING_DISK, now, out)
        else:
            self._fail(st, i, Reason.ALL_FAILED, now, out)

    def _local_done(self, cid: CallId, compute_s: float, now: float, out: list[Effect]) -> None:
        c = self._calls.get(cid)
        if c is None or c.done or c.peer is not None:
            return
        c.done = True
        del self._calls[cid]
        w = c.work
        self.local_backlog_pairs = max(0, self.local_backlog_pairs - w.pairs)
        if w.pairs > 0 and compute_s > 0:
            a = self.config.ewma_alpha
            self.local_cost_s = (1 - a) * self.local_cost_s + a * compute_s / w.pairs
        self._win(c, now, out)
        self._side(cid, "done", out)
        cross = self._cross.get(cid)
        if cross is not None and cross.dispute == cid:
            assert cross.a.peer is not None and cross.b.peer is not None
            out.append(Settle(cross.a.call, cross.b.call, cid, cross.a.peer, cross.b.peer, c.layer, w.lo, w.hi))

    def _local_failed(self, cid: CallId, message: str, now: float, out: list[Effect]) -> None:
        c = self._calls.get(cid)
        if c is None or c.done or c.peer is not None:
            return
        c.done = True
        del self._calls[cid]
        self.local_backlog_pairs = max(0, self.local_backlog_pairs - c.work.pairs)
        self._record(c, FailureKind.LOCAL, message, 0, now)
        self._side(cid, "gone", out)
        cross = self._cross.get(cid)
        if cross is not None and cross.dispute == cid:
            self._dispute_gone(cross, out)
        st = self._steps.get(c.step)
        if st is None:
            return
        r = st.ranges[c.index]
        r.pending.discard(cid)
        if r.winner is None and not any(self._can_win(r, p) for p in r.pending):
            self._fail(st, c.index, Reason.LOCAL_FAILED, now, out, message=f"local experts failed: {message}")

    def _timer(self, timer: Timer, now: float, out: list[Effect]) -> None:
        c = self._calls.get(timer.call)
        if c is None or c.done or c.peer is None:
            return  # the call ended meanwhile: a stale timer
        if timer.kind is TimerKind.DEADLINE:
            self._cancel(c, Reason.DEADLINE, out)
            self._record(c, FailureKind.TIMEOUT, f"no answer within {self.config.timeout_s:g}s", 0, now)
            self._mark_down(
                c,
                FailureKind.TIMEOUT,
                f"no answer within {self.config.timeout_s:g}s",
                0,
                now,
                out,
                record=False,
            )
            st = self._steps.get(c.step)
            if st is None:
                return
            r = st.ranges[c.index]
            r.pending.discard(c.call)
            if r.winner is None and not any(self._can_win(r, p) for p in r.pending):
                self._recover(st, c.index, now, out)
            return
        st = self._steps.get(c.step)
        if st is None:
            return
        r = st.ranges[c.index]
        if r.winner is not None or len(r.pending) > 1:
            return  # already answered, or already raced
        w = r.work
        if w.held:
            r.planned_local = False
            self._local(st, c.index, Reason.HEDGE_SLOW, now, out, hedge_of=c.call)
            return
        others = [p for p in w.replicas if p not in r.tried and self.table.is_live(p, now)]
        if others:
            proven = [p for p in others if self.table.is_proven(p)]
            self._send(
                st,
                c.index,
                self._best_remote(proven or others, now, w.pairs)[0],
                Reason.HEDGE_SLOW,
                now,
                out,
                hedge_of=c.call,
            )
