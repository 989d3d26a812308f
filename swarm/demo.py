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
9. prints a short summary (what happened, the timings, rows local and remote, whether the tokens were
   identical; with ``KEEP=1`` the dashboard's URL while the cluster keeps running; ``--json`` adds the
   summary and ``/api/moe/recruitment`` as JSON) and stops every process it started, in dependency
   order: the volunteers drain and deregister, then the coordinators, the market, the relay.

Rules: dispatcher mode changes are printed under the heading of the phase they happened in (the log
is flushed before every heading); printed model text never carries control tokens or characters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

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


# the order processes stop in: who depends on whom (volunteers heartbeat to the market and serve the
# coordinators; coordinators report to the market; volunteer-1 is reachable only through the relay)
STOP_ORDER = ("volunteer", "coordinator", "market", "relay")


class Procs:
    def __init__(self) -> None:
        self.procs: list[tuple[str, str, subprocess.Popen[bytes]]] = []
        self.logs: list[BinaryIO] = []

    def start(self, name: str, args: list[str], role: str) -> subprocess.Popen[bytes]:
        log = open(DATA / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop_all, once the process is gone
        self.logs.append(log)
        # a process group of its own: a Ctrl-C at the terminal reaches the demo only, which stops them in order
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             process_group=0)
        self.procs.append((name, role, p))
        return p

    def stop_all(self) -> list[str]:
        """SIGINT to each role in ``STOP_ORDER``, waiting for the whole role to exit before the next one;
        returns what stopped, in order."""
        stopped: list[str] = []
        for role in STOP_ORDER:
            group = [(n, p) for n, r, p in self.procs if r == role]
            for _, p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for name, p in group:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    print(f"    {name} did not stop in 15 s; killing it")
                    p.kill()
                    p.wait()
            if group:
                stopped.append(f"{len(group)} {role}s" if len(group) > 1 else f"the {role}")
        for log in self.logs:
            log.close()
        return stopped


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
    return procs.start(name, cli("volunteer", "--data-dir", str(DATA / name), "--display-name", name, "--no-progress",
                                 "--poll-interval", "1", *extra), "volunteer")


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
    p = procs.start("relay", cli("relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--port", "0", "--data-dir", str(DATA / "relay")),
                    "relay")
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


def worker_states(m: dict[str, Any], rep: dict[str, Any], names: dict[str, str]) -> dict[str, str]:
    """Each market worker's name -> ``state[/path]`` as the timeline shows it."""
    served = {w["peer_id"]: w for w in rep["workers"]}
    out = {}
    for w in m["workers"]:
        name = names.get(w["peer_id"], w["peer_id"][-6:])
        d = served.get(w["peer_id"])
        held = {x["state"] for x in w["slices"]}
        if d is not None and d["last_serve_ms"] > 0:
            state = "serving"
        elif w["dispatched"]:
            state = "dispatched"
        else:  # the market's word for a holding it does not dispatch
            state = next((n for k, n in (("loading", "downloading"), ("retiring", "retiring"), ("released", "released"))
                          if k in held), "draining")
        out[name] = state + (f"/{d['path']}" if d is not None and d.get("path") else "")
    return out


def timeline_line(t0: float, market: str, coord: str, names: dict[str, str],
                  seen: tuple[dict[str, Any], dict[str, Any]] | None = None) -> str:
    m, rep = seen if seen is not None else (recruitment(market), dispatch_report(coord))
    workers = ", ".join(f"{n}:{st}" for n, st in worker_states(m, rep, names).items())
    return (f"    t={time.monotonic() - t0:5.1f}s busy={m['busy']}/{m['slots']} saturated={str(m['saturated']):5} "
            f"recruiting={str(m['recruiting']):5} target={_targets(m)} dispatch={rep.get('load_state', '?'):9} "
            f"workers=[{workers}]")


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
    """Prints the dispatcher's load-state switches (``/dispatch`` ``mode_changes``) once each, under the
    heading of the phase they happened in: ``flush`` before every heading (``Demo.heading``)."""

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


_CONTROL_TOKEN = re.compile(r"<\|[^|<>\s]{1,64}\|>|</?s>|\[/?INST\]")


def clean_text(text: str) -> str:
    """Model text fit for a terminal: no control tokens (``<|im_start|>``, ``</s>``, ``[INST]``; the API skips
    them by default too), no control characters and no U+FFFD (random weights emit any byte, and a
    partial UTF-8 sequence decodes to the replacement character)."""
    text = _CONTROL_TOKEN.sub("", text).replace("\ufffd", "")
    return "".join(ch if ch.isprintable() else " " for ch in text)


