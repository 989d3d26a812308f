"""Verification's flow inside the dispatch core (pure; a part of ``DispatchCore``, which inherits it):
comparisons answered, cross-checks between two replicas of a range this coordinator does not hold,
disputes settled from the coordinator's own copy, quarantines (DESIGN §12; the rules are the core's
module docstring, "Verification").

Rules:
- ``_compared``: a sampled call's comparison with the local copy. Equal counts a verified call (the
  first proves the worker); within the tolerance, the error also feeds the worker's drift
  statistics (``Ledger.drifted``); unequal, or drifting, quarantines the worker.
- A cross-check (``Cross``) has two sides; neither answer is the range's until both agree. One side
  gone: the other's answer wins like an unchecked call. Disagreement: the range is computed here
  (DISPUTE), that copy is its result, and whoever differs from it is quarantined (``_settled``).
- ``_quarantine``: no more work for the worker in this process; its calls in flight are cancelled
  and their ranges recovered.
"""

from __future__ import annotations

from collections import Counter, deque

from coordinator.core.events import (
    CallId,
    Compare,
    Effect,
    ErrorRecord,
    FailureKind,
    Forget,
    MarkProven,
    Proof,
    Quarantine,
    Reason,
    Settled,
    StepId,
)
from coordinator.core.ledger import Ledger
from coordinator.core.records import CallRecord, Cross, RangeRecord, StepRecord
from coordinator.core.workers import WorkerTable

__all__ = ["VerificationFlow"]


