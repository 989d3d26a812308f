"""Pure volunteer lifecycle core: polling with jitter and backoff, fetch, heartbeats, directives,
lease lapse, shutdown (events in, effects out; no event loop)."""

from __future__ import annotations

import random

import pytest

from volunteer.core.health import BudgetWatch
from volunteer.core.lifecycle import Deregister, Fetch, Lifecycle, Offer, Phase, Poll, SendHeartbeat, Unload

OFFER = Offer(model_id="m-123456789abc", layer=1, lo=0, hi=4, url="http://c/v1/slices/m/1/0-4", sha256="ab" * 32,
              size=1000, lease_expires_in_s=10.0, heartbeat_s=2.0)
KEY = (OFFER.model_id, OFFER.layer, OFFER.lo, OFFER.hi)


def lc(seed: int = 1) -> Lifecycle:
    return Lifecycle(rng=random.Random(seed), poll_interval_s=2.0, jitter=0.25)


def serving(now: float = 0.0) -> Lifecycle:
    c = lc()
    c.start(now)
    c.offered(OFFER, now)
    c.fetched(OFFER, now + 1)
    return c


def test_start_and_jittered_polls_spread_out() -> None:
    firsts = []
    for seed in range(20):
        [p] = lc(seed).start(100.0)
        assert isinstance(p, Poll) and 100.0 <= p.at <= 100.0 + 2.0 * 0.25
        firsts.append(p.at)
    assert len(set(firsts)) == 20
    c = lc()
    c.start(0)
    [p] = c.nothing_needed(4.0, 10.0)
    assert isinstance(p, Poll) and 13.0 <= p.at <= 15.0


@pytest.mark.parametrize(("failures", "lo", "hi"), [(1, 1.5, 2.5), (2, 3.0, 5.0), (3, 6.0, 10.0), (8, 22.5, 37.5)])
def test_poll_failures_back_off(failures: int, lo: float, hi: float) -> None:
    c = lc()
    c.start(0)
    for _ in range(failures):
        [p] = c.poll_failed(0.0)
    assert isinstance(p, Poll) and lo <= p.at <= hi


def test_offer_fetch_serve_heartbeats() -> None:
    c = lc()
    c.start(0)
    eff = c.offered(OFFER, 1.0)
    assert eff == [Fetch(OFFER), SendHeartbeat(1)]  # "loading" at once: converts the lease
    assert c.phase is Phase.FETCHING and [st for _, st in c.reported()] == ["loading"]
    assert c.offered(OFFER, 1.1) == []  # one slice at a time
    assert c.fetched(OFFER, 2.0) == [SendHeartbeat(2)]
    assert c.phase is Phase.SERVING and [st for _, st in c.reported()] == ["serving"]
    assert c.tick(2.5) == [SendHeartbeat(3)]  # the "fetched" heartbeat was due immediately
    assert c.tick(3.0) == []
    assert c.tick(4.6) == [SendHeartbeat(4)]  # every heartbeat_s


def test_fetch_failure_returns_to_polling() -> None:
    c = lc()
    c.start(0)
    c.offered(OFFER, 1.0)
    eff = c.fetch_failed(OFFER, "sha256 mismatch", 2.0)
    assert eff[0] == Unload(OFFER, "fetch_failed") and isinstance(eff[1], SendHeartbeat) and isinstance(eff[2], Poll)
    assert c.phase is Phase.IDLE and not c.holdings


def test_lease_lapses_without_an_ack() -> None:
    c = lc()
    c.start(0)
    c.offered(OFFER, 0.0)
    c.heartbeat_failed(0.5)  # the market is down
    assert c.tick(9.9) == [SendHeartbeat(2)]
    eff = c.tick(10.0)
    assert eff and eff[0] == Unload(OFFER, "lease_lapsed") and c.phase is Phase.IDLE


def test_acked_slice_survives_lease_and_market_outage() -> None:
    c = serving()
    c.heartbeat_acked([(*KEY, "keep", True, None)], 2.0, 2, 1.5)
    assert c.holdings[KEY].acked and c.holdings[KEY].dispatched
    for t in range(2, 60, 2):
        for e in c.tick(float(t)):
            assert isinstance(e, SendHeartbeat)
        c.heartbeat_failed(float(t))  # an outage changes nothing
    assert c.phase is Phase.SERVING


