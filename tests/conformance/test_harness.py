"""The harness itself: another vector directory through $LEDGER_CONFORMANCE_DIR, cases by id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_env_dir_is_used_and_cases_are_reported_by_id(tmp_path: Path) -> None:
    doc = {
        "kind": "classify",
        "preset": "fased",
        "policy": {"failure_window_s": 5},
        "cases": [
            {"id": "own-ok", "observe": {"status": 429}, "expect": {"category": "rate_limit"}},
            {"id": "own-wrong", "observe": {"status": 429}, "expect": {"category": "auth"}},
        ],
    }
    (tmp_path / "own.json").write_text(json.dumps(doc), encoding="utf-8")
    env = {**os.environ, "LEDGER_CONFORMANCE_DIR": str(tmp_path)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "tests/conformance/test_conformance.py",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "PASSED tests/conformance/test_conformance.py::test_vector[own-ok]" in r.stdout
    assert "FAILED tests/conformance/test_conformance.py::test_vector[own-wrong]" in r.stdout
    assert "1 failed, 1 passed" in r.stdout
