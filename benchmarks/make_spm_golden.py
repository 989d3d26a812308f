"""A Mixtral-style SentencePiece golden fixture, and llama.cpp's outputs on it.

NOT a project module: it runs only in a scratch venv that has llama-cpp-python (llama.cpp's Python
bindings; 0.3.36 was used) and the ``gguf`` package::

    /work/ggml-proto/llama/bin/python benchmarks/make_spm_golden.py           # writes the 2 files below
    /work/ggml-proto/llama/bin/python benchmarks/make_spm_golden.py --check   # regenerate in a temp dir, compare

It writes, into ``--out`` (default: ``tests/fixtures/golden`` beside this file):

- ``mixtral-spm-tiny-f32.gguf``: a tiny random-weight Mixtral-style model written here with
  ``gguf.GGUFWriter`` (independent of the project's writer): arch ``llama`` with merged expert
  tensors, all F32 (see ``CONFIG``), and the SentencePiece vocabulary of
  ``swarm.tools.spm.spm_metadata`` (imported from the project, which is pure; the tokenizer keys
  are written from that dict as a converted Mixtral file has them).
- ``mixtral-spm-tiny-f32.llamacpp.json``: llama.cpp's tokenisation and detokenisation of many
  texts and id lists, on this file and on vocabulary variants of it (``VARIANTS``, temporary files
  loaded ``vocab_only``), its chat-template rendering, raw logits and greedy continuations (F32 KV
  cache, flash attention off, 2 threads, ``GGML_CPU_TILED_MM=0``; schema:
  tests/fixtures/golden/README.md).

Everything is a pure function of the constants below: a second run gives the same bytes (checked
by ``--check``, which regenerates into a temporary directory and compares sha256s).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# as in make_goldens.py: batch-invariant kernels, read once at library load
os.environ["GGML_CPU_TILED_MM"] = "0"

import gguf  # noqa: E402
import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from llama_cpp import llama_chat_format  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # swarm.tools.spm is pure (gguf and the stdlib only)

from swarm.tools.spm import add_tokenizer_metadata, spm_metadata  # noqa: E402

sys.path.insert(0, str(HERE))
from make_goldens import all_logits, greedy, load, sha256, write_tensors  # noqa: E402  (the shared llama.cpp helpers)

DEFAULT_OUT = HERE.parent / "tests" / "fixtures" / "golden"
NAME = "mixtral-spm-tiny-f32"

CONFIG: dict[str, Any] = {
    "seed": 8072,
    "n_vocab": 1000,
    "n_layer": 2,
    "d_model": 128,
    "n_head": 4,
    "n_head_kv": 2,
    "head_dim": 32,  # d_model / n_head, as in Mixtral
    "n_expert": 8,
    "n_expert_used": 2,
    "expert_width": 48,  # feed_forward_length, as a converted Mixtral file has it
    "context_length": 256,
    "rope_base": 1_000_000.0,
    "rms_eps": 1e-5,
}

MARGIN = 2e-3  # every recorded greedy step: top-1 minus top-2 logit above this
N_GREEDY = 24
N_SEQ, SEQ_LEN, SEQ_SEED = 3, 16, 20251202
N_PROMPTS = 3
N_CTX = 256
N_THREADS = 2
N_RANDOM_DETOK, RANDOM_DETOK_SEED = 60, 777

GREEDY_PROMPTS = [
    "The quick brown fox",
    "A mixture of experts is",
    "Volunteers on a peer-to-peer network",
    "Morning light crept across the valley",
    "[INST] What is a router? [/INST]",
    "Farmers walked along the river",
    "Only the chosen experts run, so",
    "The coordinator runs attention and",
]

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A mixture of experts is a neural network in which a small router chooses, for every token, a few",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple   inner    spaces",
    " ",
    "   ",
    "\n",
    "line one\nline two\n\nline four",
    "tab\there\t",
    "\t\n \n ",
    "\r\n",
    "digits 0123456789 and 3.14159",
    "2024-05-01 12:30",
    "punctuation: (a), [b]; {c}! \"quoted\" 'single' -- ...? #$%&*+/<=>@\\^_`|~",
    "café résumé naïve",
    "中文测试",
    "emoji 🙂👍🏽 done",
    "mixed é中🙂x",
    "Ünïcödé ß ø",
    "<s>",
    "</s>",
    "<unk>",
    "<s>Hello",
    "Hello<s>world",
    "a</s>b",
    "a </s> b",
    "</s> after",
    "x<s></s>y",
    "<s> <s>",
    "<s>\nnewline after special",
    "<s> [INST] What is a mixture of experts? [/INST]",
    "<s>[INST] hi [/INST] Hello!</s>[INST] more [/INST]",
    "▁",
    "▁literal ▁ marks",
    "<0x41> is not a byte token in text",
    "<s",
    "s>",
    "<<s>>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "the the the the",
    "THE QUICK BROWN FOX",
    "Experts, routers; tokens: slices.",
    "<|user|>\n  Hello <|end|>\n<|endoftext|> tail",
    "a\t<|end|>\t b<|user|>  c",
    "The experts jumped in, then interesting things ended.",
    "ééabcd and abcd ééa",
    "▁of course, ▁of",
]

# vocabulary variants of the golden file, each loaded vocab_only: "set" overrides metadata keys,
# "delete" removes them, "retext" renames tokens {old: [new, type]}, "retype" changes token types
# {text: type}; applied in that order (retext and retype to the golden's own lists).
VARIANTS: list[dict[str, Any]] = [
    {"name": "no_space_prefix", "set": {"tokenizer.ggml.add_space_prefix": False}, "delete": []},
    {"name": "add_eos", "set": {"tokenizer.ggml.add_eos_token": True}, "delete": []},
    {"name": "no_bos_flag", "set": {"tokenizer.ggml.add_bos_token": False}, "delete": []},
    # llama.cpp cannot load a phi-3-named file without "<|endoftext|>" (unordered_map::at), so three
    # single-character pieces are renamed: two control tokens and a user-defined one
    {
        "name": "phi3_name",
        "set": {"general.name": "Phi-3-mini-spm-test"},
        "retext": {"~": ["<|endoftext|>", 3], "}": ["<|end|>", 3], "{": ["<|user|>", 4]},
        "delete": [],
    },
    {"name": "no_scores", "set": {}, "delete": ["tokenizer.ggml.scores"]},
    # special tokens are cut out longest first by UTF-8 bytes: "ééa" (3 characters, 5 bytes) before
    # "abcd" (4 and 4), which overlap in "ééabcd"
    {"name": "non_ascii_specials", "retext": {"|": ["ééa", 3], "`": ["abcd", 3]}, "set": {}, "delete": []},
    # USER_DEFINED, UNUSED, UNDEFINED, CONTROL, UNKNOWN
    {"name": "token_types", "retype": {"ed": 4, "er": 5, "in": 0, "▁of": 3, "es": 2}, "set": {}, "delete": []},
]




# ---------------------------------------------------------------------------------------------
# the model file




def tokenizer_fields() -> dict[str, Any]:
    return spm_metadata(CONFIG["n_vocab"])


def write_model(out: Path, *, meta: dict[str, Any] | None = None, name: str = "mixtral-spm-tiny") -> None:
    c = CONFIG
    meta = tokenizer_fields() if meta is None else meta
    d, hd, w_, ne = c["d_model"], c["head_dim"], c["expert_width"], c["n_expert"]
    q_dim, kv_dim, vocab = c["n_head"] * hd, c["n_head_kv"] * hd, len(meta["tokenizer.ggml.tokens"])
    seed = c["seed"]

    w = gguf.GGUFWriter(out, "llama")
    a = "llama"
    w.add_string("general.name", name)
    w.add_type("model")
    w.add_uint32(f"{a}.vocab_size", vocab)
    w.add_uint32(f"{a}.context_length", c["context_length"])
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.block_count", c["n_layer"])
    w.add_uint32(f"{a}.feed_forward_length", w_)
    w.add_uint32(f"{a}.rope.dimension_count", hd)
    w.add_uint32(f"{a}.attention.head_count", c["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", c["n_head_kv"])
    w.add_float32(f"{a}.rope.freq_base", c["rope_base"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c["rms_eps"])
    w.add_uint32(f"{a}.expert_count", ne)
    w.add_uint32(f"{a}.expert_used_count", c["n_expert_used"])
    w.add_uint32("general.file_type", 0)
    add_tokenizer_metadata(w, meta)

    # numpy shapes (outer first); GGUF ne is the reverse. Scales as in the qwen3moe tiny golden.
    plan: list[tuple[str, tuple[int, ...], float, bool]] = [("token_embd.weight", (vocab, d), 1.0, False)]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), 0.1, True),
            (b + "attn_q.weight", (q_dim, d), d**-0.5, False),
            (b + "attn_k.weight", (kv_dim, d), d**-0.5, False),
            (b + "attn_v.weight", (kv_dim, d), d**-0.5, False),
            (b + "attn_output.weight", (d, q_dim), q_dim**-0.5, False),
            (b + "ffn_norm.weight", (d,), 0.1, True),
            (b + "ffn_gate_inp.weight", (ne, d), d**-0.5, False),
            (b + "ffn_gate_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_down_exps.weight", (ne, d, w_), w_**-0.5, False),
            (b + "ffn_up_exps.weight", (ne, w_, d), d**-0.5, False),
        ]
    plan += [
        ("output_norm.weight", (d,), 0.1, True),
        ("output.weight", (vocab, d), 2.0 * d**-0.5, False),  # logits std ~2: larger greedy margins
    ]
    write_tensors(w, seed, plan)


# ---------------------------------------------------------------------------------------------
# llama.cpp




def tokenize(llm: llama_cpp.Llama, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=add_special, special=parse_special))


def detokenize(llm: llama_cpp.Llama, ids: list[int], *, remove_special: bool, unparse_special: bool) -> bytes:
    """llama.cpp's llama_detokenize (not llama-cpp-python's Llama.detokenize, which has its own
    leading-space rule)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    if n < 0:
        raise RuntimeError(f"detokenize buffer too small ({-n} > {size})")
    return bytes(buf.raw[:n])








