"""Benchmarks that cannot rot: each runs with ``--smoke`` (tiny sizes, seconds) as a user runs it -- its
own process, ``python benchmarks/NAME.py --smoke --json OUT`` -- and its JSON is checked against DESIGN
§11's shape and the fields its docstring documents. A change that breaks a benchmark fails ``make test``.

``SMOKE`` names each benchmark's checker; every benchmark in ``benchmarks/`` must be in it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
UNIT_SUFFIXES = ("_ms", "_s", "_per_s", "_pct", "_mb", "_bytes", "_flops", "_per_day")
TIMED_WORDS = ("time", "latency", "duration", "wait", "elapsed")


def run_smoke(name: str, tmp_path: Path, *extra: str, timeout_s: float = 300.0) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{name} --smoke failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def check_design_shape(result: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """DESIGN §11: ``{"benchmark": NAME, "cases": [{"case": str, ...}]}``, timed numbers named with their
    unit; returns the cases by name (several of one name: the last)."""
    assert result["benchmark"] == name
    cases = result["cases"]
    assert isinstance(cases, list) and cases, "no cases"
    for c in cases:
        assert isinstance(c, dict) and isinstance(c.get("case"), str) and c["case"], c
        for k, v in c.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and any(w in k for w in TIMED_WORDS):
                assert k.endswith(UNIT_SUFFIXES) or k == "seconds", f"{name}/{c['case']}: {k!r} names no unit"
    return {c["case"]: c for c in cases}


def check_market(result: dict[str, Any]) -> None:
    cases = check_design_shape(result, "market")
    n = result["volunteers"]
    for store in ("sqlite", "memory"):
        for kind in ("health-baseline", "expert-volunteer", "expert-volunteer-repoll", "expert-coverage-first",
                     "expert-coverage-steady"):
            c = cases[f"{kind}/{store}"]
            assert c["requests_per_s"] > 0 and 0 < c["median_ms"] <= c["p99_ms"], c
            assert c["requests"] == (n * c.get("rounds", 1)), c
        assert cases[f"expert-volunteer/{store}"]["assigned"] == n  # every volunteer got a slice
        assert cases[f"expert-coverage-first/{store}"].get("live_volunteers", n) == n


def check_faults(result: dict[str, Any]) -> None:
    cases = check_design_shape(result, "faults")
    for mode in ("adaptive", "offload"):
        c = cases[mode]
        assert c["seeds_failed"] == 0, c["failures"]
        assert c["layers_completed"] == c["layers_expected"] > 0 and c["wall_s"] >= 0


def check_verification(result: dict[str, Any]) -> None:
    cases = check_design_shape(result, "verification")
    for name, c in cases.items():
        assert {"verify_rate", "completions", "completions_differing", "false_quarantines"} <= c.keys() or name == "honest", c
        assert c["false_quarantines"] == 0, c
    zeros = cases["zeros"]
    assert zeros["calls_to_quarantine"] is not None and zeros["completions_differing"] == 0
    pair = cases["colluding-pair"]  # agreeing liars on one network: caught from the file on disk, no wrong output
    assert pair["calls_to_quarantine"] is not None and pair["completions_differing"] == 0 and pair["disk_checks"] > 0, pair
    drift = cases["sub-tolerance-0.04"]  # each answer within the tolerance, the errors add up to a quarantine
    assert drift["calls_to_quarantine"] is not None and drift["calls_to_quarantine"] <= 40, drift
    sq = cases["squatter-liar"]  # the market dropped the squatter, recruited an honest replica, the liar was caught
    assert sq["recruit_wait_s"] is not None and sq["honest_mapped"] and not sq["squatter_mapped"], sq
    assert sq["calls_to_quarantine"] is not None and sq["completions_differing"] == 0, sq
    jam = cases["budget-jam"]  # nothing stayed reserved; the coordinator was served, never refused busy
    assert jam["budget_held_bytes"] == 0 and jam["busy_refusals"] == 0 and jam["remote_calls"] > 0, jam
    assert jam["headers_refused_at_once"] == 8 and jam["completions_differing"] == 0, jam
    honest = cases["honest"]
    assert honest["calls"] >= 50 and honest["verifications"] > 0 and honest["completions_differing"] == 0


def check_capacity(result: dict[str, Any]) -> None:
    cases = check_design_shape(result, "capacity")
    for name in ("reference_c1", "reference_c4", "decode_c1", "decode_c4"):
        assert cases[name]["tokens_per_s"] > 0, cases[name]
    check = cases["check"]  # a coordinator without experts served the reference's tokens, none computed by itself
    assert check["tokens_identical"] is True and check["coordinator_local_rows"] == 0 and check["coverage_s"] > 0, check
    procs = [c for c in result["cases"] if "peak_rss_mb" in c]
    assert len(procs) >= 1 + result["volunteers"], procs  # the reference, the coordinator, each volunteer
    for c in procs:
        assert c["peak_rss_mb"] > 0 and (not c.get("cap_mb") or c["peak_rss_mb"] <= c["cap_mb"]), c


def check_expert_rtt(result: dict[str, Any]) -> None:
    check_design_shape(result, "expert_rtt")
    got = {(c["case"], c["batch"]): c for c in result["cases"]}
    for batch in (1, 8):
        for case in ("local", "remote", "remote_null", "remote_sleep", "tcp_floor", "remote_relayed", "lane", "lane_null",
                     "lane_sleep"):
            c = got[(case, batch)]  # every remote answer was checked equal to the local one inside the run
            assert 0 < c["median_ms"] <= c["p99_ms"] and c["tokens_per_s"] > 0, c
        assert got[("remote_relayed", batch)]["relayed_over_direct"] > 0
        assert set(result["overhead_split"][str(batch)]) == {"protocol_ms", "wait_ms"}
        assert set(result["lane_overhead"][str(batch)]) == {"overhead_ms", "protocol_ms"}
    assert got[("remote_concurrent8", 8)]["tokens_per_s"] > 0 and result["via_relay"] is True


def check_offload(result: dict[str, Any]) -> None:
    check_design_shape(result, "offload")
    modes = [c for c in result["cases"] if c["case"] in ("local", "adaptive")]
    assert {(c["case"], c["sessions"]) for c in modes} == {(m, n) for m in ("local", "adaptive") for n in (1, 2)}, modes
    for c in modes:
        assert c["tokens_per_s"] > 0 and c["tokens_equal_local"] is True, c
        assert c["rows_local"] + c["rows_remote"] > 0, c
        if c["case"] == "local":
            assert c["rows_remote"] == 0, c
    ratios = [c for c in result["cases"] if c["case"] == "ratio"]
    assert {(r["mode"], r["sessions"]) for r in ratios} >= {("adaptive", 1), ("adaptive", 2)}, ratios
    assert all(r["median"] > 0 for r in ratios), ratios
    [b] = [c for c in result["cases"] if c["case"] == "bound"]
    assert b["dense_ms"] > 0 and b["experts_ms"] > 0 and b["ideal_gain"] >= 1.0 and b["shared_gain"] > 0, b


def check_engine(result: dict[str, Any]) -> None:
    cases = check_design_shape(result, "engine")
    for name in ("prefill_c1", "decode_c1", "prefill_c4", "decode_c4"):
        c = cases[name]
        assert c["tokens_per_s"] > 0 and c["concurrency"] == int(name[-1]) and c["kernel"] == "ggml", c
        if name.startswith("decode"):  # the step's breakdown: some of it in ggml's graphs, never more than all
            # (the tiny model's decode may end before its first token reaches the trio side: share 0)
            assert 0.0 <= c["graph_share"] < 1.0 and 0.0 < c["outside_graph_ms"] <= c["step_ms"], c
            assert 0.0 < c["case_graph_share"] < 1.0, c
            assert c["graphs_per_step"] >= 0.0, c  # 1 where a step is one graph (0 when the window held none)
    assert cases["rss"]["rss_mb"] > cases["rss"]["rss_before_load_mb"] > 0 and cases["rss"]["file_mb"] > 0


def check_backbone(result: dict[str, Any]) -> None:
    check_design_shape(result, "backbone")
    fields = {"case", "rtt_ms", "sessions", "draft", "tokens_per_s", "ms_per_token", "round_trips_per_token",
              "acceptance", "tokens_identical", "layer_breakdown_ms", "remote_share", "verified_rows",
              "network_ms_per_token"}
    kinds = {c["case"] for c in result["cases"]}
    assert kinds == {"all_local", "backbone"}, kinds
    for c in result["cases"]:
        backbone = c["case"] == "backbone"
        assert set(c) == fields | ({"decisions", "layout"} if backbone else set()) and c["tokens_per_s"] > 0, c
        assert c["network_ms_per_token"] is not None and c["network_ms_per_token"] >= 0, c  # Linux: from /proc
        if backbone:
            assert c["tokens_identical"] is True and c["round_trips_per_token"] > 0, c
            # why the calls were what they were, and the map they followed (each range held by a volunteer)
            assert c["decisions"] and all(isinstance(v, int) and v > 0 for v in c["decisions"].values()), c
            assert c["layout"] and all(rs and all(0 <= lo < hi and vols and all(v >= 0 for v in vols)
                                                  for lo, hi, vols in rs) for rs in c["layout"]), c
            assert c["remote_share"] == 1.0, c  # measured in the steady state: every routed row on a volunteer
            bd = c["layer_breakdown_ms"]
            assert bd["layers"] > 0 and bd["total"] > 0 and bd["crossings"] <= 2.0, bd  # the one layer path's bound


def check_gateway(result: dict[str, Any]) -> None:
    cases = check_design_shape(result, "gateway")
    off, on, ratio = cases["shared_prompt/off"], cases["shared_prompt/on"], cases["shared_prompt/ratio"]
    assert off["prefill_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0, off  # every token computed
    # each prompt token computed or reused, never both; the shared system prompt reused
    assert on["prefill_tokens"] + on["cached_tokens"] == on["prompt_tokens"] == off["prompt_tokens"], on
    assert on["cached_tokens"] >= (on["users"] - 1) * on["system_tokens"] and on["kept_bytes"] > 0, on
    assert ratio["tokens_identical"] is True and 0 < ratio["prefill_tokens_ratio"] < 1, ratio
    assert on["ttft_mean_ms"] > 0 and off["ttft_mean_ms"] > 0 and ratio["ttft_mean_ratio"] > 0, ratio
    # case (c), the admission ramp: its plumbing (the pass criteria are the full run's, on the bench model; a
    # smoke run on a shared machine measures noise)
    fixed, ramp = cases["admission_ramp/fixed"], cases["admission_ramp"]
    n = len(fixed["sessions"])
    assert fixed["sessions"] == list(range(1, n + 1)) and all(v > 0 for v in fixed["fixed_mean_tokens_per_s"]), fixed
    assert ramp["tps_floor_tokens_per_s"] > 0 and 1 <= ramp["best_fixed_sessions"] <= n, ramp
    assert 0 <= ramp["admitted_sessions"] <= n and ramp["below_floor_longest_s"] >= 0, ramp
    assert ramp["admitted_within_one"] == (abs(ramp["admitted_sessions"] - ramp["best_fixed_sessions"]) <= 1), ramp
    assert ramp["timeline"] and all(0 <= k <= n for _, k, _ in ramp["timeline"]), ramp
    assert any(m is not None and m > 0 for _, _, m in ramp["timeline"]), ramp  # the coordinator measured its sessions
    # the per-second trace (why the mean moves: sessions, parked, prefill, steps, contexts, the machine's load)
    assert ramp["preempt"] == "park" and ramp["parks"] >= 0 and ramp["resumes"] <= ramp["parks"], ramp
    assert ramp["trace"] and {"sessions", "parked", "mean_active_tps", "decode_tps", "prefill_tokens", "steps",
                              "mean_ctx", "load_1m"} <= ramp["trace"][0].keys(), ramp
    assert all(0 <= r["parked"] <= r["sessions"] <= n for r in ramp["trace"]), ramp

    # case (b): the gateway spread the sessions over both coordinators; the same tokens either way
    one, two, scale = cases["scale_out/1x4"], cases["scale_out/2x4"], cases["scale_out/ratio"]
    assert one["per_coordinator"] == [one["sessions"]] and sum(two["per_coordinator"]) == two["sessions"], two
    assert min(two["per_coordinator"]) >= 1, two
    assert one["tokens"] == two["tokens"] == one["sessions"] * one["tokens_per_session"], (one, two)
    assert scale["tokens_identical"] is True and scale["tokens_per_s_ratio"] > 0, scale


def check_sim_validate(result: dict[str, Any]) -> None:
    check_design_shape(result, "sim_validate")
    kinds = {(c["case"], c["input"]) for c in result["cases"]}
    assert ("all_local", True) in kinds and ("backbone", True) in kinds, kinds  # the two measured inputs
    for c in result["cases"]:
        assert c["measured_tokens_per_s"] > 0 and c["predicted_tokens_per_s"] > 0, c
        assert c["error"] == pytest.approx(c["predicted_tokens_per_s"] / c["measured_tokens_per_s"] - 1, abs=1e-3), c
        assert sum(c["groups"].values()) > 0, c  # steps were simulated
    assert result["worst_error"] >= 0


SMOKE: dict[str, Callable[[dict[str, Any]], None]] = {
    "sim_validate": check_sim_validate,
    "gateway": check_gateway,
    "capacity": check_capacity,
    "engine": check_engine,
    "expert_rtt": check_expert_rtt,
    "offload": check_offload,
    "backbone": check_backbone,
    "market": check_market,
    "faults": check_faults,
    "verification": check_verification,
}
NOT_BENCHMARKS = ("_", "make_")  # helpers and the golden-file generators


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_a_benchmark_runs_in_seconds_and_writes_its_documented_json(name: str, tmp_path: Path) -> None:
    SMOKE[name](run_smoke(name, tmp_path))


def test_every_benchmark_has_a_smoke_run() -> None:
    found = {p.stem for p in BENCH.glob("*.py") if not p.stem.startswith(NOT_BENCHMARKS)}
    assert found - SMOKE.keys() == set(), "a benchmark without a --smoke run in tests/benchmarks"
    assert SMOKE.keys() <= found
    for name in SMOKE:
        assert "--smoke" in (BENCH / f"{name}.py").read_text(), name


def _options(path: Path) -> set[str]:
    """The ``dest`` of every ``add_argument("--flag", ...)`` in a benchmark's source."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("--"):
                dest = next((k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)),
                            first.value[2:].replace("-", "_"))
                out.add(str(dest))
    return out


