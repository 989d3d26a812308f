"""A small deterministic byte-level BPE trainer for generated models (pure: no clock, no global RNG).

Rules:
- The vocabulary is a pure function of its size: the 256 byte tokens in GPT-2 byte-to-unicode order,
  then merges learned from the English text ``corpus.txt`` (package data beside this module;
  changing it changes every generated model file), then ``SPECIAL_TOKENS``. Smaller vocabularies
  are prefixes of larger ones.
- Ties are broken by the pair itself, never by dict or hash order.
"""

from __future__ import annotations

import collections
import functools
import heapq
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import gguf

from swarm.errors import ConfigError

__all__ = ["SPECIAL_TOKENS", "BpeVocab", "bpe_merges", "build_vocab", "corpus"]

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@functools.cache
def corpus() -> str:
    """The BPE training text (``swarm/tools/corpus.txt``)."""
    return resources.files("swarm.tools").joinpath("corpus.txt").read_text(encoding="utf-8")


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
    found = collections.Counter(_PRETOKENIZE.findall(corpus()))
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


def bpe_merges(words: list[list[str]], freq: list[int]) -> Iterator[tuple[str, str]]:
    """The merges BPE training makes on ``words`` (lists of symbols, rewritten in place as pairs merge)
    weighted by ``freq``, in order, lazily: each time the most frequent adjacent pair (ties: the
    smallest pair). Incremental pair counts with a lazily invalidated heap."""
    pair_count: dict[tuple[str, str], int] = collections.defaultdict(int)
    pair_words: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for i, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:], strict=False):
            pair_count[pair] += freq[i]
            pair_words[pair].add(i)
    heap = [(-count, left, right) for (left, right), count in pair_count.items()]
    heapq.heapify(heap)
    while heap:
        neg, left, right = heapq.heappop(heap)
        pair = (left, right)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale heap entry
        yield pair
        merged = left + right
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


def _train_merges(n_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE (``bpe_merges`` on the corpus' UTF-8 bytes) until the vocabulary has
    ``n_tokens`` tokens."""
    b2u = _byte_to_unicode()
    vocab = list(b2u.values())
    known = set(vocab)
    words_counts = _training_words()
    words = [[b2u[b] for b in word.encode("utf-8")] for word, _ in words_counts]
    merges: list[tuple[str, str]] = []
    for pair in bpe_merges(words, [count for _, count in words_counts]):
        if len(vocab) >= n_tokens:
            break
        merges.append(pair)
        merged = pair[0] + pair[1]
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
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


