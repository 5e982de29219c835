"""The hot path's transactions, written once for every driver (see :mod:`ledger.storage.driver`).

A turn touches the database exactly here: one :func:`snapshot_tx` read, then per Attempt one
:func:`begin_tx` and one :func:`settle_tx`. Each is a generator yielding the statements of
:mod:`ledger.storage.statements` (``sql``: compiled once for the store's database) with their
parameters by name; it never asks which database it runs on. The rules these
transactions apply — is the lease live, what a settle does to a hold, a health row, a group —
are pure functions (``ledger.decide.settle``); here they meet the rows, under the run row's
lock (PostgreSQL ``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE`` already serializes writers), and
always after it: the clock is read once the lock is granted, and read again after a limited
group's slots, so a decision is recorded at the time it was taken.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from ledger import faults
from ledger.decide.ending import ENDED, closed_refusal, missing_refusal, trimmed_refusal
from ledger.decide.settle import lease_problem, settle_holds
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    DebitState,
    Lease,
    Outcome,
    Queued,
    RunStatus,
    budget_left,
    carve_return,
    from_micros,
)
from ledger.domain.specs import BeginSpec, GroupUpdate, HealthUpdate, SettleSpec
from ledger.domain.timefmt import when
from ledger.domain.values import GroupMode, GroupProjection, Health
from ledger.errors import (
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
from ledger.redaction import redact
from ledger.storage import schema as s
from ledger.storage.driver import Flush, Q, Tx
from ledger.storage.encode import event_json, fact_json, health_values
from ledger.storage.rows import SnapshotRows, attempt_record, health_record, written_attempt
from ledger.storage.statements import HEALTH_READ, QUEUE_CHANNEL, Statements, Stmt

ClockFn = Callable[[], float]
_ENDED = frozenset(x.value for x in ENDED)

# The attempt's columns, in the schema's order (a settle's record is built from them).
ATTEMPT_COLS = tuple(s.attempts.c.keys())
# The health record's columns, as the settle's read carries them (prefixed ``h_``).
HEALTH_COLS = tuple(c.name for c in HEALTH_READ)


def _ns(stmt: Stmt, row: Sequence[Any]) -> SimpleNamespace:
    """A row of ``stmt`` with its columns as attributes."""
    return SimpleNamespace(**dict(zip(stmt.columns, row, strict=True)))


# -- the lease rule ----------------------------------------------------------------------------


def check_fence(row: Any, run_id: str, fence: int) -> None:
    if row.fence < fence:
        # No grant made this fence: the lease was not one acquire_lease returned.
        raise FencedOut(
            f"run {run_id!r} is held under fence {row.fence}; fence {fence} was never granted: "
            "pass the lease acquire_lease returned, not one built by hand",
            run_id=run_id, fence=fence, current=row.fence,
        )
    if row.fence != fence:
        raise FencedOut(
            f"run {run_id!r} is now held under fence {row.fence}; this executor's fence "
            f"{fence} is stale: stop working on the run (another executor took it over)",
            run_id=run_id, fence=fence, current=row.fence,
        )


def check_live(row: Any, lease: Lease, now: float, margin_s: float) -> None:
    """Raise unless ``lease`` is live at ``now`` on the locked run ``row`` (fence checked)."""
    check_fence(row, lease.run_id, lease.fence)
    problem = lease_problem(row.lease_holder, row.lease_expires_at, lease.executor, now,
                            margin_s)
    if problem == "released":
        raise LeaseLost(
            f"the lease on run {lease.run_id!r} (fence {lease.fence}) was released; acquire "
            "it again before starting more work on the run",
            run_id=lease.run_id, fence=lease.fence, reason=problem)
    if problem == "expired":
        raise LeaseLost(
            f"the lease on run {lease.run_id!r} (fence {lease.fence}) expired at "
            f"{row.lease_expires_at} (now {now}, margin {margin_s:g}s); acquire it again (the "
            "fence moves on) before starting more work on the run",
            run_id=lease.run_id, fence=lease.fence, reason=problem,
            expires_at=row.lease_expires_at)
    if problem == "holder":
        raise FencedOut(
            f"run {lease.run_id!r} is held by {row.lease_holder!r}, not {lease.executor!r}",
            run_id=lease.run_id, fence=lease.fence, current=row.fence)


def _locked(rows: list[Any], stmt: Stmt, run_id: str) -> SimpleNamespace:
    if not rows:
        raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                       run_id=run_id)
    return _ns(stmt, rows[0])


def _lock_live(stmt: Stmt, lease: Lease, clock: ClockFn,
               margin: float) -> Tx[tuple[SimpleNamespace, float]]:
    row = _locked((yield Q(stmt, {"run_id": lease.run_id})), stmt, lease.run_id)
    now = clock()
    check_live(row, lease, now, margin)
    return row, now


# -- the read of a decision --------------------------------------------------------------------


def tree_provenance_tx(sql: Statements, root: str, refs: Sequence[str]
                       ) -> Tx[dict[str, frozenset[str]]]:
    """The provenance of ``refs`` recorded by the Run ``root`` or any of its descendants."""
    rows = yield Flush((Q(sql.tree_provenance, {"root": root, "refs": sql.list_param(refs)}),),
                       commit=True)
    prov: dict[str, set[str]] = {}
    for ref, digest in rows[0]:
        prov.setdefault(ref, set()).add(digest)
    return {k: frozenset(v) for k, v in prov.items()}


def snapshot_tx(sql: Statements, run_id: str, groups: Sequence[str], keys: Sequence[str],
                runs: Sequence[str], refs: Sequence[str], clock: ClockFn,
                turn_id: str | None = None) -> Tx[SnapshotRows]:
    """The read of a decision; with ``turn_id`` (a turn's first read) also that turn's
    Attempts sent before it and still without a receipt."""
    listed = sql.list_param(groups)
    items = [Q(sql.run_live, {"run_id": run_id}),
             Q(sql.groups, {"groups": listed}),
             Q(sql.group_slots, {"groups": listed}),
             Q(sql.health, {"keys": sql.list_param(keys)})]
    if refs:
        items.append(Q(sql.provenance, {"runs": sql.list_param(runs),
                                        "refs": sql.list_param(refs)}))
    if turn_id is not None:
        items.append(Q(sql.unreceipted, {"run_id": run_id, "turn_id": turn_id}))
    # The read is the whole transaction: its COMMIT goes with it (one round trip on
    # PostgreSQL instead of a second one for the COMMIT alone).
    res = yield Flush(tuple(items), commit=True)
    now = clock()
    run = _locked(res[0], sql.run_live, run_id)
    expiries: dict[str, list[float]] = {}
    for gid, exp in res[2]:
        if exp is not None:
            expiries.setdefault(gid, []).append(float(exp))
    projections: dict[str, GroupProjection] = {}
    for gid, limit, mode_text, until, sampled in res[1]:
        mode = GroupMode(mode_text)
        if mode is not GroupMode.OPEN and until is not None and until <= now:
            mode = GroupMode.OPEN  # the waiting floor has passed
        projections[gid] = GroupProjection(
            group=gid, mode=mode, until=until,
            sampled_at=sampled if sampled is not None else now,
            in_flight=sum(1 for e in expiries.get(gid, ()) if e > now) if limit is not None
            else 0, limit=limit)
    health = {row[0]: health_record(_ns(sql.health, row)) for row in res[3]}
    prov: dict[str, set[str]] = {}
    for ref, digest in (res[4] if refs else ()):
        prov.setdefault(ref, set()).add(digest)
    unreceipted = (tuple(row[0] for row in sorted(res[-1], key=lambda row: int(row[1])))
                   if turn_id is not None else ())
    return SnapshotRows(run, projections, health, {k: frozenset(v) for k, v in prov.items()}, now,
                        unreceipted)


# -- begin -------------------------------------------------------------------------------------


def begin_tx(sql: Statements, spec: BeginSpec, clock: ClockFn, margin: float
             ) -> Tx[AttemptRecord | Queued | Refusal]:
    """Record an Attempt before it is sent (see ``Store.begin_attempt``).

    With ``spec.queue_until`` a full group queues the begin instead (:class:`Queued`, nothing
    recorded as an Attempt); the same begin again, once its place comes up, records it. A
    refusal by the group is committed, then returned as a :class:`Refusal` (its error is the
    caller's to raise).
    """
    lease = Lease(spec.run_id, spec.executor or "", spec.fence, 0.0)
    locked, looked = yield Flush((
        Q(sql.lock_run, {"run_id": spec.run_id}),
        # Its own statement, after the lock: in READ COMMITTED it sees every begin of this run
        # that committed while this one waited (a locking statement's other reads would not).
        Q(sql.begin_lookup, {"run_id": spec.run_id, "attempt_id": spec.attempt_id,
                             "group": spec.route.group}),
    ))
    run = _locked(locked, sql.lock_run, spec.run_id)
    now = clock()
    check_live(run, lease, now, margin)
    next_seq, prior, g_id, g_limit, g_mode, g_until = looked[0]
    missing = missing_refusal(spec.run_id, int(run.calls_used), int(next_seq))
    if missing is not None:
        raise missing
    if prior is not None:
        return (yield from _begin_again(sql, spec, run, lease, now, clock, margin,
                                        (g_id, g_limit, g_mode, g_until)))
    _check_allowances(spec, run)
    adm = yield from _admit(sql, spec, (g_id, g_limit, g_mode, g_until), now, clock)
    if adm.now != now:
        now = adm.now  # recorded at the time of the capacity decision: live then too
        check_live(run, lease, now, margin)
    if adm.queued:
        return (yield from _enqueue(sql, spec, adm))
    rejected = adm.rejected
    state = AttemptState.REJECTED if rejected else AttemptState.DISPATCHING
    debit_id = "d-" + spec.attempt_id
    values = {
        "attempt_id": spec.attempt_id, "run_id": spec.run_id, "tenant": spec.tenant,
        "labels": run.labels, "turn_id": spec.turn_id, "seq": next_seq, "kind": spec.kind.value,
        "route_id": spec.route.id, "provider": spec.route.provider, "model": spec.route.model,
        "group_id": spec.route.group, "profile_id": spec.profile_id, "debit_id": debit_id,
        "envelope_hash": spec.envelope_hash, "state": state.value,
        "reject_reason": redact(rejected[0]) if rejected else None, "effective_output": False,
        "tool_started": False, "reserved_micros": spec.reserve_micros,
        "reserved_tokens": 0 if rejected else spec.reserve_tokens,
        "begin_hash": spec.begin_hash, "fence": spec.fence, "executor": spec.executor,
        "created_at": now, "settled_at": now if rejected else None,
    }
    debit_state = DebitState.VOIDED if rejected else DebitState.RESERVED
    writes = [
        Q(sql.insert_debit, {"debit_id": debit_id, "run_id": spec.run_id,
                             "attempt_id": spec.attempt_id, "state": debit_state.value,
                             "reserved_micros": spec.reserve_micros, "created_at": now,
                             "settled_at": now if rejected else None}),
        Q(sql.insert_attempt, values),
    ]
    events = [_event(spec.run_id, spec.attempt_id, k, d, now) for k, d in spec.events]
    if adm.place is not None and adm.place.live:
        # The wait is recorded once, with the Attempt it ended in.
        events.append(_event(spec.run_id, spec.attempt_id, "capacity_wait", {
            "group": spec.route.group, "limit": adm.limit, "ticket": adm.place.ticket,
            "waited_s": round(max(0.0, now - adm.place.enqueued_at), 6),
            "outcome": "rejected" if rejected else "admitted"}, now))
    if adm.leaving:
        writes.append(Q(sql.drop_waiters, {"group": spec.route.group,
                                           "tickets": sql.list_param(adm.leaving)}))
    if rejected:
        events.append(_event(spec.run_id, spec.attempt_id, "reject", {
            "reason": rejected[0], "until": rejected[1], "group": spec.route.group}, now))
    elif not adm.numbered:
        writes.append(Q(sql.insert_slot, {"attempt_id": spec.attempt_id,
                                          "group_id": spec.route.group, "run_id": spec.run_id,
                                          "fence": spec.fence, "acquired_at": now}))
    if events:
        writes.append(Q(sql.insert_event, events, many=True))
    writes.append(Q(sql.begin_run, {
        "run_id": spec.run_id, "calls": 0 if rejected else 1,
        "retries": 1 if spec.take_retry else 0,
        "reserve": 0 if rejected else spec.reserve_micros,
        "reserve_tokens": 0 if rejected else spec.reserve_tokens,
        "status": RunStatus.RUNNING.value, "now": now, "moved": moved(spec.events)}))
    faults.point("begin.before_commit")
    yield Flush(sql.writes(writes), commit=True)
    faults.point("begin.after_commit")
    record = written_attempt(values, debit_state.value)
    if rejected:
        return Refusal(_refused(spec, adm, rejected, record.seq), freed_slot=False)
    return record


@dataclass(frozen=True, slots=True)
class Refusal:
    """A begin its capacity group refused, recorded and committed: ``error`` is what its
    caller is told; ``freed_slot``: the refusal freed a slot of the group (a refused adoption
    gives up the slot the Attempt held under its old fence), so a waiter may go."""

    error: CapacityUnavailable
    freed_slot: bool


def _refused(spec: BeginSpec, adm: _Admission, rejected: tuple[str, float | None],
             seq: int | None, *, adoption: bool = False) -> CapacityUnavailable:
    reason, until = rejected
    # The limit, when the group has one: a host sizing its groups reads it here, as a turn
    # reads it from its queue timeout. A refusal for fullness also says how many were in flight.
    limit = {} if adm.limit is None else {"limit": int(adm.limit)}
    full = reason == "capacity_full" and adm.limit is not None
    said = f"{reason}: limit {adm.limit}, {adm.in_flight} in flight" if full else reason
    return CapacityUnavailable(
        f"capacity group {spec.route.group!r} refused attempt {spec.attempt_id!r} "
        f"({said}); it was recorded as rejected, its hold voided, nothing sent",
        attempt_id=spec.attempt_id, group=spec.route.group, reason=reason,
        until=until, seq=seq, route=spec.route.id, **limit,
        **({"in_flight": adm.in_flight} if full else {}),
        # The caller learns the refusal voided an Attempt it had begun before.
        **({"adoption": True} if adoption else {}),
    )


def _check_allowances(spec: BeginSpec, run: Any) -> None:
    left = budget_left(run)
    if left.calls <= 0:
        carved = run.carved_calls
        raise AllowanceExhausted(
            f"run {spec.run_id!r} has used its model-call allowance "
            f"({run.calls_used} of {run.max_calls}"
            + (f", and {carved} carved for its children" if carved else "")
            + "); nothing was sent",
            run_id=spec.run_id, route=spec.route.id, field="calls",
        )
    if spec.take_retry and left.retries <= 0:
        raise AllowanceExhausted(
            f"run {spec.run_id!r} has no retry permission left ({run.retries_used} of "
            f"{run.max_retries} used); every further attempt of a turn takes one",
            run_id=spec.run_id, route=spec.route.id, field="retries",
        )
    if spec.reserve_micros > left.micros:
        raise BudgetExceeded(
            f"a hold of {from_micros(spec.reserve_micros)} would overdraw run "
            f"{spec.run_id!r} (left: {from_micros(left.micros)}); nothing was sent",
            run_id=spec.run_id, route=spec.route.id, field="cost",
            requested=str(from_micros(spec.reserve_micros)),
            available=str(from_micros(left.micros)),
        )
    if left.tokens is not None and spec.reserve_tokens > left.tokens:
        raise BudgetExceeded(
            f"a hold of {spec.reserve_tokens} tokens would overdraw the token budget of run "
            f"{spec.run_id!r} (left: {left.tokens}); nothing was sent",
            run_id=spec.run_id, route=spec.route.id, field="tokens",
            requested=spec.reserve_tokens, available=left.tokens,
        )


@dataclass(frozen=True)
class _Place:
    """A waiter's place in a group's queue, as read under the group's lock."""

    ticket: int
    waiter_id: str
    enqueued_at: float
    live: bool


@dataclass(frozen=True)
class _Admission:
    """What admission decided for one begin, and what it leaves to write.

    ``rejected``: (reason, floor) when refused; ``queued``: full, and the begin waits in the
    queue; ``place``: the begin's own place, if it had one; ``leaving``: tickets to drop (the
    begin's own once it is served or refused, and dead places found on the way).
    """

    now: float
    rejected: tuple[str, float | None] | None = None
    queued: bool = False
    place: _Place | None = None
    leaving: tuple[int, ...] = ()
    ahead: int = 0
    in_flight: int = 0
    limit: int | None = None
    numbered: bool = False  # the begin's slot row is written already, with its number


def _admit(sql: Statements, spec: BeginSpec, looked: tuple[Any, Any, Any, Any], now: float,
           clock: ClockFn) -> Tx[_Admission]:
    """Whether the group admits one more attempt, refuses it, or queues it.

    A limited group admits a begin while its live slots plus the live places ahead of the
    begin's own (all of them, for a begin without a place) stay below its limit: first come,
    first served across processes.
    """
    group = spec.route.group
    g_id, limit, mode, until = looked
    if g_id is None:
        # A group nobody configured yet: create its row (open, unlimited), then decide on it.
        [_, [(mode, until, limit)]] = yield Flush((
            Q(sql.ensure_group, {"group": group, "now": now}),
            Q(sql.lock_group, {"group": group})))
    elif limit is not None:
        if sql.spelling.numbers_slots:
            fast = yield from _admit_numbered(sql, spec, int(limit), mode, until, now, clock)
            if fast is not None:
                return fast
        # Only a limited group's row is locked: its slot count must be serialized; reading the
        # mode of an unlimited group without it keeps busy groups from serializing begins.
        [(mode, until, limit)] = yield Q(sql.lock_group, {"group": group})
    if limit is None:
        if mode != GroupMode.OPEN.value and (until is None or until > now):
            return _Admission(now, rejected=("group_" + mode, until))
        return _Admission(now)
    while True:
        # The slots and places first, the clock after: a slot released (or a lease that
        # lapsed) before this decision is then also before it in recorded time.
        slots, waiting = yield Flush((Q(sql.slot_expiries, {"group": group}),
                                      Q(sql.waiters, {"group": group})))
        now = max(now, clock())
        places = [_Place(int(t), w, float(at), float(exp) > now
                         and held is not None and float(held) > now)
                  for t, w, at, exp, held in waiting]
        mine = next((p for p in places if p.waiter_id == spec.attempt_id), None)
        dead = tuple(p.ticket for p in places if not p.live)
        leaving = tuple(sorted({*dead, *((mine.ticket,) if mine is not None else ())}))
        if mode != GroupMode.OPEN.value and (until is None or until > now):
            return _Admission(now, rejected=("group_" + mode, until), place=mine,
                              leaving=leaving, limit=limit)
        in_flight = sum(1 for _a, _n, e in slots if e is not None and float(e) > now)
        live = [p for p in places if p.live]
        ahead = (sum(1 for p in live if p.ticket < mine.ticket)
                 if mine is not None and mine.live else len(live))
        # A place past its own bound is no longer live, and admits as a newcomer would
        # (behind everyone); the waiters ahead of it are still only those with an earlier
        # ticket, and that is the count its stop reports, not the waiters behind it.
        shown = (sum(1 for p in live if p.ticket < mine.ticket) if mine is not None
                 else len(live))
        if in_flight + ahead >= limit:
            break
        if not sql.spelling.numbers_slots:
            return _Admission(now, place=mine, leaving=leaving, in_flight=in_flight,
                              limit=limit)
        claimed = yield from _claim_number(sql, spec, slots, limit, now, clock, tries=limit)
        if claimed is not None:
            return _Admission(claimed, place=mine, leaving=leaving, in_flight=in_flight,
                              limit=limit, numbered=True)
        # Begins that took no lock took the numbers this read saw free; slots may have been
        # freed since too, so a lost claim does not mean the group is full: only a fresh read
        # tells. Each lost claim is another begin admitted, and the lock keeps out every begin
        # but those, so this ends.
    if spec.queue_until is None:
        return _Admission(now, rejected=("capacity_full", None), place=mine, leaving=leaving,
                          ahead=shown, in_flight=in_flight, limit=limit)
    if mine is not None and mine.live:
        leaving = dead
    return _Admission(now, queued=True, place=mine, leaving=leaving, ahead=shown,
                      in_flight=in_flight, limit=limit)


#: Numbers a begin tries without the group's lock before it takes the lock (each failure
#: means another begin took that number in the meantime).
FAST_CLAIMS = 8


def _admit_numbered(sql: Statements, spec: BeginSpec, limit: int, mode: Any, until: Any,
                    now: float, clock: ClockFn) -> Tx[_Admission | None]:
    """Admit a begin into a limited group without the group's row lock, by numbered slots
    (PostgreSQL); None: the begin must be decided under the lock.

    The lock would be held until the begin's COMMIT, so every begin of the group would wait
    for the one before it to be flushed to disk; here a begin takes a free slot number in
    ``[0, limit)`` instead, and the unique index on (group, number) is what keeps the group's
    in-flight count within its limit, across processes: two begins that pick one number are
    ordered by the index, and the second tries another. Only the plain case is decided here —
    the group open, nobody queued (first come, first served stays the locked path's), every live
    slot numbered below the limit (none left from before numbering, none above a lowered
    limit), and room.
    """
    if mode != GroupMode.OPEN.value and (until is None or until > now):
        return None
    group = spec.route.group
    slots, waiting = yield Flush((Q(sql.slot_expiries, {"group": group}),
                                  Q(sql.waiters, {"group": group})))
    now = max(now, clock())
    if waiting:
        return None
    live = [n for _a, n, e in slots if e is not None and float(e) > now]
    if len(live) >= limit or any(n is None or n >= limit for n in live):
        return None
    claimed = yield from _claim_number(sql, spec, slots, limit, now, clock, tries=FAST_CLAIMS)
    if claimed is None:
        return None
    return _Admission(claimed, in_flight=len(live), limit=limit, numbered=True)


def _claim_number(sql: Statements, spec: BeginSpec, slots: Sequence[Any], limit: int,
                  now: float, clock: ClockFn, *, tries: int) -> Tx[float | None]:
    """Write the begin's slot with a number of ``[0, limit)`` no live slot holds (a lapsed
    slot's number is taken over) and return the time it was taken: the begin's time from then
    on (its ``created_at``, its lease checked at it); None when ``tries`` numbers were all
    taken meanwhile or none is free.

    The first number tried follows from the attempt id, so concurrent begins spread over the
    numbers instead of all trying the lowest free one.
    """
    held: set[int] = set()
    lapsed: dict[int, str] = {}
    for attempt_id, n, until in slots:
        if n is None:
            continue
        if until is not None and float(until) > now:
            held.add(int(n))
        else:
            lapsed[int(n)] = attempt_id
    start = zlib.crc32(spec.attempt_id.encode()) % limit
    for _ in range(tries):
        n = next(((start + i) % limit for i in range(limit)
                  if (start + i) % limit not in held), None)
        if n is None:
            return None
        items = []
        if n in lapsed:
            items.append(Q(sql.free_slot_no, {"attempt_id": lapsed.pop(n), "slot_no": n}))
        items.append(Q(sql.claim_slot, {
            "attempt_id": spec.attempt_id, "group_id": spec.route.group,
            "run_id": spec.run_id, "fence": spec.fence, "acquired_at": now, "slot_no": n}))
        res = yield Flush(tuple(items))
        if res[-1]:
            # The clock is read again once the number is ours: ``now`` was read before the
            # claim, and a begin paused in between (descheduled, SIGSTOPped) may find the number
            # freed by a settle that came and went meanwhile. Recorded at ``now`` it would
            # overlap that settled Attempt in the ledger's own history (two in flight in a
            # group of one), and its lease would be judged at a time already past. Read after
            # the claim, the time follows every settle (its time read before its commit) and
            # every lapse that freed the number.
            return max(now, clock())
        held.add(n)
        start = n
    return None


def _enqueue(sql: Statements, spec: BeginSpec, adm: _Admission) -> Tx[Queued]:
    """Keep (or take) the begin's place in its full group's queue; nothing else is written."""
    group, place = spec.route.group, adm.place
    assert adm.limit is not None and spec.queue_until is not None
    writes: list[Q] = []
    if adm.leaving:
        writes.append(Q(sql.drop_waiters, {"group": group,
                                           "tickets": sql.list_param(adm.leaving)}))
    if place is None or not place.live:
        writes.append(Q(sql.insert_waiter, {
            "group_id": group, "waiter_id": spec.attempt_id, "run_id": spec.run_id,
            "fence": spec.fence, "enqueued_at": adm.now,
            "expires_at": max(spec.queue_until, adm.now)}))
    if writes:
        res = yield Flush(tuple(writes), commit=True)
        if place is None or not place.live:
            place = _Place(int(res[-1][0][0]), spec.attempt_id, adm.now, True)
    assert place is not None
    return Queued(group=group, ticket=place.ticket, ahead=adm.ahead, in_flight=adm.in_flight,
                  limit=adm.limit, since=place.enqueued_at, now=adm.now)


def leave_queue_tx(sql: Statements, waiter_id: str, group: str) -> Tx[bool]:
    """Give up a place in ``group``'s queue (a waiter cancelled or past its bound).

    The waiters behind it are told (PostgreSQL), since the place may have held a slot back.
    """
    items = [Q(sql.leave_queue, {"waiter_id": waiter_id})]
    if sql.NOTIFY_QUEUE is not None:
        items.append(Q(sql.NOTIFY_QUEUE, {"group": group}))
    yield Flush(tuple(items), commit=True)
    return True


def _begin_again(sql: Statements, spec: BeginSpec, run: Any, lease: Lease, now: float,
                 clock: ClockFn, margin: float, looked: tuple[Any, Any, Any, Any]
                 ) -> Tx[AttemptRecord | Refusal]:
    """A begin whose attempt id is already recorded: the same write again (its record), or,
    retried under a lease acquired again after a lost acknowledgement, its adoption."""
    [row] = yield Q(sql.attempt, {"attempt_id": spec.attempt_id})
    prior = _ns(sql.attempt, row)
    if prior.begin_hash != spec.begin_hash or prior.run_id != spec.run_id:
        raise Conflict(
            f"attempt id {spec.attempt_id!r} is already recorded with different "
            "content; use a new attempt id for a new physical call",
            attempt_id=spec.attempt_id,
        )
    if (prior.state != AttemptState.DISPATCHING.value or prior.fence == spec.fence
            or prior.executor != spec.executor):
        return attempt_record(prior, prior.debit_state)
    # Never sent (its begin was retried): adopted under the new fence if its group admits it
    # now (it does not queue: the turn that began it is gone). With numbered slots its old
    # slot (lapsed with the old fence) goes first, and admission numbers a new one.
    renumber = sql.spelling.numbers_slots and looked[1] is not None
    if renumber:
        yield Q(sql.delete_slot, {"attempt_id": spec.attempt_id})
    adm = yield from _admit(sql, replace(spec, queue_until=None), looked, now, clock)
    rejected, now = adm.rejected, adm.now
    check_live(run, lease, now, margin)
    if rejected is None:
        slot = (() if adm.numbered else (Q(sql.insert_slot, {
            "attempt_id": spec.attempt_id, "group_id": spec.route.group,
            "run_id": spec.run_id, "fence": spec.fence, "acquired_at": now}),) if renumber
            else (Q(sql.adopt_slot, {"fence": spec.fence, "attempt_id": spec.attempt_id}),))
        yield Flush((
            Q(sql.adopt_attempt, {"fence": spec.fence, "attempt_id": spec.attempt_id}),
            *slot,
            Q(sql.insert_event, [_event(spec.run_id, spec.attempt_id, "adopt", {
                "from_fence": int(prior.fence), "fence": spec.fence}, now)], many=True),
        ), commit=True)
        prior.fence = spec.fence
        return attempt_record(prior, prior.debit_state)
    yield Flush((
        Q(sql.void_attempt, {"reason": rejected[0], "now": now, "fence": spec.fence,
                             "attempt_id": spec.attempt_id}),
        Q(sql.void_debit, {"now": now, "debit_id": prior.debit_id}),
        Q(sql.delete_slot, {"attempt_id": spec.attempt_id}),
        Q(sql.void_run, {"reserve": prior.debit_reserved_micros,
                         "reserve_tokens": prior.reserved_tokens, "now": now,
                         "run_id": spec.run_id}),
        Q(sql.insert_event, [_event(spec.run_id, spec.attempt_id, "reject", {
            "reason": rejected[0], "group": spec.route.group, "adoption": True}, now)],
          many=True),
    ), commit=True)
    return Refusal(_refused(spec, adm, rejected, int(prior.seq), adoption=True),
                   freed_slot=True)


def _event(run_id: str | None, attempt_id: str | None, kind: str, data: Mapping[str, Any],
           now: float) -> dict[str, Any]:
    return {"run_id": run_id, "attempt_id": attempt_id, "kind": kind,
            "data": event_json(data), "created_at": now}


def moved(events: Iterable[tuple[str, Any]]) -> bool:
    """Whether ``events`` (kind, data) hold a ``move``: their Run failed over (the audit's
    rule, kept on the Run since migration 0012)."""
    return any(kind == "move" for kind, _ in events)


# -- settle ------------------------------------------------------------------------------------

def settle_tx(sql: Statements, run_id: str, spec: SettleSpec, clock: ClockFn) -> Tx[AttemptRecord]:
    """Record an Attempt's outcome (see ``Store.settle_attempt``)."""
    keys = list(spec.health)
    locked, read = yield Flush((
        Q(sql.lock_run_fence, {"run_id": run_id}),
        Q(sql.settle_read, {"attempt_id": spec.attempt_id, "run_id": run_id,
                            "key": keys[0] if keys else None}),
    ))
    run = _locked(locked, sql.lock_run_fence, run_id)
    check_fence(run, run_id, spec.fence)
    now = clock()
    if not read:
        raise NotFound(f"unknown attempt id {spec.attempt_id!r} in run {run_id!r}",
                       attempt_id=spec.attempt_id, run_id=run_id)
    att = _ns(sql.settle_read, read[0])
    if att.state == AttemptState.REJECTED.value:
        raise InvalidState(
            f"attempt {spec.attempt_id!r} was rejected before dispatch; nothing to settle",
            attempt_id=spec.attempt_id, state=AttemptState.REJECTED.value,
        )
    if att.state != AttemptState.DISPATCHING.value:
        if att.settle_hash == spec.settle_hash:
            return attempt_record(att, att.debit_state)
        # An unknown Attempt is the one settled state that may still move: with evidence, by
        # settle_unknown. Said here, where a host that learnt its outcome lands.
        way_out = ("; with evidence of its outcome (the provider's console or bill), record it "
                   f"with Ledger.settle_unknown({spec.attempt_id!r}, outcome=..., note=...) or "
                   f"`failover-ledger attempt settle {spec.attempt_id}`"
                   if att.state == AttemptState.UNKNOWN.value else "")
        raise SettleConflict(
            f"attempt {spec.attempt_id!r} is already settled as {att.state} with "
            f"different content; a settled attempt is immutable{way_out}",
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
    holds = settle_holds(spec.outcome, spec.fact, cost_micros=spec.cost_micros, tokens=tokens,
                         reserved_micros=att.debit_reserved_micros,
                         reserved_tokens=att.reserved_tokens,
                         token_budget=run.max_tokens is not None)
    fact = spec.fact
    values: dict[str, Any] = {
        "state": AttemptState(spec.outcome.value).value,
        "fact": fact_json(fact) if fact is not None else None,
        "category": fact.category.value if fact else None,
        "http_status": fact.status if fact else None,
        "effective_output": spec.effective_output, "tool_started": spec.tool_started,
        "prompt_tokens": spec.prompt_tokens, "completion_tokens": spec.completion_tokens,
        "cost_micros": spec.cost_micros,
        # Cut after redacting: a redaction may lengthen a host's 200 characters.
        "model_reported": redact(spec.model_reported)[:200] if spec.model_reported else None,
        "output_hash": spec.output_hash, "settle_hash": spec.settle_hash,
        "settle_fence": spec.fence, "settled_at": now,
        **settle_measures(spec, float(att.created_at), now),
    }
    settle_debit = (att.debit_state == DebitState.RESERVED.value
                    and holds.debit is not DebitState.RESERVED)
    succeeded = spec.outcome is Outcome.SUCCEEDED
    writes = [Q(sql.settle_attempt, {**values, "attempt_id": spec.attempt_id})]
    if settle_debit:
        writes.append(Q(sql.settle_debit, {"state": holds.debit.value,
                                           "posted": holds.posted_micros, "now": now,
                                           "debit_id": att.debit_id}))
    writes.append(Q(sql.delete_slot, {"attempt_id": spec.attempt_id}))
    run_params: dict[str, Any] = {
        "run_id": run_id, "release": holds.release_micros if settle_debit else 0,
        "posted": holds.posted_micros if settle_debit else 0,
        "release_tokens": holds.release_tokens if settle_debit else 0,
        "tokens": holds.tokens_used, "uncount": 1 if holds.uncount_call else 0, "now": now,
        "moved": moved(spec.events),
    }
    if not succeeded:
        run_stmt = sql.settle_run
    elif spec.keep_profile:
        run_stmt = sql.settle_run_succeeded_pinned
        run_params.update(route=att.route_id)
    else:
        run_stmt = sql.settle_run_succeeded
        run_params.update(route=att.route_id, profile=att.profile_id)
    writes.append(Q(run_stmt, run_params))
    if succeeded:
        for digest in dict.fromkeys((spec.output_hash, *spec.provenance)):
            if digest:
                writes.append(Q(sql.insert_provenance, {
                    "run_id": run_id, "ref": spec.attempt_id, "content_hash": digest,
                    "kind": "model_output", "now": now}))
    if spec.group_update is not None:
        writes.append(_group_fact(sql, att.group_id, spec.group_update, now))
    if spec.events:
        writes.append(Q(sql.insert_event, [_event(run_id, spec.attempt_id, k, d, now)
                                           for k, d in spec.events], many=True))
    gives_back = run.status in _ENDED and run.parent_run_id is not None
    if gives_back:
        # Every writer locks Runs before health and group rows: the parents this settle may
        # give back to are locked now, not after the health rows below.
        yield from _lock_ancestors(sql, run.parent_run_id)
    # Health: the first key's row came with the read; a row that a success leaves unchanged
    # (a healthy key) is neither locked nor written, so settles of many workers on one route
    # never queue on it. Changing rows are locked and the pure update re-applied as locked.
    for i, key in enumerate(keys):
        kind, provider, update = spec.health[key]
        seen = (health_record(SimpleNamespace(**{c: getattr(att, "h_" + c)
                                                 for c in HEALTH_COLS}))
                if i == 0 and att.h_key is not None else None)
        if seen is not None and update(seen) == seen:
            continue
        writes.extend((yield from _health_write(sql, key, kind, provider, update, now,
                                                seen is not None)))
    faults.point("settle.before_commit")
    if gives_back:
        # An ended Child's released hold is not its to use any more: it goes back with it.
        yield Flush(sql.writes(writes))
        yield from give_back_tx(sql, run_id, now)
    else:
        yield Flush(sql.writes(writes), commit=True)
    faults.point("settle.after_commit")
    return written_attempt({**{c: getattr(att, c) for c in ATTEMPT_COLS}, **values},
                           holds.debit.value if settle_debit else att.debit_state)


def _health_write(sql: Statements, key: str, kind: str, provider: str | None, update: HealthUpdate,
                  now: float, exists: bool) -> Tx[list[Q]]:
    """The statements that apply ``update`` to a health row, computed on the row as locked."""
    if not exists:
        fresh = health_values(update(Health(key=key)), now)
        inserted = yield Q(sql.insert_health, {"key": key, "kind": kind, "provider": provider,
                                               **fresh})
        if inserted:
            return []
    rows = yield Q(sql.lock_health, {"key": key})
    current = health_record(_ns(sql.lock_health, rows[0]))
    return [Q(sql.update_health, {"key": key, **health_values(update(current), now)})]


def _group_fact(sql: Statements, group: str, upd: GroupUpdate, now: float) -> Q:
    # One upsert; a later fact never shortens a known waiting floor.
    return Q(sql.group_fact, {"group": group, "mode": upd.mode.value, "until": upd.until,
                              "reason": upd.reason, "now": now})


def settle_measures(spec: SettleSpec, created_at: float, now: float) -> dict[str, Any]:
    """The latency columns a settle writes (seconds from the begin, by the ledger's clock) and
    the token details. The send's first-byte and first-token times lie within the latency: a
    clock that stepped back between them is not taken for a negative or longer wait."""
    latency = max(0.0, now - created_at)

    def within(t: float | None) -> float | None:
        return None if t is None else min(max(0.0, t), latency)

    return {"latency_s": latency, "first_byte_s": within(spec.first_byte_s),
            "first_token_s": within(spec.first_token_s), "cached_tokens": spec.cached_tokens,
            "reasoning_tokens": spec.reasoning_tokens}


def late_receipt_tx(sql: Statements, run_id: str, spec: SettleSpec, now: float,
                    why: str) -> Tx[None]:
    """Keep a refused settle's observation beside the Attempt (append-only, no fence)."""
    yield Flush((Q(sql.insert_event, [_event(run_id, spec.attempt_id, "late_receipt", {
        "outcome": spec.outcome.value, "fact": spec.fact.to_json() if spec.fact else None,
        "prompt_tokens": spec.prompt_tokens, "completion_tokens": spec.completion_tokens,
        "cached_tokens": spec.cached_tokens, "reasoning_tokens": spec.reasoning_tokens,
        "cost_micros": spec.cost_micros, "model_reported": spec.model_reported,
        "output_hash": spec.output_hash, "fence": spec.fence, "refused": why,
    }, now)], many=True),), commit=True)


# -- leases and the smaller writes -------------------------------------------------------------


def acquire_tx(sql: Statements, run_id: str, executor: str, ttl_s: float, clock: ClockFn,
               margin: float) -> Tx[Lease]:
    row = _locked((yield Q(sql.lock_run_fence, {"run_id": run_id})), sql.lock_run_fence,
                  run_id)
    now = clock()
    if row.status in _ENDED:
        # Only an ended Run can have been closed, so a running one costs no extra read.
        closed = yield Q(sql.run_close, {"run_id": run_id})
        if closed:
            raise closed_refusal(run_id, json.loads(closed[0][0]), float(closed[0][1]), now)
        retentions = yield Q(sql.retentions, {})
        if retentions and not (yield Q(sql.open_attempt, {"run_id": run_id})):
            trimmed = trimmed_refusal(run_id, row.status, float(row.created_at),
                                      [(json.loads(d), float(t)) for d, t in retentions], now)
            if trimmed is not None:
                raise trimmed
    live = row.lease_holder is not None and (row.lease_expires_at or 0) > now
    if live and row.lease_holder != executor:
        raise LeaseHeld(
            f"run {run_id!r} is leased by {row.lease_holder!r}, its lease expiring "
            f"{when(float(row.lease_expires_at), now)}; wait for it to expire or for recovery",
            run_id=run_id, holder=row.lease_holder, expires_at=row.lease_expires_at,
        )
    if live and lease_problem(row.lease_holder, row.lease_expires_at, executor, now,
                              margin) is None:
        # One's own live lease: renewed under the same fence. Inside the margin it is not
        # extended (another process may already count it as ended): the fence moves on.
        expires = max(float(row.lease_expires_at), now + ttl_s)
        yield Flush((Q(sql.renew, {"expires": expires, "now": now, "run_id": run_id}),),
                    commit=True)
        faults.point("acquire.after_commit")
        return Lease(run_id, executor, int(row.fence), expires)
    fence = int(row.fence) + 1
    faults.point("acquire.before_commit")
    yield Flush((
        Q(sql.acquire, {"holder": executor, "fence": fence, "expires": now + ttl_s, "now": now,
                        "run_id": run_id}),
        Q(sql.insert_event, [_event(run_id, None, "lease", {
            "executor": executor, "fence": fence, "previous": row.lease_holder,
            "expires_at": now + ttl_s}, now)], many=True),
    ), commit=True)
    faults.point("acquire.after_commit")
    return Lease(run_id, executor, fence, now + ttl_s)


def renew_tx(sql: Statements, lease: Lease, ttl_s: float, clock: ClockFn,
             margin: float) -> Tx[Lease]:
    _row, now = yield from _lock_live(sql.lock_run_fence, lease, clock, margin)
    yield Flush((Q(sql.renew, {"expires": now + ttl_s, "now": now, "run_id": lease.run_id}),),
                commit=True)
    return Lease(lease.run_id, lease.executor, lease.fence, now + ttl_s)


def release_tx(sql: Statements, lease: Lease, clock: ClockFn, *, again: bool = False
               ) -> Tx[None]:
    """Give the lease up; ``again``: resolving a release whose acknowledgement was lost, so a
    Run that moved on to another fence was released (by it) and is not ours to refuse."""
    row = _locked((yield Q(sql.lock_run_fence, {"run_id": lease.run_id})), sql.lock_run_fence,
                  lease.run_id)
    if again and row.fence != lease.fence:
        return  # released, then acquired by another executor
    check_fence(row, lease.run_id, lease.fence)
    if row.lease_holder is None:
        return  # released already: the same write again
    now = clock()
    if lease_problem(row.lease_holder, row.lease_expires_at, lease.executor, now, 0.0):
        raise LeaseLost(
            f"the lease on run {lease.run_id!r} (fence {lease.fence}) is no longer live; there "
            "is nothing of it to release (recovery takes the run over)",
            run_id=lease.run_id, fence=lease.fence)
    [(held,)] = yield Q(sql.count_slots, {"run_id": lease.run_id, "fence": lease.fence})
    if held:
        raise InvalidState(
            f"run {lease.run_id!r} still has {held} attempt(s) in flight; settle them "
            "(or mark them unknown) before releasing the lease",
            run_id=lease.run_id, in_flight=held,
        )
    yield Flush((Q(sql.release, {"now": now, "run_id": lease.run_id}),), commit=True)


def finish_tx(sql: Statements, lease: Lease, status: RunStatus, clock: ClockFn,
              margin: float, *, again: bool = False) -> Tx[None]:
    """Record the Run's end; ``again``: resolving a finish whose acknowledgement was lost,
    so a Run already ended with ``status`` is left as it is (one ``finish`` event)."""
    row, now = yield from _lock_live(sql.lock_run_fence, lease, clock, margin)
    if again:
        # Its own statement, after the lock: it sees the finish that committed meanwhile.
        [live] = yield Q(sql.run_live, {"run_id": lease.run_id})
        if _ns(sql.run_live, live).status == status.value:
            return
    child = row.parent_run_id is not None
    faults.point("finish.before_commit")
    yield Flush((
        Q(sql.finish, {"status": status.value, "now": now, "run_id": lease.run_id}),
        Q(sql.insert_event, [_event(lease.run_id, None, "finish", {"status": status.value},
                                    now)], many=True),
    ), commit=not child)
    if child:
        yield from give_back_tx(sql, lease.run_id, now)
    faults.point("finish.after_commit")


def give_back_tx(sql: Statements, run_id: str, now: float) -> Tx[None]:
    """Give what the ended Child ``run_id`` has left back to its parent, and commit.

    Run in the transaction that ended it (or released a hold of it), which holds its row's
    lock: the parent's row is locked after it, child before parent as admission carves, so
    ends and admissions never wait on each other in a cycle. A parent that has ended itself
    passes what came back on to its own parent, up the tree. What is given back is
    :func:`~ledger.domain.records.carve_return`'s: the Child records it (``returned_*``) and
    never uses it again; the parent's ``carved_*`` go down by it, so the parent may spend it.
    """
    [row] = yield Q(sql.lock_run_carve, {"run_id": run_id})
    child = _ns(sql.lock_run_carve, row)
    writes: list[Q] = []
    while child.status in _ENDED and child.parent_run_id is not None:
        found = yield Q(sql.lock_run_carve, {"run_id": child.parent_run_id})
        if not found:
            break  # the parent's rows are gone (retention): nobody to give it to
        parent = _ns(sql.lock_run_carve, found[0])
        back = carve_return(child, parent.max_tokens is not None)
        if back is None:
            break
        amounts = back.amounts()
        writes += [
            Q(sql.give_back, {"run_id": child.run_id, **amounts}),
            Q(sql.take_back, {"run_id": parent.run_id, **amounts}),
            Q(sql.insert_event, [_event(child.run_id, None, "give_back",
                                        give_back_event(parent.run_id, back), now)],
              many=True),
        ]
        for name, value in amounts.items():  # as written: a parent passing it on reads it so
            setattr(parent, f"carved_{name}", getattr(parent, f"carved_{name}") - value)
        child = parent
    # Not fused: an ended parent passing it on is written twice (its carve, its return).
    yield Flush(tuple(writes), commit=True)


def _lock_ancestors(sql: Statements, parent_id: str) -> Tx[None]:
    """Lock ``parent_id``'s row and, while the locked one has ended and has a parent, that
    parent's: every row :func:`give_back_tx` may write to, in its order."""
    run_id: str | None = parent_id
    while run_id is not None:
        found = yield Q(sql.lock_run_carve, {"run_id": run_id})
        if not found:
            return
        row = _ns(sql.lock_run_carve, found[0])
        run_id = row.parent_run_id if row.status in _ENDED else None


def give_back_event(parent_id: str, back: Any) -> dict[str, Any]:
    """The ``give_back`` event's data: to whom, and how much of each."""
    return {"parent": parent_id, "calls": back.calls, "retries": back.retries,
            "cost": str(from_micros(back.micros)), "tokens": back.tokens}


def reserve_retry_tx(sql: Statements, lease: Lease, clock: ClockFn, margin: float,
                     data: Mapping[str, Any]) -> Tx[int]:
    row, now = yield from _lock_live(sql.lock_run_full, lease, clock, margin)
    left = row.max_retries - row.carved_retries - row.retries_used - row.returned_retries
    if left <= 0:
        raise AllowanceExhausted(
            f"run {lease.run_id!r} has no retry permission left "
            f"({row.retries_used} of {row.max_retries} used)",
            run_id=lease.run_id, field="retries",
        )
    yield Flush((
        Q(sql.take_retry, {"now": now, "run_id": lease.run_id}),
        Q(sql.insert_event, [_event(lease.run_id, None, "retry_permission", data, now)],
          many=True),
    ), commit=True)
    return int(left) - 1


def provenance_tx(sql: Statements, lease: Lease, ref: str, content_hash: str, kind: str,
                  clock: ClockFn, margin: float, *, own_attempt: bool = False) -> Tx[None]:
    _row, now = yield from _lock_live(sql.lock_run_fence, lease, clock, margin)
    owners = yield Q(sql.attempt_run, {"attempt_id": ref})
    if own_attempt:
        # The ledger's own record under an Attempt (a tool call it renamed): of this Run only.
        if not owners or owners[0][0] != lease.run_id:
            raise NotFound(f"unknown attempt id {ref!r} in run {lease.run_id!r}",
                           attempt_id=ref, run_id=lease.run_id)
    elif owners:
        # What an Attempt produced is recorded by its settle, once (a settled Attempt is never
        # rewritten): a hash a host adds under an Attempt id would pass an edited or invented
        # answer for that model's output (invariant 7), in this tree or another.
        raise InvalidArgument(
            f"ref {ref!r} is an Attempt id: what an Attempt produced is recorded by its "
            "settle only, and a host may not add to it; carry the model's parts as a turn "
            "returned them (result.parts), and record a document, a memory or a tool result "
            "under its own id (a tool-call id, 'doc-10k'), never an Attempt's",
            field="ref", ref=ref)
    yield Flush((Q(sql.insert_provenance, {"run_id": lease.run_id, "ref": ref,
                                           "content_hash": content_hash, "kind": kind,
                                           "now": now}),), commit=True)


def event_tx(sql: Statements, lease: Lease, attempt_id: str | None, kind: str,
             data: Mapping[str, Any], clock: ClockFn, margin: float) -> Tx[None]:
    _row, now = yield from _lock_live(sql.lock_run_fence, lease, clock, margin)
    writes = [Q(sql.insert_event, [_event(lease.run_id, attempt_id, kind, data, now)],
                many=True)]
    if kind == "move":  # a host's own move counts as the turn loop's (the audit's rule)
        writes.append(Q(sql.mark_failed_over, {"run_id": lease.run_id}))
    yield Flush(sql.writes(writes), commit=True)


def mark_unknown_tx(sql: Statements, lease: Lease, attempt_id: str, clock: ClockFn,
                    reason: str) -> Tx[AttemptRecord]:
    row = _locked((yield Q(sql.lock_run_fence, {"run_id": lease.run_id})), sql.lock_run_fence,
                  lease.run_id)
    check_fence(row, lease.run_id, lease.fence)
    now = clock()
    rows = yield Q(sql.attempt, {"attempt_id": attempt_id})
    if not rows or rows[0][1] != lease.run_id:
        raise NotFound(f"unknown attempt id {attempt_id!r} in run {lease.run_id!r}",
                       attempt_id=attempt_id, run_id=lease.run_id)
    att = _ns(sql.attempt, rows[0])
    if att.state == AttemptState.DISPATCHING.value:
        if att.fence != lease.fence:
            raise FencedOut(
                f"attempt {attempt_id!r} was begun under fence {att.fence}, not "
                f"{lease.fence}; recovery marks it unknown",
                run_id=lease.run_id, fence=lease.fence, attempt_fence=int(att.fence))
        yield Flush((
            Q(sql.mark_unknown, {"now": now, "fence": lease.fence, "attempt_id": attempt_id}),
            Q(sql.delete_slot, {"attempt_id": attempt_id}),
            Q(sql.insert_event, [_event(lease.run_id, attempt_id, "unknown",
                                        {"reason": reason}, now)], many=True),
        ), commit=True)
        att.state = AttemptState.UNKNOWN.value
        att.settled_at = now
        att.settle_fence = lease.fence
    return attempt_record(att, att.debit_state)


def attempt_tx(sql: Statements, attempt_id: str) -> Tx[AttemptRecord]:
    """One Attempt with its debit's state (:class:`~ledger.errors.NotFound` for an unknown id)."""
    [rows] = yield Flush((Q(sql.attempt, {"attempt_id": attempt_id}),), commit=True)
    if not rows:
        raise NotFound(f"unknown attempt id {attempt_id!r}; list a run's attempts with "
                       "`failover-ledger run show RUN_ID`", attempt_id=attempt_id)
    att = _ns(sql.attempt, rows[0])
    return attempt_record(att, att.debit_state)


def claim_probe_tx(sql: Statements, key: str, provider: str | None, now: float, interval_s: float,
                   *, kind: str = "route", ttl_s: float | None = None,
                   max_keys: int | None = None) -> Tx[bool]:
    """Take the probe slot of ``key`` (one caller per interval); a claim taken also bounds the
    probe state: times at least ``ttl_s`` old are forgotten, and at most ``max_keys`` keys keep
    one, the oldest going first (``ledger.decide.health.ProbeThrottle`` is the same rule)."""
    _, claimed = yield Flush((
        Q(sql.ensure_health, {"key": key, "kind": kind, "provider": provider, "now": now}),
        Q(sql.claim_probe, {"now": now, "key": key, "since": now - interval_s}),
    ), commit=not _bounded(ttl_s, max_keys))
    if claimed and _bounded(ttl_s, max_keys):
        expired = now - ttl_s if ttl_s is not None else float("-inf")
        keep = max_keys - 1 if max_keys is not None else 2**62
        yield Flush((Q(sql.forget_probes, {"key": key, "expired": expired, "keep": keep}),),
                    commit=True)
    return bool(claimed)


def _bounded(ttl_s: float | None, max_keys: int | None) -> bool:
    """Whether a claim bounds the probe state (a TTL or a key limit is given)."""
    return ttl_s is not None or max_keys is not None


def compaction_tx(sql: Statements, lease: Lease, clock: ClockFn, margin: float) -> Tx[int]:
    """Count one compaction of the Run's session (needs a live lease), with its event."""
    _row, now = yield from _lock_live(sql.lock_run_fence, lease, clock, margin)
    [(count,)] = yield Q(sql.compaction, {"run_id": lease.run_id, "now": now})
    yield Flush((Q(sql.insert_event, [_event(lease.run_id, None, "compaction",
                                             {"compactions": int(count)}, now)], many=True),),
                commit=True)
    return int(count)


__all__ = [
    "QUEUE_CHANNEL",
    "Refusal",
    "SnapshotRows",
    "acquire_tx",
    "attempt_tx",
    "begin_tx",
    "check_live",
    "claim_probe_tx",
    "compaction_tx",
    "event_tx",
    "finish_tx",
    "late_receipt_tx",
    "leave_queue_tx",
    "mark_unknown_tx",
    "moved",
    "provenance_tx",
    "release_tx",
    "renew_tx",
    "reserve_retry_tx",
    "settle_tx",
    "snapshot_tx",
    "tree_provenance_tx",
]
