"""attempts and events range-partitioned by created_at (PostgreSQL only)

On PostgreSQL, ``attempts`` and ``events`` become tables partitioned by range of
``created_at``: one partition per calendar month (UTC) named ``<table>_pYYYYMM``, and a
``<table>_default`` partition for any row no month covers, so an insert never fails. Retention
(``failover-ledger retention``) then drops whole months; ``ledger.storage.partitions`` creates
the coming months ahead.

PostgreSQL requires the partition key in every unique index of a partitioned table, so the
primary keys become ``(attempt_id, created_at)`` and ``(event_id, created_at)`` (a lookup by
id alone still uses them: the id is their first column) and ``attempts``' unique
``(run_id, seq)`` becomes ``(run_id, seq, created_at)``
(``uq_attempts_run_id_seq_created_at``). What the old keys guaranteed still
holds where it matters: a Run's ``seq`` is taken under the Run's row lock, event ids come from
one sequence, and a begin looks its attempt id up before it writes it.

An existing ledger is converted in the migrating transaction: a partitioned twin of each table
is created with the months its rows (and the next two months) fall in, the rows are copied,
the old table dropped and the twin renamed, then the keys and indexes are built on the
partitioned table. The tables are locked (ACCESS EXCLUSIVE) for the whole copy and index build,
so the ledger's writes wait: plan it like any table rewrite (see docs/operations.md). SQLite is
unchanged.

The downgrade copies the rows back into plain tables with the keys of 0007; it fails (and
changes nothing) if two attempts of a Run share a ``seq``, which the old key forbids.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from alembic import op
from sqlalchemy import text

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_MONTHS_AHEAD = 2

# table -> (primary key columns, unique constraints, foreign keys, indexes) after 0007.
_KEYS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "attempts": {
        "unique": [("uq_attempts_run_id_seq", "run_id, seq")],
        "fk": [("fk_attempts_run_id_runs", "(run_id) REFERENCES runs (run_id)")],
        "index": [
            ("ix_attempts_route_id_created_at", "route_id, created_at"),
            ("ix_attempts_group_id_created_at", "group_id, created_at"),
            ("ix_attempts_state_created_at", "state, created_at"),
            ("ix_attempts_category_created_at", "category, created_at"),
            ("ix_attempts_created_at", "created_at"),
            ("ix_attempts_tenant_created_at", "tenant, created_at"),
            ("ix_attempts_run_id_state", "run_id, state"),
        ],
    },
    "events": {
        "unique": [],
        "fk": [],
        "index": [
            ("ix_events_run_id_event_id", "run_id, event_id"),
            ("ix_events_kind_created_at", "kind, created_at"),
            ("ix_events_run_id_kind", "run_id, kind"),
        ],
    },
}
_PK = {"attempts": "attempt_id", "events": "event_id"}


def _month_after(year: int, month: int, n: int = 1) -> tuple[int, int]:
    k = year * 12 + (month - 1) + n
    return k // 12, k % 12 + 1


def _epoch(year: int, month: int) -> float:
    return datetime(year, month, 1, tzinfo=UTC).timestamp()


def _months() -> list[tuple[int, int]]:
    """The months (UTC) the rows of either table fall in, and this month and the next two."""
    conn = op.get_bind()
    found = conn.execute(text(
        "SELECT DISTINCT extract(year FROM t)::int, extract(month FROM t)::int FROM ("
        "SELECT to_timestamp(created_at) AT TIME ZONE 'UTC' AS t FROM attempts "
        "UNION SELECT to_timestamp(created_at) AT TIME ZONE 'UTC' FROM events) AS m "
        "WHERE t IS NOT NULL")).all()
    now = datetime.fromtimestamp(time.time(), UTC)
    months = {(int(y), int(m)) for y, m in found}
    months |= {_month_after(now.year, now.month, k) for k in range(_MONTHS_AHEAD + 1)}
    return sorted(months)


def _partition(table: str) -> None:
    """Replace ``table`` by a partitioned copy of it, rows, keys and indexes included."""
    twin = f"{table}_0008"
    op.execute(f"CREATE TABLE {twin} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
               "PARTITION BY RANGE (created_at)")
    for y, m in _months():
        ny, nm = _month_after(y, m)
        op.execute(f"CREATE TABLE {table}_p{y:04d}{m:02d} PARTITION OF {twin} "
                   f"FOR VALUES FROM ({_epoch(y, m)!r}) TO ({_epoch(ny, nm)!r})")
    op.execute(f"CREATE TABLE {table}_default PARTITION OF {twin} DEFAULT")
    op.execute(f"INSERT INTO {twin} SELECT * FROM {table}")
    _swap(table, twin, partitioned=True)


def _unpartition(table: str) -> None:
    """Replace the partitioned ``table`` by a plain copy of it with the keys of 0007."""
    twin = f"{table}_0007"
    op.execute(f"CREATE TABLE {twin} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    op.execute(f"INSERT INTO {twin} SELECT * FROM {table}")
    _swap(table, twin, partitioned=False)


def _swap(table: str, twin: str, *, partitioned: bool) -> None:
    """Drop ``table``, name ``twin`` after it, and build its keys and indexes: with
    ``created_at`` in the unique ones when ``partitioned`` (PostgreSQL requires it)."""
    seq = f"{table}_{_PK[table]}_seq"
    has_seq = op.get_bind().execute(text("SELECT to_regclass(:s) IS NOT NULL"),
                                    {"s": seq}).scalar()
    if has_seq:  # the twin's default uses the sequence; it must outlive the old table
        op.execute(f"ALTER SEQUENCE {seq} OWNED BY NONE")
    op.execute(f"DROP TABLE {table}")
    op.execute(f"ALTER TABLE {twin} RENAME TO {table}")
    if has_seq:
        op.execute(f"ALTER SEQUENCE {seq} OWNED BY {table}.{_PK[table]}")
    key = ", created_at" if partitioned else ""
    keys = _KEYS[table]
    op.execute(f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY ({_PK[table]}{key})")
    for name, cols in keys["unique"]:
        if partitioned:
            name += "_created_at"
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} UNIQUE ({cols}{key})")
    for name, ref in keys["fk"]:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY {ref}")
    for name, cols in keys["index"]:
        op.execute(f"CREATE INDEX {name} ON {table} ({cols})")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in ("attempts", "events"):
        op.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    _partition("attempts")
    _partition("events")
    op.execute("ANALYZE attempts")
    op.execute("ANALYZE events")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in ("attempts", "events"):
        op.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    _unpartition("attempts")
    _unpartition("events")
