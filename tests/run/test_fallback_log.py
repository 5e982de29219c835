"""The ``[fallback]`` log line tells an operator reading logs what a failover did.

Beyond the seed's few words (``serving the request with p/m (p0/m0: 429 rate_limit)``), each
line names the Run, the Attempt that failed and its route, the failure's category, status and
the provider's code, the route the turn moves to or the reason it stops, and the backoff
chosen. Ids and route ids only: the prompt and the key never appear (a provider code echoing
the key is redacted). Real HTTP over loopback through a Run session, both backends.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from ledger import (
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    Ledger,
    ManualClock,
    Part,
    Route,
)
from ledger.domain.facts import WireProtocol
from ledger.testing import FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import PRICE

fake = fakeplan.fake
_clear = fakeplan._clear

KEY_ENV = "LEDGER_TEST_FALLBACK_KEY"
KEY = "sk-fallback-log-0123456789abcdef0123"
PROMPT = "Summarise the confidential merger memo."
ASK = Envelope(parts=[Part(content=PROMPT)])
BUDGET = Budget(max_calls=6, max_retries=3, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
T0 = 1_700_000_000.0


def _plan(fake: FakeProvider) -> list[Route]:
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol=WireProtocol.OPENAI,
                  endpoint=fake.endpoint("openai"), price=PRICE, api_key_env=KEY_ENV),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=WireProtocol.OPENAI,
                  endpoint=fake.endpoint("openai"), price=PRICE, api_key_env=KEY_ENV)]


def _fallback_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ledger.run" and r.getMessage().startswith("[fallback]")]


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


def test_a_failover_log_line_names_run_attempt_routes_failure_code_and_backoff(
        db_url: str, fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ledger.run")
    fake.enqueue(Fault.RATE_LIMIT, model="primary-model")
    with Ledger.open(db_url) as led:
        with led.run("r", plan=_plan(fake), budget=BUDGET, grant=GRANT) as run:
            assert run.turn(ASK).route.id == "backup"
        [failed] = [a for a in led.timeline("r") if a.route_id == "primary"]
    assert _fallback_lines(caplog) == [
        "[fallback] serving the request with fake-b/backup-model (fake/primary-model: 429 "
        f"rate_limit): run r, attempt {failed.attempt_id} failed on route primary (rate_limit, "
        "HTTP 429, code rate_limit_exceeded), moving to route backup, backoff 0.0s"]
    assert not any(PROMPT in m or KEY in m for m in caplog.messages)


def test_a_failure_with_no_route_to_move_to_logs_the_stop_without_the_key_it_echoed(
        db_url: str, fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ledger.run")
    fake.enqueue(Fault.ECHO_KEY, model="primary-model")
    with Ledger.open(db_url) as led:
        with led.run("r", plan=_plan(fake), budget=BUDGET, grant=GRANT) as run, \
                pytest.raises(FailoverExhausted) as stop:
            run.turn(ASK)
        [failed] = led.timeline("r")
    [line] = _fallback_lines(caplog)
    assert line.startswith(f"[fallback] no route to move to (fake/primary-model: 401 auth): run "
                           f"r, attempt {failed.attempt_id} failed on route primary (auth, HTTP "
                           "401, code [REDACTED]")
    assert line.endswith(f"), stopping ({stop.value.reason}), backoff 0.0s")
    assert not any(PROMPT in m or KEY in m for m in caplog.messages)


def test_a_failover_after_waiting_for_the_next_route_to_reopen_logs_that_backoff(
        db_url: str, fake: FakeProvider, caplog: pytest.LogCaptureFixture) -> None:
    """Every candidate left cooling (backup's group under a floor for 7 s): the failure-domain
    turn waits for backup to reopen (on the injected clock: nothing sleeps), then moves to it.
    The line is written once the wait is over and says it: moving to route backup, backoff
    7.0s, the wait the turn recorded and the clock slept."""
    caplog.set_level("INFO", logger="ledger.run")
    clock = ManualClock(T0)
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    with Ledger.open(db_url, clock=clock) as led:
        led.set_group_state("gb", "cooldown", until=T0 + 7, reason="test floor")
        with led.run("r", plan=_plan(fake), budget=BUDGET, grant=GRANT,
                     policy="failure-domain") as run:
            assert run.turn(ASK).route.id == "backup"
        [failed] = [a for a in led.timeline("r") if a.route_id == "primary"]
        [wait] = [e.data for e in led.events("r", ["wait"])]
    assert clock.slept == [7.0] and wait["waited_s"] == 7.0 and wait["route"] == "backup"
    assert _fallback_lines(caplog) == [
        "[fallback] serving the request with fake-b/backup-model (fake/primary-model: 503 "
        f"overloaded): run r, attempt {failed.attempt_id} failed on route primary (overloaded, "
        "HTTP 503, code server_error), moving to route backup, backoff 7.0s"]
    assert not any(PROMPT in m or KEY in m for m in caplog.messages)
