"""A simulation scenario: TOML in, frozen msgspec Structs out (config is data, checked at the edge).

Rules:
- Every table and key is declared here; an unknown key, a value of the wrong type or outside its bounds
  (a negative rate, a count below zero) is refused with one line naming the key (``$.volunteers[0].count``),
  and so is an impossible shape (a load above the coordinator's slots, NAT shares not summing to 1, a load
  curve out of order, a model the market itself would refuse): ``ScenarioError``, exit code 2 on the CLI.
- ``[market.policy]`` holds overrides of ``market.policy.MarketPolicy``'s fields, checked by that Struct's
  own constraints; what is not given is the market's default (DESIGN §11). The loop timings the market's
  shell owns (``poll_interval_s``, ``tick_s``, ``poll_timeout_s``) and the volunteer's ``poll_interval_s``
  and ``max_slices`` default to the real processes' defaults (a test keeps them equal).
- Distributions are tables with a ``dist`` tag: ``const`` (value), ``uniform`` (lo, hi), ``exponential``
  (mean), ``weibull`` (shape, scale: churn's session lengths), ``lognormal`` (median, sigma).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec

from swarm.errors import ConfigError

__all__ = [
    "Const",
    "CoordinatorSpec",
    "Dist",
    "Exponential",
    "LogNormal",
    "MarketSpec",
    "ModelSpec",
    "NatSpec",
    "Population",
    "Scenario",
    "Rounds",
    "ScenarioError",
    "Uniform",
    "dist_mean",
    "Weibull",
    "load_scenario",
    "parse_scenario",
]

NonNeg = Annotated[float, msgspec.Meta(ge=0.0)]
Pos = Annotated[float, msgspec.Meta(gt=0.0)]
Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class ScenarioError(ConfigError):
    code = "bad_scenario"


class Const(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="const", tag_field="dist"):
    value: NonNeg


class Uniform(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="uniform", tag_field="dist"):
    lo: NonNeg
    hi: NonNeg


class Exponential(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="exponential", tag_field="dist"):
    mean: Pos


class Weibull(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="weibull", tag_field="dist"):
    shape: Pos  # k < 1: many short sessions and a long tail (what volunteer churn looks like)
    scale: Pos  # lambda, seconds (or the unit of the key)


class LogNormal(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="lognormal", tag_field="dist"):
    median: Pos
    sigma: NonNeg


Dist = Const | Uniform | Exponential | Weibull | LogNormal


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The hosted model's expert shape (the market's manifest)."""

    id: str = "sim-000000000000"
    n_layer: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 48
    n_expert: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 128
    bytes_per_expert: Annotated[int, msgspec.Meta(ge=1)] = 5_013_504  # 30b-a3b at Q8_0: 3 x 768 x 2048 x 34/32


class MarketSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    poll_interval_s: Pos = 2.0  # market.server.MarketConfig / market.cli --poll-interval
    poll_timeout_s: Pos = 1.0
    tick_s: Pos = 0.25
    policy: dict[str, Any] = {}  # MarketPolicy overrides (checked by MarketPolicy)


