"""The hot path's statements: built once with SQLAlchemy Core from :mod:`ledger.storage.schema`,
compiled once per database.

Each statement is a function of the database's few spellings (its ``INSERT ... ON CONFLICT``, how
a list parameter is passed) and of how its parameters are named, returning a Core construct over
the schema's tables; the columns are the schema's, never restated. :class:`Statements` compiles
each one for its database the first time a transaction uses it, with SQLAlchemy's public
compiler (``construct.compile(dialect=...)``), and keeps the text, the parameter names in the
order the text takes them, and the names of the columns it returns (:class:`Stmt`). The
transactions (:mod:`ledger.storage.hot`) name statements as attributes
(``sql.lock_run``); the drivers (:mod:`ledger.storage.driver`) execute the compiled text on
the database's own driver — ``sqlite3`` with named parameters, psycopg with positional ones.

Where the databases differ, SQLAlchemy's dialects render it (``FOR UPDATE`` and ``SKIP LOCKED``
are dropped on SQLite, whose ``BEGIN IMMEDIATE`` already serializes writers), two small
constructs compiled per dialect say the rest (:class:`in_list`, :class:`greatest`), and on
PostgreSQL the writes that end a transaction are fused into one statement of data-modifying
CTEs (:meth:`Statements.writes`): each write is built again with its own parameter names and
added to one ``SELECT`` as a CTE, compiled once per shape of writes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from sqlalchemy import (
    Table,
    and_,
    bindparam,
    case,
    delete,
    false,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.dialects.sqlite.base import SQLiteDialect
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter, ColumnElement
from sqlalchemy.sql.functions import FunctionElement, ReturnTypeFromArgs
from sqlalchemy.types import NullType

from ledger.storage import schema as s
from ledger.storage.driver import Q

#: The PostgreSQL channel told (payload: the group id) when a slot of a group with waiters is
#: freed (a trigger, migration 0006) or a waiter leaves its queue.
QUEUE_CHANNEL = "ledger_slots"

#: Names one parameter of a statement (``bindparam`` itself, or one that adds a prefix).
Namer = Callable[[str], BindParameter[Any]]
#: A statement: a Core construct built from the database's spellings and a :data:`Namer` (an
#: INSERT of several rows takes one namer per row).
Build = Callable[..., Any]


# -- what SQLAlchemy's dialects do not say for us ------------------------------------------------


class in_list(FunctionElement[Any]):
    """``column IN <one list parameter>``, one SQL text whatever the list's length: PostgreSQL's
    ``= ANY(array)``, SQLite's ``IN (SELECT value FROM json_each(json array))``. The value is
    passed as :meth:`Spelling.list_param` makes it."""

    # Not Boolean: a dialect without a boolean type would compare the whole clause with 1.
    type = NullType()
    name = "in_list"
    inherit_cache = True


@compiles(in_list)
def _in_any(element: in_list, compiler: SQLCompiler, **kw: Any) -> str:
    column, param = element.clauses
    return f"{compiler.process(column, **kw)} = ANY({compiler.process(param, **kw)})"


@compiles(in_list, "sqlite")
def _in_json_each(element: in_list, compiler: SQLCompiler, **kw: Any) -> str:
    column, param = element.clauses
    return (f"{compiler.process(column, **kw)} IN "
            f"(SELECT value FROM json_each({compiler.process(param, **kw)}))")


class greatest(ReturnTypeFromArgs[Any]):
    """The larger of its arguments: ``GREATEST`` (PostgreSQL), the scalar ``MAX`` (SQLite)."""

    inherit_cache = True


@compiles(greatest, "sqlite")
def _scalar_max(element: greatest, compiler: SQLCompiler, **kw: Any) -> str:
    return f"MAX({compiler.process(element.clauses, **kw)})"


def lit(value: str | int) -> ColumnElement[Any]:
    """A constant written into the statement's text (a plain Python value would become a
    parameter, which the transactions do not pass)."""
    return literal_column(f"'{value}'" if isinstance(value, str) else str(int(value)))


@dataclass(frozen=True)
class Spelling:
    """What the hot path's SQL says differently on one database: the SQLAlchemy dialect it is
    compiled for (``target``, with the driver's parameter style), its ``INSERT`` (with ``ON
    CONFLICT``), how a list parameter is passed, whether the writes that end a transaction are
    fused into one statement, and whether a freed slot is told to other processes
    (``NOTIFY``)."""

    target: Dialect
    insert: Callable[[Table], Any]
    list_param: Callable[[Sequence[Any]], Any]
    fuse_writes: bool
    notifies: bool
    #: Whether a limited group's slots are numbered (a unique slot number per group, taken
    #: without the group's lock; :func:`ledger.storage.hot.begin_tx`), or counted under the
    #: group's lock (SQLite, whose writers are serialized anyway).
    numbers_slots: bool


SQLITE_SPELLING = Spelling(
    # sqlite3 takes a mapping for named parameters as it is: no list to build per statement.
    target=SQLiteDialect(paramstyle="named"),
    insert=sqlite_insert,
    list_param=lambda values: json.dumps(list(values)),
    fuse_writes=False,  # no round trips to save
    notifies=False,  # no channel: waiters in other processes poll
    numbers_slots=False,  # BEGIN IMMEDIATE serializes every writer anyway
)


@functools.cache
def postgres_spelling() -> Spelling:
    """The spelling for PostgreSQL, made on first use and kept: SQLAlchemy's PostgreSQL
    dialect is a large import that a process on a SQLite ledger never needs."""
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.postgresql.base import PGDialect

    return Spelling(
        # psycopg is given a sequence of values (it costs the driver less than a mapping); the
        # base dialect renders no casts on the parameters.
        target=PGDialect(paramstyle="format"),  # type: ignore[no-untyped-call]
        insert=pg_insert,
        list_param=list,
        fuse_writes=True,
        notifies=True,
        numbers_slots=True,
    )


# -- a compiled statement ---------------------------------------------------------------------


class Stmt:
    """One statement compiled for one database: its ``text``, the parameter ``names`` in the
    order a positional driver passes them, the ``columns`` it returns (empty: no rows to fetch;
    describing a result costs the client work) and the ``build`` it came from."""

    __slots__ = ("build", "columns", "name", "names", "rows", "text")

    def __init__(self, name: str, text: str, names: tuple[str, ...], columns: tuple[str, ...],
                 build: Build | None) -> None:
        self.name = name
        self.text = text
        self.names = names
        self.columns = columns
        #: Whether it returns rows (only those are fetched).
        self.rows = bool(columns)
        self.build = build

    def args(self, params: Any) -> list[Any]:
        """The values of ``params`` (a mapping) in the order of :attr:`names`."""
        return [params[n] for n in self.names]

    def __repr__(self) -> str:
        return f"<Stmt {self.name}: {self.text!r}>"


class Fused(Stmt):
    """Several writes as one statement (data-modifying CTEs); its parameters are gathered from
    the writes' own (``plan``: for each position, the write, its row or -1, and the name)."""

    __slots__ = ("plan",)

    def __init__(self, name: str, text: str, plan: tuple[tuple[int, int, str], ...]) -> None:
        super().__init__(name, text, (), (), None)
        self.plan = plan

    def args(self, params: Any) -> list[Any]:
        """The values of the fused writes ``params`` (a sequence of :class:`Q`), in order."""
        return [(params[i].params if j < 0 else params[i].params[j])[key]
                for i, j, key in self.plan]


