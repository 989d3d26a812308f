"""What a simulation measures, and its JSON report (shell-side bookkeeping: it watches, never decides).

Measures (DESIGN §10; issue 27):
- Coverage holes: every ``sample_s`` the market's live replica counts per (layer, expert) are read; an
  expert with no dispatched volunteer replica is a hole for that sample's seconds (the coordinator computes
  it itself if it holds it, else nobody does), one below its effective target is a deficit. Reported in
  expert-seconds: in all, per layer, their spread over experts and the worst experts; also from the first
  sample of full coverage on (the start-up fill is not churn's fault).
- Recruitment episodes, one per saturation signal the market raised (its own ``saturated`` /
  ``unsaturated`` events): ``detect_s`` (load step -> the market's signal on), ``reaction_s`` (signal on ->
  the coordinator's first successful dial of a worker leased after it: a recruited worker serving, as
  ``benchmarks/_recruitment.py`` measures), ``unboost_s`` (load end -> signal off) and ``age_out_s`` (load
  end -> the last surplus holding the market retired has left the market: released or expired).
- Market requests by endpoint: in all, mean and peak per second (1-second buckets).
- Lease churn: the market's event counts (leases granted and lapsed, leases converted to coverage,
  surplus retired, restored, released, volunteers expired, holdings dropped unproven / overdue) and its
  counters.
Rules: the report holds only simulated quantities (no wall time), rounded to 6 digits, keys sorted, so
the same scenario and seed give the same bytes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from market.core.records import SliceRef
from market.policy import MarketPolicy
from sim.scenario import Scenario

if TYPE_CHECKING:
    from market.state import Market

__all__ = ["Episode", "Metrics", "rounded"]

_TIMELINE_POINTS = 720


def rounded(x: Any) -> Any:
    """``x`` with every float rounded to 6 digits (and non-finite ones as None), recursively."""
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v) for v in x]
    return x


@dataclass
class Episode:
    saturated_at: float
    serving_at: float | None = None  # the first recruited worker serving
    unsaturated_at: float | None = None
    retiring: set[tuple[str, SliceRef]] = field(default_factory=set)
    retired: int = 0
    aged_out_at: float | None = None


class Metrics:
    def __init__(self, sc: Scenario, policy: MarketPolicy) -> None:
        self.sc = sc
        self.policy = policy
        self.n_sec = int(math.ceil(sc.duration_s)) + 1
        self.requests: dict[str, list[int]] = {}
        self.events: Counter[str] = Counter()
        shape = (sc.model.n_layer, sc.model.n_expert)
        self.hole_s = np.zeros(shape)
        self.deficit_s = np.zeros(shape)
        self.hole_after_full_s = np.zeros(shape)
        self.full_at: float | None = None
        self.timeline: list[list[float]] = []
        self.episodes: list[Episode] = []
        self.assigned_at: dict[tuple[str, SliceRef], float] = {}
        self.sessions = 0
        self.ends: Counter[str] = Counter()
        self.dial_failures: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self._last_sample: float | None = None
        self.steps: list[list[float | None]] = []  # [load rose to >= threshold, fell below it (None: not yet)]

    # -- inputs -------------------------------------------------------------------------------------
    def load(self, now: float, busy: int) -> None:
        """The coordinator's busy count changed."""
        rising = busy >= self.policy.saturation_threshold
        if rising and (not self.steps or self.steps[-1][1] is not None):
            self.steps.append([now, None])
        elif not rising and self.steps and self.steps[-1][1] is None:
            self.steps[-1][1] = now

    def request(self, endpoint: str, now: float) -> None:
        buckets = self.requests.get(endpoint)
        if buckets is None:
            buckets = self.requests[endpoint] = [0] * self.n_sec
        buckets[min(self.n_sec - 1, int(now))] += 1

    def refused(self, code: str) -> None:
        self.refusals[code] += 1

    def dial_failed(self, nat: str) -> None:
        self.dial_failures[nat] += 1

    def session_started(self, now: float) -> None:
        self.sessions += 1

    def session_ended(self, now: float, graceful: bool) -> None:
        self.ends["graceful" if graceful else "vanished"] += 1

    def on_market_event(self, kind: str, now: float, peer: str | None, s: SliceRef | None, detail: str) -> None:
        key = "retired" if kind == "draining" and detail == "surplus" else kind
        self.events[key] += 1
        ep = self.episodes[-1] if self.episodes else None
        if kind == "saturated":
            self.episodes.append(Episode(now))
        elif kind == "unsaturated" and ep is not None:
            ep.unsaturated_at = now
        elif kind == "assigned" and peer is not None and s is not None:
            self.assigned_at[(peer, s)] = now
        elif ep is None or ep.unsaturated_at is None:
            return
        elif key == "retired" and peer is not None and s is not None:
            ep.retiring.add((peer, s))
            ep.retired += 1
        elif kind in ("released", "unproven", "download_overdue", "restored") and peer is not None and s is not None:
            self._gone(ep, {(peer, s)}, now, released=kind != "restored")
        elif kind == "expired" and peer is not None:
            self._gone(ep, {k for k in ep.retiring if k[0] == peer}, now, released=True)

    def _gone(self, ep: Episode, keys: set[tuple[str, SliceRef]], now: float, *, released: bool) -> None:
        hit = keys & ep.retiring
        if not hit:
            return
        ep.retiring -= hit
        if not ep.retiring and released:
            ep.aged_out_at = now

    def serving(self, peer: str, key: tuple[str, int, int, int], now: float) -> bool:
        """The coordinator dialled ``peer`` for ``key`` successfully: calls flow. True when it is the
        current episode's first recruited worker serving."""
        ep = self.episodes[-1] if self.episodes else None
        if ep is None or ep.serving_at is not None or ep.unsaturated_at is not None:
            return False
        at = self.assigned_at.get((peer, SliceRef(*key)))
        if at is not None and at >= ep.saturated_at:
            ep.serving_at = now
            return True
        return False

    def sample(self, market: Market, now: float, busy: int, online: int) -> None:
        mid = self.sc.model.id
        counts = market.ix.counts.get(mid)
        if counts is None:
            return
        dt = 0.0 if self._last_sample is None else now - self._last_sample
        self._last_sample = now
        reps = np.asarray(counts.replicas)
        target = market.ix.targets(mid)
        holes = reps == 0
        deficit = reps < (target if isinstance(target, int) else np.asarray(target))
        n_holes = int(holes.sum())
        if dt > 0:
            self.hole_s += holes * dt
            self.deficit_s += deficit * dt
            if self.full_at is not None:
                self.hole_after_full_s += holes * dt
        if self.full_at is None and n_holes == 0:
            self.full_at = now
        recruiting = 1.0 if market.ix.recruiting(mid) else 0.0
        self.timeline.append([now, float(busy), recruiting, float(online), float(n_holes), float(deficit.sum()),
                              float(reps.sum()), float(reps.min())])

    # -- output -------------------------------------------------------------------------------------
    def _spread(self, a: np.ndarray) -> dict[str, Any]:
        flat = a.ravel()
        order = np.argsort(-flat, kind="stable")[:10]
        n_expert = a.shape[1]
        return {
            "expert_seconds": float(flat.sum()),
            "share_of_expert_time": float(flat.sum() / (flat.size * self.sc.duration_s)),
            "per_layer": [float(x) for x in a.sum(axis=1)],
            "per_expert_quantiles": {q: float(np.quantile(flat, p)) for q, p in
                                     (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))},
            "worst": [[int(i) // n_expert, int(i) % n_expert, float(flat[i])] for i in order if flat[i] > 0],
        }

    def _episodes(self) -> list[dict[str, Any]]:
        out = []
        for ep in self.episodes:
            up = max((s for s in self.steps if s[0] is not None and s[0] <= ep.saturated_at),
                     key=lambda s: s[0] or 0.0, default=None)
            t_up, t_down = (up[0], up[1]) if up is not None else (None, None)
            out.append({
                "load_step_at": t_up,
                "saturated_at": ep.saturated_at,
                "detect_s": None if t_up is None else ep.saturated_at - t_up,
                "serving_at": ep.serving_at,
                "reaction_s": None if ep.serving_at is None else ep.serving_at - ep.saturated_at,
                "step_to_serving_s": None if ep.serving_at is None or t_up is None else ep.serving_at - t_up,
                "load_end_at": t_down,
                "unsaturated_at": ep.unsaturated_at,
                "unboost_s": None if ep.unsaturated_at is None or t_down is None else ep.unsaturated_at - t_down,
                "retired": ep.retired,
                "still_retiring": len(ep.retiring),
                "aged_out_at": ep.aged_out_at if not ep.retiring else None,
                "age_out_s": None if ep.aged_out_at is None or ep.retiring or t_down is None
                else ep.aged_out_at - t_down,
            })
        return out

    def report(self, market: Market, end: float) -> dict[str, Any]:
        sc = self.sc
        requests = {}
        for name, buckets in sorted(self.requests.items()):
            n = sum(buckets)
            requests[name] = {"total": n, "per_s_mean": n / sc.duration_s, "per_s_peak": max(buckets)}
        stride = max(1, len(self.timeline) // _TIMELINE_POINTS)
        churn = {k: {"total": n, "per_s": n / sc.duration_s} for k, n in sorted(self.events.items())}
        out = {
            "scenario": {"duration_s": sc.duration_s, "volunteers": sum(p.count for p in sc.volunteers),
                         "model": [sc.model.n_layer, sc.model.n_expert, sc.model.bytes_per_expert]},
            "market_policy": {f: getattr(self.policy, f) for f in self.policy.__struct_fields__},
            "coverage": {
                "first_full_coverage_at": self.full_at,
                "holes": self._spread(self.hole_s),
                "holes_after_full_coverage": self._spread(self.hole_after_full_s),
                "below_target": self._spread(self.deficit_s),
            },
            "recruitment": self._episodes(),
            "requests": requests,
            "lease_churn": churn,
            "market_counters": dict(sorted(market.counters.items())),
            "volunteers": {"sessions": self.sessions, "session_ends": dict(sorted(self.ends.items())),
                           "dial_failures": dict(sorted(self.dial_failures.items())),
                           "refused": dict(sorted(self.refusals.items()))},
            "timeline": {
                "columns": ["t", "busy", "recruiting", "online", "holes", "below_target", "replicas", "min_replicas"],
                "rows": self.timeline[::stride],
            },
        }
        return dict(rounded(out))
