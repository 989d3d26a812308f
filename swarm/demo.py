"""``make demo``: the whole system on one machine, as real processes on loopback (shell).

What it does, in order, printing as it goes:
1. generates the tiny qwen3moe model (``moe-swarm make-model``) into ``demo-data/``;
2. starts a circuit relay, the market (SQLite; it offers the relay to volunteers) and the
   coordinator (registered with the market) as real processes;
3. one streamed chat answer through the official ``openai`` client, then four concurrent greedy
   requests computed all-local: the reference tokens;
4. starts three pull-mode volunteers (one of them listens nowhere and is reachable only through
   the relay): two take the slices the base target needs, one stays idle;
5. one request at a time (the coordinator idle): its experts run locally -- the fastest path per
   token -- although volunteers hold them (load-adaptive dispatch, DESIGN §5);
6. ramps the load (1 then 3 concurrent streams): the coordinator saturates, its dispatcher splits
   each layer between itself and the proven volunteers by earliest finish (a new one gets a hedged
   trial first) and measures whether that pays here (windows local / split / local: the faster is
   kept for 30 s, the timeline prints the verdict with both rates), the
   market boosts the target, the idle volunteer is recruited and serves; the reference requests
   repeated under load give identical tokens; every switch of the dispatcher prints with its reason;
7. the load stops: after the serve TTL the dispatcher is local again, the boost ends, the extra
   volunteer is undispatched and released (age-out);
8. second act, a backbone coordinator: another coordinator of the same model joins holding no
   expert (``--local-experts none``); the market now wants two replicas of every expert, recruits
   the idle volunteer and a fourth one, which download their slices from the volunteers already
   serving them (``/moe-swarm/slice/1``, every expert checked against the manifest) rather than from
   a coordinator; each proves it holds its slice (hold challenge); the reference requests through
   the backbone give the same tokens with every expert computed by volunteers, checked on a second
   replica;
9. prints ``/api/moe/recruitment`` and stops every process it started, cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

__all__ = ["main"]

ROOT = Path.cwd()
DATA = ROOT / "demo-data"


def say(msg: str) -> None:
    print(f"\033[1m==> {msg}\033[0m", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", *args]


class Procs:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(DATA / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append((name, p))
        return p

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                print(f"    {name} did not stop in 15 s; killing it")
                p.kill()
                p.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {DATA / (name + '.log')}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{name} did not become healthy in {timeout} s")


def start_volunteer(procs: Procs, name: str, extra: list[str]) -> subprocess.Popen[bytes]:
    return procs.start(name, cli("volunteer", "--data-dir", str(DATA / name), "--no-progress", "--poll-interval", "1", *extra))


def show_downloads(name: str, names: dict[str, str]) -> None:
    """One line: a volunteer's slices, the bytes it downloaded by source and what it shared (its status)."""
    r = subprocess.run(cli("volunteer", "status", "--json", "--data-dir", str(DATA / name)), capture_output=True, text=True,
                       timeout=30, cwd=ROOT)
    if r.returncode != 0:
        print(f"    {name}: no status ({r.stderr.strip()[:200]})")
        return
    st = json.loads(r.stdout)
    parts = []
    for src, n in sorted(st.get("downloaded", {}).items()):
        kind, _, who = src.partition(" ")
        label = f"peer {names.get(who, who[-8:])}" if kind == "peer" else kind
        parts.append(f"{n / 1024:.0f} KiB from {label}")
    slices = ", ".join(x["slice"] for x in st.get("slices", [])) or "none"
    print(f"    {name}: serves {slices}; downloaded {', '.join(parts) or 'nothing'}; "
          f"shared {st.get('shared_bytes', 0) / 1024:.0f} KiB with other volunteers")


def start_relay(procs: Procs) -> str:
    """Start ``moe-swarm relay`` on loopback; returns its multiaddr (with /p2p/ID)."""
    log = DATA / "relay.log"
    p = procs.start("relay", cli("relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--port", "0", "--data-dir", str(DATA / "relay")))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"the relay exited; see {log}")
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("relay ready "):
                addrs = line.split("addrs=", 1)[1].split()[0]
                return addrs.split(",")[0]
        time.sleep(0.1)
    raise SystemExit("the relay did not start in 60 s")


