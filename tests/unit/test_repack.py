"""swarm.model.kernels.repack: ggml's CPU_REPACK layouts in the ggml kernels -- which weights are
repacked, batch and thread invariance on them (the gemm on groups of 4 rows against the gemv), the
repacked bits against the plain kernels', the mirror (one copy per stored matrix, shared by views of
sub-ranges, freed with the stored bytes), the opt-out, and the kernel id."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

import swarm.model.kernels.ggml as K
from swarm.model.kernels import repack

PACKED_MM = ("Q4_0", "IQ4_NL", "MXFP4")
PACKED_MMID = PACKED_MM  # and Q4_K with MOE_SWARM_REPACK=all
ALL_MMID = (*PACKED_MMID, "Q4_K")
NS = (1, 2, 3, 4, 5, 8, 16)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(4321)


@pytest.fixture
def plain() -> Iterator[None]:
    """Repacking off for what is built inside (and back on after)."""
    repack.set_repack(False)
    try:
        yield
    finally:
        repack.set_repack(True)


@pytest.fixture
def with_q4k() -> Iterator[None]:
    """``MOE_SWARM_REPACK=all``: Q4_K experts repacked too."""
    repack.set_repack("all")
    try:
        yield
    finally:
        repack.set_repack(True)


def quant(rng: np.random.Generator, t: str, shape: tuple[int, ...]) -> np.ndarray:
    return K.quantize((rng.standard_normal(shape) * 0.03).astype(np.float32), t)


def test_the_build_repacks():
    """ops/ggml-cmake-args builds with GGML_CPU_REPACK=ON: the buffer type is there, weights are
    repacked by default, and the kernel id says so (and goes back to the plain id when off)."""
    assert repack.available() and K.build_info()["repack"] is True
    assert repack.repack_active()
    on = K.kernel_id()
    repack.set_repack(False)
    try:
        assert K.kernel_id() != on and repack.repacked_types() == ((), ())
    finally:
        repack.set_repack(True)
    assert K.kernel_id() == on


@pytest.mark.parametrize("t", K.SUPPORTED_TYPES)
def test_which_weights_are_repacked(t):
    tid = K._type_id(t)
    assert repack.packs(tid, (512, 64), "mul_mat") == (t in PACKED_MM)
    assert repack.packs(tid, (512, 64, 4), "mul_mat_id") == (t in PACKED_MMID)
    assert not repack.packs(tid, (512, 64), "get_rows")  # any other use reads the stored layout
    assert not repack.packs(tid, (512, 64, 4), "mul_mat")  # 3-D MUL_MAT (MLA heads): as stored
    if t in PACKED_MMID:
        assert not repack.packs(tid, (512, 60, 4), "mul_mat_id")  # rows interleave 8 at a time
    repack.set_repack("all")
    try:
        assert repack.packs(tid, (512, 64, 4), "mul_mat_id") == (t in ALL_MMID)
        assert repack.packs(tid, (512, 64), "mul_mat") == (t in PACKED_MM)  # never Q4_K's gemm
    finally:
        repack.set_repack(True)


@pytest.mark.parametrize("t", PACKED_MM)
def test_matmul_repacked_batch_and_thread_invariant(rng, t):
    out, inn = 64, 512
    raw = quant(rng, t, (out, inn))
    x = rng.standard_normal((16, inn)).astype(np.float32)
    one = K.GgmlMatmul(raw, t, out, inn)
    assert one._w.contents.extra and not np.shares_memory(one._raw, raw)  # the repacked copy
    alone = np.stack([one(x[i:i + 1])[0] for i in range(16)])
    for nt in (1, 2):
        mm = K.GgmlMatmul(raw, t, out, inn, n_threads=nt, max_rows=12)
        for n in NS:
            assert np.array_equal(bits(mm(x[:n])), bits(alone[:n])), (t, nt, n)


def test_q4k_matmul_stays_as_stored(rng, with_q4k):
    """A 2-D Q4_K weight keeps the plain kernels: the repacked gemm (4 rows at a time) does not give
    the repacked gemv's bits. The evidence: the same weight forced into the repacked layout, whose
    rows 0..3 of a batch of 4 differ from each row alone (in the last bits)."""
    out, inn = 64, 512
    raw = quant(rng, "Q4_K", (out, inn))
    mm = K.GgmlMatmul(raw, "Q4_K", out, inn)
    assert not mm._w.contents.extra and mm._w.contents.data == raw.ctypes.data
    forced = K.GgmlMatmul(raw, "Q4_K", out, inn)
    tid = K._type_id("Q4_K")
    forced._raw = repack.packed(raw, tid, (inn, out))
    forced._w.contents.data = forced._raw.ctypes.data
    repack.mark(forced._w, tid, (inn, out))
    x = rng.standard_normal((4, inn)).astype(np.float32)
    alone = np.stack([forced(x[i:i + 1])[0] for i in range(4)])
    together = forced(x)
    assert not np.array_equal(bits(together), bits(alone))
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-4)


@pytest.mark.parametrize("t", [*ALL_MMID, ("Q4_K", "Q4_K", "Q5_0")])
def test_experts_repacked_batch_and_thread_invariant(rng, t, with_q4k):
    """Every (row, expert) pair through the gemv: a pair's bits never depend on the others, the
    bucket, or the threads; ``combined`` (one graph) has ``compute``'s bits."""
    types = (t, t, t) if isinstance(t, str) else t
    d, f, e, k = 256, 256, 6, 3
    raws = [quant(rng, tt, s) for tt, s in zip(types, ((e, f, d), (e, f, d), (e, d, f)), strict=True)]
    x = rng.standard_normal((16, d)).astype(np.float32)
    rows, exps = np.arange(16), rng.integers(0, e, 16)
    k1 = K.GgmlExpertKernel(*raws, types, d, f, e)
    assert k1._packed == tuple(tt in ALL_MMID for tt in types)
    alone = np.stack([k1.expert_outputs(x, rows[i:i + 1], exps[i:i + 1])[0] for i in range(16)])
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(16)])
    w = rng.random((16, k)).astype(np.float32)
    for nt, mp in ((1, 512), (2, 512), (2, 5)):
        kk = K.GgmlExpertKernel(*raws, types, d, f, e, n_threads=nt, max_pairs=mp)
        for n in NS:
            assert np.array_equal(bits(kk.expert_outputs(x, rows[:n], exps[:n])), bits(alone[:n])), (t, nt, mp, n)
            want = kk.compute(x[:n], np.repeat(np.arange(n), k), ids[:n].reshape(-1), w[:n].reshape(-1))
            assert np.array_equal(bits(kk.combined(x[:n], ids[:n], w[:n])), bits(want)), (t, nt, mp, n)


