"""Operations as data: a transaction (``Tx``), a flow of them (``Flow``), and one runner.

Every storage transaction is written once as a generator of statements
(:mod:`ledger.storage.driver`). An operation of the ledger may need more than one of them (read
a Run's frozen parts, then begin an Attempt; refuse a settle, then keep it as a late receipt),
so an operation is itself a generator, a :data:`Flow`: it yields :class:`Txn` steps and is
sent each one's result (or thrown its error). It never touches a connection, a thread or an
event loop.

A :class:`Runner` performs flows: :meth:`Runner.run` on the calling thread, :meth:`Runner.arun`
for an asyncio caller (the database's asyncio driver; on SQLite the database's own threads).
:class:`ledger.Ledger` and :class:`ledger.AsyncLedger` are the same operations, differing only
in which of the two they call: sync and async are chosen once, here.

A step may also be :class:`Blocking`: a call into code that only has a blocking form (the
cold path's SQLAlchemy queries). The blocking runner calls it; the async one runs it on the
store's own :class:`Workers` (threads named ``ledger-cold``), so the event loop never waits on
it, and neither does the host's work on the loop's default executor: such a call may wait up
to SQLite's busy timeout for another process's write lock, and a few of them would otherwise
fill that executor (``asyncio.to_thread``, ``run_in_executor(None, ...)``, LangChain's own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar

from ledger.forking import abandon, in_child, renew_in_child
from ledger.storage.driver import Driver, Tx
from ledger.storage.failure import closed_error

T = TypeVar("T")
P = ParamSpec("P")

#: How many threads a store's :class:`Workers` may run at once: the bound asyncio gives its
#: default executor, so moving off it does not lower the ledger's own concurrency.
WORKERS_MAX = min(32, (os.cpu_count() or 1) + 4)

# Which Workers (if any) the current thread belongs to: a close from one of its own threads
# cannot wait for itself.
_MINE = threading.local()


@in_child
def _forked_mine() -> None:
    global _MINE
    _MINE = threading.local()  # the forking thread may have been one of a store's


class Workers:
    """The threads a store runs its blocking calls on for asyncio callers (``ledger-cold``).

    Created on the first call, at most :data:`WORKERS_MAX` threads, shut down by
    :meth:`close` (the store's). Never the event loop's default executor: a cold-path call may
    wait up to SQLite's busy timeout for another process's write lock, and the host's own
    ``asyncio.to_thread`` / ``run_in_executor(None, ...)`` work must not queue behind it.

    Args:
        where: The database's URL without its password, for the closed ledger's error.
        max_workers: The most threads at once.
    """

    def __init__(self, where: str, max_workers: int = WORKERS_MAX) -> None:
        self.where = where
        self.max_workers = max_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child: the parent's threads do not exist here, and their pool is
        abandoned (:mod:`ledger.forking`); the first call starts this process's own."""
        abandon(self._pool)
        self._pool = None
        self._lock = threading.Lock()

    async def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on one of these threads, in a copy of the caller's context
        (as :func:`asyncio.to_thread`). Cancelling the awaiting task does not stop a call
        already running: it finishes (its transaction commits or rolls back) unobserved.

        Raises:
            InvalidState: the store was closed (``problem="ledger_closed"``).
        """
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        with self._lock:
            if self._closed:
                raise closed_error(self.where)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="ledger-cold", initializer=self._own)
            # Submitted under the lock: a close cannot shut the pool between the check and it.
            future = self._pool.submit(functools.partial(ctx.run, fn, *args, **kwargs))
        return await asyncio.wrap_future(future, loop=loop)

    def _own(self) -> None:
        _MINE.workers = self

    def close(self) -> None:
        """Refuse new calls, let the queued ones run (each finds the store closed), and wait
        for the threads to end; from one of these threads, do not wait (it would wait for
        itself)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=getattr(_MINE, "workers", None) is not self)


