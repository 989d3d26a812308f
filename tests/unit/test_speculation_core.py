"""Speculative decoding's pure rules (``coordinator.core.speculation``), table-driven."""

from __future__ import annotations

import pytest

from coordinator.core.speculation import DraftLength, DraftStats, ngram_draft, verify


@pytest.mark.parametrize(
    ("drafts", "target", "emitted"),
    [
        ([], [5], [5]),  # no draft: one token, as plain decoding
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted: k + 1 tokens
        ([1, 2, 3], [1, 9, 3, 4], [1, 9]),  # the first that differs ends the step (it is the target's)
        ([1, 2, 3], [7, 2, 3, 4], [7]),  # none accepted: the target's token alone
    ],
)
def test_verify_emits_the_targets_tokens(drafts: list[int], target: list[int], emitted: list[int]) -> None:
    asked: list[int] = []

    def sample(i: int) -> int:
        asked.append(i)
        return target[i]

    assert verify(drafts, sample) == emitted
    assert asked == list(range(len(emitted)))  # one draw per emitted token, in order: the plain draws


@pytest.mark.parametrize(
    ("history", "k", "want"),
    [
        ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # suffix [1, 2] seen before: what followed it
        ([1, 2, 3, 9, 2, 3], 2, [9, 2]),  # the longest suffix that occurred: [2, 3]
        ([5, 6, 7], 4, []),  # nothing repeats
        ([1, 1, 1, 1], 2, [1]),  # the most recent earlier occurrence of [1, 1, 1]: one token follows it
        ([4, 2, 4, 3, 4], 1, [3]),  # the most recent occurrence of [4] wins
        ([1, 2, 1, 2], 0, []),
        ([], 3, []),
    ],
)
def test_ngram_draft(history: list[int], k: int, want: list[int]) -> None:
    assert ngram_draft(history, k) == want


def test_the_draft_length_follows_the_acceptance_and_backs_off() -> None:
    dl = DraftLength(k_max=8, k_start=4, a_min=0.3, probe_every=4, alpha=1.0)
    assert dl.next_k(room=100) == 4  # nothing measured yet
    assert dl.next_k(room=2) == 2  # never past the request's room
    dl.observe(4, 4)  # everything accepted
    assert dl.next_k(100) == 8
    dl.observe(4, 3)  # a = 0.75: about twice the expected run of 3
    assert dl.next_k(100) == 6
    dl.observe(4, 2)
    assert dl.next_k(100) == 2
    dl.observe(4, 0)  # a drafter that predicts nothing: no drafts, a probe every 4 steps
    ks = [dl.next_k(100) for _ in range(8)]
    assert ks == [0, 0, 0, 1, 0, 0, 0, 1]
    dl.observe(1, 1)  # a probe that hits brings it back
    assert dl.next_k(100) >= 1


def test_stats() -> None:
    s = DraftStats()
    assert s.acceptance is None and s.tokens_per_step is None
    s.steps, s.proposed, s.accepted, s.emitted = 2, 8, 6, 8
    assert s.acceptance == 0.75 and s.tokens_per_step == 4.0
