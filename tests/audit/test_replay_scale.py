"""Replay at scale: 100,000 generated Attempts, replayed under each preset on both backends.

The history comes from the benchmarks' bulk generator (``python -m benchmarks generate
--frozen-policy``): some 60,000 Runs over seven days under the goclaw preset, every decision
recorded with its inputs exactly as the retry owner records them, every Run frozen under the
preset itself. Each replay must recompute every recorded decision under its own policy and
report within a minute of its own CPU time at that size (the figure is CPU, not wall time, so
the test holds on a machine busy with other work; ``docs/audit.md`` gives wall times).

It takes several minutes (generating the history is most of it), so it runs on demand::

    LEDGER_SCALE=1 LEDGER_REQUIRE_POSTGRES=1 python -m pytest -p no:cacheprovider \\
        tests/audit/test_replay_scale.py -s
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.generate import generate
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.ops.audit import Audit

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("LEDGER_SCALE") != "1",
    reason="the 100,000-attempt replay takes minutes: LEDGER_SCALE=1 runs it (docs/audit.md)")]

ATTEMPTS = 100_000
END = 1_700_000_000.0
DAYS = 7.0
MINUTE = 60.0


@pytest.fixture(scope="module",
                params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def big(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Audit]:
    if request.param == "sqlite":
        url = str(tmp_path_factory.mktemp("scale") / "ledger.db")
    else:
        srv = request.getfixturevalue("pg_server")
        name = f"scale_{os.getpid()}"
        url = srv.create_database(name, template="ledger_template")
    with Ledger.open(url, clock=ManualClock(END)) as led:
        st = generate(led, attempts=ATTEMPTS, days=DAYS, end=END, seed=11, frozen_policy=True)
    assert st.attempts == ATTEMPTS
    led = Ledger.open(url, clock=ManualClock(END + 1), migrate_schema=False)
    try:
        yield Audit(led)
    finally:
        led.close()


@pytest.mark.parametrize("policy", ["goclaw", "failure-domain", "fased"])
def test_replay_of_100k_attempts_reports_within_a_minute(big: Audit, policy: str,
                                                         request: Any) -> None:
    cpu, wall = time.process_time(), time.monotonic()
    rep = big.replay(policy, since=END - DAYS * 86400.0 - 1, until=END + 1)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    print(f"\n{request.node.name}: {rep.runs} runs, {rep.decisions} decisions, "
          f"{rep.differing} differing, {len(rep.findings)} findings: {cpu:.1f} s CPU, "
          f"{wall:.1f} s wall, load {os.getloadavg()[0]:.1f}")
    assert cpu < MINUTE
    assert rep.baseline.attempts >= 0.98 * ATTEMPTS  # model calls (not-sent ones aside)
    assert rep.check.decisions == rep.decisions > ATTEMPTS
    assert rep.check.agree == rep.check.decisions
    assert rep.coverage.decisions_without_inputs == 0
    if policy == "goclaw":  # the policy the history was recorded under
        assert rep.differing == 0 and rep.replayed == rep.baseline
    else:
        assert rep.differing > 1000 and rep.findings
        assert 0 < rep.estimates.share < 0.5
