"""The public ledger classes: :class:`Ledger` (blocking) and :class:`AsyncLedger` (awaited).

Both are the same operations (:class:`~ledger.api.face.Face`, written once); this module adds
what ties a face to the rest of the API: how each kind is opened, and the Run session each
kind's :meth:`~ledger.api.face.Face.run` gives (:mod:`ledger.api.session`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Annotated, Any

from ledger.api.arguments import SessionOptions
from ledger.api.face import (
    CLOSE_WAITS_ENTRIES_S,
    AsyncFace,
    SyncFace,
    check_executor_free,
    release_executor,
)
from ledger.clock import Clock
from ledger.domain.validation import checked, instance
from ledger.forking import renew_in_child
from ledger.storage.runner import in_own_thread

log = logging.getLogger("ledger.session")

if TYPE_CHECKING:
    # The sessions bring the turn loop; a ledger opened only to read (the audit, the CLI's
    # reporting commands) never loads it.
    from ledger.api.session import AsyncRunSession, RunSession


class Ledger(SyncFace["RunSession", "Ledger"]):
    """A ledger over one database (SQLite file or PostgreSQL). Open with :meth:`open`.

    It records Runs (admitted with a frozen plan, grant, budget and policy), their leases, and
    every Attempt (a physical model call: begun before it is sent, settled once), and keeps the
    health and capacity-group facts the selector reads. Most hosts use :meth:`run` (a Run
    session) or :func:`ledger.execute`; the lower-level writes below are what those call.

    Every method checks its arguments before it reads or writes: a wrong value is
    :class:`~ledger.errors.InvalidArgument` naming the field, a call that fits no signature
    :class:`~ledger.errors.ArgumentMismatch`. Every method that touches the database may also
    raise :class:`~ledger.errors.StorageError`, and
    :class:`~ledger.errors.DatabaseUnavailable` (safe to retry) when it cannot be reached, or
    :class:`~ledger.errors.DatabaseSetupError` when the server refuses the URL's database or
    role (retrying will not help). A
    write under a lease raises :class:`~ledger.errors.FencedOut` once another executor took
    the Run over, and :class:`~ledger.errors.LeaseLost` once the lease lapsed where it must be
    live.

    :class:`AsyncLedger` has the same methods, awaited. ``Ledger(store)`` builds one over a
    store that is already open (see :func:`ledger.storage.open_store`); the ledger owns it from
    then on and closes it (unless it refused its ``executor_id``, one another ledger open in
    this process holds on the same database: the store is then still the caller's).

    Attributes:
        clock: Where the ledger reads time (:class:`~ledger.SystemClock` by default).
        executor_id: This process's name as a lease holder; one open ledger's per database
            in this process (a second ledger on the database under it is refused until this
            one is closed).

    Example:
        >>> led = Ledger.open("ledger.db", clock=ManualClock())  # doctest: +SKIP
        >>> with led.run("task-1", plan=[route], budget={"max_calls": 4, "max_retries": 2,
        ...              "max_cost": "0.10"}) as run:  # doctest: +SKIP
        ...     print(run.turn(Envelope(parts=[Part(content="Hello")])).text)
    """


    def close(self) -> None:
        """Close the database connections, for good (the ledger cannot be used afterwards).

        Any call afterwards (and one in flight when the close came) raises
        :class:`~ledger.errors.InvalidState` (``problem`` is ``"ledger_closed"``): open a new
        ledger to go on. Closing again does nothing.

        Writes whose outcome the database could not tell when they were made are resolved
        first, one try each (:meth:`ledger.storage.store.Store.settle_pending`): a begin of the
        retry owner that was never sent is settled ``not_sent``, a settle of the retry owner the
        database did not take is written as decided (freeing its capacity slot), a Run
        session's exit finishes the Run and releases its lease (the threads still trying such
        exits, ``ledger-exit``, stop first). What the database still does
        not take is logged at WARNING and left to recovery. Then, once the begins under way
        have ended (up to 5 s), the places this ledger's turns hold in full capacity groups'
        queues are given up (one try each), so no waiter anywhere waits behind them or counts
        them; from then on it begins nothing (the turns still waiting raise the closed
        ledger's ``InvalidState``).

        Then the Run sessions still open on it (entered, their blocks not left) give up their
        leases: their keepers stop, and each lease is released (one try each), so the next
        session of the Run, in any executor, resumes it at once. The Runs are not finished
        (their blocks have not ended). A release settles nothing: a session with an Attempt in
        flight (sent, its outcome unknown) keeps its lease, which lapses, and the Attempt is
        left to recovery. What the database does not take is logged at WARNING and lapses.
        Such a session's exit writes nothing: it raises the closed ledger's ``InvalidState``
        (a block that raised keeps its own exception), noted with what the close did with its
        lease. No session enters once the close has begun (its entry raises the closed
        ledger's ``InvalidState``); one whose entry was under way is waited for (up to
        5 s, :data:`~ledger.api.face.CLOSE_WAITS_ENTRIES_S`, then a WARNING) and gives
        back what it took, raising the same error.

        Last, the ledger's own threads (``ledger-cold``, where an :class:`AsyncLedger` runs
        its blocking calls) end: a call already running on one is waited for (it may wait up
        to SQLite's busy timeout for another process's write lock), the queued ones raise the
        closed ledger's ``InvalidState``.
        """
        if self._store.closed:
            return
        self._entries.close()
        try:
            # The threads still trying sessions' exits stop first: this writes the exits.
            for writer in self._entries.take_exit_writers():
                writer.stop()
            self._runner.run(self._store.settle_pending(self.clock.now))
            taken: list[Any] = []
            if self._open_sessions:
                # Loaded already: a session is open. Taken before the queues are left, so that
                # a turn the close wakes leaves a session whose exit writes nothing.
                from ledger.api.session import give_up_open, take_open

                taken = take_open(self)
            self._runner.run(self._store.leave_queues())
            # An entry under way gives back what it took once it finds the close begun: while
            # the database is still open to take it.
            if not self._entries.ended(CLOSE_WAITS_ENTRIES_S):
                log.warning("closing the ledger with a Run session still entering after %ss: "
                            "a lease it takes lapses", CLOSE_WAITS_ENTRIES_S)
            if taken:
                self._runner.run(give_up_open(self, taken))
        finally:
            try:
                self._store.close()
            finally:
                try:
                    if self._replica is not None:
                        self._replica.close()
                finally:
                    release_executor(self)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def _open(cls, url: str, *, clock: Clock | None, executor_id: str | None,
              migrate_schema: bool, lease_margin_s: float, read_url: str | None) -> Ledger:
        from ledger.storage import engine, open_reads, open_store

        check_executor_free(executor_id, url)  # before the database is opened or migrated
        reads = None
        if read_url is not None:
            engine.parse(url)  # the URL's own faults first, named as its own
            reads = open_reads(url, read_url)  # touches nothing until the first read
        try:
            store = open_store(url, lease_margin_s=lease_margin_s,
                               migrate_schema=migrate_schema,
                               now=None if clock is None else clock.now())
        except BaseException:
            if reads is not None:
                reads.close()
            raise
        try:
            # Claimed again here: another thread may have opened one under it meanwhile.
            led = Ledger(store, clock=clock, executor_id=executor_id)
        except BaseException:
            with contextlib.suppress(Exception):  # the refusal is the error to tell
                store.close()
            if reads is not None:
                with contextlib.suppress(Exception):
                    reads.close()
            raise
        led._replica = reads
        return led

    def _session(self, run_id: str, options: SessionOptions) -> RunSession:
        from ledger.api.session import RunSession

        return RunSession(self, run_id, options)


class _Opening(Coroutine[Any, Any, "AsyncLedger"]):
    """An AsyncLedger being opened: awaited, used as ``async with``, or run as a coroutine.

    It is a real coroutine (``asyncio.run``, ``asyncio.create_task`` take it), started only
    when awaited or run: ``async with`` never starts it, so no "never awaited" warning.
    """

    def __init__(self, make: Callable[[], AsyncLedger]) -> None:
        self._make = make
        self._led: AsyncLedger | None = None
        self._coro: Coroutine[Any, Any, AsyncLedger] | None = None

    async def _opened(self) -> AsyncLedger:
        # Its own thread, not the loop's default executor: opening may wait up to the busy
        # timeout for another process's write lock (a migration), and the host's work must not
        # queue behind it. There are no ledger threads yet.
        return await in_own_thread(self._make, "ledger-open")

    def _started(self) -> Coroutine[Any, Any, AsyncLedger]:
        if self._coro is None:
            self._coro = self._opened()
        return self._coro

    def __await__(self) -> Generator[Any, None, AsyncLedger]:
        return self._started().__await__()

    def send(self, value: Any) -> Any:
        return self._started().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        return self._started().throw(typ, val, tb)

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()

    async def __aenter__(self) -> AsyncLedger:
        self._led = await self._opened()
        return self._led

    async def __aexit__(self, *exc: object) -> None:
        if self._led is not None:
            await self._led.close()


class AsyncLedger(AsyncFace["AsyncRunSession", _Opening]):
    """The async twin of :class:`Ledger`: the same operations, awaited; one implementation.

    Every operation is :class:`Ledger`'s own (the same checks, docstring and transactions),
    awaited: on PostgreSQL on psycopg's asyncio connections, on SQLite on the database's own
    threads (one for the writes, which also takes a read when idle, and one for the reads that
    find it busy), so the event loop never blocks on the database. What has only a blocking form
    (admission, the cold path's reads and writes, recovery) runs on the ledger's own bounded
    threads (``ledger-cold``), never on the event loop's default executor: one of those calls
    may wait up to SQLite's busy timeout for another process's write lock, and the host's own
    ``asyncio.to_thread`` / ``run_in_executor(None, ...)`` work does not queue behind it.
    :meth:`close` ends them. Open it with :meth:`open`.

    Args:
        ledger: The :class:`Ledger` whose database, clock, executor id and caches it shares
            (see :attr:`sync`).

    Attributes:
        sync: The blocking :class:`Ledger` over the same database, for code that must block.

    Example:
        >>> async with AsyncLedger.open("ledger.db") as led:  # doctest: +SKIP
        ...     async with led.run("task-1", plan=routes, budget=budget) as run:
        ...         result = await run.turn(Envelope(parts=[Part(content="Hello")]))
    """

    @checked
    def __init__(self, ledger: Annotated[Ledger, instance(
            Ledger, "a ledger.Ledger", "AsyncLedger(ledger) takes a ledger.Ledger; open one "
            "with AsyncLedger.open(url)")]) -> None:
        self.__dict__.update(vars(ledger))  # one database, clock, executor id and caches
        self.sync = ledger
        renew_in_child(self)  # after its ledger, which it follows there

    def _forked(self) -> None:
        """In a forked child: what its ledger renewed there, shared again."""
        for name in ("executor_id", "_open_sessions", "_open_sessions_lock", "_entries"):
            setattr(self, name, getattr(self.sync, name))

    @classmethod
    def _open(cls, url: str, *, clock: Clock | None, executor_id: str | None,
              migrate_schema: bool, lease_margin_s: float, read_url: str | None) -> _Opening:
        return _Opening(lambda: AsyncLedger(Ledger._open(
            url, clock=clock, executor_id=executor_id, migrate_schema=migrate_schema,
            lease_margin_s=lease_margin_s, read_url=read_url)))

    def _session(self, run_id: str, options: SessionOptions) -> AsyncRunSession:
        from ledger.api.session import AsyncRunSession

        return AsyncRunSession(self, run_id, options)

    async def close(self) -> None:
        """Close the database connections; what is unresolved is resolved first.

        See :meth:`Ledger.close`. The ledger's own threads (``ledger-cold``, where its blocking
        calls ran) have ended when this returns.
        """
        # Its own thread: closing waits for the ledger's threads, so it cannot run on one of
        # them, nor hold up the loop's default executor meanwhile.
        await in_own_thread(self.sync.close, "ledger-close")

    async def __aenter__(self) -> AsyncLedger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncLedger", "Ledger"]
