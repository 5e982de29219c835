"""The audit API: typed, paginated, read-only answers from the ledger alone.

:class:`Audit` holds the one implementation; :class:`AsyncAudit` runs the same methods in a worker
thread. Nothing here writes, so an audit works through a read-only database role (open the ledger
with ``Ledger.open(url, migrate_schema=False)``).

Questions it answers: which route served a Run and why (:meth:`Audit.timeline`); which Runs failed
over and for what cause (:meth:`Audit.failovers`); Attempts by route, group, outcome, category and
time (:meth:`Audit.attempts`); what each route, Run, tenant or label cost (:meth:`Audit.costs`);
what each tenant or label spent against the budgets of its Runs, over time (:meth:`Audit.spend`);
which cooldowns operators cleared and which Runs and Attempts they closed or settled
(:meth:`Audit.actions`);
which Attempts are unknown or still dispatching (:meth:`Audit.open_attempts`); which routes,
profiles and groups are cooling now (:meth:`Audit.health`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from enum import Enum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Any, Unpack

from ledger.api.arguments import AttemptFilters, Cursor, Limit, attempt_query
from ledger.api.calls import Awaiting, query
from ledger.api.facade import Ledger
from ledger.api.face import reads_of
from ledger.domain.facts import Category, FailureFact
from ledger.domain.records import (
    DURATION_BUCKETS,
    OPERATOR_ACTION_KINDS,
    AttemptRecord,
    AttemptState,
    Page,
    RunStatus,
    budget_left,
    from_micros,
)
from ledger.domain.validation import (
    Id,
    Problem,
    Time,
    checked,
    duration,
    instance,
    integers,
    listing,
    one_of,
    rule,
)
from ledger.errors import InvalidArgument, NotFound
from ledger.policy.model import Policy
from ledger.storage.audit import (
    LATENCY_MEASURES,
    SUCCEEDED_LATENCY,
    TOTALS_KEYS,
    AuditQueries,
)
from ledger.storage.rows import attempt_record
from ledger.storage.runner import Workers
from ledger.storage.runs import RunQueries
from ledger.storage.series import SeriesQueries

if TYPE_CHECKING:
    from ledger.ops.replay import ReplayReport

OPEN_STATES = ("unknown", "dispatching")
# The attempts that can cause a failover; a not_sent one only with a failure category (a
# route that cannot be used, a connection that never carried the request), not a cancellation
# before the send.
CAUSE_STATES = ("failed", "unknown", "rejected", "not_sent")
#: The events :meth:`Audit.actions` lists: an operator's clear, close, evidence and retention.
ACTION_KINDS = OPERATOR_ACTION_KINDS
#: How far back :meth:`Audit.health` looks for routes skipped as unusable, by default.
UNUSABLE_WINDOW_S = 86400.0
#: How far back :meth:`Audit.health` takes its latency percentiles, by default.
LATENCY_WINDOW_S = 86400.0


# -- result types ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    """A Run as the audit lists it: ids, status, routes, counters, budget, lease, times.

    Money (``reserved``, ``posted``, ``max_cost``, ``carved``, ``returned``, ``cost_left``) is
    in currency units; ``current_route`` is the route of the Run's last success. Its budget
    (``max_cost``, ``max_calls``, ``max_retries``, ``max_tokens``: ``None`` without a token
    budget) is what it was admitted with (``max_cost`` in the whole micro-units it is enforced
    at, rounded down: docs/concepts.md); ``carved*`` is what it carved out for its Children
    and still counts (less what they gave back when they ended), ``returned*`` what it gave
    back to its parent when it ended, as a Child; ``*_left`` is what it may still use: its
    budget less what it used, holds, carved and gave back.
    """

    run_id: str
    parent_run_id: str | None
    role: str
    tenant: str | None
    labels: dict[str, str]
    status: RunStatus
    selected_route: str
    current_route: str | None
    current_profile: str | None
    calls_used: int
    retries_used: int
    reserved: Decimal
    posted: Decimal
    max_cost: Decimal
    tokens_used: int
    lease_holder: str | None
    lease_expires_at: float | None
    created_at: float
    updated_at: float
    max_calls: int = 0
    max_retries: int = 0
    max_tokens: int | None = None
    tokens_reserved: int = 0
    carved: Decimal = Decimal(0)
    carved_calls: int = 0
    carved_retries: int = 0
    carved_tokens: int = 0
    returned: Decimal = Decimal(0)
    returned_calls: int = 0
    returned_retries: int = 0
    returned_tokens: int = 0
    cost_left: Decimal = Decimal(0)
    calls_left: int = 0
    retries_left: int = 0
    tokens_left: int | None = None


@dataclass(frozen=True)
class Skipped:
    """A candidate the selector passed over, and why."""

    route: str
    reason: str
    detail: str | None = None


@dataclass(frozen=True)
class Selection:
    """The selector's recorded decision that led to an attempt (a ``select`` event)."""

    decision: str | None
    route: str | None
    from_route: str | None
    profile: str | None
    reason: str | None
    skipped: list[Skipped] = field(default_factory=list)
    cause: dict[str, Any] | None = None


@dataclass(frozen=True)
class AuditEvent:
    """One audit event: its ``kind`` (``admit``, ``select``, ``move``, ``stop``, ...) and data."""

    event_id: int
    kind: str
    attempt_id: str | None
    data: dict[str, Any]
    created_at: float


@dataclass(frozen=True)
class TimelineEntry:
    """One attempt of a run's timeline, with its debit and the reasons it was made.

    Its times are the ledger clock's, in seconds from its begin: ``latency_s`` to its settle,
    ``first_byte_s`` to the response's first byte, ``first_token_s`` to a stream's first
    content (each ``None`` when not recorded); ``cached_tokens`` and ``reasoning_tokens`` the
    parts of its prompt and completion tokens the provider reported as cached and reasoning.
    """

    seq: int
    attempt_id: str
    turn_id: str
    kind: str
    route_id: str
    provider: str
    model: str
    group_id: str
    profile_id: str | None
    state: str
    debit_id: str
    debit_state: str
    reserved: Decimal
    posted: Decimal
    cost: Decimal | None
    prompt_tokens: int | None
    completion_tokens: int | None
    category: str | None
    http_status: int | None
    fact: FailureFact | None
    reject_reason: str | None
    created_at: float
    settled_at: float | None
    selection: Selection | None
    events: list[AuditEvent] = field(default_factory=list)
    latency_s: float | None = None
    first_byte_s: float | None = None
    first_token_s: float | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


@dataclass(frozen=True)
class Stop:
    """Why a turn of a Run stopped (a ``stop`` event).

    The reason, its detail, the candidates the selector passed over, the attempts the turn made
    and their errors.
    """

    reason: str
    detail: str | None
    skipped: list[Skipped]
    attempts: list[str]
    errors: list[str]
    at: float
    # One line per candidate of the plan: how it failed, or why it was skipped (and the fix).
    candidates: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Wait:
    """One wait of a turn (a ``capacity_wait`` or ``wait`` event), recorded once.

    ``kind``: ``capacity`` (in a full group's queue), ``reopening`` (for a cooling route) or
    ``group_floor`` (a group's waiting floor); ``outcome``: ``admitted`` (the Attempt it ended
    in is ``attempt_id``), ``rejected``, ``timed_out`` or ``redecided`` (its route stopped
    serving during the wait and the turn decided again; no Attempt).
    """

    kind: str
    group: str | None
    route: str | None
    waited_s: float
    outcome: str
    attempt_id: str | None
    at: float

    @property
    def text(self) -> str:
        """What the turn waited for, in words (``run show`` and the dashboard say it)."""
        if self.kind == "capacity":
            return f"for a slot of full group {self.group}"
        if self.kind == "reopening":
            return f"for route {self.route} to reopen"
        return f"for group {self.group}'s waiting floor"


