"""Cancellation and interruption at every phase of a turn are recorded truthfully (invariants
1, 4, 6 and 8).

A caller that cancels (``task.cancel()``, ``asyncio.timeout``) or is interrupted (Ctrl-C) before
the begin commits, between begin and send, in the middle of a stream, or while the settle
transaction runs, leaves: no Attempt ``dispatching``, no capacity slot held, the Run's counters
equal to its debit rows, and a lease that can be released; the exception propagates unchanged.
Real HTTP over loopback (the shipped fake provider), both backends.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger import faults
from ledger.adapters import (
    HttpAdapter,
    StaticSecretProvider,
    SyncAdapter,
    async_sender,
    sync_sender,
)
from ledger.adapters.contract import StreamEvent, TextDelta
from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import Dispatch, SendResult, aexecute, execute
from ledger.domain.envelope import Envelope, Part
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.ops.reconcile import reconcile
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

SECRETS = StaticSecretProvider({"p:a": "key-a"})


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


@pytest.fixture(autouse=True)
def _clean(fake: FakeProvider) -> Iterator[None]:
    fake.clear()
    yield
    faults.disarm()


def _plan(fake: FakeProvider) -> list[Route]:
    return [Route(id="primary", provider="pa", model="m", group="ga", recipient="ra",
                  endpoint=fake.endpoint("openai"), profiles=[Profile(id="p:a")],
                  price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2)))]


def _admit(led: Ledger, fake: FakeProvider) -> Lease:
    led.admit_run("r", plan=_plan(fake), budget=Budget(max_calls=5, max_retries=2,
                                                        max_cost=Decimal("1")),
                  grant=Grant(recipients={"ra": ["user_input"]}))
    led.configure_group("ga", max_in_flight=5)  # a limited group: its slots are counted
    return led.acquire_lease("r", ttl_s=60)


def _envelope(stream: bool = False) -> Envelope:
    return Envelope(parts=[Part(content="hello")], stream=stream, max_output_tokens=16)


def _assert_truthful(led: Ledger, lease: Lease, expected: AttemptState, *,
                     shown: bool = False) -> None:
    [att] = led.timeline("r")
    assert att.state is expected
    # Text the caller was shown before the interruption is effective output (and only that).
    assert att.effective_output is shown
    assert att.state is not AttemptState.DISPATCHING
    if expected is AttemptState.NOT_SENT:
        assert att.debit_state is DebitState.VOIDED
    elif expected is AttemptState.UNKNOWN:
        assert att.debit_state is DebitState.RESERVED
        assert att.fact is not None and att.fact.category.value == "cancelled"
    assert led.group_projections(["ga"])["ga"].in_flight == 0
    check = reconcile(led)
    assert check.ok, check.violations
    run = led.get_run("r")
    assert run.calls_used == (0 if expected is AttemptState.NOT_SENT else 1)
    led.release_lease(lease)
    assert led.get_run("r").lease_holder is None


# -- asyncio: task.cancel() and asyncio.timeout --------------------------------------------------


def _in_loop_thread(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]
                    ) -> Callable[[str], None]:
    """A fault action for a point reached in a worker thread: cancel the caller's task, and
    give the loop a moment to deliver it while the transaction is still open."""

    def act(_name: str) -> None:
        loop.call_soon_threadsafe(task.cancel)
        time.sleep(0.05)

    return act


def _run_async(db_url: str, fake: FakeProvider, *, stream: bool, behavior: Behavior,
               setup: Callable[[asyncio.AbstractEventLoop, asyncio.Task[Any]], None] | None = None,
               on_event: Callable[[asyncio.Task[Any]], Any] | None = None,
               timeout: float | None = None) -> tuple[Ledger, Lease, BaseException]:
    led = Ledger.open(db_url)
    lease = _admit(led, fake)
    fake.set_default(behavior)

    async def main() -> BaseException:
        adapter = HttpAdapter(secrets=SECRETS)
        try:
            holder: dict[str, asyncio.Task[Any]] = {}

            def event(ev: StreamEvent) -> None:
                if on_event is not None and isinstance(ev, TextDelta):
                    on_event(holder["task"])

            send = async_sender(adapter, on_event=event)

            async def turn() -> None:
                if timeout is not None:
                    async with asyncio.timeout(timeout):
                        await aexecute(AsyncLedger(led), lease, _envelope(stream), send)
                else:
                    await aexecute(AsyncLedger(led), lease, _envelope(stream), send)

            task = asyncio.create_task(turn())
            holder["task"] = task
            if setup is not None:
                setup(asyncio.get_running_loop(), task)
            try:
                await task
            except BaseException as e:
                return e
            raise AssertionError("the turn was not interrupted")
        finally:
            await adapter.aclose()

    return led, lease, asyncio.run(main())


def test_cancel_before_begin_commits_voids_the_attempt(db_url: str, fake: FakeProvider) -> None:
    led, lease, err = _run_async(
        db_url, fake, stream=False, behavior=Behavior(),
        setup=lambda loop, task: faults.arm("begin.before_commit", _in_loop_thread(loop, task)))
    assert isinstance(err, asyncio.CancelledError)
    _assert_truthful(led, lease, AttemptState.NOT_SENT)
    assert fake.requests == []
    led.close()


def test_cancel_after_begin_before_send_voids_the_attempt(db_url: str,
                                                          fake: FakeProvider) -> None:
    def arm(_loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        faults.arm("dispatch.before_send", lambda _n: task.cancel())

    led, lease, err = _run_async(db_url, fake, stream=False, behavior=Behavior(), setup=arm)
    assert isinstance(err, asyncio.CancelledError)
    _assert_truthful(led, lease, AttemptState.NOT_SENT)
    assert fake.requests == []
    led.close()


def test_cancel_mid_stream_is_unknown_with_its_hold(db_url: str, fake: FakeProvider) -> None:
    led, lease, err = _run_async(
        db_url, fake, stream=True, behavior=Behavior(fault=Fault.TRICKLE, delay_s=0.02),
        on_event=lambda task: task.cancel())
    assert isinstance(err, asyncio.CancelledError)
    _assert_truthful(led, lease, AttemptState.UNKNOWN, shown=True)
    led.close()


def test_timeout_mid_stream_is_unknown_and_raises_timeout(db_url: str,
                                                          fake: FakeProvider) -> None:
    led, lease, err = _run_async(
        db_url, fake, stream=True, behavior=Behavior(fault=Fault.TRICKLE, delay_s=0.02),
        timeout=0.5)
    assert isinstance(err, TimeoutError)
    # The stream's callback had been handed text before the deadline: it was shown.
    _assert_truthful(led, lease, AttemptState.UNKNOWN, shown=True)
    led.close()


def test_cancel_during_settle_completes_the_settle(db_url: str, fake: FakeProvider) -> None:
    led, lease, err = _run_async(
        db_url, fake, stream=False, behavior=Behavior(),
        setup=lambda loop, task: faults.arm("settle.before_commit", _in_loop_thread(loop, task)))
    assert isinstance(err, asyncio.CancelledError)
    _assert_truthful(led, lease, AttemptState.SUCCEEDED)
    led.close()


def test_a_write_whose_own_task_is_cancelled_ends_the_turn_and_frees_the_loop(
        db_url: str, fake: FakeProvider) -> None:
    """A teardown (``asyncio.run`` leaving, a task group failing) cancels every task, the
    settle's own task among them: the turn ends with the cancellation, the loop is never held,
    and the settle, which committed, stands. It ran in a thread with a deadline, because the
    fault it guards against spun the event loop forever, so no timeout inside it could fire."""

    def arm(loop: asyncio.AbstractEventLoop, _task: asyncio.Task[Any]) -> None:
        main = asyncio.current_task()

        def cancel_every_task() -> None:
            for t in asyncio.all_tasks(loop):
                if t is not main:
                    t.cancel()

        def act(_name: str) -> None:
            loop.call_soon_threadsafe(cancel_every_task)
            time.sleep(0.05)

        faults.arm("settle.before_commit", act)

    out: dict[str, Any] = {}

    def body() -> None:
        out["result"] = _run_async(db_url, fake, stream=False, behavior=Behavior(), setup=arm)

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the turn never ended: the event loop was held"
    led, lease, err = out["result"]
    assert isinstance(err, asyncio.CancelledError)
    _assert_truthful(led, lease, AttemptState.SUCCEEDED)
    led.close()


# -- sync: KeyboardInterrupt ---------------------------------------------------------------------


def _interrupt(_name: str) -> None:
    raise KeyboardInterrupt


def _run_sync(db_url: str, fake: FakeProvider, *, stream: bool, behavior: Behavior,
              on_event: Callable[[StreamEvent], None] | None = None
              ) -> tuple[Ledger, Lease, BaseException]:
    led = Ledger.open(db_url)
    lease = _admit(led, fake)
    fake.set_default(behavior)
    adapter = SyncAdapter(secrets=SECRETS)
    try:
        execute(led, lease, _envelope(stream), sync_sender(adapter, on_event=on_event))
    except BaseException as e:
        return led, lease, e
    finally:
        adapter.close()
    raise AssertionError("the turn was not interrupted")


def test_interrupt_inside_begin_voids_the_attempt(db_url: str, fake: FakeProvider) -> None:
    faults.arm("begin.before_commit", _interrupt)
    led, lease, err = _run_sync(db_url, fake, stream=False, behavior=Behavior())
    assert isinstance(err, KeyboardInterrupt)
    _assert_truthful(led, lease, AttemptState.NOT_SENT)
    assert fake.requests == []
    led.close()


def test_interrupt_after_begin_voids_the_attempt(db_url: str, fake: FakeProvider) -> None:
    faults.arm("dispatch.before_send", _interrupt)
    led, lease, err = _run_sync(db_url, fake, stream=False, behavior=Behavior())
    assert isinstance(err, KeyboardInterrupt)
    _assert_truthful(led, lease, AttemptState.NOT_SENT)
    led.close()


def test_interrupt_after_the_answer_arrived_settles_it_as_answered(db_url: str,
                                                                   fake: FakeProvider) -> None:
    # Between the answer and its settle: the answer is in hand, so the Attempt is settled as
    # it says (succeeded, its usage posted), not unknown; every other point of that window is
    # in tests/session/test_interrupt_after_answer.py.
    faults.arm("dispatch.after_send", _interrupt)
    led, lease, err = _run_sync(db_url, fake, stream=False, behavior=Behavior())
    assert isinstance(err, KeyboardInterrupt)
    assert len(fake.requests) == 1
    _assert_truthful(led, lease, AttemptState.SUCCEEDED)
    assert led.timeline("r")[0].debit_state is DebitState.POSTED
    led.close()


def test_interrupt_mid_stream_is_unknown(db_url: str, fake: FakeProvider) -> None:
    main = threading.main_thread()
    assert threading.current_thread() is main
    fired = threading.Event()

    def on_event(ev: StreamEvent) -> None:
        if isinstance(ev, TextDelta) and not fired.is_set():
            fired.set()
            # Ctrl-C while the caller waits for the stream (a real SIGINT to the main thread).
            signal.pthread_kill(main.ident or 0, signal.SIGINT)

    # Python's own Ctrl-C handler, whatever an earlier test or library installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        led, lease, err = _run_sync(db_url, fake, stream=True,
                                    behavior=Behavior(fault=Fault.TRICKLE, delay_s=0.02),
                                    on_event=on_event)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(err, KeyboardInterrupt)
    _assert_truthful(led, lease, AttemptState.UNKNOWN, shown=True)
    led.close()


def test_a_callback_that_raises_keyboard_interrupt_ends_the_send_and_keeps_the_adapter(
        db_url: str, fake: FakeProvider) -> None:
    """A KeyboardInterrupt raised by a callback (on the calling thread) ends the send and
    reaches the caller as itself; the Attempt is recorded truthfully and the adapter, shared
    with other threads, still sends."""
    def on_event(ev: StreamEvent) -> None:
        if isinstance(ev, TextDelta):
            raise KeyboardInterrupt

    led = Ledger.open(db_url)
    lease = _admit(led, fake)
    fake.set_default(Behavior(fault=Fault.TRICKLE, delay_s=0.02))
    adapter = SyncAdapter(secrets=SECRETS)
    outcome: dict[str, BaseException] = {}

    def turn() -> None:
        try:
            execute(led, lease, _envelope(True), sync_sender(adapter, on_event=on_event))
        except BaseException as e:
            outcome["err"] = e

    try:
        waiter = threading.Thread(target=turn, daemon=True)
        waiter.start()
        waiter.join(60)  # a bound on a hang, not a wait for time to pass
        assert not waiter.is_alive(), "the caller still waits for a loop that stopped"
        assert isinstance(outcome.get("err"), KeyboardInterrupt)
        _assert_truthful(led, lease, AttemptState.UNKNOWN, shown=True)
        fake.set_default(Behavior())
        lease2 = _admit(led, fake)
        execute(led, lease2, _envelope(False), sync_sender(adapter))
    finally:
        adapter.close()
        led.close()


class _ReaderGone(Exception):
    pass


def test_callback_error_after_shown_text_is_unknown_with_effective_output(
        db_url: str, fake: FakeProvider) -> None:
    def on_event(ev: StreamEvent) -> None:
        if isinstance(ev, TextDelta):
            raise _ReaderGone  # the caller's own callback: it propagates unchanged

    led, lease, err = _run_sync(db_url, fake, stream=True,
                                behavior=Behavior(fault=Fault.TRICKLE, delay_s=0.02),
                                on_event=on_event)
    assert isinstance(err, _ReaderGone)
    _assert_truthful(led, lease, AttemptState.UNKNOWN, shown=True)
    led.close()


def test_a_hosts_send_function_reports_shown_output_through_the_progress(
        db_url: str, fake: FakeProvider) -> None:
    """A host that streams itself says what it showed (``Dispatch.progress.delivered``); an
    interruption after that is recorded with effective output."""
    led = Ledger.open(db_url)
    lease = _admit(led, fake)

    def send(d: Dispatch) -> SendResult:
        d.progress.sent = True
        d.progress.delivered = True  # the host printed the first tokens
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(led, lease, _envelope(True), send)
    _assert_truthful(led, lease, AttemptState.UNKNOWN, shown=True)
    led.close()


async def _answers(_d: Dispatch) -> SendResult:
    return SendResult(ok=True, output="hi")


@pytest.mark.parametrize("returned", [None, {"ok": True, "output": "hi"}, _answers],
                         ids=["none", "dict", "coroutine"])
def test_a_send_that_returns_no_send_result_leaves_a_truthful_record(
        db_url: str, fake: FakeProvider, returned: Any) -> None:
    """A host's send that returns something other than a ``SendResult`` may have sent the
    request: the turn raises ``InvalidArgument`` naming ``send`` and the fix, and the Attempt
    is settled unknown with its hold, never left ``dispatching`` (which kept the lease from
    being released)."""
    from ledger.errors import InvalidArgument

    led = Ledger.open(db_url)
    lease = _admit(led, fake)
    send = returned if callable(returned) else lambda d: returned
    with pytest.raises(InvalidArgument) as bad:
        execute(led, lease, _envelope(), send)
    assert bad.value.field == "send"
    assert ("aexecute" if callable(returned) else "SendResult(ok=True") in str(bad.value)
    [att] = led.timeline("r")
    assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
    assert bad.value.fields["attempt_id"] == att.attempt_id
    assert led.group_projections(["ga"])["ga"].in_flight == 0
    assert reconcile(led).ok
    led.release_lease(lease)
    led.close()


def test_interrupt_inside_settle_completes_the_settle(db_url: str, fake: FakeProvider) -> None:
    faults.arm("settle.before_commit", _interrupt)
    led, lease, err = _run_sync(db_url, fake, stream=False, behavior=Behavior())
    assert isinstance(err, KeyboardInterrupt)
    _assert_truthful(led, lease, AttemptState.SUCCEEDED)
    led.close()
