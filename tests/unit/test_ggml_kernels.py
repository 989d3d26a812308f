"""swarm.model.kernels.ggml: build flags, numerics vs a float64 reference, batch/thread invariance,
the project's summation rule, partition chaining, zero-copy mmap, argument validation."""

from __future__ import annotations

import threading

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

import swarm.model.kernels.ggml as K

ALL = K.SUPPORTED_TYPES


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def deq(raw: np.ndarray, t: str, shape: tuple[int, ...]) -> np.ndarray:
    rows = int(np.prod(shape[:-1]))
    return dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[t]).reshape(shape).astype(np.float64)


def act_round(x: np.ndarray, t: str) -> np.ndarray:
    """x rounded as ggml rounds activations for weight type t (float64 result).

    Q8_1 is modelled as its values d*q only (the fp16 block sum is checked in test_q8_1_model)."""
    a = K.activation_type(t)
    x = x.astype(np.float32)
    if a == "F32":
        return x.astype(np.float64)
    if a == "F16":
        return x.astype(np.float16).astype(np.float64)
    if a in ("BF16", "Q8_0"):
        qt = gguf.GGMLQuantizationType[a]
        return dequantize(gguf_quantize(x, qt), qt).astype(np.float64)
    xb = x.reshape(x.shape[0], -1, 256 if a == "Q8_K" else 32)
    if a == "Q8_1":
        amax = np.abs(xb).max(-1, keepdims=True)
        d = (amax / np.float32(127)).astype(np.float32)
        idv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        return (d.astype(np.float16).astype(np.float64) * np.rint(xb * idv)).reshape(x.shape)
    i = np.abs(xb).argmax(-1)[..., None]
    isc = (np.float32(-127) / np.take_along_axis(xb, i, -1)).astype(np.float32)
    q = np.minimum(127, np.rint(isc * xb))
    return ((np.float32(1) / isc).astype(np.float64) * q).reshape(x.shape)


def make_stack(rng, t, d, f, e, scale=0.03):
    types = (t, t, t) if isinstance(t, str) else t
    arrs = [(rng.standard_normal(s) * scale).astype(np.float32) for s in ((e, f, d), (e, f, d), (e, d, f))]
    return [K.quantize(a, tt) for a, tt in zip(arrs, types, strict=True)], types


def ref_slice(x, rows, exps, w, raws, types, d, f, e):
    """float64 reference of the slice partial sum (f32 activations)."""
    gd, ud, dd = deq(raws[0], types[0], (e, f, d)), deq(raws[1], types[1], (e, f, d)), deq(raws[2], types[2], (e, d, f))
    out = np.zeros((x.shape[0], d))
    for r, ex, ww in zip(rows, exps, w, strict=True):
        gg, uu = gd[ex] @ x[r], ud[ex] @ x[r]
        out[r] += float(ww) * (dd[ex] @ (gg / (1 + np.exp(-gg)) * uu))
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- build

def test_build_flags_portable_v3():
    bi = K.build_info()
    fl = bi["flags"]
    assert bi["ggml"] == "0.15.3" and bi["ggml_python"] == "0.0.45"
    assert fl["avx"] == fl["avx2"] == fl["fma"] == fl["f16c"] == fl["bmi2"] == 1
    assert fl["avx512"] == fl["avx512_vnni"] == fl["avx512_bf16"] == fl["avx_vnni"] == fl["amx_int8"] == 0
    assert fl["llamafile"] == 0, "LLAMAFILE=ON breaks batch invariance for F32/F16/BF16/IQ4_NL"
    assert bi["openmp"] is False
    assert bi["repack"] is True, "ops/ggml-cmake-args builds with GGML_CPU_REPACK=ON (swarm.model.kernels.repack)"
    kid = K.kernel_id()
    assert kid.startswith("ggml-0.15.3-avx+avx2+fma+f16c+bmi2-") and kid == K.kernel_id()


def test_host_supported(tmp_path):
    assert K.host_supported()  # this CPU runs the tests, so it must qualify
    old = tmp_path / "cpuinfo"
    old.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx\n")
    assert not K.host_supported(str(old))
    assert not K.host_supported(str(tmp_path / "missing"))


def test_numeric_fingerprint_stable():
    fp = K.numeric_fingerprint()
    assert fp == K.numeric_fingerprint() and len(fp) == 64
    assert K.numeric_fingerprint(["Q8_0"]) != K.numeric_fingerprint(["Q4_0"])


