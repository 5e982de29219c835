"""Ledger-wide reconciliation: check every stored invariant over the whole ledger.

Usable by operators (``ledger.ops.reconcile.reconcile(ledger)``) and by the soak test. It reads one
consistent snapshot and reports figures and violations; it writes nothing. Checks:

* every Attempt has exactly its own Debit, with the same hold; states agree (dispatching and
  unknown keep a reserved hold, succeeded is posted, failed is posted or voided, rejected is
  voided); a posted amount never exceeds its hold and equals the settled cost;
* each Run's counters equal the sums of its debits (reserved, posted) and its non-rejected
  Attempts (calls); reserved + posted + carved never exceed the cost budget; calls and retries
  stay within their allowances; children's budgets equal what the parent carved;
* attempt sequence numbers are 1..n per run (none lost, none duplicated); nothing was written
  under a fence above the run's;
* capacity slots are held only by dispatching Attempts, and live slots never exceed a group's
  limit;
* every Attempt recovery marked unknown carries its audit event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ledger.api.facade import Ledger


@dataclass
class Reconciliation:
    runs: int
    attempts: int
    by_state: dict[str, int]
    debits: dict[str, int]
    recoveries: int
    unknown_events: int
    violations: list[str] = field(default_factory=list)
    cost_over_hold: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No violation, and no Attempt that cost more than it held."""
        return not self.violations and not self.cost_over_hold

    def to_json(self) -> dict[str, Any]:
        return {"runs": self.runs, "attempts": self.attempts, "by_state": self.by_state,
                "debits": self.debits, "recoveries": self.recoveries,
                "unknown_events": self.unknown_events, "violations": self.violations,
                "cost_over_hold": self.cost_over_hold}

    def summary(self) -> str:
        states = dict(sorted(self.by_state.items()))
        return (f"runs: {self.runs}, attempts: {self.attempts} {states}"
                f", debits: {dict(sorted(self.debits.items()))}, recoveries: {self.recoveries}, "
                f"violations: {len(self.violations)}, cost_over_hold: {len(self.cost_over_hold)}")


def reconcile(ledger: Ledger) -> Reconciliation:
    """The ledger's books: runs, attempts by state, debits, recoveries and any violation."""
    from ledger.api.facade import Ledger as _Ledger
    from ledger.api.facade import storage_of
    from ledger.errors import InvalidArgument

    if not isinstance(ledger, _Ledger):
        raise InvalidArgument("ledger must be a ledger.Ledger (an AsyncLedger's is .sync)",
                              field="ledger")
    store = storage_of(ledger)
    fig = store.reconcile_figures(ledger.now())
    ev = store.event_counts(["recover", "unknown"])
    return Reconciliation(runs=fig.runs, attempts=fig.attempts, by_state=fig.by_state,
                          debits=fig.debits, recoveries=ev["recover"],
                          unknown_events=ev["unknown"], violations=fig.violations,
                          cost_over_hold=fig.cost_over_hold)


__all__ = ["Reconciliation", "reconcile"]
