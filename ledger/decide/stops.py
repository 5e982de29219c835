"""How a turn tells its failures and its stop: the texts and typed errors, pure.

A failed Attempt's error names its category, status and the provider's code and message
(:func:`failure_text`); a stop's :class:`~ledger.errors.FailoverExhausted` holds one line per
candidate of the plan (:func:`candidate_lines`): what became of its Attempts, why it was
skipped, or that it was not tried; a wait in a full group's queue that reached its bound is a
:class:`~ledger.errors.CapacityUnavailable` (:func:`queue_timeout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ledger.decide.effects import Begin, RecordedTurn
from ledger.decide.select import Skip
from ledger.domain.facts import FailureFact
from ledger.domain.records import AttemptRecord, AttemptState, Queued
from ledger.domain.timefmt import duration, iso, relative
from ledger.domain.values import Route
from ledger.errors import CandidateSkipped, CapacityUnavailable, ProviderError
from ledger.policy.model import Policy
from ledger.redaction import redact


def reopening_note(at: float | None, bound: float | None, now: float | None) -> str:
    """Why a stop did not wait for the first candidate that reopens, when one does."""
    if at is None or now is None:
        return ""
    note = f"; the first candidate reopens at {iso(at)} ({relative(at, now)})"
    if bound is not None:
        note += f", beyond what this turn may wait ({duration(bound)}, " \
                "admission.max_capacity_wait_s, or the Run's deadline)"
    return note


def skipped_error(skip: Skip) -> CandidateSkipped:
    """The typed error a stop holds for a candidate it passed over and never tried."""
    fix = f" — fix: {skip.fix}" if skip.fix else ""
    return CandidateSkipped(
        f"route {skip.route!r} skipped ({skip.reason.value}): {skip.detail}{fix}",
        route=skip.route, reason=skip.reason.value, detail=skip.detail, fix=skip.fix,
        profile=skip.profile)


def failures_by_route(errors: Sequence[Exception], states: Mapping[str, AttemptState]
                       ) -> dict[str, list[str]]:
    """What became of each candidate's Attempts, each said as it ended (skips are not here).

    ``errors`` are the turn's errors, ``states`` its Attempts' states by id.

    An operator reads "failed" as "over, nothing owed": an unknown Attempt may have run and
    keeps its hold, and a refusal at the begin (a full or closed group, the budget) or a
    connection that never carried the request never left.
    """
    out: dict[str, list[str]] = {}
    for e in errors:
        route = getattr(e, "route", None)
        if route is None or isinstance(e, CandidateSkipped):
            continue
        attempt = getattr(e, "attempt_id", None)
        state = states.get(attempt or "")
        if not isinstance(e, ProviderError) or state is AttemptState.NOT_SENT:
            said = f"not sent: {e}"
        elif state is AttemptState.UNKNOWN:
            said = f"unknown (may have run; hold kept): {e}"
        elif state is AttemptState.DISPATCHING:  # only in a turn read back from its records
            said = f"in flight (sent; hold kept): {e}"
        else:
            said = f"failed: {e}"
        out.setdefault(route, []).append(
            said + (f" [attempt {attempt}]" if attempt and isinstance(e, ProviderError)
                    else ""))
    return out


def candidate_lines(plan: Sequence[Route], failures: Mapping[str, Sequence[str]],
                    skips: Mapping[str, Skip]) -> list[str]:
    """One line per candidate of the plan: what became of it, why it was skipped, or untried.

    ``failures`` gives each tried route's outcomes in order, each already saying how it ended
    (``failed: ...``, ``unknown (may have run; hold kept): ...``, ``not sent: ...``), ``skips``
    each route's latest skip (the stop's message, its ``stop`` event and ``run show`` say these
    lines).
    """
    lines = []
    for r in plan:
        if failures.get(r.id):
            lines.append(f"{r.id}: " + "; then ".join(failures[r.id]))
        elif r.id in skips:
            # A route never sent to may still be ruled out as tried (its every profile failed
            # on another route): "not tried" would hide why the turn could not use it.
            skip = skips[r.id]
            fix = f" — fix: {skip.fix}" if skip.fix else ""
            lines.append(f"{r.id}: skipped ({skip.reason.value}): {skip.detail}{fix}")
        else:
            lines.append(f"{r.id}: not tried (the turn stopped first)")
    return lines


def attempt_error(attempt_id: str, route: str, provider: str, model: str,
                  fact: FailureFact) -> ProviderError:
    """The error of an Attempt that gave no answer, as a turn holds it and a stop names it."""
    return ProviderError(f"{provider}/{model}: {failure_text(fact)}", attempt_id=attempt_id,
                         route=route, fact=fact)


def recorded_candidate_lines(plan: Sequence[Route], turn: RecordedTurn) -> list[str]:
    """:func:`candidate_lines` of a turn from what it recorded, as its own stop said them.

    A turn asked again while an Attempt of it has no receipt stops before deciding anything:
    its stop names the candidates from the first call's Attempts (their facts and states) and
    the skips its decisions recorded, by the same rules, so an operator reading either stop
    (or a process that crashed before the first could stop) sees why each candidate was left.
    A begin that admission refused names only its reason here (its message was not recorded).
    """
    errors: list[Exception] = []
    for a in turn.attempts:
        if a.fact is not None:
            errors.append(attempt_error(a.attempt_id, a.route_id, a.provider, a.model, a.fact))
        elif a.state in (AttemptState.UNKNOWN, AttemptState.DISPATCHING):
            # Left by a process that never settled it (recovery made it unknown, or it is
            # still in flight): sent, with nothing known of how it ended.
            errors.append(ProviderError(f"{a.provider}/{a.model}: no receipt",
                                        attempt_id=a.attempt_id, route=a.route_id))
        elif a.reject_reason is not None:
            errors.append(CapacityUnavailable(
                f"admission refused the begin ({a.reject_reason}); nothing was sent",
                route=a.route_id, reason=a.reject_reason))
    skips: dict[str, Skip] = {}
    for decision in turn.skipped:
        for s in decision:
            skips[s["route"]] = Skip.from_json(s)
    states = {a.attempt_id: a.state for a in turn.attempts}
    return candidate_lines(plan, failures_by_route(errors, states), skips)


def queue_timeout(begin: Begin, first: Queued, last: Queued, policy: Policy
                   ) -> CapacityUnavailable:
    """The error of a wait in a full group's queue that reached its bound."""
    waited = last.now - first.since
    bound = policy.admission.max_capacity_wait_s
    return CapacityUnavailable(
        f"capacity group {first.group!r} stayed full (limit {last.limit}: {last.in_flight} in "
        f"flight, {last.ahead} waiting ahead) for the {duration(waited)} this turn could wait "
        f"(admission.max_capacity_wait_s {duration(bound)}, or the Run's deadline); nothing "
        "was sent", group=first.group, limit=last.limit, waited_s=round(waited, 6),
        reason="capacity_full", queued=True, route=begin.route.id)


