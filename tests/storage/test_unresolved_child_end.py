"""A fresh Child whose entry raised while the database was away never strands its parent's carve.

A Child session's entry that raises after the Child's admission (which carved the Child's
budget out of its parent's) ends the Child and gives the carve back before the exception
propagates. Here the database goes away in the middle of that entry: a real loopback proxy
(:mod:`tests.pgcut`) in front of a real PostgreSQL server loses the connection of the Child's
lease acquisition — after forwarding its ``COMMIT`` (the lease lands, fence 1) or instead of
forwarding it (it never lands) — and refuses every connection from then on, so the entry's own
give-back (acquire, finish, release) cannot be written either. The entry raises the
acquisition's ``DatabaseUnavailable``, with a note saying the Child is ended later, and the
process remembers the Child's ending under the parent: as soon as the database answers again —
the parent's lease keeper's tick, the parent's next write, or the ledger's ``close()`` — the
Child is ended ``failed`` under the parent's fence, its lease released, and its whole carve is
the parent's again. Only an ending still not written at ``close()`` is logged at WARNING.

SQLite has no database to lose; the same ending refused by a fault point is tested on both
backends in ``tests/session/test_session_lease.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from ledger import AsyncLedger, Ledger, RunStatus
from ledger.decide.resolve import UnresolvedChildEnd
from ledger.errors import DatabaseUnavailable
from ledger.testing.pgserver import PgServer
from tests.storage.childcut import (
    BUDGET,
    CHILD,
    GRANT,
    HELLO,
    TTL_S,
    Db,
    aserved,
    cut_db,
    routes,
    served,
)


@pytest.fixture
def db(pg_server: PgServer) -> Iterator[Db]:
    with cut_db(pg_server, "end") as d:
        yield d


def _told_deferred(error: DatabaseUnavailable) -> None:
    """The entry raised its acquisition's error, noting that the Child is ended later."""
    assert error.fields["operation"] == "acquire" and error.fields["resolved"] is False
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "ending child run 'c'" in notes
    assert "gives the carve back as soon as the database answers again" in notes


def _stranded(led: Ledger) -> None:
    """While the database is away: the Child is admitted, its carve out of the parent's."""
    child = led.get_run("c")
    assert child.status is RunStatus.ADMITTED and child.returned == 0
    assert led.get_run("p").carved == CHILD.max_cost


def _ended_and_given_back(led: Ledger, how: str, parent_fence: int) -> None:
    """The Child is ended failed, holding no lease, and its whole carve is the parent's."""
    child = led.get_run("c")
    fence = 1 if how == "after" else 0  # the lease the entry's acquisition took, or none
    assert (child.status, child.fence, child.lease_holder) == (RunStatus.FAILED, fence, None)
    assert child.returned == CHILD.max_cost
    assert (child.returned_calls, child.returned_retries) == (CHILD.max_calls,
                                                              CHILD.max_retries)
    parent = led.get_run("p")
    assert (parent.carved, parent.carved_calls, parent.carved_retries) == (0, 0, 0)
    kinds = [e.kind for e in led.events("c")]
    lease = ["lease"] if how == "after" else []
    assert kinds == ["admit", *lease, "finish", "unwound", "give_back"], kinds
    [why] = led.events("c", ["unwound"])
    assert why.data == {"resolution": "ended", "parent": "p", "parent_fence": parent_fence,
                        "fence": fence}
    [finish] = led.events("c", ["finish"])
    assert finish.data == {"status": "failed"}


@pytest.mark.postgres
@pytest.mark.parametrize("again", ["keeper", "next_write", "close"])
@pytest.mark.parametrize("how", ["after", "instead"],
                         ids=["lease-landed", "lease-never-landed"])
def test_a_child_whose_entry_raised_while_the_database_was_away_is_ended_when_it_answers(
    db: Db, how: str, again: str
) -> None:
    led = Ledger.open(db.url)
    exit_error: DatabaseUnavailable | None = None
    fence = 0
    try:
        with led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                     lease_ttl_s=TTL_S) as run:
            run._keeper.stop()  # ticked by hand below
            assert run.turn(HELLO, send=served).output == "ok"
            fence = run.lease.fence
            db.cutter.arm_kind("acquire", how, down=True)
            with pytest.raises(DatabaseUnavailable) as err, run.child("c", budget=CHILD):
                pytest.fail("the Child's block ran")  # pragma: no cover
            assert [c.kind for c in db.cutter.cuts] == ["acquire"]
            _told_deferred(err.value)
            [item] = led._store.pending.of("p")
            assert isinstance(item, UnresolvedChildEnd) and item.child_id == "c"
            _stranded(db.led)
            if again != "close":  # else still away at the parent's exit: remembered too
                db.cutter.up()
                if again == "keeper":
                    run._keeper.tick()
                    assert not led._store.pending
                else:
                    assert run.turn(HELLO, send=served).output == "ok"
                _ended_and_given_back(db.led, how, fence)
    except DatabaseUnavailable as e:
        exit_error = e
    finally:
        db.cutter.up()
        led.close()
    if again == "close":
        assert exit_error is not None and exit_error.fields.get("deferred") is True
    else:
        assert exit_error is None
    parent = db.led.get_run("p")
    assert (parent.status, parent.lease_holder) == (RunStatus.SUCCEEDED, None)
    _ended_and_given_back(db.led, how, fence)


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["after", "instead"],
                         ids=["lease-landed", "lease-never-landed"])
def test_an_async_child_whose_entry_raised_while_the_database_was_away_is_ended_when_it_answers(
    db: Db, how: str
) -> None:
    async def main() -> int:
        async with AsyncLedger.open(db.url) as led, \
                led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                        lease_ttl_s=TTL_S) as run:
            await run._keeper.stop()
            fence = run.lease.fence
            db.cutter.arm_kind("acquire", how, down=True)
            with pytest.raises(DatabaseUnavailable) as err:
                async with run.child("c", budget=CHILD):
                    pytest.fail("the Child's block ran")  # pragma: no cover
            _told_deferred(err.value)
            _stranded(db.led)
            db.cutter.up()
            # The parent's next write ends the Child first, and spends what came back.
            assert (await run.turn(HELLO, send=aserved)).output == "ok"
            assert not led._store.pending
            _ended_and_given_back(db.led, how, fence)
        return fence

    fence = asyncio.run(main())
    _ended_and_given_back(db.led, how, fence)


@pytest.mark.postgres
def test_a_child_ending_still_not_written_at_close_is_logged_at_warning_and_only_then(
    db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """The database never comes back before the ledger closes: the entry's note is the news
    (no WARNING then), and the close warns once, naming the Child and the operator's fix. The
    Child stays admitted with its carve until an operator closes it."""
    led = Ledger.open(db.url)
    caplog.set_level(logging.INFO)
    try:
        with led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                     lease_ttl_s=TTL_S) as run:
            run._keeper.stop()
            db.cutter.arm_kind("acquire", "instead", down=True)
            with pytest.raises(DatabaseUnavailable) as err, run.child("c", budget=CHILD):
                pytest.fail("the Child's block ran")  # pragma: no cover
            _told_deferred(err.value)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                        and "child run c" in r.getMessage()]
    except DatabaseUnavailable:
        pass  # the parent's exit, deferred too
    finally:
        led.close()  # the database still away
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and r.getMessage().startswith("closing the ledger")
              and "child run c" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "failover-ledger run close c --status failed" in warned[0]
    db.cutter.up()
    _stranded(db.led)
    db.led.close_run("c", status="failed", reason="its entry raised; the ledger closed first")
    assert db.led.get_run("p").carved == 0
