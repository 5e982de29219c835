"""The `fased` preset behaves like Fased over time (seed 002), through the public API.

Timeouts and format errors rotate without marking the credential, so the next model on the same
credential stays a candidate; a Run is a session whose credential profile is kept across turns
until it cools, a compaction is recorded, or the session ends; a user pin stays locked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger.adapters import StaticSecretProvider
from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import Dispatch, SendResult, aexecute, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, Transport, WireProtocol
from ledger.domain.records import Lease
from ledger.domain.values import Budget, Grant, Price, Profile, ProfileType, Route
from ledger.errors import CandidateSkipped, FailoverExhausted
from ledger.policy.load import preset
from ledger.testing.fakeprovider import FakeProvider

FREE = Price()
ME = Profile(id="anthropic:me", type=ProfileType.API_KEY)
ALT = Profile(id="anthropic:alt", type=ProfileType.API_KEY)
SONNET = Route(id="sonnet", provider="anthropic", model="claude-sonnet-4-5", group="anthropic",
               recipient="anthropic", price=FREE, profiles=[ME])
HAIKU = Route(id="haiku", provider="anthropic", model="claude-haiku-4-5", group="anthropic",
              recipient="anthropic", price=FREE, profiles=[ME])
GPT = Route(id="gpt", provider="openai", model="gpt-4o", group="openai", recipient="openai",
            price=FREE, profiles=[Profile(id="openai:default")])
A = Profile(id="anthropic:a", type=ProfileType.API_KEY)
B = Profile(id="anthropic:b", type=ProfileType.API_KEY)
CLAUDE = Route(id="claude", provider="anthropic", model="claude-sonnet-4-5", group="anthropic",
               recipient="anthropic", price=FREE, profiles=[A, B])
GRANT = Grant(recipients={"anthropic": ["user_input"], "openai": ["user_input"]})
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)

OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal(0))
TIMEOUT = SendResult.failed(Observation(transport=Transport.READ_TIMEOUT))
FORMAT = SendResult.failed(Observation(status=400, body='{"error": {"message": "bad shape"}}'))
RATE_LIMITED = SendResult.failed(Observation(status=429))


class Script:
    """Per (route, profile): queued results (the last repeats); records what was sent."""

    def __init__(self, by_key: dict[tuple[str, str], list[SendResult]] | None = None) -> None:
        self.queues = {k: list(v) for k, v in (by_key or {}).items()}
        self.sent: list[tuple[str, str | None]] = []

    def __call__(self, d: Dispatch) -> SendResult:
        key = (d.route.id, d.profile_id or "")
        self.sent.append((d.route.id, d.profile_id))
        q = self.queues.get(key) or [OK]
        return q.pop(0) if len(q) > 1 else q[0]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(80_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as ledger:
        yield ledger


def admit(led: Ledger, run_id: str, plan: list[Route], policy: Any = "fased") -> Lease:
    led.admit_run(run_id, plan=plan, grant=GRANT, policy=policy,
                  budget=Budget(max_calls=20, max_retries=10, max_cost=Decimal(1)))
    return led.acquire_lease(run_id, ttl_s=3600)


# -- 7. timeouts and format errors rotate without marking the credential -----------------------


@pytest.mark.parametrize("failure", [TIMEOUT, FORMAT], ids=["timeout", "format"])
def test_a_timeout_or_format_error_leaves_the_credential_to_the_next_model(
        led: Ledger, failure: SendResult) -> None:
    send = Script({("sonnet", ME.id): [failure]})
    res = execute(led, admit(led, "r", [SONNET, HAIKU, GPT]), ENV, send)
    # "marking the credential would block other valid model routes on the same provider"
    assert (res.route.id, res.profile_id) == ("haiku", ME.id)
    assert send.sent == [("sonnet", ME.id), ("haiku", ME.id)]
    me = led.health([ME.id])[ME.id]
    assert me.cooldown_until is None and me.error_count == 0


def test_a_rate_limit_marks_the_credential_so_the_next_model_uses_another(led: Ledger) -> None:
    send = Script({("sonnet", ME.id): [RATE_LIMITED]})
    res = execute(led, admit(led, "r", [SONNET, HAIKU, GPT]), ENV, send)
    assert res.route.id == "gpt" and send.sent == [("sonnet", ME.id), ("gpt", "openai:default")]
    assert led.health([ME.id])[ME.id].cooldown_until is not None


def test_a_stop_says_a_model_whose_credential_failed_elsewhere_was_skipped_not_untried(
        led: Ledger) -> None:
    # Haiku shares sonnet's only credential, which the 429 ruled out: the stop must say so.
    send = Script({("sonnet", ME.id): [RATE_LIMITED]})
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [SONNET, HAIKU]), ENV, send)
    err = ei.value
    assert err.reason == "no_candidate" and send.sent == [("sonnet", ME.id)]
    skip = next(e for e in err.exceptions if isinstance(e, CandidateSkipped))
    assert (skip.route, skip.reason) == ("haiku", "already_tried")
    _, haiku = err.fields["candidates"]
    assert haiku == "haiku: skipped (already_tried): every profile already tried", haiku
    assert haiku in str(err)
    assert led.events("r", ["stop"])[-1].data["candidates"] == err.fields["candidates"]


def test_rotation_never_returns_to_a_credential_that_failed_on_that_route(led: Ledger) -> None:
    sonnet = SONNET.model_copy(update={"profiles": [ME, ALT]})
    send = Script({("sonnet", ME.id): [TIMEOUT], ("sonnet", ALT.id): [TIMEOUT]})
    res = execute(led, admit(led, "r", [sonnet, HAIKU, GPT]), ENV, send)
    # Profiles first, then models; the timed-out credential is still good for haiku.
    assert send.sent == [("sonnet", ME.id), ("sonnet", ALT.id), ("haiku", ME.id)]
    assert res.route.id == "haiku"


# -- 8. sticky by default; a compaction drops the pin ------------------------------------------


def test_a_run_is_a_session_that_keeps_its_profile_until_a_compaction(
        db_url: str, clock: ManualClock) -> None:
    async def go() -> list[str | None]:
        aled = await AsyncLedger.open(db_url, clock=clock)
        try:
            await aled.admit_run("s", plan=[CLAUDE, GPT], grant=GRANT, policy="fased",
                                 budget=Budget(max_calls=20, max_retries=10,
                                               max_cost=Decimal(1)))
            lease = await aled.acquire_lease("s", ttl_s=3600)
            used: list[str | None] = []

            async def turn(n: int, send: Script | None = None) -> None:
                clock.advance(5)
                res = await aexecute(aled, lease, ENV, send or Script(), turn_id=f"t{n}")
                used.append(res.profile_id)

            await turn(1)  # both never used: the declared order picks a
            await turn(2)  # rotation would pick b (never used); the session keeps a
            assert await aled.record_compaction(lease) == 1
            await turn(3)  # the pin is dropped: rotation picks b, the oldest used
            await turn(4)  # and b is the session's profile from now on
            # b is rate-limited: the turn rotates to a, which the session then keeps.
            await turn(5, Script({("claude", B.id): [RATE_LIMITED]}))
            await turn(6)
            run = await aled.get_run("s")
            assert (run.compactions, run.profile_compactions) == (1, 1)
            [event] = await aled.events("s", ["compaction"])
            assert event.data == {"compactions": 1}
            return used
        finally:
            await aled.close()

    assert asyncio.run(go()) == [A.id, A.id, B.id, B.id, A.id, A.id]


def test_without_stickiness_a_run_rotates_its_profile_every_turn(led: Ledger,
                                                                 clock: ManualClock) -> None:
    data = preset("fased").model_dump(mode="json")
    data["profiles"]["sticky"] = False
    lease = admit(led, "s", [CLAUDE, GPT], policy=data)
    used = []
    for n in range(3):
        clock.advance(5)
        used.append(execute(led, lease, ENV, Script(), turn_id=f"t{n}").profile_id)
    assert used == [A.id, B.id, A.id]


def test_a_user_pin_stays_locked_through_a_compaction_and_a_cooldown(
        led: Ledger, clock: ManualClock) -> None:
    lease = admit(led, "s", [CLAUDE, GPT])
    clock.advance(5)
    assert execute(led, lease, ENV, Script(), turn_id="t1", pin="user").profile_id == A.id
    led.record_compaction(lease)
    clock.advance(5)
    assert execute(led, lease, ENV, Script(), turn_id="t2", pin="user").profile_id == A.id
    # The pinned credential fails: fased moves to the next model rather than switching profiles.
    send = Script({("claude", A.id): [RATE_LIMITED]})
    res = execute(led, lease, ENV, send, turn_id="t3", pin="user")
    assert send.sent == [("claude", A.id), ("gpt", "openai:default")] and res.route.id == "gpt"


def test_a_user_pin_outlives_a_failover_that_served_on_another_profile(
        led: Ledger, clock: ManualClock) -> None:
    # Seed 002: "User-pinned profiles stay locked to that profile ... until a new session
    # starts". A failover's answer on another profile (or provider) is that turn's only.
    haiku = Route(id="haiku", provider="anthropic", model="claude-haiku-4-5", group="anthropic",
                  recipient="anthropic", price=FREE, profiles=[A, B])
    lease = admit(led, "s", [CLAUDE, haiku, GPT])
    sent: list[tuple[str, str | None]] = []

    def turn(n: int, send: Script) -> tuple[str, str | None]:
        res = execute(led, lease, ENV, send, turn_id=f"t{n}", pin="user")
        sent.extend(send.sent)
        return res.route.id, res.profile_id

    assert turn(1, Script()) == ("claude", A.id)
    clock.advance(1)
    # The pinned a is rate-limited: no rotation inside claude; the next model takes its first
    # usable profile (a cools and failed this turn), b.
    assert turn(2, Script({("claude", A.id): [RATE_LIMITED]})) == ("haiku", B.id)
    clock.advance(1)
    assert turn(3, Script()) == ("claude", A.id)  # back on the pin, though it still cools
    clock.advance(61)
    assert turn(4, Script()) == ("claude", A.id)  # and after its cooldown
    # A failover to another provider (every anthropic profile fails) keeps it too.
    clock.advance(400)
    assert turn(5, Script({("claude", A.id): [RATE_LIMITED], ("haiku", B.id): [RATE_LIMITED]})
                ) == ("gpt", "openai:default")
    run = led.get_run("s")  # the Run records the route that served, and keeps the pin
    assert (run.current_route, run.current_profile) == ("gpt", A.id)
    clock.advance(1)
    assert turn(6, Script()) == ("claude", A.id)
    assert sent == [("claude", A.id), ("claude", A.id), ("haiku", B.id), ("claude", A.id),
                    ("claude", A.id), ("claude", A.id), ("haiku", B.id),
                    ("gpt", "openai:default"), ("claude", A.id)]


def test_a_session_keeps_its_credential_over_loopback_until_the_host_records_a_compaction(
        db_url: str, clock: ManualClock) -> None:
    secrets = StaticSecretProvider({A.id: "sk-anthropic-a-test-0001",
                                    B.id: "sk-anthropic-b-test-0002"})
    with FakeProvider().in_thread() as fake, Ledger.open(db_url, clock=clock) as led:
        route = CLAUDE.model_copy(update={"protocol": WireProtocol.OPENAI,
                                          "endpoint": fake.endpoint("openai")})
        with led.run("s", plan=[route], grant=GRANT, policy="fased", secrets=secrets,
                     budget=Budget(max_calls=10, max_retries=5, max_cost=Decimal(1))) as run:
            used = []
            for n in range(4):
                if n == 2:
                    assert run.compacted() == 1  # the host summarised the context
                clock.advance(5)
                used.append(run.turn(ENV, turn_id=f"t{n}").profile_id)
        keys = [r.headers.get("authorization", "") for r in fake.requests]
    # Kept across turns (rotation alone would pick b, never used, on the second), chosen again
    # after the compaction, then kept again.
    assert used == [A.id, A.id, B.id, B.id]
    assert keys == (["Bearer sk-anthropic-a-test-0001"] * 2
                    + ["Bearer sk-anthropic-b-test-0002"] * 2)


def test_an_async_session_drops_its_credential_when_the_host_records_a_compaction(
        db_url: str, clock: ManualClock) -> None:
    secrets = StaticSecretProvider({A.id: "sk-anthropic-a-test-0001",
                                    B.id: "sk-anthropic-b-test-0002"})

    async def go(fake: FakeProvider) -> list[str | None]:
        route = CLAUDE.model_copy(update={"protocol": WireProtocol.OPENAI,
                                          "endpoint": fake.endpoint("openai")})
        aled = await AsyncLedger.open(db_url, clock=clock)
        try:
            async with aled.run("s", plan=[route], grant=GRANT, policy="fased",
                                secrets=secrets, budget=Budget(max_calls=10, max_retries=5,
                                                               max_cost=Decimal(1))) as run:
                used = []
                for n in range(3):
                    if n == 2:
                        assert await run.compacted() == 1
                    clock.advance(5)
                    used.append((await run.turn(ENV, turn_id=f"t{n}")).profile_id)
                return used
        finally:
            await aled.close()

    with FakeProvider().in_thread() as fake:
        assert asyncio.run(go(fake)) == [A.id, A.id, B.id]


def test_a_huge_retry_after_on_a_429_closes_no_group_and_the_profile_cools_a_minute(
        led: Ledger, clock: ManualClock) -> None:
    # docs/presets/fased.md "Hints are capped": not group-aware, moves on at route scope, so
    # only the profile's own cooldown follows, and the turn rotates at once.
    lease = admit(led, "s", [CLAUDE, GPT])
    huge = SendResult.failed(Observation(status=429, headers={"retry-after": "99999999"}))
    send = Script({("claude", A.id): [huge]})
    res = execute(led, lease, ENV, send)
    assert send.sent == [("claude", A.id), ("claude", B.id)] and res.profile_id == B.id
    assert led.group_projections(["anthropic"])["anthropic"].mode.value == "open"
    assert led.health([A.id])[A.id].cooldown_until == clock.now() + 60

