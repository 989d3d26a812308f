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
  masked; takes the market lock (below); then, under a transaction-scoped advisory lock (two markets starting at once do not race on
  ``CREATE TABLE``), checks the schema: a newer ``version`` -> ``store_schema`` naming both versions;
  a table of ours with other columns (not a market database, or a damaged one) -> ``store_schema``;
  otherwise creates what is missing and records ``SCHEMA_VERSION``.
- One market per database, or replicas: a session advisory lock (``pg_try_advisory_lock``) held by a
  connection of its own for the store's life, exclusive for a lone market (a second market, a replica or a
  ``migrate`` into it is refused with ``store_in_use``), shared by replicas (``shared=True``, ``--replica``;
  a lone market is then refused). The lock goes with its session (also when the process is killed, or the
  database restarts). Every write is fenced: its transaction first takes the write lock
  (``pg_advisory_xact_lock``, until commit) and checks in ``pg_locks`` that our lock session still holds
  the market lock; when it does not (a database restart ended it), the lock is taken again on a new
  connection and the write retried once; when another market took it meanwhile, the write fails with
  ``store_in_use`` (the market then refuses calls until it can read the store again, ``market.state``).
- Replicas (``market.replica``): every batch is also appended to ``market_feed`` in its transaction;
  ``begin_call`` opens a call's transaction (the write lock, the fence and the feed rows past this
  replica's position in one pipelined round trip), ``apply`` writes and commits it, ``end_call`` commits
  or rolls back what is left; ``load`` moves the position to its snapshot; a position behind
  ``market_sync.pruned_through`` reads everything. ``market_counters`` holds the replay counters,
  ``market_seen`` the heartbeat marks, a second session lock the leader. These tables hold no market row:
  ``migrate`` moves none of them.
- Connections fail within seconds on a silent network (``tcp_user_timeout``, keepalives), never block.
- Reads and writes go through a small ``psycopg_pool.ConnectionPool``. A connection found dead (a database
  restart) at a call's first statement -- nothing sent but ``BEGIN`` and the fence -- is dropped, the
  pool's idle ones checked (``ConnectionPool.check``), and the call retried once on a fresh one, so a restart costs no failed call and no extra round trip per call; a
  failure later in a write is not retried (its commit may be ambiguous: ``market.state`` reloads). A call
  that cannot get a connection within ``GETCONN_S`` (1 s) raises ``StoreError``; after such a
  connection-level failure every call fails at once (naming the cause) for ``DOWN_RETRY_S`` (5 s): a
  database outage blocks the market's event loop for about 1 s in 6, not on every request.
- ``close()`` closes the pool, releases the lock and closes its connection; idempotent.
- Calls block: the market opens and first loads in a worker thread (``market.server``).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolTimeout

from market.core.records import Snapshot, Table
from market.replica import Catchup
from market.store import SCHEMA_VERSION, Change, decode_row, encode_changes, mask_url, snapshot_of
from swarm.errors import StoreError

__all__ = ["PostgresStore", "open_postgres_store"]

SCHEMA_TABLE: Final = "market_schema"
_SETUP_LOCK: Final = 0x6D6F65_0001  # pg_advisory_xact_lock key while creating / checking tables
_MARKET_LOCK: Final = 0x6D6F65_0002  # session lock: exclusive for a lone market (and migrate), shared by replicas
_WRITE_LOCK: Final = 0x6D6F65_0003  # pg_advisory_xact_lock key every write holds until its commit
_LEADER_LOCK: Final = 0x6D6F65_0004  # session lock of the replica that runs the tick's decisions
_HOLDS_LEADER: Final = ("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
                        f"pid = pg_backend_pid() AND objsubid = 1 AND classid = {_LEADER_LOCK >> 32} "
                        f"AND objid = {_LEADER_LOCK & 0xFFFFFFFF})")
