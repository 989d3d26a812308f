"""The small machines the dispatch core owns, table-driven on their own: one range's placement
(``coordinator.core.placement``), the load state (``coordinator.core.load``), the hot-expert counts
and the verification ledger's sides (``coordinator.core.ledger``)."""

from __future__ import annotations

import pytest

from coordinator.core.events import (
    CallId,
    Compare,
    DispatchConfig,
    DispatchMode,
    Forget,
    LoadState,
    RangeWork,
    Reason,
)
from coordinator.core.ledger import Ledger
from coordinator.core.load import LoadTracker
from coordinator.core.placement import HotExperts, PlaceKind, Placement, PlacementView
from coordinator.core.records import VerifyPair
from coordinator.core.workers import WorkerTable

MS = 1e-3


def table(*peers: str, proven: tuple[str, ...] = (), latency_ms: float = 5.0, probation: int = 0) -> WorkerTable:
    t = WorkerTable(probation_calls=probation)
    t.sync(set(peers), 0.0)
    for p in proven:
        t.succeeded(p, rows=1, latency_s=latency_ms * MS, wall_ms=1)
        t.verified(p, True)
        t.workers[p].probation_left = 0
    return t


def view(state: LoadState, *, cost_ms: float = 1.0, backlog: int = 0, local_arm: bool = False,
         probes: set[str] | None = None, hot: frozenset[int] = frozenset()) -> PlacementView:
    return PlacementView(now=1.0, state=state, hot=hot, local_cost_s=cost_ms * MS, local_backlog_pairs=backlog,
                         local_arm=local_arm, split_reason=Reason.SPLIT_SLOWER, probes=probes or set())


def placement(t: WorkerTable, mode: DispatchMode = DispatchMode.ADAPTIVE, missing_disk: bool = False) -> Placement:
    cfg = DispatchConfig(mode=mode, missing_disk=missing_disk)

    def best(peers: list[str], pairs: float | None) -> tuple[str, float]:
        p = min(peers, key=lambda q: t.call_estimate_s(q, pairs, 1.0))
        return p, t.call_estimate_s(p, pairs, 1.0)

    return Placement(cfg, t, best)


def rw(pairs: int = 4, replicas: tuple[str, ...] = ("a",), held: bool = True, lo: int = 0, hi: int = 4) -> RangeWork:
    return RangeWork(lo, hi, pairs, pairs, replicas, held)


@pytest.mark.parametrize(
    ("case", "work", "state", "mode", "want"),
    [
        ("idle held", rw(), LoadState.IDLE, DispatchMode.ADAPTIVE, (PlaceKind.LOCAL, Reason.IDLE_LOCAL, None)),
        ("not held, proven", rw(held=False), LoadState.IDLE, DispatchMode.ADAPTIVE, (PlaceKind.REMOTE, Reason.NOT_HELD, "a")),
        ("not held, nobody", rw(held=False, replicas=()), LoadState.IDLE, DispatchMode.ADAPTIVE,
         (PlaceKind.FAIL, Reason.NO_REPLICA, None)),
        ("offload", rw(), LoadState.IDLE, DispatchMode.OFFLOAD, (PlaceKind.REMOTE, Reason.OFFLOAD_REMOTE, "a")),
        ("offload, nobody, held", rw(replicas=()), LoadState.IDLE, DispatchMode.OFFLOAD,
         (PlaceKind.LOCAL, Reason.NO_REPLICA, None)),
        # loaded: 4 pairs at 1 ms here (4 ms) against a 5 ms worker: here; 8 pairs (8 ms): there
        ("loaded, local is earlier", rw(4), LoadState.LOADED, DispatchMode.ADAPTIVE,
         (PlaceKind.LOCAL, Reason.LOAD_EARLIEST_FINISH_LOCAL, None)),
        ("loaded, remote is earlier", rw(8), LoadState.LOADED, DispatchMode.ADAPTIVE,
         (PlaceKind.REMOTE, Reason.LOAD_EARLIEST_FINISH_REMOTE, "a")),
        ("serve ttl, remote is earlier", rw(8), LoadState.SERVE_TTL, DispatchMode.ADAPTIVE,
         (PlaceKind.REMOTE, Reason.SERVE_TTL, "a")),
    ],
)
def test_placement(case: str, work: RangeWork, state: LoadState, mode: DispatchMode, want: tuple[object, ...]) -> None:
    p = placement(table("a", proven=("a",)), mode).place(work, view(state))
    assert (p.kind, p.reason, p.peer) == want, case


