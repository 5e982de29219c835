"""The demo through the real entry point: three scenarios, written to the named ledger."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ledger.api import Ledger
from ledger.records import AttemptState

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_offline_and_writes_the_ledger(tmp_path: Path) -> None:
    env = dict(os.environ, LEDGER_URL=str(tmp_path / "ledger.db"))
    res = subprocess.run([sys.executable, "-m", "ledger.cli.main", "demo"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "answered by go-glm" in out  # scenario 1: next model, same healthy group
    assert "answered by official-deepseek" in out  # scenario 2: independent group
    assert "skipped go-glm: same_group_unavailable" in out
    assert "stopped: no_candidate" in out and "official-deepseek: disclosure" in out
    with Ledger.open(str(tmp_path / "ledger.db")) as led:
        runs = sorted({a.run_id for a in led.attempts(limit=100).items})
        assert len(runs) == 3
        served = [led.get_run(r).current_route for r in runs]
        assert served == ["go-glm", "official-deepseek", "go-deepseek"]
        for r in runs:
            states = [a.state for a in led.timeline(r)]
            assert states[0] is AttemptState.SUCCEEDED and AttemptState.FAILED in states
