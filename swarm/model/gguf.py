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
    "ModelConfig",
    "QTensor",
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
}


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


def pread_chunks(path: Path, spans: Iterable[tuple[int, int]], piece: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of ``(offset, length)`` spans of a file, ``piece`` bytes at a time, read with
    ``pread`` (never through a memory map, so the reader's RSS does not grow) and dropped from the page
    cache after each piece."""
    fd = os.open(path, os.O_RDONLY)
    done: list[tuple[int, int]] = []
    try:
        for offset, length in spans:
            end = offset + length
            at = offset
            while at < end:
                n = min(piece, end - at)
                block = os.pread(fd, n, at)
                if len(block) != n:
                    raise ModelError(f"{path}: short read at {at} ({len(block)} of {n} bytes)")
                yield block
                # the range read so far, less the last piece (readahead may still be filling it)
                drop_pages(fd, offset, max(0, at - offset))
                at += n
            done.append((offset, length))
    finally:
        for offset, length in done:  # the whole spans and what readahead fetched past them
            drop_pages(fd, offset, length + _READAHEAD_SLACK)
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
    float32, for local expert index ``e`` (0-based within the stack).
    """

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor) -> None:
        if not (gate.shape[0] == up.shape[0] == down.shape[0]):
            raise ModelError("expert tensors disagree on the number of experts")
        self.gate_t, self.up_t, self.down_t = gate, up, down
        self.n_expert = gate.shape[0]
        self.d_expert, self.d_model = gate.shape[1], gate.shape[2]
        if up.shape[1:] != gate.shape[1:] or down.shape[1:] != (self.d_model, self.d_expert):
            raise ModelError(f"expert tensor shapes disagree: {gate.shape} {up.shape} {down.shape}")

    def experts(self, lo: int, hi: int) -> ExpertStack:
        """Experts ``lo..hi-1`` of this stack (zero-copy views)."""
        if (lo, hi) == (0, self.n_expert):
            return self
        return ExpertStack(*(QTensor(t.name, t.qtype, (hi - lo, *t.shape[1:]), t.raw[lo:hi])
                             for t in (self.gate_t, self.up_t, self.down_t)))

    def _get(self, t: QTensor, e: int) -> torch.Tensor:
        return dequantize_raw(torch.from_numpy(t.raw[e]), t.qtype, t.shape[1:])

    def gate(self, e: int) -> torch.Tensor:
        return self._get(self.gate_t, e)

    def up(self, e: int) -> torch.Tensor:
        return self._get(self.up_t, e)

    def down(self, e: int) -> torch.Tensor:
        return self._get(self.down_t, e)

    @property
    def nbytes(self) -> int:
        return self.gate_t.nbytes + self.up_t.nbytes + self.down_t.nbytes

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
class LayerWeights:
    attn_norm: torch.Tensor
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    q_norm: torch.Tensor | None  # [head_dim_k] (per head) or [n_head * head_dim_k] (whole projection)
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    router: Linear
    experts: ExpertStack
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    shared: SharedExpert | None = None


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
        self.token_embd = Embedding(self.tensor("token_embd.weight"))
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
        cfg = ModelConfig(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=int(_field(f, f"{arch}.context_length", 2048)),
            d_model=d_model,
            n_layer=int(_field(f, f"{arch}.block_count", required=True)),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_rot=int(_field(f, f"{arch}.rope.dimension_count", head_dim_k)),
            n_expert=n_expert,
            n_expert_used=int(_field(f, f"{arch}.expert_used_count", required=True)),
            d_expert=self._expert_width(arch, spec, int(_field(f, f"{arch}.expert_used_count", 1))),
            rope_base=float(_field(f, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(_field(f, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            spec=spec,
            d_shared=int(_field(f, f"{arch}.{spec.shared_ff_key}", 0) or _field(f, f"{arch}.feed_forward_length", 0))
            if spec.shared_expert != "none" else 0,
        )
        if spec.shared_expert != "none" and cfg.d_shared <= 0:
            raise ModelError(f"{arch}: the shared expert's width ({arch}.{spec.shared_ff_key} or "
                             f"{arch}.feed_forward_length) is missing")
        if n_head % n_head_kv != 0:
            raise ModelError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        if not 0 < cfg.n_expert_used <= cfg.n_expert:
            raise ModelError(f"expert_used_count {cfg.n_expert_used} out of range for {cfg.n_expert} experts")
        return cfg

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

    def _layer(self, i: int) -> LayerWeights:
        p = f"blk.{i}."
        spec = self.config.spec
        if spec.qkv_bias:
            for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
                self.tensor(p + b)  # required: a clear error when missing
        shared = None
        if spec.shared_expert != "none":
            shared = SharedExpert(
                gate=self._linear(p + "ffn_gate_shexp.weight"), up=self._linear(p + "ffn_up_shexp.weight"),
                down=self._linear(p + "ffn_down_shexp.weight"),
                gate_inp=self._dense(p + "ffn_gate_inp_shexp.weight").reshape(-1)
                if spec.shared_expert == "sigmoid" else None)
            if (shared.gate.out_features, shared.down.in_features) != (self.config.d_shared, self.config.d_shared):
                raise ModelError(f"blk.{i}: shared expert tensors are not {self.config.d_shared} wide")
        qk = spec.qk_norm != "none"
        return LayerWeights(
            attn_norm=self._dense(p + "attn_norm.weight"),
            wq=self._linear(p + "attn_q.weight"),
            wk=self._linear(p + "attn_k.weight"),
            wv=self._linear(p + "attn_v.weight"),
            wo=self._linear(p + "attn_output.weight"),
            q_norm=self._dense(p + "attn_q_norm.weight") if qk else None,
            k_norm=self._dense(p + "attn_k_norm.weight") if qk else None,
            ffn_norm=self._dense(p + "ffn_norm.weight"),
            router=self._linear(p + "ffn_gate_inp.weight"),
            experts=self.expert_stack(i),
            bq=self._optional(p + "attn_q.bias"),
            bk=self._optional(p + "attn_k.bias"),
            bv=self._optional(p + "attn_v.bias"),
            bo=self._optional(p + "attn_output.bias"),
            shared=shared,
        )

    def expert_stack(self, layer: int, lo: int = 0, hi: int | None = None) -> ExpertStack:
        """Experts ``lo..hi-1`` of a layer as a zero-copy ``ExpertStack``."""
        stack = ExpertStack(*(self.tensor(f"blk.{layer}.ffn_{kind}_exps.weight") for kind in ("gate", "up", "down")))
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
