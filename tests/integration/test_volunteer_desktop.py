"""The volunteer as a guest on a desktop (``volunteer.desktop`` with the pull daemon), in one event loop
with a real market (SQLite) and a real coordinator: ``--only-when-idle`` read from a fake idle source
(the test plays the owner at the keyboard) pauses the volunteer -- the market sees it paused, its slice
draining, out of the dispatch map, not gone -- and once the keyboard rests it serves again. /proc's
reader is checked on a planted /proc, and ``--cpu-limit``'s duty cycle on a timed handler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch
import trio
import trio.testing

from coordinator.server import CoordinatorConfig, serve_coordinator
from market.policy import MarketPolicy
from market.server import MarketConfig, serve_market
from swarm.protocol.market import RecruitmentView, VolunteerCredit
from swarm.rpc.server import Computed
from tests.conftest import GOLDEN_GGUF, eventually
from volunteer.daemon import PullVolunteerConfig, serve_pull_volunteer
from volunteer.desktop import DutyCycle, ProcIdleSource

# the daemon's httpx client is cancelled mid-request at the end (the loop goes down with the test)
pytestmark = [pytest.mark.filterwarnings("ignore:Async generator 'httpx:ResourceWarning"),
              pytest.mark.filterwarnings("ignore:Exception ignored in. <async_generator object ByteStream:"
                                         "pytest.PytestUnraisableExceptionWarning")]

TOKEN = "t0k"
POLICY = MarketPolicy(proof_grace_s=0.0, heartbeat_ttl_s=4.0)


class Keyboard:
    """A fake idle source: an input counter the test moves, other programs idle."""

    def __init__(self) -> None:
        self.presses = 0
        self.reads = 0

    def read(self) -> tuple[int | None, float | None]:
        self.reads += 1
        return self.presses, 0.0


async def test_only_when_idle_pauses_while_the_owner_types_and_the_market_sees_it(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    market = await nursery.start(serve_market, MarketConfig(db=str(tmp_path / "m.db"), port=0, token=TOKEN,
                                                            poll_interval_s=0.2, tick_s=0.05, policy=POLICY))
    await nursery.start(serve_coordinator, CoordinatorConfig(model=str(GOLDEN_GGUF), port=0, slots=1, market=market,
                                                             token=TOKEN, data_dir=str(tmp_path / "c")))
    keys = Keyboard()
    cfg = PullVolunteerConfig(market=market, data_dir=str(tmp_path / "v"), max_experts=8, poll_interval_s=0.2,
                              progress=False, only_when_idle_s=1.5, idle_sample_s=0.1)
    info = await nursery.start(lambda task_status: serve_pull_volunteer(cfg, idle_source=keys, task_status=task_status))
    peer = info.peer_id
    async with httpx.AsyncClient(base_url=market, timeout=10) as h:
        async def volunteer() -> VolunteerCredit | None:
            r = await h.get(f"/api/volunteers/{peer}")
            return msgspec.json.decode(r.content, type=VolunteerCredit) if r.status_code == 200 else None

        async def worker() -> Any:
            view = msgspec.json.decode((await h.get("/api/moe/recruitment")).content, type=RecruitmentView)
            return next((w for m in view.models for w in m.workers if w.peer_id == peer), None)

        async def state(paused: str, slice_state: str) -> bool:
            v, w = await volunteer(), await worker()
            return v is not None and v.paused == paused and w is not None and w.paused == paused and \
                all(s.state == slice_state for s in w.slices) and bool(w.slices)

        # nothing is known of the keyboard before the first reading: it waits 1.5 s of quiet, then serves
        await eventually(lambda: state("", "dispatched"), within=60, interval=0.1)
        assert keys.reads > 10

        # the owner types: paused, its slice draining (out of the map), still a volunteer of the market
        typing = trio.Event()

        async def type_until_told() -> None:
            while not typing.is_set():
                keys.presses += 1
                await trio.sleep(0.05)

        nursery.start_soon(type_until_told)
        await eventually(lambda: state("user_active", "draining"), within=10, interval=0.05)
        model_id = (await h.get("/api/moe/recruitment")).json()["models"][0]["model_id"]

        async def unmapped() -> bool:  # coordinators no longer send it calls
            r = await h.get("/api/expert-dispatch-map", params={"model": model_id},
                            headers={"authorization": f"Bearer {TOKEN}"})
            return r.status_code == 200 and peer not in r.text

        await eventually(unmapped, within=5, interval=0.05)
        events = (await h.get("/api/events")).json()["events"]
        assert any(e["kind"] == "paused" and e["peer_id"] == peer and e["detail"] == "user_active" for e in events)
        # typing for longer than the heartbeat TTL (4 s): paused all along, never expired
        until = trio.current_time() + 5
        while trio.current_time() < until:
            assert await state("user_active", "draining")
            await trio.sleep(0.25)

        # the keyboard rests: after 1.5 s of quiet it serves again
        typing.set()
        await eventually(lambda: state("", "dispatched"), within=15, interval=0.1)
        assert not (tmp_path / "v" / "paused").exists()  # no manual pause was involved


def test_proc_idle_source_reads_input_interrupts_and_others_cpu(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    interrupts = """           CPU0       CPU1
  1:         {k}          3   IO-APIC   1-edge      i8042
  8:          0          0   IO-APIC   8-edge      rtc0
 12:        {m}          7   IO-APIC  12-edge      i8042
 16:      99999      99999   IO-APIC  16-fasteoi   ehci_hcd:usb1
