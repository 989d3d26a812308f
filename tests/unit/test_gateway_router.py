"""The gateway's router under logical time (``gateway.core.router``): events in, effects out, no loop."""

from __future__ import annotations

import random

import pytest

from gateway.core.router import (
    Abort,
    Answer,
    Arrive,
    AttemptFailed,
    Capacity,
    ClientGone,
    Commit,
    Effect,
    EndStream,
    Event,
    Finished,
    FirstToken,
    Listed,
    Load,
    Polled,
    PollFailed,
    Rearm,
    Refused,
    Router,
    RouterPolicy,
    Send,
    Timeout,
)
from swarm.core.prefix_hash import prefix_hashes

A, B = "http://a:1", "http://b:2"
M = "m-123456789abc"
SALT = b"salt-1"
SYSTEM = tuple(range(100, 612))  # a 512-token system prompt


def kept(*seqs: tuple[int, ...]) -> frozenset[bytes]:
    return frozenset(prefix_hashes(s, SALT)[-1] for s in seqs)


def router(**policy: float) -> Router:
    r = Router(RouterPolicy(**policy))  # type: ignore[arg-type]
    r.handle(Listed(M, (A, B)), 0.0)
    return r


def only_send(effects: list[Effect]) -> Send:
    [s] = [e for e in effects if isinstance(e, Send)]
    return s


def test_locality_beats_light_load() -> None:
    """A holds the system prompt and runs one session; B is idle and holds nothing: A's predicted TTFT
    (one decode step + 24 uncached tokens) beats B's (512 + 24 uncached), so A is chosen."""
    r = router()
    r.handle(Polled(A, Load(slots=4, active=1, mean_active_tps=20.0, salt=SALT, kept=kept(SYSTEM))), 1.0)
    r.handle(Polled(B, Load(slots=4, active=0, mean_active_tps=20.0, salt=SALT)), 1.0)
    prompt = SYSTEM + tuple(range(24))
    s = only_send(r.handle(Arrive(1, M, len(prompt), prompt), 1.5))
    assert (s.url, s.attempt, s.cached_tokens) == (A, 1, 512)
    assert [u for u, _ in s.scores] == [A, B]
    assert s.predicted_ttft_s == pytest.approx(0.05 + 24 * 0.002 + 0.05)


def test_load_beats_locality_when_the_holder_is_full() -> None:
    """A holds the prefix but its 4 slots are busy with 4 more queued: waiting for a slot (5/4 of a 2 s
    request) costs more than B's prefill of 536 tokens (1.07 s), so B is chosen."""
    r = router()
    r.handle(Polled(A, Load(slots=4, active=4, queue=4, mean_active_tps=20.0, salt=SALT, kept=kept(SYSTEM))), 1.0)
    r.handle(Polled(B, Load(slots=4, active=0, mean_active_tps=20.0, salt=SALT)), 1.0)
    prompt = SYSTEM + tuple(range(24))
    s = only_send(r.handle(Arrive(1, M, len(prompt), prompt), 1.5))
    assert (s.url, s.cached_tokens) == (B, 0)


def test_a_whole_prompt_hit_still_leaves_one_token_to_compute() -> None:
    r = router()
    r.handle(Polled(A, Load(slots=4, active=0, salt=SALT, kept=kept(SYSTEM))), 0.0)
    assert r.cached_tokens(A, SYSTEM, len(SYSTEM)) == 0  # the kept entry is the whole prompt: capped at n - 1
    assert r.cached_tokens(A, SYSTEM + (7,), len(SYSTEM) + 1) == 512
    assert r.cached_tokens(A, SYSTEM[:-1] + (7, 8), len(SYSTEM) + 1) == 0  # diverges inside the prefix
    r.handle(Polled(B, Load(slots=4, active=0, salt=b"other-model", kept=kept(SYSTEM))), 0.0)
    assert r.cached_tokens(B, SYSTEM + (7,), len(SYSTEM) + 1) == 0  # another salt's hashes never meet


def test_concurrent_arrivals_spread_by_in_flight_attempts() -> None:
    """Eight requests between two polls: the gateway's own attempts in flight count as load."""
    r = router()
    for u in (A, B):
        r.handle(Polled(u, Load(slots=4, active=0, mean_active_tps=20.0)), 0.0)
    urls = [only_send(r.handle(Arrive(i, M, 8), 0.1)).url for i in range(8)]
    assert urls.count(A) == 4 and urls.count(B) == 4
    assert r.inflight(A) == 4


