"""Records the ledger returns: what is durably written about Runs, Attempts, Debits and Leases."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from decimal import Decimal
from enum import StrEnum
from types import SimpleNamespace
from typing import Annotated, Any, Generic, TypeVar

from ledger.domain.bounds import MAX_FENCE
from ledger.domain.facts import FailureFact
from ledger.domain.validation import Problem, is_id, rule
from ledger.domain.values import Budget, Grant, Route

MICROS = Decimal(1_000_000)


def to_micros(amount: Decimal | int | float | str) -> int:
    """A charge (a hold, a cost) in currency units -> integer micro-units, rounded up.

    Rounded up so a hold never under-reserves and a cost is never under-counted. A budget
    limit is converted with :func:`limit_micros` instead.
    """
    return _micros(amount, "ROUND_CEILING")


def limit_micros(amount: Decimal | int | float | str) -> int:
    """A budget limit (``max_cost``) in currency units -> integer micro-units, rounded down.

    Rounded down because holds and costs round up: a limit rounded up would let a Run reserve
    and post more than the budget it was given (``max_cost="0.0000015"`` would allow 2 micros).
    """
    return _micros(amount, "ROUND_FLOOR")


def _micros(amount: Decimal | int | float | str, rounding: str) -> int:
    return int((Decimal(str(amount)) * MICROS).to_integral_value(rounding=rounding))


def from_micros(micros: int) -> Decimal:
    """Integer micro-units -> currency units, exactly.

    The inverse of :func:`to_micros` and :func:`limit_micros` on whole micro-units.
    """
    return Decimal(micros) / MICROS


class RunStatus(StrEnum):
    """Where a Run is in its life.

    ``admitted`` until its first Attempt begins, then ``running``; it ends ``succeeded``,
    ``failed``, ``stopped`` or ``cancelled`` (:meth:`~ledger.Ledger.finish_run`).
    """

    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    CANCELLED = "cancelled"


class AttemptState(StrEnum):
    """Where an Attempt (one physical call) is: ``dispatching`` until it is settled."""

    DISPATCHING = "dispatching"  # recorded, request may be on the wire
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"  # sent, no receipt: keeps its hold, never re-sent by recovery
    REJECTED = "rejected"  # refused by admission at begin; nothing was sent
    NOT_SENT = "not_sent"  # begun, then provably never left the process; hold voided


class AttemptKind(StrEnum):
    """Why an Attempt was made: the turn's first, a same-route retry, a failover, a probe."""

    FIRST = "first"
    RETRY = "retry"  # same route again
    FAILOVER = "failover"  # another route
    PROBE = "probe"  # a cooling primary, probed


class Outcome(StrEnum):
    """What settle records.

    ``not_sent``: the request provably never left the process (its hold is voided and the call is
    not counted against the model-call allowance).
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    NOT_SENT = "not_sent"


class DebitState(StrEnum):
    """An Attempt's budget hold: ``reserved`` while in flight, then ``posted`` or ``voided``."""

    RESERVED = "reserved"
    POSTED = "posted"
    VOIDED = "voided"


@dataclass(frozen=True)
class Lease:
    """The right to write for a Run, as :meth:`~ledger.Ledger.acquire_lease` grants it.

    Attributes:
        run_id: The Run it is a lease on.
        executor: Who holds it (the ledger's ``executor_id``).
        fence: The Run's fence when it was granted; a write under an older fence is refused
            with :class:`~ledger.errors.FencedOut`.
        expires_at: When it lapses (epoch seconds) unless renewed.
    """

    run_id: str
    executor: str
    fence: int
    expires_at: float


@rule
def granted(value: Any) -> Lease:
    """``value`` if it is a :class:`Lease` as :meth:`~ledger.Ledger.acquire_lease` grants one."""
    fix = "pass what acquire_lease returned"
    if not isinstance(value, Lease):
        raise Problem("is not a ledger.Lease", fix)
    # A hand-built one must still fit the columns it is compared with (so both backends refuse
    # the same leases).
    if not (is_id(value.run_id) and is_id(value.executor)
            and not isinstance(value.fence, bool) and isinstance(value.fence, int)
            and 0 <= value.fence <= MAX_FENCE and not isinstance(value.expires_at, bool)
            and isinstance(value.expires_at, int | float)):
        raise Problem("is not a lease the ledger granted (run id, executor, fence or expiry out "
                      "of range)", fix)
    return value


