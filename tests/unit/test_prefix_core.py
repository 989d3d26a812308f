"""The pure prefix index and the scheduler's KV ops: longest match, exact boundaries, LRU by bytes,
superseded prefixes, and the order of the copies around a slot's reuse (no event loop, no torch)."""

from __future__ import annotations

import random

import pytest

from coordinator.core.prefixes import Drop, Hit, Keep, PrefixIndex, Spill, Unlink, prefix_hashes
from coordinator.core.scheduler import (
    Finish,
    FinishReason,
    FreeRows,
    GenParams,
    GenRequest,
    LoadRows,
    SaveRows,
    Scheduler,
    SpillRows,
)

SALT = b"test-model"


def idx(capacity_rows: int = 1000, min_tokens: int = 4) -> PrefixIndex:
    return PrefixIndex(capacity=capacity_rows * 10, row_bytes=10, salt=SALT, min_tokens=min_tokens)


def test_chain_hashes_name_prefixes() -> None:
    a = prefix_hashes([1, 2, 3, 4], SALT)
    b = prefix_hashes([1, 2, 9, 4], SALT)
    assert len(a) == 5 and len(set(a)) == 5
    assert a[:3] == b[:3] and a[3] != b[3] and a[4] != b[4]  # equal exactly as long as the tokens are
    assert prefix_hashes([1, 2, 3, 4], b"other-model")[1:] != a[1:]  # another model's never meet
    assert prefix_hashes([1, 2, 3, 4], SALT, limit=2) == a[:3]
    assert prefix_hashes([256], SALT) != prefix_hashes([1, 0], SALT)[:2]  # tokens are whole 4-byte words


@pytest.mark.parametrize("diverge", [4, 5, 9, 15])
def test_lookup_finds_exactly_the_common_prefix(diverge: int) -> None:
    px = idx()
    seq = list(range(100, 120))
    assert px.offer(seq) == [Keep(1, 20)]
    prompt = [*seq[:diverge], 7, 8, 9]
    assert px.lookup(prompt) == Hit(1, diverge)
    ram = px.stats.tiers["ram"]
    assert ram.hits == 1 and ram.hit_tokens == diverge and ram.hit_bytes == diverge * 10


def test_lookup_leaves_one_token_and_respects_min_tokens() -> None:
    px = idx(min_tokens=4)
    px.offer(list(range(10)))
    assert px.lookup(list(range(10))) == Hit(1, 9)  # the whole sequence: all but the last token
    assert px.lookup(list(range(20))) == Hit(1, 10)
    assert px.lookup([0, 1, 2, 99, 98]) is None  # 3 common tokens < min_tokens
    assert px.lookup([5, 6, 7, 8, 9]) is None  # the same tokens elsewhere are not a prefix
    assert px.stats.misses == 2


def test_offer_dedups_and_supersedes_prefixes() -> None:
    px = idx()
    assert px.offer([1, 2, 3, 4, 5, 6]) == [Keep(1, 6)]
    assert px.offer([1, 2, 3, 4]) == []  # held already (a prefix of entry 1)
    assert px.offer([1, 2, 3, 4, 5, 6]) == []
    # a longer sequence holds entry 1's rows too: entry 1 goes
    assert px.offer([1, 2, 3, 4, 5, 6, 7, 8]) == [Drop(1), Keep(2, 8)]
    # a diverging one is a new entry beside it
    assert px.offer([1, 2, 3, 4, 5, 9]) == [Keep(3, 6)]
    assert len(px) == 2 and px.used == (8 + 6) * 10
    assert px.lookup([1, 2, 3, 4, 5, 9, 9]) == Hit(3, 6)
    assert px.lookup([1, 2, 3, 4, 5, 6, 7, 0]) == Hit(2, 7)


def test_lru_eviction_by_bytes() -> None:
    px = idx(capacity_rows=30)
    assert px.offer([1] * 10) == [Keep(1, 10)]
    assert px.offer([2] * 10) == [Keep(2, 10)]
    assert px.offer([3] * 10) == [Keep(3, 10)]
    assert px.lookup([1] * 11) == Hit(1, 10)  # entry 1 is now the most recently used
    assert px.offer([4] * 15) == [Drop(2), Drop(3), Keep(4, 15)]
    assert px.used == 25 * 10 <= px.capacity
    assert px.offer([5] * 31) == []  # bigger than the whole budget: not kept, nothing evicted
    assert px.offer([6] * 3) == []  # shorter than min_tokens
    assert len(px) == 2 and px.stats.tiers["ram"].dropped == 2


