"""The market's read views: ``/api/expert-demand``, ``/api/moe/recruitment``, dispatch maps.

Pure reads over ``market.indexes.Indexes`` (no I/O, no clock: ``now`` is given; nothing is
written, no randomness).

Rules:
- ``hosted`` and the sources count only coordinators that are not down (``Indexes.hosts_of``); the
  recruitment view lists down ones too, with ``hosting: false``.
- A view asked about a model that is not registered raises ``RequestError`` ``unknown_model``
  (404, ``param="model"``).
- Views decide nothing of their own: saturation is ``market.core.recruit``'s (``coordinator_saturated``
  per coordinator and ``observe`` per model: ``saturated_now``, the raw signal; a model's ``saturated``
  is the smoothed one, ``step``'s hysteresis, which also drives the boost), targets and segments are
  ``market.core.demand``'s, a holding's state name follows ``market.core.directive``.
- Models, workers and slices are listed in sorted order; ages are rounded to milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from market.core.activity import SliceActivity, activity
from market.core.credit import rac_now
from market.core.demand import segments
from market.core.directive import Action, directive
from market.core.records import CoverageRow, HeldState
from market.core.recruit import RecruitState, coordinator_saturated
from market.indexes import Indexes, PollRecord
from swarm.dispatch_map import DispatchMap
from swarm.errors import RequestError
from swarm.protocol.market import (
    CoordinatorView,
    CreditBoard,
    DemandView,
    LeaseView,
    ModelDemand,
    ModelRecruitment,
    RecruitmentView,
    VolunteerCredit,
    WorkerSliceView,
    WorkerView,
)

__all__ = ["credit_board", "demand_view", "dispatch_map", "lease_view", "map_version", "recruitment_view",
           "remote_and_holes", "state_name", "volunteer_credit"]


def _unknown_model(model_id: str) -> RequestError:
    return RequestError(f"no model {model_id!r} is registered", code="unknown_model", status=404, param="model")


def dispatch_map(ix: Indexes, model_id: str) -> DispatchMap:
    row = ix.maps.get(model_id)
    if row is None or model_id not in ix.models:
        raise _unknown_model(model_id)
    return DispatchMap(model_id, row.version, row.layers)


def map_version(ix: Indexes, model_id: str) -> int:
    row = ix.maps.get(model_id)
    return row.version if row else 0


def demand_view(ix: Indexes, now: float, model_ids: Iterable[str] | None = None) -> DemandView:
    out: list[ModelDemand] = []
    for mid in sorted(ix.models if model_ids is None else model_ids):
        if mid not in ix.models:
            raise _unknown_model(mid)
        target = ix.target(mid)
        c = ix.counts[mid]
        remote, holes = remote_and_holes(ix, mid)
        out.append(
            ModelDemand(
                mid,
                hosted=bool(ix.hosts_of(mid)),
                saturated=ix.recruiting(mid),
                recruiting=ix.recruiting(mid),
                base_target=ix.policy.base_target,
                effective_target=target,
                replicas_min=c.min_replicas(),
                segments=segments(c, ix.targets(mid)),
                remote_target=remote,
                holes=holes,
                saturated_now=ix.saturated_now(mid, now),
            )
        )
    return DemandView(any(ix.recruiting(m) for m in ix.models), out)


def recruitment_view(ix: Indexes, now: float, calls_per_s: Callable[[str], float] = lambda _: 0.0) -> RecruitmentView:
    """``GET /api/moe/recruitment``; ``calls_per_s(peer)``: its answered calls a second, from coordinator
    reports (``market.journal``); a worker's ``activity`` is ``market.core.activity``'s."""
    out: list[ModelRecruitment] = []
    for mid in sorted(ix.models):
        coords: list[CoordinatorView] = []
        busy = slots = 0
        for url in ix.registered_hosts_of(mid):  # down ones too, marked: what is wrong is shown
            p = ix.polls.get(url, PollRecord())
            last = p.last_ok
            if last is not None and not p.down:
                busy += last.busy
                slots += last.slots
            coords.append(
                CoordinatorView(
                    url,
                    p.ok,
                    last.busy if last else None,
                    last.slots if last else None,
                    coordinator_saturated(last, now, ix.recruit_policy),
                    None if p.at is None else round(now - p.at, 3),
                    p.error,
                    hosting=not p.down,
                )
            )
        st = ix.recruit.get(mid, RecruitState())
        remote, holes = remote_and_holes(ix, mid)
        out.append(
            ModelRecruitment(
                mid,
                busy=busy,
                slots=slots,
                saturated=st.recruiting,
                recruiting=st.recruiting,
                recruiting_for_s=round(now - st.changed_at, 3) if st.recruiting else None,
                base_target=ix.policy.base_target,
                effective_target=ix.target(mid),
                replicas_min=ix.counts[mid].min_replicas(),
                map_version=map_version(ix, mid),
                coordinators=coords,
                workers=_workers(ix, mid, now, calls_per_s),
                remote_target=remote,
                holes=holes,
                tokens_per_s=round(sum(ix.polls[u].tps for u in ix.hosts_of(mid)
                                       if u in ix.polls and ix.polls[u].ok), 2),
                saturated_now=ix.saturated_now(mid, now),
                saturated_for_s=round(st.saturated_for(now), 3) if ix.saturated_now(mid, now) else None,
            )
        )
    return RecruitmentView(any(m.recruiting for m in out), out)


def remote_and_holes(ix: Indexes, model_id: str) -> tuple[int | None, int]:
    """The remote experts' effective target (None: every hosting coordinator computes every expert) and
    the number of experts no one can compute now (no replica, not held by every hosting coordinator)."""
    held = ix.held_by_all(model_id)
    if held is None:
        return None, 0
    reps = ix.counts[model_id].replicas
    holes = sum(1 for layer, row in enumerate(held) for e, h in enumerate(row) if not h and reps[layer][e] == 0)
    return ix.remote_target(model_id), holes


def _workers(ix: Indexes, model_id: str, now: float, calls_per_s: Callable[[str], float]) -> list[WorkerView]:
    by_peer: dict[str, list[CoverageRow]] = {}
    for (peer, _), r in ix.by_model[model_id].items():
        by_peer.setdefault(peer, []).append(r)
    out: list[WorkerView] = []
    for peer, rows in sorted(by_peer.items()):
        v = ix.volunteers.get(peer)
        views: list[WorkerSliceView] = []
        for r in sorted(rows, key=lambda r: r.slice):
            dl = v.download if v is not None else None
            views.append(
                WorkerSliceView(
                    str(r.slice),
                    r.slice.layer,
                    r.slice.lo,
                    r.slice.hi,
                    state_name(r, now, ix.policy.cooldown_s),
                    round(now - r.since, 3),
                    v.last_serve_ms.get(r.slice, 0) if v else 0,
                    served=r.served,
                    held=r.held,
                    progress=round(dl[1], 3) if dl is not None and dl[0] == r.slice and r.pending else None,
                )
            )
        path, latency = ix.reported.get(peer, (None, None))
        calls, _, verified = ix.served.get(peer, (0, 0, 0))
        credit = ix.credit.get(peer)
        rate = calls_per_s(peer)
        doing = activity([SliceActivity(w.slice, w.state, w.progress, w.held or w.served) for w in views], rate)
        if v is not None and v.paused:  # its owner's preferences: not gone, not serving
            doing = f"paused ({v.paused.replace('_', ' ')})"
        out.append(
            WorkerView(
                peer,
                age_s=round(now - min(r.since for r in rows), 3),
                last_heartbeat_age_s=round(now - v.last_seen, 3) if v else 0.0,
                last_serve_ms=max((w.last_serve_ms for w in views), default=0),
                load=v.load if v else 0.0,
                dispatched=any(r.dispatched for r in rows),
                slices=views,
                display_name=v.display_name if v else "",
                path=path,
                calls=calls,
                verified=verified,
                latency_ms=latency,
                credit_rac=rac_now(credit, now) if credit is not None else 0.0,
                paused=v.paused if v else "",
                calls_per_s=round(rate, 2),
                activity=doing,
            )
        )
    return out


_RETIRED_NAME = {Action.DRAIN: "retiring", Action.RELEASE: "released"}


def state_name(row: CoverageRow, now: float, cooldown_s: float) -> str:
    """The dashboard's name for a holding: ``retiring`` / ``released`` (the heartbeat answer
    ``drain`` / ``release``), else ``dispatched`` or the state the volunteer reported."""
    name = _RETIRED_NAME.get(directive(row.retiring_since, now, cooldown_s).action)
    if name is not None:
        return name
    return "dispatched" if row.dispatched else row.state.value


def lease_view(ix: Indexes, lease_id: str, now: float) -> LeaseView:
    """``GET /api/leases/{lease_id}``: an open lease, or the coverage it was converted into while that
    is still ``loading`` (the volunteer downloads then: the peers it asks check this); for
    ``loading`` the answer holds for the holder's remaining heartbeat TTL. Anything else (lapsed,
    cancelled, serving, released, never granted): ``unknown_lease`` (404)."""
    lease = ix.leases.get(lease_id)
    if lease is not None and lease.expires_at > now:
        s = lease.slice
        return LeaseView(lease_id=lease_id, peer_id=lease.peer_id, model_id=s.model_id, layer=s.layer, lo=s.lo,
                         hi=s.hi, expires_in_s=round(lease.expires_at - now, 3), state="leased")
    row = ix.cov_by_lease.get(lease_id)
    v = ix.volunteers.get(row.peer_id) if row is not None else None
    if row is not None and v is not None and row.state is HeldState.LOADING and row.retiring_since is None:
        left = v.last_seen + ix.policy.heartbeat_ttl_s - now
        if left > 0 and ix.quarantine_of(row.peer_id, now) is None:
            s = row.slice
            return LeaseView(lease_id=lease_id, peer_id=row.peer_id, model_id=s.model_id, layer=s.layer, lo=s.lo,
                             hi=s.hi, expires_in_s=round(left, 3), state="loading")
    raise RequestError(f"no open lease {lease_id[:64]!r} is known here", code="unknown_lease", status=404)


def volunteer_credit(ix: Indexes, peer_id: str, now: float) -> VolunteerCredit:
    """``GET /api/volunteers/{peer_id}``; ``unknown_volunteer`` (404) for a peer the market never saw."""
    row = ix.credit.get(peer_id)
    if row is None and peer_id not in ix.volunteers and peer_id not in ix.quarantined:
        raise RequestError(f"no volunteer {peer_id[:128]!r} is known here", code="unknown_volunteer", status=404)
    q = ix.quarantine_of(peer_id, now)
    slices = sorted(str(s) for s in ix.coverage.get(peer_id, {}))
    until = int(q.until * 1000) if q is not None else None
    reason, proof = (q.evidence[:300], q.proof) if q is not None else ("", None)
    paused = v.paused if (v := ix.volunteers.get(peer_id)) is not None else ""
    if row is None:
        return VolunteerCredit(peer_id, 0.0, 0.0, 0, 0, None, None, until, slices, reason, proof, paused)
    return VolunteerCredit(peer_id, row.total_flops, rac_now(row, now), row.pairs, row.verified,
                           int(row.first_at * 1000), int(row.last_at * 1000), until, slices, reason, proof, paused)


def credit_board(ix: Indexes, now: float, limit: int = 100) -> CreditBoard:
    """``GET /api/volunteers?limit=N``: the volunteers with credit, highest recent average first."""
    peers = sorted(ix.credit, key=lambda p: (-rac_now(ix.credit[p], now), p))[: max(0, limit)]
    return CreditBoard([volunteer_credit(ix, p, now) for p in peers])
