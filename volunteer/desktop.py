"""The volunteer as a guest on its owner's desktop (shell: /proc, a file, trio; the decisions are
``volunteer.core.preferences``).

Rules:
- ``ProcIdleSource`` reads what ``--only-when-idle`` needs from /proc: keyboard and mouse activity as
  the interrupt count of input devices in /proc/interrupts (lines naming i8042, keyboard, mouse,
  touchpad or hid: PS/2 and I2C/USB HID devices; a USB device that shares its host controller's
  interrupt line is not seen -- then the reading is None and does not pause), and other programs'
  CPU use as the machine's busy jiffies in /proc/stat less this process's own (/proc/self/stat), as a
  share of all CPUs since the previous reading.
- ``Pauser`` samples the source every ``sample_s`` (only with ``--only-when-idle``), decides with the
  local time of day, and hands every change of verdict to ``on_change`` at once. A manual pause
  (``moe-swarm volunteer pause``) is kept in ``DATA_DIR/paused`` so it outlives a restart (of the
  service, of the machine) until ``resume``.
- ``DutyCycle`` holds ``--cpu-limit``'s duty cycle: after a computation of ``t`` seconds the next one
  starts no sooner than ``rest_after(t, duty)`` later (calls that overlap share one rest).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import torch
import trio

from swarm.protocol.expert import ExpertRequest, Pairs
from swarm.rpc.server import Computed
from volunteer.core.preferences import ActivityTracker, Decision, IdleReading, Preferences, decide, rest_after

__all__ = ["DutyCycle", "IdleSource", "Pauser", "ProcIdleSource", "local_minute_of_day"]

log = logging.getLogger(__name__)

_INPUT = re.compile(r"i8042|keyboard|mouse|touchpad|hid", re.IGNORECASE)


class IdleSource(Protocol):
    def read(self) -> tuple[int | None, float | None]:
        """(input event count, other programs' CPU share since the last read); None: not readable."""
        ...


class ProcIdleSource:
    """Keyboard/mouse interrupts and other programs' CPU share, from /proc (see the module rules)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._last: tuple[int, int, int] | None = None  # (total, busy, ours) jiffies

    def input_count(self) -> int | None:
        try:
            text = (self.proc / "interrupts").read_text()
        except OSError:
            return None
        total, seen = 0, False
        for line in text.splitlines()[1:]:
            label, _, rest = line.partition(":")
            if not label.strip() or not _INPUT.search(rest):
                continue
            seen = True
            for field in rest.split():
                if not field.isdigit():
                    break
                total += int(field)
        return total if seen else None

    def _jiffies(self) -> tuple[int, int, int] | None:
        try:
            cpu = (self.proc / "stat").read_text().split("\n", 1)[0].split()
            own = (self.proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        if not cpu or cpu[0] != "cpu" or len(cpu) < 8:
            return None
        v = [int(x) for x in cpu[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
        total = sum(v)
        busy = total - v[3] - v[4]
        ours = sum(int(x) for x in own[11:15])  # utime stime cutime cstime (fields 14-17)
        return total, busy, ours

    def others_cpu(self) -> float | None:
        now = self._jiffies()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0])

    def read(self) -> tuple[int | None, float | None]:
        return self.input_count(), self.others_cpu()


def local_minute_of_day() -> int:
    t = time.localtime()
    return t.tm_hour * 60 + t.tm_min


class Pauser:
    """Run or pause, from the owner's preferences and a manual pause (see the module rules)."""

    def __init__(self, prefs: Preferences, data_dir: Path, on_change: Callable[[Decision], None], *,
                 source: IdleSource | None = None, sample_s: float = 2.0,
                 minute_of_day: Callable[[], int] = local_minute_of_day) -> None:
        self.prefs = prefs
        self.flag = data_dir / "paused"
        self.on_change = on_change
        self.source = source if source is not None else (ProcIdleSource() if prefs.idle_s is not None else None)
        self.sample_s = sample_s
        self.minute_of_day = minute_of_day
        self.tracker = ActivityTracker(busy_fraction=prefs.busy_fraction)
        self.manual = self.flag.exists()
        self.decision = Decision(True)
        self._reading: IdleReading | None = None

    def command(self, cmd: str) -> None:
        """``pause`` or ``resume`` (the status socket's commands); the verdict follows at once."""
        if cmd not in ("pause", "resume"):
            raise ValueError(f"unknown command {cmd!r}")
        self.manual = cmd == "pause"
        if self.manual:
            self.flag.write_text("paused by its owner: moe-swarm volunteer resume\n")
        else:
            self.flag.unlink(missing_ok=True)
        self.evaluate()

    def evaluate(self) -> Decision:
        d = decide(self.minute_of_day(), self._reading, self.prefs, self.manual)
        if d != self.decision:
            old, self.decision = self.decision, d
            if d.run != old.run or d.reason != old.reason:
                self.on_change(d)
        return d

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.evaluate()
        task_status.started()
        while True:
            if self.source is not None and self.prefs.idle_s is not None:
                count, others = await trio.to_thread.run_sync(self.source.read)
                self._reading = self.tracker.observe(trio.current_time(), count, others)
            self.evaluate()
            await trio.sleep(self.sample_s)


Handler = Callable[[ExpertRequest, torch.Tensor, Pairs], Awaitable[Computed]]


class DutyCycle:
    """An expert handler that rests after computing, to hold ``duty`` (see the module rules)."""

    def __init__(self, handler: Handler, duty: float) -> None:
        self.handler = handler
        self.duty = duty
        self.resume_at = 0.0

    async def __call__(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> Computed:
        await trio.sleep_until(self.resume_at)
        out = await self.handler(req, rows, pairs)
        self.resume_at = max(self.resume_at, trio.current_time() + rest_after(out.compute_s, self.duty))
        return out
