"""Operations as data: a transaction (``Tx``), a flow of them (``Flow``), and one runner.

Every storage transaction is written once as a generator of statements
(:mod:`ledger.storage.driver`). An operation of the ledger may need more than one of them (read
a Run's frozen parts, then begin an Attempt; refuse a settle, then keep it as a late receipt),
so an operation is itself a generator, a :data:`Flow`: it yields :class:`Txn` steps and is
sent each one's result (or thrown its error). It never touches a connection, a thread or an
event loop.

A :class:`Runner` performs flows: :meth:`Runner.run` on the calling thread, :meth:`Runner.arun`
for an asyncio caller (the database's asyncio driver; on SQLite the database's own thread).
:class:`ledger.Ledger` and :class:`ledger.AsyncLedger` are the same operations, differing only
in which of the two they call: sync and async are chosen once, here.

A step may also be :class:`Blocking`: a call into code that only has a blocking form (the
cold path's SQLAlchemy queries). The blocking runner calls it; the async one runs it in a worker
thread, so the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ledger.storage.driver import Driver, Tx

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Txn(Generic[T]):
    """One transaction of a flow: ``tx`` run by the driver (``write``: it takes the write lock)."""

    tx: Tx[T]
    write: bool = True


@dataclass(frozen=True, slots=True)
class Blocking(Generic[T]):
    """One step that only has a blocking form: ``call()`` (run in a thread for async callers)."""

    call: Callable[[], T]


Step = Txn[Any] | Blocking[Any]
Flow = Generator[Step, Any, T]


def txn(tx: Tx[T], *, write: bool = True) -> Generator[Step, Any, T]:
    """Yield ``tx`` as a step of a flow and return its result: ``x = yield from txn(tx)``."""
    return (yield Txn(tx, write))  # type: ignore[no-any-return]


def blocking(call: Callable[[], T]) -> Generator[Step, Any, T]:
    """Yield a blocking call as a step of a flow and return its result."""
    return (yield Blocking(call))  # type: ignore[no-any-return]


class Runner:
    """Performs flows on one database's driver, blocking or for asyncio."""

    __slots__ = ("driver",)

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

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
                    value = self.driver.run(step.tx, write=step.write)
                else:
                    value = step.call()
            except Exception as e:  # handed to the flow, which may act on it or raise it
                error = e

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
                    value = await self.driver.arun(step.tx, write=step.write)
                else:
                    value = await asyncio.to_thread(step.call)
            except Exception as e:
                error = e


__all__ = ["Blocking", "Flow", "Runner", "Step", "Txn", "blocking", "txn"]
