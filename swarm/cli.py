"""The ``moe-swarm`` command line (shell: parses flags into config Structs and runs services).

Rules:
- Flags are parsed once here into frozen config Structs; nothing below reads the environment.
- Every long-running command is a trio service run under a signal-aware cancel scope: SIGINT or
  SIGTERM triggers a graceful shutdown (drain, deregister) instead of a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from swarm.errors import SwarmError

__all__ = ["main", "run_service"]


def run_service(service: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run a trio service until it ends or SIGINT/SIGTERM asks it to stop."""

    async def runner() -> None:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

                async def watch() -> None:
                    async for _ in signals:
                        logging.getLogger("moe-swarm").info("shutting down")
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(watch)
                await service(*args)
                nursery.cancel_scope.cancel()

    trio.run(runner)


def _coordinator(ns: argparse.Namespace) -> None:
    from coordinator.server import CoordinatorConfig, serve_coordinator

    cfg = CoordinatorConfig(
        model=ns.model,
        host=ns.host,
        port=ns.port,
        slots=ns.slots,
        ctx_size=ns.ctx_size,
        n_batch=ns.batch_size,
        max_queue=ns.max_queue,
        data_dir=os.path.expanduser(ns.data_dir) if ns.data_dir else None,
        dispatch_map=ns.dispatch_map,
        p2p_listen=tuple(ns.p2p_listen or ["/ip4/127.0.0.1/tcp/0"]),
        expert_timeout_s=ns.expert_timeout,
        wire_dtype=ns.wire_dtype,
        market=ns.market,
        advertise_url=ns.advertise_url,
        token=ns.token or os.environ.get("MOE_SWARM_TOKEN"),
        hole_punch=not ns.no_hole_punch,
    )

    async def service() -> None:
        async with trio.open_nursery() as n:
            url = await n.start(serve_coordinator, cfg)
            print(f"coordinator ready at {url}", flush=True)

    run_service(service)


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1.5GiB``, ``1000000`` -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" else t
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return int(value * mult)


def _volunteer(ns: argparse.Namespace) -> None:
    import torch

    # parallelism comes from --threads compute threads; one intra-op thread each keeps them from
    # oversubscribing the cores (OpenMP threads spin while idle)
    torch.set_num_threads(1)
    if ns.no_direct and ns.listen:
        raise SwarmError("--no-direct (reachable only through relays) excludes --listen", code="config_error")
    listen = () if ns.no_direct else tuple(ns.listen or ["/ip4/127.0.0.1/tcp/0"])
    data_dir = os.path.expanduser(ns.data_dir)
    if ns.market:
        if ns.slices or ns.coordinator:
            raise SwarmError("--market (pull mode) and --coordinator/--slice (static mode) exclude each other",
                             code="config_error")
        from volunteer.daemon import PullVolunteerConfig, serve_pull_volunteer

        pcfg = PullVolunteerConfig(
            market=ns.market, data_dir=data_dir, listen=listen, max_bytes=ns.max_memory, max_experts=ns.max_experts,
            models=tuple(ns.models or ()), threads=ns.threads, progress=not ns.no_progress,
            poll_interval_s=ns.poll_interval, relays=tuple(ns.relays or ()), hole_punch=not ns.no_hole_punch,
        )
        if pcfg.max_bytes is None and pcfg.max_experts is None:
            pcfg = msgspec.structs.replace(pcfg, max_bytes=1 << 30)
        run_service(serve_pull_volunteer, pcfg)
        return
    if not ns.coordinator or not ns.slices:
        raise SwarmError("give --market URL (pull mode) or --coordinator URL with --slice LAYER:LO-HI (static mode)",
                         code="config_error")
    from volunteer.static import StaticVolunteerConfig, check_config, serve_static_volunteer

    cfg = StaticVolunteerConfig(
        coordinator=ns.coordinator,
        slices=tuple(ns.slices),
        listen=listen,
        data_dir=data_dir,
        model_id=ns.model_id,
        threads=ns.threads,
        progress=not ns.no_progress,
        relays=tuple(ns.relays or ()),
        hole_punch=not ns.no_hole_punch,
    )
    check_config(cfg)
    run_service(serve_static_volunteer, cfg)