LeaseArg = Annotated[Lease, granted]
"""A :class:`Lease` argument: one :meth:`~ledger.Ledger.acquire_lease` granted."""


@dataclass(frozen=True, kw_only=True)
class FrozenRun:
    """What a Run froze at admission: its plan, grant, budget, policy and identity.

    None of it ever changes, so it is safe to cache for the Run's life
    (:meth:`ledger.Ledger.frozen_run`); the counters that do change live in :class:`RunState`.

    Attributes:
        run_id: The Run's id.
        parent_run_id: Its parent's, for a Child Run.
        role: The role it runs in (routes and grants qualify roles).
        tenant: Whose it is, for the audit's totals.
        labels: Free labels (string to string), for the audit's totals.
        plan: The frozen route snapshots, in preference order.
        grant: Which recipients may receive which data classes.
        budget: Its bounds (calls, retries, cost, tokens).
        policy: The frozen policy, as JSON; ``policy_hash`` names it.
        policy_hash: The hash of ``policy``.
        selected_route: The route the first turn starts on.
        content_hash: The hash of all of the above: a repeated admission must match it.
        deadline: When the Run must be done by (epoch seconds), if any.
        created_at: When it was admitted.
    """

    run_id: str
    parent_run_id: str | None
    role: str
    tenant: str | None
    labels: dict[str, str]
    plan: list[Route]
    grant: Grant
    budget: Budget
    policy: dict[str, Any]
    policy_hash: str
    selected_route: str
    content_hash: str
    deadline: float | None
    created_at: float

    def route(self, route_id: str) -> Route:
        """The frozen snapshot of the plan's route ``route_id`` (``KeyError`` if absent)."""
        for r in self.plan:
            if r.id == route_id:
                return r
        raise KeyError(route_id)


@dataclass(frozen=True, kw_only=True)
class RunState:
    """A Run's live state as read.

    Its ``status``; what it used (``calls_used``, ``retries_used``, ``tokens_used``) and holds
    for Attempts in flight (``reserved`` cost, ``tokens_reserved``) and spent (``posted``), in
    currency units; what it carved out for its Children (``carved_calls``, ``carved_retries``,
    ``carved``, ``carved_tokens``); what it gave back of its own carve to its parent when it
    ended, as a Child (``returned_calls``, ``returned_retries``, ``returned``,
    ``returned_tokens``: never used again by it); ``current_route`` and ``current_profile``, those
    of its last success (except that a success under a user pin on another profile leaves
    ``current_profile``, the session's pin, as it was); its lease (``lease_holder``, ``fence``,
    ``lease_expires_at``); the ``compactions`` recorded; ``updated_at``.
    """

    status: RunStatus
    calls_used: int
    retries_used: int
    reserved: Decimal
    posted: Decimal
    tokens_used: int
    tokens_reserved: int
    carved_calls: int
    carved_retries: int
    carved: Decimal
    carved_tokens: int
    current_route: str | None
    current_profile: str | None
    lease_holder: str | None
    fence: int
    lease_expires_at: float | None
    updated_at: float
    # Compactions recorded (Ledger.record_compaction), and their count when current_profile
    # was set: the profile is the session's pin only while no compaction came after it.
    compactions: int = 0
    profile_compactions: int = 0
    # What it gave back to its parent when it ended, as a Child (0 for any other Run).
    returned_calls: int = 0
    returned_retries: int = 0
    returned: Decimal = Decimal(0)
    returned_tokens: int = 0


FROZEN_RUN_FIELDS = tuple(f.name for f in fields(FrozenRun))
RUN_STATE_FIELDS = tuple(f.name for f in fields(RunState))


