"""The ``moe-swarm`` command line (application layer: the one place that knows every role).

Rules:
- Each role owns its command (``<role>.cli``: ``add_parser`` and the flags -> config step); this
  module only assembles them, sets up logging and turns a ``SwarmError`` into exit code 2 with
  one clear line. Roles never import this module (no cycle).
- Flags are parsed once into frozen config Structs (``swarm.config.build_config``); nothing below
  reads the environment.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys

from swarm.errors import SwarmError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    import coordinator.cli
    import market.cli
    import relay.cli
    import volunteer.cli
    from swarm.tools.makemodel import add_make_model_parser

    p = argparse.ArgumentParser(prog="moe-swarm", description="Peer-to-peer volunteer compute for MoE language models")
    p.add_argument("--log-level", default=os.environ.get("MOE_SWARM_LOG", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)
    add_make_model_parser(sub)
    market.cli.add_parser(sub)
    coordinator.cli.add_parser(sub)
    volunteer.cli.add_parser(sub)
    relay.cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    # a crash in native code (ggml, the tokenizer) prints every thread's Python stack to stderr: the log
    # then says where the process died instead of only that its sockets closed
    try:
        faulthandler.enable()
    except (ValueError, OSError):  # stderr without a file descriptor (captured in tests): nothing to write to
        pass
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
    except BaseExceptionGroup as group:  # raised inside a nursery (trio wraps it): the same clear error
        found, rest = group.split(SwarmError)
        if found is None or rest is not None:
            raise
        leaf: BaseException = found
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        print(f"moe-swarm: error: {leaf} [{getattr(leaf, 'code', 'error')}]", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
