"""Speculative decoding's decisions (pure: no I/O, no clock, no torch).

A decode step of a session may carry ``k`` drafted tokens after its last sampled one: the step
computes the logits at all ``k + 1`` positions at once (one round trip per remote layer for all of
them), and ``verify`` keeps the drafts the target itself would have produced. Because every kernel
is batch-invariant, position ``i``'s logits are the bits plain decoding computes there, and each
emitted token is *sampled* from them exactly as plain decoding samples it (one draw per emitted
token, in order): the output equals decoding without speculation, for greedy and seeded sampling.

Rules:
- ``verify(drafts, sample)``: ``sample(i)`` is the target's token at position ``i`` (given the
  accepted ones before it); tokens are emitted while they equal the drafts, then the first that
  differs (or, when all ``k`` were accepted, the one after them) ends the step: 1..k+1 tokens.
- ``ngram_draft(history, k)``: prompt-lookup drafting (llama.cpp's lookup decoding family): the
  longest suffix of ``history`` of ``n_max``..``n_min`` tokens that occurred before, its most recent
  earlier occurrence, and the up to ``k`` tokens that followed it.
- ``DraftLength``: a session's draft length from its measured acceptance (an EWMA of accepted /
  proposed): ``k = clamp(round(2 a / (1 - a)), 1, k_max)`` -- about twice the expected run of
  accepted drafts, which costs little beyond it -- from ``k_start`` before any measurement; below
  ``a_min`` it backs off to no draft at all and probes with one drafted token every
  ``probe_every`` steps, so a drafter that predicts nothing costs at most those probes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["DraftLength", "DraftStats", "ngram_draft", "verify"]


def verify(drafts: Sequence[int], sample: Callable[[int], int]) -> list[int]:
    """The tokens a step with ``drafts`` emits (see the rules): accepted drafts, then one more."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        t = sample(i)
        out.append(t)
        if i == len(drafts) or t != drafts[i]:
            break
    return out


def ngram_draft(history: Sequence[int], k: int, *, n_max: int = 4, n_min: int = 1, window: int = 1024) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``history`` (``n_max`` down to ``n_min`` tokens), searched in its last ``window`` tokens."""
    if k <= 0 or len(history) < 2:
        return []
    h = list(history[-window:])
    n_hist = len(h)
    last = h[-1]
    # positions whose token is the last one (a match must end on one), most recent first, not the last
    ends = [i for i in range(n_hist - 2, -1, -1) if h[i] == last]
    for n in range(min(n_max, n_hist - 1), n_min - 1, -1):
        key = h[n_hist - n:]
        for end in ends:
            start = end - n + 1
            if start >= 0 and h[start:end + 1] == key:
                return h[end + 1:end + 1 + k]
    return []


@dataclass
class DraftStats:
    """A drafter's counters (``/metrics``, ``/slots``)."""

    steps: int = 0  # verify steps that carried drafts
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens those steps emitted (accepted + one each)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.emitted / self.steps if self.steps else None


class DraftLength:
    def __init__(self, *, k_max: int = 8, k_start: int = 4, a_min: float = 0.3, probe_every: int = 16,
                 alpha: float = 0.3) -> None:
        self.k_max, self.k_start, self.a_min, self.probe_every, self.alpha = k_max, k_start, a_min, probe_every, alpha
        self.acceptance: float | None = None
        self.steps_since_probe = 0

    def length(self) -> int:
        """The draft length the acceptance asks for now (0: backed off), before the request's room."""
        a = self.acceptance
        if a is None:
            return self.k_start
        if a < self.a_min:
            return 0
        return max(1, min(self.k_max, round(2 * a / max(1e-6, 1 - a))))

    def next_k(self, room: int) -> int:
        """How many tokens to draft now, at most ``room`` (the tokens the request may still take)."""
        room = max(0, min(room, self.k_max))
        if room == 0:
            return 0
        k = self.length()
        if k == 0:  # backed off: a probe now and then, else plain decoding
            self.steps_since_probe += 1
            if self.steps_since_probe >= self.probe_every:
                self.steps_since_probe = 0
                return 1
            return 0
        return min(room, k)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        rate = accepted / proposed
        self.acceptance = rate if self.acceptance is None else (1 - self.alpha) * self.acceptance + self.alpha * rate
