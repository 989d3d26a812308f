"""The backbone forward pass (owned by the engine thread).

Rules:
- Only the engine thread calls ``Transformer.forward``; it owns the KV caches.
- A forward step batches tokens from many sequences: every dense op (norms, projections, router,
  output) runs once over all rows; attention runs per sequence against its own KV cache.
- The routed experts of a layer are computed by one replaceable object, ``ExpertBackend.moe``: the
  local backend calls each layer's ``swarm.model.kernels.ExpertKernel``; a dispatcher may send rows to volunteers.
- With the ggml kernels (the default) each layer's dense halves are one ggml graph each
  (``coordinator.engine.block``: norm, q/k/v, q/k norms and RoPE; output projection, residual, norm,
  router softmax), attention is ggml's on in-place views of the KV cache (V kept transposed, the view
  padded to ``KV_PAD`` rows as llama.cpp pads its own) and the head is one graph: llama.cpp's own ops, so its
  numbers (tests: within 1.6e-6 of llama.cpp on Q8_0, Q4_0 and Q4_K_M files). The torch path (the
  reference backend) computes the same math with torch ops.
- A step whose every layer is computed here (``ExpertBackend.whole_layer_here`` for every expert layer,
  one group, up to ``STACK_MAX_ROWS`` padded rows: decode and prefill chunks alike) runs as one ggml
  graph from token ids to logits (``coordinator.engine.stack``), built once per shape (a prefill: per
  bucket) and rebound per step: the per-layer graphs' bits (tested on every architecture), no Python
  between layers. Runs of local layers between remote ones are one graph each; several groups take
  the per-layer path. The gates ``select_np`` does not compute (gpt-oss's top-k softmax, DeepSeek's
  groups) are ggml ops on both paths (``Gate``, the fused MoE's), so both give the same bits.
- Numerics follow llama.cpp: RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``; NEOX or adjacent-pair RoPE
  per architecture; q/k/v biases where the file has them; q/k RMSNorm before RoPE per head or over
  the whole projection where the architecture has it; GQA maps query head h to kv head
  ``h // (n_head / n_head_kv)``; router softmax over all experts, top-k, and renormalisation of the
  top-k weights where the architecture asks for it.
- A shared expert (qwen2moe's, sigmoid-gated) is not routed: the coordinator computes it (in the
  ``AttnOut`` graph with ggml) and adds it to the routed sum before the residual, as llama.cpp does.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from coordinator.core.pipeline import group_cuts
from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.dispatch.layer import LayerCall, ThreadWaker, Waker
from coordinator.engine.attention import Attention
from coordinator.engine.block import (
    AttnIn,
    AttnOut,
    AttnOutMoE,
    DenseWeight,
    Family,
    Gate,
    Head,
    HeadWeights,
    MlaIn,
    RoutedExperts,
    SharedFFN,
    SharedOut,
)
from coordinator.engine.stack import LayerSpec, StackGraph
from swarm.model.gguf import GGUFModel, LayerWeights, ModelConfig, QTensor, SharedExpert
from swarm.model.kernels import KernelBackend, compute_threads
from swarm.model.kernels.dense import Linear

__all__ = ["KV_TYPES", "ExpertBackend", "KVCache", "LocalExperts", "SeqChunk", "Transformer"]


class ExpertBackend(Protocol):
    """Computes a layer's routed experts, through the one layer path of ``coordinator.dispatch.layer``
    (``coordinator.dispatch.dispatcher.Dispatcher`` is the implementation; ``LocalExperts`` is one
    that is not serving: every expert computed here):

    - ``whole_layer_here(layer, n_pairs)``: would it compute this whole layer of ``n_pairs`` routed
      pairs on this machine right now? Then the engine computes it itself, inside the layer's
      AttnOut graph (``AttnOutMoE``: the same bits), and ``ran_here`` hears of it afterwards;
    - ``begin`` starts a layer (its placement is known when it returns), ``service`` computes the
      local work placed here on the calling thread (True once the layer has ended), ``result``
      waits and combines: what the engine computes in between overlaps the remote calls;
    - ``may_go_remote(layer)``: could any of the layer's routed experts be computed elsewhere now
      (then the engine computes a shared expert while they are in flight);
    - ``groups(n_seqs, n_rows)``: into how many groups of sessions the engine splits a step, each
      advancing through the layers on its own (one's dense half while another's experts are remote).
    """

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool: ...

    def ran_here(self, layer: int, ids: np.ndarray, seconds: float) -> None: ...

    def begin(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, *, waker: Waker | None = None
              ) -> LayerCall: ...

    def service(self, call: LayerCall) -> bool: ...

    def result(self, call: LayerCall) -> np.ndarray: ...

    def moe(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray: ...

    def groups(self, n_seqs: int, n_rows: int) -> int: ...

    def may_go_remote(self, layer: int) -> bool: ...


class LocalExperts(Dispatcher):
    """All experts of every expert layer computed on this machine: a dispatcher that is not serving
    (the same layer path, every range placed here)."""

    def __init__(self, model: GGUFModel, kernel: KernelBackend | None = None) -> None:
        super().__init__(model, None, kernel=kernel or model.kernel)


KV_TYPES: dict[str, torch.dtype] = {"f16": torch.float16, "f32": torch.float32}


class KVCache:
    """Per-sequence K/V for every layer: K ``[n_layer, n_ctx, n_head_kv, head_dim_k]``, V transposed
    ``[n_layer, n_head_kv, head_dim_v, n_ctx]`` (llama.cpp's layout without flash attention: the
    attention's V product reads each (head, dim) row over the positions in place).

    ``dtype`` float16 (the coordinator's default, like llama.cpp's) halves the cache; float32 keeps
    K/V exact (the tests that compare logits with llama.cpp's F32-KV goldens use it).
    """

    def __init__(self, cfg: ModelConfig, n_ctx: int, dtype: torch.dtype = torch.float32) -> None:
        self.n_ctx = n_ctx
        self.k = torch.zeros(cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim_k, dtype=dtype)
        self.v = torch.zeros(cfg.n_layer, cfg.n_head_kv, cfg.head_dim_v, n_ctx, dtype=dtype)
        self.k_np, self.v_np = self.k.numpy(), self.v.numpy()  # the same memory
        self.hi = 0  # rows hi.. are zero in every layer (the ggml attention reads a padded view)

    def begin(self, used: int) -> None:
        """A step will leave this sequence at ``used`` positions: rows a previous, longer sequence
        left behind are zeroed (so a padded attention view never reads its numbers)."""
        if self.hi > used:
            self.k[:, used : self.hi] = 0
            self.v[:, :, :, used : self.hi] = 0
        self.hi = used

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's rows (K and V of every layer)."""
        return self.nbytes // self.n_ctx

    def copy_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[0, n)`` (K ``[n_layer, n, ...]``, V ``[..., n]``), copied out (a kept prefix)."""
        return self.k[:, :n].clone(), self.v[..., :n].clone()

    def load_rows(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        """Rows ``[0, n)`` from ``copy_rows``'s tensors (bit for bit); the zeroed tail moves past them."""
        self.k[:, :n] = k[:, :n]
        self.v[..., :n] = v[..., :n]
        self.hi = max(self.hi, n)


@dataclass
class SeqChunk:
    """Tokens of one sequence fed in this step, starting at position ``pos``."""

    cache: KVCache
    tokens: list[int]
    pos: int
    all_logits: bool = False  # logits at every position (tests) instead of the last only


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _biased(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b


def shared_ffn(sh: SharedExpert, h: torch.Tensor) -> torch.Tensor:
    """A shared expert on rows ``h`` (the torch path): ``down(silu(gate h) * up h)``, scaled by
    ``sigmoid(gate_inp . h)`` where it is gated."""
    y = sh.down(torch.nn.functional.silu(sh.gate(h)) * sh.up(h))
    if sh.gate_inp is not None:
        y = y * torch.sigmoid(h @ sh.gate_inp).unsqueeze(-1)
    return y


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy()


def _dw(lin: Linear) -> DenseWeight:
    t = lin.weight
    return DenseWeight(np.ascontiguousarray(t.raw).reshape(-1), int(t.qtype), lin.out_features, lin.in_features)


def _dwo(lin: Linear | None) -> DenseWeight | None:
    return None if lin is None else _dw(lin)


def _hw(t: QTensor) -> HeadWeights:
    return HeadWeights(np.ascontiguousarray(t.raw).reshape(-1), int(t.qtype), *t.shape)


def _attn_in(cfg: ModelConfig, L: LayerWeights, fam: Family) -> AttnIn | MlaIn:
    if L.mla is not None and cfg.mla is not None:
        m, mc = L.mla, cfg.mla
        return MlaIn(attn_norm=L.attn_norm.numpy(), wq=_dwo(L.wq), wq_a=_dwo(m.wq_a), q_a_norm=_np(m.q_a_norm),
                     wq_b=_dwo(m.wq_b), wkv_a=_dw(m.wkv_a), kv_a_norm=m.kv_a_norm.numpy(), wk_b=_hw(m.wk_b),
                     n_head=cfg.n_head, kv_lora_rank=mc.kv_lora_rank, d_nope=mc.d_nope, d_rope=mc.d_rope,
                     rope_neox=cfg.spec.rope_neox, rope_base=cfg.rope_base, eps=cfg.rms_eps, rope=cfg.rope,
                     family=fam)
    assert L.wq is not None and L.wk is not None and L.wv is not None
    return AttnIn(
        attn_norm=L.attn_norm.numpy(), wq=_dw(L.wq), wk=_dw(L.wk), wv=_dw(L.wv),
        q_norm=_np(L.q_norm), k_norm=_np(L.k_norm), qk_norm_full=cfg.spec.qk_norm == "full",
        bq=_np(L.bq), bk=_np(L.bk), bv=_np(L.bv),
        n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v,
        n_rot=cfg.n_rot, rope_neox=cfg.spec.rope_neox, rope_base=cfg.rope_base, eps=cfg.rms_eps, rope=cfg.rope,
        family=fam)


def plain_softmax_gate(cfg: ModelConfig) -> bool:
    """Top-k of the router's softmax without expert groups: the gate ``select_np`` and the fused MoE
    graph compute (not gpt-oss's top-k-then-softmax, not DeepSeek's groups)."""
    return cfg.spec.gating == "softmax" and cfg.n_expert_groups <= 1


ATTN_BIG_WORK = 16_000_000  # attention multiply-accumulates from which it uses every thread (prefill)
FUSED_MAX_ROWS = 16  # steps of up to this many rows compute a local layer's MoE inside its AttnOut graph
STACK_MAX_ROWS = 1024  # a step's rows (each sequence's padded to its attention's bucket) in one stack graph
KV_PAD = 32  # the attention view covers the used rows rounded up to this (llama.cpp pads its view too)


class _GgmlDense:
    """The ggml graphs of every layer's dense halves and the head (``coordinator.engine.block``)."""

    stack: StackGraph | None

    def __init__(self, model: GGUFModel) -> None:
        cfg = model.config
        self.attn_in: list[AttnIn | MlaIn] = []
        self.attn_out: list[AttnOut] = []
        fam: Family = {}  # layers of equal shapes and types share their graphs (and graph buffers)
        for L in model.layers:
            self.attn_in.append(_attn_in(cfg, L, fam))
            sh = L.shared
            self.attn_out.append(AttnOut(
                wo=_dw(L.wo), ffn_norm=L.ffn_norm.numpy(), router=_dwo(L.router), eps=cfg.rms_eps, bo=_np(L.bo),
                shared=None if sh is None else SharedFFN(_dw(sh.gate), _dw(sh.up), _dw(sh.down), _np(sh.gate_inp)),
                v_b=_hw(L.mla.wv_b) if L.mla is not None else None, router_b=_np(L.router_b),
                softmax=cfg.spec.gating == "softmax", family=fam))
        # decode-sized steps of a layer whose experts are all computed here: the routed MoE joins the
        # AttnOut graph (AttnOutMoE), for every gate (the ones select_np does not compute: Gate's ops)
        self.attn_out_moe: list[AttnOutMoE | None] = [None] * cfg.n_layer
        self.gate: Gate | None = None  # the per-layer path's top-k for gpt-oss's and DeepSeek's grouped gates
        for li, L in enumerate(model.layers):
            st = L.experts
            if st is None or L.router is None or st.activation not in ("silu", "swiglu_oai"):
                continue
            sh = L.shared
            ex = RoutedExperts(
                gate=st.gate_t.raw, up=st.up_t.raw, down=st.down_t.raw,
                types=(int(st.gate_t.qtype), int(st.up_t.qtype), int(st.down_t.qtype)),
                n_expert=st.n_expert, width=st.d_expert, k=cfg.n_expert_used, norm_topk=cfg.norm_topk,
                scale=cfg.expert_weights_scale, activation=st.activation, gating=cfg.spec.gating,
                n_group=cfg.n_expert_groups, n_group_used=cfg.n_group_used,
                biases=None if st.biases is None else tuple(  # type: ignore[arg-type]
                    np.ascontiguousarray(b.raw).reshape(-1) for b in st.biases))
            self.attn_out_moe[li] = AttnOutMoE(
                experts=ex, max_rows=FUSED_MAX_ROWS, wo=_dw(L.wo), ffn_norm=L.ffn_norm.numpy(), router=_dwo(L.router),
                eps=cfg.rms_eps, bo=_np(L.bo),
                shared=None if sh is None else SharedFFN(_dw(sh.gate), _dw(sh.up), _dw(sh.down), _np(sh.gate_inp)),
                v_b=_hw(L.mla.wv_b) if L.mla is not None else None, router_b=_np(L.router_b),
                softmax=cfg.spec.gating == "softmax", family=fam)
            if self.gate is None and not plain_softmax_gate(cfg):
                self.gate = Gate(experts=ex)
        # layers with a shared expert: their AttnOut without it, and the shared expert alone, computed while
        # the routed experts are remote (the same ops: the same bits)
        self.attn_out_routed: list[AttnOut | None] = [None] * cfg.n_layer
        self.shared_out: list[SharedOut | None] = [None] * cfg.n_layer
        for li, L in enumerate(model.layers):
            sh = L.shared
            if sh is None or L.router is None or L.experts is None:
                continue
            self.attn_out_routed[li] = AttnOut(
                wo=_dw(L.wo), ffn_norm=L.ffn_norm.numpy(), router=_dwo(L.router), eps=cfg.rms_eps, bo=_np(L.bo),
                shared=None, v_b=_hw(L.mla.wv_b) if L.mla is not None else None, router_b=_np(L.router_b),
                softmax=cfg.spec.gating == "softmax", family=fam)
            self.shared_out[li] = SharedOut(shared=SharedFFN(_dw(sh.gate), _dw(sh.up), _dw(sh.down), _np(sh.gate_inp)),
                                            d=cfg.d_model, family=fam)
        self.head = Head(output_norm=model.output_norm.numpy(), output=_dw(model.output), eps=cfg.rms_eps)
        self.attn = Attention(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim_k=cfg.head_dim_k,
                              head_dim_v=cfg.head_dim_v, kv_pad=KV_PAD, scale=cfg.kq_scale)
        # steps whose every layer is computed here: all layers in one graph
        moe_of = {b: i for i, b in enumerate(cfg.moe_layers)}
        specs: list[LayerSpec] = []
        swa = frozenset(cfg.swa_layers)
        for li, L in enumerate(model.layers):
            ml = moe_of.get(li)
            fused = self.attn_out_moe[li]
            if (ml is not None and fused is None) or (ml is None and self.attn_out[li].n_expert):
                break  # a layer the stack does not compute: every step takes the per-layer path
            specs.append(LayerSpec(attn_in=self.attn_in[li], moe=fused if ml is not None else None, moe_layer=ml,
                                   dense=self.attn_out[li] if ml is None else None, window=cfg.n_swa if li in swa else 0,
                                   sinks=_np(L.sinks)))
        emb = model.token_embd.table
        self.stack = StackGraph(
            specs, self.attn, self.head, DenseWeight(np.ascontiguousarray(emb.raw).reshape(-1), int(emb.qtype), *emb.shape),
            max_rows=STACK_MAX_ROWS) if len(specs) == cfg.n_layer else None


@dataclass(eq=False)
class _Group:
    """Some of a step's sequences (contiguous) advancing through the layers on their own: their rows'
    state, the next layer to run and the MoE layer in flight."""

    chunks: list[SeqChunk]
    bounds: list[tuple[int, int]]  # rows of each chunk within ``xn``
    xn: np.ndarray
    pos: np.ndarray
    layer: int = 0  # the next layer whose dense half runs
    pending: LayerCall | None = None
    shared: np.ndarray | None = None
    here: list[bool] | None = None  # whole_layer_here per expert layer, asked at the step's start

    def finish(self, experts: ExpertBackend) -> None:
        """The started layer's MoE into the residual (llama.cpp: (routed + shared) + residual, float32 adds)."""
        if self.pending is None:
            return
        moe = experts.result(self.pending)
        self.pending = None
        if self.shared is not None:
            moe = moe + self.shared
            self.shared = None
        self.xn = self.xn + moe


class Transformer:
    def __init__(self, model: GGUFModel, experts: ExpertBackend | None = None) -> None:
        self.model = model
        self.cfg = model.config
        self.experts: ExpertBackend = experts if experts is not None else LocalExperts(model)
        cfg = self.cfg
        self._swa = frozenset(cfg.swa_layers)
        # block -> expert layer (None: a dense block)
        self._moe_of: list[int | None] = [None] * cfg.n_layer
        for i, b in enumerate(cfg.moe_layers):
            self._moe_of[b] = i
        n_rot = cfg.n_rot
        # float64 frequencies, cast at use: matches llama.cpp's float32 rope within ~1e-7
        self._inv_freq = cfg.rope_base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
        r = cfg.rope  # ggml_rope_yarn_corr_dims

        def corr(beta: float) -> float:
            return n_rot * math.log(r.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

        self._yarn_dims = ((max(0.0, math.floor(corr(r.beta_fast))), min(n_rot - 1.0, math.ceil(corr(r.beta_slow))))
                           if r.ext_factor != 0.0 else (0.0, 0.0))
        # ggml: each layer's dense halves and the head are one graph each (llama.cpp's own ops)
        self._ggml = _GgmlDense(model) if model.kernel is KernelBackend.GGML else None
        self._np_select = plain_softmax_gate(cfg)

    # -- pieces -----------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[T, H, hd]`` at positions ``pos[T]`` (first n_rot dims), with ggml's position
        scaling and YaRN (``cfg.rope``; ggml's rope_yarn in float64)."""
        n_rot = self.cfg.n_rot
        r = self.cfg.rope
        extrap = pos.to(torch.float64).unsqueeze(1) * self._inv_freq.unsqueeze(0)  # [T, n_rot/2]
        ang = extrap * r.freq_scale
        mscale = r.attn_factor
        if r.ext_factor != 0.0:
            lo, hi = self._yarn_dims
            ramp = 1.0 - ((torch.arange(n_rot // 2, dtype=torch.float64) - lo) / max(0.001, hi - lo)).clamp(0, 1)
            mix = ramp * r.ext_factor
            ang = ang * (1 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / r.freq_scale)
        cos = (ang.cos() * mscale).to(torch.float32).unsqueeze(1)
        sin = (ang.sin() * mscale).to(torch.float32).unsqueeze(1)
        xr, rest = x[..., :n_rot], x[..., n_rot:]
        if self.cfg.spec.rope_neox:
            half = n_rot // 2
            a, b = xr[..., :half], xr[..., half:]
            rot = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot

    def _qkv(self, L: LayerWeights, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roped q ``[n, H, hdk]``, k ``[n, Hkv, hdk]`` and v ``[n, Hkv, hdv]`` of an MHA/GQA block."""
        cfg = self.cfg
        n_tok = h.shape[0]
        assert L.wq is not None and L.wk is not None and L.wv is not None
        q, k, v = _biased(L.wq(h), L.bq), _biased(L.wk(h), L.bk), _biased(L.wv(h), L.bv)
        full = cfg.spec.qk_norm == "full"
        if full and L.q_norm is not None and L.k_norm is not None:  # over the whole projection
            q = rms_norm(q, L.q_norm, cfg.rms_eps)
            k = rms_norm(k, L.k_norm, cfg.rms_eps)
        q = q.view(n_tok, cfg.n_head, cfg.head_dim_k)
        k = k.view(n_tok, cfg.n_head_kv, cfg.head_dim_k)
        v = v.view(n_tok, cfg.n_head_kv, cfg.head_dim_v)
        if not full and L.q_norm is not None and L.k_norm is not None:  # per head
            q = rms_norm(q, L.q_norm, cfg.rms_eps)
            k = rms_norm(k, L.k_norm, cfg.rms_eps)
        return self._rope(q, pos), self._rope(k, pos), v

    def _mla_qkv(self, L: LayerWeights, h: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA with attn_k_b absorbed, as llama.cpp: q ``[n, H, kv_lora + d_rope]``, k ``[n, 1, kv_lora +
        d_rope]``, v ``[n, 1, kv_lora]`` (the normed latent); RoPE on the last ``d_rope`` dims only."""
        cfg, m = self.cfg, L.mla
        assert m is not None and cfg.mla is not None
        mc, n_tok = cfg.mla, h.shape[0]
        if L.wq is not None:
            q = L.wq(h)
        else:
            assert m.wq_a is not None and m.wq_b is not None and m.q_a_norm is not None
            q = m.wq_b(rms_norm(m.wq_a(h), m.q_a_norm, cfg.rms_eps))
        q = q.view(n_tok, cfg.n_head, mc.d_nope + mc.d_rope)
        q_nope, q_pe = q[..., : mc.d_nope], q[..., mc.d_nope :]
        kv = m.wkv_a(h)
        kv_c, k_pe = kv[:, : mc.kv_lora_rank], kv[:, mc.kv_lora_rank :].reshape(n_tok, 1, mc.d_rope)
        q_pe, k_pe = self._rope(q_pe, pos), self._rope(k_pe, pos)
        kv_c = rms_norm(kv_c, m.kv_a_norm, cfg.rms_eps)
        kb = m.wk_b.to_float()  # [H, kv_lora, d_nope]
        q_abs = torch.bmm(kb, q_nope.permute(1, 2, 0)).permute(2, 0, 1)  # [n, H, kv_lora]
        q = torch.cat([q_abs, q_pe], dim=-1)
        k = torch.cat([kv_c.unsqueeze(1), k_pe], dim=-1)
        return q, k, kv_c.unsqueeze(1)

    def route(self, block: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts and weights of rows ``h`` (the torch path; ggml computes the probabilities
        in the layer's graph and selects with ``select``)."""
        L = self.model.layers[block]
        assert L.router is not None
        logits = L.router(h)
        if L.router_b is not None:
            logits = logits + L.router_b
        return self.select(torch.softmax(logits, dim=-1) if self.cfg.spec.gating == "softmax" else logits)

    def select(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts and their weights from router probabilities (logits for a "softmax_topk"
        gate): ``select_np`` for the plain softmax gate (a decode step's handful of rows costs a few
        microseconds in numpy against ~50 in torch's small ops), ``select_torch`` otherwise; the
        two give the same bits (tested)."""
        if self._np_select:
            ids, w = self.select_np(probs.numpy())
            return torch.from_numpy(ids), torch.from_numpy(w)
        return self.select_torch(probs)

    def select_arrays(self, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``select`` from and to numpy (the ggml path): ``select_np`` for the plain softmax gate."""
        if self._np_select:
            return self.select_np(probs)
        ids, w = self.select_torch(torch.from_numpy(probs))
        return ids.numpy(), w.numpy()

    def select_torch(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of router probabilities (for a "softmax_topk" gate: of the logits, then a softmax
        over those k); renormalised as llama.cpp does (the sum in double, one float32 division)
        where the architecture asks for it, then scaled by the model's ``expert_weights_scale`` (a
        float32 multiply, as ggml_scale) unless it is 1."""
        cfg = self.cfg
        if cfg.n_expert_groups > 1:  # llama.cpp: groups ranked by the sum of their two best, the rest out
            per = cfg.n_expert // cfg.n_expert_groups
            grouped = probs.view(probs.shape[0], cfg.n_expert_groups, per)
            score = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, groups]
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(cfg.n_group_used, dim=-1).indices, True)
            sel = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(probs)
            ids = torch.topk(sel, cfg.n_expert_used, dim=-1).indices
            w = probs.gather(1, ids)
        else:
            w, ids = torch.topk(probs, cfg.n_expert_used, dim=-1)
        if self.cfg.spec.gating == "softmax_topk":
            w = torch.softmax(w, dim=-1)
        if self.cfg.norm_topk:
            w = w / w.double().sum(-1, keepdim=True).float()
        if self.cfg.expert_weights_scale != 1.0:
            w = w * torch.tensor(self.cfg.expert_weights_scale, dtype=torch.float32)
        return ids, w

    def select_np(self, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``select_torch`` in numpy, for the plain softmax gate: the same numbers -- top-k in
        descending order (ties to the lower index), the renormalisation's sum in double over that
        order and one float32 division, the float32 scale."""
        cfg = self.cfg
        k = cfg.n_expert_used
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, ids, axis=1)
        if cfg.norm_topk:
            w = w / w.astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
        if cfg.expert_weights_scale != 1.0:
            w = w * np.float32(cfg.expert_weights_scale)
        return ids, w

    # -- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """Run one step over all chunks; returns per chunk logits ``[n_tokens or 1, n_vocab]``."""
        bounds, tokens, pos = self._inputs(chunks)
        if self._ggml is not None:
            return [torch.from_numpy(a) for a in self._forward_ggml(self._ggml, chunks, bounds, tokens, pos)]
        return self._forward_torch(chunks, bounds, self.model.token_embd(torch.from_numpy(tokens)), torch.from_numpy(pos))

    def forward_np(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        """``forward``'s logits as float32 numpy arrays: on the ggml kernels no torch op at all when the step is
        one graph (the engine thread's decode path: after a graph the interpreter's caches are cold, and
        torch's dispatch and inference mode cost tens of microseconds a step there)."""
        if self._ggml is None:
            return [t.to(torch.float32).numpy() for t in self.forward(chunks)]
        bounds, tokens, pos = self._inputs(chunks)
        return self._forward_ggml(self._ggml, chunks, bounds, tokens, pos)

    @staticmethod
    def _inputs(chunks: list[SeqChunk]) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
        """Each chunk's rows in the step, the step's token ids and positions."""
        bounds: list[tuple[int, int]] = []
        start = 0
        for c in chunks:
            if c.pos + len(c.tokens) > c.cache.n_ctx:
                raise ValueError(f"sequence exceeds the context ({c.pos + len(c.tokens)} > {c.cache.n_ctx})")
            bounds.append((start, start + len(c.tokens)))
            start += len(c.tokens)
        tokens = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64, count=start)
        if all(len(c.tokens) == 1 for c in chunks):  # a decode step: one row each
            pos = np.fromiter((c.pos for c in chunks), dtype=np.int64, count=start)
        else:
            pos = np.concatenate([np.arange(c.pos, c.pos + len(c.tokens), dtype=np.int64) for c in chunks])
        return bounds, tokens, pos

    def _forward_ggml(self, gd: _GgmlDense, chunks: list[SeqChunk], bounds: list[tuple[int, int]], tokens: np.ndarray,
                      pos: np.ndarray) -> list[np.ndarray]:
        """Each layer: one graph to q/k/v, the new rows into the caches, one attention graph for every
        sequence, one graph to the router; the experts through ``self.experts``. numpy in between.

        The sequences run as ``experts.groups(...)`` groups (contiguous, about equal rows), each
        advancing through the layers on its own: while one group's experts are remote, another's dense
        half computes (``_run_groups``). Every kernel is batch-invariant, so the bits do not depend
        on the grouping."""
        cfg = self.cfg
        n_tok = len(tokens)
        pos_np = pos.astype(np.int32)
        for c in chunks:
            c.cache.begin(c.pos + len(c.tokens))
        n_groups = min(len(chunks), max(1, self.experts.groups(len(chunks), n_tok)))
        here: list[bool] | None = None
        if n_groups == 1 and gd.stack is not None and gd.stack.fits([len(c.tokens) for c in chunks]):
            # asked once per layer and step: the whole step in one graph if every layer is computed here
            here = [self.experts.whole_layer_here(ml, n_tok * cfg.n_expert_used) for ml in range(cfg.n_moe_layer)]
            if all(here):
                return self._stack_ggml(gd.stack, chunks, bounds, tokens, pos_np)
        xn = self.model.token_embd(torch.from_numpy(tokens)).numpy()
        cuts = group_cuts([e - s for s, e in bounds], n_groups)
        groups: list[_Group] = []
        for a, b in itertools.pairwise(cuts):
            s0, e0 = bounds[a][0], bounds[b - 1][1]
            groups.append(_Group(chunks[a:b], [(s - s0, e - s0) for s, e in bounds[a:b]], xn[s0:e0], pos_np[s0:e0]))
        if len(groups) == 1:
            one = groups[0]
            one.here = here
            # runs of layers computed here, between remote layers: one graph each (``coordinator.engine.stack``)
            segments = self._segments(here) if here is not None else {}
            li = 0
            while li < cfg.n_layer:
                end = segments.get(li)
                if end is not None and gd.stack is not None:
                    self._segment_ggml(gd.stack, one, li, end)
                    li = end
                    continue
                self._layer_ggml(gd, li, one, None)
                one.finish(self.experts)
                li += 1
        else:
            self._run_groups(gd, groups)
        xn = groups[0].xn if len(groups) == 1 else np.concatenate([g.xn for g in groups])
        # the head once for every sequence's rows (its weights are read once per step, not per sequence)
        rows = [xn[s:e] if c.all_logits else xn[e - 1 : e] for c, (s, e) in zip(chunks, bounds, strict=True)]
        xs = rows[0] if len(rows) == 1 else np.concatenate(rows)
        logits = gd.head(xs, compute_threads(len(xs) * gd.head.macs))
        return np.split(logits, np.cumsum([len(r) for r in rows[:-1]])) if len(rows) > 1 else [logits]

    def _stack_ggml(self, stack: StackGraph, chunks: list[SeqChunk], bounds: list[tuple[int, int]], tokens: np.ndarray,
                    pos: np.ndarray) -> list[np.ndarray]:
        """The whole step in one graph (``coordinator.engine.stack``); the backend hears of each MoE
        layer's experts (its time: the graph's, shared evenly)."""
        t0 = time.perf_counter()
        seqs = [(e - s, c.pos, c.cache.k_np, c.cache.v_np) for c, (s, e) in zip(chunks, bounds, strict=True)]
        every = all(c.all_logits or e - s == 1 for c, (s, e) in zip(chunks, bounds, strict=True))
        rows = None if every else np.concatenate([np.arange(s, e) if c.all_logits else np.arange(e - 1, e)
                                                  for c, (s, e) in zip(chunks, bounds, strict=True)])
        logits, ids = stack(tokens, pos, seqs, compute_threads(len(tokens) * stack.macs), rows)
        share = (time.perf_counter() - t0) / max(1, len(ids))
        for ml, e in ids:
            self.experts.ran_here(ml, e, share)
        if len(chunks) == 1:
            return [logits]
        sizes = [e - s if c.all_logits else 1 for c, (s, e) in zip(chunks, bounds, strict=True)]
        return np.split(logits, np.cumsum(sizes[:-1]))

    def _segments(self, here: list[bool]) -> dict[int, int]:
        """First layer -> end of each run of consecutive layers computed here (dense blocks and expert
        layers ``here`` allows)."""
        runs: dict[int, int] = {}
        start: int | None = None
        for li in range(self.cfg.n_layer + 1):
            ml = self._moe_of[li] if li < self.cfg.n_layer else None
            local = li < self.cfg.n_layer and (ml is None or here[ml])
            if local and start is None:
                start = li
            elif not local and start is not None:
                runs[start] = li
                start = None
        return runs

    def _segment_ggml(self, stack: StackGraph, mb: _Group, lo: int, hi: int) -> None:
        """Layers ``lo .. hi-1`` of one group in one graph, from its residual rows to the next."""
        t0 = time.perf_counter()
        seqs = [(e - s, c.pos, c.cache.k_np, c.cache.v_np) for c, (s, e) in zip(mb.chunks, mb.bounds, strict=True)]
        mb.xn, ids = stack(mb.xn, mb.pos, seqs, compute_threads(mb.xn.shape[0] * stack.macs), span=(lo, hi))
        share = (time.perf_counter() - t0) / max(1, len(ids))
        for ml, e in ids:
            self.experts.ran_here(ml, e, share)

    def _run_groups(self, gd: _GgmlDense, groups: list[_Group]) -> None:
        """Advance every group through the layers, each on its own: a group whose layer is in flight
        waits while the others compute; one waker tells this thread when any has news (local work
        or its end), in whatever order their experts answer."""
        n_layer = self.cfg.n_layer
        waker = ThreadWaker.current()
        ready = list(groups)
        waiting: list[_Group] = []
        while ready or waiting:
            while ready:
                g = ready.pop(0)
                g.finish(self.experts)
                if g.layer == n_layer:
                    continue
                self._layer_ggml(gd, g.layer, g, waker)
                g.layer += 1
                (waiting if g.pending is not None else ready).append(g)
            while waiting and not ready:
                for g in list(waiting):
                    assert g.pending is not None
                    if self.experts.service(g.pending):
                        waiting.remove(g)
                        ready.append(g)
                if not ready:
                    waker.wait(1.0)

    def _layer_ggml(self, gd: _GgmlDense, li: int, mb: _Group, waker: Waker | None) -> None:
        """Layer ``li`` of one group: its dense half, then its MoE computed (``mb.xn`` updated) or
        begun (``mb.pending``; its local share computed here before this returns)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        Hkv, hdk, hdv = cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v
        chunks, xn = mb.chunks, mb.xn
        n_tok = xn.shape[0]
        # attention reads little (a decode row: ~0.1 MB of f16 cache per layer) through many small ops,
        # each a barrier for the threads: on 2 threads it measured 1-30x slower than on one (vCPU
        # steal makes the barriers erratic), so only prefill-sized work gets every thread
        att_threads = compute_threads(sum(gd.attn.macs(len(c.tokens), gd.attn.n_kv(c.pos + len(c.tokens), c.cache.n_ctx))
                                          for c in chunks), big=ATTN_BIG_WORK)
        blk = gd.attn_in[li]
        qn, kn, vn = blk(xn, mb.pos, compute_threads(n_tok * blk.macs))
        items = []
        for c, (s, e) in zip(chunks, mb.bounds, strict=True):
            n = e - s
            kc, vc = c.cache.k_np[li], c.cache.v_np[li]
            kc[c.pos : c.pos + n] = kn[s:e].reshape(n, Hkv, hdk)
            vc[:, :, c.pos : c.pos + n] = vn[s:e].reshape(n, Hkv, hdv).transpose(1, 2, 0)
            items.append((qn[s:e], kc, vc, c.pos))
        L = self.model.layers[li]
        att = gd.attn.many(items, att_threads, zero_tail=False, sinks=_np(L.sinks),
                           window=cfg.n_swa if li in self._swa else 0)
        attn = att[0] if len(att) == 1 else np.concatenate(att)
        moe_layer = self._moe_of[li]
        fused = gd.attn_out_moe[li]
        if fused is not None and moe_layer is not None and n_tok <= FUSED_MAX_ROWS \
                and (mb.here[moe_layer] if mb.here is not None
                     else self.experts.whole_layer_here(moe_layer, n_tok * cfg.n_expert_used)):
            t1 = time.perf_counter()
            mb.xn, ids_np = fused(attn, xn, compute_threads(n_tok * fused.macs))
            self.experts.ran_here(moe_layer, ids_np, time.perf_counter() - t1)
            return
        # a shared expert waits for the routed call where that may go remote: computed during its wait
        later = gd.shared_out[li] if moe_layer is not None and self.experts.may_go_remote(moe_layer) else None
        blk_o = gd.attn_out_routed[li] if later is not None else gd.attn_out[li]
        assert blk_o is not None
        xn, hn, probs, shared = blk_o(attn, xn, compute_threads(n_tok * blk_o.macs))
        if moe_layer is None:  # a dense block: its FFN came out of the graph
            assert shared is not None
            mb.xn = xn + shared
            return
        ids, w = gd.gate(probs) if gd.gate is not None else self.select_arrays(probs)
        dense_s = time.perf_counter() - t0
        call = self.experts.begin(moe_layer, hn, ids, w, waker=waker)
        call.timing.dense_s = dense_s
        self.experts.service(call)  # the local share, while the remote calls are in flight
        if later is not None:
            shared = later(hn, compute_threads(n_tok * later.macs))
        mb.xn, mb.pending, mb.shared = xn, call, shared

    def _forward_torch(self, chunks: list[SeqChunk], bounds: list[tuple[int, int]], x: torch.Tensor,
                       pos: torch.Tensor) -> list[torch.Tensor]:
        cfg = self.cfg
        m = self.model
        n_tok = x.shape[0]
        H, Hkv, hdk, hdv = cfg.n_head, cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v
        group = H // Hkv
        scale = cfg.kq_scale or 1.0 / (hdk**0.5)
        for li, L in enumerate(m.layers):
            h = rms_norm(x, L.attn_norm, cfg.rms_eps)
            q, k, v = self._mla_qkv(L, h, pos) if L.mla is not None else self._qkv(L, h, pos)
            attn = torch.empty(n_tok, H, hdv)
            for c, (s, e) in zip(chunks, bounds, strict=True):
                n = e - s
                c.cache.k[li, c.pos : c.pos + n] = k[s:e]
                c.cache.v[li, :, :, c.pos : c.pos + n] = v[s:e].permute(1, 2, 0)
                # grouped-query attention on [Hkv, L, hd] views of the cache: query head h reads kv head
                # h // group, as llama.cpp maps them; no per-head copy of the prefix (an f16 cache is
                # read as f32, one copy of the kv heads)
                L_ = c.pos + n
                kk = c.cache.k[li, :L_].transpose(0, 1).to(torch.float32)  # [Hkv, L, hd]
                vv = c.cache.v[li, :, :, :L_].transpose(1, 2).to(torch.float32)  # [Hkv, L, hdv]
                qq = q[s:e].view(n, Hkv, group, hdk).permute(1, 2, 0, 3).reshape(Hkv, group * n, hdk)
                scores = torch.bmm(qq, kk.transpose(1, 2)) * scale  # [Hkv, group * n, L]
                window = cfg.n_swa if li in self._swa else 0
                if n > 1 or window:
                    kpos = torch.arange(L_)
                    qpos = torch.arange(c.pos, L_)
                    masked = kpos.unsqueeze(0) > qpos.unsqueeze(1)
                    if window:
                        masked |= qpos.unsqueeze(1) - kpos.unsqueeze(0) >= window
                    scores = scores.masked_fill(masked.repeat(group, 1), float("-inf"))  # [group * n, L]
                if L.sinks is not None:  # one more logit per head in the softmax, whose value weighs nothing
                    sink = L.sinks.view(Hkv, group, 1, 1).expand(Hkv, group, n, 1).reshape(Hkv, group * n, 1)
                    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
                else:
                    probs = torch.softmax(scores, dim=-1)
                o = torch.bmm(probs, vv)  # [Hkv, group * n, hdv]
                o = o.view(Hkv, group, n, hdv).permute(2, 0, 1, 3).reshape(n, H, hdv)
                attn[s:e] = o
            if L.mla is not None:  # per head from the latent space to the value dims (attn_v_b)
                vb = L.mla.wv_b.to_float()  # [H, d_v, kv_lora]
                att = torch.bmm(vb, attn.permute(1, 2, 0)).permute(2, 0, 1).reshape(n_tok, -1)  # [n, H * d_v]
            else:
                att = attn.reshape(n_tok, H * hdv)
            x = x + _biased(L.wo(att), L.bo)
            h = rms_norm(x, L.ffn_norm, cfg.rms_eps)
            moe_layer = self._moe_of[li]
            if moe_layer is None:  # a dense block
                assert L.shared is not None
                x = x + shared_ffn(L.shared, h)
                continue
            ids, w = self.route(li, h)
            moe = torch.from_numpy(self.experts.moe(moe_layer, h.numpy(), ids.numpy(), w.numpy()))
            if L.shared is not None:
                moe = moe + shared_ffn(L.shared, h)
            x = x + moe
        out: list[torch.Tensor] = []
        for c, (s, e) in zip(chunks, bounds, strict=True):
            xs = x[s:e] if c.all_logits else x[e - 1 : e]
            out.append(m.output(rms_norm(xs, m.output_norm, cfg.rms_eps)))
        return out
