"""The dashboard: JSON, HTML and Prometheus metrics over the seeded ledger, through a read-only
PostgreSQL role, and the real pages in headless chromium (health, per-route charts, costs, the
runs list at 1,400 px, a stopped run's reasons; screenshots kept as artifacts)."""

from __future__ import annotations

import contextlib
import html
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.errors import InvalidArgument, StorageError

from .seed import T0, seed

starlette = pytest.importorskip("starlette", reason="the dashboard extra is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the dashboard extra is not installed")

from starlette.testclient import TestClient  # noqa: E402

from ledger.dashboard.app import create_app  # noqa: E402

NOW = T0 + 600
REQUIRE = os.environ.get("LEDGER_REQUIRE_POSTGRES") == "1"


def _client(url: str, **kw: Any) -> TestClient:
    return TestClient(create_app(url, clock=ManualClock(NOW), **kw), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A ledger written by the demo (real stop events); returns (url, the stopped run's id)."""
    import io

    from ledger.tools.demo import run_demo

    url = str(tmp_path_factory.mktemp("demo") / "ledger.db")
    ids = run_demo(url, io.StringIO())
    return url, ids[-1]


def test_pages_and_json_endpoints(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        page = c.get("/")
        assert page.status_code == 200
        assert "default-src 'none'" in page.headers["content-security-policy"]
        body = page.text
        assert 'id="health-table"' in body and 'id="groups-table"' in body
        assert '<svg id="activity-chart"' in body and "<script" not in body
        assert 'href="/runs/r6"' in body  # recent failovers link to their timelines
        assert "http://" not in body.replace('xmlns="http://www.w3.org/2000/svg"', "")
        run = c.get("/runs/r1")
        assert run.status_code == 200 and 'id="timeline-table"' in run.text
        assert 'id="served-route">B<' in run.text
        assert c.get("/runs?id=r3").status_code == 200
        assert c.get("/runs/nope").status_code == 404
        assert c.get("/api/runs/r1").json()["served_route"] == "B"
        # The runs command's window (--since/--until), as epoch seconds; unbounded unless given.
        every = c.get("/api/runs").json()["items"]
        assert every and c.get("/api/runs", params={"until": T0 - 1}).json()["items"] == []
        assert len(c.get("/api/runs", params={"since": T0 - 1}).json()["items"]) == len(every)
        assert c.get("/api/runs", params={"since": "abc"}).status_code == 400
        fo = c.get("/api/failovers", params={"since": T0 - 1}).json()
        assert [f["run_id"] for f in fo["items"]] == ["r6", "r1"]
        groups = {g["group"]: g for g in c.get("/api/health").json()["groups"]}
        assert groups["g3"]["mode"] == "unavailable"
        costs = c.get("/api/costs", params={"since": T0 - 1, "by": "tenant"}).json()
        assert [t["key"] for t in costs["items"]] == [None, "t1", "t2"]
        act = c.get("/api/activity", params={"since": T0, "until": NOW, "buckets": 6}).json()
        assert [b["attempts"] for b in act] == [2, 1, 2, 1, 1, 1]
        assert c.get("/api/costs", params={"by": "color"}).status_code == 400
        assert c.post("/api/health").status_code == 405  # nothing can be changed
        assert c.post("/metrics").status_code == 405


def test_index_shows_charts_costs_and_what_cools_now(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        body = c.get("/", params={"hours": 1}).text
    assert "<script" not in body
    # At a glance: g3 is held by the operator until T0 + 10000.
    glance = body.split('id="glance"', 1)[1].split("</section>", 1)[0]
    assert '<span class="unavailable">unavailable</span> group <b>g3</b>' in glance
    assert ('waiting floor in 3 h <span class="muted">(2023-11-15T01:00:00Z)</span> (operator)'
            in glance)
    # Per-route success rate and latency over time, one row of charts per route.
    routes = body.split('id="routes-table"', 1)[1].split("</table>", 1)[0]
    assert [r.split("</td>", 1)[0] for r in routes.split('<td class="id">')[1:]] == [
        "A", "B", "C"]
    assert routes.count('<svg id="success-') == 3 and routes.count('<svg id="latency-') == 3
    # Costs by tenant and by route over the window, and by day.
    tenants = body.split('id="costs-tenant-table"', 1)[1].split("</table>", 1)[0]
    assert "<td>(none)</td>" in tenants and "<td>t1</td>" in tenants
    assert '<svg id="cost-days-chart"' in body
    assert 'href="/metrics"' in body


def test_the_index_reads_health_aside_answers_the_same_and_leaves_no_thread(
        seeded_url: str) -> None:
    """The index reads health on the app's own two threads while the request reads the rest:
    its page is the same whether requests come one at a time or at once, a failure of the
    read surfaces as the page's error, and closing the app stops those threads."""
    def aside() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("ledger-dashboard")]

    with _client(seeded_url) as c:
        one = c.get("/", params={"hours": 1, "refresh": 0}).text
        pages: list[str] = []
        readers = [threading.Thread(target=lambda: pages.append(
            c.get("/", params={"hours": 1, "refresh": 0}).text)) for _ in range(4)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert pages == [one] * 4
        assert 0 < len(aside()) <= 2
        # Over a year: refused as the page's own parameter, before health is asked.
        bad = c.get("/", params={"hours": 9000, "refresh": 0})
        assert bad.status_code == 400 and "hours must be" in bad.text
    assert aside() == []


def test_glitches_of_issue_27_are_gone(seeded_url: str) -> None:
    from ledger.domain.timefmt import iso

    with _client(seeded_url) as c:
        body = c.get("/", params={"hours": 1}).text
    # "Routes over time" runs to the window's end (now), not to its last bucket's start.
    window = body.split('id="routes-window">', 1)[1].split("</span>", 1)[0]
    assert f"{iso(NOW - 3600)}" in window and f"to {iso(NOW)}," in window
    assert iso(NOW - 3600 / 24) not in window  # the last bucket's start
    # Failovers and money each in a tile of its own, with its unit.
    glance = body.split('id="glance"', 1)[1].split("</section>", 1)[0]
    assert 'runs failed over, last 1 h<b><span id="glance-failovers">2</span> <small>runs' in (
        glance)
    assert '<span id="glance-charged">0.010000</span> <small>currency units</small>' in glance
    assert "&middot;" not in glance.split('id="glance-list"', 1)[0]
    # The cost axis reads as money, never in exponent notation.
    assert 'id="cost-axis-top">0.01<' in body


def test_cost_axis_never_reads_in_exponent_notation() -> None:
    from decimal import Decimal

    from ledger.dashboard.charts import axis_number, cost_days_svg
    from ledger.ops.audit import DayCost

    day = T0 - T0 % 86400
    svg = cost_days_svg([DayCost(day=day, tenant="t1", attempts=1, cost=Decimal("0.00004"))],
                        [day])
    assert 'id="cost-axis-top">0.00005<' in svg and "e-0" not in svg
    assert [axis_number(v) for v in (5e-05, 20.0, 1.5, 1e6)] == ["0.00005", "20", "1.5",
                                                                 "1000000"]


def test_latency_page_and_json_filter_by_route_group_category_tenant_outcome(
        seeded_url: str) -> None:
    with _client(seeded_url) as c:
        index = c.get("/", params={"hours": 1}).text
        page = c.get("/latency", params={"hours": 1}).text
        b_only = c.get("/latency", params={"hours": 1, "route": "B"}).text
        answers = c.get("/api/latency", params={"since": T0, "state": "succeeded",
                                                "tenant": "t1"}).json()
        failures = c.get("/api/latency", params={"since": T0, "category": "rate_limit"}).json()
        bad = c.get("/api/latency", params={"category": "slow"})
    # The index: p50 / p95 / p99 per route and group, and of each route's answers.
    latency = index.split('id="latency"', 1)[1].split("</section>", 1)[0]
    assert 'id="latency-routes-table"' in latency and 'id="latency-groups-table"' in latency
    assert '<td class="num"><span title="3 attempts">1.000 / 1.900 / 1.980</span>' in latency
    routes = index.split('id="routes-table"', 1)[1].split("</table>", 1)[0]
    assert "latency p50 / p95 / p99" in index and '<span title="2 attempts">' in routes  # B
    # The page: a form of filters, then the tables.
    assert 'id="latency-filters"' in page and 'name="category"' in page
    assert 'name="tenant"' in page and '<select name="state">' in page
    rows = b_only.split('id="latency-routes-table"', 1)[1].split("</table>", 1)[0]
    assert rows.count("<tr>") == 2 and '<td class="id">B</td>' in rows  # head + B
    assert "route B" in b_only
    assert [(r["key"], r["latency"]["count"]) for r in answers["routes"]] == [("A", 1), ("B", 1)]
    assert answers["state"] == "succeeded" and answers["tenant"] == "t1"
    assert [r["key"] for r in failures["routes"]] == ["A"]
    assert bad.status_code == 400 and "category" in bad.json()["error"]


def test_a_number_that_is_not_finite_is_a_bad_request_not_a_server_error(
        seeded_url: str) -> None:
    with _client(seeded_url) as c:
        for path, name in (("/", "hours"), ("/", "refresh"), ("/api/activity", "buckets"),
                           ("/api/runs", "limit"), ("/api/costs/days", "days")):
            for value in ("inf", "-inf", "1e400", "nan", "ten"):
                r = c.get(path, params={name: value})
                assert r.status_code == 400, (path, name, value, r.status_code)
                assert name in r.text


def test_a_cursor_past_what_the_backend_binds_is_a_bad_request_naming_cursor(
        seeded_url: str) -> None:
    with _client(seeded_url) as c:
        for path, cursor in (("/api/costs", "o:99999999999999999999"),
                             ("/api/budgets", "o:99999999999999999999"),
                             ("/api/actions", "1700000000.0|99999999999999999999"),
                             ("/api/runs", "nan|r1"), ("/runs", "nan|r1")):
            r = c.get(path, params={"cursor": cursor})
            assert r.status_code == 400, (path, r.status_code)
            assert "malformed cursor" in r.text
            if path.startswith("/api/"):
                assert r.json()["field"] == "cursor"


def test_pages_refresh_themselves_as_configured(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        assert '<meta http-equiv="refresh" content="30">' in c.get("/").text
        assert '<meta http-equiv="refresh" content="5">' in c.get("/runs/r1?refresh=5").text
        off = c.get("/", params={"refresh": 0}).text
        assert "http-equiv" not in off and "auto-refresh off" in off
        assert c.get("/", params={"refresh": -1}).status_code == 400
    with _client(seeded_url, refresh_s=0) as c:
        assert "http-equiv" not in c.get("/").text
    with pytest.raises(InvalidArgument):
        create_app(seeded_url, refresh_s=-5)


def test_route_series_and_costs_by_day(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        series = c.get("/api/routes", params={"since": T0, "until": NOW,
                                              "buckets": 6}).json()
        days = c.get("/api/costs/days").json()
    assert [s["route"] for s in series] == ["A", "B", "C"]  # busiest first, then by name
    rate = {s["route"]: [p["success_rate"] for p in s["points"]] for s in series}
    latency = {s["route"]: [p["latency_s"] for p in s["points"]] for s in series}
    # r1: A fails, B serves (2 s); r2: A serves (2 s); r3: B fails then serves (1 s);
    # r4: C unknown; r5: A still dispatching (not sent: no rate); r6: C serves (1 s).
    assert rate["A"] == [0.0, 1.0, None, None, None, None]
    assert rate["B"] == [1.0, None, 0.5, None, None, None]
    assert rate["C"] == [None, None, None, 0.0, None, 1.0]
    assert latency["A"] == [None, 2.0, None, None, None, None]
    assert latency["B"][0] == 2.0 and latency["B"][2] == 1.0 and latency["C"][5] == 1.0
    # Charged (posted debits) and held (r5 dispatching, r4 unknown), as the runs count them.
    assert [(d["tenant"], d["attempts"], d["cost"], d["held"]) for d in days] == [
        (None, 2, "0.004", "0.03"), ("t1", 3, "0.003", "0"), ("t2", 3, "0.003", "0.02")]
    assert {d["day"] for d in days} == {T0 - T0 % 86400}


def _families(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    # Every sample line belongs to a family with HELP and TYPE (the strict parser's view).
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or line.split("{")[0].split(" ")[0] in {
            s.name for f in families.values() for s in f.samples}, line
    return families


def _by(family: Any, suffix: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[k] for k in labels): s.value for s in family.samples
            if s.name.endswith(suffix)}


def test_metrics_endpoint_is_prometheus_text(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        res = c.get("/metrics")
        health = c.get("/api/health").json()
    assert res.status_code == 200
    assert res.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = _families(res.text)
    assert families["ledger_attempts"].type == "counter"
    route_outcome = ("ledger_route", "ledger_outcome")
    # Settled for good only: r5 still dispatching and r4 unknown are gauges until they settle
    # (a counter of them would go down then: tests/audit/test_metrics_monotonic.py).
    assert _by(families["ledger_attempts"], "_total", *route_outcome) == {
        ("A", "failed"): 1, ("A", "succeeded"): 1, ("B", "failed"): 1,
        ("B", "succeeded"): 2, ("C", "succeeded"): 1}
    assert families["ledger_attempts_in_flight"].type == "gauge"
    assert _by(families["ledger_attempts_in_flight"], "flight", "ledger_route") == {
        ("A",): 1, ("B",): 0, ("C",): 0}
    assert _by(families["ledger_attempts_unknown"], "unknown", "ledger_route") == {
        ("A",): 0, ("B",): 0, ("C",): 1}
    assert [s.labels for s in families["ledger_failovers"].samples
            if s.name.endswith("_total")] == [{"ledger_route_from": "A", "ledger_route_to": "B",
                                               "ledger_failure_category": "rate_limit"}]
    cooling = _by(families["ledger_cooldowns_active"], "active", "ledger_kind")
    keys = health["routes"] + health["profiles"]
    assert cooling == {
        ("route",): sum(k["status"] != "ok" for k in health["routes"] if k["kind"] == "route"),
        ("provider",): sum(k["status"] != "ok" for k in health["routes"]
                           if k["kind"] == "provider"),
        ("profile",): sum(k["status"] != "ok" for k in health["profiles"]),
        ("group",): sum(g["mode"] != "open" for g in health["groups"])}
    assert cooling[("group",)] == 1 and keys  # g3, held by the operator
    posted = _by(families["ledger_budget_posted"], "_total", "ledger_tenant")
    assert posted == {("",): 0.004, ("t1",): 0.003, ("t2",): 0.003}
    held = _by(families["ledger_budget_held"], "held", "ledger_tenant")
    assert held == {("",): 0.03, ("t1",): 0.0, ("t2",): 0.02}  # r5 dispatching, r4 unknown


def test_metrics_have_latency_histograms_and_token_and_cost_counters(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        families = _families(c.get("/metrics").text)
    route_outcome = ("ledger_route", "ledger_outcome")
    duration = families["ledger_attempt_duration_seconds"]
    assert duration.type == "histogram"
    # Begin to settle by the ledger's clock (the seed's times), of the attempts settled for
    # good: r5 still dispatching has none, r4 unknown has one once it is resolved.
    assert _by(duration, "_count", *route_outcome) == {
        ("A", "failed"): 1, ("A", "succeeded"): 1, ("B", "failed"): 1, ("B", "succeeded"): 2,
        ("C", "succeeded"): 1}
    assert _by(duration, "_sum", *route_outcome)[("B", "succeeded")] == 3.0
    buckets = {s.labels["le"]: s.value for s in duration.samples if s.name.endswith("_bucket")
               and s.labels["ledger_route"] == "B" and s.labels["ledger_outcome"] == "succeeded"}
    assert (buckets["0.64"], buckets["1.28"], buckets["2.56"], buckets["+Inf"]) == (0, 1, 2, 2)
    # The GenAI conventions' time to first chunk: the streamed answers only (r1 and r3 on B).
    ttft = families["gen_ai_client_operation_time_to_first_chunk_seconds"]
    assert _by(ttft, "_count", *route_outcome) == {("B", "succeeded"): 2}
    assert _by(ttft, "_sum", *route_outcome) == {("B", "succeeded"): 2.0}
    ttfb = families["ledger_attempt_time_to_first_byte_seconds"]
    assert _by(ttfb, "_sum", *route_outcome) == {("A", "succeeded"): 1.0,
                                                 ("B", "succeeded"): 0.75}
    tokens = _by(families["ledger_tokens"], "_total", "ledger_route", "gen_ai_token_type")
    assert {k: v for k, v in tokens.items() if k[0] == "B"} == {
        ("B", "input"): 120, ("B", "output"): 60, ("B", "cache_read"): 40,
        ("B", "reasoning"): 10}
    assert tokens[("A", "input")] == 10 and tokens[("C", "output")] == 20
    # Charged per route: the same figures as `costs` (posted debits).
    assert _by(families["ledger_cost"], "_total", "ledger_route") == {
        ("A",): 0.001, ("B",): 0.005, ("C",): 0.004}
    assert families["ledger_capacity_wait_duration_seconds"].samples == []  # no queue waits


def test_every_limited_capacity_group_has_a_waiting_series_from_its_configuration_on(
        db_url: str) -> None:
    # Nobody has ever queued here: a limited group's queue is empty, and its gauge reads 0 so
    # an alert on it sees 0, not no data; an unlimited group has no queue and no series.
    led = Ledger.open(db_url, clock=ManualClock(NOW))
    try:
        led.configure_group("limited", max_in_flight=2)
        led.configure_group("unlimited", max_in_flight=None)
    finally:
        led.close()
    with _client(db_url) as c:
        families = _families(c.get("/metrics").text)
    waiting = families["ledger_capacity_waiting"]
    assert waiting.type == "gauge"
    assert _by(waiting, "waiting", "ledger_capacity_group") == {("limited",): 0}
    assert families["ledger_capacity_wait_duration_seconds"].samples == []  # never queued


def test_metrics_speak_openmetrics_when_asked(seeded_url: str) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with _client(seeded_url) as c:
        res = c.get("/metrics", headers={"Accept": "application/openmetrics-text; "
                                                   "version=1.0.0"})
    assert res.status_code == 200
    assert res.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert res.text.endswith("# EOF\n")
    families = {f.name: f for f in text_string_to_metric_families(res.text)}
    assert families["ledger_attempt_duration_seconds"].unit == "seconds"
    assert families["ledger_attempts"].type == "counter"


def test_run_page_says_why_the_run_stopped(demo_url: tuple[str, str]) -> None:
    url, stopped = demo_url
    with _client(url) as c:
        page = c.get(f"/runs/{stopped}").text
        doc = c.get(f"/api/runs/{stopped}").json()
    stops = page.split('id="stops"', 1)[1].split("</section>", 1)[0]
    assert '<b class="stop-reason">no_candidate</b>' in stops
    assert "<b>official-deepseek</b>: skipped (disclosure)" in stops
    assert "add model_derived to Grant.recipients" in stops  # the fix, where there is one
    assert "<b>go-glm</b>: skipped (same_group_unavailable)" in stops
    assert ("<b>go-deepseek</b>: failed: go/deepseek-v4: rate_limit (HTTP 429, code "
            "rate_limit_exceeded): Rate limit reached for requests per min." in stops)
    assert doc["stops"][0]["reason"] == "no_candidate"


def test_never_shows_secrets(seeded_url: str) -> None:
    # Profiles appear by id only; the ledger stores no secret, and the page has no place for one.
    with _client(seeded_url) as c:
        text = c.get("/runs/r1").text + c.get("/").text
    assert "pa1" in text
    for word in ("api_key", "secret", "Authorization", "Bearer"):
        assert word not in text


@pytest.mark.postgres
def test_works_with_a_read_only_role(pg_server: Any, pg_url: str) -> None:
    seed(pg_url)
    db = pg_url.rsplit("/", 1)[1]
    pg_server.psql("DO $$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname='auditor') "
                   "THEN CREATE ROLE auditor LOGIN; END IF; END$$")
    pg_server.psql("GRANT USAGE ON SCHEMA public TO auditor; "
                   "GRANT SELECT ON ALL TABLES IN SCHEMA public TO auditor", db)
    ro_url = pg_url.replace("postgres@", "auditor@", 1)
    with _client(ro_url) as c:
        assert c.get("/").status_code == 200
        assert c.get("/runs/r1").status_code == 200
        assert c.get("/api/health").json()["groups"]
    # The role really is read-only: a write through the ledger API is refused by the server.
    led = Ledger.open(ro_url, clock=ManualClock(NOW), migrate_schema=False)
    try:
        with pytest.raises(StorageError, match="permission denied"):
            led.configure_group("g9", max_in_flight=1)
    finally:
        led.close()


# -- a real browser --------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture
def served(seeded_url: str) -> Iterator[str]:
    """The dashboard on a free loopback port in a thread; yields its base URL."""
    with _serving(seeded_url, ManualClock(NOW)) as base:
        yield base


@contextlib.contextmanager
def _serving(url: str, clock: ManualClock | None) -> Iterator[str]:
    from ledger.testing.pgserver import free_port

    port = free_port()
    config = uvicorn.Config(create_app(url, clock=clock), host="127.0.0.1",
                            port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    ready = threading.Event()
    # Poll for readiness (the server binds asynchronously); bounded, no fixed sleep.
    for _ in range(500):
        if not thread.is_alive():
            break
        try:
            with urllib.request.urlopen(base + "/api/health", timeout=2) as r:
                if r.status == 200:
                    ready.set()
                    break
        except OSError:
            ready.wait(0.02)
    assert ready.is_set(), "dashboard did not start"
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _browse(chromium: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Chromium's answer for ``args``. A DOM dump that comes back empty with success is asked
    again (twice at most): with the machine's cores busy, headless Chromium has exited 0
    having printed nothing, and no page of the dashboard is empty, so an empty dump is never
    the answer under test."""
    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="ledger-chromium-") as profile:
            res = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", *args],
                capture_output=True, text=True, timeout=90)
        if "--dump-dom" not in args or res.returncode != 0 or res.stdout.strip():
            return res
    return res


@pytest.mark.browser
def test_dashboard_in_headless_chromium(served: str, seeded_url: str) -> None:
    chromium = _chromium()
    if chromium is None:
        msg = "chromium is not installed (apt-get install chromium); browser test cannot run"
        if REQUIRE:
            pytest.fail(msg + " and LEDGER_REQUIRE_POSTGRES=1")
        pytest.skip(msg)
    dom = _browse(chromium, "--dump-dom", served + "/")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'id="health-table"' in html and 'id="groups-table"' in html
    health_rows = html.split('id="health-table"', 1)[1].split("</table>", 1)[0]
    for key in ("A", "B", "C"):
        assert f'<td class="id">{key}</td>' in health_rows
    assert '<span class="unavailable">unavailable</span>' in html  # g3's operator hold
    assert '<svg id="activity-chart"' in html

    dom = _browse(chromium, "--dump-dom", served + "/runs/r1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    timeline = dom.stdout.split('id="timeline-table"', 1)[1].split("</table>", 1)[0]
    rows = timeline.split("<tr>")[2:]
    assert len(rows) == 2
    assert '<td class="id">A</td>' in rows[0] and "rate_limit" in rows[0]
    assert "primary" in rows[0]
    assert '<td class="id">B</td>' in rows[1] and "next_candidate" in rows[1]
    assert "C (cooling)" in rows[1]
    # Each attempt's latency, first byte / first token, tokens with their cached and reasoning
    # parts (r1's answer on B).
    assert "1.000 s" in rows[0] and "2.000 s" in rows[1]
    assert "0.500 s / 1.500 s" in rows[1] and "100 / 50" in rows[1]
    assert "40 cached, 10 reasoning" in rows[1]
    index = _browse(chromium, "--dump-dom", served + "/").stdout
    assert '<svg id="success-0"' in index
    assert 'id="latency-routes-table"' in index and 'id="glance-failovers">2<' in index
    dom = _browse(chromium, "--dump-dom", served + "/latency?hours=1&state=succeeded")
    assert dom.returncode == 0, dom.stderr[-2000:]
    table = dom.stdout.split('id="latency-routes-table"', 1)[1].split("</table>", 1)[0]
    assert [r.split("</td>", 1)[0] for r in table.split('<td class="id">')[1:]] == [
        "B", "A", "C"]

    artifacts = Path(os.environ.get("LEDGER_ARTIFACTS", "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    backend = "postgres" if seeded_url.startswith("postgresql") else "sqlite"
    # 1,400 px: the width the recent-runs table must read well at (the screenshots are kept).
    for name, path, height in ((f"dashboard-{backend}.png", "/", 4200),
                               (f"dashboard-run-{backend}.png", "/runs/r1", 900),
                               (f"dashboard-runs-{backend}.png", "/runs", 900),
                               (f"dashboard-latency-{backend}.png", "/latency?hours=1", 900)):
        shot = artifacts.resolve() / name
        shot.unlink(missing_ok=True)
        res = _browse(chromium, f"--screenshot={shot}", f"--window-size=1400,{height}",
                      served + path)
        assert res.returncode == 0, res.stderr[-2000:]
        assert shot.exists() and shot.stat().st_size > 10_000


@pytest.mark.browser
def test_stopped_run_in_headless_chromium(demo_url: tuple[str, str]) -> None:
    chromium = _chromium()
    if chromium is None:
        if REQUIRE:
            pytest.fail("chromium is not installed and LEDGER_REQUIRE_POSTGRES=1")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    url, stopped = demo_url
    with _serving(url, None) as base:
        dom = _browse(chromium, "--dump-dom", f"{base}/runs/{stopped}")
        assert dom.returncode == 0, dom.stderr[-2000:]
        stops = dom.stdout.split('id="stops"', 1)[1].split("</section>", 1)[0]
        assert "no_candidate" in stops and "disclosure" in stops
        artifacts = Path(os.environ.get("LEDGER_ARTIFACTS", "test-artifacts")).resolve()
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / "dashboard-run-stopped.png"
        shot.unlink(missing_ok=True)
        res = _browse(chromium, f"--screenshot={shot}", "--window-size=1400,900",
                      f"{base}/runs/{stopped}")
        assert res.returncode == 0 and shot.stat().st_size > 10_000


@pytest.mark.parametrize("now", [NOW, 1_700_000_000.0, 1_699_999_200.0])
def test_a_chart_of_whole_days_is_cut_on_the_hour_or_the_day_so_the_rollups_count_it(
        now: float) -> None:
    from ledger.dashboard.charts import chart_window

    for hours in range(24, 24 * 80):
        since, until, n = chart_window(now, hours)
        width = (until - since) / n
        if hours <= 7 * 24:  # a week at most: buckets of whole hours
            assert since % 3600 == 0 and width % 3600 == 0 and 24 <= n <= 48, hours
            assert until - 3600 <= now < until  # ends with the hour now is in
            assert hours * 3600 <= until - since < hours * 3600 + width  # less a bucket more
            continue
        # Longer: whole UTC days (each a folded day's, or 24 rolled hours), up to 48 buckets.
        assert since % 86400 == 0 and width % 86400 == 0 and 8 <= n <= 48, hours
        assert until - 86400 <= now < until  # ends with the day now is in
        assert since <= now - hours * 3600 < since + width  # the span, less a bucket more
    # A shorter or fractional span keeps exactly its window, in 48 slices.
    for hours in (1, 0.5, 23, 24.5):
        assert chart_window(now, hours) == (now - hours * 3600, now, 48)


def test_the_days_chart_says_its_hours_and_the_tiles_count_the_pages_window(
        seeded_url: str) -> None:
    from ledger.dashboard.charts import chart_window
    from ledger.domain.timefmt import iso

    with _client(seeded_url) as c:
        day = c.get("/", params={"hours": 24}).text
        hour = c.get("/", params={"hours": 1}).text
        month = c.get("/", params={"hours": 30 * 24}).text
    since, _until, n = chart_window(NOW, 30 * 24)
    window = month.split('id="activity-window">', 1)[1].split("</span>", 1)[0]
    assert f"({iso(since)} to {iso(NOW)}, {n} buckets of 1 day, UTC; 8 attempts" in window
    since = chart_window(NOW, 24)[0]
    window = day.split('id="activity-window">', 1)[1].split("</span>", 1)[0]
    assert f"({iso(since)} to {iso(NOW)}, 24 buckets of 60 min, UTC; 8 attempts" in window
    window = hour.split('id="activity-window">', 1)[1].split("</span>", 1)[0]
    assert f"({iso(NOW - 3600)} to {iso(NOW)}, 48 buckets of 1.25 min, UTC; 8 attempts" in window
    for page in (day, hour):
        glance = page.split('id="glance"', 1)[1].split("</section>", 1)[0]
        assert "h<b>8</b>" in glance


def test_only_the_pages_rolling_window_is_called_last_n_hours_the_charts_say_their_whole_hours(
        seeded_url: str) -> None:
    """The tiles and cost tables count [now - N h, now); the charts whole hours (or days)
    from the first one's start: each heading says which, so the page never shows two
    different "last 24 h"."""
    from datetime import UTC, datetime

    from ledger.dashboard.charts import chart_window

    def headings(page: str) -> list[str]:
        return [page.split('id="activity-heading">', 1)[1].split(" <span", 1)[0],
                page.split('id="routes-over-time"><h2>', 1)[1].split(" <span", 1)[0]]

    with _client(seeded_url) as c:
        day = c.get("/", params={"hours": 24}).text
        hour = c.get("/", params={"hours": 1}).text
        month = c.get("/", params={"hours": 30 * 24}).text
    start = datetime.fromtimestamp(chart_window(NOW, 24)[0], UTC)
    assert headings(day) == [
        f"{what} by hour, from {start:%Y-%m-%d %H:%M} UTC to now (whole hours)"
        for what in ("Attempts and failures", "Routes over time")]
    glance = day.split('id="glance"', 1)[1].split("</section>", 1)[0]
    assert "attempts, last 24 h<b>" in glance and "Cost by tenant, last 24 h" in day
    start = datetime.fromtimestamp(chart_window(NOW, 30 * 24)[0], UTC)
    assert headings(month)[0] == (f"Attempts and failures by day, from {start:%Y-%m-%d} UTC "
                                  "to now (whole days)")
    # An hour is charted over exactly the page's window: the same words for the same span.
    assert headings(hour) == ["Attempts and failures, last 1 h", "Routes over time, last 1 h"]


@pytest.mark.parametrize("hours", ["100000", "1e308", "8784.5", "0", "-3"])
def test_a_bad_window_is_refused_naming_hours_and_its_range_as_the_route_speaks(
        seeded_url: str, hours: str) -> None:
    """A window too long was refused as a parameter the request never sent
    (latency_window_s, since = -inf); a page answered in JSON."""
    with _client(seeded_url) as c:
        for path, extra in (("/", {}), ("/latency", {}), ("/replay", {"policy": "goclaw"})):
            res = c.get(path, params={"hours": hours, **extra})
            assert res.status_code == 400, path
            assert res.headers["content-type"].startswith("text/html"), path
            assert "hours must be more than 0 and at most 8784 (366 days)" in res.text, path
            assert "latency_window_s" not in res.text and "since" not in res.text, path
        for path, extra in (("/api/latency", {}), ("/api/replay", {"policy": "goclaw"})):
            res = c.get(path, params={"hours": hours, **extra})
            assert res.status_code == 400 and res.json()["field"] == "hours", path
            assert "at most 8784 (366 days)" in res.json()["error"], path
        # The message is escaped into the page, never markup.
        res = c.get("/latency", params={"hours": "1", "state": "<b>x</b>"})
        assert res.status_code == 400 and "&lt;b&gt;x&lt;/b&gt;" in res.text
        assert "<b>x</b>" not in res.text


@pytest.mark.parametrize(("path", "name", "value"), [
    ("/", "days", "2.5"), ("/", "days", "0"), ("/", "days", "367"), ("/", "refresh", "1e18"),
    ("/", "refresh", "86401"), ("/", "refresh", "-1"), ("/", "refresh", "2.5"),
    ("/runs", "refresh", "99999999999999999999"), ("/replay", "refresh", "1.5"),
    ("/budgets", "days", "7.9"), ("/api/runs", "limit", "2.5"), ("/api/costs", "limit", "1e2"),
    ("/api/costs/days", "days", "1.5"), ("/api/activity", "buckets", "4.5"),
    ("/api/routes", "routes", "2.5"), ("/api/failovers", "limit", "0x10")])
def test_a_count_that_is_not_a_whole_number_in_range_is_refused_naming_it_not_truncated(
        seeded_url: str, path: str, name: str, value: str) -> None:
    """?days=2.5 was read as 2 and ?refresh=1e18 served a page that never reloads."""
    with _client(seeded_url) as c:
        res = c.get(path, params={name: value})
        assert res.status_code == 400, (path, name, value, res.status_code)
        if path.startswith("/api/"):
            assert res.json()["field"] == name
        assert f"query parameter {name} must be a whole number" in res.text


def test_api_budgets_refuses_a_label_without_by_label_as_the_command_does(
        seeded_url: str) -> None:
    """?label=team without by=label was ignored: the answer was by tenant, silently."""
    with _client(seeded_url) as c:
        for query in ({"label": "team"}, {"by": "tenant", "label": "team"}):
            res = c.get("/api/budgets", params={**query, "since": str(T0 - 1)})
            assert res.status_code == 400 and res.json()["field"] == "label", res.text
            assert "add by=label" in res.json()["error"]
        ok = c.get("/api/budgets", params={"by": "label", "label": "team", "since": str(T0 - 1)})
        assert ok.status_code == 200, ok.text


def test_budgets_page_refuses_a_label_without_by_label_as_the_api_does(
        seeded_url: str) -> None:
    """/budgets?by=tenant&label=team answered by tenant, the label ignored, where
    /api/budgets refuses it; and the page's own form sent the label with by=tenant."""
    with _client(seeded_url) as c:
        for query in ({"label": "team"}, {"by": "tenant", "label": "team"},
                      {"by": "tenant", "label": ""}):
            page = c.get("/budgets", params=query)
            api = c.get("/api/budgets", params={**query, "since": str(T0 - 1)})
            assert page.status_code == api.status_code == 400, (page.text, api.text)
            assert api.json()["field"] == "label"
            assert api.json()["error"] in html.unescape(page.text)
        for query in ({}, {"by": "tenant"}, {"by": "label", "label": "team"}):
            assert c.get("/budgets", params=query).status_code == 200
            assert c.get("/api/budgets", params=query).status_code == 200
        page = c.get("/budgets").text
        by_tenant = page.split('<form id="budgets-form"', 1)[1].split("</form>", 1)[0]
        by_label = page.split('<form id="budgets-label-form"', 1)[1].split("</form>", 1)[0]
        assert 'name="label"' not in by_tenant and 'name="by" value="tenant"' in by_tenant
        assert 'name="label"' in by_label and 'name="by" value="label"' in by_label


def test_api_replay_reads_at_most_the_window_hours_may_ask_for(seeded_url: str) -> None:
    """?since=0 replayed the whole history in one unpaged read; ?hours= stops at 366 days."""
    with _client(seeded_url) as c:
        for path in ("/api/replay", "/replay"):
            res = c.get(path, params={"policy": "goclaw", "since": "0"})
            assert res.status_code == 400, path
            assert "at most 366 days" in res.text, path
        assert c.get("/api/replay", params={"policy": "goclaw", "since": "0"}).json()["field"] \
            == "since"
        # Within the bound, and one run whenever it was admitted, are answered.
        assert c.get("/api/replay", params={"policy": "goclaw", "since": str(T0 - 1)}
                     ).status_code == 200
        assert c.get("/api/replay", params={"policy": "goclaw", "since": "0", "run": "r1"}
                     ).status_code == 200
