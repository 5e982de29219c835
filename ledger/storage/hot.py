"""The hot path's transactions, written once for every driver (see :mod:`ledger.storage.driver`).

A turn touches the database exactly here: one :func:`snapshot_tx` read, then per Attempt one
:func:`begin_tx` and one :func:`settle_tx`. Each is a generator yielding plain SQL; only a few
statements differ between the databases (row locks, ``GREATEST``/``MAX``, list parameters), and
they are said once, by :class:`SqliteSql` and :class:`PostgresSql`. The rules these
transactions apply — is the lease live, what a settle does to a hold, a health row, a group —
are pure functions (``ledger.decide.settle``); here they meet the rows, under the run row's
lock (PostgreSQL ``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE`` already serializes writers), and
always after it: the clock is read once the lock is granted, and read again after a limited
group's slots, so a decision is recorded at the time it was taken.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from ledger import faults
from ledger.decide.settle import lease_problem, settle_holds
from ledger.domain.records import (
    AttemptRecord,
    AttemptState,
    DebitState,
    Lease,
    Outcome,
    Queued,
    RunStatus,
    budget_left,
    from_micros,
)
from ledger.domain.specs import BeginSpec, GroupUpdate, HealthUpdate, SettleSpec
from ledger.domain.values import GroupMode, GroupProjection, Health
from ledger.errors import (
    AllowanceExhausted,
    BudgetExceeded,
    CapacityUnavailable,
    Conflict,
    FencedOut,
    InvalidState,
    LeaseHeld,
    LeaseLost,
    NotFound,
    SettleConflict,
    StorageError,
)
from ledger.redaction import redact
from ledger.storage import schema
from ledger.storage.driver import Flush, Q, Tx
from ledger.storage.encode import event_json, fact_json, health_values
from ledger.storage.rows import SnapshotRows, attempt_record, health_record, written_attempt

ClockFn = Callable[[], float]
#: The PostgreSQL channel told (payload: the group id) when a slot of a group with waiters is
#: freed (a trigger, migration 0006) or a waiter leaves its queue.
QUEUE_CHANNEL = "ledger_slots"

ATTEMPT_COLS = (
    "attempt_id", "run_id", "tenant", "turn_id", "seq", "kind", "route_id", "provider", "model",
    "group_id", "profile_id", "debit_id", "envelope_hash", "state", "reject_reason", "fact",
    "category", "http_status", "effective_output", "tool_started", "prompt_tokens",
    "completion_tokens", "cost_micros", "reserved_micros", "reserved_tokens", "model_reported",
    "output_hash", "settle_hash", "begin_hash", "fence", "settle_fence", "executor",
    "created_at", "settled_at",
)
HEALTH_COLS = ("key", "cooldown_until", "disabled_until", "disabled_reason", "error_count",
               "failure_counts", "last_failure_at", "last_used", "last_probe_at", "reset_at",
               "recent_failures")
RUN_LIVE_COLS = (
    "status", "calls_used", "retries_used", "reserved_micros", "posted_micros", "tokens_used",
    "tokens_reserved", "carved_calls", "carved_retries", "carved_micros", "carved_tokens",
    "current_route", "current_profile", "lease_holder", "fence", "lease_expires_at",
    "updated_at", "compactions", "profile_compactions",
)
BEGIN_RUN_COLS = (
    "fence", "lease_holder", "lease_expires_at", "max_calls", "carved_calls", "calls_used",
    "max_cost_micros", "carved_micros", "reserved_micros", "posted_micros", "max_retries",
    "carved_retries", "retries_used", "max_tokens", "carved_tokens", "tokens_reserved",
    "tokens_used",
)
GROUP_COLS = ("group_id", "max_in_flight", "mode", "until", "sampled_at")


def _ns(cols: Sequence[str], row: Sequence[Any]) -> SimpleNamespace:
    return SimpleNamespace(**dict(zip(cols, row, strict=True)))


class Sql(abc.ABC):
    """The hot path's encode. What differs between the databases is said once, by
    :class:`SqliteSql` and :class:`PostgresSql`: a few spellings (class attributes), how a list
    parameter is passed and how the writes that end a transaction are sent (methods)."""

    # A locking read's suffix (SQLite's BEGIN IMMEDIATE already holds the write lock).
    LOCK: str
    # ``column IN <list parameter>``, with one SQL text whatever the list's length.
    IN_LIST: str
    GREATEST: str
    # How the probe state's eviction treats rows another transaction holds.
    SKIP_LOCKED: str
    # Tells other processes that a group's queue changed (PostgreSQL's NOTIFY); None: there is
    # no channel, and waiters in other processes find out by polling.
    NOTIFY_QUEUE: str | None = None

    def __init__(self) -> None:
        lock = self.LOCK
        inlist = self.IN_LIST
        # Until when a slot or a queue place counts (schema.held_until), in these statements'
        # aliases; compared with the clock read after the statement.
        r = schema.runs.alias("r")
        slot_held = str(schema.held_until(schema.group_slots.alias("gs").c.fence, r).compile())
        place_held = str(schema.held_until(schema.group_waiters.alias("w").c.fence, r).compile())
        self.run_live = (f"SELECT {', '.join(RUN_LIVE_COLS)} FROM runs WHERE run_id = :run_id")
        self.lock_run = (f"SELECT {', '.join(BEGIN_RUN_COLS)} FROM runs WHERE run_id = :run_id"
                         + lock)
        self.lock_run_full = ("SELECT fence, lease_holder, lease_expires_at, max_retries, "
                              "carved_retries, retries_used FROM runs WHERE run_id = :run_id"
                              + lock)
        self.lock_run_fence = ("SELECT fence, lease_holder, lease_expires_at, max_tokens FROM runs "
                               "WHERE run_id = :run_id" + lock)
        self.groups = (f"SELECT {', '.join(GROUP_COLS)} FROM capacity_groups "
                       f"WHERE group_id {inlist.format('groups')}")
        self.group_slots = (
            f"SELECT gs.group_id, {slot_held} FROM group_slots gs JOIN runs r "
            "ON r.run_id = gs.run_id WHERE gs.group_id " + inlist.format("groups"))
        self.health = (f"SELECT {', '.join(HEALTH_COLS)} FROM health "
                       f"WHERE key {inlist.format('keys')}")
        self.provenance = ("SELECT ref, content_hash FROM provenance "
                           f"WHERE run_id {inlist.format('runs')} AND ref {inlist.format('refs')}")
        self.begin_lookup = (
            "SELECT (SELECT COALESCE(MAX(seq), 0) + 1 FROM attempts WHERE run_id = :run_id), "
            "(SELECT attempt_id FROM attempts WHERE attempt_id = :attempt_id), "
            "g.group_id, g.max_in_flight, g.mode, g.until "
            "FROM (SELECT 1 AS one) o LEFT JOIN capacity_groups g ON g.group_id = :group")
        self.ensure_group = ("INSERT INTO capacity_groups (group_id, mode, updated_at) "
                             "VALUES (:group, 'open', :now) ON CONFLICT DO NOTHING")
        self.lock_group = ("SELECT mode, until, max_in_flight FROM capacity_groups "
                           "WHERE group_id = :group" + lock)
        self.waiters = (
            f"SELECT w.ticket, w.waiter_id, w.enqueued_at, w.expires_at, {place_held} "
            "FROM group_waiters w LEFT JOIN runs r ON r.run_id = w.run_id "
            "WHERE w.group_id = :group ORDER BY w.ticket")
        self.insert_waiter = (
            "INSERT INTO group_waiters (group_id, waiter_id, run_id, fence, enqueued_at, "
            "expires_at) VALUES (:group_id, :waiter_id, :run_id, :fence, :enqueued_at, "
            ":expires_at) RETURNING ticket")
        self.drop_waiters = ("DELETE FROM group_waiters WHERE group_id = :group AND ticket "
                             + inlist.format("tickets"))
        self.leave_queue = "DELETE FROM group_waiters WHERE waiter_id = :waiter_id"
        self.slot_expiries = (
            f"SELECT {slot_held} FROM group_slots gs JOIN runs r ON r.run_id = gs.run_id "
            "WHERE gs.group_id = :group")
        self.attempt = (
            f"SELECT {', '.join('a.' + c for c in ATTEMPT_COLS)}, d.state, d.reserved_micros "
            "FROM attempts a LEFT JOIN debits d ON d.debit_id = a.debit_id "
            "WHERE a.attempt_id = :attempt_id")
        self.settle_read = (
            f"SELECT {', '.join('a.' + c for c in ATTEMPT_COLS)}, d.state, d.reserved_micros, "
            f"{', '.join('h.' + c for c in HEALTH_COLS)} "
            "FROM attempts a LEFT JOIN debits d ON d.debit_id = a.debit_id "
            "LEFT JOIN health h ON h.key = :key "
            "WHERE a.attempt_id = :attempt_id AND a.run_id = :run_id")
        self.insert_debit = (
            "INSERT INTO debits (debit_id, run_id, attempt_id, state, reserved_micros, "
            "posted_micros, created_at, settled_at) VALUES (:debit_id, :run_id, :attempt_id, "
            ":state, :reserved_micros, 0, :created_at, :settled_at)")
        cols = [c for c in ATTEMPT_COLS if c not in (
            "fact", "category", "http_status", "prompt_tokens", "completion_tokens",
            "cost_micros", "model_reported", "output_hash", "settle_hash", "settle_fence")]
        self.insert_attempt = (f"INSERT INTO attempts ({', '.join(cols)}) VALUES "
                               f"({', '.join(':' + c for c in cols)})")
        self.insert_slot = ("INSERT INTO group_slots (attempt_id, group_id, run_id, fence, "
                            "acquired_at) VALUES (:attempt_id, :group_id, :run_id, :fence, "
                            ":acquired_at)")
        self.insert_event = ("INSERT INTO events (run_id, attempt_id, kind, data, created_at) "
                             "VALUES (:run_id, :attempt_id, :kind, :data, :created_at)")
        self.begin_run = (
            "UPDATE runs SET calls_used = calls_used + :calls, retries_used = retries_used + "
            ":retries, reserved_micros = reserved_micros + :reserve, tokens_reserved = "
            "tokens_reserved + :reserve_tokens, status = :status, updated_at = :now "
            "WHERE run_id = :run_id")
        self.adopt_attempt = "UPDATE attempts SET fence = :fence WHERE attempt_id = :attempt_id"
        self.adopt_slot = "UPDATE group_slots SET fence = :fence WHERE attempt_id = :attempt_id"
        self.void_attempt = (
            "UPDATE attempts SET state = 'not_sent', reject_reason = :reason, settled_at = :now, "
            "settle_fence = :fence WHERE attempt_id = :attempt_id")
        self.void_debit = ("UPDATE debits SET state = 'voided', settled_at = :now "
                           "WHERE debit_id = :debit_id")
        self.void_run = (
            "UPDATE runs SET reserved_micros = reserved_micros - :reserve, tokens_reserved = "
            "tokens_reserved - :reserve_tokens, calls_used = calls_used - 1, updated_at = :now "
            "WHERE run_id = :run_id")
        self.settle_attempt = (
            "UPDATE attempts SET state = :state, fact = :fact, category = :category, "
            "http_status = :http_status, effective_output = :effective_output, tool_started = "
            ":tool_started, prompt_tokens = :prompt_tokens, completion_tokens = "
            ":completion_tokens, cost_micros = :cost_micros, model_reported = :model_reported, "
            "output_hash = :output_hash, settle_hash = :settle_hash, settle_fence = "
            ":settle_fence, settled_at = :settled_at WHERE attempt_id = :attempt_id")
        self.settle_debit = ("UPDATE debits SET state = :state, posted_micros = :posted, "
                             "settled_at = :now WHERE debit_id = :debit_id")
        self.delete_slot = "DELETE FROM group_slots WHERE attempt_id = :attempt_id"
        self.settle_run = (
            "UPDATE runs SET reserved_micros = reserved_micros - :release, posted_micros = "
            "posted_micros + :posted, tokens_reserved = tokens_reserved - :release_tokens, "
            "tokens_used = tokens_used + :tokens, calls_used = calls_used - :uncount, "
            "updated_at = :now WHERE run_id = :run_id")
        self.settle_run_succeeded = (
            "UPDATE runs SET reserved_micros = reserved_micros - :release, posted_micros = "
            "posted_micros + :posted, tokens_reserved = tokens_reserved - :release_tokens, "
            "tokens_used = tokens_used + :tokens, calls_used = calls_used - :uncount, "
            "current_route = :route, current_profile = :profile, "
            "profile_compactions = compactions, updated_at = :now WHERE run_id = :run_id")
        self.lock_health = (f"SELECT {', '.join(HEALTH_COLS)} FROM health WHERE key = :key"
                            + lock)
        hcols = ("cooldown_until", "disabled_until", "disabled_reason", "error_count",
                 "failure_counts", "last_failure_at", "last_used", "last_probe_at", "reset_at",
                 "recent_failures", "updated_at")
        self.insert_health = (
            f"INSERT INTO health (key, kind, provider, {', '.join(hcols)}) VALUES (:key, :kind, "
            f":provider, {', '.join(':' + c for c in hcols)}) ON CONFLICT DO NOTHING "
            "RETURNING key")
        self.update_health = (f"UPDATE health SET {', '.join(f'{c} = :{c}' for c in hcols)} "
                              "WHERE key = :key")
        greatest = self.GREATEST
        self.group_fact = (
            "INSERT INTO capacity_groups (group_id, mode, until, reason, sampled_at, updated_at) "
            "VALUES (:group, :mode, :until, :reason, :now, :now) ON CONFLICT (group_id) DO "
            "UPDATE SET mode = excluded.mode, reason = excluded.reason, sampled_at = "
            "excluded.sampled_at, updated_at = excluded.updated_at, until = CASE WHEN "
            "capacity_groups.mode <> 'open' AND capacity_groups.until IS NOT NULL AND "
            f"excluded.until IS NOT NULL THEN {greatest}(capacity_groups.until, excluded.until) "
            "ELSE excluded.until END")
        self.insert_provenance = (
            "INSERT INTO provenance (run_id, ref, content_hash, kind, created_at) VALUES "
            "(:run_id, :ref, :content_hash, :kind, :now) ON CONFLICT DO NOTHING")
        self.renew = ("UPDATE runs SET lease_expires_at = :expires, updated_at = :now "
                      "WHERE run_id = :run_id")
        self.acquire = ("UPDATE runs SET lease_holder = :holder, fence = :fence, "
                        "lease_expires_at = :expires, updated_at = :now WHERE run_id = :run_id")
        self.release = ("UPDATE runs SET lease_holder = NULL, lease_expires_at = NULL, "
                        "updated_at = :now WHERE run_id = :run_id")
        self.count_slots = ("SELECT count(*) FROM group_slots WHERE run_id = :run_id "
                            "AND fence = :fence")
        self.finish = "UPDATE runs SET status = :status, updated_at = :now WHERE run_id = :run_id"
        self.take_retry = ("UPDATE runs SET retries_used = retries_used + 1, updated_at = :now "
                           "WHERE run_id = :run_id")
        self.mark_unknown = (
            "UPDATE attempts SET state = 'unknown', settled_at = :now, settle_fence = :fence "
            "WHERE attempt_id = :attempt_id")
        self.ensure_health = (
            "INSERT INTO health (key, kind, provider, error_count, failure_counts, updated_at) "
            "VALUES (:key, :kind, :provider, 0, '{}', :now) ON CONFLICT DO NOTHING")
        self.claim_probe = (
            "UPDATE health SET last_probe_at = :now, updated_at = :now WHERE key = :key AND "
            "(last_probe_at IS NULL OR last_probe_at <= :since) RETURNING key")
        # Probe state is bounded like GoClaw's throttle map: times past the TTL are forgotten,
        # and of the others only the newest `keep` stay besides the key just claimed. Rows
        # another transaction holds are skipped (PostgreSQL), so concurrent claims never wait
        # on each other's evictions; the bound is exact when claims do not overlap.
        self.forget_probes = (
            "UPDATE health SET last_probe_at = NULL WHERE key IN (SELECT key FROM health "
            "WHERE last_probe_at IS NOT NULL AND key <> :key AND (last_probe_at <= :expired "
            "OR key NOT IN (SELECT key FROM health WHERE last_probe_at IS NOT NULL AND "
            "key <> :key ORDER BY last_probe_at DESC, key DESC LIMIT :keep))"
            + self.SKIP_LOCKED + ")")
        self.compaction = (
            "UPDATE runs SET compactions = compactions + 1, updated_at = :now "
            "WHERE run_id = :run_id RETURNING compactions")

    @abc.abstractmethod
    def list_param(self, values: Sequence[str] | Sequence[int]) -> Any:
        """A list parameter as :attr:`IN_LIST` takes it."""

    @abc.abstractmethod
    def writes(self, items: Sequence[Q]) -> tuple[Q, ...]:
        """The writes that end a transaction, as this database takes them best."""


class SqliteSql(Sql):
    """The hot path's statements on SQLite: no row locks, JSON arrays, ``MAX``."""

    LOCK = ""
    IN_LIST = "IN (SELECT value FROM json_each(:{0}))"
    GREATEST = "MAX"
    SKIP_LOCKED = ""

    def list_param(self, values: Sequence[str] | Sequence[int]) -> Any:
        """A list parameter as a JSON array (read by ``json_each``)."""
        return json.dumps(list(values))

    def writes(self, items: Sequence[Q]) -> tuple[Q, ...]:
        """The writes as they are: there are no round trips to save."""
        return tuple(items)


