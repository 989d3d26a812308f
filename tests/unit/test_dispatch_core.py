"""Pure dispatch core, table-driven: worker health with backoff, static and balanced replica choice, and the
load-adaptive machine (load state, placement by reason, earliest finish, trials, hedges, deadlines, retries,
fallbacks, hot experts, stale answers, row counts)."""

from __future__ import annotations

import math
import random
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.dispatch import (
    BalancedPolicy,
    CallId,
    Cancel,
    CancelTimer,
    ChoiceReason,
    Combine,
    Compare,
    Compared,
    DispatchConfig,
    DispatchCore,
    DispatchMode,
    Effect,
    Fail,
    FailureKind,
    Hedge,
    LayerRanLocally,
    LayerReady,
    LoadSample,
    LoadSampleTimeout,
    LoadState,
    LocalDone,
    LocalFailed,
    MarkDown,
    MarkProven,
    ModeChanged,
    RangeWork,
    Reason,
    RemoteDone,
    RemoteFailed,
    RunLocal,
    SendRemote,
    StartTimer,
    StaticPolicy,
    StepId,
    Timer,
    TimerFired,
    TimerKind,
    WorkersListed,
    WorkerTable,
    p95,
)


def table(*peers: str) -> WorkerTable:
    t = WorkerTable(backoff_base_s=1.0, backoff_max_s=8.0)
    t.sync(set(peers), 0.0)
    return t


def test_sync_attaches_and_detaches() -> None:
    t = table("a", "b")
    assert t.sync({"b", "c"}, 1.0) == ({"c"}, {"a"})
    assert set(t.workers) == {"b", "c"}


@pytest.mark.parametrize(
    ("failures", "live_at", "dead_at"),
    [(1, 1.0, 0.99), (2, 2.0, 1.99), (3, 4.0, 3.99), (5, 8.0, 7.99), (6, 8.0, 7.99)],  # capped at 8 s
)
def test_backoff_doubles_and_caps(failures: int, live_at: float, dead_at: float) -> None:
    t = table("a")
    for _ in range(failures):
        t.failed("a", "boom", 0.0)
    assert not t.is_live("a", dead_at)
    assert t.is_live("a", live_at)
    assert t.views(0.0)[0].retry_in_s == live_at


def test_success_resets_backoff_and_records_stats() -> None:
    t = table("a")
    t.failed("a", "boom", 0.0)
    t.succeeded("a", rows=5, latency_s=0.002, wall_ms=1234)
    t.succeeded("a", rows=3, latency_s=0.004, wall_ms=1300)
    v = t.views(0.0)[0]
    assert (v.state, v.calls, v.rows, v.last_serve_ms, v.failures) == ("up", 2, 8, 1300, 1)
    assert v.latency_ewma_ms == pytest.approx(2.4)
    t.failed("a", "again", 10.0)
    assert t.is_live("a", 11.0)  # consecutive count restarted: 1 s backoff


@pytest.mark.parametrize(
    ("replicas", "down", "expect", "reason"),
    [
        ([], [], (), ChoiceReason.NO_REPLICA),
        (["a", "b"], [], ("a", "b"), ChoiceReason.REMOTE),
        (["a", "b"], ["a"], ("b",), ChoiceReason.REMOTE),
        (["a", "b"], ["a", "b"], (), ChoiceReason.ALL_DOWN),
    ],
)
def test_static_policy(
    replicas: list[str], down: list[str], expect: tuple[str, ...], reason: ChoiceReason
) -> None:
    t = table("a", "b")
    for p in down:
        t.failed(p, "x", 0.0)
    c = StaticPolicy().choose(replicas, t, 0.5)
    assert (c.candidates, c.reason) == (expect, reason)


def test_balanced_policy_trials_new_then_spreads() -> None:
    t = table("old", "new")
    t.succeeded("old", rows=1, latency_s=0.001, wall_ms=1)
    pol = BalancedPolicy()
    # the untried worker gets the first call even though the map lists it second
    assert pol.choose(["old", "new"], t, 0.0).candidates == ("new", "old")
    t.succeeded("new", rows=1, latency_s=0.001, wall_ms=2)
    # equal health: alternate (round robin by picks)
    firsts = [pol.choose(["old", "new"], t, 0.0).candidates[0] for _ in range(5)]
    # picks (old:new) 0:1 -> 1:1 -> 2:1 -> 2:2 -> 3:2 -> 3:3; ties go to the map's order
    assert firsts == ["old", "old", "new", "old", "new"]
    assert t.workers["old"].picks == t.workers["new"].picks == 3
    # a busy worker goes last
    t.started("old")
    assert pol.choose(["old", "new"], t, 0.0).candidates == ("new", "old")
    t.finished("old")
    # a slower worker goes after a faster one
    for _ in range(10):
        t.succeeded("new", rows=1, latency_s=0.050, wall_ms=3)
    assert pol.choose(["old", "new"], t, 0.0).candidates[0] == "old"
    t.failed("old", "x", 0.0)
    c = pol.choose(["old", "new"], t, 0.1)
    assert c.candidates == ("new",) and c.reason is ChoiceReason.REMOTE


# -- the load-adaptive core (DispatchCore): events in, effects out -----------------------------------


MS = 1e-3
E = TypeVar("E")


