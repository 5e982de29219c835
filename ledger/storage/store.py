"""The store: the hot path's operations, as flows its runner performs.

The turn, leases, provenance and events use :class:`Store` and nothing else. Each member is a
flow (:mod:`ledger.storage.runner`) of one or two transaction functions of
:mod:`ledger.storage.hot`, which the store's runner performs on the database's own driver
(:mod:`ledger.storage.driver`), blocking or for asyncio: plain SQL, prepared on the server,
``BEGIN`` and ``COMMIT`` pipelined with the statements on PostgreSQL. Writes that carry a fence
lock the run row first (``SELECT ... FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE`` already
serializes SQLite writers), then check the lease, so a stale or lapsed executor can write
nothing.

Everything else (admission and reads, recovery, the audit) is a query object built on the
store's :class:`~ledger.storage.context.SqlContext` (``store.context``). Open a store with
:func:`ledger.storage.open_store`; ops and tools reach the store of an open ledger through
:func:`ledger.api.face.storage_of`.

What every flow promises:

* it is one transaction (a refused settle adds the append-only record of the refused
  observation);
* a driver's exception never leaves it: it is a :class:`~ledger.errors.LedgerError` with the
  driver's exception as ``__cause__`` (:mod:`ledger.storage.failure`):
  :class:`~ledger.errors.DatabaseUnavailable` when the database cannot be reached, went away or
  stayed busy (retry-safe), :class:`~ledger.errors.DatabaseReadOnly` (a set-up error, also a
  :class:`~ledger.errors.StorageError` with ``read_only=True``) for a write the database
  refuses on the primary, :class:`~ledger.errors.Conflict` for a key recorded already,
  :class:`~ledger.errors.StorageError` for the rest;
* arguments are taken as already checked (ids, amounts, leases); the store checks only what
  only the database knows (a live lease, a budget left, a row that exists). ``clock`` is read
  once the transaction holds its locks, so a decision is recorded at the time it was taken;
* a write whose ``COMMIT`` outcome is unknown (an error after the ``COMMIT`` was sent that is
  not the server's answer to a statement of the transaction on a connection it still serves —
  the connection lost, the session terminated, even before the driver saw the connection
  close: ``DatabaseUnavailable`` with ``fields["commit"] == "unknown"``,
  :mod:`ledger.storage.driver`) is resolved before the flow returns or raises. A settle,
  finish, release, renew or acquire is run once more, on a new connection: each locks the
  Run's row before it reads anything, so it waits until the server has finished with the old
  transaction (committed or rolled back) and then finds the write done (the same write again
  is the same record) or does it. An admission (:meth:`Store.admit`, the cold path's
  transaction, marked the same way by :meth:`~ledger.storage.context.SqlContext.writing`) is
  run once more too: the same content again is the same Run. Only when that fails too
  does the original :class:`~ledger.errors.DatabaseUnavailable` leave, with
  ``fields["operation"]`` and ``fields["resolved"] = False``. A begin is not run again here (a
  host retries it with the same attempt id, or the retry owner settles it ``not_sent``:
  :mod:`ledger.decide.turn`); its error says ``operation="begin"``. An error raised before the
  ``COMMIT`` was sent, or the server's answer to a statement of the transaction (a
  serialization failure, a deadlock, a lock timeout), is told with ``resolved=True,
  landed=False``: nothing was written;
* what stays unresolved because the database did not answer (the retry owner's begin that was
  never sent, the retry owner's settle, a Run session's exit, a Child's admission told failed
  and the ending of a fresh Child whose entry raised, both kept under the parent:
  :mod:`ledger.decide.resolve`) is remembered in
  :attr:`Store.pending`, and every write for its Run (and the turn's snapshot) resolves it
  first: nothing else is written for that Run until it is, and while the database stays away
  that write fails with the same :class:`~ledger.errors.DatabaseUnavailable`. The lease keeper
  resolves it too, and :meth:`Store.settle_pending` when the ledger closes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from ledger import faults
from ledger.decide.resolve import (
    Resolution,
    Unresolved,
    UnresolvedAdmission,
    UnresolvedBegin,
    UnresolvedChildEnd,
    UnresolvedExit,
    UnresolvedSettle,
    attempt_verdict,
    settle_verdict,
    stays,
    unresolved_admission,
)
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    Lease,
    Queued,
    RunRecord,
    RunStatus,
)
from ledger.domain.specs import AdmitSpec, BeginSpec, ReceiptSpec, SettleSpec
from ledger.errors import (
    DatabaseUnavailable,
    FencedOut,
    InvalidState,
    LedgerError,
    NotFound,
    SettleConflict,
)
from ledger.forking import renew_in_child
from ledger.storage import hot
from ledger.storage.context import ClockFn, SqlContext
from ledger.storage.driver import Driver, Tx
from ledger.storage.failure import closed_error
from ledger.storage.rows import SnapshotRows
from ledger.storage.runner import Flow, Runner, UnderWay, Workers, blocking, txn
from ledger.storage.runs import RunQueries
from ledger.storage.statements import Statements
from ledger.storage.wake import Listener, SlotWaker

T = TypeVar("T")
log = logging.getLogger("ledger.storage")

#: How long a ledger's close waits for the begins under way to end before it gives up the
#: queue places of its waiters.
CLOSE_WAITS_BEGINS_S = 5.0


def commit_unknown(error: DatabaseUnavailable) -> bool:
    """Whether ``error`` lost the connection after its transaction's ``COMMIT`` was sent."""
    return error.fields.get("commit") == "unknown"