class PostgresSql(Sql):
    """The hot path's statements on PostgreSQL: row locks, arrays, ``GREATEST``, and the
    writes that end a transaction sent as one statement."""

    LOCK = " FOR UPDATE"
    IN_LIST = "= ANY(:{0})"
    GREATEST = "GREATEST"
    SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"
    NOTIFY_QUEUE = f"SELECT pg_notify('{QUEUE_CHANNEL}', :group)"

    def __init__(self) -> None:
        super().__init__()
        self._combined: dict[tuple[tuple[str, int], ...], str] = {}

    def list_param(self, values: Sequence[str] | Sequence[int]) -> Any:
        """A list parameter as an array."""
        return list(values)

    def writes(self, items: Sequence[Q]) -> tuple[Q, ...]:
        """One statement of data-modifying CTEs (every statement costs the client a round of
        work in the driver, and they touch distinct rows, none reading another's writes, so
        one snapshot serves them all)."""
        if len(items) < 2:
            return tuple(items)
        shape = tuple((q.sql, len(q.batch) if q.many else -1) for q in items)
        sql = self._combined.get(shape)
        if sql is None:
            ctes = []
            for i, (text, n) in enumerate(shape):
                if n == 0:
                    continue
                if n > 0:
                    head, _, values = text.partition(" VALUES ")
                    rows = ", ".join(_prefixed(values, f"p{i}_{j}_") for j in range(n))
                    ctes.append(f"w{i} AS ({head} VALUES {rows})")
                else:
                    ctes.append(f"w{i} AS ({_prefixed(text, f'p{i}_')})")
            sql = self._combined[shape] = "WITH " + ", ".join(ctes) + " SELECT 1"
        params: dict[str, Any] = {}
        for i, q in enumerate(items):
            if q.many:
                for j, row in enumerate(q.batch):
                    params.update({f"p{i}_{j}_{k}": v for k, v in row.items()})
            else:
                params.update({f"p{i}_{k}": v for k, v in q.mapping.items()})
        return (Q(sql, params),)


