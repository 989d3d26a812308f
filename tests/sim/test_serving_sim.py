"""The serving simulation (``sim.serving``): the real dispatch core over declared costs, in logical time."""

from __future__ import annotations

import heapq
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.core.events import DispatchConfig
from sim.costs import Costs, calibrate, dump_costs, load_costs
from sim.scenario import ScenarioError
from sim.serving import Point, ServingSim, _Clock, _Fifo, _Machine, local_only
from sim.serving_run import COORDINATOR_DISPATCH, load_serving, run_serving
from tests.conftest import GOLDEN_GGUF

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "benchmarks" / "scenarios" / "serving-smoke.toml"
COSTS = Costs(dense_layer_s=0.0004, dense_row_s=0.0002, expert_call_s=0.0003, expert_pair_s=0.0002,
              worker_call_s=0.0001, worker_pair_s=0.0002, threads=2)


def point(**over: object) -> Point:
    kw: dict[str, object] = dict(costs=COSTS, n_layer=4, n_expert=32, top_k=4, ranges_per_layer=4, sessions=16, slots=32,
                                 volunteers=2, speed=2.0, rtt_s=0.001, bandwidth=1.25e8, shared_cores=False,
                                 machine_cores=2, coordinator_threads=2, warmup_s=20.0, measure_s=10.0)
    kw.update(over)
    return Point(**kw)  # type: ignore[arg-type]


def test_processor_sharing() -> None:
    clock = _Clock()
    m = _Machine(clock, 2)
    done: dict[str, float] = {}
    m.run(1.0, 2, lambda: done.update(two=clock.now))  # alone: 1 s
    m.run(0.5, 1, lambda: done.update(one=clock.now))  # 3 threads on 2 cores: each at 2/3
    while clock.heap:
        t, _, fn = heapq.heappop(clock.heap)
        clock.now = t
        fn()
    assert done["one"] == pytest.approx(0.75)  # 0.5 s of work at 2/3
    assert done["two"] == pytest.approx(0.75 + 0.5)  # 0.5 done by 0.75, the rest alone at full speed


def _drain(clock: _Clock) -> None:
    while clock.heap:
        t, _, fn = heapq.heappop(clock.heap)
        clock.now = t
        fn()


def test_the_interpreter_lock_serialises_python_and_not_the_graphs() -> None:
    """An engine job's Python share waits for the network thread's work ahead of it on the lock; its
    graph share (the lock released) overlaps the network thread's next job on the other core."""
    clock = _Clock()
    m = _Machine(clock, 2)
    net = _Fifo(m, 1)
    engine = _Fifo(m, 1, net)
    done: dict[str, float] = {}
    net.submit(None, lambda: 0.4, lambda _s: done.update(stream=clock.now))  # on the lock first
    engine.submit(None, lambda: 1.0, lambda _s: done.update(step=clock.now), 0.5)  # 0.5 Python, 0.5 graph
    net.submit(None, lambda: 0.4, lambda _s: done.update(call=clock.now))  # behind the engine's Python
    _drain(clock)
    assert done["stream"] == pytest.approx(0.4)
    assert done["step"] == pytest.approx(0.4 + 0.5 + 0.5)  # its Python after the stream, then its graph
    assert done["call"] == pytest.approx(0.4 + 0.5 + 0.4)  # while the graph runs on the other core
    # without a Python share the engine's job overlaps the network thread's from the start
    clock = _Clock()
    m = _Machine(clock, 2)
    net = _Fifo(m, 1)
    engine = _Fifo(m, 1, net)
    net.submit(None, lambda: 0.4, lambda _s: done.update(stream=clock.now))
    engine.submit(None, lambda: 1.0, lambda _s: done.update(step=clock.now), 0.0)
    _drain(clock)
    assert done["step"] == pytest.approx(1.0)


def test_idle_local_only_matches_the_step_time() -> None:
    """One session: idle, every layer on the engine's fast path; tokens/s is the declared step's inverse."""
    p = point(sessions=1)
    step = p.n_layer * (COSTS.dense(1) + COSTS.experts(4)) + COSTS.head(1)
    r = ServingSim(p).run()
    assert abs(r.tokens_per_s - 1 / step) <= 1 / p.measure_s + 1e-9
    assert r.remote_calls == 0 and r.decisions == {"idle_local": r.decisions["idle_local"]}