@dataclass(frozen=True, kw_only=True)
class RunRecord(FrozenRun, RunState):
    """The Run as it stands when read: frozen admission and live state, and what is left.

    It is its frozen admission (:class:`FrozenRun`, whose attributes it has) with its live state
    (:class:`RunState`); what is left of the budget is :attr:`calls_left`,
    :attr:`retries_left`, :attr:`cost_left` and :attr:`tokens_left`.
    """

    @classmethod
    def of(cls, frozen: FrozenRun, state: RunState) -> RunRecord:
        """The record of ``frozen`` as it stands in ``state``."""
        return cls(**{f: getattr(frozen, f) for f in FROZEN_RUN_FIELDS},
                   **{f: getattr(state, f) for f in RUN_STATE_FIELDS})

    @property
    def frozen(self) -> FrozenRun:
        """Only what the Run froze at admission (what :meth:`ledger.Ledger.frozen_run` caches)."""
        return FrozenRun(**{f: getattr(self, f) for f in FROZEN_RUN_FIELDS})

    @property
    def state(self) -> RunState:
        """Only the live state, as read."""
        return RunState(**{f: getattr(self, f) for f in RUN_STATE_FIELDS})

    @property
    def pinned_profile(self) -> str | None:
        """The profile a new turn keeps (session stickiness).

        It is the one used last, unless a compaction was recorded since (Fased: "a compaction
        completes ... increments").
        """
        if self.compactions != self.profile_compactions:
            return None
        return self.current_profile

    @property
    def left(self) -> Left:
        """What is left of the Run's budget (:func:`budget_left`)."""
        b = self.budget
        return budget_left(SimpleNamespace(
            max_calls=b.max_calls, carved_calls=self.carved_calls, calls_used=self.calls_used,
            max_retries=b.max_retries, carved_retries=self.carved_retries,
            retries_used=self.retries_used, max_cost_micros=limit_micros(b.max_cost),
            carved_micros=to_micros(self.carved), reserved_micros=to_micros(self.reserved),
            posted_micros=to_micros(self.posted), max_tokens=b.max_tokens,
            carved_tokens=self.carved_tokens, tokens_reserved=self.tokens_reserved,
            tokens_used=self.tokens_used, returned_calls=self.returned_calls,
            returned_retries=self.returned_retries, returned_micros=to_micros(self.returned),
            returned_tokens=self.returned_tokens))

    @property
    def calls_left(self) -> int:
        """Model calls the Run may still begin."""
        return self.left.calls

    @property
    def retries_left(self) -> int:
        """Retry permissions (further Attempts of a turn) the Run still has."""
        return self.left.retries

    @property
    def cost_left(self) -> Decimal:
        """Cost budget neither held, spent nor carved out for children (currency units)."""
        return from_micros(self.left.micros)

    @property
    def tokens_left(self) -> int | None:
        """Tokens the Run may still hold or spend (``None``: no token budget)."""
        return self.left.tokens


@dataclass(frozen=True, slots=True)
class Left:
    """What is left of a Run's budget: not used, held, carved, nor given back.

    Carved: for its Children; given back: to its parent, by an ended Child.

    ``micros`` is money in millionths; ``tokens`` is ``None`` without a token budget.
    """

    calls: int
    retries: int
    micros: int
    tokens: int | None

    def amounts(self) -> dict[str, int]:
        """Each amount by its name, as the Run's ``carved_*`` and ``returned_*`` columns say.

        Without a token budget ``tokens`` is 0.
        """
        return {"calls": self.calls, "retries": self.retries, "micros": self.micros,
                "tokens": self.tokens or 0}


def budget_left(run: Any) -> Left:
    """What is left of the budget of ``run``; the one place this is said.

    ``run`` is anything with the ledger's run counters by their column names (a row, a
    namespace), money in micros.
    """
    tokens = None
    if run.max_tokens is not None:
        tokens = (run.max_tokens - run.carved_tokens - run.tokens_reserved - run.tokens_used
                  - run.returned_tokens)
    return Left(
        calls=run.max_calls - run.carved_calls - run.calls_used - run.returned_calls,
        retries=run.max_retries - run.carved_retries - run.retries_used - run.returned_retries,
        micros=(run.max_cost_micros - run.carved_micros - run.reserved_micros
                - run.posted_micros - run.returned_micros),
        tokens=tokens)


