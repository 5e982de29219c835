"""The values the storage layer takes for its writes (built by ``ledger.api``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.core.facts import FailureFact
from ledger.model import GroupMode, Health, Route
from ledger.records import (
    AttemptKind,
    Outcome,
)

HealthUpdate = Callable[[Health], Health]

# Fields compared on a duplicate admission, in the order reported.
ADMISSION_FIELDS = (
    "parent_run_id", "role", "tenant", "labels", "plan", "run_grant", "budget", "policy_hash",
    "selected_route", "deadline",
)


@dataclass(frozen=True)
class AdmitSpec:
    run_id: str
    parent_run_id: str | None
    parent_fence: int | None
    role: str
    tenant: str | None
    labels: str  # JSON
    plan: str  # JSON
    run_grant: str  # JSON
    budget: str  # JSON
    policy: str  # JSON
    policy_hash: str
    selected_route: str
    content_hash: str
    deadline: float | None
    max_calls: int
    max_retries: int
    max_cost_micros: int
    max_tokens: int | None


@dataclass(frozen=True)
class BeginSpec:
    run_id: str
    fence: int
    attempt_id: str
    turn_id: str
    kind: AttemptKind
    route: Route
    profile_id: str | None
    envelope_hash: str
    reserve_micros: int
    executor: str | None
    begin_hash: str
    events: Sequence[tuple[str, dict[str, Any]]] = ()
    tenant: str | None = None


@dataclass(frozen=True)
class GroupUpdate:
    """A capacity-group fact written by settle: a cooldown with a waiting floor."""

    mode: GroupMode
    until: float | None
    reason: str


@dataclass(frozen=True)
class SettleSpec:
    attempt_id: str
    fence: int
    outcome: Outcome
    fact: FailureFact | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_micros: int | None
    effective_output: bool
    tool_started: bool
    model_reported: str | None
    output_hash: str | None
    settle_hash: str
    void_hold: bool  # the request provably never left the process
    health: Mapping[str, tuple[str, str | None, HealthUpdate]]  # key -> (kind, provider, update)
    group_update: GroupUpdate | None
    events: Sequence[tuple[str, dict[str, Any]]] = ()
