"""A Run session's lease: kept renewed for a turn however long it runs, and never left held.

A turn that outlives the lease it started with (a capacity queue, backoffs) sends with the
lease as its keeper last renewed it, not as it was when the turn began. An entry cancelled
while it takes the lease (or a sync one interrupted, even right after the lease's commit) gives
the lease back, and so does an entry of either kind failing with an ordinary error once the
lease is taken (right after its commit, or building its adapter); a Run admitted by an entry
cancelled before its lease is resumed by the next entry; an exit cancelled again and again still
finishes the Run and releases it, and so does a sync exit interrupted in its finish or release
(a second interruption is noted, and the exit is written at the ledger's close()). A Child whose
entry raised after its admission (which carved the parent's budget) is ended and gives the carve
back, unless a lease held it before (then it stays resumable), and when the database does not
take that ending, the parent's next write writes it; a session dropped without leaving
its block stops renewing its lease, which lapses for a takeover. The turns send with a function
(no provider is needed); both backends.
"""

from __future__ import annotations

import asyncio
import gc
import math
import threading
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import text

from ledger import (
    AsyncLedger,
    Budget,
    Dispatch,
    Envelope,
    Grant,
    Ledger,
    Part,
    RunRecord,
    RunStatus,
    SendResult,
    faults,
)
from ledger.clock import ManualClock
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.records import AttemptState
from ledger.errors import DatabaseUnavailable, InvalidState, NotFound, SettleConflict
from ledger.policy.load import preset
from ledger.policy.model import StreamingPolicy
from ledger.testing import Fault
from tests import fakeplan
from tests.fakeplan import cancelled_often, plan
from tests.storage.helpers import impatient_url, sql_context

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])
TTL = 3.0
LAG = 0.6  # between a begin and its send: longer than the lease margin (0.5 s)


def _unavailable(d: Dispatch) -> SendResult:
    return SendResult.failed(Observation(status=503, protocol=WireProtocol.OPENAI,
                                         provider=d.route.provider))


OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)


async def _served(_d: Dispatch) -> SendResult:
    return OK


def _lag(clock: ManualClock) -> None:
    # The second Attempt's begin is followed by a stalled loop (other tasks' work).
    faults.arm("dispatch.before_send", lambda _p: clock.advance(LAG), on_hit=2)


def test_a_turn_that_outlives_its_starting_lease_sends_under_the_keepers_renewal(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(70_000.0)
    sent: list[str] = []
    with Ledger.open(db_url, clock=clock) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                     lease_ttl_s=TTL) as run:

            def send(d: Dispatch) -> SendResult:
                sent.append(d.route.id)
                if len(sent) > 1:
                    return OK
                for _ in range(2):  # 4 s of a 3 s lease, the keeper renewing it meanwhile
                    clock.advance(2.0)
                    run._keeper.tick()
                return _unavailable(d)

            _lag(clock)
            try:
                result = run.turn(HELLO, send=send)
            finally:
                faults.disarm()
            assert result.output == "ok" and len(sent) == 2
        assert [a.state for a in led.timeline("r")] == [AttemptState.FAILED,
                                                        AttemptState.SUCCEEDED]


def test_an_async_turn_that_outlives_its_starting_lease_sends_under_the_keepers_renewal(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(70_000.0)
    sent: list[str] = []

    async def main() -> list[AttemptState]:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                               lease_ttl_s=TTL) as run:

                async def send(d: Dispatch) -> SendResult:
                    sent.append(d.route.id)
                    if len(sent) > 1:
                        return OK
                    for _ in range(2):  # 4 s of a 3 s lease, the keeper renewing it meanwhile
                        clock.advance(2.0)
                        await run._keeper.tick()
                    return _unavailable(d)

                _lag(clock)
                try:
                    result = await run.turn(HELLO, send=send)
                finally:
                    faults.disarm()
                assert result.output == "ok" and len(sent) == 2
            return [a.state for a in await led.timeline("r")]

    assert asyncio.run(main()) == [AttemptState.FAILED, AttemptState.SUCCEEDED]


class _CancelsEntry(ManualClock):
    """A clock whose ``at``-th reading (0: none) cancels ``task``, from whatever thread reads
    it: a cancellation landing there, in the middle of the entry's writes."""

    def __init__(self, t: float) -> None:
        super().__init__(t)
        self.at, self.reads = 0, 0
        self.task: asyncio.Task[Any] | None = None

    def now(self) -> float:
        self.reads += 1
        if self.task is not None and self.reads == self.at:
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)
        return super().now()


def test_a_cancelled_entry_leaves_the_run_without_a_held_lease(db_url: str, fake: Any) -> None:
    # The cancellation lands at each clock reading of the entry in turn (admission, the lease's
    # acquisition): wherever it lands, no lease stays held by an entry whose block never ran.
    clock = _CancelsEntry(80_000.0)

    async def main() -> list[int]:
        fences = []
        async with AsyncLedger.open(db_url, clock=clock) as led:
            for at in range(1, 12):
                run_id = f"r{at}"

                async def enter(run_id: str = run_id) -> None:
                    async with led.run(run_id, plan=plan(fake), budget=BUDGET, grant=GRANT):
                        pass

                clock.reads, clock.at = 0, at
                clock.task = asyncio.ensure_future(enter())
                try:
                    await clock.task
                except asyncio.CancelledError:
                    pass
                else:
                    break  # the entry reads the clock fewer times: every reading was tried
                finally:
                    clock.task = None
                try:
                    rec = await led.get_run(run_id)
                except NotFound:
                    continue  # cancelled before the Run was admitted
                assert rec.lease_holder is None, f"cancelled at reading {at}"
                fences.append(rec.fence)
        return fences

    # The scene happened: a cancelled entry's acquisition committed (the fence moved on).
    assert any(f > 0 for f in asyncio.run(main()))