# A ``:name`` parameter (not a ``::`` cast).
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_][A-Za-z0-9_]*)")


def _prefixed(sql: str, prefix: str) -> str:
    return _PARAM.sub(lambda m: ":" + prefix + m.group(1), sql)

SQLITE_SQL = SqliteSql()
POSTGRES_SQL = PostgresSql()


# -- the lease rule ----------------------------------------------------------------------------


def check_fence(row: Any, run_id: str, fence: int) -> None:
    if row.fence != fence:
        raise FencedOut(
            f"run {run_id!r} is now held under fence {row.fence}; this executor's fence "
            f"{fence} is stale: stop working on the run (another executor took it over)",
            run_id=run_id, fence=fence, current=row.fence,
        )


def check_live(row: Any, lease: Lease, now: float, margin_s: float) -> None:
    """Raise unless ``lease`` is live at ``now`` on the locked run ``row`` (fence checked)."""
    check_fence(row, lease.run_id, lease.fence)
    problem = lease_problem(row.lease_holder, row.lease_expires_at, lease.executor, now,
                            margin_s)
    if problem == "released":
        raise LeaseLost(
            f"the lease on run {lease.run_id!r} (fence {lease.fence}) was released; acquire "
            "it again before starting more work on the run",
            run_id=lease.run_id, fence=lease.fence, reason=problem)
    if problem == "expired":
        raise LeaseLost(
            f"the lease on run {lease.run_id!r} (fence {lease.fence}) expired at "
            f"{row.lease_expires_at} (now {now}, margin {margin_s:g}s); acquire it again (the "
            "fence moves on) before starting more work on the run",
            run_id=lease.run_id, fence=lease.fence, reason=problem,
            expires_at=row.lease_expires_at)
    if problem == "holder":
        raise FencedOut(
            f"run {lease.run_id!r} is held by {row.lease_holder!r}, not {lease.executor!r}",
            run_id=lease.run_id, fence=lease.fence, current=row.fence)