_CLAIM: Final = ("INSERT INTO market_counters AS c (peer, epoch, seq) VALUES (%s, %s, %s) ON CONFLICT (peer) DO UPDATE "
                 "SET epoch = EXCLUDED.epoch, seq = EXCLUDED.seq WHERE (c.epoch, c.seq) < (EXCLUDED.epoch, EXCLUDED.seq) "
                 "RETURNING 1")
_SEEN_PUT: Final = ("INSERT INTO market_seen AS s (peer, at, load) VALUES (%s, %s, %s) ON CONFLICT (peer) DO UPDATE "
                    "SET at = EXCLUDED.at, load = EXCLUDED.load WHERE s.at <= EXCLUDED.at")
# is the market lock still held by session %s? (a bigint key is (classid, objid) = (high, low) 32 bits, objsubid 1)
_FENCE_AND_FEED: Final = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s "
    f"AND objsubid = 1 AND classid = {_MARKET_LOCK >> 32} AND objid = {_MARKET_LOCK & 0xFFFFFFFF}), "
    "(SELECT pruned_through FROM market_sync WHERE id = 1), (SELECT coalesce(max(seq), 0) FROM market_feed)")
# the replicas' tables (not ``Table``s: no market row lives there; ``migrate`` moves none of them)
_REPLICA_DDL: Final = (
    "CREATE TABLE IF NOT EXISTS market_feed (seq bigserial PRIMARY KEY, tbl text NOT NULL, key text NOT NULL, body bytea)",
    "CREATE TABLE IF NOT EXISTS market_sync (id smallint PRIMARY KEY CHECK (id = 1), pruned_through bigint NOT NULL)",
    "INSERT INTO market_sync (id, pruned_through) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
    "CREATE TABLE IF NOT EXISTS market_counters (peer text PRIMARY KEY, epoch bigint NOT NULL, seq bigint NOT NULL)",
    "CREATE TABLE IF NOT EXISTS market_seen (peer text PRIMARY KEY, at double precision NOT NULL, load real NOT NULL)",
)
_COLUMNS: Final = {"key": "text", "body": "bytea"}
# a database that stops answering (a partition that drops packets rather than refusing them) fails a
# connection within seconds, never blocks a call for ever: unacknowledged data for 5 s, or an idle link
# whose keepalives go unanswered
_NET_KW: Final[dict[str, Any]] = {"tcp_user_timeout": 5000, "keepalives": 1, "keepalives_idle": 5,
                                  "keepalives_interval": 2, "keepalives_count": 2}
DOWN_RETRY_S: Final = 5.0  # after a connection-level failure, calls fail at once for this long
GETCONN_S: Final = 1.0  # the longest a call waits for a pooled connection (the market calls from its event loop)


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


class _LockLost(Exception):
    """The fence found our market lock gone (inside ``apply``)."""


