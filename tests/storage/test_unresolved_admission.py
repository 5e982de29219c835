"""A Child Run's admission whose COMMIT's outcome is unknown never strands its parent's carve.

A Child's admission carves the Child's budget out of its parent's in the same transaction. A
real loopback proxy (:mod:`tests.pgcut`) in front of a real PostgreSQL server loses the
connection of that admission's ``COMMIT`` — after forwarding it (the Child lands, its
acknowledgement is lost), instead of forwarding it (it never lands), or by ending the session
after the server committed it — and the ledger cannot tell which:

* while the database answers, the admission is run again on a new connection (the same content
  is the same Run) and the Child's block runs as if nothing happened, carved once;
* when the database goes away with the cut, the entry raises ``DatabaseUnavailable``
  (``operation="admit"``, ``resolved=False``, ``deferred=True``) and the process remembers the
  admission under the parent: as soon as the database answers again — the parent's lease
  keeper's tick, the parent's next write, or the ledger's ``close()`` — a Child that landed and
  that no lease ever held is ended ``failed`` under the parent's fence and its whole carve goes
  back to the parent; one that did not land leaves nothing.

SQLite has no such ambiguity to produce: its ``COMMIT`` is a call into the library in this
process, which returns once it is decided (no connection to lose between sending it and hearing
its answer), so a SQLite admission's error is always one that wrote nothing
(:meth:`ledger.storage.context.SqlContext.commit_unknown`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from ledger import AsyncLedger, Ledger, RunStatus
from ledger.errors import DatabaseUnavailable, NotFound
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
from tests.storage.helpers import lock_waits, until


@pytest.fixture
def db(pg_server: PgServer) -> Iterator[Db]:
    with cut_db(pg_server, "adm") as d:
        yield d


def _told_deferred(error: DatabaseUnavailable) -> None:
    f = error.fields
    assert f["operation"] == "admit" and f["run_id"] == "c" and f["commit"] == "unknown"
    assert f["resolved"] is False and f["landed"] is None and f["deferred"] is True
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "gives its carve back as soon as the database answers again" in notes


def _ended_and_given_back(led: Ledger, parent_fence: int) -> None:
    """The Child that landed is ended failed, never held, its whole carve back with the
    parent, and its events say why."""
    child = led.get_run("c")
    assert (child.status, child.fence, child.lease_holder) == (RunStatus.FAILED, 0, None)
    assert child.returned == CHILD.max_cost
    assert (child.returned_calls, child.returned_retries) == (CHILD.max_calls,
                                                              CHILD.max_retries)
    parent = led.get_run("p")
    assert (parent.carved, parent.carved_calls, parent.carved_retries) == (0, 0, 0)
    kinds = [e.kind for e in led.events("c")]
    assert kinds == ["admit", "finish", "commit_unknown", "give_back"], kinds
    [why] = led.events("c", ["commit_unknown"])
    assert why.data == {"operation": "admit", "resolution": "ended", "parent": "p",
                        "parent_fence": parent_fence}
    [finish] = led.events("c", ["finish"])
    assert finish.data == {"status": "failed"}


def _nothing_landed(led: Ledger) -> None:
    with pytest.raises(NotFound):
        led.get_run("c")
    assert led.get_run("p").carved == 0


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["after", "instead", "terminated"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_child_admission_whose_acknowledgement_is_lost_is_resolved_and_its_block_runs(
    db: Db, mode: str, how: str
) -> None:
    if mode == "sync":
        with Ledger.open(db.url) as led, \
                led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                        lease_ttl_s=TTL_S) as run:
            db.cutter.arm_kind("admit", how)
            with run.child("c", budget=CHILD) as sub:
                cuts = [c.kind for c in db.cutter.cuts]
                assert sub.turn(HELLO, send=served).output == "ok"
            db.cutter.arm()
            assert not led._store.pending
    else:
        async def main() -> list[str]:
            async with AsyncLedger.open(db.url) as led, \
                    led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                            lease_ttl_s=TTL_S) as run:
                db.cutter.arm_kind("admit", how)
                async with run.child("c", budget=CHILD) as sub:
                    cuts = [c.kind for c in db.cutter.cuts]
                    assert (await sub.turn(HELLO, send=aserved)).output == "ok"
                db.cutter.arm()
                assert not led._store.pending
            return cuts

        cuts = asyncio.run(main())
    assert cuts == ["admit"]  # the Child's admission was cut, and the block ran all the same
    led = db.led
    child, parent = led.get_run("c"), led.get_run("p")
    assert child.status is RunStatus.SUCCEEDED and child.fence == 1
    # Carved once: the parent keeps exactly what the Child used, the rest came back.
    assert [e.kind for e in led.events("c", ["admit"])] == ["admit"]
    assert parent.carved_calls == child.calls_used == 1
    assert parent.carved == CHILD.max_cost - child.returned


@pytest.mark.postgres
@pytest.mark.parametrize("again", ["keeper", "next_write", "close"])
@pytest.mark.parametrize("how", ["after", "instead"],
                         ids=["child-landed", "child-never-landed"])
def test_a_child_admission_left_unknown_while_the_database_is_away_ends_and_gives_back(
    db: Db, how: str, again: str
) -> None:
    """The Child's admission is cut and the database goes away with it (its resolution cannot
    connect): the entry raises, told deferred; once the database answers — at the parent's
    keeper tick, its next write, or ``close()`` — the Child that landed is ended ``failed``
    under the parent's fence and its carve is the parent's again."""
    led = Ledger.open(db.url)
    exit_error: DatabaseUnavailable | None = None
    fence = 0
    try:
        with led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                     lease_ttl_s=TTL_S) as run:
            run._keeper.stop()  # ticked by hand below
            assert run.turn(HELLO, send=served).output == "ok"
            fence = run.lease.fence
            db.cutter.arm_kind("admit", how, down=True)
            with pytest.raises(DatabaseUnavailable) as err, run.child("c", budget=CHILD):
                pytest.fail("the Child's block ran")  # pragma: no cover
            assert [c.kind for c in db.cutter.cuts] == ["admit"]
            _told_deferred(err.value)
            assert len(led._store.pending.of("p")) == 1
            if again != "close":  # else still away at the parent's exit: remembered too
                db.cutter.up()
                if again == "keeper":
                    run._keeper.tick()
                    assert not led._store.pending
                else:
                    assert run.turn(HELLO, send=served).output == "ok"
                if how == "after":
                    _ended_and_given_back(db.led, fence)
                else:
                    _nothing_landed(db.led)
    except DatabaseUnavailable as e:
        exit_error = e
    finally:
        db.cutter.up()
        led.close()
    if again == "close":
        assert exit_error is not None and exit_error.fields.get("deferred") is True
    else:
        assert exit_error is None
    assert db.led.get_run("p").status is RunStatus.SUCCEEDED
    assert db.led.get_run("p").lease_holder is None
    if how == "after":
        _ended_and_given_back(db.led, fence)
    else:
        _nothing_landed(db.led)


@pytest.mark.postgres
def test_an_async_child_admission_left_unknown_is_ended_by_the_parents_keeper(db: Db) -> None:
    async def main() -> int:
        async with AsyncLedger.open(db.url) as led, \
                led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                        lease_ttl_s=TTL_S) as run:
            await run._keeper.stop()
            fence = run.lease.fence
            db.cutter.arm_kind("admit", "after", down=True)
            with pytest.raises(DatabaseUnavailable) as err:
                async with run.child("c", budget=CHILD):
                    pytest.fail("the Child's block ran")  # pragma: no cover
            _told_deferred(err.value)
            db.cutter.up()
            await run._keeper.tick()
            assert not led._store.pending
            _ended_and_given_back(db.led, fence)
            assert (await run.turn(HELLO, send=aserved)).output == "ok"
        return fence

    fence = asyncio.run(main())
    _ended_and_given_back(db.led, fence)


@pytest.mark.postgres
def test_a_child_some_lease_took_before_the_resolution_is_left_to_its_holder(db: Db) -> None:
    """The host took the Child's lease itself (by its id) before the database answered the
    process's resolution: the Child is the holder's, and it is left running, carve and all."""
    led = Ledger.open(db.url)
    try:
        with led.run("p", plan=routes(), budget=BUDGET, grant=GRANT,
                     lease_ttl_s=TTL_S) as run:
            run._keeper.stop()
            db.cutter.arm_kind("admit", "after", down=True)
            with pytest.raises(DatabaseUnavailable), run.child("c", budget=CHILD):
                pytest.fail("the Child's block ran")  # pragma: no cover
            db.cutter.up()
            # Another executor (the direct ledger) enters the Child before this one resolves.
            lease = db.led.acquire_lease("c", ttl_s=TTL_S)
            run._keeper.tick()
            assert not led._store.pending
            child = db.led.get_run("c")
            assert child.status is RunStatus.ADMITTED
            assert child.fence == lease.fence == 1 and child.returned == 0
            assert db.led.get_run("p").carved == CHILD.max_cost
            assert db.led.events("c", ["commit_unknown"]) == []
            db.led.finish_run(lease, "failed")
            db.led.release_lease(lease)
    finally:
        led.close()
    assert db.led.get_run("p").carved == 0


@pytest.mark.postgres
def test_a_child_admission_still_committing_is_waited_for_never_told_absent(pg_url: str) -> None:
    """The resolution of a Child admission told failed can run before that admission's COMMIT
    reaches the server (its acknowledgement lost, the next connection quicker): the Child's
    row is not yet there, and no lock can wait on a row not yet committed. It was told absent,
    and the Child that landed a moment later stayed ``admitted`` with its carve. The admission
    holds its parent's row until it ends; the resolution waits for it there and finds it.

    Here another connection holds the parent's row, an admission queues behind it, and the
    resolution is asked while that admission has not written yet."""
    import psycopg
    from sqlalchemy.engine import make_url

    from ledger.decide.resolve import Resolution, UnresolvedAdmission
    from ledger.storage.engine import normalize_url

    conninfo = make_url(normalize_url(pg_url)).set(drivername="postgresql").render_as_string(
        hide_password=False)
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        with lock_waits(pg_url) as waiting, Ledger.open(pg_url, executor_id="w") as led:
            led.admit_run("p", plan=routes(), budget=BUDGET, grant=GRANT)
            parent = led.acquire_lease("p", ttl_s=TTL_S)
            holder = psycopg.connect(conninfo)  # a transaction until rolled back
            holder.execute("SELECT 1 FROM runs WHERE run_id = 'p' FOR UPDATE")
            admitted = pool.submit(led.admit_run, "c", plan=routes(), budget=CHILD,
                                   grant=GRANT, parent=parent)
            until(lambda: waiting() >= 1, "the admission waits for the parent's row")
            resolved = pool.submit(led._runs.end_unheld_child,
                                   UnresolvedAdmission(parent, "c", RunStatus.FAILED),
                                   led.clock.now)
            until(lambda: resolved.done() or waiting() >= 2,
                  "the resolution answers, or waits behind the admission")
            holder.rollback()
            holder.close()
            admitted.result(timeout=60)
            assert resolved.result(timeout=60) is Resolution.ENDED
            _ended_and_given_back(led, parent.fence)
    finally:
        pool.shutdown(wait=True)
