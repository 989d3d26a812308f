"""Backbone serving speed (issue 26): a coordinator that holds no expert against one that holds them
all, on the same file, in one run (DESIGN §11 format).

    python benchmarks/backbone.py [--quick] [--smoke] [--json OUT] [--size small|30b-a3b] [--rtt-ms MS ...]
                                  [--sessions N ...] [--draft none ngram model self ...] [--tokens N] [--work DIR]

Default: the ``30b-a3b`` shape (48 MoE layers x 128 experts, top-8, Q4_0 experts), four volunteers,
rtt 0 / 20 / 50 ms, 1 / 4 / 8 sessions. ``--quick``: the ``small`` shape (4 layers x 16 experts),
two volunteers, rtt 0 and 20 ms, 1 and 4 sessions. ``--smoke``: the ``tiny`` shape, rtt 0, one
session, a few tokens (``make test`` runs it: the benchmark cannot rot).

Real processes on loopback:
- **all_local**: ``moe-swarm coordinator --local-experts all`` on the file: greedy streamed
  completions of fixed prompts (``ignore_eos``, token ids returned) at each session count; its
  tokens are the reference.
- **backbone**: a market (SQLite, ``--remote-base-target 1``), ``moe-swarm coordinator
  --local-experts none`` and volunteers that together hold every expert (``--max-experts`` the
  total over their number). With ``--rtt-ms`` > 0 each volunteer listens on a port of its own and
  announces (``--announce``) a delaying TCP relay in front of it (``_delay.DelayLink``: half the
  round trip each way; this kernel has no netem), so every coordinator-volunteer round trip pays it;
  so do the data lanes the volunteers dial (a delaying relay in front of the coordinator's
  ``--lane-port``, offered as its ``--lane-announce``), which the engine's calls take.
  The same completions, and ``tokens_identical`` against the reference. Each case names its drafter
  (the request's ``draft``): ``none``, ``ngram``, ``model`` (``make-model --draft-of``: the same
  random model with its experts in Q4_0 (``--draft-qtype``), all-local on the coordinator; not for 30b-a3b, whose
  experts are random blocks), ``self`` (the model's own blocks without the experts it does not hold).

For the small shape both coordinators run at once (the idle one costs nothing) and each backbone
case is preceded by the all-local case of the same sessions: ratios between adjacent runs. The
30b-a3b reference runs first and stops (its 16 GB mapping and the volunteers' slices do not both
fit in this machine's memory).

Threads (2 cores): each coordinator ``--threads 2`` (ggml's threads for big graphs), each volunteer
``--threads 1`` (``--volunteer-threads``). A volunteer's second ggml thread must be woken on the
other core for every call, which here is busy with the coordinator or halted: with 2 the small
shape's remote layer measured 2.9 ms (its expert compute 1.9 ms, for ~0.1 ms of work in a warm
process), with 1 thread 1.0 ms (0.27 ms). Pinning the volunteers to the second core
(``sched_setaffinity``) was slower still at 1 session (1.5 ms a layer: every call then crosses
cores). In a sequential decode only one process computes at a time; at 4 and 8 sessions the
coordinator's session groups and the volunteers compute at once, and share the cores.

Per case: ``tokens_per_s`` (decode, summed over sessions: (tokens - 1) / (last - first token time)),
``ms_per_token`` (per session), ``round_trips_per_token`` (the coordinator's expert calls over the
tokens it generated), ``layer_breakdown_ms`` (the coordinator's ``/dispatch`` ``layer_path``: where a
remote layer's time goes), ``acceptance`` (speculative drafts accepted / proposed; None without one),
``remote_share`` (the routed rows the volunteers answered over all routed rows: 1.0 once every
worker is proven, as the cases are measured after a warm-up that waits for it), ``verified_rows``
(rows of the case also computed here to check an answer) and ``network_ms_per_token`` (the CPU the
coordinator's network thread -- trio: the API's streams, the dispatcher's protocol -- spent per token
generated, from ``/proc``; None elsewhere); for the backbone also ``decisions`` (the dispatcher's placements,
hedges and retries by reason over the case) and ``layout`` (the market's map at its end: per MoE layer its
ranges ``[lo, hi, [volunteer indices]]`` -- the market hands out slices by demand, so one run's volunteers may
hold whole layers and another's halves of them, with a call per range: ``benchmarks/sim_validate.py``
simulates each case on its own layout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _delay import DelayLink  # noqa: E402
from _results import write_json  # noqa: E402

PROMPTS = ["The swarm serves a model that no single machine can hold,",
           "Experts are routed per token; the backbone keeps attention and",
           "A volunteer on a desktop behind NAT pulls a slice and",
           "Capacity grows with every machine that joins:",
           "Round trips are hidden when sessions advance on their own,",
           "A draft of several tokens is checked in one batched step",
           "Bits are the same wherever an expert runs, so",
           "The market raises the targets while the coordinator is saturated"]
DRAFTS = ("none", "ngram", "model", "self")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Procs:
    """The processes of one world; logs in ``work``; stopped in reverse order."""

    def __init__(self, work: Path, tag: str) -> None:
        self.work, self.tag = work, tag
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.work / f"{self.tag}-{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        cmd = [sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self.procs.append((name, p))
        return p

    def check(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                tail = (self.work / f"{self.tag}-{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited {p.returncode}:\n{tail}")

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def wait_for(what: str, fn: Any, procs: Procs, timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        try:
            v = fn()
        except (httpx.HTTPError, ValueError, KeyError, OSError):
            v = None
        if v:
            return v
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def stream_one(url: str, model_id: str, prompt: str, n_tokens: int, draft: str, out: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": model_id, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0,
                            "stream": True, "ignore_eos": True, "return_token_ids": True,
                            # always named: a coordinator's default drafter (ngram) would draft a "none" case
                            "draft": draft}
    ids: list[int] = []
    times: list[float] = []
    try:
        with httpx.Client(timeout=httpx.Timeout(900.0)) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"completion failed: {chunk['error']}")
                got = chunk["choices"][0].get("token_ids") or []
                if got:
                    ids.extend(got)
                    times.extend([time.monotonic()] * len(got))
    except Exception as exc:  # reported by the caller
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["ids"], out["times"] = ids, times


def decode(url: str, model_id: str, sessions: int, n_tokens: int, draft: str = "none") -> dict[str, Any]:
    """``sessions`` concurrent streamed completions: decode tokens/s in all, ms per token (mean per
    session), the token ids per session."""
    results: list[dict[str, Any]] = [{} for _ in range(sessions)]
    threads = [threading.Thread(target=stream_one, args=(url, model_id, PROMPTS[i % len(PROMPTS)], n_tokens, draft,
                                                         results[i])) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate, per = 0.0, []
    for r in results:
        if "error" in r:
            raise RuntimeError(r["error"])
        ts = r["times"]
        if len(ts) != n_tokens:
            raise RuntimeError(f"a completion returned {len(ts)} of {n_tokens} tokens")
        span = max(1e-9, ts[-1] - ts[0])
        rate += (len(ts) - 1) / span
        per.append(1000.0 * span / (len(ts) - 1))
    return {"tokens_per_s": rate, "ms_per_token": sum(per) / len(per), "ids": [r["ids"] for r in results]}


THREADS = {"coordinator": 2, "volunteer": 1}


PIDS: dict[str, int] = {}  # a coordinator's URL -> its process id


def network_thread_cpu_s(url: str) -> float | None:
    """The CPU seconds the coordinator's network thread (the main thread: trio, the API's streams and the
    dispatcher's protocol) has used (Linux: /proc; None elsewhere)."""
    pid = PIDS.get(url)
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_coordinator(procs: Procs, name: str, model: Path, sessions: int, *extra: str) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    PIDS[url] = procs.start(name, "coordinator", "--model", str(model), "--port", str(port), "--threads", str(THREADS["coordinator"]), "--slots",
                str(max(4, sessions)), "--ctx-size", "1024", "--data-dir", str(procs.work / f"{procs.tag}-{name}"), *extra).pid
    wait_for(f"{name} to start", lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, procs, 1800)
    return url


