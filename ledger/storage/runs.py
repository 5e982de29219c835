"""Runs, groups and what happened to them: the queries of the face's cold operations.

:class:`RunQueries` is built on a :class:`~ledger.storage.context.SqlContext` by the facade
(``Ledger.admit_run``, ``get_run``, ``timeline``, ``attempts``, the group administration) and by
the operator's tools. Each method is one transaction on the context's engine (SQLAlchemy Core):
admission, the reads of Runs, Attempts, debits, health, provenance and events, the capacity
groups' settings, and the operator's writes: the settle of an unknown Attempt with evidence and
the clear of a cooldown (of a health key or a group). The hot path
(begin, settle, leases) is :class:`~ledger.storage.store.Store`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, literal, or_, select

from ledger.decide.health import canonical_key, group_closed, operator_clear
from ledger.decide.resolve import (
    COMMIT_UNKNOWN,
    UNWOUND,
    Resolution,
    UnresolvedAdmission,
    UnresolvedChildEnd,
)
from ledger.decide.settle import settle_holds
from ledger.domain.facts import FailureFact
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    DebitRecord,
    DebitState,
    EventRecord,
    Outcome,
    Page,
    RunRecord,
    RunStatus,
    budget_left,
    from_micros,
)
from ledger.domain.specs import (
    ADMISSION_FIELDS,
    AdmitSpec,
    GroupUpdate,
    ReceiptSpec,
    normal_admission_field,
)
from ledger.domain.values import GroupMode, GroupProjection, Health
from ledger.errors import (
    AdmissionConflict,
    AllowanceExhausted,
    BudgetExceeded,
    Conflict,
    InvalidArgument,
    InvalidState,
    NotFound,
)
from ledger.storage import schema as s
from ledger.storage.audit import parse_cursor
from ledger.storage.carve import give_back
from ledger.storage.context import ClockFn, SqlContext
from ledger.storage.encode import event_json, health_values
from ledger.storage.hot import check_live, moved
from ledger.storage.rows import attempt_record, health_record, run_record
from ledger.storage.statements import run_tree


def _attempts_with_debits(*where: Any) -> Any:
    """The Attempts ``where`` says, each with its debit's state, in sequence."""
    a, d = s.attempts.c, s.debits.c
    return (select(s.attempts, d.state.label("debit_state"))
            .join(s.debits, d.debit_id == a.debit_id).where(*where).order_by(a.seq))


SEL_ATTEMPT_WITH_DEBIT = (
    select(s.attempts, s.debits.c.state.label("debit_state"))
    .outerjoin(s.debits, s.debits.c.debit_id == s.attempts.c.debit_id)
    .where(s.attempts.c.attempt_id == bindparam("k_attempt_id"))
)


