"""Classification: an :class:`Observation` becomes a :class:`FailureFact` under a policy.

Precedence (the conformance rules, for every preset): caller facts; a local 429; the transport
kind; context overflow; the provider's structured error field (a detail such as Gemini's
``ErrorInfo`` reason before the field it refines); the HTTP status; free-text patterns; else
``unknown``. Which codes, statuses and patterns map where is policy data, and so is one
reordering: ``status_text_first`` lets a status's text rules decide before the structured field.

The retry hint is the longest of ``Retry-After``, ``retry-after-ms``, ``x-ms-retry-after-ms`` and
Gemini's ``RetryInfo``; a wait named only in the message's text is not read.

Every text a fact carries (``message``, ``provider_code``) has been through
:func:`ledger.redaction.redact`; decisions read the unredacted observation.

``classify`` is total: bodies of any bytes, JSON of any shape and headers of any size yield a
fact, never an exception, because losing the record of a failure is worse than a vague one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from ledger.decide.health import cooldown_effect
from ledger.decide.hints import gemini_retry_delay, parse_retry_after, parse_retry_after_ms
from ledger.domain.facts import (
    Category,
    FailureFact,
    Observation,
    Phase,
    Scope,
    Source,
    Transport,
    WireProtocol,
)
from ledger.domain.validation import Problem, Rule, checked, instance
from ledger.policy.model import (
    LEDGER_FACTS,
    ClassificationPolicy,
    FailoverPolicy,
    Policy,
    PolicyArg,
)
from ledger.redaction import redact

# Which structured fields each protocol's error body carries, in the order they are looked up;
# `generic` tries them all. A provider's detail (Anthropic's `error.details.error_code`,
# Gemini's `ErrorInfo.reason`) comes before the coarse field it refines: a spend limit is sent
# as a `rate_limit_error`, a bad Gemini key as `INVALID_ARGUMENT`.
_FIELDS: dict[WireProtocol, tuple[str, ...]] = {
    WireProtocol.OPENAI: ("openai.code", "openai.type"),
    # The Responses API's errors are OpenAI's (error.code, error.type), also in failed events.
    WireProtocol.OPENAI_RESPONSES: ("openai.code", "openai.type"),
    WireProtocol.ANTHROPIC: ("anthropic.error_code", "anthropic.type"),
    WireProtocol.GEMINI: ("gemini.reason", "gemini.status"),
    WireProtocol.GENERIC: ("openai.code", "openai.type", "anthropic.error_code", "anthropic.type",
                           "gemini.reason", "gemini.status"),
}
# The details: the code a fact names when no table knows any field is the coarse one, as before
# details were read (a replay rebuilds the body from it).
_DETAILS = frozenset({"anthropic.error_code", "gemini.reason"})
_CODE_LIMIT = 128


@dataclass(frozen=True)
class _ProviderError:
    """The structured parts of a provider's error body, whatever its shape."""

    fields: Mapping[str, str]
    message: str | None
    retry_delay_s: float | None


def _body_text(body: str | bytes | None, limit: int) -> str:
    if body is None:
        return ""
    if isinstance(body, bytes | bytearray):
        return bytes(body[:limit]).decode("utf-8", errors="replace")
    return body[:limit]


def _short(value: Any) -> str | None:
    return value[:_CODE_LIMIT] if isinstance(value, str) and value else None


def _gemini_reason(err: Mapping[str, Any]) -> str | None:
    """``reason`` of the first ``google.rpc.ErrorInfo`` in a Gemini error's ``details``."""
    details = err.get("details")
    if not isinstance(details, list):
        return None
    for item in details[:64]:
        if isinstance(item, dict):
            kind = item.get("@type")
            if isinstance(kind, str) and kind.endswith("google.rpc.ErrorInfo"):
                return _short(item.get("reason"))
    return None


def _anthropic_error_code(err: Mapping[str, Any]) -> str | None:
    """Anthropic's ``error.details.error_code`` (e.g. ``enforced_spend_limit_reached``)."""
    details = err.get("details")
    return _short(details.get("error_code")) if isinstance(details, dict) else None