def core(*peers: str, rng: random.Random | None = None, **kw: object) -> DispatchCore:
    kw.setdefault("local_cost_prior_s", 1 * MS)  # 1 ms per pair: a range of 8 pairs = 8 ms here
    kw.setdefault("verify_rate", 0.0)  # placement tables: no sampling (verification has its own tests)
    kw.setdefault("verify_probation_calls", 0)
    kw.setdefault("split_check_s", 0.0)  # earliest finish alone (the split check has its own tests)
    c = DispatchCore(DispatchConfig(**kw), n_layer=2, n_expert=8, rng=rng)  # type: ignore[arg-type]
    c.handle(WorkersListed(frozenset(peers)), 0.0)
    return c


def rw(lo: int, hi: int, *replicas: str, held: bool = True, pairs: int = 8, rows: int = 8) -> RangeWork:
    return RangeWork(lo, hi, rows, pairs, tuple(replicas), held)


def ready(
    c: DispatchCore,
    now: float,
    *ranges: RangeWork,
    step: int = 1,
    layer: int = 0,
    expert_pairs: tuple[int, ...] = (),
) -> list[Effect]:
    return c.handle(LayerReady(StepId(step), layer, tuple(ranges), expert_pairs), now)


def prove(c: DispatchCore, peer: str, latency_s: float) -> None:
    """``peer`` has answered a call that passed verification (the worker table's record of it)."""
    c.table.succeeded(peer, rows=8, latency_s=latency_s, wall_ms=1)
    c.table.verified(peer, True)


def loaded(c: DispatchCore, now: float = 0.0, busy: int = 4) -> None:
    c.handle(LoadSample(busy, 4), now)
    assert c.load_state(now) is LoadState.LOADED


def placements(effects: list[Effect]) -> list[tuple[str, str | None, Reason]]:
    """(kind, peer, reason) of every placement: local, remote, hedge, fail."""
    out: list[tuple[str, str | None, Reason]] = []
    for e in effects:
        match e:
            case SendRemote(peer=peer, reason=reason):
                out.append(("remote", peer, reason))
            case RunLocal(reason=reason):
                out.append(("local", None, reason))
            case Hedge(peer=peer, reason=reason):
                out.append(("hedge", peer, reason))
            case Fail(reason=reason):
                out.append(("fail", None, reason))
    return out


def only(effects: list[Effect], kind: type[E]) -> list[E]:
    return [e for e in effects if isinstance(e, kind)]


def call_of(effects: list[Effect], kind: type[SendRemote | RunLocal] = SendRemote) -> CallId:
    [e] = only(effects, kind)
    return e.call


@pytest.mark.parametrize(
    ("events", "at", "state"),
    [
        ([], 0.0, LoadState.IDLE),
        ([(0.0, LoadSample(1, 4))], 0.0, LoadState.IDLE),  # below the threshold of 2
        ([(0.0, LoadSample(2, 4))], 0.0, LoadState.LOADED),
        ([(0.0, LoadSample(4, 4))], 5.9, LoadState.LOADED),  # the sample holds ...
        ([(0.0, LoadSample(4, 4))], 6.0, LoadState.LOADED),
        ([(0.0, LoadSample(4, 4))], 6.1, LoadState.SERVE_TTL),  # ... until it ages out (6 s); then the TTL
        ([(0.0, LoadSample(4, 4))], 25.9, LoadState.SERVE_TTL),
        ([(0.0, LoadSample(4, 4))], 26.0, LoadState.IDLE),
        ([(0.0, LoadSample(4, 4)), (2.0, LoadSample(0, 4))], 2.0, LoadState.SERVE_TTL),
        ([(0.0, LoadSample(4, 4)), (2.0, LoadSample(0, 4))], 21.9, LoadState.SERVE_TTL),
        ([(0.0, LoadSample(4, 4)), (2.0, LoadSample(0, 4))], 22.0, LoadState.IDLE),
        # a timed-out sample changes nothing: the last one holds until it ages out
        (
            [(0.0, LoadSample(4, 4)), (2.0, LoadSampleTimeout()), (4.0, LoadSampleTimeout())],
            5.0,
            LoadState.LOADED,
        ),
        ([(0.0, LoadSample(0, 4)), (2.0, LoadSampleTimeout())], 3.0, LoadState.IDLE),
        # an idle sample after the loaded one aged out: the TTL counts from the age-out
        ([(0.0, LoadSample(4, 4)), (10.0, LoadSample(0, 4))], 25.9, LoadState.SERVE_TTL),
        ([(0.0, LoadSample(4, 4)), (10.0, LoadSample(0, 4))], 26.0, LoadState.IDLE),
    ],
)
def test_load_state(
    events: list[tuple[float, LoadSample | LoadSampleTimeout]], at: float, state: LoadState
) -> None:
    c = core()
    for now, ev in events:
        c.handle(ev, now)
    assert c.load_state(at) is state


def test_threshold_and_ttl_are_configurable() -> None:
    c = core(saturation_threshold=4, serve_ttl_s=1.0)
    c.handle(LoadSample(3, 4), 0.0)
    assert c.load_state(0.0) is LoadState.IDLE
    c.handle(LoadSample(4, 4), 1.0)
    c.handle(LoadSample(0, 4), 2.0)
    assert (c.load_state(2.9), c.load_state(3.0)) == (LoadState.SERVE_TTL, LoadState.IDLE)


def test_mode_changes_are_effects_with_reasons() -> None:
    c = core()
    assert c.handle(LoadSample(4, 4), 0.0) == [ModeChanged(LoadState.LOADED, Reason.LOAD_ONSET)]
    assert c.handle(LoadSample(4, 4), 2.0) == []
    assert c.handle(LoadSample(0, 4), 4.0) == [ModeChanged(LoadState.SERVE_TTL, Reason.LOAD_ENDED)]
    assert c.handle(LoadSample(0, 4), 24.0) == [ModeChanged(LoadState.IDLE, Reason.TTL_EXPIRED)]


