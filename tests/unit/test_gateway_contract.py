"""The gateway reads what the coordinator writes: ``GET /capacity`` encoded from the coordinator's own
``CapacityReport`` (before any session was measured its speeds are null) decodes in the gateway's poller."""

from __future__ import annotations

import msgspec
import pytest

from gateway.server import _capacity
from swarm.protocol.coordinator import CapacityReport


@pytest.mark.parametrize("mean", [None, 0.0, 12.5])
def test_the_coordinators_capacity_report_decodes_in_the_gateway(mean: float | None) -> None:
    rep = CapacityReport(can_admit=False, projected_mean_tps_if_admitted=None, headroom_sessions=0, kv_headroom_pct=40.0,
                         settling=True, settle_remaining_ms=1200, reason="settling", mean_active_tps=mean, tps_floor=None,
                         active_sessions=3, slots=4, queue=1, admission="enforced")
    got = _capacity.decode(msgspec.json.encode(rep))
    assert (got.can_admit, got.admission, got.settling, got.settle_remaining_ms) == (False, "enforced", True, 1200)
    assert (got.mean_active_tps, got.active_sessions, got.slots, got.queue) == (mean, 3, 4, 1)
