"""Health state machines: curves, disables, resets, probes and the probe throttle."""

from __future__ import annotations

from ledger.decide.health import (
    ProbeThrottle,
    canonical_key,
    cooldown_seconds,
    disable_seconds,
    health_key,
    is_available,
    probe_eligible,
    record_failure,
    record_repeat,
    record_success,
    refresh,
)
from ledger.decide.settle import health_updates
from ledger.domain.facts import Category
from ledger.domain.records import Outcome
from ledger.domain.values import Health, Route
from ledger.policy.load import apply_overrides, preset
from ledger.policy.model import Policy

GOCLAW = preset("goclaw")
FASED = preset("fased")
DOMAIN = preset("failure-domain")


def test_goclaw_curve() -> None:
    assert [cooldown_seconds(n, GOCLAW) for n in range(0, 7)] == [
        0,
        60,
        300,
        1500,
        3600,
        3600,
        3600,
    ]


def test_billing_disable_doubles_to_cap_with_provider_override() -> None:
    rule = apply_overrides(FASED, {"billing_backoff_hours_by_provider": {"OpenAI": 1}}).health
    r = rule.disables[0]
    assert [disable_seconds(k, r) for k in (1, 2, 3, 4)] == [18000, 36000, 72000, 86400]
    assert disable_seconds(1, r, "openai") == 3600
    assert disable_seconds(10_000, r) == 86400


def test_disabled_key_available_again_at_exactly_until() -> None:
    h = record_failure(Health(key="p"), Category.BILLING, provider="x", now=100, policy=FASED)
    assert h.disabled_reason == "billing" and h.cooldown_until is None
    assert not is_available(h, 18099.999)
    assert is_available(h, 18100)


def test_non_counting_failure_changes_nothing() -> None:
    h = Health(key="p", error_count=2, last_failure_at=5.0, cooldown_until=65.0)
    assert record_failure(h, Category.TIMEOUT, provider="x", now=10, policy=FASED) == h


def test_fased_counters_survive_expiry_but_not_the_window() -> None:
    h = record_failure(Health(key="p"), Category.RATE_LIMIT, provider="x", now=0, policy=FASED)
    assert refresh(h, 61, FASED).error_count == 1  # expired, still inside 24 h
    assert refresh(h, 86_400, FASED).error_count == 0
    shorter = apply_overrides(FASED, {"failure_window_s": 100})
    assert refresh(h, 100, shorter).error_count == 0


def test_goclaw_window_reset_waits_for_expiry() -> None:
    h = Health(key="r")
    for t in (0, 10, 20, 30):
        h = record_failure(h, Category.OVERLOADED, provider="p", now=t, policy=GOCLAW)
    assert h.error_count == 4 and h.cooldown_until == 3630
    # 10 minutes without a failure, but the 1 h cooldown is still running: escalate.
    h = record_failure(h, Category.OVERLOADED, provider="p", now=1000, policy=GOCLAW)
    assert h.error_count == 5 and h.cooldown_until == 4600


def test_success_clears_and_marks_use() -> None:
    h = record_failure(Health(key="p"), Category.BILLING, provider="x", now=0, policy=FASED)
    h = record_success(h, 5, FASED)
    assert (h.error_count, h.disabled_until, h.failure_counts, h.last_used) == (0, None, {}, 5)
    keep = FASED.model_copy(
        update={"health": FASED.health.model_copy(update={"reset_on_success": False})}
    )
    h2 = record_success(Health(key="p", error_count=3), 7, keep)
    assert (h2.error_count, h2.last_used) == (3, 7)


def test_health_key_follows_the_policy_key() -> None:
    route = Route(id="route", provider="gemini", model="m", group="g", recipient="r")
    assert health_key(route, "prof", FASED) == "prof"
    assert health_key(route, None, FASED) == "route"
    # goclaw: the cooldown belongs to the provider, shared by all its routes.
    assert health_key(route, "prof", GOCLAW) == "provider:gemini"
    assert health_key(route, None, preset("failure-domain")) == "route"


def test_a_providers_key_is_one_for_every_spelling_of_its_name() -> None:
    spelt = [Route(id=f"r{i}", provider=name, model="m", group="g", recipient="r")
             for i, name in enumerate(("OpenAI", "openai", "OPENAI"))]
    assert {health_key(r, None, GOCLAW) for r in spelt} == {"provider:openai"}
    # The route's own provider stays as written: it is part of the frozen plan and its hash.
    assert spelt[0].provider == "OpenAI"
    assert canonical_key("provider:OpenAI") == "provider:openai"
    assert canonical_key("OpenAI-direct") == "OpenAI-direct"  # a route or profile id is as is


