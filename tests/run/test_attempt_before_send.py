"""Invariant 1 from outside the sending process's view: when a request reaches the network, its
Attempt is already committed, readable by any other connection to the ledger."""

from __future__ import annotations

from decimal import Decimal

import pytest

from ledger import faults
from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import FencedOut, InvalidArgument, LeaseLost

PLAN = [Route(id=f"r{i}", provider=f"p{i}", model="m", group=f"g{i}", recipient="rcpt",
              price=Price()) for i in range(3)]


def test_invariant1_every_attempt_is_committed_before_its_request_is_sent(db_url: str) -> None:
    clock = ManualClock(10_000.0)
    led = Ledger.open(db_url, clock=clock)
    observer = Ledger.open(db_url, migrate_schema=False)  # another connection, another view
    led.admit_run("run", plan=PLAN, budget=Budget(max_calls=5, max_retries=4,
                                                   max_cost=Decimal("1")),
                  grant=Grant(recipients={"rcpt": ["user_input"]}))
    lease = led.acquire_lease("run")
    seen: list[tuple[str, AttemptState]] = []

    def send(d: Dispatch) -> SendResult:
        # The moment the request would leave: the Attempt must already be durable.
        seen.append((d.attempt_id, observer.get_attempt(d.attempt_id).state))
        if len(seen) < 3:  # two failures that fail over, then a success
            return SendResult.failed(Observation(status=503, protocol=WireProtocol.OPENAI,
                                                 provider=d.route.provider))
        return SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)

    result = execute(led, lease, Envelope(parts=[Part(content="hi")]), send)
    assert [s for _, s in seen] == [AttemptState.DISPATCHING] * 3
    assert [a for a, _ in seen] == [a.attempt_id for a in result.attempts]
    observer.close()
    led.close()


def _two_executors(db_url: str) -> tuple[ManualClock, Ledger, Lease, Ledger]:
    """A Run leased for 30 s by executor ``a``, and executor ``b`` on the same ledger."""
    clock = ManualClock(10_000.0)
    led = Ledger.open(db_url, clock=clock, executor_id="a")
    led.admit_run("run", plan=PLAN[:1], budget=Budget(max_calls=5, max_retries=4,
                                                       max_cost=Decimal("1")),
                  grant=Grant(recipients={"rcpt": ["user_input"]}))
    lease = led.acquire_lease("run", ttl_s=30)
    return clock, led, lease, Ledger.open(db_url, clock=clock, executor_id="b",
                                          migrate_schema=False)


@pytest.mark.parametrize("taken_over", [False, True], ids=["lapsed", "taken-over"])
def test_invariant3_a_lease_lapsed_between_begin_and_send_sends_nothing(
        db_url: str, taken_over: bool) -> None:
    """An executor paused after its begin committed (the OS stopped it, its loop was held) until
    its lease lapsed sends nothing when it wakes: another executor may hold the Run, and the
    capacity slot stopped counting when the lease lapsed (invariant 8). The turn raises
    ``LeaseLost``; the attempt is settled ``not_sent`` where the Run is still its own, and is
    left to recovery (never sent) where another executor took it."""
    clock, led, lease, other = _two_executors(db_url)

    def pause(_point: str) -> None:
        clock.advance(31.0)  # asleep past the lease's end
        if taken_over:
            other.acquire_lease("run", ttl_s=30)

    sent: list[Dispatch] = []

    def send(d: Dispatch) -> SendResult:
        sent.append(d)
        return SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)

    faults.arm("dispatch.before_send", pause)
    try:
        with pytest.raises(LeaseLost) as lost:
            execute(led, lease, Envelope(parts=[Part(content="hi")]), send)
    finally:
        faults.disarm()
    assert sent == []
    [att] = led.timeline("run")
    assert lost.value.fields["attempt_id"] == att.attempt_id
    if taken_over:
        assert att.state is AttemptState.DISPATCHING  # the new holder's recovery settles it
    else:
        assert att.state is AttemptState.NOT_SENT
        assert att.debit_state is DebitState.VOIDED
    led.close()
    other.close()


def test_invariant3_a_begin_refused_for_a_stale_fence_writes_nothing(db_url: str) -> None:
    """A stale executor's begin is refused (``FencedOut``) and writes nothing at all: no
    attempt, and no late receipt of a settle for an attempt that never existed."""
    clock, led, lease, other = _two_executors(db_url)
    clock.advance(31.0)
    other.acquire_lease("run", ttl_s=30)
    before = [e.kind for e in led.events("run")]

    def send(d: Dispatch) -> SendResult:
        raise AssertionError("a stale executor sent a request")

    with pytest.raises(FencedOut):
        execute(led, lease, Envelope(parts=[Part(content="hi")]), send)
    assert led.timeline("run") == []
    assert [e.kind for e in led.events("run")] == before
    led.close()
    other.close()


def _no_parts() -> list[Envelope]:
    """Envelopes with no parts that skipped the model's validation (it refuses them)."""
    whole = Envelope(parts=[Part(content="hi")])
    return [Envelope.model_construct(parts=[]), whole.model_copy(update={"parts": []})]


def test_an_envelope_with_no_parts_that_skipped_validation_begins_no_attempt(
        db_url: str) -> None:
    # No request can be made of it, so no Attempt row may say one was: the turn refuses it
    # with Envelope(parts=[])'s error before it begins anything (before, the begin committed
    # and the adapter refused it after).
    led = Ledger.open(db_url, clock=ManualClock(10_000.0))
    sent: list[Dispatch] = []

    def send(d: Dispatch) -> SendResult:
        sent.append(d)
        return SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)

    with led.run("run", plan=PLAN, budget=Budget(max_calls=5, max_retries=4,
                                                 max_cost=Decimal("1")),
                 grant=Grant(recipients={"rcpt": ["user_input"]})) as run:
        with pytest.raises(InvalidArgument) as validated:  # the error validation gives
            execute(led, run.lease, {"parts": []}, send)
        for envelope in _no_parts():
            for turn in (lambda e: run.turn(e, send=send),
                         lambda e: execute(led, run.lease, e, send)):
                with pytest.raises(InvalidArgument, match="add at least one user part") as ei:
                    turn(envelope)
                assert ei.value.field == "envelope.parts"
                assert (str(ei.value), ei.value.fields) == (str(validated.value),
                                                            validated.value.fields)
        assert led.timeline("run") == [] and not sent
        rec = led.get_run("run")
        assert (rec.calls_used, rec.reserved) == (0, 0)  # nothing held
    # The refused calls were no turns: the block tried none, and the Run is cancelled as one
    # that never made an Attempt; its lease is given back.
    rec = led.get_run("run")
    assert rec.status.value == "cancelled" and rec.lease_holder is None
    led.close()
