"""PostgreSQL: :class:`PostgresContext`, and the store it opens.

The hot path runs on psycopg 3 directly (autocommit with ``BEGIN`` and ``COMMIT`` pipelined with
the statements, prepared statements on the server), the cold path on a SQLAlchemy engine; both
take their connections from the store's one pool (:class:`~ledger.storage.pgpool.PgPool`).
Writes that carry a fence lock the run row (``SELECT ... FOR UPDATE``); claims of work items
skip rows another transaction holds (``SKIP LOCKED``); migrations serialize on an advisory lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

from sqlalchemy import Connection, Select, case, cast, func, literal, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL

from ledger.domain.bounds import DEFAULT_LEASE_MARGIN_S
from ledger.errors import DatabaseSetupError
from ledger.storage import engine as eng
from ledger.storage import migrate, statements
from ledger.storage import schema as s
from ledger.storage.context import RowMap, SqlContext
from ledger.storage.driver import PgDriver, statement_answer
from ledger.storage.engine import redact_url
from ledger.storage.failure import driver_error, mapped, setup_error
from ledger.storage.hours import PG_HOUR_LOCK
from ledger.storage.pgpool import PgPool, own_pids
from ledger.storage.store import Store
from ledger.storage.wake import LISTEN_CHECK_S, Stopping

#: What an operator's action writes (clear a cooldown, close a Run, settle an unknown
#: Attempt): (table, privilege).
_ACTION_WRITES = (("events", "INSERT"), ("runs", "UPDATE"), ("attempts", "UPDATE"),
                  ("debits", "UPDATE"), ("health", "UPDATE"), ("capacity_groups", "UPDATE"))


class PostgresContext(SqlContext):
    """One PostgreSQL database, for the queries built on it."""

    backend = "postgresql"
    partitioned = True

    #: Notifications wake waiters at once; polling only finds slots of leases that expired.
    QUEUE_POLL_S = 1.0

    @classmethod
    def open(cls, norm: str, parsed: URL, *,
             lease_margin_s: float = DEFAULT_LEASE_MARGIN_S, reads: bool = False) -> Store:
        """The store on the database of ``parsed`` (a ``postgresql+psycopg://`` URL), without
        touching it yet (the first transaction connects). ``reads``: a read replica's, for
        the audit's reads only: read-only sessions, which may be on a standby."""
        conninfo = eng.postgres_conninfo(norm, parsed, reads=reads)
        where = redact_url(norm)
        pool = PgPool(conninfo, where=where, reads=reads)
        # One pool to the database: the engine keeps no connection of its own (NullPool); each
        # one SQLAlchemy uses is lent by the store's pool and goes back to it when SQLAlchemy
        # closes it, so the hot and the cold path share one bound, one health check and one
        # close. (A pool of SQLAlchemy's beside it would double the connections held, check
        # them another way, and find a dead one only by failing a statement on it.)
        engine = eng.postgres_engine(parsed, pool.lend)
        ctx = cls(engine, where, lease_margin_s=lease_margin_s)
        return Store(ctx, PgDriver(pool), statements.postgres(),
                     queue_poll_s=cls.QUEUE_POLL_S,
                     listen=partial(_listen, conninfo, partial(own_pids, where)))

    @classmethod
    def prepare_database(cls, norm: str, parsed: URL) -> bool:
        """Create the URL's database when it does not exist and the role may create databases:
        connected, with the URL's credentials, to the server's ``postgres`` maintenance
        database (``template1`` when that one is missing or closed to the role), as
        ``createdb`` does. The new database belongs to the role."""
        where = redact_url(norm)
        conninfo = eng.postgres_conninfo(norm, parsed)  # checks the driver is installed
        database = eng.database_name(parsed)
        assert database is not None  # postgres_conninfo refused a URL that names none
        try:
            with mapped(where), _connected(conninfo):
                return False  # it exists (and this role may connect to it)
        except DatabaseSetupError as e:
            if e.fields.get("problem") != "database_missing":
                raise
            missing = e
        with _maintenance(parsed, conninfo, where) as conn:
            may = conn.execute(text(
                "SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user"
            )).scalar()
            if not may:
                raise setup_error("createdb_privilege", where) from missing
            name = '"' + database.replace('"', '""') + '"'
            try:
                conn.exec_driver_sql(f"CREATE DATABASE {name}")
            except sa_exc.DBAPIError as e:
                state = getattr(e.orig, "sqlstate", None)
                if state == "42P04":  # another process created it first: it exists now
                    return False
                if state == "42501":
                    raise setup_error("createdb_privilege", where,
                                      text=str(e.orig).strip().splitlines()[0]) from e
                raise driver_error(e, where) from e
        return True

    def write_refusal(self) -> str | None:
        """:meth:`SqlContext.write_refusal`: the role's sessions are read-only here
        (``default_transaction_read_only``, which a standby's recovery does not set), or it
        lacks a privilege an operator's action uses; asked of the catalog, on any server."""
        granted = ", ".join(f"has_table_privilege('{t}', '{p}')" for t, p in _ACTION_WRITES)
        with self.reading() as conn:
            role, read_only, *held = conn.execute(text(
                "SELECT current_user, current_setting('default_transaction_read_only')::bool, "
                f"{granted}")).one()
        who = '"' + str(role).replace('"', '""') + '"'
        if read_only:
            return (f"role {who}'s sessions are read-only (default_transaction_read_only is on "
                    "for the role, the database or the URL's options)")
        missing = [f"{p} on {t}" for (t, p), ok in zip(_ACTION_WRITES, held, strict=True)
                   if not ok]
        return f"role {who} lacks {', '.join(missing)}" if missing else None

    def has_table(self, conn: Connection, name: str) -> bool:
        """Whether a table or view ``name`` is visible on the role's ``search_path`` (where the
        ledger's unqualified statements find it; ``pg_catalog``'s own excepted), as SQLAlchemy's
        ``has_table`` reads it."""
        return bool(conn.execute(text(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
            "ON n.oid = c.relnamespace WHERE c.relname = :name "
            "AND c.relkind IN ('r', 'p', 'f', 'v', 'm') "
            "AND pg_catalog.pg_table_is_visible(c.oid) AND n.nspname <> 'pg_catalog')"),
            {"name": name}).scalar())

    def commit_unknown(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a write transaction's ``COMMIT``, leaves its outcome
        unknown: anything but the server's answer to a statement on a connection it still
        serves (:func:`~ledger.storage.driver.statement_answer`), as the hot path reads it. A
        connection lost or a session ended after the ``COMMIT`` was sent may come after the
        server carried it out; SQLAlchemy marks a lost connection ``connection_invalidated``."""
        if getattr(error, "connection_invalidated", False):
            return True
        return not statement_answer(getattr(error, "orig", None) or error)

    def refuse_foreign(self) -> None:
        """Nothing: a PostgreSQL database is shared by design (other applications' tables,
        other schemas), and the ledger's tables go into the role's schema beside them; one of
        the same name already there fails the migration, which rolls back whole."""

    def migration_lock(self) -> AbstractContextManager[Connection]:
        """:func:`ledger.storage.migrate.postgres_lock`."""
        return migrate.postgres_lock(self.engine)

    def insert_for(self, table: Any) -> Any:
        """PostgreSQL's INSERT (with ``ON CONFLICT``)."""
        return pg_dialect.insert(table)

    def claiming(self, query: Select[Any]) -> Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: a run another process holds is left to it."""
        return query.with_for_update(skip_locked=True)

    #: The first key of the hour locks (``pg_advisory_xact_lock(7894, hour % 2^31)``) the
    #: trigger of migration 0011 takes shared for each attempt it sees written.
    HOUR_LOCK = PG_HOUR_LOCK

    def lock_hour(self, conn: Connection, hour: int, *, wait: bool = True) -> bool:
        """The hour's advisory lock, exclusive: writes to its attempts wait (their trigger
        takes it shared), and those in flight are committed before the roll-up reads."""
        # The trigger's key: the hour modulo 2^31 with its sign (PostgreSQL's %), as an int4.
        key = {"k": self.HOUR_LOCK, "h": int(math.fmod(hour, 2**31))}
        if wait:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k, :h)"), key)
            return True
        return bool(conn.execute(text("SELECT pg_try_advisory_xact_lock(:k, :h)"),
                                 key).scalar_one())

    def lock_hours(self, conn: Connection, hours: list[int]) -> set[int]:
        """Each hour's advisory lock tried in one statement, not one round trip per hour."""
        if not hours:
            return set()
        rows = conn.execute(text(
            "SELECT h FROM unnest(CAST(:hs AS bigint[])) AS t(h) "
            "WHERE pg_try_advisory_xact_lock(:k, CAST(h % 2147483648 AS integer))"),
            {"hs": hours, "k": self.HOUR_LOCK}).scalars()
        return {int(h) for h in rows}

    def bounded_locks(self, conn: Connection, timeout: str) -> bool:
        """``SET LOCAL lock_timeout``: a lock not granted in time is SQLSTATE 55P03."""
        conn.execute(text(f"SET LOCAL lock_timeout = '{timeout}'"))
        return True

    def consistent(self, conn: Connection) -> None:
        """``REPEATABLE READ``: every statement of the transaction sees one snapshot."""
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")

    #: ``work_mem`` of an audit's aggregate (per sort or hash table of its plan): at the
    #: server's default of 4 MB, a busy day's attempts (140,000) sorted for the latency
    #: percentiles or the activity chart's buckets went to disk (an external merge of 4 to
    #: 9 MB), and its 87,000 Runs' totals did not fit one hash (docs/benchmarks.md).
    AGGREGATE_WORK_MEM = "64MB"

    def aggregating(self, conn: Connection) -> None:
        """``SET LOCAL work_mem`` (:attr:`AGGREGATE_WORK_MEM`) and ``jit = off``, for this
        transaction only: settings any role may change, so a read-only role and a replica's
        sessions take them.

        JIT because its compile cost is paid on every run of these plans, which are never
        cached, and it outgrew the work: on a day of 140,000 attempts the totals by label spent
        about 550 ms compiling for 300 ms of execution (docs/benchmarks.md)."""
        conn.exec_driver_sql(f"SET LOCAL work_mem = '{self.AGGREGATE_WORK_MEM}'")
        conn.exec_driver_sql("SET LOCAL jit = off")

    def bucket(self, col: Any, since: float, width: float) -> Any:
        """``floor`` of the offset in widths."""
        return func.floor((col - since) / width)

    def label(self, key: str, labels: Any = None) -> Any:
        """The labels as ``jsonb``, ``->> key``."""
        return cast(s.runs.c.labels if labels is None else labels, JSONB).op("->>")(key)

    def json_text(self, col: Any, *path: str) -> Any:
        """The text as ``jsonb``: ``->`` down to the last key, ``->>`` at it."""
        expr: Any = cast(col, JSONB)
        for key in path[:-1]:
            expr = expr.op("->")(key)
        return expr.op("->>")(path[-1])

    def percentiles(self, conn: Connection, values: Sequence[Any], keys: Mapping[str, Any],
                    where: Sequence[Any], fractions: Sequence[float]) -> list[RowMap]:
        """``percentile_cont(f) WITHIN GROUP (ORDER BY value)``, an ordered-set aggregate
        (which skips NULLs), for every value and every key in one pass over the rows
        (``GROUPING SETS``, one set per key); the fractions of one value share its sort."""
        names = list(keys)
        # GROUPING(k) is 0 in the rows of k's own set.
        by = case(*((func.grouping(keys[name]) == 0, literal(name)) for name in names))
        key = case(*((func.grouping(keys[name]) == 0, keys[name]) for name in names))
        cols: list[Any] = [by.label("by"), key.label("key")]
        for j, value in enumerate(values):
            cols.append(func.count(value).label(f"n{j}"))
            cols.extend(func.percentile_cont(f).within_group(value.asc()).label(f"p{j}_{i}")
                        for i, f in enumerate(fractions))
        q = (select(*cols).select_from(s.attempts).where(*where)
             .group_by(func.grouping_sets(*(keys[name] for name in names))))
        return [dict(r._mapping) for r in conn.execute(q)]


def _listen(conninfo: str, own: Callable[[], Collection[int]], told: Callable[[str], None],
            stop: Stopping) -> None:
    """LISTEN on the queue channel until ``stop``; ``told("")`` once listening, then
    ``told(group)`` for each notification but those of the backends ``own`` names (this
    process's pooled connections: whatever freed a slot through them woke a waiter here
    already, :mod:`ledger.storage.wake`)."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"LISTEN {statements.QUEUE_CHANNEL}")
        told("")
        while not stop.is_set():
            for note in conn.notifies(timeout=LISTEN_CHECK_S):
                if note.pid not in own():
                    told(note.payload)


@contextmanager
def _connected(conninfo: str) -> Iterator[Any]:
    """A connection of ``conninfo``, closed at the end of the block."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        yield conn


@contextmanager
def _maintenance(parsed: URL, conninfo: str, where: str) -> Iterator[Connection]:
    """An autocommit connection to the server's maintenance database, with the URL's hosts
    and credentials; a database missing or closed to the role is passed over for the next."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    last: DatabaseSetupError | None = None
    for name in ("postgres", "template1"):
        maintenance = make_conninfo(conninfo, dbname=name)
        engine = eng.postgres_engine(parsed.set(database=name),
                                     partial(psycopg.connect, maintenance),
                                     isolation_level="AUTOCOMMIT")
        try:
            try:
                with mapped(where):
                    conn = engine.connect()
            except DatabaseSetupError as e:
                if e.fields.get("problem") not in ("database_missing", "connect_privilege",
                                                   "connections_disabled", "hba_rejected"):
                    raise
                last = e
                continue
            with conn, mapped(where):
                yield conn
            return
        finally:
            engine.dispose()
    assert last is not None
    raise setup_error("createdb_privilege", where, text=(
        "it cannot connect to the maintenance database postgres or template1 to create it: "
        f"{last.fields.get('problem')}")) from last


__all__ = ["PostgresContext"]
