"""Verification in the pure dispatch core (DESIGN §12): sampling (probation at rate 1.0, then
``verify_rate``), the coordinator's copy as the range's result, Compare/Forget exactly once per kept
pair, quarantine at the first unequal answer (sticky across re-listing, calls in flight abandoned and
recovered), and a randomized property over whole event histories."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.dispatch import (
    CallId,
    Cancel,
    Combine,
    Compare,
    Compared,
    DispatchCore,
    DispatchMode,
    Effect,
    Fail,
    FailureKind,
    Forget,
    HoldRefuted,
    LayerReady,
    LocalDone,
    LocalFailed,
    MarkDown,
    MarkProven,
    Quarantine,
    Reason,
    RemoteDone,
    RemoteFailed,
    RunLocal,
    SendRemote,
    Settle,
    Settled,
    StepId,
    Timer,
    TimerFired,
    TimerKind,
    WorkersListed,
    WorkerState,
)
from tests.unit.test_dispatch_core import MS, call_of, core, loaded, only, placements, prove, ready, rw


def remote_placement(c: DispatchCore, now: float, step: int, *, peer: str = "p") -> list[Effect]:
    """A loaded layer of one range where the proven ``peer`` is the earlier finish (8 pairs at 1 ms
    locally vs its 1 ms EWMA)."""
    return ready(c, now, rw(0, 4, peer), step=step)


def test_probation_verifies_every_call_then_the_rate_takes_over() -> None:
    c = core("p", verify_probation_calls=3, verify_rate=0.0)
    prove(c, "p", 1 * MS)  # proven, probation still 3 (prove() does not count it)
    c.table.workers["p"].probation_left = 3
    loaded(c)
    for step in range(1, 4):
        eff = remote_placement(c, 0.0, step)
        # in probation: no candidate of earliest finish (its share would be computed here anyway), probed instead
        assert placements(eff) == [("remote", "p", Reason.PROBE), ("local", None, Reason.VERIFY)]
        [send], [run] = only(eff, SendRemote), only(eff, RunLocal)
        assert send.keep and run.keep
        eff = c.handle(RemoteDone(send.call, 1), 0.001)
        assert only(eff, Combine) == []  # a kept remote answer is never the range's result
        eff = c.handle(LocalDone(run.call, 0.008), 0.008)
        assert Combine(StepId(step), 0, (run.call,)) in eff
        assert only(eff, Compare) == [Compare(send.call, run.call, "p", 0, 0, 4)]
        assert c.handle(Compared(send.call, True), 0.009) == []  # already proven: nothing to mark
    assert c.table.workers["p"].probation_left == 0 and c.table.workers["p"].verified == 4
    assert c.rows[0].verified_rows == 24 and c.rows[0].remote_rows == 0
    eff = remote_placement(c, 1.0, 9)
    [send] = only(eff, SendRemote)
    assert not send.keep and only(eff, RunLocal) == []  # out of probation at rate 0: not sampled
    eff = c.handle(RemoteDone(send.call, 1), 1.001)
    assert Combine(StepId(9), 0, (send.call,)) in eff and c.rows[0].remote_rows == 8


def test_after_probation_calls_are_sampled_at_the_rate() -> None:
    c = core("p", verify_probation_calls=0, verify_rate=0.25, rng=random.Random(7))
    prove(c, "p", 1 * MS)
    loaded(c)
    sampled = 0
    n = 4000
    for step in range(1, n + 1):
        eff = remote_placement(c, 0.0, step)
        [send] = only(eff, SendRemote)
        locals_ = only(eff, RunLocal)
        sampled += send.keep
        eff = c.handle(RemoteDone(send.call, 1), 0.0)
        for r in locals_:
            eff += c.handle(LocalDone(r.call, 0.008), 0.0)
        for cmp in only(eff, Compare):
            c.handle(Compared(cmp.remote, True), 0.0)
        assert c.active_steps() == 0 and c.in_flight() == 0
    assert 0.22 < sampled / n < 0.28


def test_an_unequal_answer_quarantines_at_once_and_for_good() -> None:
    c = core("p", "q", verify_probation_calls=50, verify_rate=0.05, rng=random.Random(1))
    loaded(c)
    eff = ready(c, 0.0, rw(0, 4, "p"))  # p's trial
    send, run = only(eff, SendRemote)[0], only(eff, RunLocal)[0]
    c.handle(LocalDone(run.call, 0.008), 0.008)
    [cmp] = only(c.handle(RemoteDone(send.call, 1), 0.01), Compare)
    eff = c.handle(Compared(cmp.remote, False, "max |diff| 1.5 at pair 3"), 0.011)
    [q] = only(eff, Quarantine)
    assert (q.peer, q.layer, q.lo, q.hi) == ("p", 0, 0, 4) and "1.5" in q.evidence
    assert MarkProven("p") not in eff
    w = c.table.workers["p"]
    assert w.state is WorkerState.QUARANTINED and not w.proven and not c.table.is_live("p", 1e9)
    assert [e.kind for e in c.errors] == [FailureKind.WRONG_ANSWER] and c.quarantines == 1
    assert c.table.views(1.0)[0].quarantine == q.evidence
    # never placed again, not even after a failure, a success or a detach and re-listing
    c.table.failed("p", "x", 1.0)
    c.table.succeeded("p", rows=1, latency_s=0.001, wall_ms=1)
    c.handle(WorkersListed(frozenset({"q"})), 2.0)
    c.handle(WorkersListed(frozenset({"p", "q"})), 2.0)
    assert c.table.workers["p"].state is WorkerState.QUARANTINED
    assert all(p != "p" for _, p, _ in placements(ready(c, 3.0, rw(0, 4, "p", "q"), step=2)))


def test_quarantine_abandons_the_workers_calls_in_flight_and_recovers_their_ranges() -> None:
    c = core("p", verify_probation_calls=0, verify_rate=0.0)
    prove(c, "p", 1 * MS)
    loaded(c)
    # a sampled call (forced: probation of one) and, in another step, an unsampled one in flight
    c.table.workers["p"].probation_left = 1
    eff1 = remote_placement(c, 0.0, 1)
    s1, l1 = only(eff1, SendRemote)[0], only(eff1, RunLocal)[0]
    c.table.workers["p"].probation_left = 0
    eff2 = remote_placement(c, 0.0, 2)
    [s2] = only(eff2, SendRemote)
    assert s1.keep and not s2.keep
    c.handle(RemoteDone(s1.call, 1), 0.001)
    [cmp] = only(c.handle(LocalDone(l1.call, 0.008), 0.008), Compare)
    eff = c.handle(Compared(cmp.remote, False, "zeros"), 0.009)
    assert Cancel(s2.call, Reason.QUARANTINED) in eff
    assert ("local", None, Reason.FALLBACK_LOCAL) in placements(eff)  # step 2 recovers here
    [fb] = only(eff, RunLocal)
    eff = c.handle(LocalDone(fb.call, 0.008), 0.02)
    assert Combine(StepId(2), 0, (fb.call,)) in eff
    assert c.handle(RemoteDone(s2.call, 1), 0.03) == [] and c.stale_answers == 1  # its late answer: dropped


def test_a_refuted_hold_quarantines_like_a_wrong_answer_and_recovers_calls_in_flight() -> None:
    c = core("p", verify_probation_calls=0, verify_rate=0.0)
    prove(c, "p", 1 * MS)
    loaded(c)
    [s] = only(remote_placement(c, 0.0, 1), SendRemote)
    eff = c.handle(HoldRefuted("p", 1, 0, 4, "hold digest 00 is not ab"), 0.001)
    [q] = only(eff, Quarantine)
    assert (q.peer, q.layer, q.lo, q.hi) == ("p", 1, 0, 4) and "hold digest" in q.evidence
    assert Cancel(s.call, Reason.QUARANTINED) in eff
    assert ("local", None, Reason.FALLBACK_LOCAL) in placements(eff)
    assert c.table.workers["p"].state is WorkerState.QUARANTINED and c.quarantines == 1
    assert [e.kind for e in c.errors] == [FailureKind.WRONG_ANSWER]
    assert only(c.handle(HoldRefuted("p", 1, 4, 8, "again"), 0.002), Quarantine) == [] and c.quarantines == 1


def test_a_failed_kept_call_is_forgotten_not_compared_and_restarts_probation() -> None:
    c = core("p", verify_probation_calls=2, verify_rate=0.0)
    prove(c, "p", 1 * MS)
    c.table.workers["p"].probation_left = 1
    loaded(c)
    eff = remote_placement(c, 0.0, 1)
    s, r = only(eff, SendRemote)[0], only(eff, RunLocal)[0]
    eff = c.handle(RemoteFailed(s.call, FailureKind.BROKEN, "reset"), 0.001)
    assert only(eff, MarkDown) and only(eff, Forget) == [] and placements(eff) == []  # the local copy runs on
    eff = c.handle(LocalDone(r.call, 0.008), 0.008)
    assert Combine(StepId(1), 0, (r.call,)) in eff and only(eff, Forget) == [Forget((s.call, r.call))]
    assert c.table.workers["p"].probation_left == 2  # rate 1.0 again after any failure


def test_a_kept_call_past_its_deadline_is_forgotten() -> None:
    c = core("p", verify_probation_calls=1, timeout_s=1.0)
    loaded(c)
    eff = ready(c, 0.0, rw(0, 4, "p"))  # the trial
    s, r = only(eff, SendRemote)[0], only(eff, RunLocal)[0]
    c.handle(LocalDone(r.call, 0.008), 0.008)
    eff = c.handle(TimerFired(Timer(TimerKind.DEADLINE, s.call)), 1.0)
    assert Cancel(s.call, Reason.DEADLINE) in eff and Forget((s.call, r.call)) in eff
    assert not c.table.is_proven("p")


def test_local_failure_of_a_verified_range_fails_the_layer_instead_of_using_the_remote_answer() -> None:
    c = core("p")
    loaded(c)
    eff = ready(c, 0.0, rw(0, 4, "p"))  # the trial: only the local copy may give the result
    s, r = only(eff, SendRemote)[0], only(eff, RunLocal)[0]
    c.handle(RemoteDone(s.call, 1), 0.001)
    eff = c.handle(LocalFailed(r.call, "boom"), 0.002)
    assert only(eff, Fail) and Forget((s.call, r.call)) in eff and only(eff, Combine) == []


def test_offload_mode_verifies_too_and_not_held_ranges_cannot_be() -> None:
    c = core("p", mode=DispatchMode.OFFLOAD, verify_probation_calls=5)
    eff = ready(c, 0.0, rw(0, 4, "p"))
    assert placements(eff) == [("remote", "p", Reason.OFFLOAD_REMOTE), ("local", None, Reason.VERIFY)]
    eff = ready(c, 0.0, rw(0, 4, "p", held=False), step=2)
    assert placements(eff) == [("remote", "p", Reason.OFFLOAD_REMOTE)] and not only(eff, SendRemote)[0].keep


def test_a_stale_comparison_changes_nothing() -> None:
    c = core("p")
    assert c.handle(Compared(CallId(42), False, "?"), 0.0) == [] and c.stale_answers == 1
    assert c.table.workers["p"].state is WorkerState.UP


# -- a property over whole histories ------------------------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_steps=st.integers(1, 6),
    mode=st.sampled_from([DispatchMode.ADAPTIVE, DispatchMode.OFFLOAD]),
    rate=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_every_kept_pair_ends_in_exactly_one_compare_or_forget(
    seed: int, n_steps: int, mode: DispatchMode, rate: float
) -> None:
    """Random layers over two workers, held here or not, their calls answered, failed, timed out,
    compared (equal or not) and disputes settled in random order: every step combines or fails exactly
    once, a held range whose calls include a kept one combines only a local call, a not-held range whose
    replicas disagreed combines only the coordinator's copy, every kept call is named by exactly one
    Compare (an agreed or a held one), Settle or Forget, and at the end nothing is pending."""
    rnd = random.Random(seed)
    c = core("p", "q", mode=mode, verify_probation_calls=rnd.choice([0, 2]), verify_rate=rate, timeout_s=1.0,
             rng=random.Random(seed))
    loaded(c)
    for p in ("p", "q"):
        if rnd.random() < 0.7:
            prove(c, p, 1 * MS)
    now = 0.0
    kept: set[CallId] = set()
    local_calls: set[CallId] = set()
    trusted_steps: dict[StepId, set[int]] = {}
    held_of: dict[tuple[StepId, int], bool] = {}
    named: list[CallId] = []
    ended: list[StepId] = []
    todo: list[Effect] = []
    for step in range(1, n_steps + 1):
        ranges = [rw(lo, hi, *rnd.sample(["p", "q"], rnd.randint(0, 2)), held=rnd.random() < 0.6)
                  for lo, hi in ((0, 4), (4, 8))]
        for i, r in enumerate(ranges):
            held_of[(StepId(step), i)] = r.held
        todo += c.handle(LayerReady(StepId(step), 0, tuple(ranges)), now)
    pending_compares: list[tuple[CallId, CallId, bool]] = []  # (a, b, cross-check)
    pending_settles: list[tuple[CallId, CallId, CallId]] = []
    live: dict[CallId, Effect] = {}

    def absorb(effs: list[Effect]) -> None:
        for e in effs:
            match e:
                case SendRemote() | RunLocal():
                    live[e.call] = e
                    if e.keep:
                        kept.add(e.call)
                        if held_of[(e.step, e.index)] or (isinstance(e, RunLocal) and e.reason is Reason.DISPUTE):
                            trusted_steps.setdefault(e.step, set()).add(e.index)
                    if isinstance(e, RunLocal):
                        local_calls.add(e.call)
                case Cancel(call=cid):
                    live.pop(cid, None)
                case Compare(remote=r, local=loc, peer_b=pb):
                    pending_compares.append((r, loc, pb is not None))
                case Settle(a=a, b=b, local=loc):
                    pending_settles.append((a, b, loc))
                case Forget(calls=cs):
                    named.extend(cs)
                case Combine(step=s, calls=calls):
                    ended.append(s)
                    for i, cid in enumerate(calls):
                        if i in trusted_steps.get(s, set()):
                            assert cid in local_calls
                case Fail(step=s):
                    ended.append(s)
                case _:
                    pass

    absorb(todo)
    for _ in range(500):
        if not live and not pending_compares and not pending_settles:
            break
        now += 0.01
        if pending_settles and (not live or rnd.random() < 0.3):
            a, b, loc = pending_settles.pop(rnd.randrange(len(pending_settles)))
            named.extend([a, b, loc])
            absorb(c.handle(Settled(a, rnd.random() < 0.5, rnd.random() < 0.5), now))
            continue
        if pending_compares and (not live or rnd.random() < 0.3):
            r, loc, cross = pending_compares.pop(rnd.randrange(len(pending_compares)))
            equal = rnd.random() < 0.8
            if equal or not cross:  # a disagreement of two replicas is named again by its Settle
                named.extend([r, loc])
            absorb(c.handle(Compared(r, equal, "d"), now))
            continue
        cid = rnd.choice(sorted(live))
        e = live.pop(cid)
        roll = rnd.random()
        if isinstance(e, RunLocal):
            absorb(c.handle(LocalDone(cid, 0.001) if roll < 0.95 else LocalFailed(cid, "x"), now))
        elif roll < 0.7:
            absorb(c.handle(RemoteDone(cid, 1), now))
        elif roll < 0.85:
            absorb(c.handle(RemoteFailed(cid, FailureKind.BROKEN, "x"), now))
        else:
            absorb(c.handle(TimerFired(Timer(TimerKind.DEADLINE, cid)), now))
    assert not live and not pending_compares and not pending_settles
    assert sorted(ended) == list(range(1, n_steps + 1))  # each step once
    assert sorted(named) == sorted(kept)  # each kept call named exactly once
    assert c.active_steps() == 0 and c.in_flight() == 0 and not c._pairs and not c._comparing and not c._cross


def test_a_cross_check_never_pairs_two_workers_of_one_network() -> None:
    """A sampled call of a range not held here goes to a second replica for a check -- never one the
    market tags with the same network (one party could run both)."""
    for nets, second in (((("p", "n1"), ("q", "n1")), None), ((("p", "n1"), ("q", "n2")), "q"), ((), "q")):
        c = core("p", "q", verify_rate=1.0)
        c.handle(WorkersListed(frozenset({"p", "q"}), nets), 0.0)
        prove(c, "p", 5 * MS)
        prove(c, "q", 50 * MS)  # slower: the first call goes to p
        effects = ready(c, 0.1, rw(0, 4, "p", "q", held=False))
        sends = [(e.peer, e.reason) for e in only(effects, SendRemote)]
        assert sends[0] == ("p", Reason.NOT_HELD)
        assert [p for p, r in sends if r is Reason.VERIFY_SECOND] == ([second] if second else []), nets
        assert c.unverifiable == (0 if second else 1)


def test_in_probation_a_range_not_held_here_is_checked_from_disk_and_that_copy_is_its_result() -> None:
    c = core("p", verify_probation_calls=3, verify_disk_rate=0.01)
    prove(c, "p", 5 * MS)
    c.table.workers["p"].probation_left = 3
    effects = ready(c, 0.1, rw(0, 4, "p", held=False))
    assert [r for _, _, r in placements(effects)] == [Reason.NOT_HELD, Reason.VERIFY_DISK]
    remote, disk = call_of(effects), call_of(effects, RunLocal)
    assert not only(c.handle(RemoteDone(remote, 1), 0.2), Combine)  # the remote answer alone is not the result
    out = c.handle(LocalDone(disk, 0.0), 0.3)
    [comb] = only(out, Combine)
    assert comb.calls == (disk,)  # the disk copy is the range's result
    assert only(out, Compare)[0].disk
