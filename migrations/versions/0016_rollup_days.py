"""rollup_days: old hours of the roll-ups folded into days

The roll-ups keep one set of rows per hour, so every whole-history read (``/metrics`` at every
scrape, the totals since the start) read more roll-up rows the longer the ledger had run: at ten
million attempts over seventy days a scrape read 69,000 ``metric_rollups`` rows, 90,000
``move_rollups`` rows and 108,000 ``run_rollups`` rows. The roll-up job now folds each UTC day
whose 24 hours are all rolled, once it is old enough (``--fold-after``, 8 days by default),
into one set of rows per day: every roll-up table's rows of the day are summed per key into
rows at the day's first hour, and the day is marked in ``rollup_days``. The day's 24 hours stay
marked in ``rollup_hours``; a read whose window (or bucket) holds the whole day reads the day's
rows, any other reads the day from the tables (``ledger.storage.hours.rolled_stretches``).

Why this stays exact: the trigger that undoes an hour when one of its rows is written (0011,
0013) now also undoes the hour's day when the day is folded: the day's mark, its rows and the
marks of its 24 hours go, and the next roll-up redoes those hours one by one. It does so only
where it already found the hour marked, so a write to an hour not rolled (nearly every write)
pays nothing more. On PostgreSQL the fold takes the exclusive advisory locks of the day's 24
hours, without waiting (a day whose hour a writer holds is folded by a later run), so a write
committed while the fold read is never missed.

Existing ledgers: the table is created empty; nothing is folded until the next roll-up. The
downgrade unfolds every folded day (its rows and its hours' marks go, and 0015's roll-up redoes
the hours) and restores 0013's trigger bodies.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_ROLLUPS = ("attempt_rollups", "metric_rollups", "move_rollups", "wait_rollups", "run_rollups")

# 0013's trigger function, as it stands after 0015 (the {day} slot empty), and with the day.
_PG_FUNCTION = """
CREATE OR REPLACE FUNCTION ledger_attempts_unroll() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t double precision;
    h bigint;
    d bigint;
BEGIN
    FOR i IN 1..2 LOOP
        IF i = 1 AND TG_OP <> 'DELETE' THEN
            t := NEW.created_at;
        ELSIF i = 2 AND TG_OP <> 'INSERT'
                AND (TG_OP = 'DELETE' OR OLD.created_at IS DISTINCT FROM NEW.created_at) THEN
            t := OLD.created_at;
        ELSE
            CONTINUE;
        END IF;
        h := floor(t / 3600);
        IF h * 3600 > t THEN
            h := h - 1;
        END IF;
        PERFORM pg_advisory_xact_lock_shared(7894, (h % 2147483648)::integer);
        DELETE FROM rollup_hours WHERE hour = h;
        IF FOUND THEN
            DELETE FROM attempt_rollups WHERE hour = h;
            DELETE FROM metric_rollups WHERE hour = h;
            DELETE FROM move_rollups WHERE hour = h;
            DELETE FROM wait_rollups WHERE hour = h;
            DELETE FROM run_rollups WHERE hour = h;{day}
        END IF;
    END LOOP;
    RETURN NULL;
END
$$
"""
# A folded day's rows sit at its first hour; its hours are all marked, so only a write whose
# hour was found marked can be in one.
_PG_DAY = """
            d := floor(h / 24.0);
            DELETE FROM rollup_days WHERE day = d;
            IF FOUND THEN
                DELETE FROM rollup_hours WHERE hour >= d * 24 AND hour < d * 24 + 24;
                DELETE FROM attempt_rollups WHERE hour = d * 24;
                DELETE FROM metric_rollups WHERE hour = d * 24;
                DELETE FROM move_rollups WHERE hour = d * 24;
                DELETE FROM wait_rollups WHERE hour = d * 24;
                DELETE FROM run_rollups WHERE hour = d * 24;
            END IF;"""

# SQLite: each trigger (0013, 0014) ends with ``DELETE FROM rollup_hours WHERE hour = <its
# row's hour>; END``. The day's statements go first, before that hour's mark is gone; they are
# spliced into the triggers as they stand rather than restated, so that the WHEN clauses 0013
# and 0014 wrote stay theirs.
_SQLITE_LAST = re.compile(r"DELETE FROM rollup_hours WHERE hour = (.+); END$", re.S)
_SQLITE_MARK = "/* 0016 day */ "


def _sqlite_day(hour: str) -> str:
    day = f"({hour} / 24 - ({hour} / 24 * 24 > {hour}))"  # floor, for negative hours too
    folded = f"EXISTS (SELECT 1 FROM rollup_days WHERE day = {day})"
    rows = " ".join(f"DELETE FROM {t} WHERE hour = {day} * 24 AND {folded};" for t in _ROLLUPS)
    return (f"{_SQLITE_MARK}{rows} DELETE FROM rollup_hours WHERE hour >= {day} * 24 "
            f"AND hour < {day} * 24 + 24 AND {folded}; "
            f"DELETE FROM rollup_days WHERE day = {day}; {_SQLITE_MARK}")


def _sqlite_triggers(fold: bool) -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.text(
        "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND name LIKE '%_unroll_%'"
    )).all()
    assert len(rows) == 10, rows  # attempts' four, events' two, runs' four
    for name, sql in rows:
        if fold:
            hour = _SQLITE_LAST.search(sql)
            assert hour is not None, sql
            head, tail = sql.split(" BEGIN ", 1)
            new = f"{head} BEGIN {_sqlite_day(hour.group(1))}{tail}"
        else:
            start, _day, end = sql.split(_SQLITE_MARK, 2)
            new = start + end
        op.execute(f"DROP TRIGGER {name}")
        op.execute(new)


def upgrade() -> None:
    op.create_table(
        "rollup_days",
        sa.Column("day", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("folded_at", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("day"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION.replace("{day}", _PG_DAY))
    else:
        _sqlite_triggers(fold=True)


def downgrade() -> None:
    bind = op.get_bind()
    for (day,) in bind.execute(sa.text("SELECT day FROM rollup_days")).all():
        first = {"lo": int(day) * 24, "hi": int(day) * 24 + 24}
        for table in _ROLLUPS:
            bind.execute(sa.text(f"DELETE FROM {table} WHERE hour = :lo"), first)
        bind.execute(sa.text("DELETE FROM rollup_hours WHERE hour >= :lo AND hour < :hi"), first)
    if bind.dialect.name == "postgresql":
        op.execute(_PG_FUNCTION.replace("{day}", ""))
    else:
        _sqlite_triggers(fold=False)
    op.drop_table("rollup_days")