def test_bucket_sizes():
    seen = [K._bucket(n, 512) for n in range(1, 513)]
    assert all(b >= n for n, b in zip(range(1, 513), seen, strict=True))
    assert all(b <= max(8, int(n * 1.5) + 1) for n, b in zip(range(1, 513), seen, strict=True))
    assert len(set(seen)) <= 24


def test_graph_time_counts_each_threads_own_graphs(rng):
    """``graph_time``: a thread's seconds inside ggml_graph_compute and its graph count, its own only."""
    out, inn = 64, 256
    mm = K.GgmlMatmul(K.quantize((rng.standard_normal((out, inn)) * 0.02).astype(np.float32), "Q8_0"), "Q8_0", out, inn)
    x = rng.standard_normal((3, inn)).astype(np.float32)
    s0, n0 = K.graph_time()
    mm(x)
    mm(x)
    s1, n1 = K.graph_time()
    assert n1 == n0 + 2 and s1 > s0
    seen: list[tuple[float, int]] = []
    # a thread's ident may be one a finished thread had (the count goes on from its): differences count
    other = threading.Thread(target=lambda: (seen.append(K.graph_time()), mm(x), seen.append(K.graph_time())))
    other.start()
    other.join()
    assert other.ident is not None and seen[1][1] == seen[0][1] + 1 and seen[1][0] > seen[0][0]
    assert K.graph_time(other.ident) == seen[1]
    assert K.graph_time() == (s1, n1)  # the other thread's graph is not counted here


# --------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("t", ALL)
def test_matmul_matches_f64_reference(rng, t):
    out, inn, n = 96, 512, 5
    w = (rng.standard_normal((out, inn)) * 0.02).astype(np.float32)
    x = rng.standard_normal((n, inn)).astype(np.float32)
    raw = K.quantize(w, t)
    y = K.GgmlMatmul(raw, t, out, inn)(x).astype(np.float64)
    wd = deq(raw, t, (out, inn))
    ref = x.astype(np.float64) @ wd.T
    scale = np.abs(ref).max()
    # vs f32 activations: the activation rounding (Q8_0/Q8_K/F16/...) dominates
    assert np.abs(y - ref).max() / scale < (1e-6 if t == "F32" else 2e-2)
    # with ggml's activation rounding modelled, only float32 accumulation error remains
    tol = 2e-3 if K.activation_type(t) == "Q8_1" else 2e-6
    assert np.abs(y - act_round(x, t) @ wd.T).max() / scale < tol
    # 1-D input
    assert np.array_equal(bits(K.GgmlMatmul(raw, t, out, inn)(x[0])), bits(y[0].astype(np.float32)))


