"""The ledger's value types: routes, grants, budgets, and the projections decisions read.

All are frozen pydantic models, so a Run can freeze them as JSON snapshots at admission and read
historical Attempts under their original routes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from decimal import Decimal
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, StrictBool, StrictInt, field_validator

from ledger.domain.bounds import MAX_AMOUNT, MAX_COUNT, MAX_TOKENS, canonical_decimal
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MAX_BINARY_BYTES
from ledger.domain.validation import (
    Count,
    HealthKey,
    Id,
    Instant,
    Problem,
    Recipient,
    StrictModel,
    Text,
)
from ledger.forking import in_child

# A route's endpoint is a URL. Only its size is bounded here: an endpoint that cannot make a
# request is the adapter's `cannot_build` result (the Run skips that route), not misuse.
MAX_ENDPOINT = 8192
MAX_LIST = 1000



class ProfileType(StrEnum):
    """A credential profile's kind; rotation tries ``oauth``, then ``token``, then ``api_key``."""

    OAUTH = "oauth"
    TOKEN = "token"
    API_KEY = "api_key"


class Profile(StrictModel):
    """A credential profile: only its id and type are stored, never the secret."""

    id: Id
    type: ProfileType = ProfileType.API_KEY


class Capabilities(StrictModel):
    """What a route can serve. ``None`` means unknown and is no restriction.

    Attributes:
        tools: Tool calls.
        context_window: Prompt plus output tokens, at most.
        prefill: Continuing a trailing assistant part.
        streaming: Streamed answers.
        parameters: The request parameters it takes (``None``: any).
        image_input: Images in the request (``image/png``, ``jpeg``, ``gif``, ``webp``).
        pdf_input: PDF documents in the request (plain-text documents are text to every
            protocol, so they need no capability).
        url_input: Images and documents given as ``https://`` links, which the provider fetches
            (``False`` for a server that cannot reach the internet).
        max_image_bytes: The largest image it takes, in bytes (Anthropic's API: 5 MB).
        max_pdf_bytes: The largest PDF it takes, in bytes (Anthropic and OpenAI: 32 MB).
    """

    tools: StrictBool | None = None
    context_window: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    prefill: StrictBool | None = None
    streaming: StrictBool | None = None
    # Supported request parameters; None = any.
    parameters: list[Text] | None = Field(default=None, max_length=MAX_LIST)
    image_input: StrictBool | None = None
    pdf_input: StrictBool | None = None
    url_input: StrictBool | None = None
    max_image_bytes: StrictInt | None = Field(default=None, ge=1, le=MAX_BINARY_BYTES)
    max_pdf_bytes: StrictInt | None = Field(default=None, ge=1, le=MAX_BINARY_BYTES)

    @field_validator("parameters")
    @classmethod
    def _as_set(cls, v: list[str] | None) -> list[str] | None:
        # A set, written in one order, so equal capabilities freeze (and hash) alike.
        return sorted(set(v)) if v is not None else None


class Price(StrictModel):
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
        """The cost of this usage: tokens times the price per million, input and output."""
        return (
            self.input_per_mtok * prompt_tokens + self.output_per_mtok * completion_tokens
        ) / Decimal(1_000_000)


