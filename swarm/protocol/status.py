"""What a volunteer or relay publishes about itself in its data dir (pure: msgspec Structs).

``DATA_DIR/volunteer.json`` and ``DATA_DIR/relay.json`` are for the person running the process and
for tools (the demo, tests) that need its peer id and addresses; rewritten whenever they change.
Readers tolerate unknown fields; new fields get defaults.
"""

from __future__ import annotations

import msgspec

__all__ = ["RelayInfo", "VolunteerInfo", "encode_info"]


class VolunteerInfo(msgspec.Struct, kw_only=True):
    peer_id: str
    addrs: list[str]  # what coordinators dial: direct and/or /p2p-circuit addresses
    reachability: str  # public | private | unknown (swarm.core.paths.Reachability)
    epoch: int | None = None  # pull mode: the restart epoch of its signed heartbeats
    relays: list[str] = []  # pull mode: the relays it may reserve on
    model_id: str | None = None  # static mode
    slices: list[str] = []  # static mode: LAYER:LO-HI
    expert_tokens_per_s: float | None = None  # pull mode: the throughput probe
    measured_at: int | None = None


class RelayInfo(msgspec.Struct, kw_only=True):
    peer_id: str
    addrs: list[str]  # each ending in /p2p/<relay id>: what volunteers pass to --relay
    metrics: str | None  # the /metrics URL


def encode_info(info: VolunteerInfo | RelayInfo) -> bytes:
    """Pretty JSON with a trailing newline (people read these files)."""
    return msgspec.json.format(msgspec.json.encode(info), indent=2) + b"\n"
