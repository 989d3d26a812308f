"""Load-adaptive expert dispatch (pure core: no I/O, no clock; ``now`` is given, DESIGN §5 "layer 1").

Events in, effects out: ``DispatchCore.handle(event, now) -> list[Effect]``. The shell
(``coordinator.dispatch.dispatcher``) reports what happened (a layer's routed pairs are ready, a remote
call answered or failed, a local computation finished, a timer fired, a load sample came in or
timed out) and does what the effects ask (send a call, run the local kernel, cancel a loser,
start or cancel a timer, combine a layer). Every placement carries a ``Reason``; the core counts
them (``decisions``), and keeps the last failures (``errors``) for ``/dispatch``.

The core owns small machines, each with its own rules and tests: the worker table and its
estimates (``coordinator.core.workers``), the load state (``coordinator.core.load``), the placement
of one range (``coordinator.core.placement``, with the hot-expert counts), the verification ledger
(``coordinator.core.ledger``; the flow of comparisons, cross-checks, disputes and quarantines:
``coordinator.core.crosscheck``) and the split check (``coordinator.core.split_check``); its vocabulary
is ``coordinator.core.events``, its in-flight records ``coordinator.core.records``. This module ties
them together: steps, calls, winners, hedges, retries, deadlines, cross-checks.

Rules (the machines' own rules are in their modules):
- Workers: up, down with backoff, quarantined; proven, trial, probation (``coordinator.core.workers``).
- Load: idle / loaded / serve TTL from the shell's samples (``coordinator.core.load``).
- Placement of a layer's ranges (``LayerReady``), in ascending ``lo``, one ``Place`` each
  (``coordinator.core.placement``): hot expert, offload, not held, idle, trial, earliest finish,
  probe, local. The core applies it: a trial's worker is no longer due; a worker probed or given a
  share is no longer a probe candidate at this layer; a failed range fails the whole layer
  (``Fail``: the shell may wait for coverage and retry it) and nothing more of it is placed.
- Verification (DESIGN §12; the ledger, ``coordinator.core.ledger``): a sampled call (and every
  trial and probe) is *kept* (``SendRemote.keep``) and the range is computed here too
  (``RunLocal(keep=True)``, reason VERIFY, TRIAL_HEDGE for a trial): the range's result is always the
  local one, the remote call runs to its end and is never cancelled as a loser, so the step does not
  wait for it. ``Compared(equal)``: equal counts a verified call (the first proves the worker,
  ``MarkProven``); unequal **quarantines** the worker at once (``Quarantine`` with the evidence): its
  calls in flight are abandoned and their ranges recovered (next proven replica, else local). A
  wrong hold digest (``HoldRefuted``) quarantines the same way. A sampled call of a range not held
  here is checked on a second live replica (VERIFY_SECOND): neither answer is the range's until both
  agree; a disagreement is settled by computing it here (DISPUTE, ``Settle``), which is then the
  result, and whoever differs is quarantined; with no second replica the call is served unchecked
  (``unverifiable``).
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
  whole layer (``(backlog + pairs) x seconds per pair``; ties go local). A due trial or probe makes the
  shell ask only once ``ask_interval_s`` has passed since the last ``LayerReady``: between, the layers
  keep the fast path.
- ``Combine(step, calls)`` once every range of the layer has a result: the winning call of each
  range, in ascending ``lo`` (DESIGN §3: the same kernel on the same rows wherever it ran, summed
  in the same order, whoever won).
"""

from __future__ import annotations

import math
from collections import Counter, deque

