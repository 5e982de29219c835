"""A process that may read the SQLite file but not write it (``python -m tests.storage._readonly
PATH RUN_ID EXECUTOR FENCE ATTEMPT_ID``), for ``test_driver_errors``.

It drives the public calls against the read-only file and prints one JSON object: per call,
``{"ok": true}`` or the error's class, its ``read_only`` field and the driver exception found in
its chain of causes. Root is not bound by file modes, so the test starts this process without
``CAP_DAC_OVERRIDE`` when it runs as root.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from ledger.api.facade import AsyncLedger, Ledger
from ledger.clock import ManualClock
from ledger.domain.records import Lease
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover

T0 = 1_700_000_000.0  # the test's clock: its lease is live
# Later than any lease the test took: recovery finds the run expired and must write to take it.
LATER = 1_800_000_000.0


DRIVERS = ("sqlite3", "psycopg", "sqlalchemy")


def driver_cause(err: BaseException) -> BaseException | None:
    """The first driver or SQLAlchemy exception among ``err``'s causes and contexts."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err.__cause__, err.__context__]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__module__.split(".")[0] in DRIVERS:
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "orig", None)]
    return None


def _cause_name(err: BaseException) -> str | None:
    cause = driver_cause(err)
    return None if cause is None else f"{type(cause).__module__}.{type(cause).__name__}"


def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        out = call()
        if asyncio.iscoroutine(out):
            asyncio.run(out)
    except Exception as e:
        return {"error": f"{type(e).__module__}.{type(e).__name__}",
                "read_only": getattr(e, "fields", {}).get("read_only"),
                "cause": _cause_name(e), "message": str(e)}
    return {"ok": True}


def recover_later(led: Ledger, clock: ManualClock) -> Any:
    """Recovery once the Run's lease expired: taking it over is a write."""
    clock.set(LATER)
    return recover(led, sleeper=ManualClock(LATER))


def main(path: str, run_id: str, executor: str, fence: int, attempt_id: str) -> dict[str, Any]:
    clock = ManualClock(T0)
    led = Ledger.open(path, clock=clock, migrate_schema=False)
    aled = AsyncLedger(led)
    lease = Lease(run_id, executor, fence, T0 + 30)
    route = led.frozen_run(run_id).plan[0].id
    calls: dict[str, Callable[[], Any]] = {
        "Ledger.open": lambda: Ledger.open(path).close(),
        "configure_group": lambda: led.configure_group("g2", max_in_flight=1),
        "admit_run": lambda: led.admit_run("r-new", plan=led.frozen_run(run_id).plan,
                                           budget={"max_calls": 1, "max_retries": 0,
                                                   "max_cost": "0.10"}),
        "begin_attempt": lambda: led.begin_attempt(lease, route=route, envelope_hash="sha256:e",
                                                   reserve="0.01"),
        "settle_attempt": lambda: led.settle_attempt(lease, attempt_id, outcome="succeeded"),
        "AsyncLedger.mark_unknown": lambda: aled.mark_unknown(lease, attempt_id, "stop"),
        "recover": lambda: recover_later(led, clock),
        "get_run": lambda: led.get_run(run_id),
        "timeline": lambda: led.timeline(run_id),
        "Audit.runs": lambda: Audit(led).runs(),
        "reconcile": lambda: reconcile(led),
    }
    try:
        return {name: outcome(call) for name, call in calls.items()}
    finally:
        led.close()


if __name__ == "__main__":
    p, r, ex, f, a = sys.argv[1:]
    print(json.dumps(main(p, r, ex, int(f), a)))
