"""Retention and resumed Runs: an ended Run whose lease is live (a session resumed it, the
lease taken before its first begin makes it ``running`` again) is held, and its history stays,
so its next Attempt is numbered after the old ones; a lease that has expired by the ledger's
clock holds nothing. On PostgreSQL a lease taken between retention's checks and its drops is
found again under the drops' locks: either retention sees the lease or the lease sees the
trim, never neither. A begin that would number an Attempt from a trimmed history anyway (a
lease live by the session's clock, expired by retention's) is refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest

from ledger import Budget, Envelope, Grant, Ledger, Part, Price, Route
from ledger.clock import ManualClock
from ledger.errors import DatabaseUnavailable, InvalidState
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.testing import FakeProvider
from tests.audit.test_rollups import _sql

from .test_history_scales import HASH, ROUTE, _dump, _t

DAY = 86400.0
JAN, AUG = _t(2026, 1), _t(2026, 8, 5)
BUDGET = Budget(max_calls=9, max_retries=0, max_cost=1)


@pytest.fixture(scope="module")
def api() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


def _ended(led: Ledger, clock: ManualClock, name: str, when: float) -> None:
    """A Run ``name`` admitted at ``when`` with one succeeded Attempt, ended by its block
    (not closed: resumable) and its lease released."""
    clock.set(when)
    led.admit_run(name, plan=[ROUTE], budget=BUDGET)
    lease = led.acquire_lease(name, ttl_s=3600)
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)


def _attempt_rows(url: str, run_id: str) -> int:
    return int(_sql(url, f"SELECT count(*) FROM attempts WHERE run_id = '{run_id}'")[0][0])


def test_a_run_session_resuming_an_ended_run_holds_its_history_through_retention(
        db_url: str, api: FakeProvider) -> None:
    """The operator's audit: a Run ended two months ago is resumed by a Run session, and the
    retention cron runs before its first turn. The session's live lease holds the Run: its
    old Attempt stays, and the turn's Attempt is numbered 2, not 1 again."""
    price = Price(input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal("1.5"))
    routes = [Route(id="primary", provider="acme", model="model-a", group="acme",
                    recipient="acme", endpoint=api.endpoint("openai"), price=price)]
    terms: dict[str, Any] = {
        "plan": routes, "grant": Grant(recipients={"acme": ["user_input"]}),
        "budget": Budget(max_calls=8, max_retries=4, max_cost=Decimal("0.10"))}
    clock = ManualClock(JAN)
    with Ledger.open(db_url, clock=clock) as led:
        with led.run("old-1", **terms) as run:
            run.turn(Envelope(parts=[Part(content="first")]))
        assert led.get_run("old-1").status == "succeeded"
        clock.set(AUG)
        with led.run("old-1", **terms) as run:
            report = led.drop_history(60 * DAY, by="cron", reason="test")
            assert report.rows("attempts") == 0, report
            assert any(p.table == "attempts" and p.held and "lease" in p.held
                       for p in report.kept), report.kept
            run.turn(Envelope(parts=[Part(content="second")]))
        assert [a.seq for a in led.timeline("old-1")] == [1, 2]
        assert led.get_run("old-1").calls_used == 2
        books = reconcile(led)
        assert books.ok, books.violations


def test_a_lease_taken_with_acquire_lease_holds_an_ended_runs_history_through_retention(
        db_url: str) -> None:
    """The low-level API the same: ``acquire_lease`` on an ended Run, then retention, then a
    begin numbered after the Attempt of before; the report says why the rows stayed."""
    clock = ManualClock(JAN)
    with Ledger.open(db_url, clock=clock) as led:
        _ended(led, clock, "jan", JAN)
        clock.set(AUG)
        lease = led.acquire_lease("jan", ttl_s=3600)
        dry = led.drop_history(90 * DAY, dry_run=True)
        report = led.drop_history(90 * DAY, by="alice", reason="keep 90 days")
        for r in (dry, report):
            assert r.rows("attempts") == 0, r
            [kept] = [p for p in r.kept if p.table == "attempts"]
            assert kept.rows == 1 and kept.held is not None and "lease" in kept.held, kept
        assert _attempt_rows(db_url, "jan") == 1
        assert led.begin_attempt(lease, route="a", envelope_hash=HASH,
                                 reserve="0.01").seq == 2


def test_an_expired_lease_of_an_ended_run_does_not_hold_its_history(db_url: str) -> None:
    """Live by retention's clock is what holds: of two ended Runs leased again in August, the
    one whose lease is still live keeps its history, the one whose lease expired (by the
    ledger's clock, moved on past it) does not, and is refused as trimmed if leased again. The
    two are of different months, so on PostgreSQL each has a partition of its own."""
    clock = ManualClock(JAN)
    with Ledger.open(db_url, clock=clock) as led:
        _ended(led, clock, "jan", JAN)
        _ended(led, clock, "feb", _t(2026, 2))
        clock.set(AUG)
        led.acquire_lease("feb", ttl_s=600)  # lapses
        live = led.acquire_lease("jan", ttl_s=3 * 3600)
        clock.advance(3600)
        report = led.drop_history(90 * DAY, by="alice", reason="keep 90 days")
        assert report.rows("attempts") == 1, report
        assert (_attempt_rows(db_url, "jan"), _attempt_rows(db_url, "feb")) == (1, 0)
        assert led.begin_attempt(live, route="a", envelope_hash=HASH, reserve="0.01").seq == 2
        with pytest.raises(InvalidState) as ei:
            led.acquire_lease("feb", ttl_s=600)
        assert "its history may be gone" in str(ei.value), str(ei.value)


