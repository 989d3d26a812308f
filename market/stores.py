"""Which ``Store`` ``--db`` names (shell): ``:memory:``, ``postgresql://...`` / ``postgres://...``
(``market.store_pg``, imported only then: psycopg loads nothing for a SQLite market), ``sqlite:PATH`` or a
plain path (SQLite). Raises ``StoreError`` when the store cannot be used; its message shows a URL only
through ``market.store.mask_url``."""

from __future__ import annotations

from market.store import MEMORY_DB, InMemoryStore, Store, is_postgres_url, open_sqlite_store, sqlite_path

__all__ = ["open_store"]


def open_store(db: str, *, replica: bool = False) -> Store:
    """``replica``: a PostgreSQL store shared with other market replicas (``market.replica``)."""
    if db == MEMORY_DB:
        return InMemoryStore()
    if is_postgres_url(db):
        from market.store_pg import open_postgres_store

        return open_postgres_store(db, shared=replica)
    return open_sqlite_store(sqlite_path(db))
