"""The market's state machine: registry, demand, leases, recruitment, age-out, dispatch maps.

Sans-IO apart from its ``Store``: every method takes ``now``; randomness comes from the injected
``rng``; nothing awaits, sleeps or reads a clock. With an ``InMemoryStore`` it runs under virtual
time (``tests/test_market_scenarios.py``); the HTTP shell (``market.api``, ``market.server``)
calls it from one trio task at a time. Decisions are made by the pure cores in
``market.core``; this module keeps the indexes they read and writes the facts they decide.

Rules:
- Decision-grade facts are written through to the store at the end of the call that made them
  (one atomic batch per call): models, coordinators, volunteers' identity/epoch/addresses,
  coverage rows (with their retirement mark and proven flag), leases, published map versions,
  recruitment flags. A volunteer's sequence number is flushed every ``flush_s`` (and at close):
  a market killed between flushes may accept one replay of a heartbeat from that window.
- Runtime only: last heartbeat time, load, per-slice last serve, coordinator polls.
- Restart: everything durable is loaded; volunteers holding coverage are treated as just seen
  (one heartbeat TTL of grace), so the published map stays valid until they heartbeat again or
  expire; a model that was recruiting keeps recruiting until ``hold_s`` without saturation.
- Counts (replicas / pending per expert) are maintained incrementally on every coverage and lease
  change; ``recount()`` rebuilds them from scratch (tests compare the two).
- The dispatch map of a model is rebuilt by ``tick`` when something it depends on changed; its
  ``version`` grows exactly when its content changes, and keeps growing across restarts.
- Age-out: while the target falls, surplus holdings get ``retiring_since = now`` (out of the map at
  the next tick); heartbeat answers say ``drain`` until ``cooldown_s`` has passed, then
  ``release``. A retiring holding is dispatched again if its experts fall below target before
  it was released.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from market.core.assign import Budget, ModelSupply, NoOfferReason, choose_slice, jittered, new_lease_id
from market.core.demand import CoverageCounts, contribution, effective_target, segments
from market.core.records import (
    CoordinatorRow,
    CoverageRow,
    HeldState,
    LeaseRow,
    MapRow,
    ModelManifest,
    ModelRow,
    RecruitRow,
    SliceRef,
    Table,
    VolunteerRow,
    coverage_key,
)
from market.core.recruit import Holding, PollView, RecruitPolicy, RecruitState, observe, plan_ageout, step
from market.core.registry import ACCEPTED, check_heartbeat, diff_coverage, is_expired, registration_is_stale
from market.core.wiring import ServingSlice, build_layers, load_bucket, preference
from market.store import Change, Delete, Put, Store
from swarm.core.rng import Rng
from swarm.dispatch_map import DispatchMap
from swarm.errors import RequestError
from swarm.protocol.market import (
    CoordinatorView,
    CoverageAck,
    CoverageHeartbeat,
    DemandView,
    ModelDemand,
    ModelRecruitment,
    RecruitmentView,
    RegisterAck,
    RegisterModels,
    SliceDirective,
    VolunteerRequest,
    WorkerSliceView,
    WorkerView,
)

__all__ = ["Market", "MarketPolicy", "Offer", "TickReport"]

log = logging.getLogger(__name__)

PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class MarketPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The market's decision parameters (defaults: DESIGN §11)."""

    base_target: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 1
    boost: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 1
    saturation_threshold: Annotated[int, msgspec.Meta(ge=1)] = 2
    rise_s: NonNegFloat = 0.0  # saturated this long before the boost starts
    hold_s: NonNegFloat = 10.0  # unsaturated this long before the boost ends (hysteresis)
    poll_stale_s: PosFloat = 10.0  # an older successful poll says nothing
    lease_s: PosFloat = 30.0
    heartbeat_ttl_s: PosFloat = 15.0
    cooldown_s: NonNegFloat = 10.0  # retired (not dispatched) this long before "release"
    retry_after_s: PosFloat = 5.0
    flush_s: PosFloat = 5.0
    header_allowance: Annotated[int, msgspec.Meta(ge=0)] = 64 * 1024  # slice header + slack, in bytes
    volunteer_gc_s: PosFloat = 7 * 24 * 3600.0  # forget silent volunteers without coverage after this

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_ttl_s / 3.0

    def recruit_policy(self) -> RecruitPolicy:
        return RecruitPolicy(
            saturation_threshold=self.saturation_threshold,
            rise_s=self.rise_s,
            hold_s=self.hold_s,
            poll_stale_s=self.poll_stale_s,
        )