NMI:          0          0   Non-maskable interrupts
"""

    def write(k: int, m: int, cpu: list[int], own: list[int]) -> None:
        (proc / "interrupts").write_text(interrupts.format(k=k, m=m))
        (proc / "stat").write_text("cpu  " + " ".join(map(str, cpu)) + " 0 0\ncpu0 1 2 3\n")
        fields = ["S", *["0"] * 10, *map(str, own), *["0"] * 30]
        (proc / "self" / "stat").write_text("4242 (python3 (moe)) " + " ".join(fields) + "\n")

    src = ProcIdleSource(proc)
    #           user nice system idle iowait irq softirq steal
    write(10, 20, [100, 0, 50, 800, 50, 0, 0, 0], [10, 5, 0, 0])
    assert src.read() == (10 + 3 + 20 + 7, None)  # the first CPU reading has nothing to compare with
    # 1000 jiffies later: 400 busy of which 300 ours -> others used 100 of 1000
    write(11, 20, [400, 0, 150, 1300, 150, 0, 0, 0], [210, 105, 0, 0])
    count, others = src.read()
    assert count == 41 and others == pytest.approx(0.1)
    (proc / "interrupts").write_text("           CPU0\n  8:   0   IO-APIC   8-edge   rtc0\n")
    assert src.input_count() is None  # no input device: not known (does not pause)
    assert ProcIdleSource(tmp_path / "nothing").read() == (None, None)


async def test_the_cpu_limit_rests_after_each_computation(autojump_clock: trio.testing.MockClock) -> None:
    starts: list[float] = []

    async def compute(*_: Any) -> Computed:
        starts.append(trio.current_time())
        await trio.sleep(0.2)
        return Computed(torch.zeros(1), 0.2)

    limited = DutyCycle(compute, 0.25)  # 0.2 s of work, then 0.6 s of rest: a quarter of the time
    for _ in range(3):
        await limited(None, None, None)  # type: ignore[arg-type]
    assert [round(b - a, 6) for a, b in zip(starts, starts[1:], strict=False)] == [0.8, 0.8]
    # calls that overlap (one batch) share one rest, not one each
    starts.clear()
    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(limited, None, None, None)
    await limited(None, None, None)  # type: ignore[arg-type]
    assert len(set(starts[:3])) == 1 and round(starts[3] - starts[0], 6) == 0.8