def _locked(rows: list[Any], cols: Sequence[str], run_id: str) -> SimpleNamespace:
    if not rows:
        raise NotFound(f"unknown run id {run_id!r}; check the id or admit the run first",
                       run_id=run_id)
    return _ns(cols, rows[0])


def _lock_live(sql: Sql, stmt: str, cols: Sequence[str], lease: Lease, clock: ClockFn,
               margin: float) -> Tx[tuple[SimpleNamespace, float]]:
    row = _locked((yield Q(stmt, {"run_id": lease.run_id})), cols, lease.run_id)
    now = clock()
    check_live(row, lease, now, margin)
    return row, now


FENCE_COLS = ("fence", "lease_holder", "lease_expires_at", "max_tokens")
RETRY_COLS = ("fence", "lease_holder", "lease_expires_at", "max_retries", "carved_retries",
              "retries_used")


# -- the read of a decision --------------------------------------------------------------------


def snapshot_tx(sql: Sql, run_id: str, groups: Sequence[str], keys: Sequence[str],
                runs: Sequence[str], refs: Sequence[str], clock: ClockFn) -> Tx[SnapshotRows]:
    listed = sql.list_param(groups)
    items = [Q(sql.run_live, {"run_id": run_id}),
             Q(sql.groups, {"groups": listed}),
             Q(sql.group_slots, {"groups": listed}),
             Q(sql.health, {"keys": sql.list_param(keys)})]
    if refs:
        items.append(Q(sql.provenance, {"runs": sql.list_param(runs),
                                        "refs": sql.list_param(refs)}))
    res = yield Flush(tuple(items))
    now = clock()
    run = _locked(res[0], RUN_LIVE_COLS, run_id)
    expiries: dict[str, list[float]] = {}
    for gid, exp in res[2]:
        if exp is not None:
            expiries.setdefault(gid, []).append(float(exp))
    projections: dict[str, GroupProjection] = {}
    for gid, limit, mode_text, until, sampled in res[1]:
        mode = GroupMode(mode_text)
        if mode is not GroupMode.OPEN and until is not None and until <= now:
            mode = GroupMode.OPEN  # the waiting floor has passed
        projections[gid] = GroupProjection(
            group=gid, mode=mode, until=until,
            sampled_at=sampled if sampled is not None else now,
            in_flight=sum(1 for e in expiries.get(gid, ()) if e > now) if limit is not None
            else 0, limit=limit)
    health = {row[0]: health_record(_ns(HEALTH_COLS, row)) for row in res[3]}
    prov: dict[str, set[str]] = {}
    for ref, digest in (res[4] if refs else ()):
        prov.setdefault(ref, set()).add(digest)
    return SnapshotRows(run, projections, health, {k: frozenset(v) for k, v in prov.items()}, now)


# -- begin -------------------------------------------------------------------------------------


def begin_tx(sql: Sql, spec: BeginSpec, clock: ClockFn, margin: float
             ) -> Tx[AttemptRecord | Queued]:
    """Record an Attempt before it is sent (see ``Store.begin_attempt``).

    With ``spec.queue_until`` a full group queues the begin instead (:class:`Queued`, nothing
    recorded as an Attempt); the same begin again, once its place comes up, records it.
    """
    lease = Lease(spec.run_id, spec.executor or "", spec.fence, 0.0)
    locked, looked = yield Flush((
        Q(sql.lock_run, {"run_id": spec.run_id}),
        # Its own statement, after the lock: in READ COMMITTED it sees every begin of this run
        # that committed while this one waited (a locking statement's other reads would not).
        Q(sql.begin_lookup, {"run_id": spec.run_id, "attempt_id": spec.attempt_id,
                             "group": spec.route.group}),
    ))
    run = _locked(locked, BEGIN_RUN_COLS, spec.run_id)
    now = clock()
    check_live(run, lease, now, margin)
    next_seq, prior, g_id, g_limit, g_mode, g_until = looked[0]
    if prior is not None:
        return (yield from _begin_again(sql, spec, run, lease, now, clock, margin,
                                        (g_id, g_limit, g_mode, g_until)))
    _check_allowances(spec, run)
    adm = yield from _admit(sql, spec, (g_id, g_limit, g_mode, g_until), now, clock)
    if adm.now != now:
        now = adm.now  # recorded at the time of the capacity decision: live then too
        check_live(run, lease, now, margin)
    if adm.queued:
        return (yield from _enqueue(sql, spec, adm))
    rejected = adm.rejected
    state = AttemptState.REJECTED if rejected else AttemptState.DISPATCHING
    debit_id = "d-" + spec.attempt_id
    values = {
        "attempt_id": spec.attempt_id, "run_id": spec.run_id, "tenant": spec.tenant,
        "turn_id": spec.turn_id, "seq": next_seq, "kind": spec.kind.value,
        "route_id": spec.route.id, "provider": spec.route.provider, "model": spec.route.model,
        "group_id": spec.route.group, "profile_id": spec.profile_id, "debit_id": debit_id,
        "envelope_hash": spec.envelope_hash, "state": state.value,
        "reject_reason": redact(rejected[0]) if rejected else None, "effective_output": False,
        "tool_started": False, "reserved_micros": spec.reserve_micros,
        "reserved_tokens": 0 if rejected else spec.reserve_tokens,
        "begin_hash": spec.begin_hash, "fence": spec.fence, "executor": spec.executor,
        "created_at": now, "settled_at": now if rejected else None,
    }
    debit_state = DebitState.VOIDED if rejected else DebitState.RESERVED
    writes = [
        Q(sql.insert_debit, {"debit_id": debit_id, "run_id": spec.run_id,
                             "attempt_id": spec.attempt_id, "state": debit_state.value,
                             "reserved_micros": spec.reserve_micros, "created_at": now,
                             "settled_at": now if rejected else None}),
        Q(sql.insert_attempt, values),
    ]
    events = [_event(spec.run_id, spec.attempt_id, k, d, now) for k, d in spec.events]
    if adm.place is not None and adm.place.live:
        # The wait is recorded once, with the Attempt it ended in.
        events.append(_event(spec.run_id, spec.attempt_id, "capacity_wait", {
            "group": spec.route.group, "limit": adm.limit, "ticket": adm.place.ticket,
            "waited_s": round(max(0.0, now - adm.place.enqueued_at), 6),
            "outcome": "rejected" if rejected else "admitted"}, now))
    if adm.leaving:
        writes.append(Q(sql.drop_waiters, {"group": spec.route.group,
                                           "tickets": sql.list_param(adm.leaving)}))
    if rejected:
        events.append(_event(spec.run_id, spec.attempt_id, "reject", {
            "reason": rejected[0], "until": rejected[1], "group": spec.route.group}, now))
    else:
        writes.append(Q(sql.insert_slot, {"attempt_id": spec.attempt_id,
                                          "group_id": spec.route.group, "run_id": spec.run_id,
                                          "fence": spec.fence, "acquired_at": now}))
    if events:
        writes.append(Q(sql.insert_event, events, many=True))
    writes.append(Q(sql.begin_run, {
        "run_id": spec.run_id, "calls": 0 if rejected else 1,
        "retries": 1 if spec.take_retry else 0,
        "reserve": 0 if rejected else spec.reserve_micros,
        "reserve_tokens": 0 if rejected else spec.reserve_tokens,
        "status": RunStatus.RUNNING.value, "now": now}))
    faults.point("begin.before_commit")
    yield Flush(sql.writes(writes), commit=True)
    faults.point("begin.after_commit")
    record = written_attempt(values, debit_state.value)
    if rejected:
        raise _refused(spec, rejected, record.seq)
    return record


