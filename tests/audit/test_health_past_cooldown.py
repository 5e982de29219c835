"""A cooldown that ran out is no cooldown: ``failover-ledger health`` and the dashboard show
``-`` in its COOLDOWN (and DISABLED) column, as for a key that never cooled, while the row
keeps the past time (``--json`` and ``/api/health`` give it unchanged) and the key reads
``ok``. Showing "31 m ago" under COOLDOWN beside ``ok`` read as a cooldown in force."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.ops.audit import Audit
from tests.storage.helpers import begin_on_a, health_lease, overloaded

# Long before the system clock's now, which the command line reads the health at: the
# cooldown the burst starts has run out when it reads.
T0 = 1_700_000_000.0


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=ManualClock(T0), executor_id="w1") as ledger:
        yield ledger


def _cool_a(led: Ledger) -> float:
    """Three 503s within a minute cool route ``a``; returns its cooldown's end."""
    clock = led.clock
    assert isinstance(clock, ManualClock)
    for n in range(3):
        clock.advance(1)
        lease = health_lease(led, f"burst{n}")
        led.settle_attempt(lease, begin_on_a(led, lease), outcome="failed", fact=overloaded())
    key = next(k for k in Audit(led).health(latency_window_s=None).routes if k.key == "a")
    assert key.status == "cooling" and key.cooldown_until is not None
    return key.cooldown_until


def _cli(url: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["--db", url, "health", *args]) == 0
    return capsys.readouterr().out


def test_a_cooldown_that_ran_out_shows_as_none_and_the_row_keeps_its_time(
        led: Ledger, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    until = _cool_a(led)
    lines = _cli(db_url, capsys).splitlines()
    header = lines[1]
    row = next(x for x in lines if x.startswith("a "))
    status = row[header.index("STATUS"):header.index("COOLDOWN")].strip()
    cooldown = row[header.index("COOLDOWN"):header.index("DISABLED")].strip()
    disabled = row[header.index("DISABLED"):header.index("ERRORS")].strip()
    assert (status, cooldown, disabled) == ("ok", "-", "-")
    key = next(k for k in json.loads(_cli(db_url, capsys, "--json"))["routes"]
               if k["key"] == "a")
    assert (key["status"], key["cooldown_until"]) == ("ok", until)


def test_the_dashboard_shows_a_cooldown_only_while_it_holds(led: Ledger, db_url: str) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    until = _cool_a(led)

    def cooldown_cell(now: float) -> str:
        with TestClient(create_app(db_url, clock=ManualClock(now)),
                        base_url="http://127.0.0.1") as c:
            page = c.get("/").text
            api = next(k for k in c.get("/api/health").json()["routes"] if k["key"] == "a")
            assert api["cooldown_until"] == until  # the row's time, in force or not
        table = page.split('id="health-table"', 1)[1].split("</table>", 1)[0]
        row = next(r for r in table.split("<tr>") if r.startswith('<td class="id">a</td>'))
        return row.split("<td")[5]

    assert "in " in cooldown_cell(until - 10)  # in force: how long it has left
    assert cooldown_cell(until + 10).endswith('><span class="muted">-</span></td>')
