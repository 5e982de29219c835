"""Credential-profile ordering, usability and stickiness (seed 002, the ``fased`` behaviour).

A route may carry several credential profiles (an OAuth login, a token, an API key). Health is
kept per profile id. This module answers three pure questions:

* in which order are a route's profiles tried (:func:`rotation_order`);
* may a profile be used right now (:func:`usable`);
* which profile does a request use, given the session's pin (:func:`sticky_profile`,
  :func:`first_usable`), and which one the session keeps after a success
  (:func:`keeps_pinned_profile`).

Nothing here reads a clock or a store: ``now`` and the health map are arguments.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

from ledger.decide.health import cooldown_effect, unavailable_until
from ledger.domain.facts import Category, CooldownEffect, FailureFact
from ledger.domain.values import Health, Profile
from ledger.policy.model import Policy, ProfilePolicy


class Pin(StrEnum):
    """How the session's current profile was chosen.

    ``auto``: the router chose it; it is a preference kept while it stays usable.
    ``user``: the user chose it; it is kept until a new session, even when it cools, and a
    failover that served on another profile does not replace it
    (:func:`keeps_pinned_profile`).
    """

    AUTO = "auto"
    USER = "user"


def available_at(health: Health | None, now: float) -> float | None:
    """When the key becomes usable again, or ``None`` if it is usable at ``now`` (or unknown).

    A thin ``None``-tolerant wrapper over :func:`ledger.decide.health.unavailable_until`, the one
    definition of availability (usable again at exactly its ``until``).
    """
    return None if health is None else unavailable_until(health, now)


def usable(profile_id: str, health: Mapping[str, Health], now: float) -> bool:
    """True when the profile is neither cooling nor disabled at ``now``."""
    return available_at(health.get(profile_id), now) is None


def rotation_order(
    profiles: Sequence[Profile],
    provider: str,
    health: Mapping[str, Health],
    now: float,
    policy: ProfilePolicy,
) -> list[Profile]:
    """The order in which a route's profiles are tried.

    1. An explicit ``auth_order[provider]`` lists the profiles to use, in that order; profiles
       not listed are left out entirely (that is how a user forces a single profile).
    2. Otherwise by type (``policy.type_order``: OAuth, token, API key), then by ``last_used``
       oldest first, so use is spread round-robin; a never-used profile counts as the oldest.
    3. In both cases, cooling and disabled profiles go to the end, soonest expiry first, so
       the head of the list is always the best usable choice.
    """
    explicit = _auth_order(policy, provider)
    if explicit is not None:
        by_id = {p.id: p for p in profiles}
        base = [by_id[pid] for pid in explicit if pid in by_id]
    else:
        rank = {t: i for i, t in enumerate(policy.type_order)}
        unranked = len(rank)

        def key(p: Profile) -> tuple[int, float]:
            h = health.get(p.id)
            last = h.last_used if h is not None and h.last_used is not None else float("-inf")
            return (rank.get(p.type, unranked), last)

        # sorted() is stable: equal keys keep the route's declared order.
        base = sorted(profiles, key=key)

    ready = [p for p in base if usable(p.id, health, now)]
    waiting = [p for p in base if not usable(p.id, health, now)]
    waiting.sort(key=lambda p: available_at(health.get(p.id), now) or now)
    return ready + waiting


def auth_order_key(policy: ProfilePolicy, provider: str) -> str | None:
    """The ``policy.auth_order`` key ordering ``provider``'s profiles, or ``None``.

    Matched case-insensitively: the key spelled exactly as the route's provider comes first (a
    frozen policy admitted before two spellings of one provider were refused keeps the order
    it decided by then).
    """
    if provider in policy.auth_order:
        return provider
    p = provider.casefold()
    return next((name for name in policy.auth_order if name.casefold() == p), None)


def _auth_order(policy: ProfilePolicy, provider: str) -> list[str] | None:
    """The explicit order of ``provider``'s profiles (:func:`auth_order_key`)."""
    key = auth_order_key(policy, provider)
    return None if key is None else policy.auth_order[key]


def first_usable(
    profiles: Sequence[Profile],
    provider: str,
    health: Mapping[str, Health],
    now: float,
    policy: ProfilePolicy,
    exclude: Collection[str] = (),
) -> Profile | None:
    """The first usable profile in rotation order, leaving out ``exclude`` (tried ones)."""
    for p in rotation_order(profiles, provider, health, now, policy):
        if p.id not in exclude and usable(p.id, health, now):
            return p
    return None


def sticky_profile(
    profiles: Sequence[Profile],
    provider: str,
    health: Mapping[str, Health],
    now: float,
    policy: ProfilePolicy,
    *,
    current: str | None,
    pin: Pin | None,
    exclude: Collection[str] = (),
) -> Profile | None:
    """The profile a new request on this route uses, honouring session stickiness.

    A user pin is kept always (the user asked for that credential; cooling does not override
    a person's explicit choice). An auto pin is kept while it is usable and not excluded,
    which keeps provider caches warm instead of rotating on every request. Otherwise, or when
    ``current`` is not one of this route's profiles, the first usable profile in rotation order.
    """
    by_id = {p.id: p for p in profiles}
    if current is not None and current in by_id:
        if pin is Pin.USER:
            return by_id[current]
        if pin is Pin.AUTO and current not in exclude and usable(current, health, now):
            return by_id[current]
    return first_usable(profiles, provider, health, now, policy, exclude)


def keeps_pinned_profile(pin: Pin | None, pinned: str | None, served: str | None) -> bool:
    """Whether a success on profile ``served`` leaves the Run's current profile ``pinned``.

    Under a user pin the pinned profile is the session's until a new session starts (seed 002:
    "User-pinned profiles stay locked to that profile"): a failover that served on another
    profile, or on a route without profiles, does not move it, so the next turn goes back to
    the pinned profile. With no profile pinned yet (the session's first success), the serving
    profile becomes the pin. Auto pins and unpinned turns follow the profile that served.
    """
    return pin is Pin.USER and pinned is not None and served != pinned


def marks_profile_tried(fact: FailureFact, provider: str, policy: Policy) -> bool:
    """Whether a failure on a credential profile rules it out for the rest of the turn.

    Ruled out, it is skipped on every route that carries it.

    Only where credentials rotate (``profiles.rotate_before_model``): under a route-level
    policy one 503 says nothing about the account its routes share. A profile that cannot be
    used (no secret) is always ruled out. With ``mark_tried: credential_failure`` only a
    failure that cools or disables the credential marks it: Fased rotates on timeouts and
    format errors "but does not mark the auth profile ... marking the credential would block
    other valid model routes on the same provider".
    """
    if fact.category is Category.UNUSABLE:
        return True
    pp = policy.profiles
    if not pp.rotate_before_model:
        return False
    if pp.mark_tried == "any_failure":
        return True
    return cooldown_effect(fact.category, provider, fact.source, policy) is not CooldownEffect.NONE


__all__ = [
    "Pin",
    "available_at",
    "first_usable",
    "keeps_pinned_profile",
    "marks_profile_tried",
    "rotation_order",
    "sticky_profile",
    "usable",
]
