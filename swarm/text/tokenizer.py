"""Tokenizers built from a GGUF's metadata (pure: no I/O, no clocks, no globals mutated).

Two of llama.cpp's vocabulary types are reproduced exactly, tokenisation and detokenisation:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE.
- ``tokenizer.ggml.model == "llama"``: SentencePiece (SPM), as in Llama-2, Mistral and Mixtral files.

Tokenisation:

1. Special-token partition (llama.cpp's ``tokenizer_st_partition``): control, unknown and user-defined
   tokens are cut out of the text first, longest token text first, each one splitting every remaining
   text fragment at all its (non-overlapping, leftmost-first) occurrences. With ``parse_special=False``
   control and unknown tokens are *not* cut out (their text is tokenised as plain text), but
   user-defined tokens still are, as in llama.cpp and HF ``tokenizers``. llama.cpp sets only one
   strip attribute on the tokenizers supported here: for a model whose ``general.name`` contains
   ``phi-3`` or ``phi3`` every partition token and ``</s>`` (except ``<unk>``, ``<s>``,
   ``<|endoftext|>``) eats the whitespace after it (RSTRIP).
2. BPE: each remaining fragment goes through the pre-tokenizer regexes llama.cpp uses for the GGUF's
   ``tokenizer.ggml.pre`` (applied in sequence, each one splitting the pieces of the previous one),
   GPT-2's byte-to-unicode mapping, then BPE merges by rank (``tokenizers`` does this step).
   Supported ``tokenizer.ggml.pre`` names: see ``SUPPORTED_PRE_TOKENIZERS``; a missing one means
   ``default``, as in llama.cpp.
3. SPM (llama.cpp's ``llm_tokenizer_spm_session``): a text fragment that comes first or right after a
   special token gets a leading space when ``tokenizer.ggml.add_space_prefix`` (default true); spaces
   become U+2581 "▁"; the fragment's characters are merged pairwise, always the adjacent pair whose
   concatenation is the vocabulary token with the highest score (``tokenizer.ggml.scores``; ties: the
   leftmost pair); a final piece not in the vocabulary falls back to its UTF-8 bytes as ``<0xXX>``
   tokens. Where llama.cpp would abort (a byte with no ``<0xXX>`` token) the unknown token is used,
   as SentencePiece does.
4. ``add_bos``/``add_eos`` (``tokenizer.ggml.add_bos_token``/``add_eos_token``; SPM: true/false,
   BPE: per pre-tokenizer/false) put bos first and eos last.

Step 1 is done here rather than with ``tokenizers``' added tokens: those match leftmost-longest rather
than longest-token-first, and their parse-special switch is a mutable flag on the shared object.

Rules:
- Built once from a plain ``dict`` of GGUF fields; immutable afterwards, so one instance can be shared
  across threads.
- Anything unsupported (tokenizer model, pre-tokenizer name) or malformed fails at construction with a
  ``TokenizerError`` that names what is supported or what is wrong.
- Decoding is bytes first, as llama.cpp's ``token_to_piece``: ``token_bytes`` gives each token's raw
  bytes (BPE normal tokens through the inverse byte map; SPM normal tokens with "▁" as a space, SPM
  byte tokens as their byte, unused/undefined SPM tokens as nothing; control, unknown and
  user-defined tokens as their UTF-8 text); ``decode`` joins them and replaces invalid UTF-8 with
  U+FFFD. Like llama.cpp's ``llama_detokenize`` (with ``remove_special`` off), when
  ``add_space_prefix`` is on one leading space of the *first* token's piece is dropped, whatever that
  token is, unless the ids are a ``continuation`` of earlier ones.
- ``StreamDecoder`` is exact: the concatenation of everything it returns (including ``flush()``)
  equals ``decode`` of the same ids.
- As in llama.cpp, tokens whose text marks end of generation (``<|im_end|>``, ``<|endoftext|>``,
  ``<|eot_id|>``, ...) are treated as control tokens even if the GGUF types them otherwise.
"""

from __future__ import annotations

import codecs
import functools
import heapq
import math
import operator
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _hf_models
from tokenizers import pre_tokenizers as _hf_pre

