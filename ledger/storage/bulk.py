"""Fast bulk loading of generated history (``failover-ledger generate``); never used by the
write path.

Rows go in with one multi-row ``executemany`` per table and one transaction per batch, bypassing
the fenced write path on purpose: generated history is synthetic and internally consistent by
construction, and loading a million attempts through per-attempt transactions would take hours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ledger.errors import InvalidArgument
from ledger.storage import schema as s

if TYPE_CHECKING:
    from ledger.storage.store import SqlStore as Store

# Parents before children (attempts and debits reference runs).
_ORDER = ("runs", "debits", "attempts", "events", "group_slots", "provenance", "health",
          "capacity_groups")
_UPSERT_SKIP = {"health": "key", "capacity_groups": "group_id"}


def bulk_insert(store: Store, rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> int:
    """Insert ``{table: [row, ...]}`` in one transaction; returns the number of rows written.

    Health and capacity-group rows that already exist are left as they are (a second
    ``generate`` on the same database adds history without rewriting current health).
    """
    unknown = set(rows) - set(_ORDER)
    if unknown:
        raise InvalidArgument(f"bulk_insert: unknown tables {sorted(unknown)}; pass rows of "
                              f"{', '.join(_ORDER)}", field="rows")
    n = 0
    with store.writing() as conn:
        for name in _ORDER:
            batch = rows.get(name)
            if not batch:
                continue
            table = s.metadata.tables[name]
            if name in _UPSERT_SKIP:
                stmt = store.insert_for(table).on_conflict_do_nothing(
                    index_elements=[_UPSERT_SKIP[name]])
                conn.execute(stmt, [dict(r) for r in batch])
            else:
                conn.execute(table.insert(), [dict(r) for r in batch])
            n += len(batch)
    return n


def analyze(store: Store) -> None:
    """Refresh planner statistics after a bulk load (autovacuum would, but only later), so the
    first queries on a freshly generated ledger are planned with its real size."""
    from sqlalchemy import text

    with store.writing() as conn:
        conn.execute(text(store.ANALYZE))


def first_run_other_than(store: Store, *, policy_hash: str | None = None,
                         tenant: str | None = None) -> str | None:
    """The id of one run that does not carry ``policy_hash`` (or ``tenant``), else ``None``.

    ``generate`` and the demo ask this before writing, so that synthetic history never lands
    beside real runs unnoticed. One indexed-or-short scan: it stops at the first such run.
    """
    from sqlalchemy import or_, select

    r = s.runs.c
    conds: list[Any] = []
    if policy_hash is not None:
        conds.append(r.policy_hash != policy_hash)
    if tenant is not None:
        conds.append(or_(r.tenant.is_(None), r.tenant != tenant))
    q = select(r.run_id)
    if conds:
        q = q.where(or_(*conds))
    with store.reading() as conn:
        row = conn.execute(q.limit(1)).first()
    return None if row is None else str(row.run_id)
