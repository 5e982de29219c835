"""``/metrics``' counters never go down: an attempt is counted (``ledger_attempts_total``, its
histograms, tokens and cost) once it is settled for good, under the state it keeps, while the
attempts dispatching or unknown now are gauges. Scraped through an attempt's begin and settle,
an unknown attempt resolved by an operator, roll-ups (hours rolled, days folded) and retention,
on SQLite and PostgreSQL: Prometheus reads any decrease as a counter reset (a false ``rate()``
spike)."""

from __future__ import annotations

from decimal import Decimal

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from ledger import Budget, Grant, Ledger, Price, Route
from ledger.clock import ManualClock
from ledger.dashboard.app import create_app
from tests.storage.test_history_scales import HASH, _t

DAY = 86400.0
PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
A = Route(id="a", provider="p", model="m", group="ga", recipient="r", price=PRICE)
GRANT = Grant(recipients={"r": ["user_input"]})
BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal(1))
Sample = tuple[str, tuple[tuple[str, str], ...]]


def _scrape(led: Ledger) -> tuple[dict[Sample, float], dict[Sample, float]]:
    """``/metrics`` as (counters' and histograms' samples, gauges' samples)."""
    app = create_app(ledger=led, metrics_ttl_s=0)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        res = client.get("/metrics")
    assert res.status_code == 200
    rising: dict[Sample, float] = {}
    gauges: dict[Sample, float] = {}
    for fam in text_string_to_metric_families(res.text):
        for x in fam.samples:
            if x.name.endswith("_created"):
                continue
            key = (x.name, tuple(sorted(x.labels.items())))
            if fam.type in ("counter", "histogram"):
                rising[key] = x.value
            elif fam.type == "gauge":
                gauges[key] = x.value
    return rising, gauges


def _never_down(was: str, before: dict[Sample, float], now: str,
                after: dict[Sample, float]) -> None:
    """Each ``_total``, ``_count`` and ``_bucket`` series of scrape ``before`` is in the later
    ``after``, at least as high (a ``_sum`` too, up to a float's last bits: sums of roll-ups)."""
    gone = sorted(before.keys() - after.keys())
    assert not gone, (was, now, gone[:5])
    down = {k: (v, after[k]) for k, v in before.items()
            if after[k] < v - (1e-9 * max(1.0, abs(v)) if k[0].endswith("_sum") else 0)}
    assert not down, (was, now, list(down.items())[:5])


def _gauge(gauges: dict[Sample, float], name: str, route: str = "a") -> float | None:
    return gauges.get((name, (("ledger_route", route),)))


def _count(rising: dict[Sample, float], name: str, outcome: str) -> float:
    return rising.get((name, (("ledger_outcome", outcome), ("ledger_route", "a"))), 0.0)


def test_metrics_counters_and_histograms_never_go_down_as_attempts_change_state(
        db_url: str) -> None:
    clock = ManualClock(_t(2026, 5, 10))
    scrapes: list[tuple[str, dict[Sample, float]]] = []
    gauges: dict[str, tuple[float | None, float | None]] = {}

    def scrape(tag: str, led: Ledger) -> dict[Sample, float]:
        rising, now = _scrape(led)
        for was, before in scrapes:  # every earlier scrape, not only the last
            _never_down(was, before, tag, rising)
        scrapes.append((tag, rising))
        gauges[tag] = (_gauge(now, "ledger_attempts_in_flight"),
                       _gauge(now, "ledger_attempts_unknown"))
        return rising

    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r1", plan=[A], grant=GRANT, budget=BUDGET)
        lease = led.acquire_lease("r1", ttl_s=DAY)
        scrape("before begin", led)
        first = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
        in_flight = scrape("in flight", led)
        clock.advance(2)
        led.settle_attempt(lease, first.attempt_id, outcome="succeeded", prompt_tokens=100,
                           completion_tokens=50)
        settled = scrape("settled", led)
        assert not [k for k in in_flight if k[0].startswith("ledger_attempt")]
        assert _count(settled, "ledger_attempts_total", "succeeded") == 1
        assert _count(settled, "ledger_attempt_duration_seconds_count", "succeeded") == 1

        # Two attempts sent without a receipt (usage reported before the cut): counted by the
        # unknown gauge only, until an operator resolves them.
        unsure = []
        for _ in range(2):
            att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
            clock.advance(3)
            led.settle_attempt(lease, att.attempt_id, outcome="unknown", prompt_tokens=500)
            unsure.append(att.attempt_id)
        assert scrape("unknown", led) == settled
        clock.advance(7200)
        assert led.roll_up(lag=0).hours  # their hour rolled, the unknown ones with it
        assert scrape("rolled", led) == settled

        led.settle_unknown(unsure[0], outcome="not_sent", note="console: never arrived",
                           by="ops")
        resolved = scrape("resolved not_sent", led)
        assert _count(resolved, "ledger_attempts_total", "not_sent") == 1
        assert _count(resolved, "ledger_attempt_duration_seconds_count", "not_sent") == 1
        led.settle_unknown(unsure[1], outcome="succeeded", prompt_tokens=400,
                           completion_tokens=80, note="billing export", by="ops")
        resolved = scrape("resolved succeeded", led)
        assert _count(resolved, "ledger_attempts_total", "succeeded") == 2
        assert _count(resolved, "ledger_attempt_duration_seconds_count", "succeeded") == 2
        assert resolved[("ledger_tokens_total", (("gen_ai_token_type", "input"),
                                                 ("ledger_route", "a")))] == 500
        led.roll_up(lag=0)
        assert scrape("rolled again", led) == resolved

        led.finish_run(lease, "succeeded")
        led.release_lease(lease)
        clock.set(_t(2026, 8, 10))
        led.roll_up(lag=0)  # May's days folded
        assert scrape("folded", led) == resolved
        dropped = led.drop_history(30 * DAY, by="ops", reason="keep 30 days")
        assert any(p.table == "attempts" for p in dropped.dropped)
        assert scrape("retention", led) == resolved  # carried over, every sample

        led.admit_run("r2", plan=[A], grant=GRANT, budget=BUDGET)
        lease = led.acquire_lease("r2", ttl_s=600)
        led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
        scrape("in flight after retention", led)
    # (dispatching, unknown) now, per scrape: 0 rather than no series once route a has any.
    assert gauges == {
        "before begin": (None, None), "in flight": (1, 0), "settled": (0, 0),
        "unknown": (0, 2), "rolled": (0, 2), "resolved not_sent": (0, 1),
        "resolved succeeded": (0, 0), "rolled again": (0, 0), "folded": (0, 0),
        "retention": (0, 0), "in flight after retention": (1, 0)}
