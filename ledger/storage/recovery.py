"""SQL of restart-time recovery and of the reconciliation (see ``ledger.ops.recovery`` and
``ledger.ops.reconcile``): :class:`RecoveryQueries`, built on a
:class:`~ledger.storage.context.SqlContext`. Each method is one transaction on its engine.

Claiming: candidates are listed without locks; each run is then taken over in its own
transaction that locks the run row and re-checks that the lease is still expired. On PostgreSQL
the lock is ``FOR UPDATE SKIP LOCKED``: a run another recovering process (or a live writer) is
holding right now is skipped, not waited for, and is left to that process or to the next pass.
This is used only to *claim work items*; budget and capacity checks never skip locked rows.
SQLite serializes writers with ``BEGIN IMMEDIATE``, so the re-check alone suffices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, or_, select
from sqlalchemy.exc import DBAPIError

from ledger import faults
from ledger.decide.ending import ENDED, last_turn_served
from ledger.decide.settle import settle_holds
from ledger.domain.facts import FailureFact
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    DebitState,
    Lease,
    Outcome,
    RunRecord,
    RunStatus,
    budget_left,
    from_micros,
)
from ledger.domain.timefmt import when
from ledger.errors import DatabaseUnavailable, InvalidState, LeaseHeld, NotFound
from ledger.storage import schema as s
from ledger.storage.carve import give_back
from ledger.storage.context import ClockFn, SqlContext, id_chunks
from ledger.storage.encode import event_json
from ledger.storage.rows import attempt_record, run_record
from ledger.storage.wake import poke

UNFINISHED = (RunStatus.ADMITTED.value, RunStatus.RUNNING.value)
#: How long closing a Run waits for its row's lock (PostgreSQL) before it gives up.
CLOSE_LOCK_TIMEOUT = "10s"
UNKNOWN_REASON = "recovery: dispatched without a receipt (executor lease expired)"


@dataclass(frozen=True)
class Takeover:
    """What one takeover transaction did to one run (:meth:`RecoveryQueries.take_over`)."""

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
    adopted: bool = False  # already taken over by this pass (a retried, committed takeover)


@dataclass
class Figures:
    """Whole-ledger figures and the violations found by
    :meth:`RecoveryQueries.reconcile_figures`."""

    runs: int = 0
    attempts: int = 0
    by_state: dict[str, int] = field(default_factory=dict)
    debits: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Attempts whose reported cost exceeded their hold: posted at the hold (the invariant holds)
    # but the Run really cost more than it reserved; an operator needs to know.
    cost_over_hold: list[str] = field(default_factory=list)
    # Likewise for tokens: under a token budget a posted Attempt adds at most its token hold to
    # the Run's tokens_used, so reported usage past it (or any usage of a begin that held no
    # tokens) shows in the Run's counters nowhere else.
    tokens_over_hold: list[str] = field(default_factory=list)
    # Runs part of whose history retention dropped: their sums and sequences are not checked.
    trimmed: int = 0



def _expired_cond(now: float) -> Any:
    r = s.runs.c
    return and_(r.lease_holder.is_not(None), r.lease_expires_at.is_not(None),
                r.lease_expires_at <= now)


def _dispatching(conn: Connection, run_ids: list[str] | None) -> list[tuple[str, int]]:
    """(run id, fence) of every dispatching attempt: unsettled work, found through the
    attempts' state index, whatever the history's size (no join the planner could turn into a
    scan of every run or every attempt)."""
    a = s.attempts.c
    q = select(a.run_id, a.fence).where(a.state == AttemptState.DISPATCHING.value)
    if run_ids is not None:
        q = q.where(a.run_id.in_(run_ids))
    return [(row[0], int(row[1])) for row in conn.execute(q)]


def _expired(row: Any, now: float) -> bool:
    return (row.lease_holder is not None and row.lease_expires_at is not None
            and row.lease_expires_at <= now)


def _wake(ctx: SqlContext, groups: Sequence[str]) -> None:
    """Wake a waiter of this process for each slot freed (of its group), once committed: the
    waiters here hear of it at once, and a PostgreSQL listener skips this process's own
    notifications (:mod:`ledger.storage.wake`)."""
    for group in groups:
        poke(ctx.where, group)


def _event_row(run_id: str, attempt_id: str | None, kind: str, data: Mapping[str, Any],
               now: float) -> dict[str, Any]:
    return {"run_id": run_id, "attempt_id": attempt_id, "kind": kind, "data": event_json(data),
            "created_at": now}


def _own_takeovers(conn: Connection, rows: Mapping[str, Any], executor: str,
                   pass_id: str) -> dict[str, dict[str, Any]]:
    """The data of each run's latest ``recover`` event, for the runs of ``rows`` whose latest
    takeover is this pass's and still stands (its fence is the run's). Neither the lease nor
    the executor id tells: a released lease names nobody, and another pass may reuse the id."""
    if not rows:
        return {}
    e = s.events.c
    # The event stores its strings redacted: compare what it would have stored.
    mine = json.loads(event_json({"executor": executor, "pass": pass_id}))
    latest: dict[str, dict[str, Any]] = {}
    for chunk in id_chunks(sorted(rows)):
        last = (select(func.max(e.event_id)).where(e.run_id.in_(chunk), e.kind == "recover")
                .group_by(e.run_id))
        for run_id, data in conn.execute(select(e.run_id, e.data)
                                         .where(e.event_id.in_(last.scalar_subquery()))):
            latest[run_id] = json.loads(data)
    return {rid: data for rid, data in latest.items()
            if data.get("pass") == mine["pass"] and data.get("executor") == mine["executor"]
            and data.get("fence") == int(rows[rid].fence)}


def _ids(data: Mapping[str, Any] | None, key: str) -> list[str]:
    return [str(x) for x in (data or {}).get(key) or []]


def _count(data: Mapping[str, Any] | None) -> int:
    return int((data or {}).get("slots_released") or 0)


CLOSE_UNKNOWN_REASON = "closed: dispatched without a receipt (the Run was closed)"


def _money(micros: int) -> str:
    """An amount the books store in micro-units, in currency units as every report shows it."""
    return format(from_micros(micros), "f")


def _reported_tokens(att: Any) -> int | None:
    """The tokens the Attempt's settle reported (prompt and completion), ``None``: none."""
    if att.prompt_tokens is None and att.completion_tokens is None:
        return None
    return int(att.prompt_tokens or 0) + int(att.completion_tokens or 0)