def test_random_offers_never_exceed_capacity_and_hits_are_exact(rng: random.Random) -> None:
    px = idx(capacity_rows=200)
    held: dict[int, tuple[int, ...]] = {}
    for _ in range(300):
        base = rng.choice([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7]])
        seq = base + [rng.randrange(4) for _ in range(rng.randrange(0, 60))]
        if rng.random() < 0.5:
            for eff in px.offer(seq):
                if isinstance(eff, Keep):
                    held[eff.entry] = tuple(seq[: eff.n_tokens])
                else:
                    del held[eff.entry]
        else:
            hit = px.lookup(seq)
            best = max((_common(h, seq) for h in held.values()), default=0)
            best = min(best, len(seq) - 1)
            if hit is None:
                assert best < 4
            else:
                assert hit.n_tokens == best and held[hit.entry][: hit.n_tokens] == tuple(seq[: hit.n_tokens])
        assert px.used == sum(len(t) for t in held.values()) * 10 <= px.capacity


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _sched(px: PrefixIndex | None, n_slots: int = 1) -> Scheduler:
    return Scheduler(n_slots=n_slots, n_ctx=64, n_batch=64, max_queue=4, eot_ids=frozenset({99}), prefixes=px)


def _run_to_end(s: Scheduler, req_id: int, sampled: list[int]) -> list[Finish]:
    """Feed every step of ``req_id`` and sample ``sampled`` in turn; the Finish effects."""
    out: list[Finish] = []
    toks = iter(sampled)
    while s.slot_of(req_id) is not None:
        for e in s.plan():
            s.fed(e, 0.0)
            if e.sample and e.req_id == req_id:
                out += [x for x in s.token(e.slot, req_id, next(toks), "x", 0.0) if isinstance(x, Finish)]
    return out


def test_scheduler_saves_before_it_loads_and_starts_after_the_prefix() -> None:
    px = idx()
    s = _sched(px)
    prompt = tuple(range(10, 30))
    s.submit(GenRequest(1, prompt, GenParams(max_tokens=3, ignore_eos=True)), 0.0)
    fin = _run_to_end(s, 1, [40, 41, 42])
    assert fin == [Finish(1, FinishReason.LENGTH, 20, 3, 0)]
    assert s.take_kv_ops() == [SaveRows(0, 1, 22)]  # kept as it ended (the last sampled token was never fed)
    # the next request shares 20 prompt tokens + 2 generated ones; looked up when the step is planned
    s.submit(GenRequest(2, (*prompt, 40, 41, 42, 50), GenParams(max_tokens=1)), 0.0)
    assert s.take_kv_ops() == []
    plan = s.plan()
    assert s.take_kv_ops() == [LoadRows(0, 1, 22)]
    assert [(e.tokens, e.pos, e.sample) for e in plan] == [((42, 50), 22, True)]
    for e in plan:
        s.fed(e, 0.0)
    assert [x for x in s.token(0, 2, 7, "y", 0.0) if isinstance(x, Finish)] == [Finish(2, FinishReason.LENGTH, 24, 1, 22)]
    assert s.take_kv_ops() == [FreeRows(1), SaveRows(0, 2, 24)]  # entry 1 is a prefix of the new one


def test_cancelled_and_broken_requests() -> None:
    px = idx()
    s = _sched(px, n_slots=2)
    s.submit(GenRequest(1, tuple(range(30)), GenParams()), 0.0)
    s.submit(GenRequest(2, tuple(range(100, 130)), GenParams()), 0.0)
    for e in s.plan():
        s.fed(e, 0.0)
    s.cancel(1, 0.0)  # the client went away: its fed rows are still good
    s.cancel(2, 0.0, keep=False)  # its numbers broke: never kept
    s.plan()
    assert s.take_kv_ops() == [SaveRows(0, 1, 30)]
    # without an index nothing is kept and nothing is looked up
    s2 = _sched(None)
    s2.submit(GenRequest(1, tuple(range(30)), GenParams()), 0.0)
    assert [e.pos for e in s2.plan()] == [0] and s2.take_kv_ops() == []


