"""The market's in-memory indexes and the queries over them (no I/O, no clock, no randomness).

Sans-IO but stateful: ``Indexes`` holds what the market knows (registered models, coordinators
and their polls, volunteers, coverage, leases, recruitment state, published maps) arranged for
the handlers (``market.state``) and the views (``market.views``) to read. It never calls the
store: a mutation that is a durable fact appends its ``Change`` to the caller's batch, and the
caller commits the batch.

Rules:
- ``coverage`` (peer -> slice -> row) and ``by_model`` (model -> (peer, slice) -> row) hold the
  same rows; a peer with no rows is absent from ``coverage``.
- A peer has at most one outstanding lease (``lease_of``); ``cov_by_lease`` finds the coverage row a
  lease was converted into (rows with a ``lease_id``).
- ``counts`` (replicas / pending per expert) are maintained incrementally on every coverage and
  lease change (``market.core.demand.contribution`` says how a row counts); ``recount()``
  rebuilds them from the rows, and the two must always be equal.
- Every coverage change marks its model in ``dirty_maps`` and ``dirty_ageout``; the market's tick
  consumes and clears both sets.
- A slice is indexed only when its model is registered and the slice lies inside it
  (``market.core.directive.slice_refusal``); ``load`` drops stored rows that do not.
- Runtime only (lost on restart, never in a ``Change``): polls, last heartbeat time, load,
  per-slice last serve, the unflushed sequence mark.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec

from market.core.demand import (
    CoverageCounts,
    Targets,
    contribution,
    effective_target,
    expert_targets,
    hot_extra,
)
from market.core.directive import Reason, slice_refusal
from market.core.records import (
    CoordinatorRow,
    CoverageRow,
    CreditRow,
    LeaseRow,
    MapRow,
    ModelRow,
    QuarantineRow,
    SliceRef,
    Snapshot,
    Table,
    VolunteerRow,
    coverage_key,
)
from market.core.recruit import PollView, RecruitState, observe
from market.core.registry import epoch_bound_ms
from market.core.sources import PeerCandidate, Source
from market.policy import MarketPolicy
from market.store import Change, Delete, Put

__all__ = ["Indexes", "LiveVolunteer", "PollRecord"]


@dataclass
class LiveVolunteer:
    """A volunteer's identity row plus what its last heartbeat said (runtime)."""

    row: VolunteerRow
    last_seen: float
    load: float = 0.0
    dirty: bool = False  # a sequence newer than the stored row
    last_serve_ms: dict[SliceRef, int] = field(default_factory=dict)
    display_name: str = ""  # volunteer-chosen (stranger text), control characters removed
    share_slices: bool = False  # it serves its slices to downloading volunteers (its last heartbeat said so)
    stored: bool = True  # its row is in the store (False: an identity that never held anything, memory only)
    paused: str = ""  # its last heartbeat's pause reason ("" serving): its slices are draining, no new lease
    download: tuple[SliceRef, float] | None = None  # a slice it reports loading and the share downloaded (0..1)


@dataclass
class PollRecord:
    """The outcome of a coordinator's ``/slots`` polls (runtime)."""

    ok: bool = False
    at: float | None = None  # last attempt
    error: str | None = None
    last_ok: PollView | None = None
    tps: float = 0.0  # decode tokens/s of its busy slots at the last successful poll
    since: float = 0.0  # when the market learnt of it (registration, or the market's start)
    down: bool = False  # every poll failed for host_down_s: it does not count as hosting

    def good_at(self) -> float:
        """When it last answered a poll (or, never having, when the market learnt of it)."""
        return self.last_ok.at if self.last_ok is not None else self.since


