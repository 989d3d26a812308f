"""Identifiers shared by every component (pure: msgspec Structs and parsing, no torch, no I/O).

Rules (DESIGN §11):
- A slice is ``(model_id, layer, lo, hi)``, experts ``lo .. hi-1`` (half-open); on a command line
  ``LAYER:LO-HI``. Slice keys order by (model_id, layer, lo, hi).
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

from swarm.errors import ConfigError

__all__ = ["SliceKey", "parse_slice_arg"]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
_SLICE_ARG: Final = re.compile(r"([0-9]+):([0-9]+)-([0-9]+)")


class SliceKey(msgspec.Struct, frozen=True, order=True):
    """A slice: experts ``lo .. hi-1`` (half-open) of ``layer`` of ``model_id``."""

    model_id: str
    layer: NonNeg
    lo: NonNeg
    hi: Positive

    def __str__(self) -> str:
        return f"{self.layer}:{self.lo}-{self.hi}"

    @property
    def n_expert(self) -> int:
        return self.hi - self.lo

    @property
    def http_path(self) -> str:
        """The download path on a coordinator (DESIGN §11)."""
        return f"/v1/slices/{self.model_id}/{self.layer}/{self.lo}-{self.hi}"

    def overlaps(self, other: SliceKey) -> bool:
        return (
            self.model_id == other.model_id and self.layer == other.layer and self.lo < other.hi and other.lo < self.hi
        )

    @classmethod
    def parse(cls, model_id: str, arg: str) -> SliceKey:
        layer, lo, hi = parse_slice_arg(arg)
        return cls(model_id, layer, lo, hi)


def parse_slice_arg(arg: str) -> tuple[int, int, int]:
    """``"LAYER:LO-HI"`` (e.g. ``"0:0-4"``) -> ``(layer, lo, hi)``; ``ConfigError`` on bad syntax."""
    m = _SLICE_ARG.fullmatch(arg.strip())
    if m is None:
        raise ConfigError(f"bad slice {arg!r}: expected LAYER:LO-HI, e.g. 0:0-4 (experts 0..3 of layer 0)")
    layer, lo, hi = (int(g) for g in m.groups())
    if lo >= hi:
        raise ConfigError(f"bad slice {arg!r}: LO must be below HI (the range LO-HI is half-open)")
    return layer, lo, hi
