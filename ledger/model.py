"""The ledger's value types: routes, grants, budgets, and the projections decisions read.

All are frozen pydantic models, so a Run can freeze them as JSON snapshots at admission and read
historical Attempts under their original routes.
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ledger.bounds import MAX_AMOUNT, MAX_COUNT, MAX_ID_LENGTH, MAX_TOKENS, canonical_decimal
from ledger.core.facts import Protocol


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProfileType(StrEnum):
    OAUTH = "oauth"
    TOKEN = "token"
    API_KEY = "api_key"


class Profile(_Frozen):
    """A credential profile: only its id and type are stored, never the secret."""

    id: str
    type: ProfileType = ProfileType.API_KEY


class Capabilities(_Frozen):
    """What a route can serve. ``None`` means unknown and is no restriction."""

    tools: bool | None = None
    context_window: int | None = None
    prefill: bool | None = None
    streaming: bool | None = None
    parameters: list[str] | None = None  # supported request parameters; None = any

    @field_validator("parameters")
    @classmethod
    def _as_set(cls, v: list[str] | None) -> list[str] | None:
        # A set, written in one order, so equal capabilities freeze (and hash) alike.
        return sorted(set(v)) if v is not None else None


class Price(_Frozen):
    """Price per million tokens, in the ledger's currency unit."""

    input_per_mtok: Decimal = Field(default=Decimal(0), ge=0, le=MAX_AMOUNT,
                                    allow_inf_nan=False)
    output_per_mtok: Decimal = Field(default=Decimal(0), ge=0, le=MAX_AMOUNT,
                                     allow_inf_nan=False)

    @field_validator("input_per_mtok", "output_per_mtok")
    @classmethod
    def _canonical(cls, v: Decimal) -> Decimal:
        return canonical_decimal(v)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> Decimal:
        return (
            self.input_per_mtok * prompt_tokens + self.output_per_mtok * completion_tokens
        ) / Decimal(1_000_000)


class Route(_Frozen):
    """One concrete way to call a model."""

    id: str = Field(max_length=MAX_ID_LENGTH)
    provider: str = Field(max_length=MAX_ID_LENGTH)
    model: str = Field(max_length=MAX_ID_LENGTH)
    group: str = Field(max_length=MAX_ID_LENGTH)
    recipient: str = Field(max_length=MAX_ID_LENGTH)
    protocol: Protocol = Protocol.OPENAI
    endpoint: str | None = None
    capabilities: Capabilities = Field(default_factory=Capabilities)
    roles: list[str] | None = None  # qualified roles; None = every role
    profiles: list[Profile] = Field(default_factory=list)
    # The environment variable that holds this route's API key, for a route without credential
    # profiles (the key itself is never stored: only this name is frozen with the plan).
    api_key_env: str | None = Field(default=None, max_length=200,
                                    pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # None: look it up by provider and model when a Run is admitted (ledger.pricing), so the
    # Run's frozen plan always carries a price. Price() declares the route free.
    price: Price | None = None

    def cost(self, prompt_tokens: int, completion_tokens: int) -> Decimal:
        """The cost of this usage at the route's price. Routes of an admitted Run are always
        priced; an unpriced route outside a Run (never admitted) costs nothing, as before."""
        return (self.price or Price()).cost(prompt_tokens, completion_tokens)

    @field_validator("id", "provider", "model", "group", "recipient")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("must be a non-empty string")
        if not v.isprintable():
            raise ValueError("must be printable text (no NUL or control characters)")
        return v

    @field_validator("roles")
    @classmethod
    def _roles_as_set(cls, v: list[str] | None) -> list[str] | None:
        return sorted(set(v)) if v is not None else None


class Grant(_Frozen):
    """Which recipients may receive which data classes, and which roles the run may use.

    ``recipients`` maps a recipient to the data classes approved for it.
    """

    recipients: dict[str, list[str]] = Field(default_factory=dict)
    roles: list[str] | None = None

    @field_validator("recipients")
    @classmethod
    def _classes_as_sets(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        # Approved classes are a set: one order, no repeats, so equal grants hash alike.
        return {k: sorted(set(classes)) for k, classes in sorted(v.items())}

    @field_validator("roles")
    @classmethod
    def _roles_as_set(cls, v: list[str] | None) -> list[str] | None:
        return sorted(set(v)) if v is not None else None

    def approves(self, recipient: str, data_class: str) -> bool:
        return data_class in self.recipients.get(recipient, [])


class Budget(_Frozen):
    """The bounds of a Run. Cost is in the ledger's currency unit (e.g. USD).

    ``max_calls``: physical model calls (Attempts that may have reached a provider);
    ``max_retries``: further Attempts of a turn after its first (same-route retries and
    failovers alike); ``max_cost``: reserved plus posted debits; ``max_tokens``: held plus used
    tokens (``None``: no token bound). Ranges are in :mod:`ledger.bounds`.
    """

    max_calls: StrictInt = Field(ge=0, le=MAX_COUNT)
    max_retries: StrictInt = Field(ge=0, le=MAX_COUNT)
    max_cost: Decimal = Field(ge=0, le=MAX_AMOUNT, allow_inf_nan=False)
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_TOKENS)

    @field_validator("max_cost")
    @classmethod
    def _canonical(cls, v: Decimal) -> Decimal:
        # 1, "1.0" and "1.00" are one budget: a retried admission must not conflict.
        return canonical_decimal(v)


class GroupMode(StrEnum):
    OPEN = "open"
    COOLDOWN = "cooldown"
    UNAVAILABLE = "unavailable"


class GroupProjection(_Frozen):
    """Admission's view of a capacity group, as the selector reads it."""

    group: str
    mode: GroupMode = GroupMode.OPEN
    until: float | None = None  # waiting floor: earliest next dispatch
    sampled_at: float | None = None
    in_flight: int = 0
    limit: int | None = None


class Health(_Frozen):
    """Health of one key (a route id, or a credential profile id)."""

    key: str
    cooldown_until: float | None = None
    disabled_until: float | None = None
    disabled_reason: str | None = None
    error_count: int = 0
    failure_counts: dict[str, int] = Field(default_factory=dict)
    last_failure_at: float | None = None
    last_used: float | None = None
    last_probe_at: float | None = None

    def available(self, now: float) -> bool:
        cooling = self.cooldown_until is not None and now < self.cooldown_until
        disabled = self.disabled_until is not None and now < self.disabled_until
        return not (cooling or disabled)


def _encode_default(o: Any) -> Any:
    if isinstance(o, Decimal):
        return str(o)
    if isinstance(o, BaseModel):
        return o.model_dump(mode="json")
    raise TypeError(f"cannot encode {type(o).__name__}")


# One encoder for every hash: ``json.dumps`` with options builds a new encoder on each call,
# which was most of the cost of hashing a small part.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=_encode_default)


def canonical_json(value: Any) -> str:
    """A stable JSON encoding: sorted keys, no whitespace, decimals as strings."""
    return _CANONICAL.encode(value)


def content_hash(value: Any) -> str:
    """sha256 over :func:`canonical_json`, as ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(canonical_json(value).encode()).hexdigest()


__all__ = [
    "Budget",
    "Capabilities",
    "Grant",
    "GroupMode",
    "GroupProjection",
    "Health",
    "Price",
    "Profile",
    "ProfileType",
    "Route",
    "canonical_json",
    "content_hash",
]
