"""What settling an Attempt does (pure): its outcome, its hash, and its effects.

The effects are on the holds, on route/profile health and on the capacity group.

:func:`settle_spec` decides everything a settle writes from the Run's frozen policy and route;
the settle transaction applies it (and :func:`settle_holds` to the Attempt as locked). Computing
it is pure so it is tested without a database and shared by every caller of settle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.decide.classify import classify
from ledger.decide.health import (
    health_key,
    key_kind,
    record_failure,
    record_repeat,
    record_success,
)
from ledger.domain.facts import (
    Category,
    FailureFact,
    Observation,
    Phase,
    Scope,
    Source,
    Transport,
)
from ledger.domain.records import DebitState, Lease, Outcome
from ledger.domain.specs import GroupUpdate, HealthUpdate, SettleSpec
from ledger.domain.values import GroupMode, Route, content_hash
from ledger.errors import InvalidArgument
from ledger.policy.model import Policy


def health_keys(policy: Policy, route: Route, profile_id: str | None) -> list[tuple[str, str]]:
    """The key whose health one attempt touches, with its kind.

    Its profile where the policy keys health by profile (fased), its provider's shared key where
    it keys health by provider (goclaw), else its route.
    """
    key = health_key(route, profile_id, policy)
    return [(key, key_kind(route, key, policy))]


def health_updates(
    policy: Policy,
    route: Route,
    profile_id: str | None,
    outcome: Outcome,
    fact: FailureFact | None,
    now: float,
    *,
    repeat: bool = False,
    began_at: float | None = None,
) -> Mapping[str, tuple[str, str | None, HealthUpdate]]:
    """Health updaters for the settle transaction, keyed by health key.

    ``repeat``: the Attempt was a same-route retry of a failure this request already counted;
    its failure restarts the key's window instead of counting again (``record_repeat``).
    ``began_at``: when the Attempt began; a failure of one begun before the failure that
    counted the key's outage (``Health.counted_at``) was in flight through that outage, and
    its success is evidence from before it (``health.count_overlapping_failures``). ``None``:
    not known, counted (a failure) or clearing (a success) as every outcome does.
    """
    out: dict[str, tuple[str, str | None, HealthUpdate]] = {}
    update = _health_update(policy, route, outcome, fact, now, repeat, began_at)
    if update is None:
        return out
    for key, kind in health_keys(policy, route, profile_id):
        out[key] = (kind, route.provider, update)
    return out


# Failures that say nothing about the route's health: the caller cancelled, or our own
# configuration could not build the request (no key, bad endpoint).
_NOT_ABOUT_THE_ROUTE = frozenset({Category.CANCELLED, Category.UNUSABLE})


def _health_update(policy: Policy, route: Route, outcome: Outcome, fact: FailureFact | None,
                   now: float, repeat: bool, began_at: float | None) -> HealthUpdate | None:
    if outcome is Outcome.SUCCEEDED:
        return lambda h: record_success(h, now=now, policy=policy, began_at=began_at)
    if fact is not None and fact.category not in _NOT_ABOUT_THE_ROUTE:
        # failed, or unknown with an observed fact (a timeout after send)
        category: Category = fact.category
        record = record_repeat if repeat else record_failure
        return lambda h: record(h, category, provider=route.provider, now=now, policy=policy,
                                began_at=began_at)
    return None  # unknown without a fact: nothing was observed about the route's health


def group_update(policy: Policy, fact: FailureFact | None, now: float) -> GroupUpdate | None:
    """A trusted provider 429 establishes a group cooldown with a waiting floor."""
    if fact is None or not policy.admission.trust_provider_429:
        return None
    if (fact.category is Category.RATE_LIMIT and fact.source is Source.PROVIDER
            and fact.status == 429 and fact.scope is Scope.GROUP):
        wait = fact.retry_after_s
        if wait is None or wait <= 0:
            wait = policy.admission.default_group_cooldown_s
        # A hint is capped by the policy however it arrived (a host-built fact is not clamped
        # by the classifier): one response never closes a group for longer.
        wait = min(wait, policy.classification.retry_after_limit_s)
        return GroupUpdate(GroupMode.COOLDOWN, now + wait, "provider_429")
    return None


# Transport kinds that say the answer stopped arriving (the connection broke, the stream was cut
# or stalled, a time limit ran out, the framing broke), not what the provider answered.
_ANSWER_LOST = frozenset({
    Transport.CONNECTION_RESET, Transport.READ_TIMEOUT, Transport.STREAM_CUT,
    Transport.STREAM_STALL, Transport.FIRST_TOKEN_TIMEOUT, Transport.PROTOCOL_ERROR,
    Transport.TOTAL_TIMEOUT,
})


def failure_outcome(fact: FailureFact, sent: bool) -> Outcome:
    """The outcome a failed send is recorded with: how far it got, and what ended it.

    * it never left (``sent`` is False, or the phase is ``before_send``): ``not_sent``, the hold
      voided;
    * it left and no verdict came back: no status at all (a reset or a timeout before the
      response), the answer stopped arriving mid-stream (a cut, a stall, a time limit, broken
      framing), or the provider accepted it (a 2xx) and then sent nothing before a time limit
      (the first token never came) — ``unknown``: the provider may have run it to the end and
      billed it, so the hold stays until a receipt settles it (``Ledger.settle_unknown``);
    * the provider answered with an error (a status, an error object or event, a payload that
      is not the protocol's): ``failed``, posted at the reported cost.
    """
    if not sent or fact.phase is Phase.BEFORE_SEND:
        return Outcome.NOT_SENT
    if fact.phase in (Phase.AFTER_SEND, Phase.MID_STREAM) and (
            fact.status is None or fact.transport in _ANSWER_LOST):
        return Outcome.UNKNOWN
    if (fact.phase is Phase.AFTER_HEADERS and fact.transport in _ANSWER_LOST
            and (fact.status is None or 200 <= fact.status < 300)):
        return Outcome.UNKNOWN  # accepted, then silent: it may be running all the same
    return Outcome.FAILED


def settle_spec(policy: Policy, route: Route, profile_id: str | None, lease: Lease,
                attempt_id: str, *, outcome: Outcome, fact: FailureFact | None,
                observation: Observation | None, now: float,
                effective_output: bool | None, tool_started: bool | None,
                prompt_tokens: int | None, completion_tokens: int | None,
                cost_micros: int | None, model_reported: str | None, output_hash: str | None,
                events: Sequence[tuple[str, dict[str, Any]]], provenance: tuple[str, ...],
                repeat: bool, cached_tokens: int | None = None,
                reasoning_tokens: int | None = None, first_byte_s: float | None = None,
                first_token_s: float | None = None,
                began_at: float | None = None, keep_profile: bool = False) -> SettleSpec:
    """Everything one settle of an Attempt on ``route`` (with ``profile_id``) writes.

    * a failed outcome needs a ``fact``, or an ``observation`` that is classified under the
      Run's policy; a succeeded one carries neither (else
      :class:`~ledger.errors.InvalidArgument`, field ``fact``);
    * a failure whose phase is ``before_send`` never left the process: it is recorded as
      ``not_sent``, and a bare ``not_sent`` (no fact) says nothing about the route's health;
    * ``effective_output`` and ``tool_started`` default to the fact's;
    * the settle hash covers what was reported, so a repeated settle of the same receipt is the
      same write and a different one a :class:`~ledger.errors.SettleConflict`; the times to the
      first byte and first token are measurements of the send, not part of the receipt, and
      stay out of it;
    * health changes come from :func:`health_updates` (``began_at``: when the Attempt began, as
      there) and a failed outcome's group fact from :func:`group_update`;
    * ``keep_profile`` (a success only): the Run keeps its current profile, which is the session's
      user pin (:func:`ledger.decide.profiles.keeps_pinned_profile`), and records only the route
      that served.
    """
    if outcome is Outcome.FAILED and fact is None:
        if observation is None:
            raise InvalidArgument(
                "a failed outcome needs a fact or an observation to classify", field="fact")
        fact = classify(observation, policy, now=now)
    if outcome is Outcome.SUCCEEDED and (fact is not None or observation is not None):
        raise InvalidArgument("a succeeded outcome carries no failure fact", field="fact")
    if outcome is Outcome.FAILED and fact is not None and fact.phase is Phase.BEFORE_SEND:
        outcome = Outcome.NOT_SENT  # it never left: the truth is "not sent"
    eff = bool(effective_output if effective_output is not None
               else (fact.effective_output if fact else False))
    tool = bool(tool_started if tool_started is not None
                else (fact.tool_started if fact else False))
    settled: dict[str, Any] = {
        "outcome": outcome.value,
        "fact": fact.to_json() if fact else None,
        "tokens": [prompt_tokens, completion_tokens],
        "cost": cost_micros, "eff": eff, "tool": tool, "model": model_reported,
        "output": output_hash,
    }
    if provenance:  # only then: settles recorded before output parts existed hash as they did
        settled["parts"] = list(provenance)
    if cached_tokens is not None or reasoning_tokens is not None:  # likewise
        settled["token_details"] = [cached_tokens, reasoning_tokens]
    health = ({} if outcome is Outcome.NOT_SENT and fact is None
              else health_updates(policy, route, profile_id, outcome, fact, now, repeat=repeat,
                                began_at=began_at))
    return SettleSpec(
        attempt_id=attempt_id, fence=lease.fence, outcome=outcome, fact=fact,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        cost_micros=cost_micros, effective_output=eff, tool_started=tool,
        model_reported=model_reported, output_hash=output_hash,
        settle_hash=content_hash(settled), health=health,
        group_update=group_update(policy, fact, now) if outcome is Outcome.FAILED else None,
        events=events, provenance=provenance, cached_tokens=cached_tokens,
        reasoning_tokens=reasoning_tokens, first_byte_s=first_byte_s,
        first_token_s=first_token_s,
        keep_profile=keep_profile and outcome is Outcome.SUCCEEDED,
    )


@dataclass(frozen=True)
class Holds:
    """What one settle does to an Attempt's cost and token holds."""

    debit: DebitState  # the debit's state after the settle
    posted_micros: int  # posted to the Run's spend (0 unless posted)
    release_micros: int  # taken off the Run's reserved total
    tokens_used: int  # added to the Run's used tokens
    release_tokens: int  # taken off the Run's held tokens
    uncount_call: bool  # the Attempt gives its model call back (it never left)