def _refused(spec: BeginSpec, rejected: tuple[str, float | None], seq: int | None
             ) -> CapacityUnavailable:
    return CapacityUnavailable(
        f"capacity group {spec.route.group!r} refused attempt {spec.attempt_id!r} "
        f"({rejected[0]}); it was recorded as rejected, its hold voided, nothing sent",
        attempt_id=spec.attempt_id, group=spec.route.group, reason=rejected[0],
        until=rejected[1], seq=seq, route=spec.route.id,
    )


def _check_allowances(spec: BeginSpec, run: Any) -> None:
    left = budget_left(run)
    if left.calls <= 0:
        raise AllowanceExhausted(
            f"run {spec.run_id!r} has used its model-call allowance "
            f"({run.calls_used} of {run.max_calls}); nothing was sent",
            run_id=spec.run_id, route=spec.route.id, field="calls",
        )
    if spec.take_retry and left.retries <= 0:
        raise AllowanceExhausted(
            f"run {spec.run_id!r} has no retry permission left ({run.retries_used} of "
            f"{run.max_retries} used); every further attempt of a turn takes one",
            run_id=spec.run_id, route=spec.route.id, field="retries",
        )
    if spec.reserve_micros > left.micros:
        raise BudgetExceeded(
            f"a hold of {from_micros(spec.reserve_micros)} would overdraw run "
            f"{spec.run_id!r} (left: {from_micros(left.micros)}); nothing was sent",
            run_id=spec.run_id, route=spec.route.id, field="cost",
            requested=str(from_micros(spec.reserve_micros)),
            available=str(from_micros(left.micros)),
        )
    if left.tokens is not None and spec.reserve_tokens > left.tokens:
        raise BudgetExceeded(
            f"a hold of {spec.reserve_tokens} tokens would overdraw run "
            f"{spec.run_id!r}'s token budget (left: {left.tokens}); nothing was sent",
            run_id=spec.run_id, route=spec.route.id, field="tokens",
            requested=spec.reserve_tokens, available=left.tokens,
        )


@dataclass(frozen=True)
class _Place:
    """A waiter's place in a group's queue, as read under the group's lock."""

    ticket: int
    waiter_id: str
    enqueued_at: float
    live: bool


@dataclass(frozen=True)
class _Admission:
    """What admission decided for one begin, and what it leaves to write.

    ``rejected``: (reason, floor) when refused; ``queued``: full, and the begin waits in the
    queue; ``place``: the begin's own place, if it had one; ``leaving``: tickets to drop (the
    begin's own once it is served or refused, and dead places found on the way).
    """

    now: float
    rejected: tuple[str, float | None] | None = None
    queued: bool = False
    place: _Place | None = None
    leaving: tuple[int, ...] = ()
    ahead: int = 0
    in_flight: int = 0
    limit: int | None = None


def _admit(sql: Sql, spec: BeginSpec, looked: tuple[Any, Any, Any, Any], now: float,
           clock: ClockFn) -> Tx[_Admission]:
    """Whether the group admits one more attempt, refuses it, or queues it.

    A limited group admits a begin while its live slots plus the live places ahead of the
    begin's own (all of them, for a begin without a place) stay below its limit: first come,
    first served across processes.
    """
    group = spec.route.group
    g_id, limit, mode, until = looked
    if g_id is None:
        # A group nobody configured yet: create its row (open, unlimited), then decide on it.
        [_, [(mode, until, limit)]] = yield Flush((
            Q(sql.ensure_group, {"group": group, "now": now}),
            Q(sql.lock_group, {"group": group})))
    elif limit is not None:
        # Only a limited group's row is locked: its slot count must be serialized; reading the
        # mode of an unlimited group without it keeps busy groups from serializing begins.
        [(mode, until, limit)] = yield Q(sql.lock_group, {"group": group})
    if limit is None:
        if mode != GroupMode.OPEN.value and (until is None or until > now):
            return _Admission(now, rejected=("group_" + mode, until))
        return _Admission(now)
    # The slots and places first, the clock after: a slot released (or a lease that lapsed)
    # before this decision is then also before it in recorded time.
    slots, waiting = yield Flush((Q(sql.slot_expiries, {"group": group}),
                                  Q(sql.waiters, {"group": group})))
    now = max(now, clock())
    places = [_Place(int(t), w, float(at), float(exp) > now
                     and held is not None and float(held) > now)
              for t, w, at, exp, held in waiting]
    mine = next((p for p in places if p.waiter_id == spec.attempt_id), None)
    dead = tuple(p.ticket for p in places if not p.live)
    leaving = tuple(sorted({*dead, *((mine.ticket,) if mine is not None else ())}))
    if mode != GroupMode.OPEN.value and (until is None or until > now):
        return _Admission(now, rejected=("group_" + mode, until), place=mine, leaving=leaving,
                          limit=limit)
    in_flight = sum(1 for (e,) in slots if e is not None and float(e) > now)
    live = [p for p in places if p.live]
    ahead = (sum(1 for p in live if p.ticket < mine.ticket) if mine is not None and mine.live
             else len(live))
    if in_flight + ahead < limit:
        return _Admission(now, place=mine, leaving=leaving, in_flight=in_flight, limit=limit)
    if spec.queue_until is None:
        return _Admission(now, rejected=("capacity_full", None), place=mine, leaving=leaving,
                          ahead=ahead, in_flight=in_flight, limit=limit)
    if mine is not None and mine.live:
        leaving = dead
    return _Admission(now, queued=True, place=mine, leaving=leaving, ahead=ahead,
                      in_flight=in_flight, limit=limit)


def _enqueue(sql: Sql, spec: BeginSpec, adm: _Admission) -> Tx[Queued]:
    """Keep (or take) the begin's place in its full group's queue; nothing else is written."""
    group, place = spec.route.group, adm.place
    assert adm.limit is not None and spec.queue_until is not None
    writes: list[Q] = []
    if adm.leaving:
        writes.append(Q(sql.drop_waiters, {"group": group,
                                           "tickets": sql.list_param(adm.leaving)}))
    if place is None or not place.live:
        writes.append(Q(sql.insert_waiter, {
            "group_id": group, "waiter_id": spec.attempt_id, "run_id": spec.run_id,
            "fence": spec.fence, "enqueued_at": adm.now,
            "expires_at": max(spec.queue_until, adm.now)}))
    if writes:
        res = yield Flush(tuple(writes), commit=True)
        if place is None or not place.live:
            place = _Place(int(res[-1][0][0]), spec.attempt_id, adm.now, True)
    assert place is not None
    return Queued(group=group, ticket=place.ticket, ahead=adm.ahead, in_flight=adm.in_flight,
                  limit=adm.limit, since=place.enqueued_at, now=adm.now)


def leave_queue_tx(sql: Sql, waiter_id: str, group: str) -> Tx[bool]:
    """Give up a place in ``group``'s queue (a waiter cancelled or past its bound).

    The waiters behind it are told (PostgreSQL), since the place may have held a slot back.
    """
    items = [Q(sql.leave_queue, {"waiter_id": waiter_id})]
    if sql.NOTIFY_QUEUE is not None:
        items.append(Q(sql.NOTIFY_QUEUE, {"group": group}))
    yield Flush(tuple(items), commit=True)
    return True


