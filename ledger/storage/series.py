"""Read-only SQL for the dashboard's charts and the ``/metrics`` endpoint.

Like :mod:`ledger.storage.audit`: each method of :class:`SeriesQueries` runs one read
transaction, never writes, and returns plain mappings that :mod:`ledger.ops.audit` turns into
typed results.

- per-route series and costs by day scan one time range of ``attempts`` through
  ``ix_attempts_created_at`` (as the activity chart does);
- the metrics totals are counters over the whole history (Prometheus computes rates from
  them): attempts grouped by route and state, ``move`` and ``capacity_wait`` events through
  ``ix_events_kind_created_at``, money per tenant from ``runs``, each from the hourly roll-ups
  for the hours rolled (:mod:`ledger.storage.rollups`) and from the table for the rest, plus
  the roll-up rows retention carried over for the history it dropped
  (:data:`~ledger.storage.hours.CARRIED_HOUR`: only these counters read them; every read over
  a window, the series and costs above included, counts the retained history); the current
  cooldowns from ``health`` and ``capacity_groups`` (small tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Table,
    bindparam,
    case,
    cast,
    column,
    func,
    literal_column,
    or_,
    select,
)
from sqlalchemy.sql import Select

from ledger.errors import InvalidArgument
from ledger.storage import schema as s
from ledger.storage.audit import charged_and_held
from ledger.storage.context import RowMap, SqlContext
from ledger.storage.hours import (
    CARRIED_HOUR,
    HOUR,
    LIVE_STATUSES,
    OPEN_STATES,
    Split,
    bucketed_split,
    rollup_sums,
    split,
    summed,
    time_range,
)


def _maps(rows: Sequence[Any]) -> list[RowMap]:
    return [dict(r._mapping) for r in rows]


class SeriesQueries:
    """The dashboard's series and the counters of ``/metrics``, on one database."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx
        # /metrics' four history statements, for one (bounds, split): a scrape builds none
        # until an hour more is rolled. Building them (a histogram is a sum per bucket) and
        # their cache keys was most of a scrape's client CPU. Replaced whole, so threads that
        # race only build twice.
        self._metric_statements: tuple[Any, list[Select[Any]]] | None = None

    def _bucket(self, col: Any, since: float, width: float) -> ColumnElement[Any]:
        bucket: ColumnElement[Any] = self.ctx.bucket(col, since, width)
        return bucket

    def route_series(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Per route and bucket: attempts, outcomes and the succeeded ones' summed latency.

        When ``since`` starts an hour and ``bucket_s`` is a whole number of hours, the settled
        attempts of rolled hours are counted from ``metric_rollups`` (as the activity chart
        counts them from ``attempt_rollups``). Raises :class:`~ledger.errors.InvalidArgument`
        (``bucket_s`` not > 0)."""
        if bucket_s <= 0:
            raise InvalidArgument("bucket_s must be > 0", field="bucket_s")
        a = s.attempts.c
        ok = a.state == "succeeded"
        cols = ("attempts", "succeeded", "failed", "unknown", "latency_sum", "latency_n")
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            hours = bucketed_split(conn, since, until, bucket_s)
            window = ([hours.attempts_where()] if hours is not None
                      else time_range(a.created_at, since, until))
            q = (select(a.route_id.label("route"),
                        self._bucket(a.created_at, since, bucket_s).label("bucket"),
                        func.count().label("attempts"),
                        func.sum(case((ok, 1), else_=0)).label("succeeded"),
                        func.sum(case((a.state == "failed", 1), else_=0)).label("failed"),
                        func.sum(case((a.state == "unknown", 1), else_=0)).label("unknown"),
                        func.sum(case((ok, a.latency_s), else_=None)).label("latency_sum"),
                        func.count(case((ok, a.latency_s), else_=None)).label("latency_n"))
                 .where(*window).group_by(a.route_id, literal_column("bucket")))
            if hours is not None:
                t = s.metric_rollups.c
                won = t.state == "succeeded"
                sums = (select(t.route_id.label("route"),
                               self._bucket(t.hour * HOUR, since, bucket_s).label("bucket"),
                               func.sum(t.n).label("attempts"),
                               func.sum(case((won, t.n), else_=0)).label("succeeded"),
                               func.sum(case((t.state == "failed", t.n), else_=0)).label("failed"),
                               func.sum(case((t.state == "unknown", t.n), else_=0))
                               .label("unknown"),
                               func.sum(case((won, t.latency_s_sum), else_=None))
                               .label("latency_sum"),
                               func.sum(case((won, t.latency_s_n), else_=0)).label("latency_n"))
                        .where(hours.rollups_where(s.metric_rollups))
                        .group_by(t.route_id, literal_column("bucket")))
                q = summed([q, sums], ["route", "bucket"], cols)
            return _maps(conn.execute(q.order_by(literal_column("route"),
                                                 literal_column("bucket"))).all())

    def cost_by_day(self, *, since: float, until: float) -> list[RowMap]:
        """Per UTC day from ``since`` (a midnight) and tenant: attempts and cost in micros.

        The attempts of rolled hours not in flight (:mod:`ledger.storage.rollups`) are summed from
        their roll-ups when ``since`` starts an hour (so no hour straddles two days)."""
        a = s.attempts.c
        charged, held = charged_and_held()
        day = self._bucket(a.created_at, since, 86400.0).label("day")
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            rolled = bucketed_split(conn, since, until, 86400.0)
            window = ([rolled.attempts_where()] if rolled is not None
                      else time_range(a.created_at, since, until))
            q = (select(day, a.tenant.label("tenant"), func.count().label("attempts"),
                        charged.label("cost_micros"), held.label("held_micros"))
                 .where(*window).group_by(literal_column("day"), a.tenant))
            if rolled is not None:
                t = s.attempt_rollups.c
                cols = ("attempts", "cost_micros", "held_micros")
                sums = (select(self._bucket(t.hour * HOUR, since, 86400.0).label("day"),
                               t.tenant.label("tenant"), *rollup_sums(*cols))
                        .where(rolled.rollups_where()).group_by(literal_column("day"), t.tenant))
                q = summed([q, sums], ["day", "tenant"], cols)
            return _maps(conn.execute(q.order_by(literal_column("day"), literal_column("tenant"))
                                      ).all())

    def metrics_totals(self, now: float, bounds: Sequence[float]) -> dict[str, list[RowMap]]:
        """The whole-history counters ``/metrics`` exposes, in one read.

        Per route and outcome: attempts, tokens, money charged, and for each time of an
        Attempt (``latency_s``, ``first_token_s``, ``first_byte_s``) its count, sum and how
        many are at most each of ``bounds`` (a histogram's cumulative buckets); every state,
        ``dispatching`` and ``unknown`` too, which :meth:`~ledger.ops.audit.Audit.metrics`
        turns into gauges (their state will change) and leaves out of the counters. Moves to
        another route by their routes and cause; capacity waits by group and outcome (with
        the same buckets); the places waiting in each group's queue now, and the limited
        groups (``limited``: each has a queue, empty or not).

        The attempts, moves and capacity waits retention dropped count too (the roll-ups'
        rows it carried over, :data:`~ledger.storage.hours.CARRIED_HOUR`), so no counter goes
        down when history is dropped; with ``bounds`` other than
        :data:`~ledger.storage.schema.METRIC_BOUNDS` (whose buckets the roll-ups keep) the
        counts are the retained history's only.
        """
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            # The attempts not in flight, moves, waits and ended Runs of rolled hours, and what
            # retention dropped, come from the roll-ups (whose histograms count into
            # METRIC_BOUNDS only); the rest from tables.
            hours = split(conn, None, None) if tuple(bounds) == s.METRIC_BOUNDS else None
            attempts, moves, waits, money = (
                _maps(conn.execute(q).all()) for q in self._metric_history(bounds, hours))
            at = {"now": now}
            waiting = _maps(conn.execute(_WAITING, at).all())
            limited = _maps(conn.execute(_LIMITED).all())
            cooling = _maps(conn.execute(_COOLING, at).all())
            groups = _maps(conn.execute(_GROUPS_NOT_OPEN, at).all())
        return {"attempts": attempts, "moves": moves, "money": money, "cooling": cooling,
                "groups": groups, "waits": waits, "waiting": waiting, "limited": limited}

    def _metric_history(self, bounds: Sequence[float], hours: Split | None
                        ) -> list[Select[Any]]:
        """The statements of :func:`metric_counts` over ``hours``, built once for those
        bounds and that split."""
        key = (tuple(bounds), None if hours is None else hours.key)
        made = self._metric_statements
        if made is None or made[0] != key:
            made = (key, [self._counted(c, hours) for c in metric_counts(self.ctx, bounds)])
            self._metric_statements = made
        return made[1]

    def _counted(self, c: Counted, hours: Split | None) -> Select[Any]:
        """``c``'s sums per key over its table: every row when ``hours`` is ``None`` (bounds
        the roll-ups do not keep); else the rows the roll-ups leave (outside the rolled hours,
        or still open inside them) plus the rolled hours' rows of ``c.table`` and its rows
        carried over from dropped history (:data:`~ledger.storage.hours.CARRIED_HOUR`)."""
        group = list(c.keys.values())
        raw = select(*(k.label(n) for n, k in c.keys.items()), *c.sums).where(*c.where)
        order: list[Any] = [column(n) for n in c.keys]
        if hours is None:
            return raw.group_by(*group).order_by(*order)
        t = c.table.c
        names = [x.name for x in c.sums]
        # With what retention dropped (its carried rows), even when no hour is rolled: a
        # counter that went down at a retention run would read as a reset to Prometheus.
        carried = t.hour == CARRIED_HOUR
        rows = or_(hours.rollups_where(c.table), carried) if hours.stretches else carried
        rolled = (select(*(t[col].label(n) for n, col in zip(c.keys, c.columns, strict=True)),
                         *(func.sum(t[n]).label(n) for n in names))
                  .where(rows).group_by(*(t[col] for col in c.columns)))
        left = raw.where(hours.unrolled(c.time, c.open)).group_by(
            *(self.ctx.group_key(k) for k in group))
        return summed([left, rolled], list(c.keys), names).order_by(*order)


def _now_counts() -> tuple[Select[Any], Select[Any], Select[Any]]:
    """/metrics' gauges at the bound time ``now``: the places waiting in each group's queue
    (counted as admission counts them, :func:`~ledger.storage.schema.held_until`, within
    their own bound), the cooldowns active by kind, and the groups not open (closed or
    limited) by mode."""
    r, h, g, w = s.runs.c, s.health.c, s.capacity_groups.c, s.group_waiters.c
    now = bindparam("now", type_=Float)
    waiting = (select(w.group_id.label("group"), func.count().label("n"))
               .select_from(s.group_waiters.join(s.runs, r.run_id == w.run_id))
               .where(w.expires_at > now, s.held_until(w.fence) > now)
               .group_by(w.group_id).order_by(w.group_id))
    cooling = (select(h.kind.label("kind"), func.count().label("n"))
               .where((h.cooldown_until > now) | (h.disabled_until > now))
               .group_by(h.kind).order_by(h.kind))
    groups = (select(g.mode.label("mode"), func.count().label("n"))
              .where(g.mode != "open", (g.until.is_(None)) | (g.until > now))
              .group_by(g.mode).order_by(g.mode))
    return waiting, cooling, groups


_WAITING, _COOLING, _GROUPS_NOT_OPEN = _now_counts()
# Every limited group has a queue, so /metrics gives each its waiting gauge even before anyone
# has queued in it (an unlimited group never queues).
_LIMITED = (select(s.capacity_groups.c.group_id.label("group"))
            .where(s.capacity_groups.c.max_in_flight.is_not(None))
            .order_by(s.capacity_groups.c.group_id))


@dataclass(frozen=True)
class Counted:
    """One of ``/metrics``' counts over a history table, as its roll-up keeps it: ``sums``
    (each labelled with its column of ``table``) per ``keys`` (label: expression; the roll-up's
    key ``columns`` in the same order) over the rows ``where`` holds, by the time ``time``.
    The roll-up holds a rolled hour's rows but those ``open`` says may still change (``None``:
    none), which are read from the table (:meth:`SeriesQueries._counted`) and never rolled
    (:class:`~ledger.storage.rollups.RollupQueries`). ``detail``: more keys the roll-up
    keeps (its column: expression) for other readers, which ``/metrics`` sums over."""

    keys: dict[str, Any]
    sums: list[Any]
    where: list[ColumnElement[bool]]
    table: Table
    columns: tuple[str, ...]
    time: Any
    open: ColumnElement[bool] | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def metric_counts(ctx: SqlContext, bounds: Sequence[float]) -> list[Counted]:
    """What ``/metrics`` counts over the history, each as its roll-up keeps it:

    - per route and state over ``attempts``: the attempts, tokens by kind, money charged, and
      :func:`_histogram` of each of ``schema.METRIC_TIMES`` over ``bounds``
      (``metric_rollups``; the ``dispatching`` ones stay open);
    - the ``move`` events to another route (a credential rotated on one route is a retry) by
      their routes and cause (``move_rollups``);
    - the ``capacity_wait`` events by group and outcome, with the histogram of ``waited_s``
      (``wait_rollups``);
    - per tenant over ``runs``: how many, their money posted and held, and their budgets
      (``run_rollups``, kept by labels too for :meth:`~ledger.storage.audit.AuditQueries.spend`;
      live Runs stay open). The trigger that keeps it exact (migrations 0013, 0014) watches the
      columns these are made of (and ``status``, ``created_at``): one more counted here needs
      a migration watching it.
    """
    a, e, r = s.attempts.c, s.events.c, s.runs.c
    charged, _held = charged_and_held()
    attempts: list[Any] = [
        func.count().label("n"),
        func.coalesce(func.sum(a.prompt_tokens), 0).label("input"),
        func.coalesce(func.sum(a.completion_tokens), 0).label("output"),
        func.coalesce(func.sum(a.cached_tokens), 0).label("cache_read"),
        func.coalesce(func.sum(a.reasoning_tokens), 0).label("reasoning"),
        charged.label("charged_micros")]
    for m in s.METRIC_TIMES:
        attempts += _histogram(a[m], m, bounds)
    src = ctx.json_text(e.data, "from_route")
    dst = ctx.json_text(e.data, "to_route")
    waited = cast(ctx.json_text(e.data, "waited_s"), Float)
    return [
        Counted({"route": a.route_id, "outcome": a.state}, attempts, [], s.metric_rollups,
                ("route_id", "state"), a.created_at, a.state.in_(OPEN_STATES)),
        Counted({"from_route": src, "to_route": dst,
                 "category": ctx.json_text(e.data, "cause", "category")},
                [func.count().label("n")],
                [e.kind == "move", or_(src.is_(None), dst.is_(None), src != dst)],
                s.move_rollups, ("from_route", "to_route", "category"), e.created_at),
        Counted({"group": ctx.json_text(e.data, "group"),
                 "outcome": ctx.json_text(e.data, "outcome")},
                _histogram(waited, "waited_s", bounds), [e.kind == "capacity_wait"],
                s.wait_rollups, ("group_id", "outcome"), e.created_at),
        Counted({"tenant": r.tenant},
                [func.count().label("runs"),
                 func.coalesce(func.sum(r.posted_micros), 0).label("posted_micros"),
                 func.coalesce(func.sum(r.reserved_micros), 0).label("reserved_micros"),
                 func.coalesce(func.sum(r.max_cost_micros - r.carved_micros - r.returned_micros), 0)
                 .label("budget_micros")],
                [], s.run_rollups, ("tenant",), r.created_at, r.status.in_(LIVE_STATUSES),
                {"labels": r.labels}),
    ]


def _histogram(col: Any, name: str, bounds: Sequence[float]) -> list[Any]:
    """``{name}_n``, ``{name}_sum`` and ``{name}_le{i}`` (how many are at most
    ``bounds[i]``) of ``col``'s non-NULL values."""
    cols: list[Any] = [func.count(col).label(f"{name}_n"),
                       func.coalesce(func.sum(col), 0.0).label(f"{name}_sum")]
    cols += [func.coalesce(func.sum(case((col <= b, 1), else_=0)), 0).label(f"{name}_le{i}")
             for i, b in enumerate(bounds)]
    return cols

__all__ = ["Counted", "SeriesQueries", "metric_counts"]
