"""HTTP bodies of the market API (pure: msgspec Structs and their decoders).

Rules:
- Request bodies forbid unknown fields and carry their limits as ``msgspec.Meta`` constraints,
  so bad input is a 400 with a clear message, never an exception inside the market.
- ``CoverageHeartbeat`` is signed (``swarm.p2p.identity``): its field order is part of the signature
  and must not change; new fields go at the end, with defaults, and both sides must know them
  (a receiver re-encodes only the fields it knows, so an unknown field breaks verification).
- Responses are plain Structs encoded as JSON; the two answers of ``/api/expert-volunteer`` are a
  union tagged by ``kind``: ``"assignment"`` or ``"nothing_needed"``.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar, Literal

import msgspec

from swarm.protocol.manifest import MODEL_ID_PATTERN, ModelManifest

__all__ = [
    "Assignment",
    "CoordinatorReport",
    "CoordinatorView",
    "CoverageAck",
    "CoverageHeartbeat",
    "DownloadSource",
    "LeaseView",
    "SourceKind",
    "CreditBoard",
    "HistorySample",
    "ModelHistory",
    "EventLog",
    "EvidenceMethod",
    "MarketEvent",
    "QuarantineEvidence",
    "DemandView",
    "DownloadProgress",
    "HeldSlice",
    "ModelDemand",
    "ModelRecruitment",
    "NothingNeeded",
    "ProvenSlice",
    "RecruitmentView",
    "RegisterAck",
    "RegisterModels",
    "ReportAck",
    "ReportedWorker",
    "RoutedRange",
    "SliceDirective",
    "VolunteerAnswer",
    "VolunteerCredit",
    "VolunteerRequest",
    "WorkerSliceView",
    "WorkerView",
    "coverage_decoder",
    "lease_decoder",
    "register_decoder",
    "report_decoder",
    "volunteer_decoder",
]

ModelId = Annotated[str, msgspec.Meta(pattern=MODEL_ID_PATTERN)]
PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Url = Annotated[str, msgspec.Meta(pattern=r"^https?://[^\s]+\Z", max_length=2048)]  # \Z: "$" passes a final newline
Addr = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]  # a circuit multiaddr with two peer ids is ~150
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Layer = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Expert = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")]
LeaseId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e7)]
ShortText = Annotated[str, msgspec.Meta(max_length=2048)]


class HeldState(enum.StrEnum):
    """What a volunteer says about a slice it holds."""

    LOADING = "loading"  # downloading / loading: not dispatchable yet
    SERVING = "serving"  # loaded and reachable: dispatchable
    DRAINING = "draining"  # the volunteer is leaving: do not dispatch, it finishes in-flight calls


class Segment(msgspec.Struct, frozen=True):
    """A maximal run of experts of one layer with the same counts (hence the same demand)."""

    layer: int
    lo: int
    hi: int
    replicas: int
    pending: int
    target: int
    scarcity: float


# -- requests ---------------------------------------------------------------------------------


class ProvenSlice(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """``[layer, lo, hi]``: one slice (a volunteer proved it holds it; a coordinator computes it itself)."""

    layer: Layer
    lo: Expert
    hi: Expert


class RegisterModels(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /api/models``: a coordinator (by its advertised base URL) and the models it hosts.

    ``models`` is the whole list: a model left out is no longer hosted by this coordinator.
    ``epoch`` (the coordinator's start time in ms, say) orders registrations of one URL.
    """

    url: Url
    models: Annotated[list[ModelManifest], msgspec.Meta(max_length=16)]
    epoch: Epoch = 0
    # the coordinator's libp2p peer id: volunteers holding its models answer expert calls from it only
    peer_id: PeerId | None = None
    # the routed experts it computes itself, per model (``--local-experts``; DESIGN §11: holdings travel per
    # coordinator, never in the manifest); a model not named here: all of them (what older coordinators do)
    local_experts: Annotated[dict[ModelId, Annotated[list[ProvenSlice], msgspec.Meta(max_length=65536)]],
                             msgspec.Meta(max_length=16)] = {}


class VolunteerRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /api/expert-volunteer``: give me something to serve. At least one budget is required.

    Signed (DESIGN §11): header ``X-Moe-Signature`` over method, path and the raw body
    (``swarm.p2p.identity.sign_request``); ``sent_at_ms`` within 120 s of the market's clock; ``(epoch,
    sequence)`` is the one counter the volunteer's polls and heartbeats share (replays refused)."""

    peer_id: PeerId
    epoch: Epoch | None = None
    sequence: Epoch | None = None
    sent_at_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_bytes: Annotated[int, msgspec.Meta(gt=0)] | None = None
    max_experts: Annotated[int, msgspec.Meta(gt=0, le=1 << 20)] | None = None
    models: Annotated[list[ModelId], msgspec.Meta(max_length=64)] | None = None


