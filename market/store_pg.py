"""The market's ``Store`` in a PostgreSQL database (shell: psycopg 3 + psycopg-pool; blocking calls).

Same contract as ``market.store`` (the one conformance suite runs on all three back-ends): ``apply`` is
one transaction, ``load`` returns every row sorted by key, a closed store raises ``store_closed``.

Rules:
- Layout: the SQLite one (one table per ``market.core.records.Table``, ``key text PRIMARY KEY, body
  bytea NOT NULL``, bodies the same msgspec JSON) plus ``market_schema (id = 1, version)``; rows move
  between the two byte for byte (``market.migrate``). Tables live in the connection's current schema
  (``?options=-csearch_path%3DNAME`` in the URL picks another).
- Opening (``open_postgres_store``) connects once directly, so an unreachable server, a bad URL or a
  refused login is one clear ``StoreError`` (``store_unavailable``) naming the URL with its password
  masked; then, under a transaction-scoped advisory lock (two markets starting at once do not race on
  ``CREATE TABLE``), checks the schema: a newer ``version`` -> ``store_schema`` naming both versions;
  a table of ours with other columns (not a market database, or a damaged one) -> ``store_schema``;
  otherwise creates what is missing and records ``SCHEMA_VERSION``.
- One market per database until replicas are supported (issue 29): the opening connection stays open
  holding a session advisory lock (``pg_try_advisory_lock``) for the store's life; a second market (or
  a ``migrate`` into it) is refused with ``store_in_use``. The lock goes with the connection, also when
  the process is killed.
- Reads and writes go through a small ``psycopg_pool.ConnectionPool`` whose connections are checked
  before use (``check_connection``): after a database restart the next call reconnects instead of
  failing on a dead socket. A call that cannot get a connection within ``timeout_s`` raises
  ``StoreError``; the caller (``market.state``) rolls its memory back.
- ``close()`` closes the pool and the lock connection; idempotent.
- Calls block: the market opens and first loads in a worker thread (``market.server``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from market.core.records import Snapshot, Table
from market.store import SCHEMA_VERSION, Change, decode_row, encode_changes, mask_url, snapshot_of
from swarm.errors import StoreError

__all__ = ["PostgresStore", "open_postgres_store"]

SCHEMA_TABLE: Final = "market_schema"
_SETUP_LOCK: Final = 0x6D6F65_0001  # pg_advisory_xact_lock key while creating / checking tables
_MARKET_LOCK: Final = 0x6D6F65_0002  # pg_try_advisory_lock key held by the one market of a database
_COLUMNS: Final = {"key": "text", "body": "bytea"}


def _one_line(exc: BaseException, url: str) -> str:
    """``exc``'s message on one line, with ``url`` and any password in it masked."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text.replace(url, mask_url(url))
    m = re.search(r"//[^/@:]*:([^@/]+)@", url)
    if m:
        text = text.replace(m.group(1), "***")
    return text


def _tables() -> list[Table]:
    return list(Table)


class PostgresStore:
    """A ``Store`` in PostgreSQL. Use ``open_postgres_store``; calls from one thread at a time."""

    def __init__(self, url: str, lock_conn: psycopg.Connection[Any], pool: ConnectionPool[Any]) -> None:
        self.url = url
        self.shown = mask_url(url)
        self._lock_conn: psycopg.Connection[Any] | None = lock_conn
        self._pool: ConnectionPool[Any] | None = pool
        self._mutex = threading.Lock()
        self.commits = 0

    def _p(self) -> ConnectionPool[Any]:
        if self._pool is None:
            raise StoreError("store is closed", code="store_closed")
        return self._pool

    def raw(self) -> dict[Table, list[tuple[str, bytes]]]:
        """Every ``(key, body)`` as stored, sorted by key (``market.migrate`` compares them)."""
        return raw_rows(self._p(), self.url)

    def load(self) -> Snapshot:
        rows: dict[Table, list[Any]] = {}
        for t, got in self.raw().items():
            rows[t] = [decode_row(t, k, b) for k, b in got]
        return snapshot_of(rows)

    def apply(self, changes: Sequence[Change]) -> None:
        pool = self._p()
        encoded = encode_changes(changes)
        if not encoded:
            return
        try:
            with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
                i = 0
                while i < len(encoded):  # runs of one table and one kind: one executemany (pipelined) each
                    table, _, body = encoded[i]
                    j = i
                    while j < len(encoded) and encoded[j][0] is table and (encoded[j][2] is None) == (body is None):
                        j += 1
                    name = sql.Identifier(table.value)
                    if body is None:
                        cur.executemany(sql.SQL("DELETE FROM {} WHERE key = %s").format(name),
                                        [(k,) for _, k, _ in encoded[i:j]])
                    else:
                        cur.executemany(sql.SQL("INSERT INTO {} (key, body) VALUES (%s, %s) ON CONFLICT (key) "
                                                "DO UPDATE SET body = EXCLUDED.body").format(name),
                                        [(k, b) for _, k, b in encoded[i:j]])
                    i = j
        except psycopg.Error as exc:
            raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc
        self.commits += 1

    def write_raw(self, rows: dict[Table, list[tuple[str, bytes]]]) -> None:
        """Insert ``rows`` as they are (``market.migrate``) in one transaction; the tables must be empty."""
        try:
            with self._p().connection() as conn, conn.transaction(), conn.cursor() as cur:
                for t in _tables():
                    cur.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(t.value)))
                    got = cur.fetchone()
                    if got is not None and got[0]:
                        raise StoreError(f"market database {self.shown} already holds {got[0]} {t.value} rows: migrate "
                                         "into an empty database", code="store_not_empty")
                for t, items in rows.items():
                    cur.executemany(sql.SQL("INSERT INTO {} (key, body) VALUES (%s, %s)").format(sql.Identifier(t.value)),
                                    list(items))
        except psycopg.Error as exc:
            raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc

    def close(self) -> None:
        with self._mutex:
            pool, self._pool = self._pool, None
            lock_conn, self._lock_conn = self._lock_conn, None
        try:
            if pool is not None:
                pool.close()
        finally:
            if lock_conn is not None:
                lock_conn.close()


