"""``run show``, its JSON and the dashboard's run page show a Run's family and what is left.

A parent lists its Children with what each carved, charged, holds and gave back; a Child names
its parent; "left" is what the Run may still use: its budget less what it used, holds, carved
for its Children and gave back to its parent (before, the page said ``held 0 of 1.00`` with
0.80 carved).
"""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import RunStatus
from ledger.domain.values import Budget
from ledger.ops.audit import Audit
from tests.storage.helpers import grant, routes

from .test_cli import ok

NOW = 1_800_000_000.0


def _family(url: str) -> None:
    """Parent ``P`` (1.00, 20 calls, 6 retries) with two Children of 0.40: ``K1`` ended after
    one call of 0.05 (the rest given back), ``K2`` still running with one call held."""
    with Ledger.open(url, clock=ManualClock(NOW)) as led:
        led.admit_run("P", plan=routes(), grant=grant(),
                      budget=Budget(max_calls=20, max_retries=6, max_cost=Decimal("1.00")))
        pl = led.acquire_lease("P")
        for cid in ("K1", "K2"):
            led.admit_run(cid, plan=routes(), grant=grant(), parent=pl,
                          budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("0.40")))
        k1 = led.acquire_lease("K1")
        a = led.begin_attempt(k1, route="a", envelope_hash="sha256:e", reserve="0.10")
        led.settle_attempt(k1, a.attempt_id, outcome="succeeded", cost="0.05")
        led.finish_run(k1, RunStatus.SUCCEEDED)
        led.release_lease(k1)
        k2 = led.acquire_lease("K2")
        led.begin_attempt(k2, route="a", envelope_hash="sha256:e", reserve="0.10")


def test_run_show_names_the_family_and_what_is_left(db_url: str) -> None:
    _family(db_url)
    out = ok("--db", db_url, "run", "show", "P")
    # Carved: K1's 0.05 spent and K2's whole 0.40; left 1.00 - 0.45.
    assert ("cost     1.000000: charged 0.000000, held 0.000000, carved 0.450000 for children; "
            "left 0.550000") in out
    assert "calls    20: used 0, carved 5 for children; left 15" in out
    assert "retries  6: used 0, carved 2 for children; left 4" in out
    k1 = next(line for line in out.splitlines() if line.startswith("K1 "))
    assert k1.split() == ["K1", "succeeded", "0.050000", "0.000000", "0.400000", "0.350000",
                          "1/4", "(back", "3)", "0/2", "(back", "2)"]
    assert next(line for line in out.splitlines() if line.startswith("K2 ")).split()[:6] == [
        "K2", "running", "0.000000", "0.100000", "0.400000", "0.000000"]
    child = ok("--db", db_url, "run", "show", "K1")
    assert "child of P" in child.splitlines()[0]
    assert ("cost     0.400000: charged 0.050000, held 0.000000, gave back 0.350000 to its "
            "parent; left 0.000000") in child
    doc = json.loads(ok("--db", db_url, "run", "show", "P", "--json"))
    run = doc["run"]
    assert (run["carved"], run["carved_calls"], run["cost_left"], run["calls_left"],
            run["max_calls"], run["max_retries"]) == ("0.45", 5, "0.55", 15, 20, 6)
    assert [(c["run_id"], c["returned"], c["returned_calls"]) for c in doc["children"]] == [
        ("K1", "0.35", 3), ("K2", "0", 0)]
    with Ledger.open(db_url) as led:
        tl = Audit(led).timeline("K1")
        assert tl.run.parent_run_id == "P" and tl.children == []
        assert (tl.run.returned, tl.run.cost_left) == (Decimal("0.35"), Decimal(0))


def test_the_run_page_shows_the_family_and_what_is_left(db_url: str) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    _family(db_url)
    with TestClient(create_app(db_url, clock=ManualClock(NOW)),
                    base_url="http://127.0.0.1") as client:
        page = client.get("/runs/P").text
        child = client.get("/runs/K1").text
        api = client.get("/api/runs/P").json()
    assert 'id="budget-table"' in page and 'id="children-table"' in page
    assert "<b>0.550000</b>" in page and "<b>15</b>" in page  # left: cost, calls
    assert 'href="/runs/K1"' in page and 'href="/runs/K2"' in page
    assert 'child of <a href="/runs/P">P</a>' in child
    assert "<b>0.000000</b>" in child  # nothing left: the rest went back
    assert api["run"]["cost_left"] == "0.55" and len(api["children"]) == 2