class HeldSlice(msgspec.Struct, forbid_unknown_fields=True):
    """A slice a volunteer holds, as reported in its heartbeat."""

    model_id: ModelId
    layer: Layer
    lo: Expert
    hi: Expert
    state: HeldState = HeldState.SERVING
    last_serve_ms: NonNeg = 0  # Unix ms of its last served call for this slice; 0 = never


class DownloadProgress(msgspec.Struct, forbid_unknown_fields=True):
    """A slice its volunteer is downloading and how far it got (``CoverageHeartbeat.download``)."""

    model_id: ModelId
    layer: Layer
    lo: Expert
    hi: Expert
    done_bytes: NonNeg
    total_bytes: Annotated[int, msgspec.Meta(gt=0, le=1 << 44)]


class CoverageHeartbeat(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /api/expert-coverage``: the volunteer's whole holding, signed by its libp2p key.

    ``addrs`` are multiaddrs the coordinator can dial, best first: direct ones, or relayed
    ``.../p2p-circuit/p2p/<peer_id>`` ones. ``load`` = calls in flight. ``signature`` is
    ``swarm.p2p.identity.sign_body`` of this body (field order matters; see there). ``protocols``:
    the expert-stream versions the volunteer speaks; the market dispatches it only to coordinators
    that speak one of them (all coordinators speak 2 now).
    """

    signed_when_set: ClassVar[frozenset[str]] = frozenset({"protocols", "sent_at_ms", "display_name", "share_slices",
                                                          "paused", "download"})

    peer_id: PeerId
    epoch: Epoch
    sequence: Epoch
    addrs: Annotated[list[Addr], msgspec.Meta(max_length=16)] = []
    slices: Annotated[list[HeldSlice], msgspec.Meta(max_length=256)] = []
    load: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    max_bytes: Annotated[int, msgspec.Meta(gt=0)] | None = None
    signature: bytes = b""
    # added later: signed only when not its default (``signed_when_set``, swarm.p2p.identity)
    protocols: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]], msgspec.Meta(max_length=16)] = (
        msgspec.field(default_factory=lambda: [1])
    )  # expert-stream versions spoken (swarm.protocol.expert); a body without it is from a v1 volunteer
    # the request scheme (X-Moe-Signature): the send time, within 120 s of the market's clock
    sent_at_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # a name the volunteer chose for the dashboard (stranger text: shown escaped, never as markup)
    display_name: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # it serves its slices to other volunteers downloading them (``/moe-swarm/slice/1``); older
    # volunteers do not, and one that opted out says False
    share_slices: bool = False
    # "" while it serves; else why its owner's preferences paused it (manual, schedule, user_active,
    # cpu_busy: volunteer.core.preferences): its slices are reported draining, it asks for no slice, and
    # it is not gone -- the heartbeats go on
    paused: Annotated[str, msgspec.Meta(max_length=32, pattern="^[a-z_]*$")] = ""
    # how far the download of a slice it reports ``loading`` got (the dashboard's "downloading 40 %")
    download: DownloadProgress | None = None




class EvidenceMethod(enum.StrEnum):
    """How a coordinator caught a wrong answer (``QuarantineEvidence.method``)."""

    BIT_EXACT = "bit_exact"  # equal kernel ids and a float32 wire: the answer's bits differ from the coordinator's
    TOLERANCE = "tolerance"  # other kernel ids: the answer is beyond the stated tolerance of the coordinator's
    DISK = "disk"  # the coordinator recomputed the experts from its own GGUF on disk (it holds none in memory)
    HOLD_DIGEST = "hold_digest"  # a hold challenge's digest differs from the one computed from the coordinator's copy
    SECOND_REPLICA = "second_replica"  # a second replica disagreed and the coordinator's own computation settled it


class QuarantineEvidence(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a quarantine report must carry (DESIGN §12): enough for anyone holding the model to check
    it -- the call's slice, the sha256 of its input (the request payload as sent: rows, padding and
    pair arrays; for ``hold_digest``, the challenge's nonce and windows as msgpack), of the worker's
    answer (the response payload; the digest) and of the coordinator's own result in the same layout.
    The two output hashes differ (equal ones prove nothing). The market keeps it with the quarantine."""

    layer: Layer
    lo: Expert
    hi: Expert
    input_sha256: Sha256Hex
    remote_sha256: Sha256Hex
    local_sha256: Sha256Hex
    method: EvidenceMethod
    detail: Annotated[str, msgspec.Meta(max_length=2048)] = ""  # for people: e.g. the error against the tolerance


Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # within int64 (what the store and SQLite keep)


class ReportedWorker(msgspec.Struct, forbid_unknown_fields=True):
    """One volunteer as a coordinator saw it since its last report.

    A quarantine (``quarantine``, the reason for people, and/or ``evidence``) must carry ``evidence``:
    a report with a quarantine without it is refused (400 ``missing_evidence``); older coordinators'
    reports without quarantines still decode (``evidence`` defaults to None)."""

    peer_id: PeerId
    calls: Count = 0  # answered calls since the last report
    rows: Count = 0
    verified: Count = 0  # answers that passed verification since the last report
    pairs: Count = 0  # (row, expert) pairs answered since the last report: its credit (6 d_model d_expert FLOPs each)
    latency_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e7)] | None = None  # its latency EWMA now
    path: Annotated[str, msgspec.Meta(max_length=32)] | None = None  # direct | relayed | hole-punched
    quarantine: Annotated[str, msgspec.Meta(max_length=2048)] | None = None  # why, when it failed verification
    # slices it proved it holds (answered this coordinator's hold challenge: DESIGN §12)
    held: Annotated[list[ProvenSlice], msgspec.Meta(max_length=65536)] = []
    evidence: QuarantineEvidence | None = None  # required with a quarantine (added in issue 31)

    @property
    def quarantined(self) -> bool:
        return self.quarantine is not None or self.evidence is not None