class _CancelsAdmission(ManualClock):
    """A clock that cancels ``task`` when the admission's transaction reads it (the first
    reading off the event loop's thread): the admission goes on to commit in its worker
    thread, and the entry that waited for it is cancelled before it takes the lease."""

    def __init__(self, t: float) -> None:
        super().__init__(t)
        self.task: asyncio.Task[Any] | None = None

    def now(self) -> float:
        task = self.task
        if task is not None and threading.current_thread() is not threading.main_thread():
            self.task = None
            task.get_loop().call_soon_threadsafe(task.cancel)
        return super().now()


def test_a_run_admitted_by_an_entry_cancelled_before_its_lease_is_resumed_by_the_next_entry(
        db_url: str, fake: Any) -> None:
    # The admission commits, the entry is cancelled before it takes the lease: the Run stays
    # admitted with no lease (nothing to give back, no Attempt), and the next entry with the
    # same id and content resumes it, the same Run: admitted once, leased for the first time.
    clock = _CancelsAdmission(80_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            async def enter() -> None:
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                    raise AssertionError("the cancelled entry's block never runs")

            clock.task = asyncio.ensure_future(enter())
            with pytest.raises(asyncio.CancelledError):
                await clock.task
            assert clock.task is None  # the cancellation came from inside the admission
            for _ in range(600):  # bounded: until the admission's thread has committed
                try:
                    left = await led.get_run("r")
                    break
                except NotFound:
                    await asyncio.sleep(0.05)
            assert (left.status, left.lease_holder, left.fence) == (RunStatus.ADMITTED, None, 0)
            assert await led.timeline("r") == []
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                assert run.record is not None and run.record.created_at == left.created_at
                assert run.lease.fence == 1
                assert (await run.turn(HELLO, send=_served)).output == "ok"
            done = await led.get_run("r")
            assert (done.status, done.lease_holder) == (RunStatus.SUCCEEDED, None)
            assert [e.kind for e in await led.events("r", ["admit"])] == ["admit"]

    asyncio.run(main())


class _InterruptsEntry(ManualClock):
    """A clock whose ``at``-th reading (0: none) on the entering thread raises
    ``KeyboardInterrupt``: a Ctrl-C landing there, in the middle of a sync entry's writes (the
    lease keeper's thread reads it too, and is left alone)."""

    def __init__(self, t: float) -> None:
        super().__init__(t)
        self.at, self.reads = 0, 0
        self.thread = threading.current_thread()

    def now(self) -> float:
        if threading.current_thread() is self.thread:
            self.reads += 1
            if self.reads == self.at:
                raise KeyboardInterrupt
        return super().now()


def _enters_at_once(db_url: str, clock: ManualClock, run_id: str, fake: Any) -> None:
    """Another executor enters the Run at once (the clock has not moved: a lease left held
    would still be live, and refuse it with LeaseHeld)."""
    with Ledger.open(db_url, clock=clock, executor_id="other-worker",
                     migrate_schema=False) as other, \
            other.run(run_id, plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        assert run.lease.executor == "other-worker"


def test_an_interrupted_sync_entry_leaves_the_run_without_a_held_lease(
        db_url: str, fake: Any) -> None:
    # KeyboardInterrupt lands at each clock reading of the sync entry in turn (admission, the
    # lease's acquisition, the keeper's start right after its commit): wherever it lands, no
    # lease stays held by an entry whose block never ran.
    clock = _InterruptsEntry(80_000.0)
    fences = []
    with Ledger.open(db_url, clock=clock) as led:
        for at in range(1, 12):
            run_id = f"r{at}"
            clock.reads, clock.at = 0, at
            try:
                with led.run(run_id, plan=plan(fake), budget=BUDGET, grant=GRANT):
                    clock.at = 0  # the entry is over; its exit is not what this tests
            except KeyboardInterrupt:
                pass
            else:
                break  # the entry reads the clock fewer times: every reading was tried
            finally:
                clock.at = 0
            try:
                rec = led.get_run(run_id)
            except NotFound:
                continue  # interrupted before the Run was admitted
            assert rec.lease_holder is None, f"interrupted at reading {at}"
            fences.append(rec.fence)
            _enters_at_once(db_url, clock, run_id, fake)
    # The scene happened: an interrupted entry's acquisition committed (the fence moved on).
    assert any(f > 0 for f in fences)


def test_a_sync_entry_interrupted_right_after_the_lease_commits_gives_it_back(
        db_url: str, fake: Any) -> None:
    # The acquisition committed, and the interruption lands before it returns the lease: the
    # entry learns what it took by acquiring once more (the same write), then releases it.
    def ctrl_c(_point: str) -> None:
        raise KeyboardInterrupt

    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        faults.arm("acquire.after_commit", ctrl_c)
        try:
            with pytest.raises(KeyboardInterrupt), \
                    led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                pass  # pragma: no cover - the entry raised
        finally:
            faults.disarm()
        rec = led.get_run("r")
        assert rec.fence == 1 and rec.lease_holder is None  # taken (once), released
        _enters_at_once(db_url, clock, "r", fake)


def _hold_run_lock(db_url: str, run_id: str, locked: threading.Event,
                   release: threading.Event) -> None:
    """Another transaction holding the Run's row lock (SQLite: the database's write lock)."""
    with Ledger.open(db_url, migrate_schema=False) as other, \
            sql_context(other).writing() as conn:
        if other.backend == "postgresql":
            conn.execute(text("SELECT run_id FROM runs WHERE run_id = :r FOR UPDATE"),
                         {"r": run_id})
        locked.set()
        release.wait(60)


@pytest.mark.parametrize("cancels", [3, 5])
def test_a_block_cancelled_again_and_again_while_leaving_still_finishes_and_releases(
        db_url: str, fake: Any, cancels: int) -> None:
    # The first cancellation leaves the block; the others land while its exit waits for the
    # database (another transaction holds the Run's lock): the exit still ends the Run.
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            served = asyncio.Event()

            async def agent() -> None:
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                    await run.turn(HELLO, send=_served)
                    served.set()
                    await asyncio.sleep(600)

            task = asyncio.ensure_future(agent())
            await served.wait()
            locked, release = threading.Event(), threading.Event()
            holder = threading.Thread(target=_hold_run_lock,
                                      args=(db_url, "r", locked, release))
            holder.start()
            try:
                assert await asyncio.to_thread(locked.wait, 30)
                asyncio.get_running_loop().call_later(1.0, release.set)
                await cancelled_often(task, cancels, gap_s=0.1)
            finally:
                release.set()
                await asyncio.to_thread(holder.join)
            rec = await led.get_run("r")
            assert rec.status is RunStatus.CANCELLED and rec.lease_holder is None

    asyncio.run(main())


def _written_by_itself(db_url: str, run_id: str) -> RunRecord:
    """The Run once its exit is written, read by another ledger: nothing of the one whose
    session left it is used meanwhile (no write for the Run, no close)."""
    with Ledger.open(db_url, migrate_schema=False) as other:
        for _ in range(400):  # up to 20 s: a retry comes every second (TTL_EXIT / 12)
            rec = other.get_run(run_id)
            if rec.lease_holder is None:
                return rec
            threading.Event().wait(0.05)  # for the writer's thread, not for time to pass
        return rec


TTL_EXIT = 12.0  # a retry every second, and many before the lease is near its end


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_exit_the_database_refused_is_written_as_soon_as_it_answers_without_another_write(
        db_url: str, fake: Any, request: pytest.FixtureRequest, mode: str) -> None:
    """The block succeeded; its exit waited for a lock another transaction held and was
    refused (``DatabaseUnavailable``, remembered). Once the lock is free, the process writes
    the exit by itself, before the lease lapses: the Run ends ``succeeded`` with its lease
    released, with no further write for the Run and no close() to carry it."""
    impatient = impatient_url(db_url, request)
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(db_url, "r", locked, release))
    raised: list[DatabaseUnavailable] = []

    def leave_refused(e: DatabaseUnavailable) -> None:
        raised.append(e)
        release.set()  # the database answers again
        holder.join()

    if mode == "sync":
        with Ledger.open(impatient) as led:
            try:
                with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                             lease_ttl_s=TTL_EXIT) as run:
                    run.turn(HELLO, send=_served_sync)
                    holder.start()
                    assert locked.wait(30)
            except DatabaseUnavailable as e:
                leave_refused(e)
            rec = _written_by_itself(db_url, "r")
    else:
        async def main() -> RunRecord:
            async with AsyncLedger.open(impatient) as led:
                try:
                    async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                                       lease_ttl_s=TTL_EXIT) as run:
                        await run.turn(HELLO, send=_served)
                        holder.start()
                        assert await asyncio.to_thread(locked.wait, 30)
                except DatabaseUnavailable as e:
                    await asyncio.to_thread(leave_refused, e)
                return await asyncio.to_thread(_written_by_itself, db_url, "r")

        rec = asyncio.run(main())
    [error] = raised
    assert error.fields["deferred"] is True
    assert "from a thread that tries again" in "\n".join(getattr(error, "__notes__", []))
    assert rec.status is RunStatus.SUCCEEDED and rec.lease_holder is None


