"""Bulk loading and sampling of generated history, for the benchmarks only.

The ledger's own write path never loads rows in bulk; this module does, for the large synthetic
histories the audit and recovery benchmarks measure (:mod:`benchmarks.generate`). Rows go in
with one multi-row ``executemany`` per table and one transaction per batch, bypassing the fenced
write path on purpose: generated history is synthetic and internally consistent by construction,
and loading a million attempts through per-attempt transactions would take hours.

It works on the SQLAlchemy engine of an open ledger, reached the one deliberate way
(:func:`ledger.api.face.storage_of`), with the ledger's tables (:mod:`ledger.storage.schema`)
and its mapping of driver errors to ledger errors (:func:`ledger.storage.failure.mapped`): a key
recorded already is a :class:`~ledger.errors.Conflict`, as everywhere in the ledger.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.engine import Connection, Engine

from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.errors import InvalidArgument
from ledger.storage import schema as s
from ledger.storage.failure import mapped

# Parents before children (attempts and debits reference runs).
_ORDER = ("runs", "debits", "attempts", "events", "group_slots", "provenance", "health",
          "capacity_groups")
_UPSERT_SKIP = {"health": "key", "capacity_groups": "group_id"}
# What refreshes the planner's statistics, per database.
_ANALYZE = {"sqlite": "ANALYZE",
            "postgresql": "ANALYZE runs, attempts, debits, events, health, capacity_groups"}


def _engine(led: Ledger) -> tuple[Engine, str]:
    ctx = storage_of(led).context
    return ctx.engine, ctx.where


@contextmanager
def _transaction(led: Ledger) -> Iterator[Connection]:
    engine, where = _engine(led)
    with mapped(where), engine.begin() as conn:
        yield conn


def _insert(conn: Connection, table: Any, key: str) -> Any:
    """An INSERT that leaves a row whose ``key`` exists as it is."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table).on_conflict_do_nothing(index_elements=[key])
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table).on_conflict_do_nothing(index_elements=[key])


def bulk_insert(led: Ledger, rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> int:
    """Insert ``{table: [row, ...]}`` in one transaction; returns the number of rows written.

    Health and capacity-group rows that already exist are left as they are (a second
    ``generate`` on the same database adds history without rewriting current health). A key
    recorded already is a :class:`~ledger.errors.Conflict`, and nothing of the batch is written.
    """
    unknown = set(rows) - set(_ORDER)
    if unknown:
        raise InvalidArgument(f"bulk_insert: unknown tables {sorted(unknown)}; pass rows of "
                              f"{', '.join(_ORDER)}", field="rows")
    n = 0
    with _transaction(led) as conn:
        for name in _ORDER:
            batch = rows.get(name)
            if not batch:
                continue
            table = s.metadata.tables[name]
            stmt = (_insert(conn, table, _UPSERT_SKIP[name]) if name in _UPSERT_SKIP
                    else table.insert())
            conn.execute(stmt, [dict(r) for r in batch])
            n += len(batch)
    return n


def analyze(led: Ledger) -> None:
    """Refresh planner statistics after a bulk load (autovacuum would, but only later), so the
    first queries on a freshly generated ledger are planned with its real size.
    """
    with _transaction(led) as conn:
        conn.execute(text(_ANALYZE[conn.dialect.name]))


def history_bounds(led: Ledger) -> tuple[float | None, float | None]:
    """(oldest, newest) Attempt time, read from the ends of ``ix_attempts_created_at``;
    (None, None) for a ledger without Attempts.
    """
    a = s.attempts.c
    with _transaction(led) as conn:
        lo = conn.execute(select(func.min(a.created_at))).scalar()
        hi = conn.execute(select(func.max(a.created_at))).scalar()
    return lo, hi


def sample_runs(led: Ledger, *, since: float, until: float, n: int) -> list[str]:
    """Up to ``n`` run ids admitted in [since, until), newest first."""
    r = s.runs.c
    with _transaction(led) as conn:
        return list(conn.execute(
            select(r.run_id).where(r.created_at >= since, r.created_at < until)
            .order_by(r.created_at.desc()).limit(n)
        ).scalars())


def sample_route(led: Ledger) -> str | None:
    """The route of the newest Attempt (None: there is none)."""
    a = s.attempts.c
    with _transaction(led) as conn:
        route = conn.execute(select(a.route_id).order_by(a.created_at.desc()).limit(1)).scalar()
    return None if route is None else str(route)


__all__ = ["analyze", "bulk_insert", "history_bounds", "sample_route", "sample_runs"]