def carve_return(child: Any, tokens_carved: bool) -> Left | None:
    """What the ended Child ``child`` gives back to its parent now (``None``: nothing).

    It is all it has left (:func:`budget_left`), which it never uses again.

    What its Attempts still hold (an ``unknown`` one's hold, until it is settled), what they
    spent and what it carved for its own Children stay carved; ``tokens_carved``: whether the
    parent carved the Child's token budget (only a parent with a token budget does).
    """
    left = budget_left(child)
    back = Left(calls=max(left.calls, 0), retries=max(left.retries, 0),
                micros=max(left.micros, 0),
                tokens=max(left.tokens or 0, 0) if tokens_carved else 0)
    return None if back == Left(0, 0, 0, 0) else back


@dataclass(frozen=True)
class AttemptRecord:
    """One physical call, as recorded: begun before it was sent, settled once.

    The route it used stays as it was frozen (``route_id``, ``provider``, ``model``,
    ``group_id``, and ``profile_id``, the credential profile); ``kind`` says why it was made and
    ``seq`` is its order in the Run. ``state`` is where it is; a settled one carries its
    failure ``fact`` (with ``category`` and ``http_status`` copied out for queries),
    ``effective_output`` and ``tool_started``, the usage the provider reported
    (``prompt_tokens``, ``completion_tokens``, ``cost``; ``None`` when not reported),
    ``model_reported`` (the model the provider named: an answer's, or a failure's when the
    provider named one before failing) and the ``output_hash`` of its answer. ``reserved`` and
    ``reserved_tokens`` are its holds and ``debit_state`` what became of them; ``fence`` and
    ``executor`` who began it; ``reject_reason`` why admission refused it (``rejected``).

    Measured by the ledger's clock, in seconds from its begin (``created_at``): ``latency_s``
    to its settle by the executor (``None`` for an Attempt still in flight, rejected, or
    resolved by recovery), ``first_byte_s`` to the response's first byte and
    ``first_token_s`` to a stream's first content (``None`` when the send did not report
    them). ``cached_tokens`` and ``reasoning_tokens`` are the parts of ``prompt_tokens`` served
    from the provider's cache and of ``completion_tokens`` spent reasoning, where the provider
    reports them.
    """

    attempt_id: str
    run_id: str
    turn_id: str
    seq: int
    kind: AttemptKind
    route_id: str
    provider: str
    model: str
    group_id: str
    profile_id: str | None
    debit_id: str
    envelope_hash: str
    state: AttemptState
    reject_reason: str | None
    fact: FailureFact | None
    category: str | None
    http_status: int | None
    effective_output: bool
    tool_started: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    cost: Decimal | None
    reserved: Decimal
    reserved_tokens: int
    model_reported: str | None
    output_hash: str | None
    fence: int
    executor: str | None
    created_at: float
    settled_at: float | None
    debit_state: DebitState | None = None
    latency_s: float | None = None
    first_byte_s: float | None = None
    first_token_s: float | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


@dataclass(frozen=True)
class DebitRecord:
    """An Attempt's budget hold: ``reserved`` at begin, ``posted`` (spent) at settle."""

    debit_id: str
    run_id: str
    attempt_id: str
    state: DebitState
    reserved: Decimal
    posted: Decimal
    created_at: float
    settled_at: float | None


@dataclass(frozen=True)
class EventRecord:
    """One audit event of a Run (or of one of its Attempts): a ``kind`` and its ``data``."""

    event_id: int
    run_id: str | None
    attempt_id: str | None
    kind: str
    data: dict[str, Any]
    created_at: float


#: The upper bounds, in seconds, of the buckets an Attempt's times are counted into: semconv's
#: advised boundaries for durations, used by the OpenTelemetry histograms
#: (:mod:`ledger.telemetry`), ``/metrics`` and the hourly roll-ups that keep its counts.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)

#: The events of operators' actions: a retention run keeps them whatever their age (a dropped
#: partition's are copied back first), so the record of who did what outlives the history.
OPERATOR_ACTION_KINDS = ("clear_cooldown", "close", "late_receipt", "retention")


@dataclass(frozen=True)
class HistoryPart:
    """Rows of history a retention run dropped or kept, for its report and its record.

    On PostgreSQL one partition (``partition`` its name, ``since``/``until`` its month); on
    SQLite, which has none, the rows of one table older than the cut-off (``partition``
    ``None``, ``since`` ``None``, ``until`` the cut-off). ``rows``: how many; ``held``: why a
    kept one was kept (``None`` for a dropped one), e.g. ``"1 unknown attempt(s)"``.
    """

    table: str
    partition: str | None
    since: float | None
    until: float | None
    rows: int
    held: str | None = None


