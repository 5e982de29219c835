"""A full capacity group is a queue, not a refusal.

A turn whose target group is full waits for a slot, bounded by ``max_capacity_wait_s`` and the
Run's deadline; waiters are served first come, first served across processes; a waiter that is
cancelled or times out leaves the queue and nothing else behind; a dead waiter's place lapses
with its lease, and a closed ledger's waiters give their places up at the close. A wait writes
no ``rejected`` Attempt: it is recorded once (``capacity_wait``) and shows in the audit timeline
and ``run show``. Waits wake when a slot frees (PostgreSQL ``LISTEN/NOTIFY``, or in-process
signals), polling only as a bounded fallback.

Real HTTP over loopback (the fake provider), real PostgreSQL and SQLite files, real OS
processes for order and reclaiming; no test sleeps to make time pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import (
    AsyncLedger,
    Budget,
    CapacityUnavailable,
    DatabaseUnavailable,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidState,
    Ledger,
    ManualClock,
    Notice,
    Part,
    Route,
    RunStatus,
    faults,
    preset,
)
from ledger.api.face import storage_of
from ledger.domain.records import AttemptState
from ledger.ops.audit import Audit
from ledger.ops.recovery import recover
from ledger.storage.engine import normalize_url
from ledger.storage.pgpool import own_pids
from ledger.storage.statements import QUEUE_CHANNEL
from ledger.storage.wake import LISTEN_READY_S
from ledger.testing import FakeProvider, Fault
from ledger.testing.pgserver import PgServer
from tests import fakeplan
from tests.fakeplan import PRICE
from tests.pgcut import CommitCutter

fake = fakeplan.fake
_clear = fakeplan._clear

REPO = Path(__file__).resolve().parents[2]
BUDGET = Budget(max_calls=4, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
ENV = Envelope(parts=[Part(content="hello")])
PATIENCE_S = 120  # how long a test waits for an event before it calls the run hung
TICKS = 20  # heartbeats that show the event loop runs


def _route(fake: FakeProvider) -> Route:
    return Route(id="a", provider="fake", model="a-model", group="ga", recipient="fake",
                 endpoint=fake.endpoint("openai"), price=PRICE)


def _hold(led: Ledger, route: Route, run_id: str = "holder") -> tuple[object, str]:
    """Another Run takes the group's only slot (a long lease: it stays live)."""
    led.configure_group("ga", max_in_flight=1)
    led.admit_run(run_id, plan=[route], budget=BUDGET, grant=GRANT)
    lease = led.acquire_lease(run_id, ttl_s=3600)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:held", reserve="0")
    return lease, att.attempt_id


def _waiting(led: Ledger) -> int:
    return led.group_projections(["ga"])["ga"].waiting


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url) as ledger:
        yield ledger


def _only_a_signal_wakes(led: Ledger) -> None:
    # No polling fallback within the test's patience: the waiter is served only if a signal
    # (this process's settle, or PostgreSQL's NOTIFY) wakes it.
    storage_of(led).waker.poll_s = 10 * PATIENCE_S


# -- in one process -------------------------------------------------------------------------


