"""Spawning the recovery workers and reading what they sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def spawn(worker: str, *args: object, faults: str | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("LEDGER_FAULTS", None)
    if faults:
        env["LEDGER_FAULTS"] = faults
    return subprocess.Popen(
        [sys.executable, "-m", "tests.recovery._workers", worker, *map(str, args)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(p: subprocess.Popen[str], timeout: float = 180) -> tuple[int, dict[str, object]]:
    """Wait for a worker; (return code, its JSON line or {})."""
    stdout, stderr = p.communicate(timeout=timeout)
    if p.returncode not in (0, -9):
        raise AssertionError(f"worker failed ({p.returncode}): {stderr[-3000:]}")
    lines = stdout.strip().splitlines()
    return p.returncode, (json.loads(lines[-1]) if lines else {})


def sent(log: Path) -> list[tuple[str, str, str]]:
    """(run, turn, attempt) per line of the shared sent.log."""
    if not log.exists():
        return []
    return [tuple(line.split()) for line in log.read_text().splitlines()  # type: ignore[misc]
            if line.strip()]


def duplicates(items: list[str]) -> list[str]:
    return [k for k, n in Counter(items).items() if n > 1]
