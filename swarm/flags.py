"""What the roles' command lines share (pure: argparse and the standard library only).

Rules:
- Importing this module (and a role's ``cli`` module, which uses it) imports nothing heavy: no trio,
  httpx, torch, libp2p or ggml, so ``moe-swarm --help`` and any usage error answer at once. A role's
  ``run`` imports what the role needs.
- Help shows every default that says something (``(default: 8M)``); ``None``, ``False`` and empty
  defaults are left out rather than printed as noise.
- A size is a number with a unit (``512M``, ``2G``, ``1.5GiB``, ``4096B``); a bare number is refused
  (bytes or megabytes? the person must say), as is anything not positive.
- The options every command accepts (``GLOBAL_LEVELS``: ``--log-level``) may follow the command too.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Final

__all__ = ["LOG_LEVELS", "HelpFormatter", "add_global_options", "size_flag"]

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_UNITS: Final = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE: Final = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with the defaults that carry information appended (``(default: X)``)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 30,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or not action.option_strings or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or default in ([], (), "")):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def size_flag(text: str) -> int:
    """A size with its unit -> bytes, for argparse (``type=size_flag``; a string default such as
    ``"8M"`` is converted the same way and shown as written)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 512M or 2G")
    num, letter, suffix = m.groups()
    if not letter and not suffix:
        raise argparse.ArgumentTypeError(f"{text!r} has no unit: write {num}G, {num}M or {num}B (bytes)")
    if letter == "" and suffix.upper() == "IB":
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 512M or 2G")
    value = float(num)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(value * _UNITS[letter.upper() or "B"])


def add_global_options(parser: argparse.ArgumentParser, *, root: bool, default_level: str = "INFO") -> None:
    """``--log-level`` on ``parser``. On a command's parser its default is suppressed, so the value
    given before the command stays unless one is given after it."""
    kw: dict[str, Any] = {"default": default_level} if root else {"default": argparse.SUPPRESS}
    group = parser.add_argument_group("global options") if not root else parser
    group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                       help="log level: " + ", ".join(LOG_LEVELS) + " (or MOE_SWARM_LOG)", **kw)
