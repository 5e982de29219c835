"""Leases in practice: renewal the LLM call cannot starve, and a clear fenced-out signal.

A :class:`LeaseKeeper` (thread) or :class:`AsyncLeaseKeeper` (asyncio task) renews a Run's
lease every ``ttl/3`` (or more often) on its own schedule, independently of the work that holds
the lease: a model call that blocks for minutes cannot delay a renewal. Each renewal is due by
the lease's own end (once no more of it is left than ``ttl - interval``), so a lease handed over
partly run out is renewed in time, at once when it is that close to its end already. The
moment a renewal learns that the run was taken over (:class:`FencedOut`), or the lease can no
longer be renewed while the database was unreachable (:class:`LeaseLost`: renewals are refused
from the ledger's ``lease_margin_s`` before its end), the keeper sets ``lost`` and every
later :meth:`check` raises; the async keeper can also cancel the task doing the work
(:meth:`watch`).

Graceful shutdown (:meth:`close`) settles what the keeper was told is in flight: an Attempt
whose request never left the process (``track(..., sent=False)``) is settled as a failure
*before send*, which voids its hold; one that was sent without a receipt is marked unknown and
keeps its hold; then the lease is released. A fenced-out keeper writes nothing.

Each tick first settles what the process left unresolved for the Run (a begin of the retry owner
whose ``COMMIT``'s outcome was unknown and that was never sent: ``not_sent``; a settle of the
retry owner the database did not take: as the turn decided it), as soon as the database answers
again (:mod:`ledger.decide.resolve`).

A Run session's keeper renews only while the session exists (it holds it weakly): a session
dropped without leaving its block stops the renewals at the next tick, and its lease lapses for
another executor to take the Run over. A ledger closed while the session is open stops them at
once, and releases the lease itself (:meth:`ledger.Ledger.close`).

Both twins share one implementation of the schedule (:class:`KeeperCore.tick`); time comes from
an injectable clock and the waits from an injectable sleeper, so tests never sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import weakref
from collections.abc import Callable
from typing import Annotated, Any

from ledger.api.arguments import ClockArg, LeaseTtl
from ledger.api.face import AsyncFace, Face, SyncFace
from ledger.clock import Clock, Sleeper
from ledger.decide.settle import check_lease_ttl
from ledger.domain.facts import Category, FailureFact, Phase, Source
from ledger.domain.records import Lease, LeaseArg
from ledger.domain.validation import Flag, Id, checked, duration, instance, methods
from ledger.errors import DatabaseUnavailable, FencedOut, InvalidArgument, LeaseLost
from ledger.storage.runner import Flow

log = logging.getLogger(__name__)

Interval = Annotated[float, duration(positive=True)]


SHUTDOWN_FACT = FailureFact(category=Category.CANCELLED, phase=Phase.BEFORE_SEND,
                            source=Source.LOCAL, message="executor shut down before sending")


class KeeperCore:
    """The schedule and state shared by both keepers.

    :meth:`tick` does at most one renewal and returns the seconds to wait before the next tick.
    The arguments are :class:`LeaseKeeper`'s (without ``sleeper``).

    Attributes:
        lost: Set once the Run is lost; :attr:`error` is then the reason.
        error: The :class:`FencedOut` (or :class:`LeaseLost`) that ended it, else ``None``.
        renewals: Renewals done so far.
        failures: Renewals that failed because the database was unreachable (each retried).
        in_flight: The Attempts :meth:`track` registered: attempt id -> sent?
    """

    def __init__(self, ledger: SyncFace[Any, Any] | AsyncFace[Any, Any], lease: Lease, *,
                 ttl_s: float, interval_s: float | None = None, clock: Clock | None = None) -> None:
        # The arguments as a keeper validated them; the rules between them and the ledger's
        # margin: a lease renewed to less would be lost at the next write (acquire_lease
        # refuses it too).
        check_lease_ttl(ttl_s, ledger.lease_margin_s, field="ttl_s", fix="use a longer ttl_s")
        limit = ttl_s / 3
        if interval_s is None:
            interval_s = limit
        if not interval_s <= limit:
            raise InvalidArgument(
                f"interval_s must be in (0, ttl_s/3 = {limit:g}]: renewal every third of the "
                "lease or more often; pass a smaller interval_s or None", field="interval_s")
        self.ledger = ledger
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        # A quarter interval, but never so long that a lease renewed a retry later would be
        # inside the ledger's margin (a ttl_s just above it could otherwise never be renewed).
        self.retry_s = max(min(interval_s / 4, (ttl_s - ledger.lease_margin_s) / 2), 0.001)
        self.clock: Clock = clock or ledger.clock
        self._lease = lease
        self._next = self._due(lease, self.clock.now())
        self._lock = threading.Lock()
        self.lost = threading.Event()
        self.error: FencedOut | None = None
        self.renewals = 0
        self.failures = 0
        self.in_flight: dict[str, bool] = {}  # attempt id -> sent?
        self._on_lost: list[Callable[[FencedOut], None]] = []
        #: Why the last renewal failed; ``None`` once one succeeded.
        self._failed: Exception | None = None
        #: What the lease is kept for (a Run session), when :meth:`_held_by` named it.
        self._owner: weakref.ref[object] | None = None
        #: Set by the ledger's close, which gives the lease up itself (:meth:`_halt`).
        self._halted = False
        #: Only the session's remembered exit is left to write (:meth:`_linger`).
        self._lingering = False

    def _linger(self) -> None:
        """Go on after the session's block only to write its remembered exit.

        The block has ended, so nothing is renewed any more: the exit is tried every
        :attr:`retry_s` until it is written, or until the lease is within the ledger's margin
        of its end (a finish would be refused from then on), and the session may be dropped
        meanwhile.
        """
        self._owner = None
        self._lingering = True

    def _held_by(self, owner: object) -> None:
        """Keep the lease only while ``owner`` (a Run session) exists.

        Held weakly: a session dropped without leaving its block (never exited, then
        garbage-collected) has nobody working under its lease, which must then lapse for
        another executor to take the Run over, not stay renewed until the process exits.
        """
        self._owner = weakref.ref(owner)

    def _halt(self) -> None:
        """Renew no more, from any thread: the ledger is closing and gives the lease up.

        A tick already under way may still try a renewal: the closed ledger refuses it, or the
        release that follows does (a renewal after it is refused as released), and that tick
        ends quietly.
        """
        self._halted = True

    def _due(self, lease: Lease, now: float) -> float:
        """When ``lease`` is next renewed (an interval on, or sooner by its own end).

        Once no more of it is left than after an interval of the steady state
        (``ttl_s - interval_s``), and at least every interval. Counted from the lease's own
        end, not from ``now`` alone: a keeper handed a lease that is partly run out (acquired a
        while ago, or for a shorter time than ``ttl_s``) would otherwise wait a whole interval
        and could let it lapse while the database answered. A lease already within that
        margin is due at once. Never later than a retry before the ledger's lease margin: from
        there on a renewal is refused, so a short lease (``ttl_s`` under 1.5 margins) is
        renewed sooner than the steady state would.
        """
        ahead = max(self.ttl_s - self.interval_s, self.ledger.lease_margin_s + self.retry_s)
        return min(now + self.interval_s, lease.expires_at - ahead)

    @property
    def lease(self) -> Lease:
        """The lease as last renewed (its ``expires_at`` moves on; its fence does not)."""
        with self._lock:
            return self._lease

    def check(self) -> None:
        """Raise :class:`FencedOut` (or :class:`LeaseLost`) once the run was lost."""
        if self.error is not None:
            raise self.error

    @checked
    def track(self, attempt_id: Id, *, sent: Flag = False) -> None:
        """Tell the keeper an Attempt is in flight (begun; ``sent`` once the request left)."""
        with self._lock:
            self.in_flight[attempt_id] = sent

    @checked
    def mark_sent(self, attempt_id: Id) -> None:
        """The tracked Attempt's request left: on shutdown it is marked unknown, not voided."""
        self.track(attempt_id, sent=True)

    @checked
    def untrack(self, attempt_id: Id) -> None:
        """The Attempt was settled."""
        with self._lock:
            self.in_flight.pop(attempt_id, None)

    def _lose(self, err: FencedOut) -> None:
        self.error = err
        self.lost.set()
        for cb in list(self._on_lost):
            cb(err)

    def tick(self) -> float:
        """Renew when due; the seconds until the next tick (``math.inf`` once lost).

        A renewal is due an interval after the last one, or sooner once no more of the lease is
        left than ``ttl_s - interval_s`` (a lease the keeper was handed partly run out: at once
        when it is that close to its end already).
        A keeper of a Run session that was dropped without leaving its block renews no more
        (``math.inf``). A renewal refused with :class:`FencedOut` loses the Run. An
        unreachable database (:class:`DatabaseUnavailable`) is retried every quarter interval
        while a renewal can still be accepted, that is until the ledger's ``lease_margin_s``
        before the lease's end, and at that moment it is lost with :class:`LeaseLost`, without
        a last try the database would refuse. Nothing is raised: :meth:`check` raises
        afterwards. Each tick first resolves what the process left unresolved for the Run (a
        begin of the retry owner whose ``COMMIT``'s outcome was unknown and that was never
        sent: settled ``not_sent``; a settle of the retry owner the database did not take:
        written as the turn decided it, which frees its capacity slot; a Child's admission told
        failed whose outcome was unknown: the Child ended and its carve given back if it landed),
        every quarter interval while the database does not answer.
        """
        return self.ledger._runner.run(self._tick())

    def _tick(self) -> Flow[float]:
        """:meth:`tick` as a flow, for either kind of ledger."""
        if self.error is not None or self._halted:
            return math.inf
        lease = self.lease
        if self._owner is not None and self._owner() is None:
            log.warning("run %s: its Run session was dropped without leaving its block; its "
                        "lease (fence %d) is no longer renewed and lapses at %s, for another "
                        "executor (or recovery) to take the Run over", lease.run_id,
                        lease.fence, lease.expires_at)
            return math.inf
        pending = yield from self._resolve(lease)
        now = self.clock.now()
        # Past this, a renewal is refused as expired: one that failed is given up here rather
        # than tried again to the lease's end, while another process may count it as ended.
        deadline = lease.expires_at - self.ledger.lease_margin_s
        if self._lingering:
            if not pending or self.ledger._store.closed:
                return math.inf  # written (or the close took it over)
            if now >= deadline:
                log.warning("run %s: its session's exit (the Run's finish and its lease's "
                            "release) could not be written before the lease's end at %s; the "
                            "Run stays running until a session of it ends it", lease.run_id,
                            lease.expires_at)
                return math.inf
            return min(self.retry_s, deadline - now)
        if self._failed is not None and now >= deadline:
            self._give_up(lease, self._failed)
            return math.inf
        if now < self._next:
            # An unresolved write is tried again every quarter interval until it is resolved.
            return min(self._next - now, self.retry_s) if pending else self._next - now
        try:
            new = yield from Face.renew_lease.flow(self.ledger, lease, ttl_s=self.ttl_s)
        except Exception as e:
            if self._halted:
                # The ledger closed under the renewal (a refusal of the closed ledger, or of
                # the lease its close released): nothing to tell, nobody lost the Run.
                return math.inf
            if isinstance(e, FencedOut):
                self._lose(e)
                return math.inf
            # An unreachable database, or any other fault of the renewal (a read-only or
            # corrupt file, a database moved away): tried again every quarter interval while
            # the lease may still be renewed, then lost. A keeper that died of it would leave
            # the Run looking kept while its lease ran out.
            self.failures += 1
            self._failed = e
            now = self.clock.now()
            if now >= deadline:
                self._give_up(lease, e)
                return math.inf
            if not isinstance(e, DatabaseUnavailable):
                log.warning("run %s: renewing its lease failed, tried again while it may be "
                            "renewed: %s", lease.run_id, e)
            # The last retry comes before the deadline; at the deadline the next tick gives up.
            self._next = min(now + self.retry_s, deadline)
            return self._next - now
        with self._lock:
            self._lease = new
        self._failed = None
        self.renewals += 1
        now = self.clock.now()
        # Never sooner than a retry: a keeper whose clock runs ahead of the ledger's would
        # find each new lease due already, and renew without pause.
        self._next = max(self._due(new, now), now + self.retry_s)
        return self._next - now

    def _give_up(self, lease: Lease, e: Exception) -> None:
        """Lose the Run with :class:`LeaseLost`.

        Its renewals failed (``e`` the last one's error) until the lease could no longer be
        renewed.
        """
        why = ("the database was unreachable" if isinstance(e, DatabaseUnavailable) else
               f"its renewal failed ({type(e).__name__}: {e})")
        margin = self.ledger.lease_margin_s
        err = LeaseLost(
            f"the lease on run {lease.run_id!r} can no longer be renewed (it ends at "
            f"{lease.expires_at}, and renewals are refused from {margin:g}s before) while "
            f"{why}; another executor may hold it soon: stop working on the run",
            run_id=lease.run_id, fence=lease.fence, expires_at=lease.expires_at)
        err.__cause__ = e
        self._lose(err)

    def _resolve(self, lease: Lease) -> Flow[bool]:
        """Resolve what this process left unresolved for the Run; whether some of it stays.

        That is a begin never sent whose ``COMMIT``'s outcome was unknown, or a settle the
        database did not take (:mod:`ledger.decide.resolve`); it stays while the database does
        not answer.
        """
        store = self.ledger._store
        if not store.pending or not store.pending.of(lease.run_id):
            return False
        try:
            yield from store.resolve_run(lease.run_id, self.ledger.clock.now)
        except Exception as e:  # it stays remembered, and is tried again at the next tick
            if not isinstance(e, DatabaseUnavailable) and not self._halted:
                log.warning("run %s: resolving its unresolved writes failed: %s",
                            lease.run_id, e)
            return True
        return False

    def shutdown_writes(self) -> None:
        """Settle or mark unknown what is in flight, then release the lease.

        An Attempt tracked as not sent is settled ``not_sent`` (its hold voided), one sent
        without a receipt is marked unknown (its hold kept). A keeper that lost the Run writes
        nothing.

        Raises:
            LeaseLost: the lease lapsed before it could be released (the Attempts are settled
                all the same: a settle needs the fence, not a live lease).
            FencedOut: the Run was taken over meanwhile.
            DatabaseUnavailable: the database could not be reached.
        """
        self.ledger._runner.run(self._shutdown())

    def _shutdown(self) -> Flow[None]:
        """:meth:`shutdown_writes` as a flow, for either kind of ledger."""
        if self.error is not None:
            return  # fenced out: nothing of ours may be written
        led, lease = self.ledger, self.lease
        with self._lock:
            pending = dict(self.in_flight)
        for attempt_id, was_sent in pending.items():
            if was_sent:
                yield from Face.mark_unknown.flow(
                    led, lease, attempt_id, "executor shut down: sent without a receipt")
            else:
                yield from Face.settle_attempt.flow(led, lease, attempt_id,
                                                     outcome="not_sent", fact=SHUTDOWN_FACT)
            self.untrack(attempt_id)
        yield from Face.release_lease.flow(led, lease)


