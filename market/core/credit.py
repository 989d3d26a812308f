"""Credit for verified work (pure: no I/O, no clock; ``now`` is given).

Volunteer-computing projects grant credit only for validated work, as an amount of computation,
with totals and a recent average per host. Here:
- Credit is fed only by coordinator reports (DESIGN §11), never by a volunteer's own count: a
  report's ``pairs`` for a worker, each worth ``6 * d_model * d_expert`` floating-point operations
  (three matrices of ``d_model x d_expert``, a multiply and an add each).
- Counts saturate at int64 (``INT64_MAX``); the market bounds each report's (``max_report_pairs``).
- A report period in which the coordinator quarantined the worker (the report carries evidence),
  or in which the market refuses it, earns nothing.
- The recent average credit (RAC, FLOPs per day) decays exponentially with ``half_life_s``
  (default one week): ``rac = rac * 2^(-dt / H) + credit * ln 2 / H_days``, so a steady rate of r
  FLOPs a day converges to r.
"""

from __future__ import annotations

import math

from market.core.records import CreditRow

__all__ = ["HALF_LIFE_S", "credit_row", "flops_per_pair", "rac_now"]

HALF_LIFE_S = 7 * 24 * 3600.0
INT64_MAX = 2**63 - 1  # counts stay within what the store (and anyone reading its JSON) keeps
_DAY = 24 * 3600.0


def flops_per_pair(d_model: int, d_expert: int) -> float:
    return 6.0 * d_model * d_expert


def rac_now(row: CreditRow, now: float, half_life_s: float = HALF_LIFE_S) -> float:
    """The recent average credit brought forward to ``now`` (no new credit)."""
    return float(row.rac_flops_per_day * math.pow(2.0, -max(0.0, now - row.rac_at) / half_life_s))


def credit_row(old: CreditRow | None, peer_id: str, *, flops: float, pairs: int, verified: int, now: float,
               half_life_s: float = HALF_LIFE_S) -> CreditRow:
    """``old`` (or a new row) with one report period's work added."""
    rac = 0.0 if old is None else rac_now(old, now, half_life_s)
    rac += flops * math.log(2) / (half_life_s / _DAY)
    if old is None:
        return CreditRow(peer_id, flops, rac, now, min(INT64_MAX, pairs), min(INT64_MAX, verified), now, now)
    return CreditRow(peer_id, old.total_flops + flops, rac, now, min(INT64_MAX, old.pairs + pairs),
                     min(INT64_MAX, old.verified + verified), old.first_at, now)