def compile_stmt(name: str, construct: Any, dialect: Dialect,
                 build: Build | None = None) -> Stmt:
    """``construct`` compiled for ``dialect``, with its parameter order and its columns.

    Every parameter must be one the transactions pass (a ``bindparam`` without a value): a
    Python constant or a column default would become a parameter nobody passes, so it is
    refused here, when the statement is first compiled, not at its first execution.
    """
    compiled = construct.compile(dialect=dialect)
    assert isinstance(compiled, SQLCompiler)
    stray = sorted(n for n, b in compiled.binds.items() if not b.required)
    if stray:
        raise TypeError(f"statement {name!r} has parameters the transactions do not pass: "
                        f"{stray}; write constants with lit() and every column explicitly")
    names = tuple(compiled.positiontup or ())
    columns = tuple(construct.exported_columns.keys())
    return Stmt(name, str(compiled), names, columns, build)


# -- the statements ---------------------------------------------------------------------------

class _stmt:
    """A statement of :class:`Statements`: built and compiled for the instance's database on
    first use, then kept in the instance's ``__dict__`` (read as fast as any attribute)."""

    def __init__(self, build: Build) -> None:
        self.build = build

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Statements | None, owner: type) -> Any:
        if obj is None:
            return self
        stmt = obj.compile(self.name, self.build)
        obj.__dict__[self.name] = stmt
        return stmt


