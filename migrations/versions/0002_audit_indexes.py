"""audit indexes

Indexes the audit queries (ledger.storage.audit) need: runs by status newest first, and the
per-run probes of the failover history (a run's attempts by state, a run's events by kind).
Without the two per-run indexes SQLite, which keeps no planner statistics unless ANALYZE runs,
probes the global (state, created_at) / (kind, created_at) indexes instead and a failover page
scans every succeeded attempt.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index('ix_runs_status_created_at', ['status', 'created_at'], unique=False)
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index('ix_attempts_run_id_state', ['run_id', 'state'], unique=False)
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_run_id_kind', ['run_id', 'kind'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_run_id_kind')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index('ix_attempts_run_id_state')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_status_created_at')
