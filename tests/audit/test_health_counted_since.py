"""An operator sees since when a key's outage is counted: ``KeyHealth.counted_at``, the
``COUNTED SINCE`` column of ``failover-ledger health`` (and its ``--json``), and the dashboard's
``counted since`` column, each the health row's ``counted_at`` (migration 0019), on both
backends.

Under ``failure-domain`` three 503s within 60 s cool route ``a``: the third is the counting
failure. A request already in flight then fails too: it restarts the window and moves
``last_failure_at``, not ``counted_at``, so the two differ and the operator can tell which
Attempts are the same outage (begun before it) and which are new evidence (begun after it). A
probe begun after it fails: that steps the curve and moves ``counted_at``. Once the cooldown
has run out the counters read as reset, and so does ``counted_at``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain.records import Lease
from ledger.domain.timefmt import iso, relative
from ledger.ops.audit import Audit, KeyHealth
from ledger.storage.engine import normalize_url
from tests.storage.helpers import begin_on_a, health_lease, overloaded

# The command line reads the health at the system clock's now, which it has no option to
# move: the ledger's clock is set decades ahead of it, so the outage is live when it reads.
T0 = 4_000_000_000.0



def _row(url: str) -> dict[str, Any]:
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            return dict(conn.execute(text(
                "SELECT error_count, last_failure_at, counted_at FROM health WHERE key = 'a'"
            )).mappings().one())
    finally:
        engine.dispose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock, executor_id="w1") as ledger:
        yield ledger


def _outage(led: Ledger, clock: ManualClock) -> tuple[Lease, str]:
    """A stream begins at T0; 503s at T0+1..3 cool ``a`` (counted at T0+3); a probe begins at
    T0+4; the stream's 503 at T0+5 restarts the window. Returns the probe, in flight."""
    slow = health_lease(led, "slow")
    stream = begin_on_a(led, slow)
    for n in range(3):
        clock.advance(1)
        lease = health_lease(led, f"burst{n}")
        led.settle_attempt(lease, begin_on_a(led, lease), outcome="failed", fact=overloaded())
    clock.advance(1)
    probe = health_lease(led, "probe")
    attempt = begin_on_a(led, probe)
    clock.advance(1)
    led.settle_attempt(slow, stream, outcome="failed", fact=overloaded())
    return probe, attempt


def _key(led: Ledger, now: float) -> KeyHealth:
    rep = Audit(led).health(now=now, latency_window_s=None)
    return next(k for k in rep.routes if k.key == "a")


def _cli(url: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["--db", url, "health", *args]) == 0
    return capsys.readouterr().out


def _cli_row(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str]:
    lines = _cli(url, capsys).splitlines()
    header = lines[1]
    line = next(x for x in lines if x.startswith("a "))
    return header.split("  "), line[header.index("COUNTED SINCE"):].strip()


def test_health_shows_since_when_a_keys_outage_is_counted_as_its_row_keeps_it(
        led: Ledger, db_url: str, clock: ManualClock,
        capsys: pytest.CaptureFixture[str]) -> None:
    probe, attempt = _outage(led, clock)
    row = _row(db_url)
    # The late failure moved the last failure, not the count's.
    assert (row["error_count"], row["counted_at"], row["last_failure_at"]) == (
        1, T0 + 3, T0 + 5)
    key = _key(led, clock.now())
    assert (key.status, key.error_count, key.counted_at, key.last_failure_at) == (
        "cooling", 1, row["counted_at"], row["last_failure_at"])

    doc = json.loads(_cli(db_url, capsys, "--json"))
    cli_key = next(k for k in doc["routes"] if k["key"] == "a")
    assert (cli_key["counted_at"], cli_key["last_failure_at"]) == (T0 + 3, T0 + 5)
    headers, shown = _cli_row(db_url, capsys)
    # Added after the existing columns, which keep their names and places.
    assert [h.strip() for h in headers if h.strip()] == [
        "KEY", "KIND", "PROVIDER", "STATUS", "COOLDOWN", "DISABLED", "ERRORS", "RECENT",
        "LAST FAILURE", "LAST PROBE", "COUNTED SINCE"]
    assert shown.endswith(f"({iso(T0 + 3)})")

    # The probe, begun after the counting failure, fails: new evidence, counted.
    clock.advance(1)
    led.settle_attempt(probe, attempt, outcome="failed", fact=overloaded())
    row = _row(db_url)
    assert (row["error_count"], row["counted_at"]) == (2, T0 + 6)
    assert _key(led, clock.now()).counted_at == row["counted_at"]
    cli_key = next(k for k in json.loads(_cli(db_url, capsys, "--json"))["routes"]
                   if k["key"] == "a")
    assert cli_key["counted_at"] == row["counted_at"]
    assert _cli_row(db_url, capsys)[1].endswith(f"({iso(T0 + 6)})")

    # Past the cooldown (300 s from T0+6) the counters read as reset, and so does the count.
    later = T0 + 400
    assert _row(db_url)["counted_at"] == T0 + 6  # nothing written since
    gone = _key(led, later)
    assert (gone.status, gone.error_count, gone.counted_at) == ("ok", 0, None)


def test_the_dashboard_shows_since_when_a_keys_outage_is_counted(
        led: Ledger, db_url: str, clock: ManualClock) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    _outage(led, clock)
    counted = _row(db_url)["counted_at"]
    assert counted == T0 + 3
    now = clock.now()
    with TestClient(create_app(db_url, clock=ManualClock(now)),
                    base_url="http://127.0.0.1") as c:
        page = c.get("/").text
        assert c.get("/api/health").json()["routes"][0]["counted_at"] == counted
    table = page.split('id="health-table"', 1)[1].split("</table>", 1)[0]
    head = table.split("</thead>", 1)[0]
    assert head.endswith("<th>last probe</th><th>counted since</th></tr>")
    row = next(r for r in table.split("<tr>") if r.startswith('<td class="id">a</td>'))
    last = row.split("<td")[-1].removesuffix("</tbody>")
    assert last == (f' class="nowrap"><span title="{iso(counted)}">{relative(counted, now)}'
                    "</span></td></tr>")
