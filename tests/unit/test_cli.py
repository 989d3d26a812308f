"""The command line: every role's flags become a constrained config; a bad value is one clear error."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from swarm.cli import BUILTIN_ROLES, _commands, build_parser, main
from swarm.errors import ConfigError
from swarm.flags import size_flag

ROOT = Path(__file__).resolve().parents[2]


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
    c = config("coordinator", "--model", "m.gguf", "--local-experts", "0-2:none", "--no-hold-proof", "--market", "http://m:8090")
    assert c.local_experts == "0-2:none" and c.hold_proof is False  # type: ignore[attr-defined]
    d = config("coordinator", "--model", "m.gguf")
    assert d.local_experts == "all" and d.hold_proof is True  # type: ignore[attr-defined]
    m = config("market", "--db", ":memory:", "--insecure-no-token", "--proof-grace-s", "30")
    assert m.policy.proof_grace_s == 30.0  # type: ignore[attr-defined]


# -- the parser: found through entry points, light, one-line usage errors --------------------------------

def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["volunteer", "--market", "http://m:8090", "--max-memry", "5G"],
         "moe-swarm volunteer: error: unknown option --max-memry; did you mean --max-memory? "
         "(see 'moe-swarm volunteer --help')"),
        # named although the required --model is missing too
        (["coordinator", "--modle", "m.gguf"],
         "moe-swarm coordinator: error: unknown option --modle; did you mean --model? (see 'moe-swarm coordinator --help')"),
        (["--log-levl", "DEBUG", "market"],
         "moe-swarm: error: unknown option --log-levl; did you mean --log-level? (see 'moe-swarm --help')"),
        (["cordinator", "--model", "m.gguf"],
         "moe-swarm: error: unknown command 'cordinator'; did you mean coordinator? (commands: make-model, market, "
         "coordinator, volunteer, relay, simulate, gateway) (see 'moe-swarm --help')"),
        ([], "moe-swarm: error: choose a command: make-model, market, coordinator, volunteer, relay, simulate, gateway (see 'moe-swarm --help')"),
        (["volunteer", "--market", "http://m:8090", "--max-memory", "5"],
         "moe-swarm volunteer: error: argument --max-memory: '5' has no unit: write 5G, 5M or 5B (bytes) "
         "(see 'moe-swarm volunteer --help')"),
        (["coordinator", "--model", "m.gguf", "--max-body", "100"],
         "moe-swarm coordinator: error: argument --max-body: '100' has no unit: write 100G, 100M or 100B (bytes) "
         "(see 'moe-swarm coordinator --help')"),
        (["coordinator", "--model", "m.gguf", "--prefix-cache-mem", "100"],
         "moe-swarm coordinator: error: argument --prefix-cache-mem: '100' has no unit: write 100G, 100M or 100B "
         "(bytes) (see 'moe-swarm coordinator --help')"),
        (["market", "--log-level", "LOUD"],
         "moe-swarm market: error: argument --log-level: invalid choice: 'LOUD' (choose from 'DEBUG', 'INFO', "
         "'WARNING', 'ERROR', 'CRITICAL') (see 'moe-swarm market --help')"),
    ],
)
def test_a_usage_error_is_one_line_with_the_closest_match(argv: list[str], line: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_prefix_cache_mem_is_a_size_or_zero() -> None:
    assert config("coordinator", "--model", "m.gguf").prefix_cache_mem == 512 << 20  # type: ignore[attr-defined]
    assert config("coordinator", "--model", "m.gguf", "--prefix-cache-mem", "0").prefix_cache_mem == 0  # type: ignore[attr-defined]
    assert config("coordinator", "--model", "m.gguf", "--prefix-cache-mem", "1.5GiB").prefix_cache_mem == 3 << 29  # type: ignore[attr-defined]
    cfg = config("coordinator", "--model", "m.gguf", "--prefix-cache-dir", "/tmp/kv", "--prefix-cache-disk", "2G")
    assert (cfg.prefix_cache_dir, cfg.prefix_cache_disk) == ("/tmp/kv", 2 << 30)  # type: ignore[attr-defined]
    assert config("coordinator", "--model", "m.gguf").prefix_cache_disk == 4 << 30  # type: ignore[attr-defined]


def test_global_options_go_before_or_after_the_command(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOE_SWARM_LOG", "debug")
    assert build_parser().parse_args(["market"]).log_level == "DEBUG"
    monkeypatch.setenv("MOE_SWARM_LOG", "loud")
    with pytest.raises(SystemExit) as ei:
        main(["market"])
    assert ei.value.code == 2 and capsys.readouterr().err == (
        "moe-swarm: error: MOE_SWARM_LOG=loud is not a log level: use one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
        "(see 'moe-swarm --help')\n")
    monkeypatch.delenv("MOE_SWARM_LOG")
    p = build_parser()
    assert p.parse_args(["market"]).log_level == "INFO"
    assert p.parse_args(["--log-level", "debug", "market"]).log_level == "DEBUG"
    assert p.parse_args(["market", "--log-level", "warning"]).log_level == "WARNING"
    assert p.parse_args(["--log-level", "debug", "volunteer", "status", "--log-level", "error"]).log_level == "ERROR"


def test_sizes_need_a_unit() -> None:
    assert [size_flag(s) for s in ("512M", "2G", "1.5GiB", "4096B", "2g", "16 MiB", "1k", "1T")] == [
        512 << 20, 2 << 30, 3 << 29, 4096, 2 << 30, 16 << 20, 1024, 1 << 40]
    for bad, said in (("5", "has no unit"), ("0M", "must be positive"), ("5x", "is not a size"), ("", "is not a size"),
                      ("iB", "is not a size"), ("5iB", "is not a size"), ("-1G", "is not a size")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            size_flag(bad)


def test_a_url_without_a_scheme_says_how_to_write_it() -> None:
    with pytest.raises(ConfigError, match=r"^--market: 'market:8090' has no scheme: write http://market:8090 \(or https://\)$"):
        config("coordinator", "--model", "m.gguf", "--market", "market:8090")
    with pytest.raises(ConfigError, match=r"^--market: '127.0.0.1:8090' has no scheme: write http://127.0.0.1:8090"):
        config("volunteer", "--market", "127.0.0.1:8090")
    with pytest.raises(ConfigError, match=r"^--market: 'ftp://m' is not an http\(s\) URL such as http://127.0.0.1:8090$"):
        config("volunteer", "--market", "ftp://m")
    with pytest.raises(ConfigError, match=r"^--listen: '0.0.0.0:4001' is not a multiaddr such as /ip4/0.0.0.0/tcp/4001$"):
        config("relay", "--listen", "0.0.0.0:4001")


def test_experts_computed_nowhere_are_refused_at_start() -> None:
    with pytest.raises(ConfigError, match=r"^--local-experts none: the experts not computed here need volunteers") as ei:
        config("coordinator", "--model", "m.gguf", "--local-experts", "none")
    assert ei.value.code == "no_volunteers" and "give --market URL" in str(ei.value)
    for ok in (["--market", "http://m:8090"], ["--dispatch-map", "map.json"], ["--on-missing", "disk"]):
        assert config("coordinator", "--model", "m.gguf", "--local-experts", "0-2:none", *ok).local_experts == "0-2:none"  # type: ignore[attr-defined]


def test_help_groups_each_commands_options_and_shows_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    import swarm

    expected = {
        "coordinator": ["model and API:", "market and volunteers:", "dispatch: where experts run:",
                        "verification of volunteers:", "speculative decoding:", "global options:",
                        "(default: 8080)", "(default: 8M)", "(default: adaptive)"],
        "market": ["server:", "replicas and recruitment:", "volunteers:", "trust:", "(default: 8090)"],
        "volunteer": ["pull mode (--market):", "static mode (--coordinator and --slice):", "network:",
                      "(default: 16M)", "(default: 64)"],
        "relay": ["network:", "limits:", "(default: 9090)"],
        "make-model": ["qwen3moe", "mixtral", "qwen2moe", "olmoe", "deepseek2", "gpt-oss", "(default: tiny)"],
    }
    for command, wanted in expected.items():
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert all(w in " ".join(out.split()) for w in wanted), (command, out)
        assert "(default: None)" not in out and "(default: False)" not in out and "(default: )" not in out
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out == f"moe-swarm {swarm.__version__}\n"


def test_the_builtin_table_is_pyprojects_entry_points() -> None:
    """``BUILTIN_ROLES`` stands in for the entry points when the installed metadata predates them: the
    same table; and the version pyproject.toml reads is swarm.__version__."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["moe_swarm.roles"] == BUILTIN_ROLES
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "swarm.__version__"}
    assert list(_commands(build_parser())) == list(BUILTIN_ROLES)


