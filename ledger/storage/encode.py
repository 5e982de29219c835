"""How values are written: events and facts as JSON (every string redacted), health rows."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ledger.domain.facts import FailureFact
from ledger.domain.values import Health
from ledger.redaction import redact_data


def event_json(data: Mapping[str, Any]) -> str:
    """An event's data as stored: every string redacted (it may carry provider or host text)."""
    return json.dumps(redact_data(dict(data)), sort_keys=True)


def fact_json(fact: FailureFact) -> str:
    """A failure fact as stored: every string redacted (message, provider code, ...)."""
    return json.dumps(redact_data(fact.to_json()))


def fact_member(key: str, value: str | bool) -> str:
    """The text one member of a stored fact reads as (``"phase": "after_headers"``).

    Spelled by the same encoder as :func:`fact_json`, so a query can find it in the stored
    text without parsing the JSON; a quote inside a string value is escaped, so no message can
    hold it.
    """
    return json.dumps({key: value})[1:-1]


def health_values(new: Health, now: float) -> dict[str, Any]:
    return {
        "cooldown_until": new.cooldown_until, "disabled_until": new.disabled_until,
        "disabled_reason": new.disabled_reason, "error_count": new.error_count,
        "failure_counts": json.dumps(new.failure_counts, sort_keys=True),
        "last_failure_at": new.last_failure_at, "counted_at": new.counted_at,
        "last_used": new.last_used,
        "last_probe_at": new.last_probe_at, "reset_at": new.reset_at,
        "recent_failures": json.dumps(list(new.recent_failures)) if new.recent_failures else None,
        "updated_at": now,
    }
