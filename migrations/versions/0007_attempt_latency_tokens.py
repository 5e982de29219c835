"""attempts.latency_s, first_byte_s, first_token_s, cached_tokens, reasoning_tokens

Per Attempt, by the ledger's clock and in seconds from its begin: ``latency_s`` to its settle by
the executor, ``first_byte_s`` to the response's first byte (its headers), ``first_token_s`` to
a stream's first content; and the parts of its prompt and completion tokens the provider
reported as served from its cache (``cached_tokens``) and spent reasoning
(``reasoning_tokens``).

Existing ledgers: a succeeded, failed or not-sent Attempt gets ``latency_s = settled_at -
created_at``, which is what its settle recorded, except one an operator settled with evidence
(a ``late_receipt`` event: it was unknown when its executor settled it); unknown Attempts get
none (their settle time may be recovery's). The first-byte and first-token times and the token
details were not recorded before: NULL.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_BACKFILL = (
    "UPDATE attempts SET latency_s = CASE WHEN settled_at > created_at "
    "THEN settled_at - created_at ELSE 0 END "
    "WHERE state IN ('succeeded', 'failed', 'not_sent') AND settled_at IS NOT NULL "
    "AND attempt_id NOT IN (SELECT attempt_id FROM events WHERE kind = 'late_receipt' "
    "AND attempt_id IS NOT NULL)"
)


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("latency_s", sa.Float(precision=53), nullable=True))
        batch_op.add_column(sa.Column("first_byte_s", sa.Float(precision=53), nullable=True))
        batch_op.add_column(sa.Column("first_token_s", sa.Float(precision=53), nullable=True))
        batch_op.add_column(sa.Column("cached_tokens", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("reasoning_tokens", sa.BigInteger(), nullable=True))
    op.execute(_BACKFILL)


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("reasoning_tokens")
        batch_op.drop_column("cached_tokens")
        batch_op.drop_column("first_token_s")
        batch_op.drop_column("first_byte_s")
        batch_op.drop_column("latency_s")
