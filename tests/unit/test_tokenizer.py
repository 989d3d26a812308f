"""swarm.text.tokenizer: llama.cpp's tokenisation of the golden GGUF, pre-tokenizer rules, decoding, streaming."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import gguf
import pytest

from swarm.errors import TokenizerError
from swarm.text.tokenizer import StreamDecoder, Tokenizer

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden"
GGUF_PATH = GOLDEN / "qwen3moe-tiny-f32.gguf"
LLAMACPP = json.loads((GOLDEN / "qwen3moe-tiny-f32.llamacpp.json").read_text(encoding="utf-8"))


@functools.cache
def golden_fields() -> dict[str, Any]:
    reader = gguf.GGUFReader(GGUF_PATH)
    return {k: f.contents() for k, f in reader.fields.items()}


@functools.cache
def golden() -> Tokenizer:
    return Tokenizer.from_gguf_fields(golden_fields())


# -- golden: llama.cpp's own tokenisation ------------------------------------------------------


def test_golden_fixture_covers_both_special_modes() -> None:
    cases = LLAMACPP["tokenize"]
    assert {c["special"] for c in cases} == {True, False}
    assert len(cases) >= 10


@pytest.mark.parametrize(
    "case", LLAMACPP["tokenize"], ids=lambda c: f"{c['text'][:24]!r}-special={c['special']}"
)
def test_encode_matches_llamacpp(case: dict[str, Any]) -> None:
    ids = golden().encode(case["text"], parse_special=case["special"], add_bos=False)
    assert ids == case["ids"]


@pytest.mark.parametrize(
    "case", LLAMACPP["tokenize"], ids=lambda c: f"{c['text'][:24]!r}-special={c['special']}"
)
def test_decode_round_trips_llamacpp_ids(case: dict[str, Any]) -> None:
    assert golden().decode(case["ids"]) == case["text"]


@pytest.mark.parametrize("case", LLAMACPP["greedy"], ids=lambda c: c["prompt"][:24])
def test_decode_invalid_utf8_like_llamacpp(case: dict[str, Any]) -> None:
    # Random weights produce broken UTF-8; llama.cpp's detokenisation has U+FFFD where we must too.
    text = golden().decode(case["greedy_ids"])
    assert "\ufffd" in text
    assert text == case["greedy_text"]


def test_golden_metadata() -> None:
    tok = golden()
    assert tok.vocab_size == LLAMACPP["n_vocab"] == 387
    assert tok.pre == "qwen2"
    assert tok.add_bos is False
    assert tok.bos_id == 384 and tok.token_text(384) == "<|endoftext|>"
    assert tok.eos_id == 386 and tok.token_text(386) == "<|im_end|>"
    assert tok.pad_id == 384
    assert tok.eot_ids == {384, 386}  # <|im_start|> does not end generation
    assert tok.special_ids == {384, 385, 386}
    assert tok.token_id("<|im_start|>") == 385
    assert tok.token_id("no such token") is None


def test_parse_special_switch() -> None:
    tok = golden()
    text = "<|im_start|>user"
    assert tok.encode(text)[0] == 385
    plain = tok.encode(text, parse_special=False)
    assert 385 not in plain
    assert tok.decode(plain) == text


def test_add_bos_follows_gguf_unless_overridden() -> None:
    tok = golden()
    assert tok.encode("Hello") == tok.encode("Hello", add_bos=False)
    assert tok.encode("Hello", add_bos=True) == [384, *tok.encode("Hello")]
    assert tok.encode("", add_bos=True) == [384]
    assert tok.encode("") == []


def test_token_bytes_undoes_the_byte_map() -> None:
    tok = golden()
    the = tok.token_id("Ġthe")
    assert the is not None
    assert tok.token_bytes(the) == b" the"
    assert tok.token_bytes(tok.encode("\n")[0]) == b"\n"
    assert tok.token_bytes(386) == b"<|im_end|>"
    # one of the 256 byte tokens that is not valid UTF-8 on its own
    [lead] = tok.encode("日")[:1]
    assert tok.token_bytes(lead) == "日".encode()[:1]


def test_decode_skip_special() -> None:
    tok = golden()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.decode(ids, skip_special=True) == "user\nhi\n"


@pytest.mark.parametrize("bad", [-1, 387, 10**9, "3"])
def test_decode_rejects_ids_outside_vocab(bad: Any) -> None:
    with pytest.raises(TokenizerError) as info:
        golden().decode([1, bad])
    assert info.value.code == "invalid_token_id"


def test_encode_rejects_lone_surrogates() -> None:
    with pytest.raises(TokenizerError) as info:
        golden().encode("a\ud800b")
    assert info.value.code == "invalid_text"


# -- streaming ---------------------------------------------------------------------------------


def test_stream_decoder_holds_back_split_utf8() -> None:
    tok = golden()
    ids = tok.encode("日本")
    assert len(ids) == 6  # three byte tokens per character in this tiny vocab
    stream = StreamDecoder(tok)
    assert [stream.push(i) for i in ids] == ["", "", "日", "", "", "本"]
    assert stream.pending == b""
    assert stream.flush() == ""


def test_stream_decoder_flushes_incomplete_tail_as_replacement() -> None:
    tok = golden()
    ids = tok.encode("a日")
    stream = StreamDecoder(tok)
    out = [stream.push(i) for i in ids[:-1]]
    assert out == ["a", "", ""]
    assert stream.pending == "日".encode()[:2]
    assert stream.flush() == "\ufffd"
    assert tok.decode(ids[:-1]) == "a\ufffd"


def test_stream_decoder_invalid_byte_is_not_held_back() -> None:
    tok = golden()
    # a lone continuation byte can never become valid: it is replaced at once, as decode() would
    cont = tok.encode("日")[1]
    stream = StreamDecoder(tok)
    assert stream.push(cont) == "\ufffd"
    assert stream.push(tok.encode("x")[0]) == "x"


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_decoder_equals_decode(skip_special: bool) -> None:
    tok = golden()
    rng = random.Random(20240601)
    sequences = [c["greedy_ids"] for c in LLAMACPP["greedy"]]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(64)] for _ in range(50)]
    for ids in sequences:
        stream = StreamDecoder(tok, skip_special=skip_special)
        text = "".join(stream.push(i) for i in ids) + stream.flush()
        assert text == tok.decode(ids, skip_special=skip_special)


# -- synthetic vocabularies: the pre-tokenizer rules llama.cpp applies -------------------------
# The expected ids below were derived by hand from llama.cpp's regexes and then checked against
# llama.cpp itself (llama-cpp-python 0.3.36, vocab_only) on GGUFs written from these same fields.


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table, written out independently of swarm.text.tokenizer."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE = _byte_chars()


def make_fields(
    *,
    pre: str | None = "qwen2",
    merges: tuple[str, ...] = (),
    normal: tuple[str, ...] = (),
    control: tuple[str, ...] = (),
    user_defined: tuple[str, ...] = (),
    model: str = "gpt2",
    bos: int | None = None,
    add_bos: bool | None = None,
) -> dict[str, Any]:
    """Ids: byte b -> b; then each merge result in order (256, 257, ...); then normal, control, user."""
    tokens = list(BYTE)
    for m in merges:
        left, right = m.split(" ")
        tokens.append(left + right)
    tokens += normal
    types = [1] * len(tokens) + [3] * len(control) + [4] * len(user_defined)
    tokens += control
    tokens += user_defined
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
    }
    if pre is not None:
        fields["tokenizer.ggml.pre"] = pre
    if bos is not None:
        fields["tokenizer.ggml.bos_token_id"] = bos
    if add_bos is not None:
        fields["tokenizer.ggml.add_bos_token"] = add_bos
    return fields


def ascii_ids(text: str) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("qwen2", ascii_ids("4123")),  # \p{N}: every digit alone, so no merge can apply
        ("llama-bpe", [257, 51]),  # \p{N}{1,3}: "412" "3"
        ("gpt-2", [258]),  # " ?\p{N}+": "4123" is one piece
        ("default", [257, 51]),  # GPT-2's regex, then split into runs of three digits: "412" "3"
    ],
)
def test_digit_splitting(pre: str, expected: list[int]) -> None:
    # merge results: 256 "41", 257 "412", 258 "4123"
    tok = Tokenizer.from_gguf_fields(make_fields(pre=pre, merges=("4 1", "41 2", "412 3"), add_bos=False))
    assert tok.encode("4123") == expected


def test_default_splits_runs_of_three_digits_where_gpt2_does_not() -> None:
    merges = ("1 2", "12 3", "4 1")
    gpt2 = Tokenizer.from_gguf_fields(make_fields(pre="gpt-2", merges=merges))
    default = Tokenizer.from_gguf_fields(make_fields(pre="default", merges=merges))
    # gpt2: one piece "4123" -> "1 2" (rank 0) wins over "4 1", then "12 3": [4, 123]
    assert gpt2.encode("4123") == [52, 257]
    # default: "412" | "3" -> "1 2" first, then nothing: [4, 12, 3]
    assert default.encode("4123") == [52, 256, 51]


def test_default_isolates_punctuation_runs() -> None:
    merges = ("Ġ ,",)
    assert Tokenizer.from_gguf_fields(make_fields(pre="gpt-2", merges=merges)).encode(" ,") == [256]
    assert Tokenizer.from_gguf_fields(make_fields(pre="default", merges=merges)).encode(" ,") == [32, 44]


def test_missing_pre_means_default() -> None:
    tok = Tokenizer.from_gguf_fields(make_fields(pre=None, merges=("Ġ ,",)))
    assert tok.pre == "default"
    assert tok.encode(" ,") == [32, 44]


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        ("qwen2", "'Sx", [256, 120]),  # '[sS] matches before [^\r\n\p{L}\p{N}]?\p{L}+ could take "'Sx"
        ("qwen2", "'sx", [258, 120]),
        ("gpt-2", "'Sx", [39, 83, 120]),  # GPT-2's contractions are lower-case only: "'" "Sx"
        ("gpt-2", "'sx", [258, 120]),
    ],
)
def test_contractions(pre: str, text: str, expected: list[int]) -> None:
    # merge results: 256 "'S", 257 "'Sx", 258 "'s", 259 "'sx"
    tok = Tokenizer.from_gguf_fields(make_fields(pre=pre, merges=("' S", "'S x", "' s", "'s x")))
    assert tok.encode(text) == expected


def test_whitespace_before_word_is_split_off() -> None:
    # \s+(?!\S): of three spaces before "b", two stand alone and one joins the word
    tok = Tokenizer.from_gguf_fields(make_fields(merges=("Ġ Ġ", "Ġ b", "ĠĠ Ġ")))
    assert tok.encode("a   b") == [97, 256, 257]
    assert tok.encode("a   ") == [97, 258]


@pytest.mark.parametrize(("pre", "expected"), [("llama-bpe", [258]), ("qwen2", [256, 99])])
def test_llama3_ignores_merges_for_whole_vocab_words(pre: str, expected: list[int]) -> None:
    # "abc" is in the vocab but no merge sequence builds it: llama3 looks whole pre-tokens up first
    tok = Tokenizer.from_gguf_fields(
        make_fields(pre=pre, merges=("a b", "b c"), normal=("abc",), add_bos=False)
    )
    assert tok.encode("abc") == expected


def test_llama3_adds_bos_by_default() -> None:
    tok = Tokenizer.from_gguf_fields(make_fields(pre="llama-bpe", control=("<s>",), bos=256))
    assert tok.add_bos is True
    assert tok.encode("a") == [256, 97]
    assert tok.encode("a", add_bos=False) == [97]
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf_fields(make_fields(pre="llama-bpe"))  # add_bos but no bos id


def test_special_partition_longest_first_and_user_defined_always() -> None:
    # ids: control "abc" = 256, user-defined "ab" = 257
    tok = Tokenizer.from_gguf_fields(make_fields(control=("abc",), user_defined=("ab",)))
    assert tok.encode("xabcxab") == [120, 256, 120, 257]
    # control tokens are plain text without parse_special; user-defined ones are still cut out
    assert tok.encode("xabcxab", parse_special=False) == [120, 257, 99, 120, 257]
    assert tok.special_ids == {256}
    # user-defined tokens render even with skip_special; control tokens do not
    assert tok.decode([256, 257], skip_special=True) == "ab"
    assert tok.decode([256, 257]) == "abcab"


def test_end_of_generation_text_is_control_even_if_typed_normal() -> None:
    tok = Tokenizer.from_gguf_fields(make_fields(normal=("<|im_end|>", "<|eot_id|>", "<|im_start|>")))
    im_end, eot, im_start = 256, 257, 258
    assert tok.eot_ids == {im_end, eot}
    assert tok.special_ids == {im_end, eot}
    assert tok.encode("a<|im_end|>") == [97, im_end]
    assert im_end not in tok.encode("a<|im_end|>", parse_special=False)
    assert tok.encode("<|im_start|>") != [im_start]  # a normal token is never cut out of text


# -- errors ------------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_names_the_supported_ones() -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_fields(make_fields(pre="tekken"))
    assert info.value.code == "unsupported_tokenizer"
    for name in ("'tekken'", "qwen2", "llama-bpe", "default", "gpt-2"):
        assert name in info.value.message


def test_gpt2_is_spelled_gpt_dash_2() -> None:
    # llama.cpp itself refuses a GGUF whose pre-tokenizer is "gpt2", so we do too, with a hint
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_fields(make_fields(pre="gpt2"))
    assert "'gpt-2'" in info.value.message


@pytest.mark.parametrize("model", ["rwkv", "bert", "t5"])
def test_unknown_tokenizer_model_names_the_supported_one(model: str) -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_fields(make_fields(model=model))
    assert info.value.code == "unsupported_tokenizer"
    assert repr(model) in info.value.message and "gpt2" in info.value.message


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda f: f.pop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
        (lambda f: f.pop("tokenizer.ggml.model"), "tokenizer.ggml.model"),
        (lambda f: f.__setitem__("tokenizer.ggml.token_type", [1, 1]), "token_type"),
        (lambda f: f.__setitem__("tokenizer.ggml.merges", ["ab"]), "'ab'"),
        (lambda f: f.__setitem__("tokenizer.ggml.merges", ["a b"]), "'a b'"),  # "ab" not in vocab
        (lambda f: f.__setitem__("tokenizer.ggml.eos_token_id", 9999), "eos_token_id"),
        (lambda f: f.__setitem__("tokenizer.ggml.pre", 3), "tokenizer.ggml.pre"),
    ],
)
def test_malformed_metadata(mutate: Any, fragment: str) -> None:
    fields = make_fields()
    mutate(fields)
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_fields(fields)
    assert fragment in info.value.message
