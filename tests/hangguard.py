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

import contextlib
import faulthandler
import os
from collections.abc import Iterator
from typing import NamedTuple

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


class _Settings(NamedTuple):
    timeout: float  # 0: none
    func_only: bool  # the timeout covers the test function only, not its fixtures
    ignore_debugger: bool  # pytest-timeout's disable_debugger_detection


def _settings_of(item: pytest.Item) -> _Settings:
    """The item's timeout settings as pytest-timeout decides them (its marker in any form,
    ``PYTEST_TIMEOUT``, ``--timeout``, the ini values)."""
    try:
        import pytest_timeout

        got = pytest_timeout._get_item_settings(item)
        return _Settings(float(got.timeout or 0), bool(got.func_only),
                         bool(got.disable_debugger_detection))
    except (ImportError, AttributeError):  # another pytest-timeout: its plain settings
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            return _Settings(float(marker.args[0]), bool(marker.kwargs.get("func_only")),
                             bool(marker.kwargs.get("disable_debugger_detection")))
        try:
            return _Settings(float(item.config.getoption("timeout", None)
                                   or item.config.getini("timeout") or 0), False, False)
        except ValueError:  # pytest-timeout not loaded (-p no:timeout): no timeout to follow
            return _Settings(0.0, False, False)


def _debugging() -> bool:
    """Whether a debugger is attached (pytest-timeout times nothing out then either)."""
    try:
        import pytest_timeout

        return bool(pytest_timeout.is_debugging())
    except (ImportError, AttributeError):
        return False


@contextlib.contextmanager
def _armed(settings: _Settings, here: bool) -> Iterator[None]:
    """The guard armed, if ``here`` is where pytest-timeout times the test, at the timeout
    plus the grace (not at all under a debugger, unless told to ignore one)."""
    limit = settings.timeout if here and (settings.ignore_debugger or not _debugging()) else 0.0
    if limit > 0:
        faulthandler.dump_traceback_later(limit + GRACE_S, exit=True, file=_stderr["fd"])
    try:
        yield
    finally:
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()


def pytest_enter_pdb() -> None:
    # Someone is at a --pdb prompt: as pytest-timeout does, no longer time the test.
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # The whole test, fixtures included, as pytest-timeout times it by default.
    settings = _settings_of(item)
    with _armed(settings, here=not settings.func_only):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    # The test function alone, under func_only: its fixtures may take longer than its timeout.
    settings = _settings_of(item)
    with _armed(settings, here=settings.func_only):
        yield