@pytest.mark.parametrize("t", ALL_MMID)
def test_repacked_bits_against_the_plain_kernels(rng, t, plain):
    """Other bits than the plain kernels' (another summation order in the dot products; the down
    projection's input, quantised to 8 bits, may then round to a neighbouring step: ~1e-4 here)."""
    d, f, e = 256, 256, 4
    raws = [quant(rng, t, s) for s in ((e, f, d), (e, f, d), (e, d, f))]
    x = rng.standard_normal((8, d)).astype(np.float32)
    rows, exps = np.arange(8), np.arange(8) % e
    flat = K.GgmlExpertKernel(*raws, t, d, f, e)  # built with repacking off
    assert flat._packed == (False, False, False) and flat._w[0].contents.data == raws[0].ctypes.data
    repack.set_repack("all")
    pk = K.GgmlExpertKernel(*raws, t, d, f, e)
    assert pk._packed == (True, True, True)
    a, b = flat.expert_outputs(x, rows, exps), pk.expert_outputs(x, rows, exps)
    assert not np.array_equal(bits(a), bits(b))
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-3)


def test_views_share_the_mirror_and_rebind(rng, with_q4k):
    """Experts lo..hi of a stack (a view of its bytes) are the same range of the one repacked copy;
    a pooled kernel rebound to another stack's bytes computes that stack (its repacked copy)."""
    t, d, f, e = "Q4_K", 256, 256, 8
    raws = [quant(rng, t, s) for s in ((e, f, d), (e, f, d), (e, d, f))]
    full = K.GgmlExpertKernel(*raws, t, d, f, e)
    per = [r.nbytes // e for r in raws]
    part = K.GgmlExpertKernel(*(r[2 * p:6 * p] for r, p in zip(raws, per, strict=True)), t, d, f, 4)
    for i in range(3):
        assert part._raw[i].ctypes.data == full._raw[i].ctypes.data + 2 * per[i]
        assert np.shares_memory(part._raw[i], full._raw[i])
    x = rng.standard_normal((4, d)).astype(np.float32)
    got = part.expert_outputs(x, np.arange(4), np.arange(4))
    assert np.array_equal(bits(got), bits(full.expert_outputs(x, np.arange(4), np.arange(4) + 2)))
    other = [quant(rng, t, s) for s in ((4, f, d), (4, f, d), (4, d, f))]
    fresh = K.GgmlExpertKernel(*other, t, d, f, 4)
    part.rebind(*other)
    assert np.array_equal(bits(part.expert_outputs(x, np.arange(4), np.arange(4))),
                          bits(fresh.expert_outputs(x, np.arange(4), np.arange(4))))


def test_mirror_lives_as_long_as_the_stored_bytes(rng):
    t, d, f, e = "Q4_0", 256, 256, 2
    raws = [quant(rng, t, s) for s in ((e, f, d), (e, f, d), (e, d, f))]
    k = K.GgmlExpertKernel(*raws, t, d, f, e)
    mirrors = [weakref.ref(repack._MIRRORS[id(r)][1]) for r in raws]  # each array its own root
    assert all(np.shares_memory(k._raw[i], mirrors[i]().arr) for i in range(3))
    del k, raws
    gc.collect()
    assert all(m() is None for m in mirrors)


def test_opt_out_keeps_zero_copy(rng, plain):
    t, d, f, e = "Q4_K", 256, 256, 2
    raws = [quant(rng, t, s) for s in ((e, f, d), (e, f, d), (e, d, f))]
    k = K.GgmlExpertKernel(*raws, t, d, f, e)
    assert all(k._w[i].contents.data == raws[i].ctypes.data and not k._w[i].contents.extra for i in range(3))
    mm = K.GgmlMatmul(quant(rng, "Q4_0", (64, 256)), "Q4_0", 64, 256)
    assert not mm._w.contents.extra


@pytest.mark.parametrize("name", ["qwen3moe-small-w224-q4_k_m", "qwen3moe-tiny-q4_0", "qwen2moe-tiny-mxfp4_moe"])
def test_fused_moe_on_repacked_experts_gives_the_separate_paths_bits(name, with_q4k):
    """The engine's fused layer (``AttnOutMoE``: ``mul_mat_id`` on the repacked experts in its graph)
    and the separate path (``GgmlExpertKernel``, as a volunteer computes them) agree bit for bit on
    repacked weights too, Q4_K included (with_q4k): all-local equals distributed."""
    from swarm.model.gguf import GGUFModel
    from tests.conftest import FIXTURES
    from tests.unit.test_fused_moe import test_fused_layers_give_the_separate_paths_bits as same_bits

    st = GGUFModel(FIXTURES / "golden" / f"{name}.gguf").expert_stack(0)
    assert repack.packs(int(st.gate_t.qtype), (st.d_model, st.d_expert, st.n_expert), "mul_mat_id")
    same_bits(name)


def test_the_coordinators_repack_flag_reaches_the_kernels() -> None:
    """``moe-swarm coordinator --repack all`` (the config's ``repack``): the runtime's weights are bound with
    Q4_K experts repacked and its kernel id says so; without the flag the process's setting stays."""
    import argparse

    from coordinator.cli import add_parser, config_from_args
    from coordinator.server import load_runtime
    from tests.conftest import FIXTURES

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    model = str(FIXTURES / "golden" / "qwen3moe-small-w224-q4_k_m.gguf")
    assert config_from_args(p.parse_args(["coordinator", "--model", model])).repack is None
    cfg = config_from_args(p.parse_args(["coordinator", "--model", model, "--repack", "all"]))
    assert cfg.repack == "all"
    plain_id = K.kernel_id()
    try:
        load_runtime(cfg)
        assert K._type_id("Q4_K") in repack.repacked_types()[1] and K.kernel_id() != plain_id
    finally:
        repack.set_repack(True)
    assert K.kernel_id() == plain_id


def test_the_volunteers_repack_flag_parses() -> None:
    import argparse

    from volunteer.cli import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    assert p.parse_args(["volunteer", "--repack", "off"]).repack == "off"
    assert p.parse_args(["volunteer"]).repack is None
    with pytest.raises(SystemExit):
        p.parse_args(["volunteer", "--repack", "maybe"])
