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