def test_probe_eligibility() -> None:
    cooling = Health(key="r", cooldown_until=1000)
    assert not probe_eligible(cooling, 879, GOCLAW)  # outside the 2-minute margin
    assert probe_eligible(cooling, 880, GOCLAW)  # never probed
    assert not probe_eligible(cooling, 900, GOCLAW, last_probe_at=880)
    assert probe_eligible(cooling, 910, GOCLAW, last_probe_at=880)
    probed = cooling.model_copy(update={"last_probe_at": 890})
    assert not probe_eligible(probed, 900, GOCLAW)
    assert probe_eligible(probed, 900, GOCLAW, last_probe_at=None)
    assert not probe_eligible(Health(key="r"), 0, GOCLAW)  # available: not a probe
    assert not probe_eligible(cooling, 990, FASED)  # probes off


def test_probe_throttle_interval_ttl_and_bound() -> None:
    t = ProbeThrottle()
    assert t.allowed("a", 0, GOCLAW)
    t = t.record("a", 0, GOCLAW)
    assert not t.allowed("a", 29.9, GOCLAW)
    assert t.allowed("a", 30, GOCLAW)
    t2 = t.record("b", 86_400, GOCLAW)
    assert "a" not in t2.last and len(t2) == 1  # TTL eviction
    small = apply_overrides(GOCLAW, {}).model_copy(
        update={"probe": GOCLAW.probe.model_copy(update={"max_keys": 3})}
    )
    big = ProbeThrottle()
    for i in range(5):
        big = big.record(f"k{i}", float(i), small)
    assert sorted(big.last) == ["k2", "k3", "k4"]  # the oldest went first
    assert len(t) == 1  # values: recording never mutates


def _cooling_from_100(policy: Policy) -> Health:
    """A key whose third 503 within a minute, at t=100, cooled it (under ``policy``)."""
    h = Health(key="a")
    for t in (90.0, 95.0, 100.0):
        h = record_failure(h, Category.OVERLOADED, provider="x", now=t, policy=policy,
                           began_at=t - 1)
    return h


def test_a_failure_in_flight_when_the_key_started_cooling_restarts_its_window_unstepped() -> None:
    h = _cooling_from_100(DOMAIN)
    assert (h.error_count, h.cooldown_until) == (1, 160.0)
    for now in (101.0, 102.0, 103.0):  # requests begun at 99, before the cooling failure
        h = record_failure(h, Category.OVERLOADED, provider="x", now=now, policy=DOMAIN,
                           began_at=99.0)
    assert (h.error_count, h.last_failure_at, h.cooldown_until) == (1, 103.0, 163.0)
    # A same-route retry begun before the last failure is no second step either.
    h = record_repeat(h, Category.OVERLOADED, provider="x", now=104.0,
                      policy=DOMAIN.model_copy(update={"health": DOMAIN.health.model_copy(
                          update={"count_same_route_retries": True})}), began_at=99.0)
    assert (h.error_count, h.cooldown_until) == (1, 164.0)


def test_a_failure_begun_after_the_last_failure_still_steps_the_curve() -> None:
    h = _cooling_from_100(DOMAIN)
    h = record_failure(h, Category.OVERLOADED, provider="x", now=130.0, policy=DOMAIN,
                       began_at=120.0)
    assert (h.error_count, h.cooldown_until) == (2, 430.0)


def test_a_failure_whose_begin_is_unknown_steps_the_curve() -> None:
    h = _cooling_from_100(DOMAIN)
    h = record_failure(h, Category.OVERLOADED, provider="x", now=101.0, policy=DOMAIN)
    assert (h.error_count, h.cooldown_until) == (2, 401.0)


def test_an_overlapping_failure_after_the_window_expired_counts_again() -> None:
    h = _cooling_from_100(DOMAIN)
    h = record_failure(h, Category.OVERLOADED, provider="x", now=170.0, policy=DOMAIN,
                       began_at=99.0)  # the route reopened at 160: the curve starts over
    assert h.error_count == 0 and h.recent_failures == (170.0,)


def test_goclaw_and_fased_count_every_failure_of_a_burst_as_their_seeds_do() -> None:
    assert GOCLAW.health.count_overlapping_failures
    assert FASED.health.count_overlapping_failures
    assert not DOMAIN.health.count_overlapping_failures
    h = Health(key="provider:x")
    for now in (100.0, 101.0, 102.0, 103.0):
        h = record_failure(h, Category.OVERLOADED, provider="x", now=now, policy=GOCLAW,
                           began_at=99.0)
    assert (h.error_count, h.cooldown_until) == (4, 3703.0)


def test_a_policy_frozen_before_the_overlap_rule_counts_every_failure() -> None:
    frozen = DOMAIN.model_dump(mode="json")
    del frozen["health"]["count_overlapping_failures"]
    old = Policy.model_validate(frozen)
    assert old.health.count_overlapping_failures
    h = _cooling_from_100(old)
    h = record_failure(h, Category.OVERLOADED, provider="x", now=101.0, policy=old,
                       began_at=99.0)
    assert (h.error_count, h.cooldown_until) == (2, 401.0)


