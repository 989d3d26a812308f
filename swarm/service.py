"""Running a role's service from the command line (shell): signals, exit codes, flag adapters.

Rules:
- Every long-running command is a trio service run under a signal-aware cancel scope: SIGINT or
  SIGTERM triggers a graceful shutdown (drain, deregister) instead of a traceback.
- Roles' ``cli`` modules use these helpers (in their ``run``: this module imports trio); only
  ``swarm.cli`` knows every role. ``size_flag`` lives in ``swarm.flags`` (re-exported here).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarm.flags import size_flag

__all__ = ["run_announced", "run_service", "size_flag"]


def run_service(service: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run a trio service until it ends or SIGINT/SIGTERM asks it to stop."""

    async def runner() -> None:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

                async def watch() -> None:
                    async for _ in signals:
                        logging.getLogger("moe-swarm").info("shutting down")
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(watch)
                await service(*args)
                nursery.cancel_scope.cancel()

    trio.run(runner)


def run_announced(serve: Callable[..., Awaitable[Any]], cfg: Any, announce: Callable[[Any], str]) -> None:
    """Run ``serve(cfg, task_status=...)`` and print ``announce(started value)`` once it is up: the
    one "... ready ..." line that scripts (the demo, tests) wait for."""

    async def service() -> None:
        async with trio.open_nursery() as nursery:
            started = await nursery.start(serve, cfg)
            print(announce(started), flush=True)

    run_service(service)