@dataclass(frozen=True)
class Retention:
    """What a retention run (:meth:`~ledger.Ledger.drop_history`) dropped, or would drop.

    ``cutoff`` is the ledger clock's time less ``older_than_s``; ``dropped`` the history that
    went (or, with ``dry_run``, would go), ``kept`` the old partitions kept because an open
    (unknown or dispatching) Attempt, a live Run or an ended Run under a live lease (resumed)
    is inside; ``actions_kept`` the operators'
    action events older than the cut-off that stay; ``event`` the ``retention`` event that
    records the run (on SQLite, which drops in slices, the last slice's; ``None`` for a dry
    run).
    """

    cutoff: float
    older_than_s: float
    dry_run: bool
    dropped: list[HistoryPart]
    kept: list[HistoryPart]
    actions_kept: int
    event: EventRecord | None

    def rows(self, table: str) -> int:
        """How many rows of ``table`` went (or would go)."""
        return sum(p.rows for p in self.dropped if p.table == table)


@dataclass(frozen=True)
class Rollup:
    """What a roll-up (:meth:`~ledger.Ledger.roll_up`) did.

    ``hours``: the hours it rolled up (each one transaction); ``rows``: the roll-up rows it
    wrote for them (one per route, group, provider, tenant and set of labels that had settled
    attempts in the hour); ``pending``: the hours due but left for a later call
    (``max_hours``); ``until``: the hours ending by this time were due; ``days``: the old
    UTC days it folded, each into one set of rows (``fold_after``).
    """

    hours: int
    rows: int
    pending: int
    until: float
    days: int = 0


@dataclass(frozen=True)
class Queued:
    """A begin that found its capacity group full: it holds a place in the group's queue.

    No Attempt was recorded. Places are served in ``ticket`` order across processes; ``ahead``
    counts the live places before this one, ``in_flight`` the live slots, of ``limit``; the
    place was taken at ``since`` (``now`` is when this was decided).
    """

    group: str
    ticket: int
    ahead: int
    in_flight: int
    limit: int
    since: float
    now: float


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of results; pass ``next_cursor`` back to get the next page (None = the end)."""

    items: list[T] = field(default_factory=list)
    next_cursor: str | None = None


LIVE_RUN_FIELDS = (
    "status", "calls_used", "retries_used", "tokens_used", "tokens_reserved", "carved_calls",
    "carved_retries", "carved_tokens", "current_route", "current_profile", "lease_holder",
    "fence", "lease_expires_at", "updated_at", "compactions", "profile_compactions",
    "returned_calls", "returned_retries", "returned_tokens",
)


def run_live(frozen: FrozenRun, row: Any) -> RunRecord:
    """The Run as it stands: its frozen parts (read once per Run) with a live row's state."""
    live: dict[str, Any] = {f: getattr(row, f) for f in LIVE_RUN_FIELDS}
    live["status"] = RunStatus(live["status"])
    live["reserved"] = from_micros(row.reserved_micros)
    live["posted"] = from_micros(row.posted_micros)
    live["carved"] = from_micros(row.carved_micros)
    live["returned"] = from_micros(row.returned_micros)
    return RunRecord(**{f: getattr(frozen, f) for f in FROZEN_RUN_FIELDS}, **live)


__all__ = [
    "DURATION_BUCKETS",
    "FROZEN_RUN_FIELDS",
    "LIVE_RUN_FIELDS",
    "OPERATOR_ACTION_KINDS",
    "RUN_STATE_FIELDS",
    "AttemptKind",
    "AttemptRecord",
    "AttemptState",
    "DebitRecord",
    "DebitState",
    "EventRecord",
    "FrozenRun",
    "HistoryPart",
    "Lease",
    "LeaseArg",
    "Left",
    "Outcome",
    "Page",
    "Queued",
    "Retention",
    "Rollup",
    "RunRecord",
    "RunState",
    "RunStatus",
    "budget_left",
    "carve_return",
    "from_micros",
    "granted",
    "limit_micros",
    "run_live",
    "to_micros",
]
