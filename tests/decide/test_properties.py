"""Properties of the pure core: a total classifier, bounded monotone cooldowns, bounded jitter."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.decide.classify import classify
from ledger.decide.health import (
    cooldown_seconds,
    disable_seconds,
    is_available,
    record_failure,
    unavailable_until,
)
from ledger.decide.hints import gemini_retry_delay, parse_retry_after, parse_retry_after_ms
from ledger.decide.retry import retry_decision
from ledger.domain.facts import Category, Observation, Phase, Source, Transport, WireProtocol
from ledger.domain.values import Health
from ledger.policy.load import PRESETS, preset
from ledger.policy.model import (
    CooldownCurve,
    DisableRule,
    HealthPolicy,
    MoveRule,
    Policy,
    RetryRule,
)
from tests.decide.retries import same_route_retries

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICIES = [preset(n) for n in PRESETS]
# A policy that fails over says what moves on (refused otherwise), beside the point here.
MOVES = [MoveRule(categories=[Category.OVERLOADED])]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
error_words = st.sampled_from(
    ["code", "type", "status", "message", "details", "retryDelay", "@type", "error"]
)
error_objects = st.dictionaries(error_words, json_values, max_size=6)
bodies = st.one_of(
    st.none(),
    st.binary(max_size=300),
    st.text(max_size=300),
    json_values.map(json.dumps),
    error_objects.map(lambda e: json.dumps({"error": e})),
    error_objects.map(lambda e: json.dumps([{"error": e}])),
)
header_values = st.one_of(
    st.text(max_size=60),
    st.integers(-(10**40), 10**40).map(str),
    st.sampled_from(["Wed, 21 Oct 2015 07:28:00 GMT", "Fri, 31 Dec 9999 23:59:59 GMT", "0", "-1"]),
)
headers = st.dictionaries(
    st.sampled_from(["Retry-After", "retry-after", "Date", "X-Other"]) | st.text(max_size=20),
    header_values,
    max_size=5,
)
observations = st.builds(
    Observation,
    # Every status an Observation accepts (the three digits of a status line, 0 to 999).
    status=st.none() | st.integers(0, 999),
    headers=headers,
    body=bodies,
    protocol=st.sampled_from(list(WireProtocol)),
    provider=st.none() | st.sampled_from(["openrouter", "OpenAI", ""]) | st.text(max_size=10),
    message=st.none() | st.text(max_size=100),
    transport=st.none() | st.sampled_from(list(Transport)),
    phase=st.none() | st.sampled_from(list(Phase)),
    source=st.sampled_from(list(Source)),
    effective_output=st.booleans(),
    tool_started=st.booleans(),
    cancelled=st.booleans(),
    over_token_budget=st.booleans(),
)
nows = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 4e9)
# classify refuses a NaN or infinite ``now`` as a misuse (tests/test_misuse.py).
finite_nows = st.none() | st.floats(allow_nan=False, allow_infinity=False) | st.floats(0, 4e9)


@FEW
@given(obs=observations, now=finite_nows, which=st.integers(0, len(POLICIES) - 1))
def test_classify_is_total_and_consistent(obs: Observation, now: float | None, which: int) -> None:
    policy = POLICIES[which]
    fact = classify(obs, policy, now)
    assert fact.phase is obs.effective_phase()
    if fact.retry_after_s is not None:
        assert 0 <= fact.retry_after_s <= policy.classification.retry_after_limit_s
    if fact.message is not None:
        assert len(fact.message) <= policy.classification.message_limit_chars
    if obs.tool_started:
        assert not fact.moves_on and not fact.resubmit
    if fact.moves_on:
        assert fact.resubmit
    json.dumps(fact.to_json())  # always serialisable evidence
    decision = retry_decision(fact, policy, 0, random.Random(0))
    assert decision.retry == (same_route_retries(fact, policy) > 0)


@FEW
@given(
    value=st.none() | st.text(max_size=80) | header_values,
    now=nows,
    date=st.none() | st.text(max_size=40),
)
def test_retry_after_parsing_never_raises(
    value: str | None, now: float | None, date: str | None
) -> None:
    got = parse_retry_after(value, now=now, date=date)
    assert got is None or got >= 0
    in_ms = parse_retry_after_ms(value)
    assert in_ms is None or in_ms >= 0


@FEW
@given(error=json_values)
def test_retry_info_parsing_never_raises(error: Any) -> None:
    got = gemini_retry_delay(error)
    assert got is None or got >= 0


curves = st.builds(
    CooldownCurve,
    base_s=st.floats(0.001, 1e6),
    factor=st.floats(1, 1000),
    max_exponent=st.integers(0, 64),
    cap_s=st.floats(1e6, 1e9),
)


@FEW
@given(curve=curves, n=st.integers(0, 10_000))
def test_cooldowns_monotone_and_capped(curve: CooldownCurve, n: int) -> None:
    policy = Policy(name="p", moves_on=MOVES, health=HealthPolicy(cooldown=curve))
    a, b = cooldown_seconds(n, policy), cooldown_seconds(n + 1, policy)
    assert 0 <= a <= b <= curve.cap_s


@FEW
@given(
    k=st.integers(0, 100_000),
    base=st.floats(1, 1e6),
    factor=st.floats(1, 1000),
    provider=st.none() | st.sampled_from(["openai", "other"]),
)
def test_disables_monotone_and_capped(
    k: int, base: float, factor: float, provider: str | None
) -> None:
    rule = DisableRule(
        categories=[Category.BILLING],
        base_s=base,
        factor=factor,
        cap_s=2e6,
        base_s_by_provider={"openai": base / 2},
    )
    a, b = disable_seconds(k, rule, provider), disable_seconds(k + 1, rule, provider)
    assert 0 <= a <= b <= rule.cap_s


@FEW
@given(
    events=st.lists(
        st.tuples(st.floats(0, 1e5), st.sampled_from(list(Category))), min_size=1, max_size=12
    ),
    which=st.integers(0, len(POLICIES) - 1),
)
def test_recorded_failures_never_exceed_caps(
    events: list[tuple[float, Category]], which: int
) -> None:
    policy = POLICIES[which]
    h = Health(key="k")
    longest = max([policy.health.cooldown.cap_s, *(r.cap_s for r in policy.health.disables)])
    for t, category in sorted(events, key=lambda e: e[0]):
        h = record_failure(h, category, provider="p", now=t, policy=policy)
        until = unavailable_until(h, t)
        assert until is None or until - t <= longest + 1e-6
        assert h.error_count >= 0
        if until is not None:
            assert not is_available(h, t) and is_available(h, until)


retry_rules = st.builds(
    RetryRule,
    categories=st.just([Category.OVERLOADED]),
    max=st.just(3),
    delays_s=st.lists(st.floats(0, 1e4), min_size=3, max_size=3),
    jitter=st.floats(0, 0.999),
    honor_retry_after=st.booleans(),
)


@FEW
@given(
    rule=retry_rules,
    seed=st.integers(0, 2**32),
    n=st.integers(0, 2),
    hint=st.none() | st.floats(0, 50),
)
def test_jittered_waits_stay_in_bounds(
    rule: RetryRule, seed: int, n: int, hint: float | None
) -> None:
    policy = Policy(name="p", moves_on=MOVES, same_route_retry=[rule])
    fact = classify(Observation(status=503), policy).model_copy(update={"retry_after_s": hint})
    d = retry_decision(fact, policy, n, random.Random(seed))
    nominal = rule.delays_s[n]
    assert d.retry and d.delay_s is not None
    honoured = hint if rule.honor_retry_after else None
    if honoured is not None and honoured > nominal:
        assert d.delay_s == honoured  # a longer hint is waited out exactly
    else:
        lo, hi = nominal * (1 - rule.jitter), nominal * (1 + rule.jitter)
        assert lo - 1e-9 <= d.delay_s <= max(hi, honoured or 0.0) + 1e-9
    if honoured is not None:
        assert d.delay_s >= honoured  # never shorter than the hint
