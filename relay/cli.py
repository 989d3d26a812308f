"""``moe-swarm relay`` (shell: flags -> ``RelayConfig`` -> ``serve_relay``)."""

from __future__ import annotations

import argparse
from typing import Any

from relay.service import RelayConfig, serve_relay
from swarm.config import build_config, data_dir_for
from swarm.service import run_announced

__all__ = ["add_parser", "config_from_args"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    r: argparse.ArgumentParser = subparsers.add_parser("relay", help="run a circuit relay v2 for volunteers behind NATs")
    r.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen multiaddr, TCP or WebSocket (repeatable; default /ip4/0.0.0.0/tcp/4001), "
                        "e.g. --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/tcp/443/ws")
    r.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="public address handed to volunteers with their reservation (repeatable; default: listen ones)")
    r.add_argument("--host", default="127.0.0.1", help="/metrics and /health bind address")
    r.add_argument("--port", type=int, default=9090, help="/metrics and /health port")
    r.add_argument("--data-dir", default=None,
                   help="identity key, so the relay's peer id stays the same across restarts "
                        "(default ~/.local/share/moe-swarm/relay)")
    r.add_argument("--max-reservations", type=int, default=128, help="volunteers that can reserve a slot")
    r.add_argument("--max-reservations-per-address", type=int, default=16,
                   help="... of which from one IP address (an IPv6 /64)")
    r.add_argument("--max-reservations-per-prefix", type=int, default=64,
                   help="... and from one network (an IPv4 /24, an IPv6 /48)")
    r.add_argument("--max-circuits", type=int, default=1024, help="open circuits in total")
    r.add_argument("--max-circuits-per-peer", type=int, default=16, help="open circuits per volunteer and per dialer")
    r.add_argument("--reservation-ttl", type=int, default=3600, help="seconds a reservation lasts without a refresh")
    r.add_argument("--circuit-max-bytes", type=int, default=0, help="bytes per direction per circuit (0 = unlimited)")
    r.add_argument("--circuit-max-duration", type=int, default=0, help="seconds per circuit (0 = unlimited)")
    r.add_argument("--stream-window", type=int, default=256 * 1024,
                   help="receive window per stream, in bytes: what the relay holds of a stalled circuit direction")
    r.set_defaults(func=run)
    return r


def config_from_args(ns: argparse.Namespace) -> RelayConfig:
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
    run_announced(serve_relay, config_from_args(ns),
                  lambda info: f"relay ready peer_id={info.peer_id} addrs={','.join(info.addrs)} metrics={info.metrics}")
    return 0
