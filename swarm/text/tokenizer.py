"""Byte-level BPE tokenizer built from a GGUF's metadata (pure: no I/O, no clocks, no globals mutated).

The tokenizer reproduces llama.cpp's tokenisation of ``tokenizer.ggml.model == "gpt2"`` vocabularies:

1. Special-token partition (llama.cpp's ``tokenizer_st_partition``): control, unknown and user-defined
   tokens are cut out of the text first, longest token text first, each one splitting every remaining
   text fragment at all its (non-overlapping, leftmost-first) occurrences. With ``parse_special=False``
   control and unknown tokens are *not* cut out (their text is tokenised as plain text), but
   user-defined tokens still are, as in llama.cpp and HF ``tokenizers``.
2. Each remaining fragment goes through the pre-tokenizer regexes llama.cpp uses for the GGUF's
   ``tokenizer.ggml.pre`` (applied in sequence, each one splitting the pieces of the previous one),
   GPT-2's byte-to-unicode mapping, then BPE merges by rank (``tokenizers`` does this step).
   Supported ``tokenizer.ggml.pre`` names: see ``SUPPORTED_PRE_TOKENIZERS``; a missing one means
   ``default``, as in llama.cpp.

Step 1 is done here rather than with ``tokenizers``' added tokens: those match leftmost-longest rather
than longest-token-first, and their parse-special switch is a mutable flag on the shared object.

Rules:
- Built once from a plain ``dict`` of GGUF fields; immutable afterwards, so one instance can be shared
  across threads.
- Anything unsupported (tokenizer model, pre-tokenizer name) or malformed fails at construction with a
  ``TokenizerError`` that names what is supported.
- Decoding is bytes first: ``token_bytes`` gives each token's raw bytes (normal tokens through the
  inverse byte map, control/unknown/user-defined tokens as their UTF-8 text, like llama.cpp's
  ``token_to_piece``); ``decode`` joins them and replaces invalid UTF-8 with U+FFFD.
- ``StreamDecoder`` is exact: the concatenation of everything it returns (including ``flush()``)
  equals ``decode`` of the same ids.
- As in llama.cpp, tokens whose text marks end of generation (``<|im_end|>``, ``<|endoftext|>``,
  ``<|eot_id|>``, ...) are treated as control tokens even if the GGUF types them otherwise.
"""

from __future__ import annotations

import codecs
import functools
import operator
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


SUPPORTED_MODELS: tuple[str, ...] = ("gpt2",)


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


