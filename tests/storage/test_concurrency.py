"""Several OS processes against one database: budgets, group limits and fences hold.

Workers use the real clock; the assertions read back what was recorded, so they cannot pass by
accident of timing: every overlap of in-flight intervals is checked.
"""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState

from .helpers import budget, collect, routes, spawn

WORKERS = 4


def test_budget_never_overdrawn_by_concurrent_processes(db_url: str) -> None:
    with Ledger.open(db_url) as led:
        led.admit_run("shared", plan=routes(), budget=budget(calls=1000, cost="0.95"))
        lease = led.acquire_lease("shared", ttl_s=600, executor_id="shared")
    results = collect([spawn("budget", db_url, "shared", lease.fence, 15, "0.05")
                       for _ in range(WORKERS)])
    begun = sum(r["begun"] for r in results)
    with Ledger.open(db_url) as led:
        run = led.get_run("shared")
        assert run.posted + run.reserved <= Decimal("0.95")
        assert begun == 19  # exactly what fits: 19 * 0.05 = 0.95
        assert run.posted == Decimal("0.95") and run.calls_used == 19
        assert sum(r["budget"] for r in results) == WORKERS * 15 - 19
        tl = led.timeline("shared")
        assert len(tl) == 19 and sorted(a.seq for a in tl) == list(range(1, 20))


def test_call_allowance_never_exceeded(db_url: str) -> None:
    with Ledger.open(db_url) as led:
        led.admit_run("calls", plan=routes(), budget=budget(calls=23, cost="100"))
        lease = led.acquire_lease("calls", ttl_s=600, executor_id="shared")
    results = collect([spawn("budget", db_url, "calls", lease.fence, 10, "0.01")
                       for _ in range(WORKERS)])
    assert sum(r["begun"] for r in results) == 23
    with Ledger.open(db_url) as led:
        assert led.get_run("calls").calls_used == 23


def test_group_limit_never_exceeded_across_processes(db_url: str, tmp_path: Path) -> None:
    limit = 2
    counter = tmp_path / "inflight"
    counter.write_text("0 0")
    with Ledger.open(db_url) as led:
        led.configure_group("g", max_in_flight=limit)
        for i in range(WORKERS):
            led.admit_run(f"run-{i}", plan=routes(), budget=budget(calls=1000, cost="10"))
    results = collect([spawn("group", db_url, f"run-{i}", 25, counter)
                       for i in range(WORKERS)])
    begun = sum(r["begun"] for r in results)
    assert begun > 0 and begun + sum(r["rejected"] for r in results) == WORKERS * 25
    live, peak = (int(x) for x in counter.read_text().split())
    assert live == 0 and 1 <= peak <= limit
    with Ledger.open(db_url) as led:
        rejected = [a for i in range(WORKERS) for a in led.timeline(f"run-{i}")
                    if a.state is AttemptState.REJECTED]
        assert len(rejected) == sum(r["rejected"] for r in results)
        assert all(a.reject_reason == "capacity_full" for a in rejected)
        assert led.group_projections(["g"])["g"].in_flight == 0


def test_stale_fence_never_writes_from_other_processes(db_url: str) -> None:
    clock = ManualClock(time.time())
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("fenced", plan=routes(), budget=budget(calls=1000, retries=1000))
        old = led.acquire_lease("fenced", ttl_s=1, executor_id="old")
        clock.advance(2)  # the old lease expires: the new executor acquires it
        new = led.acquire_lease("fenced", ttl_s=600, executor_id="new")
        assert new.fence > old.fence
    results = collect([spawn("stale", db_url, "fenced", old.fence, 10) for _ in range(WORKERS)])
    assert all(r["written"] == 0 and r["refused"] == 20 for r in results)
    with Ledger.open(db_url) as led:
        run = led.get_run("fenced")
        assert run.calls_used == 0 and run.retries_used == 0 and led.timeline("fenced") == []


def test_child_carving_under_concurrency(db_url: str) -> None:
    """Many threads carve children from one parent: the sum never exceeds the parent's."""
    from concurrent.futures import ThreadPoolExecutor

    from ledger.errors import AllowanceExhausted, BudgetExceeded

    with Ledger.open(db_url) as led:
        led.admit_run("parent", plan=routes(), budget=budget(calls=100, retries=100, cost="1.00"))
        lease = led.acquire_lease("parent", ttl_s=600)

        def carve(i: int) -> bool:
            try:
                led.admit_run(f"child-{i}", plan=routes(), budget=budget(calls=1, retries=0,
                                                                         cost="0.15"),
                              parent=lease)
                return True
            except (BudgetExceeded, AllowanceExhausted):
                return False

        with ThreadPoolExecutor(8) as pool:
            ok = sum(pool.map(carve, range(12)))
        parent = led.get_run("parent")
        assert ok == 6 and parent.carved == Decimal("0.90")
        assert len(led.children("parent")) == 6


def test_one_probe_per_throttle_window_cluster_wide(db_url: str) -> None:
    Ledger.open(db_url).close()
    first = collect([spawn("probe", db_url, 1000, 5) for _ in range(WORKERS)])
    assert sum(r["won"] for r in first) == 1
    inside = collect([spawn("probe", db_url, 1029, 5) for _ in range(WORKERS)])
    assert sum(r["won"] for r in inside) == 0  # still inside the 30 s window
    after = collect([spawn("probe", db_url, 1030, 5) for _ in range(WORKERS)])
    assert sum(r["won"] for r in after) == 1
