"""What the gateway reads from the market (wire contract, msgspec): ``GET /api/coordinators[?model=ID]``.

Rules: read-only and public (coordinator URLs are public on ``/api/moe/recruitment`` too); one entry per
model, its registered coordinators sorted by URL, down ones too with ``hosting`` false (the gateway skips
them); new fields get defaults.
"""

from __future__ import annotations

import msgspec

__all__ = ["CoordinatorDirectory", "DirectoryEntry", "ListedCoordinator", "directory_decoder"]


class ListedCoordinator(msgspec.Struct, frozen=True):
    url: str
    hosting: bool = True  # False: its polls have failed too long
    ok: bool = False  # the market's last poll of it succeeded
    last_poll_age_s: float | None = None


class DirectoryEntry(msgspec.Struct, frozen=True):
    model_id: str
    coordinators: list[ListedCoordinator] = []


class CoordinatorDirectory(msgspec.Struct, frozen=True):
    models: list[DirectoryEntry] = []


directory_decoder = msgspec.json.Decoder(CoordinatorDirectory)