class RoutedRange(msgspec.Struct, forbid_unknown_fields=True):
    layer: Layer
    lo: Expert
    hi: Expert
    rows: NonNeg  # rows routed to the range since the last report


class CoordinatorReport(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /api/coordinator-report`` (operator token; DESIGN §11): what a coordinator saw of its
    volunteers and its routing since its last report. One channel for trust, capacity and the dashboard."""

    url: Url  # the coordinator, as registered
    model_id: ModelId
    workers: Annotated[list[ReportedWorker], msgspec.Meta(max_length=4096)] = []
    ranges: Annotated[list[RoutedRange], msgspec.Meta(max_length=65536)] = []
    # (epoch, sequence) of this report (0, 0: unnumbered, and then not on the wire: a market from before the
    # numbering refuses unknown fields): a report resent after an answer that never came is refused as
    # replayed (409 replayed_sequence) by every market replica, so its counts land once
    epoch: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    sequence: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0


class ReportAck(msgspec.Struct):
    workers: int
    quarantined: list[str]  # peer ids newly refused by this report
    # peer ids whose entries changed nothing: they hold no slice (coverage or lease) of the reported model, so
    # no credit, no proof and no quarantine came of them
    ignored: list[str] = []


# -- responses --------------------------------------------------------------------------------


class RegisterAck(msgspec.Struct):
    url: str
    model_ids: list[str]
    epoch: int
    dispatch_map_paths: dict[str, str]  # model id -> path of its dispatch map on this market


class SourceKind(enum.StrEnum):
    PEER = "peer"  # a volunteer holding the slice: ``/moe-swarm/slice/1`` to ``peer_id`` at ``addrs``
    ORIGIN = "origin"  # a plain HTTP(S) mirror of the GGUF file at ``url`` (Range at the manifest's offsets)
    COORDINATOR = "coordinator"  # the slice file at ``url`` (``GET /v1/slices/...``, Range honoured)


class DownloadSource(msgspec.Struct, frozen=True, kw_only=True):
    """One place to download an assigned slice from. ``kind`` is a ``SourceKind`` value, kept an open
    string on the wire: a volunteer skips kinds it does not know (a newer market's), where a tagged
    union would make the whole assignment undecodable."""

    kind: Annotated[str, msgspec.Meta(max_length=32)]
    url: Annotated[str, msgspec.Meta(max_length=2048)] = ""  # origin, coordinator
    peer_id: Annotated[str, msgspec.Meta(max_length=128)] = ""  # peer
    addrs: Annotated[list[Addr], msgspec.Meta(max_length=16)] = []  # peer


class LeaseView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /api/leases/{lease_id}``: whose lease it is and for what, so a volunteer asked for slice
    bytes can check the asker was assigned that slice. ``state`` ``leased`` (not reported yet) or
    ``loading`` (reported ``loading``: downloading); ``expires_in_s`` how long the answer holds."""

    lease_id: str
    peer_id: str
    model_id: str
    layer: int
    lo: int
    hi: int
    expires_in_s: float
    state: Literal["leased", "loading"] = "leased"


class Assignment(msgspec.Struct, tag="assignment", tag_field="kind"):
    """The slice to serve. Download it (sha256-check it), report it ``loading`` then ``serving`` in
    heartbeats before the lease lapses (``lease_expires_in_s``: the market's clock need not match
    yours). ``sources``: where to download from, best first (peers holding it, the GGUF's mirrors,
    then the coordinators; a market that predates them sends none: use ``url``).

    Constrained like a request body: the volunteer builds a file path from ``model_id`` and the range
    (``swarm.safe_paths``), so a hostile market's answer is refused at decoding."""

    model_id: ModelId
    layer: Layer
    lo: Expert
    hi: Expert
    slice: Annotated[str, msgspec.Meta(max_length=64)]  # "LAYER:LO-HI"
    url: Url
    size: Annotated[int, msgspec.Meta(gt=0, le=1 << 44)]
    sha256: Sha256Hex
    lease_id: LeaseId
    lease_expires_in_s: Seconds
    scarcity: float
    relays: Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=16)]  # reserve a slot on one of these when you cannot be dialled
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]  # send coverage at least this often
    coordinator: Annotated[str, msgspec.Meta(max_length=2048)]
    sources: Annotated[list[DownloadSource], msgspec.Meta(max_length=64)] = []

    def __post_init__(self) -> None:
        if self.hi <= self.lo:  # raised as a ValidationError by the decoder
            raise ValueError(f"an assignment of the empty range {self.lo}-{self.hi}")


