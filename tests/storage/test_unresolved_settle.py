"""A turn's settle the database did not take is recorded once it answers, and frees its slot.

The provider answered; the settle that would record it found the database busy past its
timeout (another connection holds the write lock: SQLite's ``BEGIN IMMEDIATE`` with a short
``?timeout=``, PostgreSQL's row lock with a short ``lock_timeout``). The turn raises that
``DatabaseUnavailable`` (``operation="settle"``, ``deferred=True``), and the process, which
holds the receipt, writes the settle as the turn decided it once the database answers: at the
Run's next write, from the lease keeper's heartbeat, at the session's exit, or on the ledger's
``close()`` — once, the same settle again being the same write. Until then the Attempt stays
``dispatching`` and holds its capacity slot; afterwards the slot is free for every Run, the
usage the provider reported is posted, and the session leaves cleanly.
"""

from __future__ import annotations

import sqlite3
import time
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part, faults
from ledger.api.face import storage_of
from ledger.api.lease import LeaseKeeper
from ledger.api.turn import execute
from ledger.clock import ManualClock
from ledger.decide.effects import Dispatch, SendResult
from ledger.domain.records import AttemptState, DebitState, RunStatus
from ledger.errors import DatabaseUnavailable
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.storage.engine import normalize_url
from ledger.testing import Behavior, FakeProvider
from tests import fakeplan
from tests.fakeplan import plan
from tests.storage.helpers import impatient_url

from .helpers import session_failing_once

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
ENV = Envelope(parts=[Part(content="Compare the filings.")])
TTL_S = 600.0  # the keeper of a session never renews during a test
USAGE = (123, 45)  # what the provider reports for the answer whose settle is held up


class WriteLock:
    """Another connection holding run ``r``'s write lock (on SQLite, the database's)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self._conn: Any = None

    def take(self) -> None:
        if "://" not in self.db_url:
            conn = sqlite3.connect(self.db_url, isolation_level=None, check_same_thread=False)
            conn.execute("BEGIN IMMEDIATE")
        else:
            import psycopg

            conninfo = make_url(normalize_url(self.db_url)).set(
                drivername="postgresql").render_as_string(hide_password=False)
            conn = psycopg.connect(conninfo)  # a transaction until released
            conn.execute("SELECT 1 FROM runs WHERE run_id = 'r' FOR UPDATE")
        self._conn = conn

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.rollback()
            conn.close()


def _told_deferred(error: DatabaseUnavailable) -> str:
    """The settle's own error, saying the process keeps it for later; its Attempt's id."""
    f = error.fields
    assert f["operation"] == "settle" and f["deferred"] is True
    assert f["resolved"] is True and f["landed"] is False  # rolled back: nothing was written
    return str(f["attempt_id"])


def _recorded_once(led: Ledger, attempt_id: str) -> None:
    """The Attempt is settled with the provider's usage, posted once, its slot free."""
    att = led.get_attempt(attempt_id)
    assert att.state is AttemptState.SUCCEEDED and att.debit_state is DebitState.POSTED
    assert (att.prompt_tokens, att.completion_tokens) == USAGE
    assert att.cost is not None and att.cost > 0
    run = led.get_run(att.run_id)
    assert run.reserved == 0 and run.tokens_reserved == 0
    assert led.group_projections([att.group_id])[att.group_id].in_flight == 0
    assert led.events(att.run_id, ["late_receipt"]) == []
    assert reconcile(led).violations == []  # posted once: the Run's totals agree


def _session(led: Ledger | AsyncLedger, fake: FakeProvider, lock: WriteLock, again: str
             ) -> tuple[DatabaseUnavailable, BaseException | None]:
    """Run ``r``'s session with its first settle held up by ``lock``; the lock goes at
    ``again`` (before the next turn, before the exit, or only before the ledger's close).
    The turn's error, and what the block raised."""
    lost: list[DatabaseUnavailable] = []
    fake.enqueue(Behavior(usage=USAGE, before_head=lock.take))
    terms = {"plan": plan(fake)[:1], "budget": BUDGET, "grant": GRANT, "lease_ttl_s": TTL_S}

    def failed(e: DatabaseUnavailable) -> None:
        lost.append(e)
        if again != "close":
            lock.release()

    raised = session_failing_once(led, terms, ENV, again, failed)
    return lost[0], raised