class PostgresStore:
    """A ``Store`` in PostgreSQL. Use ``open_postgres_store``; calls from one thread at a time."""

    def __init__(self, url: str, lock_conn: psycopg.Connection[Any], pool: ConnectionPool[Any], timeout_s: float,
                 *, shared: bool = False) -> None:
        self.url = url
        self.shared = shared  # a replica: other markets may use the database at once
        self._seq = 0  # the feed position this replica's memory reflects
        self._call: psycopg.Connection[Any] | None = None  # the open call's transaction (``begin_call``)
        self._leader = False
        self.calls = 0
        self.shown = mask_url(url)
        self._lock_conn: psycopg.Connection[Any] | None = lock_conn
        self._lock_pid = lock_conn.info.backend_pid
        self._pool: ConnectionPool[Any] | None = pool
        self._timeout_s = timeout_s
        self._mutex = threading.Lock()
        self.commits = 0
        self.relocked = 0  # times the market lock was taken again (after a database restart)
        self._down_until = -math.inf  # fail at once until then (module rules)
        self._down_why = ""

    def _p(self) -> ConnectionPool[Any]:
        if self._pool is None:
            raise StoreError("store is closed", code="store_closed")
        if time.monotonic() < self._down_until:
            raise StoreError(f"market database {self.shown} is unreachable: {self._down_why} (next try within "
                             f"{DOWN_RETRY_S:g} s)")
        return self._pool

    def _p_any(self) -> ConnectionPool[Any]:
        if self._pool is None:
            raise StoreError("store is closed", code="store_closed")
        return self._pool

    def _failed(self, exc: psycopg.Error) -> None:
        """A connection-level failure: calls fail at once for ``DOWN_RETRY_S`` (module rules)."""
        if isinstance(exc, psycopg.OperationalError):
            self._down_until = time.monotonic() + DOWN_RETRY_S
            self._down_why = _one_line(exc, self.url)

    def raw(self) -> dict[Table, list[tuple[str, bytes]]]:
        """Every ``(key, body)`` as stored, sorted by key (``market.migrate`` compares them)."""
        try:
            return raw_rows(self._p(), self.url)
        except StoreError as exc:
            if isinstance(exc.__cause__, psycopg.Error):
                self._failed(exc.__cause__)
            raise

    def load(self) -> Snapshot:
        """Every row, and this replica's feed position moved to the same snapshot."""
        pool = self._p()
        for attempt in (1, 2):
            try:
                with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
                    cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    snap = _snapshot(cur)
                    got = cur.execute("SELECT coalesce(max(seq), 0) FROM market_feed").fetchone()
                    self._seq = int(got[0]) if got else 0
                    return snap
            except psycopg.OperationalError as exc:
                if attempt == 1 and not isinstance(exc, PoolTimeout):
                    pool.check()
                    continue
                self._failed(exc)
                raise StoreError(f"cannot read market database {self.shown}: {_one_line(exc, self.url)}") from exc
            except psycopg.Error as exc:
                raise StoreError(f"cannot read market database {self.shown}: {_one_line(exc, self.url)}") from exc
        raise AssertionError("unreachable")

    def _fenced(self, cur: psycopg.Cursor[Any]) -> tuple[int, int]:
        """The start of every write: the database's write lock (until commit), the fence; returns the feed's
        ``(pruned_through, top)``."""
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
        got = cur.execute(_FENCE_AND_FEED, (self._lock_pid,)).fetchone()
        if not got or not got[0]:
            raise _LockLost
        return int(got[1]), int(got[2])

    def apply(self, changes: Sequence[Change]) -> None:
        encoded = encode_changes(changes)
        if self._call is not None:  # the end of a call (``begin_call``): its transaction holds the write lock
            conn, self._call = self._call, None
            pool = self._p_any()
            try:
                with conn.cursor() as cur:
                    top = _write(cur, encoded)
                conn.commit()
            except psycopg.Error as exc:
                _discard(pool, conn)
                if isinstance(exc, psycopg.OperationalError):
                    self._failed(exc)
                raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc
            pool.putconn(conn)
            if top:
                self._seq = top
            self.commits += 1
            return
        pool = self._p()
        if not encoded:
            return
        retry_dead, retry_lock = True, True  # once each: a dead pooled connection, a lost lock
        while True:
            fenced = False
            try:
                with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
                    self._fenced(cur)
                    fenced = True
                    _write(cur, encoded)  # not a call: this replica reads its own feed rows back (harmless)
            except _LockLost:
                if not retry_lock:
                    raise StoreError(f"market database {self.shown}: the market lock is lost", code="store_in_use") from None
                retry_lock = False
                self._relock()
                continue
            except psycopg.OperationalError as exc:
                if retry_dead and not fenced and not isinstance(exc, PoolTimeout):  # a dead connection, nothing written
                    retry_dead = False
                    pool.check()  # the other idle connections died with it: replaced too
                    continue
                self._failed(exc)
                raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc
            except psycopg.Error as exc:
                raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc
            self.commits += 1
            return

    # -- replicas (market.replica) -------------------------------------------------------------

    def begin_call(self) -> Catchup:
        """Open a call's transaction holding the write lock; what others committed since we last read."""
        if self._call is not None:  # a call that never ended (cannot happen through Market): end it first
            self.end_call(False)
        pool = self._p()
        retry_dead, retry_lock = True, True
        while True:
            fenced = False
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = pool.getconn()
                with conn.cursor() as cur, conn.cursor() as fence, conn.cursor() as feed:
                    # one round trip (a pipeline): the lock, then -- each statement its own snapshot, taken once
                    # the lock is ours -- the fence and feed position, and the feed rows past ours
                    with conn.pipeline():
                        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
                        fence.execute(_FENCE_AND_FEED, (self._lock_pid,))
                        feed.execute("SELECT seq, tbl, key, body FROM market_feed WHERE seq > %s ORDER BY seq",
                                     (self._seq,))
                    got = fence.fetchone()
                    if not got or not got[0]:
                        raise _LockLost
                    fenced = True
                    pruned, top = int(got[1]), int(got[2])
                    rows = feed.fetchall()
                    if self._seq < pruned:  # the feed no longer reaches back to us: everything, in this snapshot
                        catch = Catchup([], _snapshot(cur))
                    else:
                        top = max([top, *(int(r[0]) for r in rows)])
                        catch = Catchup([(Table(t), str(k), None if b is None else decode_row(Table(t), str(k), bytes(b)))
                                         for _, t, k, b in rows])
            except _LockLost:
                _discard(pool, conn)
                if not retry_lock:
                    raise StoreError(f"market database {self.shown}: the market lock is lost", code="store_in_use") from None
                retry_lock = False
                self._relock()
                continue
            except psycopg.OperationalError as exc:
                _discard(pool, conn)
                if retry_dead and not fenced and not isinstance(exc, PoolTimeout):
                    retry_dead = False
                    pool.check()
                    continue
                self._failed(exc)
                raise StoreError(f"cannot read market database {self.shown}: {_one_line(exc, self.url)}") from exc
            except (psycopg.Error, StoreError) as exc:
                _discard(pool, conn)
                if isinstance(exc, StoreError):
                    raise
                raise StoreError(f"cannot read market database {self.shown}: {_one_line(exc, self.url)}") from exc
            self._seq = top
            self._call = conn
            self.calls += 1
            return catch

    def end_call(self, ok: bool) -> None:
        """Commit what the call left open (counter claims; ``ok``) or roll it back."""
        conn, self._call = self._call, None
        if conn is None:
            return
        pool = self._p_any()
        try:
            if ok:
                conn.commit()
            else:
                conn.rollback()
        except psycopg.Error as exc:
            _discard(pool, conn)
            if isinstance(exc, psycopg.OperationalError):
                self._failed(exc)
            if ok:
                raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc
            return
        pool.putconn(conn)

    def claim_counter(self, peer_id: str, epoch: int, sequence: int) -> bool:
        """Accept ``(epoch, sequence)`` for ``peer_id`` unless some replica accepted it or a newer one."""
        conn = self._call
        try:
            if conn is None:  # on its own (a re-poll without the write lock): one statement, committed
                with self._p().connection() as own:
                    got = own.execute(_CLAIM, (peer_id, epoch, sequence)).fetchone()
                return got is not None
            got = conn.execute(_CLAIM, (peer_id, epoch, sequence)).fetchone()
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self._failed(exc)
            raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc
        return got is not None

    def exchange_seen(self, heard: Sequence[tuple[str, float, float]], since: float) -> list[tuple[str, float, float]]:
        """Write when we heard whom (and their load); read what the others wrote after ``since``. Inside the
        open call when there is one."""
        conn = self._call
        if conn is None:
            raise StoreError("exchange_seen outside a call", code="store_error")
        try:
            with conn.cursor() as cur:
                if heard:
                    cur.executemany(_SEEN_PUT, list(heard))
                cur.execute("SELECT peer, at, load FROM market_seen WHERE at > %s", (since,))
                return [(str(p), float(a), float(ld)) for p, a, ld in cur.fetchall()]
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self._failed(exc)
            raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc

    def prune(self, keep: int, seen_before: float) -> None:
        """Inside a call: drop all but the last ``keep`` feed rows (``pruned_through`` moves with them) and the
        heartbeat marks older than ``seen_before``."""
        conn = self._call
        if conn is None:
            raise StoreError("prune outside a call", code="store_error")
        try:
            with conn.cursor() as cur:
                cur.execute("UPDATE market_sync SET pruned_through = greatest(pruned_through, "
                            "(SELECT coalesce(max(seq), 0) FROM market_feed) - %s) WHERE id = 1", (keep,))
                cur.execute("DELETE FROM market_feed WHERE seq <= (SELECT pruned_through FROM market_sync WHERE id = 1)")
                cur.execute("DELETE FROM market_seen WHERE at < %s", (seen_before,))
        except psycopg.Error as exc:
            raise StoreError(f"cannot write market database {self.shown}: {_one_line(exc, self.url)}") from exc

    def leads(self) -> bool:
        """Is this replica the leader (the database's leader lock, on the market lock's session)? Tries to
        become it when nobody is."""
        with self._mutex:
            conn = self._lock_conn
        if conn is None or time.monotonic() < self._down_until:
            self._leader = False
            return False
        try:
            if self._leader:
                got = conn.execute(_HOLDS_LEADER).fetchone()
            else:
                got = conn.execute("SELECT pg_try_advisory_lock(%s)", (_LEADER_LOCK,)).fetchone()
        except psycopg.Error:
            self._leader = False  # the session is gone (a restart): the next write takes the market lock again
            return False
        self._leader = bool(got and got[0])
        return self._leader

    def _relock(self) -> None:
        """Take the market lock again on a new connection (``store_in_use`` when another market has it)."""
        conn = _take_lock(self.url, self.shown, self._timeout_s, shared=self.shared)
        with self._mutex:
            old, self._lock_conn = self._lock_conn, conn
            self._lock_pid = conn.info.backend_pid
        self.relocked += 1
        if old is not None:
            old.close()

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
            call, self._call = self._call, None
        try:
            if call is not None:
                call.close()
            if pool is not None:
                pool.close()
        finally:
            if lock_conn is not None:
                try:  # released now, not when the server notices the session ended: a restart may follow at once
                    lock_conn.execute("SELECT pg_advisory_unlock_all()")
                except psycopg.Error:
                    pass  # a dead session holds nothing
                lock_conn.close()


