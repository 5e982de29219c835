"""Spend against budgets (issue 27, item 5): ``Audit.spend``, ``failover-ledger costs --by tenant
/ --by label`` and ``/api/budgets``, on SQLite and PostgreSQL.

A history written through the real write API over three UTC days: Runs of two tenants and none,
with a ``team`` label or without, a parent that carves a Child (of its tenant, under a ``team``
of its own), charges whose sum is exact only in decimal (0.1 + 0.2), an unknown Attempt that
keeps its hold. Every figure
is checked against the Runs' own records (``Ledger.get_run``), summed here in Python: the sum of
the budgets admitted (less what a parent carved, which its Child counts), what was posted and
what is held, per key and per admission day.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from decimal import Decimal
from typing import Any

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.values import Budget
from ledger.errors import InvalidArgument
from ledger.ops.audit import AsyncAudit, Audit, Spend
from tests.storage.helpers import grant, routes

from .test_cli import cli

DAY = 86400.0
T0 = 1_700_006_400.0  # 2023-11-15T00:00:00Z, a UTC midnight
ENV = "sha256:" + "e" * 64
IDS = [f"run-{i}" for i in range(8)]


def _budget(cost: str) -> Budget:
    return Budget(max_calls=5, max_retries=2, max_cost=Decimal(cost))


def _history(led: Ledger, clock: ManualClock) -> None:
    """Eight Runs over three days (see the module docstring)."""
    plan = routes()
    spec: list[tuple[float, str | None, dict[str, str], str, list[tuple[str, str | None]]]] = [
        # (admitted at, tenant, labels, budget, [(outcome, cost)])
        (T0 + 3600, "acme", {"team": "search"}, "1.00", [("succeeded", "0.1")]),
        (T0 + 7200, "acme", {"team": "search"}, "0.50", [("succeeded", "0.2")]),
        (T0 + DAY + 60, "acme", {"team": "eval"}, "2.00", [("succeeded", "0.000001"),
                                                          ("succeeded", "0.3")]),
        (T0 + DAY + 120, "beta", {}, "0.25", [("unknown", None)]),
        (T0 + DAY + 180, None, {"team": "eval"}, "0.75", [("succeeded", "0.05")]),
        (T0 + 2 * DAY + 10, "beta", {"team": "search"}, "3.00", []),  # nothing spent yet
    ]
    for i, (at, tenant, labels, cost, attempts) in enumerate(spec):
        clock.set(at)
        led.admit_run(IDS[i], plan=plan, budget=_budget(cost), grant=grant(), tenant=tenant,
                      labels=labels)
        lease = led.acquire_lease(IDS[i], ttl_s=60)
        for n, (outcome, charged) in enumerate(attempts):
            clock.advance(1)
            att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.02"
                                    if charged is None else Decimal(charged) * 2,
                                    turn_id=f"t{n}")
            clock.advance(1)
            if outcome == "unknown":
                led.settle_attempt(lease, att.attempt_id, outcome="unknown")
            else:
                led.settle_attempt(lease, att.attempt_id, outcome=outcome, cost=charged)
        led.release_lease(lease)
    # A parent of tenant acme carves a Child, acme's too (it spends acme's money), whose own
    # team label wins over the parent's: each counts its own share.
    clock.set(T0 + 2 * DAY + 300)
    led.admit_run(IDS[6], plan=plan, budget=_budget("1.00"), grant=grant(), tenant="acme",
                  labels={"team": "search"})
    parent = led.acquire_lease(IDS[6], ttl_s=60)
    clock.advance(5)
    led.admit_run(IDS[7], plan=plan, grant=grant(), labels={"team": "eval"}, parent=parent,
                  budget=Budget(max_calls=2, max_retries=1, max_cost=Decimal("0.40")))
    child = led.acquire_lease(IDS[7], ttl_s=60)
    att = led.begin_attempt(child, route="a", envelope_hash=ENV, reserve="0.10")
    led.settle_attempt(child, att.attempt_id, outcome="succeeded", cost="0.07")
    att = led.begin_attempt(parent, route="a", envelope_hash=ENV, reserve="0.10")
    led.settle_attempt(parent, att.attempt_id, outcome="succeeded", cost="0.01")
    clock.set(T0 + 3 * DAY - 1)


@pytest.fixture
def ledger(db_url: str) -> Any:
    clock = ManualClock(T0)
    led = Ledger.open(db_url, clock=clock)
    _history(led, clock)
    try:
        yield led
    finally:
        led.close()


def _expected(led: Ledger, key: Any, *, since: float, until: float,
              every: float | None = None) -> dict[Any, dict[str, Any]]:
    """Spend recomputed from each Run's own record: key -> totals (and buckets)."""
    out: dict[Any, dict[str, Any]] = defaultdict(lambda: {
        "runs": 0, "budget": Decimal(0), "posted": Decimal(0), "held": Decimal(0),
        "buckets": defaultdict(lambda: [0, Decimal(0), Decimal(0), Decimal(0)])})
    for rid in IDS:
        r = led.get_run(rid)
        if not since <= r.created_at < until:
            continue
        k = key(r)
        own = r.budget.max_cost - r.carved
        t = out[k]
        t["runs"] += 1
        t["budget"] += own
        t["posted"] += r.posted
        t["held"] += r.reserved
        if every is not None:
            b = t["buckets"][r.created_at - r.created_at % every]
            b[0] += 1
            b[1] += own
            b[2] += r.posted
            b[3] += r.reserved
    return out


