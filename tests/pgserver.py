"""A throwaway PostgreSQL server for the tests (Debian's ``postgresql`` package: ``initdb``, ``postgres``).

Rules:
- ``find_bindir()`` looks for ``postgres`` and ``initdb`` on PATH, then in ``/usr/lib/postgresql/*/bin``
  (newest first); ``None`` when absent: the PostgreSQL tests then skip, saying so.
- ``PgServer.start()`` runs ``initdb`` in a fresh temporary directory (``/tmp/moe-swarm-pg-*``: trust
  authentication, user ``postgres``, UTF-8, C locale, no fsync) and ``postgres`` on a free loopback port,
  its unix socket in the same directory; it returns once a connection succeeds (polled with a deadline)
  or raises with the server's log. PostgreSQL refuses to run as root: as root the directory is given to
  ``nobody`` and both programs run as ``nobody`` (``subprocess``'s ``user=``/``group=``; no ``runuser``
  or ``su`` needed), which is what CI (root in a container) does.
- ``database()`` creates a new empty database and returns its URL; ``restart()`` stops and starts the
  server on the same port and data (``halt()`` and ``resume()``: the two halves, for an outage); ``stop()`` ends it (fast shutdown, SIGKILL after 30 s) and removes
  the directory.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["PgServer", "find_bindir"]


def find_bindir() -> Path | None:
    postgres, initdb = shutil.which("postgres"), shutil.which("initdb")
    if postgres and initdb and Path(postgres).resolve().parent == Path(initdb).resolve().parent:
        return Path(postgres).resolve().parent
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]) if
                    p.split("/")[-2].isdigit() else 0, reverse=True):
        if (Path(d) / "postgres").is_file() and (Path(d) / "initdb").is_file():
            return Path(d)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.base = Path(tempfile.mkdtemp(prefix="moe-swarm-pg-"))
        self.data = self.base / "data"
        self.sock = self.base / "sock"
        self.log = self.base / "postgres.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._n = itertools.count(1)
        self._as: dict[str, Any] = {}
        self.sock.mkdir()
        if os.geteuid() == 0:  # postgres refuses root
            nobody = pwd.getpwnam("nobody")
            self._as = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
            for d in (self.base, self.sock):
                os.chown(d, nobody.pw_uid, nobody.pw_gid)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, dbname: str, *, password: str | None = None) -> str:
        auth = f"postgres:{password}" if password is not None else "postgres"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        subprocess.run([str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                        "--locale=C", "--no-sync"], check=True, capture_output=True, cwd=self.base, timeout=120,
                       **self._as)
        self.port = _free_port()
        self._run()

    def _run(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
                 "-k", str(self.sock), "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.base, **self._as)
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(self.admin_url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not start:\n{self.log.read_text(errors='replace')[-3000:]}") from None
                time.sleep(0.05)

    def database(self) -> str:
        name = f"t{next(self._n)}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def _halt(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: sessions are ended, committed data kept
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
            self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port and data (a database restarted mid-run)."""
        self._halt()
        self._run()

    def halt(self) -> None:
        """Stop the server, keeping its data (``resume`` starts it again on the same port)."""
        self._halt()

    def resume(self) -> None:
        self._run()

    def stop(self) -> None:
        self._halt()
        shutil.rmtree(self.base, ignore_errors=True)
