"""An interruption after the provider answered and before the settle is written records the
answer.

Between the send returning and its settle the answer is in hand: a Ctrl-C (or a cancellation
raised there) landing right after the send returned, while the failure is classified, while
the settle is built, or in the settle's transaction before it commits, settles the Attempt as
the answer says (``succeeded`` with its usage, or ``failed`` with its facts), holds nothing that
state does not hold, lets the session's exit release the lease, and propagates unchanged. It
used to leave the Attempt ``dispatching`` with its hold and slot, so the exit failed ("still
has 1 attempt(s) in flight") and the next session stopped with ``execution_unknown``. Real
HTTP over loopback (the shipped fake provider), sync and async, both backends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from decimal import Decimal

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part, faults
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState
from ledger.ops.reconcile import reconcile
from ledger.testing import FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
ASK = Envelope(parts=[Part(content="hello")], max_output_tokens=16)


class _InterruptsNextReading(ManualClock):
    """A clock whose next reading on the turn's thread, once armed, raises ``interruption``:
    armed when the send has returned, it lands in the first thing the turn does with the
    answer (the failure's classification; a success's settle being built). The lease keeper's
    thread reads it too, and is left alone."""

    def __init__(self, interruption: type[BaseException]) -> None:
        super().__init__(80_000.0)
        self.interruption = interruption
        self.armed = False
        self.fired = 0
        self.thread = threading.current_thread()

    def arm(self, _point: str) -> None:
        self.armed = True

    def now(self) -> float:
        if self.armed and threading.current_thread() is self.thread:
            self.armed = False
            self.fired += 1
            raise self.interruption
        return super().now()


def _ctrl_c(_point: str) -> None:
    raise KeyboardInterrupt


# Where the interruption lands: (fault point, what its action does).
#   after_send: right after the send returned, before anything is made of the answer;
#   first_reading: the turn's next clock reading (classifying a failure, building a settle);
#   in_settle: inside the settle's transaction, before its commit.
WHERE = ["after_send", "first_reading", "in_settle"]


def _arm(where: str, clock: _InterruptsNextReading) -> None:
    if where == "after_send":
        faults.arm("dispatch.after_send", _ctrl_c)
    elif where == "first_reading":
        faults.arm("dispatch.after_send", clock.arm)
    else:
        faults.arm("settle.before_commit", _ctrl_c)


def _answered_truthfully(led: Ledger, fake: FakeProvider, answered: AttemptState) -> None:
    """One Attempt, settled as its answer says and holding only what that state holds; the
    session's exit released the lease; the ledger reconciles."""
    assert len(fake.requests) == 1
    [att] = led.timeline("r")
    assert att.state is answered
    if answered is AttemptState.SUCCEEDED:
        assert att.debit_state is DebitState.POSTED and att.cost is not None and att.cost > 0
        assert att.fact is None
    else:
        # A 503 is a failure the provider answered: no hold kept for a receipt.
        assert att.debit_state is not DebitState.RESERVED
        assert att.fact is not None and att.fact.status == 503
        assert att.fact.category.value != "cancelled"
    assert led.group_projections(["ga"])["ga"].in_flight == 0
    run = led.get_run("r")
    assert run.lease_holder is None
    assert run.reserved == 0
    check = reconcile(led)
    assert check.ok, check.violations


def _enqueue(fake: FakeProvider, answered: AttemptState) -> None:
    if answered is AttemptState.FAILED:
        fake.enqueue(Fault.UNAVAILABLE, model="primary-model")


ANSWERS = [AttemptState.SUCCEEDED, AttemptState.FAILED]


@pytest.mark.parametrize("answered", ANSWERS, ids=lambda s: s.value)
@pytest.mark.parametrize("where", WHERE)
def test_a_sync_interruption_after_the_answer_settles_it_as_answered(
        db_url: str, fake: FakeProvider, where: str, answered: AttemptState) -> None:
    clock = _InterruptsNextReading(KeyboardInterrupt)
    _enqueue(fake, answered)
    with Ledger.open(db_url, clock=clock) as led:
        _arm(where, clock)
        try:
            with pytest.raises(KeyboardInterrupt), \
                    led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                run.turn(ASK)
        finally:
            faults.disarm()
        assert clock.fired == (1 if where == "first_reading" else 0)
        _answered_truthfully(led, fake, answered)