@dataclass(frozen=True)
class RunTimeline:
    """A Run's whole story: its attempts in order, its own events, where it was served.

    ``failed_over`` is true when it was served elsewhere than its selected route at any of its
    turns, or the selector moved it (as :meth:`Audit.failovers` counts it); ``total_cost`` is
    what its budget was charged (``run.posted``: its attempts' posted debits) and ``held``
    what its holds still reserve (``run.reserved``: its unknown and in-flight attempts), also
    once retention has dropped its attempts. An attempt's own ``cost`` is the cost the
    provider reported, which may differ (none reported: the whole hold was posted).
    ``run.parent_run_id`` names its parent (a Child's) and ``children`` lists its own Child
    Runs, each with what it carved and gave back; ``run.cost_left`` (and the other
    ``*_left``) is what the Run may still use.
    """

    run: RunSummary
    attempts: list[TimelineEntry]
    run_events: list[AuditEvent]  # events not tied to one attempt (admit, lease, stop, finish)
    served_route: str | None  # the route of the run's last succeeded attempt
    failed_over: bool
    total_cost: Decimal
    stops: list[Stop] = field(default_factory=list)  # the run's stop events, oldest first
    waits: list[Wait] = field(default_factory=list)  # every wait of its turns, oldest first
    held: Decimal = Decimal(0)
    children: list[RunSummary] = field(default_factory=list)  # its Child Runs, oldest first


@dataclass(frozen=True)
class FailoverCause:
    """An attempt that preceded the failover: failed, unknown, rejected, or not sent.

    A route skipped as ``unusable`` (its key missing, its endpoint unusable; never sent) is
    one, with ``detail`` saying what is missing (the variable or profile) and the fix. A Run
    served elsewhere without any such attempt had its selected route passed over by the
    selector before its first Attempt (cooling, disabled): then the cause has ``state``
    ``skipped``, ``category`` the selector's reason (``route_cooldown``, ...), ``detail`` its
    words, and ``attempt_id`` the Attempt made instead; no retry permission was taken.
    """

    attempt_id: str
    route: str
    state: str
    category: str | None
    http_status: int | None
    detail: str | None = None  # an unusable route's reason (names the missing variable)


@dataclass(frozen=True)
class Move:
    """One of the selector's moves to another route (a ``move`` event), with its cause."""

    from_route: str | None
    to_route: str | None
    category: str | None
    status: int | None
    at: float


@dataclass(frozen=True)
class Failover:
    """A Run that failed over: the routes it tried, the failures that caused it, its moves."""

    run_id: str
    tenant: str | None
    labels: dict[str, str]
    status: RunStatus
    created_at: float
    selected_route: str
    served_route: str | None
    routes: list[str]  # routes tried, in order, each once
    causes: list[FailoverCause]
    moves: list[Move]


@dataclass(frozen=True)
class Totals:
    """Attempts, outcomes, tokens and money of one group of :meth:`Audit.costs` (its ``key``).

    ``cost`` is what the budget was charged (the posted debits: the same figure as the runs'
    ``posted``), ``held`` what is still reserved (unknown and in-flight attempts' holds, not
    charged yet: the runs' ``reserved``). Tokens are as the providers reported them.
    """

    key: str | None
    attempts: int
    succeeded: int
    failed: int
    unknown: int
    prompt_tokens: int
    completion_tokens: int
    cost: Decimal
    held: Decimal = Decimal(0)


@dataclass(frozen=True)
class SpendPoint:
    """The Runs of one key admitted in one time bucket (starting at ``start``).

    How many, their budgets, and what they have posted and hold now (see :class:`Spend`).
    """

    start: float
    runs: int
    budget: Decimal
    posted: Decimal
    held: Decimal


@dataclass(frozen=True)
class Spend:
    """A tenant's (or a label value's) spend against the budgets of its Runs.

    Over the Runs admitted in the window (``key`` ``None``: those without a tenant, or without
    the label): ``budget`` is the sum of their cost budgets as admitted (each less what it
    carved for its Children, which count under their own key, and, an ended Child's, less
    what it gave back to its parent, which counts it, so nothing counts twice),
    ``posted`` what they were charged and ``held`` what their holds still reserve, now (the
    Runs' own counters, the figures ``runs`` lists); ``left`` is ``budget - posted - held``,
    never negative (a Run never overdraws its budget). With ``every=``, ``points`` splits the
    same Runs by when they were admitted, one :class:`SpendPoint` per bucket, empty ones
    included.
    """

    key: str | None
    runs: int
    budget: Decimal
    posted: Decimal
    held: Decimal
    left: Decimal
    points: list[SpendPoint] = field(default_factory=list)


@dataclass(frozen=True)
class OperatorAction:
    """One operator's action as recorded: who, why, when, and on what.

    ``kind`` is ``clear_cooldown`` (``key`` the health key or group cleared), ``close`` (a
    Run closed by hand, or by recovery past its deadline), ``late_receipt`` (an unknown
    Attempt settled with evidence) or ``retention`` (history dropped: the cut-off, the
    partitions and rows); ``data`` is the event's whole record (what was cleared,
    the statuses and fences, the evidence and the money).
    """

    event_id: int
    kind: str
    by: str | None
    reason: str | None
    run_id: str | None
    attempt_id: str | None
    key: str | None
    at: float
    data: dict[str, Any]


@dataclass(frozen=True)
class OpenAttempt:
    """An unknown or still-dispatching attempt, and whether its executor still holds the run."""

    attempt: AttemptRecord
    lease_holder: str | None
    lease_expires_at: float | None
    lease_live: bool  # False: the executor is gone or fenced; recovery should look at it


@dataclass(frozen=True)
class KeyHealth:
    """One health row now: ``status`` is ``ok``, ``cooling`` or ``disabled``, with its counters.

    Counters past their reset time read as reset, as the selector would read them.

    ``counted_at`` is when the failure that counted the key's current outage was recorded
    (it stepped ``error_count``): its cooldown or disable runs from that outage, and the
    failures of requests already in flight then restart the window (``last_failure_at``
    moves) without moving it. Under ``health.count_overlapping_failures: false`` an outcome
    of an Attempt begun before it is the same outage: its failure steps nothing, its success
    does not reopen the key; one begun after it (a probe) steps the curve or reopens the key.
    ``None`` when the key counts no outage (``error_count`` 0, also once its counters read
    as reset), and on a row kept from before migration 0019 until the key's next counted
    failure (the overlap is then measured from ``last_failure_at``).
    """

    key: str
    kind: str  # route | profile | provider (one row shared by a provider's routes)
    provider: str | None
    status: str  # ok | cooling | disabled
    cooldown_until: float | None
    disabled_until: float | None
    disabled_reason: str | None
    error_count: int
    failure_counts: dict[str, int]
    last_failure_at: float | None
    last_used: float | None
    last_probe_at: float | None
    # Failures below the policy's cooling threshold (health.cooldown_after), not yet forgotten.
    recent_failures: int = 0
    # Last, with a default: a new field must not move the positions of the ones before it.
    counted_at: float | None = None


@dataclass(frozen=True)
class GroupHealth:
    """One capacity group now: its effective mode, waiting floor and slots in use."""

    group: str
    mode: str  # effective now: open | cooldown | unavailable
    stored_mode: str
    until: float | None  # the waiting floor
    reason: str | None
    sampled_at: float | None
    in_flight: int
    limit: int | None
    waiting: int = 0  # turns waiting in its queue for a slot


@dataclass(frozen=True)
class UnusableRoute:
    """A route (with one credential profile) the retry owner skipped as ``unusable``.

    Its key was missing or its endpoint could not make a request, so nothing was sent; it is no
    health penalty and so no cooldown, but every turn that reaches it skips it until it is
    fixed. Listed while the route has not served since its last skip. ``why`` is the last
    skip's reason: what is missing (the environment variable, the profile) and the fix.
    """

    route: str
    profile: str | None
    provider: str
    group: str
    skips: int  # in the window
    first_at: float
    last_at: float
    last_attempt: str
    last_run: str
    why: str | None


@dataclass(frozen=True)
class Percentiles:
    """One time of the Attempts of a key: how many have it, and its p50, p95 and p99 (seconds).

    Continuous percentiles (linear interpolation between the nearest ranks, as PostgreSQL's
    ``percentile_cont``), the same on every backend.
    """

    count: int
    p50: float
    p95: float
    p99: float


@dataclass(frozen=True)
class LatencyStats:
    """The times of one route's (or group's) Attempts.

    ``latency`` from begin to settle, ``first_token`` to a stream's first content,
    ``first_byte`` to the response's first byte, and ``succeeded_latency`` the latency of the
    succeeded ones alone (how long an answer took); each ``None`` when none of its Attempts
    has it.
    """

    key: str
    latency: Percentiles | None
    first_token: Percentiles | None = None
    first_byte: Percentiles | None = None
    succeeded_latency: Percentiles | None = None


