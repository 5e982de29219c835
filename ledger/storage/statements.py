"""Prebuilt SQL statements of the write path, and the PostgreSQL one-statement writes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    bindparam,
    func,
    literal,
    select,
    true,
)
from sqlalchemy.dialects import postgresql as pg_dialect

from ledger.model import Health
from ledger.records import (
    AttemptState,
    DebitState,
    RunStatus,
)
from ledger.storage import schema as s
from ledger.storage.rows import HEALTH_COLS
from ledger.storage.specs import BeginSpec

# -- prebuilt statements of the begin/settle hot path ------------------------------------------
# Built once: SQLAlchemy memoizes a statement object's cache key, so executing these costs no
# statement construction or cache-key walk per call (that was most of the write path's CPU time).
# Parameters named ``k_*`` are bound per call; other keys passed to an INSERT/UPDATE are columns.

A, R, D, H = s.attempts.c, s.runs.c, s.debits.c, s.health.c
# The run row under the lock: its counters, fence and lease, not the frozen JSON snapshots.
FROZEN_RUN_JSON = ("labels", "plan", "run_grant", "budget", "policy")
LOCK_RUN = (
    select(*[c for c in s.runs.c if c.name not in FROZEN_RUN_JSON])
    .where(R.run_id == bindparam("k_run_id")).with_for_update()
)
# The run's live state (counters, current route, lease) without its frozen snapshots.
SEL_RUN_LIVE = select(*[c for c in s.runs.c if c.name not in FROZEN_RUN_JSON]).where(
    R.run_id == bindparam("k_run_id"))
# The same lock, returning only what begin (fence and budget counters) and settle (fence) read:
# fewer result columns cost less to describe on every execution.
LOCK_RUN_FOR_BEGIN = (
    select(R.fence, R.lease_holder, R.lease_expires_at, R.max_calls, R.carved_calls,
           R.calls_used, R.max_cost_micros, R.carved_micros, R.reserved_micros, R.posted_micros,
           R.max_retries, R.carved_retries, R.retries_used, R.max_tokens, R.tokens_reserved,
           R.tokens_used)
    .where(R.run_id == bindparam("k_run_id")).with_for_update()
)
LOCK_RUN_FENCE = (
    select(R.fence, R.lease_holder, R.lease_expires_at, R.max_tokens)
    .where(R.run_id == bindparam("k_run_id")).with_for_update()
)
SEL_ATTEMPT_WITH_DEBIT = (
    select(s.attempts, D.state.label("debit_state"),
           D.reserved_micros.label("debit_reserved_micros"))
    .outerjoin(s.debits, D.debit_id == A.debit_id)
    .where(A.attempt_id == bindparam("k_attempt_id"))
)
SEL_ATTEMPT_WITH_DEBIT_IN_RUN = SEL_ATTEMPT_WITH_DEBIT.where(A.run_id == bindparam("k_run_id"))
# Computed after the run row is locked (its own statement, so its snapshot is taken after the
# lock: every concurrent begin of this run has committed), with the capacity group row read
# without a lock (``g_id`` is NULL when the group has no row yet). Not merged into the lock
# statement: in READ COMMITTED the rest of a locking statement reads the snapshot taken before
# it waited for the lock, so a begin that committed meanwhile would be missed.
CG = s.capacity_groups.c


def group_col(col: Any, label: str) -> Any:
    return select(col).where(CG.group_id == bindparam("k_group")).scalar_subquery().label(label)


BEGIN_LOOKUP = select(
    select(func.coalesce(func.max(A.seq), 0) + 1).where(A.run_id == bindparam("k_run_id"))
    .scalar_subquery().label("next_seq"),
    select(A.attempt_id).where(A.attempt_id == bindparam("k_attempt_id"))
    .scalar_subquery().label("prior"),
    group_col(CG.group_id, "g_id"),
    group_col(CG.max_in_flight, "g_max_in_flight"),
    group_col(CG.mode, "g_mode"),
    group_col(CG.until, "g_until"),
)
SEL_GROUP_FOR_UPDATE = select(s.capacity_groups).where(
    s.capacity_groups.c.group_id == bindparam("k_group")).with_for_update()
INS_DEBIT = s.debits.insert()
INS_ATTEMPT = s.attempts.insert()
INS_SLOT = s.group_slots.insert()
BEGIN_RUN = s.runs.update().where(R.run_id == bindparam("k_run_id")).values(
    calls_used=R.calls_used + bindparam("k_calls", type_=R.calls_used.type),
    retries_used=R.retries_used + bindparam("k_retries", type_=R.retries_used.type),
    reserved_micros=R.reserved_micros + bindparam("k_reserve", type_=R.reserved_micros.type),
    tokens_reserved=R.tokens_reserved + bindparam("k_reserve_tokens",
                                                  type_=R.tokens_reserved.type),
    status=bindparam("k_status"), updated_at=bindparam("k_now"),
)
SETTLE_ATTEMPT = s.attempts.update().where(A.attempt_id == bindparam("k_attempt_id"))
SETTLE_DEBIT = s.debits.update().where(D.debit_id == bindparam("k_debit_id"))
DEL_SLOT = s.group_slots.delete().where(s.group_slots.c.attempt_id == bindparam("k_attempt_id"))
SETTLE_RUN = s.runs.update().where(R.run_id == bindparam("k_run_id")).values(
    reserved_micros=R.reserved_micros - bindparam("k_release", type_=R.reserved_micros.type),
    posted_micros=R.posted_micros + bindparam("k_posted", type_=R.posted_micros.type),
    tokens_reserved=R.tokens_reserved - bindparam("k_release_tokens",
                                                  type_=R.tokens_reserved.type),
    tokens_used=R.tokens_used + bindparam("k_tokens", type_=R.tokens_used.type),
    # A not-sent Attempt was no model call: it gives its call back.
    calls_used=R.calls_used - bindparam("k_uncount", type_=R.calls_used.type),
    updated_at=bindparam("k_now"),
)
SETTLE_RUN_SUCCEEDED = SETTLE_RUN.values(
    current_route=bindparam("k_route"), current_profile=bindparam("k_profile"),
)
SEL_HEALTH_FOR_UPDATE = select(s.health).where(H.key == bindparam("k_key")).with_for_update()
UPD_HEALTH = s.health.update().where(H.key == bindparam("k_key"))

# Settle's read after the run lock: the attempt, its debit, and the first health row it updates
# (``h_*`` columns, ``h_key`` NULL when the row does not exist yet). On PostgreSQL the health row
# is locked here (the run row is already locked, so the lock order is unchanged) and its
# read-modify-write completes in the settle's write statement; SQLite's ``BEGIN IMMEDIATE``
# already holds the database's write lock.


def settle_read(dialect: str) -> Any:
    """The attempt, its debit's state and hold, and the first health row settle updates.

    The health row is read without a lock: most successes leave it unchanged and then write
    nothing, so settles of many workers on one route do not queue on it. Settle locks the row
    (after the run row, keeping the lock order) only when it is going to change it.
    """
    if dialect == "postgresql":
        h: Any = select(s.health).where(H.key == bindparam("k_key")).lateral("h")
        on: Any = true()
    else:
        h = s.health
        on = H.key == bindparam("k_key")
    return (
        select(s.attempts, D.state.label("debit_state"),
               D.reserved_micros.label("debit_reserved_micros"),
               *[h.c[n].label("h_" + n) for n in HEALTH_COLS])
        .select_from(s.attempts.outerjoin(s.debits, D.debit_id == A.debit_id).outerjoin(h, on))
        .where(A.attempt_id == bindparam("k_attempt_id"), A.run_id == bindparam("k_run_id"))
    )


SETTLE_READ = {d: settle_read(d) for d in ("postgresql", "sqlite")}

# -- PostgreSQL: each transaction's writes as one statement (data-modifying CTEs) -------------
# A round trip per statement is most of what the write path costs on PostgreSQL, so the writes of
# begin and settle, all decided before they are sent, go as one statement. The sub-statements
# touch distinct rows and none reads what another writes (they all see the statement's
# snapshot); the events go in one multi-row INSERT so their ids keep the order given. Built once
# per shape. SQLite keeps the plain statements (in-process: no round trips to save).


def bp(prefix: str, col: Any) -> Any:
    return bindparam(prefix + col.name, type_=col.type)


BEGIN_ATTEMPT_COLS = (
    "attempt_id", "run_id", "tenant", "turn_id", "seq", "kind", "route_id", "provider", "model",
    "group_id", "profile_id", "debit_id", "envelope_hash", "state", "reject_reason",
    "effective_output", "tool_started", "reserved_micros", "reserved_tokens", "begin_hash",
    "fence", "executor", "created_at", "settled_at",
)
DEBIT_COLS = ("debit_id", "run_id", "attempt_id", "state", "reserved_micros", "posted_micros",
               "created_at", "settled_at")
SLOT_COLS = ("attempt_id", "group_id", "run_id", "fence", "acquired_at")
SETTLE_ATTEMPT_COLS = (
    "state", "fact", "category", "http_status", "effective_output", "tool_started",
    "prompt_tokens", "completion_tokens", "cost_micros", "model_reported", "output_hash",
    "settle_hash", "settle_fence", "settled_at",
)
HEALTH_UPDATE_COLS = (
    "cooldown_until", "disabled_until", "disabled_reason", "error_count", "failure_counts",
    "last_failure_at", "last_used", "last_probe_at", "updated_at",
)
EVENT_COLS = ("run_id", "attempt_id", "kind", "data", "created_at")
PG_STATEMENTS: dict[tuple[Any, ...], Any] = {}


def events_cte(n: int) -> Any:
    e = s.events.c
    return s.events.insert().values([
        {c: bp(f"e{i}_", e[c]) for c in EVENT_COLS} for i in range(n)
    ]).cte("w_events")


def pg_begin_writes(n_events: int) -> Any:
    """Insert debit, attempt, slot and events, and count the call on the run, as one statement."""
    key = ("begin", n_events)
    stmt = PG_STATEMENTS.get(key)
    if stmt is None:
        gs = s.group_slots.c
        ctes = [
            s.debits.insert().values({c: bp("d_", D[c]) for c in DEBIT_COLS}).cte("w_debit"),
            s.attempts.insert().values({c: bp("a_", A[c]) for c in BEGIN_ATTEMPT_COLS})
            .cte("w_attempt"),
            s.group_slots.insert().values({c: bp("s_", gs[c]) for c in SLOT_COLS})
            .cte("w_slot"),
            BEGIN_RUN.cte("w_run"),
        ]
        if n_events:
            ctes.append(events_cte(n_events))
        stmt = PG_STATEMENTS[key] = select(literal(1)).add_cte(*ctes)
    return stmt


def begin_rows(spec: BeginSpec, seq: int | None, rejected: tuple[str, float | None] | None,
                now: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any],
                                     dict[str, Any]]:
    """The debit, attempt and slot rows and the run update's parameters of one begin."""
    debit_id = "d-" + spec.attempt_id
    state = AttemptState.REJECTED if rejected else AttemptState.DISPATCHING
    debit_state = DebitState.VOIDED if rejected else DebitState.RESERVED
    debit: dict[str, Any] = {
        "debit_id": debit_id, "run_id": spec.run_id, "attempt_id": spec.attempt_id,
        "state": debit_state.value, "reserved_micros": spec.reserve_micros,
        "posted_micros": 0, "created_at": now, "settled_at": now if rejected else None,
    }
    values: dict[str, Any] = {
        "attempt_id": spec.attempt_id, "run_id": spec.run_id, "tenant": spec.tenant,
        "turn_id": spec.turn_id, "seq": seq, "kind": spec.kind.value,
        "route_id": spec.route.id,
        "provider": spec.route.provider, "model": spec.route.model,
        "group_id": spec.route.group, "profile_id": spec.profile_id,
        "debit_id": debit_id, "envelope_hash": spec.envelope_hash, "state": state.value,
        "reject_reason": rejected[0] if rejected else None,
        "effective_output": False, "tool_started": False,
        "reserved_micros": spec.reserve_micros,
        "reserved_tokens": 0 if rejected else spec.reserve_tokens,
        "begin_hash": spec.begin_hash,
        "fence": spec.fence, "executor": spec.executor, "created_at": now,
        "settled_at": now if rejected else None,
    }
    slot = {"attempt_id": spec.attempt_id, "group_id": spec.route.group,
            "run_id": spec.run_id, "fence": spec.fence, "acquired_at": now}
    run_params = {"k_run_id": spec.run_id, "k_calls": 0 if rejected else 1,
                  "k_retries": 1 if spec.take_retry else 0,
                  "k_reserve": 0 if rejected else spec.reserve_micros,
                  "k_reserve_tokens": 0 if rejected else spec.reserve_tokens,
                  "k_status": RunStatus.RUNNING.value, "k_now": now}
    return debit, values, slot, run_params


