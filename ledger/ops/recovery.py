"""Restart-time recovery: fence dead executors and say exactly what was in flight.

:func:`recover` finds Runs whose executor lease expired (and that are not finished, or still
have an Attempt dispatching), and takes them over, a batch of runs per transaction:

* the run's fence is bumped, so the dead executor (should it wake up) can write nothing;
* every Attempt still ``dispatching`` becomes ``unknown`` and **keeps its debit hold**. The
  Attempt row was committed before its request could leave the process, and the ledger records
  nothing between begin and send, so a dispatching Attempt may have been executed remotely: not
  observing success is not proof of no remote execution. Recovery never re-sends it;
* holds the ledger can *prove* were never sent (an Attempt refused at begin, or settled as a
  failure before send) are voided should any still be reserved; the write path voids these
  itself, so in a healthy ledger this finds nothing. A live executor that knows its request
  never left (e.g. shutting down before the send) settles it as a ``before_send`` failure, which
  voids the hold: that knowledge exists only in the process, never in the ledger;
* capacity slots held by the dead executor are released (they already stopped counting when its
  lease expired);
* Attempts left dispatching under an older fence of a run that another executor already
  re-acquired (without recovery) are orphans: they become unknown too, keeping their holds,
  without taking the run from its current executor;
* route health, probes and group cooldowns are left as they are.

With ``close_past_deadline=True`` it then closes every unfinished Run whose deadline has passed
and that no live executor holds (those it just took over included, and those an earlier pass
recovered and nobody resumed): each is ended ``failed`` as :meth:`ledger.Ledger.close_run`
ends a Run, under a fresh fence, with a ``close`` event saying it was past its deadline; its
unknown Attempts keep their holds.

It returns, per Run, the settled and unknown Attempts, the route to continue on (the route of
the last success, else the originally selected one) and the new :class:`Lease` (or none, with
``release=True``). Running it twice, from several processes at once, or again after it was
interrupted or after the database restarted under it is safe: each takeover is one
transaction (of up to ``batch`` runs), and a run is taken only while its lease is expired.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from ledger.api.arguments import LeaseTtl
from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.face import storage_of
from ledger.clock import Sleeper, SystemSleeper
from ledger.decide.settle import check_lease_ttl
from ledger.domain.records import AttemptRecord, AttemptState, Lease, RunStatus
from ledger.domain.validation import (
    Flag,
    Id,
    IdList,
    checked,
    function,
    instance,
    integers,
    methods,
)
from ledger.domain.values import new_id
from ledger.errors import DatabaseUnavailable, InvalidState, LeaseHeld
from ledger.storage.recovery import RecoveryQueries, Takeover

DEFAULT_RECOVERY_TTL_S = 30.0
DEFAULT_LIMIT = 1000
# Runs taken over per transaction: one commit and a few statements per batch, not per run; a
# batch holds its runs' row locks until it commits, so it stays small.
DEFAULT_BATCH = 100
MAX_BATCH = 1000
# Retries of one takeover after DatabaseUnavailable, with these waits (seconds).
RETRY_WAITS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class RunRecovery:
    """What recovery found and did for one Run.

    Attributes:
        run_id: The Run taken over.
        previous_executor: Who held its lease before (``None``: nobody).
        previous_fence: Its fence before; ``fence`` is the new one.
        fence: The Run's new fence.
        lease: The recovering executor's new lease (``None`` with ``release=True``).
        newly_unknown: Attempts this pass marked unknown (their holds kept).
        voided: The debits (ids) of provably unsent Attempts whose holds this pass voided.
        slots_released: Capacity slots of the dead executor released.
        settled: The Run's Attempts that succeeded or failed.
        unknown: The Run's unknown Attempts (never sent again).
        selected_route: The route admitted as the first choice.
        current_route: The route of the last success, if any.
        status: The Run's status.
    """

    run_id: str
    previous_executor: str | None
    previous_fence: int
    fence: int
    lease: Lease | None
    newly_unknown: list[str]
    voided: list[str]
    slots_released: int
    settled: list[AttemptRecord]
    unknown: list[AttemptRecord]
    selected_route: str
    current_route: str | None
    status: str

    @property
    def route(self) -> str:
        """The actual route to continue on: the last successful one, else the selected one."""
        return self.current_route or self.selected_route

    def to_json(self) -> dict[str, Any]:
        """The recovery as JSON data (``failover-ledger recover --json``)."""
        return {
            "run_id": self.run_id,
            "previous_executor": self.previous_executor,
            "previous_fence": self.previous_fence,
            "fence": self.fence,
            "lease": None if self.lease is None else {
                "executor": self.lease.executor, "fence": self.lease.fence,
                "expires_at": self.lease.expires_at,
            },
            "newly_unknown": self.newly_unknown,
            "voided": self.voided,
            "slots_released": self.slots_released,
            "settled": [{"attempt_id": a.attempt_id, "turn_id": a.turn_id, "route": a.route_id,
                         "state": a.state.value} for a in self.settled],
            "unknown": [{"attempt_id": a.attempt_id, "turn_id": a.turn_id, "route": a.route_id,
                         "reserved": str(a.reserved)} for a in self.unknown],
            "selected_route": self.selected_route,
            "current_route": self.current_route,
            "route": self.route,
            "status": self.status,
        }


@dataclass
class RecoveryReport:
    """The result of one :func:`recover` pass.

    Attributes:
        executor: The recovering executor's id.
        now: When the pass began (the ledger clock's time).
        runs: One :class:`RunRecovery` per Run taken over.
        skipped: Runs not taken over (or, past their deadline, not closed): their row was
            locked by another session's transaction (another recovery, or an executor in
            the middle of a write, perhaps paused), or another process took them over or
            renewed their lease first. The next pass tries them again.
        orphans: Runs held by a live executor that still had Attempts dispatching under an
            older fence: run id -> those Attempts, now unknown.
        retries: Takeovers retried after :class:`~ledger.errors.DatabaseUnavailable`.
        closed: With ``close_past_deadline``: the Runs past their deadline this pass closed
            (``failed``), oldest deadline first.
    """

    executor: str
    now: float
    runs: list[RunRecovery] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # locked, or taken meanwhile
    # Runs held by a live executor that still had Attempts dispatching under an older fence
    # (its lease was acquired directly after expiry): those Attempts, now unknown.
    orphans: dict[str, list[str]] = field(default_factory=dict)
    retries: int = 0  # takeovers retried after DatabaseUnavailable
    closed: list[str] = field(default_factory=list)  # past their deadline, closed failed

    @property
    def unknown_attempts(self) -> int:
        """How many Attempts this pass marked unknown, each a possibly billed request.

        Those of the Runs it took over and the orphans of Runs it left to their executors.
        """
        return (sum(len(r.newly_unknown) for r in self.runs)
                + sum(len(ids) for ids in self.orphans.values()))

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data (``failover-ledger recover --json``)."""
        return {
            "executor": self.executor, "now": self.now,
            "recovered": len(self.runs), "newly_unknown": self.unknown_attempts,
            "skipped": self.skipped, "retries": self.retries, "orphans": self.orphans,
            "closed": self.closed, "runs": [r.to_json() for r in self.runs],
        }


