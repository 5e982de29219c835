"""A retention run on SQLite deletes old history in slices, each its own write transaction
with its own ``retention`` event, and lets go of the write lock between them: the ledger's
writers wait for one slice, never for the whole run. In one transaction a run held the lock
for 11.6 s at 300,000 attempts, and a larger history passed the writers' busy timeout: no
call could be recorded, so none could leave (invariant 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ledger import Budget, Ledger
from ledger.clock import ManualClock
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.storage import retention
from tests.audit.test_retention_metrics import (
    DAY,
    END,
    _carried_keys_once,
    _no_decrease,
    _old_history,
    _scrape,
)
from tests.audit.test_rollups import _metrics

from .test_history_scales import ROUTE


def test_a_sqlite_retention_lets_writers_in_between_its_slices_and_records_each(
        tmp_path: Path, monkeypatch: Any) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    clock = ManualClock(END - 100 * DAY)
    with Ledger.open(url, clock=clock) as led:
        _old_history(led, clock, url)
        led.roll_up(lag=0)
        scraped, metrics = _scrape(led), _metrics(Audit(led))
        clock.set(END)
        dry = led.drop_history(60 * DAY, dry_run=True)
    assert dry.rows("attempts") > 100

    # Another process's writer that will not wait at all (a busy timeout of 0): each of its
    # writes between two slices lands only if retention let go of the write lock.
    other = Ledger.open(f"{url}?timeout=0", clock=ManualClock(END), migrate_schema=False)
    admitted: list[str] = []

    def between_slices() -> None:
        run_id = f"between-{len(admitted)}"
        other.admit_run(run_id, plan=[ROUTE],
                        budget=Budget(max_calls=1, max_retries=0, max_cost=1))
        admitted.append(run_id)

    monkeypatch.setattr(retention, "SQLITE_SLICE_ROWS", 40, raising=False)
    monkeypatch.setattr(retention, "_pause", between_slices, raising=False)
    try:
        with Ledger.open(url, clock=ManualClock(END)) as led:
            done = led.drop_history(60 * DAY, by="ops", reason="keep 60 days")
            events = Audit(led).actions(kinds=["retention"]).items
            # Exactly what the dry run planned went, slice by slice.
            assert [(p.table, p.rows) for p in done.dropped] == [
                (p.table, p.rows) for p in dry.dropped]
            assert (done.kept, done.actions_kept) == (dry.kept, dry.actions_kept)
            slices = sorted(events, key=lambda e: e.event_id)
            assert len(slices) >= 3 and len(admitted) == len(slices) - 1
            assert done.event is not None and done.event.event_id == slices[-1].event_id
            assert [e.data["slice"]["last"] for e in slices] == [False] * (len(slices) - 1) + [True]
            # Each slice recorded what it dropped: together, all of it.
            for table in ("attempts", "events"):
                assert sum(e.data["rows"][table] for e in slices) == dry.rows(table)
            assert all(e.data["rows"]["attempts"] <= 40 for e in slices)
            ends = [e.data["slice"]["until"] for e in slices]
            assert ends == sorted(ends) and ends[-1] == dry.cutoff
            # What /metrics counted of the dropped history was carried over once.
            _carried_keys_once(url)
            # (the Runs admitted between slices are new Runs: counted once more each)
            scraped[("ledger_runs_total", (("ledger_tenant", ""),))] += len(admitted)
            _no_decrease(scraped, _scrape(led))
            metrics["metrics runs"]["None"] += len(admitted)
            assert _metrics(Audit(led)) == metrics
            assert reconcile(led).ok
            assert led.drop_history(60 * DAY, dry_run=True).dropped == []
            assert all(led.get_run(r) is not None for r in admitted)
    finally:
        other.close()
