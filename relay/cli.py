"""``moe-swarm relay`` (shell: flags -> ``RelayConfig`` -> ``serve_relay``).

Rules: importing this module imports nothing heavy (``--help``); ``run`` holds the data dir's lock
(one relay per identity: ``swarm.lockfile``) and checks its ports first, each failure one line.
"""

from __future__ import annotations

import argparse
from typing import Any

from swarm.config import data_dir_for

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    r: argparse.ArgumentParser = subparsers.add_parser(
        "relay", usage="%(prog)s [--listen MULTIADDR] [--announce MULTIADDR] [--data-dir DIR] [options]",
        help="run a circuit relay v2 for volunteers behind NATs",
        description="Run a libp2p circuit relay v2 (and AutoNAT) sized for expert traffic: volunteers that cannot "
                    "be dialled reserve a slot here and coordinators reach them through it.")
    n = r.add_argument_group("network")
    n.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen multiaddr, TCP or WebSocket (repeatable; default /ip4/0.0.0.0/tcp/4001), "
                        "e.g. --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/tcp/443/ws")
    n.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="public address handed to volunteers with their reservation (repeatable; default: the listen ones)")
    n.add_argument("--host", default="127.0.0.1", help="/metrics and /health bind address")
    n.add_argument("--port", type=int, default=9090, help="/metrics and /health port (0: any free port)")
    n.add_argument("--data-dir", default=None,
                   help="identity key, so the relay's peer id stays the same across restarts; one relay each "
                        "(default ~/.local/share/moe-swarm/relay)")
    lim = r.add_argument_group("limits")
    lim.add_argument("--max-reservations", type=int, default=128, help="volunteers that can reserve a slot")
    lim.add_argument("--max-reservations-per-address", type=int, default=16,
                     help="... of which from one IP address (an IPv6 /64)")
    lim.add_argument("--max-reservations-per-prefix", type=int, default=64,
                     help="... and from one network (an IPv4 /24, an IPv6 /48)")
    lim.add_argument("--max-circuits", type=int, default=1024, help="open circuits in total")
    lim.add_argument("--max-circuits-per-peer", type=int, default=16, help="open circuits per volunteer and per dialer")
    lim.add_argument("--reservation-ttl", type=int, default=3600, help="seconds a reservation lasts without a refresh")
    lim.add_argument("--circuit-max-bytes", type=int, default=0, help="bytes per direction per circuit (0 = unlimited)")
    lim.add_argument("--circuit-max-duration", type=int, default=0, help="seconds per circuit (0 = unlimited)")
    lim.add_argument("--stream-window", type=int, default=256 * 1024,
                     help="receive window per stream, in bytes: what the relay holds of a stalled circuit direction")
    r.set_defaults(func=run)
    return r


def config_from_args(ns: argparse.Namespace) -> Any:
    from relay.service import RelayConfig
    from swarm.config import build_config

    cfg = build_config(RelayConfig, {
        "listen": tuple(ns.listen or ["/ip4/0.0.0.0/tcp/4001"]),
        "announce": tuple(ns.announce or ()),
        "host": ns.host,
        "port": ns.port,
        "data_dir": data_dir_for("relay", ns.data_dir),
        "max_reservations": ns.max_reservations,
        "max_reservations_per_address": ns.max_reservations_per_address,
        "max_reservations_per_prefix": ns.max_reservations_per_prefix,
        "max_circuits": ns.max_circuits,
        "max_circuits_per_peer": ns.max_circuits_per_peer,
        "reservation_ttl_s": ns.reservation_ttl,
        "circuit_max_bytes": ns.circuit_max_bytes,
        "stream_window_bytes": ns.stream_window,
        "circuit_max_duration_s": ns.circuit_max_duration,
    }, flags={"reservation_ttl_s": "--reservation-ttl", "circuit_max_duration_s": "--circuit-max-duration"})
    cfg.limits()  # the ledger's own cross-field checks, before anything starts
    return cfg


def run(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from relay.service import serve_relay
    from swarm.lockfile import LOCK_NAME, hold
    from swarm.preflight import check_listen_addrs, check_port_free
    from swarm.service import run_announced

    cfg = config_from_args(ns)
    with hold(Path(cfg.data_dir) / LOCK_NAME, flag="--data-dir", shown=cfg.data_dir, what="relay"):
        check_port_free(cfg.host, cfg.port, "--port")
        check_listen_addrs(cfg.listen, "--listen")
        run_announced(serve_relay, cfg, lambda info: f"relay ready peer_id={info.peer_id} addrs={','.join(info.addrs)} "
                                                     f"metrics={info.metrics}")
    return 0