def test_placement_trials_probes_hot_experts_and_the_split_checks_local_arm() -> None:
    t = table("a", "n", proven=("a",))
    pl = placement(t)
    # an unproven worker due for its trial gets it under load
    p = pl.place(rw(replicas=("a", "n")), view(LoadState.LOADED))
    assert (p.kind, p.reason, p.peer, p.trial) == (PlaceKind.REMOTE, Reason.TRIAL_HEDGE, "n", True)
    t.workers["n"].trial_due = False
    # a probe candidate gets a range earliest finish kept here
    p = pl.place(rw(4), view(LoadState.LOADED, probes={"a"}))
    assert (p.kind, p.reason, p.peer, p.probe) == (PlaceKind.REMOTE, Reason.PROBE, "a", True)
    # the split check's local arm keeps even a range a worker would finish first here
    p = pl.place(rw(8), view(LoadState.LOADED, local_arm=True))
    assert (p.kind, p.reason) == (PlaceKind.LOCAL, Reason.SPLIT_SLOWER)
    # a hot expert in a held range stays here whatever the load
    p = pl.place(rw(8), view(LoadState.LOADED, hot=frozenset({2})))
    assert (p.kind, p.reason) == (PlaceKind.LOCAL, Reason.HOT_EXPERT)
    # the local backlog counts: 4 pairs behind 4 others (8 ms) lose to the 5 ms worker
    p = pl.place(rw(4), view(LoadState.LOADED, backlog=4))
    assert (p.kind, p.reason) == (PlaceKind.REMOTE, Reason.LOAD_EARLIEST_FINISH_REMOTE)


def test_hot_experts_decay_and_rank() -> None:
    h = HotExperts(2, 0.5)
    assert h.of(0) == frozenset()
    h.routed(0, (0, 4, 0, 1))
    h.routed(0, (3, 0, 0, 1))  # expert 1: 4 -> 2, expert 0: 3, expert 3: 0.5 + 1
    assert h.of(0) == frozenset({0, 1})
    assert HotExperts(0, 0.5).of(0) == frozenset()


@pytest.mark.parametrize(
    ("samples", "at", "state"),
    [
        ([], 1.0, LoadState.IDLE),
        ([(3, 0.0)], 1.0, LoadState.LOADED),  # busy 3 >= 2
        ([(3, 0.0)], 7.0, LoadState.SERVE_TTL),  # the loaded sample aged out (6 s): the load is not known to go on
        ([(3, 0.0)], 27.0, LoadState.IDLE),  # ... and the serve TTL (20 s) passed
        ([(3, 0.0), (1, 2.0)], 3.0, LoadState.SERVE_TTL),  # an idle sample ends the load
        ([(3, 0.0), (1, 2.0)], 23.0, LoadState.IDLE),
    ],
)
def test_load_state(samples: list[tuple[int, float]], at: float, state: LoadState) -> None:
    lt = LoadTracker(DispatchConfig())
    for busy, t in samples:
        lt.sampled(busy, 4, t)
    assert lt.load_state(at) is state


def test_load_updates_say_why() -> None:
    lt = LoadTracker(DispatchConfig())
    assert lt.update(0.0) is None
    lt.sampled(3, 4, 0.0)
    assert lt.update(0.5).reason is Reason.LOAD_ONSET  # type: ignore[union-attr]
    lt.sampled(0, 4, 2.0)
    assert lt.update(2.0).reason is Reason.LOAD_ENDED  # type: ignore[union-attr]
    assert lt.update(30.0).reason is Reason.TTL_EXPIRED  # type: ignore[union-attr]
    lt.timed_out()
    assert lt.samples_failed == 1


def test_ledger_sides_compare_or_forget() -> None:
    t = table("a", probation=2)
    led = Ledger(DispatchConfig(verify_rate=0.0, verify_probation_calls=2), t, None)
    assert led.sampled("a")  # in probation: every call
    t.workers["a"].probation_left = 0
    assert not led.sampled("a")  # rate 0 afterwards
    led.pair(VerifyPair(CallId(1), CallId(2), "a", 0, 0, 4, False))
    assert led.side(CallId(1), "done") is None  # the local copy is still running
    assert led.side(CallId(2), "done") == Compare(CallId(1), CallId(2), "a", 0, 0, 4)
    assert led.verifications == 1 and CallId(1) in led.comparing
    led.pair(VerifyPair(CallId(3), CallId(4), "a", 0, 0, 4, False))
    assert led.side(CallId(4), "done") is None
    assert led.side(CallId(3), "gone") == Forget((CallId(3), CallId(4)))
    assert not led.pairs