def test_drain_then_keep_then_release() -> None:
    c = serving()
    c.heartbeat_acked([(*KEY, "drain", False, 5.0)], 2.0, 2, 2.0)
    assert c.holdings[KEY].state == "draining" and not c.holdings[KEY].dispatched
    assert [st for _, st in c.reported()] == ["serving"]  # still answering: the market decides when it goes
    c.heartbeat_acked([(*KEY, "keep", True, None)], 2.0, 3, 3.0)  # demand came back
    assert c.holdings[KEY].state == "serving" and c.holdings[KEY].dispatched
    eff = c.heartbeat_acked([(*KEY, "release", False, None)], 2.0, 4, 9.0)
    assert eff[0] == Unload(OFFER, "released_by_market") and isinstance(eff[-1], Poll)
    assert c.phase is Phase.IDLE


def test_directives_for_other_slices_are_ignored() -> None:
    c = serving()
    assert c.heartbeat_acked([("other", 0, 0, 4, "release", False, None)], 2.0, 2, 2.0) == []
    assert c.phase is Phase.SERVING


def test_sequences_strictly_grow() -> None:
    c = serving()
    seqs = [e.sequence for t in range(1, 40) for e in c.tick(float(t)) if isinstance(e, SendHeartbeat)]
    assert seqs == sorted(set(seqs)) and seqs[0] > 2


def test_shutdown_drains_then_deregisters() -> None:
    c = serving()
    [hb] = c.stop(5.0)
    assert isinstance(hb, SendHeartbeat) and [st for _, st in c.reported()] == ["draining"]
    assert c.tick(100.0) == []  # no more heartbeats or lease logic while stopping
    eff = c.drained(6.0)
    assert eff[0] == Unload(OFFER, "shutdown") and isinstance(eff[1], Deregister) and eff[1].sequence > hb.sequence


def test_a_fetch_that_finishes_after_its_offer_ended_changes_nothing() -> None:
    """Offer A is released while downloading and B is taken; A's late completion must not mark B
    serving, and B's own failure must still be handled."""
    other = Offer(model_id=OFFER.model_id, layer=0, lo=4, hi=8, url="http://c/v1/slices/m/0/4-8", sha256="cd" * 32,
                  size=1000, lease_expires_in_s=10.0, heartbeat_s=2.0)
    c = lc()
    c.start(0)
    c.offered(OFFER, 0.0)
    c.heartbeat_acked([(*KEY, "release", False, None)], 2.0, 1, 1.0)
    assert c.phase is Phase.IDLE
    c.offered(other, 2.0)
    assert c.fetched(OFFER, 3.0) == [] and [st for _, st in c.reported()] == ["loading"]  # A's late completion
    assert c.fetch_failed(OFFER, "late", 3.1) == []
    eff = c.fetch_failed(other, "sha256 mismatch", 4.0)
    assert eff[0] == Unload(other, "fetch_failed") and c.phase is Phase.IDLE


def offer(layer: int, lo: int, hi: int, size: int = 400) -> Offer:
    return Offer(model_id=OFFER.model_id, layer=layer, lo=lo, hi=hi, url=f"http://c/v1/slices/m/{layer}/{lo}-{hi}",
                 sha256="ef" * 32, size=size, lease_expires_in_s=10.0, heartbeat_s=2.0)


def budgeted(max_bytes: int = 1000, max_slices: int = 8) -> Lifecycle:
    c = Lifecycle(rng=random.Random(3), poll_interval_s=2.0, jitter=0.25, max_bytes=max_bytes, max_slices=max_slices)
    c.start(0.0)
    return c


def test_a_budget_fills_with_several_slices_one_download_at_a_time() -> None:
    c = budgeted(1000)
    a, b = offer(0, 0, 4), offer(3, 4, 8)
    assert c.offered(a, 1.0) == [Fetch(a), SendHeartbeat(1)]
    assert not c.has_room() and c.offered(b, 1.1) == []  # one download at a time
    eff = c.fetched(a, 2.0)
    assert eff[0] == SendHeartbeat(2) and isinstance(eff[1], Poll)  # room left: ask for more
    assert c.budget_left() == 600 and c.wants_poll(eff[1].at)
    c.offered(b, 3.0)
    eff = c.fetched(b, 4.0)
    assert c.budget_left() == 200 and isinstance(eff[-1], Poll) and c.phase is Phase.SERVING
    [p] = [e for e in eff if isinstance(e, Poll)]
    assert c.nothing_needed(5.0, p.at, reason="budget_too_small") == []  # full: stop asking
    assert c.full and not c.has_room() and not c.wants_poll(p.at)
    assert [(h.offer.layer, st) for h, st in c.reported()] == [(0, "serving"), (3, "serving")]


