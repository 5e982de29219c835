"""The audit queries' SQL: read-only statements over the ledger's tables.

:class:`AuditQueries` is built on a :class:`~ledger.storage.context.SqlContext` (by
:class:`ledger.ops.audit.Audit`); each of its methods runs one read transaction and none of them
writes, so they work through a read-only PostgreSQL role. Rows come back as plain mappings;
the typed results are built by :mod:`ledger.ops.audit`. Pagination is keyset on
``(created_at, id)`` newest first, so a page costs the same at any depth; aggregates (small
result sets, sorted by cost) page by offset.

Indexes each query relies on (asserted with EXPLAIN by ``tests/audit/test_plans.py``):

- timeline: ``uq_attempts_run_id_seq``, ``ix_events_run_id_event_id``, ``pk_debits``;
- runs page: ``ix_runs_created_at`` / ``ix_runs_status_created_at`` / ``ix_runs_tenant_created_at``;
- failovers, their page and their count: ``ix_runs_failed_over_created_at`` (a Run is marked
  when it fails over, by the write that makes it so: migration 0012);
- totals and activity over a time range: ``ix_attempts_created_at`` (the money each debit
  moved is read off its attempt's row: :func:`charged_and_held`); the totals of rolled hours
  (:mod:`ledger.storage.rollups`) ``ix_attempt_rollups_hour``, and their open attempts
  ``ix_attempts_state_created_at``;
- unknown/unsettled attempts: ``ix_attempts_state_created_at``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    bindparam,
    case,
    exists,
    false,
    func,
    literal,
    literal_column,
    or_,
    select,
    union_all,
)

from ledger.domain.validation import Problem, label_key
from ledger.errors import InvalidArgument
from ledger.storage import schema as s
from ledger.storage.context import IDS_PER_STATEMENT, RowMap, SqlContext, id_chunks
from ledger.storage.encode import fact_member
from ledger.storage.hours import (
    HOUR,
    LIVE_STATUSES,
    Split,
    bucketed_split,
    rollup_sums,
    split,
    summed,
    time_range,
)

#: What :meth:`AuditQueries.totals` can group by.
TOTALS_KEYS = ("route", "group", "run", "tenant", "label", "provider")
#: What :meth:`AuditQueries.latency` can group by, and the times it takes percentiles of.
LATENCY_KEYS = ("route", "group")
LATENCY_MEASURES = ("latency_s", "first_token_s", "first_byte_s")
#: What :meth:`AuditQueries.latency` reports beside them: the latency of the succeeded
#: attempts alone, in the same pass (the dashboard's routes show it beside their health).
SUCCEEDED_LATENCY = "succeeded_latency_s"
# The columns of a row of totals, after its key.
_TOTALS = ("attempts", "succeeded", "failed", "unknown", "prompt_tokens", "completion_tokens",
           "cost_micros", "held_micros")
#: The percentiles the audit reports (p50, p95, p99).
FRACTIONS = (0.5, 0.95, 0.99)

# Columns of ``runs`` an audit needs; the frozen plan/policy JSON stays out of list queries.
_RUN_COLS = (
    "run_id", "parent_run_id", "role", "tenant", "labels", "status", "selected_route",
    "current_route", "current_profile", "calls_used", "retries_used", "reserved_micros",
    "posted_micros", "tokens_used", "max_cost_micros", "max_calls", "max_retries",
    "lease_holder", "lease_expires_at", "fence", "created_at", "updated_at",
    # What is left of its budget is worked out from these too (budget_left).
    "max_tokens", "tokens_reserved", "carved_calls", "carved_retries", "carved_micros",
    "carved_tokens", "returned_calls", "returned_retries", "returned_micros", "returned_tokens",
)

# A Run's timeline, the audit's most frequent read, built once: building a statement and its
# cache key each call cost a third of the read's client CPU.
_TIMELINE_RUN = select(*(s.runs.c[c] for c in _RUN_COLS), s.runs.c.failed_over).where(
    s.runs.c.run_id == bindparam("run_id"))
_TIMELINE_ATTEMPTS = (
    select(s.attempts, s.debits.c.state.label("debit_state"),
           s.debits.c.posted_micros.label("debit_posted_micros"))
    .join(s.debits, s.debits.c.debit_id == s.attempts.c.debit_id)
    .where(s.attempts.c.run_id == bindparam("run_id")).order_by(s.attempts.c.seq))
# Every event kind, lease renewals and admission bookkeeping too: an auditor reading one run
# wants the whole story, and one run has few events.
_TIMELINE_EVENTS = (
    select(*(s.events.c[c] for c in ("event_id", "attempt_id", "kind", "data", "created_at")))
    .where(s.events.c.run_id == bindparam("run_id")).order_by(s.events.c.event_id))


def _bad_cursor(cursor: str) -> InvalidArgument:
    return InvalidArgument(f"malformed cursor {cursor[:40]!r}; pass back next_cursor unchanged "
                           "(none for the first page)", field="cursor")


# The largest offset or event id a cursor may hold: 18 digits, below the 64-bit integer both
# backends bind. A larger one is no page the listing handed out, and binding it fails
# differently per backend (OverflowError on SQLite, "bigint out of range" on PostgreSQL).
_MAX_DIGITS = 18


def _whole(text: str) -> int | None:
    """``text`` as a whole number the backends bind, or None: ASCII digits only (``int`` also
    takes signs, spaces, ``_`` and other scripts' digits, none of which a cursor holds)."""
    if not 0 < len(text) <= _MAX_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def parse_cursor(cursor: str | None) -> tuple[float, str] | None:
    """A keyset cursor ``"<created_at>|<id>"`` (as handed out by the previous page)."""
    if not cursor:
        return None
    try:
        ts_text, last_id = cursor.split("|", 1)
        ts = float(ts_text)
    except ValueError:
        raise _bad_cursor(cursor) from None
    # NaN and infinity are no row's time, and the backends order them differently (NaN
    # after every number on PostgreSQL, as NULL on SQLite): refused, so both answer alike.
    if not math.isfinite(ts) or not last_id:
        # No row has an empty id: "1|" read as a cursor past every row, an empty page.
        raise _bad_cursor(cursor)
    return ts, last_id


def make_cursor(created_at: float, ident: str) -> str:
    return f"{created_at!r}|{ident}"


def _offset(cursor: str | None) -> int:
    if not cursor:
        return 0
    off = _whole(cursor.removeprefix("o:")) if cursor.startswith("o:") else None
    if off is None:
        raise _bad_cursor(cursor)
    return off


# Run ids bound in one statement of the totals by run (a page may hold 10,000 Runs).
_IDS_PER_STATEMENT = IDS_PER_STATEMENT


def _check_limit(limit: int) -> None:
    if limit <= 0 or limit > 10_000:
        raise InvalidArgument("limit must be between 1 and 10000", field="limit")


def _keyset(ts_col: Any, id_col: Any, cursor: str | None) -> list[ColumnElement[bool]]:
    cur = parse_cursor(cursor)
    if cur is None:
        return []
    ts, last = cur
    return [or_(ts_col < ts, and_(ts_col == ts, id_col < last))]


def _maps(rows: Sequence[Any]) -> list[RowMap]:
    return [dict(r._mapping) for r in rows]


def _folded_providers(rows: list[RowMap]) -> list[RowMap]:
    """Totals by provider name as spelled (``key``) merged per name case-folded, keyed by
    that folded name, costliest first (then by name).

    Every column is a sum, so the merged sums are exact; the folded name is the one the
    provider's health key carries (``provider:<folded>``)."""
    merged: dict[str, dict[str, Any]] = {}
    for row in rows:
        name = str(row["key"]).casefold()
        into = merged.setdefault(name, {"key": name, **dict.fromkeys(_TOTALS, 0)})
        for c in _TOTALS:
            into[c] += int(row[c] or 0)
    return sorted(merged.values(), key=lambda r: (-r["cost_micros"], r["key"]))


def in_state(state: str) -> ColumnElement[Any]:
    """How many of the attempts summed are in ``state``."""
    return func.coalesce(func.sum(case((s.attempts.c.state == state, 1), else_=0)), 0)


def charged_and_held() -> tuple[ColumnElement[Any], ColumnElement[Any]]:
    """Sums of what the attempts' debits did, in micros: what the budget was charged (the
    posted amounts) and what is held now (the holds still reserved): the runs' own counters.

    Read off each attempt's row, not its debit's: a join per attempt made the totals three to
    four times slower over a day of history (this costs some 15-20 % over summing one column).
    The row says it exactly, because the settle posted
    :func:`ledger.decide.settle.settle_holds` of these very columns, and reconcile checks every
    posted debit against that rule. The rule, in SQL:

    * ``dispatching``, ``unknown``: the hold is reserved, nothing posted;
    * ``succeeded``, ``failed``: the reported cost, at most the hold; none reported, the whole
      hold — except a failure the provider answered with its status or error body (phase
      ``after_headers``, not a body that failed to parse: transport ``malformed_event``, nor
      one reported inside a 2xx answer: ``accepted``), which generated nothing and posted
      nothing (found in the stored fact's text, which is cheaper than parsing it);
    * ``not_sent``, ``rejected``: voided, nothing held or posted.
    """
    a = s.attempts.c
    posted = case((a.state.in_(("succeeded", "failed")),
                   case((a.cost_micros < a.reserved_micros, a.cost_micros),
                        else_=a.reserved_micros)), else_=0)
    answered = and_(a.state == "failed", a.cost_micros.is_(None),
                    a.fact.contains(fact_member("phase", "after_headers"), autoescape=True),
                    ~a.fact.contains(fact_member("transport", "malformed_event"),
                                     autoescape=True),
                    ~a.fact.contains(fact_member("accepted", True), autoescape=True))
    nothing = case((answered, a.reserved_micros), else_=0)
    held = case((a.state.in_(("dispatching", "unknown")), a.reserved_micros), else_=0)
    charged = func.coalesce(func.sum(posted), 0) - func.coalesce(func.sum(nothing), 0)
    return charged, func.coalesce(func.sum(held), 0)


def _keys_in(col: Any, keys: Sequence[Any]) -> ColumnElement[bool]:
    """``col`` is one of ``keys``, ``None`` among them matching NULL."""
    named = [k for k in keys if k is not None]
    conds = [col.in_(named)] if named else []
    if len(named) < len(keys):
        conds.append(col.is_(None))
    return or_(false(), *conds)


class AuditQueries:
    """The audit's read-only queries, on one database (a read-only role serves)."""

    def __init__(self, ctx: SqlContext) -> None:
        self.ctx = ctx

    def runs(self, *, status: str | None, tenant: str | None, since: float | None,
             until: float | None, limit: int, cursor: str | None
             ) -> tuple[list[RowMap], str | None]:
        """Runs newest first (by status, tenant, admission time), with the next cursor.
        Raises :class:`~ledger.errors.InvalidArgument` (limit, malformed cursor)."""
        _check_limit(limit)
        r = s.runs.c
        conds = time_range(r.created_at, since, until) + _keyset(r.created_at, r.run_id, cursor)
        if status is not None:
            conds.append(r.status == status)
        if tenant is not None:
            conds.append(r.tenant == tenant)
        q = (select(*(r[c] for c in _RUN_COLS)).where(*conds)
             .order_by(r.created_at.desc(), r.run_id.desc()).limit(limit + 1))
        with self.ctx.reading() as conn:
            rows = _maps(conn.execute(q).all())
        nxt = None
        if len(rows) > limit:
            rows = rows[:limit]
            nxt = make_cursor(rows[-1]["created_at"], rows[-1]["run_id"])
        return rows, nxt

    def timeline(self, run_id: str) -> tuple[RowMap | None, list[RowMap], list[RowMap]]:
        """(run, its attempts with their debits, its events); the run is None when unknown."""
        key = {"run_id": run_id}
        with self.ctx.reading() as conn:
            run = conn.execute(_TIMELINE_RUN, key).first()
            if run is None:
                return None, [], []
            atts = conn.execute(_TIMELINE_ATTEMPTS, key).all()
            evs = conn.execute(_TIMELINE_EVENTS, key).all()
        return dict(run._mapping), _maps(atts), _maps(evs)

    def children(self, run_id: str) -> list[RowMap]:
        """The Child Runs of ``run_id``, oldest first (by the parent's index)."""
        r = s.runs.c
        with self.ctx.reading() as conn:
            return _maps(conn.execute(select(*(r[c] for c in _RUN_COLS))
                                      .where(r.parent_run_id == run_id)
                                      .order_by(r.created_at, r.run_id)).all())

    def failovers(self, *, since: float | None, until: float | None, limit: int,
                  cursor: str | None
                  ) -> tuple[list[RowMap], list[RowMap], list[RowMap], str | None]:
        """Runs admitted in the range that failed over, their attempts, their ``move``
        events, and the next cursor. Raises :class:`~ledger.errors.InvalidArgument`."""
        _check_limit(limit)
        r = s.runs.c
        a = s.attempts.c
        e = s.events.c
        conds = time_range(r.created_at, since, until) + _keyset(r.created_at, r.run_id, cursor)
        q = (select(*(r[c] for c in _RUN_COLS))
             .where(*conds, r.failed_over)
             .order_by(r.created_at.desc(), r.run_id.desc()).limit(limit + 1))
        with self.ctx.reading() as conn:
            runs = _maps(conn.execute(q).all())
            nxt = None
            if len(runs) > limit:
                runs = runs[:limit]
                nxt = make_cursor(runs[-1]["created_at"], runs[-1]["run_id"])
            ids = [x["run_id"] for x in runs]
            if not ids:
                return [], [], [], None
            atts = _maps(conn.execute(
                select(a.run_id, a.attempt_id, a.seq, a.kind, a.route_id, a.profile_id, a.state,
                       a.category, a.http_status, a.fact, a.created_at)
                .where(a.run_id.in_(ids)).order_by(a.run_id, a.seq)
            ).all())
            # The selector's decisions and moves: a Run served elsewhere without a failure had
            # its selected route skipped (cooling, unusable), which only a select event says.
            moves = _maps(conn.execute(
                select(e.run_id, e.attempt_id, e.kind, e.data, e.created_at)
                .where(e.run_id.in_(ids), e.kind.in_(("move", "select")))
                .order_by(e.run_id, e.event_id)
            ).all())
        return runs, atts, moves, nxt

    def _label_expr(self, key: str, labels: Any = None) -> ColumnElement[Any]:
        try:
            label_key(key)  # any key a Run may carry (admission holds it to the same rule)
        except Problem as e:
            raise InvalidArgument(f"label key {key!r} {e.problem}; {e.fix}",
                                  field="label") from None
        expr: ColumnElement[Any] = self.ctx.label(key, labels)
        return expr

    def totals(self, *, by: str, since: float | None, until: float | None,
               label: str | None, limit: int, cursor: str | None
               ) -> tuple[list[RowMap], str | None]:
        """Attempt counts, tokens and cost grouped by ``by`` (route, group, run, tenant,
        label with ``label`` the key, provider with its name case-folded), most expensive
        first. Raises
        :class:`~ledger.errors.InvalidArgument` (an unknown ``by``, a bad label key)."""
        _check_limit(limit)
        if by not in TOTALS_KEYS:
            raise InvalidArgument(f"cannot total by {by!r}; choose one of {', '.join(TOTALS_KEYS)}",
                                  field="by")
        a = s.attempts.c
        offset = _offset(cursor)
        key: ColumnElement[Any]
        if by == "route":
            key = a.route_id
        elif by == "group":
            key = a.group_id
        elif by == "provider":
            key = a.provider
        elif by == "run":
            key = a.run_id
        elif by == "tenant":
            key = a.tenant  # copied from the run at begin: no join over a day of attempts
        else:
            if not label:
                raise InvalidArgument("totals by label need the label key (label='team')",
                                      field="label")
            self._label_expr(label)  # checks the key before any read
            key = a.labels  # copied from the run at begin (0010): no join either

        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            self.ctx.aggregating(conn)
            # By run, a day holds as many keys as attempts nearly: roll-ups would not help.
            hours = None if by == "run" else split(conn, since, until)
            q, cost, key = self._totals_query(by, key, label, since, until, hours)
            if by == "provider":
                # Summed by the name as each route spelled it, then folded here: a few rows,
                # and str.casefold is the fold of the provider's health key
                # (ledger.decide.health.provider_key), which neither backend's lower() is.
                rows = _folded_providers(_maps(conn.execute(q).all()))
                rows = rows[offset:offset + limit + 1]
            elif by == "run":
                rows = self._page_of_runs(conn, q, cost, key, since, until, offset, limit + 1)
            else:
                q = q.order_by(cost.desc(), key.asc()).offset(offset).limit(limit + 1)
                rows = _maps(conn.execute(q).all())
        nxt = None
        if len(rows) > limit:
            rows = rows[:limit]
            nxt = f"o:{offset + limit}"
        return rows, nxt

    def _page_of_runs(self, conn: Any, q: Select[Any], cost: ColumnElement[Any],
                      key: ColumnElement[Any], since: float | None, until: float | None,
                      offset: int, n: int) -> list[RowMap]:
        """The ``n`` rows of the totals by run from ``offset``: the Runs of the page chosen on
        their cost alone, then only they summed whole (``q`` narrowed to them), in one snapshot.

        A day holds nearly as many Runs as attempts (87,000 of 143,000 in the project's
        generated history), and keeping every column's sum for each of them while choosing
        the page cost about a third of the read (docs/benchmarks.md). The order and the page
        are those of ``q`` ordered by cost (ties by run id): the same sums of the same rows.
        Both statements read the same window in the read's one snapshot; on PostgreSQL the
        first holds its partitions' locks to the end, so retention cannot drop one between
        them."""
        window = time_range(s.attempts.c.created_at, since, until)
        page = [r[0] for r in conn.execute(
            select(key).where(*window).group_by(self.ctx.group_key(key))
            .order_by(cost.desc(), key.asc()).offset(offset).limit(n)).all()]
        if not page:
            return []
        rank = {k: i for i, k in enumerate(page)}
        rows: list[RowMap] = []
        for chunk in id_chunks(page, _IDS_PER_STATEMENT):
            rows += _maps(conn.execute(q.where(key.in_(chunk))).all())
        return sorted(rows, key=lambda r: rank[r["key"]])

    def _totals_query(self, by: str, key: ColumnElement[Any], label: str | None,
                      since: float | None, until: float | None, hours: Split | None
                      ) -> tuple[Select[Any], ColumnElement[Any], ColumnElement[Any]]:
        """(the totals' statement without order or page, its cost column, its key column).

        The window's attempts are read from ``attempts`` except those of rolled hours
        (``hours``) not in flight, whose sums come from ``attempt_rollups``; every column is a sum
        (a count is one too), so summing the parts' sums is exact.
        """
        a = s.attempts.c
        window = time_range(a.created_at, since, until)
        rolled: Select[Any] | None = None
        if hours is not None and hours.stretches:
            window = [hours.attempts_where()]
            t = s.attempt_rollups.c
            rkey = {"route": t.route_id, "group": t.group_id, "provider": t.provider,
                    "tenant": t.tenant, "label": t.labels}[by]
            rolled = (select(rkey.label("key"), *rollup_sums(*_TOTALS))
                      .where(hours.rollups_where()).group_by(rkey))

        cost, held = charged_and_held()
        sums = (
            func.count().label("attempts"),
            in_state("succeeded").label("succeeded"),
            in_state("failed").label("failed"),
            in_state("unknown").label("unknown"),
            func.coalesce(func.sum(a.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(a.completion_tokens), 0).label("completion_tokens"),
            cost.label("cost_micros"),
            held.label("held_micros"),
        )
        read = select(key.label("key"), *sums).where(*window).group_by(self.ctx.group_key(key))
        if by != "label":
            if rolled is None:
                return read, cost, key
            parts = [read, rolled]
        else:
            # Grouped by the labels as stored first, then by the label's value: a day's
            # attempts carry a few sets of labels, so the JSON is parsed once per set, not once
            # per attempt. Attempts without their copy (written before 0010, or by a process
            # still on older code while it migrated) form the NULL set; only when it exists
            # (a one-time filter on the sets already summed) are they read again and summed by
            # their Runs' labels (a roll-up summed them so already). Grouping by the column
            # alone keeps the day's read a parallel hash aggregate: an expression in its key
            # (a per-row subquery, a fallback to the run id) made PostgreSQL expect tens of
            # thousands of groups and read it serially.
            sets = read.cte("label_sets")
            r = s.runs.c
            unfilled = (select(r.labels.label("key"), *sums)
                        .select_from(s.attempts.join(s.runs, r.run_id == a.run_id))
                        .where(*window, a.labels.is_(None),
                               exists().where(sets.c.key.is_(None)))
                        .group_by(r.labels))
            parts = [select(sets).where(sets.c.key.is_not(None)), unfilled]
            if rolled is not None:
                parts.append(rolled)
        both = union_all(*parts).subquery("parts")
        out = self._label_expr(label or "", both.c.key) if by == "label" else both.c.key
        total = func.sum(both.c.cost_micros)
        q = select(out.label("key"), *(total.label(c) if c == "cost_micros"
                                       else func.sum(both.c[c]).label(c) for c in _TOTALS)
                   ).group_by(out)
        return q, total, out

    def latency(self, *, route: str | None, group: str | None, category: str | None,
                tenant: str | None, state: str | None, since: float | None,
                until: float | None) -> dict[tuple[str, str], list[RowMap]]:
        """Per route and per group (:data:`LATENCY_KEYS`), for each time of
        :data:`LATENCY_MEASURES` and for :data:`SUCCEEDED_LATENCY`: its count and percentiles
        (:data:`FRACTIONS`) over the attempts begun in [since, until) that match the
        filters, in one read."""
        a = s.attempts.c
        where: list[ColumnElement[bool]] = time_range(a.created_at, since, until)
        for col, value in ((a.route_id, route), (a.group_id, group), (a.category, category),
                           (a.tenant, tenant), (a.state, state)):
            if value is not None:
                where.append(col == value)
        keys = {"route": a.route_id, "group": a.group_id}
        out: dict[tuple[str, str], list[RowMap]] = {}
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            self.ctx.aggregating(conn)
            # One statement for both keys and all three times (on PostgreSQL one pass over
            # the window, where six statements made six: docs/benchmarks.md), split back here.
            # The succeeded attempts' latency rides along as a fourth value, since a
            # second statement for it would read the window again (docs/benchmarks.md).
            values = [*(a[m] for m in LATENCY_MEASURES),
                      case((a.state == "succeeded", a.latency_s))]
            rows = self.ctx.percentiles(conn, values, keys, where, FRACTIONS)
        for by in LATENCY_KEYS:
            for j, measure in enumerate((*LATENCY_MEASURES, SUCCEEDED_LATENCY)):
                out[(by, measure)] = [
                    {"key": x["key"], "n": x[f"n{j}"],
                     **{f"p{i}": x[f"p{j}_{i}"] for i in range(len(FRACTIONS))}}
                    for x in rows if x["by"] == by and x[f"n{j}"]]
        return out

    def count_failovers(self, *, since: float | None, until: float | None) -> int:
        """How many Runs admitted in the range failed over (:meth:`failovers`' rule)."""
        r = s.runs.c
        q = (select(func.count()).select_from(s.runs)
             .where(*time_range(r.created_at, since, until), r.failed_over))
        with self.ctx.reading() as conn:
            self.ctx.aggregating(conn)
            return int(conn.execute(q).scalar_one())
    def spend(self, *, by: str, label: str | None, since: float | None, until: float | None,
              bucket: tuple[float, float] | None, limit: int, cursor: str | None
              ) -> tuple[list[RowMap], list[RowMap], str | None]:
        """Runs admitted in the range grouped by tenant (``by="tenant"``) or by the value of
        label ``label``: how many, their own budgets (``max_cost`` less what they carved for
        children and gave back to a parent) and what they have posted and hold now, in
        micros; most posted first.
        Returns (a page of keys with their totals, the same keys' rows per time bucket when
        ``bucket`` is ``(origin, width)``, the next cursor). Raises
        :class:`~ledger.errors.InvalidArgument` (``by``, a bad label key, limit, cursor)."""
        _check_limit(limit)
        r, t = s.runs.c, s.run_rollups.c
        key: ColumnElement[Any]
        rkey: ColumnElement[Any]  # the same key over run_rollups
        if by == "tenant":
            key, rkey = r.tenant, t.tenant
        elif by == "label":
            if not label:
                raise InvalidArgument("spend by label needs the label key (label='team')",
                                      field="label")
            key, rkey = self._label_expr(label), self._label_expr(label, t.labels)
        else:
            raise InvalidArgument(f"cannot total spend by {by!r}; choose tenant or label",
                                  field="by")
        offset = _offset(cursor)
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            self.ctx.aggregating(conn)
            # The ended Runs of rolled hours are counted in run_rollups.
            window = split(conn, since, until)
            hours = window if window.stretches else None
            q = self._spend_query((key, rkey), since, until, hours, None)
            total = q.selected_columns
            # Runs without the key (no tenant, no such label) form one group, ordered the
            # same on both databases (they sort NULL apart).
            q = (q.order_by(total.posted_micros.desc(), total.key.is_(None).desc(),
                            total.key.asc())
                 .offset(offset).limit(limit + 1))
            rows = _maps(conn.execute(q).all())
            nxt = None
            if len(rows) > limit:
                rows = rows[:limit]
                nxt = f"o:{offset + limit}"
            points: list[RowMap] = []
            if bucket is not None and rows:
                wanted = [x["key"] for x in rows]
                origin, width = bucket
                # An hour of the roll-ups (a folded day's too) must fall in one bucket.
                whole = None if hours is None else bucketed_split(conn, since, until, width,
                                                                   origin)
                q = self._spend_query((key, rkey), since, until, whole, bucket, wanted)
                points = _maps(conn.execute(q.order_by(q.selected_columns.bucket)).all())
        return rows, points, nxt

    def _spend_query(self, keyed: tuple[ColumnElement[Any], ColumnElement[Any]],
                     since: float | None, until: float | None, hours: Split | None,
                     bucket: tuple[float, float] | None,
                     wanted: Sequence[Any] | None = None) -> Select[Any]:
        """Per key (and per bucket ``(origin, width)``): the Runs admitted in [since, until),
        their budgets, money posted and held; the ended Runs of ``hours``' rolled hours from
        ``run_rollups``, the rest from ``runs``. ``keyed``: the key over ``runs`` and over
        ``run_rollups``; ``wanted``: only these keys (``None`` among them: the Runs without
        one)."""
        key, rkey = keyed
        r = s.runs.c
        names = ("runs", "budget_micros", "posted_micros", "held_micros")
        sums = (func.count(), func.sum(r.max_cost_micros - r.carved_micros - r.returned_micros),
                func.sum(r.posted_micros), func.sum(r.reserved_micros))
        keys: list[Any] = [key.label("key")]
        if bucket is not None:
            keys.append(self.ctx.bucket(r.created_at, *bucket).label("bucket"))
        where = [] if wanted is None else [_keys_in(key, wanted)]
        if hours is None:
            where += time_range(r.created_at, since, until)
        else:
            where.append(hours.unrolled(r.created_at, r.status.in_(LIVE_STATUSES)))
        group: list[Any] = [literal_column(k.name) for k in keys[1:]]
        q = (select(*keys, *(func.coalesce(x, 0).label(n) for x, n in zip(sums, names,
                                                                           strict=True)))
             .where(*where).group_by(self.ctx.group_key(key), *group))
        if hours is None:
            return q
        t = s.run_rollups.c
        rkeys: list[Any] = [rkey.label("key")]
        if bucket is not None:
            rkeys.append(self.ctx.bucket(t.hour * HOUR, *bucket).label("bucket"))
        rolled = [hours.rollups_where(s.run_rollups)]
        if wanted is not None:
            rolled.append(_keys_in(rkey, wanted))
        r_q = (select(*rkeys, func.sum(t.runs).label("runs"),
                      func.sum(t.budget_micros).label("budget_micros"),
                      func.sum(t.posted_micros).label("posted_micros"),
                      func.sum(t.reserved_micros).label("held_micros"))
               .where(*rolled).group_by(rkey, *group))
        return summed([q, r_q], [k.name for k in keys], names)

    def actions(self, *, kinds: Sequence[str], since: float | None, until: float | None,
                limit: int, cursor: str | None) -> tuple[list[RowMap], str | None]:
        """Operators' actions newest first: the events of ``kinds`` (``late_receipt`` only
        where an operator's evidence was applied, not an executor's refused settle), keyset
        on ``(created_at, event_id)``. Raises :class:`~ledger.errors.InvalidArgument`."""
        _check_limit(limit)
        e = s.events.c
        conds: list[ColumnElement[bool]] = time_range(e.created_at, since, until)
        cur = parse_cursor(cursor)
        if cur is not None:
            ts, last = cur
            last_id = _whole(last)
            if last_id is None:
                raise _bad_cursor(cursor or "")
            conds.append(or_(e.created_at < ts, and_(e.created_at == ts, e.event_id < last_id)))
        # The stored data is JSON with sorted keys (ledger.storage.encode.event_json): an
        # applied receipt reads '"applied": true' in it.
        kind_ok: list[ColumnElement[bool]] = [
            e.kind.in_([k for k in kinds if k != "late_receipt"])]
        if "late_receipt" in kinds:
            kind_ok.append(and_(e.kind == "late_receipt",
                                e.data.contains('"applied": true', autoescape=True)))
        q = (select(e.event_id, e.run_id, e.attempt_id, e.kind, e.data, e.created_at)
             .where(*conds, or_(*kind_ok))
             .order_by(e.created_at.desc(), e.event_id.desc()).limit(limit + 1))
        with self.ctx.reading() as conn:
            rows = _maps(conn.execute(q).all())
        nxt = None
        if len(rows) > limit:
            rows = rows[:limit]
            nxt = make_cursor(rows[-1]["created_at"], str(rows[-1]["event_id"]))
        return rows, nxt

    def open_attempts(self, *, states: Sequence[str], since: float | None,
                      until: float | None, limit: int, cursor: str | None
                      ) -> tuple[list[RowMap], str | None]:
        """Attempts in ``states`` with their run's lease and until when their executor holds
        it (:func:`~ledger.storage.schema.held_until`), newest first."""
        _check_limit(limit)
        a = s.attempts.c
        r = s.runs.c
        conds = (time_range(a.created_at, since, until)
                 + _keyset(a.created_at, a.attempt_id, cursor))
        d = s.debits.c
        q = (select(s.attempts, r.lease_holder.label("lease_holder"),
                    r.lease_expires_at.label("lease_expires_at"),
                    s.held_until(a.fence).label("held_until"),
                    d.state.label("debit_state"))
             .join(s.runs, r.run_id == a.run_id)
             .outerjoin(s.debits, d.debit_id == a.debit_id)
             .where(a.state.in_(list(states)), *conds)
             .order_by(a.created_at.desc(), a.attempt_id.desc()).limit(limit + 1))
        with self.ctx.reading() as conn:
            rows = _maps(conn.execute(q).all())
        nxt = None
        if len(rows) > limit:
            rows = rows[:limit]
            nxt = make_cursor(rows[-1]["created_at"], rows[-1]["attempt_id"])
        return rows, nxt

    def health(self, now: float) -> tuple[list[RowMap], list[RowMap]]:
        """(every health row, every capacity group with its live in-flight count at ``now``)."""
        h = s.health.c
        g = s.capacity_groups.c
        gs = s.group_slots.c
        r = s.runs.c
        # A slot counts while its executor still holds the run (the same rule as admission).
        # Its Run is looked up from the slot (EXISTS): joined, SQLite's planner may walk every
        # Run to find the few slots (docs/benchmarks.md).
        live = (select(gs.group_id, func.count().label("in_flight"))
                .where(exists().where(r.run_id == gs.run_id, s.held_until(gs.fence) > now))
                .group_by(gs.group_id).subquery())
        w = s.group_waiters.c
        # A place in a full group's queue counts the same way, while its own bound has not passed.
        queued = (select(w.group_id, func.count().label("waiting"))
                  .select_from(s.group_waiters.join(s.runs, r.run_id == w.run_id))
                  .where(w.expires_at > now, s.held_until(w.fence) > now)
                  .group_by(w.group_id).subquery())
        with self.ctx.reading() as conn:
            hrows = _maps(conn.execute(select(s.health).order_by(h.kind.desc(), h.key)).all())
            grows = _maps(conn.execute(
                select(s.capacity_groups, func.coalesce(live.c.in_flight, 0).label("in_flight"),
                       func.coalesce(queued.c.waiting, 0).label("waiting"))
                .select_from(s.capacity_groups.outerjoin(live, live.c.group_id == g.group_id)
                             .outerjoin(queued, queued.c.group_id == g.group_id))
                .order_by(g.group_id)
            ).all())
        return hrows, grows

    def unusable(self, since: float) -> list[RowMap]:
        """Routes (per profile) skipped as unusable since ``since`` and not served since their
        last skip: skips, first and last time, the last skip's attempt, run and fact."""
        a = s.attempts.c
        grouped = (select(a.route_id, a.profile_id, func.count().label("skips"),
                          func.min(a.created_at).label("first_at"),
                          func.max(a.created_at).label("last_at"))
                   .where(a.category == "unusable", a.created_at >= since)
                   .group_by(a.route_id, a.profile_id).order_by(a.route_id))
        out: list[RowMap] = []
        with self.ctx.reading() as conn:
            for g in _maps(conn.execute(grouped).all()):
                same = (a.profile_id.is_(None) if g["profile_id"] is None
                        else a.profile_id == g["profile_id"])
                served = conn.execute(
                    select(a.attempt_id).where(a.route_id == g["route_id"], same,
                                               a.state == "succeeded", a.created_at > g["last_at"])
                    .limit(1)).first()
                if served is not None:
                    continue  # served since: whatever was missing is there again
                last = conn.execute(
                    select(a.attempt_id, a.run_id, a.provider, a.group_id, a.fact)
                    .where(a.category == "unusable", a.created_at == g["last_at"],
                           a.route_id == g["route_id"], same)
                    .order_by(a.attempt_id.desc()).limit(1)).one()
                out.append({**g, **last._mapping})
        return out

    def activity(self, *, since: float, until: float, bucket_s: float) -> list[RowMap]:
        """Attempts per ``bucket_s`` bucket of [since, until): total, failed, unknown.

        When ``since`` starts an hour and ``bucket_s`` is a whole number of hours (so no hour
        straddles two buckets), the attempts not in flight of rolled hours
        (:mod:`ledger.storage.rollups`) are counted from their roll-ups. Raises
        :class:`~ledger.errors.InvalidArgument` (``bucket_s`` not > 0)."""
        if bucket_s <= 0:
            raise InvalidArgument("bucket_s must be > 0", field="bucket_s")
        a = s.attempts.c
        cols = ("attempts", "failed", "unknown")
        bucket: ColumnElement[Any] = self.ctx.bucket(a.created_at, since, bucket_s)
        with self.ctx.reading() as conn:
            self.ctx.consistent(conn)
            self.ctx.aggregating(conn)
            hours = bucketed_split(conn, since, until, bucket_s)
            window = ([hours.attempts_where()] if hours is not None
                      else time_range(a.created_at, since, until))
            # Two reads that each touch only the columns of one index, so the database
            # answers from the index alone (on PostgreSQL an index-only scan, wherever its
            # visibility map allows; SQLite a covering index): every attempt's bucket from
            # the times, and the failed and unknown ones' from (state, created_at), a tenth
            # of the rows. Counting the states over the attempts' rows read every row of
            # the window from the table (docs/benchmarks.md).
            zero = literal(0)
            parts = [
                select(bucket.label("bucket"), func.count().label("attempts"),
                       zero.label("failed"), zero.label("unknown"))
                .where(*window).group_by(literal_column("bucket")),
                select(bucket.label("bucket"), zero.label("attempts"),
                       in_state("failed").label("failed"), in_state("unknown").label("unknown"))
                .where(*window, a.state.in_(("failed", "unknown")))
                .group_by(literal_column("bucket")),
            ]
            if hours is not None:
                t = s.attempt_rollups.c
                parts.append(
                    select(self.ctx.bucket(t.hour * HOUR, since, bucket_s).label("bucket"),
                           *rollup_sums(*cols))
                    .where(hours.rollups_where()).group_by(literal_column("bucket")))
            q = summed(parts, ["bucket"], cols)
            return _maps(conn.execute(q.order_by(literal_column("bucket"))).all())

    def schema_present(self) -> bool:
        """Whether the ledger's tables exist (a reader never creates them)."""
        with self.ctx.reading() as conn:
            return self.ctx.has_table(conn, "runs")

    def latest_instant(self) -> float | None:
        """The latest time the ledger holds: of a write, or of a cooldown or waiting floor
        still ahead of it; None when it holds none (no run, no health, no group)."""
        cols = (s.runs.c.updated_at, s.attempts.c.created_at, s.attempts.c.settled_at,
                s.events.c.created_at, s.capacity_groups.c.updated_at,
                s.capacity_groups.c.until, s.capacity_groups.c.sampled_at,
                s.health.c.updated_at, s.health.c.cooldown_until, s.health.c.disabled_until)
        q = select(*(select(func.max(c)).scalar_subquery() for c in cols))
        with self.ctx.reading() as conn:
            row = conn.execute(q).one()
        times = [float(t) for t in row if t is not None]
        return max(times) if times else None

    def first_run_other_than(self, *, policy_hash: str | None = None,
                             tenant: str | None = None) -> str | None:
        """The id of one run not carrying ``policy_hash`` (or ``tenant``), else None."""
        r = s.runs.c
        conds: list[Any] = []
        if policy_hash is not None:
            conds.append(r.policy_hash != policy_hash)
        if tenant is not None:
            conds.append(or_(r.tenant.is_(None), r.tenant != tenant))
        q = select(r.run_id)
        if conds:
            q = q.where(or_(*conds))
        with self.ctx.reading() as conn:
            row = conn.execute(q.limit(1)).first()
        return None if row is None else str(row.run_id)


__all__ = ["FRACTIONS", "LATENCY_KEYS", "LATENCY_MEASURES", "SUCCEEDED_LATENCY", "TOTALS_KEYS",
           "AuditQueries", "charged_and_held", "in_state"]
