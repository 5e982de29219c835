"""LeaseKeeper: renewal schedule, fenced-out signal, starvation-free renewal, graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path

import pytest

from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.lease import AsyncLeaseKeeper, KeeperCore, LeaseKeeper, LeaseLost
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.errors import FencedOut, InvalidArgument
from ledger.ops.recovery import recover
from tests.netfaults import closed_port
from tests.storage.helpers import budget, grant, routes


def _ledger(url: str, clock: ManualClock) -> Ledger:
    led = Ledger.open(url, clock=clock, executor_id="w1")
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    return led


def test_schedule_renews_every_third_and_learns_takeover(db_url: str) -> None:
    clock = ManualClock()
    led = _ledger(db_url, clock)
    lease = led.acquire_lease("r1", ttl_s=30)
    with pytest.raises(InvalidArgument):
        KeeperCore(led, lease, ttl_s=30, interval_s=11)
    k = KeeperCore(led, lease, ttl_s=30)
    assert k.tick() == pytest.approx(10)  # not due yet
    clock.advance(10)
    assert k.tick() == pytest.approx(10) and k.renewals == 1
    assert k.lease.expires_at == clock.now() + 30 and k.lease.fence == lease.fence
    # The process stalls past its lease; recovery takes the run over.
    clock.advance(31)
    assert recover(led).runs[0].run_id == "r1"
    assert k.tick() == float("inf")
    assert k.lost.is_set()
    with pytest.raises(FencedOut):
        k.check()
    led.close()


def test_a_lease_shorter_than_one_and_a_half_margins_is_renewed_before_the_margin(
        db_url: str) -> None:
    """Renewals are refused from the lease margin before the lease's end. The steady state
    renews with ``ttl - interval`` left (two thirds of the lease): for a lease of 0.6 s under
    the default 0.5 s margin that is 0.4 s, inside the margin, so every renewal was refused
    and a healthy keeper lost its Run. It renews a retry before the margin instead."""
    clock = ManualClock()
    led = _ledger(db_url, clock)
    assert led.lease_margin_s == 0.5
    lease = led.acquire_lease("r1", ttl_s=0.6)
    keeper = LeaseKeeper(led, lease, ttl_s=0.6, sleeper=clock)
    end = clock.now() + 10
    while clock.now() < end and not keeper.lost.is_set():
        clock.sleep(keeper.tick())
    assert not keeper.lost.is_set(), keeper.error
    assert keeper.renewals >= 10
    assert keeper.lease.expires_at - clock.now() > led.lease_margin_s
    led.close()


def test_a_lease_just_above_the_margin_is_kept_renewed(db_url: str) -> None:
    """No renewal comes sooner than a retry after the last one. A retry was a quarter interval
    (ttl/12), so a lease of 0.52 s under a 0.5 s margin had 0.477 s left at its first chance
    to renew, inside the margin: refused, and the Run lost. The retry is now short enough."""
    clock = ManualClock()
    led = _ledger(db_url, clock)
    lease = led.acquire_lease("r1", ttl_s=0.52)
    keeper = LeaseKeeper(led, lease, ttl_s=0.52, sleeper=clock)
    end = clock.now() + 5
    while clock.now() < end and not keeper.lost.is_set():
        clock.sleep(keeper.tick())
    assert not keeper.lost.is_set(), keeper.error
    assert keeper.lease.expires_at - clock.now() > led.lease_margin_s
    led.close()


def test_the_first_renewal_is_due_by_how_much_of_the_lease_is_left(db_url: str) -> None:
    """A keeper handed a lease that is partly run out renews it by its own end, when as much of
    it is left as after an interval of the steady state (here 20 of 30 s): one with 5 s left
    is renewed at once, not a whole interval later, when it would have lapsed."""
    clock = ManualClock()
    led = _ledger(db_url, clock)
    lease = led.acquire_lease("r1", ttl_s=30)
    clock.advance(5)  # 25 s left: due in 5 s, not 10
    assert KeeperCore(led, lease, ttl_s=30).tick() == pytest.approx(5)
    clock.advance(20)  # 5 s left: due at once
    keeper = LeaseKeeper(led, lease, ttl_s=30, sleeper=clock)
    assert keeper.tick() == pytest.approx(10) and keeper.renewals == 1
    assert keeper.lease.expires_at == clock.now() + 30 and keeper.lease.fence == lease.fence
    clock.advance(10)
    assert keeper.tick() == pytest.approx(10) and keeper.renewals == 2
    keeper.check()
    keeper.close()
    assert led.get_run("r1").lease_holder is None
    led.close()


def test_the_async_keeper_s_first_renewal_is_due_by_how_much_of_the_lease_is_left(
        db_url: str) -> None:
    clock = ManualClock()
    led = _ledger(db_url, clock)
    lease = led.acquire_lease("r1", ttl_s=30)
    clock.advance(25)

    async def main() -> None:
        keeper = AsyncLeaseKeeper(AsyncLedger(led), lease, ttl_s=30, sleeper=clock)
        assert await keeper.tick() == pytest.approx(10) and keeper.renewals == 1
        clock.advance(10)
        assert await keeper.tick() == pytest.approx(10) and keeper.renewals == 2
        keeper.check()
        await keeper.close()

    asyncio.run(main())
    assert led.get_run("r1").lease_holder is None
    led.close()


def test_unreachable_database_retries_then_lease_lost() -> None:
    # A real ledger whose PostgreSQL server is not there (a closed loopback port).
    clock = ManualClock()
    down = Ledger.open(f"postgresql+psycopg://ledger@127.0.0.1:{closed_port()}/ledger",
                       clock=clock, migrate_schema=False)
    lease = Lease("r1", "w1", 1, clock.now() + 30)
    k = KeeperCore(down, lease, ttl_s=30)
    clock.advance(10)
    assert k.tick() == pytest.approx(2.5)  # retried sooner than the interval
    while not k.lost.is_set():
        delay = k.tick()
        if not k.lost.is_set():
            clock.advance(delay)
    # Lost once a renewal could no longer be accepted, not at the lease's end.
    assert clock.now() == pytest.approx(lease.expires_at - down.lease_margin_s, abs=1e-6)
    assert k.failures >= 2
    with pytest.raises(LeaseLost):
        k.check()
    down.close()


def test_a_failing_keeper_retries_only_while_a_renewal_can_be_accepted_then_reports_it_lost(
        ) -> None:
    """Renewals are refused from ``lease_margin_s`` before the lease's end. The keeper whose
    renewals failed went on trying until the end itself (tries the database would refuse,
    had it answered) and reported the lease lost only then, while another process may
    already count it as ended: now its last try comes before that point, and the loss is
    reported at it."""
    clock = ManualClock()
    down = Ledger.open(f"postgresql+psycopg://ledger@127.0.0.1:{closed_port()}/ledger",
                       clock=clock, migrate_schema=False, lease_margin_s=5)
    lease = Lease("r1", "w1", 1, clock.now() + 30)
    deadline = lease.expires_at - 5  # the last moment a renewal is accepted
    keeper = LeaseKeeper(down, lease, ttl_s=30, sleeper=clock)
    tries: list[float] = []
    while not keeper.lost.is_set():
        failures, now = keeper.failures, clock.now()
        delay = keeper.tick()
        if keeper.failures > failures:
            tries.append(now)
        if not keeper.lost.is_set():
            clock.sleep(delay)  # as the keeper's own loop waits
    assert len(tries) >= 2 and max(tries) < deadline, tries
    assert clock.now() == pytest.approx(deadline, abs=1e-6)  # the tick that reported it lost
    with pytest.raises(LeaseLost) as ei:
        keeper.check()
    assert ei.value.fields["expires_at"] == lease.expires_at
    assert "can no longer be renewed" in str(ei.value)
    assert keeper.tick() == float("inf") and keeper.failures == len(tries)  # no more tries
    down.close()


def test_a_renewal_that_fails_otherwise_is_retried_then_the_lease_lost_never_a_dead_keeper(
        tmp_path: Path) -> None:
    """A renewal refused by the database for another reason than an outage (here a trigger
    that aborts it, as a read-only or corrupt file would) is tried again until the lease's
    end, then the keeper reports ``LeaseLost``: it never dies with the error,
    which left the Run looking kept while its lease ran out."""
    import sqlite3

    clock = ManualClock()
    path = tmp_path / "l.db"
    led = _ledger(f"sqlite:///{path}", clock)
    lease = led.acquire_lease("r1", ttl_s=30)
    fault = sqlite3.connect(path)
    fault.execute("CREATE TRIGGER no_renewal BEFORE UPDATE OF lease_expires_at ON runs "
                  "BEGIN SELECT RAISE(ABORT, 'the file refuses writes'); END")
    fault.commit()
    k = KeeperCore(led, lease, ttl_s=30)
    clock.advance(10)
    assert k.tick() == pytest.approx(2.5)  # tried again sooner than the interval
    assert not k.lost.is_set() and k.failures == 1
    while not k.lost.is_set():
        clock.advance(k.tick())
    with pytest.raises(LeaseLost):
        k.check()
    assert k.failures >= 2 and clock.now() >= lease.expires_at - led.lease_margin_s
    fault.close()
    led.close()


def test_thread_keeper_renews_while_the_call_blocks(tmp_path: Path) -> None:
    clock = ManualClock()
    led = _ledger(str(tmp_path / "l.db"), clock)
    lease = led.acquire_lease("r1", ttl_s=3)
    renewed = threading.Event()
    release = threading.Event()

    class Gate:
        def sleep(self, seconds: float) -> None:
            clock.advance(seconds)
            if keeper.renewals >= 5:
                renewed.set()
                release.wait(30)

        async def asleep(self, seconds: float) -> None:  # pragma: no cover
            self.sleep(seconds)

    keeper = LeaseKeeper(led, lease, ttl_s=3, sleeper=Gate())
    keeper.start()
    # "The LLM call": this thread is blocked the whole time; renewals go on regardless.
    assert renewed.wait(30)
    assert led.get_run("r1").lease_expires_at == keeper.lease.expires_at > lease.expires_at
    keeper.check()
    release.set()
    keeper.close()
    assert led.get_run("r1").lease_holder is None
    led.close()


def test_graceful_shutdown_settles_in_flight(db_url: str) -> None:
    clock = ManualClock()
    led = _ledger(db_url, clock)
    lease = led.acquire_lease("r1", ttl_s=30)
    unsent = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.1")
    sent = led.begin_attempt(lease, route="c", envelope_hash="sha256:2", reserve="0.2")
    keeper = LeaseKeeper(led, lease, ttl_s=30, sleeper=clock)
    keeper.track(unsent.attempt_id)
    keeper.track(sent.attempt_id)
    keeper.mark_sent(sent.attempt_id)
    keeper.close()  # never started: shutdown alone
    a = led.get_attempt(unsent.attempt_id)
    assert a.state is AttemptState.NOT_SENT and a.debit_state is DebitState.VOIDED
    b = led.get_attempt(sent.attempt_id)
    assert b.state is AttemptState.UNKNOWN and b.debit_state is DebitState.RESERVED
    run = led.get_run("r1")
    assert run.lease_holder is None and str(run.reserved) == "0.2"
    led.close()


def test_async_keeper_cancels_the_work_when_fenced(tmp_path: Path) -> None:
    clock = ManualClock()
    led = _ledger(str(tmp_path / "l.db"), clock)
    lease = led.acquire_lease("r1", ttl_s=3)
    clock.advance(4)
    led.acquire_lease("r1", ttl_s=3, executor_id="other")  # taken over meanwhile

    async def main() -> None:
        work = asyncio.create_task(asyncio.Event().wait())  # an LLM call that never returns
        keeper = AsyncLeaseKeeper(AsyncLedger(led), lease, ttl_s=3, sleeper=clock)
        keeper.watch(work)
        keeper.start()
        with pytest.raises(asyncio.CancelledError):
            await work
        with pytest.raises(FencedOut):
            keeper.check()
        await keeper.close()  # fenced: writes nothing, releases nothing

    asyncio.run(main())
    assert led.get_run("r1").lease_holder == "other"
    led.close()


def test_the_async_keeper_holds_no_watched_task_once_it_has_ended(tmp_path: Path) -> None:
    """A host watches every turn of a long Run: the finished turns are not kept alive by the
    keeper, and the turn still running is the one cancelled when the Run is lost."""
    clock = ManualClock()
    led = _ledger(str(tmp_path / "l.db"), clock)
    lease = led.acquire_lease("r1", ttl_s=3)

    async def main() -> None:
        keeper = AsyncLeaseKeeper(AsyncLedger(led), lease, ttl_s=3, sleeper=clock)

        async def turn() -> None:
            await asyncio.sleep(0)

        ended: list[weakref.ref[asyncio.Task[None]]] = []
        for _ in range(50):
            task = asyncio.create_task(turn())
            keeper.watch(task)
            await task
            ended.append(weakref.ref(task))
        del task
        await asyncio.sleep(0)  # the loop's handle that woke this task holds the last turn
        gc.collect()
        assert [r for r in ended if r() is not None] == []

        work = asyncio.create_task(asyncio.Event().wait())  # the turn in flight
        keeper.watch(work)
        clock.advance(4)
        led.acquire_lease("r1", ttl_s=3, executor_id="other")  # taken over meanwhile
        keeper.start()
        with pytest.raises(asyncio.CancelledError):
            await work
        await keeper.close()  # fenced: writes nothing, releases nothing

    asyncio.run(main())
    assert led.get_run("r1").lease_holder == "other"
    led.close()


KEEPER_MEMBERS = ("lease", "lost", "error", "renewals", "failures", "in_flight", "ttl_s",
                  "interval_s", "check", "track", "mark_sent", "untrack", "tick",
                  "shutdown_writes", "start", "stop", "close")


def test_the_async_keeper_offers_every_member_of_the_thread_keeper(db_url: str) -> None:
    """What a host reads or calls on a LeaseKeeper it finds on an AsyncLeaseKeeper (awaited
    where the sync one blocks), with the same values: a renewal and a graceful shutdown."""
    clock = ManualClock()
    led = _ledger(db_url, clock)
    lease = led.acquire_lease("r1", ttl_s=30)
    sent = led.begin_attempt(lease, route="c", envelope_hash="sha256:2", reserve="0.2")

    async def main() -> None:
        keeper = AsyncLeaseKeeper(AsyncLedger(led), lease, ttl_s=30, sleeper=clock)
        assert all(hasattr(keeper, m) for m in KEEPER_MEMBERS)
        assert all(hasattr(LeaseKeeper, m) or m in vars(KeeperCore(led, lease, ttl_s=30))
                   for m in KEEPER_MEMBERS)
        assert (keeper.ttl_s, keeper.interval_s, keeper.renewals, keeper.error) == (
            30, 10, 0, None)
        clock.advance(10)
        assert await keeper.tick() == 10
        assert keeper.renewals == 1 and keeper.failures == 0
        assert keeper.lease.expires_at == clock.now() + 30
        keeper.track(sent.attempt_id, sent=True)
        assert keeper.in_flight == {sent.attempt_id: True}
        await keeper.shutdown_writes()
        assert keeper.in_flight == {}

    asyncio.run(main())
    assert led.get_attempt(sent.attempt_id).state is AttemptState.UNKNOWN
    assert led.get_run("r1").lease_holder is None
    led.close()
