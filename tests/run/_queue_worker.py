"""A worker process of the capacity-queue tests (run as ``python -m tests.run._queue_worker``).

``waiter URL RUN_ID ROUTE_JSON TTL``: opens its own ledger, holds Run ``RUN_ID`` in a session
(lease ``TTL`` seconds) and serves one turn on the route; prints ``queued`` when the turn
starts waiting in the group's queue and ``served ATTEMPT_ID`` once answered.

``holder URL RUN_ID ROUTE_JSON``: begins one Attempt on the route (taking the group's slot),
prints ``holding ATTEMPT_ID``, then settles it when a line arrives on stdin and prints
``settled``.
"""

from __future__ import annotations

import json
import sys
from decimal import Decimal

from ledger import Budget, Envelope, Grant, Ledger, Notice, Part, Route

BUDGET = Budget(max_calls=4, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})


def _say(text: str) -> None:
    print(text, flush=True)


def waiter(url: str, run_id: str, route: Route, ttl: float) -> None:
    def notice(n: Notice) -> None:
        if n.kind == "queued":
            _say("queued")

    with Ledger.open(url, migrate_schema=False) as led, led.run(
            run_id, plan=[route], budget=BUDGET, grant=GRANT, lease_ttl_s=ttl) as run:
        res = run.turn(Envelope(parts=[Part(content=f"hello from {run_id}")]),
                       on_notice=notice)
        _say(f"served {res.attempt.attempt_id}")


def holder(url: str, run_id: str, route: Route) -> None:
    with Ledger.open(url, migrate_schema=False) as led:
        led.admit_run(run_id, plan=[route], budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease(run_id, ttl_s=600)
        att = led.begin_attempt(lease, route=route.id, envelope_hash="sha256:held",
                                reserve="0")
        _say(f"holding {att.attempt_id}")
        sys.stdin.readline()
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0")
        led.finish_run(lease, "succeeded")
        led.release_lease(lease)
        _say("settled")


if __name__ == "__main__":
    kind, url, run_id, route_json = sys.argv[1:5]
    route = Route.model_validate(json.loads(route_json))
    if kind == "waiter":
        waiter(url, run_id, route, float(sys.argv[5]))
    else:
        holder(url, run_id, route)