def model_id_of(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def dispatch(url: str) -> dict[str, Any]:
    d: dict[str, Any] = httpx.get(f"{url}/dispatch", timeout=10).json()
    return d


def draft_counts(url: str, drafter: str) -> tuple[float, float]:
    """(proposed, accepted) drafted tokens of ``drafter`` so far, from the coordinator's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    got = {"proposed": 0.0, "accepted": 0.0}
    for line in text.splitlines():
        if line.startswith("moe_swarm_draft_tokens_total{") and f'drafter="{drafter}"' in line:
            for outcome in got:
                if f'outcome="{outcome}"' in line:
                    got[outcome] = float(line.rsplit(" ", 1)[1])
    return got["proposed"], got["accepted"]


def n_experts(model: Path) -> int:
    from swarm.model.gguf import GGUFModel

    m = GGUFModel(model, compute_id=False)
    return int(m.config.n_moe_layer * m.config.n_expert)


class Backbone:
    """A market, the backbone coordinator and its volunteers (each behind a delaying relay when
    ``rtt_ms`` > 0)."""

    def __init__(self, work: Path, model: Path, rtt_ms: float, n_vol: int, max_sessions: int,
                 draft_model: Path | None = None) -> None:
        self.procs = Procs(work, f"bb{rtt_ms:g}")
        self.links: list[DelayLink] = []
        self.rtt_ms = rtt_ms
        try:
            mport = free_port()
            market = self.market = f"http://127.0.0.1:{mport}"
            # every volunteer speaks from 127.0.0.1: the per-address caps for strangers are lifted for the run
            self.procs.start("market", "market", "--db", str(work / f"bb{rtt_ms:g}-market.db"), "--port", str(mport),
                             "--token", "bench", "--poll-interval", "0.5", "--remote-base-target", "1",
                             "--max-leases-per-address", "100000", "--max-identities-per-address", "1000")
            wait_for("the market", lambda: httpx.get(f"{market}/health", timeout=5).status_code == 200, self.procs, 60)
            extra_c = ["--draft-model", str(draft_model)] if draft_model is not None else []
            if rtt_ms > 0:  # the volunteers dial the coordinator's data lane through a delaying relay too
                lane_port = free_port()
                lane_link = DelayLink(rtt_ms, lane_port)
                self.links.append(lane_link)
                extra_c += ["--lane-port", str(lane_port), "--lane-announce", f"127.0.0.1:{lane_link.port}"]
            self.url = start_coordinator(self.procs, "coordinator", model, max_sessions, "--local-experts", "none",
                                         "--market", market, "--token", "bench", "--draft", "none", *extra_c)
            wait_for("the coordinator to register",
                     lambda: httpx.get(f"{self.url}/health", timeout=5).json().get("market", {}).get("registered"),
                     self.procs, 600)
            self.model_id = model_id_of(self.url)
            per = -(-n_experts(model) // n_vol)
            for i in range(n_vol):
                port = free_port()
                extra = ["--listen", f"/ip4/127.0.0.1/tcp/{port}"]
                if rtt_ms > 0:
                    link = DelayLink(rtt_ms, port)
                    self.links.append(link)
                    extra += ["--announce", link.addr()]
                self.procs.start(f"volunteer-{i + 1}", "volunteer", "--market", market, "--max-experts", str(per),
                                 "--threads", str(THREADS["volunteer"]), "--no-progress", "--poll-interval", "1", "--display-name",
                                 f"volunteer-{i + 1}", "--data-dir", str(work / f"bb-volunteer-{i + 1}"), *extra)
            t0 = time.monotonic()
            wait_for("full coverage", lambda: httpx.get(f"{self.url}/health", timeout=5).json().get("coverage_holes") == 0,
                     self.procs, 3600, 0.5)
            print(f"  rtt {rtt_ms:g} ms: {n_vol} volunteers cover every expert after {time.monotonic() - t0:.1f} s",
                  flush=True)
            self.steady(max_sessions)
        except BaseException:
            self.close()
            raise

    def steady(self, sessions: int, within_s: float = 600.0) -> None:
        """Decode until every worker has proved its holdings and left probation (its calls are then
        checked only at the verify rates, as in a swarm that has run a while): the cases measure the
        steady state, not the first minute of a volunteer."""
        t0 = time.monotonic()
        while True:
            workers = dispatch(self.url)["workers"]
            waiting = [w["peer_id"][-8:] for w in workers
                       if w["probation_left"] > 0 or w["holdings_pending"] > 0 or not w["proven"] or w["state"] != "up"]
            if workers and not waiting:
                print(f"  rtt {self.rtt_ms:g} ms: every worker proven and out of probation after "
                      f"{time.monotonic() - t0:.1f} s", flush=True)
                return
            if time.monotonic() - t0 > within_s:
                raise RuntimeError(f"workers {waiting} still in probation after {within_s:.0f} s")
            decode(self.url, self.model_id, sessions, 4)

    def close(self) -> None:
        self.procs.stop_all()
        for link in self.links:
            link.close()


def layout(market: str, model_id: str, workers: list[dict[str, Any]]) -> list[list[list[Any]]]:
    """The market's dispatch map as the case ran it: per MoE layer its ranges ``[lo, hi, [volunteers]]``, each
    volunteer by its index among the coordinator's workers (what a simulation of the case partitions alike)."""
    r = httpx.get(f"{market}/api/expert-dispatch-map", params={"model": model_id},
                  headers={"Authorization": "Bearer bench"}, timeout=10)
    r.raise_for_status()
    index = {w["peer_id"]: i for i, w in enumerate(sorted(workers, key=lambda w: w["peer_id"]))}
    return [[[rg["lo"], rg["hi"], sorted(index[p["peer_id"]] for p in rg["replicas"] if p["peer_id"] in index)]
             for rg in sorted(L["ranges"], key=lambda rg: rg["lo"])]
            for L in sorted(r.json()["layers"], key=lambda L: L["layer"])]


def run_case(url: str, model_id: str, kind: str, rtt: float, sessions: int, draft: str, n_tokens: int,
             ref: dict[int, list[list[int]]] | None, market: str | None = None) -> tuple[dict[str, Any], list[list[int]]]:
    before = dispatch(url) if kind == "backbone" else None
    drafted = draft_counts(url, draft) if draft != "none" else None
    net0 = network_thread_cpu_s(url)
    r = decode(url, model_id, sessions, n_tokens, draft)
    net1 = network_thread_cpu_s(url)
    case: dict[str, Any] = {"case": kind, "rtt_ms": rtt, "sessions": sessions, "draft": draft,
                            "tokens_per_s": round(r["tokens_per_s"], 2), "ms_per_token": round(r["ms_per_token"], 2),
                            "round_trips_per_token": None, "acceptance": None, "tokens_identical": None,
                            "layer_breakdown_ms": None, "remote_share": None, "verified_rows": None,
                            "network_ms_per_token": None if net0 is None or net1 is None else
                            round(1000 * (net1 - net0) / (sessions * n_tokens), 4)}
    if ref is not None:
        case["tokens_identical"] = r["ids"] == ref[sessions]
    if before is not None:
        after = dispatch(url)
        calls = sum(w["calls"] for w in after["workers"]) - sum(w["calls"] for w in before["workers"])
        case["round_trips_per_token"] = round(calls / (sessions * n_tokens), 2)
        rows = {k: sum(L[k] for L in after["layers"]) - sum(L[k] for L in before["layers"])
                for k in ("local_rows", "remote_rows", "fallback_rows", "verified_rows")}
        # the share of routed rows the volunteers answered (the rest: computed here from disk, a fallback)
        case["remote_share"] = round(rows["remote_rows"] / max(1, rows["remote_rows"] + rows["local_rows"]), 4)
        case["verified_rows"] = rows["verified_rows"]
        case["layer_breakdown_ms"] = after.get("layer_path")
        # why the calls are what they are: placements, hedges, retries by reason over the case
        d0, d1 = before.get("decisions") or {}, after.get("decisions") or {}
        case["decisions"] = {k: d1[k] - d0.get(k, 0) for k in sorted(d1) if d1[k] - d0.get(k, 0)}
        if market is not None:
            case["layout"] = layout(market, model_id, after["workers"])
    if drafted is not None:
        proposed, accepted = draft_counts(url, draft)
        dp, da = proposed - drafted[0], accepted - drafted[1]
        case["acceptance"] = round(da / dp, 3) if dp else 0.0
    return case, r["ids"]


def print_table(cases: list[dict[str, Any]]) -> None:
    print()
    print(f"{'case':<10} {'rtt ms':>6} {'sess':>4} {'draft':>6} {'tok/s':>8} {'ms/tok':>8} {'x local':>7} "
          f"{'rt/tok':>6} {'remote':>6} {'accept':>6} {'same':>5}  breakdown of a remote layer (ms)")
    local = {(c["sessions"], c.get("pair")): c for c in cases if c["case"] == "all_local"}
    for c in cases:
        ref = local.get((c["sessions"], c.get("pair"))) or next(
            (v for k, v in local.items() if k[0] == c["sessions"]), None)
        ratio = f"{c['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref and c["case"] == "backbone" else ""
        bd = c.get("layer_breakdown_ms") or {}
        keys = ("dense", "place", "encode", "to_trio", "wire", "queue", "compute", "core", "wake", "combine", "total",
                "crossings")
        b = " ".join(f"{k} {bd[k]:.2f}" for k in keys if k in bd and bd.get("layers")) if bd else ""
        acc = "" if c.get("acceptance") is None else f"{c['acceptance']:.2f}"
        rt = "" if c.get("round_trips_per_token") is None else f"{c['round_trips_per_token']:.1f}"
        same = "" if c.get("tokens_identical") is None else str(c["tokens_identical"])
        remote = "" if c.get("remote_share") is None else f"{c['remote_share']:.2f}"
        print(f"{c['case']:<10} {c['rtt_ms']:>6g} {c['sessions']:>4} {c['draft']:>6} {c['tokens_per_s']:>8.2f} "
              f"{c['ms_per_token']:>8.2f} {ratio:>7} {rt:>6} {remote:>6} {acc:>6} {same:>5}  {b}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small shape, rtt 0 and 20 ms, 1 and 4 sessions")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape, rtt 0, one session, a few tokens")
    ap.add_argument("--json", default=None)
    ap.add_argument("--size", default=None, choices=["tiny", "small", "bench", "30b-a3b"])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=None)
    ap.add_argument("--sessions", type=int, nargs="+", default=None)
    ap.add_argument("--draft", nargs="+", default=None, choices=DRAFTS)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per completion")
    ap.add_argument("--draft-qtype", default="Q4_0",
                    help="the 'model' drafter's experts (make-model --draft-of --qtype): Q4_0 (default) or Q8_0")
    ap.add_argument("--work", default=None, help="models, slices, logs (default: a folder in /tmp)")
    ap.add_argument("--coordinator-threads", type=int, default=2, help="--threads of both coordinators (default 2)")
    ap.add_argument("--volunteer-threads", type=int, default=1, help="--threads of each volunteer (default 1)")
    a = ap.parse_args()
    THREADS.update(coordinator=a.coordinator_threads, volunteer=a.volunteer_threads)
    if a.smoke:
        size, rtts, sess, drafts, n_tokens = "tiny", [0.0], [1], ["none"], 6
    elif a.quick:
        size, rtts, sess, drafts, n_tokens = "small", [0.0, 20.0], [1, 4], list(DRAFTS), 64
    else:
        size, rtts, sess, drafts, n_tokens = "30b-a3b", [0.0, 20.0, 50.0], [1, 4, 8], list(DRAFTS), 16
    size = a.size or size
    rtts = a.rtt_ms or rtts
    sess = a.sessions or sess
    drafts = a.draft or drafts
    n_tokens = a.tokens or n_tokens
    n_vol = 4 if size == "30b-a3b" else 2
    work = Path(a.work) if a.work else Path(tempfile.gettempdir()) / f"moe-swarm-backbone-{size}"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("bb*"):  # slices and databases of an earlier run: this run starts from none (the
        # volunteers keep their data dirs, slices and identities from one round trip's world to the next)
        subprocess.run(["rm", "-rf", str(old)], check=True)
    model = work / f"{size}.gguf"
    if not model.exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "swarm.cli", "make-model", "--size", size, "--out", str(model)], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
        print(f"make-model --size {size}: {model.stat().st_size / (1 << 30):.2f} GiB in {time.monotonic() - t0:.0f} s")
    # the "model" drafter: the same random model with its experts in Q4_0 (make-model --draft-of; a size whose
    # experts are random blocks has no such draft: the case is left out and the table says so)
    draft_model: Path | None = None
    if "model" in drafts:
        cand = work / f"{size}-draft-{a.draft_qtype.lower()}.gguf"
        if not cand.exists():
            r = subprocess.run([sys.executable, "-m", "swarm.cli", "make-model", "--draft-of", str(model), "--qtype",
                                a.draft_qtype, "--out", str(cand)], cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"  no draft model for {size}: {r.stderr.strip().splitlines()[-1] if r.stderr else r.returncode}")
        if cand.exists():
            draft_model = cand
        else:
            drafts = [d for d in drafts if d != "model"]
    interleave = size != "30b-a3b"
    cases: list[dict[str, Any]] = []
    ref_procs = Procs(work, "ref")
    ref: dict[int, list[list[int]]] = {}
    t_start = time.monotonic()
    try:
        if not interleave:  # the reference is measured from memory, not from the disk: its file read once first
            t0, n = time.monotonic(), 0
            with open(model, "rb", buffering=0) as f:
                while chunk := f.read(64 << 20):
                    n += len(chunk)
            print(f"  {model.name}: {n / (1 << 30):.1f} GiB read into the page cache in {time.monotonic() - t0:.0f} s",
                  flush=True)
        ref_url = start_coordinator(ref_procs, "all-local", model, max(sess), "--local-experts", "all")
        mid = model_id_of(ref_url)
        decode(ref_url, mid, 1, 4)  # warm-up: graphs and pages
        for n in sess:
            c, ids = run_case(ref_url, mid, "all_local", 0.0, n, "none", n_tokens, None)
            ref[n] = ids
            cases.append(c)
            print(f"  all-local {n} session(s): {c['tokens_per_s']:.2f} tokens/s", flush=True)
        if not interleave:
            ref_procs.stop_all()
            # and its pages leave the cache: read twice they are the kernel's "active" ones, and the
            # volunteers' slices (written once) would be evicted first -- the backbone then reads its
            # experts from the disk (0.7 tokens/s instead of 2+ measured so)
            fd = os.open(model, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        for rtt in rtts:
            world = Backbone(work, model, rtt, n_vol, max(sess), draft_model)
            try:
                decode(world.url, world.model_id, max(sess), 4)  # warm-up: connections, hold proofs, graphs
                for n in sess:
                    for draft in drafts:
                        if interleave:
                            c, _ = run_case(ref_url, mid, "all_local", rtt, n, "none", n_tokens, ref)
                            c["pair"] = (rtt, n, draft)
                            cases.append(c)
                        c, _ = run_case(world.url, world.model_id, "backbone", rtt, n, draft, n_tokens, ref, world.market)
                        c["pair"] = (rtt, n, draft)
                        cases.append(c)
                        print(f"  backbone rtt {rtt:g} ms, {n} session(s), draft {draft}: {c['tokens_per_s']:.2f} "
                              f"tokens/s, identical {c['tokens_identical']}", flush=True)
            finally:
                world.close()
    finally:
        ref_procs.stop_all()
    print_table(cases)
    for c in cases:
        c.pop("pair", None)
    print(f"\nbackbone ({size}, {n_vol} volunteers, {n_tokens} tokens per completion): {time.monotonic() - t_start:.0f} s")
    write_json(a.json, {"benchmark": "backbone", "size": size, "volunteers": n_vol, "tokens": n_tokens, "cases": cases})


if __name__ == "__main__":
    main()