class Route(StrictModel):
    """One concrete way to call a model: a provider's model, at an endpoint, with credentials.

    A Run's plan is a list of Routes, frozen at admission; an Attempt always uses a frozen one.

    Attributes:
        id: The route's id, unique in a plan.
        provider: Who serves it (``"openai"``, ``"deepseek"``, ...); health keyed by provider
            (``provider:<name>``) uses it.
        model: The provider's model name, sent in the request.
        group: The capacity group it shares slots and outage facts with.
        recipient: Who receives the request's data, as the Run's :class:`Grant` names them.
        protocol: The wire protocol (:class:`~ledger.domain.facts.WireProtocol`).
        endpoint: The base URL; ``None`` lets an adapter refuse it as ``cannot_build``.
        capabilities: What it can serve (:class:`Capabilities`; unknown is no restriction).
        roles: The Run roles it is qualified for (``None``: every role).
        profiles: Its credential profiles (ids and types only; the secrets stay outside).
        api_key_env: The environment variable holding its key, for a route without profiles.
        price: Its :class:`Price`; ``None`` is looked up by provider and model at admission,
            ``Price()`` declares it free.

    Example:
        >>> Route(id="primary", provider="openai", model="gpt-4o-mini", group="openai",
        ...       recipient="openai", endpoint="https://api.openai.com/v1",
        ...       price=Price(input_per_mtok="0.15", output_per_mtok="0.60"))  # doctest: +SKIP
    """

    id: Id
    provider: Id
    model: Id
    group: Id
    recipient: Recipient
    protocol: WireProtocol = WireProtocol.OPENAI
    endpoint: str | None = Field(default=None, max_length=MAX_ENDPOINT)
    capabilities: Capabilities = Field(default_factory=Capabilities)
    roles: list[Id] | None = Field(default=None, max_length=MAX_LIST)  # None = every role
    profiles: list[Profile] = Field(default_factory=list, max_length=MAX_LIST)
    # The environment variable that holds this route's API key, for a route without credential
    # profiles (the key itself is never stored: only this name is frozen with the plan).
    api_key_env: str | None = Field(default=None, max_length=200,
                                    pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # None: look it up by provider and model when a Run is admitted (ledger.decide.pricing), so the
    # Run's frozen plan always carries a price. Price() declares the route free.
    price: Price | None = None

    def cost(self, prompt_tokens: int, completion_tokens: int) -> Decimal:
        """The cost of this usage at the route's price.

        Routes of an admitted Run are always priced; an unpriced route outside a Run (never
        admitted) costs nothing, as before.
        """
        return (self.price or Price()).cost(prompt_tokens, completion_tokens)

    @field_validator("roles")
    @classmethod
    def _roles_as_set(cls, v: list[str] | None) -> list[str] | None:
        return sorted(set(v)) if v is not None else None

    @field_validator("profiles")
    @classmethod
    def _unique_profiles(cls, v: list[Profile]) -> list[Profile]:
        ids = [p.id for p in v]
        dup = next((i for i in ids if ids.count(i) > 1), None)
        if dup is not None:
            raise Problem(f"profile id {dup!r} appears twice", "give each profile its own id")
        return v


class Grant(StrictModel):
    """Which recipients may receive which data classes, and which roles the run may use.

    ``recipients`` maps a recipient to the data classes approved for it. A recipient is a name
    of up to 2,048 characters: a provider's (as ``Route.recipient`` says it), or the URL of a
    server a request parameter makes the provider forward the conversation to (an MCP server's
    ``server_url``), compared exactly as written.
    """

    recipients: dict[Recipient, list[Id]] = Field(default_factory=dict, max_length=MAX_LIST)
    roles: list[Id] | None = Field(default=None, max_length=MAX_LIST)

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
        """Whether ``data_class`` may be sent to ``recipient`` under this grant."""
        return data_class in self.recipients.get(recipient, [])


class Budget(StrictModel):
    """The bounds of a Run. Cost is in the ledger's currency unit (e.g. USD).

    ``max_calls``: physical model calls (Attempts that may have reached a provider);
    ``max_retries``: further Attempts of a turn after its first (same-route retries and
    failovers alike); ``max_cost``: reserved plus posted debits; ``max_tokens``: held plus used
    tokens (``None``: no token bound). Ranges are in :mod:`ledger.domain.bounds`.

    ``max_cost`` is enforced in whole micro-units, rounded down (holds and costs round up), so
    reserved plus posted never exceed it: ``"0.0000015"`` allows 0.000001.
    """

    max_calls: StrictInt = Field(ge=0, le=MAX_COUNT)
    max_retries: StrictInt = Field(ge=0, le=MAX_COUNT)
    max_cost: Decimal = Field(ge=0, le=MAX_AMOUNT, allow_inf_nan=False)
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_TOKENS)

    @field_validator("max_cost")
    @classmethod
    def _canonical(cls, v: Decimal) -> Decimal:
        # 1, "1.0" and "1.00" (and -0 and 0) are one budget: a retried admission must not
        # conflict.
        return canonical_decimal(v)


