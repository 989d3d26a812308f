"""Callbacks from a compute thread to a trio loop, without the compute thread giving up the interpreter lock.

Rules:
- ``TrioToken.run_sync_soon`` wakes the loop by writing to a socket: a system call, during which the
  calling thread releases Python's interpreter lock. When the trio thread is runnable (it has just been
  woken, or has streams to serve) it takes the lock then, and the calling thread waits for it to come back:
  the trio thread's whole burst of Python. Measured on the engine thread (bench model, one session, 2
  cores): 0.21 ms a token inside ``run_sync_soon``, with the graph compute 7.0 ms.
- A ``Courier`` takes the callback on a queue instead (``queue.SimpleQueue.put`` wakes a waiting thread
  without releasing the lock) and its own thread makes the ``run_sync_soon`` call. That thread needs the
  lock to run, so it gets it the next time the compute thread releases it anyway: when ggml's graph
  starts (its compute releases the lock for milliseconds), or when it waits. The trio thread's work then
  overlaps the graph instead of delaying it.
- Order is kept: callbacks run on the trio thread in the order they were posted (what arrives together
  runs in one ``run_sync_soon``). ``close`` (any thread but the courier's) hands over what is queued and
  ends the thread; a loop that has finished drops what is left (as ``run_sync_soon`` would refuse it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["Courier"]

_Item = tuple[Callable[..., object], tuple[Any, ...]]


def _run_all(items: list[_Item]) -> None:
    for fn, args in items:
        fn(*args)


class Courier:
    def __init__(self, token: trio.lowlevel.TrioToken, *, name: str = "courier") -> None:
        self._token = token
        self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)`` for the trio thread (never blocks, never releases the lock)."""
        self._q.put((fn, args))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._q.get()
            batch = [first]
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not None]
            if items:
                try:
                    self._token.run_sync_soon(_run_all, items)
                except trio.RunFinishedError:
                    pass
            if len(items) < len(batch):  # closed: what was posted before is handed over
                return