@dataclass(frozen=True)
class LatencyReport:
    """Latency percentiles per route and per group over [since, until), as filtered.

    The filters are the ones asked for (``None``: any): the Attempts' ``route``, ``group``,
    failure ``category``, Run ``tenant`` and outcome ``state``. Only Attempts settled by their
    executor have a latency (not one still in flight, rejected, or resolved by recovery);
    times to the first byte and token only where the send reported them.
    """

    since: float | None
    until: float | None
    routes: list[LatencyStats]
    groups: list[LatencyStats]
    route: str | None = None
    group: str | None = None
    category: str | None = None
    tenant: str | None = None
    state: str | None = None


@dataclass(frozen=True)
class HealthReport:
    """Every route (and provider), profile and group health row, as of ``now``.

    ``unusable`` lists the routes skipped as unusable in the window and not served since;
    ``latency`` the percentiles of the routes' and groups' Attempt times over the last
    ``latency_window_s`` (:meth:`Audit.health`).
    """

    now: float
    routes: list[KeyHealth]
    profiles: list[KeyHealth]
    groups: list[GroupHealth]
    unusable: list[UnusableRoute] = field(default_factory=list)
    latency: LatencyReport | None = None


@dataclass(frozen=True)
class ActivityBucket:
    """Attempts, failures and unknowns in one time slice starting at ``start``."""

    start: float
    attempts: int
    failed: int
    unknown: int


@dataclass(frozen=True)
class RoutePoint:
    """One route in one time bucket.

    ``success_rate`` is succeeded / (succeeded + failed + unknown), ``None`` when nothing was sent;
    ``latency_s`` is the mean latency (begin to settle, by the ledger's clock) of the succeeded
    attempts, ``None`` when none succeeded.
    """

    start: float
    attempts: int
    succeeded: int
    failed: int
    unknown: int
    success_rate: float | None
    latency_s: float | None


@dataclass(frozen=True)
class RouteSeries:
    """A route's success rate and latency over equal time buckets (the dashboard's charts)."""

    route: str
    attempts: int
    points: list[RoutePoint]


@dataclass(frozen=True)
class DayCost:
    """Money of the attempts made on one UTC day by one tenant (``None``: no tenant).

    ``cost`` is what the budget was charged (posted debits), ``held`` what is still reserved.
    """

    day: float  # the day's midnight, UTC
    tenant: str | None
    attempts: int
    cost: Decimal
    held: Decimal = Decimal(0)


@dataclass(frozen=True)
class Histogram:
    """Observations counted into buckets, as Prometheus histograms count them.

    ``counts`` holds, per bound of ``bounds``, how many are at most that bound (cumulative);
    ``count`` how many there are in all, ``sum`` their sum.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """Totals for the Prometheus endpoint: counters over the whole history, gauges now.

    The counters and histograms of attempts (``attempts``, ``latency``, ``first_token``,
    ``first_byte``, ``tokens``, ``cost``) count only attempts settled for good: every state
    but ``dispatching`` and ``unknown``, which may still change and are the gauges
    ``in_flight`` and ``unknown`` instead. An attempt enters the counters once, under the
    state it keeps, so none of them ever goes down (Prometheus reads a decrease as a reset).
    Histograms count seconds into :data:`~ledger.domain.records.DURATION_BUCKETS` (the
    OpenTelemetry GenAI conventions' advised boundaries).
    """

    now: float
    attempts: dict[tuple[str, str], int]  # (route, settled outcome) -> attempts
    failovers: int  # the selector's moves to another route (``move`` events)
    cooldowns: dict[str, int]  # route / profile / group -> cooling or disabled now
    posted: dict[str | None, Decimal]  # tenant -> posted cost of its runs
    reserved: dict[str | None, Decimal]  # tenant -> holds still outstanding
    runs: dict[str | None, int]  # tenant -> runs admitted
    # (from route, to route, cause category) -> moves; their sum is ``failovers``.
    failovers_by: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # (route, outcome) -> the Attempts' latency, time to first token, time to first byte.
    latency: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    first_token: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    first_byte: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    # (route, token type: input, output, cache_read, reasoning) -> tokens reported.
    tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    cost: dict[str, Decimal] = field(default_factory=dict)  # route -> charged (posted)
    # (group, outcome: admitted, rejected, timed_out, redecided) -> waits in a full group's
    # queue.
    queue_waits: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)  # group -> places in its queue now
    # route -> its attempts dispatching now, and unknown now; every route the history holds
    # has both (0 when none), so an alert on them sees 0 rather than no data.
    in_flight: dict[str, int] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)


# -- conversions ----------------------------------------------------------------------------


def _run(row: Mapping[str, Any]) -> RunSummary:
    left = budget_left(SimpleNamespace(**row))
    return RunSummary(
        max_calls=int(row["max_calls"]), max_retries=int(row["max_retries"]),
        max_tokens=row["max_tokens"], tokens_reserved=int(row["tokens_reserved"]),
        carved=from_micros(row["carved_micros"]), carved_calls=int(row["carved_calls"]),
        carved_retries=int(row["carved_retries"]), carved_tokens=int(row["carved_tokens"]),
        returned=from_micros(row["returned_micros"]),
        returned_calls=int(row["returned_calls"]),
        returned_retries=int(row["returned_retries"]),
        returned_tokens=int(row["returned_tokens"]), cost_left=from_micros(left.micros),
        calls_left=left.calls, retries_left=left.retries, tokens_left=left.tokens,
        run_id=row["run_id"], parent_run_id=row["parent_run_id"], role=row["role"],
        tenant=row["tenant"], labels=json.loads(row["labels"] or "{}"),
        status=RunStatus(row["status"]),
        selected_route=row["selected_route"], current_route=row["current_route"],
        current_profile=row["current_profile"], calls_used=int(row["calls_used"]),
        retries_used=int(row["retries_used"]), reserved=from_micros(row["reserved_micros"]),
        posted=from_micros(row["posted_micros"]), max_cost=from_micros(row["max_cost_micros"]),
        tokens_used=int(row["tokens_used"]), lease_holder=row["lease_holder"],
        lease_expires_at=row["lease_expires_at"], created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def _skipped(data: Mapping[str, Any]) -> list[Skipped]:
    return [Skipped(route=str(x.get("route")), reason=str(x.get("reason")),
                    detail=x.get("detail"))
            for x in data.get("skipped") or [] if isinstance(x, Mapping)]


def _selection(data: Mapping[str, Any]) -> Selection:
    # The retry owner records the attempt's kind as "attempt_kind" beside the selector's own
    # decision (its "kind": route / probe); hosts and generated history write "decision".
    return Selection(decision=data.get("decision") or data.get("attempt_kind"),
                     route=data.get("route"),
                     from_route=data.get("from_route"), profile=data.get("profile"),
                     reason=data.get("reason"), skipped=_skipped(data),
                     cause=data.get("cause"))


def _action(row: Mapping[str, Any]) -> OperatorAction:
    data = json.loads(row["data"])
    kind = row["kind"]
    # The receipt's why is its note; a close before `by` was recorded names its executor.
    why = data.get("note") if kind == "late_receipt" else data.get("reason")
    who = data.get("by") or data.get("executor")
    return OperatorAction(event_id=int(row["event_id"]), kind=kind, by=who, reason=why,
                          run_id=row["run_id"], attempt_id=row["attempt_id"],
                          key=data.get("key") if kind == "clear_cooldown" else None,
                          at=row["created_at"], data=data)


def _stop(ev: AuditEvent) -> Stop:
    d = ev.data
    return Stop(reason=str(d.get("reason") or "unknown"), detail=d.get("detail") or None,
                skipped=_skipped(d), attempts=[str(a) for a in d.get("attempts") or []],
                errors=[str(e) for e in d.get("errors") or []], at=ev.created_at,
                candidates=[str(c) for c in d.get("candidates") or []])


def _wait(ev: AuditEvent) -> Wait:
    d = ev.data
    what = "capacity" if ev.kind == "capacity_wait" else str(d.get("for") or "wait")
    return Wait(kind=what, group=d.get("group"), route=d.get("route"),
                waited_s=float(d.get("waited_s") or 0.0),
                outcome=str(d.get("outcome") or "admitted"), attempt_id=ev.attempt_id,
                at=ev.created_at)


def _key_health(row: Mapping[str, Any], now: float) -> KeyHealth:
    if row["disabled_until"] is not None and row["disabled_until"] > now:
        status = "disabled"
    elif row["cooldown_until"] is not None and row["cooldown_until"] > now:
        status = "cooling"
    else:
        status = "ok"
    # Counters past their reset time read as reset (ledger.decide.health.as_read).
    reset = row.get("reset_at") is not None and now >= row["reset_at"]
    return KeyHealth(
        key=row["key"], kind=row["kind"], provider=row["provider"], status=status,
        cooldown_until=row["cooldown_until"], disabled_until=row["disabled_until"],
        disabled_reason=row["disabled_reason"],
        error_count=0 if reset else int(row["error_count"]),
        failure_counts={} if reset else json.loads(row["failure_counts"] or "{}"),
        last_failure_at=row["last_failure_at"], last_used=row["last_used"],
        last_probe_at=row["last_probe_at"],
        recent_failures=0 if reset else len(json.loads(row.get("recent_failures") or "[]")),
        # A reset clears it with the counters (ledger.decide.health.as_read): the next write
        # would find no outage counted.
        counted_at=None if reset else row.get("counted_at"),
    )


def _fact_message(raw: Any) -> str | None:
    if not raw:
        return None
    try:
        message = json.loads(raw).get("message")
    except (ValueError, AttributeError):
        return None
    return message if isinstance(message, str) else None


def _unusable(row: Mapping[str, Any]) -> UnusableRoute:
    return UnusableRoute(
        route=row["route_id"], profile=row["profile_id"], provider=row["provider"],
        group=row["group_id"], skips=int(row["skips"]), first_at=row["first_at"],
        last_at=row["last_at"], last_attempt=row["attempt_id"], last_run=row["run_id"],
        why=_fact_message(row["fact"]))


def _skip_causes(selected: str, selects: Sequence[tuple[str | None, Mapping[str, Any]]]
                 ) -> list[FailoverCause]:
    """The selector's skips of ``selected`` (the first per Attempt), as failover causes."""
    out: list[FailoverCause] = []
    for attempt_id, data in selects:
        skip = next((x for x in data.get("skipped") or []
                     if isinstance(x, Mapping) and x.get("route") == selected), None)
        if skip is not None and attempt_id is not None:
            out.append(FailoverCause(attempt_id, selected, "skipped",
                                     str(skip.get("reason") or "skipped"), None,
                                     skip.get("detail") or None))
    return out[:1]


def _group_health(row: Mapping[str, Any], now: float) -> GroupHealth:
    mode = row["mode"]
    if mode != "open" and row["until"] is not None and row["until"] <= now:
        mode = "open"  # the waiting floor has passed (the same projection admission uses)
    return GroupHealth(group=row["group_id"], mode=mode, stored_mode=row["mode"],
                       until=row["until"], reason=row["reason"], sampled_at=row["sampled_at"],
                       in_flight=int(row["in_flight"]), limit=row["max_in_flight"],
                       waiting=int(row.get("waiting") or 0))


def _histogram(row: Mapping[str, Any], name: str) -> Histogram | None:
    """The histogram of ``name`` in a metrics row (``None`` when it counted nothing)."""
    n = int(row[f"{name}_n"] or 0)
    if not n:
        return None
    return Histogram(bounds=DURATION_BUCKETS,
                     counts=tuple(int(row[f"{name}_le{i}"] or 0)
                                  for i in range(len(DURATION_BUCKETS))),
                     count=n, sum=float(row[f"{name}_sum"] or 0.0))


def to_jsonable(value: Any) -> Any:
    """A result (dataclasses, pages, decimals, facts) as plain JSON values; money as strings."""
    if isinstance(value, Page):
        return {"items": [to_jsonable(x) for x in value.items],
                "next_cursor": value.next_cursor}
    if hasattr(value, "__dataclass_fields__"):
        return {k: to_jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, FailureFact):
        return value.to_json()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(x) for x in value]
    return value


