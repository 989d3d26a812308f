"""``moe-swarm volunteer`` (shell: flags -> ``PullVolunteerConfig`` or ``StaticVolunteerConfig`` -> serve).

Pull mode (``--market``) takes the scarcest slice the market offers; static mode
(``--coordinator`` + ``--slice``) serves what it is told. The two exclude each other.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from swarm.config import build_config, data_dir_for
from swarm.errors import ConfigError
from swarm.service import run_service, size_flag

__all__ = ["add_parser", "pull_config_from_args", "static_config_from_args"]

_FLAGS = {"max_memory": "--max-memory", "max_slices": "--max-slices", "share_rate_bytes_per_s": "--share-rate", "poll_interval_s": "--poll-interval", "relays": "--relay",
          "hole_punch": "--no-hole-punch", "progress": "--no-progress", "slices": "--slice",
          "cpu_limit_pct": "--cpu-limit", "only_when_idle_s": "--only-when-idle"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    v: argparse.ArgumentParser = subparsers.add_parser(
        "volunteer", help="serve expert slices: pulled from a market, or given statically")
    v.add_argument("action", nargs="?", choices=["status", "pause", "resume", "service"], default=None,
                   help="status: print the running volunteer's status (of --data-dir) once, and exit; "
                        "pause / resume: ask it to stop serving (it drains its calls and tells the market it is "
                        "paused, kept across restarts) or to serve again; service install|uninstall|status: run it "
                        "as a systemd user service with the other flags given here")
    v.add_argument("what", nargs="?", choices=["install", "uninstall", "status"], default=None, help=argparse.SUPPRESS)
    v.add_argument("--json", action="store_true", help="status: as JSON")
    v.add_argument("--market", default=None, help="pull mode: take the scarcest slice the market offers")
    v.add_argument("--max-memory", type=size_flag, default=None,
                   help="pull mode: this process's peak memory (RSS), e.g. 5G; the slices get what its baseline "
                        "leaves (default 2G, or only --max-experts when that is given)")
    v.add_argument("--max-slices", type=int, default=64, help="pull mode: hold at most this many slices (default 64)")
    v.add_argument("--no-share", action="store_true",
                   help="pull mode: do not serve held slices to other volunteers (they download elsewhere)")
    v.add_argument("--share-rate", type=size_flag, default=16 << 20,
                   help="pull mode: upload cap for sharing slices, bytes per second (default 16M)")
    v.add_argument("--max-experts", type=int, default=None, help="pull mode: budget in experts")
    v.add_argument("--display-name", default="", help="pull mode: a name for the market's dashboard (at most 64 characters)")
    v.add_argument("--models", action="append", default=None, help="pull mode: only these model ids (repeatable)")
    v.add_argument("--poll-interval", type=float, default=2.0, help="pull mode: seconds between market polls")
    v.add_argument("--cpu-limit", type=float, default=None, metavar="PCT",
                   help="pull mode: use at most PCT %% of this machine's CPU (fewer compute threads, and a rest after "
                        "each computation when that is still more)")
    v.add_argument("--only-when-idle", type=float, default=None, metavar="MIN",
                   help="pull mode: serve only after MIN minutes without keyboard or mouse input or other programs "
                        "using the CPU (read from /proc); paused otherwise")
    v.add_argument("--schedule", default=None, metavar="HH:MM-HH:MM",
                   help="pull mode: serve only in this daily window, local time (e.g. 22:00-07:00); paused outside it")
    v.add_argument("--coordinator", default=None, help="static mode: coordinator URL (slices are downloaded from it)")
    v.add_argument("--slice", action="append", dest="slices", default=None, metavar="LAYER:LO-HI",
                   help="static mode: experts LO..HI-1 of LAYER, e.g. 0:0-4 (repeatable)")
    v.add_argument("--listen", action="append", default=None, help="libp2p listen multiaddr (repeatable)")
    v.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="pull mode: the address coordinators should dial instead of the listen addresses "
                        "(a port forward or a proxy in front of this machine; repeatable)")
    v.add_argument("--data-dir", default=None,
                   help="identity key, restart epoch and slice cache (default ~/.local/share/moe-swarm/volunteer)")
    v.add_argument("--model-id", default=None, help="model to serve when the coordinator hosts several")
    v.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="compute threads of one computation (ggml's, as llama.cpp's -t)")
    v.add_argument("--no-progress", action="store_true", help="no download progress bar")
    v.add_argument("--kernel", choices=["ggml", "torch"], default="ggml",
                   help="expert kernels: ggml's on the stored quantised bytes, or the torch reference")
    v.add_argument("--relay", action="append", dest="relays", default=None, metavar="MULTIADDR",
                   help="a relay to reserve on when not reachable directly, e.g. "
                        "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW... (repeatable; pull mode default: the market's)")
    v.add_argument("--no-direct", action="store_true",
                   help="do not listen; reachable only through relays")
    v.add_argument("--no-hole-punch", action="store_true",
                   help="do not answer DCUtR: coordinators keep reaching this volunteer through the relay")
    v.add_argument("--allow-peer", action="append", dest="allow_peers", default=None, metavar="PEER_ID",
                   help="static mode: also answer expert calls from this libp2p peer (repeatable; the "
                        "--coordinator's own id, from its /health, is always allowed)")
    v.set_defaults(func=run)
    return v


def _listen(ns: argparse.Namespace) -> tuple[str, ...]:
    if ns.no_direct and ns.listen:
        raise ConfigError("--no-direct (reachable only through relays) excludes --listen")
    return () if ns.no_direct else tuple(ns.listen or ["/ip4/127.0.0.1/tcp/0"])


def pull_config_from_args(ns: argparse.Namespace) -> Any:
    from volunteer.daemon import PullVolunteerConfig

    if ns.slices or ns.coordinator:
        raise ConfigError("--market (pull mode) and --coordinator/--slice (static mode) exclude each other")
    if ns.allow_peers:
        raise ConfigError("--allow-peer is for static mode: in pull mode the market names the coordinators")
    max_memory = ns.max_memory
    if max_memory is None and ns.max_experts is None:
        max_memory = 2 << 30
    return build_config(PullVolunteerConfig, {
        "market": ns.market, "data_dir": data_dir_for("volunteer", ns.data_dir), "listen": _listen(ns),
        "announce": tuple(ns.announce or ()),
        "max_memory": max_memory, "max_experts": ns.max_experts, "max_slices": ns.max_slices,
        "share_slices": not ns.no_share, "share_rate_bytes_per_s": float(ns.share_rate), "models": tuple(ns.models or ()),
        "display_name": ns.display_name,
        "threads": ns.threads, "progress": not ns.no_progress, "poll_interval_s": ns.poll_interval,
        "relays": tuple(ns.relays or ()), "hole_punch": not ns.no_hole_punch, "kernel": ns.kernel,
        "cpu_limit_pct": ns.cpu_limit, "only_when_idle_s": ns.only_when_idle * 60 if ns.only_when_idle is not None else None,
        "schedule": _schedule(ns.schedule),
    }, flags=_FLAGS)


def _schedule(text: str | None) -> str | None:
    from volunteer.core.preferences import parse_schedule

    if text is None:
        return None
    try:
        return str(parse_schedule(text))
    except ValueError as exc:
        raise ConfigError(f"--schedule: {exc}", code="bad_schedule") from None


def _desktop_flags(ns: argparse.Namespace) -> None:
    if ns.cpu_limit is not None or ns.only_when_idle is not None or ns.schedule is not None:
        raise ConfigError("--cpu-limit, --only-when-idle and --schedule are for pull mode (--market)")


def static_config_from_args(ns: argparse.Namespace) -> Any:
    from volunteer.static import StaticVolunteerConfig, check_config

    if not ns.coordinator or not ns.slices:
        raise ConfigError("give --market URL (pull mode) or --coordinator URL with --slice LAYER:LO-HI (static mode)")
    _desktop_flags(ns)
    cfg = build_config(StaticVolunteerConfig, {
        "coordinator": ns.coordinator, "slices": tuple(ns.slices), "listen": _listen(ns),
        "data_dir": data_dir_for("volunteer", ns.data_dir), "model_id": ns.model_id, "threads": ns.threads,
        "progress": not ns.no_progress, "relays": tuple(ns.relays or ()), "hole_punch": not ns.no_hole_punch,
        "kernel": ns.kernel, "allow_peers": tuple(ns.allow_peers or ()),
    }, flags=_FLAGS)
    check_config(cfg)
    return cfg


def print_status(ns: argparse.Namespace) -> int:
    """``moe-swarm volunteer status``: what the volunteer running in ``--data-dir`` says of itself."""
    import msgspec

    from volunteer.status import read_status, render_table

    data_dir = Path(data_dir_for("volunteer", ns.data_dir))
    try:
        st = read_status(data_dir)
    except OSError as exc:
        raise ConfigError(f"no volunteer answers on {data_dir / 'status.sock'} ({exc}); is one running with "
                          f"--data-dir {data_dir}?", code="not_running") from exc
    if ns.json:
        print(msgspec.json.encode(st).decode())
        return 0
    from rich.console import Console

    Console().print(render_table(st))
    return 0


def control(ns: argparse.Namespace) -> int:
    """``moe-swarm volunteer pause|resume``: over the running volunteer's status socket."""
    from volunteer.status import StatusError, plain_line, read_status

    data_dir = Path(data_dir_for("volunteer", ns.data_dir))
    try:
        st = read_status(data_dir, command=ns.action)
    except StatusError as exc:
        raise ConfigError(f"the volunteer refused {ns.action!r}: {exc}", code="refused") from exc
    except OSError as exc:
        raise ConfigError(f"no volunteer answers on {data_dir / 'status.sock'} ({exc}); is one running with "
                          f"--data-dir {data_dir}?", code="not_running") from exc
    what = f"paused ({st.paused}): {st.pause_detail}" if st.paused else "serving (not paused)"
    print(f"{ns.action}: the volunteer is {what}")
    print(plain_line(st))
    return 0


