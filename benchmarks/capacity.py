"""Serve a model no participant holds (issue 12): a backbone coordinator with no experts in memory,
the experts on volunteers, each process within a memory cap (DESIGN §11 format).

    python benchmarks/capacity.py [--quick | --smoke] [--json OUT] [--work DIR] [--tokens N]

Default: the ``30b-a3b`` shape (Qwen3-30B-A3B: 48 layers x 128 experts, top-8, Q4_0 experts, about
16 GB of experts; written once by ``moe-swarm make-model`` into ``--work``), four volunteers.
``--quick``: the ``small`` shape (4 layers x 16 experts), two volunteers, in a few minutes.
``--smoke`` (``make test``): the ``tiny`` shape, two volunteers, 6 tokens, no kill: seconds.

Real processes on loopback:
1. **Reference** (a separate run): ``moe-swarm coordinator --local-experts all`` alone on the same
   file: greedy completions of fixed prompts (``ignore_eos``, token ids returned) at 1 and 4
   sessions. Its tokens are the reference; its tokens/s is printed for comparison.
2. **Backbone**: a market (SQLite; ``--remote-base-target 1``), the coordinator with ``--local-experts
   none --slots 4 --ctx-size 2048`` within ``COORD_CAP`` and N volunteers with ``--max-memory
   VOL_CAP`` (their peak-RSS budget; the slice budget is what their baseline leaves). Each process
   runs in its own memory cgroup (v1, ``memory.limit_in_bytes`` = its cap; skipped with a note when
   cgroups are not writable), and its peak RSS is its ``VmHWM``, read just before it is stopped.
   ``coverage_s``: from starting the volunteers until the coordinator's ``/health`` shows no coverage
   hole. Then the same completions as the reference at 1 and 4 sessions: ``tokens_identical``.
3. **Kill the only replica** (``--quick`` only: the machine has no room for a spare 30b volunteer):
   once the extra replicas the load recruited have aged out, a spare volunteer starts and idles
   (nothing scarce); during a streamed completion the volunteer holding layer 0 is killed; the
   market re-offers its slices, the spare fetches and serves them; ``stall_s`` is the longest gap
   between streamed tokens and the completion's tokens must equal the reference.

Decode tokens/s is measured on streamed completions: (tokens - 1) / (time of last token - time of
first token), so the prompt's prefill is not counted; at 4 sessions the sum over sessions.

Threads (the machine has 2 cores): the coordinator computes attention with 2 threads, each volunteer
its experts with 1; in a sequential decode only one of them computes at a time.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402

T = TypeVar("T")
GIB = 1 << 30
MIB = 1 << 20
CG_ROOT = Path("/sys/fs/cgroup/memory")
PROMPTS = ["The swarm serves a model that no single machine can hold,",
           "Experts are routed per token; the backbone keeps attention and",
           "A volunteer on a desktop behind NAT pulls a slice and",
           "Capacity grows with every machine that joins:"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = fn()
        except (httpx.HTTPError, ValueError, KeyError):
            v = None
        if v:
            return v
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Procs:
    """Processes of one run, each optionally in its own memory cgroup; logs in ``work``."""

    def __init__(self, work: Path, tag: str) -> None:
        self.work, self.tag = work, tag
        self.procs: dict[str, tuple[subprocess.Popen[bytes], int | None]] = {}
        self.cgroups = os.access(CG_ROOT, os.W_OK)
        self.peaks: dict[str, dict[str, Any]] = {}

    def _cgroup(self, name: str, cap: int) -> Path | None:
        if not self.cgroups:
            return None
        cg = CG_ROOT / f"moe-swarm-capacity-{self.tag}-{name}"
        if cg.exists():
            cg.rmdir()
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(cap))
        return cg

    def start(self, name: str, *args: str, cap: int | None = None) -> subprocess.Popen[bytes]:
        log = open(self.work / f"{self.tag}-{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        cmd = [sys.executable, "-m", "swarm.cli", "--log-level", "INFO", *args]
        cg = self._cgroup(name, cap) if cap is not None else None
        if cg is not None:  # enter the cgroup, then become the process: its pid is the one measured
            cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self.procs[name] = (p, cap)
        return p

    def measure(self, name: str) -> dict[str, Any]:
        p, cap = self.procs[name]
        out: dict[str, Any] = {"case": name, "peak_rss_mb": round(vm_hwm(p.pid) / MIB, 1),
                               "cap_mb": round(cap / MIB) if cap is not None else None}
        cg = CG_ROOT / f"moe-swarm-capacity-{self.tag}-{name}"
        if cap is not None and self.cgroups and cg.exists():
            out["cgroup_max_usage_mb"] = round(int((cg / "memory.max_usage_in_bytes").read_text()) / MIB, 1)
            out["cgroup_limit_hits"] = int((cg / "memory.failcnt").read_text())
        out["alive"] = p.poll() is None
        self.peaks[name] = out
        return out

    def kill(self, name: str) -> None:
        p, _ = self.procs[name]
        if p.poll() is None:
            p.kill()
            p.wait(30)

    def stop_all(self) -> None:
        for p, _ in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, _ in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self.cgroups:
            for name in self.procs:
                cg = CG_ROOT / f"moe-swarm-capacity-{self.tag}-{name}"
                for _ in range(50):
                    try:
                        if cg.exists():
                            cg.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)


def stream_one(url: str, model_id: str, prompt: str, n_tokens: int, out: dict[str, Any]) -> None:
    """A streamed greedy completion: token ids and the time each streamed chunk arrived."""
    body = {"model": model_id, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    ids: list[int] = []
    times: list[float] = []
    with httpx.Client(timeout=httpx.Timeout(600.0)) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
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
    out["ids"], out["times"] = ids, times


def decode(url: str, model_id: str, sessions: int, n_tokens: int) -> tuple[float, list[list[int]], float]:
    """``sessions`` concurrent streamed completions: (decode tokens/s in all, token ids per prompt, max gap s)."""
    results: list[dict[str, Any]] = [{} for _ in range(sessions)]
    threads = [threading.Thread(target=stream_one, args=(url, model_id, PROMPTS[i % len(PROMPTS)], n_tokens, results[i]))
               for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate, gap = 0.0, 0.0
    for r in results:
        ts = r.get("times", [])
        if len(ts) != n_tokens:
            raise RuntimeError(f"a completion returned {len(ts)} of {n_tokens} tokens")
        rate += (len(ts) - 1) / max(1e-9, ts[-1] - ts[0])
        gap = max(gap, max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0))
    return rate, [r["ids"] for r in results], gap


def start_coordinator(procs: Procs, name: str, model: Path, port: int, *extra: str, cap: int | None = None) -> str:
    url = f"http://127.0.0.1:{port}"
    procs.start(name, "coordinator", "--model", str(model), "--port", str(port), "--threads", "2", "--slots", "4",
                "--ctx-size", "2048", "--data-dir", str(procs.work / f"{procs.tag}-{name}"), *extra, cap=cap)
    wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 1800, f"{name} to start")
    return url


def model_id_of(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def reference(model: Path, work: Path, n_tokens: int) -> tuple[dict[int, list[list[int]]], list[dict[str, Any]]]:
    procs = Procs(work, "ref")
    cases: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        url = start_coordinator(procs, "reference", model, free_port(), "--local-experts", "all")
        mid = model_id_of(url)
        print(f"reference: all-local coordinator up in {time.monotonic() - t0:.1f} s", flush=True)
        decode(url, mid, 1, 4)  # warm-up
        tokens: dict[int, list[list[int]]] = {}
        for sessions in (1, 4):
            rate, ids, _ = decode(url, mid, sessions, n_tokens)
            tokens[sessions] = ids
            cases.append({"case": f"reference_c{sessions}", "tokens_per_s": round(rate, 2), "sessions": sessions})
            print(f"reference: {sessions} session(s): {rate:.2f} tok/s", flush=True)
        cases.append({**procs.measure("reference"), "case": "reference_process"})
    finally:
        procs.stop_all()
    return tokens, cases


def backbone(model: Path, work: Path, n_tokens: int, *, n_vol: int, coord_cap: int, vol_cap: int, quick: bool,
             ref: dict[int, list[list[int]]], kill: bool = True) -> list[dict[str, Any]]:
    procs = Procs(work, "bb")
    cases: list[dict[str, Any]] = []
    try:
        mport = free_port()
        market = f"http://127.0.0.1:{mport}"
        procs.start("market", "market", "--db", str(work / "bb-market.db"), "--port", str(mport), "--token", "cap",
                    "--poll-interval", "0.5", "--remote-base-target", "1",
                    "--max-leases-per-address", "100000", "--max-identities-per-address", "1000")  # all on 127.0.0.1
        wait_for(lambda: httpx.get(f"{market}/health", timeout=5).status_code == 200, 60, "the market")
        t0 = time.monotonic()
        url = start_coordinator(procs, "coordinator", model, free_port(), "--local-experts", "none", "--market", market,
                                "--token", "cap", cap=coord_cap)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).json().get("market", {}).get("registered"), 600,
                 "the coordinator to register")
        mid = model_id_of(url)
        print(f"backbone: coordinator up and registered in {time.monotonic() - t0:.1f} s", flush=True)
        extra = ["--max-experts", str(_experts(model) // n_vol)] if quick else []
        t_cov = time.monotonic()
        for i in range(n_vol):
            procs.start(f"volunteer-{i + 1}", "volunteer", "--market", market, "--max-memory", f"{vol_cap}B", *extra,
                        "--threads", "1", "--no-progress", "--poll-interval", "1", "--data-dir",
                        str(work / f"bb-volunteer-{i + 1}"), cap=vol_cap)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).json().get("coverage_holes") == 0, 3600,
                 "full coverage", interval=0.5)
        coverage_s = time.monotonic() - t_cov
        print(f"backbone: full coverage {coverage_s:.1f} s after the volunteers started", flush=True)
        decode(url, mid, 1, 4)  # warm-up: connections, hold proofs
        same = True
        for sessions in (1, 4):
            rate, ids, _ = decode(url, mid, sessions, n_tokens)
            same = same and ids == ref[sessions]
            cases.append({"case": f"decode_c{sessions}", "tokens_per_s": round(rate, 2), "sessions": sessions})
            print(f"backbone: {sessions} session(s): {rate:.2f} tok/s, tokens identical: {ids == ref[sessions]}", flush=True)
        d = httpx.get(f"{url}/dispatch", timeout=10).json()
        local_rows = sum(r["local_rows"] for r in d["layers"])
        check: dict[str, Any] = {"case": "check", "tokens_identical": same, "coverage_s": round(coverage_s, 1),
                                 "coordinator_local_rows": local_rows}
        if quick and kill:
            check.update(_kill_only_replica(procs, market, url, mid, n_tokens, n_vol, vol_cap, extra, ref[1][0]))
        cases.append(check)
        for name in procs.procs:
            if name != "market" and not name.startswith("volunteer-spare"):
                # a killed volunteer was measured just before it died
                cases.append(procs.peaks[name] if name in procs.peaks else procs.measure(name))
    finally:
        procs.stop_all()
    return cases


def _kill_only_replica(procs: Procs, market: str, url: str, mid: str, n_tokens: int, n_vol: int, vol_cap: int,
                       extra: list[str], want: list[int]) -> dict[str, Any]:
    # the load of the cases before recruited extra replicas: wait until they aged out, so the spare idles
    def settled() -> bool:
        m = httpx.get(f"{market}/api/moe/recruitment", timeout=10).json()["models"][0]
        return not m["recruiting"] and all(s["state"] == "dispatched" for w in m["workers"] for s in w["slices"])

    wait_for(settled, 300, "recruitment to end and its extra replicas to age out", 0.5)
    spare_dir = procs.work / "bb-volunteer-spare"
    procs.start("volunteer-spare", "volunteer", "--market", market, "--max-memory", f"{vol_cap}B", *extra, "--threads", "1",
                "--no-progress", "--poll-interval", "1", "--data-dir", str(spare_dir), cap=vol_cap)

    def spare_idle() -> bool:
        r = subprocess.run([sys.executable, "-m", "swarm.cli", "volunteer", "status", "--json", "--data-dir", str(spare_dir)],
                           capture_output=True, text=True, timeout=30, cwd=ROOT)
        return r.returncode == 0 and json.loads(r.stdout)["waiting_for"] == "idle: nothing_scarce"

    wait_for(spare_idle, 120, "the spare volunteer to idle", 0.5)
    workers = httpx.get(f"{market}/api/moe/recruitment", timeout=10).json()["models"][0]["workers"]
    victim_peer = next(w["peer_id"] for w in workers if any(s["layer"] == 0 for s in w["slices"]))
    victim = next(f"volunteer-{i + 1}" for i in range(n_vol)
                  if victim_peer in (procs.work / f"bb-volunteer-{i + 1}" / "volunteer.json").read_text())
    out: dict[str, Any] = {}
    t = threading.Thread(target=stream_one, args=(url, mid, PROMPTS[0], n_tokens, out))
    t.start()
    # kill once the stream has produced a few tokens: poll the coordinator's slots for progress
    wait_for(lambda: any(s["n_decoded"] >= 3 for s in httpx.get(f"{url}/slots", timeout=5).json()), 120,
             "the stream to start", 0.02)
    procs.measure(victim)
    procs.kill(victim)
    t.join()
    ts = out["times"]
    stall = max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)
    print(f"kill: {victim} killed mid-stream; longest gap between tokens {stall:.2f} s; "
          f"tokens identical: {out['ids'] == want}", flush=True)
    return {"killed": victim, "stall_s": round(stall, 2), "after_kill_tokens_identical": out["ids"] == want}


def _experts(model: Path) -> int:
    from swarm.model.gguf import GGUFModel

    m = GGUFModel(model, compute_id=False)
    return int(m.config.n_moe_layer * m.config.n_expert)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small shape, two volunteers")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape, two volunteers, a few tokens, no kill (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--work", default=None, help="models, slices, logs (default: a folder in /tmp, kept for 30b-a3b)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per completion (default 32 quick, 16 30b)")
    a = ap.parse_args()
    small = a.quick or a.smoke
    size = "tiny" if a.smoke else "small" if a.quick else "30b-a3b"
    n_vol = 2 if small else 4
    coord_cap, vol_cap = (1 * GIB, 1 * GIB) if small else (4 * GIB, 5 * GIB)
    n_tokens = a.tokens or (6 if a.smoke else 32 if a.quick else 16)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="moe-swarm-capacity-")) if a.smoke else \
        Path(tempfile.gettempdir()) / f"moe-swarm-capacity-{size}"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("bb-*"):  # slices and databases of an earlier run: this run starts from none
        subprocess.run(["rm", "-rf", str(old)], check=True)
    model = work / f"{size}.gguf"
    if not model.exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "swarm.cli", "make-model", "--size", size, "--out", str(model)], check=True,
                       cwd=ROOT)
        print(f"make-model --size {size}: {model.stat().st_size / GIB:.1f} GiB in {time.monotonic() - t0:.0f} s")
    ref, ref_cases = reference(model, work, n_tokens)
    cases = backbone(model, work, n_tokens, n_vol=n_vol, coord_cap=coord_cap, vol_cap=vol_cap, quick=small, ref=ref,
                     kill=not a.smoke)
    cases += ref_cases
    print()
    print(f"capacity ({size}, {n_vol} volunteers, {n_tokens} tokens per completion; cgroups "
          f"{'enforced' if os.access(CG_ROOT, os.W_OK) else 'NOT enforced (not writable)'})")
    print(f"{'case':<20} {'peak RSS MB':>12} {'cap MB':>8} {'cgroup max MB':>14} {'tok/s':>8}  other")
    for c in cases:
        other = {k: v for k, v in c.items() if k not in {"case", "peak_rss_mb", "cap_mb", "cgroup_max_usage_mb",
                                                          "tokens_per_s"}}
        print(f"{c['case']:<20} {c.get('peak_rss_mb', ''):>12} {c.get('cap_mb') or '':>8} "
              f"{c.get('cgroup_max_usage_mb', ''):>14} {c.get('tokens_per_s', ''):>8}  {other or ''}")
    write_json(a.json, {"benchmark": "capacity", "size": size, "volunteers": n_vol, "tokens": n_tokens, "cases": cases})


if __name__ == "__main__":
    main()
