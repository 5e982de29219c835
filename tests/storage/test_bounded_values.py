"""Values are bounded and finite everywhere (invariants 2 and 4).

Every number that reaches storage is checked at the API boundary (a typed InvalidArgument
naming the field, nothing written); a provider's out-of-range usage never loses a success; a
wait or cooldown derived from a hint is capped by the policy.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.api.facade import Ledger
from ledger.api.turn import SendResult, execute
from ledger.clock import ManualClock
from ledger.decide.classify import classify
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, FailureFact, Observation, Phase, Scope, Source
from ledger.domain.records import AttemptState, DebitState
from ledger.errors import InvalidArgument, NotFound
from ledger.ops.reconcile import reconcile
from ledger.policy.load import preset

from .helpers import budget, grant, routes

T0 = 80_000.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r1", plan=routes(), budget=budget(calls=1000, retries=100), grant=grant())
        yield led


@pytest.mark.parametrize("field,value", [
    ("prompt_tokens", 2**63), ("prompt_tokens", -1), ("completion_tokens", 2**70),
    ("prompt_tokens", True), ("cost", "inf"), ("cost", "NaN"), ("cost", "1e30"),
    ("cost", -0.5), ("cost", "abc"),
])
def test_out_of_range_settle_values_are_refused_and_nothing_is_written(
        led: Ledger, field: str, value: Any) -> None:
    lease = led.acquire_lease("r1")
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01")
    before = led.get_run("r1")
    with pytest.raises(InvalidArgument) as ei:
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", **{field: value})
    assert ei.value.field == field
    assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING
    assert led.get_run("r1") == before


def test_a_runs_labels_are_bounded_at_admission_and_a_refusal_writes_nothing(
        led: Ledger) -> None:
    """Every Attempt row copies its Run's labels, so their number is bounded where they enter:
    at most 64, for a Run and for a Child alike; more is refused before any row is written."""
    most = {f"k{i}": "v" * 200 for i in range(64)}
    led.admit_run("wide", plan=routes(), budget=budget(), grant=grant(), labels=most)
    assert led.get_run("wide").labels == most
    lease = led.acquire_lease("r1")
    for run_id, parent in (("huge", None), ("huge-child", lease)):
        before = led.get_run("r1")
        with pytest.raises(InvalidArgument) as ei:
            led.admit_run(run_id, plan=routes(), budget=budget(calls=1, retries=0,
                                                               cost="0.01"),
                          parent=parent, labels={f"k{i}": "v" for i in range(50_000)})
        assert ei.value.field == "labels" and "at most 64" in str(ei.value)
        with pytest.raises(NotFound):
            led.get_run(run_id)
        assert led.get_run("r1") == before  # nothing carved out of the parent


def test_a_provider_reporting_absurd_usage_never_loses_the_success(led: Ledger) -> None:
    lease = led.acquire_lease("r1")
    env = Envelope(parts=[Part(content="hi")], max_output_tokens=10)

    def send(_d: object) -> SendResult:
        return SendResult(ok=True, output="answer", prompt_tokens=2**70,
                          completion_tokens=-5, cost=Decimal("1e40"))

    res = execute(led, lease, env, send, reserve=Decimal("0.02"))  # type: ignore[arg-type]
    att = led.get_attempt(res.attempt.attempt_id)
    assert att.state is AttemptState.SUCCEEDED and att.debit_state is DebitState.POSTED
    assert att.prompt_tokens is None and att.cost is None
    assert led.get_run("r1").posted == Decimal("0.02")  # the whole hold is posted
    [ev] = led.events("r1", ["usage_invalid"])
    assert ev.data["prompt_tokens"] == str(2**70) and ev.data["cost"] == "1E+40"
    assert reconcile(led).ok


def test_a_reported_count_too_long_to_write_never_loses_the_success(led: Ledger) -> None:
    """``str()`` refuses an integer of over 4,300 digits: the usage_invalid event says what it
    was instead of failing the settle, and keeps every value it holds short."""
    lease = led.acquire_lease("r1")
    env = Envelope(parts=[Part(content="hi")], max_output_tokens=10)

    def send(_d: object) -> SendResult:
        return SendResult(ok=True, output="answer", prompt_tokens=10**5000,
                          completion_tokens="7" * 10_000)  # type: ignore[arg-type]

    res = execute(led, lease, env, send, reserve=Decimal("0.02"))  # type: ignore[arg-type]
    att = led.get_attempt(res.attempt.attempt_id)
    assert att.state is AttemptState.SUCCEEDED and att.prompt_tokens is None
    assert led.get_run("r1").posted == Decimal("0.02")
    [ev] = led.events("r1", ["usage_invalid"])
    assert ev.data["prompt_tokens"] == f"an integer of {(10**5000).bit_length()} bits"
    assert ev.data["completion_tokens"].startswith("7" * 200 + "...")
    assert len(ev.data["completion_tokens"]) < 250
    assert reconcile(led).ok


@pytest.mark.parametrize("ttl", [math.inf, math.nan, -1.0, 0.0, 1e9, "30"])
def test_lease_ttl_is_finite_and_bounded(led: Ledger, ttl: Any) -> None:
    with pytest.raises(InvalidArgument) as ei:
        led.acquire_lease("r1", ttl_s=ttl)
    assert ei.value.field == "ttl_s"
    assert led.get_run("r1").lease_holder is None


def test_infinite_or_nan_hints_are_refused_in_host_facts() -> None:
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(ValueError):
            FailureFact(category=Category.RATE_LIMIT, phase=Phase.AFTER_HEADERS, retry_after_s=bad)


def test_a_huge_host_hint_closes_a_group_for_at_most_the_policy_cap(
        led: Ledger, clock: ManualClock) -> None:
    lease = led.acquire_lease("r1")
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01")
    fact = FailureFact(category=Category.RATE_LIMIT, status=429, phase=Phase.AFTER_HEADERS,
                       scope=Scope.GROUP, source=Source.PROVIDER, retry_after_s=1e308)
    led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=fact)
    cap = preset("failure-domain").classification.retry_after_limit_s
    assert cap == 3600
    assert led.group_projections(["g"])["g"].until == T0 + cap


def test_retry_after_dated_in_year_9999_is_capped_at_an_hour() -> None:
    obs = Observation(status=429, headers={"Retry-After": "Fri, 31 Dec 9999 23:59:59 GMT"})
    for name in ("goclaw", "fased", "failure-domain"):
        fact = classify(obs, preset(name), now=T0)
        assert fact.retry_after_s == 3600


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pt=st.one_of(st.none(), st.integers(min_value=-10, max_value=2**70)),
       ct=st.one_of(st.none(), st.integers(min_value=-10, max_value=2**70)),
       cost=st.one_of(st.none(), st.decimals(allow_nan=True, allow_infinity=True),
                      st.floats(allow_nan=True, allow_infinity=True)))
def test_property_settle_stores_exactly_what_it_accepts(tmp_path_factory: pytest.TempPathFactory,
                                                        sqlite_template: str,
                                                        pt: int | None, ct: int | None,
                                                        cost: Any) -> None:
    db = str(tmp_path_factory.mktemp("prop") / "l.db")
    shutil.copyfile(sqlite_template, db)  # a migrated ledger, without migrating each example
    with Ledger.open(db, clock=ManualClock(T0)) as led:
        led.admit_run("r", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r")
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.5")
        try:
            done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded",
                                      prompt_tokens=pt, completion_tokens=ct, cost=cost)
        except InvalidArgument as e:
            assert e.field in ("prompt_tokens", "completion_tokens", "cost")
            assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING
            return
        assert done.prompt_tokens == pt and done.completion_tokens == ct
        stored = led.get_attempt(att.attempt_id)
        assert stored.state is AttemptState.SUCCEEDED
        posted = led.get_run("r").posted
        assert 0 <= posted <= Decimal("0.5")
        check = reconcile(led)
        assert not check.violations
        assert bool(check.cost_over_hold) == (done.cost is not None and done.cost > Decimal("0.5"))


@settings(max_examples=200, deadline=None)
@given(hint=st.floats(allow_nan=True, allow_infinity=True),
       header=st.one_of(st.none(), st.text(max_size=40),
                        st.sampled_from(["-1", "1e309", "NaN", "inf",
                                         "Thu, 01 Jan 1970 00:00:00 GMT",
                                         "Fri, 31 Dec 9999 23:59:59 GMT"])))
def test_property_every_fact_hint_is_finite_and_capped(hint: float, header: str | None) -> None:
    pol = preset("failure-domain")
    obs = Observation(status=429, headers={"Retry-After": header} if header is not None else {},
                      body='{"error": {"details": [{"@type": "type.googleapis.com/'
                           f'google.rpc.RetryInfo", "retryDelay": "{hint}s"}}]}}}}')
    fact = classify(obs, pol, now=T0)
    if fact.retry_after_s is not None:
        assert math.isfinite(fact.retry_after_s)
        assert 0 <= fact.retry_after_s <= pol.classification.retry_after_limit_s
