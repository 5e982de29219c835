"""One Run session per Run id per ledger at a time: a second one is refused, writing nothing.

A second session of a Run entered on the ledger that already holds it open would be handed the
same lease (the executor's own, under the same fence) and would know only its own turns: the
first to leave would end the Run (or give up its lease) under the other's turn in flight. So its
entry raises ``LeaseHeld`` (``problem="session_open"``) before it admits or leases anything; the
open session and its turns go on unaffected, and once its block is left (normally, by an
exception, or its entry raised) the Run id is free at once. A session never entered, or dropped
without leaving, does not hold it. Sync (threads) and async (tasks), on an ``AsyncLedger`` and
its ``sync`` ledger alike; both backends. The turns send with a function (no provider).
"""

from __future__ import annotations

import asyncio
import gc
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
from ledger.clock import ManualClock
from ledger.errors import AdmissionConflict, InvalidState, LeaseHeld
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])
OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)


def _refused(error: LeaseHeld, led: Any) -> None:
    assert error.fields["problem"] == "session_open"
    assert error.fields["run_id"] == "r" and error.fields["holder"] == led.executor_id
    assert "Use the open session" in str(error) and "leave its block first" in str(error)


def _kinds(events: Any) -> list[str]:
    return [e.kind for e in events]


def test_a_second_session_of_an_open_run_on_one_ledger_is_refused_and_records_nothing(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(90_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as first:
            refusals: list[LeaseHeld] = []
            unchanged: list[bool] = []

            def send(_d: Dispatch) -> SendResult:
                # While the first session's turn is on the wire, another thread tries a
                # session of its own, as a host sharing one ledger between threads would.
                def enter() -> None:
                    try:
                        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                            raise AssertionError("the second session's block never runs")
                    except LeaseHeld as e:
                        refusals.append(e)

                before = led.events("r")
                t = threading.Thread(target=enter)
                t.start()
                t.join()
                unchanged.append(led.events("r") == before)  # nothing recorded
                return OK

            assert first.turn(HELLO, send=send).output == "ok"
            assert len(refusals) == 1 and unchanged == [True]
            _refused(refusals[0], led)
            before = led.events("r")
            with pytest.raises(LeaseHeld):  # on this thread too, between turns
                led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT).__enter__()
            assert led.events("r") == before
            assert first.lease.fence == 1
        rec = led.get_run("r")
        assert (rec.status, rec.lease_holder) == (RunStatus.SUCCEEDED, None)
        assert _kinds(led.events("r", ["finish"])) == ["finish"]
        # Left: a new session of the Run enters at once and goes on with it.
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as again:
            assert again.turn(HELLO, send=lambda _d: OK).output == "ok"
        assert _kinds(led.events("r", ["admit"])) == ["admit"]
        assert len(led.timeline("r")) == 2


def test_a_second_async_session_of_an_open_run_is_refused_while_the_first_ones_turn_runs(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(90_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            first = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
            async with first:
                on_wire, answer = asyncio.Event(), asyncio.Event()

                async def send(_d: Dispatch) -> SendResult:
                    on_wire.set()
                    await answer.wait()
                    return OK

                turn = asyncio.ensure_future(first.turn(HELLO, send=send))
                await on_wire.wait()
                before = _kinds(await led.events("r"))
                with pytest.raises(LeaseHeld) as refused:
                    async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                        raise AssertionError("the second session's block never runs")
                _refused(refused.value, led)
                assert refused.value.fields["expires_at"] == first.lease.expires_at
                # The AsyncLedger's blocking twin is the same executor: refused the same way.
                with pytest.raises(LeaseHeld) as blocking:
                    await asyncio.to_thread(
                        led.sync.run("r", plan=plan(fake), budget=BUDGET,
                                     grant=GRANT).__enter__)
                _refused(blocking.value, led)
                assert _kinds(await led.events("r")) == before  # nothing recorded
                answer.set()
                assert (await turn).output == "ok"  # the first session's turn: unaffected
            rec = await led.get_run("r")
            assert (rec.status, rec.lease_holder) == (RunStatus.SUCCEEDED, None)
            assert _kinds(await led.events("r", ["finish"])) == ["finish"]
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as again:
                async def served(_d: Dispatch) -> SendResult:
                    return OK

                assert (await again.turn(HELLO, send=served)).output == "ok"
            assert _kinds(await led.events("r", ["admit"])) == ["admit"]
            assert len(await led.timeline("r")) == 2

    asyncio.run(main())


def _entered_twice(error: BaseException) -> None:
    """The refusal of a session's second entry while its first is under way."""
    assert isinstance(error, InvalidState), repr(error)
    assert error.fields["run_id"] == "r"
    assert "a Run session is entered once" in str(error)
    assert "share the session the first entry opens" in str(error)


def test_one_session_entered_twice_at_once_is_refused_with_invalid_state(
        db_url: str, fake: Any) -> None:
    # The same session object entered again while its first entry is taking the lease (a
    # second thread, here the entry's own fault point) and again once open: each is refused,
    # naming the problem, and the first entry, its claim on the Run id and its block go on.
    clock = ManualClock(90_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        session = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
        caught: list[BaseException] = []

        def again(_point: str) -> None:
            try:
                session.__enter__()
            except BaseException as e:  # what the second entry raised, kept
                caught.append(e)

        faults.arm("acquire.before_commit", again)
        try:
            with session as run:
                faults.disarm()
                [error] = caught
                _entered_twice(error)
                with pytest.raises(InvalidState) as reentered:
                    session.__enter__()
                assert "a Run session is entered once" in str(reentered.value)
                assert reentered.value.fields["run_id"] == "r"
                # The first entry's claim on the Run id stands: another session is refused.
                with pytest.raises(LeaseHeld) as other, \
                        led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                    raise AssertionError("never entered")
                _refused(other.value, led)
                assert run.turn(HELLO, send=lambda _d: OK).output == "ok"
        finally:
            faults.disarm()
        rec = led.get_run("r")
        assert (rec.status, rec.lease_holder) == (RunStatus.SUCCEEDED, None)
        assert _kinds(led.events("r", ["admit", "lease"])) == ["admit", "lease"]


def test_one_async_session_entered_twice_at_once_is_refused_with_invalid_state(
        db_url: str, fake: Any) -> None:
    import ledger.adapters  # noqa: F401 - imported: each entry claims the Run id at once

    clock = ManualClock(90_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            session = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
            first, second = await asyncio.gather(session.__aenter__(), session.__aenter__(),
                                                 return_exceptions=True)
            assert first is session  # the first entry opened it, unaffected
            assert isinstance(second, BaseException)
            _entered_twice(second)
            try:
                async def served(_d: Dispatch) -> SendResult:
                    return OK

                assert (await session.turn(HELLO, send=served)).output == "ok"
            finally:
                await session.__aexit__(None, None, None)
            rec = await led.get_run("r")
            assert (rec.status, rec.lease_holder) == (RunStatus.SUCCEEDED, None)
            assert _kinds(await led.events("r", ["admit", "lease"])) == ["admit", "lease"]

    asyncio.run(main())


def test_a_session_left_by_an_exception_or_refused_on_entry_frees_its_run_id(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(90_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            with pytest.raises(RuntimeError):
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                    raise RuntimeError("the host's own error")
            # An entry refused by admission (other content under the id) holds nothing.
            with pytest.raises(AdmissionConflict):
                async with led.run("r", plan=plan(fake), grant=GRANT,
                                   budget=Budget(max_calls=1, max_retries=0,
                                                 max_cost=Decimal("1"))):
                    raise AssertionError("never entered")
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                assert run.lease.fence >= 1

    asyncio.run(main())
    with Ledger.open(db_url, clock=clock) as led:
        with pytest.raises(RuntimeError), \
                led.run("s", plan=plan(fake), budget=BUDGET, grant=GRANT):
            raise RuntimeError("the host's own error")
        with led.run("s", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            assert run.lease.executor == led.executor_id


def test_a_session_never_entered_or_dropped_without_leaving_does_not_hold_its_run_id(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(90_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        made = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)  # never entered
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
            pass
        assert made.record is None
        dropped = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
        dropped.__enter__()
        keeper = dropped._keeper
        keeper.stop()  # its renewals would outlive it; the lease stays this executor's
        del dropped
        gc.collect()
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            assert run.lease.executor == led.executor_id
