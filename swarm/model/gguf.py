"""GGUF model loading (shell: reads and memory-maps a file).

Rules:
- Metadata drives everything: dimensions, expert counts, RoPE style and norms come from the GGUF
  keys of the file's architecture and the architecture table below; nothing is hard-coded per model.
- Weights stay in their stored type. The file is memory-mapped copy-on-write; tensors are exposed as
  zero-copy uint8/float views of the map. Expert stacks are dequantised per use (``ExpertStack``);
  the small dense tensors (norms, attention, router) are materialised once as float32 — a zero-copy
  view when they are stored as F32.
- Anything unsupported fails at load with an error that names what is supported.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import gguf
import numpy as np
import torch

from swarm.errors import ModelError, UnsupportedArchitecture, UnsupportedTensorType
from swarm.model.kernels.dense import Embedding, Linear
from swarm.model.quant import dequantize_raw

if TYPE_CHECKING:
    from swarm.model.kernels import KernelBackend

__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "ExpertStack",
    "GGUFModel",
    "MlaConfig",
    "MlaWeights",
    "ModelConfig",
    "QTensor",
    "RopeScaling",
    "SharedExpert",
    "file_sha256",
    "model_id_for",
]

# what llama.cpp's common quantisations write for MoE files; ggml's kernels compute all of them, the
# torch reference path (``--kernel torch``) dequantises them (its own torch code for the common ones,
# gguf's numpy reference for the rest)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")


QkNorm = Literal["none", "head", "full"]


@dataclass(frozen=True)
class ArchSpec:
    """What differs between MoE architectures, as data (add an entry to support a new one).

    Biases (``attn_{q,k,v,output}.bias``) are read wherever the file has them, as llama.cpp does for
    the architectures that may carry them; the entries below say what the architecture *requires*.
    """

    name: str
    rope_neox: bool  # NEOX (rotate halves) vs adjacent pairs
    qk_norm: QkNorm  # RMSNorm of q and k before RoPE: per head, over the whole projection, or none
    norm_topk: bool  # renormalise the top-k router weights
    # a shared expert beside the routed ones (``ffn_{gate,up,down}_shexp``), computed by the coordinator;
    # "sigmoid": its output is scaled by sigmoid(ffn_gate_inp_shexp . x) (qwen2moe)
    shared_expert: Literal["none", "plain", "sigmoid"] = "none"
    qkv_bias: bool = False  # attn_{q,k,v}.bias are required
    expert_ff_key: str = "expert_feed_forward_length"
    # when ``expert_ff_key`` is absent: feed_forward_length / expert_used_count (qwen2moe), else an error
    expert_ff_from_n_ff: bool = False
    shared_ff_key: str = "expert_shared_feed_forward_length"  # absent: feed_forward_length
    # DeepSeek-V2 style: the shared experts' width is expert_shared_count x the expert width
    shared_ff_from_count: bool = False
    # "mla": multi-head latent attention (DeepSeek-V2: compressed KV, split rope/nope head dims,
    # attn_k_b/attn_v_b absorbed as llama.cpp does, one latent "kv head"); "mha": q/k/v projections
    attention: Literal["mha", "mla"] = "mha"
    # metadata that may turn on the top-k renormalisation (DeepSeek: expert_weights_norm), else norm_topk
    norm_topk_key: str | None = None
    # "softmax": softmax over all experts, then top-k; "softmax_topk" (gpt-oss): top-k of the raw
    # logits, then a softmax over those k (llama.cpp's SOFTMAX_WEIGHT gating)
    gating: Literal["softmax", "softmax_topk"] = "softmax"
    ffn_norm_name: str = "ffn_norm"  # gpt-oss: post_attention_norm (llama.cpp's ATTN_POST_NORM)
    # sliding-window attention on every layer il with il % pattern < pattern - 1 (llama.cpp's default
    # pattern; 0: no sliding window), window from attention.sliding_window
    swa_pattern: int = 0
    attn_sinks: bool = False  # one learned logit per head joins each softmax (attn_sinks.weight)
    # the routed experts' activation, carried by manifests and slices to volunteers
    # (``swarm.model.kernels.EXPERT_ACTIVATIONS``); every architecture so far: silu(gate) * up
    expert_activation: str = "silu"


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec("qwen3moe", rope_neox=True, qk_norm="head", norm_topk=True),
    # Mixtral-style: arch "llama" with merged expert tensors; expert width is feed_forward_length.
    "llama": ArchSpec("llama", rope_neox=False, qk_norm="none", norm_topk=True, expert_ff_key="feed_forward_length"),
    # Qwen1.5-MoE / Qwen2-57B-A14B: q/k/v biases, a sigmoid-gated shared expert, top-k weights as the
    # softmax gave them (llama.cpp never renormalises them for this architecture)
    "qwen2moe": ArchSpec("qwen2moe", rope_neox=True, qk_norm="none", norm_topk=False, shared_expert="sigmoid",
                         qkv_bias=True, expert_ff_from_n_ff=True),
    # OLMoE: q/k RMSNorm over the whole projection (all heads at once), no renormalisation, expert
    # width from feed_forward_length
    "olmoe": ArchSpec("olmoe", rope_neox=True, qk_norm="full", norm_topk=False, expert_ff_key="feed_forward_length"),
    # DeepSeek-V2 / V2-Lite: multi-head latent attention, adjacent-pair RoPE on the rope dims only,
    # leading dense FFN layers (leading_dense_block_count), expert_shared_count shared experts, softmax
    # gating scaled by expert_weights_scale, renormalised only where expert_weights_norm says so
    "deepseek2": ArchSpec("deepseek2", rope_neox=False, qk_norm="none", norm_topk=False, shared_expert="plain",
                          shared_ff_from_count=True, attention="mla", norm_topk_key="expert_weights_norm"),
    # gpt-oss: attention sinks, sliding-window attention on alternate layers, biases on q/k/v/o, the
    # router and the experts, top-k of the router logits then softmax over k, the clamped SwiGLU
    "gpt-oss": ArchSpec("gpt-oss", rope_neox=True, qk_norm="none", norm_topk=False, gating="softmax_topk",
                        ffn_norm_name="post_attention_norm", swa_pattern=2, attn_sinks=True,
                        expert_activation="swiglu_oai"),
}


@dataclass(frozen=True)
class RopeScaling:
    """ggml_rope_ext's context-extension parameters, as llama.cpp derives them from the GGUF
    (``rope.scaling.*``; llama-context.cpp): none/linear scale the positions by ``freq_scale``; YaRN
    (``ext_factor`` 1) mixes interpolated and extrapolated frequencies between the correction dims
    of ``beta_fast``/``beta_slow`` at ``n_ctx_orig`` and scales cos/sin by ``attn_factor``."""

    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    yarn_log_mul: float = 0.0  # DeepSeek's mscale_all_dim (MLA's score scale uses it)


def _f32(x: float) -> np.float32:
    return np.float32(x)


# the rope.scaling.yarn_* keys llama.cpp reads for an architecture (llama-model.cpp / src/models/*): the
# ext/attn factors and betas only for architectures we do not support (grok, mistral3), the log
# multiplier for deepseek2; for the others its defaults hold whatever a file says
_YARN_LOG_MUL_ARCHS = frozenset({"deepseek2"})


def rope_scaling(fields: dict[str, Any], arch: str, n_ctx_train: int) -> RopeScaling:
    """llama.cpp's derivation of the RoPE scaling parameters (float32 arithmetic, as in C)."""
    kind = str(_field(fields, f"{arch}.rope.scaling.type", "linear"))
    if kind not in ("none", "linear", "yarn"):
        raise UnsupportedArchitecture(f"{arch} with RoPE scaling {kind!r} is not supported (none, linear, yarn)")
    factor = float(_field(fields, f"{arch}.rope.scaling.factor", 0.0) or _field(fields, f"{arch}.rope.scale_linear", 0.0))
    freq_scale = _f32(1.0) if kind == "none" or factor == 0.0 else _f32(1.0) / _f32(factor)
    ext = 1.0 if kind == "yarn" else 0.0
    log_mul = _f32(float(_field(fields, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
                   if arch in _YARN_LOG_MUL_ARCHS else 0.0)
    if arch == "deepseek2" and log_mul != 0:
        log_mul = log_mul / _f32(0.1)  # llama.cpp cancels the factor its converter wrote
    attn = _f32(1.0)
    if ext != 0:
        def get_mscale(scale: np.float32, mscale: np.float32) -> np.float32:
            return _f32(1.0) if scale <= 1 else _f32(0.1) * mscale * np.log(scale) + _f32(1.0)

        f = _f32(1.0) / freq_scale
        if log_mul != 0:
            mscale, mscale_all = _f32(1.0), log_mul
            if arch == "deepseek2" and mscale_all != 1:
                mscale = mscale_all
            attn = get_mscale(f, mscale) / get_mscale(f, mscale_all)
        else:
            attn = get_mscale(f, _f32(1.0))
        attn = attn * (_f32(1.0) / (_f32(1.0) + _f32(0.1) * np.log(f)))
    attn = attn * _f32(float(_field(fields, f"{arch}.rope.scaling.attn_factor", 1.0)))
    return RopeScaling(
        freq_scale=float(freq_scale), ext_factor=float(ext), attn_factor=float(attn),
        beta_fast=32.0,
        beta_slow=1.0,
        n_ctx_orig=int(_field(fields, f"{arch}.rope.scaling.original_context_length", n_ctx_train)),
        yarn_log_mul=float(log_mul))


def mla_kq_scale(rope: RopeScaling, d_qk: int) -> float:
    """DeepSeek-V2's attention score scale (llama.cpp's deepseek2 graph): YaRN's magnitude
    correction, squared, over sqrt(nope + rope dims)."""
    fs = _f32(rope.freq_scale)
    org = _f32(rope.attn_factor) * (_f32(1.0) + _f32(0.1) * np.log(_f32(1.0) / fs))
    mscale = org * (_f32(1.0) + _f32(0.1) * _f32(rope.yarn_log_mul) * np.log(_f32(1.0) / fs))
    return float(_f32(1.0) * mscale * mscale / np.sqrt(_f32(d_qk)))


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek-V2's attention dimensions: per head ``d_nope + d_rope`` query/key dims (RoPE on the
    last ``d_rope``), ``d_v`` value dims; K/V compressed to ``kv_lora_rank`` (+ the shared rope part);
    queries through a ``q_lora_rank`` bottleneck (0: one plain projection, ``attn_q``)."""

    kv_lora_rank: int
    q_lora_rank: int
    d_nope: int
    d_rope: int
    d_v: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_ctx_train: int
    d_model: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    n_expert: int
    n_expert_used: int
    d_expert: int
    rope_base: float
    rms_eps: float
    spec: ArchSpec
    d_shared: int = 0  # the shared expert's width (0: none)
    # the blocks with routed experts, in order; "expert layer" i (slices, manifests, dispatch maps) is
    # block moe_layers[i]. Every block but DeepSeek's leading dense ones.
    moe_layers: tuple[int, ...] = ()
    d_ff_dense: int = 0  # the FFN width of the dense blocks (feed_forward_length)
    norm_topk: bool = False  # renormalise the top-k weights
    expert_weights_scale: float = 1.0  # the top-k weights are multiplied by this (when not 0 or 1)
    mla: MlaConfig | None = None
    kq_scale: float = 0.0  # the attention's score scale (0: 1/sqrt(head_dim_k))
    rope: RopeScaling = RopeScaling()
    n_swa: int = 0  # the sliding window (tokens), for the blocks in swa_layers
    swa_layers: tuple[int, ...] = ()
    # group-limited routing (DeepSeek-V2/V2.5: expert_group_count 8, expert_group_used_count 3): only
    # the n_group_used groups with the largest sums of their two best experts take part in the top-k
    n_expert_groups: int = 0
    n_group_used: int = 0

    @property
    def n_moe_layer(self) -> int:
        return len(self.moe_layers)


def file_sha256(path: Path, chunk: int = 1 << 22, *, drop_cache: bool = False) -> str:
    """The file's sha256, read in ``chunk`` pieces; ``drop_cache`` tells the kernel to drop each piece
    from the page cache once hashed (hashing a 17 GB model must not leave 17 GB of it cached)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        at = 0
        while block := f.read(chunk):
            h.update(block)
            if drop_cache:
                drop_pages(f.fileno(), at, len(block))
            at += len(block)
    return h.hexdigest()


def drop_pages(fd: int, offset: int, length: int) -> None:
    """Advise the kernel to drop a file range from the page cache (best effort; Linux)."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        try:
            fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


_READAHEAD_SLACK = 8 << 20


def pread_chunks(path: Path, spans: Iterable[tuple[int, int]], piece: int = 1 << 20,
                 drop_every: int = 64 << 20) -> Iterator[bytes]:
    """The bytes of ``(offset, length)`` spans of a file, ``piece`` bytes at a time, read with
    ``pread`` (never through a memory map, so the reader's RSS does not grow) and dropped from the page
    cache: once at the end, each range the spans covered (spans closer than the readahead slack are one
    range; and what readahead fetched past it), and during a long read every ``drop_every`` bytes. Readahead is switched off for the descriptor
    (``POSIX_FADV_RANDOM``: each piece is one large read anyway): an asynchronous readahead still in
    flight when the pages are dropped would otherwise land in the cache afterwards.

    Dropping is batched because each ``POSIX_FADV_DONTNEED`` drains every CPU's page lists (work on
    each CPU, waited for): dropped after every piece and span, a 30b-a3b backbone's disk checks spent
    65 % of their thread in it and half of both CPUs in the kernel."""
    fd = os.open(path, os.O_RDONLY)
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        try:
            fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass
    groups: list[list[int]] = []  # [lo, hi) ranges read, spans closer than the readahead slack merged
    since = 0  # bytes read since the last drop
    try:
        for offset, length in spans:
            end = offset + length
            g = groups[-1] if groups else None
            if g is not None and g[0] - _READAHEAD_SLACK <= offset <= g[1] + _READAHEAD_SLACK:
                g[0], g[1] = min(g[0], offset), max(g[1], end)
            else:
                groups.append([offset, end])
            at = offset
            while at < end:
                n = min(piece, end - at)
                block = os.pread(fd, n, at)
                if len(block) != n:
                    raise ModelError(f"{path}: short read at {at} ({len(block)} of {n} bytes)")
                yield block
                at += n
                since += n
                if since >= drop_every:  # a long read: what it cached so far, less the last piece (readahead)
                    for glo, ghi in groups:
                        drop_pages(fd, glo, max(0, min(ghi, at - n) - glo))
                    since = 0
    finally:
        for glo, ghi in groups:  # each range read and what readahead fetched past it
            drop_pages(fd, glo, ghi - glo + _READAHEAD_SLACK)
        os.close(fd)


def model_id_for(path: Path, sha256: str | None = None) -> str:
    """DESIGN §11: ``<GGUF file stem>-<first 12 hex digits of its sha256>``."""
    digest = sha256 if sha256 is not None else file_sha256(path)
    return f"{Path(path).stem}-{digest[:12]}"


@dataclass(frozen=True)
class QTensor:
    """A tensor as stored in the GGUF: raw bytes (zero-copy view) + ggml type + logical shape.

    ``shape`` is numpy order (the last dimension is the contiguous row), e.g. an expert stack is
    ``(n_expert, rows, cols)``. ``raw`` is a uint8 array shaped ``(*shape[:-1], bytes_per_row)``.
    """

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray[Any, np.dtype[np.uint8]]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def to_float(self) -> torch.Tensor:
        """Dequantise the whole tensor to float32 (zero-copy when stored as F32)."""
        return dequantize_raw(torch.from_numpy(self.raw), self.qtype, self.shape)

    def select(self, index: int) -> QTensor:
        """The sub-tensor ``[index]`` along the first axis (zero-copy)."""
        return QTensor(f"{self.name}[{index}]", self.qtype, self.shape[1:], self.raw[index])


class ExpertStack:
    """The three expert tensors of one layer (or a slice of them), dequantised per use.

    ``gate(e)``/``up(e)`` are ``[d_expert, d_model]``, ``down(e)`` is ``[d_model, d_expert]``, all
    float32, for local expert index ``e`` (0-based within the stack). ``biases`` (gpt-oss): the
    F32 ``gate``/``up`` ``[n_expert, d_expert]`` and ``down`` ``[n_expert, d_model]`` bias rows;
    ``activation``: what joins gate and up (``swarm.model.kernels.EXPERT_ACTIVATIONS``).
    """

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, *,
                 biases: tuple[QTensor, QTensor, QTensor] | None = None, activation: str = "silu") -> None:
        if not (gate.shape[0] == up.shape[0] == down.shape[0]):
            raise ModelError("expert tensors disagree on the number of experts")
        self.gate_t, self.up_t, self.down_t = gate, up, down
        self.n_expert = gate.shape[0]
        self.d_expert, self.d_model = gate.shape[1], gate.shape[2]
        if up.shape[1:] != gate.shape[1:] or down.shape[1:] != (self.d_model, self.d_expert):
            raise ModelError(f"expert tensors shapes disagree: {gate.shape} {up.shape} {down.shape}")
        if biases is not None:
            want = ((self.n_expert, self.d_expert), (self.n_expert, self.d_expert), (self.n_expert, self.d_model))
            if tuple(b.shape for b in biases) != want or any(b.qtype != gguf.GGMLQuantizationType.F32 for b in biases):
                raise ModelError(f"expert biases must be F32 {want}, got {[b.shape for b in biases]}")
        self.biases = biases
        self.activation = activation

    def experts(self, lo: int, hi: int) -> ExpertStack:
        """Experts ``lo..hi-1`` of this stack (zero-copy views)."""
        if (lo, hi) == (0, self.n_expert):
            return self

        def sub(t: QTensor) -> QTensor:
            return QTensor(t.name, t.qtype, (hi - lo, *t.shape[1:]), t.raw[lo:hi])

        gate, up, down = (sub(t) for t in (self.gate_t, self.up_t, self.down_t))
        biases = None if self.biases is None else (sub(self.biases[0]), sub(self.biases[1]), sub(self.biases[2]))
        return ExpertStack(gate, up, down, biases=biases, activation=self.activation)

    def _get(self, t: QTensor, e: int) -> torch.Tensor:
        return dequantize_raw(torch.from_numpy(t.raw[e]), t.qtype, t.shape[1:])

    def gate(self, e: int) -> torch.Tensor:
        return self._get(self.gate_t, e)

    def up(self, e: int) -> torch.Tensor:
        return self._get(self.up_t, e)

    def down(self, e: int) -> torch.Tensor:
        return self._get(self.down_t, e)

    def bias(self, kind: int, e: int) -> torch.Tensor | None:
        """Expert ``e``'s bias row of kind 0 (gate), 1 (up) or 2 (down); None without biases."""
        return None if self.biases is None else self._get(self.biases[kind], e)

    def tensors(self) -> dict[str, QTensor]:
        """The stack's tensors by slice kind: ``gate``, ``up``, ``down``, then ``gate_b``, ``up_b``,
        ``down_b`` when it has biases (the order slices store them in)."""
        out = {"gate": self.gate_t, "up": self.up_t, "down": self.down_t}
        if self.biases is not None:
            out.update(zip(("gate_b", "up_b", "down_b"), self.biases, strict=True))
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def bytes_per_expert(self) -> int:
        return self.nbytes // max(1, self.n_expert)


def _field(fields: dict[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in fields:
        return fields[key]
    if required:
        raise ModelError(f"GGUF metadata key {key!r} is missing")
    return default


@dataclass(frozen=True)
class SharedExpert:
    """A layer's shared (always-on) expert: ``down(silu(gate x) * up x)``, times ``sigmoid(gate_inp . x)``
    where the architecture gates it (``gate_inp`` then holds ``ffn_gate_inp_shexp``, a ``[d_model]`` vector)."""

    gate: Linear
    up: Linear
    down: Linear
    gate_inp: torch.Tensor | None


@dataclass(frozen=True)
class MlaWeights:
    """A block's multi-head latent attention weights (DeepSeek-V2): ``wq_a``/``q_a_norm``/``wq_b`` (or
    the block's ``wq`` when ``q_lora_rank`` is 0), ``wkv_a`` ``[kv_lora + d_rope, d_model]``,
    ``kv_a_norm``, and ``wk_b`` ``(H, kv_lora, d_nope)`` / ``wv_b`` ``(H, d_v, kv_lora)`` as stored."""

    wq_a: Linear | None
    q_a_norm: torch.Tensor | None
    wq_b: Linear | None
    wkv_a: Linear
    kv_a_norm: torch.Tensor
    wk_b: QTensor
    wv_b: QTensor


@dataclass(frozen=True)
class LayerWeights:
    """One block. ``wk``/``wv`` are None with MLA (``mla``); ``router``/``experts`` are None in a
    dense block, whose FFN is ``shared``; otherwise ``shared`` is the shared expert, if any."""

    attn_norm: torch.Tensor
    wq: Linear | None
    wk: Linear | None
    wv: Linear | None
    wo: Linear
    q_norm: torch.Tensor | None  # [head_dim_k] (per head) or [n_head * head_dim_k] (whole projection)
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    router: Linear | None
    experts: ExpertStack | None
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    shared: SharedExpert | None = None
    mla: MlaWeights | None = None
    router_b: torch.Tensor | None = None  # gpt-oss: the router's bias
    sinks: torch.Tensor | None = None  # gpt-oss: one attention-sink logit per head


class GGUFModel:
    """A loaded MoE GGUF: config, tokenizer metadata, dense weights and per-layer expert stacks."""

    def __init__(self, path: str | Path, *, compute_id: bool = True, kernel: KernelBackend | None = None) -> None:
        from swarm.model.kernels import DEFAULT_BACKEND

        self.path = Path(path)
        self.kernel = kernel if kernel is not None else DEFAULT_BACKEND  # dense and expert kernels
        try:
            self.reader = gguf.GGUFReader(self.path, "c")
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read GGUF {self.path}: {exc}") from exc
        self.fields: dict[str, Any] = {}
        for k, f in self.reader.fields.items():
            try:
                self.fields[k] = f.contents()
            except Exception:  # noqa: BLE001 - a field we cannot decode is just absent
                continue
        self.sha256 = file_sha256(self.path, drop_cache=True) if compute_id else ""
        self.model_id = model_id_for(self.path, self.sha256) if compute_id else self.path.stem
        self.tensors: dict[str, QTensor] = {}
        for t in self.reader.tensors:
            qtype = gguf.GGMLQuantizationType(t.tensor_type)
            if qtype.name not in SUPPORTED_TYPES:
                raise UnsupportedTensorType(
                    f"tensor {t.name} of {self.path.name} has type {qtype.name}, which moe-swarm cannot compute; "
                    f"supported: {', '.join(SUPPORTED_TYPES)}"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = t.data
            raw = data.view(np.uint8).reshape(*shape[:-1], -1)
            self.tensors[t.name] = QTensor(t.name, qtype, shape, raw)
        self.config = self._read_config()
        self.layers = [self._layer(i) for i in range(self.config.n_layer)]
        self.token_embd = Embedding(self.tensor("token_embd.weight"), self.kernel)
        self.output_norm = self._dense("output_norm.weight")
        self.output = self._linear("output.weight" if "output.weight" in self.tensors else "token_embd.weight")

    # -- config -----------------------------------------------------------------------------
    def _read_config(self) -> ModelConfig:
        f = self.fields
        arch = str(_field(f, "general.architecture", required=True))
        spec = ARCHITECTURES.get(arch)
        if spec is None:
            raise UnsupportedArchitecture(
                f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        n_expert = int(_field(f, f"{arch}.expert_count", 0))
        if n_expert <= 0:
            raise UnsupportedArchitecture(f"{arch} model without experts ({arch}.expert_count missing): not an MoE")
        d_model = int(_field(f, f"{arch}.embedding_length", required=True))
        n_head = int(_field(f, f"{arch}.attention.head_count", required=True))
        n_head_kv = int(_field(f, f"{arch}.attention.head_count_kv", n_head))
        head_dim_k = int(_field(f, f"{arch}.attention.key_length", d_model // n_head))
        head_dim_v = int(_field(f, f"{arch}.attention.value_length", head_dim_k))
        tokens = _field(f, "tokenizer.ggml.tokens", [])
        n_vocab = len(tokens) if tokens else self.tensors["token_embd.weight"].shape[0]
        # llama.cpp runs block_count - nextn_predict_layers blocks (the rest are multi-token prediction)
        n_layer = int(_field(f, f"{arch}.block_count", required=True)) - int(_field(f, f"{arch}.nextn_predict_layers", 0))
        n_dense = int(_field(f, f"{arch}.leading_dense_block_count", 0))
        if not 0 <= n_dense < n_layer:
            raise ModelError(f"{arch}.leading_dense_block_count {n_dense} leaves no MoE block of {n_layer}")
        n_used = int(_field(f, f"{arch}.expert_used_count", required=True))
        d_expert = self._expert_width(arch, spec, n_used)
        if spec.shared_expert == "none":
            d_shared = 0
        elif spec.shared_ff_from_count:
            d_shared = int(_field(f, f"{arch}.expert_shared_count", 0)) * d_expert
        else:
            d_shared = int(_field(f, f"{arch}.{spec.shared_ff_key}", 0) or _field(f, f"{arch}.feed_forward_length", 0))
        mla = self._mla(arch) if spec.attention == "mla" else None
        n_ctx_train = int(_field(f, f"{arch}.context_length", 2048))
        rope = rope_scaling(f, arch, n_ctx_train)
        n_swa = int(_field(f, f"{arch}.attention.sliding_window", 0)) if spec.swa_pattern else 0
        raw_pattern = _field(f, f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
        # llama.cpp: a per-layer bool array, or n (layer il slides when il % n < n - 1; 0: every layer)
        swa_flags = [bool(x) for x in raw_pattern] if isinstance(raw_pattern, list) else None
        swa_pattern = 0 if swa_flags is not None else int(raw_pattern)
        if spec.swa_pattern and n_swa <= 0:
            raise ModelError(f"{arch}: {arch}.attention.sliding_window is missing")
        if float(_field(f, f"{arch}.rope.freq_base_swa", _field(f, f"{arch}.rope.freq_base", 10000.0))) != \
                float(_field(f, f"{arch}.rope.freq_base", 10000.0)):
            raise UnsupportedArchitecture(f"{arch} with another RoPE base on its sliding-window layers is not supported")
        n_groups = int(_field(f, f"{arch}.expert_group_count", 0))
        if n_groups > 1 and (n_expert % n_groups or not 0 < int(_field(f, f"{arch}.expert_group_used_count", 0)) <= n_groups):
            raise ModelError(f"{arch}: expert_group_count {n_groups} and expert_group_used_count do not fit "
                             f"{n_expert} experts")
        if any(t.endswith("exp_probs_b.bias") for t in self.tensors):
            raise UnsupportedArchitecture(f"{arch} with an expert selection bias (exp_probs_b, DeepSeek-V3 style) "
                                          "is not supported")
        gating = int(_field(f, f"{arch}.expert_gating_func", 1))
        if gating != 1:  # llama.cpp: 1 softmax, 2 sigmoid (DeepSeek-V3), 3 softmax of the top-k
            raise UnsupportedArchitecture(f"{arch} with expert_gating_func {gating} (not softmax) is not supported")
        cfg = ModelConfig(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            d_model=d_model,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_rot=int(_field(f, f"{arch}.rope.dimension_count", head_dim_k)),
            n_expert=n_expert,
            n_expert_used=n_used,
            d_expert=d_expert,
            rope_base=float(_field(f, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(_field(f, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            spec=spec,
            d_shared=d_shared,
            moe_layers=tuple(range(n_dense, n_layer)),
            d_ff_dense=int(_field(f, f"{arch}.feed_forward_length", 0)) if n_dense else 0,
            norm_topk=bool(_field(f, f"{arch}.{spec.norm_topk_key}", spec.norm_topk)) if spec.norm_topk_key
            else spec.norm_topk,
            expert_weights_scale=float(_field(f, f"{arch}.expert_weights_scale", 0.0) or 1.0),
            mla=mla,
            kq_scale=mla_kq_scale(rope, mla.d_nope + mla.d_rope) if mla is not None else 0.0,
            rope=rope,
            n_swa=n_swa,
            n_expert_groups=n_groups if n_groups > 1 else 0,
            n_group_used=int(_field(f, f"{arch}.expert_group_used_count", 0)) if n_groups > 1 else 0,
            swa_layers=tuple(i for i in range(n_layer) if spec.swa_pattern and n_swa and (
                swa_flags[i] if swa_flags is not None and i < len(swa_flags) else
                swa_flags is None and (swa_pattern == 0 or i % swa_pattern < swa_pattern - 1))),
        )
        if spec.shared_expert != "none" and cfg.d_shared <= 0 and not spec.shared_ff_from_count:
            raise ModelError(f"{arch}: the shared expert's width ({arch}.{spec.shared_ff_key} or "
                             f"{arch}.feed_forward_length) is missing")
        if n_dense and cfg.d_ff_dense <= 0:
            raise ModelError(f"{arch}: {arch}.feed_forward_length (the dense blocks' width) is missing")
        if n_head % n_head_kv != 0:
            raise ModelError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        if not 0 < cfg.n_expert_used <= cfg.n_expert:
            raise ModelError(f"expert_used_count {cfg.n_expert_used} out of range for {cfg.n_expert} experts")
        return cfg

    def _mla(self, arch: str) -> MlaConfig:
        f = self.fields
        key_mla, val_mla = f"{arch}.attention.key_length_mla", f"{arch}.attention.value_length_mla"
        if key_mla not in f or val_mla not in f:
            raise UnsupportedArchitecture(
                f"{arch} file without {key_mla} / {val_mla}: a GGUF converted before llama.cpp split attn_kv_b "
                "into attn_k_b and attn_v_b; convert the model again with a current llama.cpp")
        d_rope = int(_field(f, f"{arch}.rope.dimension_count", required=True))
        kv_lora = int(_field(f, f"{arch}.attention.kv_lora_rank", required=True))
        mla = MlaConfig(kv_lora_rank=kv_lora, q_lora_rank=int(_field(f, f"{arch}.attention.q_lora_rank", 0)),
                        d_nope=int(f[key_mla]) - d_rope, d_rope=d_rope, d_v=int(f[val_mla]))
        hk, hv, hkv = (int(_field(f, f"{arch}.attention.{k}", 0)) for k in ("key_length", "value_length", "head_count_kv"))
        if (hk, hv, hkv) != (kv_lora + d_rope, kv_lora, 1) or mla.d_nope <= 0:
            raise ModelError(f"{arch}: MLA needs key_length = kv_lora_rank + rope dims ({kv_lora + d_rope}), "
                             f"value_length = kv_lora_rank ({kv_lora}) and one kv head; the file says "
                             f"{hk}, {hv}, {hkv}")
        return mla

    def _expert_width(self, arch: str, spec: ArchSpec, n_used: int) -> int:
        f = self.fields
        key = f"{arch}.{spec.expert_ff_key}"
        if key in f or not spec.expert_ff_from_n_ff:
            return int(_field(f, key, required=True))
        n_ff = int(_field(f, f"{arch}.feed_forward_length", required=True))  # llama.cpp: n_ff / n_expert_used
        return n_ff // max(1, n_used)

    # -- tensors ----------------------------------------------------------------------------
    def tensor(self, name: str) -> QTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"tensor {name!r} missing from {self.path.name}")
        return t

    def _dense(self, name: str) -> torch.Tensor:
        return self.tensor(name).to_float()

    def _linear(self, name: str) -> Linear:
        return Linear(self.tensor(name), self.kernel)

    def _optional(self, name: str) -> torch.Tensor | None:
        return self._dense(name) if name in self.tensors else None

    def _ffn(self, p: str, suffix: str, width: int, gate_inp: str | None = None) -> SharedExpert:
        ffn = SharedExpert(gate=self._linear(f"{p}ffn_gate{suffix}.weight"), up=self._linear(f"{p}ffn_up{suffix}.weight"),
                           down=self._linear(f"{p}ffn_down{suffix}.weight"),
                           gate_inp=self._dense(p + gate_inp).reshape(-1) if gate_inp is not None else None)
        if (ffn.gate.out_features, ffn.down.in_features) != (width, width):
            raise ModelError(f"{p}ffn_*{suffix}: the tensors are not {width} wide")
        return ffn

    def _layer(self, i: int) -> LayerWeights:
        p = f"blk.{i}."
        cfg = self.config
        spec = cfg.spec
        moe = i in cfg.moe_layers
        if spec.qkv_bias:
            for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
                self.tensor(p + b)  # required: a clear error when missing
        shared = None
        if not moe:  # a leading dense block: its whole FFN, computed like a shared expert
            shared = self._ffn(p, "", cfg.d_ff_dense)
        elif spec.shared_expert != "none" and cfg.d_shared > 0:
            shared = self._ffn(p, "_shexp", cfg.d_shared,
                               "ffn_gate_inp_shexp.weight" if spec.shared_expert == "sigmoid" else None)
        qk = spec.qk_norm != "none"
        mha = spec.attention == "mha"
        return LayerWeights(
            attn_norm=self._dense(p + "attn_norm.weight"),
            wq=self._linear(p + "attn_q.weight") if mha or f"{p}attn_q.weight" in self.tensors else None,
            wk=self._linear(p + "attn_k.weight") if mha else None,
            wv=self._linear(p + "attn_v.weight") if mha else None,
            wo=self._linear(p + "attn_output.weight"),
            q_norm=self._dense(p + "attn_q_norm.weight") if qk else None,
            k_norm=self._dense(p + "attn_k_norm.weight") if qk else None,
            ffn_norm=self._dense(f"{p}{spec.ffn_norm_name}.weight"),
            router=self._linear(p + "ffn_gate_inp.weight") if moe else None,
            experts=self._stack(i) if moe else None,
            bq=self._optional(p + "attn_q.bias"),
            bk=self._optional(p + "attn_k.bias"),
            bv=self._optional(p + "attn_v.bias"),
            bo=self._optional(p + "attn_output.bias"),
            shared=shared,
            mla=self._mla_weights(p) if not mha else None,
            router_b=self._optional(p + "ffn_gate_inp.bias") if moe else None,
            sinks=self._dense(p + "attn_sinks.weight").reshape(-1) if spec.attn_sinks else None,
        )

    def _mla_weights(self, p: str) -> MlaWeights:
        mla = self.config.mla
        assert mla is not None
        H = self.config.n_head
        low_rank_q = mla.q_lora_rank > 0
        w = MlaWeights(
            wq_a=self._linear(p + "attn_q_a.weight") if low_rank_q else None,
            q_a_norm=self._dense(p + "attn_q_a_norm.weight") if low_rank_q else None,
            wq_b=self._linear(p + "attn_q_b.weight") if low_rank_q else None,
            wkv_a=self._linear(p + "attn_kv_a_mqa.weight"),
            kv_a_norm=self._dense(p + "attn_kv_a_norm.weight"),
            wk_b=self.tensor(p + "attn_k_b.weight"),
            wv_b=self.tensor(p + "attn_v_b.weight"),
        )
        want = {"attn_k_b": (H, mla.kv_lora_rank, mla.d_nope), "attn_v_b": (H, mla.d_v, mla.kv_lora_rank)}
        for name, t in (("attn_k_b", w.wk_b), ("attn_v_b", w.wv_b)):
            if t.shape != want[name]:
                raise ModelError(f"{p}{name}.weight has shape {t.shape}, MLA needs {want[name]}")
        if w.wkv_a.out_features != mla.kv_lora_rank + mla.d_rope:
            raise ModelError(f"{p}attn_kv_a_mqa.weight is not kv_lora_rank + rope dims wide")
        return w

    def _stack(self, block: int) -> ExpertStack:
        kinds = ("gate", "up", "down")
        p = f"blk.{block}."
        if f"{p}ffn_gate_exps.weight" not in self.tensors and f"{p}ffn_gate.0.weight" in self.tensors:
            raise UnsupportedArchitecture(
                f"{self.path.name} stores each expert as its own tensor ({p}ffn_gate.0.weight, an old Mixtral "
                "conversion); moe-swarm reads merged expert tensors (ffn_gate_exps): convert the model again with "
                "a current llama.cpp")
        names = [f"{p}ffn_{k}_exps.bias" for k in kinds]
        have = [n in self.tensors for n in names]
        if any(have) and not all(have):
            raise ModelError(f"{p}: expert biases come for gate, up and down together")
        biases = (self.tensor(names[0]), self.tensor(names[1]), self.tensor(names[2])) if all(have) else None
        return ExpertStack(*(self.tensor(f"{p}ffn_{k}_exps.weight") for k in kinds), biases=biases,
                           activation=self.config.spec.expert_activation)

    def expert_stack(self, layer: int, lo: int = 0, hi: int | None = None) -> ExpertStack:
        """Experts ``lo..hi-1`` of expert layer ``layer`` (block ``config.moe_layers[layer]``) as a
        zero-copy ``ExpertStack``."""
        if not 0 <= layer < self.config.n_moe_layer:
            raise ModelError(f"expert layer {layer} out of range: the model has {self.config.n_moe_layer}")
        stack = self.layers[self.config.moe_layers[layer]].experts
        assert stack is not None
        return stack.experts(lo, stack.n_expert if hi is None else hi)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def file_span(self, arr: np.ndarray[Any, np.dtype[np.uint8]]) -> tuple[int, int]:
        """``(offset, length)`` in the GGUF file of a contiguous view of its mapped data (a tensor's
        ``raw`` or a slice of its first axis), for ``pread_chunks``."""
        base = int(self.reader.data.ctypes.data)
        addr = int(arr.ctypes.data)
        if not arr.flags.c_contiguous or not base <= addr <= base + int(self.reader.data.nbytes) - int(arr.nbytes):
            raise ModelError("not a contiguous view of this model's file")
        return addr - base, int(arr.nbytes)
