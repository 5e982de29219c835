"""health: one row per provider, however its name is capitalised

Under ``health.key: provider`` a route's health was kept under ``provider:`` and its provider
name exactly as the route spelled it, so routes of ``OpenAI`` and of ``openai`` kept two rows:
a 503 cooldown seen through one spelling left the other's routes open, and the fleet went on
calling a provider it knew was down. The key is now ``provider:`` and the name case-folded
(``ledger.decide.health.provider_key``), as ``health.exempt_providers``, ``base_s_by_provider``
and ``profiles.auth_order`` already match provider names. ``Route.provider`` itself is left as
written: it is part of every Run's frozen plan and of the hash that plan is checked against.

Existing ledgers: the rows of kind ``provider`` whose names fold alike become one row under the
folded key, and a lone row spelled otherwise is renamed to it; the new package never reads the
old spelling, so a cooldown or disable left there would otherwise be lost while it still ran.
The stricter state is kept: the merged row is the one that stays dark the longest (a disable
before a cooldown ending at the same time, then the higher error count, then the later write),
with its counters, when its outage was counted and when they reset; it takes the later cooldown
end, the later disable (with its reason) and the latest use and probe of all of them. Its
darkness then ends with that row's, and that row's reset time is never before its darkness
ends, so the reset cannot clear early what was taken from the others. The other rows' counters
are not added to its: the spellings often counted one outage twice, and the sum would lengthen
the next cooldown past what one row would have reached.

It reads ``health`` once (a row per route, profile or provider that ever failed or was
probed) and rewrites only the provider rows spelled otherwise than folded.
The downgrade copies each merged row back to the spelling its ``provider`` column records when
no row has that key, so the older package still finds its routes' darkness under the spelling
the row was first written by; routes of another spelling start healthy there, as they did.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

# How the ledger spells a provider's key (ledger.decide.health.provider_key), restated: a
# migration must not change when the package does.
_PREFIX = "provider:"

_health = sa.table(
    "health",
    *(sa.column(name) for name in (
        "key", "kind", "provider", "cooldown_until", "disabled_until", "disabled_reason",
        "error_count", "failure_counts", "last_failure_at", "counted_at", "last_used",
        "last_probe_at", "reset_at", "recent_failures", "updated_at")),
)


def _folded(key: str) -> str:
    return _PREFIX + key[len(_PREFIX):].casefold()


def _latest(rows: list[dict[str, Any]], column: str) -> Any:
    return max((r[column] for r in rows if r[column] is not None), default=None)


def _dark_until(row: dict[str, Any]) -> float:
    ends = [t for t in (row["cooldown_until"], row["disabled_until"]) if t is not None]
    return max(ends) if ends else float("-inf")


def _merged(key: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for ``rows``, the provider rows whose names fold to ``key``'s."""
    base = max(rows, key=lambda r: (_dark_until(r), r["disabled_until"] is not None,
                                    r["error_count"], r["updated_at"], r["key"]))
    out = {**base, "key": key, "kind": "provider",
           "cooldown_until": _latest(rows, "cooldown_until"),
           "last_used": _latest(rows, "last_used"),
           "last_probe_at": _latest(rows, "last_probe_at"),
           "updated_at": _latest(rows, "updated_at")}
    disabled = [r for r in rows if r["disabled_until"] is not None]
    if disabled:
        # A disable wins: the later one, with the reason it was written with.
        last = max(disabled, key=lambda r: (r["disabled_until"], r["key"]))
        out.update(disabled_until=last["disabled_until"], disabled_reason=last["disabled_reason"])
    return out


def upgrade() -> None:
    conn = op.get_bind()
    h = _health.c
    groups: dict[str, list[dict[str, Any]]] = {}
    others: set[str] = set()
    for row in conn.execute(sa.select(_health)).mappings():
        if row["kind"] == "provider" and row["key"].startswith(_PREFIX):
            groups.setdefault(_folded(row["key"]), []).append(dict(row))
        else:
            others.add(row["key"])
    for key, rows in sorted(groups.items()):
        if [r["key"] for r in rows] == [key] or key in others:
            # Already one row under its folded key; or a route or profile id is that key (the
            # package reads that row for both, as it did for the exact spelling), and stays.
            continue
        conn.execute(_health.delete().where(h.key.in_([r["key"] for r in rows])))
        conn.execute(_health.insert().values(**_merged(key, rows)))


def downgrade() -> None:
    conn = op.get_bind()
    h = _health.c
    rows = [dict(r) for r in conn.execute(sa.select(_health).where(h.kind == "provider"))
            .mappings()]
    have = {r["key"] for r in rows}
    for row in rows:
        spelt = _PREFIX + (row["provider"] or "")
        if row["provider"] and spelt not in have and _folded(spelt) == row["key"]:
            conn.execute(_health.insert().values(**{**row, "key": spelt}))
            have.add(spelt)

