"""The PostgreSQL market store's own rules (the shared ones are in ``test_market_store.py``): schema
version and foreign layouts refused, one market per database, bad databases as one masked line and exit
2 from a real ``moe-swarm market`` process, and ``moe-swarm market migrate`` from SQLite.

PostgreSQL is a throwaway server (``tests/pgserver.py``; a new database per test); the tests needing it
skip, saying so, only where Debian's ``postgresql`` package is absent. The unreachable-server cases need
no server."""

from __future__ import annotations

import random
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psycopg
import pytest

from market.core.records import HeldState, ModelRow, Table
from market.migrate import read_sqlite_rows
from market.policy import MarketPolicy
from market.state import Market, Offer
from market.store import InMemoryStore, mask_url, open_sqlite_store
from market.store_pg import PostgresStore, open_postgres_store
from market.stores import open_store
from swarm.errors import StoreError
from swarm.lockfile import hold
from swarm.protocol.market import (
    CoordinatorReport,
    CoverageHeartbeat,
    EvidenceMethod,
    HeldSlice,
    QuarantineEvidence,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)
from tests.integration.test_market_store import MANIFEST, MID, sample_rows

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-n0t-5hown"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", *args]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=120, cwd=ROOT)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://market:{PASSWORD}@127.0.0.1:{port}/marketdb"


def with_password(url: str) -> str:
    return url.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@")


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://u:secret@h:5432/db", "postgresql://u:***@h:5432/db"),
    ("postgres://u@h/db", "postgres://u@h/db"),
    ("postgresql://h/db?password=secret&sslmode=require", "postgresql://h/db?password=***&sslmode=require"),
    ("postgresql://u:p%40ss@[::1]:5432/db", "postgresql://u:***@[::1]:5432/db"),
    ("/var/lib/market.db", "/var/lib/market.db"),
])
def test_urls_are_shown_with_the_password_masked(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_an_unreachable_server_is_one_clear_error_without_the_password() -> None:
    url = closed_port_url()
    with pytest.raises(StoreError) as ei:
        open_store(url)
    msg = str(ei.value)
    assert ei.value.code == "store_unavailable" and "\n" not in msg
    assert mask_url(url) in msg and PASSWORD not in msg


def test_the_schema_version_is_recorded_and_a_newer_one_refused_naming_both(pg_url: str) -> None:
    open_postgres_store(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM market_schema").fetchall() == [(3,)]
        conn.execute("UPDATE market_schema SET version = 7")
    with pytest.raises(StoreError) as ei:
        open_postgres_store(with_password(pg_url))
    assert ei.value.code == "store_schema"
    assert "schema 7" in str(ei.value) and "up to 3" in str(ei.value) and PASSWORD not in str(ei.value)


def test_a_database_with_foreign_tables_of_our_names_is_refused(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE leases (id integer PRIMARY KEY, holder text)")
    with pytest.raises(StoreError) as ei:
        open_postgres_store(pg_url)
    assert ei.value.code == "store_schema" and "leases" in str(ei.value)
    with psycopg.connect(pg_url, autocommit=True) as conn:  # nothing was created beside it
        assert conn.execute("SELECT to_regclass('market_schema') IS NULL").fetchone() == (True,)


def test_one_market_per_database_until_the_first_closes(pg_url: str) -> None:
    first = open_postgres_store(pg_url)
    with pytest.raises(StoreError) as ei:
        open_postgres_store(pg_url)
    assert ei.value.code == "store_in_use"
    first.close()
    open_postgres_store(pg_url).close()


def test_a_dropped_connection_is_replaced_before_the_next_call(pg_url: str) -> None:
    """A server-side end of the pool's connection (as a database restart does) costs no failed call."""
    s = open_postgres_store(pg_url)
    assert isinstance(s, PostgresStore)
    s.apply(sample_rows())
    with psycopg.connect(pg_url, autocommit=True) as admin:
        pids = [int(r[0]) for r in admin.execute(
            "SELECT pid FROM pg_stat_activity a WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')")]
        assert pids  # the pool's connection (the lock's stays: it is no pool connection)
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone() != (0,):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert len(s.load().volunteers) == 2
    s.close()


def test_a_database_restarted_mid_run_loses_nothing_and_the_store_carries_on(pg_server: Any) -> None:
    url = pg_server.database()
    s = open_postgres_store(url)
    puts = sample_rows()
    s.apply(puts[:5])
    pg_server.restart()
    s.apply(puts[5:])  # a fresh connection for the dead one; the market lock taken again
    ref = InMemoryStore()
    ref.apply(puts)
    assert s.load() == ref.load()
    assert isinstance(s, PostgresStore) and s.relocked == 1
    with pytest.raises(StoreError) as ei:  # still one market per database after the restart
        open_postgres_store(url)
    assert ei.value.code == "store_in_use"
    s.close()


def test_a_database_outage_fails_calls_fast_and_they_work_again_after_it(pg_server: Any) -> None:
    """While the server is down a call fails (bounded), and the next ones within ``DOWN_RETRY_S`` at once,
    naming the cause; once it is back, calls work again and nothing committed is lost."""
    from market.store_pg import DOWN_RETRY_S

    url = pg_server.database()
    s = open_postgres_store(url)
    puts = sample_rows()
    s.apply(puts[:3])
    pg_server.halt()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            s.apply(puts[3:4])
        first = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="is unreachable: .*next try within"):
            s.load()
        again = time.monotonic() - t0
    finally:
        pg_server.resume()
    assert first < 5.0 and again < 0.05, (first, again)
    deadline = time.monotonic() + DOWN_RETRY_S + 10
    while True:
        try:
            s.apply(puts[3:4])
            break
        except StoreError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    ref = InMemoryStore()
    ref.apply(puts[:4])
    assert s.load() == ref.load()
    s.close()


def test_a_market_that_lost_its_lock_to_another_never_writes(pg_url: str) -> None:
    """The lock's session ends (as in a restart) and a second market starts meanwhile: the first one's
    next write is refused (fenced inside its transaction), the second one's lands; once the second is
    gone the first takes the lock again."""
    a = open_postgres_store(pg_url)
    puts = sample_rows()
    a.apply(puts[:1])
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (a._lock_pid,))
        deadline = time.monotonic() + 10
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (a._lock_pid,)).fetchone() != (0,):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    b = open_postgres_store(pg_url)
    with pytest.raises(StoreError) as ei:
        a.apply(puts[1:2])
    assert ei.value.code == "store_in_use"
    b.apply(puts[2:3])
    assert (b.load().coordinators, b.load().volunteers) == ([], [puts[2].row])
    b.close()
    a.apply(puts[3:4])
    assert [v.peer_id for v in a.load().volunteers] == ["12D3KooWpeerA", "12D3KooWpeerB"] and a.relocked == 1
    a.close()


