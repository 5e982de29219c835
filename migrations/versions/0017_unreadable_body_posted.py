"""unreadable 2xx bodies: the rows settled under the old rule keep what they posted

A whole (not streamed) 2xx answer whose body is not the protocol's (not JSON, or not its
shape: a failure after the headers with transport ``malformed_event``) was settled as if the
provider had answered with an error status: nothing posted. The provider ran that call and may
bill it, so settles now post the whole hold (``ledger.decide.settle.settle_holds``), and the
audit's sums, replay and reconcile read each settled row by that rule.

Rows settled before this revision posted nothing, and their debits and their Runs' counters
say so. Read by the new rule they would be charged their whole hold in every report, and
reconcile would flag each one. So this revision writes on each of them the cost they were
charged, 0 (``cost_micros`` is ``NULL`` there: no usage was reported), which both rules read as
what was posted. Nothing else changes: no debit, no counter; the triggers of 0011/0013 unroll
the hours of the rows written, and the next roll-up redoes them.

It scans ``attempts`` once (the failed rows without a cost); a ledger has few such rows.
The downgrade leaves the rows as they are: the old rule reads a cost of 0 as 0 too.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def _member(key: str, value: str) -> str:
    # How the ledger spells one member of a stored fact (ledger.storage.encode.fact_member),
    # restated: a migration must not change when the package does.
    return json.dumps({key: value})[1:-1]


def upgrade() -> None:
    attempts = sa.table("attempts", sa.column("state", sa.String), sa.column("fact", sa.Text),
                        sa.column("cost_micros", sa.BigInteger))
    a = attempts.c
    op.execute(attempts.update().where(
        a.state == "failed", a.cost_micros.is_(None),
        a.fact.contains(_member("phase", "after_headers"), autoescape=True),
        a.fact.contains(_member("transport", "malformed_event"), autoescape=True),
    ).values(cost_micros=0))


def downgrade() -> None:
    pass
