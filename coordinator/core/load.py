"""The coordinator's load state for dispatch (pure core: no I/O, no clock; ``now`` is given).

Rules:
- ``sampled(busy, n_slots, now)`` every ``sample_interval_s`` (the shell bounds the sample in time;
  a sample that hangs or fails is ``timed_out()`` and changes nothing). ``busy >=
  saturation_threshold`` is *loaded*. A sample older than ``sample_max_age_s`` has aged out and
  says nothing.
- After the load ends (an idle sample, or the loaded one aged out) the state is ``serve_ttl`` for
  ``serve_ttl_s``, then ``idle``: hysteresis, so a flapping load does not thrash.
- ``update(now)`` moves the state the core acts on to ``load_state(now)`` and says why it changed
  (a ``ModeChanged`` effect), or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.events import DispatchConfig, LoadState, ModeChanged, Reason

__all__ = ["LoadSampleRecord", "LoadTracker"]


@dataclass(frozen=True)
class LoadSampleRecord:
    busy: int
    n_slots: int
    at: float


class LoadTracker:
    def __init__(self, config: DispatchConfig) -> None:
        self.config = config
        self.sample: LoadSampleRecord | None = None
        self.load_ended_at: float | None = None
        self.state = LoadState.IDLE
        self.samples_failed = 0

    def load_state(self, now: float) -> LoadState:
        """idle / loaded / serve_ttl at ``now`` (see the module rules)."""
        c = self.config
        s = self.sample
        ended: float | None
        if s is not None and s.busy >= c.saturation_threshold:
            if now - s.at <= c.sample_max_age_s:
                return LoadState.LOADED
            end = s.at + c.sample_max_age_s  # aged out: the load is not known to go on
            ended = end if self.load_ended_at is None else max(end, self.load_ended_at)
        else:
            ended = self.load_ended_at
        if ended is not None and now - ended < c.serve_ttl_s:
            return LoadState.SERVE_TTL
        return LoadState.IDLE

    def sampled(self, busy: int, n_slots: int, now: float) -> None:
        prev, thr = self.sample, self.config.saturation_threshold
        if prev is not None and prev.busy >= thr and busy < thr:
            self.load_ended_at = min(now, prev.at + self.config.sample_max_age_s)
        self.sample = LoadSampleRecord(busy, n_slots, now)

    def timed_out(self) -> None:
        self.samples_failed += 1

    def update(self, now: float) -> ModeChanged | None:
        new = self.load_state(now)
        if new is self.state:
            return None
        reason = {
            LoadState.LOADED: Reason.LOAD_ONSET,
            LoadState.SERVE_TTL: Reason.LOAD_ENDED,
            LoadState.IDLE: Reason.TTL_EXPIRED if self.state is LoadState.SERVE_TTL else Reason.LOAD_ENDED,
        }[new]
        self.state = new
        return ModeChanged(new, reason)
