"""Overlap is measured from the failure that counted the outage, on both backends.

Under ``failure-domain`` (``health.count_overlapping_failures: false``) an outcome of an
Attempt begun before a route's outage was counted is the same outage. A late failure of such a
request restarts the window and moves ``last_failure_at``; a probe begun after the count but
before that restart is still new evidence: its success clears the route, its failure steps the
curve. Migration 0019 keeps the counting failure in ``health.counted_at``.
"""

from __future__ import annotations

from sqlalchemy import create_engine, text

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import Lease
from ledger.storage.engine import normalize_url

from .helpers import begin_on_a, downgrade_schema, health_lease, overloaded

T0 = 10_000.0



def _cooled_with_a_probe_in_flight(led: Ledger, clock: ManualClock) -> tuple[Lease, str]:
    """A stream begun at T0; three 503s at T0+1..3 cool ``a`` (counted at T0+3); a probe
    begins at T0+4; the stream's 503 at T0+5 restarts the window. The probe, still in flight."""
    slow = health_lease(led, "slow")
    stream = begin_on_a(led, slow)
    for n in range(3):  # failure-domain cools on the third 503 within 60 s
        clock.advance(1)
        lease = health_lease(led, f"burst{n}")
        led.settle_attempt(lease, begin_on_a(led, lease), outcome="failed", fact=overloaded())
    assert led.health(["a"])["a"].counted_at == T0 + 3
    clock.advance(1)
    probe = health_lease(led, "probe")
    probe_attempt = begin_on_a(led, probe)
    clock.advance(1)
    led.settle_attempt(slow, stream, outcome="failed", fact=overloaded())
    h = led.health(["a"])["a"]
    assert (h.error_count, h.counted_at, h.last_failure_at, h.cooldown_until) == (
        1, T0 + 3, T0 + 5, T0 + 65)
    clock.advance(1)
    return probe, probe_attempt


def _row(url: str) -> dict[str, object]:
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            row = conn.execute(text(
                "SELECT error_count, cooldown_until, last_failure_at, counted_at "
                "FROM health WHERE key = 'a'")).mappings().one()
            return dict(row)
    finally:
        engine.dispose()


def test_a_probe_begun_after_the_counting_failure_clears_the_cooldown_a_late_failure_restarted(
        led: Ledger, db_url: str, clock: ManualClock) -> None:
    probe, attempt = _cooled_with_a_probe_in_flight(led, clock)
    led.settle_attempt(probe, attempt, outcome="succeeded", cost="0")
    h = led.health(["a"])["a"]
    assert (h.error_count, h.cooldown_until, h.counted_at) == (0, None, None)
    assert h.available(clock.now())
    assert _row(db_url) == {"error_count": 0, "cooldown_until": None,
                            "last_failure_at": T0 + 5, "counted_at": None}


def test_a_probe_begun_after_the_counting_failure_steps_the_curve_when_it_fails(
        led: Ledger, db_url: str, clock: ManualClock) -> None:
    probe, attempt = _cooled_with_a_probe_in_flight(led, clock)
    led.settle_attempt(probe, attempt, outcome="failed", fact=overloaded())
    assert _row(db_url) == {"error_count": 2, "cooldown_until": T0 + 6 + 300,
                            "last_failure_at": T0 + 6, "counted_at": T0 + 6}


def test_migration_0019_reads_a_row_kept_before_it_by_its_last_failure(
        db_url: str, clock: ManualClock) -> None:
    """A ledger from before 0019 (the column dropped) keeps its cooling rows; opened again,
    their ``counted_at`` is NULL and the overlap is measured from ``last_failure_at`` as the
    package of 0018 did, until the route's next counted failure sets it."""
    with Ledger.open(db_url, clock=clock) as led:
        probe, attempt = _cooled_with_a_probe_in_flight(led, clock)
        before = led.health()
    assert "counted_at" not in downgrade_schema(db_url, "0018", "health")
    with Ledger.open(db_url, clock=clock) as led:  # migrates to head again
        after = led.health()
        assert after == {k: h.model_copy(update={"counted_at": None})
                         for k, h in before.items()}
        # The probe began after the counting failure, but this row cannot tell: it began
        # before the row's last failure, so its success is taken for one in flight, as before.
        led.settle_attempt(probe, attempt, outcome="succeeded", cost="0")
        kept = led.health(["a"])["a"]
        assert (kept.error_count, kept.cooldown_until, kept.counted_at) == (1, T0 + 65, None)
        # A request begun after the last failure steps the curve and records its count.
        clock.advance(1)
        lease = health_lease(led, "late")
        att = begin_on_a(led, lease)
        clock.advance(1)
        led.settle_attempt(lease, att, outcome="failed", fact=overloaded())
        assert led.health(["a"])["a"].counted_at == clock.now()
    assert _row(db_url)["error_count"] == 2

