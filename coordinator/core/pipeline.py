"""Session groups: how many groups of sessions the engine advances through the layers on their own,
and how it splits a step's sequences into them (pure: no I/O, no clock).

Rules:
- ``group_cuts(rows, n)``: ``n`` contiguous groups of the step's sequences (each at least one), the
  cuts placed so that every group's rows are as near ``total / n`` as the sequences allow.
- ``PipelineModel`` learns, from the engine's remote layers, three costs of a layer as functions of
  its rows (``Affine``: least squares over the last ``window`` samples): the coordinator's dense half
  ``dense(r)``, the volunteers' time on it ``remote(r)`` (queue and compute), and the rest of the
  round trip ``latency`` (network, both protocol stacks, both thread hops: an EWMA, independent of
  the rows).
- ``choose_groups``: with ``G`` groups of ``r = rows / G`` rows each, a group's layer takes
  ``latency + remote(r) + dense(r)`` end to end, and the groups share the coordinator
  (``G * dense(r)`` per layer-cycle) and the volunteers (``G * remote(r)``); the cycle is the largest
  of the three and the step's rate ``rows / cycle``. The chosen ``G`` (1..n_seqs) has the best rate,
  and beats one group by ``min_gain`` (the noise of these estimates), else 1. One sequence, or a
  model without samples yet, is one group: the step is computed exactly as without groups.
- ``GroupArms``: the model's pick runs only while measured steps say it is faster than one group
  (per-row step time per arm; the arm not in use re-measured every ``explore_every`` steps).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["Affine", "GroupArms", "PipelineModel", "choose_groups", "group_cuts"]


def group_cuts(rows: list[int], n: int) -> list[int]:
    """Cut points ``[0, c1, ..., len(rows)]`` of ``n`` (clamped to 1..len(rows)) contiguous groups of
    sequences with ``rows[i]`` rows each, every group's rows nearest an equal share."""
    m = len(rows)
    n = max(1, min(n, m))
    prefix = [0]
    for r in rows:
        prefix.append(prefix[-1] + r)
    total = prefix[-1]
    cuts = [0]
    for g in range(1, n):
        lo, hi = cuts[-1] + 1, m - (n - g)  # leave one sequence at least for each later group
        want = total * g / n
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - want), i)))
    cuts.append(m)
    return cuts


@dataclass(frozen=True)
class Affine:
    """``fixed + per_row * rows`` seconds."""

    fixed: float
    per_row: float

    def __call__(self, rows: float) -> float:
        return max(0.0, self.fixed + self.per_row * rows)


def _fit(samples: deque[tuple[float, float]]) -> Affine | None:
    """Least squares of (rows, seconds); the mean alone (no slope) while the rows do not vary."""
    if not samples:
        return None
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((x - mx) ** 2 for x, _ in samples)
    if var <= 1e-12:
        return Affine(my, 0.0)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in samples) / var)
    return Affine(max(0.0, my - b * mx), b)


class PipelineModel:
    def __init__(self, *, window: int = 128, ewma_alpha: float = 0.1, min_gain: float = 0.1) -> None:
        self._dense: deque[tuple[float, float]] = deque(maxlen=window)
        self._remote: deque[tuple[float, float]] = deque(maxlen=window)
        self.latency_s: float | None = None
        self.alpha = ewma_alpha
        self.min_gain = min_gain

    def sample(self, rows: int, dense_s: float, remote_s: float, latency_s: float) -> None:
        """One remote layer of ``rows`` rows: the engine's dense half before it, the volunteers' time
        on it, the rest of its round trip."""
        self._dense.append((float(rows), dense_s))
        self._remote.append((float(rows), remote_s))
        lat = max(0.0, latency_s)
        self.latency_s = lat if self.latency_s is None else (1 - self.alpha) * self.latency_s + self.alpha * lat

    def groups(self, n_seqs: int, rows: int) -> int:
        dense, remote = _fit(self._dense), _fit(self._remote)
        if n_seqs < 2 or dense is None or remote is None or self.latency_s is None:
            return 1
        return choose_groups(n_seqs, rows, self.latency_s, dense, remote, min_gain=self.min_gain)


def cycle_s(groups: int, rows: int, latency_s: float, dense: Affine, remote: Affine) -> float:
    """The seconds per layer of a step of ``rows`` rows in ``groups`` groups (module rules)."""
    r = rows / groups
    return max(latency_s + remote(r) + dense(r), groups * dense(r), groups * remote(r))


