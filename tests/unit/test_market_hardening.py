"""What a hostile stranger or a careless operator could still do to the market (issue 31), at the
state level (``market.state.Market`` over an in-memory store, no event loop):

- a store that refuses a batch leaves memory as the store has it (item 8);
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from market.core.records import HeldState, ModelManifest, SliceRef
from market.policy import MarketPolicy
from market.state import Market, Offer
from market.store import Change, InMemoryStore, MemoryBacking
from swarm.errors import StoreError
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageHeartbeat,
    HeldSlice,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)

MID = "hard-0123456789ab"
URL = "http://c1.test"
SERVING, LOADING = HeldState.SERVING, HeldState.LOADING
POLICY = MarketPolicy(heartbeat_ttl_s=6.0, cooldown_s=5.0, lease_s=10.0, hold_s=10.0, poll_stale_s=5.0,
                      header_allowance=0, proof_grace_s=0.0)


class FlakyStore(InMemoryStore):
    """An in-memory store whose next ``apply`` fails while ``fail`` is set (a full disk, say)."""

    def __init__(self, backing: MemoryBacking | None = None) -> None:
        super().__init__(backing)
        self.fail = False

    def apply(self, changes: Sequence[Change]) -> None:
        if self.fail and changes:
            raise StoreError("database or disk is full", code="store_error")
        super().apply(changes)


def manifest(model_id: str = MID, n_layer: int = 2, n_expert: int = 8, bpe: int = 1000) -> ModelManifest:
    return ModelManifest(model_id=model_id, arch="qwen3moe", n_layer=n_layer, n_expert=n_expert, d_model=16,
                         d_expert=8, bytes_per_expert=[bpe] * n_layer)


def market(policy: MarketPolicy = POLICY, store: InMemoryStore | None = None) -> Market:
    return Market(store if store is not None else InMemoryStore(), policy, now=0.0, rng=random.Random(0))


def hb(peer: str, seq: int, *slices: tuple[int, int, int, HeldState], epoch: int = 1) -> CoverageHeartbeat:
    return CoverageHeartbeat(peer, epoch, seq, [f"/ip4/10.0.0.1/tcp/1/p2p/{peer}"],
                             [HeldSlice(MID, la, lo, hi, st) for la, lo, hi, st in slices], protocols=[2])


def leased(m: Market, peer: str, now: float, *, address: str = "", max_experts: int = 4) -> SliceRef:
    got = m.volunteer(VolunteerRequest(peer, max_experts=max_experts), now, address=address)
    assert isinstance(got, Offer), got
    return got.lease.slice


def durable(m: Market) -> dict[str, Any]:
    """Everything the store holds, as memory has it (runtime facts left out)."""
    ix = m.ix
    return {
        "models": sorted(ix.models), "coordinators": dict(ix.coordinators),
        "volunteers": {p: (v.row.addrs, v.row.max_bytes) for p, v in ix.volunteers.items() if getattr(v, "stored", True)},
        "coverage": {p: dict(r) for p, r in ix.coverage.items()}, "leases": dict(ix.leases),
        "lease_of": dict(ix.lease_of), "quarantined": dict(ix.quarantined), "credit": dict(ix.credit),
        "maps": dict(ix.maps), "recruiting": {mid: ix.recruiting(mid) for mid in ix.models},
        "counts": {mid: copy.deepcopy((c.replicas, c.pending)) for mid, c in ix.counts.items()},
    }


# -- item 8: memory and store change together or not at all ------------------------------------------------


def _setup() -> tuple[Market, FlakyStore, SliceRef]:
    store = FlakyStore()
    m = market(store=store)
    m.register(RegisterModels(URL, [manifest()], epoch=10), 0.0)
    s = leased(m, "a", 1.0)
    m.heartbeat(hb("a", 1, (s.layer, s.lo, s.hi, SERVING)), 1.5)
    m.tick(2.0)
    return m, store, s


SEQ = itertools.count(2)
CALLS: dict[str, Callable[[Market, SliceRef], object]] = {
    "register": lambda m, s: m.register(RegisterModels(URL, [manifest(), manifest("two-0123456789ab")], epoch=11), 3.0),
    "register another coordinator": lambda m, s: m.register(RegisterModels("http://c2.test", [manifest()], epoch=1), 3.0),
    "poll": lambda m, s: m.volunteer(VolunteerRequest("b", max_experts=4), 3.0),
    # releases everything; a new sequence each time (a refused heartbeat's counter stays used: replays stay refused)
    "heartbeat": lambda m, s: m.heartbeat(hb("a", next(SEQ)), 3.0),
    "report": lambda m, s: m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="a", calls=5, rows=5, verified=5, pairs=10)]), 3.0),
    "tick": lambda m, s: m.tick(100.0),  # "a" has been silent past its TTL: expired
}


@pytest.mark.parametrize("call", CALLS)
def test_a_refused_batch_leaves_memory_as_the_store_has_it(call: str) -> None:
    m, store, s = _setup()
    before = durable(m)
    events = m.events().last_seq
    store.fail = True
    with pytest.raises(StoreError):
        CALLS[call](m, s)
    assert durable(m) == before
    assert m.ix.counts == m.ix.recount()
    assert [e.seq for e in m.events().events if e.seq > events] == []
    # the same call succeeds once the store takes writes again, and then memory matches a restart
    store.fail = False
    CALLS[call](m, s)
    m.tick(100.5)
    restarted = market(store=FlakyStore(store.backing))
    restarted.tick(100.5)
    after, again = durable(m), durable(restarted)
    for k in ("models", "coordinators", "coverage", "leases", "quarantined", "credit", "maps"):
        assert after[k] == again[k], k


def test_a_refused_registration_is_not_hosted_and_the_volunteer_counter_survives_a_refused_heartbeat() -> None:
    m, store, s = _setup()
    store.fail = True
    with pytest.raises(StoreError):
        m.register(RegisterModels("http://c2.test", [manifest("two-0123456789ab")], epoch=1), 3.0)
    assert "two-0123456789ab" not in m.ix.models and "http://c2.test" not in m.ix.coordinators
    assert m.ix.hosts_of(MID) == [URL]
    with pytest.raises(StoreError):
        m.heartbeat(hb("a", 7), 3.5)
    assert m.ix.coverage["a"] and m.ix.volunteers["a"].row.sequence == 7  # a replay of 7 stays refused
    store.fail = False
    with pytest.raises(Exception, match="not newer"):
        m.heartbeat(hb("a", 7), 4.0)
    m.heartbeat(hb("a", 8, (s.layer, s.lo, s.hi, SERVING)), 4.0)
    assert list(m.ix.coverage["a"]) == [s]
