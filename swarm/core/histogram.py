"""Bucket counts of durations for a Prometheus histogram (pure: the caller observes and reads)."""

from __future__ import annotations

__all__ = ["Histogram"]


class Histogram:
    """Observations counted into buckets of upper bounds ``bounds`` (seconds) plus +Inf, and their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, as ``HistogramMetricFamily.add_metric`` takes them."""
        out, run = [], 0
        for b, n in zip((*(repr(b) for b in self.bounds), "+Inf"), self.counts, strict=True):
            run += n
            out.append((b, run))
        return out