def test_a_success_in_flight_when_the_key_started_cooling_leaves_its_cooldown() -> None:
    # A long request (a stream) begun at 99, before the failure that cooled the key at 100,
    # answers at 120: it is evidence from before the outage, and the key keeps cooling.
    h = _cooling_from_100(DOMAIN)
    assert record_success(h, 120.0, DOMAIN, began_at=99.0) == h
    # The settle passes the Attempt's begin to the success as it does to a failure.
    route = Route(id="a", provider="x", model="m", group="g", recipient="r")
    [(_kind, _provider, update)] = health_updates(DOMAIN, route, None, Outcome.SUCCEEDED, None,
                                                  120.0, began_at=99.0).values()
    assert update(h) == h and not is_available(update(h), 120.0)


def test_a_success_begun_after_the_last_failure_clears_the_cooldown() -> None:
    h = _cooling_from_100(DOMAIN)
    for began in (100.0, 110.0):  # a request sent at or after the cooling failure: it works
        cleared = record_success(h, 120.0, DOMAIN, began_at=began)
        assert (cleared.error_count, cleared.cooldown_until) == (0, None)
        assert is_available(cleared, 120.0)


def _restarted_after_a_probe_began() -> Health:
    """Cooling since its counting failure at 100; a probe begins at 130; a request in flight
    since 99 fails at 140, the same outage: the window restarts from 140, unstepped."""
    h = _cooling_from_100(DOMAIN)
    h = record_failure(h, Category.OVERLOADED, provider="x", now=140.0, policy=DOMAIN,
                       began_at=99.0)
    assert (h.error_count, h.counted_at, h.last_failure_at, h.cooldown_until) == (
        1, 100.0, 140.0, 200.0)
    return h


def test_a_probe_begun_after_the_counting_failure_clears_though_a_late_failure_restarted_it(
) -> None:
    # The probe began at 130, after the outage was counted (100) and before the in-flight
    # failure that restarted the window (140): its success says the route is back.
    h = record_success(_restarted_after_a_probe_began(), 150.0, DOMAIN, began_at=130.0)
    assert (h.error_count, h.cooldown_until, h.counted_at) == (0, None, None)
    assert is_available(h, 150.0)
    # One in flight since before the count still clears nothing, however late it answers.
    h = _restarted_after_a_probe_began()
    assert record_success(h, 150.0, DOMAIN, began_at=99.0) == h


def test_a_probe_begun_after_the_counting_failure_steps_the_curve_when_it_fails() -> None:
    h = record_failure(_restarted_after_a_probe_began(), Category.OVERLOADED, provider="x",
                       now=150.0, policy=DOMAIN, began_at=130.0)
    assert (h.error_count, h.counted_at, h.last_failure_at, h.cooldown_until) == (
        2, 150.0, 150.0, 450.0)
    # The outage is counted again at 150: a request begun at 145 now overlaps it.
    again = record_failure(h, Category.OVERLOADED, provider="x", now=155.0, policy=DOMAIN,
                           began_at=145.0)
    assert (again.error_count, again.counted_at, again.cooldown_until) == (2, 150.0, 455.0)


def test_a_row_kept_before_counted_at_existed_measures_the_overlap_from_its_last_failure(
) -> None:
    # Migration 0019 leaves counted_at NULL: such a row behaves as it did before.
    h = _restarted_after_a_probe_began().model_copy(update={"counted_at": None})
    assert record_success(h, 150.0, DOMAIN, began_at=130.0) == h
    h = record_failure(h, Category.OVERLOADED, provider="x", now=150.0, policy=DOMAIN,
                       began_at=130.0)
    assert (h.error_count, h.counted_at, h.cooldown_until) == (1, None, 210.0)


def test_a_success_whose_begin_is_unknown_clears_the_cooldown() -> None:
    h = record_success(_cooling_from_100(DOMAIN), 120.0, DOMAIN)
    assert (h.error_count, h.cooldown_until) == (0, None)


def test_a_success_in_flight_after_the_window_expired_clears_the_counters() -> None:
    h = record_success(_cooling_from_100(DOMAIN), 170.0, DOMAIN, began_at=99.0)
    assert (h.error_count, h.cooldown_until, h.last_failure_at) == (0, None, 100.0)


def test_goclaw_and_fased_clear_on_every_success_as_their_seeds_do() -> None:
    for policy in (GOCLAW, FASED):
        h = record_failure(Health(key="p"), Category.OVERLOADED, provider="x", now=100.0,
                           policy=policy, began_at=99.0)
        assert not is_available(h, 120.0)
        h = record_success(h, 120.0, policy, began_at=50.0)
        assert (h.error_count, h.cooldown_until, h.last_used) == (0, None, 120.0)