# -- a real market process -------------------------------------------------------------------------


def test_the_market_exits_2_on_an_unreachable_database_with_one_masked_line() -> None:
    url = closed_port_url()
    r = run_cli("market", "--db", url, "--token", "t0k", "--port", "0")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("moe-swarm: error: cannot open market database " + mask_url(url))
    assert lines[0].endswith("[store_unavailable]") and PASSWORD not in r.stderr + r.stdout


def test_the_market_exits_2_on_a_wrong_or_newer_schema(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE credit (peer text, amount numeric)")
    r = run_cli("market", "--db", with_password(pg_url), "--token", "t0k", "--port", "0")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "table credit has columns" in line and line.endswith("[store_schema]") and PASSWORD not in line
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DROP TABLE credit")
    open_postgres_store(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE market_schema SET version = 4")
    r = run_cli("market", "--db", with_password(pg_url), "--token", "t0k", "--port", "0")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "has schema 4, this market knows up to 3" in line and mask_url(with_password(pg_url)) in line


def test_the_market_serves_on_postgresql_and_a_second_one_is_refused(pg_url: str, tmp_path: Path) -> None:
    url = with_password(pg_url)
    log = tmp_path / "market.log"
    with open(log, "wb") as fh:
        p = subprocess.Popen(cli("market", "--db", url, "--token", "t0k", "--port", "0"), stdout=fh,
                             stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while "market ready at " not in log.read_text():
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        ready = next(line for line in log.read_text().splitlines() if line.startswith("market ready at "))
        assert ready.endswith(f"(db {mask_url(url)})") and PASSWORD not in log.read_text()
        murl = ready.split()[3]
        assert httpx.get(f"{murl}/health", timeout=10).status_code == 200
        r = httpx.post(f"{murl}/api/models", timeout=10, headers={"authorization": "Bearer t0k"},
                       json={"url": "http://127.0.0.1:9", "models": [msgspec.to_builtins(MANIFEST)], "epoch": 1})
        assert r.status_code == 200, r.text
        second = run_cli("market", "--db", url, "--token", "t0k", "--port", "0")
        assert second.returncode == 2 and "[store_in_use]" in second.stderr and PASSWORD not in second.stderr
    finally:
        p.terminate()
        assert p.wait(30) == 0, log.read_text()
    s = open_postgres_store(pg_url)  # the registration is in the database
    assert [m.manifest.model_id for m in s.load().models] == [MID]
    assert [c.url for c in s.load().coordinators] == ["http://127.0.0.1:9"]
    s.close()


# -- migrate ---------------------------------------------------------------------------------------

POLICY = MarketPolicy(heartbeat_ttl_s=60.0, lease_s=600.0, header_allowance=0, coverage_requires_lease=False)


def hb(peer: str, layer: int, lo: int, hi: int) -> CoverageHeartbeat:
    return CoverageHeartbeat(peer, 1, 1, [f"/ip4/10.0.0.1/tcp/1/p2p/{peer}"],
                             [HeldSlice(MID, layer, lo, hi, HeldState.SERVING)], 0.0, protocols=[2])


def make_sqlite_market_db(path: Path) -> None:
    """A database as the current market writes it: a registration, coverage, an open lease, a
    quarantine with its evidence, credit, a published map, plus a row of every table (``sample_rows``)."""
    now = time.time()
    store = open_sqlite_store(path)
    m = Market(store, POLICY, now=now, rng=random.Random(3))
    m.register(RegisterModels("http://c1.test", [MANIFEST], epoch=10), now)
    m.heartbeat(hb("12D3KooWhonest", 0, 0, 4), now)
    m.heartbeat(hb("12D3KooWliar", 0, 4, 8), now)
    offer = m.volunteer(VolunteerRequest("12D3KooWnewbie", max_experts=4), now)
    assert isinstance(offer, Offer)
    m.report(CoordinatorReport(url="http://c1.test", model_id=MID, workers=[
        ReportedWorker(peer_id="12D3KooWhonest", calls=5, rows=40, verified=5, pairs=80),
        ReportedWorker(peer_id="12D3KooWliar", calls=5, rows=40, pairs=80, quarantine="layer 0 experts 4-8: zeros",
                       evidence=QuarantineEvidence(layer=0, lo=4, hi=8, input_sha256="a" * 64, remote_sha256="b" * 64,
                                                   local_sha256="c" * 64, method=EvidenceMethod.BIT_EXACT))]), now + 1)
    m.tick(now + 2)
    m.flush(now + 2)
    store.apply([p for p in sample_rows() if not isinstance(p.row, ModelRow)])
    store.close()


def test_migrate_moves_every_table_of_a_market_database_with_nothing_lost(pg_url: str, tmp_path: Path) -> None:
    db = tmp_path / "market.db"
    make_sqlite_market_db(db)
    before = read_sqlite_rows(str(db))
    for t in (Table.MODELS, Table.COORDINATORS, Table.VOLUNTEERS, Table.COVERAGE, Table.LEASES, Table.MAPS,
              Table.QUARANTINE, Table.CREDIT, Table.RECRUITMENT):
        assert before[t], f"the source has no {t.value} rows: the test would prove nothing"
    sqlite_snapshot = open_sqlite_store(db).load()
    url = with_password(pg_url)
    r = run_cli("market", "migrate", "--from", f"sqlite:{db}", "--to", url)
    assert r.returncode == 0, r.stderr
    assert PASSWORD not in r.stdout + r.stderr
    counts = dict(line.split(": ") for line in r.stdout.splitlines() if ": " in line and not line.startswith("migr"))
    assert counts == {t.value: str(len(before[t])) for t in Table}
    assert f"migrated {sum(len(v) for v in before.values())} rows" in r.stdout
    pg = open_postgres_store(pg_url)
    try:
        assert pg.raw() == before  # every key and every byte
        assert pg.load() == sqlite_snapshot
        # and the market on PostgreSQL carries on where the SQLite one stopped
        m = Market(pg, POLICY, now=time.time(), rng=random.Random(4))
        assert m.ix.quarantined.keys() >= {"12D3KooWliar"}
        assert m.volunteer_credit("12D3KooWhonest", time.time()).pairs == 80
        lease_id = m.ix.lease_of["12D3KooWnewbie"]
        assert m.lease_view(lease_id, time.time()).state == "leased"
    finally:
        pg.close()
    # the source is untouched (read-only) and a second migration into the now full database is refused
    assert read_sqlite_rows(str(db)) == before
    again = run_cli("market", "migrate", "--from", f"sqlite:{db}", "--to", url)
    assert again.returncode == 2 and "[store_not_empty]" in again.stderr and PASSWORD not in again.stderr


def test_migrate_takes_an_old_schema_and_refuses_a_running_market(pg_url: str, tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    conn = sqlite3.connect(db)
    for t in ("models", "coordinators", "volunteers", "coverage", "leases", "maps", "recruitment"):
        conn.execute(f"CREATE TABLE {t} (key TEXT PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID")
    body = (b'{"type":"CoordinatorRow","url":"http://c.test","model_ids":["m-0123456789ab"],"epoch":7,'
            b'"registered_at":1.5}')
    conn.execute("INSERT INTO coordinators VALUES ('http://c.test', ?)", (body,))
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with hold(Path(str(db) + ".lock"), flag="--db", shown=str(db), what="market"):  # as a running market does
        r = run_cli("market", "migrate", "--from", f"sqlite:{db}", "--to", pg_url)
        assert r.returncode == 2 and "[data_dir_in_use]" in r.stderr, r.stderr
    r = run_cli("market", "migrate", "--from", f"sqlite:{db}", "--to", pg_url)
    assert r.returncode == 0, r.stderr
    pg = open_postgres_store(pg_url)
    assert pg.raw()[Table.COORDINATORS] == [("http://c.test", body)]
    assert [(c.url, c.epoch, c.peer_id) for c in pg.load().coordinators] == [("http://c.test", 7, None)]
    pg.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1  # not upgraded: read-only
    conn.close()


def test_migrate_refuses_bad_flags_and_a_newer_source(tmp_path: Path) -> None:
    r = run_cli("market", "migrate", "--from", str(tmp_path / "x.db"), "--to", "postgresql://h/db")
    assert r.returncode == 2 and "sqlite:PATH" in r.stderr
    r = run_cli("market", "migrate", "--from", f"sqlite:{tmp_path / 'missing.db'}", "--to", closed_port_url())
    assert r.returncode == 2 and "no such database file" in r.stderr
    db = tmp_path / "new.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 9")
    conn.commit()
    conn.close()
    r = run_cli("market", "migrate", "--from", f"sqlite:{db}", "--to", closed_port_url())
    assert r.returncode == 2 and "has schema 9, this market knows up to 3" in r.stderr
    assert PASSWORD not in r.stderr


def test_the_db_flag_keeps_a_url_as_given_and_expands_sqlite_paths() -> None:
    from market.cli import config_from_args
    from swarm.cli import build_parser

    def db(*args: str) -> str:
        value: str = config_from_args(build_parser().parse_args(["market", "--insecure-no-token", *args])).db
        return value

    assert db("--db", "postgresql://u:p@h:5432/d?sslmode=require") == "postgresql://u:p@h:5432/d?sslmode=require"
    assert db("--db", "postgres://h/d") == "postgres://h/d"
    assert db("--db", "sqlite:~/m.db") == "sqlite:" + str(Path.home() / "m.db")
    assert db("--db", "~/m.db") == str(Path.home() / "m.db")
