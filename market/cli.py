"""``moe-swarm market`` (shell: flags -> ``MarketConfig`` -> ``serve_market``).

``moe-swarm market --db PATH [--host H] [--port P] --token T | --insecure-no-token [--relay MULTIADDR ...]
[--poll-interval S] [--saturation-threshold N] [--base-target N] [--boost N] [--lease-s S]
[--heartbeat-ttl-s S] [--cooldown-s S] [--rise-s S] [--hold-s S] ...``

``moe-swarm market migrate --from sqlite:PATH --to postgresql://USER:PASSWORD@HOST:PORT/DB`` moves a
stopped market's SQLite database into an empty PostgreSQL one (``market.migrate``) and prints the rows
moved per table.

Rules:
- Flags are parsed once into a frozen config (constraints checked: ``ConfigError``); the token falls
  back to ``MOE_SWARM_TOKEN``, read here at the edge; ``--db :memory:`` keeps the state in the
  process only (tests, throwaway demos); ``--db postgresql://...`` keeps it in a PostgreSQL database
  (``market.store_pg``); anything else (or ``sqlite:PATH``) is a SQLite file. A database URL is only
  ever printed with its password masked.
- Importing this module imports nothing heavy (``--help``); ``run`` imports the server.
- ``run`` holds ``DB.lock`` (``swarm.lockfile``) for the process's life: one market per database
  file; a second exits 2 naming the holder's PID (a PostgreSQL database: its advisory lock,
  ``market.store_pg``). A port in use is one line too (``swarm.preflight``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from market.policy import MarketPolicy
from swarm.config import data_dir_for, env_token

__all__ = ["add_parser", "config_from_args", "run"]

# MarketConfig's defaults (market.server imports the whole server: not for --help); a test keeps them equal
_HOST, _PORT, _POLL_INTERVAL_S, _POLL_TIMEOUT_S = "127.0.0.1", 8090, 2.0, 1.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``market`` on an ``argparse`` subparsers object; ``func(ns) -> int`` runs it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "market", usage="%(prog)s (--token TOKEN | --insecure-no-token) [--db FILE|URL] [--port PORT] [options]\n"
                                "       %(prog)s migrate --from sqlite:PATH --to postgresql://...",
        help="run the demand market: registry, recruitment, dispatch maps (HTTP API)",
        description="Run the demand market: coordinators register their models, volunteers are recruited for the "
                    "scarcest experts, dispatch maps tell coordinators who serves what; a dashboard at /.")
    d = MarketPolicy()
    s = p.add_argument_group("server")
    s.add_argument("--db", default=None, help="SQLite database file (or sqlite:PATH), or postgresql://USER:PASSWORD@"
                                             "HOST:PORT/DB; one market each (default: DATA_DIR/market.db; "
                                             "':memory:' = volatile)")
    s.add_argument("--replica", action="store_true",
                   help="share the PostgreSQL database of --db with other market replicas (each started with --replica): "
                        "leases and assignments stay exclusive across them; volunteers and coordinators list every "
                        "replica (--market URL --market URL2)")
    s.add_argument("--data-dir", default=None, help="where the default database lives (default ~/.local/share/moe-swarm/market)")
    s.add_argument("--host", default=_HOST, help="bind address")
    s.add_argument("--port", type=int, default=_PORT, help="port (0: any free port)")
    s.add_argument("--token", default=None,
                   help="operator token coordinators must send (or MOE_SWARM_TOKEN); required unless --insecure-no-token")
    s.add_argument("--insecure-no-token", action="store_true",
                   help="run without an operator token: anyone may register models and coordinators")
    s.add_argument("--relay", action="append", default=[], metavar="MULTIADDR",
                   help="relay offered to volunteers that cannot be dialled (repeatable)")
    s.add_argument("--seed", type=int, default=None, help="RNG seed (reproducible tie-breaks and lease ids)")
    c = p.add_argument_group("coordinators and models")
    c.add_argument("--poll-interval", type=float, default=_POLL_INTERVAL_S, help="seconds between /slots polls")
    c.add_argument("--poll-timeout", type=float, default=_POLL_TIMEOUT_S, help="bound on one /slots poll (s)")
    c.add_argument("--saturation-threshold", type=int, default=d.saturation_threshold,
                   help="busy slots at which a coordinator counts as saturated")
    c.add_argument("--host-down-s", type=float, default=d.host_down_s,
                   help="a coordinator whose /slots polls all failed this long stops counting as hosting")
    c.add_argument("--coordinator-gc-s", type=float, default=d.coordinator_gc_s,
                   help="... and is deregistered after this long")
    c.add_argument("--model-gc-s", type=float, default=d.model_gc_s,
                   help="a model no registered coordinator lists is dropped after this long")
    c.add_argument("--max-models", type=int, default=d.max_models, help="registered models in all")
    r = p.add_argument_group("replicas and recruitment")
    r.add_argument("--base-target", type=int, default=d.base_target, help="replicas wanted per expert")
    r.add_argument("--remote-base-target", type=int, default=d.remote_base_target,
                   help="replicas of each expert some hosting coordinator does not compute itself (--local-experts)")
    r.add_argument("--boost", type=int, default=d.boost, help="extra replicas per expert while saturated")
    r.add_argument("--rise-s", type=float, default=d.rise_s,
                   help="saturated this long (dips shorter than this do not count) before the model counts as "
                        "saturated and the boost starts (hysteresis)")
    r.add_argument("--hold-s", type=float, default=d.hold_s,
                   help="no saturated poll for this long before the model counts as unsaturated and the boost ends")
    r.add_argument("--hot-extra-max", type=int, default=d.hot_extra_max,
                   help="extra replicas, at most, for an expert carrying a multiple of its layer's mean load (0 = off)")
    r.add_argument("--hot-half-life-s", type=float, default=d.hot_half_life_s,
                   help="half-life of the routed-row counts that make experts hot")
    r.add_argument("--lease-s", type=float, default=d.lease_s, help="how long a handed-out slice stays reserved")
    r.add_argument("--cooldown-s", type=float, default=d.cooldown_s,
                   help="a surplus volunteer is undispatched this long before it is told to release")
    r.add_argument("--retry-after-s", type=float, default=d.retry_after_s,
                   help="when idle volunteers should ask again if nothing is needed (the least wait)")
    r.add_argument("--idle-poll-rate", type=float, default=d.idle_poll_rate,
                   help="'nothing needed' polls a second to pace the idle volunteers to: their wait grows with their "
                        "number (0: always --retry-after-s)")
    r.add_argument("--max-idle-retry-s", type=float, default=d.max_idle_retry_s,
                   help="the longest wait an idle volunteer is told (a recruitment boost reaches it within this)")
    v = p.add_argument_group("volunteers")
    v.add_argument("--heartbeat-ttl-s", type=float, default=d.heartbeat_ttl_s,
                   help="a volunteer silent this long expires")
    v.add_argument("--sole-replica-ttl-s", type=float, default=d.sole_replica_ttl_s,
                   help="... this long when it holds the only replica of experts a hosting coordinator lacks")
    v.add_argument("--max-leases-per-address", type=int, default=d.max_leases_per_address,
                   help="open leases one IP address may hold (volunteers behind one address share it)")
    v.add_argument("--max-identities-per-address", type=int, default=d.max_identities_per_address,
                   help="live volunteer identities one IP address (an IPv6 /64) may speak for")
    v.add_argument("--identity-idle-s", type=float, default=d.identity_idle_s,
                   help="an identity that never held anything is forgotten after this long without a word")
    v.add_argument("--download-grace-s", type=float, default=d.download_grace_s,
                   help="a slice reported loading counts only until this grace plus its bytes at --download-floor-rate")
    v.add_argument("--download-floor-rate", type=float, default=d.download_floor_bytes_per_s, metavar="BYTES_PER_S",
                   help="the slowest download the deadline allows for (generous: 1 MiB/s)")
    t = p.add_argument_group("trust")
    t.add_argument("--proof-grace-s", type=float, default=d.proof_grace_s,
                   help="a serving slice no coordinator saw proof of (hold challenge, verified answers) "
                        "stops counting after this long; 0 = no proof needed")
    t.add_argument("--quarantine-s", type=float, default=d.quarantine_s,
                   help="how long a volunteer a coordinator caught answering wrongly is refused")
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="market_command", required=False, metavar="migrate",
                           title="subcommands (instead of running the market)")
    m = sub.add_parser("migrate", usage="%(prog)s --from sqlite:PATH --to postgresql://USER:PASSWORD@HOST:PORT/DB",
                       help="move a stopped market's SQLite database into an empty PostgreSQL database",
                       description="Move every row of a SQLite market database (any schema this market knows) into "
                                   "an empty PostgreSQL database, then compare both row for row. Stop the market "
                                   "first.")
    m.add_argument("--from", dest="source", required=True, metavar="sqlite:PATH", help="the SQLite database")
    m.add_argument("--to", dest="target", required=True, metavar="postgresql://...", help="the PostgreSQL database")
    m.set_defaults(func=run_migrate)
    return p


def run_migrate(ns: argparse.Namespace) -> int:
    from market.migrate import migrate
    from market.store import mask_url

    moved = migrate(ns.source, ns.target)
    for table, n in moved.items():
        print(f"{table.value}: {n}")
    print(f"migrated {sum(moved.values())} rows from {ns.source} to {mask_url(ns.target)} (read back and compared)",
          flush=True)
    return 0


def config_from_args(ns: argparse.Namespace) -> Any:
    from market.server import MarketConfig
    from swarm.config import build_config

    db = ns.db if ns.db is not None else os.path.join(data_dir_for("market", ns.data_dir), "market.db")
    if db != ":memory:" and not db.startswith(("postgresql://", "postgres://")):
        db = "sqlite:" + os.path.expanduser(db.removeprefix("sqlite:")) if db.startswith("sqlite:") else os.path.expanduser(db)
    raw = {
        "db": db,
        "host": ns.host,
        "port": ns.port,
        "token": env_token(ns.token),
        "insecure_no_token": ns.insecure_no_token,
        "relays": list(ns.relay),
        "poll_interval_s": ns.poll_interval,
        "poll_timeout_s": ns.poll_timeout,
        "seed": ns.seed,
        "replica": ns.replica,
        "policy": {
            "saturation_threshold": ns.saturation_threshold,
            "base_target": ns.base_target,
            "boost": ns.boost,
            "rise_s": ns.rise_s,
            "hold_s": ns.hold_s,
            "lease_s": ns.lease_s,
            "heartbeat_ttl_s": ns.heartbeat_ttl_s,
            "sole_replica_ttl_s": ns.sole_replica_ttl_s,
            "cooldown_s": ns.cooldown_s,
            "retry_after_s": ns.retry_after_s,
            "idle_poll_rate": ns.idle_poll_rate,
            "max_idle_retry_s": ns.max_idle_retry_s,
            "max_leases_per_address": ns.max_leases_per_address,
            "quarantine_s": ns.quarantine_s,
            "proof_grace_s": ns.proof_grace_s,
            "remote_base_target": ns.remote_base_target,
            "hot_extra_max": ns.hot_extra_max,
            "hot_half_life_s": ns.hot_half_life_s,
            "download_grace_s": ns.download_grace_s,
            "download_floor_bytes_per_s": ns.download_floor_rate,
            "max_identities_per_address": ns.max_identities_per_address,
            "identity_idle_s": ns.identity_idle_s,
            "host_down_s": ns.host_down_s,
            "coordinator_gc_s": ns.coordinator_gc_s,
            "model_gc_s": ns.model_gc_s,
            "max_models": ns.max_models,
        },
    }
    return build_config(MarketConfig, raw, flags={"relays": "--relay", "poll_interval_s": "--poll-interval",
                                                 "poll_timeout_s": "--poll-timeout",
                                                 "download_floor_bytes_per_s": "--download-floor-rate"})


def run(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from market.server import MEMORY_DB, serve_market
    from market.store import is_postgres_url, mask_url, sqlite_path
    from swarm.lockfile import hold
    from swarm.preflight import check_port_free
    from swarm.service import run_announced

    cfg = config_from_args(ns)
    with contextlib.ExitStack() as stack:
        # one market per database file: a second would interleave its writes (PostgreSQL: an advisory lock)
        if cfg.db != MEMORY_DB and not is_postgres_url(cfg.db):
            path = sqlite_path(cfg.db)
            stack.enter_context(hold(Path(path + ".lock"), flag="--db", shown=path, what="market"))
        check_port_free(cfg.host, cfg.port, "--port")
        run_announced(serve_market, cfg, lambda url: f"market ready at {url} (db {mask_url(cfg.db)})")
    return 0