def test_disk_tier_spills_unlinks_and_finds() -> None:
    px = PrefixIndex(capacity=200, row_bytes=10, salt=SALT, disk_capacity=250)
    assert px.offer([1] * 10) == [Keep(1, 10)]
    assert px.offer([2] * 10) == [Keep(2, 10)]
    # RAM is full: its least recently used entry goes to disk
    assert px.offer([3] * 10) == [Spill(1), Keep(3, 10)]
    assert (px.used, px.disk_used, px.tier_of(1)) == (200, 100, "disk")
    assert px.lookup([1] * 12) == Hit(1, 10, "disk")
    assert px.stats.tiers["disk"].hits == 1 and px.stats.tiers["disk"].hit_tokens == 10
    # the disk budget evicts its own least recently used entries for a newcomer
    assert px.offer([4] * 10) == [Spill(2), Keep(4, 10)]
    assert px.offer([5] * 10) == [Unlink(1), Spill(3), Keep(5, 10)]
    assert px.disk_used == 200 <= px.disk_capacity and px.count("disk") == 2
    # a sequence held only on disk comes back to RAM (its disk copy superseded), displacing both RAM entries
    assert px.offer([2] * 12) == [Unlink(2), Spill(4), Unlink(3), Spill(5), Keep(6, 12)]
    assert px.lookup([2] * 20) == Hit(6, 12, "ram")
    assert px.advertised() == [prefix_hashes([2] * 12, SALT)[-1], prefix_hashes([5] * 10, SALT)[-1],
                               prefix_hashes([4] * 10, SALT)[-1]]
    # the same rows in both tiers: RAM's are used
    assert px.offer([5] * 8 + [9, 9]) == [Unlink(4), Spill(6), Keep(7, 10)]
    assert px.lookup([5] * 8 + [0]) == Hit(7, 8, "ram")
    assert px.lookup([5] * 12) == Hit(5, 10, "disk")
    px.forget(6)
    assert px.tier_of(6) is None and px.stats.failed == 1 and px.lookup([2] * 13) is None


def test_adopt_fills_the_disk_tier_oldest_first() -> None:
    px = PrefixIndex(capacity=200, row_bytes=10, salt=SALT, disk_capacity=250)
    assert px.adopt([1] * 10) == (1, [])
    assert px.adopt([1] * 10) == (None, [])  # the same sequence twice
    assert px.adopt([2] * 10) == (2, [])
    assert px.adopt([3] * 10) == (3, [Unlink(1)])
    assert px.adopt([4] * 30) == (None, [])  # bigger than the disk budget
    assert PrefixIndex(capacity=200, row_bytes=10, salt=SALT).adopt([1] * 10) == (None, [])  # no disk tier
    assert px.lookup([2] * 11) == Hit(2, 10, "disk")


def test_scheduler_spill_and_failed_load() -> None:
    px = PrefixIndex(capacity=300, row_bytes=10, salt=SALT, disk_capacity=1000)
    s = _sched(px)
    a, b = tuple(range(10, 30)), tuple(range(40, 60))
    for rid, prompt in ((1, a), (2, b)):
        s.submit(GenRequest(rid, prompt, GenParams(max_tokens=1)), 0.0)
        _run_to_end(s, rid, [7])
    s.submit(GenRequest(3, (*a, 1, 2), GenParams(max_tokens=1)), 0.0)
    s.plan()
    assert s.take_kv_ops() == [SaveRows(0, 1, 20), SpillRows(1, a), SaveRows(0, 2, 20), LoadRows(0, 1, 20)]
    s.load_failed(0, 1)  # its file failed its checks: the whole prompt is prefilled
    assert [(e.pos, len(e.tokens)) for e in s.plan()] == [(0, 22)] and s.take_kv_ops() == []
    assert px.tier_of(1) is None and px.stats.failed == 1 and px.stats.tiers["disk"].hits == 0 and px.stats.misses == 3
    fin = _run_to_end(s, 3, [7])
    assert fin == [Finish(3, FinishReason.LENGTH, 22, 1, 0)]
    s.plan()
    assert s.take_kv_ops() == [SpillRows(2, b), SaveRows(0, 3, 22)]


def test_pinned_entries_are_never_evicted_or_superseded() -> None:
    px = idx(capacity_rows=30)
    px.offer([1] * 10)
    px.offer([2] * 10)
    assert px.pin_holder([1] * 6) == 1  # an entry holding these tokens
    assert px.pin_holder([9] * 6) is None
    assert px.lookup([2] * 11) == Hit(2, 10)  # entry 1 is the least recently used now
    assert px.offer([3] * 10) == [Keep(3, 10)]
    assert px.offer([4] * 10) == [Drop(2), Keep(4, 10)]  # 1 stays: pinned
    assert px.offer([1] * 12) == [Drop(3), Drop(4), Keep(5, 12)]  # 1 is a prefix of it, and pinned: kept
    assert px.pinned_bytes == 100 and px.offer([7] * 25) == []  # does not fit beside the pinned bytes
    px.unpin(1)
    assert px.offer([8] * 25) == [Drop(1), Drop(5), Keep(6, 25)]
