"""A step's layers as one ggml graph (``coordinator.engine.stack``): the bits of the per-layer graphs
on every architecture it covers, f32 and f16 caches, 1-16 sequences at staggered positions, across the
KV padding boundaries (the graph's ``n_kv`` rebound, not rebuilt) and with caches changing places
between steps; prefill chunks (bucketed, beyond the attention's row blocks, chunked at later positions);
one graph per step, built once per shape (a prefill: per bucket) and reused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.engine.model import KV_PAD, KVCache, LocalExperts, SeqChunk, Transformer
from swarm.errors import KernelError
from swarm.model.gguf import GGUFModel
from swarm.model.kernels.ggml import graph_time
from tests.conftest import FIXTURES

STACKING = ["qwen3moe-tiny-q8_0", "qwen3moe-small-w224-q4_k_m", "olmoe-tiny-q8_0", "qwen2moe-tiny-q8_0",
            "mixtral-spm-tiny-q8_0", "deepseek2-tiny-q8_0", "qwen3moe-tiny-f32", "gpt-oss-tiny-q8_0", "gpt-oss-tiny-mxfp4_moe",
            "gpt-oss-tiny-f32", "deepseek2-groups-tiny-f32"]


def _run(tr: Transformer, n_seq: int, steps: int, dtype: torch.dtype, *, swap: bool = False) -> list[torch.Tensor]:
    """Prompts of different lengths (positions staggered around the KV padding), then ``steps`` greedy
    decode steps of every sequence together; ``swap``: the sequences' order reverses every step (each
    graph slot meets another cache)."""
    vocab = tr.cfg.n_vocab
    caches = [KVCache(tr.cfg, 96, dtype) for _ in range(n_seq)]
    prompts = [[(7 * j + 5 * i + 1) % (vocab - 3) for j in range(KV_PAD - 6 + 3 * i)] for i in range(n_seq)]
    first = tr.forward([SeqChunk(c, p, 0) for c, p in zip(caches, prompts, strict=True)])
    toks = [int(o[-1].argmax()) for o in first]
    pos = [len(p) for p in prompts]
    out: list[torch.Tensor] = [torch.cat([o[-1:] for o in first])]
    order = list(range(n_seq))
    for _ in range(steps):
        if swap:
            order.reverse()
        logits = tr.forward([SeqChunk(caches[i], [toks[i]], pos[i]) for i in order])
        by_seq = {i: lg[-1] for i, lg in zip(order, logits, strict=True)}
        toks = [int(by_seq[i].argmax()) for i in range(n_seq)]
        pos = [p + 1 for p in pos]
        out.append(torch.stack([by_seq[i] for i in range(n_seq)]))
    return out


def _per_layer(model: GGUFModel) -> Transformer:
    tr = Transformer(model, LocalExperts(model))
    assert tr._ggml is not None
    tr._ggml.stack = None  # the per-layer graphs (each layer's MoE still fused into its AttnOut graph)
    return tr


def _both(model: GGUFModel) -> tuple[Transformer, Transformer]:
    """The stacked engine (its stack graph built) and the per-layer one, on ``model``."""
    stacked = Transformer(model, LocalExperts(model))
    assert stacked._ggml is not None and stacked._ggml.stack is not None
    return stacked, _per_layer(model)


@pytest.mark.parametrize("name", STACKING)
def test_the_stacked_step_gives_the_per_layer_bits(name: str) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    stacked, plain = _both(model)
    for dtype in (torch.float32, torch.float16):
        for n_seq in (1, 3):
            a, b = _run(stacked, n_seq, 10, dtype), _run(plain, n_seq, 10, dtype)
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), (name, dtype, n_seq, i, (x - y).abs().max())


@pytest.mark.parametrize("n_seq", [2, 8, 16])
def test_many_sequences_and_moving_caches(n_seq: int) -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen2moe-tiny-q8_0.gguf")
    stacked, plain = _both(model)
    for x, y in zip(_run(stacked, n_seq, 4, torch.float16, swap=True), _run(plain, n_seq, 4, torch.float16, swap=True),
                    strict=True):
        assert torch.equal(x, y), n_seq


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-small-w224-q4_k_m.gguf")
    tr = Transformer(model, LocalExperts(model))
    vocab = tr.cfg.n_vocab
    prompts = [[(11 * j + 3 * i + 2) % (vocab - 3) for j in range(9 + i)] for i in range(16)]
    caches = [KVCache(tr.cfg, 64) for _ in prompts]
    for c, p in zip(caches, prompts, strict=True):
        tr.forward([SeqChunk(c, p, 0)])
    kept = [(c.k.clone(), c.v.clone()) for c in caches]
    alone = [tr.forward([SeqChunk(c, [5 + i], len(p))])[0] for i, (c, p) in enumerate(zip(caches, prompts, strict=True))]
    for n in (1, 2, 3, 8, 16):
        for c, (k, v) in zip(caches, kept, strict=True):
            c.k.copy_(k)
            c.v.copy_(v)
        together = tr.forward([SeqChunk(c, [5 + i], len(p)) for i, (c, p) in enumerate(zip(caches[:n], prompts[:n],
                                                                                            strict=True))])
        for i in range(n):
            assert torch.equal(together[i], alone[i]), (n, i)


def test_one_graph_per_step_built_once() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    tr = Transformer(model, LocalExperts(model))
    assert tr._ggml is not None and tr._ggml.stack is not None
    stack = tr._ggml.stack
    cache = KVCache(tr.cfg, 128)
    _, n0 = graph_time()
    tr.forward([SeqChunk(cache, list(range(1, 12)), 0)])  # 11 rows: a prefill, one graph too (12 rows, one padding)
    assert graph_time()[1] - n0 == 1 and len(stack._graphs) == 1
    stack._graphs.clear()
    tok = int(tr.forward([SeqChunk(cache, [4], 11)])[0][-1].argmax())
    built = dict(stack._graphs)
    pos = 12
    for _ in range(2 * KV_PAD):  # through two padding boundaries
        _, n0 = graph_time()
        tok = int(tr.forward([SeqChunk(cache, [tok], pos)])[0][-1].argmax())
        pos += 1
        assert graph_time()[1] - n0 == 1  # token ids to logits: one graph
    assert len(stack._graphs) == len(built) == 1 and all(stack._graphs[k] is built[k] for k in built)


@pytest.mark.parametrize("name", ["qwen3moe-tiny-q8_0", "deepseek2-tiny-q8_0"])
def test_small_chunks_of_several_rows(name: str) -> None:
    """Chunks of 2-5 rows (a short prompt, draft tokens), with and without every row's logits."""
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    outs = []
    stacked = Transformer(model, LocalExperts(model))
    for tr in (stacked, _per_layer(model)):
        caches = [KVCache(tr.cfg, 64, torch.float16) for _ in range(3)]
        got = tr.forward([SeqChunk(caches[0], [5, 6, 7], 0), SeqChunk(caches[1], [8, 9], 0, all_logits=True),
                          SeqChunk(caches[2], [1], 0)])
        got += tr.forward([SeqChunk(caches[0], [9, 10, 11, 12, 13], 3, all_logits=True), SeqChunk(caches[2], [4, 4], 1)])
        outs.append(got)
    assert stacked._ggml is not None and stacked._ggml.stack is not None and len(stacked._ggml.stack._graphs) == 2
    assert [o.shape[0] for o in outs[0]] == [1, 2, 1, 5, 1]
    for x, y in zip(*outs, strict=True):
        assert torch.equal(x, y)


