"""The volunteer's own view (shell: a Unix socket; the renderers are pure).

``VolunteerStatus`` is what a running pull volunteer knows of itself: what it serves, how it is
reached, what it computed, what the market credits it, and what it is waiting for. It is served
as JSON on a Unix socket in the data dir (``status.sock``, mode 0600: its owner only) to
``moe-swarm volunteer status``, and drawn on a terminal (rich, ``volunteer.view``) or logged as a plain
line every ``status_interval_s`` when not on one.

Rules of the renderers: the table is ``VIEW_WIDTH`` columns whatever it holds (a narrower terminal's
width); every value is shown as text, never read as rich markup (a display name is the user's); labels
say what a number is -- the slices held (their bytes, of the slice budget) apart from the request bytes
in flight; running downloads appear as progress bars in the table, as words in the plain line.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import trio

__all__ = ["DownloadStatus", "SliceStatus", "StatusError", "VolunteerStatus", "plain_line", "read_status", "render_table",
           "serve_status"]

SOCKET_NAME = "status.sock"


class SliceStatus(msgspec.Struct, frozen=True):
    model_id: str
    slice: str  # layer:lo-hi
    state: str  # serving | draining | loading
    last_serve_ms: int


class DownloadStatus(msgspec.Struct, frozen=True):
    """A download running now: ``done`` of ``total`` bytes (``total`` None while unknown)."""

    name: str
    done: int
    total: int | None
    bytes_per_s: float = 0.0


class VolunteerStatus(msgspec.Struct, frozen=True, kw_only=True):
    peer_id: str
    market: str
    phase: str  # idle | fetching | serving | stopping
    waiting_for: str  # the lifecycle's own words: "idle: nothing_scarce", "downloading ...", ...
    market_reachable: bool
    reachability: str  # public | private | unknown
    path: str  # direct | relayed (how coordinators reach it: its advertised addresses)
    addrs: list[str]
    slices: list[SliceStatus]
    calls: int
    calls_per_s: float
    rows: int
    errors: int
    in_flight: int
    payload_bytes: int  # request bytes in flight now (the request budget in use), not the slices
    latency_ms: float = 0.0  # a call's time here, arrival to answer (EWMA)
    bytes_in: int = 0
    bytes_out: int = 0
    coordinators: list[str]  # the coordinators it answers
    credit_flops: float | None = None  # from the market (None: not known yet)
    credit_rac_flops_per_day: float | None = None
    verified: int | None = None
    uptime_s: float = 0.0
    downloaded: dict[str, int] = {}  # slice bytes by source ("peer 12D3...", "origin URL", "coordinator URL")
    shared_bytes: int = 0  # slice bytes sent to other volunteers
    display_name: str = ""  # --display-name: how the market's dashboard names it
    held_bytes: int = 0  # the slices held (loaded or loading): their file sizes
    slice_budget_bytes: int | None = None  # what the slices may take (None: a budget in experts only)
    downloads: list[DownloadStatus] = []  # running now
    paused: str = ""  # why its owner's preferences pause it now ("" while it runs: volunteer.core.preferences)
    pause_detail: str = ""  # the same in words
    cpu_limit: str = ""  # --cpu-limit as applied: threads and duty cycle ("" without one)


VIEW_WIDTH = 100  # the terminal view's width (narrower terminals: theirs), whatever it shows


def _flops(x: float | None) -> str:
    if x is None:
        return "?"
    units = ["", "k", "M", "G", "T", "P", "E"]
    i = 0
    while x >= 1000 and i < len(units) - 1:
        x /= 1000
        i += 1
    return f"{x:.1f} {units[i]}FLOP"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _name(s: VolunteerStatus) -> str:
    return f"{s.display_name} ({s.peer_id[-8:]})" if s.display_name else s.peer_id[-8:]


def held_text(s: VolunteerStatus) -> str:
    """The slices held and what they take: ``2 slices, 24.0 MiB of 2048.0 MiB``."""
    n = len(s.slices)
    budget = f" of {_mib(s.slice_budget_bytes)}" if s.slice_budget_bytes is not None else ""
    return f"{n} slice{'' if n == 1 else 's'}, {_mib(s.held_bytes)}{budget}"


def downloading_text(s: VolunteerStatus) -> str:
    """The running downloads in a few words: ``0:0-8.safetensors 42% of 12.0 MiB``."""
    parts = []
    for d in s.downloads:
        if d.total:
            parts.append(f"{d.name} {min(100.0, 100 * d.done / d.total):.0f}% of {_mib(d.total)}")
        else:
            parts.append(f"{d.name} {_mib(d.done)}")
    return "; ".join(parts)


def plain_line(s: VolunteerStatus) -> str:
    """One log line (not on a terminal): no ``\\r``, no control sequence."""
    sl = ",".join(f"{x.slice}:{x.state}" for x in s.slices) or "none"
    market = "" if s.market_reachable else " | market unreachable"
    dl = f" | downloading {downloading_text(s)}" if s.downloads else ""
    return (f"[volunteer {_name(s)}] {s.waiting_for} | slices {sl} ({held_text(s)}) | path {s.path} | calls {s.calls} "
            f"({s.calls_per_s:.1f}/s, {s.latency_ms:.1f} ms) rows {s.rows} | verified {s.verified if s.verified is not None else '?'} | "
            f"credit {_flops(s.credit_flops)}{dl}{market}")


def downloads_text(s: VolunteerStatus) -> str:
    """Where the slices came from, by kind of source, and what was shared: ``4.0 MiB from peers, ...``."""
    by: dict[str, int] = {}
    for name, n in s.downloaded.items():
        kind = name.split(" ", 1)[0]
        by[kind] = by.get(kind, 0) + n
    parts = [f"{n / 2**20:.1f} MiB from {kind}{'s' if kind in ('peer', 'origin') else ''}" for kind, n in sorted(by.items())]
    return f"{', '.join(parts) or 'nothing yet'}; shared {s.shared_bytes / 2**20:.1f} MiB"


def render_table(s: VolunteerStatus, bars: Any = None) -> object:
    """A one-screen rich renderable, ``VIEW_WIDTH`` columns whatever it holds (the terminal's width when
    narrower); ``bars``: the running downloads' progress bars (``swarm.progress.TransferBars``) to show
    inside it. Every value is plain text (a name or an address is never read as rich markup). ``rich``
    is imported here only: the status command and the terminal view."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(f"moe-swarm volunteer {_name(s)}"), show_header=False, width=VIEW_WIDTH, expand=False)
    t.add_column(style="bold", width=12, no_wrap=True)
    t.add_column(overflow="fold", ratio=1)
    slices = "\n".join(f"{x.model_id} {x.slice} ({x.state})" for x in s.slices) or "none"
    rows: list[tuple[str, object]] = [
        ("name", s.display_name or "(none: --display-name NAME names it on the market's dashboard)"),
        ("doing", s.waiting_for if s.market_reachable else f"{s.waiting_for} (market unreachable)"),
        ("market", s.market),
        ("slices", f"{slices}\n{held_text(s)} held"),
        ("path", f"{s.path} ({s.reachability}); answers {len(s.coordinators)} coordinator(s)"),
        ("calls", f"{s.calls} ({s.calls_per_s:.1f}/s), {s.in_flight} in flight, {s.errors} errors"),
        ("latency", f"{s.latency_ms:.1f} ms a call here"),
        ("rows", str(s.rows)),
        ("traffic", f"{_mib(s.bytes_in)} in, {_mib(s.bytes_out)} out; requests in flight: {_mib(s.payload_bytes)}"),
        ("downloads", downloads_text(s)),
        ("verified", "?" if s.verified is None else str(s.verified)),
        ("credit", f"{_flops(s.credit_flops)} total, {_flops(s.credit_rac_flops_per_day)} a day recently"),
        ("uptime", f"{s.uptime_s:.0f} s"),
    ]
    if s.cpu_limit:
        rows.insert(2, ("cpu limit", s.cpu_limit))
    if s.downloads:
        now: object = Text(downloading_text(s))
        if bars is not None and not getattr(bars, "empty", True):
            now = Group(bars)
        rows.insert(4, ("downloading", now))
    for k, v in rows:
        t.add_row(Text(k), Text(v) if isinstance(v, str) else v)  # type: ignore[arg-type]
    return t


