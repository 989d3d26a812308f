"""Credit for verified work (``market.core.credit``; issue 13): fed by coordinator reports only,
nothing for quarantined periods, a recent average that converges to the steady daily rate."""

from __future__ import annotations

import random

import msgspec
import pytest

from market.core.credit import HALF_LIFE_S, credit_row, flops_per_pair, rac_now
from market.state import Market
from market.store import InMemoryStore, MemoryBacking
from swarm.protocol.market import (
    CoordinatorReport,
    EvidenceMethod,
    QuarantineEvidence,
    RegisterModels,
    ReportedWorker,
)
from tests.unit.test_market_state import MID, POLICY, SERVING, URL, codes, hb, manifest

DAY = 24 * 3600.0


def evidence(layer: int, lo: int, hi: int) -> QuarantineEvidence:
    """Quarantine evidence as a coordinator sends it (bit-exact comparison: the hashes differ)."""
    return QuarantineEvidence(layer=layer, lo=lo, hi=hi, input_sha256="a" * 64, remote_sha256="b" * 64,
                              local_sha256="c" * 64, method=EvidenceMethod.BIT_EXACT)


def test_a_steady_rate_converges_to_itself_and_silence_decays_by_the_half_life() -> None:
    assert flops_per_pair(2048, 768) == 6 * 2048 * 768
    row = None
    for day in range(60):  # 1e12 FLOPs a day, reported hourly
        for hour in range(24):
            row = credit_row(row, "p", flops=1e12 / 24, pairs=10, verified=1, now=day * DAY + hour * 3600.0)
    assert row is not None
    assert row.total_flops == pytest.approx(60e12) and row.pairs == 14400 and row.verified == 1440
    assert rac_now(row, row.last_at) == pytest.approx(1e12, rel=0.03)
    assert rac_now(row, row.last_at + HALF_LIFE_S) == pytest.approx(rac_now(row, row.last_at) / 2)
    assert row.first_at == 0.0 and row.last_at == 59 * DAY + 23 * 3600.0


def _market(backing: MemoryBacking) -> Market:
    return Market(InMemoryStore(backing), POLICY, now=0.0, rng=random.Random(0))


def test_reports_credit_pairs_served_but_not_in_quarantined_periods_and_the_ledger_is_durable() -> None:
    backing = MemoryBacking()
    m = _market(backing)
    man = msgspec.structs.replace(manifest(), d_model=64, d_expert=32)
    m.register(RegisterModels(URL, [man], epoch=1), 0.0)
    m.heartbeat(hb("honest", 1, (0, 0, 4, SERVING)), 0.0)
    m.heartbeat(hb("liar", 1, (0, 4, 8, SERVING)), 0.0)
    assert codes(lambda: m.volunteer_credit("nobody", 1.0)) == "404 unknown_volunteer"
    assert m.volunteer_credit("honest", 1.0).total_flops == 0.0  # known, no credit yet
    m.report(CoordinatorReport(url=URL, model_id=MID, workers=[
        ReportedWorker(peer_id="honest", calls=5, rows=40, verified=5, pairs=80),
        ReportedWorker(peer_id="liar", calls=5, rows=40, pairs=80, quarantine="layer 0 experts 4-8: zeros",
                       evidence=evidence(0, 4, 8))]), 10.0)
    c = m.volunteer_credit("honest", 10.0)
    assert (c.total_flops, c.pairs, c.verified, c.slices) == (80 * 6 * 64 * 32, 80, 5, ["0:0-4"])
    liar = m.volunteer_credit("liar", 10.0)
    assert liar.total_flops == 0.0 and liar.quarantined_until_ms is not None  # its period earned nothing
    m.report(CoordinatorReport(url=URL, model_id=MID, workers=[ReportedWorker(peer_id="liar", pairs=100)]), 20.0)
    assert m.volunteer_credit("liar", 20.0).total_flops == 0.0  # ... nor any while refused
    board = m.credit_board(20.0)
    assert [v.peer_id for v in board.volunteers] == ["honest"]
    # durable: a restarted market has the same ledger
    again = _market(backing)
    assert again.volunteer_credit("honest", 30.0).total_flops == c.total_flops
    assert again.volunteer_credit("honest", 30.0).first_credit_ms == 10_000