def test_a_full_group_queues_the_turn_and_a_freed_slot_serves_it_at_once(
        led: Ledger, fake: FakeProvider) -> None:
    route = _route(fake)
    lease, held = _hold(led, route)
    _only_a_signal_wakes(led)
    queued = threading.Event()
    notices: list[Notice] = []
    out: dict[str, object] = {}

    def on_notice(n: Notice) -> None:
        notices.append(n)
        if n.kind == "queued":
            queued.set()

    def worker() -> None:
        try:
            with led.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                out["result"] = run.turn(ENV, on_notice=on_notice)
        except BaseException as e:  # pragma: no cover - reported below
            out["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    assert queued.wait(PATIENCE_S), out
    assert _waiting(led) == 1
    assert led.timeline("w") == []  # waiting writes no Attempt
    led.settle_attempt(lease, held, outcome="succeeded", cost="0")  # type: ignore[arg-type]
    t.join(PATIENCE_S)
    assert not t.is_alive() and "error" not in out, out
    [att] = led.timeline("w")
    assert att.state is AttemptState.SUCCEEDED and att.route_id == "a"
    [wait] = led.events("w", ["capacity_wait"])
    assert wait.attempt_id == att.attempt_id and wait.data["outcome"] == "admitted"
    assert wait.data["group"] == "ga" and wait.data["limit"] == 1 and wait.data["waited_s"] > 0
    assert [n.kind for n in notices] == ["queued"] and "ga" in notices[0].detail
    assert _waiting(led) == 0
    tl = Audit(led).timeline("w")
    assert [(w.kind, w.group, w.outcome) for w in tl.waits] == [("capacity", "ga", "admitted")]


def test_a_waiter_past_its_bound_leaves_nothing_behind_and_names_group_limit_and_wait(
        db_url: str, fake: FakeProvider) -> None:
    clock = ManualClock(1_800_000_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        route = _route(fake)
        lease, held = _hold(led, route)
        with pytest.raises(FailoverExhausted) as ei, led.run(
                "w", plan=[route], budget=BUDGET, grant=GRANT, lease_ttl_s=3600) as run:
            run.turn(ENV)
        [err] = ei.value.exceptions
        assert isinstance(err, CapacityUnavailable) and err.route == "a"
        assert err.fields["group"] == "ga" and err.fields["limit"] == 1
        assert err.fields["waited_s"] == pytest.approx(30.0)
        assert "'ga'" in str(err) and "limit 1" in str(err) and "30 s" in str(err)
        assert clock.slept == [pytest.approx(30.0)]  # the injectable sleeper, not real time
        assert led.timeline("w") == [] and _waiting(led) == 0
        [wait] = led.events("w", ["capacity_wait"])
        assert wait.attempt_id is None and wait.data["outcome"] == "timed_out"
        # Its place is gone: once the slot frees, a begin that does not queue is admitted.
        led.settle_attempt(lease, held, outcome="succeeded", cost="0")  # type: ignore
        other = led.acquire_lease("holder", ttl_s=3600)
        assert led.begin_attempt(other, route="a", envelope_hash="sha256:again",
                                 reserve="0").state is AttemptState.DISPATCHING


def _waited_out(db_url: str, fake: FakeProvider) -> FailoverExhausted:
    """Run "w"'s turn, queued behind a held slot of its only group until its wait ran out."""
    clock = ManualClock(1_800_000_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        route = _route(fake)
        _hold(led, route)
        with pytest.raises(FailoverExhausted) as ei, led.run(
                "w", plan=[route], budget=BUDGET, grant=GRANT, lease_ttl_s=3600) as run:
            run.turn(ENV)
    return ei.value


def test_a_route_whose_queue_wait_timed_out_is_said_not_sent_never_failed(
        db_url: str, fake: FakeProvider) -> None:
    err = _waited_out(db_url, fake)
    [line] = err.fields["candidates"]
    assert line.startswith("a: not sent: capacity group 'ga' stayed full"), line
    assert "failed" not in str(err)
    assert [(s["route"], s["detail"]) for s in err.fields["skipped"]] == [
        ("a", "already tried in this turn")]


class _Parked:
    """A turn's sleeper that parks each wait for a slot until the test releases it.

    The ledger's time is the test's ManualClock, set by the test while the waiter is parked;
    the waiter then looks at the queue once more at that time.
    """

    def __init__(self) -> None:
        self.parked = threading.Event()
        self.release = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.parked.set()
        assert self.release.wait(PATIENCE_S)

    async def asleep(self, seconds: float) -> None:  # pragma: no cover - a sync turn's
        self.sleep(seconds)

    def sleep_until_woken(self, seconds: float, woken: threading.Event, poll_s: float) -> None:
        self.sleep(seconds)


def test_a_waiter_past_its_bound_names_only_the_waiters_ahead_of_it(db_url: str,
                                                                     fake: FakeProvider) -> None:
    start = 1_800_000_000.0
    clock = ManualClock(start)
    patient = preset("failure-domain")
    patient = patient.model_copy(update={"admission": patient.admission.model_copy(
        update={"max_capacity_wait_s": 60.0})})
    with Ledger.open(db_url, clock=clock) as led:
        route = _route(fake)
        _hold(led, route)
        # w1 waits up to 60 s, w2 (queued behind it a second later) 30 s, w3 60 s.
        waiters = {"w1": patient, "w2": preset("failure-domain"), "w3": patient}
        sleepers = {w: _Parked() for w in waiters}
        queued: dict[str, str] = {}
        stops: dict[str, BaseException] = {}

        def wait_in_queue(run_id: str) -> None:
            try:
                with led.run(run_id, plan=[route], budget=BUDGET, grant=GRANT,
                             policy=waiters[run_id], lease_ttl_s=3600) as run:
                    run.turn(ENV, sleeper=sleepers[run_id],
                             on_notice=lambda n: queued.setdefault(run_id, n.detail))
            except BaseException as e:
                stops[run_id] = e

        threads = {w: threading.Thread(target=wait_in_queue, args=(w,)) for w in waiters}
        try:
            for w, t in threads.items():
                t.start()
                assert sleepers[w].parked.wait(PATIENCE_S), stops
                clock.advance(1)
            assert [queued[w].split("; ")[0] for w in waiters] == [
                f"capacity group 'ga' is full (limit 1: 1 in flight, {n} waiting ahead)"
                for n in (0, 1, 2)]
            # w2's bound (start + 31 s) has passed; w1's and w3's have not: at its last look
            # one waiter is ahead of it (w1), and w3 is behind it.
            clock.set(start + 31.5)
            sleepers["w2"].release.set()
            threads["w2"].join(PATIENCE_S)
            stop = stops["w2"]
            assert isinstance(stop, FailoverExhausted)
            [err] = stop.exceptions
            assert isinstance(err, CapacityUnavailable)
            assert "(limit 1: 1 in flight, 1 waiting ahead)" in str(err), str(err)
        finally:
            clock.set(start + 100)  # past every bound: the others stop too
            for w, t in threads.items():
                sleepers[w].release.set()
                if t.is_alive():
                    t.join(PATIENCE_S)
        assert {w: type(e) for w, e in stops.items()} == dict.fromkeys(waiters, FailoverExhausted)
        assert _waiting(led) == 0


def _queued_through_a_burst(led: Ledger, clock: ManualClock, plan: list[Route],
                            queued_on: Route) -> tuple[Any, float]:
    """Run "w"'s turn on ``plan``; while it waits in ``queued_on``'s full group, the three
    calls in flight there (another Run's) answer 503, which cools ``queued_on`` for 60 s.

    Returns the turn's result and the time of the burst's last failure.
    """
    led.configure_group(queued_on.group, max_in_flight=3)
    led.admit_run("holder", plan=[queued_on], budget=BUDGET, grant=GRANT)
    lease = led.acquire_lease("holder", ttl_s=3600)
    held = [led.begin_attempt(lease, route=queued_on.id, envelope_hash=f"sha256:held{i}",
                              reserve="0", turn_id=f"t{i}").attempt_id for i in range(3)]
    sleeper = _Parked()
    out: dict[str, Any] = {}

    def worker() -> None:
        try:
            with led.run("w", plan=plan, budget=BUDGET, grant=GRANT, lease_ttl_s=3600) as run:
                out["result"] = run.turn(ENV, sleeper=sleeper)
        except BaseException as e:  # pragma: no cover - reported below
            out["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert sleeper.parked.wait(PATIENCE_S), out
        group = queued_on.group
        assert led.group_projections([group])[group].waiting == 1
        for att in held:  # the burst: one 503 after another
            clock.advance(0.1)
            led.settle_attempt(lease, att, outcome="failed",  # type: ignore[arg-type]
                               observation={"status": 503})
        last = clock.now()
        health = led.health([queued_on.id])[queued_on.id]
        assert health.cooldown_until == pytest.approx(last + 60)
        clock.advance(0.1)
    finally:
        sleeper.release.set()
        t.join(PATIENCE_S)
    assert not t.is_alive() and "error" not in out, out
    assert led.group_projections([group])[group].waiting == 0
    return out["result"], last


def _acme(fake: FakeProvider) -> tuple[Route, Route, Route]:
    endpoint = fake.endpoint("openai")
    return tuple(Route(id=rid, provider=provider, model=f"{rid}-model", group=group,
                       recipient="fake", endpoint=endpoint, price=PRICE)
                 for rid, provider, group in (("a1", "acme", "ga"), ("a2", "acme", "ga2"),
                                              ("b1", "beta", "gb")))  # type: ignore[return-value]


def _stepped_once(led: Ledger, route: str, last: float) -> None:
    """The burst stepped ``route``'s curve once: 60 s from its last failure, one error."""
    health = led.health([route])[route]
    assert health.error_count == 1 and health.last_failure_at == pytest.approx(last)
    assert health.cooldown_until == pytest.approx(last + 60)


def test_a_queued_turn_never_sends_to_a_route_that_started_cooling_while_it_waited(
        db_url: str, fake: FakeProvider) -> None:
    # A turn queues for a1 behind another Run's three calls in flight; while it waits they
    # all answer 503, and the third failure within 60 s cools a1 for 60 s. Once woken, the
    # turn must look at its choice again: a1 is cooling, so it gives its place up and serves
    # on b1. Sent to a1 on the old choice, its 503 (begun after a1's last failure, so not the
    # same outage) would step a1's cooldown to 5 min fleet-wide.
    clock = ManualClock(1_800_000_000.0)
    a1, _, b1 = _acme(fake)
    fake.set_default(Fault.UNAVAILABLE, model="a1-model")  # a1 is down
    with Ledger.open(db_url, clock=clock) as led:
        result, last = _queued_through_a_burst(led, clock, [a1, b1], a1)
        assert result.route.id == "b1"
        assert [(a.route_id, a.kind.value, a.state) for a in result.attempts] == [
            ("b1", "first", AttemptState.SUCCEEDED)]
        assert [r.model for r in fake.requests] == ["b1-model"]  # nothing reached a1
        assert led.get_run("w").retries_used == 0  # no permission taken for the change
        _stepped_once(led, "a1", last)
        [wait] = led.events("w", ["capacity_wait"])
        assert wait.attempt_id is None and wait.data["outcome"] == "redecided"
        assert wait.data["route"] == "a1" and wait.data["why"]["reason"] == "route_cooldown"
        assert wait.data["waited_s"] == pytest.approx(0.4)
        [select] = led.events("w", ["select"])
        assert select.data["route"] == "b1"
        assert ("a1", "route_cooldown") in [(s["route"], s["reason"])
                                            for s in select.data["skipped"]]


def test_a_failover_queued_for_a_route_that_started_cooling_moves_on_with_one_permission(
        db_url: str, fake: FakeProvider) -> None:
    # a1 fails; the failover to a2 queues in a2's full group, where a burst cools a2. The turn
    # decides again from the same failure: b1, with the one retry permission of the failover
    # and a move that says a1 -> b1 (the move to a2 was never made).
    clock = ManualClock(1_800_000_000.0)
    a1, a2, b1 = _acme(fake)
    fake.set_default(Fault.UNAVAILABLE, model="a1-model")
    fake.set_default(Fault.UNAVAILABLE, model="a2-model")
    with Ledger.open(db_url, clock=clock) as led:
        result, last = _queued_through_a_burst(led, clock, [a1, a2, b1], a2)
        assert [(a.route_id, a.kind.value, a.state) for a in result.attempts] == [
            ("a1", "first", AttemptState.FAILED), ("b1", "failover", AttemptState.SUCCEEDED)]
        assert [r.model for r in fake.requests] == ["a1-model", "b1-model"]
        assert led.get_run("w").retries_used == 1
        _stepped_once(led, "a2", last)
        moves = [(e.data["from_route"], e.data["to_route"]) for e in led.events("w", ["move"])]
        assert moves == [("a1", "b1")]
        [wait] = led.events("w", ["capacity_wait"])
        assert wait.data["outcome"] == "redecided" and wait.data["route"] == "a2"


def test_a_cancelled_waiter_leaves_the_queue_and_nothing_else(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            route = _route(fake)
            lease, held = _hold(led.sync, route)
            queued = asyncio.Event()

            def on_notice(n: Notice) -> None:
                if n.kind == "queued":
                    queued.set()

            async with led.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                task = asyncio.create_task(run.turn(ENV, on_notice=on_notice))
                await asyncio.wait_for(queued.wait(), PATIENCE_S)
                assert _waiting(led.sync) == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # The session still holds the Run (its lease is live), yet its place is gone:
                assert _waiting(led.sync) == 0
                await led.settle_attempt(lease, held, outcome="succeeded", cost="0")
                other = await led.acquire_lease("holder", ttl_s=3600)
                att = await led.begin_attempt(other, route="a", envelope_hash="sha256:x",
                                              reserve="0")
                assert att.state is AttemptState.DISPATCHING
            assert await led.timeline("w") == []  # nothing recorded for the cancelled wait

    asyncio.run(main())


def test_a_closed_ledgers_waiters_leave_no_place_to_count_or_wait_behind(
        db_url: str, fake: FakeProvider) -> None:
    # A ledger closed while its turns wait in a full group's queue: their sessions cannot end
    # their Runs on it (the close releases their leases), and their places go at the close,
    # so nobody counts them as waiting nor waits behind them.
    route = _route(fake)

    async def main() -> None:
        with Ledger.open(db_url) as other:
            lease, held = _hold(other, route)
            queued = asyncio.Event()
            waiting: list[str] = []

            def on_notice(n: Notice) -> None:
                if n.kind == "queued":
                    waiting.append(n.kind)
                    if len(waiting) == 2:
                        queued.set()

            async with AsyncLedger.open(db_url) as led:

                async def wait_in(run_id: str) -> None:
                    async with led.run(run_id, plan=[route], budget=BUDGET, grant=GRANT) as run:
                        await run.turn(ENV, on_notice=on_notice)

                tasks = [asyncio.ensure_future(wait_in(f"w{i}")) for i in range(2)]
                await asyncio.wait_for(queued.wait(), PATIENCE_S)
                assert _waiting(other) == 2
                await led.close()
                for t in await asyncio.gather(*tasks, return_exceptions=True):
                    assert isinstance(t, InvalidState) and t.fields["problem"] == "ledger_closed"
            assert _waiting(other) == 0
            other.settle_attempt(lease, held, outcome="succeeded", cost="0")
            # A begin that is not queued is refused while anyone waits ahead: nobody does.
            att = other.begin_attempt(lease, route="a", envelope_hash="sha256:next", reserve="0")
            assert att.state is AttemptState.DISPATCHING
            assert other.timeline("w0") == [] and other.timeline("w1") == []

    asyncio.run(main())


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_turn_queued_when_its_ledger_closes_settles_no_attempt_it_never_began(
        db_url: str, fake: FakeProvider, face: str, caplog: pytest.LogCaptureFixture) -> None:
    # The closing ledger refuses the waiter's begin before it opens a transaction: there is
    # no Attempt, so nothing to settle, nor a warning that one was left to recovery. The
    # session's lease is given up by the close, so its exit warns of nothing either.
    caplog.set_level(logging.DEBUG, logger="ledger")
    route = _route(fake)
    queued: list[str] = []
    errors: list[BaseException] = []
    with Ledger.open(db_url) as other:
        lease, held = _hold(other, route)
        led = Ledger.open(db_url)
        if face == "sync":
            _close_while_queued(led, route, queued, errors)
        else:

            async def main() -> None:
                aled = AsyncLedger(led)
                on_queue = asyncio.Event()

                def on_notice(n: Notice) -> None:
                    queued.append(n.attempt_id)
                    on_queue.set()

                async def wait_in() -> None:
                    async with aled.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                        await run.turn(ENV, on_notice=on_notice)

                task = asyncio.ensure_future(wait_in())
                await asyncio.wait_for(on_queue.wait(), PATIENCE_S)
                await aled.close()
                [out] = await asyncio.gather(task, return_exceptions=True)
                errors.append(out)

            asyncio.run(main())
        [err] = errors
        assert isinstance(err, InvalidState) and err.fields["problem"] == "ledger_closed"
        [waiter_id] = queued
        assert not [r for r in caplog.records if waiter_id in r.getMessage()]
        assert not [r.getMessage() for r in caplog.records
                    if r.name.startswith("ledger") and r.levelno >= logging.WARNING]
        assert other.timeline("w") == []
        other.settle_attempt(lease, held, outcome="succeeded", cost="0")


def test_a_turn_the_close_wakes_leaves_a_session_the_close_took_and_writes_nothing(
        db_url: str, fake: FakeProvider, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The close wakes the turns queued for a slot; a woken turn's block ends at once. Its
    exit found its session not yet taken by the close (which took the open sessions only
    after waking the queues), so it went on to write the Run's end and met the closed
    ledger: a WARNING, the lease left to lapse. The close now takes the open sessions before
    it wakes the queues, so that exit writes nothing and the close releases the lease.

    Here the close goes on only once the woken block has been left, and that exit is held
    until the close has ended: the order that, before, left it to write on a closed ledger
    (one CI run of the suite on two cores met it)."""
    from ledger.api.session import RunSession

    caplog.set_level(logging.DEBUG, logger="ledger")
    route = _route(fake)
    queued: list[str] = []
    errors: list[BaseException] = []
    finish = RunSession._finish

    def after_the_close(self: RunSession, exc: BaseException | None) -> None:
        _until(lambda: self.ledger._store.closed)
        finish(self, exc)

    left = threading.Event()
    leave = RunSession._leave

    def leaving(self: RunSession) -> None:
        leave(self)
        left.set()

    monkeypatch.setattr(RunSession, "_finish", after_the_close)
    monkeypatch.setattr(RunSession, "_leave", leaving)
    with Ledger.open(db_url) as other:
        lease, held = _hold(other, route)
        led = Ledger.open(db_url)
        # The close goes on past the queues it woke once the woken block has been left.
        entries_ended = led._entries.ended

        def once_left(timeout_s: float) -> bool:
            assert left.wait(PATIENCE_S), "the woken turn's block was never left"
            return entries_ended(timeout_s)

        monkeypatch.setattr(led._entries, "ended", once_left)

        _close_while_queued(led, route, queued, errors)
        [err] = errors
        assert isinstance(err, InvalidState) and err.fields["problem"] == "ledger_closed"
        assert not [r.getMessage() for r in caplog.records
                    if r.name.startswith("ledger") and r.levelno >= logging.WARNING]
        # The close released the lease: the Run is free to resume at once, not finished.
        run = other.get_run("w")
        assert run.lease_holder is None and run.status in (RunStatus.ADMITTED, RunStatus.RUNNING)
        other.settle_attempt(lease, held, outcome="succeeded", cost="0")


@pytest.mark.postgres
def test_a_begin_under_way_at_the_close_takes_no_place_the_close_leaves_behind(
        pg_url: str, fake: FakeProvider) -> None:
    # A waiter's begin whose transaction commits after the close started giving places up
    # takes its place when nobody is left to give it up: the close waits for such begins.
    # The group's row lock, held here, keeps the begin inside its transaction until then.
    route = _route(fake)
    eng = create_engine(normalize_url(pg_url))
    with Ledger.open(pg_url) as other:
        lease, held = _hold(other, route)
        led = Ledger.open(pg_url)
        errors: list[BaseException] = []

        def wait_in() -> None:
            try:
                with led.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                    run.turn(ENV)
            except BaseException as e:
                errors.append(e)

        with eng.connect() as raw:
            raw.execute(text("SELECT 1 FROM capacity_groups WHERE group_id = 'ga' FOR UPDATE"))
            waiter = threading.Thread(target=wait_in)
            waiter.start()
            _until(lambda: raw.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()")).scalar_one() == 1)
            closer = threading.Thread(target=led.close)
            closer.start()
            _until(lambda: storage_of(led).closing)
            raw.rollback()  # the begin goes on and queues: the close has begun by now
        closer.join(PATIENCE_S)
        waiter.join(PATIENCE_S)
        eng.dispose()
        assert _waiting(other) == 0
        [err] = errors
        assert isinstance(err, InvalidState) and err.fields["problem"] == "ledger_closed"
        other.settle_attempt(lease, held, outcome="succeeded", cost="0")


def test_a_begin_an_interruption_cut_short_is_not_waited_for_at_the_close(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # The close waits for the begins under way; one a KeyboardInterrupt left (or a
    # cancellation) is not under way: it counted as such until the garbage collector closed
    # its flow, and the close waited its whole bound for it, then warned of a begin that was
    # not there.
    route = Route(id="a", provider="fake", model="m", group="g", recipient="fake",
                  endpoint="http://127.0.0.1:9/v1", price=PRICE)
    led = Ledger.open(db_url)
    led.admit_run("r", plan=[route], budget=BUDGET, grant=GRANT)
    lease = led.acquire_lease("r", ttl_s=3600)

    def interrupt(_point: str) -> None:
        raise KeyboardInterrupt

    faults.arm("begin.before_commit", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            led.begin_attempt(lease, route="a", envelope_hash="sha256:x", reserve="0")
    finally:
        faults.disarm()
    assert storage_of(led)._begins.ended(0)
    with caplog.at_level(logging.WARNING, logger="ledger"):
        led.close()
    assert not [r for r in caplog.records if "still under way" in r.getMessage()]


def _close_while_queued(led: Ledger, route: Route, queued: list[str],
                        errors: list[BaseException]) -> None:
    """Close ``led`` while a Run session's turn on ``route`` (a thread) waits in its group's
    queue; the turn's queued Attempt ids go to ``queued``, what its block raised to
    ``errors``."""
    def wait_in() -> None:
        try:
            with led.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                run.turn(ENV, on_notice=lambda n: queued.append(n.attempt_id))
        except BaseException as e:  # read by the caller
            errors.append(e)

    waiter = threading.Thread(target=wait_in)
    waiter.start()
    _until(lambda: bool(queued))
    led.close()
    waiter.join(PATIENCE_S)


def _until(cond: Callable[[], bool]) -> None:
    """Wait for ``cond`` (another thread's progress), up to :data:`PATIENCE_S`."""
    deadline = time.monotonic() + PATIENCE_S
    while not cond():
        assert time.monotonic() < deadline, "the other thread made no progress"
        time.sleep(0.005)


@pytest.mark.postgres
def test_a_turn_joining_a_queue_keeps_the_event_loop_running_while_the_listener_connects(
        pg_server: PgServer, pg_url: str, fake: FakeProvider) -> None:
    # The waiter that opens the LISTEN connection waits for it to listen before it begins
    # again; with the server slow to accept that connection, the loop must run meanwhile
    # (it used to stop for up to LISTEN_READY_S).
    with CommitCutter(pg_server.port) as proxy:
        url = proxy.url(pg_url.rsplit("/", 1)[1], user=pg_server.user)

        async def main() -> None:
            async with AsyncLedger.open(url) as led:
                route = _route(fake)
                lease, held = _hold(led.sync, route)
                ticks: list[float] = []
                measured = asyncio.Event()

                async def heartbeat() -> None:
                    while True:
                        ticks.append(time.monotonic())
                        if proxy.held and sum(t > proxy.held[0] for t in ticks) >= TICKS:
                            measured.set()
                        await asyncio.sleep(0.005)

                def on_notice(n: Notice) -> None:
                    if n.kind == "queued":
                        proxy.hold()  # the next new connection is the listener's

                beat = asyncio.create_task(heartbeat())
                async with led.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                    turn = asyncio.create_task(run.turn(ENV, on_notice=on_notice))
                    try:
                        await asyncio.wait_for(measured.wait(), PATIENCE_S)
                    finally:
                        proxy.unhold()
                    first = min(t for t in ticks if t > proxy.held[0])
                    assert first - proxy.held[0] < LISTEN_READY_S / 2
                    await led.settle_attempt(lease, held, outcome="succeeded", cost="0")
                    await asyncio.wait_for(turn, PATIENCE_S)
                beat.cancel()
                [att] = await led.timeline("w")
                assert att.state is AttemptState.SUCCEEDED

        asyncio.run(main())


# -- across processes -----------------------------------------------------------------------


class Worker:
    """A worker process (tests/run/_queue_worker.py) and the lines it prints."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.run._queue_worker", *args], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def expect(self, prefix: str) -> str:
        """The next line, which must start with ``prefix`` (waits for it, never for time)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith(prefix):
            self.proc.kill()
            _, err = self.proc.communicate(timeout=PATIENCE_S)
            raise AssertionError(f"expected {prefix!r}, got {line!r}; stderr:\n{err}")
        return line

    def tell(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def done(self) -> None:
        _, err = self.proc.communicate(timeout=PATIENCE_S)
        assert self.proc.returncode == 0, err


def _release(holder: Worker) -> None:
    holder.tell()
    holder.expect("settled")
    holder.done()


def _holding(led: Ledger, url: str, route: Route) -> Worker:
    """A process that holds the only slot of ``route``'s group until told to settle."""
    led.configure_group("ga", max_in_flight=1)
    holder = Worker("holder", url, "holder", route.model_dump_json())
    holder.expect("holding")
    return holder


def _waiter(url: str, run_id: str, route: Route, ttl: float = 30.0) -> Worker:
    return Worker("waiter", url, run_id, route.model_dump_json(), str(ttl))


def test_a_slot_freed_by_another_process_wakes_the_waiter(
        led: Ledger, db_url: str, fake: FakeProvider) -> None:
    route = _route(fake)
    holder = _holding(led, db_url, route)
    if led.backend == "postgresql":
        _only_a_signal_wakes(led)  # only NOTIFY from the holder's process can wake it
    served: dict[str, object] = {}
    queued = threading.Event()

    def worker() -> None:
        try:
            with led.run("w", plan=[route], budget=BUDGET, grant=GRANT) as run:
                served["result"] = run.turn(
                    ENV, on_notice=lambda n: queued.set() if n.kind == "queued" else None)
        except BaseException as e:  # pragma: no cover - reported below
            served["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    assert queued.wait(PATIENCE_S), served
    _release(holder)
    t.join(PATIENCE_S)
    assert not t.is_alive() and "error" not in served, served
    assert [a.state for a in led.timeline("w")] == [AttemptState.SUCCEEDED]


@pytest.mark.slow
def test_waiters_in_several_processes_are_served_in_arrival_order(
        led: Ledger, db_url: str, fake: FakeProvider) -> None:
    route = _route(fake)
    holder = _holding(led, db_url, route)
    waiters = []
    for i in range(4):
        w = _waiter(db_url, f"w{i}", route)
        w.expect("queued")  # in the queue before the next one arrives
        waiters.append(w)
    assert _waiting(led) == 4
    _release(holder)
    for w in waiters:
        w.expect("served")
        w.done()
    begun = sorted((led.timeline(f"w{i}")[0].created_at, f"w{i}") for i in range(4))
    assert [rid for _, rid in begun] == ["w0", "w1", "w2", "w3"]
    tickets = [led.events(f"w{i}", ["capacity_wait"])[0].data["ticket"] for i in range(4)]
    assert tickets == sorted(tickets)
    for i in range(4):
        [att] = led.timeline(f"w{i}")
        assert att.state is AttemptState.SUCCEEDED
    assert led.attempts(state="rejected").items == []  # no wait left a rejected row
    assert _waiting(led) == 0


@pytest.mark.slow
def test_a_dead_waiters_place_is_reclaimed_when_its_lease_expires(
        led: Ledger, db_url: str, fake: FakeProvider) -> None:
    route = _route(fake)
    holder = _holding(led, db_url, route)
    dead = _waiter(db_url, "dead", route, ttl=3.0)  # a short lease: it lapses soon after death
    dead.expect("queued")
    live = _waiter(db_url, "live", route)
    live.expect("queued")
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.communicate(timeout=PATIENCE_S)
    _release(holder)
    # The dead waiter is first in line until its lease expires; then the live one is served.
    live.expect("served")
    live.done()
    assert led.timeline("dead") == []
    assert [a.state for a in led.timeline("live")] == [AttemptState.SUCCEEDED]
    assert _waiting(led) == 0


def test_run_show_says_how_long_a_turn_waited_for_which_group(
        db_url: str, fake: FakeProvider) -> None:
    _waited_out(db_url, fake)
    show = subprocess.run([sys.executable, "-m", "ledger.cli.main", "--db", db_url, "run",
                           "show", "w"], capture_output=True, text=True, cwd=REPO,
                          timeout=PATIENCE_S)
    assert show.returncode == 0, show.stderr
    assert "waited 30.0 s (for a slot of full group ga): timed_out" in show.stdout
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "ledger.cli.main", "--db", db_url, "run", "show", "w", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=PATIENCE_S).stdout)
    assert doc["waits"][0]["group"] == "ga" and doc["waits"][0]["outcome"] == "timed_out"
    # The dashboard's run page shows the same wait.
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    with TestClient(create_app(db_url), base_url="http://127.0.0.1") as c:
        page = c.get("/runs/w").text
        api = c.get("/api/runs/w").json()
    waits = page.split('id="waits"', 1)[1].split("</section>", 1)[0]
    assert "30.0 s" in waits and "for a slot of full group ga" in waits and "timed_out" in waits
    assert api["waits"][0]["waited_s"] == pytest.approx(30.0)


# -- one freed slot, one wake-up ------------------------------------------------------------


class _WokenOnly:
    """A turn's sleeper whose waits for a slot end only on a wake-up: never on the polling
    interval, never on time (past PATIENCE_S the turn is called hung). It counts them: each
    is one more begin of its waiter."""

    def __init__(self) -> None:
        self.waits = 0
        self.parked = asyncio.Event()  # waits for a slot now
        self.woken = asyncio.Event()

    def sleep(self, seconds: float) -> None:  # pragma: no cover - nothing here backs off
        raise AssertionError("a queued turn slept on time")

    async def asleep(self, seconds: float) -> None:  # pragma: no cover - as sleep
        self.sleep(seconds)

    async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                 poll_s: float) -> None:
        self.waits += 1
        self.parked.set()
        await asyncio.wait_for(woken.wait(), PATIENCE_S)
        self.parked.clear()
        self.woken.set()


async def _held(led: AsyncLedger, route: Route, slots: int) -> list[tuple[object, str]]:
    """Other Runs take all ``slots`` of the group (long leases: they stay live)."""
    await led.configure_group("ga", max_in_flight=slots)
    held = []
    for i in range(slots):
        await led.admit_run(f"holder{i}", plan=[route], budget=BUDGET, grant=GRANT)
        lease = await led.acquire_lease(f"holder{i}", ttl_s=3600)
        att = await led.begin_attempt(lease, route="a", envelope_hash="sha256:held",
                                      reserve="0")
        held.append((lease, att.attempt_id))
    return held


async def _queue(led: AsyncLedger, route: Route, run_id: str, sleeper: _WokenOnly
                 ) -> asyncio.Task[object]:
    """Start ``run_id``'s turn and return once it waits in the queue (its ticket is then
    behind every waiter queued before)."""
    async def turn() -> object:
        async with led.run(run_id, plan=[route], budget=BUDGET, grant=GRANT) as run:
            return await run.turn(ENV, sleeper=sleeper)

    task = asyncio.create_task(turn())
    await asyncio.wait_for(sleeper.parked.wait(), PATIENCE_S)
    return task


def test_a_freed_slot_wakes_one_waiter_not_every_waiter_of_the_group(
        db_url: str, fake: FakeProvider) -> None:
    # Waking every waiter for each freed slot cost each of them a begin, all serialized on the
    # group's lock: N waiters and K slots made O(N*K) begins, and a long queue crawled.
    waiters, slots = 20, 2

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            _only_a_signal_wakes(led.sync)
            route = _route(fake)
            held = await _held(led, route, slots)
            sleepers = [_WokenOnly() for _ in range(waiters)]
            tasks = [await _queue(led, route, f"w{i}", s) for i, s in enumerate(sleepers)]
            assert sum(s.waits for s in sleepers) == waiters
            for lease, attempt_id in held:  # several slots in a row: as many waiters go
                await led.settle_attempt(lease, attempt_id, outcome="succeeded", cost="0")
            await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S)
            # Each served turn frees its slot for the next: waiters + slots freed in all. Each
            # wakes one waiter (the NOTIFY of this process's own settle no longer a second),
            # and a served waiter hands polling to the next; a wake-up is one more wait unless
            # it admits, and every waiter's last one does. Waking every waiter instead made
            # this grow with waiters * slots freed.
            more = sum(s.waits for s in sleepers) - waiters
            assert more <= 2 * (waiters + slots) - waiters, more
            for i in range(waiters):
                [att] = await led.timeline(f"w{i}")
                assert att.state is AttemptState.SUCCEEDED

    asyncio.run(main())


def test_a_woken_waiter_cancelled_before_it_begins_again_passes_the_slot_on(
        db_url: str, fake: FakeProvider) -> None:
    class _Stuck(_WokenOnly):
        """Woken, then stuck until cancelled: it never begins again."""

        async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                     poll_s: float) -> None:
            await super().asleep_until_woken(seconds, woken, poll_s)
            await asyncio.Event().wait()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            _only_a_signal_wakes(led.sync)
            route = _route(fake)
            [(lease, held)] = await _held(led, route, 1)
            first, second = _Stuck(), _WokenOnly()
            stuck = await _queue(led, route, "first", first)
            nxt = await _queue(led, route, "second", second)
            await led.settle_attempt(lease, held, outcome="succeeded", cost="0")
            await asyncio.wait_for(first.woken.wait(), PATIENCE_S)  # the earliest is woken
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck
            await asyncio.wait_for(nxt, PATIENCE_S)  # woken by a signal, not by polling
            [att] = await led.timeline("second")
            assert att.state is AttemptState.SUCCEEDED
            assert await led.timeline("first") == [] and _waiting(led.sync) == 0

    asyncio.run(main())


def test_slots_freed_in_a_row_wake_as_many_waiters_in_ticket_order(led: Ledger) -> None:
    waker = storage_of(led).waker
    tickets = {"third": 3, "first": 1, "second": 2, "elsewhere": 0}
    for w, t in tickets.items():  # joined out of ticket order
        assert waker.join("gb" if w == "elsewhere" else "ga", w, t)

    def woken() -> set[str]:
        return {w for w in tickets if (s := waker.signal(w)) is not None and s.event.is_set()}

    try:
        waker.poke("ga")
        waker.poke("ga")
        assert woken() == {"first", "second"}  # two slots: two waiters, the earliest
        waker.leave("first")  # woken, and gone before it began again: its wake passes on
        assert woken() == {"second", "third"}
        assert not waker.join("ga", "second", 5)  # begun again: a new place, same signal
        waker.poke(None)  # every group
        assert woken() == {"second", "third", "elsewhere"}
    finally:
        for w in tickets:
            waker.leave(w)


# -- only the earliest waiter of a group polls ------------------------------------------------


def test_only_the_earliest_waiter_of_a_group_polls_and_hands_over_when_it_leaves(
        led: Ledger) -> None:
    waker = storage_of(led).waker
    for w, t in {"second": 2, "first": 1, "third": 3}.items():
        assert waker.join("ga", w, t)

    def woken() -> set[str]:
        return {w for w in ("first", "second", "third")
                if (s := waker.signal(w)) is not None and s.event.is_set()}

    try:
        # Joining, at a begin each, wakes nobody; the earliest alone polls.
        assert woken() == set()
        assert [waker.interval(w) for w in ("first", "second", "third")] == [
            waker.poll_s, waker.idle_s, waker.idle_s]
        assert waker.idle_s == 20 * waker.poll_s
        waker.leave("first")  # served, cancelled or gave up: the next takes over polling
        assert woken() == {"second"} and waker.polls("second")
        waker.signal("second").clear()  # type: ignore[union-attr]
        assert not waker.join("ga", "second", 7)  # its place lapsed: taken anew, behind
        assert woken() == {"third"} and waker.polls("third") and not waker.polls("second")
    finally:
        for w in ("first", "second", "third"):
            waker.leave(w)


class _VirtualTime:
    """One clock for many turns' sleepers, moved by the test: a wait for a slot ends on a
    wake-up or once the clock passed the interval it was given. ``parked``: waits under way."""

    def __init__(self) -> None:
        self.now = 0.0
        self.moved = asyncio.Event()
        self.changed = asyncio.Event()
        self.parked: dict[int, float] = {}  # each wait under way: until when
        self._ids = 0

    def sleeper(self) -> _VirtualSleeper:
        return _VirtualSleeper(self)

    def advance(self, dt: float) -> int:
        """Move the clock on; how many waits are due."""
        self.now += dt
        moved, self.moved = self.moved, asyncio.Event()
        moved.set()
        return sum(until <= self.now for until in self.parked.values())

    async def until(self, test: Callable[[], bool]) -> None:
        while not test():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), PATIENCE_S)


class _VirtualSleeper:
    def __init__(self, clock: _VirtualTime) -> None:
        self.clock = clock
        self.waits = 0

    def sleep(self, seconds: float) -> None:  # pragma: no cover - nothing here backs off
        raise AssertionError("a queued turn slept on time")

    async def asleep(self, seconds: float) -> None:  # pragma: no cover - as sleep
        self.sleep(seconds)

    async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                 poll_s: float) -> None:
        c = self.clock
        c._ids += 1
        me, until = c._ids, c.now + min(seconds, poll_s)
        self.waits += 1
        c.parked[me] = until
        c.changed.set()
        try:
            while not woken.is_set() and c.now < until:
                signal = asyncio.ensure_future(woken.wait())
                moved = asyncio.ensure_future(c.moved.wait())
                await asyncio.wait({signal, moved}, timeout=PATIENCE_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                signal.cancel()
                moved.cancel()
        finally:
            del c.parked[me]
            c.changed.set()


class _Begins:
    """The store's driver, counting the begin transactions it runs."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.count = 0

    def run(self, tx: Any, *, write: bool, again: Any = None) -> Any:
        self.count += getattr(tx, "__name__", "") == "begin_tx"
        return self.inner.run(tx, write=write, again=again)  # type: ignore[attr-defined]

    async def arun(self, tx: Any, *, write: bool, again: Any = None) -> Any:
        self.count += getattr(tx, "__name__", "") == "begin_tx"
        return await self.inner.arun(tx, write=write, again=again)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_only_the_earliest_waiter_of_a_group_begins_each_polling_interval(
        db_url: str, fake: FakeProvider) -> None:
    # Every waiter used to poll: N waiters made N begins per polling interval, each a write
    # under the group's lock, though only the earliest could be served (first come, first
    # served). Now the others wait for a signal: one begin per interval.
    waiters, steps = 8, 5

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            store = storage_of(led.sync)
            route = _route(fake)
            [(lease, held)] = await _held(led, route, 1)
            clock = _VirtualTime()
            sleepers = [clock.sleeper() for _ in range(waiters)]
            tasks = []
            for i, s in enumerate(sleepers):
                tasks.append(asyncio.create_task(_turn(led, route, f"w{i}", s)))
                await clock.until(lambda n=i + 1: len(clock.parked) == n)
            begins = _Begins(store.runner.driver)
            store.runner.driver = begins  # type: ignore[assignment]
            try:
                for _ in range(steps):
                    due = clock.advance(store.waker.poll_s)
                    waits = sum(s.waits for s in sleepers)
                    await clock.until(lambda w=waits + due: (
                        sum(s.waits for s in sleepers) >= w and len(clock.parked) == waiters))
                assert begins.count == steps, begins.count  # the earliest's, once a step
                assert [s.waits for s in sleepers] == [1 + steps] + [1] * (waiters - 1)
                # The earliest gives up: the next is woken at once and polls in its stead.
                tasks[0].cancel()
                with pytest.raises(asyncio.CancelledError):
                    await tasks[0]
                # On PostgreSQL the departure's NOTIFY reaches this process's listener too,
                # which skips it (this process's own): it used to wake one more waiter, at a
                # moment the test could not know.
                await clock.until(lambda: sleepers[1].waits == 2 and len(clock.parked)
                                  == waiters - 1)
                begins.count = 0
                clock.advance(store.waker.poll_s)
                await clock.until(lambda: sleepers[1].waits == 3 and len(clock.parked)
                                  == waiters - 1)
                assert begins.count == 1
                assert [s.waits for s in sleepers[2:]] == [1] * (waiters - 2)
            finally:
                store.runner.driver = begins.inner  # type: ignore[assignment]
            await _served(led, lease, held, tasks[1:])

    asyncio.run(main())


async def _served(led: AsyncLedger, lease: object, held: str,
                  tasks: list[asyncio.Task[object]]) -> None:
    """Free the held slot: each served waiter's settle wakes the next, through signals."""
    await led.settle_attempt(lease, held, outcome="succeeded", cost="0")  # type: ignore
    for att in await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S):
        assert att.attempt.state is AttemptState.SUCCEEDED  # type: ignore[attr-defined]


async def _turn(led: AsyncLedger, route: Route, run_id: str, sleeper: object) -> object:
    async with led.run(run_id, plan=[route], budget=BUDGET, grant=GRANT) as run:
        return await run.turn(ENV, sleeper=sleeper)


# -- a slot freed in this process is heard once -------------------------------------------------


def _lose_ack(_name: str) -> None:
    raise DatabaseUnavailable("the acknowledgement of the commit was lost")


@pytest.mark.parametrize("path", ["close_run", "takeover", "orphans", "refused_adoption"])
def test_a_slot_freed_by_any_path_of_this_process_wakes_a_waiter_here_at_once(
        db_url: str, fake: FakeProvider, path: str) -> None:
    # These paths freed slots without waking a waiter of this process: on SQLite it heard at
    # its next poll, on PostgreSQL only through the trigger's NOTIFY, which is why this
    # process could not skip its own notifications (one spare begin per slot it freed).
    clock = ManualClock(90_000.0)
    route = _route(fake)
    with Ledger.open(db_url, clock=clock) as led:
        waker = storage_of(led).waker
        waker._listen = None  # no NOTIFY: only a wake-up of this process counts
        led.configure_group("ga", max_in_flight=1)
        led.admit_run("r", plan=[route], budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=10)
        if path == "refused_adoption":
            faults.arm("begin.after_commit", _lose_ack)
        try:
            led.begin_attempt(lease, route="a", envelope_hash="sha256:held", reserve="0",
                              attempt_id="att-1")
        except DatabaseUnavailable:
            assert path == "refused_adoption"
        finally:
            faults.disarm()
        clock.advance(11)  # the lease lapsed
        if path == "orphans":  # taken again without recovery: att-1 is left dispatching
            led.acquire_lease("r", ttl_s=60, executor_id="worker-2")
        if path == "refused_adoption":  # the begin retried once another Run filled the group
            led.admit_run("s", plan=[route], budget=BUDGET, grant=GRANT)
            other = led.acquire_lease("s", ttl_s=60, executor_id="w2")
            led.begin_attempt(other, route="a", envelope_hash="sha256:other", reserve="0")
            lease = led.acquire_lease("r", ttl_s=10)
        assert waker.join("ga", "waiter", 1)
        try:
            if path == "close_run":
                led.close_run("r", status="failed", reason="closed by the test")
            elif path == "takeover":
                assert [r.run_id for r in recover(led).runs] == ["r"]
            elif path == "orphans":
                assert recover(led).orphans == {"r": ["att-1"]}
            else:
                with pytest.raises(CapacityUnavailable) as ei:
                    led.begin_attempt(lease, route="a", envelope_hash="sha256:held",
                                      reserve="0", attempt_id="att-1")
                assert ei.value.fields["adoption"] is True
            assert led.group_projections(["ga"])["ga"].in_flight == (
                1 if path == "refused_adoption" else 0)
            signal = waker.signal("waiter")
            assert signal is not None and signal.event.is_set()
        finally:
            waker.leave("waiter")


class _Gated(_WokenOnly):
    """Woken, then held until the test opens its gate: it begins again only then, and its
    signal stays set meanwhile (a wake-up goes to the next waiter not woken yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.signal = asyncio.Event()

    async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                 poll_s: float) -> None:
        self.signal = woken
        await super().asleep_until_woken(seconds, woken, poll_s)
        await asyncio.wait_for(self.gate.wait(), PATIENCE_S)


@contextmanager
def _raw(pg_server: PgServer, pg_url: str) -> Iterator[Any]:
    """A connection of this process outside the ledger's pools: a backend of its own."""
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=pg_server.port, user=pg_server.user,
                         dbname=pg_url.rsplit("/", 1)[1], autocommit=True) as conn:
        yield conn


