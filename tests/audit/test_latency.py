"""Latency and tokens where operators look (issue 27, item 3).

Each Attempt records, by the ledger's injectable clock and in seconds from its begin, its
latency (to its settle), the response's first byte and a stream's first token, and the cached
and reasoning parts of its tokens where the provider reports them. They show in the record, the
audit timeline, ``run show`` and the dashboard's run page. p50/p95/p99 per route and per group,
filtered by route, group, category, tenant and outcome, come from the database: the same
answers on SQLite and PostgreSQL, equal to the definition (``percentile_cont``'s linear
interpolation) computed in Python over the recorded times.

Real turns over loopback HTTP (the fake provider, which moves the test's ManualClock just
before it writes the response's head and its first content event), real SQLite files and a
real PostgreSQL server; no test sleeps.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from ledger import (
    AttemptState,
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    Ledger,
    ManualClock,
    Part,
    Route,
)
from ledger.adapters import SyncAdapter, sync_sender
from ledger.decide.effects import Dispatch, SendResult
from ledger.domain.facts import Category, FailureFact, Phase, Scope
from ledger.ops.audit import Audit, LatencyReport, Percentiles
from ledger.storage.context import percentile_cont
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import PRICE

fake = fakeplan.fake
_clear = fakeplan._clear

REPO = Path(__file__).resolve().parents[2]
T = 1_800_000_000.0
BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
TICK = 1e-6  # the spacing of float times near T is 2.4e-7: a time is exact to this


PATIENCE_S = 120  # how long the fake waits for the client before the test calls it hung


def _advance(clock: ManualClock, seconds: float) -> Any:
    return lambda: clock.advance(seconds)


class _Paced:
    """The fake's pace on the ledger's clock, exact without waiting for time to pass.

    The clock moves just before the fake writes its head, so the client's first-byte mark
    (made when it has read the head) comes after it. Before its first content the fake waits
    until the client has made that mark (the send's clock is read for it), then moves the
    clock again: the first-token mark comes after.
    """

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.head_marked = threading.Event()

    def sender(self, inner: Callable[[Dispatch], SendResult]) -> Callable[[Dispatch], SendResult]:
        def send(d: Dispatch) -> SendResult:
            self.head_marked.clear()
            ledger_clock = d.progress.clock
            assert ledger_clock is not None  # the driver hands the ledger's clock over

            def marking() -> float:
                t = ledger_clock()
                self.head_marked.set()  # the first read of a send is its first-byte mark
                return t

            d.progress.clock = marking
            return inner(d)
        return send

    def content_after(self, seconds: float) -> Callable[[], None]:
        def hook() -> None:
            assert self.head_marked.wait(PATIENCE_S), "the client never read the head"
            self.clock.advance(seconds)
        return hook


# -- per attempt ----------------------------------------------------------------------------


@pytest.fixture
def turned(db_url: str, fake: FakeProvider) -> Iterator[tuple[str, Ledger]]:
    """A streamed turn: the primary answers 503 after 0.25 s; the backup's head comes after
    0.5 s and its first token 1 s later, with 100 of its 120 prompt tokens cached and 25 of
    its 40 completion tokens spent reasoning (the Responses API reports them)."""
    clock = ManualClock(T)
    paced = _Paced(clock)
    primary, backup = fakeplan.plan(fake, "openai_responses")
    fake.enqueue(Behavior(fault=Fault.UNAVAILABLE, before_head=_advance(clock, 0.25)),
                 model="primary-model")
    fake.enqueue(Behavior(usage=(120, 40), cached_tokens=100, reasoning_tokens=25,
                          before_head=_advance(clock, 0.5),
                          before_content=paced.content_after(1.0)), model="backup-model")
    with Ledger.open(db_url, clock=clock) as led, SyncAdapter() as adapter:
        with led.run("lat", plan=[primary, backup], budget=BUDGET, grant=GRANT) as run:
            send = paced.sender(sync_sender(adapter, limits=led.run_policy("lat").streaming))
            res = run.turn(Envelope(parts=[Part(content="hello")], stream=True), send=send)
        assert res.route.id == "backup"
        yield db_url, led


def test_each_attempt_records_latency_first_byte_first_token_and_token_details(
        turned: tuple[str, Ledger]) -> None:
    _url, led = turned
    failed, served = led.timeline("lat")
    # The 503: its head after 0.25 s of the ledger's time; no content, so no first token.
    assert failed.state is AttemptState.FAILED and failed.http_status == 503
    assert failed.first_byte_s == pytest.approx(0.25, abs=TICK)
    assert failed.first_token_s is None
    assert failed.latency_s == pytest.approx(0.25, abs=TICK)
    # The answer: head at 0.5 s, first token at 1.5 s, settled then (the rest took no time).
    assert served.state is AttemptState.SUCCEEDED
    assert served.first_byte_s == pytest.approx(0.5, abs=TICK)
    assert served.first_token_s == pytest.approx(1.5, abs=TICK)
    assert served.latency_s == pytest.approx(1.5, abs=TICK)
    assert served.latency_s == pytest.approx(served.settled_at - served.created_at, abs=TICK)
    assert (served.prompt_tokens, served.completion_tokens) == (120, 40)
    assert (served.cached_tokens, served.reasoning_tokens) == (100, 25)
    assert (failed.cached_tokens, failed.reasoning_tokens) == (None, None)
    # The audit timeline says the same.
    entries = Audit(led).timeline("lat").attempts
    assert [(e.latency_s, e.first_byte_s, e.first_token_s, e.cached_tokens, e.reasoning_tokens)
            for e in entries] == [
        (a.latency_s, a.first_byte_s, a.first_token_s, a.cached_tokens, a.reasoning_tokens)
        for a in (failed, served)]


def test_run_show_and_the_run_page_show_each_attempts_times_and_tokens(
        turned: tuple[str, Ledger]) -> None:
    url, _led = turned
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LEDGER_URL", None)
    show = subprocess.run([sys.executable, "-m", "ledger.cli.main", "--db", url, "run", "show",
                           "lat"], capture_output=True, text=True, env=env, timeout=120)
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#"))
    cols = lines[header].split()
    assert cols[7:12] == ["LATENCY", "TTFB", "TTFT", "TOKENS", "IN/OUT"]
    # The failure's outcome takes three words (failed overloaded 503), the answer's one.
    first, second = lines[header + 2].split(), lines[header + 3].split()
    assert first[4:7] == ["failed", "overloaded", "503"]
    assert first[9:13] == ["-", "0.250s", "0.250s", "-"]  # reported cost, latency, TTFB, TTFT
    assert first[13] == "-"  # no usage reported
    assert second[8:16] == ["1.500s", "0.500s", "1.500s", "120/40", "(100", "cached,", "25",
                            "reasoning)"]
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "ledger.cli.main", "--db", url, "run", "show", "lat", "--json"],
        capture_output=True, text=True, env=env, timeout=120).stdout)
    assert doc["attempts"][1]["cached_tokens"] == 100
    assert doc["attempts"][1]["first_token_s"] == pytest.approx(1.5, abs=TICK)

    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    with TestClient(create_app(url), base_url="http://127.0.0.1") as c:
        page = c.get("/runs/lat").text
    table = page.split('id="timeline-table"', 1)[1].split("</table>", 1)[0]
    head, rows = table.split("</thead>", 1)
    assert "latency" in head and "first byte / token" in head and "tokens in / out" in head
    served = rows.split("<tr>")[2]
    assert "1.500 s" in served and "0.500 s / 1.500 s" in served and "120 / 40" in served
    assert "100 cached, 25 reasoning" in served


def test_a_host_reports_times_and_token_details_through_settle(db_url: str) -> None:
    clock = ManualClock(T)
    route = Route(id="h", provider="p", model="m", group="gh", recipient="p", price=PRICE)
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("h1", plan=[route], budget=BUDGET)
        lease = led.acquire_lease("h1")
        att = led.begin_attempt(lease, route="h", envelope_hash="sha256:" + "a" * 64,
                                reserve="0.01")
        bad = [({"cached_tokens": 11}, "cached_tokens"),  # more than the prompt's 10
               ({"reasoning_tokens": -1}, "reasoning_tokens"),
               ({"first_byte_s": float("nan")}, "first_byte_s"),
               ({"first_byte_s": 2.0, "first_token_s": 1.0}, "first_token_s")]
        for extra, field in bad:
            with pytest.raises(InvalidArgument) as ei:
                led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                                   completion_tokens=5, **extra)
            assert ei.value.field == field
        assert led.timeline("h1")[0].state is AttemptState.DISPATCHING  # nothing written
        clock.advance(3.0)
        rec = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                                 completion_tokens=5, cached_tokens=8, reasoning_tokens=2,
                                 first_byte_s=0.5, first_token_s=9.0)
        # The latency is the ledger's (begin to this settle); a first token reported later
        # than the settle is kept within it.
        assert rec.latency_s == pytest.approx(3.0, abs=TICK)
        assert rec.first_byte_s == 0.5 and rec.first_token_s == pytest.approx(3.0, abs=TICK)
        assert (rec.cached_tokens, rec.reasoning_tokens) == (8, 2)
        # The same settle again is the same write (times are measurements, not the receipt).
        again = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                                   completion_tokens=5, cached_tokens=8, reasoning_tokens=2)
        assert again == led.timeline("h1")[0] == rec


# -- percentiles ----------------------------------------------------------------------------

ROUTES = [Route(id=f"r{i}", provider="p", model=f"m{i}", group=("g1", "g1", "g2")[i],
                recipient="p", price=PRICE) for i in range(3)]
#: r0 as a later policy places it, in another capacity group: a route's attempts then count
#: in two groups' percentiles, each by the group it was begun in.
R0_MOVED = ROUTES[0].model_copy(update={"group": "g2"})
SERVER_ERROR = FailureFact(category=Category.SERVER_ERROR, status=500,
                           phase=Phase.AFTER_HEADERS, scope=Scope.ROUTE)
TIMEOUT = FailureFact(category=Category.TIMEOUT, phase=Phase.AFTER_SEND, scope=Scope.REQUEST)


def _history(url: str) -> list[Any]:
    """90 Attempts over three routes in two groups and two tenants: successes (some streamed),
    500s and timeouts, with latencies drawn by a seeded generator (repeats included, so ranks
    tie) and a run still in flight (no latency). Returns every Attempt as recorded."""
    rng = random.Random(27)
    clock = ManualClock(T)
    with Ledger.open(url, clock=clock, executor_id="x") as led:
        for i in range(90):
            route = ROUTES[rng.choice((0, 0, 1, 2))]
            if route is ROUTES[0] and i % 4 == 3:
                route = R0_MOVED
            run = f"p{i:03d}"
            led.admit_run(run, plan=[route], budget=BUDGET, tenant=("t1", "t2")[i % 2])
            lease = led.acquire_lease(run, ttl_s=10_000)
            att = led.begin_attempt(lease, route=route.id, envelope_hash="sha256:" + "b" * 64,
                                    reserve="0.001")
            took = rng.choice((0.5, 1.0, 2.0)) if rng.random() < 0.2 else round(
                rng.uniform(0.05, 40.0), 3)
            clock.advance(took)
            draw = rng.random()
            if i == 89:
                break  # left in flight: no latency
            if draw < 0.7:
                streamed = rng.random() < 0.6
                led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                                   completion_tokens=5, first_byte_s=took / 4,
                                   first_token_s=took / 2 if streamed else None)
            elif draw < 0.85:
                led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=SERVER_ERROR,
                                   first_byte_s=took)
            else:
                led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=TIMEOUT)
            led.finish_run(lease, "succeeded" if draw < 0.7 else "failed")
            led.release_lease(lease)
            clock.advance(5.0)
        return [a for r in range(90) for a in led.timeline(f"p{r:03d}")]


def _cont(values: list[float]) -> Percentiles | None:
    """percentile_cont's definition, by the standard library (``inclusive``: the same rule)."""
    if not values:
        return None
    if len(values) == 1:
        return Percentiles(1, values[0], values[0], values[0])
    q = statistics.quantiles(values, n=100, method="inclusive")
    return Percentiles(len(values), q[49], q[94], q[98])


def _expected(records: list[Any], by: str, **filters: Any) -> dict[str, tuple[Any, Any]]:
    tenants = {f"p{i:03d}": ("t1", "t2")[i % 2] for i in range(90)}
    out: dict[str, tuple[list[float], list[float]]] = {}
    for a in records:
        if a.latency_s is None:
            continue
        row = {"route": a.route_id, "group": a.group_id, "category": a.category,
               "tenant": tenants[a.run_id], "state": a.state.value}
        if any(row[k] != v for k, v in filters.items()):
            continue
        lat, ttft = out.setdefault(row[by], ([], []))
        lat.append(a.latency_s)
        if a.first_token_s is not None:
            ttft.append(a.first_token_s)
    return {k: (_cont(lat), _cont(ttft)) for k, (lat, ttft) in out.items()}


def _close(got: Percentiles | None, want: Percentiles | None) -> bool:
    if got is None or want is None:
        return got is want
    return got.count == want.count and all(
        getattr(got, q) == pytest.approx(getattr(want, q), rel=1e-12, abs=1e-9)
        for q in ("p50", "p95", "p99"))


FILTERS: list[dict[str, str]] = [
    {}, {"state": "succeeded"}, {"category": "timeout"}, {"category": "server_error"},
    {"tenant": "t2"}, {"route": "r0"}, {"group": "g1", "state": "failed"},
]


def _check(report: LatencyReport, records: list[Any], filters: dict[str, str]) -> None:
    for by, stats in (("route", report.routes), ("group", report.groups)):
        want = _expected(records, by, **filters)
        # The answers' latency beside it: the same filters, the succeeded attempts alone.
        answered = (_expected(records, by, **{**filters, "state": "succeeded"})
                    if filters.get("state", "succeeded") == "succeeded" else {})
        assert {s.key for s in stats} == set(want), (by, filters)
        for s in stats:
            lat, ttft = want[s.key]
            assert _close(s.latency, lat), (by, s.key, filters, s.latency, lat)
            assert _close(s.first_token, ttft), (by, s.key, filters, s.first_token, ttft)
            ok = answered.get(s.key, (None, None))[0]
            assert _close(s.succeeded_latency, ok), (by, s.key, filters, s.succeeded_latency)
        assert any(s.succeeded_latency for s in stats) == bool(answered), filters
        counts = [s.latency.count for s in stats if s.latency]
        assert counts == sorted(counts, reverse=True)  # busiest first


def test_latency_percentiles_per_route_and_group_follow_percentile_cont(db_url: str) -> None:
    records = _history(db_url)
    assert sum(a.latency_s is None for a in records) == 1  # the one in flight
    assert {a.group_id for a in records if a.route_id == "r0"} == {"g1", "g2"}
    assert {a.category for a in records} >= {None, "server_error", "timeout"}
    with Ledger.open(db_url, migrate_schema=False) as led:
        audit = Audit(led)
        for filters in FILTERS:
            _check(audit.latency(**filters), records, filters)
        # A window of begin times, and filters that match nothing.
        mid = sorted(a.created_at for a in records)[45]
        _check(audit.latency(since=mid), [a for a in records if a.created_at >= mid], {})
        empty = audit.latency(route="r1", group="g2")
        assert empty.routes == [] and empty.groups == []


@pytest.mark.postgres
def test_latency_percentiles_are_the_same_on_sqlite_and_postgresql(
        tmp_path: Path, pg_url: str) -> None:
    sqlite_url = str(tmp_path / "ledger.db")
    on_sqlite, on_postgres = _history(sqlite_url), _history(pg_url)
    assert [a.latency_s for a in on_sqlite] == [a.latency_s for a in on_postgres]
    with Ledger.open(sqlite_url, migrate_schema=False) as a, \
            Ledger.open(pg_url, migrate_schema=False) as b:
        for filters in FILTERS:
            lite, pg = Audit(a).latency(**filters), Audit(b).latency(**filters)
            assert lite == pg, filters  # the very same numbers


@pytest.mark.postgres
def test_sqlite_percentiles_are_postgresqls_percentile_cont_to_the_bit(pg_url: str) -> None:
    # SQLite's percentiles are computed in Python (ledger.storage.context.percentile_cont):
    # they must be PostgreSQL's own aggregate, bit for bit, ties and one value included.
    rng = random.Random(61)
    cases = [[7.25], [1.0, 2.0], [0.5, 0.5, 0.5, 3.0]]
    cases += [sorted(round(rng.uniform(0.001, 40.0), rng.choice((1, 3, 9)))
                     for _ in range(rng.randint(2, 400))) for _ in range(40)]
    fractions = (0.0, 0.5, 0.95, 0.99, 1.0, 0.333)
    engine = sqlalchemy.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            for values in cases:
                want = conn.execute(sqlalchemy.text(
                    "SELECT " + ", ".join(
                        f"percentile_cont({f}) WITHIN GROUP (ORDER BY v)" for f in fractions)
                    + " FROM unnest(CAST(:vs AS float8[])) AS v"), {"vs": values}).one()
                got = tuple(percentile_cont(values, f) for f in fractions)
                assert got == tuple(want), values
    finally:
        engine.dispose()


def test_latency_filters_refuse_bad_input_naming_the_field(db_url: str) -> None:
    with Ledger.open(db_url) as led:
        audit = Audit(led)
        for kwargs, field in (({"category": "slow"}, "category"), ({"state": "done"}, "state"),
                              ({"route": ""}, "route"), ({"tenant": 7}, "tenant"),
                              ({"since": 10.0, "until": 5.0}, "until"),
                              ({"since": float("inf")}, "since")):
            with pytest.raises(InvalidArgument) as ei:
                audit.latency(**kwargs)
            assert ei.value.field == field
        with pytest.raises(InvalidArgument) as ei:
            audit.health(latency_window_s=0)
        assert ei.value.field == "latency_window_s"
        assert audit.health(latency_window_s=None).latency is None


def test_health_carries_the_latency_of_its_window(db_url: str) -> None:
    records = _history(db_url)
    end = max(a.created_at for a in records) + 1
    with Ledger.open(db_url, clock=ManualClock(end), migrate_schema=False) as led:
        rep = Audit(led).health(latency_window_s=end - T)
        assert rep.latency is not None and rep.latency.until == end
        _check(rep.latency, records, {})
        # The command line prints the same percentiles, and filters them.
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.pop("LEDGER_URL", None)
        out = subprocess.run(
            [sys.executable, "-m", "ledger.cli.main", "--db", db_url, "health", "--since",
             str(T), "--until", str(end), "--state", "succeeded", "--json"],
            capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)["latency"]
        assert doc["state"] == "succeeded"
        want = _expected(records, "route", state="succeeded")
        got = {r["key"]: r["latency"] for r in doc["routes"]}
        assert set(got) == set(want)
        for key, (lat, _ttft) in want.items():
            assert lat is not None and got[key]["count"] == lat.count
            assert got[key]["p95"] == pytest.approx(lat.p95, rel=1e-12)
        text = subprocess.run(
            [sys.executable, "-m", "ledger.cli.main", "--db", db_url, "health", "--since",
             str(T), "--until", str(end), "--category", "timeout"],
            capture_output=True, text=True, env=env, timeout=120).stdout
        assert "category timeout" in text
        route_rows = text.split("ROUTE", 1)[1].split("GROUP", 1)[0].splitlines()[2:]
        timeouts = _expected(records, "route", category="timeout")
        assert sorted(r.split()[0] for r in route_rows if r.strip()) == sorted(timeouts)
        # The table shows the succeeded attempts' latency beside every outcome's, as the JSON.
        both = subprocess.run(
            [sys.executable, "-m", "ledger.cli.main", "--db", db_url, "health", "--since",
             str(T), "--until", str(end)], capture_output=True, text=True, env=env,
            timeout=120).stdout
        head, _, rest = both.split("ROUTE", 1)[1].partition("\n")
        cols = ["ROUTE", *head.replace("OK ", "OK_").replace("TTFT ", "TTFT_")
                .replace("TTFB ", "TTFB_").split()]
        rows = {r.split()[0]: dict(zip(cols, r.split(), strict=True))
                for r in rest.split("GROUP", 1)[0].splitlines()[1:] if r.strip()}
        succeeded = _expected(records, "route", state="succeeded")
        assert set(rows) == set(_expected(records, "route")) and set(succeeded) <= set(rows)
        assert any(row["OK_N"] != "0" for row in rows.values())
        for key, row in rows.items():
            lat = succeeded.get(key, (None, None))[0]
            assert row["OK_N"] == str(lat.count if lat else 0)
            assert row["OK_P50"] == ("-" if lat is None else f"{lat.p50:.3f}")
            assert row["OK_P95"] == ("-" if lat is None else f"{lat.p95:.3f}")
        # And the time to first byte's three percentiles, as the API reports them.
        by_route = {x.key: x.first_byte for x in Audit(led).latency(since=T, until=end).routes}
        assert set(by_route) == set(rows)
        for key, row in rows.items():
            fb = by_route[key]
            for q in ("p50", "p95", "p99"):
                assert row[f"TTFB_{q.upper()}"] == ("-" if fb is None else f"{getattr(fb, q):.3f}")


# -- the same figures in /metrics -------------------------------------------------------------


def test_metrics_count_real_turns_times_tokens_failovers_and_queue_waits(
        turned: tuple[str, Ledger], fake: FakeProvider) -> None:
    url, led = turned
    # A full group: another Run holds group gq's only slot; a turn waits for it 30 s of the
    # ledger's time (the policy's bound), then gives up.
    route = Route(id="q", provider="fake", model="q-model", group="gq", recipient="fake",
                  endpoint=fake.endpoint("openai"), price=PRICE)
    led.configure_group("gq", max_in_flight=1)
    led.admit_run("holder", plan=[route], budget=BUDGET, grant=GRANT)
    held = led.acquire_lease("holder", ttl_s=3600)
    led.begin_attempt(held, route="q", envelope_hash="sha256:" + "c" * 64, reserve="0")
    with pytest.raises(FailoverExhausted), led.run("w", plan=[route], budget=BUDGET,
                                                   grant=GRANT, lease_ttl_s=3600) as run:
        run.turn(Envelope(parts=[Part(content="hi")]))
    m = Audit(led).metrics()
    wait = m.queue_waits[("gq", "timed_out")]
    assert (wait.count, wait.sum) == (1, pytest.approx(30.0))
    assert wait.counts[-1] == 1 and wait.counts[wait.bounds.index(20.48)] == 0
    # The waiter left the queue: its group's gauge reads 0, not no series (an alert on the
    # queue's length would see no data).
    assert m.waiting == {"gq": 0}
    assert (m.first_byte[("primary", "failed")].sum, m.first_token[("backup", "succeeded")].sum,
            m.latency[("backup", "succeeded")].sum) == (
        pytest.approx(0.25, abs=TICK), pytest.approx(1.5, abs=TICK),
        pytest.approx(1.5, abs=TICK))
    assert ("primary", "failed") not in m.first_token  # no content came
    assert {k: v for k, v in m.tokens.items() if k[0] == "backup"} == {
        ("backup", "input"): 120, ("backup", "output"): 40, ("backup", "cache_read"): 100,
        ("backup", "reasoning"): 25}
    assert m.failovers_by == {("primary", "backup", "overloaded"): 1} and m.failovers == 1

    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    with TestClient(create_app(url), base_url="http://127.0.0.1") as c:
        text = c.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("ledger_capacity_wait_duration_seconds_count",
                    (("ledger_capacity_group", "gq"), ("ledger_outcome", "timed_out")))] == 1
    assert samples[("gen_ai_client_operation_time_to_first_chunk_seconds_count",
                    (("ledger_outcome", "succeeded"), ("ledger_route", "backup")))] == 1
    assert samples[("ledger_tokens_total",
                    (("gen_ai_token_type", "cache_read"), ("ledger_route", "backup")))] == 100
    assert samples[("ledger_failovers_total", (("ledger_failure_category", "overloaded"),
                                               ("ledger_route_from", "primary"),
                                               ("ledger_route_to", "backup")))] == 1
