"""``moe-swarm gateway`` (shell: flags -> ``GatewayConfig`` -> ``serve_gateway``).

Rules: importing this module imports nothing heavy (``--help``); a bad flag is one line and exit 2.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    g: argparse.ArgumentParser = subparsers.add_parser(
        "gateway", usage="%(prog)s --market URL [--market URL2] [--port P] [--model GGUF] [options]",
        help="run one OpenAI endpoint for every coordinator a market lists",
        description="One OpenAI-compatible endpoint for every coordinator the markets list: each request goes to "
                    "the coordinator with the lowest predicted time to first token (its load, its advertised "
                    "prefixes, its measured prefill speed); one that fails before the first token is replaced "
                    "transparently.")
    g.add_argument("--market", action="append", required=True, metavar="URL",
                   help="a market to read coordinators from (repeatable: replicas of one swarm)")
    g.add_argument("--host", default="127.0.0.1", help="bind address")
    g.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    g.add_argument("--model", action="append", default=None, metavar="GGUF",
                   help="a model's GGUF, read for its tokenizer only: prompts are tokenised here and routed to the "
                        "coordinator holding their longest prefix (repeatable; without it, routing is by load)")
    t = g.add_argument_group("timing")
    t.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls of markets and coordinators")
    t.add_argument("--poll-timeout", type=float, default=2.0, help="seconds a poll may take")
    t.add_argument("--offer-timeout", type=float, default=10.0,
                   help="seconds an attempt may take beyond its predicted time to first token")
    t.add_argument("--stream-idle-timeout", type=float, default=60.0,
                   help="seconds a coordinator may send nothing after a stream's first token; then the stream ends "
                        "with an error event and the request is cancelled there (keep it above the coordinators' "
                        "--max-park-time)")
    t.add_argument("--stale-after", type=float, default=5.0, help="seconds after which a coordinator's poll is stale")
    t.add_argument("--backoff", type=float, default=5.0, help="seconds a failed coordinator is left out")
    g.add_argument("--max-body", type=int, default=8 << 20, help="bytes of one request body (as the coordinator's)")
    g.set_defaults(func=run)
    return g


def config_from_args(ns: argparse.Namespace) -> Any:
    from gateway.server import GatewayConfig
    from swarm.config import build_config

    return build_config(GatewayConfig, {
        "markets": tuple(m.rstrip("/") for m in ns.market),
        "host": ns.host,
        "port": ns.port,
        "models": tuple(ns.model or ()),
        "poll_interval_s": ns.poll_interval,
        "poll_timeout_s": ns.poll_timeout,
        "offer_timeout_s": ns.offer_timeout,
        "stream_idle_timeout_s": ns.stream_idle_timeout,
        "stale_after_s": ns.stale_after,
        "backoff_s": ns.backoff,
        "max_body": ns.max_body,
    }, flags={"markets": "--market", "models": "--model", "poll_interval_s": "--poll-interval",
              "poll_timeout_s": "--poll-timeout", "offer_timeout_s": "--offer-timeout", "stream_idle_timeout_s": "--stream-idle-timeout",
              "stale_after_s": "--stale-after", "backoff_s": "--backoff"})


def run(ns: argparse.Namespace) -> int:
    from gateway.server import serve_gateway
    from swarm.preflight import check_port_free
    from swarm.service import run_announced

    cfg = config_from_args(ns)
    check_port_free(cfg.host, cfg.port, "--port")
    run_announced(serve_gateway, cfg, lambda url: f"gateway ready at {url}")
    return 0