@pytest.mark.parametrize(
    ("setup", "work", "expect"),
    [
        # idle: held ranges run here, whatever the replicas
        ("idle", rw(0, 4, "p"), [("local", None, Reason.IDLE_LOCAL)]),
        ("idle proven 1ms", rw(0, 4, "p"), [("local", None, Reason.IDLE_LOCAL)]),
        # not held: remote only, or fail
        ("idle", rw(0, 4, "p", held=False), [("remote", "p", Reason.NOT_HELD)]),
        ("loaded", rw(0, 4, "p", held=False), [("remote", "p", Reason.NOT_HELD)]),
        ("idle", rw(0, 4, held=False), [("fail", None, Reason.NO_REPLICA)]),
        ("idle p down", rw(0, 4, "p", held=False), [("fail", None, Reason.ALL_DOWN)]),
        # loaded: the unproven replica's one trial is hedged by the local copy
        ("loaded", rw(0, 4, "p"), [("remote", "p", Reason.TRIAL_HEDGE), ("local", None, Reason.TRIAL_HEDGE)]),
        ("loaded trial spent", rw(0, 4, "p"), [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]),
        ("loaded p down", rw(0, 4, "p"), [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]),
        ("loaded", rw(0, 4), [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]),
        # loaded, proven: earliest estimated finish (8 pairs at 1 ms here vs the replica's EWMA)
        ("loaded proven 5ms", rw(0, 4, "p"), [("remote", "p", Reason.LOAD_EARLIEST_FINISH_REMOTE)]),
        ("loaded proven 9ms", rw(0, 4, "p"), [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]),
        (
            "loaded proven 8ms",
            rw(0, 4, "p"),
            [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)],
        ),  # ties: local
        ("loaded proven 5ms", rw(0, 4, "p", pairs=4), [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]),
        # serve TTL: the same choice, no trials
        ("ttl proven 5ms", rw(0, 4, "p"), [("remote", "p", Reason.SERVE_TTL)]),
        ("ttl", rw(0, 4, "p"), [("local", None, Reason.SERVE_TTL)]),
        # offload mode: remote whenever a replica is live
        ("offload", rw(0, 4, "p"), [("remote", "p", Reason.OFFLOAD_REMOTE)]),
        ("offload", rw(0, 4), [("local", None, Reason.NO_REPLICA)]),
        ("offload p down", rw(0, 4, "p"), [("local", None, Reason.ALL_DOWN)]),
        ("offload p down", rw(0, 4, "p", held=False), [("fail", None, Reason.ALL_DOWN)]),
    ],
)
def test_placement(setup: str, work: RangeWork, expect: list[tuple[str, str | None, Reason]]) -> None:
    words = setup.split()
    c = core("p", mode=DispatchMode.OFFLOAD if "offload" in words else DispatchMode.ADAPTIVE)
    if "proven" in words:
        prove(c, "p", float(words[-1].removesuffix("ms")) * MS)
    if "down" in words:
        c.table.failed("p", "x", 0.0)
    if "spent" in words:
        c.table.workers["p"].trial_due = False
    now = 0.0
    if "loaded" in words:
        loaded(c)
    if "ttl" in words:
        loaded(c)
        c.handle(LoadSample(0, 4), 1.0)
        now = 1.0
    assert placements(ready(c, now, work)) == expect
    # every decision is counted by its reason
    assert sum(c.decisions.values()) == len(expect)


def answered(c: DispatchCore, peer: str, *samples: tuple[int, float]) -> None:
    """``peer`` answered calls of (pairs, latency_s) and passed verification."""
    for pairs, lat in samples:
        c.table.succeeded(peer, rows=pairs, latency_s=lat, wall_ms=1, pairs=pairs)
    c.table.verified(peer, True)


LINE = [(p, (2 + 1.5 * p) * MS) for p in (2, 8) * 4]  # 2 ms a call + 1.5 ms a pair, 8 samples of 2 sizes


@pytest.mark.parametrize(
    ("samples", "slope_ms", "estimates_ms"),
    [
        ([], None, {None: 500.0, 32: 500.0}),  # no sample: the default (half the timeout)
        ([(8, 5 * MS)] * 8, None, {None: 5.0, 2: 5.0, 64: 5.0}),  # one size: size-blind
        ([(8, 5 * MS), (10, 6 * MS)] * 4, None, {None: None, 64: None}),  # sizes too alike to fit: the EWMA
        (LINE[:7], None, {32: None}),  # fewer than 8: size-blind (the EWMA, whatever it is)
        (LINE, 1.5, {32: 2 + 1.5 * 32, 0: None, 1000: 2 + 1.5 * 1000}),  # the line, from the EWMA's size
        ([(p, (9 - p) * MS) for p in (2, 8) * 4], 0.0, {64: None}),  # a negative slope: 0 (bigger is never cheaper)
    ],
)
def test_the_estimate_is_size_aware_once_the_sizes_vary(
    samples: list[tuple[int, float]], slope_ms: float | None, estimates_ms: dict[int | None, float | None]
) -> None:
    t = table("p")
    for pairs, lat in samples:
        t.succeeded("p", rows=pairs, latency_s=lat, wall_ms=1, pairs=pairs)
    b = t.per_pair_s("p")
    assert (b is None) if slope_ms is None else b == pytest.approx(slope_ms * MS)
    [view] = t.views(0.0)  # what /dispatch reports of it
    assert (view.per_pair_ms is None) if b is None else view.per_pair_ms == pytest.approx(b * 1000, abs=1e-4)
    ewma = t.workers["p"].latency_ewma_ms * MS
    for pairs, want in estimates_ms.items():
        got = t.call_estimate_s("p", pairs, 0.5)
        if want is not None:
            assert got == pytest.approx(want * MS)
        elif pairs is not None and b is not None:  # the EWMA moved along the slope, floored at the slope's share
            assert got == pytest.approx(max(ewma + b * (pairs - t.workers["p"].pairs_ewma), b * pairs))
        else:
            assert got == pytest.approx(ewma)