class NothingNeeded(msgspec.Struct, tag="nothing_needed", tag_field="kind"):
    reason: Annotated[str, msgspec.Meta(max_length=64)]  # no_models | nothing_scarce | budget_too_small | coordinator_unreachable | quarantined | address_cap | paused
    retry_after_s: Seconds
    message: ShortText = ""


VolunteerAnswer = Assignment | NothingNeeded


class SliceDirective(msgspec.Struct):
    """What to do with one reported slice.

    ``keep``: carry on (``dispatched`` says whether coordinators are told to use it);
    ``drain``: no longer dispatched; answer what is in flight, release in ``release_in_s``;
    ``release``: drop it now (cooldown over, or a slice the market does not know: ``reason``).
    """

    model_id: str
    layer: int
    lo: int
    hi: int
    action: Literal["keep", "drain", "release"]
    dispatched: bool = False
    release_in_s: float | None = None
    reason: str = ""


class CoverageAck(msgspec.Struct):
    peer_id: str
    epoch: int
    sequence: int
    slices: list[SliceDirective]
    heartbeat_s: float
    ttl_s: float
    relays: list[str] = []
    # peer ids of the registered coordinators of the models in the heartbeat: the only callers the
    # volunteer answers (DESIGN §12); None from a market that predates the rule
    coordinators: list[str] | None = None


class ModelDemand(msgspec.Struct):
    model_id: str
    hosted: bool  # some coordinator serves its slices
    saturated: bool
    recruiting: bool
    base_target: int
    effective_target: int
    replicas_min: int
    segments: list[Segment]
    # experts some hosting coordinator does not compute itself: their effective target (None: there are none)
    remote_target: int | None = None
    holes: int = 0  # experts nobody can compute now: no replica, and not every hosting coordinator holds them
    # ``saturated`` is the smoothed signal (on after --rise-s saturated, off after --hold-s not; it drives the
    # boost); this is what the fresh polls say right now, before that hysteresis
    saturated_now: bool = False


class DemandView(msgspec.Struct):
    recruiting: bool  # some model is recruiting
    models: list[ModelDemand]


class CoordinatorView(msgspec.Struct):
    url: str
    ok: bool  # last poll succeeded
    busy: int | None
    slots: int | None
    saturated: bool
    last_poll_age_s: float | None
    error: str | None = None
    hosting: bool = True  # False: its polls have failed too long; its models are not offered on its account


class WorkerSliceView(msgspec.Struct):
    slice: str
    layer: int
    lo: int
    hi: int
    state: str  # dispatched | loading | draining | retiring | released
    age_s: float
    last_serve_ms: int
    served: bool = False  # a coordinator verified the volunteer's answers
    held: bool = False  # it answered a coordinator's hold challenge for this slice
    progress: float | None = None  # of a loading slice: the share downloaded (0..1), as its volunteer reported


