"""Issue 28's gateway benchmarks; here case (a): a chat workload whose users share a system prompt,
with the coordinator's prefix cache on and off -- time to first token and prompt tokens computed
(DESIGN §11 benchmark format).

    python benchmarks/gateway.py [--smoke|--quick] [--cases a,b,c] [--json OUT] [--model PATH] [--threads N]

Case (a), ``shared_prompt``: a 512-token system prompt shared by 8 users; each sends two turns (a
24-token message, then the conversation so far -- system prompt, message, the reply's tokens -- and
another 24-token message), 16 tokens decoded a turn (greedy, ``ignore_eos``). Users arrive one after
another: a user's first turn is sent when the previous user's first turn has ended, its second turn
as soon as its first ended, so up to two users' requests are in flight. Requests go through the
real engine runtime (engine thread + scheduler, 4 slots) in process, once with
``--prefix-cache-mem 512M`` and once with 0 (the ``off`` case); ``prefill_tokens`` is the prompt
tokens the engine computed (``moe_swarm_prompt_tokens_total``), ``ttft_*_ms`` the time from submit
to the first token over all 16 requests. The ``ratio`` case: on / off (targets: TTFT <= 0.3x,
prefill tokens <= 0.2x) and whether every request's tokens were identical.

``--smoke`` (``make test``): the ``tiny`` model, a 64-token system prompt, 3 users, 4 tokens a turn.
The model is generated once into ``benchmarks/.cache/`` (``moe-swarm make-model --size bench``).
Case (c), ``admission_ramp`` (``benchmarks/_admission_ramp.py`` says how): 1 -> 12 sessions arriving
against a floor set from the measured fixed-choice curve, admission enforced; the coordinator's mean
active tps below the floor for at most one settle window, and the sessions admitted within one of the
best fixed choice. ``--smoke`` (alias ``--quick``): the ``small`` model, 1 -> 4 sessions, a 0.5 s settle window.
``--cases a,b,c`` picks cases (default: all three).

Case (b), ``scale_out`` (``case_scale_out``; ``--cases b``): real processes -- a market, coordinators and
``moe-swarm gateway`` -- and 8 concurrent streamed sessions (greedy, ``ignore_eos``, distinct 32-token
prompts, 64 tokens each) sent to the gateway: ``1x4`` one coordinator with ``--slots 4`` (4 sessions wait),
``2x4`` two of them, ``1x8`` one with ``--slots 8`` (all 8 batched: the strongest single coordinator); every
coordinator runs ``--threads 1`` pinned to a core of its own (``taskset -c 0`` / ``-c 1``; the market, gateway and client are not pinned). ``tokens_per_s`` is
all sessions' tokens over the wall time from the first request to the last token; ``per_coordinator``
counts the sessions each coordinator answered (``x-moe-swarm-coordinator``); ``coordinator_cpu_s`` the CPU
time the coordinators used meanwhile, ``core_share`` that over ``wall_s`` x coordinators (how much of its
pinned core each one got: below 1 on a shared machine), ``tokens_per_cpu_s`` tokens over that CPU time; ``load_avg_1m_before`` /
``_after`` are ``/proc/loadavg``'s (the machine may be shared). The ``scale_out/ratio`` case: 2x4 / 1x4
(target >= 1.7x), 2x4 / 1x8, and whether every session's tokens were identical in every run. ``--smoke``:
the tiny model, 4 sessions of 8 tokens, no 1x8 run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _admission_ramp import RampConfig, print_ramp, run_ramp_case  # noqa: E402
from _results import write_json  # noqa: E402

from coordinator.core.scheduler import Emit, Finish, GenParams  # noqa: E402
from coordinator.engine.runtime import EngineRuntime  # noqa: E402
from swarm.config import physical_cores  # noqa: E402
from swarm.model.gguf import GGUFModel  # noqa: E402
from swarm.model.kernels import KernelBackend, configure_threads  # noqa: E402
from swarm.text.tokenizer import Tokenizer  # noqa: E402
from swarm.tools.makemodel import make_model  # noqa: E402

CACHE_MEM = 512 << 20


async def turn(rt: EngineRuntime, prompt: list[int], n_decode: int) -> tuple[float, list[int], int]:
    """One request: seconds to its first token, its tokens, its cached prompt tokens."""
    t0 = time.perf_counter()
    h = rt.submit(prompt, GenParams(max_tokens=n_decode, temperature=0.0, ignore_eos=True))
    ttft: float | None = None
    ids: list[int] = []
    cached = 0
    async for ev in h.events:
        if isinstance(ev, Emit) and ev.token_ids:
            ids.extend(ev.token_ids)
            if ttft is None:
                ttft = time.perf_counter() - t0
        elif isinstance(ev, Finish):
            cached = ev.n_cached
    assert ttft is not None and len(ids) == n_decode
    return ttft, ids, cached


async def workload(rt: EngineRuntime, system: list[int], users: list[tuple[list[int], list[int]]], n_decode: int
                   ) -> tuple[list[float], list[list[int]], list[int], float]:
    """Every user's two turns (arrivals as the docstring says): TTFTs, tokens, cached tokens per request
    (user-major), and the wall time."""
    n = len(users)
    ttfts: list[float] = [0.0] * (2 * n)
    tokens: list[list[int]] = [[] for _ in range(2 * n)]
    cached: list[int] = [0] * (2 * n)
    t0 = time.perf_counter()

    async def user(i: int, first_done: trio.Event, previous: trio.Event | None) -> None:
        if previous is not None:
            await previous.wait()
        m1, m2 = users[i]
        ttfts[2 * i], tokens[2 * i], cached[2 * i] = await turn(rt, system + m1, n_decode)
        first_done.set()
        ttfts[2 * i + 1], tokens[2 * i + 1], cached[2 * i + 1] = await turn(rt, system + m1 + tokens[2 * i] + m2, n_decode)

    async with trio.open_nursery() as nursery:
        previous: trio.Event | None = None
        for i in range(n):
            done = trio.Event()
            nursery.start_soon(user, i, done, previous)
            previous = done
    return ttfts, tokens, cached, time.perf_counter() - t0


async def run_case(model: GGUFModel, mem: int, system: list[int], users: list[tuple[list[int], list[int]]],
                   n_decode: int) -> tuple[dict[str, Any], list[list[int]]]:
    rt = EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=4, n_ctx=2048, prefix_cache_bytes=mem)
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        ttfts, tokens, cached, wall = await workload(rt, system, users, n_decode)
        n.cancel_scope.cancel()
    info = rt.prefix_cache()
    case = {
        "case": "shared_prompt/" + ("on" if mem else "off"),
        "prefix_cache_mem_bytes": mem,
        "users": len(users),
        "system_tokens": len(system),
        "requests": len(ttfts),
        "ttft_mean_ms": round(statistics.mean(ttfts) * 1000, 2),
        "ttft_median_ms": round(statistics.median(ttfts) * 1000, 2),
        "ttft_first_turn_mean_ms": round(statistics.mean(ttfts[0::2]) * 1000, 2),
        "ttft_second_turn_mean_ms": round(statistics.mean(ttfts[1::2]) * 1000, 2),
        "prefill_tokens": rt.stats.prompt_tokens_total,
        "prompt_tokens": sum(len(system) + len(m1) for m1, _ in users) * 2
                         + sum(len(m2) + n_decode for _, m2 in users),
        "cached_tokens": sum(cached),
        "wall_s": round(wall, 3),
        "kept_bytes": info.used if info is not None else 0,
    }
    return case, tokens


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    size = "tiny" if args.smoke else "bench"
    path = Path(args.model) if args.model else ROOT / "benchmarks" / ".cache" / f"{size}-qwen3moe.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(arch="qwen3moe", size=size, seed=0, out=path)
    threads = args.threads or physical_cores()
    configure_threads(threads, KernelBackend.GGML)
    model = GGUFModel(path)
    cases: list[dict[str, Any]] = []
    if "c" in args.case:
        if args.smoke:  # the tiny model's 512 tokens of context end a session in half a second: "small" (2,048)
            small = ROOT / "benchmarks" / ".cache" / "small-qwen3moe.gguf"
            if not small.exists():
                make_model(arch="qwen3moe", size="small", seed=0, out=small)
            cfg = RampConfig(max_sessions=4, window_s=1.0, arrival_s=0.3, ramp_s=6.0, settle_s=0.5)
            cases += await run_ramp_case(GGUFModel(small), cfg)
        else:
            cfg = RampConfig()
            cfg = RampConfig(max_sessions=args.ramp_sessions or cfg.max_sessions, window_s=args.ramp_window_s or cfg.window_s,
                             ramp_s=args.ramp_s or cfg.ramp_s, arrival_s=args.arrival_s or cfg.arrival_s,
                             preempt=args.ramp_preempt)
            cases += await run_ramp_case(model, cfg)
    if "a" not in args.case:
        return {"benchmark": "gateway", "model": path.name, "threads": threads, "cases": cases}
    n_sys, n_users, n_msg, n_decode = (64, 3, 8, 4) if args.smoke else (512, 8, 24, 16)
    rng = random.Random(0)
    vocab = model.config.n_vocab
    system = [rng.randrange(3, vocab) for _ in range(n_sys)]
    users = [([rng.randrange(3, vocab) for _ in range(n_msg)], [rng.randrange(3, vocab) for _ in range(n_msg)])
             for _ in range(n_users)]
    off, tokens_off = await run_case(model, 0, system, users, n_decode)
    on, tokens_on = await run_case(model, CACHE_MEM, system, users, n_decode)
    ratio = {
        "case": "shared_prompt/ratio",
        "ttft_mean_ratio": round(on["ttft_mean_ms"] / off["ttft_mean_ms"], 3),
        "prefill_tokens_ratio": round(on["prefill_tokens"] / off["prefill_tokens"], 3),
        "ttft_target_ratio": 0.3,
        "prefill_target_ratio": 0.2,
        "tokens_identical": tokens_on == tokens_off,
    }
    return {"benchmark": "gateway", "model": path.name, "threads": threads, "cases": [off, on, ratio, *cases]}


# case (b): two coordinators behind the gateway vs one ------------------------------------------------------

class _Proc:
    def __init__(self, work: Path, name: str, args: list[str], core: int | None = None) -> None:
        cmd = [sys.executable, "-m", "swarm.cli", "--log-level", "INFO", *args]
        if core is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(core), *cmd]
        self.log = work / f"{name}.log"
        self.fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.p = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def ready(self, prefix: str, within_s: float = 600.0) -> str:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited {self.p.returncode}:\n{self.log.read_text()[-3000:]}")
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix):].split()[0].rstrip("/")
            time.sleep(0.05)
        raise RuntimeError(f"{self.log.name}: no {prefix!r} within {within_s} s")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.fh.close()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _stream(url: str, model: str, prompt: list[int], n: int, out: dict[str, Any]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    ids: list[int] = []
    with httpx.Client(timeout=httpx.Timeout(900.0)) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        out["coordinator"] = r.headers.get("x-moe-swarm-coordinator", "")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"a session failed: {chunk['error']}")
                for ch in chunk["choices"]:
                    ids.extend(ch.get("token_ids") or [])
    out["ids"], out["end"] = ids, time.monotonic()


def _scale_out_run(model_path: Path, n_coords: int, n_slots: int, prompts: list[list[int]], n_tokens: int, work: Path
                   ) -> tuple[dict[str, Any], list[list[int]]]:
    procs: list[_Proc] = []
    try:
        tag = f"{n_coords}x{n_slots}"
        market = _Proc(work, f"market{tag}", ["market", "--db", str(work / f"market{tag}.db"), "--port", "0",
                                              "--token", "t0k", "--poll-interval", "0.5"])
        procs.append(market)
        murl = market.ready("market ready at ")
        urls = []
        for i in range(n_coords):
            c = _Proc(work, f"coord{tag}-{i}", ["coordinator", "--model", str(model_path), "--port", "0",
                                               "--market", murl, "--token", "t0k", "--threads", "1", "--slots",
                                               str(n_slots), "--data-dir", str(work / f"c{tag}-{i}")], core=i)
            procs.append(c)
            urls.append(c.ready("coordinator ready at "))
        gw = _Proc(work, f"gateway{tag}", ["gateway", "--market", murl, "--port", "0", "--poll-interval", "0.5"])
        procs.append(gw)
        gurl = gw.ready("gateway ready at ")
        deadline = time.monotonic() + 60
        while True:
            health = httpx.get(gurl + "/health", timeout=10).json()
            if sum(c["polled"] for c in health["coordinators"]) == n_coords and health["models"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not see {n_coords} coordinators: {health}")
            time.sleep(0.1)
        model = health["models"][0]
        for u in urls:  # warm-up, each coordinator directly
            httpx.post(u + "/v1/completions", json={"model": model, "prompt": prompts[0], "max_tokens": 2},
                       timeout=600).raise_for_status()
        load_before = _load_avg()
        coord_procs = procs[1:1 + n_coords]
        cpu0 = [_cpu_s(c.p.pid) for c in coord_procs]
        results: list[dict[str, Any]] = [{} for _ in prompts]
        threads = [threading.Thread(target=_stream, args=(gurl, model, p, n_tokens, results[i]))
                   for i, p in enumerate(prompts)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any("end" not in r for r in results):
            raise RuntimeError("a session did not finish (see the logs in " + str(work) + ")")
        wall = max(r["end"] for r in results) - t0
        cpu = sum(_cpu_s(c.p.pid) - c0 for c, c0 in zip(coord_procs, cpu0, strict=True))
        tokens = sum(len(r["ids"]) for r in results)
        per = {u: sum(r["coordinator"] == u for r in results) for u in urls}
        case = {"case": f"scale_out/{tag}", "coordinators": n_coords, "slots_each": n_slots,
                "threads_each": 1, "sessions": len(prompts), "tokens_per_session": n_tokens, "tokens": tokens,
                "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
                "per_coordinator": sorted(per.values(), reverse=True),
                "coordinator_cpu_s": round(cpu, 2), "tokens_per_cpu_s": round(tokens / cpu, 2) if cpu else 0.0,
                "core_share": round(cpu / (wall * n_coords), 3),
                "load_avg_1m_before": load_before, "load_avg_1m_after": _load_avg()}
        return case, [r["ids"] for r in results]
    finally:
        for p in reversed(procs):
            p.stop()


def case_scale_out(model_path: Path, smoke: bool) -> list[dict[str, Any]]:
    """Case (b): aggregate tokens/s of 8 sessions through the gateway, two coordinators vs one."""
    n_sessions, n_tokens = (4, 8) if smoke else (8, 64)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(32)] for _ in range(n_sessions)]
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        one, ids_one = _scale_out_run(model_path, 1, 4, prompts, n_tokens, Path(tmp))
        two, ids_two = _scale_out_run(model_path, 2, 4, prompts, n_tokens, Path(tmp))
        cases = [one, two]
        ratio: dict[str, Any] = {"case": "scale_out/ratio",
                                 "tokens_per_s_ratio": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                                 "target_ratio": 1.7, "tokens_identical": ids_one == ids_two}
        if not smoke:  # the strongest single coordinator: all 8 sessions batched in one
            wide, ids_wide = _scale_out_run(model_path, 1, 8, prompts, n_tokens, Path(tmp))
            cases.append(wide)
            ratio["tokens_per_s_ratio_vs_1x8"] = round(two["tokens_per_s"] / wide["tokens_per_s"], 3)
            ratio["tokens_identical"] = ratio["tokens_identical"] and ids_wide == ids_one
    return [*cases, ratio]


def print_scale_out(cases: list[dict[str, Any]]) -> None:
    print(f"{'case':<18}{'coords':>7}{'slots':>6}{'sessions':>9}{'tokens':>8}{'wall s':>9}{'tok/s':>9}"
          f"{'per coord':>11}{'core share':>11}{'tok/cpu-s':>10}{'load 1m':>13}")
    for c in cases:
        if "coordinators" in c:
            print(f"{c['case']:<18}{c['coordinators']:>7}{c['slots_each']:>6}{c['sessions']:>9}{c['tokens']:>8}"
                  f"{c['wall_s']:>9.2f}{c['tokens_per_s']:>9.2f}{'/'.join(map(str, c['per_coordinator'])):>11}"
                  f"{c['core_share']:>11.2f}{c['tokens_per_cpu_s']:>10.2f}"
                  f"{c['load_avg_1m_before']:>6.2f}->{c['load_avg_1m_after']:<5.2f}")
        else:
            vs8 = f", two / one with 8 slots {c['tokens_per_s_ratio_vs_1x8']}x" if "tokens_per_s_ratio_vs_1x8" in c else ""
            print(f"two / one (4 slots each): {c['tokens_per_s_ratio']}x (target >= {c['target_ratio']}x){vs8}, "
                  f"tokens identical: {c['tokens_identical']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", "--quick", action="store_true",
                    help="the tiny model, a 64-token system prompt, 3 users; 4 sessions of 8 tokens; ramp 1 -> 4 (make test)")
    ap.add_argument("--cases", default="a,b,c",
                    help="which cases: a (shared prompt), b (two coordinators vs one), c (admission ramp)")
    ap.add_argument("--ramp-sessions", type=int, default=None, help="case (c): the most sessions offered (default 12)")
    ap.add_argument("--ramp-s", type=float, default=None, help="case (c): how long the ramp runs (default 120 s)")
    ap.add_argument("--ramp-window-s", type=float, default=None,
                    help="case (c): each fixed choice's measuring window (default 8 s)")
    ap.add_argument("--arrival-s", type=float, default=None, help="case (c): one user arrives this often (default 1 s)")
    ap.add_argument("--ramp-preempt", choices=["park", "off"], default="park",
                    help="case (c): the coordinator's --preempt (off: admission alone)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None, help="GGUF to measure (default: generated bench model)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the physical cores)")
    args = ap.parse_args()
    args.case = {c.strip() for c in args.cases.split(",") if c.strip()}
    if not args.case <= {"a", "b", "c"}:
        ap.error(f"--cases: unknown case(s) {', '.join(sorted(args.case - {'a', 'b', 'c'}))} (known: a, b, c)")
    result = trio.run(main_async, args)
    if "b" in args.case:
        size = "tiny" if args.smoke else "bench"
        path = Path(args.model) if args.model else ROOT / "benchmarks" / ".cache" / f"{size}-qwen3moe.gguf"
        scale = case_scale_out(path, args.smoke)
        result["cases"].extend(scale)
        print_scale_out(scale)
    by_name = {c["case"]: c for c in result["cases"]}
    if "shared_prompt/off" in by_name:
        print_shared(by_name)
    if "admission_ramp" in by_name:
        print_ramp(result["cases"])
    write_json(args.json, result)


def print_shared(by_name: dict[str, dict[str, Any]]) -> None:
    print(f"{'case':<22}{'TTFT mean ms':>14}{'TTFT p50 ms':>13}{'1st turn':>10}{'2nd turn':>10}{'prefill tok':>13}"
          f"{'cached tok':>12}{'wall s':>9}")
    for c in (by_name["shared_prompt/off"], by_name["shared_prompt/on"]):
        print(f"{c['case']:<22}{c['ttft_mean_ms']:>14.1f}{c['ttft_median_ms']:>13.1f}{c['ttft_first_turn_mean_ms']:>10.1f}"
              f"{c['ttft_second_turn_mean_ms']:>10.1f}{c['prefill_tokens']:>13}{c['cached_tokens']:>12}{c['wall_s']:>9.2f}")
    r = by_name["shared_prompt/ratio"]
    print(f"on/off: TTFT {r['ttft_mean_ratio']}x (target <= {r['ttft_target_ratio']}x), prefill tokens "
          f"{r['prefill_tokens_ratio']}x (target <= {r['prefill_target_ratio']}x), tokens identical: {r['tokens_identical']}")


if __name__ == "__main__":
    main()
