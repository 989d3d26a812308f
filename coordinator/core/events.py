"""The dispatch core's vocabulary (pure: no I/O, no clock): its configuration, the reasons it gives,
the events the shell reports and the effects it asks for (``coordinator.core.dispatch``).

Events are nouns (what happened: ``LayerReady``, ``RemoteDone``), effects imperatives (what to do:
``SendRemote``, ``RunLocal``, ``Combine``); every placement and cancellation carries a ``Reason``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NewType

from coordinator.core.split_check import SplitOutcome

__all__ = [
    "CallId",
    "Cancel",
    "CancelTimer",
    "Combine",
    "Compare",
    "Compared",
    "DispatchConfig",
    "DispatchMode",
    "Effect",
    "ErrorRecord",
    "Event",
    "Fail",
    "FailureKind",
    "Forget",
    "Proof",
    "Hedge",
    "HoldRefuted",
    "LayerRanLocally",
    "LayerReady",
    "LayerRowCounts",
    "LoadSample",
    "LoadSampleTimeout",
    "LoadState",
    "LocalDone",
    "LocalFailed",
    "MarkDown",
    "MarkProven",
    "ModeChanged",
    "Quarantine",
    "RangeWork",
    "Reason",
    "RemoteDone",
    "RemoteFailed",
    "RunLocal",
    "SendRemote",
    "Settle",
    "Settled",
    "SplitChecked",
    "StartTimer",
    "StepId",
    "Timer",
    "TimerFired",
    "TimerKind",
    "WorkersListed",
]

CallId = NewType("CallId", int)
StepId = NewType("StepId", int)


class DispatchMode(StrEnum):
    ADAPTIVE = "adaptive"  # DESIGN §5 layer 1: local when idle, earliest finish under load
    OFFLOAD = "offload"  # every range with a live replica goes remote (the pre-adaptive behaviour)


class LoadState(StrEnum):
    IDLE = "idle"
    LOADED = "loaded"
    SERVE_TTL = "serve_ttl"


class Reason(StrEnum):
    """Why a range went where it went (or why a call was cancelled, a worker marked down)."""

    IDLE_LOCAL = "idle_local"
    LOAD_EARLIEST_FINISH_LOCAL = "load_earliest_finish_local"
    LOAD_EARLIEST_FINISH_REMOTE = "load_earliest_finish_remote"
    SERVE_TTL = "serve_ttl"
    TRIAL_HEDGE = "trial_hedge"
    SPLIT_CHECK = "split_check"  # RunLocal: under load, a local window of the split check (split_check.py)
    SPLIT_SLOWER = "split_slower"  # RunLocal: under load, held here: the last check found the split no faster
    SPLIT_FASTER = "split_faster"  # SplitChecked: the check found the split faster (earliest finish decides)
    PROBE = "probe"  # SendRemote: a proven worker's estimate is stale or it is in probation; kept, the local copy used
    HOT_EXPERT = "hot_expert"
    OFFLOAD_REMOTE = "offload_remote"
    NOT_HELD = "not_held"
    NO_REPLICA = "no_replica"
    ALL_DOWN = "all_down"
    HEDGE_SLOW = "hedge_slow"
    RETRY_NEXT = "retry_next"
    FALLBACK_LOCAL = "fallback_local"
    ALL_FAILED = "all_failed"
    VERIFY = "verify"  # RunLocal: the coordinator's copy of a sampled remote call (its result is used)
    VERIFY_SECOND = "verify_second"  # SendRemote: a second replica of a sampled call of a range not held here
    DISPUTE = "dispute"  # RunLocal: two replicas disagreed; the coordinator computes it from its GGUF
    VERIFY_DISK = "verify_disk"  # RunLocal: a sampled call of a range not held here, recomputed from the GGUF on disk
    DRIFT = "drift"  # Quarantine: a worker's errors within the tolerance are consistently beyond the honest spread
    LOCAL_FAILED = "local_failed"  # Fail: the coordinator's own kernel failed on a range
    MISSING_DISK = "missing_disk"  # RunLocal: not held, nobody serves it: computed from the GGUF (--on-missing disk)
    QUARANTINED = "quarantined"  # Cancel: the worker failed verification
    LOST_RACE = "lost_race"  # Cancel: another call of the range answered first
    DEADLINE = "deadline"  # Cancel: no answer within the timeout
    LOAD_ONSET = "load_onset"  # ModeChanged
    LOAD_ENDED = "load_ended"
    TTL_EXPIRED = "ttl_expired"


class FailureKind(StrEnum):
    TIMEOUT = "timeout"
    BROKEN = "broken"  # the stream or connection died under the call
    DIAL = "dial_failed"
    CLOSED = "closed"
    REFUSED = "refused"  # draining, slice not held
    PROTOCOL = "protocol"  # error answer, wrong shape, NaN, bad frame
    SLOW = "slow"  # lost ``max_hedge_losses`` hedges in a row
    LOCAL = "local"  # the coordinator's own kernel failed
    WRONG_ANSWER = "wrong_answer"  # failed verification: quarantined
    OTHER = "other"


@dataclass(frozen=True)
class DispatchConfig:
    mode: DispatchMode = DispatchMode.ADAPTIVE
    saturation_threshold: int = 2  # busy slots from which the coordinator is under load
    serve_ttl_s: float = 20.0
    sample_interval_s: float = 2.0
    sample_timeout_s: float = 1.0  # the shell's bound on one load sample
    sample_max_age_s: float = 6.0  # a sample older than this says nothing
    timeout_s: float = 3.0  # deadline of one remote call
    hedge: bool = True
    hedge_floor_s: float = 0.05
    max_hedge_losses: int = 3  # lost hedges in a row that mark a worker down
    hot_experts: int = 0  # the K most-routed experts of each layer always run locally
    hot_decay: float = 0.98  # per layer call: the routing counts' memory
    local_cost_prior_s: float = 20e-6  # seconds per (row, expert) pair before the first measurement
    ewma_alpha: float = 0.2
    # under load, a proven worker without a latency sample for this long is probed (0: never): an
    # estimate is only refreshed by calls, so one slow early answer must not keep it idle for good
    probe_interval_s: float = 2.0
    # with only trials or probes due, the shell is told to hand a layer to the core (not compute it whole in
    # the engine's own graph) at most this often: between, layers keep the fast path (with many listed
    # volunteers some trial or probe is nearly always due; moe-swarm simulate's liars-all.toml: 100
    # volunteers cost 32 % of local-only's tokens/s before)
    ask_interval_s: float = 0.25
    # under load, measure whether remote shares pay here: windows local / split / local of this
    # length, the winner held for split_hold_s; the split must win by split_margin (0: no check)
    split_check_s: float = 3.0
    split_hold_s: float = 30.0
    split_margin: float = 0.10  # must win clearly (windows of the same work differed by up to ~20 % on the 2-core VM; the watch backs it)
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_errors: int = 32  # failures kept for /dispatch
    verify_rate: float = 0.05  # sampled share of a held range's remote calls after probation
    verify_probation_calls: int = 50  # verified answers at rate 1.0 after an attach and after any failure
    # a range not held here with no live replica (or all failed): "fail" the layer (the shell may wait and
    # retry it: --on-missing wait) or compute it here from the GGUF on disk anyway ("disk": slow but exact)
    missing_disk: bool = False
    # a range not held here: this share of its remote calls (every one while the worker is in probation) is
    # recomputed from the GGUF on disk (off the engine thread) and that copy is the range's result (0: never)
    verify_disk_rate: float = 0.0
    # comparisons within the tolerance (other kernel ids, a 16-bit wire): a worker whose mean relative error
    # over at least drift_calls comparisons exceeds drift_factor x the honest spread is quarantined
    honest_error: float = 0.015  # the mean relative error between honest kernels (the shell sets it per model)
    drift_factor: float = 2.0
    drift_calls: int = 16


# -- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RangeWork:
    """One range of a layer with routed pairs: what the shell grouped, what the map lists."""

    lo: int
    hi: int
    rows: int
    pairs: int
    replicas: tuple[str, ...] = ()  # preference order (the map's)
    held: bool = True  # the coordinator holds these experts


@dataclass(frozen=True)
class WorkersListed:
    """The dispatch map changed: these workers are listed now (new ones attach, missing detach)."""

    peers: frozenset[str]
    # each worker's network (the market's tag of the address it speaks from; "" unknown): a cross-check
    # never pairs two workers of one network, which could be one party
    nets: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LayerReady:
    step: StepId
    layer: int
    ranges: tuple[RangeWork, ...]  # ascending lo, only ranges with pairs
    expert_pairs: tuple[int, ...] = ()  # routed pairs per expert of the layer (hot-expert counts)


@dataclass(frozen=True)
class LayerRanLocally:
    """The shell computed a whole layer here without asking (its fast path: every range held, at most
    ``local_only_pairs()`` pairs): counted as ``reason`` placements; ``compute_s`` > 0 is the kernel time."""

    layer: int
    ranges: tuple[RangeWork, ...]
    reason: Reason = Reason.IDLE_LOCAL
    compute_s: float = 0.0


@dataclass(frozen=True)
class RemoteDone:
    call: CallId
    wall_ms: int  # Unix ms (for last_serve_ms only)


@dataclass(frozen=True)
class RemoteFailed:
    call: CallId
    kind: FailureKind
    message: str
    wall_ms: int = 0


@dataclass(frozen=True)
class LocalDone:
    call: CallId
    compute_s: float  # time the kernel ran (not the wait for the local runner)


@dataclass(frozen=True)
class LocalFailed:
    call: CallId
    message: str


@dataclass(frozen=True)
class Proof:
    """What a quarantine can be checked by (``swarm.protocol.market.QuarantineEvidence``): the sha256 of
    the call's input, of the worker's answer and of the coordinator's own result, and how it was
    caught (bit_exact, tolerance, disk, hold_digest, second_replica)."""

    input_sha256: str
    remote_sha256: str
    local_sha256: str
    method: str


@dataclass(frozen=True)
class Compared:
    """The shell's answer to ``Compare``: were the remote call's outputs the coordinator's?"""

    remote: CallId
    equal: bool
    detail: str = ""  # what differed (the evidence), or how close it was
    proof: Proof | None = None  # when unequal
    error: float | None = None  # a tolerance comparison's largest relative error (None: bit-exact)