from swarm.errors import TokenizerError

__all__ = [
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE_TOKENIZERS",
    "StreamDecoder",
    "TokenType",
    "Tokenizer",
]


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SUPPORTED_MODELS: tuple[str, ...] = ("gpt2", "llama")
_MODEL_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}


@dataclass(frozen=True, slots=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool  # llama3: a pre-token that is itself in the vocab skips the merges
    default_add_bos: bool  # used when the GGUF has no tokenizer.ggml.add_bos_token


# The regexes are llama.cpp's (src/llama-vocab.cpp, llm_tokenizer_bpe), which spell the
# case-insensitive contractions of the HF originals as explicit character classes.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as llama3 except that digits are split one by one.
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = _PreTokenizer(
    regexes=(r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    ignore_merges=False,
    default_add_bos=False,
)
_GPT2 = _PreTokenizer(regexes=(_GPT2_RE,), ignore_merges=False, default_add_bos=False)
_LLAMA3 = _PreTokenizer(regexes=(_LLAMA3_RE,), ignore_merges=True, default_add_bos=True)
_QWEN2 = _PreTokenizer(regexes=(_QWEN2_RE,), ignore_merges=False, default_add_bos=False)
# gpt-oss / GPT-4o (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O: its rewrite of o200k's case-insensitive groups)
_GPT4O_RE = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = _PreTokenizer(regexes=(_GPT4O_RE,), ignore_merges=False, default_add_bos=False)
# DeepSeek-V2 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM), applied in sequence; llama.cpp matches
# "\s+$" with std::regex, where "$" is the end of the fragment: "\z" here (Oniguruma's "$" is a line end)
_DEEPSEEK_LLM = _PreTokenizer(
    regexes=(
        "[\r\n]",
        ("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
         "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
         "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
         "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
         "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
         "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
         "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
         "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
         "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
         "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
         "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"),
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+\\z",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ),
    ignore_merges=False,
    default_add_bos=False,
)

# tokenizer.ggml.pre names, spelled as llama.cpp spells them. Note "gpt-2", not "gpt2": llama.cpp
# (as of llama-cpp-python 0.3.36) refuses to load a GGUF whose pre-tokenizer is "gpt2".
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT,
    "gpt-2": _GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "olmo": _GPT2,  # llama.cpp: LLAMA_VOCAB_PRE_TYPE_OLMO shares GPT-2's regex
    "deepseek-llm": _DEEPSEEK_LLM,
    "gpt-4o": _GPT4O,
}
SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZERS))

# llama.cpp decides end-of-generation tokens by their text (llama-vocab.cpp, special_eog_ids).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)

_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
_PARTITION_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED})

# llama.cpp's default special ids for SPM vocabularies (used when the GGUF has no such key)
_SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unk": 0}
# llama.cpp (llama_vocab::load, "set attributes by model name"): phi-3 special tokens eat the
# whitespace after them, except these.
_PHI3_NAMES = ("phi-3", "phi3")
_PHI3_NOT_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})
_C_SPACE = " \t\n\v\f\r"  # C's isspace() in the "C" locale

_SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space
_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_bytes(text: str) -> bytes:
    # A character outside GPT-2's byte map cannot come out of the byte-level pre-tokenizer; if a vocab
    # has one anyway we keep its UTF-8 rather than failing (llama.cpp prints an "[UNK_BYTE_..]" marker).
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            out += ch.encode("utf-8", "surrogatepass")
        else:
            out.append(b)
    return bytes(out)


def _field(fields: Mapping[str, Any], key: str, kind: type, *, required: bool = False) -> Any:
    if key not in fields:
        if required:
            raise TokenizerError(f"GGUF metadata has no {key!r}", code="tokenizer_missing_field")
        return None
    value = fields[key]
    if kind is int:
        try:
            return operator.index(value)
        except TypeError:
            pass
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is list and isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise TokenizerError(
        f"GGUF metadata {key!r} should be {kind.__name__}, got {type(value).__name__}",
        code="tokenizer_bad_field",
    )


