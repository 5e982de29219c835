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
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Any, TypeVar

from ledger.errors import InvalidArgument

MAX_ID_LENGTH = 200
MAX_COUNT = 10**9
MAX_TOKENS = 10**15
MAX_AMOUNT = Decimal(10**12)
MAX_LEASE_TTL_S = 86_400.0
#: The default of ``lease_margin_s`` (seconds): processes whose clocks differ by less than this
#: never both believe they may use one capacity slot (``docs/operations.md``).
DEFAULT_LEASE_MARGIN_S = 0.5
MAX_FENCE = 2**62  # a lease's fence: a bigint on both backends, with room to grow
MAX_TIME = 1e11


def id_problem(value: Any) -> tuple[str, str] | None:
    """What is wrong with ``value`` as an identifier, as ``(problem, fix)``; ``None`` if fine.

    The one definition of the id alphabet, shared by :func:`check_id` and the models' ``Id``
    fields: 1 to :data:`MAX_ID_LENGTH` characters, not only whitespace, every character
    printable (``str.isprintable``: no NUL, newline, other control or format characters,
    no lone surrogates) — what both backends store and compare alike.
    """
    if not isinstance(value, str):
        return (f"is not a string (got {type(value).__name__})",
                "pass a non-empty string such as 'run-1'")
    if not value.strip():
        return "is empty", "pass a non-empty string such as 'run-1'"
    if len(value) > MAX_ID_LENGTH:
        return (f"is {len(value)} characters long; ids are at most {MAX_ID_LENGTH}",
                "use a shorter id (e.g. a hash of the long one)")
    if not value.isprintable():
        return ("contains control characters (NUL, newline, ...)",
                "use printable text only")
    return None


def text_problem(value: Any, maximum: int) -> tuple[str, str] | None:
    """What is wrong with ``value`` as a short stored text (a name, a reason), or ``None``.

    A short text is a string of at most ``maximum`` printable characters (it may be empty).
    """
    if not isinstance(value, str):
        return f"is not a string (got {type(value).__name__})", "pass a string"
    if len(value) > maximum:
        return (f"is {len(value)} characters long", f"pass at most {maximum} characters")
    if not value.isprintable():
        return ("contains control characters (NUL, newline, ...)",
                "use printable text only")
    return None


def check_id(value: Any, field: str) -> str:
    """A non-empty printable identifier of at most :data:`MAX_ID_LENGTH` characters."""
    found = id_problem(value)
    if found is not None:
        problem, fix = found
        raise InvalidArgument(f"{field} {_short(value)} {problem}; {fix}", field=field)
    return value  # type: ignore[no-any-return]


def check_optional_id(value: Any, field: str) -> str | None:
    """``None``, or an identifier as :func:`check_id` accepts it."""
    return None if value is None else check_id(value, field)


def check_text(value: Any, field: str, *, maximum: int = 200) -> str:
    """A short printable text (a reason, a name) of at most ``maximum`` characters."""
    found = text_problem(value, maximum)
    if found is not None:
        problem, fix = found
        raise InvalidArgument(f"{field} {_short(value)} {problem}; {fix}", field=field)
    return value  # type: ignore[no-any-return]