def pg_settle_writes(debit: bool, succeeded: bool, health: bool, provenance: bool,
                      n_events: int) -> Any:
    """Update attempt, debit, run and health row, release the slot, insert provenance and
    events, as one statement."""
    key = ("settle", debit, succeeded, health, provenance, n_events)
    stmt = PG_STATEMENTS.get(key)
    if stmt is None:
        ctes = [
            SETTLE_ATTEMPT.values({c: bp("a_", A[c]) for c in SETTLE_ATTEMPT_COLS})
            .cte("w_attempt"),
            DEL_SLOT.cte("w_slot"),
            (SETTLE_RUN_SUCCEEDED if succeeded else SETTLE_RUN).cte("w_run"),
        ]
        if debit:
            ctes.append(SETTLE_DEBIT.values(
                state=bp("d_", D.state), posted_micros=bp("d_", D.posted_micros),
                settled_at=bp("d_", D.settled_at),
            ).cte("w_debit"))
        if health:
            ctes.append(UPD_HEALTH.values({c: bp("h_", H[c]) for c in HEALTH_UPDATE_COLS})
                        .cte("w_health"))
        if provenance:
            p = s.provenance.c
            ctes.append(pg_dialect.insert(s.provenance).values(
                run_id=bindparam("k_run_id", type_=p.run_id.type),
                ref=bindparam("k_attempt_id", type_=p.ref.type),
                content_hash=bp("p_", p.content_hash), kind=bp("p_", p.kind),
                created_at=bindparam("k_now", type_=p.created_at.type),
            ).on_conflict_do_nothing().cte("w_provenance"))
        if n_events:
            ctes.append(events_cte(n_events))
        stmt = PG_STATEMENTS[key] = select(literal(1)).add_cte(*ctes)
    return stmt


def event_params(events: Sequence[tuple[str, Mapping[str, Any]]], run_id: str,
                  attempt_id: str, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, (kind, data) in enumerate(events):
        out[f"e{i}_run_id"] = run_id
        out[f"e{i}_attempt_id"] = attempt_id
        out[f"e{i}_kind"] = kind
        out[f"e{i}_data"] = event_json(data)
        out[f"e{i}_created_at"] = now
    return out


def event_json(data: Mapping[str, Any]) -> str:
    return json.dumps(dict(data), sort_keys=True, default=str)


def health_values(new: Health, now: float) -> dict[str, Any]:
    return {
        "cooldown_until": new.cooldown_until, "disabled_until": new.disabled_until,
        "disabled_reason": new.disabled_reason, "error_count": new.error_count,
        "failure_counts": json.dumps(new.failure_counts, sort_keys=True),
        "last_failure_at": new.last_failure_at, "last_used": new.last_used,
        "last_probe_at": new.last_probe_at, "updated_at": now,
    }
