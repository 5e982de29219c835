"""The face's plumbing: one operation written once, run blocking or awaited, and a cache.

An operation of the ledger is a method that returns a :data:`~ledger.storage.runner.Flow`: it
checks its arguments, asks the pure core what the write means, and yields the transactions it
needs. :class:`op` turns such a method into the public method of both faces: on a
:class:`~ledger.Ledger` it runs the flow on the blocking runner and returns its result, on an
:class:`~ledger.AsyncLedger` it returns a coroutine that awaits it. One definition, one
docstring and one signature serve both (and a type checker sees each face's return type).
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from ledger.domain.validation import checked

if TYPE_CHECKING:
    from ledger.storage.runner import Flow, Workers

K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")
T = TypeVar("T")
P = ParamSpec("P")


class Lru(Generic[K, V]):
    """A small thread-safe LRU map, of at most ``size`` items.

    What a Run's decisions read (its frozen Run, its parsed policy) is read once and kept while in
    use; the size bounds what is kept, whatever the number of Runs a process ever served.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def forked(self) -> None:
        """In a forked child: a new lock (a thread of the parent may have held it)."""
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

    def drop(self, key: K) -> None:
        """Forget ``key`` (nothing when it is not kept)."""
        with self._lock:
            self._items.pop(key, None)

    def drop_where(self, gone: Callable[[V], bool]) -> None:
        """Forget every item whose value is ``gone``."""
        with self._lock:
            for key in [k for k, v in self._items.items() if gone(v)]:
                del self._items[key]

    def __len__(self) -> int:
        return len(self._items)


class op(Generic[P, T]):
    """An operation of the ledger: a flow-returning method, public on both faces.

    ``Ledger().name(...)`` runs the flow and returns ``T``; ``AsyncLedger().name(...)`` returns
    an awaitable of ``T``; ``Face.name.flow(ledger, ...)`` is the flow itself, for code that
    composes operations (a lease keeper's renewal, a session's entry). A call that does not
    fit the signature is :class:`~ledger.errors.ArgumentMismatch` before anything runs, and its
    arguments are validated against the builder's annotations
    (:func:`~ledger.domain.validation.checked`): the flow gets them as validated.
    """

    def __init__(self, builder: Callable[Concatenate[Any, P], Flow[T]]) -> None:
        self._builder = checked(builder)
        self.__doc__ = builder.__doc__
        self.__name__ = builder.__name__
        self.__qualname__ = builder.__qualname__
        self.__wrapped__ = builder
        sig = inspect.signature(builder)
        # What a caller gets is the flow's result (awaited, on an AsyncLedger), not the flow.
        ret = sig.return_annotation
        if isinstance(ret, str) and ret.startswith("Flow[") and ret.endswith("]"):
            sig = sig.replace(return_annotation=ret[len("Flow["):-1])
        self._signature = sig.replace(parameters=list(sig.parameters.values())[1:])
        # Read on the class (help(Ledger), inspect.signature(Ledger.admit_run)), where an op
        # is callable as an unbound method is.
        self.__signature__ = sig

    def __call__(self, face: Blocking | Awaiting, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """``Ledger.name(ledger, ...)``: the operation on ``face``, as ``ledger.name(...)``."""
        return self.__get__(face, type(face))(*args, **kwargs)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> op[P, T]: ...
    @overload
    def __get__(self, obj: Awaiting, owner: type[Any]) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __get__(self, obj: Blocking, owner: type[Any]) -> Callable[P, T]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        builder = self._builder
        if obj.awaiting:
            async def awaited(*args: Any, **kwargs: Any) -> Any:
                return await obj._runner.arun(builder(obj, *args, **kwargs))
            bound: Any = awaited
        else:
            def blocking(*args: Any, **kwargs: Any) -> Any:
                return obj._runner.run(builder(obj, *args, **kwargs))
            bound = blocking
        bound.__name__ = self.__name__
        bound.__qualname__ = f"{type(obj).__name__}.{self.__name__}"
        bound.__doc__ = self.__doc__
        bound.__signature__ = self._signature
        return bound

    def flow(self, face: Blocking | Awaiting, /, *args: P.args, **kwargs: P.kwargs) -> Flow[T]:
        """The operation's flow for ``face`` (either kind), unrun."""
        return self._builder(face, *args, **kwargs)


class Blocking:
    """The mark of a face that blocks on its operations: an :class:`op` returns its result."""

    awaiting = False


class Awaiting:
    """The mark of a face that awaits its operations: an op or a query returns an awaitable.

    A face so marked names the threads its queries run on (:meth:`_workers`).
    """

    awaiting = True

    def _workers(self) -> Workers:
        """The ledger's own threads for this face's blocking queries (its store's)."""
        raise NotImplementedError(f"{type(self).__name__} names no worker threads")


class query(Generic[P, T]):
    """A blocking read, public on a blocking face and (in a worker thread) on an awaiting one.

    For the operator's read-only queries (the audit), which are SQLAlchemy queries with only a
    blocking form: on a face marked :class:`Awaiting` the method is a coroutine that runs the
    same call on the ledger's own threads (:meth:`Awaiting._workers`, never the loop's default
    executor), so the database call blocks neither the event loop nor the host's own threads. One
    definition, one docstring and one signature serve both; the arguments are validated
    (:func:`~ledger.domain.validation.checked`) before anything runs.
    """

    def __init__(self, fn: Callable[Concatenate[Any, P], T]) -> None:
        self._fn = checked(fn)
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__
        sig = inspect.signature(fn)
        self._signature = sig.replace(parameters=list(sig.parameters.values())[1:])
        self.__signature__ = sig  # as op's: for help() and inspect.signature on the class

    def __call__(self, face: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """``Audit.name(audit, ...)``: the query on ``face``, as ``audit.name(...)``."""
        return self.__get__(face, type(face))(*args, **kwargs)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> query[P, T]: ...
    @overload
    def __get__(self, obj: Awaiting, owner: type[Any]) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __get__(self, obj: object, owner: type[Any]) -> Callable[P, T]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        fn = self._fn
        if obj.awaiting:
            async def awaited(*args: Any, **kwargs: Any) -> Any:
                return await obj._workers().call(fn, obj, *args, **kwargs)
            bound: Any = awaited
        else:
            def blocking(*args: Any, **kwargs: Any) -> Any:
                return fn(obj, *args, **kwargs)
            bound = blocking
        bound.__name__ = self.__name__
        bound.__qualname__ = f"{type(obj).__name__}.{self.__name__}"
        bound.__doc__ = self.__doc__
        bound.__signature__ = self._signature
        return bound


__all__ = ["Awaiting", "Blocking", "Lru", "op", "query"]
