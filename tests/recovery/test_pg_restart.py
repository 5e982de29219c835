"""A PostgreSQL restart (immediate mode: a crash of the server) under a run of workers.

Workers see typed :class:`DatabaseUnavailable` errors, retry the retry-safe calls (begin with the
same attempt id, settle with the same content), and finish. Nothing is lost, duplicated or
corrupted: a begin or settle whose commit landed just before the crash is recognised as the same
write on retry. A dedicated server is started for this test; the shared one is left alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from ledger.api.facade import Ledger
from ledger.domain.records import AttemptState
from ledger.errors import DatabaseUnavailable
from ledger.ops.reconcile import reconcile
from ledger.testing.pgserver import PgServer, find_bindir, start_server
from tests.recovery.helpers import duplicates, finish, sent, spawn
from tests.storage.helpers import budget, grant, routes

pytestmark = pytest.mark.postgres

WORKERS = 3
TURNS = 60


@pytest.fixture
def own_server() -> Iterator[PgServer]:
    if find_bindir() is None:
        pytest.skip("PostgreSQL server binaries not installed")
    # durable: an immediate stop is a crash, and with synchronous_commit=off an acknowledged
    # commit could be lost, which no ledger can survive.
    srv = start_server(durable=True, max_connections=50)
    try:
        yield srv
    finally:
        srv.cleanup()


def test_restart_under_workers(own_server: PgServer, tmp_path: Path) -> None:
    own_server.psql("CREATE DATABASE ledger")
    url = own_server.url("ledger")
    led = Ledger.open(url)
    led.configure_group("g", max_in_flight=WORKERS)
    runs = [f"run-{i}" for i in range(WORKERS)]
    for run_id in runs:
        led.admit_run(run_id, plan=routes(), budget=budget(calls=TURNS, cost="10.00"),
                      grant=grant())
    log = tmp_path / "sent.log"
    procs = [spawn("restart", url, run_id, TURNS, log) for run_id in runs]
    # Wait until the workers are under way, then crash and restart the server.
    deadline = time.monotonic() + 120
    while len(sent(log)) < WORKERS * 5:
        assert time.monotonic() < deadline, "workers made no progress"
        assert all(p.poll() is None for p in procs), "a worker ended early"
        time.sleep(0.05)  # polling the workers' progress, not making time pass
    own_server.stop("immediate")
    with pytest.raises(DatabaseUnavailable):
        led.get_run(runs[0])  # typed, while the server is down
    own_server.start()
    outs = [finish(p) for p in procs]
    assert all(code == 0 for code, _ in outs)
    assert sum(int(o.get("unavailable", 0)) for _, o in outs) > 0  # type: ignore[call-overload]
    lines = sent(log)
    assert len(lines) == WORKERS * TURNS
    assert duplicates([a for _r, _t, a in lines]) == []
    for run_id in runs:
        tl = led.timeline(run_id)
        assert len(tl) == TURNS and all(a.state is AttemptState.SUCCEEDED for a in tl)
        assert [a.seq for a in tl] == list(range(1, TURNS + 1))
        run = led.get_run(run_id)
        assert run.posted == Decimal("0.01") * TURNS and run.reserved == 0
        assert run.calls_used == TURNS
    assert reconcile(led).violations == []
    led.close()


def test_recovery_resumes_across_restarts(own_server: PgServer) -> None:
    """The server crashes inside a takeover (before its commit) and right after another one's
    commit (its acknowledgement lost): recovery retries, adopts its own committed takeover, and
    every run ends up taken over exactly once."""
    from ledger import faults
    from ledger.clock import ManualClock
    from ledger.ops.recovery import recover

    own_server.psql("CREATE DATABASE ledger")
    url = own_server.url("ledger")
    clock = ManualClock(time.time())
    led = Ledger.open(url, clock=clock)
    inflight = {}
    for i in range(4):
        run_id = f"run-{i}"
        led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease(run_id, ttl_s=5)
        inflight[run_id] = led.begin_attempt(lease, route="a", envelope_hash="sha256:e",
                                             reserve="0.1").attempt_id
    clock.advance(10)

    def crash_before_commit(_name: str) -> None:
        own_server.restart("immediate")

    def crash_after_commit(_name: str) -> None:
        own_server.restart("immediate")
        raise DatabaseUnavailable("acknowledgement lost (simulated)")

    class NoWait:
        def sleep(self, seconds: float) -> None:
            pass

        async def asleep(self, seconds: float) -> None:
            pass

    faults.arm("recover.before_commit", crash_before_commit, on_hit=1)
    faults.arm("recover.after_commit", crash_after_commit, on_hit=2)
    try:
        # Two batches of two runs: the first batch's commit is lost to a crash, the second's
        # acknowledgement is lost after it committed.
        rep = recover(led, executor_id="rec", sleeper=NoWait(), batch=2)
    finally:
        faults.disarm()
    assert rep.retries >= 2
    assert sorted(r.run_id for r in rep.runs) == sorted(inflight)
    for r in rep.runs:
        assert r.unknown and r.unknown[0].attempt_id == inflight[r.run_id]
        run = led.get_run(r.run_id)
        assert run.fence == 2 and run.lease_holder == "rec"  # taken over once
        assert led.get_attempt(inflight[r.run_id]).state is AttemptState.UNKNOWN
    recovers = [e for rid in inflight for e in led.events(rid, ["recover"])]
    assert len(recovers) == len(inflight)
    assert reconcile(led).violations == []
    led.close()
