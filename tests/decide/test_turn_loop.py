"""The turn is data: :class:`~ledger.decide.turn.TurnLoop` runs with no database, clock or
network, fed each effect's result by hand, and decides exactly what the drivers then perform.

Each test plays the driver: it answers the Snapshot with a hand-built Run, the Begin with the
Attempt it records, the Send with what the provider said, and checks the next effect.
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest

from ledger.decide.effects import (
    Begin,
    Effect,
    Notify,
    Now,
    Record,
    Send,
    SendResult,
    Settle,
    Sleep,
    Snapshot,
    TurnSnapshot,
)
from ledger.decide.preflight import NO_DENIALS, CharEstimator
from ledger.decide.turn import RunResult, TurnLoop
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, Source, Transport
from ledger.domain.records import (
    AttemptKind,
    AttemptRecord,
    AttemptState,
    FrozenRun,
    Lease,
    Outcome,
    RunRecord,
    RunState,
    RunStatus,
)
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import FailoverExhausted, InvalidState
from ledger.policy.load import policy_hash, preset

POLICY = preset("failure-domain")
PRIMARY = Route(id="primary", provider="p1", model="m1", group="g1", recipient="r1",
                price=Price())
BACKUP = Route(id="backup", provider="p2", model="m2", group="g2", recipient="r2",
               price=Price())
LEASE = Lease(run_id="run-1", executor="ex-1", fence=1, expires_at=1e9)
NOW = 1_000.0


def snapshot(calls_used: int = 0, retries_used: int = 0) -> TurnSnapshot:
    frozen = FrozenRun(
        run_id="run-1", parent_run_id=None, role="research", tenant=None, labels={},
        plan=[PRIMARY, BACKUP],
        grant=Grant(recipients={"r1": ["user_input"], "r2": ["user_input"]}),
        budget=Budget(max_calls=4, max_retries=3, max_cost=Decimal("1")),
        policy=POLICY.model_dump(mode="json"), policy_hash=policy_hash(POLICY),
        selected_route="primary", content_hash="h", deadline=None, created_at=0.0)
    state = RunState(
        status=RunStatus.RUNNING, calls_used=calls_used, retries_used=retries_used,
        reserved=Decimal(0), posted=Decimal(0), tokens_used=0, tokens_reserved=0,
        carved_calls=0, carved_retries=0, carved=Decimal(0), carved_tokens=0,
        current_route=None, current_profile=None, lease_holder="ex-1", fence=1,
        lease_expires_at=1e9, updated_at=0.0)
    return TurnSnapshot(run=RunRecord.of(frozen, state), policy=POLICY, groups={}, health={},
                        provenance={}, now=NOW)


def recorded(begin: Begin) -> AttemptRecord:
    return AttemptRecord(
        attempt_id=begin.attempt_id, run_id="run-1", turn_id=begin.turn_id, seq=1,
        kind=begin.kind, route_id=begin.route.id, provider=begin.route.provider,
        model=begin.route.model, group_id=begin.route.group, profile_id=begin.profile_id,
        debit_id="d-" + begin.attempt_id, envelope_hash=begin.spec.envelope_hash,
        state=AttemptState.DISPATCHING, reject_reason=None, fact=None, category=None,
        http_status=None, effective_output=False, tool_started=False, prompt_tokens=None,
        completion_tokens=None, cost=None, reserved=begin.reserve,
        reserved_tokens=begin.spec.reserve_tokens, model_reported=None, output_hash=None, fence=1,
        executor="ex-1", created_at=NOW, settled_at=None)


def settled(att: AttemptRecord, settle: Settle) -> AttemptRecord:
    state = {Outcome.SUCCEEDED: AttemptState.SUCCEEDED, Outcome.FAILED: AttemptState.FAILED,
             Outcome.UNKNOWN: AttemptState.UNKNOWN, Outcome.NOT_SENT: AttemptState.NOT_SENT}
    return replace(att, state=state[settle.outcome], fact=settle.spec.fact, settled_at=NOW)


def loop() -> TurnLoop:
    return TurnLoop(LEASE, Envelope(parts=[Part(content="hello")]), turn_id="turn-1",
                    pin=None, denials=NO_DENIALS, reserve=Decimal("0.01"),
                    rng=random.Random(1), token_counter=CharEstimator())


class Driver:
    """Answers the loop's effects from a script of provider answers; records what it saw."""

    def __init__(self, answers: dict[str, list[SendResult]]) -> None:
        self.answers = answers
        self.seen: list[Effect[Any]] = []
        self.attempts: dict[str, AttemptRecord] = {}
        self.calls = 0

    def answer(self, eff: Effect[Any]) -> Any:
        self.seen.append(eff)
        match eff:
            case Snapshot():
                return snapshot(calls_used=self.calls, retries_used=max(self.calls - 1, 0))
            case Begin():
                self.calls += 1
                self.attempts[eff.attempt_id] = recorded(eff)
                return self.attempts[eff.attempt_id]
            case Send(dispatch=d):
                return self.answers[d.route.id].pop(0)
            case Settle():
                return settled(self.attempts[eff.attempt_id], eff)
            case Sleep() | Notify() | Record():
                return None
            case Now():
                return NOW
        raise AssertionError(f"unexpected effect {eff!r}")

    def run(self, steps: Any) -> RunResult:
        value: Any = None
        try:
            while True:
                value = self.answer(steps.send(value))
        except StopIteration as done:
            result: RunResult = done.value
            return result


