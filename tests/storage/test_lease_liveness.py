"""Invariant 3 (and 8): a lapsed lease — expired, released or taken over — starts nothing.

Each scenario below was once accepted by a fence-number-only check; every one runs on SQLite
and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.errors import CapacityUnavailable, FencedOut, LeaseHeld, LeaseLost
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover

from .helpers import budget, grant, routes, sql_context

ENV = "sha256:env"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock, executor_id="w1") as led:
        for run in ("r1", "r2", "r3"):
            led.admit_run(run, plan=routes(), budget=budget(calls=20, retries=5), grant=grant())
        led.configure_group("g", max_in_flight=1)
        yield led


def test_invariant3_expired_lease_begins_nothing_and_the_group_limit_holds(
        led: Ledger, clock: ManualClock) -> None:
    l1 = led.acquire_lease("r1", ttl_s=10)
    led.begin_attempt(l1, route="a", envelope_hash=ENV, reserve="0.01")
    clock.advance(11)  # r1's lease lapses with its attempt in flight: its slot is free again
    l2 = led.acquire_lease("r2", ttl_s=10, executor_id="w2")
    led.begin_attempt(l2, route="a", envelope_hash=ENV, reserve="0.01")
    with pytest.raises(LeaseLost, match="expired"):
        led.begin_attempt(l1, route="b", envelope_hash=ENV, reserve="0.01")
    with pytest.raises(LeaseLost):
        led.reserve_retry(l1)
    with pytest.raises(LeaseLost):
        led.record_provenance(l1, "tool-1", "sha256:x")
    with pytest.raises(LeaseLost):
        led.append_event(l1, "note", {})
    with pytest.raises(LeaseLost):
        led.finish_run(l1, "succeeded")
    proj = led.group_projections(["g"])["g"]
    assert proj.in_flight == 1 and proj.limit == 1
    assert [a.state for a in led.timeline("r1")] == [AttemptState.DISPATCHING]


def test_invariant8_every_reader_counts_in_flight_alike_and_a_taken_over_slot_counts_for_none(
        led: Ledger, clock: ManualClock) -> None:
    # One rule (schema.held_until): a slot or an open attempt is held while the executor that
    # took it still holds the Run under the same fence. After a takeover the Run's new lease is
    # live, but the old slot is not held: counting "the Run's lease is live" would see two
    # slots in a group of one.
    l1 = led.acquire_lease("r1", ttl_s=10)
    old = led.begin_attempt(l1, route="a", envelope_hash=ENV, reserve="0.01")
    audit = Audit(led)

    def counted() -> tuple[int, int, dict[str, bool]]:
        group = next(g for g in audit.health().groups if g.group == "g")
        opened = {o.attempt.attempt_id: o.lease_live for o in audit.open_attempts().items}
        return led.group_projections(["g"])["g"].in_flight, group.in_flight, opened

    assert counted() == (1, 1, {old.attempt_id: True})
    clock.advance(11)
    l2 = led.acquire_lease("r1", ttl_s=30, executor_id="w2")  # takes r1 over: the fence moves
    assert l2.fence == l1.fence + 1
    assert counted() == (0, 0, {old.attempt_id: False})
    new = led.begin_attempt(l2, route="a", envelope_hash=ENV, reserve="0.01")  # admitted
    assert counted() == (1, 1, {old.attempt_id: False, new.attempt_id: True})
    books = reconcile(led)
    assert not [v for v in books.violations if "live slots" in v], books.violations


def test_invariant3_a_lease_ending_within_the_margin_starts_nothing(
        led: Ledger, clock: ManualClock) -> None:
    lease = led.acquire_lease("r1", ttl_s=10)
    clock.advance(10 - led.lease_margin_s / 2)  # not expired yet, but inside the margin
    with pytest.raises(LeaseLost, match="expired"):
        led.begin_attempt(lease, route="c", envelope_hash=ENV, reserve="0.01")
    assert led.timeline("r1") == []


def test_invariant3_renewing_a_lapsed_lease_is_refused_and_resurrects_no_slot(
        led: Ledger, clock: ManualClock) -> None:
    l1 = led.acquire_lease("r1", ttl_s=10)
    led.begin_attempt(l1, route="a", envelope_hash=ENV, reserve="0.01")
    clock.advance(11)
    l2 = led.acquire_lease("r2", ttl_s=10, executor_id="w2")
    led.begin_attempt(l2, route="a", envelope_hash=ENV, reserve="0.01")
    with pytest.raises(LeaseLost):
        led.renew_lease(l1, ttl_s=10)
    proj = led.group_projections(["g"])["g"]
    assert proj.in_flight == 1  # never 2 with a limit of 1
    fresh = led.acquire_lease("r1", ttl_s=10)  # acquiring again moves the fence on
    assert fresh.fence == l1.fence + 1
    assert led.group_projections(["g"])["g"].in_flight == 1


def test_invariant3_released_lease_begins_renews_and_releases_nothing(
        led: Ledger, clock: ManualClock) -> None:
    lease = led.acquire_lease("r1", ttl_s=30)
    led.release_lease(lease)
    with pytest.raises(LeaseLost, match="released"):
        led.begin_attempt(lease, route="c", envelope_hash=ENV, reserve="0.01")
    with pytest.raises(LeaseLost, match="released"):
        led.begin_attempt(lease, route="c", envelope_hash=ENV, reserve="0.01")
    with pytest.raises(LeaseLost):
        led.renew_lease(lease)
    led.release_lease(lease)  # releasing again is the same write: nothing changes
    run = led.get_run("r1")
    assert run.lease_holder is None and run.calls_used == 0 and led.timeline("r1") == []


def test_invariant8_acquiring_ones_own_live_lease_keeps_its_fence_and_slot(
        led: Ledger, clock: ManualClock) -> None:
    l1 = led.acquire_lease("r1", ttl_s=30)
    led.begin_attempt(l1, route="a", envelope_hash=ENV, reserve="0.01")
    again = led.acquire_lease("r1", ttl_s=30)
    assert again.fence == l1.fence and again.executor == l1.executor
    l2 = led.acquire_lease("r2", ttl_s=30, executor_id="w2")
    with pytest.raises(CapacityUnavailable):  # the group is still full
        led.begin_attempt(l2, route="a", envelope_hash=ENV, reserve="0.01")
    assert led.group_projections(["g"])["g"].in_flight == 1
    with pytest.raises(LeaseHeld):
        led.acquire_lease("r1", ttl_s=30, executor_id="w2")


def test_invariant3_settle_after_expiry_is_accepted_until_someone_takes_over(
        led: Ledger, clock: ManualClock) -> None:
    lease = led.acquire_lease("r1", ttl_s=10)
    att = led.begin_attempt(lease, route="c", envelope_hash=ENV, reserve="0.01")
    clock.advance(20)  # the answer arrives late; nobody took the run over
    done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.005")
    assert done.state is AttemptState.SUCCEEDED and done.debit_state is DebitState.POSTED
    assert [e.kind for e in led.events("r1", ["late_receipt"])] == []


def test_invariant3_settle_after_a_takeover_is_a_late_receipt_that_changes_no_row(
        led: Ledger, clock: ManualClock) -> None:
    lease = led.acquire_lease("r1", ttl_s=10)
    att = led.begin_attempt(lease, route="c", envelope_hash=ENV, reserve="0.01")
    clock.advance(11)
    report = recover(led, executor_id="rec")
    assert report.runs[0].newly_unknown == [att.attempt_id]
    with pytest.raises(FencedOut):
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.005",
                           prompt_tokens=10, completion_tokens=5)
    row = led.get_attempt(att.attempt_id)
    assert row.state is AttemptState.UNKNOWN and row.debit_state is DebitState.RESERVED
    [late] = led.events("r1", ["late_receipt"])
    assert late.attempt_id == att.attempt_id
    assert late.data["outcome"] == "succeeded" and late.data["prompt_tokens"] == 10
    assert late.data["fence"] == lease.fence


def test_invariant3_reacquired_run_refuses_settles_of_the_older_fence(
        led: Ledger, clock: ManualClock) -> None:
    old = led.acquire_lease("r1", ttl_s=10)
    att = led.begin_attempt(old, route="c", envelope_hash=ENV, reserve="0.01")
    clock.advance(11)
    new = led.acquire_lease("r1", ttl_s=10)  # the same executor, after expiry: a new fence
    assert new.fence == old.fence + 1
    for lease in (old, new):
        with pytest.raises(FencedOut):
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
    assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING
    assert len(led.events("r1", ["late_receipt"])) == 2
    assert recover(led).orphans == {"r1": [att.attempt_id]}


def _hold_run_lock(led: Ledger, run_id: str, locked: threading.Event,
                   release: threading.Event) -> None:
    """Another transaction holding the run's write lock (SQLite: the database's)."""
    with sql_context(led).writing() as conn:  # BEGIN IMMEDIATE on SQLite: the database's write lock
        if led.backend == "postgresql":
            conn.execute(text("SELECT run_id FROM runs WHERE run_id = :r FOR UPDATE"),
                         {"r": run_id})
        locked.set()
        release.wait(60)


def test_invariant3_a_begin_that_waited_for_the_lock_is_judged_when_it_got_it(
        led: Ledger, clock: ManualClock) -> None:
    lease = led.acquire_lease("r1", ttl_s=10)
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(led, "r1", locked, release))
    holder.start()
    assert locked.wait(30)
    outcome: list[BaseException | None] = []

    def begin() -> None:
        try:
            led.begin_attempt(lease, route="c", envelope_hash=ENV, reserve="0.01")
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    worker = threading.Thread(target=begin)
    worker.start()
    worker.join(0.5)  # the begin is now waiting for the lock (not a clock: real contention)
    clock.advance(11)  # the lease expires while it waits (a database restart, a slow writer)
    release.set()
    holder.join(30)
    worker.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost)
    assert led.timeline("r1") == []


def test_lease_objects_are_checked_against_the_holder(led: Ledger) -> None:
    lease = led.acquire_lease("r1", ttl_s=30)
    forged = Lease("r1", "someone-else", lease.fence, lease.expires_at)
    with pytest.raises(FencedOut):
        led.begin_attempt(forged, route="c", envelope_hash=ENV, reserve="0.01")
