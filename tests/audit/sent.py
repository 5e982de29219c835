"""What an audit read sends: the plan tests of both databases EXPLAIN it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event

from ledger.ops.audit import Audit
from tests.storage.helpers import sql_context


def sent_selects(audit: Audit, call: Any) -> list[tuple[str, Any]]:
    """Run ``call``; every SELECT it sent (a WITH ... SELECT too), with its parameters."""
    sent: list[tuple[str, Any]] = []
    engine = sql_context(audit.ledger).engine

    def capture(conn: Any, cursor: Any, statement: str, params: Any, context: Any,
                executemany: bool) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):  # WITH: a CTE's read
            sent.append((statement, params))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    return sent