def _as_dict(items: list[Spend]) -> dict[Any, tuple[int, Decimal, Decimal, Decimal, Decimal]]:
    return {s.key: (s.runs, s.budget, s.posted, s.held, s.left) for s in items}


def test_spend_per_tenant_equals_the_runs_own_records_exactly(ledger: Ledger) -> None:
    audit = Audit(ledger)
    page = audit.spend(by="tenant", since=T0, until=T0 + 3 * DAY)
    want = _expected(ledger, lambda r: r.tenant, since=T0, until=T0 + 3 * DAY)
    assert _as_dict(page.items) == {
        k: (v["runs"], v["budget"], v["posted"], v["held"],
            v["budget"] - v["posted"] - v["held"]) for k, v in want.items()}
    got = {s.key: s for s in page.items}
    # Exact decimal money: 0.1 + 0.2 (+ the parent's 0.01 and its Child's 0.07) is 0.38 to the
    # last digit, and the 0.000001 charge is kept.
    assert got["acme"].posted == Decimal("0.680001")
    # The parent counts its budget less the Child's carve; the Child, its tenant's, the carve.
    assert got["acme"].budget == Decimal("1.00") + Decimal("0.50") + Decimal("2.00") + Decimal(
        "0.60") + Decimal("0.40")
    assert got["acme"].runs == 5
    assert got["beta"].budget == Decimal("0.25") + Decimal("3.00")
    assert got["beta"].held == Decimal("0.02")  # the unknown attempt keeps its hold
    # Most posted first; the Runs without a tenant as None.
    assert [s.key for s in page.items] == ["acme", None, "beta"]
    # Money never exceeds what was admitted: a Run never overdraws.
    for s in page.items:
        assert s.posted + s.held <= s.budget and s.left >= 0


def test_spend_per_label_and_by_admission_day(ledger: Ledger) -> None:
    audit = Audit(ledger)
    page = audit.spend(by="label", label="team", since=T0, every=DAY)
    assert page.next_cursor is None
    want = _expected(ledger, lambda r: r.labels.get("team"), since=T0, until=T0 + 3 * DAY,
                     every=DAY)
    assert _as_dict(page.items) == {
        k: (v["runs"], v["budget"], v["posted"], v["held"],
            v["budget"] - v["posted"] - v["held"]) for k, v in want.items()}
    assert set(want) == {"search", "eval", None}  # the Child's own team wins
    for s in page.items:
        # One bucket per UTC day of the window (until defaults to now), empty ones included.
        assert [p.start for p in s.points] == [T0, T0 + DAY, T0 + 2 * DAY]
        buckets = want[s.key]["buckets"]
        for p in s.points:
            runs, budget, posted, held = buckets.get(p.start, [0, 0, 0, 0])
            assert (p.runs, p.budget, p.posted, p.held) == (runs, budget, posted, held)
            assert p.posted + p.held <= p.budget
        assert sum(p.runs for p in s.points) == s.runs
        assert sum((p.posted for p in s.points), Decimal(0)) == s.posted
    search = next(s for s in page.items if s.key == "search")
    assert [p.runs for p in search.points] == [2, 0, 2]


def test_the_window_counts_runs_by_when_they_were_admitted(ledger: Ledger) -> None:
    audit = Audit(ledger)
    day2 = audit.spend(by="tenant", since=T0 + DAY, until=T0 + 2 * DAY)
    assert _as_dict(day2.items) == {
        "acme": (1, Decimal("2.00"), Decimal("0.300001"), Decimal(0), Decimal("1.699999")),
        "beta": (1, Decimal("0.25"), Decimal(0), Decimal("0.02"), Decimal("0.23")),
        None: (1, Decimal("0.75"), Decimal("0.05"), Decimal(0), Decimal("0.70"))}
    # Six-hour buckets aligned to the epoch: the window's first bucket starts before `since`.
    six = audit.spend(by="tenant", since=T0 + DAY + 30, until=T0 + DAY + 7 * 3600,
                      every=6 * 3600)
    assert [p.start for p in six.items[0].points] == [T0 + DAY, T0 + DAY + 6 * 3600]
    assert audit.spend(by="tenant", since=T0 + 5 * DAY).items == []