@dataclass(frozen=True)
class Settled:
    """The shell's answer to ``Settle``: did each replica's answer equal the coordinator's?"""

    a: CallId
    a_equal: bool
    b_equal: bool
    detail_a: str = ""
    detail_b: str = ""
    proof_a: Proof | None = None
    proof_b: Proof | None = None


@dataclass(frozen=True)
class HoldRefuted:
    """The shell's hold challenge (DESIGN §12 "proved it holds it") got a wrong digest from ``peer``
    for slice ``layer:lo-hi``: the worker does not hold what it claims, so it is quarantined like a
    wrong answer (a failed or unanswered challenge is not this: the shell just tries again later)."""

    peer: str
    layer: int
    lo: int
    hi: int
    detail: str
    proof: Proof | None = None


class TimerKind(StrEnum):
    HEDGE = "hedge"
    DEADLINE = "deadline"


@dataclass(frozen=True)
class Timer:
    kind: TimerKind
    call: CallId


@dataclass(frozen=True)
class TimerFired:
    timer: Timer


@dataclass(frozen=True)
class LoadSample:
    busy: int
    n_slots: int


@dataclass(frozen=True)
class LoadSampleTimeout:
    message: str = "load sample timed out"


Event = (
    WorkersListed
    | LayerReady
    | LayerRanLocally
    | RemoteDone
    | RemoteFailed
    | LocalDone
    | LocalFailed
    | Compared
    | Settled
    | HoldRefuted
    | TimerFired
    | LoadSample
    | LoadSampleTimeout
)


