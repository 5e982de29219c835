"""A last bound on a hung test: its worker process ends, so the run goes red instead of hanging.

pytest-timeout fails a test that runs past its timeout by raising inside it, once. A test whose
cleanup then blocks again (a ``finally`` waiting on a lock the failed body held, a fixture's
teardown joining a thread that never ends) is not interrupted a second time, and its worker would
wait until CI's own bound. Here each test also arms :func:`faulthandler.dump_traceback_later` at
its timeout plus a grace: if the test is still running then, every thread's stack is written to
stderr and the process exits. Under pytest-xdist the controller reports the worker crashed in that
test, which fails the run, and goes on with a new worker.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator

import pytest

#: Seconds a test may run past its pytest-timeout alarm (time for its cleanup) before its
#: process is ended. ``LEDGER_HANG_GRACE_S`` overrides it (the guard's own test sets it low).
GRACE_S = float(os.environ.get("LEDGER_HANG_GRACE_S", "120"))


_stderr: dict[str, int] = {}


def pytest_configure(config: pytest.Config) -> None:
    # The process's own stderr, taken while pytest's capture is suspended (as its faulthandler
    # plugin takes it): during a test, fd 2 is the capture's temporary file, which nobody reads
    # after the process is ended.
    _stderr["fd"] = os.dup(2)


def _timeout_of(item: pytest.Item) -> float:
    """The item's timeout as pytest-timeout decides it (its marker in any form,
    ``PYTEST_TIMEOUT``, ``--timeout``, the ini value); 0: none."""
    try:
        import pytest_timeout

        return float(pytest_timeout._get_item_settings(item).timeout or 0)
    except (ImportError, AttributeError):  # another pytest-timeout: its plain settings
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            return float(marker.args[0])
        try:
            return float(item.config.getoption("timeout", None)
                         or item.config.getini("timeout") or 0)
        except ValueError:  # pytest-timeout not loaded (-p no:timeout): no timeout to follow
            return 0.0


def _debugging() -> bool:
    """Whether a debugger is attached (pytest-timeout times nothing out then either)."""
    try:
        import pytest_timeout

        return bool(pytest_timeout.is_debugging())
    except (ImportError, AttributeError):
        return False


def pytest_enter_pdb() -> None:
    # Someone is at a --pdb prompt: as pytest-timeout does, no longer time the test.
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    limit = 0.0 if _debugging() else _timeout_of(item)
    if limit > 0:
        faulthandler.dump_traceback_later(limit + GRACE_S, exit=True, file=_stderr["fd"])
    try:
        yield
    finally:
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()