@pytest.mark.parametrize(
    ("pairs", "size_aware", "expect"),
    [
        # a worker slower per pair than here (1.5 vs 1 ms): its decode-sized answers (EWMA ~10 ms) would
        # win a 32-pair range (32 ms here); sized, the call takes ~50 ms: local
        (32, True, ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)),
        (32, False, ("remote", "p", Reason.LOAD_EARLIEST_FINISH_REMOTE)),
        # a 2-pair range: 2 ms here against 5 ms there, either way
        (2, True, ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)),
        # 12 pairs: 12 ms here, 20 ms sized -- but size-blind the EWMA (~10 ms) sends it
        (12, True, ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)),
        (12, False, ("remote", "p", Reason.LOAD_EARLIEST_FINISH_REMOTE)),
    ],
)
def test_earliest_finish_sizes_the_call(pairs: int, size_aware: bool, expect: tuple[str, str | None, Reason]) -> None:
    c = core("p")
    answered(c, "p", *(LINE if size_aware else [(8, 10 * MS)] * 8))
    loaded(c)
    assert placements(ready(c, 0.0, rw(0, 4, "p", pairs=pairs))) == [expect]


def test_earliest_finish_counts_the_local_backlog_and_the_replica_queue() -> None:
    c = core("p")
    prove(c, "p", 5 * MS)
    loaded(c)
    # a: remote 5 ms < local 8; b: remote 10 (one call queued) > local 8; c: local 16 > remote 10
    eff = ready(c, 0.0, rw(0, 2, "p"), rw(2, 4, "p"), rw(4, 6, "p"))
    assert placements(eff) == [
        ("remote", "p", Reason.LOAD_EARLIEST_FINISH_REMOTE),
        ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL),
        ("remote", "p", Reason.LOAD_EARLIEST_FINISH_REMOTE),
    ]


@pytest.mark.parametrize(
    ("setup", "at", "expect"),
    [
        # a proven worker whose one sample (120 ms, a cold start) says local is faster: once no sample
        # has come for probe_interval_s (2 s), its first range is probed -- sent, and computed here too
        ("loaded", 1.9, [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)] * 2),
        ("loaded", 2.0, [("remote", "p", Reason.PROBE), ("local", None, Reason.VERIFY),
                         ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]),
        ("loaded busy", 5.0, [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)] * 2),  # a call in flight
        ("loaded off", 5.0, [("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)] * 2),  # probe_interval_s=0
        ("ttl", 5.0, [("local", None, Reason.SERVE_TTL)] * 2),  # only under load
        ("idle", 5.0, [("local", None, Reason.IDLE_LOCAL)] * 2),
    ],
)
def test_a_stale_estimate_is_probed(setup: str, at: float, expect: list[tuple[str, str | None, Reason]]) -> None:
    c = core("p", probe_interval_s=0.0 if "off" in setup else 2.0)
    prove(c, "p", 120 * MS)
    if "busy" in setup:
        c.table.started("p")
    if "loaded" in setup:
        loaded(c, at)
    elif "ttl" in setup:
        loaded(c, at - 1.0)
        c.handle(LoadSample(0, 4), at)
    max_pairs, _ = c.local_only_pairs(at)
    eff = ready(c, at, rw(0, 4, "p"), rw(4, 8, "p"))
    assert placements(eff) == expect
    probed = any(r is Reason.PROBE for _, _, r in placements(eff))
    assert (max_pairs == 0) == probed  # the shell's fast path asks the core exactly when a probe is due
    if probed:  # kept: compared with the local copy, never cancelled by a hedge timer
        assert only(eff, SendRemote)[0].keep
        assert not any(isinstance(e, StartTimer) and e.timer.kind is TimerKind.HEDGE for e in eff)


def test_a_probe_refreshes_the_estimate_and_the_next_layer_uses_it() -> None:
    c = core("p")
    prove(c, "p", 120 * MS)  # a cold first answer: 120 ms, against 8 ms of local work per range
    loaded(c, 3.0)
    eff = ready(c, 3.0, rw(0, 4, "p"), rw(4, 8, "p"))
    probe = only(eff, SendRemote)[0]
    assert probe.reason is Reason.PROBE
    # another layer before the answer: the probe is in flight, no second one
    assert c.local_only_pairs(3.001)[0] > 0
    assert [r for _, _, r in placements(ready(c, 3.001, rw(0, 4, "p"), step=2, layer=1))] == [
        Reason.LOAD_EARLIEST_FINISH_LOCAL]
    c.handle(RemoteDone(probe.call, 1), 3.05)  # warmer now: 50 ms
    for e in only(eff, RunLocal):
        c.handle(LocalDone(e.call, 0.008), 3.06)
    # the stale estimate is replaced, not blended (0.8 x 120 + 0.2 x 50 would hold on to the cold start)
    assert c.table.workers["p"].latency_ewma_ms == pytest.approx(50.0)
    # not due again for probe_interval_s from the answer
    assert c.local_only_pairs(5.049)[0] > 0
    assert c.local_only_pairs(5.05)[0] == 0
    eff = ready(c, 5.05, rw(0, 4, "p"), step=3)
    [probe] = only(eff, SendRemote)
    assert probe.reason is Reason.PROBE
    c.handle(RemoteDone(probe.call, 1), 5.052)  # 2 ms
    assert c.table.workers["p"].latency_ewma_ms == pytest.approx(2.0)
    # earliest finish now sends the range (no probe needed: it is sampled anyway)
    eff = ready(c, 5.5, rw(0, 4, "p"), step=4)
    assert placements(eff) == [("remote", "p", Reason.LOAD_EARLIEST_FINISH_REMOTE)]


def test_a_worker_in_probation_is_probed_not_given_shares() -> None:
    """In probation every answer is computed here too, so a share sent to it saves nothing: it is no
    candidate of earliest finish (2 ms here against 8 ms of local work), it is probed instead -- one
    range a layer while it has nothing in flight -- and the split check waits until it is through."""
    c = core("p", verify_probation_calls=2, split_check_s=1.0)
    prove(c, "p", 2 * MS)
    c.table.workers["p"].probation_left = 2
    loaded(c)
    assert c.local_only_pairs(0.0)[0] == 0  # a probe is due: the shell asks
    eff = ready(c, 0.0, rw(0, 4, "p"), rw(4, 8, "p"))
    assert placements(eff) == [("remote", "p", Reason.PROBE), ("local", None, Reason.VERIFY),
                               ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL)]
    # its probe in flight: no candidate, no probe -> everything here, even on the fast path
    assert c.local_only_pairs(0.001) == (math.inf, Reason.LOAD_EARLIEST_FINISH_LOCAL)
    assert not c.split.checking  # nothing measured while it is in probation
    for step in (2, 3):
        [send] = only(eff, SendRemote)
        c.handle(RemoteDone(send.call, 1), 0.002)
        for e in only(eff, RunLocal):
            out = c.handle(LocalDone(e.call, 0.008), 0.008)
            for cmp in only(out, Compare):
                c.handle(Compared(cmp.remote, True), 0.009)
        if c.table.workers["p"].probation_left == 0:
            break
        eff = ready(c, 0.01, rw(0, 4, "p"), rw(4, 8, "p"), step=step)
    assert c.table.workers["p"].probation_left == 0
    # through: a candidate again, and the split check starts with the next layer
    eff = ready(c, 0.02, rw(0, 4, "p"), step=9)
    assert c.split.checking and placements(eff) == [("local", None, Reason.SPLIT_CHECK)]


