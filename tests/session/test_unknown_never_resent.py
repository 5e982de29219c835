"""A turn asked again while an earlier Attempt of it has no receipt is never sent again.

That request may have run (a cut after it left, a crash, a cancellation): sending it again
could run it twice (invariant 6). The turn stops with ``execution_unknown`` before any begin,
whoever asks: the same session, a later session of the Run (a worker resuming after
recovery), or a bare ``execute``; under every policy. A new turn id, or the Attempt settled
with evidence, sends again. Real HTTP over loopback, sync and async, both backends.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidState,
    Ledger,
    Part,
    RunStatus,
    execute,
)
from ledger.adapters import SyncAdapter, sync_sender
from ledger.domain.records import AttemptState
from ledger.testing import FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
ASK = Envelope(parts=[Part(content="What did the filing say?")])


def _cut(led: Ledger, fake: FakeProvider, policy: str = "failure-domain") -> list[str]:
    """Run "r" with one turn whose requests left and whose answers never came: unknown
    (every one the policy sent, resubmissions and moves included)."""
    for _ in range(BUDGET.max_calls):
        fake.enqueue(Fault.RESET_BEFORE_HEADERS)
    with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, policy=policy) as run, \
            pytest.raises(FailoverExhausted):
        run.turn(ASK)
    fake.clear()
    unknown = [a.attempt_id for a in led.timeline("r") if a.state is AttemptState.UNKNOWN]
    assert unknown
    return unknown


def _refused(err: FailoverExhausted, attempt_ids: list[str]) -> None:
    assert err.reason == "execution_unknown" and err.attempts == attempt_ids
    assert "settle_unknown" in str(err)
    # What docs/retry-owner.md says a re-asked stop holds: an InvalidState per Attempt without
    # a receipt, naming it and the turn, and no candidate lines.
    assert all(type(e) is InvalidState for e in err.exceptions)
    assert [e.fields["attempt_id"] for e in err.exceptions] == attempt_ids  # type: ignore[attr-defined]
    assert err.fields["candidates"] == []


@pytest.mark.parametrize("policy", ["failure-domain", "goclaw", "fased"])
def test_a_later_session_of_the_run_never_resends_a_turn_without_a_receipt(
        db_url: str, fake: FakeProvider, policy: str) -> None:
    with Ledger.open(db_url) as led:
        unknown = _cut(led, fake, policy)
        sent = len(fake.requests)
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, policy=policy) as run:
            with pytest.raises(FailoverExhausted) as stop:
                run.turn(ASK)
            _refused(stop.value, unknown)
            # In the same session too, however often it is asked.
            with pytest.raises(FailoverExhausted) as again:
                run.turn(ASK)
            _refused(again.value, unknown)
            assert len(fake.requests) == sent
            # Another question is another turn: it is sent.
            run.turn(Envelope(parts=[Part(content="Something else.")]))
        assert len(fake.requests) == sent + 1
        assert [e.data["reason"] for e in led.events("r", ["stop"])][-2:] == [
            "execution_unknown", "execution_unknown"]
        assert led.get_run("r").status is RunStatus.SUCCEEDED


def test_a_bare_execute_stops_too_and_a_new_turn_id_or_settled_evidence_sends_again(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led, SyncAdapter() as adapter:
        unknown = _cut(led, fake)
        sent = len(fake.requests)
        lease = led.acquire_lease("r", ttl_s=60)
        with pytest.raises(FailoverExhausted) as stop:
            execute(led, lease, ASK, sync_sender(adapter))
        _refused(stop.value, unknown)
        assert len(fake.requests) == sent
        execute(led, lease, ASK, sync_sender(adapter), turn_id="asked-again-on-purpose")
        assert len(fake.requests) == sent + 1
        [one] = unknown
        led.settle_unknown(one, outcome="not_sent", note="the provider has no such request")
        execute(led, lease, ASK, sync_sender(adapter))
        assert len(fake.requests) == sent + 2
        led.release_lease(lease)


def test_an_async_session_never_resends_a_turn_without_a_receipt(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        unknown = _cut(led, fake)
    sent = len(fake.requests)

    async def main() -> FailoverExhausted:
        async with await AsyncLedger.open(db_url) as led, led.run(
                "r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            with pytest.raises(FailoverExhausted) as stop:
                await run.turn(ASK)
            return stop.value

    _refused(asyncio.run(main()), unknown)
    assert len(fake.requests) == sent
