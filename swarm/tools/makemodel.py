"""``moe-swarm make-model``: deterministic random-weight MoE GGUF files (a shell: writes one file).

Models are for the demo, tests and benchmarks; nothing is ever downloaded. The layout follows
llama.cpp's conventions (and ``tests/fixtures/golden/qwen3moe-tiny-f32.gguf``), so llama.cpp loads
them: ``qwen3moe`` (per-head q/k RMSNorm, NEOX RoPE) or Mixtral-style ``llama`` with merged 3-D
expert tensors ``blk.N.ffn_{gate,up,down}_exps`` (adjacent-pair RoPE, no q/k norm).

Rules:
- The file is a pure function of ``(arch, size, seed, qtype)``: the same arguments give the same
  bytes on every run (no clock, no global RNG, no dict-order or hash-seed dependence).
- Each tensor (each expert of an expert tensor) draws from its own generator seeded by
  ``(seed, sha256(name), expert)``, so weights do not depend on the storage type: a Q4_K file
  holds the quantised weights of the F32 file with the same seed.
- ``qtype`` changes only the expert tensors. Norms and the router are always F32; embeddings,
  attention and output use the size's dense type (F32, or F16 for ``bench``).
- The tokenizer is byte-level BPE (``gpt2``): the 256 byte tokens in GPT-2 byte-to-unicode order,
  then merges learned by a small deterministic trainer from the English text embedded below
  (smaller vocabularies are prefixes of larger ones), then the control tokens ``<|endoftext|>``
  (bos, padding), ``<|im_start|>``, ``<|im_end|>`` (eos). The chat template is ChatML.
- The file is written to a temporary name beside ``out`` and renamed, so ``out`` is never partial.

Sizes (parameters and file bytes for the default types; ``qwen3moe`` / ``mixtral``)::

    size   layers d_model heads/kv head_dim experts top-k width ctx  vocab types (dense/experts)
    tiny   2      128     4/2      32       8       2     64    512  512   F32/F32
    small  4      256     8/2      32       16      4     256   1024 2048  F32/F32
    bench  8      1024    16/4     64       32      4     1408  2048 8192  F16/Q8_0

    size   params qwen3moe   bytes qwen3moe          params mixtral    bytes mixtral
    tiny   625,408           2,515,104 (2.5 MB)      625,280           2,514,240
    small  14,305,792        57,285,792 (57 MB)      14,305,536        57,284,160
    bench  1,145,325,568     1,253,395,360 (1.25 GB) 1,145,324,544     1,253,390,208

(bytes vary by a few with the digits of the seed in ``general.name``). In ``bench`` the experts
are 1.107e9 of the weights; a token uses 4 of 32 experts per layer, ~176M weights in all, of which
138M are expert weights: expert FFNs dominate CPU decode compute.

K-quant expert types need rows that are multiples of 256 elements, so ``tiny`` (d_model 128,
width 64) accepts only F32, F16, BF16, Q8_0 and Q4_0. Writing ``bench`` takes 30-45 s on 2 cores
(drawing 1.1e9 normals and quantising them), one tensor in memory at a time (~300 MB peak RSS).
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import heapq
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import gguf
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as T

from swarm.errors import ConfigError, SwarmError
from swarm.model import quant

__all__ = [
    "ARCHITECTURES",
    "CHATML_TEMPLATE",
    "SIZES",
    "Arch",
    "BpeVocab",
    "SizeName",
    "SizeSpec",
    "add_make_model_parser",
    "build_vocab",
    "count_parameters",
    "main_make_model",
    "make_model",
    "run_make_model",
]

Arch = Literal["qwen3moe", "mixtral"]
SizeName = Literal["tiny", "small", "bench"]
ARCHITECTURES: tuple[str, ...] = get_args(Arch)

# Rendering: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
# "<|im_start|>assistant\n" when add_generation_prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class SizeSpec:
    n_layer: int
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    expert_width: int
    context_length: int
    vocab_size: int
    dense_type: T  # token_embd, attention projections, output
    expert_type: T  # default type of ffn_{gate,up,down}_exps


SIZES: dict[str, SizeSpec] = {
    "tiny": SizeSpec(2, 128, 4, 2, 32, 8, 2, 64, 512, 512, T.F32, T.F32),
    "small": SizeSpec(4, 256, 8, 2, 32, 16, 4, 256, 1024, 2048, T.F32, T.F32),
    "bench": SizeSpec(8, 1024, 16, 4, 64, 32, 4, 1408, 2048, 8192, T.F16, T.Q8_0),
}

_FILE_TYPES: dict[T, gguf.LlamaFileType] = {
    T.F32: gguf.LlamaFileType.ALL_F32,
    T.F16: gguf.LlamaFileType.MOSTLY_F16,
    T.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    T.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    T.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    T.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}
_UNQUANTISED = frozenset({T.F32, T.F16, T.BF16})
QTYPE_NAMES: tuple[str, ...] = tuple(t.name for t in _FILE_TYPES)

# ---------------------------------------------------------------------------------------------
# tokenizer

# Pre-tokenisation for training: an ASCII rendering of the qwen2/llama-bpe split rules (a word
# with its leading space, single digits, punctuation runs, whitespace runs).
_PRETOKENIZE = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


_CORPUS_WEIGHT = 16


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in GPT-2's token order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@dataclass(frozen=True)
class BpeVocab:
    tokens: tuple[str, ...]  # byte tokens, merged tokens, then SPECIAL_TOKENS
    token_types: tuple[int, ...]  # gguf.TokenType: NORMAL, or CONTROL for the special tokens
    merges: tuple[str, ...]  # "left right", by rank

    def token_id(self, token: str) -> int:
        return self.tokens.index(token)


def _training_words() -> list[tuple[str, int]]:
    """Pre-tokens of the corpus with counts, plus each word's case/space variants, which lets the
    small corpus supply ~10k merges; sorted for a deterministic trainer. Corpus occurrences weigh
    ``_CORPUS_WEIGHT`` times a variant, so the first merges are those of ordinary English text."""
    found = collections.Counter(_PRETOKENIZE.findall(_CORPUS))
    counts = collections.Counter({word: n * _CORPUS_WEIGHT for word, n in found.items()})
    variants: collections.Counter[str] = collections.Counter()
    for word in sorted(found):
        core = word.lstrip(" ")
        if core.isascii() and core.isalpha():
            for form in sorted({core.lower(), core.capitalize(), core.upper()}):
                variants[form] += 1
                variants[" " + form] += 1
    counts.update(variants)
    return sorted(counts.items())


def _train_merges(n_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE: merge the most frequent adjacent pair (ties: smallest pair) until the
    vocabulary has ``n_tokens`` tokens. Incremental pair counts with a lazily invalidated heap."""
    b2u = _byte_to_unicode()
    vocab = list(b2u.values())
    known = set(vocab)
    words_counts = _training_words()
    words = [[b2u[b] for b in word.encode("utf-8")] for word, _ in words_counts]
    freq = [count for _, count in words_counts]
    pair_count: dict[tuple[str, str], int] = collections.defaultdict(int)
    pair_words: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for i, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:], strict=False):
            pair_count[pair] += freq[i]
            pair_words[pair].add(i)
    heap = [(-count, left, right) for (left, right), count in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while len(vocab) < n_tokens and heap:
        neg, left, right = heapq.heappop(heap)
        pair = (left, right)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale heap entry
        merges.append(pair)
        merged = left + right
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
        touched: set[tuple[str, str]] = set()
        for i in sorted(pair_words.pop(pair)):
            symbols = words[i]
            for old in zip(symbols, symbols[1:], strict=False):
                pair_count[old] -= freq[i]
                touched.add(old)
            out: list[str] = []
            j = 0
            while j < len(symbols):
                if j + 1 < len(symbols) and symbols[j] == left and symbols[j + 1] == right:
                    out.append(merged)
                    j += 2
                else:
                    out.append(symbols[j])
                    j += 1
            words[i] = out
            for new in zip(out, out[1:], strict=False):
                pair_count[new] += freq[i]
                pair_words[new].add(i)
                touched.add(new)
        pair_count.pop(pair, None)
        touched.discard(pair)
        for p in sorted(touched):
            if pair_count.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_count[p], p[0], p[1]))
            else:
                pair_count.pop(p, None)
                pair_words.pop(p, None)
    if len(vocab) < n_tokens:
        raise ConfigError(f"the built-in corpus supplies only {len(vocab)} BPE tokens, {n_tokens} asked")
    return vocab, merges