def test_stale_capacity_is_not_trusted() -> None:
    """A's last /capacity said it cannot admit (enforced), but that answer is 10 s old: A is a candidate
    again (with the stale penalty); fresh, the same answer excludes it."""
    r = router(stale_after_s=5.0)
    refusing = Load(slots=4, active=4, capacity=Capacity(can_admit=False, admission="enforced", settle_remaining_s=0.0))
    r.handle(Polled(A, refusing), 0.0)
    r.handle(Listed(M, (A,)), 0.0)
    [ans] = r.handle(Arrive(1, M, 8), 1.0)
    assert isinstance(ans, Answer) and (ans.status, ans.code) == (429, "all_refused") and ans.retry_after_s == 1.0
    s = only_send(r.handle(Arrive(2, M, 8), 10.0))
    assert s.url == A and s.predicted_ttft_s > 1.0  # the stale penalty is in the score


def test_advisory_refusal_is_a_penalty_and_settling_a_delay() -> None:
    r = router()
    r.handle(Polled(A, Load(slots=4, active=1, mean_active_tps=20.0,
                            capacity=Capacity(can_admit=False, admission="advisory"))), 0.0)
    r.handle(Polled(B, Load(slots=4, active=1, mean_active_tps=20.0,
                            capacity=Capacity(can_admit=True, admission="enforced", settle_remaining_s=0.5))), 0.0)
    s = only_send(r.handle(Arrive(1, M, 8), 0.1))
    assert s.url == B and s.predicted_ttft_s == pytest.approx(0.5 + 8 * 0.002 + 0.05)
    assert dict(s.scores)[A] > 2.0


def test_an_advisory_coordinator_settling_is_no_delay() -> None:
    """Only an enforcing coordinator holds a new request while it settles: an advisory one's settle window
    (after a warm-up request, say) must not send every request elsewhere (benchmark case (b) on a quiet
    machine: all 8 sessions went to one of two coordinators)."""
    r = router()
    for u in (A, B):
        r.handle(Polled(u, Load(slots=4, active=0, mean_active_tps=20.0,
                                capacity=Capacity(can_admit=True, settle_remaining_s=4.8 if u == B else 0.0))), 0.0)
    urls = [only_send(r.handle(Arrive(i, M, 8), 0.1)).url for i in range(1, 9)]
    assert urls.count(A) == 4 and urls.count(B) == 4


def test_partition_marks_down_and_a_good_poll_brings_back() -> None:
    r = router(down_after_fails=2, backoff_s=5.0)
    r.handle(PollFailed(A, "connect timeout"), 1.0)
    assert not r.is_down(A, 1.0)  # one failure is no partition
    r.handle(PollFailed(A, "connect timeout"), 2.0)
    assert r.is_down(A, 2.0)
    assert only_send(r.handle(Arrive(1, M, 8), 2.5)).url == B
    r.handle(Listed(M, (A,)), 3.0)
    [ans] = r.handle(Arrive(2, M, 8), 3.0)
    assert isinstance(ans, Answer) and ans.status == 503 and ans.code == "no_coordinator" and M in ans.message
    r.handle(Polled(A, Load(slots=4, active=0)), 4.0)
    assert only_send(r.handle(Arrive(3, M, 8), 4.0)).url == A


def test_unknown_model_is_503_naming_it() -> None:
    r = router()
    [ans] = r.handle(Arrive(1, "no-such-model", 8), 0.0)
    assert isinstance(ans, Answer) and (ans.status, ans.code) == (503, "no_coordinator")
    assert "'no-such-model'" in ans.message and "the market lists none" in ans.message


def test_crash_before_first_token_fails_over_and_fences_the_old_attempt() -> None:
    r = router()
    s1 = only_send(r.handle(Arrive(1, M, 8), 0.0))
    assert s1.url == A
    s2 = only_send(r.handle(AttemptFailed(1, 1, "connection reset"), 0.2))
    assert (s2.url, s2.attempt) == (B, 2)
    assert r.is_down(A, 0.3) and r.inflight(A) == 0 and r.inflight(B) == 1
    # a late first token of attempt 1 can never complete attempt 2: it is aborted
    assert r.handle(FirstToken(1, 1), 0.4) == [Abort(1, 1, "", "stale_attempt")]
    assert r.handle(FirstToken(1, 2), 0.5) == [Commit(1, 2)]
    assert r.handle(Finished(1, 1), 0.6) == []  # old attempt's end: nothing
    assert r.handle(Finished(1, 2), 0.7) == [] and r.inflight(B) == 0 and r.counters.completed == 1
    assert r.counters.failovers == 1