def token_types(path: Path) -> list[int]:
    return [int(t) for t in gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"].contents()]


def tokenize_cases(llm: llama_cpp.Llama) -> list[dict[str, Any]]:
    out = []
    for text in TEXTS:
        for parse_special in (True, False):
            for add_special in (True, False):
                ids = tokenize(llm, text, add_special=add_special, parse_special=parse_special)
                out.append({"text": text, "special": parse_special, "add_special": add_special, "ids": ids})
    return out


def detok_entry(llm: llama_cpp.Llama, ids: list[int]) -> dict[str, Any]:
    entry: dict[str, Any] = {"ids": list(ids)}
    for unparse in (True, False):
        raw = detokenize(llm, ids, remove_special=False, unparse_special=unparse)
        key = "special" if unparse else "plain"
        entry[f"{key}_hex"] = raw.hex()
        entry[key] = raw.decode("utf-8", errors="replace")
    return entry


def detokenize_cases(llm: llama_cpp.Llama, tokenized: list[dict[str, Any]], types: list[int]) -> list[dict[str, Any]]:
    lists: list[list[int]] = []
    for t in tokenized:
        if t["ids"] not in lists:
            lists.append(t["ids"])

    def first(kind: int) -> int:
        return types.index(kind)

    byte = {b: first(int(gguf.TokenType.BYTE)) + b for b in range(256)}
    the = tokenizer_fields()["tokenizer.ggml.tokens"].index("\u2581the")
    space_piece = tokenize(llm, " ", add_special=False, parse_special=False)  # the prefix and the space
    hand = [
        [],
        [1],
        [2],
        [0],
        [the],
        [the, the],
        [1, the],
        [0, the],
        [2, the],
        [byte[0x20], the],
        [byte[0x20], byte[0x20], byte[0x41]],
        [byte[0x41], the],
        [byte[0xE4]],
        [byte[0xE4], byte[0xB8]],
        [byte[0xE4], byte[0xB8], byte[0xAD]],
        [byte[0xB8], byte[0x41]],
        [byte[0xFF], byte[0x0A]],
        [1, 1, 2, 0],
        space_piece,
        space_piece + [the],
    ]
    for h in hand:
        if h not in lists:
            lists.append(h)
    rng = np.random.Generator(np.random.PCG64(RANDOM_DETOK_SEED))
    n_vocab = llm.n_vocab()
    for _ in range(N_RANDOM_DETOK):
        k = int(rng.integers(1, 25))
        lists.append([int(x) for x in rng.integers(0, n_vocab, k)])
    return [detok_entry(llm, ids) for ids in lists]


def greedy_entry(llm: llama_cpp.Llama, prompt: str) -> dict[str, Any]:
    prompt_ids = tokenize(llm, prompt, add_special=True, parse_special=True)
    ids, margins = greedy(llm, prompt_ids, N_GREEDY)
    small = [i for i, m in enumerate(margins) if m <= MARGIN]
    n_rel = small[0] if small else N_GREEDY
    kept = ids[:n_rel]
    return {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "greedy_ids": kept,
        # llama_detokenize(remove_special=False, unparse_special=True): of the generated ids alone
        # (the leading-space rule applies to the first generated token), and of prompt + generated
        "greedy_text": detokenize(llm, kept, remove_special=False, unparse_special=True).decode("utf-8", "replace"),
        "full_text_hex": detokenize(llm, prompt_ids + kept, remove_special=False, unparse_special=True).hex(),
        "n_requested": N_GREEDY,
        "n_reliable": n_rel,
        "margins": [round(m, 6) for m in margins[:n_rel]],
        "min_margin": round(min(margins[:n_rel]), 6) if n_rel else None,
        "first_small_margin": round(margins[n_rel], 7) if small else None,
    }


CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is a mixture of experts?"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Explain routing in one line."},
    ],
    [{"role": "user", "content": "  spaces\nand a newline  "}],
]


