"""Credential-profile ordering, usability and stickiness (seed 002)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ledger.decide.profiles import (
    Pin,
    available_at,
    first_usable,
    keeps_pinned_profile,
    rotation_order,
    sticky_profile,
    usable,
)
from ledger.domain.values import Health, Profile, ProfileType
from ledger.policy.model import FROZEN, ProfilePolicy

NOW = 10_000.0
POLICY = ProfilePolicy()

OAUTH = Profile(id="anthropic:me@example.com", type=ProfileType.OAUTH)
TOKEN = Profile(id="anthropic:ci", type=ProfileType.TOKEN)
KEY = Profile(id="anthropic:default", type=ProfileType.API_KEY)
# Declared in the "wrong" order on purpose: ordering must come from type, not declaration.
PROFILES = [KEY, TOKEN, OAUTH]


def h(key: str, **kw: float) -> Health:
    return Health.model_validate({"key": key, **kw})


def ids(ps: list[Profile]) -> list[str]:
    return [p.id for p in ps]


def test_type_order_oauth_token_api_key() -> None:
    health = {
        OAUTH.id: h(OAUTH.id, last_used=9000),
        TOKEN.id: h(TOKEN.id, last_used=100),
        KEY.id: h(KEY.id, last_used=50),
    }
    # Type dominates last use: the OAuth profile leads although it was used most recently.
    assert ids(rotation_order(PROFILES, "anthropic", health, NOW, POLICY)) == [
        OAUTH.id,
        TOKEN.id,
        KEY.id,
    ]


def test_oldest_last_used_first_within_a_type_and_never_used_is_oldest() -> None:
    a = Profile(id="a", type=ProfileType.OAUTH)
    b = Profile(id="b", type=ProfileType.OAUTH)
    c = Profile(id="c", type=ProfileType.OAUTH)
    health = {"a": h("a", last_used=9000), "b": h("b", last_used=100)}
    assert ids(rotation_order([a, b, c], "x", health, NOW, POLICY)) == ["c", "b", "a"]


def test_cooling_and_disabled_go_last_by_soonest_expiry() -> None:
    health = {
        OAUTH.id: h(OAUTH.id, cooldown_until=NOW + 100),
        TOKEN.id: h(TOKEN.id, disabled_until=NOW + 50),
    }
    assert ids(rotation_order(PROFILES, "anthropic", health, NOW, POLICY)) == [
        KEY.id,
        TOKEN.id,
        OAUTH.id,
    ]


def test_explicit_auth_order_lists_only_the_named_profiles() -> None:
    policy = ProfilePolicy(auth_order={"anthropic": [KEY.id, "anthropic:unknown", OAUTH.id]})
    order = rotation_order(PROFILES, "anthropic", {}, NOW, policy)
    assert ids(order) == [KEY.id, OAUTH.id]  # TOKEN is not listed; unknown ids are ignored
    # Another provider keeps the type order.
    assert ids(rotation_order(PROFILES, "openai", {}, NOW, policy))[0] == OAUTH.id


def test_an_auth_order_key_matches_its_provider_case_insensitively() -> None:
    """``auth_order: {Anthropic: [...]}`` was ignored for routes of provider ``anthropic``
    (matched exactly), while ``exempt_providers`` and ``base_s_by_provider`` of the same
    policy matched them case-insensitively."""
    policy = ProfilePolicy(auth_order={"Anthropic": [KEY.id]})
    assert ids(rotation_order(PROFILES, "anthropic", {}, NOW, policy)) == [KEY.id]
    assert ids(rotation_order(PROFILES, "ANTHROPIC", {}, NOW, policy)) == [KEY.id]
    assert first_usable(PROFILES, "anthropic", {}, NOW, policy) == KEY


def test_a_frozen_auth_order_with_two_spellings_keeps_deciding_by_the_exact_one() -> None:
    """Invariant 5: a Run admitted before two spellings of one provider were refused reads
    back, and the key spelled as its route's provider still decides, as it did then."""
    policy = ProfilePolicy.model_validate(
        {"auth_order": {"Anthropic": [OAUTH.id], "anthropic": [KEY.id]}}, context=FROZEN)
    assert ids(rotation_order(PROFILES, "anthropic", {}, NOW, policy)) == [KEY.id]
    assert ids(rotation_order(PROFILES, "Anthropic", {}, NOW, policy)) == [OAUTH.id]


def test_custom_type_order_is_read_from_policy() -> None:
    policy = ProfilePolicy(type_order=[ProfileType.API_KEY, ProfileType.OAUTH, ProfileType.TOKEN])
    assert ids(rotation_order(PROFILES, "anthropic", {}, NOW, policy)) == [
        KEY.id,
        OAUTH.id,
        TOKEN.id,
    ]