# -- effects ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendRemote:
    call: CallId
    step: StepId
    layer: int
    index: int  # the range's position in LayerReady.ranges
    lo: int
    hi: int
    peer: str
    request_id: int
    attempt: int
    reason: Reason
    keep: bool = False  # keep the answer until a Compare or Forget names this call


@dataclass(frozen=True)
class RunLocal:
    call: CallId
    step: StepId
    layer: int
    index: int
    lo: int
    hi: int
    reason: Reason
    keep: bool = False


@dataclass(frozen=True)
class Hedge:
    """Race a slow call: compute the range locally (``peer is None``) or on ``peer``."""

    call: CallId
    step: StepId
    layer: int
    index: int
    lo: int
    hi: int
    peer: str | None
    request_id: int
    attempt: int
    reason: Reason
    slow_call: CallId


@dataclass(frozen=True)
class Cancel:
    call: CallId
    reason: Reason


@dataclass(frozen=True)
class StartTimer:
    timer: Timer
    at: float


@dataclass(frozen=True)
class CancelTimer:
    timer: Timer


@dataclass(frozen=True)
class MarkDown:
    peer: str
    kind: FailureKind
    message: str
    retry_at: float


@dataclass(frozen=True)
class MarkProven:
    peer: str


@dataclass(frozen=True)
class Compare:
    """Compare the kept answers of ``remote`` (on ``peer``) and ``local``, then drop both; answer
    with ``Compared``."""

    remote: CallId
    local: CallId
    peer: str
    layer: int
    lo: int
    hi: int
    peer_b: str | None = None  # ``local`` is a second replica's call (a range not held here): keep both if unequal
    disk: bool = False  # ``local`` was computed from the GGUF on disk (a range not held here)


