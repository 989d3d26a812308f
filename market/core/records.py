"""The market's facts as data (pure: msgspec Structs, no I/O).

Durable rows (``*Row``) are what the ``Store`` keeps; everything else the market knows (last
heartbeat time, reported load, per-slice last serve, coordinator polls) is runtime state that a
restart may lose without losing a decision.

Rules:
- Rows are frozen; a change is a new row put under the same key (``row_key``).
- Slices are half-open ``[lo, hi)`` expert ranges of one layer (DESIGN §11).
- Times are the market's ``now`` (Unix seconds in the service, virtual seconds in tests):
  persisted times must stay meaningful across a restart, so the service uses the wall clock.
- ``ModelManifest`` is ``swarm.protocol.manifest``'s, the one wire shape of a model's manifest.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec

from swarm.dispatch_map import LayerRanges
from swarm.ids import SliceKey
from swarm.protocol.manifest import MODEL_ID_PATTERN, ModelManifest
from swarm.protocol.market import HeldState, QuarantineEvidence

__all__ = [
    "MODEL_ID_PATTERN",
    "CoordinatorRow",
    "CoverageRow",
    "HeldState",
    "LeaseRow",
    "MapRow",
    "ModelManifest",
    "ModelRow",
    "QuarantineRow",
    "RecruitRow",
    "Row",
    "SliceRef",
    "Snapshot",
    "Table",
    "VolunteerRow",
    "coverage_key",
    "row_key",
    "row_table",
]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]


class Table(enum.StrEnum):
    MODELS = "models"
    COORDINATORS = "coordinators"
    VOLUNTEERS = "volunteers"
    COVERAGE = "coverage"
    LEASES = "leases"
    MAPS = "maps"
    RECRUITMENT = "recruitment"
    QUARANTINE = "quarantine"
    CREDIT = "credit"


SliceRef = SliceKey  # the slice identity of DESIGN §11, shared with the coordinator and volunteers


class ModelRow(msgspec.Struct, frozen=True, tag=True):
    manifest: ModelManifest
    registered_at: float


class CoordinatorRow(msgspec.Struct, frozen=True, tag=True):
    """A coordinator (by its advertised base URL) and the models it hosts.

    ``epoch`` orders registrations of one URL: a registration with a lower epoch than the stored
    one is stale and never replaces it (the coordinator sends its start time in ms).
    """

    url: str
    model_ids: list[str]
    epoch: NonNeg
    registered_at: float
    peer_id: str | None = None  # its libp2p id (volunteers of its models answer it only)
    # model -> [(layer, lo, hi)] it computes itself; a model not named: all (``--local-experts``)
    local_experts: dict[str, list[tuple[int, int, int]]] = {}
    # model -> the mirror URLs of its GGUF this coordinator registered (``--origin``; download sources)
    origins: dict[str, list[str]] = {}


class VolunteerRow(msgspec.Struct, frozen=True, tag=True):
    """A volunteer's identity facts: the epoch/sequence high-water mark and its addresses.

    ``sequence`` is flushed periodically, not on every heartbeat (see ``market.state``).
    """

    peer_id: str
    epoch: NonNeg
    sequence: NonNeg
    first_seen: float
    addrs: list[str] = []
    max_bytes: int | None = None
    protocols: list[int] = msgspec.field(default_factory=lambda: [1])  # expert-stream versions it speaks
    # the salted tag of the network its heartbeats come from (``registry.network_tag``; "" unknown): the
    # map's ``Replica.net``, so a coordinator never lets one network's replicas check each other
    net: str = ""


class CoverageRow(msgspec.Struct, frozen=True, tag=True):
    """One volunteer holding one slice.

    ``retiring_since`` is the market's decision to stop dispatching it (surplus after the target
    fell); ``cooldown`` seconds later the volunteer is told to release it. ``served`` flips once,
    when a coordinator reports verified answers of the volunteer (never from its own word; stored
    under its old name ``proven``); ``held`` once a coordinator reports it answered a hold
    challenge for the slice (DESIGN §12: only then, or served, does it count beyond its grace).
    ``lease_id``: the lease the row was converted from.
    """

    peer_id: str
    slice: SliceRef
    state: HeldState
    since: float
    retiring_since: float | None = None
    served: bool = msgspec.field(default=False, name="proven")
    held: bool = False
    # the lease it was granted under (converted by the heartbeat that first listed it): the market keeps
    # answering ``GET /api/leases/{lease_id}`` for it while the row is ``loading`` (peers serving the
    # download check it); "" for rows from before the rule or without a lease
    lease_id: str = ""

    @property
    def proved(self) -> bool:
        """It showed it holds the slice: a passed hold challenge or verified answers."""
        return self.held or self.served

    @property
    def dispatched(self) -> bool:
        return self.state is HeldState.SERVING and self.retiring_since is None

    @property
    def pending(self) -> bool:
        return self.state is HeldState.LOADING and self.retiring_since is None


class LeaseRow(msgspec.Struct, frozen=True, tag=True):
    """A slice handed to a volunteer that has not reported it yet; it lapses at ``expires_at``."""

    lease_id: str
    peer_id: str
    slice: SliceRef
    granted_at: float
    expires_at: float


class MapRow(msgspec.Struct, frozen=True, tag=True):
    """The last published dispatch map of a model (its version must keep growing across restarts)."""

    model_id: str
    version: NonNeg
    layers: list[LayerRanges] = []


class RecruitRow(msgspec.Struct, frozen=True, tag=True):
    """Whether a model's target is boosted, so a restart does not drop a boost mid-load."""

    model_id: str
    recruiting: bool
    changed_at: float