def test_hot_experts_run_locally_and_keep_the_partition() -> None:
    c = core("p", mode=DispatchMode.OFFLOAD, hot_experts=1)
    counts = (0, 1, 0, 0, 0, 9, 0, 0)
    eff = ready(c, 0.0, rw(0, 4, "p"), rw(4, 8, "p"), expert_pairs=counts)
    assert placements(eff) == [("remote", "p", Reason.OFFLOAD_REMOTE)] * 2  # nothing known before this layer
    assert c.hot_experts(0) == {5} and c.hot_experts(1) == frozenset()
    eff = ready(c, 0.0, rw(0, 4, "p"), rw(4, 8, "p"), step=2)
    assert placements(eff) == [("remote", "p", Reason.OFFLOAD_REMOTE), ("local", None, Reason.HOT_EXPERT)]
    # not held: a hot expert cannot run here
    eff = ready(c, 0.0, rw(4, 8, "p", held=False), step=3)
    assert placements(eff) == [("remote", "p", Reason.OFFLOAD_REMOTE)]


@pytest.mark.parametrize(
    ("k", "rounds", "hot"),
    [
        (0, [(5, 1, 0, 0)], set()),
        (1, [(5, 1, 0, 0)], {0}),
        (2, [(5, 1, 0, 0)], {0, 1}),
        (3, [(5, 1, 0, 0)], {0, 1}),  # never-routed experts are not hot
        (1, [(1, 1, 0, 0)], {0}),  # ties: the lower index
        (1, [(10, 0, 0, 0)] + [(0, 1, 0, 0)] * 40, {1}),  # counts decay: the recent routing wins
    ],
)
def test_hot_expert_ranking(k: int, rounds: list[tuple[int, ...]], hot: set[int]) -> None:
    c = DispatchCore(DispatchConfig(hot_experts=k, hot_decay=0.9), n_layer=1, n_expert=4, rng=random.Random(0))
    for i, counts in enumerate(rounds):
        c.handle(LayerReady(StepId(i + 1), 0, (), counts), 0.0)
    assert c.hot_experts(0) == hot


@pytest.mark.parametrize(
    ("samples", "expect"),
    [
        ([], None),
        ([0.01], 0.02),
        ([0.01, 0.03], 0.06),
        ([float(i) for i in range(1, 21)], 19.0),
        ([float(i) for i in range(1, 101)], 95.0),
        ([1.0] * 7 + [9.0], 9.0),
    ],
)
def test_p95(samples: list[float], expect: float | None) -> None:
    assert p95(samples) == expect


