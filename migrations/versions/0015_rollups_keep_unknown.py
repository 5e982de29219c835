"""attempt_rollups.unknown and .held_micros: the roll-ups keep the unknown attempts

An ``unknown`` attempt stays unknown until an operator settles it (``settle_unknown``), which
may be months; the roll-ups left those attempts out and every reader took them from
``attempts`` inside each rolled hour, so ``/metrics`` (the whole history, at every scrape) and
the totals over long windows read more rows as such attempts accumulated (1.7 % of a generated
history, 17,000 rows a scrape at a million attempts, ten times as many at ten million). The
roll-ups now count them: ``attempt_rollups`` keeps, per key, how many are ``unknown`` and what
they hold (their reserved money), and ``metric_rollups`` their row per route and state.
Only the attempts in flight (``dispatching``) are still read from ``attempts``.

That stays exact without a new trigger: the write that ends an unknown attempt (a settle, a
resolution, retention) is a write to ``attempts``, and 0011's trigger already undoes its hour.

Existing ledgers: the columns are added (0 on the rows there, right for every hour without an
unknown attempt), and the rolled hours holding an unknown attempt are unmarked (every roll-up
table's rows of them deleted), so that the next roll-up counts them; until it runs, those hours
are read from the tables. The downgrade unmarks the hours whose roll-ups count an unknown
attempt (0014's readers take those from ``attempts``, and would count them twice) and drops the
columns.

On PostgreSQL the new columns keep no default, so that a roll-up written by an older package
(whose INSERT names neither) fails rather than miscounts while a fleet is rolled out.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import math

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_ROLLUPS = ("attempt_rollups", "metric_rollups", "move_rollups", "wait_rollups", "run_rollups")
_BATCH = 500


def _hour(t: float) -> int:
    """The hour of time ``t`` as the roll-ups count it (``3600*h <= t < 3600*(h+1)``)."""
    h = math.floor(t / 3600)
    return h - 1 if h * 3600 > t else h


def _unmark(hours: set[int]) -> None:
    """Rolled ``hours`` unmarked and their rows gone: the next roll-up redoes them."""
    bind = op.get_bind()
    ordered = sorted(hours)
    for i in range(0, len(ordered), _BATCH):
        chunk = {"hours": ordered[i:i + _BATCH]}
        for table in (*_ROLLUPS, "rollup_hours"):
            bind.execute(sa.text(f"DELETE FROM {table} WHERE hour IN :hours").bindparams(
                sa.bindparam("hours", expanding=True)), chunk)


def upgrade() -> None:
    with op.batch_alter_table("attempt_rollups") as batch:
        batch.add_column(sa.Column("unknown", sa.BigInteger(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("held_micros", sa.BigInteger(), nullable=False,
                                   server_default="0"))
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # No default once the rows there have theirs: an older package's roll-up, whose
        # INSERT names neither column, then fails instead of writing an hour without its
        # unknown attempts (a fleet shares PostgreSQL while its processes are rolled out).
        # SQLite keeps the default: dropping it would rebuild the table.
        for name in ("unknown", "held_micros"):
            op.alter_column("attempt_rollups", name, server_default=None)
    rolled = {int(h) for h in bind.execute(sa.text("SELECT hour FROM rollup_hours")).scalars()}
    if rolled:
        times = bind.execute(sa.text("SELECT created_at FROM attempts WHERE state = 'unknown'"))
        _unmark(rolled & {_hour(t) for t in times.scalars()})


def downgrade() -> None:
    bind = op.get_bind()
    _unmark({int(h) for h in bind.execute(sa.text(
        "SELECT DISTINCT hour FROM attempt_rollups WHERE unknown > 0")).scalars()})
    if bind.dialect.name == "postgresql":
        op.drop_column("attempt_rollups", "held_micros")
        op.drop_column("attempt_rollups", "unknown")
        return
    # As 0014's downgrade: SQLite copies the table without the columns and renames the copy,
    # which the triggers deleting from attempt_rollups would refuse unless the rename is the
    # legacy one.
    op.execute("PRAGMA legacy_alter_table = ON")
    with op.batch_alter_table("attempt_rollups") as batch:
        batch.drop_column("held_micros")
        batch.drop_column("unknown")
    op.execute("PRAGMA legacy_alter_table = OFF")
