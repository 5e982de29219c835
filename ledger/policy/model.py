"""The policy model: a declarative file validated into typed, frozen models.

Every number a preset uses is a field here, not a constant in code. Presets live in
``policies/*.yaml``. (Skeleton: section owners fill in and validate their sections.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ledger.core.facts import Category, Phase, Scope, Transport
from ledger.model import ProfileType


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FailoverPolicy(_Section):
    """The master switch and the rules about when a request may move to another route."""

    enabled: bool = True
    excluded_roles: list[str] = Field(
        default_factory=lambda: ["evaluation", "reviewer", "compaction", "diagnostics", "scheduled"]
    )
    # "stop": effective output rules out another route; "discard": discard it, tell the caller,
    # move on (goclaw). A started tool always stops.
    after_effective_output: Literal["stop", "discard"] = "stop"
    # Whether a request whose execution is unknown (timeout after send) may be sent again as a
    # new Attempt (goclaw and fased do, the default never does).
    resubmit_unknown_execution: bool = False
    last_candidate_always_tried: bool = False
    new_turn: Literal["first_entry", "keep_current"] = "keep_current"
    group_aware: bool = True
    group_fact_max_age_s: float = 30.0


class MoveRule(_Section):
    """A failure that makes the request eligible for another route."""

    categories: list[Category]
    phases: list[Phase] | None = None  # None = any phase
    scope: Scope = Scope.ROUTE


class RetryRule(_Section):
    """Same-route retries before moving on."""

    categories: list[Category] = Field(default_factory=list)
    transports: list[Transport] = Field(default_factory=list)
    max: int = 0
    delays_s: list[float] = Field(default_factory=list)
    jitter: float = 0.0
    honor_retry_after: bool = False
    retry_after_cap_s: float | None = None


class ProbePolicy(_Section):
    """Probing a cooling primary to learn that it is back (goclaw)."""

    enabled: bool = False
    interval_s: float = 30.0
    margin_s: float = 120.0
    ttl_s: float = 86_400.0
    max_keys: int = 256


class ProfilePolicy(_Section):
    """Credential-profile rotation inside a route before model fallback (fased)."""

    rotate_before_model: bool = False
    type_order: list[ProfileType] = Field(
        default_factory=lambda: [ProfileType.OAUTH, ProfileType.TOKEN, ProfileType.API_KEY]
    )
    auth_order: dict[str, list[str]] = Field(default_factory=dict)


class AdmissionPolicy(_Section):
    """Capacity-group admission facts written by settle."""

    trust_provider_429: bool = True
    default_group_cooldown_s: float = 30.0
    max_capacity_wait_s: float = 30.0


class StreamingPolicy(_Section):
    """Time limits adapters enforce so that no call is unbounded in time."""

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    total_timeout_s: float = 600.0


class Policy(BaseModel):
    """A whole policy (one preset file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    failover: FailoverPolicy = Field(default_factory=FailoverPolicy)
    moves_on: list[MoveRule] = Field(default_factory=list)
    same_route_retry: list[RetryRule] = Field(default_factory=list)
    probe: ProbePolicy = Field(default_factory=ProbePolicy)
    profiles: ProfilePolicy = Field(default_factory=ProfilePolicy)
    admission: AdmissionPolicy = Field(default_factory=AdmissionPolicy)
    streaming: StreamingPolicy = Field(default_factory=StreamingPolicy)
