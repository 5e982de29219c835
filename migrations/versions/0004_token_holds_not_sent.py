"""Token holds (runs.tokens_reserved, runs.carved_tokens, attempts.reserved_tokens), not_sent

Existing history keeps its meaning: an Attempt settled as failed with phase before_send was
provably never sent and its hold was voided; it becomes ``not_sent``, and, as not_sent Attempts
are not model calls, its Run's ``calls_used`` no longer counts it.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# The fact JSON is written by json.dumps with its default separators.
_BEFORE_SEND = "state = 'failed' AND fact LIKE '%\"phase\": \"before_send\"%'"


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tokens_reserved", sa.BigInteger(), nullable=False,
                                      server_default="0"))
        batch_op.add_column(sa.Column("carved_tokens", sa.BigInteger(), nullable=False,
                                      server_default="0"))
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reserved_tokens", sa.BigInteger(), nullable=False,
                                      server_default="0"))
    op.execute(
        "UPDATE runs SET calls_used = calls_used - (SELECT count(*) FROM attempts "
        f"WHERE attempts.run_id = runs.run_id AND {_BEFORE_SEND}) "
        f"WHERE EXISTS (SELECT 1 FROM attempts WHERE attempts.run_id = runs.run_id "
        f"AND {_BEFORE_SEND})"
    )
    op.execute(f"UPDATE attempts SET state = 'not_sent' WHERE {_BEFORE_SEND}")


def downgrade() -> None:
    op.execute(
        "UPDATE runs SET calls_used = calls_used + (SELECT count(*) FROM attempts "
        "WHERE attempts.run_id = runs.run_id AND attempts.state = 'not_sent')"
    )
    op.execute("UPDATE attempts SET state = 'failed' WHERE state = 'not_sent'")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("reserved_tokens")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("carved_tokens")
        batch_op.drop_column("tokens_reserved")
