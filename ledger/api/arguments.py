"""The facade's argument types: what a public method's annotations say it accepts.

Each is a type of :mod:`ledger.domain.validation`'s kind, read by :func:`~ledger.domain
.validation.checked` like every other: the value as the ledger uses it, or
:class:`~ledger.errors.InvalidArgument` naming the field and the fix. The rules that decide what
a write *means* live in :mod:`ledger.decide`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Annotated, Any

from typing_extensions import TypedDict

from ledger.clock import Clock
from ledger.decide.admission import Admission
from ledger.domain.bounds import (
    DEFAULT_FOLD_AFTER_S,
    MAX_FOLD_AFTER_S,
    MAX_LAG_S,
    MAX_LEASE_TTL_S,
)
from ledger.domain.facts import Category
from ledger.domain.records import AttemptState
from ledger.domain.validation import (
    Id,
    Problem,
    Secrets,
    Time,
    as_id,
    duration,
    instance,
    integers,
    listing,
    methods,
    one_of,
    rule,
    text,
)
from ledger.domain.values import Route
from ledger.errors import InvalidArgument

MAX_EVENT_KIND = 32
MAX_HASH = 80
MAX_CURSOR = 300


@rule
def content_hash(value: Any) -> str:
    """A content hash (``Envelope.hash``, ``Part.content_hash``)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_HASH or not value.isprintable():
        raise Problem("is not a content hash", f"pass a content hash string of at most "
                      f"{MAX_HASH} printable characters, e.g. Envelope.hash")
    return value


#: The least age :meth:`ledger.Ledger.drop_history` takes: one day, so a slip of the unit
#: (``90`` meant as days) cannot drop a month that just ended.
MIN_RETENTION_S = 86400.0
#: The most: 36 500 days (100 years), older than any ledger's history. A larger age is a slip
#: (``9999999d``), and its cut-off would be before any year a date can be written in.
MAX_RETENTION_S = 36500 * 86400.0


@rule
def retention_age(value: Any) -> float:
    """How old history must be to go: seconds from a day to 36 500 days (the bounds above)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not MIN_RETENTION_S <= float(value) <= MAX_RETENTION_S:
        raise Problem("is not a retention age", "pass seconds from 86400 (one day) to "
                      "3153600000 (36500 days), e.g. 90 * 86400 for 90 days")
    return float(value)


#: A part's content hash as the ledger makes it (``Part.content_hash``): ``sha256:`` and 64
#: lowercase hex digits.
PART_HASH = re.compile(r"sha256:[0-9a-f]{64}")


@rule
def part_hash(value: Any) -> str:
    """A part's content hash (``Part.content_hash``), the form provenance is looked up by."""
    if not isinstance(value, str) or not PART_HASH.fullmatch(value):
        raise Problem("is not a part's content hash (sha256: and 64 lowercase hex digits)",
                      "pass each answer part's Part.content_hash, e.g. "
                      "[part.content_hash for part in parts]")
    return value


# Strict as the stored form is sorted: NaN, an infinity, an object or a mapping mixing key
# types has no JSON text the audit could read back.
_EVENT_JSON = json.JSONEncoder(sort_keys=True, allow_nan=False)
_NOT_JSON_FIX = ("pass only strings, finite numbers, booleans, None, lists and mappings with "
                 "string keys (an amount as str(amount))")


def _not_json(value: Any) -> bool:
    try:
        _EVENT_JSON.encode(value)
    except (TypeError, ValueError, RecursionError):
        return True
    return False