def test_a_token_out_of_range_is_refused() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    tr = Transformer(model, LocalExperts(model))
    with pytest.raises(KernelError, match="out of range"):
        tr.forward([SeqChunk(KVCache(tr.cfg, 16), [tr.cfg.n_vocab], 0)])


class SomeRemote(LocalExperts):
    """Expert layer 1 (and 3) may go elsewhere: the engine takes the layer path there (here computed locally)."""

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        return layer not in (1, 3)


@pytest.mark.parametrize("name", ["qwen3moe-tiny-q8_0", "deepseek2-tiny-q8_0", "qwen2moe-tiny-q8_0"])
def test_segments_between_remote_layers(name: str) -> None:
    """Each run of local layers between the remote ones is one graph; the bits of the per-layer path."""
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    seg = Transformer(model, SomeRemote(model))
    plain = Transformer(model, SomeRemote(model))
    assert seg._ggml is not None and seg._ggml.stack is not None and plain._ggml is not None
    plain._ggml.stack = None
    for dtype in (torch.float32, torch.float16):
        for x, y in zip(_run(seg, 3, 6, dtype, swap=True), _run(plain, 3, 6, dtype, swap=True), strict=True):
            assert torch.equal(x, y), (name, dtype)
    moe = list(model.config.moe_layers)
    remote = {moe[1], moe[3]} if len(moe) > 3 else {moe[1]}
    spans = {k[0] for k in seg._ggml.stack._graphs}
    want = set()
    lo = 0
    for li in sorted(remote) + [model.config.n_layer]:
        if li > lo:
            want.add((lo, li))
        lo = li + 1
    assert spans == want, (spans, want)