def test_a_begin_numbers_no_attempt_from_a_history_retention_dropped_under_its_lease(
        db_url: str) -> None:
    """Defence in depth, at no statement more: a lease retention counted as expired (its
    clock an hour ahead of the session's) did not hold the Run, yet the session's own clock
    says it is live. Its begin would number the Attempt 1 again from the Attempts left; it
    is refused (the Run counts more calls than it has Attempts), and nothing is written."""
    clock = ManualClock(JAN)
    with Ledger.open(db_url, clock=clock) as led:
        _ended(led, clock, "jan", JAN)
        clock.set(AUG)
        lease = led.acquire_lease("jan", ttl_s=1800)
        with Ledger.open(db_url, clock=ManualClock(AUG + 3600)) as ahead:
            assert ahead.drop_history(90 * DAY, by="cron", reason="test").rows("attempts") == 1
        before, run = _dump(db_url), led.get_run("jan")
        with pytest.raises(InvalidState) as ei:
            led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
        said = str(ei.value)
        assert "counts 1 model call(s) but has 0 Attempt(s) left" in said, said
        assert "admit the work as a new Run" in said, said
        assert ei.value.fields["run_id"] == "jan" and ei.value.fields["attempts_left"] == 0
        assert _dump(db_url) == before and led.get_run("jan") == run


def _lease_taken_meanwhile(monkeypatch: Any, other: Ledger, run_id: str) -> list[Any]:
    """Open a window in retention's run between its checks and its drops (it takes the real
    locks as ever): the first run lets ``other`` (another ledger, its own connections) take
    ``run_id``'s lease there and commit. Returns the leases taken."""
    from ledger.storage import retention

    take = retention._lock_as_writers_do
    taken: list[Any] = []

    def meanwhile(conn: Any) -> None:
        if not taken:
            taken.append(other.acquire_lease(run_id, ttl_s=3600))
        take(conn)

    monkeypatch.setattr(retention, "_lock_as_writers_do", meanwhile)
    return taken


@pytest.mark.postgres
def test_a_lease_taken_between_retentions_checks_and_its_drops_keeps_the_history(
        pg_url: str, monkeypatch: Any) -> None:
    """A session resumes the Run after retention checked its partition (not held then) and
    before the drops: retention checks again under the drops' locks, finds the lease, and
    fails having dropped and recorded nothing. The session's begin is numbered 2; the next
    retention run keeps the partition and says why."""
    clock = ManualClock(JAN)
    with Ledger.open(pg_url, clock=clock) as led, Ledger.open(pg_url, clock=clock) as other:
        _ended(led, clock, "jan", JAN)
        clock.set(AUG)
        taken = _lease_taken_meanwhile(monkeypatch, other, "jan")
        with pytest.raises(DatabaseUnavailable) as ei:
            led.drop_history(90 * DAY, by="cron", reason="test")
        said = str(ei.value)
        assert ei.value.fields["contention"] == "40001", ei.value.fields
        assert "attempts_p202601" in said and "resumed" in said, said
        assert "nothing was dropped or recorded" in said and "run it again" in said, said
        assert Audit(led).actions(kinds=["retention"]).items == []
        assert _attempt_rows(pg_url, "jan") == 1
        [lease] = taken
        assert led.begin_attempt(lease, route="a", envelope_hash=HASH,
                                 reserve="0.01").seq == 2
        again = led.drop_history(90 * DAY, by="cron", reason="test")
        assert again.rows("attempts") == 0, again
        assert {p.partition for p in again.kept} >= {"attempts_p202601", "events_p202601"}
        books = reconcile(led)
        assert books.ok, books.violations


@pytest.mark.postgres
def test_a_lease_asked_for_while_retention_drops_waits_and_sees_the_trim(
        pg_url: str, monkeypatch: Any) -> None:
    """The other order: a lease asked for once retention holds the drops' locks waits for
    its commit, then reads its ``retention`` event and is refused as trimmed; nothing of the
    Run is numbered from what is left."""
    from ledger.storage import retention

    clock = ManualClock(JAN)
    take = retention._lock_as_writers_do
    locked, asked = threading.Event(), threading.Event()

    def then_ask(conn: Any) -> None:
        take(conn)
        locked.set()
        assert asked.wait(60)

    with Ledger.open(pg_url, clock=clock) as led, Ledger.open(pg_url, clock=clock) as other, \
            ThreadPoolExecutor(1) as pool:
        _ended(led, clock, "jan", JAN)
        clock.set(AUG)
        monkeypatch.setattr(retention, "_lock_as_writers_do", then_ask)
        dropping = pool.submit(led.drop_history, 90 * DAY, by="cron", reason="test")
        assert locked.wait(60), "retention never took the drops' locks"
        with ThreadPoolExecutor(1) as asker:
            leasing = asker.submit(other.acquire_lease, "jan", ttl_s=3600)
            deadline = time.monotonic() + 60
            while not leasing.done() and not _sql(pg_url, (
                    "SELECT count(*) FROM pg_locks WHERE relation = 'runs'::regclass "
                    "AND NOT granted"))[0][0]:
                assert time.monotonic() < deadline, "the lease never waited for retention"
                time.sleep(0.01)  # polling another session's lock wait, not passing time
            asked.set()
            assert dropping.result(60).rows("attempts") == 1
            with pytest.raises(InvalidState) as ei:
                leasing.result(60)
        assert "its history may be gone" in str(ei.value), str(ei.value)
        assert led.get_run("jan").lease_holder is None