def test_remote_call_timers_and_combine() -> None:
    c = core("p", hedge_floor_s=0.05, timeout_s=3.0)
    eff = ready(c, 10.0, rw(0, 4, "p", held=False))
    cid = call_of(eff)
    [send] = only(eff, SendRemote)
    assert (send.request_id, send.attempt, send.lo, send.hi) == (1, 0, 0, 4)
    # the deadline at the timeout; the hedge at half of it with no latency history
    assert set(only(eff, StartTimer)) == {
        StartTimer(Timer(TimerKind.DEADLINE, cid), 13.0),
        StartTimer(Timer(TimerKind.HEDGE, cid), 11.5),
    }
    eff = c.handle(RemoteDone(cid, wall_ms=777), 10.004)
    # a not-held range has no local copy to verify against: the answer is used, it proves nothing
    assert Combine(StepId(1), 0, (cid,)) in eff and MarkProven("p") not in eff
    assert {CancelTimer(Timer(TimerKind.DEADLINE, cid)), CancelTimer(Timer(TimerKind.HEDGE, cid))} <= set(eff)
    v = c.table.views(11.0)[0]
    assert (v.calls, v.last_serve_ms, v.proven) == (1, 777, False) and v.latency_ewma_ms == pytest.approx(4.0)
    assert (c.rows[0].remote_rows, c.rows[0].local_rows, c.in_flight(), c.active_steps()) == (8, 0, 0, 0)
    # a stale timer of the finished call does nothing
    assert c.handle(TimerFired(Timer(TimerKind.HEDGE, cid)), 11.5) == []
    assert c.handle(TimerFired(Timer(TimerKind.DEADLINE, cid)), 13.0) == []


@pytest.mark.parametrize(
    ("latencies_ms", "hedge_at_ms"), [([2.0], 50.0), ([40.0], 80.0), ([10.0] * 20, 50.0), ([60.0] * 20, 60.0)]
)
def test_hedge_timer_is_the_p95_with_a_floor(latencies_ms: list[float], hedge_at_ms: float) -> None:
    c = core("p", hedge_floor_s=0.05)
    for ms in latencies_ms:
        prove(c, "p", ms * MS)
    eff = ready(c, 0.0, rw(0, 4, "p", held=False))
    [hedge] = [t for t in only(eff, StartTimer) if t.timer.kind is TimerKind.HEDGE]
    assert hedge.at == pytest.approx(hedge_at_ms * MS)


def test_hedge_against_local_first_result_wins_and_the_loser_is_cancelled() -> None:
    c = core("p", max_hedge_losses=2)
    prove(c, "p", 2 * MS)
    loaded(c)
    cid = call_of(ready(c, 0.0, rw(0, 4, "p")))
    eff = c.handle(TimerFired(Timer(TimerKind.HEDGE, cid)), 0.05)
    [h] = only(eff, Hedge)
    assert (h.peer, h.reason, h.slow_call) == (None, Reason.HEDGE_SLOW, cid)
    # the local copy answers first: it is the range's result, the remote call is cancelled
    eff = c.handle(LocalDone(h.call, 0.008), 0.058)
    assert Combine(StepId(1), 0, (h.call,)) in eff
    assert Cancel(cid, Reason.LOST_RACE) in eff
    assert c.table.workers["p"].hedge_losses == 1 and c.table.workers["p"].state.value == "up"
    assert c.rows[0].fallback_rows == 8
    # its late answer (if the shell still sees one) changes nothing
    assert c.handle(RemoteDone(cid, 1), 2.0) == [] and c.stale_answers == 1
    # a second lost hedge in a row: marked down as slow, and reported
    cid = call_of(ready(c, 3.0, rw(0, 4, "p", held=False), step=2))
    eff = c.handle(TimerFired(Timer(TimerKind.HEDGE, cid)), 3.1)
    assert only(eff, Hedge) == []  # not held and no other replica: nothing to race with
    c.handle(WorkersListed(frozenset({"p", "q"})), 3.1)
    cid = call_of(ready(c, 4.0, rw(0, 4, "p", "q", held=False), step=3))
    [h] = only(c.handle(TimerFired(Timer(TimerKind.HEDGE, cid)), 4.2), Hedge)
    assert (h.peer, h.attempt, h.request_id) == ("q", 1, 3)
    eff = c.handle(RemoteDone(h.call, 1), 4.21)
    [down] = only(eff, MarkDown)
    assert (down.peer, down.kind) == ("p", FailureKind.SLOW)
    assert [(e.peer, e.kind) for e in c.errors] == [("p", FailureKind.SLOW)]


def test_failure_retries_the_next_replica_then_falls_back_locally() -> None:
    c = core("a", "b", mode=DispatchMode.OFFLOAD)
    cid = call_of(ready(c, 0.0, rw(0, 4, "a", "b")))
    eff = c.handle(RemoteFailed(cid, FailureKind.BROKEN, "stream died", wall_ms=5), 0.01)
    assert placements(eff) == [("remote", "b", Reason.RETRY_NEXT)]
    [down] = only(eff, MarkDown)
    assert (down.peer, down.kind) == ("a", FailureKind.BROKEN) and down.retry_at == pytest.approx(0.51)
    [send] = only(eff, SendRemote)
    assert send.attempt == 1 and send.request_id == 1
    eff = c.handle(RemoteFailed(send.call, FailureKind.PROTOCOL, "NaN", wall_ms=6), 0.02)
    assert placements(eff) == [("local", None, Reason.FALLBACK_LOCAL)]
    eff = c.handle(LocalDone(call_of(eff, RunLocal), 0.008), 0.03)
    assert only(eff, Combine) and c.rows[0].fallback_rows == 8 and c.rows[0].remote_rows == 0
    assert [(e.peer, e.layer, e.lo, e.hi, e.attempt, e.kind, e.wall_ms) for e in c.errors] == [
        ("a", 0, 0, 4, 0, FailureKind.BROKEN, 5),
        ("b", 0, 0, 4, 1, FailureKind.PROTOCOL, 6),
    ]
    assert c.errors_total == 2 and c.errors_by_kind[FailureKind.BROKEN] == 1


