"""Greedy sampling (``coordinator.engine.sampling``): the argmax, the lowest id on ties, whatever the
tensor's type or layout; a seeded draw repeats."""

from __future__ import annotations

import torch

from coordinator.engine.sampling import make_generator, sample


def test_greedy_is_the_first_maximum() -> None:
    g = make_generator(0)
    x = torch.tensor([1.0, 3.0, -2.0, 3.0, 2.0])
    assert sample(x, temperature=0.0, top_p=1.0, generator=g) == 1
    assert sample(x.to(torch.float64), temperature=0.0, top_p=1.0, generator=g) == 1
    assert sample(x.to(torch.bfloat16), temperature=0.0, top_p=1.0, generator=g) == 1
    big = torch.zeros(4, 8192)[1]  # a row view of a bigger tensor, every value tied
    big[5000] = 1.0
    big[6000] = 1.0
    assert sample(big, temperature=0.0, top_p=1.0, generator=g) == 5000


def test_a_seeded_draw_repeats() -> None:
    x = torch.linspace(-1, 1, 50)
    a = [sample(x, temperature=0.8, top_p=0.9, generator=make_generator(7)) for _ in range(3)]
    assert len(set(a)) == 1


def test_a_numpy_row_samples_as_its_torch_row() -> None:
    """The engine passes numpy rows (``Transformer.forward_np``): the same tokens as the torch row, greedy
    (first maximum) and seeded, with and without nucleus."""
    x = torch.tensor([1.0, 3.0, -2.0, 3.0, 2.0])
    assert sample(x.numpy(), temperature=0.0, top_p=1.0, generator=make_generator(0)) == 1
    y = torch.linspace(-2, 2, 300)
    for top_p in (1.0, 0.7):
        for seed in range(20):
            a = sample(y, temperature=0.9, top_p=top_p, generator=make_generator(seed))
            b = sample(y.numpy(), temperature=0.9, top_p=top_p, generator=make_generator(seed))
            assert a == b, (top_p, seed)
