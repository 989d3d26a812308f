"""The market tick's upkeep decisions (shell helpers of ``market.state.Market.tick``, taken out of it).

Sans-IO like ``Market``: proofs and download deadlines (``drop_unprovable``), age-out (``age_out``) and
the dispatch maps (``rebuild_map``); the rules are ``market.state``'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from market.core.demand import contribution
from market.core.directive import Reason, in_cooldown
from market.core.records import HeldState, MapRow, SliceRef
from market.core.recruit import Holding, plan_ageout
from market.core.wiring import ServingSlice, build_layers, preference
from market.store import Change, Put
from swarm.protocol.expert import PROTOCOL_VERSION as EXPERT_PROTOCOL_VERSION

if TYPE_CHECKING:
    from market.state import Market, TickReport

__all__ = ["age_out", "download_allowance", "drop_unprovable", "rebuild_map"]

log = logging.getLogger(__name__)


def drop_unprovable(m: Market, now: float, changes: list[Change]) -> None:
    """A holding counts only while it can be proven (DESIGN §12). Its row goes (the volunteer's next
    heartbeat listing it is told ``release`` with the reason; it gets no new lease for that slice for
    ``dropped_penalty_s``) and its experts are recruited again, when
    - it is ``loading`` past its download deadline: ``since`` + ``download_grace_s`` + the slice's
      bytes at ``download_floor_bytes_per_s`` (``download_overdue``): reporting ``loading`` for ever
      is squatting, not downloading;
    - it is ``serving`` and no coordinator reported it proved (hold challenge or verified answers)
      within ``proof_grace_s`` of starting to serve (``unproven``; 0 = off)."""
    grace = m.policy.proof_grace_s
    due = m._proof_due
    live: set[tuple[str, SliceRef]] = set()
    for peer, rows in list(m.ix.coverage.items()):
        for s, row in list(rows.items()):
            if row.state is HeldState.LOADING:
                if now < row.since + download_allowance(m, s):
                    continue
                reason, detail = Reason.OVERDUE, f"still loading {now - row.since:.0f} s after it was leased"
            elif row.state is HeldState.SERVING and not row.proved and grace > 0:
                k = (peer, s)
                live.add(k)
                if now < due.setdefault(k, now + grace):
                    continue
                reason, detail = Reason.UNPROVEN, f"no proof of holding within {grace:.0f} s"
            else:
                continue
            m.ix.del_cov(row, changes)
            m.ix.dirty_maps.add(s.model_id)
            m.ix.dirty_ageout.add(s.model_id)
            m._mark_dropped(peer, s, reason, now)
            m.counters[f"coverage_{reason.value}"] += 1
            m._event(reason.value, now, peer_id=peer, s=s, detail=detail)
            log.info("volunteer %s: %s dropped (%s: %s)", peer, s, reason.value, detail)
    for k in list(due):
        if k not in live:
            del due[k]


def download_allowance(m: Market, s: SliceRef) -> float:
    """How long a slice may stay ``loading``: a fixed grace plus its bytes at a generous floor rate."""
    row = m.ix.models.get(s.model_id)
    size = (s.hi - s.lo) * row.manifest.bytes_per_expert[s.layer] if row is not None else 0
    p = m.policy
    return p.download_grace_s + (size + p.header_allowance) / p.download_floor_bytes_per_s


def age_out(m: Market, model_id: str, now: float, changes: list[Change], rep: TickReport) -> None:
    man = m.ix.models[model_id].manifest
    rows = m.ix.by_model[model_id]
    holdings = [
        Holding(
            key=k,
            peer_id=r.peer_id,
            layer=r.slice.layer,
            lo=r.slice.lo,
            hi=r.slice.hi,
            since=r.since,
            serving=r.state is HeldState.SERVING,
            served=r.served,
            counted=contribution(r) is not None,
            restorable=(
                r.state is not HeldState.DRAINING and in_cooldown(r.retiring_since, now, m.policy.cooldown_s)
            ),
        )
        for k, r in rows.items()
    ]
    plan = plan_ageout(man.n_layer, man.n_expert, m.ix.targets(model_id), holdings)
    for k in plan.restore:
        m.ix.put_cov(msgspec.structs.replace(rows[k], retiring_since=None), changes)
        rep.restored += 1
        m.counters["restored"] += 1
        m._event("restored", now, peer_id=rows[k].peer_id, s=rows[k].slice)
    for k in plan.retire:
        m.ix.put_cov(msgspec.structs.replace(rows[k], retiring_since=now), changes)
        rep.retired += 1
        m.counters["retired"] += 1
        m._event("draining", now, peer_id=rows[k].peer_id, s=rows[k].slice, detail="surplus")
    # a just-retired or restored row re-dirtied the model for age-out; the plan is already stable
    if plan.restore or plan.retire:
        log.info("model %s: age-out retired %d, restored %d", model_id, len(plan.retire), len(plan.restore))


def rebuild_map(m: Market, model_id: str, changes: list[Change]) -> bool:
    serving: list[ServingSlice] = []
    for (peer, s), r in m.ix.by_model[model_id].items():
        if r.dispatched:
            v = m.ix.volunteers.get(peer)
            addrs = tuple(v.row.addrs) if v else ()
            load = v.load if v else 0.0
            protocols = tuple(v.row.protocols) if v else ()
            serving.append(
                ServingSlice(peer, s.layer, s.lo, s.hi, addrs, preference(r.served, load, r.since, peer, r.proved), protocols,
                             v.row.net if v else "")
            )
    layers = build_layers(serving, protocol=EXPERT_PROTOCOL_VERSION)
    cur = m.ix.maps.get(model_id, MapRow(model_id, 0, []))
    if layers == cur.layers:
        return False
    new = MapRow(model_id, cur.version + 1, layers)
    m.ix.maps[model_id] = new
    changes.append(Put(new))
    return True