def recruitment(market: str) -> dict[str, Any]:
    model: dict[str, Any] = httpx.get(f"{market}/api/moe/recruitment", timeout=5).json()["models"][0]
    return model


def _targets(m: dict[str, Any]) -> str:
    """The effective target, and the remote experts' one when some coordinator holds no copy of them."""
    remote = m.get("remote_target")
    return str(m["effective_target"]) if remote is None else f"{m['effective_target']} (not held: {remote})"


def timeline_line(t0: float, market: str, coord: str, names: dict[str, str]) -> str:
    m = recruitment(market)
    rep = httpx.get(f"{coord}/dispatch", timeout=5).json()
    served = {w["peer_id"]: w for w in rep["workers"]}
    parts = []
    for w in m["workers"]:
        name = names.get(w["peer_id"], w["peer_id"][-6:])
        d = served.get(w["peer_id"])
        state = "serving" if d is not None and d["last_serve_ms"] > 0 else ("dispatched" if w["dispatched"] else "draining")
        path = f"/{d['path']}" if d is not None and d.get("path") else ""
        parts.append(f"{name}:{state}{path}")
    return (f"    t={time.monotonic() - t0:5.1f}s busy={m['busy']}/{m['slots']} saturated={str(m['saturated']):5} "
            f"recruiting={str(m['recruiting']):5} target={_targets(m)} dispatch={rep.get('load_state', '?'):9} "
            f"workers=[{', '.join(parts)}]")


def dispatch_report(coord: str) -> dict[str, Any]:
    rep: dict[str, Any] = httpx.get(f"{coord}/dispatch", timeout=5).json()
    return rep


def rows_since(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int, int, int]:
    """Rows computed (local, remote, fallback, verified) between two ``/dispatch`` reports, over all layers."""
    def tot(rep: dict[str, Any], key: str) -> int:
        return sum(int(L.get(key, 0)) for L in rep["layers"])

    return tuple(tot(after, k) - tot(before, k)  # type: ignore[return-value]
                 for k in ("local_rows", "remote_rows", "fallback_rows", "verified_rows"))


def decisions_since(before: dict[str, Any], after: dict[str, Any]) -> str:
    d0, d1 = before.get("decisions", {}), after.get("decisions", {})
    diff = {k: v - d0.get(k, 0) for k, v in d1.items() if v - d0.get(k, 0)}
    return ", ".join(f"{k} {v}" for k, v in sorted(diff.items(), key=lambda kv: -kv[1])) or "none"