def resolving(operation: str, write: Callable[[bool], Tx[T]], *, again: bool = True,
              **about: Any) -> Flow[T]:
    """Perform the write ``write(False)``; when its ``COMMIT``'s outcome is unknown, resolve it.

    A write the server refused for a statement prepared before a migration changed what it
    returns (``schema_changed``) is made once more from its start by the driver itself, as
    every transaction is (:class:`~ledger.storage.driver.PgDriver`).

    ``write(True)`` is the same write again, run on a new connection: it locks the Run's row
    before reading, so it waits for the old transaction to end on the server and then finds it
    done, or does it (the caller makes it idempotent). ``again=False``: told, not resolved
    (the caller resolves it). An error without ``commit="unknown"`` (raised before the
    ``COMMIT`` was sent, or the server's answer to a statement) is told ``landed=False``
    unread: the driver marks every other one. The error that leaves is always the first one,
    with ``operation``, ``resolved`` and ``landed`` (and ``about``) in its fields.
    """
    try:
        return (yield from txn(lambda: write(False)))
    except DatabaseUnavailable as e:
        e.fields.update(operation=operation, **about)
        if not commit_unknown(e):
            e.fields.update(resolved=True, landed=False)  # rolled back: nothing was written
            raise
        e.fields.update(resolved=False, landed=None)
        if not again:
            raise
        first = e
    log.warning("%s: the connection was lost after its COMMIT was sent; resolving it under "
                "the Run's row lock on a new connection (%s)", operation, first)
    try:
        out = yield from txn(lambda: write(True))
    except DatabaseUnavailable as second:
        first.add_note(f"resolving the {operation} failed too: {second}")
        log.warning("%s: not resolved (%s); it is safe to retry once the database is back",
                    operation, second)
        raise first from first.__cause__  # the original error, with its own cause
    log.warning("%s: resolved: the write is recorded", operation)
    return out