def test_fast_near_volunteers_pay_under_load_slow_far_ones_do_not_hurt() -> None:
    fast = point()
    a, b = ServingSim(fast).run(), ServingSim(local_only(fast)).run()
    assert a.remote_rows > 0 and a.tokens_per_s > 1.2 * b.tokens_per_s
    far = point(speed=0.5, rtt_s=0.040)
    a, b = ServingSim(far).run(), ServingSim(local_only(far)).run()
    assert a.tokens_per_s >= 0.9 * b.tokens_per_s  # the split check keeps the rows here
    assert a.wrong_tokens == 0


def test_a_liar_is_quarantined_and_no_token_is_wrong_where_the_coordinator_holds_the_experts() -> None:
    r = ServingSim(point(liars=1)).run()
    assert r.quarantined == 1 and r.liars_quarantined == 1 and r.honest_quarantined == 0
    assert len(r.calls_to_quarantine) == 1 and r.calls_to_quarantine[0] >= 1
    assert r.wrong_tokens == 0
    assert r.remote_rows > 0  # the honest volunteer still serves


def test_the_same_seed_gives_the_same_report(tmp_path: Path) -> None:
    sc, costs, cfg = load_serving(SMOKE)
    one = json.dumps(run_serving(sc, costs, cfg, 3), sort_keys=True)
    assert one == json.dumps(run_serving(sc, costs, cfg, 3), sort_keys=True)
    rep = json.loads(one)
    assert {(p["sessions"], p["rtt_ms"]) for p in rep["points"]} == {(1, 1.0), (1, 40.0), (16, 1.0), (16, 40.0)}
    assert all(p["gain"] is not None and math.isfinite(p["gain"]) for p in rep["points"])


