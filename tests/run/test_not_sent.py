"""Never sent is not unknown (invariants 1, 4 and 6).

A request that provably never left the process — the route cannot be used (no key), or the
connection was refused before a byte was written — is settled ``not_sent``: hold voided, slot
released, the call not counted against the allowance, no health penalty for a configuration
problem; the retry owner logs ``[fallback] provider/model cannot be used: <why>`` and moves on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.adapters import StaticSecretProvider, SyncAdapter, sync_sender
from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, Phase, Source, Transport
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import FailoverExhausted
from ledger.ops.reconcile import reconcile
from ledger.testing.fakeprovider import FakeProvider
from tests.netfaults import closed_port

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)
OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal("0.0001"))


def _plan(primary_endpoint: str = "http://127.0.0.1:9/v1") -> list[Route]:
    return [
        Route(id="primary", provider="pa", model="m1", group="ga", recipient="ra",
              endpoint=primary_endpoint, price=PRICE),
        Route(id="nokey", provider="openai", model="gpt-4o-mini", group="gb", recipient="ra",
              price=PRICE),
        Route(id="backup", provider="pc", model="m3", group="gc", recipient="ra", price=PRICE),
    ]


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=ManualClock(60_000.0)) as led:
        yield led


def _admit(led: Ledger, plan: list[Route], policy: str, retries: int = 5) -> Lease:
    led.admit_run("r", plan=plan, budget=Budget(max_calls=6, max_retries=retries,
                                                max_cost=Decimal("1")),
                  grant=Grant(recipients={"ra": ["user_input"]}), policy=policy)
    return led.acquire_lease("r")


class Sender:
    """Per route: the primary fails with ``primary``; ``nokey`` cannot be built; backup answers."""

    def __init__(self, primary: SendResult) -> None:
        self.primary = primary
        self.sent: list[str] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d.route.id)
        if d.route.id == "primary":
            return self.primary
        if d.route.id == "nokey":
            return SendResult.failed(Observation(
                transport=Transport.CANNOT_BUILD, source=Source.LOCAL,
                message="no secret for credential profile 'openai:default'; set "
                        "OPENAI_API_KEY"), sent=False)
        return OK


UNAVAILABLE = SendResult.failed(Observation(status=503))


@pytest.mark.parametrize("policy", ["goclaw", "failure-domain", "fased"])
def test_a_fallback_that_cannot_be_built_is_logged_skipped_and_never_unknown(
        led: Ledger, policy: str, caplog: pytest.LogCaptureFixture) -> None:
    lease = _admit(led, _plan(), policy)
    send = Sender(UNAVAILABLE)
    with caplog.at_level(logging.INFO, logger="ledger.run"):
        res = execute(led, lease, ENV, send)
    assert res.route.id == "backup"
    states = {a.route_id: (a.state, a.debit_state) for a in led.timeline("r")}
    assert states["nokey"] == (AttemptState.NOT_SENT, DebitState.VOIDED)
    assert "[fallback] openai/gpt-4o-mini cannot be used: no secret for credential profile" \
        in caplog.text
    [unusable] = led.events("r", ["unusable"])
    assert unusable.data["route"] == "nokey" and "OPENAI_API_KEY" in unusable.data["why"]
    run = led.get_run("r")
    timeline = led.timeline("r")
    # The route that could not be built is no model call; every further attempt of the turn,
    # the switch away from it included, took one retry permission.
    assert run.calls_used == sum(a.state is not AttemptState.NOT_SENT for a in timeline)
    assert run.retries_used == len(timeline) - 1
    assert "nokey" not in led.health()  # a configuration problem is no health penalty
    assert reconcile(led).ok


def test_unusable_route_stops_when_failover_is_off(led: Ledger) -> None:
    plan = _plan()
    lease = _admit(led, [plan[1], plan[2]], policy="failure-domain")
    led.admit_run("off", plan=[plan[1], plan[2]], budget=Budget(max_calls=3, max_retries=2,
                                                                  max_cost=Decimal("1")),
                  grant=Grant(recipients={"ra": ["user_input"]}),
                  policy={"name": "off", "failover": {"enabled": False}})
    off = led.acquire_lease("off")
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, off, ENV, Sender(UNAVAILABLE))
    assert ei.value.reason == "failover_disabled"
    [att] = led.timeline("off")
    assert att.state is AttemptState.NOT_SENT and att.debit_state is DebitState.VOIDED
    led.release_lease(lease)


def test_connect_refused_over_loopback_is_not_sent_and_counts_no_call(led: Ledger) -> None:
    plan = _plan(f"http://127.0.0.1:{closed_port()}/v1")
    adapter = SyncAdapter(secrets=StaticSecretProvider({}))
    with FakeProvider().in_thread() as fake:
        backup = plan[2].model_copy(update={"endpoint": fake.endpoint("openai")})
        lease = _admit(led, [plan[0], backup], policy="goclaw")
        try:
            # goclaw retries a refused connection once, then moves on to the backup.
            res = execute(led, lease, ENV, sync_sender(adapter))
        finally:
            adapter.close()
    assert res.route.id == "backup"
    refused = [a for a in led.timeline("r") if a.route_id == "primary"]
    assert len(refused) == 2
    for att in refused:
        assert att.state is AttemptState.NOT_SENT and att.debit_state is DebitState.VOIDED
        assert att.fact is not None and att.fact.phase is Phase.BEFORE_SEND
        assert att.fact.transport is Transport.CONNECT_REFUSED
    run = led.get_run("r")
    assert run.reserved == 0 and run.calls_used == 1  # only the backup's call
    assert reconcile(led).ok
