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
        data_dir=ns.data_dir,
    )

    async def service() -> None:
        async with trio.open_nursery() as n:
            url = await n.start(serve_coordinator, cfg)
            print(f"coordinator ready at {url}", flush=True)

    run_service(service)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-swarm", description="Peer-to-peer volunteer compute for MoE language models")
    p.add_argument("--log-level", default=os.environ.get("MOE_SWARM_LOG", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    from swarm.makemodel import add_make_model_parser

    add_make_model_parser(sub)

    c = sub.add_parser("coordinator", help="host a GGUF MoE model behind an OpenAI-compatible API")
    c.add_argument("--model", required=True, help="path to a GGUF MoE model")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8080)
    c.add_argument("--slots", type=int, default=4, help="parallel sequences batched per step")
    c.add_argument("--ctx-size", type=int, default=None, help="context per slot (default: the model's)")
    c.add_argument("--batch-size", type=int, default=512, help="max tokens per engine step")
    c.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503")
    c.add_argument("--data-dir", default=None)
    c.set_defaults(func=_coordinator)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
