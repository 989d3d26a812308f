"""``make demo``: the whole system on one machine, as real processes on loopback (shell).

What it does, in order, printing as it goes:
1. generates the tiny qwen3moe model (``moe-swarm make-model``) into ``demo-data/``;
2. starts the coordinator as a real process and waits for ``/health``;
3. sends chat requests through the official ``openai`` client: one streamed, then several
   concurrent ones, and prints what came back with tokens/s;
4. shows ``/slots`` and stops every process it started, cleanly.
"""

from __future__ import annotations

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


def main() -> None:
    DATA.mkdir(exist_ok=True)
    from swarm.makemodel import make_model

    model_path = DATA / "tiny-qwen3moe.gguf"
    say(f"generating the tiny qwen3moe model -> {model_path.relative_to(ROOT)}")
    make_model(arch="qwen3moe", size="tiny", seed=0, out=model_path)
    procs = Procs()
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        say(f"starting the coordinator on {url} (4 slots)")
        coord = procs.start("coordinator", cli("coordinator", "--model", str(model_path), "--port", str(port), "--slots", "4"))
        wait_healthy(url, coord, "coordinator")
        client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0)
        model = client.models.list().data[0].id
        print(f"    model id: {model}")

        say("one streamed chat request through the openai client")
        t0 = time.monotonic()
        n = 0
        print("    assistant: ", end="", flush=True)
        for ev in client.chat.completions.create(
            model=model,
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

        say("four concurrent chat requests (continuous batching shares each step)")
        prompts = ["What is a relay?", "Explain NAT.", "Why volunteer compute?", "Count to five."]

        def ask(p: str) -> tuple[str, int, float]:
            t = time.monotonic()
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.usage is not None
            return p, r.usage.completion_tokens, time.monotonic() - t

        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(ask, prompts))
        wall = time.monotonic() - t0
        total = 0
        for p, toks, dt in results:
            total += toks
            print(f"    {p!r:28} {toks} tokens in {dt:.2f} s ({toks / dt:.1f} tok/s)")
        print(f"    aggregate: {total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s")

        slots = httpx.get(url + "/slots").json()
        say("/slots after the run")
        for s in slots:
            print(f"    slot {s['id']}: processing={s['is_processing']} n_decoded={s['n_decoded']} tps_ewma={s['tps_ewma']}")
        say("done: stopping processes")
    finally:
        procs.stop_all()
    print("Next: README.md (architecture, flags), `make test`, `make bench`.")


if __name__ == "__main__":
    main()
