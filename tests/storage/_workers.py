"""Worker processes for the multi-process storage tests (run as ``python -m``).

Each worker opens its own Ledger on the shared database and hammers one operation, printing one
JSON line of counts. They use the real clock: the test checks invariants from what was recorded.
"""

from __future__ import annotations

import fcntl
import json
import sys
import time
from decimal import Decimal

from ledger.api.facade import Ledger
from ledger.domain.records import Lease
from ledger.errors import (
    AllowanceExhausted,
    BudgetExceeded,
    CapacityUnavailable,
    DatabaseUnavailable,
    FencedOut,
)


def budget_worker(url: str, run_id: str, fence: int, n: int, reserve: str) -> dict[str, int]:
    """Begin+settle as fast as possible on one shared run until refused."""
    led = Ledger.open(url, migrate_schema=False)
    lease = Lease(run_id, "shared", fence, 0.0)
    out = {"begun": 0, "budget": 0, "allowance": 0, "unavailable": 0}
    for _ in range(n):
        try:
            att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve=reserve)
        except BudgetExceeded:
            out["budget"] += 1
            continue
        except AllowanceExhausted:
            out["allowance"] += 1
            continue
        except DatabaseUnavailable:
            out["unavailable"] += 1
            continue
        out["begun"] += 1
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost=Decimal(reserve))
    led.close()
    return out


def _count(path: str, delta: int) -> None:
    """Shared in-flight counter across processes: 'live peak' in a file under flock."""
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        live, peak = (int(x) for x in (f.read().split() or ["0", "0"]))
        live += delta
        peak = max(peak, live)
        f.seek(0)
        f.truncate()
        f.write(f"{live} {peak}")
        f.flush()  # before unlocking, or another process reads the old count
        fcntl.flock(f, fcntl.LOCK_UN)


def group_worker(url: str, run_id: str, n: int, counter: str) -> dict[str, int]:
    """Own a run; begin attempts in a capacity-limited group, hold briefly, settle.

    The holder counts itself in a shared counter after its begin committed and out before its
    settle starts, so the counter never exceeds what the ledger counts: a peak above the limit
    proves the ledger admitted too many.
    """
    led = Ledger.open(url, migrate_schema=False)
    lease = led.acquire_lease(run_id, ttl_s=600)
    out = {"begun": 0, "rejected": 0}
    for _ in range(n):
        try:
            att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
        except CapacityUnavailable:
            out["rejected"] += 1
            continue
        out["begun"] += 1
        _count(counter, +1)
        # Hold the slot across a few reads, so holds overlap between processes.
        for _ in range(4):
            led.group_projections(["g"])
        _count(counter, -1)
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0")
    led.close()
    return out


def hammer_worker(url: str, run_id: str, n: int, group: str) -> dict[str, object]:
    """Own a run; begin attempts in limited group ``group`` as fast as it can, each settled at
    once. After every begin it reads the group's durable in-flight count (the slots the
    database holds, every process's); it also returns the interval during which it knew it held
    each slot (after its begin returned, before its settle started: inside the real hold), on
    the system-wide monotonic clock, so the test can count overlaps across processes.
    """
    led = Ledger.open(url, migrate_schema=False)
    lease = led.acquire_lease(run_id, ttl_s=600)
    out: dict[str, object] = {"begun": 0, "rejected": 0}
    seen: list[int] = []
    held: list[tuple[float, float]] = []
    for _ in range(n):
        try:
            att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
        except CapacityUnavailable:
            out["rejected"] = int(out["rejected"]) + 1  # type: ignore[call-overload]
            continue
        t0 = time.monotonic()
        out["begun"] = int(out["begun"]) + 1  # type: ignore[call-overload]
        seen.append(led.group_projections([group])[group].in_flight)
        t1 = time.monotonic()
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0")
        held.append((t0, t1))
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)
    led.close()
    out["seen"] = seen
    out["held"] = held
    return out


def stale_worker(url: str, run_id: str, fence: int, n: int) -> dict[str, int]:
    """Write with a stale fence; every write must be refused."""
    led = Ledger.open(url, migrate_schema=False)
    lease = Lease(run_id, "stale", fence, 0.0)
    out = {"refused": 0, "written": 0}
    for _ in range(n):
        try:
            led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
            out["written"] += 1
        except FencedOut:
            out["refused"] += 1
        try:
            led.reserve_retry(lease)
            out["written"] += 1
        except FencedOut:
            out["refused"] += 1
    led.close()
    return out


def probe_worker(url: str, t: int, n: int) -> dict[str, int]:
    """Claim the cluster-wide probe of a cooling primary ``n`` times at clock ``t``."""
    from ledger.clock import ManualClock
    from ledger.domain.values import Route

    led = Ledger.open(url, migrate_schema=False, clock=ManualClock(float(t)))
    route = Route(id="a", provider="p1", model="m1", group="g", recipient="r1")
    won = sum(led.claim_probe(route, interval_s=30.0) for _ in range(n))
    led.close()
    return {"won": won}


