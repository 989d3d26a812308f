"""The dispatch map of DESIGN §11 (pure: msgspec Structs, validation, partitioning).

Rules:
- Ranges are half-open ``[lo, hi)`` expert ranges of one layer; within a layer they never overlap.
- Replicas are listed in preference order; the coordinator's own copy is implicit, always the last
  resort, and never listed.
- ``version`` grows with every change; a reader keeps the map with the highest version it has seen.
- The same JSON comes from ``--dispatch-map FILE`` and from the market.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from swarm.errors import ConfigError

__all__ = ["DispatchMap", "LayerRanges", "RangeReplicas", "Replica", "decode_dispatch_map", "partition_layer"]


class Replica(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    peer_id: str
    addrs: list[str] = []
    # the market's opaque tag of the network the volunteer speaks from ("" unknown): two replicas of one
    # tag could be one party, so a coordinator never lets one check the other (DESIGN §12)
    net: Annotated[str, msgspec.Meta(max_length=64)] = ""


class RangeReplicas(msgspec.Struct, frozen=True):
    lo: Annotated[int, msgspec.Meta(ge=0)]
    hi: Annotated[int, msgspec.Meta(ge=1)]
    replicas: list[Replica] = []


class LayerRanges(msgspec.Struct, frozen=True):
    layer: Annotated[int, msgspec.Meta(ge=0)]
    ranges: list[RangeReplicas] = []


class DispatchMap(msgspec.Struct, frozen=True):
    model_id: str
    version: Annotated[int, msgspec.Meta(ge=0)] = 0
    layers: list[LayerRanges] = []

    def validate(self, *, n_layer: int | None = None, n_expert: int | None = None) -> DispatchMap:
        seen_layers: set[int] = set()
        for L in self.layers:
            if L.layer in seen_layers:
                raise ConfigError(f"dispatch map lists layer {L.layer} twice", code="bad_dispatch_map")
            seen_layers.add(L.layer)
            if n_layer is not None and L.layer >= n_layer:
                raise ConfigError(f"dispatch map layer {L.layer} >= n_layer {n_layer}", code="bad_dispatch_map")
            prev_hi = -1
            for r in sorted(L.ranges, key=lambda r: r.lo):
                if r.lo >= r.hi:
                    raise ConfigError(f"layer {L.layer}: empty range {r.lo}-{r.hi}", code="bad_dispatch_map")
                if n_expert is not None and r.hi > n_expert:
                    raise ConfigError(f"layer {L.layer}: range {r.lo}-{r.hi} beyond {n_expert} experts", code="bad_dispatch_map")
                if r.lo < prev_hi:
                    raise ConfigError(f"layer {L.layer}: ranges overlap at {r.lo}", code="bad_dispatch_map")
                prev_hi = r.hi
        return self

    def ranges_of(self, layer: int) -> list[RangeReplicas]:
        for L in self.layers:
            if L.layer == layer:
                return sorted(L.ranges, key=lambda r: r.lo)
        return []

    def peers(self) -> dict[str, list[str]]:
        """Every listed peer with its addresses (the last listing wins)."""
        out: dict[str, list[str]] = {}
        for L in self.layers:
            for r in L.ranges:
                for rep in r.replicas:
                    out[rep.peer_id] = list(rep.addrs)
        return out


_decoder = msgspec.json.Decoder(DispatchMap)


def decode_dispatch_map(data: bytes, *, n_layer: int | None = None, n_expert: int | None = None) -> DispatchMap:
    try:
        m = _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"invalid dispatch map: {exc}", code="bad_dispatch_map") from exc
    return m.validate(n_layer=n_layer, n_expert=n_expert)


def partition_layer(ranges: list[RangeReplicas], n_expert: int) -> list[RangeReplicas]:
    """Cover ``[0, n_expert)``: the listed ranges plus replica-less gaps (local-only ranges)."""
    out: list[RangeReplicas] = []
    at = 0
    for r in sorted(ranges, key=lambda r: r.lo):
        if r.lo > at:
            out.append(RangeReplicas(at, r.lo, []))
        out.append(r)
        at = r.hi
    if at < n_expert:
        out.append(RangeReplicas(at, n_expert, []))
    return out