class WorkerView(msgspec.Struct):
    peer_id: str
    age_s: float  # since its oldest slice of this model
    last_heartbeat_age_s: float
    last_serve_ms: int  # latest over its slices; 0 = never served
    load: float
    dispatched: bool
    slices: list[WorkerSliceView]
    display_name: str = ""  # volunteer-chosen, control characters removed (escape it when shown)
    path: str | None = None  # direct | relayed | hole-punched, as the last coordinator report said
    calls: int = 0  # answered calls, as coordinators reported
    verified: int = 0
    latency_ms: float | None = None  # its latency EWMA at the last coordinator report
    credit_rac: float = 0.0  # recent average credit, FLOPs a day
    paused: str = ""  # its owner's preferences paused it (why; its slices are draining): not gone
    # answered calls per second over the last 15 s, from coordinator reports (market.core.activity)
    calls_per_s: float = 0.0
    # what it does, in a few words: "serving 3.2 calls/s", "idle", "downloading 40 %", "retiring", ...
    activity: str = ""


class ModelRecruitment(msgspec.Struct):
    model_id: str
    busy: int
    slots: int
    saturated: bool
    recruiting: bool
    recruiting_for_s: float | None
    base_target: int
    effective_target: int
    replicas_min: int
    map_version: int
    coordinators: list[CoordinatorView]
    workers: list[WorkerView]
    remote_target: int | None = None  # as in ModelDemand
    holes: int = 0
    tokens_per_s: float = 0.0  # decode tokens/s of its coordinators' busy slots at their last polls
    saturated_now: bool = False  # as in ModelDemand: the raw signal (``saturated`` is after hysteresis)
    saturated_for_s: float | None = None  # how long the current run of saturated polls has lasted


class VolunteerCredit(msgspec.Struct):
    """``GET /api/volunteers/{peer_id}``: a volunteer's credit (fed only by coordinator reports: FLOPs of
    the pairs it answered, 6 d_model d_expert each, in periods it was not quarantined) and its state.
    Never its addresses."""

    peer_id: str
    total_flops: float
    rac_flops_per_day: float  # recent average credit, half-life one week
    pairs: int
    verified: int  # answers that passed a coordinator's verification
    first_credit_ms: int | None  # Unix ms (None: no credit yet)
    last_credit_ms: int | None
    quarantined_until_ms: int | None = None
    slices: list[str] = []  # what it holds now, as the market counts it
    # while quarantined: the coordinator's reason (for people) and its evidence (``QuarantineEvidence``)
    quarantine_reason: str = ""
    quarantine_evidence: QuarantineEvidence | None = None
    paused: str = ""  # its last heartbeat said its owner paused it, and why ("" serving or unknown)


class MarketEvent(msgspec.Struct):
    """One entry of the market's event log (``GET /api/events``): ``kind`` is one of assigned,
    loading, serving, draining, restored, released, expired, lease_expired, unproven, download_overdue,
    quarantined, saturated, unsaturated (the model's smoothed saturation signal: the boost and
    recruitment start and end with it), host_down, host_up, coordinator_gone, model_dropped, paused, resumed."""

    seq: int
    at_ms: int
    kind: str
    model_id: str | None = None
    peer_id: str | None = None
    slice: str | None = None
    detail: str = ""


class EventLog(msgspec.Struct):
    """``GET /api/events?after=SEQ``: the events after ``SEQ`` (the last 1,000 are kept)."""

    events: list[MarketEvent]
    last_seq: int


class HistorySample(msgspec.Struct, array_like=True):
    """``[at_ms, busy, slots, effective_target, replicas_min, tokens_per_s]``"""

    at_ms: int
    busy: int
    slots: int
    effective_target: int
    replicas_min: int
    tokens_per_s: float


class ModelHistory(msgspec.Struct):
    """``GET /api/history``: one model's samples of the last 15 minutes (every 5 s), oldest first."""

    model_id: str
    samples: list[HistorySample]


class CreditBoard(msgspec.Struct):
    """``GET /api/volunteers?limit=N``: the volunteers with credit, highest recent average first."""

    volunteers: list[VolunteerCredit]


class RecruitmentView(msgspec.Struct):
    recruiting: bool
    models: list[ModelRecruitment]


register_decoder = msgspec.json.Decoder(RegisterModels)
volunteer_decoder = msgspec.json.Decoder(VolunteerRequest)
coverage_decoder = msgspec.json.Decoder(CoverageHeartbeat)
report_decoder = msgspec.json.Decoder(CoordinatorReport)
lease_decoder = msgspec.json.Decoder(LeaseView)
