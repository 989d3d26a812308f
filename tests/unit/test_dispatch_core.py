"""Pure dispatch core: worker health with backoff, static and balanced replica choice."""

from __future__ import annotations

import pytest

from coordinator.core.dispatch import BalancedPolicy, ChoiceReason, StaticPolicy, WorkerTable


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
def test_static_policy(replicas: list[str], down: list[str], expect: tuple[str, ...], reason: ChoiceReason) -> None:
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