class Indexes:
    def __init__(self, policy: MarketPolicy) -> None:
        self.policy = policy
        self.recruit_policy = policy.recruit_policy()
        self.models: dict[str, ModelRow] = {}
        self.counts: dict[str, CoverageCounts] = {}
        self.coordinators: dict[str, CoordinatorRow] = {}
        self.polls: dict[str, PollRecord] = {}
        self.volunteers: dict[str, LiveVolunteer] = {}
        self.coverage: dict[str, dict[SliceRef, CoverageRow]] = {}  # peer -> slice -> row
        self.by_model: dict[str, dict[tuple[str, SliceRef], CoverageRow]] = {}
        self.leases: dict[str, LeaseRow] = {}
        self.lease_of: dict[str, str] = {}  # peer -> its outstanding lease id
        self.cov_by_lease: dict[str, CoverageRow] = {}  # lease id -> the coverage row converted from it
        self.recruit: dict[str, RecruitState] = {}
        self.maps: dict[str, MapRow] = {}
        self.dirty_maps: set[str] = set()
        self.dirty_ageout: set[str] = set()
        self.quarantined: dict[str, QuarantineRow] = {}  # peer -> why and until when it is refused
        self.served: dict[str, tuple[int, int, int]] = {}  # peer -> (calls, rows, verified) reported by coordinators
        self.credit: dict[str, CreditRow] = {}  # peer -> its credit ledger row (durable)
        self.reported: dict[str, tuple[str | None, float | None]] = {}  # peer -> (path, latency ms) last reported
        self.routed: dict[str, dict[tuple[int, int, int], int]] = {}  # model -> (layer, lo, hi) -> routed rows (runtime)
        self._coordinators_version = 0  # bumped on every registration change (the targets' memo key)
        self._targets: dict[str, tuple[tuple[bool, int, int], Targets]] = {}
        # model -> per layer, per expert: routed rows from coordinator reports, decayed (runtime)
        self.heat: dict[str, list[list[float]]] = {}
        self._heat_at: dict[str, float] = {}
        self._heat_version: dict[str, int] = {}

    # -- loading --------------------------------------------------------------------------------

    def load(self, snap: Snapshot, now: float) -> list[Change]:
        """Index everything durable; return the deletes of stored rows that cannot be indexed.

        Volunteers are treated as just seen and recruiting models as just saturated (one TTL /
        one ``hold_s`` of grace after a restart).
        """
        for m in snap.models:
            self.add_model(m)
        for c in snap.coordinators:
            if c.epoch > epoch_bound_ms(now, self.policy.max_epoch_ahead_s):  # written before epochs were bounded
                c = msgspec.structs.replace(c, epoch=int(now * 1000))
            self.coordinators[c.url] = c
            self.polls[c.url] = PollRecord(since=now)
        for v in snap.volunteers:
            self.volunteers[v.peer_id] = LiveVolunteer(v, last_seen=now)
        for q in snap.quarantine:
            self.quarantined[q.peer_id] = q
        for cr in snap.credit:
            self.credit[cr.peer_id] = cr
        for r in snap.recruitment:
            if r.model_id in self.models and r.recruiting:
                self.recruit[r.model_id] = RecruitState(True, r.changed_at, last_saturated_at=now)
        for mr in snap.maps:
            if mr.model_id in self.models:
                self.maps[mr.model_id] = mr
        dropped: list[Change] = []
        for row in snap.coverage:
            if self.slice_problem(row.slice) is None:
                self.index_cov(row)
                if row.peer_id not in self.volunteers:  # cannot happen with our writes; keep the row alive for one TTL anyway
                    self.volunteers[row.peer_id] = LiveVolunteer(VolunteerRow(row.peer_id, 0, 0, now), last_seen=now)
            else:
                dropped.append(Delete(Table.COVERAGE, coverage_key(row.peer_id, row.slice)))
        for lease in snap.leases:
            if self.slice_problem(lease.slice) is None and lease.peer_id not in self.lease_of:
                self.index_lease(lease)
            else:
                dropped.append(Delete(Table.LEASES, lease.lease_id))
        self.dirty_maps.update(self.models)
        self.dirty_ageout.update(self.models)
        return dropped

    def add_model(self, row: ModelRow) -> None:
        m = row.manifest
        self.models[m.model_id] = row
        if m.model_id not in self.counts:
            self.counts[m.model_id] = CoverageCounts(m.n_layer, m.n_expert)
            self.by_model[m.model_id] = {}
            self.maps.setdefault(m.model_id, MapRow(m.model_id, 0, []))
            self.dirty_maps.add(m.model_id)

    def slice_problem(self, s: SliceRef) -> Reason | None:
        row = self.models.get(s.model_id)
        shape = None if row is None else (row.manifest.n_layer, row.manifest.n_expert)
        return slice_refusal(shape, s.layer, s.lo, s.hi)

    # -- coverage and leases --------------------------------------------------------------------

    def touch(self, model_id: str) -> None:
        self.dirty_maps.add(model_id)
        self.dirty_ageout.add(model_id)

    def index_cov(self, row: CoverageRow, sign: int = 1) -> None:
        s = row.slice
        kind = contribution(row)
        if kind is not None:
            self.counts[s.model_id].add(kind, s.layer, s.lo, s.hi, sign)
        if sign > 0:
            self.coverage.setdefault(row.peer_id, {})[s] = row
            self.by_model[s.model_id][(row.peer_id, s)] = row
            if row.lease_id:
                self.cov_by_lease[row.lease_id] = row
        else:
            rows = self.coverage.get(row.peer_id, {})
            rows.pop(s, None)
            if not rows:
                self.coverage.pop(row.peer_id, None)
            self.by_model[s.model_id].pop((row.peer_id, s), None)
            known = self.cov_by_lease.get(row.lease_id) if row.lease_id else None
            if known is not None and (known.peer_id, known.slice) == (row.peer_id, s):
                del self.cov_by_lease[row.lease_id]
        self.touch(s.model_id)

    def put_cov(self, row: CoverageRow, changes: list[Change]) -> None:
        old = self.coverage.get(row.peer_id, {}).get(row.slice)
        if old is not None:
            self.index_cov(old, -1)
        self.index_cov(row)
        changes.append(Put(row))

    def del_cov(self, row: CoverageRow, changes: list[Change]) -> None:
        self.index_cov(row, -1)
        changes.append(Delete(Table.COVERAGE, coverage_key(row.peer_id, row.slice)))

    def index_lease(self, lease: LeaseRow, sign: int = 1) -> None:
        s = lease.slice
        self.counts[s.model_id].add("pending", s.layer, s.lo, s.hi, sign)
        if sign > 0:
            self.leases[lease.lease_id] = lease
            self.lease_of[lease.peer_id] = lease.lease_id
        else:
            self.leases.pop(lease.lease_id, None)
            if self.lease_of.get(lease.peer_id) == lease.lease_id:
                del self.lease_of[lease.peer_id]

    def del_lease(self, lease: LeaseRow, changes: list[Change]) -> None:
        self.index_lease(lease, -1)
        changes.append(Delete(Table.LEASES, lease.lease_id))

    def recount(self) -> dict[str, CoverageCounts]:
        """The counts rebuilt from the rows (for tests: must equal ``self.counts``)."""
        out = {mid: CoverageCounts(r.manifest.n_layer, r.manifest.n_expert) for mid, r in self.models.items()}
        for rows in self.coverage.values():
            for row in rows.values():
                kind = contribution(row)
                if kind is not None:
                    out[row.slice.model_id].add(kind, row.slice.layer, row.slice.lo, row.slice.hi, 1)
        for lease in self.leases.values():
            out[lease.slice.model_id].add("pending", lease.slice.layer, lease.slice.lo, lease.slice.hi, 1)
        return out

    # -- queries --------------------------------------------------------------------------------

    def hosts_of(self, model_id: str) -> list[str]:
        """The coordinators that count as hosting ``model_id``: registered with it, and not down."""
        return [url for url, c in self.coordinators.items()
                if model_id in c.model_ids and not (url in self.polls and self.polls[url].down)]

    def registered_hosts_of(self, model_id: str) -> list[str]:
        """Every registered coordinator listing ``model_id``, down ones too (views, age-out)."""
        return [url for url, c in self.coordinators.items() if model_id in c.model_ids]

    def drop_model(self, model_id: str, changes: list[Change]) -> None:
        """Forget a model no coordinator lists any more: its row, coverage, leases, map and boost."""
        for (_, _), row in list(self.by_model.get(model_id, {}).items()):
            self.del_cov(row, changes)
        for lease in [x for x in self.leases.values() if x.slice.model_id == model_id]:
            self.del_lease(lease, changes)
        for table in (Table.MODELS, Table.MAPS, Table.RECRUITMENT):
            changes.append(Delete(table, model_id))
        for d in (self.models, self.counts, self.by_model, self.maps, self.recruit, self.routed, self.heat,
                  self._heat_at, self._heat_version, self._targets):
            d.pop(model_id, None)
        self.dirty_maps.discard(model_id)
        self.dirty_ageout.discard(model_id)

    def poll_views(self, model_id: str) -> list[PollView | None]:
        return [self.polls[u].last_ok if u in self.polls else None for u in self.hosts_of(model_id)]

    def sources(self, model_id: str) -> list[Source]:
        """The coordinators hosting ``model_id`` as download sources (``market.core.sources``)."""
        out: list[Source] = []
        for url in self.hosts_of(model_id):
            p = self.polls.get(url)
            out.append(Source(url, p is not None and p.ok, p.last_ok if p is not None else None))
        return out

    def peer_candidates(self, model_id: str, layer: int, now: float) -> list[PeerCandidate]:
        """Every holding of ``layer`` of ``model_id`` as a download source candidate (``market.core.sources``)."""
        out: list[PeerCandidate] = []
        for (peer, s), r in self.by_model.get(model_id, {}).items():
            if s.layer != layer:
                continue
            v = self.volunteers.get(peer)
            q = self.quarantined.get(peer)
            out.append(PeerCandidate(peer, s.model_id, s.layer, s.lo, s.hi, tuple(v.row.addrs) if v else (),
                                     r.dispatched, v.share_slices if v else False, q is not None and q.until > now,
                                     r.proved))
        return out

    def quarantine_of(self, peer_id: str, now: float) -> QuarantineRow | None:
        """Its quarantine, while it lasts."""
        q = self.quarantined.get(peer_id)
        return q if q is not None and q.until > now else None

    def saturated_now(self, model_id: str, now: float) -> bool:
        """What the fresh polls say at ``now``, before hysteresis (the raw signal)."""
        obs = observe(self.poll_views(model_id), now, self.recruit_policy)
        return obs is not None and obs.saturated

    def recruiting(self, model_id: str) -> bool:
        """The model's saturation signal after hysteresis (``market.core.recruit``): saturated, boosted."""
        st = self.recruit.get(model_id)
        return st is not None and st.recruiting

    def target(self, model_id: str) -> int:
        """The effective target of the experts every hosting coordinator computes itself (the base one)."""
        return effective_target(self.policy.base_target, self.policy.boost, self.recruiting(model_id))

    def remote_target(self, model_id: str) -> int:
        """The effective target of experts some hosting coordinator does not compute (``remote_base_target``)."""
        return effective_target(self.policy.remote_base_target, self.policy.boost, self.recruiting(model_id))

    def held_by_all(self, model_id: str) -> list[list[bool]] | None:
        """Per layer, per expert: does every coordinator hosting the model compute it itself? None: all do."""
        m = self.models.get(model_id)
        if m is None:
            return None
        n_layer, n_expert = m.manifest.n_layer, m.manifest.n_expert
        out: list[list[bool]] | None = None
        for c in self.coordinators.values():
            if model_id not in c.model_ids or model_id not in c.local_experts:
                continue  # not hosting it, or computing all of it
            mine = [[False] * n_expert for _ in range(n_layer)]
            for layer, lo, hi in c.local_experts[model_id]:
                if 0 <= layer < n_layer:
                    for e in range(max(0, lo), min(hi, n_expert)):
                        mine[layer][e] = True
            out = mine if out is None else [[a and b for a, b in zip(x, y, strict=True)] for x, y in zip(out, mine, strict=True)]
        return out

    def targets(self, model_id: str) -> Targets:
        """Per-expert effective targets (one number when uniform): ``market.core.demand.expert_targets``."""
        m = self.models[model_id].manifest
        p = self.policy
        key = (self.recruiting(model_id), self._coordinators_version, self._heat_version.get(model_id, 0))
        hit = self._targets.get(model_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        heat = self.heat.get(model_id)
        extra = [hot_extra(row, p.hot_extra_max) for row in heat] if heat is not None else None
        t = expert_targets(m.n_layer, m.n_expert, base=p.base_target, remote_base=p.remote_base_target, boost=p.boost,
                           recruiting=key[0], held_by_all=self.held_by_all(model_id), extra=extra)
        self._targets[model_id] = (key, t)
        return t

    def coordinators_changed(self) -> None:
        self._coordinators_version += 1

    def add_heat(self, model_id: str, ranges: list[tuple[int, int, int, int]], now: float) -> None:
        """Routed rows ``(layer, lo, hi, rows)`` reported for a model; older heat decays by
        ``hot_half_life_s``; ranges outside the model are ignored."""
        m = self.models.get(model_id)
        if m is None or not ranges:
            return
        n_layer, n_expert = m.manifest.n_layer, m.manifest.n_expert
        heat = self.heat.setdefault(model_id, [[0.0] * n_expert for _ in range(n_layer)])
        at = self._heat_at.get(model_id, now)
        f = 0.5 ** (max(0.0, now - at) / self.policy.hot_half_life_s)
        if f < 1.0:
            for row in heat:
                for e in range(n_expert):
                    row[e] *= f
        self._heat_at[model_id] = now
        for layer, lo, hi, rows in ranges:
            if 0 <= layer < n_layer and 0 <= lo < hi <= n_expert and rows > 0:
                share = rows / (hi - lo)
                row = heat[layer]
                for e in range(lo, hi):
                    row[e] += share
        self._heat_version[model_id] = self._heat_version.get(model_id, 0) + 1
        self.touch(model_id)

    def reloaded(self, snap: Snapshot, now: float) -> Indexes:
        """Fresh indexes of ``snap`` (the store after it refused a batch) with this one's runtime facts:
        polls, volunteers' last words, loads and sequence marks (replays stay refused), recruitment
        states, served and routed counts, heat. ``snap``'s "dropped" rows were dropped at start."""
        ix = Indexes(self.policy)
        ix.load(snap, now)
        for url, p in self.polls.items():
            if url in ix.coordinators:
                ix.polls[url] = p
        for peer, o in self.volunteers.items():
            lv = ix.volunteers.get(peer)
            if lv is None:
                if not o.stored:  # in memory only (it holds nothing): runtime, kept as it was
                    ix.volunteers[peer] = o
                continue
            mark = max((lv.row.epoch, lv.row.sequence), (o.row.epoch, o.row.sequence))
            row = msgspec.structs.replace(lv.row, epoch=mark[0], sequence=mark[1])
            ix.volunteers[peer] = LiveVolunteer(row, o.last_seen, o.load, row != lv.row, o.last_serve_ms,
                                                o.display_name, share_slices=o.share_slices, stored=True,
                                                paused=o.paused, download=o.download)
        for mid, st in self.recruit.items():
            if mid in ix.models:
                ix.recruit[mid] = dataclasses.replace(st, recruiting=ix.recruiting(mid))
        ix.served, ix.reported = self.served, self.reported
        ix.routed = {mid: r for mid, r in self.routed.items() if mid in ix.models}
        ix.restore_heat(self)
        return ix

    def restore_heat(self, old: Indexes) -> None:
        """Take ``old``'s routed-row heat (runtime) for the models still registered."""
        for mid in self.models:
            if mid in old.heat:
                self.heat[mid] = old.heat[mid]
                self._heat_at[mid] = old._heat_at.get(mid, 0.0)
                self._heat_version[mid] = old._heat_version.get(mid, 0)

    def live_volunteers(self) -> int:
        return len(self.coverage)