class QuarantineRow(msgspec.Struct, frozen=True, tag=True):
    """A volunteer a coordinator caught answering wrongly (verification, DESIGN §12): its coverage is
    dropped and it is refused until ``until``."""

    peer_id: str
    until: float
    evidence: str  # the coordinator's reason, for people
    reported_by: str  # the coordinator's URL
    at: float
    proof: QuarantineEvidence | None = None  # what it checked (required of reports since issue 31; None in older rows)


class CreditRow(msgspec.Struct, frozen=True, tag=True):
    """A volunteer's credit, fed only by coordinator reports (``market.core.credit``): FLOPs of the
    pairs it answered (6 d_model d_expert each) in report periods it was not quarantined in, its
    recent average (per day, exponentially decayed) and the pair counts."""

    peer_id: str
    total_flops: float
    rac_flops_per_day: float
    rac_at: float  # when ``rac_flops_per_day`` was last brought up to date
    pairs: int
    verified: int  # answers that passed a coordinator's verification
    first_at: float
    last_at: float


Row = ModelRow | CoordinatorRow | VolunteerRow | CoverageRow | LeaseRow | MapRow | RecruitRow | QuarantineRow | CreditRow

_TABLE_OF: Final[dict[type, Table]] = {
    ModelRow: Table.MODELS,
    CoordinatorRow: Table.COORDINATORS,
    VolunteerRow: Table.VOLUNTEERS,
    CoverageRow: Table.COVERAGE,
    LeaseRow: Table.LEASES,
    MapRow: Table.MAPS,
    RecruitRow: Table.RECRUITMENT,
    QuarantineRow: Table.QUARANTINE,
    CreditRow: Table.CREDIT,
}


def row_table(row: Row) -> Table:
    return _TABLE_OF[type(row)]


def coverage_key(peer_id: str, s: SliceRef) -> str:
    return f"{peer_id}|{s.model_id}|{s.layer}|{s.lo}|{s.hi}"


def row_key(row: Row) -> str:
    """The primary key of ``row`` in its table."""
    match row:
        case ModelRow():
            return row.manifest.model_id
        case CoordinatorRow():
            return row.url
        case VolunteerRow() | QuarantineRow() | CreditRow():
            return row.peer_id
        case CoverageRow():
            return coverage_key(row.peer_id, row.slice)
        case LeaseRow():
            return row.lease_id
        case MapRow() | RecruitRow():
            return row.model_id
    raise TypeError(f"not a row: {type(row).__name__}")


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything durable, as loaded at start."""

    models: list[ModelRow] = []
    coordinators: list[CoordinatorRow] = []
    volunteers: list[VolunteerRow] = []
    coverage: list[CoverageRow] = []
    leases: list[LeaseRow] = []
    maps: list[MapRow] = []
    recruitment: list[RecruitRow] = []
    quarantine: list[QuarantineRow] = []
    credit: list[CreditRow] = []
