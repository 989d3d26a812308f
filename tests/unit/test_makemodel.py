"""swarm.tools.makemodel: the generated GGUFs follow the golden file's conventions and are deterministic."""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType as T

from swarm.errors import ConfigError
from swarm.model import quant
from swarm.tools import makemodel

VOCAB_8192_SHA256 = "e73f63491b8eb652131942d319146a8ce90adfc203d1b07721ef08eaf8d4678b"
GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden" / "qwen3moe-tiny-f32.gguf"


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("models")
    return {
        arch: makemodel.make_model(arch=arch, size="tiny", seed=7, out=out / f"{arch}-tiny.gguf")
        for arch in ("qwen3moe", "mixtral")
    }


def fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensors(reader: gguf.GGUFReader) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type name, numpy-order logical shape)."""
    return {t.name: (t.tensor_type.name, tuple(int(s) for s in reversed(t.shape))) for t in reader.tensors}


def structure(names: list[str]) -> list[str]:
    return [re.sub(r"^blk\.\d+\.", "blk.N.", n) for n in names]


def test_tiny_qwen3moe_follows_the_golden_conventions(tiny_paths: dict[str, Path]) -> None:
    golden = gguf.GGUFReader(GOLDEN)
    ours = gguf.GGUFReader(tiny_paths["qwen3moe"])
    got, ref = fields(ours), fields(golden)
    assert set(got) == set(ref) | {"tokenizer.chat_template"}
    for key in set(ref):  # same value types for every key
        assert ours.fields[key].types == golden.fields[key].types, key
    assert {k: got[k] for k in got if k.startswith("qwen3moe.")} == {
        "qwen3moe.context_length": 512,
        "qwen3moe.embedding_length": 128,
        "qwen3moe.block_count": 2,
        "qwen3moe.feed_forward_length": 384,
        "qwen3moe.expert_feed_forward_length": 64,
        "qwen3moe.attention.head_count": 4,
        "qwen3moe.attention.head_count_kv": 2,
        "qwen3moe.attention.key_length": 32,
        "qwen3moe.attention.value_length": 32,
        "qwen3moe.rope.freq_base": 1e6,
        "qwen3moe.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
    }
    assert got["general.architecture"] == "qwen3moe"
    assert got["general.file_type"] == 0
    assert got["tokenizer.ggml.model"] == "gpt2"
    assert got["tokenizer.ggml.pre"] == "qwen2"
    assert got["tokenizer.ggml.add_bos_token"] is False

    ours_t, golden_t = tensors(ours), tensors(golden)
    assert structure(list(ours_t)) == structure(list(golden_t))  # same names, same order
    assert list(ours_t) == list(golden_t)
    assert all(t == "F32" for t, _ in ours_t.values())
    assert ours_t["token_embd.weight"][1] == (512, 128)
    assert ours_t["output.weight"][1] == (512, 128)
    assert ours_t["blk.1.attn_q.weight"][1] == (4 * 32, 128)
    assert ours_t["blk.1.attn_k.weight"][1] == (2 * 32, 128)
    assert ours_t["blk.1.attn_output.weight"][1] == (128, 4 * 32)
    assert ours_t["blk.1.attn_q_norm.weight"][1] == (32,)
    assert ours_t["blk.1.ffn_gate_inp.weight"][1] == (8, 128)
    assert ours_t["blk.1.ffn_gate_exps.weight"][1] == (8, 64, 128)
    assert ours_t["blk.1.ffn_up_exps.weight"][1] == (8, 64, 128)
    assert ours_t["blk.1.ffn_down_exps.weight"][1] == (8, 128, 64)


def test_tiny_mixtral_is_llama_with_merged_experts(tiny_paths: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(tiny_paths["mixtral"])
    got = fields(reader)
    assert got["general.architecture"] == "llama"
    assert got["tokenizer.ggml.pre"] == "llama-bpe"
    assert {k: got[k] for k in got if k.startswith("llama.")} == {
        "llama.context_length": 512,
        "llama.embedding_length": 128,
        "llama.block_count": 2,
        "llama.feed_forward_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 32,
        "llama.rope.freq_base": 1e6,
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5),
        "llama.expert_count": 8,
        "llama.expert_used_count": 2,
    }
    names = tensors(reader)
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    golden_names = [n for n in tensors(gguf.GGUFReader(GOLDEN)) if "_q_norm" not in n and "_k_norm" not in n]
    assert list(names) == golden_names
    assert names["blk.0.ffn_down_exps.weight"] == ("F32", (8, 128, 64))


def test_tokenizer_is_byte_level_bpe_with_chatml(tiny_paths: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(tiny_paths["qwen3moe"])
    got = fields(reader)
    tokens = list(got["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    types = list(got["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
    merges = list(got["tokenizer.ggml.merges"])  # type: ignore[call-overload]
    golden_tokens = gguf.GGUFReader(GOLDEN).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 512 and len(set(tokens)) == 512
    assert tokens[:256] == golden_tokens[:256]  # GPT-2 byte-to-unicode order
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types == [1] * 509 + [3] * 3
    assert got["tokenizer.ggml.bos_token_id"] == 509
    assert got["tokenizer.ggml.padding_token_id"] == 509
    assert got["tokenizer.ggml.eos_token_id"] == 511
    assert len(merges) == 512 - 256 - 3
    for rank, merge in enumerate(merges):  # each merge joins two existing tokens into the next one
        left, right = merge.split(" ")
        assert left in tokens[: 256 + rank] and right in tokens[: 256 + rank]
        assert tokens[256 + rank] == left + right
    assert merges[:3] == ["Ġ a", "e s", "i n"]

    # a real byte-level BPE tokenizer accepts the vocabulary and round-trips text
    bpe = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]
        )
    )
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    text = "The experts answer the coordinator. Ünïcode ☃ too!"
    ids = bpe.encode(text).ids
    assert bpe.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges apply

    template = jinja2.Environment().from_string(got["tokenizer.chat_template"])  # type: ignore[arg-type]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(messages=messages[:1], add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    )


def test_vocabularies_nest_and_reach_their_sizes() -> None:
    small, bench = makemodel.build_vocab(2048), makemodel.build_vocab(8192)
    assert len(small.tokens) == 2048 and len(bench.tokens) == 8192
    assert small.tokens[:-3] == bench.tokens[: 2048 - 3]
    assert small.merges == bench.merges[: len(small.merges)]
    # pinned: the trainer must give the same vocabulary on every machine and Python hash seed
    digest = hashlib.sha256("\n".join(bench.tokens + bench.merges).encode()).hexdigest()
    assert digest == VOCAB_8192_SHA256


def test_output_is_byte_identical_for_the_same_arguments(tmp_path: Path, tiny_paths: dict[str, Path]) -> None:
    for arch, first in tiny_paths.items():
        again = makemodel.make_model(arch=arch, size="tiny", seed=7, out=tmp_path / f"{arch}-again.gguf")  # type: ignore[arg-type]
        assert again.read_bytes() == first.read_bytes()
    other = makemodel.make_model(arch="qwen3moe", size="tiny", seed=8, out=tmp_path / "other.gguf")
    assert other.read_bytes() != tiny_paths["qwen3moe"].read_bytes()
    assert other.stat().st_size == tiny_paths["qwen3moe"].stat().st_size
    assert not list(tmp_path.glob(".*partial"))


def test_weights_are_scaled_sensibly(tiny_paths: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(tiny_paths["qwen3moe"])
    by_name = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    norm = by_name["blk.0.attn_norm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and 0.05 < float(norm.std()) < 0.2
    gate = by_name["blk.0.ffn_gate_exps.weight"]
    assert float(gate.std()) == pytest.approx(128**-0.5, rel=0.05)
    down = by_name["blk.0.ffn_down_exps.weight"]
    assert float(down.std()) == pytest.approx(64**-0.5, rel=0.05)
    assert not np.array_equal(gate[0], gate[1])  # experts differ
    assert not np.array_equal(by_name["blk.0.attn_q.weight"], by_name["blk.1.attn_q.weight"])


def test_k_quant_experts_dequantise_close_to_the_f32_weights(tmp_path: Path) -> None:
    f32 = gguf.GGUFReader(makemodel.make_model(arch="mixtral", size="small", seed=3, out=tmp_path / "f32.gguf"))
    # copy-on-write map: torch warns about wrapping read-only memory
    q4k = gguf.GGUFReader(
        makemodel.make_model(arch="mixtral", size="small", seed=3, out=tmp_path / "q4k.gguf", qtype="Q4_K"), "c"
    )
    assert fields(q4k)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert fields(q4k)["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    ref = {t.name: t for t in f32.tensors}
    n_experts = 0
    for t in q4k.tensors:
        r = ref[t.name]
        if "_exps" not in t.name:
            assert t.tensor_type == r.tensor_type == T.F32
            np.testing.assert_array_equal(np.asarray(t.data), np.asarray(r.data))
            continue
        n_experts += 1
        assert t.tensor_type == T.Q4_K
        shape = tuple(int(s) for s in reversed(t.shape))
        assert shape == (16, 256, 256)
        got = quant.dequantize(torch.from_numpy(np.asarray(t.data)), T.Q4_K, shape).numpy()
        want = np.asarray(r.data, dtype=np.float32)
        rel = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
        assert 0.0 < rel < 0.1, t.name
    assert n_experts == 4 * 3


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_tiny_rejects_k_quants(tmp_path: Path, qtype: str) -> None:
    with pytest.raises(ConfigError, match="multiples of 256"):
        makemodel.make_model(arch="qwen3moe", size="tiny", seed=0, out=tmp_path / "x.gguf", qtype=qtype)
    assert not list(tmp_path.iterdir())


def test_tiny_q8_0_experts(tmp_path: Path) -> None:
    path = makemodel.make_model(arch="qwen3moe", size="tiny", seed=7, out=tmp_path / "q8.gguf", qtype="q8_0")
    types = {name: t for name, (t, _) in tensors(gguf.GGUFReader(path)).items()}
    assert {t for n, t in types.items() if "_exps" in n} == {"Q8_0"}
    assert {t for n, t in types.items() if "_exps" not in n} == {"F32"}


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Q2_K"):
        makemodel.make_model(arch="qwen3moe", size="tiny", seed=0, out=tmp_path / "x.gguf", qtype="Q2_K")
    with pytest.raises(ConfigError, match="arch"):
        makemodel.make_model(arch="gpt2", size="tiny", seed=0, out=tmp_path / "x.gguf")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="head_dim x heads = d_model"):  # llama.cpp's layout for these
        makemodel.make_model(arch="olmoe", size="30b-a3b", seed=0, out=tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="size"):
        makemodel.make_model(arch="qwen3moe", size="huge", seed=0, out=tmp_path / "x.gguf")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="seed"):
        makemodel.make_model(arch="qwen3moe", size="tiny", seed=-1, out=tmp_path / "x.gguf")


def test_bench_and_small_shapes_without_writing() -> None:
    bench = makemodel.SIZES["bench"]
    assert (bench.n_layer, bench.d_model, bench.n_expert, bench.n_expert_used, bench.expert_width) == (8, 1024, 32, 4, 1408)
    assert (bench.n_head, bench.n_head_kv, bench.head_dim, bench.context_length) == (16, 4, 64, 2048)
    assert bench.expert_type == T.Q8_0
    experts = 8 * 3 * 32 * 1408 * 1024
    assert makemodel.count_parameters("qwen3moe", "bench") > experts > 0.9 * makemodel.count_parameters("qwen3moe", "bench")
    assert makemodel.count_parameters("qwen3moe", "tiny") == 625408


def test_cli(tmp_path: Path, tiny_paths: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from swarm.tools import cli

    out = tmp_path / "cli.gguf"
    assert cli.main(["--arch", "mixtral", "--size", "tiny", "--seed", "7", "--out", str(out)]) == 0
    assert out.read_bytes() == tiny_paths["mixtral"].read_bytes()
    assert "params=625280" in capsys.readouterr().out

    # wired into a parent CLI
    parser = argparse.ArgumentParser(prog="moe-swarm")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", "--size", "tiny", "--out", str(tmp_path / "sub.gguf"), "--qtype", "q4_0"])
    assert args.func is cli.run and args.qtype == "Q4_0" and args.arch == "qwen3moe"
    assert args.func(args) == 0
    assert {t.tensor_type for t in gguf.GGUFReader(tmp_path / "sub.gguf").tensors if "_exps" in t.name} == {T.Q4_0}

    assert cli.main(["--size", "tiny", "--qtype", "Q4_K", "--out", str(tmp_path / "k.gguf")]) == 2
    assert "multiples of 256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--qtype", "Q2_K", "--out", str(tmp_path / "bad.gguf")])


def test_the_command_lines_choices_are_the_generators() -> None:
    """swarm.tools.cli writes its choices out (its parser imports neither numpy nor gguf): the same as
    the generator's, and its help names every architecture."""
    from swarm.tools import cli

    assert cli.ARCHITECTURES == makemodel.ARCHITECTURES
    assert cli.SIZE_NAMES == tuple(makemodel.SIZES)
    assert cli.QTYPE_NAMES == makemodel.QTYPE_NAMES
    assert cli.VOCABS == makemodel.VOCABS
    assert all(arch in cli.DESCRIPTION for arch in makemodel.ARCHITECTURES)
    assert all(size in cli.DESCRIPTION for size in makemodel.SIZES)


