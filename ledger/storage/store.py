"""Every SQL statement of the ledger. Nothing outside ``ledger.storage`` touches the database.

Each public method is one transaction. Writes that carry a fence lock the run row first
(``SELECT ... FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE`` already serializes SQLite writers),
then check the fence, so a stale executor can write nothing. Budget, allowance and capacity checks
happen under that lock (capacity additionally under the group row lock, always taken after the run
row, so lock order is fixed and cannot deadlock).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    and_,
    func,
    or_,
    select,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from ledger import faults
from ledger.errors import (
    AdmissionConflict,
    AllowanceExhausted,
    BudgetExceeded,
    CapacityUnavailable,
    Conflict,
    FencedOut,
    InvalidArgument,
    InvalidState,
    LeaseHeld,
    NotFound,
    SettleConflict,
)
from ledger.model import GroupMode, GroupProjection, Health
from ledger.records import (
    AttemptRecord,
    AttemptState,
    DebitRecord,
    DebitState,
    EventRecord,
    Lease,
    Outcome,
    Page,
    RunRecord,
    RunStatus,
    from_micros,
)
from ledger.storage import schema as s
from ledger.storage.engine import mapped_errors, run_prebuilt, run_prebuilt_batch
from ledger.storage.rows import (
    attempt_record,
    health_from_read,
    health_record,
    run_record,
    written_attempt,
)
from ledger.storage.specs import (
    ADMISSION_FIELDS,
    AdmitSpec,
    BeginSpec,
    GroupUpdate,
    HealthUpdate,
    SettleSpec,
)
from ledger.storage.statements import (
    BEGIN_LOOKUP,
    BEGIN_RUN,
    DEL_SLOT,
    INS_ATTEMPT,
    INS_DEBIT,
    INS_SLOT,
    LOCK_RUN,
    LOCK_RUN_FENCE,
    LOCK_RUN_FOR_BEGIN,
    PG_BEGIN_COMMON,
    SEL_ATTEMPT_WITH_DEBIT,
    SEL_ATTEMPT_WITH_DEBIT_IN_RUN,
    SEL_GROUP_FOR_UPDATE,
    SEL_HEALTH_FOR_UPDATE,
    SETTLE_ATTEMPT,
    SETTLE_DEBIT,
    SETTLE_READ,
    SETTLE_RUN,
    SETTLE_RUN_SUCCEEDED,
    UPD_HEALTH,
    begin_rows,
    event_json,
    event_params,
    health_values,
    pg_begin_writes,
    pg_settle_writes,
)


class Store:
    """The storage layer over one SQLAlchemy engine."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.dialect = engine.dialect.name

    # -- transactions ---------------------------------------------------------------------

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One write transaction (``BEGIN IMMEDIATE`` on SQLite); other storage modules use it."""
        with mapped_errors(self.url), self.engine.connect() as conn:
            conn = conn.execution_options(ledger_write=True)
            with conn.begin():
                yield conn

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """One read transaction."""
        with mapped_errors(self.url), self.engine.connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        self.engine.dispose()

    def insert_for(self, table: Any) -> Any:
        """The dialect's INSERT (with ON CONFLICT support) for ``table``."""
        if self.dialect == "postgresql":
            return pg_dialect.insert(table)
        return sqlite_dialect.insert(table)

    # -- runs -----------------------------------------------------------------------------

    def admit(self, spec: AdmitSpec, now: float) -> tuple[RunRecord, bool]:
        """Insert a run; returns (record, created). Same id + same content -> the first record."""
        with self.writing() as conn:
            existing = conn.execute(
                select(s.runs).where(s.runs.c.run_id == spec.run_id).with_for_update()
            ).first()
            if existing is not None:
                differing = [f for f in ADMISSION_FIELDS
                             if getattr(existing, f) != getattr(spec, f)]
                if differing or existing.content_hash != spec.content_hash:
                    raise AdmissionConflict(
                        f"run {spec.run_id!r} was admitted before with different frozen content "
                        f"(differs in: {', '.join(differing) or 'content'}); use a new run id",
                        run_id=spec.run_id,
                        differing=differing or ["content"],
                    )
                return run_record(existing), False
            if spec.parent_run_id is not None:
                self._carve_from_parent(conn, spec)
            values = {
                f: getattr(spec, f)
                for f in (
                    "run_id", "parent_run_id", "role", "tenant", "labels", "plan", "run_grant",
                    "budget", "policy", "policy_hash", "selected_route", "content_hash",
                    "deadline", "max_calls", "max_retries", "max_cost_micros", "max_tokens",
                )
            }
            conn.execute(
                s.runs.insert().values(
                    **values,
                    status=RunStatus.ADMITTED.value,
                    calls_used=0, retries_used=0, reserved_micros=0, posted_micros=0,
                    tokens_used=0, carved_calls=0, carved_retries=0, carved_micros=0,
                    fence=0, created_at=now, updated_at=now,
                )
            )
            self.add_event(conn, spec.run_id, None, "admit",
                        {"policy_hash": spec.policy_hash, "parent": spec.parent_run_id}, now)
            row = conn.execute(select(s.runs).where(s.runs.c.run_id == spec.run_id)).one()
            return run_record(row), True

    def _carve_from_parent(self, conn: Connection, spec: AdmitSpec) -> None:
        r = s.runs.c
        parent = conn.execute(
            select(s.runs).where(r.run_id == spec.parent_run_id).with_for_update()
        ).first()
        if parent is None:
            raise NotFound(f"parent run {spec.parent_run_id!r} does not exist; admit it first",
                           run_id=spec.parent_run_id)
        if spec.parent_fence is None or parent.fence != spec.parent_fence:
            raise FencedOut(
                f"the parent run {spec.parent_run_id!r} is held under fence {parent.fence}, "
                f"not {spec.parent_fence}: only the parent's current executor can carve a child",
                run_id=spec.parent_run_id, fence=spec.parent_fence, current=parent.fence,
            )
        cost_left = (parent.max_cost_micros - parent.carved_micros - parent.reserved_micros
                     - parent.posted_micros)
        calls_left = parent.max_calls - parent.carved_calls - parent.calls_used
        retries_left = parent.max_retries - parent.carved_retries - parent.retries_used
        if spec.max_cost_micros > cost_left:
            raise BudgetExceeded(
                f"child budget {from_micros(spec.max_cost_micros)} exceeds what parent "
                f"{spec.parent_run_id!r} has left ({from_micros(cost_left)}); ask for less",
                run_id=spec.run_id, field="budget.max_cost",
            )
        if spec.max_calls > calls_left or spec.max_retries > retries_left:
            raise AllowanceExhausted(
                f"child allowance (calls {spec.max_calls}, retries {spec.max_retries}) exceeds "
                f"what parent {spec.parent_run_id!r} has left (calls {calls_left}, retries "
                f"{retries_left}); ask for less",
                run_id=spec.run_id, field="budget.max_calls",
            )
        conn.execute(
            s.runs.update().where(r.run_id == spec.parent_run_id).values(
                carved_micros=r.carved_micros + spec.max_cost_micros,
                carved_calls=r.carved_calls + spec.max_calls,
                carved_retries=r.carved_retries + spec.max_retries,
            )
        )

    def get_run(self, run_id: str) -> RunRecord:
        with self.reading() as conn:
            row = conn.execute(select(s.runs).where(s.runs.c.run_id == run_id)).first()
        if row is None:
            raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                           run_id=run_id)
        return run_record(row)

    def children(self, run_id: str) -> list[RunRecord]:
        with self.reading() as conn:
            rows = conn.execute(
                select(s.runs).where(s.runs.c.parent_run_id == run_id)
                .order_by(s.runs.c.created_at, s.runs.c.run_id)
            ).all()
        return [run_record(r) for r in rows]

    def _lock_run(self, conn: Connection, run_id: str, fence: int | None,
                  stmt: Any = LOCK_RUN, rows: list[Any] | None = None) -> Any:
        """The run row, locked; ``rows``: the lock statement's rows when already executed."""
        if rows is None:
            rows = run_prebuilt(conn, stmt, {"k_run_id": run_id})
        row = rows[0] if rows else None
        if row is None:
            raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                           run_id=run_id)
        if fence is not None and row.fence != fence:
            raise FencedOut(
                f"run {run_id!r} is now held under fence {row.fence}; this executor's fence "
                f"{fence} is stale: stop working on the run (another executor took it over)",
                run_id=run_id, fence=fence, current=row.fence,
            )
        return row

    # -- leases ---------------------------------------------------------------------------

    def acquire_lease(self, run_id: str, executor: str, ttl_s: float, now: float,
                      *, steal_expired_only: bool = True) -> Lease:
        r = s.runs.c
        with self.writing() as conn:
            row = self._lock_run(conn, run_id, None)
            live = row.lease_holder is not None and (row.lease_expires_at or 0) > now
            if live and row.lease_holder != executor and steal_expired_only:
                raise LeaseHeld(
                    f"run {run_id!r} is leased by {row.lease_holder!r} until "
                    f"{row.lease_expires_at}; wait for it to expire or for recovery",
                    run_id=run_id, holder=row.lease_holder, expires_at=row.lease_expires_at,
                )
            fence = row.fence + 1
            conn.execute(
                s.runs.update().where(r.run_id == run_id).values(
                    lease_holder=executor, fence=fence, lease_expires_at=now + ttl_s,
                    updated_at=now,
                )
            )
            self.add_event(conn, run_id, None, "lease",
                        {"executor": executor, "fence": fence, "previous": row.lease_holder}, now)
        return Lease(run_id, executor, fence, now + ttl_s)

    def renew_lease(self, run_id: str, fence: int, ttl_s: float, now: float) -> Lease:
        r = s.runs.c
        with self.writing() as conn:
            row = self._lock_run(conn, run_id, fence)
            conn.execute(
                s.runs.update().where(r.run_id == run_id)
                .values(lease_expires_at=now + ttl_s, updated_at=now)
            )
        return Lease(run_id, row.lease_holder or "", fence, now + ttl_s)

    def release_lease(self, run_id: str, fence: int, now: float) -> None:
        r = s.runs.c
        with self.writing() as conn:
            self._lock_run(conn, run_id, fence)
            held = conn.execute(
                select(func.count()).select_from(s.group_slots)
                .where(s.group_slots.c.run_id == run_id, s.group_slots.c.fence == fence)
            ).scalar_one()
            if held:
                raise InvalidState(
                    f"run {run_id!r} still has {held} attempt(s) in flight; settle them "
                    "(or mark them unknown) before releasing the lease",
                    run_id=run_id, in_flight=held,
                )
            conn.execute(
                s.runs.update().where(r.run_id == run_id)
                .values(lease_holder=None, lease_expires_at=None, updated_at=now)
            )

    def finish_run(self, run_id: str, fence: int, status: RunStatus, now: float) -> None:
        r = s.runs.c
        with self.writing() as conn:
            self._lock_run(conn, run_id, fence)
            conn.execute(s.runs.update().where(r.run_id == run_id)
                         .values(status=status.value, updated_at=now))
            self.add_event(conn, run_id, None, "finish", {"status": status.value}, now)

    # -- permissions ----------------------------------------------------------------------

    def reserve_retry(self, run_id: str, fence: int, now: float,
                      data: Mapping[str, Any] | None = None) -> int:
        """Take one retry permission; returns how many are left after it."""
        r = s.runs.c
        with self.writing() as conn:
            row = self._lock_run(conn, run_id, fence)
            left = row.max_retries - row.carved_retries - row.retries_used
            if left <= 0:
                raise AllowanceExhausted(
                    f"run {run_id!r} has no retry permission left "
                    f"({row.retries_used} of {row.max_retries} used)",
                    run_id=run_id, field="retries",
                )
            conn.execute(s.runs.update().where(r.run_id == run_id)
                         .values(retries_used=r.retries_used + 1, updated_at=now))
            self.add_event(conn, run_id, None, "retry_permission", dict(data or {}), now)
        return int(left) - 1

    # -- attempts -------------------------------------------------------------------------

    def begin_attempt(self, spec: BeginSpec, now: float) -> AttemptRecord:
        """Record an attempt before it is sent, in one transaction (see module docstring)."""
        rejected: tuple[str, float | None] | None = None
        with self.writing() as conn:
            # A batch of one: on PostgreSQL the transaction's BEGIN goes with it.
            run = self._lock_run(conn, spec.run_id, spec.fence, LOCK_RUN_FOR_BEGIN,
                                 run_prebuilt_batch(conn, [(LOCK_RUN_FOR_BEGIN,
                                                            {"k_run_id": spec.run_id})])[0])
            values: dict[str, Any] | None = None
            debit_state = DebitState.RESERVED
            if (self.dialect == "postgresql" and not spec.events
                    and run.max_calls - run.carved_calls - run.calls_used > 0
                    and spec.reserve_micros <= (run.max_cost_micros - run.carved_micros
                                                - run.reserved_micros - run.posted_micros)):
                # The common case in one statement: written only if no attempt has this id and
                # the group is open and unlimited; else nothing is written and the checks below
                # decide, as for every other begin.
                values = self._pg_begin_common(conn, spec, now)
            if values is None:
                nxt = run_prebuilt(conn, BEGIN_LOOKUP, {"k_run_id": spec.run_id,
                                                        "k_attempt_id": spec.attempt_id,
                                                        "k_group": spec.route.group})[0]
                if nxt.prior is not None:
                    prior = conn.execute(SEL_ATTEMPT_WITH_DEBIT,
                                         {"k_attempt_id": spec.attempt_id}).one()
                    if prior.begin_hash == spec.begin_hash and prior.run_id == spec.run_id:
                        # the same write, acknowledged again
                        return attempt_record(prior, prior.debit_state)
                    raise Conflict(
                        f"attempt id {spec.attempt_id!r} is already recorded with different "
                        "content; use a new attempt id for a new physical call",
                        attempt_id=spec.attempt_id,
                    )
                if run.max_calls - run.carved_calls - run.calls_used <= 0:
                    raise AllowanceExhausted(
                        f"run {spec.run_id!r} has used its model-call allowance "
                        f"({run.calls_used} of {run.max_calls}); nothing was sent",
                        run_id=spec.run_id, field="calls",
                    )
                available = (run.max_cost_micros - run.carved_micros - run.reserved_micros
                             - run.posted_micros)
                if spec.reserve_micros > available:
                    raise BudgetExceeded(
                        f"a hold of {from_micros(spec.reserve_micros)} would overdraw run "
                        f"{spec.run_id!r} (left: {from_micros(available)}); nothing was sent",
                        run_id=spec.run_id, field="cost",
                        requested=str(from_micros(spec.reserve_micros)),
                        available=str(from_micros(available)),
                    )
                rejected = self._admit_capacity(conn, spec.route.group, now, nxt)
                seq = nxt.next_seq
                debit_state = DebitState.VOIDED if rejected else DebitState.RESERVED
                debit, values, slot, run_params = begin_rows(spec, seq, rejected, now)
                if not rejected and self.dialect == "postgresql":
                    # The same writes as below, as one statement (one round trip).
                    params = {**run_params,
                              **event_params(spec.events, spec.run_id, spec.attempt_id, now)}
                    params.update({"d_" + k: v for k, v in debit.items()})
                    params.update({"a_" + k: v for k, v in values.items()})
                    params.update({"s_" + k: v for k, v in slot.items()})
                    run_prebuilt(conn, pg_begin_writes(len(spec.events)), params)
                else:
                    run_prebuilt(conn, INS_DEBIT, debit)
                    run_prebuilt(conn, INS_ATTEMPT, values)
                    for kind, data in spec.events:
                        self.add_event(conn, spec.run_id, spec.attempt_id, kind, data, now)
                    if rejected:
                        self.add_event(conn, spec.run_id, spec.attempt_id, "reject",
                                    {"reason": rejected[0], "until": rejected[1],
                                     "group": spec.route.group}, now)
                    else:
                        run_prebuilt(conn, INS_SLOT, slot)
                        run_prebuilt(conn, BEGIN_RUN, run_params)
            # The record from what was just written (no re-read of the rows).
            record = written_attempt(values, debit_state.value)
            faults.point("begin.before_commit")
        faults.point("begin.after_commit")
        if rejected:
            raise CapacityUnavailable(
                f"capacity group {spec.route.group!r} refused attempt {spec.attempt_id!r} "
                f"({rejected[0]}); it was recorded as rejected, its hold voided, nothing sent",
                attempt_id=spec.attempt_id, group=spec.route.group, reason=rejected[0],
                until=rejected[1],
            )
        return record

    def _pg_begin_common(self, conn: Connection, spec: BeginSpec, now: float
                         ) -> dict[str, Any] | None:
        """Begin's writes as one statement, conditional on no attempt having this id and the
        group being open without a limit; the attempt's values if written, else None (nothing
        was written). Run after the run lock, so it sees every begin of this run, as the
        lookup would; the budget and allowance were checked on the locked row."""
        debit, values, slot, run_params = begin_rows(spec, None, None, now)
        params = {**run_params, "k_attempt_id": spec.attempt_id, "k_group": spec.route.group,
                  "k_open": GroupMode.OPEN.value}
        params.update({"d_" + k: v for k, v in debit.items()})
        params.update({"a_" + k: v for k, v in values.items() if k != "seq"})
        params.update({"s_" + k: v for k, v in slot.items()})
        rows = run_prebuilt(conn, PG_BEGIN_COMMON, params)
        seq = rows[0][0] if rows else None
        if seq is None:
            return None
        values["seq"] = seq
        return values

    def _admit_capacity(self, conn: Connection, group: str, now: float, looked_up: Any
                        ) -> tuple[str, float | None] | None:
        """None when the group admits one more attempt, else (reason, waiting floor).
        ``looked_up`` carries the group row as read (unlocked) after the run lock."""
        # Only a limited group needs its row lock (the slot count must be serialized); reading
        # the mode of an unlimited group without it keeps busy groups from serializing begins.
        row: Any = None
        if looked_up.g_id is not None:
            row = SimpleNamespace(mode=looked_up.g_mode, until=looked_up.g_until,
                                  max_in_flight=looked_up.g_max_in_flight)
        if row is None:
            conn.execute(
                self.insert_for(s.capacity_groups)
                .values(group_id=group, mode=GroupMode.OPEN.value, updated_at=now)
                .on_conflict_do_nothing()
            )
            row = conn.execute(SEL_GROUP_FOR_UPDATE, {"k_group": group}).one()
        elif row.max_in_flight is not None:
            row = conn.execute(SEL_GROUP_FOR_UPDATE, {"k_group": group}).one()
        if row.mode != GroupMode.OPEN.value and (row.until is None or row.until > now):
            return ("group_" + row.mode, row.until)
        if row.max_in_flight is not None:
            held = self._live_slots(conn, group, now)
            if held >= row.max_in_flight:
                return ("capacity_full", None)
        return None

    def _live_slots(self, conn: Connection, group: str, now: float) -> int:
        # A slot counts only while its executor still holds the run (same fence, lease alive):
        # slots of dead executors come back when their lease expires, before any recovery.
        gs = s.group_slots.c
        r = s.runs.c
        return int(
            conn.execute(
                select(func.count()).select_from(
                    s.group_slots.join(s.runs, r.run_id == gs.run_id)
                ).where(
                    gs.group_id == group, gs.fence == r.fence,
                    r.lease_expires_at.is_not(None), r.lease_expires_at > now,
                )
            ).scalar_one()
        )

    def settle_attempt(self, run_id: str, spec: SettleSpec, now: float) -> AttemptRecord:
        """Record an attempt's outcome in one transaction; a settled attempt is never rewritten."""
        with self.writing() as conn:
            # The run lock, then the attempt with its debit's state and hold (and the first
            # health row it updates, unlocked), in one statement; both in one round trip on
            # PostgreSQL (the read runs after the lock is granted, and writes nothing).
            health_keys = list(spec.health)
            params: dict[str, Any] = {"k_attempt_id": spec.attempt_id, "k_run_id": run_id}
            read: tuple[Any, dict[str, Any]] = (
                (SETTLE_READ[self.dialect], {**params, "k_key": health_keys[0]}) if health_keys
                else (SEL_ATTEMPT_WITH_DEBIT_IN_RUN, params))
            locked_rows, rows = run_prebuilt_batch(
                conn, [(LOCK_RUN_FENCE, {"k_run_id": run_id}), read])
            self._lock_run(conn, run_id, spec.fence, LOCK_RUN_FENCE, locked_rows)
            att = rows[0] if rows else None
            if att is None:
                raise NotFound(f"unknown attempt id {spec.attempt_id!r} in run {run_id!r}",
                               attempt_id=spec.attempt_id, run_id=run_id)
            if att.state == AttemptState.REJECTED.value:
                raise InvalidState(
                    f"attempt {spec.attempt_id!r} was rejected before dispatch; nothing to settle",
                    attempt_id=spec.attempt_id,
                )
            if att.state != AttemptState.DISPATCHING.value:
                if att.settle_hash == spec.settle_hash:
                    return attempt_record(att, att.debit_state)  # the same settle again: same write
                if att.state == AttemptState.UNKNOWN.value and att.settle_hash is None:
                    pass  # recovery marked it unknown; a late receipt may still settle it
                else:
                    raise SettleConflict(
                        f"attempt {spec.attempt_id!r} is already settled as {att.state} with "
                        "different content; a settled attempt is immutable",
                        attempt_id=spec.attempt_id, state=att.state,
                    )
            if att.debit_state is None:  # no debit row: fails as before (NoResultFound)
                conn.execute(select(s.debits).where(s.debits.c.debit_id == att.debit_id)).one()
            reserved = att.debit_reserved_micros
            posted = 0
            if spec.outcome is Outcome.UNKNOWN:
                debit_state = DebitState.RESERVED  # may have executed: the hold stays
            elif spec.void_hold:
                debit_state = DebitState.VOIDED
            else:
                debit_state = DebitState.POSTED
                posted = min(spec.cost_micros or 0, reserved)
            fact = spec.fact
            values: dict[str, Any] = {
                "state": spec.outcome.value,
                "fact": json.dumps(fact.to_json()) if fact else None,
                "category": fact.category.value if fact else None,
                "http_status": fact.status if fact else None,
                "effective_output": spec.effective_output,
                "tool_started": spec.tool_started,
                "prompt_tokens": spec.prompt_tokens,
                "completion_tokens": spec.completion_tokens,
                "cost_micros": spec.cost_micros,
                "model_reported": spec.model_reported,
                "output_hash": spec.output_hash,
                "settle_hash": spec.settle_hash,
                "settle_fence": spec.fence,
                "settled_at": now,
            }
            settle_debit = (att.debit_state == DebitState.RESERVED.value
                            and debit_state is not DebitState.RESERVED)
            final_debit_state = debit_state.value if settle_debit else att.debit_state
            release = reserved if settle_debit else 0
            succeeded = spec.outcome is Outcome.SUCCEEDED
            tokens = (spec.prompt_tokens or 0) + (spec.completion_tokens or 0)
            run_params: dict[str, Any] = {
                "k_run_id": run_id, "k_release": release, "k_posted": posted,
                "k_tokens": tokens, "k_now": now,
            }
            if succeeded:
                run_params.update(k_route=att.route_id, k_profile=att.profile_id)
            debit_params = {"state": debit_state.value, "posted_micros": posted,
                            "settled_at": now}
            # The first health row's new values, when it exists and changes. An unchanged row
            # (a success on a healthy key) is neither locked nor written: serialized, that
            # settle simply comes before any failure committed meanwhile. A changing row is
            # locked and the pure health function is applied to the row as locked.
            first_health: dict[str, Any] | None = None
            health_done: set[str] = set()
            if health_keys and att.h_key is not None:
                key0 = health_keys[0]
                _kind, _provider, update = spec.health[key0]
                seen = health_from_read(att)
                new_health = update(seen)
                if new_health != seen:
                    if self.dialect == "postgresql":
                        locked = run_prebuilt(conn, SEL_HEALTH_FOR_UPDATE, {"k_key": key0})[0]
                        new_health = update(health_record(locked))
                    first_health = health_values(new_health, now)
                health_done.add(key0)
            provenance = succeeded and bool(spec.output_hash)
            if self.dialect == "postgresql":
                # The same writes as below, as one statement (one round trip).
                params = {"k_attempt_id": spec.attempt_id, "k_debit_id": att.debit_id,
                          **run_params,
                          **event_params(spec.events, run_id, spec.attempt_id, now)}
                params.update({"a_" + k: v for k, v in values.items()})
                if settle_debit:
                    params.update({"d_" + k: v for k, v in debit_params.items()})
                if first_health is not None:
                    params["k_key"] = health_keys[0]
                    params.update({"h_" + k: v for k, v in first_health.items()})
                if provenance:
                    params.update(p_content_hash=spec.output_hash, p_kind="model_output")
                run_prebuilt(conn, pg_settle_writes(settle_debit, succeeded,
                                                    first_health is not None, provenance,
                                                    len(spec.events)), params)
            else:
                run_prebuilt(conn, SETTLE_ATTEMPT, {"k_attempt_id": spec.attempt_id, **values})
                if settle_debit:
                    run_prebuilt(conn, SETTLE_DEBIT,
                                 {"k_debit_id": att.debit_id, **debit_params})
                run_prebuilt(conn, DEL_SLOT, {"k_attempt_id": spec.attempt_id})
                run_prebuilt(conn, SETTLE_RUN_SUCCEEDED if succeeded else SETTLE_RUN,
                             run_params)
                if first_health is not None:
                    run_prebuilt(conn, UPD_HEALTH, {"k_key": health_keys[0], **first_health})
            # Health rows not handled above, in the order given (the lock order).
            for key in health_keys:
                if key in health_done:
                    continue
                kind, provider, update = spec.health[key]
                self._update_health(conn, key, kind, provider, update, now)
            if spec.group_update is not None:
                self._write_group_fact(conn, att.group_id, spec.group_update, now)
            if self.dialect != "postgresql":
                if provenance:
                    conn.execute(
                        self.insert_for(s.provenance).values(
                            run_id=run_id, ref=spec.attempt_id, content_hash=spec.output_hash,
                            kind="model_output", created_at=now,
                        ).on_conflict_do_nothing()
                    )
                for kind, data in spec.events:
                    self.add_event(conn, run_id, spec.attempt_id, kind, data, now)
            # The record from the row as read plus what was just written (no re-read).
            record = written_attempt({**att._mapping, **values}, final_debit_state)
            faults.point("settle.before_commit")
        faults.point("settle.after_commit")
        return record

    def _update_health(self, conn: Connection, key: str, kind: str, provider: str | None,
                       update: HealthUpdate, now: float) -> None:
        row = conn.execute(SEL_HEALTH_FOR_UPDATE, {"k_key": key}).first()
        if row is None:
            conn.execute(
                self.insert_for(s.health).values(
                    key=key, kind=kind, provider=provider, error_count=0, failure_counts="{}",
                    updated_at=now,
                ).on_conflict_do_nothing()
            )
            row = conn.execute(SEL_HEALTH_FOR_UPDATE, {"k_key": key}).one()
        conn.execute(UPD_HEALTH, {"k_key": key, **health_values(update(health_record(row)), now)})

    def _write_group_fact(self, conn: Connection, group: str, upd: GroupUpdate, now: float) -> None:
        g = s.capacity_groups.c
        row = conn.execute(
            select(s.capacity_groups).where(g.group_id == group).with_for_update()
        ).first()
        until = upd.until
        if row is not None and row.until is not None and until is not None and row.mode != "open":
            until = max(until, row.until)  # a later fact never shortens a known waiting floor
        if row is None:
            conn.execute(
                self.insert_for(s.capacity_groups).values(
                    group_id=group, mode=upd.mode.value, until=until, reason=upd.reason,
                    sampled_at=now, updated_at=now,
                ).on_conflict_do_nothing()
            )
        else:
            conn.execute(
                s.capacity_groups.update().where(g.group_id == group).values(
                    mode=upd.mode.value, until=until, reason=upd.reason, sampled_at=now,
                    updated_at=now,
                )
            )

    def mark_unknown(self, run_id: str, attempt_id: str, fence: int, now: float,
                     reason: str) -> AttemptRecord:
        """Dispatched without a receipt: unknown, keeping its hold (used by recovery)."""
        a = s.attempts.c
        with self.writing() as conn:
            self._lock_run(conn, run_id, fence)
            att = conn.execute(select(s.attempts).where(a.attempt_id == attempt_id)).one()
            if att.state == AttemptState.DISPATCHING.value:
                conn.execute(s.attempts.update().where(a.attempt_id == attempt_id)
                             .values(state=AttemptState.UNKNOWN.value, settled_at=now,
                                     settle_fence=fence))
                conn.execute(s.group_slots.delete().where(s.group_slots.c.attempt_id == attempt_id))
                self.add_event(conn, run_id, attempt_id, "unknown", {"reason": reason}, now)
            row = conn.execute(select(s.attempts).where(a.attempt_id == attempt_id)).one()
            return self._attempt(conn, row)

    # -- groups, health, probes -----------------------------------------------------------

    def configure_group(self, group: str, max_in_flight: int | None, now: float) -> None:
        g = s.capacity_groups.c
        with self.writing() as conn:
            stmt = self.insert_for(s.capacity_groups).values(
                group_id=group, max_in_flight=max_in_flight, mode=GroupMode.OPEN.value,
                updated_at=now,
            )
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[g.group_id],
                set_={"max_in_flight": max_in_flight, "updated_at": now},
            ))

    def set_group_mode(self, group: str, upd: GroupUpdate, now: float) -> None:
        with self.writing() as conn:
            g = s.capacity_groups.c
            row = conn.execute(select(s.capacity_groups).where(g.group_id == group)).first()
            if row is None:
                conn.execute(self.insert_for(s.capacity_groups).values(
                    group_id=group, mode=GroupMode.OPEN.value, updated_at=now,
                ).on_conflict_do_nothing())
            conn.execute(s.capacity_groups.update().where(g.group_id == group).values(
                mode=upd.mode.value, until=upd.until, reason=upd.reason, sampled_at=now,
                updated_at=now,
            ))

    def group_projections(self, groups: Iterable[str] | None, now: float
                          ) -> dict[str, GroupProjection]:
        g = s.capacity_groups.c
        with self.reading() as conn:
            q = select(s.capacity_groups)
            if groups is not None:
                q = q.where(g.group_id.in_(list(groups)))
            rows = conn.execute(q).all()
            out: dict[str, GroupProjection] = {}
            for row in rows:
                mode = GroupMode(row.mode)
                if mode is not GroupMode.OPEN and row.until is not None and row.until <= now:
                    mode = GroupMode.OPEN  # the waiting floor has passed
                out[row.group_id] = GroupProjection(
                    group=row.group_id, mode=mode, until=row.until,
                    sampled_at=row.sampled_at if row.sampled_at is not None else now,
                    in_flight=self._live_slots(conn, row.group_id, now),
                    limit=row.max_in_flight,
                )
        return out

    def health(self, keys: Iterable[str] | None = None) -> dict[str, Health]:
        h = s.health.c
        with self.reading() as conn:
            q = select(s.health)
            if keys is not None:
                q = q.where(h.key.in_(list(keys)))
            return {row.key: health_record(row) for row in conn.execute(q).all()}

    def claim_probe(self, key: str, provider: str | None, now: float, interval_s: float) -> bool:
        """Take the cluster-wide probe slot for ``key``: True for exactly one caller per window."""
        h = s.health.c
        with self.writing() as conn:
            conn.execute(
                self.insert_for(s.health).values(
                    key=key, kind="route", provider=provider, error_count=0, failure_counts="{}",
                    updated_at=now,
                ).on_conflict_do_nothing()
            )
            res = conn.execute(
                s.health.update().where(
                    h.key == key,
                    or_(h.last_probe_at.is_(None), h.last_probe_at <= now - interval_s),
                ).values(last_probe_at=now, updated_at=now)
            )
            return bool(res.rowcount == 1)

    # -- provenance and events ------------------------------------------------------------

    def record_provenance(self, run_id: str, fence: int, ref: str, content_hash: str,
                          kind: str, now: float) -> None:
        with self.writing() as conn:
            self._lock_run(conn, run_id, fence)
            conn.execute(
                self.insert_for(s.provenance).values(
                    run_id=run_id, ref=ref, content_hash=content_hash, kind=kind, created_at=now,
                ).on_conflict_do_nothing()
            )

    def provenance(self, run_ids: Sequence[str]) -> dict[str, set[str]]:
        p = s.provenance.c
        with self.reading() as conn:
            rows = conn.execute(select(p.ref, p.content_hash).where(p.run_id.in_(list(run_ids))))
            out: dict[str, set[str]] = {}
            for ref, h in rows:
                out.setdefault(ref, set()).add(h)
            return out

    def append_event(self, run_id: str | None, attempt_id: str | None, kind: str,
                     data: Mapping[str, Any], now: float, fence: int | None = None) -> None:
        with self.writing() as conn:
            if run_id is not None and fence is not None:
                self._lock_run(conn, run_id, fence)
            self.add_event(conn, run_id, attempt_id, kind, data, now)

    def add_event(self, conn: Connection, run_id: str | None, attempt_id: str | None, kind: str,
               data: Mapping[str, Any], now: float) -> None:
        conn.execute(s.events.insert().values(
            run_id=run_id, attempt_id=attempt_id, kind=kind, data=event_json(data),
            created_at=now,
        ))

    def events(self, run_id: str, kinds: Sequence[str] | None = None) -> list[EventRecord]:
        e = s.events.c
        with self.reading() as conn:
            q = select(s.events).where(e.run_id == run_id)
            if kinds:
                q = q.where(e.kind.in_(list(kinds)))
            rows = conn.execute(q.order_by(e.event_id)).all()
        return [EventRecord(r.event_id, r.run_id, r.attempt_id, r.kind, json.loads(r.data),
                            r.created_at) for r in rows]

    # -- reads ----------------------------------------------------------------------------

    def get_attempt(self, attempt_id: str) -> AttemptRecord:
        with self.reading() as conn:
            row = conn.execute(SEL_ATTEMPT_WITH_DEBIT, {"k_attempt_id": attempt_id}).first()
            if row is None:
                raise NotFound(f"unknown attempt id {attempt_id!r}", attempt_id=attempt_id)
            return attempt_record(row, row.debit_state)

    def timeline(self, run_id: str) -> list[AttemptRecord]:
        a = s.attempts.c
        d = s.debits.c
        with self.reading() as conn:
            known = conn.execute(select(s.runs.c.run_id).where(s.runs.c.run_id == run_id))
            if known.first() is None:
                raise NotFound(f"unknown run id {run_id!r}", run_id=run_id)
            rows = conn.execute(
                select(s.attempts, d.state.label("debit_state"))
                .join(s.debits, d.debit_id == a.debit_id)
                .where(a.run_id == run_id).order_by(a.seq)
            ).all()
        return [attempt_record(row, row.debit_state) for row in rows]

    def attempts(
        self,
        *,
        route: str | None = None,
        group: str | None = None,
        state: str | None = None,
        category: str | None = None,
        since: float | None = None,
        until: float | None = None,
        run_ids: Sequence[str] | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[AttemptRecord]:
        """Attempts newest first, filtered; keyset pagination on (created_at, attempt_id)."""
        if limit <= 0 or limit > 10_000:
            raise InvalidArgument("limit must be between 1 and 10000", field="limit")
        a = s.attempts.c
        conds: list[Any] = []
        if route is not None:
            conds.append(a.route_id == route)
        if group is not None:
            conds.append(a.group_id == group)
        if state is not None:
            conds.append(a.state == state)
        if category is not None:
            conds.append(a.category == category)
        if since is not None:
            conds.append(a.created_at >= since)
        if until is not None:
            conds.append(a.created_at < until)
        if run_ids is not None:
            conds.append(a.run_id.in_(list(run_ids)))
        if cursor:
            try:
                ts_text, last_id = cursor.split("|", 1)
                ts = float(ts_text)
            except ValueError as e:
                raise InvalidArgument("malformed cursor; pass back next_cursor unchanged",
                                      field="cursor") from e
            conds.append(or_(a.created_at < ts, and_(a.created_at == ts, a.attempt_id < last_id)))
        d = s.debits.c
        # The debit by its primary key, per attempt of the page (an outer join: an attempt
        # without its debit row still lists, with debit_state None).
        q = (select(s.attempts, d.state.label("debit_state"))
             .outerjoin(s.debits, d.debit_id == a.debit_id)
             .where(*conds).order_by(a.created_at.desc(), a.attempt_id.desc()))
        with self.reading() as conn:
            rows = conn.execute(q.limit(limit + 1)).all()
        items = [attempt_record(r, r.debit_state) for r in rows[:limit]]
        nxt = None
        if len(rows) > limit:
            last = rows[limit - 1]
            nxt = f"{last.created_at!r}|{last.attempt_id}"
        return Page(items, nxt)

    def debit(self, debit_id: str) -> DebitRecord:
        with self.reading() as conn:
            row = conn.execute(select(s.debits).where(s.debits.c.debit_id == debit_id)).first()
        if row is None:
            raise NotFound(f"unknown debit id {debit_id!r}", debit_id=debit_id)
        return DebitRecord(row.debit_id, row.run_id, row.attempt_id, DebitState(row.state),
                           from_micros(row.reserved_micros), from_micros(row.posted_micros),
                           row.created_at, row.settled_at)

    def _attempt(self, conn: Connection, row: Row[Any]) -> AttemptRecord:
        dstate = conn.execute(
            select(s.debits.c.state).where(s.debits.c.debit_id == row.debit_id)
        ).scalar_one_or_none()
        return attempt_record(row, dstate)