@pytest.mark.parametrize(("text", "key"), [
    ("sessions = [1]\nbogus = 1", "bogus"),
    ("sessions = [1]\nranges_per_layer = 3", "ranges_per_layer"),
    ("sessions = [1]\nliars = [3]", "liars"),
    ("sessions = [-1]", "sessions"),
    ("sessions = [64]", "sessions"),
    ("sessions = [1]\n[serving.dispatch]\nnot_a_field = 1", "dispatch.not_a_field"),
])
def test_bad_scenarios_are_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[serving]\ncosts = "%s"\nn_layer = 2\nn_expert = 8\ntop_k = 2\nslots = 8\nvolunteers = 2\n'
                 % (ROOT / "benchmarks" / "scenarios" / "costs" / "bench.toml") + text + "\n")
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")):
        load_serving(f)
    run = subprocess.run([sys.executable, "-m", "swarm.cli", "simulate", str(f)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and key in run.stderr


def test_cli_writes_the_report_and_plots(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "swarm.cli", "simulate", str(SMOKE), "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["kind"] == "serving" and len(rep["points"]) == 4
    png = (tmp_path / "gain-speed-2.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "gain" in run.stdout


def test_calibrate_measures_a_model_and_writes_a_cost_file(tmp_path: Path) -> None:
    c = calibrate(GOLDEN_GGUF, threads=1, batches=(1, 2, 4), steps=5)
    assert c.expert_pair_s > 0 and c.worker_pair_s > 0 and c.dense_layer_s + c.dense_row_s > 0
    assert 0 < c.py_share_dense < 1 and 0 < c.py_share_local < 1  # measured from ggml's graph time
    f = tmp_path / "costs.toml"
    f.write_text(dump_costs(c))
    assert load_costs(f) == c


def test_dispatch_config_overrides_reach_the_core(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text(SMOKE.read_text().replace('"costs/bench.toml"', f'"{SMOKE.parent / "costs" / "bench.toml"}"')
                 + "\n[serving.dispatch]\nverify_rate = 1.0\n")
    _, _, cfg = load_serving(f)
    assert cfg == DispatchConfig(verify_rate=1.0, verify_disk_rate=0.02)


def test_the_simulated_coordinator_has_the_real_ones_dispatch_defaults() -> None:
    from coordinator.server import CoordinatorConfig, dispatch_config
    from sim.serving_run import COORDINATOR_DISPATCH

    assert dispatch_config(CoordinatorConfig(model="m.gguf")) == DispatchConfig(**COORDINATOR_DISPATCH)


def test_a_sleeper_lies_after_its_honest_calls_and_is_caught_by_sampling() -> None:
    """Honest for its first 200 calls (proven, out of probation), then wrong: the default 5 % sample
    catches it; until then its unchecked answers may make tokens wrong (the coordinator used them)."""
    r = ServingSim(point(liars=1, lie_after_calls=200, measure_s=40.0)).run()
    assert r.liars_quarantined == 1 and r.honest_quarantined == 0
    assert 1 <= r.calls_to_quarantine[0] <= 100  # sampled at 5 %: caught within tens of calls of its first lie
    assert r.wrong_tokens > 0  # the exposure sampling leaves (a liar from its first call causes none: above)


def test_the_cost_fit_never_goes_negative() -> None:
    from sim.costs import _fit

    assert _fit([1, 2, 4], [1.0, 2.0, 4.0]) == pytest.approx((0.0, 1.0), abs=1e-9)
    assert _fit([1, 2, 4], [2.0, 3.0, 5.0]) == pytest.approx((1.0, 1.0))
    a, b = _fit([1, 2, 4], [3.0, 2.0, 1.0])  # noise: a falling cost is the line through the origin
    assert a == 0.0 and b == pytest.approx(6.0 / 7.0)


def test_a_layout_is_the_map_the_dispatcher_partitions() -> None:
    """``layout`` (a measured run's map): the default alternation written out gives the same run; two ranges
    per layer on two volunteers make two calls a layer; a gap is computed by the coordinator."""
    base = point(held=False, ranges_per_layer=1, replicas=1, sessions=1, rtt_s=0.0,
                 dispatch=DispatchConfig(**COORDINATOR_DISPATCH))
    alternating = tuple(((0, 32, (layer % 2,)),) for layer in range(4))
    a, b = ServingSim(base).run(), ServingSim(Point(**{**base.__dict__, "layout": alternating})).run()
    assert (a.tokens_per_s, a.remote_calls) == (b.tokens_per_s, b.remote_calls)
    halves = tuple(((0, 16, (0,)), (16, 32, (1,))) for _ in range(4))
    h = ServingSim(Point(**{**base.__dict__, "layout": halves})).run()
    assert h.remote_calls > 1.5 * a.remote_calls  # top-4 of 32: most layers touch both halves
    gap = tuple(((0, 16, (0,)),) for _ in range(4))  # experts 16..31 listed nowhere: computed here
    g = ServingSim(Point(**{**base.__dict__, "layout": gap})).run()
    assert g.local_rows > 0 and g.remote_rows > 0 and g.wrong_tokens == 0
    with pytest.raises(ValueError, match="layout"):
        ServingSim(Point(**{**base.__dict__, "layout": alternating[:2]}))


def test_the_network_threads_work_per_call_delays_the_engine_behind_the_lock() -> None:
    """``net_call_s``: the network thread's own work per remote call holds the interpreter lock, which the
    engine's Python share waits for: a backbone decodes slower with it, and by no more than it adds."""
    import msgspec

    costs = msgspec.structs.replace(COSTS, py_share_dense=0.6, coord_layer_s=0.0001, coord_call_s=0.0002)
    base = point(costs=costs, held=False, ranges_per_layer=1, replicas=1, sessions=4, rtt_s=0.0, shared_cores=True,
                 dispatch=DispatchConfig(**COORDINATOR_DISPATCH))
    slow = Point(**{**base.__dict__, "costs": msgspec.structs.replace(costs, net_call_s=0.0004)})
    a, b = ServingSim(base).run(), ServingSim(slow).run()
    assert b.tokens_per_s < 0.97 * a.tokens_per_s
    calls_per_token = a.remote_calls / max(1.0, a.tokens_per_s * (base.warmup_s + base.measure_s))
    assert 1 / b.tokens_per_s <= 1 / a.tokens_per_s + 1.5 * calls_per_token * 0.0004
