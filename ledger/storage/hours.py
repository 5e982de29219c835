"""Hours of history: how a time window splits into hours the roll-ups hold and the rest.

Hour ``h`` is ``[3600*h, 3600*(h+1))`` of ``attempts.created_at``; the roll-ups
(:mod:`ledger.storage.rollups`) hold the attempts not in flight of the hours marked in
``rollup_hours``, and the audit's totals read everything else from ``attempts``. An old day
whose hours are all rolled may be folded (``rollup_days``): its rows are summed per key into
rows at its first hour, which only a window holding the whole day can read.
"""

from __future__ import annotations

import math
from bisect import bisect_right
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
#: The hour of the roll-up rows that carry what retention dropped (``metric_rollups``,
#: ``move_rollups``, ``wait_rollups``): one row per key, what ``/metrics`` counted of the
#: dropped attempts, moves and capacity waits, so its counters never go down when history is
#: dropped (:mod:`ledger.storage.retention`). Some 125 million years before 1970: no row of the
#: history is in it, so it is never marked in ``rollup_hours`` and no window's read (each reads
#: the roll-ups of marked hours only, :func:`rolled_stretches`), roll-up, fold or trigger ever
#: touches it; only the whole-history counters add it in
#: (:meth:`~ledger.storage.series.SeriesQueries.metrics_totals`).
CARRIED_HOUR = -(1 << 40)
#: The attempts a roll-up leaves to the audit's own read: those in flight, whose settle comes
#: within seconds and would only undo their hour. ``unknown`` attempts are rolled (migration
#: 0015): they can stay unknown for months, so reading them live made every whole-history read
#: grow with them, and the one write that ends them (an operator's ``settle_unknown``, or
#: retention) undoes their hour like any other.
OPEN_STATES = (AttemptState.DISPATCHING.value,)
#: The statuses of a Run that may still change what it counts; ``run_rollups`` keeps the others.
LIVE_STATUSES = (RunStatus.ADMITTED.value, RunStatus.RUNNING.value)
#: PostgreSQL: the first key of an hour's advisory lock, ``(PG_HOUR_LOCK, hour % 2^31)``
#: (PostgreSQL's ``%``, keeping the sign): the triggers of migrations 0011 and 0013 take it
#: shared for each row they see written, a roll-up exclusive before it reads the hour
#: (:meth:`~ledger.storage.context.SqlContext.lock_hour`), and retention shared before it
#: moves rows (:mod:`ledger.storage.retention`).
PG_HOUR_LOCK = 7894


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
                 stretches: Sequence[tuple[int, int]]) -> None:
        col = s.attempts.c.created_at
        #: The window's stretches of rolled hours ``[lo, hi)`` whose rows a read adds up, in
        #: order (:func:`rolled_stretches`); empty: nothing is read from the roll-ups.
        self.stretches = list(stretches)
        self.rolled = self.inside(col)
        # The gaps: before the first stretch, between two, after the last (none if empty).
        starts: list[float | None] = [since, *(float(hi * HOUR) for _, hi in self.stretches)]
        ends: list[float | None] = [*(float(lo * HOUR) for lo, _ in self.stretches), until]
        self._gaps = [(lo, hi) for lo, hi in zip(starts, ends, strict=True)
                      if lo is None or hi is None or lo < hi]
        self.raw = self.gaps(col)

    @property
    def key(self) -> tuple[Any, ...]:
        """What the split's conditions are made of (its stretches of rolled hours and its
        gaps): two splits with the same key read alike, so statements built on one serve
        the other."""
        return (tuple(self.stretches), tuple(self._gaps))

    def inside(self, col: Any) -> list[ColumnElement[bool]]:
        """The stretches of rolled hours, as conditions on the time ``col`` (``rolled`` for
        another table: ``runs.created_at``)."""
        return [hours_in(col, lo, hi) for lo, hi in self.stretches]

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
        if still_open is not None and self.stretches:
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
        return or_(*(hour.between(lo, hi - 1) for lo, hi in self.stretches))


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


