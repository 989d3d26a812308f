"""``python -m coordinator.calibrate``: what ``moe-swarm simulate --calibrate`` measures, in a process of its own.

Rules:
- ``--model GGUF --threads N --batches B... --steps S [--runtime]``: the engine on the model at ``N`` ggml
  threads (``configure_threads``, as ``--threads`` does), decode steps at each batch size with a timed expert
  backend (every expert outside the dense graphs, ``benchmarks/offload.py``'s ``bound`` method): the median
  dense+head and expert seconds of a step; with ``--runtime`` also the seconds per decode step of 1
  and of 4 sessions through the real ``EngineRuntime`` (the whole-step graph, scheduler, sampling, the event
  stream; no HTTP).
- The last line of stdout is one JSON object: ``{n_layer, n_moe_layer, top_k, d_model, steps: {batch:
  [dense_s, experts_s]}, py_share_dense, py_share_local | null, runtime_steps: {sessions: step_s} | null}``
  (``py_share_*``: the share of a step outside ggml's graphs, from ``graph_time``: Python, holding the lock). ``sim.costs.calibrate`` runs it and fits the costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "timed_transformer"]


def timed_transformer(model: Any) -> tuple[Any, list[float]]:
    """A ``Transformer`` over ``model`` whose experts are computed outside the dense graphs (never the
    whole-layer path) and timed: ``spent[0]`` adds the seconds each expert call took (reset it per step).
    ``benchmarks/offload.py``'s ``bound`` case uses it too."""
    from coordinator.dispatch.layer import LayerCall
    from coordinator.engine.model import LocalExperts, Transformer

    spent = [0.0]

    class Timed(LocalExperts):
        def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
            return False

        def service(self, call: LayerCall) -> bool:
            t = time.perf_counter()
            r = super().service(call)
            spent[0] += time.perf_counter() - t
            return r

    return Transformer(model, Timed(model)), spent


def _step_parts(path: Path, threads: int, batches: list[int],
                steps: int) -> tuple[dict[int, tuple[float, float]], Any, float]:
    """Per batch size: the median (dense + head, experts) seconds of a decode step, the experts timed apart
    from the dense graphs at ``threads``."""
    import torch

    from coordinator.engine.model import KVCache, SeqChunk
    from swarm.model.gguf import GGUFModel
    from swarm.model.kernels import KernelBackend, configure_threads
    from swarm.model.kernels.ggml import graph_time

    configure_threads(threads, KernelBackend.GGML)
    tr, spent = timed_transformer(GGUFModel(path))
    out: dict[int, tuple[float, float]] = {}
    py: list[float] = []  # per step: the share outside ggml's graphs (Python, holding the interpreter lock)
    for b in batches:
        caches = [KVCache(tr.cfg, 64 + steps, torch.float16) for _ in range(b)]
        tr.forward([SeqChunk(c, [(11 * i + 7 * j + 3) % 50 for j in range(8)], 0) for i, c in enumerate(caches)])
        got: list[tuple[float, float]] = []
        for s in range(steps + 2):
            spent[0] = 0.0
            g0 = graph_time()[0]
            t = time.perf_counter()
            tr.forward([SeqChunk(c, [5], 8 + s) for c in caches])
            dt = time.perf_counter() - t
            if s >= 2:
                got.append((dt - spent[0], spent[0]))
                py.append(max(0.0, 1.0 - (graph_time()[0] - g0) / dt))
        out[b] = (statistics.median(g[0] for g in got), statistics.median(g[1] for g in got))
    return out, tr.cfg, statistics.median(py)


def _runtime_steps(path: Path, threads: int, sessions: list[int], n_decode: int = 160) -> tuple[dict[int, float], float]:
    """Seconds per decode step with ``n`` sessions decoding together through the real ``EngineRuntime``
    (its whole-step graph where every layer is here, scheduler, sampling, the event stream; no HTTP): the
    last session's decode time after every first token over its steps, the median of 5 rounds (each long
    enough -- ``n_decode`` tokens -- that one scheduler hiccup does not decide it); and the share of the engine
    thread's time outside ggml's graphs (Python, holding the interpreter lock) over the rounds."""
    import trio

    from coordinator.core.scheduler import Emit, Finish, GenParams
    from coordinator.engine.runtime import EngineRuntime
    from swarm.model.gguf import GGUFModel
    from swarm.model.kernels import KernelBackend, configure_threads
    from swarm.model.kernels.ggml import graph_time
    from swarm.text.tokenizer import Tokenizer

    configure_threads(threads, KernelBackend.GGML)
    model = GGUFModel(path)
    py: list[float] = []
    rt = EngineRuntime(model, Tokenizer.from_gguf_fields(model.fields), n_slots=max(sessions), n_ctx=n_decode + 32)
    out: dict[int, list[float]] = {n: [] for n in sessions}

    async def one(prompt: list[int], firsts: list[float], ends: list[float]) -> None:
        h = rt.submit(prompt, GenParams(max_tokens=n_decode, temperature=0.0, ignore_eos=True))
        first = True
        async for ev in h.events:
            if isinstance(ev, Emit) and ev.token_ids and first:
                firsts.append(time.perf_counter())
                first = False
            if isinstance(ev, Finish):
                break
        ends.append(time.perf_counter())

    def engine_graph_s() -> float:
        import threading

        return sum(graph_time(t.ident)[0] for t in threading.enumerate() if t.name == "engine" and t.ident is not None)

    async def round_(n: int, salt: int) -> float:
        firsts: list[float] = []
        ends: list[float] = []
        g0, t0 = engine_graph_s(), time.perf_counter()
        async with trio.open_nursery() as nn:
            for i in range(n):
                nn.start_soon(one, [9 + i + salt, 10, 11, 12], firsts, ends)
        py.append(max(0.0, 1.0 - (engine_graph_s() - g0) / (time.perf_counter() - t0)))
        return (max(ends) - max(firsts)) / (n_decode - 1)

    async def main() -> None:
        async with trio.open_nursery() as nurse:
            await nurse.start(rt.serve)
            await round_(max(sessions), 0)  # warm-up: graphs built, pages read
            for n in sessions:
                for r in range(5):
                    out[n].append(await round_(n, 10 * r + 1))
            nurse.cancel_scope.cancel()

    trio.run(main)
    return {n: statistics.median(v) for n, v in out.items()}, statistics.median(py[1:])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m coordinator.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runtime", action="store_true")
    ap.add_argument("--runtime-tokens", type=int, default=160, help="tokens per session of each runtime round")
    a = ap.parse_args()
    parts, cfg, py_dense = _step_parts(a.model, a.threads, a.batches, a.steps)
    runtime, py_local = _runtime_steps(a.model, a.threads, [1, 4], a.runtime_tokens) if a.runtime else (None, None)
    print(json.dumps({"n_layer": int(cfg.n_layer), "n_moe_layer": int(cfg.n_moe_layer), "top_k": int(cfg.n_expert_used),
                      "d_model": int(cfg.d_model), "steps": {str(b): list(v) for b, v in parts.items()},
                      "py_share_dense": py_dense, "py_share_local": py_local,
                      "runtime_steps": {str(n): v for n, v in runtime.items()} if runtime else None}))


if __name__ == "__main__":
    main()