def choose_groups(n_seqs: int, rows: int, latency_s: float, dense: Affine, remote: Affine, *,
                  min_gain: float = 0.1) -> int:
    if n_seqs < 2:
        return 1
    one = cycle_s(1, rows, latency_s, dense, remote)
    best, best_cycle = 1, one
    for g in range(2, n_seqs + 1):
        c = cycle_s(g, rows, latency_s, dense, remote)
        if c < best_cycle:
            best, best_cycle = g, c
    return best if one > best_cycle * (1 + min_gain) else 1


class GroupArms:
    """The model's pick checked against what steps really take: the pick ``G`` runs only while its
    measured seconds per row (per ``(sequences, groups)``: the median of its last ``window`` steps, from a
    step's start to its last layer's end) beat one group's. The model cannot see every cost — on one
    machine the volunteers share the coordinator's cores, and each group pays its own protocol work — so
    a pick that is slower in fact is dropped. Both arms are measured first, in turn (the model's pick,
    then one group, until each has ``first`` steps); then every ``explore_every``-th step runs the arm
    not in use, so a changed network is noticed. More groups are chosen only when their median beats one
    group's by ``margin`` (a share of it): one group makes fewer calls, and steps vary by tens of percent
    here (the interpreter lock, the scheduler) -- with an EWMA of a third per step, one first sample
    each and no margin, a noisy run of one group against the other arm's lucky sample flipped the
    choice to the slower arm for a fifth to a third of the steps (a backbone coordinator at 4 sessions
    on loopback, where one group is a few percent faster). Means of 8 such steps still differ by 10 %
    and more between two equal arms (measured there: 1.6-2.3 ms a row for one group, 1.7-1.8 for two),
    and a mean kept a cold start's steps (new graph shapes: tens of ms) for 8 re-measurements -- with
    one re-measurement in ~9 steps, four groups ran half of a 128-token case there. Hence the median
    and a margin of 20 % (a pipelining gain smaller than that is given up for choices that hold). Steps
    are sampled only while the model's pick is more than one group: one group's steps before (the
    workers' probation, every call also computed here: 6 ms a row against 1.7) made four groups look
    twice as fast."""

    def __init__(self, *, explore_every: int = 24, window: int = 8, margin: float = 0.2, first: int = 3) -> None:
        self.explore_every, self.window, self.margin, self.first = explore_every, window, margin, first
        self.per_row: dict[tuple[int, int], float] = {}
        self._samples: dict[tuple[int, int], deque[float]] = {}
        self._open: tuple[int, int, int, float] | None = None  # (sequences, groups, rows, started)
        self._steps = 0

    def close(self, last_end: float | None) -> None:
        """The step begun last ended its last layer at ``last_end`` (None or earlier: no sample)."""
        if self._open is None:
            return
        n, g, rows, t0 = self._open
        self._open = None
        if last_end is None or last_end <= t0 or rows <= 0:
            return
        d = self._samples.setdefault((n, g), deque(maxlen=self.window))
        d.append((last_end - t0) / rows)
        self.per_row[(n, g)] = statistics.median(d)

    def pick(self, n_seqs: int, rows: int, model_g: int, now: float, last_end: float | None) -> int:
        self.close(last_end)
        g = self._choose(n_seqs, model_g)
        # measured only where there is a choice: one group's steps while the model wants one are another
        # regime (a coordinator's first minute: its workers' calls all checked here, graphs built) that
        # would stand against the model's pick for a window of re-measurements
        self._open = (n_seqs, g, rows, now) if model_g > 1 else None
        return g

    def _choose(self, n: int, model_g: int) -> int:
        if model_g <= 1:
            return 1
        self._steps += 1
        seen_g, seen_1 = len(self._samples.get((n, model_g), ())), len(self._samples.get((n, 1), ()))
        if min(seen_g, seen_1) < self.first:  # both arms measured first, in turn, ``first`` times each
            return model_g if seen_g <= seen_1 else 1
        mine, one = self.per_row[(n, model_g)], self.per_row[(n, 1)]
        best, other = (model_g, 1) if mine < one * (1.0 - self.margin) else (1, model_g)
        return other if self._steps % self.explore_every == 0 else best
