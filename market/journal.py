"""The market's record for people: the event log, the charts' history and volunteers' call rates
(runtime, never stored; sans-IO: ``now`` is given, nothing awaits or reads a clock).

Rules:
- Events (``GET /api/events``): numbered from 1, the last ``MAX_EVENTS`` kept, details cut to 300
  characters. A call whose store batch was refused drops the events it logged: ``mark`` at the
  start of a call that may commit, ``rollback`` after the refusal (``market.state``'s rule).
- History (``GET /api/history``): per model a ``HistorySample`` every ``HISTORY_EVERY_S``, the last
  ``HISTORY_S`` kept; a model no longer registered loses its samples at the next sample.
- Call rates: ``market.core.activity.CallWindow`` per volunteer, fed by coordinator reports (each
  report's calls spread over the period since that coordinator's previous report of the model);
  windows with nothing left in them are dropped (``prune``), so memory follows the active volunteers.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

from market.core.activity import FIRST_PERIOD_S, CallWindow
from market.core.records import SliceRef
from market.indexes import Indexes
from swarm.protocol.market import EventLog, HistorySample, MarketEvent, ModelHistory

__all__ = ["HISTORY_EVERY_S", "HISTORY_S", "MAX_EVENTS", "Journal"]

HISTORY_S: Final = 15 * 60.0  # what the dashboard's charts show
HISTORY_EVERY_S: Final = 5.0
MAX_EVENTS: Final = 1000


class Journal:
    def __init__(self) -> None:
        self._events: deque[MarketEvent] = deque(maxlen=MAX_EVENTS)
        self._seq = 0
        self._mark = 0
        self._history: dict[str, deque[HistorySample]] = {}
        self._history_at = -math.inf
        self.calls: dict[str, CallWindow] = {}  # peer -> its reported calls (the dashboard's calls/s)
        self._reported_at: dict[tuple[str, str], float] = {}  # (coordinator URL, model) -> its last report

    # -- events -------------------------------------------------------------------------------------
    def mark(self) -> None:
        self._mark = self._seq

    def rollback(self) -> None:
        while self._events and self._events[-1].seq > self._mark:
            self._events.pop()

    def event(self, kind: str, now: float, *, model_id: str | None = None, peer_id: str | None = None,
              s: SliceRef | None = None, detail: str = "") -> None:
        self._seq += 1
        self._events.append(MarketEvent(self._seq, int(now * 1000), kind,
                                        model_id if model_id is not None else (s.model_id if s else None),
                                        peer_id, str(s) if s is not None else None, detail[:300]))

    def events(self, after: int = 0) -> EventLog:
        return EventLog([e for e in self._events if e.seq > after], self._seq)

    # -- history ------------------------------------------------------------------------------------
    def sample(self, ix: Indexes, now: float) -> None:
        """Take the models' samples if one is due."""
        if now - self._history_at < HISTORY_EVERY_S:
            return
        self._history_at = now
        for mid in ix.models:
            busy = slots = 0
            tps = 0.0
            for url in ix.hosts_of(mid):
                p = ix.polls.get(url)
                if p is not None and p.ok and p.last_ok is not None:
                    busy, slots, tps = busy + p.last_ok.busy, slots + p.last_ok.slots, tps + p.tps
            h = self._history.setdefault(mid, deque(maxlen=int(HISTORY_S / HISTORY_EVERY_S)))
            h.append(HistorySample(int(now * 1000), busy, slots, ix.target(mid), ix.counts[mid].min_replicas(),
                                   round(tps, 2)))
        for mid in list(self._history):
            if mid not in ix.models:
                del self._history[mid]

    def forget_model(self, model_id: str) -> None:
        self._history.pop(model_id, None)

    def history(self) -> list[ModelHistory]:
        return [ModelHistory(mid, list(h)) for mid, h in sorted(self._history.items())]

    # -- call rates ---------------------------------------------------------------------------------
    def reported(self, url: str, model_id: str, calls: dict[str, int], now: float) -> None:
        """A coordinator's report: the answered calls per volunteer since its previous one."""
        start = self._reported_at.get((url, model_id), now - FIRST_PERIOD_S)
        self._reported_at[(url, model_id)] = now
        for peer, n in calls.items():
            if n > 0:
                self.calls.setdefault(peer, CallWindow()).add(start, now, n)

    def calls_per_s(self, peer_id: str, now: float) -> float:
        w = self.calls.get(peer_id)
        return w.rate(now) if w is not None else 0.0

    def prune(self, ix: Indexes, now: float) -> None:
        for peer in list(self.calls):
            w = self.calls[peer]
            w.prune(now)
            if not w.periods:
                del self.calls[peer]
        for key in list(self._reported_at):
            if key[0] not in ix.coordinators:
                del self._reported_at[key]
