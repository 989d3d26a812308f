"""coordinator.core.market_outage: one line when the market is lost or refuses us, one when it is
back, the reason while it is not (table-driven, no event loop)."""

from __future__ import annotations

from coordinator.core.market_outage import MarketOutage, Problem, ProblemKind

M = "http://m.test:8090"
DOWN = Problem(ProblemKind.UNREACHABLE, "unreachable (ConnectError: [Errno 111] Connection refused)")
TOKEN = Problem(ProblemKind.REFUSED, "refused the operator token (HTTP 401 unauthorized)", hint="give --token")
BROKEN = Problem(ProblemKind.ERROR, "answered HTTP 500 internal_error: boom")


def test_an_outage_is_said_once_and_its_end_once() -> None:
    o = MarketOutage(M)
    assert o.ok("map", 0.0) is None and o.reason is None  # all fine: nothing said
    said = [o.failed("map", DOWN, 1.0), o.failed("register", DOWN, 1.2)]
    said += [o.failed(ch, DOWN, 1.5 + i / 2) for i in range(20) for ch in ("map", "register")]  # retries
    assert said[0] == f"market {M} {DOWN.text}; retrying (the last dispatch map stays in force)"
    assert said[1:] == [None] * 41
    assert o.reason == f"market {M} {DOWN.text}"
    assert o.ok("map", 30.0) is None and o.reason == f"market {M} {DOWN.text}"  # register still failing
    assert o.ok("register", 31.0) == f"market {M} answers again (after 30 s)"
    assert o.reason is None and o.ok("register", 32.0) is None
    # the next outage is news again
    assert o.failed("report", BROKEN, 40.0) == f"market {M} {BROKEN.text}; retrying (the last dispatch map stays in force)"


def test_a_refusal_is_news_inside_an_outage_and_wins_the_reason() -> None:
    o = MarketOutage(M)
    assert o.failed("map", DOWN, 0.0) is not None
    # the market is back but with another token: a different kind of problem, said once, with the fix
    assert o.failed("register", TOKEN, 5.0) == f"market {M} {TOKEN.text}; give --token (the last dispatch map stays in force)"
    assert o.failed("map", TOKEN, 5.5) is None and o.failed("register", TOKEN, 6.0) is None
    assert o.reason == f"market {M} {TOKEN.text}"
    o.failed("report", DOWN, 7.0)
    assert o.reason == f"market {M} {TOKEN.text}"  # refused outranks unreachable, whatever the order
    assert o.ok("map", 8.0) is None and o.ok("register", 8.0) is None
    assert o.ok("report", 9.0) == f"market {M} answers again (after 9 s)"


def test_the_oldest_of_equal_problems_is_the_reason() -> None:
    o = MarketOutage(M)
    o.failed("report", BROKEN, 0.0)
    o.failed("map", Problem(ProblemKind.ERROR, "answered HTTP 502"), 1.0)
    o.failed("report", BROKEN, 2.0)  # a retry keeps its channel's start
    assert o.reason == f"market {M} {BROKEN.text}"