def _float32(value: Any, index: int) -> float:
    """A score as llama.cpp holds it (a C float); GGUF int32 scores are allowed, as in llama.cpp."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)  # numpy scalars
        except (TypeError, ValueError):
            raise TokenizerError(
                f"tokenizer.ggml.scores[{index}] should be a number, got {type(value).__name__}",
                code="tokenizer_bad_field",
            ) from None
    f = float(value)
    if math.isnan(f):
        raise TokenizerError(f"tokenizer.ggml.scores[{index}] is NaN", code="tokenizer_bad_field")
    try:
        return float(struct.unpack("<f", struct.pack("<f", f))[0])
    except OverflowError:
        return math.copysign(math.inf, f)


def _spm_pieces(text: str, token_to_id: Mapping[str, int], scores: Sequence[float]) -> list[str]:
    """llama.cpp's ``llm_tokenizer_spm_session::tokenize`` on one escaped fragment: its final pieces.

    Symbols start as single characters; the adjacent pair whose concatenation is a token with the
    highest score is merged first (ties: the leftmost pair), until no adjacent pair forms a token.
    Every merged piece is a token by construction; a piece that is not is a single character.
    (llama.cpp's ``rev_merge`` re-segmentation is never reached for that reason, so it is left out.)
    """
    n = len(text)
    if n == 0:
        return []
    # symbol i starts at character i (a merge extends the left symbol over the right one)
    length = [1] * n  # in characters; 0 once merged into the symbol on the left
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[float, int, int, int]] = []

    def try_add(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        size = length[left] + length[right]
        tid = token_to_id.get(text[left : left + size])
        if tid is not None:
            heapq.heappush(heap, (-scores[tid], left, right, size))

    for i in range(1, n):
        try_add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        # a pair one of whose symbols has changed since it was queued is stale
        if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
            continue
        length[left] = size
        length[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add(prev[left], left)
        try_add(left, nxt[left])
    out: list[str] = []
    i = 0
    while i != -1:
        out.append(text[i : i + length[i]])
        i = nxt[i]
    return out


@dataclass(frozen=True, slots=True)
class _Special:
    """A token cut out of the text by the partition step."""

    text: str
    token_id: int
    lstrip: bool  # eat the whitespace before it
    rstrip: bool  # eat the whitespace after it


class Tokenizer:
    """A llama.cpp-compatible tokenizer (byte-level BPE or SentencePiece); build it with ``from_gguf_fields``."""

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        token_types: Sequence[int],
        bos_id: int | None,
        eos_id: int | None,
        model: str = "gpt2",
        merges: Sequence[str] = (),
        pre: str = "default",
        scores: Sequence[float] | None = None,
        pad_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
        general_name: str | None = None,
    ) -> None:
        if model not in SUPPORTED_MODELS:
            supported = ", ".join(f"{m} ({_MODEL_KINDS[m]})" for m in SUPPORTED_MODELS)
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}; supported: {supported}", code="unsupported_tokenizer"
            )
        spm = model == "llama"
        if not tokens:
            raise TokenizerError("the vocabulary is empty", code="tokenizer_bad_field")
        if len(token_types) != len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens",
                code="tokenizer_bad_field",
            )
        pre_tok = _DEFAULT if spm else _PRE_TOKENIZERS.get(pre)
        if pre_tok is None:
            hint = " (GPT-2's is spelled 'gpt-2')" if pre == "gpt2" else ""
            raise TokenizerError(
                f"unsupported pre-tokenizer {pre!r}{hint}; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}",
                code="unsupported_tokenizer",
            )
        n = len(tokens)
        # llama.cpp renames empty tokens so that every text is unique and non-empty.
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types: list[TokenType] = []
        for t in token_types:
            try:
                types.append(TokenType(t))
            except ValueError:
                types.append(TokenType.UNDEFINED)

        self._model = model
        self._pre_name = "default" if spm else pre
        self._texts: tuple[str, ...] = tuple(texts)
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(texts)}  # last one wins, as llama.cpp
        eog = {i for i, t in enumerate(texts) if t in _EOG_TEXTS}
        for i in eog:
            if types[i] not in _SPECIAL_TYPES:
                types[i] = TokenType.CONTROL
        self._types: tuple[TokenType, ...] = tuple(types)

        def check(name: str, tid: int | None) -> int | None:
            if tid is None:
                return None
            if not 0 <= tid < n:
                raise TokenizerError(
                    f"{name} {tid} is outside the vocabulary (size {n})", code="tokenizer_bad_field"
                )
            return tid

        self._bos_id = check("bos_token_id", bos_id)
        self._eos_id = check("eos_token_id", eos_id)
        self._pad_id = check("padding_token_id", pad_id)
        self._unk_id = check("unknown_token_id", unk_id)
        for extra in (check("eot_token_id", eot_id), check("eom_token_id", eom_id), self._eos_id):
            if extra is not None:
                eog.add(extra)
        self._eot_ids = frozenset(eog)
        self._add_bos = (True if spm else pre_tok.default_add_bos) if add_bos is None else add_bos
        self._add_eos = False if add_eos is None else add_eos
        # llama.cpp reads add_space_prefix for every vocabulary type; only SPM tokenisation adds the
        # space, but detokenisation removes it for any type
        self._add_space_prefix = spm if add_space_prefix is None else add_space_prefix
        for flag, tid, what in ((self._add_bos, self._bos_id, "bos"), (self._add_eos, self._eos_id, "eos")):
            if flag and tid is None:
                raise TokenizerError(
                    f"add_{what}_token is set but there is no {what}_token_id", code="tokenizer_bad_field"
                )

        self._special_ids = frozenset(i for i, t in enumerate(self._types) if t in _SPECIAL_TYPES)
        name = (general_name or "").lower()
        rstrip_all = any(p in name for p in _PHI3_NAMES)
        # Longest text (in UTF-8 bytes, as llama.cpp) first; ties by id so the order is deterministic
        # (llama.cpp's sort is unstable).
        partition = sorted(
            (i for i, t in enumerate(self._types) if t in _PARTITION_TYPES),
            key=lambda i: (-len(texts[i].encode("utf-8", "surrogatepass")), i),
        )
        specials = [
            _Special(texts[i], i, lstrip=False, rstrip=rstrip_all and texts[i] not in _PHI3_NOT_RSTRIP)
            for i in partition
        ]
        self._partition_all: tuple[_Special, ...] = tuple(specials)
        self._partition_user: tuple[_Special, ...] = tuple(
            s for s in specials if self._types[s.token_id] is TokenType.USER_DEFINED
        )

        if spm:
            self._bytes = self._spm_pieces_bytes()
            if scores is None:
                self._scores: tuple[float, ...] = (0.0,) * n  # llama.cpp: no scores, all 0
            else:
                if len(scores) < n:
                    raise TokenizerError(
                        f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens",
                        code="tokenizer_bad_field",
                    )
                self._scores = tuple(_float32(s, i) for i, s in enumerate(scores[:n]))
            # byte fallback as llama.cpp's byte_to_token: "<0xXX>", else the byte itself as a token
            byte_ids: list[int | None] = []
            for b in range(256):
                tid = self._token_to_id.get(f"<0x{b:02X}>")
                if tid is None and b < 0x80:
                    tid = self._token_to_id.get(chr(b))
                byte_ids.append(tid)
            self._byte_ids: tuple[int | None, ...] = tuple(byte_ids)
            self._hf: _HFTokenizer | None = None
        else:
            self._bytes = tuple(
                texts[i].encode("utf-8", "surrogatepass")
                if self._types[i] in _PARTITION_TYPES
                else _byte_level_bytes(texts[i])
                for i in range(n)
            )
            self._scores = ()
            self._byte_ids = ()
            self._hf = self._build_bpe(merges, pre_tok)

    def _spm_pieces_bytes(self) -> tuple[bytes, ...]:
        # llama.cpp's token_to_piece for SPM (with special tokens rendered)
        out: list[bytes] = []
        for i, (text, ttype) in enumerate(zip(self._texts, self._types, strict=True)):
            if ttype in _PARTITION_TYPES:
                out.append(text.encode("utf-8", "surrogatepass"))
            elif ttype is TokenType.NORMAL:
                out.append(text.replace(_SPM_SPACE, " ").encode("utf-8", "surrogatepass"))
            elif ttype is TokenType.BYTE:
                m = _BYTE_TOKEN_RE.fullmatch(text)
                if m is None:
                    raise TokenizerError(
                        f"token {i} is of type BYTE but its text {text!r} is not of the form <0xXX>",
                        code="tokenizer_bad_field",
                    )
                out.append(bytes([int(m.group(1), 16)]))
            else:  # UNUSED, UNDEFINED: llama.cpp renders nothing
                out.append(b"")
        return tuple(out)

    def _build_bpe(self, merges: Sequence[str], pre_tok: _PreTokenizer) -> _HFTokenizer:
        vocab = self._token_to_id
        pairs: list[tuple[str, str]] = []
        for rank, m in enumerate(merges):
            # llama.cpp splits at the first space after the first character.
            pos = m.find(" ", 1)
            left, right = m[:pos], m[pos + 1 :]
            # tokenizers panics (PanicException, a BaseException) on a merge whose result is not in the
            # vocabulary, so every merge is checked here; converted models never have one.
            if pos < 0 or left not in vocab or right not in vocab or left + right not in vocab:
                raise TokenizerError(
                    f"merge {rank} {m!r} is malformed or names a token outside the vocabulary",
                    code="tokenizer_bad_field",
                )
            pairs.append((left, right))
        try:
            model = _hf_models.BPE(
                vocab=dict(vocab),
                merges=pairs,
                ignore_merges=pre_tok.ignore_merges,
                fuse_unk=False,
                byte_fallback=False,
            )
        except Exception as exc:  # tokenizers reports errors as plain Exception
            raise TokenizerError(f"cannot build the BPE model: {exc}", code="tokenizer_bad_field") from exc
        hf = _HFTokenizer(model)
        hf.pre_tokenizer = _hf_pre.Sequence(
            [
                *(_hf_pre.Split(Regex(r), behavior="isolated", invert=False) for r in pre_tok.regexes),
                _hf_pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        return hf

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata, e.g. ``{k: f.contents() for k, f in GGUFReader(p).fields.items()}``."""
        model = _field(fields, "tokenizer.ggml.model", str, required=True)
        if model not in SUPPORTED_MODELS:
            supported = ", ".join(f"{m} ({_MODEL_KINDS[m]})" for m in SUPPORTED_MODELS)
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}; supported: {supported}", code="unsupported_tokenizer"
            )
        spm = model == "llama"
        tokens = _field(fields, "tokenizer.ggml.tokens", list, required=True)
        if not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("tokenizer.ggml.tokens must be strings", code="tokenizer_bad_field")
        types = _field(fields, "tokenizer.ggml.token_type", list)
        if types is None:
            types = [TokenType.NORMAL] * len(tokens)
        try:
            types = [operator.index(t) for t in types]
        except TypeError as exc:
            raise TokenizerError(
                "tokenizer.ggml.token_type must be integers", code="tokenizer_bad_field"
            ) from exc
        merges: list[str] = []
        if not spm:
            merges = _field(fields, "tokenizer.ggml.merges", list, required=True)
            if not all(isinstance(m, str) for m in merges):
                raise TokenizerError("tokenizer.ggml.merges must be strings", code="tokenizer_bad_field")

        def special(key: str, default: str | None = None) -> int | None:
            tid: int | None = _field(fields, f"tokenizer.ggml.{key}_token_id", int)
            if tid is None and spm and default is not None:
                # llama.cpp's defaults for SPM; one outside the vocabulary is disabled
                tid = _SPM_DEFAULT_IDS[default]
                return tid if tid < len(tokens) else None
            return tid

        return cls(
            model=model,
            tokens=tokens,
            token_types=types,
            merges=merges,
            # llama.cpp falls back to 'default' when the key is missing (and ignores it for SPM)
            pre=_field(fields, "tokenizer.ggml.pre", str) or "default",
            scores=_field(fields, "tokenizer.ggml.scores", list) if spm else None,
            bos_id=special("bos", "bos"),
            eos_id=special("eos", "eos"),
            unk_id=special("unknown", "unk"),
            pad_id=special("padding"),
            eot_id=special("eot"),
            eom_id=special("eom"),
            add_bos=_field(fields, "tokenizer.ggml.add_bos_token", bool),
            add_eos=_field(fields, "tokenizer.ggml.add_eos_token", bool),
            add_space_prefix=_field(fields, "tokenizer.ggml.add_space_prefix", bool),
            general_name=_field(fields, "general.name", str),
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def model(self) -> str:
        """The tokenizer model (``tokenizer.ggml.model``): ``gpt2`` or ``llama``."""
        return self._model

    @property
    def pre(self) -> str:
        """The pre-tokenizer name (``tokenizer.ggml.pre``; ``default`` for SPM, which has none)."""
        return self._pre_name

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, eot/eom ids, and tokens with llama.cpp's end-of-generation texts."""
        return self._eot_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def add_space_prefix(self) -> bool:
        """SPM: a space is put before the first text fragment (and after every special token), and
        ``decode`` drops one leading space of the first token (any vocabulary type, as llama.cpp)."""
        return self._add_space_prefix

    @property
    def special_ids(self) -> frozenset[int]:
        """Control and unknown tokens: parsed only with ``parse_special``, dropped by ``skip_special``.

        User-defined tokens are not in this set: they are always parsed and always rendered.
        """
        return self._special_ids

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the GGUF (byte-level form for BPE, "▁" for spaces in SPM)."""
        return self._texts[self._check_id(token_id)]

    def token_type(self, token_id: int) -> TokenType:
        return self._types[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id whose stored text is exactly ``text`` (e.g. ``"<|im_end|>"``), or None."""
        return self._token_to_id.get(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (control tokens as their text; no leading space removed)."""
        return self._bytes[self._check_id(token_id)]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token covers (control tokens by their text): a text of ``n`` UTF-8 bytes
        has at least ``ceil(n / max_token_bytes)`` tokens -- a bound checked before tokenising."""
        return max(1, max((len(b) for b in self._bytes), default=1))

    # -- encode / decode -----------------------------------------------------------------------

    def encode(
        self, text: str, *, parse_special: bool = True, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        """Tokenise ``text`` exactly as llama.cpp's ``llama_tokenize``.

        ``parse_special=False`` tokenises control-token text such as ``<|im_start|>`` as plain text.
        ``add_bos``/``add_eos`` = None follow the GGUF's ``add_bos_token``/``add_eos_token`` (llama.cpp's
        ``add_special=True``; ``add_special=False`` is ``add_bos=False, add_eos=False``).
        """
        if add_bos is None:
            add_bos = self._add_bos
        if add_eos is None:
            add_eos = self._add_eos
        out: list[int] = []
        if add_bos:
            if self._bos_id is None:
                raise TokenizerError("add_bos requested but the vocabulary has no bos token")
            out.append(self._bos_id)
        if text:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise TokenizerError(f"text is not valid Unicode: {exc}", code="invalid_text") from exc
            specials = self._partition_all if parse_special else self._partition_user
            frags = self._partition(text, specials)
            if self._hf is None:
                self._encode_spm(frags, out)
            else:
                for piece in frags:
                    if isinstance(piece, int):
                        out.append(piece)
                    else:
                        out.extend(self._hf.encode(piece, add_special_tokens=False).ids)
        if add_eos:
            if self._eos_id is None:
                raise TokenizerError("add_eos requested but the vocabulary has no eos token")
            out.append(self._eos_id)
        return out

    def _encode_spm(self, frags: Iterable[str | int], out: list[int]) -> None:
        prev_special = True  # the first fragment is prefixed too
        for frag in frags:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self._add_space_prefix and prev_special:
                frag = " " + frag
            prev_special = False
            for piece in _spm_pieces(frag.replace(" ", _SPM_SPACE), self._token_to_id, self._scores):
                tid = self._token_to_id.get(piece)
                if tid is not None:
                    out.append(tid)
                    continue
                for b in piece.encode("utf-8"):
                    bid = self._byte_ids[b]
                    if bid is None:
                        bid = self._unk_id
                    if bid is None:
                        raise TokenizerError(
                            f"cannot encode {piece!r}: the vocabulary has no <0x{b:02X}> token and no unknown token",
                            code="invalid_text",
                        )
                    out.append(bid)

    @staticmethod
    def _partition(text: str, specials: Iterable[_Special]) -> list[str | int]:
        # llama.cpp's tokenizer_st_partition: for each special token (longest first), split every
        # remaining text fragment at its occurrences, left to right; the strip attributes eat the
        # whitespace beside a match before the search goes on. Empty fragments are dropped.
        frags: list[str | int] = [text]
        for sp in specials:
            stext = sp.text
            if not any(isinstance(f, str) and stext in f for f in frags):
                continue
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or stext not in f:
                    new.append(f)
                    continue
                rest = f
                while rest:
                    pos = rest.find(stext)
                    if pos < 0:
                        new.append(rest)
                        break
                    left = rest[:pos]
                    if sp.lstrip:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        new.append(left)
                    new.append(sp.token_id)
                    rest = rest[pos + len(stext) :]
                    if sp.rstrip:
                        rest = rest.lstrip(_C_SPACE)
            frags = new
        return frags

    def decode_bytes(
        self, ids: Iterable[int], *, skip_special: bool = False, continuation: bool = False
    ) -> bytes:
        """The concatenated raw bytes of ``ids`` (possibly invalid UTF-8), as llama.cpp's
        ``llama_detokenize(remove_special=False, unparse_special=not skip_special)``.

        With ``add_space_prefix`` one leading space of the first token's piece is dropped (a skipped
        special token still counts as the first); ``continuation=True`` says the ids follow earlier
        ones, so nothing is dropped.
        """
        parts: list[bytes] = []
        strip = self._add_space_prefix and not continuation
        for token_id in ids:
            tid = self._check_id(token_id)
            piece = b"" if skip_special and tid in self._special_ids else self._bytes[tid]
            if strip and piece[:1] == b" ":
                piece = piece[1:]
            strip = False
            parts.append(piece)
        return b"".join(parts)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False, continuation: bool = False) -> str:
        """Detokenise; invalid UTF-8 becomes U+FFFD. Control tokens render as their text unless
        ``skip_special``. The leading space rule is ``decode_bytes``'s. No other space clean-up is
        applied (llama.cpp's ``clean_spaces`` is off for qwen2 and SPM)."""
        return self.decode_bytes(ids, skip_special=skip_special, continuation=continuation).decode(
            "utf-8", "replace"
        )

    def _check_id(self, token_id: int) -> int:
        try:
            tid = operator.index(token_id)  # also accepts numpy integers
        except TypeError:
            tid = -1
        if not 0 <= tid < len(self._texts):
            raise TokenizerError(
                f"token id {token_id!r} is outside the vocabulary (size {len(self._texts)})",
                code="invalid_token_id",
            )
        return tid

    def __repr__(self) -> str:
        return f"Tokenizer(model={self._model!r}, pre={self._pre_name!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Incremental detokeniser: ``push`` ids one at a time, get back the text that is complete so far.

    Bytes of a UTF-8 sequence that is still incomplete are held back until the next token completes it
    (or ``flush`` turns them into U+FFFD). The first id pushed is decoded as ``decode`` decodes a first
    token (its leading space dropped when the vocabulary has ``add_space_prefix``), unless the stream
    is a ``continuation``. Invariant: ``"".join(pushes) + flush() == tok.decode(ids, continuation=c)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False, continuation: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._continuation = continuation
        self._started = continuation
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self._tok.decode_bytes((token_id,), skip_special=self._skip_special, continuation=self._started)
        self._started = True
        return self._dec.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back (incomplete sequences become U+FFFD) and reset, so
        the next push starts a new stream."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        self._started = self._continuation
        return out

    @property
    def pending(self) -> bytes:
        """The bytes held back, waiting for the rest of a UTF-8 sequence."""
        buffered, _ = self._dec.getstate()
        return buffered