def _discard(pool: ConnectionPool[Any], conn: psycopg.Connection[Any] | None) -> None:
    """Give back a connection whose transaction failed (rolled back; the pool drops a broken one)."""
    if conn is None:
        return
    try:
        conn.rollback()
    except psycopg.Error:
        pass
    pool.putconn(conn)


def _snapshot(cur: psycopg.Cursor[Any]) -> Snapshot:
    rows: dict[Table, list[Any]] = {}
    for t in _tables():
        cur.execute(sql.SQL("SELECT key, body FROM {}").format(sql.Identifier(t.value)))
        rows[t] = [decode_row(t, k, b) for k, b in sorted((str(k), bytes(b)) for k, b in cur.fetchall())]
    return snapshot_of(rows)


def _write(cur: psycopg.Cursor[Any], encoded: list[tuple[Table, str, bytes | None]]) -> int:
    """The batch in order: runs of one table and one kind, one ``executemany`` (pipelined) each; then the
    same changes appended to the feed (the replicas' catch-up). Returns the feed's new top (0: nothing)."""
    if not encoded:
        return 0
    cur.executemany("INSERT INTO market_feed (tbl, key, body) VALUES (%s, %s, %s)",
                    [(t.value, k, b) for t, k, b in encoded])
    i = 0
    while i < len(encoded):
        table, _, body = encoded[i]
        j = i
        while j < len(encoded) and encoded[j][0] is table and (encoded[j][2] is None) == (body is None):
            j += 1
        name = sql.Identifier(table.value)
        if body is None:
            cur.executemany(sql.SQL("DELETE FROM {} WHERE key = %s").format(name), [(k,) for _, k, _ in encoded[i:j]])
        else:
            cur.executemany(sql.SQL("INSERT INTO {} (key, body) VALUES (%s, %s) ON CONFLICT (key) "
                                    "DO UPDATE SET body = EXCLUDED.body").format(name),
                            [(k, b) for _, k, b in encoded[i:j]])
        i = j
    got = cur.execute("SELECT max(seq) FROM market_feed").fetchone()
    return int(got[0]) if got and got[0] is not None else 0