@dataclass(frozen=True)
class Offer:
    """A lease granted; the shell turns it into an ``Assignment`` (it fetches size and sha256)."""

    lease: LeaseRow
    sources: list[str]  # coordinator base URLs hosting the model, best first
    scarcity: float
    est_bytes: int
    renewed: bool = False  # the volunteer already had this lease


@dataclass(frozen=True)
class NoOffer:
    reason: NoOfferReason
    retry_after_s: float


@dataclass
class TickReport:
    changed_maps: list[str] = field(default_factory=list)
    expired_volunteers: list[str] = field(default_factory=list)
    expired_leases: int = 0
    retired: int = 0
    restored: int = 0
    recruiting_changed: list[str] = field(default_factory=list)


@dataclass
class _Volunteer:
    row: VolunteerRow
    last_seen: float
    load: float = 0.0
    dirty: bool = False  # a sequence newer than the stored row
    last_serve_ms: dict[SliceRef, int] = field(default_factory=dict)


@dataclass
class _Poll:
    ok: bool = False
    at: float | None = None  # last attempt
    error: str | None = None
    last_ok: PollView | None = None


def _http_error(message: str, code: str, status: int = 400, param: str | None = None) -> RequestError:
    return RequestError(message, code=code, status=status, param=param)


class Market:
    def __init__(self, store: Store, policy: MarketPolicy, *, now: float, rng: Rng) -> None:
        self.store = store
        self.policy = policy
        self.rng = rng
        self._rp = policy.recruit_policy()
        self.models: dict[str, ModelRow] = {}
        self.counts: dict[str, CoverageCounts] = {}
        self.coordinators: dict[str, CoordinatorRow] = {}
        self.polls: dict[str, _Poll] = {}
        self.volunteers: dict[str, _Volunteer] = {}
        self.coverage: dict[str, dict[SliceRef, CoverageRow]] = {}  # peer -> slice -> row
        self._by_model: dict[str, dict[tuple[str, SliceRef], CoverageRow]] = {}
        self.leases: dict[str, LeaseRow] = {}
        self._lease_of: dict[str, str] = {}  # peer -> its outstanding lease id
        self.recruit: dict[str, RecruitState] = {}
        self.maps: dict[str, MapRow] = {}
        self._dirty_maps: set[str] = set()
        self._dirty_ageout: set[str] = set()
        self._last_flush = now
        self.counters: Counter[str] = Counter()
        self._load(now)

    # -- loading and bookkeeping ------------------------------------------------------------

    def _load(self, now: float) -> None:
        snap = self.store.load()
        for m in snap.models:
            self._add_model(m)
        for c in snap.coordinators:
            self.coordinators[c.url] = c
            self.polls[c.url] = _Poll()
        for v in snap.volunteers:
            self.volunteers[v.peer_id] = _Volunteer(v, last_seen=now)
        for r in snap.recruitment:
            if r.model_id in self.models and r.recruiting:
                self.recruit[r.model_id] = RecruitState(True, r.changed_at, last_saturated_at=now)
        for mr in snap.maps:
            if mr.model_id in self.models:
                self.maps[mr.model_id] = mr
        dropped: list[Change] = []
        for row in snap.coverage:
            if self._slice_problem(row.slice) is None:
                self._index_cov(row)
                if row.peer_id not in self.volunteers:  # cannot happen with our writes; keep the row alive for one TTL anyway
                    self.volunteers[row.peer_id] = _Volunteer(VolunteerRow(row.peer_id, 0, 0, now), last_seen=now)
            else:
                dropped.append(Delete(Table.COVERAGE, coverage_key(row.peer_id, row.slice)))
        for lease in snap.leases:
            if self._slice_problem(lease.slice) is None and lease.peer_id not in self._lease_of:
                self._index_lease(lease)
            else:
                dropped.append(Delete(Table.LEASES, lease.lease_id))
        if dropped:
            self.store.apply(dropped)
        self._dirty_maps.update(self.models)
        self._dirty_ageout.update(self.models)

    def _add_model(self, row: ModelRow) -> None:
        m = row.manifest
        self.models[m.model_id] = row
        if m.model_id not in self.counts:
            self.counts[m.model_id] = CoverageCounts(m.n_layer, m.n_expert)
            self._by_model[m.model_id] = {}
            self.maps.setdefault(m.model_id, MapRow(m.model_id, 0, []))
            self._dirty_maps.add(m.model_id)

    def _slice_problem(self, s: SliceRef) -> str | None:
        row = self.models.get(s.model_id)
        if row is None:
            return "unknown_model"
        m = row.manifest
        if not (s.layer < m.n_layer and 0 <= s.lo < s.hi <= m.n_expert):
            return "bad_slice_range"
        return None

    def _touch(self, model_id: str) -> None:
        self._dirty_maps.add(model_id)
        self._dirty_ageout.add(model_id)

    def _index_cov(self, row: CoverageRow, sign: int = 1) -> None:
        s = row.slice
        kind = contribution(row)
        if kind is not None:
            self.counts[s.model_id].add(kind, s.layer, s.lo, s.hi, sign)
        if sign > 0:
            self.coverage.setdefault(row.peer_id, {})[s] = row
            self._by_model[s.model_id][(row.peer_id, s)] = row
        else:
            rows = self.coverage.get(row.peer_id, {})
            rows.pop(s, None)
            if not rows:
                self.coverage.pop(row.peer_id, None)
            self._by_model[s.model_id].pop((row.peer_id, s), None)
        self._touch(s.model_id)

    def _put_cov(self, row: CoverageRow, changes: list[Change]) -> None:
        old = self.coverage.get(row.peer_id, {}).get(row.slice)
        if old is not None:
            self._index_cov(old, -1)
        self._index_cov(row)
        changes.append(Put(row))

    def _del_cov(self, row: CoverageRow, changes: list[Change]) -> None:
        self._index_cov(row, -1)
        changes.append(Delete(Table.COVERAGE, coverage_key(row.peer_id, row.slice)))

    def _index_lease(self, lease: LeaseRow, sign: int = 1) -> None:
        s = lease.slice
        self.counts[s.model_id].add("pending", s.layer, s.lo, s.hi, sign)
        if sign > 0:
            self.leases[lease.lease_id] = lease
            self._lease_of[lease.peer_id] = lease.lease_id
        else:
            self.leases.pop(lease.lease_id, None)
            if self._lease_of.get(lease.peer_id) == lease.lease_id:
                del self._lease_of[lease.peer_id]

    def _del_lease(self, lease: LeaseRow, changes: list[Change]) -> None:
        self._index_lease(lease, -1)
        changes.append(Delete(Table.LEASES, lease.lease_id))

    def _commit(self, changes: list[Change]) -> None:
        if changes:
            self.store.apply(changes)

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

    # -- queries used by several views ----------------------------------------------------------

    def hosts_of(self, model_id: str) -> list[str]:
        return [url for url, c in self.coordinators.items() if model_id in c.model_ids]

    def _poll_views(self, model_id: str) -> list[PollView | None]:
        return [self.polls[u].last_ok if u in self.polls else None for u in self.hosts_of(model_id)]

    def saturated(self, model_id: str, now: float) -> bool:
        obs = observe(self._poll_views(model_id), now, self._rp)
        return obs is not None and obs.saturated

    def recruiting(self, model_id: str) -> bool:
        st = self.recruit.get(model_id)
        return st is not None and st.recruiting

    def target(self, model_id: str) -> int:
        return effective_target(self.policy.base_target, self.policy.boost, self.recruiting(model_id))

    def download_sources(self, model_id: str) -> list[str]:
        """Coordinators hosting ``model_id``, best first: polled fine lately, then least busy; random among equals."""
        ranked: list[tuple[int, float, float, str]] = []
        for url in self.hosts_of(model_id):
            p = self.polls.get(url)
            ok = p is not None and p.ok
            busy = p.last_ok.busy / max(1, p.last_ok.slots) if p is not None and p.last_ok is not None else 1.0
            ranked.append((0 if ok else 1, busy, self.rng.uniform(0.0, 1.0), url))
        return [u for *_, u in sorted(ranked)]

    # -- coordinators ---------------------------------------------------------------------------

    def register(self, req: RegisterModels, now: float) -> RegisterAck:
        """``POST /api/models``. Errors: ``bad_manifest`` (400), ``stale_registration`` and
        ``manifest_conflict`` (409). The URL is kept without a trailing slash."""
        req = msgspec.structs.replace(req, url=req.url.rstrip("/"))
        seen: set[str] = set()
        for m in req.models:
            problems = m.problems()
            if problems:
                raise _http_error(f"model {m.model_id!r}: {'; '.join(problems)}", "bad_manifest", param="models")
            if m.model_id in seen:
                raise _http_error(f"model {m.model_id!r} listed twice", "bad_manifest", param="models")
            seen.add(m.model_id)
            old = self.models.get(m.model_id)
            if old is not None and _shape(old.manifest) != _shape(m):
                raise _http_error(
                    f"model {m.model_id!r} is already registered with a different shape "
                    f"(layers, experts or expert sizes differ)",
                    "manifest_conflict",
                    status=409,
                )
        stored = self.coordinators.get(req.url)
        if registration_is_stale(stored.epoch if stored else None, req.epoch):
            raise _http_error(
                f"registration epoch {req.epoch} is older than the stored {stored.epoch if stored else 0}",
                "stale_registration",
                status=409,
            )
        changes: list[Change] = []
        for m in req.models:
            old = self.models.get(m.model_id)
            if old is None or old.manifest != m:
                row = ModelRow(m, now if old is None else old.registered_at)
                self._add_model(row)
                changes.append(Put(row))
        ids = [m.model_id for m in req.models]
        crow = CoordinatorRow(req.url, ids, req.epoch, now)
        self.coordinators[req.url] = crow
        self.polls.setdefault(req.url, _Poll())
        changes.append(Put(crow))
        self._commit(changes)
        for mid in {*ids, *(stored.model_ids if stored else [])}:
            if mid in self.models:
                self._touch(mid)
        self.counters["registrations"] += 1
        return RegisterAck(req.url, ids, req.epoch, {mid: f"/api/expert-dispatch-map?model={mid}" for mid in ids})

    def record_poll(self, url: str, busy: int, slots: int, now: float) -> None:
        if url in self.coordinators:
            p = self.polls.setdefault(url, _Poll())
            p.ok, p.at, p.error, p.last_ok = True, now, None, PollView(busy, slots, now)
            self.counters["polls_ok"] += 1

    def record_poll_failure(self, url: str, error: str, now: float) -> None:
        if url in self.coordinators:
            p = self.polls.setdefault(url, _Poll())
            p.ok, p.at, p.error = False, now, error
            self.counters["polls_failed"] += 1

    # -- volunteers: pull -----------------------------------------------------------------------

    def volunteer(self, req: VolunteerRequest, now: float) -> Offer | NoOffer:
        """``POST /api/expert-volunteer``: the scarcest slice that fits, as a fresh lease."""
        if req.max_bytes is None and req.max_experts is None:
            raise _http_error("give max_bytes or max_experts (or both)", "missing_budget", param="max_bytes")
        changes: list[Change] = []
        lease_id = self._lease_of.get(req.peer_id)
        if lease_id is not None:
            lease = self.leases[lease_id]
            if lease.expires_at > now:
                self.counters["offers_renewed"] += 1
                return Offer(lease, self.download_sources(lease.slice.model_id), 0.0, 0, renewed=True)
            self._del_lease(lease, changes)  # lapsed; the tick has not collected it yet
        wanted = set(req.models) if req.models is not None else None
        supplies = [
            ModelSupply(mid, row.manifest.bytes_per_expert, self.counts[mid], self.target(mid))
            for mid, row in self.models.items()
            if (wanted is None or mid in wanted) and self.hosts_of(mid)
        ]
        held = list(self.coverage.get(req.peer_id, {}))
        res = choose_slice(
            supplies,
            Budget(req.max_bytes, req.max_experts),
            held,
            self.rng,
            header_allowance=self.policy.header_allowance,
        )
        if isinstance(res, NoOfferReason):
            self._commit(changes)
            self.counters[f"no_offer_{res.value}"] += 1
            return NoOffer(res, jittered(self.rng, self.policy.retry_after_s))
        lease = LeaseRow(new_lease_id(self.rng), req.peer_id, res.slice, now, now + self.policy.lease_s)
        self._index_lease(lease)
        self._dirty_ageout.add(res.slice.model_id)
        changes.append(Put(lease))
        self._commit(changes)
        self.counters["offers"] += 1
        return Offer(lease, self.download_sources(res.slice.model_id), res.scarcity, res.est_bytes)

    def cancel_lease(self, lease_id: str) -> None:
        """Undo a lease the shell could not complete (no coordinator described the slice file)."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            changes: list[Change] = []
            self._del_lease(lease, changes)
            self._commit(changes)

    # -- volunteers: coverage heartbeats ---------------------------------------------------------

    def heartbeat(self, hb: CoverageHeartbeat, now: float) -> CoverageAck:
        """``POST /api/expert-coverage`` (signature already verified by the shell).

        Errors: ``stale_epoch`` / ``replayed_sequence`` (409), ``duplicate_slice`` (400).
        """
        v = self.volunteers.get(hb.peer_id)
        verdict = check_heartbeat((v.row.epoch, v.row.sequence) if v else None, hb.epoch, hb.sequence)
        if verdict not in ACCEPTED:
            self.counters[f"heartbeats_{verdict.value}"] += 1
            known = f"{v.row.epoch}/{v.row.sequence}" if v else "none"
            raise _http_error(
                f"heartbeat epoch/sequence {hb.epoch}/{hb.sequence} is not newer than {known}",
                verdict.value,
                status=409,
            )
        reported: dict[SliceRef, HeldState] = {}
        serves: dict[SliceRef, int] = {}
        refused: list[SliceDirective] = []
        for h in hb.slices:
            if h.lo >= h.hi:
                refused.append(SliceDirective(h.model_id, h.layer, h.lo, h.hi, "release", reason="bad_slice_range"))
                continue
            s = SliceRef(h.model_id, h.layer, h.lo, h.hi)
            if s in reported:
                raise _http_error(f"slice {h.model_id} {s} listed twice", "duplicate_slice", param="slices")
            problem = self._slice_problem(s)
            if problem is not None:
                refused.append(SliceDirective(h.model_id, h.layer, h.lo, h.hi, "release", reason=problem))
                continue
            reported[s] = h.state
            serves[s] = h.last_serve_ms
        changes: list[Change] = []
        row = VolunteerRow(hb.peer_id, hb.epoch, hb.sequence, v.row.first_seen if v else now, list(hb.addrs), hb.max_bytes)
        addrs_changed = v is None or v.row.addrs != row.addrs
        if v is None or v.row.epoch != hb.epoch or addrs_changed or v.row.max_bytes != hb.max_bytes:
            changes.append(Put(row))
            dirty = False
        else:
            dirty = True
        old_bucket = load_bucket(v.load) if v else 0
        v = self.volunteers[hb.peer_id] = _Volunteer(row, now, hb.load, dirty, serves)
        rows = dict(self.coverage.get(hb.peer_id, {}))
        diff = diff_coverage(rows, reported)
        lease_id = self._lease_of.get(hb.peer_id)
        for s, state in diff.added:
            self._put_cov(CoverageRow(hb.peer_id, s, state, now, proven=serves[s] > 0), changes)
            if lease_id is not None and self.leases[lease_id].slice == s:
                self._del_lease(self.leases[lease_id], changes)
                lease_id = None
        for old, state in diff.changed:
            self._put_cov(msgspec.structs.replace(old, state=state, proven=old.proven or serves[old.slice] > 0), changes)
        for old in diff.removed:
            self._del_cov(old, changes)
        for s in reported:
            cur = self.coverage[hb.peer_id][s]
            if serves[s] > 0 and not cur.proven:
                self._put_cov(msgspec.structs.replace(cur, proven=True), changes)
        if addrs_changed or load_bucket(hb.load) != old_bucket:
            for s in reported:
                self._dirty_maps.add(s.model_id)
        self._commit(changes)
        self.counters["heartbeats_accepted"] += 1
        return CoverageAck(
            hb.peer_id,
            hb.epoch,
            hb.sequence,
            [*(self._directive(self.coverage[hb.peer_id][s], now) for s in reported), *refused],
            heartbeat_s=self.policy.heartbeat_s,
            ttl_s=self.policy.heartbeat_ttl_s,
        )

    def _directive(self, row: CoverageRow, now: float) -> SliceDirective:
        s = row.slice
        if row.retiring_since is None:
            return SliceDirective(s.model_id, s.layer, s.lo, s.hi, "keep", dispatched=row.dispatched)
        left = row.retiring_since + self.policy.cooldown_s - now
        if left > 0:
            return SliceDirective(s.model_id, s.layer, s.lo, s.hi, "drain", release_in_s=left, reason="surplus")
        return SliceDirective(s.model_id, s.layer, s.lo, s.hi, "release", reason="surplus")

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float) -> TickReport:
        """Expire silent volunteers and lapsed leases, step recruitment, age out, rebuild maps."""
        rep = TickReport()
        changes: list[Change] = []
        ttl = self.policy.heartbeat_ttl_s
        for peer, v in list(self.volunteers.items()):
            if not is_expired(v.last_seen, now, ttl):
                continue
            rows = self.coverage.get(peer)
            if rows:
                for row in list(rows.values()):
                    self._del_cov(row, changes)
                rep.expired_volunteers.append(peer)
                self.counters["volunteers_expired"] += 1
            elif now - v.last_seen > self.policy.volunteer_gc_s:
                del self.volunteers[peer]
                changes.append(Delete(Table.VOLUNTEERS, peer))
        for lease in list(self.leases.values()):
            if lease.expires_at <= now:
                self._del_lease(lease, changes)
                self._dirty_ageout.add(lease.slice.model_id)
                rep.expired_leases += 1
                self.counters["leases_expired"] += 1
        for mid in self.models:
            old = self.recruit.get(mid, RecruitState())
            new = step(old, observe(self._poll_views(mid), now, self._rp), now, self._rp)
            self.recruit[mid] = new
            if new.recruiting != old.recruiting:
                changes.append(Put(RecruitRow(mid, new.recruiting, now)))
                rep.recruiting_changed.append(mid)
                self._touch(mid)
                log.info("model %s: recruiting %s", mid, "on" if new.recruiting else "off")
        for mid in sorted(self._dirty_ageout):
            self._age_out(mid, now, changes, rep)
        self._dirty_ageout.clear()
        for mid in sorted(self._dirty_maps):
            if self._rebuild_map(mid, changes):
                rep.changed_maps.append(mid)
        self._dirty_maps.clear()
        if now - self._last_flush >= self.policy.flush_s:
            self._flush(changes, now)
        self._commit(changes)
        return rep

    def flush(self, now: float) -> None:
        """Write every volunteer's latest sequence number (periodically, and before closing)."""
        changes: list[Change] = []
        self._flush(changes, now)
        self._commit(changes)

    def _flush(self, changes: list[Change], now: float) -> None:
        for v in self.volunteers.values():
            if v.dirty:
                changes.append(Put(v.row))
                v.dirty = False
        self._last_flush = now

    def _age_out(self, model_id: str, now: float, changes: list[Change], rep: TickReport) -> None:
        m = self.models[model_id].manifest
        rows = self._by_model[model_id]
        holdings = [
            Holding(
                key=k,
                peer_id=r.peer_id,
                layer=r.slice.layer,
                lo=r.slice.lo,
                hi=r.slice.hi,
                since=r.since,
                serving=r.state is HeldState.SERVING,
                proven=r.proven,
                counted=contribution(r) is not None,
                restorable=(
                    r.retiring_since is not None
                    and r.state is not HeldState.DRAINING
                    and now < r.retiring_since + self.policy.cooldown_s
                ),
            )
            for k, r in rows.items()
        ]
        plan = plan_ageout(m.n_layer, m.n_expert, self.target(model_id), holdings)
        for k in plan.restore:
            self._put_cov(msgspec.structs.replace(rows[k], retiring_since=None), changes)
            rep.restored += 1
            self.counters["restored"] += 1
        for k in plan.retire:
            self._put_cov(msgspec.structs.replace(rows[k], retiring_since=now), changes)
            rep.retired += 1
            self.counters["retired"] += 1
        # a just-retired or restored row re-dirtied the model for age-out; the plan is already stable
        if plan.restore or plan.retire:
            log.info("model %s: age-out retired %d, restored %d", model_id, len(plan.retire), len(plan.restore))

    def _rebuild_map(self, model_id: str, changes: list[Change]) -> bool:
        serving: list[ServingSlice] = []
        for (peer, s), r in self._by_model[model_id].items():
            if r.dispatched:
                v = self.volunteers.get(peer)
                addrs = tuple(v.row.addrs) if v else ()
                load = v.load if v else 0.0
                serving.append(ServingSlice(peer, s.layer, s.lo, s.hi, addrs, preference(r.proven, load, r.since, peer)))
        layers = build_layers(serving)
        cur = self.maps.get(model_id, MapRow(model_id, 0, []))
        if layers == cur.layers:
            return False
        new = MapRow(model_id, cur.version + 1, layers)
        self.maps[model_id] = new
        changes.append(Put(new))
        return True

    # -- views ----------------------------------------------------------------------------------

    def dispatch_map(self, model_id: str) -> DispatchMap:
        row = self.maps.get(model_id)
        if row is None or model_id not in self.models:
            raise _http_error(f"no model {model_id!r} is registered", "unknown_model", status=404, param="model")
        return DispatchMap(model_id, row.version, row.layers)

    def map_version(self, model_id: str) -> int:
        row = self.maps.get(model_id)
        return row.version if row else 0

    def demand(self, now: float, model_ids: Iterable[str] | None = None) -> DemandView:
        out: list[ModelDemand] = []
        for mid in sorted(self.models if model_ids is None else model_ids):
            if mid not in self.models:
                raise _http_error(f"no model {mid!r} is registered", "unknown_model", status=404, param="model")
            target = self.target(mid)
            c = self.counts[mid]
            out.append(
                ModelDemand(
                    mid,
                    hosted=bool(self.hosts_of(mid)),
                    saturated=self.saturated(mid, now),
                    recruiting=self.recruiting(mid),
                    base_target=self.policy.base_target,
                    effective_target=target,
                    replicas_min=c.min_replicas(),
                    segments=segments(c, target),
                )
            )
        return DemandView(any(self.recruiting(m) for m in self.models), out)

    def recruitment(self, now: float) -> RecruitmentView:
        out: list[ModelRecruitment] = []
        for mid in sorted(self.models):
            coords: list[CoordinatorView] = []
            busy = slots = 0
            for url in self.hosts_of(mid):
                p = self.polls.get(url, _Poll())
                last = p.last_ok
                sat = last is not None and now - last.at <= self._rp.poll_stale_s and (
                    last.busy >= self.policy.saturation_threshold
                )
                if last is not None:
                    busy += last.busy
                    slots += last.slots
                coords.append(
                    CoordinatorView(
                        url,
                        p.ok,
                        last.busy if last else None,
                        last.slots if last else None,
                        sat,
                        None if p.at is None else round(now - p.at, 3),
                        p.error,
                    )
                )
            st = self.recruit.get(mid, RecruitState())
            out.append(
                ModelRecruitment(
                    mid,
                    busy=busy,
                    slots=slots,
                    saturated=self.saturated(mid, now),
                    recruiting=st.recruiting,
                    recruiting_for_s=round(now - st.changed_at, 3) if st.recruiting else None,
                    base_target=self.policy.base_target,
                    effective_target=self.target(mid),
                    replicas_min=self.counts[mid].min_replicas(),
                    map_version=self.map_version(mid),
                    coordinators=coords,
                    workers=self._workers(mid, now),
                )
            )
        return RecruitmentView(any(m.recruiting for m in out), out)

    def _workers(self, model_id: str, now: float) -> list[WorkerView]:
        by_peer: dict[str, list[CoverageRow]] = {}
        for (peer, _), r in self._by_model[model_id].items():
            by_peer.setdefault(peer, []).append(r)
        out: list[WorkerView] = []
        for peer, rows in sorted(by_peer.items()):
            v = self.volunteers.get(peer)
            views: list[WorkerSliceView] = []
            for r in sorted(rows, key=lambda r: r.slice):
                views.append(
                    WorkerSliceView(
                        str(r.slice),
                        r.slice.layer,
                        r.slice.lo,
                        r.slice.hi,
                        self._state_name(r, now),
                        round(now - r.since, 3),
                        v.last_serve_ms.get(r.slice, 0) if v else 0,
                    )
                )
            out.append(
                WorkerView(
                    peer,
                    age_s=round(now - min(r.since for r in rows), 3),
                    last_heartbeat_age_s=round(now - v.last_seen, 3) if v else 0.0,
                    last_serve_ms=max((w.last_serve_ms for w in views), default=0),
                    load=v.load if v else 0.0,
                    dispatched=any(r.dispatched for r in rows),
                    slices=views,
                )
            )
        return out

    def _state_name(self, r: CoverageRow, now: float) -> str:
        if r.retiring_since is not None:
            return "retiring" if now < r.retiring_since + self.policy.cooldown_s else "released"
        return "dispatched" if r.dispatched else r.state.value

    def live_volunteers(self) -> int:
        return len(self.coverage)


def _shape(m: ModelManifest) -> tuple[int, int, Sequence[int]]:
    return (m.n_layer, m.n_expert, tuple(m.bytes_per_expert))
