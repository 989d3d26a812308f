"""Preemption by parking with the real engine thread (``EngineRuntime`` around ``AdmissionCore.police`` and
the scheduler's ``park``/``resume``): with a floor no two sessions reach, the most recently admitted
sessions are parked (decode paused, KV kept in the slot), the guaranteed one never is, every parked one
resumes by ``max_park_s``, and every session ends with exactly the tokens of a run that parked nothing."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio

from coordinator.core.admission import AdmissionPolicy, Reason, Verdict
from coordinator.core.scheduler import Emit, Finish, GenParams
from coordinator.engine.runtime import EngineRuntime, OverCapacity
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer
from swarm.tools.makemodel import make_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
N_TOKENS = 240


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GGUFModel:
    # slower than the golden model (which decodes these sessions in 0.1 s): sessions that live for seconds
    return GGUFModel(make_model(arch="qwen3moe", size="small", seed=3, out=tmp_path_factory.mktemp("m") / "small.gguf"))


def runtime(model: Any, preempt: str) -> EngineRuntime:
    policy = AdmissionPolicy(tps_floor=1e6, mode="enforced", settle_tokens=4, settle_s=0.3, guarantee_min_sessions=1,
                             park_after_s=0.05, max_park_s=0.5, min_run_s=0.2, preempt=preempt)  # type: ignore[arg-type]
    return EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=4, n_ctx=512, admission=policy)


async def run_all(rt: EngineRuntime, watch: Any = None) -> list[list[int]]:
    params = GenParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    out: list[list[int]] = [[] for _ in PROMPTS]

    async def drain(i: int) -> None:
        h = rt.submit(PROMPTS[i], params)
        async for ev in h.events:
            if isinstance(ev, Emit):
                out[i].extend(ev.token_ids)
            elif isinstance(ev, Finish):
                assert ev.n_decoded == N_TOKENS
        assert len(out[i]) == N_TOKENS

    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        async with trio.open_nursery() as users:
            for i in range(len(PROMPTS)):
                users.start_soon(drain, i)
                await trio.lowlevel.checkpoint()
            if watch is not None:
                users.start_soon(watch, rt)
        n.cancel_scope.cancel()
    return out


async def test_parked_sessions_wait_keep_their_kv_and_end_with_an_unparked_runs_tokens(model: GGUFModel) -> None:
    want = await run_all(runtime(model, "off"))
    seen: dict[str, Any] = {"parked": set(), "still": False, "refused": False}

    async def watch(rt: EngineRuntime) -> None:
        first = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            views = [v for v in rt.slots() if v.is_processing]
            if not views:
                return
            if first is None:
                first = min(v.req_id for v in views if v.req_id is not None)
            parked = {v.req_id: v.n_decoded for v in views if v.parked}
            cap = rt.capacity().capacity
            if parked:
                assert first not in parked  # --guarantee-min-sessions 1: the first admitted is never parked
                assert cap.parked_sessions >= 1 and not cap.can_admit
                seen["parked"] |= set(parked)
                # a parked session decodes nothing while it stays parked (the same park: no resume between)
                resumes = rt.admission.resumes_total
                await trio.sleep(0.1)
                after = {v.req_id: v.n_decoded for v in rt.slots() if v.is_processing and v.parked}
                if rt.admission.resumes_total == resumes:
                    for rid, k in parked.items():
                        if rid in after:
                            assert after[rid] == k
                            seen["still"] = True
                if not seen["refused"] and rt.admission.parked():
                    # no new session goes ahead of a parked one
                    d, _ = rt.decide([99, 98, 97])
                    if d.verdict is Verdict.REJECT and d.reason is Reason.PARKED:
                        seen["refused"] = True
            await trio.sleep(0.02)

    rt = runtime(model, "park")
    got = await run_all(rt, watch)
    assert got == want  # nothing lost: the KV kept in place, the same tokens as a run that never parked
    assert seen["parked"] and seen["still"] and seen["refused"], seen
    assert rt.admission.parks_total >= 1 and rt.admission.resumes_total >= 1
    assert not rt.admission.parked() and not rt.sched.parked and not rt.admission.sessions


async def test_a_refused_request_names_the_parked_session(model: GGUFModel) -> None:
    rt = runtime(model, "park")
    params = GenParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        hs = [rt.submit(p, params) for p in PROMPTS[:3]]
        with trio.fail_after(30):
            while not rt.admission.parked():
                with trio.move_on_after(0.5):  # woken by tokens and parks; the deadline bounds a lost wake
                    await rt.wait_changed()
        try:
            await rt.admit([99, 98, 97], GenParams(max_tokens=2))
        except OverCapacity as exc:
            assert exc.status == 429 and "parked" in str(exc)
        else:
            raise AssertionError("admitted ahead of a parked session")
        for h in hs:
            rt.cancel(h.req_id)
        assert not rt.sched.parked and not rt.admission.parked()
        n.cancel_scope.cancel()