def test_releasing_one_of_several_keeps_the_others_and_polls_again() -> None:
    c = budgeted(1000)
    a, b = offer(0, 0, 4), offer(3, 4, 8)
    for o, t in ((a, 1.0), (b, 3.0)):
        c.offered(o, t)
        c.fetched(o, t + 1)
    c.nothing_needed(5.0, 5.0, reason="budget_too_small")
    eff = c.heartbeat_acked([(*a.key, "release", False, None), (*b.key, "keep", True, None)], 2.0, 4, 6.0)
    assert eff[0] == Unload(a, "released_by_market") and isinstance(eff[-1], Poll)
    assert list(c.holdings) == [b.key] and c.holdings[b.key].dispatched and not c.full


def test_several_drops_in_one_event_send_one_heartbeat_and_one_poll() -> None:
    c = budgeted(2000)
    a, b, d = offer(0, 0, 4), offer(1, 0, 4), offer(2, 0, 4)
    for o, t in ((a, 1.0), (b, 2.0), (d, 3.0)):
        c.offered(o, t)
        c.fetched(o, t + 0.5)
    eff = c.heartbeat_acked([(*o.key, "release", False, None) for o in (a, b, d)], 2.0, 9, 6.0)
    assert [e for e in eff if isinstance(e, Unload)] == [Unload(a, "released_by_market"), Unload(b, "released_by_market"),
                                                         Unload(d, "released_by_market")]
    assert sum(isinstance(e, SendHeartbeat) for e in eff) == 1 and sum(isinstance(e, Poll) for e in eff) == 1
    assert c.phase is Phase.IDLE and c.budget_left() == 2000


def test_a_lapsed_lease_drops_only_its_slice() -> None:
    c = budgeted(1000)
    a, b = offer(0, 0, 4), offer(1, 0, 4)
    c.offered(a, 0.0)
    c.fetched(a, 1.0)
    c.heartbeat_acked([(*a.key, "keep", True, None)], 2.0, 2, 1.5)
    c.offered(b, 2.0)  # never acknowledged: the market lost the lease
    eff = c.tick(12.0)
    assert Unload(b, "lease_lapsed") in eff and list(c.holdings) == [a.key]


def test_max_slices_caps_the_holdings_and_shutdown_drains_them_all() -> None:
    c = budgeted(10_000, max_slices=2)
    a, b = offer(0, 0, 4), offer(1, 0, 4)
    c.offered(a, 0.0)
    c.fetched(a, 1.0)
    c.offered(b, 2.0)
    assert c.fetched(b, 3.0) == [SendHeartbeat(4)] and not c.has_room()  # two slices: no more polls
    [hb] = c.stop(4.0)
    assert [st for _, st in c.reported()] == ["draining", "draining"]
    eff = c.drained(5.0)
    assert eff[:2] == [Unload(a, "shutdown"), Unload(b, "shutdown")] and isinstance(eff[2], Deregister)


def test_a_budget_in_experts_counts_the_experts_held() -> None:
    c = Lifecycle(rng=random.Random(4), max_experts=8, max_slices=8)
    c.start(0.0)
    a, b = offer(0, 0, 4), offer(1, 4, 8)
    c.offered(a, 0.0)
    c.fetched(a, 1.0)
    assert c.experts_left() == 4 and c.budget_left() is None and c.has_room()
    c.offered(b, 2.0)
    assert c.fetched(b, 3.0) == [SendHeartbeat(4)] and c.experts_left() == 0 and not c.has_room()


