"""``/metrics`` across ``failover-ledger retention``: its counters are totals over the whole
history, so dropping old history changes none of them (Prometheus reads any decrease as a
counter reset), while every read over a window still counts the retained history only."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from ledger import Budget, Ledger
from ledger.clock import ManualClock
from ledger.dashboard.app import create_app
from ledger.ops.audit import Audit
from ledger.storage.hours import CARRIED_HOUR
from ledger.tools.generate import generate
from tests.audit.test_rollups import _answers, _metrics, _sql, _unroll_all
from tests.storage.test_history_scales import HASH, ROUTE, _t

DAY = 86400.0
END = _t(2026, 8, 5)
_CARRIED = {"metric_rollups": ("route_id", "state"),
            "move_rollups": ("from_route", "to_route", "category"),
            "wait_rollups": ("group_id", "outcome")}


def _scrape(led: Ledger) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``' counters and histograms (buckets, ``_count``, ``_sum``)."""
    app = create_app(ledger=led, metrics_ttl_s=0)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        body = client.get("/metrics").text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(body)
            if fam.type in ("counter", "histogram") for x in fam.samples
            if not x.name.endswith("_created")}


def _no_decrease(before: dict[Any, float], after: dict[Any, float]) -> None:
    """Every series of ``before`` is in ``after`` with the same value (a histogram's ``_sum``
    up to the last bits of a float: the dropped history is summed in another order)."""
    assert before.keys() <= after.keys(), sorted(before.keys() - after.keys())[:5]
    changed = {k: (v, after[k]) for k, v in before.items()
               if abs(after[k] - v) > 1e-9 * max(1.0, abs(v))}
    assert not changed, list(changed.items())[:5]


def _retained(led: Ledger) -> dict[str, Any]:
    """Every read over a window (costs, charts, spend): the retained history's."""
    return {k: v for k, v in _answers(led).items() if not k.startswith("metrics")}


def _old_history(led: Ledger, clock: ManualClock, url: str) -> None:
    """100 days of generated history to ``END``, its unknown attempts older than 40 days
    settled (so their months may go), and moves and capacity waits of a host's own in May."""
    generate(led, attempts=300, days=100, end=END, seed=11)
    for (attempt_id,) in _sql(url, "SELECT attempt_id FROM attempts WHERE state = 'unknown' "
                                   "AND created_at < :t", {"t": END - 40 * DAY}):
        led.settle_unknown(attempt_id, outcome="failed", note="billing export", by="ops")
    clock.set(_t(2026, 5, 3))
    led.admit_run("waits", plan=[ROUTE], budget=Budget(max_calls=2, max_retries=0, max_cost=1))
    lease = led.acquire_lease("waits", ttl_s=600)
    led.append_event(lease, "move", {"from_route": "a", "to_route": "b",
                                     "cause": {"category": "overloaded"}})
    for outcome, waited in (("timed_out", 2.5), ("admitted", 0.3), ("admitted", 0.07)):
        led.append_event(lease, "capacity_wait", {"group": "g", "outcome": outcome,
                                                  "waited_s": waited})
    led.finish_run(lease, "failed")
    led.release_lease(lease)
    clock.set(END)


def _carried_keys_once(url: str) -> None:
    for table, keys in _CARRIED.items():
        rows = _sql(url, f"SELECT {', '.join(keys)} FROM {table} WHERE hour = :h",
                    {"h": CARRIED_HOUR})
        assert len(rows) == len(set(rows)), table  # one carried row per key


def test_metrics_counters_never_go_down_across_retention(db_url: str) -> None:
    clock = ManualClock(END - 100 * DAY)
    with Ledger.open(db_url, clock=clock) as led:
        _old_history(led, clock, db_url)
        led.roll_up(lag=0)  # the hours rolled, the days older than 8 folded
        scraped = _scrape(led)
        metrics = _metrics(Audit(led))
        first = led.drop_history(60 * DAY, by="ops", reason="keep 60 days")
        assert first.dropped and any(p.table == "events" for p in first.dropped)
        _no_decrease(scraped, _scrape(led))
        assert _metrics(Audit(led)) == metrics
        # The moves and waits of May went too, and are still counted.
        assert _sql(db_url, "SELECT count(*) FROM events WHERE kind = 'capacity_wait'") \
            == [(0,)]
        assert ('ledger_capacity_wait_duration_seconds_count',
                (("ledger_capacity_group", "g"), ("ledger_outcome", "admitted"))) in scraped
        # Every read over a window counts the retained history: what the tables alone say.
        retained = _retained(led)
        _unroll_all(db_url)
        assert _retained(led) == retained
        assert _metrics(Audit(led)) == metrics
        # A second run, over hours not rolled, adds to the carried rows, one per key.
        clock.set(END + 2 * DAY)
        assert led.drop_history(30 * DAY, by="ops", reason="keep 30 days").dropped
        _carried_keys_once(db_url)
        _no_decrease(scraped, _scrape(led))
        assert _metrics(Audit(led)) == metrics
        led.roll_up(lag=0)
        assert _metrics(Audit(led)) == metrics
        assert _sql(db_url, "SELECT count(*) FROM attempt_rollups WHERE hour = :h",
                    {"h": CARRIED_HOUR}) == [(0,)]


@pytest.mark.postgres
def test_a_months_dropped_moves_are_counted_once_when_its_attempts_are_kept(pg_url: str) -> None:
    """PostgreSQL drops each table's months on their own: May's events may go while May's
    attempts stay (an attempt of May still unknown, its Run's events in other months). The
    moves of May are carried over, and May's roll-ups go with its events, so each is counted
    once."""
    clock = ManualClock(_t(2026, 4, 30))
    budget = Budget(max_calls=2, max_retries=0, max_cost=1)
    with Ledger.open(pg_url, clock=clock) as led:
        # Admitted and leased in April, its attempt begun in May and never settled.
        led.admit_run("straddle", plan=[ROUTE], budget=budget)
        lease = led.acquire_lease("straddle", ttl_s=DAY)
        clock.set(_t(2026, 5, 1) - 3600)
        led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
        clock.set(_t(2026, 5, 12))
        led.admit_run("mover", plan=[ROUTE], budget=budget)
        moved = led.acquire_lease("mover", ttl_s=600)
        led.append_event(moved, "move", {"from_route": "a", "to_route": "b",
                                          "cause": {"category": "overloaded"}})
        led.finish_run(moved, "failed")
        led.release_lease(moved)
        clock.set(END)
        led.roll_up(lag=0)
        scraped = _scrape(led)
        metrics = _metrics(Audit(led))
        assert metrics["metrics failovers"] == 1
        done = led.drop_history(60 * DAY, by="ops", reason="keep 60 days")
        may = {(p.table, p.partition) for p in done.dropped}
        assert ("events", "events_p202605") in may
        assert "attempts_p202605" in {p.partition for p in done.kept}
        _no_decrease(scraped, _scrape(led))
        assert _metrics(Audit(led)) == metrics
