"""What a person watching a volunteer sees (shell: stderr; the renderers are ``volunteer.status``'s).

Rules:
- On a terminal (stderr is a TTY, and ``--no-progress`` not given): one rich live view, redrawn by
  the daemon's loop (no refresh thread of its own), ``VIEW_WIDTH`` columns wide whatever it holds,
  running downloads drawn as progress bars inside it. Log records go above the view (the root
  logger's stderr handlers write through the live display while it runs), so nothing stacks or tears.
- Anywhere else (a log file, a pipe, systemd's journal): plain lines only -- the status line every
  ``status_interval_s`` and one line per download at start, every 25 % and end (no ``\\r``, no escape
  sequence).
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

from swarm.progress import PlainTransferLog, TransferBars, Transfers
from volunteer.status import VolunteerStatus, plain_line, render_table

__all__ = ["VolunteerView"]


class VolunteerView:
    """The live view on a terminal, plain lines elsewhere (see the module rules)."""

    def __init__(self, transfers: Transfers, *, live: bool, download_lines: bool = True, stream: IO[str] | None = None,
                 interval_s: float = 5.0, prefix: str = "[volunteer] ") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.transfers = transfers
        self.interval_s = interval_s
        self.bars = TransferBars()
        self._live: Any = None
        self._handlers: list[tuple[logging.StreamHandler[Any], IO[str]]] = []
        self._last_line: float | None = None
        if live:
            self._start_live()
        elif download_lines:
            transfers.on_change = PlainTransferLog(self._print, prefix=prefix)

    @property
    def live(self) -> bool:
        return self._live is not None

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self._live = Live(console=Console(file=self.stream), auto_refresh=False, transient=False,
                          redirect_stdout=True, redirect_stderr=True)
        self._live.start()
        # the handlers set up before (logging.basicConfig) hold the real stderr: point them at the live
        # display's proxy (what sys.stderr is now) so a record prints above the view, not through it
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in (sys.__stderr__, self.stream):
                old = h.setStream(sys.stderr)
                if old is not None:
                    self._handlers.append((h, old))

    def show(self, status: VolunteerStatus, now: float) -> None:
        """Redraw (live) or, every ``interval_s``, log the status line."""
        if self._live is not None:
            self.bars.update(self.transfers.running())
            self._live.update(render_table(status, self.bars), refresh=True)
        elif self._last_line is None or now - self._last_line >= self.interval_s:
            self._last_line = now
            self._print(plain_line(status))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        for h, old in self._handlers:
            h.setStream(old)
        self._handlers.clear()
