"""The SQL shared by both store implementations (:class:`SqlStore`).

The hot path — the snapshot read of a decision, begin, settle, the lease writes, provenance and
events — runs the transactions of :mod:`ledger.storage.hot` on the database's own driver
(:mod:`ledger.storage.driver`): plain SQL, prepared by psycopg on the server, ``BEGIN`` and
``COMMIT`` pipelined with the statements on PostgreSQL, and each one available sync and async.
The rest (admission, reads, audit, recovery, administration) uses SQLAlchemy Core over an engine
on the same database. Writes that carry a fence lock the run row first (``SELECT ... FOR
UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE`` already serializes SQLite writers), then check the
lease, so a stale or lapsed executor can write nothing.

What differs between the databases is not decided here: :class:`SqlStore` leaves it to its two
subclasses, :class:`ledger.storage.sqlite.SqliteStore` and
:class:`ledger.storage.postgres.PostgresStore` (their driver, their hot-path statements, a few
hooks of the cold-path SQL), so no transaction asks which database it runs on.
"""

from __future__ import annotations

import abc
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

from sqlalchemy import Connection, Engine, Select, and_, bindparam, func, or_, select
from sqlalchemy.engine import URL

from ledger import faults
from ledger.decide.settle import settle_holds
from ledger.domain.facts import FailureFact
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    DebitRecord,
    DebitState,
    EventRecord,
    Lease,
    Page,
    Queued,
    RunRecord,
    RunStatus,
    budget_left,
    from_micros,
)
from ledger.domain.specs import (
    ADMISSION_FIELDS,
    AdmitSpec,
    BeginSpec,
    GroupUpdate,
    ReceiptSpec,
    SettleSpec,
    normal_admission_field,
)
from ledger.domain.values import GroupMode, GroupProjection, Health
from ledger.errors import (
    AdmissionConflict,
    AllowanceExhausted,
    BudgetExceeded,
    Conflict,
    FencedOut,
    InvalidArgument,
    InvalidState,
    NotFound,
    SettleConflict,
)
from ledger.storage import DEFAULT_LEASE_MARGIN_S, audit, hot, recovery, series
from ledger.storage import schema as s
from ledger.storage.driver import Driver
from ledger.storage.encode import event_json
from ledger.storage.failure import mapped
from ledger.storage.hot import check_live
from ledger.storage.port import ClockFn, Figures, RowMap, SnapshotRows, StoragePort, Takeover
from ledger.storage.rows import attempt_record, health_record, run_record
from ledger.storage.runner import Flow, Runner, txn
from ledger.storage.statements import Statements
from ledger.storage.wake import SlotWaker

SEL_ATTEMPT_WITH_DEBIT = (
    select(s.attempts, s.debits.c.state.label("debit_state"))
    .outerjoin(s.debits, s.debits.c.debit_id == s.attempts.c.debit_id)
    .where(s.attempts.c.attempt_id == bindparam("k_attempt_id"))
)


