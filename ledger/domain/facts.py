"""What was observed about a failed call, and the structured failure fact derived from it.

An :class:`Observation` is raw evidence (status, headers, body, transport error kind, phase, ...).
A :class:`FailureFact` is the classifier's verdict: category, scope, whether the request may be
resubmitted or moved to another route. Classification depends only on the observation and the
policy; whether a retry is then allowed never renames a failure.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field, StrictBool, ValidationInfo, field_validator

from ledger.domain.validation import HttpStatus, Problem, StrictModel


class Category(StrEnum):
    """What kind of failure a fact is: the classifier's verdict, named in policy files."""

    AUTH = "auth"
    BILLING = "billing"
    RATE_LIMIT = "rate_limit"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    MODEL_NOT_FOUND = "model_not_found"
    FORMAT = "format"
    CONTEXT_OVERFLOW = "context_overflow"
    CONTENT_POLICY = "content_policy"
    SESSION_EXPIRED = "session_expired"
    SERVER_ERROR = "server_error"
    NETWORK = "network"
    DNS = "dns"
    TLS = "tls"
    CANCELLED = "cancelled"
    BUDGET_EXCEEDED = "budget_exceeded"
    LOCAL_RATE_LIMIT = "local_rate_limit"
    UNKNOWN = "unknown"
    # The route cannot be used at all (no credential, unusable endpoint, a request that cannot
    # be encoded): a configuration problem found before anything was sent.
    UNUSABLE = "unusable"


class Transport(StrEnum):
    """Transport-level failure kinds an adapter (or a host) can report."""

    DNS_FAILURE = "dns_failure"
    CONNECT_REFUSED = "connect_refused"
    CONNECTION_RESET = "connection_reset"
    CONNECT_TIMEOUT = "connect_timeout"
    READ_TIMEOUT = "read_timeout"
    TLS_ERROR = "tls_error"
    STREAM_CUT = "stream_cut"
    STREAM_STALL = "stream_stall"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    PROTOCOL_ERROR = "protocol_error"
    MALFORMED_EVENT = "malformed_event"
    # The call's own total deadline (policy.streaming.total_timeout_s) ran out; the phase says how
    # far the request had got.
    TOTAL_TIMEOUT = "total_timeout"
    # The request could not even be built (see Category.UNUSABLE); nothing left the process.
    CANNOT_BUILD = "cannot_build"


class Phase(StrEnum):
    """How far the request got. It decides what may happen next."""

    BEFORE_SEND = "before_send"  # nothing left the process / no byte reached the peer
    AFTER_SEND = "after_send"  # sent, no response bytes: execution unknown
    AFTER_HEADERS = "after_headers"  # the provider answered with a status
    MID_STREAM = "mid_stream"  # a stream was under way


class Scope(StrEnum):
    """The failure domain a fact establishes."""

    REQUEST = "request"
    ROUTE = "route"
    GROUP = "group"


class Source(StrEnum):
    """Who produced a failure: the provider, or the local side (the adapter, the ledger)."""

    PROVIDER = "provider"
    LOCAL = "local"


class WireProtocol(StrEnum):
    """The wire protocol a route speaks; each has a codec in :mod:`ledger.adapters`."""

    OPENAI = "openai"
    # OpenAI's Responses API (``POST /v1/responses``): input items, reasoning items, store=false.
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC = "anthropic"
    GEMINI = "gemini"
    GENERIC = "generic"


class CooldownEffect(StrEnum):
    """What a failure does to its health key: nothing, a cooldown, or disabling it."""

    NONE = "none"
    COOLDOWN = "cooldown"
    DISABLE = "disable"


_DEFAULT_PHASE: dict[Transport, Phase] = {
    Transport.DNS_FAILURE: Phase.BEFORE_SEND,
    Transport.CONNECT_REFUSED: Phase.BEFORE_SEND,
    Transport.CONNECT_TIMEOUT: Phase.BEFORE_SEND,
    Transport.TLS_ERROR: Phase.BEFORE_SEND,
    Transport.CANNOT_BUILD: Phase.BEFORE_SEND,
    Transport.CONNECTION_RESET: Phase.AFTER_SEND,
    Transport.READ_TIMEOUT: Phase.AFTER_SEND,
    Transport.FIRST_TOKEN_TIMEOUT: Phase.AFTER_SEND,
    Transport.PROTOCOL_ERROR: Phase.AFTER_SEND,
    Transport.STREAM_CUT: Phase.MID_STREAM,
    Transport.STREAM_STALL: Phase.MID_STREAM,
    Transport.MALFORMED_EVENT: Phase.MID_STREAM,
}


