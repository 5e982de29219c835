"""health.counted_at: the failure that counted a key's current outage

Under ``health.count_overlapping_failures: false`` an outcome of an Attempt that began before
the key's outage was counted is the same outage (a failure restarts the window, a success
clears nothing). That was measured against ``last_failure_at``, which every such restart moves
forward: a probe begun after the outage was counted but before a late failure of a request in
flight restarted the window was taken for one in flight too, so its success left the route
cooling and its failure did not step the curve. The failure that counted the outage is now
kept in ``counted_at`` (set when a failure steps ``error_count``, left by a restart, cleared
with the counters) and the overlap is measured against it.

Existing ledgers: rows get NULL, read as "not known": the overlap is measured against
``last_failure_at`` as before, until the key's next counted failure sets it. The downgrade
drops the column (what it held is not needed at 0018).

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.add_column(sa.Column("counted_at", sa.Float(precision=53), nullable=True))


def downgrade() -> None:
    # No trigger, index or view names the column or the table, so SQLite's batch copy of
    # health loses nothing.
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.drop_column("counted_at")