class GroupMode(StrEnum):
    """A capacity group's state: ``open``, or closed (``cooldown``, ``unavailable``) ``until``."""

    OPEN = "open"
    COOLDOWN = "cooldown"
    UNAVAILABLE = "unavailable"


class GroupProjection(StrictModel):
    """Admission's view of a capacity group, as the selector reads it."""

    group: Id
    mode: GroupMode = GroupMode.OPEN
    until: Instant | None = None  # waiting floor: earliest next dispatch
    sampled_at: Instant | None = None
    in_flight: Count = 0
    limit: StrictInt | None = Field(default=None, ge=1, le=MAX_COUNT)
    # Turns waiting in the group's queue for a slot (live places); read by operators, not by
    # the selector (a full group is a queue, not a reason to skip a route).
    waiting: Count = 0


class Health(StrictModel):
    """Health of one key (a route id, a credential profile id, or ``provider:<name>``)."""

    key: HealthKey
    cooldown_until: Instant | None = None
    disabled_until: Instant | None = None
    disabled_reason: Text | None = None
    error_count: Count = 0
    failure_counts: dict[Text, Count] = Field(default_factory=dict)
    last_failure_at: Instant | None = None
    # The failure that counted the current outage (stepped ``error_count``); a failure of the
    # same outage restarts the window and moves ``last_failure_at``, not this. An Attempt that
    # began before it overlaps the outage (``health.count_overlapping_failures``); ``None``
    # with counters: a row written before it was kept, read as ``last_failure_at``.
    counted_at: Instant | None = None
    last_used: Instant | None = None
    last_probe_at: Instant | None = None
    # When the counters reset by themselves under the policy that counted the last failure
    # (``None``: only a success resets them); see ledger.decide.health.as_read.
    reset_at: Instant | None = None
    # Failures below the policy's threshold (``health.cooldown_after``), oldest first: each
    # would have cooled the key, but one failed call is not an outage.
    recent_failures: tuple[Instant, ...] = ()

    def available(self, now: float) -> bool:
        """Whether the key is neither cooling down nor disabled at ``now``."""
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


class _Uuid7:
    """UUIDv7 (RFC 9562) values, strictly increasing within a process.

    The first 48 bits are the wall clock's Unix milliseconds, so ids made later sort later
    (as text too: 32 lower-case hex digits) and a PostgreSQL ledger's Attempts, partitioned
    by time, keep ids whose order is their partitions' order; the other 74 bits are random, so
    ids stay unique across hosts. Within one millisecond, or when the clock steps back, the
    next value is the last plus a random step (RFC 9562's monotonic random, method 2), so the
    order within a process holds whatever the clock does. A forked child starts afresh: it
    must not continue its parent's sequence, or both could make the same next value.
    """

    _RAND_BITS = 74
    _STEP = 1 << 32

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0  # (ms << 74) | random: the value before the version and variant bits

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next_hex(self) -> str:
        ms = time.time_ns() // 1_000_000
        with self._lock:
            value = (ms << self._RAND_BITS) | secrets.randbits(self._RAND_BITS)
            if value <= self._last:
                value = self._last + 1 + secrets.randbelow(self._STEP)
            self._last = value
        ts = value >> self._RAND_BITS
        rand_a = (value >> 62) & 0xFFF
        rand_b = value & ((1 << 62) - 1)
        whole = (ts & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
        return f"{whole:032x}"


_UUID7 = _Uuid7()
# A forked child's ids must not follow its parent's last one (nor wait on a lock another
# thread of the parent held): renewed before any ledger there takes a new executor id.
in_child(_UUID7.reset)


def uuid7_hex() -> str:
    """A fresh UUIDv7 as 32 hex digits: later ids sort later, within a process strictly."""
    return _UUID7.next_hex()


def new_id(prefix: str) -> str:
    """A fresh identifier such as ``att-<32 hex digits>``, unique across hosts.

    The digits are a UUIDv7 (:func:`uuid7_hex`), so ids of one prefix sort by when they
    were made.
    """
    return f"{prefix}-{uuid7_hex()}"


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