from coordinator.core.crosscheck import VerificationFlow
from coordinator.core.events import (
    CallId,
    Cancel,
    CancelTimer,
    Combine,
    Compare,
    Compared,
    DispatchConfig,
    DispatchMode,
    Effect,
    ErrorRecord,
    Event,
    Fail,
    FailureKind,
    Forget,
    Hedge,
    HoldRefuted,
    LayerRanLocally,
    LayerReady,
    LayerRowCounts,
    LoadSample,
    LoadSampleTimeout,
    LoadState,
    LocalDone,
    LocalFailed,
    MarkDown,
    MarkProven,
    ModeChanged,
    Quarantine,
    RangeWork,
    Reason,
    RemoteDone,
    RemoteFailed,
    RunLocal,
    SendRemote,
    Settle,
    Settled,
    SplitChecked,
    StartTimer,
    StepId,
    Timer,
    TimerFired,
    TimerKind,
    WorkersListed,
)
from coordinator.core.ledger import Ledger
from coordinator.core.load import LoadSampleRecord, LoadTracker
from coordinator.core.placement import HotExperts, PlaceKind, Placement, PlacementView
from coordinator.core.records import CallRecord, Cross, RangeRecord, StepRecord, VerifyPair
from coordinator.core.split_check import SplitArm, SplitCheck
from coordinator.core.workers import (
    BalancedPolicy,
    Choice,
    ChoiceReason,
    DispatchPolicy,
    StaticPolicy,
    WorkerHealth,
    WorkerState,
    WorkerTable,
    WorkerView,
    p95,
)
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
    "FailureKind",
    "Forget",
    "Hedge",
    "HoldRefuted",
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
    "Settle",
    "Settled",
    "SplitChecked",
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


