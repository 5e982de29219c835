"""Retention: dropping the history of finished Runs older than a cut-off.

On PostgreSQL the history (``attempts``, ``events``) is partitioned by month
(:mod:`ledger.storage.partitions`) and retention drops whole partitions: each one whose month
ends at or before the cut-off is dropped, unless a row of a *held* Run is inside.
Rows of such old months that sit in a default partition (written while their month had no
partition) are first moved into a partition of their own; the moves fire the roll-ups' row
triggers, so their hours' locks are taken (shared) before the tables' (:func:`_split_default`).
On SQLite, which has no partitions, it deletes the same rows one by one: those older than the
cut-off whose Run is not held. Either way, in one transaction with a ``retention`` event that
records who, why, the cut-off and what went; on SQLite in slices of the old history, oldest
first, each its own transaction with its own event, letting go of the write lock between them
(:data:`SQLITE_SLICE_ROWS`, :data:`SQLITE_SLICE_PAUSE_S`). Retention runs take turns (on
PostgreSQL an advisory lock each takes before it reads anything; on SQLite the write lock, a
slice at a time): a second run plans from what the first left. A dry run only reads: on
PostgreSQL plain ``SELECT`` statements through the partitioned tables, an old month still in
a default partition counted there as the partition a real run would first move it into; on
SQLite a read transaction (``BEGIN``, not ``BEGIN IMMEDIATE``), which neither waits for the
write lock nor holds up the ledger's writers while it counts, and which a read-only file
allows.

A Run is held while it is live (``admitted`` or ``running``: its executor may still write to
it), while its lease is live by retention's clock (an ended Run a session resumed: its next
Attempt is numbered from its rows) or while any of its Attempts is open (``unknown`` or
``dispatching``: an operator may still settle it with evidence, and its story must be whole
for that). A lease taken after the checks and before the drops is found again under the drops'
locks, and the run fails having changed nothing (:func:`_still_unheld`); one taken after the
commit sees the ``retention`` event and is refused (``ledger.decide.ending.trimmed_refusal``).
The events of operators' actions (:data:`~ledger.domain.records.OPERATOR_ACTION_KINDS`) are
never dropped: on PostgreSQL those of a dropped partition are copied back first, into the
default partition (no month partition covers their time any more). Runs, debits and
provenance are not touched; the roll-ups of the hours that lost rows
(:mod:`ledger.storage.rollups`) go with them, so the totals over those hours read what is
left.

What ``/metrics`` counted of the dropped rows (attempts by route and state with their tokens,
money and histograms, moves, capacity waits) is first added, in the same transaction, to the
roll-ups' carried rows (:data:`~ledger.storage.hours.CARRIED_HOUR`, one row per key of
``metric_rollups``, ``move_rollups`` and ``wait_rollups``): its counters are totals over the
whole history and never go down when history is dropped. Only they read those rows; the costs,
charts, spend, health windows and Run pages read the retained history.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, bindparam, func, select, text, true
from sqlalchemy.exc import DBAPIError

from ledger.domain.records import (
    OPERATOR_ACTION_KINDS,
    AttemptState,
    EventRecord,
    HistoryPart,
    Retention,
    RunStatus,
)
from ledger.errors import DatabaseSetupError, DatabaseUnavailable, LedgerError, StorageError
from ledger.storage import partitions as parts
from ledger.storage import schema as s
from ledger.storage.context import ClockFn, SqlContext
from ledger.storage.encode import event_json
from ledger.storage.hours import CARRIED_HOUR, DAY_HOURS, PG_HOUR_LOCK, hour_of, time_range
from ledger.storage.rollups import FOLDED, fold_rows, roll_counts
from ledger.storage.series import metric_counts

#: The roll-ups that keep what ``/metrics`` counted of the dropped history, and their keys
#: (``run_rollups`` is not one: Runs are never dropped).
_CARRIED = {t: k for t, k in FOLDED if t in (s.metric_rollups, s.move_rollups, s.wait_rollups)}

#: How long a retention run waits for a table's lock (or for another retention run to end)
#: before it gives up (and changes nothing).
LOCK_TIMEOUT = "10s"
# The advisory lock that makes retention runs on PostgreSQL take turns (any constant; not the
# migrations' 0x1ED6E5 nor the partitions' 0x1ED6E6).
_PG_RETENTION_LOCK = 0x1ED6E7

_OPEN = tuple(v.value for v in (AttemptState.UNKNOWN, AttemptState.DISPATCHING))
_LIVE = tuple(v.value for v in (RunStatus.ADMITTED, RunStatus.RUNNING))
_ENDED = tuple(v.value for v in RunStatus if v.value not in _LIVE)
_SETS = {"open": list(_OPEN), "live": list(_LIVE), "ended": list(_ENDED),
         "actions": list(OPERATOR_ACTION_KINDS)}


def _leased(r: str = "") -> str:
    """The SQL condition of an ended Run on ``runs`` (``r``: its alias and a dot, if any)
    whose lease is live at ``:now`` (retention's clock): a session resumed it, taking its
    lease before its first begin makes it ``running`` again, and numbers its next Attempt
    from its rows. By status first, so a probe walks the (status, lease_expires_at) index."""
    return (f"{r}status = ANY(:ended) AND {r}lease_holder IS NOT NULL "
            f"AND {r}lease_expires_at > :now")


# The runs a retention run keeps whole: live, resumed (a live lease), or with an open Attempt
# (sql, on any backend).
_HELD_RUNS = ("SELECT run_id FROM runs WHERE status = ANY(:live) "
              f"UNION SELECT run_id FROM runs WHERE {_leased()} "
              "UNION SELECT run_id FROM attempts WHERE state = ANY(:open)")


def _in(sql: str) -> str:
    """``sql`` with ``= ANY(:name)`` spelled for SQLite (``IN`` over an expanding list)."""
    for name in _SETS:
        sql = sql.replace(f"= ANY(:{name})", f"IN :{name}")
    return sql


class RetentionQueries:
    """Retention on one ledger database (see the module docstring)."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx

    def run(self, older_than_s: float, clock: ClockFn, *, by: str, reason: str,
            dry_run: bool) -> Retention:
        """Drop (``dry_run``: only find) the history older than ``older_than_s`` before the
        ledger clock's now, and record a ``retention`` event in the same transaction. On
        PostgreSQL the coming months' partitions are made first (not in a dry run)."""
        if self.ctx.partitioned:
            if dry_run:
                return self._partitions(older_than_s, clock, by, reason, dry_run)
            self._owner_only()
            try:
                parts.ensure_partitions(self.ctx, clock())
                return self._partitions(older_than_s, clock, by, reason, dry_run)
            except StorageError as e:
                if _sqlstate(e) != "42501":
                    raise
                # Not a read-only ledger: this role may write rows but not make or drop
                # tables, and only the tables' owner may.
                raise self._needs_owner(e) from e
        return self._rows(older_than_s, clock, by, reason, dry_run)

    def _owner_only(self) -> None:
        """Refuse a run by a role without the privileges of the tables' owner up front,
        whether or not it has a month to drop or make yet: a retention job set up under the
        runtime role fails its first run, not months later, at the first month it may not
        drop (having recorded runs that dropped nothing until then)."""
        with self.ctx.reading() as conn:
            row = conn.execute(text(
                "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE relname = "
                "'attempts' AND relnamespace = to_regnamespace(current_schema())::oid")).first()
        if row is not None and not row[0]:
            raise self._needs_owner(None)

    def _needs_owner(self, refused: StorageError | None) -> DatabaseSetupError:
        """The error of a retention run the role may not make (``refused``: the server's
        refusal, if it came to one): it names the owner to run it as (when the catalog says
        who owns the tables)."""
        role = owner = database = None
        with contextlib.suppress(LedgerError), self.ctx.reading() as conn:
            role, owner, database = conn.execute(text(
                "SELECT current_user, pg_get_userbyid(relowner), current_database() "
                "FROM pg_class WHERE relname = 'attempts' "
                "AND relnamespace = to_regnamespace(current_schema())::oid")).one()
        said = ("it does not own them" if refused is None else
                str(getattr(refused.__cause__, "orig", None) or refused.__cause__ or refused))
        return DatabaseSetupError(
            f"role {_quoted(role, 'of this URL')} may not drop or create the history's "
            f"partitions ({said.strip().splitlines()[0]}): retention detaches, drops and "
            "creates tables, which takes their owner (a --dry-run only reads: any role that "
            "may SELECT the tables may run it); run `failover-ledger retention` (or "
            f"drop_history) as {_quoted(owner, 'the role that owns the ledger tables')}, the "
            "role that runs `failover-ledger db init`; nothing was dropped or recorded; "
            "retrying will not help (docs/postgresql.md)",
            url=self.ctx.where, problem="schema_privilege", database=database, role=role)

    # -- PostgreSQL: whole partitions -----------------------------------------------------

    def _partitions(self, older_than_s: float, clock: ClockFn, by: str, reason: str,
                    dry_run: bool) -> Retention:
        # A dry run only reads (plain SELECTs, no lock a reader may not take): any role that
        # may SELECT the ledger's tables may run it.
        with self.ctx.reading() if dry_run else self.ctx.writing() as conn:
            self.ctx.bounded_locks(conn, LOCK_TIMEOUT)
            _one_at_a_time(conn, self.ctx.where)
            now = clock()
            cutoff = now - older_than_s
            months = _default_months(conn, cutoff)
            if not dry_run:
                _split_default(conn, months, self.ctx.where)
            dropped: list[HistoryPart] = []
            kept: list[HistoryPart] = []
            # First every check, each old partition locked against inserts (only a write
            # with a back-dated clock goes there); then the drops, which lock the whole
            # tables until commit: the writes of the ledger wait only for the drops.
            for table in parts.PARTITIONED:
                for p, rel, args in _old_partitions(conn, table, cutoff,
                                                    months if dry_run else None):
                    if not dry_run:
                        conn.execute(text(f'LOCK TABLE "{p.name}" IN SHARE MODE'))
                    # An events partition's operator actions are kept: not counted as gone.
                    gone = " WHERE kind <> ALL(:actions)" if table == "events" else ""
                    rows = int(conn.execute(text(f"SELECT count(*) FROM {rel} AS x{gone}"),
                                            {**_SETS, **args}).scalar_one())
                    held = _held(conn, table, rel, {**args, "now": now})
                    part = HistoryPart(table, p.name, p.since, p.until, rows, held)
                    (kept if held else dropped).append(part)
            actions = int(conn.execute(text(
                "SELECT count(*) FROM events WHERE created_at < :cut AND kind = ANY(:actions)"),
                {"cut": cutoff, **_SETS}).scalar_one())
            if dry_run:
                conn.rollback()
                return Retention(cutoff, older_than_s, True, dropped, kept, actions, None)
            for part in dropped:
                # Summed while only its partition is locked (SHARE, since the check: nothing
                # writes to it until the commit), not under the drops' locks, which stop
                # every write of the ledger.
                when = s.attempts.c.created_at if part.table == "attempts" \
                    else s.events.c.created_at
                _carry(self.ctx, conn, part.table,
                       and_(true(), *time_range(when, part.since, part.until)))
            if dropped:
                _lock_as_writers_do(conn)
                _still_unheld(conn, dropped, now, self.ctx.where)
            for part in dropped:
                if part.table == "events":
                    conn.execute(text(f'ALTER TABLE events DETACH PARTITION "{part.partition}"'))
                    conn.execute(text(f'INSERT INTO events SELECT * FROM "{part.partition}" '
                                      "WHERE kind = ANY(:actions)"), _SETS)
                # An attempts partition is dropped attached: detached, it would carry a
                # foreign key of its own to runs, whose drop takes ACCESS EXCLUSIVE on runs
                # (every read and write of the ledger waiting); attached, its key is the
                # parent's and the drop locks attempts only.
                conn.execute(text(f'DROP TABLE "{part.partition}"'))
                # An events partition's too: its moves and waits are carried now, and a
                # month's move_rollups left behind would count them twice.
                _unroll(conn, part.since, part.until)
            event = _record(conn, _data(by, reason, older_than_s, cutoff, dropped,
                                                    kept, actions), now)
        if dropped:
            # Autovacuum analyzes the partitions, never a partitioned table itself: its
            # statistics (what the planner estimates joins with) would go on counting the
            # dropped months. ANALYZE does not block the ledger's writes.
            with self.ctx.writing() as conn:
                conn.execute(text("ANALYZE attempts, events"))
        return Retention(cutoff, older_than_s, False, dropped, kept, actions, event)

    # -- SQLite: rows ---------------------------------------------------------------------

    def _rows(self, older_than_s: float, clock: ClockFn, by: str, reason: str,
              dry_run: bool) -> Retention:
        # One now for every slice: a lease live when the run began holds its Run's rows in each
        # of them (a lease taken between two slices is refused: it sees the first's event).
        now = clock()
        cutoff = now - older_than_s
        args: dict[str, Any] = {"cut": cutoff, "now": now, **_SETS}
        if dry_run:
            # A read transaction (one snapshot), not the write lock: it waits for no writer,
            # holds none up while it counts, and takes its turn with no retention run (it
            # changes nothing they could plan from).
            with self.ctx.reading() as conn:
                dropped = _doomed(conn, args, cutoff)
                kept, actions = _spared(conn, args, cutoff)
            return Retention(cutoff, older_than_s, True, dropped, kept, actions, None)
        gone: dict[str, int] = {}
        since: float | None = None
        while True:
            # One slice of the old history per write transaction, so the ledger's writers
            # wait for one slice, never for the whole run (at 300,000 attempts a single
            # transaction held the write lock for 11.6 s, and a larger history would pass
            # their busy timeout: no call could be recorded, so none could leave).
            with self.ctx.writing() as conn:
                until = _slice_end(conn, since, cutoff, SQLITE_SLICE_ROWS)
                last = until >= cutoff
                part: dict[str, Any] = {**args, "cut": until}
                dropped = _doomed(conn, part, until)
                kept, actions = _spared(conn, args, cutoff) if last else ([], 0)
                for table in parts.PARTITIONED:
                    _carry(self.ctx, conn, table, _bound(_GOING[table], part))
                    conn.execute(_expanding(f"DELETE FROM {table} WHERE {_GOING[table]}"),
                                 part)
                data = _data(by, reason, older_than_s, cutoff, dropped, kept, actions)
                # Each slice's event says which slice it was: a run cut short (a crash, a
                # busy timeout) has recorded every slice it dropped, and the next run takes
                # up from what is left.
                event = _record(conn, {**data, "slice": {"until": until, "last": last}},
                                clock())
            for p in dropped:
                gone[p.table] = gone.get(p.table, 0) + p.rows
            if last:
                break
            since = until
            _pause()
        total = [HistoryPart(t, None, None, cutoff, gone[t]) for t in parts.PARTITIONED
                 if gone.get(t)]
        return Retention(cutoff, older_than_s, False, total, kept, actions, event)


#: On SQLite, the most attempts (with the events of their time) one retention transaction
#: deletes: about 0.2 s of the write lock on a virtual disk (docs/benchmarks.md).
SQLITE_SLICE_ROWS = 5000
#: On SQLite, how long retention lets go of the write lock between two slices.
SQLITE_SLICE_PAUSE_S = 0.1

# SQLite's rows that go (older than :cut, not of a held Run) and that stay (of a held Run).
_GOING = {
    "attempts": f"created_at < :cut AND run_id NOT IN ({_HELD_RUNS})",
    "events": f"created_at < :cut AND kind NOT IN :actions "
              f"AND (run_id IS NULL OR run_id NOT IN ({_HELD_RUNS}))",
}
_STAYING = {
    "attempts": f"created_at < :cut AND run_id IN ({_HELD_RUNS})",
    "events": f"created_at < :cut AND kind NOT IN :actions AND run_id IN ({_HELD_RUNS})",
}


def _pause() -> None:
    """Let go of SQLite's write lock between two slices: writers waiting for it poll every
    100 ms once they have waited a while (SQLite's busy handler), so a pause that long lets
    one in before the next slice takes it again."""
    time.sleep(SQLITE_SLICE_PAUSE_S)


def _doomed(conn: Connection, args: dict[str, Any], until: float) -> list[HistoryPart]:
    """The SQLite rows that go at the cut-off ``args["cut"]`` (== ``until``), per table."""
    counts = ((t, _count(conn, t, _GOING[t], args)) for t in parts.PARTITIONED)
    return [HistoryPart(t, None, None, until, n) for t, n in counts if n]


def _spared(conn: Connection, args: dict[str, Any], cutoff: float
            ) -> tuple[list[HistoryPart], int]:
    """The SQLite rows older than ``cutoff`` (``args["cut"]``) that stay because their Run
    is held, per table, and the operators' actions older than it (which always stay)."""
    kept = []
    for table in parts.PARTITIONED:
        n = _count(conn, table, _STAYING[table], args)
        if n:
            kept.append(HistoryPart(table, None, None, cutoff, n,
                                    "rows of live or leased runs or of runs with an open "
                                    "attempt"))
    return kept, _count(conn, "events", "created_at < :cut AND kind IN :actions", args)


def _slice_end(conn: Connection, since: float | None, cutoff: float, rows: int) -> float:
    """Where the next slice of old history ends: the creation time of the ``rows``-th
    attempt after ``since`` (the previous slice's end) or, with fewer left, ``cutoff``.
    Always past ``since``, so every slice makes progress (attempts created at one instant
    go in one slice, however many)."""
    lo = -math.inf if since is None else since
    a = s.attempts.c.created_at
    end = conn.execute(select(a).where(a >= lo, a < cutoff).order_by(a)
                       .offset(rows).limit(1)).scalar()
    if end is not None and end <= lo:
        end = conn.execute(select(func.min(a)).where(a > lo, a < cutoff)).scalar()
    return cutoff if end is None else float(end)


def _quoted(name: str | None, otherwise: str) -> str:
    return f'"{name}"' if name else otherwise


def _sqlstate(e: BaseException) -> str | None:
    """The SQLSTATE of the driver error under the ledger error ``e``, if any."""
    cause = e.__cause__
    return getattr(getattr(cause, "orig", None) or cause, "sqlstate", None)


def _lock_as_writers_do(conn: Connection) -> None:
    """Lock ``runs``, ``attempts`` and ``events`` for dropping or making partitions, in the
    order the ledger's writes take them: each write locks its Run's row first (``FOR
    UPDATE``), then writes ``attempts`` and ``events``. Holding ``attempts`` while waiting
    for ``runs`` (or the reverse of any pair) deadlocks with such a write in between.
    ``EXCLUSIVE`` is the weakest mode of ``runs`` that a row lock waits for, so no write gets
    past its Run's row while retention waits for ``attempts``; reads of ``runs`` go on. A
    partition's ``DROP``/``DETACH``/``CREATE`` takes ``ACCESS EXCLUSIVE`` on its table."""
    conn.execute(text("LOCK TABLE runs IN EXCLUSIVE MODE"))
    conn.execute(text("LOCK TABLE attempts, events IN ACCESS EXCLUSIVE MODE"))


def _still_unheld(conn: Connection, dropped: list[HistoryPart], now: float,
                  where: str) -> None:
    """Check again, holding the drops' locks, that no partition about to go holds a row of
    a held Run, else fail (nothing dropped or recorded: the run's transaction rolls back).

    The checks took no lock on ``runs``: a session may have resumed an ended Run of such a
    partition since (its lease taken, maybe its first Attempt begun), having read no
    ``retention`` event that passed its admission, as this run's is not committed yet.
    From here on no write gets past a Run's row until the commit (``runs`` is held
    ``EXCLUSIVE``), and a lease taken later reads this run's event once it commits and is
    refused as trimmed: either retention sees the lease or the lease sees the trim."""
    for part in dropped:
        assert part.partition is not None  # a PostgreSQL run drops partitions
        held = _held(conn, part.table, f'"{part.partition}"', {"now": now})
        if held is not None:
            raise DatabaseUnavailable(
                f"database {where}: partition {part.partition} was to be dropped, but since "
                f"retention checked it, it came to hold {held} (a session resumed an ended "
                "Run of that month); nothing was dropped or recorded; run it again: it keeps "
                "that partition", url=where, contention="40001")


def _one_at_a_time(conn: Connection, where: str) -> None:
    """Wait, before reading anything, for a retention run in progress to commit (up to the
    transaction's lock timeout): a second one started at the same moment then plans from what
    the first left (the months it dropped are gone: it drops and carries nothing twice),
    instead of locking the same partitions in another order (a deadlock the server breaks
    only after holding every write of the ledger for a second)."""
    try:
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_RETENTION_LOCK})
    except DBAPIError as e:
        if getattr(e.orig, "sqlstate", None) != "55P03":
            raise
        raise DatabaseUnavailable(
            f"database {where}: another retention run held the retention lock for longer "
            f"than the lock timeout ({LOCK_TIMEOUT}); nothing was dropped or recorded; run it "
            "again once that run is done (retention runs one at a time)",
            url=where, contention="55P03") from e