# -- argument checks (the same for every query; nothing reaches SQL unchecked) ------------------


def _window(start: float | None, end: float | None) -> None:
    if start is not None and end is not None and end < start:
        raise InvalidArgument("until is before since; pass since <= until", field="until")


def _span(start: float, end: float) -> None:
    if end <= start:
        raise InvalidArgument("until must be after since; pass since < until", field="until")


@rule
def _totals_key(value: Any) -> str:
    if not isinstance(value, str) or value not in TOTALS_KEYS:
        raise Problem("cannot total by this key", f"pass by= one of {', '.join(TOTALS_KEYS)}")
    return value


@rule
def _spend_key(value: Any) -> str:
    if value not in ("tenant", "label"):
        raise Problem("cannot total spend by this key", "pass by='tenant' or by='label' (with "
                      "label=)")
    return str(value)


@rule
def _action_kind(value: Any) -> str:
    if value not in ACTION_KINDS:
        raise Problem("is not an operator's action", f"pass some of {list(ACTION_KINDS)}")
    return str(value)


ActionKinds = Annotated[Sequence[str], listing(_action_kind, "kinds",
                                               f"pass a list among {list(ACTION_KINDS)}, e.g. "
                                               "['close']")]
_OPENED = [AttemptState(v) for v in OPEN_STATES]
Buckets = Annotated[int, integers(1, 1000, "pass an integer from 1 to 1000, e.g. 24")]
Status = Annotated[RunStatus | str, one_of(RunStatus)]
OpenStates = Annotated[Sequence[str], listing(one_of(AttemptState, _OPENED), "states",
                                              f"pass a list among {list(OPEN_STATES)}, e.g. "
                                              "['unknown']")]


# -- the API --------------------------------------------------------------------------------