def _begin_again(sql: Sql, spec: BeginSpec, run: Any, lease: Lease, now: float,
                 clock: ClockFn, margin: float, looked: tuple[Any, Any, Any, Any]
                 ) -> Tx[AttemptRecord]:
    """A begin whose attempt id is already recorded: the same write again (its record), or,
    retried under a lease acquired again after a lost acknowledgement, its adoption."""
    [row] = yield Q(sql.attempt, {"attempt_id": spec.attempt_id})
    prior = _ns((*ATTEMPT_COLS, "debit_state", "debit_reserved_micros"), row)
    if prior.begin_hash != spec.begin_hash or prior.run_id != spec.run_id:
        raise Conflict(
            f"attempt id {spec.attempt_id!r} is already recorded with different "
            "content; use a new attempt id for a new physical call",
            attempt_id=spec.attempt_id,
        )
    if (prior.state != AttemptState.DISPATCHING.value or prior.fence == spec.fence
            or prior.executor != spec.executor):
        return attempt_record(prior, prior.debit_state)
    # Never sent (its begin was retried): adopted under the new fence if its group admits it
    # now (it does not queue: the turn that began it is gone).
    adm = yield from _admit(sql, replace(spec, queue_until=None), looked, now, clock)
    rejected, now = adm.rejected, adm.now
    check_live(run, lease, now, margin)
    if rejected is None:
        yield Flush((
            Q(sql.adopt_attempt, {"fence": spec.fence, "attempt_id": spec.attempt_id}),
            Q(sql.adopt_slot, {"fence": spec.fence, "attempt_id": spec.attempt_id}),
            Q(sql.insert_event, [_event(spec.run_id, spec.attempt_id, "adopt", {
                "from_fence": int(prior.fence), "fence": spec.fence}, now)], many=True),
        ), commit=True)
        prior.fence = spec.fence
        return attempt_record(prior, prior.debit_state)
    yield Flush((
        Q(sql.void_attempt, {"reason": rejected[0], "now": now, "fence": spec.fence,
                             "attempt_id": spec.attempt_id}),
        Q(sql.void_debit, {"now": now, "debit_id": prior.debit_id}),
        Q(sql.delete_slot, {"attempt_id": spec.attempt_id}),
        Q(sql.void_run, {"reserve": prior.debit_reserved_micros,
                         "reserve_tokens": prior.reserved_tokens, "now": now,
                         "run_id": spec.run_id}),
        Q(sql.insert_event, [_event(spec.run_id, spec.attempt_id, "reject", {
            "reason": rejected[0], "group": spec.route.group, "adoption": True}, now)],
          many=True),
    ), commit=True)
    raise _refused(spec, rejected, int(prior.seq))


def _event(run_id: str | None, attempt_id: str | None, kind: str, data: Mapping[str, Any],
           now: float) -> dict[str, Any]:
    return {"run_id": run_id, "attempt_id": attempt_id, "kind": kind,
            "data": event_json(data), "created_at": now}


# -- settle ------------------------------------------------------------------------------------

_SETTLE_COLS = (*ATTEMPT_COLS, "debit_state", "debit_reserved_micros",
                *("h_" + c for c in HEALTH_COLS))


def settle_tx(sql: Sql, run_id: str, spec: SettleSpec, clock: ClockFn) -> Tx[AttemptRecord]:
    """Record an Attempt's outcome (see ``Store.settle_attempt``)."""
    keys = list(spec.health)
    locked, read = yield Flush((
        Q(sql.lock_run_fence, {"run_id": run_id}),
        Q(sql.settle_read, {"attempt_id": spec.attempt_id, "run_id": run_id,
                            "key": keys[0] if keys else None}),
    ))
    run = _locked(locked, FENCE_COLS, run_id)
    check_fence(run, run_id, spec.fence)
    now = clock()
    if not read:
        raise NotFound(f"unknown attempt id {spec.attempt_id!r} in run {run_id!r}",
                       attempt_id=spec.attempt_id, run_id=run_id)
    att = _ns(_SETTLE_COLS, read[0])
    if att.state == AttemptState.REJECTED.value:
        raise InvalidState(
            f"attempt {spec.attempt_id!r} was rejected before dispatch; nothing to settle",
            attempt_id=spec.attempt_id,
        )
    if att.state != AttemptState.DISPATCHING.value:
        if att.settle_hash == spec.settle_hash:
            return attempt_record(att, att.debit_state)
        raise SettleConflict(
            f"attempt {spec.attempt_id!r} is already settled as {att.state} with "
            "different content; a settled attempt is immutable",
            attempt_id=spec.attempt_id, state=att.state,
        )
    if att.fence != spec.fence:
        raise FencedOut(
            f"attempt {spec.attempt_id!r} was begun under fence {att.fence}, and run "
            f"{run_id!r} has since been acquired again (fence {spec.fence}): its "
            "outcome is kept as a late receipt; recovery marks it unknown",
            run_id=run_id, fence=spec.fence, attempt_fence=int(att.fence),
        )
    if att.debit_state is None:
        raise StorageError(f"attempt {spec.attempt_id!r} has no debit row",
                           attempt_id=spec.attempt_id)
    tokens = (None if spec.prompt_tokens is None and spec.completion_tokens is None
              else (spec.prompt_tokens or 0) + (spec.completion_tokens or 0))
    holds = settle_holds(spec.outcome, spec.fact, cost_micros=spec.cost_micros, tokens=tokens,
                         reserved_micros=att.debit_reserved_micros,
                         reserved_tokens=att.reserved_tokens,
                         token_budget=run.max_tokens is not None)
    fact = spec.fact
    values: dict[str, Any] = {
        "state": AttemptState(spec.outcome.value).value,
        "fact": fact_json(fact) if fact is not None else None,
        "category": fact.category.value if fact else None,
        "http_status": fact.status if fact else None,
        "effective_output": spec.effective_output, "tool_started": spec.tool_started,
        "prompt_tokens": spec.prompt_tokens, "completion_tokens": spec.completion_tokens,
        "cost_micros": spec.cost_micros,
        "model_reported": redact(spec.model_reported) if spec.model_reported else None,
        "output_hash": spec.output_hash, "settle_hash": spec.settle_hash,
        "settle_fence": spec.fence, "settled_at": now,
    }
    settle_debit = (att.debit_state == DebitState.RESERVED.value
                    and holds.debit is not DebitState.RESERVED)
    succeeded = spec.outcome is Outcome.SUCCEEDED
    writes = [Q(sql.settle_attempt, {**values, "attempt_id": spec.attempt_id})]
    if settle_debit:
        writes.append(Q(sql.settle_debit, {"state": holds.debit.value,
                                           "posted": holds.posted_micros, "now": now,
                                           "debit_id": att.debit_id}))
    writes.append(Q(sql.delete_slot, {"attempt_id": spec.attempt_id}))
    run_params: dict[str, Any] = {
        "run_id": run_id, "release": holds.release_micros if settle_debit else 0,
        "posted": holds.posted_micros if settle_debit else 0,
        "release_tokens": holds.release_tokens if settle_debit else 0,
        "tokens": holds.tokens_used, "uncount": 1 if holds.uncount_call else 0, "now": now,
    }
    if succeeded:
        run_params.update(route=att.route_id, profile=att.profile_id)
    writes.append(Q(sql.settle_run_succeeded if succeeded else sql.settle_run, run_params))
    if succeeded:
        for digest in dict.fromkeys((spec.output_hash, *spec.provenance)):
            if digest:
                writes.append(Q(sql.insert_provenance, {
                    "run_id": run_id, "ref": spec.attempt_id, "content_hash": digest,
                    "kind": "model_output", "now": now}))
    if spec.group_update is not None:
        writes.append(_group_fact(sql, att.group_id, spec.group_update, now))
    if spec.events:
        writes.append(Q(sql.insert_event, [_event(run_id, spec.attempt_id, k, d, now)
                                           for k, d in spec.events], many=True))
    # Health: the first key's row came with the read; a row that a success leaves unchanged
    # (a healthy key) is neither locked nor written, so settles of many workers on one route
    # never queue on it. Changing rows are locked and the pure update re-applied as locked.
    for i, key in enumerate(keys):
        kind, provider, update = spec.health[key]
        seen = (health_record(SimpleNamespace(**{c: getattr(att, "h_" + c)
                                                 for c in HEALTH_COLS}))
                if i == 0 and att.h_key is not None else None)
        if seen is not None and update(seen) == seen:
            continue
        writes.extend((yield from _health_write(sql, key, kind, provider, update, now,
                                                seen is not None)))
    faults.point("settle.before_commit")
    yield Flush(sql.writes(writes), commit=True)
    faults.point("settle.after_commit")
    return written_attempt({**{c: getattr(att, c) for c in ATTEMPT_COLS}, **values},
                           holds.debit.value if settle_debit else att.debit_state)


