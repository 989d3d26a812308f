"""Keep a ggml threadpool's worker threads off the CPU its calling thread is on (shell over the OS).

Why: ggml's threads meet at spin barriers (``ggml_barrier``: a busy loop, no syscall). A graph
computed on ``n`` threads wakes the pool's sleeping workers (a condvar broadcast) and the calling
thread then spins until they arrive. After the machine idled for a few milliseconds the kernel often
wakes a worker onto the *calling thread's* CPU (the other one looks unavailable: a halted vCPU), where
it waits behind the spinning caller until the scheduler preempts it. Measured on the 2-core VM with
8 expert pairs of the ``small`` shape on 2 threads: 0.28 ms back to back, a median of 10.7-15.9 ms
(max 19.9) when 20 ms pass between calls — every layer of a backbone coordinator under a 20 ms round
trip paid it, on the coordinator's dense graphs and on the volunteer's expert graphs. With the
workers' affinity set to the other CPUs before each compute: 0.63 ms.

Rules:
- The workers' thread ids are the threads that appear while ``ggml_threadpool_new`` runs (listed
  from ``/proc/self/task`` around it, under the caller's pool lock). When that count is not the
  pool's ``n - 1`` (another thread started meanwhile) the pool is left alone: never pin a thread
  that may not be ggml's.
- Before a compute, if the calling thread's CPU changed since the last one, each worker's affinity
  becomes the allowed CPUs (the process's at pool creation: taskset and cpusets are kept) minus that
  CPU. One ``sched_getcpu`` per compute; ``sched_setaffinity`` only when the CPU changed.
- Any OS error turns placement off for that pool (the compute itself never fails because of it).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["WorkerPlacement", "started_threads"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TASKS = "/proc/self/task"

try:
    _sched_getcpu: Callable[[], int] | None = ctypes.CDLL(None, use_errno=True).sched_getcpu
except (OSError, AttributeError):  # not glibc/Linux: nothing to place
    _sched_getcpu = None


def _tasks() -> set[int]:
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return set()


def started_threads(create: Callable[[], T]) -> tuple[T, set[int]]:
    """Run ``create`` and return its result with the ids of the threads that appeared meanwhile."""
    before = _tasks()
    out = create()
    return out, _tasks() - before if before else set()


class WorkerPlacement:
    """A pool's worker threads, kept off the CPU of whoever computes on the pool."""

    def __init__(self, workers: set[int], n_workers: int) -> None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        ok = _sched_getcpu is not None and len(workers) == n_workers > 0 and len(allowed) > 1
        if n_workers > 0 and not ok:
            log.debug("ggml workers not placed (found %d of %d threads, %d CPUs)", len(workers), n_workers, len(allowed))
        self.workers = sorted(workers) if ok else []
        self.allowed = frozenset(allowed)
        self._cpu = -1

    @property
    def active(self) -> bool:
        return bool(self.workers)

    def before_compute(self) -> None:
        """Move the workers off the calling thread's CPU if it is not where it was last time."""
        if not self.workers:
            return
        assert _sched_getcpu is not None
        cpu = int(_sched_getcpu())
        if cpu == self._cpu:
            return
        mask = self.allowed - {cpu} or self.allowed
        try:
            for tid in self.workers:
                os.sched_setaffinity(tid, mask)
        except OSError as exc:
            log.debug("ggml worker placement off: %s", exc)
            self.workers = []
            return
        self._cpu = cpu
