"""PostgreSQL's partitions of the ledger's history: one per calendar month (UTC) of ``created_at``.

Migration 0008 makes ``attempts`` and ``events`` range-partitioned by ``created_at`` on
PostgreSQL (SQLite keeps plain tables). Each has monthly partitions named
``<table>_pYYYYMM`` (``[first instant of the month, first instant of the next)``, in epoch
seconds, the unit of ``created_at``) and a ``<table>_default`` partition that takes any row no
monthly partition covers, so an insert never fails for want of a partition.

:func:`ensure_partitions` creates the months ahead (the current one and :data:`MONTHS_AHEAD`
more) when a ledger opens with ``migrate_schema`` and when retention runs: rows keep landing in
monthly partitions, which retention can later drop whole. It is cheap when nothing is missing
(one catalog read, no lock), serialized between processes by an advisory lock when something
is, and gives up (a warning; the default partition takes the rows) rather than queue behind a
long lock or fail an open for want of the privilege to create tables.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from ledger.storage.schema import PARTITIONED_KEYS

if TYPE_CHECKING:
    from ledger.storage.context import SqlContext

log = logging.getLogger(__name__)

#: The tables partitioned by ``created_at`` on PostgreSQL (their keys: the schema's).
PARTITIONED = tuple(PARTITIONED_KEYS)
#: Months created ahead of the current one.
MONTHS_AHEAD = 2
#: How long creating a partition waits for the table's lock before giving up (it must not
#: queue the ledger's writes behind a long audit read).
LOCK_TIMEOUT = "2s"

_NAME = re.compile(r"^(attempts|events)_(?:p(\d{4})(\d{2})|default)$")
# Any constant works; it differs from the migration lock's (held while migrating).
_PG_PARTITION_LOCK = 0x1ED6E6


@dataclass(frozen=True)
class Partition:
    """One partition of a partitioned table: ``since``/``until`` its range (``None`` for the
    default partition, which takes what no range covers)."""

    table: str
    name: str
    since: float | None
    until: float | None


def is_partition_name(name: str) -> bool:
    """Whether ``name`` is one of the partitions this module makes (not a declared table)."""
    return _NAME.match(name) is not None


def month_of(t: float) -> tuple[int, int]:
    """The (year, month) in UTC of epoch time ``t``."""
    d = datetime.fromtimestamp(t, UTC)
    return d.year, d.month


def month_after(year: int, month: int, n: int = 1) -> tuple[int, int]:
    """The month ``n`` months after (``year``, ``month``)."""
    k = year * 12 + (month - 1) + n
    return k // 12, k % 12 + 1


def month_range(year: int, month: int) -> tuple[float, float]:
    """``[since, until)`` of a month, in epoch seconds."""
    ny, nm = month_after(year, month)
    return (datetime(year, month, 1, tzinfo=UTC).timestamp(),
            datetime(ny, nm, 1, tzinfo=UTC).timestamp())


def partition_name(table: str, year: int, month: int) -> str:
    """The name of ``table``'s partition of a month: ``attempts_p202612``."""
    return f"{table}_p{year:04d}{month:02d}"


def partitions(conn: Connection, table: str) -> list[Partition]:
    """``table``'s partitions this module made, oldest first, the default one last."""
    rows = conn.execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent "
        "WHERE p.relname = :t AND p.relnamespace = to_regnamespace(current_schema())::oid"),
        {"t": table}).scalars().all()
    out: list[Partition] = []
    for name in rows:
        m = _NAME.match(name)
        if m is None or m.group(1) != table:
            continue  # someone else's partition: never touched
        if m.group(2) is None:
            out.append(Partition(table, name, None, None))
        else:
            since, until = month_range(int(m.group(2)), int(m.group(3)))
            out.append(Partition(table, name, since, until))
    return sorted(out, key=lambda p: (p.since is None, p.since or 0.0))


def is_partitioned(conn: Connection, table: str) -> bool:
    """Whether ``table`` is a partitioned table (PostgreSQL, after migration 0008)."""
    kind = conn.execute(text(
        "SELECT relkind FROM pg_class WHERE relname = :t "
        "AND relnamespace = to_regnamespace(current_schema())::oid"), {"t": table}).scalar()
    return kind == "p"


