"""The facade's plumbing: one validated operation runnable on either driver, and a cache.

A :class:`Call` is built once by a :class:`~ledger.api.facade.Ledger` method (arguments checked,
spec decided) and then run by the blocking driver (:meth:`Call.run`) or the asyncio one
(:meth:`Call.arun`): both run the same storage transaction, so sync and async never hold two
copies of a check.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")
S = TypeVar("S")
P = ParamSpec("P")


class Lru(Generic[K, V]):
    """A small thread-safe LRU map, of at most ``size`` items.

    Frozen Runs and parsed policies are read once per Run and kept while in use, without growing
    with the number of Runs a process ever served.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key``, dropping the least recently used beyond the size."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or ``None``."""
        with self._lock:
            return self._items.pop(key, None)


class Call(Generic[R]):
    """One validated ledger operation, ready to run on the blocking or on the asyncio driver.

    The checks happen once (building it), and both twins run the same storage transaction;
    ``done`` turns the transaction's result into the operation's.
    """

    __slots__ = ("asy", "done", "sync")

    def __init__(self, sync: Callable[[], Any], asy: Callable[[], Awaitable[Any]],
                 done: Callable[[Any], R] | None = None) -> None:
        self.sync = sync
        self.asy = asy
        self.done = done

    def run(self) -> R:
        """Run it on the blocking driver."""
        value = self.sync()
        return self.done(value) if self.done is not None else value

    async def arun(self) -> R:
        """Run it on the asyncio driver."""
        value = await self.asy()
        return self.done(value) if self.done is not None else value


def async_doc(doc: str | None, owner: str, how: str) -> str | None:
    """A blocking method's docstring for its async twin on ``owner``.

    The same, plus how the twin runs: one docstring per operation, so the two never drift apart.
    """
    if doc is None:
        return None
    return f"{inspect.cleandoc(doc)}\n\nOn :class:`{owner}` a coroutine: awaited, {how}."


def in_thread(fn: Callable[Concatenate[S, P], R], owner: str
              ) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """The async twin, on class ``owner``, of the blocking method ``fn``.

    The twin holds the blocking object as ``.sync`` and runs the same call in a worker thread,
    so the database call does not block the event loop. The signature (for the misuse checks)
    and the docstring are ``fn``'s.
    """

    async def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, self.sync, *args, **kwargs)

    method.__name__ = fn.__name__
    method.__qualname__ = f"{owner}.{fn.__name__}"
    method.__doc__ = async_doc(fn.__doc__, owner, "in a worker thread (the database call blocks)")
    method.__wrapped__ = fn  # type: ignore[attr-defined]
    return method


__all__ = ["Call", "Lru", "async_doc", "in_thread"]