class ExitWriter:
    """Writes a Run session's remembered exit from a thread, once the database answers again.

    A session whose exit (the Run's finish and its lease's release) the database refused
    remembers it (:class:`~ledger.decide.resolve.UnresolvedExit`); this thread tries it
    again every :attr:`KeeperCore.retry_s` until it is written or the lease is about to
    lapse (:meth:`KeeperCore._linger`). Blocking, on any ledger (an
    :class:`~ledger.AsyncLedger`'s keeper as well): the event loop may end before the
    database answers. The ledger's close stops it and writes the exit itself.
    """

    def __init__(self, core: KeeperCore) -> None:
        self.core = core
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ledger-exit", daemon=True)

    def start(self) -> bool:
        """Start trying (``core`` lingers from now on); ``False`` once the ledger is closing."""
        entries = self.core.ledger._entries
        if not entries.exit_writer(self):
            return False
        self.core._linger()
        try:
            self._thread.start()
        except BaseException:
            entries.exit_written(self)
            raise
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                delay = self.core.tick()
                if math.isinf(delay):
                    return
                self._stop.wait(delay)
        finally:
            self.core.ledger._entries.exit_written(self)

    def stop(self) -> None:
        """Try no more (the closing ledger writes the exit), and wait for a try under way."""
        self.core._halt()
        self._stop.set()
        if self._thread is not threading.current_thread():
            with contextlib.suppress(RuntimeError):  # never started
                self._thread.join()