def _parse_error(text: str, protocol: WireProtocol) -> _ProviderError:
    empty = _ProviderError({}, None, None)
    if not text.lstrip().startswith(("{", "[")):
        return empty
    try:
        doc: Any = json.loads(text)
    except (ValueError, RecursionError):
        return empty
    # Gemini's streaming endpoints wrap the error object in a one-element list.
    if isinstance(doc, list) and doc and isinstance(doc[0], dict):
        doc = doc[0]
    if not isinstance(doc, dict):
        return empty
    err = doc.get("error")
    if not isinstance(err, dict):
        if protocol in (WireProtocol.GEMINI, WireProtocol.GENERIC):
            return _ProviderError(_gemini_refusal(doc), None, None)
        return empty

    raw = {
        "openai.code": _short(err.get("code")),
        "openai.type": _short(err.get("type")),
        "anthropic.error_code": _anthropic_error_code(err),
        "anthropic.type": _short(err.get("type")),
        "gemini.reason": _gemini_reason(err),
        "gemini.status": _short(err.get("status")),
    }
    fields = {k: v for k in _FIELDS[protocol] if (v := raw[k]) is not None}
    message = err.get("message")
    gemini_like = protocol in (WireProtocol.GEMINI, WireProtocol.GENERIC)
    delay = gemini_retry_delay(err) if gemini_like else None
    return _ProviderError(fields, message if isinstance(message, str) else None, delay)


def _gemini_refusal(doc: Mapping[str, Any]) -> dict[str, str]:
    """A Gemini answer that withheld itself (a 2xx without an ``error`` object): its reason.

    The prompt's ``promptFeedback.blockReason``, else the first candidate's ``finishReason``,
    read as the structured ``gemini.status`` the policy's ``codes.gemini_status`` maps: the
    provider's own word on why, which no error object carries here.
    """
    feedback = doc.get("promptFeedback")
    reason = feedback.get("blockReason") if isinstance(feedback, dict) else None
    if not isinstance(reason, str) or not reason:
        candidates = doc.get("candidates")
        first = candidates[0] if isinstance(candidates, list) and candidates else None
        reason = first.get("finishReason") if isinstance(first, dict) else None
    if isinstance(reason, str) and reason:
        return {"gemini.status": reason[:_CODE_LIMIT]}
    return {}


def _lookup(table: Mapping[str, Category], value: str) -> Category | None:
    v = value.casefold()
    for key, category in table.items():
        if key.casefold() == v:
            return category
    return None


def _any_in(patterns: list[str], haystack: str) -> bool:
    return any(p.casefold() in haystack for p in patterns)


def _context_overflow(cls: ClassificationPolicy, err: _ProviderError, text: str) -> bool:
    msg = (err.message or "").casefold().strip()
    for rule in cls.context_overflow:
        value = err.fields.get(rule.field)
        if value is None or value.casefold() != rule.equals.casefold():
            continue
        if rule.message_starts_with and not msg.startswith(rule.message_starts_with.casefold()):
            continue
        if rule.message_contains and rule.message_contains.casefold() not in msg:
            continue
        return True
    return _any_in(cls.context_overflow_text, text)


def _structured(cls: ClassificationPolicy, err: _ProviderError) -> tuple[Category, str] | None:
    tables = {
        "openai.code": cls.codes.openai_code,
        "openai.type": cls.codes.openai_type,
        "anthropic.error_code": cls.codes.anthropic_error_code,
        "anthropic.type": cls.codes.anthropic_type,
        "gemini.reason": cls.codes.gemini_reason,
        "gemini.status": cls.codes.gemini_status,
    }
    for name, value in err.fields.items():
        found = _lookup(tables[name], value)
        if found is not None:
            return found, value
    return None


def _status_text(cls: ClassificationPolicy, status: int, text: str) -> Category | None:
    for rule in cls.status_text:
        if status in rule.statuses and _any_in(rule.patterns, text):
            return rule.category
    return None


def _by_status(cls: ClassificationPolicy, status: int, text: str) -> Category | None:
    said = _status_text(cls, status, text)
    if said is not None:
        return said
    if status in cls.status:
        return cls.status[status]
    if 400 <= status < 500:
        return cls.status_4xx
    if 500 <= status < 600:
        return cls.status_5xx
    return None


def _category(
    obs: Observation, cls: ClassificationPolicy, err: _ProviderError, text: str
) -> tuple[Category, str | None]:
    if obs.cancelled:
        return Category.CANCELLED, None
    # Our own process could not build the request: a local fact no policy table renames.
    own = LEDGER_FACTS.get(obs.transport) if obs.transport is not None else None
    if own is not None:
        return own, None
    if obs.over_token_budget:
        return Category.BUDGET_EXCEEDED, None
    if obs.source is Source.LOCAL and obs.status == 429:
        return Category.LOCAL_RATE_LIMIT, None
    if obs.transport is not None and obs.transport in cls.transports:
        return cls.transports[obs.transport], None
    if _context_overflow(cls, err, text):
        return Category.CONTEXT_OVERFLOW, None
    if cls.status_text_first and obs.status is not None:
        # The status's own words outrank a coarse code: seed 001's "a 429 that says the model
        # is overloaded" is an overload although its body also says rate_limit_error.
        said = _status_text(cls, obs.status, text)
        if said is not None:
            return said, None
    structured = _structured(cls, err)
    if structured is not None:
        return structured
    if obs.status is not None:
        by_status = _by_status(cls, obs.status, text)
        if by_status is not None:
            return by_status, None
    for rule in cls.text:
        if _any_in(rule.patterns, text):
            return rule.category, None
    return Category.UNKNOWN, None


