"""``failover-ledger generate`` writes its history through the ledger (admitted Runs, turns
served by the retry owner with a scripted send function): reconciliation finds nothing to report
in it, every Attempt after a turn's first holds a retry permission, its Runs are frozen under the
goclaw rules, and its rows and events have the shape the retry owner gives a real Run on the
fake provider under the same preset, over HTTP, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ledger import (
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    Ledger,
    Part,
    Route,
    policy_hash,
    preset,
)
from ledger.clock import ManualClock
from ledger.domain.facts import WireProtocol
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.testing import Behavior, FakeProvider, Fault
from ledger.testing.pgserver import free_port
from ledger.tools.generate import generate, generated_policy, generated_policy_hash
from tests.fakeplan import PRICE, _clear, fake
from tests.storage.helpers import REPO, sql_context

# Enough Runs for a page of 20 that failed over in the audit and a second page (about one Run
# in twelve fails over: 26 here). Generating costs a few transactions per Attempt, so N stays
# small.
N = 500
END = 1_700_000_000.0
DAY = 86400.0

# The shared fake provider (one per module) and its per-test clearing, for the shape test.
__all__ = ["_clear", "fake"]


@pytest.fixture(scope="module",
                params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def generated(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    """A ledger holding N generated Attempts, once per backend."""
    if request.param == "sqlite":
        url = str(tmp_path_factory.mktemp("gen") / "ledger.db")
    else:
        srv = request.getfixturevalue("pg_server")
        name = f"gen_{os.getpid()}"
        url = srv.create_database(name, template="ledger_template")
    led = Ledger.open(url, clock=ManualClock(END))
    try:
        stats = generate(led, attempts=N, days=2, end=END, seed=5)
        assert stats.attempts == N
        yield led
    finally:
        led.close()


def test_generated_history_reconciles_with_no_violation(generated: Ledger) -> None:
    books = reconcile(generated)
    assert books.violations == [] and books.cost_over_hold == [] and books.ok
    assert books.attempts == N
    # It holds every kind of record the checks are about, so a wrong one would be found: holds
    # posted at cost, at nothing (an error answer) and kept (unknown), holds voided (never
    # sent, the model call given back), and attempts still dispatching with their slots.
    assert {"succeeded", "failed", "unknown", "not_sent"} <= set(books.by_state)
    assert set(books.debits) == {"posted", "reserved", "voided"}


def _per_run(led: Ledger, sql: str) -> list[Any]:
    with sql_context(led).engine.connect() as conn:
        return list(conn.execute(text(sql)))


def test_every_attempt_after_a_turns_first_took_a_retry_permission(generated: Ledger) -> None:
    # The retry owner takes one for every further Attempt of a turn, a same-route retry and a
    # failover alike; generated runs that failed over showed ``retries 0`` (issue 27).
    rows = _per_run(generated, "SELECT r.run_id, r.retries_used, r.calls_used, count(*), "
                               "count(DISTINCT a.turn_id), "
                               "sum(CASE WHEN a.state = 'not_sent' THEN 1 ELSE 0 END) "
                               "FROM runs r JOIN attempts a ON a.run_id = r.run_id "
                               "GROUP BY r.run_id, r.retries_used, r.calls_used")
    assert len(rows) > N // 3
    wrong = [r for r in rows if r[1] != r[3] - r[4] or r[2] != r[3] - r[5]]
    assert wrong == []
    audit = Audit(generated)
    page = audit.failovers(since=END - 3 * DAY, until=END + 1, limit=20)
    assert len(page.items) == 20
    moved = 0
    for f in page.items:
        tl = audit.timeline(f.run_id)
        further = len(tl.attempts) - len({a.turn_id for a in tl.attempts})
        assert tl.run.retries_used == further, f.run_id
        # A Run whose first Attempt went past a cooling primary failed over without a retry.
        if any(a.kind == "failover" for a in tl.attempts):
            moved += 1
            assert further > 0, f.run_id
    assert moved > 10


def test_the_command_line_reconciles_a_generated_ledger(tmp_path: Path) -> None:
    db = str(tmp_path / "gen.db")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LEDGER_URL", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ledger.cli.main", "--db", db, *args],
                              env=env, capture_output=True, text=True, timeout=300)

    made = cli("generate", "--attempts", "250", "--days", "1", "--end", str(END), "--seed", "3",
               "--json")
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    assert summary["attempts"] == 250 and summary["not_sent"] > 0 and summary["unknown"] > 0
    books = cli("reconcile", "--json")
    assert books.returncode == 0, books.stdout
    assert json.loads(books.stdout)["violations"] == []


def test_generated_runs_are_frozen_under_the_goclaw_rules_and_marked_by_their_hash(
        generated: Ledger) -> None:
    runs = Audit(generated).runs(limit=50).items
    assert len(runs) == 50
    marker = generated_policy_hash()
    goclaw = preset("goclaw").model_dump(mode="json")
    for r in runs[:5]:
        rec = generated.get_run(r.run_id)
        assert rec.policy_hash == marker
        frozen = generated.run_policy(r.run_id).model_dump(mode="json")
        # The same rules as the preset; only the name (and so the hash) tells them apart.
        assert {k: v for k, v in frozen.items() if k not in ("name", "description")} == {
            k: v for k, v in goclaw.items() if k not in ("name", "description")}
    assert marker != policy_hash(preset("goclaw")) and generated_policy().name != "goclaw"


def test_the_same_seed_writes_the_same_history(tmp_path: Path) -> None:
    def written(name: str) -> list[tuple[str, str, str, str, int]]:
        with Ledger.open(str(tmp_path / name), clock=ManualClock(END)) as led:
            generate(led, attempts=120, days=0.5, end=END, seed=11)
            # Attempt ids are the ledger's own draw; everything else follows from the seed.
            return [(a.run_id, a.turn_id, a.route_id, a.state.value, a.seq)
                    for run in Audit(led).runs(limit=500).items
                    for a in led.timeline(run.run_id)]

    first = written("a.db")
    assert len(first) == 120 and first == written("b.db")


def test_generate_needs_a_manual_clock_and_writes_nothing_without_one(tmp_path: Path) -> None:
    with Ledger.open(str(tmp_path / "g.db")) as led:
        with pytest.raises(InvalidArgument, match="ManualClock") as e:
            generate(led, attempts=10, end=END)
        assert e.value.field == "ledger"
        assert Audit(led).runs().items == []
    with Ledger.open(str(tmp_path / "g.db"), clock=ManualClock(END)) as led:
        for bad, field in (({"attempts": 0}, "attempts"), ({"days": 0}, "days")):
            with pytest.raises(InvalidArgument) as e:
                generate(led, **{"attempts": 10, "end": END, **bad})  # type: ignore[arg-type]
            assert e.value.field == field
        assert Audit(led).runs().items == []


def _history(led: Ledger) -> dict[str, list[tuple[str, str, str, int, str | None]]]:
    """Per Run, its Attempts as the ledger holds them."""
    return {run.run_id: [(a.attempt_id, a.turn_id, a.state.value, a.seq, a.debit_state.value
                          if a.debit_state else None) for a in led.timeline(run.run_id)]
            for run in Audit(led).runs(limit=500).items}


def test_a_second_history_of_the_same_seed_never_touches_the_first_ones_runs(
        db_url: str) -> None:
    """Run ids came from the seed alone: generating again on the same ledger admitted the
    first history's Runs again, added Attempts to them, then failed half-way."""
    with Ledger.open(db_url, clock=ManualClock(END)) as led:
        assert generate(led, attempts=60, days=0.5, end=END, seed=11).attempts == 60
        first = _history(led)
        for _ in range(2):  # a third one finds both ids taken
            assert generate(led, attempts=60, days=0.5, end=END, seed=11).attempts == 60
        after = _history(led)
        assert {r: after[r] for r in first} == first
        # Each history its own Runs (how many depends on the health the earlier ones left).
        assert len({r.rsplit("-", 1)[0] for r in after}) == 3
        assert sum(map(len, after.values())) == 180
        books = reconcile(led)
        assert books.attempts == 180 and books.violations == [] and books.ok


