"""Checks at the facade's boundary: every public argument, before anything is read or written.

Each check returns the value as the ledger uses it or raises
:class:`~ledger.errors.InvalidArgument` (an :class:`~ledger.errors.ArgumentMismatch` for a
misspelt keyword) naming the field and the fix, so both backends refuse the same inputs the
same way. The rules that decide what a write *means* live in :mod:`ledger.decide`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from ledger.domain.bounds import (
    MAX_FENCE,
    check_choice,
    check_optional_id,
    check_optional_time,
    check_seconds,
    check_text,
    check_tokens,
    id_problem,
)
from ledger.domain.facts import Category
from ledger.domain.records import AttemptState, Lease
from ledger.domain.validation import check_known_keys, validate_as
from ledger.errors import InvalidArgument

MAX_EVENT_KIND = 32


MAX_HASH = 80


M = TypeVar("M", bound=BaseModel)


def as_model(cls: type[M], value: Any, field: str) -> M:
    """``value`` (an instance or a mapping of its fields) as ``cls``.

    A problem is InvalidArgument naming the field path under ``field`` (``budget.max_cost``,
    ``plan[0].group``).
    """
    return validate_as(cls, dict(value) if isinstance(value, Mapping) else value, field)


def audit_data(value: Any, field: str) -> dict[str, Any]:
    """Audit data: a mapping with string keys (its values are stored as JSON, redacted)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidArgument(f"{field} must be a mapping with string keys (got "
                              f"{type(value).__name__}); pass a dict such as {{'why': '...'}}",
                              field=field)
    return dict(value)


def event_kind(value: Any, field: str, maximum: int) -> str:
    """An audit event's kind: a non-empty short text of at most ``maximum`` characters."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{field} must be a non-empty string; pass a short name such as "
                              "'note'", field=field)
    return check_text(value, field, maximum=maximum)


def events_arg(events: Sequence[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """A list of ``(kind, data)`` audit events, each checked as :func:`event_kind` and data."""
    if isinstance(events, str | bytes | Mapping) or not isinstance(events, Sequence):
        raise InvalidArgument("events must be a list of (kind, data) pairs", field="events")
    out = []
    for i, item in enumerate(events):
        try:
            kind, data = item
        except (TypeError, ValueError):
            raise InvalidArgument(f"events[{i}] must be a (kind, data) pair; pass "
                                  "('note', {...})", field=f"events[{i}]") from None
        out.append((event_kind(kind, f"events[{i}]", MAX_EVENT_KIND),
                    audit_data(data, f"events[{i}]")))
    return out


def hash_arg(value: Any, field: str, *, optional: bool = False) -> str | None:
    """A content hash string (``None`` allowed with ``optional``), else InvalidArgument."""
    if value is None and optional:
        return None
    if (not isinstance(value, str) or not 0 < len(value) <= MAX_HASH
            or not value.isprintable()):
        raise InvalidArgument(f"{field} must be a content hash string of at most {MAX_HASH} "
                              "printable characters; pass e.g. Envelope.hash", field=field)
    return value


ATTEMPT_FILTERS = ("route", "group", "state", "category", "since", "until", "limit", "cursor")


MAX_CURSOR = 300


def attempt_filters(filters: Mapping[str, Any]) -> dict[str, Any]:
    """The checked filters of an attempt listing (see :meth:`Ledger.attempts`)."""
    check_known_keys(filters, ATTEMPT_FILTERS, "an attempt filter")
    out = dict(filters)
    for name in ("route", "group"):
        out[name] = check_optional_id(out.get(name), name)
    if out.get("state") is not None:
        out["state"] = check_choice(out["state"], AttemptState, "state").value
    if out.get("category") is not None:
        out["category"] = check_choice(out["category"], Category, "category").value
    for name in ("since", "until"):
        out[name] = check_optional_time(out.get(name), name)
    if "limit" in out:
        out["limit"] = limit_arg(out["limit"])
    if out.get("cursor") is not None:
        out["cursor"] = check_text(out["cursor"], "cursor", maximum=MAX_CURSOR)
    return {k: v for k, v in out.items() if v is not None}


def limit_arg(value: Any, field: str = "limit") -> int:
    """A page size: an integer from 1 to 10 000, else InvalidArgument."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
        raise InvalidArgument(f"{field} must be an integer from 1 to 10000 (got {value!r}); "
                              "pass e.g. 100 and page on with next_cursor", field=field)
    return value


def optional_tokens(value: Any, field: str) -> int | None:
    """A token count, or ``None``."""
    return None if value is None else check_tokens(value, field)


