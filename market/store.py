"""Durable market state (shell: SQLite file I/O; the in-memory store does none).

A ``Store`` keeps the decision-grade facts (``market.core.records`` rows): models,
coordinators, volunteers (identity + epoch/sequence high-water mark), coverage, leases,
published dispatch-map versions and recruitment flags. Heartbeat times, loads and coordinator
polls are not stored: they are runtime state with TTLs.

Rules:
- ``apply(changes)`` is atomic: every put and delete of the batch lands, or none (and
  ``StoreError`` is raised). A put replaces the row with the same key; deleting a missing key is
  a no-op. Rows go through the same msgspec JSON encoding in both implementations, so the one
  conformance suite (``tests/integration/test_market_store.py``) covers the encoding too.
- ``load()`` returns every row, each table sorted by key.
- After ``close()`` every call raises ``StoreError`` (``store_closed``); ``close()`` is idempotent.
- SQLite: WAL journal, ``synchronous=NORMAL``: a committed batch survives the process being
  killed (the WAL is in the OS page cache); only an OS crash or power loss may lose the last
  few commits. Commits are small (one request's facts) and do not fsync, so the market calls the
  store on its event loop (the server opens it and loads it first in a worker thread); schema
  version in ``PRAGMA user_version``; a newer schema is refused.
- No I/O in constructors: ``open_sqlite_store(path)`` opens the file; ``market.stores.open_store(db)``
  picks the back-end from ``--db``: ``:memory:``, ``postgresql://...`` / ``postgres://...``
  (``market.store_pg``), ``sqlite:PATH`` or a plain path (SQLite).
- A database URL is shown only through ``mask_url`` (its password, in the authority or the query,
  becomes ``***``): no message, log line or exception names a password.
"""

from __future__ import annotations

import re
import sqlite3
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec

from market.core.records import (
    CoordinatorRow,
    CoverageRow,
    CreditRow,
    LeaseRow,
    MapRow,
    ModelRow,
    QuarantineRow,
    RecruitRow,
    Row,
    Snapshot,
    Table,
    VolunteerRow,
    row_key,
    row_table,
)
from swarm.errors import StoreError

__all__ = [
    "Change",
    "Delete",
    "MEMORY_DB",
    "InMemoryStore",
    "MemoryBacking",
    "Put",
    "SCHEMA_VERSION",
    "SqliteStore",
    "Store",
    "decode_row",
    "encode_changes",
    "is_postgres_url",
    "mask_url",
    "open_sqlite_store",
    "snapshot_of",
    "sqlite_path",
]

# 2 added the quarantine table, 3 the credit ledger; an older database moves forward on open (its new tables are created)
SCHEMA_VERSION: Final = 3


class Put(msgspec.Struct, frozen=True, tag=True):
    row: Row


class Delete(msgspec.Struct, frozen=True, tag=True):
    table: Table
    key: str


Change = Put | Delete


class Store(Protocol):
    def load(self) -> Snapshot: ...

    def apply(self, changes: Sequence[Change]) -> None: ...

    def close(self) -> None: ...


_ROW_TYPES: Final[dict[Table, type[Any]]] = {
    Table.MODELS: ModelRow,
    Table.COORDINATORS: CoordinatorRow,
    Table.VOLUNTEERS: VolunteerRow,
    Table.COVERAGE: CoverageRow,
    Table.LEASES: LeaseRow,
    Table.MAPS: MapRow,
    Table.RECRUITMENT: RecruitRow,
    Table.QUARANTINE: QuarantineRow,
    Table.CREDIT: CreditRow,
}
_encoder = msgspec.json.Encoder()
_decoders: Final = {t: msgspec.json.Decoder(cls) for t, cls in _ROW_TYPES.items()}


def encode_changes(changes: Sequence[Change]) -> list[tuple[Table, str, bytes | None]]:
    out: list[tuple[Table, str, bytes | None]] = []
    for c in changes:
        match c:
            case Put(row=row):
                out.append((row_table(row), row_key(row), _encoder.encode(row)))
            case Delete(table=table, key=key):
                out.append((Table(table), key, None))
            case _:
                raise TypeError(f"not a store change: {type(c).__name__}")
    return out


def decode_row(table: Table, key: str, body: bytes) -> Any:
    try:
        return _decoders[table].decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise StoreError(f"{table} row {key!r} is unreadable: {exc}", code="store_corrupt") from exc


