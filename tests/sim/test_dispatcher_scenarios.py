"""The dispatcher end to end under virtual time: the real shell (``coordinator.dispatch.dispatcher``) and core,
the real expert stream client and server (``swarm.rpc``) on the in-memory fake network, a
synchronous fake kernel on both sides (the same function, so hedges must not change bits), and
local and remote compute that take virtual time (``trio.sleep``), so the assertions on virtual
time are exact: a real kernel on a worker thread under a jumping clock would time out."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import trio
import trio.testing

from coordinator.core.dispatch import DispatchConfig, Reason
from coordinator.dispatch.dispatcher import Dispatcher, LocalJob
from swarm.dispatch_map import DispatchMap
from swarm.p2p.memory import FakeNetwork, open_fake_transport
from swarm.p2p.transport import Stream
from swarm.protocol.expert import V1_PROTOCOL_ID, ExpertRequest
from tests.sim.support import (
    HALVES,
    LATENCY_S,
    LOCAL_S_PER_PAIR,
    NO_SAMPLING,
    Load,
    Swarm,
    decisions,
    delta,
    dmap,
    fake_kernel,
    routing,
    settled,
    step,
    wait_sample,
    worker,
)

# --------------------------------------------------------------------------------------------------


async def test_idle_then_load_then_idle(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    vol = await sw.volunteer("w1")
    m = dmap({k: ["w1"] for k in HALVES})
    load = Load(busy=1)
    async with sw.coordinator(load_probe=load, config=DispatchConfig(serve_ttl_s=20.0, **NO_SAMPLING)) as d:
        d.set_map(m)
        # idle (1 busy slot < threshold 2): the experts the coordinator holds run here
        for i in range(4):
            await step(d, m, layer=i % 2, seed=i)
        assert decisions(d) == {Reason.IDLE_LOCAL.value: 8}
        assert vol.calls == [] and d.report().load_state == "idle"
        assert worker(d, "w1")["proven"] is False

        # load: the unproven worker gets one hedged trial (remote and local at once; the local result is
        # used, the remote one compared when it comes)
        load.busy = 3
        await wait_sample(d)
        assert d.report().load_state == "loaded"
        before = decisions(d)
        await step(d, m, seed=10)
        got = delta(decisions(d), before)
        assert got[Reason.TRIAL_HEDGE.value] == 2  # its SendRemote and its RunLocal
        await settled(d)
        assert worker(d, "w1")["proven"] is True and len(vol.calls) == 1 and d.core.verified_equal == 1
        # then the two halves split between the worker and the coordinator by earliest finish
        before = decisions(d)
        rows_before = [(L.local_rows, L.remote_rows) for L in d.report().layers]
        durations = [await step(d, m, layer=i % 2, seed=20 + i) for i in range(6)]
        got = delta(decisions(d), before)
        assert got.get(Reason.LOAD_EARLIEST_FINISH_REMOTE.value, 0) == 6
        assert got.get(Reason.LOAD_EARLIEST_FINISH_LOCAL.value, 0) == 6
        rows = [
            (L.local_rows - a, L.remote_rows - b)
            for L, (a, b) in zip(d.report().layers, rows_before, strict=True)
        ]
        assert all(local == remote == 3 * 8 for local, remote in rows)
        # both shares ran at once: a step lasts the local half's 8 ms, not local + remote
        local_ms = 8 * LOCAL_S_PER_PAIR
        assert all(local_ms - 1e-9 <= t < local_ms + 1e-3 for t in durations), durations

        # the load ends: proven work goes on for the serve TTL (hysteresis) ...
        load.busy = 0
        await wait_sample(d)
        assert d.report().load_state == "serve_ttl"
        before, calls = decisions(d), len(vol.calls)
        await step(d, m, seed=40)
        assert delta(decisions(d), before) == {Reason.SERVE_TTL.value: 2}
        assert len(vol.calls) == calls + 1
        # ... then everything is local again
        await trio.sleep(20.0)
        assert d.report().load_state == "idle"
        before, calls = decisions(d), len(vol.calls)
        await step(d, m, seed=50)
        assert delta(decisions(d), before) == {Reason.IDLE_LOCAL.value: 2}
        assert len(vol.calls) == calls
        states = [c.state for c in d.report().mode_changes]
        assert states == ["loaded", "serve_ttl", "idle"]
        assert [c.reason for c in d.report().mode_changes] == ["load_onset", "load_ended", "ttl_expired"]
        assert d.report().errors == [] and worker(d, "w1")["failures"] == 0


SPLIT_CHECK = {"verify_rate": 0.0, "verify_probation_calls": 0, "split_check_s": 0.2, "split_hold_s": 5.0,
               "probe_interval_s": 0.0}


async def run_until_checked(d: Dispatcher, m: DispatchMap, load: Load) -> tuple[dict[str, int], int]:
    """Steps under load until the split check has decided; returns the decisions made meanwhile and
    the number of steps (each asserts the all-local bits)."""
    before, n = decisions(d), 0
    while not any(c.reason in ("split_faster", "split_slower") for c in d.report().mode_changes):
        await step(d, m, layer=n % 2, seed=100 + n)
        n += 1
        assert n < 500, "the split check never decided"
    return delta(decisions(d), before), n


async def test_the_split_check_keeps_remote_shares_that_pay(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    vol = await sw.volunteer("w1")
    m = dmap({k: ["w1"] for k in HALVES})
    load = Load(busy=4)
    async with sw.coordinator(load_probe=load, config=DispatchConfig(**SPLIT_CHECK)) as d:
        d.set_map(m)
        await trio.sleep(0.01)  # the first sample: loaded
        await step(d, m)  # the trial
        await settled(d)
        assert worker(d, "w1")["proven"] is True
        got, _ = await run_until_checked(d, m, load)
        # the local windows kept both halves here; the split window sent one half (8 ms a layer, not 16)
        assert got[Reason.SPLIT_CHECK.value] > 0 and got[Reason.LOAD_EARLIEST_FINISH_REMOTE.value] > 0
        [c] = [c for c in d.report().mode_changes if c.reason == "split_faster"]
        assert c.state == "loaded" and "split for 5 s" in c.detail
        rep = d.report()
        assert (rep.split_arm, rep.split_checking) == ("split", False)
        assert rep.split_rate == pytest.approx(2 * rep.local_rate, rel=0.1)
        # kept: earliest finish splits every layer from now on
        before, calls = decisions(d), len(vol.calls)
        for i in range(4):
            assert await step(d, m, layer=i % 2, seed=300 + i) < 8 * LOCAL_S_PER_PAIR + 1e-3
        assert delta(decisions(d), before) == {Reason.LOAD_EARLIEST_FINISH_REMOTE.value: 4,
                                               Reason.LOAD_EARLIEST_FINISH_LOCAL.value: 4}
        assert len(vol.calls) == calls + 4


async def test_the_split_check_keeps_work_here_when_remote_shares_slow_it(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A volunteer as fast as the coordinator (1 ms a pair) whose calls cost the coordinator's own kernel
    half its speed while they are in flight (the protocol's work on its cores, or a volunteer on the
    same machine). The estimates favour a split (9 ms remote against 16 ms for the second half here);
    the measured rate shows it gains nothing."""
    box: list[Dispatcher] = []

    async def as_fast(req: ExpertRequest) -> float | None:  # on top of the volunteer's 0.5 ms a pair
        return 0.5 * LOCAL_S_PER_PAIR * int(req.n_pairs)

    async def shared_cores(job: LocalJob) -> np.ndarray:
        slow = 2.0 if box and box[0].core.table.workers["w1"].in_flight else 1.0
        await trio.sleep(LOCAL_S_PER_PAIR * int(job.pair_rows.shape[0]) * slow)
        return fake_kernel(job)

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    vol = await sw.volunteer("w1", as_fast)
    m = dmap({k: ["w1"] for k in HALVES})
    load = Load(busy=4)
    async with sw.coordinator(load_probe=load, config=DispatchConfig(**SPLIT_CHECK), local_runner=shared_cores) as d:
        box.append(d)
        d.set_map(m)
        await trio.sleep(0.01)
        await step(d, m)  # the trial
        await settled(d)
        got, _ = await run_until_checked(d, m, load)
        assert got[Reason.LOAD_EARLIEST_FINISH_REMOTE.value] > 0  # the split window did split
        [c] = [c for c in d.report().mode_changes if c.reason == "split_slower"]
        assert "local for 5 s" in c.detail and d.report().split_arm == "local"
        # held: every range here, no calls, for the hold
        before, calls = decisions(d), len(vol.calls)
        for i in range(6):
            assert await step(d, m, layer=i % 2, seed=400 + i) == pytest.approx(16 * LOCAL_S_PER_PAIR)
        assert delta(decisions(d), before) == {Reason.SPLIT_SLOWER.value: 12}
        assert len(vol.calls) == calls
        # the hold passes: the next loaded layer starts a new check (its first window: local)
        await trio.sleep(5.0)
        before = decisions(d)
        await step(d, m, seed=500)
        assert delta(decisions(d), before) == {Reason.SPLIT_CHECK.value: 2}