def _health_write(sql: Sql, key: str, kind: str, provider: str | None, update: HealthUpdate,
                  now: float, exists: bool) -> Tx[list[Q]]:
    """The statements that apply ``update`` to a health row, computed on the row as locked."""
    if not exists:
        fresh = health_values(update(Health(key=key)), now)
        inserted = yield Q(sql.insert_health, {"key": key, "kind": kind, "provider": provider,
                                               **fresh})
        if inserted:
            return []
    rows = yield Q(sql.lock_health, {"key": key})
    current = health_record(_ns(HEALTH_COLS, rows[0]))
    return [Q(sql.update_health, {"key": key, **health_values(update(current), now)})]


def _group_fact(sql: Sql, group: str, upd: GroupUpdate, now: float) -> Q:
    # One upsert; a later fact never shortens a known waiting floor.
    return Q(sql.group_fact, {"group": group, "mode": upd.mode.value, "until": upd.until,
                              "reason": upd.reason, "now": now})


def late_receipt_tx(sql: Sql, run_id: str, spec: SettleSpec, now: float, why: str) -> Tx[None]:
    """Keep a refused settle's observation beside the Attempt (append-only, no fence)."""
    yield Flush((Q(sql.insert_event, [_event(run_id, spec.attempt_id, "late_receipt", {
        "outcome": spec.outcome.value, "fact": spec.fact.to_json() if spec.fact else None,
        "prompt_tokens": spec.prompt_tokens, "completion_tokens": spec.completion_tokens,
        "cost_micros": spec.cost_micros, "model_reported": spec.model_reported,
        "output_hash": spec.output_hash, "fence": spec.fence, "refused": why,
    }, now)], many=True),), commit=True)


# -- leases and the smaller writes -------------------------------------------------------------


def acquire_tx(sql: Sql, run_id: str, executor: str, ttl_s: float, clock: ClockFn,
               margin: float) -> Tx[Lease]:
    row = _locked((yield Q(sql.lock_run_fence, {"run_id": run_id})), FENCE_COLS, run_id)
    now = clock()
    live = row.lease_holder is not None and (row.lease_expires_at or 0) > now
    if live and row.lease_holder != executor:
        raise LeaseHeld(
            f"run {run_id!r} is leased by {row.lease_holder!r} until "
            f"{row.lease_expires_at}; wait for it to expire or for recovery",
            run_id=run_id, holder=row.lease_holder, expires_at=row.lease_expires_at,
        )
    if live and lease_problem(row.lease_holder, row.lease_expires_at, executor, now,
                              margin) is None:
        # One's own live lease: renewed under the same fence. Inside the margin it is not
        # extended (another process may already count it as ended): the fence moves on.
        expires = max(float(row.lease_expires_at), now + ttl_s)
        yield Flush((Q(sql.renew, {"expires": expires, "now": now, "run_id": run_id}),),
                    commit=True)
        return Lease(run_id, executor, int(row.fence), expires)
    fence = int(row.fence) + 1
    yield Flush((
        Q(sql.acquire, {"holder": executor, "fence": fence, "expires": now + ttl_s, "now": now,
                        "run_id": run_id}),
        Q(sql.insert_event, [_event(run_id, None, "lease", {
            "executor": executor, "fence": fence, "previous": row.lease_holder,
            "expires_at": now + ttl_s}, now)], many=True),
    ), commit=True)
    return Lease(run_id, executor, fence, now + ttl_s)


def renew_tx(sql: Sql, lease: Lease, ttl_s: float, clock: ClockFn, margin: float) -> Tx[Lease]:
    _row, now = yield from _lock_live(sql, sql.lock_run_fence, FENCE_COLS, lease, clock, margin)
    yield Flush((Q(sql.renew, {"expires": now + ttl_s, "now": now, "run_id": lease.run_id}),),
                commit=True)
    return Lease(lease.run_id, lease.executor, lease.fence, now + ttl_s)


def release_tx(sql: Sql, lease: Lease, clock: ClockFn, *, again: bool = False) -> Tx[None]:
    """Give the lease up; ``again``: resolving a release whose acknowledgement was lost, so a
    Run that moved on to another fence was released (by it) and is not ours to refuse."""
    row = _locked((yield Q(sql.lock_run_fence, {"run_id": lease.run_id})), FENCE_COLS,
                  lease.run_id)
    if again and row.fence != lease.fence:
        return  # released, then acquired by another executor
    check_fence(row, lease.run_id, lease.fence)
    if row.lease_holder is None:
        return  # released already: the same write again
    now = clock()
    if lease_problem(row.lease_holder, row.lease_expires_at, lease.executor, now, 0.0):
        raise LeaseLost(
            f"the lease on run {lease.run_id!r} (fence {lease.fence}) is no longer live; there "
            "is nothing of it to release (recovery takes the run over)",
            run_id=lease.run_id, fence=lease.fence)
    [(held,)] = yield Q(sql.count_slots, {"run_id": lease.run_id, "fence": lease.fence})
    if held:
        raise InvalidState(
            f"run {lease.run_id!r} still has {held} attempt(s) in flight; settle them "
            "(or mark them unknown) before releasing the lease",
            run_id=lease.run_id, in_flight=held,
        )
    yield Flush((Q(sql.release, {"now": now, "run_id": lease.run_id}),), commit=True)