def test_an_empty_type_order_is_no_preference_and_leaves_every_profile_usable() -> None:
    """Unlike an empty ``auth_order`` entry, type order only ranks, never filters: empty, the
    profiles rotate by last use alone (never-used first, then declared order)."""
    policy = ProfilePolicy(type_order=[])
    health = {KEY.id: h(KEY.id, last_used=9000), OAUTH.id: h(OAUTH.id, last_used=100)}
    assert ids(rotation_order(PROFILES, "anthropic", health, NOW, policy)) == [
        TOKEN.id,
        OAUTH.id,
        KEY.id,
    ]
    assert first_usable(PROFILES, "anthropic", health, NOW, policy) == TOKEN


def test_usable_again_at_exactly_until() -> None:
    health = {"p": h("p", cooldown_until=NOW)}
    assert usable("p", health, NOW)
    assert not usable("p", health, NOW - 0.001)
    assert available_at(health["p"], NOW - 1) == NOW
    assert available_at(None, NOW) is None
    # The later of cooldown and disable decides.
    both = h("q", cooldown_until=NOW + 10, disabled_until=NOW + 99)
    assert available_at(both, NOW) == NOW + 99


def test_first_usable_skips_excluded_and_cooling() -> None:
    health = {OAUTH.id: h(OAUTH.id, cooldown_until=NOW + 60)}
    got = first_usable(PROFILES, "anthropic", health, NOW, POLICY, exclude={TOKEN.id})
    assert got == KEY
    everything_out = first_usable(
        PROFILES, "anthropic", health, NOW, POLICY, exclude={TOKEN.id, KEY.id}
    )
    assert everything_out is None


def test_auto_pin_kept_while_usable_then_rotates() -> None:
    health = {KEY.id: h(KEY.id, last_used=9999), OAUTH.id: h(OAUTH.id, last_used=1)}
    kept = sticky_profile(PROFILES, "anthropic", health, NOW, POLICY, current=KEY.id, pin=Pin.AUTO)
    assert kept == KEY  # stickiness keeps caches warm even though OAuth would lead
    cooling = {**health, KEY.id: h(KEY.id, cooldown_until=NOW + 60)}
    moved = sticky_profile(
        PROFILES, "anthropic", cooling, NOW, POLICY, current=KEY.id, pin=Pin.AUTO
    )
    assert moved == OAUTH


def test_user_pin_kept_always_even_cooling() -> None:
    health = {KEY.id: h(KEY.id, cooldown_until=NOW + 600)}
    got = sticky_profile(PROFILES, "anthropic", health, NOW, POLICY, current=KEY.id, pin=Pin.USER)
    assert got == KEY


def test_a_user_pinned_profile_is_kept_when_a_failover_served_on_another() -> None:
    assert keeps_pinned_profile(Pin.USER, KEY.id, TOKEN.id)
    assert keeps_pinned_profile(Pin.USER, KEY.id, None)  # a route without profiles served
    assert not keeps_pinned_profile(Pin.USER, KEY.id, KEY.id)
    assert not keeps_pinned_profile(Pin.USER, None, TOKEN.id)  # the first success pins it
    assert not keeps_pinned_profile(Pin.AUTO, KEY.id, TOKEN.id)  # a preference follows
    assert not keeps_pinned_profile(None, KEY.id, TOKEN.id)


def test_no_pin_or_foreign_current_uses_rotation_order() -> None:
    assert sticky_profile(PROFILES, "anthropic", {}, NOW, POLICY, current=KEY.id, pin=None) == OAUTH
    foreign = sticky_profile(
        PROFILES, "anthropic", {}, NOW, POLICY, current="openai:default", pin=Pin.USER
    )
    assert foreign == OAUTH


def test_rotation_after_a_failure_leaves_out_failed_tried_and_unusable() -> None:
    health = {TOKEN.id: h(TOKEN.id, disabled_until=NOW + 3600)}
    # The failed OAuth profile is excluded; the disabled token is skipped: the key is next.
    assert first_usable(PROFILES, "anthropic", health, NOW, POLICY, exclude={OAUTH.id}) == KEY
    assert first_usable(PROFILES, "anthropic", health, NOW, POLICY,
                        exclude={OAUTH.id, KEY.id}) is None


_types = st.sampled_from(list(ProfileType))
_maybe_t = st.one_of(st.none(), st.floats(min_value=0, max_value=20_000))


@given(
    st.lists(st.tuples(_types, _maybe_t, _maybe_t, _maybe_t), min_size=1, max_size=6),
)
def test_order_is_a_permutation_with_usable_first(
    specs: list[tuple[ProfileType, float | None, float | None, float | None]],
) -> None:
    profiles = [Profile(id=f"p{i}", type=t) for i, (t, _, _, _) in enumerate(specs)]
    health = {
        f"p{i}": Health(key=f"p{i}", last_used=lu, cooldown_until=cu, disabled_until=du)
        for i, (_, lu, cu, du) in enumerate(specs)
    }
    order = rotation_order(profiles, "x", health, NOW, POLICY)
    assert sorted(ids(order)) == sorted(ids(profiles))
    flags = [usable(p.id, health, NOW) for p in order]
    # Once an unusable profile appears, no usable one follows it.
    assert flags == sorted(flags, reverse=True)
    first = first_usable(profiles, "x", health, NOW, POLICY)
    assert first == (order[0] if flags[0] else None)
