"""Session groups (``coordinator.core.pipeline``): the cuts, the cost model and the choice of how many
groups, table-driven."""

from __future__ import annotations

import random

import pytest

from coordinator.core.pipeline import Affine, GroupArms, PipelineModel, choose_groups, cycle_s, group_cuts

MS = 1e-3


@pytest.mark.parametrize(
    ("rows", "n", "cuts"),
    [
        ([1, 1, 1, 1], 2, [0, 2, 4]),
        ([1, 1, 1, 1, 1], 2, [0, 2, 5]),  # 2 + 3 (the nearer of 2.5 first)
        ([1, 1, 1, 1, 1, 1, 1, 1], 8, list(range(9))),
        ([1, 1, 1], 5, [0, 1, 2, 3]),  # at most one group a sequence
        ([1, 1, 1], 0, [0, 3]),  # at least one group
        ([10, 1, 1, 1], 2, [0, 1, 4]),  # rows, not sequences: a prefill chunk is its own group
        ([1, 1, 1, 10], 2, [0, 3, 4]),
        ([5], 3, [0, 1]),
    ],
)
def test_group_cuts(rows: list[int], n: int, cuts: list[int]) -> None:
    assert group_cuts(rows, n) == cuts


DENSE = Affine(0.5 * MS, 0.5 * MS)  # the 30b-a3b shape's dense half here: ~0.5 ms a call + 0.5 ms a row
REMOTE = Affine(1.0 * MS, 1.2 * MS)  # a volunteer's experts: ~1 ms a call + 1.2 ms a row


@pytest.mark.parametrize(
    ("n_seqs", "latency_ms", "want"),
    [
        (1, 20.0, 1),  # one session: computed as without groups
        (8, 20.0, 8),  # a 20 ms round trip: every session its own group, the cores are far from busy
        (8, 50.0, 8),
        (8, 2.0, 2),  # loopback: two groups fill the short wait, more would add calls than wait saved
        # no round trip, but the volunteer's 5.8 ms and the coordinator's 2.5 ms run side by side with two
        # groups (on machines of their own): 6.8 ms a layer instead of 8.5
        (4, 0.2, 2),
        (2, 20.0, 1),  # two sessions share one 20 ms round trip anyway: two groups save 7 %, below the margin
    ],
)
def test_the_groups_follow_the_round_trip(n_seqs: int, latency_ms: float, want: int) -> None:
    assert choose_groups(n_seqs, n_seqs, latency_ms * MS, DENSE, REMOTE) == want


def test_the_choice_is_the_fastest_cycle_and_must_clearly_win() -> None:
    lat = 2.0 * MS
    cycles = {g: cycle_s(g, 8, lat, DENSE, REMOTE) for g in range(1, 9)}
    best = min(cycles, key=cycles.__getitem__)
    assert choose_groups(8, 8, lat, DENSE, REMOTE, min_gain=0.0) == best
    # a gain below the margin is noise: one group
    gain = cycles[1] / cycles[best] - 1
    assert choose_groups(8, 8, lat, DENSE, REMOTE, min_gain=gain + 0.01) == 1
    # the shared resources bound it: with a volunteer four times slower, fewer groups are best
    slow = Affine(4.0 * MS, 4.8 * MS)
    assert choose_groups(8, 8, 20 * MS, DENSE, slow) < 8


def test_the_model_learns_from_remote_layers_and_says_one_group_before() -> None:
    m = PipelineModel()
    assert m.groups(8, 8) == 1  # nothing measured yet
    for rows in (1, 2, 4, 8, 1, 2, 4, 8):
        m.sample(rows, DENSE(rows), REMOTE(rows), 20 * MS)
    assert m.latency_s == pytest.approx(20 * MS)
    assert m.groups(8, 8) == 8
    assert m.groups(1, 1) == 1
    for _ in range(200):  # the round trip falls (a closer volunteer): the EWMA follows, fewer groups
        m.sample(4, DENSE(4), REMOTE(4), 0.1 * MS)
    assert m.groups(4, 4) == 1


def drive(arms: GroupArms, model_g: int, step_s: dict[int, float], steps: int, *, n: int = 4, rows: int = 4,
          t: float = 0.0) -> tuple[list[int], float]:
    """``steps`` steps of ``rows`` rows where a step in ``g`` groups takes ``step_s[g]`` seconds
    (virtual time); the picks in order."""
    picks: list[int] = []
    end: float | None = None
    for _ in range(steps):
        g = arms.pick(n, rows, model_g, t, end)
        picks.append(g)
        t += step_s[g]
        end = t
        t += 0.001  # sampling and streaming between steps: not part of the step
    return picks, t