@dataclass(frozen=True)
class Settle:
    """Two replicas disagreed on a range not held here: compare each kept answer with the coordinator's
    own (``local``, computed from its GGUF), then drop all three; answer with ``Settled``."""

    a: CallId
    b: CallId
    local: CallId
    peer_a: str
    peer_b: str
    layer: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Forget:
    """Drop the kept answers of these calls (one side of a verification did not answer)."""

    calls: tuple[CallId, ...]


@dataclass(frozen=True)
class Quarantine:
    peer: str
    layer: int
    lo: int
    hi: int
    evidence: str
    proof: Proof | None = None


@dataclass(frozen=True)
class Combine:
    step: StepId
    layer: int
    calls: tuple[CallId, ...]  # the winner of each range, ascending lo


@dataclass(frozen=True)
class Fail:
    step: StepId
    layer: int
    lo: int
    hi: int
    reason: Reason
    message: str


@dataclass(frozen=True)
class ModeChanged:
    state: LoadState
    reason: Reason


@dataclass(frozen=True)
class SplitChecked:
    """A split check ended (``coordinator.core.split_check``): the arm kept, and why."""

    outcome: SplitOutcome
    reason: Reason  # SPLIT_FASTER / SPLIT_SLOWER


Effect = (
    SendRemote
    | RunLocal
    | Hedge
    | Cancel
    | StartTimer
    | CancelTimer
    | MarkDown
    | MarkProven
    | Compare
    | Settle
    | Forget
    | Quarantine
    | Combine
    | Fail
    | ModeChanged
    | SplitChecked
)



# -- records the core keeps (read by the shell's report) ----------------------------------------


@dataclass(frozen=True)
class ErrorRecord:
    at: float  # core time
    wall_ms: int
    peer: str
    layer: int
    lo: int
    hi: int
    attempt: int
    kind: FailureKind
    message: str


@dataclass
class LayerRowCounts:
    local_rows: int = 0  # placed local and computed there
    remote_rows: int = 0  # answered by a worker
    fallback_rows: int = 0  # placed remote, computed locally (failure, hedge or trial won locally)
    verified_rows: int = 0  # placed remote and sampled: computed here too, the coordinator's result used