def test_a_stuck_request_budget_is_reported_draining_at_once_and_serving_again_when_it_moves() -> None:
    c = serving()
    seq = c.sequence
    assert c.budget_stuck(True, 5.0) == [SendHeartbeat(seq + 1)]  # not at the next period: now
    assert [st for _, st in c.reported()] == ["draining"]
    assert c.budget_stuck(True, 6.0) == []  # no change, no extra heartbeat
    assert c.budget_stuck(False, 7.0) == [SendHeartbeat(seq + 2)]
    assert [st for _, st in c.reported()] == ["serving"]
    idle = lc()
    idle.start(0)
    assert idle.budget_stuck(True, 1.0) == []  # nothing held: nothing to report


def test_a_slice_still_loading_stays_loading_while_the_budget_is_stuck() -> None:
    c = lc()
    c.start(0)
    c.offered(OFFER, 1.0)
    c.budget_stuck(True, 2.0)
    assert [st for _, st in c.reported()] == ["loading"]


@pytest.mark.parametrize(("samples", "verdicts"), [
    # (now, held, refused, given) ...: refusals with nothing given back for the window: stuck
    ([(0, 100, 0, 0), (10, 100, 1, 0), (29, 100, 5, 0)], [False, False, False]),
    ([(0, 100, 0, 0), (10, 100, 1, 0), (30, 100, 5, 0)], [False, False, True]),
    # bytes came back in the meantime: work is being done, refusals are load
    ([(0, 100, 0, 0), (20, 100, 3, 50), (40, 100, 9, 50)], [False, False, False]),
    ([(0, 100, 0, 0), (20, 100, 3, 50), (50, 100, 9, 50), (51, 100, 9, 60)], [False, False, True, False]),
    # nothing held, or nothing refused: not stuck however long
    ([(0, 0, 5, 0), (100, 0, 9, 0)], [False, False]),
    ([(0, 100, 0, 0), (100, 100, 0, 0)], [False, False]),
    # a new budget (counters went down) starts afresh
    ([(0, 100, 0, 0), (40, 100, 4, 0), (41, 100, 1, 0)], [False, True, False]),
])
def test_budget_watch(samples: list[tuple[float, int, int, int]], verdicts: list[bool]) -> None:
    w = BudgetWatch(window_s=30.0)
    assert [w.observe(now, held=h, refused=r, given=g) for now, h, r, g in samples] == verdicts


def test_paused_reports_draining_stops_polling_keeps_heartbeating_and_resumes() -> None:
    c = serving()
    seq = c.sequence
    assert c.set_paused(True, 5.0) == [SendHeartbeat(seq + 1)]  # at once
    assert [st for _, st in c.reported()] == ["draining"] and KEY in c.holdings  # kept, not counted
    assert c.set_paused(True, 5.5) == []
    assert not c.has_room() and c.nothing_needed(1.0, 6.0) == [] and c.poll_failed(6.0) == []
    assert c.tick(5.0 + c.heartbeat_s) == [SendHeartbeat(seq + 2)]  # the period goes on
    eff = c.set_paused(False, 10.0)
    assert eff[0] == SendHeartbeat(seq + 3) and [st for _, st in c.reported()] == ["serving"]
    # room for another slice (a byte budget): the poll comes after the heartbeat that says "serving"
    roomy = Lifecycle(rng=random.Random(1), max_bytes=10_000, max_slices=4)
    roomy.start(0.0)
    roomy.offered(OFFER, 0.0)
    roomy.fetched(OFFER, 1.0)
    roomy.set_paused(True, 2.0)
    resumed = roomy.set_paused(False, 3.0)
    assert isinstance(resumed[0], SendHeartbeat) and isinstance(resumed[1], Poll) and resumed[1].at >= 3.0


def test_a_paused_volunteer_holding_nothing_still_heartbeats_so_the_market_knows() -> None:
    c = lc()
    [first_poll] = c.start(0.0)
    assert c.set_paused(True, 0.1) == [SendHeartbeat(1)]
    assert not c.wants_poll(first_poll.at)  # the poll already scheduled is skipped
    assert c.tick(0.1 + c.heartbeat_s) == [SendHeartbeat(2)]
    eff = c.set_paused(False, 5.0)
    assert eff[0] == SendHeartbeat(3) and isinstance(eff[1], Poll)
    assert c.tick(5.0 + 10 * c.heartbeat_s) == []  # nothing held, not paused: silent again (it polls)
    assert c.stop(6.0) == [] and c.set_paused(True, 7.0) == []  # stopping: no more changes
