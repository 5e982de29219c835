"""Hours of history: how a time window splits into hours the roll-ups hold and the rest.

Hour ``h`` is ``[3600*h, 3600*(h+1))`` of ``attempts.created_at``; the roll-ups
(:mod:`ledger.storage.rollups`) hold the attempts not in flight of the hours marked in
``rollup_hours``, and the audit's totals read everything else from ``attempts``. An old day
whose hours are all rolled may be folded (``rollup_days``): its rows are summed per key into
rows at its first hour, which only a window holding the whole day can read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    false,
    func,
    or_,
    select,
    true,
    union_all,
)

from ledger.domain.records import AttemptState, RunStatus
from ledger.storage import schema as s

#: The width of one roll-up, in seconds.
HOUR = 3600
#: The hours of a folded day (``rollup_days``): day ``d`` is hours ``[24*d, 24*(d+1))``.
DAY_HOURS = 24
#: The attempts a roll-up leaves to the audit's own read: those in flight, whose settle comes
#: within seconds and would only undo their hour. ``unknown`` attempts are rolled (migration
#: 0015): they can stay unknown for months, so reading them live made every whole-history read
#: grow with them, and the one write that ends them (an operator's ``settle_unknown``, or
#: retention) undoes their hour like any other.
OPEN_STATES = (AttemptState.DISPATCHING.value,)
#: The statuses of a Run that may still change what it counts; ``run_rollups`` keeps the others.
LIVE_STATUSES = (RunStatus.ADMITTED.value, RunStatus.RUNNING.value)


def hour_of(t: float) -> int:
    """The hour holding time ``t``: ``3600*h <= t < 3600*(h+1)``, in floating point too."""
    h = math.floor(t / HOUR)
    return h - 1 if h * HOUR > t else h


def first_hour_from(t: float) -> int:
    """The first hour that starts at or after ``t``."""
    h = hour_of(t)
    return h if h * HOUR >= t else h + 1


def time_range(col: Any, since: float | None, until: float | None) -> list[ColumnElement[bool]]:
    """``since <= col < until`` as conditions (none for a side that is ``None``)."""
    conds: list[ColumnElement[bool]] = []
    if since is not None:
        conds.append(col >= since)
    if until is not None:
        conds.append(col < until)
    return conds


def _within(col: Any, lo: float | None, hi: float | None) -> ColumnElement[bool]:
    return and_(true(), *time_range(col, lo, hi))


def hours_in(col: Any, lo: int | None, hi: int | None) -> ColumnElement[bool]:
    """``col`` (a time) within hours ``[lo, hi)``; ``None``: unbounded on that side."""
    return _within(col, None if lo is None else lo * HOUR, None if hi is None else hi * HOUR)


class Split:
    """A time window split into what the roll-ups hold and what is read from ``attempts``.

    ``raw``: conditions on ``created_at``, one per stretch of the window not rolled (OR them);
    ``rolled``: one per stretch of consecutive rolled hours (OR them), whose attempts are in
    ``attempt_rollups`` but the ones in flight (:data:`OPEN_STATES`), read from ``attempts``.
    """

    def __init__(self, since: float | None, until: float | None,
                 rolled: Sequence[int]) -> None:
        col = s.attempts.c.created_at
        stretches: list[tuple[int, int]] = []
        for h in rolled:
            if stretches and stretches[-1][1] == h:
                stretches[-1] = (stretches[-1][0], h + 1)
            else:
                stretches.append((h, h + 1))
        self.hours = list(rolled)
        self._stretches = stretches
        self.rolled = self.inside(col)
        # The gaps: before the first stretch, between two, after the last (none if empty).
        starts: list[float | None] = [since, *(float(hi * HOUR) for _, hi in stretches)]
        ends: list[float | None] = [*(float(lo * HOUR) for lo, _ in stretches), until]
        self._gaps = [(lo, hi) for lo, hi in zip(starts, ends, strict=True)
                      if lo is None or hi is None or lo < hi]
        self.raw = self.gaps(col)

    @property
    def key(self) -> tuple[Any, ...]:
        """What the split's conditions are made of (its stretches of rolled hours and its
        gaps): two splits with the same key read alike, so statements built on one serve
        the other."""
        return (tuple(self._stretches), tuple(self._gaps))

    def inside(self, col: Any) -> list[ColumnElement[bool]]:
        """The stretches of rolled hours, as conditions on the time ``col`` (``rolled`` for
        another table: ``runs.created_at``)."""
        return [hours_in(col, lo, hi) for lo, hi in self._stretches]

    def gaps(self, col: Any) -> list[ColumnElement[bool]]:
        """The window's stretches outside the rolled hours, as conditions on the time
        ``col`` (``raw`` for another table: ``events.created_at``)."""
        return [_within(col, lo, hi) for lo, hi in self._gaps]

    def unrolled(self, col: Any, still_open: ColumnElement[bool] | None
                 ) -> ColumnElement[bool]:
        """The rows a read still takes from their own table, by their time ``col``: those
        outside the rolled hours, and inside them those ``still_open`` holds for (rows that
        may still change, which no roll-up keeps; ``None``: none)."""
        left = self.gaps(col)
        if still_open is not None and self.hours:
            left.append(and_(still_open, or_(*self.inside(col))))
        return or_(false(), *left)  # false() when the window is empty

    def attempts_where(self) -> ColumnElement[bool]:
        """The attempts still read from ``attempts``: those outside the rolled hours, and
        the ones in flight (:data:`OPEN_STATES`) inside them."""
        a = s.attempts.c
        return self.unrolled(a.created_at, a.state.in_(OPEN_STATES))

    def rollups_where(self, table: Any = s.attempt_rollups) -> ColumnElement[bool]:
        """The rows of roll-up ``table`` in the window's stretches of rolled hours (a folded
        day's rows sit at its first hour; one left out of the stretches, read from the
        tables, has rows between two of them)."""
        hour = table.c.hour
        return or_(*(hour.between(lo, hi - 1) for lo, hi in self._stretches))


def rollup_sums(*names: str) -> list[ColumnElement[Any]]:
    """The sums of ``attempt_rollups``' columns ``names``, each labelled with its name."""
    t = s.attempt_rollups.c
    return [func.sum(t[n]).label(n) for n in names]


