"""The MoE architectures beyond qwen3moe against llama.cpp (``benchmarks/make_arch_goldens.py``).

Each architecture has a tiny F32 file written by an independent script laid out as llama.cpp's
converter lays out a real model of that family, the same file quantised to Q8_0 by llama.cpp, and
llama.cpp's logits (F32 KV cache), greedy continuations and tokenisation on both. Each single
deviation a family has (qwen2moe: q/k/v biases, the sigmoid-gated shared expert, no top-k
renormalisation; olmoe: q/k RMSNorm over the whole projection, no renormalisation; deepseek2:
multi-head latent attention with k_b absorbed, RoPE on the rope dims only in adjacent pairs, a
leading dense block, shared experts, the weights scale; gpt-oss: attention sinks, the sliding
window on alternate layers, biases everywhere, top-k of the raw router logits then softmax over k,
the clamped SwiGLU) moves these
logits by far more than the tolerance -- ``test_each_deviation_is_caught`` checks that here.
qwen2moe is also quantised with llama.cpp's ``MXFP4_MOE`` (MXFP4 experts, whose activations ggml
quantises to Q8_0 for the dot products; the rest Q8_0), and qwen2moe and deepseek2 have YaRN files
(``rope.scaling.type = yarn``: llama.cpp's attn_factor derivation, and for deepseek2 its MLA score
scale with the log multiplier).

The project's own generator (``make-model --arch``) is checked too: llama.cpp loaded its tiny file
of each architecture, and its logits are recorded beside the file's sha256.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import ARCHITECTURES, GGUFModel
from swarm.model.kernels import KernelBackend
from swarm.text.tokenizer import Tokenizer
from swarm.tools.makemodel import make_model
from tests.conftest import FIXTURES, greedy_tokens

ARCHS = ["qwen2moe", "olmoe", "deepseek2", "gpt-oss"]
TOL = 1e-4
GOLDEN = FIXTURES / "golden"


def golden(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GOLDEN / f"{name}.llamacpp.json").read_text())
    return data


CASES = [(a, q, k) for a in ARCHS for q, k in (("f32", KernelBackend.GGML), ("f32", KernelBackend.TORCH),
                                               ("q8_0", KernelBackend.GGML))]
CASES += [(a, "mxfp4_moe", KernelBackend.GGML) for a in ("qwen2moe", "gpt-oss")]  # llama.cpp's MXFP4 experts
CASES.append(("mixtral-spm", "q8_0", KernelBackend.GGML))  # llama.cpp's Q8_0 of the Mixtral-style SPM golden
# YaRN context extension (factor 4 over an original context of 32; deepseek2 with V2-Lite's log multiplier)
CASES += [(f"{a}-yarn", "f32", k) for a in ("qwen2moe", "deepseek2") for k in (KernelBackend.GGML, KernelBackend.TORCH)]
# group-limited routing (DeepSeek-V2's n_group / topk_group: 4 groups of 2 experts, the best 2 groups)
CASES += [("deepseek2-groups", "f32", k) for k in (KernelBackend.GGML, KernelBackend.TORCH)]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}-{p[2].value}")
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], Transformer]:
    arch, q, kernel = request.param
    name = f"{arch}-tiny-{q}"
    return arch, golden(name), Transformer(GGUFModel(GOLDEN / f"{name}.gguf", kernel=kernel))


def max_dev(tr: Transformer, seq: dict[str, Any]) -> float:
    logits = tr.forward([SeqChunk(KVCache(tr.cfg, 256), seq["tokens"], 0, all_logits=True)])[0]
    ref = torch.tensor(seq["logits"])
    assert logits.shape == ref.shape
    return float((logits - ref).abs().max().item())


def rewritten(tmp_path: Path, name: str, extra: dict[str, Any] | None = None,
              tensors: Callable[[str, Any], list[tuple[str, Any]]] | None = None) -> Path:
    """The golden ``name`` written again with ``extra`` metadata keys (uint32, or a bool array) and each
    tensor through ``tensors(name, data) -> [(name, data), ...]`` (default: as it is)."""
    import gguf

    src = gguf.GGUFReader(GOLDEN / f"{name}.gguf")
    out = tmp_path / f"{name}-rewritten-{len(list(tmp_path.iterdir()))}.gguf"  # a new file each call
    w = gguf.GGUFWriter(out, str(src.fields["general.architecture"].contents()))
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for k, v in (extra or {}).items():
        if isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_uint32(k, v)
    for t in src.tensors:
        for tname, data in tensors(t.name, t.data) if tensors is not None else [(t.name, t.data)]:
            w.add_tensor(tname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_the_files_are_what_the_goldens_were_made_on(case: tuple[str, dict[str, Any], Transformer]) -> None:
    arch, g, tr = case
    assert tr.model.sha256 == g["model_sha256"]
    assert tr.cfg.arch == g["arch"] == {"mixtral-spm": "llama"}.get(arch, arch.removesuffix("-yarn").removesuffix("-groups"))
    if "groups" in g:
        assert (tr.cfg.n_expert_groups, tr.cfg.n_group_used) == (4, 2)
    if "yarn" in g:  # what llama.cpp derives from rope.scaling.*
        assert tr.cfg.rope.ext_factor == 1.0 and tr.cfg.rope.freq_scale == 0.25 and tr.cfg.rope.n_ctx_orig == 32
    assert {n: t.qtype.name for n, t in tr.model.tensors.items()} == g["tensor_types"]
    assert g["settings"]["kv_cache"] == "f32" and g["settings"]["env"] == {"GGML_CPU_TILED_MM": "0"}
    if g.get("quantize_ftype") == "LLAMA_FTYPE_MOSTLY_MXFP4_MOE":
        assert {t.qtype.name for n, t in tr.model.tensors.items() if n.endswith("_exps.weight")} == {"MXFP4"}


@pytest.mark.parametrize("i", range(4))  # the 4th: 96 tokens, past a YaRN file's original context
def test_logits_match_llamacpp(case: tuple[str, dict[str, Any], Transformer], i: int) -> None:
    _, g, tr = case
    assert max_dev(tr, g["sequences"][i]) <= TOL


@pytest.mark.parametrize("i", range(3))
def test_greedy_continuations_match_llamacpp(case: tuple[str, dict[str, Any], Transformer], i: int) -> None:
    _, g, tr = case
    e = g["greedy"][i]
    assert e["n_reliable"] == 24 and e["min_margin"] > 2e-3
    assert greedy_tokens(tr, e["prompt_ids"], 24) == e["greedy_ids"]


def test_tokenisation_matches_llamacpp(case: tuple[str, dict[str, Any], Transformer]) -> None:
    _, g, tr = case
    tok = Tokenizer.from_gguf_fields(tr.model.fields)
    assert len(g["tokenize"]) > 5
    for t in g["tokenize"]:
        assert tok.encode(t["text"], parse_special=t["special"], add_bos=False) == t["ids"], t["text"]


def test_the_architectures_read_their_families_metadata() -> None:
    q = GGUFModel(GOLDEN / "qwen2moe-tiny-f32.gguf", compute_id=False)
    assert (q.config.d_expert, q.config.d_shared) == (64, 256)  # expert_feed_forward_length, ..._shared_...
    assert all(L.bq is not None and L.bk is not None and L.bv is not None and L.shared is not None for L in q.layers)
    assert q.layers[0].shared is not None and q.layers[0].shared.gate_inp is not None
    o = GGUFModel(GOLDEN / "olmoe-tiny-f32.gguf", compute_id=False)
    assert (o.config.d_expert, o.config.d_shared) == (64, 0)  # feed_forward_length is the expert width
    assert o.layers[0].q_norm is not None and o.layers[0].q_norm.shape == (128,)  # the whole projection
    d = GGUFModel(GOLDEN / "deepseek2-tiny-f32.gguf", compute_id=False)
    c = d.config
    assert c.moe_layers == (1, 2) and c.n_moe_layer == 2 and c.d_ff_dense == 192  # block 0 is dense
    assert (c.d_expert, c.d_shared, c.expert_weights_scale, c.norm_topk) == (64, 128, 1.5, False)
    assert c.mla is not None and (c.mla.kv_lora_rank, c.mla.q_lora_rank, c.mla.d_nope, c.mla.d_rope, c.mla.d_v) == (
        64, 48, 32, 16, 32)
    assert (c.n_head_kv, c.head_dim_k, c.head_dim_v) == (1, 80, 64)  # one latent head: kv_lora + rope, kv_lora
    assert d.layers[0].router is None and d.layers[0].experts is None and d.layers[0].shared is not None
    assert d.expert_stack(0).n_expert == 8 and d.expert_stack(0).gate_t.name == "blk.1.ffn_gate_exps.weight"
    g = GGUFModel(GOLDEN / "gpt-oss-tiny-f32.gguf", compute_id=False)
    c = g.config
    assert (c.n_swa, c.swa_layers, c.head_dim_k, c.rope.ext_factor) == (8, (0,), 48, 1.0)  # even layers slide
    L = g.layers[1]
    assert L.sinks is not None and L.sinks.shape == (4,) and L.router_b is not None and L.bo is not None
    st = g.expert_stack(1)
    assert st.activation == "swiglu_oai" and st.biases is not None and st.biases[2].shape == (8, 128)


@pytest.mark.parametrize("arch,change", [
    ("qwen2moe", {"norm_topk": True}),
    ("qwen2moe", {"shared_expert": "plain"}),
    ("qwen2moe", {"rope_neox": False}),
    ("olmoe", {"qk_norm": "none"}),
    ("olmoe", {"norm_topk": True}),
    ("olmoe", {"rope_neox": False}),
    ("deepseek2", {"rope_neox": True}),
    ("deepseek2", {"shared_expert": "none"}),
    ("deepseek2", {"norm_topk_key": None, "norm_topk": True}),
    ("gpt-oss", {"attn_sinks": False}),
    ("gpt-oss", {"swa_pattern": 0}),
    ("gpt-oss", {"gating": "softmax"}),
    ("gpt-oss", {"expert_activation": "silu"}),
])
def test_each_deviation_is_caught(monkeypatch: pytest.MonkeyPatch, arch: str, change: dict[str, Any]) -> None:
    """The tolerance is meaningful: one architecture rule changed moves the logits far beyond it."""
    monkeypatch.setitem(ARCHITECTURES, arch, dataclasses.replace(ARCHITECTURES[arch], **change))
    name = f"{arch}-tiny-f32"
    tr = Transformer(GGUFModel(GOLDEN / f"{name}.gguf", compute_id=False))
    assert max_dev(tr, golden(name)["sequences"][0]) > 100 * TOL


def test_qwen2moe_without_biases_is_refused(tmp_path: Path) -> None:
    from swarm.errors import ModelError

    path = rewritten(tmp_path, "qwen2moe-tiny-f32", tensors=lambda n, d: [] if n == "blk.1.attn_k.bias" else [(n, d)])
    with pytest.raises(ModelError, match="blk.1.attn_k.bias"):
        GGUFModel(path, compute_id=False)


MAKE_MODEL = [("qwen2moe", "bpe"), ("olmoe", "bpe"), ("deepseek2", "bpe"), ("gpt-oss", "bpe"), ("mixtral", "spm")]


@pytest.mark.parametrize(("arch", "vocab"), MAKE_MODEL)
def test_make_model_files_are_the_ones_llamacpp_ran(tmp_path: Path, arch: str, vocab: str) -> None:
    g = golden(f"makemodel-{arch}{'-spm' if vocab == 'spm' else ''}-tiny")
    mm = g["make_model"]
    assert mm["vocab"] == vocab
    path = make_model(arch=arch, size=mm["size"], seed=mm["seed"], out=tmp_path / f"{arch}.gguf",  # type: ignore[arg-type]
                      vocab=vocab)
    tr = Transformer(GGUFModel(path))
    assert tr.model.sha256 == g["model_sha256"]  # the generator still writes the file llama.cpp loaded
    assert tr.cfg.arch == ARCHITECTURES[{"mixtral": "llama"}.get(arch, arch)].name
    assert max_dev(tr, g["sequences"][0]) <= TOL
    e = g["greedy"][0]
    assert greedy_tokens(tr, e["prompt_ids"], 24) == e["greedy_ids"]
    tok = Tokenizer.from_gguf_fields(tr.model.fields)
    assert tok.add_bos == (vocab == "spm")
    for t in g["tokenize"]:  # llama.cpp's tokenisation with its add_bos (the file's default)
        assert tok.encode(t["text"], parse_special=t["special"]) == t["ids"], t["text"]


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_ignoring_yarn_is_caught(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Past the original context, a model that ignores rope.scaling.* misses llama.cpp by far."""
    from swarm.model import gguf as model_gguf

    monkeypatch.setattr(model_gguf, "rope_scaling", lambda fields, arch, n_ctx: model_gguf.RopeScaling())
    name = f"{arch}-yarn-tiny-f32"
    tr = Transformer(GGUFModel(GOLDEN / f"{name}.gguf", compute_id=False))
    assert tr.cfg.rope.ext_factor == 0.0
    assert max_dev(tr, golden(name)["sequences"][3]) > 100 * TOL


