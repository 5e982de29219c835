"""Two retention runs at once (two processes, one database): one drops the old months, the
other drops nothing more, and what ``/metrics`` counted of the dropped history is carried
over once: its counters neither go down nor jump up (a false spike in every ``rate()``)."""

from __future__ import annotations

import fcntl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import Budget, Ledger
from ledger.clock import ManualClock
from ledger.errors import DatabaseUnavailable
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.storage.engine import normalize_url
from ledger.storage.hours import PG_HOUR_LOCK, hour_of
from tests.audit.test_retention_metrics import (
    DAY,
    END,
    _carried_keys_once,
    _no_decrease,
    _old_history,
    _scrape,
)
from tests.audit.test_rollups import _metrics, _sql

from .helpers import collect, spawn, sql_context
from .test_history_scales import HASH, ROUTE, _dump, _history, _t


def _at_once(url: str, tmp_path: Path, n: int = 2) -> list[dict[str, Any]]:
    """``n`` processes, each with its own ledger open at ``END``, calling the same
    ``drop_history`` at the same moment: each waits on a lock of a file the test holds until
    all are ready, then released together."""
    gate = tmp_path / "gate"
    gate.write_text("")
    ready = [tmp_path / f"ready-{k}" for k in range(n)]
    with open(gate) as g:
        fcntl.flock(g, fcntl.LOCK_EX)
        procs = [spawn("retention", url, int(END), gate, r) for r in ready]
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "a retention worker never got ready"
            assert all(p.poll() is None for p in procs), "a retention worker died"
            time.sleep(0.01)  # waiting for the workers to start, not for time to pass
        fcntl.flock(g, fcntl.LOCK_UN)
        return collect(procs)


def test_two_retentions_at_once_drop_once_and_carry_the_counters_once(
        db_url: str, tmp_path: Path) -> None:
    clock = ManualClock(END - 100 * DAY)
    with Ledger.open(db_url, clock=clock) as led:
        _old_history(led, clock, db_url)
        led.roll_up(lag=0)
        scraped = _scrape(led)
        metrics = _metrics(Audit(led))
        dry = led.drop_history(60 * DAY, dry_run=True)
        # Several old months to drop (on PostgreSQL, several partitions of each table).
        [(oldest,)] = _sql(db_url, "SELECT min(created_at) FROM attempts")
        assert oldest < dry.cutoff - 35 * DAY and dry.rows("attempts") > 0
    results = _at_once(db_url, tmp_path)
    # One drops what the dry run planned; the other waited for it to commit, then found
    # those months gone: it drops nothing and records a run that dropped nothing.
    assert sorted(bool(r.get("dropped")) for r in results) == [False, True], results
    first, second = sorted(results, key=lambda r: not r.get("dropped"))
    assert [tuple(p) for p in first["dropped"]] == [
        (p.table, p.partition, p.rows) for p in dry.dropped]
    assert second.get("dropped") == [] and second["event"] is not None, second
    with Ledger.open(db_url, clock=ManualClock(END)) as led:
        events = {e.event_id: e for e in Audit(led).actions(kinds=["retention"]).items}
        assert set(events) == {first["event"], second["event"]}
        assert events[second["event"]].data["dropped"] == []
        # What /metrics counted of the dropped months was carried over once: not lost, not
        # doubled (a counter jumping up at a retention run is a false spike).
        _carried_keys_once(db_url)
        _no_decrease(scraped, _scrape(led))
        assert _metrics(Audit(led)) == metrics
        books = reconcile(led)
        assert books.ok, books.violations
        assert led.drop_history(60 * DAY, dry_run=True).dropped == []


@pytest.mark.postgres
def test_a_retention_behind_another_in_progress_fails_typed_and_changes_nothing(
        pg_url: str, monkeypatch: Any) -> None:
    """The first run holds the retention lock until it commits; a second one waits for it up
    to the lock timeout, then fails as contention and changes nothing (its dry run too)."""
    from ledger.storage import retention

    monkeypatch.setattr(retention, "LOCK_TIMEOUT", "300ms")  # the test's patience, not 10 s
    inside, go_on = threading.Event(), threading.Event()
    carry = retention._carry

    def paused(*args: Any) -> Any:  # the first run waits here, its checks made
        if not inside.is_set():
            inside.set()
            assert go_on.wait(60)
        return carry(*args)

    monkeypatch.setattr(retention, "_carry", paused)
    clock = ManualClock(_t(2026, 1))
    with Ledger.open(pg_url, clock=clock) as led:
        _history(led, clock)
    clock.set(_t(2026, 8, 5))
    with Ledger.open(pg_url, clock=clock) as first, Ledger.open(pg_url, clock=clock) as led, \
            ThreadPoolExecutor(1) as pool:
        running = pool.submit(first.drop_history, 90 * DAY, by="alice", reason="90 days")
        try:
            assert inside.wait(60), "the first retention run never took its lock"
            before = _dump(pg_url)
            for dry_run in (False, True):
                with pytest.raises(DatabaseUnavailable) as ei:
                    led.drop_history(90 * DAY, by="bob", dry_run=dry_run)
                assert ei.value.fields["contention"] == "55P03"
                assert "another retention run" in str(ei.value), str(ei.value)
                assert "nothing was dropped or recorded" in str(ei.value)
            assert _dump(pg_url) == before
        finally:
            go_on.set()
        assert running.result(60).rows("attempts") == 3
        [record] = Audit(led).actions(kinds=["retention"]).items
        assert record.by == "alice"