def lapse_worker(url: str, clock_path: str, run_id: str, log_path: str, n: int, ttl: str,
                 margin: str) -> dict[str, int]:
    """Begin and settle attempts in the limited group ``g`` on a clock the test moves, never
    renewing: a lease that lapses (the test may SIGSTOP this process past it) must start
    nothing; the worker then acquires again. Every lease it gets is logged for the checker."""
    import time

    from ledger.errors import LeaseHeld, LeaseLost
    from ledger.testing.clock import SharedClock

    led = Ledger.open(url, migrate_schema=False, clock=SharedClock(clock_path),
                      executor_id=run_id, lease_margin_s=float(margin))
    out = {"done": 0, "rejected": 0, "lapsed": 0, "late": 0}
    log = open(log_path, "a")  # noqa: SIM115 - closed below
    lease: Lease | None = None
    while out["done"] < n:
        if lease is None:
            try:
                lease = led.acquire_lease(run_id, ttl_s=float(ttl))
            except LeaseHeld:
                time.sleep(0.002)
                continue
            log.write(json.dumps({"fence": lease.fence, "expires_at": lease.expires_at}) + "\n")
            log.flush()
        try:
            att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0")
        except CapacityUnavailable:
            out["rejected"] += 1
            time.sleep(0.002)
            continue
        except (LeaseLost, FencedOut):
            out["lapsed"] += 1
            lease = None
            continue
        time.sleep(0.005)  # the model call: the slot is held meanwhile
        try:
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0")
        except FencedOut:
            out["late"] += 1
            lease = None
        out["done"] += 1
    log.close()
    led.close()
    return out


def carve_worker(url: str, run_id: str, fence: int, w: int, n: int) -> dict[str, int]:
    """Carve Children of one shared parent, spend in each and end it (it gives back what it
    did not use), or begin the parent's own calls, at random; counts what was done."""
    import random

    from ledger.domain.records import RunStatus
    from ledger.domain.values import Budget, Grant, Price, Route

    rnd = random.Random(w)
    plan = [Route(id="a", provider="p1", model="m1", group="g", recipient="r1", price=Price())]
    led = Ledger.open(url, migrate_schema=False)
    pl = Lease(run_id, "shared", fence, 0.0)
    out = {"parent_begun": 0, "children": 0, "refused": 0}
    try:
        for i in range(n):
            try:
                if rnd.random() < 0.5:
                    cid = f"{run_id}-c{w}-{i}"
                    led.admit_run(cid, plan=plan, grant=Grant(), parent=pl, budget=Budget(
                        max_calls=3, max_retries=1, max_cost=Decimal("0.07")))
                    out["children"] += 1
                    cl = led.acquire_lease(cid, ttl_s=600)
                    late = None
                    for j in range(rnd.randint(0, 2)):
                        a = led.begin_attempt(cl, route="a", envelope_hash="sha256:e",
                                              reserve="0.03", turn_id="t", take_retry=j > 0,
                                              kind="retry" if j else "first")
                        if j == 0 and rnd.random() < 0.5:
                            late = a  # settled once the Child has ended, below
                            continue
                        led.settle_attempt(cl, a.attempt_id, outcome="succeeded", cost="0.02")
                    led.finish_run(cl, RunStatus.SUCCEEDED)
                    if late is not None:
                        # A failure settled after the end: its health row and the parent's
                        # give-back in one transaction, while the parent's failures lock the
                        # same health row.
                        led.settle_attempt(cl, late.attempt_id, outcome="failed",
                                           observation={"status": 503})
                    led.release_lease(cl)
                else:
                    a = led.begin_attempt(pl, route="a", envelope_hash="sha256:e",
                                          reserve="0.03", turn_id=f"pt-{w}-{i}")
                    out["parent_begun"] += 1
                    if rnd.random() < 0.5:
                        led.settle_attempt(pl, a.attempt_id, outcome="failed",
                                           observation={"status": 503})
                    else:
                        led.settle_attempt(pl, a.attempt_id, outcome="succeeded", cost="0.02")
            except (BudgetExceeded, AllowanceExhausted):
                out["refused"] += 1
    finally:
        led.close()
    return out


def migrate_worker(url: str) -> dict[str, int]:
    Ledger.open(url).close()
    return {"ok": 1}


def retention_worker(url: str, at: int, gate: str, ready: str) -> dict[str, object]:
    """One retention run at ledger time ``at``, started when the test opens ``gate`` (it
    holds an exclusive lock on the file; this process, its ledger open, writes ``ready``
    and waits for a shared one): two such run at the same moment. Prints what it dropped,
    or the typed error it got."""
    from ledger.clock import ManualClock
    from ledger.errors import LedgerError

    led = Ledger.open(url, clock=ManualClock(float(at)), migrate_schema=False)
    try:
        led.health()  # its connection made before the gate opens
        with open(gate) as g:
            with open(ready, "w") as f:
                f.write("ready")
            fcntl.flock(g, fcntl.LOCK_SH)
            try:
                rep = led.drop_history(60 * 86400, by="ops", reason="keep 60 days")
            except LedgerError as e:
                return {"error": type(e).__name__, "message": str(e),
                        "fields": {k: str(v) for k, v in e.fields.items()}}
        return {"dropped": [[p.table, p.partition, p.rows] for p in rep.dropped],
                "event": None if rep.event is None else rep.event.event_id}
    finally:
        led.close()


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    fn = globals()[name + "_worker"]
    conv = [int(a) if a.isdigit() else a for a in args]
    print(json.dumps(fn(*conv)))
