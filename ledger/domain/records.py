"""Records the ledger returns: what is durably written about Runs, Attempts, Debits and Leases."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from decimal import Decimal
from enum import StrEnum
from typing import Any, Generic, TypeVar

from ledger.domain.facts import FailureFact
from ledger.domain.values import Budget, Grant, Route

MICROS = Decimal(1_000_000)


def to_micros(amount: Decimal | int | float | str) -> int:
    """Currency units -> integer micro-units, rounded up (a hold never under-reserves)."""
    d = Decimal(str(amount)) * MICROS
    return int(d.to_integral_value(rounding="ROUND_CEILING"))


def from_micros(micros: int) -> Decimal:
    return Decimal(micros) / MICROS


class RunStatus(StrEnum):
    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    CANCELLED = "cancelled"


class AttemptState(StrEnum):
    DISPATCHING = "dispatching"  # recorded, request may be on the wire
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"  # sent, no receipt: keeps its hold, never re-sent by recovery
    REJECTED = "rejected"  # refused by admission at begin; nothing was sent
    NOT_SENT = "not_sent"  # begun, then provably never left the process; hold voided


class AttemptKind(StrEnum):
    FIRST = "first"
    RETRY = "retry"  # same route again
    FAILOVER = "failover"  # another route
    PROBE = "probe"  # a cooling primary, probed


class Outcome(StrEnum):
    """What settle records. ``not_sent``: the request provably never left the process (its
    hold is voided and the call is not counted against the model-call allowance)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    NOT_SENT = "not_sent"


class DebitState(StrEnum):
    RESERVED = "reserved"
    POSTED = "posted"
    VOIDED = "voided"


@dataclass(frozen=True)
class Lease:
    run_id: str
    executor: str
    fence: int
    expires_at: float


@dataclass(frozen=True, kw_only=True)
class FrozenRun:
    """What a Run froze at admission: its plan, grant, budget, policy and identity.

    None of it ever changes, so it is safe to cache for the Run's life
    (:meth:`ledger.Ledger.frozen_run`); the counters that do change live in :class:`RunState`.
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
    """A Run's live state as read: its status, what it used and holds, what it carved for its
    Children, the route and profile it last used, and its lease."""

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


FROZEN_RUN_FIELDS = tuple(f.name for f in fields(FrozenRun))
RUN_STATE_FIELDS = tuple(f.name for f in fields(RunState))


@dataclass(frozen=True, kw_only=True)
class RunRecord(FrozenRun, RunState):
    """The Run as it stands when read: its frozen admission (:class:`FrozenRun`) with its live
    state (:class:`RunState`), and what is left of its budget."""

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
        """The profile a new turn keeps (session stickiness): the one used last, unless a
        compaction was recorded since (Fased: "a compaction completes ... increments")."""
        if self.compactions != self.profile_compactions:
            return None
        return self.current_profile

    @property
    def calls_left(self) -> int:
        """Model calls the Run may still begin."""
        return self.budget.max_calls - self.carved_calls - self.calls_used

    @property
    def retries_left(self) -> int:
        """Retry permissions the Run may still take."""
        return self.budget.max_retries - self.carved_retries - self.retries_used

    @property
    def cost_left(self) -> Decimal:
        """Cost the Run may still hold or spend."""
        return self.budget.max_cost - self.carved - self.reserved - self.posted

    @property
    def tokens_left(self) -> int | None:
        """Tokens the Run may still hold or spend (``None``: no token budget)."""
        if self.budget.max_tokens is None:
            return None
        return (self.budget.max_tokens - self.carved_tokens - self.tokens_reserved
                - self.tokens_used)


@dataclass(frozen=True)
class AttemptRecord:
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


@dataclass(frozen=True)
class DebitRecord:
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
    event_id: int
    run_id: str | None
    attempt_id: str | None
    kind: str
    data: dict[str, Any]
    created_at: float


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of results; pass ``next_cursor`` back to get the next page (None = the end)."""

    items: list[T] = field(default_factory=list)
    next_cursor: str | None = None


__all__ = [
    "FROZEN_RUN_FIELDS",
    "RUN_STATE_FIELDS",
    "AttemptKind",
    "AttemptRecord",
    "AttemptState",
    "DebitRecord",
    "DebitState",
    "EventRecord",
    "FrozenRun",
    "Lease",
    "Outcome",
    "Page",
    "RunRecord",
    "RunState",
    "RunStatus",
    "from_micros",
    "to_micros",
]
