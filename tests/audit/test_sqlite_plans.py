"""On SQLite, health, /metrics and the totals never walk a whole table to find a few rows:
EXPLAIN QUERY PLAN of every SELECT that :meth:`Audit.health`, :meth:`Audit.metrics`,
:meth:`Audit.costs` and :meth:`Audit.spend` send shows no SCAN of ``runs``, ``attempts`` or
``events`` (a walk of a whole index in its order included).

Two plans SQLite's planner once chose (docs/benchmarks.md): with no statistics for a table
that was empty when the ledger was last ANALYZEd (``group_slots`` between bursts), health
walked every Run to look up each one's capacity slots; and grouped by a column with an index,
/metrics' read of the rows outside the rolled hours walked that whole index in the group's
order (1.1 s a scrape at 500,000 attempts), and so did the whole history's costs and spend.
Each is read with and without statistics.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.generate import generate
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.ops.audit import Audit
from tests.audit.sent import sent_selects
from tests.storage.helpers import sql_context

END = 1_700_000_000.0
#: The tables no read of health or /metrics may walk whole.
WHOLE = ("runs", "attempts", "events")


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "ledger.db"
    with Ledger.open(f"sqlite:///{path}", clock=ManualClock(END)) as led:
        generate(led, attempts=3_000, days=2, end=END, seed=11)  # ends with ANALYZE
        led.roll_up()  # as cron would: /metrics reads the rolled hours' totals
    return path


@pytest.fixture(params=["analyzed_with_no_slot_held", "never_analyzed"])
def audit(request: pytest.FixtureRequest, history: Path, tmp_path: Path) -> Iterator[Audit]:
    path = tmp_path / "ledger.db"
    shutil.copyfile(history, path)
    with sqlite3.connect(path) as conn:  # statistics are read when a connection opens
        if request.param == "never_analyzed":
            conn.execute("DROP TABLE sqlite_stat1")
        else:
            conn.execute("DELETE FROM sqlite_stat1 WHERE tbl = 'group_slots'")
    led = Ledger.open(f"sqlite:///{path}", clock=ManualClock(END), migrate_schema=False)
    try:
        yield Audit(led)
    finally:
        led.close()


def _scans(audit: Audit, call: Any) -> list[tuple[str, str]]:
    """Run ``call``; EXPLAIN QUERY PLAN every SELECT it sent; its full scans of the history
    and the Runs, as (statement, plan line)."""
    sent = sent_selects(audit, call)
    assert sent, "the call sent no SELECT"
    out = []
    with sql_context(audit.ledger).engine.connect() as conn:
        for sql, params in sent:
            for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params):
                detail = str(row[-1])
                if detail.startswith("SCAN ") and detail.split()[1] in WHOLE:
                    out.append((sql, detail))
    return out


def test_health_on_sqlite_never_walks_every_run_or_attempt(audit: Audit) -> None:
    assert _scans(audit, lambda: audit.health(now=END)) == []


def test_metrics_on_sqlite_read_ranges_not_whole_indexes(audit: Audit) -> None:
    assert _scans(audit, lambda: audit.metrics(END)) == []


@pytest.mark.parametrize("read", ["costs_by_route", "costs_by_tenant", "costs_by_group",
                                  "spend_by_tenant"])
def test_the_whole_historys_totals_on_sqlite_read_ranges_not_whole_indexes(
        audit: Audit, read: str) -> None:
    # No window: the rows the roll-ups leave begin with an open range (before the first
    # rolled hour), the case the planner walked the grouping column's index for.
    what, by = read.split("_by_")
    call = getattr(audit, what)
    assert _scans(audit, lambda: call(by=by)) == []