def _default_months(conn: Connection, cutoff: float) -> list[tuple[str, int, int]]:
    """The months that ended by ``cutoff`` and have rows in a default partition (written
    while no partition of their month existed), per table: (table, year, month)."""
    todo: list[tuple[str, int, int]] = []
    for table in parts.PARTITIONED:
        have = {p.name: p for p in parts.partitions(conn, table)}
        if f"{table}_default" not in have:
            continue
        # Operators' actions a dropped partition left in the default one stay there.
        actions = " AND kind <> ALL(:actions)" if table == "events" else ""
        months = conn.execute(text(
            "SELECT DISTINCT extract(year FROM t)::int, extract(month FROM t)::int FROM ("
            "SELECT to_timestamp(created_at) AT TIME ZONE 'UTC' AS t "
            f'FROM "{table}_default" WHERE created_at < :cut{actions}) AS m'),
            {"cut": cutoff, **_SETS}).all()
        todo += [(table, y, m) for y, m in months if parts.month_range(y, m)[1] <= cutoff
                 and parts.partition_name(table, y, m) not in have]
    return todo


def _split_default(conn: Connection, months: list[tuple[str, int, int]], where: str) -> None:
    """Give each of ``months`` (:func:`_default_months`) its own partition, so retention can
    drop it like any other: rows never stay in a default partition for ever.

    Moving a month's rows fires the roll-ups' row triggers (migrations 0011, 0013), each of
    which takes its row's hour lock shared, waiting for a roll-up that holds it exclusive;
    that roll-up then reads ``attempts``, which retention holds from
    :func:`_lock_as_writers_do` on: a deadlock. So the hours are taken first, before any
    table lock (:func:`_hold_hours`), and the triggers find them held."""
    if not months:
        return
    _hold_hours(conn, months, wait=True)
    # A new partition of attempts locks runs too (its foreign key): all of them first.
    _lock_as_writers_do(conn)
    # A row written into an old month since (a writer with a clock months behind) may be in
    # an hour not taken: taken now without waiting, since waiting here, holding the tables,
    # is the deadlock above.
    if not _hold_hours(conn, months, wait=False):
        raise DatabaseUnavailable(
            f"database {where}: a roll-up held an hour of the old months that retention moves "
            "out of the default partition, and a write had just added a row to it; nothing "
            "was dropped or recorded; run it again once the roll-up is done",
            url=where, contention="55P03")
    for table, y, m in months:
        parts.create_partition(conn, table, y, m)