def _expected_post(att: Any, reserved_micros: int, token_budget: bool) -> int:
    """What settle posts for this attempt (the same pure rule settle applied)."""
    fact = FailureFact.model_validate_json(att.fact) if att.fact else None
    tokens = _reported_tokens(att)
    return settle_holds(Outcome(att.state), fact, cost_micros=att.cost_micros, tokens=tokens,
                        reserved_micros=reserved_micros, reserved_tokens=att.reserved_tokens,
                        token_budget=token_budget).posted_micros


class RecoveryQueries:
    """Restart-time recovery and the reconciliation, on one database."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx

    def expired_runs(self, now: float, limit: int,
                     run_ids: list[str] | None = None) -> list[str]:
        """Up to ``limit`` runs (of ``run_ids``, or all) whose executor lease expired by
        ``now`` and that are unfinished or still have an Attempt dispatching, oldest expiry
        first."""
        r = s.runs.c
        with self.ctx.reading() as conn:
            q = select(r.run_id, r.lease_expires_at).where(r.status.in_(UNFINISHED),
                                                          _expired_cond(now))
            if run_ids is not None:
                q = q.where(r.run_id.in_(run_ids))
            found = {row[0]: row[1] for row in conn.execute(q)}
            busy = sorted({rid for rid, _ in _dispatching(conn, run_ids)} - found.keys())
            for chunk in id_chunks(busy):
                found.update((row[0], row[1]) for row in conn.execute(
                    select(r.run_id, r.lease_expires_at)
                    .where(r.run_id.in_(chunk), _expired_cond(now))))
        return sorted(found, key=lambda rid: (found[rid], rid))[:limit]

    def take_over(self, run_ids: Sequence[str], executor: str, ttl_s: float, now: float,
                  *, release: bool, pass_id: str,
                  adopt: bool = False) -> tuple[list[Takeover], list[str]]:
        """Take the expired runs of ``run_ids`` over for ``executor`` in one transaction: new
        fences, dispatching Attempts unknown (holds kept), unsent holds voided (an ended Child
        gives what that releases back to its parent), slots freed (once committed, each wakes
        a waiter of its group in this process); the new lease lasts ``ttl_s`` (or is released
        at once with ``release``). Each ``recover`` event carries ``pass_id``, the recovery
        pass's id. ``adopt`` also reports the runs this pass already took over (a retried
        takeover whose commit landed), found by their latest ``recover`` event (this pass's,
        under the run's current fence) whether the lease was kept or released, with what that
        takeover marked unknown, voided and freed. Returns the takeovers and the runs not (or
        no longer) to take."""
        r = s.runs.c
        a = s.attempts.c
        d = s.debits.c
        gs = s.group_slots.c
        with self.ctx.writing() as conn:
            q = self.ctx.claiming(select(s.runs).where(r.run_id.in_(list(run_ids))))
            rows = {row.run_id: row for row in conn.execute(q)}
            ours = _own_takeovers(conn, rows, executor, pass_id) if adopt else {}
            take = [rows[i] for i in run_ids if i in rows and _expired(rows[i], now)]
            # A takeover of this pass whose commit succeeded but whose acknowledgement was lost:
            # its lease still held, or released (a released lease names nobody, so only the
            # event can tell).
            adopted = [rows[i] for i in run_ids
                       if i in ours and not _expired(rows[i], now)
                       and rows[i].lease_holder in (None, executor)]
            ids = [row.run_id for row in take]
            fence = {row.run_id: int(row.fence) + 1 for row in take}
            in_flight: dict[str, list[str]] = {i: [] for i in ids}
            voided: dict[str, list[str]] = {i: [] for i in ids}
            release_micros: dict[str, int] = dict.fromkeys(ids, 0)
            release_tokens: dict[str, int] = dict.fromkeys(ids, 0)
            slots: dict[str, int] = dict.fromkeys(ids, 0)
            freed: list[str] = []  # the group of each slot freed
            if ids:
                for att_id, rid in conn.execute(
                    select(a.attempt_id, a.run_id)
                    .where(a.run_id.in_(ids), a.state == AttemptState.DISPATCHING.value)
                    .order_by(a.run_id, a.seq)
                ):
                    in_flight[rid].append(att_id)
                # Every dispatching attempt was recorded before its request could leave the
                # process, and the ledger records nothing between begin and send: it may have been
                # sent. Unknown, keeping its hold (invariant 6). Never re-sent by recovery.
                marks = [{"k_id": att_id, "k_fence": fence[rid]}
                         for rid, atts in in_flight.items() for att_id in atts]
                if marks:
                    conn.execute(
                        s.attempts.update().where(a.attempt_id == bindparam("k_id"))
                        .values(state=AttemptState.UNKNOWN.value, settled_at=now,
                                settle_fence=bindparam("k_fence")), marks)
                # Holds the ledger can prove were never sent: attempts refused at begin (rejected)
                # or settled as not sent, whose debit is somehow still reserved. The write path
                # voids these itself, so this only repairs; it never touches a dispatching attempt.
                for debit_id, rid, micros, tokens in conn.execute(
                    select(d.debit_id, d.run_id, d.reserved_micros, a.reserved_tokens)
                    .select_from(s.debits.join(s.attempts, a.attempt_id == d.attempt_id))
                    .where(d.run_id.in_(ids), d.state == DebitState.RESERVED.value,
                           a.state.in_([AttemptState.REJECTED.value, AttemptState.NOT_SENT.value]))
                ):
                    voided[rid].append(debit_id)
                    release_micros[rid] += int(micros)
                    release_tokens[rid] += int(tokens or 0)
                unsent = [x for v in voided.values() for x in v]
                if unsent:
                    conn.execute(s.debits.update().where(d.debit_id.in_(unsent))
                                 .values(state=DebitState.VOIDED.value, settled_at=now))
                holder, expires = (None, None) if release else (executor, now + ttl_s)
                conn.execute(
                    s.runs.update().where(r.run_id == bindparam("k_run")).values(
                        fence=bindparam("k_fence"), updated_at=now, lease_holder=holder,
                        lease_expires_at=expires,
                        reserved_micros=r.reserved_micros - bindparam("k_release"),
                        tokens_reserved=r.tokens_reserved - bindparam("k_release_tokens")),
                    [{"k_run": i, "k_fence": fence[i], "k_release": release_micros[i],
                      "k_release_tokens": release_tokens[i]} for i in ids])
                # An ended Child gave back what it had left when it ended, its stray holds
                # kept carved as still held: what the repair released goes back now, as a
                # later settle's release does. Before the slot rows below: every writer locks
                # Runs (a Child, then its parent) before group rows.
                for rid in ids:
                    if voided[rid]:
                        give_back(self.ctx, conn, rid, now)
                # Capacity slots of the dead executor: all of the run's (the new fence has none).
                for rid, group in conn.execute(s.group_slots.delete().where(gs.run_id.in_(ids))
                                               .returning(gs.run_id, gs.group_id)):
                    slots[rid] += 1
                    freed.append(group)
                events = [_event_row(rid, att_id, "unknown",
                                     {"reason": UNKNOWN_REASON, "fence": fence[rid]}, now)
                          for rid, atts in in_flight.items() for att_id in atts]
                events += [_event_row(row.run_id, None, "recover", {
                    "executor": executor, "previous": row.lease_holder,
                    "previous_fence": int(row.fence), "fence": fence[row.run_id],
                    "unknown": in_flight[row.run_id], "voided": voided[row.run_id],
                    "slots_released": slots[row.run_id], "released": release,
                    "pass": pass_id,
                }, now) for row in take]
                conn.execute(s.events.insert(), events)
            reported = ids + [row.run_id for row in adopted]
            timelines: dict[str, list[AttemptRecord]] = {i: [] for i in reported}
            after: dict[str, Any] = {}
            if reported:
                for row in conn.execute(select(s.runs).where(r.run_id.in_(reported))):
                    after[row.run_id] = row
                for x in conn.execute(
                    select(s.attempts, d.state.label("debit_state"))
                    .join(s.debits, d.debit_id == a.debit_id)
                    .where(a.run_id.in_(reported)).order_by(a.run_id, a.seq)
                ):
                    timelines[x.run_id].append(attempt_record(x, x.debit_state))
            # A run this pass took over before, and now again (its kept lease expired while
            # the retry waited): what the pass did to it is both takeovers' work.
            before = {row.run_id: ours[row.run_id] for row in take if row.run_id in ours}
            out = [Takeover(
                run_id=row.run_id,
                previous_executor=before[row.run_id].get("previous")
                if row.run_id in before else row.lease_holder,
                previous_fence=int(before[row.run_id].get("previous_fence", row.fence)
                                   if row.run_id in before else row.fence),
                lease=None if release else Lease(row.run_id, executor, fence[row.run_id],
                                                 now + ttl_s),
                fence=fence[row.run_id],
                newly_unknown=_ids(before.get(row.run_id), "unknown") + in_flight[row.run_id],
                voided=_ids(before.get(row.run_id), "voided") + voided[row.run_id],
                slots_released=_count(before.get(row.run_id)) + slots[row.run_id],
                attempts=timelines[row.run_id], selected_route=after[row.run_id].selected_route,
                current_route=after[row.run_id].current_route, status=after[row.run_id].status,
            ) for row in take]
            out += [Takeover(
                run_id=row.run_id, previous_executor=ours[row.run_id].get("previous"),
                previous_fence=int(ours[row.run_id].get("previous_fence", 0)),
                lease=None if row.lease_holder is None
                else Lease(row.run_id, executor, int(row.fence), row.lease_expires_at),
                fence=int(row.fence), newly_unknown=_ids(ours[row.run_id], "unknown"),
                voided=_ids(ours[row.run_id], "voided"),
                slots_released=_count(ours[row.run_id]),
                attempts=timelines[row.run_id], selected_route=row.selected_route,
                current_route=row.current_route, status=row.status, adopted=True,
            ) for row in adopted]
            faults.point("recover.before_commit")
        _wake(self.ctx, freed)
        faults.point("recover.after_commit")
        taken = {t.run_id for t in out}
        return out, [i for i in run_ids if i not in taken]

    def orphaned_runs(self, limit: int, run_ids: list[str] | None = None) -> list[str]:
        """Up to ``limit`` runs (of ``run_ids``, or all) that have Attempts dispatching under
        a fence older than the run's."""
        r = s.runs.c
        with self.ctx.reading() as conn:
            oldest: dict[str, int] = {}
            for rid, fence in _dispatching(conn, run_ids):
                oldest[rid] = min(fence, oldest.get(rid, fence))
            orphaned: list[str] = []
            for chunk in id_chunks(sorted(oldest)):
                orphaned += [row[0] for row in conn.execute(
                    select(r.run_id, r.fence).where(r.run_id.in_(chunk)))
                    if oldest[row[0]] < row[1]]
        return sorted(orphaned)[:limit]

    def mark_orphans(self, run_id: str, now: float) -> list[str]:
        """Mark ``run_id``'s orphaned Attempts unknown (holds kept, slots freed, each waking a
        waiter of its group in this process once committed) without taking the run from its
        executor; returns their ids."""
        r = s.runs.c
        a = s.attempts.c
        gs = s.group_slots.c
        with self.ctx.writing() as conn:
            row = conn.execute(self.ctx.claiming(
                select(r.run_id, r.fence).where(r.run_id == run_id))).first()
            if row is None:
                return []
            ids = [x[0] for x in conn.execute(
                select(a.attempt_id).where(a.run_id == run_id, a.fence < row.fence,
                                           a.state == AttemptState.DISPATCHING.value)
                .order_by(a.seq))]
            freed: list[str] = []
            if ids:
                conn.execute(s.attempts.update().where(a.attempt_id.in_(ids)).values(
                    state=AttemptState.UNKNOWN.value, settled_at=now, settle_fence=row.fence))
                freed = list(conn.execute(s.group_slots.delete().where(gs.attempt_id.in_(ids))
                                          .returning(gs.group_id)).scalars())
                for att_id in ids:
                    self.ctx.add_event(conn, run_id, att_id, "unknown", {
                        "reason": "recovery: dispatched under a fence that was taken over, "
                                  "without a receipt", "fence": int(row.fence)}, now)
        _wake(self.ctx, freed)
        return ids

    def close_run(self, run_id: str, executor: str, status: RunStatus, reason: str,
                  clock: ClockFn, by: str | None = None) -> tuple[RunRecord, bool]:
        """End ``run_id`` with ``status`` under a fresh fence, in one transaction: dispatching
        Attempts unknown (holds kept), slots freed (once committed, each wakes a waiter of its
        group in this process), the lease released, a ``close`` event with ``reason`` and who
        closed it (``by``, default ``executor``). Returns the Run and
        whether it changed (``False``: it had already been closed with ``status``; a Run its
        block ended with ``status`` has no ``close`` yet and is closed). Raises
        :class:`~ledger.errors.NotFound`, :class:`~ledger.errors.LeaseHeld` (a live executor
        other than ``executor`` holds it) and :class:`~ledger.errors.InvalidState` (it ended
        with another status, or
        ``succeeded`` asked of a Run whose last turn was not served)."""
        r = s.runs.c
        a = s.attempts.c
        d = s.debits.c
        e = s.events.c
        gs = s.group_slots.c
        with self.ctx.writing() as conn:
            row = self._lock_to_close(conn, run_id)
            if row is None:
                raise NotFound(f"unknown run id {run_id!r}; list runs with `failover-ledger runs`",
                               run_id=run_id)
            now = clock()
            live = row.lease_holder is not None and (row.lease_expires_at or 0) > now
            if live and row.lease_holder != executor:
                raise LeaseHeld(
                    f"run {run_id!r} is held by the live executor {row.lease_holder!r}, its "
                    f"lease expiring {when(float(row.lease_expires_at), now)}; it is still being "
                    "worked on: let it finish, or stop that executor and close the run once its "
                    "lease has expired",
                    run_id=run_id, holder=row.lease_holder, expires_at=row.lease_expires_at)
            if row.status in {x.value for x in ENDED}:
                # A Run its block ended is not closed (the same id continues it); only a
                # ``close`` event makes it final. Its status stays what its block said.
                closed = conn.execute(select(e.event_id).where(
                    e.run_id == run_id, e.kind == "close").limit(1)).first() is not None
                if row.status != status.value:
                    what = ("a closed Run is not closed again with another status (close it "
                            f"with --status {row.status}, which changes nothing)" if closed else
                            "a Run its block ended is closed with the status it ended with "
                            f"(--status {row.status}), which records the close and keeps it "
                            "from being resumed")
                    raise InvalidState(f"run {run_id!r} already ended {row.status}; {what}",
                                       run_id=run_id, status=row.status,
                                       requested=status.value)
                if closed:
                    return run_record(row), False
            atts = [attempt_record(x, x.debit_state) for x in conn.execute(
                select(s.attempts, d.state.label("debit_state"))
                .join(s.debits, d.debit_id == a.debit_id)
                .where(a.run_id == run_id).order_by(a.seq))]
            if status is RunStatus.SUCCEEDED:
                stops = [t for (t,) in conn.execute(
                    select(e.created_at).where(e.run_id == run_id, e.kind == "stop"))]
                if not last_turn_served(atts, stops):
                    raise InvalidState(
                        f"run {run_id!r} cannot be closed succeeded: its last turn was not served "
                        "(or it made no Attempt); close it failed, stopped or cancelled",
                        run_id=run_id, status=row.status, requested=status.value)
            fence = int(row.fence) + 1
            dispatching = [x.attempt_id for x in atts if x.state is AttemptState.DISPATCHING]
            if dispatching:
                # Sent, for all the ledger knows (invariant 6): unknown, the hold kept, never
                # resent.
                conn.execute(s.attempts.update().where(a.attempt_id.in_(dispatching)).values(
                    state=AttemptState.UNKNOWN.value, settled_at=now, settle_fence=fence))
            freed = list(conn.execute(s.group_slots.delete().where(gs.run_id == run_id)
                                      .returning(gs.group_id)).scalars())
            conn.execute(s.runs.update().where(r.run_id == run_id).values(
                status=status.value, fence=fence, lease_holder=None, lease_expires_at=None,
                updated_at=now))
            held = [x.attempt_id for x in atts
                    if x.state in (AttemptState.UNKNOWN, AttemptState.DISPATCHING)]
            events = [_event_row(run_id, att_id, "unknown",
                                 {"reason": CLOSE_UNKNOWN_REASON, "fence": fence}, now)
                      for att_id in dispatching]
            events.append(_event_row(run_id, None, "close", {
                "status": status.value, "reason": reason, "by": by or executor,
                "executor": executor,
                "previous": row.lease_holder, "previous_status": row.status,
                "previous_fence": int(row.fence), "fence": fence, "unknown": dispatching,
                "holds_kept": held, "slots_released": len(freed)}, now))
            conn.execute(s.events.insert(), events)
            # A closed Child never uses what it has left again: its parent gets it back.
            give_back(self.ctx, conn, run_id, now)
            after = conn.execute(select(s.runs).where(r.run_id == run_id)).one()
        _wake(self.ctx, freed)
        return run_record(after), True

    def _lock_to_close(self, conn: Connection, run_id: str) -> Any:
        """The Run's row, locked; on PostgreSQL waiting at most :data:`CLOSE_LOCK_TIMEOUT`.
        A transaction left open on it (an executor paused or stuck mid-write: ``idle in
        transaction``) would otherwise keep an operator's close waiting for as long as it
        lasts, with nothing said."""
        query = select(s.runs).where(s.runs.c.run_id == run_id).with_for_update()
        if not self.ctx.bounded_locks(conn, CLOSE_LOCK_TIMEOUT):
            return conn.execute(query).first()  # BEGIN IMMEDIATE's busy timeout bounds it
        try:
            return conn.execute(query).first()
        except DBAPIError as e:
            if getattr(e.orig, "sqlstate", None) != "55P03":
                raise
            raise DatabaseUnavailable(
                f"run {run_id!r} was not closed: its row stayed locked for "
                f"{CLOSE_LOCK_TIMEOUT} by another session's transaction in progress (an "
                "executor paused or stuck in the middle of a write); nothing changed. Close it "
                "again once that transaction ends; to find the session, SELECT pid, state, "
                "xact_start, query FROM pg_stat_activity WHERE state LIKE 'idle in "
                "transaction%' (a paused process: resume or stop it; a stuck one: "
                "pg_terminate_backend(pid))",
                url=self.ctx.where, run_id=run_id, contention="55P03") from e

    def past_deadline_runs(self, now: float, limit: int, run_ids: list[str] | None = None,
                           executor: str | None = None) -> list[str]:
        """Up to ``limit`` unfinished runs (of ``run_ids``, or all) whose deadline is past at
        ``now`` and that no live executor other than ``executor`` holds, oldest deadline
        first."""
        r = s.runs.c
        free = or_(r.lease_holder.is_(None), r.lease_expires_at.is_(None),
                   r.lease_expires_at <= now)
        if executor is not None:
            free = or_(free, r.lease_holder == executor)
        q = (select(r.run_id).where(r.status.in_(UNFINISHED), r.deadline.is_not(None),
                                    r.deadline <= now, free)
             .order_by(r.deadline, r.run_id).limit(limit))
        if run_ids is not None:
            q = q.where(r.run_id.in_(run_ids))
        with self.ctx.reading() as conn:
            return [row[0] for row in conn.execute(q)]

    @staticmethod
    def _trimmed(conn: Connection, runs: Sequence[Any],
                 by_run_att: Mapping[str, Sequence[Any]]) -> set[str]:
        """The Runs retention may have dropped history of: admitted before the latest
        ``retention`` event's cut-off, ended, and with no open Attempt (retention keeps every
        row of the others, and drops no row newer than its cut-off)."""
        e = s.events.c
        cutoffs = [json.loads(d).get("cutoff") for d in conn.execute(
            select(e.data).where(e.kind == "retention")).scalars()]
        cut = max((c for c in cutoffs if isinstance(c, int | float)), default=None)
        if cut is None:
            return set()
        live = {RunStatus.ADMITTED.value, RunStatus.RUNNING.value}
        open_ = {AttemptState.UNKNOWN.value, AttemptState.DISPATCHING.value}
        return {run.run_id for run in runs if run.created_at < cut and run.status not in live
                and not any(a.state in open_ for a in by_run_att.get(run.run_id, ()))}

    def reconcile_figures(self, now: float) -> Figures:
        """Check every ledger-wide invariant on one consistent snapshot; writes nothing."""
        g = s.capacity_groups.c
        fig = Figures()
        v = fig.violations
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            runs = conn.execute(select(s.runs)).all()
            fig.runs = len(runs)
            by_run_att: dict[str, list[Any]] = {}
            for row in conn.execute(select(s.attempts)):
                by_run_att.setdefault(row.run_id, []).append(row)
            debits = {row.debit_id: row for row in conn.execute(select(s.debits))}
            gs = s.group_slots.c
            slots = conn.execute(
                select(s.group_slots, s.held_until(gs.fence).label("held_until"))
                .select_from(s.group_slots.outerjoin(s.runs, s.runs.c.run_id == gs.run_id))).all()
            limits = {row.group_id: row.max_in_flight for row in conn.execute(
                select(g.group_id, g.max_in_flight))}
            fig.attempts = sum(len(x) for x in by_run_att.values())
            for x in by_run_att.values():
                for att in x:
                    fig.by_state[att.state] = fig.by_state.get(att.state, 0) + 1
            for drow in debits.values():
                fig.debits[drow.state] = fig.debits.get(drow.state, 0) + 1
            attempt_ids = {att.attempt_id for x in by_run_att.values() for att in x}
            trimmed = self._trimmed(conn, runs, by_run_att)
            fig.trimmed = len(trimmed)
            for drow in debits.values():
                if drow.attempt_id not in attempt_ids and drow.run_id not in trimmed:
                    v.append(f"debit {drow.debit_id} has no attempt")
            run_by_id = {row.run_id: row for row in runs}
            for run in runs:
                atts = by_run_att.get(run.run_id, [])
                reserved = posted = calls = held_tokens = 0
                seqs = sorted(att.seq for att in atts)
                whole = run.run_id not in trimmed
                if whole and seqs != list(range(1, len(seqs) + 1)):
                    v.append(f"run {run.run_id}: attempt seqs not 1..n: {seqs}")
                for att in atts:
                    deb = debits.get(att.debit_id)
                    where = f"run {run.run_id} attempt {att.attempt_id}"
                    if deb is None:
                        v.append(f"{where}: no debit")
                        continue
                    if deb.attempt_id != att.attempt_id or deb.run_id != run.run_id:
                        v.append(f"{where}: debit {deb.debit_id} belongs elsewhere")
                    if deb.reserved_micros != att.reserved_micros:
                        v.append(f"{where}: debit hold {_money(deb.reserved_micros)} != "
                                 f"attempt's {_money(att.reserved_micros)}")
                    st = att.state
                    expected = {
                        AttemptState.DISPATCHING.value: {DebitState.RESERVED.value},
                        AttemptState.UNKNOWN.value: {DebitState.RESERVED.value},
                        AttemptState.REJECTED.value: {DebitState.VOIDED.value},
                        AttemptState.SUCCEEDED.value: {DebitState.POSTED.value},
                        AttemptState.FAILED.value: {DebitState.POSTED.value,
                                                    DebitState.VOIDED.value},
                        AttemptState.NOT_SENT.value: {DebitState.VOIDED.value},
                    }.get(st)
                    if expected is None:
                        v.append(f"{where}: unknown state {st!r}")
                    elif deb.state not in expected:
                        v.append(f"{where}: {st} attempt with a {deb.state} debit")
                    if st != AttemptState.DISPATCHING.value and att.settled_at is None:
                        v.append(f"{where}: {st} without settled_at")
                    if st not in (AttemptState.REJECTED.value, AttemptState.NOT_SENT.value):
                        calls += 1
                    if att.cost_micros is not None and att.cost_micros > att.reserved_micros:
                        fig.cost_over_hold.append(
                            f"{where}: reported cost {_money(att.cost_micros)} above its hold "
                            f"{_money(att.reserved_micros)} (posted at the hold)")
                    if deb.state == DebitState.RESERVED.value:
                        reserved += deb.reserved_micros
                        held_tokens += att.reserved_tokens
                    elif deb.state == DebitState.POSTED.value:
                        if deb.posted_micros > deb.reserved_micros:
                            v.append(f"{where}: posted {_money(deb.posted_micros)} above its "
                                     "hold")
                        posted += deb.posted_micros
                        used = _reported_tokens(att)
                        if run.max_tokens is not None and used is not None \
                                and used > att.reserved_tokens:
                            fig.tokens_over_hold.append(
                                f"{where}: reported tokens {used} above its hold "
                                f"{att.reserved_tokens} (posted at the hold)")
                        if deb.posted_micros != _expected_post(att, deb.reserved_micros,
                                                               run.max_tokens is not None):
                            v.append(f"{where}: posted {_money(deb.posted_micros)} != the "
                                     "settled cost")
                    elif deb.posted_micros:
                        v.append(f"{where}: a {deb.state} debit posted "
                                 f"{_money(deb.posted_micros)}")
                    if att.fence > run.fence or (att.settle_fence or 0) > run.fence:
                        v.append(f"{where}: written under a fence above the run's")
                # A trimmed Run (some Attempts dropped by retention) has no sums to check.
                if whole and reserved != run.reserved_micros:
                    v.append(f"run {run.run_id}: reserved counter {_money(run.reserved_micros)} "
                             f"!= sum of reserved debits {_money(reserved)}")
                if whole and posted != run.posted_micros:
                    v.append(f"run {run.run_id}: posted counter {_money(run.posted_micros)} "
                             f"!= sum of posted debits {_money(posted)}")
                if whole and calls != run.calls_used:
                    v.append(f"run {run.run_id}: calls_used {run.calls_used} != {calls} attempts")
                if held_tokens != run.tokens_reserved:
                    v.append(f"run {run.run_id}: tokens_reserved {run.tokens_reserved} != sum of "
                             f"held token reserves {held_tokens}")
                # What an ended Child gave back counts as used: it never uses it again.
                left = budget_left(run)
                if left.tokens is not None and left.tokens < 0:
                    v.append(f"run {run.run_id}: held+used tokens above the token budget")
                if left.calls < 0:
                    v.append(f"run {run.run_id}: calls {run.calls_used} above allowance")
                if left.retries < 0:
                    v.append(f"run {run.run_id}: retries {run.retries_used} above allowance")
                if left.micros < 0:
                    v.append(f"run {run.run_id}: reserved+posted above the cost budget")
                if run.parent_run_id is None and (run.returned_calls or run.returned_retries
                                                  or run.returned_micros or run.returned_tokens):
                    v.append(f"run {run.run_id}: gave back a carve but has no parent")
                if run.parent_run_id is not None and run.parent_run_id not in run_by_id:
                    v.append(f"run {run.run_id}: parent {run.parent_run_id} missing")
            # Children's budgets come out of the parent's carve, less what they gave back
            # (their token budgets only of a parent with a token budget).
            carved: dict[str, list[int]] = {}
            for run in runs:
                if run.parent_run_id is not None:
                    par = run_by_id.get(run.parent_run_id)
                    c = carved.setdefault(run.parent_run_id, [0, 0, 0, 0])
                    c[0] += run.max_calls - run.returned_calls
                    c[1] += run.max_retries - run.returned_retries
                    c[2] += run.max_cost_micros - run.returned_micros
                    if par is not None and par.max_tokens is not None:
                        c[3] += (run.max_tokens or 0) - run.returned_tokens
            for pid, (calls, retries, micros, tokens) in carved.items():
                par = run_by_id.get(pid)
                if par is None:
                    continue
                carved_now = (par.carved_calls, par.carved_retries, par.carved_micros,
                              par.carved_tokens)
                if carved_now != (calls, retries, micros, tokens):
                    v.append(f"run {pid}: carved (calls, retries, micros, tokens) {carved_now} "
                             f"!= its children's budgets less what they gave back "
                             f"{(calls, retries, micros, tokens)}")
            # Slots: only dispatching attempts hold one; live ones never exceed a group's limit.
            states = {att.attempt_id: att.state for x in by_run_att.values() for att in x}
            live: dict[str, int] = {}
            for slot in slots:
                st = states.get(slot.attempt_id)
                if st != AttemptState.DISPATCHING.value:
                    v.append(f"slot of attempt {slot.attempt_id} held by a {st} attempt")
                if slot.held_until is not None and slot.held_until > now:
                    live[slot.group_id] = live.get(slot.group_id, 0) + 1
            for grp, n in live.items():
                lim = limits.get(grp)
                if lim is not None and n > lim:
                    v.append(f"group {grp}: {n} live slots above its limit {lim}")
            # Events: every recovered unknown attempt has its event (audit trail).
            ev = s.events.c
            unknown_events = {row[0] for row in conn.execute(
                select(ev.attempt_id).where(ev.kind == "unknown"))}
            for x in by_run_att.values():
                for att in x:
                    if att.state == AttemptState.UNKNOWN.value and att.settle_hash is None \
                            and att.attempt_id not in unknown_events:
                        v.append(f"attempt {att.attempt_id}: unknown without an 'unknown' event")
        return fig

    def event_counts(self, kinds: list[str]) -> dict[str, int]:
        """How many events of each of ``kinds`` the ledger holds."""
        ev = s.events.c
        with self.ctx.reading() as conn:
            rows = conn.execute(select(ev.kind, func.count()).where(ev.kind.in_(kinds))
                                .group_by(ev.kind)).all()
        out = {k: 0 for k in kinds}
        out.update({k: int(n) for k, n in rows})
        return out

__all__ = ["Figures", "RecoveryQueries", "Takeover"]
