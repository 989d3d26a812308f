"""``moe-swarm volunteer service install|uninstall|status``: the volunteer as a systemd user service (shell).

People lending their own computer want it to start with their session and come back after a crash,
as BOINC's client does. This writes and enables a systemd *user* unit (no root).

Rules:
- The unit is ``$XDG_CONFIG_HOME/systemd/user/moe-swarm-volunteer.service`` (``~/.config/...``). Its
  ``ExecStart`` runs this Python with ``-m swarm.cli volunteer`` and the flags given to ``service
  install`` (global ones before ``volunteer`` too), checked first as the daemon would check them
  (``--market`` or ``--coordinator`` required), with ``--data-dir`` made absolute (the default one
  when none was given: the service keeps the identity, epoch and slices of the volunteer run by hand)
  and ``--no-progress`` (the journal is no terminal). Arguments are quoted for systemd (``%`` and
  ``$`` doubled).
- ``Restart=on-failure`` after 10 s; ``SIGTERM`` drains the calls in flight and deregisters (45 s at
  most); ``Nice=10``: the owner's programs come first.
- With ``systemctl --user`` (the command exists and a user manager answers) install reloads and
  enables the unit at once (``enable --now``), uninstall disables it (``disable --now``) and removes the
  file, status asks ``is-enabled`` and ``is-active``. Without it the file is still written or removed
  and the commands to run are printed -- what to run where systemd is, and the volunteer's command line
  to run it by hand.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from swarm.config import data_dir_for
from swarm.errors import ConfigError

__all__ = ["UNIT_NAME", "service_command", "systemd_quote", "unit_path", "unit_text", "volunteer_argv"]

UNIT_NAME = "moe-swarm-volunteer.service"


def unit_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user" / UNIT_NAME


def systemd_quote(arg: str) -> str:
    """One ``ExecStart`` argument as systemd reads it back."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and all(c.isalnum() or c in "-_./:=,@+%$" for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def volunteer_argv(argv: list[str], data_dir: Path) -> list[str]:
    """The volunteer's own command line from ``moe-swarm [GLOBAL] volunteer [FLAGS] service install [FLAGS]``:
    the global flags, ``volunteer``, its flags without ``service install`` and ``--data-dir``, then the
    absolute data dir and ``--no-progress``."""
    args = argv[1:]
    if "volunteer" not in args:
        raise ConfigError("cannot find 'volunteer' in the command line", code="bad_command_line")
    v = args.index("volunteer")
    head, rest = args[:v], args[v + 1:]
    out: list[str] = []
    skip_value = dropped = False
    for i, a in enumerate(rest):
        if skip_value:
            skip_value = False
            continue
        if not dropped and a == "service" and i + 1 < len(rest) and rest[i + 1] == "install":
            dropped = True
            skip_value = True  # and "install"
            continue
        if a == "--data-dir":
            skip_value = True
            continue
        if a.startswith("--data-dir=") or a == "--no-progress":
            continue
        out.append(a)
    return [*head, "volunteer", *out, "--data-dir", str(data_dir), "--no-progress"]


def unit_text(exec_argv: list[str]) -> str:
    return f"""# written by `moe-swarm volunteer service install`; remove it with `moe-swarm volunteer service uninstall`
[Unit]
Description=moe-swarm volunteer: lends this computer to a swarm of MoE language models

[Service]
Type=simple
ExecStart={' '.join(systemd_quote(a) for a in exec_argv)}
Environment=PYTHONUNBUFFERED=1
Restart=on-failure
RestartSec=10
KillSignal=SIGTERM
TimeoutStopSec=45
Nice=10

[Install]
WantedBy=default.target
"""


