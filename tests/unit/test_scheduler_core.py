"""Pure scheduler core: admission, batching plans, stop strings, cancellation (no event loop)."""

from __future__ import annotations

import pytest

from coordinator.core.scheduler import (
    Admitted,
    Emit,
    Finish,
    FinishReason,
    GenParams,
    GenRequest,
    Rejected,
    RejectReason,
    Scheduler,
    _stop_prefix_len,
)

EOS = 99


def mk(n_slots: int = 2, n_ctx: int = 64, n_batch: int = 8, max_queue: int = 1) -> Scheduler:
    return Scheduler(n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch, max_queue=max_queue, eot_ids=frozenset({EOS}))


def req(i: int, n: int = 3, **kw: object) -> GenRequest:
    return GenRequest(i, tuple(range(1, n + 1)), GenParams(**kw))  # type: ignore[arg-type]


def test_admission_queue_and_rejection() -> None:
    s = mk(n_slots=1, max_queue=1)
    assert s.submit(req(1), 0) == [Admitted(1, 0)]
    assert s.submit(req(2), 0) == []  # queued
    assert s.submit(req(3), 0) == [Rejected(3, RejectReason.QUEUE_FULL)]
    assert s.queue_depth() == 1
    # cancelling the running one admits the queued one
    eff = s.cancel(1, 1.0)
    assert eff == [Finish(1, FinishReason.CANCELLED, 3, 0), Admitted(2, 0)]


@pytest.mark.parametrize(
    ("prompt_len", "reason"),
    [(0, RejectReason.EMPTY_PROMPT), (64, RejectReason.PROMPT_TOO_LONG), (100, RejectReason.PROMPT_TOO_LONG)],
)
def test_bad_prompts_rejected(prompt_len: int, reason: str) -> None:
    s = mk()
    assert s.submit(GenRequest(1, tuple([1] * prompt_len), GenParams()), 0) == [Rejected(1, reason)]


def test_plan_batches_decode_and_chunks_prefill() -> None:
    s = mk(n_slots=3, n_batch=8)
    s.submit(req(1, n=2), 0)
    s.submit(req(2, n=20), 0.1)
    plan = s.plan()
    # slot 0 gets its whole 2-token prompt, slot 1 the remaining budget of 6
    assert [(e.slot, len(e.tokens), e.pos, e.sample, e.prefill) for e in plan] == [(0, 2, 0, True, True), (1, 6, 0, False, True)]
    for e in plan:
        s.fed(e, 1.0)
    s.token(0, 1, 7, "x", 1.0)
    plan = s.plan()
    # the decoding slot feeds one token; the prefilling one gets the other 7
    assert [(e.slot, e.tokens, e.pos, e.sample) for e in plan] == [(0, (7,), 2, True), (1, tuple(range(7, 14)), 6, False)]


def test_max_tokens_and_eos() -> None:
    s = mk()
    s.submit(req(1, max_tokens=2), 0)
    [e] = s.plan()
    s.fed(e, 0)
    assert s.token(0, 1, 5, "a", 0.1) == [Emit(1, "a", (5,))]
    eff = s.token(0, 1, 6, "b", 0.2)
    assert eff == [Emit(1, "b", (6,)), Finish(1, FinishReason.LENGTH, 3, 2)]
    assert s.busy() == 0
    s.submit(req(2), 1)
    [e] = s.plan()
    s.fed(e, 1)
    assert s.token(0, 2, EOS, "", 1.1) == [Finish(2, FinishReason.STOP, 3, 0)]


def test_ignore_eos_keeps_going() -> None:
    s = mk()
    s.submit(req(1, max_tokens=3, ignore_eos=True), 0)
    [e] = s.plan()
    s.fed(e, 0)
    assert s.token(0, 1, EOS, "<eos>", 0.1) == [Emit(1, "<eos>", (EOS,))]
    assert s.busy() == 1


def test_stop_string_held_back_and_cut() -> None:
    s = mk()
    s.submit(req(1, max_tokens=50, stop=("END",)), 0)
    [e] = s.plan()
    s.fed(e, 0)
    assert s.token(0, 1, 1, "hello E", 0.1) == [Emit(1, "hello ", (1,))]  # "E" may start END
    assert s.token(0, 1, 2, "N", 0.2) == []  # "EN" still may
    assert s.token(0, 1, 3, "Dx", 0.3) == [Emit(1, "", (2, 3)), Finish(1, FinishReason.STOP, 3, 3)]


def test_stop_string_false_alarm_released() -> None:
    s = mk()
    s.submit(req(1, max_tokens=50, stop=("END",)), 0)
    [e] = s.plan()
    s.fed(e, 0)
    assert s.token(0, 1, 1, "E", 0.1) == []
    assert s.token(0, 1, 2, "X", 0.2) == [Emit(1, "EX", (1, 2))]


@pytest.mark.parametrize(
    ("text", "stops", "n"),
    [("abc", ("cd",), 1), ("abc", ("xyz",), 0), ("ab", ("abc", "b"), 2), ("", ("a",), 0)],
)
def test_stop_prefix_len(text: str, stops: tuple[str, ...], n: int) -> None:
    assert _stop_prefix_len(text, stops) == n


def test_cancel_mid_step_ignores_stale_results() -> None:
    s = mk(n_slots=1, max_queue=2)
    s.submit(req(1), 0)
    s.submit(req(2), 0)
    [e] = s.plan()
    s.cancel(1, 0.5)  # request 2 takes slot 0 while the step for request 1 runs
    s.fed(e, 1.0)
    assert s.token(0, 1, 5, "x", 1.0) == []  # stale: request 1 is gone
    [e2] = s.plan()
    assert (e2.req_id, e2.pos, len(e2.tokens)) == (2, 0, 3)


def test_context_full_finishes_with_length() -> None:
    """n_ctx 5, prompt 3: tokens are fed at positions 3 and 4, the third sampled token has no room."""
    s = mk(n_ctx=5, n_batch=8)
    s.submit(req(1, n=3, max_tokens=100), 0)
    [e] = s.plan()
    s.fed(e, 0)
    assert not s.last_token_due(0)
    assert s.token(0, 1, 5, "a", 0.1) == [Emit(1, "a", (5,))]
    [e] = s.plan()
    assert e.pos == 3
    s.fed(e, 0.2)
    assert s.token(0, 1, 6, "b", 0.2) == [Emit(1, "b", (6,))]
    [e] = s.plan()
    assert e.pos == 4  # the last position of the context
    s.fed(e, 0.3)
    assert s.last_token_due(0)
    assert s.token(0, 1, 7, "c", 0.3) == [Emit(1, "c", (7,)), Finish(1, FinishReason.LENGTH, 3, 3)]
    assert not s.last_token_due(0)


def test_last_token_due_at_max_tokens() -> None:
    s = mk()
    s.submit(req(1, max_tokens=2), 0)
    [e] = s.plan()
    s.fed(e, 0)
    assert not s.last_token_due(0)
    s.token(0, 1, 5, "a", 0.1)
    assert s.last_token_due(0)


def test_slot_views_and_tps() -> None:
    s = mk()
    s.submit(req(1, max_tokens=10), 0)
    [e] = s.plan()
    s.fed(e, 0)
    s.token(0, 1, 5, "a", 1.0)
    s.token(0, 1, 6, "b", 1.1)
    v = s.views()[0]
    assert v.is_processing and v.n_prompt == 3 and v.n_decoded == 2
    assert v.tps_ewma == pytest.approx(10.0)