@pytest.mark.parametrize("again", ["next_turn", "exit", "close"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_turns_settle_the_database_did_not_take_is_recorded_once_it_answers_and_frees_its_slot(
    db_url: str, fake: FakeProvider, request: pytest.FixtureRequest, mode: str, again: str
) -> None:
    url = impatient_url(db_url, request)
    lock = WriteLock(db_url)
    led = Ledger.open(url)
    try:
        led.configure_group("ga", max_in_flight=1)
        lost, raised = _session(led if mode == "sync" else AsyncLedger(led), fake, lock, again)
        attempt_id = _told_deferred(lost)
        # The block's own error is the one raised, never one its exit ran into.
        assert raised is (None if again == "next_turn" else lost)
        lock.release()
    finally:
        lock.release()
        led.close()
    with Ledger.open(db_url) as check:
        _recorded_once(check, attempt_id)
        run = check.get_run("r")
        assert run.lease_holder is None  # the exit released it: nothing was left in flight
        sent = [r.headers.get("x-ledger-attempt") for r in fake.requests]
        if again == "next_turn":
            # The next turn wrote the settle first, then found the group's one slot free.
            [_, served] = check.timeline("r")
            assert served.state is AttemptState.SUCCEEDED and served.route_id == "primary"
            assert sent == [attempt_id, served.attempt_id]
            assert run.status is RunStatus.SUCCEEDED
        else:
            assert sent == [attempt_id] and run.status is RunStatus.FAILED


def _answered_under(lock: WriteLock) -> Any:
    """A send whose answer arrives while another connection takes the write lock."""
    def send(d: Dispatch) -> SendResult:
        lock.take()
        return SendResult(ok=True, output="answer", prompt_tokens=USAGE[0],
                          completion_tokens=USAGE[1], cost=Decimal("0.0002"))
    return send


def test_the_lease_keepers_heartbeat_records_a_settle_the_database_did_not_take(
    db_url: str, fake: FakeProvider, request: pytest.FixtureRequest
) -> None:
    url = impatient_url(db_url, request)
    lock = WriteLock(db_url)
    with Ledger.open(url, clock=ManualClock(time.time())) as led:
        led.configure_group("ga", max_in_flight=1)
        led.admit_run("r", plan=plan(fake)[:1], budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=60)
        keeper = LeaseKeeper(led, lease, ttl_s=60)  # ticked by hand
        try:
            with pytest.raises(DatabaseUnavailable) as err:
                execute(led, lease, ENV, _answered_under(lock))
            attempt_id = _told_deferred(err.value)
            # Still locked: the keeper tries again a quarter interval later.
            assert keeper.tick() == keeper.retry_s
            assert led.get_attempt(attempt_id).state is AttemptState.DISPATCHING
            assert led.group_projections(["ga"])["ga"].in_flight == 1
        finally:
            lock.release()
        # Free: the next tick writes it, though no renewal is due.
        assert keeper.tick() == pytest.approx(keeper.interval_s)
        assert keeper.renewals == 0
        _recorded_once(led, attempt_id)
        keeper.close()  # releases the lease: nothing is in flight
        assert led.get_run("r").lease_holder is None


def test_a_settle_whose_acknowledgement_was_lost_and_not_resolved_is_recorded_exactly_once(
    db_url: str, fake: FakeProvider, request: pytest.FixtureRequest
) -> None:
    """The settle committed, its acknowledgement was lost, and its resolution found the lock
    taken: unresolved. Written again once the lock is gone, it finds itself done."""
    url = impatient_url(db_url, request)
    lock = WriteLock(db_url)
    fired: list[str] = []

    def lost_ack(point: str) -> None:
        if not fired:
            fired.append(point)
            lock.take()  # the resolution on a new connection cannot lock the Run's row
            raise DatabaseUnavailable("the connection was lost after the COMMIT was sent",
                                      commit="unknown")

    def send(d: Dispatch) -> SendResult:
        return SendResult(ok=True, output="answer", prompt_tokens=USAGE[0],
                          completion_tokens=USAGE[1], cost=Decimal("0.0002"))

    with Ledger.open(url) as led:
        led.admit_run("r", plan=plan(fake)[:1], budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=60)
        faults.arm("settle.after_commit", lost_ack)
        try:
            with pytest.raises(DatabaseUnavailable) as err:
                execute(led, lease, ENV, send)
        finally:
            faults.disarm()
            lock.release()
        f = err.value.fields
        assert f["operation"] == "settle" and f["commit"] == "unknown"
        assert f["resolved"] is False and f["landed"] is None and f["deferred"] is True
        attempt_id = str(f["attempt_id"])
        led.renew_lease(lease, ttl_s=60)  # the Run's next write writes it first
        _recorded_once(led, attempt_id)
        assert not storage_of(led).pending  # resolved, and forgotten
        led.release_lease(lease)


def test_a_remembered_settle_refused_after_a_takeover_is_kept_as_a_late_receipt(
    db_url: str, fake: FakeProvider, request: pytest.FixtureRequest
) -> None:
    """The lease lapsed while the settle waited, and recovery recorded the Attempt unknown
    with its hold kept. The settle written at ``close()`` is then refused as any late settle
    is, and what the provider answered is kept beside the Attempt for the operator."""
    url = impatient_url(db_url, request)
    lock = WriteLock(db_url)
    led = Ledger.open(url, clock=ManualClock(time.time() - 3600))  # a lease long lapsed
    try:
        led.admit_run("r", plan=plan(fake)[:1], budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=30)
        try:
            with pytest.raises(DatabaseUnavailable) as err:
                execute(led, lease, ENV, _answered_under(lock))
        finally:
            lock.release()
        attempt_id = _told_deferred(err.value)
        with Ledger.open(db_url) as other:
            assert [r.run_id for r in recover(other, release=True).runs] == ["r"]
    finally:
        led.close()
    with Ledger.open(db_url) as check:
        att = check.get_attempt(attempt_id)
        assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
        [receipt] = check.events("r", ["late_receipt"])
        assert receipt.attempt_id == attempt_id and receipt.data["outcome"] == "succeeded"
        assert (receipt.data["prompt_tokens"], receipt.data["completion_tokens"]) == USAGE
