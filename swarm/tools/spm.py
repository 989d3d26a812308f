"""A deterministic SentencePiece-style vocabulary for generated models (pure: no clock, no global RNG).

The vocabulary is laid out like a converted Llama-2 / Mistral / Mixtral GGUF (``tokenizer.ggml.model =
"llama"``):

    id 0 ``<unk>`` (UNKNOWN), 1 ``<s>`` (CONTROL, bos), 2 ``</s>`` (CONTROL, eos),
    3..258 ``<0x00>``..``<0xFF>`` (BYTE), then NORMAL pieces, "▁" (U+2581) standing for a space.

Rules:
- A pure function of its size. The pieces are learned from the English text ``corpus.txt`` (the
  BPE trainer's corpus, ``swarm.tools.bpe.corpus``) the way SentencePiece's BPE trainer does: each
  line is one sentence with a leading space, spaces become "▁", a "▁" starts a word, letters,
  single digits, punctuation runs and "▁" runs are separate words; the most frequent adjacent pair
  of pieces within a word is merged first (ties: the smaller pair), until the vocabulary is full.
- Then the single characters, as SentencePiece appends its required characters: every character of
  the corpus, every printable ASCII character and "▁", most frequent first (ties: by code point).
  Anything else (é, 中, emoji, tabs, newlines) falls back to the byte tokens, as in Llama-2.
- Scores are the pieces' priority, decreasing from -1.0 by 1.0 in id order (merged pieces, then the
  characters), as SentencePiece writes them; the special and byte tokens score 0.0.
- Each word's lower-case, capitalised and upper-case forms, with and without "▁", are counted too
  (so the small corpus supplies thousands of pieces), a corpus occurrence weighing as much as
  ``_CORPUS_WEIGHT`` variant occurrences.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import gguf

from swarm.errors import ConfigError
from swarm.tools.bpe import bpe_merges, corpus

__all__ = ["MIXTRAL_CHAT_TEMPLATE", "SPECIAL_PIECES", "SpmVocab", "add_tokenizer_metadata", "spm_metadata", "spm_vocab"]

SPACE = "\u2581"  # "▁"
SPECIAL_PIECES: tuple[str, ...] = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_N_FIXED = len(SPECIAL_PIECES) + 256

# Mixtral-8x7B-Instruct-v0.1's tokenizer_config.json chat template, verbatim.
MIXTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

_CORPUS_WEIGHT = 16
# SentencePiece-style words of an escaped sentence: letters, one digit, a punctuation run, each
# with an optional leading "▁"; then "▁" runs (a "▁" right before a word goes with the word).
_WORD = re.compile(r"▁?[^\W\d_]+|▁?\d|▁?(?:[^\w\s▁]|_)+|▁+(?=▁)|▁+")


class SpmVocab(NamedTuple):
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    token_types: tuple[int, ...]  # gguf.TokenType values
    bos_id: int
    eos_id: int
    unk_id: int

    def token_id(self, token: str) -> int:
        return self.tokens.index(token)


def _sentences() -> list[str]:
    return [SPACE + line.replace(" ", SPACE) for line in corpus().splitlines() if line.strip()]


def _training_words() -> list[tuple[str, int]]:
    found: collections.Counter[str] = collections.Counter()
    for sentence in _sentences():
        found.update(_WORD.findall(sentence))
    counts = collections.Counter({word: n * _CORPUS_WEIGHT for word, n in found.items()})
    variants: collections.Counter[str] = collections.Counter()
    for word in sorted(found):
        core = word.lstrip(SPACE)
        if core.isascii() and core.isalpha():
            for form in sorted({core.lower(), core.capitalize(), core.upper()}):
                variants[form] += 1
                variants[SPACE + form] += 1
    counts.update(variants)
    return sorted(counts.items())


def _required_chars() -> list[str]:
    freq: collections.Counter[str] = collections.Counter()
    for sentence in _sentences():
        freq.update(ch for ch in sentence if not ch.isspace())
    chars = set(freq) | {chr(c) for c in range(0x21, 0x7F)} | {SPACE}
    return sorted(chars, key=lambda ch: (-freq[ch], ord(ch)))


@functools.cache
def _merged_pieces() -> tuple[str, ...]:
    """Every piece BPE training can create (``swarm.tools.bpe.bpe_merges`` on the characters of the
    training words), in creation order; a smaller vocabulary takes a prefix."""
    words_counts = _training_words()
    pieces: list[str] = []
    known: set[str] = set()
    for left, right in bpe_merges([list(word) for word, _ in words_counts], [count for _, count in words_counts]):
        merged = left + right
        if merged not in known:
            known.add(merged)
            pieces.append(merged)
    return tuple(pieces)


@functools.lru_cache(maxsize=8)
def spm_vocab(n_vocab: int) -> SpmVocab:
    """The SPM vocabulary of exactly ``n_vocab`` tokens (special, byte, merged and character pieces)."""
    chars = _required_chars()
    minimum = _N_FIXED + len(chars)
    if n_vocab < minimum:
        raise ConfigError(f"an SPM vocabulary needs at least {minimum} tokens, got {n_vocab}")
    merged = _merged_pieces()[: n_vocab - minimum]
    if len(merged) < n_vocab - minimum:
        raise ConfigError(
            f"the built-in corpus supplies at most {minimum + len(merged)} SPM tokens, {n_vocab} asked"
        )
    pieces = (*merged, *chars)
    tokens = (*SPECIAL_PIECES, *(f"<0x{b:02X}>" for b in range(256)), *pieces)
    scores = (0.0,) * _N_FIXED + tuple(-float(k + 1) for k in range(len(pieces)))
    t = gguf.TokenType
    types = (
        int(t.UNKNOWN),
        int(t.CONTROL),
        int(t.CONTROL),
        *(int(t.BYTE),) * 256,
        *(int(t.NORMAL),) * len(pieces),
    )
    return SpmVocab(tokens, scores, types, BOS_ID, EOS_ID, UNK_ID)


def spm_metadata(n_vocab: int) -> dict[str, Any]:
    """The tokenizer metadata of a converted Mixtral GGUF with ``spm_vocab(n_vocab)``.

    GGUF value types: ``tokens`` string array, ``scores`` float32 array, ``token_type`` int32 array,
    the ids uint32, the flags bool, the template a string (``gguf.GGUFWriter``'s ``add_token_list``,
    ``add_token_scores``, ``add_token_types``, ``add_bos_token_id``, ..., ``add_chat_template``).
    """
    v = spm_vocab(n_vocab)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.scores": list(v.scores),
        "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.bos_token_id": v.bos_id,
        "tokenizer.ggml.eos_token_id": v.eos_id,
        "tokenizer.ggml.unknown_token_id": v.unk_id,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": MIXTRAL_CHAT_TEMPLATE,
    }


def add_tokenizer_metadata(w: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    """Add SPM tokenizer keys (``spm_metadata``, or a variant of it) to ``w``, each with the GGUF type a
    converted Mixtral file gives it; ``KeyError`` for a key it has no writer for."""
    writers: dict[str, Callable[[Any], None]] = {
        "tokenizer.ggml.model": w.add_tokenizer_model,
        "tokenizer.ggml.tokens": w.add_token_list,
        "tokenizer.ggml.scores": w.add_token_scores,
        "tokenizer.ggml.token_type": w.add_token_types,
        "tokenizer.ggml.bos_token_id": w.add_bos_token_id,
        "tokenizer.ggml.eos_token_id": w.add_eos_token_id,
        "tokenizer.ggml.unknown_token_id": w.add_unk_token_id,
        "tokenizer.ggml.add_bos_token": w.add_add_bos_token,
        "tokenizer.ggml.add_eos_token": w.add_add_eos_token,
        "tokenizer.ggml.add_space_prefix": w.add_add_space_prefix,
        "tokenizer.chat_template": w.add_chat_template,
    }
    for key, value in meta.items():
        if key not in writers:
            raise KeyError(f"no writer for {key}")
        writers[key](value)