async def _heard(led: AsyncLedger, pg_server: PgServer, pg_url: str) -> None:
    """Return once the listener of ``led`` has handled every notification committed so far:
    one sent now is delivered after them, and wakes a waiter of a group of its own."""
    waker = storage_of(led.sync).waker
    assert waker.join("marker", "marker", 0)  # the listener runs already: no wait
    try:
        with _raw(pg_server, pg_url) as conn:
            conn.execute("SELECT pg_notify(%s, 'marker')", (QUEUE_CHANNEL,))
        marker = waker.signal("marker")
        assert marker is not None
        assert await asyncio.to_thread(marker.event.wait, PATIENCE_S)
    finally:
        waker.leave("marker")


@pytest.mark.postgres
def test_a_slot_freed_by_this_process_wakes_exactly_one_waiter_here(
        pg_server: PgServer, pg_url: str, fake: FakeProvider) -> None:
    # The settle woke the earliest waiter here, and then its own NOTIFY, heard by this
    # process's listener, woke the next one: one spare begin per freed slot.
    async def main() -> None:
        async with AsyncLedger.open(pg_url) as led:
            _only_a_signal_wakes(led.sync)
            route = _route(fake)
            [(lease, held)] = await _held(led, route, 1)
            first, second = _Gated(), _Gated()
            tasks = [await _queue(led, route, "first", first),
                     await _queue(led, route, "second", second)]
            await led.settle_attempt(lease, held, outcome="succeeded", cost="0")
            await _heard(led, pg_server, pg_url)
            assert first.signal.is_set() and not second.signal.is_set()
            first.gate.set()
            second.gate.set()
            for att in await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S):
                assert att.attempt.state is AttemptState.SUCCEEDED  # type: ignore[attr-defined]

    asyncio.run(main())


