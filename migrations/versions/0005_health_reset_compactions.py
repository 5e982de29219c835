"""health.reset_at; runs.compactions and runs.profile_compactions

``health.reset_at`` is when a row's counters reset by themselves under the policy that counted
them, so a read shows expired counters as reset. Existing rows get NULL (they read as stored
until their next write). ``runs.compactions`` counts the compactions a host recorded and
``runs.profile_compactions`` their count when ``current_profile`` was last set: a compaction
since then drops the session's auto-pinned profile. Existing Runs start at 0 and 0.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reset_at", sa.Float(precision=53), nullable=True))
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("compactions", sa.Integer(), nullable=False,
                                      server_default="0"))
        batch_op.add_column(sa.Column("profile_compactions", sa.Integer(), nullable=False,
                                      server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("profile_compactions")
        batch_op.drop_column("compactions")
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.drop_column("reset_at")