# The hour of a row's ``created_at``, as the triggers compute it (floor of the quotient, less
# one where it was rounded up to the next hour), and the key of its lock (as an int4, with
# PostgreSQL's sign-keeping ``%``, as the triggers and ``lock_hour`` make it).
_PG_HOUR = "floor(created_at / 3600)::bigint - (floor(created_at / 3600) * 3600 > created_at)::int"
_PG_HOUR_KEY = f"{PG_HOUR_LOCK}, (h % 2147483648)::integer"


def _hold_hours(conn: Connection, months: list[tuple[str, int, int]], *, wait: bool) -> bool:
    """Take, shared, the hour lock of every hour holding a row of ``months`` in a default
    partition that moving it fires a trigger for (every attempt; the events of
    :data:`~ledger.storage.schema.ROLLED_EVENTS`), in one statement, ascending. With ``wait``
    it waits for a roll-up holding one (up to the lock timeout); without, it returns whether
    all are held now (those this transaction holds already always are). The hours that hold
    rows, not the months' every hour: as many locks as the triggers take anyway (the
    server's lock table is shared and bounded, ``max_locks_per_transaction``)."""
    picks = []
    args: dict[str, Any] = {"rolled": list(s.ROLLED_EVENTS)}
    for table in parts.PARTITIONED:
        spans = []
        for i, (t, y, m) in enumerate(months):
            if t == table:
                args[f"lo{i}"], args[f"hi{i}"] = parts.month_range(y, m)
                spans.append(f"(created_at >= :lo{i} AND created_at < :hi{i})")
        if spans:
            kinds = "kind = ANY(:rolled) AND " if table == "events" else ""
            picks.append(f'SELECT {_PG_HOUR} AS h FROM "{table}_default" '
                         f"WHERE {kinds}({' OR '.join(spans)})")
    take = "pg_advisory_xact_lock_shared" if wait else "pg_try_advisory_xact_lock_shared"
    # count() of a void function counts its calls; bool_and() whether every one was granted.
    agg = "count" if wait else "bool_and"
    held = conn.execute(text(
        f"SELECT {agg}({take}({_PG_HOUR_KEY})) FROM ("
        f"SELECT h FROM ({' UNION '.join(picks)}) AS u ORDER BY h) AS x"), args).scalar_one()
    return wait or held is not False


