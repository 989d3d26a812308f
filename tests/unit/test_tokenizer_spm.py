"""swarm.text.tokenizer on SentencePiece ("llama") vocabularies: llama.cpp's tokenisation and
detokenisation of the Mixtral-style golden (and of variants of its vocabulary), streaming, errors;
and the vocabulary builder swarm.tools.spm."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ConfigError, TokenizerError
from swarm.text.chat import render_chat
from swarm.text.tokenizer import StreamDecoder, Tokenizer, TokenType
from swarm.tools import spm
from swarm.tools.bpe import corpus

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden"
GGUF_PATH = GOLDEN / "mixtral-spm-tiny-f32.gguf"
LLAMACPP: dict[str, Any] = json.loads((GOLDEN / "mixtral-spm-tiny-f32.llamacpp.json").read_text(encoding="utf-8"))
VARIANTS: dict[str, dict[str, Any]] = {v["name"]: v for v in LLAMACPP["variants"]}


@functools.cache
def golden_fields() -> dict[str, Any]:
    reader = gguf.GGUFReader(GGUF_PATH)
    return {k: f.contents() for k, f in reader.fields.items()}


@functools.cache
def golden() -> Tokenizer:
    return Tokenizer.from_gguf_fields(golden_fields())


def variant_fields(name: str) -> dict[str, Any]:
    """The golden's metadata with a variant's overrides, applied as benchmarks/make_spm_golden.py does."""
    v = VARIANTS[name]
    fields = dict(golden_fields())
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    for old, (new, ttype) in v["retext"].items():
        i = tokens.index(old)
        tokens[i], types[i] = new, ttype
    for text, ttype in v["retype"].items():
        types[tokens.index(text)] = ttype
    fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"] = tokens, types
    fields.update(v["set"])
    for key in v["delete"]:
        del fields[key]
    return fields


@functools.cache
def variant(name: str) -> Tokenizer:
    return Tokenizer.from_gguf_fields(variant_fields(name))


def encode_like_llamacpp(tok: Tokenizer, case: dict[str, Any]) -> list[int]:
    # llama_tokenize(add_special=True) follows the GGUF's add_bos/add_eos; add_special=False adds neither
    flags: dict[str, bool] = {} if case["add_special"] else {"add_bos": False, "add_eos": False}
    return tok.encode(case["text"], parse_special=case["special"], **flags)


def case_id(case: dict[str, Any]) -> str:
    return f"{case['text'][:24]!r}-special={case['special']}-add={case['add_special']}"


def detok_id(case: dict[str, Any]) -> str:
    return str(case["ids"][:8])


# -- the fixture -------------------------------------------------------------------------------


def test_golden_fixture_is_thorough() -> None:
    cases = LLAMACPP["tokenize"]
    assert {(c["special"], c["add_special"]) for c in cases} == {(s, a) for s in (True, False) for a in (True, False)}
    texts = {c["text"] for c in cases}
    assert "" in texts and " " in texts and "\n" in texts
    assert any("\t" in t for t in texts) and any(ch.isdigit() for t in texts for ch in t)
    assert any("中" in t for t in texts) and any("🙂" in t for t in texts) and any("é" in t for t in texts)
    assert any("<s>" in t for t in texts) and any("</s>" in t for t in texts)
    byte_ids = {i for i, t in enumerate(golden_fields()["tokenizer.ggml.token_type"]) if t == TokenType.BYTE}
    assert any(byte_ids & set(c["ids"]) for c in cases)  # some text needed the byte fallback
    assert set(VARIANTS) >= {"no_space_prefix", "add_eos", "no_scores", "phi3_name", "token_types", "non_ascii_specials"}


def test_golden_metadata() -> None:
    tok, f = golden(), golden_fields()
    assert tok.model == "llama" and tok.pre == "default"
    assert tok.vocab_size == LLAMACPP["n_vocab"] == len(f["tokenizer.ggml.tokens"])
    assert (tok.unk_id, tok.bos_id, tok.eos_id) == (
        f["tokenizer.ggml.unknown_token_id"],
        f["tokenizer.ggml.bos_token_id"],
        f["tokenizer.ggml.eos_token_id"],
    )
    assert tok.add_bos is f["tokenizer.ggml.add_bos_token"] is True
    assert tok.add_eos is f["tokenizer.ggml.add_eos_token"] is False
    assert tok.add_space_prefix is True and "tokenizer.ggml.add_space_prefix" not in f  # the SPM default
    assert tok.eot_ids == {tok.eos_id}
    assert tok.special_ids == {tok.unk_id, tok.bos_id, tok.eos_id}
    assert tok.token_text(tok.bos_id) == "<s>" and tok.token_text(tok.eos_id) == "</s>"


def test_golden_vocabulary_is_swarm_tools_spm() -> None:
    f = golden_fields()
    vocab = spm.spm_vocab(LLAMACPP["n_vocab"])
    assert list(f["tokenizer.ggml.tokens"]) == list(vocab.tokens)
    assert [int(t) for t in f["tokenizer.ggml.token_type"]] == list(vocab.token_types)
    assert [float(s) for s in f["tokenizer.ggml.scores"]] == list(vocab.scores)


# -- llama.cpp's tokenisation ------------------------------------------------------------------


@pytest.mark.parametrize("case", LLAMACPP["tokenize"], ids=case_id)
def test_encode_matches_llamacpp(case: dict[str, Any]) -> None:
    assert encode_like_llamacpp(golden(), case) == case["ids"]


@pytest.mark.parametrize(
    ("name", "case"),
    [(v["name"], c) for v in LLAMACPP["variants"] for c in v["tokenize"]],
    ids=lambda x: x if isinstance(x, str) else case_id(x),
)
def test_encode_variants_match_llamacpp(name: str, case: dict[str, Any]) -> None:
    assert encode_like_llamacpp(variant(name), case) == case["ids"]


def test_variants_change_what_they_should() -> None:
    """Each variant's llama.cpp output differs from the golden's somewhere, so each tests something."""
    base = {(c["text"], c["special"], c["add_special"]): c["ids"] for c in LLAMACPP["tokenize"]}
    for v in LLAMACPP["variants"]:
        changed = [c for c in v["tokenize"] if base[(c["text"], c["special"], c["add_special"])] != c["ids"]]
        assert changed, v["name"]
    assert variant("no_space_prefix").add_space_prefix is False
    assert variant("add_eos").encode("a")[-1] == variant("add_eos").eos_id
    assert variant("no_bos_flag").add_bos is False


# -- llama.cpp's detokenisation ----------------------------------------------------------------


def check_detok(tok: Tokenizer, case: dict[str, Any]) -> None:
    # llama_detokenize(remove_special=False, unparse_special=True / False)
    assert tok.decode_bytes(case["ids"]).hex() == case["special_hex"]
    assert tok.decode_bytes(case["ids"], skip_special=True).hex() == case["plain_hex"]
    assert tok.decode(case["ids"]) == case["special"]
    assert tok.decode(case["ids"], skip_special=True) == case["plain"]


@pytest.mark.parametrize("case", LLAMACPP["detokenize"], ids=detok_id)
def test_decode_matches_llamacpp(case: dict[str, Any]) -> None:
    check_detok(golden(), case)


@pytest.mark.parametrize(
    ("name", "case"),
    [(v["name"], c) for v in LLAMACPP["variants"] for c in v["detokenize"]],
    ids=lambda x: x if isinstance(x, str) else detok_id(x),
)
def test_decode_variants_match_llamacpp(name: str, case: dict[str, Any]) -> None:
    check_detok(variant(name), case)


def test_detokenize_fixture_has_the_leading_space_cases() -> None:
    """The cases the leading-space rule turns on are in the fixture (and so tested above)."""
    tok = golden()
    firsts = {tok.token_text(c["ids"][0]) for c in LLAMACPP["detokenize"] if c["ids"]}
    assert {"<s>", "<unk>", "</s>", "<0x20>", "\u2581the"} <= firsts
    assert any(c["ids"] == [] for c in LLAMACPP["detokenize"])


@pytest.mark.parametrize("case", LLAMACPP["greedy"], ids=lambda c: c["prompt"][:24])
def test_decode_of_a_continuation(case: dict[str, Any]) -> None:
    tok = golden()
    prompt, gen = case["prompt_ids"], case["greedy_ids"]
    assert tok.decode(gen) == case["greedy_text"]
    full = tok.decode_bytes(prompt) + tok.decode_bytes(gen, continuation=True)
    assert full.hex() == case["full_text_hex"] == tok.decode_bytes(prompt + gen).hex()


# -- streaming ---------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], **kw: bool) -> list[str]:
    dec = StreamDecoder(tok, **kw)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("case", LLAMACPP["detokenize"], ids=detok_id)
def test_stream_matches_llamacpp_detokenize(case: dict[str, Any]) -> None:
    assert "".join(stream(golden(), case["ids"])) == case["special"]
    assert "".join(stream(golden(), case["ids"], skip_special=True)) == case["plain"]


def test_stream_drops_only_the_first_leading_space() -> None:
    tok = golden()
    the = tok.token_id("\u2581the")
    assert the is not None
    assert stream(tok, [the, the]) == ["the", " the", ""]
    assert stream(tok, [the, the], continuation=True) == [" the", " the", ""]
    dec = StreamDecoder(tok)
    assert dec.push(the) == "the"
    assert dec.flush() == ""
    assert dec.push(the) == "the"  # flush ended the stream: a new one starts


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    ids=st.lists(st.integers(0, LLAMACPP["n_vocab"] - 1), max_size=40),
    skip_special=st.booleans(),
    continuation=st.booleans(),
    name=st.sampled_from(["golden", "no_space_prefix", "token_types"]),
)
def test_stream_concatenation_equals_decode(ids: list[int], skip_special: bool, continuation: bool, name: str) -> None:
    tok = golden() if name == "golden" else variant(name)
    got = "".join(stream(tok, ids, skip_special=skip_special, continuation=continuation))
    assert got == tok.decode(ids, skip_special=skip_special, continuation=continuation)


# -- chat template -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", LLAMACPP["chat"], ids=lambda c: c["messages"][-1]["content"][:20])
def test_mixtral_chat_template_renders_like_llamacpp(case: dict[str, Any]) -> None:
    tok = golden()
    bos, eos = tok.token_text(tok.bos_id or 0), tok.token_text(tok.eos_id or 0)
    text = render_chat(golden_fields()["tokenizer.chat_template"], case["messages"], bos_token=bos, eos_token=eos)
    assert text == case["jinja_prompt"]  # llama-cpp-python's Jinja2ChatFormatter
    assert text == bos + case["llama_cpp_prompt"]  # llama.cpp's own (C++) rendering leaves bos to the tokenizer
    assert tok.encode(text) == case["jinja_prompt_ids"]


# -- rules and errors --------------------------------------------------------------------------


def test_missing_byte_token_falls_back_to_unk() -> None:
    # llama.cpp aborts here (byte_to_token's unordered_map::at); we use <unk>, as SentencePiece does
    fields = dict(golden_fields())
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    c3 = tokens.index("<0xC3>")
    tokens[c3], types[c3] = "no-longer-a-byte", int(TokenType.NORMAL)
    fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"] = tokens, types
    tok = Tokenizer.from_gguf_fields(fields)
    assert tok.encode("é", add_bos=False)[-2:] == [tok.unk_id, tokens.index("<0xA9>")]  # é is C3 A9
    # without an unknown token either (only possible when built directly): a clear error
    bare = Tokenizer(model="llama", tokens=tokens, token_types=types, bos_id=None, eos_id=None, add_bos=False)
    assert bare.unk_id is None
    with pytest.raises(TokenizerError, match="no <0xC3> token") as info:
        bare.encode("é")
    assert info.value.code == "invalid_text"


def test_default_special_ids_for_spm() -> None:
    fields = dict(golden_fields())
    for key in ("bos", "eos", "unknown"):
        del fields[f"tokenizer.ggml.{key}_token_id"]
    tok = Tokenizer.from_gguf_fields(fields)
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)  # llama.cpp's SPM defaults


def _with(**changes: Any) -> dict[str, Any]:
    fields = dict(golden_fields())
    for key, value in changes.items():
        name = "tokenizer.ggml." + key
        if value is None:
            fields.pop(name, None)
        else:
            fields[name] = value(fields[name]) if callable(value) else value
    return fields


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        (_with(scores=lambda s: list(s)[:10]), "tokenizer.ggml.scores has 10 entries for 1000 tokens"),
        (_with(scores=lambda s: [*list(s)[:5], "x", *list(s)[6:]]), "tokenizer.ggml.scores[5] should be a number"),
        (_with(scores=lambda s: [*list(s)[:7], float("nan"), *list(s)[8:]]), "tokenizer.ggml.scores[7] is NaN"),
        (_with(scores="not a list"), "'tokenizer.ggml.scores' should be list"),
        (_with(tokens=lambda t: [*list(t)[:3], "<0xZZ>", *list(t)[4:]]), "token 3 is of type BYTE"),
        (_with(token_type=lambda t: list(t)[:-1]), "token_type has 999 entries for 1000 tokens"),
        (_with(bos_token_id=5000), "bos_token_id 5000"),
        (_with(add_space_prefix="yes"), "tokenizer.ggml.add_space_prefix"),
        # eos defaults to id 2, outside this two-token vocabulary, so there is none
        (
            _with(add_eos_token=True, eos_token_id=None, tokens=["<unk>", "<s>"], token_type=[2, 3], scores=[0.0, 0.0]),
            "add_eos_token is set but there is no eos_token_id",
        ),
        (_with(tokens=None), "tokenizer.ggml.tokens"),
        (_with(model="bert"), "'bert'"),
    ],
)
def test_malformed_spm_metadata(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_fields(fields)
    assert fragment in info.value.message


def test_unsupported_model_names_both_supported_ones() -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_fields(_with(model="t5"))
    assert info.value.code == "unsupported_tokenizer"
    assert "gpt2" in info.value.message and "llama" in info.value.message


# -- swarm.tools.spm: the vocabulary builder ---------------------------------------------------


@pytest.mark.parametrize("n_vocab", [512, 2048, 8192])
def test_spm_vocab_layout(n_vocab: int) -> None:
    v = spm.spm_vocab(n_vocab)
    assert len(v.tokens) == len(v.scores) == len(v.token_types) == n_vocab == len(set(v.tokens))
    assert v.tokens[:3] == ("<unk>", "<s>", "</s>") and (v.unk_id, v.bos_id, v.eos_id) == (0, 1, 2)
    assert v.tokens[3:259] == tuple(f"<0x{b:02X}>" for b in range(256))
    t = gguf.TokenType
    assert v.token_types[:259] == (t.UNKNOWN, t.CONTROL, t.CONTROL, *(t.BYTE,) * 256)
    assert set(v.token_types[259:]) == {t.NORMAL}
    assert v.scores[:259] == (0.0,) * 259
    assert list(v.scores[259:]) == [-float(k) for k in range(1, n_vocab - 258)]
    pieces = set(v.tokens[259:])
    assert {chr(c) for c in range(0x21, 0x7F)} | {"\u2581"} | set(corpus()) - {" ", "\n"} <= pieces
    assert not any(" " in p for p in pieces)
    # words carry their "▁" in front, never behind
    assert "\u2581the" in pieces and not any(p.endswith("\u2581") and p.strip("\u2581") for p in pieces)


def test_spm_vocab_merges_are_shared_across_sizes() -> None:
    small, large = spm.spm_vocab(1000), spm.spm_vocab(8192)
    n_chars = sum(1 for p in small.tokens[259:] if len(p) == 1)
    merged_small = small.tokens[259 : 1000 - n_chars]
    assert large.tokens[259 : 259 + len(merged_small)] == merged_small


@pytest.mark.parametrize("n_vocab", [100, 300, 10**6])
def test_spm_vocab_size_bounds(n_vocab: int) -> None:
    with pytest.raises(ConfigError, match="SPM"):
        spm.spm_vocab(n_vocab)


@pytest.mark.parametrize("n_vocab", [512, 8192])
def test_spm_vocab_round_trips_english(n_vocab: int) -> None:
    meta = spm.spm_metadata(n_vocab)
    tok = Tokenizer.from_gguf_fields(meta)
    assert tok.model == "llama" and tok.add_bos and not tok.add_eos
    text = corpus()
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == "<s>" + " " + text  # bos renders, its space stays
    # learned pieces: far fewer tokens than characters, and the larger vocabulary needs fewer
    assert len(ids) < len(text) / (1.5 if n_vocab == 512 else 3)
    for line in ("Hello, World!", "  indented\tand tabbed\n", "naïve café 中文 🙂", "3.14159 + 2 = 5.14159"):
        assert tok.decode(tok.encode(line, add_bos=False)) == line


def test_spm_metadata_is_a_mixtral_tokenizer() -> None:
    meta = spm.spm_metadata(1000)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.chat_template"] == spm.MIXTRAL_CHAT_TEMPLATE == golden_fields()["tokenizer.chat_template"]
    # the template's own rule (its rendering is checked against llama.cpp's above)
    msgs = [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "hi"}]
    with pytest.raises(TokenizerError, match="alternate"):
        render_chat(spm.MIXTRAL_CHAT_TEMPLATE, msgs, bos_token="<s>", eos_token="</s>")
