"""The reads of a replay (``failover-ledger replay``): a window's records, in one transaction.

:class:`ReplayQueries` is built on a :class:`~ledger.storage.context.SqlContext` by
:mod:`ledger.ops.replay`. :meth:`ReplayQueries.window` reads, in one read transaction on one
snapshot of the ledger, everything a replay decides from; nothing here writes, so it works
through a read-only PostgreSQL role. The rows come back as plain mappings; the pure replay
(:mod:`ledger.decide.replay`) works on what :mod:`ledger.ops.replay` makes of them.

Indexes each statement relies on (asserted with EXPLAIN by ``tests/audit/test_plans.py``):

- the window's Runs: ``ix_runs_created_at`` / ``ix_runs_tenant_created_at`` (or the primary
  key, for one Run);
- the Attempts of the window and of its lead-in: ``ix_attempts_created_at``;
- the decisions: ``ix_events_kind_created_at`` (``ix_events_run_id_kind`` for one Run);
- the frozen policies: the primary key of ``runs``, one Run per policy hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from ledger.storage import schema as s
from ledger.storage.context import SqlContext, id_chunks

#: The events a replay reads: the decisions, and the same-route retries' numbers.
DECISION_KINDS = ("select", "stop", "retry")

#: The columns of :attr:`ReplayRows.runs`, in order.
RUN_COLS = ("run_id", "tenant", "role", "status", "plan", "run_grant", "policy_hash",
            "deadline", "created_at", "updated_at")
#: The columns of :attr:`ReplayRows.attempts`, in order (the last is the Run's policy hash).
ATTEMPT_COLS = ("attempt_id", "run_id", "turn_id", "seq", "kind", "route_id", "provider",
                "model", "group_id", "profile_id", "state", "fact", "cost_micros",
                "reserved_micros", "created_at", "settled_at", "policy_hash")
#: The columns of :attr:`ReplayRows.events`, in order.
EVENT_COLS = ("event_id", "run_id", "attempt_id", "kind", "data", "created_at")


@dataclass
class ReplayRows:
    """What :meth:`ReplayQueries.window` read.

    Rows are tuples (many thousands of them are read at once), in the order of
    :data:`RUN_COLS`, :data:`ATTEMPT_COLS` and :data:`EVENT_COLS`. ``runs``: the window's Runs
    (their frozen plan and grant; not the policy); ``attempts``: every Attempt begun from
    ``lead_from`` until the end of the window's Runs, each with its Run's policy hash;
    ``events``: the window's Runs' ``select``, ``stop`` and ``retry`` events; ``policies``:
    each policy hash's frozen policy (JSON text). ``run_exists``: for one Run asked by id,
    whether the ledger has it at all (in the window or not).
    """

    runs: list[tuple[Any, ...]] = field(default_factory=list)
    attempts: list[tuple[Any, ...]] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    policies: dict[str, str] = field(default_factory=dict)
    lead_from: float = 0.0
    end: float = 0.0
    run_exists: bool = True


class ReplayQueries:
    """The replay's read-only queries, on one database (a read-only role serves)."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx

    def window(self, *, since: float | None, until: float | None, run_id: str | None,
               tenant: str | None, lead_s: float,
               attempts_until: float | None = None) -> ReplayRows:
        """The records of the Runs admitted in [since, until) (of ``tenant``; or the one Run
        ``run_id``), and every Attempt from ``lead_s`` before the first of them until the last
        of them was written (and at least until ``until``, else ``attempts_until``), in one
        read transaction on one snapshot. With ``run_id`` and no Run in the window, whether
        the ledger has that Run at all (``run_exists``)."""
        r, a, e = s.runs.c, s.attempts.c, s.events.c
        conds = []
        if run_id is not None:
            conds.append(r.run_id == run_id)
        if since is not None:
            conds.append(r.created_at >= since)
        if until is not None:
            conds.append(r.created_at < until)
        if tenant is not None:
            conds.append(r.tenant == tenant)
        out = ReplayRows()
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            out.runs = [tuple(x) for x in conn.execute(
                select(*(r[c] for c in RUN_COLS)).where(*conds).order_by(r.created_at,
                                                                         r.run_id)).all()]
            if not out.runs:
                if run_id is not None:
                    out.run_exists = conn.execute(
                        select(r.run_id).where(r.run_id == run_id)).first() is not None
                return out
            created, updated = RUN_COLS.index("created_at"), RUN_COLS.index("updated_at")
            first = min(x[created] for x in out.runs)
            last = until if until is not None else attempts_until
            out.end = max(max(x[updated] for x in out.runs), last or 0.0)
            out.lead_from = first - lead_s
            att = (select(*(a[c] for c in ATTEMPT_COLS[:-1]), r.policy_hash)
                   .select_from(s.attempts.join(s.runs, r.run_id == a.run_id))
                   .where(a.created_at >= out.lead_from, a.created_at <= out.end)
                   .order_by(a.created_at, a.attempt_id))
            out.attempts = [tuple(x) for x in conn.execute(att).all()]
            ev = (select(*(e[c] for c in EVENT_COLS))
                  .select_from(s.events.join(s.runs, r.run_id == e.run_id))
                  .where(e.kind.in_(DECISION_KINDS), *conds))
            ev = ev.where(e.run_id == run_id) if run_id is not None else ev.where(
                e.created_at >= first)
            out.events = [tuple(x) for x in conn.execute(ev.order_by(e.event_id)).all()]
            out.policies = self._policies(conn, out)
        return out

    @staticmethod
    def _policies(conn: Connection, out: ReplayRows) -> dict[str, str]:
        """Each policy hash's frozen policy, read from one Run that froze it."""
        one: dict[str, str] = {}
        rh, ah = RUN_COLS.index("policy_hash"), ATTEMPT_COLS.index("policy_hash")
        for row in out.runs:
            one.setdefault(row[rh], row[0])
        for row in out.attempts:
            one.setdefault(row[ah], row[1])
        found: dict[str, str] = {}
        ids: Sequence[str] = sorted(one.values())
        r = s.runs.c
        for chunk in id_chunks(ids):
            q = select(r.policy_hash, r.policy).where(r.run_id.in_(chunk))
            for h, text in conn.execute(q).all():
                found.setdefault(h, text)
        return found


__all__ = ["ATTEMPT_COLS", "DECISION_KINDS", "EVENT_COLS", "RUN_COLS", "ReplayQueries",
           "ReplayRows"]