def wanted_months(now: float, ahead: int = MONTHS_AHEAD,
                  since: float | None = None) -> list[tuple[int, int]]:
    """The month of ``now`` and ``ahead`` more, and the months from ``since``'s to it."""
    y, m = month_of(now)
    back = 0
    if since is not None and since < now:
        sy, sm = month_of(since)
        back = (y * 12 + m) - (sy * 12 + sm)
    return [month_after(y, m, k) for k in range(-back, ahead + 1)]


def missing(conn: Connection, months: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """Which of ``months`` lack a partition, per partitioned table: (table, year, month)."""
    out: list[tuple[str, int, int]] = []
    for table in PARTITIONED:
        if not is_partitioned(conn, table):
            continue
        have = {p.name for p in partitions(conn, table)}
        out += [(table, y, m) for y, m in months if partition_name(table, y, m) not in have]
    return out


def create_partition(conn: Connection, table: str, year: int, month: int) -> str:
    """Create ``table``'s partition of a month on ``conn`` (in its transaction), moving the
    rows of that month the default partition took meanwhile into it (PostgreSQL refuses a
    new partition whose range the default partition holds rows of). Returns its name."""
    name = partition_name(table, year, month)
    since, until = month_range(year, month)
    default = f"{table}_default"
    bounds = {"lo": since, "hi": until}
    held = conn.execute(text(
        f'SELECT count(*) FROM "{default}" WHERE created_at >= :lo AND created_at < :hi'),
        bounds).scalar()
    if held:
        conn.execute(text(f'CREATE TEMP TABLE "_moving_{name}" AS SELECT * FROM "{default}" '
                          "WHERE created_at >= :lo AND created_at < :hi"), bounds)
        conn.execute(text(f'DELETE FROM "{default}" WHERE created_at >= :lo AND created_at < :hi'),
                     bounds)
    conn.execute(text(f'CREATE TABLE "{name}" PARTITION OF "{table}" '
                      f"FOR VALUES FROM ({since!r}) TO ({until!r})"))
    if held:
        conn.execute(text(f'INSERT INTO "{table}" SELECT * FROM "_moving_{name}"'))
        conn.execute(text(f'DROP TABLE "_moving_{name}"'))
    return name


def ensure_partitions(ctx: SqlContext, now: float, ahead: int = MONTHS_AHEAD, *,
                      since: float | None = None) -> list[str]:
    """Create the partitions of the month of ``now`` and ``ahead`` more (and of the months
    back to ``since``'s, for a bulk load of history) that are missing; returns their
    names (empty when nothing was missing, or on a database whose history is not
    partitioned: SQLite, or PostgreSQL before migration 0008).

    One catalog read when nothing is missing. Otherwise one transaction per partition,
    under an advisory lock (other processes wait, then find the partitions made) and with a
    short lock timeout. A role that may not create tables, a read-only server, or a table
    locked for longer than :data:`LOCK_TIMEOUT`, leaves the months to the default partition,
    with a warning: an open never fails for it, and the next open or retention run tries
    again.
    """
    if not ctx.partitioned:
        return []
    months = wanted_months(now, ahead, since)
    made: list[str] = []
    with ctx.engine.connect() as conn:
        todo = missing(conn, months)
        conn.rollback()
        # One transaction per partition: it never holds one table's lock while it waits for
        # the other's (a ledger write holding the other could then deadlock with it).
        for table, y, m in todo:
            try:
                with conn.begin():
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                                 {"k": _PG_PARTITION_LOCK})
                    ctx.bounded_locks(conn, LOCK_TIMEOUT)
                    if partition_name(table, y, m) in {p.name for p in partitions(conn, table)}:
                        continue  # another process made it while this one waited
                    made.append(create_partition(conn, table, y, m))
            except DBAPIError as e:
                code = getattr(e.orig, "sqlstate", None)
                # Insufficient privilege, a lock not available, a read-only server (a
                # standby): the months are left to the default partitions.
                if code not in ("42501", "55P03", "25006"):
                    raise
                log.warning("the ledger could not create the partitions of the coming "
                            "months (%s); rows land in the default partitions until it can: "
                            "open the ledger, or run `failover-ledger retention`, as the "
                            "schema's owner", str(e.orig).strip().splitlines()[0])
                break
    return made


__all__ = [
    "LOCK_TIMEOUT",
    "MONTHS_AHEAD",
    "PARTITIONED",
    "Partition",
    "create_partition",
    "ensure_partitions",
    "is_partition_name",
    "is_partitioned",
    "missing",
    "month_after",
    "month_of",
    "month_range",
    "partition_name",
    "partitions",
    "wanted_months",
]