async def test_worker_that_never_serves(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    async def hang(req: ExpertRequest) -> float | None:
        await trio.sleep_forever()
        raise AssertionError

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    vol = await sw.volunteer("mute", hang)
    m = dmap({k: ["mute"] for k in HALVES})
    async with sw.coordinator(load_probe=Load(busy=4), timeout_s=3.0, config=DispatchConfig(split_check_s=0.0)) as d:
        d.set_map(m)
        await trio.sleep(0.01)  # the first sample
        # its trial: the local copy answers the step, the hanging call does not hold it up
        assert await step(d, m) < 0.05
        assert len(vol.calls) == 1
        # not proven: the next steps are local, while the trial waits out its deadline
        before = decisions(d)
        for i in range(3):
            assert await step(d, m, seed=i + 1) < 0.05
        assert delta(decisions(d), before) == {Reason.LOAD_EARLIEST_FINISH_LOCAL.value: 6}
        await trio.sleep(3.0)
        assert worker(d, "mute") == {
            "state": "down",
            "calls": 0,
            "proven": False,
            "failures": 1,
            "last_serve_ms": 0,
            "last_error": worker(d, "mute")["last_error"],
        }
        [err] = d.report().errors
        assert (err.peer, err.layer, err.lo, err.reason) == ("mute", 0, 0, "timeout")
        assert len(vol.calls) == 1  # it never got another call


async def test_slow_worker_is_hedged(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    slow = trio.Event()

    async def maybe_slow(req: ExpertRequest) -> float | None:
        return 2.5 if slow.is_set() else 0.0

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    await sw.volunteer("w1", maybe_slow)
    m = dmap({k: ["w1"] for k in HALVES})
    cfg = DispatchConfig(hedge_floor_s=0.05, timeout_s=3.0, max_hedge_losses=3, **NO_SAMPLING)
    async with sw.coordinator(load_probe=Load(busy=4), config=cfg) as d:
        d.set_map(m)
        await trio.sleep(0.01)
        for i in range(3):
            await step(d, m, seed=i)  # trial, then splits: proven, a few fast latencies
        assert worker(d, "w1")["proven"] is True
        slow.set()
        before = decisions(d)
        # the slow call is raced against the local copy after the hedge floor (its p95 is below it)
        t = await step(d, m, seed=7)
        assert 0.05 <= t < 0.05 + 8 * LOCAL_S_PER_PAIR + 1e-3, t
        got = delta(decisions(d), before)
        assert got[Reason.HEDGE_SLOW.value] == 1 and got[Reason.LOST_RACE.value] == 1
        # the lost hedge counted as a 50 ms latency: its estimate now loses to the local copy
        before = decisions(d)
        for i in range(2):
            assert await step(d, m, seed=8 + i) <= 2 * 8 * LOCAL_S_PER_PAIR + 1e-9
        assert delta(decisions(d), before) == {Reason.LOAD_EARLIEST_FINISH_LOCAL.value: 4}
        assert worker(d, "w1")["state"] == "up" and d.report().errors == []


async def test_worker_failing_mid_step(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    net = FakeNetwork(latency_s=LATENCY_S)
    sw = Swarm(nursery, net)

    async def pause(req: ExpertRequest) -> float | None:
        return 0.02

    await sw.volunteer("w1", pause)
    w2 = await sw.volunteer("w2")
    # layer 0: the coordinator does not hold experts 0-3 (remote only: w1, then w2); 4-7 only w1
    m = dmap({(0, 0, 4): ["w1", "w2"], (0, 4, 8): ["w1"]})
    cfg = DispatchConfig(timeout_s=3.0, hedge_floor_s=1.0, **NO_SAMPLING)
    async with sw.coordinator(load_probe=Load(busy=4), config=cfg, held=lambda layer, lo, hi: lo != 0) as d:
        d.set_map(m)
        await trio.sleep(0.01)
        await step(d, m, seed=1)  # w1 serves 0-3 (not held) and has its trial on 4-7
        await settled(d)  # the trial's answer is compared after the step (the local copy was its result)
        assert worker(d, "w1")["proven"] is True and w2.calls == []
        before = decisions(d)
        async with trio.open_nursery() as n:
            n.start_soon(step, d, m, 0, 2)
            await trio.sleep(0.005)  # both calls are in flight on w1
            net.partition("coordinator", "w1")  # its connection dies
        got = delta(decisions(d), before)
        assert got[Reason.NOT_HELD.value] == 1 and got[Reason.RETRY_NEXT.value] == 1  # 0-3: on to w2
        assert (
            got.get(Reason.FALLBACK_LOCAL.value, 0) + got.get(Reason.LOAD_EARLIEST_FINISH_LOCAL.value, 0) == 1
        )
        assert len(w2.calls) == 1 and w2.calls[0].attempt == 1  # the range's second attempt
        w = worker(d, "w1")
        assert w["state"] == "down" and w["failures"] == 1 and w["proven"] is False
        errs = d.report().errors
        assert {(e.peer, e.layer, e.lo, e.hi, e.attempt) for e in errs} >= {("w1", 0, 0, 4, 0)}
        assert all(e.reason in ("broken", "closed") for e in errs)
        assert d.report().errors_total == len(errs)
        # while w1 is down and nothing else holds 0-3 but w2, the next steps use w2
        await step(d, m, seed=3)
        assert len(w2.calls) == 2


async def test_stale_answer_of_an_old_attempt_is_ignored(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    first = [True]

    async def slow_garbage_once(req: ExpertRequest) -> float | None:
        if first[0]:
            first[0] = False
            await trio.sleep(0.5)
            return None  # ... then a wrong answer, after the range was answered elsewhere
        return 0.0

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    a = await sw.volunteer("a", slow_garbage_once)
    a.uninterruptible = True  # so the coordinator's Cancel does not stop it: its answer does come
    b = await sw.volunteer("b")
    m = dmap({(0, 0, 4): ["a", "b"], (0, 4, 8): ["a", "b"]})
    # hedging under test: no verification samples (they would add a second replica's check)
    cfg = DispatchConfig(timeout_s=0.2, hedge_floor_s=0.05, **NO_SAMPLING)
    async with sw.coordinator(config=cfg, held=lambda layer, lo, hi: False) as d:
        d.set_map(m)
        # 0-3 goes to a (attempt 0); its hedge after half the timeout goes to b (attempt 1): b wins
        t = await step(d, m, seed=1)
        assert 0.1 <= t < 0.11, t
        assert (a.calls[0].lo, a.calls[0].attempt) == (0, 0)
        assert (0, 1) in [(r.lo, r.attempt) for r in b.calls]
        assert decisions(d)[Reason.HEDGE_SLOW.value] == 1
        # a's answer of attempt 0 arrives after that: nobody waits for it, nothing changes
        await trio.sleep(0.5)
        assert a.answered == len(a.calls) == 1
        await step(d, m, seed=2)  # and the next step's bits are right too
        assert d.report().errors == [] and worker(d, "a")["failures"] == 0


async def test_a_hedges_loser_is_cancelled_on_the_volunteer(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The core's Cancel reaches the volunteer as a v2 Cancel frame: its computation stops."""

    async def slow(req: ExpertRequest) -> float | None:
        return 0.5 if req.lo == 0 else 0.0

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    a = await sw.volunteer("a", slow)
    b = await sw.volunteer("b")
    m = dmap({(0, 0, 4): ["a", "b"], (0, 4, 8): ["b"]})
    # hedging under test: no verification samples (they would add a second replica's check)
    cfg = DispatchConfig(timeout_s=0.2, hedge_floor_s=0.05, **NO_SAMPLING)
    async with sw.coordinator(config=cfg, held=lambda layer, lo, hi: False) as d:
        d.set_map(m)
        t = await step(d, m, seed=1)  # 0-3: a is slow, its hedge on b wins after 0.1 s
        assert 0.1 <= t < 0.11, t
        assert decisions(d)[Reason.HEDGE_SLOW.value] == 1
        await trio.sleep(0.01)  # the Cancel frame crosses the link
        assert (a.cancelled, a.answered) == (1, 0)  # dropped on the volunteer, never computed out
        await trio.sleep(1.0)
        assert a.answered == 0
        assert d.report().errors == [] and worker(d, "a")["failures"] == 0
        assert d.peers.clients["a"].cancels_sent == 1
        assert [(r.lo, r.attempt) for r in b.calls] == [(4, 0), (0, 1)]  # 4-7, then the hedge of 0-3


async def test_a_v1_peer_is_refused_and_the_layer_runs_elsewhere(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A volunteer that only speaks ``/moe-swarm/expert/1`` (an old version, listed by a stale or
    static map) cannot be dialled on v2: the call fails as a dial error, the worker is marked down,
    and the layer is computed by the next replica and the coordinator, bits unchanged."""
    net = FakeNetwork(latency_s=LATENCY_S)
    sw = Swarm(nursery, net)
    spoken: list[str] = []

    async def old(task_status: trio.TaskStatus[None]) -> None:
        async with open_fake_transport(net, peer_id="old") as t:

            async def v1_only(stream: Stream) -> None:
                spoken.append("v1")
                await stream.aclose()

            t.set_stream_handler(V1_PROTOCOL_ID, v1_only)
            task_status.started()
            await trio.sleep_forever()

    await nursery.start(old)
    new = await sw.volunteer("new")
    m = dmap({(0, 0, 4): ["old", "new"], (0, 4, 8): ["old"]})
    cfg = DispatchConfig(timeout_s=3.0, verify_probation_calls=0)  # its answers used at once (verification: its own tests)
    async with sw.coordinator(load_probe=Load(busy=4), config=cfg, held=lambda layer, lo, hi: lo != 0) as d:
        d.set_map(m)
        await trio.sleep(0.01)
        assert await step(d, m, seed=1) < 0.05  # 0-3 on "new" after "old" failed; 4-7 here
        w = worker(d, "old")
        assert w["state"] == "down" and w["calls"] == 0 and w["failures"] >= 1
        assert "does not speak /moe-swarm/expert/2" in str(w["last_error"])
        assert {e.reason for e in d.report().errors if e.peer == "old"} == {"dial_failed"}
        assert len(new.calls) == 1 and spoken == []  # the v2 dial never reached the v1 handler
        await step(d, m, seed=2)  # while it is down, nothing is sent to it
        assert worker(d, "old")["failures"] == w["failures"]


async def test_not_held_without_replica_fails(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    from swarm.errors import DispatchFailed

    async with sw.coordinator(held=lambda layer, lo, hi: lo != 0) as d:
        d.set_map(dmap({(0, 4, 8): []}))
        x, ids, w = routing()
        with pytest.raises(DispatchFailed, match="layer 0 experts 0-4"):
            await d.dispatch_layer(0, x.numpy(), ids.numpy(), w.numpy())
        assert decisions(d)[Reason.NO_REPLICA.value] == 1


async def test_hung_load_probe_never_blocks_dispatch(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    release = threading.Event()
    first_done = threading.Event()
    calls = [0]

    def probe() -> tuple[int, int]:
        calls[0] += 1
        if calls[0] > 1:
            release.wait(30)  # hangs (a thread the sampler abandons after its bound)
        else:
            first_done.set()
        return 4, 4

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    await sw.volunteer("w1")
    m = dmap({k: ["w1"] for k in HALVES})
    try:
        # the first sample comes from a real thread: virtual time stands still until it is in (a jumping
        # clock would time the sample out before a busy machine has even run the thread)
        clock.autojump_threshold = math.inf
        async with sw.coordinator(
            load_probe=probe, probe_in_thread=True, config=DispatchConfig(serve_ttl_s=5.0)
        ) as d:
            d.set_map(m)
            assert await trio.to_thread.run_sync(first_done.wait, 30)
            for _ in range(10_000):  # the thread's result reaches the loop through its wake-up: real-time waits
                if d.report().busy is not None:
                    break
                await trio.to_thread.run_sync(time.sleep, 0.001)
            assert d.report().load_state == "loaded"
            clock.autojump_threshold = 0
            await trio.sleep(2.5)  # the second sample hangs: the last one holds until it ages out
            assert d.report().load_state == "loaded"
            assert await step(d, m) < 0.05
            await trio.sleep(4.0)  # 6.5 s since the good sample: aged out
            rep = d.report()
            assert rep.load_state == "serve_ttl" and rep.load_samples_failed >= 2
            await step(d, m, seed=1)
    finally:
        release.set()


# -- experts nobody serves (--local-experts, --on-missing) -----------------------------------------


async def test_a_layer_waits_for_missing_experts_and_runs_once_a_volunteer_is_listed(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """``--on-missing wait``: a backbone coordinator's layer routed to experts nobody serves waits (the
    map may bring a replica) instead of failing; it runs as soon as one is listed, bits unchanged."""
    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    await sw.volunteer("a")
    m = dmap({k: ["a"] for k in HALVES})
    async with sw.coordinator(config=DispatchConfig(**NO_SAMPLING), held=lambda layer, lo, hi: False,
                              missing_wait_s=30.0) as d:
        assert d.holes(trio.current_time()) == 2  # no map yet: each layer is one range nobody serves
        done: list[float] = []

        async def layer0() -> None:
            done.append(await step(d, m, seed=3))

        async with trio.open_nursery() as n:
            n.start_soon(layer0)
            await trio.sleep(5.0)
            assert not done and d.missing_waits == 1  # waiting, not failed
            d.set_map(m)  # a volunteer is listed: the layer is retried at once
        assert done and 5.0 <= done[0] < 5.5 and d.missing_failed == 0
        assert d.holes(trio.current_time()) == 0


async def test_a_layer_fails_after_the_wait_and_disk_mode_computes_it_here(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    from swarm.errors import DispatchFailed

    sw = Swarm(nursery, FakeNetwork(latency_s=LATENCY_S))
    m = dmap({})
    async with sw.coordinator(config=DispatchConfig(**NO_SAMPLING), held=lambda layer, lo, hi: False,
                              missing_wait_s=2.0) as d:
        d.set_map(m)
        t0 = trio.current_time()
        with pytest.raises(DispatchFailed, match="experts 0-8"):
            await step(d, m, seed=1)
        assert 2.0 <= trio.current_time() - t0 < 2.6 and (d.missing_waits, d.missing_failed) == (1, 1)
    async with sw.coordinator(config=DispatchConfig(missing_disk=True, **NO_SAMPLING),
                              held=lambda layer, lo, hi: False) as d:
        d.set_map(m)
        await step(d, m, seed=1)  # computed here from the model: the all-local bits
        assert decisions(d)[Reason.MISSING_DISK.value] >= 1
