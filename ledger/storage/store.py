"""Every SQL statement of the ledger. Nothing outside ``ledger.storage`` touches the database.

Each public method is one transaction. Writes that carry a fence lock the run row first
(``SELECT ... FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE`` already serializes SQLite writers),
then check the fence, so a stale executor can write nothing. Budget, allowance and capacity checks
happen under that lock (capacity additionally under the group row lock, always taken after the run
row, so lock order is fixed and cannot deadlock).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
from ledger.effects import lease_problem, settle_holds
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
    LeaseLost,
    NotFound,
    SettleConflict,
    StorageError,
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
from ledger.redaction import redact
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
    normal_admission_field,
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
    SEL_ATTEMPT_WITH_DEBIT,
    SEL_ATTEMPT_WITH_DEBIT_IN_RUN,
    SEL_GROUP_FOR_UPDATE,
    SEL_HEALTH_FOR_UPDATE,
    SEL_RUN_LIVE,
    SETTLE_ATTEMPT,
    SETTLE_DEBIT,
    SETTLE_READ,
    SETTLE_RUN,
    SETTLE_RUN_SUCCEEDED,
    UPD_HEALTH,
    begin_rows,
    event_json,
    event_params,
    fact_json,
    health_values,
    pg_begin_writes,
    pg_settle_writes,
)

ClockFn = Callable[[], float]
# How long before its end a lease stops starting work: processes whose clocks differ by less
# than this never both believe they may use one capacity slot (docs/operations.md).
DEFAULT_LEASE_MARGIN_S = 0.5


class Store:
    """The storage layer over one SQLAlchemy engine."""

    def __init__(self, engine: Engine, url: str, *,
                 lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> None:
        self.engine = engine
        self.url = url
        self.dialect = engine.dialect.name
        self.lease_margin_s = lease_margin_s

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

    def admit(self, spec: AdmitSpec, clock: ClockFn) -> tuple[RunRecord, bool]:
        """Insert a run; returns (record, created). Same id + same content -> the first record.

        Content is compared normalised (decimals, set-like lists, defaults), so a retried
        admission that spells a budget ``1`` instead of ``"1.00"`` is the same admission.
        """
        with self.writing() as conn:
            existing = conn.execute(
                select(s.runs).where(s.runs.c.run_id == spec.run_id).with_for_update()
            ).first()
            if existing is not None:
                differing = [f for f in ADMISSION_FIELDS
                             if normal_admission_field(f, getattr(existing, f))
                             != normal_admission_field(f, getattr(spec, f))]
                if differing:
                    raise AdmissionConflict(
                        f"run {spec.run_id!r} was admitted before with different frozen content "
                        f"(differs in: {', '.join(differing)}); use a new run id",
                        run_id=spec.run_id,
                        differing=differing,
                    )
                return run_record(existing), False
            now = clock()
            if spec.parent_run_id is not None:
                now = self._carve_from_parent(conn, spec, clock)
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
                    tokens_used=0, tokens_reserved=0, carved_calls=0, carved_retries=0,
                    carved_micros=0, carved_tokens=0, fence=0, created_at=now, updated_at=now,
                )
            )
            self.add_event(conn, spec.run_id, None, "admit",
                           {"policy_hash": spec.policy_hash, "parent": spec.parent_run_id}, now)
            row = conn.execute(select(s.runs).where(s.runs.c.run_id == spec.run_id)).one()
            return run_record(row), True

    def _carve_from_parent(self, conn: Connection, spec: AdmitSpec, clock: ClockFn) -> float:
        """Carve the child's budget out of the parent's, under the parent's live lease."""
        r = s.runs.c
        assert spec.parent_run_id is not None
        if spec.parent_lease is None:
            raise InvalidArgument(
                f"admitting a child of {spec.parent_run_id!r} needs the parent's lease; pass "
                "parent_lease= (the lease the parent's executor holds)", field="parent_lease")
        try:
            parent, now = self._lock_live(conn, spec.parent_lease, clock)
        except NotFound:
            raise NotFound(f"parent run {spec.parent_run_id!r} does not exist; admit it first",
                           run_id=spec.parent_run_id) from None
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
        carved_tokens = 0
        if parent.max_tokens is not None:
            tokens_left = (parent.max_tokens - parent.carved_tokens - parent.tokens_reserved
                           - parent.tokens_used)
            if spec.max_tokens is None or spec.max_tokens > tokens_left:
                raise BudgetExceeded(
                    f"the child needs a token budget within what parent {spec.parent_run_id!r} "
                    f"has left ({tokens_left} tokens); pass budget.max_tokens <= {tokens_left}",
                    run_id=spec.run_id, field="budget.max_tokens",
                )
            carved_tokens = spec.max_tokens
        conn.execute(
            s.runs.update().where(r.run_id == spec.parent_run_id).values(
                carved_micros=r.carved_micros + spec.max_cost_micros,
                carved_calls=r.carved_calls + spec.max_calls,
                carved_retries=r.carved_retries + spec.max_retries,
                carved_tokens=r.carved_tokens + carved_tokens,
            )
        )
        return now

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

    def _lock_live(self, conn: Connection, lease: Lease, clock: ClockFn, stmt: Any = LOCK_RUN,
                   rows: list[Any] | None = None) -> tuple[Any, float]:
        """The run row locked under a **live** lease, and the time read after the lock.

        Live: the lease's fence is current, its holder still holds it (not released), and it
        has not expired by the time this transaction runs, with :attr:`lease_margin_s` to spare
        so that processes whose clocks differ by less than that never overlap (a begin that
        waited for the lock, e.g. during a database restart, is judged when it got the lock).
        """
        row = self._lock_run(conn, lease.run_id, lease.fence, stmt, rows)
        now = clock()
        self._check_live(row, lease, now)
        return row, now

    def _check_live(self, row: Any, lease: Lease, now: float) -> None:
        """Raise unless ``lease`` is live at ``now`` on the locked run ``row``."""
        problem = lease_problem(row.lease_holder, row.lease_expires_at, lease.executor, now,
                                self.lease_margin_s)
        if problem == "released":
            raise LeaseLost(
                f"the lease on run {lease.run_id!r} (fence {lease.fence}) was released; acquire "
                "it again before starting more work on the run",
                run_id=lease.run_id, fence=lease.fence, reason=problem)
        if problem == "expired":
            raise LeaseLost(
                f"the lease on run {lease.run_id!r} (fence {lease.fence}) expired at "
                f"{row.lease_expires_at} (now {now}, margin {self.lease_margin_s:g}s); acquire it "
                "again (the fence moves on) before starting more work on the run",
                run_id=lease.run_id, fence=lease.fence, reason=problem,
                expires_at=row.lease_expires_at)
        if problem == "holder":
            raise FencedOut(
                f"run {lease.run_id!r} is held by {row.lease_holder!r}, not {lease.executor!r}",
                run_id=lease.run_id, fence=lease.fence, current=row.fence)

    # -- leases ---------------------------------------------------------------------------

    def acquire_lease(self, run_id: str, executor: str, ttl_s: float, clock: ClockFn) -> Lease:
        """A lease on the run. Another holder's unexpired lease is :class:`LeaseHeld`; one's own
        unexpired lease is renewed under the same fence (its slots stay counted); otherwise the
        fence moves on, so every write of an earlier holder is refused from now on."""
        r = s.runs.c
        with self.writing() as conn:
            row = self._lock_run(conn, run_id, None)
            now = clock()
            live = row.lease_holder is not None and (row.lease_expires_at or 0) > now
            if live and row.lease_holder != executor:
                raise LeaseHeld(
                    f"run {run_id!r} is leased by {row.lease_holder!r} until "
                    f"{row.lease_expires_at}; wait for it to expire or for recovery",
                    run_id=run_id, holder=row.lease_holder, expires_at=row.lease_expires_at,
                )
            if live and lease_problem(row.lease_holder, row.lease_expires_at, executor, now,
                                      self.lease_margin_s) is None:
                # One's own live lease: renewed under the same fence. Inside the margin it is
                # not extended (another process may already count it as ended): the fence
                # moves on instead, as after expiry.
                expires = max(float(row.lease_expires_at), now + ttl_s)
                conn.execute(s.runs.update().where(r.run_id == run_id)
                             .values(lease_expires_at=expires, updated_at=now))
                return Lease(run_id, executor, int(row.fence), expires)
            fence = row.fence + 1
            conn.execute(
                s.runs.update().where(r.run_id == run_id).values(
                    lease_holder=executor, fence=fence, lease_expires_at=now + ttl_s,
                    updated_at=now,
                )
            )
            self.add_event(conn, run_id, None, "lease",
                           {"executor": executor, "fence": fence, "previous": row.lease_holder,
                            "expires_at": now + ttl_s}, now)
        return Lease(run_id, executor, fence, now + ttl_s)

    def renew_lease(self, lease: Lease, ttl_s: float, clock: ClockFn) -> Lease:
        """Extend a live lease; a lapsed one is :class:`LeaseLost` (acquire again)."""
        r = s.runs.c
        with self.writing() as conn:
            _row, now = self._lock_live(conn, lease, clock, LOCK_RUN_FENCE)
            conn.execute(
                s.runs.update().where(r.run_id == lease.run_id)
                .values(lease_expires_at=now + ttl_s, updated_at=now)
            )
        return Lease(lease.run_id, lease.executor, lease.fence, now + ttl_s)

    def release_lease(self, lease: Lease, clock: ClockFn) -> None:
        """Give the lease up. Releasing an already released lease is the same write again."""
        r = s.runs.c
        with self.writing() as conn:
            row = self._lock_run(conn, lease.run_id, lease.fence, LOCK_RUN_FENCE)
            if row.lease_holder is None:
                return
            now = clock()
            if lease_problem(row.lease_holder, row.lease_expires_at, lease.executor, now,
                             0.0) is not None:
                raise LeaseLost(
                    f"the lease on run {lease.run_id!r} (fence {lease.fence}) is no longer "
                    "live; there is nothing of it to release (recovery takes the run over)",
                    run_id=lease.run_id, fence=lease.fence)
            held = conn.execute(
                select(func.count()).select_from(s.group_slots)
                .where(s.group_slots.c.run_id == lease.run_id,
                       s.group_slots.c.fence == lease.fence)
            ).scalar_one()
            if held:
                raise InvalidState(
                    f"run {lease.run_id!r} still has {held} attempt(s) in flight; settle them "
                    "(or mark them unknown) before releasing the lease",
                    run_id=lease.run_id, in_flight=held,
                )
            conn.execute(
                s.runs.update().where(r.run_id == lease.run_id)
                .values(lease_holder=None, lease_expires_at=None, updated_at=now)
            )

    def finish_run(self, lease: Lease, status: RunStatus, clock: ClockFn) -> None:
        r = s.runs.c
        with self.writing() as conn:
            _row, now = self._lock_live(conn, lease, clock, LOCK_RUN_FENCE)
            conn.execute(s.runs.update().where(r.run_id == lease.run_id)
                         .values(status=status.value, updated_at=now))
            self.add_event(conn, lease.run_id, None, "finish", {"status": status.value}, now)

    # -- permissions ----------------------------------------------------------------------

    def reserve_retry(self, lease: Lease, clock: ClockFn,
                      data: Mapping[str, Any] | None = None) -> int:
        """Take one retry permission; returns how many are left after it."""
        r = s.runs.c
        with self.writing() as conn:
            row, now = self._lock_live(conn, lease, clock)
            left = row.max_retries - row.carved_retries - row.retries_used
            if left <= 0:
                raise AllowanceExhausted(
                    f"run {lease.run_id!r} has no retry permission left "
                    f"({row.retries_used} of {row.max_retries} used)",
                    run_id=lease.run_id, field="retries",
                )
            conn.execute(s.runs.update().where(r.run_id == lease.run_id)
                         .values(retries_used=r.retries_used + 1, updated_at=now))
            self.add_event(conn, lease.run_id, None, "retry_permission", dict(data or {}), now)
        return int(left) - 1

    # -- attempts -------------------------------------------------------------------------

    def begin_attempt(self, spec: BeginSpec, clock: ClockFn) -> AttemptRecord:
        """Record an attempt before it is sent, in one transaction (see module docstring)."""
        rejected: tuple[str, float | None] | None = None
        record: AttemptRecord | None = None
        lease = Lease(spec.run_id, spec.executor or "", spec.fence, 0.0)
        with self.writing() as conn:
            # A batch of one: on PostgreSQL the transaction's BEGIN goes with it.
            run, now = self._lock_live(
                conn, lease, clock, LOCK_RUN_FOR_BEGIN,
                run_prebuilt_batch(conn, [(LOCK_RUN_FOR_BEGIN, {"k_run_id": spec.run_id})])[0])
            nxt = run_prebuilt(conn, BEGIN_LOOKUP, {"k_run_id": spec.run_id,
                                                    "k_attempt_id": spec.attempt_id,
                                                    "k_group": spec.route.group})[0]
            if nxt.prior is not None:
                prior = conn.execute(SEL_ATTEMPT_WITH_DEBIT,
                                     {"k_attempt_id": spec.attempt_id}).one()
                if prior.begin_hash != spec.begin_hash or prior.run_id != spec.run_id:
                    raise Conflict(
                        f"attempt id {spec.attempt_id!r} is already recorded with different "
                        "content; use a new attempt id for a new physical call",
                        attempt_id=spec.attempt_id,
                    )
                if (prior.state != AttemptState.DISPATCHING.value or prior.fence == spec.fence
                        or prior.executor != spec.executor):
                    return attempt_record(prior, prior.debit_state)  # the same write again
                # The same begin, retried under a lease acquired again after its
                # acknowledgement was lost: its request was never sent. It is adopted under the
                # new fence (its slot counts again) if its group still admits it.
                rejected, now = self._admit_capacity(conn, spec.route.group, now, nxt, clock)
                self._check_live(run, lease, now)
                if rejected is None:
                    record = self._adopt(conn, prior, spec.fence, now)
                else:
                    self._void_in_place(conn, prior, rejected[0], spec.fence, now)
            else:
                record, rejected = self._begin_new(conn, spec, run, nxt, now, clock)
            faults.point("begin.before_commit")
        faults.point("begin.after_commit")
        if rejected:
            raise CapacityUnavailable(
                f"capacity group {spec.route.group!r} refused attempt {spec.attempt_id!r} "
                f"({rejected[0]}); it was recorded as rejected, its hold voided, nothing sent",
                attempt_id=spec.attempt_id, group=spec.route.group, reason=rejected[0],
                until=rejected[1], seq=record.seq if record is not None else None,
            )
        assert record is not None
        return record

    def _begin_new(self, conn: Connection, spec: BeginSpec, run: Any, nxt: Any, now: float,
                   clock: ClockFn) -> tuple[AttemptRecord, tuple[str, float | None] | None]:
        if run.max_calls - run.carved_calls - run.calls_used <= 0:
            raise AllowanceExhausted(
                f"run {spec.run_id!r} has used its model-call allowance "
                f"({run.calls_used} of {run.max_calls}); nothing was sent",
                run_id=spec.run_id, field="calls",
            )
        if spec.take_retry and run.max_retries - run.carved_retries - run.retries_used <= 0:
            raise AllowanceExhausted(
                f"run {spec.run_id!r} has no retry permission left ({run.retries_used} of "
                f"{run.max_retries} used); every further attempt of a turn takes one",
                run_id=spec.run_id, field="retries",
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
        if run.max_tokens is not None:
            tokens_left = run.max_tokens - run.tokens_reserved - run.tokens_used
            if spec.reserve_tokens > tokens_left:
                raise BudgetExceeded(
                    f"a hold of {spec.reserve_tokens} tokens would overdraw run "
                    f"{spec.run_id!r}'s token budget (left: {tokens_left}); nothing was sent",
                    run_id=spec.run_id, field="tokens", requested=spec.reserve_tokens,
                    available=tokens_left,
                )
        rejected, decided = self._admit_capacity(conn, spec.route.group, now, nxt, clock)
        if decided != now:
            # The capacity decision read the clock again: the Attempt is recorded at that
            # time, so the lease must still be live then.
            now = decided
            self._check_live(run, Lease(spec.run_id, spec.executor or "", spec.fence, 0.0), now)
        debit_state = DebitState.VOIDED if rejected else DebitState.RESERVED
        debit, values, slot, run_params = begin_rows(spec, nxt.next_seq, rejected, now)
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
        return written_attempt(values, debit_state.value), rejected

    def _adopt(self, conn: Connection, prior: Any, fence: int, now: float) -> AttemptRecord:
        a = s.attempts.c
        gs = s.group_slots.c
        conn.execute(s.attempts.update().where(a.attempt_id == prior.attempt_id)
                     .values(fence=fence))
        conn.execute(s.group_slots.update().where(gs.attempt_id == prior.attempt_id)
                     .values(fence=fence))
        self.add_event(conn, prior.run_id, prior.attempt_id, "adopt",
                       {"from_fence": int(prior.fence), "fence": fence}, now)
        return written_attempt({**prior._mapping, "fence": fence}, prior.debit_state)

    def _void_in_place(self, conn: Connection, prior: Any, reason: str, fence: int,
                       now: float) -> None:
        """A dispatching Attempt that provably never left: not sent, holds voided, call and
        slot given back (used when its adoption is refused by its group)."""
        a = s.attempts.c
        r = s.runs.c
        conn.execute(s.attempts.update().where(a.attempt_id == prior.attempt_id).values(
            state=AttemptState.NOT_SENT.value, reject_reason=reason, settled_at=now,
            settle_fence=fence))
        conn.execute(s.debits.update().where(s.debits.c.debit_id == prior.debit_id)
                     .values(state=DebitState.VOIDED.value, settled_at=now))
        run_prebuilt(conn, DEL_SLOT, {"k_attempt_id": prior.attempt_id})
        conn.execute(s.runs.update().where(r.run_id == prior.run_id).values(
            reserved_micros=r.reserved_micros - prior.debit_reserved_micros,
            tokens_reserved=r.tokens_reserved - prior.reserved_tokens,
            calls_used=r.calls_used - 1, updated_at=now))
        self.add_event(conn, prior.run_id, prior.attempt_id, "reject",
                       {"reason": reason, "group": prior.group_id, "adoption": True}, now)

    def _admit_capacity(self, conn: Connection, group: str, now: float, looked_up: Any,
                        clock: ClockFn) -> tuple[tuple[str, float | None] | None, float]:
        """(None, time) when the group admits one more attempt, else ((reason, waiting
        floor), time); the time is when the decision was taken. ``looked_up`` carries the group
        row as read (unlocked) after the run lock."""
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
            return ("group_" + row.mode, row.until), now
        if row.max_in_flight is not None:
            # The slots are read first and the clock after: a slot released (or a lease that
            # lapsed) before this decision is then also before it in recorded time.
            expiries = self._slot_expiries(conn, group)
            now = max(now, clock())
            if sum(1 for e in expiries if e > now) >= row.max_in_flight:
                return ("capacity_full", None), now
        return None, now

    def _slot_expiries(self, conn: Connection, group: str) -> list[float]:
        """The lease expiry behind each slot of ``group`` still held under its run's fence."""
        gs = s.group_slots.c
        r = s.runs.c
        return [float(e) for (e,) in conn.execute(
            select(r.lease_expires_at).select_from(
                s.group_slots.join(s.runs, r.run_id == gs.run_id)
            ).where(gs.group_id == group, gs.fence == r.fence, r.lease_expires_at.is_not(None))
        )]

    def _live_slots(self, conn: Connection, group: str, now: float) -> int:
        # A slot counts only while its executor still holds the run (same fence, lease alive):
        # slots of dead executors come back when their lease expires, before any recovery.
        return sum(1 for e in self._slot_expiries(conn, group) if e > now)

    def settle_attempt(self, run_id: str, spec: SettleSpec, clock: ClockFn) -> AttemptRecord:
        """Record an attempt's outcome in one transaction; a settled attempt is never rewritten.

        Accepted for an Attempt begun under the lease's fence while that fence is current, even
        after the lease expired (the outcome is the truth; its slot already counted as free).
        Refused with :class:`FencedOut` once the Run was taken over (by another executor, by
        recovery, or by this executor acquiring again); the refused observation is kept as a
        ``late_receipt`` event on the Attempt, and its row does not change.
        """
        try:
            return self._settle(run_id, spec, clock)
        except FencedOut as e:
            self._late_receipt(run_id, spec, clock(), str(e))
            raise
        except SettleConflict as e:
            if e.fields.get("state") == AttemptState.UNKNOWN.value:
                self._late_receipt(run_id, spec, clock(), str(e))
            raise

    def _late_receipt(self, run_id: str, spec: SettleSpec, now: float, why: str) -> None:
        """Keep a refused settle's observation beside the Attempt (append-only, no fence)."""
        with self.writing() as conn:
            self.add_event(conn, run_id, spec.attempt_id, "late_receipt", {
                "outcome": spec.outcome.value,
                "fact": spec.fact.to_json() if spec.fact else None,
                "prompt_tokens": spec.prompt_tokens,
                "completion_tokens": spec.completion_tokens,
                "cost_micros": spec.cost_micros, "model_reported": spec.model_reported,
                "output_hash": spec.output_hash, "fence": spec.fence, "refused": why,
            }, now)

    def _settle(self, run_id: str, spec: SettleSpec, clock: ClockFn) -> AttemptRecord:
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
            run = self._lock_run(conn, run_id, spec.fence, LOCK_RUN_FENCE, locked_rows)
            now = clock()
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
                raise SettleConflict(
                    f"attempt {spec.attempt_id!r} is already settled as {att.state} with "
                    "different content; a settled attempt is immutable",
                    attempt_id=spec.attempt_id, state=att.state,
                )
            if att.fence != spec.fence:
                raise FencedOut(
                    f"attempt {spec.attempt_id!r} was begun under fence {att.fence}, and run "
                    f"{run_id!r} has since been acquired again (fence {spec.fence}): its "
                    "outcome is kept as a late receipt; recovery marks it unknown",
                    run_id=run_id, fence=spec.fence, attempt_fence=int(att.fence),
                )
            if att.debit_state is None:
                raise StorageError(f"attempt {spec.attempt_id!r} has no debit row",
                                   attempt_id=spec.attempt_id)
            tokens = (None if spec.prompt_tokens is None and spec.completion_tokens is None
                      else (spec.prompt_tokens or 0) + (spec.completion_tokens or 0))
            holds = settle_holds(spec.outcome, spec.fact, cost_micros=spec.cost_micros,
                                 tokens=tokens, reserved_micros=att.debit_reserved_micros,
                                 reserved_tokens=att.reserved_tokens,
                                 token_budget=run.max_tokens is not None)
            fact = spec.fact
            values: dict[str, Any] = {
                "state": AttemptState(spec.outcome.value).value,
                "fact": fact_json(fact) if fact else None,
                "category": fact.category.value if fact else None,
                "http_status": fact.status if fact else None,
                "effective_output": spec.effective_output,
                "tool_started": spec.tool_started,
                "prompt_tokens": spec.prompt_tokens,
                "completion_tokens": spec.completion_tokens,
                "cost_micros": spec.cost_micros,
                "model_reported": redact(spec.model_reported) if spec.model_reported else None,
                "output_hash": spec.output_hash,
                "settle_hash": spec.settle_hash,
                "settle_fence": spec.fence,
                "settled_at": now,
            }
            settle_debit = (att.debit_state == DebitState.RESERVED.value
                            and holds.debit is not DebitState.RESERVED)
            final_debit_state = holds.debit.value if settle_debit else att.debit_state
            succeeded = spec.outcome is Outcome.SUCCEEDED
            run_params: dict[str, Any] = {
                "k_run_id": run_id,
                "k_release": holds.release_micros if settle_debit else 0,
                "k_posted": holds.posted_micros if settle_debit else 0,
                "k_release_tokens": holds.release_tokens if settle_debit else 0,
                "k_tokens": holds.tokens_used, "k_uncount": 1 if holds.uncount_call else 0,
                "k_now": now,
            }
            if succeeded:
                run_params.update(k_route=att.route_id, k_profile=att.profile_id)
            debit_params = {"state": holds.debit.value, "posted_micros": holds.posted_micros,
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

    def mark_unknown(self, lease: Lease, attempt_id: str, clock: ClockFn,
                     reason: str) -> AttemptRecord:
        """Dispatched without a receipt: unknown, keeping its hold (a graceful shutdown).
        Like settle, accepted under the fence the Attempt was begun under while it is current."""
        a = s.attempts.c
        with self.writing() as conn:
            self._lock_run(conn, lease.run_id, lease.fence, LOCK_RUN_FENCE)
            now = clock()
            att = conn.execute(select(s.attempts).where(a.attempt_id == attempt_id,
                                                        a.run_id == lease.run_id)).first()
            if att is None:
                raise NotFound(f"unknown attempt id {attempt_id!r} in run {lease.run_id!r}",
                               attempt_id=attempt_id, run_id=lease.run_id)
            if att.state == AttemptState.DISPATCHING.value:
                if att.fence != lease.fence:
                    raise FencedOut(
                        f"attempt {attempt_id!r} was begun under fence {att.fence}, not "
                        f"{lease.fence}; recovery marks it unknown",
                        run_id=lease.run_id, fence=lease.fence, attempt_fence=int(att.fence))
                conn.execute(s.attempts.update().where(a.attempt_id == attempt_id)
                             .values(state=AttemptState.UNKNOWN.value, settled_at=now,
                                     settle_fence=lease.fence))
                conn.execute(s.group_slots.delete().where(s.group_slots.c.attempt_id == attempt_id))
                self.add_event(conn, lease.run_id, attempt_id, "unknown", {"reason": reason}, now)
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
        with self.reading() as conn:
            return self._projections(conn, groups, now)

    def _projections(self, conn: Connection, groups: Iterable[str] | None, now: float
                     ) -> dict[str, GroupProjection]:
        g = s.capacity_groups.c
        q = select(s.capacity_groups)
        if groups is not None:
            q = q.where(g.group_id.in_(list(groups)))
        out: dict[str, GroupProjection] = {}
        for row in conn.execute(q).all():
            mode = GroupMode(row.mode)
            if mode is not GroupMode.OPEN and row.until is not None and row.until <= now:
                mode = GroupMode.OPEN  # the waiting floor has passed
            # Only a limited group's live slots matter to anyone; counting them is a scan.
            in_flight = (self._live_slots(conn, row.group_id, now)
                         if row.max_in_flight is not None else 0)
            out[row.group_id] = GroupProjection(
                group=row.group_id, mode=mode, until=row.until,
                sampled_at=row.sampled_at if row.sampled_at is not None else now,
                in_flight=in_flight, limit=row.max_in_flight,
            )
        return out

    def turn_snapshot(self, run_id: str, groups: Sequence[str], health_keys: Sequence[str],
                      provenance_runs: Sequence[str], refs: Sequence[str], clock: ClockFn
                      ) -> tuple[Any, dict[str, GroupProjection], dict[str, Health],
                                 dict[str, frozenset[str]], float]:
        """One read transaction: the run's live row (counters, current route, lease; not its
        frozen snapshots), the groups' projections, the health rows, and the provenance of
        ``refs`` recorded by ``provenance_runs``."""
        h = s.health.c
        p = s.provenance.c
        with self.reading() as conn:
            now = clock()
            row = conn.execute(SEL_RUN_LIVE, {"k_run_id": run_id}).first()
            if row is None:
                raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                               run_id=run_id)
            projections = self._projections(conn, groups, now)
            health = {r.key: health_record(r) for r in
                      conn.execute(select(s.health).where(h.key.in_(list(health_keys)))).all()}
            prov: dict[str, set[str]] = {}
            if refs:
                for ref, digest in conn.execute(
                        select(p.ref, p.content_hash).where(
                            p.run_id.in_(list(provenance_runs)), p.ref.in_(list(refs)))):
                    prov.setdefault(ref, set()).add(digest)
        return row, projections, health, {k: frozenset(v) for k, v in prov.items()}, now

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

    def record_provenance(self, lease: Lease, ref: str, content_hash: str, kind: str,
                          clock: ClockFn) -> None:
        with self.writing() as conn:
            _row, now = self._lock_live(conn, lease, clock, LOCK_RUN_FENCE)
            conn.execute(
                self.insert_for(s.provenance).values(
                    run_id=lease.run_id, ref=ref, content_hash=content_hash, kind=kind,
                    created_at=now,
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

    def append_event(self, lease: Lease, attempt_id: str | None, kind: str,
                     data: Mapping[str, Any], clock: ClockFn) -> None:
        with self.writing() as conn:
            _row, now = self._lock_live(conn, lease, clock, LOCK_RUN_FENCE)
            self.add_event(conn, lease.run_id, attempt_id, kind, data, now)

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
