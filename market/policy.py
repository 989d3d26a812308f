"""The market's decision parameters (pure: a frozen msgspec Struct, no I/O).

Rules:
- Config is data: loaded once at the edge (``market.cli``), validated by its constraints, and
  passed down by value; nothing reads it from the environment.
- Defaults are DESIGN §11's.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from market.core.recruit import RecruitPolicy
from swarm.config import NonNegFloat, PosFloat

__all__ = ["MarketPolicy"]


class MarketPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The market's decision parameters (defaults: DESIGN §11)."""

    base_target: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 1
    boost: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 1
    # experts some coordinator hosting the model does not compute itself (no last resort there): this many
    # replicas, so one volunteer leaving never leaves a hole (DESIGN §11 --remote-base-target)
    remote_base_target: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2
    # hot experts (routed rows in coordinator reports, decayed with this half-life): up to this many extra
    # replicas for an expert carrying a multiple of its layer's mean load; 0 = off
    hot_extra_max: Annotated[int, msgspec.Meta(ge=0, le=64)] = 2
    hot_half_life_s: PosFloat = 300.0
    saturation_threshold: Annotated[int, msgspec.Meta(ge=1)] = 2
    # the saturation signal's hysteresis (market.core.recruit): saturated this long (dips shorter than this
    # do not count) before the model counts as saturated and the boost starts ...
    rise_s: NonNegFloat = 2.0
    hold_s: NonNegFloat = 10.0  # ... and this long without a saturated poll before it ends
    poll_stale_s: PosFloat = 10.0  # an older successful poll says nothing
    lease_s: PosFloat = 30.0
    heartbeat_ttl_s: PosFloat = 15.0
    # a silent volunteer holding the only replica of experts some hosting coordinator cannot compute
    # expires after this long instead (its slice is re-offered sooner: a backbone waits for it)
    sole_replica_ttl_s: PosFloat = 8.0
    cooldown_s: NonNegFloat = 10.0  # retired (not dispatched) this long before "release"
    retry_after_s: PosFloat = 5.0
    # "nothing needed" polls a second the market paces its idle volunteers to (market.core.pacing: the retry
    # grows with their number, up to max_idle_retry_s; 0: always retry_after_s)
    idle_poll_rate: NonNegFloat = 200.0
    max_idle_retry_s: PosFloat = 120.0
    flush_s: PosFloat = 5.0
    # a replica answers a re-poll of an open lease from memory caught up at most this long ago (market.replica)
    fresh_s: PosFloat = 1.0
    share_s: PosFloat = 1.0  # replicas exchange heartbeat marks through the database this often (market.replica)
    header_allowance: Annotated[int, msgspec.Meta(ge=0)] = 64 * 1024  # slice header + slack, in bytes
    volunteer_gc_s: PosFloat = 7 * 24 * 3600.0  # forget silent volunteers without coverage after this
    quarantine_s: PosFloat = 7 * 24 * 3600.0  # a volunteer caught answering wrongly is refused this long
    # slices one IP address may hold or have leased at once (holdings of the identities seen there plus
    # open leases taken from it; the flag keeps its old name)
    max_leases_per_address: Annotated[int, msgspec.Meta(ge=1)] = 16
    # coverage comes from assignment (DESIGN §12): a heartbeat's new slice counts only with this
    # volunteer's open lease for it; False accepts any reported slice (the behaviour before leases ruled)
    coverage_requires_lease: bool = True
    # ... and keeps counting only once a coordinator reports it proved (a hold challenge or verified
    # answers) within this long of serving; 0 = no proof needed
    proof_grace_s: NonNegFloat = 120.0
    # ... and a ``loading`` holding counts (as pending) only until its download deadline: this grace plus the
    # slice's bytes at this floor rate (generous: a slow home link does better), then it is dropped and re-offered
    download_grace_s: NonNegFloat = 120.0
    download_floor_bytes_per_s: PosFloat = float(1 << 20)
    # a volunteer dropped from a slice (download overdue, unproven) gets no new lease for it this long
    dropped_penalty_s: NonNegFloat = 600.0
    # identities: at most this many live ones per IP address (a new one past it is refused), and one that
    # never held anything (kept in memory only, never stored) is forgotten after this long without a word
    max_identities_per_address: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_identities: Annotated[int, msgspec.Meta(ge=1)] = 200_000  # identities with an address mark, in all
    identity_idle_s: PosFloat = 600.0
    # coordinators: one whose /slots polls have all failed for host_down_s stops counting as hosting (its
    # models are not offered on its account; a model no live coordinator hosts has no demand); after
    # coordinator_gc_s its registration goes; a model no registered coordinator lists goes model_gc_s after
    host_down_s: PosFloat = 30.0
    coordinator_gc_s: PosFloat = 3600.0
    model_gc_s: PosFloat = 600.0
    max_models: Annotated[int, msgspec.Meta(ge=1)] = 256  # registered models in all (16 per registration: the wire)
    max_epoch_ahead_s: PosFloat = 600.0  # a registration epoch (start time in ms) at most this far ahead of the clock
    # a coordinator report credits at most this many pairs (and counts as many calls, rows, verified answers)
    # per worker; more is clamped (counted in moe_swarm_market_events{event="report_clamped"})
    max_report_pairs: Annotated[int, msgspec.Meta(ge=1, le=2**62)] = 1 << 30

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