class RunQueries:
    """Admission, the reads of the face and the groups' settings, on one database."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx

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
        try:
            return self._admit(spec, clock)
        except Conflict as e:
            if isinstance(e, AdmissionConflict):
                raise
            # Another process admitted the same id between this one's read and its insert
            # (PostgreSQL: the row did not exist to be locked): compare with what it recorded.
            return self._admit(spec, clock)

    def _admit(self, spec: AdmitSpec, clock: ClockFn) -> tuple[RunRecord, bool]:
        with self.ctx.writing() as conn:
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
            self.ctx.add_event(conn, spec.run_id, None, "admit",
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
        check_live(parent, spec.parent_lease, now, self.ctx.lease_margin_s)
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
                run_id=spec.run_id,
                field="budget.max_calls" if spec.max_calls > calls_left else "budget.max_retries",
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
        """The Run as it stands. Raises :class:`~ledger.errors.NotFound`."""
        with self.ctx.reading() as conn:
            row = conn.execute(select(s.runs).where(s.runs.c.run_id == run_id)).first()
        if row is None:
            raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                           run_id=run_id)
        return run_record(row)

    def children(self, run_id: str) -> list[RunRecord]:
        """The Child Runs admitted under ``run_id``, oldest first (none: an empty list)."""
        with self.ctx.reading() as conn:
            rows = conn.execute(
                select(s.runs).where(s.runs.c.parent_run_id == run_id)
                .order_by(s.runs.c.created_at, s.runs.c.run_id)
            ).all()
        return [run_record(r) for r in rows]

    # -- settling an unknown Attempt with evidence ------------------------------------------

    def settle_unknown(self, spec: ReceiptSpec, clock: ClockFn) -> AttemptRecord:
        """Settle an ``unknown`` Attempt with an operator's evidence, in one transaction under
        its Run's row lock (no lease: the Run may be closed or held by nobody), taken before
        the Attempt is read, as every writer takes them (its Run's id is looked up in a read
        of its own first): the state moves
        from ``unknown`` to ``spec.outcome`` once, the hold is posted or voided by
        :func:`ledger.decide.settle.settle_holds`, the Run's counters follow, and an applied
        ``late_receipt`` event records who, what and the previous state (``spec.events`` are
        written beside it). Raises
        :class:`~ledger.errors.NotFound` (no such attempt) and
        :class:`~ledger.errors.InvalidState` (it is not ``unknown``, or was begun under another
        fence than ``spec.fence``); nothing is written then."""
        # It cannot race a live executor: only an unknown Attempt is settled here, an executor
        # never writes to one again (its repeated settle is the same write, recognised by its
        # hash), and the Run's row lock serializes this with every other write to its counters.
        a, d, r = s.attempts.c, s.debits.c, s.runs.c
        # The Run's id is read in a transaction of its own, so that the write below takes the
        # Run's row lock before it touches `attempts`, in the order every writer (and
        # retention's `runs` EXCLUSIVE, then `attempts`) takes them: reading the Attempt first
        # held `attempts` while waiting for `runs`, a deadlock on PostgreSQL with a retention
        # run in between. An Attempt never changes Run, so the id read outside stays true.
        with self.ctx.reading() as conn:
            found = conn.execute(select(a.run_id).where(a.attempt_id == spec.attempt_id)).first()
        if found is None:
            raise self._no_attempt(spec.attempt_id)
        with self.ctx.writing() as conn:
            run = conn.execute(select(r.run_id, r.max_tokens, r.selected_route)
                               .where(r.run_id == found.run_id).with_for_update()).one()
            now = clock()
            # Re-read under the lock: what was read before it may have been settled since.
            att = conn.execute(SEL_ATTEMPT_WITH_DEBIT, {"k_attempt_id": spec.attempt_id}).first()
            if att is None:  # its history was dropped in between (a retention run)
                raise self._no_attempt(spec.attempt_id)
            if att.state != AttemptState.UNKNOWN.value or att.debit_state != "reserved":
                raise InvalidState(
                    f"attempt {spec.attempt_id!r} is {att.state}, not unknown: only an unknown "
                    "attempt is settled with evidence, once (a settled one is never rewritten)",
                    attempt_id=spec.attempt_id, state=att.state)
            if spec.fence is not None and int(att.fence) != spec.fence:
                raise InvalidState(
                    f"attempt {spec.attempt_id!r} was begun under fence {att.fence}, not "
                    f"{spec.fence}: it is not the Attempt this receipt is about",
                    attempt_id=spec.attempt_id, state=att.state, fence=int(att.fence))
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
                # The evidence replaces the usage whole: the cached and reasoning parts of
                # what arrived before the cut no longer describe it.
                .values(state=spec.outcome.value, prompt_tokens=spec.prompt_tokens,
                        completion_tokens=spec.completion_tokens, cached_tokens=None,
                        reasoning_tokens=None, cost_micros=spec.cost_micros)).rowcount
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
                calls_used=r.calls_used - (1 if holds.uncount_call else 0), updated_at=now,
                # A success elsewhere, or a move recorded with it: failed over (0012's rule).
                failed_over=or_(r.failed_over, literal(
                    moved(spec.events) or (spec.outcome is Outcome.SUCCEEDED
                                           and att.route_id != run.selected_route)))))
            self.ctx.add_event(conn, run.run_id, spec.attempt_id, "late_receipt", {
                "applied": True, "by": spec.by, "note": spec.note,
                "previous_state": AttemptState.UNKNOWN.value, "outcome": spec.outcome.value,
                "prompt_tokens": spec.prompt_tokens,
                "completion_tokens": spec.completion_tokens,
                "cost": None if spec.cost_micros is None else str(from_micros(spec.cost_micros)),
                "posted": str(from_micros(holds.posted_micros)),
                "released": str(from_micros(holds.release_micros - holds.posted_micros)),
            }, now)
            for kind, data in spec.events:
                self.ctx.add_event(conn, run.run_id, spec.attempt_id, kind, data, now)
            # What the settle released of an ended Child's holds goes back to its parent.
            give_back(self.ctx, conn, run.run_id, now)
            row = conn.execute(SEL_ATTEMPT_WITH_DEBIT, {"k_attempt_id": spec.attempt_id}).one()
        return attempt_record(row, row.debit_state)

    def end_unheld_child(self, item: UnresolvedAdmission | UnresolvedChildEnd,
                         clock: ClockFn) -> Resolution:
        """End a fresh Child the process told failed, in one transaction under the Child's
        row lock, then its parent's (as a finish gives back): the Child of an admission whose
        ``COMMIT``'s outcome was unknown, or of a session entry that raised and whose own
        ending the database did not take (:class:`UnresolvedChildEnd`).

        * no such Run, looked for again under the parent's row lock (which an admission still
          committing holds, since it carved): the admission never landed (``ABSENT``);
        * the parent's fence is no longer ``item.parent``'s (the parent was taken over), or a
          lease other than the entry's held the Child (its fence is above ``item.fence``, or
          its first lease was another executor's), or it ended otherwise: someone else has it,
          nothing is written (``LEFT``);
        * still ``admitted``: it is ended ``item.status`` (a ``finish`` event, and one saying
          why: ``commit_unknown`` for an admission, ``unwound`` for an entry's ending), its
          lease released if the entry's is still on it, and its whole carve goes back to the
          parent (:func:`~ledger.storage.carve.give_back`), ``ENDED``. Found ended so already,
          it is an earlier try's doing (whose acknowledgement was lost, or whose release the
          database did not take): ``ENDED``, only a lease still held being released.

        No lease is taken on the Child: it is written under the parent's fence, as its
        admission was."""
        r = s.runs.c
        child_id, parent = item.child_id, item.parent
        took = item.fence if isinstance(item, UnresolvedChildEnd) else 0
        find = (select(r.run_id, r.parent_run_id, r.fence, r.status, r.lease_holder)
                .where(r.run_id == child_id).with_for_update())
        with self.ctx.writing() as conn:
            child = conn.execute(find).first()
            if child is None:
                # Not seen is not absent: an admission whose COMMIT is still on its way to the
                # server (its acknowledgement lost, the resolution quicker) inserted a row no
                # lock can wait on yet. It holds its parent's row (it carved): wait for it to
                # end there, then look again (each statement reads what is committed by then).
                conn.execute(select(r.fence).where(r.run_id == parent.run_id).with_for_update())
                child = conn.execute(find).first()
                if child is None:
                    return Resolution.ABSENT
            held = conn.execute(select(r.fence).where(r.run_id == parent.run_id)
                                .with_for_update()).first()
            if (held is None or int(held.fence) != parent.fence
                    or child.parent_run_id != parent.run_id or int(child.fence) > took
                    or (int(child.fence) > 0 and not self._first_lease_by(
                        conn, child_id, parent.executor))):
                return Resolution.LEFT
            now = clock()
            # The entry's lease (fence 1, this executor's: checked above) is given up with the
            # ending: the Child's block never ran, so nothing of it is in flight.
            release = ({"lease_holder": None, "lease_expires_at": None}
                       if child.lease_holder is not None else {})
            if child.status != RunStatus.ADMITTED.value:
                if child.status != item.status.value:
                    return Resolution.LEFT
                if release:
                    conn.execute(s.runs.update().where(r.run_id == child_id).values(
                        **release, updated_at=now))
                return Resolution.ENDED
            conn.execute(s.runs.update().where(r.run_id == child_id).values(
                status=item.status.value, updated_at=now, **release))
            self.ctx.add_event(conn, child_id, None, "finish", {"status": item.status.value},
                               now)
            if isinstance(item, UnresolvedChildEnd):
                self.ctx.add_event(conn, child_id, None, UNWOUND, {
                    "resolution": "ended", "parent": parent.run_id,
                    "parent_fence": parent.fence, "fence": int(child.fence)}, now)
            else:
                self.ctx.add_event(conn, child_id, None, COMMIT_UNKNOWN, {
                    "operation": "admit", "resolution": "ended", "parent": parent.run_id,
                    "parent_fence": parent.fence}, now)
            give_back(self.ctx, conn, child_id, now)
        return Resolution.ENDED

    @staticmethod
    def _first_lease_by(conn: Connection, run_id: str, executor: str) -> bool:
        """Whether the first lease ever taken on ``run_id`` (fence 1) was ``executor``'s."""
        e = s.events.c
        # As the event stored it (its strings redacted): an executor id is compared so.
        stored = json.loads(event_json({"executor": executor}))["executor"]
        for (data,) in conn.execute(select(e.data).where(e.run_id == run_id,
                                                         e.kind == "lease")):
            found = json.loads(data)
            if found.get("fence") == 1:
                return bool(found.get("executor") == stored)
        return False

    @staticmethod
    def _no_attempt(attempt_id: str) -> NotFound:
        return NotFound(f"unknown attempt id {attempt_id!r}; list unknown attempts with "
                        "`failover-ledger attempts --open`", attempt_id=attempt_id)

    # -- an operator's clear of a cooldown -------------------------------------------------

    def clear_health(self, key: str, by: str, reason: str, clock: ClockFn) -> EventRecord:
        """Clear health key ``key`` (a route, profile or ``provider:<name>``) at an operator's
        word, in one transaction under the row's lock: it is available at once and counts
        from zero (:func:`ledger.decide.health.operator_clear`), and a ``clear_cooldown``
        event (no run) records who, why and what was cleared; returns that event. Raises
        :class:`~ledger.errors.NotFound` (no row: the key never failed) and
        :class:`~ledger.errors.InvalidState` (nothing to clear); nothing is written then."""
        h = s.health.c
        with self.ctx.writing() as conn:
            row = conn.execute(select(s.health).where(h.key == key).with_for_update()).first()
            if row is None and canonical_key(key) != key:
                # provider:OpenAI names the row of provider:openai (its name is folded).
                key = canonical_key(key)
                row = conn.execute(select(s.health).where(h.key == key)
                                   .with_for_update()).first()
            if row is None:
                group = conn.execute(select(s.capacity_groups.c.group_id).where(
                    s.capacity_groups.c.group_id == key)).first()
                hint = (f"; {key!r} is a capacity group: clear it as a group (group=True; "
                        "on the command line --group)" if group is not None else
                        "; `failover-ledger health` lists the keys (route ids, profile ids, "
                        "provider:<name>)")
                raise NotFound(f"no health is recorded for key {key!r}{hint}", key=key)
            now = clock()
            found = operator_clear(health_record(row), now)
            if found is None:
                raise InvalidState(
                    f"{row.kind} {key!r} is not cooling or disabled and counts no failures: "
                    "there is nothing to clear (nothing was recorded)", key=key, state="ok")
            after, before = found
            conn.execute(s.health.update().where(h.key == key)
                         .values(**health_values(after, now)))
            return self._insert_event(conn, "clear_cooldown", {
                "key": key, "kind": row.kind, "provider": row.provider, "by": by,
                "reason": reason, "previous": before}, now)

    def clear_group(self, group: str, by: str, reason: str, clock: ClockFn) -> EventRecord:
        """Open capacity group ``group`` at an operator's word (its mode ``open``, its waiting
        floor and reason gone), with a ``clear_cooldown`` event as :meth:`clear_health`
        records one; returns the event. Raises :class:`~ledger.errors.NotFound` (no such
        group) and :class:`~ledger.errors.InvalidState` (it is open at ``now``)."""
        g = s.capacity_groups.c
        with self.ctx.writing() as conn:
            row = conn.execute(select(s.capacity_groups).where(g.group_id == group)
                               .with_for_update()).first()
            if row is None:
                raise NotFound(f"no capacity group {group!r}; `failover-ledger health` lists "
                               "the groups", group=group)
            now = clock()
            if not group_closed(row.mode, row.until, now):
                raise InvalidState(
                    f"capacity group {group!r} is open (no cooldown or waiting floor in force): "
                    "there is nothing to clear (nothing was recorded)", group=group,
                    state="open")
            conn.execute(s.capacity_groups.update().where(g.group_id == group).values(
                mode=GroupMode.OPEN.value, until=None, reason=None, sampled_at=now,
                updated_at=now))
            return self._insert_event(conn, "clear_cooldown", {
                "key": group, "kind": "group", "by": by, "reason": reason,
                "previous": {"mode": row.mode, "until": row.until, "reason": row.reason}}, now)

    def _insert_event(self, conn: Connection, kind: str, data: dict[str, Any],
                      now: float) -> EventRecord:
        """One event of no Run, written on ``conn``; returned as recorded."""
        key = conn.execute(s.events.insert().values(
            run_id=None, attempt_id=None, kind=kind, data=event_json(data), created_at=now,
        )).inserted_primary_key
        assert key is not None  # an INSERT of one row always has its key
        event_id = key[0]
        stored = conn.execute(select(s.events.c.data).where(s.events.c.event_id == event_id)
                              ).scalar_one()
        return EventRecord(int(event_id), None, None, kind, json.loads(stored), now)

    # -- groups, health, provenance, events ----------------------------------------------

    def configure_group(self, group: str, max_in_flight: int | None, now: float) -> None:
        """Create or update capacity group ``group`` with its concurrency limit (None:
        unlimited); its mode is left as it is."""
        g = s.capacity_groups.c
        with self.ctx.writing() as conn:
            stmt = self.ctx.insert_for(s.capacity_groups).values(
                group_id=group, max_in_flight=max_in_flight, mode=GroupMode.OPEN.value,
                updated_at=now,
            )
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[g.group_id],
                set_={"max_in_flight": max_in_flight, "updated_at": now},
            ))

    def set_group_mode(self, group: str, upd: GroupUpdate, now: float) -> None:
        """Set ``group``'s mode, waiting floor and reason to ``upd`` (created when unknown)."""
        with self.ctx.writing() as conn:
            g = s.capacity_groups.c
            row = conn.execute(select(s.capacity_groups).where(g.group_id == group)).first()
            if row is None:
                conn.execute(self.ctx.insert_for(s.capacity_groups).values(
                    group_id=group, mode=GroupMode.OPEN.value, updated_at=now,
                ).on_conflict_do_nothing())
            conn.execute(s.capacity_groups.update().where(g.group_id == group).values(
                mode=upd.mode.value, until=upd.until, reason=upd.reason, sampled_at=now,
                updated_at=now,
            ))

    def group_projections(self, groups: Iterable[str] | None, now: float
                          ) -> dict[str, GroupProjection]:
        """Admission's view at ``now`` of ``groups`` (None: every known group); unknown
        groups are absent."""
        with self.ctx.reading() as conn:
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
        # A place counts like a slot (schema.held_until), while its own bound has not passed.
        w = s.group_waiters.c
        r = s.runs.c
        return int(conn.execute(
            select(func.count()).select_from(s.group_waiters.join(s.runs, r.run_id == w.run_id))
            .where(w.group_id == group, w.expires_at > now, s.held_until(w.fence) > now)
        ).scalar_one())

    def _live_slots(self, conn: Connection, group: str, now: float) -> int:
        # A slot counts while its executor still holds the run (schema.held_until).
        gs = s.group_slots.c
        r = s.runs.c
        return int(conn.execute(
            select(func.count()).select_from(s.group_slots.join(s.runs, r.run_id == gs.run_id))
            .where(gs.group_id == group, s.held_until(gs.fence) > now)).scalar_one())

    def health(self, keys: Iterable[str] | None = None) -> dict[str, Health]:
        """The stored health rows of ``keys`` (None: all), as stored (not read at a time).

        A ``provider:<name>`` key also reads the row of its folded name (``provider:OpenAI``
        that of ``provider:openai``), under the key the row is stored as."""
        h = s.health.c
        with self.ctx.reading() as conn:
            q = select(s.health)
            if keys is not None:
                wanted = list(keys)
                q = q.where(h.key.in_(list(dict.fromkeys(
                    [*wanted, *map(canonical_key, wanted)]))))
            return {row.key: health_record(row) for row in conn.execute(q).all()}

    def provenance(self, run_ids: Sequence[str]) -> dict[str, set[str]]:
        """Provenance recorded by ``run_ids``: ref -> content hashes."""
        return self._provenance(s.provenance.c.run_id.in_(list(run_ids)))

    def tree_provenance(self, root: str) -> dict[str, set[str]]:
        """Provenance recorded by the Run ``root`` and all its descendants."""
        return self._provenance(s.provenance.c.run_id.in_(run_tree(literal(root))))

    def _provenance(self, which: Any) -> dict[str, set[str]]:
        p = s.provenance.c
        with self.ctx.reading() as conn:
            rows = conn.execute(select(p.ref, p.content_hash).where(which))
            out: dict[str, set[str]] = {}
            for ref, h in rows:
                out.setdefault(ref, set()).add(h)
            return out

    def events(self, run_id: str, kinds: Sequence[str] | None = None) -> list[EventRecord]:
        """The Run's events in order, optionally only of ``kinds``."""
        e = s.events.c
        with self.ctx.reading() as conn:
            q = select(s.events).where(e.run_id == run_id)
            if kinds:
                q = q.where(e.kind.in_(list(kinds)))
            rows = conn.execute(q.order_by(e.event_id)).all()
        return [EventRecord(r.event_id, r.run_id, r.attempt_id, r.kind, json.loads(r.data),
                            r.created_at) for r in rows]

    def timeline(self, run_id: str) -> list[AttemptRecord]:
        """The Run's Attempts in sequence. Raises :class:`~ledger.errors.NotFound` for an
        unknown run."""
        a = s.attempts.c
        with self.ctx.reading() as conn:
            known = conn.execute(select(s.runs.c.run_id).where(s.runs.c.run_id == run_id))
            if known.first() is None:
                raise NotFound(f"unknown run id {run_id!r}", run_id=run_id)
            rows = conn.execute(_attempts_with_debits(a.run_id == run_id)).all()
        return [attempt_record(row, row.debit_state) for row in rows]

    def turn_record(self, run_id: str, turn_id: str
                    ) -> tuple[list[AttemptRecord], list[list[dict[str, Any]]]]:
        """A turn's Attempts in sequence, and the ``skipped`` list of each of its decisions in
        order: the ``select`` events of its Attempts, then the ``stop`` events naming them.
        Read by a turn asked again while an Attempt of it has no receipt (a rare read: it
        reads the Run's decision events, however long the Run)."""
        a, e = s.attempts.c, s.events.c
        with self.ctx.reading() as conn:
            rows = conn.execute(
                _attempts_with_debits(a.run_id == run_id, a.turn_id == turn_id)).all()
            events = conn.execute(
                select(e.kind, e.attempt_id, e.data)
                .where(e.run_id == run_id, e.kind.in_(("select", "stop")))
                .order_by(e.event_id)).all()
        attempts = [attempt_record(row, row.debit_state) for row in rows]
        ids = {att.attempt_id for att in attempts}
        selects: list[list[dict[str, Any]]] = []
        stops: list[list[dict[str, Any]]] = []
        for kind, attempt_id, text in events:
            data = json.loads(text)
            if kind == "select" and attempt_id in ids:
                selects.append(list(data.get("skipped") or []))
            elif kind == "stop" and ids & set(data.get("attempts") or []):
                stops.append(list(data.get("skipped") or []))
        return attempts, selects + stops

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
        """Attempts newest first, filtered, ``limit`` per page (keyset pagination on
        ``(created_at, attempt_id)``; pass ``next_cursor`` back). Raises
        :class:`~ledger.errors.InvalidArgument` (limit out of 1..10000, malformed cursor)."""
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
        cur = parse_cursor(cursor)
        if cur is not None:
            ts, last_id = cur
            conds.append(or_(a.created_at < ts, and_(a.created_at == ts, a.attempt_id < last_id)))
        d = s.debits.c
        # The debit by its primary key, per attempt of the page (an outer join: an attempt
        # without its debit row still lists, with debit_state None).
        q = (select(s.attempts, d.state.label("debit_state"))
             .outerjoin(s.debits, d.debit_id == a.debit_id)
             .where(*conds).order_by(a.created_at.desc(), a.attempt_id.desc()))
        with self.ctx.reading() as conn:
            rows = conn.execute(q.limit(limit + 1)).all()
        items = [attempt_record(r, r.debit_state) for r in rows[:limit]]
        nxt = None
        if len(rows) > limit:
            last = rows[limit - 1]
            nxt = f"{last.created_at!r}|{last.attempt_id}"
        return Page(items, nxt)

    def debit(self, debit_id: str) -> DebitRecord:
        """One debit (an Attempt's hold). Raises :class:`~ledger.errors.NotFound`."""
        with self.ctx.reading() as conn:
            row = conn.execute(select(s.debits).where(s.debits.c.debit_id == debit_id)).first()
        if row is None:
            raise NotFound(f"unknown debit id {debit_id!r}", debit_id=debit_id)
        return DebitRecord(row.debit_id, row.run_id, row.attempt_id, DebitState(row.state),
                           from_micros(row.reserved_micros), from_micros(row.posted_micros),
                           row.created_at, row.settled_at)


__all__ = ["RunQueries"]