def _prefill(tr: Transformer, plan: list[list[tuple[int, int, bool]]], n_ctx: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Steps of prefill chunks: per step, per sequence ``(sequence, rows, every row's logits)``; each
    sequence continues where its last chunk ended."""
    vocab = tr.cfg.n_vocab
    n_seq = 1 + max(i for step in plan for i, _, _ in step)
    caches = [KVCache(tr.cfg, n_ctx, dtype) for _ in range(n_seq)]
    pos = [0] * n_seq
    out: list[torch.Tensor] = []
    for step in plan:
        chunks = []
        for i, n, every in step:
            chunks.append(SeqChunk(caches[i], [(13 * (pos[i] + j) + 7 * i + 3) % (vocab - 3) for j in range(n)], pos[i],
                                   all_logits=every))
            pos[i] += n
        out += tr.forward(chunks)
    return out


PREFILL_PLAN = [
    [(0, 40, False)],  # one prompt (bucket 48: 8 padding rows)
    [(0, 45, True), (1, 9, False), (2, 1, False)],  # the same bucket at a later position: the graph reused
    [(1, 300, False), (0, 3, True)],  # beyond the attention's 256-row blocks: two blocks (256 + 48)
    [(2, 130, True), (1, 17, False), (0, 1, False)],
]


@pytest.mark.parametrize("name", STACKING)
def test_prefill_chunks_give_the_per_layer_bits(name: str) -> None:
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    stacked, plain = _both(model)
    for dtype in (torch.float32, torch.float16):
        _, n0 = graph_time()
        a = _prefill(stacked, PREFILL_PLAN, 400, dtype)
        assert graph_time()[1] - n0 == len(PREFILL_PLAN)  # one graph a step
        b = _prefill(plain, PREFILL_PLAN, 400, dtype)
        assert [x.shape[0] for x in a] == [1, 45, 1, 1, 1, 3, 130, 1, 1]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), (name, dtype, i, (x - y).abs().max())


def test_a_prefill_bucket_is_built_once() -> None:
    """Chunks of 33-48 rows share one graph (bucket 48): only the cache writes' row count and the data
    change."""
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    stacked, plain = _both(model)
    plan = [[(0, n, False)] for n in (33, 48, 40, 47, 34)]
    a = _prefill(stacked, plan, 256, torch.float16)
    assert stacked._ggml is not None and stacked._ggml.stack is not None
    assert len(stacked._ggml.stack._graphs) == 1
    for x, y in zip(a, _prefill(plain, plan, 256, torch.float16), strict=True):
        assert torch.equal(x, y)


def test_a_step_beyond_the_stack_takes_the_layer_path() -> None:
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    tr = Transformer(model, LocalExperts(model))
    assert tr._ggml is not None and tr._ggml.stack is not None
    stack = tr._ggml.stack
    assert stack.fits([512, 1]) and not stack.fits([1000, 100]) and not stack.fits([0])
    _, n0 = graph_time()
    tr.forward([SeqChunk(KVCache(tr.cfg, 1200), [j % 300 for j in range(1100)], 0)])
    assert graph_time()[1] - n0 > 1 and not stack._graphs


class _Heard(LocalExperts):
    """Local experts that keep what the engine tells the dispatcher: each MoE layer's rows' experts."""

    def __init__(self, model: GGUFModel) -> None:
        super().__init__(model)
        self.heard: list[tuple[int, list[list[int]]]] = []

    def ran_here(self, layer: int, ids: Any, seconds: float) -> None:
        self.heard.append((layer, [sorted(int(e) for e in row) for row in ids]))
        super().ran_here(layer, ids, seconds)

    def begin(self, layer: int, x: Any, ids: Any, w: Any, **kw: Any) -> Any:  # the per-layer path's unfused layers
        self.heard.append((layer, [sorted(int(e) for e in row) for row in ids]))
        return super().begin(layer, x, ids, w, **kw)


@pytest.mark.parametrize("name", ["qwen3moe-tiny-q8_0", "deepseek2-tiny-q8_0", "gpt-oss-tiny-q8_0"])
def test_the_last_layer_computes_the_asked_rows_and_reports_every_rows_experts(name: str) -> None:
    """As llama.cpp, the last layer's FFN runs on the rows whose logits are asked for only; the dispatcher
    still hears every row's experts in every layer -- the per-layer path's reports, row for row."""
    model = GGUFModel(FIXTURES / "golden" / f"{name}.gguf")
    got = []
    for stack in (True, False):
        ex = _Heard(model)
        tr = Transformer(model, ex)
        assert tr._ggml is not None and tr._ggml.stack is not None
        if not stack:
            tr._ggml.stack = None
        got.append((_prefill(tr, PREFILL_PLAN, 400, torch.float16), ex.heard))
    (a, heard_a), (b, heard_b) = got
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    last = max(layer for layer, _ in heard_b)
    assert any(layer == last for layer, _ in heard_a)
    for layer in sorted({layer for layer, _ in heard_b}):  # per layer, every real row's experts, in order
        rows_a = [r for lay, rows in heard_a if lay == layer for r in rows]
        rows_b = [r for lay, rows in heard_b if lay == layer for r in rows]
        assert rows_a == rows_b, (name, layer)


def test_only_the_last_layer_narrows_to_the_asked_rows() -> None:
    """The built graph of a 40-row prompt that asks for its last row's logits: every layer's experts run
    on the bucket's 48 rows but the last layer's (gate, up, down) on that one row."""
    import ggml.ggml as g

    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    tr, _ = _both(model)
    _prefill(tr, [[(0, 40, False)]], 256, torch.float16)
    assert tr._ggml is not None and tr._ggml.stack is not None
    [built] = tr._ggml.stack._graphs.values()
    graph = built.plan.graph
    rows = [int(node.contents.ne[2]) for node in (g.ggml_graph_node(graph, i) for i in range(g.ggml_graph_n_nodes(graph)))
            if node.contents.op == g.GGML_OP_MUL_MAT_ID]
    n_moe = sum(1 for s in tr._ggml.stack.layers if s.moe is not None)
    assert rows == [48] * 3 * (n_moe - 1) + [1] * 3, rows


def test_asked_rows_whose_bucket_exceeds_the_graph_rows() -> None:
    """Drafted sequences (every row's logits) beside a prompt chunk: 10 rows asked for, bucketed to 12, in a
    graph of 11 rows -- the last layer cannot narrow to them (a view past its input: ggml aborted the
    coordinator in `make demo`); the head takes them after it, with the per-layer path's bits."""
    model = GGUFModel(FIXTURES / "golden" / "qwen3moe-tiny-q8_0.gguf")
    stacked, plain = _both(model)
    plan = [[(0, 5, True), (1, 4, True), (2, 2, False)], [(0, 1, False), (1, 3, True), (2, 7, False)]]
    a = _prefill(stacked, plan, 256, torch.float16)
    assert [x.shape[0] for x in a] == [5, 4, 1, 1, 3, 1]
    for x, y in zip(a, _prefill(plain, plan, 256, torch.float16), strict=True):
        assert torch.equal(x, y)
