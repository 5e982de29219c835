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


def _cut(led: Ledger, fake: FakeProvider, policy: str = "failure-domain"
         ) -> tuple[list[str], list[str]]:
    """Run "r" with one turn whose requests left and whose answers never came: unknown
    (every one the policy sent, resubmissions and moves included). Returns those Attempts and
    the candidates' lines of the turn's stop."""
    for _ in range(BUDGET.max_calls):
        fake.enqueue(Fault.RESET_BEFORE_HEADERS)
    with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, policy=policy) as run, \
            pytest.raises(FailoverExhausted) as first:
        run.turn(ASK)
    fake.clear()
    unknown = [a.attempt_id for a in led.timeline("r") if a.state is AttemptState.UNKNOWN]
    assert unknown
    lines: list[str] = first.value.fields["candidates"]
    assert len(lines) == 2 and "unknown (may have run; hold kept)" in lines[0]
    return unknown, lines


def _refused(err: FailoverExhausted, attempt_ids: list[str], lines: list[str]) -> None:
    assert err.reason == "execution_unknown" and err.attempts == attempt_ids
    assert "settle_unknown" in str(err)
    # What docs/retry-owner.md says a re-asked stop holds: an InvalidState per Attempt without
    # a receipt, naming it and the turn, and the candidates' lines of the first call's stop,
    # derived again from what that call recorded (the operator keeps the stop's cause).
    assert all(type(e) is InvalidState for e in err.exceptions)
    assert [e.fields["attempt_id"] for e in err.exceptions] == attempt_ids  # type: ignore[attr-defined]
    assert err.fields["candidates"] == lines
    assert str(err).endswith("".join(f"\n  {line}" for line in lines))


@pytest.mark.parametrize("policy", ["failure-domain", "goclaw", "fased"])
def test_a_later_session_of_the_run_never_resends_a_turn_without_a_receipt(
        db_url: str, fake: FakeProvider, policy: str) -> None:
    with Ledger.open(db_url) as led:
        unknown, lines = _cut(led, fake, policy)
        sent = len(fake.requests)
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, policy=policy) as run:
            with pytest.raises(FailoverExhausted) as stop:
                run.turn(ASK)
            _refused(stop.value, unknown, lines)
            # In the same session too, however often it is asked.
            with pytest.raises(FailoverExhausted) as again:
                run.turn(ASK)
            _refused(again.value, unknown, lines)
            assert len(fake.requests) == sent
            # Another question is another turn: it is sent.
            run.turn(Envelope(parts=[Part(content="Something else.")]))
        assert len(fake.requests) == sent + 1
        stops = [e.data for e in led.events("r", ["stop"])]
        assert [s["reason"] for s in stops][-2:] == ["execution_unknown", "execution_unknown"]
        # Every stop of the turn, as recorded (run show reads them), names the same candidates.
        assert all(s["candidates"] == lines for s in stops)
        assert led.get_run("r").status is RunStatus.SUCCEEDED


def test_a_bare_execute_stops_too_and_a_new_turn_id_or_settled_evidence_sends_again(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led, SyncAdapter() as adapter:
        unknown, lines = _cut(led, fake)
        sent = len(fake.requests)
        lease = led.acquire_lease("r", ttl_s=60)
        with pytest.raises(FailoverExhausted) as stop:
            execute(led, lease, ASK, sync_sender(adapter))
        _refused(stop.value, unknown, lines)
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
        unknown, lines = _cut(led, fake)
    sent = len(fake.requests)

    async def main() -> FailoverExhausted:
        async with await AsyncLedger.open(db_url) as led, led.run(
                "r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            with pytest.raises(FailoverExhausted) as stop:
                await run.turn(ASK)
            return stop.value

    _refused(asyncio.run(main()), unknown, lines)
    assert len(fake.requests) == sent


def test_a_turn_whose_first_call_never_stopped_names_its_candidates_from_the_records(
        db_url: str, fake: FakeProvider) -> None:
    """The host died after sending (no stop was recorded): the re-asked turn's stop still
    names each candidate, from what the ledger recorded of the turn."""
    with Ledger.open(db_url) as led, SyncAdapter() as adapter:
        led.admit_run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=60)
        att = led.begin_attempt(lease, route="primary", envelope_hash=ASK.hash,
                                reserve="0.01", turn_id="t1")
        led.settle_attempt(lease, att.attempt_id, outcome="unknown")  # no receipt, host died
        with pytest.raises(FailoverExhausted) as stop:
            execute(led, lease, ASK, sync_sender(adapter), turn_id="t1")
        assert stop.value.reason == "execution_unknown"
        assert stop.value.fields["candidates"] == [
            "primary: unknown (may have run; hold kept): fake/primary-model: no receipt "
            f"[attempt {att.attempt_id}]",
            "backup: not tried (the turn stopped first)"]
        assert not fake.requests
        led.release_lease(lease)