class Rounds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A closed-loop load (``benchmarks/_recruitment.py``'s rounds): ``busy`` from ``start_s``; each round's load
    ends ``tail_s`` after a recruited worker serves; the next starts once the surplus is released (back to base)."""

    count: Annotated[int, msgspec.Meta(ge=1, le=100_000)]
    busy: Annotated[int, msgspec.Meta(ge=0)]
    start_s: NonNeg = 0.0
    tail_s: NonNeg = 0.0  # the load's requests in flight finishing


class CoordinatorSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One coordinator: its slots and its ``/slots`` busy count over time (the market's saturation input)."""

    url: str = "http://coordinator.sim"
    slots: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 4
    # (time s, busy) steps, time-ordered: busy holds from its time to the next step's
    load: list[tuple[NonNeg, Annotated[int, msgspec.Meta(ge=0)]]] = []
    rounds: Rounds | None = None  # instead of ``load``
    # declared costs of the coordinator's side (coordinator.dispatch.market_link, the hold challenge)
    map_latency_s: NonNeg = 0.1  # a changed dispatch map reaches it this long after the market's tick
    report_s: Pos = 5.0  # POST /api/coordinator-report period
    challenge_s: NonNeg = 0.2  # a hold challenge's round trip, once connected
    retry_s: Pos = 5.0  # a failed dial is retried after this long


class NatSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shares of a population by NAT class (sum 1) and the chance that the coordinator's dial succeeds."""

    direct: Share = 1.0
    hole_punchable: Share = 0.0
    relay_only: Share = 0.0
    direct_success: Share = 1.0
    hole_punch_success: Share = 0.7
    relay_success: Share = 0.95


class Population(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "volunteers"
    count: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]
    arrive_over_s: NonNeg = 60.0  # first sessions start uniformly over this window
    memory_bytes: Dist = Const(value=float(1 << 30))  # the slice budget (max_bytes)
    download_bytes_per_s: Dist = Const(value=float(50 << 20))  # its link, for slice downloads
    fetch_overhead_s: NonNeg = 0.5  # per slice: verify + load
    session_s: Dist = Const(value=1e12)  # online session length (churn)
    offline_s: Dist = Const(value=1e12)  # gap before the next session
    graceful: Share = 0.5  # share of session ends that drain and deregister (the rest vanish)
    drain_s: NonNeg = 1.0  # a graceful stop's wait for calls in flight
    poll_interval_s: Pos = 2.0  # volunteer.daemon.PullVolunteerConfig
    max_slices: Annotated[int, msgspec.Meta(ge=1, le=256)] = 64
    nat: NatSpec = NatSpec()


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    duration_s: Pos
    sample_s: Pos = 1.0  # coverage is sampled this often
    model: ModelSpec = ModelSpec()
    market: MarketSpec = MarketSpec()
    coordinator: CoordinatorSpec = CoordinatorSpec()
    volunteers: list[Population] = []


def _shape_problems(sc: Scenario) -> list[str]:
    """Impossible shapes, each naming its key."""
    out: list[str] = []
    for i, (t, busy) in enumerate(sc.coordinator.load):
        if busy > sc.coordinator.slots:
            out.append(f"$.coordinator.load[{i}]: busy {busy} exceeds the coordinator's {sc.coordinator.slots} slots")
        if i and t <= sc.coordinator.load[i - 1][0]:
            out.append(f"$.coordinator.load[{i}]: time {t:g} is not after the previous step's")
        if t > sc.duration_s:
            out.append(f"$.coordinator.load[{i}]: time {t:g} is past duration_s {sc.duration_s:g}")
    r = sc.coordinator.rounds
    if r is not None and sc.coordinator.load:
        out.append("$.coordinator.rounds: give load or rounds, not both")
    if r is not None and r.busy > sc.coordinator.slots:
        out.append(f"$.coordinator.rounds.busy: {r.busy} exceeds the coordinator's {sc.coordinator.slots} slots")
    for i, p in enumerate(sc.volunteers):
        share = p.nat.direct + p.nat.hole_punchable + p.nat.relay_only
        if not math.isclose(share, 1.0, abs_tol=1e-9):
            out.append(f"$.volunteers[{i}].nat: direct + hole_punchable + relay_only = {share:g}, not 1")
        for key in ("memory_bytes", "download_bytes_per_s", "session_s", "offline_s"):
            d = getattr(p, key)
            if isinstance(d, Uniform) and d.hi < d.lo:
                out.append(f"$.volunteers[{i}].{key}: hi {d.hi:g} is below lo {d.lo:g}")
        d = p.download_bytes_per_s
        if isinstance(d, Const | Uniform) and (d.value if isinstance(d, Const) else d.hi) <= 0:
            out.append(f"$.volunteers[{i}].download_bytes_per_s: must be above 0")
    if sc.sample_s > sc.duration_s:
        out.append(f"$.sample_s: {sc.sample_s:g} is longer than duration_s {sc.duration_s:g}")
    return out


def parse_scenario(raw: dict[str, Any], where: str = "scenario") -> Scenario:
    """A ``Scenario`` from a decoded TOML table; ``ScenarioError`` (one line naming the key) when it is bad."""
    try:
        sc = msgspec.convert(raw, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{where}: {exc}") from exc
    from market.policy import MarketPolicy  # the market's own constraints check its overrides

    try:
        msgspec.convert(sc.market.policy, MarketPolicy)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        msg = msg.replace("`$", "`$.market.policy", 1) if " - at `$" in msg else f"{msg} - at `$.market.policy`"
        raise ScenarioError(f"{where}: {msg}") from exc
    from swarm.protocol.manifest import ModelManifest

    m = ModelManifest(model_id=sc.model.id, arch="sim", n_layer=sc.model.n_layer, n_expert=sc.model.n_expert,
                      bytes_per_expert=[sc.model.bytes_per_expert] * sc.model.n_layer)
    problems = [f"$.model: {p}" for p in m.problems()] + _shape_problems(sc)
    if problems:
        raise ScenarioError(f"{where}: {problems[0]}")
    return sc


def load_scenario(path: Path) -> Scenario:
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: not TOML: {exc}") from exc
    return parse_scenario(raw, str(path))


def dist_mean(d: Dist) -> float:
    """The mean of a distribution (for the report's declared inputs)."""
    match d:
        case Const():
            return d.value
        case Uniform():
            return (d.lo + d.hi) / 2
        case Exponential():
            return d.mean
        case Weibull():
            return d.scale * math.gamma(1 + 1 / d.shape)
        case LogNormal():
            return d.median * math.exp(d.sigma ** 2 / 2)
    raise AssertionError(d)

