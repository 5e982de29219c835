"""run_rollups.budget_micros and .labels: spend against budgets from the roll-ups

``Audit.spend`` (the dashboard's "spend against budgets", ``/budgets``, ``/api/budgets``)
read every Run admitted in its window: the dashboard's seven days took 0.2-0.3 s for the
totals and 0.7-1.0 s for the same split by day at a million attempts on PostgreSQL, growing
with the window's Runs. ``run_rollups`` (0013) already keeps, per hour of admission and
tenant, the ended Runs' count and money posted and held; it now keeps their budgets too (what
they were admitted with, less what they carved for children), and the rows are kept per
labels (the Runs' label JSON, as ``attempt_rollups`` keeps it) as well, so that spend by
tenant or by label reads the rolled hours from it and only the rest (hours not rolled, live
Runs) from ``runs``.

The trigger that undoes an hour when an ended Run of it changes now watches the columns the
budget is made of (``max_cost_micros``, ``carved_micros``) and ``labels`` besides those it
watched.

Existing ledgers: the columns are added (empty on the rows there), and the hours already rolled are
unmarked (every roll-up table's rows of them deleted), so that the next roll-up writes the
budgets and labels; until it runs, every read goes to the tables. The downgrade drops the
columns and restores 0013's trigger.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_ROLLUPS = ("attempt_rollups", "metric_rollups", "move_rollups", "wait_rollups", "run_rollups")
_SQLITE_HOUR = "(CAST({t} / 3600 AS INTEGER) - (CAST({t} / 3600 AS INTEGER) * 3600 > {t}))"
_ENDED = "{row}.status NOT IN ('admitted', 'running')"
# The columns run_rollups sums or groups by (ledger.storage.series.metric_counts), and the
# Run's time and status: one counted there later needs a migration that adds it here.
_WATCHED_0013 = ("status", "posted_micros", "reserved_micros", "tenant", "created_at")
_WATCHED = (*_WATCHED_0013, "max_cost_micros", "carved_micros", "labels")


def _update_when(watched: tuple[str, ...], differ: str) -> str:
    changed = " OR ".join(f"OLD.{c} {differ} NEW.{c}" for c in watched)
    return f"({_ENDED.format(row='OLD')} OR {_ENDED.format(row='NEW')}) AND ({changed})"


def _update_trigger(watched: tuple[str, ...]) -> None:
    """Replace the trigger on a Run's ``UPDATE`` by one watching ``watched``."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER runs_unroll_update ON runs")
        op.execute("CREATE TRIGGER runs_unroll_update AFTER UPDATE ON runs FOR EACH ROW "
                   f"WHEN ({_update_when(watched, 'IS DISTINCT FROM')}) "
                   "EXECUTE FUNCTION ledger_attempts_unroll()")
        return
    # SQLite: the old row's hour (a moved Run's new hour has its own trigger).
    hour = _SQLITE_HOUR.format(t="OLD.created_at")
    when = (f"{_update_when(watched, 'IS NOT')} AND "
            f"EXISTS (SELECT 1 FROM rollup_hours WHERE hour = {hour})")
    deletes = " ".join(f"DELETE FROM {t} WHERE hour = {hour};" for t in _ROLLUPS)
    op.execute("DROP TRIGGER runs_unroll_update")
    op.execute(f"CREATE TRIGGER runs_unroll_update AFTER UPDATE ON runs FOR EACH ROW WHEN {when} "
               f"BEGIN {deletes} DELETE FROM rollup_hours WHERE hour = {hour}; END")


def upgrade() -> None:
    with op.batch_alter_table("run_rollups") as batch:
        batch.add_column(sa.Column("budget_micros", sa.BigInteger(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("labels", sa.Text(), nullable=True))
    # The hours rolled so far have no budgets: the next roll-up redoes them.
    for table in _ROLLUPS:
        op.execute(f"DELETE FROM {table}")
    op.execute("DELETE FROM rollup_hours")
    _update_trigger(_WATCHED)


def downgrade() -> None:
    _update_trigger(_WATCHED_0013)
    if op.get_bind().dialect.name == "postgresql":
        op.drop_column("run_rollups", "labels")
        op.drop_column("run_rollups", "budget_micros")
        return
    # SQLite copies the table without the column and renames the copy; the triggers that
    # delete from run_rollups would refuse the rename (they name a table gone for a moment)
    # unless the rename is the legacy one, which leaves them be.
    op.execute("PRAGMA legacy_alter_table = ON")
    with op.batch_alter_table("run_rollups") as batch:
        batch.drop_column("labels")
        batch.drop_column("budget_micros")
    op.execute("PRAGMA legacy_alter_table = OFF")
