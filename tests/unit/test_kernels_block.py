"""The ggml graphs of a layer's dense halves, the head and attention (``coordinator.engine.block``, ``.attention``):
they agree with a float64 reference of the same math, every row's result is independent of the other
rows in the call (batch invariance, n in {1, 2, 3, 8, 64}) and of the thread count, and stale cache
rows past a sequence's end never leak into its attention."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.engine.attention import Attention
from coordinator.engine.block import AttnIn, AttnOut, DenseWeight, Head
from swarm.errors import KernelError
from swarm.model.kernels.ggml import _type_id, quantize

D, H, HKV, HD, NE = 256, 8, 2, 32, 16
NS = (1, 2, 3, 8, 64)


def dw(rng: np.random.Generator, out: int, inp: int, t: str = "Q8_0") -> tuple[DenseWeight, np.ndarray]:
    w = (rng.standard_normal((out, inp)) * inp**-0.5).astype(np.float32)
    if t == "F32":
        raw = w.view(np.uint8).reshape(-1)
    else:
        raw = quantize(w, t)
    return DenseWeight(raw, _type_id(t), out, inp), w


def rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w


def rope_neox(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:  # x [n, h, hd]
    hd = x.shape[-1]
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.fixture
def attn_in(rng: np.random.Generator) -> tuple[AttnIn, dict[str, np.ndarray]]:
    (wq, q), (wk, k), (wv, v) = dw(rng, H * HD, D, "F32"), dw(rng, HKV * HD, D, "F32"), dw(rng, HKV * HD, D, "F32")
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    qn = (1 + 0.1 * rng.standard_normal(HD)).astype(np.float32)
    kn = (1 + 0.1 * rng.standard_normal(HD)).astype(np.float32)
    blk = AttnIn(attn_norm=norm, wq=wq, wk=wk, wv=wv, q_norm=qn, k_norm=kn, n_head=H, n_head_kv=HKV, head_dim_k=HD,
                 head_dim_v=HD, n_rot=HD, rope_neox=True, rope_base=10000.0, eps=1e-6)
    return blk, {"q": q, "k": k, "v": v, "norm": norm, "qn": qn, "kn": kn}


def test_attn_in_matches_float64_reference(rng: np.random.Generator, attn_in: tuple[AttnIn, dict[str, np.ndarray]]) -> None:
    blk, w = attn_in
    x = rng.standard_normal((5, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 3], dtype=np.int32)
    q, k, v = blk(x, pos)
    h = rms(x, w["norm"])
    rq = rope_neox(rms((h @ w["q"].T.astype(np.float64)).reshape(5, H, HD), w["qn"]), pos, 10000.0).reshape(5, -1)
    rk = rope_neox(rms((h @ w["k"].T.astype(np.float64)).reshape(5, HKV, HD), w["kn"]), pos, 10000.0).reshape(5, -1)
    np.testing.assert_allclose(q, rq, atol=2e-5)
    np.testing.assert_allclose(k, rk, atol=2e-5)
    np.testing.assert_allclose(v, h @ w["v"].T, atol=2e-5)


def test_attn_out_and_head_match_float64_reference(rng: np.random.Generator) -> None:
    (wo, o), (wr, r), (wh, hw) = dw(rng, D, H * HD, "F32"), dw(rng, NE, D, "F32"), dw(rng, 300, D, "F32")
    fn, on = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32), (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    blk = AttnOut(wo=wo, ffn_norm=fn, router=wr, eps=1e-6)
    a, x = rng.standard_normal((4, H * HD)).astype(np.float32), rng.standard_normal((4, D)).astype(np.float32)
    x2, h, p, sh = blk(a, x)
    assert sh is None
    rx2 = x + a.astype(np.float64) @ o.T
    rh = rms(rx2, fn)
    lg = rh @ r.T
    rp = np.exp(lg - lg.max(-1, keepdims=True))
    rp /= rp.sum(-1, keepdims=True)
    np.testing.assert_allclose(x2, rx2, atol=2e-5)
    np.testing.assert_allclose(h, rh, atol=2e-5)
    np.testing.assert_allclose(p, rp, atol=1e-6)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
    head = Head(output_norm=on, output=wh, eps=1e-6)
    np.testing.assert_allclose(head(x), rms(x, on) @ hw.T, atol=2e-5)


@pytest.mark.parametrize("t", ["F16", "Q8_0", "Q4_K", "Q5_0"])
def test_dense_graphs_are_batch_and_thread_invariant(rng: np.random.Generator, t: str) -> None:
    (wq, _), (wk, _), (wv, _) = dw(rng, H * HD, D, t), dw(rng, HKV * HD, D, t), dw(rng, HKV * HD, D, t)
    one = np.ones(D, np.float32)
    blk = AttnIn(attn_norm=one, wq=wq, wk=wk, wv=wv, q_norm=None, k_norm=None, n_head=H, n_head_kv=HKV,
                 head_dim_k=HD, head_dim_v=HD, n_rot=HD, rope_neox=False, rope_base=1e6, eps=1e-6)
    (wo, _), (wr, _) = dw(rng, D, H * HD, t), dw(rng, NE, D, "F32")
    out = AttnOut(wo=wo, ffn_norm=one, router=wr, eps=1e-6)
    xs = rng.standard_normal((64, D)).astype(np.float32)
    a_s = rng.standard_normal((64, H * HD)).astype(np.float32)
    pos = np.arange(64, dtype=np.int32) * 3
    ref_in = [blk(xs[i : i + 1], pos[i : i + 1]) for i in range(64)]
    ref_out = [out(a_s[i : i + 1], xs[i : i + 1]) for i in range(64)]
    for n in NS:
        for nt in (1, 2):
            got_in, got_out = blk(xs[:n], pos[:n], nt), out(a_s[:n], xs[:n], nt)
            for i in range(n):
                for j in range(3):
                    assert np.array_equal(got_in[j][i], ref_in[i][j][0]), (n, nt, i, j)
                    assert np.array_equal(got_out[j][i], ref_out[i][j][0]), (n, nt, i, j)


def ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int) -> np.ndarray:
    """q [n, H*HD]; k [L, HKV, HD]; v [L, HKV, HD] (positions 0 .. pos+n-1), float64."""
    n = q.shape[0]
    out = np.zeros((n, H, HD))
    for i in range(n):
        L = pos + i + 1
        for h in range(H):
            kv = h // (H // HKV)
            s = k[:L, kv].astype(np.float64) @ q[i].reshape(H, HD)[h] / np.sqrt(HD)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[:L, kv]
    return out.reshape(n, -1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("pad", [1, 32, 256])
def test_attention_matches_reference_and_ignores_stale_rows(rng: np.random.Generator, dtype: type, pad: int) -> None:
    n_ctx, pos, n = 300, 40, 6
    att = Attention(n_head=H, n_head_kv=HKV, head_dim_k=HD, head_dim_v=HD, kv_pad=pad)
    k = rng.standard_normal((n_ctx, HKV, HD)).astype(dtype)
    v = rng.standard_normal((n_ctx, HKV, HD)).astype(dtype)
    k[pos + n :] = np.inf  # a previous occupant's numbers past this sequence's end
    v[pos + n :] = np.nan
    vt = np.ascontiguousarray(v.transpose(1, 2, 0))
    q = rng.standard_normal((n, H * HD)).astype(np.float32)
    got = att(q, k, vt, pos)
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == np.float32 else 2e-2  # f16: q and the weights are rounded to f16, as llama.cpp
    np.testing.assert_allclose(got, ref_attention(q, k[: pos + n], v[: pos + n], pos), atol=tol)
    assert att.n_kv(pos + n, n_ctx) == min(n_ctx, -(-(pos + n) // pad) * pad)


def test_attention_rows_depend_on_the_kv_view_not_on_the_other_rows(rng: np.random.Generator) -> None:
    """With the same kv view (here: always the whole 256-row cache, llama.cpp's padding) a row's bits do
    not depend on how many rows share the call; the view's length alone changes the summation order."""
    n_ctx = 256
    att = Attention(n_head=H, n_head_kv=HKV, head_dim_k=HD, head_dim_v=HD, kv_pad=256)
    k = rng.standard_normal((n_ctx, HKV, HD)).astype(np.float32)
    vt = np.ascontiguousarray(rng.standard_normal((n_ctx, HKV, HD)).astype(np.float32).transpose(1, 2, 0))
    q = rng.standard_normal((64, H * HD)).astype(np.float32)
    k[64:] = 0  # a sequence of 64 positions (the call zeroes the rows past its end anyway)
    vt[..., 64:] = 0

    def run(a: Attention, qq: np.ndarray, pos: int, nt: int = 1) -> np.ndarray:
        return a(qq, k.copy(), vt.copy(), pos, nt)  # the call zeroes the rows past pos + n: keep ours

    whole = run(att, q, 0)  # rows at positions 0..63
    for n in NS:
        assert np.array_equal(run(att, q[:n], 0), whole[:n]), n
        assert np.array_equal(run(att, q[n - 1 : n], n - 1)[0], whole[n - 1]), n  # the row alone
        assert np.array_equal(run(att, q[:n], 0, 2), whole[:n]), n  # two threads
    short = Attention(n_head=H, n_head_kv=HKV, head_dim_k=HD, head_dim_v=HD, kv_pad=1)
    np.testing.assert_allclose(run(short, q[:8], 0), whole[:8], atol=1e-6)


def test_shape_errors_raise(rng: np.random.Generator) -> None:
    att = Attention(n_head=H, n_head_kv=HKV, head_dim_k=HD, head_dim_v=HD)
    k = np.zeros((16, HKV, HD), np.float32)
    with pytest.raises(KernelError):
        att(np.zeros((2, H * HD), np.float32), k, np.zeros((16, HKV, HD), np.float32), 0)  # V not transposed
    with pytest.raises(KernelError):
        att(np.zeros((2, H * HD), np.float32), k, np.zeros((HKV, HD, 16), np.float32), 15)  # past the cache
    with pytest.raises(KernelError):
        Attention(n_head=6, n_head_kv=4, head_dim_k=HD, head_dim_v=HD)


def test_layers_sharing_graphs_keep_their_own_weights(rng: np.random.Generator) -> None:
    """A family shares graph buffers between equal-shaped layers; each computes with its own weights."""
    fam: dict = {}
    solo, shared = [], []
    for _ in range(3):
        (wo, _), (wr, _) = dw(rng, D, H * HD, "Q8_0"), dw(rng, NE, D, "F32")
        fn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        solo.append(AttnOut(wo=wo, ffn_norm=fn, router=wr, eps=1e-6))
        shared.append(AttnOut(wo=wo, ffn_norm=fn, router=wr, eps=1e-6, family=fam))
    assert len(fam) == 1 and all(s._plans is shared[0]._plans for s in shared)
    a, x = rng.standard_normal((3, H * HD)).astype(np.float32), rng.standard_normal((3, D)).astype(np.float32)
    for order in ([0, 1, 2], [2, 0, 1, 1, 0]):  # interleaved: the leaves are re-pointed per call
        for i in order:
            for got, want in zip(shared[i](a, x), solo[i](a, x), strict=True):
                assert np.array_equal(got, want)
    (wo5, _), (wr5, _) = dw(rng, D, H * HD, "Q4_0"), dw(rng, NE, D, "F32")  # another type: its own graphs
    other = AttnOut(wo=wo5, ffn_norm=np.ones(D, np.float32), router=wr5, eps=1e-6, family=fam)
    assert len(fam) == 2 and other._plans is not shared[0]._plans
