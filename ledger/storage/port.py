"""The storage port: every operation the rest of the ledger asks of a database.

:class:`StoragePort` is the one interface between storage and everything else. The facade
(:class:`ledger.Ledger`, :class:`ledger.AsyncLedger`), recovery, reconciliation, the audit and
the tools are typed against it and hand it plain values (specs, leases, ids, times); none of them
sees an engine, a connection, a row or a driver. Two implementations exist:
:class:`ledger.storage.sqlite.SqliteStore` and :class:`ledger.storage.postgres.PostgresStore`
(both built on :class:`ledger.storage.store.SqlStore`); :func:`ledger.storage.open_store` picks
one for a URL. Ops and tools reach the port of an open ledger through
:func:`ledger.api.facade.storage_of`.

What every method promises:

* one call is one transaction (or, for the hot writes, one transaction plus, when a settle is
  refused, the append-only record of the refused observation);
* a driver's or SQLAlchemy's exception never leaves it: it is a
  :class:`~ledger.errors.LedgerError` with the driver's exception as ``__cause__``
  (:mod:`ledger.storage.failure`): :class:`~ledger.errors.DatabaseUnavailable` when the database
  cannot be reached, went away or stayed busy (retry-safe), :class:`~ledger.errors.StorageError`
  (``read_only=True``) for a write the database refuses, :class:`~ledger.errors.Conflict` for a
  key recorded already, :class:`~ledger.errors.StorageError` for the rest;
* the hot-path operations are flows (:mod:`ledger.storage.runner`): each yields the
  transaction functions of :mod:`ledger.storage.hot` it needs, and the ledger's runner performs
  them, blocking or for asyncio, so no operation is written twice.

Arguments are taken as already checked by the facade (ids, amounts, leases); the port checks
only what only the database knows (a live lease, a budget left, a row that exists).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

from ledger.domain.records import (
    AttemptRecord,
    DebitRecord,
    EventRecord,
    Lease,
    Page,
    Queued,
    RunRecord,
    RunStatus,
)
from ledger.domain.specs import AdmitSpec, BeginSpec, GroupUpdate, ReceiptSpec, SettleSpec
from ledger.domain.values import GroupProjection, Health
from ledger.storage.runner import Flow, Runner
from ledger.storage.wake import SlotWaker

ClockFn = Callable[[], float]
RowMap = Mapping[str, Any]
#: What :meth:`StoragePort.audit_totals` can group by.
TOTALS_KEYS = ("route", "group", "run", "tenant", "label", "provider")


@dataclass(frozen=True)
class SnapshotRows:
    """What one routing decision reads, in one read transaction (:meth:`StoragePort.turn_snapshot`).

    ``run`` holds the Run's live columns by name (counters, current route and profile, lease,
    compactions), not its frozen snapshots; ``now`` is the clock as read after the rows.
    """

    run: SimpleNamespace
    groups: dict[str, GroupProjection]
    health: dict[str, Health]
    provenance: dict[str, frozenset[str]]
    now: float


@dataclass(frozen=True)
class Takeover:
    """What one takeover transaction did to one run (:meth:`StoragePort.take_over`)."""

    run_id: str
    previous_executor: str | None
    previous_fence: int
    lease: Lease | None  # None when the lease was released after takeover
    fence: int
    newly_unknown: list[str]
    voided: list[str]
    slots_released: int
    attempts: list[AttemptRecord]  # the run's whole timeline after the takeover
    selected_route: str
    current_route: str | None
    status: str
    adopted: bool = False  # already taken over by this executor (a retried, committed takeover)


@dataclass
class Figures:
    """Whole-ledger figures and the violations found by :meth:`StoragePort.reconcile_figures`."""

    runs: int = 0
    attempts: int = 0
    by_state: dict[str, int] = field(default_factory=dict)
    debits: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Attempts whose reported cost exceeded their hold: posted at the hold (the invariant holds)
    # but the Run really cost more than it reserved; an operator needs to know.
    cost_over_hold: list[str] = field(default_factory=list)


@runtime_checkable
class StoragePort(Protocol):
    """Every operation the ledger asks of its database (see the module docstring).

    Every method may raise :class:`~ledger.errors.DatabaseUnavailable` (retry-safe) or
    :class:`~ledger.errors.StorageError`; a method's own docstring names the errors that are
    its answer. ``clock`` arguments are read once the transaction holds its locks, so a
    decision is recorded at the time it was taken.
    """

    #: ``"sqlite"`` or ``"postgresql"``.
    backend: str
    #: How long before its end a lease stops starting work (seconds).
    lease_margin_s: float
    #: The database's URL without its password, for messages.
    where: str
    #: Wakes this process's waiters of a full capacity group (:mod:`ledger.storage.wake`).
    waker: SlotWaker
    #: Performs the port's flows on its database, blocking or for asyncio.
    runner: Runner

    def close(self) -> None:
        """Close every connection. The store is not used afterwards."""
        ...

    # -- runs ---------------------------------------------------------------------------

    def admit(self, spec: AdmitSpec, clock: ClockFn) -> tuple[RunRecord, bool]:
        """Record the Run of ``spec``; returns ``(record, created)``.

        The same id with the same (normalised) content returns the first record with
        ``created=False``. A child (``spec.parent_run_id``) is carved from its parent under
        ``spec.parent_lease``. Raises :class:`~ledger.errors.AdmissionConflict` (same id,
        other content), :class:`~ledger.errors.NotFound` (no such parent),
        :class:`~ledger.errors.InvalidArgument` (a child without the parent's lease),
        :class:`~ledger.errors.BudgetExceeded` / :class:`~ledger.errors.AllowanceExhausted`
        (the parent has not that much left), ``FencedOut`` / ``LeaseLost`` (the parent's lease).
        """
        ...

    def get_run(self, run_id: str) -> RunRecord:
        """The Run as it stands. Raises :class:`~ledger.errors.NotFound`."""
        ...

    def children(self, run_id: str) -> list[RunRecord]:
        """The Child Runs admitted under ``run_id``, oldest first (none: an empty list)."""
        ...

    # -- the hot path -------------------------------------------------------------------

    def turn_snapshot(self, run_id: str, groups: Sequence[str], keys: Sequence[str],
                      runs: Sequence[str], refs: Sequence[str], clock: ClockFn
                      ) -> Flow[SnapshotRows]:
        """One read: the live row of ``run_id``, the projections of ``groups``, the health
        rows of ``keys`` and the provenance of ``refs`` recorded by ``runs`` (the Run and its
        ancestors). Raises :class:`~ledger.errors.NotFound` for an unknown run."""
        ...


    def begin_attempt(self, spec: BeginSpec, clock: ClockFn
                      ) -> Flow[AttemptRecord | Queued]:
        """Record the Attempt of ``spec`` before it is sent, in one transaction: live lease,
        allowances (and a retry permission when ``spec.take_retry``), the cost and token holds,
        a capacity slot, the decision's events. The same attempt id and content again is the
        same write (the first record). A capacity refusal is recorded (``rejected``), then
        raised. Raises ``FencedOut`` / ``LeaseLost`` (the lease), ``BudgetExceeded``,
        ``AllowanceExhausted``, ``CapacityUnavailable`` (refused; nothing may be sent),
        :class:`~ledger.errors.Conflict` (the id was begun with other content),
        :class:`~ledger.errors.NotFound` (unknown run). With ``spec.queue_until``, a full
        limited group queues the begin instead: the result is a
        :class:`~ledger.domain.records.Queued` place (first come, first served across
        processes), nothing is recorded as an Attempt, and the same begin again records it
        once its place comes up (with a ``capacity_wait`` event)."""
        ...


    def leave_queue(self, waiter_id: str, group: str) -> Flow[None]:
        """Give up the queue place of ``waiter_id`` (the attempt id of a queued begin) in
        ``group``, and wake the waiters behind it; without a place nothing happens."""
        ...


    def settle_attempt(self, run_id: str, spec: SettleSpec, clock: ClockFn
                       ) -> Flow[AttemptRecord]:
        """Record the outcome of ``spec.attempt_id`` (of ``run_id``) in one transaction: the
        hold posted or voided, the slot freed, health and the group fact applied. Settling
        again with the same content returns the settled record. Accepted under the Attempt's
        own fence while it is current, even after the lease expired. Raises
        :class:`~ledger.errors.FencedOut` once the Run was taken over and
        :class:`~ledger.errors.SettleConflict` for other content (both keep the refused
        observation as a ``late_receipt`` event when the Run moved on or the Attempt was
        settled unknown), :class:`~ledger.errors.NotFound` (no such attempt in the run)."""
        ...


    def settle_unknown(self, spec: ReceiptSpec, clock: ClockFn) -> AttemptRecord:
        """Settle an ``unknown`` Attempt with an operator's evidence, in one transaction under
        its Run's row lock (no lease: the Run may be closed or held by nobody): the state moves
        from ``unknown`` to ``spec.outcome`` once, the hold is posted or voided by
        :func:`ledger.decide.settle.settle_holds`, the Run's counters follow, and an applied
        ``late_receipt`` event records who, what and the previous state. Raises
        :class:`~ledger.errors.NotFound` (no such attempt) and
        :class:`~ledger.errors.InvalidState` (it is not ``unknown``); nothing is written
        then."""
        ...

    def mark_unknown(self, lease: Lease, attempt_id: str, clock: ClockFn,
                     reason: str) -> Flow[AttemptRecord]:
        """Settle a dispatching Attempt as unknown (sent, no receipt: the hold stays, the slot
        is freed); an Attempt already settled is returned as it is. Raises
        :class:`~ledger.errors.NotFound` (no such attempt in the lease's run),
        :class:`~ledger.errors.FencedOut` (a stale lease, or an Attempt of another fence)."""
        ...


    def acquire_lease(self, run_id: str, executor: str, ttl_s: float, clock: ClockFn
                      ) -> Flow[Lease]:
        """A lease on ``run_id`` for ``executor`` lasting ``ttl_s``: one's own live lease is
        renewed under the same fence, otherwise the fence moves on. Raises
        :class:`~ledger.errors.LeaseHeld` (another holder's unexpired lease),
        :class:`~ledger.errors.NotFound` (unknown run)."""
        ...


    def renew_lease(self, lease: Lease, ttl_s: float, clock: ClockFn) -> Flow[Lease]:
        """Extend a live lease to ``ttl_s`` from now. Raises :class:`~ledger.errors.LeaseLost`
        (expired or released) or :class:`~ledger.errors.FencedOut` (taken over)."""
        ...


    def release_lease(self, lease: Lease, clock: ClockFn) -> Flow[None]:
        """Give the lease up (again: the same write). Raises
        :class:`~ledger.errors.InvalidState` (attempts still in flight),
        :class:`~ledger.errors.LeaseLost` / :class:`~ledger.errors.FencedOut`."""
        ...


    def finish_run(self, lease: Lease, status: RunStatus, clock: ClockFn) -> Flow[None]:
        """Record the Run's end ``status`` under a live lease (with a ``finish`` event).
        Raises :class:`~ledger.errors.LeaseLost` / :class:`~ledger.errors.FencedOut`."""
        ...


    def reserve_retry(self, lease: Lease, clock: ClockFn,
                      data: Mapping[str, Any] | None = None) -> Flow[int]:
        """Take one retry permission (``data`` is recorded with it as an event); returns how
        many are left. Raises :class:`~ledger.errors.AllowanceExhausted`, ``LeaseLost`` /
        ``FencedOut``."""
        ...


    def record_provenance(self, lease: Lease, ref: str, content_hash: str, kind: str,
                          clock: ClockFn) -> Flow[None]:
        """Record that ``ref`` produced content with ``content_hash`` (the same again is the
        same write). Raises ``LeaseLost`` / ``FencedOut``."""
        ...


    def append_event(self, lease: Lease, attempt_id: str | None, kind: str,
                     data: Mapping[str, Any], clock: ClockFn) -> Flow[None]:
        """Append an audit event (``data`` stored as redacted JSON) under a live lease.
        Raises ``LeaseLost`` / ``FencedOut``."""
        ...


    def claim_probe(self, key: str, provider: str | None, now: float, interval_s: float, *,
                    kind: str = "route", ttl_s: float | None = None,
                    max_keys: int | None = None) -> Flow[bool]:
        """Take the cluster-wide probe slot of health key ``key`` (of ``kind``: route,
        profile or provider): True for exactly one caller per ``interval_s``. A claim taken
        forgets probe times ``ttl_s`` old and keeps at most ``max_keys`` keys with one."""
        ...


    def record_compaction(self, lease: Lease, clock: ClockFn) -> Flow[int]:
        """Count one compaction of the Run's session; returns the new count. Raises
        ``LeaseLost`` / ``FencedOut``."""
        ...


    # -- groups, health, provenance, events ---------------------------------------------

    def configure_group(self, group: str, max_in_flight: int | None, now: float) -> None:
        """Create or update capacity group ``group`` with its concurrency limit (None:
        unlimited); its mode is left as it is."""
        ...

    def set_group_mode(self, group: str, upd: GroupUpdate, now: float) -> None:
        """Set ``group``'s mode, waiting floor and reason to ``upd`` (created when unknown)."""
        ...

    def group_projections(self, groups: Iterable[str] | None, now: float
                          ) -> dict[str, GroupProjection]:
        """Admission's view at ``now`` of ``groups`` (None: every known group); unknown
        groups are absent."""
        ...

    def health(self, keys: Iterable[str] | None = None) -> dict[str, Health]:
        """The stored health rows of ``keys`` (None: all), as stored (not read at a time)."""
        ...

    def provenance(self, run_ids: Sequence[str]) -> dict[str, set[str]]:
        """Provenance recorded by ``run_ids``: ref -> content hashes."""
        ...

    def events(self, run_id: str, kinds: Sequence[str] | None = None) -> list[EventRecord]:
        """The Run's events in order, optionally only of ``kinds``."""
        ...

    # -- reads --------------------------------------------------------------------------

    def attempt(self, attempt_id: str) -> Flow[AttemptRecord]:
        """One Attempt with its debit's state. Raises :class:`~ledger.errors.NotFound`."""
        ...

    def timeline(self, run_id: str) -> list[AttemptRecord]:
        """The Run's Attempts in sequence. Raises :class:`~ledger.errors.NotFound` for an
        unknown run."""
        ...

    def attempts(self, *, route: str | None = None, group: str | None = None,
                 state: str | None = None, category: str | None = None,
                 since: float | None = None, until: float | None = None,
                 run_ids: Sequence[str] | None = None, limit: int = 100,
                 cursor: str | None = None) -> Page[AttemptRecord]:
        """Attempts newest first, filtered, ``limit`` per page (keyset pagination on
        ``(created_at, attempt_id)``; pass ``next_cursor`` back). Raises
        :class:`~ledger.errors.InvalidArgument` (limit out of 1..10000, malformed cursor)."""
        ...

    def debit(self, debit_id: str) -> DebitRecord:
        """One debit (an Attempt's hold). Raises :class:`~ledger.errors.NotFound`."""
        ...

    # -- recovery and reconciliation (ledger.ops) ---------------------------------------

    def expired_runs(self, now: float, limit: int,
                     run_ids: list[str] | None = None) -> list[str]:
        """Up to ``limit`` runs (of ``run_ids``, or all) whose executor lease expired by
        ``now`` and that are unfinished or still have an Attempt dispatching, oldest expiry
        first."""
        ...

    def take_over(self, run_ids: Sequence[str], executor: str, ttl_s: float, now: float, *,
                  release: bool, adopt: bool = False) -> tuple[list[Takeover], list[str]]:
        """Take the expired runs of ``run_ids`` over for ``executor`` in one transaction: new
        fences, dispatching Attempts unknown (holds kept), unsent holds voided, slots freed;
        the new lease lasts ``ttl_s`` (or is released at once with ``release``). ``adopt``
        also reports runs this executor already took over (a retried takeover whose commit
        landed). Returns the takeovers and the runs not (or no longer) to take."""
        ...

    def orphaned_runs(self, limit: int, run_ids: list[str] | None = None) -> list[str]:
        """Up to ``limit`` runs (of ``run_ids``, or all) that have Attempts dispatching under
        a fence older than the run's."""
        ...

    def mark_orphans(self, run_id: str, now: float) -> list[str]:
        """Mark ``run_id``'s orphaned Attempts unknown (holds kept, slots freed) without
        taking the run from its executor; returns their ids."""
        ...

    def close_run(self, run_id: str, executor: str, status: RunStatus, reason: str,
                  clock: ClockFn) -> tuple[RunRecord, bool]:
        """End ``run_id`` with ``status`` under a fresh fence, in one transaction: dispatching
        Attempts unknown (holds kept), slots freed, the lease released, a ``close`` event with
        ``reason``. Returns the Run and whether it changed (``False``: it had already ended
        with ``status``). Raises :class:`~ledger.errors.NotFound`,
        :class:`~ledger.errors.LeaseHeld` (a live executor other than ``executor`` holds it)
        and :class:`~ledger.errors.InvalidState` (it ended with another status, or
        ``succeeded`` asked of a Run whose last turn was not served)."""
        ...

    def past_deadline_runs(self, now: float, limit: int, run_ids: list[str] | None = None,
                           executor: str | None = None) -> list[str]:
        """Up to ``limit`` unfinished runs (of ``run_ids``, or all) whose deadline is past at
        ``now`` and that no live executor other than ``executor`` holds, oldest deadline
        first."""
        ...

    def reconcile_figures(self, now: float) -> Figures:
        """Check every ledger-wide invariant on one consistent snapshot; writes nothing."""
        ...

    def event_counts(self, kinds: list[str]) -> dict[str, int]:
        """How many events of each of ``kinds`` the ledger holds."""
        ...

    # -- audit reads (ledger.ops.audit; read-only, so a read-only role serves) -------------

    def audit_runs(self, *, status: str | None, tenant: str | None, since: float | None,
                   until: float | None, limit: int, cursor: str | None
                   ) -> tuple[list[RowMap], str | None]:
        """Runs newest first (by status, tenant, admission time), with the next cursor.
        Raises :class:`~ledger.errors.InvalidArgument` (limit, malformed cursor)."""
        ...

    def audit_timeline(self, run_id: str
                       ) -> tuple[RowMap | None, list[RowMap], list[RowMap]]:
        """(run, its attempts with their debits, its events); the run is None when unknown."""
        ...

    def audit_failovers(self, *, since: float | None, until: float | None, limit: int,
                        cursor: str | None
                        ) -> tuple[list[RowMap], list[RowMap], list[RowMap], str | None]:
        """Runs admitted in the range that failed over, their attempts, their ``move``
        events, and the next cursor. Raises :class:`~ledger.errors.InvalidArgument`."""
        ...

    def audit_totals(self, *, by: str, since: float | None, until: float | None,
                     label: str | None, limit: int, cursor: str | None
                     ) -> tuple[list[RowMap], str | None]:
        """Attempt counts, tokens and cost grouped by ``by`` (route, group, run, tenant,
        label with ``label`` the key, provider), most expensive first. Raises
        :class:`~ledger.errors.InvalidArgument` (an unknown ``by``, a bad label key)."""
        ...

    def audit_open_attempts(self, *, states: Sequence[str], since: float | None,
                            until: float | None, limit: int, cursor: str | None
                            ) -> tuple[list[RowMap], str | None]:
        """Attempts in ``states`` with their run's lease, newest first."""
        ...

    def audit_health(self, now: float) -> tuple[list[RowMap], list[RowMap]]:
        """(every health row, every capacity group with its live in-flight count at ``now``)."""
        ...

    def audit_unusable(self, since: float) -> list[RowMap]:
        """Routes (per profile) skipped as unusable since ``since`` and not served since their
        last skip: skips, first and last time, the last skip's attempt, run and fact."""
        ...

    def audit_activity(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Attempts per ``bucket_s`` bucket of [since, until): total, failed, unknown.
        Raises :class:`~ledger.errors.InvalidArgument` (``bucket_s`` not > 0)."""
        ...

    def route_series(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Per route and bucket: attempts, outcomes and the succeeded ones' summed latency.
        Raises :class:`~ledger.errors.InvalidArgument` (``bucket_s`` not > 0)."""
        ...

    def cost_by_day(self, *, since: float, until: float) -> list[RowMap]:
        """Per UTC day from ``since`` (a midnight) and tenant: attempts and cost in micros."""
        ...

    def metrics_totals(self, now: float) -> dict[str, list[RowMap]]:
        """The whole-history counters ``/metrics`` exposes, in one read."""
        ...

    def schema_present(self) -> bool:
        """Whether the ledger's tables exist (a reader never creates them)."""
        ...

    def first_run_other_than(self, *, policy_hash: str | None = None,
                             tenant: str | None = None) -> str | None:
        """The id of one run not carrying ``policy_hash`` (or ``tenant``), else None."""
        ...


__all__ = ["TOTALS_KEYS", "ClockFn", "Figures", "RowMap", "SnapshotRows", "StoragePort", "Takeover"]