def test_pages_of_keys_cover_every_key_once_in_the_same_order(ledger: Ledger) -> None:
    audit = Audit(ledger)
    whole = audit.spend(by="tenant", every=DAY, since=T0).items
    seen: list[Spend] = []
    cursor = None
    while True:
        page = audit.spend(by="tenant", every=DAY, since=T0, limit=1, cursor=cursor)
        seen += page.items
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == whole and len(seen) == 3


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"by": "route"}, "by"),
    ({"by": "label"}, "label"),
    ({"by": "label", "label": 'bad "key"'}, "label"),
    ({"since": T0 + 10, "until": T0}, "until"),
    ({"every": 86400.0}, "since"),
    ({"every": 30, "since": T0}, "every"),
    ({"every": float("nan"), "since": T0}, "every"),
    ({"every": 60, "since": T0 - 30 * DAY, "until": T0}, "every"),
    ({"limit": 0}, "limit"),
    ({"cursor": "o:-1"}, "cursor"),
], ids=["by-route", "label-missing", "label-malformed", "until-before-since",
        "every-without-since", "every-too-fine", "every-nan", "too-many-buckets", "limit",
        "cursor"])
def test_bad_arguments_are_typed_errors_naming_the_field(ledger: Ledger, kwargs: dict[str, Any],
                                                         field: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        Audit(ledger).spend(**kwargs)
    assert ei.value.field == field


def test_the_async_audit_answers_the_same(ledger: Ledger) -> None:
    audit = Audit(ledger)
    sync = audit.spend(by="label", label="team", since=T0, every=DAY)

    async def main() -> Any:
        return await AsyncAudit(audit).spend(by="label", label="team", since=T0, every=DAY)

    assert asyncio.run(main()) == sync


# -- the command line --------------------------------------------------------------------------


def test_costs_by_tenant_and_label_show_spend_against_budgets(ledger: Ledger,
                                                               db_url: str) -> None:
    window = ["--since", str(T0), "--until", str(T0 + 3 * DAY)]
    res = cli("--db", db_url, "costs", "--by", "tenant", *window)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    start = lines.index("spend against budgets: the runs admitted in the window, by tenant "
                        "(charged and held now)")
    assert lines[start + 1].split() == ["TENANT", "RUNS", "BUDGET", "CHARGED", "HELD", "LEFT",
                                        "USED"]
    assert [line.split() for line in lines[start + 3:start + 6]] == [
        ["acme", "5", "4.500000", "0.680001", "0.000000", "3.819999", "15.1%"],
        ["-", "1", "0.750000", "0.050000", "0.000000", "0.700000", "6.7%"],
        ["beta", "2", "3.250000", "0.000000", "0.020000", "3.230000", "0.6%"]]

    res = cli("--db", db_url, "costs", "--by", "label", "--label", "team", "--every", "1d",
              "--json", *window)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert "items" in doc  # the attempts' totals, as before
    budgets = {b["key"]: b for b in doc["budgets"]["items"]}
    assert Decimal(budgets["search"]["budget"]) == Decimal("5.10")  # 1 + 0.5 + 3 + (1 - 0.4)
    assert [p["runs"] for p in budgets["search"]["points"]] == [2, 0, 2]

    res = cli("--db", db_url, "costs", "--by", "tenant", "--every", "1d", *window)
    assert res.returncode == 0, res.stderr
    tail = res.stdout.split("by when the runs were admitted (every 1d; empty buckets left out)",
                            1)[1].splitlines()
    assert tail[1].split() == ["FROM", "TENANT", "RUNS", "BUDGET", "CHARGED", "HELD", "USED"]
    assert tail[3].split() == ["2023-11-15T00:00:00Z", "acme", "2", "1.500000", "0.300000",
                               "0.000000", "20.0%"]

    for bad, says in ((["--by", "route", "--every", "1d"], "--every splits the budgets"),
                      (["--by", "tenant", "--every", "soon"], "is not a span of time"),
                      (["--by", "tenant", "--every", "1s"], "too fine")):
        res = cli("--db", db_url, "costs", *bad, *window)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert says in res.stderr
