"""An ended Child gives back to its parent what it did not use (invariant 4), on both backends.

A Child's budget is carved out of its parent's at admission. Whatever ends it (its session's
``finish``, an operator's close, recovery's close past a deadline) gives back, in the same
transaction, what it has left: its budget less what it posted, still holds (an unknown
Attempt's hold stays carved until that Attempt is settled) and carved for its own Children.
The parent may spend it; the Child never again.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

import pytest
from sqlalchemy import update

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import DebitState, Lease, RunRecord, RunStatus
from ledger.domain.values import Budget
from ledger.errors import AllowanceExhausted, BudgetExceeded
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.storage import schema as s

from .helpers import (
    budget,
    collect,
    grant,
    routes,
    spawn,
    sql_context,
    stray_never_sent_hold,
)


def _parent(led: Ledger, calls: int = 10, retries: int = 4, cost: str = "1.00",
            tokens: int | None = None) -> Lease:
    led.admit_run("p", plan=routes(), grant=grant(),
                  budget=Budget(max_calls=calls, max_retries=retries, max_cost=Decimal(cost),
                                max_tokens=tokens))
    return led.acquire_lease("p")


def _child(led: Ledger, pl: Lease, run_id: str = "c", *, calls: int = 4, retries: int = 2,
           cost: str = "0.30", tokens: int | None = None, deadline: float | None = None
           ) -> Lease:
    led.admit_run(run_id, plan=routes(), grant=grant(), parent=pl, deadline=deadline,
                  budget=Budget(max_calls=calls, max_retries=retries, max_cost=Decimal(cost),
                                max_tokens=tokens))
    return led.acquire_lease(run_id)


def _spend(led: Ledger, cl: Lease, *, retry: bool = False) -> None:
    """One served call of the Child (0.04 posted of a 0.05 hold, 30 tokens), and with
    ``retry`` a failed one before it that takes a retry permission."""
    if retry:
        a = led.begin_attempt(cl, route="a", envelope_hash="sha256:e", reserve="0.05",
                              reserve_tokens=20, turn_id="t")
        led.settle_attempt(cl, a.attempt_id, outcome="failed", observation={"status": 503},
                           cost="0.01", prompt_tokens=5, completion_tokens=0)
    b = led.begin_attempt(cl, route="b", envelope_hash="sha256:e", reserve="0.05",
                          reserve_tokens=40, turn_id="t", take_retry=retry,
                          kind="retry" if retry else "first")
    led.settle_attempt(cl, b.attempt_id, outcome="succeeded", cost="0.04", prompt_tokens=10,
                       completion_tokens=20)


def _finish(status: RunStatus) -> Callable[[Ledger, ManualClock, Lease], None]:
    def end(led: Ledger, _clock: ManualClock, cl: Lease) -> None:
        led.finish_run(cl, status)
        led.release_lease(cl)
    return end


def _operator_close(led: Ledger, clock: ManualClock, cl: Lease) -> None:
    led.release_lease(cl)
    led.close_run(cl.run_id, status="failed", reason="nobody resumes it")


def _past_deadline(led: Ledger, clock: ManualClock, cl: Lease) -> None:
    led.release_lease(cl)
    clock.advance(120)  # past the Child's deadline (60 s after admission)
    report = recover(led, close_past_deadline=True, run_ids=[cl.run_id])
    assert report.closed == [cl.run_id]


ENDINGS = {
    "finish_succeeded": _finish(RunStatus.SUCCEEDED),
    "finish_failed": _finish(RunStatus.FAILED),
    "finish_cancelled": _finish(RunStatus.CANCELLED),
    "operator_close": _operator_close,
    "recover_close_past_deadline": _past_deadline,
}


def _returned(run: RunRecord) -> tuple[int, int, Decimal, int]:
    return run.returned_calls, run.returned_retries, run.returned, run.returned_tokens


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_invariant4_every_ending_of_a_child_gives_back_exactly_what_it_did_not_use(
        led: Ledger, clock: ManualClock, ending: str) -> None:
    pl = _parent(led, tokens=1000)
    cl = _child(led, pl, tokens=400, deadline=clock.now() + 60)
    _spend(led, cl, retry=True)
    before = led.get_run("p")
    assert (before.carved_calls, before.carved_retries, before.carved,
            before.carved_tokens) == (4, 2, Decimal("0.30"), 400)
    ENDINGS[ending](led, clock, cl)
    child, parent = led.get_run("c"), led.get_run("p")
    assert child.status.value in ("succeeded", "failed", "cancelled")
    # Used: 2 calls, 1 retry, 0.05 posted (0.01 + 0.04), 35 tokens; nothing still held.
    assert _returned(child) == (2, 1, Decimal("0.25"), 365)
    assert (parent.carved_calls, parent.carved_retries, parent.carved,
            parent.carved_tokens) == (2, 1, Decimal("0.05"), 35)
    assert (child.calls_left, child.retries_left, child.cost_left, child.tokens_left) == (
        0, 0, Decimal(0), 0)
    assert (parent.calls_left, parent.retries_left, parent.cost_left, parent.tokens_left) == (
        8, 3, Decimal("0.95"), 965)
    [event] = led.events("c", kinds=["give_back"])
    assert event.data == {"parent": "p", "calls": 2, "retries": 1, "cost": "0.25",
                          "tokens": 365}
    books = reconcile(led)
    assert books.ok, books.violations


def test_invariant4_an_unknown_attempts_hold_stays_carved_until_it_is_settled(
        led: Ledger) -> None:
    pl = _parent(led)
    cl = _child(led, pl)
    a = led.begin_attempt(cl, route="a", envelope_hash="sha256:e", reserve="0.10")
    led.mark_unknown(cl, a.attempt_id, reason="the connection dropped")
    led.finish_run(cl, RunStatus.FAILED)
    led.release_lease(cl)
    child, parent = led.get_run("c"), led.get_run("p")
    # The unknown call and its hold stay the Child's, and so carved.
    assert _returned(child) == (3, 2, Decimal("0.20"), 0)
    assert (parent.carved_calls, parent.carved_retries, parent.carved) == (1, 0, Decimal("0.10"))
    # Evidence that it was never sent: the call and the hold come back to the parent too.
    led.settle_unknown(a.attempt_id, outcome="not_sent", note="the provider's log has no call")
    child, parent = led.get_run("c"), led.get_run("p")
    assert _returned(child) == (4, 2, Decimal("0.30"), 0)
    assert (parent.carved_calls, parent.carved_retries, parent.carved) == (0, 0, Decimal(0))
    assert [e.data["cost"] for e in led.events("c", kinds=["give_back"])] == ["0.2", "0.1"]
    books = reconcile(led)
    assert books.ok, books.violations


def test_invariant4_a_hold_released_after_the_child_finished_goes_back_too(
        led: Ledger) -> None:
    pl = _parent(led)
    cl = _child(led, pl)
    a = led.begin_attempt(cl, route="a", envelope_hash="sha256:e", reserve="0.10")
    led.finish_run(cl, RunStatus.SUCCEEDED)
    assert led.get_run("p").carved == Decimal("0.10")  # in flight: held
    led.settle_attempt(cl, a.attempt_id, outcome="succeeded", cost="0.03")
    led.release_lease(cl)
    child, parent = led.get_run("c"), led.get_run("p")
    assert child.returned == Decimal("0.27") and parent.carved == Decimal("0.03")
    assert reconcile(led).ok


def test_invariant4_the_parent_spends_what_came_back(led: Ledger) -> None:
    pl = _parent(led, calls=5, retries=1, cost="0.50")
    cl = _child(led, pl, calls=5, retries=1, cost="0.50")
    with pytest.raises(AllowanceExhausted):
        led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0.01")
    _spend(led, cl)
    led.finish_run(cl, RunStatus.SUCCEEDED)
    led.release_lease(cl)
    parent = led.get_run("p")
    assert (parent.calls_left, parent.retries_left, parent.cost_left) == (4, 1, Decimal("0.46"))
    for _ in range(4):
        a = led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0.10")
        led.settle_attempt(pl, a.attempt_id, outcome="succeeded", cost="0.10")
    with pytest.raises(AllowanceExhausted):
        led.begin_attempt(pl, route="a", envelope_hash="sha256:e", reserve="0.01")
    # A new Child is carved from what came back.
    led.admit_run("c2", plan=routes(), grant=grant(), parent=pl,
                  budget=budget(calls=0, retries=1, cost="0.06"))
    with pytest.raises(BudgetExceeded):
        led.admit_run("c3", plan=routes(), grant=grant(), parent=pl,
                      budget=budget(calls=0, retries=0, cost="0.01"))
    assert reconcile(led).ok


def test_invariant4_an_ended_child_never_spends_what_it_gave_back(led: Ledger) -> None:
    pl = _parent(led)
    cl = _child(led, pl)
    _spend(led, cl)
    led.finish_run(cl, RunStatus.SUCCEEDED)
    led.release_lease(cl)
    # Its block ended, it was not closed: the same id continues it, with nothing left.
    again = led.acquire_lease("c")
    with pytest.raises(AllowanceExhausted):
        led.begin_attempt(again, route="a", envelope_hash="sha256:e", reserve="0.01",
                          turn_id="t2")
    with pytest.raises(AllowanceExhausted):
        led.reserve_retry(again)
    with pytest.raises(BudgetExceeded):
        led.admit_run("gc", plan=routes(), grant=grant(), parent=again,
                      budget=budget(calls=0, retries=0, cost="0.01"))
    led.finish_run(again, RunStatus.SUCCEEDED)  # ending again gives nothing more
    assert len(led.events("c", kinds=["give_back"])) == 1
    assert led.get_run("p").carved == Decimal("0.04")
    assert reconcile(led).ok


def test_invariant4_what_a_grandchild_gives_back_to_an_ended_child_goes_on_up(
        led: Ledger) -> None:
    pl = _parent(led)
    cl = _child(led, pl)
    led.admit_run("g", plan=routes(), grant=grant(), parent=cl,
                  budget=budget(calls=2, retries=1, cost="0.10"))
    gl = led.acquire_lease("g")
    led.finish_run(cl, RunStatus.SUCCEEDED)  # the Child ends first: the carve stays carved
    led.release_lease(cl)
    assert led.get_run("p").carved == Decimal("0.10")
    _spend(led, gl)
    led.finish_run(gl, RunStatus.SUCCEEDED)
    led.release_lease(gl)
    child, parent = led.get_run("c"), led.get_run("p")
    assert child.carved == Decimal("0.04") and child.carved_calls == 1
    assert _returned(child) == (3, 2, Decimal("0.26"), 0)
    assert (parent.carved_calls, parent.carved_retries, parent.carved) == (1, 0, Decimal("0.04"))
    assert reconcile(led).ok


def test_reconcile_is_clean_after_returns_and_flags_a_tampered_carve(led: Ledger) -> None:
    pl = _parent(led, tokens=1000)
    for i in range(3):
        cl = _child(led, pl, f"c{i}", calls=2, retries=1, cost="0.10", tokens=100)
        if i:
            _spend(led, cl)
        led.finish_run(cl, RunStatus.SUCCEEDED if i else RunStatus.CANCELLED)
        led.release_lease(cl)
    books = reconcile(led)
    assert books.ok, books.violations
    r = s.runs.c
    for column, value in (("carved_tokens", 1), ("returned_micros", 1)):
        run_id = "p" if column.startswith("carved") else "c1"
        with sql_context(led).engine.begin() as conn:
            conn.execute(update(s.runs).where(r.run_id == run_id)
                         .values({column: r[column] + value}))
        books = reconcile(led)
        assert any(v.startswith("run p: carved") for v in books.violations), books.violations
        with sql_context(led).engine.begin() as conn:
            conn.execute(update(s.runs).where(r.run_id == run_id)
                         .values({column: r[column] - value}))
    assert reconcile(led).ok


def test_spend_counts_a_given_back_carve_once_rolled_up_or_not(led: Ledger,
                                                               clock: ManualClock) -> None:
    """A Run's own budget in spend against budgets is its budget less what it carved and gave
    back: parent and Child together count the parent's budget, from the tables and from the
    roll-ups, and a give-back into a rolled hour undoes that hour."""
    from ledger.ops.audit import Audit

    pl = _parent(led)
    cl = _child(led, pl)
    a = led.begin_attempt(cl, route="a", envelope_hash="sha256:e", reserve="0.10")
    led.mark_unknown(cl, a.attempt_id, reason="the connection dropped")
    led.finish_run(cl, RunStatus.FAILED)
    led.release_lease(cl)
    led.finish_run(pl, RunStatus.SUCCEEDED)
    led.release_lease(pl)

    def budget_total() -> Decimal:
        [row] = Audit(led).spend(by="tenant", since=0, until=clock.now() + 1).items
        return row.budget

    assert budget_total() == Decimal("1.00")
    clock.advance(3 * 3600)
    assert led.roll_up(lag=0).hours > 0
    assert budget_total() == Decimal("1.00")
    # The settle gives the hold back into the rolled hour: the hour is redone, not stale.
    led.settle_unknown(a.attempt_id, outcome="not_sent", note="never sent")
    assert led.get_run("c").returned == Decimal("0.30")
    assert budget_total() == Decimal("1.00")
    led.roll_up(lag=0)
    assert budget_total() == Decimal("1.00")


@pytest.mark.postgres
def test_invariant4_children_ending_while_the_parent_and_siblings_carve_and_begin(
        pg_url: str) -> None:
    """Processes carve Children of one parent, spend in them and end them (giving back) while
    the parent's own calls begin: the parent is never overdrawn, nothing is stranded, and the
    books reconcile."""
    with Ledger.open(pg_url) as led:
        led.admit_run("shared", plan=routes(), budget=budget(calls=60, retries=30, cost="2.00"))
        lease = led.acquire_lease("shared", ttl_s=900, executor_id="shared")
    results = collect([spawn("carve", pg_url, "shared", lease.fence, w, 25)
                       for w in range(6)])
    with Ledger.open(pg_url) as led:
        parent = led.get_run("shared")
        children = led.children("shared")
        assert parent.calls_left >= 0 and parent.retries_left >= 0 and parent.cost_left >= 0
        assert sum(r["parent_begun"] for r in results) == parent.calls_used
        assert sum(r["children"] for r in results) == len(children) > 0
        # Every Child ended and gave back all it did not use: what stays carved is exactly
        # what they used.
        assert all(c.status is RunStatus.SUCCEEDED for c in children)
        assert all((c.calls_left, c.retries_left, c.cost_left) == (0, 0, Decimal(0))
                   for c in children)
        assert parent.carved_calls == sum(c.calls_used for c in children)
        assert parent.carved_retries == sum(c.retries_used for c in children)
        assert parent.carved == sum((c.posted + c.reserved for c in children), Decimal(0))
        assert sum(r["refused"] for r in results) > 0  # the parent did run short
        books = reconcile(led)
        assert books.ok, books.violations


@pytest.mark.parametrize("state", ["not_sent", "rejected"])
def test_invariant4_a_hold_recovery_voids_in_an_ended_child_goes_back_to_its_parent(
        led: Ledger, clock: ManualClock, state: str) -> None:
    """Recovery's takeover voids a never-sent hold still reserved (a repair; the state is
    made with SQL, no API reaches it). Of a Child that already ended, that hold stayed carved
    when the Child gave back at its end: what the repair releases goes back to the parent in
    the takeover's transaction, as a later settle's release does."""
    pl = _parent(led, tokens=1000)
    cl = _child(led, pl, tokens=400)
    stray = stray_never_sent_hold(led, cl, state, tokens=40)
    # In flight when the Child ended, so recovery takes it over once its lease expires.
    led.begin_attempt(cl, route="b", envelope_hash="sha256:e", reserve="0.05",
                      reserve_tokens=20, turn_id="t")
    led.finish_run(cl, RunStatus.FAILED)  # then its executor died, the lease never released
    assert _returned(led.get_run("c")) == (3, 2, Decimal("0.15"), 340)  # both holds carved
    assert led.get_run("p").carved == Decimal("0.15")
    clock.advance(3600)
    [run] = recover(led, run_ids=["c"], release=True).runs
    assert len(run.unknown) == 1 and len(run.voided) == 1
    child, parent = led.get_run("c"), led.get_run("p")
    # Only the unknown call's holds stay carved.
    assert _returned(child) == (3, 2, Decimal("0.25"), 380)
    assert (parent.carved_calls, parent.carved_retries, parent.carved,
            parent.carved_tokens) == (1, 0, Decimal("0.05"), 20)
    assert (parent.cost_left, parent.tokens_left) == (Decimal("0.95"), 980)
    assert led.events("c", kinds=["give_back"])[-1].data == {
        "parent": "p", "calls": 0, "retries": 0, "cost": "0.1", "tokens": 40}
    assert led.get_attempt(stray).debit_state is DebitState.VOIDED
    books = reconcile(led)
    assert books.ok, books.violations
