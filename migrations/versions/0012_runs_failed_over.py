"""runs.failed_over: whether a Run failed over, set when it does, for counting a day's failovers

``Audit.count_failovers`` (the dashboard's "runs failed over" tile) tested every Run admitted
in its window for a success on another route than its selected one (an index probe of its
attempts each) and for a ``move`` event (a hash of every ``move`` of the history, since an
event's time does not bound its Run's): 0.65-0.72 s for a day at 140,000 attempts a day, and
growing with the history. The Run now carries the answer, set by the transaction that makes
it true (a success elsewhere settles it, a ``move`` is written with it), and a partial index
of the failed-over Runs by admission time serves the count and the failovers page.

Existing ledgers: the column is added with the default ``false`` (no rewrite on either
database: a change of the catalog on PostgreSQL, ``ALTER TABLE ... ADD COLUMN`` on SQLite),
then set for the Runs that failed over by the rule itself, one ``UPDATE`` that writes only
those rows (about one Run in ten in the project's generated history), then the index is
built. The downgrade drops both.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_runs = sa.table("runs", sa.column("run_id"), sa.column("selected_route"),
                 sa.column("failed_over"))
_attempts = sa.table("attempts", sa.column("run_id"), sa.column("state"), sa.column("route_id"))
_events = sa.table("events", sa.column("run_id"), sa.column("kind"))


def upgrade() -> None:
    op.add_column("runs", sa.Column("failed_over", sa.Boolean(), nullable=False,
                                    server_default=sa.false()))
    r, a, e = _runs.c, _attempts.c, _events.c
    # The Runs with a move and those served elsewhere, each found by one pass (a join), not
    # by two probes per Run of the history.
    home = _runs.alias("home")
    served_elsewhere = (sa.select(a.run_id).select_from(
        _attempts.join(home, home.c.run_id == a.run_id))
        .where(a.state == "succeeded", a.route_id != home.c.selected_route))
    moved = sa.select(e.run_id).where(e.kind == "move")
    op.execute(_runs.update().where(r.run_id.in_(sa.union(served_elsewhere, moved)))
               .values(failed_over=sa.true()))
    # Each database's spelling of the test its queries write, so that they use the index.
    op.create_index("ix_runs_failed_over_created_at", "runs", ["created_at", "run_id"],
                    postgresql_where=sa.text("failed_over"),
                    sqlite_where=sa.text("failed_over = 1"))


def downgrade() -> None:
    op.drop_index("ix_runs_failed_over_created_at", table_name="runs")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("failed_over")
