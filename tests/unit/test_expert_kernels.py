"""The ExpertKernel seam on a real GGUF's expert stacks: both backends, batch invariance, pair order,
agreement between backends, and the kernel ids the expert protocol announces."""

from __future__ import annotations

import pytest
import torch

from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend, expert_kernel, kernel_id


def routed(n: int, n_expert: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g) + 0.05
    rows = torch.arange(n).repeat_interleave(k)
    return rows, experts.reshape(-1), (weights / weights.sum(1, keepdim=True)).reshape(-1)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_ggml_rows_do_not_depend_on_the_rest_of_the_batch(golden_model: GGUFModel, n: int) -> None:
    stack = golden_model.layers[1].experts
    k = expert_kernel(stack, KernelBackend.GGML)
    x = torch.randn(n, stack.d_model, generator=torch.Generator().manual_seed(n))
    rows, exps, ws = routed(n, stack.n_expert, 2, seed=100 + n)
    together = k.partial_sum(x, rows, exps, ws)
    for r in range(n):
        sel = rows == r
        alone = k.partial_sum(x[r : r + 1], torch.zeros(int(sel.sum()), dtype=torch.long), exps[sel], ws[sel])
        assert torch.equal(together[r : r + 1], alone), f"row {r} of {n}"


@pytest.mark.parametrize("backend", list(KernelBackend))
def test_the_order_of_the_pairs_does_not_matter(golden_model: GGUFModel, backend: KernelBackend) -> None:
    """Ascending expert index per row (DESIGN §3), not the router's rank order."""
    stack = golden_model.layers[0].experts
    k = expert_kernel(stack, backend)
    x = torch.randn(5, stack.d_model, generator=torch.Generator().manual_seed(3))
    rows, exps, ws = routed(5, stack.n_expert, 2, seed=4)
    perm = torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(5))
    assert torch.equal(k.partial_sum(x, rows, exps, ws), k.partial_sum(x, rows[perm], exps[perm], ws[perm]))


def test_rows_without_pairs_are_zero(golden_model: GGUFModel) -> None:
    stack = golden_model.layers[0].experts
    for backend in KernelBackend:
        out = expert_kernel(stack, backend).partial_sum(
            torch.randn(3, stack.d_model), torch.tensor([1]), torch.tensor([2]), torch.tensor([1.0]))
        assert out.shape == (3, stack.d_model) and not out[0].any() and not out[2].any() and out[1].any()


def test_the_backends_agree_on_f32_weights(golden_model: GGUFModel) -> None:
    """F32 weights: ggml multiplies in float32 too, so the two differ only by summation order inside
    the dot products."""
    for layer in golden_model.layers:
        stack = layer.experts
        x = torch.randn(16, stack.d_model, generator=torch.Generator().manual_seed(7))
        rows, exps, ws = routed(16, stack.n_expert, 2, seed=8)
        a = expert_kernel(stack, KernelBackend.GGML).partial_sum(x, rows, exps, ws)
        b = expert_kernel(stack, KernelBackend.TORCH).partial_sum(x, rows, exps, ws)
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_sub_ranges_share_pooled_kernels_without_mixing_weights(golden_model: GGUFModel) -> None:
    """Pooled ggml kernels are rebound per call: a range computed after another range of the same
    shape uses its own weights (expert lo+i of the layer, never a previous range's)."""
    x = torch.randn(4, golden_model.config.d_model, generator=torch.Generator().manual_seed(9))
    rows = torch.arange(4)
    for lo in (0, 2, 4, 6):
        sub = golden_model.expert_stack(0, lo, lo + 2)
        got = expert_kernel(sub, KernelBackend.GGML).partial_sum(x, rows, torch.tensor([0, 1, 0, 1]), torch.ones(4))
        full = expert_kernel(golden_model.layers[0].experts, KernelBackend.GGML).partial_sum(
            x, rows, torch.tensor([lo, lo + 1, lo, lo + 1]), torch.ones(4))
        assert torch.equal(got, full)


def test_kernel_ids_name_backend_version_and_build() -> None:
    gid, tid = kernel_id(KernelBackend.GGML), kernel_id(KernelBackend.TORCH)
    assert gid.startswith("ggml-0.15.3-") and "avx2" in gid and "fma" in gid
    assert tid.startswith("torch-") and gid != tid
    assert kernel_id(KernelBackend.GGML) == gid  # stable within a process


def test_big_calls_on_more_threads_give_the_same_bits(golden_model: GGUFModel) -> None:
    """The coordinator lets big calls use every compute thread: the bits do not change."""
    from swarm.model.kernels import BIG_WORK, compute_threads, set_compute_threads
    from swarm.model.kernels.dense import Linear

    stack = golden_model.layers[0].experts
    n = 64
    x = torch.randn(n, stack.d_model, generator=torch.Generator().manual_seed(12))
    rows, exps, ws = routed(n, stack.n_expert, 2, seed=13)
    lin = Linear(golden_model.tensor("blk.0.attn_q.weight"), KernelBackend.GGML)
    one = expert_kernel(stack).partial_sum(x, rows, exps, ws), lin(x)
    import swarm.model.kernels as kernels

    big_work = kernels.BIG_WORK
    try:
        set_compute_threads(2)
        kernels.BIG_WORK = 1  # the golden model is tiny: make every call "big"
        assert compute_threads(1) == 2 and compute_threads(0) == 1 and big_work == BIG_WORK
        two = expert_kernel(stack).partial_sum(x, rows, exps, ws), lin(x)
    finally:
        set_compute_threads(1)
        kernels.BIG_WORK = big_work
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