@pytest.mark.parametrize("answered", ANSWERS, ids=lambda s: s.value)
@pytest.mark.parametrize("interruption", [KeyboardInterrupt, asyncio.CancelledError],
                         ids=lambda t: t.__name__)
def test_an_async_interruption_after_the_answer_settles_it_as_answered(
        db_url: str, fake: FakeProvider, interruption: type[BaseException],
        answered: AttemptState) -> None:
    # The async driver shields a settle under way from a cancellation, and a cancellation of
    # the caller's task is delivered only where the turn awaits; an interruption raised in the
    # window itself (here by the clock, read while the answer is classified or its settle
    # built) meets the same loop as the sync one.
    clock = _InterruptsNextReading(interruption)
    _enqueue(fake, answered)
    with Ledger.open(db_url, clock=clock) as sync:

        async def main() -> None:
            led = AsyncLedger(sync)
            faults.arm("dispatch.after_send", clock.arm)
            try:
                with pytest.raises(interruption):
                    async with led.run("r", plan=plan(fake), budget=BUDGET,
                                       grant=GRANT) as run:
                        await run.turn(ASK)
            finally:
                faults.disarm()

        asyncio.run(main())
        assert clock.fired == 1
        _answered_truthfully(sync, fake, answered)


def test_a_cancellation_of_the_async_caller_after_the_answer_settles_it_as_answered(
        db_url: str, fake: FakeProvider) -> None:
    # The caller's task cancelled right after the send returned: delivered once the settle,
    # shielded, has been written.
    with Ledger.open(db_url, clock=ManualClock(80_000.0)) as sync:

        async def main() -> None:
            led = AsyncLedger(sync)
            holder: dict[str, Callable[[], object]] = {}
            faults.arm("dispatch.after_send", lambda _p: holder["cancel"]())
            try:
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                    task = asyncio.ensure_future(run.turn(ASK))
                    holder["cancel"] = task.cancel
                    with pytest.raises(asyncio.CancelledError):
                        await task
            finally:
                faults.disarm()

        asyncio.run(main())
        _answered_truthfully(sync, fake, AttemptState.SUCCEEDED)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_interruption_as_a_refused_begin_commits_is_never_swallowed(
        db_url: str, fake: FakeProvider, asynchronous: bool) -> None:
    """The group is full, the begin commits its refusal, and a Ctrl-C lands right after. The
    driver does the same begin once more to learn its outcome (the refusal, recorded) and was
    to deliver the interruption next; but the loop raised on the refused record first ("already
    rejected; it is not sent again"), and the interruption was lost: the caller got another
    error, and a cancelled task would not have ended as cancelled."""
    from ledger.policy.load import preset, validate_policy

    data = preset("failure-domain").model_dump(mode="json")
    data["admission"]["max_capacity_wait_s"] = 0  # refused at once, never queued
    policy = validate_policy({**data, "name": "no-wait"})
    routes = plan(fake)
    group = routes[0].group
    try:
        with Ledger.open(db_url) as led:
            led.configure_group(group, max_in_flight=1)
            led.admit_run("holder", plan=routes, budget=BUDGET, grant=GRANT)
            held = led.acquire_lease("holder", ttl_s=3600)
            led.begin_attempt(held, route=routes[0].id, envelope_hash="sha256:held", reserve="0")
        faults.arm("begin.after_commit", _ctrl_c)
        if asynchronous:
            async def main() -> None:
                async with AsyncLedger.open(db_url) as aled, aled.run(
                        "r", plan=[routes[0]], budget=BUDGET, grant=GRANT,
                        policy=policy) as run:
                    await run.turn(ASK)

            with pytest.raises(KeyboardInterrupt):
                asyncio.run(main())
        else:
            with Ledger.open(db_url) as led, pytest.raises(KeyboardInterrupt), led.run(
                    "r", plan=[routes[0]], budget=BUDGET, grant=GRANT, policy=policy) as run:
                run.turn(ASK)
    finally:
        faults.disarm()
    assert fake.requests == []
