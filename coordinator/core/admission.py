"""Experienced speed and admission with a floor (pure core: no clock, no I/O; ``now`` is given).

A *session* here is one request while the coordinator runs it (queued or in a slot). The core
measures the speed each session experiences and decides whether a new one may start.

Speed rules:
- ``started(sid, now)`` when a request is admitted; ``tokens(sid, n, now)`` when ``n`` decode tokens
  of it are sampled at ``now`` (a speculative step emits several at once); ``ended(sid, now)``.
- A session's tps EWMA (``alpha``) is over the intervals between its token deliveries: an EWMA of the
  seconds per token ``(now - last) / n``, inverted (a rate averaged as its inverse, so jitter between
  steps does not inflate it); its first delivery (the token the prefill samples) only starts the clock.
- A session is *warming* from its start until it has decoded ``settle_tokens`` tokens or ``settle_s``
  have passed, whichever first. Warming sessions, and sessions with no EWMA yet, are left out of
  ``mean_active_tps`` (the mean of the others' EWMAs; None when there are none). ``decode_tps`` is the
  sum of every session's EWMA (aggregate; None when no session has one).
- *Settling*: while any session is warming. The settle window after an admit is that session's warming.

Projection rules:
- An admit that started while ``n >= 1`` sessions had a mean ``m0`` is *observed* when its settle
  window ends, if the set of sessions then is exactly those ``n`` plus it and the mean ``m1`` is known:
  its *scaling* ``e = m1 (n + 1) / m0 - n``, the share of one more session's speed the aggregate gained
  (``T(n+1) = T(n) (1 + e / n)``: 0 = the aggregate was shared by one more, 1 = every session kept its
  speed), clamped to [0, 1] (adding a session never speeds the others up; a noisy window must not make
  the projection grow). ``scaling`` is an EWMA of the observed ``e`` (``drop_alpha``); before the first
  observation it is 0 (the model: today's aggregate shared by ``n + 1``).
- ``projected(k)``: the mean with ``k`` more sessions, ``m * prod((j + e) / (j + 1) for j in c .. n+k-1)``
  (``m`` the mean now over the ``c`` sessions it counts, ``n`` the sessions now: the ``n - c`` warming or
  unmeasured ones are admits the mean does not show yet, projected like the ``k`` new ones). Never above
  ``m``. The observed drop per admit is ``m - projected(1)`` when every session is counted.

Admission rules (``decide``), in order; the first that applies wins:
1. a continuation of a running session (the shell tells: an ``X-Session-Id`` it knows, or a prompt that
   starts with a recent prompt: ``remember``/``continues``) is admitted; so is a request with
   ``"overcommit": true``;
2. fewer than ``guarantee_min_sessions`` sessions and none parked: admitted (parked ones count);
3. no floor, or ``advisory`` mode: admitted (``capacity`` still says what enforcing would do);
4. settling: held (``HOLD``, recheck at the window's end) until the hold started ``hold_s`` ago; a hold
   past its bound goes on to rule 5 without the settle window;
5. a session is parked: saturated (``PARKED``, below); else no session, or no measured mean (nothing to protect, or nothing known), or ``projected(1) >= floor``:
   admitted; else saturated, per ``on_saturation``: ``reject`` -> ``REJECT`` with ``retry_after_s``;
   ``warn`` -> admitted with ``sessions_remaining = 0``; ``queue`` -> held until the bound, then rejected.
A session that is admitted is the shell's to ``start`` at once (before anything else is decided).

Preemption by parking (``police``; enforced mode with a floor and ``preempt="park"`` only). The measured mean
can fall below the floor with the sessions unchanged (their contexts grow, so each step attends over more
rows; other processes take the CPU); admission cannot undo an admit, so the coordinator parks:
- A *parked* session's decode is paused (its KV kept in its slot; its client's stream just waits); it is
  left out of ``mean_active_tps``, the projection and the settle window, but still counts as a session
  (it holds its slot, and ``guarantee_min_sessions``).
- Park: when the mean has been below the floor for ``park_after_s`` (default half the settle window)
  without a break and the measurement is *fresh* (every counted session decoded ``ceil(2 / alpha)`` tokens
  since the last park or resume, or ``settle_s`` passed since it), the most recently admitted unparked
  sessions are parked, as many as the projection inverted says bring the mean back to the floor (one
  session fewer of ``n``: ``m * n / (n - 1 + scaling)``; at least one). Never parked: the
  ``guarantee_min_sessions`` first admitted and the last session running; a session resumed less than
  ``min_run_s`` ago only when no other can be (hysteresis yields to the floor). Parks repeat, one batch per fresh
  measurement, while the mean stays below.
- Resume (before any park is considered; at most one per call): the session parked longest resumes when
  the mean is not below the floor, the measurement is fresh and ``projected`` with it back is at least
  ``floor * (1 + resume_margin * (1 + f))`` (hysteresis; ``f``: the resumes in a row followed by a park
  within ``min_run_s``, so a projection that was wrong once must clear a wider margin), or when nothing
  else runs; and, whatever the projection,
  once it has been parked ``max_park_s`` (the bound: a parked session always resumes). Every session due
  resumes in the same call; when the mean is below the floor or the projection with them back is, as
  many park candidates are parked in their place (a *swap*), so over-subscribed sessions take turns of
  ``max_park_s`` rather than one waiting forever.
- A parked session that comes to be among the ``guarantee_min_sessions`` first admitted (earlier ones ended)
  resumes at the next call, whatever the mean: those are never parked.
- A resumed session restarts its clock (its tokens' interval spans the pause) and warms again: its settle
  window is an admit's. A parked session that ends leaves the parked set.
- No ordinary admit while a session is parked (``decide``: ``PARKED`` -- held, rejected or warned per
  ``on_saturation``, as below the floor, but ``warn`` rejects too: no admit goes ahead of a parked session;
  ``capacity``: ``can_admit`` false, no headroom). Continuations
  and ``overcommit`` still pass (rule 1).

``capacity`` is rule 5's answer for one more ordinary request at ``now`` (``can_admit``; its
``projected_mean_tps_if_admitted`` counts the parked sessions as resumed first), with
``headroom_sessions``: how many more ordinary sessions fit (by the projection and the free slots; at
least what ``guarantee_min_sessions`` still guarantees).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

__all__ = [
    "AdmissionCore",
    "AdmissionPolicy",
    "Capacity",
    "Decision",
    "Park",
    "Resume",
    "Reason",
    "Verdict",
]

Mode = Literal["advisory", "enforced"]
OnSaturation = Literal["reject", "warn", "queue"]
Preempt = Literal["park", "off"]


@dataclass(frozen=True)
class AdmissionPolicy:
    tps_floor: float | None = None  # None: no floor, nothing is gated
    mode: Mode = "advisory"
    on_saturation: OnSaturation = "reject"
    guarantee_min_sessions: int = 0
    settle_tokens: int = 48
    settle_s: float = 5.0
    hold_s: float = 10.0  # the bound of a hold (settling, or a queued request under on_saturation=queue)
    retry_after_s: float = 2.0  # the least Retry-After of a rejection
    alpha: float = 0.2  # a session's tps EWMA
    drop_alpha: float = 0.5  # the EWMA of observed scaling per admit
    session_ttl_s: float = 600.0  # a finished session's continuations are recognised this long
    max_remembered: int = 4096  # continuation keys kept (least recently used dropped)
    preempt: Preempt = "park"  # enforced mode: park sessions while the mean stays below the floor
    park_after_s: float | None = None  # below the floor this long without a break -> park (None: settle_s / 2)
    max_park_s: float = 30.0  # a parked session resumes after this long, whatever the projection
    min_run_s: float | None = None  # a resumed session is not parked again before this (None: 2 * settle_s)
    resume_margin: float = 0.05  # resume only if the projection with it back is this share above the floor

    def __post_init__(self) -> None:
        if self.tps_floor is not None and not (self.tps_floor > 0 and math.isfinite(self.tps_floor)):
            raise ValueError("tps_floor must be a positive number")
        if self.guarantee_min_sessions < 0 or self.settle_tokens < 1 or self.settle_s < 0 or self.hold_s < 0:
            raise ValueError("guarantee_min_sessions >= 0, settle_tokens >= 1, settle_s >= 0, hold_s >= 0")
        if not (0 < self.alpha <= 1 and 0 < self.drop_alpha <= 1):
            raise ValueError("alpha and drop_alpha in (0, 1]")
        if (self.park_after_s is not None and self.park_after_s < 0) or self.max_park_s <= 0 \
                or (self.min_run_s is not None and self.min_run_s < 0) or self.resume_margin < 0:
            raise ValueError("park_after_s >= 0, max_park_s > 0, min_run_s >= 0, resume_margin >= 0")

    @property
    def park_after(self) -> float:
        return self.settle_s / 2 if self.park_after_s is None else self.park_after_s

    @property
    def min_run(self) -> float:
        return 2 * self.settle_s if self.min_run_s is None else self.min_run_s

    @property
    def parks(self) -> bool:
        """Whether ``police`` acts at all."""
        return self.preempt == "park" and self.mode == "enforced" and self.tps_floor is not None


class Verdict(StrEnum):
    ADMIT = "admit"
    HOLD = "hold"
    REJECT = "reject"


class Reason(StrEnum):
    CONTINUATION = "continuation"
    OVERCOMMIT = "overcommit"
    GUARANTEED = "guaranteed"  # below guarantee_min_sessions
    NO_FLOOR = "no_floor"
    ADVISORY = "advisory"  # a floor, but only reported
    IDLE = "idle"  # no session running
    UNMEASURED = "unmeasured"  # sessions run, none measured yet (and not settling)
    SETTLING = "settling"
    ABOVE_FLOOR = "projected_above_floor"
    BELOW_FLOOR = "projected_below_floor"
    SLOTS_FULL = "slots_full"  # capacity only: every slot busy (a request would queue)
    HOLD_EXPIRED = "hold_expired"  # a queued request's hold ran out
    PARKED = "parked_waiting"  # a parked session resumes before any new admit


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: Reason
    recheck_at: float | None = None  # HOLD: decide again then (or sooner, when sessions change)
    retry_after_s: float | None = None  # REJECT
    sessions_remaining: int | None = None  # warn: admitted past saturation (0)


@dataclass(frozen=True)
class Park:
    """Pause ``sid``'s decode (its KV kept)."""

    sid: Hashable