class Audit:
    """Read-only audit queries over one ledger; see the module docstring.

    Every listing is newest first and paginated: pass a page's ``next_cursor`` back as
    ``cursor``. Times are epoch seconds and ranges are ``[since, until)``. A ledger opened with
    ``read_url=`` is read on that replica (its writes and its own reads stay on the primary).
    Every method checks its arguments first (:class:`~ledger.errors.InvalidArgument` naming
    the field) and may raise :class:`~ledger.errors.StorageError` / ``DatabaseUnavailable``
    from the database.

    Args:
        ledger: The :class:`~ledger.Ledger` to read (for an :class:`~ledger.AsyncLedger`,
            its ``.sync``; then wrap the audit in :class:`AsyncAudit`).

    Raises:
        InvalidArgument: ``ledger`` is not a Ledger.

    Example:
        >>> audit = Audit(Ledger.open(url, migrate_schema=False))  # doctest: +SKIP
        >>> story = audit.timeline("task-42")  # doctest: +SKIP
        >>> story.served_route, [a.state for a in story.attempts]  # doctest: +SKIP
    """

    awaiting = False

    @checked
    def __init__(self, ledger: Annotated[Ledger, instance(
            Ledger, "a ledger.Ledger", "pass a ledger.Ledger (an AsyncLedger's is .sync)")]
                 ) -> None:
        self.ledger = ledger
        # The port's read-only queries; nothing here writes. On the ledger's read replica
        # when it has one (read_url=).
        ctx = reads_of(ledger).context
        self._audit = AuditQueries(ctx)
        self._series = SeriesQueries(ctx)
        self._runs = RunQueries(ctx)

    def now(self) -> float:
        """The ledger clock's time, in epoch seconds."""
        return self.ledger.now()

    @query
    def runs(self, *, status: Status | None = None, tenant: Id | None = None,
             since: Time | None = None, until: Time | None = None, limit: Limit = 50,
             cursor: Cursor | None = None) -> Page[RunSummary]:
        """Runs newest first, optionally filtered.

        Args:
            status: Only Runs in this status (a :class:`~ledger.RunStatus` or its value).
            tenant: Only this tenant's Runs.
            since: Admitted at or after this time.
            until: Admitted before this time.
            limit: Page size, 1 to 10 000.
            cursor: A page's ``next_cursor``.

        Returns:
            A :class:`~ledger.Page` of :class:`RunSummary`.

        Raises:
            InvalidArgument: an unknown status, a malformed tenant or cursor, ``until`` before
                ``since``, a limit out of range.
        """
        _window(since, until)
        rows, nxt = self._audit.runs(status=None if status is None else RunStatus(status).value,
                                     tenant=tenant, since=since, until=until, limit=limit,
                                     cursor=cursor)
        return Page([_run(r) for r in rows], nxt)

    @query
    def timeline(self, run_id: Id) -> RunTimeline:
        """A run's attempts in order, with debit, outcome, fact, cost and the selector's reasons.

        Args:
            run_id: The Run.

        Returns:
            Its :class:`RunTimeline`.

        Raises:
            NotFound: no Run has this id.
        """
        run_row, att_rows, ev_rows = self._audit.timeline(run_id)
        if run_row is None:
            raise NotFound(f"unknown run id {run_id!r}; list runs with `failover-ledger runs`",
                           run_id=run_id)
        events = [AuditEvent(int(e["event_id"]), e["kind"], e["attempt_id"],
                             json.loads(e["data"]), e["created_at"]) for e in ev_rows]
        by_attempt: dict[str, list[AuditEvent]] = {}
        run_events: list[AuditEvent] = []
        for ev in events:
            if ev.attempt_id is None:
                run_events.append(ev)
            else:
                by_attempt.setdefault(ev.attempt_id, []).append(ev)
        entries: list[TimelineEntry] = []
        served: str | None = None
        for a in att_rows:
            evs = by_attempt.get(a["attempt_id"], [])
            sel = next((_selection(e.data) for e in evs if e.kind == "select"), None)
            cost = from_micros(a["cost_micros"]) if a["cost_micros"] is not None else None
            if a["state"] == "succeeded":
                served = a["route_id"]
            entries.append(TimelineEntry(
                seq=a["seq"], attempt_id=a["attempt_id"], turn_id=a["turn_id"], kind=a["kind"],
                route_id=a["route_id"], provider=a["provider"], model=a["model"],
                group_id=a["group_id"], profile_id=a["profile_id"], state=a["state"],
                debit_id=a["debit_id"], debit_state=a["debit_state"],
                reserved=from_micros(a["reserved_micros"]),
                posted=from_micros(a["debit_posted_micros"]), cost=cost,
                prompt_tokens=a["prompt_tokens"], completion_tokens=a["completion_tokens"],
                category=a["category"], http_status=a["http_status"],
                fact=FailureFact.model_validate_json(a["fact"]) if a["fact"] else None,
                reject_reason=a["reject_reason"], created_at=a["created_at"],
                settled_at=a["settled_at"], selection=sel,
                events=[e for e in evs if e.kind != "select"],
                latency_s=a["latency_s"], first_byte_s=a["first_byte_s"],
                first_token_s=a["first_token_s"], cached_tokens=a["cached_tokens"],
                reasoning_tokens=a["reasoning_tokens"],
            ))
        run = _run(run_row)
        # The Run's own mark (set by the write that made it one, at any of its turns, kept
        # through retention; migration 0012 set it for the Runs before it), which the failover
        # page and count read too.
        failed_over = bool(run_row["failed_over"])
        stops = [_stop(e) for e in events if e.kind == "stop"]
        waits = [_wait(e) for e in events if e.kind in ("capacity_wait", "wait")]
        # The money is the Run's own counters (what its debits moved, reconcile checks them):
        # retention drops old attempts but never the Run, so a sum of the attempts left
        # would make an old Run look free.
        return RunTimeline(run=run, attempts=entries, run_events=run_events,
                           served_route=served, failed_over=failed_over,
                           total_cost=run.posted, stops=stops, waits=waits, held=run.reserved,
                           children=[_run(c) for c in self._audit.children(run_id)])

    @query
    def failovers(self, *, since: Time | None = None, until: Time | None = None,
                  limit: Limit = 50, cursor: Cursor | None = None) -> Page[Failover]:
        """Runs admitted in [since, until) that failed over, newest first, with their causes.

        Args:
            since: Admitted at or after this time.
            until: Admitted before this time.
            limit: Page size, 1 to 10 000.
            cursor: A page's ``next_cursor``.

        Returns:
            A :class:`~ledger.Page` of :class:`Failover`.
        """
        _window(since, until)
        runs, atts, moves, nxt = self._audit.failovers(since=since, until=until, limit=limit,
                                                       cursor=cursor)
        atts_by: dict[str, list[Mapping[str, Any]]] = {}
        for a in atts:
            atts_by.setdefault(a["run_id"], []).append(a)
        moves_by: dict[str, list[Move]] = {}
        selects_by: dict[str, list[tuple[str | None, Mapping[str, Any]]]] = {}
        for m in moves:
            data = json.loads(m["data"])
            if m["kind"] == "select":
                selects_by.setdefault(m["run_id"], []).append((m["attempt_id"], data))
                continue
            cause = data.get("cause") if isinstance(data.get("cause"), Mapping) else {}
            moves_by.setdefault(m["run_id"], []).append(Move(
                from_route=data.get("from_route"), to_route=data.get("to_route"),
                category=cause.get("category"), status=cause.get("status"),
                at=m["created_at"]))
        out: list[Failover] = []
        for r in runs:
            ra = atts_by.get(r["run_id"], [])
            served = next((a["route_id"] for a in reversed(ra) if a["state"] == "succeeded"),
                          None)
            routes: list[str] = []
            for a in ra:
                if a["route_id"] not in routes:
                    routes.append(a["route_id"])
            causes = [FailoverCause(a["attempt_id"], a["route_id"], a["state"], a["category"],
                                    a["http_status"],
                                    _fact_message(a["fact"]) if a["category"] == "unusable"
                                    else None)
                      for a in ra if a["state"] in CAUSE_STATES and (
                          a["state"] != "not_sent" or a["category"] not in (None, "cancelled"))]
            if not causes:
                # Served elsewhere without a failure: the selector passed over the selected
                # route (cooling, disabled, unusable) before its first Attempt, so no retry
                # permission was taken; the skip is the cause.
                causes = _skip_causes(r["selected_route"], selects_by.get(r["run_id"], []))
            out.append(Failover(
                run_id=r["run_id"], tenant=r["tenant"], labels=json.loads(r["labels"] or "{}"),
                status=RunStatus(r["status"]), created_at=r["created_at"],
                selected_route=r["selected_route"], served_route=served, routes=routes,
                causes=causes, moves=moves_by.get(r["run_id"], []),
            ))
        return Page(out, nxt)

    @query
    def attempts(self, **filters: Unpack[AttemptFilters]) -> Page[AttemptRecord]:
        """Attempts newest first, filtered as :meth:`ledger.Ledger.attempts` filters them.

        Args:
            **filters: Any of ``route`` and ``group`` (ids), ``state`` (an
                :class:`~ledger.AttemptState`), ``category`` (a :class:`~ledger.Category`),
                ``since`` and ``until`` (begun at or after, and before), ``limit`` (1 to
                10 000, default 100) and ``cursor`` (a page's ``next_cursor``).

        Returns:
            A :class:`~ledger.Page` of :class:`~ledger.AttemptRecord`.
        """
        return self._runs.attempts(**attempt_query(filters))

    @query
    def costs(self, *, by: Annotated[str, _totals_key] = "route", since: Time | None = None,
              until: Time | None = None, label: Id | None = None, limit: Limit = 100,
              cursor: Cursor | None = None) -> Page[Totals]:
        """Money and token totals of attempts made in [since, until), costliest first.

        Each :class:`Totals` says what the budget was charged (``cost``: posted debits) and
        what is still held (``held``: reserved debits of unknown or in-flight attempts), the
        same money the runs' ``posted`` and ``reserved`` counters count.

        Args:
            by: What to total by: ``route``, ``group``, ``provider``, ``run``, ``tenant`` or
                ``label`` (with ``label=``). By ``provider`` the routes' names are matched
                case-insensitively, as the provider's health key matches them: ``OpenAI``
                and ``openai`` are one group keyed ``openai``, the name case-folded
                (``str.casefold``, the same on both backends).
            since: Attempts begun at or after this time.
            until: Attempts begun before this time.
            label: The Run label to total by, with ``by="label"`` (e.g. ``"team"``).
            limit: Page size, 1 to 10 000.
            cursor: A page's ``next_cursor``.

        Returns:
            A :class:`~ledger.Page` of :class:`Totals`.

        Raises:
            InvalidArgument: an unknown ``by``, a malformed ``label``, a bad range or page.

        Example:
            >>> for t in audit.costs(by="label", label="team").items:  # doctest: +SKIP
            ...     print(t.key, t.cost, t.attempts)
        """
        _window(since, until)
        rows, nxt = self._audit.totals(by=by, since=since, until=until, label=label,
                                       limit=limit, cursor=cursor)
        return Page([Totals(key=r["key"], attempts=int(r["attempts"]),
                            succeeded=int(r["succeeded"]), failed=int(r["failed"]),
                            unknown=int(r["unknown"]), prompt_tokens=int(r["prompt_tokens"]),
                            completion_tokens=int(r["completion_tokens"]),
                            cost=from_micros(int(r["cost_micros"])),
                            held=from_micros(int(r["held_micros"])))
                     for r in rows], nxt)

    @query
    def spend(self, *, by: Annotated[str, _spend_key] = "tenant", label: Id | None = None,
              since: Time | None = None, until: Time | None = None,
              every: Annotated[float, duration(positive=True)] | None = None,
              limit: Limit = 100, cursor: Cursor | None = None) -> Page[Spend]:
        """Spend against budgets per tenant or label: the Runs admitted in [since, until).

        For each key, the sum of the budgets its Runs were admitted with, what they posted
        (charged) and what they hold now, and what is left (:class:`Spend`); most posted
        first, Runs without the key as ``None``. Money is exact (integer micro-units summed in
        the database). A Run counts where it was admitted, so no bucket's posted and held
        exceed its budget.

        Args:
            by: ``tenant`` or ``label`` (with ``label=``).
            since: Runs admitted at or after this time (required with ``every``).
            until: Runs admitted before this time (default with ``every``: now).
            label: The Run label to group by, with ``by="label"`` (e.g. ``"team"``).
            every: Also split each key over time, in buckets this many seconds wide (at least
                60), aligned to multiples of it since the epoch (``86400``: UTC days); the first
                and last may be partial; at most 1000 buckets.
            limit: Keys per page, 1 to 10 000.
            cursor: A page's ``next_cursor``.

        Returns:
            A :class:`~ledger.Page` of :class:`Spend`.

        Raises:
            InvalidArgument: ``by`` not ``tenant`` or ``label``, a malformed ``label``, a bad
                range, ``every`` without ``since``, below 60 s or over 1000 buckets.

        Example:
            >>> for s in audit.spend(by="tenant", since=t0, every=86400).items:  # doctest: +SKIP
            ...     print(s.key, s.budget, s.posted, s.held, s.left)
        """
        if by == "label" and label is None:
            raise InvalidArgument("spend by label needs the label key; pass label='team'",
                                  field="label")
        _window(since, until)
        bucket: tuple[float, float] | None = None
        starts: list[float] = []
        if every is not None:
            width = every
            if width < 60:
                raise InvalidArgument(f"every={width:g} s is too fine; pass at least 60 "
                                      "(86400: UTC days)", field="every")
            if since is None:
                raise InvalidArgument("every= needs since=: the window to split",
                                      field="since")
            end = self.now() if until is None else until
            if end <= since:
                raise InvalidArgument("until must be after since to split the window; pass "
                                      "since < until", field="until")
            origin = since - since % width
            n = math.ceil((end - origin) / width)
            if n > 1000:
                raise InvalidArgument(f"every={width:g} s splits the window into {n} buckets; "
                                      "pass a wider every or a shorter window (at most 1000)",
                                      field="every")
            bucket = (origin, width)
            starts = [origin + i * width for i in range(n)]
            until = end
        rows, prows, nxt = self._audit.spend(by=by, label=label, since=since, until=until,
                                             bucket=bucket, limit=limit, cursor=cursor)
        by_key: dict[str | None, dict[int, Mapping[str, Any]]] = {}
        for prow in prows:
            by_key.setdefault(prow["key"], {})[int(prow["bucket"])] = prow
        out = []
        for r in rows:
            budget, posted, held = (int(r["budget_micros"]), int(r["posted_micros"]),
                                    int(r["held_micros"]))
            got = by_key.get(r["key"], {})
            points = []
            for i, start in enumerate(starts):
                p: Mapping[str, Any] | None = got.get(i)
                points.append(SpendPoint(
                    start=start, runs=int(p["runs"]) if p else 0,
                    budget=from_micros(int(p["budget_micros"]) if p else 0),
                    posted=from_micros(int(p["posted_micros"]) if p else 0),
                    held=from_micros(int(p["held_micros"]) if p else 0)))
            out.append(Spend(key=r["key"], runs=int(r["runs"]), budget=from_micros(budget),
                             posted=from_micros(posted), held=from_micros(held),
                             left=from_micros(budget - posted - held), points=points))
        return Page(out, nxt)

    @query
    def actions(self, *, since: Time | None = None, until: Time | None = None,
                kinds: ActionKinds = ACTION_KINDS, limit: Limit = 50,
                cursor: Cursor | None = None) -> Page[OperatorAction]:
        """Operators' actions newest first, each with who and why.

        Cooldowns cleared (:meth:`ledger.Ledger.clear_cooldown`), Runs closed
        (:meth:`ledger.Ledger.close_run`, and recovery past a deadline), unknown Attempts
        settled with evidence (:meth:`ledger.Ledger.settle_unknown`) and history dropped by
        retention (:meth:`ledger.Ledger.drop_history`).

        Args:
            since: Recorded at or after this time.
            until: Recorded before this time.
            kinds: Which of ``clear_cooldown``, ``close``, ``late_receipt`` and ``retention``
                (default all).
            limit: Page size, 1 to 10 000.
            cursor: A page's ``next_cursor``.

        Returns:
            A :class:`~ledger.Page` of :class:`OperatorAction`.

        Raises:
            InvalidArgument: ``kinds`` empty or naming another kind; a bad range or page.
        """
        wanted = list(kinds)
        if not wanted:
            raise InvalidArgument(f"kinds is empty; pass some of {list(ACTION_KINDS)}",
                                  field="kinds")
        _window(since, until)
        rows, nxt = self._audit.actions(kinds=wanted, since=since, until=until, limit=limit,
                                        cursor=cursor)
        return Page([_action(r) for r in rows], nxt)

    @query
    def open_attempts(self, *, states: OpenStates = OPEN_STATES, since: Time | None = None,
                      until: Time | None = None, limit: Limit = 100,
                      cursor: Cursor | None = None) -> Page[OpenAttempt]:
        """Unknown and unsettled (dispatching) attempts, newest first.

        Each says whether its executor still holds the Run (``lease_live``): one that does not
        is recovery's to look at.

        Args:
            states: Which of ``unknown`` and ``dispatching`` to list (default both).
            since: Begun at or after this time.
            until: Begun before this time.
            limit: Page size, 1 to 10 000.
            cursor: A page's ``next_cursor``.

        Returns:
            A :class:`~ledger.Page` of :class:`OpenAttempt`.

        Raises:
            InvalidArgument: ``states`` empty, or naming another state.
        """
        if not states:
            raise InvalidArgument(f"states is empty; pass some of {list(OPEN_STATES)}",
                                  field="states")
        _window(since, until)
        rows, nxt = self._audit.open_attempts(states=[AttemptState(v).value for v in states],
                                              since=since, until=until, limit=limit,
                                              cursor=cursor)
        now = self.now()
        out = []
        for r in rows:
            live = r["held_until"] is not None and r["held_until"] > now
            out.append(OpenAttempt(attempt_record(SimpleNamespace(**r), r["debit_state"]),
                                   r["lease_holder"], r["lease_expires_at"], live))
        return Page(out, nxt)

    @query
    def health(self, now: Time | None = None, *,
               unusable_window_s: Annotated[float, duration(30 * 86400.0, positive=True)]
               = UNUSABLE_WINDOW_S,
               latency_window_s: Annotated[float, duration(366 * 86400.0, positive=True)]
               | None = LATENCY_WINDOW_S) -> HealthReport:
        """Routes, profiles and groups now: cooldowns, disables, waiting floors, last probes.

        Also the routes skipped as unusable (a missing key, an unusable endpoint) in the last
        ``unusable_window_s`` and not served since: a configuration problem, so no cooldown
        shows it, yet every turn that reaches such a route skips it. And the latency
        percentiles of every route's and group's Attempts begun in the last
        ``latency_window_s`` (:meth:`latency`, unfiltered).

        Args:
            now: The time to read them at (default: the ledger clock's now).
            unusable_window_s: How far back unusable skips are looked for (default one day;
                above 0, at most 30 days).
            latency_window_s: How far back the latency percentiles look (default one day;
                above 0, at most 366 days); ``None`` leaves them out (``latency`` is then
                ``None``).
        """
        t, window = self.now() if now is None else now, unusable_window_s
        hrows, grows = self._audit.health(t)
        keys = [_key_health(h, t) for h in hrows]
        return HealthReport(now=t, routes=[k for k in keys if k.kind != "profile"],
                            profiles=[k for k in keys if k.kind == "profile"],
                            groups=[_group_health(g, t) for g in grows],
                            unusable=[_unusable(u) for u in self._audit.unusable(t - window)
                                      if u["last_at"] <= t],
                            latency=None if latency_window_s is None
                            else self._latency(since=t - latency_window_s, until=t))

    @query
    def latency(self, *, since: Time | None = None, until: Time | None = None,
                route: Id | None = None, group: Id | None = None,
                category: Annotated[Category | str, one_of(Category)] | None = None,
                tenant: Id | None = None,
                state: Annotated[AttemptState | str, one_of(AttemptState)] | None = None,
                ) -> LatencyReport:
        """p50, p95 and p99 of the Attempts' times, per route and per capacity group.

        The latency from begin to settle, the time to a stream's first token and to the
        response's first byte, all by the ledger's clock, of the Attempts begun in
        [since, until) that match the filters. Computed by the database (the same answers on
        SQLite and PostgreSQL).

        Args:
            since: Begun at or after this time (default: from the first).
            until: Begun before this time (default: up to now).
            route: Only this route's Attempts.
            group: Only this capacity group's.
            category: Only failures of this :class:`~ledger.Category` (``timeout``, ...).
            tenant: Only the Attempts of this tenant's Runs.
            state: Only Attempts in this outcome (an :class:`~ledger.AttemptState`:
                ``succeeded`` for the latency of answers; default: every outcome).

        Returns:
            A :class:`LatencyReport`: a :class:`LatencyStats` per route and per group with
            Attempts that have a latency, each busiest first.

        Raises:
            InvalidArgument: a malformed filter, an unknown category or state, ``until``
                before ``since``.

        Example:
            >>> rep = audit.latency(since=now - 3600, state="succeeded")  # doctest: +SKIP
            >>> [(r.key, r.latency.p95) for r in rep.routes]  # doctest: +SKIP
        """
        _window(since, until)
        return self._latency(
            since=since, until=until, route=route, group=group, tenant=tenant,
            category=None if category is None else Category(category).value,
            state=None if state is None else AttemptState(state).value)

    def _latency(self, *, since: float | None, until: float | None, route: str | None = None,
                 group: str | None = None, category: str | None = None,
                 tenant: str | None = None, state: str | None = None) -> LatencyReport:
        """:meth:`latency` with its arguments checked (what :meth:`health` asks too)."""
        rows = self._audit.latency(route=route, group=group, category=category, tenant=tenant,
                                   state=state, since=since, until=until)

        def stats(by: str) -> list[LatencyStats]:
            found: dict[str, dict[str, Percentiles]] = {}
            for measure in (*LATENCY_MEASURES, SUCCEEDED_LATENCY):
                for r in rows[(by, measure)]:
                    if int(r["n"]):
                        found.setdefault(str(r["key"]), {})[measure] = Percentiles(
                            count=int(r["n"]), p50=float(r["p0"]), p95=float(r["p1"]),
                            p99=float(r["p2"]))
            out = [LatencyStats(key=k, latency=m.get("latency_s"),
                                first_token=m.get("first_token_s"),
                                first_byte=m.get("first_byte_s"),
                                succeeded_latency=m.get(SUCCEEDED_LATENCY))
                   for k, m in found.items() if "latency_s" in m]
            return sorted(out, key=lambda x: (-(x.latency.count if x.latency else 0), x.key))

        return LatencyReport(since=since, until=until, routes=stats("route"),
                             groups=stats("group"), route=route, group=group,
                             category=category, tenant=tenant, state=state)

    @query
    def count_failovers(self, *, since: Time | None = None, until: Time | None = None) -> int:
        """How many Runs admitted in [since, until) failed over (as :meth:`failovers` lists).

        Args:
            since: Admitted at or after this time.
            until: Admitted before this time.
        """
        _window(since, until)
        return self._audit.count_failovers(since=since, until=until)

    @query
    def activity(self, *, since: Time, until: Time, buckets: Buckets = 24
                 ) -> list[ActivityBucket]:
        """Attempts, failures and unknowns in ``buckets`` equal slices of [since, until).

        When ``since`` starts an hour and each slice is a whole number of hours, the attempts
        not in flight of hours already rolled up (:meth:`ledger.Ledger.roll_up`) are counted
        from their roll-ups, and the answer is the same (the dashboard's chart asks that way).

        Args:
            since: The range's start (required).
            until: Its end, after ``since``.
            buckets: How many slices, 1 to 1000.

        Returns:
            One :class:`ActivityBucket` per slice, in time order (empty slices included).
        """
        _span(since, until)
        width = (until - since) / buckets
        rows = {int(r["bucket"]): r for r in self._audit.activity(since=since, until=until,
                                                         bucket_s=width)}
        out = []
        for i in range(buckets):
            r = rows.get(i)
            out.append(ActivityBucket(start=since + i * width,
                                      attempts=int(r["attempts"]) if r else 0,
                                      failed=int(r["failed"] or 0) if r else 0,
                                      unknown=int(r["unknown"] or 0) if r else 0))
        return out


    @query
    def route_series(self, *, since: Time, until: Time, buckets: Buckets = 24,
                     routes: Annotated[int, integers(1, 1000, "pass an integer from 1 to 1000, "
                                                     "e.g. 8")] = 8) -> list[RouteSeries]:
        """Success rate and latency per route in ``buckets`` equal slices of [since, until).

        When ``since`` starts an hour and each slice is a whole number of hours, the settled
        attempts of hours already rolled up (:meth:`ledger.Ledger.roll_up`) are counted from
        their roll-ups, as :meth:`activity` counts them (the dashboard asks that way); a
        slice's mean latency may then differ in a float's last bits.

        Args:
            since: The range's start.
            until: Its end, after ``since``.
            buckets: How many slices, 1 to 1000.
            routes: How many of the range's busiest routes, 1 to 1000.

        Returns:
            One :class:`RouteSeries` per route, busiest first.
        """
        _span(since, until)
        width = (until - since) / buckets
        by_route: dict[str, dict[int, Mapping[str, Any]]] = {}
        for row in self._series.route_series(since=since, until=until, bucket_s=width):
            by_route.setdefault(row["route"], {})[int(row["bucket"])] = row
        busiest = sorted(by_route, key=lambda k: (-sum(int(x["attempts"])
                                                       for x in by_route[k].values()), k))
        out = []
        for route in busiest[:routes]:
            rows = by_route[route]
            points = []
            for i in range(buckets):
                r: Mapping[str, Any] | None = rows.get(i)
                ok, bad, unk = ((int(r["succeeded"] or 0), int(r["failed"] or 0),
                                 int(r["unknown"] or 0)) if r else (0, 0, 0))
                sent = ok + bad + unk
                points.append(RoutePoint(
                    start=since + i * width, attempts=int(r["attempts"]) if r else 0,
                    succeeded=ok, failed=bad, unknown=unk,
                    success_rate=ok / sent if sent else None,
                    latency_s=(float(r["latency_sum"]) / int(r["latency_n"])
                               if r and r["latency_n"] else None)))
            out.append(RouteSeries(route=route, attempts=sum(p.attempts for p in points),
                                   points=points))
        return out

    @query
    def costs_by_day(self, *, days: Annotated[int, integers(1, 366, "pass an integer from 1 to "
                                                            "366, e.g. 7")] = 7,
                     now: Time | None = None) -> list[DayCost]:
        """Cost per UTC day and tenant for the last ``days`` days (today included).

        Oldest first, no tenant before the named ones; days and tenants without attempts are
        absent.

        Args:
            days: How many days, 1 to 366.
            now: What "today" is (default: the ledger clock's now).
        """
        t = self.now() if now is None else now
        today = t - t % 86400.0
        since = today - (days - 1) * 86400.0
        out = [DayCost(day=since + int(r["day"]) * 86400.0, tenant=r["tenant"],
                       attempts=int(r["attempts"]), cost=from_micros(int(r["cost_micros"])),
                       held=from_micros(int(r["held_micros"])))
               for r in self._series.cost_by_day(since=since, until=today + 86400.0)]
        # The same order on every backend (they sort NULL differently): no tenant first.
        return sorted(out, key=lambda d: (d.day, d.tenant is not None, d.tenant or ""))

    @query
    def replay(self, policy: Annotated[Policy | str, instance(
            (Policy, str), "a Policy, a preset name or a policy file's path",
            "pass e.g. 'failure-domain'")], *, since: Time | None = None,
               until: Time | None = None, run: Id | None = None,
               tenant: Id | None = None) -> ReplayReport:
        """What another policy would have done over recorded history, against what was done.

        For every decision recorded in the window (the first route of a turn, each retry,
        each move and each stop of the Runs admitted in [since, until)), the other policy
        decides again on the recorded facts: whether to move on, which route, which stop, which
        candidates it skips and why. Where it differs, the report groups the differences with
        examples; where it picks a route not tried at that moment, it estimates the outcome
        from other Runs' Attempts on that route in the window and says how much rests on such
        estimates; and it totals attempts, cost, latency and stops under both. No provider is
        called and nothing is written (``docs/audit.md``, "Should we change policy?").

        Args:
            policy: The policy to replay: a :class:`~ledger.Policy`, a preset name
                (``goclaw``, ``fased``, ``failure-domain``) or a policy file's path.
            since: Runs admitted at or after this time (default: a day before ``until``; with
                ``run``, any time).
            until: Runs admitted before this time (default: now; with ``run``, any time, so
                a Run admitted after this reader's clock, another host's running ahead, is
                replayed too).
            run: Only this Run.
            tenant: Only this tenant's Runs.

        Returns:
            The :class:`~ledger.ops.replay.ReplayReport`.

        Raises:
            InvalidArgument: a policy that does not load (``field="policy"``), a bad range.
            NotFound: ``run`` is no Run of the ledger (as :meth:`run` says), rather than an
                empty report that reads "0 decisions, all agree".

        Example:
            >>> rep = audit.replay("failure-domain", since=t0)  # doctest: +SKIP
            >>> [f.text for f in rep.findings][:2]  # doctest: +SKIP
            ['would have stopped (execution_unknown) after 41 read timeout failures', ...]
        """
        # Imported here: replay brings the decision core and the policy loader, which the
        # reporting commands otherwise never need (issue 23: each CLI command under 0.5 s).
        from ledger.ops.replay import replay as replay_window

        return replay_window(self.ledger, policy, since=since, until=until, run=run,
                             tenant=tenant)

    @query
    def metrics(self, now: Time | None = None) -> MetricsSnapshot:
        """Totals for the dashboard's ``/metrics``.

        Attempts settled for good by route and outcome with their latency, time to first
        token and time to first byte as histograms, and their tokens and cost charged per
        route; the attempts dispatching and unknown now per route (gauges: their state will
        change, and a counter of them would go down); failovers by their routes and cause;
        waits in full groups' queues by group and outcome, and the places waiting now (for
        every limited group, 0 when its queue is empty, and every group that ever queued);
        cooldowns active now; and the budget used (posted and held cost) per tenant.

        Args:
            now: The time the gauges are read at (default: the ledger clock's now).
        """
        t = self.now() if now is None else now
        m = self._series.metrics_totals(t, DURATION_BUCKETS)
        # Every kind always has its series (0 when nothing of it cools): an alert on one that
        # appears only while something cools would see no data, not 0.
        cooldowns = {"route": 0, "profile": 0, "provider": 0, "group": 0}
        for r in m["cooling"]:
            cooldowns[str(r["kind"])] = int(r["n"])
        cooldowns["group"] = sum(int(r["n"]) for r in m["groups"])
        hists: dict[str, dict[tuple[str, str], Histogram]] = {
            measure: {} for measure in LATENCY_MEASURES}
        tokens: dict[tuple[str, str], int] = {}
        cost: dict[str, int] = {}
        attempts: dict[tuple[str, str], int] = {}
        in_flight: dict[str, int] = {}
        unknown: dict[str, int] = {}
        for r in m["attempts"]:
            key = (str(r["route"]), str(r["outcome"]))
            in_flight.setdefault(key[0], 0)
            unknown.setdefault(key[0], 0)
            # An attempt dispatching or unknown will change state (its settle, an operator's
            # settle_unknown): counted under this state now, it would leave the counters and
            # histograms then, which Prometheus reads as a reset. It enters them once settled.
            if key[1] == AttemptState.DISPATCHING.value:
                in_flight[key[0]] += int(r["n"])
                continue
            if key[1] == AttemptState.UNKNOWN.value:
                unknown[key[0]] += int(r["n"])
                continue
            attempts[key] = int(r["n"])
            for measure in LATENCY_MEASURES:
                h = _histogram(r, measure)
                if h is not None:
                    hists[measure][key] = h
            for kind in ("input", "output", "cache_read", "reasoning"):
                tokens[(key[0], kind)] = tokens.get((key[0], kind), 0) + int(r[kind])
            cost[key[0]] = cost.get(key[0], 0) + int(r["charged_micros"])
        failovers_by = {(str(r["from_route"]), str(r["to_route"]), str(r["category"] or "")):
                        int(r["n"]) for r in m["moves"]}
        waits = {(str(r["group"]), str(r["outcome"] or "admitted")): h for r in m["waits"]
                 if (h := _histogram(r, "waited_s")) is not None}
        # Every limited group has its series, 0 while nobody waits, from its configuration on
        # (not from its first queued turn), and a group that ever queued keeps it once made
        # unlimited: an alert on the queue's length must see 0, not no data, and an operator
        # must tell a group with an empty queue from one the ledger does not know.
        waiting = {str(r["group"]): 0 for r in m["limited"]}
        waiting.update((group, 0) for group, _ in waits)
        waiting.update((str(r["group"]), int(r["n"])) for r in m["waiting"])
        return MetricsSnapshot(
            now=t,
            attempts=attempts, in_flight=in_flight, unknown=unknown,
            failovers=sum(failovers_by.values()),
            cooldowns=cooldowns,
            posted={r["tenant"]: from_micros(int(r["posted_micros"])) for r in m["money"]},
            reserved={r["tenant"]: from_micros(int(r["reserved_micros"])) for r in m["money"]},
            runs={r["tenant"]: int(r["runs"]) for r in m["money"]},
            failovers_by=failovers_by, latency=hists["latency_s"],
            first_token=hists["first_token_s"], first_byte=hists["first_byte_s"],
            tokens=tokens, cost={k: from_micros(v) for k, v in cost.items()},
            queue_waits=waits, waiting=waiting,
        )