def test_verifications_throughput_case_gives_offload_every_option_it_reads() -> None:
    """``verification.py`` runs ``offload.run`` with a namespace of its own (its throughput cost): it
    crashed when offload.py gained ``--rtt-ms``. Every option offload.py defines must be in it."""
    sys.path.insert(0, str(BENCH))
    try:
        import verification
    finally:
        sys.path.remove(str(BENCH))
    ns = vars(verification.offload_namespace(quick=True))
    missing = _options(BENCH / "offload.py") - ns.keys()
    assert not missing, f"verification.offload_namespace lacks {sorted(missing)}"
    assert ns["sessions"] == [4] and ns["verify_cases"] is True


STAND_IN = """#!/bin/sh
# a stand-in for a Python with llama-cpp-python: engine.py runs `PY -c SCRIPT path prompt decode n_par rep repack`;
# the decode rate it reports encodes what reached it: +2 repack, +4 GGML_CPU_TILED_MM=0, +8 any other GGML_*
# variable or PYTHONPATH, +OFFSET (which stand-in)
rate=$((1 + OFFSET))
[ "$8" = "1" ] && rate=$((rate + 2))
[ "${GGML_CPU_TILED_MM-unset}" = "0" ] && rate=$((rate + 4))
others=$(env | grep -E '^(GGML_|PYTHONPATH=)' | grep -v '^GGML_CPU_TILED_MM=0$')
[ -n "$others" ] && rate=$((rate + 8))
echo '{"prefill": 100.0, "decode": '$rate'.0, "version": "stand-in"}'
"""


