"""A serving scenario (``[serving]`` in the TOML): a grid of points, each simulated with and without the
volunteers (``sim.serving``), into a report and plots.

Rules:
- Every key is declared; an unknown key, a negative or zero rate, an impossible shape (experts not divisible
  into the ranges, ``top_k`` above the experts, more liars than volunteers, sessions above the slots) is refused
  with one line naming the key (``ScenarioError``, exit 2).
- ``costs`` names a cost file (relative to the scenario) or is a table of ``sim.costs.Costs``'s keys.
- The grid is liars x speed x rtt_ms x sessions; each point runs the adaptive dispatcher with the volunteers and the
  same point with none and every expert held (local-only / all-local), from the same seed; ``gain`` is their
  tokens/s ratio. ``coordinator_holds = "none"`` is a backbone: every range goes to the volunteers (session
  groups chosen by the real ``PipelineModel``/``GroupArms``); ``rtt_sigma`` spreads the volunteers' round
  trips (lognormal around ``rtt_ms``).
- ``[serving.dispatch]`` overrides ``DispatchConfig`` fields; the rest are what ``moe-swarm coordinator``
  gives its core by default (``COORDINATOR_DISPATCH``: where they differ from ``DispatchConfig``'s own).
- The report holds simulated quantities only (same scenario and seed, same bytes); plots are written beside it
  when matplotlib is importable (a PNG per volunteer speed: gain against sessions, a line per round trip).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from coordinator.core.events import DispatchConfig
from sim.costs import Costs, load_costs
from sim.scenario import ScenarioError
from sim.serving import Point, ServingSim, local_only

__all__ = ["COORDINATOR_DISPATCH", "ServingScenario", "is_serving", "load_serving", "plot", "run_serving", "serving_summary"]

Pos = Annotated[float, msgspec.Meta(gt=0.0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


# what ``moe-swarm coordinator`` gives its dispatch core where DispatchConfig's own defaults differ
# (``coordinator.server.dispatch_config`` at the coordinator's defaults; a test keeps them equal): the
# simulated coordinator is the real one as shipped
COORDINATOR_DISPATCH: dict[str, Any] = {"verify_disk_rate": 0.02}


class ServingScenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    costs: str | Costs
    n_layer: PosInt
    n_expert: PosInt
    top_k: PosInt
    ranges_per_layer: PosInt = 4
    slots: PosInt = 64
    sessions: list[PosInt]
    rtt_ms: list[Annotated[float, msgspec.Meta(ge=0.0)]] = msgspec.field(default_factory=lambda: [1.0])
    speed: list[Pos] = msgspec.field(default_factory=lambda: [1.0])
    volunteers: Annotated[int, msgspec.Meta(ge=0)] = 1
    replicas: Annotated[int, msgspec.Meta(ge=0)] = 0  # volunteers holding each range (0: all of them)
    liars: list[Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=lambda: [0])  # an axis of the grid
    lie_after_calls: Annotated[int, msgspec.Meta(ge=0)] = 0  # a liar's honest calls first (a sleeper)
    coordinator_holds: Literal["all", "none"] = "all"  # "none": a backbone (every range remote; baseline all-local)
    rtt_sigma: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # each volunteer's RTT: rtt_ms x lognormal(0, sigma)
    cores: Literal["own", "shared"] = "own"
    machine_cores: PosInt = 2
    coordinator_threads: PosInt = 2
    bandwidth_bytes_per_s: Pos = 125_000_000.0
    warmup_s: Pos = 30.0
    measure_s: Pos = 20.0
    dispatch: dict[str, Any] = msgspec.field(default_factory=dict)


def is_serving(path: Path) -> bool:
    try:
        return "serving" in tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False


def load_serving(path: Path) -> tuple[ServingScenario, Costs, DispatchConfig]:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    unknown = set(raw) - {"serving"}
    if unknown:
        raise ScenarioError(f"{path}: unknown key $.{sorted(unknown)[0]} (a serving scenario has only [serving])")
    try:
        sc = msgspec.convert(raw["serving"], ServingScenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{path}: {str(exc).replace('$.', '$.serving.')}") from None
    costs = sc.costs if isinstance(sc.costs, Costs) else load_costs((path.parent / sc.costs).resolve())
    if sc.n_expert % sc.ranges_per_layer:
        raise ScenarioError(f"{path}: $.serving.ranges_per_layer ({sc.ranges_per_layer}) must divide n_expert ({sc.n_expert})")
    if sc.top_k > sc.n_expert:
        raise ScenarioError(f"{path}: $.serving.top_k ({sc.top_k}) is above n_expert ({sc.n_expert})")
    if sc.coordinator_holds == "none" and sc.volunteers == 0:
        raise ScenarioError(f"{path}: $.serving.volunteers is 0 and coordinator_holds is none: nobody computes the experts")
    if max(sc.liars) > sc.volunteers:
        raise ScenarioError(f"{path}: $.serving.liars ({max(sc.liars)}) is above volunteers ({sc.volunteers})")
    if max(sc.sessions) > sc.slots:
        raise ScenarioError(f"{path}: $.serving.sessions ({max(sc.sessions)}) is above slots ({sc.slots})")
    fields = {f.name for f in dataclasses.fields(DispatchConfig)}
    bad = sorted(set(sc.dispatch) - fields)
    if bad:
        raise ScenarioError(f"{path}: unknown key $.serving.dispatch.{bad[0]}")
    try:
        cfg = DispatchConfig(**{**COORDINATOR_DISPATCH, **sc.dispatch})
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{path}: $.serving.dispatch: {exc}") from None
    return sc, costs, cfg


def run_serving(sc: ServingScenario, costs: Costs, cfg: DispatchConfig, seed: int) -> dict[str, Any]:
    points = []
    grid = [(liars, speed, rtt, n) for liars in sc.liars for speed in sc.speed for rtt in sc.rtt_ms for n in sc.sessions]
    for liars, speed, rtt, n in grid:
        p = Point(costs=costs, n_layer=sc.n_layer, n_expert=sc.n_expert, top_k=sc.top_k,
                  ranges_per_layer=sc.ranges_per_layer, sessions=n, slots=sc.slots, volunteers=sc.volunteers,
                  speed=speed, rtt_s=rtt / 1000, bandwidth=sc.bandwidth_bytes_per_s, shared_cores=sc.cores == "shared",
                  machine_cores=sc.machine_cores, coordinator_threads=sc.coordinator_threads, warmup_s=sc.warmup_s,
                  measure_s=sc.measure_s, liars=liars, lie_after_calls=sc.lie_after_calls, replicas=sc.replicas, held=sc.coordinator_holds == "all",
                  rtt_sigma=sc.rtt_sigma, dispatch=cfg, seed=seed)
        a = ServingSim(p).run()
        b = ServingSim(local_only(p)).run()
        points.append({"sessions": n, "rtt_ms": rtt, "speed": speed, "liars": liars,
                       "gain": round(a.tokens_per_s / b.tokens_per_s, 4) if b.tokens_per_s else None,
                       "adaptive": a.as_json(), "local_only": b.as_json()})
    return {"kind": "serving", "seed": seed, "costs": msgspec.to_builtins(costs),
            "scenario": {k: v for k, v in msgspec.to_builtins(sc).items() if k != "costs"}, "points": points}


def serving_summary(report: dict[str, Any]) -> list[str]:
    lines = ["liars  speed  rtt_ms  sessions  local tok/s  swarm tok/s  per session  gain  remote rows  groups  wrong tokens"
             "  quarantined (calls to)"]
    for p in report["points"]:
        a, b = p["adaptive"], p["local_only"]
        groups = ",".join(f"{k}x{v}" for k, v in a["groups"].items())
        q = f"{a['liars_quarantined']}/{p['liars']} ({','.join(map(str, a['calls_to_quarantine']))})" if p["liars"] else "-"
        lines.append(f"{p['liars']:>5}  {p['speed']:>5g}  {p['rtt_ms']:>6g}  {p['sessions']:>8}  {b['tokens_per_s']:>11.1f}  "
                     f"{a['tokens_per_s']:>11.1f}  {a['tokens_per_s'] / p['sessions']:>11.2f}  {p['gain']:.3f}  "
                     f"{a['remote_rows']:>11}  {groups:>6}  {a['wrong_tokens']:>12}  {q}")
    return lines


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per volunteer speed: the gain against sessions, a line per round trip (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    pts = report["points"]
    for speed in sorted({p["speed"] for p in pts}):
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        liars = min(p["liars"] for p in pts)  # the honest swarm (or the fewest liars the grid has)
        for rtt in sorted({p["rtt_ms"] for p in pts}):
            xs = [p for p in pts if p["speed"] == speed and p["rtt_ms"] == rtt and p["liars"] == liars]
            ax.plot([p["sessions"] for p in xs], [p["gain"] for p in xs], marker="o", label=f"RTT {rtt:g} ms")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        backbone = report["scenario"].get("coordinator_holds") == "none"
        ax.set_ylabel("tokens/s, backbone / all-local" if backbone else "tokens/s, adaptive / local-only")
        ax.set_title(f"{'backbone' if backbone else 'offload gain'}, volunteers at {speed:g}x a coordinator thread")
        ax.legend()
        fig.tight_layout()
        path = out / f"gain-speed-{speed:g}.png"
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written