def test_crash_mid_stream_ends_the_stream_with_an_error() -> None:
    r = router()
    only_send(r.handle(Arrive(1, M, 8), 0.0))
    assert r.handle(FirstToken(1, 1), 0.1) == [Commit(1, 1)]
    [end] = r.handle(AttemptFailed(1, 1, "connection reset"), 0.5)
    assert isinstance(end, EndStream) and end.code == "coordinator_failed" and A in end.message
    assert r.is_down(A, 0.6) and r.counters.stream_errors == 1
    assert r.handle(Timeout(1, 1), 1.0) == []  # the request is over


def test_timeout_falls_back_and_the_deadline_is_for_the_first_token_only() -> None:
    r = router(offer_timeout_s=2.0, ttft_slack=4.0)
    s1 = only_send(r.handle(Arrive(1, M, 8), 0.0))
    assert s1.deadline == pytest.approx(2.0 + 4.0 * s1.predicted_ttft_s)
    out = r.handle(Timeout(1, 1), s1.deadline)
    assert out[0] == Abort(1, 1, A, "timeout")
    s2 = only_send(out)
    assert (s2.url, s2.attempt) == (B, 2)
    assert r.handle(FirstToken(1, 2), s2.deadline - 0.1) == [Commit(1, 2)]
    assert r.handle(Timeout(1, 2), s2.deadline) == []  # committed: streaming goes on
    assert r.counters.timeouts == 1


def test_non_streamed_deadline_covers_its_tokens() -> None:
    r = router(offer_timeout_s=2.0, ttft_slack=4.0, decode_prior_s=0.05)
    s = only_send(r.handle(Arrive(1, M, 8, max_tokens=100, stream=False), 0.0))
    assert s.deadline == pytest.approx(2.0 + 4.0 * s.predicted_ttft_s + 4.0 * 100 * 0.05)


def test_every_candidate_failing_is_503() -> None:
    r = router()
    only_send(r.handle(Arrive(1, M, 8), 0.0))
    only_send(r.handle(AttemptFailed(1, 1, "refused"), 0.1))
    [ans] = r.handle(AttemptFailed(1, 2, "refused"), 0.2)
    assert isinstance(ans, Answer) and ans.status == 503 and "none is reachable" in ans.message
    assert 1 not in r.reqs


def test_refusals_move_on_and_all_refused_is_429_with_the_soonest_retry() -> None:
    r = router()
    only_send(r.handle(Arrive(1, M, 8), 0.0))
    s2 = only_send(r.handle(Refused(1, 1, 429, 3.0), 0.1))
    assert s2.url == B
    [ans] = r.handle(Refused(1, 2, 429, 1.5), 0.2)
    assert isinstance(ans, Answer) and ans.status == 429 and ans.retry_after_s == 1.5
    # A still refuses for 2.9 s, B for 1.5 s: a new request meanwhile gets 429 at once
    [ans2] = r.handle(Arrive(2, M, 8), 0.5)
    assert isinstance(ans2, Answer) and ans2.status == 429 and ans2.retry_after_s == pytest.approx(1.2)
    assert only_send(r.handle(Arrive(3, M, 8), 1.8)).url == B


def test_client_cancellation_aborts_the_attempt() -> None:
    r = router()
    only_send(r.handle(Arrive(1, M, 8), 0.0))
    assert r.handle(ClientGone(1), 0.1) == [Abort(1, 1, A, "client_gone")]
    assert r.inflight(A) == 0 and r.counters.cancelled == 1
    assert r.handle(AttemptFailed(1, 1, "cancelled"), 0.2) == []  # no failover for a gone client
    assert not r.is_down(A, 0.3)