def _relay(ns: argparse.Namespace) -> None:
    from relay.service import RelayConfig, serve_relay

    cfg = RelayConfig(
        listen=tuple(ns.listen or ["/ip4/0.0.0.0/tcp/4001"]),
        announce=tuple(ns.announce or ()),
        host=ns.host,
        port=ns.port,
        data_dir=os.path.expanduser(ns.data_dir),
        max_reservations=ns.max_reservations,
        max_circuits=ns.max_circuits,
        max_circuits_per_peer=ns.max_circuits_per_peer,
        reservation_ttl_s=ns.reservation_ttl,
        circuit_max_bytes=ns.circuit_max_bytes,
        circuit_max_duration_s=ns.circuit_max_duration,
    )
    cfg.limits()  # validate before starting anything

    async def service() -> None:
        async with trio.open_nursery() as n:
            info = await n.start(serve_relay, cfg)
            print(f"relay ready peer_id={info['peer_id']} addrs={','.join(info['addrs'])} metrics={info['metrics']}",
                  flush=True)

    run_service(service)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-swarm", description="Peer-to-peer volunteer compute for MoE language models")
    p.add_argument("--log-level", default=os.environ.get("MOE_SWARM_LOG", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    from swarm.tools.makemodel import add_make_model_parser

    add_make_model_parser(sub)

    from market.cli import add_market_parser

    add_market_parser(sub)

    c = sub.add_parser("coordinator", help="host a GGUF MoE model behind an OpenAI-compatible API")
    c.add_argument("--model", required=True, help="path to a GGUF MoE model")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8080)
    c.add_argument("--slots", type=int, default=4, help="parallel sequences batched per step")
    c.add_argument("--ctx-size", type=int, default=None, help="context per slot (default: the model's)")
    c.add_argument("--batch-size", type=int, default=512, help="max tokens per engine step")
    c.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503")
    c.add_argument("--data-dir", default=None, help="identity key and slice cache (default: a temporary directory)")
    c.add_argument("--dispatch-map", default=None, help="follow this dispatch-map JSON file (re-read when it changes)")
    c.add_argument("--p2p-listen", action="append", default=None, help="libp2p listen multiaddr (repeatable)")
    c.add_argument("--expert-timeout", type=float, default=3.0, help="seconds before a remote expert call falls back")
    c.add_argument("--wire-dtype", choices=["float32", "bfloat16"], default="float32", help="activations on the wire")
    c.add_argument("--market", default=None, help="register with this market and follow its dispatch map")
    c.add_argument("--advertise-url", default=None, help="this coordinator's URL as others reach it (default: bound URL)")
    c.add_argument("--token", default=None, help="operator token for the market (or MOE_SWARM_TOKEN)")
    c.add_argument("--no-hole-punch", action="store_true",
                   help="keep relayed connections relayed (no DCUtR upgrade to a direct connection)")
    c.set_defaults(func=_coordinator)

    v = sub.add_parser("volunteer", help="serve expert slices: pulled from a market, or given statically")
    v.add_argument("--market", default=None, help="pull mode: take the scarcest slice the market offers")
    v.add_argument("--max-memory", type=parse_size, default=None, help="pull mode: slice budget, e.g. 512M (default 1G)")
    v.add_argument("--max-experts", type=int, default=None, help="pull mode: budget in experts")
    v.add_argument("--models", action="append", default=None, help="pull mode: only these model ids (repeatable)")
    v.add_argument("--poll-interval", type=float, default=2.0, help="pull mode: seconds between market polls")
    v.add_argument("--coordinator", default=None, help="static mode: coordinator URL (slices are downloaded from it)")
    v.add_argument("--slice", action="append", dest="slices", default=None, metavar="LAYER:LO-HI",
                   help="static mode: experts LO..HI-1 of LAYER, e.g. 0:0-4 (repeatable)")
    v.add_argument("--listen", action="append", default=None, help="libp2p listen multiaddr (repeatable)")
    v.add_argument("--data-dir", default=os.path.expanduser("~/.local/share/moe-swarm/volunteer"))
    v.add_argument("--model-id", default=None, help="model to serve when the coordinator hosts several")
    v.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="compute threads")
    v.add_argument("--no-progress", action="store_true", help="no download progress bar")
    v.add_argument("--relay", action="append", dest="relays", default=None, metavar="MULTIADDR",
                   help="a relay to reserve on when not reachable directly, e.g. "
                        "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW... (repeatable; pull mode default: the market's)")
    v.add_argument("--no-direct", action="store_true",
                   help="do not listen; reachable only through relays")
    v.add_argument("--no-hole-punch", action="store_true",
                   help="do not answer DCUtR: coordinators keep reaching this volunteer through the relay")
    v.set_defaults(func=_volunteer)

    r = sub.add_parser("relay", help="run a circuit relay v2 for volunteers behind NATs")
    r.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen multiaddr, TCP or WebSocket (repeatable; default /ip4/0.0.0.0/tcp/4001), "
                        "e.g. --listen /ip4/0.0.0.0/tcp/4001 --listen /ip4/0.0.0.0/tcp/443/ws")
    r.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="public address handed to volunteers with their reservation (repeatable; default: listen ones)")
    r.add_argument("--host", default="127.0.0.1", help="/metrics and /health bind address")
    r.add_argument("--port", type=int, default=9090, help="/metrics and /health port")
    r.add_argument("--data-dir", default=os.path.expanduser("~/.local/share/moe-swarm/relay"),
                   help="identity key (the relay's peer id stays the same across restarts)")
    r.add_argument("--max-reservations", type=int, default=128, help="volunteers that can reserve a slot")
    r.add_argument("--max-circuits", type=int, default=1024, help="open circuits in total")
    r.add_argument("--max-circuits-per-peer", type=int, default=16, help="open circuits per volunteer and per dialer")
    r.add_argument("--reservation-ttl", type=int, default=3600, help="seconds a reservation lasts without a refresh")
    r.add_argument("--circuit-max-bytes", type=int, default=0, help="bytes per direction per circuit (0 = unlimited)")
    r.add_argument("--circuit-max-duration", type=int, default=0, help="seconds per circuit (0 = unlimited)")
    r.set_defaults(func=_relay)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        # per-request and connection chatter: visible with --log-level DEBUG
        for name in ("httpx", "libp2p", "multiaddr", "hypercorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        rc = ns.func(ns)
    except SwarmError as exc:
        print(f"moe-swarm: error: {exc} [{exc.code}]", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
