"""A failed Attempt whose provider reported usage is posted at that usage's cost.

docs/operations.md's outcomes table: a failure is "posted at the reported cost", at most the
hold, the rest released; the reported tokens are the Attempt's and count against a token budget
as an answer's do. The three failures that report usage over the wire: a Responses
``incomplete`` answer (whole body, and streamed) and Anthropic's in-stream ``error`` event after
its ``message_start`` (which carries the usage). Each runs through a Run session over loopback
with the fake provider, sync and async, on both backends; every report of the money (the Run's
counters, the audit, reconcile) must say the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.api.facade import AsyncLedger, Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.records import AttemptRecord, AttemptState, DebitState
from ledger.domain.values import Budget, Price, Route, WireProtocol
from ledger.errors import FailoverExhausted
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

RUN = "r"
PRICE = Price(input_per_mtok=Decimal(100), output_per_mtok=Decimal(200))
HOLD = Decimal("0.01")

# protocol, streamed, (prompt, completion) tokens the fake reports, their cost at PRICE
CASES = {
    "responses_incomplete_body": ("openai_responses", False, (11, 7), Decimal("0.0025")),
    "responses_incomplete_stream": ("openai_responses", True, (11, 7), Decimal("0.0025")),
    # Anthropic's message_start reports the prompt and one output token before the error.
    "anthropic_error_event": ("anthropic", True, (11, 1), Decimal("0.0013")),
}
FAULTS = {"openai_responses": Fault.INCOMPLETE, "anthropic": Fault.ERROR_EVENT}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as f:
        yield f


def _turn(db_url: str, fake: FakeProvider, case: str, mode: str, hold: Decimal,
          ) -> tuple[Ledger, AttemptRecord]:
    """One turn that fails as ``case`` says; (the ledger, its only Attempt)."""
    proto, stream, _usage, _cost = CASES[case]
    return _failing_turn(db_url, fake, proto, stream, FAULTS[proto], mode, hold)


def _failing_turn(db_url: str, fake: FakeProvider, proto: str, stream: bool, fault: Fault,
                  mode: str, hold: Decimal) -> tuple[Ledger, AttemptRecord]:
    """One turn of one route of ``proto`` whose call fails with ``fault``; (the ledger, its
    only Attempt)."""
    fake.clear()
    fake.enqueue(Behavior(fault=fault))
    route = Route(id="r1", provider="p", model="m", group="g", recipient="p",
                  protocol=WireProtocol(proto), endpoint=fake.endpoint(proto), price=PRICE)
    args = {"plan": [route], "budget": Budget(max_calls=1, max_retries=0, max_cost=Decimal(1),
                                              max_tokens=10_000)}
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    if mode == "sync":
        with Ledger.open(db_url) as led, led.run(RUN, **args) as run, \
                pytest.raises(FailoverExhausted):
            run.turn(envelope, reserve=hold)
    else:
        async def main() -> None:
            async with AsyncLedger.open(db_url) as led, led.run(RUN, **args) as run:
                with pytest.raises(FailoverExhausted):
                    await run.turn(envelope, reserve=hold)
        asyncio.run(main())
    led = Ledger.open(db_url)
    [att] = led.timeline(RUN)
    return led, att


def _assert_books(led: Ledger, *, charged: Decimal, tokens: int) -> None:
    run = led.get_run(RUN)
    assert (run.posted, run.reserved) == (charged, Decimal(0))
    assert (run.tokens_used, run.tokens_reserved) == (tokens, 0)
    audit = Audit(led)
    tl = audit.timeline(RUN)
    assert (tl.total_cost, tl.held) == (charged, Decimal(0))
    [tot] = [t for t in audit.costs(by="run").items if t.key == RUN]
    assert (tot.cost, tot.held) == (charged, Decimal(0))
    books = reconcile(led)
    assert books.ok, books.violations


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_failed_attempt_with_reported_usage_posts_its_reported_cost_and_tokens(
        db_url: str, fake: FakeProvider, case: str, mode: str) -> None:
    _proto, _stream, (pt, ct), cost = CASES[case]
    led, att = _turn(db_url, fake, case, mode, HOLD)
    assert (att.state, att.debit_state) == (AttemptState.FAILED, DebitState.POSTED)
    assert (att.prompt_tokens, att.completion_tokens, att.cost) == (pt, ct, cost)
    _assert_books(led, charged=cost, tokens=pt + ct)
    led.close()


@pytest.mark.parametrize("case", list(CASES))
def test_failed_attempt_reported_cost_above_its_hold_posts_only_the_hold(
        db_url: str, fake: FakeProvider, case: str) -> None:
    _proto, _stream, (pt, ct), cost = CASES[case]
    hold = Decimal("0.001")
    led, att = _turn(db_url, fake, case, "sync", hold)
    assert att.cost == cost > hold  # the true cost stays on the Attempt
    _assert_books(led, charged=hold, tokens=pt + ct)
    led.close()


def test_failed_attempt_with_out_of_range_usage_posts_as_if_none_was_reported(
        db_url: str, fake: FakeProvider) -> None:
    """Usage out of range is kept as evidence only (a ``usage_invalid`` event), as an answer's
    is: a stream the provider failed after it ran then posts the whole hold."""
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.INCOMPLETE, usage=(2**63, 7)))
    route = Route(id="r1", provider="p", model="m", group="g", recipient="p",
                  protocol=WireProtocol.OPENAI_RESPONSES,
                  endpoint=fake.endpoint("openai_responses"), price=PRICE)
    budget = Budget(max_calls=1, max_retries=0, max_cost=Decimal(1))
    with Ledger.open(db_url) as led:
        with led.run(RUN, plan=[route], budget=budget) as run, pytest.raises(FailoverExhausted):
            run.turn(Envelope(parts=[Part(content="hi")], stream=True), reserve=HOLD)
        [att] = led.timeline(RUN)
        assert (att.state, att.prompt_tokens, att.completion_tokens, att.cost) == (
            AttemptState.FAILED, None, None, None)
        [ev] = led.events(RUN, ["usage_invalid"])
        assert ev.attempt_id == att.attempt_id and ev.data["prompt_tokens"] == str(2**63)
        assert (led.get_run(RUN).posted, led.get_run(RUN).reserved) == (HOLD, Decimal(0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unknown_attempt_records_the_usage_seen_before_the_cut_and_keeps_its_hold(
        db_url: str, fake: FakeProvider, mode: str) -> None:
    """Anthropic's ``message_start`` reports the prompt (and one output token); the stream is
    then cut, so nobody knows whether the answer ran to the end. The Attempt is ``unknown``
    and keeps its whole cost and token holds (invariant 6); the tokens it saw are recorded on
    it for audit, with no cost (the hold stands in for it until a receipt says it)."""
    led, att = _failing_turn(db_url, fake, "anthropic", True, Fault.STREAM_CUT, mode, HOLD)
    with led:
        assert (att.state, att.debit_state) == (AttemptState.UNKNOWN, DebitState.RESERVED)
        assert (att.prompt_tokens, att.completion_tokens, att.cost) == (11, 1, None)
        run = led.get_run(RUN)
        assert (run.posted, run.reserved) == (Decimal(0), HOLD)
        assert att.reserved_tokens > 0
        assert (run.tokens_used, run.tokens_reserved) == (0, att.reserved_tokens)
        tl = Audit(led).timeline(RUN)
        assert (tl.total_cost, tl.held) == (Decimal(0), HOLD)
        books = reconcile(led)
        assert books.ok, books.violations
