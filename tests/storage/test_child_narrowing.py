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

from .helpers import budget, routes


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