@pytest.mark.parametrize("t", ["Q4_1", "Q5_1"])
def test_q8_1_model(rng, t):
    """Q8_1 activations: ggml uses the fp16-rounded block sum s = d*sum(q) for the min term."""
    out, inn, n, bs = 64, 512, 3, {"Q4_1": 20, "Q5_1": 24}[t]
    w = (rng.standard_normal((out, inn)) * 0.02).astype(np.float32)
    x = rng.standard_normal((n, inn)).astype(np.float32)
    raw = K.quantize(w, t)
    wd = deq(raw, t, (out, inn))
    m = raw.reshape(out, inn // 32, bs)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    xb = x.reshape(n, -1, 32)
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    q = np.rint(xb * (np.float32(127) / amax)[..., None].astype(np.float32)).astype(np.float64)
    d16 = d.astype(np.float16).astype(np.float64)
    s16 = (d * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float64)
    ref = (d16[..., None] * q).reshape(n, inn) @ wd.T + (s16 - d16 * q.sum(-1)) @ m.T
    y = K.GgmlMatmul(raw, t, out, inn)(x)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-6


@pytest.mark.parametrize("t", ALL)
def test_experts_match_f64_reference(rng, t):
    d, f, e, n = 512, 256, 4, 4
    raws, types = make_stack(rng, t, d, f, e)
    k = K.GgmlExpertKernel(*raws, t, d, f, e)
    x = rng.standard_normal((n, d)).astype(np.float32)
    rows = np.array([0, 0, 1, 3, 3, 3])
    exps = np.array([2, 0, 1, 3, 0, 1])
    w = rng.random(6).astype(np.float32)
    out = k.compute(x, rows, exps, w)
    ref = ref_slice(x, rows, exps, w, raws, types, d, f, e)
    assert np.all(out[2] == 0)  # a row without pairs stays zero
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < (1e-6 if t == "F32" else 6e-2), err


def test_mixed_types(rng):
    d, f, e = 256, 96, 3  # f % 256 != 0: down cannot be a K-quant, as in real Q4_K models
    types = ("Q4_K", "Q4_K", "Q5_0")
    raws, _ = make_stack(rng, types, d, f, e)
    k = K.GgmlExpertKernel(*raws, types, d, f, e)
    x = rng.standard_normal((2, d)).astype(np.float32)
    out = k.compute(x, [0, 1, 1], [2, 0, 2], [0.5, 0.3, 0.7])
    ref = ref_slice(x, [0, 1, 1], [2, 0, 2], [0.5, 0.3, 0.7], raws, types, d, f, e)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 6e-2


# --------------------------------------------------------------------------- batch invariance

@pytest.mark.parametrize("t", ALL)
def test_matmul_batch_and_thread_invariance(rng, t):
    out, inn = 64, 512
    raw = K.quantize((rng.standard_normal((out, inn)) * 0.02).astype(np.float32), t)
    x = rng.standard_normal((64, inn)).astype(np.float32)
    one = K.GgmlMatmul(raw, t, out, inn, n_threads=1)
    alone = np.stack([one(x[i:i + 1])[0] for i in range(64)])
    for nt in (1, 2):
        mm = K.GgmlMatmul(raw, t, out, inn, n_threads=nt, max_rows=24)  # 64 rows -> chunks 24+24+16
        for n in (1, 2, 3, 8, 64):
            assert np.array_equal(bits(mm(x[:n])), bits(alone[:n])), (t, nt, n)
        perm = rng.permutation(64)
        assert np.array_equal(bits(mm(x[perm])), bits(alone[perm]))


@pytest.mark.parametrize("t", ALL)
def test_experts_batch_and_thread_invariance(rng, t):
    d, f, e = 256, 256, 4
    raws, _ = make_stack(rng, t, d, f, e)
    x = rng.standard_normal((64, d)).astype(np.float32)
    rows, exps = np.arange(64), rng.integers(0, e, 64)
    k1 = K.GgmlExpertKernel(*raws, t, d, f, e, n_threads=1)
    alone = np.stack([k1.expert_outputs(x, rows[i:i + 1], exps[i:i + 1])[0] for i in range(64)])
    for nt, mp in ((1, 512), (2, 512), (1, 7), (2, 20)):
        k = K.GgmlExpertKernel(*raws, t, d, f, e, n_threads=nt, max_pairs=mp)
        for n in (1, 2, 3, 8, 64):
            assert np.array_equal(bits(k.expert_outputs(x, rows[:n], exps[:n])), bits(alone[:n])), (t, nt, mp, n)


@pytest.mark.parametrize("t", ALL)
def test_combined_is_compute_in_one_graph(rng, t):
    """`combined` (the whole routed MoE of the rows in one graph) has the bits of `compute` over the
    same pairs, for every type, row count, bucket cap and thread count; a row's result never
    depends on the other rows (each row alone gives the same bits)."""
    d, f, e, k = 256, 256, 6, 3
    raws, _ = make_stack(rng, t, d, f, e)
    x = rng.standard_normal((64, d)).astype(np.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(64)])
    w = rng.random((64, k)).astype(np.float32)
    k1 = K.GgmlExpertKernel(*raws, t, d, f, e, n_threads=1)
    alone = np.concatenate([k1.combined(x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(64)])
    for nt, mp in ((1, 512), (2, 512), (2, 20)):
        kk = K.GgmlExpertKernel(*raws, t, d, f, e, n_threads=nt, max_pairs=mp)
        for n in (1, 2, 3, 8, 64):
            want = kk.compute(x[:n], np.repeat(np.arange(n), k), ids[:n].reshape(-1), w[:n].reshape(-1))
            got = kk.combined(x[:n], ids[:n], w[:n])
            assert np.array_equal(bits(got), bits(want)), (t, nt, mp, n)
            assert np.array_equal(bits(got), bits(alone[:n])), (t, nt, mp, n)


def test_combined_validates(rng):
    d, f, e = 256, 128, 4
    raws, _ = make_stack(rng, "Q8_0", d, f, e)
    kk = K.GgmlExpertKernel(*raws, "Q8_0", d, f, e)
    x = rng.standard_normal((2, d)).astype(np.float32)
    w = np.ones((2, 2), np.float32)
    with pytest.raises(K.KernelError, match="more than once"):
        kk.combined(x, np.array([[1, 1], [0, 2]]), w)
    with pytest.raises(K.KernelError, match="out of range"):
        kk.combined(x, np.array([[1, 4], [0, 2]]), w)
    with pytest.raises(K.KernelError):
        kk.combined(x, np.array([[1, 2]]), w)
    assert not kk.combined(x[:0], np.zeros((0, 2), np.int64), w[:0]).size


# --------------------------------------------------------------------------- the summation rule

def numpy_slice_partial_sum(y_pairs, rows, exps, w, n, d):
    """Literal port of swarm.model.experts.slice_partial_sum's order on given per-pair outputs."""
    out = np.zeros((n, d), np.float32)
    for ex in np.unique(exps):
        sel = np.nonzero(exps == ex)[0]
        out[rows[sel]] += y_pairs[sel] * w[sel][:, None]
    return out


def test_compute_follows_project_order(rng):
    d, f, e, n = 256, 128, 8, 16
    raws, _ = make_stack(rng, "Q4_0", d, f, e)
    k = K.GgmlExpertKernel(*raws, "Q4_0", d, f, e)
    x = rng.standard_normal((n, d)).astype(np.float32)
    rows = np.repeat(np.arange(n), 4)
    exps = np.concatenate([rng.choice(e, 4, replace=False) for _ in range(n)])
    w = rng.random(rows.size).astype(np.float32)
    perm = rng.permutation(rows.size)  # pair order must not matter
    rows, exps, w = rows[perm], exps[perm], w[perm]
    y = k.expert_outputs(x, rows, exps)
    expect = numpy_slice_partial_sum(y, rows, exps, w, n, d)
    assert np.array_equal(bits(k.compute(x, rows, exps, w)), bits(expect))
    # single-row fast path (decode): one row, its pairs shuffled
    sel = rows == 3
    r1, e1, w1 = rows[sel], exps[sel], w[sel]
    y1 = k.expert_outputs(x, r1, e1)
    assert np.array_equal(bits(k.compute(x, r1, e1, w1)), bits(numpy_slice_partial_sum(y1, r1, e1, w1, n, d)))
    with pytest.raises(K.KernelError):
        k.compute(x, [3, 3], [1, 1], [1.0, 1.0])


def test_matches_torch_slice_partial_sum_order():
    """The numpy accumulation equals torch's zeros + index_add_(h*w) per ascending expert, bit for bit."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    n, d, e = 12, 64, 6
    rows = np.repeat(np.arange(n), 3)
    exps = np.concatenate([rng.choice(e, 3, replace=False) for _ in range(n)])
    w = rng.random(rows.size).astype(np.float32)
    y = rng.standard_normal((rows.size, d)).astype(np.float32)
    out = torch.zeros(n, d)
    tr, te, tw, ty = torch.from_numpy(rows), torch.from_numpy(exps), torch.from_numpy(w), torch.from_numpy(y)
    for ex in torch.unique(te).tolist():
        sel = te == ex
        out.index_add_(0, tr[sel], ty[sel] * tw[sel].unsqueeze(1))
    assert np.array_equal(bits(out.numpy()), bits(numpy_slice_partial_sum(y, rows, exps, w, n, d)))


def test_partition_chaining_is_bit_identical(rng):
    """Contiguous sub-slices (zero-copy views of the same bytes) chained through `acc` in ascending
    lo give the same bits as the whole range at once; per-pair outputs are location-independent."""
    d, f, e, n = 256, 128, 8, 24
    raws, _ = make_stack(rng, "Q8_0", d, f, e)
    full = K.GgmlExpertKernel(*raws, "Q8_0", d, f, e)
    x = rng.standard_normal((n, d)).astype(np.float32)
    rows = np.repeat(np.arange(n), 4)
    exps = np.concatenate([rng.choice(e, 4, replace=False) for _ in range(n)])
    w = rng.random(rows.size).astype(np.float32)
    whole = full.compute(x, rows, exps, w)
    per = [r.reshape(e, -1) for r in raws]
    for cuts in ([0, 4, 8], [0, 1, 3, 8], [0, 2, 5, 7, 8]):
        acc = np.zeros((n, d), np.float32)
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            sub = K.GgmlExpertKernel(*(p[lo:hi].reshape(-1) for p in per), "Q8_0", d, f, hi - lo)
            sel = (exps >= lo) & (exps < hi)
            ys = sub.expert_outputs(x, rows[sel], exps[sel] - lo)
            assert np.array_equal(bits(ys), bits(full.expert_outputs(x, rows[sel], exps[sel])))
            sub.compute(x, rows[sel], exps[sel] - lo, w[sel], acc=acc)
        assert np.array_equal(bits(acc), bits(whole)), cuts


# --------------------------------------------------------------------------- memory, threads, errors

def test_zero_copy_memmap(rng, tmp_path):
    d, f, e = 256, 256, 4
    raws, _ = make_stack(rng, "Q6_K", d, f, e)
    path = tmp_path / "slice.bin"
    with open(path, "wb") as fh:
        for r in raws:
            fh.write(r.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    o1, o2 = raws[0].nbytes, raws[0].nbytes + raws[1].nbytes
    views = mm[:o1], mm[o1:o2], mm[o2:]
    k = K.GgmlExpertKernel(*views, "Q6_K", d, f, e)
    assert all(np.shares_memory(a, b) for a, b in zip(k._raw, views, strict=True))
    assert all(k._w[i].contents.data == views[i].ctypes.data for i in range(3))
    x = rng.standard_normal((3, d)).astype(np.float32)
    ref = K.GgmlExpertKernel(*raws, "Q6_K", d, f, e).compute(x, [0, 1, 2], [3, 0, 1], [1, 1, 1])
    assert np.array_equal(bits(k.compute(x, [0, 1, 2], [3, 0, 1], [1, 1, 1])), bits(ref))


def test_concurrent_use(rng):
    d, f, e = 256, 256, 4
    raws, _ = make_stack(rng, "Q4_K", d, f, e)
    k = K.GgmlExpertKernel(*raws, "Q4_K", d, f, e, n_threads=2)
    xs = [rng.standard_normal((5, d)).astype(np.float32) for _ in range(4)]
    pr, pe, pw = [0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [1.0] * 5
    expect = [k.compute(x, pr, pe, pw) for x in xs]
    got: dict[int, np.ndarray] = {}

    def run(i):
        for _ in range(5):
            got[i] = k.compute(xs[i], pr, pe, pw)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(np.array_equal(bits(got[i]), bits(expect[i])) for i in range(4))


def test_rebind_other_layer(rng):
    d, f, e = 256, 256, 3
    a, _ = make_stack(rng, "Q5_K", d, f, e)
    b, _ = make_stack(rng, "Q5_K", d, f, e)
    x = rng.standard_normal((4, d)).astype(np.float32)
    args = (x, [0, 1, 2, 3, 3], [2, 0, 1, 0, 2], [0.5, 1, 1, 0.25, 0.75])
    k = K.GgmlExpertKernel(*a, "Q5_K", d, f, e)
    ya = k.compute(*args)
    k.rebind(*b)
    assert np.array_equal(bits(k.compute(*args)), bits(K.GgmlExpertKernel(*b, "Q5_K", d, f, e).compute(*args)))
    k.rebind(*a)
    assert np.array_equal(bits(k.compute(*args)), bits(ya))
    with pytest.raises(K.KernelError):
        k.rebind(a[0][:-1], a[1], a[2])


def test_empty_and_acc(rng):
    d, f, e = 256, 64, 2
    raws, _ = make_stack(rng, "Q8_0", d, f, e)
    k = K.GgmlExpertKernel(*raws, "Q8_0", d, f, e)
    x = rng.standard_normal((3, d)).astype(np.float32)
    assert np.array_equal(k.compute(x, [], [], []), np.zeros((3, d), np.float32))
    acc = np.ones((3, d), np.float32)
    res = k.compute(x, [1], [1], [0.5], acc=acc)
    assert res is acc and np.all(acc[0] == 1) and np.all(acc[2] == 1) and not np.all(acc[1] == 1)


def test_validation_raises_not_aborts(rng):
    d, f, e = 256, 64, 2
    raws, _ = make_stack(rng, "Q8_0", d, f, e)
    with pytest.raises(K.KernelError):
        K.GgmlExpertKernel(raws[0][:-1], raws[1], raws[2], "Q8_0", d, f, e)  # wrong byte count
    with pytest.raises(K.KernelError):
        K.GgmlExpertKernel(*raws, "Q4_K", d, f, e)  # f=64 not a multiple of 256
    with pytest.raises(K.KernelError):
        K.GgmlExpertKernel(*raws, "IQ2_XXS", d, f, e)
    with pytest.raises(K.KernelError):
        K.GgmlExpertKernel(raws[0].astype(np.int8), raws[1], raws[2], "Q8_0", d, f, e)
    k = K.GgmlExpertKernel(*raws, "Q8_0", d, f, e)
    x = rng.standard_normal((2, d)).astype(np.float32)
    for args in (([0], [2], [1.0]), ([2], [0], [1.0]), ([-1], [0], [1.0]), ([0, 0], [1, 1], [1.0, 1.0]), ([0], [0], [1.0, 2.0])):
        with pytest.raises(K.KernelError):
            k.compute(x, *args)
    with pytest.raises(K.KernelError):
        k.compute(x[:, :100], [0], [0], [1.0])
    with pytest.raises(K.KernelError):
        k.compute(x, [0], [0], [1.0], acc=np.zeros((2, d), np.float64))
    mm = K.GgmlMatmul(K.quantize(np.ones((4, 256), np.float32), "Q4_0"), "Q4_0", 4, 256)
    with pytest.raises(K.KernelError):
        mm(np.ones((2, 255), np.float32))
    with pytest.raises(K.KernelError):
        K.GgmlMatmul(np.zeros(10, np.uint8), "F16", 4, 256)


@pytest.mark.parametrize("t", ALL)
def test_unaligned_weights(rng, t):
    """Weights at any byte offset (slices of a stack, odd GGUF offsets) give the same bits."""
    raw = K.quantize((rng.standard_normal((32, 256)) * 0.02).astype(np.float32), t)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ref = K.GgmlMatmul(raw, t, 32, 256)(x)
    buf = np.zeros(raw.nbytes + 16, np.uint8)
    for off in (1, 3, 8):
        v = buf[off:off + raw.nbytes]
        v[:] = raw
        assert np.array_equal(bits(K.GgmlMatmul(v, t, 32, 256)(x)), bits(ref))


def test_kernels_in_different_threads_use_their_own_pools():
    """A volunteer's worker threads compute at the same time: each calling thread gets its own
    ggml threadpool (no shared pool lock to queue on), and the bits do not change."""
    rng = np.random.default_rng(5)
    d = 256
    w = K.quantize(rng.standard_normal((64, d)).astype(np.float32), "Q8_0")
    mm = K.GgmlMatmul(w, "Q8_0", 64, d)
    x = rng.standard_normal((3, d)).astype(np.float32)
    ref = mm(x)
    seen, outs = [], []
    together = threading.Barrier(3)  # all alive at once: three distinct threads

    def work():
        together.wait(timeout=30)
        seen.append(K._threadpool(1, 0))
        outs.append(mm(x))
        together.wait(timeout=30)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({p[0] for p in seen}) == 3 and K._threadpool(1, 0) not in seen
    assert all(np.array_equal(o, ref) for o in outs)


@pytest.mark.parametrize("t", ALL)
def test_get_rows_is_the_dequantised_rows(rng, t):
    """The embedding lookup (ggml get_rows on the stored bytes) gives the torch dequantiser's bits
    for every type; out-of-range ids are an error, not an abort."""
    import torch

    from swarm.model.gguf import QTensor
    from swarm.model.kernels import KernelBackend
    from swarm.model.kernels.dense import Embedding

    rows, cols = 40, 256
    raw = K.quantize((rng.standard_normal((rows, cols)) * 0.5).astype(np.float32), t).reshape(rows, -1)
    table = QTensor("token_embd.weight", gguf.GGMLQuantizationType[t], (rows, cols), raw)
    ids = torch.tensor([0, 39, 7, 7, 12])
    a, b = Embedding(table, KernelBackend.GGML)(ids), Embedding(table, KernelBackend.TORCH)(ids)
    assert np.array_equal(bits(a.numpy()), bits(b.numpy()))
    with pytest.raises(K.KernelError, match="out of range"):
        Embedding(table, KernelBackend.GGML)(torch.tensor([40]))