def _old_partitions(conn: Connection, table: str, cutoff: float,
                    unsplit: list[tuple[str, int, int]] | None
                    ) -> list[tuple[parts.Partition, str, dict[str, Any]]]:
    """``table``'s partitions whose month ended by ``cutoff``, oldest first, each with the
    relation to read its rows from (SQL) and that relation's parameters.

    ``unsplit`` (a dry run's :func:`_default_months`, still in the default partition) adds
    those months, as the partitions the real run first moves them into (their names, their
    rows), and makes every month read through ``table`` by its range: no table made, no lock,
    and no grant on a partition (a month's partition made after a reader's ``GRANT SELECT``
    has none of its own; the parent's is what counts)."""
    old = [p for p in parts.partitions(conn, table) if p.until is not None and p.until <= cutoff]
    if unsplit is None:
        return [(p, f'"{p.name}"', {}) for p in old]
    for t, y, m in unsplit:
        if t == table:
            old.append(parts.Partition(table, parts.partition_name(table, y, m),
                                       *parts.month_range(y, m)))
    rel = f'(SELECT * FROM "{table}" WHERE created_at >= :since AND created_at < :until)'
    return [(p, rel, {"since": p.since, "until": p.until})
            for p in sorted(old, key=lambda p: p.since or 0.0)]


