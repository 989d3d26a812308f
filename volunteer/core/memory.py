"""How a volunteer's ``--max-memory`` splits (pure: the baseline is measured by the shell).

Rules:
- ``max_memory`` bounds the process's peak resident set. The shell measures its baseline (``VmRSS``
  once the host, the compute pool and the status socket are up).
- A reserve for request payloads in flight: the ``ByteBudget`` total is ``max_memory / 16``,
  between 16 and 256 MiB, counted twice (the rows in, the answers out).
- The slices get the rest; nothing left is a ``ConfigError`` naming the least budget that would do
  (baseline + reserve + 64 MiB).
"""

from __future__ import annotations

import msgspec

from swarm.errors import ConfigError

__all__ = ["MemoryPlan"]


class MemoryPlan(msgspec.Struct, frozen=True):
    """How ``--max-memory`` splits (see the module rules)."""

    max_memory: int
    baseline: int
    payload: int  # the ByteBudget total (request payloads held at once)
    slices: int  # the slice budget

    @staticmethod
    def of(max_memory: int, baseline: int) -> MemoryPlan:
        payload = min(256 << 20, max(16 << 20, max_memory // 16))
        slices = max_memory - baseline - 2 * payload
        if slices <= 0:
            raise ConfigError(f"--max-memory {max_memory >> 20} MiB leaves nothing for slices: this process uses "
                              f"{baseline >> 20} MiB before holding any, and keeps {2 * payload >> 20} MiB for "
                              f"requests in flight; give at least {(baseline + 2 * payload + (64 << 20)) >> 20} MiB")
        return MemoryPlan(max_memory, baseline, payload, slices)
