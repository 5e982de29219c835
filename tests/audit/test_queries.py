"""Audit queries against the seeded ledger (tests/audit/seed.py), on SQLite and PostgreSQL,
with exact expected answers."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import RunStatus
from ledger.errors import InvalidArgument, NotFound
from ledger.ops.audit import AsyncAudit, Audit, Skipped, Totals, to_jsonable

from .seed import T0


def _d(s: str) -> Decimal:
    return Decimal(s)


def test_timeline_tells_which_route_served_and_why(audit: Audit) -> None:
    tl = audit.timeline("r1")
    assert tl.run.run_id == "r1" and tl.run.tenant == "t1"
    assert tl.run.labels == {"team": "search"}
    assert tl.run.selected_route == "A" and tl.run.status == "succeeded"
    assert tl.served_route == "B" and tl.failed_over is True
    assert (tl.total_cost, tl.held) == (_d("0.002"), _d("0"))
    assert (tl.total_cost, tl.held) == (tl.run.posted, tl.run.reserved)
    first, second = tl.attempts
    assert (first.seq, first.kind, first.route_id, first.profile_id, first.state) == (
        1, "first", "A", "pa1", "failed")
    assert (first.category, first.http_status) == ("rate_limit", 429)
    assert first.fact is not None and first.fact.category.value == "rate_limit"
    assert (first.debit_state, first.posted, first.reserved, first.cost) == (
        "posted", _d("0"), _d("0.01"), None)
    assert first.selection is not None and first.selection.reason == "primary"
    assert [e.kind for e in first.events] == ["move"]
    assert first.events[0].data == {"from_route": "A", "to_route": "B",
                                    "cause": {"category": "rate_limit", "status": 429,
                                              "scope": "group"}}
    assert (second.seq, second.kind, second.route_id, second.state) == (
        2, "failover", "B", "succeeded")
    assert (second.debit_state, second.posted, second.cost) == ("posted", _d("0.002"),
                                                                 _d("0.002"))
    assert (second.prompt_tokens, second.completion_tokens) == (100, 50)
    sel = second.selection
    assert sel is not None
    assert (sel.decision, sel.from_route, sel.route, sel.profile, sel.reason) == (
        "failover", "A", "B", "pb1", "next_candidate")
    assert sel.skipped == [Skipped("C", "cooling", "cooldown for 30s")]
    assert sel.cause == {"category": "rate_limit", "status": 429, "scope": "group"}
    assert [e.kind for e in tl.run_events] == ["admit", "lease", "finish"]
    assert first.created_at == T0 + 1 and first.settled_at == T0 + 2


def test_the_timeline_and_the_failover_page_agree_on_a_run_served_elsewhere_once(
        db_url: str) -> None:
    # Its first turn served by another route than the selected one (as when the selected one
    # is cooling: a skip, no move), its last by the selected one: a failover, on every view.
    from tests.storage.helpers import budget, grant, routes

    with Ledger.open(db_url) as led:
        led.admit_run("once", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("once")
        for route in ("b", "a"):
            att = led.begin_attempt(lease, route=route, envelope_hash="sha256:e",
                                    reserve="0.01")
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
        au = Audit(led)
        tl = au.timeline("once")
        assert tl.served_route == "a" and tl.failed_over is True
        assert [f.run_id for f in au.failovers().items] == ["once"]
        assert au.count_failovers() == 1


def test_timeline_retry_unknown_and_dispatching(audit: Audit) -> None:
    r3 = audit.timeline("r3")
    assert [(a.route_id, a.kind, a.state) for a in r3.attempts] == [
        ("B", "first", "failed"), ("B", "retry", "succeeded")]
    assert [e.kind for e in r3.attempts[0].events] == ["retry"]
    assert r3.failed_over is False and r3.served_route == "B"
    assert [e.kind for e in r3.run_events] == ["admit", "lease", "retry_permission", "finish"]
    r4 = audit.timeline("r4")
    assert [(a.state, a.debit_state, a.reserved) for a in r4.attempts] == [
        ("unknown", "reserved", _d("0.02"))]
    assert r4.served_route is None and r4.failed_over is False
    r5 = audit.timeline("r5")
    assert [(a.state, a.debit_state, a.settled_at) for a in r5.attempts] == [
        ("dispatching", "reserved", None)]
    with pytest.raises(NotFound, match="unknown run id 'nope'"):
        audit.timeline("nope")


def test_failover_history_with_causes_and_pages(audit: Audit) -> None:
    page = audit.failovers()
    assert [f.run_id for f in page.items] == ["r6", "r1"] and page.next_cursor is None
    r6, r1 = page.items
    assert (r1.selected_route, r1.served_route, r1.routes, r1.status) == (
        "A", "B", ["A", "B"], "succeeded")
    assert [(c.attempt_id, c.route, c.state, c.category, c.http_status) for c in r1.causes] == [
        ("r1-a1", "A", "failed", "rate_limit", 429)]
    assert [(m.from_route, m.to_route, m.category, m.status, m.at) for m in r1.moves] == [
        ("A", "B", "rate_limit", 429, T0 + 2)]
    assert (r6.selected_route, r6.served_route, r6.causes, r6.moves) == ("A", "C", [], [])
    first = audit.failovers(limit=1)
    assert [f.run_id for f in first.items] == ["r6"] and first.next_cursor
    second = audit.failovers(limit=1, cursor=first.next_cursor)
    assert [f.run_id for f in second.items] == ["r1"] and second.next_cursor is None
    assert [f.run_id for f in audit.failovers(since=T0 + 1).items] == ["r6"]
    assert [f.run_id for f in audit.failovers(until=T0 + 500).items] == ["r1"]


def test_failovers_are_counted_as_they_are_listed(audit: Audit) -> None:
    # The dashboard's tile counts them all; a page holds at most its limit.
    assert audit.count_failovers() == len(audit.failovers().items) == 2
    assert audit.count_failovers(since=T0 + 1) == 1  # r6 only
    assert audit.count_failovers(until=T0) == 0


def test_run_status_is_a_run_status_wherever_the_audit_lists_it(audit: Audit) -> None:
    # audit.runs() said "succeeded" as a str where get_run() says RunStatus.SUCCEEDED (issue 27).
    for r in audit.runs().items:
        assert type(r.status) is RunStatus and r.status == audit.ledger.get_run(r.run_id).status
    for f in audit.failovers().items:
        assert type(f.status) is RunStatus
    assert type(audit.timeline("r1").run.status) is RunStatus
    assert to_jsonable(audit.runs(limit=1))["items"][0]["status"] == "succeeded"


def test_latency_percentiles_of_the_seed(audit: Audit) -> None:
    rep = audit.latency()
    routes = {s.key: s for s in rep.routes}
    # B: r3's 500 (1 s), r3's retry (1 s), r1's answer (2 s): ranks 0..2, p95 at rank 1.9.
    b = routes["B"].latency
    assert b is not None and b.count == 3
    assert (b.p50, b.p95, b.p99) == (1.0, pytest.approx(1.9), pytest.approx(1.98))
    ttft = routes["B"].first_token  # r1's 1.5 s and r3's 0.5 s, streamed
    assert ttft is not None and ttft.count == 2
    assert (ttft.p50, ttft.p95, ttft.p99) == (1.0, pytest.approx(1.45), pytest.approx(1.49))
    first_byte = routes["A"].first_byte  # r2's 1 s (its 429 reported none)
    assert first_byte is not None and (first_byte.count, first_byte.p99) == (1, 1.0)
    assert routes["A"].first_token is None
    # r5's attempt is still dispatching: no latency, so A counts r1's 429 and r2's answer.
    assert routes["A"].latency is not None and routes["A"].latency.count == 2
    assert [s.key for s in rep.routes] == ["B", "A", "C"]  # busiest first
    groups = {s.key: s.latency for s in rep.groups}
    assert groups["g2"] == b  # B is g2's only route
    answers = audit.latency(state="succeeded", tenant="t1")
    assert [(s.key, s.latency.count if s.latency else 0) for s in answers.routes] == [
        ("A", 1), ("B", 1)]
    assert audit.latency(category="rate_limit").routes == audit.latency(
        route="A", state="failed").routes  # r1's 429, A's only failure
    assert audit.latency(since=T0 + 550).routes == []


def test_attempts_by_route_group_outcome_category_time(audit: Audit) -> None:
    def ids(**kw: object) -> list[str]:
        return [a.attempt_id for a in audit.attempts(**kw).items]  # type: ignore[arg-type]

    assert ids(route="B") == ["r3-a2", "r3-a1", "r1-a2"]
    assert ids(group="g3") == ["r6-a1", "r4-a1"]
    assert ids(state="failed") == ["r3-a1", "r1-a1"]
    assert ids(category="rate_limit") == ["r1-a1"]
    assert ids(since=T0 + 200, until=T0 + 400) == ["r4-a1", "r3-a2", "r3-a1"]
    p1 = audit.attempts(limit=4)
    p2 = audit.attempts(limit=4, cursor=p1.next_cursor)
    assert [a.attempt_id for a in p1.items + p2.items] == [
        "r6-a1", "r5-a1", "r4-a1", "r3-a2", "r3-a1", "r2-a1", "r1-a2", "r1-a1"]
    assert p2.next_cursor is None


def _t(key: str | None, n: int, ok: int, failed: int, unknown: int, pt: int, ct: int,
       cost: str, held: str = "0") -> Totals:
    return Totals(key, n, ok, failed, unknown, pt, ct, Decimal(cost), Decimal(held))


def test_cost_and_token_totals(audit: Audit) -> None:
    assert audit.costs(by="route").items == [
        _t("B", 3, 2, 1, 0, 120, 60, "0.005"),
        _t("C", 2, 1, 0, 1, 30, 20, "0.004", "0.02"),  # r4's unknown attempt keeps its hold
        _t("A", 3, 1, 1, 0, 10, 5, "0.001", "0.03"),  # r5's is still dispatching
    ]
    assert audit.costs(by="group").items[0] == _t("g2", 3, 2, 1, 0, 120, 60, "0.005")
    assert audit.costs(by="provider").items[-1] == _t("p1", 3, 1, 1, 0, 10, 5, "0.001", "0.03")
    assert [(t.key, t.cost) for t in audit.costs(by="run").items] == [
        ("r6", _d("0.004")), ("r3", _d("0.003")), ("r1", _d("0.002")), ("r2", _d("0.001")),
        ("r4", _d("0")), ("r5", _d("0"))]
    assert audit.costs(by="tenant").items == [
        _t(None, 2, 1, 0, 0, 30, 20, "0.004", "0.03"),
        _t("t1", 3, 2, 1, 0, 110, 55, "0.003"),
        _t("t2", 3, 1, 1, 1, 20, 10, "0.003", "0.02"),
    ]
    assert audit.costs(by="label", label="team").items == [
        _t("search", 4, 2, 2, 0, 120, 60, "0.005"),
        _t(None, 3, 1, 0, 1, 30, 20, "0.004", "0.05"),
        _t("eval", 1, 1, 0, 0, 10, 5, "0.001"),
    ]
    # A time range: only r1..r3's attempts.
    assert audit.costs(by="route", since=T0, until=T0 + 300).items == [
        _t("B", 3, 2, 1, 0, 120, 60, "0.005"),
        _t("A", 2, 1, 1, 0, 10, 5, "0.001"),
    ]
    page = audit.costs(by="run", limit=4)
    rest = audit.costs(by="run", limit=4, cursor=page.next_cursor)
    assert [t.key for t in rest.items] == ["r4", "r5"] and rest.next_cursor is None
    with pytest.raises(InvalidArgument, match="label key"):
        audit.costs(by="label", label='te"am')
    with pytest.raises(InvalidArgument, match="cannot total by"):
        audit.costs(by="color")


def test_every_label_key_a_run_may_carry_can_be_totalled(db_url: str) -> None:
    # Admission and the audit hold label keys to one rule: spaces, quotes of one kind, other
    # scripts and long keys are fine; a double quote or a backslash is refused at admission.
    from tests.storage.helpers import budget, grant, routes

    keys = ["cost center", "team's", "équipe", "k" * 200]
    with Ledger.open(db_url) as led:
        led.admit_run("lab", plan=routes(), budget=budget(), grant=grant(),
                      labels={k: f"v{i}" for i, k in enumerate(keys)})
        lease = led.acquire_lease("lab")
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.002")
        au = Audit(led)
        for i, key in enumerate(keys):
            assert [(t.key, t.cost) for t in au.costs(by="label", label=key).items] == [
                (f"v{i}", _d("0.002"))]
            assert [s.key for s in au.spend(by="label", label=key).items] == [f"v{i}"]
        for bad in ('te"am', "a\\b"):
            with pytest.raises(InvalidArgument) as e:
                led.admit_run("bad", plan=routes(), budget=budget(), grant=grant(),
                              labels={bad: "v"})
            assert e.value.field == f"labels[{bad!r}]"


def test_unknown_and_unsettled_attempts(audit: Audit) -> None:
    page = audit.open_attempts()
    assert [(o.attempt.attempt_id, o.attempt.state.value, o.lease_live, o.lease_holder)
            for o in page.items] == [("r5-a1", "dispatching", True, "exec-1"),
                                     ("r4-a1", "unknown", False, None)]
    # Both still hold their budget: the debit is reserved (never reported as null).
    assert [o.attempt.debit_state.value for o in page.items if o.attempt.debit_state] == [
        "reserved", "reserved"]
    assert [o.attempt.attempt_id for o in audit.open_attempts(states=["unknown"]).items] == [
        "r4-a1"]
    with pytest.raises(InvalidArgument):
        audit.open_attempts(states=["failed"])


# Cursors no listing hands out: offsets and event ids past a 64-bit integer (which SQLite
# and PostgreSQL failed to bind, each its own way), and times that are no row's time.
BAD_OFFSETS = ["o:99999999999999999999", "o:9223372036854775808", "o:+5", "o:1_0", "o: 5"]
BAD_KEYSETS = ["nan|r1", "inf|r1", "-inf|r1", "1e400|r1",
               # A time without its id: listed an empty page as if past every row.
               "1|", "1700000000.0|"]


def test_a_cursor_no_page_handed_out_is_refused_naming_cursor_on_either_backend(
        audit: Audit) -> None:
    window = {"since": T0 - 1, "until": T0 + 600}
    listings: list[tuple[Any, list[str]]] = [
        (lambda c: audit.costs(by="route", cursor=c, **window), BAD_OFFSETS),
        (lambda c: audit.spend(by="tenant", cursor=c, **window), BAD_OFFSETS),
        (lambda c: audit.runs(cursor=c), BAD_KEYSETS),
        (lambda c: audit.failovers(cursor=c, **window), BAD_KEYSETS),
        (lambda c: audit.open_attempts(cursor=c), BAD_KEYSETS),
        (lambda c: audit.attempts(cursor=c), BAD_KEYSETS),
        (lambda c: audit.actions(cursor=c), [*BAD_KEYSETS, "1700000000.0|99999999999999999999",
                                             "1700000000.0|-1", "1700000000.0|1e3"]),
    ]
    for listing, cursors in listings:
        for cursor in cursors:
            with pytest.raises(InvalidArgument, match="pass back next_cursor") as e:
                listing(cursor)
            assert e.value.field == "cursor", cursor
    # The largest offset a cursor holds is a page past the end, not an error.
    assert audit.costs(by="route", cursor="o:" + "9" * 18, **window).items == []


def test_health_of_routes_profiles_and_groups(audit: Audit) -> None:
    led = audit.ledger
    rep = audit.health()
    assert rep.now == T0 + 600
    stored = led.health()
    assert {k.key for k in rep.routes + rep.profiles} == set(stored)
    for k in rep.routes + rep.profiles:
        h = stored[k.key]
        assert (k.cooldown_until, k.disabled_until, k.error_count, k.last_probe_at) == (
            h.cooldown_until, h.disabled_until, h.error_count, h.last_probe_at)
    groups = {g.group: g for g in rep.groups}
    assert sorted(groups) == ["g1", "g2", "g3"]
    g3 = groups["g3"]
    assert (g3.mode, g3.stored_mode, g3.until, g3.reason, g3.in_flight) == (
        "unavailable", "unavailable", T0 + 10_000, "operator", 0)
    assert groups["g1"].in_flight == 1  # r5's dispatching attempt, under a live lease
    proj = led.group_projections()
    assert {g: groups[g].mode for g in groups} == {g: p.mode.value for g, p in proj.items()}
    # Later, g3's waiting floor has passed: it projects open again.
    later = audit.health(now=T0 + 20_000)
    assert {g.group: g.mode for g in later.groups}["g3"] == "open"


def test_runs_listing_and_activity(audit: Audit) -> None:
    p1 = audit.runs(limit=4)
    assert [r.run_id for r in p1.items] == ["r6", "r5", "r4", "r3"]
    p2 = audit.runs(limit=4, cursor=p1.next_cursor)
    assert [r.run_id for r in p2.items] == ["r2", "r1"] and p2.next_cursor is None
    assert [r.run_id for r in audit.runs(status="succeeded").items] == ["r6", "r3", "r2", "r1"]
    assert [r.run_id for r in audit.runs(tenant="t2").items] == ["r4", "r3"]
    r1 = audit.runs(since=T0, until=T0 + 1).items[0]
    assert (r1.posted, r1.reserved, r1.calls_used, r1.tokens_used, r1.current_route) == (
        _d("0.002"), _d("0"), 2, 150, "B")
    buckets = audit.activity(since=T0, until=T0 + 600, buckets=6)
    assert [(b.start, b.attempts, b.failed, b.unknown) for b in buckets] == [
        (T0, 2, 1, 0), (T0 + 100, 1, 0, 0), (T0 + 200, 2, 1, 0), (T0 + 300, 1, 0, 1),
        (T0 + 400, 1, 0, 0), (T0 + 500, 1, 0, 0)]


def test_async_twin_gives_the_same_answers(audit: Audit) -> None:
    aa = AsyncAudit(audit)

    async def go() -> None:
        assert await aa.timeline("r1") == audit.timeline("r1")
        assert (await aa.failovers()).items == audit.failovers().items
        assert (await aa.costs(by="tenant")).items == audit.costs(by="tenant").items
        assert (await aa.open_attempts()).items == audit.open_attempts().items
        assert await aa.health() == audit.health()
        assert (await aa.runs(limit=2)).items == audit.runs(limit=2).items
        assert (await aa.attempts(route="A")).items == audit.attempts(route="A").items
        assert await aa.activity(since=T0, until=T0 + 600, buckets=3) == audit.activity(
            since=T0, until=T0 + 600, buckets=3)
        assert await aa.latency(route="B") == audit.latency(route="B")
        assert await aa.count_failovers() == audit.count_failovers()

    asyncio.run(go())


def test_results_are_json_ready(audit: Audit) -> None:
    doc = to_jsonable(audit.timeline("r1"))
    assert doc["attempts"][1]["cost"] == "0.002"
    assert doc["attempts"][0]["fact"]["category"] == "rate_limit"
    assert to_jsonable(audit.costs(by="route"))["items"][0]["key"] == "B"


def test_reader_never_migrates(tmp_path: object) -> None:
    # An audit opened without migration on an empty database finds no tables instead of
    # creating them (the read-only contract of the CLI and dashboard).
    from ledger.api.face import storage_of
    from ledger.storage.audit import AuditQueries

    led = Ledger.open(f"{tmp_path}/empty.db", clock=ManualClock(T0), migrate_schema=False)
    try:
        assert AuditQueries(storage_of(led).context).schema_present() is False
    finally:
        led.close()