def test_adaptive_retry_of_a_held_range_uses_only_proven_replicas() -> None:
    c = core("a", "b")
    prove(c, "a", 1 * MS)
    loaded(c)
    c.table.workers["b"].trial_due = False
    cid = call_of(ready(c, 0.0, rw(0, 4, "a", "b")))
    eff = c.handle(RemoteFailed(cid, FailureKind.REFUSED, "draining"), 0.01)
    assert placements(eff) == [("local", None, Reason.FALLBACK_LOCAL)]  # b is unproven


def test_not_held_and_every_replica_failed_fails_the_layer() -> None:
    c = core("a")
    cid = call_of(ready(c, 0.0, rw(0, 4, "a", held=False), rw(4, 8)))
    eff = c.handle(RemoteFailed(cid, FailureKind.DIAL, "unreachable"), 0.01)
    [fail] = only(eff, Fail)
    assert fail.reason is Reason.ALL_FAILED and "layer 0 experts 0-4" in fail.message
    assert only(eff, Cancel)  # the local range of the failed layer is cancelled
    assert c.active_steps() == 0


def test_deadline_marks_down_and_recovers() -> None:
    c = core("a", "b", mode=DispatchMode.OFFLOAD, timeout_s=1.0, hedge=False)
    eff = ready(c, 0.0, rw(0, 4, "a", "b"))
    cid = call_of(eff)
    assert [t.timer.kind for t in only(eff, StartTimer)] == [TimerKind.DEADLINE]
    eff = c.handle(TimerFired(Timer(TimerKind.DEADLINE, cid)), 1.0)
    assert Cancel(cid, Reason.DEADLINE) in eff
    assert [(d.peer, d.kind) for d in only(eff, MarkDown)] == [("a", FailureKind.TIMEOUT)]
    assert placements(eff) == [("remote", "b", Reason.RETRY_NEXT)]
    # the timed-out call's answer, should it come: stale
    assert c.handle(RemoteDone(cid, 1), 1.5) == [] and c.stale_answers == 1


def test_trial_local_wins_the_step_and_the_remote_answer_is_compared_then_proves() -> None:
    c = core("p")
    loaded(c)
    eff = ready(c, 0.0, rw(0, 4, "p"))
    [send], [run] = only(eff, SendRemote), only(eff, RunLocal)
    remote, local = send.call, run.call
    assert send.keep and run.keep  # both answers kept for the comparison
    assert [t.timer.kind for t in only(eff, StartTimer)] == [TimerKind.DEADLINE]  # no hedge timer
    eff = c.handle(LocalDone(local, 0.008), 0.008)
    assert Combine(StepId(1), 0, (local,)) in eff and only(eff, Cancel) == []  # the trial goes on
    assert c.rows[0].local_rows == 8
    eff = c.handle(RemoteDone(remote, 1), 0.02)
    assert only(eff, Compare) == [Compare(remote, local, "p", 0, 0, 4)] and only(eff, Combine) == []
    assert not c.table.is_proven("p")  # answered, not yet compared
    assert c.handle(Compared(remote, True), 0.021) == [MarkProven("p")]
    assert c.table.is_proven("p") and c.stale_answers == 0 and c.table.workers["p"].verified == 1
    # one trial per attach: after a detach and re-attach it is unproven and due again
    c.handle(WorkersListed(frozenset()), 1.0)
    c.handle(WorkersListed(frozenset({"p"})), 1.0)
    assert not c.table.is_proven("p") and c.table.workers["p"].trial_due


def test_trial_remote_first_never_wins_the_range() -> None:
    c = core("p")
    loaded(c)
    eff = ready(c, 0.0, rw(0, 4, "p"), rw(4, 8, "p"))
    # one trial per worker: the second range is local by earliest finish (p is not proven yet)
    assert placements(eff) == [
        ("remote", "p", Reason.TRIAL_HEDGE),
        ("local", None, Reason.TRIAL_HEDGE),
        ("local", None, Reason.LOAD_EARLIEST_FINISH_LOCAL),
    ]
    remote = call_of(eff, SendRemote)
    local_a, local_b = (e.call for e in only(eff, RunLocal))
    eff = c.handle(RemoteDone(remote, 1), 0.003)  # the remote answer first: kept, not the result
    assert only(eff, Cancel) == [] and only(eff, Combine) == [] and only(eff, Compare) == []
    eff = c.handle(LocalDone(local_b, 0.004), 0.008)
    assert only(eff, Combine) == []
    eff = c.handle(LocalDone(local_a, 0.004), 0.009)
    assert Combine(StepId(1), 0, (local_a, local_b)) in eff and Compare(remote, local_a, "p", 0, 0, 4) in eff
    assert (c.rows[0].remote_rows, c.rows[0].local_rows) == (0, 16)
    assert c.local_backlog_pairs == 0


def test_a_failed_worker_loses_proven_and_gets_a_new_trial() -> None:
    c = core("p")
    prove(c, "p", 1 * MS)
    c.table.failed("p", "boom", 0.0)
    w = c.table.workers["p"]
    assert (w.proven, w.trial_due, c.table.is_live("p", 0.6)) == (False, True, True)


