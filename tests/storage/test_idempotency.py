"""Retries of the same write are recognised (invariant 2), as ``docs/operations.md`` advises.

Admissions compare normalised content (decimals, set-like lists, defaults); a begin retried
with the same attempt id after a lost acknowledgement — also under a lease acquired again — is
the same write, and the Attempt can then be settled.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger import faults
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import AdmissionConflict, DatabaseUnavailable
from ledger.ops.reconcile import reconcile

from .helpers import routes


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(90_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as led:
        yield led
    faults.disarm()


def test_invariant2_one_budget_spelled_three_ways_is_one_admission(led: Ledger) -> None:
    grant = Grant(recipients={"r1": ["user_input", "model_derived"], "r2": ["user_input"]})
    first = led.admit_run("r", plan=routes(), grant=grant,
                          budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    again = led.admit_run("r", plan=routes(), budget=Budget(max_calls=3, max_retries=1,
                                                            max_cost=Decimal("1.00")),
                          grant=Grant(recipients={"r2": ["user_input"],
                                                  "r1": ["model_derived", "user_input"]}))
    third = led.admit_run("r", plan=routes(), grant=grant,
                          budget={"max_calls": 3, "max_retries": 1, "max_cost": "1.0"})
    assert first.run_id == again.run_id == third.run_id
    assert first.created_at == again.created_at == third.created_at
    with pytest.raises(AdmissionConflict) as ei:
        led.admit_run("r", plan=routes(), grant=grant,
                      budget={"max_calls": 3, "max_retries": 1, "max_cost": "1.01"})
    assert ei.value.differing == ["budget"]


def test_invariant2_minus_zero_and_zero_are_one_admission(led: Ledger) -> None:
    # A budget or a price of -0 equals 0; frozen apart, a retried admission spelling it the
    # other way would conflict with itself.
    def plan(price: str) -> list[Route]:
        return [r.model_copy(update={"price": Price(input_per_mtok=price, output_per_mtok="1")})
                for r in routes()]

    first = led.admit_run("z", plan=plan("0"),
                          budget={"max_calls": 1, "max_retries": 0, "max_cost": "0"})
    for price, cost in (("0", "-0"), ("-0", "0"), ("-0.00", "-0.0"), ("0.00", "0.00")):
        again = led.admit_run("z", plan=plan(price),
                              budget={"max_calls": 1, "max_retries": 0, "max_cost": cost})
        assert again.content_hash == first.content_hash and again.created_at == first.created_at
    run = led.get_run("z")
    assert str(run.budget.max_cost) == "0" and str(run.plan[0].price.input_per_mtok) == "0"


def _lose_ack(_name: str) -> None:
    raise DatabaseUnavailable("the acknowledgement of the commit was lost")


def test_invariant2_begin_retried_after_a_lost_ack_under_the_same_lease(led: Ledger) -> None:
    led.admit_run("r", plan=routes(), budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    lease = led.acquire_lease("r", ttl_s=30)
    faults.arm("begin.after_commit", _lose_ack)
    with pytest.raises(DatabaseUnavailable):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")
    # The guide: acquire the lease again (it may have moved on), retry with the same id.
    lease = led.acquire_lease("r", ttl_s=30)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                            attempt_id="att-1")
    assert att.state is AttemptState.DISPATCHING and att.fence == lease.fence
    done = led.settle_attempt(lease, "att-1", outcome="succeeded", cost="0.05")
    assert done.debit_state is DebitState.POSTED
    assert led.get_run("r").calls_used == 1
    assert reconcile(led).ok


def test_invariant2_begin_retried_under_a_lease_acquired_again_is_adopted(
        led: Ledger, clock: ManualClock) -> None:
    led.admit_run("r", plan=routes(), budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    led.configure_group("g", max_in_flight=1)
    lease = led.acquire_lease("r", ttl_s=10)
    faults.arm("begin.after_commit", _lose_ack)
    with pytest.raises(DatabaseUnavailable):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")
    clock.advance(11)  # the database stayed away long enough for the lease to lapse
    lease = led.acquire_lease("r", ttl_s=10)
    assert lease.fence == 2
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                            attempt_id="att-1")
    assert att.fence == 2  # adopted: its slot counts again under the new lease
    assert led.group_projections(["g"])["g"].in_flight == 1
    led.settle_attempt(lease, "att-1", outcome="succeeded", cost="0.05")
    assert [e.kind for e in led.events("r", ["adopt"])] == ["adopt"]
    assert led.get_run("r").calls_used == 1
    assert reconcile(led).ok


def test_an_adoption_refused_by_a_full_group_is_not_sent(led: Ledger, clock: ManualClock
                                                         ) -> None:
    led.admit_run("r", plan=routes(), budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    led.admit_run("s", plan=routes(), budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    led.configure_group("g", max_in_flight=1)
    lease = led.acquire_lease("r", ttl_s=10)
    faults.arm("begin.after_commit", _lose_ack)
    with pytest.raises(DatabaseUnavailable):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")
    faults.disarm()
    clock.advance(11)
    other = led.acquire_lease("s", ttl_s=30, executor_id="w2")
    led.begin_attempt(other, route="a", envelope_hash="sha256:e", reserve="0.1")  # g is full
    lease = led.acquire_lease("r", ttl_s=10)
    from ledger.errors import CapacityUnavailable

    with pytest.raises(CapacityUnavailable):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")
    att = led.get_attempt("att-1")
    assert att.state is AttemptState.NOT_SENT and att.debit_state is DebitState.VOIDED
    assert led.get_run("r").calls_used == 0 and led.get_run("r").reserved == 0
    assert reconcile(led).ok