def _systemctl() -> tuple[bool, str]:
    """Whether ``systemctl --user`` can be used here, and why not."""
    exe = shutil.which("systemctl")
    if exe is None:
        return False, "no systemctl command"
    try:
        r = subprocess.run([exe, "--user", "show-environment"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"systemctl --user failed: {exc}"
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        return False, f"no user manager answers ({why[0] if why else f'exit {r.returncode}'})"
    return True, ""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True, timeout=60)


def _check(r: subprocess.CompletedProcess[str], what: str) -> None:
    if r.returncode != 0:
        detail = (r.stderr or r.stdout).strip().replace("\n", " ")[:300]
        raise ConfigError(f"systemctl --user {what} failed (exit {r.returncode}): {detail}", code="systemctl_failed")


def install(ns: argparse.Namespace, argv: list[str], check: Callable[[], object]) -> int:
    check()  # the same checks as a volunteer started with these flags: a unit that cannot start is never written
    data_dir = Path(data_dir_for("volunteer", ns.data_dir)).expanduser().resolve()
    exec_argv = [sys.executable, "-m", "swarm.cli", *volunteer_argv(argv, data_dir)]
    path = unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.exists()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(unit_text(exec_argv))
    tmp.replace(path)
    print(f"{'replaced' if existed else 'wrote'} {path}")
    print(f"  runs: {shlex.join(exec_argv)}")
    ok, why = _systemctl()
    if not ok:
        print(f"systemctl --user is not available here ({why}): the unit is written but not started. Where a "
              f"systemd user session runs, start it with:\n"
              f"  systemctl --user daemon-reload\n"
              f"  systemctl --user enable --now {UNIT_NAME}\n"
              f"or run the volunteer yourself:\n"
              f"  {shlex.join(exec_argv)}")
        return 0
    _check(_run("daemon-reload"), "daemon-reload")
    _check(_run("enable", "--now", UNIT_NAME), f"enable --now {UNIT_NAME}")
    print(f"enabled and started {UNIT_NAME}: it starts with your session and restarts after a failure.\n"
          f"  its log: journalctl --user -u {UNIT_NAME} -f\n"
          f"  to keep it running while you are logged out: loginctl enable-linger {os.environ.get('USER', '$USER')}")
    return 0


def uninstall() -> int:
    path = unit_path()
    ok, why = _systemctl()
    if ok:
        r = _run("disable", "--now", UNIT_NAME)
        if r.returncode != 0 and path.exists():
            _check(r, f"disable --now {UNIT_NAME}")
    if not path.exists():
        print(f"no unit at {path}: nothing to remove")
        return 0
    path.unlink()
    print(f"removed {path}")
    if ok:
        _check(_run("daemon-reload"), "daemon-reload")
        print(f"stopped and disabled {UNIT_NAME}")
    else:
        print(f"systemctl --user is not available here ({why}); where the service runs, stop it with:\n"
              f"  systemctl --user disable --now {UNIT_NAME}\n"
              f"  systemctl --user daemon-reload")
    return 0


def status(ns: argparse.Namespace) -> int:
    from volunteer.status import plain_line, read_status

    path = unit_path()
    print(f"unit: {path} ({'installed' if path.exists() else 'not installed'})")
    ok, why = _systemctl()
    if ok:
        for what in ("is-enabled", "is-active"):
            r = _run(what, UNIT_NAME)
            print(f"{what}: {(r.stdout.strip() or r.stderr.strip() or f'exit {r.returncode}').splitlines()[0]}")
    else:
        print(f"systemctl --user is not available here ({why})")
    data_dir = Path(data_dir_for("volunteer", ns.data_dir))
    try:
        print(plain_line(read_status(data_dir)))
    except OSError:
        print(f"no volunteer answers on {data_dir / 'status.sock'}")
    return 0


def service_command(ns: argparse.Namespace, argv: list[str], check: Callable[[], object]) -> int:
    """``check()`` raises ``ConfigError`` unless the flags make a volunteer (``volunteer.cli``'s configs)."""
    if ns.what == "install":
        return install(ns, argv, check)
    if ns.what == "uninstall":
        return uninstall()
    if ns.what == "status":
        return status(ns)
    raise ConfigError("say what to do: moe-swarm volunteer service install|uninstall|status", code="usage")
