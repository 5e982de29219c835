"""Time, from one injectable place.

Every decision takes ``now`` as an argument; only the thin drivers read a :class:`Clock` and wait
through a :class:`Sleeper`. Tests inject :class:`ManualClock`, whose sleeper advances the clock
instead of waiting, so no test sleeps to make time pass.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Protocol


class Clock(Protocol):
    """Wall-clock seconds since the epoch (float)."""

    def now(self) -> float: ...


class Sleeper(Protocol):
    """Waits ``seconds``; sync and async forms."""

    def sleep(self, seconds: float) -> None: ...

    async def asleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()


class SystemSleeper:
    """Really waits."""

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)


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

    ``slept`` records every wait, so tests can assert the computed backoff.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = _finite(start, "start")
        self.slept: list[float] = []

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
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
        self._now = _finite(t, "t")

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


__all__ = ["Clock", "ManualClock", "Sleeper", "SystemClock", "SystemSleeper"]