def _carry(ctx: SqlContext, conn: Connection, table: str, dropped: ColumnElement[bool]
           ) -> None:
    """Add what ``/metrics`` counts of history ``table``'s rows ``dropped`` (about to go) to
    the roll-ups' carried rows (:data:`~ledger.storage.hours.CARRIED_HOUR`), kept to one per
    key: its counters are totals over the whole history, and one that went down at a
    retention run would read as a reset to Prometheus (a false spike in every ``rate()``).
    Only those counters read them; every read over a window counts the retained history."""
    for c in metric_counts(ctx, s.METRIC_BOUNDS):
        if c.table in _CARRIED and c.time.table.name == table:
            roll_counts(conn, c, CARRIED_HOUR, dropped)
            fold_rows(conn, c.table, _CARRIED[c.table], CARRIED_HOUR, CARRIED_HOUR)


def _bound(where: str, args: dict[str, Any]) -> ColumnElement[bool]:
    """The SQL condition ``where`` with the values of its parameters in ``args`` bound."""
    sql = _in(where)
    return and_(true(), text(sql).bindparams(*(bindparam(k, value=v, expanding=k in _SETS)
                                               for k, v in args.items() if f":{k}" in sql)))


def _unroll(conn: Connection, since: float | None, until: float | None) -> None:
    """Delete the roll-ups of the days of ``[since, until)`` (a dropped partition's, whose
    rows went without a row trigger; on SQLite each deleted row's trigger does it): whole
    UTC days, since a folded day's rows (at its first hour) count all its hours. The rows
    carried over from dropped history stay."""
    lo = None if since is None else hour_of(since) // DAY_HOURS
    hi = None if until is None else hour_of(until) // DAY_HOURS + 1  # the days [lo, hi)
    conn.execute(s.rollup_days.delete().where(*time_range(s.rollup_days.c.day, lo, hi)))
    first = None if lo is None else lo * DAY_HOURS
    end = None if hi is None else hi * DAY_HOURS
    for table in (s.rollup_hours, s.attempt_rollups, s.metric_rollups, s.move_rollups,
                  s.wait_rollups, s.run_rollups):
        conn.execute(table.delete().where(table.c.hour != CARRIED_HOUR,
                                          *time_range(table.c.hour, first, end)))


