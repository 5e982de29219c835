"""A retention dry run only reads: on SQLite it takes no write lock (it ran in ``BEGIN
IMMEDIATE``, so it failed on a read-only file and waited behind every writer), and the same
report comes back as from a writable ledger, whose real run then drops exactly that."""

from __future__ import annotations

import sqlite3
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ledger import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import Retention

from .test_driver_errors import _unprivileged
from .test_history_scales import _history, _t

DAY = 86400.0
NOW = _t(2026, 8, 5)


def _report(r: Retention) -> dict[str, Any]:
    """What a retention report says, as JSON would carry it."""
    return {"cutoff": r.cutoff, "dry_run": r.dry_run, "actions_kept": r.actions_kept,
            "dropped": [list(asdict(p).values()) for p in r.dropped],
            "kept": [list(asdict(p).values()) for p in r.kept]}


def _old_ledger(path: str) -> dict[str, Any]:
    """A SQLite ledger with months of history, and its dry run's report at ``NOW``."""
    clock = ManualClock(_t(2026, 1))
    with Ledger.open(path, clock=clock) as led:
        _history(led, clock)
        clock.set(NOW)
        report = led.drop_history(90 * DAY, dry_run=True)
    assert report.rows("attempts") > 0 and report.kept  # something to drop, something held
    return _report(report)


# A process that may only read the file: its dry run's report, or its error.
_CHILD = """\
import json, sys
from dataclasses import asdict
from ledger import Ledger
from ledger.clock import ManualClock
try:
    with Ledger.open(sys.argv[1], clock=ManualClock(float(sys.argv[2])),
                     migrate_schema=False) as led:
        r = led.drop_history(90 * 86400, dry_run=True)
    print(json.dumps({"cutoff": r.cutoff, "dry_run": r.dry_run,
                      "actions_kept": r.actions_kept,
                      "dropped": [list(asdict(p).values()) for p in r.dropped],
                      "kept": [list(asdict(p).values()) for p in r.kept]}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def test_a_sqlite_retention_dry_run_only_reads_so_a_read_only_file_gets_the_same_report(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.db")
    expected = _old_ledger(path)
    files = [p for p in tmp_path.iterdir() if p.name.startswith("ledger.db")]
    for p in files:
        p.chmod(0o444)
    try:
        got = _unprivileged(["-c", _CHILD, path, repr(NOW)])
    finally:
        for p in files:
            p.chmod(0o644)
    assert got == expected
    # The real run, on the writable file, drops exactly what the dry run reported.
    with Ledger.open(path, clock=ManualClock(NOW)) as led:
        done = led.drop_history(90 * DAY, by="ops", reason="keep 90 days")
    assert {**_report(done), "dry_run": True} == expected and done.event is not None


def test_a_sqlite_retention_dry_run_does_not_wait_for_a_writer_holding_the_write_lock(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.db")
    expected = _old_ledger(path)
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # another writer of the ledger, mid-transaction
        # A busy timeout of 0: a dry run that asked for the write lock would fail at once.
        with Ledger.open(f"sqlite:///{path}?timeout=0", clock=ManualClock(NOW),
                         migrate_schema=False) as led:
            assert _report(led.drop_history(90 * DAY, dry_run=True)) == expected
        writer.execute("ROLLBACK")
    finally:
        writer.close()
    with Ledger.open(path, clock=ManualClock(NOW)) as led:
        done = led.drop_history(90 * DAY, by="ops", reason="keep 90 days")
    assert {**_report(done), "dry_run": True} == expected
