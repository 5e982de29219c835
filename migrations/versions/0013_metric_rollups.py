"""metric_rollups, move_rollups, wait_rollups, run_rollups: ``/metrics`` from the roll-ups

``/metrics`` counted the whole history at every scrape: attempts by route and state with three
histograms, and every ``move`` event by its routes and cause. At a million attempts that took
3.2-3.3 s a scrape on PostgreSQL (1.4 s the attempts, 1.3 s the moves' scattered heap pages),
and it grows with the history, past a scraper's usual 10 s timeout at ten million. The roll-up
job (``failover-ledger rollup``) now also writes, per hour, the sums ``/metrics`` counts over
the hour's settled attempts into ``metric_rollups``, its ``move`` events into
``move_rollups`` and its ``capacity_wait`` events into ``wait_rollups``; a scrape adds the
rolled hours' rows to what it still reads from the tables.

The marks of ``rollup_hours`` keep it exact, as for ``attempt_rollups`` (0011): the attempts'
trigger now deletes the new tables' rows of an hour with its mark, and a new trigger on
``events`` does the same when a ``move`` or ``capacity_wait`` of a rolled hour is written or
deleted (a host's own ``append_event(kind="move")``, or a turn's wait, writes no attempt). On PostgreSQL it takes the same shared
advisory lock of the hour as the attempts' trigger, so a roll-up never misses a move committed
while it read. ``run_rollups`` keeps, per hour of admission and tenant, the Runs that have
ended (how many, their money posted and held), for ``/metrics``' money by tenant, which read
every Run: a trigger on ``runs`` undoes the hour when a Run of it ends or an ended Run's money
moves (an operator's receipt for an unknown attempt); a live Run's writes do not fire it.

Existing ledgers: the tables are created empty, the hours already rolled are unmarked (their
``attempt_rollups`` rows deleted with them) so that the next roll-up writes all five tables,
and the triggers are replaced. The downgrade restores 0011's triggers and drops the tables.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_TIMES = ("latency_s", "first_token_s", "first_byte_s")
_BUCKETS = 14  # ledger.telemetry.DURATION_BUCKETS, as of this revision

# The hour of a time, as the roll-up's ranges count it (created_at in [3600h, 3600(h+1))): the
# floor of the quotient, less one where the quotient was rounded up to the next hour.
_PG_FUNCTION = """
CREATE OR REPLACE FUNCTION ledger_attempts_unroll() RETURNS trigger LANGUAGE plpgsql AS $$
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
            {more}
        END IF;
    END LOOP;
    RETURN NULL;
