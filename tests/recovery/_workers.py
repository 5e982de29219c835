"""Worker processes for the crash, restart and soak tests (run as ``python -m``).

The "send" of a request is a recorded side effect: one line ``<run> <turn> <attempt>`` appended
to a shared ``sent.log`` under flock and fsync'd. The tests prove from it that nothing was sent
twice and that every sent request has its Attempt. Fault points come from ``LEDGER_FAULTS``.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any, TypeVar

from ledger import faults
from ledger.api import Ledger
from ledger.clock import ManualClock
from ledger.core.facts import Category, FailureFact, Phase
from ledger.errors import DatabaseUnavailable, FencedOut
from ledger.model import Budget, Route
from ledger.records import AttemptState, Lease
from ledger.recovery import recover

T = TypeVar("T")
COST = Decimal("0.01")


def send(log: str, run_id: str, turn: str, attempt_id: str) -> None:
    """The side effect standing for the request leaving the process."""
    with open(log, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{run_id} {turn} {attempt_id}\n")
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f, fcntl.LOCK_UN)


def retrying(fn: Callable[[], T], out: dict[str, int], patience_s: float = 90.0) -> T:
    """Retry a retry-safe ledger call through DatabaseUnavailable (e.g. a server restart)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return fn()
        except DatabaseUnavailable:
            out["unavailable"] = out.get("unavailable", 0) + 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # waiting for the server to come back, not for time to pass


def turn_done(led: Ledger, run_id: str) -> dict[str, str]:
    """turn -> 'succeeded' | 'unknown' for turns that must not be sent again."""
    done: dict[str, str] = {}
    for a in led.timeline(run_id):
        if a.state in (AttemptState.SUCCEEDED, AttemptState.UNKNOWN):
            done.setdefault(a.turn_id, a.state.value)
    return done


def drive(led: Ledger, lease: Lease, run_id: str, turns: int, log: str, out: dict[str, int],
          route: str = "a") -> None:
    """Run the turns of one run: begin -> send -> settle, never re-sending a done turn."""
    done = turn_done(led, run_id)
    for i in range(1, turns + 1):
        turn = f"t{i}"
        if turn in done:
            out["skipped"] = out.get("skipped", 0) + 1
            continue
        att_id = f"{run_id}-{turn}-{lease.fence}"
        att = retrying(functools.partial(
            led.begin_attempt, lease, route=route, envelope_hash=f"sha256:{turn}",
            reserve=COST, turn_id=turn, attempt_id=att_id), out)
        faults.point("dispatch.before_send")
        send(log, run_id, turn, att.attempt_id)
        out["sent"] = out.get("sent", 0) + 1
        faults.point("dispatch.after_send")
        retrying(functools.partial(led.settle_attempt, lease, att.attempt_id,
                                   outcome="succeeded", cost=COST), out)


def crash_worker(url: str, run_id: str, turns: int, log: str, state: str) -> dict[str, int]:
    """Take the run's lease, note the fence in ``state``, then drive its turns."""
    led = Ledger.open(url, migrate_schema=False, executor_id=f"w-{os.getpid()}")
    lease = led.acquire_lease(run_id, ttl_s=600)
    with open(state, "w") as f:
        json.dump({"fence": lease.fence, "executor": lease.executor}, f)
    out: dict[str, int] = {}
    drive(led, lease, run_id, turns, log, out)
    led.close()
    return out


def recover_worker(url: str, offset_s: int) -> dict[str, Any]:
    """Recover with a clock ``offset_s`` past now (every test lease has expired by then)."""
    led = Ledger.open(url, migrate_schema=False,
                      clock=ManualClock(time.time() + offset_s))
    rep = recover(led, release=True)
    led.close()
    return {"runs": {r.run_id: r.newly_unknown for r in rep.runs}, "skipped": rep.skipped}


