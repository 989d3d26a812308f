"""A hosted model's manifest: the one definition of ``GET /v1/models/{id}/manifest`` (pure, torch-free).

The coordinator builds it from its GGUF (``swarm.model.slices.build_manifest``), serves it to
volunteers and registers it with the market (``swarm.protocol.market.RegisterModels``); the market
keeps it as a durable fact. One Struct for all three, so the shapes cannot drift apart.

Rules:
- ``tensor_types[layer][kind]`` is the ggml type name of that layer's ``kind`` expert tensor (types
  may differ between layers, as in llama.cpp's mixed quantisations); ``bytes_per_expert[layer]`` is
  the raw gate + up + down bytes of one expert of that layer.
- Unknown fields are accepted (a newer coordinator may register with an older market); the limits
  are ``msgspec.Meta`` constraints, checked on decode; ``problems()`` lists what constraints cannot say.
- Multi-source downloads (issue 12 item 4; all defaulted, so an older coordinator's manifest still
  decodes, and then a volunteer downloads from the coordinator only: ``can_verify_experts``):
  ``kind_bytes[layer][kind]`` is the bytes of ONE expert of that kind as stored;
  ``tensor_offsets[layer][kind]`` the absolute offset in the GGUF file of that layer's stacked
  ``kind`` expert tensor, so expert ``e`` of it lies at ``offset + e * kind_bytes[layer][kind]``;
  ``expert_sha256[layer][e]`` the sha256 hex of expert ``e``'s raw ``gate || up || down`` bytes;
  ``origins`` plain HTTP(S) mirrors of the GGUF file (read with Range at those offsets). Every byte
  a volunteer takes from a peer or a mirror is checked against ``expert_sha256``; the slice file's
  header is rebuilt from this manifest (``swarm.model.slices.plan_slice``).
- ``expert_activation``: the function between an expert's gate/up and down projections ("silu":
  ``silu(gate) * up``, every architecture so far); a volunteer checks it before downloading.
- Size: the expert hashes cost 67 bytes of JSON an expert (48 layers x 128 experts: 412 KB), within
  the market's 4 MiB registration body for a few large models.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

__all__ = ["BIAS_KINDS", "DEFAULT_ACTIVATION", "EXPERT_KINDS", "MAX_ORIGINS", "MODEL_ID_PATTERN", "SLICE_FORMAT",
           "SLICE_FORMAT_ACTIVATION", "ModelId", "ModelManifest", "slice_kinds"]

# ``\Z``, not ``$``: ``$`` also matches before a final newline ("abc\n" would pass)
MODEL_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z"
_MODEL_ID = re.compile(MODEL_ID_PATTERN)
SLICE_FORMAT: Final = 1  # version of the slice file layout (``swarm.model.slices``)
# a slice whose experts use another activation than SiLU-gated (SwiGLU) says so, in format 2: a
# volunteer that predates activations refuses format 2 instead of computing the wrong function
SLICE_FORMAT_ACTIVATION: Final = 2
DEFAULT_ACTIVATION: Final = "silu"

ModelId = Annotated[str, msgspec.Meta(pattern=MODEL_ID_PATTERN)]
_Positive = Annotated[int, msgspec.Meta(gt=0)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]


MAX_EXPERTS = 1 << 16  # layers x experts of one model (DeepSeek-V3: 58 x 256 = 14,848)
MAX_ORIGINS: Final = 16
EXPERT_KINDS: Final = ("gate", "up", "down")
BIAS_KINDS: Final = ("gate_b", "up_b", "down_b")  # gpt-oss's expert biases (F32), after the weights


def slice_kinds(names: object) -> tuple[str, ...] | None:
    """The kinds a slice of experts holds, in storage order, for the set of kind ``names`` it lists:
    the three weights, or the weights and their biases; None for anything else."""
    got = set(names) if isinstance(names, dict | list | tuple | set | frozenset) else None
    if got == set(EXPERT_KINDS):
        return EXPERT_KINDS
    if got == set(EXPERT_KINDS) | set(BIAS_KINDS):
        return EXPERT_KINDS + BIAS_KINDS
    return None
_HEX64 = re.compile(r"[0-9a-f]{64}")
_ORIGIN_PATTERN: Final = r"^https?://[^\s/]+(/[^\s]*)?$"
_ORIGIN = re.compile(_ORIGIN_PATTERN[1:-1])
OriginUrl = Annotated[str, msgspec.Meta(pattern=_ORIGIN_PATTERN, max_length=2048)]


class ModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a volunteer or the market needs to know about a hosted model's experts (DESIGN §11)."""

    model_id: ModelId
    arch: Annotated[str, msgspec.Meta(max_length=64)]
    n_layer: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    n_expert: Annotated[int, msgspec.Meta(ge=1, le=65536)]
    n_expert_used: _NonNeg = 0
    d_model: _Positive = 1
    d_expert: _Positive = 1
    tensor_types: list[dict[str, str]] = []
    bytes_per_expert: list[_Positive]
    gguf_sha256: str = ""
    slice_format: int = SLICE_FORMAT
    # multi-source downloads (module rules); empty: not known (an older coordinator)
    kind_bytes: list[dict[str, _Positive]] = []
    tensor_offsets: list[dict[str, _NonNeg]] = []
    expert_sha256: list[list[Annotated[str, msgspec.Meta(min_length=64, max_length=64)]]] = []
    origins: Annotated[list[OriginUrl], msgspec.Meta(max_length=MAX_ORIGINS)] = []
    # the experts' activation (``swarm.model.kernels.EXPERT_ACTIVATIONS`` names what a volunteer computes)
    expert_activation: Annotated[str, msgspec.Meta(max_length=64)] = DEFAULT_ACTIVATION

    @property
    def can_verify_experts(self) -> bool:
        """Does it carry what a download from peers and mirrors needs (per-expert hashes and sizes)?"""
        return bool(self.expert_sha256) and bool(self.kind_bytes)

    def problems(self) -> list[str]:
        """What makes this manifest unusable (empty when it is fine)."""
        out: list[str] = []
        if not _MODEL_ID.match(self.model_id):
            out.append(f"bad model id {self.model_id!r}")
        if len(self.bytes_per_expert) != self.n_layer:
            out.append(f"bytes_per_expert has {len(self.bytes_per_expert)} entries for {self.n_layer} layers")
        if self.n_layer * self.n_expert > MAX_EXPERTS:
            # the market keeps per-expert state: a stranger's 1024 x 16384 "model" would cost it gigabytes
            out.append(f"{self.n_layer} layers x {self.n_expert} experts exceed {MAX_EXPERTS} experts in all")
            return out  # and the per-expert lists below are not walked
        out.extend(self._source_problems())
        return out

    def _source_problems(self) -> list[str]:
        out: list[str] = []
        for name, table in (("kind_bytes", self.kind_bytes), ("tensor_offsets", self.tensor_offsets)):
            if table and len(table) != self.n_layer:
                out.append(f"{name} has {len(table)} entries for {self.n_layer} layers")
            elif any(slice_kinds(row) is None for row in table):
                out.append(f"every {name} entry names exactly the kinds {', '.join(EXPERT_KINDS)} "
                           f"(and {', '.join(BIAS_KINDS)} for biased experts)")
        if not out:  # each layer's tables name the same kinds (the weights, or the weights and their biases)
            for i in range(self.n_layer):
                rows = [t[i] for t in (self.tensor_types, self.kind_bytes, self.tensor_offsets) if len(t) == self.n_layer]
                if len({frozenset(r) for r in rows}) > 1:
                    out.append(f"layer {i}: tensor_types, kind_bytes and tensor_offsets name different kinds")
                    break
        if self.kind_bytes and len(self.kind_bytes) == len(self.bytes_per_expert) and not out:
            bad = [i for i, (row, total) in enumerate(zip(self.kind_bytes, self.bytes_per_expert, strict=True))
                   if sum(row.values()) != total]
            if bad:
                out.append(f"kind_bytes of layer {bad[0]} do not add up to its bytes_per_expert")
        if self.expert_sha256:
            if len(self.expert_sha256) != self.n_layer:
                out.append(f"expert_sha256 has {len(self.expert_sha256)} entries for {self.n_layer} layers")
            elif any(len(row) != self.n_expert for row in self.expert_sha256):
                out.append(f"every expert_sha256 entry lists {self.n_expert} experts")
            elif not all(_HEX64.fullmatch(h) for row in self.expert_sha256 for h in row):
                out.append("expert_sha256 holds a value that is not 64 lowercase hex digits")
            if not self.kind_bytes:
                out.append("expert_sha256 without kind_bytes")
        bad_origins = [u for u in self.origins if not _ORIGIN.fullmatch(u)]
        if bad_origins or len(self.origins) > MAX_ORIGINS or len(set(self.origins)) != len(self.origins):
            out.append(f"origins must be at most {MAX_ORIGINS} distinct http(s) URLs"
                       + (f" ({bad_origins[0][:100]!r} is not one)" if bad_origins else ""))
        if self.origins and not (self.tensor_offsets and self.can_verify_experts):
            out.append("origins without tensor_offsets, kind_bytes and expert_sha256 cannot be read")
        return out
