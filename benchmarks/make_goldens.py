"""Quantised golden fixtures made with llama.cpp's own quantiser, and llama.cpp's outputs on them.

NOT a project module: it runs only in a scratch venv that has llama-cpp-python (llama.cpp's Python
bindings; 0.3.36 was used, built portable without llamafile/AVX-512) and the ``gguf`` package::

    /work/ggml-proto/llama/bin/python benchmarks/make_goldens.py [--out tests/fixtures/golden]

It writes, into ``--out`` (default: ``tests/fixtures/golden`` beside this file):

- ``qwen3moe-tiny-q8_0.gguf`` / ``qwen3moe-tiny-q4_0.gguf``: the existing tiny F32 golden
  (``qwen3moe-tiny-f32.gguf``, read from ``--out``; its sha256 is checked) quantised by
  ``llama_cpp.llama_model_quantize`` with ``llama_model_quantize_default_params()`` and
  ``ftype = LLAMA_FTYPE_MOSTLY_Q8_0`` / ``LLAMA_FTYPE_MOSTLY_Q4_0``.
- ``qwen3moe-small-w224-q4_k_m.gguf``: ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` of a random-weight qwen3moe
  written here with ``gguf.GGUFWriter`` (independent of the project's writer; see ``W224`` below):
  d_model 256 (K-quant rows) but expert width 224 and q_dim 8 x 48 = 384, whose rows are not
  multiples of 256, so llama.cpp's Q4_K_M mixes Q4_K and Q6_K with its fallbacks (Q5_0 for Q4_K,
  Q8_0 for Q6_K). The F32 source is only a temporary file; its sha256 goes into the JSON.
- ``<name>.llamacpp.json`` for each: llama.cpp's raw logits and greedy continuations with an F32
  KV cache, flash attention off, 2 threads, ``GGML_CPU_TILED_MM=0`` (batch-invariant kernels, see
  below; schema: tests/fixtures/golden/README.md).

Everything is a pure function of the constants below: a second run gives the same bytes (checked
by ``--check``, which regenerates into a temporary directory and compares sha256s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# llama.cpp's CPU backend (ggml 0.25.3 in llama-cpp-python 0.3.36) multiplies batches of 8 or more
# rows by K-quant weights in a tiled kernel whose float summation order differs from the one-row
# kernel, so a row's result depends on how many rows share the call (prefill vs decode). The project's
# kernels are batch-invariant by design (ggml 0.15.3, GGML_LLAMAFILE=OFF); so that the goldens are
# llama.cpp's batch-invariant numbers, the tiled path is switched off -- read once, at library load,
# hence before the import. (With it on, the Q4_K_M logits move by ~1e-6, and by ~0.06 where an
# activation then lands on the other side of a Q8_K rounding boundary.)
os.environ["GGML_CPU_TILED_MM"] = "0"

import gguf  # noqa: E402
import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "tests" / "fixtures" / "golden"

TINY_F32 = "qwen3moe-tiny-f32.gguf"
TINY_F32_SHA256 = "158f2cb9ff71d86c4d491fd737b6c30a219540a3f0d2216cebcf974832aab059"

MARGIN = 2e-3  # every recorded greedy step: top-1 minus top-2 logit above this
N_GREEDY = 24
N_SEQ, SEQ_LEN, SEQ_SEED = 3, 16, 20251201
PROMPT_LEN, PROMPT_SEED, N_PROMPTS = 8, 424242, 3
N_CTX = 256
N_THREADS = 2

# the Q4_K_M source model (qwen3moe; written by write_w224)
W224: dict[str, Any] = {
    "name": "qwen3moe-small-w224",
    "seed": 224,
    "n_layer": 4,
    "d_model": 256,
    "n_head": 8,
    "n_head_kv": 2,
    "head_dim": 48,  # q_dim 384: attn_output rows are not multiples of 256
    "n_expert": 16,
    "n_expert_used": 4,
    "expert_width": 224,  # ffn_down_exps rows are not multiples of 256
    "context_length": 256,
    "rope_base": 1_000_000.0,
    "rms_eps": 1e-6,
}

FIXTURES = [
    # (output name, source, ftype name)
    ("qwen3moe-tiny-q8_0", "tiny", "Q8_0"),
    ("qwen3moe-tiny-q4_0", "tiny", "Q4_0"),
    ("qwen3moe-small-w224-q4_k_m", "w224", "Q4_K_M"),
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# the Q4_K_M source model


def _draw(seed: int, name: str, shape: tuple[int, ...], std: float, norm: bool = False) -> np.ndarray:
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key])))
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if norm:
        x += np.float32(1.0)
    return x.astype(np.float32)


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


def write_w224(tokenizer_src: Path, out: Path) -> None:
    """An all-F32 qwen3moe with W224's shapes and the tokenizer of the tiny golden (387 tokens)."""
    c = W224
    tok = gguf.GGUFReader(tokenizer_src)
    tokens = _field(tok, "tokenizer.ggml.tokens")
    d, hd, w_, ne = c["d_model"], c["head_dim"], c["expert_width"], c["n_expert"]
    q_dim, kv_dim, vocab = c["n_head"] * hd, c["n_head_kv"] * hd, len(tokens)
    seed = c["seed"]

    w = gguf.GGUFWriter(out, "qwen3moe")
    a = "qwen3moe"
    w.add_string("general.name", f"{c['name']}-seed{seed}")
    w.add_type("model")
    w.add_uint32(f"{a}.context_length", c["context_length"])
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.block_count", c["n_layer"])
    w.add_uint32(f"{a}.feed_forward_length", 6 * w_)
    w.add_uint32(f"{a}.expert_feed_forward_length", w_)
    w.add_uint32(f"{a}.attention.head_count", c["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", c["n_head_kv"])
    w.add_uint32(f"{a}.attention.key_length", hd)
    w.add_uint32(f"{a}.attention.value_length", hd)
    w.add_float32(f"{a}.rope.freq_base", c["rope_base"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c["rms_eps"])
    w.add_uint32(f"{a}.expert_count", ne)
    w.add_uint32(f"{a}.expert_used_count", c["n_expert_used"])
    w.add_uint32("general.file_type", 0)
    w.add_string("tokenizer.ggml.model", _field(tok, "tokenizer.ggml.model"))
    w.add_string("tokenizer.ggml.pre", _field(tok, "tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in _field(tok, "tokenizer.ggml.token_type")])
    w.add_token_merges(_field(tok, "tokenizer.ggml.merges"))
    w.add_eos_token_id(int(_field(tok, "tokenizer.ggml.eos_token_id")))
    w.add_pad_token_id(int(_field(tok, "tokenizer.ggml.padding_token_id")))
    w.add_bos_token_id(int(_field(tok, "tokenizer.ggml.bos_token_id")))
    w.add_add_bos_token(False)

    # numpy shapes (outer first); GGUF ne is the reverse. Scales as in the tiny golden.
    plan: list[tuple[str, tuple[int, ...], float, bool]] = [("token_embd.weight", (vocab, d), 1.0, False)]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), 0.1, True),
            (b + "attn_q.weight", (q_dim, d), d**-0.5, False),
            (b + "attn_k.weight", (kv_dim, d), d**-0.5, False),
            (b + "attn_v.weight", (kv_dim, d), d**-0.5, False),
            (b + "attn_output.weight", (d, q_dim), q_dim**-0.5, False),
            (b + "attn_q_norm.weight", (hd,), 0.1, True),
            (b + "attn_k_norm.weight", (hd,), 0.1, True),
            (b + "ffn_norm.weight", (d,), 0.1, True),
            (b + "ffn_gate_inp.weight", (ne, d), d**-0.5, False),
            (b + "ffn_gate_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_up_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_down_exps.weight", (ne, d, w_), w_**-0.5, False),
        ]
    plan += [
        ("output_norm.weight", (d,), 0.1, True),
        ("output.weight", (vocab, d), 2.0 * d**-0.5, False),  # logits std ~2: larger greedy margins
    ]
    write_tensors(w, seed, plan)


def write_tensors(w: gguf.GGUFWriter, seed: int, plan: list[tuple[str, tuple[int, ...], float, bool]]) -> None:
    """Draw each ``(name, numpy shape, std, is_norm)`` of ``plan`` and write the file (header, metadata,
    tensors), closing ``w``."""
    for name, shape, std, norm in plan:
        w.add_tensor(name, _draw(seed, name, shape, std, norm))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------
# llama.cpp


def quantize(src: Path, dst: Path, ftype_name: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = N_THREADS  # row quantisation does not depend on the thread count
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype_name}) returned {rc}")


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def normal_token_ids(path: Path) -> list[int]:
    """Token ids of NORMAL type (no control/special tokens)."""
    types = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"].contents()
    return [i for i, t in enumerate(types) if int(t) == int(gguf.TokenType.NORMAL)]