class Tokenizer:
    """A llama.cpp-compatible byte-level BPE tokenizer; build it with ``from_gguf_fields``."""

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool | None = None,
    ) -> None:
        if not tokens:
            raise TokenizerError("the vocabulary is empty", code="tokenizer_bad_field")
        if len(token_types) != len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens",
                code="tokenizer_bad_field",
            )
        pre_tok = _PRE_TOKENIZERS.get(pre)
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

        self._pre_name = pre
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
        for extra in (check("eot_token_id", eot_id), check("eom_token_id", eom_id), self._eos_id):
            if extra is not None:
                eog.add(extra)
        self._eot_ids = frozenset(eog)
        self._add_bos = pre_tok.default_add_bos if add_bos is None else add_bos
        if self._add_bos and self._bos_id is None:
            raise TokenizerError(
                "add_bos_token is set but there is no bos_token_id", code="tokenizer_bad_field"
            )

        self._special_ids = frozenset(i for i, t in enumerate(self._types) if t in _SPECIAL_TYPES)
        # Longest text first; ties by id so the order is deterministic (llama.cpp's sort is unstable).
        partition = sorted(
            (i for i, t in enumerate(self._types) if t in _PARTITION_TYPES), key=lambda i: (-len(texts[i]), i)
        )
        self._partition_all: tuple[tuple[str, int], ...] = tuple((texts[i], i) for i in partition)
        self._partition_user: tuple[tuple[str, int], ...] = tuple(
            (texts[i], i) for i in partition if self._types[i] is TokenType.USER_DEFINED
        )

        self._bytes: tuple[bytes, ...] = tuple(
            texts[i].encode("utf-8", "surrogatepass")
            if self._types[i] in _PARTITION_TYPES
            else _byte_level_bytes(texts[i])
            for i in range(n)
        )

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
        self._hf = hf

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata, e.g. ``{k: f.contents() for k, f in GGUFReader(p).fields.items()}``."""
        model = _field(fields, "tokenizer.ggml.model", str, required=True)
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}; supported: {', '.join(SUPPORTED_MODELS)} (byte-level BPE)",
                code="unsupported_tokenizer",
            )
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
        merges = _field(fields, "tokenizer.ggml.merges", list, required=True)
        if not all(isinstance(m, str) for m in merges):
            raise TokenizerError("tokenizer.ggml.merges must be strings", code="tokenizer_bad_field")
        # llama.cpp falls back to 'default' when the key is missing.
        pre = _field(fields, "tokenizer.ggml.pre", str) or "default"
        return cls(
            tokens=tokens,
            token_types=types,
            merges=merges,
            pre=pre,
            bos_id=_field(fields, "tokenizer.ggml.bos_token_id", int),
            eos_id=_field(fields, "tokenizer.ggml.eos_token_id", int),
            pad_id=_field(fields, "tokenizer.ggml.padding_token_id", int),
            eot_id=_field(fields, "tokenizer.ggml.eot_token_id", int),
            eom_id=_field(fields, "tokenizer.ggml.eom_token_id", int),
            add_bos=_field(fields, "tokenizer.ggml.add_bos_token", bool),
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def pre(self) -> str:
        """The pre-tokenizer name (``tokenizer.ggml.pre``)."""
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
    def eot_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, eot/eom ids, and tokens with llama.cpp's end-of-generation texts."""
        return self._eot_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def special_ids(self) -> frozenset[int]:
        """Control and unknown tokens: parsed only with ``parse_special``, dropped by ``skip_special``.

        User-defined tokens are not in this set: they are always parsed and always rendered.
        """
        return self._special_ids

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the GGUF (byte-level form for normal tokens)."""
        return self._texts[self._check_id(token_id)]

    def token_type(self, token_id: int) -> TokenType:
        return self._types[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id whose stored text is exactly ``text`` (e.g. ``"<|im_end|>"``), or None."""
        return self._token_to_id.get(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (control tokens as their text)."""
        return self._bytes[self._check_id(token_id)]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token covers (control tokens by their text): a text of ``n`` UTF-8 bytes
        has at least ``ceil(n / max_token_bytes)`` tokens -- a bound checked before tokenising."""
        return max(1, max((len(b) for b in self._bytes), default=1))

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Tokenise ``text`` exactly as llama.cpp's ``llama_tokenize`` (``add_special`` only adds bos).

        ``parse_special=False`` tokenises control-token text such as ``<|im_start|>`` as plain text.
        ``add_bos=None`` follows the GGUF's ``add_bos_token``.
        """
        if add_bos is None:
            add_bos = self._add_bos
        out: list[int] = []
        if add_bos:
            if self._bos_id is None:
                raise TokenizerError("add_bos requested but the vocabulary has no bos token")
            out.append(self._bos_id)
        if not text:
            return out
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"text is not valid Unicode: {exc}", code="invalid_text") from exc
        specials = self._partition_all if parse_special else self._partition_user
        for piece in self._partition(text, specials):
            if isinstance(piece, int):
                out.append(piece)
            else:
                out.extend(self._hf.encode(piece, add_special_tokens=False).ids)
        return out

    @staticmethod
    def _partition(text: str, specials: Iterable[tuple[str, int]]) -> list[str | int]:
        # llama.cpp's tokenizer_st_partition: for each special token (longest first), split every
        # remaining text fragment at all its occurrences. Empty fragments are dropped.
        frags: list[str | int] = [text]
        for stext, sid in specials:
            if not any(isinstance(f, str) and stext in f for f in frags):
                continue
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or stext not in f:
                    new.append(f)
                    continue
                parts = f.split(stext)
                for k, part in enumerate(parts):
                    if k:
                        new.append(sid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """The concatenated raw bytes of ``ids`` (possibly invalid UTF-8)."""
        parts: list[bytes] = []
        for token_id in ids:
            tid = self._check_id(token_id)
            if skip_special and tid in self._special_ids:
                continue
            parts.append(self._bytes[tid])
        return b"".join(parts)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Detokenise; invalid UTF-8 becomes U+FFFD. Control tokens render as their text unless
        ``skip_special``. No space clean-up is applied (llama.cpp's ``clean_spaces`` is off for qwen2)."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")

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
        return f"Tokenizer(pre={self._pre_name!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Incremental detokeniser: ``push`` ids one at a time, get back the text that is complete so far.

    Bytes of a UTF-8 sequence that is still incomplete are held back until the next token completes it
    (or ``flush`` turns them into U+FFFD). Invariant: ``"".join(pushes) + flush() == tok.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self._tok.decode_bytes((token_id,), skip_special=self._skip_special)
        return self._dec.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back (incomplete sequences become U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    @property
    def pending(self) -> bytes:
        """The bytes held back, waiting for the rest of a UTF-8 sequence."""
        buffered, _ = self._dec.getstate()
        return buffered
