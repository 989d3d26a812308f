"""Case (c) of ``benchmarks/gateway.py``: an admission ramp with a floor (issue 28).

Through the real engine runtime in process (engine thread + scheduler + ``coordinator.core.admission``,
the path the API's requests take: ``EngineRuntime.admit``), greedy sessions that outlive the run:

1. *Fixed choices* (after one warm-up run of N sessions): for each n in 1..N, n sessions at once, no admission; after every session has
   decoded its settle window, each session's tokens over ``window_s`` give its tps; the mean over the
   sessions is ``fixed_mean_tps[n]``.
2. The floor: half-way between ``fixed_mean_tps`` at n = N/2 and N/2 + 1, so the *best fixed choice*
   (the most sessions whose mean stays at the floor) is N/2 unless the machine's noise says otherwise
   (it is computed from the measured curve, not assumed).
3. *Ramp*: ``--tps-floor`` that floor, ``--admission enforced``, ``--on-saturation reject``, default
   settle window (48 tokens / 5 s; the smoke run: 0.5 s). N users arrive one per ``arrival_s``; a
   refused user retries after its ``Retry-After`` (at least ``arrival_s``). Every 0.1 s the coordinator's ``mean_active_tps`` is
   sampled; ``below_floor_longest_s`` is the longest run of samples below the floor with more than one
   session running (one session alone below it is the machine's speed, not an admission's doing);
   ``below_floor_after_admit_longest_s`` the longest of those runs that began within two settle windows of
   an admit (the others: the speed drifting with the sessions unchanged, e.g. other processes' load).
   ``admitted`` is the sessions decoding at the end (running and not parked; a session that decoded its whole
   context has ended); ``decoding_sessions_last_quarter`` their mean over the ramp's last quarter. With
   ``preempt`` park (the default) the coordinator parks sessions while the mean stays below the floor; the
   sessions sampled are the decoding ones. ``trace``: one row a second (sessions, parked, mean active tps,
   decode tokens/s, prompt tokens computed, steps and ms a step, mean context, load average).

Pass: ``below_floor_longest_s <= settle_s`` (one settle window: 48 tokens or ``settle_s``, whichever first,
so at most ``settle_s``) and ``|admitted - best_fixed| <= 1``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from coordinator.core.admission import AdmissionPolicy
from coordinator.core.scheduler import Emit, Finish, GenParams
from coordinator.engine.runtime import EngineFailed, EngineRuntime, OverCapacity, RequestHandle
from swarm.model.gguf import GGUFModel
from swarm.text.tokenizer import Tokenizer

__all__ = ["RampConfig", "run_ramp_case"]


@dataclass(frozen=True)
class RampConfig:
    max_sessions: int = 12
    n_ctx: int = 2048
    window_s: float = 8.0  # fixed choices: the measuring window per n
    arrival_s: float = 1.0  # ramp: one user arrives this often
    ramp_s: float = 120.0  # ramp: how long it runs
    settle_tokens: int = 48
    settle_s: float = 5.0
    sample_s: float = 0.1
    trace_s: float = 1.0  # the per-second trace's period
    preempt: str = "park"  # the ramp's --preempt (off: admission alone, as before parking)


@dataclass
class _Session:
    handle: RequestHandle
    warm_after: int = 1 << 30  # tokens after which ``warm`` is set
    times: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) per delivery
    warm: trio.Event = field(default_factory=trio.Event)
    done: bool = False


async def _drain(s: _Session) -> None:
    n = 0
    async for ev in s.handle.events:
        if isinstance(ev, Emit) and ev.token_ids:
            s.times.append((time.monotonic(), len(ev.token_ids)))
            n += len(ev.token_ids)
            if n > s.warm_after:
                s.warm.set()
        elif isinstance(ev, Finish | EngineFailed):
            break
    s.done = True


def _prompt(i: int, vocab: int) -> list[int]:
    return [(7919 * i + 31 * k) % (vocab - 3) + 3 for k in range(8)]


def _rate(s: _Session, t0: float, t1: float) -> float:
    """Its tokens/s in ``(t0, t1]``: tokens after the first delivery there over the time since it (finer than a
    count over the window when a session decodes a few tokens a second); the count over the window when
    fewer than two deliveries fall in it."""
    inside = [(t, n) for t, n in s.times if t0 < t <= t1]
    if len(inside) < 2:
        return sum(n for _, n in inside) / (t1 - t0)
    return sum(n for _, n in inside[1:]) / (inside[-1][0] - inside[0][0])


async def _fixed(rt: EngineRuntime, n: int, cfg: RampConfig, params: GenParams, vocab: int) -> float:
    """The mean session tps with n sessions at once (module docstring, step 1)."""
    sessions: list[_Session] = []
    async with trio.open_nursery() as nursery:
        for i in range(n):
            s = _Session(rt.submit(_prompt(1000 * n + i, vocab), params), warm_after=cfg.settle_tokens)
            sessions.append(s)
            nursery.start_soon(_drain, s)
        with trio.move_on_after(cfg.settle_s):  # every session past its settle window (tokens or time)
            for s in sessions:
                await s.warm.wait()
        t0 = time.monotonic()
        await trio.sleep(cfg.window_s)
        t1 = time.monotonic()
        tps = [_rate(s, t0, t1) for s in sessions]
        for s in sessions:
            rt.cancel(s.handle.req_id)
        nursery.cancel_scope.cancel()
    return statistics.mean(tps)


def _load_avg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _trace_row(rt: EngineRuntime, t: float, prev: tuple[float, int, int, int], loadavg: float) -> dict[str, Any]:
    """One row of the per-second trace: what the engine did since ``prev`` (t, steps, generated, prompt tokens)."""
    info = rt.capacity()
    cap = info.capacity
    st = rt.stats
    dt = max(t - prev[0], 1e-9)
    steps = st.steps_total - prev[1]
    views = [v for v in rt.slots() if v.is_processing]
    ctx = [v.n_prompt + v.n_decoded for v in views]
    return {"t": round(t, 2), "sessions": cap.active_sessions, "parked": cap.parked_sessions,
            "mean_active_tps": None if cap.mean_active_tps is None else round(cap.mean_active_tps, 3),
            "decode_tps": round((st.generated_tokens_total - prev[2]) / dt, 2),
            "prefill_tokens": st.prompt_tokens_total - prev[3], "steps": steps,
            "step_ms": round(1000 * dt / steps, 1) if steps else None,
            "mean_ctx": round(statistics.mean(ctx)) if ctx else 0, "load_1m": loadavg}


async def _ramp(rt: EngineRuntime, cfg: RampConfig, params: GenParams, vocab: int, floor: float
                ) -> tuple[int, list[tuple[float, int, float | None]], int, int, list[dict[str, Any]]]:
    """Users arriving one per ``arrival_s`` against the floor: the sessions at the end, the samples
    (t, sessions, mean_active_tps), refusals, admits and the per-second trace."""
    sessions: list[_Session] = []
    samples: list[tuple[float, int, float | None]] = []
    trace: list[dict[str, Any]] = []
    refused = 0
    t_start = time.monotonic()
    end = t_start + cfg.ramp_s

    async def user(i: int, nursery: trio.Nursery) -> None:
        nonlocal refused
        await trio.sleep(i * cfg.arrival_s)
        while time.monotonic() < end:
            try:
                handle, _ = await rt.admit(_prompt(i, vocab), params)
            except OverCapacity as exc:
                refused += 1
                await trio.sleep(exc.retry_after_s)
                continue
            s = _Session(handle)
            sessions.append(s)
            nursery.start_soon(_drain, s)
            return

    async def sample() -> None:
        while True:
            cap = rt.capacity().capacity
            samples.append((time.monotonic() - t_start, cap.active_sessions - cap.parked_sessions, cap.mean_active_tps))
            await trio.sleep(cfg.sample_s)

    async def tracer() -> None:
        st = rt.stats
        prev = (0.0, st.steps_total, st.generated_tokens_total, st.prompt_tokens_total)
        while True:
            await trio.sleep(cfg.trace_s)
            t = time.monotonic() - t_start
            trace.append(_trace_row(rt, t, prev, _load_avg()))
            prev = (t, st.steps_total, st.generated_tokens_total, st.prompt_tokens_total)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        nursery.start_soon(tracer)
        async with trio.open_nursery() as users:
            for i in range(cfg.max_sessions):
                users.start_soon(user, i, nursery)
        await trio.sleep(max(0.0, end - time.monotonic()))
        admitted = sum(1 for s in sessions if not s.done and not rt.admission.is_parked(s.handle.req_id))
        for s in sessions:
            rt.cancel(s.handle.req_id)
        nursery.cancel_scope.cancel()
    return admitted, samples, refused, len(sessions), trace


def _runs_below(samples: list[tuple[float, int, float | None]], floor: float, settle_s: float
                ) -> tuple[float, float]:
    """The longest run of samples below the floor while more than one session ran (one session alone below
    the floor is the machine's speed, which no admission decision changes), and the longest such run that
    began within two settle windows of an admit (the others began with the sessions unchanged for longer:
    the machine's speed drifting under the same load, e.g. other processes on a shared machine)."""
    longest = after_admit = 0.0
    since: float | None = None
    caused = False
    last_admit = -1e9
    prev_k = 0
    for t, k, m in samples:
        if k > prev_k:
            last_admit = t
        prev_k = k
        if m is not None and m < floor and k > 1:
            if since is None:
                since, caused = t, t - last_admit <= 2 * settle_s
            longest = max(longest, t - since)
            if caused:
                after_admit = max(after_admit, t - since)
        else:
            since = None
    return longest, after_admit


async def run_ramp_case(model: GGUFModel, cfg: RampConfig) -> list[dict[str, Any]]:
    """Case (c)'s JSON cases: ``admission_ramp/fixed`` (the curve) and ``admission_ramp`` (the ramp)."""
    vocab = model.config.n_vocab
    params = GenParams(max_tokens=cfg.n_ctx - 16, temperature=0.0, ignore_eos=True)
    tok = Tokenizer.from_gguf_fields(model.fields)
    rt = EngineRuntime(model, tok, n_slots=cfg.max_sessions, n_ctx=cfg.n_ctx)
    curve: dict[int, float] = {}
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        await _fixed(rt, cfg.max_sessions, cfg, params, vocab)  # warm-up: the model's pages, the kernels' buffers
        for k in range(1, cfg.max_sessions + 1):
            curve[k] = await _fixed(rt, k, cfg, params, vocab)
        n.cancel_scope.cancel()
    half = cfg.max_sessions // 2
    floor = (curve[half] + curve[half + 1]) / 2
    best = max((k for k, v in curve.items() if v >= floor), default=1)
    policy = AdmissionPolicy(tps_floor=floor, mode="enforced", on_saturation="reject", preempt=cfg.preempt,  # type: ignore[arg-type]
                             settle_tokens=cfg.settle_tokens, settle_s=cfg.settle_s, retry_after_s=cfg.arrival_s)
    rt = EngineRuntime(model, tok, n_slots=cfg.max_sessions, n_ctx=cfg.n_ctx, admission=policy)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        admitted, samples, refused, _, trace = await _ramp(rt, cfg, params, vocab, floor)
        scaling = rt.admission.scaling
        observed = rt.admission.observed
        parks, resumes, forced = rt.admission.parks_total, rt.admission.resumes_total, rt.admission.forced_resumes_total
        n.cancel_scope.cancel()
    longest, after_admit = _runs_below(samples, floor, cfg.settle_s)
    means = [m for t, _, m in samples if m is not None and t >= cfg.ramp_s * 0.75]
    decoding = [k for t, k, _ in samples if t >= cfg.ramp_s * 0.75]  # unparked sessions, the last quarter
    fixed = {"case": "admission_ramp/fixed", "sessions": list(curve),
             "fixed_mean_tokens_per_s": [round(v, 3) for v in curve.values()],
             "aggregate_tokens_per_s": [round(v * k, 3) for k, v in curve.items()], "window_s": cfg.window_s}
    ramp = {
        "case": "admission_ramp",
        "tps_floor_tokens_per_s": round(floor, 3),
        "best_fixed_sessions": best,
        "admitted_sessions": admitted,
        "admitted_within_one": abs(admitted - best) <= 1,
        "below_floor_longest_s": round(longest, 3),
        "settle_window_s": cfg.settle_s,
        "settle_tokens": cfg.settle_tokens,
        "never_below_longer_than_settle": longest <= cfg.settle_s,
        "below_floor_after_admit_longest_s": round(after_admit, 3),
        "after_admit_within_settle": after_admit <= cfg.settle_s,
        "decoding_sessions_last_quarter": round(statistics.mean(decoding), 2) if decoding else None,
        "preempt": cfg.preempt,
        "parks": parks,
        "resumes": resumes,
        "forced_resumes": forced,
        "load_1m_mean": round(statistics.mean(r["load_1m"] for r in trace), 2) if trace else None,
        "refusals": refused,
        "admits_observed": observed,
        "scaling_per_admit": round(scaling, 4),
        "end_mean_active_tokens_per_s": round(statistics.mean(means), 3) if means else None,
        "ramp_s": cfg.ramp_s,
        "arrival_s": cfg.arrival_s,
        "trace": trace,
        "timeline": [[round(t, 2), k, None if m is None else round(m, 3)] for t, k, m in samples[:: max(1, int(1 / cfg.sample_s))]],
    }
    return [fixed, ramp]


def print_ramp(cases: list[dict[str, Any]]) -> None:
    fixed = next(c for c in cases if c["case"] == "admission_ramp/fixed")
    ramp = next(c for c in cases if c["case"] == "admission_ramp")
    print("\n(c) admission ramp: fixed choices (mean session tokens/s by sessions)")
    print(f"{'sessions':>9}{'mean tok/s':>12}{'aggregate':>11}")
    for k, m, a in zip(fixed["sessions"], fixed["fixed_mean_tokens_per_s"], fixed["aggregate_tokens_per_s"], strict=True):
        mark = "  <- best fixed" if k == ramp["best_fixed_sessions"] else ""
        print(f"{k:>9}{m:>12.2f}{a:>11.2f}{mark}")
    print(f"floor {ramp['tps_floor_tokens_per_s']:.2f} tok/s: admitted {ramp['admitted_sessions']} (best fixed "
          f"{ramp['best_fixed_sessions']}; within one: {ramp['admitted_within_one']}), mean below the floor at most "
          f"{ramp['below_floor_longest_s']:.2f} s (settle window {ramp['settle_window_s']} s: "
          f"{ramp['never_below_longer_than_settle']}; runs that began after an admit: at most "
          f"{ramp['below_floor_after_admit_longest_s']:.2f} s), {ramp['refusals']} refusals, "
          f"{ramp['admits_observed']} admits observed, scaling/admit {ramp['scaling_per_admit']}; preempt "
          f"{ramp.get('preempt')}: {ramp.get('parks')} parks, {ramp.get('resumes')} resumes ({ramp.get('forced_resumes')} "
          f"by the bound), decoding sessions over the last quarter {ramp.get('decoding_sessions_last_quarter')}, "
          f"load average {ramp.get('load_1m_mean')}")