class AsyncAudit(Awaiting, Audit):
    """The async twin of :class:`Audit`: the same methods, awaited on the ledger's threads.

    Each method is :class:`Audit`'s, with its arguments, result, errors and docstring, run on
    the threads of the store it reads (``ledger-cold``, its own; never the event loop's default
    executor, which the host's work needs). Closing the ledger ends them.

    Args:
        audit: The :class:`Audit` to run.
    """

    @checked
    def __init__(self, audit: Annotated[Audit, instance(
            Audit, "a ledger.ops.audit.Audit", "pass Audit(ledger)")]) -> None:
        self.__dict__.update(vars(audit))  # one ledger, one store
        self.sync = audit

    def _workers(self) -> Workers:
        # The store the audit reads: a slow read replica then holds up only its own threads.
        return reads_of(self.ledger).workers


__all__ = [
    "ACTION_KINDS", "ActivityBucket", "AsyncAudit", "Audit", "AuditEvent", "DayCost",
    "Failover", "FailoverCause", "GroupHealth", "HealthReport", "Histogram", "KeyHealth",
    "LatencyReport", "LatencyStats", "MetricsSnapshot", "Move", "OpenAttempt", "OperatorAction",
    "Percentiles", "RoutePoint", "RouteSeries", "RunSummary", "RunTimeline", "Selection",
    "Skipped", "Spend", "SpendPoint", "Stop", "TimelineEntry", "Totals", "UnusableRoute",
    "to_jsonable",
]
