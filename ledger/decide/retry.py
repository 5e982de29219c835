"""Same-route retries: whether to ask the same route again before moving on, and after how long.

The rules are ``policy.same_route_retry``; the first rule matching the fact's category or
transport applies. Jitter comes from an injected :class:`random.Random`, so a test can replay a
decision exactly. A retry is a resubmission, so a fact that may not be resubmitted (a started
tool, kept output, unknown execution under a strict policy) is never retried.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ledger.domain.facts import FailureFact
from ledger.policy.model import Policy, RetryRule


@dataclass(frozen=True)
class RetryDecision:
    """Whether to retry on the same route, after ``delay_s``; ``reason`` says why (not).

    ``reason`` is ``retry``, ``retry_after`` (the provider's longer hint is waited exactly),
    ``exhausted``, ``no_rule``, ``tool_started``, ``not_resubmittable`` or
    ``retry_after_exceeds_cap``.
    """

    retry: bool
    delay_s: float | None
    reason: str


def _rule_for(fact: FailureFact, policy: Policy) -> RetryRule | None:
    for rule in policy.same_route_retry:
        if fact.category in rule.categories:
            return rule
        if fact.transport is not None and fact.transport in rule.transports:
            return rule
    return None


def _hint(fact: FailureFact, rule: RetryRule) -> float | None:
    return fact.retry_after_s if rule.honor_retry_after else None


def _hint_too_long(hint: float | None, rule: RetryRule) -> bool:
    return hint is not None and rule.retry_after_cap_s is not None and hint > rule.retry_after_cap_s


def _refusal(fact: FailureFact, policy: Policy) -> tuple[RetryRule | None, str | None]:
    """The applicable rule, or why no same-route retry is possible at all."""
    if fact.tool_started:
        return None, "tool_started"
    if not fact.resubmit:
        return None, "not_resubmittable"
    rule = _rule_for(fact, policy)
    if rule is None or rule.max == 0:
        return None, "no_rule"
    if _hint_too_long(_hint(fact, rule), rule):
        return None, "retry_after_exceeds_cap"
    return rule, None


def retry_decision(
    fact: FailureFact, policy: Policy, retries_done: int, rng: random.Random
) -> RetryDecision:
    """Whether to retry ``fact`` on the same route after ``retries_done`` retries, and the wait.

    The wait is the nominal delay of this retry, jittered uniformly within +- jitter, but never
    shorter than the provider's hint; a hint longer than the nominal delay is waited exactly.
    """
    rule, why = _refusal(fact, policy)
    if rule is None:
        return RetryDecision(retry=False, delay_s=None, reason=why or "no_rule")
    if retries_done >= rule.max:
        return RetryDecision(retry=False, delay_s=None, reason="exhausted")
    nominal = rule.delays_s[max(retries_done, 0)]
    hint = _hint(fact, rule)
    if hint is not None and hint > nominal:
        return RetryDecision(retry=True, delay_s=hint, reason="retry_after")
    wait = nominal * (1.0 + rule.jitter * rng.uniform(-1.0, 1.0)) if rule.jitter else nominal
    # Rounding in the jitter arithmetic must not step outside the nominal band.
    wait = min(max(wait, nominal * (1.0 - rule.jitter)), nominal * (1.0 + rule.jitter))
    if hint is not None:
        wait = max(wait, hint)
    return RetryDecision(retry=True, delay_s=wait, reason="retry")


__all__ = ["RetryDecision", "retry_decision"]
