"""The dispatch core's in-flight records (pure data): a layer in flight (``StepRecord``), its ranges
(``RangeRecord``), their calls (``CallRecord``), and the verification records that tie calls
together (``VerifyPair``: a remote call and its local copy; ``Cross``: two replicas of a range the
coordinator does not hold)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.events import CallId, RangeWork, StepId

__all__ = ["CallRecord", "Cross", "RangeRecord", "StepRecord", "VerifyPair"]


@dataclass
class CallRecord:
    call: CallId
    step: StepId
    layer: int
    index: int
    work: RangeWork
    peer: str | None  # None: local
    attempt: int
    started: float
    trial: bool = False
    verify: bool = False  # kept for a comparison: runs to its end, never wins (remote) / must win (local)
    done: bool = False
    backlog: bool = True  # a local call that queues with the engine's local work (not a disk check)


@dataclass
class Cross:
    """A sampled call of a range not held here and its copy on a second replica; each side pending,
    done or gone. Neither answer is the range's until they agree (or one side is gone); a disagreement
    is settled by the coordinator's own copy (``dispute``)."""

    a: CallRecord
    b: CallRecord
    a_side: str = "pending"
    b_side: str = "pending"
    dispute: CallId | None = None  # the local call settling a disagreement
    over: bool = False  # decided: agreed, one side won alone, or settled


@dataclass
class RangeRecord:
    work: RangeWork
    request_id: int
    planned_local: bool
    pending: set[CallId] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)
    attempts: int = 0
    winner: CallId | None = None
    failed: bool = False
    trusted_only: bool = False  # verified: only a local call's result may be the range's
    verified: bool = False  # placed remote, sampled (row counts)
    cross: Cross | None = None  # not held here and sampled: checked against a second replica


@dataclass
class VerifyPair:
    """A verification: the remote call and the local copy; each side pending, done or gone."""

    remote: CallId
    local: CallId
    peer: str
    layer: int
    lo: int
    hi: int
    trial: bool
    remote_side: str = "pending"
    local_side: str = "pending"
    disk: bool = False  # the local copy comes from the GGUF on disk


@dataclass
class StepRecord:
    step: StepId
    layer: int
    ranges: list[RangeRecord]
