"""The documented ranges of every number and identifier the ledger stores.

Checked at the public API boundary, so both backends refuse the same inputs with the same typed
error (:class:`~ledger.errors.InvalidArgument` naming the field) and nothing out of range ever
reaches a column: an overflow inside a transaction would turn a recorded success into a crash.

=====================  ==========================================================
what                   range
=====================  ==========================================================
ids (run, attempt, …)  1 to 200 characters, printable, no NUL or control characters
counts (calls, …)      integers 0 to 10^9 (``bool`` is not an integer here)
tokens                 integers 0 to 10^15
money                  finite decimals 0 to 10^12 currency units (stored as micro-units)
durations              finite seconds; a lease TTL is in (0, 86 400]
times (deadlines, …)   finite epoch seconds in [0, 10^11)
=====================  ==========================================================
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Any

from ledger.errors import InvalidArgument

MAX_ID_LENGTH = 200
MAX_COUNT = 10**9
MAX_TOKENS = 10**15
MAX_AMOUNT = Decimal(10**12)
MAX_LEASE_TTL_S = 86_400.0
MAX_TIME = 1e11


def check_id(value: Any, field: str) -> str:
    """A non-empty printable identifier of at most :data:`MAX_ID_LENGTH` characters."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{field} must be a non-empty string (got {value!r})", field=field)
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(
            f"{field} is {len(value)} characters long; ids are at most {MAX_ID_LENGTH}: use a "
            "shorter id (e.g. a hash of the long one)", field=field)
    if not value.isprintable():
        raise InvalidArgument(
            f"{field} {value!r} contains control characters (NUL, newline, ...); ids are "
            "printable text", field=field)
    return value


def check_count(value: Any, field: str, *, maximum: int = MAX_COUNT) -> int:
    """An integer in ``[0, maximum]`` (``True``/``False`` are refused: they are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{field} must be an integer (got {value!r})", field=field)
    if not 0 <= value <= maximum:
        raise InvalidArgument(f"{field} must be between 0 and {maximum} (got {value})",
                              field=field)
    return value


def check_tokens(value: Any, field: str) -> int:
    """A token count in ``[0, MAX_TOKENS]``."""
    return check_count(value, field, maximum=MAX_TOKENS)


def tokens_in_range(value: Any) -> bool:
    """Whether a provider-reported token count can be stored (never raises)."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and 0 <= value <= MAX_TOKENS)


def check_amount(value: Any, field: str) -> Decimal:
    """Money: a finite decimal in ``[0, MAX_AMOUNT]`` from a Decimal, int, float or string."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{field} must be a number (got {value!r})", field=field)
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError, TypeError):
        raise InvalidArgument(
            f"{field} must be a decimal amount such as 0.25 or '0.25' (got {value!r})",
            field=field) from None
    if not d.is_finite():
        raise InvalidArgument(f"{field} must be finite (got {value!r})", field=field)
    if d < 0 or d > MAX_AMOUNT:
        raise InvalidArgument(f"{field} must be between 0 and {MAX_AMOUNT} (got {d})",
                              field=field)
    return d


def amount_in_range(value: Any) -> bool:
    """Whether a provider-reported cost can be stored (never raises)."""
    try:
        check_amount(value, "cost")
    except InvalidArgument:
        return False
    return True


def check_seconds(value: Any, field: str, *, maximum: float = math.inf,
                  positive: bool = False) -> float:
    """A finite duration in ``[0, maximum]`` (``(0, maximum]`` with ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{field} must be a number of seconds (got {value!r})",
                              field=field)
    v = float(value)
    if not math.isfinite(v):
        raise InvalidArgument(f"{field} must be finite (got {value!r})", field=field)
    if v < 0 or (positive and v == 0) or v > maximum:
        low = "(0" if positive else "[0"
        raise InvalidArgument(f"{field} must be in {low}, {maximum:g}] seconds (got {v:g})",
                              field=field)
    return v


def check_time(value: Any, field: str) -> float:
    """A finite epoch time in ``[0, MAX_TIME)``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{field} must be epoch seconds (got {value!r})", field=field)
    v = float(value)
    if not math.isfinite(v) or not 0 <= v < MAX_TIME:
        raise InvalidArgument(
            f"{field} must be finite epoch seconds between 0 and {MAX_TIME:g} (got {value!r})",
            field=field)
    return v


def canonical_decimal(d: Decimal) -> Decimal:
    """``1``, ``1.0`` and ``1.00`` as one value (so equal amounts hash alike)."""
    n = d.normalize()
    return Decimal(format(n, "f"))


__all__ = [
    "MAX_AMOUNT",
    "MAX_COUNT",
    "MAX_ID_LENGTH",
    "MAX_LEASE_TTL_S",
    "MAX_TIME",
    "MAX_TOKENS",
    "amount_in_range",
    "canonical_decimal",
    "check_amount",
    "check_count",
    "check_id",
    "check_seconds",
    "check_time",
    "check_tokens",
    "tokens_in_range",
]