END
$$
"""
_MORE = ("DELETE FROM metric_rollups WHERE hour = h;\n"
         "            DELETE FROM move_rollups WHERE hour = h;\n"
         "            DELETE FROM wait_rollups WHERE hour = h;\n"
         "            DELETE FROM run_rollups WHERE hour = h;")

_SQLITE_HOUR = "(CAST({t} / 3600 AS INTEGER) - (CAST({t} / 3600 AS INTEGER) * 3600 > {t}))"
_ROLLUPS = ("attempt_rollups", "metric_rollups", "move_rollups", "wait_rollups", "run_rollups")
_EVENTS = "kind IN ('move', 'capacity_wait')"  # the events rolled up
# A Run counts in its hour's roll-up once it has ended; it changes what that counts when it
# ends, or when its money moves after (an operator's receipt for an unknown attempt). The
# columns watched are those run_rollups sums or groups by (ledger.storage.series.metric_counts):
# one counted there later needs a migration that adds it here.
_ENDED = "{row}.status NOT IN ('admitted', 'running')"
_CHANGED = " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in (
    "status", "posted_micros", "reserved_micros", "tenant", "created_at"))
_PG_RUN_WHEN = {"INSERT": _ENDED.format(row="NEW"), "DELETE": _ENDED.format(row="OLD"),
                "UPDATE": f"({_ENDED.format(row='OLD')} OR {_ENDED.format(row='NEW')}) "
                          f"AND ({_CHANGED})"}


def _sqlite_trigger(table: str, event: str, row: str, tables: tuple[str, ...]) -> str:
    """The trigger of ``event`` on ``table`` for the hour of ``row`` (``NEW`` or ``OLD``); its
    ``WHEN`` is the one probe a write pays while its hour is not rolled (nearly always)."""
    hour = _SQLITE_HOUR.format(t=f"{row}.created_at")
    when = f"EXISTS (SELECT 1 FROM rollup_hours WHERE hour = {hour})"
    if event == "UPDATE OF created_at":  # the new hour of a row moved in time (never the ledger)
        when = f"NEW.created_at IS NOT OLD.created_at AND {when}"
    if table == "events":  # only moves and capacity waits are rolled up
        when = f"{row}.{_EVENTS} AND {when}"
    elif table == "runs":  # only a Run that has ended
        cond = _PG_RUN_WHEN[event.split(" OF ")[0]].replace("IS DISTINCT FROM", "IS NOT")
        when = f"{cond} AND {when}"
    name = f"{table}_unroll_" + ("moved" if event.startswith("UPDATE OF") else event.lower())
    deletes = " ".join(f"DELETE FROM {t} WHERE hour = {hour};" for t in tables)
    return (f"CREATE TRIGGER {name} AFTER {event} ON {table} FOR EACH ROW WHEN {when} "
            f"BEGIN {deletes} DELETE FROM rollup_hours WHERE hour = {hour}; END")


_ATTEMPT_TRIGGERS = (("INSERT", "NEW"), ("UPDATE", "OLD"), ("UPDATE OF created_at", "NEW"),
                     ("DELETE", "OLD"))
_EVENT_TRIGGERS = (("INSERT", "NEW"), ("DELETE", "OLD"))
_RUN_TRIGGERS = (("INSERT", "NEW"), ("UPDATE", "OLD"), ("UPDATE OF created_at", "NEW"),
                 ("DELETE", "OLD"))


def _metric_columns(*times: str) -> list[sa.Column[object]]:
    cols: list[sa.Column[object]] = []
    for m in times:
        cols += [sa.Column(f"{m}_n", sa.BigInteger(), nullable=False),
                 sa.Column(f"{m}_sum", sa.Float(precision=53), nullable=False)]
        cols += [sa.Column(f"{m}_le{i}", sa.BigInteger(), nullable=False)
                 for i in range(_BUCKETS)]
    return cols


def _sqlite_attempt_triggers(tables: tuple[str, ...]) -> None:
    for name in ("insert", "update", "moved", "delete"):
        op.execute(f"DROP TRIGGER attempts_unroll_{name}")
    for event, row in _ATTEMPT_TRIGGERS:
        op.execute(_sqlite_trigger("attempts", event, row, tables))


def upgrade() -> None:
    op.create_table(
        "metric_rollups",
        sa.Column("hour", sa.BigInteger(), nullable=False),
        sa.Column("route_id", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.Column("input", sa.BigInteger(), nullable=False),
        sa.Column("output", sa.BigInteger(), nullable=False),
        sa.Column("cache_read", sa.BigInteger(), nullable=False),
        sa.Column("reasoning", sa.BigInteger(), nullable=False),
        sa.Column("charged_micros", sa.BigInteger(), nullable=False),
        *_metric_columns(*_TIMES),
    )
    op.create_index("ix_metric_rollups_hour", "metric_rollups", ["hour"])
    op.create_table(
        "move_rollups",
        sa.Column("hour", sa.BigInteger(), nullable=False),
        sa.Column("from_route", sa.Text(), nullable=True),
        sa.Column("to_route", sa.Text(), nullable=True),
        sa.Column("category", sa.Text(), nullable=True),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_move_rollups_hour", "move_rollups", ["hour"])
    op.create_table(
        "wait_rollups",
        sa.Column("hour", sa.BigInteger(), nullable=False),
        sa.Column("group_id", sa.Text(), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        *_metric_columns("waited_s"),
    )
    op.create_index("ix_wait_rollups_hour", "wait_rollups", ["hour"])
    op.create_table(
        "run_rollups",
        sa.Column("hour", sa.BigInteger(), nullable=False),
        sa.Column("tenant", sa.String(length=200), nullable=True),
        sa.Column("runs", sa.BigInteger(), nullable=False),
        sa.Column("posted_micros", sa.BigInteger(), nullable=False),
        sa.Column("reserved_micros", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_run_rollups_hour", "run_rollups", ["hour"])
    # The hours rolled so far have no rows in the new tables: the next roll-up redoes them.
    op.execute("DELETE FROM attempt_rollups")
    op.execute("DELETE FROM rollup_hours")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION.replace("{more}", _MORE))
        for event, row in _EVENT_TRIGGERS:
            op.execute(f"CREATE TRIGGER events_unroll_{event.lower()} AFTER {event} ON events "
                       f"FOR EACH ROW WHEN ({row}.{_EVENTS}) "
                       "EXECUTE FUNCTION ledger_attempts_unroll()")
        for event, when in _PG_RUN_WHEN.items():  # one function: it unrolls both hours
            op.execute(f"CREATE TRIGGER runs_unroll_{event.lower()} AFTER {event} ON runs "
                       f"FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION ledger_attempts_unroll()")
    else:
        _sqlite_attempt_triggers(_ROLLUPS)
        for event, row in _EVENT_TRIGGERS:
            op.execute(_sqlite_trigger("events", event, row, _ROLLUPS))
        for event, row in _RUN_TRIGGERS:
            op.execute(_sqlite_trigger("runs", event, row, _ROLLUPS))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for event, _row in _EVENT_TRIGGERS:
            op.execute(f"DROP TRIGGER events_unroll_{event.lower()} ON events")
        for event in _PG_RUN_WHEN:
            op.execute(f"DROP TRIGGER runs_unroll_{event.lower()} ON runs")
        op.execute(_PG_FUNCTION.replace("{more}", ""))
    else:
        for event, _row in _EVENT_TRIGGERS:
            op.execute(f"DROP TRIGGER events_unroll_{event.lower()}")
        for name in ("insert", "update", "moved", "delete"):
            op.execute(f"DROP TRIGGER runs_unroll_{name}")
        _sqlite_attempt_triggers(_ROLLUPS[:1])
    op.drop_index("ix_run_rollups_hour", table_name="run_rollups")
    op.drop_table("run_rollups")
    op.drop_index("ix_wait_rollups_hour", table_name="wait_rollups")
    op.drop_table("wait_rollups")
    op.drop_index("ix_move_rollups_hour", table_name="move_rollups")
    op.drop_table("move_rollups")
    op.drop_index("ix_metric_rollups_hour", table_name="metric_rollups")
    op.drop_table("metric_rollups")
