"""The market's facts as data (pure: msgspec Structs, no I/O).

Durable rows (``*Row``) are what the ``Store`` keeps; everything else the market knows (last
heartbeat time, reported load, per-slice last serve, coordinator polls) is runtime state that a
restart may lose without losing a decision.

Rules:
- Rows are frozen; a change is a new row put under the same key (``row_key``).
- Slices are half-open ``[lo, hi)`` expert ranges of one layer (DESIGN §11).
- Times are the market's ``now`` (Unix seconds in the service, virtual seconds in tests):
  persisted times must stay meaningful across a restart, so the service uses the wall clock.
- ``ModelManifest`` mirrors ``swarm.slices.Manifest`` field for field (the wire shape of
  ``GET /v1/models/{id}/manifest``) without importing the model code; unknown fields are
  accepted so a newer coordinator can register with an older market.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Final

import msgspec

from swarm.dispatch_map import LayerRanges
from swarm.ids import SliceKey

__all__ = [
    "MODEL_ID_PATTERN",
    "CoordinatorRow",
    "CoverageRow",
    "HeldState",
    "LeaseRow",
    "MapRow",
    "ModelManifest",
    "ModelRow",
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

MODEL_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
_MODEL_ID = re.compile(MODEL_ID_PATTERN)

ModelId = Annotated[str, msgspec.Meta(pattern=MODEL_ID_PATTERN)]
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


SliceRef = SliceKey  # the slice identity of DESIGN §11, shared with the coordinator and volunteers


class ModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a coordinator says about a model it hosts (same shape as ``swarm.slices.Manifest``)."""

    model_id: ModelId
    arch: Annotated[str, msgspec.Meta(max_length=64)]
    n_layer: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    n_expert: Annotated[int, msgspec.Meta(ge=1, le=65536)]
    n_expert_used: NonNeg = 0
    d_model: Positive = 1
    d_expert: Positive = 1
    tensor_types: list[dict[str, str]] = []
    bytes_per_expert: list[Positive]
    gguf_sha256: str = ""
    slice_format: int = 1

    def problems(self) -> list[str]:
        """What makes this manifest unusable (empty when it is fine)."""
        out: list[str] = []
        if not _MODEL_ID.match(self.model_id):
            out.append(f"bad model id {self.model_id!r}")
        if len(self.bytes_per_expert) != self.n_layer:
            out.append(f"bytes_per_expert has {len(self.bytes_per_expert)} entries for {self.n_layer} layers")
        return out


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


class HeldState(enum.StrEnum):
    """What a volunteer says about a slice it holds."""

    LOADING = "loading"  # downloading / loading: not dispatchable yet
    SERVING = "serving"  # loaded and reachable: dispatchable
    DRAINING = "draining"  # the volunteer is leaving: do not dispatch, it finishes in-flight calls


class CoverageRow(msgspec.Struct, frozen=True, tag=True):
    """One volunteer holding one slice.

    ``retiring_since`` is the market's decision to stop dispatching it (surplus after the target
    fell); ``cooldown`` seconds later the volunteer is told to release it. ``proven`` flips once,
    when the volunteer first reports a served call for the slice.
    """

    peer_id: str
    slice: SliceRef
    state: HeldState
    since: float
    retiring_since: float | None = None
    proven: bool = False

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


Row = ModelRow | CoordinatorRow | VolunteerRow | CoverageRow | LeaseRow | MapRow | RecruitRow

_TABLE_OF: Final[dict[type, Table]] = {
    ModelRow: Table.MODELS,
    CoordinatorRow: Table.COORDINATORS,
    VolunteerRow: Table.VOLUNTEERS,
    CoverageRow: Table.COVERAGE,
    LeaseRow: Table.LEASES,
    MapRow: Table.MAPS,
    RecruitRow: Table.RECRUITMENT,
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
        case VolunteerRow():
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
