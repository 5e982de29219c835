"""The wheel carries the migrations and presets, and an installed ledger can migrate a database."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_creates_and_migrates_a_database(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = out.glob("ledger-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ledger/py.typed" in names
    assert "ledger/_migrations/env.py" in names
    assert any(n.startswith("ledger/_migrations/versions/0001") for n in names)
    assert {"ledger/_policies/goclaw.yaml", "ledger/_policies/fased.yaml",
            "ledger/_policies/failure-domain.yaml"} <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Run from elsewhere with the extracted wheel first on the path: the repository's own
    # migrations/ and policies/ folders cannot be what makes this work.
    code = (
        "import ledger, sys\n"
        "from ledger.storage.migrate import script_location\n"
        f"assert ledger.__file__.startswith({str(site)!r}), ledger.__file__\n"
        "assert script_location().endswith('_migrations'), script_location()\n"
        "from ledger import Ledger, Budget, Route, preset\n"
        "led = Ledger.open('fresh.db')\n"
        "led.admit_run('r', plan=[Route(id='a', provider='p', model='m', group='g',"
        " recipient='x')], budget=Budget(max_calls=1, max_retries=0, max_cost=1),"
        " policy='fased')\n"
        "print(led.get_run('r').policy['name'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fased"
    assert (tmp_path / "fresh.db").exists()