def rejected_record(begin: Begin, e: CapacityUnavailable, now: float) -> AttemptRecord:
    """The rejected Attempt as admission recorded it (no read back needed)."""
    return AttemptRecord(
        attempt_id=begin.attempt_id, run_id=begin.spec.run_id, turn_id=begin.turn_id,
        seq=int(e.fields.get("seq") or 0),
        kind=begin.kind, route_id=begin.route.id, provider=begin.route.provider,
        model=begin.route.model, group_id=begin.route.group, profile_id=begin.profile_id,
        debit_id="d-" + begin.attempt_id, envelope_hash=begin.spec.envelope_hash,
        state=AttemptState.REJECTED, reject_reason=str(e.fields.get("reason")), fact=None,
        category=None, http_status=None, effective_output=False, tool_started=False,
        prompt_tokens=None, completion_tokens=None, cost=None, reserved=begin.reserve,
        reserved_tokens=0, model_reported=None, output_hash=None, fence=begin.spec.fence,
        executor=begin.spec.executor, created_at=now, settled_at=now)


#: How much of a provider's text :func:`provider_text` redacts: its 200 characters kept and a
#: margin longer than any credential the redaction knows, so one that straddles the cut is
#: still matched whole.
_REDACTED_HEAD = 2200


def provider_text(text: str | None) -> str | None:
    """A provider's text as stored and told: redacted, printable, at most 200 characters."""
    # Printable: both backends store it alike. Redacted before it is cut: a secret straddling
    # the cut would leave its head unmatched. Redacted over a head with room for any key past
    # the cut, not the whole text: a provider's text may be megabytes (a 16 MiB tool-call id
    # took seconds to redact, on the event loop of an async turn).
    if text is None:
        return None
    return "".join(c if c.isprintable() else "?" for c in redact(text[:_REDACTED_HEAD])[:200])


def cause_of(fact: FailureFact) -> dict[str, Any]:
    """A failure as a ``retry`` or ``move`` event names its cause."""
    return {"category": fact.category.value, "status": fact.status, "scope": fact.scope.value,
            "phase": fact.phase.value}


def describe(fact: FailureFact) -> str:
    """A failure in a few words (``503 overloaded``), as the fallback log line says it."""
    return f"{fact.status} {fact.category.value}" if fact.status else fact.category.value


def failover_details(run_id: str, attempt_id: str, route: str, fact: FailureFact, *,
                     to: str | None = None, stop: str | None = None,
                     backoff_s: float = 0.0) -> str:
    """What the ``[fallback]`` log line says of a failover beyond the seed's few words.

    The Run, the Attempt that failed and its route, the failure (category, HTTP status or
    transport kind and phase, the provider's code), the route the turn moves to (``to``) or
    the reason it stops (``stop``), and the backoff it waited before that decision. Ids, route
    ids and codes only: never a prompt, a key or a body (the code is redacted and cut as a
    stop's message says it).
    """
    said = [fact.category.value]
    if fact.status:
        said.append(f"HTTP {fact.status}")
    elif fact.transport is not None:
        said += [fact.transport.value, fact.phase.value]
    if fact.provider_code:
        said.append(f"code {provider_text(fact.provider_code)}")
    then = f"moving to route {to}" if to is not None else f"stopping ({stop})"
    return (f"run {run_id}, attempt {attempt_id} failed on route {route} ({', '.join(said)}), "
            f"{then}, backoff {backoff_s:.1f}s")


def failure_text(fact: FailureFact) -> str:
    """A failure as its error and a stop's message name it, so one log line says why.

    The category, the status (or transport kind and phase) and the provider's code, then what
    was said of it: the provider's message, redacted, at most 200 characters.
    """
    said = [f"HTTP {fact.status}"] if fact.status else []
    if not fact.status and fact.transport is not None:
        said += [fact.transport.value, fact.phase.value]
    if fact.provider_code:
        said.append(f"code {provider_text(fact.provider_code)}")
    text = fact.category.value + (f" ({', '.join(said)})" if said else "")
    message = provider_text(fact.message)
    # The adapter's own note for a body that said nothing ("HTTP 502") would only repeat it.
    if message and message != f"HTTP {fact.status}":
        text += f": {message}"
    return text


__all__ = [
    "attempt_error",
    "candidate_lines",
    "cause_of",
    "describe",
    "failover_details",
    "failure_text",
    "failures_by_route",
    "provider_text",
    "queue_timeout",
    "recorded_candidate_lines",
    "rejected_record",
    "reopening_note",
    "skipped_error",
]