@pytest.mark.parametrize(
    ("arch", "size", "seed", "qtype", "sha256"),
    [
        ("qwen3moe", "tiny", 7, None, "c1e16dbe738fbc332d7cbe5e17adc4cdfacce40127f844d225b9d516cc124b70"),
        ("mixtral", "small", 3, "Q4_K", "c7da5c1a44f0b7d3b0230d566d2fdbe91b6dcc3ff3071dd31384c3b66ba16c55"),
    ],
)
def test_generated_bytes_are_pinned(tmp_path: Path, arch: str, size: str, seed: int, qtype: str | None, sha256: str) -> None:
    """The files written before the re-layering, byte for byte: a change to the generator, its corpus
    or its defaults shows here (the pinned gguf writer version is part of the bytes too)."""
    out = makemodel.make_model(arch=arch, size=size, seed=seed, out=tmp_path / "m.gguf", qtype=qtype)  # type: ignore[arg-type]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == sha256


def test_router_skew_scales_only_the_routers_and_makes_low_experts_hot(tmp_path: Path, tiny_paths: dict[str, Path]) -> None:
    assert np.array_equal(makemodel.router_scales(8, 0.0), np.ones(8, dtype=np.float32))
    s = makemodel.router_scales(8, 1.0)
    assert s[0] == pytest.approx(2.0) and s[-1] == pytest.approx(0.5) and all(np.diff(s) < 0)
    skewed = makemodel.make_model(arch="qwen3moe", size="tiny", seed=7, out=tmp_path / "skew.gguf", router_skew=1.5)
    plain, hot = gguf.GGUFReader(tiny_paths["qwen3moe"]), gguf.GGUFReader(skewed)
    a = {t.name: np.asarray(t.data, dtype=np.float32) for t in plain.tensors}
    b = {t.name: np.asarray(t.data, dtype=np.float32) for t in hot.tensors}
    assert [n for n in a if not np.array_equal(a[n], b[n])] == [f"blk.{i}.ffn_gate_inp.weight" for i in range(2)]
    w = b["blk.0.ffn_gate_inp.weight"]
    assert np.allclose(w, a["blk.0.ffn_gate_inp.weight"] * makemodel.router_scales(w.shape[0], 1.5)[:, None])
    assert float(fields(hot)["moe_swarm.router_skew"]) == pytest.approx(1.5)  # type: ignore[arg-type]
    # routing over the embeddings' directions: the first experts are picked far more often than the last
    x = b["token_embd.weight"]
    x = x / np.sqrt((x**2).mean(1, keepdims=True))
    top = np.argsort(-(x @ w.T), 1)[:, :2]
    counts = np.bincount(top.reshape(-1), minlength=w.shape[0])
    assert counts[0] > 2 * counts[-1]
    with pytest.raises(ConfigError, match="router-skew"):
        makemodel.make_model(arch="qwen3moe", size="tiny", seed=7, out=tmp_path / "bad.gguf", router_skew=-1.0)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0])