def summed(parts: Sequence[Any], keys: Sequence[str], sums: Sequence[str]) -> Select[Any]:
    """The rows of ``parts`` (selects with columns ``keys`` and ``sums``: a read of the tables
    and a read of the roll-ups) added up per key, as one select."""
    p = union_all(*parts).subquery("parts").c
    by = [p[k] for k in keys]
    return select(*by, *(func.sum(p[n]).label(n) for n in sums)).group_by(*by)


def rolled_hours(conn: Any, since: float | None, until: float | None,
                 buckets: tuple[float, float] | None = None) -> list[int]:
    """The rolled hours wholly inside ``[since, until)`` whose roll-up rows a read can add up, in
    order. The hours of a folded day (:data:`~ledger.storage.schema.rollup_days`, whose rows sit
    at its first hour) count only when the whole day is inside the window and, for
    ``buckets`` ``(origin, width)`` of whole hours, inside one bucket; else the day is read from
    the tables, like an hour not rolled."""
    h = s.rollup_hours.c.hour
    q = select(h).order_by(h)
    if since is not None:
        q = q.where(h >= first_hour_from(since))
    if until is not None:
        q = q.where(h < hour_of(until))  # the hours before until's own end by it
    hours = [int(x) for x in conn.execute(q).scalars()]
    if not hours:
        return hours
    d = s.rollup_days.c.day
    folded = {int(x) for x in conn.execute(select(d).where(
        d.between(hours[0] // DAY_HOURS, hours[-1] // DAY_HOURS))).scalars()}
    if not folded:
        return hours
    inside = set(hours)

    def whole(day: int) -> bool:
        lo, hi = day * DAY_HOURS, (day + 1) * DAY_HOURS - 1  # its first and last hour
        if lo not in inside or hi not in inside:  # a folded day's hours are all marked
            return False
        if buckets is None:
            return True
        start, wide = buckets[0] / HOUR, buckets[1] / HOUR  # whole hours: see bucketed_split
        return (lo - start) // wide == (hi - start) // wide

    kept = {day for day in folded if whole(day)}
    return [x for x in hours if x // DAY_HOURS not in folded or x // DAY_HOURS in kept]


def split(conn: Any, since: float | None, until: float | None) -> Split:
    """:class:`Split` of ``[since, until)`` by the hours rolled now (read on ``conn``)."""
    return Split(since, until, rolled_hours(conn, since, until))


def bucketed_split(conn: Any, since: float, until: float, width: float) -> Split | None:
    """:func:`split` for buckets ``width`` wide from ``since``, when each holds whole hours
    (``since`` starts an hour, ``width`` is whole hours: no hour straddles two buckets) and
    some hour inside is rolled; else ``None``: read the window from ``attempts``. A folded
    day straddling two buckets is read from ``attempts``."""
    if since % HOUR or width % HOUR:
        return None
    hours = Split(since, until, rolled_hours(conn, since, until, (since, width)))
    return hours if hours.hours else None


__all__ = ["DAY_HOURS", "HOUR", "LIVE_STATUSES", "OPEN_STATES", "Split", "bucketed_split",
           "first_hour_from", "hour_of", "hours_in", "rolled_hours", "rollup_sums", "split",
           "summed", "time_range"]
