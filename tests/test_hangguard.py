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


def _pytest(tmp_path: pathlib.Path, *args: str, timeout: float = 120,
            **environ: str) -> subprocess.CompletedProcess[str]:
    """pytest run on ``tmp_path`` in its own process with the guard, its grace 1 s."""
    env = {**os.environ, "LEDGER_HANG_GRACE_S": "1", **environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.hangguard",
         *args, "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("given", ["option", "environment"])
def test_a_test_blocked_again_after_its_timeout_ends_the_run_red(
        tmp_path: pathlib.Path, given: str) -> None:
    # The timeout as pytest-timeout reads it, --timeout or PYTEST_TIMEOUT alike.
    (tmp_path / "test_hang.py").write_text(_HANGS_IN_CLEANUP)
    # The bound is far below the cleanup's 600 s and far above the guard's 1 s + 1 s, so a
    # loaded machine does not decide the outcome.
    if given == "environment":
        done = _pytest(tmp_path, PYTEST_TIMEOUT="1")
    else:
        done = _pytest(tmp_path, "--timeout=1")
    assert done.returncode != 0
    # faulthandler's dump names the test that hung, for the log of the run that went red.
    assert "test_cleanup_blocks_after_the_alarm" in done.stderr, done.stderr[-2000:]


def test_under_func_only_slow_fixtures_are_not_a_hang(tmp_path: pathlib.Path) -> None:
    # pytest-timeout's func_only times the test function alone; so does the guard, or a test
    # whose fixtures take longer than its timeout would end its process.
    (tmp_path / "test_slow_setup.py").write_text(textwrap.dedent("""
        import time
        import pytest

        @pytest.fixture
        def slow():
            time.sleep(4)  # past the 1 s timeout and the 1 s grace, in setup only

        @pytest.mark.timeout(1, func_only=True)
        def test_quick_body(slow):
            pass
    """))
    done = _pytest(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_disable_debugger_detection_keeps_the_guard_under_a_debugger(
        tmp_path: pathlib.Path) -> None:
    # A registered debugger turns pytest-timeout off unless disable_debugger_detection says
    # otherwise: then its alarm fires, and the guard must end a cleanup that blocks again.
    # pytest-timeout takes a trace function from a module named like pydevd's for a debugger.
    (tmp_path / "pydevd_stand_in.py").write_text("def trace(frame, event, arg):\n    return None\n")
    (tmp_path / "test_hang_debugged.py").write_text(textwrap.dedent("""
        import sys
        import threading
        import time
        import pytest
        import pydevd_stand_in

        sys.settrace(pydevd_stand_in.trace)

        def test_cleanup_blocks_under_a_debugger():
            try:
                time.sleep(60)
            finally:
                threading.Event().wait(90)
    """))
    # Without the guard the cleanup's 90 s would outlast this bound.
    done = _pytest(tmp_path, "--timeout=1", "--timeout-disable-debugger-detection", timeout=60)
    assert done.returncode != 0
    assert "test_cleanup_blocks_under_a_debugger" in done.stderr, done.stderr[-2000:]