class DispatchCore(VerificationFlow):
    """The dispatch state machine; ``handle`` is the only way in (queries are read-only)."""

    def __init__(
        self,
        config: DispatchConfig | None = None,
        *,
        n_layer: int = 0,
        n_expert: int = 0,
        rng: Rng | None = None,
    ) -> None:
        """``rng`` draws the verification samples (a seeded ``random.Random``; the shell seeds it at
        random); it may be omitted only when the rate is 0 or 1."""
        config = config if config is not None else DispatchConfig()
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
        self.ledger = Ledger(config, self.table, rng)
        self.load = LoadTracker(config)
        self.hot = HotExperts(config.hot_experts, config.hot_decay)
        self.nets: dict[str, str] = {}  # worker -> its network tag (cross-checks never pair one network)
        self.placement = Placement(config, self.table, lambda peers, pairs: self._best_remote(peers, self._last_now, pairs),
                                   self.nets)
        self.balanced = self.placement.balanced
        self.n_expert = n_expert
        self.decisions: Counter[Reason] = Counter()
        self.errors: deque[ErrorRecord] = deque(maxlen=config.max_errors)
        self.errors_total = 0
        self.errors_by_kind: Counter[FailureKind] = Counter()
        self.stale_answers = 0
        self.rows = [LayerRowCounts() for _ in range(n_layer)]
        self.routed: Counter[tuple[int, int, int]] = Counter()  # (layer, lo, hi) -> rows routed to it, wherever run
        self.local_cost_s = config.local_cost_prior_s  # per (row, expert) pair, EWMA
        self.local_backlog_pairs = 0
        self.split = SplitCheck(window_s=config.split_check_s, hold_s=config.split_hold_s,
                                margin=config.split_margin)
        self._steps: dict[StepId, StepRecord] = {}
        self._calls: dict[CallId, CallRecord] = {}
        self._ids = 0
        self._request_ids = 0
        self._winners: dict[CallId, bool] = {}  # winning call -> answered remotely (until its layer combines)
        self._last_now = 0.0  # the time of the event being handled (for cancels deep in a decision)
        self._asked_at = -math.inf  # the last LayerReady (local_only_pairs: ask_interval_s)

    # -- the machines' state, as the shell's report reads it ------------------------------------------
    @property
    def state(self) -> LoadState:
        return self.load.state

    @property
    def sample(self) -> LoadSampleRecord | None:
        return self.load.sample

    @property
    def samples_failed(self) -> int:
        return self.load.samples_failed

    @property
    def verifications(self) -> int:
        return self.ledger.verifications

    @property
    def verified_equal(self) -> int:
        return self.ledger.verified_equal

    @property
    def quarantines(self) -> int:
        return self.ledger.quarantines

    @property
    def cross_checks(self) -> int:
        return self.ledger.cross_checks

    @property
    def disputes(self) -> int:
        return self.ledger.disputes

    @property
    def unverifiable(self) -> int:
        return self.ledger.unverifiable

    @property
    def _pairs(self) -> dict[CallId, VerifyPair]:
        return self.ledger.pairs

    @property
    def _comparing(self) -> dict[CallId, VerifyPair]:
        return self.ledger.comparing

    @property
    def _cross(self) -> dict[CallId, Cross]:
        return self.ledger.cross

    # -- queries ---------------------------------------------------------------------------------
    def load_state(self, now: float) -> LoadState:
        """idle / loaded / serve_ttl at ``now`` (``coordinator.core.load``)."""
        return self.load.load_state(now)

    def hot_experts(self, layer: int) -> frozenset[int]:
        """The layer's ``hot_experts`` most-routed experts so far (ties: the lower index)."""
        return self.hot.of(layer)

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
        ask = now - self._asked_at >= c.ask_interval_s  # a trial or probe may claim a layer now
        for p, w in self.table.workers.items():
            if not self.table.is_live(p, now):
                continue
            if not w.proven:
                if ask and self.state is LoadState.LOADED and w.trial_due:
                    return 0.0, reason  # its trial is due: the shell must ask
                continue
            if self._probe_due(w, now):
                if ask:
                    return 0.0, reason  # its estimate is stale, or it is in probation: the shell must ask
                continue
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

    def in_flight(self) -> int:
        return sum(1 for c in self._calls.values() if not c.done)

    def active_steps(self) -> int:
        return len(self._steps)

    # -- the machine -------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Effect]:
        out: list[Effect] = []
        self._last_now = now
        match event:
            case WorkersListed(peers=peers, nets=nets):
                self.table.sync(set(peers), now)
                self.nets.clear()
                self.nets.update((p, n) for p, n in nets if n)
            case LayerReady(layer=layer, ranges=ranges):
                self._asked_at = now
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
            case Compared(remote=cid, equal=equal, detail=detail, proof=proof, error=error):
                self._compared(cid, equal, detail, now, out, proof, error)
            case Settled(a=cid):
                self._settled(cid, event, now, out)
            case HoldRefuted(peer=peer, layer=layer, lo=lo, hi=hi, detail=detail, proof=proof):
                self._quarantine(peer, layer, lo, hi, f"layer {layer} experts {lo}-{hi}: {detail}", now, out, proof)
            case TimerFired(timer=timer):
                self._timer(timer, now, out)
            case LoadSample(busy=busy, n_slots=n_slots):
                self.load.sampled(busy, n_slots, now)
                self._mode(now, out)
            case LoadSampleTimeout():
                self.load.timed_out()
                self._mode(now, out)
        for e in out:
            r = getattr(e, "reason", None)
            if isinstance(r, Reason) and not isinstance(e, ModeChanged | SplitChecked):
                self.decisions[r] += 1
        return out

    def _mode(self, now: float, out: list[Effect]) -> None:
        was = self.load.state
        changed = self.load.update(now)
        if changed is None:
            return
        if was is LoadState.LOADED:
            self.split.suspend(now)
        out.append(changed)

    def _new_call(
        self, st: StepRecord, index: int, peer: str | None, attempt: int, now: float, *, trial: bool = False
    ) -> CallRecord:
        self._ids += 1
        c = CallRecord(CallId(self._ids), st.step, st.layer, index, st.ranges[index].work, peer, attempt, now,
                       trial=trial)
        self._calls[c.call] = c
        return c

    def _layer_ready(self, ev: LayerReady, now: float, out: list[Effect]) -> None:
        st = StepRecord(ev.step, ev.layer, [])
        self._steps[ev.step] = st
        probes = {p for p in {p for w in ev.ranges for p in w.replicas}
                  if self.table.is_live(p, now) and self._probe_due(self.table.workers[p], now)}
        local_arm = self.split.arm() is SplitArm.LOCAL
        hot, split_reason = self.hot.of(ev.layer), self._split_reason()
        for i, w in enumerate(ev.ranges):
            if st.step not in self._steps:
                break  # an earlier range failed the step (not held, no replica): place nothing more
            self._request_ids += 1
            st.ranges.append(RangeRecord(w, self._request_ids, planned_local=True))
            # the local backlog grows with every range placed here
            p = self.placement.place(w, PlacementView(
                now=now, state=self.state, hot=hot, local_cost_s=self.local_cost_s,
                local_backlog_pairs=self.local_backlog_pairs, local_arm=local_arm, split_reason=split_reason,
                probes=probes))
            if p.kind is PlaceKind.FAIL:
                self._fail(st, i, p.reason, now, out)
            elif p.kind is PlaceKind.LOCAL:
                self._local(st, i, p.reason, now, out)
            else:
                assert p.peer is not None
                if p.trial:
                    self.table.workers[p.peer].trial_due = False
                probes.discard(p.peer)
                self._send(st, i, p.peer, p.reason, now, out, trial=p.trial, probe=p.probe)
        self.hot.routed(ev.layer, ev.expert_pairs)
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
        st: StepRecord,
        i: int,
        reason: Reason,
        now: float,
        out: list[Effect],
        *,
        hedge_of: CallId | None = None,
        keep: bool = False,
        backlog: bool = True,
    ) -> CallRecord:
        """A local call; ``backlog``: it queues with the engine's local work (not a disk check, which runs apart)."""
        r = st.ranges[i]
        call = self._new_call(st, i, None, -1, now)
        call.verify = keep
        call.backlog = backlog
        r.pending.add(call.call)
        if backlog:
            self.local_backlog_pairs += r.work.pairs
        w = r.work
        if hedge_of is not None:
            out.append(
                Hedge(call.call, st.step, st.layer, i, w.lo, w.hi, None, r.request_id, -1, reason, hedge_of)
            )
        else:
            out.append(RunLocal(call.call, st.step, st.layer, i, w.lo, w.hi, reason, keep))
        return call

    def _send(
        self,
        st: StepRecord,
        i: int,
        peer: str,
        reason: Reason,
        now: float,
        out: list[Effect],
        *,
        trial: bool = False,
        probe: bool = False,
        hedge_of: CallId | None = None,
        second_of: CallRecord | None = None,
    ) -> None:
        r = st.ranges[i]
        led = self.ledger
        r.planned_local = r.planned_local and reason is Reason.TRIAL_HEDGE
        # not held here: recomputed from the GGUF on disk (its copy is the result), or checked on a second replica
        disk = (not r.work.held and second_of is None and hedge_of is None and not trial and r.cross is None
                and led.disk_sampled(peer))
        verify = trial or probe or disk or (r.work.held and hedge_of is None and led.sampled(peer))
        second: str | None = None
        if (second_of is None and hedge_of is None and not trial and not disk and not r.work.held and r.cross is None
                and led.sampled(peer)):
            second = self._second_replica(r, peer, now)
            if second is None:
                led.unverifiable += 1
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
            cross = Cross(second_of, call)
            r.cross = cross
            led.link(cross)
        if second is not None:
            self._send(st, i, second, Reason.VERIFY_SECOND, now, out, second_of=call)
        if verify:  # the range's result will be the coordinator's own copy
            r.trusted_only = True
            r.verified = r.verified or not trial
            if disk:
                led.disk_checks += 1
            local = self._local(st, i, Reason.VERIFY_DISK if disk else Reason.TRIAL_HEDGE if trial else Reason.VERIFY,
                                now, out, keep=True, backlog=not disk)
            led.pair(VerifyPair(call.call, local.call, peer, st.layer, w.lo, w.hi, trial, disk=disk))

    def _fail(
        self, st: StepRecord, i: int, reason: Reason, now: float, out: list[Effect], message: str = ""
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

    def _end_step(self, st: StepRecord, out: list[Effect], *, cancel_reason: Reason) -> None:
        """Forget the step; cancel what is still pending (a trial's remote call runs on: it proves)."""
        for r in st.ranges:
            for cid in sorted(r.pending):
                c = self._calls[cid]
                if c.verify and c.peer is not None and not r.failed:
                    continue  # a kept remote call runs to its end: it is compared
                self._cancel(c, cancel_reason, out)
            r.pending.clear()
        self._steps.pop(st.step, None)

    def _cancel(self, c: CallRecord, reason: Reason, out: list[Effect]) -> None:
        if c.done:
            return
        c.done = True
        self._calls.pop(c.call, None)
        out.append(Cancel(c.call, reason))
        self._side(c.call, "gone", out)
        cross = self.ledger.cross.get(c.call)
        if cross is not None and not cross.over:
            if c.peer is not None:
                self._cross_side(cross, c, "gone", self._last_now, out)
            elif cross.dispute == c.call:
                self._dispute_gone(cross, out)
        if c.peer is None:
            if c.backlog:
                self.local_backlog_pairs = max(0, self.local_backlog_pairs - c.work.pairs)
        else:
            self.table.finished(c.peer)
            out.append(CancelTimer(Timer(TimerKind.DEADLINE, c.call)))
            out.append(CancelTimer(Timer(TimerKind.HEDGE, c.call)))

    def _maybe_combine(self, st: StepRecord, out: list[Effect]) -> None:
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

    def _win(self, c: CallRecord, now: float, out: list[Effect]) -> None:
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

    def _can_win(self, r: RangeRecord, cid: CallId) -> bool:
        """May this pending call still give the range its result?"""
        c = self._calls.get(cid)
        return c is not None and not c.done and (c.peer is None or not r.trusted_only)

    def _side(self, cid: CallId, outcome: str, out: list[Effect]) -> None:
        eff = self.ledger.side(cid, outcome)
        if eff is not None:
            out.append(eff)

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
        cross = self.ledger.cross.get(cid)
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
        c: CallRecord,
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

    def _record(self, c: CallRecord, kind: FailureKind, message: str, wall_ms: int, now: float) -> None:
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
        cross = self.ledger.cross.get(cid)
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

    def _recover(self, st: StepRecord, i: int, now: float, out: list[Effect]) -> None:
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
        if c.backlog:
            self.local_backlog_pairs = max(0, self.local_backlog_pairs - w.pairs)
        if w.pairs > 0 and compute_s > 0 and c.backlog:
            a = self.config.ewma_alpha
            self.local_cost_s = (1 - a) * self.local_cost_s + a * compute_s / w.pairs
        self._win(c, now, out)
        self._side(cid, "done", out)
        cross = self.ledger.cross.get(cid)
        if cross is not None and cross.dispute == cid:
            assert cross.a.peer is not None and cross.b.peer is not None
            out.append(Settle(cross.a.call, cross.b.call, cid, cross.a.peer, cross.b.peer, c.layer, w.lo, w.hi))

    def _local_failed(self, cid: CallId, message: str, now: float, out: list[Effect]) -> None:
        c = self._calls.get(cid)
        if c is None or c.done or c.peer is not None:
            return
        c.done = True
        del self._calls[cid]
        if c.backlog:
            self.local_backlog_pairs = max(0, self.local_backlog_pairs - c.work.pairs)
        self._record(c, FailureKind.LOCAL, message, 0, now)
        self._side(cid, "gone", out)
        cross = self.ledger.cross.get(cid)
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