async def in_own_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` on a new thread named ``name``, awaited: for the one-off blocking work that
    comes before a store's :class:`Workers` exist or after they are gone (opening and closing
    a ledger), kept off the loop's default executor. Cancellation as with
    :func:`asyncio.to_thread`: the thread finishes unobserved."""
    ctx = contextvars.copy_context()
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = ctx.run(fn)
        except BaseException as e:  # the awaiting task's, as an executor hands it over
            future.set_exception(e)
        else:
            future.set_result(result)

    loop = asyncio.get_running_loop()
    threading.Thread(target=work, name=name).start()
    return await asyncio.wrap_future(future, loop=loop)


@dataclass(frozen=True, slots=True)
class Txn(Generic[T]):
    """One transaction of a flow: the transaction function ``make()`` run by the driver
    (``write``: it takes the write lock). Made again when the driver runs it once more from
    its start (:class:`~ledger.storage.driver.PgDriver`: a migration changed what a statement
    it had prepared returns)."""

    make: Callable[[], Tx[T]]
    write: bool = True


@dataclass(frozen=True, slots=True)
class Blocking(Generic[T]):
    """One step that only has a blocking form: ``call()`` (run on the store's
    :class:`Workers` for async callers)."""

    call: Callable[[], T]


Step = Txn[Any] | Blocking[Any]
Flow = Generator[Step, Any, T]


def txn(make: Callable[[], Tx[T]], *, write: bool = True) -> Generator[Step, Any, T]:
    """Yield the transaction ``make()`` as a step of a flow and return its result:
    ``x = yield from txn(lambda: some_tx(sql, ...))``."""
    return (yield Txn(make, write))  # type: ignore[no-any-return]


def blocking(call: Callable[[], T]) -> Generator[Step, Any, T]:
    """Yield a blocking call as a step of a flow and return its result."""
    return (yield Blocking(call))  # type: ignore[no-any-return]


class Runner:
    """Performs flows on one database's driver, blocking or for asyncio (its blocking steps
    on ``workers``)."""

    __slots__ = ("driver", "workers")

    def __init__(self, driver: Driver, workers: Workers) -> None:
        self.driver = driver
        self.workers = workers

    def run(self, flow: Flow[T]) -> T:
        """Perform ``flow`` on the calling thread; its result, or its error."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                if isinstance(step, Txn):
                    value = self.driver.run(step.make(), write=step.write, again=step.make)
                else:
                    value = step.call()
            except Exception as e:  # handed to the flow, which may act on it or raise it
                error = e
            except BaseException:
                # An interruption the flow is not told of (KeyboardInterrupt): closed now, so
                # its finally blocks run now, not when the generator is collected (which the
                # interruption's traceback, holding this frame, puts off).
                flow.close()
                raise

    async def arun(self, flow: Flow[T]) -> T:
        """Perform ``flow`` for an asyncio caller: the event loop never blocks on it."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                if isinstance(step, Txn):
                    value = await self.driver.arun(step.make(), write=step.write,
                                                   again=step.make)
                else:
                    value = await self.workers.call(step.call)
            except Exception as e:
                error = e
            except BaseException:
                flow.close()  # a cancellation: as in run()
                raise


class UnderWay:
    """A count of things under way (begins, Run sessions entering), which a closing thread
    can wait to see end; on ``lock`` when given, so that a caller can count one atomically
    with a check of its own under that lock."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self._cond = threading.Condition(lock)
        self._n = 0

    def begun(self) -> None:
        """One more under way (the caller holds the lock)."""
        self._n += 1

    def ended_one(self) -> None:
        """One under way ended, whichever way (takes the lock)."""
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        """One under way for the block."""
        with self._cond:
            self.begun()
        try:
            yield
        finally:
            self.ended_one()

    def ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until none is under way; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout_s)


__all__ = ["WORKERS_MAX", "Blocking", "Flow", "Runner", "Step", "Txn", "UnderWay", "Workers",
           "blocking", "in_own_thread", "txn"]
