"""Recruitment and age-out (pure: no I/O, no clock; ``now`` is given).

Rules:
- A coordinator is saturated when its last successful ``/slots`` poll, at most ``poll_stale_s`` old,
  showed the speed its sessions experience at its floor: it reports a ``tps_floor`` and a
  ``mean_active_tps`` (coordinator.core.admission), and the mean, or the mean projected with one
  more session, is below the floor (it could not admit another at the floor). A coordinator that
  reports no floor or no measured mean (an older one; none set; nothing measured yet) falls back to
  ``busy >= threshold`` (default 2). ``coordinator_saturated`` is the one definition: recruitment and
  the dashboard both use it. An older poll says nothing; a failed poll is no observation.
- A model is saturated while any coordinator hosting it is (DESIGN §11).
- Hysteresis (``step``): the model's saturation signal (``RecruitState.recruiting``: the views'
  ``saturated``, and the boost) is smoothed, so a load that flaps between polls gives one steady
  boost instead of a ``saturated``/``unsaturated`` pair every few seconds:
  * enter after ``rise_s`` (S, default 2 s) saturated: a run of saturated observations spanning
    ``rise_s``. An unsaturated observation at least S after the run's last saturated one ends the run
    (a shorter dip is sampling noise, not the end of the load), and so does a gap of more than
    ``poll_stale_s`` between saturated observations (nothing known in between); ``rise_s = 0``: the
    first saturated poll;
  * leave after ``hold_s`` (U, default 10 s) without a saturated observation. No information (no
    fresh poll) neither enters nor extends anything.
  S is short because a load seen over S is real (two or three saturated polls in a row at the market's
  default 2 s interval, as the polls' own times jitter; five at the demo's 0.5 s) and a recruited
  volunteer still needs its download; U is long because that download is wasted if the boost ends in
  the next lull (a retired volunteer also waits out ``cooldown_s`` before it is told to release).
- Age-out (``plan_ageout``), per model, given the effective target:
  * restore first: a retiring (not yet released) holding covering an expert below target is
    dispatched again; served, serving and older holdings are preferred (cheaper than recruiting);
  * then retire surplus: a counted holding (dispatched or loading) is retired when every expert
    it covers keeps at least ``target`` counted holdings without it. Loading before serving,
    never-served before served, youngest first. Retired holdings leave the dispatch map at once
    and are told to release after the cooldown (the shell/state layer does the timing).
  * A holding restored in a round is never retired in the same round (it covers a deficit).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from market.core.demand import Targets, layer_targets

__all__ = [
    "AgeOut",
    "Holding",
    "Observation",
    "PollView",
    "RecruitPolicy",
    "RecruitState",
    "SpeedReport",
    "coordinator_saturated",
    "is_fresh",
    "is_saturated",
    "observe",
    "plan_ageout",
    "speed_saturated",
    "step",
]


@dataclass(frozen=True)
class RecruitPolicy:
    saturation_threshold: int = 2
    rise_s: float = 2.0  # S: saturated this long (dips shorter than S do not count) before the signal is on
    hold_s: float = 10.0  # U: this long without a saturated observation before it is off
    poll_stale_s: float = 10.0


def is_saturated(busy: int, threshold: int) -> bool:
    return busy >= threshold


@dataclass(frozen=True)
class PollView:
    """The last successful poll of one coordinator."""

    busy: int
    slots: int
    at: float
    mean_active_tps: float | None = None  # the coordinator's experienced speed, when it reports one
    tps_floor: float | None = None
    projected_tps: float | None = None  # its mean projected with one more session


@dataclass(frozen=True)
class SpeedReport:
    """What a coordinator's ``/slots`` says of its sessions' speed (all None from one that does not measure it)."""

    mean_active_tps: float | None = None
    tps_floor: float | None = None
    projected_tps: float | None = None


def speed_saturated(poll: PollView) -> bool | None:
    """The speed signal: below the floor now or with one more session; None when the poll carries none."""
    floor, mean = poll.tps_floor, poll.mean_active_tps
    if floor is None or mean is None:
        return None
    return mean < floor or (poll.projected_tps is not None and poll.projected_tps < floor)


def is_fresh(poll: PollView, now: float, policy: RecruitPolicy) -> bool:
    return now - poll.at <= policy.poll_stale_s


def coordinator_saturated(poll: PollView | None, now: float, policy: RecruitPolicy) -> bool:
    """Whether one coordinator, by its last successful poll, is saturated at ``now``."""
    if poll is None or not is_fresh(poll, now, policy):
        return False
    by_speed = speed_saturated(poll)
    return by_speed if by_speed is not None else is_saturated(poll.busy, policy.saturation_threshold)


@dataclass(frozen=True)
class Observation:
    saturated: bool
    at: float  # when the deciding poll was taken


def observe(polls: Iterable[PollView | None], now: float, policy: RecruitPolicy) -> Observation | None:
    """What the fresh polls of a model's coordinators say; ``None`` when none is fresh."""
    fresh = [p for p in polls if p is not None and is_fresh(p, now, policy)]
    if not fresh:
        return None
    sat = [p.at for p in fresh if coordinator_saturated(p, now, policy)]
    if sat:
        return Observation(True, max(sat))
    return Observation(False, max(p.at for p in fresh))


