"""What a coordinator tells other processes (pure: msgspec Structs): ``/slots`` (polled by the market),
``/health`` and ``/dispatch`` (read by operators, the demo, benchmarks and tests).

Rules:
- One definition per body, used by the coordinator to encode and by every reader to decode.
- Readers tolerate unknown fields (a newer coordinator may add some); new fields get defaults.
- ``/slots`` follows llama-server's ``/slots`` (``id``, ``is_processing``, ``n_ctx``, ``n_decoded``...).
"""

from __future__ import annotations

import msgspec

from swarm.core.paths import Path

__all__ = [
    "LayerPath",
    "DispatchErrorReport",
    "DispatchReport",
    "Health",
    "LayerRows",
    "MarketLinkStatus",
    "ModeChange",
    "SlotInfo",
    "CapacityReport",
    "capacity_decoder",
    "WorkerReport",
    "dispatch_decoder",
    "health_decoder",
    "slots_decoder",
]


class SlotInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of ``GET /slots``; the market counts ``is_processing`` to tell saturation."""

    id: int
    is_processing: bool
    n_ctx: int = 0
    n_prompt: int = 0
    n_decoded: int = 0
    tps_ewma: float = 0.0
    draft: str | None = None  # speculative decoding: the running request's drafter (None: none)
    draft_acceptance: float | None = None  # its accepted / proposed drafts so far (EWMA)
    draft_length: int | None = None  # the tokens its next step will draft
    # experienced speed (coordinator.core.admission): ``tps_ewma`` is the session's decode tps EWMA;
    # ``warming``: in its settle window (left out of the mean). The rest is the coordinator's, the same on
    # every entry (the array keeps llama-server's shape): None from coordinators that do not measure it
    warming: bool = False
    mean_active_tps: float | None = None
    decode_tps: float | None = None  # aggregate: the sum of the sessions' EWMAs
    tps_floor: float | None = None  # --tps-floor (None: none)
    projected_mean_tps_if_admitted: float | None = None
    parked: bool = False  # preempted by admission (--preempt park): decode paused, KV kept, the stream waits


class CapacityReport(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /capacity`` (DESIGN §11): what the next new request would meet (coordinator.core.admission)."""

    can_admit: bool
    projected_mean_tps_if_admitted: float | None
    headroom_sessions: int
    kv_headroom_pct: float
    settling: bool
    settle_remaining_ms: int
    reason: str
    mean_active_tps: float | None
    tps_floor: float | None
    active_sessions: int
    slots: int
    queue: int
    admission: str  # advisory | enforced
    decode_tps: float | None = None
    warming_sessions: int = 0
    scaling_per_admit: float = 0.0
    admits_observed: int = 0
    parked_sessions: int = 0  # of active_sessions: decode paused while the mean stays below the floor


class MarketLinkStatus(msgspec.Struct, frozen=True, kw_only=True):
    market: str
    registered: bool
    last_map_ok_s_ago: float | None
    last_error: str
    problem: str = ""  # while the market is unreachable or refuses us: why ("" when it answers)


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /health``: ``peer_id`` is the coordinator's libp2p id (what volunteers allow with
    ``--allow-peer``); ``market`` is set when it follows a market."""

    status: str = "ok"  # "degraded" while something it needs fails (the market: unreachable, refusing)
    model: str
    slots_idle: int
    slots_processing: int
    peer_id: str | None = None
    market: MarketLinkStatus | None = None
    # ranges of experts not held here that no live volunteer serves now (requests routed there wait or fail)
    coverage_holes: int = 0
    reason: str = ""  # why the status is not "ok"


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True):
    """One worker of ``/dispatch``: its health as the dispatcher sees it and how it is reached."""

    peer_id: str
    state: str  # up | down | quarantined (coordinator.core.dispatch)
    calls: int
    rows: int
    failures: int
    latency_ewma_ms: float
    last_serve_ms: int  # Unix ms of its last successful call from this coordinator; 0 = never
    last_error: str
    retry_in_s: float
    addrs: list[str] = []
    path: Path | None = None  # direct | relayed | hole-punched; None when not connected
    relayed_bytes: int = 0  # expert-stream payload bytes that crossed a relay (stops growing once moved)
    kernel_id: str = ""  # the expert kernel its Hello announced ("" before the first stream or from old peers)
    proven: bool = False  # an answer passed verification since it attached (adaptive dispatch uses only these)
    p95_ms: float = 0.0  # p95 of its recent call latencies (its hedge threshold, with the floor)
    in_flight: int = 0
    verified: int = 0  # answers that passed verification
    probation_left: int = 0  # verified answers still due before sampling drops to the verify rate
    quarantine: str = ""  # the evidence when it failed verification ("" otherwise)
    # hold challenges (DESIGN §12): its listed slices it proved it holds / not yet (None: not checked here)
    holdings_proven: int | None = None
    holdings_pending: int | None = None
    pairs: int = 0  # (row, expert) pairs it answered (the work the market credits it for)
    # the per-pair slope of its call latencies (ms per routed pair) earliest finish sizes calls with;
    # None while its calls' sizes are too few or too alike (its estimate is the latency EWMA alone)
    per_pair_ms: float | None = None
    # a data lane (direct TCP the volunteer dialled; coordinator.dispatch.lanes) carries the engine's calls to it
    lane: bool = False
    lane_calls: int = 0  # calls sent on its current lane


class LayerRows(msgspec.Struct, frozen=True, kw_only=True):
    """Rows (token, expert pairs grouped by range) of one MoE layer, by where they were computed."""

    layer: int
    local_rows: int
    remote_rows: int
    fallback_rows: int
    verified_rows: int = 0  # placed remote and sampled: computed here too, this result used


class DispatchErrorReport(msgspec.Struct, frozen=True, kw_only=True):
    """One failed expert call (``/dispatch`` keeps the last few)."""

    at_ms: int  # Unix ms (0: not known)
    peer: str  # "local" for the coordinator's own kernel
    layer: int
    lo: int
    hi: int
    attempt: int
    reason: str  # timeout | broken | dial_failed | closed | refused | protocol | slow | local | other
    message: str


class ModeChange(msgspec.Struct, frozen=True, kw_only=True):
    """A switch of the dispatcher's load state (idle / loaded / serve_ttl) and why."""

    at_ms: int
    state: str
    reason: str
    detail: str = ""  # a split check's rates and the arm it keeps


