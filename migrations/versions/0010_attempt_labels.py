"""attempts.labels: the Run's labels copied at begin, for per-label totals without a join

Totals by label (``failover-ledger costs --by label --label team``) joined a window's attempts
to ``runs`` for the labels; at a day of 140,000 attempts PostgreSQL read every Run of the
history (a hash join) or probed ``runs`` once per attempt (a nested loop), either costing more
than reading the day itself. Like ``attempts.tenant`` (0003), each attempt now carries its
Run's labels, the JSON text exactly as ``runs.labels`` holds it (labels are frozen at
admission), written by the begin from the Run's locked row.

Existing ledgers: the column is added empty (NULL), which takes no rewrite on either database
(on PostgreSQL a change of the catalog only). The attempts written before it keep NULL and the
query sums them by their Runs' labels through a join, as before this migration, when a window
holds any. An ``UPDATE`` filling them was tried and not kept: it wrote a new version of every
attempt row, doubling the table until vacuumed, and in the order of its join, not of time, so a
day's attempts no longer lay together on disk (the correlation of ``created_at`` with the row
order fell from 0.96 to 0.06 on a million attempts) and every one-day total took four to seven
times as long. Retention ages the unfilled rows out. The downgrade drops the column.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("labels", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("labels")
