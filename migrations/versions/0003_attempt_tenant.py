"""attempts.tenant: the run's tenant copied at begin, for per-tenant totals without a join

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=200), nullable=True))
        batch_op.create_index("ix_attempts_tenant_created_at", ["tenant", "created_at"],
                              unique=False)
    # Existing history: fill from the runs it belongs to.
    op.execute(
        "UPDATE attempts SET tenant = (SELECT runs.tenant FROM runs "
        "WHERE runs.run_id = attempts.run_id)"
    )


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_index("ix_attempts_tenant_created_at")
        batch_op.drop_column("tenant")
