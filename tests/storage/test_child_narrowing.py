"""A Child is never broader than its parent (invariants 4, 5 and 7): roles, role, policy.

Plan and grant narrowing are in ``test_write_path``; here: a child that passes no role limit
inherits the parent's, a child role outside the parent's roles is refused, and a child runs
under the parent's frozen policy (a looser preset is refused, none given inherits it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ledger.api.facade import Ledger
from ledger.domain.values import Grant
from ledger.errors import InvalidArgument

from .helpers import budget, grant, routes


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url) as led:
        led.admit_run("p", plan=routes(), budget=budget(calls=10, retries=5),
                      grant=Grant(recipients={"r1": ["user_input", "model_derived"],
                                              "r2": ["user_input"]}, roles=["research"]),
                      policy="failure-domain")
        yield led


def test_child_without_a_role_limit_inherits_the_parents(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    child = led.admit_run("c", plan=routes()[:1], budget=budget(calls=1, retries=0, cost="0.1"),
                          grant=Grant(recipients={"r1": ["user_input"]}, roles=None),
                          parent=pl)
    assert child.grant.roles == ["research"]


def test_child_role_outside_the_parents_roles_is_refused(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("c", plan=routes()[:1], budget=budget(calls=1, retries=0, cost="0.1"),
                      grant=Grant(recipients={"r1": ["user_input"]}), role="evaluation",
                      parent=pl)
    assert ei.value.field == "role"
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("c", plan=routes()[:1], budget=budget(calls=1, retries=0, cost="0.1"),
                      grant=Grant(recipients={"r1": ["user_input"]},
                                  roles=["research", "diagnostics"]), parent=pl)
    assert ei.value.field == "grant.roles"
    assert led.children("p") == [] and led.get_run("p").carved_calls == 0


def test_child_runs_under_the_parents_frozen_policy(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("c", plan=routes()[:1], budget=budget(calls=1, retries=0, cost="0.1"),
                      grant=Grant(recipients={"r1": ["user_input"]}), policy="goclaw",
                      parent=pl)
    assert ei.value.field == "policy"
    child = led.admit_run("c", plan=routes()[:1], budget=budget(calls=1, retries=0, cost="0.1"),
                          grant=Grant(recipients={"r1": ["user_input"]}), parent=pl)
    assert child.policy_hash == led.get_run("p").policy_hash
    same = led.admit_run("c2", plan=routes()[:1], budget=budget(calls=1, retries=0, cost="0.1"),
                         grant=Grant(recipients={"r1": ["user_input"]}),
                         policy="failure-domain", parent=pl)
    assert same.policy_hash == child.policy_hash


def test_child_without_a_grant_inherits_the_parents_approvals_for_its_recipients(
        led: Ledger) -> None:
    pl = led.acquire_lease("p")
    child = led.admit_run("c", plan=routes()[2:], budget=budget(calls=1, retries=0, cost="0.1"),
                          parent=pl)
    assert child.grant.recipients == {"r2": ["user_input"]}
    assert child.grant.roles == ["research"]


def test_invariant4_tokens_carved_for_a_child_are_not_the_parents_to_hold(db_url: str) -> None:
    """A parent's begin counts the tokens it carved out for its Children as gone."""
    from decimal import Decimal

    from ledger.domain.values import Budget
    from ledger.errors import BudgetExceeded

    with Ledger.open(db_url) as led:
        led.admit_run("tp", plan=routes(), policy="failure-domain", grant=grant(),
                      budget=Budget(max_calls=10, max_retries=3, max_cost=Decimal(1),
                                    max_tokens=1000))
        pl = led.acquire_lease("tp")
        led.admit_run("tc", plan=routes()[:1], parent=pl,
                      budget=Budget(max_calls=1, max_retries=0, max_cost=Decimal("0.1"),
                                    max_tokens=800))
        assert led.get_run("tp").tokens_left == 200
        with pytest.raises(BudgetExceeded) as ei:
            led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0",
                              reserve_tokens=300)
        assert ei.value.fields["available"] == 200 and ei.value.fields["field"] == "tokens"
        assert led.timeline("tp") == []
        att = led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0",
                                reserve_tokens=200)
        assert att.reserved_tokens == 200
