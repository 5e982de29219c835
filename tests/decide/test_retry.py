"""Same-route retry decisions beyond the first wait the vectors check."""

from __future__ import annotations

import random

from ledger.decide.classify import classify
from ledger.decide.retry import retry_decision
from ledger.domain.facts import Observation
from ledger.policy.load import preset
from tests.decide.retries import same_route_retries

GOCLAW = preset("goclaw")


def _fact(**kw: object):  # type: ignore[no-untyped-def]
    return classify(Observation.model_validate(kw), GOCLAW)


def test_overload_twice_then_exhausted() -> None:
    fact = _fact(status=503)
    rng = random.Random(1)
    first = retry_decision(fact, GOCLAW, 0, rng)
    second = retry_decision(fact, GOCLAW, 1, rng)
    third = retry_decision(fact, GOCLAW, 2, rng)
    assert first.retry and 1.6 <= (first.delay_s or 0) <= 2.4
    assert second.retry and 4.8 <= (second.delay_s or 0) <= 7.2
    assert not third.retry and third.reason == "exhausted"


def test_short_hint_is_a_floor_under_jitter() -> None:
    fact = _fact(status=503, headers={"Retry-After": "2"})
    waits = []
    for seed in range(100):
        d = retry_decision(fact, GOCLAW, 0, random.Random(seed))
        assert d.retry and 2.0 <= (d.delay_s or 0) <= 2.4
        waits.append(d.delay_s or 0)
    assert max(waits) > 2.0  # a short hint keeps the jitter above it


def test_long_hint_waited_exactly_for_every_retry() -> None:
    fact = _fact(status=503, headers={"Retry-After": "20"})  # at the cap: still retried
    for n in (0, 1):
        d = retry_decision(fact, GOCLAW, n, random.Random(n))
        assert (d.retry, d.delay_s, d.reason) == (True, 20.0, "retry_after")


def test_hint_over_cap_is_not_retried() -> None:
    fact = _fact(status=529, headers={"Retry-After": "20.5"})
    assert same_route_retries(fact, GOCLAW) == 0
    assert retry_decision(fact, GOCLAW, 0, random.Random(0)).reason == "retry_after_exceeds_cap"


def test_network_once_after_exactly_half_a_second() -> None:
    fact = _fact(transport="read_timeout")
    assert retry_decision(fact, GOCLAW, 0, random.Random(5)).delay_s == 0.5
    assert not retry_decision(fact, GOCLAW, 1, random.Random(5)).retry
    assert same_route_retries(_fact(transport="connect_timeout"), GOCLAW) == 0


def test_no_retry_after_a_tool_started_or_when_not_resubmittable() -> None:
    started = _fact(status=503, tool_started=True)
    assert retry_decision(started, GOCLAW, 0, random.Random(0)).reason == "tool_started"
    fd = preset("failure-domain")
    unknown = classify(Observation(transport="read_timeout"), fd)  # type: ignore[arg-type]
    assert retry_decision(unknown, fd, 0, random.Random(0)).reason == "not_resubmittable"


def test_presets_without_rules_never_retry() -> None:
    for name in ("fased", "failure-domain"):
        policy = preset(name)
        fact = classify(Observation(status=503), policy)
        assert same_route_retries(fact, policy) == 0