def _held(conn: Connection, table: str, rel: str, args: dict[str, Any]) -> str | None:
    """Why the rows of ``rel`` (a partition of ``table``, or its rows of one month, with the
    parameters ``args``) must stay (``None``: they may go). Each probe starts from the few
    held Runs and open Attempts and uses the partition's indexes."""
    reasons = []
    args = {**_SETS, **args}
    if table == "attempts":
        n = conn.execute(text(f"SELECT count(*) FROM {rel} AS x WHERE state = ANY(:open)"),
                         args).scalar_one()
        if n:
            reasons.append(f"{n} open (unknown or dispatching) attempt(s)")
    n = conn.execute(text(
        f"SELECT count(DISTINCT r.run_id) FROM runs r WHERE r.status = ANY(:live) "
        f"AND EXISTS (SELECT 1 FROM {rel} x WHERE x.run_id = r.run_id)"), args).scalar_one()
    if n:
        reasons.append(f"rows of {n} live run(s)")
    n = conn.execute(text(
        f"SELECT count(DISTINCT r.run_id) FROM runs r WHERE {_leased('r.')} "
        f"AND EXISTS (SELECT 1 FROM {rel} x WHERE x.run_id = r.run_id)"), args).scalar_one()
    if n:
        reasons.append(f"rows of {n} ended run(s) resumed under a live lease")
    n = conn.execute(text(
        f"SELECT count(DISTINCT o.run_id) FROM attempts o WHERE o.state = ANY(:open) "
        f"AND EXISTS (SELECT 1 FROM {rel} x WHERE x.run_id = o.run_id)"), args).scalar_one()
    if n:
        reasons.append(f"rows of {n} run(s) with an open attempt")
    return "; ".join(reasons) or None