@checked
class LeaseKeeper(KeeperCore):
    """Renews a Run's lease in a daemon thread, so a blocking model call cannot starve it.

    Use it as a ``with`` block (started on entering, closed gracefully on leaving), or
    :meth:`start` / :meth:`close`. Call :meth:`check` between steps of the work: it raises once
    the Run was lost.

    Args:
        ledger: The :class:`~ledger.Ledger` the lease is from (an
            :class:`~ledger.AsyncLedger` goes with :class:`AsyncLeaseKeeper`).
        lease: The lease to keep, as :meth:`~ledger.Ledger.acquire_lease` returned it.
        ttl_s: The lease time each renewal asks for (above 0, at most 86 400 s).
        interval_s: How often to renew (default, and at most, ``ttl_s / 3``). The first
            renewal comes sooner when ``lease`` has less than ``ttl_s - interval_s`` left
            after an interval (at once when it has that little left already).
        clock: The clock due renewals are read from (default: the ledger's).
        sleeper: What waits between ticks (default: a stop-aware thread wait); a
            :class:`~ledger.ManualClock` makes a test's keeper advance without sleeping.

    Raises:
        InvalidArgument: ``ledger`` is not a Ledger, ``lease`` is not one it granted,
            ``ttl_s`` or ``interval_s`` are out of range, ``clock`` has no ``now()``.

    Example:
        >>> lease = led.acquire_lease("task-1", ttl_s=30)  # doctest: +SKIP
        >>> with LeaseKeeper(led, lease, ttl_s=30) as keeper:  # doctest: +SKIP
        ...     for step in work:
        ...         keeper.check()  # FencedOut once another executor took the Run over
        ...         step(keeper.lease)
    """

    def __init__(self, ledger: Annotated[SyncFace[Any, Any], instance(
            SyncFace, "a ledger.Ledger", "pass a ledger.Ledger (AsyncLeaseKeeper takes an "
            "AsyncLedger)")], lease: LeaseArg, *, ttl_s: LeaseTtl,
            interval_s: Interval | None = None, clock: ClockArg | None = None,
            sleeper: Annotated[Sleeper, methods("sleep", fix="pass e.g. ManualClock(t)")]
            | None = None) -> None:
        super().__init__(ledger, lease, ttl_s=ttl_s, interval_s=interval_s, clock=clock)
        self._sleeper = sleeper
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        """Start the renewal thread; returns the keeper."""
        self._thread = threading.Thread(target=self._loop, name="ledger-lease", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            delay = self.tick()
            if math.isinf(delay):
                return
            if self._sleeper is not None:
                self._sleeper.sleep(delay)
            else:
                self._stop.wait(delay)

    def _halt(self) -> None:
        super()._halt()
        self._stop.set()  # the thread's wait ends now, not an interval later

    def stop(self) -> None:
        """Stop renewing (the lease is kept until it expires) and wait for the thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # Its start may have been interrupted (a KeyboardInterrupt in Thread.start's wait):
            # the thread never ran, or runs now and finds the stop set before its first tick.
            with contextlib.suppress(RuntimeError):
                self._thread.join()

    def close(self, *, graceful: bool = True) -> None:
        """Stop renewing; with ``graceful``, also :meth:`~KeeperCore.shutdown_writes`.

        Args:
            graceful: Settle or mark unknown what is in flight and release the lease (else the
                lease just runs out, and recovery settles what was in flight).

        Raises:
            LeaseLost: a graceful close after the lease lapsed.
            FencedOut: the Run was taken over meanwhile.
            DatabaseUnavailable: the database could not be reached.
        """
        self.stop()
        if graceful:
            self.shutdown_writes()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@checked
class AsyncLeaseKeeper:
    """The asyncio twin of :class:`LeaseKeeper`: renews in a task, on an AsyncFace.

    Each renewal runs on the ledger's asyncio driver, so the event loop never blocks on the
    database (no worker thread). It
    can cancel the task doing the work the moment the Run is lost (:meth:`watch`). Use it as
    ``async with``, or :meth:`start` / :meth:`close`. The arguments and errors are
    :class:`LeaseKeeper`'s, with an :class:`~ledger.AsyncLedger` for ``ledger``; so are its
    members (:attr:`lost`, :attr:`error`, :attr:`renewals`, :attr:`failures`,
    :attr:`in_flight`, :meth:`tick` and :meth:`shutdown_writes` awaited). :attr:`core` is the
    shared :class:`KeeperCore`.

    Args:
        ledger: The :class:`~ledger.AsyncLedger` the lease is from.
        lease: The lease to keep.
        ttl_s: The lease time each renewal asks for.
        interval_s: How often to renew (default, and at most, ``ttl_s / 3``).
        clock: The clock due renewals are read from (default: the ledger's).
        sleeper: What waits between ticks (its ``asleep``).

    Raises:
        InvalidArgument: as :class:`LeaseKeeper`, or ``ledger`` is not an AsyncFace.
    """

    def __init__(self, ledger: Annotated[AsyncFace[Any, Any], instance(
            AsyncFace, "a ledger.AsyncLedger", "pass a ledger.AsyncLedger (LeaseKeeper takes "
            "a Ledger)")], lease: LeaseArg, *, ttl_s: LeaseTtl,
                 interval_s: Interval | None = None, clock: ClockArg | None = None,
                 sleeper: Annotated[Sleeper, methods("asleep", fix="pass e.g. ManualClock(t)")]
                 | None = None) -> None:
        self.core = KeeperCore(ledger, lease, ttl_s=ttl_s, interval_s=interval_s,
                               clock=clock)
        self._sleeper = sleeper
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        # The watched tasks not yet done: each leaves when it ends, so a host that watches
        # every turn of a long Run does not keep every finished turn alive here.
        self._watched: set[asyncio.Task[Any]] = set()
        self.core._on_lost.append(self._cancel_watched)

    @property
    def lease(self) -> Lease:
        """The lease as last renewed."""
        return self.core.lease

    @property
    def lost(self) -> threading.Event:
        """Set once the Run is lost."""
        return self.core.lost

    @property
    def error(self) -> FencedOut | None:
        """The :class:`FencedOut` (or :class:`LeaseLost`) that ended it, else ``None``."""
        return self.core.error

    @property
    def renewals(self) -> int:
        """Renewals done so far."""
        return self.core.renewals

    @property
    def failures(self) -> int:
        """Renewals that failed because the database was unreachable (each retried)."""
        return self.core.failures

    @property
    def in_flight(self) -> dict[str, bool]:
        """The Attempts :meth:`track` registered: attempt id -> sent?"""
        return self.core.in_flight

    @property
    def ttl_s(self) -> float:
        """The lease time each renewal asks for."""
        return self.core.ttl_s

    @property
    def interval_s(self) -> float:
        """How often it renews."""
        return self.core.interval_s

    def check(self) -> None:
        """Raise :class:`FencedOut` (or :class:`LeaseLost`) once the run was lost."""
        self.core.check()

    async def tick(self) -> float:
        """Renew when due; the seconds until the next tick (see :meth:`KeeperCore.tick`)."""
        return await self.core.ledger._runner.arun(self.core._tick())

    async def shutdown_writes(self) -> None:
        """Settle or mark unknown what is in flight, then release the lease.

        See :meth:`KeeperCore.shutdown_writes` (the same writes and errors, awaited).
        """
        await self.core.ledger._runner.arun(self.core._shutdown())

    def track(self, attempt_id: str, *, sent: bool = False) -> None:
        """Tell the keeper an Attempt is in flight (see :meth:`KeeperCore.track`)."""
        self.core.track(attempt_id, sent=sent)

    def mark_sent(self, attempt_id: str) -> None:
        """The tracked Attempt's request left."""
        self.core.mark_sent(attempt_id)

    def untrack(self, attempt_id: str) -> None:
        """The Attempt was settled."""
        self.core.untrack(attempt_id)

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` the moment the run is lost (at once if it is lost already).

        The keeper holds ``task`` only until it ends: watching every turn of a long Run keeps
        none of the finished ones.
        """
        if not task.done():
            self._watched.add(task)
            task.add_done_callback(self._watched.discard)
        if self.core.error is not None:
            task.cancel()

    def _cancel_watched(self, _err: FencedOut) -> None:
        # A copy: the loss may be learned on another thread while tasks end on their loop.
        for t in tuple(self._watched):
            loop = t.get_loop()
            loop.call_soon_threadsafe(t.cancel)

    def start(self) -> AsyncLeaseKeeper:
        """Start the renewal task on the running loop; returns the keeper."""
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def _loop(self) -> None:
        while not self._stop.is_set():
            delay = await self.tick()
            if math.isinf(delay):
                return
            if self._sleeper is not None:
                await self._sleeper.asleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)

    def _halt(self) -> None:
        """Renew no more (see :meth:`KeeperCore._halt`); called from the closing thread."""
        self.core._halt()
        task = self._task
        if task is not None and not task.done():
            # The event is the loop's: set there, so the task's wait ends now.
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing waits
                task.get_loop().call_soon_threadsafe(self._stop.set)

    async def stop(self) -> None:
        """Stop renewing and wait for the task to end."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def close(self, *, graceful: bool = True) -> None:
        """Stop renewing; with ``graceful``, settle what is in flight and release the lease.

        Args:
            graceful: As :meth:`LeaseKeeper.close`.

        Raises:
            LeaseLost: a graceful close after the lease lapsed.
            FencedOut: the Run was taken over meanwhile.
            DatabaseUnavailable: the database could not be reached.
        """
        await self.stop()
        if graceful:
            await self.shutdown_writes()

    async def __aenter__(self) -> AsyncLeaseKeeper:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncLeaseKeeper", "KeeperCore", "LeaseKeeper", "LeaseLost"]
