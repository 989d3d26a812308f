"""Download progress as data, drawn by rich on a terminal or logged as plain lines (shell helpers).

Rules:
- A ``Transfer`` counts one download's bytes (``done`` of ``total``; ``total`` None while unknown). The
  downloader only counts; ``Transfers`` keeps the running ones and tells one listener (``on_change``)
  when a transfer starts, moves (at most every ``min_interval_s`` per transfer) and ends. Counting is
  thread-safe: huggingface_hub counts from a worker thread.
- Nothing here draws by itself. ``TransferBars`` turns the running transfers into rich progress
  bars for a view that redraws (the volunteer's live view, ``show_transfers`` on a terminal);
  ``PlainTransferLog`` writes one line when a download starts, at every ``step`` of it (25 %: no
  ``\\r``, nothing a log file cannot hold) and when it ends.
- ``show_transfers`` picks one of the two for a stream: bars while it is a terminal, lines otherwise;
  the bars are redrawn from the counting calls (no refresh thread) and cleared at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

__all__ = ["PlainTransferLog", "Transfer", "TransferBars", "TransferView", "Transfers", "human_bytes", "show_transfers"]

Event = Literal["start", "move", "end", "fail"]


def human_bytes(n: float) -> str:
    """``12.0 MiB``: binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


@dataclass(frozen=True)
class TransferView:
    """A transfer as of now (``rate``: bytes per second since it started)."""

    key: int  # the transfer's own number (its name may change: the source it reads from)
    name: str
    done: int
    total: int | None
    elapsed_s: float
    resumed: int = 0  # bytes already there when it started (a resumed download)

    @property
    def rate(self) -> float:
        return (self.done - self.resumed) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def fraction(self) -> float | None:
        return None if not self.total else min(1.0, self.done / self.total)


class Transfer:
    """One download's byte counter (see the module rules)."""

    def __init__(self, owner: Transfers, key: int, name: str, total: int | None, done: int, now: float) -> None:
        self._owner = owner
        self.key = key
        self.name = name
        self.total = total
        self.done = done
        self.resumed = done
        self.started = now
        self.reported = now

    def advance(self, n: int) -> None:
        self._owner._advance(self, n)

    def set_total(self, total: int | None, done: int | None = None) -> None:
        """The size became known (a response's length), or the download restarted at ``done``."""
        self._owner._reset(self, total, done)

    def rename(self, name: str) -> None:
        """What it is called now (e.g. the source it reads from changed)."""
        self.name = name

    def view(self, now: float) -> TransferView:
        return TransferView(self.key, self.name, self.done, self.total, max(0.0, now - self.started), self.resumed)