@dataclass(frozen=True)
class Resume:
    """Let ``sid`` decode again."""

    sid: Hashable


@dataclass(frozen=True)
class Capacity:
    """``GET /capacity`` (DESIGN §11), but ``kv_headroom_pct``, ``slots`` and ``queue``, which the shell knows."""

    can_admit: bool
    projected_mean_tps_if_admitted: float | None
    headroom_sessions: int
    settling: bool
    settle_remaining_ms: int
    reason: Reason
    mean_active_tps: float | None
    decode_tps: float | None
    tps_floor: float | None
    active_sessions: int
    warming_sessions: int
    scaling_per_admit: float
    admits_observed: int
    admission: Mode
    parked_sessions: int = 0


@dataclass
class _Session:
    started: float
    order: int = 0  # admission order (the first admitted is 0)
    decoded: int = 0
    last_at: float | None = None
    spt: float | None = None  # EWMA of seconds per decode token
    mark: int = 0  # ``decoded`` at the last park or resume (freshness)
    parked_at: float | None = None  # parked since (None: decoding)
    resumed_at: float | None = None
    parks: int = 0

    @property
    def tps(self) -> float | None:
        return None if self.spt is None else 1.0 / self.spt


@dataclass
class _Pending:
    """An admit waiting for its settle window to end, to be observed."""

    sid: Hashable
    before: frozenset[Hashable]
    mean_before: float