def test_an_old_per_expert_mixtral_file_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    from swarm.errors import UnsupportedArchitecture

    def per_expert(name: str, data: Any) -> list[tuple[str, Any]]:  # block 0's gate as the old layout
        return [("blk.0.ffn_gate.0.weight", data[0])] if name == "blk.0.ffn_gate_exps.weight" else [(name, data)]

    with pytest.raises(UnsupportedArchitecture, match="convert the model again"):
        GGUFModel(rewritten(tmp_path, "mixtral-spm-tiny-f32", tensors=per_expert), compute_id=False)


def test_ignoring_expert_groups_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "deepseek2-groups-tiny-f32"
    model = GGUFModel(GOLDEN / f"{name}.gguf", compute_id=False)
    # before the engine builds its graphs (the gate's groups are in them)
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, n_expert_groups=0, n_group_used=0))
    tr = Transformer(model)
    assert max_dev(tr, golden(name)["sequences"][3]) > 100 * TOL


def test_sliding_window_patterns_as_llama_cpp_reads_them(tmp_path: Path) -> None:
    """0: every layer slides; a per-layer bool array says which ones do; a bad value is a ModelError."""
    from swarm.errors import ModelError

    def swa(extra: dict[str, Any]) -> tuple[int, ...]:
        return GGUFModel(rewritten(tmp_path, "gpt-oss-tiny-f32", extra), compute_id=False).config.swa_layers

    assert swa({}) == (0,)  # gpt-oss's default pattern 2: even layers
    assert swa({"gpt-oss.attention.sliding_window_pattern": 0}) == (0, 1)
    assert swa({"gpt-oss.attention.sliding_window_pattern": [False, True]}) == (1,)
    # llama.cpp runs block_count - nextn_predict_layers blocks (multi-token prediction blocks are not the model)
    nextn = GGUFModel(rewritten(tmp_path, "deepseek2-tiny-f32", {"deepseek2.nextn_predict_layers": 1}),
                      compute_id=False).config
    assert (nextn.n_layer, nextn.moe_layers) == (2, (1,))
    with pytest.raises(ModelError, match="expert_group_count"):
        GGUFModel(rewritten(tmp_path, "deepseek2-tiny-f32", {"deepseek2.expert_group_count": 3,
                                                             "deepseek2.expert_group_used_count": 2}), compute_id=False)
