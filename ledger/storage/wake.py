"""Waking the waiters of a full capacity group when one of its slots may have come free.

A waiter is a turn whose begin was queued (:class:`~ledger.domain.records.Queued`). It waits
through the turn's sleeper for a signal or a bounded polling interval, whichever comes first,
and then begins again; the begin decides (first come, first served), so a wake is a hint, never
a grant, and a missed one costs at most one polling interval.

Signals come from two places:

* this process: every slot freed and every queue departure, by any ledger on the same
  database, wakes a waiter of that group at once (:meth:`SlotWaker.poke`, :func:`poke`);
* other processes, on PostgreSQL: a trigger (migration 0006) notifies channel
  :data:`~ledger.storage.statements.QUEUE_CHANNEL` when a slot of a group with waiters is
  freed, and a queue departure notifies it too; one listening connection per database in this
  process, opened while someone of this process waits on that database, pokes the local
  waiters. SQLite has no such channel: waiters in other processes poll.

The listening connection is the process's, not a store's: every ledger open on the database in
this process shares it (:class:`_Channel`, counted by the stores open on it). One per store
heard each notification once per ledger, and each hearing woke a waiter: two ledgers on one
database woke two waiters for one slot another process freed (one begin for nothing, under the
group's lock). The last store of the database to close stops it, and its close returns once
the connection is closed; closing one of several leaves it to the others, whose waiters keep
hearing other processes' slots.

Every path of this process that frees a slot wakes a waiter here itself, after its commit:
the settle, ``mark_unknown`` and the queue departure of a ledger, and also recovery's takeover
and its marking of orphans, ``close_run`` (the API, the CLI, the dashboard) and a begin whose
adoption is refused (these call :func:`poke` with the store's key; on SQLite that is how the
waiters here hear of them at once rather than at their next poll). So on PostgreSQL the
listener skips the notifications sent by this process's own pooled connections, by their
backend pids (:func:`ledger.storage.pgpool.own_pids`): the slot was heard here already, and
hearing it again woke one more waiter for nothing (one more begin per freed slot).
Notifications of every other connection, this process's outside its pools included, still
wake a waiter. A pid is forgotten once its connection is closed (the server gives a pid to a
new backend only after the old one exited, so a pid kept longer could only skip another
process's notification); one of a connection closed right after its commit (a checkout's own
connection, made while the pool is not proven yet) is then heard as another's: one spare
wake-up, as before.

One freed slot wakes one waiter of this process: the earliest by ticket not woken yet, the one
the queue serves first. Waking all of them cost one begin each, all serialized on the group's
lock, for a single slot: with many waiters the queue crawled. A waiter that leaves with a wake
it did not use (it was served by an earlier one, cancelled, or gave up) passes it on.

Only the earliest waiter of a group in this process polls, every polling interval: the begin
serves first come, first served by ticket, so a later one polling could only be told to wait
again, at the cost of a write transaction under the group's lock (120 waiters on SQLite polled
1,200 begins a second). The others wait for a signal, at most :data:`IDLE_POLLS` polling
intervals (a signal lost is still bounded), and always within their own deadline. When the
earliest leaves for any reason (served, cancelled, gave up, past its bound), or another one
becomes the earliest (a lapsed place taken anew under a later ticket), the new earliest is
woken: it begins once and takes over polling. A served waiter thus wakes the next one, which
finds a second slot that a settle in another process may have freed. Waiters of other
processes have their own earliest polling, so nothing across processes depends on this one.

A slot held by a dead executor comes back when its lease expires, which nothing announces: the
earliest waiter's polling interval bounds how long the queue takes to notice.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ledger.forking import in_child, renew_in_child

log = logging.getLogger("ledger.storage")

#: How long the waiter that opens the listening connection waits for it to listen: the begin
#: it makes next then misses no wake-up. A server that does not answer in time leaves the
#: waiters to polling until it does.
LISTEN_READY_S = 5.0

#: How long the listening connection waits for a notification before it checks whether it
#: should stop: the longest the last close of a database's stores waits for it to close.
LISTEN_CHECK_S = 0.5

#: A waiter that is not the earliest of its group in this process waits for a signal at most
#: this many polling intervals: only a lost signal makes it wait that long.
IDLE_POLLS = 20


@dataclass
class _Signal:
    """One waiter's wake-up: a thread event, and an asyncio one for a waiter on a loop.

    ``arrival`` is set by the registry: among equal tickets, the one registered first is
    served first.
    """

    group: str
    ticket: int
    event: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    aevent: asyncio.Event | None = None
    arrival: int = 0

    def set(self) -> None:
        self.event.set()
        if self.loop is not None and self.aevent is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                self.loop.call_soon_threadsafe(self.aevent.set)

    def clear(self) -> None:
        self.event.clear()
        if self.aevent is not None:
            self.aevent.clear()


class _Waiters:
    """One database's waiters in this process: by id, and each group's in the order its queue
    serves them (by ticket, then arrival), so the earliest is the first of its group's list
    and a change finds its place by bisection instead of scanning every waiter."""

    __slots__ = ("by_arrival", "by_id", "order")

    def __init__(self) -> None:
        self.by_id: dict[str, _Signal] = {}
        self.by_arrival: dict[int, _Signal] = {}
        self.order: dict[str, list[tuple[int, int]]] = {}

    def put(self, signal: _Signal) -> None:
        self.by_arrival[signal.arrival] = signal
        bisect.insort(self.order.setdefault(signal.group, []), (signal.ticket, signal.arrival))

    def drop(self, signal: _Signal) -> None:
        del self.by_arrival[signal.arrival]
        places = self.order[signal.group]
        del places[bisect.bisect_left(places, (signal.ticket, signal.arrival))]
        if not places:
            del self.order[signal.group]

    def earliest(self, group: str) -> _Signal | None:
        places = self.order.get(group)
        return self.by_arrival[places[0][1]] if places else None

    def wake_first(self, group: str) -> int:
        """Wake the earliest waiter of ``group`` not woken yet: the one the queue serves first;
        one woken already will begin again anyway (only those are passed over: a woken
        waiter's signal is cleared once it is back at its wait)."""
        for _, arrival in self.order.get(group, ()):
            signal = self.by_arrival[arrival]
            if not signal.event.is_set():
                signal.set()
                return 1
        return 0

    def hand_over(self, group: str, before: _Signal | None, at_begin: _Signal) -> None:
        """Wake the group's new earliest waiter when it changed: it takes over polling (it was
        waiting out the long idle interval). ``at_begin`` is about to begin anyway."""
        now = self.earliest(group)
        if now is not None and now is not before and now is not at_begin:
            now.set()


class _Registry:
    """Every waiter of this process, by database and group (shared by all stores)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, _Waiters] = {}
        self._arrivals = itertools.count()

    def add(self, key: str, waiter: str, signal: _Signal) -> None:
        with self.lock:
            waiters = self.by_key.setdefault(key, _Waiters())
            before = waiters.earliest(signal.group)
            old = waiters.by_id.get(waiter)
            if old is not None:  # registered again: it keeps its arrival
                waiters.drop(old)
            signal.arrival = old.arrival if old is not None else next(self._arrivals)
            waiters.by_id[waiter] = signal
            waiters.put(signal)
            waiters.hand_over(signal.group, before, signal)

    def get(self, key: str, waiter: str) -> _Signal | None:
        with self.lock:
            waiters = self.by_key.get(key)
            return None if waiters is None else waiters.by_id.get(waiter)

    def retick(self, key: str, waiter: str, ticket: int) -> bool:
        """Move ``waiter`` to its new place ``ticket``; ``False`` when it is not registered."""
        with self.lock:
            waiters = self.by_key.get(key)
            signal = None if waiters is None else waiters.by_id.get(waiter)
            if waiters is None or signal is None:
                return False
            before = waiters.earliest(signal.group)
            waiters.drop(signal)
            signal.ticket = ticket
            waiters.put(signal)
            waiters.hand_over(signal.group, before, signal)
            return True

    def polls(self, key: str, waiter: str) -> bool:
        """Whether ``waiter`` is the earliest of its group here: the one that polls."""
        with self.lock:
            waiters = self.by_key.get(key)
            signal = None if waiters is None else waiters.by_id.get(waiter)
            return (waiters is not None and signal is not None
                    and waiters.earliest(signal.group) is signal)

    def remove(self, key: str, waiter: str) -> bool:
        with self.lock:
            waiters = self.by_key.get(key)
            if waiters is None:
                return True  # nobody of this database waits any more
            gone = waiters.by_id.pop(waiter, None)
            if gone is not None:
                before = waiters.earliest(gone.group)
                waiters.drop(gone)
                if gone.event.is_set():
                    # Woken and never back at a begin with it: the slot it was woken for may
                    # be free still, and the waiters behind it would not hear of it until
                    # they poll.
                    waiters.wake_first(gone.group)
                waiters.hand_over(gone.group, before, gone)
            if not waiters.by_id:
                del self.by_key[key]
                return True  # nobody of this database waits any more
            return False

    def waiting(self, key: str) -> bool:
        """Whether a waiter of the database ``key`` waits in this process."""
        with self.lock:
            return bool(self.by_key.get(key))

    def poke(self, key: str, group: str | None) -> int:
        with self.lock:
            waiters = self.by_key.get(key)
            if waiters is None:
                return 0
            if group is not None:
                return waiters.wake_first(group)
            signals = list(waiters.by_id.values())
        for s in signals:
            s.set()
        return len(signals)


_REGISTRY = _Registry()


@in_child
def _forked_registry() -> None:
    # The parent's waiters wait in the parent: left here, they would be the earliest of
    # their groups, and this process's own would wait for their turn.
    global _REGISTRY
    _REGISTRY = _Registry()


def poke(key: str, group: str | None) -> int:
    """Wake this process's earliest waiter of ``group`` not woken yet, on the database named
    ``key`` (a store's :attr:`SlotWaker.key`, its context's ``where``): one slot of the group
    came free (``None``: every waiter of every group). For the paths that free slots without
    the store's waker at hand (recovery, ``close_run``); call it after the commit, or the
    waiter begins before the slot is free. Returns how many were woken (0 or 1 for a group)."""
    return _REGISTRY.poke(key, group)


class Stopping(Protocol):
    """What a listener checks between waits for notifications: told to stop, it returns."""

    def is_set(self) -> bool: ...


#: Listens for the database's queue notifications until its ``Stopping`` is set, telling each
#: one (its group id; ``""`` once it listens).
Listener = Callable[[Callable[[str], None], Stopping], None]


class SlotWaker:
    """The wake-ups of one store's database in this process.

    Args:
        key: Names the database (its URL without the password): ledgers of one process on one
            database share their waiters' wake-ups.
        poll_s: The longest the earliest waiter of a group (in this process) waits without a
            signal before it begins again; the others wait :data:`IDLE_POLLS` times longer.
        listen: Opens a listening connection that calls its argument with a group id for each
            notification of another process (or of a connection outside this process's
            pools) until the :class:`Stopping` it gets is set (PostgreSQL); ``None``: no
            channel. The connection is the process's for the database ``key``, shared by
            every store open on it (the first one's ``listen`` opens it, the last one's
            :meth:`close` stops it).
        offload: Runs a blocking call for a waiter on the running loop, awaited (the store's
            :class:`~ledger.storage.runner.Workers`); ``None``: :func:`asyncio.to_thread`.
    """

    def __init__(self, key: str, poll_s: float,
                 listen: Listener | None = None,
                 *, offload: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.key = key
        self._offload = offload or asyncio.to_thread
        self.poll_s = poll_s
        self._listen = listen
        #: The database's listening connection in this process, shared with every other store
        #: open on it (``None``: no channel, or this store is closed).
        self._channel = None if listen is None else _CHANNELS.open(key, self)
        #: This store's waiters (the registry is the process's): waiter id -> group, for the
        #: store's close to give up their places (:meth:`queued`).
        self._mine: dict[str, str] = {}
        self._mine_lock = threading.Lock()
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child: the parent's waiters are not this process's."""
        self._mine = {}
        self._mine_lock = threading.Lock()

    def poke(self, group: str | None) -> None:
        """Wake this process's earliest waiter of ``group`` not woken yet: one slot came free
        (``None``: every waiter of every group)."""
        poke(self.key, group)

    def join(self, group: str, waiter: str, ticket: int) -> bool:
        """Register ``waiter``, at queue place ``ticket``, for ``group``'s wake-ups; ``False``
        when it already was (its ticket is updated: a lapsed place is taken anew).

        Returns once the listening connection listens, or after :data:`LISTEN_READY_S`.
        """
        if self._known(waiter, ticket):
            return False
        _REGISTRY.add(self.key, waiter, _Signal(group, ticket))
        ready = self._listening()
        if ready is not None:
            ready.wait(LISTEN_READY_S)
        return True

    async def ajoin(self, group: str, waiter: str, ticket: int) -> bool:
        """:meth:`join` for a waiter on the running loop: its signal is also an
        :class:`asyncio.Event`, and the wait for the listening connection is on a worker
        thread, so the loop runs meanwhile (a server slow to accept a connection would
        otherwise stop it for up to :data:`LISTEN_READY_S`)."""
        if self._known(waiter, ticket):
            return False
        signal = _Signal(group, ticket, loop=asyncio.get_running_loop(),
                         aevent=asyncio.Event())
        _REGISTRY.add(self.key, waiter, signal)
        ready = self._listening()
        if ready is not None and not ready.is_set():
            await self._offload(ready.wait, LISTEN_READY_S)
        return True

    def own(self, waiter: str, group: str) -> None:
        """Count ``waiter``'s place in ``group`` as this store's, for its close to give up
        (:meth:`~ledger.storage.store.Store.begin_attempt`, as its begin queues: before the
        waiter joins, so a close in between finds it)."""
        with self._mine_lock:
            self._mine[waiter] = group

    def queued(self) -> list[tuple[str, str]]:
        """This store's waiters still registered: (waiter id, group) each."""
        with self._mine_lock:
            return list(self._mine.items())

    def _known(self, waiter: str, ticket: int) -> bool:
        return _REGISTRY.retick(self.key, waiter, ticket)

    @property
    def idle_s(self) -> float:
        """How long a waiter that is not the earliest of its group here waits without a
        signal (:data:`IDLE_POLLS` polling intervals)."""
        return self.poll_s * IDLE_POLLS

    def polls(self, waiter: str) -> bool:
        """Whether ``waiter`` is the earliest waiter of its group in this process: the one
        that polls every :attr:`poll_s`; the others wait for a signal, at most
        :attr:`idle_s`."""
        return _REGISTRY.polls(self.key, waiter)

    def interval(self, waiter: str) -> float:
        """The longest ``waiter`` waits without a signal: :attr:`poll_s` for the group's
        earliest here, :attr:`idle_s` for the others."""
        return self.poll_s if self.polls(waiter) else self.idle_s

    def leave(self, waiter: str) -> None:
        """Forget ``waiter`` (it was served, gave up or was cancelled); a wake it did not use
        goes to the next waiter of its group."""
        with self._mine_lock:
            self._mine.pop(waiter, None)
        if _REGISTRY.remove(self.key, waiter):
            # By key, not this store's: a waiter of a store closed meanwhile may be the last.
            _CHANNELS.idle(self.key)

    def signal(self, waiter: str) -> _Signal | None:
        """The registered signal of ``waiter``."""
        return _REGISTRY.get(self.key, waiter)

    def wait(self, waiter: str, seconds: float, sleeper: Any) -> None:
        """Wait for ``waiter``'s signal, at most ``seconds`` and its :meth:`interval`."""
        signal = self.signal(waiter)
        wait = getattr(sleeper, "sleep_until_woken", None)
        if signal is None or wait is None:
            sleeper.sleep(min(seconds, self.poll_s))
            return
        wait(seconds, signal.event, self.interval(waiter))
        signal.clear()

    async def await_(self, waiter: str, seconds: float, sleeper: Any) -> None:
        """The coroutine form of :meth:`wait`."""
        signal = self.signal(waiter)
        wait = getattr(sleeper, "asleep_until_woken", None)
        if signal is None or signal.aevent is None or wait is None:
            await sleeper.asleep(min(seconds, self.poll_s))
            return
        await wait(seconds, signal.aevent, self.interval(waiter))
        signal.clear()

    # -- the listening connection (PostgreSQL) ---------------------------------------------

    def _listening(self) -> threading.Event | None:
        """Start the database's listening connection unless it runs: the event it sets once it
        listens (or gave up), for the waiters that joined meanwhile to wait on."""
        channel = self._channel
        return None if channel is None else channel.ensure()

    def close(self) -> None:
        """Leave the database's listening connection to the other stores open on it; the last
        one stops it, and returns once its connection is closed (waiters of this database in
        this process, if any are left, keep polling). Closing again does nothing."""
        channel, self._channel = self._channel, None
        if channel is not None:
            _CHANNELS.close(channel, self)


class _Stop:
    """A listening thread's stop, which a waiter joining before the thread saw it takes back:
    the connection goes on rather than a second one opening beside it (both listening for a
    while, each notification heard twice) and the first closing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked = False
        self.final = False  # the thread saw it: it is on its way out, for good

    def set(self) -> None:
        with self.lock:
            self.asked = True

    def asked_to(self) -> bool:
        """Whether it is asked to stop now (without ending it: a notification's check)."""
        with self.lock:
            return self.asked

    def is_set(self) -> bool:
        """The listener's check between waits; ``True`` ends it for good."""
        with self.lock:
            self.final = self.asked
            return self.asked

    def take_back(self) -> bool:
        """Cancel the stop unless the thread saw it already; whether it goes on."""
        with self.lock:
            if self.final:
                return False
            self.asked = False
            return True


class _Channel:
    """The listening connection of this process to one database (PostgreSQL), shared by every
    store open on it: each notification is heard once, and wakes one waiter here.

    It runs while a waiter of the database waits here and a store of it is open, with the
    ``listen`` of the earliest store opened that has one (they differ only in the password a
    URL carries, if at all: the key is the URL without it)."""

    def __init__(self, key: str) -> None:
        self.key = key
        #: The stores open on the database, in the order they opened: the count that keeps it.
        self.wakers: list[SlotWaker] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        #: Every thread started and maybe not ended yet (one stopped goes on until its next
        #: :data:`LISTEN_CHECK_S`): the last close waits for all of them.
        self.threads: list[threading.Thread] = []
        self.stop = _Stop()
        self.ready = threading.Event()

    def ensure(self) -> threading.Event | None:
        """Start listening unless it runs; the event set once it listens (or gave up). A slot
        freed after that wakes the waiters; one freed before it is found by their next begin
        or poll."""
        with self.lock:
            if self.thread is not None and self.thread.is_alive() and self.stop.take_back():
                return self.ready
            listen = next((w._listen for w in self.wakers if w._listen is not None), None)
            if listen is None:
                return None
            stop, ready = _Stop(), threading.Event()
            key = self.key

            def run() -> None:
                def told(group: str) -> None:
                    ready.set()
                    # Nobody waits here now; the next waiter begins once this connection (or
                    # a new one) listens, and finds the slot then.
                    if group and not stop.asked_to():
                        _REGISTRY.poke(key, group)
                try:
                    listen(told, stop)
                except Exception as e:  # the waiters fall back to polling
                    log.info("queue notifications from %s stopped: %s", key, e)
                finally:
                    ready.set()

            self.stop, self.ready = stop, ready
            self.thread = threading.Thread(target=run, name="ledger-slot-listener",
                                           daemon=True)
            self.threads = [t for t in self.threads if t.is_alive()] + [self.thread]
            self.thread.start()
            return ready

    def idle(self) -> None:
        """Nobody of the database waits here any more: stop listening (the next waiter starts
        it again, or takes the stop back while the connection has not seen it yet)."""
        with self.lock:
            # A waiter may have joined since the last one left, and found it listening.
            if not _REGISTRY.waiting(self.key):
                self.stop.set()


class _Channels:
    """Every :class:`_Channel` of this process, by database (the stores' key)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, _Channel] = {}

    def open(self, key: str, waker: SlotWaker) -> _Channel:
        with self.lock:
            channel = self.by_key.setdefault(key, _Channel(key))
            channel.wakers.append(waker)
            return channel

    def idle(self, key: str) -> None:
        with self.lock:
            channel = self.by_key.get(key)
        if channel is not None:
            channel.idle()

    def close(self, channel: _Channel, waker: SlotWaker) -> None:
        """``waker``'s store closed; the last store of the database stops the listening
        connection and waits (up to a few :data:`LISTEN_CHECK_S`) until it is closed."""
        with self.lock:
            channel.wakers.remove(waker)
            if channel.wakers:
                return
            if self.by_key.get(channel.key) is channel:
                del self.by_key[channel.key]
            with channel.lock:
                channel.thread = None
                channel.stop.set()
                threads, channel.threads = channel.threads, []
        for thread in threads:
            thread.join(4 * LISTEN_CHECK_S)


_CHANNELS = _Channels()


@in_child
def _forked_channels() -> None:
    # The listening threads are the parent's and do not exist here; their connection, a
    # local of such a thread, is the parent's too, and psycopg ends a connection only in the
    # process that opened it. Each channel of an open store starts a listener of this
    # process when a waiter here needs one.
    _CHANNELS.lock = threading.Lock()
    for channel in _CHANNELS.by_key.values():
        channel.lock = threading.Lock()
        channel.thread = None
        channel.threads = []
        channel.stop = _Stop()
        channel.ready = threading.Event()


__all__ = ["IDLE_POLLS", "LISTEN_CHECK_S", "LISTEN_READY_S", "Listener", "SlotWaker", "Stopping",
           "poke"]