def raw_rows(pool: ConnectionPool[Any], url: str) -> dict[Table, list[tuple[str, bytes]]]:
    """Every ``(key, body)`` of every table, sorted by key (code point order, as ``sorted``), in one
    repeatable-read snapshot."""
    try:
        with pool.connection() as conn:
            return _read_all(conn)
    except psycopg.Error as exc:
        raise StoreError(f"cannot read market database {mask_url(url)}: {_one_line(exc, url)}") from exc


def _read_all(conn: psycopg.Connection[Any]) -> dict[Table, list[tuple[str, bytes]]]:
    out: dict[Table, list[tuple[str, bytes]]] = {}
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        for t in _tables():
            cur.execute(sql.SQL("SELECT key, body FROM {}").format(sql.Identifier(t.value)))
            out[t] = sorted((str(k), bytes(b)) for k, b in cur.fetchall())
    return out


def _check_schema(conn: psycopg.Connection[Any], shown: str) -> None:
    """Create what is missing, refuse a newer or foreign layout (module rules). In a transaction."""
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SETUP_LOCK,))
    names = [SCHEMA_TABLE, *(t.value for t in _tables())]
    found: dict[str, dict[str, str]] = {}
    for table, column, dtype in conn.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = ANY(%s)", (names,)):
        found.setdefault(str(table), {})[str(column)] = str(dtype)
    if SCHEMA_TABLE in found:
        if found[SCHEMA_TABLE] != {"id": "smallint", "version": "integer"}:
            raise StoreError(f"market database {shown}: table {SCHEMA_TABLE} has columns "
                             f"{sorted(found[SCHEMA_TABLE])}, not a moe-swarm market's", code="store_schema")
        row = conn.execute(f"SELECT version FROM {SCHEMA_TABLE} WHERE id = 1").fetchone()
        version = int(row[0]) if row is not None else 0
        if version > SCHEMA_VERSION:
            raise StoreError(f"market database {shown} has schema {version}, this market knows up to {SCHEMA_VERSION}",
                             code="store_schema")
    for t in _tables():
        cols = found.get(t.value)
        if cols is not None and cols != _COLUMNS:
            shape = ", ".join(f"{c} {d}" for c, d in sorted(cols.items()))
            raise StoreError(f"market database {shown}: table {t.value} has columns ({shape}), not (key text, body "
                             "bytea): not a moe-swarm market database, or a damaged one", code="store_schema")
    conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} (id smallint PRIMARY KEY CHECK (id = 1), "
                 "version integer NOT NULL)")
    for t in _tables():
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (key text PRIMARY KEY, body bytea NOT NULL)")
                     .format(sql.Identifier(t.value)))
    conn.execute(f"INSERT INTO {SCHEMA_TABLE} (id, version) VALUES (1, %s) "
                 "ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version", (SCHEMA_VERSION,))


def open_postgres_store(url: str, *, timeout_s: float = 5.0, pool_size: int = 2) -> PostgresStore:
    """Connect to ``url`` (``postgresql://user:password@host:port/dbname?...``), check or create the
    schema and take the database's market lock (module rules)."""
    shown = mask_url(url)
    try:
        conn = psycopg.connect(url, connect_timeout=max(1, round(timeout_s)))
    except (psycopg.Error, ValueError) as exc:
        raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                         code="store_unavailable") from None
    pool: ConnectionPool[Any] | None = None
    try:
        try:
            with conn.transaction():
                _check_schema(conn, shown)
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (_MARKET_LOCK,)).fetchone()
            conn.commit()
        except psycopg.Error as exc:
            raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                             code="store_unavailable") from None
        if not got or not got[0]:
            raise StoreError(f"market database {shown} is in use by another moe-swarm market (one market per "
                             "database); stop it first", code="store_in_use")
        pool = ConnectionPool(url, min_size=1, max_size=max(1, pool_size), open=False, timeout=timeout_s,
                              kwargs={"connect_timeout": max(1, round(timeout_s))},
                              check=ConnectionPool.check_connection, name="moe-swarm-market")
        try:
            pool.open(wait=True, timeout=timeout_s)
        except psycopg.Error as exc:
            raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                             code="store_unavailable") from None
        return PostgresStore(url, conn, pool)
    except BaseException:
        if pool is not None:
            pool.close()
        conn.close()
        raise