class Pending:
    """This process's unresolved writes (:mod:`ledger.decide.resolve`), by Run.

    Shared by every thread of the ledger (a turn's, the lease keeper's) and by its sync and async
    faces; each Run's begins and settles come before its exit (a release needs nothing in
    flight).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, Unresolved]] = {}
        # The Runs whose writes a session's exit is resolving itself (claim): the ledger's
        # close leaves them to it, waiting for the claims to end, rather than writing the same
        # exit at once from its own thread (one of the two then found the lease gone).
        self._claims: dict[str, int] = {}
        self._unclaimed = threading.Condition(self._lock)

    def __bool__(self) -> bool:
        return bool(self._runs)  # read without the lock: a hint for the hot path's fast check

    @staticmethod
    def _key(item: Unresolved) -> str:
        if isinstance(item, UnresolvedBegin):
            return item.attempt_id
        if isinstance(item, UnresolvedSettle):
            return "settle " + item.attempt_id
        if isinstance(item, UnresolvedAdmission):
            return "admit " + item.child_id
        if isinstance(item, UnresolvedChildEnd):
            return "end " + item.child_id
        return ""

    def add(self, item: Unresolved) -> None:
        """Remember ``item`` (an exit replaces the Run's earlier exit, a settle the same
        Attempt's earlier settle)."""
        with self._lock:
            self._runs.setdefault(item.run_id, {})[self._key(item)] = item

    def drop(self, item: Unresolved) -> None:
        """Forget ``item``: it is resolved, or decided by someone else."""
        with self._lock:
            items = self._runs.get(item.run_id, {})
            items.pop(self._key(item), None)
            if not items:
                self._runs.pop(item.run_id, None)

    def of(self, run_id: str) -> list[Unresolved]:
        """The Run's unresolved writes, begins first."""
        with self._lock:
            items = list(self._runs.get(run_id, {}).values())
        return sorted(items, key=lambda i: isinstance(i, UnresolvedExit))

    def runs(self) -> list[str]:
        """The Runs with an unresolved write that no session's exit is resolving itself."""
        with self._lock:
            return [r for r in self._runs if r not in self._claims]

    @contextlib.contextmanager
    def claim(self, run_id: str) -> Iterator[None]:
        """Resolve ``run_id``'s writes in this block, and nobody's :meth:`runs` else."""
        with self._lock:
            self._claims[run_id] = self._claims.get(run_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._claims.pop(run_id) - 1
                if left:
                    self._claims[run_id] = left
                self._unclaimed.notify_all()

    def claims_ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no Run is claimed; whether none is."""
        with self._lock:
            return self._unclaimed.wait_for(lambda: not self._claims, timeout_s)


class Store:
    """The hot path on one database: about fifteen flows, a runner and a waker.

    Built by :func:`ledger.storage.open_store` from a :class:`SqlContext` (``context``: the
    cold path's engine and hooks), the database's driver, its hot-path statements (``sql``),
    and how its queued begins learn that a slot came free (``queue_poll_s``, ``listen``).
    """

    def __init__(self, context: SqlContext, driver: Driver, sql: Statements, *,
                 queue_poll_s: float, listen: Listener | None = None) -> None:
        #: The cold path: what query objects are built on.
        self.context = context
        self.backend = context.backend
        self.where = context.where
        self.lease_margin_s = context.lease_margin_s
        self.driver = driver
        #: The threads the store's blocking calls run on for asyncio callers (never the event
        #: loop's default executor, which the host's own work needs).
        self.workers = Workers(context.where)
        #: Performs the store's flows on its database, blocking or for asyncio.
        self.runner = Runner(driver, self.workers)
        self.sql = sql
        #: Wakes this process's waiters of a full capacity group (:mod:`ledger.storage.wake`).
        self.waker = SlotWaker(context.where, queue_poll_s, listen, offload=self.workers.call)
        #: Writes whose outcome the database could not tell yet; each Run's are resolved
        #: before anything else is written for it (:meth:`resolve_run`).
        self.pending = Pending()
        self._runs = RunQueries(context)
        #: Whether :meth:`close` was called: a connection asked of it since is refused.
        self.closed = False
        #: Whether :meth:`leave_queues` ran (the ledger is closing): no begin is made since.
        self.closing = False
        #: Begins under way: the close waits for them before it gives up the places that
        #: they may take (a begin whose transaction commits after the close has left the
        #: queues would otherwise take a place nobody gives up).
        self._begins = UnderWay()
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child (:mod:`ledger.forking`): the parent's unresolved writes and
        begins under way are its own, made under its executor id, and resolved by it; this
        process starts with none. Its driver, workers and waker renew themselves."""
        self.pending = Pending()
        self._begins = UnderWay()

    def close(self) -> None:
        """Close every connection, for good: what asks for one afterwards (a call made after
        the close, or one in flight when it came) is :class:`~ledger.errors.InvalidState`.

        Then the :attr:`workers` end: a blocking call already running is waited for (up to
        the database's busy or lock timeout), the queued ones find the store closed."""
        self.closed = True
        self.waker.close()
        try:
            self.driver.close()
        finally:
            try:
                self.context.close()
            finally:
                # Last: the calls still queued then meet the closed context, not a live one.
                self.workers.close()

    # -- writes whose outcome is still unknown ---------------------------------------------

    def settle_pending(self, clock: ClockFn) -> Flow[None]:
        """Resolve every Run's unresolved writes once (the ledger's ``close()``).

        A Run session's exit that is being written (:meth:`Pending.claim`) is waited for first
        (up to :data:`CLOSE_WAITS_BEGINS_S`, then a WARNING) and left to its session. Bounded:
        one try each, and none once the database did not answer. What is left is logged at
        WARNING: recovery settles it once the lease lapses.
        """
        away: LedgerError | None = None
        # A session leaving its block writes its own exit: waited for, not written over.
        if not self.pending.claims_ended(CLOSE_WAITS_BEGINS_S):
            log.warning("closing the ledger with a Run session's exit still being written "
                        "after %ss: it is left to that session", CLOSE_WAITS_BEGINS_S)
        for run_id in self.pending.runs():
            if away is None:
                try:
                    yield from self.resolve_run(run_id, clock)
                    continue
                except LedgerError as e:
                    away = e
            for item in self.pending.of(run_id):
                log.warning("closing the ledger with %s unresolved (%s): %s", _what(item), away,
                            _left_to(item))

    def resolve_run(self, run_id: str, clock: ClockFn, *, raising: bool = False
                    ) -> Flow[None]:
        """Resolve ``run_id``'s unresolved writes, in order, before anything else is written.

        A write someone else decided first is left to them (logged at WARNING; ``raising``:
        an exit's is raised, for the session leaving its block). Raises the first
        :class:`~ledger.errors.DatabaseUnavailable`: that write and the ones after it stay,
        and nothing else may be written for the Run meanwhile.
        """
        for item in self.pending.of(run_id):
            try:
                yield from self._resolve(item, clock)
            except LedgerError as e:
                if stays(e) or (raising and isinstance(item, UnresolvedExit)):
                    raise
                log.warning("%s: not resolved here (%s); recovery or an operator settles it",
                            _what(item), e)

    def resolve_begin(self, item: UnresolvedBegin, clock: ClockFn) -> Flow[Resolution]:
        """Remember the retry owner's begin of ``item``, then resolve it at once.

        When the database does not answer, the begin's error leaves and the begin stays
        remembered: the next write for its Run, the lease keeper or ``close()`` resolves it.
        """
        self.pending.add(item)
        return (yield from self._resolve(item, clock))

    def _resolve(self, item: Unresolved, clock: ClockFn) -> Flow[Resolution]:
        """Resolve one remembered write; forget it unless the database did not answer.

        Raises what the database answered when it is no resolution (a lapsed lease for an
        exit, ...), and :class:`~ledger.errors.DatabaseUnavailable` (it stays).
        """
        try:
            if isinstance(item, UnresolvedBegin):
                out = yield from self._unsent(item, clock)
            elif isinstance(item, UnresolvedSettle):
                out = yield from self._recorded(item, clock)
            elif isinstance(item, UnresolvedAdmission | UnresolvedChildEnd):
                child = item
                out = yield from blocking(lambda: self._runs.end_unheld_child(child, clock))
            else:
                out = yield from self._exit(item, clock)
        except LedgerError as e:
            if not stays(e):
                self.pending.drop(item)
            raise
        self.pending.drop(item)
        log.log(_level(item, out), "%s: resolved (%s)", _what(item), out.value)
        return out

    def _unsent(self, item: UnresolvedBegin, clock: ClockFn) -> Flow[Resolution]:
        """Settle a begin that was never sent ``not_sent``, or learn it never landed."""
        error: LedgerError | None = None
        try:
            rec = yield from resolving(
                "settle", lambda _again: hot.settle_tx(self.sql, item.run_id, item.settle,
                                                       clock),
                run_id=item.run_id, attempt_id=item.attempt_id)
            self.waker.poke(rec.group_id)  # its slot is free: a waiter may go
        except (NotFound, InvalidState, FencedOut, SettleConflict) as e:
            error = e
        verdict = settle_verdict(error)
        if verdict is not None:
            return verdict
        att = yield from txn(lambda: hot.attempt_tx(self.sql, item.attempt_id), write=False)
        step = attempt_verdict(att, item)
        if not isinstance(step, ReceiptSpec):
            return step
        try:
            yield from blocking(lambda: self._runs.settle_unknown(step, clock))
        except InvalidState:  # someone else settled it first: as they recorded it
            att = yield from txn(lambda: hot.attempt_tx(self.sql, item.attempt_id), write=False)
            again = attempt_verdict(att, item)
            return again if isinstance(again, Resolution) else Resolution.LEFT
        return Resolution.LATE

    def _recorded(self, item: UnresolvedSettle, clock: ClockFn) -> Flow[Resolution]:
        """Write the settle the database did not take, as the turn decided it.

        The same content again is the same write, so a try that landed unseen is found done.
        An answer that refuses it decides too: the Attempt was never recorded (its begin did
        not land) or was rejected, or someone else settled it first (a takeover, an operator):
        then it is kept as a ``late_receipt`` event where a late settle is.
        """
        try:
            yield from self._settle(item.run_id, item.spec, clock)
        except NotFound:
            return Resolution.ABSENT
        except InvalidState:
            return Resolution.REJECTED
        except (FencedOut, SettleConflict) as e:
            log.warning("%s: refused (%s); what it observed is kept beside the Attempt",
                        _what(item), e)
            return Resolution.LEFT
        return Resolution.RECORDED

    def _exit(self, item: UnresolvedExit, clock: ClockFn) -> Flow[Resolution]:
        """Finish the Run as the session ended it, then release its lease (each once).

        A first try writes each as :meth:`finish_run` and :meth:`release_lease` do; once a try
        may have landed (``item.tried``), a Run already ended so, or a lease already given up,
        is the same write.
        """
        lease, status, tried = item.lease, item.status, item.tried
        try:
            if status is not None:
                ending = status
                yield from resolving("finish", lambda again: hot.finish_tx(
                    self.sql, lease, ending, clock, self.lease_margin_s, again=again or tried),
                    run_id=lease.run_id)
                item, status, tried = UnresolvedExit(lease, None), None, False
                self.pending.add(item)  # finished: the release is left
            yield from resolving("release", lambda again: hot.release_tx(
                self.sql, lease, clock, again=again or tried), run_id=lease.run_id)
        except LedgerError as e:
            if stays(e):
                self.pending.add(replace(item, tried=True))
            if status is None:
                e.fields.setdefault("finished", True)  # the Run is finished; its lease is not free
            raise
        return Resolution.FINISHED

    def _first(self, run_id: str, clock: ClockFn) -> Flow[None]:
        """What every write for ``run_id`` does first: its unresolved writes."""
        if self.pending:
            yield from self.resolve_run(run_id, clock)

    def turn_snapshot(self, run_id: str, groups: Sequence[str], keys: Sequence[str],
                      runs: Sequence[str], refs: Sequence[str], clock: ClockFn,
                      turn_id: str | None = None,
                      carried: Sequence[tuple[str, str]] | None = None) -> Flow[SnapshotRows]:
        """One read: the live row of ``run_id``, the projections of ``groups``, the health
        rows of ``keys``, the provenance of ``refs`` recorded by ``runs`` (the Run and its
        ancestors, the root last) and, with ``turn_id``, that turn's Attempts without a
        receipt. A ref is looked up in the root's whole tree by a second read unless ``runs``
        recorded it with every content hash ``carried`` (the turn's (ref, hash) pairs) holds
        for it: a Child's answer its parent or a sibling carries, or a ref several Runs of the
        tree recorded with different content (``carried`` ``None``: every ref). Raises
        :class:`~ledger.errors.NotFound` for an unknown run."""
        yield from self._first(run_id, clock)
        rows = yield from txn(lambda: hot.snapshot_tx(self.sql, run_id, groups, keys, runs, refs,
                                                      clock, turn_id), write=False)
        # Provenance rows are never rewritten nor deleted, so a later read of the rest of the
        # tree agrees with the snapshot; a turn whose parts its own line covers never pays it.
        # A ref the line recorded with other content is read in the tree too: another Run of
        # the tree may have recorded it (a reused tool-call id) with the content carried.
        wanted: dict[str, set[str]] = {}
        for ref, digest in carried or ():
            wanted.setdefault(ref, set()).add(digest)
        others = [r for r in refs if r not in rows.provenance or carried is None
                  or not wanted.get(r, set()) <= rows.provenance[r]]
        if others and runs:
            more = yield from txn(lambda: hot.tree_provenance_tx(self.sql, runs[-1], others),
                                  write=False)
            rows = replace(rows, provenance={**rows.provenance, **more})
        return rows

    def admit(self, spec: AdmitSpec, clock: ClockFn) -> Flow[tuple[RunRecord, bool]]:
        """Admit the Run of ``spec`` (:meth:`~ledger.storage.runs.RunQueries.admit`: the
        same content again returns the first record), resolving a ``COMMIT`` whose outcome
        is unknown.

        A Child's admission is a write for its parent (it carves the parent's budget under
        the parent's lease), so the parent's unresolved writes come first. When the
        ``COMMIT``'s outcome is unknown (``fields["commit"] == "unknown"``), the admission
        is run once more on a new connection: the same content again is the same Run (found,
        or admitted now; a Child's carve waits for the parent's row lock, which the old
        transaction holds until the server has ended it), and the caller gets the record as
        if nothing had happened. When that fails too, the first error leaves
        (``operation="admit"``, ``resolved=False``); for a Child it is remembered
        (:class:`~ledger.decide.resolve.UnresolvedAdmission`, ``deferred=True``): its caller
        was told the admission failed and will never run it, so as soon as the database
        answers (the parent's next write, its lease keeper, ``close()``) a Child that landed
        and that no lease held is ended ``failed`` and its carve given back."""
        parent = spec.parent_lease if spec.parent_run_id is not None else None
        if parent is not None:
            yield from self._first(parent.run_id, clock)
        try:
            return (yield from blocking(lambda: self._runs.admit(spec, clock)))
        except DatabaseUnavailable as e:
            e.fields.update(operation="admit", run_id=spec.run_id)
            if not commit_unknown(e):
                e.fields.update(resolved=True, landed=False)  # rolled back: nothing written
                raise
            e.fields.update(resolved=False, landed=None)
            first = e
        log.warning("admit: the connection was lost after its COMMIT was sent; admitting run "
                    "%s again on a new connection (%s)", spec.run_id, first)
        try:
            out = yield from blocking(lambda: self._runs.admit(spec, clock))
        except DatabaseUnavailable as second:
            first.add_note(f"resolving the admit failed too: {second}")
            if parent is not None:
                self.pending.add(unresolved_admission(parent, spec.run_id, first))
                first.fields["deferred"] = True
                first.add_note(
                    f"child run {spec.run_id} may have been admitted, its budget carved out "
                    f"of run {parent.run_id}'s; this process ends it (failed) and gives its "
                    "carve back as soon as the database answers again (before the parent's "
                    "next write, from the parent's lease keeper, or when the ledger is "
                    "closed), unless a lease took it meanwhile; admit the next Child under a "
                    "new id")
            log.warning("admit of run %s: not resolved (%s)", spec.run_id, second)
            raise first from first.__cause__
        log.warning("admit of run %s: resolved: the Run is recorded (%s)", spec.run_id,
                    "it had landed" if not out[1] else "admitted now")
        return out

    def begin_attempt(self, spec: BeginSpec, clock: ClockFn) -> Flow[AttemptRecord | Queued]:
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
        once its place comes up (with a ``capacity_wait`` event). A begin retried under a lease
        acquired again whose adoption the group refuses voids its record and frees its slot:
        the error says ``adoption=True``, and a waiter of the group here is woken. Once the
        ledger is closing (:meth:`leave_queues`), every begin is refused as after its close
        (``InvalidState``, ``problem="ledger_closed"``), writing nothing."""
        with self._begins.one():
            if self.closing:  # read once counted: a close either waits for it or is seen
                # A waiter woken between its place's removal and the close would queue anew.
                raise closed_error(self.where)
            yield from self._first(spec.run_id, clock)
            out = yield from resolving(
                "begin",
                lambda _again: hot.begin_tx(self.sql, spec, clock, self.lease_margin_s),
                again=False, run_id=spec.run_id, attempt_id=spec.attempt_id)
            if isinstance(out, Queued):
                # Owned before the begin counts as ended: the close gives up every place
                # owned once no begin is under way.
                self.waker.own(spec.attempt_id, spec.route.group)
        if isinstance(out, hot.Refusal):
            if out.freed_slot:
                self.waker.poke(spec.route.group)  # committed already: as a settle's slot
            raise out.error
        return out

    def leave_queues(self) -> Flow[None]:
        """Give up the queue places of this store's waiters (the ledger's ``close()``).

        From now on no begin is made here (:meth:`begin_attempt`): a waiter woken meanwhile
        would take a place again. The begins already under way are waited for first (up to
        :data:`CLOSE_WAITS_BEGINS_S`): one whose transaction commits after the places were
        given up would take a place nobody gives up. A place left in the table would otherwise
        count as a waiter ahead of every later one, in every process, until its Run's lease
        ended (the close releases an open session's lease after this, one try; it may lapse
        instead) or its own bound passed.
        One try each; what the database does not take is logged at WARNING and lapses that way,
        as a crashed process's places do (a database that is away: the rest are not tried).
        """
        self.closing = True
        if not self._begins.ended(CLOSE_WAITS_BEGINS_S):
            log.warning("closing the ledger with a begin still under way after %ss: a queue "
                        "place it takes lapses with its Run's lease", CLOSE_WAITS_BEGINS_S)
        for waiter, group in self.waker.queued():
            try:
                yield from self.leave_queue(waiter, group)
            except LedgerError as e:
                log.warning("closing the ledger, the place of waiter %s in group %s's queue "
                            "was not given up (it lapses with its Run's lease): %s",
                            waiter, group, e)
                if isinstance(e, DatabaseUnavailable):
                    return  # the others would wait for a database that is away, in vain

    def leave_queue(self, waiter_id: str, group: str) -> Flow[None]:
        """Give up the queue place of ``waiter_id`` (the attempt id of a queued begin) in
        ``group``, and wake the waiters behind it; without a place nothing happens."""
        yield from txn(lambda: hot.leave_queue_tx(self.sql, waiter_id, group))
        self.waker.poke(group)

    def settle_attempt(self, run_id: str, spec: SettleSpec, clock: ClockFn, *,
                       remember: bool = False) -> Flow[AttemptRecord]:
        """Record the outcome of ``spec.attempt_id`` (of ``run_id``) in one transaction: the
        hold posted or voided, the slot freed, health and the group fact applied. Settling
        again with the same content returns the settled record. Accepted under the Attempt's
        own fence while it is current, even after the lease expired. Raises
        :class:`~ledger.errors.FencedOut` once the Run was taken over and
        :class:`~ledger.errors.SettleConflict` for other content (both keep the refused
        observation as a ``late_receipt`` event when the Run moved on or the Attempt was
        settled unknown), :class:`~ledger.errors.NotFound` (no such attempt in the run).

        ``remember`` (the retry owner's settles): when the database does not take it
        (:class:`~ledger.errors.DatabaseUnavailable`, raised with ``deferred=True``), the
        settle is remembered (:class:`~ledger.decide.resolve.UnresolvedSettle`) and written
        as it is before anything else for the Run, from the lease keeper, or on ``close()``:
        the process holds the receipt, and until it is written the Attempt's slot and hold
        stay taken."""
        try:
            yield from self._first(run_id, clock)
            return (yield from self._settle(run_id, spec, clock))
        except DatabaseUnavailable as e:
            if remember:
                self.pending.add(UnresolvedSettle(run_id, spec))
                e.fields["deferred"] = True
                e.add_note(
                    f"the {spec.outcome.value} settle of attempt {spec.attempt_id} is not "
                    "recorded yet; this process records it as soon as the database answers "
                    "again (before the Run's next write, from the lease keeper, at the "
                    "session's exit, or when the ledger is closed), and until then its capacity "
                    "slot and hold stay taken; if the process ends first, recovery marks it "
                    "unknown once the lease lapses")
            raise

    def _settle(self, run_id: str, spec: SettleSpec, clock: ClockFn) -> Flow[AttemptRecord]:
        """The settle itself (see :meth:`settle_attempt`), once the Run's earlier unresolved
        writes are done."""
        try:
            rec = yield from resolving(
                "settle", lambda _again: hot.settle_tx(self.sql, run_id, spec, clock),
                run_id=run_id, attempt_id=spec.attempt_id)
        except (FencedOut, SettleConflict) as e:
            if _late(e):
                now, why = clock(), str(e)
                yield from txn(lambda: hot.late_receipt_tx(self.sql, run_id, spec, now, why))
            raise
        self.waker.poke(rec.group_id)  # its slot is free: a waiter may go
        return rec

    def mark_unknown(self, lease: Lease, attempt_id: str, clock: ClockFn,
                     reason: str) -> Flow[AttemptRecord]:
        """Settle a dispatching Attempt as unknown (sent, no receipt: the hold stays, the slot
        is freed); an Attempt already settled is returned as it is. Raises
        :class:`~ledger.errors.NotFound` (no such attempt in the lease's run),
        :class:`~ledger.errors.FencedOut` (a stale lease, or an Attempt of another fence)."""
        yield from self._first(lease.run_id, clock)
        rec = yield from txn(lambda: hot.mark_unknown_tx(self.sql, lease, attempt_id, clock,
                                                         reason))
        self.waker.poke(rec.group_id)  # its slot is free: a waiter may go
        return rec

    def attempt(self, attempt_id: str) -> Flow[AttemptRecord]:
        """One Attempt with its debit's state. Raises :class:`~ledger.errors.NotFound`."""
        return (yield from txn(lambda: hot.attempt_tx(self.sql, attempt_id), write=False))

    def acquire_lease(self, run_id: str, executor: str, ttl_s: float, clock: ClockFn
                      ) -> Flow[Lease]:
        """A lease on ``run_id`` for ``executor`` lasting ``ttl_s``: one's own live lease is
        renewed under the same fence, otherwise the fence moves on. Raises
        :class:`~ledger.errors.LeaseHeld` (another holder's unexpired lease),
        :class:`~ledger.errors.NotFound` (unknown run)."""
        yield from self._first(run_id, clock)
        return (yield from resolving(
            "acquire", lambda _again: hot.acquire_tx(self.sql, run_id, executor, ttl_s, clock,
                                                     self.lease_margin_s), run_id=run_id))

    def renew_lease(self, lease: Lease, ttl_s: float, clock: ClockFn) -> Flow[Lease]:
        """Extend a live lease to ``ttl_s`` from now. Raises :class:`~ledger.errors.LeaseLost`
        (expired or released) or :class:`~ledger.errors.FencedOut` (taken over)."""
        yield from self._first(lease.run_id, clock)
        return (yield from resolving(
            "renew", lambda _again: hot.renew_tx(self.sql, lease, ttl_s, clock,
                                                 self.lease_margin_s), run_id=lease.run_id))

    def release_lease(self, lease: Lease, clock: ClockFn) -> Flow[None]:
        """Give the lease up (again: the same write). Raises
        :class:`~ledger.errors.InvalidState` (attempts still in flight),
        :class:`~ledger.errors.LeaseLost` / :class:`~ledger.errors.FencedOut`."""
        yield from self._first(lease.run_id, clock)
        yield from resolving("release", lambda again: hot.release_tx(self.sql, lease, clock,
                                                                     again=again),
                             run_id=lease.run_id)

    def finish_run(self, lease: Lease, status: RunStatus, clock: ClockFn) -> Flow[None]:
        """Record the Run's end ``status`` under a live lease (with a ``finish`` event).
        Raises :class:`~ledger.errors.LeaseLost` / :class:`~ledger.errors.FencedOut`."""
        yield from self._first(lease.run_id, clock)
        yield from resolving("finish", lambda again: hot.finish_tx(
            self.sql, lease, status, clock, self.lease_margin_s, again=again),
            run_id=lease.run_id)

    def reserve_retry(self, lease: Lease, clock: ClockFn,
                      data: Mapping[str, Any] | None = None) -> Flow[int]:
        """Take one retry permission (``data`` is recorded with it as an event); returns how
        many are left. Raises :class:`~ledger.errors.AllowanceExhausted`, ``LeaseLost`` /
        ``FencedOut``."""
        yield from self._first(lease.run_id, clock)
        return (yield from txn(lambda: hot.reserve_retry_tx(self.sql, lease, clock,
                                                            self.lease_margin_s, dict(data or {}))))

    def record_provenance(self, lease: Lease, ref: str, content_hash: str, kind: str,
                          clock: ClockFn, *, own_attempt: bool = False) -> Flow[None]:
        """Record that ``ref`` produced content with ``content_hash`` (the same again is the
        same write). ``ref`` may be no Attempt's id (:class:`~ledger.errors.InvalidArgument`,
        ``field="ref"``: an Attempt's output is its settle's), checked in the write's
        transaction; with ``own_attempt`` it must be an Attempt of the lease's Run instead
        (:class:`~ledger.errors.NotFound`). Raises ``LeaseLost`` / ``FencedOut``."""
        yield from self._first(lease.run_id, clock)
        yield from txn(lambda: hot.provenance_tx(self.sql, lease, ref, content_hash, kind, clock,
                                                 self.lease_margin_s, own_attempt=own_attempt))

    def append_event(self, lease: Lease, attempt_id: str | None, kind: str,
                     data: Mapping[str, Any], clock: ClockFn) -> Flow[None]:
        """Append an audit event (``data`` stored as redacted JSON) under a live lease.
        Raises ``LeaseLost`` / ``FencedOut``."""
        yield from self._first(lease.run_id, clock)
        yield from txn(lambda: hot.event_tx(self.sql, lease, attempt_id, kind, data, clock,
                                            self.lease_margin_s))

    def claim_probe(self, key: str, provider: str | None, now: float, interval_s: float, *,
                    kind: str = "route", ttl_s: float | None = None,
                    max_keys: int | None = None) -> Flow[bool]:
        """Take the cluster-wide probe slot of health key ``key`` (of ``kind``: route,
        profile or provider): True for exactly one caller per ``interval_s``. A claim taken
        forgets probe times ``ttl_s`` old and keeps at most ``max_keys`` keys with one."""
        faults.point("probe.before_claim")
        return (yield from txn(lambda: hot.claim_probe_tx(
            self.sql, key, provider, now, interval_s, kind=kind, ttl_s=ttl_s,
            max_keys=max_keys)))

    def record_compaction(self, lease: Lease, clock: ClockFn) -> Flow[int]:
        """Count one compaction of the Run's session; returns the new count. Raises
        ``LeaseLost`` / ``FencedOut``."""
        yield from self._first(lease.run_id, clock)
        return (yield from txn(lambda: hot.compaction_tx(self.sql, lease, clock,
                                                         self.lease_margin_s)))


def _what(item: Unresolved) -> str:
    """An unresolved write, as a log line names it."""
    if isinstance(item, UnresolvedBegin):
        return f"the begin of attempt {item.attempt_id} (run {item.run_id}), never sent"
    if isinstance(item, UnresolvedSettle):
        # What the receipt said, for an operator settling it by hand if this process cannot.
        spec = item.spec
        return (f"the {spec.outcome.value} settle of attempt {item.attempt_id} (run "
                f"{item.run_id}; prompt_tokens={spec.prompt_tokens}, completion_tokens="
                f"{spec.completion_tokens}, cost_micros={spec.cost_micros})")
    if isinstance(item, UnresolvedAdmission):
        return (f"the admission of child run {item.child_id} (of run {item.run_id}, fence "
                f"{item.parent.fence}), told failed")
    if isinstance(item, UnresolvedChildEnd):
        return (f"the ending ({item.status.value}) of child run {item.child_id} (of run "
                f"{item.run_id}, fence {item.parent.fence}), whose entry raised; its carve is "
                "given back with it")
    return f"the exit of run {item.run_id}'s session (finish and release)"


def _level(item: Unresolved, out: Resolution) -> int:
    """How loudly the resolution ``out`` of ``item`` is logged."""
    if isinstance(item, UnresolvedExit) and not item.tried:
        # An exit is remembered every time a session ends, so its first try succeeding is
        # routine (a lost acknowledgement on the way is logged by resolving()).
        return logging.DEBUG
    if isinstance(item, UnresolvedChildEnd) and out is not Resolution.LEFT:
        # What the entry would have written itself, nothing lost or guessed: the entry's note
        # told it, and close() warns of one still not written.
        return logging.INFO
    # A begin or a settle is remembered only when the database did not take it; a Child left
    # to another holder keeps its carve.
    return logging.WARNING


def _left_to(item: Unresolved) -> str:
    """Who settles ``item`` once this process no longer can, as a log line says it."""
    if isinstance(item, UnresolvedAdmission | UnresolvedChildEnd):
        # Recovery ends no Run that nothing holds: the Child's carve waits for an operator.
        return (f"an operator ends it with `failover-ledger run close {item.child_id} "
                "--status failed`, which gives its carve back")
    return "recovery settles it once the lease lapses"


def _late(e: FencedOut | SettleConflict) -> bool:
    """A refused settle whose observation is kept: the run moved on, or the attempt was
    already settled unknown (the receipt came late)."""
    if isinstance(e, FencedOut):
        # A fence above the Run's was never granted (a lease built by hand): no receipt.
        fence, current = e.fields.get("fence"), e.fields.get("current")
        return not (isinstance(fence, int) and isinstance(current, int) and fence > current)
    return e.fields.get("state") == AttemptState.UNKNOWN.value


__all__ = ["Listener", "Pending", "Store", "commit_unknown", "resolving"]
