"""Is the coordinator's market answering it? One small machine (pure: ``now`` is given, no I/O).

The market link (``coordinator.dispatch.market_link``) talks to the market on a few channels --
registration, the dispatch-map poll, the report -- each retried on its own. This machine turns
their outcomes into what a person needs: one log line when the market is lost or refuses us, one
when it is back, and the reason ``/health`` gives while it is not.

Rules:
- A channel reports each exchange: ``ok(channel, now)``, or ``failed(channel, problem, now)`` with
  a ``Problem`` -- ``UNREACHABLE`` (no answer), ``REFUSED`` (401/403: the operator token, or a 4xx
  refusal of what we sent) or ``ERROR`` (any other answer we cannot use) -- and a text for people.
- The link is *degraded* while any channel's last exchange failed; the reason is the most
  actionable of the failing channels' problems (refused, then error, then unreachable), ties to the
  oldest.
- Said once per outage: the first failure returns a line to log; further failures return nothing
  (retries every half second would flood the log), unless the reason's kind changes (unreachable ->
  refused is news); the end of the outage (no failing channel left) returns one line with its
  length. Nothing is said while every channel is fine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["MarketOutage", "Problem", "ProblemKind"]


class ProblemKind(StrEnum):
    REFUSED = "refused"
    ERROR = "error"
    UNREACHABLE = "unreachable"


_RANK = {ProblemKind.REFUSED: 0, ProblemKind.ERROR: 1, ProblemKind.UNREACHABLE: 2}


@dataclass(frozen=True)
class Problem:
    kind: ProblemKind
    text: str  # for people: "unreachable (ConnectError: ...)", "refused the operator token (HTTP 401 unauthorized)"
    hint: str = ""  # what would end it, when a retry will not ("give the market's token: --token")


class MarketOutage:
    """Outages of one market, over the link's channels."""

    def __init__(self, market: str) -> None:
        self.market = market
        self._failing: dict[str, tuple[Problem, float]] = {}  # channel -> (problem, since)
        self._since: float | None = None  # the outage's start
        self._said: ProblemKind | None = None  # the kind last logged in this outage

    @property
    def reason(self) -> str | None:
        """Why the link is degraded now (None: it is not)."""
        problem = self._worst()
        return None if problem is None else f"market {self.market} {problem.text}"

    def _worst(self) -> Problem | None:
        if not self._failing:
            return None
        return min(self._failing.values(), key=lambda ps: (_RANK[ps[0].kind], ps[1]))[0]

    def failed(self, channel: str, problem: Problem, now: float) -> str | None:
        """A channel's exchange failed: the line to log (at warning), if this is news."""
        since = self._failing[channel][1] if channel in self._failing else now
        self._failing[channel] = (problem, since)
        if self._since is None:
            self._since = now
        worst = self._worst()
        if worst is None or worst.kind == self._said:
            return None
        self._said = worst.kind
        return f"market {self.market} {worst.text}; {worst.hint or 'retrying'} (the last dispatch map stays in force)"

    def ok(self, channel: str, now: float) -> str | None:
        """A channel's exchange succeeded: the line to log (at info) when that ends the outage."""
        if self._failing.pop(channel, None) is None or self._failing or self._since is None:
            return None
        took, self._since, self._said = now - self._since, None, None
        return f"market {self.market} answers again (after {took:.0f} s)"
