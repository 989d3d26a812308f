"""A slot's KV cache is reused by the next request: the ggml attention reads a padded view of the
cache, so the rows a previous, longer sequence left behind must not change the next one's numbers --
not even non-finite leftovers."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from tests.conftest import FIXTURES


@pytest.mark.parametrize("kernel", [KernelBackend.GGML, KernelBackend.TORCH])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_reused_cache_gives_a_fresh_caches_bits(kernel: KernelBackend, dtype: torch.dtype) -> None:
    tr = Transformer(GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf", kernel=kernel))
    short = [5, 9, 33, 70, 2]
    fresh = KVCache(tr.cfg, 256, dtype)
    want = [tr.forward([SeqChunk(fresh, short, 0, all_logits=True)])[0]]
    want.append(tr.forward([SeqChunk(fresh, [11], len(short))])[0])

    reused = KVCache(tr.cfg, 256, dtype)
    tr.forward([SeqChunk(reused, list(range(40, 140)), 0)])  # a longer sequence first
    reused.k[:, 50:100] = float("inf")  # and even non-finite numbers behind it
    reused.v[..., 50:100] = float("nan")
    got = [tr.forward([SeqChunk(reused, short, 0, all_logits=True)])[0]]
    got.append(tr.forward([SeqChunk(reused, [11], len(short))])[0])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
