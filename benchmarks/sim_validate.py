"""Does the serving simulation predict what the real processes measure? (issue 27, validation)

    python benchmarks/sim_validate.py [--quick | --smoke] [--backbone-json FILE --model GGUF] [--json OUT] [--seed N]

Runs ``benchmarks/backbone.py`` (``--quick``: the ``small`` shape, rtt 0 and 20 ms, 1 and 4 sessions;
``--smoke``: ``tiny``, rtt 0, 1 session; no drafter) unless given its JSON and model, then:

1. calibrates the same model file in this process (``sim.costs.calibrate``: the real engine and ggml kernels,
   the coordinator at 2 threads and a volunteer at 1, as backbone.py runs them, and the runtime's own work
   per step);
2. takes what the calibration cannot see from the two measured cases the prediction may use (its inputs):
   - the all-local 1-session case: the network thread's CPU per token streamed (``stream_s``, from ``/proc``);
   - the backbone at rtt 0 and 1 session: its layer breakdown (``/dispatch``'s ``layer_path``) gives the
     per-call encode, the per-layer work on the coordinator's path (place, group, hand-off to the network
     thread, core, wake-up, combine), the loopback wire, the volunteer's queue and its expert compute as the
     run measured it (the calibrated volunteer costs are scaled to it); its network thread's CPU per token
     beyond the all-local one, per remote call (``net_call_s``: the dispatcher's effects and timers, the
     comparisons' streams); and the engine's work per step outside its layers (``head_s``: embedding, head,
     the runtime's step and its waits for the network thread's burst at the step's end), fitted by bisection
     so that this case's simulated rate is its measured one;
3. simulates every case of the JSON (``sim.serving``, the real dispatch core and session-group choice): the
   all-local coordinator (every expert held, no volunteer) and the backbone (no expert held; the volunteers
   on the same 2 cores), each backbone run on the map it had (``backbone.py``'s ``layout``: the market hands
   slices out by demand, whole layers to one volunteer or halves of them) -- the median prediction over the
   runs against the median measurement.

``--offload`` (or ``--offload-json``) also runs ``benchmarks/offload.py`` (the bench model, 1 and 4 sessions, 96
tokens, 2 repeats: the coordinator and one volunteer at one ggml thread each on the two cores, every expert held)
and predicts its local and adaptive rates from the bench model calibrated at one thread and its local 1-session
rate (an input: ``stream_s``).

The table gives measured and predicted tokens/s and the error; the two 1-session rtt-0 cases above are inputs
(their errors are not predictions'); target: every other case within 20 %. Threads: the calibration runs the
engine alone (2 then 1 ggml threads); backbone.py's processes are described in its own docstring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402

ENGINE_PATH = ("place", "group", "combine")  # the remote layer's machinery on the engine thread
NETWORK = ("encode", "to_trio", "core", "wake")  # ... and on the network thread (the hand-off, the core, the wake-up)


def machinery(case: dict[str, Any]) -> dict[str, float]:
    """The dispatch machinery's costs (seconds) from a measured backbone case's layer breakdown (ms)."""
    b = case["layer_breakdown_ms"]
    return {"coord_call_s": sum(b.get(k, 0.0) for k in NETWORK) / 1000,
            "coord_layer_s": sum(b.get(k, 0.0) for k in ENGINE_PATH) / 1000,
            "wire_s": b.get("wire", 0.0) / 1000,
            "worker_proto_s": b.get("queue", 0.0) / 1000,
            "wake_s": 0.0}


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One case per (case, rtt, sessions) over one or more backbone.py JSONs (drafter ``none``): within a run
    the last all-local case of a key (the one adjacent to its backbone case), over the runs the median
    tokens/s and ms per token; the breakdown of the median run."""
    by: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for run in runs:
        last: dict[tuple[str, float, int], dict[str, Any]] = {}
        for c in run["cases"]:
            if c["draft"] == "none":
                last[(c["case"], float(c["rtt_ms"]), int(c["sessions"]))] = c
        for k, c in last.items():
            by.setdefault(k, []).append(c)
    out = []
    for (case, rtt, sessions), cs in sorted(by.items()):
        cs = sorted(cs, key=lambda c: c["tokens_per_s"])
        mid = cs[len(cs) // 2]
        out.append({"case": case, "rtt_ms": rtt, "sessions": sessions, "runs": len(cs),
                    "tokens_per_s": statistics.median(c["tokens_per_s"] for c in cs),
                    "ms_per_token": statistics.median(c["ms_per_token"] for c in cs),
                    "network_ms_per_token": statistics.median(nets) if (nets := [c["network_ms_per_token"] for c in cs
                                                                                if c.get("network_ms_per_token")]) else None,
                    "round_trips_per_token": statistics.median(rts) if (rts := [c["round_trips_per_token"] for c in cs
                                                                                if c.get("round_trips_per_token")]) else None,
                    "all_tokens_per_s": [c["tokens_per_s"] for c in cs],
                    "layouts": [c.get("layout") for c in cs],  # each run's map (the backbone's; None: not recorded)
                    "layer_breakdown_ms": mid.get("layer_breakdown_ms")})
    return out


def point(costs: Any, shape: dict[str, int], case: dict[str, Any], seed: int, *, volunteers: int, held: bool,
          ranges_per_layer: int = 1, threads: int = 2, layout: list[Any] | None = None) -> Any:
    """A measured case as a simulated point on this machine (2 cores shared by every process); ``layout``: the
    map the run had (``backbone.py``'s), else each volunteer holding whole layers in turn."""
    from coordinator.core.events import DispatchConfig
    from sim.serving import Point
    from sim.serving_run import COORDINATOR_DISPATCH

    return Point(costs=costs, n_layer=shape["n_moe_layer"], n_expert=shape["n_expert"], top_k=shape["top_k"],
                 ranges_per_layer=ranges_per_layer, sessions=int(case["sessions"]), slots=max(8, int(case["sessions"])),
                 volunteers=volunteers, speed=1.0, rtt_s=float(case["rtt_ms"]) / 1000, bandwidth=1e9,
                 shared_cores=True, machine_cores=2, coordinator_threads=threads, warmup_s=20.0, measure_s=20.0,
                 held=held, replicas=1, dispatch=DispatchConfig(**COORDINATOR_DISPATCH), seed=seed,
                 layout=tuple(tuple((int(lo), int(hi), tuple(int(v) for v in vs)) for lo, hi, vs in rs) for rs in layout)
                 if layout else ())


def fit_cost(costs: Any, name: str, target: float, make: Callable[[Any], Any], *, steps: int, hi: float = 0.005,
             **fixed: float) -> Any:
    """``costs`` with ``name`` (seconds, in 0..``hi``) set by bisection so the point ``make`` builds decodes at
    ``target`` tokens/s in simulation (0 when it is slower already, ``hi`` when even that is too fast); ``fixed``
    other fields set alike."""
    import msgspec

    from sim.serving import ServingSim

    def at(v: float) -> Any:
        return msgspec.structs.replace(costs, **{name: v}, **fixed)

    def rate(v: float) -> float:
        return ServingSim(make(at(v))).run().tokens_per_s

    lo = 0.0
    if rate(lo) <= target:
        return at(lo)
    if rate(hi) > target:
        return at(hi)
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > target else (lo, mid)
    return at((lo + hi) / 2)


def fit_stream(costs: Any, local1: dict[str, Any], make: Callable[[Any], Any]) -> Any:
    """The API's streaming cost per token on the network thread (``stream_s``, what the calibration, which
    runs no server, cannot see): the value whose simulated all-local 1-session rate is the measured one
    (bisection; 0 when the engine alone is already slower than measured)."""
    return fit_cost(costs, "stream_s", float(local1["tokens_per_s"]), make, steps=20, step_s=0.0)


def backbone_costs(costs: Any, anchor: dict[str, Any], shape: dict[str, int], make: Callable[[Any], Any]) -> Any:
    """``costs`` for the backbone cases from the anchor (the backbone at rtt 0 and 1 session): the volunteers'
    expert compute scaled to the anchor's measured ``compute`` (a remote layer's, ``top_k`` pairs), then
    ``head_s`` (the engine's work per step outside its layers) by bisection so the anchor's simulated rate is
    its measured one (0 when the layers alone are already slower)."""
    import msgspec

    measured = (anchor.get("layer_breakdown_ms") or {}).get("compute", 0.0) / 1000
    calibrated = costs.worker(shape["top_k"], 1.0)
    if measured > 0 and calibrated > 0:
        f = measured / calibrated
        costs = msgspec.structs.replace(costs, worker_call_s=costs.worker_call_s * f, worker_pair_s=costs.worker_pair_s * f)
    return fit_cost(costs, "head_s", float(anchor["tokens_per_s"]), make, steps=10)  # to 5 us


def predict(cases: list[dict[str, Any]], costs: Any, shape: dict[str, int], volunteers: int,
            seed: int) -> tuple[list[dict[str, Any]], Any]:
    """Every case simulated from ``costs`` (calibrated alone) and the two inputs: the all-local 1-session rate
    (``stream_s``) and the backbone rtt-0 1-session breakdown (the dispatch machinery): the rows, the costs."""
    import msgspec

    from sim.serving import ServingSim

    anchor = next(c for c in cases if c["case"] == "backbone" and c["rtt_ms"] == 0 and c["sessions"] == 1)
    local1 = next(c for c in cases if c["case"] == "all_local" and c["rtt_ms"] == 0 and c["sessions"] == 1)
    costs = msgspec.structs.replace(costs, **machinery(anchor))
    if anchor.get("network_ms_per_token") and local1.get("network_ms_per_token") and anchor.get("round_trips_per_token"):
        # the backbone's network thread per token beyond the streaming all-local pays: its work per remote call
        extra = anchor["network_ms_per_token"] - local1["network_ms_per_token"]
        costs = msgspec.structs.replace(costs, net_call_s=max(0.0, extra) / 1000 / anchor["round_trips_per_token"])
    if local1.get("network_ms_per_token"):  # measured: the network thread's CPU per token streamed, all-local
        costs = msgspec.structs.replace(costs, stream_s=local1["network_ms_per_token"] / 1000, step_s=0.0,
                                        source=costs.source + " + the all-local 1-session network thread + backbone rtt-0 breakdown")
    else:  # a JSON from before backbone.py measured it: fitted to the all-local 1-session rate
        costs = fit_stream(costs, local1, lambda c: point(c, shape, local1, seed, volunteers=0, held=True))
        costs = msgspec.structs.replace(costs, source=costs.source + " + the all-local 1-session rate + backbone rtt-0 breakdown")
    # the backbone path's own measurements where the calibration cannot see them (the anchor: an input): the
    # volunteers' compute as the run measured it (the calibration times one expert call alone, in a quiet
    # process), then the engine's work per step outside the layers (embedding, head, the runtime's step, the
    # waits for the network thread's burst at the step's end) fitted so the anchor decodes at its measured rate
    costs_bb = backbone_costs(costs, anchor, shape, lambda c: point(c, shape, anchor, seed, volunteers=volunteers,
                                                                      held=False, layout=(anchor.get("layouts") or [None])[0]))
    out = []
    for c in cases:
        backbone = c["case"] == "backbone"
        # each run on the map it had (the market's hand-out differs between runs); the median over the runs
        layouts = (c.get("layouts") or [None]) if backbone else [None]
        runs = {json.dumps(L): ServingSim(point(costs_bb if backbone else costs, shape, c, seed,
                                                volunteers=volunteers if backbone else 0,
                                                held=not backbone, layout=L)).run() for L in layouts}
        rates = [runs[json.dumps(L)].tokens_per_s for L in layouts]
        predicted = statistics.median(rates)
        groups: dict[str, int] = {}
        for r in runs.values():
            for k, v in r.groups.items():
                groups[str(k)] = groups.get(str(k), 0) + v
        err = predicted / c["tokens_per_s"] - 1 if c["tokens_per_s"] else None
        out.append({"case": c["case"], "rtt_ms": c["rtt_ms"], "sessions": c["sessions"], "runs": c.get("runs", 1),
                    "measured_tokens_per_s": round(c["tokens_per_s"], 2), "predicted_tokens_per_s": round(predicted, 2),
                    "predicted_per_run": [round(x, 2) for x in rates],
                    "error": None if err is None else round(err, 4), "input": c is anchor or c is local1,
                    "groups": dict(sorted(groups.items()))})
    return out, costs_bb


def offload_medians(run: dict[str, Any]) -> list[dict[str, Any]]:
    """``benchmarks/offload.py``'s local and adaptive cases: the median tokens/s over its repeats per (mode, rtt, sessions)."""
    by: dict[tuple[str, float, int], list[float]] = {}
    for c in run["cases"]:
        if c["case"] in ("local", "adaptive"):
            by.setdefault((c["case"], float(c["rtt_ms"]), int(c["sessions"])), []).append(float(c["tokens_per_s"]))
    return [{"case": k[0], "rtt_ms": k[1], "sessions": k[2], "runs": len(v), "tokens_per_s": statistics.median(v),
             "all_tokens_per_s": v} for k, v in sorted(by.items())]


def predict_offload(cases: list[dict[str, Any]], costs: Any, shape: dict[str, int],
                    seed: int) -> tuple[list[dict[str, Any]], Any]:
    """``offload.py``'s setup simulated: the coordinator at one ggml thread holding every expert, one volunteer
    at one thread on the same two cores serving every layer in four ranges, local-only (no volunteer listed)
    and adaptive; input: the local 1-session rate (``stream_s``)."""
    from sim.serving import ServingSim

    def pt(c: Any, case: dict[str, Any]) -> Any:
        return point(c, shape, case, seed, volunteers=1 if case["case"] == "adaptive" else 0, held=True,
                     ranges_per_layer=4, threads=1)

    local1 = next(c for c in cases if c["case"] == "local" and c["rtt_ms"] == 0 and c["sessions"] == 1)
    costs = fit_stream(costs, local1, lambda c: pt(c, local1))
    out = []
    for c in cases:
        r = ServingSim(pt(costs, c)).run()
        err = r.tokens_per_s / c["tokens_per_s"] - 1
        out.append({"case": f"offload_{c['case']}", "rtt_ms": c["rtt_ms"], "sessions": c["sessions"], "runs": c["runs"],
                    "measured_tokens_per_s": round(c["tokens_per_s"], 2), "predicted_tokens_per_s": round(r.tokens_per_s, 2),
                    "error": round(err, 4), "input": c is local1, "groups": {str(k): v for k, v in sorted(r.groups.items())},
                    "remote_rows": r.remote_rows})
    return out, costs


def shape_of(model: Path) -> dict[str, int]:
    from swarm.model.gguf import GGUFModel

    cfg = GGUFModel(model).config
    return {"n_moe_layer": int(cfg.n_moe_layer), "n_expert": int(cfg.n_expert), "top_k": int(cfg.n_expert_used)}


def main() -> None:
    import msgspec

    from sim.costs import Costs, calibrate, load_costs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="backbone.py --quick (the small shape)")
    ap.add_argument("--smoke", action="store_true", help="backbone.py --smoke (tiny; make test)")
    ap.add_argument("--repeat", type=int, default=None, help="backbone.py runs, medians per case (default 3; --smoke 1)")
    ap.add_argument("--backbone-json", type=Path, nargs="+", default=None,
                    help="backbone.py JSONs already measured (with --model): medians per case")
    ap.add_argument("--model", type=Path, default=None, help="the GGUF those JSONs were measured on")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per completion of backbone.py (default 128 with --quick: long enough for steady decode, "
                         "which the simulation predicts, to outweigh the start of each case)")
    ap.add_argument("--costs", type=Path, default=None, help="a cost file calibrated on this machine (else calibrated here)")
    ap.add_argument("--offload", action="store_true",
                    help="also offload.py (bench model, 1 and 4 sessions, 96 tokens, 2 repeats): local and adaptive")
    ap.add_argument("--offload-json", type=Path, default=None, help="an offload.py JSON already measured (the bench model)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if (a.backbone_json is None) != (a.model is None):
        ap.error("--backbone-json and --model go together")
    if a.backbone_json is None:
        size = "tiny" if a.smoke else "small"
        work = Path(tempfile.gettempdir()) / f"moe-swarm-backbone-{size}"
        out_dir = Path(tempfile.mkdtemp(prefix="sim-validate-"))
        args = ["--smoke"] if a.smoke else ["--quick", "--draft", "none", "--tokens", str(a.tokens or 128)]
        a.backbone_json = []
        for i in range(a.repeat or (1 if a.smoke else 3)):
            js = out_dir / f"backbone-{i}.json"
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "backbone.py"), *args, "--work", str(work),
                            "--json", str(js)], check=True, cwd=ROOT)
            a.backbone_json.append(js)
        a.model = work / f"{size}.gguf"
    runs = [json.loads(p.read_text()) for p in a.backbone_json]
    cases = medians(runs)
    shape = shape_of(a.model)
    costs: Costs = load_costs(a.costs) if a.costs else calibrate(a.model, threads=2)
    rows, fitted = predict(cases, costs, shape, int(runs[0]["volunteers"]), a.seed)
    print(f"\n{'case':<10} {'rtt ms':>6} {'sess':>4} {'measured':>9} {'predicted':>9} {'error':>7}  groups")
    for r in rows:
        err = "input" if r["input"] else ("-" if r["error"] is None else f"{100 * r['error']:+.1f}%")
        groups = ",".join(f"{k}x{v}" for k, v in r["groups"].items())
        print(f"{r['case']:<10} {r['rtt_ms']:>6g} {r['sessions']:>4} {r['measured_tokens_per_s']:>9.2f} "
              f"{r['predicted_tokens_per_s']:>9.2f} {err:>7}  {groups}")
    off: dict[str, Any] | None = None
    if a.offload and a.offload_json is None:
        a.offload_json = Path(tempfile.mkdtemp(prefix="sim-validate-")) / "offload.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--sessions", "1", "4", "--decode", "96",
                        "--repeat", "2", "--json", str(a.offload_json)], check=True, cwd=ROOT)
    if a.offload_json is not None:
        bench = ROOT / "benchmarks" / ".cache" / "bench-qwen3moe.gguf"
        off_measured, off_shape, off_calibrated = offload_medians(json.loads(a.offload_json.read_text())), shape_of(bench), \
            calibrate(bench, threads=1)
        off_rows, off_costs = predict_offload(off_measured, off_calibrated, off_shape, a.seed)
        # what a test needs to simulate them again (tests/sim/test_validation.py)
        off = {"measured": off_measured, "shape": off_shape, "costs": msgspec.to_builtins(off_calibrated),
               "fitted_stream_s": off_costs.stream_s}
        rows += off_rows
        for r in off_rows:
            err = "input" if r["input"] else f"{100 * r['error']:+.1f}%"
            print(f"{r['case']:<10} {r['rtt_ms']:>6g} {r['sessions']:>4} {r['measured_tokens_per_s']:>9.2f} "
                  f"{r['predicted_tokens_per_s']:>9.2f} {err:>7}  remote rows {r['remote_rows']}")
    worst = max((abs(r["error"]) for r in rows if not r["input"] and r["error"] is not None), default=0.0)
    print(f"\nworst prediction error (inputs excluded): {100 * worst:.1f} % (target <= 20 %); "
          f"stream_s {1000 * fitted.stream_s:.3f} ms, backbone head_s {1000 * fitted.head_s:.3f} ms, "
          f"volunteer pair {1000 * fitted.worker_pair_s:.4f} ms")
    # what a test needs to simulate the same cases again: the measured medians, the shape, the costs calibrated
    write_json(a.json, {"benchmark": "sim_validate", "size": runs[0].get("size"), "volunteers": runs[0]["volunteers"],
                        "runs": len(runs), "shape": shape, "measured": cases, "costs": msgspec.to_builtins(costs),
                        "fitted_stream_s": fitted.stream_s, "backbone_costs": msgspec.to_builtins(fitted),
                        "offload": off, "cases": rows, "worst_error": round(worst, 4)})


if __name__ == "__main__":
    main()
