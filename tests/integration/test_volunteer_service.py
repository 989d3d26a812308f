"""``moe-swarm volunteer service install|uninstall|status`` as a user runs it (the real command line in a
subprocess), with the unit directory in a temporary ``XDG_CONFIG_HOME`` and ``systemctl`` faked on the
``PATH`` (a script that records its arguments): the unit written, enabled and started, removed again;
and what it says where ``systemctl --user`` cannot be used."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from volunteer.service import UNIT_NAME, systemd_quote, volunteer_argv

FAKE = """#!/bin/sh
echo "$@" >> "{log}"
case "$*" in
  "--user show-environment") {bus} ;;
  "--user is-enabled {unit}") echo enabled ;;
  "--user is-active {unit}") echo active ;;
esac
exit 0
"""


def fake_env(tmp_path: Path, systemctl: str | None) -> dict[str, str]:
    """The environment with ``systemctl`` faked: "ok", "no-bus" (no user manager), None (absent)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "systemctl"
    fake.unlink(missing_ok=True)
    if systemctl is not None:
        bus = "exit 0" if systemctl == "ok" else 'echo "Failed to connect to bus: No medium found" >&2; exit 1'
        fake.write_text(FAKE.format(log=tmp_path / "systemctl.log", bus=bus, unit=UNIT_NAME))
        fake.chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "USER": "alice"}


def run(tmp_path: Path, *args: str, systemctl: str | None = "ok") -> subprocess.CompletedProcess[str]:
    """``moe-swarm volunteer ARGS`` in a process of its own."""
    env = {**fake_env(tmp_path, systemctl), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "swarm.cli", "volunteer", *args], capture_output=True, text=True,
                          env=env, cwd=Path.cwd(), timeout=120)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """``moe-swarm volunteer ARGS`` in this process (``swarm.cli.main``; no second start of Python and torch)."""
    from swarm.cli import main

    def call(*args: str, systemctl: str | None = "ok") -> subprocess.CompletedProcess[str]:
        for k, v in fake_env(tmp_path, systemctl).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(sys, "argv", ["moe-swarm", "volunteer", *args])
        try:
            rc = main(["volunteer", *args])
        except SystemExit as exc:  # argparse's usage errors
            rc = int(exc.code or 0)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out.out, out.err)

    return call


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "systemctl.log"
    return log.read_text().splitlines() if log.exists() else []


def exec_start(unit: str) -> list[str]:
    [line] = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line[len("ExecStart="):].replace("%%", "%").replace("$$", "$"))


def test_install_status_uninstall_with_systemctl(tmp_path: Path, cli: Any) -> None:
    unit = tmp_path / "config" / "systemd" / "user" / UNIT_NAME
    r = run(tmp_path, "service", "install", "--market", "http://market.example:8090", "--display-name", "alice's 100% desk",
            "--only-when-idle", "5", "--max-memory", "4G", "--data-dir", "rel/vol")
    assert r.returncode == 0, r.stderr
    assert f"wrote {unit}" in r.stdout and f"enabled and started {UNIT_NAME}" in r.stdout
    assert "loginctl enable-linger alice" in r.stdout
    text = unit.read_text()
    for line in ("Restart=on-failure", "RestartSec=10", "WantedBy=default.target", "KillSignal=SIGTERM", "Nice=10"):
        assert line in text.splitlines(), (line, text)
    # the flags kept, the data dir made absolute (the cwd of install), the journal no terminal
    data_dir = str((Path.cwd() / "rel" / "vol").resolve())
    assert exec_start(text) == [sys.executable, "-m", "swarm.cli", "volunteer", "--market", "http://market.example:8090",
                                "--display-name", "alice's 100% desk", "--only-when-idle", "5", "--max-memory", "4G",
                                "--data-dir", data_dir, "--no-progress"]
    assert calls(tmp_path) == ["--user show-environment", "--user daemon-reload", f"--user enable --now {UNIT_NAME}"]

    st = cli("service", "status", "--data-dir", str(tmp_path / "v"))
    assert st.returncode == 0 and f"unit: {unit} (installed)" in st.stdout
    assert "is-enabled: enabled" in st.stdout and "is-active: active" in st.stdout
    assert "no volunteer answers on" in st.stdout

    again = cli("service", "install", "--market", "http://other.example:8090")
    assert again.returncode == 0 and f"replaced {unit}" in again.stdout
    assert "--market http://other.example:8090" in " ".join(exec_start(unit.read_text()))
    default_dir = str(tmp_path / "home" / ".local" / "share" / "moe-swarm" / "volunteer")
    assert exec_start(unit.read_text())[-3:] == ["--data-dir", default_dir, "--no-progress"]

    gone = cli("service", "uninstall")
    assert gone.returncode == 0 and f"removed {unit}" in gone.stdout and not unit.exists()
    assert calls(tmp_path)[-2:] == [f"--user disable --now {UNIT_NAME}", "--user daemon-reload"]
    assert "nothing to remove" in cli("service", "uninstall").stdout


@pytest.mark.parametrize(("systemctl", "why"), [(None, "no systemctl command"),
                                                ("no-bus", "no user manager answers (Failed to connect to bus")])
def test_without_systemctl_user_it_writes_the_unit_and_says_what_to_run(tmp_path: Path, cli: Any,
                                                                       systemctl: str | None, why: str) -> None:
    r = cli("service", "install", "--market", "http://m.example", systemctl=systemctl)
    unit = tmp_path / "config" / "systemd" / "user" / UNIT_NAME
    assert r.returncode == 0 and unit.exists(), r.stderr
    assert f"systemctl --user is not available here ({why}" in r.stdout
    assert "  systemctl --user daemon-reload\n" in r.stdout and f"  systemctl --user enable --now {UNIT_NAME}\n" in r.stdout
    assert shlex.join(exec_start(unit.read_text())) in r.stdout  # or run it by hand
    assert calls(tmp_path) == ([] if systemctl is None else ["--user show-environment"])
    gone = cli("service", "uninstall", systemctl=systemctl)
    assert gone.returncode == 0 and not unit.exists() and f"systemctl --user disable --now {UNIT_NAME}" in gone.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["service", "install"], "give --market URL"),  # a unit that could not start is never written
    (["service", "install", "--market", "http://m", "--schedule", "25:00-07:00"], "--schedule:"),
    (["service"], "install|uninstall|status"),
    (["status", "install"], "'install' goes with 'service'"),
])
def test_bad_service_commands_are_one_line(tmp_path: Path, cli: Any, args: list[str], words: str) -> None:
    r = cli(*args)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "config" / "systemd").exists()


@pytest.mark.parametrize(("arg", "quoted"), [
    ("--market", "--market"), ("http://m:8090/x", "http://m:8090/x"), ("a b", '"a b"'), ("100%", "100%%"),
    ('say "hi"', '"say \\"hi\\""'), ("$HOME", "$$HOME"), ("", '""'),
])
def test_systemd_quoting(arg: str, quoted: str) -> None:
    assert systemd_quote(arg) == quoted


def test_the_volunteer_command_line_keeps_its_flags() -> None:
    d = Path("/data/v")
    assert volunteer_argv(["moe-swarm", "--log-level", "DEBUG", "volunteer", "--market", "http://m", "service", "install",
                           "--data-dir=x", "--threads", "2", "--no-progress"], d) == \
        ["--log-level", "DEBUG", "volunteer", "--market", "http://m", "--threads", "2", "--data-dir", "/data/v",
         "--no-progress"]
