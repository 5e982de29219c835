"""The pure rule of an operator's clear (``ledger.decide.health.operator_clear``,
``group_closed``): what a clear writes, what it reports as cleared, and when there is nothing
to clear. The storage applies exactly this to the row as locked (tests/recovery/
test_operator_actions.py shows it end to end)."""

from __future__ import annotations

from ledger.decide.health import as_read, group_closed, operator_clear
from ledger.domain.values import Health

NOW = 1_000.0


def test_a_cooling_key_is_available_at_once_and_counts_from_zero() -> None:
    h = Health(key="a", cooldown_until=NOW + 60, error_count=3,
               failure_counts={"overloaded": 3}, last_failure_at=NOW - 1, last_used=NOW - 5,
               last_probe_at=NOW - 2, reset_at=NOW + 60, recent_failures=(NOW - 1,),
               counted_at=NOW - 3)
    found = operator_clear(h, NOW)
    assert found is not None
    after, before = found
    assert after.available(NOW) and after.error_count == 0 and after.failure_counts == {}
    assert after.reset_at is None and after.recent_failures == ()
    # History stays: when it was last used, failed and probed.
    assert (after.last_failure_at, after.last_used, after.last_probe_at) == (
        NOW - 1, NOW - 5, NOW - 2)
    assert before == {"status": "cooling", "cooldown_until": NOW + 60, "disabled_until": None,
                      "disabled_reason": None, "error_count": 3,
                      "failure_counts": {"overloaded": 3}, "recent_failures": 1,
                      "counted_at": NOW - 3}


def test_a_disabled_key_reports_its_disable() -> None:
    h = Health(key="p", disabled_until=NOW + 3600, disabled_reason="billing", error_count=1)
    _after, before = operator_clear(h, NOW) or (None, {})
    assert before["status"] == "disabled" and before["disabled_reason"] == "billing"


def test_nothing_to_clear_when_the_key_reads_as_healthy() -> None:
    assert operator_clear(Health(key="a"), NOW) is None
    assert operator_clear(Health(key="a", last_failure_at=NOW - 10, last_used=NOW), NOW) is None
    # Counters past their reset time read as reset (as the selector reads them): nothing left.
    expired = Health(key="a", cooldown_until=NOW - 1, error_count=2, reset_at=NOW - 1)
    assert as_read(expired, NOW).error_count == 0
    assert operator_clear(expired, NOW) is None
    # A cooldown that has passed, counters not reset yet (GoClaw's failure window): cleared.
    counting = Health(key="a", cooldown_until=NOW - 1, error_count=2, reset_at=NOW + 600)
    found = operator_clear(counting, NOW)
    assert found is not None and found[1]["status"] == "ok" and found[1]["error_count"] == 2


def test_a_group_is_closed_only_while_its_floor_holds() -> None:
    assert group_closed("cooldown", NOW + 1, NOW)
    assert group_closed("unavailable", None, NOW)  # until changed again
    assert not group_closed("cooldown", NOW, NOW)  # the floor has passed: open
    assert not group_closed("open", None, NOW)
