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
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

__all__ = ["MODEL_ID_PATTERN", "SLICE_FORMAT", "ModelId", "ModelManifest"]

MODEL_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
_MODEL_ID = re.compile(MODEL_ID_PATTERN)
SLICE_FORMAT: Final = 1  # version of the slice file layout (``swarm.model.slices``)

ModelId = Annotated[str, msgspec.Meta(pattern=MODEL_ID_PATTERN)]
_Positive = Annotated[int, msgspec.Meta(gt=0)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]


MAX_EXPERTS = 1 << 16  # layers x experts of one model (DeepSeek-V3: 58 x 256 = 14,848)


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
        return out