def _accepted_status(accepted: bool, info: ValidationInfo) -> bool:
    status = info.data.get("status")
    if accepted and status is not None and not 200 <= status < 300:
        raise Problem(f"accepted=True with status {status}: a provider that answered with an "
                      "error status did not accept the request",
                      "pass accepted=True only when the status was 2xx (or is not known)")
    return accepted


class Observation(StrictModel):
    """Raw evidence about one failed call. Every field is optional.

    ``status`` is an integer 0 to 999 (the three digits of a status line); the texts are evidence
    only, unbounded here (the classifier caps and redacts what it keeps). ``accepted``: the
    provider accepted the request (a 2xx status) before the failure, which it then reported in
    its answer (an ``incomplete`` Responses answer, an error object in a 2xx body or stream):
    it ran the call, so a failure without reported usage posts the whole hold rather than
    nothing (:func:`ledger.decide.settle.settle_holds`). The built-in adapters set it for every
    failure after a 2xx status; a host that calls the provider itself sets it likewise.
    """

    status: HttpStatus | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    body: str | bytes | None = None
    protocol: WireProtocol = WireProtocol.GENERIC
    provider: str | None = None
    message: str | None = None
    transport: Transport | None = None
    phase: Phase | None = None
    source: Source = Source.PROVIDER
    effective_output: StrictBool = False
    tool_started: StrictBool = False
    cancelled: StrictBool = False
    over_token_budget: StrictBool = False
    accepted: StrictBool = False

    _accepted = field_validator("accepted")(_accepted_status)

    def effective_phase(self) -> Phase:
        """The phase, defaulted from the transport kind or the presence of a status."""
        if self.phase is not None:
            return self.phase
        if self.transport is not None:
            return _DEFAULT_PHASE.get(self.transport, Phase.AFTER_SEND)
        if self.status is not None:
            return Phase.AFTER_HEADERS
        return Phase.BEFORE_SEND

    def header(self, name: str) -> str | None:
        """Case-insensitive header lookup."""
        low = name.lower()
        for k, v in self.headers.items():
            if k.lower() == low:
                return v
        return None


class FailureFact(StrictModel):
    """The structured classification of an observed failure.

    ``status`` is an integer 0 to 999; ``retry_after_s`` a finite number of seconds >= 0.
    ``accepted`` is the observation's (the provider accepted the request before it reported
    the failure): it decides what a failed Attempt without reported usage posts.
    """

    category: Category
    status: HttpStatus | None = None
    provider_code: str | None = None
    phase: Phase
    scope: Scope = Scope.REQUEST
    transport: Transport | None = None
    source: Source = Source.PROVIDER
    # Finite and non-negative: an infinite hint would close a group for ever.
    retry_after_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    resubmit: StrictBool = False
    moves_on: StrictBool = False
    cooldown: CooldownEffect = CooldownEffect.NONE
    effective_output: StrictBool = False
    tool_started: StrictBool = False
    provider: str | None = None
    message: str | None = None  # short, redacted; evidence only, never used for decisions
    accepted: StrictBool = False

    _accepted = field_validator("accepted")(_accepted_status)

    def to_json(self) -> dict[str, Any]:
        """The fact as JSON data (what the ledger stores with the Attempt).

        ``accepted`` is written only when it is true.
        """
        data = self.model_dump(mode="json")
        if not self.accepted:
            # Facts from before the field existed stay as they were stored and hashed: their
            # settle hashes still match a repeated settle, and the settle rule, which the audit
            # and reconcile read off the stored text, reads them as it did when they posted.
            del data["accepted"]
        return data


__all__ = [
    "Category",
    "CooldownEffect",
    "FailureFact",
    "Observation",
    "Phase",
    "Scope",
    "Source",
    "Transport",
    "WireProtocol",
]
