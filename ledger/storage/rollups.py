"""Hourly roll-ups of the attempts, for the audit's totals over long windows.

Hour ``h`` is ``[3600*h, 3600*(h+1))`` of ``attempts.created_at``. :meth:`RollupQueries.roll`
writes, for each hour that ended at least ``lag_s`` ago and is not rolled yet, the sums over
its attempts but those in flight (every state but ``dispatching``; ``unknown`` ones and their
holds are counted, since 0015) by route, group, provider, tenant and labels into
``attempt_rollups``, and marks the hour in ``rollup_hours``, in one transaction per hour.
:meth:`~ledger.storage.audit.AuditQueries.totals` then adds a rolled hour's rows to what it
still reads from ``attempts``: the window's ragged edges, the hours not rolled, and the
attempts of rolled hours still ``dispatching`` (:func:`split`). The same transaction writes
the hour's rows of ``metric_rollups`` (per route and state: what ``/metrics`` counts,
histograms included) and of ``move_rollups`` (its ``move`` events by routes and cause) and of
``run_rollups`` (per tenant, the Runs admitted in it that have ended, with their money), which
:meth:`~ledger.storage.series.SeriesQueries.metrics_totals` adds up the same way (migration
0013).

Why this stays exact: an attempt's row changes only by a write of the ledger (one in flight
settled or marked ``unknown``, an ``unknown`` one resolved), and a trigger on ``attempts``
(migration 0011) deletes an hour's mark and rows whenever any attempt of that hour is written:
inserted late (a clock behind the others', a begin whose commit took long), settled after the
roll-up, resolved by an operator, or deleted by retention. Such an hour is read from
``attempts`` again until the next roll-up. On PostgreSQL the trigger holds a shared advisory
lock of the hour until its transaction ends and a roll-up takes the exclusive one before it
reads (:meth:`~ledger.storage.context.SqlContext.lock_hour`), so a write committed while a
roll-up read is never missed; SQLite's single writer serializes them. A ``move`` event may be
written without an attempt (a host's own ``append_event``): a trigger on ``events`` does the
same for moves (0013), and an hour holding only moves is rolled, not marked empty. A Run's
row keeps changing while it lives; it is rolled up once it has ended, and a trigger on ``runs``
undoes its hour of admission when it ends or its money moves after (an operator's receipt).

Old days are folded (migration 0016): after rolling, :meth:`RollupQueries.fold` sums each
UTC day that ended at least ``fold_after_s`` ago (by default
:data:`~ledger.domain.bounds.DEFAULT_FOLD_AFTER_S`) and whose 24 hours are all rolled into one
set of rows at its first hour, per key (:data:`FOLDED`), and marks it in ``rollup_days``; its
hours stay marked. A read takes those rows only for a window (and bucket) holding the whole
day (:func:`~ledger.storage.hours.rolled_stretches`), and the trigger that undoes an hour undoes
its folded day whole, so whole-history reads read one set per old day instead of 24.

The roll-up is a job: ``failover-ledger rollup`` or :meth:`ledger.Ledger.roll_up`, run from
cron or a scheduler every few minutes (docs/operations.md). Without it nothing reads
differently; it only makes the totals and ``/metrics`` cheaper.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Table,
    and_,
    bindparam,
    func,
    literal,
    select,
)

from ledger.domain.bounds import DEFAULT_FOLD_AFTER_S
from ledger.domain.records import Rollup
from ledger.storage import schema as s
from ledger.storage.audit import charged_and_held, in_state
from ledger.storage.context import ClockFn, SqlContext
from ledger.storage.hours import DAY_HOURS, HOUR, OPEN_STATES, hour_of, hours_in
from ledger.storage.series import Counted, metric_counts

#: Each roll-up table and the columns its rows are kept per; a fold sums every other column
#: (but ``hour``) over the day's rows of each key.
FOLDED: tuple[tuple[Table, tuple[str, ...]], ...] = (
    (s.attempt_rollups, ("route_id", "group_id", "provider", "tenant", "labels")),
    (s.metric_rollups, ("route_id", "state")),
    (s.move_rollups, ("from_route", "to_route", "category")),
    (s.wait_rollups, ("group_id", "outcome")),
    (s.run_rollups, ("tenant", "labels")),
)

# Empty hours marked per transaction (on PostgreSQL each holds an advisory lock until the
# commit, in the server's shared lock table).
_EMPTY_BATCH = 256
# Empty days folded per transaction: as many hour locks.
_EMPTY_DAYS = _EMPTY_BATCH // DAY_HOURS


def _next_each(conn: Any, col: Any, lo: int, hi: int, *where: ColumnElement[bool],
               hourly: bool = False, stride: int = 1) -> set[int]:
    """The hours in ``[lo, hi)`` that ``col`` (a time; ``hourly``: an hour number) has a row
    in, found by jumping from each to the next (its least value from an hour on, by its
    index): a stretch without rows costs one read, however long (a ledger idle for months).

    ``stride``: only the first such hour of each ``stride`` hours from 0 is wanted (a day's).
    """
    found: set[int] = set()
    at = lo
    while at < hi:
        span = and_(col >= at, col < hi) if hourly else hours_in(col, at, hi)
        t = conn.execute(select(func.min(col)).where(*where, span)).scalar()
        if t is None:
            break
        h = int(t) if hourly else hour_of(t)
        found.add(h)
        at = (h // stride + 1) * stride
    return found


def _whole_days(conn: Any, lo: int, hi: int) -> set[int]:
    """The days in ``[lo, hi)`` (from day 0) whose 24 hours are all marked rolled and that are
    not folded: the days a fold may fold (it checks again under the days' hour locks)."""
    h = s.rollup_hours.c.hour
    day = (h // DAY_HOURS).label("day")  # a floor for hours from 0
    whole = {int(d) for d in conn.execute(
        select(day).where(h >= lo * DAY_HOURS, h < hi * DAY_HOURS).group_by(day)
        .having(func.count() == DAY_HOURS)).scalars()}
    d = s.rollup_days.c.day
    return whole - {int(x) for x in conn.execute(select(d).where(d >= lo, d < hi)).scalars()}


def fold_rows(conn: Any, table: Table, keys: tuple[str, ...], lo: int, hi: int) -> None:
    """Replace roll-up ``table``'s rows of hours ``[lo, hi]`` with their sums per ``keys``
    (every other column but ``hour`` summed), at hour ``lo``: a day's fold, and retention's
    carried rows (:data:`~ledger.storage.hours.CARRIED_HOUR`) kept to one per key."""
    sums = [c for c in table.c if c.name != "hour" and c.name not in keys]
    rows = conn.execute(
        select(*(table.c[k] for k in keys), *(func.sum(c).label(c.name) for c in sums))
        .where(table.c.hour.between(lo, hi)).group_by(*(table.c[k] for k in keys))
    ).mappings().all()
    conn.execute(table.delete().where(table.c.hour.between(lo, hi)))
    if rows:
        # PostgreSQL sums integers as numeric: back to the column's own type.
        whole = {c.name for c in sums if isinstance(c.type, BigInteger)}
        conn.execute(table.insert(), [
            {"hour": lo, **{k: int(v) if k in whole else v for k, v in r.items()}}
            for r in rows])


def roll_counts(conn: Any, c: Counted, hour: int, *where: ColumnElement[bool]) -> None:
    """Insert into ``c.table``, at ``hour``, ``c``'s sums per key over its rows ``where``
    holds: what retention carries over of the rows it drops (an hour's roll-up runs the same
    statement, built once: :meth:`RollupQueries._hour_statements`)."""
    conn.execute(_counts_insert(c, literal(hour), *where))


def _counts_insert(c: Counted, hour: Any, *where: ColumnElement[bool]) -> Any:
    keys = [*c.keys.values(), *c.detail.values()]
    return c.table.insert().from_select(
        ["hour", *c.columns, *c.detail, *(x.name for x in c.sums)],
        select(hour, *keys, *c.sums).where(*c.where, *where).group_by(*keys))


# An hour's roll-up statements take the hour and its bounds as parameters: built once per
# roll-up, not once per hour (building them was most of a roll-up's time: a month of hours
# spent half a minute in SQLAlchemy's constructors and cache keys).
_HOUR = bindparam("hour", type_=BigInteger)
_LO, _HI = bindparam("lo", type_=Float), bindparam("hi", type_=Float)


def _in_hour(col: Any) -> ColumnElement[bool]:
    """``col`` (a time) in the hour the statement is run for (``lo <= col < hi``)."""
    return and_(col >= _LO, col < _HI)


class RollupQueries:
    """Writing the roll-ups (see the module docstring)."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx
        self._statements: list[Any] | None = None

    def roll(self, clock: ClockFn, *, lag_s: float, max_hours: int | None = None,
             fold_after_s: float | None = DEFAULT_FOLD_AFTER_S) -> Rollup:
        """Roll up every hour that ended at least ``lag_s`` before the ledger clock's now
        and is not rolled, oldest first (at most ``max_hours`` of them): the hours without
        an attempt are marked many to a transaction, the others rolled one to a transaction.
        Then fold each UTC day that ended at least ``fold_after_s`` before now (``None``:
        none) and whose hours are all rolled (:meth:`fold`).
        """
        a = s.attempts.c
        now = clock()
        last = hour_of(now - lag_s)  # hours below it ended at least lag_s ago
        with self.ctx.reading() as conn:
            # The first hour of the history: of its attempts, Runs, or a host's own moves.
            firsts = [t for t in (conn.execute(select(func.min(a.created_at))).scalar(),
                                  conn.execute(select(func.min(s.runs.c.created_at))).scalar(),
                                  conn.execute(select(func.min(s.events.c.created_at)).where(
                                      s.events.c.kind.in_(s.ROLLED_EVENTS))).scalar())
                      if t is not None]
            first = min(firsts) if firsts else None
            done = set() if first is None else {int(x) for x in conn.execute(
                select(s.rollup_hours.c.hour).where(s.rollup_hours.c.hour >= hour_of(first)))
                .scalars()}
        missing = [] if first is None else [
            h for h in range(hour_of(first), last) if h not in done]
        todo = missing if max_hours is None else missing[:max_hours]
        rolled, busy = self._mark_empty(todo, now)
        rows = 0
        for h in busy:
            with self.ctx.writing() as conn:
                self.ctx.lock_hour(conn, h)
                if self._marked(conn, [h]):
                    continue  # another roll-up did it while this one waited
                rows += self._roll_hour(conn, h, now)
                rolled += 1
        days = 0 if fold_after_s is None else self.fold(now - fold_after_s, now)
        return Rollup(hours=rolled, rows=rows, pending=len(missing) - len(todo),
                      until=float(last * HOUR), days=days)

    def fold(self, before: float, now: float) -> int:
        """Fold each UTC day ending by ``before`` whose 24 hours are all rolled and that is
        not folded: every roll-up table's rows of the day summed per key into rows at its
        first hour, the day marked in ``rollup_days``; one transaction per day. Returns how
        many were folded.

        A whole-history read then reads one set of rows per old day instead of 24. The day's
        hours stay marked, and the trigger that undoes an hour undoes its whole day
        (migration 0016). On PostgreSQL the day's 24 hour locks are taken without waiting: a
        day whose hour a writer holds (or another fold) is left for the next run.
        """
        end = hour_of(before) // DAY_HOURS  # days below it ended by before
        with self.ctx.reading() as conn:
            days = sorted(_whole_days(conn, 0, end))
        folded = 0
        for i in range(0, len(days), _EMPTY_DAYS):
            with self.ctx.writing() as conn:
                empty, full = self._fold_empty(conn, days[i:i + _EMPTY_DAYS], now)
            folded += len(empty)
            for d in full:
                with self.ctx.writing() as conn:
                    if self._fold_day(conn, d, now):
                        folded += 1
        return folded

    def _fold_empty(self, conn: Any, days: list[int], now: float
                    ) -> tuple[set[int], list[int]]:
        """Mark folded, in one transaction, those of ``days`` (ascending) with no roll-up row
        (a ledger idle for a month has 30 of them). Returns them, and the days with rows to
        sum, which :meth:`_fold_day` folds one to a transaction.

        Under the same hour locks and checks as :meth:`_fold_day`: taken without waiting,
        every hour of the day still marked, the day not folded meanwhile. A day failing them
        is in neither: it is left for the next roll-up (its locks were just refused).
        """
        hours = [h for d in days for h in range(d * DAY_HOURS, (d + 1) * DAY_HOURS)]
        taken = self.ctx.lock_hours(conn, hours)
        ready = [d for d in days
                 if all(h in taken for h in range(d * DAY_HOURS, (d + 1) * DAY_HOURS))]
        if not ready:
            return set(), []
        lo, hi = ready[0] * DAY_HOURS, (ready[-1] + 1) * DAY_HOURS
        whole = _whole_days(conn, ready[0], ready[-1] + 1)
        held: set[int] = set()
        for table, _keys in FOLDED:
            held |= {x // DAY_HOURS for x in _next_each(conn, table.c.hour, lo, hi,
                                                         hourly=True, stride=DAY_HOURS)}
        empty = {d for d in ready if d in whole and d not in held}
        if empty:
            conn.execute(s.rollup_days.insert(),
                         [{"day": d, "folded_at": now} for d in sorted(empty)])
        return empty, [d for d in ready if d in whole and d in held]

    def _fold_day(self, conn: Any, d: int, now: float) -> bool:
        lo, hi = d * DAY_HOURS, (d + 1) * DAY_HOURS - 1
        # Tried all at once (one statement on PostgreSQL, not 24 round trips); one not taken
        # leaves the day, and the ones taken go with the transaction.
        if len(self.ctx.lock_hours(conn, list(range(lo, hi + 1)))) != DAY_HOURS:
            return False
        h = s.rollup_hours.c.hour
        marks = conn.execute(select(func.count()).where(h.between(lo, hi))).scalar_one()
        if marks != DAY_HOURS or conn.execute(select(s.rollup_days.c.day).where(
                s.rollup_days.c.day == d)).first() is not None:
            return False  # undone, or folded by another run, since it was listed
        for table, keys in FOLDED:
            fold_rows(conn, table, keys, lo, hi)
        conn.execute(s.rollup_days.insert().values(day=d, folded_at=now))
        return True

    @staticmethod
    def _marked(conn: Any, hours: list[int]) -> set[int]:
        h = s.rollup_hours.c.hour
        return {int(x) for x in conn.execute(select(h).where(h.in_(hours))).scalars()}

    def _mark_empty(self, hours: list[int], now: float) -> tuple[int, list[int]]:
        """Mark the hours without any attempt, many to a transaction (a ledger idle for a
        month has 720 of them); return how many, and the hours left to roll one by one.

        Each is locked without waiting: one held by a writer (or by another roll-up) is left
        to the one-by-one pass, which waits for it; waiting here, holding the locks taken
        so far, could deadlock with a writer touching two hours.
        """
        marked = 0
        busy: list[int] = []
        for i in range(0, len(hours), _EMPTY_BATCH):
            chunk = hours[i:i + _EMPTY_BATCH]
            with self.ctx.writing() as conn:
                taken = self.ctx.lock_hours(conn, chunk)
                done = self._marked(conn, sorted(taken))
                todo = [h for h in chunk if h in taken and h not in done]
                full = self._holding(conn, todo)
                empty = [h for h in todo if h not in full]
                if empty:
                    conn.execute(s.rollup_hours.insert(),
                                 [{"hour": h, "rolled_at": now} for h in empty])
                marked += len(empty)
                skip = done.union(empty)
                busy.extend(h for h in chunk if h not in skip)
        return marked, busy

    @staticmethod
    def _holding(conn: Any, hours: list[int]) -> set[int]:
        """Which of ``hours`` (ascending) hold an attempt, a Run admitted, or a rolled event
        (a host's own ``move`` is written without an attempt).

        Each table is read by jumping from one written hour to the next (the least time from
        an hour on, by its index): a stretch of empty hours costs one read per table, however
        long (a ledger idle for months), and a written hour one read per table, as before.
        """
        if not hours:
            return set()
        lo, hi = hours[0], hours[-1] + 1
        e = s.events.c
        held = _next_each(conn, s.attempts.c.created_at, lo, hi)
        held |= _next_each(conn, s.runs.c.created_at, lo, hi)
        for kind in s.ROLLED_EVENTS:  # one kind at a time: its (kind, created_at) index
            held |= _next_each(conn, e.created_at, lo, hi, e.kind == kind)
        return held.intersection(hours)

    def _roll_hour(self, conn: Any, h: int, now: float) -> int:
        if self._statements is None:
            self._statements = self._hour_statements()
        params = {"hour": h, "lo": h * HOUR, "hi": (h + 1) * HOUR}
        for statement in self._statements:
            conn.execute(statement, params)
        conn.execute(s.rollup_hours.insert().values(hour=h, rolled_at=now))
        # Counted, not the INSERT's rowcount, which not every driver reports for a SELECT.
        t = s.attempt_rollups.c
        return int(conn.execute(select(func.count()).select_from(s.attempt_rollups)
                                .where(t.hour == h)).scalar_one())

    def _hour_statements(self) -> list[Any]:
        """An hour's roll-up, for the hour the parameters name (``hour``, ``lo``, ``hi``):
        its ``attempt_rollups`` rows, then its rows of the roll-ups of what ``/metrics``
        counts (:func:`~ledger.storage.series.metric_counts`), each over the hour's rows but
        the open ones (attempts in flight, Runs not ended)."""
        a = s.attempts.c
        r = s.runs.c
        labels = func.coalesce(a.labels, select(r.labels).where(r.run_id == a.run_id)
                               .scalar_subquery())
        charged, held = charged_and_held()
        keys = (a.route_id, a.group_id, a.provider, a.tenant, labels)
        q = (select(_HOUR, *keys, func.count(), in_state("succeeded"), in_state("failed"),
                    func.coalesce(func.sum(a.prompt_tokens), 0),
                    func.coalesce(func.sum(a.completion_tokens), 0), charged,
                    in_state("unknown"), held)
             .where(_in_hour(a.created_at), a.state.not_in(OPEN_STATES))
             .group_by(*keys))
        t = s.attempt_rollups.c
        statements: list[Any] = [s.attempt_rollups.insert().from_select(
            [t.hour, t.route_id, t.group_id, t.provider, t.tenant, t.labels, t.attempts,
             t.succeeded, t.failed, t.prompt_tokens, t.completion_tokens, t.cost_micros,
             t.unknown, t.held_micros], q)]
        for c in metric_counts(self.ctx, s.METRIC_BOUNDS):
            kept = [] if c.open is None else [~c.open]
            statements.append(_counts_insert(c, _HOUR, _in_hour(c.time), *kept))
        return statements


__all__ = ["FOLDED", "RollupQueries", "fold_rows", "roll_counts"]
