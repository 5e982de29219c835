"""Health of a route or credential profile: cooldowns, disables, counters, probes.

Pure state machines over the frozen :class:`ledger.domain.values.Health`: every function takes
``now`` and returns a new value. What cools, what disables, how long, and when counters reset
all come from ``policy.health`` and ``policy.probe``; nothing here knows which preset it runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from ledger.domain.facts import Category, CooldownEffect, Source
from ledger.domain.values import Health, Route
from ledger.policy.model import DisableRule, HealthPolicy, Policy

# Beyond this many doublings every curve has long hit its cap; bounding the exponent keeps the
# arithmetic finite for absurd counters.
_MAX_EXPONENT: Final = 1024


#: Prefix of the health key a provider's routes share under ``health.key: provider``.
PROVIDER_KEY_PREFIX = "provider:"


def provider_key(provider: str) -> str:
    """The health key every route of ``provider`` shares under ``health.key: provider``.

    ``provider:`` and the name case-folded: ``OpenAI`` and ``openai`` are one provider, as
    ``health.exempt_providers``, ``base_s_by_provider`` and ``profiles.auth_order`` already
    match them, so a cooldown seen through one spelling darkens every route of the provider.
    Only the key is folded: ``Route.provider`` stays as written, since it is part of a Run's
    frozen plan and its hash.
    """
    return PROVIDER_KEY_PREFIX + provider.casefold()


def canonical_key(key: str) -> str:
    """``key`` as its health row is stored, for a key a host or operator spells.

    A ``provider:<name>`` key with the name folded (:func:`provider_key`), any other as it is.
    """
    if key.startswith(PROVIDER_KEY_PREFIX):
        return provider_key(key[len(PROVIDER_KEY_PREFIX):])
    return key


def route_key(route: Route, policy: Policy) -> str:
    """The key a route's own health is kept under.

    Its id, or :func:`provider_key` where the policy keys health by provider (every route of
    that provider, however its name is capitalised, shares the row).
    """
    if policy.health.key == "provider":
        return provider_key(route.provider)
    return route.id


def health_key(route: Route, profile_id: str | None, policy: Policy) -> str:
    """The key one attempt's health is kept under.

    The profile where the policy keys health by profile and the attempt used one, else
    :func:`route_key`.
    """
    if policy.health.key == "profile" and profile_id:
        return profile_id
    return route_key(route, policy)


def key_kind(route: Route, key: str, policy: Policy) -> str:
    """What a health row is about, as stored in its ``kind`` column."""
    if key == route.id:
        return "route"
    return "provider" if policy.health.key == "provider" else "profile"


def probe_key_kind(route: Route, key: str) -> str:
    """What the health row a probe of ``route`` claims under ``key`` is about (its ``kind``)."""
    if key == route.id:
        return "route"
    return "provider" if key.startswith(PROVIDER_KEY_PREFIX) else "profile"


def _exempt(provider: str | None, hp: HealthPolicy) -> bool:
    if not provider:
        return False
    p = provider.casefold()
    return any(p == e.casefold() for e in hp.exempt_providers)


def _disable_rule(category: Category, hp: HealthPolicy) -> DisableRule | None:
    for rule in hp.disables:
        if category in rule.categories:
            return rule
    return None


def cooldown_effect(
    category: Category, provider: str | None, source: Source, policy: Policy
) -> CooldownEffect:
    """What a failure of ``category`` does to its key under ``policy``.

    A local refusal says nothing about the provider, and exempt routers spread load over many
    upstreams, so neither cools anything.
    """
    hp = policy.health
    if source is Source.LOCAL or _exempt(provider, hp):
        return CooldownEffect.NONE
    if _disable_rule(category, hp) is not None:
        return CooldownEffect.DISABLE
    if category in hp.cooldown_categories:
        return CooldownEffect.COOLDOWN
    return CooldownEffect.NONE


def _curve(base: float, factor: float, exponent: int, cap: float) -> float:
    try:
        value = base * factor ** min(max(exponent, 0), _MAX_EXPONENT)
    except OverflowError:
        return cap
    return cap if not math.isfinite(value) else min(value, cap)


def cooldown_seconds(n: int, policy: Policy) -> float:
    """Cooldown after the ``n``-th counted failure: ``min(base * factor^min(n-1, k), cap)``."""
    if n <= 0:
        return 0.0
    c = policy.health.cooldown
    return _curve(c.base_s, c.factor, min(n - 1, c.max_exponent), c.cap_s)


def disable_seconds(k: int, rule: DisableRule, provider: str | None = None) -> float:
    """Disable length after the ``k``-th failure counted by ``rule``: ``base * factor^(k-1)``."""
    if k <= 0:
        return 0.0
    base = rule.base_s
    if provider:
        p = provider.casefold()
        for name, seconds in rule.base_s_by_provider.items():
            if name.casefold() == p:
                base = seconds
                break
    return _curve(base, rule.factor, k - 1, rule.cap_s)


def unavailable_until(health: Health, now: float) -> float | None:
    """When the key becomes available again, or ``None`` if it is available at ``now``."""
    active = [
        t for t in (health.cooldown_until, health.disabled_until) if t is not None and now < t
    ]
    return max(active) if active else None


def is_available(health: Health, now: float) -> bool:
    """Available unless cooling or disabled; available again at exactly its ``until``."""
    return unavailable_until(health, now) is None


def _cleared() -> dict[str, object]:
    """What a counter reset clears (a fresh mapping each time: the counts dict is new)."""
    return {
        "error_count": 0,
        "failure_counts": {},
        "cooldown_until": None,
        "disabled_until": None,
        "disabled_reason": None,
        "reset_at": None,
        "recent_failures": (),
        "counted_at": None,
    }


def refresh(health: Health, now: float, policy: Policy) -> Health:
    """Apply the counter resets that are due at ``now`` (before counting a new failure).

    Counters reset once every window has expired, when ``reset_on_expiry`` says so or when the
    failure window has passed since the last failure. Requiring expiry for the failure-window
    reset keeps a failure inside an active cooldown escalating, as GoClaw does; for Fased it
    changes nothing, since no window outlasts its 24 h failure window.
    """
    if health.error_count == 0 and not health.failure_counts:
        return health
    if not is_available(health, now):
        return health
    hp = policy.health
    window_passed = (
        hp.failure_window_s is not None
        and health.last_failure_at is not None
        and now - health.last_failure_at >= hp.failure_window_s
    )
    if not (hp.reset_on_expiry or window_passed):
        return health
    return health.model_copy(update=_cleared())


def reset_at(health: Health, policy: Policy) -> float | None:
    """When the counters of ``health`` reset by themselves under ``policy``, or ``None``.

    It is what :func:`refresh` would do, as a time: once every window has expired, and, unless
    the policy resets on expiry, once the failure window has passed since the last failure.
    ``None``: only a success resets them.
    """
    hp = policy.health
    if health.error_count == 0 and not health.failure_counts:
        if health.recent_failures and hp.cooldown_window_s is not None:
            # Failures below the threshold are forgotten once the window has passed them all.
            return health.recent_failures[-1] + hp.cooldown_window_s
        return None
    ends = [t for t in (health.cooldown_until, health.disabled_until) if t is not None]
    available = max(ends) if ends else health.last_failure_at
    if available is None:
        return None
    if hp.reset_on_expiry:
        return available
    if hp.failure_window_s is None or health.last_failure_at is None:
        return None
    return max(available, health.last_failure_at + hp.failure_window_s)


def as_read(health: Health, now: float) -> Health:
    """``health`` as it stands at ``now``, as the next write would find it.

    Counters whose reset time (``reset_at``, written by the policy that counted them) has passed
    read as reset.

    GoClaw: "When both cooldownUntil and disabledUntil have expired, errorCount and
    failureCounts are reset to zero" - an operator reading the row sees that, not stale counts.
    """
    if health.reset_at is None or now < health.reset_at:
        return health
    return health.model_copy(update=_cleared())


def operator_clear(health: Health, now: float) -> tuple[Health, dict[str, object]] | None:
    """An operator's clear of ``health`` at ``now``: the row it writes and what it cleared.

    The key is made available at once and its counters start again from zero (cooldown,
    disable, error and failure counts, failures below the cooling threshold); when it was last
    used, failed and probed stays as history. ``None`` when there is nothing to clear: the key
    is available and counts nothing at ``now`` (counters past their reset time read as reset,
    as :func:`as_read` reads them).
    """
    seen = as_read(health, now)
    cooling = seen.cooldown_until is not None and now < seen.cooldown_until
    disabled = seen.disabled_until is not None and now < seen.disabled_until
    if not (cooling or disabled or seen.error_count or seen.failure_counts
            or seen.recent_failures):
        return None
    before: dict[str, object] = {
        "status": "disabled" if disabled else "cooling" if cooling else "ok",
        "cooldown_until": seen.cooldown_until if cooling else None,
        "disabled_until": seen.disabled_until if disabled else None,
        "disabled_reason": seen.disabled_reason if disabled else None,
        "error_count": seen.error_count,
        "failure_counts": dict(seen.failure_counts),
        "recent_failures": len(seen.recent_failures),
        # Since when the outage it clears was counted: when its evidence began.
        "counted_at": seen.counted_at,
    }
    return seen.model_copy(update=_cleared()), before


def group_closed(mode: str, until: float | None, now: float) -> bool:
    """Whether a capacity group stored as ``mode``, floor ``until``, is closed at ``now``.

    Admission's projection: a waiting floor that has passed reads as open.
    """
    return mode != "open" and (until is None or now < until)


def _with_reset(health: Health, policy: Policy) -> Health:
    return health.model_copy(update={"reset_at": reset_at(health, policy)})


def record_failure(
    health: Health, category: Category, *, provider: str | None, now: float, policy: Policy,
    began_at: float | None = None,
) -> Health:
    """Count a failure and start the cooldown or disable it calls for.

    A failure that neither cools nor disables (e.g. a Fased timeout) is not counted at all, so
    it cannot lengthen the next real cooldown. A failure inside an active window raises the
    count and recomputes the window from this failure — unless the policy does not count
    overlapping failures and its Attempt began (``began_at``) before the failure that counted
    the key's current outage (``counted_at``): then it is the same outage, seen late by a
    request already in flight, and it restarts the window with the count it has (as a
    same-route retry does), leaving ``counted_at`` where it is. A request begun after that
    failure (a probe, say) is new evidence and counted, however many restarts came since.
    ``began_at`` ``None``: not known, counted.
    """
    effect = cooldown_effect(category, provider, Source.PROVIDER, policy)
    if effect is CooldownEffect.NONE:
        return health
    h = refresh(health, now, policy)
    if _overlapping(h, began_at, now, policy.health):
        return _restart(h, category, provider=provider, now=now, policy=policy)
    return _count(h, category, effect, provider=provider, now=now, policy=policy)


def _count(h: Health, category: Category, effect: CooldownEffect, *, provider: str | None,
           now: float, policy: Policy) -> Health:
    if effect is CooldownEffect.COOLDOWN and h.error_count == 0:
        below = _below_threshold(h, now, policy.health)
        if below is not None:
            return _with_reset(h.model_copy(update={"recent_failures": below,
                                                    "last_failure_at": now}), policy)
    counts = dict(h.failure_counts)
    counts[category.value] = counts.get(category.value, 0) + 1
    n = h.error_count + 1
    update: dict[str, object] = {
        "error_count": n,
        "failure_counts": counts,
        "last_failure_at": now,
        "counted_at": now,
        "recent_failures": (),
    }
    rule = _disable_rule(category, policy.health)
    if effect is CooldownEffect.DISABLE and rule is not None:
        k = sum(counts.get(c.value, 0) for c in rule.categories)
        update["disabled_until"] = now + disable_seconds(k, rule, provider)
        update["disabled_reason"] = category.value
    else:
        update["cooldown_until"] = now + cooldown_seconds(n, policy)
    return _with_reset(h.model_copy(update=update), policy)


def _below_threshold(health: Health, now: float, hp: HealthPolicy) -> tuple[float, ...] | None:
    """The key's recent failures with this one, while they stay below the cooling threshold.

    ``None`` when this failure reaches ``cooldown_after`` failures within ``cooldown_window_s``:
    then the key cools. A policy that cools on the first failure never remembers any.
    """
    if hp.cooldown_after <= 1 or hp.cooldown_window_s is None:
        return None
    window = hp.cooldown_window_s
    recent = (*(t for t in health.recent_failures if now - t < window), now)
    if len(recent) >= hp.cooldown_after:
        return None
    return recent


def record_repeat(
    health: Health, category: Category, *, provider: str | None, now: float, policy: Policy,
    began_at: float | None = None,
) -> Health:
    """A same-route retry failed again inside the request whose first failure was counted.

    Unless the policy counts every retry, the failure is not counted again: the window
    restarts from this (latest) failure with the count it has, so one request steps the
    cooldown once and the cooldown runs from its last try. A key whose counters are at zero
    by now (the first failure did not count, or they reset meanwhile) counts it normally, as
    :func:`record_failure` does (``began_at`` as there).
    """
    effect = cooldown_effect(category, provider, Source.PROVIDER, policy)
    if effect is CooldownEffect.NONE:
        return health
    h = refresh(health, now, policy)
    hp = policy.health
    if (h.error_count == 0 and h.recent_failures and not hp.count_same_route_retries
            and effect is CooldownEffect.COOLDOWN
            and _below_threshold(h, now, hp) is not None):
        # The request's first failure is remembered below the threshold: its retry moves it
        # to this latest try instead of counting as a second, independent failure.
        recent = (*h.recent_failures[:-1], now)
        return _with_reset(h.model_copy(update={"recent_failures": recent,
                                                "last_failure_at": now}), policy)
    if hp.count_same_route_retries or h.error_count == 0:
        return record_failure(h, category, provider=provider, now=now, policy=policy,
                              began_at=began_at)
    return _restart(h, category, provider=provider, now=now, policy=policy)


def _overlapping(health: Health, began_at: float | None, now: float, hp: HealthPolicy) -> bool:
    """Whether an outcome is of a request that was in flight when an outage already counted began.

    Its Attempt began before the failure that counted the outage, and the outage's window is
    still running: every worker's request in flight when the route went dark would otherwise
    step the curve once more on failing, and one short burst would cool it for the cap; or, on
    succeeding, reopen it for every worker while it is still dark.

    Measured from the counting failure (``counted_at``), not the latest one: each overlapping
    failure restarts the window and moves ``last_failure_at``, and a probe begun after the
    count but before such a restart is evidence about the route since the outage, not from
    before it. A row kept before ``counted_at`` existed falls back to ``last_failure_at``.
    """
    counted = health.counted_at if health.counted_at is not None else health.last_failure_at
    return (not hp.count_overlapping_failures and began_at is not None
            and health.error_count > 0 and counted is not None
            and began_at < counted and not is_available(health, now))


def _restart(health: Health, category: Category, *, provider: str | None, now: float,
             policy: Policy) -> Health:
    """The window restarts from this failure with the count the key has; nothing is counted.

    ``last_failure_at`` moves to this failure; ``counted_at`` stays on the failure that counted
    the outage, so what overlaps it does not move with each restart.

    A disable this category's rule has not counted yet is a different failure, not a repeat:
    it is counted.
    """
    effect = cooldown_effect(category, provider, Source.PROVIDER, policy)
    update: dict[str, object] = {"last_failure_at": now}
    rule = _disable_rule(category, policy.health)
    if effect is CooldownEffect.DISABLE and rule is not None:
        k = sum(health.failure_counts.get(c.value, 0) for c in rule.categories)
        if k == 0:
            return _count(health, category, effect, provider=provider, now=now, policy=policy)
        update["disabled_until"] = now + disable_seconds(k, rule, provider)
        update["disabled_reason"] = category.value
    else:
        update["cooldown_until"] = now + cooldown_seconds(health.error_count, policy)
    return _with_reset(health.model_copy(update=update), policy)


def record_success(health: Health, now: float, policy: Policy,
                   began_at: float | None = None) -> Health:
    """A successful call: the key was used, and (per policy) all error state is cleared.

    ``last_used`` is rewritten only once it is ``last_used_interval_s`` old, so a success on
    a healthy key that changes nothing else leaves the row as it is (and settle skips it).

    Unless the policy counts overlapping failures, a success of an Attempt that began
    (``began_at``) before the failure that counted the key's current outage (``counted_at``),
    while the outage's window still runs, clears nothing: it is evidence from before the
    outage (a long stream sent before the route went dark), and clearing on it would reopen
    the route to every worker at once. A success of one begun after it (a probe) clears, even
    when failures of requests in flight restarted the window since. It is the mirror of
    :func:`record_failure`'s overlap rule. ``began_at`` ``None``: not known, it clears.
    """
    hp = policy.health
    update: dict[str, object] = {}
    if hp.track_last_used and (
        health.last_used is None or now - health.last_used >= hp.last_used_interval_s
    ):
        update["last_used"] = now
    if hp.reset_on_success and not _overlapping(health, began_at, now, hp):
        update.update(_cleared())
    return health.model_copy(update=update)


class _Unset:
    pass


_UNSET: Final = _Unset()


def probe_eligible(
    health: Health,
    now: float,
    policy: Policy,
    last_probe_at: float | _Unset | None = _UNSET,
) -> bool:
    """Whether an unavailable key may be probed now.

    ``now >= until - margin`` and ``now - last_probe_at >= interval`` (or never probed).
    ``last_probe_at`` defaults to ``health.last_probe_at``; pass ``None`` for "never probed".
    An available key is not a probe, it is simply a candidate.
    """
    pp = policy.probe
    if not pp.enabled:
        return False
    until = unavailable_until(health, now)
    if until is None or now < until - pp.margin_s:
        return False
    last = health.last_probe_at if isinstance(last_probe_at, _Unset) else last_probe_at
    return last is None or now - last >= pp.interval_s


@dataclass(frozen=True)
class ProbeThrottle:
    """Last probe time per key, bounded in age (``ttl_s``) and size (``max_keys``).

    A value: :meth:`record` returns a new throttle. Keys are the caller's (GoClaw uses
    ``agentDir::provider``).
    """

    last: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def allowed(self, key: str, now: float, policy: Policy) -> bool:
        """At least ``interval_s`` since this key's last probe, or no live entry for it."""
        t = self.last.get(key)
        if t is None:
            return True
        pp = policy.probe
        return now - t >= pp.ttl_s or now - t >= pp.interval_s

    def record(self, key: str, now: float, policy: Policy) -> ProbeThrottle:
        """Record a probe of ``key`` at ``now``.

        Entries past their TTL go, then the oldest beyond ``max_keys``.
        """
        pp = policy.probe
        kept = {k: t for k, t in self.last.items() if k != key and now - t < pp.ttl_s}
        excess = len(kept) + 1 - pp.max_keys
        if excess > 0:
            for k, _ in sorted(kept.items(), key=lambda kv: (kv[1], kv[0]))[:excess]:
                del kept[k]
        kept[key] = now
        return ProbeThrottle(MappingProxyType(kept))

    def __len__(self) -> int:
        return len(self.last)


__all__ = [
    "PROVIDER_KEY_PREFIX",
    "ProbeThrottle",
    "as_read",
    "canonical_key",
    "cooldown_effect",
    "cooldown_seconds",
    "disable_seconds",
    "group_closed",
    "health_key",
    "is_available",
    "key_kind",
    "operator_clear",
    "probe_eligible",
    "probe_key_kind",
    "provider_key",
    "record_failure",
    "record_repeat",
    "record_success",
    "refresh",
    "reset_at",
    "route_key",
    "unavailable_until",
]