def run(ns: argparse.Namespace) -> int:
    if ns.what is not None and ns.action != "service":
        raise ConfigError(f"{ns.what!r} goes with 'service': moe-swarm volunteer service {ns.what}")
    if ns.action == "status":
        return print_status(ns)
    if ns.action in ("pause", "resume"):
        return control(ns)
    if ns.action == "service":
        from volunteer.service import service_command

        return service_command(ns, sys.argv, lambda: pull_config_from_args(ns) if ns.market else static_config_from_args(ns))
    import torch

    from swarm.model.kernels import KernelBackend, configure_threads
    from volunteer.core.preferences import cpu_plan

    # --threads are the ggml threads of one computation (as llama.cpp's -t): the volunteer computes one
    # call at a time with all of them (the expert server's one lane); torch keeps one intra-op thread;
    # --cpu-limit may lower them (volunteer.core.preferences.cpu_plan)
    try:
        ns.threads = cpu_plan(ns.cpu_limit, os.cpu_count() or 1, ns.threads).threads
    except ValueError as exc:
        raise ConfigError(str(exc), code="bad_cpu_limit") from None
    configure_threads(ns.threads, KernelBackend.GGML)
    torch.set_num_threads(1)
    if ns.market:
        from volunteer.daemon import serve_pull_volunteer

        run_service(serve_pull_volunteer, pull_config_from_args(ns))
    else:
        from volunteer.static import serve_static_volunteer

        run_service(serve_static_volunteer, static_config_from_args(ns))
    return 0