def restart_worker(url: str, run_id: str, turns: int, log: str) -> dict[str, int]:
    """Drive many turns while the server restarts under us; retry where safe."""
    out: dict[str, int] = {}
    led = Ledger.open(url, migrate_schema=False, executor_id=f"w-{os.getpid()}")
    lease = retrying(lambda: led.acquire_lease(run_id, ttl_s=600), out)
    drive(led, lease, run_id, turns, log, out)
    led.close()
    return out


PLAN = [
    Route(id="a", provider="p1", model="m1", group="g", recipient="r1"),
    Route(id="b", provider="p1", model="m2", group="g", recipient="r1"),
    Route(id="c", provider="p2", model="m1", group="h", recipient="r2"),
]


def soak_worker(url: str, prefix: str, seconds: int, log: str, seed: int) -> dict[str, int]:
    """Admit and run many runs with random provider faults until ``seconds`` have passed.

    Each call fails at random: 503 after headers (posted 0, retry on the next route), a
    failure before send (voided, nothing sent), or a lost receipt (settled unknown, never
    re-sent). FencedOut (a recovery took a stalled run over) abandons the run.
    """
    rnd = random.Random(seed)
    led = Ledger.open(url, migrate_schema=False, executor_id=f"{prefix}-{os.getpid()}")
    out: dict[str, int] = {}
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        run_id = f"{prefix}-{os.getpid()}-{n}"
        led.admit_run(run_id, plan=PLAN, budget=Budget(max_calls=6, max_retries=3,
                                                       max_cost=Decimal("0.05")))
        out["runs"] = out.get("runs", 0) + 1
        try:
            run_one(led, run_id, rnd, log, out)
        except FencedOut:
            out["fenced"] = out.get("fenced", 0) + 1
        except Exception as e:  # a refused begin (budget, capacity, allowance) ends the run
            key = "refused_" + type(e).__name__
            out[key] = out.get(key, 0) + 1
    led.close()
    return out


def run_one(led: Ledger, run_id: str, rnd: random.Random, log: str, out: dict[str, int]) -> None:
    lease = led.acquire_lease(run_id, ttl_s=3)
    route_i = 0
    for t in range(1, rnd.randint(2, 4) + 1):
        turn = f"t{t}"
        kind = "first"
        while True:
            lease = led.renew_lease(lease, ttl_s=3)
            route = PLAN[route_i % len(PLAN)].id
            att = led.begin_attempt(lease, route=route, envelope_hash=f"sha256:{turn}",
                                    reserve=COST, turn_id=turn, kind=kind)
            faults.point("dispatch.before_send")
            x = rnd.random()
            if x < 0.05:  # refused locally before the request left
                out["faults"] = out.get("faults", 0) + 1
                led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=FailureFact(
                    category=Category.NETWORK, phase=Phase.BEFORE_SEND))
            else:
                send(log, run_id, turn, att.attempt_id)
                faults.point("dispatch.after_send")
                if x < 0.25:
                    out["faults"] = out.get("faults", 0) + 1
                    led.settle_attempt(lease, att.attempt_id, outcome="failed", cost="0",
                                       fact=FailureFact(category=Category.SERVER_ERROR,
                                                        status=503, phase=Phase.AFTER_HEADERS))
                elif x < 0.30:
                    out["faults"] = out.get("faults", 0) + 1
                    led.settle_attempt(lease, att.attempt_id, outcome="unknown")
                    out["unknown"] = out.get("unknown", 0) + 1
                    led.finish_run(run_id, lease.fence, "stopped")
                    led.release_lease(lease)
                    return  # execution unknown: never re-sent (default policy)
                else:
                    led.settle_attempt(lease, att.attempt_id, outcome="succeeded",
                                       cost=COST * Decimal(rnd.random()))
                    break
            led.reserve_retry(lease)
            route_i += 1
            kind = "failover"
    led.finish_run(run_id, lease.fence, "succeeded")
    led.release_lease(lease)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    fn = globals()[name + "_worker"]
    conv = [int(a) if a.lstrip("-").isdigit() else a for a in args]
    print(json.dumps(fn(*conv)), flush=True)
