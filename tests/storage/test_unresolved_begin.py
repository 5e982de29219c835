"""A begin the retry owner never sent, whose COMMIT's outcome stayed unknown, ends ``not_sent``.

On both backends, fault points stand in for the network: the begin commits and its
acknowledgement is lost (``begin.after_commit`` raises ``DatabaseUnavailable`` with
``commit="unknown"``), and the database is away for the settle that would resolve it
(``settle.before_commit`` raises before the commit). The process remembers the begin; these
tests check each place that resolves it once the database answers again — the lease keeper's
heartbeat, the session's next turn, exit, and the ledger's ``close()`` — and what happens when the
lease lapsed meanwhile and recovery recorded the Attempt ``unknown``: this process knows it was
never sent and settles it ``not_sent`` through the late-receipt path, under its own fence. (The
same on PostgreSQL through a proxy that really drops the connections:
``tests/storage/test_lost_acknowledgement.py``.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part, Price, Route, faults
from ledger.api.lease import LeaseKeeper
from ledger.api.turn import execute
from ledger.clock import ManualClock
from ledger.decide.effects import Dispatch, SendResult
from ledger.domain.records import AttemptState, DebitState, RunStatus
from ledger.errors import DatabaseUnavailable
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

from .helpers import session_failing_once

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
ENV = Envelope(parts=[Part(content="Compare the filings.")])
TTL_S = 600.0  # the keeper of a session never renews during a test


def _lost_ack(_point: str) -> None:
    raise DatabaseUnavailable("the connection was lost after the COMMIT was sent",
                              commit="unknown")


def _away(_point: str) -> None:
    raise DatabaseUnavailable("the database is away")


@contextmanager
def lands_unresolved() -> Iterator[None]:
    """The next begin lands with its acknowledgement lost; the next settle finds no database."""
    faults.arm("begin.after_commit", _lost_ack)
    faults.arm("settle.before_commit", _away)
    try:
        yield
    finally:
        faults.disarm()


def _never_sent(d: Dispatch) -> SendResult:
    raise AssertionError(f"attempt {d.attempt_id} was sent")


def _routes() -> list[Route]:
    """A plan whose endpoint is never called (nothing is sent here)."""
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol="openai", endpoint="http://127.0.0.1:9/v1",
                  price=price)]


def _told_unresolved(error: DatabaseUnavailable) -> str:
    """The begin's error says it is unresolved and kept for later; its Attempt's id."""
    f = error.fields
    assert f["operation"] == "begin" and f["commit"] == "unknown"
    assert f["resolved"] is False and f["landed"] is None and f["deferred"] is True
    return str(f["attempt_id"])


def _settled_not_sent(led: Ledger, run_id: str, attempt_id: str) -> None:
    """The Attempt is not_sent with nothing held, its call given back, and the audit says why."""
    att = led.get_attempt(attempt_id)
    assert att.state is AttemptState.NOT_SENT and att.debit_state is DebitState.VOIDED
    run = led.get_run(run_id)
    assert run.reserved == 0 and run.tokens_reserved == 0
    assert [e.attempt_id for e in led.events(run_id, ["commit_unknown"])] == [attempt_id]
    assert reconcile(led).violations == []


def test_the_lease_keepers_heartbeat_settles_a_never_sent_begin_once_the_database_answers(
    db_url: str
) -> None:
    clock = ManualClock(time.time())
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r", plan=_routes(), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=60)
        keeper = LeaseKeeper(led, lease, ttl_s=60)  # ticked by hand
        with lands_unresolved(), pytest.raises(DatabaseUnavailable) as err:
            execute(led, lease, ENV, _never_sent)
        attempt_id = _told_unresolved(err.value)
        assert led.get_attempt(attempt_id).state is AttemptState.DISPATCHING
        # Still away: the keeper tries again a quarter interval later, not at the renewal.
        faults.arm("settle.before_commit", _away)
        try:
            assert keeper.tick() == keeper.retry_s
        finally:
            faults.disarm()
        assert led.get_attempt(attempt_id).state is AttemptState.DISPATCHING
        # Back: the next tick settles it, though no renewal is due.
        assert keeper.tick() == pytest.approx(keeper.interval_s)
        assert keeper.renewals == 0
        _settled_not_sent(led, "r", attempt_id)
        keeper.close()
        assert led.get_run("r").lease_holder is None


def test_a_never_sent_begin_that_recovery_recorded_unknown_is_settled_not_sent_by_its_executor(
    db_url: str
) -> None:
    """The lease lapsed while the database was away and recovery took the Run over: it records
    the Attempt ``unknown`` with its hold kept, since it cannot know it was never sent. Its
    executor does, and settles it ``not_sent`` when its ledger closes, through the late-receipt
    path (only an ``unknown`` Attempt of its own fence, once, under the Run's row lock)."""
    clock = ManualClock(time.time() - 3600)  # the lease ends long before recovery's now
    led = Ledger.open(db_url, clock=clock)
    try:
        led.admit_run("r", plan=_routes(), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=30)
        with lands_unresolved(), pytest.raises(DatabaseUnavailable) as err:
            execute(led, lease, ENV, _never_sent)
        attempt_id = _told_unresolved(err.value)
        with Ledger.open(db_url) as other:
            report = recover(other, release=True)
            assert [r.run_id for r in report.runs] == ["r"]
            att = other.get_attempt(attempt_id)
            assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
            assert other.get_run("r").reserved > 0
    finally:
        led.close()
    with Ledger.open(db_url) as check:
        _settled_not_sent(check, "r", attempt_id)
        assert check.get_run("r").calls_used == 0  # the call it never made is given back
        [receipt] = check.events("r", ["late_receipt"])
        assert receipt.attempt_id == attempt_id and receipt.data["applied"] is True
        assert receipt.data["previous_state"] == "unknown"
        assert receipt.data["outcome"] == "not_sent"
        [why] = check.events("r", ["commit_unknown"])
        assert why.data == {"operation": "begin", "resolution": "not_sent", "after": "unknown"}


def test_closing_while_the_database_is_still_away_warns_and_leaves_the_begin_to_recovery(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    led = Ledger.open(db_url)
    closed = False
    try:
        led.admit_run("r", plan=_routes(), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=30)
        with lands_unresolved():
            with pytest.raises(DatabaseUnavailable) as err:
                execute(led, lease, ENV, _never_sent)
            faults.arm("settle.before_commit", _away)  # still away when the ledger closes
            with caplog.at_level(logging.WARNING, logger="ledger.storage"):
                led.close()
                closed = True
    finally:
        if not closed:
            led.close()
    attempt_id = _told_unresolved(err.value)
    left = [r for r in caplog.records if r.levelno == logging.WARNING
            and "closing the ledger" in r.getMessage() and attempt_id in r.getMessage()]
    assert left and "recovery" in left[0].getMessage()
    with Ledger.open(db_url) as check:  # one try, then left: recovery's, once the lease lapses
        assert check.get_attempt(attempt_id).state is AttemptState.DISPATCHING


def _session(led: Ledger | AsyncLedger, fake: FakeProvider, again: str
             ) -> tuple[DatabaseUnavailable, BaseException | None]:
    """Run ``r``'s session with its first begin left unresolved; the database answers again at
    ``again`` (the next turn, the exit, or only the ledger's close). The turn's error, and
    what the block raised."""
    lost: list[DatabaseUnavailable] = []

    def failed(e: DatabaseUnavailable) -> None:
        lost.append(e)
        faults.disarm()
        if again == "close":
            faults.arm("settle.before_commit", _away)  # still away when the session ends

    terms = {"plan": plan(fake), "budget": BUDGET, "grant": GRANT, "lease_ttl_s": TTL_S}
    raised = session_failing_once(led, terms, ENV, again, failed, lands_unresolved)
    return lost[0], raised


@pytest.mark.parametrize("again", ["next_turn", "exit", "close"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sessions_never_sent_begin_ends_not_sent_and_its_exit_is_written_once_back(
    db_url: str, fake: FakeProvider, mode: str, again: str
) -> None:
    led = Ledger.open(db_url)
    try:
        lost, raised = _session(led if mode == "sync" else AsyncLedger(led), fake, again)
    finally:
        led.close()
    attempt_id = _told_unresolved(lost)
    assert raised is (None if again == "next_turn" else lost)
    with Ledger.open(db_url) as check:
        _settled_not_sent(check, "r", attempt_id)
        run = check.get_run("r")
        assert run.lease_holder is None
        sent = [r.headers.get("x-ledger-attempt") for r in fake.requests]
        assert attempt_id not in sent
        if again == "next_turn":
            [_, served] = check.timeline("r")
            assert served.state is AttemptState.SUCCEEDED and sent == [served.attempt_id]
            assert run.status is RunStatus.SUCCEEDED
        else:
            assert sent == [] and run.status is RunStatus.FAILED
