"""``moe-swarm make-model``'s command line (shell; imports nothing heavy until it runs).

Rules:
- The choices are written here as plain tuples so that building the parser imports neither numpy
  nor gguf; ``tests/unit/test_makemodel.py`` keeps them equal to ``swarm.tools.makemodel``'s.
- ``run`` imports the generator and writes the file; a ``SwarmError`` is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from swarm.flags import HelpFormatter

__all__ = ["ARCHITECTURES", "QTYPE_NAMES", "SIZE_NAMES", "VOCABS", "add_arguments", "add_parser", "main", "run"]

ARCHITECTURES: Final = ("qwen3moe", "mixtral", "qwen2moe", "olmoe", "deepseek2", "gpt-oss")
SIZE_NAMES: Final = ("tiny", "small", "bench", "30b-a3b")
QTYPE_NAMES: Final = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
VOCABS: Final = ("bpe", "spm")

DESCRIPTION: Final = (
    "Write a deterministic random-weight MoE GGUF (for the demo, tests and benchmarks; nothing is downloaded): "
    "architectures qwen3moe, mixtral (Mixtral-style llama), qwen2moe (shared expert), olmoe, deepseek2 (MLA, "
    "shared experts) and gpt-oss (attention sinks, biased router); sizes tiny (2.5 MB), "
    "small (57 MB), bench (1.25 GB) and 30b-a3b (Qwen3-30B-A3B's shape, 18 GB). The same arguments give the "
    "same bytes on every run."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output GGUF path (written whole or not at all)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3moe", help="model architecture")
    parser.add_argument("--size", choices=SIZE_NAMES, default="tiny", help="model size")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("--vocab", choices=VOCABS, default="bpe",
                        help="tokenizer: byte-level BPE with ChatML, or SentencePiece with byte fallback (Mixtral's)")
    parser.add_argument("--qtype", type=str.upper, choices=QTYPE_NAMES, default=None,
                        help="storage type of the expert tensors (default: F32 for tiny/small, Q8_0 for bench, "
                             "Q4_0 for 30b-a3b)")
    parser.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                        help="make low-index experts hot: router rows scaled by (1+S)^(1-2e/(n-1)) (0: uniform)")
    parser.add_argument("--draft-of", type=Path, default=None, metavar="TARGET",
                        help="write a draft model for speculative decoding of TARGET (a make-model file): the same "
                             "weights -- embedding, head, attention, router -- with its experts stored in --qtype "
                             "(default Q4_0), a smaller file with the same vocabulary")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``make-model`` on a CLI's subparsers; ``func(ns) -> int`` runs it."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "make-model", usage="%(prog)s --out FILE [--arch ARCH] [--size SIZE] [options]",
        help="write a deterministic random-weight MoE GGUF (six architectures, four sizes)",
        description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(ns: argparse.Namespace) -> int:
    from swarm.tools.makemodel import run_make_model

    return run_make_model(ns)


def main(argv: Sequence[str] | None = None) -> int:
    """``make-model`` as a standalone program; returns the exit status."""
    from swarm.errors import SwarmError

    parser = argparse.ArgumentParser(prog="moe-swarm make-model", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except SwarmError as exc:
        print(f"moe-swarm make-model: error: {exc.message}", file=sys.stderr)
        return 2
