"""Issue 28's gateway benchmarks; here case (a): a chat workload whose users share a system prompt,
with the coordinator's prefix cache on and off -- time to first token and prompt tokens computed
(DESIGN §11 benchmark format).

    python benchmarks/gateway.py [--smoke] [--json OUT] [--model PATH] [--threads N]

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
``--cases a,c`` picks cases (default: all here). Case (b) (two coordinators behind the gateway) is not
here yet: it needs the gateway.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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
    if "c" in args.cases:
        if args.smoke:  # the tiny model's 512 tokens of context end a session in half a second: "small" (2,048)
            small = ROOT / "benchmarks" / ".cache" / "small-qwen3moe.gguf"
            if not small.exists():
                make_model(arch="qwen3moe", size="small", seed=0, out=small)
            cfg = RampConfig(max_sessions=4, window_s=1.0, arrival_s=0.3, ramp_s=6.0, settle_s=0.5)
            cases += await run_ramp_case(GGUFModel(small), cfg)
        else:
            cases += await run_ramp_case(model, RampConfig())
    if "a" not in args.cases:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", "--quick", action="store_true",
                    help="the tiny model, a 64-token system prompt, 3 users; ramp 1 -> 4 (make test)")
    ap.add_argument("--cases", default="a,c", help="which cases: a (shared prompt), c (admission ramp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None, help="GGUF to measure (default: generated bench model)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the physical cores)")
    args = ap.parse_args()
    result = trio.run(main_async, args)
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