def chat_cases(llm: llama_cpp.Llama, template: str) -> list[dict[str, Any]]:
    fmt = llama_chat_format.Jinja2ChatFormatter(template, eos_token="</s>", bos_token="<s>")
    out = []
    for msgs in CHATS:
        jinja_prompt = fmt(messages=msgs).prompt
        arr = (llama_cpp.llama_chat_message * len(msgs))(
            *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in msgs)
        )
        buf = ctypes.create_string_buffer(8192)
        n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(msgs), True, buf, len(buf))
        if n < 0 or n > len(buf):
            raise RuntimeError(f"llama_chat_apply_template returned {n}")
        out.append(
            {
                "messages": msgs,
                "jinja_prompt": jinja_prompt,
                "llama_cpp_prompt": buf.raw[:n].decode(),
                "jinja_prompt_ids": tokenize(llm, jinja_prompt, add_special=True, parse_special=True),
            }
        )
    return out


def variant_meta(base: dict[str, Any], variant: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(tokenizer metadata, the overrides as recorded, general.name) of a variant."""
    sets = dict(variant["set"])
    if variant.get("retext"):
        tokens = list(base["tokenizer.ggml.tokens"])
        types = list(base["tokenizer.ggml.token_type"])
        for old, (new, ttype) in variant["retext"].items():
            i = tokens.index(old)
            tokens[i], types[i] = new, ttype
        sets["tokenizer.ggml.tokens"] = tokens
        sets["tokenizer.ggml.token_type"] = types
    if variant.get("retype"):
        tokens = base["tokenizer.ggml.tokens"]
        types = list(base["tokenizer.ggml.token_type"])
        for text, ttype in variant["retype"].items():
            types[tokens.index(text)] = ttype
        sets["tokenizer.ggml.token_type"] = types
    recorded = {k: variant.get(k, {}) for k in ("set", "delete", "retext", "retype")}
    name = sets.pop("general.name", "mixtral-spm-tiny")
    meta = {**base, **sets}
    for k in variant["delete"]:
        meta.pop(k)
    return meta, recorded, name


def variant_cases(tmp: Path, base: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for v in VARIANTS:
        meta, recorded, name = variant_meta(base, v)
        path = tmp / f"variant-{v['name']}.gguf"
        write_model(path, meta=meta, name=name)
        llm = load(path, vocab_only=True)
        tok = tokenize_cases(llm)
        det = [detok_entry(llm, ids) for ids in dict.fromkeys(tuple(t["ids"]) for t in tok)]
        out.append({"name": v["name"], **recorded, "tokenize": tok, "detokenize": det})
        del llm
    return out


def build_json(path: Path, tmp: Path) -> dict[str, Any]:
    llm = load(path)
    types = token_types(path)
    normal = [i for i, t in enumerate(types) if t == int(gguf.TokenType.NORMAL)]

    rng = np.random.Generator(np.random.PCG64(SEQ_SEED))
    sequences = []
    for _ in range(N_SEQ):
        toks = [1] + [int(normal[i]) for i in rng.integers(0, len(normal), SEQ_LEN - 1)]
        lg = all_logits(llm, toks)
        sequences.append({"tokens": toks, "logits": [[round(float(x), 7) for x in row] for row in lg]})
    fresh = load(path)
    if not np.array_equal(all_logits(fresh, sequences[0]["tokens"]), all_logits(llm, sequences[0]["tokens"])):
        raise RuntimeError(f"{path.name}: logits differ between contexts")
    del fresh

    tokenized = tokenize_cases(llm)
    detok = detokenize_cases(llm, tokenized, types)
    greedy_out: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    for prompt in GREEDY_PROMPTS:
        if len(greedy_out) == N_PROMPTS:
            break
        e = greedy_entry(llm, prompt)
        if e["n_reliable"] == N_GREEDY:
            greedy_out.append(e)
        else:
            rejected.append({"prompt": prompt, "n_reliable": e["n_reliable"], "first_small_margin": e["first_small_margin"]})
    if len(greedy_out) < N_PROMPTS:
        raise RuntimeError(f"only {len(greedy_out)} decisive prompts")

    template = tokenizer_fields()["tokenizer.chat_template"]
    if template != llama_chat_format.MIXTRAL_INSTRUCT_CHAT_TEMPLATE:
        raise RuntimeError("the chat template is not llama-cpp-python's copy of Mixtral-Instruct's")
    return {
        "model_file": path.name,
        "model_sha256": sha256(path),
        "producer": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "llama_cpp_python_version": llama_cpp.__version__,
        "generator": "benchmarks/make_spm_golden.py",
        "config": CONFIG,
        "kv_type": "f32",
        "settings": {
            "kv_cache": "f32",
            "flash_attn": False,
            "logits": "raw, before any sampling",
            "n_ctx": N_CTX,
            "n_batch": N_CTX,
            "n_threads": N_THREADS,
            "env": {"GGML_CPU_TILED_MM": os.environ["GGML_CPU_TILED_MM"]},
            "greedy_margin_threshold": MARGIN,
        },
        "n_vocab": llm.n_vocab(),
        "tokenize": tokenized,
        "detokenize": detok,
        "variants": variant_cases(tmp, tokenizer_fields()),
        "chat": chat_cases(llm, template),
        "sequences": sequences,
        "greedy": greedy_out,
        "greedy_rejected_prompts": rejected,
    }


def generate(out_dir: Path) -> dict[str, str]:
    t0 = time.time()
    gg = out_dir / f"{NAME}.gguf"
    js = out_dir / f"{NAME}.llamacpp.json"
    with tempfile.TemporaryDirectory(prefix="make_spm_golden-") as tmp:
        part = out_dir / f".{NAME}.gguf.partial"
        write_model(part)
        os.replace(part, gg)
        data = build_json(gg, Path(tmp))
    js.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
    print(
        f"{NAME}: {gg.stat().st_size} B gguf, {js.stat().st_size} B json, {len(data['tokenize'])} tokenize, "
        f"{len(data['detokenize'])} detokenize, {len(data['variants'])} variants, "
        f"greedy min margins {[g['min_margin'] for g in data['greedy']]}, "
        f"rejected prompts {len(data['greedy_rejected_prompts'])}, {time.time() - t0:.1f} s",
        flush=True,
    )
    return {gg.name: sha256(gg), js.name: sha256(js)}


_QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # kept alive: ctypes callback


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary directory and compare with --out")
    args = ap.parse_args()
    llama_cpp.llama_log_set(_QUIET, None)
    if not args.check:
        generate(args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="make_spm_golden-check-") as tmp:
        shas = generate(Path(tmp))
    bad = [f for f, s in shas.items() if not (args.out / f).exists() or sha256(args.out / f) != s]
    print("identical" if not bad else f"DIFFERENT: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