def check_bool(value: Any, field: str) -> bool:
    """``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field} must be True or False (got {_short(value)})",
                              field=field)
    return value


E = TypeVar("E", bound=Enum)


def check_choice(value: Any, choices: type[E], field: str,
                 allowed: Iterable[E] | None = None) -> E:
    """One of an enum's values (the member or its string), else InvalidArgument listing the choices.

    ``allowed`` narrows the choices (e.g. the states a Run ends in).
    """
    options = list(allowed) if allowed is not None else list(choices)
    member: E | None = None
    if isinstance(value, choices):
        member = value
    elif isinstance(value, str):
        member = next((m for m in choices if m.value == value), None)
    if member is None or member not in options:
        names = ", ".join(repr(m.value) for m in options)
        raise InvalidArgument(f"{field} {_short(value)} is not one of the choices; pass one of "
                              f"{names}", field=field, choices=[m.value for m in options])
    return member


def check_ids(value: Any, field: str, *, maximum: int = 10_000) -> list[str]:
    """A list (or tuple) of identifiers, at most ``maximum`` of them, else InvalidArgument.

    A lone string is refused: it would be read as its characters.
    """
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple | set | frozenset):
        raise InvalidArgument(f"{field} must be a list of ids (got {_short(value)})",
                              field=field)
    items = list(value)
    if len(items) > maximum:
        raise InvalidArgument(f"{field} has {len(items)} ids; pass at most {maximum}",
                              field=field)
    return [check_id(v, f"{field}[{i}]") for i, v in enumerate(items)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_count(value: Any, field: str, *, maximum: int = MAX_COUNT) -> int:
    """An integer in ``[0, maximum]`` (``True``/``False`` are refused: they are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{field} must be an integer (got {_short(value)}); pass an "
                              f"integer between 0 and {maximum}", field=field)
    if not 0 <= value <= maximum:
        raise InvalidArgument(f"{field} is out of range (got {_short(value)}); pass an "
                              f"integer between 0 and {maximum}", field=field)
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
    fix = f"pass a decimal amount between 0 and {MAX_AMOUNT} such as Decimal('0.25') or '0.25'"
    if isinstance(value, bool) or not isinstance(value, Decimal | int | float | str):
        raise InvalidArgument(f"{field} is not an amount (got {_short(value)}); {fix}",
                              field=field)
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except (InvalidOperation, ValueError, TypeError):
        raise InvalidArgument(f"{field} is not an amount (got {_short(value)}); {fix}",
                              field=field) from None
    if not d.is_finite():
        raise InvalidArgument(f"{field} must be finite (got {_short(value)}); {fix}",
                              field=field)
    if d < 0 or d > MAX_AMOUNT:
        raise InvalidArgument(f"{field} is out of range (got {_short(value)}); {fix}",
                              field=field)
    return d


def amount_in_range(value: Any) -> bool:
    """Whether a provider-reported cost can be stored (never raises)."""
    try:
        check_amount(value, "cost")
    except InvalidArgument:
        return False
    return True


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        v = float(value)
    except OverflowError:  # an int beyond a float's range
        return None
    return v if math.isfinite(v) else None


def check_seconds(value: Any, field: str, *, maximum: float = math.inf,
                  positive: bool = False) -> float:
    """A finite duration in ``[0, maximum]`` (``(0, maximum]`` with ``positive``)."""
    low = "above 0" if positive else "from 0"
    fix = f"pass a finite number of seconds {low}" + (
        f" up to {maximum:g}" if math.isfinite(maximum) else "")
    v = _finite(value)
    if v is None or v < 0 or (positive and v == 0) or v > maximum:
        raise InvalidArgument(f"{field} is not a usable duration (got {_short(value)}); {fix}",
                              field=field)
    return v


def check_time(value: Any, field: str) -> float:
    """A finite epoch time in ``[0, MAX_TIME)``."""
    v = _finite(value)
    if v is None or not 0 <= v < MAX_TIME:
        raise InvalidArgument(
            f"{field} is not a usable time (got {_short(value)}); pass finite epoch seconds "
            f"(a float such as clock.now() + 60) between 0 and {MAX_TIME:g}", field=field)
    return v


def check_optional_time(value: Any, field: str) -> float | None:
    """``None``, or a time as :func:`check_time` accepts it."""
    return None if value is None else check_time(value, field)


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
    "check_bool",
    "check_choice",
    "check_count",
    "check_id",
    "check_ids",
    "check_optional_id",
    "check_optional_time",
    "check_seconds",
    "check_text",
    "check_time",
    "check_tokens",
    "id_problem",
    "text_problem",
    "tokens_in_range",
]
