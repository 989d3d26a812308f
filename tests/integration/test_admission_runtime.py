"""``EngineRuntime.admit`` with the real engine thread (the shell around ``coordinator.core.admission``):
``queue`` holds a request until a session ends and then admits it, or refuses it at the hold's bound;
sessions are measured and end with their requests."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio

from coordinator.core.admission import AdmissionPolicy, Reason, Verdict
from coordinator.core.scheduler import Finish, GenParams
from coordinator.engine.runtime import EngineRuntime, OverCapacity, RequestHandle
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer
from swarm.tools.makemodel import make_model

FLOOR = 1e6  # no second session reaches it


def runtime(model: Any, n_ctx: int = 256, **kw: Any) -> EngineRuntime:
    policy = AdmissionPolicy(tps_floor=FLOOR, mode="enforced", settle_tokens=4, settle_s=0.5, **kw)
    return EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=4, n_ctx=n_ctx, admission=policy)


async def finish(h: RequestHandle) -> Finish:
    async for ev in h.events:
        if isinstance(ev, Finish):
            return ev
    raise AssertionError("no Finish")


async def test_queue_holds_until_a_session_ends_then_admits(golden_model: Any) -> None:
    rt = runtime(golden_model, on_saturation="queue", hold_s=60.0)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        first, d1 = await rt.admit([5, 6, 7, 8], GenParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        assert (d1.verdict, d1.reason) == (Verdict.ADMIT, Reason.IDLE)
        ended = trio.Event()

        async def run_first() -> None:
            await finish(first)
            ended.set()

        n.start_soon(run_first)
        second, d2 = await rt.admit([9, 10, 11], GenParams(max_tokens=2, temperature=0.0))
        # held past the first's settle window (measured: one more is below the floor), admitted as it ended:
        # no session was running then (the first's Finish reaches its reader in the same delivery)
        assert d2.reason is Reason.IDLE, d2
        assert first.req_id not in rt.admission.sessions
        with trio.fail_after(5):
            await ended.wait()
        assert (await finish(second)).n_decoded == 2
        assert rt.decisions[("hold", "settling")] == 1 and rt.decisions[("admit", "idle")] == 2
        cap = rt.capacity().capacity
        assert cap.active_sessions == 0 and cap.mean_active_tps is None
        n.cancel_scope.cancel()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> GGUFModel:
    # 2,048 tokens of context: a session that outlives the hold
    return GGUFModel(make_model(arch="qwen3moe", size="small", seed=3, out=tmp_path_factory.mktemp("m") / "small.gguf"))


async def test_queue_refuses_at_the_bound_of_its_hold(small_model: GGUFModel) -> None:
    rt = runtime(small_model, on_saturation="queue", hold_s=0.5, n_ctx=2048)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        first, _ = await rt.admit([5, 6, 7, 8], GenParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
        t0 = time.monotonic()
        with pytest.raises(OverCapacity) as exc:
            await rt.admit([9, 10, 11], GenParams(max_tokens=2, temperature=0.0))
        assert time.monotonic() - t0 >= 0.5  # held for the bound (the settle window inside it), then refused
        assert exc.value.status == 429 and exc.value.code == "over_capacity" and exc.value.retry_after_s >= 2.0
        assert rt.slots()[0].is_processing and rt.capacity().capacity.active_sessions == 1
        assert rt.decisions[("reject", "hold_expired")] == 1
        rt.cancel(first.req_id)
        n.cancel_scope.cancel()