def random_log(seed: int, n: int = 400) -> list[tuple[float, Event]]:
    rng = random.Random(seed)
    urls = [f"http://c{i}:1" for i in range(4)]
    log: list[tuple[float, Event]] = [(0.0, Listed(M, tuple(urls)))]
    now, rid = 0.0, 0
    open_attempts: list[tuple[int, int]] = []
    for _ in range(n):
        now += rng.uniform(0.0, 0.3)
        k = rng.randrange(8)
        if k == 0:
            u = rng.choice(urls)
            log.append((now, Polled(u, Load(slots=4, active=rng.randrange(6), queue=rng.randrange(3),
                                           mean_active_tps=rng.uniform(5, 30), salt=SALT,
                                           kept=kept(SYSTEM[: rng.randrange(1, 512)])))))
        elif k == 1:
            log.append((now, PollFailed(rng.choice(urls), "timeout")))
        elif k in (2, 3):
            rid += 1
            prompt = SYSTEM[: rng.randrange(1, 512)] + (rng.randrange(10),)
            log.append((now, Arrive(rid, M, len(prompt), prompt, stream=rng.random() < 0.8)))
            open_attempts.append((rid, 1))
        elif open_attempts:
            r_, a_ = rng.choice(open_attempts)
            a_ = max(1, a_ + rng.randrange(-1, 2))
            ev = rng.choice([FirstToken(r_, a_), Finished(r_, a_), AttemptFailed(r_, a_, "x"), Timeout(r_, a_),
                             Refused(r_, a_, 429, 1.0), ClientGone(r_)])
            log.append((now, ev))
            open_attempts.append((r_, a_ + 1))
    return log


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_of_an_event_log_gives_the_same_decisions(seed: int) -> None:
    log = random_log(seed)

    def run() -> list[list[Effect]]:
        r = Router()
        return [r.handle(ev, now) for now, ev in log]

    first, second = run(), run()
    assert first == second
    sends = [e for out in first for e in out if isinstance(e, Send)]
    assert len(sends) > 20 and len({s.url for s in sends}) > 1  # the log exercised real choices
    assert any(isinstance(e, Commit) for out in first for e in out)
    assert any(isinstance(e, Abort) for out in first for e in out)


def test_measured_prefill_rate_steers_later_choices() -> None:
    """A's first tokens come slowly for its uncached prompts: its measured prefill rate makes B the
    better choice for the next long prompt though both are idle."""
    r = router(prefill_prior_s=0.002)
    for u in (A, B):
        r.handle(Polled(u, Load(slots=4, active=0, mean_active_tps=20.0)), 0.0)
    s = only_send(r.handle(Arrive(1, M, 200), 0.0))
    assert s.url == A  # tie: by URL
    r.handle(FirstToken(1, 1), 2.05)  # 2 s for 200 tokens: 10 ms a token
    r.handle(Finished(1, 1), 2.5)
    s2 = only_send(r.handle(Arrive(2, M, 200), 3.0))
    assert s2.url == B and dict(s2.scores)[A] == pytest.approx(200 * 0.01 + 0.05, rel=1e-3)


def test_a_good_poll_does_not_clear_a_failed_attempts_backoff() -> None:
    """A coordinator that answers polls but timed out on a request stays out for ``backoff_s``."""
    r = router(backoff_s=5.0)
    s = only_send(r.handle(Arrive(1, M, 8), 0.0))
    only_send(r.handle(Timeout(1, 1), s.deadline))
    r.handle(Polled(A, Load(slots=4, active=0)), s.deadline + 1.0)
    assert r.is_down(A, s.deadline + 1.0)
    assert only_send(r.handle(Arrive(2, M, 8), s.deadline + 1.0)).url == B
    assert not r.is_down(A, s.deadline + 5.0)


def test_a_timeout_with_no_one_else_to_ask_keeps_waiting() -> None:
    """The only coordinator is slow, not dead: its attempt is kept (Rearm), never aborted into a 503."""
    r = router(offer_timeout_s=2.0)
    r.handle(Listed(M, (A,)), 0.0)
    s = only_send(r.handle(Arrive(1, M, 8), 0.0))
    assert r.handle(Timeout(1, 1), s.deadline) == [Rearm(1, 1, s.deadline + 2.0)]
    assert not r.is_down(A, s.deadline) and r.inflight(A) == 1 and r.counters.rearmed == 1
    assert r.handle(FirstToken(1, 1), s.deadline + 1.0) == [Commit(1, 1)]