def test_an_exit_the_database_keeps_refusing_is_tried_no_longer_than_its_lease_can_take_it(
        db_url: str, fake: Any, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    """While the database stays away, the thread trying the exit stops at the ledger's margin
    before the lease's end (a finish is refused from there on), saying so: no thread is left
    trying for ever."""
    impatient = impatient_url(db_url, request)
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_run_lock, args=(db_url, "r", locked, release))
    try:
        with Ledger.open(impatient) as led:
            with pytest.raises(DatabaseUnavailable), \
                    led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                            lease_ttl_s=TTL) as run:
                run.turn(HELLO, send=_served_sync)
                holder.start()
                assert locked.wait(30)
            writers = [t for t in threading.enumerate() if t.name == "ledger-exit"]
            assert len(writers) == 1
            writers[0].join(TTL + 10)  # it ends by itself, before the lease's end
            assert not writers[0].is_alive()
            assert "could not be written before the lease's end" in caplog.text
    finally:
        release.set()
        if holder.is_alive():
            holder.join()


def test_a_cancellation_landing_while_the_database_refuses_the_exit_is_raised_not_lost(
        db_url: str, fake: Any, request: pytest.FixtureRequest) -> None:
    """The block succeeded; its exit waited for a lock another transaction held and was
    refused (``DatabaseUnavailable``, remembered for later) while the task was cancelled: the
    task ended with that error, not cancelled, and ``asyncio.timeout`` raised no
    ``TimeoutError``. The cancellation propagates, the refusal noted on it."""
    impatient = impatient_url(db_url, request)
    notes: list[str] = []

    async def main() -> None:
        async with AsyncLedger.open(impatient) as led:
            locked, release, leaving = threading.Event(), threading.Event(), asyncio.Event()
            holder = threading.Thread(target=_hold_run_lock, args=(db_url, "r", locked, release))

            async def agent() -> None:
                try:
                    async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                        await run.turn(HELLO, send=_served)
                        holder.start()
                        assert await asyncio.to_thread(locked.wait, 30)
                        leaving.set()  # the exit starts, and waits for the lock
                except asyncio.CancelledError as e:
                    notes.extend(getattr(e, "__notes__", []))
                    raise

            task = asyncio.ensure_future(agent())
            try:
                await leaving.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert task.cancelled()
            finally:
                release.set()
                await asyncio.to_thread(holder.join)
        # The exit was remembered, and the ledger's close wrote it (the lease had not lapsed).
        async with AsyncLedger.open(db_url) as led:
            rec = await led.get_run("r")
            assert rec.status is RunStatus.SUCCEEDED and rec.lease_holder is None

    asyncio.run(main())
    (note,) = [n for n in notes if "finishing run 'r'" in n]
    assert "DatabaseUnavailable" in note and "close()" in note


