"""A ledger closed while Run sessions are open on it gives their leases up.

Their blocks cannot end the Runs on a closed ledger, so the close releases each one's lease
(once no begin is under way or can start): another worker resumes the Run at once instead of
waiting for the lease to lapse. The Run is not finished, and a release settles nothing: an
Attempt in flight stays ``dispatching`` for recovery, and its lease is left to lapse. The
session's exit then writes nothing and raises the closed ledger's ``InvalidState`` (a block that
raised keeps its own exception), noted with what the close did. Both backends, both faces; the
turns send with a function (no provider is needed).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    Dispatch,
    Envelope,
    Grant,
    Ledger,
    Part,
    RunStatus,
    SendResult,
    faults,
)
from ledger.domain.records import AttemptState
from ledger.errors import InvalidState, LeaseHeld, NotFound
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])
# Long enough that only the close's release can free the Run within the test.
TTL = 3600.0
OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)


def _served(_d: Dispatch) -> SendResult:
    return OK


async def _served_async(_d: Dispatch) -> SendResult:
    return OK


def _resumed_by_another_worker(db_url: str, run_id: str,
                               status: RunStatus = RunStatus.RUNNING) -> None:
    with Ledger.open(db_url) as other:
        lease = other.acquire_lease(run_id, ttl_s=TTL)  # no LeaseHeld: the close released it
        assert lease.fence == 2
        run = other.get_run(run_id)
        assert run.status is status  # not finished: its block never ended
        other.release_lease(lease)


def _told_closed(error: BaseException, what: str) -> None:
    assert isinstance(error, InvalidState) and error.fields["problem"] == "ledger_closed"
    assert any("not finished" in n and what in n for n in getattr(error, "__notes__", []))


def test_a_ledger_closed_with_a_session_open_releases_its_lease_for_another_worker(
        db_url: str, fake: Any) -> None:
    led = Ledger.open(db_url)
    with pytest.raises(InvalidState) as caught, \
            led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL) as run:
        run.turn(HELLO, send=_served)
        led.close()
        _resumed_by_another_worker(db_url, "r")
    _told_closed(caught.value, "released its lease")


def test_an_async_ledger_closed_with_a_session_open_releases_its_lease_for_another_worker(
        db_url: str, fake: Any) -> None:
    async def main() -> None:
        led = await AsyncLedger.open(db_url)
        with pytest.raises(InvalidState) as caught:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                               lease_ttl_s=TTL) as run:
                await run.turn(HELLO, send=_served_async)
                await led.close()
                _resumed_by_another_worker(db_url, "r")
        _told_closed(caught.value, "released its lease")

    asyncio.run(main())


def test_a_block_that_raised_after_the_close_keeps_its_own_exception(
        db_url: str, fake: Any) -> None:
    led = Ledger.open(db_url)
    with pytest.raises(KeyError) as caught, \
            led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL) as run:
        run.turn(HELLO, send=_served)
        led.close()
        raise KeyError("the host's own")
    assert any("released its lease" in n for n in getattr(caught.value, "__notes__", []))
    _resumed_by_another_worker(db_url, "r")


def test_a_close_leaves_an_attempt_in_flight_dispatching_and_its_lease_to_lapse(
        db_url: str, fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A turn's request is on the wire when the ledger closes: its outcome is unknown, so the
    # release (which needs nothing in flight) is refused, and the Attempt stays as it is.
    caplog.set_level(logging.WARNING)
    on_wire, answer = threading.Event(), threading.Event()
    raised: list[BaseException] = []

    def send(_d: Dispatch) -> SendResult:
        on_wire.set()
        answer.wait(30)
        return OK

    led = Ledger.open(db_url)
    with pytest.raises(InvalidState) as caught, \
            led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL) as run:

        def work() -> None:
            try:
                run.turn(HELLO, send=send)
            except BaseException as e:  # read below
                raised.append(e)

        turn = threading.Thread(target=work)
        turn.start()
        assert on_wire.wait(30)
        led.close()
        with Ledger.open(db_url) as other:
            [att] = other.timeline("r")
            assert att.state is AttemptState.DISPATCHING  # not settled by the close
            with pytest.raises(LeaseHeld):
                other.acquire_lease("r", ttl_s=TTL)
        answer.set()
        turn.join(30)
    _told_closed(caught.value, "could not release its lease")
    [err] = raised  # the turn's settle found the ledger closed
    assert isinstance(err, InvalidState) and err.fields["problem"] == "ledger_closed"
    assert any("was not released" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    with Ledger.open(db_url) as other:
        [att] = other.timeline("r")
        assert att.state is AttemptState.DISPATCHING  # recovery's, once the lease lapses


# -- a session entering when the close begins -------------------------------------------------


def _held_until_the_close_begins(led: Ledger, closer: threading.Thread) -> None:
    """Arm the lease's acquisition to pause right after its COMMIT (the lease taken, the
    session not open yet) until ``closer`` has begun closing ``led``."""
    def hold(_name: str) -> None:
        closer.start()
        # The close's first step, which every entry ending after it reads under the same lock.
        for _ in range(30_000):
            if led._entries.closing:
                return
            threading.Event().wait(0.001)
        raise AssertionError("the close did not begin")

    faults.arm("acquire.after_commit", hold)


def _entry_gave_back(error: BaseException, db_url: str) -> None:
    assert isinstance(error, InvalidState) and error.fields["problem"] == "ledger_closed"
    assert error.fields["run_id"] == "r"
    assert any("began closing while the Run session" in n
               for n in getattr(error, "__notes__", []))
    # The lease the entry took was released before the database closed: another worker
    # resumes the (Root) Run at once, not after the hour-long lease lapses; no turn ran.
    _resumed_by_another_worker(db_url, "r", RunStatus.ADMITTED)


def test_a_session_entering_when_the_close_begins_gives_its_lease_back(
        db_url: str, fake: Any) -> None:
    led = Ledger.open(db_url)
    closer = threading.Thread(target=led.close)
    _held_until_the_close_begins(led, closer)
    try:
        with pytest.raises(InvalidState) as caught, \
                led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL):
            pytest.fail("the block of a session entered on a closing ledger ran")
    finally:
        faults.disarm()
        closer.join(30)
    assert not closer.is_alive()
    _entry_gave_back(caught.value, db_url)


def test_an_async_session_entering_when_the_close_begins_gives_its_lease_back(
        db_url: str, fake: Any) -> None:
    async def main() -> BaseException:
        led = await AsyncLedger.open(db_url)
        closer = threading.Thread(target=asyncio.run, args=(led.close(),))
        _held_until_the_close_begins(led.sync, closer)
        try:
            with pytest.raises(InvalidState) as caught:
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                                   lease_ttl_s=TTL):
                    pytest.fail("the block of a session entered on a closing ledger ran")
        finally:
            faults.disarm()
            # Joined off the loop: the close cancels this loop's pool workers on it, and a loop
            # blocked in the join answered only when the close gave up on it after 10 s.
            await asyncio.to_thread(closer.join, 30)
        assert not closer.is_alive()
        return caught.value

    _entry_gave_back(asyncio.run(main()), db_url)


def test_no_session_enters_a_closing_ledger(db_url: str, fake: Any) -> None:
    # Refused before anything is written: the Run is never admitted.
    led = Ledger.open(db_url)
    led._entries.close()  # the close's first step; the rest of it runs below
    with pytest.raises(InvalidState) as caught, \
            led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL):
        pytest.fail("the block of a session entered on a closing ledger ran")
    led.close()
    assert caught.value.fields["problem"] == "ledger_closed"
    with Ledger.open(db_url) as other, pytest.raises(NotFound):
        other.get_run("r")


# -- a session leaving when the close begins --------------------------------------------------


def test_a_session_leaving_when_the_close_begins_ends_its_run_itself_raising_nothing(
        db_url: str, fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    # The session's exit has finished the Run and is about to release its lease when the
    # close begins: the close waits for that exit instead of writing the same exit from its
    # own thread, where one of the two found the lease released (the session, whose block
    # succeeded, raised LeaseLost; or the close logged an exit "not resolved here").
    caplog.set_level(logging.WARNING)
    led = Ledger.open(db_url)
    closer = threading.Thread(target=led.close)

    def hold(_name: str) -> None:
        closer.start()
        for _ in range(30_000):
            if led._entries.closing:  # the close's first step; its exit writes come after
                return
            threading.Event().wait(0.001)
        raise AssertionError("the close did not begin")

    try:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL) as run:
            run.turn(HELLO, send=_served)
            faults.arm("finish.after_commit", hold)
    finally:
        faults.disarm()
        closer.join(30)
    assert not closer.is_alive()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    with Ledger.open(db_url) as other:
        run_record = other.get_run("r")
        assert run_record.status is RunStatus.SUCCEEDED and run_record.lease_holder is None
