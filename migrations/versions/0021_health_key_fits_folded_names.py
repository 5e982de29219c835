"""health.key: room for every provider's folded name

Under ``health.key: provider`` a route's health is kept under ``provider:`` and its provider
name case-folded (0020). A provider name may be 200 characters (an id), and folding turns one
character into up to three (U+0390 into three), so the key may be 9 + 600 characters; the
column held 200. Every settle of a route whose key was longer failed after its request was
sent (the attempt left dispatching, its hold kept), and on PostgreSQL a probe claim under it
failed with "value too long". The column now holds 609 characters, the longest key any valid
route has (``ledger.domain.bounds.MAX_HEALTH_KEY_LENGTH``).

A key that always fits 200 (a digest of long names) was the other way: it would have made the
listed key of such a provider unreadable, and operators name providers by the key
``failover-ledger health`` lists; a wider column keeps ``provider:<name>`` one rule.

On PostgreSQL widening a ``varchar`` rewrites neither the table nor its primary key index;
SQLite's batch copy of ``health`` (no trigger, index or view names it) loses nothing.
The downgrade deletes the rows whose key is longer than 200 characters before it narrows the
column: PostgreSQL would refuse to narrow it over them, and the older package refuses to read
such a key (its health listing and every snapshot naming it would fail), on both backends. Such
a row holds the health of a provider whose every call failed to settle under the older
package, so it darkens nothing that package could have used.

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# Restated, not imported: a migration must not change when the package does.
_OLD = 200
_NEW = 609


def upgrade() -> None:
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.alter_column("key", existing_type=sa.String(_OLD), type_=sa.String(_NEW),
                              existing_nullable=False)


def downgrade() -> None:
    health = sa.table("health", sa.column("key"))
    op.execute(health.delete().where(sa.func.length(health.c.key) > _OLD))
    with op.batch_alter_table("health", schema=None) as batch_op:
        batch_op.alter_column("key", existing_type=sa.String(_NEW), type_=sa.String(_OLD),
                              existing_nullable=False)
