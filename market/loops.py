"""The market's background tasks (shell: trio tasks around ``market.state.Market``).

- ``run_recruitment_loop``: every ``interval_s`` polls each registered coordinator's ``/slots``
  concurrently; each poll is bounded by ``timeout_s`` (a hung coordinator costs one timeout, never
  the loop's rhythm, and is recorded as a failed poll). Ticks are scheduled on trio's clock, so
  the loop runs under ``trio.testing.MockClock``.
- ``run_housekeeping``: calls ``Market.tick`` every ``tick_s`` and wakes dispatch-map long-polls
  when a map changed. A failing store write is retried at the next tick (logged once per run of
  failures, and when it works again); it never stops the market.
- ``MapWatch``: long-poll support (``GET /api/expert-dispatch-map?after=V&wait_s=S``).

- ``MarketGate``: how the shell touches the market. Unthreaded (SQLite, memory: commits are small and
  local) every call runs on the trio thread. Threaded (PostgreSQL: a call waits on the database, and on
  the other replicas' write lock) a call that may commit runs in a worker thread (``call``), reads and
  runtime updates on the trio thread (``hold``), all under one ``trio.Lock``: one of them at a time, and
  the event loop keeps serving HTTP meanwhile.

Rules: the market object is touched by one task at a time (the gate); ``clock()`` gives the market's
``now`` (wall clock in the service, ``trio.current_time`` in virtual-time tests).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from market.core.recruit import SpeedReport
from market.state import Market
from swarm.errors import SwarmError

__all__ = ["Clock", "MapWatch", "MarketGate", "Poller", "run_housekeeping", "run_recruitment_loop"]

log = logging.getLogger(__name__)

Clock = Callable[[], float]
# coordinator URL -> (busy, slots) or (busy, slots, decode tokens/s of its busy slots[, its speed report]);
# raises SwarmError
Poller = Callable[[str], Awaitable[tuple[int, int] | tuple[int, int, float]
                                   | tuple[int, int, float, SpeedReport | None]]]


_T = TypeVar("_T")


class MarketGate:
    """One market call at a time; in a worker thread when ``threaded`` (module rules)."""

    def __init__(self, threaded: bool = False) -> None:
        self.threaded = threaded
        self._lock = trio.Lock()
        self._limiter = trio.CapacityLimiter(1)

    async def call(self, fn: Callable[[], _T]) -> _T:
        if not self.threaded:
            return fn()
        async with self._lock:
            return await trio.to_thread.run_sync(fn, limiter=self._limiter)

    async def hold(self, fn: Callable[[], _T]) -> _T:
        if not self.threaded:
            return fn()
        async with self._lock:
            return fn()

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        if not self.threaded:
            yield
            return
        async with self._lock:
            yield


class MapWatch:
    """Wakes waiters whenever some dispatch map changed."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``ready()`` or ``timeout_s``; returns ``ready()``."""
        with trio.move_on_after(timeout_s):
            while not ready():
                await self._event.wait()
        return ready()


async def _poll_one(market: Market, poll: Poller, url: str, clock: Clock, timeout_s: float, gate: MarketGate) -> None:
    error = "timeout"
    with trio.move_on_after(timeout_s):
        try:
            got = await poll(url)
        except SwarmError as exc:
            error = f"{exc.code}: {exc.message}"
        else:
            await gate.hold(lambda: market.record_poll(url, got[0], got[1], clock(),
                                                       tps=float(got[2]) if len(got) > 2 else 0.0,
                                                       speed=got[3] if len(got) > 3 else None))
            return
    await gate.hold(lambda: market.record_poll_failure(url, error, clock()))
    log.debug("poll of %s failed: %s", url, error)


async def run_recruitment_loop(
    market: Market,
    poll: Poller,
    *,
    clock: Clock,
    interval_s: float,
    timeout_s: float,
    gate: MarketGate | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    gate = gate if gate is not None else MarketGate()
    timeout_s = min(timeout_s, interval_s)
    while True:
        deadline = trio.current_time() + interval_s
        async with trio.open_nursery() as nursery:
            for url in list(market.ix.coordinators):
                nursery.start_soon(_poll_one, market, poll, url, clock, timeout_s, gate)
        await trio.sleep_until(deadline)


async def run_housekeeping(
    market: Market,
    watch: MapWatch,
    *,
    clock: Clock,
    tick_s: float,
    gate: MarketGate | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    gate = gate if gate is not None else MarketGate()
    failing = False
    while True:
        try:
            rep = await gate.call(lambda: market.tick(clock()))
        except SwarmError as exc:
            if not failing:  # once per outage (a database down for minutes would log every tick)
                log.exception("market tick failed; retrying at every tick")
            else:
                log.debug("market tick failed again: %s", exc)
            failing = True
        else:
            if failing:
                log.warning("market tick works again")
            failing = False
            if rep.changed_maps:
                watch.notify()
        await trio.sleep(tick_s)