@pytest.mark.postgres
def test_a_missing_history_partition_is_retryable_not_an_outdated_schema(
        pg_url: str, pg_empty_url: str) -> None:
    """A statement naming a month's partition that a retention run dropped (42P01 from the
    server) is a retryable ``DatabaseUnavailable`` naming the partition, not the schema's
    ``schema_outdated`` ("run db init", which would not help); a missing table of the schema
    still is ``schema_outdated``. Reads through ``attempts``/``events`` never get it: they
    lock the parent, so a drop waits for them (or they for it) and then they read what is
    left."""
    import psycopg

    from ledger.errors import DatabaseSetupError
    from ledger.storage.failure import ledger_error

    def refused(url: str, sql: str) -> psycopg.Error:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as c, \
                pytest.raises(psycopg.Error) as ei:
            c.execute(sql)
        assert ei.value.sqlstate == "42P01"
        return ei.value

    clock = ManualClock(_t(2026, 1))
    with Ledger.open(pg_url, clock=clock) as led:
        _history(led, clock)
        clock.set(_t(2026, 8, 5))
        gone = led.drop_history(90 * DAY, by="ops", reason="90 days").dropped
        assert {p.partition for p in gone} >= {"attempts_p202601", "events_p202601"}
        for name in ("attempts_p202601", "events_p202601"):
            told = ledger_error(refused(pg_url, f'SELECT count(*) FROM "{name}"'), "db")
            assert isinstance(told, DatabaseUnavailable), told
            assert not isinstance(told, DatabaseSetupError)
            assert told.fields["partition"] == name
            assert "history changed" in str(told) and "run it again" in str(told), str(told)
        # The reads of the ledger go on, over what is left.
        assert Audit(led).runs().items
    for sql in ("SELECT count(*) FROM attempts", "SELECT count(*) FROM events"):
        told = ledger_error(refused(pg_empty_url, sql), "db")
        assert isinstance(told, DatabaseSetupError), told
        assert told.fields["problem"] == "schema_outdated"



def _old_run(led: Ledger, clock: ManualClock, now: float, *, move: bool = False) -> None:
    """A finished Run "old" of January 2026 with one succeeded Attempt (and, with ``move``, a
    host's own ``move`` three hours later, in an hour without attempts); the clock back at
    ``now``."""
    clock.set(_t(2026, 1))
    led.admit_run("old", plan=[ROUTE], budget=Budget(max_calls=9, max_retries=0, max_cost=1))
    lease = led.acquire_lease("old", ttl_s=DAY)
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
    if move:
        clock.set(_t(2026, 1) + 3 * 3600)
        led.append_event(lease, "move", {"from_route": "a", "to_route": "b"})
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)
    clock.set(now)


