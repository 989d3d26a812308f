"""Slices: cutting is byte-deterministic, loading is validated and computes bit-identically."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np
import pytest
import safetensors
import torch

from swarm.errors import ConfigError, SliceError
from swarm.model.experts import slice_partial_sum
from swarm.model.gguf import GGUFModel, file_sha256
from swarm.model.slices import (
    METADATA_KEY,
    SliceCache,
    SliceKey,
    build_manifest,
    cut_slice,
    load_slice,
    parse_slice_arg,
)
from swarm.protocol.manifest import ModelManifest

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden" / "qwen3moe-tiny-f32.gguf"

# A small quantised model: layer 0 mixes three stored types, layer 1 is all Q8_0.
Q = gguf.GGMLQuantizationType
QUANT_LAYER_TYPES = [{"gate": Q.Q8_0, "up": Q.Q4_0, "down": Q.F16}, {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0}]
QD_MODEL, QD_EXPERT, QN_EXPERT, QN_HEAD, QHEAD_DIM = 64, 32, 6, 2, 32


def write_quant_model(path: Path) -> None:
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(len(QUANT_LAYER_TYPES))
    w.add_context_length(64)
    w.add_embedding_length(QD_MODEL)
    w.add_head_count(QN_HEAD)
    w.add_head_count_kv(1)
    w.add_expert_count(QN_EXPERT)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(QD_EXPERT)
    w.add_layer_norm_rms_eps(1e-6)

    def f32(*shape: int) -> np.ndarray[Any, Any]:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    w.add_tensor("token_embd.weight", f32(16, QD_MODEL))
    w.add_tensor("output_norm.weight", np.ones(QD_MODEL, np.float32))
    for i, types in enumerate(QUANT_LAYER_TYPES):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(QD_MODEL, np.float32))
        w.add_tensor(p + "attn_q.weight", f32(QN_HEAD * QHEAD_DIM, QD_MODEL))
        w.add_tensor(p + "attn_k.weight", f32(QHEAD_DIM, QD_MODEL))
        w.add_tensor(p + "attn_v.weight", f32(QHEAD_DIM, QD_MODEL))
        w.add_tensor(p + "attn_output.weight", f32(QD_MODEL, QN_HEAD * QHEAD_DIM))
        w.add_tensor(p + "attn_q_norm.weight", np.ones(QHEAD_DIM, np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(QHEAD_DIM, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(QD_MODEL, np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", f32(QN_EXPERT, QD_MODEL))
        shapes = {"gate": (QN_EXPERT, QD_EXPERT, QD_MODEL), "up": (QN_EXPERT, QD_EXPERT, QD_MODEL),
                  "down": (QN_EXPERT, QD_MODEL, QD_EXPERT)}
        for kind, qtype in types.items():
            data = f32(*shapes[kind])
            name = f"{p}ffn_{kind}_exps.weight"
            if qtype == Q.F16:
                w.add_tensor(name, data.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def quant_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quant") / "quant-tiny.gguf"
    write_quant_model(path)
    return path


@pytest.fixture(scope="module")
def quant_model(quant_path: Path) -> GGUFModel:
    return GGUFModel(quant_path)


@pytest.fixture(scope="module")
def golden_model() -> GGUFModel:
    return GGUFModel(GOLDEN)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- slice ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("arg", "want"), [("0:0-4", (0, 0, 4)), (" 12:3-4 ", (12, 3, 4)), ("1:0-128", (1, 0, 128))])
def test_parse_slice_arg(arg: str, want: tuple[int, int, int]) -> None:
    assert parse_slice_arg(arg) == want
    key = SliceKey.parse("m-abc", arg)
    assert (key.layer, key.lo, key.hi) == want
    assert str(key) == f"{want[0]}:{want[1]}-{want[2]}"
    assert key.http_path == f"/v1/slices/m-abc/{want[0]}/{want[1]}-{want[2]}"
    assert key.n_expert == want[2] - want[1]


@pytest.mark.parametrize("arg", ["", "0", "0:4", "0:4-", "a:0-4", "0:-1-4", "0:4-4", "0:5-4", "0:0-4x", "0;0-4"])
def test_parse_slice_arg_rejects(arg: str) -> None:
    with pytest.raises(ConfigError, match="LAYER:LO-HI|LO must be below HI"):
        parse_slice_arg(arg)


# -- cutting ------------------------------------------------------------------------------------

CASES = [("golden", 0, 0, 4), ("golden", 1, 3, 8), ("quant", 0, 1, 5), ("quant", 1, 0, 6)]

_CHILD = """
import hashlib, json, sys
from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice
models = {"golden": GGUFModel(sys.argv[1]), "quant": GGUFModel(sys.argv[2])}
cases = json.loads(sys.argv[3])
print(json.dumps([hashlib.sha256(cut_slice(models[m], l, lo, hi)).hexdigest() for m, l, lo, hi in cases]))
"""


def test_cut_is_byte_deterministic_across_processes(golden_model: GGUFModel, quant_model: GGUFModel,
                                                     quant_path: Path) -> None:
    models = {"golden": golden_model, "quant": quant_model}
    here = [sha(cut_slice(models[m], layer, lo, hi)) for m, layer, lo, hi in CASES]
    assert len(set(here)) == len(CASES)
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(GOLDEN), str(quant_path), json.dumps(CASES)],
                         stdout=subprocess.PIPE, env={**os.environ, "PYTHONHASHSEED": str(seed)})
        for seed in (1, 2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [json.loads(o) for o in outs] == [here, here]


def split_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_file_is_canonical_safetensors(golden_model: GGUFModel, quant_model: GGUFModel, tmp_path: Path) -> None:
    for model, layer, lo, hi in [(golden_model, 1, 2, 6), (quant_model, 0, 1, 5)]:
        data = cut_slice(model, layer, lo, hi)
        (n,) = struct.unpack("<Q", data[:8])
        header, _ = split_file(data)
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        assert data[8 : 8 + n] == text + b" " * (n - len(text)) and (8 + n) % 8 == 0
        meta_json = header["__metadata__"][METADATA_KEY]
        assert list(header["__metadata__"]) == [METADATA_KEY]
        assert meta_json == json.dumps(json.loads(meta_json), sort_keys=True, separators=(",", ":"))
        meta = json.loads(meta_json)
        stack = model.expert_stack(layer, lo, hi)
        assert meta == {
            "format": 1, "model_id": model.model_id, "arch": "qwen3moe", "layer": layer, "lo": lo, "hi": hi,
            "d_model": model.config.d_model, "d_expert": model.config.d_expert,
            "tensors": {k: {"type": t.qtype.name, "shape": list(t.shape)}
                        for k, t in (("gate", stack.gate_t), ("up", stack.up_t), ("down", stack.down_t))},
        }
        # the reference reader agrees on every byte
        path = tmp_path / f"{layer}-{lo}-{hi}.safetensors"
        path.write_bytes(data)
        with safetensors.safe_open(str(path), framework="np") as f:
            assert f.metadata() == {METADATA_KEY: meta_json}
            assert sorted(f.keys()) == ["down", "gate", "up"]
            for kind, t in (("gate", stack.gate_t), ("up", stack.up_t), ("down", stack.down_t)):
                arr = f.get_tensor(kind)
                assert arr.dtype == np.uint8 and arr.shape == t.raw.shape
                assert np.array_equal(arr, t.raw)


@pytest.mark.parametrize(("layer", "lo", "hi"), [(-1, 0, 1), (2, 0, 1), (0, -1, 2), (0, 3, 3), (0, 4, 2), (0, 0, 9),
                                                  (0, 8, 9)])
def test_bad_ranges(golden_model: GGUFModel, tmp_path: Path, layer: int, lo: int, hi: int) -> None:
    with pytest.raises(SliceError, match="out of range|invalid") as exc:
        cut_slice(golden_model, layer, lo, hi)
    assert exc.value.code == "bad_slice_range"
    with pytest.raises(SliceError):
        SliceCache(golden_model, tmp_path).get(layer, lo, hi)
    assert not any(tmp_path.rglob("*"))


# -- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["path", "bytes"])
@pytest.mark.parametrize(("which", "layer", "lo", "hi"), [("golden", 1, 2, 6), ("quant", 0, 1, 5), ("quant", 1, 0, 6)])
def test_round_trip_is_bit_identical(golden_model: GGUFModel, quant_model: GGUFModel, tmp_path: Path,
                                     source: str, which: str, layer: int, lo: int, hi: int) -> None:
    model = golden_model if which == "golden" else quant_model
    data = cut_slice(model, layer, lo, hi)
    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    loaded = load_slice(path if source == "path" else data)
    assert loaded.key == SliceKey(model.model_id, layer, lo, hi)
    assert loaded.meta.d_model == model.config.d_model
    ref = model.expert_stack(layer, lo, hi)
    assert (loaded.experts.n_expert, loaded.experts.d_model, loaded.experts.d_expert) == (hi - lo, ref.d_model,
                                                                                          ref.d_expert)
    assert [loaded.experts.gate_t.qtype, loaded.experts.up_t.qtype, loaded.experts.down_t.qtype] == [
        ref.gate_t.qtype, ref.up_t.qtype, ref.down_t.qtype]

    g = torch.Generator().manual_seed(layer * 100 + lo)
    n_rows, n = 9, hi - lo
    x = torch.randn(n_rows, ref.d_model, generator=g)
    rows = torch.arange(n_rows).repeat_interleave(2)
    experts = torch.stack([torch.randperm(n, generator=g)[:2] for _ in range(n_rows)]).reshape(-1)
    weights = torch.rand(rows.numel(), generator=g)
    want = slice_partial_sum(x, rows, experts, weights, ref)
    got = slice_partial_sum(x, rows, experts, weights, loaded.experts)
    assert want.abs().sum() > 0
    assert torch.equal(got, want)
    for e in range(n):  # and every weight, not only the ones this routing touched
        assert torch.equal(loaded.experts.gate(e), ref.gate(e))
        assert torch.equal(loaded.experts.up(e), ref.up(e))
        assert torch.equal(loaded.experts.down(e), ref.down(e))


def rewrite(data: bytes, mutate: Callable[[dict[str, Any], dict[str, Any]], None]) -> bytes:
    """Apply ``mutate(header, meta)`` and re-encode the header around the same data."""
    header, body = split_file(data)
    original = header["__metadata__"][METADATA_KEY]
    meta = json.loads(original)
    mutate(header, meta)
    if header.get("__metadata__", {}).get(METADATA_KEY) == original:
        header["__metadata__"][METADATA_KEY] = json.dumps(meta)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _set(path: str, value: Any) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    def mutate(header: dict[str, Any], meta: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = {"header": header, "meta": meta}
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()

CORRUPTIONS: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("truncated", lambda d: d[:-1], "truncated"),
    ("padded", lambda d: d + b"\0", "truncated or padded"),
    ("garbage", lambda d: b"hello", "too short"),
    ("huge header length", lambda d: struct.pack("<Q", 1 << 40) + d[8:], "does not fit"),
    ("header not json", lambda d: d[:8] + b"x" + d[9:], "not JSON"),
    ("header not an object", lambda d: struct.pack("<Q", 8) + b"[1,2,3] " + d[8:], "not a JSON object"),
    ("no metadata", lambda d: rewrite(d, _set("header.__metadata__", _DELETE)), "is missing"),
    ("metadata not json", lambda d: rewrite(d, _set(f"header.__metadata__.{METADATA_KEY}", "{nope")),
     "bad slice metadata"),
    ("metadata not a string", lambda d: rewrite(d, _set(f"header.__metadata__.{METADATA_KEY}", 5)), "is missing"),
    ("metadata field missing", lambda d: rewrite(d, _set("meta.d_model", _DELETE)), "bad slice metadata"),
    ("negative layer", lambda d: rewrite(d, _set("meta.layer", -1)), "bad slice metadata"),
    ("future format", lambda d: rewrite(d, _set("meta.format", 3)), "format 3 is not supported"),
    ("format 2 without an activation", lambda d: rewrite(d, _set("meta.format", 2)), "format 2 with activation"),
    ("an activation in format 1", lambda d: rewrite(d, _set("meta.activation", "silu")), "format 1 with activation"),
    ("an activation not computed here",
     lambda d: rewrite(rewrite(d, _set("meta.format", 2)), _set("meta.activation", "relu2")),
     "activation 'relu2' cannot be computed here"),
    ("unknown type", lambda d: rewrite(d, _set("meta.tensors.gate.type", "Q9_9")), "not supported"),
    ("shape disagrees", lambda d: rewrite(d, _set("meta.tensors.up.shape.1", 63)), "logical shape"),
    ("d_model lies", lambda d: rewrite(d, _set("meta.d_model", 64)), "logical shape"),
    ("range lies", lambda d: rewrite(d, _set("meta.hi", 7)), "logical shape"),
    ("type lies", lambda d: rewrite(d, _set("meta.tensors.down.type", "F16")), "must be U8"),
    ("stored dtype", lambda d: rewrite(d, _set("header.gate.dtype", "F32")), "must be U8"),
    ("stored shape", lambda d: rewrite(d, _set("header.down.shape.0", 3)), "must be U8"),
    ("extra tensor", lambda d: rewrite(d, _set("header.extra", {"dtype": "U8", "shape": [0],
                                                                "data_offsets": [0, 0]})), "exactly the tensors"),
    ("tensor missing", lambda d: rewrite(d, _set("meta.tensors.up", _DELETE)), "exactly the tensors"),
    ("offsets", lambda d: rewrite(d, _set("header.up.data_offsets.0", 8)), "data_offsets"),
]


@pytest.mark.parametrize("source", ["path", "bytes"])
@pytest.mark.parametrize(("name", "corrupt", "message"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_files_are_refused(golden_model: GGUFModel, tmp_path: Path, source: str, name: str,
                                     corrupt: Callable[[bytes], bytes], message: str) -> None:
    good = cut_slice(golden_model, 1, 2, 6)
    assert load_slice(rewrite(good, lambda h, m: None)).key.hi == 6  # the helper alone breaks nothing
    bad = corrupt(good)
    assert bad != good
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bad)
    with pytest.raises(SliceError, match=message):
        load_slice(path if source == "path" else bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SliceError, match="cannot read"):
        load_slice(tmp_path / "nope.safetensors")


# -- cache --------------------------------------------------------------------------------------


def test_slices_are_served_from_the_gguf_and_hashed_once(golden_model: GGUFModel, tmp_path: Path) -> None:
    """No copy on disk: the file is the header plus ``pread`` ranges of the GGUF, any byte range of it
    equal to ``cut_slice``'s; concurrent callers hash a slice once, a new process reads the digest
    from the index, and an index from another GGUF is not trusted."""
    want = cut_slice(golden_model, 0, 2, 5)
    cache = SliceCache(golden_model, tmp_path)
    results = []
    barrier = threading.Barrier(6)

    def worker() -> None:
        barrier.wait()
        results.append(cache.get(0, 2, 5))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and len({(r.sha256, r.size) for r in results}) == 1
    sf = results[0]
    assert (sf.sha256, sf.size, sf.path) == (sha(want), len(want), golden_model.path)
    assert b"".join(sf.read(0, sf.size)) == want
    n_head = len(sf.header)
    for a, b in [(0, 5), (n_head - 3, n_head + 9), (n_head, sf.size), (sf.size - 1, sf.size), (7, 7), (100, 20_000)]:
        assert b"".join(sf.read(a, b, piece=4096)) == want[a:b], (a, b)
    with pytest.raises(SliceError, match="outside"):
        list(sf.read(0, sf.size + 1))
    assert cache.hashed <= 6 and cache.key(0, 2, 5) == SliceKey(golden_model.model_id, 0, 2, 5)
    files = sorted(p.name for p in (tmp_path / golden_model.model_id).iterdir())
    assert files == ["sha256.json"]  # the digests only: no slice file, no temp file left
    (tmp_path / golden_model.model_id / "0-2-5.safetensors").write_bytes(want)  # a copy an earlier release kept
    again = SliceCache(golden_model, tmp_path)
    assert not (tmp_path / golden_model.model_id / "0-2-5.safetensors").exists()  # its disk given back
    assert again.get(0, 2, 5).sha256 == sf.sha256 and again.hashed == 0  # from the index
    index = (tmp_path / golden_model.model_id / "sha256.json")
    index.write_bytes(index.read_bytes().replace(golden_model.sha256.encode(), b"0" * 64))  # another GGUF's
    other = SliceCache(golden_model, tmp_path)
    assert other.get(0, 2, 5).sha256 == sf.sha256 and other.hashed == 1


def test_the_digest_index_is_bounded_least_recently_used_first(golden_model: GGUFModel, tmp_path: Path) -> None:
    cache = SliceCache(golden_model, tmp_path, max_entries=3)
    keys = [(0, 0, 2), (0, 2, 4), (1, 0, 2), (1, 2, 4)]
    for k in keys[:3]:
        cache.get(*k)
    cache.get(*keys[0])  # used again: the most recent
    cache.get(*keys[3])  # one too many: forgets the least recently used, keys[1]
    again = SliceCache(golden_model, tmp_path, max_entries=3)
    for k in (keys[0], keys[2], keys[3]):
        again.get(*k)
    assert again.hashed == 0
    again.get(*keys[1])
    assert again.hashed == 1
    assert b"".join(again.get(*keys[1]).read(0, again.get(*keys[1]).size)) == cut_slice(golden_model, 0, 2, 4)


# -- manifest -----------------------------------------------------------------------------------


def test_manifest(golden_model: GGUFModel, quant_model: GGUFModel, quant_path: Path) -> None:
    g = build_manifest(golden_model)
    assert (g.model_id, g.arch, g.n_layer, g.n_expert, g.n_expert_used, g.d_model, g.d_expert) == (
        golden_model.model_id, "qwen3moe", 2, 8, 2, 128, 64)
    assert g.tensor_types == [{"gate": "F32", "up": "F32", "down": "F32"}] * 2
    assert g.bytes_per_expert == [3 * 64 * 128 * 4] * 2
    assert g.gguf_sha256 == file_sha256(GOLDEN)
    assert golden_model.model_id == f"qwen3moe-tiny-f32-{g.gguf_sha256[:12]}"

    q = build_manifest(quant_model)
    assert q.tensor_types == [{k: t.name for k, t in types.items()} for types in QUANT_LAYER_TYPES]
    q8_row, q4_row = QD_MODEL // 32 * 34, QD_MODEL // 32 * 18
    assert q.bytes_per_expert == [
        QD_EXPERT * q8_row + QD_EXPERT * q4_row + QD_MODEL * QD_EXPERT * 2,
        2 * QD_EXPERT * q8_row + QD_MODEL * (QD_EXPERT // 32 * 34),
    ]
    assert q.gguf_sha256 == file_sha256(quant_path)
    # bytes per expert predicts the slice file's size up to its header
    data = cut_slice(quant_model, 0, 1, 5)
    (n,) = struct.unpack("<Q", data[:8])
    assert len(data) == 8 + n + 4 * q.bytes_per_expert[0]

    assert msgspec.json.decode(msgspec.json.encode(q), type=ModelManifest) == q




def test_an_architectures_activation_travels_in_manifest_and_slice(golden_model: GGUFModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """SiLU slices keep their bytes (no activation field, format 1); experts of another activation are
    cut as format 2 naming it, the manifest alone rebuilds that header, and a volunteer whose kernels
    lack the activation refuses the slice (and, from the manifest, before downloading it)."""
    import dataclasses

    from swarm.model import kernels
    from swarm.model.slices import build_manifest, check_activation, plan_slice

    silu = cut_slice(golden_model, 0, 0, 4)
    meta = json.loads(split_file(silu)[0]["__metadata__"][METADATA_KEY])
    assert meta["format"] == 1 and "activation" not in meta
    assert build_manifest(golden_model).expert_activation == "silu"
    cfg = golden_model.config
    monkeypatch.setattr(golden_model, "config", dataclasses.replace(
        cfg, spec=dataclasses.replace(cfg.spec, expert_activation="relu2")))
    other = cut_slice(golden_model, 0, 0, 4)
    meta = json.loads(split_file(other)[0]["__metadata__"][METADATA_KEY])
    assert (meta["format"], meta["activation"]) == (2, "relu2")
    manifest = build_manifest(golden_model)
    assert manifest.expert_activation == "relu2" and manifest.can_verify_experts
    assert plan_slice(manifest, 0, 0, 4).header == other[: len(plan_slice(manifest, 0, 0, 4).header)]
    with pytest.raises(SliceError, match="cannot be computed here") as err:
        load_slice(other)
    assert err.value.code == "unsupported_activation"
    with pytest.raises(SliceError, match="computes silu, swiglu_oai"):
        check_activation(manifest.expert_activation)
    monkeypatch.setattr(kernels, "EXPERT_ACTIVATIONS", ("silu", "swiglu_oai", "relu2"))  # a version that has it
    assert load_slice(other).key == load_slice(silu).key


def test_hold_proofs_cover_a_biased_slice_to_its_last_byte() -> None:
    """gpt-oss: the challenged data is the slice file's whole tensor data, weights then biases; the
    coordinator (pread of its GGUF) and the volunteer (its slice file) agree on windows anywhere in
    it, the bias tail included, and a window past its end is refused."""
    from swarm.model.slices import hold_digest, hold_digest_from_file
    from tests.conftest import FIXTURES

    model = GGUFModel(FIXTURES / "golden" / "gpt-oss-tiny-mxfp4_moe.gguf")
    stack = model.expert_stack(0, 0, 4)
    served = load_slice(cut_slice(model, 0, 0, 4)).experts
    size = stack.nbytes
    assert size == sum(t.nbytes for t in stack.tensors().values()) > stack.gate_t.nbytes * 3  # biases included
    spans = tuple(model.file_span(t.raw) for t in stack.tensors().values())
    for windows in ([(0, 64)], [(size - 100, 100)], [(size - 4096, 4096), (17, 300)]):
        nonce = b"n" * 16
        assert hold_digest_from_file(model.path, spans, nonce, windows) == hold_digest(served, nonce, windows)
    with pytest.raises(SliceError):
        hold_digest(served, b"n" * 16, [(size - 10, 11)])
