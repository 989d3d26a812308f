"""ggml's pool workers are kept off the computing thread's CPU (swarm/model/kernels/affinity.py)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from swarm.model.kernels import ggml as G
from swarm.model.kernels.affinity import WorkerPlacement, started_threads

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place threads apart")

_getcpu = ctypes.CDLL(None).sched_getcpu


def test_started_threads_finds_exactly_the_new_ones() -> None:
    stop = threading.Event()

    def spawn() -> list[threading.Thread]:
        ts = [threading.Thread(target=stop.wait) for _ in range(3)]
        for t in ts:
            t.start()
        return ts

    ts, tids = started_threads(spawn)
    try:
        assert tids == {t.native_id for t in ts}
    finally:
        stop.set()
        for t in ts:
            t.join()


def test_a_pool_of_two_has_its_worker_placed_off_the_callers_cpu() -> None:
    seen: dict[str, object] = {}

    def run() -> None:  # a fresh thread: a fresh pool (pools are per calling thread)
        pool, _lock = G._threadpool(2, 0)
        placement = G._PLACEMENT[pool]
        assert placement.active and len(placement.workers) == 1
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux): it cannot move between the two reads
        placement.before_compute()  # what every compute on the pool does first
        seen["cpu"] = _getcpu()
        assert seen["cpu"] == cpu
        seen["mask"] = os.sched_getaffinity(placement.workers[0])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["cpu"] not in seen["mask"]  # type: ignore[operator]
    assert seen["mask"]


def test_placement_refuses_a_thread_count_that_does_not_match() -> None:
    me = threading.get_native_id()
    p = WorkerPlacement({me, me + 1}, 1)  # two "new" threads for a one-worker pool: maybe not ggml's
    assert not p.active
    p.before_compute()  # nothing to place, nothing raised
    assert os.sched_getaffinity(me) == os.sched_getaffinity(0)