_runs, _att, _deb, _groups, _slots, _waiters, _health, _events, _prov = (
    s.runs, s.attempts, s.debits, s.capacity_groups, s.group_slots, s.group_waiters, s.health,
    s.events, s.provenance)


def run_tree(root: ColumnElement[Any]) -> Any:
    """The ids of the Run ``root`` and of all its descendants: a recursive CTE down the
    ``parent_run_id`` index (both databases take ``WITH RECURSIVE``)."""
    anchor = select(_runs.c.run_id).where(_runs.c.run_id == root)
    tree = anchor.cte("run_tree", recursive=True)
    tree = tree.union_all(select(_runs.c.run_id).where(_runs.c.parent_run_id == tree.c.run_id))
    return select(tree.c.run_id)


#: The health row as the health record reads it (the rest is its identity and bookkeeping).
HEALTH_READ = tuple(c for c in _health.c if c.name not in ("kind", "provider", "updated_at"))
#: The health columns an update writes.
HEALTH_WRITE = tuple(c for c in _health.c if c.name not in ("key", "kind", "provider"))
#: The attempt columns a begin writes (the rest are the settle's).
_SETTLED = ("fact", "category", "http_status", "prompt_tokens", "completion_tokens",
            "cost_micros", "model_reported", "output_hash", "settle_hash", "settle_fence",
            # what the settle measured: times from the begin, the token details
            "latency_s", "first_byte_s", "first_token_s", "cached_tokens", "reasoning_tokens")
_BEGUN = tuple(c for c in _att.c if c.name not in _SETTLED)
_SETTLE_SET = (*(c for c in _att.c if c.name in _SETTLED or c.name in (
    "state", "effective_output", "tool_started")), _att.c.settled_at)


def _cols(table: Table, *names: str) -> list[ColumnElement[Any]]:
    return [table.c[n] for n in names]


#: What an ended Child gives back is worked out from (ledger.domain.records.carve_return).
CARVE_COLS = ("run_id", "status", "parent_run_id", "max_calls", "max_retries",
              "max_cost_micros", "max_tokens", "calls_used", "retries_used",
              "reserved_micros", "posted_micros", "tokens_used", "tokens_reserved",
              "carved_calls", "carved_retries", "carved_micros", "carved_tokens",
              "returned_calls", "returned_retries", "returned_micros", "returned_tokens")


def _run_lock(*names: str) -> Build:
    def build(k: Spelling, p: Namer = bindparam) -> Any:
        return (select(*_cols(_runs, *names)).where(_runs.c.run_id == p("run_id"))
                .with_for_update())
    return build


# A group's slots joined to their runs, and the condition that a slot's lease (of the same
# fence) may still be live.
_SLOT_RUNS = _slots.join(_runs, _runs.c.run_id == _slots.c.run_id)
# Until when each slot counts (schema.held_until: NULL once it does not), the one definition.
_SLOT_HELD_UNTIL = s.held_until(_slots.c.fence).label("held_until")


def _event_rows(k: Spelling, *rows: Namer) -> Any:
    return k.insert(_events).values([{
        "run_id": p("run_id"), "attempt_id": p("attempt_id"), "kind": p("kind"),
        "data": p("data"), "created_at": p("created_at")} for p in rows or (bindparam,)])


def _run_counters(p: Namer, *failed_over: ColumnElement[bool]) -> dict[str, Any]:
    """A settle's (or a voided begin's) release of the run's holds; ``failed_over``: more
    that makes the Run one that failed over, beside a ``move`` written with it."""
    r = _runs.c
    return {"reserved_micros": r.reserved_micros - p("release"),
            "posted_micros": r.posted_micros + p("posted"),
            "tokens_reserved": r.tokens_reserved - p("release_tokens"),
            "tokens_used": r.tokens_used + p("tokens"),
            "calls_used": r.calls_used - p("uncount"), "updated_at": p("now"),
            # ``moved``: the transaction writes a ``move`` event (the audit's rule, 0012).
            "failed_over": or_(r.failed_over, p("moved"), *failed_over)}


