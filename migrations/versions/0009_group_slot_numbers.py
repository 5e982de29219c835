"""group_slots.slot_no: numbered slots, so one limited group's begins need no lock held through
their commit

On PostgreSQL a begin in a limited capacity group takes a free slot number in ``[0, limit)`` of
its group; a unique index on ``(group_id, slot_no)`` holds the group's in-flight count to its
limit across processes, and begins of one group no longer queue on the group's row through each
other's commits. NULL on SQLite (whose writers are serialized anyway) and for unlimited groups.

Existing ledgers: slots already in flight keep NULL; while a live one is left, begins of its
group take the group's row lock as before (they count it), and number their own slots.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("group_slots", schema=None) as batch_op:
        batch_op.add_column(sa.Column("slot_no", sa.Integer(), nullable=True))
        batch_op.create_index("ux_group_slots_group_id_slot_no", ["group_id", "slot_no"],
                              unique=True)


def downgrade() -> None:
    with op.batch_alter_table("group_slots", schema=None) as batch_op:
        batch_op.drop_index("ux_group_slots_group_id_slot_no")
        batch_op.drop_column("slot_no")