class SqlStore(StoragePort, abc.ABC):
    """The storage port over one database: an engine for the cold path, the database's own
    driver for the hot one. Subclasses say what differs between the databases (the hooks
    below); open one with :func:`ledger.storage.open_store`."""

    #: The hot path's statements for this database.
    SQL: ClassVar[Statements]

    #: The longest a queued begin waits without a signal before it begins again (another
    #: process's settle signals nothing on SQLite).
    QUEUE_POLL_S: ClassVar[float] = 0.1

    def __init__(self, engine: Engine, where: str, driver: Driver, *,
                 lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> None:
        self.engine = engine
        self.where = where
        self.lease_margin_s = lease_margin_s
        self.driver = driver
        self.runner = Runner(driver)
        self.sql = self.SQL
        listen = self._listen if self.sql.NOTIFY_QUEUE is not None else None
        self.waker = SlotWaker(where, self.QUEUE_POLL_S, listen)

    def _listen(self, told: Callable[[str], None], stop: threading.Event) -> None:
        """Listen for the database's queue notifications (where it has a channel)."""
        raise NotImplementedError

    @classmethod
    @abc.abstractmethod
    def connect(cls, norm: str, parsed: URL, *, lease_margin_s: float) -> SqlStore:
        """A store on the database of the normalized URL ``norm`` (parsed: ``parsed``),
        without touching it yet (the first transaction connects)."""

    @classmethod
    @abc.abstractmethod
    def prepare_database(cls, norm: str, parsed: URL) -> bool:
        """Make sure the database of ``norm`` can hold a ledger, creating what this backend
        must and may; ``True`` when the database did not exist before. A database that cannot
        be made (no such folder, a role that may not create it) is a
        :class:`~ledger.errors.DatabaseSetupError`, and nothing is created."""

    # -- what differs between the databases (the cold path's hooks) ------------------------

    @abc.abstractmethod
    def migration_lock(self) -> AbstractContextManager[Connection]:
        """A connection whose work is serialized against every other migrating process."""

    @abc.abstractmethod
    def insert_for(self, table: Any) -> Any:
        """The database's INSERT (with ON CONFLICT support) for ``table``."""

    @abc.abstractmethod
    def claiming(self, query: Select[Any]) -> Select[Any]:
        """``query`` as a claim of work items: rows another transaction holds are skipped
        (PostgreSQL), not waited for; budget and capacity checks never use it."""

    @abc.abstractmethod
    def consistent(self, conn: Connection) -> None:
        """Make the read transaction just begun on ``conn`` one snapshot of the whole ledger."""

    @abc.abstractmethod
    def bucket(self, col: Any, since: float, width: float) -> Any:
        """The 0-based index of the ``width``-wide time bucket from ``since`` of ``col``."""

    @abc.abstractmethod
    def label(self, key: str) -> Any:
        """The value of label ``key`` (checked) of a run, as SQL."""

    # -- transactions ---------------------------------------------------------------------

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One write transaction (``BEGIN IMMEDIATE`` on SQLite); other storage modules use it."""
        with mapped(self.where), self.engine.connect() as conn:
            conn = conn.execution_options(ledger_write=True)
            with conn.begin():
                yield conn

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """One read transaction."""
        with mapped(self.where), self.engine.connect() as conn, conn.begin():
            yield conn

    def close(self) -> None:
        """Close the driver's connections and the engine's pool."""
        self.waker.close()
        with mapped(self.where):
            self.driver.close()
            self.engine.dispose()

    # -- runs -----------------------------------------------------------------------------

    def admit(self, spec: AdmitSpec, clock: ClockFn) -> tuple[RunRecord, bool]:
        """Insert a run; returns (record, created). Same id + same content -> the first record.

        Content is compared normalised (decimals, set-like lists, defaults), so a retried
        admission that spells a budget ``1`` instead of ``"1.00"`` is the same admission.
        """
        try:
            return self._admit(spec, clock)
        except Conflict as e:
            if isinstance(e, AdmissionConflict):
                raise
            # Another process admitted the same id between this one's read and its insert
            # (PostgreSQL: the row did not exist to be locked): compare with what it recorded.
            return self._admit(spec, clock)

    def _admit(self, spec: AdmitSpec, clock: ClockFn) -> tuple[RunRecord, bool]:
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
        parent = conn.execute(
            select(s.runs).where(r.run_id == spec.parent_run_id).with_for_update()).first()
        if parent is None:
            raise NotFound(f"parent run {spec.parent_run_id!r} does not exist; admit it first",
                           run_id=spec.parent_run_id)
        now = clock()
        check_live(parent, spec.parent_lease, now, self.lease_margin_s)
        left = budget_left(parent)
        cost_left, calls_left, retries_left = left.micros, left.calls, left.retries
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
        if left.tokens is not None:
            tokens_left = left.tokens
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
        """The Run as it stands (NotFound for an unknown id)."""
        with self.reading() as conn:
            row = conn.execute(select(s.runs).where(s.runs.c.run_id == run_id)).first()
        if row is None:
            raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                           run_id=run_id)
        return run_record(row)

    def children(self, run_id: str) -> list[RunRecord]:
        """The Child Runs of ``run_id``, oldest first."""
        with self.reading() as conn:
            rows = conn.execute(
                select(s.runs).where(s.runs.c.parent_run_id == run_id)
                .order_by(s.runs.c.created_at, s.runs.c.run_id)
            ).all()
        return [run_record(r) for r in rows]

    # -- the hot path ---------------------------------------------------------------------
    # Each is a flow of one transaction function of ``hot`` (a refused settle adds the late
    # receipt's): the runner performs it, blocking or for asyncio (ledger.storage.runner).

    def turn_snapshot(self, run_id: str, groups: Sequence[str], keys: Sequence[str],
                      runs: Sequence[str], refs: Sequence[str], clock: ClockFn
                      ) -> Flow[SnapshotRows]:
        """One read: the run's live row (counters, current route, lease; not its frozen
        snapshots), its groups' projections, the health rows of ``keys``, and the provenance
        of ``refs`` recorded by ``runs``."""
        return (yield from txn(hot.snapshot_tx(self.sql, run_id, groups, keys, runs, refs,
                                               clock), write=False))

    def begin_attempt(self, spec: BeginSpec, clock: ClockFn) -> Flow[AttemptRecord | Queued]:
        """Record an attempt before it is sent, in one transaction: live lease, allowances,
        holds, capacity, the decision's events. A rejection is recorded, then raised; a full
        group queues a begin with ``spec.queue_until`` (nothing recorded)."""
        return (yield from txn(hot.begin_tx(self.sql, spec, clock, self.lease_margin_s)))

    def leave_queue(self, waiter_id: str, group: str) -> Flow[None]:
        """Give up ``waiter_id``'s place in ``group``'s queue (no place: nothing happens)."""
        yield from txn(hot.leave_queue_tx(self.sql, waiter_id, group))
        self.waker.poke(group)

    def settle_attempt(self, run_id: str, spec: SettleSpec, clock: ClockFn
                       ) -> Flow[AttemptRecord]:
        """Record an attempt's outcome in one transaction; a settled attempt is never rewritten.

        Accepted for an Attempt begun under the lease's fence while that fence is current, even
        after the lease expired (the outcome is the truth; its slot already counted as free).
        Refused with :class:`FencedOut` once the Run was taken over (by another executor, by
        recovery, or by this executor acquiring again); the refused observation is kept as a
        ``late_receipt`` event on the Attempt, and its row does not change.
        """
        try:
            rec = yield from txn(hot.settle_tx(self.sql, run_id, spec, clock))
        except (FencedOut, SettleConflict) as e:
            if _late(e):
                yield from txn(hot.late_receipt_tx(self.sql, run_id, spec, clock(), str(e)))
            raise
        self.waker.poke(rec.group_id)  # its slot is free: a waiter may go
        return rec

    def settle_unknown(self, spec: ReceiptSpec, clock: ClockFn) -> AttemptRecord:
        """Settle an unknown Attempt with an operator's evidence (see the port's docstring).

        No lease: the Run may be closed or held by nobody. It cannot race a live executor:
        only an ``unknown`` Attempt is settled here, an executor never writes to one again
        (its repeated settle is the same write, recognised by its hash, and changes nothing),
        and the Run's row lock serializes this with every other write to its counters.
        """
        a, d, r = s.attempts.c, s.debits.c, s.runs.c
        with self.writing() as conn:
            found = conn.execute(select(a.run_id).where(a.attempt_id == spec.attempt_id)).first()
            if found is None:
                raise NotFound(f"unknown attempt id {spec.attempt_id!r}; list unknown attempts "
                               "with `failover-ledger attempts --open`",
                               attempt_id=spec.attempt_id)
            run = conn.execute(select(r.run_id, r.max_tokens).where(r.run_id == found.run_id)
                               .with_for_update()).one()
            now = clock()
            att = conn.execute(SEL_ATTEMPT_WITH_DEBIT, {"k_attempt_id": spec.attempt_id}).one()
            if att.state != AttemptState.UNKNOWN.value or att.debit_state != "reserved":
                raise InvalidState(
                    f"attempt {spec.attempt_id!r} is {att.state}, not unknown: only an unknown "
                    "attempt is settled with evidence, once (a settled one is never rewritten)",
                    attempt_id=spec.attempt_id, state=att.state)
            fact = FailureFact.model_validate_json(att.fact) if att.fact else None
            tokens = (None if spec.prompt_tokens is None and spec.completion_tokens is None
                      else (spec.prompt_tokens or 0) + (spec.completion_tokens or 0))
            holds = settle_holds(spec.outcome, fact, cost_micros=spec.cost_micros,
                                 tokens=tokens, reserved_micros=att.reserved_micros,
                                 reserved_tokens=att.reserved_tokens or 0,
                                 token_budget=run.max_tokens is not None)
            changed = conn.execute(
                s.attempts.update()
                .where(a.attempt_id == spec.attempt_id, a.state == AttemptState.UNKNOWN.value)
                .values(state=spec.outcome.value, prompt_tokens=spec.prompt_tokens,
                        completion_tokens=spec.completion_tokens,
                        cost_micros=spec.cost_micros)).rowcount
            if changed != 1:  # pragma: no cover - the run row lock makes this unreachable
                raise Conflict(f"attempt {spec.attempt_id!r} changed while it was settled",
                               attempt_id=spec.attempt_id)
            conn.execute(s.debits.update().where(d.debit_id == att.debit_id).values(
                state=holds.debit.value, posted_micros=holds.posted_micros, settled_at=now))
            conn.execute(s.runs.update().where(r.run_id == run.run_id).values(
                reserved_micros=r.reserved_micros - holds.release_micros,
                posted_micros=r.posted_micros + holds.posted_micros,
                tokens_reserved=r.tokens_reserved - holds.release_tokens,
                tokens_used=r.tokens_used + holds.tokens_used,
                calls_used=r.calls_used - (1 if holds.uncount_call else 0), updated_at=now))
            self.add_event(conn, run.run_id, spec.attempt_id, "late_receipt", {
                "applied": True, "by": spec.by, "note": spec.note,
                "previous_state": AttemptState.UNKNOWN.value, "outcome": spec.outcome.value,
                "prompt_tokens": spec.prompt_tokens,
                "completion_tokens": spec.completion_tokens,
                "cost": None if spec.cost_micros is None else str(from_micros(spec.cost_micros)),
                "posted": str(from_micros(holds.posted_micros)),
                "released": str(from_micros(holds.release_micros - holds.posted_micros)),
            }, now)
            row = conn.execute(SEL_ATTEMPT_WITH_DEBIT, {"k_attempt_id": spec.attempt_id}).one()
        return attempt_record(row, row.debit_state)

    def mark_unknown(self, lease: Lease, attempt_id: str, clock: ClockFn,
                     reason: str) -> Flow[AttemptRecord]:
        """Dispatched without a receipt: unknown, keeping its hold (a graceful shutdown)."""
        rec = yield from txn(hot.mark_unknown_tx(self.sql, lease, attempt_id, clock, reason))
        self.waker.poke(rec.group_id)  # its slot is free: a waiter may go
        return rec

    def attempt(self, attempt_id: str) -> Flow[AttemptRecord]:
        """One Attempt, under its original route, with its debit's state."""
        return (yield from txn(hot.attempt_tx(self.sql, attempt_id), write=False))

    def acquire_lease(self, run_id: str, executor: str, ttl_s: float, clock: ClockFn
                      ) -> Flow[Lease]:
        """A lease on the run. Another holder's unexpired lease is ``LeaseHeld``; one's own
        live lease is renewed under the same fence; otherwise the fence moves on."""
        return (yield from txn(hot.acquire_tx(self.sql, run_id, executor, ttl_s, clock,
                                              self.lease_margin_s)))

    def renew_lease(self, lease: Lease, ttl_s: float, clock: ClockFn) -> Flow[Lease]:
        """Extend a live lease; a lapsed one is ``LeaseLost`` (acquire again)."""
        return (yield from txn(hot.renew_tx(self.sql, lease, ttl_s, clock,
                                            self.lease_margin_s)))

    def release_lease(self, lease: Lease, clock: ClockFn) -> Flow[None]:
        """Give the lease up. Releasing an already released lease is the same write again."""
        yield from txn(hot.release_tx(self.sql, lease, clock))

    def finish_run(self, lease: Lease, status: RunStatus, clock: ClockFn) -> Flow[None]:
        """Record the Run's end under a live lease."""
        yield from txn(hot.finish_tx(self.sql, lease, status, clock, self.lease_margin_s))

    def reserve_retry(self, lease: Lease, clock: ClockFn,
                      data: Mapping[str, Any] | None = None) -> Flow[int]:
        """Take one retry permission; returns how many are left after it."""
        return (yield from txn(hot.reserve_retry_tx(self.sql, lease, clock,
                                                    self.lease_margin_s, dict(data or {}))))

    def record_provenance(self, lease: Lease, ref: str, content_hash: str, kind: str,
                          clock: ClockFn) -> Flow[None]:
        """Record that ``ref`` produced ``content_hash`` (under a live lease)."""
        yield from txn(hot.provenance_tx(self.sql, lease, ref, content_hash, kind, clock,
                                         self.lease_margin_s))

    def append_event(self, lease: Lease, attempt_id: str | None, kind: str,
                     data: Mapping[str, Any], clock: ClockFn) -> Flow[None]:
        """Append an audit event under a live lease."""
        yield from txn(hot.event_tx(self.sql, lease, attempt_id, kind, data, clock,
                                    self.lease_margin_s))

    def claim_probe(self, key: str, provider: str | None, now: float, interval_s: float, *,
                    kind: str = "route", ttl_s: float | None = None,
                    max_keys: int | None = None) -> Flow[bool]:
        """Take the cluster-wide probe slot for ``key``: True for exactly one caller per window.
        A claim taken forgets probe times ``ttl_s`` old and keeps at most ``max_keys``."""
        faults.point("probe.before_claim")
        return (yield from txn(hot.claim_probe_tx(self.sql, key, provider, now, interval_s,
                                                  kind=kind, ttl_s=ttl_s, max_keys=max_keys)))

    def record_compaction(self, lease: Lease, clock: ClockFn) -> Flow[int]:
        """Count one compaction of the Run's session; returns the new count."""
        return (yield from txn(hot.compaction_tx(self.sql, lease, clock, self.lease_margin_s)))

    # -- groups, health (administration and reads) -----------------------------------------

    def configure_group(self, group: str, max_in_flight: int | None, now: float) -> None:
        """Create or update a capacity group's limit (its mode is kept)."""
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
        """Set a group's mode, waiting floor and reason (the group is created if unknown)."""
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
        """Admission's view of ``groups`` (None: all) at ``now``."""
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
            limited = row.max_in_flight is not None
            out[row.group_id] = GroupProjection(
                group=row.group_id, mode=mode, until=row.until,
                sampled_at=row.sampled_at if row.sampled_at is not None else now,
                in_flight=self._live_slots(conn, row.group_id, now) if limited else 0,
                limit=row.max_in_flight,
                waiting=self._live_places(conn, row.group_id, now) if limited else 0,
            )
        return out

    def _live_places(self, conn: Connection, group: str, now: float) -> int:
        # A place counts like a slot: while its own bound has not passed and its executor
        # still holds the run (same fence, lease alive).
        w = s.group_waiters.c
        r = s.runs.c
        return int(conn.execute(
            select(func.count()).select_from(s.group_waiters.join(s.runs, r.run_id == w.run_id))
            .where(w.group_id == group, w.fence == r.fence, w.expires_at > now,
                   r.lease_expires_at.is_not(None), r.lease_expires_at > now)).scalar_one())

    def _live_slots(self, conn: Connection, group: str, now: float) -> int:
        # A slot counts only while its executor still holds the run (same fence, lease alive):
        # slots of dead executors come back when their lease expires, before any recovery.
        gs = s.group_slots.c
        r = s.runs.c
        return int(conn.execute(
            select(func.count()).select_from(s.group_slots.join(s.runs, r.run_id == gs.run_id))
            .where(gs.group_id == group, gs.fence == r.fence, r.lease_expires_at.is_not(None),
                   r.lease_expires_at > now)).scalar_one())

    def health(self, keys: Iterable[str] | None = None) -> dict[str, Health]:
        """The stored health rows of ``keys`` (None: all)."""
        h = s.health.c
        with self.reading() as conn:
            q = select(s.health)
            if keys is not None:
                q = q.where(h.key.in_(list(keys)))
            return {row.key: health_record(row) for row in conn.execute(q).all()}

    def provenance(self, run_ids: Sequence[str]) -> dict[str, set[str]]:
        """Provenance recorded by ``run_ids``: ref -> content hashes."""
        p = s.provenance.c
        with self.reading() as conn:
            rows = conn.execute(select(p.ref, p.content_hash).where(p.run_id.in_(list(run_ids))))
            out: dict[str, set[str]] = {}
            for ref, h in rows:
                out.setdefault(ref, set()).add(h)
            return out

    def add_event(self, conn: Connection, run_id: str | None, attempt_id: str | None, kind: str,
               data: Mapping[str, Any], now: float) -> None:
        """Insert one event on ``conn`` (inside another write of this store)."""
        conn.execute(s.events.insert().values(
            run_id=run_id, attempt_id=attempt_id, kind=kind, data=event_json(data),
            created_at=now,
        ))

    def events(self, run_id: str, kinds: Sequence[str] | None = None) -> list[EventRecord]:
        """The Run's events in order, optionally only of ``kinds``."""
        e = s.events.c
        with self.reading() as conn:
            q = select(s.events).where(e.run_id == run_id)
            if kinds:
                q = q.where(e.kind.in_(list(kinds)))
            rows = conn.execute(q.order_by(e.event_id)).all()
        return [EventRecord(r.event_id, r.run_id, r.attempt_id, r.kind, json.loads(r.data),
                            r.created_at) for r in rows]

    # -- reads ----------------------------------------------------------------------------

    def timeline(self, run_id: str) -> list[AttemptRecord]:
        """The Run's Attempts in sequence (NotFound for an unknown run)."""
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
        """One debit (NotFound for an unknown id)."""
        with self.reading() as conn:
            row = conn.execute(select(s.debits).where(s.debits.c.debit_id == debit_id)).first()
        if row is None:
            raise NotFound(f"unknown debit id {debit_id!r}", debit_id=debit_id)
        return DebitRecord(row.debit_id, row.run_id, row.attempt_id, DebitState(row.state),
                           from_micros(row.reserved_micros), from_micros(row.posted_micros),
                           row.created_at, row.settled_at)

    # -- recovery and reconciliation (the SQL is in ledger.storage.recovery) ----------------

    def expired_runs(self, now: float, limit: int,
                     run_ids: list[str] | None = None) -> list[str]:
        """Runs whose lease expired by ``now`` with work left, oldest expiry first."""
        return recovery.expired_runs(self, now, limit, run_ids)

    def take_over(self, run_ids: Sequence[str], executor: str, ttl_s: float, now: float, *,
                  release: bool, adopt: bool = False) -> tuple[list[Takeover], list[str]]:
        """Take expired runs over under new fences, in one transaction."""
        return recovery.take_over(self, run_ids, executor, ttl_s, now, release=release,
                                  adopt=adopt)

    def orphaned_runs(self, limit: int, run_ids: list[str] | None = None) -> list[str]:
        """Runs with Attempts dispatching under a fence older than the run's."""
        return recovery.orphaned_runs(self, limit, run_ids)

    def mark_orphans(self, run_id: str, now: float) -> list[str]:
        """Mark a run's orphaned Attempts unknown; returns their ids."""
        return recovery.mark_orphans(self, run_id, now)

    def close_run(self, run_id: str, executor: str, status: RunStatus, reason: str,
                  clock: ClockFn) -> tuple[RunRecord, bool]:
        """End a Run nobody will resume, under a fresh fence, in one transaction."""
        return recovery.close_run(self, run_id, executor, status, reason, clock)

    def past_deadline_runs(self, now: float, limit: int, run_ids: list[str] | None = None,
                           executor: str | None = None) -> list[str]:
        """Unfinished runs past their deadline that no other live executor holds."""
        return recovery.past_deadline_runs(self, now, limit, run_ids, executor)

    def reconcile_figures(self, now: float) -> Figures:
        """Every ledger-wide invariant checked on one snapshot."""
        return recovery.reconcile_rows(self, now)

    def event_counts(self, kinds: list[str]) -> dict[str, int]:
        """How many events of each kind the ledger holds."""
        return recovery.event_counts(self, kinds)

    # -- audit reads (the SQL is in ledger.storage.audit and ledger.storage.series) ---------

    def audit_runs(self, *, status: str | None, tenant: str | None, since: float | None,
                   until: float | None, limit: int, cursor: str | None
                   ) -> tuple[list[RowMap], str | None]:
        """Runs newest first, with the next cursor."""
        return audit.runs_page(self, status=status, tenant=tenant, since=since, until=until,
                               limit=limit, cursor=cursor)

    def audit_timeline(self, run_id: str
                       ) -> tuple[RowMap | None, list[RowMap], list[RowMap]]:
        """(run, attempts with debits, events) of one run."""
        return audit.timeline(self, run_id)

    def audit_failovers(self, *, since: float | None, until: float | None, limit: int,
                        cursor: str | None
                        ) -> tuple[list[RowMap], list[RowMap], list[RowMap], str | None]:
        """Runs that failed over, their attempts and moves, and the next cursor."""
        return audit.failover_page(self, since=since, until=until, limit=limit, cursor=cursor)

    def audit_totals(self, *, by: str, since: float | None, until: float | None,
                     label: str | None, limit: int, cursor: str | None
                     ) -> tuple[list[RowMap], str | None]:
        """Attempt totals grouped by ``by``, most expensive first."""
        return audit.totals(self, by=by, since=since, until=until, label=label, limit=limit,
                            cursor=cursor)

    def audit_open_attempts(self, *, states: Sequence[str], since: float | None,
                            until: float | None, limit: int, cursor: str | None
                            ) -> tuple[list[RowMap], str | None]:
        """Attempts in ``states`` with their run's lease, newest first."""
        return audit.open_attempts(self, states=states, since=since, until=until, limit=limit,
                                   cursor=cursor)

    def audit_health(self, now: float) -> tuple[list[RowMap], list[RowMap]]:
        """(health rows, groups with their live in-flight count)."""
        return audit.health(self, now)

    def audit_unusable(self, since: float) -> list[RowMap]:
        """Routes skipped as unusable since ``since`` and not served since."""
        return audit.unusable(self, since)

    def audit_activity(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Attempts per time bucket."""
        return audit.activity(self, since=since, until=until, bucket_s=bucket_s)

    def route_series(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Per route and time bucket: attempts, outcomes, latency."""
        return series.route_series(self, since=since, until=until, bucket_s=bucket_s)

    def cost_by_day(self, *, since: float, until: float) -> list[RowMap]:
        """Per UTC day and tenant: attempts and cost."""
        return series.cost_by_day(self, since=since, until=until)

    def metrics_totals(self, now: float) -> dict[str, list[RowMap]]:
        """The counters of ``/metrics``."""
        return series.metrics_totals(self, now)

    def schema_present(self) -> bool:
        """Whether the ledger's tables exist."""
        return audit.schema_present(self)

    def first_run_other_than(self, *, policy_hash: str | None = None,
                             tenant: str | None = None) -> str | None:
        """One run not carrying ``policy_hash`` (or ``tenant``), else None."""
        return audit.first_run_other_than(self, policy_hash=policy_hash, tenant=tenant)


def _late(e: FencedOut | SettleConflict) -> bool:
    """A refused settle whose observation is kept: the run moved on, or the attempt was
    already settled unknown (the receipt came late)."""
    return isinstance(e, FencedOut) or e.fields.get("state") == AttemptState.UNKNOWN.value


__all__ = ["DEFAULT_LEASE_MARGIN_S", "SqlStore"]
