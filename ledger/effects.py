"""What settling an Attempt does to route/profile health and to its capacity group (pure).

The settle transaction applies these values; computing them is pure so it is tested without a
database and shared by every caller of settle.
"""

from __future__ import annotations

from collections.abc import Mapping

from ledger.core.facts import Category, FailureFact, Scope, Source
from ledger.core.health import record_failure, record_success
from ledger.model import GroupMode, Health, Route
from ledger.policy.model import Policy
from ledger.records import Outcome
from ledger.storage.store import GroupUpdate, HealthUpdate


def health_keys(route: Route, profile_id: str | None) -> list[tuple[str, str]]:
    """The keys whose health one attempt touches: the route, and its profile if any."""
    keys = [(route.id, "route")]
    if profile_id:
        keys.append((profile_id, "profile"))
    return keys


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
    for key, kind in health_keys(route, profile_id):
        if outcome is Outcome.SUCCEEDED:
            def upd(h: Health) -> Health:
                return record_success(h, now=now, policy=policy)
        elif outcome is Outcome.FAILED and fact is not None:
            category = fact.category

            def upd(h: Health, category: Category = category) -> Health:
                return record_failure(h, category, provider=route.provider, now=now,
                                      policy=policy)
        else:
            continue
        out[key] = (kind, route.provider, upd)
    return out


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
