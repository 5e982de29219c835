"""group_waiters (a full capacity group's queue); health.recent_failures

``group_waiters`` holds one place per Attempt waiting for a slot of a full limited group, served
in ticket order across processes; a place counts while its own bound has not passed and its
Run's lease (of the same fence) is live. On PostgreSQL a trigger notifies channel
``ledger_slots`` (payload: the group id) when a slot of a group with waiters is freed, so
waiters wake at once instead of polling. ``health.recent_failures`` remembers the failures of a
key below its policy's cooling threshold (``health.cooldown_after``).

Existing ledgers: the queue starts empty; existing health rows get NULL (no recent failures).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_NOTIFY_FUNCTION = """
CREATE OR REPLACE FUNCTION ledger_slot_freed() RETURNS trigger AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM group_waiters WHERE group_id = OLD.group_id) THEN
    PERFORM pg_notify('ledger_slots', OLD.group_id);
  END IF;
  RETURN NULL;
END
$$ LANGUAGE plpgsql
"""
_NOTIFY_TRIGGER = (
    "CREATE TRIGGER group_slots_freed AFTER DELETE ON group_slots "
    "FOR EACH ROW EXECUTE FUNCTION ledger_slot_freed()"
)


def upgrade() -> None:
    op.create_table(
        "group_waiters",
        sa.Column("ticket", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                  autoincrement=True, nullable=False),
        sa.Column("group_id", sa.String(length=200), nullable=False),
        sa.Column("waiter_id", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("enqueued_at", sa.Float(precision=53), nullable=False),
        sa.Column("expires_at", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("ticket", name=op.f("pk_group_waiters")),
        sa.UniqueConstraint("waiter_id", name=op.f("uq_group_waiters_waiter_id")),
    )
    with op.batch_alter_table("group_waiters", schema=None) as batch_op:
        batch_op.create_index("ix_group_waiters_group_id_ticket", ["group_id", "ticket"],
                              unique=False)
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.add_column(sa.Column("recent_failures", sa.Text(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_NOTIFY_FUNCTION)
        op.execute(_NOTIFY_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS group_slots_freed ON group_slots")
        op.execute("DROP FUNCTION IF EXISTS ledger_slot_freed()")
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.drop_column("recent_failures")
    with op.batch_alter_table("group_waiters", schema=None) as batch_op:
        batch_op.drop_index("ix_group_waiters_group_id_ticket")
    op.drop_table("group_waiters")
