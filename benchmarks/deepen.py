"""Deepen a generated history: copies of its finished Runs, shifted back in time, written by the
database itself (``python -m benchmarks deepen``).

What the audit benchmarks at ten or a hundred million Attempts have to show is that a day's
queries cost what the day holds, however much history lies behind it. The bulk generator
(:mod:`benchmarks.generate`) simulates every Run in Python, about half a millisecond of CPU per
Attempt: ten million would take an hour and a half on one core. This module takes a generated
span instead and copies its finished Runs ``copies`` times, each copy ``span`` further back,
with ``INSERT ... SELECT`` statements the database runs on its own (one per table and copy):

* every id that names a Run, an Attempt, a turn, a debit or a provenance reference gets a
  suffix naming its copy (``~d3``), so keys stay unique and every copy is a whole, consistent
  history (``failover-ledger reconcile`` finds nothing to report);
* every point in time moves back by ``k * span`` (durations such as ``latency_s`` stay);
* events get new ids in their original order;
* Runs still in flight at the recent end of the span are not copied: history holds finished
  Runs, and the open-attempt pages keep reading only the recent ones.

The newest span is left as it was generated, so ``bench audit`` (which reads the newest day)
measures the same day with more history behind it. Like the generator it bypasses the ledger's
write path on purpose; it is for throwaway benchmark databases only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Table, and_, func, literal, or_, select
from sqlalchemy.engine import Connection

from benchmarks.bulk import analyze, history_bounds
from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.domain.records import RunStatus
from ledger.errors import InvalidArgument, NotFound
from ledger.storage import schema as s
from ledger.storage.failure import mapped
from ledger.storage.partitions import ensure_partitions

DAY = 86_400.0
#: Columns that identify a Run's own records: suffixed in each copy.
IDS = frozenset({"run_id", "parent_run_id", "attempt_id", "debit_id", "turn_id", "ref"})
#: Columns that are points in time: moved back in each copy (durations are not).
TIMES = frozenset({"created_at", "updated_at", "settled_at", "deadline", "lease_expires_at"})
#: What a copy holds, parents first.
TABLES = ("runs", "debits", "attempts", "events", "provenance")
FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED)


@dataclass
class Deepened:
    """What :func:`deepen` wrote: rows per table, the span, and the history's new bounds."""

    copies: int
    span_s: float
    rows: dict[str, int] = field(default_factory=dict)
    since: float = 0.0
    until: float = 0.0
    seconds: float = 0.0


def _copy_of(table: Table, k: int, shift: float) -> list[ColumnElement[Any]]:
    """The select list of copy ``k``: each column as it is, suffixed, or moved back."""
    out: list[ColumnElement[Any]] = []
    for col in table.columns:
        if table.name == "events" and col.name == "event_id":
            continue  # a new id, in the original order
        if col.name in IDS:
            out.append((col + literal(f"~d{k}")).label(col.name))
        elif col.name in TIMES:
            out.append((col - literal(shift)).label(col.name))
        else:
            out.append(col)
    return out


def _finished_runs(since: float) -> Any:
    """The ids of the base span's finished Runs whose parent (if any) is finished too: a copy
    never references a parent it did not copy."""
    r = s.runs.c
    parent = s.runs.alias("parent")
    done = r.status.in_([x.value for x in FINISHED])
    parent_done = select(parent.c.run_id).where(
        parent.c.run_id == r.parent_run_id, parent.c.status.in_([x.value for x in FINISHED]),
        parent.c.created_at >= since).exists()
    return select(r.run_id).where(r.created_at >= since, done,
                                  or_(r.parent_run_id.is_(None), parent_done))


def _source(table: Table, since: float) -> Any:
    """The base span's rows of ``table`` that belong to the Runs :func:`_finished_runs` copies."""
    return and_(table.c.created_at >= since, table.c.run_id.in_(_finished_runs(since)))


def _count(conn: Connection, name: str, since: float) -> int:
    """How many rows of ``name`` a copy writes (every copy writes the same)."""
    table = s.metadata.tables[name]
    return int(conn.execute(select(func.count()).select_from(table)
                            .where(_source(table, since))).scalar_one())


def _copy_table(conn: Connection, name: str, k: int, shift: float, since: float) -> None:
    table = s.metadata.tables[name]
    copied = _copy_of(table, k, shift)
    src = select(*copied).where(_source(table, since))
    if name == "events":
        src = src.order_by(table.c.event_id)
    # The driver's row count of an INSERT ... SELECT is not reliable everywhere (-1 on some):
    # the counts come from _count instead.
    conn.execute(table.insert().from_select([c.name for c in copied], src))


def deepen(led: Ledger, copies: int, *, span_s: float | None = None,
           progress: Callable[[int, int], None] | None = None) -> Deepened:
    """Copy the ledger's history ``copies`` times, each ``span_s`` further back (default: the
    history's span, rounded up to whole days). One transaction per copy, so a copy is all there
    or not at all. Raises :class:`~ledger.errors.InvalidArgument` (``copies`` < 1, a span
    shorter than the history's) and :class:`~ledger.errors.NotFound` (no history).
    """
    if copies < 1:
        raise InvalidArgument("--copies must be >= 1", field="copies")
    first, hi = history_bounds(led)
    if first is None or hi is None:
        raise NotFound("the ledger holds no attempts to copy; fill it with generate first")
    ctx = storage_of(led).context
    with mapped(ctx.where), ctx.engine.connect() as conn:
        admitted = conn.execute(select(func.min(s.runs.c.created_at))).scalar()
    lo = min(first, admitted if admitted is not None else first)  # a Run precedes its Attempts
    need = max(DAY, math.ceil((hi - lo) / DAY) * DAY)
    span = need if span_s is None else span_s
    if span < hi - lo:
        raise InvalidArgument(
            f"--span-days must cover the history ({(hi - lo) / DAY:.2f} days) so that copies "
            "do not overlap it; pass a longer span or leave it out", field="span")
    with mapped(ctx.where), ctx.engine.connect() as conn:
        each = {name: _count(conn, name, lo) for name in TABLES}
    report = Deepened(copies=copies, span_s=span, rows=dict.fromkeys(TABLES, 0))
    # The partitions of the months the copies reach, made before anything lands in them (on a
    # partitioned PostgreSQL ledger; nothing elsewhere).
    with mapped(ctx.where):
        ensure_partitions(ctx, hi, since=lo - copies * span)
    t0 = time.monotonic()
    for k in range(1, copies + 1):
        with mapped(ctx.where), ctx.engine.begin() as conn:
            for name in TABLES:
                _copy_table(conn, name, k, k * span, lo)
                report.rows[name] += each[name]
        if progress is not None:
            progress(k, copies)
    analyze(led)
    report.seconds = time.monotonic() - t0
    report.since, report.until = lo - copies * span, hi
    return report


__all__ = ["FINISHED", "IDS", "TABLES", "TIMES", "Deepened", "deepen"]
