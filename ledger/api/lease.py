"""Leases in practice: renewal the LLM call cannot starve, and a clear fenced-out signal.

A :class:`LeaseKeeper` (thread) or :class:`AsyncLeaseKeeper` (asyncio task) renews a Run's
lease every ``ttl/3`` (or more often) on its own schedule, independently of the work that holds
the lease: a model call that blocks for minutes cannot delay a renewal. The moment a renewal
learns that the run was taken over (:class:`FencedOut`), or the lease ran out while the database
was unreachable (:class:`LeaseLost`), the keeper sets ``lost`` and every later :meth:`check`
raises; the async keeper can also cancel the task doing the work (:meth:`watch`).

Graceful shutdown (:meth:`close`) settles what the keeper was told is in flight: an Attempt
whose request never left the process (``track(..., sent=False)``) is settled as a failure
*before send*, which voids its hold; one that was sent without a receipt is marked unknown and
keeps its hold; then the lease is released. A fenced-out keeper writes nothing.

Both twins share one implementation of the schedule (:class:`KeeperCore.tick`); time comes from
an injectable clock and the waits from an injectable sleeper, so tests never sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ledger.clock import Clock, Sleeper
from ledger.domain.bounds import MAX_LEASE_TTL_S, check_seconds
from ledger.domain.facts import Category, FailureFact, Phase, Source
from ledger.domain.records import Lease
from ledger.domain.validation import checked_calls
from ledger.errors import DatabaseUnavailable, FencedOut, InvalidArgument, LeaseLost

if TYPE_CHECKING:
    from ledger.api.facade import AsyncLedger, Ledger


SHUTDOWN_FACT = FailureFact(category=Category.CANCELLED, phase=Phase.BEFORE_SEND,
                            source=Source.LOCAL, message="executor shut down before sending")


class KeeperCore:
    """The schedule and state shared by both keepers.

    ``tick()`` does at most one renewal and returns the seconds to wait before the next tick.
    """

    def __init__(self, ledger: Ledger, lease: Lease, *, ttl_s: float,
                 interval_s: float | None = None, clock: Clock | None = None) -> None:
        from ledger.api.facade import _lease

        _lease(lease)
        ttl_s = check_seconds(ttl_s, "ttl_s", maximum=MAX_LEASE_TTL_S, positive=True)
        limit = ttl_s / 3
        if interval_s is None:
            interval_s = limit
        interval_s = check_seconds(interval_s, "interval_s", positive=True)
        if not 0 < interval_s <= limit:
            raise InvalidArgument(
                f"interval_s must be in (0, ttl_s/3 = {limit:g}]: renewal every third of the "
                "lease or more often; pass a smaller interval_s or None", field="interval_s")
        if clock is not None and not callable(getattr(clock, "now", None)):
            raise InvalidArgument("clock must have a now() method; pass e.g. ManualClock(t)",
                                  field="clock")
        self.ledger = ledger
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.retry_s = max(interval_s / 4, 0.01)
        self.clock: Clock = clock or ledger.clock
        self._lease = lease
        self._next = self.clock.now() + interval_s
        self._lock = threading.Lock()
        self.lost = threading.Event()
        self.error: FencedOut | None = None
        self.renewals = 0
        self.failures = 0
        self.in_flight: dict[str, bool] = {}  # attempt id -> sent?
        self._on_lost: list[Callable[[FencedOut], None]] = []

    @property
    def lease(self) -> Lease:
        with self._lock:
            return self._lease

    def check(self) -> None:
        """Raise :class:`FencedOut` (or :class:`LeaseLost`) once the run was lost."""
        if self.error is not None:
            raise self.error

    def track(self, attempt_id: str, *, sent: bool = False) -> None:
        """Tell the keeper an Attempt is in flight (begun; ``sent`` once the request left)."""
        with self._lock:
            self.in_flight[attempt_id] = sent

    def mark_sent(self, attempt_id: str) -> None:
        self.track(attempt_id, sent=True)

    def untrack(self, attempt_id: str) -> None:
        """The Attempt was settled."""
        with self._lock:
            self.in_flight.pop(attempt_id, None)

    def _lose(self, err: FencedOut) -> None:
        self.error = err
        self.lost.set()
        for cb in list(self._on_lost):
            cb(err)

    def tick(self) -> float:
        if self.error is not None:
            return math.inf
        now = self.clock.now()
        if now < self._next:
            return self._next - now
        lease = self.lease
        try:
            new = self.ledger.renew_lease(lease, ttl_s=self.ttl_s)
        except FencedOut as e:
            self._lose(e)
            return math.inf
        except DatabaseUnavailable as e:
            self.failures += 1
            now = self.clock.now()
            if now >= lease.expires_at:
                err = LeaseLost(
                    f"the lease on run {lease.run_id!r} expired at {lease.expires_at} while the "
                    "database was unreachable; another executor may hold it now: stop working "
                    "on the run", run_id=lease.run_id, fence=lease.fence)
                err.__cause__ = e
                self._lose(err)
                return math.inf
            self._next = min(now + self.retry_s, lease.expires_at)
            return self._next - now
        with self._lock:
            self._lease = new
        self.renewals += 1
        now = self.clock.now()
        self._next = now + self.interval_s
        return self.interval_s

    def shutdown_writes(self) -> None:
        """Settle or mark unknown what is in flight, then release the lease."""
        if self.error is not None:
            return  # fenced out: nothing of ours may be written
        lease = self.lease
        with self._lock:
            pending = dict(self.in_flight)
        for attempt_id, was_sent in pending.items():
            if was_sent:
                self.ledger.mark_unknown(lease, attempt_id,
                                         "executor shut down: sent without a receipt")
            else:
                self.ledger.settle_attempt(lease, attempt_id, outcome="not_sent",
                                           fact=SHUTDOWN_FACT)
            self.untrack(attempt_id)
        self.ledger.release_lease(lease)


@checked_calls
class LeaseKeeper(KeeperCore):
    """Renews in a daemon thread. Use as a context manager, or ``start()`` / ``close()``."""

    def __init__(self, ledger: Ledger, lease: Lease, *, ttl_s: float,
                 interval_s: float | None = None, clock: Clock | None = None,
                 sleeper: Sleeper | None = None) -> None:
        from ledger.api.facade import Ledger

        if not isinstance(ledger, Ledger):
            raise InvalidArgument("ledger must be a ledger.Ledger (AsyncLeaseKeeper takes an "
                                  "AsyncLedger)", field="ledger")
        super().__init__(ledger, lease, ttl_s=ttl_s, interval_s=interval_s, clock=clock)
        self._sleeper = sleeper
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
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

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def close(self, *, graceful: bool = True) -> None:
        """Stop renewing; with ``graceful`` settle or mark unknown what is in flight and
        release the lease.
        """
        self.stop()
        if graceful:
            self.shutdown_writes()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@checked_calls
class AsyncLeaseKeeper:
    """The asyncio twin: renews in a task (the database call runs in a worker thread), can
    cancel the task doing the work when the run is lost.
    """

    def __init__(self, ledger: AsyncLedger, lease: Lease, *, ttl_s: float,
                 interval_s: float | None = None, clock: Clock | None = None,
                 sleeper: Sleeper | None = None) -> None:
        from ledger.api.facade import AsyncLedger

        if not isinstance(ledger, AsyncLedger):
            raise InvalidArgument("ledger must be a ledger.AsyncLedger (LeaseKeeper takes a "
                                  "Ledger)", field="ledger")
        self.core = KeeperCore(ledger.sync, lease, ttl_s=ttl_s, interval_s=interval_s,
                               clock=clock)
        self._sleeper = sleeper
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._watched: list[asyncio.Task[Any]] = []
        self.core._on_lost.append(self._cancel_watched)

    @property
    def lease(self) -> Lease:
        return self.core.lease

    @property
    def lost(self) -> threading.Event:
        return self.core.lost

    def check(self) -> None:
        self.core.check()

    def track(self, attempt_id: str, *, sent: bool = False) -> None:
        self.core.track(attempt_id, sent=sent)

    def mark_sent(self, attempt_id: str) -> None:
        self.core.mark_sent(attempt_id)

    def untrack(self, attempt_id: str) -> None:
        self.core.untrack(attempt_id)

    def watch(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` the moment the run is lost."""
        self._watched.append(task)
        if self.core.error is not None:
            task.cancel()

    def _cancel_watched(self, _err: FencedOut) -> None:
        for t in self._watched:
            loop = t.get_loop()
            loop.call_soon_threadsafe(t.cancel)

    def start(self) -> AsyncLeaseKeeper:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def _loop(self) -> None:
        while not self._stop.is_set():
            delay = await asyncio.to_thread(self.core.tick)
            if math.isinf(delay):
                return
            if self._sleeper is not None:
                await self._sleeper.asleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def close(self, *, graceful: bool = True) -> None:
        await self.stop()
        if graceful:
            await asyncio.to_thread(self.core.shutdown_writes)

    async def __aenter__(self) -> AsyncLeaseKeeper:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncLeaseKeeper", "KeeperCore", "LeaseKeeper", "LeaseLost"]
