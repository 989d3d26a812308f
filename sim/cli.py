"""``moe-swarm simulate``'s command line (shell; imports nothing heavy until it runs).

Rules:
- Building the parser imports only ``argparse`` and ``swarm.flags``: the market, the volunteer lifecycle
  and numpy are imported when the command runs, so ``moe-swarm --help`` stays fast.
- A bad scenario (unknown key, negative rate, impossible shape) is a ``ScenarioError``: one line naming
  the key and exit code 2 (``swarm.cli``).
- ``report.json`` (and the summary printed) hold simulated quantities only; the wall time goes to stderr,
  so the same scenario and seed write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run", "summary"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on a CLI's subparsers; ``func(ns) -> int`` runs it."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", usage="%(prog)s SCENARIO.toml [--seed N] [--out DIR] | --calibrate MODEL.gguf [--threads N] [--out DIR]",
        help="simulate a swarm at scale over the real market and volunteer cores (logical time, deterministic)",
        description="Run a scenario (benchmarks/scenarios/*.toml) in logical time: the market's request handling "
                    "and the volunteers' lifecycle are the real code; downloads, churn, NAT and the coordinator's "
                    "load are declared by the scenario. The same scenario and seed give the same report, byte "
                    "for byte.")
    parser.add_argument("scenario", type=Path, nargs="?", metavar="SCENARIO.toml",
                        help="the scenario file: a swarm (market + volunteers) or a [serving] grid (sim.serving_run)")
    parser.add_argument("--seed", type=int, default=0, help="the random seed (same seed, same report)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write report.json here (default: print the summary only)")
    parser.add_argument("--calibrate", type=Path, default=None, metavar="MODEL.gguf",
                        help="measure the serving costs of this model on this machine (the real engine and kernels) and "
                             "write them as a cost file (--out DIR/costs.toml, else printed)")
    parser.add_argument("--threads", type=int, default=2, help="with --calibrate: the coordinator's compute threads")
    parser.add_argument("--rtt-json", type=Path, default=None, metavar="JSON",
                        help="with --calibrate: a benchmarks/expert_rtt.py JSON whose lane_null case (else remote_null) gives the "
                             "per-call protocol cost")
    parser.add_argument("--no-plots", action="store_true", help="a [serving] scenario: write report.json only")
    parser.set_defaults(func=run)
    return parser


def summary(report: dict[str, Any]) -> list[str]:
    """A few lines for a person: the coverage holes, each recruitment episode, the market's request rates."""
    cov = report["coverage"]
    lines = [f"volunteers {report['scenario']['volunteers']}, {report['scenario']['duration_s']:g} s simulated; "
             f"full coverage at {cov['first_full_coverage_at']} s"]
    h, ha = cov["holes"], cov["holes_after_full_coverage"]
    lines.append(f"coverage holes: {h['expert_seconds']:.0f} expert-seconds ({100 * h['share_of_expert_time']:.2f} % "
                 f"of expert time); after full coverage {ha['expert_seconds']:.0f}")
    for i, ep in enumerate(report["recruitment"]):
        lines.append(f"episode {i}: load step at {ep['load_step_at']}, saturated +{ep['detect_s']} s, recruited "
                     f"worker serving +{ep['reaction_s']} s; load end {ep['load_end_at']}, boost off +"
                     f"{ep['unboost_s']} s, aged out +{ep['age_out_s']} s ({ep['retired']} retired)")
    for name, r in report["requests"].items():
        lines.append(f"{name}: {r['total']} requests, {r['per_s_mean']:.1f}/s mean, {r['per_s_peak']}/s peak")
    churn = report["lease_churn"]
    lines.append("lease churn: " + ", ".join(f"{k} {v['total']}" for k, v in churn.items()))
    return lines


def run(ns: argparse.Namespace) -> int:
    from sim.engine import Simulation
    from sim.scenario import ScenarioError, load_scenario
    from sim.serving_run import is_serving

    if ns.log_level != "DEBUG":  # the market logs every episode and drop at INFO: thousands of lines here
        logging.getLogger("market").setLevel(logging.WARNING)
    if ns.calibrate is not None:
        return _calibrate(ns)
    if ns.scenario is None:
        raise ScenarioError("simulate needs SCENARIO.toml (or --calibrate MODEL.gguf)")
    if is_serving(ns.scenario):
        return _serving(ns)
    sc = load_scenario(ns.scenario)
    t0 = time.perf_counter()
    report = Simulation(sc, ns.seed).run()
    wall = time.perf_counter() - t0
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "report.json").write_text(json.dumps(report, sort_keys=True, indent=1) + "\n")
    for line in summary(report):
        print(line)
    print(f"simulated {sc.duration_s:g} s in {wall:.1f} s of wall time", file=sys.stderr)
    return 0


def _calibrate(ns: argparse.Namespace) -> int:
    from sim.costs import calibrate, dump_costs
    from sim.scenario import ScenarioError

    if not ns.calibrate.is_file():
        raise ScenarioError(f"--calibrate: no model file {ns.calibrate}")
    text = dump_costs(calibrate(ns.calibrate, threads=ns.threads, rtt_json=ns.rtt_json))
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "costs.toml").write_text(text)
        print(f"wrote {ns.out / 'costs.toml'}")
    else:
        print(text, end="")
    return 0


def _serving(ns: argparse.Namespace) -> int:
    from sim.serving_run import load_serving, plot, run_serving, serving_summary

    sc, costs, cfg = load_serving(ns.scenario)
    t0 = time.perf_counter()
    report = run_serving(sc, costs, cfg, ns.seed)
    wall = time.perf_counter() - t0
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "report.json").write_text(json.dumps(report, sort_keys=True, indent=1) + "\n")
        if not ns.no_plots:
            for p in plot(report, ns.out):
                print(f"wrote {p}", file=sys.stderr)
    for line in serving_summary(report):
        print(line)
    print(f"simulated {len(report['points'])} points in {wall:.1f} s of wall time", file=sys.stderr)
    return 0
