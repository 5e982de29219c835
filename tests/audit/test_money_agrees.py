"""Every report shows the money the budget counted: charged (posted debits) and held.

Runs made through sessions over loopback (a cut stream that keeps its hold, a complete answer,
a cut stream an operator then settled with evidence, an answer whose usage was out of range),
then read back through every face an operator has: the audit API, the command line (``runs``,
``run show``, ``costs``; text and JSON) and the dashboard (JSON and the run page). Each figure
equals the Run's own budget counters (``posted``, ``reserved``). Both backends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from ledger.adapters import StaticSecretProvider
from ledger.api.facade import Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.records import AttemptState
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

REPO = Path(__file__).resolve().parents[2]
SECRETS = StaticSecretProvider({"p:a": "key-a"})
HOLD = Decimal("0.02")
RUNS = ("cut", "answered", "settled", "bad-usage")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


def _route(fake: FakeProvider) -> Route:
    return Route(id="primary", provider="pa", model="m-a", group="ga", recipient="ra",
                 endpoint=fake.endpoint("openai"), profiles=[Profile(id="p:a")],
                 price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2)))


def _fill(url: str, fake: FakeProvider) -> None:
    route = _route(fake)
    env = Envelope(parts=[Part(content="Summarise the filing.")], stream=True,
                   max_output_tokens=64)
    behaviours = {"cut": Behavior(fault=Fault.STREAM_CUT), "answered": Behavior(),
                  "settled": Behavior(fault=Fault.STREAM_CUT),
                  "bad-usage": Behavior(usage=(2**63, 7))}
    with Ledger.open(url) as led:
        for run_id in RUNS:
            fake.enqueue(behaviours[run_id])
            try:
                with led.run(run_id, plan=[route], secrets=SECRETS,
                             budget=Budget(max_calls=2, max_retries=1, max_cost=Decimal("1")),
                             grant=Grant(recipients={"ra": ["user_input"]})) as run:
                    run.turn(env, on_text=lambda _t: None, reserve=HOLD)
            except FailoverExhausted:
                pass
        [cut] = led.timeline("settled")
        assert cut.state is AttemptState.UNKNOWN
        led.settle_unknown(cut.attempt_id, outcome="succeeded", prompt_tokens=3000,
                           completion_tokens=1000, note="console")


def _cli(url: str, *args: str) -> str:
    env = dict(os.environ)
    env.pop("LEDGER_URL", None)
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-m", "ledger.cli.main", "--db", url, *args],
                         capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_every_report_shows_what_the_budget_counted(db_url: str, fake: FakeProvider) -> None:
    fake.clear()
    _fill(db_url, fake)
    with Ledger.open(db_url) as led:
        counters = {r: (led.get_run(r).posted, led.get_run(r).reserved) for r in RUNS}
        books = reconcile(led)
        assert books.ok, books.violations
        audit = Audit(led)
        by_run = {t.key: (t.cost, t.held) for t in audit.costs(by="run").items}
        listed = {r.run_id: (r.posted, r.reserved) for r in audit.runs().items}
        timelines = {r: audit.timeline(r) for r in RUNS}
    # The money each ending moved (see docs/operations.md's table): the cut keeps its hold,
    # the answer and the out-of-range usage post (the whole hold when no usage is known),
    # the settled one posts the evidenced 0.005 and released the rest.
    assert counters == {"cut": (0, HOLD), "answered": (Decimal("0.000025"), 0),
                        "settled": (Decimal("0.005"), 0), "bad-usage": (HOLD, 0)}
    for r in RUNS:
        assert (timelines[r].total_cost, timelines[r].held) == counters[r]
        assert by_run[r] == counters[r] and listed[r] == counters[r]

    # The command line, JSON and text.
    runs = {x["run_id"]: (Decimal(x["posted"]), Decimal(x["reserved"]))
            for x in json.loads(_cli(db_url, "runs", "--json"))["items"]}
    costs = {x["key"]: (Decimal(x["cost"]), Decimal(x["held"]))
             for x in json.loads(_cli(db_url, "costs", "--by", "run", "--json"))["items"]}
    table = _cli(db_url, "costs", "--by", "run").splitlines()
    assert table[0].split()[-2:] == ["CHARGED", "HELD"]
    runs_table = _cli(db_url, "runs").splitlines()
    assert runs_table[0].split()[6:8] == ["CHARGED", "HELD"]
    for r in RUNS:
        charged, held = counters[r]
        assert runs[r] == counters[r] and costs[r] == counters[r]
        shown = json.loads(_cli(db_url, "run", "show", r, "--json"))
        assert (Decimal(shown["total_cost"]), Decimal(shown["held"])) == counters[r]
        text = _cli(db_url, "run", "show", r)
        assert f"cost     1.000000: charged {charged:.6f}, held {held:.6f}" in text
        row = next(line.split() for line in table[2:] if line.split()[0] == r)
        assert row[-2:] == [f"{charged:.6f}", f"{held:.6f}"]
        row = next(line.split() for line in runs_table[2:] if line.split()[0] == r)
        assert row[6:8] == [f"{charged:.6f}", f"{held:.6f}"]

    # The dashboard, JSON and the run page.
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    with TestClient(create_app(db_url), base_url="http://127.0.0.1") as client:
        api_costs = {x["key"]: (Decimal(x["cost"]), Decimal(x["held"])) for x in client.get(
            "/api/costs", params={"by": "run"}).json()["items"]}
        for r in RUNS:
            doc = client.get(f"/api/runs/{r}").json()
            assert (Decimal(doc["total_cost"]), Decimal(doc["held"])) == counters[r]
            assert api_costs[r] == counters[r]
            page = client.get(f"/runs/{r}").text
            page_charged = re.search(r'id="run-charged">([^<]*)<', page)
            page_held = re.search(r'id="run-held">([^<]*)<', page)
            assert page_charged is not None and page_held is not None
            assert (Decimal(page_charged.group(1)), Decimal(page_held.group(1))) == counters[r]
        index = client.get("/").text
        glance_charged = re.search(r'id="glance-charged">([^<]*)<', index)
        glance_held = re.search(r'id="glance-held">([^<]*)<', index)
        assert glance_charged is not None and glance_held is not None
        assert Decimal(glance_charged.group(1)) == sum(c for c, _ in counters.values())
        assert Decimal(glance_held.group(1)) == sum(h for _, h in counters.values())


def test_totals_read_off_the_attempts_equal_every_runs_counters(db_url: str) -> None:
    """The totals read each attempt's money off its own row (one index range, no join with the
    debits); over a generated history with every kind of ending (successes, answered errors
    that posted nothing, unknowns that hold, never-sent and in-flight attempts), every run's
    total equals its budget counters, which equal its debits (reconcile)."""
    from ledger.clock import ManualClock
    from ledger.tools.generate import generate

    end = 1_700_000_000.0
    with Ledger.open(db_url, clock=ManualClock(end)) as led:
        # A dense half hour of history (Runs written through the ledger), so that some are
        # still in flight at its end.
        stats = generate(led, attempts=500, days=0.025, end=end, seed=11)
        assert stats.unknown and stats.failed and stats.not_sent and stats.dispatching
        books = reconcile(led)
        assert books.ok, books.violations
        audit = Audit(led)
        counters = {r.run_id: (r.posted, r.reserved)
                    for r in audit.runs(limit=10_000).items}
        totals = {t.key: (t.cost, t.held) for t in audit.costs(by="run", limit=10_000).items}
        assert totals == counters
        days = audit.costs_by_day(days=3, now=end)
        assert sum(d.cost for d in days) == sum(p for p, _ in counters.values())
        assert sum(d.held for d in days) == sum(h for _, h in counters.values())


def test_an_unreadable_whole_answer_posts_its_hold_in_every_report(
        db_url: str, fake: FakeProvider) -> None:
    """A whole (not streamed) 200 whose body is not the protocol's: the provider ran the call
    and may bill it, so the whole hold is posted (it is not the provider's error verdict, which
    posts nothing), and the audit, replay and reconcile read the row the same way."""
    fake.clear()
    with Ledger.open(db_url) as led:
        fake.enqueue(Behavior(fault=Fault.MALFORMED_EVENT))
        with pytest.raises(FailoverExhausted), led.run(
                "unreadable", plan=[_route(fake)], secrets=SECRETS,
                budget=Budget(max_calls=1, max_retries=0, max_cost=Decimal("1")),
                grant=Grant(recipients={"ra": ["user_input"]})) as run:
            run.turn(Envelope(parts=[Part(content="Summarise the filing.")],
                              max_output_tokens=64), reserve=HOLD)
        [att] = led.timeline("unreadable")
        assert att.state is AttemptState.FAILED and att.fact is not None
        assert (att.fact.status, att.fact.transport) == (200, "malformed_event")
        r = led.get_run("unreadable")
        assert (r.posted, r.reserved) == (HOLD, 0)
        books = reconcile(led)
        assert books.ok, books.violations
        audit = Audit(led)
        [total] = audit.costs(by="run").items
        assert (total.cost, total.held) == (HOLD, 0)
        tl = audit.timeline("unreadable")
        assert (tl.total_cost, tl.held) == (HOLD, 0)
        assert audit.replay("failure-domain", run="unreadable").baseline.cost == HOLD
