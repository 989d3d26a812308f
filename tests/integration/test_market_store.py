"""One conformance suite for the three market stores (in-memory, SQLite, PostgreSQL), plus each
back-end's own rules (SQLite durability and old schemas; PostgreSQL schema checks and its lock).

The PostgreSQL cases run on a throwaway server (``tests/pgserver.py``, the ``pg_url`` fixture), a new
database per test; they skip, saying so, only where Debian's ``postgresql`` package is absent."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from market.core.records import (
    CoordinatorRow,
    CoverageRow,
    CreditRow,
    HeldState,
    LeaseRow,
    MapRow,
    ModelManifest,
    ModelRow,
    QuarantineRow,
    RecruitRow,
    SliceRef,
    Snapshot,
    Table,
    VolunteerRow,
    coverage_key,
)
from market.store import Delete, InMemoryStore, MemoryBacking, Put, Store, open_sqlite_store
from market.stores import open_store
from swarm.dispatch_map import LayerRanges, RangeReplicas, Replica
from swarm.errors import StoreError

ROOT = Path(__file__).resolve().parents[2]
MID = "tiny-0123456789ab"
MANIFEST = ModelManifest(
    model_id=MID, arch="qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, d_model=16, d_expert=8,
    tensor_types=[{"gate": "F32", "up": "F32", "down": "F32"}] * 2, bytes_per_expert=[1536, 1536], gguf_sha256="ab" * 32,
)
S0 = SliceRef(MID, 0, 0, 4)
S1 = SliceRef(MID, 1, 4, 8)


def sample_rows() -> list[Put]:
    return [
        Put(ModelRow(MANIFEST, 1.5)),
        Put(CoordinatorRow("http://127.0.0.1:8080", [MID], 7, 2.0, "12D3KooWc", {MID: [(0, 0, 4)]})),
        Put(VolunteerRow("12D3KooWpeerA", 3, 41, 3.0, ["/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWpeerA"], 10**9)),
        Put(VolunteerRow("12D3KooWpeerB", 0, 0, 3.5)),
        Put(CoverageRow("12D3KooWpeerA", S0, HeldState.SERVING, 4.0, served=True, held=True)),
        Put(CoverageRow("12D3KooWpeerA", S1, HeldState.LOADING, 4.5, retiring_since=9.25)),
        Put(LeaseRow("00000000000000ff", "12D3KooWpeerB", S1, 5.0, 35.0)),
        Put(MapRow(MID, 12, [LayerRanges(0, [RangeReplicas(0, 4, [Replica("12D3KooWpeerA", ["/ip4/1.2.3.4"])])])])),
        Put(RecruitRow(MID, True, 6.0)),
        Put(QuarantineRow("12D3KooWliar", 1e9, "layer 0 experts 0-4: outputs differ", "http://c.test", 7.0)),
        Put(CreditRow("12D3KooWpeerA", 1.5e12, 2.5e11, 8.0, 1000, 40, 7.5, 8.0)),
    ]


@dataclass
class Opener:
    open: Callable[[], Store]
    kind: str


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    if request.param == "memory":
        backing = MemoryBacking()
        yield Opener(lambda: InMemoryStore(backing), "memory")
    elif request.param == "sqlite":
        path = tmp_path / "sub" / "market.db"
        yield Opener(lambda: open_sqlite_store(path), "sqlite")
    else:
        url: str = request.getfixturevalue("pg_url")
        yield Opener(lambda: open_store(url), "postgresql")


def test_empty_store_loads_empty(opener: Opener) -> None:
    s = opener.open()
    assert s.load() == Snapshot()
    s.close()


def test_put_then_load_returns_every_row(opener: Opener) -> None:
    s = opener.open()
    puts = sample_rows()
    s.apply(puts)
    snap = s.load()
    assert snap.models == [puts[0].row]
    assert snap.coordinators == [puts[1].row]
    assert snap.volunteers == [puts[2].row, puts[3].row]  # sorted by key
    assert sorted(snap.coverage, key=lambda r: r.since) == [puts[4].row, puts[5].row]
    assert snap.leases == [puts[6].row]
    assert snap.maps == [puts[7].row]
    assert snap.recruitment == [puts[8].row]
    assert snap.quarantine == [puts[9].row]
    assert snap.credit == [puts[10].row]
    s.close()


def test_put_replaces_and_delete_removes(opener: Opener) -> None:
    s = opener.open()
    s.apply(sample_rows())
    s.apply([Put(VolunteerRow("12D3KooWpeerA", 4, 0, 3.0)), Put(MapRow(MID, 13, []))])
    s.apply([
        Delete(Table.COVERAGE, coverage_key("12D3KooWpeerA", S1)),
        Delete(Table.LEASES, "00000000000000ff"),
        Delete(Table.LEASES, "no-such-lease"),  # a no-op
    ])
    snap = s.load()
    assert [v.epoch for v in snap.volunteers] == [4, 0]
    assert snap.maps == [MapRow(MID, 13, [])]
    assert [c.slice for c in snap.coverage] == [S0]
    assert snap.leases == []
    s.close()


def test_apply_is_all_or_nothing(opener: Opener) -> None:
    s = opener.open()
    with pytest.raises(TypeError):
        s.apply([Put(ModelRow(MANIFEST, 1.0)), "not a change"])  # type: ignore[list-item]
    assert s.load() == Snapshot()
    s.apply([])  # an empty batch is fine
    s.close()


def test_closed_store_refuses_and_close_is_idempotent(opener: Opener) -> None:
    s = opener.open()
    s.close()
    s.close()
    for call in (s.load, lambda: s.apply([Put(ModelRow(MANIFEST, 1.0))])):
        with pytest.raises(StoreError) as ei:
            call()
        assert ei.value.code == "store_closed"


def test_reopen_after_close_keeps_everything(opener: Opener) -> None:
    s = opener.open()
    s.apply(sample_rows())
    s.apply([Delete(Table.VOLUNTEERS, "12D3KooWpeerB")])
    before = s.load()
    s.close()
    s2 = opener.open()
    assert s2.load() == before
    assert [v.peer_id for v in before.volunteers] == ["12D3KooWpeerA"]
    s2.close()


def test_a_batch_may_put_then_delete_one_key_in_order(opener: Opener) -> None:
    """Changes land in their order: put, delete, put again of one key, across tables."""
    s = opener.open()
    a, b = VolunteerRow("12D3KooWpeerA", 1, 1, 1.0), VolunteerRow("12D3KooWpeerA", 2, 2, 2.0)
    s.apply([Put(a), Put(ModelRow(MANIFEST, 1.0)), Delete(Table.VOLUNTEERS, a.peer_id), Put(b),
             Delete(Table.MODELS, MID)])
    snap = s.load()
    assert (snap.volunteers, snap.models) == ([b], [])
    s.apply([Put(a), Delete(Table.VOLUNTEERS, a.peer_id)])
    assert s.load().volunteers == []
    s.close()


def test_keys_sort_by_code_point_whatever_the_backend(opener: Opener) -> None:
    """``load`` sorts each table by key as Python's ``sorted`` does (not by a database's collation)."""
    s = opener.open()
    peers = ["b", "B", "a", "_x", "Z9", "é", "12D3KooW", "a b"]
    s.apply([Put(VolunteerRow(p, 0, 0, 1.0)) for p in peers])
    assert [v.peer_id for v in s.load().volunteers] == sorted(peers)
    s.close()


def test_many_rows_round_trip(opener: Opener) -> None:
    s = opener.open()
    rows = [CreditRow(f"12D3KooWp{i:04d}", i * 1e9, i * 1e8, float(i), i, i % 7, 0.5, 1.0) for i in range(500)]
    s.apply([Put(r) for r in rows])
    assert s.load().credit == rows
    s.close()


# -- SQLite specifics ---------------------------------------------------------------------------


def test_sqlite_uses_wal_and_a_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    open_sqlite_store(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {t.value for t in Table}
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as ei:
        open_sqlite_store(path)
    assert ei.value.code == "store_schema"


def test_sqlite_corrupt_row_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    open_sqlite_store(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO volunteers (key, body) VALUES ('x', '{\"not\": \"a row\"}')")
    conn.commit()
    conn.close()
    s = open_sqlite_store(path)
    with pytest.raises(StoreError) as ei:
        s.load()
    assert ei.value.code == "store_corrupt"
    s.close()


def test_sqlite_unopenable_path_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError) as ei:
        open_sqlite_store(tmp_path / "dir.db")
    assert ei.value.code == "store_unavailable"


def test_sqlite_commit_survives_a_killed_process(tmp_path: Path) -> None:
    """A process that commits and dies without closing (os._exit) loses nothing."""
    path = tmp_path / "killed.db"
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from market.store import open_sqlite_store, Put
        from market.core.records import VolunteerRow
        s = open_sqlite_store({str(path)!r})
        s.apply([Put(VolunteerRow("12D3KooWkilled", 9, 99, 1.0))])
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    s = open_sqlite_store(path)
    assert s.load().volunteers == [VolunteerRow("12D3KooWkilled", 9, 99, 1.0)]
    s.close()


def test_a_version_1_database_moves_forward_with_its_rows(tmp_path: Path) -> None:
    """Schema 1 (as the market before quarantines wrote it: no quarantine table, coordinator rows
    without a peer id) opens as the current schema: the tables are added, every row still loads."""
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    for t in ("models", "coordinators", "volunteers", "coverage", "leases", "maps", "recruitment"):
        conn.execute(f"CREATE TABLE {t} (key TEXT PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID")
    conn.execute("INSERT INTO coordinators VALUES ('http://c.test', ?)",
                 (b'{"type":"CoordinatorRow","url":"http://c.test","model_ids":["m-0123456789ab"],"epoch":7,'
                  b'"registered_at":1.5}',))
    conn.execute("INSERT INTO volunteers VALUES ('p', ?)",
                 (b'{"type":"VolunteerRow","peer_id":"p","epoch":1,"sequence":4,"first_seen":2.0}',))
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    s = open_sqlite_store(path)
    snap = s.load()
    assert [(c.url, c.epoch, c.peer_id) for c in snap.coordinators] == [("http://c.test", 7, None)]
    assert [(v.peer_id, v.sequence, v.protocols) for v in snap.volunteers] == [("p", 4, [1])]
    assert snap.quarantine == []
    s.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert {"quarantine", "credit"} <= {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()


def test_a_version_2_database_moves_forward_with_its_rows(tmp_path: Path) -> None:
    """Schema 2, as the previous release wrote it (coverage rows with ``proven``, coordinator rows
    without holdings, no credit table), opens as schema 3: ``proven`` reads as ``served``, the
    coordinator holds everything, the credit table is added and empty."""
    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path)
    for t in ("models", "coordinators", "volunteers", "coverage", "leases", "maps", "recruitment", "quarantine"):
        conn.execute(f"CREATE TABLE {t} (key TEXT PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID")
    conn.execute("INSERT INTO coordinators VALUES ('http://c.test', ?)",
                 (b'{"type":"CoordinatorRow","url":"http://c.test","model_ids":["m-0123456789ab"],"epoch":7,'
                  b'"registered_at":1.5,"peer_id":"12D3KooWc"}',))
    conn.execute("INSERT INTO coverage VALUES ('p|m-0123456789ab|0|0|4', ?)",
                 (b'{"type":"CoverageRow","peer_id":"p","slice":{"model_id":"m-0123456789ab","layer":0,"lo":0,'
                  b'"hi":4},"state":"serving","since":3.0,"retiring_since":null,"proven":true}',))
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    s = open_sqlite_store(path)
    snap = s.load()
    [c] = snap.coordinators
    assert (c.peer_id, c.local_experts) == ("12D3KooWc", {})
    [cov] = snap.coverage
    assert (cov.served, cov.held, cov.since) == (True, False, 3.0)
    assert snap.credit == []
    s.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    conn.close()