@dataclass
class AdmissionCore:
    policy: AdmissionPolicy
    sessions: dict[Hashable, _Session] = field(default_factory=dict)
    scaling: float = 0.0
    observed: int = 0
    _pending: list[_Pending] = field(default_factory=list)
    _recent: OrderedDict[Hashable, float] = field(default_factory=OrderedDict)
    _lengths: dict[int, int] = field(default_factory=dict)  # remembered prompt lengths -> how many
    _order: int = 0
    _below_since: float | None = None  # the mean below the floor since (police)
    _changed_at: float | None = None  # the last park or resume
    parks_total: int = 0
    resumes_total: int = 0
    forced_resumes_total: int = 0  # resumed by the bound (max_park_s)
    _last_resume_at: float | None = None
    _resume_fails: int = 0  # resumes followed by a park within min_run_s (each raises the resume margin)

    # -- speed ------------------------------------------------------------------------------------
    def started(self, sid: Hashable, now: float) -> None:
        if sid in self.sessions:
            return
        m = self.mean_active_tps(now)
        if m is not None and self.sessions and not self.parked():
            self._pending.append(_Pending(sid, frozenset(self.sessions), m))
        self.sessions[sid] = _Session(now, order=self._order)
        self._order += 1

    def tokens(self, sid: Hashable, n: int, now: float) -> None:
        s = self.sessions.get(sid)
        if s is None or n <= 0 or s.parked_at is not None:
            return  # a parked session's token from the step that ran as it was parked: not a speed
        if s.last_at is not None:
            s.decoded += n
            if now > s.last_at:
                inst = (now - s.last_at) / n
                a = self.policy.alpha
                s.spt = inst if s.spt is None else (1 - a) * s.spt + a * inst
            else:
                return  # the same instant: counted, and the next interval carries these tokens' time
        s.last_at = now
        self._observe(now)

    def ended(self, sid: Hashable, now: float) -> None:
        if self.sessions.pop(sid, None) is not None:
            self._pending = [p for p in self._pending if p.sid != sid and sid not in p.before]
            if not self.sessions:
                self._below_since = None
            self._observe(now)

    def warming(self, sid: Hashable, now: float) -> bool:
        s = self.sessions.get(sid)
        if s is None or s.parked_at is not None:
            return False
        return s.decoded < self.policy.settle_tokens and now - s.started < self.policy.settle_s

    def parked(self) -> list[Hashable]:
        """The parked sessions, parked longest first."""
        ps = [(s.parked_at, s.order, sid) for sid, s in self.sessions.items() if s.parked_at is not None]
        return [sid for _, _, sid in sorted(ps, key=lambda x: (x[0], x[1]))]

    def is_parked(self, sid: Hashable) -> bool:
        s = self.sessions.get(sid)
        return s is not None and s.parked_at is not None

    def _counted(self, now: float) -> list[float]:
        """The speeds ``mean_active_tps`` averages: unparked, measured, past their settle window."""
        return [s.tps for sid, s in self.sessions.items()
                if s.tps is not None and s.parked_at is None and not self.warming(sid, now)]

    def session_tps(self, sid: Hashable) -> float | None:
        s = self.sessions.get(sid)
        return s.tps if s is not None else None

    def mean_active_tps(self, now: float) -> float | None:
        xs = self._counted(now)
        return sum(xs) / len(xs) if xs else None

    def decode_tps(self) -> float | None:
        xs = [s.tps for s in self.sessions.values() if s.tps is not None and s.parked_at is None]
        return sum(xs) if xs else None

    def settle_remaining_s(self, now: float) -> float:
        """Until the last warming session stops warming by time (it may stop sooner by tokens)."""
        p = self.policy
        left = [s.started + p.settle_s - now for sid, s in self.sessions.items() if self.warming(sid, now)]
        return max(left, default=0.0)

    def _observe(self, now: float) -> None:
        """Settle windows that ended: their admits' scaling, when the sessions are those it was measured on."""
        keep: list[_Pending] = []
        for p in self._pending:
            if self.warming(p.sid, now):
                keep.append(p)
                continue
            if set(self.sessions) != p.before | {p.sid}:
                continue  # sessions came or went meanwhile: the change is not this admit's alone
            m1 = self.mean_active_tps(now)
            if m1 is None:
                if self.sessions[p.sid].tps is None and now - self.sessions[p.sid].started < 4 * self.policy.settle_s:
                    keep.append(p)  # no decode token yet (a long prefill): wait for its first measurement
                continue
            n = len(p.before)
            e = min(1.0, max(0.0, m1 * (n + 1) / p.mean_before - n))
            a = self.policy.drop_alpha
            self.scaling = e if self.observed == 0 else (1 - a) * self.scaling + a * e
            self.observed += 1
        self._pending = keep

    # -- projection ----------------------------------------------------------------------------
    def projected(self, k: int, now: float) -> float | None:
        counted = self._counted(now)
        n = sum(1 for s in self.sessions.values() if s.parked_at is None)
        if not counted:
            return None
        m, c = sum(counted) / len(counted), len(counted)
        for j in range(c, n + k):
            m *= (j + self.scaling) / (j + 1)
        return m

    # -- preemption by parking -------------------------------------------------------------------
    def _fresh(self, now: float) -> bool:
        """Whether the mean reflects the last park or resume (module rules)."""
        if self._changed_at is None or now - self._changed_at >= self.policy.settle_s:
            return True
        need = math.ceil(2 / self.policy.alpha)
        return all(s.decoded - s.mark >= need for sid, s in self.sessions.items()
                   if s.parked_at is None and s.tps is not None and not self.warming(sid, now))

    def _park_candidates(self, now: float, *, besides: Hashable | None = None) -> list[Hashable]:
        """The sessions that may be parked, most recently admitted first (module rules)."""
        p = self.policy
        ranked = sorted(self.sessions.items(), key=lambda kv: kv[1].order)
        unparked = sum(1 for s in self.sessions.values() if s.parked_at is None)
        room = unparked - max(1, p.guarantee_min_sessions)  # never the last one running: it slows nobody
        free = [sid for sid, s in reversed(ranked[p.guarantee_min_sessions:]) if s.parked_at is None and sid != besides]
        recent = [sid for sid in free if (r := self.sessions[sid].resumed_at) is not None and now - r < p.min_run]
        # hysteresis yields to the floor: a session resumed lately is passed over while another can be parked
        return ([sid for sid in free if sid not in recent] + recent)[:max(0, room)]

    def _to_park(self, m: float, floor: float) -> int:
        """How many to park so the projection comes back to the floor: the projection inverted (one session
        fewer of ``n`` running: ``m * n / (n - 1 + e)``), at least one."""
        n = sum(1 for s in self.sessions.values() if s.parked_at is None)
        k = 0
        while m < floor and n - k > 1:
            j = n - k
            m *= j / (j - 1 + self.scaling)
            k += 1
        return max(1, k)

    def _mark(self, now: float) -> None:
        self._changed_at = now
        self._pending.clear()  # the sessions changed: no admit's observation is its own any more
        for s in self.sessions.values():
            s.mark = s.decoded

    def _park(self, sid: Hashable, now: float) -> Park:
        if self._last_resume_at is not None and now - self._last_resume_at < self.policy.min_run:
            self._resume_fails = min(self._resume_fails + 1, 10)  # that resume was wrong: resume more warily
            self._last_resume_at = None
        s = self.sessions[sid]
        s.parked_at = now
        s.parks += 1
        s.last_at = None  # the pause is no interval of its speed
        self.parks_total += 1
        return Park(sid)

    def _resume(self, sid: Hashable, now: float) -> Resume:
        s = self.sessions[sid]
        s.parked_at = None
        s.resumed_at = now
        s.started, s.decoded, s.last_at = now, 0, None  # warms again, its clock restarted
        self.resumes_total += 1
        self._last_resume_at = now
        return Resume(sid)

    def police(self, now: float) -> list[Park | Resume]:
        """Park or resume sessions (module rules); the shell pauses or resumes their decode at once."""
        p = self.policy
        if not p.parks:
            out: list[Park | Resume] = [self._resume(sid, now) for sid in self.parked()]  # policy off: none stays parked
            if out:
                self._mark(now)
            return out
        floor = p.tps_floor
        assert floor is not None
        m = self.mean_active_tps(now)
        below = m is not None and m < floor
        if not below:
            self._below_since = None
        elif self._below_since is None:
            self._below_since = now
        if self._last_resume_at is not None and now - self._last_resume_at >= p.min_run:
            self._resume_fails, self._last_resume_at = 0, None  # the last resume held
        waiting = self.parked()
        if waiting:
            first = {sid for sid, _ in sorted(self.sessions.items(), key=lambda kv: kv[1].order)[:p.guarantee_min_sessions]}
            owed = [sid for sid in waiting if sid in first]  # guaranteed now that earlier sessions ended
            if owed:
                self._mark(now)
                return [self._resume(sid, now) for sid in owed]
            running = any(s.parked_at is None for s in self.sessions.values())
            due = [sid for sid in waiting if now - (self.sessions[sid].parked_at or now) >= p.max_park_s]
            if due:
                acts: list[Park | Resume] = []
                proj = self.projected(len(due), now)
                if running and (below or (proj is not None and proj < floor)):
                    swap = [c for c in self._park_candidates(now) if c not in due][:len(due)]
                    acts.extend(self._park(c, now) for c in swap)
                acts.extend(self._resume(sid, now) for sid in due)
                self.forced_resumes_total += len(due)
                self._mark(now)
                return acts
            if not running:
                self._mark(now)
                return [self._resume(waiting[0], now)]
            if not below and self._fresh(now) and self.settle_remaining_s(now) <= 0:
                proj = self.projected(1, now)
                if proj is not None and proj >= floor * (1 + p.resume_margin * (1 + self._resume_fails)):
                    act = self._resume(waiting[0], now)
                    self._mark(now)
                    return [act]
        if below and m is not None and self._below_since is not None and now - self._below_since >= p.park_after \
                and self._fresh(now):
            cands = self._park_candidates(now)[:self._to_park(m, floor)]
            if cands:
                parked: list[Park | Resume] = [self._park(c, now) for c in cands]
                self._mark(now)
                return parked
        return []

    # -- continuations -------------------------------------------------------------------------
    def remember(self, key: Hashable, now: float, *, length: int | None = None) -> None:
        """A session key (an ``X-Session-Id``, or a prompt's hash at ``length`` tokens) seen at ``now``."""
        if key not in self._recent and length is not None:
            self._lengths[length] = self._lengths.get(length, 0) + 1
        self._recent[key] = now
        self._recent.move_to_end(key)
        self._expire(now)
        while len(self._recent) > self.policy.max_remembered:
            self._drop(next(iter(self._recent)))

    def _drop(self, key: Hashable) -> None:
        del self._recent[key]
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int):
            n = self._lengths.get(key[0], 0) - 1
            if n > 0:
                self._lengths[key[0]] = n
            else:
                self._lengths.pop(key[0], None)

    def _expire(self, now: float) -> None:
        ttl = self.policy.session_ttl_s
        while self._recent:
            key, at = next(iter(self._recent.items()))
            if now - at <= ttl:
                break
            self._drop(key)

    def remembered_lengths(self) -> list[int]:
        """The prompt lengths a continuation may extend (longest first): the shell hashes a prompt at these."""
        return sorted(self._lengths, reverse=True)

    def continues(self, keys: Sequence[Hashable], now: float) -> bool:
        """Whether any of ``keys`` is a remembered session key (refreshed then)."""
        self._expire(now)
        for k in keys:
            if k in self._recent:
                self._recent[k] = now
                self._recent.move_to_end(k)
                return True
        return False

    # -- decisions -----------------------------------------------------------------------------
    def decide(self, now: float, *, continuation: bool = False, overcommit: bool = False,
               held_since: float | None = None) -> Decision:
        """Whether a new request may start now (see the module rules); ``held_since``: when its hold began."""
        p = self.policy
        if continuation:
            return Decision(Verdict.ADMIT, Reason.CONTINUATION)
        if overcommit:
            return Decision(Verdict.ADMIT, Reason.OVERCOMMIT)
        if len(self.sessions) < p.guarantee_min_sessions and not self.parked():
            return Decision(Verdict.ADMIT, Reason.GUARANTEED)
        if p.tps_floor is None:
            return Decision(Verdict.ADMIT, Reason.NO_FLOOR)
        if p.mode == "advisory":
            return Decision(Verdict.ADMIT, Reason.ADVISORY)
        since = now if held_since is None else held_since
        deadline = since + p.hold_s
        if self.settle_remaining_s(now) > 0 and now < deadline and not self.parked():
            return Decision(Verdict.HOLD, Reason.SETTLING, recheck_at=min(deadline, now + self.settle_remaining_s(now)))
        ok, reason = self._fits(now)
        if ok:
            return Decision(Verdict.ADMIT, reason)
        if reason is Reason.PARKED and p.on_saturation != "queue":
            return Decision(Verdict.REJECT, reason, retry_after_s=self._retry_after(now))  # warn too: never ahead of one
        match p.on_saturation:
            case "warn":
                return Decision(Verdict.ADMIT, reason, sessions_remaining=0)
            case "queue" if now < deadline:
                return Decision(Verdict.HOLD, reason, recheck_at=deadline)
            case _:
                return Decision(Verdict.REJECT, Reason.HOLD_EXPIRED if p.on_saturation == "queue" else reason,
                                retry_after_s=self._retry_after(now))

    def _fits(self, now: float) -> tuple[bool, Reason]:
        """Rule 5: would one more session keep the projected mean at the floor?"""
        floor = self.policy.tps_floor
        if self.parked():
            return False, Reason.PARKED
        if not self.sessions:
            return True, Reason.IDLE
        proj = self.projected(1, now)
        if proj is None or floor is None:
            return True, Reason.UNMEASURED
        return (True, Reason.ABOVE_FLOOR) if proj >= floor else (False, Reason.BELOW_FLOOR)

    def _retry_after(self, now: float) -> float:
        return max(self.policy.retry_after_s, self.settle_remaining_s(now))

    def capacity(self, now: float, *, free_slots: int) -> Capacity:
        p = self.policy
        n = len(self.sessions)
        settle = self.settle_remaining_s(now)
        settling = settle > 0
        floor = p.tps_floor
        guaranteed = max(0, p.guarantee_min_sessions - n)
        fit = free_slots if floor is None else self._headroom(now, free_slots)
        if guaranteed > 0:
            can, reason, headroom = True, Reason.GUARANTEED, max(guaranteed, fit)
        elif free_slots <= 0:
            can, reason, headroom = False, Reason.SLOTS_FULL, 0
        elif floor is None:
            can, reason, headroom = True, Reason.NO_FLOOR, fit
        elif self.parked():
            can, reason, headroom = False, Reason.PARKED, 0
        elif settling and now < now + p.hold_s:  # as ``decide`` holds (hold_s 0: nothing is held)
            can, reason, headroom = False, Reason.SETTLING, fit
        else:
            can, reason = self._fits(now)
            headroom = fit if can else 0
        proj = self.projected(1 + len(self.parked()), now)  # the parked ones resume before a new one starts
        return Capacity(can_admit=can, projected_mean_tps_if_admitted=proj, headroom_sessions=headroom,
                        settling=settling, settle_remaining_ms=int(math.ceil(settle * 1000)), reason=reason,
                        mean_active_tps=self.mean_active_tps(now), decode_tps=self.decode_tps(), tps_floor=floor,
                        active_sessions=n, warming_sessions=sum(1 for sid in self.sessions if self.warming(sid, now)),
                        scaling_per_admit=self.scaling, admits_observed=self.observed, admission=p.mode,
                        parked_sessions=len(self.parked()))

    def _headroom(self, now: float, free_slots: int) -> int:
        floor = self.policy.tps_floor
        assert floor is not None
        if self.parked():
            return 0
        if not self.sessions or self.mean_active_tps(now) is None:
            return max(0, free_slots)
        k = 0
        while k < free_slots:
            proj = self.projected(k + 1, now)
            if proj is None or proj < floor:
                break
            k += 1
        return k