def split_checks_since(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The split check's verdicts (``/dispatch`` ``mode_changes`` with a ``split_*`` reason) in
    ``after`` that ``before`` did not have yet."""
    seen = {(c["at_ms"], c["reason"]) for c in before.get("mode_changes", [])}
    return [c for c in after.get("mode_changes", [])
            if c["reason"].startswith("split_") and (c["at_ms"], c["reason"]) not in seen]


class ModeLog:
    """Prints the dispatcher's load-state switches (``/dispatch`` ``mode_changes``) once each."""

    def __init__(self, t0_ms: int) -> None:
        self.t0_ms = t0_ms
        self.seen: set[tuple[int, str, str]] = set()

    def show(self, rep: dict[str, Any]) -> None:
        for c in rep.get("mode_changes", []):
            key = (int(c["at_ms"]), c["state"], c["reason"])
            if key not in self.seen:
                self.seen.add(key)
                detail = f": {c['detail']}" if c.get("detail") else ""
                print(f"    dispatcher -> {c['state']} ({c['reason']}{detail}) at t={(key[0] - self.t0_ms) / 1000:5.1f}s",
                      flush=True)


def keep_running(market: str, client: openai.OpenAI, model_id: str, stream_worker: Any) -> None:
    """``make demo KEEP=1``: the cluster stays up with its load ramp on a loop (20 s of three streams,
    then 25 s idle) until Ctrl-C, for looking at the dashboard."""
    say(f"KEEP=1: the cluster keeps running -- open {market}/dashboard; Ctrl-C stops it")
    pool = ThreadPoolExecutor(3)
    try:
        while True:
            print("    load: three streams for 20 s", flush=True)
            futs = [pool.submit(stream_worker, time.monotonic() + 20.0) for _ in range(3)]
            for f in futs:
                f.result()
            print("    idle for 25 s", flush=True)
            time.sleep(25.0)
    except KeyboardInterrupt:
        print("\n    Ctrl-C: stopping", flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # streams in flight end when the coordinator stops


def main() -> None:
    DATA.mkdir(exist_ok=True)
    from swarm.model.gguf import model_id_for
    from swarm.tools.makemodel import make_model

    model_path = DATA / "tiny-qwen3moe.gguf"
    say(f"generating the tiny qwen3moe model -> {model_path.relative_to(ROOT)}")
    make_model(arch="qwen3moe", size="tiny", seed=0, out=model_path)
    model_id = model_id_for(model_path)
    for stale in DATA.glob("market.db*"):
        stale.unlink()
    for cache in DATA.glob("volunteer-*/slices"):  # every run shows the downloads (and where they came from)
        shutil.rmtree(cache)
    procs = Procs()
    try:
        mport, cport = free_port(), free_port()
        market, coord = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{cport}"
        say("starting a circuit relay (for volunteers nobody can dial)")
        relay_addr = start_relay(procs)
        print(f"    relay: {relay_addr}")
        say(f"starting the market on {market} (SQLite {DATA.relative_to(ROOT)}/market.db; base target 1, boost +1)")
        mp = procs.start("market", cli("market", "--db", str(DATA / "market.db"), "--port", str(mport), "--token", "demo",
                                       "--poll-interval", "0.5", "--hold-s", "3", "--cooldown-s", "3",
                                       "--relay", relay_addr))
        wait_healthy(market, mp, "market")
        say(f"starting the coordinator on {coord} (4 slots; saturated at 2 busy; serve TTL 5 s; split check windows 1 s)")
        # the demo's load act is short (16 s): 1 s windows let the split check reach a verdict in it
        cp = procs.start("coordinator", cli("coordinator", "--model", str(model_path), "--port", str(cport), "--slots", "4",
                                            "--data-dir", str(DATA / "coordinator"), "--market", market, "--token", "demo",
                                            "--saturation-threshold", "2", "--serve-ttl", "5", "--split-check", "1"))
        wait_healthy(coord, cp, "coordinator")
        client = openai.OpenAI(base_url=coord + "/v1", api_key="demo", max_retries=0)
        print(f"    model id: {model_id}")

        say("one streamed chat request through the openai client")
        print("    assistant: ", end="", flush=True)
        for ev in client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Tell me about mixture of experts."}],
            max_tokens=32, temperature=0.7, seed=1, stream=True,
        ):
            for ch in ev.choices:
                if ch.delta.content:
                    print(ch.delta.content, end="", flush=True)
        print("\n    (random weights, so the words are noise)")

        prompts = ["What is a relay?", "Explain NAT.", "Why volunteer compute?", "Count to five."]

        def ask(p: str, via: openai.OpenAI = client) -> tuple[str, list[int], float]:
            t = time.monotonic()
            r = via.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": p}], max_tokens=48, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            ids = list((r.choices[0].model_extra or {}).get("token_ids", []))
            return p, ids, time.monotonic() - t

        def run_batch(label: str, via: openai.OpenAI = client) -> list[list[int]]:
            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda p: ask(p, via), prompts))
            wall = time.monotonic() - t0
            total = sum(len(ids) for _, ids, _ in results)
            print(f"    {label}: 4 requests, {total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s aggregate")
            return [ids for _, ids, _ in results]

        say("reference: four concurrent greedy requests with every expert on the coordinator (all-local)")
        local = run_batch("all-local")

        say("three volunteers start in pull mode (real processes, each with a budget of 8 experts);")
        print("    volunteer-1 does not listen at all (--no-direct --no-hole-punch): reachable only through the relay")
        start_volunteer(procs, "volunteer-1", ["--market", market, "--max-experts", "8", "--no-direct", "--no-hole-punch"])
        for i in (2, 3):
            start_volunteer(procs, f"volunteer-{i}", ["--market", market, "--max-experts", "8"])
        names: dict[str, str] = {}
        t0 = time.monotonic()
        deadline = t0 + 90
        while time.monotonic() < deadline:
            for i in range(3):
                f = DATA / f"volunteer-{i + 1}" / "volunteer.json"
                if f.exists():
                    names[json.loads(f.read_text())["peer_id"]] = f"volunteer-{i + 1}"
            m = recruitment(market)
            if len(names) == 3 and len(m["workers"]) == 2 and m["replicas_min"] >= 1:
                break
            time.sleep(0.5)
        print(timeline_line(t0, market, coord, names))
        print("    base target covered: two volunteers hold one layer each; the third has nothing to do yet")

        say("idle: one request at a time -- the coordinator computes the experts it holds itself")
        modes = ModeLog(int(time.time() * 1000))
        before = dispatch_report(coord)
        for p in prompts[:2]:
            ask(p)
        after = dispatch_report(coord)
        loc, rem, fb, _ = rows_since(before, after)
        print(f"    2 requests: rows local {loc}, remote {rem}, fallback {fb}; decisions: {decisions_since(before, after)}")
        print("    (a round trip per layer would only slow each token; volunteers pay off when the coordinator is busy)")
        modes.show(after)

        say("load ramp through the OpenAI API: 1 stream, then 3 streams (saturation)")
        stop_at = [time.monotonic() + 3.0, time.monotonic() + 16.0]

        def stream_worker(until: float) -> int:
            n = 0
            while time.monotonic() < until:
                r = client.completions.create(model=model_id, prompt="load", max_tokens=40, temperature=0,
                                              extra_body={"ignore_eos": True})
                n += r.usage.completion_tokens if r.usage else 0
            return n

        t0 = time.monotonic()
        before = dispatch_report(coord)
        pool = ThreadPoolExecutor(4)
        futs = [pool.submit(stream_worker, stop_at[0])]
        time.sleep(1.5)
        futs += [pool.submit(stream_worker, stop_at[1]) for _ in range(3)]
        under_load: list[list[int]] | None = None
        while any(not f.done() for f in futs):
            print(timeline_line(t0, market, coord, names), flush=True)
            modes.show(dispatch_report(coord))
            if under_load is None and time.monotonic() - t0 > 9:
                print("    ... repeating the four reference requests while saturated:")
                under_load = run_batch("under load, volunteers serving")
            time.sleep(1.0)
        pool.shutdown()
        after = dispatch_report(coord)
        loc, rem, fb, ver = rows_since(before, after)
        print(f"    under load: rows local {loc}, remote {rem}, verified {ver}, fallback {fb}; "
              f"decisions: {decisions_since(before, after)}")
        print(f"    verification: {after.get('verifications', 0)} volunteer answers recomputed here and compared, "
              f"{after.get('verified_equal', 0)} equal, {after.get('quarantines', 0)} volunteers quarantined")
        print("    (a volunteer's hedged trial and its first 50 answers are all verified: the coordinator computes them too and")
        print("    uses its own result; then 5% of its answers, drawn at random)")
        verdicts = split_checks_since(before, after)
        if verdicts:
            for c in verdicts:
                print(f"    split check: {c['reason']} ({c.get('detail', '')})")
        else:
            print("    split check: no verdict -- the load dipped below saturation before its three windows (local / split /")
            print("    local) ended; until one does, earliest finish decides alone")
        if rem < loc // 10:
            print("    (each volunteer answered its hedged trial and is proven; but a range of this tiny model computes here in")
            print("    microseconds against a ~1-2 ms round trip, so earliest-finish keeps nearly all of it local; on the bench")
            print("    model the split is measured by benchmarks/offload.py)")
        assert under_load is not None
        same = under_load == local
        print(f"    tokens identical to the all-local run: {'YES' if same else 'NO'}")
        if not same:
            raise SystemExit("remote experts changed the output")

        say("the load has stopped: the boost ends, the extra volunteer is undispatched, then released")
        t1 = time.monotonic()
        while time.monotonic() - t1 < 30:
            line = timeline_line(t0, market, coord, names)
            print(line, flush=True)
            modes.show(dispatch_report(coord))
            m = recruitment(market)
            if not m["recruiting"] and len(m["workers"]) == 2 and time.monotonic() - t1 > 2:
                break
            time.sleep(1.0)
        rep = dispatch_report(coord)
        print(f"    dispatcher state: {rep.get('load_state')}")
        for L in rep["layers"]:
            print(f"    layer {L['layer']}: rows local {L['local_rows']}, remote {L['remote_rows']}, "
                  f"verified {L.get('verified_rows', 0)}, fallback {L['fallback_rows']}")

        say("second act: a backbone coordinator joins the market; it holds no expert (--local-experts none)")
        bport = free_port()
        backbone = f"http://127.0.0.1:{bport}"
        bp = procs.start("backbone", cli("coordinator", "--model", str(model_path), "--port", str(bport), "--slots", "4",
                                         "--data-dir", str(DATA / "backbone"), "--market", market, "--token", "demo",
                                         "--local-experts", "none"))
        wait_healthy(backbone, bp, "backbone")
        print("    one coordinator of the model now holds no expert: the market wants 2 replicas of each (remote target)")
        start_volunteer(procs, "volunteer-4", ["--market", market, "--max-experts", "8"])
        t2 = time.monotonic()
        while time.monotonic() - t2 < 90:
            for i in range(4):
                f = DATA / f"volunteer-{i + 1}" / "volunteer.json"
                if f.exists():
                    names[json.loads(f.read_text())["peer_id"]] = f"volunteer-{i + 1}"
            holes = httpx.get(f"{backbone}/health", timeout=5).json().get("coverage_holes", 1)
            m = recruitment(market)
            workers = dispatch_report(backbone)["workers"]
            proved = len(workers) >= 4 and all(w.get("holdings_pending") == 0 for w in workers)
            if holes == 0 and m["replicas_min"] >= 2 and proved:  # two proved replicas of everything
                break
            time.sleep(0.5)
        print(timeline_line(t2, market, backbone, names))
        brep = dispatch_report(backbone)
        print(f"    covered in {time.monotonic() - t2:.1f} s: {len(brep['workers'])} volunteers proved their slices to the "
              f"backbone ({brep.get('hold_passes', 0)} hold challenges passed, {brep.get('hold_refutations', 0)} refuted)")
        print("    where each volunteer's slices came from (volunteer-1 is reachable only through the relay: no source):")
        for i in range(4):
            show_downloads(f"volunteer-{i + 1}", names)
        bclient = openai.OpenAI(base_url=backbone + "/v1", api_key="demo", max_retries=0)
        before = dispatch_report(backbone)
        via_backbone = run_batch("backbone, every expert on volunteers", bclient)
        after = dispatch_report(backbone)
        loc, rem, fb, _ = rows_since(before, after)
        print(f"    rows local {loc}, remote {rem}, fallback {fb}; second-replica checks: "
              f"{after.get('decisions', {}).get('verify_second', 0)} calls, disputes {after.get('decisions', {}).get('dispute', 0)}")
        same = via_backbone == local
        print(f"    tokens identical to the all-local run: {'YES' if same else 'NO'}")
        if not same:
            raise SystemExit("the backbone coordinator changed the output")

        say(f"GET {market}/api/moe/recruitment")
        print(json.dumps(recruitment(market), indent=2))
        print(f"    (live: {market}/dashboard, {market}/api/moe/recruitment, {market}/api/expert-demand, {coord}/dispatch)")
        if os.environ.get("KEEP") == "1":
            keep_running(market, client, model_id, stream_worker)
        say("done: stopping processes (volunteers drain and deregister, then exit)")
    finally:
        procs.stop_all()
    print("Next: README.md (architecture, flags), `make test`, `make bench`.")


if __name__ == "__main__":
    main()
