"""An ended Child's carve given back to its parent, on the operator's side (SQLAlchemy Core).

:func:`ledger.storage.hot.give_back_tx` does it on the hot path (a session's ``finish``, a
settle of an ended Child); :func:`give_back` does the same in the cold path's transactions:
an operator's (or recovery's) close of a Run, an operator's settle of an unknown Attempt of
an ended Child, and recovery's takeover voiding a never-sent hold of an ended Child. Both give
:func:`~ledger.domain.records.carve_return`'s amounts, lock the parent after the Child, and
record the same ``give_back`` event.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, select

from ledger.decide.ending import ENDED
from ledger.domain.records import carve_return
from ledger.storage import schema as s
from ledger.storage.context import SqlContext
from ledger.storage.hot import give_back_event
from ledger.storage.statements import CARVE_COLS

_ENDED = frozenset(x.value for x in ENDED)


def give_back(ctx: SqlContext, conn: Connection, run_id: str, now: float) -> None:
    """Give what ``run_id`` has left back to its parent if it is an ended Child, on ``conn``
    (whose transaction holds ``run_id``'s row lock), and on up past ended parents."""
    r = s.runs.c
    cols = [r[c] for c in CARVE_COLS]

    def locked(rid: str) -> dict[str, Any] | None:
        row = conn.execute(select(*cols).where(r.run_id == rid).with_for_update()).first()
        return None if row is None else dict(row._mapping)

    child = locked(run_id)
    while (child is not None and child["status"] in _ENDED
           and child["parent_run_id"] is not None):
        parent = locked(str(child["parent_run_id"]))
        if parent is None:
            return  # the parent's rows are gone (retention): nobody to give it to
        back = carve_return(SimpleNamespace(**child), parent["max_tokens"] is not None)
        if back is None:
            return
        amounts = back.amounts()
        conn.execute(s.runs.update().where(r.run_id == child["run_id"]).values(
            {f"returned_{k}": r[f"returned_{k}"] + v for k, v in amounts.items()}))
        conn.execute(s.runs.update().where(r.run_id == parent["run_id"]).values(
            {f"carved_{k}": r[f"carved_{k}"] - v for k, v in amounts.items()}))
        ctx.add_event(conn, str(child["run_id"]), None, "give_back",
                      give_back_event(str(parent["run_id"]), back), now)
        for k, v in amounts.items():
            parent[f"carved_{k}"] -= v  # as written: a parent passing it on reads it so
        child = parent


__all__ = ["give_back"]
