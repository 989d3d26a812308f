"""``--dispatch-map FILE`` (shell): re-read the file and adopt it whenever its contents change."""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from coordinator.dispatch.dispatcher import Dispatcher
from swarm.dispatch_map import decode_dispatch_map
from swarm.errors import ConfigError, SwarmError

__all__ = ["watch_dispatch_map_file"]

log = logging.getLogger(__name__)


async def watch_dispatch_map_file(
    path: Path,
    dispatcher: Dispatcher,
    *,
    interval_s: float = 0.25,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Follow ``--dispatch-map FILE``: re-read and adopt it whenever its contents change."""
    last: bytes | None = None
    first = True
    while True:
        try:
            data = await trio.Path(path).read_bytes()
        except OSError as exc:
            if first:
                raise ConfigError(f"cannot read dispatch map {path}: {exc}") from exc
            data = last or b""
        if data != last:
            last = data
            try:
                m = decode_dispatch_map(data)
                if not dispatcher.set_map(m):
                    log.warning("ignoring %s: version %d is older than the current map", path, m.version)
            except SwarmError as exc:
                if first:
                    raise
                dispatcher.reject_map(f"ignoring the changed dispatch map {path}: {exc}")
        if first:
            first = False
            task_status.started()
        await trio.sleep(interval_s)
