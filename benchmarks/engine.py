"""Engine throughput on the ``bench`` model: prefill and decode tokens/s at 1 and 4 concurrent
requests, plus resident memory (DESIGN §11 benchmark format).

    python benchmarks/engine.py [--quick | --smoke] [--json OUT] [--model PATH] [--kernel ggml|torch]
                                [--llamacpp-python PYTHON [--llamacpp-invariant]]
                                [--llamacpp-same-build PYTHON]

``--smoke`` (``make test``): the ``tiny`` model, 16-token prompts, 4 tokens, one round.

``--llamacpp-python`` names a Python that has llama-cpp-python (a scratch venv, not a project
dependency): llama.cpp then runs on the same file in a subprocess in the same run -- 2 threads, the
same prompt tokens, an F16 KV cache, at 1 and at 4 sequences decoded together (one batch per step, as
a server with parallel slots) -- and its tokens/s stand beside ours, round by round. Threads (``--threads``,
default the physical cores, as the coordinator: ``swarm.model.kernels.configure_threads``): the ggml
kernels use that many for big calls and one for small ones; torch (attention, norms) one intra-op
thread on the engine thread (all of them with ``--kernel torch``).

llama.cpp runs in its defaults (``Llama(...)``'s: repacked weights where its CPU backend has a layout,
ggml's tiled K-quant matmuls for >= 8 rows, and whatever its build enabled -- pip builds it for the
host's own CPU, with llamafile's sgemm). ``--llamacpp-invariant`` adds llama.cpp with the kernels the
engine must use, in the same rounds: ``GGML_CPU_TILED_MM=0`` and no repacked weights (each gives a row
other last bits in a batch than alone, or than on a machine without the layout); ``--llamacpp-same-build``
adds a llama-cpp-python built with the engine's own ggml flags (``ops/ggml-cmake-args``: x86-64-v3, no
llamafile), run invariant -- the like-for-like comparison: the same kernels, so the ratio is the engine's
own overhead. Each is a column (``llamacpp_variants`` in the JSON).

The model is generated once into ``benchmarks/.cache/`` (``moe-swarm make-model --size bench``).
Requests go through the real engine runtime (engine thread + scheduler), in process, with
``ignore_eos`` so every request decodes exactly ``--decode`` tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402

from coordinator.core.scheduler import Emit, Finish, GenParams  # noqa: E402
from coordinator.engine.runtime import EngineRuntime  # noqa: E402
from swarm.config import physical_cores  # noqa: E402
from swarm.model.gguf import GGUFModel  # noqa: E402
from swarm.model.kernels import KernelBackend, configure_threads  # noqa: E402
from swarm.model.kernels.ggml import graph_time  # noqa: E402
from swarm.text.tokenizer import Tokenizer  # noqa: E402
from swarm.tools.makemodel import make_model  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def engine_graph() -> tuple[float, int]:
    """Seconds the engine thread has spent inside ``ggml_graph_compute`` so far and the graphs it computed
    (``graph_time``)."""
    for t in threading.enumerate():
        if t.name == "engine" and t.ident is not None:
            return graph_time(t.ident)
    return 0.0, 0


async def one_request(rt: EngineRuntime, prompt: list[int], n_decode: int) -> tuple[float, float, tuple[float, int]]:
    """Returns (prefill seconds = time to first token, decode seconds for the remaining tokens, the
    engine thread's graph seconds and count when the first token came)."""
    t0 = time.perf_counter()
    h = rt.submit(prompt, GenParams(max_tokens=n_decode, temperature=0.0, ignore_eos=True))
    t_first: float | None = None
    g_first = (0.0, 0)
    async for ev in h.events:
        if isinstance(ev, Emit) and ev.token_ids and t_first is None:
            t_first = time.perf_counter()
            g_first = engine_graph()
        if isinstance(ev, Finish):
            break
    t_end = time.perf_counter()
    assert t_first is not None
    return t_first - t0, t_end - t_first, g_first


async def one_case(rt: EngineRuntime, conc: int, rep: int, prompt_len: int, n_decode: int
                   ) -> tuple[float, float, float, float, float, float]:
    """Prefill and aggregate decode tokens/s of ``conc`` concurrent requests (prompts differ per rep),
    and the shares of the decode phase (from the last first token to the end, as the trio side sees
    them come) and of the whole case the engine thread spent inside ggml's graph compute, the graphs
    it computed per decode step in that phase, and the share of the prefill phase (to the last first
    token) inside ggml's graph compute. With a tiny model the engine can finish before its first
    token is delivered: the decode share is then 0."""
    vocab = rt.model.config.n_vocab
    prompts = [[(7 * i + 13 * j + rep) % (vocab - 3) for j in range(prompt_len)] for i in range(conc)]
    results: list[tuple[float, float, tuple[float, int]]] = [(0.0, 0.0, (0.0, 0))] * conc
    t0 = time.perf_counter()
    g0, _ = engine_graph()

    async def go(i: int) -> None:
        results[i] = await one_request(rt, prompts[i], n_decode)

    async with trio.open_nursery() as n:
        for i in range(conc):
            n.start_soon(go, i)
    wall = time.perf_counter() - t0
    g_end, n_end = engine_graph()
    last = max(range(conc), key=lambda i: results[i][0])
    prefill_wall, (g_decode, n_decode_0) = results[last][0], results[last][2]
    decode_wall = wall - prefill_wall
    return (conc * prompt_len / prefill_wall, conc * (n_decode - 1) / decode_wall, (g_end - g_decode) / decode_wall,
            (g_end - g0) / wall, (n_end - n_decode_0) / max(1, n_decode - 1), (g_decode - g0) / prefill_wall)


Reference = Callable[[int, int], dict[str, Any]]  # (concurrency, round) -> llama.cpp's prefill/decode rates


async def run_cases(rt: EngineRuntime, prompt_len: int, n_decode: int, reps: int,
                    refs: dict[str, Reference]) -> list[dict[str, Any]]:
    """Medians over ``reps`` rounds; each round runs each llama.cpp reference (same concurrency) right
    after ours (the machine's memory bandwidth drifts by 20-30 % over minutes: interleaving keeps the
    ratios fair). The first reference is ``llamacpp_tokens_per_s``; all are in ``llamacpp_variants``."""
    cases: list[dict[str, Any]] = []
    for conc in (1, 4):
        pre: list[float] = []
        dec: list[float] = []
        share: list[float] = []
        case_share: list[float] = []  # over the whole case, prefill included
        graphs: list[float] = []  # ggml graphs per decode step (1: token ids to logits in one graph)
        pre_shares: list[float] = []  # the prefill phase's share inside ggml's graph compute
        ref_pre: dict[str, list[float]] = {k: [] for k in refs}
        ref_dec: dict[str, list[float]] = {k: [] for k in refs}
        version = ""
        for rep in range(reps):
            p, d, gs, whole, per_step, pre_share = await one_case(rt, conc, rep, prompt_len, n_decode)
            pre_shares.append(pre_share)
            graphs.append(per_step)
            pre.append(p)
            dec.append(d)
            share.append(gs)
            case_share.append(whole)
            for key, fn in refs.items():
                ref = await trio.to_thread.run_sync(fn, conc, rep)
                ref_pre[key].append(ref["prefill"])
                ref_dec[key].append(ref["decode"])
                version = ref["version"]
        for name, ours, theirs in (("prefill", pre, ref_pre), ("decode", dec, ref_dec)):
            c: dict[str, Any] = {"case": f"{name}_c{conc}", "concurrency": conc,
                                 "prompt_tokens" if name == "prefill" else "decode_tokens":
                                     prompt_len if name == "prefill" else n_decode,
                                 "tokens_per_s": round(statistics.median(ours), 2)}
            if name == "prefill":  # the prefill phase: inside ggml's graphs vs everything else
                c["graph_share"] = round(statistics.median(pre_shares), 4)
                c["outside_graph_ms"] = round(1000.0 * conc * prompt_len / statistics.median(ours)
                                              * (1.0 - statistics.median(pre_shares)), 3)
            if name == "decode":  # issue 32's breakdown: a decode step inside ggml's graphs vs everything else
                step_ms = 1000.0 * conc / statistics.median(ours)
                c["step_ms"] = round(step_ms, 3)
                c["graph_share"] = round(statistics.median(share), 4)
                c["case_graph_share"] = round(statistics.median(case_share), 4)
                c["outside_graph_ms"] = round(step_ms * (1.0 - statistics.median(share)), 3)
                c["graphs_per_step"] = round(statistics.median(graphs), 2)
            if theirs:
                first = theirs[next(iter(theirs))]
                c["llamacpp_tokens_per_s"] = round(statistics.median(first), 2)
                c["llamacpp_version"] = version
                c["llamacpp_variants"] = {k: round(statistics.median(v), 2) for k, v in theirs.items()}
                c["rounds"] = [{"tokens_per_s": round(a, 2)} | {f"llamacpp_{k}_tokens_per_s": round(v[i], 2)
                                                                 for k, v in theirs.items()}
                               for i, a in enumerate(ours)]
            cases.append(c)
    return cases


LLAMACPP_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
import llama_cpp as L
path, prompt_len, n_decode, n_par, rep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
_CB = L.llama_log_callback(lambda *a: None)
L.llama_log_set(_CB, None)
mp = L.llama_model_default_params(); mp.n_gpu_layers = 0; mp.use_extra_bufts = sys.argv[6] == '1'  # repack
model = L.llama_model_load_from_file(path.encode(), mp)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
cp = L.llama_context_default_params()
cp.n_ctx = 1024 * n_par; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = n_par
cp.n_threads = 2; cp.n_threads_batch = 2; cp.type_k = 1; cp.type_v = 1  # F16 KV
cp.flash_attn_type = 0  # disabled, as the 1-session script (Llama(flash_attn=False) default)
ctx = L.llama_init_from_model(model, cp)
batch = L.llama_batch_init(512, 0, n_par)
def run(items):  # items: (token, pos, seq, want_logits)
    batch.n_tokens = len(items)
    for i, (t, p, s, lg) in enumerate(items):
        batch.token[i] = t; batch.pos[i] = p; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = s; batch.logits[i] = int(lg)
    assert L.llama_decode(ctx, batch) == 0
def logits(i):
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))
prompts = [[(7 * s + 13 * j + rep) % (vocab - 3) for j in range(prompt_len)] for s in range(n_par)]
t0 = time.perf_counter()
for s in range(n_par):  # prefill: one sequence per batch, as the server does with a big batch per request
    run([(t, j, s, j == prompt_len - 1) for j, t in enumerate(prompts[s])])