def _to_run(t: Takeover) -> RunRecovery:
    settled = [a for a in t.attempts if a.state in (AttemptState.SUCCEEDED, AttemptState.FAILED)]
    unknown = [a for a in t.attempts if a.state is AttemptState.UNKNOWN]
    return RunRecovery(
        run_id=t.run_id, previous_executor=t.previous_executor, previous_fence=t.previous_fence,
        fence=t.fence, lease=t.lease, newly_unknown=t.newly_unknown, voided=t.voided,
        slots_released=t.slots_released, settled=settled, unknown=unknown,
        selected_route=t.selected_route, current_route=t.current_route, status=t.status,
    )


@checked
def recover(
    ledger: Annotated[Ledger, instance(Ledger, "a ledger.Ledger", "pass a ledger.Ledger "
                                       "(arecover takes an AsyncLedger)")],
    *,
    executor_id: Id | None = None,
    lease_ttl_s: LeaseTtl = DEFAULT_RECOVERY_TTL_S,
    limit: Annotated[int, integers(1, fix="pass an integer of at least 1, e.g. 1000")]
    = DEFAULT_LIMIT,
    batch: Annotated[int, integers(1, MAX_BATCH, f"pass e.g. {DEFAULT_BATCH} (an integer from 1 "
                                   f"to {MAX_BATCH})")] = DEFAULT_BATCH,
    release: Flag = False,
    run_ids: IdList | None = None,
    sleeper: Annotated[Sleeper, methods("sleep", fix="pass e.g. SystemSleeper()")] | None = None,
    progress: Annotated[Callable[[int, int], None], function("a function of (done, total)")]
    | None = None,
    close_past_deadline: Flag = False,
) -> RecoveryReport:
    """Take over every Run whose executor lease expired; see the module docstring.

    A takeover interrupted by :class:`~ledger.errors.DatabaseUnavailable` is retried (it was
    rolled back, or it committed and is then recognised as this pass's by the Runs' latest
    ``recover`` events, whose ``pass`` names the pass, whether the leases were kept or
    released: those Runs are reported as recovered, with the Attempts that takeover marked
    unknown, the holds it voided and the slots it freed), waiting 0.1 s to 8 s between tries;
    if the database stays away, the error is raised and a later pass resumes where this one
    stopped. Several processes may recover at once.

    Args:
        ledger: The :class:`~ledger.Ledger` (an :class:`~ledger.AsyncLedger` goes with
            :func:`arecover`).
        executor_id: Names the recovering executor (default: a fresh id).
        lease_ttl_s: The lease the recovering executor takes on each Run (at most 86 400 s;
            above the ledger's lease margin unless ``release``, as for
            :meth:`~ledger.Ledger.acquire_lease`).
        limit: At most this many Runs per pass (at least 1).
        batch: Runs taken over per transaction, 1 to 1000 (default 100): all or none of a
            batch, each Run under its own new fence.
        release: Release each lease right after the takeover (the fence stays bumped)
            instead of holding it for ``lease_ttl_s``.
        run_ids: Recover only these Runs.
        sleeper: Waits between retries (a :class:`~ledger.ManualClock` in tests).
        progress: Called as ``progress(done, total)`` after each batch, for a progress
            display.
        close_past_deadline: Then close every unfinished Run whose deadline has passed and
            that no live executor holds: ended ``failed`` under a fresh fence, with a
            ``close`` event (see :meth:`ledger.Ledger.close_run`); listed in ``closed``. A
            Run another executor holds (or takes meanwhile) is left alone.

    Returns:
        The :class:`RecoveryReport`: per Run, what was settled and what is unknown, and the
        route to continue on.

    Raises:
        InvalidArgument: an argument is wrong (nothing is read or written then).
        DatabaseUnavailable: the database stayed unreachable through every retry.

    Example:
        >>> report = recover(led, release=True)  # doctest: +SKIP
        >>> for run in report.runs:  # doctest: +SKIP
        ...     print(run.run_id, run.route, [a.attempt_id for a in run.unknown])
    """
    if not release:
        check_lease_ttl(lease_ttl_s, ledger.lease_margin_s, field="lease_ttl_s",
                        fix="use a longer lease_ttl_s (or release the leases)")
    run_ids = None if run_ids is None else list(run_ids)
    executor = executor_id or new_id("recover")
    # Names this pass in its recover events: how a retry knows a committed takeover as its own
    # (an executor id may be reused by another pass, and a released lease names nobody).
    pass_id = new_id("pass")
    sleeper = sleeper or SystemSleeper()
    now = ledger.now()
    report = RecoveryReport(executor=executor, now=now)
    store = RecoveryQueries(storage_of(ledger).context)
    candidates = _retrying(lambda: store.expired_runs(now, limit, run_ids), sleeper, report)
    for start in range(0, len(candidates), batch):
        chunk = candidates[start:start + batch]
        first = [True]

        def attempt(chunk: list[str] = chunk, first: list[bool] = first,
                    ) -> tuple[list[Takeover], list[str]]:
            adopt = not first[0]  # a retry may find its own committed takeover
            first[0] = False
            return store.take_over(chunk, executor, lease_ttl_s, ledger.now(),
                                   release=release, pass_id=pass_id, adopt=adopt)

        taken, skipped = _retrying(attempt, sleeper, report)
        report.runs.extend(_to_run(t) for t in taken)
        report.skipped.extend(skipped)
        if progress is not None:
            progress(len(report.runs) + len(report.skipped), len(candidates))
    orphaned = _retrying(lambda: store.orphaned_runs(limit, run_ids), sleeper, report)
    for run_id in orphaned:
        ids = _retrying(lambda run_id=run_id: store.mark_orphans(run_id, ledger.now()),
                        sleeper, report)
        if ids:
            report.orphans[run_id] = ids
    if close_past_deadline:
        _close_past_deadline(store, report, ledger.now, limit, run_ids, sleeper)
    return report