def load(path: Path, *, vocab_only: bool = False) -> llama_cpp.Llama:
    """llama.cpp on ``path`` with the goldens' settings (F32 KV cache, no flash attention, 2 threads)."""
    return llama_cpp.Llama(
        model_path=str(path),
        vocab_only=vocab_only,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_ubatch=N_CTX,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        logits_all=True,
        flash_attn=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        n_gpu_layers=0,
        seed=0,
        verbose=False,
    )


def all_logits(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def margin(lg: np.ndarray) -> float:
    top = np.sort(lg.astype(np.float64))[-2:]
    return float(top[1] - top[0])


def greedy(llm: llama_cpp.Llama, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens and the top-1/top-2 margin of the logits each was chosen from."""
    llm.reset()
    llm.eval(prompt)
    lg = np.array(llm.scores[len(prompt) - 1], dtype=np.float32)
    ids, margins = [], []
    for _ in range(n):
        t = int(np.argmax(lg))
        ids.append(t)
        margins.append(margin(lg))
        llm.eval([t])
        lg = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return ids, margins


def detok(llm: llama_cpp.Llama, ids: list[int]) -> str:
    return llm.detokenize(ids).decode("utf-8", errors="replace")


def greedy_entry(llm: llama_cpp.Llama, prompt: str, prompt_ids: list[int]) -> dict[str, Any]:
    ids, margins = greedy(llm, prompt_ids, N_GREEDY)
    small = [i for i, m in enumerate(margins) if m <= MARGIN]
    n_rel = small[0] if small else N_GREEDY
    return {
        "prompt": prompt,
        "prompt_ids": list(prompt_ids),
        "greedy_ids": ids[:n_rel],
        "greedy_text": detok(llm, ids[:n_rel]),
        "n_requested": N_GREEDY,
        "n_reliable": n_rel,
        "margins": [round(m, 6) for m in margins[:n_rel]],
        "min_margin": round(min(margins[:n_rel]), 6) if n_rel else None,
        "first_small_margin": round(margins[n_rel], 7) if small else None,
    }


def sequences(llm: llama_cpp.Llama, normal: list[int], n: int) -> list[dict[str, Any]]:
    """``n`` random 16-token sequences of NORMAL tokens (fixed seed) and llama.cpp's logits at every position."""
    rng = np.random.Generator(np.random.PCG64(SEQ_SEED))
    out = []
    for _ in range(n):
        toks = [int(normal[i]) for i in rng.integers(0, len(normal), SEQ_LEN)]
        lg = all_logits(llm, toks)
        out.append({"tokens": toks, "logits": [[round(float(x), 7) for x in row] for row in lg]})
    return out


def greedy_prompts(llm: llama_cpp.Llama, normal: list[int], n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``n`` decisive greedy continuations of fixed random prompts (a candidate with any step's margin
    at or below 2e-3 is skipped and listed)."""
    prng = np.random.Generator(np.random.PCG64(PROMPT_SEED))
    kept: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    while len(kept) < n:
        pids = [int(normal[i]) for i in prng.integers(0, len(normal), PROMPT_LEN)]
        e = greedy_entry(llm, detok(llm, pids), pids)
        if e["n_reliable"] == N_GREEDY:
            kept.append(e)
        else:
            rejected.append({"prompt_ids": pids, "n_reliable": e["n_reliable"], "first_small_margin": e["first_small_margin"]})
        if len(rejected) > 50:
            raise RuntimeError("no decisive prompts found")
    return kept, rejected


def build_json(path: Path, source: str, ftype_name: str, src_path: Path, tiny_golden: dict[str, Any]) -> dict[str, Any]:
    llm = load(path)
    n_vocab = llm.n_vocab()
    normal = normal_token_ids(path)

    seqs = sequences(llm, normal, N_SEQ)

    # self-check: a fresh context gives the same bits (no state leaks between reset()s)
    fresh = load(path)
    again = all_logits(fresh, seqs[0]["tokens"])
    if not np.array_equal(again, all_logits(llm, seqs[0]["tokens"])):
        raise RuntimeError(f"{path.name}: logits differ between contexts")
    del fresh

    tokenize = []
    for t in tiny_golden["tokenize"]:
        ids = llm.tokenize(t["text"].encode(), add_bos=False, special=t["special"])
        tokenize.append({"text": t["text"], "special": t["special"], "ids": list(ids)})

    greedy_out: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    if source == "tiny":
        # the existing tiny golden's prompts; truncated at the first small margin (n_reliable)
        for g in tiny_golden["greedy"]:
            greedy_out.append(greedy_entry(llm, g["prompt"], g["prompt_ids"]))
    else:
        greedy_out, rejected = greedy_prompts(llm, normal, N_PROMPTS)

    out = {
        "model_file": path.name,
        "model_sha256": sha256(path),
        "producer": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "llama_cpp_python_version": llama_cpp.__version__,
        "generator": "benchmarks/make_goldens.py",
        "quantize_ftype": f"LLAMA_FTYPE_MOSTLY_{ftype_name}",
        "quantize_ftype_value": int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")),
        "source_model": {
            "file": src_path.name if source == "tiny" else f"{W224['name']}-f32.gguf (temporary, written by make_goldens.write_w224)",
            "sha256": sha256(src_path),
            **({} if source == "tiny" else {"config": W224}),
        },
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
        "n_vocab": n_vocab,
        "tensor_types": tensor_types(path),
        "tokenize": tokenize,
        "sequences": seqs,
        "greedy": greedy_out,
        "greedy_rejected_prompts": rejected,
    }
    return out


def generate(out_dir: Path, only: set[str] | None = None) -> dict[str, str]:
    tiny_src = out_dir / TINY_F32
    if sha256(tiny_src) != TINY_F32_SHA256:
        raise RuntimeError(f"{tiny_src} is not the tiny golden (sha256 mismatch)")
    tiny_golden = json.loads((out_dir / "qwen3moe-tiny-f32.llamacpp.json").read_text())
    shas = {}
    with tempfile.TemporaryDirectory(prefix="make_goldens-") as tmp:
        w224_src = Path(tmp) / f"{W224['name']}-f32.gguf"
        for name, source, ftype_name in FIXTURES:
            if only and name not in only:
                continue
            t0 = time.time()
            if source == "tiny":
                src = tiny_src
            else:
                if not w224_src.exists():
                    write_w224(tiny_src, w224_src)
                src = w224_src
            gg = out_dir / f"{name}.gguf"
            part = out_dir / f".{name}.gguf.partial"
            quantize(src, part, ftype_name)
            os.replace(part, gg)
            data = build_json(gg, source, ftype_name, src, tiny_golden)
            js = out_dir / f"{name}.llamacpp.json"
            js.write_text(json.dumps(data, ensure_ascii=False) + "\n")
            shas[gg.name] = sha256(gg)
            shas[js.name] = sha256(js)
            counts: dict[str, int] = {}
            for t in data["tensor_types"].values():
                counts[t] = counts.get(t, 0) + 1
            print(
                f"{name}: {gg.stat().st_size} B gguf, {js.stat().st_size} B json, types {counts}, "
                f"greedy min margins {[g['min_margin'] for g in data['greedy']]}, "
                f"n_reliable {[g['n_reliable'] for g in data['greedy']]}, "
                f"rejected prompts {len(data['greedy_rejected_prompts'])}, {time.time() - t0:.1f} s",
                flush=True,
            )
    return shas


_QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # kept alive: ctypes callback


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory (holds the tiny F32 golden)")
    ap.add_argument("--only", nargs="*", help="fixture names to (re)generate (default: all)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary directory and compare with --out")
    args = ap.parse_args()
    llama_cpp.llama_log_set(_QUIET, None)
    only = set(args.only) if args.only else None
    if not args.check:
        generate(args.out, only)
        return 0
    with tempfile.TemporaryDirectory(prefix="make_goldens-check-") as tmp:
        d = Path(tmp)
        for f in (TINY_F32, "qwen3moe-tiny-f32.llamacpp.json"):
            (d / f).write_bytes((args.out / f).read_bytes())
        shas = generate(d, only)
    bad = [f for f, s in shas.items() if not (args.out / f).exists() or sha256(args.out / f) != s]
    print("identical" if not bad else f"DIFFERENT: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
