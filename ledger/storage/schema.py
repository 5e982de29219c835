"""The declared schema. Alembic migrations in ``migrations/`` must produce exactly this.

Conventions: times are float seconds since the epoch (the injectable clock's unit, so tests and
recovery reason about one kind of time); money is integer micro-units (``*_micros``) so sums are
exact on both backends; frozen snapshots are JSON text written once at admission.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    case,
    false,
)
from sqlalchemy.sql.expression import ColumnElement, FromClause

from ledger.domain.bounds import MAX_HEALTH_KEY_LENGTH
from ledger.domain.records import DURATION_BUCKETS

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

_ID = String(200)
_T = Float(precision=53)

runs = Table(
    "runs",
    metadata,
    Column("run_id", _ID, primary_key=True),
    Column("parent_run_id", _ID, ForeignKey("runs.run_id"), nullable=True),
    Column("role", String(64), nullable=False),
    Column("tenant", String(200), nullable=True),
    Column("labels", Text, nullable=False),  # JSON object
    Column("status", String(32), nullable=False),
    # Frozen at admission, never updated.
    Column("plan", Text, nullable=False),  # JSON list of route snapshots
    Column("run_grant", Text, nullable=False),  # "grant" is an SQL keyword
    Column("budget", Text, nullable=False),
    Column("policy", Text, nullable=False),
    Column("policy_hash", String(80), nullable=False),
    Column("selected_route", _ID, nullable=False),
    Column("content_hash", String(80), nullable=False),
    Column("deadline", _T, nullable=True),
    # Budget bounds, denormalized from the frozen budget so checks are single-row conditions.
    Column("max_calls", Integer, nullable=False),
    Column("max_retries", Integer, nullable=False),
    Column("max_cost_micros", BigInteger, nullable=False),
    Column("max_tokens", BigInteger, nullable=True),
    # Mutable counters (serialized by the run row lock).
    Column("calls_used", Integer, nullable=False, default=0),
    Column("retries_used", Integer, nullable=False, default=0),
    Column("reserved_micros", BigInteger, nullable=False, default=0),
    Column("posted_micros", BigInteger, nullable=False, default=0),
    Column("tokens_used", BigInteger, nullable=False, default=0),
    Column("tokens_reserved", BigInteger, nullable=False, default=0, server_default="0"),
    Column("carved_calls", Integer, nullable=False, default=0),
    Column("carved_retries", Integer, nullable=False, default=0),
    Column("carved_micros", BigInteger, nullable=False, default=0),
    Column("carved_tokens", BigInteger, nullable=False, default=0, server_default="0"),
    # What an ended Child gave back to its parent of its carve (the part it had not used and
    # could no longer use): its budget stays as admitted (invariant 5), so what it may still
    # use is its budget less this too (0018).
    Column("returned_calls", Integer, nullable=False, default=0, server_default="0"),
    Column("returned_retries", Integer, nullable=False, default=0, server_default="0"),
    Column("returned_micros", BigInteger, nullable=False, default=0, server_default="0"),
    Column("returned_tokens", BigInteger, nullable=False, default=0, server_default="0"),
    Column("current_route", _ID, nullable=True),
    # The last success's profile, or under a user pin the pinned one (a failover's does not
    # replace it).
    Column("current_profile", _ID, nullable=True),
    # Compactions the host recorded, and their count when current_profile was last set: a
    # compaction since then drops the session's auto-pinned profile.
    Column("compactions", Integer, nullable=False, default=0, server_default="0"),
    Column("profile_compactions", Integer, nullable=False, default=0, server_default="0"),
    # Executor lease and fence.
    Column("lease_holder", String(200), nullable=True),
    Column("fence", BigInteger, nullable=False, default=0),
    Column("lease_expires_at", _T, nullable=True),
    # Whether the Run failed over (a success on another route than its selected one, or a
    # ``move`` event), set in the transaction that makes it so: the audit counts a day's
    # failovers off a small index instead of testing every Run of the day (0012).
    Column("failed_over", Boolean, nullable=False, default=False, server_default=false()),
    Column("created_at", _T, nullable=False),
    Column("updated_at", _T, nullable=False),
    Index("ix_runs_parent_run_id", "parent_run_id"),
    # Partial: of the marked Runs only (WHERE failed_over; SQLite: failed_over = 1, as its
    # queries spell it), as migration 0012 creates it. The predicate is not declared here:
    # a dialect's keyword makes SQLAlchemy import that dialect wherever this module is
    # imported, PostgreSQL's into every SQLite process (and Alembic does not compare it).
    Index("ix_runs_failed_over_created_at", "created_at", "run_id"),
    Index("ix_runs_created_at", "created_at"),
    Index("ix_runs_status_lease", "status", "lease_expires_at"),
    Index("ix_runs_tenant_created_at", "tenant", "created_at"),
    Index("ix_runs_status_created_at", "status", "created_at"),  # audit: runs by status
)

attempts = Table(
    "attempts",
    metadata,
    Column("attempt_id", _ID, primary_key=True),
    Column("run_id", _ID, ForeignKey("runs.run_id"), nullable=False),
    # The run's frozen tenant and labels (its JSON text as stored), copied at begin so per-tenant
    # and per-label totals read a day's attempts without a join to every Run behind them.
    Column("tenant", String(200), nullable=True),
    Column("labels", Text, nullable=True),
    Column("turn_id", _ID, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("kind", String(16), nullable=False),  # first | retry | failover | probe
    Column("route_id", _ID, nullable=False),
    Column("provider", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    Column("group_id", _ID, nullable=False),
    Column("profile_id", _ID, nullable=True),
    Column("debit_id", _ID, nullable=False),
    Column("envelope_hash", String(80), nullable=False),
    # dispatching | succeeded | failed | unknown | rejected | not_sent
    Column("state", String(16), nullable=False),
    Column("reject_reason", String(64), nullable=True),
    Column("fact", Text, nullable=True),  # JSON FailureFact
    Column("category", String(32), nullable=True),
    Column("http_status", Integer, nullable=True),
    Column("effective_output", Boolean, nullable=False, default=False),
    Column("tool_started", Boolean, nullable=False, default=False),
    Column("prompt_tokens", BigInteger, nullable=True),
    Column("completion_tokens", BigInteger, nullable=True),
    Column("cost_micros", BigInteger, nullable=True),
    Column("reserved_micros", BigInteger, nullable=False),
    Column("reserved_tokens", BigInteger, nullable=False, default=0, server_default="0"),
    Column("model_reported", String(200), nullable=True),
    Column("output_hash", String(80), nullable=True),
    Column("settle_hash", String(80), nullable=True),
    Column("begin_hash", String(80), nullable=False),
    Column("fence", BigInteger, nullable=False),  # the fence the begin was written under
    Column("settle_fence", BigInteger, nullable=True),
    Column("executor", String(200), nullable=True),
    Column("created_at", _T, nullable=False),
    Column("settled_at", _T, nullable=True),
    # Latency by the ledger's clock, in seconds from the begin (created_at): to its settle by
    # the executor (``latency_s``; not for an Attempt recovery or an operator resolved), to the
    # response's first byte and to a stream's first content, as the send reported them.
    Column("latency_s", _T, nullable=True),
    Column("first_byte_s", _T, nullable=True),
    Column("first_token_s", _T, nullable=True),
    # The parts of prompt_tokens served from the provider's cache and of completion_tokens
    # spent reasoning, where the provider reports them (None: not reported).
    Column("cached_tokens", BigInteger, nullable=True),
    Column("reasoning_tokens", BigInteger, nullable=True),
    # On PostgreSQL the table is partitioned by created_at (migration 0008), and PostgreSQL
    # requires the partition key in every unique key: the primary key is (attempt_id,
    # created_at) there (PARTITIONED_KEYS) and this one (run_id, seq, created_at). A Run's seq
    # is taken under its row lock, so it stays unique per Run all the same.
    UniqueConstraint("run_id", "seq").ddl_if(dialect="sqlite"),
    UniqueConstraint("run_id", "seq", "created_at").ddl_if(dialect="postgresql"),
    Index("ix_attempts_route_id_created_at", "route_id", "created_at"),
    Index("ix_attempts_group_id_created_at", "group_id", "created_at"),
    Index("ix_attempts_state_created_at", "state", "created_at"),
    Index("ix_attempts_category_created_at", "category", "created_at"),
    Index("ix_attempts_created_at", "created_at"),
    Index("ix_attempts_tenant_created_at", "tenant", "created_at"),
    Index("ix_attempts_run_id_state", "run_id", "state"),  # audit: failover probe per run
)

debits = Table(
    "debits",
    metadata,
    Column("debit_id", _ID, primary_key=True),
    Column("run_id", _ID, ForeignKey("runs.run_id"), nullable=False),
    Column("attempt_id", _ID, nullable=False),
    Column("state", String(16), nullable=False),  # reserved | posted | voided
    Column("reserved_micros", BigInteger, nullable=False),
    Column("posted_micros", BigInteger, nullable=False, default=0),
    Column("created_at", _T, nullable=False),
    Column("settled_at", _T, nullable=True),
    Index("ix_debits_run_id", "run_id"),
    Index("ix_debits_attempt_id", "attempt_id"),
)

capacity_groups = Table(
    "capacity_groups",
    metadata,
    Column("group_id", _ID, primary_key=True),
    Column("max_in_flight", Integer, nullable=True),  # None = unlimited
    Column("mode", String(16), nullable=False),  # open | cooldown | unavailable
    Column("until", _T, nullable=True),  # the waiting floor
    Column("reason", String(200), nullable=True),
    Column("sampled_at", _T, nullable=True),
    Column("updated_at", _T, nullable=False),
)

group_slots = Table(
    "group_slots",
    metadata,
    Column("attempt_id", _ID, primary_key=True),
    Column("group_id", _ID, nullable=False),
    Column("run_id", _ID, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("acquired_at", _T, nullable=False),
    # PostgreSQL: the slot's number in [0, limit) of its limited group, unique per group, so
    # the database itself holds a group's in-flight count to its limit and begins of one group
    # need no lock held through their commit. NULL on SQLite (whose writers are serialized),
    # for unlimited groups, and for a lapsed slot whose number was taken over.
    Column("slot_no", Integer, nullable=True),
    Index("ix_group_slots_group_id", "group_id"),
    Index("ix_group_slots_run_id", "run_id"),
    Index("ux_group_slots_group_id_slot_no", "group_id", "slot_no", unique=True),
)

# A full limited group's queue: one place per waiting Attempt (not yet recorded as one).
# Places are served in ticket order; a place counts while now < expires_at and its Run's
# lease (of the same fence) is live, so a dead waiter's place lapses with its lease.
group_waiters = Table(
    "group_waiters",
    metadata,
    Column("ticket", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
           autoincrement=True),
    Column("group_id", _ID, nullable=False),
    Column("waiter_id", _ID, nullable=False, unique=True),  # the attempt id it will begin
    Column("run_id", _ID, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("enqueued_at", _T, nullable=False),
    Column("expires_at", _T, nullable=False),
    Index("ix_group_waiters_group_id_ticket", "group_id", "ticket"),
)

health = Table(
    "health",
    metadata,
    # route id, credential profile id, or provider:<name> (health keyed by provider), its name
    # case-folded and so up to three times an id's length (0021)
    Column("key", String(MAX_HEALTH_KEY_LENGTH), primary_key=True),
    Column("kind", String(16), nullable=False),  # route | profile | provider
    Column("provider", String(200), nullable=True),
    Column("cooldown_until", _T, nullable=True),
    Column("disabled_until", _T, nullable=True),
    Column("disabled_reason", String(64), nullable=True),
    Column("error_count", Integer, nullable=False, default=0),
    Column("failure_counts", Text, nullable=False),  # JSON {reason: n}
    Column("last_failure_at", _T, nullable=True),
    # The failure that counted the current outage (0019); NULL on older rows: last_failure_at.
    Column("counted_at", _T, nullable=True),
    Column("last_used", _T, nullable=True),
    Column("last_probe_at", _T, nullable=True),
    # When the counters reset by themselves under the policy that counted them (reads apply it).
    Column("reset_at", _T, nullable=True),
    # JSON list of failure times below the policy's cooling threshold (health.cooldown_after).
    Column("recent_failures", Text, nullable=True),
    Column("updated_at", _T, nullable=False),
)

events = Table(
    "events",
    metadata,
    Column("event_id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
           autoincrement=True),
    Column("run_id", _ID, nullable=True),
    Column("attempt_id", _ID, nullable=True),
    Column("kind", String(32), nullable=False),
    Column("data", Text, nullable=False),  # JSON
    Column("created_at", _T, nullable=False),
    Index("ix_events_run_id_event_id", "run_id", "event_id"),
    Index("ix_events_kind_created_at", "kind", "created_at"),
    Index("ix_events_run_id_kind", "run_id", "kind"),  # audit: move events per run
)

provenance = Table(
    "provenance",
    metadata,
    Column("run_id", _ID, nullable=False),
    Column("ref", _ID, nullable=False),  # attempt id or tool-call id
    Column("content_hash", String(80), nullable=False),
    Column("kind", String(16), nullable=False),  # model_output | tool_result
    Column("created_at", _T, nullable=False),
    PrimaryKeyConstraint("run_id", "ref", "content_hash"),
)

#: On PostgreSQL (migration 0008): the tables range-partitioned by ``created_at``, one partition
#: per month (:mod:`ledger.storage.partitions`), with their primary keys there. The key of the
#: declared tables above is the one SQLite has.
PARTITIONED_KEYS: dict[str, tuple[str, ...]] = {
    "attempts": ("attempt_id", "created_at"),
    "events": ("event_id", "created_at"),
}


def declared_for(obj: Any, dialect: str) -> bool:
    """Whether schema item ``obj`` (a constraint or index) exists on ``dialect``'s databases:
    false for one declared for another database only (``.ddl_if(dialect=...)``). Schema
    comparisons (Alembic's ``include_object``) skip the others."""
    cond = getattr(obj, "_ddl_if", None)
    wanted = getattr(cond, "dialect", None)
    if wanted is None:
        return True
    return dialect == wanted if isinstance(wanted, str) else dialect in wanted


#: The hours of ``attempts`` rolled up (:mod:`ledger.storage.rollups`): hour ``h`` is
#: ``[3600*h, 3600*(h+1))`` of ``created_at``. A row here says ``attempt_rollups`` holds that
#: hour's attempts not in flight exactly; any write to an attempt of the hour deletes it (a trigger,
#: migration 0011), and with it the hour's roll-up rows.
rollup_hours = Table(
    "rollup_hours",
    metadata,
    Column("hour", BigInteger, primary_key=True, autoincrement=False),
    Column("rolled_at", _T, nullable=False),
)

#: The UTC days folded (:meth:`ledger.storage.rollups.RollupQueries.fold`): day ``d`` is hours
#: ``[24*d, 24*(d+1))``, all marked in ``rollup_hours``, whose roll-up rows were summed per key
#: into rows at hour ``24*d`` (migration 0016). A write to any attempt of the day deletes this
#: row, the day's rows and its hours' marks (the same trigger as ``rollup_hours``).
rollup_days = Table(
    "rollup_days",
    metadata,
    Column("day", BigInteger, primary_key=True, autoincrement=False),
    Column("folded_at", _T, nullable=False),
)

#: Per rolled hour, the sums over its attempts but those in flight (``dispatching``, which the
#: audit reads from ``attempts`` itself) by route, group, provider, tenant and labels (the
#: attempt's copy, else its Run's), ``unknown`` ones and what they hold included (0015): what
#: :meth:`ledger.storage.audit.AuditQueries.totals` adds up, so a day's totals read some
#: hundreds of rows instead of the day's attempts.
attempt_rollups = Table(
    "attempt_rollups",
    metadata,
    Column("hour", BigInteger, nullable=False),
    Column("route_id", _ID, nullable=False),
    Column("group_id", _ID, nullable=False),
    Column("provider", String(200), nullable=False),
    Column("tenant", String(200), nullable=True),
    Column("labels", Text, nullable=True),
    Column("attempts", BigInteger, nullable=False),
    Column("succeeded", BigInteger, nullable=False),
    Column("failed", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_micros", BigInteger, nullable=False),
    # No default on PostgreSQL (0015): an older package's roll-up, naming neither, fails.
    Column("unknown", BigInteger, nullable=False),
    Column("held_micros", BigInteger, nullable=False),
    Index("ix_attempt_rollups_hour", "hour"),
)

#: The times of an Attempt that ``/metrics`` exposes as histograms, and their buckets' upper
#: bounds (:data:`~ledger.domain.records.DURATION_BUCKETS`): the roll-ups below keep
#: ``{time}_le{i}``, how many are at most ``METRIC_BOUNDS[i]``. Other bounds are read from
#: ``attempts``.
METRIC_TIMES = ("latency_s", "first_token_s", "first_byte_s")
METRIC_BOUNDS = DURATION_BUCKETS


def _metric_columns(*times: str) -> list[Column[Any]]:
    cols: list[Column[Any]] = []
    for m in times:
        cols += [Column(f"{m}_n", BigInteger, nullable=False),
                 Column(f"{m}_sum", _T, nullable=False)]
        cols += [Column(f"{m}_le{i}", BigInteger, nullable=False)
                 for i in range(len(METRIC_BOUNDS))]
    return cols


#: Per rolled hour, route and state, the sums ``/metrics`` counts over its attempts not in flight
#: (:meth:`ledger.storage.series.SeriesQueries.metrics_totals`): attempts, tokens, money
#: charged, and each time's histogram over :data:`METRIC_BOUNDS` (migration
#: 0013). Kept exact with ``attempt_rollups``, by the same marks and triggers.
#:
#: This table, ``wait_rollups`` and ``move_rollups`` also hold, at hour
#: :data:`~ledger.storage.hours.CARRIED_HOUR`, what ``/metrics`` counted of the history
#: retention dropped (one row per key): counts no table holds any more, which a change that
#: redoes the roll-ups (a migration emptying them, as 0013 did) must keep, or every counter
#: goes down.
metric_rollups = Table(
    "metric_rollups",
    metadata,
    Column("hour", BigInteger, nullable=False),
    Column("route_id", _ID, nullable=False),
    Column("state", String(16), nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("input", BigInteger, nullable=False),
    Column("output", BigInteger, nullable=False),
    Column("cache_read", BigInteger, nullable=False),
    Column("reasoning", BigInteger, nullable=False),
    Column("charged_micros", BigInteger, nullable=False),
    *_metric_columns(*METRIC_TIMES),
    Index("ix_metric_rollups_hour", "hour"),
)

#: Per rolled hour, the ``capacity_wait`` events (a turn's wait in a full group's queue) by
#: group and outcome, with the histogram of ``waited_s`` over :data:`METRIC_BOUNDS`, as
#: ``/metrics`` counts them; the trigger on ``events`` undoes the hour for these too (0013).
wait_rollups = Table(
    "wait_rollups",
    metadata,
    Column("hour", BigInteger, nullable=False),
    Column("group_id", Text, nullable=True),  # from the event's JSON, like move_rollups'
    Column("outcome", Text, nullable=True),
    *_metric_columns("waited_s"),
    Index("ix_wait_rollups_hour", "hour"),
)

#: The kinds of events the roll-ups count (``move_rollups``, ``wait_rollups``).
ROLLED_EVENTS = ("move", "capacity_wait")

#: Per rolled hour, tenant and labels, the Runs admitted in it that have ended (any status but
#: ``admitted`` and ``running``): how many, their money posted and held, as ``/metrics``
#: counts them, and their budgets, as spend against budgets counts them. A trigger on ``runs``
#: undoes the hour when such a Run is written: one ends, an operator settles an unknown attempt
#: of one that had, its budget or labels change (migrations 0013, 0014).
run_rollups = Table(
    "run_rollups",
    metadata,
    Column("hour", BigInteger, nullable=False),
    Column("tenant", String(200), nullable=True),
    Column("runs", BigInteger, nullable=False),
    Column("posted_micros", BigInteger, nullable=False),
    Column("reserved_micros", BigInteger, nullable=False),
    # Their budgets: what they were admitted with, less what they carved (0014) and gave
    # back to their parent (0018).
    Column("budget_micros", BigInteger, nullable=False, default=0, server_default="0"),
    # And their labels (the JSON text, as attempt_rollups keeps it), for spend by label (0014).
    Column("labels", Text, nullable=True),
    Index("ix_run_rollups_hour", "hour"),
)

#: Per rolled hour, the ``move`` events to another route by their routes and cause (as
#: ``/metrics`` counts them), whoever wrote them: a trigger on ``events`` undoes the hour when
#: a ``move`` of it is written or deleted after the roll-up (migration 0013).
move_rollups = Table(
    "move_rollups",
    metadata,
    Column("hour", BigInteger, nullable=False),
    # Text: a host's own ``move`` may carry any JSON (``Ledger.append_event``).
    Column("from_route", Text, nullable=True),
    Column("to_route", Text, nullable=True),
    Column("category", Text, nullable=True),
    Column("n", BigInteger, nullable=False),
    Index("ix_move_rollups_hour", "hour"),
)


def held_until(fence: ColumnElement[Any], run: FromClause = runs) -> ColumnElement[Any]:
    """Until when a capacity slot (or a place in a group's queue) taken under ``fence`` is in
    flight: the one definition admission, the projections, the audit and reconciliation count.

    It counts while the executor that took it still holds the Run ``run`` (this table, or an
    alias of it, joined on ``run_id``): the place's fence is the Run's, until the Run's lease
    lapses. ``NULL`` when it no longer counts (another executor took the Run over, or the lease
    was released): a dead executor's slots come back when its lease expires, before any
    recovery. Compare it with the time of the decision (``held_until(...) > now``).
    """
    r = run.c
    return case((fence == r.fence, r.lease_expires_at))


__all__ = [
    "METRIC_BOUNDS",
    "METRIC_TIMES",
    "PARTITIONED_KEYS",
    "ROLLED_EVENTS",
    "attempt_rollups",
    "attempts",
    "capacity_groups",
    "debits",
    "declared_for",
    "events",
    "group_slots",
    "group_waiters",
    "health",
    "held_until",
    "metadata",
    "metric_rollups",
    "move_rollups",
    "provenance",
    "rollup_days",
    "rollup_hours",
    "run_rollups",
    "runs",
    "wait_rollups",
]