def _where_not_json(value: Any, at: str = "", depth: int = 0) -> str:
    """The path below ``value`` of the first entry that is not JSON data (``.v``, ``[2]``)."""
    if depth > 32:  # a cycle, or nesting no caller means: the deepest path found says enough
        return at
    items: Sequence[tuple[str, Any]] = ()
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            return at
        items = [(f".{k}", v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    for step, item in items:
        if _not_json(item):
            return _where_not_json(item, at + step, depth + 1)
    return at


@rule
def audit_data(value: Any) -> dict[str, Any]:
    """An audit event's data: a string-keyed mapping of JSON data (stored redacted)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise Problem("is not a mapping with string keys", "pass a dict such as {'why': '...'}")
    # Refused, not stored as its str(): "<object object at 0x...>" records nothing, and a NaN
    # would make the stored text no JSON.
    if _not_json(value):
        raise Problem("is not JSON data", _NOT_JSON_FIX, at=_where_not_json(value))
    return dict(value)


event_kind = text(MAX_EVENT_KIND, empty=False, fix="pass a non-empty short name such as 'note'")


@rule
def _event(item: Any) -> tuple[str, dict[str, Any]]:
    try:
        kind, data = item
    except (TypeError, ValueError):
        raise Problem("is not a (kind, data) pair", "pass ('note', {...})") from None
    kind = event_kind(kind)
    try:
        return kind, audit_data(data)
    except Problem as p:
        raise Problem(p.problem, p.fix, at=f".data{p.at}") from None


@rule
def _route(value: Any) -> str | Route:
    if isinstance(value, Route):
        return value
    if not isinstance(value, str):
        raise Problem("is not a route id or a ledger.Route",
                      "pass a route id or a ledger.Route of the Run's plan")
    return as_id(value)


Hash = Annotated[str, content_hash]
"""A content hash (``Envelope.hash``, ``Part.content_hash``)."""
Hashes = Annotated[Sequence[str], listing(content_hash, "content hashes",
                                          "pass e.g. [part.content_hash for part in parts]")]
"""A list of content hashes."""
PartHashList = Annotated[Sequence[str], listing(part_hash, "part content hashes",
                                              "pass e.g. [part.content_hash for part in parts]")]
"""A list of parts' content hashes (``Part.content_hash``)."""
AuditData = Annotated[Mapping[str, Any], audit_data]
"""An audit event's data: a mapping with string keys (stored as JSON, redacted)."""
EventKind = Annotated[str, event_kind]
"""An audit event's kind: a short name such as ``note``."""
Events = Annotated[Sequence[tuple[str, Mapping[str, Any]]],
                   listing(_event, "(kind, data) pairs", "pass e.g. [('note', {...})]")]
"""Audit events written with a begin or settle: ``(kind, data)`` pairs."""
RouteRef = Annotated[str | Route, _route]
"""A route of a Run's plan: its id, or the frozen :class:`~ledger.Route` itself."""
#: The longest time to a first byte or token a settle accepts (a day: no call waits longer).
MAX_SEND_S = 86_400.0
SendTime = Annotated[float, duration(MAX_SEND_S)]
"""Seconds from an Attempt's begin to its first byte or token: finite, from 0 to a day."""
LeaseTtl = Annotated[float, duration(MAX_LEASE_TTL_S, positive=True)]
"""How long a lease lasts: above 0, at most 86 400 s (and above the lease margin)."""
RollupLag = Annotated[float, duration(MAX_LAG_S, fix=(
    f"pass seconds from 0 to {MAX_LAG_S:.0f} ({MAX_LAG_S / 86_400:g} days), e.g. 300 (the "
    "default) or 3600"))]
"""How long after its end an hour is rolled up: seconds from 0 to a week."""
FoldAfter = Annotated[float, duration(MAX_FOLD_AFTER_S, fix=(
    f"pass seconds from 0 to {MAX_FOLD_AFTER_S:.0f} ({MAX_FOLD_AFTER_S / 86_400:g} days), e.g. "
    f"{DEFAULT_FOLD_AFTER_S:.0f} ({DEFAULT_FOLD_AFTER_S / 86_400:g} days, the default), or None "
    "to fold nothing"))]
"""How long after its end a day is folded: seconds from 0 to 366 days."""
Limit = Annotated[int, integers(1, 10_000, "pass an integer from 1 to 10000, e.g. 100, and "
                                "page on with next_cursor")]
"""A page size."""
Cursor = Annotated[str, text(MAX_CURSOR)]
"""A page's ``next_cursor``."""


ClockArg = Annotated[Clock, methods("now", fix="pass ledger.SystemClock() or "
                                     "ledger.ManualClock(t)")]
"""Where a ledger reads time: an object with ``now()`` returning epoch seconds."""
Url = Annotated[str, instance(str, "a database URL string", "pass a SQLite file path or a "
                              "database URL string, e.g. 'ledger.db' or 'postgresql://host/db'")]
"""A SQLite file path or a database URL."""


class SessionOptions(Admission, total=False):
    """What :meth:`~ledger.Ledger.run` takes: the Run's terms and the session's own options.

    The terms are :class:`~ledger.decide.admission.Admission`'s.

    Attributes:
        lease_ttl_s: The lease the session takes and keeps renewed (above the lease margin, at
            most 86 400 s; default 30).
        adapter: A :class:`~ledger.adapters.SyncAdapter` (an
            :class:`~ledger.adapters.HttpAdapter` for an :class:`~ledger.AsyncLedger`) to send
            with (default: one of the session's own, closed with it).
        secrets: The secret provider of that default adapter (not with ``adapter``).
    """

    lease_ttl_s: LeaseTtl
    adapter: Any
    secrets: Secrets | None


def attempt_query(filters: AttemptFilters) -> dict[str, Any]:
    """Validated attempt filters as the storage query takes them (choices as their values).

    An empty window (``until`` before ``since``) is refused, as by every audit query: it is a
    caller's mistake, not a question whose answer is "nothing".
    """
    since, until = filters.get("since"), filters.get("until")
    if since is not None and until is not None and until < since:
        raise InvalidArgument("until is before since; pass since <= until", field="until")
    return {k: v.value if isinstance(v, Enum) else v for k, v in filters.items() if v is not None}


class AttemptFilters(TypedDict, total=False):
    """The filters of an attempt listing (:meth:`~ledger.Ledger.attempts`)."""

    route: Id | None
    group: Id | None
    state: Annotated[AttemptState | str, one_of(AttemptState)] | None
    category: Annotated[Category | str, one_of(Category)] | None
    since: Time | None
    until: Time | None
    limit: Limit
    cursor: Cursor | None


__all__ = [
    "MAX_CURSOR",
    "MAX_EVENT_KIND",
    "MAX_HASH",
    "MAX_SEND_S",
    "MIN_RETENTION_S",
    "PART_HASH",
    "AttemptFilters",
    "AuditData",
    "ClockArg",
    "Cursor",
    "EventKind",
    "Events",
    "Hash",
    "Hashes",
    "LeaseTtl",
    "Limit",
    "PartHashList",
    "RouteRef",
    "SendTime",
    "SessionOptions",
    "Url",
    "attempt_query",
    "audit_data",
    "content_hash",
    "event_kind",
    "part_hash",
]
