"""Closing a Run nobody will resume (issue 22, item 6): ``Ledger.close_run``, its AsyncLedger
twin, ``failover-ledger run close``, and ``recover(close_past_deadline=True)``, on both backends.

A close takes the Run over under a fresh fence (an executor that wakes up can write nothing),
records a ``close`` event and releases the lease; unknown Attempts keep their holds. Bad input
changes nothing: a Run a live executor holds (``LeaseHeld``), an unknown id (``NotFound``), a
status that is no end (``InvalidArgument`` naming the field and the choices), a different end
for an ended Run (``InvalidState``; the same end again is a no-op).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from ledger import Budget, Envelope, Grant, Part, faults
from ledger.api.facade import AsyncLedger, Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState, RunStatus
from ledger.errors import (
    DatabaseUnavailable,
    FencedOut,
    InvalidArgument,
    InvalidState,
    LeaseHeld,
    NotFound,
)
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.storage import schema as s
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.storage.helpers import budget, grant, routes, sql_context

fake = fakeplan.fake
_clear = fakeplan._clear

T0 = 1_700_000_000.0


def _rows(led: Ledger) -> dict[str, int]:
    with sql_context(led).engine.connect() as conn:
        return {t: conn.execute(select(func.count()).select_from(getattr(s, t))).scalar_one()
                for t in ("runs", "attempts", "debits", "events", "group_slots")}


def _crashed(led: Ledger, clock: ManualClock, run_id: str = "r1", *,
             deadline: float | None = None) -> tuple[object, str, str]:
    """A Run whose executor served one turn, sent a second and died: (its lease, the served
    attempt, the one left dispatching). The lease has expired."""
    led.configure_group("g", max_in_flight=5)
    led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant(), deadline=deadline)
    lease = led.acquire_lease(run_id, ttl_s=10, executor_id="worker-1")
    ok = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.10",
                           turn_id="t1")
    led.settle_attempt(lease, ok.attempt_id, outcome="succeeded", cost="0.05")
    lost = led.begin_attempt(lease, route="a", envelope_hash="sha256:2", reserve="0.20",
                             turn_id="t2")
    clock.advance(11)
    return lease, ok.attempt_id, lost.attempt_id


def test_a_recovered_run_left_running_is_closed_under_a_fresh_fence(db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        lease, _ok, lost = _crashed(led, clock)
        rep = recover(led, release=True)  # taken over, released: nobody resumes it
        assert led.get_run("r1").status is RunStatus.RUNNING
        fence = rep.runs[0].fence
        rec = led.close_run("r1", status="failed", reason="the user gave up on task 7")
        assert rec.status is RunStatus.FAILED and rec.lease_holder is None
        [ev] = led.events("r1", ["close"])
        assert ev.data["status"] == "failed" and ev.data["reason"] == "the user gave up on task 7"
        assert (ev.data["previous_fence"], ev.data["fence"]) == (fence, fence + 1)
        assert ev.data["previous_status"] == "running" and ev.data["holds_kept"] == [lost]
        # The unknown Attempt keeps its hold: the provider may bill it.
        att = led.get_attempt(lost)
        assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
        assert led.get_run("r1").reserved == Decimal("0.20")
        # The dead executor, should it wake up, can write nothing.
        with pytest.raises(FencedOut):
            led.settle_attempt(lease, lost, outcome="succeeded", cost="0.1")  # type: ignore[arg-type]
        assert led.get_attempt(lost).state is AttemptState.UNKNOWN
        assert reconcile(led).violations == []


def test_closing_a_run_nobody_recovered_marks_its_dispatching_attempt_unknown_with_its_hold(
        db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        lease, _ok, lost = _crashed(led, clock)
        rec = led.close_run("r1", status="cancelled")
        assert rec.status is RunStatus.CANCELLED
        att = led.get_attempt(lost)
        assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
        assert led.group_projections(["g"])["g"].in_flight == 0
        [ev] = led.events("r1", ["close"])
        assert ev.data["unknown"] == [lost] and ev.data["slots_released"] == 1
        assert ev.data["fence"] == lease.fence + 1  # type: ignore[attr-defined]
        [unknown] = led.events("r1", ["unknown"])
        assert unknown.attempt_id == lost
        assert reconcile(led).violations == []


def test_a_run_a_live_executor_holds_is_not_closed_and_nothing_changes(db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=30, executor_id="worker-1")
        before, run = _rows(led), led.get_run("r1")
        with pytest.raises(LeaseHeld) as ei:
            led.close_run("r1", status="failed")
        assert ei.value.fields["holder"] == "worker-1"
        assert _rows(led) == before and led.get_run("r1") == run
        led.renew_lease(lease, ttl_s=30)  # still the holder, fence unchanged


def test_bad_input_to_close_run_is_typed_and_changes_nothing(db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        _crashed(led, clock)
        before, run = _rows(led), led.get_run("r1")
        with pytest.raises(NotFound):
            led.close_run("no-such-run", status="failed")
        for bad in ("running", "admitted", "done", 3):
            with pytest.raises(InvalidArgument) as ei:
                led.close_run("r1", status=bad)  # type: ignore[arg-type]
            assert ei.value.field == "status"
            assert ei.value.fields["choices"] == ["succeeded", "failed", "stopped", "cancelled"]
        with pytest.raises(InvalidArgument) as ei:
            led.close_run("r1", status="failed", reason="x" * 500)
        assert ei.value.field == "reason"
        # Its last turn was not served (an attempt is still out): not succeeded.
        with pytest.raises(InvalidState):
            led.close_run("r1", status="succeeded")
        assert _rows(led) == before and led.get_run("r1") == run


def test_closing_an_ended_run_again_is_a_no_op_for_the_same_status_and_refused_for_another(
        db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        _crashed(led, clock)
        led.close_run("r1", status="stopped")
        before, run = _rows(led), led.get_run("r1")
        assert led.close_run("r1", status=RunStatus.STOPPED) == run
        with pytest.raises(InvalidState) as ei:
            led.close_run("r1", status="failed")
        assert ei.value.fields["status"] == "stopped"
        assert _rows(led) == before and led.get_run("r1") == run


def test_a_run_its_block_ended_is_closed_for_good_with_the_status_it_ended_with(
        db_url: str) -> None:
    """A Run its block ended has no ``close`` and would be continued by the same id; the
    operator's close with its status records one and it is never resumed. Another status is
    refused: the status stays what its block said."""
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r", ttl_s=10)
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.1")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.01")
        led.finish_run(lease, RunStatus.FAILED)
        led.release_lease(lease)
        before = _rows(led)
        with pytest.raises(InvalidState) as ei:
            led.close_run("r", status="cancelled")
        assert "--status failed" in str(ei.value) and _rows(led) == before
        closed = led.close_run("r", status="failed", reason="withdrawn", by="ana")
        assert closed.status is RunStatus.FAILED and closed.fence == lease.fence + 1
        [event] = led.events("r", ["close"])
        assert event.data["by"] == "ana" and event.data["previous_status"] == "failed"
        with pytest.raises(InvalidState) as ei:
            led.acquire_lease("r", ttl_s=10)
        assert "closed failed by 'ana'" in str(ei.value)
        before = _rows(led)
        assert led.close_run("r", status="failed") == led.get_run("r")  # again: a no-op
        assert _rows(led) == before


def test_a_run_whose_last_turn_was_served_may_be_closed_succeeded(db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        led.admit_run("r2", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=10)
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.10")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.05")
        clock.advance(11)  # the host died before it finished the Run
        assert led.close_run("r1", status="succeeded").status is RunStatus.SUCCEEDED
        with pytest.raises(InvalidState):  # nothing was ever served
            led.close_run("r2", status="succeeded")


def test_the_async_twin_closes_the_same_way(db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        _crashed(led, clock)

    async def main_() -> RunStatus:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            with pytest.raises(NotFound):
                await led.close_run("nope", status="failed")
            return (await led.close_run("r1", status="failed")).status

    assert asyncio.run(main_()) is RunStatus.FAILED


# -- a closed Run stays closed ---------------------------------------------------------------

SESSION_BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
SESSION_GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])


def test_a_closed_run_is_never_resumed_by_a_session_or_a_lease_and_nothing_is_sent(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        terms = {"plan": fakeplan.plan(fake), "budget": SESSION_BUDGET, "grant": SESSION_GRANT}
        # Served a turn, then its host went away without ending it; another was never started.
        led.admit_run("r", **terms)  # type: ignore[arg-type]
        lease = led.acquire_lease("r", ttl_s=30)
        att = led.begin_attempt(lease, route="primary", envelope_hash=HELLO.hash,
                                reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.001")
        led.release_lease(lease)
        led.admit_run("fresh", **terms)  # type: ignore[arg-type]
        led.close_run("r", status="succeeded", reason="the user took the answer", by="ana")
        led.close_run("fresh", status="cancelled", reason="ticket 8812 withdrawn", by="ana")
        before, sent = _rows(led), len(fake.requests)
        for rid, status in (("r", RunStatus.SUCCEEDED), ("fresh", RunStatus.CANCELLED)):
            # The same terms again would continue a Run a block ended; a close is final.
            with pytest.raises(InvalidState) as ei, \
                    led.run(rid, **terms) as again:  # type: ignore[arg-type]
                again.turn(Envelope(parts=[Part(content="once more")]))
            msg = str(ei.value)
            assert f"closed {status.value} by 'ana'" in msg and "new Run" in msg
            assert ei.value.fields["closed_by"] == "ana"
            with pytest.raises(InvalidState):  # the low-level API, which execute needs too
                led.acquire_lease(rid, ttl_s=30)
            assert led.get_run(rid).status is status
        assert _rows(led) == before and len(fake.requests) == sent

    async def main_() -> None:
        async with AsyncLedger.open(db_url) as aled:
            with pytest.raises(InvalidState):
                async with aled.run("fresh", **terms):  # type: ignore[arg-type]
                    pass

    asyncio.run(main_())
    with Ledger.open(db_url) as led:
        assert _rows(led) == before and led.get_run("fresh").status is RunStatus.CANCELLED


def test_a_run_recovery_closed_past_its_deadline_takes_no_new_lease(db_url: str) -> None:
    clock = ManualClock(T0)
    with Ledger.open(db_url, clock=clock) as led:
        _crashed(led, clock, "late", deadline=T0 + 5)
        clock.advance(100)
        assert recover(led, close_past_deadline=True).closed == ["late"]
        before = _rows(led)
        with pytest.raises(InvalidState) as ei:
            led.acquire_lease("late", ttl_s=30, executor_id="worker-2")
        assert "deadline" in ei.value.fields["reason"]
        assert _rows(led) == before and led.get_run("late").status is RunStatus.FAILED


# -- the command line -----------------------------------------------------------------------


def test_run_close_on_the_command_line(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The command reads the system clock: the crash is an hour old, the other lease is live.
    clock = ManualClock(time.time() - 3600)
    with Ledger.open(db_url, clock=clock) as led:
        _, _ok, lost = _crashed(led, clock)
        led.admit_run("held", plan=routes(), budget=budget(), grant=grant())
        led.acquire_lease("held", ttl_s=86400, executor_id="worker-2")
    why = ["--reason", "nobody resumes it"]
    assert main(["--db", db_url, "run", "close", "r1", "--status", "running", *why]) == 2
    err = capsys.readouterr().err
    assert "--status is not one of the choices (got 'running')" in err
    assert "'failed'" in err
    assert main(["--db", db_url, "run", "close", "nope", "--status", "failed", *why]) == 1
    err = capsys.readouterr().err
    assert "unknown run id 'nope'; nothing was closed: check the id (list runs with" in err
    assert "admit" not in err  # the host's fix, not an operator's
    assert main(["--db", db_url, "run", "close", "held", "--status", "failed", *why]) == 1
    err = capsys.readouterr().err
    # The expiry as a person reads it: how far off, and when (never an epoch float).
    assert re.search(r"'worker-2', its lease expiring in 2[34] h "
                     r"\(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\)", err), err
    assert main(["--db", db_url, "run", "close", "r1", "--status", "failed",
                 "--reason", "crashed, nobody resumes"]) == 0
    out = capsys.readouterr().out
    assert "closed run r1: running -> failed" in out and lost in out
    assert main(["--db", db_url, "run", "close", "r1", "--status", "failed", "--json",
                 *why]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed"] is False and doc["status"] == "failed"
    assert main(["--db", db_url, "runs", "--status", "failed", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["items"]] == ["r1"]
    with Ledger.open(db_url) as led:
        [ev] = led.events("r1", ["close"])
        assert ev.data["reason"] == "crashed, nobody resumes"
        assert led.get_run("held").status is RunStatus.ADMITTED


def test_the_command_says_a_block_ended_run_was_closed_and_a_closed_one_was_not_again(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with Ledger.open(db_url) as led:
        led.admit_run("r", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r", ttl_s=10)
        led.finish_run(lease, RunStatus.FAILED)
        led.release_lease(lease)
    args = ["--db", db_url, "run", "close", "r", "--status", "failed", "--reason", "withdrawn"]
    assert main(args) == 0
    assert "closed run r: failed -> failed" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed"] is False and doc["close"] == {}
    assert main(args) == 0
    assert "run r was already closed failed; nothing changed" in capsys.readouterr().out


# -- recovery closes Runs past their deadline -----------------------------------------------


def test_recovery_closes_runs_past_their_deadline_when_asked(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The command at the end reads the system clock: the story happens in the last hour.
    t0 = time.time() - 3600
    clock = ManualClock(t0)
    with Ledger.open(db_url, clock=clock) as led:
        _crashed(led, clock, "late", deadline=t0 + 5)          # crashed, past its deadline
        _crashed(led, clock, "on-time", deadline=t0 + 10 ** 6)  # crashed, deadline ahead
        _crashed(led, clock, "no-deadline")
        led.admit_run("busy", plan=routes(), budget=budget(), grant=grant(),
                      deadline=t0 + 5)
        led.acquire_lease("busy", ttl_s=86400, executor_id="alive")
        # Recovered earlier and released: left running with nobody on it.
        _crashed(led, clock, "orphan", deadline=t0 + 50)
        recover(led, release=True, run_ids=["orphan"])
        clock.advance(100)
        rep = recover(led)  # without the option nothing is closed
        assert rep.closed == []
        clock.advance(100)
        rep = recover(led, close_past_deadline=True, executor_id="rec-2")
        assert sorted(rep.closed) == ["late", "orphan"]
        for rid in ("late", "orphan"):
            rec = led.get_run(rid)
            assert rec.status is RunStatus.FAILED and rec.lease_holder is None
            [ev] = led.events(rid, ["close"])
            assert "deadline" in ev.data["reason"] and ev.data["executor"] == "rec-2"
            assert len(ev.data["holds_kept"]) == 1
        assert led.get_run("on-time").status is RunStatus.RUNNING
        assert led.get_run("no-deadline").status is RunStatus.RUNNING
        assert led.get_run("busy").lease_holder == "alive"
        assert reconcile(led).violations == []
        _crashed(led, clock, "late-2", deadline=t0)
    assert main(["--db", db_url, "recover", "--close-past-deadline", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["closed"] == ["late-2"]
    assert main(["--db", db_url, "recover", "--close-past-deadline"]) == 0
    assert "closed 0 run(s) past their deadline" in capsys.readouterr().out


@pytest.mark.postgres
def test_closing_a_run_whose_row_a_paused_executor_holds_waits_boundedly_and_says_why(
        pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """An executor paused inside its write transaction (``idle in transaction``, its Run's
    row locked): the operator's close (the call, the command) waits for the row at most the
    lock timeout, then fails typed, naming the Run, the cause and where to look; nothing
    changes. Recovery's report says the Run was locked, not "taken by another process"."""
    from ledger.storage import recovery as queries

    monkeypatch.setattr(queries, "CLOSE_LOCK_TIMEOUT", "300ms")  # the test's patience
    clock = ManualClock(time.time() - 3600)  # the command's system clock: the lease expired
    executor = Ledger.open(pg_url, clock=clock)
    operator = Ledger.open(pg_url, clock=clock)
    executor.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    lease = executor.acquire_lease("r1", ttl_s=10, executor_id="worker-1")
    paused, go = threading.Event(), threading.Event()

    def pause(_name: str) -> None:
        paused.set()
        assert go.wait(60), "the executor was never resumed"

    def closing() -> Any:
        return operator.close_run("r1", status="failed", reason="stuck", by="ops")

    pool = ThreadPoolExecutor(max_workers=2)
    try:
        faults.arm("begin.before_commit", pause)
        begin = pool.submit(executor.begin_attempt, lease, route="a",
                            envelope_hash="sha256:1", reserve="0.10", turn_id="t1")
        assert paused.wait(30), begin.exception(0)
        clock.advance(11)
        before = operator.get_run("r1")
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as ei:
            pool.submit(closing).result(20)  # without the bound: waits until the executor goes
        assert time.monotonic() - started < 10
        err = ei.value
        assert err.fields["run_id"] == "r1" and err.fields["contention"] == "55P03"
        said = str(err)
        assert "'r1' was not closed" in said and "another session's transaction" in said
        assert "pg_stat_activity" in said and "nothing changed" in said
        assert operator.get_run("r1") == before and operator.events("r1", ["close"]) == []
        assert main(["--db", pg_url, "run", "close", "r1", "--status", "failed",
                     "--reason", "stuck"]) == 1
        assert "its row stayed locked" in capsys.readouterr().err
        rep = recover(operator)
        assert rep.skipped == ["r1"] and rep.runs == []
        assert main(["--db", pg_url, "recover"]) == 0
        assert "skipped 1 (locked by another session's transaction" in capsys.readouterr().out
        go.set()
        begin.result(30)
    finally:
        faults.disarm()
        go.set()
        pool.shutdown(wait=True)
    try:
        rec = operator.close_run("r1", status="failed", reason="stuck", by="ops")
        assert rec.status is RunStatus.FAILED
    finally:
        executor.close()
        operator.close()