def _close_past_deadline(store: RecoveryQueries, report: RecoveryReport, clock: Callable[[], float],
                         limit: int, run_ids: list[str] | None, sleeper: Sleeper) -> None:
    """Close the unfinished Runs past their deadline that nobody holds (or this pass holds)."""
    due = _retrying(lambda: store.past_deadline_runs(clock(), limit, run_ids,
                                                     report.executor), sleeper, report)
    why = f"recovery: past its deadline with nobody to resume it (closed by {report.executor})"
    for run_id in due:
        try:
            _rec, changed = _retrying(
                lambda run_id=run_id: store.close_run(run_id, report.executor,
                                                      RunStatus.FAILED, why, clock),
                sleeper, report, locked_run=run_id)
        except (LeaseHeld, InvalidState):
            continue  # resumed or ended meanwhile: no longer ours to close
        except DatabaseUnavailable as e:
            if e.fields.get("run_id") != run_id:
                raise
            report.skipped.append(run_id)  # its row stayed locked: left to the next pass
            continue
        if changed:
            report.closed.append(run_id)


def _retrying(fn: Any, sleeper: Sleeper, report: RecoveryReport,
              locked_run: str | None = None) -> Any:
    for wait in (*RETRY_WAITS, None):
        try:
            return fn()
        except DatabaseUnavailable as e:
            # A Run whose row another session's transaction held through the lock timeout
            # is not retried: each retry would wait the whole timeout again.
            if wait is None or (locked_run is not None and e.fields.get("run_id") == locked_run):
                raise
            report.retries += 1
            sleeper.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


@checked
async def arecover(ledger: Annotated[AsyncLedger, instance(
        AsyncLedger, "a ledger.AsyncLedger", "pass a ledger.AsyncLedger (recover takes a "
        "Ledger)")], **kwargs: Any) -> RecoveryReport:
    """The async twin of :func:`recover`: the same implementation, on the ledger's threads.

    It runs on one of the ledger's own threads (``ledger-cold``), never on the event loop's
    default executor, which the host's own work needs.

    Args:
        ledger: The :class:`~ledger.AsyncLedger`.
        **kwargs: The keyword arguments of :func:`recover`.

    Returns:
        The :class:`RecoveryReport`.

    Raises:
        InvalidArgument: ``ledger`` is not an AsyncLedger, or an argument of :func:`recover`
            is wrong.
        DatabaseUnavailable: the database stayed unreachable through every retry.
    """
    return await storage_of(ledger).workers.call(recover, ledger.sync, **kwargs)


__all__ = ["RecoveryReport", "RunRecovery", "arecover", "recover"]
