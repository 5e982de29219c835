"""runs.returned_*: what an ended Child gave back of its carve to its parent

A Child Run's budget is carved out of its parent's when it is admitted, and stayed carved when
it ended: what it had not used (three children of 0.10 ending served, failed and cancelled
kept 0.2988 of the 0.30 carved, 8 calls and 5 retries) was lost to the parent, which could be
refused ``AllowanceExhausted`` while its ended children held calls nobody could use. The Run
that ends a Child now gives that part back in the same transaction, under the parent's row
lock: the parent's ``carved_*`` go down by it and the Child records it in the new columns
``returned_calls``, ``returned_retries``, ``returned_micros`` and ``returned_tokens``. A
Child's budget stays as it was admitted (invariant 5): what it may still use is its budget
less what it used, holds, carved and returned.

A Run's own budget in spend against budgets (``run_rollups.budget_micros``) is its budget
less what it carved and what it returned, so the trigger that undoes an hour when an ended Run
of it changes now watches ``returned_micros`` too.

Existing ledgers: the columns are added as 0 (nothing was given back before this revision:
the children that ended keep their carve, and reconcile reads them as it did). The downgrade
drops the columns and restores 0014's trigger; the carves given back stay given back (the
parents keep the smaller ``carved_*``, which reconcile at that revision flags).

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_COLUMNS = (("returned_calls", sa.Integer()), ("returned_retries", sa.Integer()),
            ("returned_micros", sa.BigInteger()), ("returned_tokens", sa.BigInteger()))

# 0014's trigger on a Run's UPDATE, restated (a migration must not change when the package
# does): its WHEN clause, whose list of watched columns ends with labels.
_ENDED = "{row}.status NOT IN ('admitted', 'running')"
_WATCHED_0014 = ("status", "posted_micros", "reserved_micros", "tenant", "created_at",
                 "max_cost_micros", "carved_micros", "labels")
_WATCHED = (*_WATCHED_0014, "returned_micros")


def _update_when(watched: tuple[str, ...], differ: str) -> str:
    changed = " OR ".join(f"OLD.{c} {differ} NEW.{c}" for c in watched)
    return f"({_ENDED.format(row='OLD')} OR {_ENDED.format(row='NEW')}) AND ({changed})"


def _update_trigger(watched: tuple[str, ...], was: tuple[str, ...]) -> None:
    """Make the trigger on a Run's ``UPDATE`` watch ``watched`` instead of ``was``."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER runs_unroll_update ON runs")
        op.execute("CREATE TRIGGER runs_unroll_update AFTER UPDATE ON runs FOR EACH ROW "
                   f"WHEN ({_update_when(watched, 'IS DISTINCT FROM')}) "
                   "EXECUTE FUNCTION ledger_attempts_unroll()")
        return
    # SQLite: the trigger's body is 0014's with 0016's day spliced in; only its WHEN clause's
    # list changes, so it is replaced in the trigger as it stands rather than restated.
    bind = op.get_bind()
    sql = bind.execute(sa.text("SELECT sql FROM sqlite_master WHERE type = 'trigger' "
                               "AND name = 'runs_unroll_update'")).scalar_one()
    old, new = _update_when(was, "IS NOT"), _update_when(watched, "IS NOT")
    assert sql.count(old) == 1, sql
    op.execute("DROP TRIGGER runs_unroll_update")
    op.execute(sql.replace(old, new))


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        for name, kind in _COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=False, server_default="0"))
    _update_trigger(_WATCHED, _WATCHED_0014)


def downgrade() -> None:
    _update_trigger(_WATCHED_0014, _WATCHED)
    if op.get_bind().dialect.name == "postgresql":
        for name, _kind in reversed(_COLUMNS):
            op.drop_column("runs", name)
        return
    # SQLite drops them in place (3.35+): a batch copy of runs would drop its triggers with
    # the old table, and no trigger, index or view names them once 0014's trigger is back.
    for name, _kind in reversed(_COLUMNS):
        op.execute(f"ALTER TABLE runs DROP COLUMN {name}")
