"""Experts recomputed from the GGUF on disk (``coordinator.dispatch.disk``): the bits of the model's own
kernel for any call, and memory bounded by the largest call however many checks run (a buffer per
capacity, read into in place), with biases (gpt-oss) too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.dispatch.disk import DiskExperts, capacity
from coordinator.dispatch.layer import LocalJob
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import expert_kernel
from tests.conftest import FIXTURES


def test_capacities_are_powers_of_two() -> None:
    assert [capacity(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 64]


@pytest.mark.parametrize("name", ["qwen3moe-tiny-q8_0", "gpt-oss-tiny-f32", "gpt-oss-tiny-mxfp4_moe"])
def test_any_call_has_the_bits_of_the_model_and_the_buffers_stay_few(name: str) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    cfg = model.config
    disk = DiskExperts(model)
    rng = np.random.default_rng(7)
    for _ in range(60):
        layer = int(rng.integers(0, cfg.n_moe_layer))
        lo = int(rng.integers(0, cfg.n_expert - 1))
        hi = int(rng.integers(lo + 1, cfg.n_expert + 1))
        n_rows = int(rng.integers(1, 6))
        per_row = int(rng.integers(1, min(4, hi - lo) + 1))
        rows = np.repeat(np.arange(n_rows), per_row)
        exps = np.concatenate([np.sort(rng.choice(hi - lo, per_row, replace=False)) for _ in range(n_rows)])
        w = rng.uniform(0.1, 1.0, rows.size).astype(np.float32)
        x = rng.standard_normal((n_rows, cfg.d_model)).astype(np.float32)
        job = LocalJob(layer, lo, hi, x, rows, exps.astype(np.int64), w)
        want = expert_kernel(model.expert_stack(layer, lo, hi)).pair_outputs_np(x, rows, exps, w)
        got = disk.pair_outputs(job)
        assert np.array_equal(got, want)
    # one buffer per (tensor, capacity): never more capacities than powers of two up to the layer's size
    caps = {key[-1] for key in disk._bufs}
    assert caps <= {capacity(n) for n in range(1, cfg.n_expert + 1)} and len(disk._bufs) == 3 * len(caps)
    assert disk.bytes_read > 0


def test_reading_scattered_spans_drops_the_page_cache_a_few_times_not_per_span(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    """``POSIX_FADV_DONTNEED`` drains every CPU's page lists: one per range read, not per span or piece."""
    import swarm.model.gguf as gguf_mod

    data = np.random.default_rng(1).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes()
    f = tmp_path / "blob"
    f.write_bytes(data)
    drops: list[tuple[int, int]] = []
    monkeypatch.setattr(gguf_mod, "drop_pages", lambda fd, off, n: drops.append((off, n)))
    near = [(k * (1 << 20) + 100, 300_000) for k in range(0, 16, 2)]  # 8 spans within 16 MB: one range
    far = [(22 << 20, 1 << 20)]
    got = b"".join(gguf_mod.pread_chunks(f, [*near, *far], piece=1 << 18))
    assert got == b"".join(data[o : o + n] for o, n in [*near, *far])
    assert len(drops) == 1  # the spans closer than the readahead slack are one range, the far one joins it too
    lo, n = drops[0]
    assert lo == near[0][0] and lo + n >= far[0][0] + far[0][1]
    drops.clear()
    list(gguf_mod.pread_chunks(f, [(0, 24 << 20)], piece=1 << 20, drop_every=4 << 20))  # a long read
    assert 5 <= len(drops) <= 7 and drops[-1] == (0, (24 << 20) + gguf_mod._READAHEAD_SLACK)