class Transfers:
    """The running transfers of a process, and who hears of them."""

    def __init__(self, on_change: Callable[[TransferView, Event], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic, min_interval_s: float = 0.1) -> None:
        self.on_change = on_change
        self._clock = clock
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._running: list[Transfer] = []
        self._keys = itertools.count(1)

    def start(self, name: str, total: int | None = None, done: int = 0) -> Transfer:
        with self._lock:
            t = Transfer(self, next(self._keys), name, total, done, self._clock())
            self._running.append(t)
        self._tell(t, "start")
        return t

    def finish(self, t: Transfer, *, ok: bool = True) -> None:
        with self._lock:
            if t not in self._running:
                return
            self._running.remove(t)
        self._tell(t, "end" if ok else "fail")

    @contextlib.contextmanager
    def transfer(self, name: str, total: int | None = None, done: int = 0) -> Iterator[Transfer]:
        """A transfer that ends with the block (``fail`` when the block raises)."""
        t = self.start(name, total, done)
        ok = False
        try:
            yield t
            ok = True
        finally:
            self.finish(t, ok=ok)

    def running(self) -> list[TransferView]:
        now = self._clock()
        with self._lock:
            return [t.view(now) for t in self._running]

    def _advance(self, t: Transfer, n: int) -> None:
        now = self._clock()
        with self._lock:
            t.done += n
            due = now - t.reported >= self._min_interval_s
            if due:
                t.reported = now
        if due:
            self._tell(t, "move")

    def _reset(self, t: Transfer, total: int | None, done: int | None) -> None:
        with self._lock:
            t.total = total
            if done is not None:
                t.done = t.resumed = done
                t.started = self._clock()
        self._tell(t, "move")

    def _tell(self, t: Transfer, event: Event) -> None:
        if self.on_change is not None:
            self.on_change(t.view(self._clock()), event)


class PlainTransferLog:
    """``on_change`` for a log: a line when a download starts, at every ``step`` of it and when it ends."""

    def __init__(self, write: Callable[[str], None], *, step: float = 0.25, prefix: str = "") -> None:
        self.write = write
        self.step = step
        self.prefix = prefix
        self._marks: dict[int, int] = {}

    def __call__(self, v: TransferView, event: Event) -> None:
        size = human_bytes(v.total) if v.total is not None else "size unknown"
        if event == "start":
            self._marks[v.key] = int((v.fraction or 0.0) / self.step)
            resumed = f", resuming at {human_bytes(v.done)}" if v.done else ""
            self.write(f"{self.prefix}downloading {v.name} ({size}{resumed})")
        elif event == "move":
            f = v.fraction
            if f is None:
                return
            mark = int(f / self.step)
            if mark > self._marks.get(v.key, 0) and f < 1.0:
                self._marks[v.key] = mark
                self.write(f"{self.prefix}downloading {v.name}: {f:.0%} ({human_bytes(v.done)} of {size}, "
                           f"{human_bytes(v.rate)}/s)")
        else:
            self._marks.pop(v.key, None)
            if event == "end":
                self.write(f"{self.prefix}downloaded {v.name}: {human_bytes(v.done)} in {v.elapsed_s:.1f} s "
                           f"({human_bytes(v.rate)}/s)")
            else:
                self.write(f"{self.prefix}download of {v.name} stopped at {human_bytes(v.done)} of {size}")


class TransferBars:
    """Rich progress bars of the running transfers (a renderable: ``bars.update(views)`` then draw ``bars``)."""

    def __init__(self, *, bar_width: int = 24, name_width: int = 28) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn(f"{{task.description:<{name_width}.{name_width}}}"), BarColumn(bar_width=bar_width),
            TextColumn("{task.percentage:>3.0f}%"), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(compact=True), auto_refresh=False, expand=False)
        self._tasks: dict[int, Any] = {}

    def update(self, views: list[TransferView]) -> None:
        keys = {v.key for v in views}
        for key in [k for k in self._tasks if k not in keys]:
            self._progress.remove_task(self._tasks.pop(key))
        for v in views:
            task = self._tasks.get(v.key)
            if task is None:
                self._tasks[v.key] = self._progress.add_task(v.name, total=v.total, completed=v.done)
            else:
                self._progress.update(task, description=v.name, total=v.total, completed=v.done)

    @property
    def empty(self) -> bool:
        return not self._tasks

    def __rich__(self) -> Any:
        return self._progress.get_renderable()


@contextlib.contextmanager
def show_transfers(stream: IO[str] | None = None, *, prefix: str = "") -> Iterator[Transfers]:
    """Transfers shown on ``stream`` (stderr by default): rich bars redrawn as bytes arrive while it is
    a terminal, plain lines otherwise."""
    out = stream if stream is not None else sys.stderr
    if not out.isatty():
        yield Transfers(PlainTransferLog(lambda line: print(line, file=out, flush=True), prefix=prefix))
        return
    from rich.console import Console
    from rich.live import Live

    bars = TransferBars()
    live = Live(bars, console=Console(file=out), auto_refresh=False, transient=True, redirect_stdout=False,
                redirect_stderr=False)
    lock = threading.Lock()
    transfers = Transfers()

    def redraw(v: TransferView, event: Event) -> None:
        with lock:
            bars.update(transfers.running())
            live.refresh()
        if event in ("end", "fail"):
            PlainTransferLog(lambda line: live.console.print(line, highlight=False), prefix=prefix)(v, event)

    transfers.on_change = redraw
    with live:
        yield transfers
