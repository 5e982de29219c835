"""Budgets hold on every axis (invariant 4), and every switch takes a permission.

Token budgets are held and posted like cost and re-checked before every retry and failover; a
switch after an admission rejection takes a retry permission; a reported cost above the hold is
posted at the hold and reported by reconcile.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, Transport
from ledger.domain.records import AttemptState
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import BudgetExceeded, FailoverExhausted
from ledger.ops.reconcile import reconcile

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
PLAN = [
    Route(id="a", provider="pa", model="m1", group="ga", recipient="ra", price=PRICE),
    Route(id="b", provider="pb", model="m2", group="gb", recipient="ra", price=PRICE),
]
GRANT = Grant(recipients={"ra": ["user_input"]})
ENV = Envelope(parts=[Part(content="x" * 400)], max_output_tokens=100)  # ~100 + 100 tokens


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=ManualClock(70_000.0)) as led:
        yield led


class Sender:
    def __init__(self, **by_route: SendResult) -> None:
        self.by_route = by_route
        self.sent: list[str] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d.route.id)
        return self.by_route.get(d.route.id, SendResult(ok=True, output="ok", prompt_tokens=90,
                                                        completion_tokens=40,
                                                        cost=Decimal("0.0002")))


def _admit(led: Ledger, *, tokens: int | None, retries: int = 3, policy: str = "goclaw",
           plan: list[Route] = PLAN) -> object:
    led.admit_run("r", plan=plan, budget=Budget(max_calls=6, max_retries=retries,
                                                max_cost=Decimal("1"), max_tokens=tokens),
                  grant=GRANT, policy=policy)
    return led.acquire_lease("r")


def test_invariant4_token_budget_is_held_posted_and_never_moves_on(led: Ledger) -> None:
    lease = _admit(led, tokens=150)  # less than one attempt's hold (prompt + max output)
    send = Sender()
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "budget" and send.sent == []
    assert isinstance(ei.value.exceptions[0], BudgetExceeded)
    assert led.timeline("r") == []
    stop = led.events("r", ["stop"])[0].data
    assert stop["reason"] == "budget"


def test_a_token_budget_refusal_names_the_run_without_a_possessive_after_its_quoted_id(
        led: Ledger) -> None:
    lease = _admit(led, tokens=150)
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, Sender())  # type: ignore[arg-type]
    refusal = str(ei.value.exceptions[0])
    assert "would overdraw the token budget of run 'r' (left: 150)" in refusal
    assert "''s" not in str(ei.value)


def test_invariant4_tokens_are_rechecked_before_a_retry_or_failover(led: Ledger) -> None:
    lease = _admit(led, tokens=300)  # room for one hold of ~200 tokens, not two
    # Sent, then no answer: the attempt is unknown and keeps its token hold.
    send = Sender(a=SendResult.failed(Observation(transport=Transport.READ_TIMEOUT)))
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "budget" and send.sent == ["a"]  # goclaw would have moved on
    [att] = led.timeline("r")
    assert att.state is AttemptState.UNKNOWN
    run = led.get_run("r")
    assert run.tokens_reserved == att.reserved_tokens and run.tokens_used == 0
    assert reconcile(led).ok


def test_invariant4_token_hold_posts_the_reported_usage(led: Ledger) -> None:
    lease = _admit(led, tokens=10_000)
    res = execute(led, lease, ENV, Sender())  # type: ignore[arg-type]
    run = led.get_run("r")
    assert run.tokens_used == 130 and run.tokens_reserved == 0
    assert res.attempt.reserved_tokens >= 130
    assert reconcile(led).ok


def test_invariant4_a_switch_after_an_admission_rejection_takes_a_retry_permission(
        led: Ledger) -> None:
    led.configure_group("ga", max_in_flight=1)
    led.admit_run("other", plan=PLAN, budget=Budget(max_calls=2, max_retries=0,
                                                    max_cost=Decimal("1")), grant=GRANT)
    other = led.acquire_lease("other", ttl_s=3600)
    led.begin_attempt(other, route="a", envelope_hash="sha256:e", reserve="0")  # ga is full
    _admit(led, tokens=None, retries=0)
    lease = led.acquire_lease("r", ttl_s=3600)
    send = Sender()
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    # ga stayed full past the wait bound; the switch to another group needs a retry
    # permission, and there is none.
    assert ei.value.reason == "retry_allowance" and send.sent == []
    assert led.timeline("r") == []
    assert led.get_run("r").retries_used == 0


def test_reported_cost_above_the_hold_is_posted_at_the_hold_and_reported(
        led: Ledger, db_url: str) -> None:
    lease = _admit(led, tokens=None)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.001")
    done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.5")
    assert done.cost == Decimal("0.5")
    run = led.get_run("r")
    assert run.posted == Decimal("0.001")  # at the hold: the budget invariant
    check = reconcile(led)
    assert not check.violations and len(check.cost_over_hold) == 1
    # In currency units, as every other amount: not the micro-units the books store.
    assert "reported cost 0.5 above its hold 0.001 (posted at the hold)" in check.cost_over_hold[0]
    # Reported, not a fault: a monitor on reconcile's exit status must not alert for ever on
    # an estimate the provider's bill went past.
    assert check.ok
    cli = subprocess.run([sys.executable, "-m", "ledger.cli.main", "--db", db_url, "reconcile"],
                         capture_output=True, text=True)
    assert cli.returncode == 0 and "cost_over_hold" in cli.stdout


def test_reported_tokens_above_the_token_hold_are_posted_at_the_hold_and_reported(
        led: Ledger, db_url: str) -> None:
    """Under a token budget a settle adds at most the token hold to ``tokens_used`` (as cost
    is posted at most the cost hold); what the provider reported past it, and any usage of a
    low-level begin that held no tokens, is kept on the Attempt and listed by reconcile."""
    lease = _admit(led, tokens=1000)
    held = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01",
                             reserve_tokens=200)
    led.settle_attempt(lease, held.attempt_id, outcome="succeeded", prompt_tokens=3000,
                       completion_tokens=2000, cost="0.001")
    unheld = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01",
                               turn_id="turn-2")  # reserve_tokens defaults to 0
    done = led.settle_attempt(lease, unheld.attempt_id, outcome="succeeded", prompt_tokens=70,
                              completion_tokens=30, cost="0.001")
    assert (done.prompt_tokens, done.completion_tokens) == (70, 30)  # the Attempt keeps them
    assert led.get_run("r").tokens_used == 200  # at the holds: 200 + 0
    check = reconcile(led)
    assert check.ok and not check.violations and check.cost_over_hold == []
    assert check.tokens_over_hold == [
        f"run r attempt {held.attempt_id}: reported tokens 5000 above its hold 200 "
        "(posted at the hold)",
        f"run r attempt {unheld.attempt_id}: reported tokens 100 above its hold 0 "
        "(posted at the hold)"]
    assert check.to_json()["tokens_over_hold"] == check.tokens_over_hold
    assert "tokens_over_hold: 2" in check.summary()
    cli = subprocess.run([sys.executable, "-m", "ledger.cli.main", "--db", db_url, "reconcile"],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert f"tokens_over_hold: run r attempt {held.attempt_id}: reported tokens 5000" in cli.stdout


def test_tokens_above_the_hold_of_a_run_without_a_token_budget_are_posted_whole_not_listed(
        led: Ledger) -> None:
    lease = _admit(led, tokens=None)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=300,
                       completion_tokens=200, cost="0.001")
    assert led.get_run("r").tokens_used == 500  # no budget to cap them at
    assert reconcile(led).tokens_over_hold == []


def test_a_stop_on_a_refused_begin_keeps_the_candidates_its_decision_skipped(
        led: Ledger) -> None:
    """The selector skipped ``a`` (its recipient is not in the grant) and chose ``b``, whose
    begin the token budget refused: the stop (its error, its event, the span's
    ``ledger.stop.skipped``) still says ``a`` was skipped and why. It said nothing was."""
    plan = [PLAN[0].model_copy(update={"recipient": "unapproved"}), PLAN[1]]
    lease = _admit(led, tokens=150, plan=plan)
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, Sender())  # type: ignore[arg-type]
    assert ei.value.reason == "budget"
    assert [(s["route"], s["reason"]) for s in ei.value.fields["skipped"]] == [
        ("a", "disclosure")]
    stop = led.events("r", ["stop"])[0].data
    assert [s["route"] for s in stop["skipped"]] == ["a"]
