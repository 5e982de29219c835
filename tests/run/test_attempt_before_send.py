"""Invariant 1 from outside the sending process's view: when a request reaches the network, its
Attempt is already committed, readable by any other connection to the ledger."""

from __future__ import annotations

from decimal import Decimal

from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.records import AttemptState
from ledger.domain.values import Budget, Grant, Price, Route

PLAN = [Route(id=f"r{i}", provider=f"p{i}", model="m", group=f"g{i}", recipient="rcpt",
              price=Price()) for i in range(3)]


def test_invariant1_every_attempt_is_committed_before_its_request_is_sent(db_url: str) -> None:
    clock = ManualClock(10_000.0)
    led = Ledger.open(db_url, clock=clock)
    observer = Ledger.open(db_url, migrate_schema=False)  # another connection, another view
    led.admit_run("run", plan=PLAN, budget=Budget(max_calls=5, max_retries=4,
                                                   max_cost=Decimal("1")),
                  grant=Grant(recipients={"rcpt": ["user_input"]}))
    lease = led.acquire_lease("run")
    seen: list[tuple[str, AttemptState]] = []

    def send(d: Dispatch) -> SendResult:
        # The moment the request would leave: the Attempt must already be durable.
        seen.append((d.attempt_id, observer.get_attempt(d.attempt_id).state))
        if len(seen) < 3:  # two failures that fail over, then a success
            return SendResult.failed(Observation(status=503, protocol=WireProtocol.OPENAI,
                                                 provider=d.route.provider))
        return SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)

    result = execute(led, lease, Envelope(parts=[Part(content="hi")]), send)
    assert [s for _, s in seen] == [AttemptState.DISPATCHING] * 3
    assert [a for a, _ in seen] == [a.attempt_id for a in result.attempts]
    observer.close()
    led.close()