def _ctrl_c(_point: str) -> None:
    raise KeyboardInterrupt


def _served_sync(_d: Dispatch) -> SendResult:
    return OK


def _finished_once(led: Ledger, run_id: str, status: RunStatus) -> None:
    """The Run ended ``status`` by one finish, holds no lease, and nothing of it is left for
    later (its exit was resolved before the interruption propagated)."""
    rec = led.get_run(run_id)
    assert rec.status is status and rec.lease_holder is None
    assert [e.data["status"] for e in led.events(run_id, ["finish"])] == [status.value]
    assert not led._store.pending.of(run_id)


@pytest.mark.parametrize("point", ["finish.before_commit", "finish.after_commit"])
def test_a_sync_exit_interrupted_in_its_finish_still_finishes_and_releases(
        db_url: str, fake: Any, point: str) -> None:
    # A Ctrl-C lands in the exit's finish, before its commit (rolled back) or right after it
    # (committed, not returned): the exit completes its finish and release once more, then
    # the interruption propagates. Another executor enters at once (the clock has not moved).
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        try:
            with pytest.raises(KeyboardInterrupt), \
                    led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                run.turn(HELLO, send=_served_sync)
                faults.arm(point, _ctrl_c)
        finally:
            faults.disarm()
        assert run.ended is RunStatus.SUCCEEDED
        _finished_once(led, "r", RunStatus.SUCCEEDED)
        _enters_at_once(db_url, clock, "r", fake)