def token_details(prompt: int | None, completion: int | None, cached: Any,
                  reasoning: Any) -> tuple[int | None, int | None]:
    """``cached_tokens`` and ``reasoning_tokens`` as a settle records them.

    Counts within the totals they are parts of (the prompt's, the completion's), when those
    are given.
    """
    out = []
    for value, field, total, of in ((cached, "cached_tokens", prompt, "prompt_tokens"),
                                    (reasoning, "reasoning_tokens", completion,
                                     "completion_tokens")):
        n = optional_tokens(value, field)
        if n is not None and total is not None and n > total:
            raise InvalidArgument(
                f"{field} ({n}) exceeds {of} ({total}); it counts a part of {of}, so pass at "
                f"most {total}", field=field)
        out.append(n)
    return out[0], out[1]


#: The longest time to a first byte or token a settle accepts (a day: no call waits longer).
MAX_SEND_S = 86_400.0


def send_times(first_byte_s: Any, first_token_s: Any) -> tuple[float | None, float | None]:
    """The seconds from an Attempt's begin to its first byte and first token, checked.

    Finite, from 0 to a day, and the first token not before the first byte.
    """
    byte = (None if first_byte_s is None
            else check_seconds(first_byte_s, "first_byte_s", maximum=MAX_SEND_S))
    token = (None if first_token_s is None
             else check_seconds(first_token_s, "first_token_s", maximum=MAX_SEND_S))
    if byte is not None and token is not None and token < byte:
        raise InvalidArgument(
            f"first_token_s ({token:g}) is before first_byte_s ({byte:g}); content comes after "
            "the response's first byte: pass times measured from the begin", field="first_token_s")
    return byte, token


def check_opening(url: Any, clock: Any, executor_id: Any) -> None:
    """Refuse (InvalidArgument) what :meth:`~ledger.Ledger.open` cannot open with."""
    if not isinstance(url, str):
        raise InvalidArgument("url must be a SQLite file path or a database URL string; pass "
                              "e.g. 'ledger.db' or 'postgresql://host/db'", field="url")
    if clock is not None and not callable(getattr(clock, "now", None)):
        raise InvalidArgument("clock must have a now() method returning epoch seconds; pass "
                              "ledger.SystemClock() or ledger.ManualClock(t)", field="clock")
    check_optional_id(executor_id, "executor_id")


def lease_arg(lease: Any, field: str = "lease") -> Lease:
    """``lease`` if it is a Lease as :meth:`~ledger.Ledger.acquire_lease` returns it.

    A hand-built one must still fit the columns it is compared with (so both backends refuse the
    same leases).
    """
    if not isinstance(lease, Lease):
        raise InvalidArgument(f"{field} must be a ledger.Lease; pass what acquire_lease "
                              "returned", field=field)
    if (id_problem(lease.run_id) or id_problem(lease.executor)
            or isinstance(lease.fence, bool) or not isinstance(lease.fence, int)
            or not 0 <= lease.fence <= MAX_FENCE
            or isinstance(lease.expires_at, bool)
            or not isinstance(lease.expires_at, int | float)):
        raise InvalidArgument(f"{field} is not a lease the ledger granted (run id, executor, "
                              "fence or expiry out of range); pass what acquire_lease returned",
                              field=field)
    return lease


def keyless_arg(value: Any, plan: Sequence[Any]) -> frozenset[str]:
    """``keyless_ok``: the route and profile ids of ``plan`` allowed to lack a key.

    ``True`` allows every route; ``False`` or an empty collection none. An id that is neither a
    route nor a credential profile of the plan is refused (a typo would silently check the key
    it meant to excuse).
    """
    if value is True:
        return frozenset(r.id for r in plan)
    if value is False:
        return frozenset()
    if (isinstance(value, str | bytes | Mapping)
            or not isinstance(value, Sequence | set | frozenset)
            or not all(isinstance(v, str) for v in value)):
        raise InvalidArgument("keyless_ok must be a set of route ids (or credential profile "
                              "ids) of the plan, or True for every route; pass e.g. "
                              "{'local-llama'}", field="keyless_ok")
    known = {r.id for r in plan} | {p.id for r in plan for p in r.profiles}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidArgument(
            f"keyless_ok names {', '.join(repr(u) for u in unknown)}, which is no route or "
            f"credential profile of the plan ({', '.join(repr(r.id) for r in plan)}); pass ids "
            "of the plan's routes", field="keyless_ok", unknown=unknown)
    return frozenset(value)


__all__ = [
    "ATTEMPT_FILTERS",
    "MAX_CURSOR",
    "MAX_EVENT_KIND",
    "MAX_HASH",
    "as_model",
    "attempt_filters",
    "audit_data",
    "check_opening",
    "event_kind",
    "events_arg",
    "hash_arg",
    "keyless_arg",
    "lease_arg",
    "limit_arg",
    "optional_tokens",
]