def kinds(seen: list[Effect[Any]]) -> list[str]:
    """The effects that do I/O (reading the clock is none)."""
    return [type(e).__name__ for e in seen if not isinstance(e, Now)]


def test_a_healthy_turn_is_one_read_one_begin_one_send_one_settle() -> None:
    driver = Driver({"primary": [SendResult(ok=True, output="hi", prompt_tokens=3,
                                            completion_tokens=1)]})
    result = driver.run(loop().steps())
    assert kinds(driver.seen) == ["Snapshot", "Begin", "Send", "Settle"]
    assert result.route.id == "primary" and result.output == "hi"
    begin = next(e for e in driver.seen if isinstance(e, Begin))
    assert isinstance(begin, Begin) and begin.kind is AttemptKind.FIRST
    assert not begin.spec.take_retry


def test_an_unavailable_primary_is_settled_then_the_backup_begins_with_a_retry_permission(
) -> None:
    driver = Driver({"primary": [SendResult.failed(Observation(status=503))],
                     "backup": [SendResult(ok=True, output="from backup")]})
    result = driver.run(loop().steps())
    assert result.route.id == "backup"
    settles = [e for e in driver.seen if isinstance(e, Settle)]
    assert [s.outcome for s in settles] == [Outcome.FAILED, Outcome.SUCCEEDED]
    assert settles[0].spec.fact is not None and settles[0].spec.fact.status == 503
    begins = [e for e in driver.seen if isinstance(e, Begin)]
    assert [b.route.id for b in begins][-1] == "backup" and begins[-1].spec.take_retry
    # the failed Attempt is settled before anything else is begun
    first_settle = driver.seen.index(settles[0])
    assert all(not isinstance(e, Begin) for e in driver.seen[2:first_settle])


def test_a_request_that_never_left_is_settled_not_sent() -> None:
    refused = Observation(transport=Transport.CONNECT_REFUSED, source=Source.LOCAL)
    driver = Driver({"primary": [SendResult.failed(refused, sent=False)],
                     "backup": [SendResult(ok=True, output="ok")]})
    with contextlib.suppress(FailoverExhausted):  # the policy may stop on a network failure
        driver.run(loop().steps())
    first = next(e for e in driver.seen if isinstance(e, Settle))
    assert first.outcome is Outcome.NOT_SENT


def test_a_stop_raises_failover_exhausted_holding_every_attempts_error() -> None:
    driver = Driver({"primary": [SendResult.failed(Observation(status=401))],
                     "backup": [SendResult.failed(Observation(status=401))]})
    try:
        driver.run(loop().steps())
    except FailoverExhausted as stop:
        assert stop.exceptions and stop.reason
    else:
        raise AssertionError("a turn whose every route refuses the key must stop")


def test_an_interrupted_begin_that_was_rejected_leaves_nothing_said_to_await_recovery(
        caplog: pytest.LogCaptureFixture) -> None:
    # The interruption reaches the loop at its begin (a write whose outcome the driver could not
    # learn), so the loop settles the Attempt not_sent, in case the begin committed; the store
    # answers that the begin was rejected (as it does: tests/storage/test_write_path.py). A
    # rejected Attempt holds nothing and was never sent: nothing is left for recovery either,
    # and nothing is logged above DEBUG that says otherwise.
    caplog.set_level(logging.DEBUG, logger="ledger")
    steps = loop().steps()
    driver = Driver({})
    eff = steps.send(None)
    while not isinstance(eff, Begin):
        eff = steps.send(driver.answer(eff))
    eff = steps.throw(KeyboardInterrupt())
    while not isinstance(eff, Settle):
        eff = steps.send(driver.answer(eff))
    assert eff.outcome is Outcome.NOT_SENT
    rejected = InvalidState(f"attempt {eff.attempt_id!r} was rejected before dispatch; nothing "
                            "to settle", attempt_id=eff.attempt_id, state="rejected")
    with pytest.raises(KeyboardInterrupt):
        steps.throw(rejected)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(eff.attempt_id in r.getMessage() and "nothing to settle" in r.getMessage()
               for r in caplog.records)