def finish_tx(sql: Sql, lease: Lease, status: RunStatus, clock: ClockFn,
              margin: float, *, again: bool = False) -> Tx[None]:
    """Record the Run's end; ``again``: resolving a finish whose acknowledgement was lost,
    so a Run already ended with ``status`` is left as it is (one ``finish`` event)."""
    _row, now = yield from _lock_live(sql, sql.lock_run_fence, FENCE_COLS, lease, clock, margin)
    if again:
        # Its own statement, after the lock: it sees the finish that committed meanwhile.
        [live] = yield Q(sql.run_live, {"run_id": lease.run_id})
        if _ns(RUN_LIVE_COLS, live).status == status.value:
            return
    yield Flush((
        Q(sql.finish, {"status": status.value, "now": now, "run_id": lease.run_id}),
        Q(sql.insert_event, [_event(lease.run_id, None, "finish", {"status": status.value},
                                    now)], many=True),
    ), commit=True)


def reserve_retry_tx(sql: Sql, lease: Lease, clock: ClockFn, margin: float,
                     data: Mapping[str, Any]) -> Tx[int]:
    row, now = yield from _lock_live(sql, sql.lock_run_full, RETRY_COLS, lease, clock, margin)
    left = row.max_retries - row.carved_retries - row.retries_used
    if left <= 0:
        raise AllowanceExhausted(
            f"run {lease.run_id!r} has no retry permission left "
            f"({row.retries_used} of {row.max_retries} used)",
            run_id=lease.run_id, field="retries",
        )
    yield Flush((
        Q(sql.take_retry, {"now": now, "run_id": lease.run_id}),
        Q(sql.insert_event, [_event(lease.run_id, None, "retry_permission", data, now)],
          many=True),
    ), commit=True)
    return int(left) - 1


def provenance_tx(sql: Sql, lease: Lease, ref: str, content_hash: str, kind: str,
                  clock: ClockFn, margin: float) -> Tx[None]:
    _row, now = yield from _lock_live(sql, sql.lock_run_fence, FENCE_COLS, lease, clock, margin)
    yield Flush((Q(sql.insert_provenance, {"run_id": lease.run_id, "ref": ref,
                                           "content_hash": content_hash, "kind": kind,
                                           "now": now}),), commit=True)


def event_tx(sql: Sql, lease: Lease, attempt_id: str | None, kind: str,
             data: Mapping[str, Any], clock: ClockFn, margin: float) -> Tx[None]:
    _row, now = yield from _lock_live(sql, sql.lock_run_fence, FENCE_COLS, lease, clock, margin)
    yield Flush((Q(sql.insert_event, [_event(lease.run_id, attempt_id, kind, data, now)],
                   many=True),), commit=True)


def mark_unknown_tx(sql: Sql, lease: Lease, attempt_id: str, clock: ClockFn,
                    reason: str) -> Tx[AttemptRecord]:
    row = _locked((yield Q(sql.lock_run_fence, {"run_id": lease.run_id})), FENCE_COLS,
                  lease.run_id)
    check_fence(row, lease.run_id, lease.fence)
    now = clock()
    rows = yield Q(sql.attempt, {"attempt_id": attempt_id})
    if not rows or rows[0][1] != lease.run_id:
        raise NotFound(f"unknown attempt id {attempt_id!r} in run {lease.run_id!r}",
                       attempt_id=attempt_id, run_id=lease.run_id)
    att = _ns((*ATTEMPT_COLS, "debit_state", "debit_reserved_micros"), rows[0])
    if att.state == AttemptState.DISPATCHING.value:
        if att.fence != lease.fence:
            raise FencedOut(
                f"attempt {attempt_id!r} was begun under fence {att.fence}, not "
                f"{lease.fence}; recovery marks it unknown",
                run_id=lease.run_id, fence=lease.fence, attempt_fence=int(att.fence))
        yield Flush((
            Q(sql.mark_unknown, {"now": now, "fence": lease.fence, "attempt_id": attempt_id}),
            Q(sql.delete_slot, {"attempt_id": attempt_id}),
            Q(sql.insert_event, [_event(lease.run_id, attempt_id, "unknown",
                                        {"reason": reason}, now)], many=True),
        ), commit=True)
        att.state = AttemptState.UNKNOWN.value
        att.settled_at = now
        att.settle_fence = lease.fence
    return attempt_record(att, att.debit_state)


def attempt_tx(sql: Sql, attempt_id: str) -> Tx[AttemptRecord]:
    """One Attempt with its debit's state (:class:`~ledger.errors.NotFound` for an unknown id)."""
    rows = yield Q(sql.attempt, {"attempt_id": attempt_id})
    if not rows:
        raise NotFound(f"unknown attempt id {attempt_id!r}; list a run's attempts with "
                       "`failover-ledger run show RUN_ID`", attempt_id=attempt_id)
    att = _ns((*ATTEMPT_COLS, "debit_state", "debit_reserved_micros"), rows[0])
    return attempt_record(att, att.debit_state)


def claim_probe_tx(sql: Sql, key: str, provider: str | None, now: float, interval_s: float,
                   *, kind: str = "route", ttl_s: float | None = None,
                   max_keys: int | None = None) -> Tx[bool]:
    """Take the probe slot of ``key`` (one caller per interval); a claim taken also bounds the
    probe state: times at least ``ttl_s`` old are forgotten, and at most ``max_keys`` keys keep
    one, the oldest going first (``ledger.decide.health.ProbeThrottle`` is the same rule)."""
    _, claimed = yield Flush((
        Q(sql.ensure_health, {"key": key, "kind": kind, "provider": provider, "now": now}),
        Q(sql.claim_probe, {"now": now, "key": key, "since": now - interval_s}),
    ), commit=not _bounded(ttl_s, max_keys))
    if claimed and _bounded(ttl_s, max_keys):
        expired = now - ttl_s if ttl_s is not None else float("-inf")
        keep = max_keys - 1 if max_keys is not None else 2**62
        yield Flush((Q(sql.forget_probes, {"key": key, "expired": expired, "keep": keep}),),
                    commit=True)
    return bool(claimed)


def _bounded(ttl_s: float | None, max_keys: int | None) -> bool:
    """Whether a claim bounds the probe state (a TTL or a key limit is given)."""
    return ttl_s is not None or max_keys is not None


def compaction_tx(sql: Sql, lease: Lease, clock: ClockFn, margin: float) -> Tx[int]:
    """Count one compaction of the Run's session (needs a live lease), with its event."""
    _row, now = yield from _lock_live(sql, sql.lock_run_fence, FENCE_COLS, lease, clock, margin)
    [(count,)] = yield Q(sql.compaction, {"run_id": lease.run_id, "now": now})
    yield Flush((Q(sql.insert_event, [_event(lease.run_id, None, "compaction",
                                             {"compactions": int(count)}, now)], many=True),),
                commit=True)
    return int(count)


__all__ = [
    "POSTGRES_SQL",
    "QUEUE_CHANNEL",
    "SQLITE_SQL",
    "PostgresSql",
    "SnapshotRows",
    "Sql",
    "SqliteSql",
    "acquire_tx",
    "attempt_tx",
    "begin_tx",
    "check_live",
    "claim_probe_tx",
    "compaction_tx",
    "event_tx",
    "finish_tx",
    "late_receipt_tx",
    "leave_queue_tx",
    "mark_unknown_tx",
    "provenance_tx",
    "release_tx",
    "renew_tx",
    "reserve_retry_tx",
    "settle_tx",
    "snapshot_tx",
]