class VerificationFlow:
    """The verification methods of ``DispatchCore`` (its state, declared here, is the core's)."""

    table: WorkerTable
    ledger: Ledger
    nets: dict[str, str]
    errors: deque[ErrorRecord]
    errors_total: int
    errors_by_kind: Counter[FailureKind]
    stale_answers: int
    _steps: dict[StepId, StepRecord]
    _calls: dict[CallId, CallRecord]

    # the core's own steps (``DispatchCore`` defines them)
    def _best_remote(self, peers: list[str], now: float, pairs: float | None = None) -> tuple[str, float]:
        raise NotImplementedError

    def _local(self, st: StepRecord, i: int, reason: Reason, now: float, out: list[Effect], *,
               hedge_of: CallId | None = None, keep: bool = False, backlog: bool = True) -> CallRecord:
        raise NotImplementedError

    def _cancel(self, c: CallRecord, reason: Reason, out: list[Effect]) -> None:
        raise NotImplementedError

    def _win(self, c: CallRecord, now: float, out: list[Effect]) -> None:
        raise NotImplementedError

    def _can_win(self, r: RangeRecord, cid: CallId) -> bool:
        raise NotImplementedError

    def _recover(self, st: StepRecord, i: int, now: float, out: list[Effect]) -> None:
        raise NotImplementedError

    def _second_replica(self, r: RangeRecord, peer: str, now: float) -> str | None:
        """Another live replica of the range for a cross-check (proven ones first, then the earliest
        estimated finish), or None."""
        net = self.nets.get(peer)
        others = [p for p in r.work.replicas if p != peer and p not in r.tried and self.table.is_live(p, now)
                  and (net is None or self.nets.get(p) != net)]
        if not others:
            return None
        proven = [p for p in others if self.table.is_proven(p)]
        return self._best_remote(proven or others, now, r.work.pairs)[0]

    def _cross_side(self, cross: Cross, c: CallRecord, outcome: str, now: float, out: list[Effect]) -> None:
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
            self.ledger.cross_checks += 1
            w = c.work
            out.append(Compare(cross.a.call, cross.b.call, cross.a.peer or "", c.layer, w.lo, w.hi,
                               peer_b=cross.b.peer))
            return
        if "pending" in sides and outcome == "done":
            return  # wait for the other replica: not the range's result yet
        cross.over = True
        self.ledger.drop(cross)
        out.append(Forget((cross.a.call, cross.b.call)))
        if "done" in sides:
            self._win(cross.a if cross.a_side == "done" else cross.b, now, out)

    def _dispute_gone(self, cross: Cross, out: list[Effect]) -> None:
        """The local copy settling a dispute failed or was cancelled: nothing to settle with, drop the answers."""
        cross.over = True
        self.ledger.drop(cross)
        out.append(Forget((cross.a.call, cross.b.call, *((cross.dispute,) if cross.dispute is not None else ()))))

    def _cross_compared(self, cross: Cross, equal: bool, detail: str, now: float, out: list[Effect]) -> None:
        a, b = cross.a, cross.b
        assert a.peer is not None and b.peer is not None
        if equal:
            self.ledger.verified_equal += 1
            for peer in (a.peer, b.peer):
                was = self.table.is_proven(peer)
                self.table.verified(peer, True)
                if not was and self.table.is_proven(peer):
                    out.append(MarkProven(peer))
            cross.over = True
            self.ledger.drop(cross)
            self._win(a, now, out)
            return
        self.ledger.disputes += 1
        st = self._steps.get(a.step)
        if st is None:  # the step ended meanwhile (another range failed): nothing to settle it for
            cross.over = True
            self.ledger.drop(cross)
            out.append(Forget((a.call, b.call)))
            return
        r = st.ranges[a.index]
        r.trusted_only = True  # from now on only the coordinator's copy may be the range's result
        local = self._local(st, a.index, Reason.DISPUTE, now, out, keep=True)
        cross.dispute = local.call
        self.ledger.cross[local.call] = cross

    def _settled(self, cid: CallId, ev: Settled, now: float, out: list[Effect]) -> None:
        cross = self.ledger.cross.get(cid)
        if cross is None or cross.dispute is None:
            self.stale_answers += 1
            return
        cross.over = True
        self.ledger.drop(cross)
        w = cross.a.work
        for call, equal, detail, proof in ((cross.a, ev.a_equal, ev.detail_a, ev.proof_a),
                                           (cross.b, ev.b_equal, ev.detail_b, ev.proof_b)):
            assert call.peer is not None
            if equal:
                self.table.verified(call.peer, True)
            else:
                evidence = (f"layer {call.layer} experts {w.lo}-{w.hi}: {detail or 'outputs differ'} "
                            f"(a second replica disagreed; settled from the coordinator's copy)")
                self._quarantine(call.peer, call.layer, w.lo, w.hi, evidence, now, out, proof)

    def _compared(self, cid: CallId, equal: bool, detail: str, now: float, out: list[Effect],
                  proof: Proof | None = None, error: float | None = None) -> None:
        cross = self.ledger.cross.get(cid)
        if cross is not None and cid == cross.a.call and not cross.over and cross.dispute is None:
            self._cross_compared(cross, equal, detail, now, out)
            return
        pair = self.ledger.comparing.pop(cid, None)
        if pair is None:
            self.stale_answers += 1
            return
        peer = pair.peer
        if equal and error is not None:  # within the tolerance: is it consistently beyond the honest spread?
            drift = self.ledger.drifted(peer, error)
            if drift is not None:
                self._quarantine(peer, pair.layer, pair.lo, pair.hi, f"layer {pair.layer} experts {pair.lo}-{pair.hi}: "
                                 f"{drift}", now, out, proof)
                return
        if equal:
            self.ledger.verified_equal += 1
            was = self.table.is_proven(peer)
            self.table.verified(peer, True)
            if not was and self.table.is_proven(peer):
                out.append(MarkProven(peer))
            return
        evidence = f"layer {pair.layer} experts {pair.lo}-{pair.hi}: {detail or 'outputs differ'}"
        self._quarantine(peer, pair.layer, pair.lo, pair.hi, evidence, now, out, proof)

    def _quarantine(self, peer: str, layer: int, lo: int, hi: int, evidence: str, now: float,
                    out: list[Effect], proof: Proof | None = None) -> None:
        """Caught lying (a wrong answer or a wrong hold digest): no more work, ever, in this process;
        its calls in flight are abandoned and their ranges recovered."""
        if peer in self.table.quarantined:
            return
        self.ledger.quarantines += 1
        self.table.verified(peer, False, evidence)
        self.errors.append(ErrorRecord(now, 0, peer, layer, lo, hi, -1, FailureKind.WRONG_ANSWER, evidence))
        self.errors_total += 1
        self.errors_by_kind[FailureKind.WRONG_ANSWER] += 1
        out.append(Quarantine(peer, layer, lo, hi, evidence, proof))
        for c in sorted((c for c in self._calls.values() if c.peer == peer and not c.done), key=lambda c: c.call):
            self._cancel(c, Reason.QUARANTINED, out)
            st = self._steps.get(c.step)
            if st is None:
                continue
            r = st.ranges[c.index]
            r.pending.discard(c.call)
            if r.winner is None and not r.failed and not any(self._can_win(r, p) for p in r.pending):
                self._recover(st, c.index, now, out)