@pytest.mark.postgres
def test_a_slot_freed_through_a_connection_not_of_this_processs_pools_wakes_a_waiter(
        pg_server: PgServer, pg_url: str, fake: FakeProvider) -> None:
    # Only this process's pooled connections are skipped: another process's notifications,
    # or those of a connection of this process outside its pools, still wake its waiters.
    async def main() -> None:
        async with AsyncLedger.open(pg_url) as led:
            _only_a_signal_wakes(led.sync)
            route = _route(fake)
            [(_lease, held)] = await _held(led, route, 1)
            waiter = _WokenOnly()
            task = await _queue(led, route, "w", waiter)
            with _raw(pg_server, pg_url) as conn:
                conn.execute("DELETE FROM group_slots WHERE attempt_id = %s", (held,))
            await asyncio.wait_for(task, PATIENCE_S)  # woken by the trigger's NOTIFY alone
            assert waiter.waits == 1
            [att] = await led.timeline("w")
            assert att.state is AttemptState.SUCCEEDED

    asyncio.run(main())


@pytest.mark.postgres
def test_the_pids_of_this_processs_own_connections_are_forgotten_once_closed(
        pg_url: str) -> None:
    led = Ledger.open(pg_url)
    where = storage_of(led).waker.key
    try:
        led.configure_group("ga", max_in_flight=1)
        with storage_of(led).context.reading() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        assert pid in own_pids(where)
    finally:
        led.close()
    assert pid not in own_pids(where)