@functools.lru_cache(maxsize=8)
def build_vocab(vocab_size: int) -> BpeVocab:
    """The byte-level BPE vocabulary of ``vocab_size`` tokens (including the 3 special tokens)."""
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ConfigError(f"vocab_size must be at least {256 + n_special}, got {vocab_size}")
    vocab, merges = _train_merges(vocab_size - n_special)
    tokens = (*vocab, *SPECIAL_TOKENS)
    types = (int(gguf.TokenType.NORMAL),) * len(vocab) + (int(gguf.TokenType.CONTROL),) * n_special
    return BpeVocab(tokens, types, tuple(f"{a} {b}" for a, b in merges))


# ---------------------------------------------------------------------------------------------
# tensors


@dataclass(frozen=True)
class _TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: last dim is the row
    qtype: T
    std: float  # normal(0, std) weights; for norms: 1 + normal(0, std)
    is_norm: bool = False

    @property
    def nbytes(self) -> int:
        return quant.tensor_nbytes(self.qtype, self.shape)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], quant.bytes_per_row(self.qtype, self.shape[-1]))


def _plan(arch: Arch, spec: SizeSpec, expert_type: T) -> list[_TensorPlan]:
    d, hd, width, n_exp = spec.d_model, spec.head_dim, spec.expert_width, spec.n_expert
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd
    dense, f32 = spec.dense_type, T.F32
    norm_std = 0.1
    plans = [_TensorPlan("token_embd.weight", (spec.vocab_size, d), dense, 1.0)]
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        plans += [
            _TensorPlan(b + "attn_norm.weight", (d,), f32, norm_std, is_norm=True),
            _TensorPlan(b + "attn_q.weight", (q_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_k.weight", (kv_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_v.weight", (kv_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_output.weight", (d, q_dim), dense, q_dim**-0.5),
        ]
        if arch == "qwen3moe":
            plans += [
                _TensorPlan(b + "attn_q_norm.weight", (hd,), f32, norm_std, is_norm=True),
                _TensorPlan(b + "attn_k_norm.weight", (hd,), f32, norm_std, is_norm=True),
            ]
        plans += [
            _TensorPlan(b + "ffn_norm.weight", (d,), f32, norm_std, is_norm=True),
            _TensorPlan(b + "ffn_gate_inp.weight", (n_exp, d), f32, d**-0.5),
            _TensorPlan(b + "ffn_gate_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_up_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_down_exps.weight", (n_exp, d, width), expert_type, width**-0.5),
        ]
    plans += [
        _TensorPlan("output_norm.weight", (d,), f32, norm_std, is_norm=True),
        # logits of std ~2: argmax is scale-free, but top-1/top-2 margins double (robust greedy tests)
        _TensorPlan("output.weight", (spec.vocab_size, d), dense, 2.0 * d**-0.5),
    ]
    return plans


def _draw(seed: int, plan: _TensorPlan, shape: tuple[int, ...], expert: int) -> npt.NDArray[np.float32]:
    name_key = int.from_bytes(hashlib.sha256(plan.name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(np.random.SeedSequence([seed, name_key, expert]))
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(plan.std)
    if plan.is_norm:
        x += np.float32(1.0)
    return x


def _tensor_bytes(seed: int, plan: _TensorPlan) -> npt.NDArray[np.uint8]:
    """The raw GGUF bytes of one tensor; 3-D expert stacks are drawn and quantised per expert."""
    if len(plan.shape) == 3:
        out = np.empty(plan.byte_shape, dtype=np.uint8)
        for e in range(plan.shape[0]):
            out[e] = quant.quantize(_draw(seed, plan, plan.shape[1:], e), plan.qtype)
        return out
    return quant.quantize(_draw(seed, plan, plan.shape, 0), plan.qtype)


def _parse_qtype(qtype: str | None, size: str) -> T:
    spec = SIZES[size]
    if qtype is None:
        return spec.expert_type
    try:
        parsed = T[qtype.upper()]
    except KeyError:
        parsed = None
    if parsed is None or parsed not in _FILE_TYPES:
        raise ConfigError(f"unsupported --qtype {qtype!r}: choose one of {', '.join(QTYPE_NAMES)}")
    block, _ = gguf.GGML_QUANT_SIZES[parsed]
    for cols in (spec.d_model, spec.expert_width):
        if cols % block:
            raise ConfigError(
                f"{parsed.name} needs expert rows that are multiples of {block} elements; size {size!r} "
                f"has rows of {spec.d_model} and {spec.expert_width}"
            )
    return parsed


def count_parameters(arch: Arch, size: SizeName) -> int:
    """Number of weights in the model (independent of storage types)."""
    spec = SIZES[size]
    return sum(math.prod(p.shape) for p in _plan(arch, spec, spec.expert_type))


# ---------------------------------------------------------------------------------------------
# the file


def _add_metadata(w: gguf.GGUFWriter, arch: Arch, size: SizeName, seed: int, expert_type: T) -> None:
    spec = SIZES[size]
    gguf_arch = "qwen3moe" if arch == "qwen3moe" else "llama"
    w.add_string("general.name", f"moe-swarm-{arch}-{size}-seed{seed}")
    w.add_type("model")
    a = gguf_arch
    w.add_uint32(f"{a}.context_length", spec.context_length)
    w.add_uint32(f"{a}.embedding_length", spec.d_model)
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    if arch == "qwen3moe":
        # Qwen3-MoE's dense intermediate size (unused by the MoE blocks), as in the golden file.
        w.add_uint32(f"{a}.feed_forward_length", 6 * spec.expert_width)
        w.add_uint32(f"{a}.expert_feed_forward_length", spec.expert_width)
    else:
        w.add_uint32(f"{a}.feed_forward_length", spec.expert_width)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    if arch == "qwen3moe":
        w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
        w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    else:
        w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 1_000_000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if arch == "qwen3moe" else 1e-5)
    w.add_uint32(f"{a}.expert_count", spec.n_expert)
    w.add_uint32(f"{a}.expert_used_count", spec.n_expert_used)
    w.add_uint32("general.file_type", int(_FILE_TYPES[expert_type]))
    if expert_type not in _UNQUANTISED:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    vocab = build_vocab(spec.vocab_size)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2" if arch == "qwen3moe" else "llama-bpe")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(vocab.token_id("<|im_end|>"))
    w.add_pad_token_id(vocab.token_id("<|endoftext|>"))
    w.add_bos_token_id(vocab.token_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def make_model(
    *, arch: Arch, size: SizeName, seed: int, out: Path, qtype: str | None = None
) -> Path:
    """Write the model GGUF to ``out`` (replacing it) and return ``out``.

    ``qtype`` (a GGML type name such as ``"Q4_K"``) overrides the expert tensors' type.
    Raises ``ConfigError`` for an unknown arch, size or type, or a type the size cannot use.
    """
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    if seed < 0 or seed >= 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {seed}")
    expert_type = _parse_qtype(qtype, size)
    plans = _plan(arch, SIZES[size], expert_type)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    writer = gguf.GGUFWriter(partial, "qwen3moe" if arch == "qwen3moe" else "llama")
    try:
        _add_metadata(writer, arch, size, seed, expert_type)
        for p in plans:
            writer.add_tensor_info(p.name, p.byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plans:  # one tensor in memory at a time
            writer.write_tensor_data(_tensor_bytes(seed, p))
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# command line


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3moe", help="model architecture")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny", help="model size (see the module docs)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("--out", type=Path, required=True, help="output GGUF path")
    parser.add_argument(
        "--qtype",
        type=str.upper,
        choices=QTYPE_NAMES,
        default=None,
        help="storage type of the expert tensors (default: F32 for tiny/small, Q8_0 for bench)",
    )


def add_make_model_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``make-model`` on a CLI's subparsers; the parsed namespace's ``func`` is
    ``run_make_model``."""
    parser = subparsers.add_parser(
        "make-model",
        help="write a deterministic random-weight MoE GGUF",
        description="Write a deterministic random-weight MoE GGUF (qwen3moe or Mixtral-style llama).",
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_make_model)
    return parser


def run_make_model(args: argparse.Namespace) -> int:
    """Run a parsed ``make-model`` command; errors propagate as ``SwarmError``."""
    path = make_model(arch=args.arch, size=args.size, seed=args.seed, out=args.out, qtype=args.qtype)
    expert_type = _parse_qtype(args.qtype, args.size)
    print(
        f"wrote {path}: {args.arch} {args.size} seed={args.seed} experts={expert_type.name} "
        f"params={count_parameters(args.arch, args.size)} bytes={path.stat().st_size}"
    )
    return 0


def main_make_model(argv: Sequence[str] | None = None) -> int:
    """``moe-swarm make-model`` as a standalone program; returns the exit status."""
    parser = argparse.ArgumentParser(prog="moe-swarm make-model", description="Write a random-weight MoE GGUF.")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_make_model(args)
    except SwarmError as exc:
        print(f"moe-swarm make-model: error: {exc.message}", file=sys.stderr)
        return 2


# A small original English text: the BPE training corpus. Changing it changes every model file.
_CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
A mixture of experts is a neural network in which a small router chooses, for every token, a few
expert feed-forward blocks out of many. Only the chosen experts run, so the model can hold far more
parameters than it spends on any single step. Volunteers on a peer-to-peer network each keep a slice
of the experts in memory and answer requests from a coordinator that runs attention and routing.

Morning light crept across the valley while the river carried leaves toward the distant harbour.
Farmers walked along the narrow paths between fields of wheat, barley, oats and sunflowers, talking
quietly about rain, markets, prices, tractors and the weather that always seemed to change too soon.
In the village square, children played games with chalk and marbles; an old baker sold warm bread,
honey cakes, apple pies and cinnamon rolls from a wooden cart painted green and yellow.

Science begins with curiosity. Someone notices a pattern, asks why it happens, proposes an
explanation, and then designs an experiment that could prove the explanation wrong. Measurements are
repeated, errors are estimated, and results are shared so that others can check them. Physics,
chemistry, biology, geology and astronomy all follow this careful rhythm of doubt and evidence.

Computers store numbers as bits. A floating point value keeps a sign, an exponent and a mantissa;
half precision uses sixteen bits, single precision thirty-two, and double precision sixty-four.
Quantisation squeezes weights into four, five, six or eight bits per value, with a shared scale for
each block, which saves memory and bandwidth at the cost of a little accuracy.

She opened the letter slowly. Her grandmother had written it decades ago, in careful handwriting,
describing a journey by train through mountains, forests, deserts and coastal towns. Every page
mentioned small kindnesses: a stranger who shared an orange, a conductor who found a lost glove,
a musician who played the violin beneath a bridge until the evening lamps were lit.

How do you cook a simple soup? Chop onions, carrots, celery and garlic. Warm olive oil in a heavy pot,
soften the vegetables, add tomatoes, lentils, beans, stock, pepper, salt, thyme and a bay leaf, then
simmer gently for forty minutes. Serve it with fresh bread, grated cheese and a squeeze of lemon.

Networks fail in interesting ways. Packets are delayed, duplicated, reordered or dropped; links go
down; machines restart without warning. Robust systems use timeouts, retries, hedged requests,
leases, heartbeats and careful bookkeeping so that every decision can be explained afterwards.
Good engineers write tests that simulate partitions, latency, loss and clock skew before users do.

History remembers empires, kings, queens, generals and treaties, but ordinary people built the roads,
bridges, cathedrals, ships, libraries and universities. Merchants traded silk, spices, salt, copper,
iron, timber, wool and glass across oceans and continents, carrying languages, recipes and ideas.

Music is organised sound. Melody, harmony, rhythm and timbre combine in songs, symphonies, operas,
ballads, marches and lullabies. A piano has eighty-eight keys; a guitar usually has six strings; a
drum kit includes cymbals, snares, toms and a bass drum. Orchestras tune to the oboe before playing.

In mathematics, a matrix multiplies a vector by taking weighted sums of its columns. Eigenvalues,
determinants, gradients, integrals, probabilities and logarithms appear everywhere: in statistics,
engineering, economics, cryptography and machine learning. The softmax function turns scores into
probabilities; attention compares queries with keys and mixes values accordingly.

Winter arrived early that year. Snow covered rooftops, chimneys, fences and gardens; icicles hung from
gutters; frozen ponds invited skaters wearing scarves, mittens and woollen hats. Families gathered
near fireplaces, reading novels, knitting sweaters, solving puzzles and telling stories late at night.

The athlete trained every day: running, swimming, cycling, stretching, lifting weights and resting.
Coaches measured heart rate, speed, endurance and recovery. At the championship she finished third,
smiled broadly, thanked her teammates and promised to return stronger next season.

Please remember to save your work often. Check the configuration file, verify the checksum, restart
the service, and read the logs carefully if anything looks unusual. Ask questions early; answers are
cheaper than mistakes. Documentation, examples and tutorials help newcomers become contributors.

Birds migrate thousands of kilometres each spring and autumn. Swallows, geese, cranes, storks and
warblers navigate using the sun, the stars, the magnetic field of the earth and familiar landmarks.
Scientists attach tiny transmitters to follow them across seas, islands, wetlands and mountain passes.

Language models predict the next token given the previous ones. A tokenizer splits text into pieces;
byte pair encoding starts from single bytes and repeatedly merges the most frequent adjacent pair.
The vocabulary grows until it reaches the desired size, and every string can still be encoded because
each byte remains available on its own.

Travellers often say that the best part of a trip is the unexpected: a festival in a small town, a
conversation with a fisherman, a meal cooked by a family who insisted on sharing, or a sunset seen
from a hilltop after missing the last bus. Maps, tickets, passports and suitcases are merely tools.

Gardening teaches patience. Seeds need water, soil, sunlight and time. Tomatoes climb wooden stakes,
beans twist around strings, pumpkins sprawl across paths, and roses demand pruning, feeding and care.
Worms, bees, butterflies and ladybirds are welcome guests; slugs, aphids and weeds are not.

The committee met on Thursday to discuss the budget, the schedule and the proposal for a new library.
After long debate, they voted seven to two in favour, asked the architect for revised drawings, and
agreed to publish the minutes online so that every resident could read the reasoning behind it.

Oceans cover most of our planet. Whales sing across enormous distances, coral reefs shelter colourful
fish, octopuses solve puzzles, and currents distribute heat from the tropics toward the poles. Tides
rise and fall because of the moon, while storms build waves that travel across entire basins.

Why does bread rise? Yeast consumes sugar and releases carbon dioxide, which forms bubbles trapped by
gluten. Kneading strengthens the dough; proofing lets it expand; baking sets the structure and browns
the crust through caramelisation and the chemical reactions that give toast its wonderful aroma.

Software is written by people for people. Clear names, small functions, honest comments, typed
interfaces and automated checks make programs easier to change. Reviewers look for correctness,
simplicity, security, performance and whether the code explains itself to the next reader.
Zebras, jaguars, kangaroos, penguins, quokkas, yaks and vultures rarely appear in the same sentence.

Astronomers photograph galaxies, nebulae, comets and asteroids with telescopes on remote plateaus.
Light from faraway quasars departed billions of years before our sun ignited; spectroscopy reveals
hydrogen, helium, oxygen and nitrogen, and slight redshifts betray an expanding, accelerating cosmos.

The carpenter measured twice and cut once. Chisels, hammers, saws, planes, clamps, drills and sandpaper
lay organised on the workbench; shavings curled beneath it like pale ribbons. Oak, walnut, maple,
cherry, pine and birch each behave differently when glued, varnished, polished or exposed to humidity.

Medicine advances through patient observation. Nurses monitor temperature, pulse, breathing and blood
pressure; physicians diagnose infections, fractures, allergies and chronic illnesses; pharmacists
explain dosage, interactions and side effects. Vaccines, antibiotics, anaesthesia and hygiene have
saved countless lives, yet compassion remains the oldest and most dependable treatment.

Economists argue about inflation, unemployment, productivity, wages, taxation and interest rates.
Households budget for rent, groceries, electricity, transport, insurance and holidays. Entrepreneurs
borrow capital, hire employees, negotiate contracts, design products and occasionally go bankrupt.

Philosophers ask difficult questions: what is knowledge, what makes an action just, whether free will
exists, how minds relate to bodies, and why anything exists rather than nothing. Socratic dialogue,
skeptical inquiry, logical analysis and thought experiments remain surprisingly useful methods.

Volcanoes erupt when magma forces its way through cracks in the crust. Lava flows, ash clouds and
pyroclastic surges reshape landscapes; later, fertile soils attract vineyards, orchards and villages.
Earthquakes, tsunamis, landslides, hurricanes, droughts and floods remind everyone of nature's power.

Our kitchen smelled of roasted garlic, rosemary, paprika, ginger, cumin, coriander, turmeric, vanilla
and nutmeg. Grandfather whisked eggs, folded flour, melted butter, toasted almonds, peeled potatoes,
sliced mushrooms, squeezed oranges and scolded anybody who dared to open the oven door too early.

Electricity flows when electrons move through conductors. Voltage, current, resistance, capacitance
and inductance obey tidy equations; transistors switch billions of times per second inside processors;
batteries, generators, transformers, turbines and solar panels keep modern cities humming overnight.

The detective examined footprints, fingerprints, receipts, photographs and an abandoned umbrella.
Witnesses contradicted each other, alibis crumbled, and a forgotten diary finally revealed the motive:
jealousy, greed, revenge and a misunderstanding that began with an unanswered telephone call.

Painters experiment with pigments, brushes, canvases, palettes and perspective. Impressionists chased
fleeting reflections; cubists fractured geometry; surrealists painted dreams; sculptors carved marble,
cast bronze, welded steel and modelled clay, while photographers captured shadows with lenses.

Children learn vocabulary astonishingly quickly: nouns, verbs, adjectives, adverbs, pronouns and
prepositions accumulate through stories, jokes, songs, arguments and endless questions. Teachers
encourage reading, writing, arithmetic, geography, handwriting, spelling and thoughtful listening.

Railways transformed continents. Locomotives pulled carriages across viaducts, tunnels and plains;
stations became cathedrals of iron and glass; timetables synchronised clocks; porters, signalmen,
engineers and ticket inspectors kept passengers moving through fog, blizzards and summer heatwaves.

Privacy matters online. Encryption protects messages, signatures authenticate senders, hashes detect
tampering, and careful protocols avoid leaking metadata. Passwords should be long, unique and stored
in a manager; backups should be tested; permissions should follow the principle of least privilege.
"""
