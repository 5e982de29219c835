"""The store: every read and write of the ledger over one database goes through it.

Nothing outside ``ledger.storage`` touches the database; the SQL itself lives here and in the
modules beside it (:mod:`~ledger.storage.hot`, :mod:`~ledger.storage.audit`,
:mod:`~ledger.storage.recovery`, :mod:`~ledger.storage.series`, ...).

The hot path — the snapshot read of a decision, begin, settle, the lease writes, provenance and
events — runs the transactions of :mod:`ledger.storage.hot` on the database's own driver
(:mod:`ledger.storage.driver`): plain SQL, prepared by psycopg on the server, ``BEGIN`` and
``COMMIT`` pipelined with the statements on PostgreSQL, and each one available sync and async.
The rest (admission, reads, group administration, and the audit and recovery queries, which run
in :meth:`Store.reading` / :meth:`Store.writing`) uses SQLAlchemy Core over an engine on the same
database; migrations use Alembic on that engine. Writes that carry a fence lock the run row
first (``SELECT ... FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE`` already serializes SQLite
writers), then check the lease, so a stale or lapsed executor can write nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, and_, bindparam, func, or_, select
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from ledger import faults
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    DebitRecord,
    DebitState,
    EventRecord,
    Lease,
    Page,
    RunRecord,
    RunStatus,
    from_micros,
)
from ledger.domain.specs import (
    ADMISSION_FIELDS,
    AdmitSpec,
    BeginSpec,
    GroupUpdate,
    SettleSpec,
    normal_admission_field,
)
from ledger.domain.values import GroupMode, GroupProjection, Health
from ledger.errors import (
    AdmissionConflict,
    AllowanceExhausted,
    BudgetExceeded,
    FencedOut,
    InvalidArgument,
    NotFound,
    SettleConflict,
)
from ledger.storage import hot
from ledger.storage import schema as s
from ledger.storage.driver import PgDriver, SqliteDriver, Tx
from ledger.storage.engine import mapped_errors, redact_url
from ledger.storage.hot import check_live
from ledger.storage.rows import attempt_record, health_record, run_record
from ledger.storage.statements import event_json

ClockFn = Callable[[], float]
# How long before its end a lease stops starting work: processes whose clocks differ by less
# than this never both believe they may use one capacity slot (docs/operations.md).
DEFAULT_LEASE_MARGIN_S = 0.5
SEL_ATTEMPT_WITH_DEBIT = (
    select(s.attempts, s.debits.c.state.label("debit_state"))
    .outerjoin(s.debits, s.debits.c.debit_id == s.attempts.c.debit_id)
    .where(s.attempts.c.attempt_id == bindparam("k_attempt_id"))
)


def _driver(engine: Engine, url: str) -> SqliteDriver | PgDriver:
    if engine.dialect.name == "postgresql":
        conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        return PgDriver(conninfo, where=redact_url(url))
    db = engine.url.database
    assert db is not None
    return SqliteDriver(db)


class Store:
    """The storage layer over one database (an engine for the cold path, a driver for the hot)."""

    def __init__(self, engine: Engine, url: str, *,
                 lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> None:
        self.engine = engine
        self.url = url
        self.dialect = engine.dialect.name
        self.lease_margin_s = lease_margin_s
        self.driver = _driver(engine, url)
        self.sql = hot.SQL[self.dialect]

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
        self.driver.close()
        self.engine.dispose()

    def insert_for(self, table: Any) -> Any:
        """The dialect's INSERT (with ON CONFLICT support) for ``table``."""
        if self.dialect == "postgresql":
            return pg_dialect.insert(table)
        return sqlite_dialect.insert(table)

    def _write(self, tx: Tx[Any]) -> Any:
        return self.driver.run(tx, write=True)

    async def _awrite(self, tx: Tx[Any]) -> Any:
        return await self.driver.arun(tx, write=True)

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
        parent = conn.execute(
            select(s.runs).where(r.run_id == spec.parent_run_id).with_for_update()).first()
        if parent is None:
            raise NotFound(f"parent run {spec.parent_run_id!r} does not exist; admit it first",
                           run_id=spec.parent_run_id)
        now = clock()
        check_live(parent, spec.parent_lease, now, self.lease_margin_s)
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

    # -- the hot path (each also as an ``a``-prefixed coroutine) -------------------------

    def _snapshot_tx(self, run_id: str, groups: Sequence[str], keys: Sequence[str],
                     runs: Sequence[str], refs: Sequence[str], clock: ClockFn
                     ) -> Tx[hot.Snapshot]:
        return hot.snapshot_tx(self.sql, run_id, groups, keys, runs, refs, clock)

    def turn_snapshot(self, run_id: str, groups: Sequence[str], keys: Sequence[str],
                      runs: Sequence[str], refs: Sequence[str], clock: ClockFn
                      ) -> hot.Snapshot:
        """One read: the run's live row (counters, current route, lease; not its frozen
        snapshots), its groups' projections, the health rows of ``keys``, and the provenance
        of ``refs`` recorded by ``runs``."""
        return self.driver.run(self._snapshot_tx(run_id, groups, keys, runs, refs, clock),
                               write=False)

    async def aturn_snapshot(self, run_id: str, groups: Sequence[str], keys: Sequence[str],
                             runs: Sequence[str], refs: Sequence[str], clock: ClockFn
                             ) -> hot.Snapshot:
        return await self.driver.arun(
            self._snapshot_tx(run_id, groups, keys, runs, refs, clock), write=False)

    def begin_attempt(self, spec: BeginSpec, clock: ClockFn) -> AttemptRecord:
        """Record an attempt before it is sent, in one transaction: live lease, allowances,
        holds, capacity, the decision's events. A rejection is recorded, then raised."""
        return self._write(hot.begin_tx(self.sql, spec, clock, self.lease_margin_s))  # type: ignore[no-any-return]

    async def abegin_attempt(self, spec: BeginSpec, clock: ClockFn) -> AttemptRecord:
        return await self._awrite(hot.begin_tx(self.sql, spec, clock, self.lease_margin_s))  # type: ignore[no-any-return]

    def settle_attempt(self, run_id: str, spec: SettleSpec, clock: ClockFn) -> AttemptRecord:
        """Record an attempt's outcome in one transaction; a settled attempt is never rewritten.

        Accepted for an Attempt begun under the lease's fence while that fence is current, even
        after the lease expired (the outcome is the truth; its slot already counted as free).
        Refused with :class:`FencedOut` once the Run was taken over (by another executor, by
        recovery, or by this executor acquiring again); the refused observation is kept as a
        ``late_receipt`` event on the Attempt, and its row does not change.
        """
        try:
            return self._write(hot.settle_tx(self.sql, run_id, spec, clock))  # type: ignore[no-any-return]
        except (FencedOut, SettleConflict) as e:
            if _late(e):
                self._write(hot.late_receipt_tx(self.sql, run_id, spec, clock(), str(e)))
            raise

    async def asettle_attempt(self, run_id: str, spec: SettleSpec, clock: ClockFn
                              ) -> AttemptRecord:
        try:
            return await self._awrite(hot.settle_tx(self.sql, run_id, spec, clock))  # type: ignore[no-any-return]
        except (FencedOut, SettleConflict) as e:
            if _late(e):
                await self._awrite(hot.late_receipt_tx(self.sql, run_id, spec, clock(), str(e)))
            raise

    def mark_unknown(self, lease: Lease, attempt_id: str, clock: ClockFn,
                     reason: str) -> AttemptRecord:
        """Dispatched without a receipt: unknown, keeping its hold (a graceful shutdown)."""
        return self._write(hot.mark_unknown_tx(self.sql, lease, attempt_id, clock, reason))  # type: ignore[no-any-return]

    async def amark_unknown(self, lease: Lease, attempt_id: str, clock: ClockFn,
                            reason: str) -> AttemptRecord:
        return await self._awrite(hot.mark_unknown_tx(self.sql, lease, attempt_id, clock,  # type: ignore[no-any-return]
                                                      reason))

    def acquire_lease(self, run_id: str, executor: str, ttl_s: float, clock: ClockFn) -> Lease:
        """A lease on the run. Another holder's unexpired lease is ``LeaseHeld``; one's own
        live lease is renewed under the same fence; otherwise the fence moves on."""
        return self._write(hot.acquire_tx(self.sql, run_id, executor, ttl_s, clock,  # type: ignore[no-any-return]
                                          self.lease_margin_s))

    async def aacquire_lease(self, run_id: str, executor: str, ttl_s: float,
                             clock: ClockFn) -> Lease:
        return await self._awrite(hot.acquire_tx(self.sql, run_id, executor, ttl_s, clock,  # type: ignore[no-any-return]
                                                 self.lease_margin_s))

    def renew_lease(self, lease: Lease, ttl_s: float, clock: ClockFn) -> Lease:
        """Extend a live lease; a lapsed one is ``LeaseLost`` (acquire again)."""
        return self._write(hot.renew_tx(self.sql, lease, ttl_s, clock, self.lease_margin_s))  # type: ignore[no-any-return]

    async def arenew_lease(self, lease: Lease, ttl_s: float, clock: ClockFn) -> Lease:
        return await self._awrite(hot.renew_tx(self.sql, lease, ttl_s, clock,  # type: ignore[no-any-return]
                                               self.lease_margin_s))

    def release_lease(self, lease: Lease, clock: ClockFn) -> None:
        """Give the lease up. Releasing an already released lease is the same write again."""
        self._write(hot.release_tx(self.sql, lease, clock))

    async def arelease_lease(self, lease: Lease, clock: ClockFn) -> None:
        await self._awrite(hot.release_tx(self.sql, lease, clock))

    def finish_run(self, lease: Lease, status: RunStatus, clock: ClockFn) -> None:
        self._write(hot.finish_tx(self.sql, lease, status, clock, self.lease_margin_s))

    async def afinish_run(self, lease: Lease, status: RunStatus, clock: ClockFn) -> None:
        await self._awrite(hot.finish_tx(self.sql, lease, status, clock, self.lease_margin_s))

    def reserve_retry(self, lease: Lease, clock: ClockFn,
                      data: Mapping[str, Any] | None = None) -> int:
        """Take one retry permission; returns how many are left after it."""
        return self._write(hot.reserve_retry_tx(self.sql, lease, clock, self.lease_margin_s,  # type: ignore[no-any-return]
                                                dict(data or {})))

    async def areserve_retry(self, lease: Lease, clock: ClockFn,
                             data: Mapping[str, Any] | None = None) -> int:
        return await self._awrite(hot.reserve_retry_tx(  # type: ignore[no-any-return]
            self.sql, lease, clock, self.lease_margin_s, dict(data or {})))

    def record_provenance(self, lease: Lease, ref: str, content_hash: str, kind: str,
                          clock: ClockFn) -> None:
        self._write(hot.provenance_tx(self.sql, lease, ref, content_hash, kind, clock,
                                      self.lease_margin_s))

    async def arecord_provenance(self, lease: Lease, ref: str, content_hash: str, kind: str,
                                 clock: ClockFn) -> None:
        await self._awrite(hot.provenance_tx(self.sql, lease, ref, content_hash, kind, clock,
                                             self.lease_margin_s))

    def append_event(self, lease: Lease, attempt_id: str | None, kind: str,
                     data: Mapping[str, Any], clock: ClockFn) -> None:
        self._write(hot.event_tx(self.sql, lease, attempt_id, kind, data, clock,
                                 self.lease_margin_s))

    async def aappend_event(self, lease: Lease, attempt_id: str | None, kind: str,
                            data: Mapping[str, Any], clock: ClockFn) -> None:
        await self._awrite(hot.event_tx(self.sql, lease, attempt_id, kind, data, clock,
                                        self.lease_margin_s))

    def claim_probe(self, key: str, provider: str | None, now: float, interval_s: float, *,
                    kind: str = "route", ttl_s: float | None = None,
                    max_keys: int | None = None) -> bool:
        """Take the cluster-wide probe slot for ``key``: True for exactly one caller per window.
        A claim taken forgets probe times ``ttl_s`` old and keeps at most ``max_keys``."""
        faults.point("probe.before_claim")
        return self._write(hot.claim_probe_tx(self.sql, key, provider, now, interval_s,  # type: ignore[no-any-return]
                                              kind=kind, ttl_s=ttl_s, max_keys=max_keys))

    async def aclaim_probe(self, key: str, provider: str | None, now: float,
                           interval_s: float, *, kind: str = "route", ttl_s: float | None = None,
                           max_keys: int | None = None) -> bool:
        faults.point("probe.before_claim")
        return await self._awrite(hot.claim_probe_tx(self.sql, key, provider, now, interval_s,  # type: ignore[no-any-return]
                                                     kind=kind, ttl_s=ttl_s,
                                                     max_keys=max_keys))

    def record_compaction(self, lease: Lease, clock: ClockFn) -> int:
        """Count one compaction of the Run's session; returns the new count."""
        return self._write(hot.compaction_tx(self.sql, lease, clock, self.lease_margin_s))  # type: ignore[no-any-return]

    async def arecord_compaction(self, lease: Lease, clock: ClockFn) -> int:
        return await self._awrite(hot.compaction_tx(self.sql, lease, clock,  # type: ignore[no-any-return]
                                                    self.lease_margin_s))

    # -- groups, health (administration and reads) -----------------------------------------

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
        h = s.health.c
        with self.reading() as conn:
            q = select(s.health)
            if keys is not None:
                q = q.where(h.key.in_(list(keys)))
            return {row.key: health_record(row) for row in conn.execute(q).all()}

    def provenance(self, run_ids: Sequence[str]) -> dict[str, set[str]]:
        p = s.provenance.c
        with self.reading() as conn:
            rows = conn.execute(select(p.ref, p.content_hash).where(p.run_id.in_(list(run_ids))))
            out: dict[str, set[str]] = {}
            for ref, h in rows:
                out.setdefault(ref, set()).add(h)
            return out

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


def _late(e: FencedOut | SettleConflict) -> bool:
    """A refused settle whose observation is kept: the run moved on, or the attempt was
    already settled unknown (the receipt came late)."""
    return isinstance(e, FencedOut) or e.fields.get("state") == AttemptState.UNKNOWN.value