def test_an_installed_entry_point_is_a_command(tmp_path: Path) -> None:
    """A distribution declaring a ``moe_swarm.roles`` entry point adds its command (the installed path):
    a fake one on PYTHONPATH, its command run through ``python -m swarm.cli``."""
    (tmp_path / "hello_role.py").write_text(
        "def add_parser(sub):\n"
        "    p = sub.add_parser('hello', help='say hello')\n"
        "    p.add_argument('--name', default='swarm')\n"
        "    p.set_defaults(func=lambda ns: print(f'hello {ns.name} at {ns.log_level}') or 0)\n"
        "    return p\n")
    info = tmp_path / "hello_role-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-role\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[moe_swarm.roles]\nhello = hello_role:add_parser\n")
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    r = _run("hello", "--name", "you", "--log-level", "debug", env=env)
    assert (r.returncode, r.stdout, r.stderr) == (0, "hello you at DEBUG\n", "")
    r = _run("--help", env=env)
    assert "say hello" in r.stdout and "coordinator" in r.stdout
    r = _run("hello", "--nme", "x", env=env)
    assert (r.returncode, r.stderr) == (2, "moe-swarm hello: error: unknown option --nme; did you mean --name? "
                                           "(see 'moe-swarm hello --help')\n")


HEAVY = ("torch", "libp2p", "ggml", "numpy", "gguf", "trio", "httpx", "hypercorn", "starlette", "tokenizers", "coordinator.server",
         "market.server", "volunteer.daemon", "relay.service")


def test_the_parser_imports_nothing_heavy() -> None:
    """``moe-swarm --help`` and every usage error build the whole parser: none of the heavy modules may be
    imported by then (they cost seconds: torch alone ~1.2 s here). The wall time is printed, not asserted."""
    code = ("import sys, json, time; t = time.perf_counter(); from swarm.cli import build_parser; p = build_parser();"
            f"print(json.dumps([time.perf_counter() - t, sorted(m for m in {list(HEAVY)!r} if m in sys.modules)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    took, heavy = json.loads(r.stdout)
    assert heavy == []
    start = time.perf_counter()
    help_run = _run("--help")
    wall = time.perf_counter() - start
    usage_run = _run("volunteer", "--max-memry", "5G")
    assert help_run.returncode == 0 and usage_run.returncode == 2
    print(f"[build_parser {took * 1000:.0f} ms in-process; `moe-swarm --help` {wall * 1000:.0f} ms wall]")
