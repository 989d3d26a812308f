"""``moe-swarm market migrate --from sqlite:PATH --to postgresql://...`` (shell: moves a market's data).

Rules:
- The source is read read-only (``mode=ro``; nothing in it changes, not even its schema version), in
  one read transaction, under the database's lock file (``PATH.lock``, as the market holds it): a market
  still running on it is refused (``data_dir_in_use``): stop it first, so nothing written after the copy
  is lost.
- Every SQLite schema this market knows (1 .. ``SCHEMA_VERSION``) is accepted: tables an older schema
  lacks are empty; a newer schema, or a table no market schema has, is refused (``store_schema``);
  every row must decode as the current code reads it (``store_corrupt`` otherwise), so the target
  holds nothing the market could not load.
- Rows move byte for byte (key and body) into the target in one transaction; the target must hold no
  market rows (``store_not_empty``). The target is opened as the market opens it (schema created,
  the database's market lock held: no market may run on it meanwhile).
- Afterwards every table is read back from the target and compared with the source, row for row
  (keys and bytes); any difference is a ``StoreError`` (``migrate_mismatch``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from market.core.records import Table
from market.store import SCHEMA_VERSION, decode_row, is_postgres_url, mask_url, sqlite_path
from swarm.errors import ConfigError, StoreError

__all__ = ["migrate", "read_sqlite_rows"]


def read_sqlite_rows(path: str) -> dict[Table, list[tuple[str, bytes]]]:
    """Every ``(key, body)`` of the SQLite market database at ``path``, sorted by key (module rules)."""
    p = Path(path)
    if not p.is_file():
        raise StoreError(f"--from sqlite:{path}: no such database file", code="store_unavailable")
    try:
        conn = sqlite3.connect(p.absolute().as_uri() + "?mode=ro", uri=True, isolation_level=None, timeout=5.0)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open market database {path}: {exc}", code="store_unavailable") from exc
    try:
        conn.execute("BEGIN")
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise StoreError(f"market database {path} has schema {version}, this market knows up to {SCHEMA_VERSION}",
                             code="store_schema")
        names = {str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        known = {t.value for t in Table}
        if names - known:
            raise StoreError(f"market database {path} has tables no market schema has: {sorted(names - known)}",
                             code="store_schema")
        out: dict[Table, list[tuple[str, bytes]]] = {}
        for t in Table:
            rows = ([(str(k), bytes(b)) for k, b in conn.execute(f"SELECT key, body FROM {t.value}")]
                    if t.value in names else [])
            out[t] = sorted(rows)
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read market database {path}: {exc}", code="store_unavailable") from exc
    finally:
        conn.close()
    for t, rows in out.items():
        for k, b in rows:
            decode_row(t, k, b)  # store_corrupt when the market could not load it
    return out


def migrate(source: str, target: str) -> dict[Table, int]:
    """Move every row of ``source`` (``sqlite:PATH``) into the empty PostgreSQL ``target``; returns the
    rows moved per table (module rules)."""
    from market.store_pg import open_postgres_store
    from swarm.lockfile import hold

    if not source.startswith("sqlite:"):
        raise ConfigError(f"--from {mask_url(source)}: give the SQLite database as sqlite:PATH", code="bad_flag")
    if not is_postgres_url(target):
        raise ConfigError(f"--to {mask_url(target)}: give the PostgreSQL database as postgresql://USER@HOST:PORT/DB",
                          code="bad_flag")
    path = sqlite_path(source)
    with hold(Path(path + ".lock"), flag="--from", shown=source, what="market"):
        rows = read_sqlite_rows(path)
        store = open_postgres_store(target)
        try:
            store.write_raw(rows)
            back = store.raw()
        finally:
            store.close()
    for t in Table:
        if back[t] != rows[t]:
            missing = len(set(rows[t]) - set(back[t]))
            raise StoreError(f"{t.value}: {len(back[t])} rows in {mask_url(target)} after the copy, {len(rows[t])} in "
                             f"{path} ({missing} missing or different)", code="migrate_mismatch")
    return {t: len(rows[t]) for t in Table}
