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
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, Lease
from ledger.domain.values import Budget, Price, Route
from ledger.errors import DatabaseUnavailable, FencedOut
from ledger.ops.recovery import recover

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
    done = retrying(lambda: turn_done(led, run_id), out)
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


def continue_worker(url: str, run_ids: str, turns: int, log: str) -> dict[str, int]:
    """Continue recovered runs (comma-separated) in one process: acquire, drive, release."""
    led = Ledger.open(url, migrate_schema=False, executor_id=f"c-{os.getpid()}")
    out: dict[str, int] = {}
    for run_id in run_ids.split(","):
        lease = led.acquire_lease(run_id, ttl_s=600)
        drive(led, lease, run_id, turns, log, out)
        led.release_lease(lease)
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
    Route(id="a", provider="p1", model="m1", group="g", recipient="r1", price=Price()),
    Route(id="b", provider="p1", model="m2", group="g", recipient="r1", price=Price()),
    Route(id="c", provider="p2", model="m1", group="h", recipient="r2", price=Price()),
]


GROUPS = 4  # capacity groups g0..g3 and h0..h3 in the soak


class _NoWait:
    """The soak's sleeper: retry-owner waits return at once (the soak measures safety)."""

    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


def owner_soak_worker(url: str, prefix: str, seconds: int, log: str, seed: int,
                      ttl_s: int) -> dict[str, int]:
    """Many runs through the retry owner (``ledger.api.turn.execute``) with random provider faults.

    The send function records the request in ``sent.log`` unless the fault happens before the
    request leaves (connect refused). A stalled run taken over by recovery (FencedOut) is
    abandoned; a stop (FailoverExhausted) ends the run.
    """
    from ledger.api.turn import Dispatch, SendResult, execute
    from ledger.domain.envelope import Envelope, Part
    from ledger.domain.facts import Observation, Transport
    from ledger.errors import FailoverExhausted

    rnd = random.Random(seed)
    led = Ledger.open(url, migrate_schema=False, executor_id=f"{prefix}-{os.getpid()}")
    out: dict[str, int] = {}

    def bump(k: str) -> None:
        out[k] = out.get(k, 0) + 1

    def send(d: Dispatch) -> SendResult:
        x = rnd.random()
        if x < 0.04:
            bump("faults")
            return SendResult.failed(Observation(transport=Transport.CONNECT_REFUSED))
        send_line(log, d.run_id, d.turn_id, d.attempt_id)
        if x < 0.70:
            return SendResult(ok=True, output="ok", prompt_tokens=10, completion_tokens=5,
                              cost=Decimal("0.004"))
        bump("faults")
        if x < 0.84:
            return SendResult.failed(Observation(status=503))
        if x < 0.86:
            return SendResult.failed(Observation(status=429, headers={"retry-after": "1"}))
        if x < 0.94:
            return SendResult.failed(Observation(status=500))
        return SendResult.failed(Observation(transport=Transport.READ_TIMEOUT))

    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        run_id = f"{prefix}-{os.getpid()}-{n}"
        # Route ids rotate over a pool, so route cooldowns from earlier faults (shared health)
        # do not stop every later run: the soak keeps exercising the write path.
        k = rnd.randrange(64)
        plan = [r.model_copy(update={"id": f"{r.id}{k}", "model": f"{r.model}-{k}",
                                     "group": f"{r.group}{k % GROUPS}"}) for r in PLAN]
        led.admit_run(run_id, plan=plan, budget=Budget(max_calls=8, max_retries=5,
                                                       max_cost=Decimal("0.20")))
        bump("runs")
        try:
            lease = led.acquire_lease(run_id, ttl_s=ttl_s)
            status = "succeeded"
            for t in range(1, rnd.randint(1, 3) + 1):
                lease = led.renew_lease(lease, ttl_s=ttl_s)
                env = Envelope(parts=[Part(content=f"{run_id} turn {t}")], max_output_tokens=50)
                try:
                    execute(led, lease, env, send, turn_id=f"t{t}", sleeper=_NoWait(), rng=rnd,
                            reserve=Decimal("0.01"))
                except FailoverExhausted:
                    bump("stopped")
                    status = "stopped"
                    break
            led.finish_run(lease, status)
            led.release_lease(lease)
        except FencedOut:
            bump("fenced")
    led.close()
    return out


def send_line(log: str, run_id: str, turn: str, attempt_id: str) -> None:
    send(log, run_id, turn, attempt_id)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    fn = globals()[name + "_worker"]
    conv = [int(a) if a.lstrip("-").isdigit() else a for a in args]
    print(json.dumps(fn(*conv)), flush=True)
