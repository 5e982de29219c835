"""Wait hints a provider sends with a failure.

``Retry-After`` (delta-seconds or an HTTP-date), its millisecond forms (``retry-after-ms``,
``x-ms-retry-after-ms``) and Gemini's ``RetryInfo``.

Every parser here is total: garbage, negative or absurd input yields ``None`` (no usable hint),
never an exception, because a hint is advisory and a malformed one must not lose the failure.
"""

from __future__ import annotations

import email.utils
import math
import re
from datetime import UTC
from typing import Any

_DELTA = re.compile(r"\d{1,32}(?:\.\d{1,32})?")
_PROTO_DURATION = re.compile(r"\s*(\d{1,32}(?:\.\d{1,32})?)s\s*")
_MAX_HEADER = 256  # an HTTP-date is 29 characters; anything much longer is not a hint


def _http_date(value: str) -> float | None:
    """Seconds since the epoch of an HTTP-date, or None."""
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if dt is None:
        return None
    if dt.tzinfo is None:  # "-0000" and obsolete forms carry no zone; HTTP-dates are GMT
        dt = dt.replace(tzinfo=UTC)
    try:
        return dt.timestamp()
    except (OverflowError, ValueError, OSError):
        return None


def parse_retry_after(
    value: str | None, *, now: float | None = None, date: str | None = None
) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP-date).

    An HTTP-date is measured from the response's own ``Date`` header (``date``) when it has a
    usable one: both come from the provider's clock, so skew between our clock and theirs
    cancels out. Otherwise it is measured from ``now`` (our clock). With neither there is no
    reference, and the hint is ``None`` rather than a guess. A date in the past means "retry
    now" (0).
    """
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text or len(text) > _MAX_HEADER:
        return None
    if _DELTA.fullmatch(text):
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    at = _http_date(text)
    if at is None:
        return None
    # The provider's Date first: measuring its date against our clock would turn any clock
    # skew into a longer or shorter wait (or none at all).
    ref = _http_date(date) if isinstance(date, str) and len(date) <= _MAX_HEADER else None
    if ref is None and now is not None and math.isfinite(now):
        ref = now
    if ref is None:
        return None
    return max(0.0, at - ref)


def parse_retry_after_ms(value: str | None) -> float | None:
    """Seconds to wait from a ``retry-after-ms`` or ``x-ms-retry-after-ms`` value.

    Milliseconds as a non-negative decimal number, the form OpenAI and Azure OpenAI send and
    their SDKs read before ``Retry-After`` (Azure may send only this). No date form exists; the
    same length bound as ``Retry-After`` applies, and anything else is ``None``.
    """
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text or len(text) > _MAX_HEADER or not _DELTA.fullmatch(text):
        return None
    seconds = float(text) / 1000.0
    return seconds if math.isfinite(seconds) else None


def _proto_duration(value: Any) -> float | None:
    """A protobuf Duration in its JSON form ("8s", "1.5s") or as {seconds, nanos}."""
    if isinstance(value, str):
        m = _PROTO_DURATION.fullmatch(value)
        return float(m.group(1)) if m else None
    if isinstance(value, dict):
        secs, nanos = value.get("seconds", 0), value.get("nanos", 0)
        if isinstance(secs, str) and secs.isdigit() and len(secs) <= 32:
            secs = int(secs)
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (secs, nanos))
        if not numeric:
            return None
        try:
            total = float(secs) + float(nanos) / 1e9
        except OverflowError:  # a JSON integer beyond any float
            return None
        return total if math.isfinite(total) and total >= 0 else None
    return None


def gemini_retry_delay(error: Any) -> float | None:
    """``retryDelay`` of a ``google.rpc.RetryInfo`` detail in a Gemini ``error`` object."""
    if not isinstance(error, dict):
        return None
    details = error.get("details")
    if not isinstance(details, list):
        return None
    for item in details[:64]:
        if not isinstance(item, dict):
            continue
        kind = item.get("@type")
        if isinstance(kind, str) and kind.endswith("google.rpc.RetryInfo"):
            found = _proto_duration(item.get("retryDelay"))
            if found is not None:
                return found
    return None


__all__ = ["gemini_retry_delay", "parse_retry_after", "parse_retry_after_ms"]
