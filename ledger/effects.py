"""What settling an Attempt does to route/profile health and to its capacity group (pure).

The settle transaction applies these values; computing them is pure so it is tested without a
database and shared by every caller of settle.
"""

from __future__ import annotations

from collections.abc import Mapping

from ledger.core.facts import Category, FailureFact, Scope, Source
from ledger.core.health import health_key, record_failure, record_success
from ledger.model import GroupMode, Route
from ledger.policy.model import Policy
from ledger.records import Outcome
from ledger.storage.specs import GroupUpdate, HealthUpdate


def health_keys(policy: Policy, route: Route, profile_id: str | None) -> list[tuple[str, str]]:
    """The key whose health one attempt touches: its profile where the policy keys health by
    profile (fased), else its route."""
    key = health_key(route.id, profile_id, policy)
    return [(key, "profile" if key != route.id else "route")]


def health_updates(
    policy: Policy,
    route: Route,
    profile_id: str | None,
    outcome: Outcome,
    fact: FailureFact | None,
    now: float,
) -> Mapping[str, tuple[str, str | None, HealthUpdate]]:
    """Health updaters for the settle transaction, keyed by route id / profile id."""
    out: dict[str, tuple[str, str | None, HealthUpdate]] = {}
    update = _health_update(policy, route, outcome, fact, now)
    if update is None:
        return out
    for key, kind in health_keys(policy, route, profile_id):
        out[key] = (kind, route.provider, update)
    return out


def _health_update(policy: Policy, route: Route, outcome: Outcome, fact: FailureFact | None,
                   now: float) -> HealthUpdate | None:
    if outcome is Outcome.SUCCEEDED:
        return lambda h: record_success(h, now=now, policy=policy)
    if fact is not None:  # failed, or unknown with an observed fact (a timeout after send)
        category: Category = fact.category
        return lambda h: record_failure(h, category, provider=route.provider, now=now,
                                        policy=policy)
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
        return GroupUpdate(GroupMode.COOLDOWN, now + wait, "provider_429")
    return None
