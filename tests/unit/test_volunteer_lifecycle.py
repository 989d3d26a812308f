"""Pure volunteer lifecycle core: polling with jitter and backoff, fetch, heartbeats, directives,
lease lapse, shutdown (events in, effects out; no event loop)."""

from __future__ import annotations

import random

import pytest

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
    assert c.phase is Phase.FETCHING and c.reported_state() == "loading"
    assert c.offered(OFFER, 1.1) == []  # one slice at a time
    assert c.fetched(OFFER, 2.0) == [SendHeartbeat(2)]
    assert c.phase is Phase.SERVING and c.reported_state() == "serving"
    assert c.tick(2.5) == [SendHeartbeat(3)]  # the "fetched" heartbeat was due immediately
    assert c.tick(3.0) == []
    assert c.tick(4.6) == [SendHeartbeat(4)]  # every heartbeat_s


def test_fetch_failure_returns_to_polling() -> None:
    c = lc()
    c.start(0)
    c.offered(OFFER, 1.0)
    eff = c.fetch_failed(OFFER, "sha256 mismatch", 2.0)
    assert eff[0] == Unload(OFFER, "fetch_failed") and isinstance(eff[1], SendHeartbeat) and isinstance(eff[2], Poll)
    assert c.phase is Phase.IDLE and c.held is None


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
    assert c.held is not None and c.held.acked and c.held.dispatched
    for t in range(2, 60, 2):
        for e in c.tick(float(t)):
            assert isinstance(e, SendHeartbeat)
        c.heartbeat_failed(float(t))  # an outage changes nothing
    assert c.phase is Phase.SERVING


def test_drain_then_keep_then_release() -> None:
    c = serving()
    c.heartbeat_acked([(*KEY, "drain", False, 5.0)], 2.0, 2, 2.0)
    assert c.held is not None and c.held.state == "draining" and not c.held.dispatched
    assert c.reported_state() == "serving"  # still answering: the market decides when it goes
    c.heartbeat_acked([(*KEY, "keep", True, None)], 2.0, 3, 3.0)  # demand came back
    assert c.held.state == "serving" and c.held.dispatched
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
    assert isinstance(hb, SendHeartbeat) and c.reported_state() == "draining"
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
    assert c.fetched(OFFER, 3.0) == [] and c.reported_state() == "loading"  # A's late completion
    assert c.fetch_failed(OFFER, "late", 3.1) == []
    eff = c.fetch_failed(other, "sha256 mismatch", 4.0)
    assert eff[0] == Unload(other, "fetch_failed") and c.phase is Phase.IDLE
