"""market.core.pacing: idle volunteers' retry grows with their number, bounded, and follows the swarm."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from market.core.pacing import IdlePacing


def test_few_idle_volunteers_keep_the_base_retry() -> None:
    p = IdlePacing(rate=200.0, max_s=120.0)
    assert [p.retry_after(f"v{i}", 5.0, 0.0) for i in range(10)] == [5.0] * 10


def test_many_idle_volunteers_are_paced_to_the_rate_up_to_the_bound() -> None:
    p = IdlePacing(rate=200.0, max_s=120.0)
    for i in range(10_000):
        r = p.retry_after(f"v{i}", 5.0, i * 0.001)
    assert p.idle == 10_000 and r == 10_000 / 200.0  # 200 polls a second from 10^4 idle volunteers
    for i in range(10_000, 100_000):
        r = p.retry_after(f"v{i}", 5.0, 10.0 + i * 0.0001)
    assert r == 120.0  # bounded: a boost reaches every idle volunteer within max_s


def test_a_volunteer_counts_once_and_the_silent_are_forgotten() -> None:
    p = IdlePacing(rate=1.0, max_s=60.0)
    for _ in range(5):
        p.retry_after("same", 5.0, 0.0)
    assert p.idle == 1
    for i in range(100):
        p.retry_after(f"v{i}", 5.0, 1.0)
    assert p.idle == 101
    assert p.retry_after("late", 5.0, 1.0 + p.window_s + 1) == 5.0  # the others went silent: forgotten
    assert p.idle == 1


def test_rate_zero_turns_pacing_off() -> None:
    p = IdlePacing(rate=0.0, max_s=120.0)
    assert all(p.retry_after(f"v{i}", 5.0, 0.0) == 5.0 for i in range(1000))


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 1000)), max_size=200), st.floats(0.1, 1e4))
def test_the_retry_is_within_its_bounds(polls: list[tuple[int, float]], rate: float) -> None:
    p = IdlePacing(rate=rate, max_s=120.0)
    now = 0.0
    for peer, dt in polls:
        now += dt
        r = p.retry_after(f"v{peer}", 5.0, now)
        assert 5.0 <= r <= 120.0
        assert r >= min(120.0, p.idle / rate) - 1e-9
