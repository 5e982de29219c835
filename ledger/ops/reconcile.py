"""Ledger-wide reconciliation: check every stored invariant over the whole ledger.

Usable by operators (``ledger.ops.reconcile.reconcile(ledger)``, ``failover-ledger reconcile``) and
by the soak test. It reads the books in one read transaction (and the recovery event counts in a
second one) and reports figures and violations; it writes nothing. Checks:

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

Runs that retention may have trimmed (ended, admitted before the latest ``retention`` event's
cut-off, no open Attempt) are counted as ``trimmed_runs``: their sums and sequence numbers are
not checked against the Attempts and debits that remain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.domain.validation import checked, instance
from ledger.storage.recovery import RecoveryQueries


@dataclass
class Reconciliation:
    """The ledger's books, and what is wrong with them.

    Attributes:
        runs: How many Runs the ledger holds.
        attempts: How many Attempts.
        by_state: Attempts per state.
        debits: Debits per state.
        recoveries: Recovery takeovers recorded (``recover`` events).
        unknown_events: ``unknown`` events recorded.
        violations: Every broken invariant, one sentence each (empty when the books hold).
        cost_over_hold: Attempts whose reported cost exceeded their hold (the provider
            charged more than was reserved: worth a look, though no invariant broke).
        tokens_over_hold: Posted Attempts of Runs with a token budget whose reported tokens
            exceeded their token hold: the Run's ``tokens_used`` took at most the hold (as
            its spend takes at most the cost hold), so the usage past it counts against
            ``max_tokens`` nowhere but here; a begin with ``reserve_tokens=0`` held none.
        trimmed_runs: Ended Runs admitted before the latest retention's cut-off
            (:meth:`ledger.Ledger.drop_history`), some of whose Attempts may be gone: their
            counters are not summed against their Attempts and debits, nor their sequence
            numbers checked (every other check still holds them).
    """

    runs: int
    attempts: int
    by_state: dict[str, int]
    debits: dict[str, int]
    recoveries: int
    unknown_events: int
    violations: list[str] = field(default_factory=list)
    cost_over_hold: list[str] = field(default_factory=list)
    trimmed_runs: int = 0
    tokens_over_hold: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No violation.

        An Attempt that cost (or used tokens) more than it held is a figure, not a fault: a
        provider may bill past the hold, and the Run is posted at most the hold by design.
        """
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        """The books as JSON data."""
        return {"runs": self.runs, "attempts": self.attempts, "by_state": self.by_state,
                "debits": self.debits, "recoveries": self.recoveries,
                "unknown_events": self.unknown_events, "violations": self.violations,
                "cost_over_hold": self.cost_over_hold, "tokens_over_hold": self.tokens_over_hold,
                "trimmed_runs": self.trimmed_runs}

    def summary(self) -> str:
        """The figures on one line, for a log or a terminal."""
        states = dict(sorted(self.by_state.items()))
        return (f"runs: {self.runs}, attempts: {self.attempts} {states}"
                f", debits: {dict(sorted(self.debits.items()))}, recoveries: {self.recoveries}, "
                f"violations: {len(self.violations)}, cost_over_hold: {len(self.cost_over_hold)}"
                f", tokens_over_hold: {len(self.tokens_over_hold)}")


@checked
def reconcile(ledger: Annotated[Ledger, instance(
        Ledger, "a ledger.Ledger", "pass a ledger.Ledger (an AsyncLedger's is .sync)")]
              ) -> Reconciliation:
    """The ledger's books: runs, attempts by state, debits, recoveries and any violation.

    Args:
        ledger: The :class:`~ledger.Ledger` to check (for an :class:`~ledger.AsyncLedger`,
            pass its ``.sync``).

    Returns:
        The :class:`Reconciliation`; its ``ok`` says whether every invariant held.

    Raises:
        InvalidArgument: ``ledger`` is not a Ledger.

    Example:
        >>> books = reconcile(led)  # doctest: +SKIP
        >>> assert books.ok, books.violations  # doctest: +SKIP
    """
    store = RecoveryQueries(storage_of(ledger).context)
    fig = store.reconcile_figures(ledger.now())
    ev = store.event_counts(["recover", "unknown"])
    return Reconciliation(runs=fig.runs, attempts=fig.attempts, by_state=fig.by_state,
                          debits=fig.debits, recoveries=ev["recover"],
                          unknown_events=ev["unknown"], violations=fig.violations,
                          cost_over_hold=fig.cost_over_hold, trimmed_runs=fig.trimmed,
                          tokens_over_hold=fig.tokens_over_hold)


__all__ = ["Reconciliation", "reconcile"]