def test_a_model_pick_slower_in_fact_is_dropped_but_re_measured() -> None:
    arms = GroupArms(explore_every=8)
    picks, _ = drive(arms, 3, {1: 0.010, 3: 0.016}, 40)
    assert picks[:6] == [3, 1, 3, 1, 3, 1]  # both arms measured first, in turn: the model's pick, then one group
    assert picks[6:].count(3) == len([i for i in range(7, 41) if i % 8 == 0])  # only the re-measurements
    assert arms.per_row[(4, 1)] == pytest.approx(0.010 / 4)
    assert arms.per_row[(4, 3)] == pytest.approx(0.016 / 4)


def test_a_model_pick_faster_in_fact_is_kept() -> None:
    arms = GroupArms(explore_every=8)
    picks, _ = drive(arms, 3, {1: 0.030, 3: 0.012}, 40)
    assert picks[:6] == [3, 1, 3, 1, 3, 1]
    assert picks[6:].count(1) == len([i for i in range(7, 41) if i % 8 == 0])


def test_one_group_asked_is_one_group_and_idle_time_is_not_a_step() -> None:
    arms = GroupArms()
    assert drive(arms, 1, {1: 0.01}, 5)[0] == [1] * 5
    assert arms.per_row == {}  # no choice, no sample: steps before the model wants groups are another regime
    # ... which then cannot stand against the model's pick: both arms are measured afresh
    arms = GroupArms(explore_every=8)
    _, t = drive(arms, 1, {1: 0.040}, 20)  # slow steps while the model wants one group (a warm-up)
    picks, _ = drive(arms, 2, {1: 0.010, 2: 0.0105}, 40, t=t)
    assert picks[:6] == [2, 1, 2, 1, 2, 1] and picks[6:].count(2) <= 40 // 8 + 1
    # a step whose layers ended before it began (an idle gap, no layer since) gives no sample
    arms = GroupArms()
    arms.pick(4, 4, 2, 10.0, None)
    arms.pick(4, 4, 2, 20.0, 5.0)
    assert arms.per_row == {}
    # the network changes: the arm not in use is re-measured and the choice flips
    arms = GroupArms(explore_every=4)
    _, t = drive(arms, 2, {1: 0.010, 2: 0.020}, 12)
    picks, _ = drive(arms, 2, {1: 0.040, 2: 0.020}, 24, t=t)
    assert picks[-8:].count(2) >= 6


def noisy(arms: GroupArms, model_g: int, step_s: dict[int, float], steps: int, seed: int) -> list[int]:
    """``drive`` with each step's time off its mean by up to +-20 % (seeded): what steps look like here."""
    rng = random.Random(seed)
    picks: list[int] = []
    t, end = 0.0, None
    for _ in range(steps):
        g = arms.pick(4, 4, model_g, t, end)
        picks.append(g)
        t += step_s[g] * rng.uniform(0.8, 1.2)
        end = t
        t += 0.001
    return picks


@pytest.mark.parametrize("seed", range(5))
def test_noise_does_not_flip_the_choice_to_a_slightly_slower_arm(seed: int) -> None:
    """Two groups truly 4 % slower, steps +-20 %: the slower arm runs little more than its re-measurements
    (without the margin: a fifth of the steps and more); truly 30 % faster, it is the choice."""
    picks = noisy(GroupArms(), 2, {1: 0.0080, 2: 0.0083}, 3000, seed)
    assert picks[100:].count(2) / len(picks[100:]) <= 1 / 24 + 0.03
    picks = noisy(GroupArms(), 2, {1: 0.0100, 2: 0.0070}, 3000, seed)
    assert picks[100:].count(1) / len(picks[100:]) <= 1 / 24 + 0.03


def test_a_cold_start_does_not_decide_the_arms() -> None:
    """One group's first steps are slow (graphs built for a new shape: 40 ms instead of 8): the median of
    the window forgets them as soon as they are fewer than half of it, and one group is kept."""
    arms = GroupArms(explore_every=8)
    t, end = 0.0, None
    picks: list[int] = []
    cold = 3
    for _ in range(200):
        g = arms.pick(4, 4, 4, t, end)
        picks.append(g)
        if g == 1 and cold:
            t += 0.040
            cold -= 1
        else:
            t += 0.008 if g == 1 else 0.0085
        end = t
        t += 0.001
    assert picks[40:].count(4) <= len(picks[40:]) // 8 + 1  # only the re-measurements
