"""A fleet that never takes itself down: the default policy's answers to ordinary faults.

Workers sharing one ledger, the README's defaults (``failure-domain``), a provider that blips:

1. a connection that provably never carried the request (refused, connect timeout) moves the
   request to an independent capacity group, never to another route of the same group; TLS
   failures never switch; the attempt is ``not_sent`` with its hold voided;
2. one failure is not an outage: a route cools for other Runs only after 3 failures within
   60 s; a turn whose every candidate is cooling waits for the first reopening within its wait
   bound and tries it as a probe, and stops at once (saying when) when that does not fit;
3. a stop names every candidate: how it failed, or why it was skipped and the fix.

Real HTTP over loopback (the shipped fake provider) on both backends; time is a ManualClock.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger import (
    AllowanceExhausted,
    AsyncLedger,
    Budget,
    CandidateSkipped,
    Envelope,
    FailoverExhausted,
    Grant,
    Ledger,
    ManualClock,
    Part,
    ProviderError,
    Route,
    preset,
)
from ledger.adapters import SyncAdapter, sync_sender
from ledger.api.turn import Dispatch, SendResult
from ledger.domain.records import AttemptKind, AttemptState, DebitState
from ledger.ops.audit import Audit
from ledger.policy.model import Policy, StreamingPolicy
from ledger.testing import FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import PRICE
from tests.netfaults import closed_port

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=6, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "system"]})
ENV = Envelope(parts=[Part(content="Compare the filings.")])
START = 1_800_000_000.0
HASH = "sha256:" + "e" * 64


def route(rid: str, group: str, endpoint: str, model: str | None = None) -> Route:
    return Route(id=rid, provider="fake", model=model or f"{rid}-model", group=group,
                 recipient="fake", endpoint=endpoint, price=PRICE)


def two_groups(fake: FakeProvider, primary_endpoint: str | None = None) -> list[Route]:
    """a (group ga), a2 (also ga, healthy) and b (group gb, healthy)."""
    up = fake.endpoint("openai")
    return [route("a", "ga", primary_endpoint or up), route("a2", "ga", up),
            route("b", "gb", up)]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as ledger:
        yield ledger


def served(led: Ledger, run_id: str, plan: list[Route], **kw: object) -> object:
    with led.run(run_id, plan=plan, budget=BUDGET, grant=GRANT, lease_ttl_s=3600,
                 **kw) as run:  # type: ignore[arg-type]
        return run.turn(ENV)


def stopped(led: Ledger, run_id: str, plan: list[Route], env: Envelope = ENV,
            **kw: object) -> FailoverExhausted:
    with pytest.raises(FailoverExhausted) as ei, led.run(
            run_id, plan=plan, budget=kw.pop("budget", BUDGET),  # type: ignore[arg-type]
            grant=kw.pop("grant", GRANT), lease_ttl_s=3600, **kw) as run:  # type: ignore[arg-type]
        run.turn(env)
    return ei.value


def models(fake: FakeProvider) -> list[str | None]:
    return [r.model for r in fake.requests]


# -- 1. a connection that never carried the request -----------------------------------------


def test_a_refused_connection_moves_to_an_independent_group_never_the_same_one(
        led: Ledger, fake: FakeProvider) -> None:
    plan = two_groups(fake, f"http://127.0.0.1:{closed_port()}/v1")
    res = served(led, "r", plan)
    assert res.route.id == "b"  # type: ignore[attr-defined]
    assert models(fake) == ["b-model"]  # a2 shares a's endpoint group: never tried
    first, second = led.timeline("r")
    assert (first.route_id, first.state, first.debit_state) == (
        "a", AttemptState.NOT_SENT, DebitState.VOIDED)
    assert (second.route_id, second.state) == ("b", AttemptState.SUCCEEDED)
    select = [e.data for e in led.events("r", ["select"]) if e.attempt_id == second.attempt_id]
    assert {s["route"]: s["reason"] for s in select[0]["skipped"]}["a2"] == (
        "independent_group_required")
    run = led.get_run("r")
    assert run.calls_used == 1 and run.reserved == 0  # the refused call counted nothing


def test_a_connect_timeout_moves_to_an_independent_group(
        db_url: str, fake: FakeProvider, full_backlog: int) -> None:
    policy = preset("failure-domain").model_copy(update={
        "streaming": StreamingPolicy(connect_timeout_s=0.5)})

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "r", plan=two_groups(fake, f"http://127.0.0.1:{full_backlog}/v1"),
                budget=BUDGET, grant=GRANT, policy=policy) as run:
            res = await run.turn(ENV)
            assert res.route.id == "b"
            first = (await led.timeline("r"))[0]
            assert first.state is AttemptState.NOT_SENT
            assert first.fact is not None and first.fact.transport is not None
            assert first.fact.transport.value == "connect_timeout"

    asyncio.run(main())
    assert models(fake) == ["b-model"]


def test_a_tls_failure_never_switches(led: Ledger, fake: FakeProvider) -> None:
    tls = fake.endpoint("openai").replace("http://", "https://")  # the fake speaks plain HTTP
    err = stopped(led, "r", two_groups(fake, tls))
    assert err.reason == "not_eligible_failure" and models(fake) == []
    [att] = led.timeline("r")
    assert att.state is AttemptState.NOT_SENT and att.category == "tls"


# -- 2. one failure is not an outage --------------------------------------------------------


def test_one_503_on_each_of_two_routes_darkens_nothing_for_the_next_run(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="a-model")
    fake.enqueue(Fault.UNAVAILABLE, model="b-model")
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    assert stopped(led, "first", plan).reason == "no_candidate"
    health = led.health(["a", "b"])  # each failure is remembered, and cools nothing
    assert all(h.available(clock.now()) and h.error_count == 0 for h in health.values())
    assert [len(health[k].recent_failures) for k in ("a", "b")] == [1, 1]
    report = Audit(led).health()  # what `failover-ledger health` shows an operator
    assert {(k.key, k.status, k.recent_failures) for k in report.routes} == {
        ("a", "ok", 1), ("b", "ok", 1)}
    clock.advance(1)
    res = served(led, "next", plan)  # a worker's next Run, a second later
    assert res.route.id == "a" and len(res.attempts) == 1  # type: ignore[attr-defined]
    assert clock.slept == []
    assert led.health(["a"])["a"].recent_failures == ()  # a success forgets them


def _trip(led: Ledger, fake: FakeProvider, clock: ManualClock, plan: list[Route],
          prefix: str, both: bool) -> None:
    """Three Runs, ten seconds apart, meet a 503 on ``a`` (and on ``b`` with ``both``)."""
    for i in range(3):
        fake.enqueue(Fault.UNAVAILABLE, model="a-model")
        if both:
            fake.enqueue(Fault.UNAVAILABLE, model="b-model")
            stopped(led, f"{prefix}{i}", plan)
        else:
            assert served(led, f"{prefix}{i}", plan).route.id == "b"  # type: ignore[attr-defined]
        clock.advance(10)


def test_three_failures_within_a_minute_cool_the_route_for_every_worker(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    _trip(led, fake, clock, plan, "w", both=False)
    fake.clear()
    res = served(led, "next", plan)
    assert res.route.id == "b" and models(fake) == ["b-model"]  # type: ignore[attr-defined]
    [select] = led.events("next", ["select"])
    assert select.data["skipped"][0]["route"] == "a"
    assert select.data["skipped"][0]["reason"] == "route_cooldown"


def _burst(led: Ledger, fake: FakeProvider, clock: ManualClock, policy: Policy,
           workers: int) -> str:
    """``workers`` Runs send to ``a`` a second apart, all in flight before the first 503 returns.

    Each worker's send begins the next worker's Run before its own request leaves, so every
    Attempt is begun first; the 503s then come back two seconds apart, the last begun first.
    Returns the health key of ``a``.
    """
    a = route("a", "ga", fake.endpoint("openai"))
    fake.set_default(Fault.UNAVAILABLE, model="a-model")
    real = sync_sender(SyncAdapter())

    def worker(i: int) -> None:
        nested = [i + 1 < workers]

        def send(d: Dispatch) -> SendResult:
            if nested.pop() if nested else False:
                clock.advance(1)
                worker(i + 1)  # begun while this worker's Attempt is in flight
            clock.advance(1)
            return real(d)

        with pytest.raises(FailoverExhausted), led.run(
                f"w{i}", plan=[a], budget=BUDGET, grant=GRANT, policy=policy,
                lease_ttl_s=3600) as run:
            run.turn(ENV, send=send)

    worker(0)
    return "a" if policy.health.key == "route" else "provider:fake"


def test_requests_in_flight_when_the_route_starts_cooling_step_its_curve_once(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    key = _burst(led, fake, clock, preset("failure-domain"), workers=8)
    h = led.health([key])[key]
    last = max(att.settled_at or 0.0 for i in range(8) for att in led.timeline(f"w{i}"))
    # The third 503 cooled the route for 60 s; the five requests already in flight restart
    # that minute from the last of them, but do not make it 5 m, 25 m, then the hour.
    assert h.error_count == 1
    assert h.cooldown_until == pytest.approx(last + 60)


def test_under_goclaw_every_worker_in_a_burst_steps_the_curve_as_its_seed_does(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    key = _burst(led, fake, clock, preset("goclaw"), workers=8)
    h = led.health([key])[key]
    last = max(att.settled_at or 0.0 for i in range(8) for att in led.timeline(f"w{i}"))
    assert h.error_count == 8  # one per request (its same-route retries count once with it)
    assert h.cooldown_until == pytest.approx(last + 3600)


def test_a_hosts_own_settles_of_a_burst_step_the_curve_once_whichever_ledger_settles_them(
        db_url: str, led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    a = route("a", "ga", fake.endpoint("openai"))
    leases, attempts = [], []
    for i in range(6):  # six requests begun before any of them failed
        led.admit_run(f"h{i}", plan=[a], budget=BUDGET, grant=GRANT)
        leases.append(led.acquire_lease(f"h{i}", ttl_s=3600))
        attempts.append(led.begin_attempt(leases[-1], route="a", envelope_hash=HASH,
                                          reserve="0.01").attempt_id)
        clock.advance(1)
    with Ledger.open(db_url, clock=clock) as other:  # it never saw the begins: it reads them
        for i, (lease, att) in enumerate(zip(leases, attempts, strict=True)):
            clock.advance(1)
            (led if i % 2 else other).settle_attempt(lease, att, outcome="failed",
                                                     observation={"status": 503})
    h = led.health(["a"])["a"]
    assert h.error_count == 1 and h.cooldown_until == pytest.approx(clock.now() + 60)
    # A request begun after the route went dark is another outage: it steps the curve.
    led.admit_run("late", plan=[a], budget=BUDGET, grant=GRANT)
    lease = led.acquire_lease("late", ttl_s=3600)
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH,
                            reserve="0.01").attempt_id
    clock.advance(1)
    led.settle_attempt(lease, att, outcome="failed", observation={"status": 503})
    h = led.health(["a"])["a"]
    assert h.error_count == 2 and h.cooldown_until == pytest.approx(clock.now() + 300)


def test_when_every_candidate_cools_the_turn_waits_for_the_first_reopening_and_probes_it(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    _trip(led, fake, clock, plan, "w", both=True)  # a and b trip at +20 s: cool until +80 s
    a_until = led.health(["a"])["a"].cooldown_until
    assert a_until is not None
    clock.set(a_until - 12)  # both still cooling; a reopens first, within the 30 s bound
    clock.slept.clear()
    fake.clear()
    res = served(led, "next", plan)
    assert res.route.id == "a" and models(fake) == ["a-model"]  # type: ignore[attr-defined]
    assert clock.slept == [pytest.approx(12.0)]
    [att] = led.timeline("next")
    assert att.kind is AttemptKind.PROBE and att.state is AttemptState.SUCCEEDED
    [wait] = led.events("next", ["wait"])
    assert wait.data["for"] == "reopening" and wait.data["route"] == "a"
    assert wait.data["waited_s"] == pytest.approx(12.0)


def test_a_reopening_beyond_the_wait_bound_stops_at_once_and_says_when(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    _trip(led, fake, clock, plan, "w", both=True)
    clock.slept.clear()
    fake.clear()
    err = stopped(led, "next", plan)
    assert err.reason == "no_candidate" and err.attempts == [] and clock.slept == []
    assert models(fake) == []
    text = str(err)
    assert "the first candidate reopens at" in text and "admission.max_capacity_wait_s" in text
    assert "a: skipped (route_cooldown)" in text and "b: skipped (route_cooldown)" in text
    assert {type(e) for e in err.exceptions} == {CandidateSkipped}
    assert sorted(e.route for e in err.exceptions) == ["a", "b"]  # type: ignore[attr-defined]


def test_a_reopening_after_the_runs_deadline_is_not_waited(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    _trip(led, fake, clock, plan, "w", both=True)
    a_until = led.health(["a"])["a"].cooldown_until
    assert a_until is not None
    clock.set(a_until - 12)
    clock.slept.clear()
    err = stopped(led, "next", plan, deadline=a_until - 1)
    assert err.reason == "no_candidate" and clock.slept == [] and err.attempts == []


def test_after_a_failure_the_turn_also_waits_for_a_cooling_backup(
        led: Ledger, fake: FakeProvider, clock: ManualClock) -> None:
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    # b alone trips (three Runs whose primary is b); a stays healthy.
    for i in range(3):
        fake.enqueue(Fault.UNAVAILABLE, model="b-model")
        assert served(led, f"w{i}", plan[::-1]).route.id == "a"  # type: ignore[attr-defined]
        clock.advance(10)
    b_until = led.health(["b"])["b"].cooldown_until
    assert b_until is not None
    clock.set(b_until - 5)
    clock.slept.clear()
    fake.clear()
    fake.enqueue(Fault.UNAVAILABLE, model="a-model")  # the primary blips once
    res = served(led, "next", plan)
    # Within this Run a is not retried by the turn; b reopens in 5 s: waited for, probed.
    assert res.route.id == "b" and models(fake) == ["a-model", "b-model"]  # type: ignore
    assert clock.slept == [pytest.approx(5.0)]
    assert [a.kind for a in led.timeline("next")] == [AttemptKind.FIRST, AttemptKind.PROBE]


# -- 3. stops that explain themselves -------------------------------------------------------


def test_a_stop_names_every_candidate_and_the_fix(led: Ledger, fake: FakeProvider) -> None:
    # The README's two-class grant and a system prompt: no route may receive the system text.
    grant = Grant(recipients={"fake": ["user_input", "model_derived"]})
    env = Envelope(parts=[Part(role="system", data_class="system", content="Be terse."),
                          Part(content="Compare the filings.")])
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    err = stopped(led, "r", plan, env, grant=grant)
    assert err.reason == "no_candidate" and models(fake) == []
    text = str(err)
    for rid in ("a", "b"):
        assert (f"{rid}: skipped (disclosure): recipient 'fake' is not approved for: system"
                f" — fix: add system to Grant.recipients['fake']") in text
    assert "no attempt was made" not in text
    assert all(isinstance(e, CandidateSkipped) and e.fix for e in err.exceptions)
    assert [e.route for e in err.exceptions] == ["a", "b"]  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == text and back.exceptions[0].fix == err.exceptions[0].fix
    stop = led.events("r", ["stop"])[-1].data
    assert any("Grant.recipients['fake']" in line for line in stop["candidates"])


def test_a_stop_after_a_failure_names_the_failure_and_the_skip(
        led: Ledger, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="a-model")
    plan = [route("a", "ga", fake.endpoint("openai")),
            route("b", "gb", fake.endpoint("openai")).model_copy(
                update={"roles": ["reviewer"]})]
    err = stopped(led, "r", plan)
    text = str(err)
    assert ("a: failed: fake/a-model: overloaded (HTTP 503, code server_error): The engine is "
            "currently overloaded, please try again later." in text)
    assert "b: skipped (not_qualified)" in text and "add 'research' to Route(id='b').roles" in text
    assert [type(e) for e in err.exceptions] == [ProviderError, CandidateSkipped]


def test_a_stop_says_an_unknown_attempt_may_have_run_and_keeps_its_hold(
        led: Ledger, fake: FakeProvider) -> None:
    # Reset after the request left: not a failure an operator may forget, since the provider
    # may have run it and its hold is kept.
    fake.enqueue(Fault.RESET_BEFORE_HEADERS, model="a-model")
    plan = [route("a", "ga", fake.endpoint("openai")), route("b", "gb", fake.endpoint("openai"))]
    err = stopped(led, "r", plan)
    assert err.reason == "execution_unknown"
    [line, untried] = err.fields["candidates"]
    assert line.startswith("a: unknown (may have run; hold kept): fake/a-model: network "
                           "(connection_reset, after_send)"), line
    assert untried == "b: not tried (the turn stopped first)"
    assert led.events("r", ["stop"])[-1].data["candidates"] == err.fields["candidates"]


def test_a_stop_says_a_refused_connection_was_not_sent(led: Ledger) -> None:
    # Nothing left the process: no money owed, nothing that may have run.
    plan = [route("a", "ga", f"http://127.0.0.1:{closed_port()}/v1")]
    err = stopped(led, "r", plan)
    [line] = err.fields["candidates"]
    assert line.startswith("a: not sent: "), line
    assert "connect_refused" in line, line


def test_max_calls_zero_stops_on_the_call_allowance(led: Ledger, fake: FakeProvider) -> None:
    plan = [route("a", "ga", fake.endpoint("openai"))]
    err = stopped(led, "r", plan,
                  budget=Budget(max_calls=0, max_retries=3, max_cost=Decimal("1")))
    assert err.reason == "call_allowance" and "max_calls" in str(err)
    [e] = err.exceptions
    assert isinstance(e, AllowanceExhausted) and e.route == "a"
