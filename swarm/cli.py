"""The ``moe-swarm`` command line (application layer: assembles the commands it finds).

Rules:
- The commands are found, not imported: each is an entry point of the ``moe_swarm.roles`` group
  (``name = "module:add_parser"``, pyproject.toml's table), read with ``importlib.metadata``.
  ``BUILTIN_ROLES`` is the same table (a test keeps them equal), for a checkout whose installed
  metadata predates it (an editable install of an older tree, ``python -m swarm.cli`` from a clone);
  an installed entry point wins over the built-in one of its name, and adds a command if new. No
  module of ``swarm`` imports a role (``tests/unit/test_layers.py``).
- Building the parser imports only the commands' ``cli`` modules, which import nothing heavy at
  module level (``swarm.flags``): no torch, libp2p, ggml, trio or httpx until a command runs, so
  ``--help`` and every usage error answer in about a tenth of a second.
- A usage error is one line and exit code 2, with the closest option or command when one was
  misspelt (``unknown option --max-memry; did you mean --max-memory?``).
- Global options (``--log-level``) are accepted before or after the command; the one after wins.
- Each command owns its flags (``<role>.cli``: ``add_parser`` and the flags -> config step); this
  module sets up logging and turns an expected failure into exit code 2 with one clear line: a
  ``SwarmError`` (also inside trio's exception groups) or an address already in use. Anything else
  is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import faulthandler
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

import swarm
from swarm.errors import SwarmError
from swarm.flags import LOG_LEVELS, HelpFormatter, add_global_options

__all__ = ["BUILTIN_ROLES", "ROLE_GROUP", "build_parser", "main", "role_table"]

ROLE_GROUP: Final = "moe_swarm.roles"
# name -> "module:function(subparsers) -> parser"; the same as pyproject.toml's entry points
BUILTIN_ROLES: Final[dict[str, str]] = {
    "make-model": "swarm.tools.cli:add_parser",
    "market": "market.cli:add_parser",
    "coordinator": "coordinator.cli:add_parser",
    "volunteer": "volunteer.cli:add_parser",
    "relay": "relay.cli:add_parser",
    "simulate": "sim.cli:add_parser",
    "gateway": "gateway.cli:add_parser",
}


def role_table() -> dict[str, str]:
    """Every command: the built-in table, then the installed ``moe_swarm.roles`` entry points."""
    from importlib.metadata import entry_points

    return {**BUILTIN_ROLES, **{ep.name: ep.value for ep in entry_points(group=ROLE_GROUP)}}


def _load(value: str) -> Callable[[Any], argparse.ArgumentParser]:
    module, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module.strip())
    for part in attr.split("[")[0].strip().split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


class SwarmParser(argparse.ArgumentParser):
    """argparse with one-line usage errors, close-match suggestions and defaults in the help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        found = _misspelt(self, argv)
        if found is not None:
            parser, message = found
            parser.error(message)
        return super().parse_args(argv, namespace)


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``parser`` and of every command below it."""
    out = set(parser._option_string_actions)
    for sub in _commands(parser).values():
        out |= _options(sub)
    return out


def _suggest(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _unknown(option: str, known: set[str], abbrev: bool) -> bool:
    name = option.split("=", 1)[0]
    if name in known:
        return False
    return not (abbrev and any(k.startswith(name) for k in known))


def _misspelt(root: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, str] | None:
    """An unknown option or command in ``argv`` (before argparse sees it, so a misspelt flag is named
    even when a required one is missing): the parser that should report it and the message."""
    commands = _commands(root)
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        tok = argv[i]
        if tok.startswith("--") and _unknown(tok, set(root._option_string_actions), root.allow_abbrev):
            return root, f"unknown option {tok.split('=', 1)[0]}" + _suggest(tok.split("=", 1)[0], list(root._option_string_actions))
        action = root._option_string_actions.get(tok.split("=", 1)[0])
        i += 2 if action is not None and action.nargs != 0 and "=" not in tok else 1
    if i >= len(argv) or argv[i] == "--":
        if commands and not {"-h", "--help", "--version"} & set(argv):
            return root, f"choose a command: {', '.join(commands)}"
        return None
    sub = commands.get(argv[i])
    if sub is None:
        return root, f"unknown command {argv[i]!r}" + _suggest(argv[i], list(commands)) + \
            f" (commands: {', '.join(commands)})"
    known = _options(sub)
    for tok in argv[i + 1:]:
        if tok == "--":
            break
        if tok.startswith("--") and _unknown(tok, known, sub.allow_abbrev):
            name = tok.split("=", 1)[0]
            return sub, f"unknown option {name}" + _suggest(name, list(known))
    return None


def build_parser() -> argparse.ArgumentParser:
    p = SwarmParser(prog="moe-swarm", description="Peer-to-peer volunteer compute for Mixture-of-Experts language models.",
                    epilog="'moe-swarm COMMAND --help' lists a command's options, grouped, with their defaults.")
    p.add_argument("--version", action="version", version=f"moe-swarm {swarm.__version__}")
    add_global_options(p, root=True, default_level=os.environ.get("MOE_SWARM_LOG", "INFO").upper())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=SwarmParser)
    for value in role_table().values():
        add_global_options(_load(value)(sub), root=False)
    return p


def _expected(exc: BaseException) -> str | None:
    """The one line for an expected failure, or None for a bug (its traceback stays)."""
    if isinstance(exc, SwarmError):
        return f"{exc} [{exc.code}]"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"an address this process binds is already in use ({exc.strerror}): another process listens there [address_in_use]"
    if isinstance(exc, BaseExceptionGroup):  # raised inside a nursery (trio wraps it)
        lines = [_expected(e) for e in exc.exceptions]
        if all(line is not None for line in lines):
            return lines[0]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.log_level not in LOG_LEVELS:  # from MOE_SWARM_LOG (a flag's value is checked by argparse)
        parser.error(f"MOE_SWARM_LOG={ns.log_level.lower()} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    # a crash in native code (ggml, the tokenizer) prints every thread's Python stack to stderr: the log
    # then says where the process died instead of only that its sockets closed
    try:
        faulthandler.enable()
    except (ValueError, OSError):  # stderr without a file descriptor (captured in tests): nothing to write to
        pass
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        # per-request and connection chatter: visible with --log-level DEBUG
        for name in ("httpx", "libp2p", "multiaddr", "hypercorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        rc = ns.func(ns)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        line = _expected(exc)
        if line is None:
            raise
        print(f"moe-swarm: error: {line}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
