"""Several market replicas on one database: the seam and the catch-up (sans-IO: the link does the I/O).

A ``ReplicaLink`` is a store that other markets write too (``market.store_pg``). ``market.state.Market``
uses it so that no replica decides from its own memory alone:

Rules:
- Every call that may commit (``Market``'s registrations, polls, heartbeats, reports, ticks) starts with
  ``begin_call``: the link opens a transaction, takes the database's one write lock (held until the
  call commits or ends) and returns what other replicas committed since this replica last read
  (``Catchup``: the changes in commit order, or a whole ``Snapshot`` when the change feed no longer
  reaches back that far). ``apply_catchup`` brings the indexes up to date with it before the call
  decides. Decisions are thus serialised across replicas and each one sees every earlier one: a lease
  is granted once, a credit row is read-modified-written by one replica at a time.
- One exception: a re-poll of an open lease (``Market._renewal``) decides nothing new, so it takes no lock:
  it claims its counter alone (one statement) and answers from memory that caught up at most ``fresh_s``
  ago (every tick catches up); older memory, or anything but a live lease, goes the locked way.
- ``end_call(ok)`` commits what the call left open (its counter claims) or rolls back after a failure.
- Replay protection is shared: ``claim_counter(peer, epoch, sequence)`` is an atomic conditional
  upsert; False means some replica already accepted that counter or a newer one (``replayed``).
- Soft state (volunteers' last heartbeat times and loads) stays in each replica's memory and is
  exchanged through the database at most once per ``share_s`` (``exchange_seen``: one row per volunteer
  heard since the last exchange, and the rows others wrote since the last read).
- One replica leads (``leads``: a session lock of the database; another takes over when its session
  ends): it alone runs the tick's decisions (expiry, lease expiry, recruitment, age-out, dispatch maps,
  proofs), so boosts and map versions are computed in one place and read by every replica as rows.
- ``apply_catchup`` is the incremental twin of ``Indexes.load``: each change's row replaces the indexed
  one (coverage and leases re-counted), a delete removes it; runtime facts (heartbeat times, loads,
  polls) are kept; re-applying a change the replica made itself changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import msgspec

from market.core.records import (
    CoordinatorRow,
    CoverageRow,
    CreditRow,
    LeaseRow,
    MapRow,
    ModelRow,
    QuarantineRow,
    RecruitRow,
    SliceRef,
    Snapshot,
    Table,
    VolunteerRow,
)
from market.core.recruit import RecruitState
from market.core.registry import ACCEPTED, check_heartbeat
from market.indexes import Indexes, LiveVolunteer, PollRecord
from swarm.errors import RequestError
from swarm.protocol.market import VolunteerRequest

if TYPE_CHECKING:
    from market.state import Market, Offer

__all__ = ["Catchup", "FEED_KEEP", "FeedChange", "ReplicaLink", "apply_catchup", "exchange_seen", "renew_unlocked"]

FEED_KEEP: Final = 200_000  # feed rows kept (a replica further behind reloads everything)
SEEN_KEEP_S: Final = 24 * 3600.0  # heartbeat marks older than this are dropped
FeedChange = tuple[Table, str, Any]  # (table, key, row) -- row None: deleted


@dataclass(frozen=True)
class Catchup:
    changes: list[FeedChange]
    snapshot: Snapshot | None = None  # the feed was pruned past this replica's position: everything


@runtime_checkable
class ReplicaLink(Protocol):
    def begin_call(self) -> Catchup: ...

    def end_call(self, ok: bool) -> None: ...

    def claim_counter(self, peer_id: str, epoch: int, sequence: int) -> bool: ...

    def exchange_seen(self, heard: Sequence[tuple[str, float, float]], since: float) -> list[tuple[str, float, float]]: ...

    def leads(self) -> bool: ...

    def prune(self, keep: int, seen_before: float) -> None: ...


def exchange_seen(link: ReplicaLink, ix: Indexes, heard: dict[str, tuple[float, float]], read_at: float, now: float, *,
                  prune: bool) -> float:
    """Inside a call: write the marks heard since the last exchange (then forgets them), read those the others
    wrote since ``read_at`` (a second of slack: another replica's mark may carry an older ``now``) and take the
    newer ones; the leader also prunes the feed and old marks. Returns the new ``read_at``."""
    got = link.exchange_seen([(p, at, load) for p, (at, load) in heard.items()], read_at - 1.0)
    heard.clear()
    for peer, at, load in got:
        lv = ix.volunteers.get(peer)
        if lv is not None and at > lv.last_seen:
            lv.last_seen, lv.load = at, load
    if prune:
        link.prune(FEED_KEEP, now - SEEN_KEEP_S)
    return now


def _coverage_ref(key: str) -> tuple[str, SliceRef] | None:
    """``coverage_key``'s parts (``peer|model|layer|lo|hi``; a model id holds no ``|``)."""
    parts = key.rsplit("|", 3)
    head = parts[0].split("|", 1) if parts else []
    if len(parts) != 4 or len(head) != 2:
        return None
    try:
        return head[0], SliceRef(head[1], int(parts[1]), int(parts[2]), int(parts[3]))
    except ValueError:
        return None


def apply_catchup(ix: Indexes, changes: Sequence[FeedChange], now: float) -> set[str]:
    """Bring ``ix`` up to date with ``changes`` (other replicas' commits, in order; module rules); returns
    the models whose published dispatch map changed (their long polls are woken)."""
    maps: set[str] = set()
    for table, key, row in changes:
        match table:
            case Table.MODELS:
                if row is None:
                    if key in ix.models:
                        ix.drop_model(key, [])
                elif isinstance(row, ModelRow):
                    ix.add_model(row)
                    ix.touch(key)
            case Table.COORDINATORS:
                if row is None:
                    old = ix.coordinators.pop(key, None)
                    ix.polls.pop(key, None)
                elif isinstance(row, CoordinatorRow):
                    old = ix.coordinators.get(key)
                    ix.coordinators[key] = row
                    ix.polls.setdefault(key, PollRecord(since=now))
                    for mid in row.model_ids:
                        if mid in ix.models:
                            ix.touch(mid)
                ix.coordinators_changed()
                for mid in old.model_ids if old is not None else []:
                    if mid in ix.models:
                        ix.touch(mid)
            case Table.VOLUNTEERS:
                if row is None:
                    ix.volunteers.pop(key, None)
                elif isinstance(row, VolunteerRow):
                    lv = ix.volunteers.get(key)
                    if lv is None:
                        ix.volunteers[key] = LiveVolunteer(row, last_seen=now)
                    else:
                        if (row.epoch, row.sequence) < (lv.row.epoch, lv.row.sequence):
                            row = msgspec.structs.replace(row, epoch=lv.row.epoch, sequence=lv.row.sequence)
                        lv.row, lv.stored = row, True
                        lv.last_seen = max(lv.last_seen, now)
                    for s in ix.coverage.get(key, {}):
                        ix.dirty_maps.add(s.model_id)
            case Table.COVERAGE:
                ref = _coverage_ref(key)
                if ref is None:
                    continue
                peer, s = ref
                old_cov = ix.coverage.get(peer, {}).get(s)
                if old_cov is not None:
                    ix.index_cov(old_cov, -1)
                if isinstance(row, CoverageRow) and ix.slice_problem(row.slice) is None:
                    ix.index_cov(row)
                    if peer not in ix.volunteers:
                        ix.volunteers[peer] = LiveVolunteer(VolunteerRow(peer, 0, 0, now), last_seen=now)
            case Table.LEASES:
                old_lease = ix.leases.get(key)
                if old_lease is not None:
                    ix.index_lease(old_lease, -1)
                if isinstance(row, LeaseRow) and ix.slice_problem(row.slice) is None:
                    other = ix.lease_of.get(row.peer_id)
                    if other is not None and other in ix.leases:
                        ix.index_lease(ix.leases[other], -1)
                    ix.index_lease(row)
                    ix.dirty_ageout.add(row.slice.model_id)
            case Table.MAPS:
                if row is None:
                    ix.maps.pop(key, None)
                elif isinstance(row, MapRow) and key in ix.models:
                    cur = ix.maps.get(key)
                    if cur is None or row.version > cur.version:
                        ix.maps[key] = row
                        maps.add(key)
            case Table.RECRUITMENT:
                if row is None:
                    ix.recruit.pop(key, None)
                elif isinstance(row, RecruitRow) and key in ix.models:
                    st = ix.recruit.get(key)
                    if st is None or st.recruiting != row.recruiting:
                        ix.recruit[key] = RecruitState(row.recruiting, row.changed_at,
                                                       last_saturated_at=now if row.recruiting else None)
                        ix.touch(key)
            case Table.QUARANTINE:
                if row is None:
                    ix.quarantined.pop(key, None)
                elif isinstance(row, QuarantineRow):
                    ix.quarantined[key] = row
            case Table.CREDIT:
                if row is None:
                    ix.credit.pop(key, None)
                elif isinstance(row, CreditRow):
                    ix.credit[key] = row
    return maps


def renew_unlocked(m: Market, req: VolunteerRequest, now: float, address: str) -> Offer | None:
    """A replica's re-poll of an open lease, without the write lock (``market.replica``): it decides
    nothing new -- the lease and its expiry are the database's, read at most ``fresh_s`` ago -- so only
    the counter is claimed (one statement; 503 when the database cannot be reached). None: the locked
    path answers (anything else, or memory older than ``fresh_s``)."""
    if m._link is None or now - m._caught_up_at > m.policy.fresh_s or req.epoch is None \
            or req.sequence is None or (req.max_bytes is None and req.max_experts is None):
        return None
    lease_id = m.ix.lease_of.get(req.peer_id)
    lease = m.ix.leases.get(lease_id) if lease_id is not None else None
    live = m.ix.volunteers.get(req.peer_id)
    if lease is None or lease.expires_at <= now or m.quarantine_of(req.peer_id, now) is not None \
            or (live is not None and live.paused):
        return None
    if address and not m._note_address(req.peer_id, address, now):
        return None
    if check_heartbeat(m._known_counter(req.peer_id), req.epoch, req.sequence) not in ACCEPTED:
        return None  # the locked path says why
    if not m._link.claim_counter(req.peer_id, req.epoch, req.sequence):
        m.counters["poll_replayed_sequence"] += 1
        raise RequestError(f"poll epoch/sequence {req.epoch}/{req.sequence} is not newer than one another market "
                           "replica accepted", code="replayed_sequence", status=409)
    m._polled[req.peer_id] = (req.epoch, req.sequence)
    m.counters["offers_renewed"] += 1
    m.counters["offers_renewed_unlocked"] += 1
    return m._offer(lease, now, 0.0, 0, renewed=True)