COMMANDS = ("status", "pause", "resume")
_MAX_REQUEST = 256  # bytes of a command line


async def _read_command(stream: trio.SocketStream, timeout_s: float) -> str:
    """The command a client sent (one line, then end of its side); "status" from one that sends none."""
    data = b""
    with trio.move_on_after(timeout_s):
        while len(data) < _MAX_REQUEST and b"\n" not in data:
            chunk = await stream.receive_some(_MAX_REQUEST)
            if not chunk:
                break
            data += chunk
    return data.split(b"\n", 1)[0].decode("ascii", "replace").strip() or "status"


async def serve_status(data_dir: Path, snapshot: object, *, control: Callable[[str], None] | None = None,
                       command_timeout_s: float = 1.0,
                       task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer each connection on ``data_dir/status.sock``: read its command (``status``, ``pause``,
    ``resume``: one line; a client that sends nothing asks for the status), do it (``control``), then
    send ``snapshot()`` as JSON -- or ``{"error": ...}`` for a command it does not take -- and close.
    The socket is created owner-only (0600: only its owner may pause it) and removed when this returns."""
    path = data_dir / SOCKET_NAME
    if path.is_socket() or path.exists():
        path.unlink()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(8)
    listener = trio.SocketListener(sock)
    try:
        task_status.started(path)
        async with listener:
            while True:
                stream = await listener.accept()
                async with stream:
                    try:
                        cmd = await _read_command(stream, command_timeout_s)
                        if cmd not in COMMANDS or (cmd != "status" and control is None):
                            answer = msgspec.json.encode({"error": f"unknown command {cmd[:40]!r}: "
                                                                   f"{', '.join(COMMANDS if control else COMMANDS[:1])}"})
                        else:
                            if cmd != "status" and control is not None:
                                control(cmd)
                            answer = msgspec.json.encode(snapshot())  # type: ignore[operator]
                        await stream.send_all(answer)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
    finally:
        path.unlink(missing_ok=True)


class StatusError(Exception):
    """The volunteer refused the command (its message says why)."""


def read_status(data_dir: Path, timeout_s: float = 5.0, command: str = "status") -> VolunteerStatus:
    """Send ``command`` to the volunteer running in ``data_dir`` and return its status after it (blocking;
    ``OSError`` when none runs there, ``StatusError`` for a command it refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(data_dir / SOCKET_NAME))
        s.sendall(command.encode("ascii") + b"\n")
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(1 << 16):
            chunks.append(chunk)
    raw = msgspec.json.decode(b"".join(chunks))
    if isinstance(raw, dict) and set(raw) == {"error"}:
        raise StatusError(str(raw["error"]))
    return msgspec.convert(raw, VolunteerStatus)
