"""The migrations produce the declared schema; concurrent migration converges; bad databases."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.errors import DatabaseSetupError, DatabaseUnavailable, InvalidArgument, SchemaTooNew
from ledger.storage.engine import normalize_url
from ledger.storage.migrate import (
    alembic_config,
    comparison_options,
    head_revision,
    script_revisions,
)
from ledger.storage.schema import metadata

from .helpers import collect, downgrade_schema, spawn


def _diff(url: str) -> list[object]:
    eng = create_engine(normalize_url(url))
    try:
        with eng.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts=comparison_options(conn.dialect.name))
            return list(compare_metadata(ctx, metadata))
    finally:
        eng.dispose()


def _query(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def test_upgrade_head_equals_declared_schema(db_url: str) -> None:
    Ledger.open(db_url).close()
    assert _diff(db_url) == []


def test_reopen_is_a_no_op_and_records_head(db_url: str) -> None:
    Ledger.open(db_url).close()
    Ledger.open(db_url).close()
    eng = create_engine(normalize_url(db_url))
    with eng.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == head_revision()
        assert {"runs", "attempts", "debits", "capacity_groups", "group_slots", "health",
                "events", "provenance"} <= set(inspect(conn).get_table_names())
    eng.dispose()


def test_the_revisions_read_from_the_scripts_are_alembics_own() -> None:
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config())
    assert script_revisions() == (scripts.get_current_head(),
                                  frozenset(s.revision for s in scripts.walk_revisions()))


def test_opening_a_ledger_at_head_neither_locks_nor_loads_alembic(db_url: str) -> None:
    # Every open after the first: one read of the revision, no migration lock (on SQLite that
    # is the database's write lock) and no Alembic import (most of a command's start-up).
    Ledger.open(db_url).close()
    code = ("import sys; from ledger import Ledger\n"
            f"Ledger.open({db_url!r}).close()\n"
            "print('alembic' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_newer_schema_is_refused_and_left_untouched(db_url: str) -> None:
    Ledger.open(db_url).close()
    eng = create_engine(normalize_url(db_url))
    with eng.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed9999'"))
    eng.dispose()
    with pytest.raises(SchemaTooNew, match="upgrade the ledger package"):
        Ledger.open(db_url)
    # A command's exit code: a set-up problem (2), like an older schema, not 1 (retry later).
    for argv in (["--db", db_url, "runs"], ["db", "init", db_url]):
        assert main(argv) == 2, argv
    eng = create_engine(normalize_url(db_url))
    with eng.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == \
            "f00dfeed9999"
    eng.dispose()


def test_sqlite_concurrent_migrations_converge(tmp_path: object) -> None:
    url = f"{tmp_path}/many.db"
    results = collect([spawn("migrate", url) for _ in range(6)])
    assert results == [{"ok": 1}] * 6
    assert _diff(url) == []
    con = sqlite3.connect(url)
    assert con.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)
    con.close()
    # The database's own lock serialized them: no lock file is left beside it.
    import pathlib
    left = sorted(p.name for p in pathlib.Path(str(tmp_path)).iterdir())
    assert [n for n in left if not n.startswith("many.db")] == []
    assert not [n for n in left if "lock" in n]


@pytest.mark.postgres
def test_postgres_concurrent_migrations_converge(pg_empty_url: str) -> None:
    results = collect([spawn("migrate", pg_empty_url) for _ in range(6)])
    assert results == [{"ok": 1}] * 6
    assert _diff(pg_empty_url) == []


def test_unopenable_urls_are_typed_errors(tmp_path: object) -> None:
    with pytest.raises(DatabaseSetupError, match="does not exist"):  # retrying cannot help
        Ledger.open(f"{tmp_path}/no/such/dir/x.db")
    with pytest.raises(InvalidArgument, match="SQLite \\*file\\*"):
        Ledger.open("sqlite://")
    with pytest.raises(InvalidArgument, match="unsupported database backend"):
        Ledger.open("mysql://u@h/db")
    with pytest.raises(InvalidArgument, match="empty database URL"):
        Ledger.open("")


def test_unreachable_postgres_is_database_unavailable() -> None:
    from ledger.testing.pgserver import free_port

    url = f"postgresql+psycopg://nobody:secret@127.0.0.1:{free_port()}/x"
    with pytest.raises(DatabaseUnavailable) as ei:
        Ledger.open(url)
    assert "secret" not in str(ei.value)


def test_migration_0007_keeps_the_latency_of_settled_attempts(db_url: str) -> None:
    """A ledger from before 0007 gets, from its settled and begin times, the latency of its
    succeeded, failed and not-sent Attempts: not of an unknown one (its settle time may be
    recovery's) nor of one an operator settled with evidence (it was unknown)."""
    from ledger import Budget, Price, Route
    from ledger.clock import ManualClock
    from ledger.domain.facts import Category, FailureFact, Phase

    clock = ManualClock(1_800_000_000.0)
    route = Route(id="a", provider="p", model="m", group="g", recipient="p", price=Price())
    fact = FailureFact(category=Category.SERVER_ERROR, status=500, phase=Phase.AFTER_HEADERS)
    outcomes = {"ok": ("succeeded", None), "bad": ("failed", fact),
                "never": ("not_sent", None), "lost": ("unknown", None),
                "receipt": ("unknown", None)}
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r", plan=[route], budget=Budget(max_calls=9, max_retries=0, max_cost=1))
        lease = led.acquire_lease("r", ttl_s=3600)
        for n, (name, (outcome, f)) in enumerate(outcomes.items(), start=1):
            att = led.begin_attempt(lease, route="a", envelope_hash="sha256:" + "d" * 64,
                                    reserve="0.01", attempt_id=name)
            clock.advance(float(n))  # each takes n seconds
            led.settle_attempt(lease, att.attempt_id, outcome=outcome, fact=f)
        led.settle_unknown("receipt", outcome="succeeded", by="ops", note="billing export")
        led.begin_attempt(lease, route="a", envelope_hash="sha256:" + "d" * 64, reserve="0.01",
                          attempt_id="flying")
    # Back to the schema before 0007 (its columns dropped), then open: migrated again.
    assert "latency_s" not in downgrade_schema(db_url, "0006")
    with Ledger.open(db_url, clock=clock) as led:
        got = {a.attempt_id: a.latency_s for a in led.timeline("r")}
        assert got == {"ok": 1.0, "bad": 2.0, "never": 3.0, "lost": None, "receipt": None,
                       "flying": None}
        assert all(a.first_byte_s is None and a.cached_tokens is None
                   for a in led.timeline("r"))
    assert _diff(db_url) == []


def test_migration_0010_counts_attempts_under_their_runs_labels_before_and_after(
        db_url: str) -> None:
    """Totals by label read the attempts' own copy of their Run's labels since 0010; the
    attempts written before it (the migration leaves them NULL: no rewrite of the history) are
    counted under their Run's labels all the same, and a begin after it copies them."""
    from ledger import Budget, Price, Route
    from ledger.clock import ManualClock
    from ledger.ops.audit import Audit

    clock = ManualClock(1_800_000_000.0)
    route = Route(id="a", provider="p", model="m", group="g", recipient="p",
                  price=Price(input_per_mtok=1))
    runs = {"r1": {"team": "red"}, "r2": {"team": "blue", "env": "prod"}, "r3": {}}
    leases = {}
    with Ledger.open(db_url, clock=clock) as led:
        for run_id, labels in runs.items():
            led.admit_run(run_id, plan=[route], labels=labels,
                          budget=Budget(max_calls=9, max_retries=0, max_cost=1))
            lease = leases[run_id] = led.acquire_lease(run_id, ttl_s=3600)
            att = led.begin_attempt(lease, route="a", envelope_hash="sha256:" + "d" * 64,
                                    reserve="0.01")
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded",
                               prompt_tokens=1000 * len(labels) + 7, completion_tokens=1)
        before = Audit(led).costs(by="label", label="team").items
    assert {(t.key, t.attempts) for t in before} == {("red", 1), ("blue", 1), (None, 1)}
    copied = ("SELECT a.run_id, a.labels, r.labels FROM attempts a "
              "JOIN runs r ON r.run_id = a.run_id ORDER BY a.run_id, a.seq")
    assert all(a is not None and a == r for _, a, r in _query(db_url, copied))
    assert "labels" not in downgrade_schema(db_url, "0009")
    with Ledger.open(db_url, clock=clock) as led:  # migrates to head again
        assert Audit(led).costs(by="label", label="team").items == before
        led.begin_attempt(leases["r2"], route="a", envelope_hash="sha256:" + "d" * 64,
                          reserve="0.01")
        got = {t.key: t.attempts for t in Audit(led).costs(by="label", label="env").items}
        assert got == {"prod": 2, None: 2}
    rows = _query(db_url, copied)
    assert [(run, a) for run, a, _ in rows] == [("r1", None), ("r2", None),
                                                ("r2", rows[2][2]), ("r3", None)]
    assert _diff(db_url) == []
