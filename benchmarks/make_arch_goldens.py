"""Golden fixtures for the MoE architectures beyond qwen3moe, made with llama.cpp.

NOT a project module: like ``make_goldens.py`` (whose llama.cpp helpers it reuses) it runs only in a
scratch venv with llama-cpp-python 0.3.36 and ``gguf``::

    /work/ggml-proto/llama/bin/python benchmarks/make_arch_goldens.py           # writes the files below
    /work/ggml-proto/llama/bin/python benchmarks/make_arch_goldens.py --check   # regenerate, compare

For each architecture in ``ARCHS`` it writes, into ``--out`` (default ``tests/fixtures/golden``):

- ``<arch>-tiny-f32.gguf``: a tiny random-weight model written here with ``gguf.GGUFWriter``, laid
  out as llama.cpp's converter (``convert_hf_to_gguf.py``) lays out a real model of that family:
  the same metadata keys (and only those), the same tensor names and shapes, biases and norms in
  F32; independent of the project's ``make-model``. Tokenizer: the tiny qwen3moe golden's (byte-level
  BPE, 387 tokens).
- ``<arch>-tiny-q8_0.gguf``: that file quantised by ``llama_model_quantize`` (``MOSTLY_Q8_0``, the
  default parameters, so llama.cpp chooses every tensor's type); for the architectures in
  ``MXFP4_ARCHS`` also ``<arch>-tiny-mxfp4_moe.gguf`` (``MOSTLY_MXFP4_MOE``: llama.cpp's MXFP4
  expert tensors, as gpt-oss ships them).
- ``<name>.llamacpp.json`` for each (schema: ``tests/fixtures/golden/README.md``): llama.cpp's raw
  logits of 3 random 16-token sequences at every position, greedy continuations of random prompts
  whose every step has a top-1/top-2 margin above 2e-3, and llama.cpp's tokenisation of the tiny
  golden's texts. F32 KV cache, flash attention off, 2 threads, ``GGML_CPU_TILED_MM=0``.
- ``makemodel-<arch>-tiny.llamacpp.json``: the project's own generator checked by llama.cpp:
  ``moe-swarm make-model --arch <arch> --size tiny --seed 0`` (run with ``--project-python``, default
  ``.venv/bin/python``), its sha256 and llama.cpp's logits of one sequence and one greedy
  continuation on it (the test regenerates the file, checks the sha256, and compares).

Everything is a pure function of the constants below (``--check`` regenerates into a temporary
directory and compares sha256s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_goldens as mg  # noqa: E402  (sets GGML_CPU_TILED_MM before llama_cpp loads)

gguf, llama_cpp, np = mg.gguf, mg.llama_cpp, mg.np

ROOT = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = "qwen3moe-tiny-f32.gguf"

# the tiny models: d_model 128, 2 layers, 8 experts top-2; per architecture what its family needs
BASE: dict[str, Any] = {
    "n_layer": 2,
    "d_model": 128,
    "n_head": 4,
    "n_expert": 8,
    "n_expert_used": 2,
    "expert_width": 64,
    "context_length": 256,
}
ARCHS: dict[str, dict[str, Any]] = {
    # Qwen1.5-MoE style: GQA, q/k/v biases, a sigmoid-gated shared expert 4x an expert's width
    "qwen2moe": {**BASE, "seed": 2, "n_head_kv": 2, "shared_width": 256, "rope_base": 1_000_000.0, "rms_eps": 1e-6},
    # OLMoE style: q/k RMSNorm over the whole projection; llama.cpp sizes the k norm by d_model, so
    # kv heads = query heads (as in OLMoE-1B-7B)
    "olmoe": {**BASE, "seed": 3, "n_head_kv": 4, "rope_base": 10_000.0, "rms_eps": 1e-5},
    # DeepSeek-V2 style: MLA (q through a rank-48 bottleneck, kv_lora_rank 64, nope/rope/v head dims
    # 32/16/32), one leading dense block, 2 shared experts, softmax gating scaled by 1.5, no
    # renormalisation. (llama.cpp 0.3.36 takes the plain attn_q of V2-Lite only for 26- or 27-block
    # models, so a tiny file has the bottleneck.)
    # gpt-oss style: head_dim 48 (q_dim 192 != d_model), GQA 4/2, a sliding window of 8 on even
    # layers, attention sinks, biases on q/k/v/o, the router and the experts, clamped SwiGLU, YaRN
    "gpt-oss": {**BASE, "seed": 5, "n_head_kv": 2, "head_dim": 48, "sliding_window": 8, "rope_base": 150_000.0,
                "rms_eps": 1e-5},
    "deepseek2": {**BASE, "seed": 4, "n_layer": 3, "n_dense": 1, "dense_width": 192, "n_shared": 2,
                  "kv_lora_rank": 64, "q_lora_rank": 48, "d_nope": 32, "d_rope": 16, "d_v": 32,
                  "weights_scale": 1.5, "rope_base": 10_000.0, "rms_eps": 1e-6},
}


MXFP4_ARCHS = ("qwen2moe", "gpt-oss")
# YaRN context extension (F32 files ``<arch>-yarn-tiny-f32.gguf``): factor 4 over an original context
# of 32, so the 16-token sequences and 32-token greedy runs cross the correction dims; deepseek2 with
# V2-Lite's log multiplier (0.1 x mscale_all_dim 0.707, as its converter writes it)
YARN: dict[str, dict[str, Any]] = {
    "qwen2moe": {"factor": 4.0, "original_context_length": 32},
    "deepseek2": {"factor": 4.0, "original_context_length": 32, "yarn_log_multiplier": 0.0707},
}


# group-limited routing (DeepSeek-V2's n_group / topk_group): F32 file ``<arch>-groups-tiny-f32.gguf``
GROUPS: dict[str, dict[str, int]] = {"deepseek2": {"expert_group_count": 4, "expert_group_used_count": 2}}


def _add_yarn(w: Any, arch: str, yarn: dict[str, Any] | None) -> None:
    if yarn is None:
        return
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", yarn["factor"])
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", yarn["original_context_length"])
    if "yarn_log_multiplier" in yarn:
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", yarn["yarn_log_multiplier"])


# each family's pre-tokenizer as its converter names it (the vocabulary stays the tiny golden's)
PRE: dict[str, str] = {"qwen2moe": "qwen2", "olmoe": "olmo", "deepseek2": "deepseek-llm", "gpt-oss": "gpt-4o"}
# texts tokenised by llama.cpp beside the tiny golden's: what the pre-tokenizers split differently
EXTRA_TEXTS = [
    "line one\nline two\r\n\tindented   \n\n",
    "trailing spaces   ",
    "  leading spaces and 12345678 digits 3.14159",
    "Ελληνικά, русский, العربية, עברית",
    "中文分词测试，全角标点！日本語のテキスト。한국어 문장",
    "ＡＢＣ ｆｕｌｌｗｉｄｔｈ（ｔｅｓｔ）“quotes”",
    "emoji 🙂🚀 and µ-units, Ω and K",
    "code: def f(x): return x**2 # ok?",
    "it's they're we'll I'd you've",
]


def _add_tokenizer(w: Any, tok: Any, pre: str | None = None) -> list[str]:
    tokens: list[str] = mg._field(tok, "tokenizer.ggml.tokens")
    w.add_string("tokenizer.ggml.model", mg._field(tok, "tokenizer.ggml.model"))
    w.add_string("tokenizer.ggml.pre", pre or mg._field(tok, "tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in mg._field(tok, "tokenizer.ggml.token_type")])
    w.add_token_merges(mg._field(tok, "tokenizer.ggml.merges"))
    w.add_eos_token_id(int(mg._field(tok, "tokenizer.ggml.eos_token_id")))
    w.add_pad_token_id(int(mg._field(tok, "tokenizer.ggml.padding_token_id")))
    w.add_bos_token_id(int(mg._field(tok, "tokenizer.ggml.bos_token_id")))
    w.add_add_bos_token(False)
    return tokens


def write_deepseek2(tokenizer_src: Path, out: Path, yarn: dict[str, Any] | None = None,
                    groups: dict[str, int] | None = None) -> None:
    """DeepseekV2Model's layout (convert_hf_to_gguf.py, after llama.cpp split attn_kv_b into attn_k_b
    (stored [heads, kv_lora, nope]) and attn_v_b ([heads, v, kv_lora]) for its MLA cache)."""
    a, c = "deepseek2", ARCHS["deepseek2"]
    tok = gguf.GGUFReader(tokenizer_src)
    d, nh, ne, w_ = c["d_model"], c["n_head"], c["n_expert"], c["expert_width"]
    kvl, ql, dn, dr, dv = c["kv_lora_rank"], c["q_lora_rank"], c["d_nope"], c["d_rope"], c["d_v"]
    seed = c["seed"]
    w = gguf.GGUFWriter(out, a)
    w.add_string("general.name", f"{a}-tiny-seed{seed}")
    w.add_type("model")
    w.add_uint32(f"{a}.context_length", c["context_length"])
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.block_count", c["n_layer"])
    w.add_uint32(f"{a}.feed_forward_length", c["dense_width"])
    w.add_uint32(f"{a}.attention.head_count", nh)
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    w.add_float32(f"{a}.rope.freq_base", c["rope_base"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c["rms_eps"])
    w.add_uint32(f"{a}.expert_used_count", c["n_expert_used"])
    w.add_uint32(f"{a}.leading_dense_block_count", c["n_dense"])
    if ql:
        w.add_uint32(f"{a}.attention.q_lora_rank", ql)
    w.add_uint32(f"{a}.attention.kv_lora_rank", kvl)
    w.add_uint32(f"{a}.attention.key_length", kvl + dr)
    w.add_uint32(f"{a}.attention.value_length", kvl)
    w.add_uint32(f"{a}.attention.key_length_mla", dn + dr)
    w.add_uint32(f"{a}.attention.value_length_mla", dv)
    w.add_uint32(f"{a}.expert_feed_forward_length", w_)
    w.add_uint32(f"{a}.expert_count", ne)
    w.add_uint32(f"{a}.expert_shared_count", c["n_shared"])
    w.add_float32(f"{a}.expert_weights_scale", c["weights_scale"])
    w.add_bool(f"{a}.expert_weights_norm", False)
    w.add_uint32(f"{a}.expert_gating_func", 1)  # softmax
    w.add_uint32(f"{a}.rope.dimension_count", dr)
    _add_yarn(w, a, yarn)
    for key, value in (groups or {}).items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_uint32("general.file_type", 0)
    tokens = _add_tokenizer(w, tok, PRE["deepseek2"])
    vocab, sw = len(tokens), c["n_shared"] * w_
    plan: list[tuple[str, tuple[int, ...], float, bool]] = [("token_embd.weight", (vocab, d), 1.0, False)]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), 0.1, True),
            *([(b + "attn_q_a.weight", (ql, d), d**-0.5, False), (b + "attn_q_a_norm.weight", (ql,), 0.1, True),
               (b + "attn_q_b.weight", (nh * (dn + dr), ql), ql**-0.5, False)] if ql else
              [(b + "attn_q.weight", (nh * (dn + dr), d), d**-0.5, False)]),
            (b + "attn_kv_a_mqa.weight", (kvl + dr, d), d**-0.5, False),
            (b + "attn_kv_a_norm.weight", (kvl,), 0.1, True),
            (b + "attn_k_b.weight", (nh, kvl, dn), kvl**-0.5, False),
            (b + "attn_v_b.weight", (nh, dv, kvl), kvl**-0.5, False),
            (b + "attn_output.weight", (d, nh * dv), (nh * dv) ** -0.5, False),
            (b + "ffn_norm.weight", (d,), 0.1, True),
        ]
        if i < c["n_dense"]:
            dw = c["dense_width"]
            plan += [(b + "ffn_gate.weight", (dw, d), d**-0.5, False), (b + "ffn_up.weight", (dw, d), d**-0.5, False),
                     (b + "ffn_down.weight", (d, dw), dw**-0.5, False)]
            continue
        plan += [
            (b + "ffn_gate_inp.weight", (ne, d), d**-0.5, False),
            (b + "ffn_gate_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_up_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_down_exps.weight", (ne, d, w_), w_**-0.5, False),
            (b + "ffn_gate_shexp.weight", (sw, d), d**-0.5, False),
            (b + "ffn_up_shexp.weight", (sw, d), d**-0.5, False),
            (b + "ffn_down_shexp.weight", (d, sw), sw**-0.5, False),
        ]
    plan += [("output_norm.weight", (d,), 0.1, True), ("output.weight", (vocab, d), 2.0 * d**-0.5, False)]
    mg.write_tensors(w, seed, plan)


def write_gpt_oss(tokenizer_src: Path, out: Path) -> None:
    """GptOssModel's layout (conversion/gpt_oss.py): attn_post_norm, attn_sinks, biases, separate
    gate/up/down experts with biases; YaRN as gpt-oss ships it (here factor 4 over 32)."""
    a, c = "gpt-oss", ARCHS["gpt-oss"]
    tok = gguf.GGUFReader(tokenizer_src)
    d, nh, nkv, ne, w_, hd = c["d_model"], c["n_head"], c["n_head_kv"], c["n_expert"], c["expert_width"], c["head_dim"]
    seed = c["seed"]
    w = gguf.GGUFWriter(out, a)
    w.add_string("general.name", f"{a}-tiny-seed{seed}")
    w.add_type("model")
    w.add_uint32(f"{a}.context_length", c["context_length"])
    w.add_uint32(f"{a}.embedding_length", d)
    w.add_uint32(f"{a}.block_count", c["n_layer"])
    w.add_uint32(f"{a}.feed_forward_length", w_)
    w.add_uint32(f"{a}.attention.head_count", nh)
    w.add_uint32(f"{a}.attention.head_count_kv", nkv)
    w.add_float32(f"{a}.rope.freq_base", c["rope_base"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c["rms_eps"])
    w.add_uint32(f"{a}.expert_count", ne)
    w.add_uint32(f"{a}.expert_used_count", c["n_expert_used"])
    w.add_uint32(f"{a}.attention.key_length", hd)
    w.add_uint32(f"{a}.attention.value_length", hd)
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", 4.0)
    w.add_uint32(f"{a}.rope.scaling.original_context_length", 32)
    w.add_uint32(f"{a}.attention.sliding_window", c["sliding_window"])
    w.add_uint32(f"{a}.expert_feed_forward_length", w_)
    w.add_uint32("general.file_type", 0)
    tokens = _add_tokenizer(w, tok, PRE[a])
    vocab, q_dim, kv_dim = len(tokens), nh * hd, nkv * hd
    plan: list[tuple[str, tuple[int, ...], float, bool]] = [("token_embd.weight", (vocab, d), 1.0, False)]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), 0.1, True),
            (b + "attn_q.weight", (q_dim, d), d**-0.5, False), (b + "attn_q.bias", (q_dim,), 0.5, False),
            (b + "attn_k.weight", (kv_dim, d), d**-0.5, False), (b + "attn_k.bias", (kv_dim,), 0.5, False),
            (b + "attn_v.weight", (kv_dim, d), d**-0.5, False), (b + "attn_v.bias", (kv_dim,), 0.5, False),
            (b + "attn_output.weight", (d, q_dim), q_dim**-0.5, False), (b + "attn_output.bias", (d,), 0.1, False),
            (b + "attn_sinks.weight", (nh,), 1.0, False),
            (b + "post_attention_norm.weight", (d,), 0.1, True),
            (b + "ffn_gate_inp.weight", (ne, d), d**-0.5, False), (b + "ffn_gate_inp.bias", (ne,), 0.5, False),
            (b + "ffn_gate_exps.weight", (ne, w_, d), d**-0.5, False), (b + "ffn_gate_exps.bias", (ne, w_), 0.5, False),
            (b + "ffn_up_exps.weight", (ne, w_, d), d**-0.5, False), (b + "ffn_up_exps.bias", (ne, w_), 0.5, False),
            (b + "ffn_down_exps.weight", (ne, d, w_), w_**-0.5, False), (b + "ffn_down_exps.bias", (ne, d), 0.1, False),
        ]
    plan += [("output_norm.weight", (d,), 0.1, True), ("output.weight", (vocab, d), 2.0 * d**-0.5, False)]
    mg.write_tensors(w, seed, plan)


def write_model(arch: str, tokenizer_src: Path, out: Path, yarn: dict[str, Any] | None = None) -> None:
    if arch == "deepseek2":
        write_deepseek2(tokenizer_src, out, yarn)
        return
    if arch == "gpt-oss":
        write_gpt_oss(tokenizer_src, out)
        return
    c = ARCHS[arch]
    tok = gguf.GGUFReader(tokenizer_src)
    tokens = mg._field(tok, "tokenizer.ggml.tokens")
    d, nh, nkv, ne, w_ = c["d_model"], c["n_head"], c["n_head_kv"], c["n_expert"], c["expert_width"]
    hd = d // nh
    q_dim, kv_dim, vocab, seed = nh * hd, nkv * hd, len(tokens), c["seed"]

    w = gguf.GGUFWriter(out, arch)
    w.add_string("general.name", f"{arch}-tiny-seed{seed}")
    w.add_type("model")
    w.add_uint32(f"{arch}.context_length", c["context_length"])
    w.add_uint32(f"{arch}.embedding_length", d)
    w.add_uint32(f"{arch}.block_count", c["n_layer"])
    if arch == "qwen2moe":  # Qwen2MoeModel: intermediate_size, moe_intermediate_size, shared_expert_intermediate_size
        w.add_uint32(f"{arch}.feed_forward_length", c["shared_width"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", w_)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c["shared_width"])
    else:  # OlmoeModel: intermediate_size is the expert width
        w.add_uint32(f"{arch}.feed_forward_length", w_)
    w.add_uint32(f"{arch}.attention.head_count", nh)
    w.add_uint32(f"{arch}.attention.head_count_kv", nkv)
    w.add_float32(f"{arch}.rope.freq_base", c["rope_base"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_eps"])
    w.add_uint32(f"{arch}.expert_count", ne)
    w.add_uint32(f"{arch}.expert_used_count", c["n_expert_used"])
    _add_yarn(w, arch, yarn)
    w.add_uint32("general.file_type", 0)
    _add_tokenizer(w, tok, PRE[arch])

    plan: list[tuple[str, tuple[int, ...], float, bool]] = [("token_embd.weight", (vocab, d), 1.0, False)]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), 0.1, True),
            (b + "attn_q.weight", (q_dim, d), d**-0.5, False),
            (b + "attn_k.weight", (kv_dim, d), d**-0.5, False),
            (b + "attn_v.weight", (kv_dim, d), d**-0.5, False),
            (b + "attn_output.weight", (d, q_dim), q_dim**-0.5, False),
        ]
        if arch == "qwen2moe":
            plan += [(b + "attn_q.bias", (q_dim,), 0.5, False), (b + "attn_k.bias", (kv_dim,), 0.5, False),
                     (b + "attn_v.bias", (kv_dim,), 0.5, False)]
        if arch == "olmoe":
            plan += [(b + "attn_q_norm.weight", (q_dim,), 0.1, True), (b + "attn_k_norm.weight", (kv_dim,), 0.1, True)]
        plan += [
            (b + "ffn_norm.weight", (d,), 0.1, True),
            (b + "ffn_gate_inp.weight", (ne, d), d**-0.5, False),
            (b + "ffn_gate_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_up_exps.weight", (ne, w_, d), d**-0.5, False),
            (b + "ffn_down_exps.weight", (ne, d, w_), w_**-0.5, False),
        ]
        if arch == "qwen2moe":
            sw = c["shared_width"]
            plan += [
                (b + "ffn_gate_inp_shexp.weight", (d,), 2.0 * d**-0.5, False),  # gate logits of std ~2
                (b + "ffn_gate_shexp.weight", (sw, d), d**-0.5, False),
                (b + "ffn_up_shexp.weight", (sw, d), d**-0.5, False),
                (b + "ffn_down_shexp.weight", (d, sw), sw**-0.5, False),
            ]
    plan += [("output_norm.weight", (d,), 0.1, True), ("output.weight", (vocab, d), 2.0 * d**-0.5, False)]
    mg.write_tensors(w, seed, plan)


def long_sequences(normal: list[int]) -> list[list[int]]:
    """One 96-token sequence (positions past a YaRN file's original context of 32)."""
    rng = np.random.Generator(np.random.PCG64(mg.SEQ_SEED + 1))
    return [[int(normal[i]) for i in rng.integers(0, len(normal), 96)]]


def settings() -> dict[str, Any]:
    return {"kv_cache": "f32", "flash_attn": False, "logits": "raw, before any sampling", "n_ctx": mg.N_CTX,
            "n_batch": mg.N_CTX, "n_threads": mg.N_THREADS, "env": {"GGML_CPU_TILED_MM": "0"},
            "greedy_margin_threshold": mg.MARGIN}


def build_json(path: Path, arch: str, src: Path, tiny_golden: dict[str, Any], ftype: str | None) -> dict[str, Any]:
    llm = mg.load(path)
    normal = mg.normal_token_ids(path)
    seqs = mg.sequences(llm, normal, mg.N_SEQ)
    fresh = mg.load(path)  # a fresh context gives the same bits
    if not np.array_equal(mg.all_logits(fresh, seqs[0]["tokens"]), mg.all_logits(llm, seqs[0]["tokens"])):
        raise RuntimeError(f"{path.name}: logits differ between contexts")
    del fresh
    texts = [(t["text"], t["special"]) for t in tiny_golden["tokenize"]] + [(t, sp) for t in EXTRA_TEXTS
                                                                            for sp in (False, True)]
    tokenize = [{"text": t, "special": sp, "ids": list(llm.tokenize(t.encode(), add_bos=False, special=sp))}
                for t, sp in texts]
    kept, rejected = mg.greedy_prompts(llm, normal, mg.N_PROMPTS)
    seqs += [{"tokens": t, "logits": [[round(float(x), 7) for x in row] for row in mg.all_logits(llm, t)]}
             for t in long_sequences(normal)]
    return {
        "model_file": path.name,
        "model_sha256": mg.sha256(path),
        "arch": arch,
        "producer": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "llama_cpp_python_version": llama_cpp.__version__,
        "generator": "benchmarks/make_arch_goldens.py",
        "config": ARCHS.get(arch, {}),
        **({"quantize_ftype": f"LLAMA_FTYPE_MOSTLY_{ftype}",
            "source_model": {"file": src.name, "sha256": mg.sha256(src)}} if ftype else {}),
        "kv_type": "f32",
        "settings": settings(),
        "n_vocab": llm.n_vocab(),
        "tensor_types": mg.tensor_types(path),
        "tokenize": tokenize,
        "sequences": seqs,
        "greedy": kept,
        "greedy_rejected_prompts": rejected,
    }


QUANTISE_EXISTING = [("mixtral-spm-tiny", "llama")]

# the project's generator, checked by llama.cpp: (arch, vocab) -> makemodel-<name>-tiny.llamacpp.json
MAKE_MODEL = [("qwen2moe", "bpe"), ("olmoe", "bpe"), ("deepseek2", "bpe"), ("gpt-oss", "bpe"), ("mixtral", "spm")]


def makemodel_name(arch: str, vocab: str) -> str:
    return f"makemodel-{arch}{'-spm' if vocab == 'spm' else ''}-tiny"


def makemodel_json(arch: str, vocab: str, project_python: Path, tmp: Path, tiny_golden: dict[str, Any]) -> dict[str, Any]:
    """The project's generator checked by llama.cpp (the file is not stored: the test rewrites it)."""
    path = tmp / f"{makemodel_name(arch, vocab)}.gguf"
    subprocess.run([str(project_python), "-m", "swarm.cli", "make-model", "--arch", arch, "--size", "tiny",
                    "--seed", "0", "--vocab", vocab, "--out", str(path)], check=True, cwd=ROOT, capture_output=True)
    llm = mg.load(path)
    normal = mg.normal_token_ids(path)
    kept, rejected = mg.greedy_prompts(llm, normal, 1)
    texts = [(t["text"], t["special"]) for t in tiny_golden["tokenize"]] + [(t, sp) for t in EXTRA_TEXTS
                                                                            for sp in (False, True)]
    return {
        "make_model": {"arch": arch, "size": "tiny", "seed": 0, "vocab": vocab},
        "tokenize": [{"text": t, "special": sp, "add_bos": True,
                      "ids": list(llm.tokenize(t.encode(), add_bos=True, special=sp))} for t, sp in texts],
        "model_sha256": mg.sha256(path),
        "producer": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "generator": "benchmarks/make_arch_goldens.py",
        "settings": settings(),
        "n_vocab": llm.n_vocab(),
        "sequences": mg.sequences(llm, normal, 1),
        "greedy": kept,
        "greedy_rejected_prompts": rejected,
    }


def generate(out_dir: Path, project_python: Path, only: set[str] | None) -> dict[str, str]:
    tiny_golden = json.loads((out_dir / "qwen3moe-tiny-f32.llamacpp.json").read_text())
    shas: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="make_arch_goldens-") as tmp:
        for arch in ARCHS:
            if only and arch not in only:
                continue
            t0 = time.time()
            f32 = out_dir / f"{arch}-tiny-f32.gguf"
            part = out_dir / f".{f32.name}.partial"
            write_model(arch, out_dir / TINY_TOKENIZER, part)
            part.replace(f32)
            q8 = out_dir / f"{arch}-tiny-q8_0.gguf"
            mg.quantize(f32, part, "Q8_0")
            part.replace(q8)
            files: list[tuple[Path, dict[str, Any]]] = [
                (f32, build_json(f32, arch, f32, tiny_golden, None)),
                (q8, build_json(q8, arch, f32, tiny_golden, "Q8_0")),
            ]
            if arch in MXFP4_ARCHS:
                mx = out_dir / f"{arch}-tiny-mxfp4_moe.gguf"
                mg.quantize(f32, part, "MXFP4_MOE")
                part.replace(mx)
                files.append((mx, build_json(mx, arch, f32, tiny_golden, "MXFP4_MOE")))
            if arch in GROUPS:
                gf = out_dir / f"{arch}-groups-tiny-f32.gguf"
                write_deepseek2(out_dir / TINY_TOKENIZER, part, None, GROUPS[arch])
                part.replace(gf)
                data = build_json(gf, arch, gf, tiny_golden, None)
                data["groups"] = GROUPS[arch]
                files.append((gf, data))
            if arch in YARN:
                yf = out_dir / f"{arch}-yarn-tiny-f32.gguf"
                write_model(arch, out_dir / TINY_TOKENIZER, part, YARN[arch])
                part.replace(yf)
                data = build_json(yf, arch, yf, tiny_golden, None)
                data["yarn"] = YARN[arch]
                files.append((yf, data))
            for gg, data in files:
                js = out_dir / f"{gg.stem}.llamacpp.json"
                js.write_text(json.dumps(data, ensure_ascii=False) + "\n")
                shas[gg.name], shas[js.name] = mg.sha256(gg), mg.sha256(js)
                print(f"{gg.name}: {gg.stat().st_size} B, greedy min margins "
                      f"{[g['min_margin'] for g in data['greedy']]}, rejected {len(data['greedy_rejected_prompts'])}",
                      flush=True)
            print(f"{arch}: done in {time.time() - t0:.1f} s", flush=True)
        # llama.cpp's Q8_0 of the Mixtral-style SPM golden (make_spm_golden.py writes the F32 file)
        for name, arch in QUANTISE_EXISTING:
            if only and arch not in only:
                continue
            src = out_dir / f"{name}-f32.gguf"
            dst = out_dir / f"{name}-q8_0.gguf"
            part = out_dir / f".{dst.name}.partial"
            mg.quantize(src, part, "Q8_0")
            part.replace(dst)
            data = build_json(dst, arch, src, tiny_golden, "Q8_0")
            js = out_dir / f"{dst.stem}.llamacpp.json"
            js.write_text(json.dumps(data, ensure_ascii=False) + "\n")
            shas[dst.name], shas[js.name] = mg.sha256(dst), mg.sha256(js)
        for arch, vocab in MAKE_MODEL:
            if only and arch not in only:
                continue
            mm = makemodel_json(arch, vocab, project_python, Path(tmp), tiny_golden)
            js = out_dir / f"{makemodel_name(arch, vocab)}.llamacpp.json"
            js.write_text(json.dumps(mm, ensure_ascii=False) + "\n")
            shas[js.name] = mg.sha256(js)
    return shas


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=mg.DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", help="architectures to (re)generate (default: all)")
    ap.add_argument("--project-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary directory and compare")
    args = ap.parse_args()
    llama_cpp.llama_log_set(mg._QUIET, None)
    only = set(args.only) if args.only else None
    if not args.check:
        generate(args.out, args.project_python, only)
        return 0
    with tempfile.TemporaryDirectory(prefix="make_arch_goldens-check-") as tmp:
        d = Path(tmp)
        for f in (TINY_TOKENIZER, "qwen3moe-tiny-f32.llamacpp.json", *(f"{n}-f32.gguf" for n, _ in QUANTISE_EXISTING)):
            (d / f).write_bytes((args.out / f).read_bytes())
        shas = generate(d, args.project_python, only)
    bad = [f for f, s in shas.items() if not (args.out / f).exists() or mg.sha256(args.out / f) != s]
    print("identical" if not bad else f"DIFFERENT: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