def test_a_sync_exit_interrupted_anywhere_still_finishes_and_releases(
        db_url: str, fake: Any) -> None:
    # KeyboardInterrupt lands at each clock reading of the sync exit in turn (the finish's,
    # the release's): wherever it lands, the Run ends as its block did and no lease stays held.
    clock = _InterruptsEntry(80_000.0)
    landed = 0
    with Ledger.open(db_url, clock=clock) as led:
        for at in range(1, 12):
            run_id = f"r{at}"
            try:
                with led.run(run_id, plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                    run.turn(HELLO, send=_served_sync)
                    clock.reads, clock.at = 0, at
            except KeyboardInterrupt:
                landed += 1
            else:
                break  # the exit reads the clock fewer times: every reading was tried
            finally:
                clock.at = 0
            _finished_once(led, run_id, RunStatus.SUCCEEDED)
            _enters_at_once(db_url, clock, run_id, fake)
    assert landed >= 2  # the scene happened: in the finish, and in the release


def test_a_sync_exit_interrupted_twice_notes_it_and_writes_the_exit_later(
        db_url: str, fake: Any) -> None:
    # The second try is interrupted too (right after its finish commits): the interruption
    # propagates with a note saying what is left, and the exit is written once all the same:
    # by the thread that tries it again (ExitWriter), or else by the ledger's close().
    clock = ManualClock(80_000.0)
    led = Ledger.open(db_url, clock=clock)
    try:
        with pytest.raises(KeyboardInterrupt) as caught, \
                led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            run.turn(HELLO, send=_served_sync)
            faults.arm("finish.before_commit", _ctrl_c)  # the first try: rolled back
            faults.arm("finish.after_commit", _ctrl_c)  # the second: committed, not returned
    finally:
        faults.disarm()
    assert any("interrupted again" in n and "a thread that tries again" in n and "close()" in n
               for n in getattr(caught.value, "__notes__", []))
    led.close()
    with Ledger.open(db_url, clock=clock, migrate_schema=False) as again:
        _finished_once(again, "r", RunStatus.SUCCEEDED)
    _enters_at_once(db_url, clock, "r", fake)


def test_a_turn_its_block_left_under_is_told_why_its_answer_was_not_recorded(
        db_url: str, fake: Any) -> None:
    # A thread still waiting on the provider when the block is left: the exit records its
    # Attempt unknown and ends the Run, so the turn's own settle is refused. The turn's caller
    # hears that, and the fix, not a storage rule (SettleConflict) it did nothing to break.
    on_wire, answer = threading.Event(), threading.Event()
    caught: list[BaseException] = []

    def send(_d: Dispatch) -> SendResult:
        on_wire.set()
        answer.wait(30)
        return OK

    with Ledger.open(db_url) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:

            def work() -> None:
                try:
                    run.turn(HELLO, send=send)
                except BaseException as e:  # what the turn raised, read below
                    caught.append(e)

            worker = threading.Thread(target=work)
            worker.start()
            assert on_wire.wait(30)
        answer.set()
        worker.join(30)
        [err] = caught
        assert isinstance(err, InvalidState), repr(err)
        assert "was left while this turn's request was in flight" in str(err)
        assert isinstance(err.__cause__, SettleConflict)
        [att] = led.timeline("r")
        assert att.state is AttemptState.UNKNOWN and err.fields["attempt_id"] == att.attempt_id
        assert led.get_run("r").status is RunStatus.CANCELLED
        assert [e.kind for e in led.events("r", ["late_receipt"])] == ["late_receipt"]


def test_an_async_turn_its_block_left_under_is_told_why_its_answer_was_not_recorded(
        db_url: str, fake: Any) -> None:
    async def main() -> None:
        on_wire, answer = asyncio.Event(), asyncio.Event()

        async def send(_d: Dispatch) -> SendResult:
            on_wire.set()
            await answer.wait()
            return OK

        async with AsyncLedger.open(db_url) as led:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                task = asyncio.ensure_future(run.turn(HELLO, send=send))
                await on_wire.wait()
            answer.set()
            with pytest.raises(InvalidState, match="left while this turn's request") as got:
                await task
            assert isinstance(got.value.__cause__, SettleConflict)
            [att] = await led.timeline("r")
            assert att.state is AttemptState.UNKNOWN
            assert (await led.get_run("r")).status is RunStatus.CANCELLED

    asyncio.run(main())


def _closed_under_it(receipt: Any) -> None:
    """A late receipt of a send whose client the session closed: the ledger's own doing."""
    fact = receipt.data["fact"]
    assert (fact["category"], fact["source"]) == ("cancelled", "local")
    assert "closed while this call was in flight" in fact["message"]


def test_an_answer_cut_by_closing_the_adapter_is_unknown_with_its_hold_kept(
        db_url: str, fake: Any) -> None:
    # A host closes the adapter it shares between sessions while a streamed answer is coming:
    # the provider may go on generating (and billing), so the Attempt is unknown, its hold
    # kept for reconciliation, as after the caller's own cancellation; not a failure posted
    # at what little it had reported.
    from ledger.adapters import HttpAdapter
    from ledger.errors import FailoverExhausted
    from ledger.testing import Behavior

    fake.enqueue(Behavior(fault=Fault.TRICKLE, delay_s=0.05))

    async def main() -> None:
        adapter = HttpAdapter()
        got: list[str] = []
        async with AsyncLedger.open(db_url) as led:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                               adapter=adapter) as run:
                task = asyncio.ensure_future(run.turn(
                    Envelope(parts=[Part(content="hi")], stream=True), on_text=got.append))
                while not got:
                    await asyncio.sleep(0.005)
                await adapter.aclose()
                with pytest.raises(FailoverExhausted):
                    await task
            [att] = await led.timeline("r")
            assert att.state is AttemptState.UNKNOWN and att.debit_state == "reserved"
            assert att.fact is not None and att.fact.category.value == "cancelled"

    asyncio.run(main())


def test_an_async_turn_its_block_left_under_is_a_local_cancellation_not_a_provider_reset(
        db_url: str, fake: Any) -> None:
    # The session's own adapter is closed when the block is left, under the request still
    # waiting on the provider: what the socket raised then (a ReadError) is the ledger's
    # doing, and its late receipt says so, not that the provider reset the connection.
    fake.enqueue(Fault.NO_RESPONSE)

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                task = asyncio.ensure_future(run.turn(HELLO))
                while not fake.requests:
                    await asyncio.sleep(0.005)
            with pytest.raises(InvalidState, match="left while this turn's request"):
                await task
            [att] = await led.timeline("r")
            assert att.state is AttemptState.UNKNOWN
            [receipt] = await led.events("r", ["late_receipt"])
            _closed_under_it(receipt)

    asyncio.run(main())


def test_a_turn_its_block_left_under_is_a_local_cancellation_not_a_provider_reset(
        db_url: str, fake: Any) -> None:
    # The same with a thread's turn, on the session's blocking adapter. Closing a blocking
    # client shuts its connections down, which wakes the thread blocked in its read (the
    # read limit, short here, is only a backstop), and what it then records is still the
    # ledger's doing, not a reset of the provider's.
    fake.enqueue(Fault.NO_RESPONSE)
    short = preset("failure-domain").model_copy(update={"streaming": StreamingPolicy(
        read_timeout_s=2.0)})
    caught: list[BaseException] = []
    with Ledger.open(db_url) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, policy=short) as run:

            def work() -> None:
                try:
                    run.turn(HELLO)
                except BaseException as e:  # what the turn raised, read below
                    caught.append(e)

            worker = threading.Thread(target=work)
            worker.start()
            while not fake.requests:
                threading.Event().wait(0.005)
        worker.join(30)
        [err] = caught
        assert isinstance(err, InvalidState), repr(err)
        [receipt] = led.events("r", ["late_receipt"])
        _closed_under_it(receipt)