def test_local_failure_fails_the_layer_and_is_reported() -> None:
    c = core()
    cid = call_of(ready(c, 0.0, rw(0, 4)), RunLocal)
    eff = c.handle(LocalFailed(cid, "RuntimeError: boom"), 0.01)
    [fail] = only(eff, Fail)
    assert "boom" in fail.message
    assert [(e.peer, e.kind) for e in c.errors] == [("local", FailureKind.LOCAL)]


def test_a_layer_without_pairs_combines_at_once() -> None:
    assert ready(core(), 0.0) == [Combine(StepId(1), 0, ())]


def test_unknown_answers_are_stale() -> None:
    c = core()
    assert c.handle(RemoteDone(CallId(99), 1), 0.0) == []
    assert c.handle(RemoteFailed(CallId(98), FailureKind.BROKEN, "x"), 0.0) == []
    assert c.handle(LocalDone(CallId(97), 0.1), 0.0) == []
    assert c.stale_answers == 2


def test_a_layer_the_shell_ran_locally_counts_as_its_placements() -> None:
    c = core("p")
    assert c.local_only_pairs(0.0) == (math.inf, Reason.IDLE_LOCAL)
    c.handle(LayerRanLocally(1, (rw(0, 4, "p", rows=3), rw(4, 8, rows=5))), 0.0)
    assert c.decisions == {Reason.IDLE_LOCAL: 2} and c.rows[1].local_rows == 8
    c.handle(LayerRanLocally(1, (rw(0, 4, rows=3, pairs=4),), Reason.LOAD_EARLIEST_FINISH_LOCAL, compute_s=0.008), 0.0)
    assert c.decisions[Reason.LOAD_EARLIEST_FINISH_LOCAL] == 1
    assert c.local_cost_s == pytest.approx(0.8 * MS + 0.2 * 2 * MS)  # 8 ms for 4 pairs into the EWMA
    assert core(hot_experts=1).local_only_pairs(0.0)[0] == 0 and core(mode=DispatchMode.OFFLOAD).local_only_pairs(0.0)[0] == 0


@pytest.mark.parametrize(
    ("setup", "want"),
    [
        ("loaded", (math.inf, Reason.LOAD_EARLIEST_FINISH_LOCAL)),  # nobody to offload to
        ("loaded p", (0.0, Reason.LOAD_EARLIEST_FINISH_LOCAL)),  # its trial is due: ask
        ("loaded p spent", (math.inf, Reason.LOAD_EARLIEST_FINISH_LOCAL)),  # unproven, no trial: not a candidate
        ("loaded p proven 5ms", (5.0, Reason.LOAD_EARLIEST_FINISH_LOCAL)),  # 5 ms / 1 ms a pair
        ("loaded p proven 5ms down", (math.inf, Reason.LOAD_EARLIEST_FINISH_LOCAL)),
        ("ttl p proven 5ms", (5.0, Reason.SERVE_TTL)),
        ("ttl p", (math.inf, Reason.SERVE_TTL)),  # no trials in the serve TTL
    ],
)
def test_local_only_pairs(setup: str, want: tuple[float, Reason]) -> None:
    words = setup.split()
    c = core(*(["p"] if "p" in words else []))
    if "proven" in words:
        prove(c, "p", 5 * MS)
    if "spent" in words:
        c.table.workers["p"].trial_due = False
    if "down" in words:
        c.table.failed("p", "x", 0.0)
    loaded(c)
    if "ttl" in words:
        c.handle(LoadSample(0, 4), 1.0)
    got = c.local_only_pairs(0.4 if "down" in words else 1.0)  # down until its 0.5 s backoff ends
    assert got[1] is want[1] and got[0] == pytest.approx(want[0])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.floats(0.1, 20.0), st.integers(0, 3)),
             min_size=0, max_size=3),
    st.integers(0, 20), st.sampled_from(["loaded", "ttl"]), st.lists(st.integers(1, 12), min_size=1, max_size=4),
)
def test_the_fast_path_size_never_changes_a_placement(
    workers: list[tuple[bool, bool, bool, float, int]], backlog: int, state: str, pairs: list[int]
) -> None:
    """Whenever a layer is within ``local_only_pairs()``, placing it with the core gives only local
    placements of the reported reason: the shell's shortcut decides what the core would (with
    size-blind estimates, and size-aware ones: a worker whose answers came in two sizes)."""
    names = [f"w{i}" for i in range(len(workers))]
    c = core(*names)
    for k, (n, (proven, due, down, ms, in_flight)) in enumerate(zip(names, workers, strict=True)):
        if proven and k % 2:
            answered(c, n, *[(p, (ms + 0.5 * p) * MS) for p in (1, 6) * 4])
        elif proven:
            prove(c, n, ms * MS)
        c.table.workers[n].trial_due = due and not proven
        c.table.workers[n].in_flight = in_flight
        if down:
            c.table.failed(n, "x", 0.0)
    loaded(c)
    if state == "ttl":
        c.handle(LoadSample(0, 4), 0.5)
    c.local_backlog_pairs = backlog
    limit, reason = c.local_only_pairs(0.6)
    if sum(pairs) > limit:
        return
    ranges = tuple(rw(4 * i, 4 * i + 4, *names, pairs=p) for i, p in enumerate(pairs))
    got = placements(c.handle(LayerReady(StepId(1), 0, ranges), 0.6))
    assert got == [("local", None, reason)] * len(pairs)
