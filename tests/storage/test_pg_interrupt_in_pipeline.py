"""An interruption that lands between a transaction's pipelined statements cancels what the
server is running, rather than waiting behind it.

psycopg turns a ``KeyboardInterrupt`` that lands in its own wait into a cancel request; one
that lands in Python code while a pipeline is being filled (building the next statement's
arguments) leaves the pipeline's exit to wait for every statement already sent, however long
the server takes: behind a row lock another session holds, until that session lets go. The
driver asks the server to cancel them, so the interruption reaches its caller at once (the
write's outcome is what it would be for any interruption: nothing, or unknown once its
``COMMIT`` was sent).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from ledger import Budget, Grant, Ledger, Price, Route
from ledger.api.face import storage_of
from ledger.storage.driver import Flush, Q
from ledger.storage.statements import Stmt
from ledger.testing.pgserver import PgServer

ROUTE = Route(id="a", provider="fake", model="m", group="g", recipient="fake",
              endpoint="http://127.0.0.1:9/v1", price=Price())
PATIENCE_S = 20  # how long the lock is held at most: a miss fails, it never hangs


class _Interrupting(Mapping[str, Any]):
    """Parameters whose reading is interrupted (as a Ctrl-C landing there would be)."""

    def __getitem__(self, key: str) -> Any:
        raise KeyboardInterrupt

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


@pytest.mark.postgres
@pytest.mark.parametrize("commit", [False, True])
def test_an_interruption_between_pipelined_statements_cancels_the_one_waiting_on_a_lock(
        pg_server: PgServer, pg_url: str, commit: bool) -> None:
    led = Ledger.open(pg_url)
    led.admit_run("r", plan=[ROUTE], grant=Grant(recipients={"fake": ["user_input"]}),
                  budget=Budget(max_calls=2, max_retries=0, max_cost=Decimal("1")))
    dbname = pg_url.rsplit("/", 1)[1]
    holder = psycopg.connect(host="127.0.0.1", port=pg_server.port, user=pg_server.user,
                             dbname=dbname)
    holder.execute("SELECT 1 FROM runs WHERE run_id = 'r' FOR UPDATE")
    released = threading.Event()

    def let_go() -> None:  # the bound of a miss: the statement then ends by itself
        released.set()
        holder.rollback()

    timer = threading.Timer(PATIENCE_S, let_go)
    timer.start()
    locked = Stmt("locked", "SELECT run_id FROM runs WHERE run_id = %s FOR UPDATE",
                  ("run_id",), ("run_id",), None)
    other = Stmt("other", "SELECT %s::text", ("x",), ("text",), None)

    def tx() -> Iterator[Any]:
        yield Flush((Q(locked, {"run_id": "r"}), Q(other, _Interrupting())), commit=commit)

    try:
        with pytest.raises(KeyboardInterrupt):
            storage_of(led).driver.run(tx(), write=True)
        assert not released.is_set(), "the interruption waited for the lock to go"
    finally:
        timer.cancel()
        if not released.is_set():
            holder.rollback()
        holder.close()
    # The connection it ran on went back clean (or was dropped): the ledger goes on.
    led.acquire_lease("r", ttl_s=60)
    led.close()
