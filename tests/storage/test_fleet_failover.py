"""A fleet of worker processes survives the loss of the PostgreSQL primary (issue 24).

A primary and a synchronous hot standby run on loopback (:mod:`tests.storage._standby`). Three
worker processes (:mod:`tests.storage._fleet`), each with its own ledger on a URL naming both
servers, run turns through the retry owner and the built-in adapters against one fake provider
over loopback HTTP. Under that load the primary is killed (``pg_ctl stop -m immediate``), then
the standby promoted; blocking ``Ledger`` workers once, ``AsyncLedger`` workers once. Then, on the
new primary:

* every request that reached the provider has its Attempt row, joined by ``X-Ledger-Attempt``,
  and none was sent twice;
* every turn a worker saw acknowledged is there, ``succeeded``;
* every error a worker saw is typed (``DatabaseUnavailable``, with the driver's error as its
  cause) — none untyped, none other;
* every Attempt that never reached the provider ends ``not_sent`` (or ``rejected``) with nothing
  held, once the run's leases are recovered; the begins the ledger could not resolve during the
  outage (``fields["deferred"]``) it resolved itself once the database answered, before
  recovery ran (the workers do nothing about them);
* every worker writes again after the promotion, without being restarted.

The test waits only for what the workers report (each wait has a deadline); nothing sleeps for
time to pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger
from ledger.adapters import ATTEMPT_HEADER
from ledger.clock import ManualClock
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.testing import FakeProvider
from ledger.testing.pgserver import PgServer

from ._standby import promote

pytestmark = pytest.mark.postgres

REPO = Path(__file__).resolve().parents[2]
WORKERS = 3
# Turns each worker must have acknowledged before the kill, and after the promotion.
BEFORE, AFTER = 3, 3
DEADLINE_S = 90.0


def _spawn(mode: str, url: str, endpoint: str, name: str, flags: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("LEDGER_FAULTS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage._fleet", mode, url, endpoint, name, str(flags)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _log(flags: Path, name: str) -> list[dict[str, Any]]:
    path = flags / f"{name}.jsonl"
    if not path.exists():
        return []
    # A line being written is not complete yet: only whole lines are read.
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


def _wait_for(what: str, cond: Callable[[], bool], procs: list[subprocess.Popen[str]]) -> None:
    """Wait until ``cond()`` holds (the workers' reports), failing after the deadline or as
    soon as a worker died."""
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a worker exited ({p.returncode}) while waiting for "
                                     f"{what}: {p.stderr.read()[-3000:] if p.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {DEADLINE_S:.0f} s")
        time.sleep(0.02)  # polling the workers' logs, not waiting for time to pass


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_fleet_loses_nothing_and_sends_nothing_twice_when_the_primary_dies(
        cluster: tuple[PgServer, PgServer], tmp_path: Path, mode: str) -> None:
    primary, standby = cluster
    url = (f"postgresql+psycopg://postgres@/ha?host=127.0.0.1,127.0.0.1"
           f"&port={primary.port},{standby.port}&connect_timeout=5")
    names = [f"{mode}{i}" for i in range(WORKERS)]

    def count(name: str, key: str, promoted: bool | None = None) -> int:
        return sum(1 for e in _log(tmp_path, name)
                   if key in e and (promoted is None or e.get("promoted") is promoted))

    with FakeProvider().in_thread() as fake:
        procs = [_spawn(mode, url, fake.endpoint("openai"), n, tmp_path) for n in names]
        try:
            _wait_for("turns before the kill",
                      lambda: all(count(n, "ack") >= BEFORE for n in names), procs)
            primary.stop("immediate")  # the primary dies under load
            _wait_for("errors while no primary takes writes",
                      lambda: all(count(n, "error") >= 1 for n in names), procs)
            promote(standby)
            (tmp_path / "promoted").touch()
            _wait_for("turns after the promotion",
                      lambda: all(count(n, "ack", promoted=True) >= AFTER for n in names), procs)
            (tmp_path / "stop").touch()
            for p in procs:
                _out, err = p.communicate(timeout=DEADLINE_S)
                assert p.returncode == 0, err[-3000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        sent = [r.headers.get(ATTEMPT_HEADER.lower()) for r in fake.requests]

    logs = {n: _log(tmp_path, n) for n in names}
    for n, log in logs.items():
        assert log[-1].get("done") is True, (n, log[-1])
    deferred = {a for log in logs.values() for a in log[-1]["deferred"]}
    acked = [e["ack"] for log in logs.values() for e in log if "ack" in e]
    errors = [e for log in logs.values() for e in log if "error" in e]
    # Every error a worker saw is typed, and it is the one the outage explains.
    assert all(e["typed"] for e in errors), [e for e in errors if not e["typed"]]
    assert {e["error"] for e in errors} == {"DatabaseUnavailable"}, Counter(
        (e["error"], e["text"]) for e in errors)

    # The begins the ledger kept to resolve were resolved by it when it could (at the latest
    # as the worker closed it): never sent, so not_sent with nothing held, or never recorded.
    # Read before recovery, which would settle an open one otherwise (unknown, hold kept).
    if deferred:
        left = standby.psql(
            "SELECT a.attempt_id, a.state, d.state FROM attempts a JOIN debits d "
            "ON d.attempt_id = a.attempt_id WHERE a.attempt_id IN ("
            + ", ".join(f"'{a}'" for a in sorted(deferred)) + ")", db="ha").splitlines()
        assert [r for r in left if r.split("|")[1] not in ("not_sent", "rejected")
                or r.split("|")[2] == "reserved"] == [], left

    # The leases the outage left held (a release that failed) lapse; recovery takes them.
    with Ledger.open(standby.url("ha"), migrate_schema=False,
                     clock=ManualClock(time.time() + 3600)) as led:
        recover(led, release=True)
        assert reconcile(led).violations == []
        rows = {line.split("|")[0]: line.split("|")[1:] for line in standby.psql(
            "SELECT a.attempt_id, a.state, d.state FROM attempts a "
            "JOIN debits d ON d.attempt_id = a.attempt_id", db="ha").splitlines()}

    # Every request that reached the provider names an Attempt of the ledger; none twice.
    assert None not in sent
    assert [k for k, v in Counter(sent).items() if v > 1] == [], "an Attempt was sent twice"
    assert [a for a in sent if a not in rows] == [], "a request without its Attempt row"
    # No acknowledged turn is missing after the promotion.
    assert [a for a in acked if rows.get(a, [None])[0] != "succeeded"] == [], rows
    # Every Attempt that never reached the provider ends not_sent (or rejected), holding
    # nothing.
    unsent = {a: r for a, r in rows.items() if a not in set(sent)}
    assert {a: r for a, r in unsent.items()
            if r[0] not in ("not_sent", "rejected") or r[1] == "reserved"} == {}
    assert len(acked) >= WORKERS * (BEFORE + AFTER)
