"""A test that hangs again after its timeout fired ends its process (``tests/hangguard.py``)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

_HANGS_IN_CLEANUP = textwrap.dedent("""
    import threading
    import time

    def test_cleanup_blocks_after_the_alarm():
        try:
            time.sleep(60)  # pytest-timeout's alarm fails the test here
        finally:
            threading.Event().wait(600)  # and this would then wait unbounded
""")


@pytest.mark.parametrize("given", ["option", "environment"])
def test_a_test_blocked_again_after_its_timeout_ends_the_run_red(
        tmp_path: pathlib.Path, given: str) -> None:
    # The timeout as pytest-timeout reads it, --timeout or PYTEST_TIMEOUT alike.
    (tmp_path / "test_hang.py").write_text(_HANGS_IN_CLEANUP)
    env = {**os.environ, "LEDGER_HANG_GRACE_S": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    timeout = ["--timeout=1"]
    if given == "environment":
        env["PYTEST_TIMEOUT"], timeout = "1", []
    # The bound is far below the cleanup's 600 s and far above the guard's 1 s + 1 s, so a
    # loaded machine does not decide the outcome.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.hangguard",
         *timeout, "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    # faulthandler's dump names the test that hung, for the log of the run that went red.
    assert "test_cleanup_blocks_after_the_alarm" in done.stderr, done.stderr[-2000:]
