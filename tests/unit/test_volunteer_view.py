"""The volunteer's view for a person (``volunteer.status`` renderers, ``volunteer.view``, ``swarm.progress``):
a fixed width whatever it shows, its display name, honest labels (the slices held, not the request bytes
in flight), running downloads as progress bars inside it; plain lines without ``\\r`` or escape
sequences anywhere else. Rendered into a rich Console of a fixed width, as text."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from swarm.progress import PlainTransferLog, TransferBars, Transfers, TransferView
from volunteer.status import (
    VIEW_WIDTH,
    DownloadStatus,
    SliceStatus,
    VolunteerStatus,
    plain_line,
    render_table,
)
from volunteer.view import VolunteerView


def status(**kw: object) -> VolunteerStatus:
    base: dict[str, object] = dict(
        peer_id="12D3KooWabcdefghijklmnop", market="http://m.test", phase="serving", waiting_for="serving 0:0-8 of m",
        market_reachable=True, reachability="public", path="direct", addrs=["/ip4/1.2.3.4/tcp/1"],
        slices=[SliceStatus("m", "0:0-8", "serving", 1), SliceStatus("m", "1:0-8", "serving", 1)], calls=3,
        calls_per_s=0.5, rows=9, errors=0, in_flight=0, payload_bytes=0, coordinators=["12D3KooWc"],
        display_name="alice's desk", held_bytes=24 << 20, slice_budget_bytes=2048 << 20)
    base.update(kw)
    return VolunteerStatus(**base)  # type: ignore[arg-type]


def draw(renderable: object, width: int = 140) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_the_view_has_one_width_the_name_and_what_is_held() -> None:
    quiet = draw(render_table(status()))
    busy = draw(render_table(status(
        waiting_for="serving " + ", ".join(f"{i}:0-8" for i in range(40)) + " of a-model-with-a-long-id",
        addrs=["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx/p2p-circuit"] * 3,
        market_reachable=False, downloaded={"peer 12D3KooWa": 3 << 20})))
    # the same width whatever it holds (the title line is centred in it)
    for lines in (quiet, busy):
        assert {len(x) for x in lines[1:]} == {VIEW_WIDTH}, {len(x) for x in lines}
    text = "\n".join(quiet)
    assert "moe-swarm volunteer alice's desk (ijklmnop)" in text  # the name, and the peer id's tail
    # the slices held are named as such; the request budget in flight has its own label
    assert "2 slices, 24.0 MiB of 2048.0 MiB held" in text
    assert "requests in flight: 0.0 MiB" in text and "0.0 MiB held" not in text
    # a narrower terminal: the view takes its width, never more
    assert {len(x) for x in draw(render_table(status()), width=80)[1:]} == {80}


def test_a_name_is_text_not_markup() -> None:
    text = "\n".join(draw(render_table(status(display_name="[red]x[/red] [link=http://e]y"))))
    assert "[red]x[/red] [link=http://e]y" in text


def test_running_downloads_are_progress_bars_inside_the_view() -> None:
    clock = [0.0]
    transfers = Transfers(clock=lambda: clock[0])
    t = transfers.start("0-0-8.safetensors", total=12 << 20)
    clock[0] = 2.0
    t.advance(3 << 20)
    bars = TransferBars()
    bars.update(transfers.running())
    downloads = [DownloadStatus(v.name, v.done, v.total, v.rate) for v in transfers.running()]
    lines = draw(render_table(status(phase="fetching", downloads=downloads), bars))
    text = "\n".join(lines)
    assert "downloading" in text and "0-0-8.safetensors" in text and " 25%" in text and "3.0/12.0 MiB" in text
    assert {len(x) for x in lines[1:]} == {VIEW_WIDTH}
    # in a plain line: the same, as words
    line = plain_line(status(downloads=downloads))
    assert "downloading 0-0-8.safetensors 25% of 12.0 MiB" in line
    transfers.finish(t)
    bars.update(transfers.running())
    assert bars.empty and transfers.running() == []


def test_plain_download_lines_start_step_by_a_quarter_and_end() -> None:
    lines: list[str] = []
    clock = [0.0]
    transfers = Transfers(PlainTransferLog(lines.append, prefix="[v] "), clock=lambda: clock[0], min_interval_s=0)
    with transfers.transfer("s.safetensors", total=100 << 20) as t:
        for _ in range(100):
            clock[0] += 0.01
            t.advance(1 << 20)
    assert lines == [
        "[v] downloading s.safetensors (100.0 MiB)",
        "[v] downloading s.safetensors: 25% (25.0 MiB of 100.0 MiB, 100.0 MiB/s)",
        "[v] downloading s.safetensors: 50% (50.0 MiB of 100.0 MiB, 100.0 MiB/s)",
        "[v] downloading s.safetensors: 75% (75.0 MiB of 100.0 MiB, 100.0 MiB/s)",
        "[v] downloaded s.safetensors: 100.0 MiB in 1.0 s (100.0 MiB/s)",
    ]
    with pytest.raises(OSError), transfers.transfer("t.safetensors", total=10) as t:
        t.advance(4)
        raise OSError("cut")
    assert lines[-1] == "[v] download of t.safetensors stopped at 4 B of 10 B"


def test_off_a_terminal_the_view_writes_plain_lines_only() -> None:
    out = io.StringIO()
    transfers = Transfers(min_interval_s=0)
    view = VolunteerView(transfers, live=False, stream=out, interval_s=5.0, prefix="[volunteer alice] ")
    assert not view.live
    view.show(status(), now=0.0)
    view.show(status(), now=1.0)  # within the interval: nothing
    with transfers.transfer("0-0-8.safetensors", total=8) as t:
        t.advance(8)
    view.show(status(calls=9), now=5.0)
    view.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("[volunteer alice's desk (") and "calls 9" in lines[3]
    assert lines[1] == "[volunteer alice] downloading 0-0-8.safetensors (8 B)"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_transfer_views_measure_what_this_attempt_moved() -> None:
    v = TransferView(1, "x", done=60, total=100, elapsed_s=2.0, resumed=20)
    assert v.rate == 20.0 and v.fraction == 0.6
