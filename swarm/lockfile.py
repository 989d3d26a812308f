"""One process per data directory or database (shell: an advisory ``flock`` on a lock file).

Rules:
- A daemon takes ``hold(...)`` before it touches its data dir (identity key, restart epoch, slices,
  status socket) or its database, and keeps it for its whole life. A second process asking for the
  same lock gets a ``ConfigError`` (code ``data_dir_in_use``) naming the holder's PID and the flag
  that gives it a place of its own; it has changed nothing.
- The kernel drops the lock when its holder ends in any way (exit, crash, SIGKILL): a lock file a
  dead process left behind is no obstacle -- the lock is the ``flock``, not the file's existence.
  The file is never deleted (deleting a locked file would let two holders lock two inodes).
- The file holds the holder's PID, for the message only; readers of the data dir
  (``moe-swarm volunteer status``) never take the lock.
- ``flock`` locks belong to an open file, so two holders in one process exclude each other too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from swarm.errors import ConfigError

__all__ = ["LOCK_NAME", "hold", "holder_pid"]

LOCK_NAME = "lock"  # in a data dir; a database's lock is "<file>.lock" beside it


def holder_pid(lock_path: Path) -> int | None:
    """The PID written in ``lock_path`` (None when unreadable or empty)."""
    try:
        text = lock_path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def hold(lock_path: Path, *, flag: str, shown: str, what: str) -> Iterator[Path]:
    """Hold the exclusive lock ``lock_path`` (its directory created) while the block runs.

    ``flag`` and ``shown`` name what the person gave (``--data-dir``, the path), ``what`` the kind of
    daemon (``volunteer``), for the message when another process holds it."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"{flag} {shown}: cannot create {lock_path} ({exc.strerror}); give a {flag} this user "
                          "can write", code="data_dir_unusable") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            pid = f"pid {raw}" if raw.isdigit() else "a process that is just starting"
            raise ConfigError(f"{flag} {shown} is in use by another moe-swarm {what} ({pid}); stop it, or give this "
                              f"one its own {flag}", code="data_dir_in_use") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield lock_path
    finally:
        os.close(fd)  # releases the lock
