"""CoordinatorReport's numbering (epoch, sequence) is schema evolution: an unnumbered report carries neither field,
so a market from before them (which refuses unknown fields) still takes it, and a numbered one is refused with a
message naming the field -- what ``coordinator.dispatch.market_link`` keys its fallback to unnumbered reports on."""

from __future__ import annotations

import msgspec
import pytest

from swarm.protocol.market import CoordinatorReport, ReportedWorker


class ReportBeforeNumbering(msgspec.Struct, forbid_unknown_fields=True):
    """The wire shape of CoordinatorReport before ``epoch``/``sequence`` (a5afb6c)."""

    url: str
    model_id: str
    workers: list[ReportedWorker] = []
    ranges: list[dict[str, int]] = []


def test_an_unnumbered_report_is_readable_by_a_market_from_before_numbering() -> None:
    body = msgspec.json.encode(CoordinatorReport(url="http://c.test", model_id="m"))
    assert b"epoch" not in body and b"sequence" not in body
    assert msgspec.json.decode(body, type=ReportBeforeNumbering).url == "http://c.test"


def test_a_numbered_report_is_refused_there_naming_the_field() -> None:
    body = msgspec.json.encode(CoordinatorReport(url="http://c.test", model_id="m", epoch=7, sequence=1))
    with pytest.raises(msgspec.ValidationError, match="unknown field `epoch`"):
        msgspec.json.decode(body, type=ReportBeforeNumbering)
    assert msgspec.json.decode(body, type=CoordinatorReport).sequence == 1  # and read by today's market
