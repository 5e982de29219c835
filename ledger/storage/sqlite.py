"""SQLite: :class:`SqliteContext`, and the store it opens.

One file shared by every process on the host: the hot path runs on :mod:`sqlite3` directly (one
connection per live thread, ``BEGIN IMMEDIATE`` for writes, WAL with ``synchronous=FULL``), the cold
path on a SQLAlchemy engine over the same file. Writers serialize on the database's write lock,
so no statement takes a row lock; a connection waits for another's write lock up to the busy
timeout (30 s, or the URL's ``?timeout=`` in seconds), then answers
:class:`~ledger.errors.DatabaseUnavailable`. An asyncio caller's transaction counts that
timeout from its call, its time queued on the database's thread included
(:mod:`ledger.storage.groupcommit`): behind a write stuck on another process's lock, it is
answered one busy timeout after its call, not two.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    Select,
    Text,
    cast,
    func,
    select,
    text,
)
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL
from sqlalchemy.sql import operators
from sqlalchemy.sql.expression import UnaryExpression

from ledger.domain.bounds import DEFAULT_LEASE_MARGIN_S
from ledger.errors import DatabaseSetupError, StorageError
from ledger.storage import engine as eng
from ledger.storage import migrate, statements
from ledger.storage import schema as s
from ledger.storage.context import RowMap, SqlContext, percentile_cont
from ledger.storage.driver import SqliteDriver
from ledger.storage.engine import redact_url
from ledger.storage.store import Store


class SqliteContext(SqlContext):
    """One SQLite file, for the queries built on it."""

    backend = "sqlite"

    #: The longest a queued begin waits without a signal before it begins again: another
    #: process's settle signals nothing on SQLite.
    QUEUE_POLL_S = 0.1
    #: How long the look at the file before the first connection waits for another's lock:
    #: the URL's ``timeout=`` when shorter (a URL asking 0.2 s waited 5).
    holds_timeout_s = 5.0

    @classmethod
    def open(cls, norm: str, parsed: URL, *,
             lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> Store:
        """The store on the SQLite file of ``parsed`` (its folder must exist), without
        touching it yet (the first transaction connects)."""
        path = eng.sqlite_file(norm, parsed)
        timeout = eng.sqlite_busy_timeout(parsed)
        ctx = cls(eng.sqlite_engine(parsed, timeout), redact_url(norm),
                  lease_margin_s=lease_margin_s)
        ctx.holds_timeout_s = min(timeout, cls.holds_timeout_s)
        return Store(ctx, SqliteDriver(path, busy_timeout_s=timeout), statements.SQLITE,
                     queue_poll_s=cls.QUEUE_POLL_S)

    @classmethod
    def database_key(cls, norm: str, parsed: URL) -> str:
        """A SQLite database is its file, its path resolved (relative to the working folder,
        links followed): a bare path, its ``sqlite:///`` URL and a link to it are one key."""
        return "sqlite:" + os.path.realpath(parsed.database or "")

    @classmethod
    def prepare_database(cls, norm: str, parsed: URL) -> bool:
        """Its folder must exist; the file itself is made by the first connection (the
        migration's), so ``True`` says it does not exist yet."""
        return not os.path.exists(eng.sqlite_file(norm, parsed))

    def holds_schema(self) -> bool:
        """Only a file that holds the ledger's schema
        (:func:`~ledger.storage.engine.file_holds`): the engine's first connection switches
        a file to WAL, a write, and one that is not a ledger must stay as it was."""
        try:
            return eng.file_holds(str(self.engine.url.database),
                                  self.holds_timeout_s) == "ledger"
        except StorageError:
            return False  # the first call tells what is wrong with the file

    def write_refusal(self) -> str | None:
        """:meth:`SqlContext.write_refusal`: the file is read-only to this process."""
        path = self.engine.url.database
        if path and os.path.isfile(path) and not os.access(path, os.W_OK):
            return f"the file {path} is read-only to this process"
        return None

    def has_table(self, conn: Connection, name: str) -> bool:
        """Whether the file (its ``main`` schema) holds table or view ``name``."""
        return bool(conn.execute(text(
            "SELECT EXISTS (SELECT 1 FROM main.sqlite_master WHERE type IN ('table', 'view') "
            "AND name = :name)"), {"name": name}).scalar())

    def refuse_foreign(self) -> None:
        """Refuse a file that holds tables but not the ledger's
        (:func:`~ledger.storage.engine.file_holds`), before the first connection writes to it:
        a SQLite file is one application's database, and the ledger's tables, indexes and
        triggers beside another's would make it neither's (and the command line would take it
        for a ledger from then on)."""
        path = str(self.engine.url.database)
        holds = eng.file_holds(path, self.holds_timeout_s)
        if holds in ("foreign", "not_sqlite"):
            raise DatabaseSetupError(
                f"cannot make {path!r} a ledger: {eng.not_a_ledger(holds)}, and a ledger keeps a "
                "SQLite file of its own; pass the path of a new file (the ledger creates it); "
                "nothing was written; retrying will not help",
                url=self.where, problem="not_a_ledger", database=path, role=None)

    def migration_lock(self) -> AbstractContextManager[Connection]:
        """:func:`ledger.storage.migrate.sqlite_lock`."""
        return migrate.sqlite_lock(self.engine)

    def insert_for(self, table: Any) -> Any:
        """SQLite's INSERT (with ``ON CONFLICT``)."""
        return sqlite_dialect.insert(table)

    def claiming(self, query: Select[Any]) -> Select[Any]:
        """As it is: ``BEGIN IMMEDIATE`` serializes writers, so the re-check suffices."""
        return query

    def lock_hour(self, conn: Connection, hour: int, *, wait: bool = True) -> bool:
        """Nothing to take: the write transaction (``BEGIN IMMEDIATE``) holds every writer
        off."""
        return True

    def consistent(self, conn: Connection) -> None:
        """Nothing to do: a SQLite read transaction is one snapshot already."""

    def aggregating(self, conn: Connection) -> None:
        """Nothing: SQLite sizes its sorts by its page cache, per connection, not per query."""

    def bucket(self, col: Any, since: float, width: float) -> Any:
        """Truncation: SQLite lacks ``floor()`` before 3.35, and ``col >= since``."""
        return cast((col - since) / width, Integer)

    def label(self, key: str, labels: Any = None) -> Any:
        """``json_extract`` of the labels' JSON text.

        The labels are stored with non-ASCII characters escaped (``\\u00e9``), and SQLite
        3.40 matches a path's key against the stored text as it is (an escaped key is found
        only by its escaped spelling): a key beyond ASCII is looked up both ways, so either
        rule finds it (a Run's label values are strings, never a JSON ``null``).
        """
        doc = s.runs.c.labels if labels is None else labels
        escaped = json.dumps(key)[1:-1]
        if escaped == key:
            return func.json_extract(doc, f'$."{key}"')
        return func.coalesce(func.json_extract(doc, f'$."{key}"'),
                             func.json_extract(doc, f'$."{escaped}"'))

    def json_text(self, col: Any, *path: str) -> Any:
        """``json_extract`` at the quoted path, as text."""
        where = "$" + "".join(f'."{k}"' for k in path)
        return cast(func.json_extract(col, where), Text)

    def group_key(self, col: Any) -> Any:
        """``+col``: SQLite's unary ``+`` leaves the value as it is and keeps the planner from
        using an index for the key (as its documentation advises). Grouped by a column with an
        index, a read of the rows outside the rolled hours walked that whole index in the
        group's order, ranges unused: on a 500,000-attempt ledger a /metrics scrape took
        1.1 s, the whole history's costs or spend 0.6 s (docs/benchmarks.md)."""
        return UnaryExpression(col, operator=operators.custom_op("+"), type_=col.type)

    def percentiles(self, conn: Connection, values: Sequence[Any], keys: Mapping[str, Any],
                    where: Sequence[Any], fractions: Sequence[float]) -> list[RowMap]:
        """SQLite has no ordered-set aggregate, and spelling one with window functions took a
        pass and a sort of the rows per key and value (ten for the latency's two keys and
        four values: docs/benchmarks.md). So the rows' keys and values are read once, and
        each key's values sorted here; a key none of whose rows has a value is there with a
        count of 0, as on PostgreSQL. The rows are first gathered per combination of all the
        keys (a route and its group), so each row is looked at once; each key's lists are
        then those combinations' sorted lists joined, which sorting merges as runs."""
        names = list(keys)
        width = len(names)
        q = select(*(keys[n] for n in names), *values).select_from(s.attempts).where(*where)
        combos: dict[tuple[Any, ...], list[list[float]]] = {}
        for row in conn.execute(q).all():
            lists = combos.get(row[:width])
            if lists is None:
                lists = combos[row[:width]] = [[] for _ in values]
            for j, lst in enumerate(lists):
                v = row[width + j]
                if v is not None:
                    lst.append(v)
        for lists in combos.values():
            for lst in lists:
                lst.sort()
        out: list[RowMap] = []
        for i, name in enumerate(names):
            per_key: dict[Any, list[list[float]]] = {}
            for combo, lists in combos.items():
                into = per_key.setdefault(combo[i], [[] for _ in values])
                for acc, lst in zip(into, lists, strict=True):
                    acc.extend(lst)
            for key, lists in per_key.items():
                got: dict[str, Any] = {"by": name, "key": key}
                for j, lst in enumerate(lists):
                    lst.sort()
                    got[f"n{j}"] = len(lst)
                    for f_i, f in enumerate(fractions):
                        got[f"p{j}_{f_i}"] = percentile_cont(lst, f) if lst else None
                out.append(got)
        return out


__all__ = ["SqliteContext"]
