"""Where one range of a layer runs (pure core: no I/O, no clock; ``now`` is given).

``Placement.place(work, view)`` decides a range of a ``LayerReady`` (the core applies it: sends,
computes here or fails the layer); ``HotExperts`` keeps the routing counts the hot-expert rule uses.

Rules, in this order:
- a range holding one of the layer's ``hot_experts`` most-routed experts runs locally (HOT_EXPERT)
  when the coordinator holds it; the partition is never changed, so the bits are not either;
- ``offload`` mode (the pre-adaptive behaviour): a live replica gets it (OFFLOAD_REMOTE, replicas in
  ``BalancedPolicy`` order), else local (NO_REPLICA / ALL_DOWN) when held, else computed from the
  GGUF (MISSING_DISK, with ``missing_disk``) or the layer fails;
- not held: remote only (NOT_HELD), proven replicas first by earliest finish, never a worker in
  probation whose calls could not be checked (no disk checks, no other live replica of another
  network: ``checkable``); no usable replica: MISSING_DISK with ``missing_disk``, else fail
  (NO_REPLICA / ALL_DOWN);
- idle: held ranges run locally (IDLE_LOCAL);
- loaded, a live unproven replica due for its trial: it gets the range *and* the local copy
  computes it (TRIAL_HEDGE);
- otherwise earliest estimated finish among local (its backlog plus these pairs at the measured
  seconds per pair) and each live proven replica out of probation -- unless the split check holds
  every range here (``local_arm``) --: LOAD_EARLIEST_FINISH_REMOTE (SERVE_TTL after the load) when
  a replica finishes strictly earlier; ties go local;
- else a proven worker due for a probe gets the range as a PROBE (the local copy is the result);
- else local: SPLIT_CHECK / SPLIT_SLOWER under the split check's local arm, SERVE_TTL after the
  load, LOAD_EARLIEST_FINISH_LOCAL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from coordinator.core.events import DispatchConfig, DispatchMode, LoadState, RangeWork, Reason
from coordinator.core.workers import BalancedPolicy, WorkerTable

__all__ = ["HotExperts", "Place", "PlaceKind", "Placement", "PlacementView"]


class PlaceKind(StrEnum):
    LOCAL = "local"
    REMOTE = "remote"
    FAIL = "fail"


@dataclass(frozen=True)
class Place:
    kind: PlaceKind
    reason: Reason
    peer: str | None = None
    trial: bool = False  # the worker's first loaded call: sent and computed here
    probe: bool = False  # a stale estimate or probation: sent and computed here


@dataclass(frozen=True)
class PlacementView:
    """What a placement reads of the core's state at one layer."""

    now: float
    state: LoadState
    hot: frozenset[int]
    local_cost_s: float  # seconds per routed pair here
    local_backlog_pairs: int
    local_arm: bool  # the split check keeps every held range here
    split_reason: Reason  # SPLIT_CHECK or SPLIT_SLOWER, while ``local_arm``
    probes: set[str]  # workers due for a probe at this layer (the core removes those it used)


class HotExperts:
    """Routed pairs per expert of each layer, decayed per layer call; the top ``k`` are hot."""

    def __init__(self, k: int, decay: float) -> None:
        self.k, self.decay = k, decay
        self._counts: dict[int, list[float]] = {}

    def of(self, layer: int) -> frozenset[int]:
        """The layer's ``k`` most-routed experts so far (ties: the lower index)."""
        counts = self._counts.get(layer)
        if self.k <= 0 or not counts:
            return frozenset()
        order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        return frozenset(e for e in order[: self.k] if counts[e] > 0)

    def routed(self, layer: int, expert_pairs: tuple[int, ...]) -> None:
        if not expert_pairs or self.k <= 0:
            return
        counts = self._counts.setdefault(layer, [0.0] * len(expert_pairs))
        for e, n in enumerate(expert_pairs):
            counts[e] = counts[e] * self.decay + n


Estimate = Callable[[list[str], float | None], tuple[str, float]]  # (peers, pairs) -> (best, its finish)


class Placement:
    def __init__(self, config: DispatchConfig, table: WorkerTable, best_remote: Estimate,
                 nets: dict[str, str] | None = None) -> None:
        self.config = config
        self.table = table
        self.best_remote = best_remote
        self.nets = nets if nets is not None else {}
        self.balanced = BalancedPolicy()

    def checkable(self, peer: str, w: RangeWork, live: list[str]) -> bool:
        """Can a call of a range not held here to ``peer`` be checked: from disk, or on another live
        replica of another network? A worker in probation that cannot be is not given such a range."""
        if self.config.verify_disk_rate > 0 or self.table.workers[peer].probation_left == 0:
            return True
        net = self.nets.get(peer)
        return any(p != peer and (net is None or self.nets.get(p) != net) for p in live)

    def place(self, w: RangeWork, v: PlacementView) -> Place:
        c, table, now = self.config, self.table, v.now
        live = [p for p in w.replicas if table.is_live(p, now)]
        proven = [p for p in live if table.is_proven(p)]
        none_live = Reason.ALL_DOWN if w.replicas else Reason.NO_REPLICA
        if w.held and any(w.lo <= e < w.hi for e in v.hot):
            return Place(PlaceKind.LOCAL, Reason.HOT_EXPERT)
        if c.mode is DispatchMode.OFFLOAD:
            if live:
                order = self.balanced.choose(list(w.replicas), table, now).candidates
                return Place(PlaceKind.REMOTE, Reason.OFFLOAD_REMOTE, order[0])
            if w.held:
                return Place(PlaceKind.LOCAL, none_live)
            return Place(PlaceKind.LOCAL, Reason.MISSING_DISK) if c.missing_disk else Place(PlaceKind.FAIL, none_live)
        if not w.held:
            usable = [p for p in live if self.checkable(p, w, live)]
            if usable:
                ready = [p for p in usable if table.is_proven(p)]
                return Place(PlaceKind.REMOTE, Reason.NOT_HELD, self.best_remote(ready or usable, w.pairs)[0])
            return Place(PlaceKind.LOCAL, Reason.MISSING_DISK) if c.missing_disk else Place(PlaceKind.FAIL, none_live)
        if v.state is LoadState.IDLE:
            return Place(PlaceKind.LOCAL, Reason.IDLE_LOCAL)
        trial = next((p for p in live if not table.is_proven(p) and table.workers[p].trial_due), None)
        if v.state is LoadState.LOADED and trial is not None:
            return Place(PlaceKind.REMOTE, Reason.TRIAL_HEDGE, trial, trial=True)
        local_finish = (v.local_backlog_pairs + w.pairs) * v.local_cost_s
        # in probation every answer is verified (computed here too): no candidate, only probed
        ready = [p for p in proven if table.workers[p].probation_left == 0]
        if ready and not v.local_arm:
            peer, remote_finish = self.best_remote(ready, w.pairs)
            if remote_finish < local_finish:
                reason = Reason.SERVE_TTL if v.state is LoadState.SERVE_TTL else Reason.LOAD_EARLIEST_FINISH_REMOTE
                return Place(PlaceKind.REMOTE, reason, peer)
        probe = min((p for p in proven if p in v.probes), default=None)
        if probe is not None:  # its estimate is stale: sampled now, the local copy is the result
            return Place(PlaceKind.REMOTE, Reason.PROBE, probe, probe=True)
        return Place(PlaceKind.LOCAL, v.split_reason if v.local_arm
                     else Reason.SERVE_TTL if v.state is LoadState.SERVE_TTL else Reason.LOAD_EARLIEST_FINISH_LOCAL)
