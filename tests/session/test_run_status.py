"""A Run's status says what happened (issue 22, item 6), for a Run session's block.

``succeeded`` only when the Run's last turn was served; ``cancelled`` after a cancelled turn,
even one the host caught; after a stop the host caught, ``stopped`` when the policy stopped on
purpose (failover off, a bound spent) and ``failed`` otherwise; a block with no turn leaves an
ended Run as it was and ends a new one ``cancelled``; a parent's last piece of work may be a
Child Run. Real HTTP over loopback (the shipped fake provider), sync and async, both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    Dispatch,
    Envelope,
    FailoverExhausted,
    FencedOut,
    Grant,
    Ledger,
    Part,
    RunStatus,
    SendResult,
)
from ledger.clock import ManualClock
from ledger.decide.ending import POLICY_STOPS, turn_end
from ledger.domain.records import AttemptState
from ledger.errors import ArgumentMismatch, InvalidArgument
from ledger.testing import FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])
NO_FAILOVER = {"name": "no-failover", "failover": {"enabled": False}}


def _finish(led: Ledger, run_id: str) -> tuple[RunStatus, list[str]]:
    rec = led.get_run(run_id)
    assert rec.lease_holder is None  # released on every path
    return rec.status, [e.data["status"] for e in led.events(run_id, ["finish"])]


# -- cancelled turns ------------------------------------------------------------------------


def test_a_turn_interrupted_inside_the_block_ends_the_run_cancelled_though_caught(
        db_url: str, fake: FakeProvider) -> None:
    def interrupted(_d: Dispatch) -> SendResult:
        raise KeyboardInterrupt  # Ctrl-C while the request was on its way

    with Ledger.open(db_url) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            run.turn(HELLO)  # served first: it is the last turn that counts
            with contextlib.suppress(KeyboardInterrupt):
                run.turn(Envelope(parts=[Part(content="more")]), send=interrupted)
        assert run.ended is RunStatus.CANCELLED
        assert _finish(led, "r") == (RunStatus.CANCELLED, ["cancelled"])
        assert [a.state for a in led.timeline("r")] == [AttemptState.SUCCEEDED,
                                                        AttemptState.UNKNOWN]


def test_a_cancelled_async_turn_the_host_caught_ends_the_run_cancelled(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> tuple[RunStatus, RunStatus]:
        async with AsyncLedger.open(db_url) as led:
            sending = asyncio.Event()

            async def hangs(_d: Dispatch) -> SendResult:
                sending.set()
                await asyncio.Event().wait()  # a provider that never answers
                raise AssertionError("unreachable")

            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                task = asyncio.create_task(run.turn(HELLO, send=hangs))
                await sending.wait()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            first = (await led.get_run("r")).status
            # A later served turn is the last one again: succeeded. (Another question: the
            # cancelled one has no receipt, and asked again it would stop, never be re-sent.)
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                await run.turn(Envelope(parts=[Part(content="hello again")]))
            return first, (await led.get_run("r")).status

    assert asyncio.run(main()) == (RunStatus.CANCELLED, RunStatus.SUCCEEDED)


def test_a_block_left_while_its_turn_is_still_sending_ends_the_run_cancelled_and_unknown(
        db_url: str, fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    """Leaving the block while a turn is still in its send (an ``astream`` the host broke out
    of and has not closed, a thread still waiting on the provider) finishes the Run cancelled
    and releases its lease: the request may have left, so its Attempt is marked unknown, its
    hold kept, never sent again. Leaving failed with ``InvalidState`` (an attempt in flight)
    and left the Run running and leased."""
    async def main() -> tuple[Any, Any]:
        async with AsyncLedger.open(db_url) as led:
            sending = asyncio.Event()

            async def hangs(_d: Dispatch) -> SendResult:
                sending.set()
                await asyncio.Event().wait()  # still waiting when the block is left
                raise AssertionError("unreachable")

            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                task = asyncio.create_task(run.turn(HELLO, send=hangs))
                await sending.wait()
            rec, [att] = await led.get_run("r"), await led.timeline("r")
            task.cancel()  # the abandoned turn, closed late: its own settle is refused
            with contextlib.suppress(BaseException):
                await task
            return rec, att

    with caplog.at_level("INFO", logger="ledger"):
        rec, att = asyncio.run(main())
    assert rec.status is RunStatus.CANCELLED and rec.lease_holder is None
    assert att.state is AttemptState.UNKNOWN and att.debit_state.value == "reserved"
    # The abandoned turn's own settle, refused, is no news for an operator to chase.
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("was settled before its interruption" in r.getMessage()
               for r in caplog.records)


def test_a_block_left_while_two_turns_are_sending_marks_both_unknown(
        db_url: str, fake: FakeProvider) -> None:
    """Two turns of one session in flight at once (two tasks): leaving the block marks each
    one's Attempt unknown, its hold kept. The exit knew only the last one to start sending,
    so the other stayed dispatching and the lease could not be released."""
    async def main() -> tuple[Any, list[Any]]:
        async with AsyncLedger.open(db_url) as led:
            sending = [asyncio.Event(), asyncio.Event()]

            def hangs(i: int) -> Any:
                async def send(_d: Dispatch) -> SendResult:
                    sending[i].set()
                    await asyncio.Event().wait()
                    raise AssertionError("unreachable")
                return send

            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                tasks = [asyncio.create_task(run.turn(
                    Envelope(parts=[Part(content=f"question {i}")]), send=hangs(i)))
                    for i in range(2)]
                for ev in sending:
                    await ev.wait()
            rec, atts = await led.get_run("r"), await led.timeline("r")
            for task in tasks:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            return rec, atts

    rec, atts = asyncio.run(main())
    assert rec.status is RunStatus.CANCELLED and rec.lease_holder is None
    assert len(atts) == 2
    assert all(a.state is AttemptState.UNKNOWN and a.debit_state.value == "reserved"
               for a in atts)


# -- stops the host caught ------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "budget", "reason", "status"), [
    # Every route failed: no candidate is left. Not on purpose: failed.
    (None, BUDGET, "no_candidate", RunStatus.FAILED),
    # Failover switched off by the policy: a deliberate stop.
    (NO_FAILOVER, BUDGET, "failover_disabled", RunStatus.STOPPED),
    # The Run's own retry allowance spent: a deliberate stop.
    (None, Budget(max_calls=10, max_retries=0, max_cost=Decimal("1")), "retry_allowance",
     RunStatus.STOPPED),
])
def test_a_stop_the_host_caught_ends_the_run_failed_or_stopped_by_its_reason(
        db_url: str, fake: FakeProvider, policy: Any, budget: Budget, reason: str,
        status: RunStatus) -> None:
    fake.set_default(Fault.UNAVAILABLE)  # every route answers 503
    with Ledger.open(db_url) as led:
        with led.run("r", plan=plan(fake), budget=budget, grant=GRANT, policy=policy) as run:
            with pytest.raises(FailoverExhausted) as ei:
                run.turn(HELLO)
            assert ei.value.reason == reason
        assert _finish(led, "r") == (status, [status.value])


def test_a_stop_that_leaves_the_block_ends_the_run_by_the_same_rule(
        db_url: str, fake: FakeProvider) -> None:
    fake.set_default(Fault.UNAVAILABLE)
    with Ledger.open(db_url) as led:
        with pytest.raises(FailoverExhausted), led.run("r", plan=plan(fake), budget=BUDGET,
                                                       grant=GRANT, policy=NO_FAILOVER) as run:
            run.turn(HELLO)
        assert _finish(led, "r")[0] is RunStatus.STOPPED
        with pytest.raises(FailoverExhausted), led.run("r2", plan=plan(fake), budget=BUDGET,
                                                       grant=GRANT) as run:
            run.turn(HELLO)
        assert _finish(led, "r2")[0] is RunStatus.FAILED


def test_a_served_turn_after_a_caught_stop_ends_the_run_succeeded(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Fault.UNAVAILABLE, model="backup-model")
    clock = ManualClock(time.time())
    with Ledger.open(db_url, clock=clock) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                     lease_ttl_s=7200) as run:
            with pytest.raises(FailoverExhausted):
                run.turn(HELLO)
            clock.advance(3600)  # past any cooldown the failures left
            run.turn(HELLO)  # the host tries again, and is served
        assert _finish(led, "r")[0] is RunStatus.SUCCEEDED


REFUSED_TURNS = [{"on_txt": print}, {"pin": 5}, {"reserve": "lots"},
                 {"part_hashes": object()}, {"on_text": 5}]


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("bad", REFUSED_TURNS, ids=lambda b: next(iter(b)))
def test_a_refused_turn_call_records_nothing_and_leaves_the_last_served_turn_the_runs_end(
        db_url: str, fake: FakeProvider, kind: str, bad: dict[str, Any]) -> None:
    # A call the session refuses (a misspelt or bad option) never started a turn: the Run
    # ends by the turn that was served before it, and a typo names turn's own arguments.
    if kind == "sync":
        with Ledger.open(db_url) as led:
            with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                run.turn(HELLO)
                with pytest.raises(InvalidArgument) as refused:
                    run.turn(HELLO, **bad)
            assert len(led.timeline("r")) == 1
            assert _finish(led, "r")[0] is RunStatus.SUCCEEDED
        err = refused.value
    else:
        async def main() -> InvalidArgument:
            async with await AsyncLedger.open(db_url) as led:
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                    await run.turn(HELLO)
                    with pytest.raises(InvalidArgument) as refused:
                        await run.turn(HELLO, **bad)
                assert len(await led.timeline("r")) == 1
                assert (await led.get_run("r")).status is RunStatus.SUCCEEDED
                return refused.value
        err = asyncio.run(main())
    if "on_txt" in bad:
        assert isinstance(err, ArgumentMismatch)
        assert str(err).startswith("turn() has no argument 'on_txt'; did you mean 'on_text'?")
    else:
        assert err.field == next(iter(bad))


# -- blocks without a turn, and Children ----------------------------------------------------


def test_a_block_without_a_turn_ends_a_new_run_cancelled_and_leaves_an_ended_run_as_it_was(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
            pass
        assert _finish(led, "r")[0] is RunStatus.CANCELLED  # nothing was asked, nothing served
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            run.turn(HELLO)
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
            pass  # resumed and left alone: still succeeded
        assert _finish(led, "r") == (RunStatus.SUCCEEDED,
                                     ["cancelled", "succeeded", "succeeded"])


def test_a_block_without_a_turn_ends_a_resumed_running_run_by_its_last_recorded_turn(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        led.admit_run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=30)
        att = led.begin_attempt(lease, route="primary", envelope_hash=HELLO.hash,
                                reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="unknown")  # no receipt, host died
        led.release_lease(lease)
        assert led.get_run("r").status is RunStatus.RUNNING
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
            pass
        assert _finish(led, "r")[0] is RunStatus.FAILED  # its last turn was not served


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_parent_whose_last_work_was_a_child_run_ends_as_the_child_ended(
        db_url: str, fake: FakeProvider, kind: str) -> None:
    small = Budget(max_calls=3, max_retries=2, max_cost=Decimal("0.1"))
    fake.set_default(Fault.UNAVAILABLE)  # both routes fail: no candidate left, failed

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run, run.child(
                "c", budget=small) as child:
            with pytest.raises(FailoverExhausted):
                await child.turn(HELLO)

    if kind == "sync":
        with Ledger.open(db_url) as led, led.run("p", plan=plan(fake), budget=BUDGET,
                                                 grant=GRANT) as run, run.child(
                "c", budget=small) as child, pytest.raises(FailoverExhausted):
            child.turn(HELLO)
    else:
        asyncio.run(main())
    with Ledger.open(db_url) as led:
        assert _finish(led, "c")[0] is RunStatus.FAILED
        assert _finish(led, "p")[0] is RunStatus.FAILED  # nothing of the parent was served


# -- the mapping itself ---------------------------------------------------------------------


def test_every_deliberate_stop_reason_is_stopped_and_any_other_is_failed() -> None:
    for reason in POLICY_STOPS:
        assert turn_end(FailoverExhausted("x", [], reason=reason)) is RunStatus.STOPPED
    for reason in ("no_candidate", "not_eligible_failure", "output_exists",
                   "execution_unknown", "rejected_before_dispatch", "a_reason_added_later"):
        assert turn_end(FailoverExhausted("x", [], reason=reason)) is RunStatus.FAILED
    assert turn_end(None) is RunStatus.SUCCEEDED
    for cancel in (asyncio.CancelledError(), KeyboardInterrupt(), GeneratorExit()):
        assert turn_end(cancel) is RunStatus.CANCELLED
    assert turn_end(RuntimeError("host")) is RunStatus.FAILED


def test_a_block_whose_keeper_lost_the_run_raises_on_leaving_and_finishes_nothing(
        db_url: str, fake: FakeProvider) -> None:
    """A session whose lease keeper found the Run taken over (the process was paused past its
    lease) did not finish the Run: leaving raises the keeper's ``FencedOut`` instead of ending
    as if all went well, and the Run is left to its new holder."""
    clock = ManualClock(50_000.0)
    with Ledger.open(db_url, clock=clock, executor_id="a", lease_margin_s=0.05) as led, \
            Ledger.open(db_url, clock=clock, executor_id="b", migrate_schema=False) as other:
        session = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=0.3)
        with pytest.raises(FencedOut) as lost, session as run:
            run.turn(HELLO)
            clock.advance(1.0)  # asleep past the lease's end...
            other.acquire_lease("r", ttl_s=60)  # ...while another executor took the Run
            assert run._keeper.lost.wait(30)  # the keeper's next renewal is refused
        assert lost.value is run._keeper.error
        rec = led.get_run("r")
        assert rec.status is RunStatus.RUNNING and rec.lease_holder == "b"
        assert led.events("r", ["finish"]) == []