@dataclass(frozen=True)
class RecruitState:
    recruiting: bool = False  # the smoothed saturation signal: saturated, boosted
    changed_at: float = 0.0
    last_saturated_at: float | None = None  # the latest saturated observation
    saturated_since: float | None = None  # the first saturated observation of the current run

    def saturated_for(self, at: float) -> float:
        """How long the current run of saturated observations has lasted at ``at`` (0 without one)."""
        return 0.0 if self.saturated_since is None else max(0.0, at - self.saturated_since)


def step(state: RecruitState, obs: Observation | None, now: float, policy: RecruitPolicy) -> RecruitState:
    """The model's recruitment state after observing ``obs`` at ``now`` (see the hysteresis rule)."""
    s = state
    last = s.last_saturated_at
    if obs is not None and obs.saturated:
        new_run = s.saturated_since is None or last is None or obs.at - last > policy.poll_stale_s
        since = obs.at if new_run or s.saturated_since is None else s.saturated_since
        s = replace(s, last_saturated_at=obs.at if last is None else max(last, obs.at), saturated_since=since)
        if not s.recruiting and obs.at - since >= policy.rise_s:
            s = replace(s, recruiting=True, changed_at=now)
        return s
    if obs is not None and s.saturated_since is not None and (last is None or obs.at - last >= policy.rise_s):
        s = replace(s, saturated_since=None)  # the dip outlasted rise_s: the run is over
    if s.recruiting and (last is None or now - last >= policy.hold_s):
        s = replace(s, recruiting=False, changed_at=now, saturated_since=None)
    return s


K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Holding(Generic[K]):
    """One (volunteer, slice) as age-out sees it."""

    key: K
    peer_id: str
    layer: int
    lo: int
    hi: int
    since: float
    serving: bool  # reported serving (else loading)
    served: bool  # a coordinator verified its answers
    counted: bool  # dispatched or loading, not retiring
    restorable: bool = False  # retiring, cooldown not over


@dataclass
class AgeOut(Generic[K]):
    restore: list[K] = field(default_factory=list)
    retire: list[K] = field(default_factory=list)


def plan_ageout(n_layer: int, n_expert: int, target: Targets, holdings: Sequence[Holding[K]]) -> AgeOut[K]:
    """Which retiring holdings to dispatch again and which counted ones to retire (see the rules);
    ``target`` is one for every expert or per layer, per expert."""
    tl = [layer_targets(target, layer, n_expert) for layer in range(n_layer)]
    counts = [[0] * n_expert for _ in range(n_layer)]
    for h in holdings:
        if h.counted:
            row = counts[h.layer]
            for e in range(h.lo, h.hi):
                row[e] += 1
    out: AgeOut[K] = AgeOut()
    for h in sorted(
        (h for h in holdings if h.restorable and not h.counted),
        key=lambda h: (not h.served, not h.serving, h.since, h.peer_id),
    ):
        row = counts[h.layer]
        if any(row[e] < tl[h.layer][e] for e in range(h.lo, h.hi)):
            out.restore.append(h.key)
            for e in range(h.lo, h.hi):
                row[e] += 1
    for h in sorted(
        (h for h in holdings if h.counted),
        key=lambda h: (h.serving, h.served, -h.since, h.peer_id),
    ):
        row = counts[h.layer]
        if all(row[e] - 1 >= tl[h.layer][e] for e in range(h.lo, h.hi)):
            out.retire.append(h.key)
            for e in range(h.lo, h.hi):
                row[e] -= 1
    return out
