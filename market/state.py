"""The market's request handling: registration, pull, heartbeats, polls and the tick (shell over the store).

Sans-IO apart from its ``Store``: every method takes ``now``; randomness comes from the injected
``rng``; nothing awaits, sleeps or reads a clock. With an ``InMemoryStore`` it runs under virtual
time (``tests/sim/test_market_scenarios.py``); the HTTP shell (``market.api``, ``market.server``)
calls it from one trio task at a time. ``Market`` translates requests into calls of the pure
cores (``market.core``), applies their answers to the indexes (``market.indexes``) and writes
the facts they decide; the read views live in ``market.views``.

Rules:
- Decision-grade facts are written through to the store at the end of the call that made them
  (one atomic batch per call): models, coordinators, volunteers' identity/epoch/addresses,
  coverage rows (with their retirement mark and served / held flags), leases, published map versions,
  recruitment flags. A volunteer's sequence number is flushed every ``flush_s`` (and at close):
  a market killed between flushes may accept one replay of a heartbeat from that window.
- Runtime only: last heartbeat time, load, per-slice last serve, coordinator polls.
- Restart: everything durable is loaded; volunteers holding coverage are treated as just seen
  (one heartbeat TTL of grace), so the published map stays valid until they heartbeat again or
  expire; a model that was recruiting keeps recruiting until ``hold_s`` without saturation.
- A rejected request (``RequestError``) changes nothing. A request whose batch the store refuses
  (``StoreError``: a full disk, say; the API answers 503 ``store_error``) changes nothing either:
  memory and store change together or not at all. The durable facts are reloaded from the store
  (which applied none of the batch), the runtime ones (polls, heartbeat times, loads, the sequence
  marks) are kept, and the call's events are dropped (``_restore``). A store that cannot be read back
  either (a database server gone) fails every call that may commit until it can (``_begin``).
- The dispatch map of a model is rebuilt by ``tick`` when something it depends on changed; its
  ``version`` grows exactly when its content changes, and keeps growing across restarts.
- Age-out: while the target falls, surplus holdings get ``retiring_since = now`` (out of the map at
  the next tick; ``market.core.recruit.plan_ageout`` picks them); each heartbeat answer is
  ``market.core.directive``'s (``keep``, ``drain`` during the cooldown, then ``release``). A
  retiring holding is dispatched again if its experts fall below target before it was released.
- Download sources are ranked by ``market.core.sources``: volunteers sharing a holding that contains
  the slice, the GGUF's origin mirrors, the coordinators.
- A lease stays answerable (``lease_view``, ``GET /api/leases/{id}``) while it is open, and after the
  first heartbeat converted it into coverage for as long as that coverage is ``loading`` and its
  volunteer is within its heartbeat TTL (``CoverageRow.lease_id`` keeps the link, durably): peers a
  volunteer downloads from check it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Concatenate, Final, ParamSpec, TypeVar

import msgspec

from market.addresses import AddressBook
from market.core.assign import Budget, ModelSupply, NoOfferReason, choose_slice, jittered, new_lease_id
from market.core.credit import credit_row, flops_per_pair
from market.core.directive import Reason, directive, wire_directive
from market.core.pacing import IdlePacing
from market.core.records import (
    CoordinatorRow,
    CoverageRow,
    HeldState,
    LeaseRow,
    ModelRow,
    QuarantineRow,
    RecruitRow,
    SliceRef,
    Table,
    VolunteerRow,
)
from market.core.recruit import PollView, RecruitState, SpeedReport, observe, step
from market.core.registry import (
    ACCEPTED,
    address_key,
    check_heartbeat,
    diff_coverage,
    epoch_bound_ms,
    evidence_problem,
    is_expired,
    manifest_shape,
    network_tag,
    registration_is_stale,
)
from market.core.sources import PeerCandidate, rank_origins, rank_peer_sources, rank_sources
from market.core.wiring import load_bucket
from market.indexes import Indexes, LiveVolunteer, PollRecord
from market.journal import Journal
from market.policy import MarketPolicy
from market.replica import ReplicaLink, apply_catchup, exchange_seen, renew_unlocked
from market.store import Change, Delete, Put, Store
from market.upkeep import age_out, drop_unprovable, rebuild_map
from market.views import (
    credit_board,
    demand_view,
    dispatch_map,
    lease_view,
    map_version,
    recruitment_view,
    volunteer_credit,
)
from swarm.core.rng import Rng
from swarm.dispatch_map import DispatchMap
from swarm.errors import RequestError, StoreError
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageAck,
    CoverageHeartbeat,
    CreditBoard,
    DemandView,
    EventLog,
    LeaseView,
    ModelHistory,
    QuarantineEvidence,
    RecruitmentView,
    RegisterAck,
    RegisterModels,
    ReportAck,
    SliceDirective,
    VolunteerCredit,
    VolunteerRequest,
)

__all__ = ["Market", "NoOffer", "Offer", "TickReport"]

log = logging.getLogger(__name__)


_INT64_MAX: Final = 2**63 - 1


@dataclass(frozen=True)
class Offer:
    """A lease granted; the shell turns it into an ``Assignment`` (it fetches size and sha256)."""

    lease: LeaseRow
    sources: list[str]  # coordinator base URLs hosting the model, best first
    scarcity: float
    est_bytes: int
    renewed: bool = False  # the volunteer already had this lease
    peers: list[PeerCandidate] = field(default_factory=list)  # volunteers to download it from, best first
    origins: list[str] = field(default_factory=list)  # mirrors of the model's GGUF, best first


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


def _finite(x: float | None) -> float | None:
    """A reported speed, or None when it is no usable number (a coordinator's bad report says nothing)."""
    return x if x is not None and math.isfinite(x) and x >= 0 else None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _call(fn: Callable[Concatenate[Market, _P], _R]) -> Callable[Concatenate[Market, _P], _R]:
    """A call that may commit: ``Market._end`` after it, told whether it returned."""

    @functools.wraps(fn)
    def run(market: Market, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        ok = False
        try:
            out = fn(market, *args, **kwargs)
            ok = True
        finally:
            market._end(ok)
        return out

    return run


def _http_error(message: str, code: str, status: int = 400, param: str | None = None) -> RequestError:
    return RequestError(message, code=code, status=status, param=param)


class Market:
    def __init__(self, store: Store, policy: MarketPolicy, *, now: float, rng: Rng, net_salt: bytes = b"",
                 link: ReplicaLink | None = None) -> None:
        """``net_salt``: the secret network tags are hashed with (the server derives it from its token, so
        a restart keeps them). ``link``: the store as other replicas share it (``market.replica``)."""
        self.store = store
        self._link = link
        self.leading = link is None  # runs the tick's decisions (``market.replica``: one leader)
        self._heard: dict[str, tuple[float, float]] = {}  # peer -> (when, load) heard since the last exchange
        self._seen_read_at = -math.inf
        self._maps_arrived: set[str] = set()  # maps another replica published (the next tick reports them)
        self._caught_up_at = now  # when memory last caught up with the other replicas (the load, ``_begin``)
        self._report_marks: dict[str, tuple[int, int]] = {}  # coordinator|model -> last numbered report (runtime)
        self.policy = policy
        self.rng = rng
        self._net_salt = net_salt  # network tags name no address
        self.ix = Indexes(policy)
        self._last_flush = now
        self.counters: Counter[str] = Counter()
        self._served_peers: set[str] = set()  # volunteers a coordinator reported verified answers of (runtime)
        # (peer, slice) -> when a serving holding not yet proved loses its place (runtime: a restart
        # gives every holding a fresh grace, so coverage from before proofs ruled is not a hole at once)
        self._proof_due: dict[tuple[str, SliceRef], float] = {}
        # peer -> slice -> (why, when) the market dropped its holding: the refusal's reason when it lists it
        # again, and no new lease for it for ``dropped_penalty_s`` (runtime, bounded)
        self._dropped: dict[str, dict[SliceRef, tuple[Reason, float]]] = {}
        self._n_dropped = 0
        self.addresses = AddressBook()  # which identities speak from which IP address (runtime)
        self.pacing = IdlePacing(rate=policy.idle_poll_rate, max_s=policy.max_idle_retry_s)  # runtime, per replica
        self._last_gc = -math.inf
        self._unlisted_since: dict[str, float] = {}  # model -> since when no coordinator lists it (runtime)
        self.journal = Journal()  # the event log, the charts' history, call rates: for people (runtime)
        self._polled: dict[str, tuple[int, int]] = {}  # peer -> last (epoch, sequence) of a poll (runtime)
        self._stale: float | None = None  # when a refused batch could not be read back (``_begin``)
        dropped = self.ix.load(store.load(), now)
        if dropped:
            store.apply(dropped)

    def _begin(self, now: float) -> None:
        """The start of a call that may commit: what ``_restore`` rolls the event log back to; while the store
        could not be read back (``_stale``), it is read first, and the call fails while it still cannot be.
        A replica first takes the database's write lock and catches up with the others (``market.replica``)."""
        if self._stale is not None:
            self._restore(self._stale, refused=False)
        if self._link is not None:
            catch = self._link.begin_call()
            if catch.snapshot is not None:
                self.ix = self.ix.reloaded(catch.snapshot, now)
                self.addresses.keep_open_leases(self.ix)
            elif catch.changes:
                self._maps_arrived |= apply_catchup(self.ix, catch.changes, now)
            self._caught_up_at = now
        self.journal.mark()

    def _end(self, ok: bool) -> None:
        """The end of a call (``_call``): a replica commits what is left open, or rolls it back."""
        if self._link is None:
            return
        if ok:
            self._link.end_call(True)
            return
        try:
            self._link.end_call(False)
        except StoreError:
            log.debug("rolling a failed call back failed too", exc_info=True)

    def _claim(self, peer_id: str, epoch: int, sequence: int, what: str) -> None:
        """A replica's counter check against every replica's (``market.replica``): 409 when replayed."""
        if self._link is not None and not self._link.claim_counter(peer_id, epoch, sequence):
            self.counters[f"{what}_replayed_sequence"] += 1
            raise _http_error(f"{what} epoch/sequence {epoch}/{sequence} is not newer than one another market "
                              "replica accepted", "replayed_sequence", status=409)

    def _commit(self, changes: list[Change], now: float) -> None:
        if not changes:
            return
        try:
            self.store.apply(changes)
        except StoreError:
            self._restore(now)
            raise

    def _restore(self, now: float, *, refused: bool = True) -> None:
        """After the store refused a batch (and so applied none of it): memory as the store has it, plus
        the runtime facts the store never holds (module rules, ``Indexes.reloaded``)."""
        if refused:
            self.journal.rollback()
            self.counters["store_failures"] += 1
        try:
            self.ix = self.ix.reloaded(self.store.load(), now)
        except StoreError:
            if self._stale is None:
                log.error("the store cannot be read back: calls that may commit fail until it can")
                self._stale = now
            raise
        self._stale = None
        self.addresses.keep_open_leases(self.ix)
        if refused:
            log.error("the store refused a batch: memory rolled back to it")
        else:
            log.warning("the store answers again: memory reloaded from it")

    def download_sources(self, model_id: str) -> list[str]:
        """Coordinators hosting ``model_id``, best first (``market.core.sources``)."""
        return rank_sources(self.ix.sources(model_id), self.rng)

    def _offer(self, lease: LeaseRow, now: float, scarcity: float, est_bytes: int, *, renewed: bool = False) -> Offer:
        """An ``Offer`` of ``lease`` with its download sources, best first (``market.core.sources``):
        volunteers holding the slice, the GGUF's mirrors (the hosting coordinators' ``--origin`` lists,
        then the manifest's), the coordinators."""
        s = lease.slice
        coordinators = self.download_sources(s.model_id)
        peers = rank_peer_sources(self.ix.peer_candidates(s.model_id, s.layer, now), model_id=s.model_id,
                                  layer=s.layer, lo=s.lo, hi=s.hi, requester=lease.peer_id, rng=self.rng)
        row = self.ix.models.get(s.model_id)
        listed = [u for url in coordinators if url in self.ix.coordinators
                  for u in self.ix.coordinators[url].origins.get(s.model_id, [])]
        manifest_origins = list(row.manifest.origins) if row is not None and row.manifest.tensor_offsets else []
        return Offer(lease, coordinators, scarcity, est_bytes, renewed=renewed, peers=peers,
                     origins=rank_origins([*listed, *manifest_origins]))

    def lease_view(self, lease_id: str, now: float) -> LeaseView:
        return lease_view(self.ix, lease_id, now)

    # -- coordinators ---------------------------------------------------------------------------

    @_call
    def register(self, req: RegisterModels, now: float) -> RegisterAck:
        """``POST /api/models``. Errors: ``bad_manifest``, ``bad_epoch`` (400: more than ``max_epoch_ahead_s``
        ahead), ``stale_registration``, ``manifest_conflict`` and ``too_many_models`` (409: past ``max_models``).
        The URL is kept without a trailing slash."""
        self._begin(now)
        req = msgspec.structs.replace(req, url=req.url.rstrip("/"))
        seen: set[str] = set()
        for m in req.models:
            problems = m.problems()
            if problems:
                raise _http_error(f"model {m.model_id!r}: {'; '.join(problems)}", "bad_manifest", param="models")
            if m.model_id in seen:
                raise _http_error(f"model {m.model_id!r} listed twice", "bad_manifest", param="models")
            seen.add(m.model_id)
            old = self.ix.models.get(m.model_id)
            if old is not None and manifest_shape(old.manifest) != manifest_shape(m):
                raise _http_error(
                    f"model {m.model_id!r} is already registered with a different shape "
                    f"(layers, experts or expert sizes differ)",
                    "manifest_conflict",
                    status=409,
                )
            if old is not None and old.manifest.expert_sha256 and m.expert_sha256 and (
                    old.manifest.expert_sha256 != m.expert_sha256 or old.manifest.tensor_offsets != m.tensor_offsets):
                raise _http_error(f"model {m.model_id!r} is already registered with other expert hashes or offsets",
                                  "manifest_conflict", status=409)
        if req.epoch > epoch_bound_ms(now, self.policy.max_epoch_ahead_s):
            raise _http_error(f"registration epoch {req.epoch} lies more than {self.policy.max_epoch_ahead_s:.0f} s "
                              f"in the future (a start time in ms is expected)", "bad_epoch", param="epoch")
        new_models = seen - self.ix.models.keys()
        if len(self.ix.models) + len(new_models) > self.policy.max_models:
            raise _http_error(f"the market holds {len(self.ix.models)} models; {len(new_models)} more would pass its "
                              f"limit of {self.policy.max_models}", "too_many_models", status=409, param="models")
        stored = self.ix.coordinators.get(req.url)
        if registration_is_stale(stored.epoch if stored else None, req.epoch):
            raise _http_error(
                f"registration epoch {req.epoch} is older than the stored {stored.epoch if stored else 0}",
                "stale_registration",
                status=409,
            )
        changes: list[Change] = []
        for m in req.models:
            old = self.ix.models.get(m.model_id)
            if old is not None and old.manifest.can_verify_experts and not m.can_verify_experts:
                # an older coordinator of the same model: keep what peers and mirrors need
                m = msgspec.structs.replace(m, kind_bytes=old.manifest.kind_bytes,
                                            tensor_offsets=old.manifest.tensor_offsets,
                                            expert_sha256=old.manifest.expert_sha256)
            if old is None or old.manifest != m:
                row = ModelRow(m, now if old is None else old.registered_at)
                self.ix.add_model(row)
                changes.append(Put(row))
        ids = [m.model_id for m in req.models]
        local = {mid: [(s.layer, s.lo, s.hi) for s in spans] for mid, spans in req.local_experts.items() if mid in ids}
        origins = {m.model_id: list(m.origins) for m in req.models if m.origins}
        crow = CoordinatorRow(req.url, ids, req.epoch, now, req.peer_id, local, origins)
        self.ix.coordinators[req.url] = crow
        self.ix.coordinators_changed()
        self.ix.polls.setdefault(req.url, PollRecord(since=now))
        changes.append(Put(crow))
        self._commit(changes, now)
        for mid in {*ids, *(stored.model_ids if stored else [])}:
            if mid in self.ix.models:
                self.ix.touch(mid)
        self.counters["registrations"] += 1
        return RegisterAck(req.url, ids, req.epoch, {mid: f"/api/expert-dispatch-map?model={mid}" for mid in ids})

    def record_poll(self, url: str, busy: int, slots: int, now: float, *, tps: float = 0.0,
                    speed: SpeedReport | None = None) -> None:
        """A successful ``/slots`` poll; ``speed``: the coordinator's experienced speed and floor, when it
        reports them (``market.core.recruit``'s saturation rule)."""
        if url in self.ix.coordinators:
            p = self.ix.polls.setdefault(url, PollRecord(since=now))
            sp = speed if speed is not None else SpeedReport()
            p.ok, p.at, p.error, p.last_ok = True, now, None, PollView(
                busy, slots, now, _finite(sp.mean_active_tps), _finite(sp.tps_floor), _finite(sp.projected_tps))
            p.tps = tps if math.isfinite(tps) and tps >= 0 else 0.0
            if p.down:
                p.down = False
                self._host_changed(url, now, "host_up", "answers its /slots polls again")
            self.counters["polls_ok"] += 1

    def record_poll_failure(self, url: str, error: str, now: float) -> None:
        """A failed ``/slots`` poll; a coordinator whose polls have all failed for ``host_down_s`` (since it
        last answered, or since the market learnt of it) stops counting as hosting."""
        if url in self.ix.coordinators:
            p = self.ix.polls.setdefault(url, PollRecord(since=now))
            p.ok, p.at, p.error = False, now, error
            if not p.down and now - p.good_at() >= self.policy.host_down_s:
                p.down = True
                self._host_changed(url, now, "host_down", f"no /slots answer for {now - p.good_at():.0f} s: {error[:200]}")
            self.counters["polls_failed"] += 1

    def _host_changed(self, url: str, now: float, kind: str, detail: str) -> None:
        c = self.ix.coordinators[url]
        for mid in c.model_ids:
            if mid in self.ix.models:
                self.ix.touch(mid)
        self.counters[kind] += 1
        self._event(kind, now, detail=f"{url[:200]}: {detail}")
        log.log(logging.WARNING if kind == "host_down" else logging.INFO, "coordinator %s: %s", url, detail)

    def _forget_gone(self, now: float, changes: list[Change]) -> None:
        """A coordinator down for ``coordinator_gc_s`` is deregistered; a model no registered coordinator
        lists is dropped ``model_gc_s`` after it stopped being listed (its volunteers are told ``release``
        / ``unknown_model`` at their next heartbeat; a coordinator registering it again starts afresh)."""
        gc = self.policy.coordinator_gc_s
        for url, p in list(self.ix.polls.items()):
            if url in self.ix.coordinators and p.down and now - p.good_at() >= gc:
                c = self.ix.coordinators.pop(url)
                del self.ix.polls[url]
                self.ix.coordinators_changed()
                changes.append(Delete(Table.COORDINATORS, url))
                for mid in c.model_ids:
                    if mid in self.ix.models:
                        self.ix.touch(mid)
                self.counters["coordinators_gone"] += 1
                self._event("coordinator_gone", now, detail=f"{url[:200]}: no /slots answer for {now - p.good_at():.0f} s")
                log.warning("coordinator %s deregistered: no /slots answer for %.0f s", url, now - p.good_at())
        listed = {mid for c in self.ix.coordinators.values() for mid in c.model_ids}
        for mid in list(self.ix.models):
            if mid in listed:
                self._unlisted_since.pop(mid, None)
                continue
            since = self._unlisted_since.setdefault(mid, now)
            if now - since >= self.policy.model_gc_s:
                del self._unlisted_since[mid]
                self.ix.drop_model(mid, changes)
                self.journal.forget_model(mid)
                self.counters["models_dropped"] += 1
                self._event("model_dropped", now, model_id=mid,
                            detail=f"no coordinator lists it for {self.policy.model_gc_s:.0f} s")
                log.warning("model %s dropped: no coordinator lists it", mid)

    # -- volunteers: pull -----------------------------------------------------------------------

    @_call
    def volunteer(self, req: VolunteerRequest, now: float, *, address: str = "") -> Offer | NoOffer:
        """``POST /api/expert-volunteer``: the scarcest slice that fits, as a fresh lease. ``(epoch,
        sequence)``, when given, must be newer than the volunteer's last poll or heartbeat (409
        ``replayed_sequence`` / ``stale_epoch``); ``address`` (the client's IP) holds at most
        ``max_leases_per_address`` open leases."""
        renewed = renew_unlocked(self, req, now, address)
        if renewed is not None:
            return renewed
        self._begin(now)
        if req.max_bytes is None and req.max_experts is None:
            raise _http_error("give max_bytes or max_experts (or both)", "missing_budget", param="max_bytes")
        if address and not self._note_address(req.peer_id, address, now):
            self.counters["no_offer_identity_cap"] += 1
            return NoOffer(NoOfferReason.ADDRESS_CAP, jittered(self.rng, self.policy.retry_after_s))
        if req.epoch is not None and req.sequence is not None:
            self._accept_counter(req.peer_id, req.epoch, req.sequence)
        q = self.quarantine_of(req.peer_id, now)
        if q is not None:
            self.counters["no_offer_quarantined"] += 1
            return NoOffer(NoOfferReason.QUARANTINED, max(1.0, q.until - now))
        if (live := self.ix.volunteers.get(req.peer_id)) is not None and live.paused:
            self.counters["no_offer_paused"] += 1  # it says it resumed in a heartbeat before it polls
            return NoOffer(NoOfferReason.PAUSED, jittered(self.rng, self.policy.retry_after_s))
        changes: list[Change] = []
        lease_id = self.ix.lease_of.get(req.peer_id)
        if lease_id is not None:
            lease = self.ix.leases[lease_id]
            if lease.expires_at > now:
                self.counters["offers_renewed"] += 1
                return self._offer(lease, now, 0.0, 0, renewed=True)
            self.ix.del_lease(lease, changes)  # lapsed; the tick has not collected it yet
        wanted = set(req.models) if req.models is not None else None
        supplies = [
            ModelSupply(mid, row.manifest.bytes_per_expert, self.ix.counts[mid], self.ix.targets(mid))
            for mid, row in self.ix.models.items()
            if (wanted is None or mid in wanted) and self.ix.hosts_of(mid)
        ]
        # what it holds, and what it was dropped from lately (it squatted a download, or never proved it)
        held = [*self.ix.coverage.get(req.peer_id, {}), *self._penalised(req.peer_id, now)]
        res = choose_slice(
            supplies,
            Budget(req.max_bytes, req.max_experts),
            held,
            self.rng,
            header_allowance=self.policy.header_allowance,
        )
        if isinstance(res, NoOfferReason):
            self._commit(changes, now)
            self.counters[f"no_offer_{res.value}"] += 1
            return NoOffer(res, jittered(self.rng, self.pacing.retry_after(req.peer_id, self.policy.retry_after_s, now)))
        if address and self.addresses.holdings(address, self.ix) >= self.policy.max_leases_per_address:
            self._commit(changes, now)
            self.counters["no_offer_address_cap"] += 1
            return NoOffer(NoOfferReason.ADDRESS_CAP, jittered(self.rng, self.policy.retry_after_s))
        lease_id = new_lease_id(self.rng)
        while lease_id in self.ix.leases or lease_id in self.ix.cov_by_lease:  # replicas seeded alike draw alike
            lease_id = new_lease_id(self.rng)
        lease = LeaseRow(lease_id, req.peer_id, res.slice, now, now + self.policy.lease_s)
        self._event("assigned", now, peer_id=req.peer_id, s=res.slice, detail=f"scarcity {res.scarcity:.2f}")
        if address:
            self.addresses.leased(lease.lease_id, address)
        self.ix.index_lease(lease)
        self.ix.dirty_ageout.add(res.slice.model_id)
        changes.append(Put(lease))
        self._commit(changes, now)
        self.counters["offers"] += 1
        return self._offer(lease, now, res.scarcity, res.est_bytes)

    # -- addresses and identities (runtime) ----------------------------------------------------

    def _note_address(self, peer: str, address: str, now: float) -> bool:
        """Record that ``peer`` spoke from ``address``; False (and nothing recorded) for a new identity at
        an address that already has ``max_identities_per_address`` live ones (``market.addresses``)."""
        return self.addresses.note(peer, address, now, max_per_address=self.policy.max_identities_per_address,
                                   max_total=self.policy.max_identities)

    def _forget_idle_identities(self, now: float) -> None:
        """Address marks of identities that hold nothing age out after ``identity_idle_s`` of silence (as
        identities that never held anything do: the tick), and so do old drop marks."""
        self.addresses.forget_idle(now, self.policy.identity_idle_s, self.ix)
        for peer, marks in list(self._dropped.items()):
            for sl, (_, at) in list(marks.items()):
                if now - at > self.policy.dropped_penalty_s:
                    del marks[sl]
            if not marks:
                del self._dropped[peer]

    def _penalised(self, peer: str, now: float) -> list[SliceRef]:
        """The slices ``peer`` was dropped from within ``dropped_penalty_s``: not offered to it again yet."""
        return [sl for sl, (_, at) in self._dropped.get(peer, {}).items() if now - at <= self.policy.dropped_penalty_s]

    def _mark_dropped(self, peer: str, sl: SliceRef, reason: Reason, now: float) -> None:
        self._dropped.setdefault(peer, {})[sl] = (reason, now)
        self._n_dropped += 1
        if self._n_dropped > 100_000:  # bounded: the oldest marks go
            self._n_dropped = 0
            for p in list(self._dropped)[: max(1, len(self._dropped) // 10)]:
                del self._dropped[p]

    @_call
    def cancel_lease(self, lease_id: str, now: float) -> None:
        """Undo a lease the shell could not complete (no coordinator described the slice file)."""
        self._begin(now)
        lease = self.ix.leases.get(lease_id)
        if lease is not None:
            changes: list[Change] = []
            self.ix.del_lease(lease, changes)
            self._commit(changes, now)

    # -- volunteers: coverage heartbeats ---------------------------------------------------------

    @_call
    def heartbeat(self, hb: CoverageHeartbeat, now: float, *, address: str = "") -> CoverageAck:
        """``POST /api/expert-coverage`` (signature already verified by the shell). ``address``: the
        client's IP. An identity is stored once it holds something; until then it lives in memory only
        and is forgotten after ``identity_idle_s`` of silence.

        Errors: ``stale_epoch`` / ``replayed_sequence`` (409), ``duplicate_slice`` (400),
        ``too_many_identities`` (429: a new identity at an address with ``max_identities_per_address``).
        """
        self._begin(now)
        address = address_key(address)
        if address and not self._note_address(hb.peer_id, address, now):
            self.counters["heartbeats_identity_cap"] += 1
            raise _http_error(f"this address already speaks for {self.policy.max_identities_per_address} identities",
                              "too_many_identities", status=429)
        q = self.quarantine_of(hb.peer_id, now)
        if q is not None:
            self.counters["heartbeats_quarantined"] += 1
            raise _http_error(f"this volunteer is refused for {q.until - now:.0f} s more: {q.evidence[:300]}",
                              "quarantined", status=403)
        v = self.ix.volunteers.get(hb.peer_id)
        verdict = check_heartbeat(self._known_counter(hb.peer_id), hb.epoch, hb.sequence)
        if verdict not in ACCEPTED:
            self.counters[f"heartbeats_{verdict.value}"] += 1
            known = f"{v.row.epoch}/{v.row.sequence}" if v else "none"
            raise _http_error(
                f"heartbeat epoch/sequence {hb.epoch}/{hb.sequence} is not newer than {known}",
                verdict.value,
                status=409,
            )
        self._claim(hb.peer_id, hb.epoch, hb.sequence, "heartbeat")
        if self._link is not None:
            self._heard[hb.peer_id] = (now, hb.load)
        reported: dict[SliceRef, HeldState] = {}
        serves: dict[SliceRef, int] = {}
        refused: list[SliceDirective] = []
        listed: set[SliceRef] = set()
        for h in hb.slices:
            if h.lo >= h.hi:
                # not a slice at all, so never a duplicate: refused before the duplicate check
                refused.append(wire_directive(h, directive(None, now, self.policy.cooldown_s, Reason.BAD_SLICE_RANGE)))
                continue
            s = SliceRef(h.model_id, h.layer, h.lo, h.hi)
            if s in listed:
                raise _http_error(f"slice {h.model_id} {s} listed twice", "duplicate_slice", param="slices")
            listed.add(s)
            problem = self.ix.slice_problem(s)
            if problem is None and self.policy.coverage_requires_lease and not self._assigned(hb.peer_id, s):
                mark = self._dropped.get(hb.peer_id, {}).get(s)
                problem = mark[0] if mark is not None else Reason.NOT_ASSIGNED
            if problem is not None:
                refused.append(wire_directive(h, directive(None, now, self.policy.cooldown_s, problem)))
                self.counters[f"slices_refused_{problem.value}"] += 1
                continue
            reported[s] = h.state
            serves[s] = h.last_serve_ms
        changes: list[Change] = []
        net = network_tag(address, self._net_salt) if address else (v.row.net if v else "")
        row = VolunteerRow(hb.peer_id, hb.epoch, hb.sequence, v.row.first_seen if v else now, list(hb.addrs), hb.max_bytes,
                           sorted(set(hb.protocols)), net)
        # a changed address, network or protocol list changes the map (wiring leaves out who cannot serve)
        addrs_changed = v is None or v.row.addrs != row.addrs or v.row.protocols != row.protocols or v.row.net != net
        changed = v is None or v.row.epoch != hb.epoch or addrs_changed or v.row.max_bytes != hb.max_bytes
        was_stored = v is not None and v.stored
        old_bucket = load_bucket(v.load) if v else 0
        if hb.paused != (v.paused if v else ""):  # the owner paused it (its slices come draining) or resumed it
            self._event("paused" if hb.paused else "resumed", now, peer_id=hb.peer_id, detail=hb.paused)
        download, dl = None, hb.download  # how far a slice it reports loading got (the dashboard's)
        if dl is not None and reported.get(ref := SliceRef(dl.model_id, dl.layer, dl.lo, dl.hi)) is HeldState.LOADING:
            download = (ref, min(1.0, dl.done_bytes / dl.total_bytes))
        v = self.ix.volunteers[hb.peer_id] = LiveVolunteer(row, now, hb.load, False, serves,
                                                           "".join(ch for ch in hb.display_name if ch.isprintable()),
                                                           share_slices=hb.share_slices, stored=was_stored,
                                                           paused=hb.paused, download=download)
        rows = dict(self.ix.coverage.get(hb.peer_id, {}))
        diff = diff_coverage(rows, reported)
        lease_id = self.ix.lease_of.get(hb.peer_id)
        for s, state in diff.added:
            converted = lease_id is not None and self.ix.leases[lease_id].slice == s
            # served comes from coordinators' reports only, never from the volunteer's own word
            self.ix.put_cov(CoverageRow(hb.peer_id, s, state, now, served=hb.peer_id in self._served_peers,
                                        lease_id=lease_id if converted and lease_id is not None else ""), changes)
            self._event(state.value, now, peer_id=hb.peer_id, s=s)
            if converted and lease_id is not None:
                self.ix.del_lease(self.ix.leases[lease_id], changes)
                lease_id = None
        for old, state in diff.changed:
            self.ix.put_cov(msgspec.structs.replace(old, state=state), changes)
            self._event(state.value, now, peer_id=hb.peer_id, s=old.slice)
        for old in diff.removed:
            self.ix.del_cov(old, changes)
            self._event("released", now, peer_id=hb.peer_id, s=old.slice)
        if addrs_changed or load_bucket(hb.load) != old_bucket:
            for s in reported:
                self.ix.dirty_maps.add(s.model_id)
        # the identity row is stored once it holds something (then its epoch mark outlives a restart); a
        # throwaway identity's heartbeats cost memory for ``identity_idle_s``, never a row
        if (was_stored and changed) or (not was_stored and hb.peer_id in self.ix.coverage):
            changes.append(Put(row))
            v.stored = True
        elif was_stored:
            v.dirty = True  # a newer sequence only: flushed every flush_s
        self._commit(changes, now)
        self.counters["heartbeats_accepted"] += 1
        return CoverageAck(
            hb.peer_id,
            hb.epoch,
            hb.sequence,
            [*(self._directive(self.ix.coverage[hb.peer_id][s], now) for s in reported), *refused],
            heartbeat_s=self.policy.heartbeat_s,
            ttl_s=self.policy.heartbeat_ttl_s,
            coordinators=self.coordinator_peers({s.model_id for s in reported}),
        )

    def _assigned(self, peer_id: str, s: SliceRef) -> bool:
        """Does this volunteer hold ``s`` by the market's word: a coverage row it has, or its open lease?"""
        if s in self.ix.coverage.get(peer_id, {}):
            return True
        lease_id = self.ix.lease_of.get(peer_id)
        return lease_id is not None and self.ix.leases[lease_id].slice == s

    def _known_counter(self, peer_id: str) -> tuple[int, int] | None:
        """The newest ``(epoch, sequence)`` accepted from this volunteer, by poll or heartbeat."""
        v = self.ix.volunteers.get(peer_id)
        seen = [c for c in ((v.row.epoch, v.row.sequence) if v else None, self._polled.get(peer_id)) if c is not None]
        return max(seen) if seen else None

    def _accept_counter(self, peer_id: str, epoch: int, sequence: int) -> None:
        verdict = check_heartbeat(self._known_counter(peer_id), epoch, sequence)
        if verdict not in ACCEPTED:
            self.counters[f"polls_{verdict.value}"] += 1
            raise _http_error(f"poll epoch/sequence {epoch}/{sequence} is not newer than the last accepted",
                              verdict.value, status=409)
        self._claim(peer_id, epoch, sequence, "poll")
        self._polled[peer_id] = (epoch, sequence)
        if len(self._polled) > 100_000:  # bounded: the oldest entries go (a heartbeat row keeps its own)
            for k in list(self._polled)[:10_000]:
                del self._polled[k]

    def quarantine_of(self, peer_id: str, now: float) -> QuarantineRow | None:
        return self.ix.quarantine_of(peer_id, now)

    @_call
    def report(self, rep: CoordinatorReport, now: float) -> ReportAck:
        """``POST /api/coordinator-report`` (operator token checked by the shell). What an operator token
        may do here is bounded (DESIGN §12):
        - Only workers that hold a slice of the reported model (a coverage row or a lease of it) count:
          calls, rows and verified answers (the views), credit (their pairs), proofs of holding (``held``);
          any other entry changes nothing and is named in the answer's ``ignored``.
        - Per worker and report at most ``max_report_pairs`` of each count (more is clamped); every
          count is within int64 (the wire).
        - A quarantine must carry ``evidence`` (``QuarantineEvidence``: the call's slice, its input's
          hash, both outputs' hashes, the method), for a slice of the model, with differing output hashes;
          the report is refused otherwise, before anything changes. It drops the worker's coverage and
          lease and refuses it for ``quarantine_s``; the evidence is kept with the quarantine (persisted)
          -- if the worker holds that range of the model (else ``ignored``).
        Errors: ``unknown_coordinator``, ``unknown_model`` (404), ``missing_evidence``, ``bad_evidence`` (400)."""
        self._begin(now)
        url = rep.url.rstrip("/")
        if url not in self.ix.coordinators:
            raise _http_error(f"coordinator {url[:200]!r} is not registered", "unknown_coordinator", status=404, param="url")
        m = self.ix.models.get(rep.model_id)
        if rep.model_id not in self.ix.coordinators[url].model_ids or m is None:
            raise _http_error(f"coordinator {url[:200]!r} does not host {rep.model_id!r}", "unknown_model", status=404,
                              param="model_id")
        for w in rep.workers:  # refused as a whole, before anything changes
            if not w.quarantined:
                continue
            if w.evidence is None:
                raise _http_error(f"the quarantine of {w.peer_id[:128]!r} carries no evidence (QuarantineEvidence: the "
                                  f"slice, the input's and both outputs' sha256, the method)", "missing_evidence",
                                  param="workers")
            problem = evidence_problem(w.evidence, m.manifest)
            if problem:
                raise _http_error(f"the quarantine evidence of {w.peer_id[:128]!r}: {problem}", "bad_evidence",
                                  param="workers")
        if rep.sequence > 0:  # a numbered report lands once (a resend after a lost answer is refused)
            key = f"report|{url}|{rep.model_id}"
            if (rep.epoch, rep.sequence) <= self._report_marks.get(key, (-1, -1)):
                self.counters["report_replayed_sequence"] += 1
                raise _http_error(f"report {rep.epoch}/{rep.sequence} was accepted already", "replayed_sequence",
                                  status=409)
            self._claim(key, rep.epoch, rep.sequence, "report")
        per_pair = flops_per_pair(m.manifest.d_model, m.manifest.d_expert)
        cap = self.policy.max_report_pairs
        changes: list[Change] = []
        newly: list[str] = []
        ignored: list[str] = []
        answered: dict[str, int] = {}  # the dashboard's calls/s (market.journal)
        for w in rep.workers:
            if not self._holds_model(w.peer_id, rep.model_id):
                ignored.append(w.peer_id)  # never volunteered for this coordinator's model: nothing to credit or refuse
                self.counters["report_workers_ignored"] += 1
                continue
            calls, rows, verified, pairs = (min(cap, x) for x in (w.calls, w.rows, w.verified, w.pairs))
            if max(w.calls, w.rows, w.verified, w.pairs) > cap:
                self.counters["report_clamped"] += 1
            c, r, v = self.ix.served.get(w.peer_id, (0, 0, 0))
            self.ix.served[w.peer_id] = (min(_INT64_MAX, c + calls), min(_INT64_MAX, r + rows),
                                         min(_INT64_MAX, v + verified))
            self.ix.reported[w.peer_id] = (w.path, w.latency_ms)
            answered[w.peer_id] = answered.get(w.peer_id, 0) + calls
            if w.quarantined:
                ev = w.evidence
                if ev is None:  # cannot happen: refused above
                    continue
                if not self._holds_range(w.peer_id, rep.model_id, ev.layer, ev.lo, ev.hi):
                    ignored.append(w.peer_id)
                    self.counters["quarantines_ignored"] += 1
                    continue
                if self.quarantine_of(w.peer_id, now) is None:
                    self._quarantine(w.peer_id, w.quarantine or ev.detail or ev.method.value, ev, url, rep.model_id, now,
                                     changes)
                    newly.append(w.peer_id)
                continue
            if pairs and self.quarantine_of(w.peer_id, now) is None:
                credit = credit_row(self.ix.credit.get(w.peer_id), w.peer_id, flops=pairs * per_pair, pairs=pairs,
                                    verified=verified, now=now)
                self.ix.credit[w.peer_id] = credit
                changes.append(Put(credit))
                self.counters["credited_pairs"] += pairs
            mine = self.ix.coverage.get(w.peer_id, {})
            if verified > 0:  # a coordinator checked its answers: its holdings of that model are served
                self._served_peers.add(w.peer_id)
                for cov in list(mine.values()):
                    if cov.slice.model_id == rep.model_id and not cov.served:
                        self.ix.put_cov(msgspec.structs.replace(cov, served=True), changes)
                        self.ix.dirty_maps.add(cov.slice.model_id)
            for h in w.held:  # slices it proved it holds (the coordinator's hold challenge)
                got = mine.get(SliceRef(rep.model_id, h.layer, h.lo, h.hi))
                if got is not None and not got.held:
                    self.ix.put_cov(msgspec.structs.replace(got, held=True), changes)
                    self.ix.dirty_maps.add(rep.model_id)
                    self.counters["holdings_proved"] += 1
        routed = self.ix.routed.setdefault(rep.model_id, {})
        for rr in rep.ranges:  # rows routed per range: hot experts' extra replicas, the dashboard
            k = (rr.layer, rr.lo, rr.hi)
            if k in routed or len(routed) < 65536:
                routed[k] = min(_INT64_MAX, routed.get(k, 0) + rr.rows)
        self.ix.add_heat(rep.model_id, [(rr.layer, rr.lo, rr.hi, min(cap, rr.rows)) for rr in rep.ranges], now)
        self._commit(changes, now)
        if rep.sequence > 0:  # only once it landed: a resend of a refused batch is accepted
            self._report_marks[f"report|{url}|{rep.model_id}"] = (rep.epoch, rep.sequence)
        self.journal.reported(url, rep.model_id, answered, now)
        self.counters["reports"] += 1
        return ReportAck(len(rep.workers), newly, ignored)

    def _holds_model(self, peer: str, model_id: str) -> bool:
        """Does ``peer`` hold (a coverage row) or have leased a slice of ``model_id``?"""
        if any(s.model_id == model_id for s in self.ix.coverage.get(peer, {})):
            return True
        lease_id = self.ix.lease_of.get(peer)
        return lease_id is not None and self.ix.leases[lease_id].slice.model_id == model_id

    def _holds_range(self, peer: str, model_id: str, layer: int, lo: int, hi: int) -> bool:
        """Does ``peer`` hold or have leased a slice of ``model_id`` overlapping ``layer:lo-hi``?"""
        s = SliceRef(model_id, layer, lo, hi)
        if any(x.overlaps(s) for x in self.ix.coverage.get(peer, {})):
            return True
        lease_id = self.ix.lease_of.get(peer)
        return lease_id is not None and self.ix.leases[lease_id].slice.overlaps(s)

    def _quarantine(self, peer: str, reason: str, ev: QuarantineEvidence, url: str, model_id: str, now: float,
                    changes: list[Change]) -> None:
        row = QuarantineRow(peer, now + self.policy.quarantine_s, reason, url, now, ev)
        self.ix.quarantined[peer] = row
        changes.append(Put(row))
        for cov in list(self.ix.coverage.get(peer, {}).values()):
            self.ix.del_cov(cov, changes)
            self.ix.dirty_maps.add(cov.slice.model_id)
            self.ix.dirty_ageout.add(cov.slice.model_id)
        lease_id = self.ix.lease_of.get(peer)
        if lease_id is not None:
            self.ix.del_lease(self.ix.leases[lease_id], changes)
        self.counters["quarantines"] += 1
        self._event("quarantined", now, model_id=model_id, peer_id=peer,
                    detail=f"{ev.method.value} {ev.layer}:{ev.lo}-{ev.hi} input {ev.input_sha256[:12]} remote "
                           f"{ev.remote_sha256[:12]} local {ev.local_sha256[:12]}: {reason}")

    def coordinator_peers(self, model_ids: set[str]) -> list[str]:
        """The libp2p ids of the registered coordinators hosting any of ``model_ids``."""
        return sorted({c.peer_id for c in self.ix.coordinators.values()
                       if c.peer_id is not None and model_ids.intersection(c.model_ids)})

    def _event(self, kind: str, now: float, *, model_id: str | None = None, peer_id: str | None = None,
               s: SliceRef | None = None, detail: str = "") -> None:
        self.journal.event(kind, now, model_id=model_id, peer_id=peer_id, s=s, detail=detail)

    def history(self) -> list[ModelHistory]:
        """``GET /api/history``: per model, the samples of the last 15 minutes."""
        return self.journal.history()

    def events(self, after: int = 0) -> EventLog:
        """``GET /api/events?after=SEQ``: the kept events newer than ``after``."""
        return self.journal.events(after)

    def _directive(self, row: CoverageRow, now: float) -> SliceDirective:
        d = directive(row.retiring_since, now, self.policy.cooldown_s)
        return wire_directive(row.slice, d, dispatched=row.dispatched)

    # -- time -----------------------------------------------------------------------------------

    @_call
    def tick(self, now: float) -> TickReport:
        """Expire silent volunteers and lapsed leases, step recruitment, age out, rebuild maps. A replica
        that does not lead only catches up and exchanges its heartbeat marks (``market.replica``)."""
        self._begin(now)
        rep = TickReport()
        changes: list[Change] = []
        if self._link is not None:
            rep.changed_maps.extend(sorted(self._maps_arrived))
            self._maps_arrived.clear()
            self.leading = self._link.leads()
            if now - self._seen_read_at >= self.policy.share_s:
                self._seen_read_at = exchange_seen(self._link, self.ix, self._heard, self._seen_read_at, now,
                                                   prune=self.leading)
            if not self.leading:
                self.journal.sample(self.ix, now)
                return rep
        ttl = self.policy.heartbeat_ttl_s
        short = min(ttl, self.policy.sole_replica_ttl_s)
        for peer, v in list(self.ix.volunteers.items()):
            if not is_expired(v.last_seen, now, ttl) and not (
                    is_expired(v.last_seen, now, short) and self._sole_replica_of_unheld(peer)):
                continue
            rows = self.ix.coverage.get(peer)
            if rows:
                for row in list(rows.values()):
                    self.ix.del_cov(row, changes)
                rep.expired_volunteers.append(peer)
                self._event("expired", now, peer_id=peer, detail=f"silent {now - v.last_seen:.0f} s")
                self.counters["volunteers_expired"] += 1
            elif now - v.last_seen > (self.policy.volunteer_gc_s if v.stored else self.policy.identity_idle_s):
                del self.ix.volunteers[peer]  # one that never held anything goes far sooner (it has no row)
                if v.stored:
                    changes.append(Delete(Table.VOLUNTEERS, peer))
        for lease in list(self.ix.leases.values()):
            if lease.expires_at <= now:
                self.ix.del_lease(lease, changes)
                self.ix.dirty_ageout.add(lease.slice.model_id)
                rep.expired_leases += 1
                self._event("lease_expired", now, peer_id=lease.peer_id, s=lease.slice)
                self.counters["leases_expired"] += 1
        drop_unprovable(self, now, changes)
        if now - self._last_gc >= 10.0:
            self._last_gc = now
            self._forget_idle_identities(now)
            self._forget_gone(now, changes)
            self.journal.prune(self.ix, now)
        self.journal.sample(self.ix, now)
        for mid in self.ix.models:
            old = self.ix.recruit.get(mid, RecruitState())
            new = step(old, observe(self.ix.poll_views(mid), now, self.ix.recruit_policy), now, self.ix.recruit_policy)
            self.ix.recruit[mid] = new
            if new.recruiting != old.recruiting:
                changes.append(Put(RecruitRow(mid, new.recruiting, now)))
                rep.recruiting_changed.append(mid)
                self.ix.touch(mid)
                rp = self.ix.recruit_policy
                if new.recruiting:
                    why = (f"busy >= {rp.saturation_threshold} (or below a tps floor) for {new.saturated_for(now):.0f} s "
                           f"(--rise-s {rp.rise_s:g}): "
                           f"target +{self.policy.boost}, recruiting")
                else:
                    idle = now - new.last_saturated_at if new.last_saturated_at is not None else rp.hold_s
                    why = (f"below {rp.saturation_threshold} busy (and above any tps floor) for {idle:.0f} s "
                           f"(--hold-s {rp.hold_s:g}): boost ended")
                log.info("model %s: %s", mid, ("saturated: " if new.recruiting else "unsaturated: ") + why)
                self._event("saturated" if new.recruiting else "unsaturated", now, model_id=mid, detail=why)
        for mid in sorted(self.ix.dirty_ageout):
            age_out(self, mid, now, changes, rep)
        self.ix.dirty_ageout.clear()
        for mid in sorted(self.ix.dirty_maps):
            if rebuild_map(self, mid, changes):
                rep.changed_maps.append(mid)
        self.ix.dirty_maps.clear()
        if now - self._last_flush >= self.policy.flush_s:
            self._flush(changes, now)
        self._commit(changes, now)
        return rep

    @_call
    def flush(self, now: float) -> None:
        """Write every volunteer's latest sequence number (periodically, and before closing)."""
        self._begin(now)
        changes: list[Change] = []
        self._flush(changes, now)
        self._commit(changes, now)

    def _flush(self, changes: list[Change], now: float) -> None:
        for v in self.ix.volunteers.values():
            if v.dirty and v.stored:
                changes.append(Put(v.row))
                v.dirty = False
        self._last_flush = now

    def _sole_replica_of_unheld(self, peer: str) -> bool:
        """Does ``peer`` hold the only live replica of an expert some coordinator hosting its model does
        not compute itself (a hole the moment it is gone)?"""
        for s, row in self.ix.coverage.get(peer, {}).items():
            if not row.dispatched:
                continue
            held = self.ix.held_by_all(s.model_id)
            if held is None:
                continue
            reps = self.ix.counts[s.model_id].replicas[s.layer]
            if any(reps[e] <= 1 and not held[s.layer][e] for e in range(s.lo, s.hi)):
                return True
        return False

    # -- views (market.views) -------------------------------------------------------------------

    def dispatch_map(self, model_id: str) -> DispatchMap:
        return dispatch_map(self.ix, model_id)

    def map_version(self, model_id: str) -> int:
        return map_version(self.ix, model_id)

    def demand(self, now: float, model_ids: Iterable[str] | None = None) -> DemandView:
        return demand_view(self.ix, now, model_ids)

    def recruitment(self, now: float) -> RecruitmentView:
        return recruitment_view(self.ix, now, lambda peer: self.journal.calls_per_s(peer, now))

    def volunteer_credit(self, peer_id: str, now: float) -> VolunteerCredit:
        return volunteer_credit(self.ix, peer_id, now)

    def credit_board(self, now: float, limit: int = 100) -> CreditBoard:
        return credit_board(self.ix, now, limit)
