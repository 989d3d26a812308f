"""``make demo``: the whole system on one machine, as real processes on loopback (shell).

What it does, in order, printing as it goes:
1. generates the tiny qwen3moe model (``moe-swarm make-model``) into ``demo-data/``;
2. starts the coordinator as a real process and waits for ``/health``;
3. sends chat requests through the official ``openai`` client: one streamed, then four concurrent
   ones computed all-local, printing tokens/s;
4. starts two volunteers as real processes (each downloads its expert slices from the coordinator
   and serves them over libp2p), writes a dispatch map, and repeats the four requests: the rows go
   to the volunteers, the tokens are identical to the all-local run;
5. shows ``/dispatch`` and ``/slots`` and stops every process it started, cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def start_volunteer(procs: Procs, name: str, url: str, slices: list[str]) -> dict[str, object]:
    args = ["volunteer", "--coordinator", url, "--data-dir", str(DATA / name), "--no-progress"]
    for sl in slices:
        args += ["--slice", sl]
    info_path = DATA / name / "volunteer.json"
    info_path.unlink(missing_ok=True)
    p = procs.start(name, cli(*args))
    deadline = time.monotonic() + 60
    while not info_path.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start; see {DATA / (name + '.log')}")
        time.sleep(0.1)
    info: dict[str, object] = json.loads(info_path.read_text())
    return info


def main() -> None:
    DATA.mkdir(exist_ok=True)
    from swarm.gguf_model import model_id_for
    from swarm.makemodel import make_model

    model_path = DATA / "tiny-qwen3moe.gguf"
    say(f"generating the tiny qwen3moe model -> {model_path.relative_to(ROOT)}")
    make_model(arch="qwen3moe", size="tiny", seed=0, out=model_path)
    model_id = model_id_for(model_path)
    map_path = DATA / "dispatch-map.json"
    map_path.write_text(json.dumps({"model_id": model_id, "version": 0, "layers": []}))
    procs = Procs()
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        say(f"starting the coordinator on {url} (4 slots, following {map_path.relative_to(ROOT)})")
        coord = procs.start("coordinator", cli("coordinator", "--model", str(model_path), "--port", str(port), "--slots", "4",
                                                "--data-dir", str(DATA / "coordinator"), "--dispatch-map", str(map_path)))
        wait_healthy(url, coord, "coordinator")
        client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0)
        print(f"    model id: {model_id}")

        say("one streamed chat request through the openai client")
        t0 = time.monotonic()
        n = 0
        print("    assistant: ", end="", flush=True)
        for ev in client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "Tell me about mixture of experts."}],
            max_tokens=32,
            temperature=0.7,
            seed=1,
            stream=True,
        ):
            for ch in ev.choices:
                if ch.delta.content:
                    n += 1
                    print(ch.delta.content, end="", flush=True)
        dt = time.monotonic() - t0
        print(f"\n    ({n} chunks in {dt:.2f} s; random weights, so the words are noise)")

        prompts = ["What is a relay?", "Explain NAT.", "Why volunteer compute?", "Count to five."]

        def ask(p: str) -> tuple[str, list[int], float]:
            t = time.monotonic()
            r = client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": p}], max_tokens=48, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            ids = list((r.choices[0].model_extra or {}).get("token_ids", []))
            return p, ids, time.monotonic() - t

        def run_batch(label: str) -> list[list[int]]:
            t0 = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(ask, prompts))
            wall = time.monotonic() - t0
            total = 0
            for p, ids, dt in results:
                total += len(ids)
                print(f"    {p!r:28} {len(ids)} tokens in {dt:.2f} s ({len(ids) / dt:.1f} tok/s)")
            print(f"    {label}: {total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s aggregate")
            return [ids for _, ids, _ in results]

        say("four concurrent chat requests, every expert computed on the coordinator (all-local)")
        local = run_batch("all-local")

        say("starting two volunteers (real processes) that download and serve expert slices")
        v1 = start_volunteer(procs, "volunteer-1", url, ["0:0-4", "1:0-4"])
        v2 = start_volunteer(procs, "volunteer-2", url, ["0:4-8", "1:4-8"])
        for name, v in (("volunteer-1", v1), ("volunteer-2", v2)):
            print(f"    {name}: peer {str(v['peer_id'])[-12:]} serves {', '.join(map(str, v['slices']))}")  # type: ignore[call-overload]
        layers = []
        for layer in (0, 1):
            layers.append({"layer": layer, "ranges": [
                {"lo": 0, "hi": 4, "replicas": [{"peer_id": v1["peer_id"], "addrs": v1["addrs"]}]},
                {"lo": 4, "hi": 8, "replicas": [{"peer_id": v2["peer_id"], "addrs": v2["addrs"]}]},
            ]})
        map_path.write_text(json.dumps({"model_id": model_id, "version": 1, "layers": layers}))
        deadline = time.monotonic() + 10
        while len(httpx.get(url + "/dispatch").json()["workers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        print(f"    wrote dispatch map v1 ({map_path.relative_to(ROOT)}); the coordinator attached both workers")

        say("the same four requests, experts now computed by the volunteers over libp2p")
        remote = run_batch("remote experts")
        rep = httpx.get(url + "/dispatch").json()
        for L in rep["layers"]:
            print(f"    layer {L['layer']}: rows local {L['local_rows']}, remote {L['remote_rows']}, fallback {L['fallback_rows']}")
        for w in rep["workers"]:
            print(f"    worker {w['peer_id'][-12:]}: {w['state']}, {w['calls']} calls, {w['rows']} rows, "
                  f"latency {w['latency_ewma_ms']:.2f} ms, path {w['path']}")
        same = remote == local
        print(f"    tokens identical to the all-local run: {'YES' if same else 'NO'}")
        if not same:
            raise SystemExit("remote experts changed the output")

        slots = httpx.get(url + "/slots").json()
        say("/slots after the run")
        for s in slots:
            print(f"    slot {s['id']}: processing={s['is_processing']} tps_ewma={s['tps_ewma']}")
        say("done: stopping processes (volunteers drain, then exit)")
    finally:
        procs.stop_all()
    print("Next: README.md (architecture, flags), `make test`, `make bench`.")


if __name__ == "__main__":
    main()