@pytest.mark.parametrize(("kw", "field", "says"), [
    ({"end": 1_796_583_592_939}, "end", "not milliseconds"),  # milliseconds: year 58901
    ({"end": 1e20}, "end", "below 1e+11"),
    ({"end": -1.0}, "end", "seconds since 1970"),
    ({"end": float("nan")}, "end", "seconds since 1970"),
    ({"days": 1e20}, "days", "before 1970"),
    ({"days": 30_000, "end": 1e9}, "days", "at most 11574.07 days"),
])
def test_generate_refuses_a_history_outside_the_times_the_ledger_reads_and_writes_nothing(
        db_url: str, kw: dict[str, Any], field: str, says: str) -> None:
    with Ledger.open(db_url, clock=ManualClock(END)) as led:
        with pytest.raises(InvalidArgument) as e:
            generate(led, **{"attempts": 10, "days": 1, "end": END, **kw})
        assert e.value.field == field and says in str(e.value), str(e.value)
        assert Audit(led).runs().items == []


# -- the shape of what the retry owner writes ----------------------------------------------------


def _real_run(led: Ledger, fake: FakeProvider) -> str:
    """A Run through the real retry owner under ``goclaw``: a refused connection (retried once,
    then moved on), a 503 (retried), a 401 (moved on), an answer; then a turn that stops."""
    proto = WireProtocol.OPENAI
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: the connection is refused
    plan = [Route(id="dead", provider="nowhere", model="m0", group="gd", recipient="fake",
                  protocol=proto, endpoint=dead, price=PRICE),
            Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol=proto, endpoint=fake.endpoint("openai"),
                  price=PRICE),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=proto, endpoint=fake.endpoint("openai"),
                  price=PRICE)]
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Fault.UNAUTHORIZED, model="primary-model")
    # The answer streams and reports its cached and reasoning tokens, as generated ones do.
    fake.enqueue(Behavior(cached_tokens=4, reasoning_tokens=2), model="backup-model")
    clock = led.clock
    assert isinstance(clock, ManualClock)
    with pytest.raises(FailoverExhausted), led.run(
            "real", plan=plan, policy="goclaw", tenant="acme", labels={"team": "eval"},
            budget=Budget(max_calls=12, max_retries=6, max_cost="1"),
            grant=Grant(recipients={"fake": ["user_input", "model_derived"]})) as run:
        first = run.turn(Envelope(parts=[Part(content="hello")], stream=True), sleeper=clock)
        for model in ("primary-model", "backup-model"):
            for _ in range(4):
                fake.enqueue(Fault.CONTEXT_LENGTH, model=model)
        run.turn(Envelope(parts=[Part(content="hello"), *first.parts,
                                 Part(content="and the rest")]), sleeper=clock)
    return "real"


