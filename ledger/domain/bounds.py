"""The documented ranges of every number and identifier the ledger stores.

Checked at the public API boundary by the types of :mod:`ledger.domain.validation`, so both
backends refuse the same inputs with the same typed error (:class:`~ledger.errors.InvalidArgument`
naming the field) and nothing out of range ever reaches a column: an overflow inside a
transaction would turn a recorded success into a crash.

=====================  ==========================================================
what                   range
=====================  ==========================================================
ids (run, attempt, …)  1 to 200 characters, printable, no NUL or control characters
health keys            1 to 609 characters, printable: a route or profile id, or
                       ``provider:`` and a provider name (an id) case-folded
new run/attempt ids    also not ``.`` or ``..`` (a URL path cannot carry them)
counts (calls, …)      integers 0 to 10^9 (``bool`` is not an integer here)
tokens                 integers 0 to 10^15
money                  finite decimals 0 to 10^12 currency units (stored as micro-units)
durations              finite seconds; a lease TTL is in (0, 86 400]
times (deadlines, …)   finite epoch seconds in [0, 10^11)
a Run's labels         at most 64 (keys ids, values texts of at most 200 characters)
recipients             1 to 2,048 characters, printable (a grant's keys, a route's
                       recipient): a forwarding server is named by its URL
=====================  ==========================================================
"""

from __future__ import annotations

from decimal import Decimal

MAX_ID_LENGTH = 200
#: The longest health key: ``provider:`` and a provider name of :data:`MAX_ID_LENGTH` characters
#: case-folded (``ledger.decide.health.provider_key``). Folding turns one character into at
#: most three (U+0390 into three), so 9 + 3 * 200; route and profile ids are shorter.
MAX_HEALTH_KEY_LENGTH = 9 + 3 * MAX_ID_LENGTH
#: The longest recipient name (a grant's keys, ``Route.recipient``). A server a request
#: parameter makes the provider forward to (an MCP server) is a recipient named by its URL,
#: and 2,048 characters is the URL length browsers, proxies and CDNs commonly accept; recipients
#: are stored only inside the Run's frozen JSON (plan, grant), never in a sized column.
MAX_RECIPIENT_LENGTH = 2048
MAX_COUNT = 10**9
MAX_TOKENS = 10**15
MAX_AMOUNT = Decimal(10**12)
MAX_LEASE_TTL_S = 86_400.0
#: The default of ``lease_margin_s`` (seconds): processes whose clocks differ by less than this
#: never both believe they may use one capacity slot (``docs/operations.md``).
DEFAULT_LEASE_MARGIN_S = 0.5
#: The default of ``fold_after`` (seconds): how long after its end a UTC day whose hours are all
#: rolled is folded into one set of roll-up rows (:meth:`ledger.Ledger.roll_up`). Eight days:
#: the dashboard's charts of up to a week, in buckets of whole hours that do not start at
#: midnight, keep reading hours; a longer chart's buckets are whole days. At ten million
#: attempts over 70 days this keeps every whole-history read under 100 ms
#: (docs/benchmarks.md), where 32 days left the totals at 111-119 ms.
DEFAULT_FOLD_AFTER_S = 8 * 86_400.0
#: The longest ``lag`` of :meth:`ledger.Ledger.roll_up` (``rollup --lag``): a week. The lag
#: keeps an hour still being settled from being rolled and undone again, which minutes do (a
#: later write undoes a roll-up anyway); a longer one only leaves the cheap sums unwritten
#: (36 500 days: nothing ever rolled or folded) and is a slip of the unit (an hour written in
#: milliseconds, 3600000, is 41 days).
MAX_LAG_S = 7 * 86_400.0
#: The longest ``fold_after`` of :meth:`ledger.Ledger.roll_up` (``rollup --fold-after``): 366
#: days. A fold keeps the totals' answers and only merges an old day's hours, so a longer wait
#: means no fold (``None``, ``never``, says so), and is a slip of the unit (the default 8 days
#: written in milliseconds, 691200000, is 8,000 days).
MAX_FOLD_AFTER_S = 366 * 86_400.0
MAX_FENCE = 2**62  # a lease's fence: a bigint on both backends, with room to grow
MAX_TIME = 1e11
#: The most labels a Run may carry. Every Attempt row copies the Run's labels (the audit totals
#: and splits budgets by them without a join), so an unbounded map would make each begin and
#: settle write its size again under the Run's lock; 64 leaves room for any grouping an audit
#: needs.
MAX_LABELS = 64


def canonical_decimal(d: Decimal) -> Decimal:
    """``1``, ``1.0`` and ``1.00`` as one value, and ``-0`` as ``0``: equal amounts hash alike."""
    # Decimal keeps the sign of a zero through normalize(), so "-0" would freeze (and hash) apart
    # from the "0" it equals, and a retried admission would conflict with itself.
    if d.is_zero():
        return Decimal(0)
    n = d.normalize()
    return Decimal(format(n, "f"))


__all__ = [
    "MAX_AMOUNT",
    "MAX_COUNT",
    "MAX_FENCE",
    "MAX_HEALTH_KEY_LENGTH",
    "MAX_ID_LENGTH",
    "MAX_LABELS",
    "MAX_LEASE_TTL_S",
    "MAX_RECIPIENT_LENGTH",
    "MAX_TIME",
    "MAX_TOKENS",
    "canonical_decimal",
]
