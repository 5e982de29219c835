"""The retry owner driven by the real adapters over loopback, through the fake provider's faults.

Each case puts one fault on the primary route and checks what the ledger recorded: the failed
attempt's state, phase and category, which route served (or why the Run stopped), that a
truncated answer is never returned as a success, and that nothing is left unbounded in time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.adapters import StaticSecretProvider, SyncAdapter, sync_sender
from ledger.api.facade import Ledger
from ledger.api.turn import Notice, execute
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.records import AttemptState, DebitState
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.policy.model import StreamingPolicy
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

LIMITS = StreamingPolicy(connect_timeout_s=2, read_timeout_s=0.6, first_token_timeout_s=0.4,
                         idle_timeout_s=0.4, total_timeout_s=5)


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeProvider, FakeProvider]]:
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b:
        yield a, b


@pytest.fixture(scope="module")
def adapter() -> Iterator[SyncAdapter]:
    ad = SyncAdapter(secrets=StaticSecretProvider({"p:a": "key-a", "p:b": "key-b"}))
    yield ad
    ad.close()


def plan(a: FakeProvider, b: FakeProvider, protocol: WireProtocol) -> list[Route]:
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(4))
    return [
        Route(id="primary", provider="pa", model="m-primary", group="ga", recipient="ra",
              protocol=protocol, endpoint=a.endpoint(protocol.value), price=price,
              profiles=[Profile(id="p:a")]),
        Route(id="backup", provider="pb", model="m-backup", group="gb", recipient="rb",
              protocol=protocol, endpoint=b.endpoint(protocol.value), price=price,
              profiles=[Profile(id="p:b")]),
    ]


CASES = [
    # policy, protocol, fault, stream, served-by or stop reason, primary state, category
    ("failure-domain", WireProtocol.OPENAI, Fault.UNAVAILABLE, False, "backup", "failed",
     "overloaded"),
    ("failure-domain", WireProtocol.ANTHROPIC, Fault.OVERLOADED, True, "backup", "failed",
     "overloaded"),
    ("failure-domain", WireProtocol.GEMINI, Fault.RATE_LIMIT_RETRY_AFTER, False, "backup", "failed",
     "rate_limit"),
    ("failure-domain", WireProtocol.OPENAI, Fault.SERVER_ERROR, False, "backup", "failed",
     "server_error"),
    ("failure-domain", WireProtocol.OPENAI, Fault.RESET_BEFORE_HEADERS, False,
     "stop:execution_unknown", "unknown", "network"),
    ("failure-domain", WireProtocol.OPENAI, Fault.NO_RESPONSE, False,
     "stop:execution_unknown", "unknown", "timeout"),
    # A stream cut or stalled after the request left: no verdict, execution unknown (hold kept).
    ("failure-domain", WireProtocol.OPENAI, Fault.STREAM_CUT, True, "stop:output_exists",
     "unknown", "network"),
    ("failure-domain", WireProtocol.ANTHROPIC, Fault.STALL, True, "stop:output_exists", "unknown",
     "timeout"),
    ("failure-domain", WireProtocol.OPENAI, Fault.CONTEXT_LENGTH, False,
     "stop:not_eligible_failure", "failed", "context_overflow"),
    ("failure-domain", WireProtocol.GEMINI, Fault.CONTEXT_LENGTH, False,
     "stop:not_eligible_failure", "failed", "context_overflow"),
    ("failure-domain", WireProtocol.OPENAI, Fault.MISSING_DONE, True, "primary", "succeeded", None),
    ("goclaw", WireProtocol.OPENAI, Fault.SLOW_FIRST_TOKEN, True, "backup", "unknown", "timeout"),
    ("goclaw", WireProtocol.OPENAI, Fault.STREAM_CUT, True, "backup", "unknown", "network"),
    ("goclaw", WireProtocol.OPENAI, Fault.MALFORMED_EVENT, True, "stop:not_eligible_failure",
     "failed", "format"),
    ("fased", WireProtocol.OPENAI, Fault.CONTENT_POLICY, False, "stop:not_eligible_failure",
     "failed", "content_policy"),
    # The Responses API: the same faults, the same facts.
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.UNAVAILABLE, True, "backup",
     "failed", "overloaded"),
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.RATE_LIMIT_RETRY_AFTER, False,
     "backup", "failed", "rate_limit"),
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.STREAM_CUT, True,
     "stop:output_exists", "unknown", "network"),
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.STALL, True, "stop:output_exists",
     "unknown", "timeout"),
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.CONTEXT_LENGTH, False,
     "stop:not_eligible_failure", "failed", "context_overflow"),
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.INCOMPLETE, False,
     "stop:not_eligible_failure", "failed", "unknown"),
    ("failure-domain", WireProtocol.OPENAI_RESPONSES, Fault.RESET_BEFORE_HEADERS, False,
     "stop:execution_unknown", "unknown", "network"),
    ("goclaw", WireProtocol.OPENAI_RESPONSES, Fault.SLOW_FIRST_TOKEN, True, "backup", "unknown",
     "timeout"),
    ("goclaw", WireProtocol.OPENAI_RESPONSES, Fault.ERROR_EVENT, False, "stop:not_eligible_failure",
     "failed", "unknown"),
]


@pytest.mark.parametrize(("policy", "protocol", "fault", "stream", "expect", "state", "category"),
                         CASES, ids=[f"{c[0]}-{c[1].value}-{c[2].value}" for c in CASES])
def test_fault_through_adapter_and_retry_owner(
    db_url: str, fakes: tuple[FakeProvider, FakeProvider], adapter: SyncAdapter, policy: str,
    protocol: WireProtocol, fault: Fault, stream: bool, expect: str, state: str,
    category: str | None,
) -> None:
    a, b = fakes
    a.clear()
    b.clear()
    routes = plan(a, b, protocol)
    a.enqueue(Behavior(fault=fault, delay_s=2.0, retry_after="5"), model="m-primary")
    notices: list[Notice] = []
    with Ledger.open(db_url) as led:
        led.admit_run("r", plan=routes, policy=policy,
                      budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
                      grant=Grant(recipients={"ra": ["user_input"], "rb": ["user_input"]}))
        lease = led.acquire_lease("r")
        env = Envelope(parts=[Part(content="What changed in the filings?")], stream=stream,
                       max_output_tokens=64)
        started = time.monotonic()
        try:
            # Same-route retries are part of goclaw's behaviour; their waits are real here, so
            # keep them short through the clock-less sleeper of a ManualClock-free ledger.
            # A streamed answer is watched (shown to a user as it arrives): it is effective.
            shown: list[object] = []
            res = execute(led, lease, env,
                          sync_sender(adapter, limits=LIMITS,
                                      on_event=shown.append if stream else None),
                          on_notice=notices.append, sleeper=_NoWait())
            outcome = res.route.id
            assert res.output.ok and res.output.text  # never a truncated answer
            assert res.output.finish_reason or fault is not Fault.MISSING_DONE
        except FailoverExhausted as e:
            outcome = f"stop:{e.reason}"
        assert time.monotonic() - started < 10  # nothing is unbounded in time
        assert outcome == expect
        tl = led.timeline("r")
        assert tl[0].route_id == "primary" and tl[0].state.value == state
        assert tl[0].category == category
        if tl[0].state is AttemptState.UNKNOWN:
            assert tl[0].debit_state is DebitState.RESERVED  # may have executed: hold kept
        if tl[0].state is AttemptState.FAILED and tl[0].effective_output:
            # Output was streamed: it ran and may be billed; with no usage the hold is posted.
            assert tl[0].debit_state is DebitState.POSTED
            assert led.debit(tl[0].debit_id).posted == tl[0].reserved
        if expect == "backup":
            assert tl[-1].route_id == "backup" and tl[-1].state is AttemptState.SUCCEEDED
            assert tl[-1].prompt_tokens and tl[-1].cost is not None
            assert tl[-1].model_reported
        if tl[0].effective_output and outcome == "backup":
            assert notices and notices[0].kind == "reset"


class _NoWait:
    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


@pytest.mark.parametrize(("policy", "expect"), [("failure-domain", "stop:execution_unknown"),
                                                ("goclaw", "backup")])
def test_buffered_stream_cut_is_discarded_not_effective(
    db_url: str, fakes: tuple[FakeProvider, FakeProvider], adapter: SyncAdapter, policy: str,
    expect: str,
) -> None:
    """Nobody was shown the partial text: it is no effective output; it is discarded and that
    is recorded, and the policy decides whether to move on (seed 003 section 7)."""
    a, b = fakes
    a.clear()
    b.clear()
    a.enqueue(Behavior(fault=Fault.STREAM_CUT), model="m-primary")
    with Ledger.open(db_url) as led:
        led.admit_run("r", plan=plan(a, b, WireProtocol.OPENAI), policy=policy,
                      budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
                      grant=Grant(recipients={"ra": ["user_input"], "rb": ["user_input"]}))
        lease = led.acquire_lease("r")
        env = Envelope(parts=[Part(content="What changed?")], stream=True, max_output_tokens=64)
        try:
            outcome = execute(led, lease, env, sync_sender(adapter, limits=LIMITS),
                              sleeper=_NoWait()).route.id
        except FailoverExhausted as e:
            outcome = f"stop:{e.reason}"
            assert e.partial is None  # nothing was delivered, nothing to hand back
        assert outcome == expect
        first = led.timeline("r")[0]
        assert first.route_id == "primary" and not first.effective_output
        assert [e.attempt_id for e in led.events("r", ["discarded"])] == [first.attempt_id]
