"""Time, from one injectable place.

Every decision takes ``now`` as an argument; only the thin drivers read a :class:`Clock` and wait
through a :class:`Sleeper`. Tests inject :class:`ManualClock`, whose sleeper advances the clock
instead of waiting, so no test sleeps to make time pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Wall-clock seconds since the epoch (float): what the ledger reads time from."""

    def now(self) -> float:
        """The current time, in epoch seconds."""
        ...


class Sleeper(Protocol):
    """Waits ``seconds``; sync and async forms (the retry owner waits backoffs through it)."""

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds``."""
        ...

    async def asleep(self, seconds: float) -> None:
        """Wait ``seconds`` without blocking the event loop."""
        ...


class WakeableSleeper(Sleeper, Protocol):
    """A sleeper whose wait a signal can end early (a queued turn waits for a free slot).

    A sleeper without these methods still works: the waiter then polls.
    """

    def sleep_until_woken(self, seconds: float, woken: threading.Event,
                          poll_s: float) -> None:
        """Block until ``woken`` is set or ``seconds`` passed (real time: at most ``poll_s``)."""
        ...

    async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                 poll_s: float) -> None:
        """Wait until ``woken`` is set or ``seconds`` passed, without blocking the loop."""
        ...


class SystemClock:
    """The real clock (:func:`time.time`); the default of :meth:`ledger.Ledger.open`."""

    def now(self) -> float:
        """The system's wall-clock time, in epoch seconds."""
        return time.time()


class SystemSleeper:
    """Really waits (:func:`time.sleep`, :func:`asyncio.sleep`); a wait of 0 or less returns."""

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds``."""
        if seconds > 0:
            time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the event loop."""
        if seconds > 0:
            await asyncio.sleep(seconds)

    def sleep_until_woken(self, seconds: float, woken: threading.Event,
                          poll_s: float) -> None:
        """Block until ``woken`` is set, at most ``min(seconds, poll_s)``."""
        if seconds > 0:
            woken.wait(min(seconds, poll_s))

    async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                 poll_s: float) -> None:
        """Wait until ``woken`` is set, at most ``min(seconds, poll_s)``, on the event loop."""
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(seconds, poll_s))


def _finite(value: object, field: str) -> float:
    # A NaN or infinite time would poison every deadline and lease computed from it.
    from ledger.errors import InvalidArgument

    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{field} must be a number of seconds (got {value!r}); pass a "
                              "float such as 1_700_000_000.0", field=field)
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise InvalidArgument(f"{field} must be finite (got {value!r}); pass a finite number "
                              "of seconds", field=field)
    return v


def _nan(field: str) -> Exception:
    from ledger.errors import InvalidArgument

    return InvalidArgument(f"{field} is NaN; pass a number of seconds", field=field)


class ManualClock:
    """A clock that moves only when told to; also a :class:`Sleeper` that advances it.

    ``slept`` records every wait, so tests can assert the computed backoff. Pass it as the
    ledger's clock and the retry owner waits through it too: no test really sleeps. A lease then
    lasts in this clock's time while its keeper renews on real time, so hold the Run with a
    lease longer than all the time the test (and the turns' waits) move this clock while
    holding it (``lease_ttl_s=3600``), or the next begin raises ``LeaseLost``.

    Args:
        start: The time it starts at, in epoch seconds (finite).

    Raises:
        InvalidArgument: ``start`` is not a finite number.

    Example:
        >>> clock = ManualClock(1_700_000_000.0)
        >>> clock.sleep(2.5)
        >>> clock.now(), clock.slept
        (1700000002.5, [2.5])
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = _finite(start, "start")
        self.slept: list[float] = []

    def now(self) -> float:
        """The clock's time, in epoch seconds."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds`` (``math.inf`` is allowed; NaN is InvalidArgument)."""
        # Infinity is allowed: a keeper's tick() returns it for "never again", and a test may
        # wait that out. NaN is not: it would make every later comparison false.
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            _finite(seconds, "seconds")  # raises: not a number
        try:
            step = float(seconds)
        except OverflowError:  # an int beyond a float: as long as forever
            step = math.inf
        if math.isnan(step):
            raise _nan("seconds")
        self._now += step

    def set(self, t: float) -> None:
        """Set the clock to ``t`` (finite epoch seconds, else InvalidArgument)."""
        self._now = _finite(t, "t")

    def sleep(self, seconds: float) -> None:
        """Record the wait in :attr:`slept` and advance the clock by it (at least 0)."""
        self.slept.append(seconds)
        self.advance(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        """The same as :meth:`sleep`; it never yields to the event loop."""
        self.sleep(seconds)

    def sleep_until_woken(self, seconds: float, woken: threading.Event,
                          poll_s: float) -> None:
        """Return at once if ``woken`` is set; else wait all of ``seconds`` (:meth:`sleep`).

        Manual time has no polling interval: nobody else moves it while this waits, so the
        wait is the whole of it (a test of a queue that is served uses the real clock).
        """
        if not woken.is_set():
            self.sleep(seconds)

    async def asleep_until_woken(self, seconds: float, woken: asyncio.Event,
                                 poll_s: float) -> None:
        """The same as :meth:`sleep_until_woken`; it never yields to the event loop."""
        if not woken.is_set():
            self.sleep(seconds)


__all__ = ["Clock", "ManualClock", "Sleeper", "SystemClock", "SystemSleeper", "WakeableSleeper"]