def raw_rows(pool: ConnectionPool[Any], url: str) -> dict[Table, list[tuple[str, bytes]]]:
    """Every ``(key, body)`` of every table, sorted by key (code point order, as ``sorted``), in one
    repeatable-read snapshot; a dead connection is replaced once (reads may be repeated)."""
    for attempt in (1, 2):
        try:
            with pool.connection() as conn:
                return _read_all(conn)
        except psycopg.OperationalError as exc:
            if attempt == 1 and not isinstance(exc, PoolTimeout):  # a dead connection: once more
                pool.check()
                continue
            raise StoreError(f"cannot read market database {mask_url(url)}: {_one_line(exc, url)}") from exc
        except psycopg.Error as exc:
            raise StoreError(f"cannot read market database {mask_url(url)}: {_one_line(exc, url)}") from exc
    raise AssertionError("unreachable")


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
    for stmt in _REPLICA_DDL:
        conn.execute(stmt)
    conn.execute(f"INSERT INTO {SCHEMA_TABLE} (id, version) VALUES (1, %s) "
                 "ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version", (SCHEMA_VERSION,))


def _take_lock(url: str, shown: str, timeout_s: float, *, shared: bool = False) -> psycopg.Connection[Any]:
    """A new autocommit connection holding the market lock, exclusive or ``shared`` (replicas)
    (``store_in_use`` when another market holds it the other way)."""
    try:
        conn = psycopg.connect(url, connect_timeout=max(1, round(timeout_s)), autocommit=True, **_NET_KW)
    except (psycopg.Error, ValueError) as exc:
        raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                         code="store_unavailable") from None
    try:
        got = conn.execute("SELECT pg_try_advisory_lock_shared(%s)" if shared else "SELECT pg_try_advisory_lock(%s)",
                           (_MARKET_LOCK,)).fetchone()
    except psycopg.Error as exc:
        conn.close()
        raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                         code="store_unavailable") from None
    if not got or not got[0]:
        conn.close()
        raise StoreError(f"market database {shown} is in use by another moe-swarm market (without --replica, one "
                         "market per database); stop it first, or run every market with --replica", code="store_in_use")
    return conn