def _record(conn: Connection, data: dict[str, Any], now: float) -> EventRecord:
    """The ``retention`` event (of no Run), written on ``conn``; returned as recorded."""
    key = conn.execute(s.events.insert().values(
        run_id=None, attempt_id=None, kind="retention", data=event_json(data), created_at=now,
    )).inserted_primary_key
    assert key is not None  # an INSERT of one row always has its key
    stored = conn.execute(select(s.events.c.data).where(s.events.c.event_id == key[0])
                          ).scalar_one()
    return EventRecord(int(key[0]), None, None, "retention", json.loads(stored), now)


def _expanding(sql: str) -> Any:
    sql = _in(sql)
    return text(sql).bindparams(*(bindparam(k, expanding=True) for k in _SETS
                                  if f":{k}" in sql))


def _count(conn: Connection, table: str, where: str, args: dict[str, Any]) -> int:
    return int(conn.execute(_expanding(f"SELECT count(*) FROM {table} WHERE {where}"),
                            args).scalar_one())


def _data(by: str, reason: str, older_than_s: float, cutoff: float,
          dropped: list[HistoryPart], kept: list[HistoryPart], actions: int) -> dict[str, Any]:
    def part(p: HistoryPart) -> dict[str, Any]:
        out = {"table": p.table, "partition": p.partition, "since": p.since,
               "until": p.until, "rows": p.rows}
        return out if p.held is None else {**out, "held": p.held}

    return {"by": by, "reason": reason, "older_than_s": older_than_s, "cutoff": cutoff,
            "dropped": [part(p) for p in dropped], "kept": [part(p) for p in kept],
            "rows": {t: sum(p.rows for p in dropped if p.table == t) for t in parts.PARTITIONED},
            "actions_kept": actions}


__all__ = ["LOCK_TIMEOUT", "SQLITE_SLICE_PAUSE_S", "SQLITE_SLICE_ROWS", "RetentionQueries"]
