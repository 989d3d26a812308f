"""The verification ledger of the dispatch core (pure core: no I/O, no clock, an injected ``Rng``).

Rules (DESIGN §12):
- ``sampled(peer)``: a remote call is verified always while its worker is in probation (its first
  ``verify_probation_calls`` verified answers after an attach or a failure), else at
  ``verify_rate``, drawn from the rng, so a worker cannot tell sampled calls from others.
- ``disk_sampled``: a call of a range the coordinator does not hold is recomputed from its GGUF on
  disk -- every call while the worker is in probation, then at ``verify_disk_rate`` -- whatever else
  checks it (agreeing replicas could be one party); its copy is the range's result.
- ``drifted``: comparisons within a tolerance (other kernel ids, a 16-bit wire) keep each worker's
  mean relative error; one consistently beyond ``drift_factor`` x the honest spread between kernels
  (``honest_error``) over ``drift_calls`` comparisons is quarantined: lies below the tolerance add up.
- A *pair* is a verified remote call and the coordinator's local copy of the same range. Each side
  ends ``done`` (answered) or ``gone`` (failed, cancelled); once both have, ``side`` answers
  ``Compare`` (both done: the shell compares them and answers ``Compared``) or ``Forget`` (drop the
  kept answers). A kept answer is held exactly until then.
- A *cross-check* (a sampled call of a range the coordinator does not hold) pairs two replicas'
  calls; the core orchestrates it (neither answer is the range's until they agree, a disagreement is
  settled by a local copy); the ledger keeps the records by each call and the dispute's local call.
- Counters for ``/dispatch``: comparisons asked (``verifications``), equal ones, quarantines,
  cross-checks, disputes, and sampled calls that had no second replica (``unverifiable``).
"""

from __future__ import annotations

from coordinator.core.events import CallId, Compare, DispatchConfig, Forget
from coordinator.core.records import Cross, VerifyPair
from coordinator.core.workers import WorkerTable
from swarm.core.rng import Rng

__all__ = ["Ledger"]


class Ledger:
    def __init__(self, config: DispatchConfig, table: WorkerTable, rng: Rng | None) -> None:
        self.config = config
        self.table = table
        self.rng = rng
        self.pairs: dict[CallId, VerifyPair] = {}  # by remote call and by local call
        self.comparing: dict[CallId, VerifyPair] = {}  # Compare sent, Compared not yet in (by remote call)
        self.cross: dict[CallId, Cross] = {}  # by either replica's call and by the dispute's local call
        self.verifications = 0  # comparisons asked for
        self.verified_equal = 0
        self.quarantines = 0
        self.cross_checks = 0  # second-replica comparisons asked for
        self.disputes = 0  # second-replica comparisons that disagreed (settled here)
        self.unverifiable = 0  # sampled calls of ranges not held here with no second live replica
        self.disk_checks = 0  # sampled calls of ranges not held here recomputed from the GGUF on disk
        self.errors: dict[str, tuple[int, float]] = {}  # peer -> (tolerance comparisons, sum of their errors)

    def sampled(self, peer: str) -> bool:
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

    def disk_sampled(self, peer: str) -> bool:
        """Is this call of a range not held here recomputed from disk? Every call while the worker is in
        probation, then at ``verify_disk_rate`` (never when 0) -- whatever else checks it: replicas that
        agree on a lie could be one party."""
        rate = self.config.verify_disk_rate
        w = self.table.workers.get(peer)
        if rate <= 0 or w is None:
            return False
        if w.probation_left > 0 or rate >= 1.0:
            return True
        return self.rng is not None and self.rng.uniform(0.0, 1.0) < rate

    def drifted(self, peer: str, error: float) -> str | None:
        """A comparison within the tolerance had this largest relative error: the evidence, once the
        worker's mean is consistently beyond the honest spread (see the config), else None."""
        n, total = self.errors.get(peer, (0, 0.0))
        n, total = n + 1, total + max(0.0, error)
        self.errors[peer] = (n, total)
        c = self.config
        mean = total / n
        if n >= c.drift_calls and mean > c.drift_factor * c.honest_error:
            return (f"mean relative error {mean:.3g} over {n} comparisons within the tolerance, beyond "
                    f"{c.drift_factor:g} x the honest spread {c.honest_error:.3g} between kernels")
        return None

    def pair(self, p: VerifyPair) -> None:
        self.pairs[p.remote] = self.pairs[p.local] = p

    def side(self, cid: CallId, outcome: str) -> Compare | Forget | None:
        """One side of a verification ended (``done`` or ``gone``); once both have: ``Compare`` or ``Forget``."""
        p = self.pairs.get(cid)
        if p is None:
            return None
        if cid == p.remote:
            p.remote_side = outcome
        else:
            p.local_side = outcome
        if "pending" in (p.remote_side, p.local_side):
            return None
        self.pairs.pop(p.remote, None)
        self.pairs.pop(p.local, None)
        if p.remote_side == p.local_side == "done":
            self.comparing[p.remote] = p
            self.verifications += 1
            return Compare(p.remote, p.local, p.peer, p.layer, p.lo, p.hi, disk=p.disk)
        return Forget((p.remote, p.local))

    def link(self, cross: Cross) -> None:
        self.cross[cross.a.call] = self.cross[cross.b.call] = cross

    def drop(self, cross: Cross) -> None:
        for cid in (cross.a.call, cross.b.call, cross.dispute):
            if cid is not None and self.cross.get(cid) is cross:
                del self.cross[cid]