def _shapes(led: Ledger, where: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per event kind, the keys of its data; per attempt state, the columns left NULL."""
    keys: dict[str, set[str]] = {}
    for kind, data in _per_run(led, f"SELECT kind, data FROM events WHERE {where}"):
        keys.setdefault(kind, set()).update(json.loads(data))
    nulls: dict[str, set[str]] = {}
    with sql_context(led).engine.connect() as conn:
        res = conn.execute(text(f"SELECT * FROM attempts WHERE {where}"))
        cols = list(res.keys())
        for row in res:
            state = row[cols.index("state")]
            empty = {c for c, v in zip(cols, row, strict=True) if v is None}
            nulls[state] = nulls.get(state, empty) & empty
    return keys, nulls


def test_generated_records_have_the_shape_the_retry_owner_writes(generated: Ledger,
                                                                 fake: FakeProvider) -> None:
    _real_run(generated, fake)
    real_keys, real_nulls = _shapes(generated, "run_id = 'real'")
    gen_keys, gen_nulls = _shapes(generated, "run_id <> 'real'")
    # The real Run wrote what the comparison is about.
    assert {"admit", "lease", "select", "retry", "move", "stop", "finish"} <= set(real_keys)
    assert {"not_sent", "failed", "succeeded"} <= set(real_nulls)
    for kind, keys in real_keys.items():
        assert gen_keys.get(kind) == keys, kind
    for state, nulls in real_nulls.items():
        # The profile is the route's (the real plan's routes carry none); the rest is the
        # retry owner's doing.
        assert gen_nulls.get(state, set()) - {"profile_id"} == nulls - {"profile_id"}, state
    run = generated.get_run("real")
    attempts = generated.timeline("real")
    assert run.retries_used == len(attempts) - len({a.turn_id for a in attempts})


def test_failovers_are_all_counted_and_each_says_why(generated: Ledger) -> None:
    audit = Audit(generated)
    window = {"since": END - 3 * DAY, "until": END + 1}
    items: list[Any] = []
    cursor = None
    while True:
        page = audit.failovers(limit=25, cursor=cursor, **window)
        items += page.items
        cursor = page.next_cursor
        if cursor is None:
            break
    assert audit.count_failovers(**window) == len(items) > 20
    assert all(f.causes for f in items)  # every failover has a cause (a failure, or a skip)
    # The dashboard's tile counts them all, not the 20 its "recent failovers" table lists.
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    with TestClient(create_app(ledger=generated), base_url="http://127.0.0.1") as c:
        page_html = c.get("/", params={"hours": 72}).text
    shown = page_html.split('id="glance-failovers">', 1)[1].split("<", 1)[0]
    now = audit.now()  # the page's (another test of this module may have moved the clock)
    assert int(shown) == audit.count_failovers(since=now - 72 * 3600, until=now) > 20


def test_a_run_that_skipped_its_cooling_selected_route_names_the_skip_as_its_cause(
        db_url: str, fake: FakeProvider) -> None:
    # One Run's trusted 429 (Retry-After 7 s) closes group ga; the next Run, selected on the
    # same route, is served by the backup without a failure of its own and without a retry:
    # it failed over, and the skip is why (issue 27: such runs showed "retries 0" and no cause).
    plan = [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", endpoint=fake.endpoint("openai"), price=PRICE),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", endpoint=fake.endpoint("openai"), price=PRICE)]
    grant = Grant(recipients={"fake": ["user_input"]})
    budget = Budget(max_calls=4, max_retries=2, max_cost="1")
    fake.enqueue(Fault.RATE_LIMIT_RETRY_AFTER, model="primary-model")
    with Ledger.open(db_url, clock=ManualClock(END)) as led:
        for run_id in ("first", "second"):
            with led.run(run_id, plan=plan, budget=budget, grant=grant) as run:
                assert run.turn(Envelope(parts=[Part(content="hi")])).route.id == "backup"
        audit = Audit(led)
        second = led.get_run("second")
        assert second.retries_used == 0 and [a.route_id for a in led.timeline("second")] == [
            "backup"]
        failovers = {f.run_id: f for f in audit.failovers().items}
        assert [(c.state, c.route) for c in failovers["first"].causes] == [("failed",
                                                                             "primary")]
        [cause] = failovers["second"].causes
        assert (cause.state, cause.route) == ("skipped", "primary")
        assert cause.attempt_id == led.timeline("second")[0].attempt_id
        assert cause.category  # the selector's reason, e.g. the group's cooldown
        assert audit.timeline("second").failed_over is True
