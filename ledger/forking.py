"""What a process forked with ledgers open must not share with its parent.

``gunicorn --preload``, Celery's prefork pool and :mod:`multiprocessing` with the ``fork``
start method fork a process that may have opened ledgers. A child is a copy of the parent's
memory with one thread, the one that forked. Whatever a ledger kept in that memory for this
process is then the parent's, not the child's:

* its default executor id: parent and child would each take the other's Run leases for their
  own, under one fence (an executor's own live lease comes back to it);
* its database connections: a PostgreSQL socket written from both processes interleaves their
  messages and each reads the other's replies, and SQLite forbids carrying an open connection
  across a fork;
* its threads (the lease keepers, SQLite's writer thread, the asyncio workers, the queue
  listener), which do not exist in the child, and their locks, which one of them may have held
  when the fork came and which nothing in the child would ever release.

Each object that keeps such state registers here (:func:`renew_in_child`) and is renewed in the
child by its ``_forked()`` method, right after the fork, before the child's own code runs. A
connection or thread object of the parent is never closed or used there: closing a PostgreSQL
connection sends the server a Terminate over the parent's socket (ending the parent's session),
and closing a SQLite one may roll back or checkpoint what the parent's connection is doing. It
is abandoned (:func:`abandon`): kept referenced for the life of the child, so that no
finalizer runs on it either, and the child opens its own on first use. The parent is left as
it was.

Registered objects are referenced weakly: a ledger dropped or closed is not kept alive.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("ledger")


class Renewable(Protocol):
    """What :func:`renew_in_child` registers: an object with a ``_forked()`` method."""

    def _forked(self) -> None:
        """Called in a forked child: let go of the parent's state (see the module)."""
        ...


# In the order they registered (a ledger after its store, an AsyncLedger after its ledger):
# each is renewed after what it is built on.
_objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_numbers = itertools.count()
# Module-level state (a registry's lock, a process-wide table), renewed before any object.
_modules: list[Callable[[], None]] = []
# What a child let go of: kept, never closed nor used (see the module).
_abandoned: list[Any] = []


def renew_in_child(obj: Renewable) -> None:
    """Call ``obj._forked()`` in every child this process forks, while ``obj`` lives.

    ``obj`` is referenced weakly: registering keeps nothing alive.
    """
    _objects[next(_numbers)] = obj


def in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Call ``reset()`` in every child this process forks, before any object is renewed.

    For a module's own state (a registry's lock, a process-wide table); a decorator, which
    gives ``reset`` back.
    """
    _modules.append(reset)
    return reset


def abandon(*things: Any) -> None:
    """Keep ``things`` for the life of this child, unused: neither closed nor finalized here.

    For the parent's connections, pools and threads' executors (see the module).
    """
    _abandoned.extend(t for t in things if t is not None)


def _in_child() -> None:
    for reset in _modules:
        _renew(reset)
    for obj in list(_objects.values()):
        _renew(obj._forked)


def _renew(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:  # one failure must not leave the others the parent's
        log.exception("renewing %r in a forked child failed", call)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


__all__ = ["Renewable", "abandon", "in_child", "renew_in_child"]