def test_engine_runs_each_llamacpp_configuration_with_its_own_environment(tmp_path: Path) -> None:
    """``--llamacpp-invariant`` and ``--llamacpp-same-build`` add columns, each llama.cpp run in its own
    configuration (repack on/off, ``GGML_CPU_TILED_MM``) and none of the engine's ggml settings or paths:
    stand-in executables report what reached them."""
    pys = []
    for i, offset in enumerate((0, 100)):
        p = tmp_path / f"py{i}"
        p.write_text(STAND_IN.replace("OFFSET", str(offset)))
        p.chmod(0o755)
        pys.append(str(p))
    out = tmp_path / "engine.json"
    r = subprocess.run([sys.executable, str(BENCH / "engine.py"), "--smoke", "--json", str(out),
                        "--llamacpp-python", pys[0], "--llamacpp-invariant", "--llamacpp-same-build", pys[1]],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "GGML_SCHED_X": "1", "GGML_CPU_TILED_MM": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = check_design_shape(json.loads(out.read_text()), "engine")
    for name in ("decode_c1", "decode_c4"):
        c = cases[name]
        assert c["llamacpp_variants"] == {"default": 3.0, "invariant": 5.0, "same_build": 105.0}, c
        assert c["llamacpp_tokens_per_s"] == 3.0 and c["llamacpp_version"] == "stand-in"
        assert c["rounds"][0]["llamacpp_same_build_tokens_per_s"] == 105.0, c
    assert "llama.cpp same_build" in r.stdout and "llama.cpp invariant" in r.stdout