def test_random_expert_blocks_have_the_planned_spread_and_bounded_values(qtype: T) -> None:
    plan = makemodel._TensorPlan("blk.0.ffn_gate_exps.weight", (2, 96, 256), qtype, 256**-0.5)
    raw = makemodel.random_blocks(7, plan, 1)
    assert raw.shape == plan.byte_shape[1:] and raw.dtype == np.uint8
    assert np.array_equal(raw, makemodel.random_blocks(7, plan, 1))  # deterministic
    assert not np.array_equal(raw, makemodel.random_blocks(7, plan, 0)) and not np.array_equal(raw, makemodel.random_blocks(8, plan, 1))
    w = quant.dequantize_raw(torch.from_numpy(raw), qtype, plan.shape[1:]).numpy()
    assert np.isfinite(w).all() and abs(float(w.std()) / plan.std - 1.0) < 0.1
    assert float(np.abs(w).max()) <= 16 * plan.std


def test_the_30b_a3b_size_has_qwen3_30b_a3bs_shape() -> None:
    spec = makemodel.SIZES["30b-a3b"]
    assert (spec.n_layer, spec.n_expert, spec.n_expert_used, spec.d_model, spec.expert_width) == (48, 128, 8, 2048, 768)
    assert (spec.n_head, spec.n_head_kv, spec.head_dim, spec.vocab_size, spec.context_length) == (32, 4, 128, 8192, 4096)
    assert spec.expert_type is T.Q4_0 and spec.dense_type is T.F16 and spec.random_expert_blocks
    n = makemodel.count_parameters("qwen3moe", "30b-a3b")
    plans = makemodel._plan("qwen3moe", spec, spec.expert_type)
    expert_bytes = sum(p.nbytes for p in plans if "_exps" in p.name)
    # 29.9 B (the real model has 30.5 B: its vocabulary is 151,936, not 8,192); 29 B of them routed experts
    assert 29.5e9 < n < 31.0e9 and 16.0e9 < expert_bytes < 16.6e9
