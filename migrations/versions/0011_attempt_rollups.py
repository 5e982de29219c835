"""rollup_hours and attempt_rollups: hourly sums of settled attempts, kept exact by a trigger

A day's totals by route, group, provider, tenant or label read every attempt of the day (some
140,000 on a busy ledger, over 100 ms however they are indexed). ``failover-ledger rollup``
(``Ledger.roll_up``) now writes, per hour, the sums over its settled attempts into
``attempt_rollups`` and marks the hour in ``rollup_hours``; the totals add a rolled hour's few
hundred rows to what they still read from ``attempts`` (the window's ragged edges, hours not
rolled, and the attempts still ``dispatching`` or ``unknown``).

A trigger on ``attempts`` keeps that exact: any insert, update or delete of an attempt
deletes its hour's mark and roll-up rows in the same transaction (an attempt settled, resolved
or written late, by a clock behind the others', into an hour already rolled), and the hour is
read from ``attempts`` again until the next roll-up. On PostgreSQL the trigger takes a shared
advisory lock of the hour (``pg_advisory_xact_lock_shared(7894, hour % 2^31)``, the
hour as a key of four bytes whatever the clock said) and a roll-up the
exclusive one, so a roll-up never misses a write committed while it read.

Existing ledgers: the tables are created empty and the trigger added; no row is rewritten and
nothing reads differently until the first roll-up. The downgrade drops the trigger and the
tables.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# The hour of a time, as the roll-up's ranges count it (created_at in [3600h, 3600(h+1))): the
# floor of the quotient, less one where the quotient was rounded up to the next hour.
_PG_FUNCTION = """
CREATE FUNCTION ledger_attempts_unroll() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t double precision;
    h bigint;
BEGIN
    FOR i IN 1..2 LOOP
        IF i = 1 AND TG_OP <> 'DELETE' THEN
            t := NEW.created_at;
        ELSIF i = 2 AND TG_OP <> 'INSERT'
                AND (TG_OP = 'DELETE' OR OLD.created_at IS DISTINCT FROM NEW.created_at) THEN
            t := OLD.created_at;
        ELSE
            CONTINUE;
        END IF;
        h := floor(t / 3600);
        IF h * 3600 > t THEN
            h := h - 1;
        END IF;
        PERFORM pg_advisory_xact_lock_shared(7894, (h % 2147483648)::integer);
        DELETE FROM rollup_hours WHERE hour = h;
        IF FOUND THEN
            DELETE FROM attempt_rollups WHERE hour = h;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$
"""

_SQLITE_HOUR = "(CAST({t} / 3600 AS INTEGER) - (CAST({t} / 3600 AS INTEGER) * 3600 > {t}))"


def _sqlite_trigger(event: str, row: str) -> str:
    """The trigger of ``event`` for the hour of ``row`` (``NEW`` or ``OLD``); its ``WHEN`` is
    the one probe a write pays while its hour is not rolled (nearly always)."""
    hour = _SQLITE_HOUR.format(t=f"{row}.created_at")
    when = f"EXISTS (SELECT 1 FROM rollup_hours WHERE hour = {hour})"
    if event == "UPDATE OF created_at":  # the new hour of a row moved in time (never the ledger)
        when = f"NEW.created_at IS NOT OLD.created_at AND {when}"
    name = "attempts_unroll_" + ("moved" if event.startswith("UPDATE OF") else event.lower())
    return (f"CREATE TRIGGER {name} AFTER {event} ON attempts FOR EACH ROW WHEN {when} "
            f"BEGIN DELETE FROM attempt_rollups WHERE hour = {hour}; "
            f"DELETE FROM rollup_hours WHERE hour = {hour}; END")


_SQLITE_TRIGGERS = (("INSERT", "NEW"), ("UPDATE", "OLD"), ("UPDATE OF created_at", "NEW"),
                    ("DELETE", "OLD"))


def upgrade() -> None:
    op.create_table(
        "rollup_hours",
        sa.Column("hour", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("rolled_at", sa.Float(precision=53), nullable=False),
        sa.PrimaryKeyConstraint("hour", name=op.f("pk_rollup_hours")),
    )
    op.create_table(
        "attempt_rollups",
        sa.Column("hour", sa.BigInteger(), nullable=False),
        sa.Column("route_id", sa.String(length=200), nullable=False),
        sa.Column("group_id", sa.String(length=200), nullable=False),
        sa.Column("provider", sa.String(length=200), nullable=False),
        sa.Column("tenant", sa.String(length=200), nullable=True),
        sa.Column("labels", sa.Text(), nullable=True),
        sa.Column("attempts", sa.BigInteger(), nullable=False),
        sa.Column("succeeded", sa.BigInteger(), nullable=False),
        sa.Column("failed", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_attempt_rollups_hour", "attempt_rollups", ["hour"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        op.execute("CREATE TRIGGER attempts_unroll AFTER INSERT OR UPDATE OR DELETE ON attempts "
                   "FOR EACH ROW EXECUTE FUNCTION ledger_attempts_unroll()")
    else:
        for event, row in _SQLITE_TRIGGERS:
            op.execute(_sqlite_trigger(event, row))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER attempts_unroll ON attempts")
        op.execute("DROP FUNCTION ledger_attempts_unroll()")
    else:
        for name in ("insert", "update", "moved", "delete"):
            op.execute(f"DROP TRIGGER attempts_unroll_{name}")
    op.drop_index("ix_attempt_rollups_hour", table_name="attempt_rollups")
    op.drop_table("attempt_rollups")
    op.drop_table("rollup_hours")