def _retry_after(
    obs: Observation, err: _ProviderError, cls: ClassificationPolicy, now: float | None
) -> float | None:
    hints = [
        h
        for h in (
            parse_retry_after(obs.header("Retry-After"), now=now, date=obs.header("Date")),
            # OpenAI's and Azure's millisecond forms, which their SDKs read first: Azure OpenAI
            # may send nothing else.
            parse_retry_after_ms(obs.header("retry-after-ms")),
            parse_retry_after_ms(obs.header("x-ms-retry-after-ms")),
            err.retry_delay_s,
        )
        if h is not None and math.isfinite(h) and h >= 0
    ]
    # The longest hint wins: waiting less than any of them would be refused anyway.
    return min(max(hints), cls.retry_after_limit_s) if hints else None


def resubmittable(obs: Observation, phase: Phase, failover: FailoverPolicy) -> bool:
    """Whether this same request may be sent again from the beginning at all."""
    if obs.tool_started:
        return False
    if obs.effective_output and failover.after_effective_output == "stop":
        return False
    unknown = phase in (Phase.AFTER_SEND, Phase.MID_STREAM)
    return not (unknown and not failover.resubmit_unknown_execution)


def _move(policy: Policy, category: Category, phase: Phase,
          transport: Transport | None, status: int | None) -> Scope | None:
    for rule in policy.moves_on:
        if (category in rule.categories and (rule.phases is None or phase in rule.phases)
                and (rule.transports is None or transport in rule.transports)
                and (rule.statuses is None or status in rule.statuses)):
            return rule.scope
    return None


def _clean(text: str) -> str:
    # JSON escapes can carry lone surrogates, which no database encoding accepts.
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _evidence(text: str | None, limit: int, body_limit: int) -> str | None:
    if not text:
        return None
    # Redacted whole, before any cut: a secret cut in half no longer matches anything.
    short = " ".join(redact(_clean(text[:body_limit])).split())
    return short[:limit] or None


ObservationArg = Annotated[Observation, instance(
    Observation, "a ledger.Observation", "pass a ledger.Observation (what the adapter saw)")]