def _group_fact(k: Spelling, p: Namer = bindparam) -> Any:
    # One upsert; a later fact never shortens a known waiting floor.
    ins = k.insert(_groups).values(
        group_id=p("group"), mode=p("mode"), until=p("until"), reason=p("reason"),
        sampled_at=p("now"), updated_at=p("now"))
    new, old = ins.excluded, _groups.c
    return ins.on_conflict_do_update(index_elements=[old.group_id], set_={
        "mode": new.mode, "reason": new.reason, "sampled_at": new.sampled_at,
        "updated_at": new.updated_at,
        "until": case((and_(old.mode != lit("open"), old.until.is_not(None),
                            new.until.is_not(None)), greatest(old.until, new.until)),
                      else_=new.until)})


def _forget_probes(k: Spelling, p: Namer = bindparam) -> Any:
    # Probe state is bounded like GoClaw's throttle map: times past the TTL are forgotten,
    # and of the others only the newest `keep` stay besides the key just claimed. Rows
    # another transaction holds are skipped (PostgreSQL), so concurrent claims never wait
    # on each other's evictions; the bound is exact when claims do not overlap.
    held, newest = _health.alias("held"), _health.alias("newest")
    keep = (select(newest.c.key).where(newest.c.last_probe_at.is_not(None),
                                       newest.c.key != p("key"))
            .order_by(newest.c.last_probe_at.desc(), newest.c.key.desc())
            .limit(p("keep")).offset(lit(0)))  # SQLite says OFFSET with a LIMIT
    stale = (select(held.c.key).where(
        held.c.last_probe_at.is_not(None), held.c.key != p("key"),
        or_(held.c.last_probe_at <= p("expired"), held.c.key.not_in(keep)))
        .with_for_update(skip_locked=True))
    return update(_health).where(_health.c.key.in_(stale)).values(last_probe_at=null())


