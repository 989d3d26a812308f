"""Does a volunteer make serving faster? The coordinator and one volunteer on one machine, each with
one compute thread (the two cores), on the ``bench`` model: aggregate decode tokens/s and per-session
ms/token at 1, 4 and 8 concurrent sessions, local-only vs load-adaptive dispatch (DESIGN §11 format).

    python benchmarks/offload.py [--quick | --smoke] [--json OUT] [--sessions 1 4 8] [--decode 32] [--repeat N]
                                 [--verify-cases] [--split-forced-case] [--rtt-ms 0 10 40]

``--smoke`` (``make test``): the ``tiny`` model, 1 and 2 sessions, 6 tokens, a 1 s serve TTL.

Real processes on loopback: ``moe-swarm coordinator --threads 1`` and ``moe-swarm volunteer --threads 1``
in static mode, serving every layer of the model in four ranges (its slices are downloaded from a
coordinator once and cached in ``benchmarks/.cache/offload-volunteer``). Each mode has its own
coordinator process, idle while the others' cases run, so the cases interleave -- per repeat and
session count: local, adaptive, ... -- and every ratio is taken between runs next to each other
in time (this VM's speed drifts by tens of percent over minutes):

- ``local``: its ``--dispatch-map`` lists no replica: every expert on the coordinator;
- ``adaptive``: the volunteer for every range: local while idle, split by earliest finish under
  load where the split check measures that it pays (its verdicts, with the rates of its windows,
  are each case's ``split_checks``);
- ``adaptive_unverified`` (``--verify-cases``): the same with ``--verify-rate 0 --verify-probation 0``:
  its ratio to ``adaptive`` is verification's throughput cost;
- ``split_forced`` (``--split-forced-case``): ``--split-check 0``: earliest finish alone decides, as
  before the split check -- what a split costs or buys here, measured.

A warm-up per coordinator (every session count, 32 tokens) builds its graphs, maps the experts'
pages and, under load, gives the volunteer its hedged trial and probation (the probes), so it is
proven; every case starts from an idle dispatcher (after the serve TTL). Requests go through the
HTTP API (``/v1/completions``, streamed, the same token-id prompt per session index,
``ignore_eos``); the tokens of every case are checked against the first local run's.

Verification is at the coordinator's defaults (a volunteer's first 50 answers and then 5 % are
recomputed here: ``rows_verified``).

The ``bound`` case measures one decode step in this process (the largest session count, one
thread): its dense time D (attention, norms, router, head) and expert time E, and the gain two
equal workers could reach by splitting the experts: (D + E) / (D + E / 2), round trips not
counted. It measures D and E again while a second process computes expert layers of the same
shape on the other core (what the volunteer does during a split; the windows alone and shared
alternate), D' and E': ``shared_gain`` = (D + E) / (D' + E' / 2) is that bound on this machine,
where the two workers share its memory and caches.

The ``ratio`` cases give, per mode, round trip and session count, each run's tokens/s over the
local run of the same repeat, and their median.

``--rtt-ms 0 10 40`` runs every case at each round trip: for > 0 the coordinator reaches the
volunteer through a delaying TCP relay (``DelayLink``; this kernel has no netem), and the volunteer
dials each coordinator's data lane through one too (``--lane-announce``). The engine's
session groups apply only where it must wait for remote ranges (offload mode, or ranges the
coordinator does not hold: ``coordinator.core.pipeline``); here every expert is held, so earliest
finish and the split check decide.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _delay import DelayLink  # noqa: E402
from _results import write_json  # noqa: E402

from swarm.demo import split_checks_since  # noqa: E402
from swarm.model.gguf import model_id_for  # noqa: E402
from swarm.tools.makemodel import make_model  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
PROMPT_VOCAB = [8000]  # prompts' token ids are taken modulo this (the model's vocabulary when smaller)
SMOKE_FLAGS: list[str] = []  # --smoke: a short serve TTL, so each case's wait for an idle dispatcher is short
N_RANGES = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", *args]


class Proc:
    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.log = name, log
        self.fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(args, stdout=self.fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def alive(self) -> None:
        if self.p.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.p.returncode}:\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.fh.close()


def wait_until(what: str, cond: Any, procs: list[Proc], timeout: float = 600.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p in procs:
            p.alive()
        try:
            v = cond()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            v = None
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def write_map(path: Path, model_id: str, n_layer: int, n_expert: int, version: int, worker: dict[str, Any] | None) -> None:
    step = n_expert // N_RANGES
    reps = [{"peer_id": worker["peer_id"], "addrs": worker["addrs"]}] if worker else []
    layers = [{"layer": L, "ranges": [{"lo": lo, "hi": lo + step, "replicas": reps} for lo in range(0, n_expert, step)]}
              for L in range(n_layer)] if worker else []
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model_id": model_id, "version": version, "layers": layers}))
    os.replace(tmp, path)


async def one_session(h: httpx.AsyncClient, model_id: str, i: int, n_decode: int) -> dict[str, Any]:
    prompt = [(11 * i + 7 * j + 3) % PROMPT_VOCAB[0] for j in range(16)]
    body = {"model": model_id, "prompt": prompt, "max_tokens": n_decode, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    t_first: float | None = None
    ids: list[int] = []
    async with h.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"][0].get("token_ids", [])
            if got and t_first is None:
                t_first = time.perf_counter()
            ids.extend(got)
    t_end = time.perf_counter()
    assert t_first is not None and len(ids) == n_decode, (len(ids), n_decode)
    return {"t_first": t_first, "t_end": t_end, "ids": ids}


async def run_sessions(url: str, model_id: str, n: int, n_decode: int) -> tuple[float, float, list[list[int]]]:
    """(aggregate decode tokens/s, median per-session ms/token, token ids per session)."""
    out: list[dict[str, Any]] = [{}] * n
    async with httpx.AsyncClient(base_url=url, timeout=600) as h:

        async def go(i: int) -> None:
            out[i] = await one_session(h, model_id, i, n_decode)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(go, i)
    first = max(r["t_first"] for r in out)
    end = max(r["t_end"] for r in out)
    tps = n * (n_decode - 1) / (end - first)
    ms = statistics.median((r["t_end"] - r["t_first"]) / (n_decode - 1) * 1000 for r in out)
    return tps, ms, [r["ids"] for r in out]


def volunteer_latency(vol: Proc) -> float:
    """The volunteer's own arrival-to-answer EWMA (``latency 3.2ms``) from its first status line
    (every 10 s) after now."""
    start = vol.log.stat().st_size

    def after() -> float | None:
        with open(vol.log, "rb") as f:
            f.seek(start)
            found = re.findall(rb" latency ([0-9.]+)ms ", f.read())
        return float(found[-1]) if found else None

    try:
        got: float = wait_until("a volunteer status line", after, [vol], timeout=30)
    except TimeoutError:
        print("    (no volunteer status line within 30 s: its latency is not known)", flush=True)
        return float("nan")
    return got


def dispatch(url: str) -> dict[str, Any]:
    rep: dict[str, Any] = httpx.get(url + "/dispatch", timeout=10).json()
    return rep


def rows(rep: dict[str, Any]) -> tuple[int, int]:
    return (sum(L["local_rows"] for L in rep["layers"]), sum(L["remote_rows"] + L["fallback_rows"] for L in rep["layers"]))


def verified_rows(rep: dict[str, Any]) -> int:
    return sum(int(L.get("verified_rows", 0)) for L in rep["layers"])


def bound(path: Path, sessions: int) -> dict[str, Any]:
    """Dense and expert time of one decode step at ``sessions`` sequences, one thread, in process:
    alone, and while a second process computes expert layers of the same shape on the other core
    (what a volunteer on this machine does during a split; paused with SIGSTOP in the windows
    alone, so the alone and shared windows alternate)."""
    import torch

    from coordinator.calibrate import timed_transformer
    from coordinator.engine.model import KVCache, SeqChunk
    from swarm.model.gguf import GGUFModel
    from swarm.model.kernels import KernelBackend, configure_threads

    configure_threads(1, KernelBackend.GGML)
    tr, spent = timed_transformer(GGUFModel(path))  # every expert here, timed apart from the dense graphs
    caches = [KVCache(tr.cfg, 256, torch.float16) for _ in range(sessions)]
    tr.forward([SeqChunk(c, [(11 * i + 7 * j + 3) % PROMPT_VOCAB[0] for j in range(16)], 0) for i, c in enumerate(caches)])
    toks, pos = [5] * sessions, 16

    def steps(n: int) -> list[tuple[float, float]]:
        nonlocal toks, pos
        got = []
        for _ in range(n):  # 62 steps from position 16: well within the 256 of the caches
            spent[0] = 0.0
            t = time.perf_counter()
            out = tr.forward([SeqChunk(c, [toks[i]], pos) for i, c in enumerate(caches)])
            dt = time.perf_counter() - t
            toks = [int(o[-1].argmax()) for o in out]
            pos += 1
            got.append((dt - spent[0], spent[0]))
        return got

    steps(2)
    alone: list[tuple[float, float]] = []
    shared: list[tuple[float, float]] = []
    other = subprocess.Popen([sys.executable, __file__, "--expert-loop", str(path), "--sessions", str(sessions)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        other.stdout.readline()  # "ready": its model is loaded and it computes
        for _ in range(3):
            other.send_signal(signal.SIGSTOP)
            time.sleep(0.2)
            alone += steps(10)
            other.send_signal(signal.SIGCONT)
            time.sleep(0.2)
            shared += steps(10)
    finally:
        other.send_signal(signal.SIGCONT)
        other.terminate()
        other.wait(10)
    d, e = (statistics.median(s[k] for s in alone) * 1000 for k in (0, 1))
    d2, e2 = (statistics.median(s[k] for s in shared) * 1000 for k in (0, 1))
    return {"case": "bound", "sessions": sessions, "dense_ms": round(d, 2), "experts_ms": round(e, 2),
            "ideal_gain": round((d + e) / (d + e / 2), 3),
            "shared_dense_ms": round(d2, 2), "shared_experts_ms": round(e2, 2),
            "shared_gain": round((d + e) / (d2 + e2 / 2), 3)}


def expert_loop(path: Path, sessions: int) -> None:
    """``--expert-loop``: compute the expert layers of ``sessions`` decode rows (random routing),
    one thread, until killed (the second worker of ``bound``)."""
    import torch

    from coordinator.engine.model import LocalExperts
    from swarm.model.gguf import GGUFModel
    from swarm.model.kernels import KernelBackend, configure_threads

    configure_threads(1, KernelBackend.GGML)
    model = GGUFModel(path)
    local = LocalExperts(model)
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sessions, cfg.d_model, generator=g)
    w = torch.full((sessions, cfg.n_expert_used), 1.0 / cfg.n_expert_used)
    print("ready", flush=True)
    while True:
        ids = torch.stack([torch.randperm(cfg.n_expert, generator=g)[: cfg.n_expert_used] for _ in range(sessions)])
        for layer in range(cfg.n_moe_layer):
            local.moe(layer, x, ids, w)


def sessions(url: str, model_id: str, n: int, n_decode: int) -> tuple[float, float, list[list[int]]]:
    return trio.run(run_sessions, url, model_id, n, n_decode)


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = "tiny" if args.smoke else "bench"
    path = CACHE / f"{size}-qwen3moe.gguf"
    if not path.exists():
        print(f"generating the {size} model -> {path} (once)", flush=True)
        make_model(arch="qwen3moe", size=size, seed=0, out=path)
    from swarm.model.gguf import GGUFModel

    PROMPT_VOCAB[0] = min(8000, GGUFModel(path, compute_id=False).config.n_vocab)
    model_id = model_id_for(path)
    cases: list[dict[str, Any]] = []
    for rtt in args.rtt_ms:
        cases += run_world(args, path, model_id, rtt)
    cases.append(bound(path, max(args.sessions)))
    return {"benchmark": "offload", "model": model_id, "threads": "coordinator 1, volunteer 1", "cases": cases}


# the coordinator processes of one world: each case runs on its own, idle during the others (so
# cases can interleave without a map change: a worker that detached would start over unproven)
MODES: dict[str, list[str]] = {
    "local": [],  # its map lists no replica: every expert here
    "adaptive": [],  # the defaults (verification, the split check)
    "adaptive_unverified": ["--verify-rate", "0", "--verify-probation", "0"],  # --verify-cases
    "split_forced": ["--split-check", "0"],  # --split-forced-case: earliest finish alone decides
}


def run_world(args: argparse.Namespace, path: Path, model_id: str, rtt: float) -> list[dict[str, Any]]:
    """Every case at one round trip (0: plain loopback), ``--repeat`` times, interleaved."""
    work = CACHE / "offload"
    work.mkdir(parents=True, exist_ok=True)
    modes = ["local", "adaptive"]
    if getattr(args, "verify_cases", False):
        modes.append("adaptive_unverified")
    if getattr(args, "split_forced_case", False):
        modes.append("split_forced")
    procs: list[Proc] = []
    cases: list[dict[str, Any]] = []
    link: DelayLink | None = None
    lane_links: list[DelayLink] = []
    urls: dict[str, str] = {}
    maps: dict[str, Path] = {}
    try:
        common = ["--model", str(path), "--threads", "1", "--slots", str(max(args.sessions)), "--ctx-size", "256",
                  *SMOKE_FLAGS]
        for mode in modes:
            port = free_port()
            urls[mode], maps[mode] = f"http://127.0.0.1:{port}", work / f"dispatch-map-{mode}.json"
            write_map(maps[mode], model_id, 0, 0, 1, None)
            lane: list[str] = []
            if rtt > 0:  # the volunteer dials each coordinator's data lane through a delaying relay too
                lane_port = free_port()
                lane_links.append(DelayLink(rtt, lane_port))
                lane = ["--lane-port", str(lane_port), "--lane-announce", f"127.0.0.1:{lane_links[-1].port}"]
            procs.append(Proc(f"coordinator-{mode}", cli("coordinator", *common, *MODES[mode], *lane, "--port", str(port),
                                                         "--data-dir", str(work / f"coordinator-{mode}"),
                                                         "--dispatch-map", str(maps[mode])),
                              work / f"coordinator-{mode}.log"))
            wait_until(f"the {mode} coordinator", lambda u=urls[mode]: httpx.get(u + "/health", timeout=2).status_code == 200,
                       procs)
        url = urls["adaptive"]
        cfg = dispatch(url)
        n_layer = len(cfg["layers"])
        manifest = httpx.get(f"{url}/v1/models/{model_id}/manifest", timeout=10).json()
        n_expert = int(manifest["n_expert"])
        step = n_expert // N_RANGES
        slices = [a for L in range(n_layer) for lo in range(0, n_expert, step) for a in ("--slice", f"{L}:{lo}-{lo + step}")]
        vdir = CACHE / ("offload-volunteer" if path.stem.startswith("bench") else f"offload-volunteer-{path.stem}")
        print(f"starting the volunteer ({n_layer} layers x {N_RANGES} ranges; slices cached in {vdir})", flush=True)
        # the volunteer answers its --coordinator; the other coordinators by --allow-peer
        allow = [a for m, u in urls.items() if m not in ("local", "adaptive")
                 for a in ("--allow-peer", httpx.get(u + "/health", timeout=5).json()["peer_id"])]
        vol = Proc("volunteer", cli("volunteer", "--coordinator", url, *slices, "--threads", "1", "--data-dir", str(vdir),
                                    "--no-progress", "--listen", "/ip4/127.0.0.1/tcp/0", *sorted(set(allow))), work / "volunteer.log")
        procs.append(vol)
        info = wait_until("the volunteer", lambda: json.loads((vdir / "volunteer.json").read_text())
                          if "volunteer ready" in vol.log.read_text(errors="replace") else None, procs, timeout=1800)
        if rtt > 0:  # the maps send the coordinators through the delaying relay
            vport = int(info["addrs"][0].rsplit("/", 1)[1])
            link = DelayLink(rtt, vport)
            info = {**info, "addrs": [link.addr()]}
            print(f"    round trip {rtt:g} ms: the volunteer behind a delaying relay on {link.addr()}", flush=True)
        for mode in modes:
            u = urls[mode]
            write_map(maps[mode], model_id, n_layer, n_expert, 2, info if mode != "local" else None)
            want = 0 if mode == "local" else 1
            wait_until(f"the {mode} map", lambda w=want, u=u: dispatch(u)["map_version"] == 2
                       and len(dispatch(u)["workers"]) == w, procs)
            # warm-up: graphs for every case's sizes (each mode gets the same, so the first measured is
            # not the one that builds them); with a worker, the load onset gives it its trial and probation
            # (32 tokens: a process's first pass over the experts also maps their pages -- with 8, a
            # mode's first measured case was up to a third slower than the same case run again)
            for n in sorted(set(args.sessions), reverse=True):
                sessions(u, model_id, n, min(32, args.decode))
            if mode != "local":
                w = dispatch(u)["workers"][0]
                print(f"    {mode}: volunteer after the warm-up: proven={w.get('proven')} calls={w.get('calls')}", flush=True)
        ref: dict[int, list[list[int]]] = {}
        for rep in range(args.repeat):
            for n in args.sessions:
                for mode in modes:
                    cases.append(one_case(urls[mode], mode, model_id, n, rtt, rep, args, vol, procs, ref))
    finally:
        for p in reversed(procs):
            p.stop()
        for lk in [link, *lane_links]:
            if lk is not None:
                lk.close()
    return cases


def one_case(url: str, mode: str, model_id: str, n: int, rtt: float, rep: int, args: argparse.Namespace, vol: Proc,
             procs: list[Proc], ref: dict[int, list[list[int]]]) -> dict[str, Any]:
    """One measured case, from the steady state: after a burst the dispatcher keeps its proven workers
    for the serve TTL (20 s); every case starts from an idle dispatcher."""
    wait_until("an idle dispatcher", lambda: dispatch(url)["load_state"] in ("idle", ""), procs, timeout=120)
    before = dispatch(url)
    tps, ms, ids = sessions(url, model_id, n, args.decode)
    after = dispatch(url)
    loc, rem = rows(before)
    loc2, rem2 = rows(after)
    case: dict[str, Any] = {"case": mode, "sessions": n, "rtt_ms": rtt, "repeat": rep, "tokens_per_s": round(tps, 2),
                            "ms_per_token": round(ms, 2), "rows_local": loc2 - loc, "rows_remote": rem2 - rem,
                            "rows_verified": verified_rows(after) - verified_rows(before)}
    if mode == "local":
        ref.setdefault(n, ids)
        case["tokens_equal_local"] = ids == ref[n]
    else:
        case["tokens_equal_local"] = ids == ref[n]
        d0, d1 = before.get("decisions", {}), after.get("decisions", {})
        case["decisions"] = {k: v - d0.get(k, 0) for k, v in d1.items() if v - d0.get(k, 0)}
        w = after["workers"][0]
        case["worker_latency_ewma_ms"], case["worker_p95_ms"] = w["latency_ewma_ms"], w.get("p95_ms")
        calls = int(w.get("calls", 0)) - int(before["workers"][0].get("calls", 0))
        case["remote_calls"] = calls
        if rep == 0 and calls > 0:
            # the volunteer's own arrival-to-answer time (its status line every 10 s): the rest of the
            # coordinator's figure is the wire and the coordinator's own loop
            case["volunteer_latency_ms"] = volunteer_latency(vol)
        # the split check's verdicts in this case (DESIGN §5: windows local / split / local)
        case["split_checks"] = [f"{c['reason']}: {c.get('detail', '')}" for c in split_checks_since(before, after)]
    print(f"    {mode:8} rtt {rtt:g} ms sessions {n} (run {rep + 1}): {tps:7.2f} tokens/s, {ms:6.2f} ms/token per "
          f"session, rows local {loc2 - loc} remote {rem2 - rem} verified {case['rows_verified']}", flush=True)
    if mode != "local":
        lat = case.get("volunteer_latency_ms")
        print(f"             decisions {case['decisions']}; {case['remote_calls']} calls, worker latency EWMA "
              f"{case['worker_latency_ewma_ms']:.2f} ms, p95 {case['worker_p95_ms']}"
              + (f"; at the volunteer {lat:.2f} ms" if lat is not None else ""), flush=True)
        for v in case["split_checks"]:
            print(f"             split check: {v}", flush=True)
    return case


def ratios(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, round trip and sessions: each run's tokens/s over the local run of the same repeat
    (adjacent in time), and their median."""
    local = {(c["rtt_ms"], c["sessions"], c["repeat"]): c["tokens_per_s"] for c in cases if c["case"] == "local"}
    groups: dict[tuple[str, float, int], list[float]] = {}
    for c in cases:
        if c["case"] in MODES and c["case"] != "local":
            ref = local[(c["rtt_ms"], c["sessions"], c["repeat"])]
            groups.setdefault((c["case"], c["rtt_ms"], c["sessions"]), []).append(round(c["tokens_per_s"] / ref, 3))
    return [{"case": "ratio", "mode": m, "rtt_ms": rtt, "sessions": n, "ratios": r, "median": round(statistics.median(r), 3)}
            for (m, rtt, n), r in groups.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 and 4 sessions, 12 tokens")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 1 and 2 sessions, 6 tokens (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--decode", type=int, default=32, help="tokens per session")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every case, interleaved (local, adaptive, ... per sessions); ratios per run")
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0],
                    help="round trips to run at: 0 = plain loopback; > 0 = the volunteer behind a relay that delays "
                         "each direction by half of it")
    ap.add_argument("--verify-cases", action="store_true",
                    help="also adaptive dispatch without verification (its own coordinator): its throughput cost")
    ap.add_argument("--split-forced-case", action="store_true",
                    help="also adaptive dispatch without the split check (its own coordinator): earliest finish alone")
    ap.add_argument("--expert-loop", default=None, help=argparse.SUPPRESS)  # bound's second worker (a model path)
    args = ap.parse_args()
    if args.expert_loop:
        expert_loop(Path(args.expert_loop), max(args.sessions))
        return
    if args.quick:
        args.sessions, args.decode = [1, 4], 12
    if args.smoke:
        args.sessions, args.decode = [1, 2], 6
        SMOKE_FLAGS[:] = ["--serve-ttl", "1"]
    result = run(args)
    result["cases"] += ratios(result["cases"])
    print(f"\noffload benchmark: {result['model']} (threads: {result['threads']})")
    print(f"{'case':<19} {'rtt ms':>6} {'sessions':>8} {'run':>3} {'tokens/s':>9} {'ms/token':>9} {'local rows':>11} "
          f"{'remote rows':>12}")
    by = {(c["case"], c.get("rtt_ms"), c.get("sessions"), c.get("repeat")): c for c in result["cases"]}
    for c in result["cases"]:
        if c["case"] in MODES:
            ref = by[("local", c["rtt_ms"], c["sessions"], c["repeat"])]
            print(f"{c['case']:<19} {c['rtt_ms']:>6g} {c['sessions']:>8} {c['repeat'] + 1:>3} {c['tokens_per_s']:>9.2f} "
                  f"{c['ms_per_token']:>9.2f} {c['rows_local']:>11} {c['rows_remote']:>12}" + (
                      f"   x{c['tokens_per_s'] / ref['tokens_per_s']:.2f}" if c["case"] != "local" else "")
                  + f", tokens {'equal' if c['tokens_equal_local'] else 'DIFFERENT'}")
    for r in result["cases"]:
        if r["case"] == "ratio":
            print(f"{r['mode']:<19} {r['rtt_ms']:>6g} {r['sessions']:>8}: x{r['median']:.2f} of local-only "
                  f"(median of {len(r['ratios'])}: {', '.join(f'{x:.2f}' for x in r['ratios'])})")
    b = next(c for c in result["cases"] if c["case"] == "bound")
    print(f"one decode step at {b['sessions']} sessions (1 thread): dense {b['dense_ms']} ms, experts {b['experts_ms']} ms "
          f"-> two equal workers at best x{b['ideal_gain']}; with the second worker's experts on the other core: "
          f"dense {b['shared_dense_ms']} ms, experts {b['shared_experts_ms']} ms -> x{b['shared_gain']} on this machine")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