class LayerPath(msgspec.Struct, frozen=True, kw_only=True):
    """Where the time of a remote layer goes: means over the last ``layers`` layers with a remote call
    (milliseconds). ``dense`` is the engine's dense half before the layer; ``group`` grouping the
    routed pairs by range; ``place`` the core's placement; ``encode`` building the wire requests and
    handing them over; ``to_trio`` until the trio thread sent them; ``wire`` the round trip less the
    volunteer's own time (framing, Noise, Yamux, both event loops, decoding the answer); ``queue`` and
    ``compute`` the volunteer's time waiting and computing; ``core`` from the answer to the core's
    combine; ``wake`` until the driver saw it; ``combine`` the driver's combine; ``local`` the driver's
    own expert compute; ``total`` from begin to the combined output. ``crossings`` is the mean of
    thread crossings per layer (hand-offs to the trio thread and wakes of the driver from it)."""

    layers: int = 0
    dense: float = 0.0
    group: float = 0.0
    place: float = 0.0
    encode: float = 0.0
    to_trio: float = 0.0
    wire: float = 0.0
    queue: float = 0.0
    compute: float = 0.0
    core: float = 0.0
    wake: float = 0.0
    combine: float = 0.0
    local: float = 0.0
    total: float = 0.0
    crossings: float = 0.0


class DispatchReport(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /dispatch``: the map followed, its workers, and per-layer row counts."""

    model_id: str
    map_version: int | None
    maps_rejected: int = 0  # maps from the file or the market that could not be adopted
    map_error: str = ""  # why the last one was not
    policy: str
    timeout_s: float
    wire_dtype: str
    kernel_id: str = ""  # the coordinator's own expert kernel: equal ids give bit-identical results
    workers: list[WorkerReport]
    layers: list[LayerRows]
    # load-adaptive dispatch (DESIGN §5 layer 1); defaults so that older readers and writers still decode
    mode: str = ""  # adaptive | offload
    load_state: str = ""  # idle | loaded | serve_ttl
    busy: int | None = None  # the last load sample (None: none yet)
    n_slots: int | None = None
    load_sample_age_s: float | None = None
    load_samples_failed: int = 0  # samples that timed out or failed
    saturation_threshold: int = 0
    serve_ttl_s: float = 0.0
    hedge_floor_ms: float = 0.0
    hot_experts: int = 0
    decisions: dict[str, int] = {}  # placements, hedges, retries and cancels by reason
    errors_total: int = 0
    errors: list[DispatchErrorReport] = []  # the last failures, oldest first
    stale_answers: int = 0  # answers of calls no longer waited for (ignored)
    mode_changes: list[ModeChange] = []  # the last load-state switches and split checks, oldest first
    # under load: the split check's arm in force (split: earliest finish; local: every held range here),
    # whether a check is running, and its last rates (routed pairs per second; 0: none yet)
    split_arm: str = ""
    split_checking: bool = False
    split_rate: float = 0.0
    local_rate: float = 0.0
    verify_rate: float = 0.0  # the sampled share of remote calls after probation
    verify_probation_calls: int = 0
    verifications: int = 0  # comparisons made
    verified_equal: int = 0
    quarantines: int = 0
    # hold challenges sent, passed, failed (error, timeout, refusal: retried) and refuted (wrong digest)
    hold_challenges: int = 0
    hold_passes: int = 0
    hold_failures: int = 0
    hold_refutations: int = 0
    # coverage of the experts not held here (--local-experts): ranges of the map with no live replica now,
    # layers that waited for coverage (--on-missing wait) and those that still found none
    holes: int = 0
    missing_waits: int = 0
    missing_failed: int = 0
    layer_path: LayerPath = LayerPath()  # where a remote layer's time goes (newer coordinators)


slots_decoder = msgspec.json.Decoder(list[SlotInfo])
capacity_decoder = msgspec.json.Decoder(CapacityReport)
health_decoder = msgspec.json.Decoder(Health)
dispatch_decoder = msgspec.json.Decoder(DispatchReport)