def settle_holds(outcome: Outcome, fact: FailureFact | None, *, cost_micros: int | None,
                 tokens: int | None, reserved_micros: int, reserved_tokens: int,
                 token_budget: bool) -> Holds:
    """The holds' fate, from the outcome and what the provider reported.

    * unknown: both holds stay (the provider may bill it; invariant 6);
    * not sent: both holds are voided and the call is given back;
    * succeeded, or failed after the request left: posted at the reported cost and tokens, at
      most the hold (the budget invariant; the true cost and tokens stay on the Attempt; tokens
      are capped only where the Run has a token budget) — when nothing was reported, the whole
      hold is posted, never zero;
    * failed with the provider's own error status or error body (phase after_headers) and no
      usage: nothing was generated, so nothing is posted. A whole 2xx body that is not the
      protocol's (transport ``malformed_event``) is not such a verdict: the provider ran the
      call and may bill it, so the whole hold is posted. Nor is a failure the provider reported
      inside a 2xx answer (the fact is ``accepted``: an ``incomplete`` Responses answer, an
      error object in a 2xx body): it ran the call, so the whole hold is posted, as for the
      same answer streamed (phase mid_stream).
    """
    if outcome is Outcome.UNKNOWN:
        return Holds(DebitState.RESERVED, 0, 0, 0, 0, False)
    if outcome is Outcome.NOT_SENT:
        return Holds(DebitState.VOIDED, 0, reserved_micros, 0, reserved_tokens, True)
    # Keyed on ``accepted``, not on a 2xx status: facts settled before the field existed posted
    # nothing for a 2xx answered failure, and the audit and reconcile read this rule off them.
    answered_error = (outcome is Outcome.FAILED and fact is not None
                      and fact.phase is Phase.AFTER_HEADERS
                      and fact.transport is not Transport.MALFORMED_EVENT
                      and not fact.accepted)
    if cost_micros is None:
        cost_micros = 0 if answered_error else reserved_micros
    if tokens is None:
        tokens = 0 if answered_error else reserved_tokens
    if token_budget:
        tokens = min(tokens, reserved_tokens)
    return Holds(DebitState.POSTED, min(cost_micros, reserved_micros), reserved_micros,
                 tokens, reserved_tokens, False)


def check_lease_ttl(ttl_s: float, margin_s: float, *, field: str, fix: str) -> None:
    """Refuse a lease of ``ttl_s`` no longer than the lease margin.

    Such a lease could start nothing (:func:`lease_problem` counts it expired at once).
    ``field`` and ``fix`` name the argument and what to pass.

    Raises:
        InvalidArgument: ``ttl_s`` is not above ``margin_s``.
    """
    if ttl_s <= margin_s:
        raise InvalidArgument(
            f"{field}={ttl_s:g} is not above the lease margin ({margin_s:g}s): such a lease "
            f"could start nothing; {fix}", field=field)


def lease_problem(holder: str | None, expires_at: float | None, executor: str, now: float,
                  margin_s: float) -> str | None:
    """Why a lease (of the current fence, held by ``executor``) is not live, or ``None``.

    ``released``: nobody holds the run; ``holder``: someone else does; ``expired``: it ends
    within ``margin_s`` of ``now`` (the margin absorbs clock skew between hosts and the time
    between this check and the commit).
    """
    if holder is None:
        return "released"
    if holder != executor:
        return "holder"
    if expires_at is None or expires_at - margin_s <= now:
        return "expired"
    return None
