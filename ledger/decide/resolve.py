"""Writes whose outcome is unknown and that the process settles once the database answers (pure).

When the connection is lost after a ``COMMIT`` was sent, the write is resolved at once on a new
connection (:func:`ledger.storage.store.resolving`). When that fails too (no primary takes
writes yet), the process keeps what it needs to finish the job as one of these values, and the
store resolves it before it writes anything else for that Run (:mod:`ledger.storage.store`), from
the lease keeper's heartbeat, and when the ledger is closed. A settle of the retry owner is
remembered whatever stopped the database from taking it (an outage, another writer holding the
lock past the busy or lock timeout, a lost acknowledgement):

* :class:`UnresolvedBegin`: a begin of the retry owner that was never sent (sending waits for
  the begin's acknowledgement). If it landed it is settled ``not_sent`` under its own fence:
  hold voided, slot freed, the model call given back, a ``commit_unknown`` event. If the lease
  lapsed meanwhile and recovery took the Run over, recovery recorded it ``unknown`` with its hold
  kept, because recovery cannot know it was never sent; this process does, and settles it
  ``not_sent`` through the late-receipt path (:meth:`ledger.Ledger.settle_unknown`'s), which
  accepts only an ``unknown`` Attempt, under the Run's row lock, once — and here only one begun
  under this process's own fence.
* :class:`UnresolvedSettle`: a settle of the retry owner the database did not take (busy past
  its timeout, away, or its acknowledgement lost and the resolution failed too). The process
  holds the receipt, so it records it as it was decided (outcome, fact, usage, cost, events)
  under the Attempt's own fence; the same settle again is the same write, so it lands once.
  Until then the Attempt is ``dispatching``, its capacity slot and hold held. If the Run was
  taken over meanwhile and recovery recorded the Attempt ``unknown``, the settle is refused and
  kept as a ``late_receipt`` event beside it, as any late settle is.
* :class:`UnresolvedExit`: a Run session's exit whose finish or release could not be written: it
  is finished with the status the block ended in, then its lease released, while that lease is
  still the Run's.
* :class:`UnresolvedAdmission`: a Child Run's admission (which carves the Child's budget out of
  its parent's) whose ``COMMIT``'s outcome stayed unknown: its caller was told it failed, so
  nobody will run the Child. Kept under the parent (the parent's writes, its lease keeper and
  ``close()`` resolve it), it is resolved under the parent's fence: a Child that landed and that
  no lease ever held is ended (the status an entry that raised the error ends it in:
  ``failed``), which gives its whole carve back to the parent; one that did not land leaves
  nothing; a Child some lease took since, or a parent taken over, is left to its holder.
* :class:`UnresolvedChildEnd`: the ending of a fresh Child Run (one no lease had held before)
  whose session's entry raised after its admission, which the database did not take (the
  give-back of :meth:`ledger.api.session._SessionCore.child`'s entry: its acquisition, finish
  or release). Kept under the parent and resolved as an admission is, under the parent's
  fence: a Child still ``admitted`` that no lease but this entry's ever held is ended (the
  status the entry's exception ends it in), its lease released if it is still held, and its
  whole carve given back; a Child that is gone (its admission never landed) leaves nothing; a
  Child another lease took since, or a parent taken over, is left to its holder.

The verdicts below map what the database answered to what it means; they read nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ledger.decide.ending import turn_end
from ledger.decide.settle import settle_spec
from ledger.domain.records import AttemptRecord, AttemptState, DebitState, Lease, Outcome, RunStatus
from ledger.domain.specs import ReceiptSpec, SettleSpec
from ledger.domain.values import Route
from ledger.errors import (
    DatabaseUnavailable,
    FencedOut,
    InvalidState,
    LedgerError,
    NotFound,
    SettleConflict,
)
from ledger.policy.model import Policy

#: The event a begin whose acknowledgement was lost is settled with (data: how it was resolved).
COMMIT_UNKNOWN = "commit_unknown"
#: The event a fresh Child is ended with when its entry's own ending was written later.
UNWOUND = "unwound"


class Resolution(Enum):
    """How an unresolved write ended."""

    #: The begin had landed; it is settled ``not_sent`` now (or was, by an earlier try).
    SETTLED = "settled"
    #: The begin never landed: nothing was recorded, nothing is held.
    ABSENT = "absent"
    #: The begin landed refused by its capacity group: settled, nothing held.
    REJECTED = "rejected"
    #: Recovery had recorded it ``unknown`` (hold kept); it is settled ``not_sent`` now.
    LATE = "late"
    #: The settle the database did not take is recorded now (or was, by the try it missed).
    RECORDED = "recorded"
    #: The session's exit is written: the Run finished, the lease released.
    FINISHED = "finished"
    #: The Child's admission had landed and no lease ever held it (but the entry's own, for
    #: an entry's ending): it is ended now (or was, by an earlier try), its carve given back
    #: to the parent.
    ENDED = "ended"
    #: Someone else decided first (an operator's receipt, a takeover that has not marked it
    #: yet): nothing of this process is written; recovery or the operator has it.
    LEFT = "left"


@dataclass(frozen=True)
class UnresolvedBegin:
    """A begin of the retry owner that was never sent and whose ``COMMIT`` may have landed.

    Attributes:
        lease: The lease it was begun under (its fence is the Attempt's).
        attempt_id: The Attempt.
        route_id: Its route.
        profile_id: Its credential profile, if any.
        settle: The ``not_sent`` settle (with its ``commit_unknown`` event) under its fence.
        receipt: The same truth for an Attempt recovery recorded ``unknown`` meanwhile.
    """

    lease: Lease
    attempt_id: str
    route_id: str
    profile_id: str | None
    settle: SettleSpec
    receipt: ReceiptSpec

    @property
    def run_id(self) -> str:
        """The Run it belongs to."""
        return self.lease.run_id


@dataclass(frozen=True)
class UnresolvedSettle:
    """A settle of the retry owner that the database did not take: the receipt is in hand.

    Attributes:
        run_id: The Run of the Attempt.
        spec: The settle as the turn decided it (its outcome, fact, usage, cost and events,
            under the Attempt's fence); written again as it is, so a try that landed unseen
            makes the next one the same write.
    """

    run_id: str
    spec: SettleSpec

    @property
    def attempt_id(self) -> str:
        """The Attempt it settles."""
        return self.spec.attempt_id


@dataclass(frozen=True)
class UnresolvedExit:
    """A Run session's exit whose finish or release the database did not take.

    Attributes:
        lease: The session's lease, as last renewed.
        status: What the Run ends in; ``None`` when it is finished and only the release is left.
        tried: A try may have landed (its outcome is unknown): the next one finds it done.
    """

    lease: Lease
    status: RunStatus | None
    tried: bool = False

    @property
    def run_id(self) -> str:
        """The Run it belongs to."""
        return self.lease.run_id


@dataclass(frozen=True)
class UnresolvedAdmission:
    """A Child Run's admission whose ``COMMIT``'s outcome is unknown, told failed to its caller.

    Attributes:
        parent: The parent's lease the admission carved under (its fence decides: the
            resolution writes only while the parent's fence is still this lease's).
        child_id: The Child Run's id.
        status: What a Child that landed is ended with.
    """

    parent: Lease
    child_id: str
    status: RunStatus

    @property
    def run_id(self) -> str:
        """The Run it is kept under: the parent's (the Child has no lease to write with)."""
        return self.parent.run_id


@dataclass(frozen=True)
class UnresolvedChildEnd:
    """A fresh Child Run whose session's entry raised, and whose ending the database did not take.

    The entry's give-back (finish the Child, release its lease, which gives the carve back)
    met a database that did not answer; until it is written the Child keeps its carve out of
    the parent's budget, and nobody will run it (its id is spent).

    Attributes:
        parent: The parent's lease (its fence decides: the resolution writes only while the
            parent's fence is still this lease's). Its executor is the Child's lease holder's
            too: a Child session runs on its parent's ledger.
        child_id: The Child Run's id.
        status: What the Child is ended with (as its entry's exception ends a fresh Child).
        fence: The highest fence the entry may have given the Child: 1 when it took (or may
            have taken) the Child's first lease, 0 when it took none. A Child found at a higher
            fence, or at fence 1 under another executor's lease, was taken by someone else.
    """

    parent: Lease
    child_id: str
    status: RunStatus
    fence: int

    @property
    def run_id(self) -> str:
        """The Run it is kept under: the parent's (whose next write resolves it)."""
        return self.parent.run_id


Unresolved = (UnresolvedBegin | UnresolvedSettle | UnresolvedExit | UnresolvedAdmission
              | UnresolvedChildEnd)


def unresolved_admission(parent: Lease, child_id: str,
                         error: BaseException) -> UnresolvedAdmission:
    """What ends ``child_id``, admitted under ``parent`` with ``error`` told to its caller.

    The status is the one a Run session's entry that raised ``error`` ends a fresh Child in
    (:func:`ledger.decide.ending.turn_end`: ``failed`` for a database that did not answer): the
    caller was told the admission failed, and its block never ran.
    """
    return UnresolvedAdmission(parent, child_id, turn_end(error))


def unresolved_begin(policy: Policy, route: Route, profile_id: str | None, lease: Lease,
                     attempt_id: str, *, by: str) -> UnresolvedBegin:
    """What settles the retry owner's begin of ``attempt_id`` that it will never send.

    ``by`` names the executor in the late receipt. The settle is a bare ``not_sent`` (no fact):
    it says nothing about the route's health, and its content does not depend on when it is
    written, so the same value settles it now or an hour later, and again is the same write.
    """
    why = {"operation": "begin", "resolution": "not_sent"}
    settle = settle_spec(
        policy, route, profile_id, lease, attempt_id, outcome=Outcome.NOT_SENT, fact=None,
        observation=None, now=0.0, effective_output=None, tool_started=None,
        prompt_tokens=None, completion_tokens=None, cost_micros=None, model_reported=None,
        output_hash=None, events=[(COMMIT_UNKNOWN, why)], provenance=(), repeat=False)
    receipt = ReceiptSpec(
        attempt_id=attempt_id, outcome=Outcome.NOT_SENT, prompt_tokens=None,
        completion_tokens=None, cost_micros=None, by=lease.executor, fence=lease.fence,
        note=f"{by}: its begin's COMMIT outcome was unknown and it was never sent (sending "
             "waits for the begin's acknowledgement)",
        events=[(COMMIT_UNKNOWN, {**why, "after": "unknown"})])
    return UnresolvedBegin(lease, attempt_id, route.id, profile_id, settle, receipt)


def stays(error: BaseException) -> bool:
    """Whether ``error`` leaves a write unresolved: the database did not answer the question.

    A server that cannot be reached, went away or is a standby (``DatabaseUnavailable``); every
    other answer decides.
    """
    return isinstance(error, DatabaseUnavailable)


def settle_verdict(error: LedgerError | None) -> Resolution | None:
    """What the ``not_sent`` settle's answer says; ``None``: look at the Attempt itself.

    No error: settled (again: the same write). ``NotFound``: the begin never landed.
    ``InvalidState``: it was recorded rejected. ``FencedOut`` (the Run was acquired again) or
    ``SettleConflict`` (it was settled otherwise): the Attempt's record decides
    (:func:`attempt_verdict`). Any other error is not an answer about the begin: it is raised.
    """
    if error is None:
        return Resolution.SETTLED
    if isinstance(error, NotFound):
        return Resolution.ABSENT
    if isinstance(error, InvalidState):
        return Resolution.REJECTED
    if isinstance(error, FencedOut | SettleConflict):
        return None
    raise error


def attempt_verdict(att: AttemptRecord, item: UnresolvedBegin) -> Resolution | ReceiptSpec:
    """What to do with ``item``'s Attempt as recorded now: a verdict, or the receipt to apply.

    ``unknown`` with its hold, under ``item``'s own fence: recovery's doing, and this process
    knows better; the receipt settles it ``not_sent``. Already ``not_sent`` or ``rejected``:
    nothing is held. Anything else (settled by someone with other evidence, or still
    dispatching under a fence that was taken over without recovery): left alone.
    """
    if att.fence != item.lease.fence:
        return Resolution.LEFT  # pragma: no cover - an attempt id is this process's own
    if att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED:
        return item.receipt
    if att.state is AttemptState.NOT_SENT:
        return Resolution.SETTLED
    if att.state is AttemptState.REJECTED:
        return Resolution.REJECTED
    return Resolution.LEFT


__all__ = [
    "COMMIT_UNKNOWN",
    "UNWOUND",
    "Resolution",
    "Unresolved",
    "UnresolvedAdmission",
    "UnresolvedBegin",
    "UnresolvedChildEnd",
    "UnresolvedExit",
    "UnresolvedSettle",
    "attempt_verdict",
    "settle_verdict",
    "stays",
    "unresolved_admission",
    "unresolved_begin",
]
