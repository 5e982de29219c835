"""A Run session's lease: kept renewed for a turn however long it runs.

A turn that outlives the lease it started with (a capacity queue, backoffs) sends with the
lease as its keeper last renewed it, not as it was when the turn began. Real loopback HTTP is
not needed for the send (the turns send with a function); both backends, sync and async.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

from ledger import (
    AsyncLedger,
    Budget,
    Dispatch,
    Envelope,
    Grant,
    Ledger,
    Part,
    SendResult,
    faults,
)
from ledger.clock import ManualClock
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.records import AttemptState
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")])
TTL = 3.0
LAG = 0.6  # between a begin and its send: longer than the lease margin (0.5 s)


def _unavailable(d: Dispatch) -> SendResult:
    return SendResult.failed(Observation(status=503, protocol=WireProtocol.OPENAI,
                                         provider=d.route.provider))


OK = SendResult(ok=True, output="ok", prompt_tokens=1, completion_tokens=1)


def _lag(clock: ManualClock) -> None:
    # The second Attempt's begin is followed by a stalled loop (other tasks' work).
    faults.arm("dispatch.before_send", lambda _p: clock.advance(LAG), on_hit=2)


def test_a_turn_that_outlives_its_starting_lease_sends_under_the_keepers_renewal(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(70_000.0)
    sent: list[str] = []
    with Ledger.open(db_url, clock=clock) as led, \
            led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT, lease_ttl_s=TTL) as run:

        def send(d: Dispatch) -> SendResult:
            sent.append(d.route.id)
            if len(sent) > 1:
                return OK
            for _ in range(2):  # 4 s of a 3 s lease, the keeper renewing it meanwhile
                clock.advance(2.0)
                run._keeper.tick()
            return _unavailable(d)

        _lag(clock)
        try:
            result = run.turn(HELLO, send=send)
        finally:
            faults.disarm()
        assert result.output == "ok" and len(sent) == 2
    assert [a.state for a in led.timeline("r")] == [AttemptState.FAILED,
                                                    AttemptState.SUCCEEDED]


def test_an_async_turn_that_outlives_its_starting_lease_sends_under_the_keepers_renewal(
        db_url: str, fake: Any) -> None:
    clock = ManualClock(70_000.0)
    sent: list[str] = []

    async def main() -> list[AttemptState]:
        async with AsyncLedger.open(db_url, clock=clock) as led:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                               lease_ttl_s=TTL) as run:

                async def send(d: Dispatch) -> SendResult:
                    sent.append(d.route.id)
                    if len(sent) > 1:
                        return OK
                    for _ in range(2):  # 4 s of a 3 s lease, the keeper renewing it meanwhile
                        clock.advance(2.0)
                        await run._keeper.tick()
                    return _unavailable(d)

                _lag(clock)
                try:
                    result = await run.turn(HELLO, send=send)
                finally:
                    faults.disarm()
                assert result.output == "ok" and len(sent) == 2
            return [a.state for a in await led.timeline("r")]

    assert asyncio.run(main()) == [AttemptState.FAILED, AttemptState.SUCCEEDED]
