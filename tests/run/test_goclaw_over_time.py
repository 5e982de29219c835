"""The `goclaw` preset behaves like GoClaw over time (seeds 000/001), through the public API.

Each test drives ``admit_run`` / ``execute`` with a ``ManualClock`` (also the sleeper, so the
same-provider backoffs advance it) on SQLite and PostgreSQL, and checks the rule of the seed it
is named after: one cooldown step per request, the cooldown belongs to the provider, a fallback
that cannot be built is logged and skipped, the token budget stops the request, the probe state
is bounded and a refused probe never loops, and usage stats read as an operator reads them.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from email.utils import format_datetime
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import faults
from ledger.adapters import StaticSecretProvider, SyncAdapter, sync_sender
from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.decide.health import ProbeThrottle
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, Transport, WireProtocol
from ledger.domain.records import AttemptKind, AttemptState, Lease
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted, LeaseLost, PolicyError
from ledger.policy.load import preset, validate_policy
from ledger.storage.engine import normalize_url
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

FREE = Price()
FLASH = Route(id="gemini-flash", provider="gemini", model="gemini-3-flash", group="gemini",
              recipient="google", price=FREE)
PRO = Route(id="gemini-pro", provider="gemini", model="gemini-3-pro", group="gemini",
            recipient="google", price=FREE)
DEEPSEEK = Route(id="deepseek", provider="deepseek", model="deepseek-v4-flash", group="deepseek",
                 recipient="deepseek", price=FREE)
MINI = Route(id="gpt-mini", provider="openai", model="gpt-4o-mini", group="openai",
             recipient="openai", price=FREE)
GRANT = Grant(recipients={r: ["user_input"] for r in ("google", "deepseek", "openai")})
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)

OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal(0))
OVERLOADED = SendResult.failed(Observation(status=503, body="The model is overloaded"))
RATE_LIMITED = SendResult.failed(Observation(status=429, body="Too Many Requests"))
GEMINI = "provider:gemini"


class Script:
    """Per route: the queued results in order (the last one repeats); records the routes sent."""

    def __init__(self, by_route: dict[str, list[SendResult]] | None = None) -> None:
        self.queues = {k: list(v) for k, v in (by_route or {}).items()}
        self.sent: list[str] = []
        self.kinds: list[AttemptKind] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d.route.id)
        self.kinds.append(d.kind)
        q = self.queues.get(d.route.id) or [OK]
        return q.pop(0) if len(q) > 1 else q[0]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(50_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as ledger:
        yield ledger


def goclaw(**sections: dict[str, Any]) -> dict[str, Any]:
    """The goclaw preset as a mapping, with fields of some sections changed."""
    data = preset("goclaw").model_dump(mode="json")
    for name, fields in sections.items():
        data[name] = {**data[name], **fields}
    return data


def admit(led: Ledger, run_id: str, plan: list[Route], *, policy: Any = "goclaw",
          retries: int = 6, calls: int = 10, tokens: int | None = None) -> Lease:
    led.admit_run(run_id, plan=plan, grant=GRANT, policy=policy,
                  budget=Budget(max_calls=calls, max_retries=retries, max_cost=Decimal(1),
                                max_tokens=tokens))
    return led.acquire_lease(run_id, ttl_s=3600)


def gemini(led: Ledger) -> Any:
    return led.health([GEMINI])[GEMINI]


# -- 1. one cooldown step per request ----------------------------------------------------------


def test_an_overload_retried_twice_steps_the_providers_cooldown_once_per_request(
        led: Ledger, clock: ManualClock) -> None:
    plan = [FLASH, DEEPSEEK]
    for turn in range(3):
        # Flapping: the provider is overloaded for each of three requests, each at the end of
        # the cooldown the one before it left, then it is back.
        send = Script({"gemini-flash": [OVERLOADED]})
        res = execute(led, admit(led, f"r{turn}", plan), ENV, send, rng=random.Random(turn))
        assert res.route.id == "deepseek"
        assert send.sent == ["gemini-flash"] * 3 + ["deepseek"]  # asked again twice, then on
        last_try = [a for a in led.timeline(f"r{turn}") if a.route_id == "gemini-flash"][-1]
        h = gemini(led)
        # One failure of the provider per request, however often it was asked: 1 minute from
        # its last try, not 60 s -> 300 s -> 1,500 s inside one request.
        assert (h.error_count, h.failure_counts) == (1, {"overloaded": 1})
        assert h.cooldown_until == pytest.approx(last_try.settled_at + 60)
        clock.set(h.cooldown_until)
    send = Script({"gemini-flash": [OK]})
    res = execute(led, admit(led, "back", plan), ENV, send)
    assert res.route.id == "gemini-flash" and send.sent == ["gemini-flash"]
    assert gemini(led).error_count == 0


def test_a_policy_that_counts_every_try_steps_the_cooldown_per_retry(led: Ledger) -> None:
    lease = admit(led, "r", [FLASH, DEEPSEEK],
                  policy=goclaw(health={"count_same_route_retries": True}))
    execute(led, lease, ENV, Script({"gemini-flash": [OVERLOADED]}), rng=random.Random(1))
    last_try = [a for a in led.timeline("r") if a.route_id == "gemini-flash"][-1]
    h = gemini(led)
    assert h.error_count == 3 and h.cooldown_until == pytest.approx(last_try.settled_at + 1500)


# -- 2. the cooldown belongs to the provider ---------------------------------------------------


def test_a_providers_cooldown_is_shared_by_every_route_of_that_provider(
        led: Ledger, clock: ManualClock) -> None:
    plan = [FLASH, PRO, DEEPSEEK]
    send = Script({"gemini-flash": [RATE_LIMITED]})  # a rate limit moves on, never retried
    res = execute(led, admit(led, "r1", plan), ENV, send)
    assert res.route.id == "deepseek" and send.sent == ["gemini-flash", "deepseek"]
    moved = led.events("r1", ["select"])[-1].data
    assert {s["route"]: s["reason"] for s in moved["skipped"]}["gemini-pro"] == "route_cooldown"
    health = led.health()
    assert "gemini-flash" not in health and "gemini-pro" not in health
    assert health[GEMINI].error_count == 1 and health["provider:deepseek"].error_count == 0
    # The probe of the agent's own provider is throttled per provider: 30 s later, inside the
    # 2-minute margin, one request probes it and a success clears the whole provider.
    clock.advance(30)
    send = Script()
    res = execute(led, admit(led, "r2", plan), ENV, send)
    assert res.route.id == "gemini-flash" and send.kinds == [AttemptKind.PROBE]
    h = gemini(led)
    assert h.last_probe_at == clock.now() and h.cooldown_until is None and h.error_count == 0


# -- 3. a fallback that cannot be built is logged and skipped ----------------------------------


def test_a_fallback_without_a_key_is_logged_as_cannot_be_used_and_skipped_over_loopback(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(60_000.0)
    secrets = StaticSecretProvider({"gemini:default": "sk-gemini-test-key-0001",
                                    "deepseek:default": "sk-deepseek-test-key-0002"})
    with FakeProvider().in_thread() as fake, Ledger.open(db_url, clock=clock) as led, \
            SyncAdapter(secrets=secrets) as adapter:
        fake.set_default(Fault.UNAVAILABLE, model="gemini-3-flash")

        def real(route: Route, profile: str) -> Route:
            return route.model_copy(update={"protocol": WireProtocol.OPENAI,
                                            "endpoint": fake.endpoint("openai"),
                                            "profiles": [Profile(id=profile)]})

        plan = [real(FLASH, "gemini:default"), real(MINI, "openai:default"),
                real(DEEPSEEK, "deepseek:default")]
        with caplog.at_level(logging.INFO, logger="ledger.run"):
            res = execute(led, admit(led, "r", plan), ENV, sync_sender(adapter),
                          rng=random.Random(5))
        models = [r.model for r in fake.requests]
        timeline = led.timeline("r")
    assert res.route.id == "deepseek" and res.output.ok
    # The overloaded provider was asked again twice (the clock, not the test, waited), the
    # fallback with no key never reached the network, and the request went on.
    assert models == ["gemini-3-flash"] * 3 + ["deepseek-v4-flash"]
    assert len(clock.slept) == 2
    assert "[fallback] openai/gpt-4o-mini cannot be used: no secret for credential profile " \
           "'openai:default'; add it to the StaticSecretProvider" in caplog.messages
    [mini] = [a for a in timeline if a.route_id == "gpt-mini"]
    assert mini.state is AttemptState.NOT_SENT
    assert any(m.startswith("[fallback] serving the request with openai/gpt-4o-mini "
                            "(gemini/gemini-3-flash: 503 overloaded): run ")
               for m in caplog.messages)


def test_after_the_chains_last_entry_fails_a_cooling_fallback_it_passed_is_not_sent(
        db_url: str) -> None:
    # Seeds 000/001: own provider -> fallback 1 -> fallback 2 -> "every provider failed". A
    # fallback in cooldown is skipped on the way; it is not "left" once the last entry failed.
    clock = ManualClock(70_000.0)
    secrets = StaticSecretProvider({"k": "sk-test-key-0001"})
    with FakeProvider().in_thread() as fake, Ledger.open(db_url, clock=clock) as led, \
            SyncAdapter(secrets=secrets) as adapter:
        def real(route: Route) -> Route:
            return route.model_copy(update={"protocol": WireProtocol.OPENAI,
                                            "endpoint": fake.endpoint("openai"),
                                            "profiles": [Profile(id="k")]})

        flash, deepseek, mini = real(FLASH), real(DEEPSEEK), real(MINI)
        # deepseek fails once (one minute of cooldown) on a request it served first.
        fake.set_default(Fault.RATE_LIMIT, model="deepseek-v4-flash")
        execute(led, admit(led, "cool", [deepseek, mini]), ENV, sync_sender(adapter))
        assert led.health(["provider:deepseek"])["provider:deepseek"].error_count == 1
        clock.advance(5)
        fake.clear()
        fake.set_default(Fault.OK, model="deepseek-v4-flash")
        fake.set_default(Fault.RATE_LIMIT, model="gemini-3-flash")
        fake.set_default(Fault.RATE_LIMIT, model="gpt-4o-mini")
        with pytest.raises(FailoverExhausted) as ei:
            execute(led, admit(led, "r", [flash, deepseek, mini]), ENV, sync_sender(adapter))
        models = [r.model for r in fake.requests]
        stop = led.events("r", ["stop"])[-1].data
        health = led.health(["provider:deepseek"])["provider:deepseek"]
        routes = [a.route_id for a in led.timeline("r")]
    assert ei.value.reason == "no_candidate"
    assert models == ["gemini-3-flash", "gpt-4o-mini"]  # the cooling deepseek never asked
    assert routes == ["gemini-flash", "gpt-mini"]
    [skip] = [s for s in stop["skipped"] if s["route"] == "deepseek"]
    assert skip["reason"] == "route_cooldown" and "cooling until" in skip["detail"]
    assert health.error_count == 1  # its cooldown did not step


def _raw_503(headers: dict[str, str]) -> bytes:
    body = json.dumps({"error": {"message": "The engine is currently overloaded",
                                 "type": "server_error", "code": None}}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{head}\r\n").encode() + body


@pytest.mark.parametrize("skew", [-30.0, 0.0, 30.0])
def test_an_http_date_retry_after_is_waited_from_the_responses_date_whatever_the_clock_skew(
        db_url: str, skew: float) -> None:
    # A 503 whose Retry-After is 15 s after its own Date: the retries wait 15 s, whether our
    # clock runs with the provider's, 30 s behind it or 30 s ahead (seed 001: a longer
    # Retry-After is waited out exactly).
    sent = datetime(2026, 3, 1, 9, 0, 0, tzinfo=UTC)
    headers = {"Date": format_datetime(sent, usegmt=True),
               "Retry-After": format_datetime(sent + timedelta(seconds=15), usegmt=True)}
    clock = ManualClock(sent.timestamp() + skew)
    with FakeProvider().in_thread() as fake, Ledger.open(db_url, clock=clock) as led, \
            SyncAdapter(secrets=StaticSecretProvider({"k": "sk-test-key-0001"})) as adapter:
        fake.set_default(Behavior(fault=Fault.RAW, raw=(_raw_503(headers),)),
                         model="gemini-3-flash")
        plan = [r.model_copy(update={"protocol": WireProtocol.OPENAI,
                                     "endpoint": fake.endpoint("openai"),
                                     "profiles": [Profile(id="k")]}) for r in (FLASH, DEEPSEEK)]
        res = execute(led, admit(led, "r", plan), ENV, sync_sender(adapter))
        models = [r.model for r in fake.requests]
    assert res.route.id == "deepseek"
    assert models == ["gemini-3-flash"] * 3 + ["deepseek-v4-flash"]
    assert clock.slept == [15.0, 15.0]


# -- 4. the token budget stops the request -----------------------------------------------------


def test_over_its_token_budget_a_request_stops_with_budget_and_never_moves_on(
        led: Ledger) -> None:
    # The caller's per-call token check, made again before the retry, refuses it.
    over = SendResult.failed(Observation(over_token_budget=True, phase="before_send",
                                         source="local"), sent=False)
    send = Script({"gemini-flash": [OVERLOADED, over]})
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [FLASH, DEEPSEEK]), ENV, send, rng=random.Random(2))
    assert ei.value.reason == "budget" and send.sent == ["gemini-flash", "gemini-flash"]
    assert led.events("r", ["stop"])[-1].data["reason"] == "budget"
    assert gemini(led).error_count == 1  # the overload; the budget is no provider failure


def test_the_runs_token_budget_refuses_the_fallback_and_the_request_stops(led: Ledger) -> None:
    # A stalled stream may have been billed: its token hold stays, and no second hold fits.
    stalled = SendResult.failed(Observation(transport=Transport.STREAM_STALL))
    send = Script({"gemini-flash": [stalled]})
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [FLASH, DEEPSEEK], tokens=200), ENV, send)
    assert ei.value.reason == "budget" and send.sent == ["gemini-flash"]
    assert [a.state for a in led.timeline("r")] == [AttemptState.UNKNOWN]


# -- 5. probe state TTL and key limit; a refused claim --------------------------------------


def test_a_probe_interval_longer_than_the_probe_state_ttl_is_refused_at_load() -> None:
    with pytest.raises(PolicyError) as ei:
        validate_policy(goclaw(probe={"interval_s": 90_000, "ttl_s": 86_400}))
    assert "probe.interval_s" in str(ei.value) and "ttl_s" in str(ei.value)


def _cool_gemini(led: Ledger, run_id: str) -> None:
    execute(led, admit(led, run_id, [FLASH, DEEPSEEK]), ENV,
            Script({"gemini-flash": [RATE_LIMITED]}))


def test_a_probe_claimed_by_another_process_is_decided_again_without_the_probe(
        led: Ledger, db_url: str, clock: ManualClock) -> None:
    _cool_gemini(led, "before")
    clock.advance(30)  # inside the margin: the next request would probe gemini
    claims: list[bool] = []

    def another_process_claims_first(_point: str) -> None:
        with Ledger.open(db_url, clock=clock) as other:
            claims.append(other.claim_probe(FLASH, 30, key=GEMINI))

    faults.arm("probe.before_claim", another_process_claims_first)
    try:
        send = Script()
        res = execute(led, admit(led, "r", [FLASH, DEEPSEEK]), ENV, send)
    finally:
        faults.disarm("probe.before_claim")
    assert claims == [True] and res.route.id == "deepseek" and send.sent == ["deepseek"]
    [chosen] = led.events("r", ["select"])
    [flash] = [s for s in chosen.data["skipped"] if s["route"] == "gemini-flash"]
    assert flash["reason"] == "probe_throttled"
    assert "another process claimed its probe" in flash["detail"]


def test_probe_state_lives_24_hours_for_at_most_256_providers_on_the_execute_path(
        led: Ledger, clock: ManualClock) -> None:
    policy = preset("goclaw")
    model = ProbeThrottle()
    others = [f"provider:p{i:03d}" for i in range(256)]
    for key in others:  # 256 other providers probed, one a second
        assert led.claim_probe(DEEPSEEK, 30, key=key, ttl_s=86_400, max_keys=256)
        model = model.record(key, clock.now(), policy)
        clock.advance(1)
    _cool_gemini(led, "cool-1")
    clock.advance(30)
    send = Script()
    execute(led, admit(led, "probe-1", [FLASH, DEEPSEEK]), ENV, send)
    assert send.kinds == [AttemptKind.PROBE]
    model = model.record(GEMINI, clock.now(), policy)

    def probed() -> dict[str, float]:
        return {k: h.last_probe_at for k, h in led.health().items() if h.last_probe_at}

    state = probed()
    assert len(state) == 256 and "provider:p000" not in state  # the oldest went
    assert state == dict(model.last)
    # A day later every one of those probe times is forgotten when gemini is probed again.
    clock.advance(86_400)
    _cool_gemini(led, "cool-2")
    clock.advance(30)
    execute(led, admit(led, "probe-2", [FLASH, DEEPSEEK]), ENV, Script())
    assert probed() == {GEMINI: clock.now()}


# -- 6. usage stats as an operator reads them ----------------------------------------------------


def test_expired_counters_read_back_as_reset(led: Ledger, clock: ManualClock) -> None:
    _cool_gemini(led, "r")
    until = gemini(led).cooldown_until
    clock.set(until - 1)
    assert gemini(led).error_count == 1
    assert led.turn_snapshot("r").health[GEMINI].failure_counts == {"rate_limit": 1}
    clock.set(until)
    # "When both cooldownUntil and disabledUntil have expired, errorCount and failureCounts
    # are reset to zero": the ledger's reads and the selector's snapshot show that.
    h = gemini(led)
    assert (h.error_count, h.failure_counts) == (0, {})
    snap = led.turn_snapshot("r").health[GEMINI]
    assert (snap.error_count, snap.failure_counts) == (0, {})


def _health_written_at(db_url: str, key: str) -> float:
    eng = create_engine(normalize_url(db_url))
    try:
        with eng.connect() as conn:
            return float(conn.execute(text("SELECT updated_at FROM health WHERE key = :k"),
                                      {"k": key}).scalar_one())
    finally:
        eng.dispose()


def test_last_used_is_recorded_per_provider_and_written_at_most_once_a_minute(
        led: Ledger, db_url: str, clock: ManualClock) -> None:
    lease = admit(led, "r", [FLASH, DEEPSEEK], calls=10)
    first = clock.now()
    execute(led, lease, ENV, Script(), turn_id="t1")
    assert gemini(led).last_used == first
    written = _health_written_at(db_url, GEMINI)
    clock.advance(10)
    execute(led, lease, ENV, Script(), turn_id="t2")
    # A success on a healthy provider inside the minute changes nothing: the row is not written.
    assert gemini(led).last_used == first
    assert _health_written_at(db_url, GEMINI) == written
    clock.advance(50)
    execute(led, lease, ENV, Script(), turn_id="t3")
    assert gemini(led).last_used == clock.now()


def test_a_huge_retry_after_on_a_429_closes_no_group_and_cools_on_the_usual_curve(
        led: Ledger, clock: ManualClock) -> None:
    # docs/presets/goclaw.md "Hints are capped": not group-aware, moves on at route scope, so
    # only the provider's own cooldown follows, not the hint.
    led.admit_run("r", plan=[FLASH, DEEPSEEK], grant=GRANT, policy="goclaw",
                  budget=Budget(max_calls=10, max_retries=5, max_cost=Decimal(1)))
    lease = led.acquire_lease("r", ttl_s=3600)
    huge = SendResult.failed(Observation(status=429, body="Too Many Requests",
                                         headers={"retry-after": "99999999"}))
    res = execute(led, lease, ENV, Script({FLASH.id: [huge]}))
    assert res.route.id == DEEPSEEK.id
    assert res.attempts[0].fact is not None and res.attempts[0].fact.retry_after_s == 3600
    assert led.group_projections([FLASH.group])[FLASH.group].mode.value == "open"
    assert led.health([GEMINI])[GEMINI].cooldown_until == clock.now() + 60


def test_a_manual_clocks_waits_past_the_session_lease_lapse_it_and_a_longer_lease_holds(
        db_url: str, clock: ManualClock) -> None:
    # docs/operations.md "A lease in a test's manual time": the turn's waits move a ManualClock
    # at once, and the keeper (on the monotonic timer) never renews inside the jump: two
    # 20 s Retry-After waits outlast the session's default 30 s lease.
    secrets = StaticSecretProvider({"k": "sk-test-key-0001"})
    budget = Budget(max_calls=10, max_retries=5, max_cost=Decimal(1))
    with FakeProvider().in_thread() as fake, Ledger.open(db_url, clock=clock) as led:
        fake.set_default(Behavior(fault=Fault.RAW, raw=(_raw_503({"Retry-After": "20"}),)),
                         model="gemini-3-flash")
        plan = [r.model_copy(update={"protocol": WireProtocol.OPENAI,
                                     "endpoint": fake.endpoint("openai"),
                                     "profiles": [Profile(id="k")]}) for r in (FLASH, DEEPSEEK)]
        with pytest.raises(LeaseLost), led.run("default-ttl", plan=plan, grant=GRANT,
                                                policy="goclaw", secrets=secrets,
                                                budget=budget) as run:
            run.turn(ENV)
        assert clock.slept == [20.0, 20.0]
        with led.run("long-ttl", plan=plan, grant=GRANT, policy="goclaw", secrets=secrets,
                     budget=budget, lease_ttl_s=3600) as run:
            assert run.turn(ENV).route.id == "deepseek"

