"""``moe-swarm make-model``: deterministic random-weight MoE GGUF files (a shell: writes one file).

Models are for the demo, tests and benchmarks; nothing is ever downloaded. The layout follows
llama.cpp's conventions (and ``tests/fixtures/golden/qwen3moe-tiny-f32.gguf``), so llama.cpp loads
them, in six architectures (``ARCHITECTURES``): ``qwen3moe`` (per-head q/k RMSNorm, NEOX RoPE),
Mixtral-style ``llama`` (adjacent-pair RoPE, no q/k norm), ``qwen2moe`` (a gated shared expert),
``olmoe``, ``deepseek2`` (MLA, shared experts) and ``gpt-oss`` (attention sinks, a
biased router), all with merged 3-D expert tensors ``blk.N.ffn_{gate,up,down}_exps``. The command
line is ``swarm.tools.cli`` (light: it imports this module only to run).

Rules:
- The file is a pure function of ``(arch, size, seed, qtype)``: the same arguments give the same
  bytes on every run (no clock, no global RNG, no dict-order or hash-seed dependence).
- Each tensor (each expert of an expert tensor) draws from its own generator seeded by
  ``(seed, sha256(name), expert)``, so weights do not depend on the storage type: a Q4_K file
  holds the quantised weights of the F32 file with the same seed.
- ``qtype`` changes only the expert tensors. Norms and the router are always F32; embeddings,
  attention and output use the size's dense type (F32, or F16 for ``bench``).
- The tokenizer is byte-level BPE (``gpt2``): the 256 byte tokens in GPT-2 byte-to-unicode order,
  then merges learned by a small deterministic trainer (``swarm.tools.bpe``) from an English text
  (``swarm/tools/corpus.txt``; smaller vocabularies are prefixes of larger ones), then the control
  tokens ``<|endoftext|>`` (bos, padding), ``<|im_start|>``, ``<|im_end|>`` (eos). The chat template is ChatML.
- The file is written to a temporary name beside ``out`` and renamed, so ``out`` is never partial.

Sizes (parameters and file bytes for the default types; ``qwen3moe`` / ``mixtral``)::

    size   layers d_model heads/kv head_dim experts top-k width ctx  vocab types (dense/experts)
    tiny   2      128     4/2      32       8       2     64    512  512   F32/F32
    small  4      256     8/2      32       16      4     256   1024 2048  F32/F32
    bench  8      1024    16/4     64       32      4     1408  2048 8192  F16/Q8_0
    30b-a3b 48    2048    32/4     128      128     8     768   4096 8192  F16/Q4_0 (Qwen3-30B-A3B's shape)

    size   params qwen3moe   bytes qwen3moe          params mixtral    bytes mixtral
    tiny   625,408           2,515,104 (2.5 MB)      625,280           2,514,240
    small  14,305,792        57,285,792 (57 MB)      14,305,536        57,284,160
    bench  1,145,325,568     1,253,395,360 (1.25 GB) 1,145,324,544     1,253,390,208

(bytes vary by a few with the digits of the seed in ``general.name``). In ``bench`` the experts
are 1.107e9 of the weights; a token uses 4 of 32 experts per layer, ~176M weights in all, of which
138M are expert weights: expert FFNs dominate CPU decode compute.

``30b-a3b`` (29.9e9 weights, 18.2 GB) draws only its dense weights; its experts are random Q4_0
blocks with bounded scales of the same spread (``random_blocks``; 16.3 GB): written in 1 min 42 s
here, 396 MB peak RSS.

K-quant expert types need rows that are multiples of 256 elements, so ``tiny`` (d_model 128,
width 64) accepts only F32, F16, BF16, Q8_0 and Q4_0. Writing ``bench`` takes 30-45 s on 2 cores
(drawing 1.1e9 normals and quantising them), one tensor in memory at a time (~300 MB peak RSS).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, get_args

import gguf
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as T

from swarm.errors import ConfigError
from swarm.model import quant
from swarm.model.gguf_check import check_gguf_file
from swarm.tools.bpe import BpeVocab, build_vocab

__all__ = [
    "ARCHITECTURES",
    "CHATML_TEMPLATE",
    "SIZES",
    "Arch",
    "BpeVocab",
    "SizeName",
    "SizeSpec",
    "build_vocab",
    "count_parameters",
    "make_model",
    "run_make_model",
]

Arch = Literal["qwen3moe", "mixtral", "qwen2moe", "olmoe", "deepseek2", "gpt-oss"]
SizeName = Literal["tiny", "small", "bench", "30b-a3b"]
ARCHITECTURES: tuple[str, ...] = get_args(Arch)
GGUF_ARCH: Final[dict[str, str]] = {"qwen3moe": "qwen3moe", "mixtral": "llama", "qwen2moe": "qwen2moe", "olmoe": "olmoe",
                                    "deepseek2": "deepseek2", "gpt-oss": "gpt-oss"}
SHARED_WIDTH_FACTOR: Final = 4  # qwen2moe's shared expert is 4x an expert's width (Qwen1.5-MoE-A2.7B: 5632 / 1408)

# Rendering: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
# "<|im_start|>assistant\n" when add_generation_prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)



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
    # experts as random quantised blocks with bounded scales (Q4_0 / Q8_0), not quantised normal draws:
    # ~100x faster, for shapes too big to draw (the weights' spread is the same: std d**-0.5 or width**-0.5)
    random_expert_blocks: bool = False


SIZES: dict[str, SizeSpec] = {
    "tiny": SizeSpec(2, 128, 4, 2, 32, 8, 2, 64, 512, 512, T.F32, T.F32),
    "small": SizeSpec(4, 256, 8, 2, 32, 16, 4, 256, 1024, 2048, T.F32, T.F32),
    "bench": SizeSpec(8, 1024, 16, 4, 64, 32, 4, 1408, 2048, 8192, T.F16, T.Q8_0),
    # Qwen3-30B-A3B's shape (the capacity issue): 48 layers x 128 experts, top-8; experts Q4_0, ~16 GB
    "30b-a3b": SizeSpec(48, 2048, 32, 4, 128, 128, 8, 768, 4096, 8192, T.F16, T.Q4_0, random_expert_blocks=True),
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


@dataclass(frozen=True)
class MlaDims:
    """deepseek2's attention and FFN shape for a size: nope/rope/value head dims, the latent ranks,
    one leading dense block of ``dense_width``, ``n_shared`` shared experts."""

    d_nope: int
    d_rope: int
    d_v: int
    kv_lora_rank: int
    q_lora_rank: int
    n_dense: int
    dense_width: int
    n_shared: int


def mla_dims(spec: SizeSpec) -> MlaDims:
    """DeepSeek-V2's proportions scaled to the size's head_dim (V2: 128/64/128, kv 512, q 1536).
    q goes through its low-rank bottleneck (V2's layout: llama.cpp 0.3.36 reads V2-Lite's plain
    attn_q only in 26- or 27-block models)."""
    hd = spec.head_dim
    return MlaDims(d_nope=hd, d_rope=hd // 2, d_v=hd, kv_lora_rank=2 * hd, q_lora_rank=3 * hd // 2, n_dense=1,
                   dense_width=3 * spec.expert_width, n_shared=2)


def n_head_kv(arch: Arch, spec: SizeSpec) -> int:
    """OLMoE has as many kv heads as query heads (llama.cpp sizes its k norm by d_model)."""
    return spec.n_head if arch == "olmoe" else 1 if arch == "deepseek2" else spec.n_head_kv


def _plan(arch: Arch, spec: SizeSpec, expert_type: T) -> list[_TensorPlan]:
    d, hd, width, n_exp = spec.d_model, spec.head_dim, spec.expert_width, spec.n_expert
    q_dim, kv_dim = spec.n_head * hd, n_head_kv(arch, spec) * hd
    dense, f32 = spec.dense_type, T.F32
    norm_std = 0.1
    plans = [_TensorPlan("token_embd.weight", (spec.vocab_size, d), dense, 1.0)]
    if arch == "deepseek2":
        return plans + _plan_deepseek2(spec, expert_type)
    if arch == "gpt-oss":
        return plans + _plan_gpt_oss(spec, expert_type)
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        plans += [
            _TensorPlan(b + "attn_norm.weight", (d,), f32, norm_std, is_norm=True),
            _TensorPlan(b + "attn_q.weight", (q_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_k.weight", (kv_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_v.weight", (kv_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_output.weight", (d, q_dim), dense, q_dim**-0.5),
        ]
        if arch == "qwen2moe":  # q/k/v biases (F32, as converted files keep them)
            plans += [_TensorPlan(b + f"attn_{x}.bias", (n,), f32, 0.2) for x, n in (("q", q_dim), ("k", kv_dim),
                                                                                       ("v", kv_dim))]
        if arch == "qwen3moe":  # per-head q/k norms
            plans += [
                _TensorPlan(b + "attn_q_norm.weight", (hd,), f32, norm_std, is_norm=True),
                _TensorPlan(b + "attn_k_norm.weight", (hd,), f32, norm_std, is_norm=True),
            ]
        if arch == "olmoe":  # q/k norms over the whole projection
            plans += [
                _TensorPlan(b + "attn_q_norm.weight", (q_dim,), f32, norm_std, is_norm=True),
                _TensorPlan(b + "attn_k_norm.weight", (kv_dim,), f32, norm_std, is_norm=True),
            ]
        plans += [
            _TensorPlan(b + "ffn_norm.weight", (d,), f32, norm_std, is_norm=True),
            _TensorPlan(b + "ffn_gate_inp.weight", (n_exp, d), f32, d**-0.5),
            _TensorPlan(b + "ffn_gate_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_up_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_down_exps.weight", (n_exp, d, width), expert_type, width**-0.5),
        ]
        if arch == "qwen2moe":  # the sigmoid-gated shared expert (the dense type, like attention)
            sw = SHARED_WIDTH_FACTOR * width
            plans += [
                _TensorPlan(b + "ffn_gate_inp_shexp.weight", (d,), f32, d**-0.5),
                _TensorPlan(b + "ffn_gate_shexp.weight", (sw, d), dense, d**-0.5),
                _TensorPlan(b + "ffn_up_shexp.weight", (sw, d), dense, d**-0.5),
                _TensorPlan(b + "ffn_down_shexp.weight", (d, sw), dense, sw**-0.5),
            ]
    plans += [
        _TensorPlan("output_norm.weight", (d,), f32, norm_std, is_norm=True),
        # logits of std ~2: argmax is scale-free, but top-1/top-2 margins double (robust greedy tests)
        _TensorPlan("output.weight", (spec.vocab_size, d), dense, 2.0 * d**-0.5),
    ]
    return plans


def gpt_oss_window(spec: SizeSpec) -> int:
    """The sliding window of a gpt-oss file (gpt-oss: 128 of a 4096-token original context)."""
    return max(8, spec.context_length // 32)


def _plan_gpt_oss(spec: SizeSpec, expert_type: T) -> list[_TensorPlan]:
    """gpt-oss's blocks (llama.cpp's names): biases on q/k/v/o, the router and the experts (F32), one
    attention-sink logit per head, ``post_attention_norm``."""
    d, hd, width, n_exp, dense, f32 = spec.d_model, spec.head_dim, spec.expert_width, spec.n_expert, spec.dense_type, T.F32
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd
    plans: list[_TensorPlan] = []
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        plans += [
            _TensorPlan(b + "attn_norm.weight", (d,), f32, 0.1, is_norm=True),
            _TensorPlan(b + "attn_q.weight", (q_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_q.bias", (q_dim,), f32, 0.2),
            _TensorPlan(b + "attn_k.weight", (kv_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_k.bias", (kv_dim,), f32, 0.2),
            _TensorPlan(b + "attn_v.weight", (kv_dim, d), dense, d**-0.5),
            _TensorPlan(b + "attn_v.bias", (kv_dim,), f32, 0.2),
            _TensorPlan(b + "attn_output.weight", (d, q_dim), dense, q_dim**-0.5),
            _TensorPlan(b + "attn_output.bias", (d,), f32, 0.05),
            _TensorPlan(b + "attn_sinks.weight", (spec.n_head,), f32, 1.0),
            _TensorPlan(b + "post_attention_norm.weight", (d,), f32, 0.1, is_norm=True),
            _TensorPlan(b + "ffn_gate_inp.weight", (n_exp, d), f32, d**-0.5),
            _TensorPlan(b + "ffn_gate_inp.bias", (n_exp,), f32, 0.2),
            _TensorPlan(b + "ffn_gate_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_gate_exps.bias", (n_exp, width), f32, 0.2),
            _TensorPlan(b + "ffn_up_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_up_exps.bias", (n_exp, width), f32, 0.2),
            _TensorPlan(b + "ffn_down_exps.weight", (n_exp, d, width), expert_type, width**-0.5),
            _TensorPlan(b + "ffn_down_exps.bias", (n_exp, d), f32, 0.05),
        ]
    return plans + [
        _TensorPlan("output_norm.weight", (d,), f32, 0.1, is_norm=True),
        _TensorPlan("output.weight", (spec.vocab_size, d), dense, 2.0 * d**-0.5),
    ]


def _plan_deepseek2(spec: SizeSpec, expert_type: T) -> list[_TensorPlan]:
    """The blocks and head of a deepseek2 file (llama.cpp's tensor names and shapes, numpy order)."""
    m = mla_dims(spec)
    d, H, width, n_exp, dense, f32 = spec.d_model, spec.n_head, spec.expert_width, spec.n_expert, spec.dense_type, T.F32
    qk, sw = m.d_nope + m.d_rope, m.n_shared * width
    plans: list[_TensorPlan] = []
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        plans += [
            _TensorPlan(b + "attn_norm.weight", (d,), f32, 0.1, is_norm=True),
            _TensorPlan(b + "attn_q_a.weight", (m.q_lora_rank, d), dense, d**-0.5),
            _TensorPlan(b + "attn_q_a_norm.weight", (m.q_lora_rank,), f32, 0.1, is_norm=True),
            _TensorPlan(b + "attn_q_b.weight", (H * qk, m.q_lora_rank), dense, m.q_lora_rank**-0.5),
            _TensorPlan(b + "attn_kv_a_mqa.weight", (m.kv_lora_rank + m.d_rope, d), dense, d**-0.5),
            _TensorPlan(b + "attn_kv_a_norm.weight", (m.kv_lora_rank,), f32, 0.1, is_norm=True),
            _TensorPlan(b + "attn_k_b.weight", (H, m.kv_lora_rank, m.d_nope), dense, m.kv_lora_rank**-0.5),
            _TensorPlan(b + "attn_v_b.weight", (H, m.d_v, m.kv_lora_rank), dense, m.kv_lora_rank**-0.5),
            _TensorPlan(b + "attn_output.weight", (d, H * m.d_v), dense, (H * m.d_v) ** -0.5),
            _TensorPlan(b + "ffn_norm.weight", (d,), f32, 0.1, is_norm=True),
        ]
        if i < m.n_dense:
            plans += [
                _TensorPlan(b + "ffn_gate.weight", (m.dense_width, d), dense, d**-0.5),
                _TensorPlan(b + "ffn_up.weight", (m.dense_width, d), dense, d**-0.5),
                _TensorPlan(b + "ffn_down.weight", (d, m.dense_width), dense, m.dense_width**-0.5),
            ]
            continue
        plans += [
            _TensorPlan(b + "ffn_gate_inp.weight", (n_exp, d), f32, d**-0.5),
            _TensorPlan(b + "ffn_gate_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_up_exps.weight", (n_exp, width, d), expert_type, d**-0.5),
            _TensorPlan(b + "ffn_down_exps.weight", (n_exp, d, width), expert_type, width**-0.5),
            _TensorPlan(b + "ffn_gate_shexp.weight", (sw, d), dense, d**-0.5),
            _TensorPlan(b + "ffn_up_shexp.weight", (sw, d), dense, d**-0.5),
            _TensorPlan(b + "ffn_down_shexp.weight", (d, sw), dense, sw**-0.5),
        ]
    return plans + [
        _TensorPlan("output_norm.weight", (d,), f32, 0.1, is_norm=True),
        _TensorPlan("output.weight", (spec.vocab_size, d), dense, 2.0 * d**-0.5),
    ]


def _draw(seed: int, plan: _TensorPlan, shape: tuple[int, ...], expert: int) -> npt.NDArray[np.float32]:
    name_key = int.from_bytes(hashlib.sha256(plan.name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(np.random.SeedSequence([seed, name_key, expert]))
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(plan.std)
    if plan.is_norm:
        x += np.float32(1.0)
    return x


def router_scales(n_expert: int, skew: float) -> npt.NDArray[np.float32]:
    """Per-expert scale of a router's rows for ``--router-skew S``: ``(1 + S) ** (1 - 2e / (n - 1))``,
    so expert 0 has the largest logits (routed most: top-k picks the largest), the last the smallest;
    all ones for S = 0 (the weights then have the bytes they always had)."""
    if n_expert < 2 or skew == 0:
        return np.ones(n_expert, dtype=np.float32)
    e = np.arange(n_expert, dtype=np.float64)
    return ((1.0 + skew) ** (1.0 - 2.0 * e / (n_expert - 1))).astype(np.float32)


# the spread of a block's quants when its bytes are random: Q4_0 holds q - 8 for q uniform in 0..15,
# Q8_0 an int8 uniform in -128..127 (their standard deviations, so scale * std = the plan's std)
_RANDOM_Q_STD: Final = {T.Q4_0: math.sqrt((16**2 - 1) / 12), T.Q8_0: math.sqrt((256**2 - 1) / 12)}
_BLOCK_QUANT_BYTES: Final = {T.Q4_0: 16, T.Q8_0: 32}


def random_blocks(seed: int, plan: _TensorPlan, expert: int) -> npt.NDArray[np.uint8]:
    """One expert of ``plan`` as random Q4_0 / Q8_0 blocks: random quant bytes under a per-block f16
    scale of ``std / std(quants)`` times a factor uniform in [0.75, 1.25] (bounded: every weight is
    finite and within 16x the plan's std). Deterministic in ``(seed, name, expert)``."""
    rows, cols = plan.shape[1:]
    n_blocks = rows * cols // 32
    name_key = int.from_bytes(hashlib.sha256(plan.name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(np.random.SeedSequence([seed, name_key, expert, 1]))
    scales = (plan.std / _RANDOM_Q_STD[plan.qtype] * rng.uniform(0.75, 1.25, n_blocks)).astype(np.float16)
    blocks = np.empty((n_blocks, 2 + _BLOCK_QUANT_BYTES[plan.qtype]), dtype=np.uint8)
    blocks[:, :2] = scales.view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:] = rng.integers(0, 256, size=(n_blocks, _BLOCK_QUANT_BYTES[plan.qtype]), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _tensor_bytes(seed: int, plan: _TensorPlan, router_skew: float = 0.0,
                  random_expert_blocks: bool = False) -> npt.NDArray[np.uint8]:
    """The raw GGUF bytes of one tensor; 3-D expert stacks are drawn and quantised per expert
    (or, with ``random_expert_blocks`` and a Q4_0 / Q8_0 type, made of random blocks)."""
    if len(plan.shape) == 3:
        out = np.empty(plan.byte_shape, dtype=np.uint8)
        fast = random_expert_blocks and plan.qtype in _RANDOM_Q_STD
        for e in range(plan.shape[0]):
            out[e] = random_blocks(seed, plan, e) if fast else quant.quantize(_draw(seed, plan, plan.shape[1:], e), plan.qtype)
        return out
    x = _draw(seed, plan, plan.shape, 0)
    if router_skew and plan.name.endswith("ffn_gate_inp.weight"):
        x *= router_scales(plan.shape[0], router_skew)[:, None]
    return quant.quantize(x, plan.qtype)


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


VOCABS: tuple[str, ...] = ("bpe", "spm")


def _add_metadata(w: gguf.GGUFWriter, arch: Arch, size: SizeName, seed: int, expert_type: T,
                  vocab_kind: str = "bpe") -> None:
    spec = SIZES[size]
    a = GGUF_ARCH[arch]
    w.add_string("general.name", f"moe-swarm-{arch}-{size}-seed{seed}")
    w.add_type("model")
    w.add_uint32(f"{a}.context_length", spec.context_length)
    w.add_uint32(f"{a}.embedding_length", spec.d_model)
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    # the keys each architecture's converter writes (llama.cpp's convert_hf_to_gguf.py)
    if arch == "qwen3moe":
        # Qwen3-MoE's dense intermediate size (unused by the MoE blocks), as in the golden file.
        w.add_uint32(f"{a}.feed_forward_length", 6 * spec.expert_width)
        w.add_uint32(f"{a}.expert_feed_forward_length", spec.expert_width)
    elif arch == "qwen2moe":
        w.add_uint32(f"{a}.feed_forward_length", SHARED_WIDTH_FACTOR * spec.expert_width)
        w.add_uint32(f"{a}.expert_feed_forward_length", spec.expert_width)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", SHARED_WIDTH_FACTOR * spec.expert_width)
    elif arch == "deepseek2":  # DeepseekV2Model (convert_hf_to_gguf.py), MLA with attn_k_b / attn_v_b
        m = mla_dims(spec)
        w.add_uint32(f"{a}.feed_forward_length", m.dense_width)
        w.add_uint32(f"{a}.leading_dense_block_count", m.n_dense)
        w.add_uint32(f"{a}.attention.q_lora_rank", m.q_lora_rank)
        w.add_uint32(f"{a}.attention.kv_lora_rank", m.kv_lora_rank)
        w.add_uint32(f"{a}.attention.key_length_mla", m.d_nope + m.d_rope)
        w.add_uint32(f"{a}.attention.value_length_mla", m.d_v)
        w.add_uint32(f"{a}.expert_feed_forward_length", spec.expert_width)
        w.add_uint32(f"{a}.expert_shared_count", m.n_shared)
        w.add_float32(f"{a}.expert_weights_scale", 1.0)
        w.add_bool(f"{a}.expert_weights_norm", False)
        w.add_uint32(f"{a}.expert_gating_func", 1)  # softmax
    elif arch == "gpt-oss":  # GptOssModel: sliding window, YaRN as gpt-oss ships it (32 over 4096)
        w.add_uint32(f"{a}.feed_forward_length", spec.expert_width)
        w.add_uint32(f"{a}.expert_feed_forward_length", spec.expert_width)
        w.add_uint32(f"{a}.attention.sliding_window", gpt_oss_window(spec))
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", 32.0)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
    else:  # mixtral, olmoe: the expert width is feed_forward_length
        w.add_uint32(f"{a}.feed_forward_length", spec.expert_width)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", n_head_kv(arch, spec))
    if arch == "deepseek2":
        m = mla_dims(spec)
        w.add_uint32(f"{a}.attention.key_length", m.kv_lora_rank + m.d_rope)
        w.add_uint32(f"{a}.attention.value_length", m.kv_lora_rank)
        w.add_uint32(f"{a}.rope.dimension_count", m.d_rope)
    elif arch == "mixtral":
        w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    else:
        w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
        w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    w.add_float32(f"{a}.rope.freq_base", {"olmoe": 10_000.0, "deepseek2": 10_000.0, "gpt-oss": 150_000.0}.get(arch, 1e6))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if arch in ("qwen3moe", "qwen2moe") else 1e-5)
    w.add_uint32(f"{a}.expert_count", spec.n_expert)
    w.add_uint32(f"{a}.expert_used_count", spec.n_expert_used)
    w.add_uint32("general.file_type", int(_FILE_TYPES[expert_type]))
    if expert_type not in _UNQUANTISED:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if vocab_kind == "spm":
        from swarm.tools.spm import add_tokenizer_metadata, spm_metadata

        add_tokenizer_metadata(w, spm_metadata(spec.vocab_size))
        return
    vocab = build_vocab(spec.vocab_size)
    w.add_string("tokenizer.ggml.model", "gpt2")
    pre = {"mixtral": "llama-bpe", "olmoe": "olmo", "deepseek2": "deepseek-llm", "gpt-oss": "gpt-4o"}
    w.add_string("tokenizer.ggml.pre", pre.get(arch, "qwen2"))
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(vocab.token_id("<|im_end|>"))
    w.add_pad_token_id(vocab.token_id("<|endoftext|>"))
    w.add_bos_token_id(vocab.token_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def make_model(
    *, arch: Arch, size: SizeName, seed: int, out: Path, qtype: str | None = None, router_skew: float = 0.0,
    vocab: str = "bpe",
) -> Path:
    """Write the model GGUF to ``out`` (replacing it) and return ``out``.

    ``vocab``: "bpe" (byte-level BPE, ChatML) or "spm" (a SentencePiece vocabulary with byte fallback
    and Mixtral-Instruct's [INST] template, as real Mixtral files carry).
    ``qtype`` (a GGML type name such as ``"Q4_K"``) overrides the expert tensors' type.
    ``router_skew`` >= 0 makes low-index experts hot (``router_scales``; random routers are nearly uniform).
    Raises ``ConfigError`` for an unknown arch, size or type, or a type the size cannot use.
    """
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    if vocab not in VOCABS:
        raise ConfigError(f"unknown vocab {vocab!r}: choose one of {', '.join(VOCABS)}")
    if seed < 0 or seed >= 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {seed}")
    if not 0.0 <= router_skew <= 100.0:
        raise ConfigError(f"--router-skew must be in [0, 100], got {router_skew}")
    expert_type = _parse_qtype(qtype, size)
    spec = SIZES[size]
    if arch in ("qwen2moe", "olmoe") and spec.head_dim * spec.n_head != spec.d_model:
        # llama.cpp sizes these architectures' q and output projections by d_model
        raise ConfigError(f"{arch} needs head_dim x heads = d_model; size {size!r} has "
                          f"{spec.head_dim} x {spec.n_head} != {spec.d_model}")
    plans = _plan(arch, spec, expert_type)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    writer = gguf.GGUFWriter(partial, GGUF_ARCH[arch])
    try:
        _add_metadata(writer, arch, size, seed, expert_type, vocab)
        if router_skew:
            writer.add_float32("moe_swarm.router_skew", router_skew)
        for p in plans:
            writer.add_tensor_info(p.name, p.byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plans:  # one tensor in memory at a time
            writer.write_tensor_data(_tensor_bytes(seed, p, router_skew, SIZES[size].random_expert_blocks))
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# command line (the parser: swarm.tools.cli)


def draft_spec(target: Path) -> tuple[str, str, int, str, float]:
    """(arch, size, seed, vocab, router skew) of a make-model file (``--draft-of``), from its metadata."""
    check_gguf_file(target, "--draft-of")  # missing, not GGUF, cut short: one line each
    try:
        reader = gguf.GGUFReader(target)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--draft-of {target}: not a readable GGUF file ({exc})") from exc

    def field(name: str) -> object:
        f = reader.fields.get(name)
        return None if f is None else f.contents()

    name = str(field("general.name") or "")
    parts = name.split("-")
    if len(parts) < 5 or parts[:2] != ["moe", "swarm"] or not parts[-1].startswith("seed"):
        raise ConfigError(f"--draft-of {target}: not a make-model file (general.name {name!r})")
    arch, size, seed = parts[2], "-".join(parts[3:-1]), int(parts[-1][4:])
    if arch not in ARCHITECTURES or size not in SIZES:
        raise ConfigError(f"--draft-of {target}: unknown arch or size in {name!r}")
    vocab = "spm" if field("tokenizer.ggml.model") == "llama" else "bpe"
    skew = float(field("moe_swarm.router_skew") or 0.0)  # type: ignore[arg-type]
    return arch, size, seed, vocab, skew


def run_make_model(args: argparse.Namespace) -> int:
    """Run a parsed ``make-model`` command; errors propagate as ``SwarmError``."""
    if args.draft_of is not None:
        args.arch, args.size, args.seed, args.vocab, args.router_skew = draft_spec(args.draft_of)
        args.qtype = args.qtype or "Q4_0"
        if SIZES[args.size].random_expert_blocks:
            raise ConfigError(f"--draft-of: size {args.size!r} stores random expert blocks, not quantised weights: "
                              "a draft in another type would not be the same model")
    path = make_model(arch=args.arch, size=args.size, seed=args.seed, out=args.out, qtype=args.qtype,
                      router_skew=args.router_skew, vocab=args.vocab)
    expert_type = _parse_qtype(args.qtype, args.size)
    print(
        f"wrote {path}: {args.arch} {args.size} seed={args.seed} experts={expert_type.name} "
        f"params={count_parameters(args.arch, args.size)} bytes={path.stat().st_size}"
    )
    return 0