@dataclass
class Summary:
    """What the closing summary says (and ``--json`` prints)."""

    model_id: str = ""
    market: str = ""
    coordinator: str = ""
    backbone: str = ""
    reference_tokens_per_s: float = 0.0
    idle_rows: dict[str, int] = field(default_factory=dict)
    load_rows: dict[str, int] = field(default_factory=dict)
    saturated_after_s: float | None = None  # from the third stream's start to the market's signal
    recruited: str = ""
    recruited_serving_after_s: float | None = None  # from the market's saturation to its first served call
    boost_ended_after_s: float | None = None  # from the load's end
    aged_out_after_s: float | None = None
    same_tokens_under_load: bool = False
    verifications: int = 0
    verified_equal: int = 0
    quarantines: int = 0
    backbone_covered_s: float | None = None
    backbone_rows: dict[str, int] = field(default_factory=dict)
    same_tokens_backbone: bool = False
    shutdown: list[str] = field(default_factory=list)
    failed_heartbeats: int = 0
    deregistered: int = 0


def rows_dict(rows: tuple[int, int, int, int]) -> dict[str, int]:
    return dict(zip(("local", "remote", "fallback", "verified"), rows, strict=True))


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def print_summary(sm: Summary, *, keep: bool) -> None:
    say("summary")
    lr = sm.load_rows
    lines = [
        f"model        {sm.model_id} (tiny, random weights: its words are noise -- the point is the machinery)",
        f"reference    4 greedy requests, every expert on the coordinator: {sm.reference_tokens_per_s:.1f} tokens/s",
        f"idle         rows local {sm.idle_rows.get('local', 0)}, remote {sm.idle_rows.get('remote', 0)}: an idle "
        "coordinator computes the experts it holds itself",
        f"load         3 streams: the market saw saturation after {_s(sm.saturated_after_s)}; "
        f"{sm.recruited or 'no volunteer'} recruited, serving {_s(sm.recruited_serving_after_s)} later",
        f"             rows local {lr.get('local', 0)}, remote {lr.get('remote', 0)}, verified {lr.get('verified', 0)} (sent to a "
        f"volunteer and recomputed here), fallback {lr.get('fallback', 0)}",
        f"             tokens identical to all-local: {'YES' if sm.same_tokens_under_load else 'NO'}",
        f"age-out      boost ended {_s(sm.boost_ended_after_s)} after the load, the extra volunteer released after "
        f"{_s(sm.aged_out_after_s)}",
        f"verification {sm.verifications} volunteer answers recomputed here, {sm.verified_equal} equal, "
        f"{sm.quarantines} volunteers quarantined",
        f"backbone     a coordinator holding no expert: two proved replicas of everything in {_s(sm.backbone_covered_s)}",
        f"             rows local {sm.backbone_rows.get('local', 0)}, remote {sm.backbone_rows.get('remote', 0)}; "
        f"tokens identical to all-local: {'YES' if sm.same_tokens_backbone else 'NO'}",
    ]
    if keep:
        lines.append(f"dashboard    {sm.market}/dashboard -- live until Ctrl-C (the load ramp repeats)")
    else:
        lines.append("dashboard    `make demo KEEP=1` keeps the cluster up and its dashboard live (/dashboard on the market)")
    lines.append(f"logs         {DATA.relative_to(ROOT)}/*.log; raw JSON: python -m swarm.demo --json")
    for line in lines:
        print("    " + line)


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


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m swarm.demo", description="the whole system on loopback (make demo)")
    ap.add_argument("--json", action="store_true", help="also print the summary and /api/moe/recruitment as JSON")
    args = ap.parse_args(argv)
    keep = os.environ.get("KEEP") == "1"
    signal.signal(signal.SIGTERM, _interrupted)  # stopped from outside: the processes still stop in order
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
    sm = Summary(model_id=model_id)
    modes = ModeLog(int(time.time() * 1000))
    coord = ""

    def heading(msg: str) -> None:
        if coord:  # the dispatcher's switches so far belong to the phase that just ended
            modes.show(dispatch_report(coord))
        say(msg)

    try:
        mport, cport = free_port(), free_port()
        market = f"http://127.0.0.1:{mport}"
        sm.market = market
        heading("starting a circuit relay (for volunteers nobody can dial)")
        relay_addr = start_relay(procs)
        print(f"    relay: {relay_addr}")
        heading(f"starting the market on {market} (SQLite {DATA.relative_to(ROOT)}/market.db; base target 1, boost +1;"
                " saturated after 2 s of busy polls, not after 5 s without)")
        mp = procs.start("market", cli("market", "--db", str(DATA / "market.db"), "--port", str(mport), "--token", "demo",
                                       "--poll-interval", "0.5", "--rise-s", "2", "--hold-s", "5", "--cooldown-s", "3",
                                       "--relay", relay_addr), "market")
        wait_healthy(market, mp, "market")
        heading(f"starting the coordinator on http://127.0.0.1:{cport} (4 slots; saturated at 2 busy; serve TTL 5 s;"
                " split check windows 1 s)")
        # the demo's load act is short (16 s): 1 s windows let the split check reach a verdict in it
        cp = procs.start("coordinator", cli("coordinator", "--model", str(model_path), "--port", str(cport), "--slots", "4",
                                            "--data-dir", str(DATA / "coordinator"), "--market", market, "--token", "demo",
                                            "--saturation-threshold", "2", "--serve-ttl", "5", "--split-check", "1"),
                         "coordinator")
        wait_healthy(f"http://127.0.0.1:{cport}", cp, "coordinator")
        coord = sm.coordinator = f"http://127.0.0.1:{cport}"
        client = openai.OpenAI(base_url=coord + "/v1", api_key="demo", max_retries=0)
        print(f"    model id: {model_id}")

        heading("one streamed chat request through the openai client")
        print("    assistant: ", end="", flush=True)
        for ev in client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Tell me about mixture of experts."}],
            max_tokens=32, temperature=0.7, seed=1, stream=True, extra_body={"skip_special_tokens": True},
        ):
            for ch in ev.choices:
                if ch.delta.content:
                    print(clean_text(ch.delta.content), end="", flush=True)
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

        def run_batch(label: str, via: openai.OpenAI = client) -> tuple[list[list[int]], float]:
            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda p: ask(p, via), prompts))
            wall = time.monotonic() - t0
            total = sum(len(ids) for _, ids, _ in results)
            print(f"    {label}: 4 requests, {total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s aggregate")
            return [ids for _, ids, _ in results], total / wall

        heading("reference: four concurrent greedy requests with every expert on the coordinator (all-local)")
        local, sm.reference_tokens_per_s = run_batch("all-local")

        heading("three volunteers start in pull mode (real processes, each with a budget of 8 experts);")
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
        base_workers = {names.get(w["peer_id"], w["peer_id"]) for w in recruitment(market)["workers"]}
        print("    base target covered: two volunteers hold one layer each; the third has nothing to do yet")

        heading("idle: one request at a time -- the coordinator computes the experts it holds itself")
        before = dispatch_report(coord)
        for p in prompts[:2]:
            ask(p)
        after = dispatch_report(coord)
        idle_rows = rows_since(before, after)
        sm.idle_rows = rows_dict(idle_rows)
        loc, rem, fb, _ = idle_rows
        print(f"    2 requests: rows local {loc}, remote {rem}, fallback {fb}; decisions: {decisions_since(before, after)}")
        print("    (a round trip per layer would only slow each token; volunteers pay off when the coordinator is busy)")

        heading("load ramp through the OpenAI API: 1 stream, then 3 streams (saturation)")
        stop_at = [time.monotonic() + 3.0, time.monotonic() + 16.0]

        def stream_worker(until: float) -> int:
            n = 0
            while time.monotonic() < until:
                r = client.completions.create(model=model_id, prompt="load", max_tokens=40, temperature=0,
                                              extra_body={"ignore_eos": True})
                n += r.usage.completion_tokens if r.usage else 0
            return n

        t0 = time.monotonic()
        modes.t0_ms = int(time.time() * 1000)  # the dispatcher's switches on the timeline's clock from here
        before = dispatch_report(coord)
        pool = ThreadPoolExecutor(4)
        futs = [pool.submit(stream_worker, stop_at[0])]
        time.sleep(1.5)
        three_at = time.monotonic()
        futs += [pool.submit(stream_worker, stop_at[1]) for _ in range(3)]
        under_load: list[list[int]] | None = None
        saturated_at: float | None = None
        while any(not f.done() for f in futs):
            m, rep = recruitment(market), dispatch_report(coord)
            now = time.monotonic()
            print(timeline_line(t0, market, coord, names, (m, rep)), flush=True)
            if saturated_at is None and m["saturated"]:
                saturated_at = now
                sm.saturated_after_s = now - three_at
            for name, state in worker_states(m, rep, names).items():
                if (saturated_at is not None and not sm.recruited and name not in base_workers
                        and state.startswith("serving")):
                    sm.recruited, sm.recruited_serving_after_s = name, now - saturated_at
            modes.show(rep)
            if under_load is None and time.monotonic() - t0 > 9:
                print("    ... repeating the four reference requests while saturated:")
                under_load, _ = run_batch("under load, volunteers serving")
            time.sleep(1.0)
        pool.shutdown()
        load_end = time.monotonic()
        after = dispatch_report(coord)
        load_rows = rows_since(before, after)
        sm.load_rows = rows_dict(load_rows)
        loc, rem, fb, ver = load_rows
        print(f"    under load: rows local {loc}, remote {rem}, verified {ver}, fallback {fb}; "
              f"decisions: {decisions_since(before, after)}")
        sm.verifications, sm.verified_equal = after.get("verifications", 0), after.get("verified_equal", 0)
        sm.quarantines = after.get("quarantines", 0)
        print(f"    verification: {sm.verifications} volunteer answers recomputed here and compared, "
              f"{sm.verified_equal} equal, {sm.quarantines} volunteers quarantined")
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
        sm.same_tokens_under_load = under_load == local
        print(f"    tokens identical to the all-local run: {'YES' if sm.same_tokens_under_load else 'NO'}")
        if not sm.same_tokens_under_load:
            raise SystemExit("remote experts changed the output")

        heading("the load has stopped: the boost ends, the extra volunteer is undispatched, then released")
        while time.monotonic() - load_end < 30:
            m, rep = recruitment(market), dispatch_report(coord)
            print(timeline_line(t0, market, coord, names, (m, rep)), flush=True)
            modes.show(rep)
            if sm.boost_ended_after_s is None and not m["recruiting"]:
                sm.boost_ended_after_s = time.monotonic() - load_end
            if not m["recruiting"] and len(m["workers"]) == 2 and time.monotonic() - load_end > 2:
                sm.aged_out_after_s = time.monotonic() - load_end
                break
            time.sleep(1.0)
        rep = dispatch_report(coord)
        print(f"    dispatcher state: {rep.get('load_state')}")
        for L in rep["layers"]:
            print(f"    layer {L['layer']}: rows local {L['local_rows']}, remote {L['remote_rows']}, "
                  f"verified {L.get('verified_rows', 0)}, fallback {L['fallback_rows']}")

        heading("second act: a backbone coordinator joins the market; it holds no expert (--local-experts none)")
        bport = free_port()
        backbone = sm.backbone = f"http://127.0.0.1:{bport}"
        bp = procs.start("backbone", cli("coordinator", "--model", str(model_path), "--port", str(bport), "--slots", "4",
                                         "--data-dir", str(DATA / "backbone"), "--market", market, "--token", "demo",
                                         "--local-experts", "none"), "coordinator")
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
        sm.backbone_covered_s = time.monotonic() - t2
        print(f"    covered in {sm.backbone_covered_s:.1f} s: {len(brep['workers'])} volunteers proved their slices to the "
              f"backbone ({brep.get('hold_passes', 0)} hold challenges passed, {brep.get('hold_refutations', 0)} refuted)")
        print("    where each volunteer's slices came from (volunteer-1 is reachable only through the relay: no source):")
        for i in range(4):
            show_downloads(f"volunteer-{i + 1}", names)
        bclient = openai.OpenAI(base_url=backbone + "/v1", api_key="demo", max_retries=0)
        before = dispatch_report(backbone)
        via_backbone, _ = run_batch("backbone, every expert on volunteers", bclient)
        after = dispatch_report(backbone)
        backbone_rows = rows_since(before, after)
        sm.backbone_rows = rows_dict(backbone_rows)
        loc, rem, fb, _ = backbone_rows
        print(f"    rows local {loc}, remote {rem}, fallback {fb}; second-replica checks: "
              f"{after.get('decisions', {}).get('verify_second', 0)} calls, disputes {after.get('decisions', {}).get('dispute', 0)}")
        sm.same_tokens_backbone = via_backbone == local
        print(f"    tokens identical to the all-local run: {'YES' if sm.same_tokens_backbone else 'NO'}")
        if not sm.same_tokens_backbone:
            raise SystemExit("the backbone coordinator changed the output")

        modes.show(dispatch_report(coord))
        print_summary(sm, keep=keep)
        if args.json:
            print(json.dumps({"summary": asdict(sm), "recruitment": recruitment(market)}, indent=2))
        if keep:
            keep_running(market, client, model_id, stream_worker)
        say("stopping: the volunteers drain and deregister, then the coordinators, the market, the relay")
    except KeyboardInterrupt:
        say("interrupted: stopping the volunteers (they drain and deregister), the coordinators, the market, the relay")
    finally:
        logs = [f for f in (DATA / f"volunteer-{i}.log" for i in range(1, 5)) if f.exists()]
        marks = {f: f.stat().st_size for f in logs}  # what the volunteers log while stopping comes after these
        stopped = procs.stop_all()
    tails = [f.read_bytes()[marks[f]:].decode(errors="replace") for f in logs]
    sm.failed_heartbeats = sum(t.count("heartbeat to the market failed") for t in tails)
    sm.deregistered = sum("deregistering" in t for t in tails)
    print(f"    stopped in order: {', '.join(stopped)}; {sm.deregistered} of {len(tails)} volunteers drained and "
          f"deregistered, {sm.failed_heartbeats} failed heartbeats while stopping")
    print("Next: README.md (run your own swarm), docs/ (architecture, protocol, trust, operations), `make test`.")


if __name__ == "__main__":
    main()
