"""Seeded fault injection, many seeds (DESIGN §11 JSON): kills and restarts, 10 s freezes and
partitions of three volunteers while a loaded coordinator dispatches (``tests/sim/test_fault_injection``,
virtual time on the fake network). Every layer must complete once with the all-local bits.

    python benchmarks/faults.py [--quick | --smoke] [--json OUT] [--seeds N] [--steps N]

``--smoke`` (``make test``: ``tests/benchmarks``): 2 seeds of 10 layers per mode, a few seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402

from coordinator.core.dispatch import DispatchMode  # noqa: E402
from tests.sim.test_fault_injection import run_seed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 seeds")
    ap.add_argument("--smoke", action="store_true", help="2 seeds of 10 layers (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--steps", type=int, default=60, help="layers dispatched per seed")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the dispatcher's per-failure warnings: thousands of them here
    if args.quick:
        args.seeds = 10
    if args.smoke:
        args.seeds, args.steps = 2, 10
    cases: list[dict[str, Any]] = []
    for mode in (DispatchMode.ADAPTIVE, DispatchMode.OFFLOAD):
        t0 = time.perf_counter()
        runs, failed = [], []
        for seed in range(args.seeds):
            try:
                runs.append(trio.run(run_seed, seed, args.steps, mode, clock=trio.testing.MockClock(autojump_threshold=0)))
            except Exception as exc:  # noqa: BLE001 - a failed seed is counted and shown
                failed.append({"seed": seed, "error": f"{type(exc).__name__}: {exc}"[:300]})
        tot = {k: sum(r[k] for r in runs) for k in ("steps", "kills", "restarts", "freezes", "partitions", "errors",
                                                      "quarantines")}
        case = {"case": mode.value, "seeds": args.seeds, "seeds_failed": len(failed), "layers_completed": tot["steps"],
                "layers_expected": args.seeds * args.steps, **{f"{k}_total": v for k, v in tot.items() if k != "steps"},
                "wall_s": round(time.perf_counter() - t0, 1), "failures": failed[:10]}
        cases.append(case)
        print(f"{mode.value:9} seeds {args.seeds} failed {len(failed)}: layers {tot['steps']}/{args.seeds * args.steps} "
              f"identical to all-local; kills {tot['kills']} (restarts {tot['restarts']}), freezes {tot['freezes']}, "
              f"partitions {tot['partitions']}; call failures {tot['errors']}; quarantines {tot['quarantines']}", flush=True)
    result = {"benchmark": "faults", "cases": cases}
    write_json(args.json, result)


if __name__ == "__main__":
    main()