@pytest.mark.postgres
@pytest.mark.parametrize("held", ["attempt", "move"])
def test_retention_takes_the_hour_locks_of_default_rows_before_the_tables_no_deadlock(
        pg_url: str, held: str) -> None:
    """Moving an old month's rows out of the default partition fires the roll-ups' row
    triggers (every attempt; a ``move``), each taking its row's hour lock shared. A roll-up
    holding one of those hours exclusive, then reading ``attempts``, would wait for
    retention's table locks while retention's trigger waited for the roll-up: retention takes
    the hours first, before any table lock, so it waits for the roll-up (which holds nothing
    retention needs) and the two go one after the other; neither is a deadlock's victim."""
    now = _t(2026, 8, 5)
    clock = ManualClock(now)  # opened in August: January gets no partition of its own
    with Ledger.open(pg_url, clock=clock) as led:
        _old_run(led, clock, now, move=True)  # its move in an hour without attempts
        assert {r[0] for r in _sql(pg_url, "SELECT tableoid::regclass::text FROM attempts "
                                   "UNION SELECT tableoid::regclass::text FROM events "
                                   "WHERE kind = 'move'")} == {"attempts_default",
                                                               "events_default"}
        hour = hour_of(_t(2026, 1) + (0 if held == "attempt" else 3 * 3600))
        engine = create_engine(normalize_url(pg_url))

        def waiting() -> bool:  # a session waits for an hour lock
            with engine.connect() as c:
                return bool(c.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND NOT granted AND classid = :k"), {"k": PG_HOUR_LOCK}).scalar_one())

        pool = ThreadPoolExecutor(1)
        try:
            with engine.connect() as rollup:  # a roll-up of the hour, locked as rollups.py does
                rollup.execute(text("SET LOCAL statement_timeout = '60s'"))
                assert sql_context(led).lock_hour(rollup, hour)
                ret = pool.submit(led.drop_history, 90 * DAY, by="ops", reason="90 days")
                deadline = time.monotonic() + 60
                while not (waiting() or ret.done()):
                    assert time.monotonic() < deadline, "retention never waited for the hour"
                    time.sleep(0.01)  # polling another session's lock wait, not passing time
                assert not ret.done(), ret.exception()
                # The roll-up reads its hour: no table lock of retention's is in its way.
                assert rollup.execute(text(
                    "SELECT count(*) FROM attempts WHERE run_id = 'old'")).scalar_one() == 1
                rollup.commit()
            report = ret.result(60)
        finally:
            pool.shutdown(wait=True)
            engine.dispose()
        assert report.rows("attempts") == 1, report
        assert {p.partition for p in report.dropped} == {"attempts_p202601", "events_p202601"}
        assert _sql(pg_url, "SELECT count(*) FROM attempts WHERE run_id = 'old'") == [(0,)]
        books = reconcile(led)
        assert books.ok, books.violations


@pytest.mark.postgres
def test_retention_refuses_an_hour_written_into_after_it_took_the_hours_rather_than_wait(
        pg_url: str, monkeypatch: Any) -> None:
    """A row written into an old month's default partition after retention took the hours
    of its rows (a writer with a clock months behind), in an hour a roll-up then holds: with
    the tables locked, retention does not wait for that hour (the roll-up's read would wait
    for retention: a deadlock); it fails typed, changes nothing, and the next run goes
    through."""
    from ledger.storage import retention

    now = _t(2026, 8, 5)
    clock = ManualClock(now)  # opened in August: January gets no partition of its own
    late = _t(2026, 1) + 5 * 3600
    engine = create_engine(normalize_url(pg_url))
    rollup = engine.connect()
    take = retention._lock_as_writers_do

    once: list[bool] = []

    def written_meanwhile(conn: Any) -> None:
        if not once:  # the first run only
            once.append(True)
            with engine.begin() as writer:  # a move of the old Run, in an hour of its own
                writer.execute(text(
                    "INSERT INTO events (run_id, kind, data, created_at) "
                    "VALUES ('old', 'move', '{}', :t)"), {"t": late})
            assert sql_context(led).lock_hour(rollup, hour_of(late))  # then rolled up
        take(conn)

    monkeypatch.setattr(retention, "_lock_as_writers_do", written_meanwhile)
    pool = ThreadPoolExecutor(1)
    try:
        with Ledger.open(pg_url, clock=clock) as led:
            _old_run(led, clock, now)
            ret = pool.submit(led.drop_history, 90 * DAY, by="ops", reason="90 days")
            deadline = time.monotonic() + 60
            while not ret.done() and not _sql(pg_url, (
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    f"AND NOT granted AND classid = {PG_HOUR_LOCK}"))[0][0]:
                assert time.monotonic() < deadline, "retention neither waited nor ended"
                time.sleep(0.01)  # polling another session's lock wait, not passing time
            # The roll-up reads its hour (it would wait for retention's table locks).
            assert rollup.execute(text(
                "SELECT count(*) FROM events WHERE kind = 'move'")).scalar_one() == 1
            rollup.commit()
            with pytest.raises(DatabaseUnavailable) as ei:
                ret.result(60)
            assert ei.value.fields["contention"] == "55P03", ei.value
            assert "roll-up" in str(ei.value) and "nothing was dropped" in str(ei.value)
            assert Audit(led).actions(kinds=["retention"]).items == []
            assert _sql(pg_url, "SELECT count(*) FROM attempts") == [(1,)]
            # Run again (the roll-up done): it goes through.
            report = led.drop_history(90 * DAY, by="ops", reason="90 days")
            assert report.rows("attempts") == 1 and report.rows("events") > 1
    finally:
        pool.shutdown(wait=True)
        rollup.close()
        engine.dispose()