def snapshot_of(rows: dict[Table, list[Any]]) -> Snapshot:
    return Snapshot(
        models=rows[Table.MODELS],
        coordinators=rows[Table.COORDINATORS],
        volunteers=rows[Table.VOLUNTEERS],
        coverage=rows[Table.COVERAGE],
        leases=rows[Table.LEASES],
        maps=rows[Table.MAPS],
        recruitment=rows[Table.RECRUITMENT],
        quarantine=rows[Table.QUARANTINE],
        credit=rows[Table.CREDIT],
    )


class MemoryBacking:
    """The "disk" of an ``InMemoryStore``: survives closing the store, so tests can restart on it."""

    def __init__(self) -> None:
        self.tables: dict[Table, dict[str, bytes]] = {t: {} for t in Table}


class InMemoryStore:
    """A ``Store`` in a dict (tests, benchmarks, ``--db :memory:``)."""

    def __init__(self, backing: MemoryBacking | None = None) -> None:
        self.backing = backing if backing is not None else MemoryBacking()
        self._closed = False
        self.commits = 0

    def _check(self) -> None:
        if self._closed:
            raise StoreError("store is closed", code="store_closed")

    def load(self) -> Snapshot:
        self._check()
        return snapshot_of(
            {t: [decode_row(t, k, v) for k, v in sorted(rows.items())] for t, rows in self.backing.tables.items()}
        )

    def apply(self, changes: Sequence[Change]) -> None:
        self._check()
        encoded = encode_changes(changes)  # validate everything before touching anything: all or nothing
        for table, key, body in encoded:
            if body is None:
                self.backing.tables[table].pop(key, None)
            else:
                self.backing.tables[table][key] = body
        if encoded:
            self.commits += 1

    def close(self) -> None:
        self._closed = True


class SqliteStore:
    """A ``Store`` in one SQLite file (WAL). Use ``open_sqlite_store``; one thread at a time."""

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self.commits = 0

    def _c(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError("store is closed", code="store_closed")
        return self._conn

    def load(self) -> Snapshot:
        conn = self._c()
        rows: dict[Table, list[Any]] = {}
        try:
            for t in Table:
                rows[t] = [decode_row(t, k, b) for k, b in conn.execute(f"SELECT key, body FROM {t.value} ORDER BY key")]
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read {self.path}: {exc}") from exc
        return snapshot_of(rows)

    def apply(self, changes: Sequence[Change]) -> None:
        conn = self._c()
        encoded = encode_changes(changes)
        if not encoded:
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for table, key, body in encoded:
                    if body is None:
                        conn.execute(f"DELETE FROM {table.value} WHERE key = ?", (key,))
                    else:
                        conn.execute(f"INSERT OR REPLACE INTO {table.value} (key, body) VALUES (?, ?)", (key, body))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite rolls back by itself on some errors (SQLITE_FULL)
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write {self.path}: {exc}") from exc
        self.commits += 1

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot close {self.path}: {exc}") from exc


def open_sqlite_store(path: str | Path) -> SqliteStore:
    """Open (creating if needed) the market database at ``path`` in WAL mode."""
    p = str(path)
    if p != ":memory:":
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    try:
        # check_same_thread off: the server opens it in a worker thread, then calls it from the trio thread
        # (one thread at a time, never concurrently)
        conn = sqlite3.connect(p, isolation_level=None, timeout=5.0, check_same_thread=False)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open market database {p}: {exc}", code="store_unavailable") from exc
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"market database {p} has schema {version}, this market knows up to {SCHEMA_VERSION}",
                code="store_schema",
            )
        conn.execute("BEGIN IMMEDIATE")
        for t in Table:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {t.value} (key TEXT PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(f"cannot open market database {p}: {exc}", code="store_unavailable") from exc
    except StoreError:
        conn.close()
        raise
    return SqliteStore(conn, p)


MEMORY_DB: Final = ":memory:"
_PG_SCHEMES: Final = ("postgresql://", "postgres://")


def is_postgres_url(db: str) -> bool:
    return db.startswith(_PG_SCHEMES)


def sqlite_path(db: str) -> str:
    """The SQLite file ``db`` names: ``sqlite:PATH`` or a plain path."""
    return db.removeprefix("sqlite:")


def mask_url(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@`` or ``?password=``) shown as ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return re.sub(r"(//[^/@:]*:)[^@/]*@", r"\1***@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        if ":" in userinfo:
            netloc = userinfo.split(":", 1)[0] + ":***@" + hostport
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
