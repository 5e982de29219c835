"""A Child spends its parent's money by its parent's time (invariant 4, and the audit).

A Child left without a tenant was counted under no tenant, so ``costs --tenant acme`` and the
dashboard's per-tenant views under-reported what acme's Runs spent; one left without a deadline
could outlive its parent's. Admission now gives a Child its parent's tenant (another one is
refused), its parent's labels under its own, and a deadline no later than its parent's (a later
one is refused, as a budget larger than the parent has left is). The low-level API and the
session's ``child`` share the rule, on SQLite and PostgreSQL, sync and async.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from decimal import Decimal

import pytest
from sqlalchemy import update

from ledger import AsyncLedger
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.bounds import MAX_LABELS
from ledger.domain.records import Lease
from ledger.errors import AdmissionConflict, InvalidArgument, NotFound
from ledger.ops.audit import Audit
from ledger.storage import schema as s

from .helpers import budget, grant, routes, sql_context

T0 = 1_700_006_400.0
DEADLINE = T0 + 3600
ENV = "sha256:" + "e" * 64
SMALL = budget(calls=2, retries=0, cost="0.30")


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=ManualClock(T0)) as led:
        led.admit_run("p", plan=routes(), budget=budget(), grant=grant(), tenant="acme",
                      labels={"team": "search", "stage": "draft"}, deadline=DEADLINE)
        yield led


def _nothing_admitted(led: Ledger, child_id: str) -> None:
    with pytest.raises(NotFound):
        led.get_run(child_id)
    parent = led.get_run("p")
    assert (parent.carved, parent.carved_calls, parent.carved_retries) == (0, 0, 0)


def _spend(led: Ledger, lease: Lease, cost: str) -> None:
    att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.10")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost=cost)


def test_a_childs_spend_counts_under_its_parents_tenant(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    child = led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl)
    assert child.tenant == "acme"
    _spend(led, led.acquire_lease("c"), "0.07")
    _spend(led, pl, "0.01")
    audit = Audit(led)
    costs = {t.key: t.cost for t in audit.costs(by="tenant").items}
    assert costs == {"acme": Decimal("0.08")}  # none under no tenant
    spend = {x.key: (x.runs, x.budget, x.posted) for x in audit.spend(by="tenant").items}
    # The parent counts its budget less the carve, the Child the carve: 1.00 in all.
    assert spend == {"acme": (2, Decimal("1.00"), Decimal("0.08"))}
    # Naming the parent's tenant is the same Child, admitted again.
    assert led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                         tenant="acme") == led.get_run("c")


def test_a_child_of_another_tenant_than_its_parents_is_refused_before_anything_is_carved(
        led: Ledger) -> None:
    pl = led.acquire_lease("p")
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                      tenant="beta")
    assert ei.value.field == "tenant"
    assert "'acme'" in str(ei.value) and "leave tenant out" in str(ei.value)
    _nothing_admitted(led, "c")
    # A parent of no tenant has no money of a tenant's to give: its Child names none either.
    led.admit_run("q", plan=routes(), budget=budget(), grant=grant())
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("qc", plan=routes(), grant=grant(), budget=SMALL,
                      parent=led.acquire_lease("q"), tenant="acme")
    assert ei.value.field == "tenant" and "admit the parent with that tenant" in str(ei.value)
    with pytest.raises(NotFound):
        led.get_run("qc")


def test_a_child_never_outlives_its_parents_deadline(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    assert led.admit_run("c1", plan=routes(), grant=grant(), budget=SMALL,
                         parent=pl).deadline == DEADLINE
    assert led.admit_run("c2", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                         deadline=DEADLINE - 60).deadline == DEADLINE - 60
    assert led.admit_run("c3", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                         deadline=DEADLINE).deadline == DEADLINE
    before = led.get_run("p")
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("c4", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                      deadline=DEADLINE + 0.5)
    assert ei.value.field == "deadline" and "leave deadline out" in str(ei.value)
    assert ei.value.fields["parent_deadline"] == DEADLINE
    with pytest.raises(NotFound):
        led.get_run("c4")
    assert led.get_run("p") == before  # nothing more carved
    # A parent without a deadline bounds none: the Child's own stands, or none.
    led.admit_run("q", plan=routes(), budget=budget(), grant=grant(), tenant="acme")
    ql = led.acquire_lease("q")
    assert led.admit_run("qc", plan=routes(), grant=grant(), budget=SMALL, parent=ql,
                         deadline=DEADLINE + 60).deadline == DEADLINE + 60
    assert led.admit_run("qd", plan=routes(), grant=grant(), budget=SMALL,
                         parent=ql).deadline is None


def test_a_child_carries_its_parents_labels_its_own_winning(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    child = led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                          labels={"stage": "verify", "step": "2"})
    assert child.labels == {"team": "search", "stage": "verify", "step": "2"}
    _spend(led, led.acquire_lease("c"), "0.05")
    _spend(led, pl, "0.01")
    audit = Audit(led)
    # A total by one of the parent's labels includes its Child's spend.
    by_team = {t.key: t.cost for t in audit.costs(by="label", label="team").items}
    assert by_team == {"search": Decimal("0.06")}
    by_stage = {t.key: t.cost for t in audit.costs(by="label", label="stage").items}
    assert by_stage == {"draft": Decimal("0.01"), "verify": Decimal("0.05")}


def test_a_childs_labels_with_its_parents_stay_within_the_bound(led: Ledger) -> None:
    pl = led.acquire_lease("p")
    own = {f"k{i}": "v" for i in range(MAX_LABELS - 1)}  # 63 of its own, 65 with the parent's
    with pytest.raises(InvalidArgument) as ei:
        led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl, labels=own)
    assert ei.value.field == "labels" and f"limit of {MAX_LABELS}" in str(ei.value)
    _nothing_admitted(led, "c")
    # A key the parent has already counts once.
    fits = {**{f"k{i}": "v" for i in range(MAX_LABELS - 2)}, "team": "eval"}
    assert len(led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                             labels=fits).labels) == MAX_LABELS


def test_a_child_admitted_before_children_inherited_is_continued_on_its_own_terms(
        db_url: str) -> None:
    """A Child frozen by an earlier version (no tenant, labels or deadline of its parent's),
    entered again on the same terms after an upgrade, is the same Run, not a conflict."""
    with Ledger.open(db_url, clock=ManualClock(T0), executor_id="w") as led:
        led.admit_run("p", plan=routes(), budget=budget(), grant=grant(), tenant="acme",
                      labels={"team": "search"}, deadline=DEADLINE)
        pl = led.acquire_lease("p")
        led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                      labels={"step": "1"})
        # What the earlier version froze: the caller's terms as passed.
        with sql_context(led).engine.begin() as conn:
            conn.execute(update(s.runs).where(s.runs.c.run_id == "c").values(
                tenant=None, labels='{"step": "1"}', deadline=None))
    # The upgraded process, the same executor (the parent's lease is its own).
    with Ledger.open(db_url, clock=ManualClock(T0), executor_id="w") as led:
        pl = led.acquire_lease("p")
        again = led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                              labels={"step": "1"})
        assert (again.tenant, again.labels, again.deadline) == (None, {"step": "1"}, None)
        assert led.get_run("p").carved_calls == SMALL.max_calls  # carved once
        # Other terms under its id are still a conflict.
        with pytest.raises(AdmissionConflict) as ei:
            led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                          labels={"step": "2"})
        assert "labels" in ei.value.differing


@pytest.mark.parametrize("entered", ["as_admitted", "terms_left_out"])
def test_a_child_frozen_with_a_tenant_and_deadline_now_refused_is_still_continued(
        db_url: str, entered: str) -> None:
    """A Child an earlier version froze under another tenant than its parent's and a later
    deadline (both allowed then) is continued when entered again after an upgrade, whether
    the caller passes those terms again or leaves them out (the refusal's own fix), never
    refused so that its carve stays taken; a term it does not hold is still a conflict."""
    with Ledger.open(db_url, clock=ManualClock(T0), executor_id="w") as led:
        led.admit_run("p", plan=routes(), budget=budget(), grant=grant(), tenant="acme",
                      deadline=DEADLINE)
        pl = led.acquire_lease("p")
        led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl)
        with sql_context(led).engine.begin() as conn:
            conn.execute(update(s.runs).where(s.runs.c.run_id == "c").values(
                tenant="research", labels='{"step": "1"}', deadline=DEADLINE + 60))
    own = ({"tenant": "research", "labels": {"step": "1"}, "deadline": DEADLINE + 60}
           if entered == "as_admitted" else {})
    with Ledger.open(db_url, clock=ManualClock(T0), executor_id="w") as led:
        with led.run("p", plan=routes(), budget=budget(), grant=grant(), tenant="acme",
                     deadline=DEADLINE) as run:
            for other in ({"tenant": "beta"}, {"deadline": DEADLINE + 1}):
                with pytest.raises((InvalidArgument, AdmissionConflict)), \
                        run.child("c", budget=SMALL, **other):
                    pass
            with run.child("c", budget=SMALL, **own):
                rec = led.get_run("c")
                assert led.get_run("p").carved_calls == SMALL.max_calls  # carved once
        assert (rec.tenant, rec.labels, rec.deadline) == (
            "research", {"step": "1"}, DEADLINE + 60)


def test_a_child_frozen_with_labels_too_many_beside_its_parents_is_still_continued(
        db_url: str) -> None:
    """A Child an earlier version froze with labels of its own that, with its parent's, are
    over the limit is continued when entered again with them, not refused."""
    theirs = {f"p{i}": "x" for i in range(40)}
    mine = {f"c{i}": "y" for i in range(30)}
    with Ledger.open(db_url, clock=ManualClock(T0), executor_id="w") as led:
        led.admit_run("p", plan=routes(), budget=budget(), grant=grant(), labels=theirs)
        pl = led.acquire_lease("p")
        led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl)
        with sql_context(led).engine.begin() as conn:
            conn.execute(update(s.runs).where(s.runs.c.run_id == "c").values(
                labels=json.dumps(mine)))
        again = led.admit_run("c", plan=routes(), grant=grant(), budget=SMALL, parent=pl,
                              labels=mine)
        assert again.labels == mine
        assert led.get_run("p").carved_calls == SMALL.max_calls  # carved once


def test_a_child_session_takes_its_parents_tenant_labels_and_deadline(db_url: str) -> None:
    with Ledger.open(db_url, clock=ManualClock(T0)) as led, \
            led.run("p", plan=routes(), budget=budget(), grant=grant(), tenant="acme",
                    labels={"team": "search"}, deadline=DEADLINE) as run:
        with run.child("c", budget=SMALL, labels={"step": "1"}):
            rec = led.get_run("c")
        assert (rec.tenant, rec.labels, rec.deadline) == (
            "acme", {"team": "search", "step": "1"}, DEADLINE)
        with pytest.raises(InvalidArgument) as ei, run.child("c2", budget=SMALL,
                                                              deadline=DEADLINE + 1):
            pass
        assert ei.value.field == "deadline"
        with pytest.raises(NotFound):
            led.get_run("c2")


def test_an_async_child_session_takes_its_parents_tenant_labels_and_deadline(
        db_url: str) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=ManualClock(T0)) as led, \
                led.run("p", plan=routes(), budget=budget(), grant=grant(), tenant="acme",
                        labels={"team": "search"}, deadline=DEADLINE) as run:
            async with run.child("c", budget=SMALL, deadline=DEADLINE - 60):
                rec = await led.get_run("c")
            assert (rec.tenant, rec.labels, rec.deadline) == (
                "acme", {"team": "search"}, DEADLINE - 60)
            with pytest.raises(InvalidArgument) as ei:
                async with run.child("c2", budget=SMALL, tenant="beta"):
                    pass
            assert ei.value.field == "tenant"
            pl = run.lease
            # The low-level async admission applies the same rule.
            child = await led.admit_run("c3", plan=routes(), grant=grant(), budget=SMALL,
                                        parent=pl)
            assert (child.tenant, child.deadline) == ("acme", DEADLINE)

    asyncio.run(main())
