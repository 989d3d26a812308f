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


def _cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat") as fh:  # time on a CPU, in ns (stat's ticks are 10 ms)
        return int(fh.read().split()[0])


def test_rested_workers_stop_spinning_until_the_next_graph() -> None:
    """``rest_workers``: a pool that spins for its next graph (poll > 0) sleeps from the call on, and the
    next compute on it wakes it with the same bits (what a coordinator does before it waits on volunteers).
    The worker's CPU time is read over the 5 ms after each of 10 graphs: poll 100 spins for tens of ms at the
    least (131072 x 100 ``pause`` instructions, a few to ~140 cycles each by CPU), so it spins through each
    window -- unless rested."""
    import numpy as np

    seen: dict[str, object] = {}
    rng = np.random.default_rng(3)
    w = G.quantize((rng.standard_normal((256, 512)) * 0.02).astype(np.float32), "Q8_0")
    x = rng.standard_normal((64, 512)).astype(np.float32)

    def run() -> None:  # a fresh thread: pools of its own
        mm = G.GgmlMatmul(w, "Q8_0", 256, 512, n_threads=2, poll=100)
        placement = G._PLACEMENT[G._threadpool(2, 100)[0]]
        assert len(placement.workers) == 1
        worker = placement.workers[0]
        # this thread's spinning pools (an ident may be a finished thread's, whose pools stay keyed by it)
        seen["spinning_pools"] = len([k for k in G._POOLS if k[2] == threading.get_ident() and k[0] > 1 and k[1] > 0])
        seen["first"] = mm(x)
        spinning = resting = 0
        paused = []
        for _ in range(10):
            mm(x)
            a = _cpu_ns(worker)
            threading.Event().wait(0.005)
            spinning += _cpu_ns(worker) - a
            seen["again"] = mm(x)  # a paused pool's next compute resumes it
            paused.append(G.rest_workers())
            a = _cpu_ns(worker)
            threading.Event().wait(0.005)
            resting += _cpu_ns(worker) - a
        seen["spinning"], seen["resting"], seen["paused"] = spinning / 1e9, resting / 1e9, paused

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert set(seen["paused"]) == {seen["spinning_pools"]} and seen["spinning_pools"] >= 1, seen  # type: ignore[arg-type]
    assert seen["spinning"] >= 0.025, seen  # the worker spun for most of the 10 x 5 ms after graphs
    assert seen["resting"] <= 0.01, seen  # ... and after the rest it slept
    assert np.array_equal(seen["first"], seen["again"])  # type: ignore[arg-type]


def test_rest_workers_leaves_other_threads_pools_and_non_spinning_ones_alone() -> None:
    def spinning_pools() -> int:  # this thread's (an ident may be a finished thread's, with its pools)
        return len([k for k in G._POOLS if k[2] == threading.get_ident() and k[0] > 1 and k[1] > 0])

    got: list[tuple[int, int]] = []

    def run() -> None:
        before = spinning_pools()
        G._threadpool(2, 0)  # poll 0: never spins
        G._threadpool(1, 1)  # one thread: no worker
        got.append((before, G.rest_workers()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got[0][1] == got[0][0]  # the two new pools were not counted
    assert G.rest_workers() == spinning_pools()  # only the calling thread's own