t1 = time.perf_counter()
toks = [int(prompts[s][-1]) for s in range(n_par)]  # any first token: the timing is what counts
pos = prompt_len
for _ in range(n_decode - 1):
    run([(toks[s], pos, s, True) for s in range(n_par)])
    toks = [int(np.argmax(logits(i))) for i in range(n_par)]
    pos += 1
t2 = time.perf_counter()
print(json.dumps({"prefill": n_par * prompt_len / (t1 - t0), "decode": n_par * (n_decode - 1) / (t2 - t1),
                  "version": llama_cpp.__version__}))
"""


# llama.cpp's configurations in the comparison: its defaults (what `Llama(...)` runs: repacked weights
# where its CPU backend has a layout for them, ggml's tiled K-quant matmuls for >= 8 rows) and its
# batch-invariant kernels, the ones the goldens are made with and the engine runs (GGML_CPU_TILED_MM=0,
# no repacked weights: either one gives a row other last bits in a batch than alone, or than on a
# machine without the layout -- moe-swarm's remote experts must give equal bits everywhere)
LLAMACPP_CONFIGS: dict[str, tuple[dict[str, str], bool]] = {  # name -> (environment, repack)
    "default": ({}, True),
    "invariant": ({"GGML_CPU_TILED_MM": "0"}, False),
}


def run_llamacpp(python: str, path: Path, prompt_len: int, n_decode: int, n_par: int, rep: int = 0,
                 config: str = "default") -> dict[str, Any]:
    """llama.cpp (low-level API: one context, ``n_par`` sequences decoded in one batch per step, as a
    server with parallel slots; each prompt prefilled in its own batch; F16 KV, 2 threads, no flash
    attention) on ``path``, in a subprocess, in one of ``LLAMACPP_CONFIGS``. The prompts are ours (same
    token ids). The subprocess gets none of this process's ggml settings."""
    extra, repack = LLAMACPP_CONFIGS[config]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_") and k != "PYTHONPATH"} | extra
    out = subprocess.run([python, "-c", LLAMACPP_SCRIPT, str(path), str(prompt_len), str(n_decode), str(n_par), str(rep),
                          "1" if repack else "0"], capture_output=True, text=True, check=True, timeout=1800, env=env)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def references(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(key, python, configuration) of each llama.cpp reference asked for, the default first."""
    out: list[tuple[str, str, str]] = []
    if args.llamacpp_python:
        out.append(("default", args.llamacpp_python, "default"))
        if args.llamacpp_invariant:
            out.append(("invariant", args.llamacpp_python, "invariant"))
    if args.llamacpp_same_build:
        out.append(("same_build", args.llamacpp_same_build, "invariant"))
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    size = "tiny" if args.smoke else "bench"
    path = Path(args.model) if args.model else ROOT / "benchmarks" / ".cache" / f"{size}-qwen3moe.gguf"
    if not path.exists():
        print(f"generating the {size} model -> {path} (once)", flush=True)
        make_model(arch="qwen3moe", size=size, seed=0, out=path)
    threads = args.threads or physical_cores()
    configure_threads(threads, KernelBackend(args.kernel))  # what `moe-swarm coordinator --threads` does
    rss0 = rss_mb()
    model = GGUFModel(path, kernel=KernelBackend(args.kernel))
    rt = EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=4, n_ctx=1024)
    file_mb = path.stat().st_size / 2**20
    async with trio.open_nursery() as n:
        await n.start(rt.serve)
        prompt_len, n_decode, reps = (16, 4, 1) if args.smoke else (32, 8, 1) if args.quick else (128, 32, args.rounds)
        # warm-up at full size: every expert's pages of the memory-mapped file are read once, and the
        # kernels' graphs for these sizes are built, before anything is timed
        await one_request(rt, [(5 * j + 1) % (model.config.n_vocab - 3) for j in range(prompt_len)], n_decode)
        refs: dict[str, Reference] = {}
        for key, python, config in references(args):
            refs[key] = functools.partial(run_llamacpp, python, path, prompt_len, n_decode, config=config)
        cases = await run_cases(rt, prompt_len, n_decode, reps, refs)
        n.cancel_scope.cancel()
    for c in cases:
        c["model"] = path.name
        c["kernel"] = args.kernel
    cases.append({"case": "rss", "model": path.name, "rss_mb": round(rss_mb(), 1), "rss_before_load_mb": round(rss0, 1),
                  "file_mb": round(file_mb, 1)})
    cfg = model.config
    return {"benchmark": "engine", "model": model.model_id,
            "model_shape": f"{cfg.n_layer}L d{cfg.d_model} {cfg.n_expert}e top{cfg.n_expert_used} w{cfg.d_expert}",
            "cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 4 tokens, one round (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None, help="GGUF to measure (default: generated bench model)")
    ap.add_argument("--kernel", choices=["ggml", "torch"], default="ggml", help="expert and dense kernels")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the physical cores)")
    ap.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python: run llama.cpp too")
    ap.add_argument("--llamacpp-invariant", action="store_true",
                    help="also run llama.cpp with its batch-invariant kernels (GGML_CPU_TILED_MM=0, no repack)")
    ap.add_argument("--llamacpp-same-build", default=None, metavar="PYTHON",
                    help="a Python whose llama-cpp-python is built with ops/ggml-cmake-args: run it too, invariant")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per case (medians; llama.cpp interleaved)")
    args = ap.parse_args()
    if args.llamacpp_invariant and not args.llamacpp_python:
        ap.error("--llamacpp-invariant runs the llama.cpp of --llamacpp-python: give that too")
    result = trio.run(main_async, args)
    print(f"\nengine benchmark: {result['model']} ({result['model_shape']})")
    keys = [k for k, _, _ in references(args)]
    head = "".join(f" {'llama.cpp ' + k:>20} {'ratio':>6}" for k in keys)
    print(f"{'case':<12} {'tokens/s':>10}{head}   (kernel {args.kernel}; medians)")
    for c in result["cases"]:
        if "tokens_per_s" in c:
            variants = c.get("llamacpp_variants", {})
            extra = "".join(f" {variants[k]:>20.2f} {c['tokens_per_s'] / variants[k]:>6.2f}" for k in keys if k in variants)
            split = (f"   step {c['step_ms']:.2f} ms: {100 * c['graph_share']:.0f} % in ggml graphs, "
                     f"{c['outside_graph_ms']:.2f} ms outside, {c['graphs_per_step']:.1f} graphs a step"
                     if "step_ms" in c else f"   {100 * c['graph_share']:.0f} % in ggml graphs, "
                     f"{c['outside_graph_ms']:.1f} ms outside" if "graph_share" in c else "")
            print(f"{c['case']:<12} {c['tokens_per_s']:>10.2f}{extra}{split}")
    mem = result["cases"][-1]
    print(f"resident memory {mem['rss_mb']:.0f} MB (model file {mem['file_mb']:.0f} MB, "
          f"before load {mem['rss_before_load_mb']:.0f} MB)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