def _listening(pg_server: PgServer, pg_url: str) -> int:
    """The sessions listening on the queue channel in the test's database (this process's
    listeners: no other process uses the database)."""
    with _raw(pg_server, pg_url) as conn:
        return int(conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = %s", (f"LISTEN {QUEUE_CHANNEL}",)).fetchone()[0])


def _gone(pg_server: PgServer, pg_url: str) -> bool:
    """Whether the listening sessions are gone: closed by this process, they leave the
    server's view once their backend has exited, which the server does right after."""
    deadline = time.monotonic() + PATIENCE_S
    while _listening(pg_server, pg_url):
        if time.monotonic() > deadline:
            return False
    return True


@pytest.mark.postgres
def test_ledgers_on_one_database_share_one_listener_so_a_freed_slot_wakes_one_waiter(
        pg_server: PgServer, pg_url: str, fake: FakeProvider) -> None:
    # Each store opened a listening connection of its own: with two ledgers on one database
    # in one process, a slot another process freed was heard twice, and woke two waiters
    # here for one slot (one begin for nothing, under the group's lock).
    async def main() -> None:
        route = _route(fake)
        one = await AsyncLedger.open(pg_url)
        two = await AsyncLedger.open(pg_url)
        try:
            for led in (one, two):
                _only_a_signal_wakes(led.sync)
            [(_lease, held)] = await _held(one, route, 1)
            first, second = _Gated(), _Gated()
            tasks = [await _queue(one, route, "first", first),
                     await _queue(two, route, "second", second)]
            assert _listening(pg_server, pg_url) == 1
            with _raw(pg_server, pg_url) as conn:  # as another process's settle does
                conn.execute("DELETE FROM group_slots WHERE attempt_id = %s", (held,))
            await _heard(one, pg_server, pg_url)
            assert first.signal.is_set() and not second.signal.is_set()
            first.gate.set()
            second.gate.set()
            await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE_S)

            # The listener opened with the first ledger's connection settings; closing that
            # ledger leaves it to the other one's waiters.
            await two.admit_run("holder-two", plan=[route], budget=BUDGET, grant=GRANT)
            lease = await two.acquire_lease("holder-two", ttl_s=3600)
            held = (await two.begin_attempt(lease, route="a", envelope_hash="sha256:held",
                                            reserve="0")).attempt_id
            third = _WokenOnly()
            task = await _queue(two, route, "third", third)
            await one.close()
            with _raw(pg_server, pg_url) as conn:
                conn.execute("DELETE FROM group_slots WHERE attempt_id = %s", (held,))
            await asyncio.wait_for(task, PATIENCE_S)  # woken by the NOTIFY alone
            assert third.waits == 1
        finally:
            await one.close()
            await two.close()
        assert _gone(pg_server, pg_url)  # the last close stopped it

    asyncio.run(main())