def _finite_now(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Problem("is not a finite time",
                      "pass finite epoch seconds such as clock.now(), or None")
    return float(value)


FiniteTime = Annotated[float, Rule(_finite_now)]
"""``classify``'s ``now``: finite epoch seconds (no range: a ManualClock may run anywhere)."""


@checked
def classify(obs: ObservationArg, policy: PolicyArg,
             now: FiniteTime | None = None) -> FailureFact:
    """The failure fact for ``obs`` under ``policy``.

    Pure: the same observation and policy always give the same fact. Whether a retry is then
    allowed never renames a failure.

    Args:
        obs: What was observed about the failed call (status, headers, body, transport kind,
            phase, ...).
        policy: The policy to classify under (a Run's frozen one: ``Ledger.run_policy``).
        now: Turns an HTTP-date ``Retry-After`` into seconds when the response has no usable
            ``Date`` header (that header, from the provider's clock, is the reference when
            present); with neither the date is not used.

    Returns:
        The :class:`~ledger.FailureFact`: category, scope, phase, whether the request may be
        resubmitted or moved on, the cooldown effect, the retry hint, redacted evidence.

    Raises:
        InvalidArgument: ``obs`` is not an Observation, ``policy`` not a Policy, or ``now``
            not finite epoch seconds.
        ArgumentMismatch: a misspelt keyword (named, with its likely spelling).

    Example:
        >>> from ledger import Observation, classify, preset
        >>> fact = classify(Observation(status=429, headers={"Retry-After": "7"}),
        ...                 preset("goclaw"))
        >>> fact.category.value, fact.retry_after_s
        ('rate_limit', 7.0)
    """
    body = _body_text(obs.body, policy.classification.body_limit_bytes)
    return _fact(obs, policy, body, _parse_error(body, obs.protocol), now)


def _fact(obs: Observation, policy: Policy, body: str, err: _ProviderError,
          now: float | None) -> FailureFact:
    cls = policy.classification
    phase = obs.effective_phase()
    message = obs.message[: cls.body_limit_bytes] if isinstance(obs.message, str) else ""
    text = f"{body}\n{message}".casefold()
    category, code = _category(obs, cls, err, text)
    if code is None and err.fields:
        coarse = [v for k, v in err.fields.items() if k not in _DETAILS]
        code = coarse[0] if coarse else next(iter(err.fields.values()))
    if code is not None:
        code = redact(_clean(code))
    scope = _move(policy, category, phase, obs.transport, obs.status)
    if category is Category.UNUSABLE:
        # A route that cannot be used never ends the request by itself: it is skipped (seed
        # 001: "one that cannot be built (no key) is logged and skipped"), under every policy.
        scope = Scope.ROUTE
    resubmit = resubmittable(obs, phase, policy.failover)
    return FailureFact(
        category=category,
        status=obs.status,
        provider_code=code,
        phase=phase,
        scope=scope if scope is not None else Scope.REQUEST,
        transport=obs.transport,
        source=obs.source,
        retry_after_s=_retry_after(obs, err, cls, now),
        resubmit=resubmit,
        moves_on=scope is not None and resubmit,
        cooldown=cooldown_effect(category, obs.provider, obs.source, policy),
        effective_output=obs.effective_output,
        tool_started=obs.tool_started,
        provider=obs.provider,
        message=_evidence(err.message or message or body, cls.message_limit_chars,
                          cls.body_limit_bytes),
        accepted=obs.accepted,
    )


def _recorded_observation(fact: FailureFact) -> Observation:
    """The observation a recorded fact keeps the structured evidence of."""
    headers = {}
    if fact.retry_after_s is not None:
        headers["Retry-After"] = f"{fact.retry_after_s:.6f}"
    body = None
    if fact.provider_code is not None or fact.message is not None:
        err: dict[str, Any] = {"message": fact.message or ""}
        if fact.provider_code is not None:
            err.update(code=fact.provider_code, type=fact.provider_code,
                       status=fact.provider_code)
        body = json.dumps({"error": err})
    return Observation(
        status=fact.status, headers=headers, body=body, provider=fact.provider,
        message=fact.message, transport=fact.transport, phase=fact.phase, source=fact.source,
        effective_output=fact.effective_output, tool_started=fact.tool_started,
        cancelled=fact.category is Category.CANCELLED,
        over_token_budget=fact.category is Category.BUDGET_EXCEEDED, accepted=fact.accepted)


def reclassify(fact: FailureFact, policy: Policy) -> FailureFact:
    """The fact ``policy`` gives the evidence ``fact`` recorded, decided as :func:`classify` is.

    A fact keeps one provider code (the value a table matched, else the coarse field's) and not
    which field of the body held it, so the code is looked up as every field the generic
    protocol reads, in the live precedence: a detail (Anthropic's ``error.details.error_code``,
    Gemini's ``ErrorInfo`` reason) before the field it refines. A spend limit or a
    ``BILLING_DISABLED`` recorded as its detail is read by ``policy``'s detail tables, as the
    live path read it, not by the coarse status it came with. The status, transport kind,
    phase, source, Retry-After and redacted message are the rest of the evidence.
    """
    obs = _recorded_observation(fact)
    body = _body_text(obs.body, policy.classification.body_limit_bytes)
    err = _parse_error(body, WireProtocol.GENERIC)
    if fact.provider_code is not None:
        err = _ProviderError(dict.fromkeys(_FIELDS[WireProtocol.GENERIC], fact.provider_code),
                             err.message, err.retry_delay_s)
    return _fact(obs, policy, body, err, None)


def refile(fact: FailureFact, policy: Policy) -> FailureFact:
    """``fact`` with its policy-dependent verdict as ``policy`` gives it, its category kept.

    The scope (which candidates a move may go to), whether it may be resubmitted or moved on,
    and what it does to its health key are the policy's; the category, status, phase and the
    evidence are what was observed. A replay uses it where the observation cannot be
    classified again (:mod:`ledger.decide.replay`).
    """
    obs = Observation(status=fact.status, transport=fact.transport, phase=fact.phase,
                      source=fact.source, provider=fact.provider,
                      effective_output=fact.effective_output, tool_started=fact.tool_started)
    scope = _move(policy, fact.category, fact.phase, fact.transport, fact.status)
    if fact.category is Category.UNUSABLE:
        scope = Scope.ROUTE
    resubmit = resubmittable(obs, fact.phase, policy.failover)
    return fact.model_copy(update={
        "scope": scope if scope is not None else Scope.REQUEST, "resubmit": resubmit,
        "moves_on": scope is not None and resubmit,
        "cooldown": cooldown_effect(fact.category, fact.provider, fact.source, policy)})


__all__ = ["classify", "reclassify", "refile", "resubmittable"]
