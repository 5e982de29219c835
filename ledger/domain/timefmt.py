"""Times for people: ISO-8601 in UTC, or a distance from now ("in 4 m", "12 s ago").

The ledger stores times as epoch seconds (floats); nothing meant for a person prints one. Pure
functions of their arguments (no clock read here), so the selector's reasons, the command line,
the demo and the dashboard all say the same thing for the same instant.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any


def iso(ts: float | None) -> str:
    """``2026-01-31T18:00:05Z`` (UTC, whole seconds), or ``-`` for no time."""
    if ts is None:
        return "-"
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, OverflowError, OSError):
        # A stored time outside the years a date can show (a row written by a clock or an
        # older ledger gone wrong): shown as it is, so one bad row never breaks a listing.
        return f"{ts:.6g} s since 1970"


def duration(seconds: float) -> str:
    """A length of time, rounded to the unit that keeps it short: ``42 s``, ``4 m``, ``3 h``."""
    s = abs(seconds)
    if s < 120:
        return f"{s:.0f} s" if s >= 10 or s == int(s) else f"{s:.1f} s"
    if s < 120 * 60:
        return f"{s / 60:.0f} m"
    if s < 48 * 3600:
        return f"{s / 3600:.0f} h"
    return f"{s / 86400:.0f} d"


def relative(ts: float | None, now: float) -> str:
    """``in 4 m`` for the future, ``12 s ago`` for the past, ``now`` within half a second."""
    if ts is None:
        return "-"
    d = ts - now
    if abs(d) < 0.5:
        return "now"
    return f"in {duration(d)}" if d > 0 else f"{duration(d)} ago"


def when(ts: float | None, now: float) -> str:
    """Both: ``in 4 m (2026-01-31T18:04:00Z)``; the form for times a reader acts on."""
    if ts is None:
        return "-"
    return f"{relative(ts, now)} ({iso(ts)})"


_TIME_KEYS = re.compile(r"^(until|.*_until|.*_at)$")


def data_text(data: Any, now: float) -> str:
    """Event data as ``key=value`` pairs, keys sorted.

    Numbers under time keys (``until``, ``*_until``, ``*_at``) are instants and read as
    :func:`when` gives them.
    """
    if not isinstance(data, dict):
        return json.dumps(data, sort_keys=True)
    parts = []
    for k in sorted(data):
        v = data[k]
        if _TIME_KEYS.match(k) and isinstance(v, int | float) and not isinstance(v, bool):
            parts.append(f"{k}={when(float(v), now)}")
        elif isinstance(v, str):
            parts.append(f"{k}={v}")
        else:
            parts.append(f"{k}={json.dumps(v, sort_keys=True)}")
    return ", ".join(parts)


__all__ = ["data_text", "duration", "iso", "relative", "when"]
