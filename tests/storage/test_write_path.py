"""The write path on both backends: admission, leases and fences, begin/settle, debits, children."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.facts import Category, FailureFact, Phase, Scope
from ledger.domain.records import AttemptState, DebitState
from ledger.domain.values import Budget, Grant
from ledger.errors import (
    AdmissionConflict,
    AllowanceExhausted,
    BudgetExceeded,
    CapacityUnavailable,
    Conflict,
    FencedOut,
    InvalidArgument,
    InvalidState,
    LeaseHeld,
    NotFound,
    SettleConflict,
)

from .helpers import budget, grant, routes


def _fail(status: int = 503, phase: Phase = Phase.AFTER_HEADERS) -> FailureFact:
    return FailureFact(category=Category.OVERLOADED, status=status, phase=phase,
                       scope=Scope.ROUTE, moves_on=True, resubmit=True)


def test_admit_freezes_and_duplicate_returns_first_identity(led: Ledger) -> None:
    first = led.admit_run("r1", plan=routes(), budget=budget(), grant=grant(), policy="goclaw")
    again = led.admit_run("r1", plan=routes(), budget=budget(), grant=grant(), policy="goclaw")
    assert again.run_id == first.run_id and again.content_hash == first.content_hash
    assert again.created_at == first.created_at
    assert [r.id for r in first.plan] == ["a", "b", "c"]
    assert first.selected_route == "a" and first.policy["name"] == "goclaw"


def test_admit_conflict_names_every_differing_field(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    with pytest.raises(AdmissionConflict) as ei:
        led.admit_run("r1", plan=routes()[:2], budget=budget(calls=3), grant=grant(),
                      role="reviewer")
    assert set(ei.value.differing) == {"plan", "budget", "role"}
    # Nothing recorded changed.
    assert led.get_run("r1").budget.max_calls == 10


def test_admit_bad_input(led: Ledger) -> None:
    with pytest.raises(InvalidArgument, match=r"budget\.max_calls") as ei:
        led.admit_run("r1", plan=routes(), budget={"max_calls": -1, "max_retries": 1,
                                                   "max_cost": "1"})
    assert ei.value.field and "budget" in ei.value.field
    with pytest.raises(InvalidArgument, match="max_retries"):
        led.admit_run("r1", plan=routes(), budget={"max_calls": 1, "max_cost": "1"})
    with pytest.raises(InvalidArgument, match="plan is empty"):
        led.admit_run("r1", plan=[], budget=budget())
    with pytest.raises(NotFound, match="unknown run id"):
        led.get_run("nope")


def test_lease_fence_and_stale_executor_refused_everywhere(led: Ledger, clock: ManualClock
                                                           ) -> None:
    led.admit_run("r1", plan=routes(), budget=budget())
    old = led.acquire_lease("r1", ttl_s=30, executor_id="w1")
    att = led.begin_attempt(old, route="a", envelope_hash="sha256:e", reserve="0.1")
    with pytest.raises(LeaseHeld) as held:
        led.acquire_lease("r1", executor_id="w2")
    # The expiry as a reader acts on it, not an epoch float.
    assert "its lease expiring in 30 s (" in str(held.value) and "Z)" in str(held.value)
    clock.advance(31)
    new = led.acquire_lease("r1", executor_id="w2")
    assert new.fence == old.fence + 1
    with pytest.raises(FencedOut):
        led.begin_attempt(old, route="a", envelope_hash="sha256:e", reserve="0.1")
    with pytest.raises(FencedOut):
        led.settle_attempt(old, att.attempt_id, outcome="succeeded", cost="0.05")
    with pytest.raises(FencedOut):
        led.renew_lease(old)
    with pytest.raises(FencedOut):
        led.release_lease(old)
    with pytest.raises(FencedOut):
        led.reserve_retry(old)
    assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING
    led.renew_lease(new)


def test_a_parent_out_of_calls_by_its_childrens_carve_says_so(led: Ledger) -> None:
    led.admit_run("p", plan=routes(), budget=budget(calls=5, retries=2, cost="1.00"),
                  grant=grant())
    pl = led.acquire_lease("p")
    led.admit_run("c", plan=routes(), budget=budget(calls=5, retries=0, cost="0.1"),
                  grant=grant(), parent=pl)
    with pytest.raises(AllowanceExhausted, match=r"\(0 of 5, and 5 carved for its children\)"):
        led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0.01")


def test_a_fence_never_granted_is_refused_as_such_and_leaves_no_receipt(led: Ledger) -> None:
    """A lease built by hand with a fence above the Run's is no stale executor's: the refusal
    says the fence was never granted, and nothing of the settle is kept as a late receipt."""
    led.admit_run("r1", plan=routes(), budget=budget())
    lease = led.acquire_lease("r1", ttl_s=30)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1")
    forged = replace(lease, fence=lease.fence + 5)
    before = [e.kind for e in led.events("r1")]
    with pytest.raises(FencedOut, match="never granted"):
        led.settle_attempt(forged, att.attempt_id, outcome="succeeded", cost="0.05")
    with pytest.raises(FencedOut, match="never granted"):
        led.begin_attempt(forged, route="a", envelope_hash="sha256:e", reserve="0.1")
    assert [e.kind for e in led.events("r1")] == before
    assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING


def test_begin_settle_success_posts_and_releases(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(cost="1.00"))
    lease = led.acquire_lease("r1")
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.30")
    run = led.get_run("r1")
    assert run.reserved == Decimal("0.3") and run.calls_used == 1
    done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.12",
                              prompt_tokens=100, completion_tokens=20, model_reported="m1-x")
    assert done.state is AttemptState.SUCCEEDED and done.debit_state is DebitState.POSTED
    run = led.get_run("r1")
    assert run.reserved == 0 and run.posted == Decimal("0.12") and run.tokens_used == 120
    assert run.current_route == "a"
    d = led.debit(att.debit_id)
    assert d.posted == Decimal("0.12") and d.state is DebitState.POSTED
    # Duplicate settle, same content: the same write.
    same = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.12",
                              prompt_tokens=100, completion_tokens=20, model_reported="m1-x")
    assert same == done
    with pytest.raises(SettleConflict):
        led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=_fail())
    assert led.get_run("r1").posted == Decimal("0.12")


def test_settling_an_unknown_attempt_again_is_refused_naming_settle_unknown_the_way_out(
        led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(cost="1.00"))
    lease = led.acquire_lease("r1")
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.30")
    led.mark_unknown(lease, att.attempt_id, "shutdown with the call out")
    with pytest.raises(SettleConflict) as ei:
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.12")
    said = str(ei.value)
    assert "already settled as unknown" in said and ei.value.fields["state"] == "unknown"
    assert f"Ledger.settle_unknown({att.attempt_id!r}, outcome=..., note=...)" in said
    assert f"failover-ledger attempt settle {att.attempt_id}" in said
    assert led.get_attempt(att.attempt_id).state is AttemptState.UNKNOWN  # nothing written
    # The way it names is open: the evidence settles it.
    done = led.settle_unknown(att.attempt_id, outcome="succeeded", cost="0.12",
                              note="provider console, req 7a1")
    assert done.state is AttemptState.SUCCEEDED
    # A settled state that cannot move any more names no way out.
    with pytest.raises(SettleConflict) as again:
        led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=_fail())
    assert "settle_unknown" not in str(again.value)


def test_a_settle_finds_the_attempts_run_and_route_whoever_began_it(
        led: Ledger, db_url: str, clock: ManualClock) -> None:
    # The ledger that began an Attempt settles it from what its begin recorded; another
    # ledger (another process, a restart) reads it first. Both refuse another Run's lease and
    # settle the route the Attempt used (its health row), not the lease Run's first route.
    led.admit_run("r1", plan=routes(), budget=budget(cost="1.00"))
    led.admit_run("r2", plan=routes(), budget=budget(cost="1.00"))
    l1, l2 = led.acquire_lease("r1"), led.acquire_lease("r2")
    mine = led.begin_attempt(l1, route="b", envelope_hash="sha256:e", reserve="0.1")
    theirs = led.begin_attempt(l1, route="c", envelope_hash="sha256:e", reserve="0.1")
    # Its own executor id: one process refuses a second open ledger under "w1"; the lease it
    # is handed is what it settles under.
    with Ledger.open(db_url, clock=clock, executor_id="w2") as other:
        for settler, att in ((led, mine), (other, theirs)):
            with pytest.raises(NotFound):
                settler.settle_attempt(l2, att.attempt_id, outcome="succeeded", cost="0.1")
            done = settler.settle_attempt(l1, att.attempt_id, outcome="failed", fact=_fail())
            assert done.state is AttemptState.FAILED and done.route_id == att.route_id
            assert led.health()[att.route_id].last_failure_at == clock.now()
    assert "a" not in led.health()  # the lease Run's first route was never touched


def test_cost_above_the_hold_posts_at_most_the_hold(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(cost="1.00"))
    lease = led.acquire_lease("r1")
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.10")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.50")
    run = led.get_run("r1")
    assert run.posted == Decimal("0.1")
    assert led.get_attempt(att.attempt_id).cost == Decimal("0.5")  # the truth is kept


def test_failed_before_send_voids_unknown_keeps_hold(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(cost="1.00"))
    lease = led.acquire_lease("r1")
    a1 = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.2")
    led.settle_attempt(lease, a1.attempt_id, outcome="failed",
                       fact=_fail(phase=Phase.BEFORE_SEND))
    assert led.debit(a1.debit_id).state is DebitState.VOIDED
    a2 = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.2")
    unk = led.settle_attempt(lease, a2.attempt_id, outcome="unknown")
    assert unk.state is AttemptState.UNKNOWN and led.debit(a2.debit_id).state is \
        DebitState.RESERVED
    a3 = led.begin_attempt(lease, route="b", envelope_hash="sha256:e", reserve="0.2")
    led.settle_attempt(lease, a3.attempt_id, outcome="failed", fact=_fail(), cost="0.01")
    run = led.get_run("r1")
    assert run.reserved == Decimal("0.2")  # only the unknown attempt's hold
    assert run.posted == Decimal("0.01")
    assert [a.seq for a in led.timeline("r1")] == [1, 2, 3]
    assert [a.route_id for a in led.timeline("r1")] == ["a", "a", "b"]


def test_budget_and_allowance_refuse_without_overdraw(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(calls=2, retries=1, cost="0.50"))
    lease = led.acquire_lease("r1")
    led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.30")
    with pytest.raises(BudgetExceeded, match="overdraw"):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.30")
    led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.20")
    with pytest.raises(AllowanceExhausted, match="allowance"):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
    assert led.reserve_retry(lease) == 0
    with pytest.raises(AllowanceExhausted, match="retry"):
        led.reserve_retry(lease)
    run = led.get_run("r1")
    assert run.reserved == Decimal("0.5") and run.calls_used == 2 and run.retries_used == 1
    assert len(led.timeline("r1")) == 2


def test_invariant4_a_budget_finer_than_a_micro_is_rounded_down_and_never_overdrawn(
        led: Ledger) -> None:
    # Holds and costs round up to whole micro-units; a limit rounded up as well would let a
    # Run reserve and post more than its max_cost. 0.0000015 allows one micro, 0.0000001 none.
    led.admit_run("r1", plan=routes(), budget=budget(cost="0.0000015"))
    lease = led.acquire_lease("r1")
    run = led.get_run("r1")
    assert run.budget.max_cost == Decimal("0.0000015")
    assert run.cost_left == Decimal("0.000001") <= run.budget.max_cost
    with pytest.raises(BudgetExceeded, match="overdraw"):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.0000015")
    held = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.000001")
    led.settle_attempt(lease, held.attempt_id, outcome="succeeded", cost="0.0000015")
    run = led.get_run("r1")
    assert run.reserved + run.posted <= run.budget.max_cost and run.cost_left == 0
    with pytest.raises(BudgetExceeded, match="overdraw"):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.0000001")

    led.admit_run("r2", plan=routes(), budget=budget(cost="0.0000001"))
    l2 = led.acquire_lease("r2")
    assert led.get_run("r2").cost_left == 0
    with pytest.raises(BudgetExceeded, match="overdraw"):
        led.begin_attempt(l2, route="a", envelope_hash="sha256:e", reserve="0.0000001")
    assert led.get_run("r2").reserved == 0

    # A Child's carve is its limit, rounded down alike: it takes one micro of the parent's two.
    led.admit_run("p", plan=routes(), budget=budget(cost="0.000002"), grant=grant())
    pl = led.acquire_lease("p")
    led.admit_run("c", plan=routes(), budget=budget(cost="0.0000019"), grant=grant(), parent=pl)
    assert led.get_run("p").carved == Decimal("0.000001")
    assert led.get_run("c").cost_left == Decimal("0.000001")
    cl = led.acquire_lease("c")
    with pytest.raises(BudgetExceeded, match="overdraw"):
        led.begin_attempt(cl, route="a", envelope_hash="sha256:e", reserve="0.0000019")


def test_capacity_rejection_is_recorded_and_hold_voided(led: Ledger, clock: ManualClock
                                                         ) -> None:
    led.configure_group("g", max_in_flight=1)
    led.admit_run("r1", plan=routes(), budget=budget())
    led.admit_run("r2", plan=routes(), budget=budget())
    l1 = led.acquire_lease("r1")
    l2 = led.acquire_lease("r2", executor_id="w2")
    held = led.begin_attempt(l1, route="a", envelope_hash="sha256:e", reserve="0.1")
    with pytest.raises(CapacityUnavailable) as ei:
        led.begin_attempt(l2, route="b", envelope_hash="sha256:e", reserve="0.1")
    rej = led.get_attempt(ei.value.fields["attempt_id"])
    assert rej.state is AttemptState.REJECTED and rej.reject_reason == "capacity_full"
    assert led.debit(rej.debit_id).state is DebitState.VOIDED
    run2 = led.get_run("r2")
    assert run2.calls_used == 0 and run2.reserved == 0
    # A settle of it is refused, saying so (a turn interrupted at its begin then knows there is
    # nothing to settle, nor anything for recovery to do).
    with pytest.raises(InvalidState) as nothing:
        led.settle_attempt(l2, rej.attempt_id, outcome="not_sent")
    assert nothing.value.fields["state"] == "rejected"
    # Another group is independent.
    led.begin_attempt(l2, route="c", envelope_hash="sha256:e", reserve="0.1")
    led.settle_attempt(l1, held.attempt_id, outcome="succeeded", cost="0")
    led.begin_attempt(l2, route="b", envelope_hash="sha256:e", reserve="0.1")


def test_a_begin_refused_by_a_full_group_names_the_limit_and_what_was_in_flight(
        led: Ledger) -> None:
    # What a host sizing its groups reads (docs/reference.md): the refusal of its own begin
    # says the limit, as a turn's queue timeout does.
    led.configure_group("g", max_in_flight=2)
    for run_id in ("r1", "r2"):
        led.admit_run(run_id, plan=routes(), budget=budget())
    l1, l2 = led.acquire_lease("r1"), led.acquire_lease("r2", executor_id="w2")
    led.begin_attempt(l1, route="a", envelope_hash="sha256:e", reserve="0.1")
    led.begin_attempt(l1, route="b", envelope_hash="sha256:e", reserve="0.1")
    with pytest.raises(CapacityUnavailable) as ei:
        led.begin_attempt(l2, route="a", envelope_hash="sha256:e", reserve="0.1")
    fields = ei.value.fields
    assert (fields["group"], fields["limit"], fields["in_flight"]) == ("g", 2, 2)
    assert "limit 2, 2 in flight" in str(ei.value)


def test_dead_executor_slot_comes_back_after_lease_expiry(led: Ledger, clock: ManualClock
                                                           ) -> None:
    led.configure_group("g", max_in_flight=1)
    led.admit_run("r1", plan=routes(), budget=budget())
    led.admit_run("r2", plan=routes(), budget=budget())
    l1 = led.acquire_lease("r1", ttl_s=30)
    l2 = led.acquire_lease("r2", ttl_s=300, executor_id="w2")
    led.begin_attempt(l1, route="a", envelope_hash="sha256:e", reserve="0")
    with pytest.raises(CapacityUnavailable):
        led.begin_attempt(l2, route="a", envelope_hash="sha256:e", reserve="0")
    clock.advance(31)  # r1's executor died: its lease expired
    led.begin_attempt(l2, route="a", envelope_hash="sha256:e", reserve="0")


def test_group_waiting_floor_rejects_until_it_passes(led: Ledger, clock: ManualClock) -> None:
    led.admit_run("r1", plan=routes(), budget=budget())
    lease = led.acquire_lease("r1")
    led.set_group_state("g", "cooldown", until=clock.now() + 20, reason="test")
    with pytest.raises(CapacityUnavailable) as ei:
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
    assert ei.value.fields["until"] == clock.now() + 20
    clock.advance(20)
    led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")


def test_begin_is_idempotent_per_attempt_id(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget())
    lease = led.acquire_lease("r1")
    a = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")
    b = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")
    assert a == b and led.get_run("r1").calls_used == 1
    with pytest.raises(Conflict):
        led.begin_attempt(lease, route="b", envelope_hash="sha256:e", reserve="0.1",
                          attempt_id="att-1")


def test_begin_bad_input(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget())
    lease = led.acquire_lease("r1")
    with pytest.raises(InvalidArgument, match="not in the frozen plan of run 'r1' "):
        led.begin_attempt(lease, route="zzz", envelope_hash="sha256:e", reserve="0")
    with pytest.raises(InvalidArgument, match="reserve"):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="-1")
    with pytest.raises(NotFound):
        led.settle_attempt(lease, "att-missing", outcome="succeeded")
    with pytest.raises(InvalidArgument, match="fact or an observation"):
        a = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
        led.settle_attempt(lease, a.attempt_id, outcome="failed")


def test_release_refused_while_in_flight(led: Ledger) -> None:
    led.admit_run("r1", plan=routes(), budget=budget())
    lease = led.acquire_lease("r1")
    a = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
    with pytest.raises(InvalidState, match="in flight"):
        led.release_lease(lease)
    led.settle_attempt(lease, a.attempt_id, outcome="succeeded", cost="0")
    led.release_lease(lease)
    assert led.get_run("r1").lease_holder is None


def test_child_budget_carved_and_broader_refused(led: Ledger) -> None:
    led.admit_run("p", plan=routes(), budget=budget(calls=10, retries=4, cost="1.00"),
                  grant=grant())
    pl = led.acquire_lease("p")
    child = led.admit_run("c1", plan=routes()[1:], budget=budget(calls=4, retries=2, cost="0.6"),
                          grant=Grant(recipients={"r1": ["user_input"]}), parent=pl)
    assert child.parent_run_id == "p"
    parent = led.get_run("p")
    assert parent.carved == Decimal("0.6") and parent.calls_left == 6 and parent.retries_left == 2
    with pytest.raises(BudgetExceeded):
        led.admit_run("c2", plan=routes(), budget=budget(calls=1, retries=0, cost="0.5"),
                      grant=grant(), parent=pl)
    # The refusal names the allowance that is short.
    for calls, retries, short in ((7, 0, "budget.max_calls"), (1, 3, "budget.max_retries")):
        with pytest.raises(AllowanceExhausted) as over:
            led.admit_run("c2", plan=routes(), budget=budget(calls=calls, retries=retries,
                                                             cost="0.1"),
                          grant=grant(), parent=pl)
        assert over.value.fields["field"] == short
    with pytest.raises(InvalidArgument, match="narrow"):
        led.admit_run("c3", plan=routes(), budget=budget(calls=1, retries=0, cost="0.1"),
                      grant=Grant(recipients={"r2": ["user_input", "memory"]}),
                      parent=pl)
    from ledger.domain.values import Price, Route

    with pytest.raises(InvalidArgument, match="approved candidates"):
        led.admit_run("c4", plan=[Route(id="x", provider="p9", model="m", group="z",
                                        recipient="r9", price=Price())],
                      budget=budget(calls=1, retries=0, cost="0.1"), grant=Grant(),
                      parent=pl)
    stale = replace(pl, fence=pl.fence - 1)
    with pytest.raises(FencedOut):
        led.admit_run("c5", plan=routes(), budget=budget(calls=1, retries=0, cost="0.1"),
                      grant=grant(), parent=stale)
    # The parent's own spending respects the carve.
    with pytest.raises(BudgetExceeded):
        led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0.5")
    assert [c.run_id for c in led.children("p")] == ["c1"]


def test_attempt_queries_filter_and_paginate(led: Ledger, clock: ManualClock) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(calls=20))
    lease = led.acquire_lease("r1")
    ids = []
    for i in range(6):
        clock.advance(1)
        a = led.begin_attempt(lease, route="a" if i % 2 else "c", envelope_hash="sha256:e",
                              reserve="0")
        ids.append(a.attempt_id)
        if i % 3 == 0:
            led.settle_attempt(lease, a.attempt_id, outcome="failed", fact=_fail(), cost="0")
        else:
            led.settle_attempt(lease, a.attempt_id, outcome="succeeded", cost="0")
    page = led.attempts(route="a", limit=2)
    assert len(page.items) == 2 and page.next_cursor
    rest = led.attempts(route="a", limit=2, cursor=page.next_cursor)
    assert [x.attempt_id for x in page.items + rest.items] == [ids[5], ids[3], ids[1]]
    assert rest.next_cursor is None
    assert {x.attempt_id for x in led.attempts(category="overloaded").items} == {ids[0], ids[3]}
    assert len(led.attempts(group="h").items) == 3
    t0 = 10_000.0
    assert [x.attempt_id for x in led.attempts(since=t0 + 2, until=t0 + 4).items] == \
        [ids[2], ids[1]]
    with pytest.raises(InvalidArgument, match="cursor"):
        led.attempts(cursor="garbage")


def test_async_twin_runs_the_same_logic(db_url: str) -> None:
    import asyncio

    from ledger.api.facade import AsyncLedger

    async def go() -> None:
        led = await AsyncLedger.open(db_url, clock=ManualClock(5.0))
        await led.admit_run("ra", plan=routes(), budget=Budget(max_calls=1, max_retries=0,
                                                               max_cost=Decimal(1)))
        lease = await led.acquire_lease("ra")
        a = await led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1")
        with pytest.raises(AllowanceExhausted):
            await led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1")
        await led.settle_attempt(lease, a.attempt_id, outcome="succeeded", cost="0.1")
        assert [x.state for x in await led.timeline("ra")] == [AttemptState.SUCCEEDED]
        await led.close()

    asyncio.run(go())


def test_health_is_written_only_when_it_changes(led: Ledger, clock: ManualClock) -> None:
    led.admit_run("r1", plan=routes(), budget=budget(calls=10), policy="failure-domain")
    lease = led.acquire_lease("r1")

    def settle(outcome: str) -> None:
        a = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
        if outcome == "failed":
            led.settle_attempt(lease, a.attempt_id, outcome="failed", fact=_fail())
        else:
            led.settle_attempt(lease, a.attempt_id, outcome="succeeded", cost="0")

    for _ in range(3):  # failure-domain cools a route after 3 failures within 60 s
        settle("failed")
    cooled = led.health(["a"])["a"]
    assert cooled.error_count == 1 and cooled.cooldown_until is not None
    clock.advance(5)
    settle("succeeded")  # changes the row: counters reset
    healthy = led.health(["a"])["a"]
    assert healthy.error_count == 0 and healthy.cooldown_until is None
    assert healthy.last_used is None  # failure-domain does not track last use
    clock.advance(5)
    settle("succeeded")  # a success on a healthy route leaves the row as it was
    assert led.health(["a"])["a"] == healthy


def test_fased_records_last_use_of_profiles(led: Ledger, clock: ManualClock) -> None:
    from ledger.domain.values import Price, Profile, Route

    plan = [Route(id="a", provider="p1", model="m1", group="g", recipient="r1", price=Price(),
                  profiles=[Profile(id="p1:a"), Profile(id="p1:b")])]
    led.admit_run("r1", plan=plan, budget=budget(), policy="fased")
    lease = led.acquire_lease("r1")
    a = led.begin_attempt(lease, route="a", profile_id="p1:b", envelope_hash="sha256:e",
                          reserve="0")
    led.settle_attempt(lease, a.attempt_id, outcome="succeeded", cost="0")
    assert led.health(["p1:b"])["p1:b"].last_used == clock.now()
