"""The command line: every role's flags become a constrained config; a bad value is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.cli import build_parser, main
from swarm.errors import ConfigError


def config(*argv: str) -> object:
    ns = build_parser().parse_args(list(argv))
    module = __import__(ns.func.__module__, fromlist=["_"])
    if ns.command == "volunteer":
        return module.pull_config_from_args(ns) if ns.market else module.static_config_from_args(ns)
    return module.config_from_args(ns)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["coordinator", "--model", "m.gguf", "--port", "70000"], "--port"),
        (["coordinator", "--model", "m.gguf", "--slots", "0"], "--slots"),
        (["coordinator", "--model", "m.gguf", "--expert-timeout", "0"], "--expert-timeout"),
        (["coordinator", "--model", "m.gguf", "--market", "market:8090"], "--market"),
        (["coordinator", "--model", "m.gguf", "--p2p-listen", "127.0.0.1:4001"], "--p2p-listen"),
        (["coordinator", "--model", "m.gguf", "--threads", "0"], "--threads"),
        (["coordinator", "--model", "m.gguf", "--saturation-threshold", "0"], "--saturation-threshold"),
        (["coordinator", "--model", "m.gguf", "--serve-ttl", "-1"], "--serve-ttl"),
        (["coordinator", "--model", "m.gguf", "--hedge-floor-ms", "-5"], "--hedge-floor-ms"),
        (["coordinator", "--model", "m.gguf", "--hot-experts", "-1"], "--hot-experts"),
        (["coordinator", "--model", "m.gguf", "--origin", "ftp://mirror.test/m.gguf"], "--origin"),
        (["coordinator", "--model", "m.gguf", "--origin", "mirror.test/m.gguf"], "--origin"),
        (["volunteer", "--market", "http://m:8090", "--threads", "0"], "--threads"),
        (["volunteer", "--market", "http://m:8090", "--poll-interval", "-1"], "--poll-interval"),
        (["volunteer", "--market", "ftp://m"], "--market"),
        (["volunteer", "--coordinator", "localhost:8080", "--slice", "0:0-4"], "--coordinator"),
        (["relay", "--port", "-1"], "--port"),
        (["relay", "--reservation-ttl", "0"], "--reservation-ttl"),
        (["relay", "--listen", "0.0.0.0:4001"], "--listen"),
        (["market", "--db", ":memory:", "--port", "65536"], "--port"),
    ],
)
def test_a_bad_flag_value_is_a_config_error_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        config(*argv)


def test_mutually_exclusive_volunteer_modes() -> None:
    with pytest.raises(ConfigError, match="exclude each other"):
        config("volunteer", "--market", "http://m:8090", "--slice", "0:0-4")
    with pytest.raises(ConfigError, match="excludes --listen"):
        config("volunteer", "--market", "http://m:8090", "--no-direct", "--listen", "/ip4/127.0.0.1/tcp/0")
    with pytest.raises(ConfigError, match="static mode"):
        config("volunteer", "--slice", "0:0-4")


def test_main_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["coordinator", "--model", "m.gguf", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moe-swarm: error: --port: Expected `int` <= 65535 [config_error]"]


def test_data_dirs_default_under_the_users_share(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    share = tmp_path / ".local/share/moe-swarm"
    assert config("coordinator", "--model", "m.gguf").data_dir == str(share / "coordinator")  # type: ignore[attr-defined]
    assert config("relay").data_dir == str(share / "relay")  # type: ignore[attr-defined]
    assert config("volunteer", "--market", "http://m:8090").data_dir == str(share / "volunteer")  # type: ignore[attr-defined]
    assert config("market").db == str(share / "market" / "market.db")  # type: ignore[attr-defined]


def test_the_token_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_SWARM_TOKEN", "from-env")
    assert config("coordinator", "--model", "m.gguf").token == "from-env"  # type: ignore[attr-defined]
    assert config("coordinator", "--model", "m.gguf", "--token", "flag").token == "flag"  # type: ignore[attr-defined]


def test_threads_default_to_the_physical_cores(tmp_path: Path) -> None:
    from swarm.config import physical_cores

    # two cores with two hyper-threads each: 4 logical CPUs, 2 physical cores
    blocks = [f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i // 2}\n" for i in range(4)]
    info = tmp_path / "cpuinfo"
    info.write_text("\n".join(blocks) + "\n")
    assert physical_cores(str(info)) == 2
    assert physical_cores(str(tmp_path / "missing")) >= 1
    assert config("coordinator", "--model", "m.gguf").threads is None  # type: ignore[attr-defined]
    assert config("coordinator", "--model", "m.gguf", "--threads", "2").threads == 2  # type: ignore[attr-defined]


def test_coordinator_dispatch_flags_reach_the_dispatch_core() -> None:
    from coordinator.core.dispatch import DispatchConfig, DispatchMode
    from coordinator.server import dispatch_config

    cfg = config("coordinator", "--model", "m.gguf", "--dispatch", "offload", "--saturation-threshold", "3",
                 "--serve-ttl", "5", "--hedge-floor-ms", "20", "--hot-experts", "2", "--expert-timeout", "1.5")
    d = dispatch_config(cfg)  # type: ignore[arg-type]
    assert (d.mode, d.saturation_threshold, d.serve_ttl_s, d.hedge_floor_s, d.hot_experts, d.timeout_s) == (
        DispatchMode.OFFLOAD, 3, 5.0, 0.02, 2, 1.5)
    default = dispatch_config(config("coordinator", "--model", "m.gguf"))  # type: ignore[arg-type]
    # adaptive, 2 busy slots, 20 s, 50 ms, no hot experts, verification 0.05 after 50
    assert default == DispatchConfig(timeout_s=3.0, verify_disk_rate=0.02)
    assert (default.verify_rate, default.verify_probation_calls) == (0.05, 50)
    assert dispatch_config(config("coordinator", "--model", "m.gguf", "--verify-disk-rate", "0.5")).verify_disk_rate == 0.5  # type: ignore[arg-type]
    v = dispatch_config(config("coordinator", "--model", "m.gguf", "--verify-rate", "1", "--verify-probation", "7"))  # type: ignore[arg-type]
    assert (v.verify_rate, v.verify_probation_calls) == (1.0, 7)
    assert default.split_check_s == 3.0
    assert dispatch_config(config("coordinator", "--model", "m.gguf", "--split-check", "0")).split_check_s == 0.0  # type: ignore[arg-type]


def test_trust_and_capacity_flags_reach_the_configs() -> None:
    c = config("coordinator", "--model", "m.gguf", "--local-experts", "0-2:none", "--no-hold-proof")
    assert c.local_experts == "0-2:none" and c.hold_proof is False  # type: ignore[attr-defined]
    d = config("coordinator", "--model", "m.gguf")
    assert d.local_experts == "all" and d.hold_proof is True  # type: ignore[attr-defined]
    m = config("market", "--db", ":memory:", "--insecure-no-token", "--proof-grace-s", "30")
    assert m.policy.proof_grace_s == 30.0  # type: ignore[attr-defined]
