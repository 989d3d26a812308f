"""A backbone coordinator never reads expert bytes through its memory map (issue 12 item 1): cutting
and hashing every slice of a model, and checking hold challenges, use ``pread`` and drop what they
read from the page cache, so the expert pages of the mapped GGUF stay out of memory (``mincore``)."""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

from swarm.model.gguf import GGUFModel, drop_pages
from swarm.model.slices import SliceCache, build_manifest, hold_digest, hold_digest_from_file, load_slice
from tests.conftest import GOLDEN_GGUF

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def resident_share(arr: np.ndarray) -> float:  # type: ignore[type-arg]
    """Share of the pages under ``arr`` that are in memory (mincore over its mapping)."""
    page = mmap.PAGESIZE
    start = arr.ctypes.data - arr.ctypes.data % page
    length = arr.ctypes.data + arr.nbytes - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / len(vec)


def test_cutting_hashing_and_challenging_slices_leave_expert_pages_out_of_memory(tmp_path: Path) -> None:
    path = tmp_path / GOLDEN_GGUF.name  # a private copy: no other mapping of this file has touched its pages
    shutil.copyfile(GOLDEN_GGUF, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    drop_pages(fd, 0, 0)
    os.close(fd)
    model = GGUFModel(path)  # hashes the whole file: dropped from the cache as it goes
    experts = [t.raw for n, t in model.tensors.items() if "_exps" in n]
    assert max(resident_share(a) for a in experts) < 0.05
    cfg = model.config
    cache = SliceCache(model, tmp_path / "slices")
    files = [cache.get(layer, lo, lo + 4) for layer in range(cfg.n_layer) for lo in range(0, cfg.n_expert, 4)]
    for layer in range(cfg.n_layer):  # what the dispatcher computes for every hold challenge
        stack = model.expert_stack(layer, 0, 4)
        spans = tuple(model.file_span(t.raw) for t in (stack.gate_t, stack.up_t, stack.down_t))
        nonce = secrets.token_bytes(16)
        windows = [(0, 4096), (stack.nbytes - 100, 100)]
        got = hold_digest_from_file(model.path, spans, nonce, windows)
        served = b"".join(files[layer * 2].read(0, files[layer * 2].size))  # what a download of it sends
        assert got == hold_digest(load_slice(served).experts, nonce, windows)  # the volunteer's answer
    for f in files:  # serve every slice once more, in small pieces (the HTTP shell's reads)
        assert sum(len(b) for b in f.read(0, f.size, piece=4096)) == f.size
    shares = [resident_share(a) for a in experts]
    assert max(shares) < 0.05, shares
    # the mapping itself is intact: touching it now brings the pages in (the measure can see them)
    int(experts[0].sum())
    assert resident_share(experts[0]) > 0.9


def test_hashing_every_expert_for_the_manifest_leaves_expert_pages_out_of_memory(tmp_path: Path) -> None:
    path = tmp_path / GOLDEN_GGUF.name
    shutil.copyfile(GOLDEN_GGUF, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    drop_pages(fd, 0, 0)
    os.close(fd)
    model = GGUFModel(path)
    experts = [t.raw for n, t in model.tensors.items() if "_exps" in n]
    manifest = build_manifest(model, cache_dir=tmp_path / "manifests")  # reads every expert once
    assert len(manifest.expert_sha256) == model.config.n_layer
    shares = [resident_share(a) for a in experts]
    assert max(shares) < 0.05, shares
    int(experts[0].sum())  # the measure sees pages once they are touched
    assert resident_share(experts[0]) > 0.9
