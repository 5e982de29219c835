"""Read-only SQL for the dashboard's charts and the ``/metrics`` endpoint.

Like :mod:`ledger.storage.audit`: each method of :class:`SeriesQueries` runs one read
transaction, never writes, and returns plain mappings that :mod:`ledger.ops.audit` turns into
typed results.

- per-route series and costs by day scan one time range of ``attempts`` through
  ``ix_attempts_created_at`` (as the activity chart does);
- the metrics totals are counters over the whole history (Prometheus computes rates from
  them): attempts grouped by route and state, ``move`` events through ``ix_events_kind_created_at``,
  money per tenant from ``runs``, and the current cooldowns from ``health`` and
  ``capacity_groups`` (small tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, case, func, literal_column, select

from ledger.errors import InvalidArgument
from ledger.storage import schema as s
from ledger.storage.audit import charged_and_held
from ledger.storage.context import RowMap, SqlContext


def _maps(rows: Sequence[Any]) -> list[RowMap]:
    return [dict(r._mapping) for r in rows]


class SeriesQueries:
    """The dashboard's series and the counters of ``/metrics``, on one database."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx

    def _bucket(self, col: Any, since: float, width: float) -> ColumnElement[Any]:
        bucket: ColumnElement[Any] = self.ctx.bucket(col, since, width)
        return bucket

    def route_series(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Per route and bucket: attempts, outcomes and the succeeded ones' summed latency.
        Raises :class:`~ledger.errors.InvalidArgument` (``bucket_s`` not > 0)."""
        if bucket_s <= 0:
            raise InvalidArgument("bucket_s must be > 0", field="bucket_s")
        a = s.attempts.c
        ok = a.state == "succeeded"
        q = (select(a.route_id.label("route"),
                    self._bucket(a.created_at, since, bucket_s).label("bucket"),
                    func.count().label("attempts"),
                    func.sum(case((ok, 1), else_=0)).label("succeeded"),
                    func.sum(case((a.state == "failed", 1), else_=0)).label("failed"),
                    func.sum(case((a.state == "unknown", 1), else_=0)).label("unknown"),
                    func.sum(case((ok, a.settled_at - a.created_at), else_=0.0))
                    .label("latency_sum"))
             .where(a.created_at >= since, a.created_at < until)
             .group_by(a.route_id, literal_column("bucket"))
             .order_by(a.route_id, literal_column("bucket")))
        with self.ctx.reading() as conn:
            return _maps(conn.execute(q).all())

    def cost_by_day(self, *, since: float, until: float) -> list[RowMap]:
        """Per UTC day from ``since`` (a midnight) and tenant: attempts and cost in micros."""
        a = s.attempts.c
        charged, held = charged_and_held()
        q = (select(self._bucket(a.created_at, since, 86400.0).label("day"),
                    a.tenant.label("tenant"), func.count().label("attempts"),
                    charged.label("cost_micros"), held.label("held_micros"))
             .where(a.created_at >= since, a.created_at < until)
             .group_by(literal_column("day"), a.tenant)
             .order_by(literal_column("day"), a.tenant))
        with self.ctx.reading() as conn:
            return _maps(conn.execute(q).all())

    def metrics_totals(self, now: float) -> dict[str, list[RowMap]]:
        """The whole-history counters ``/metrics`` exposes, in one read."""
        a = s.attempts.c
        e = s.events.c
        r = s.runs.c
        h = s.health.c
        g = s.capacity_groups.c
        with self.ctx.reading() as conn:
            attempts = _maps(conn.execute(
                select(a.route_id.label("route"), a.state.label("outcome"),
                       func.count().label("n"))
                .group_by(a.route_id, a.state).order_by(a.route_id, a.state)).all())
            moves = _maps(conn.execute(
                select(func.count().label("n")).where(e.kind == "move")).all())
            money = _maps(conn.execute(
                select(r.tenant.label("tenant"),
                       func.coalesce(func.sum(r.posted_micros), 0).label("posted_micros"),
                       func.coalesce(func.sum(r.reserved_micros), 0).label("reserved_micros"),
                       func.count().label("runs"))
                .group_by(r.tenant).order_by(r.tenant)).all())
            cooling = _maps(conn.execute(
                select(h.kind.label("kind"), func.count().label("n"))
                .where((h.cooldown_until > now) | (h.disabled_until > now))
                .group_by(h.kind).order_by(h.kind)).all())
            groups = _maps(conn.execute(
                select(g.mode.label("mode"), func.count().label("n"))
                .where(g.mode != "open", (g.until.is_(None)) | (g.until > now))
                .group_by(g.mode).order_by(g.mode)).all())
        return {"attempts": attempts, "moves": moves, "money": money, "cooling": cooling,
                "groups": groups}

__all__ = ["SeriesQueries"]