class _Misconfigured(RuntimeError):
    """An ordinary error of an entry once its lease is taken (a driver fault, an adapter
    that cannot be built)."""


def _fails(_point: str) -> None:
    raise _Misconfigured("the acquisition's driver failed after its commit")


class _BrokenAdapter:
    """An adapter whose construction raises: the entry has taken the lease and started its
    keeper by then."""

    def __init__(self, **_options: Any) -> None:
        cause = ValueError("no such CA bundle")
        raise _Misconfigured("the session's adapter cannot be built") from cause


async def _enters_at_once_async(db_url: str, clock: ManualClock, run_id: str,
                                fake: Any) -> None:
    """:func:`_enters_at_once`, for an AsyncLedger of another executor."""
    async with AsyncLedger.open(db_url, clock=clock, executor_id="other-worker",
                                migrate_schema=False) as other, \
            other.run(run_id, plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        assert run.lease.executor == "other-worker"


def _given_back(rec: Any) -> None:
    """The Run as it was before the entry (admitted, no Attempt), its lease taken once and
    released."""
    assert (rec.status, rec.lease_holder, rec.fence) == (RunStatus.ADMITTED, None, 1)


def test_a_sync_entry_failing_right_after_the_lease_commits_gives_it_back(
        db_url: str, fake: Any) -> None:
    # An ordinary exception (not an interruption) lands after the acquisition's commit: the
    # entry learns what it took by acquiring once more, releases it, and raises it unchanged.
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        faults.arm("acquire.after_commit", _fails)
        try:
            with pytest.raises(_Misconfigured) as caught, \
                    led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                pass  # pragma: no cover - the entry raised
        finally:
            faults.disarm()
        assert not getattr(caught.value, "__notes__", None)  # given back: nothing to note
        _given_back(led.get_run("r"))
        assert led.timeline("r") == []
        _enters_at_once(db_url, clock, "r", fake)


def test_a_sync_entry_whose_adapter_cannot_be_built_gives_its_lease_back(
        db_url: str, fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import ledger.adapters

    monkeypatch.setattr(ledger.adapters, "SyncAdapter", _BrokenAdapter)
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        with pytest.raises(_Misconfigured) as caught, \
                led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
            pass  # pragma: no cover - the entry raised
        assert isinstance(caught.value.__cause__, ValueError)  # its cause chain intact
        _given_back(led.get_run("r"))
        monkeypatch.undo()
        _enters_at_once(db_url, clock, "r", fake)


@pytest.mark.parametrize("started", [False, True])
def test_a_sync_entry_interrupted_while_its_lease_keeper_starts_gives_the_lease_back(
        db_url: str, fake: Any, monkeypatch: pytest.MonkeyPatch, started: bool) -> None:
    # A Ctrl-C lands in Thread.start's wait for the keeper's thread: the thread never ran, or
    # runs already. Either way the entry stops it and releases the lease it took.
    start = threading.Thread.start

    def interrupted(thread: threading.Thread) -> None:
        if thread.name != "ledger-lease":
            start(thread)
            return
        if started:
            start(thread)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        with pytest.raises(KeyboardInterrupt) as caught, \
                led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
            pass  # pragma: no cover - the entry raised
        assert not getattr(caught.value, "__notes__", None)  # given back: nothing to note
        _given_back(led.get_run("r"))
        monkeypatch.undo()
        _enters_at_once(db_url, clock, "r", fake)


def test_an_async_entry_failing_right_after_the_lease_commits_gives_it_back(
        db_url: str, fake: Any) -> None:
    # The async twin of the sync test above: the acquisition committed, then raised an
    # ordinary exception; the entry gives the lease back before raising it unchanged.
    clock = ManualClock(80_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            faults.arm("acquire.after_commit", _fails)
            try:
                with pytest.raises(_Misconfigured) as caught:
                    async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                        pass  # pragma: no cover - the entry raised
            finally:
                faults.disarm()
            assert not getattr(caught.value, "__notes__", None)
            _given_back(await led.get_run("r"))
            assert await led.timeline("r") == []
            await _enters_at_once_async(db_url, clock, "r", fake)

    asyncio.run(main())


def test_an_async_entry_whose_adapter_cannot_be_built_gives_its_lease_back(
        db_url: str, fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The lease is taken and its keeper started when the adapter's construction raises: the
    # keeper is stopped, the lease released, and the adapter's error raised with its cause.
    import ledger.adapters

    clock = ManualClock(80_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            monkeypatch.setattr(ledger.adapters, "HttpAdapter", _BrokenAdapter)
            try:
                with pytest.raises(_Misconfigured) as caught:
                    async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT):
                        pass  # pragma: no cover - the entry raised
            finally:
                monkeypatch.undo()
            assert isinstance(caught.value.__cause__, ValueError)
            _given_back(await led.get_run("r"))
            await _enters_at_once_async(db_url, clock, "r", fake)

    asyncio.run(main())


# -- a Child whose entry raised ----------------------------------------------------------------

CHILD = Budget(max_calls=2, max_retries=1, max_cost=Decimal("0.3"))


def _nothing_stranded(parent: Any, child: Any) -> None:
    """The parent's carve is all back, and a Child the entry admitted ended, holding nothing."""
    assert parent.carved == 0 and parent.carved_calls == 0 and parent.carved_retries == 0
    if child is not None:  # None: the entry raised before the Child was admitted
        assert (child.status, child.lease_holder) == (RunStatus.CANCELLED, None)
        assert child.returned == CHILD.max_cost


def test_a_child_whose_entry_is_cancelled_after_its_carve_is_ended_and_gives_it_back(
        db_url: str, fake: Any) -> None:
    # The cancellation lands at each clock reading of a Child's entry in turn (its admission,
    # which carves the parent's budget, the lease's acquisition): wherever it lands, the
    # parent's money is not kept by a Child whose block never ran.
    clock = _CancelsEntry(80_000.0)

    async def main() -> int:
        admitted = 0
        async with AsyncLedger.open(db_url, clock=clock) as led, \
                led.run("p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            for at in range(1, 12):
                child_id = f"c{at}"

                ran: list[str] = []

                async def enter(child_id: str = child_id, ran: list[str] = ran) -> None:
                    async with run.child(child_id, budget=CHILD):
                        ran.append(child_id)

                clock.reads, clock.at = 0, at
                clock.task = asyncio.ensure_future(enter())
                try:
                    await clock.task
                except asyncio.CancelledError:
                    pass
                finally:
                    clock.task = None
                if ran:
                    break  # the entry reads the clock fewer times: every reading was tried
                try:
                    child = await led.get_run(child_id)
                    admitted += 1
                except NotFound:
                    child = None
                _nothing_stranded(await led.get_run("p"), child)
            # The parent spends its whole budget: none of it is kept by a Child.
            assert (await run.turn(HELLO, send=_served)).output == "ok"
        return admitted

    assert asyncio.run(main()) > 0  # the scene happened: a cancelled entry's Child was carved


def test_a_child_whose_sync_entry_is_interrupted_after_its_carve_is_ended_and_gives_it_back(
        db_url: str, fake: Any) -> None:
    # KeyboardInterrupt lands at each clock reading of a sync Child entry in turn (admission,
    # the lease's acquisition, the keeper's start): the parent's carve always comes back.
    clock = _InterruptsEntry(80_000.0)
    admitted = 0
    with Ledger.open(db_url, clock=clock) as led, \
            led.run("p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        for at in range(1, 12):
            child_id = f"c{at}"
            clock.reads, clock.at = 0, at
            try:
                with run.child(child_id, budget=CHILD):
                    clock.at = 0
                    break  # the entry reads the clock fewer times: every reading was tried
            except KeyboardInterrupt:
                pass
            finally:
                clock.at = 0
            try:
                child = led.get_run(child_id)
                admitted += 1
            except NotFound:
                child = None
            _nothing_stranded(led.get_run("p"), child)
    assert admitted > 0


def _refused(_point: str) -> None:
    # What a busy SQLite (its busy timeout) or a PostgreSQL serialization failure tells: the
    # acquisition took nothing.
    raise DatabaseUnavailable("the database refused the acquisition (simulated)",
                              operation="acquire", resolved=True, landed=False)


def test_a_child_whose_acquisition_is_refused_after_its_carve_is_ended_and_gives_it_back(
        db_url: str, fake: Any) -> None:
    # The ledger's own refusal of the acquisition took nothing, but the admission before it
    # carved the parent's budget: the entry ends the Child it admitted all the same.
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led, \
            led.run("p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        faults.arm("acquire.before_commit", _refused)
        try:
            with pytest.raises(DatabaseUnavailable), run.child("c", budget=CHILD):
                pass  # pragma: no cover - the entry raised
        finally:
            faults.disarm()
        child, parent = led.get_run("c"), led.get_run("p")
        assert (child.status, child.lease_holder, child.returned) == (
            RunStatus.FAILED, None, CHILD.max_cost)
        assert parent.carved == 0 and parent.carved_calls == 0


class _Away:
    """The database going away once an entry has taken a Child's lease: the acquisition's
    caller hears an ordinary error right after its commit, and the give-back's finish is
    refused as by a database that does not answer, until :meth:`back`."""

    def __init__(self) -> None:
        self.away = False

    def arm(self) -> None:
        faults.arm("acquire.after_commit", self._taken)
        faults.arm("finish.before_commit", self._refuse)

    def _taken(self, _point: str) -> None:
        self.away = True
        raise _Misconfigured("the session's adapter cannot be built")

    def _refuse(self, _point: str) -> None:
        if self.away:
            raise DatabaseUnavailable("the database is away (simulated)", operation="finish",
                                      resolved=True, landed=False)

    def back(self) -> None:
        self.away = False
        faults.disarm()


def _told_ended_later(error: BaseException) -> None:
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "ending child run 'c'" in notes and "DatabaseUnavailable" in notes
    assert "gives the carve back as soon as the database answers again" in notes


def _stranded_then_given_back(led: Any, before: Any) -> None:
    """``before``: the parent while the database was away (the Child's carve out of it); now
    the Child is ended failed, its lease released, and the carve is the parent's again."""
    assert before.carved == CHILD.max_cost
    child, parent = led.get_run("c"), led.get_run("p")
    assert (child.status, child.fence, child.lease_holder) == (RunStatus.FAILED, 1, None)
    assert child.returned == CHILD.max_cost
    assert parent.carved == 0 and parent.carved_calls == 0 and parent.carved_retries == 0
    assert [e.kind for e in led.events("c")] == [
        "admit", "lease", "finish", "unwound", "give_back"]


def test_a_child_whose_entry_raised_with_the_database_away_is_ended_by_the_next_write(
        db_url: str, fake: Any) -> None:
    # The entry took the Child's lease, then raised; its give-back's finish met a database
    # that did not answer. The ending is remembered under the parent and written before the
    # parent's next write: the parent's budget has the carve back for that very turn.
    away = _Away()
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led, \
            led.run("p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        away.arm()
        try:
            with pytest.raises(_Misconfigured) as caught, run.child("c", budget=CHILD):
                pass  # pragma: no cover - the entry raised
            _told_ended_later(caught.value)
            before = led.get_run("p")
            assert led.get_run("c").status is RunStatus.ADMITTED
        finally:
            away.back()
        assert run.turn(HELLO, send=_served_sync).output == "ok"
        assert not led._store.pending
        _stranded_then_given_back(led, before)


def test_an_async_child_whose_entry_raised_with_the_database_away_is_ended_by_the_next_write(
        db_url: str, fake: Any) -> None:
    away = _Away()
    clock = ManualClock(80_000.0)

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led, \
                led.run("p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            away.arm()
            try:
                with pytest.raises(_Misconfigured) as caught:
                    async with run.child("c", budget=CHILD):
                        pass  # pragma: no cover - the entry raised
                _told_ended_later(caught.value)
                before = await led.get_run("p")
                assert (await led.get_run("c")).status is RunStatus.ADMITTED
            finally:
                away.back()
            assert (await run.turn(HELLO, send=_served)).output == "ok"
            assert not led._store.pending
            _stranded_then_given_back(led.sync, before)

    asyncio.run(main())


def test_a_child_entered_before_whose_entry_is_interrupted_stays_resumable(
        db_url: str, fake: Any) -> None:
    # A Child some lease held before is not this entry's to end: it stays as it was (its carve
    # with it, for what it holds and will do), and the next entry continues it.
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led, \
            led.run("p", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        led.admit_run("c", plan=plan(fake), budget=CHILD, grant=GRANT, parent=run.lease)
        led.release_lease(led.acquire_lease("c", ttl_s=TTL))  # a host held it once
        faults.arm("acquire.after_commit", _ctrl_c)
        try:
            with pytest.raises(KeyboardInterrupt), run.child("c", budget=CHILD):
                pass  # pragma: no cover - the entry raised
        finally:
            faults.disarm()
        child = led.get_run("c")
        assert (child.status, child.lease_holder, child.returned) == (
            RunStatus.ADMITTED, None, 0)
        assert led.get_run("p").carved == CHILD.max_cost
        with run.child("c", budget=CHILD) as sub:
            assert sub.turn(HELLO, send=_served_sync).output == "ok"
        assert led.get_run("c").status is RunStatus.SUCCEEDED


# -- a session dropped without leaving its block -----------------------------------------------


def _dropped(led: Ledger, run_id: str, fake: Any) -> Any:
    """A session entered and never left (its object then dropped); its keeper, stopped so
    that the test ticks it by the manual clock."""
    session = led.run(run_id, plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL)
    keeper = session.__enter__()._keeper
    keeper.stop()
    return keeper


def test_a_dropped_sessions_lease_is_no_longer_renewed_and_lapses_for_a_takeover(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        keeper = _dropped(led, "r", fake)
        gc.collect()  # the session is gone: nothing refers to it but the keeper, weakly
        clock.advance(TTL / 3)
        assert math.isinf(keeper.tick()) and keeper.renewals == 0
        clock.advance(TTL)  # the lease lapsed: another executor takes the Run over
        _enters_at_once(db_url, clock, "r", fake)


def test_a_kept_sessions_lease_is_renewed_by_the_same_ticks(db_url: str, fake: Any) -> None:
    # The other side of the one above: while the session exists, the ticks renew its lease.
    clock = ManualClock(80_000.0)
    with Ledger.open(db_url, clock=clock) as led, \
            led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL) as run:
        run._keeper.stop()
        for _ in range(4):
            clock.advance(TTL / 3)
            gc.collect()
            assert not math.isinf(run._keeper.tick())
        assert run._keeper.renewals >= 3 and run.lease.expires_at > clock.now()


def test_a_dropped_async_sessions_lease_is_no_longer_renewed_and_lapses_for_a_takeover(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(80_000.0)

    async def dropped(led: AsyncLedger) -> Any:
        session = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL)
        keeper = (await session.__aenter__())._keeper
        await keeper.stop()
        return keeper

    async def main() -> None:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            keeper = await dropped(led)
            gc.collect()
            clock.advance(TTL / 3)
            assert math.isinf(await keeper.tick()) and keeper.renewals == 0
            clock.advance(TTL)
            await _enters_at_once_async(db_url, clock, "r", fake)

    asyncio.run(main())