def rolled_stretches(conn: Any, since: float | None, until: float | None,
                     buckets: tuple[float, float] | None = None) -> list[tuple[int, int]]:
    """The stretches ``[lo, hi)`` of consecutive rolled hours wholly inside ``[since, until)``
    whose roll-up rows a read can add up, in order. The hours of a folded day
    (:data:`~ledger.storage.schema.rollup_days`, whose rows sit at its first hour) count only
    when the whole day is inside a stretch and, for ``buckets`` ``(origin, width)`` of whole
    hours, inside one bucket; else the day is cut out, and read from the tables like an hour
    not rolled.

    The stretches are found by the database (consecutive hours share ``hour - row_number``):
    a whole history holds thousands of hours, two years 17,000, and reading each into the
    client cost a scrape 23 ms of its CPU."""
    h = s.rollup_hours.c.hour
    conds: list[ColumnElement[bool]] = []
    if since is not None:
        conds.append(h >= first_hour_from(since))
    if until is not None:
        conds.append(h < hour_of(until))  # the hours before until's own end by it
    marks = select(h.label("hour"), (h - func.row_number().over(order_by=h)).label("island")
                   ).where(*conds).subquery("islands")
    first = func.min(marks.c.hour)
    stretches = [(int(lo), int(hi) + 1) for lo, hi in conn.execute(
        select(first, func.max(marks.c.hour)).group_by(marks.c.island).order_by(first))]
    if not stretches:
        return stretches
    d = s.rollup_days.c.day
    folded = [int(x) for x in conn.execute(select(d).where(d.between(
        stretches[0][0] // DAY_HOURS, (stretches[-1][1] - 1) // DAY_HOURS)).order_by(d)).scalars()]
    starts = [lo for lo, _ in stretches]

    def whole(day: int) -> bool:
        lo, hi = day * DAY_HOURS, (day + 1) * DAY_HOURS  # its hours [lo, hi)
        i = bisect_right(starts, lo) - 1
        if i < 0 or stretches[i][1] < hi:  # not wholly inside one stretch
            return False
        if buckets is None:
            return True
        start, wide = buckets[0] / HOUR, buckets[1] / HOUR  # whole hours: see bucketed_split
        return (lo - start) // wide == (hi - 1 - start) // wide

    cuts = [(day * DAY_HOURS, (day + 1) * DAY_HOURS) for day in folded if not whole(day)]
    return _without(stretches, cuts) if cuts else stretches


def _without(stretches: Sequence[tuple[int, int]], cuts: Sequence[tuple[int, int]]
             ) -> list[tuple[int, int]]:
    """``stretches`` less ``cuts`` (both sorted ranges ``[lo, hi)``; cuts do not overlap)."""
    out: list[tuple[int, int]] = []
    i = 0
    for lo, hi in stretches:
        while i < len(cuts) and cuts[i][1] <= lo:
            i += 1
        j = i
        while j < len(cuts) and cuts[j][0] < hi:
            if cuts[j][0] > lo:
                out.append((lo, cuts[j][0]))
            lo = max(lo, cuts[j][1])
            j += 1
        if lo < hi:
            out.append((lo, hi))
    return out


def split(conn: Any, since: float | None, until: float | None) -> Split:
    """:class:`Split` of ``[since, until)`` by the hours rolled now (read on ``conn``)."""
    return Split(since, until, rolled_stretches(conn, since, until))


def bucketed_split(conn: Any, since: float | None, until: float | None, width: float,
                   origin: float | None = None) -> Split | None:
    """:func:`split` of ``[since, until)`` for buckets ``width`` wide from ``origin`` (default
    ``since``), when each holds whole hours (``origin`` starts an hour, ``width`` is whole
    hours: no hour straddles two buckets) and some hour inside is rolled; else ``None``: read
    the window from ``attempts``. A folded day straddling two buckets is read from
    ``attempts``."""
    start = since if origin is None else origin
    if start is None or start % HOUR or width % HOUR:
        return None
    hours = Split(since, until, rolled_stretches(conn, since, until, (start, width)))
    return hours if hours.stretches else None


__all__ = ["CARRIED_HOUR", "DAY_HOURS", "HOUR", "LIVE_STATUSES", "OPEN_STATES", "PG_HOUR_LOCK",
           "Split", "bucketed_split", "first_hour_from", "hour_of", "hours_in", "rolled_stretches",
           "rollup_sums", "split", "summed", "time_range"]