class Statements:
    """The hot path's statements on one database, each compiled the first time it is used.

    One instance per database kind (:data:`SQLITE`, :data:`POSTGRES`) serves every store of
    the process. A statement is an attribute (``sql.lock_run``: a :class:`Stmt`); the
    transactions pass its parameters by name.
    """

    #: A bound on the fused statements kept (their shapes are few; never unbounded).
    MAX_FUSED: ClassVar[int] = 4096

    def __init__(self, spelling: Spelling) -> None:
        self.spelling = spelling
        self.list_param = spelling.list_param
        self._fused: dict[tuple[tuple[Stmt, int], ...], Fused] = {}
        #: Tells other processes that a group's queue changed; None: there is no channel, and
        #: waiters in other processes find out by polling.
        self.NOTIFY_QUEUE: Stmt | None = (
            self.compile("notify_queue", lambda k, p=bindparam: select(
                func.pg_notify(lit(QUEUE_CHANNEL), p("group"))))
            if spelling.notifies else None)

    def compile(self, name: str, build: Build) -> Stmt:
        """``build`` made for this database and compiled (see :func:`compile_stmt`)."""
        return compile_stmt(name, build(self.spelling), self.spelling.target, build)

    def writes(self, items: Sequence[Q]) -> tuple[Q, ...]:
        """The writes that end a transaction, as this database takes them best: as they are,
        or (PostgreSQL) as one statement of data-modifying CTEs — every statement costs the
        client a round of work in the driver, and these touch distinct rows, none reading
        another's writes, so one snapshot serves them all."""
        if not self.spelling.fuse_writes or len(items) < 2:
            return tuple(items)
        # The writes a transaction ends with are this module's statements (a Q only needs
        # the driver's narrower Statement).
        shape = tuple((cast(Stmt, q.stmt), len(q.params) if q.many else -1) for q in items)
        fused = self._fused.get(shape)
        if fused is None:
            fused = self._fuse(shape)
            if len(self._fused) < self.MAX_FUSED:
                self._fused[shape] = fused
        return (Q(fused, items),)

    def _fuse(self, shape: tuple[tuple[Stmt, int], ...]) -> Fused:
        where: dict[str, tuple[int, int, str]] = {}

        def namer(i: int, j: int) -> Namer:
            prefix = f"p{i}_" if j < 0 else f"p{i}_{j}_"

            def name(key: str) -> BindParameter[Any]:
                where[prefix + key] = (i, j, key)
                return bindparam(prefix + key)
            return name

        ctes = []
        for i, (stmt, n) in enumerate(shape):
            if n == 0:
                continue  # a batch of no rows writes nothing
            assert stmt.build is not None, stmt
            rows = [namer(i, -1)] if n < 0 else [namer(i, j) for j in range(n)]
            ctes.append(stmt.build(self.spelling, *rows).cte(f"w{i}"))
        name = "+".join(stmt.name for stmt, _ in shape)
        compiled = compile_stmt(name, select(lit(1)).add_cte(*ctes), self.spelling.target)
        return Fused(name, compiled.text, tuple(where[n] for n in compiled.names))

    # -- the read of a decision --------------------------------------------------------------

    run_live = _stmt(lambda k, p=bindparam: select(*_cols(
        _runs, "status", "calls_used", "retries_used", "reserved_micros", "posted_micros",
        "tokens_used", "tokens_reserved", "carved_calls", "carved_retries", "carved_micros",
        "carved_tokens", "current_route", "current_profile", "lease_holder", "fence",
        "lease_expires_at", "updated_at", "compactions", "profile_compactions",
        "returned_calls", "returned_retries", "returned_micros", "returned_tokens",
    )).where(_runs.c.run_id == p("run_id")))
    groups = _stmt(lambda k, p=bindparam: select(*_cols(
        _groups, "group_id", "max_in_flight", "mode", "until", "sampled_at",
    )).where(in_list(_groups.c.group_id, p("groups"))))
    group_slots = _stmt(lambda k, p=bindparam: select(
        _slots.c.group_id, _SLOT_HELD_UNTIL,
    ).select_from(_SLOT_RUNS).where(in_list(_slots.c.group_id, p("groups"))))
    health = _stmt(lambda k, p=bindparam: select(*HEALTH_READ).where(
        in_list(_health.c.key, p("keys"))))
    provenance = _stmt(lambda k, p=bindparam: select(_prov.c.ref, _prov.c.content_hash).where(
        in_list(_prov.c.run_id, p("runs")), in_list(_prov.c.ref, p("refs"))))
    # What the whole tree of the Run ``root`` recorded under ``refs``: read only for refs its
    # own line (the Run and its ancestors, above) did not record, since the recursive walk
    # costs SQLite several times that plain read.
    tree_provenance = _stmt(lambda k, p=bindparam: select(
        _prov.c.ref, _prov.c.content_hash,
    ).where(_prov.c.run_id.in_(run_tree(p("root"))), in_list(_prov.c.ref, p("refs"))))
    # A turn's Attempts sent before it started and still without a receipt: the turn must
    # not send that request again (invariant 6). Unordered, with ``seq`` for the caller to
    # sort: ordered by ``seq``, SQLite (no ANALYZE) walks the Run's whole (run_id, seq) index
    # instead of the few rows (run_id, state) finds, on every turn of a long Run.
    unreceipted = _stmt(lambda k, p=bindparam: select(_att.c.attempt_id, _att.c.seq).where(
        _att.c.run_id == p("run_id"), _att.c.turn_id == p("turn_id"),
        or_(_att.c.state == lit("unknown"), _att.c.state == lit("dispatching"))))

    # -- locks ---------------------------------------------------------------------------------

    lock_run = _stmt(_run_lock(
        "fence", "lease_holder", "lease_expires_at", "max_calls", "carved_calls", "calls_used",
        "max_cost_micros", "carved_micros", "reserved_micros", "posted_micros", "max_retries",
        "carved_retries", "retries_used", "max_tokens", "carved_tokens", "tokens_reserved",
        "tokens_used", "labels", "returned_calls", "returned_retries", "returned_micros",
        "returned_tokens"))
    lock_run_full = _stmt(_run_lock("fence", "lease_holder", "lease_expires_at", "max_retries",
                                    "carved_retries", "retries_used", "returned_retries"))
    lock_run_fence = _stmt(_run_lock("fence", "lease_holder", "lease_expires_at", "max_tokens",
                                     "status", "created_at", "parent_run_id"))
    # A Run's budget and counters, locked: an ended Child's and its parent's, when the Child
    # gives back what it has left (ledger.storage.hot.give_back_tx).
    lock_run_carve = _stmt(_run_lock(*CARVE_COLS))
    lock_group = _stmt(lambda k, p=bindparam: select(
        _groups.c.mode, _groups.c.until, _groups.c.max_in_flight,
    ).where(_groups.c.group_id == p("group")).with_for_update())
    lock_health = _stmt(lambda k, p=bindparam: select(*HEALTH_READ).where(
        _health.c.key == p("key")).with_for_update())

    # -- begin ---------------------------------------------------------------------------------

    # Its own statement, after the run's lock: in READ COMMITTED it sees every begin of the run
    # that committed while the lock was awaited (a locking statement's other reads would not).
    begin_lookup = _stmt(lambda k, p=bindparam: select(
        select(func.coalesce(func.max(_att.c.seq), lit(0)) + lit(1))
        .where(_att.c.run_id == p("run_id")).scalar_subquery(),
        select(_att.c.attempt_id).where(_att.c.attempt_id == p("attempt_id")).scalar_subquery(),
        _groups.c.group_id, _groups.c.max_in_flight, _groups.c.mode, _groups.c.until,
    ).select_from(select(lit(1).label("one")).subquery("o").outerjoin(
        _groups, _groups.c.group_id == p("group"))))
    ensure_group = _stmt(lambda k, p=bindparam: k.insert(_groups).values(
        group_id=p("group"), mode=lit("open"), updated_at=p("now")).on_conflict_do_nothing())
    slot_expiries = _stmt(lambda k, p=bindparam: select(
        _slots.c.attempt_id, _slots.c.slot_no, _SLOT_HELD_UNTIL,
    ).select_from(_SLOT_RUNS).where(_slots.c.group_id == p("group")))
    # A numbered slot, taken only while its number is below the group's limit as committed
    # when the statement starts; nothing when another slot holds the number (the unique
    # index waits for that slot's transaction, then refuses it).
    claim_slot = _stmt(lambda k, p=bindparam: k.insert(_slots).from_select(
        [c.name for c in _slots.c],
        select(*(p(c.name) for c in _slots.c)).where(
            select(lit(1)).where(_groups.c.group_id == p("group_id"),
                                 _groups.c.max_in_flight > p("slot_no")).exists()),
    ).on_conflict_do_nothing().returning(_slots.c.attempt_id))
    # A lapsed slot gives its number up (its row stays until its attempt is settled or
    # recovered); only while it still holds that number.
    free_slot_no = _stmt(lambda k, p=bindparam: update(_slots).where(
        _slots.c.attempt_id == p("attempt_id"), _slots.c.slot_no == p("slot_no"),
    ).values(slot_no=null()))
    waiters = _stmt(lambda k, p=bindparam: select(
        _waiters.c.ticket, _waiters.c.waiter_id, _waiters.c.enqueued_at, _waiters.c.expires_at,
        s.held_until(_waiters.c.fence).label("held_until"),
    ).select_from(_waiters.outerjoin(_runs, _runs.c.run_id == _waiters.c.run_id))
        .where(_waiters.c.group_id == p("group")).order_by(_waiters.c.ticket))
    insert_waiter = _stmt(lambda k, p=bindparam: k.insert(_waiters).values({
        c: p(c) for c in ("group_id", "waiter_id", "run_id", "fence", "enqueued_at",
                          "expires_at")}).returning(_waiters.c.ticket))
    drop_waiters = _stmt(lambda k, p=bindparam: delete(_waiters).where(
        _waiters.c.group_id == p("group"), in_list(_waiters.c.ticket, p("tickets"))))
    leave_queue = _stmt(lambda k, p=bindparam: delete(_waiters).where(
        _waiters.c.waiter_id == p("waiter_id")))
    insert_debit = _stmt(lambda k, p=bindparam: k.insert(_deb).values(
        debit_id=p("debit_id"), run_id=p("run_id"), attempt_id=p("attempt_id"),
        state=p("state"), reserved_micros=p("reserved_micros"), posted_micros=lit(0),
        created_at=p("created_at"), settled_at=p("settled_at")))
    insert_attempt = _stmt(lambda k, p=bindparam: k.insert(_att).values(
        {c.name: p(c.name) for c in _BEGUN}))
    # An unnumbered slot (SQLite, unlimited groups): the number is left NULL, unnamed.
    insert_slot = _stmt(lambda k, p=bindparam: k.insert(_slots).values(
        {c.name: p(c.name) for c in _slots.c if c.name != "slot_no"}))
    insert_event = _stmt(_event_rows)
    # A ``move`` written makes its Run one that failed over (the audit's rule, 0012).
    mark_failed_over = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id"), _runs.c.failed_over.is_(false())).values(
        failed_over=true()))
    begin_run = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        calls_used=_runs.c.calls_used + p("calls"),
        retries_used=_runs.c.retries_used + p("retries"),
        reserved_micros=_runs.c.reserved_micros + p("reserve"),
        tokens_reserved=_runs.c.tokens_reserved + p("reserve_tokens"),
        status=p("status"), updated_at=p("now"),
        failed_over=or_(_runs.c.failed_over, p("moved"))))
    adopt_attempt = _stmt(lambda k, p=bindparam: update(_att).where(
        _att.c.attempt_id == p("attempt_id")).values(fence=p("fence")))
    adopt_slot = _stmt(lambda k, p=bindparam: update(_slots).where(
        _slots.c.attempt_id == p("attempt_id")).values(fence=p("fence")))
    void_attempt = _stmt(lambda k, p=bindparam: update(_att).where(
        _att.c.attempt_id == p("attempt_id")).values(
        state=lit("not_sent"), reject_reason=p("reason"), settled_at=p("now"),
        settle_fence=p("fence")))
    void_debit = _stmt(lambda k, p=bindparam: update(_deb).where(
        _deb.c.debit_id == p("debit_id")).values(state=lit("voided"), settled_at=p("now")))
    void_run = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        reserved_micros=_runs.c.reserved_micros - p("reserve"),
        tokens_reserved=_runs.c.tokens_reserved - p("reserve_tokens"),
        calls_used=_runs.c.calls_used - lit(1), updated_at=p("now")))

    # -- settle --------------------------------------------------------------------------------

    attempt = _stmt(lambda k, p=bindparam: select(
        _att, _deb.c.state.label("debit_state"),
        _deb.c.reserved_micros.label("debit_reserved_micros"),
    ).select_from(_att.outerjoin(_deb, _deb.c.debit_id == _att.c.debit_id))
        .where(_att.c.attempt_id == p("attempt_id")))
    # The Attempt, its debit and the health row of the settle's first key, in one read.
    settle_read = _stmt(lambda k, p=bindparam: select(
        _att, _deb.c.state.label("debit_state"),
        _deb.c.reserved_micros.label("debit_reserved_micros"),
        *(c.label("h_" + c.name) for c in HEALTH_READ),
    ).select_from(_att.outerjoin(_deb, _deb.c.debit_id == _att.c.debit_id)
                  .outerjoin(_health, _health.c.key == p("key")))
        .where(_att.c.attempt_id == p("attempt_id"), _att.c.run_id == p("run_id")))
    settle_attempt = _stmt(lambda k, p=bindparam: update(_att).where(
        _att.c.attempt_id == p("attempt_id")).values({c.name: p(c.name) for c in _SETTLE_SET}))
    settle_debit = _stmt(lambda k, p=bindparam: update(_deb).where(
        _deb.c.debit_id == p("debit_id")).values(
        state=p("state"), posted_micros=p("posted"), settled_at=p("now")))
    delete_slot = _stmt(lambda k, p=bindparam: delete(_slots).where(
        _slots.c.attempt_id == p("attempt_id")))
    settle_run = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(_run_counters(p)))
    settle_run_succeeded = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        {**_run_counters(p, _runs.c.selected_route != p("route")),  # served elsewhere
         "current_route": p("route"), "current_profile": p("profile"),
         "profile_compactions": _runs.c.compactions}))
    # A success under a user pin on another profile than the pinned one (a failover's): the
    # pin is the session's, so the Run keeps its profile (and the compaction count it was set
    # at) and only records the route that served.
    settle_run_succeeded_pinned = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        {**_run_counters(p, _runs.c.selected_route != p("route")),  # served elsewhere
         "current_route": p("route")}))
    insert_health = _stmt(lambda k, p=bindparam: k.insert(_health).values(
        key=p("key"), kind=p("kind"), provider=p("provider"),
        **{c.name: p(c.name) for c in HEALTH_WRITE}).on_conflict_do_nothing()
        .returning(_health.c.key))
    update_health = _stmt(lambda k, p=bindparam: update(_health).where(
        _health.c.key == p("key")).values({c.name: p(c.name) for c in HEALTH_WRITE}))
    # Which Run an Attempt id belongs to: a ref a host records provenance under may not be one
    # (only a settle records what an Attempt produced).
    attempt_run = _stmt(lambda k, p=bindparam: select(_att.c.run_id).where(
        _att.c.attempt_id == p("attempt_id")))
    insert_provenance = _stmt(lambda k, p=bindparam: k.insert(_prov).values(
        run_id=p("run_id"), ref=p("ref"), content_hash=p("content_hash"), kind=p("kind"),
        created_at=p("now")).on_conflict_do_nothing())

    group_fact = _stmt(_group_fact)

    # -- leases and the smaller writes ---------------------------------------------------------

    renew = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(lease_expires_at=p("expires"),
                                             updated_at=p("now")))
    acquire = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        lease_holder=p("holder"), fence=p("fence"), lease_expires_at=p("expires"),
        updated_at=p("now")))
    release = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        lease_holder=null(), lease_expires_at=null(), updated_at=p("now")))
    # The Run's close, if an operator (or recovery past a deadline) closed it: once closed, a
    # Run is never closed again (nor resumed), so there is at most one.
    run_close = _stmt(lambda k, p=bindparam: select(_events.c.data, _events.c.created_at).where(
        _events.c.run_id == p("run_id"), _events.c.kind == lit("close")))
    # Retention's records (each one's data holds its cut-off), and whether a Run has an
    # Attempt still open (retention keeps every row of such a Run): whether an ended Run's
    # history may be gone.
    retentions = _stmt(lambda k, p=bindparam: select(_events.c.data, _events.c.created_at)
                       .where(_events.c.kind == lit("retention")))
    open_attempt = _stmt(lambda k, p=bindparam: select(_att.c.attempt_id).where(
        _att.c.run_id == p("run_id"),
        or_(_att.c.state == lit("unknown"), _att.c.state == lit("dispatching"))))
    count_slots = _stmt(lambda k, p=bindparam: select(func.count()).select_from(_slots).where(
        _slots.c.run_id == p("run_id"), _slots.c.fence == p("fence")))
    # An ended Child gives back what it has left: it records it, and its parent's carve shrinks
    # by it (carve_return's amounts, as parameters).
    give_back = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        returned_calls=_runs.c.returned_calls + p("calls"),
        returned_retries=_runs.c.returned_retries + p("retries"),
        returned_micros=_runs.c.returned_micros + p("micros"),
        returned_tokens=_runs.c.returned_tokens + p("tokens")))
    take_back = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(
        carved_calls=_runs.c.carved_calls - p("calls"),
        carved_retries=_runs.c.carved_retries - p("retries"),
        carved_micros=_runs.c.carved_micros - p("micros"),
        carved_tokens=_runs.c.carved_tokens - p("tokens")))
    finish = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(status=p("status"), updated_at=p("now")))
    take_retry = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(retries_used=_runs.c.retries_used + lit(1),
                                             updated_at=p("now")))
    mark_unknown = _stmt(lambda k, p=bindparam: update(_att).where(
        _att.c.attempt_id == p("attempt_id")).values(
        state=lit("unknown"), settled_at=p("now"), settle_fence=p("fence")))
    ensure_health = _stmt(lambda k, p=bindparam: k.insert(_health).values(
        key=p("key"), kind=p("kind"), provider=p("provider"), error_count=lit(0),
        failure_counts=lit("{}"), updated_at=p("now")).on_conflict_do_nothing())
    claim_probe = _stmt(lambda k, p=bindparam: update(_health).where(
        _health.c.key == p("key"),
        or_(_health.c.last_probe_at.is_(None), _health.c.last_probe_at <= p("since")),
    ).values(last_probe_at=p("now"), updated_at=p("now")).returning(_health.c.key))

    forget_probes = _stmt(_forget_probes)
    compaction = _stmt(lambda k, p=bindparam: update(_runs).where(
        _runs.c.run_id == p("run_id")).values(compactions=_runs.c.compactions + lit(1),
                                             updated_at=p("now"))
        .returning(_runs.c.compactions))


#: The hot path's statements on SQLite and on PostgreSQL (compiled once per process).
SQLITE = Statements(SQLITE_SPELLING)

@functools.cache
def postgres() -> Statements:
    """The hot path's statements on PostgreSQL, compiled on first use, once per process (every
    PostgreSQL store shares them, as every SQLite one shares :data:`SQLITE`)."""
    return Statements(postgres_spelling())


__all__ = [
    "QUEUE_CHANNEL",
    "SQLITE",
    "SQLITE_SPELLING",
    "Fused",
    "Spelling",
    "Statements",
    "Stmt",
    "compile_stmt",
    "greatest",
    "in_list",
    "lit",
    "postgres",
    "postgres_spelling",
]
