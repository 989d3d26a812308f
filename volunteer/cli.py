"""``moe-swarm volunteer`` (shell: flags -> ``PullVolunteerConfig`` or ``StaticVolunteerConfig`` -> serve).

Pull mode (``--market``) takes the scarcest slice the market offers; static mode
(``--coordinator`` + ``--slice``) serves what it is told. The two exclude each other.

Rules:
- Importing this module imports nothing heavy (``--help``); ``run`` imports the daemon.
- The daemon holds its data dir's lock (``swarm.lockfile``) for its life: a second daemon on the same
  ``--data-dir`` would take the first one's identity, bump its epoch and release its slices; it exits
  2 instead, naming the holder's PID. ``volunteer status`` only reads the data dir (no lock).
- Before the daemon starts: its listen ports are free and the market (or the coordinator) answers
  (``swarm.preflight``), each failure one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from swarm.config import build_config, data_dir_for
from swarm.errors import ConfigError
from swarm.flags import size_flag

__all__ = ["add_parser", "pull_config_from_args", "static_config_from_args"]

_FLAGS = {"max_memory": "--max-memory", "max_slices": "--max-slices", "share_rate_bytes_per_s": "--share-rate", "poll_interval_s": "--poll-interval", "relays": "--relay",
          "hole_punch": "--no-hole-punch", "progress": "--no-progress", "slices": "--slice", "lanes": "--no-lanes",
          "cpu_limit_pct": "--cpu-limit", "only_when_idle_s": "--only-when-idle"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    v: argparse.ArgumentParser = subparsers.add_parser(
        "volunteer",
        usage="%(prog)s --market URL [--max-memory SIZE] [--data-dir DIR] [options]\n"
              "       %(prog)s --coordinator URL --slice LAYER:LO-HI [--slice ...] [options]\n"
              "       %(prog)s status [--json] [--data-dir DIR]\n"
              "       %(prog)s pause | resume [--data-dir DIR]\n"
              "       %(prog)s service install | uninstall | status [flags of the volunteer to run]",
        help="serve expert slices: pulled from a market, or given statically",
        description="Lend this computer to a swarm: hold slices of a model's experts and compute them for "
                    "coordinators. Pull mode (--market) takes what the market needs most; static mode "
                    "(--coordinator and --slice) serves what it is told. 'moe-swarm volunteer status' shows "
                    "the running volunteer of --data-dir.")
    v.add_argument("action", nargs="?", choices=["status", "pause", "resume", "service"], default=None,
                   help="status: print the running volunteer's status (of --data-dir) once, and exit; "
                        "pause / resume: ask it to stop serving (it drains its calls and tells the market it is "
                        "paused, kept across restarts) or to serve again; service install|uninstall|status: run it "
                        "as a systemd user service with the other flags given here")
    v.add_argument("what", nargs="?", choices=["install", "uninstall", "status"], default=None, help=argparse.SUPPRESS)
    v.add_argument("--json", action="store_true", help="status: as JSON")
    g = v.add_argument_group("this volunteer")
    g.add_argument("--data-dir", default=None,
                   help="identity key, restart epoch and slice cache, one volunteer each "
                        "(default ~/.local/share/moe-swarm/volunteer)")
    g.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                   help="compute threads of one computation (ggml's, as llama.cpp's -t)")
    g.add_argument("--kernel", choices=["ggml", "torch"], default="ggml",
                   help="expert kernels: ggml's on the stored quantised bytes, or the torch reference")
    g.add_argument("--repack", choices=["off", "on", "all"], default=None,
                   help="ggml's repacked weight layouts, as the coordinators served run them (default on, or "
                        "MOE_SWARM_REPACK): all repacks Q4_K experts too")
    g.add_argument("--no-progress", action="store_true", help="no download progress bar")
    p = v.add_argument_group("pull mode (--market)")
    p.add_argument("--market", action="append", default=None, metavar="URL",
                   help="take the scarcest slice this market offers, e.g. http://127.0.0.1:8090; repeat it for "
                        "replicas of one market (--market URL --market URL2): failed over in turn")
    p.add_argument("--max-memory", type=size_flag, default=None, metavar="SIZE",
                   help="this process's peak memory (RSS), e.g. 5G; the slices get what its baseline leaves "
                        "(default 2G, or only --max-experts when that is given)")
    p.add_argument("--max-experts", type=int, default=None, help="budget in experts")
    p.add_argument("--max-slices", type=int, default=64, help="hold at most this many slices")
    p.add_argument("--display-name", default="", help="a name for the market's dashboard (at most 64 characters)")
    p.add_argument("--models", action="append", default=None, help="only these model ids (repeatable)")
    p.add_argument("--no-share", action="store_true",
                   help="do not serve held slices to other volunteers (they download elsewhere)")
    p.add_argument("--share-rate", type=size_flag, default="16M", metavar="SIZE",
                   help="upload cap for sharing slices, bytes per second")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between market polls")
    p.add_argument("--cpu-limit", type=float, default=None, metavar="PCT",
                   help="use at most PCT %% of this machine's CPU (fewer compute threads, and a rest after each "
                        "computation when that is still more)")
    p.add_argument("--only-when-idle", type=float, default=None, metavar="MIN",
                   help="serve only after MIN minutes without keyboard or mouse input or other programs using the "
                        "CPU (read from /proc); paused otherwise")
    p.add_argument("--schedule", default=None, metavar="HH:MM-HH:MM",
                   help="serve only in this daily window, local time (e.g. 22:00-07:00); paused outside it")
    p.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="the address coordinators should dial instead of the listen addresses "
                        "(a port forward or a proxy in front of this machine; repeatable)")
    t = v.add_argument_group("static mode (--coordinator and --slice)")
    t.add_argument("--coordinator", default=None, metavar="URL", help="coordinator URL (slices are downloaded from it)")
    t.add_argument("--slice", action="append", dest="slices", default=None, metavar="LAYER:LO-HI",
                   help="experts LO..HI-1 of LAYER, e.g. 0:0-4 (repeatable)")
    t.add_argument("--model-id", default=None, help="model to serve when the coordinator hosts several")
    t.add_argument("--allow-peer", action="append", dest="allow_peers", default=None, metavar="PEER_ID",
                   help="also answer expert calls from this libp2p peer (repeatable; the --coordinator's own id, "
                        "from its /health, is always allowed)")
    n = v.add_argument_group("network")
    n.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen multiaddr (repeatable; default /ip4/127.0.0.1/tcp/0)")
    n.add_argument("--relay", action="append", dest="relays", default=None, metavar="MULTIADDR",
                   help="a relay to reserve on when not reachable directly, e.g. "
                        "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW... (repeatable; pull mode default: the market's)")
    n.add_argument("--no-direct", action="store_true", help="do not listen; reachable only through relays")
    n.add_argument("--no-hole-punch", action="store_true",
                   help="do not answer DCUtR: coordinators keep reaching this volunteer through the relay")
    n.add_argument("--no-lanes", action="store_true",
                   help="decline coordinators' data lanes (direct TCP connections this volunteer dials to a "
                        "coordinator it serves): every expert call then comes on the libp2p stream")
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
        "market": ns.market[0], "market_replicas": tuple(ns.market[1:]),
        "data_dir": data_dir_for("volunteer", ns.data_dir), "listen": _listen(ns),
        "announce": tuple(ns.announce or ()),
        "max_memory": max_memory, "max_experts": ns.max_experts, "max_slices": ns.max_slices,
        "share_slices": not ns.no_share, "share_rate_bytes_per_s": float(ns.share_rate), "models": tuple(ns.models or ()),
        "display_name": ns.display_name,
        "threads": ns.threads, "progress": not ns.no_progress, "poll_interval_s": ns.poll_interval,
        "relays": tuple(ns.relays or ()), "hole_punch": not ns.no_hole_punch, "kernel": ns.kernel,
        "lanes": not ns.no_lanes,
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
        "kernel": ns.kernel, "allow_peers": tuple(ns.allow_peers or ()), "lanes": not ns.no_lanes,
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
    cfg = pull_config_from_args(ns) if ns.market else static_config_from_args(ns)
    from swarm import preflight
    from swarm.lockfile import LOCK_NAME, hold

    with hold(Path(cfg.data_dir) / LOCK_NAME, flag="--data-dir", shown=cfg.data_dir, what="volunteer"):
        preflight.check_listen_addrs(cfg.listen, "--listen")
        if ns.market:
            preflight.check_any_market([cfg.market, *cfg.market_replicas])
        else:
            preflight.check_reachable(cfg.coordinator, "--coordinator", "coordinator")
        _serve(ns, cfg)
    return 0


def _serve(ns: argparse.Namespace, cfg: Any) -> None:
    import torch

    from swarm.model.kernels import KernelBackend, configure_threads
    from swarm.service import run_service

    # --threads are the ggml threads of one computation (as llama.cpp's -t): the volunteer computes one
    # call at a time with all of them (the expert server's one lane); torch keeps one intra-op thread
    configure_threads(ns.threads, KernelBackend.GGML)
    torch.set_num_threads(1)
    if ns.repack is not None:  # before any slice is bound (part of the kernel id the coordinators check)
        from swarm.model.kernels.repack import set_repack

        set_repack(ns.repack)
    if ns.market:
        from volunteer.daemon import serve_pull_volunteer

        run_service(serve_pull_volunteer, cfg)
    else:
        from volunteer.static import serve_static_volunteer

        run_service(serve_static_volunteer, cfg)