def open_postgres_store(url: str, *, timeout_s: float = 5.0, pool_size: int = 3, shared: bool = False) -> PostgresStore:
    """Connect to ``url`` (``postgresql://user:password@host:port/dbname?...``), check or create the
    schema and take the database's market lock, exclusive or ``shared`` (replicas) (module rules)."""
    shown = mask_url(url)
    conn = _take_lock(url, shown, timeout_s, shared=shared)
    pool: ConnectionPool[Any] | None = None
    try:
        try:
            with conn.transaction():
                _check_schema(conn, shown)
        except psycopg.Error as exc:
            raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                             code="store_unavailable") from None
        pool = ConnectionPool(url, min_size=1, max_size=max(1, pool_size), open=False, timeout=min(timeout_s, GETCONN_S),
                              kwargs={"connect_timeout": max(1, round(timeout_s)), **_NET_KW}, name="moe-swarm-market")
        try:
            pool.open(wait=True, timeout=timeout_s)
        except psycopg.Error as exc:
            raise StoreError(f"cannot open market database {shown}: {_one_line(exc, url)}",
                             code="store_unavailable") from None
        return PostgresStore(url, conn, pool, timeout_s, shared=shared)
    except BaseException:
        if pool is not None:
            pool.close()
        conn.close()
        raise
