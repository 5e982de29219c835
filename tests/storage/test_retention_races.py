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

from ledger import Ledger
from ledger.clock import ManualClock
from ledger.errors import DatabaseUnavailable
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from tests.audit.test_retention_metrics import (
    DAY,
    END,
    _carried_keys_once,
    _no_decrease,
    _old_history,
    _scrape,
)
from tests.audit.test_rollups import _metrics, _sql

from .helpers import collect, spawn
from .test_history_scales import _dump, _history, _t


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
