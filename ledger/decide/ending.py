"""How a Run ends: the status its last turn (or a stop, or a cancellation) gives it.

A Run session (``with led.run(...)``), the pydantic-ai integration and ``Ledger.close_run`` all
end a Run by these rules, so its status says what happened (``docs/operations.md``, "How a
Run ends"):

* ``succeeded`` only when the Run's last turn was served;
* ``cancelled`` when its last turn was cancelled (``asyncio.CancelledError``,
  ``KeyboardInterrupt``, ``GeneratorExit``), even when the host caught the cancellation;
* ``stopped`` when its last turn was stopped on purpose by the Run's own policy or bounds
  (:data:`POLICY_STOPS`), ``failed`` after any other stop (every candidate failed, none was
  eligible, ...) and after any other error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from ledger.domain.records import AttemptRecord, AttemptState, RunStatus
from ledger.domain.timefmt import iso, when
from ledger.errors import FailoverExhausted, InvalidState

#: The statuses a Run ends in.
ENDED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED)

#: Stop reasons (``FailoverExhausted.reason``) that are the policy stopping on purpose: failover
#: switched off (for the Run's role, or altogether), or a bound the Run was admitted with spent
#: (its cost or token budget, its retry or model-call allowance). Every other stop reason
#: (``no_candidate``, ``not_eligible_failure``, ``output_exists``, ``execution_unknown``,
#: ``rejected_before_dispatch``, and any reason not listed here) ends the Run ``failed``.
POLICY_STOPS = frozenset({"failover_disabled", "role_excluded", "budget", "retry_allowance",
                          "call_allowance"})

_CANCELLATIONS = (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit)


def turn_end(exc: BaseException | None) -> RunStatus:
    """The status a Run ends in when its last turn ended with ``exc`` (``None``: served).

    A ``TimeoutError`` raised from a ``CancelledError`` is asyncio's own time limit
    (``asyncio.timeout``, ``wait_for``), which cancels what it bounds: a cancellation, wherever
    the host catches it.
    """
    if exc is None:
        return RunStatus.SUCCEEDED
    if isinstance(exc, _CANCELLATIONS) or (
            isinstance(exc, TimeoutError) and isinstance(exc.__cause__, asyncio.CancelledError)):
        return RunStatus.CANCELLED
    if isinstance(exc, FailoverExhausted):
        return RunStatus.STOPPED if exc.reason in POLICY_STOPS else RunStatus.FAILED
    return RunStatus.FAILED


def last_turn_served(attempts: Sequence[AttemptRecord], stops: Iterable[float]) -> bool | None:
    """Whether the Run's last turn was served, from its Attempts and the times of its stops.

    A turn ends with its one successful Attempt, so the last turn was served when the Run's
    last Attempt succeeded and no turn stopped since (a stop can come with no Attempt at all;
    one at the same instant counts as later). ``None`` when the Run has no Attempt.
    """
    if not attempts:
        return None
    last = max(attempts, key=lambda a: a.seq)
    if last.state is not AttemptState.SUCCEEDED:
        return False
    served_at = last.settled_at if last.settled_at is not None else last.created_at
    return all(t < served_at for t in stops)


def idle_end(status: RunStatus, served: bool | None) -> RunStatus:
    """How a block that tried no turn ends the Run.

    ``status`` is the Run's status as recorded, ``served`` what :func:`last_turn_served` says.
    A Run that ended before keeps its status (the block changed nothing); a Run that never
    made an Attempt is ``cancelled`` (nothing was asked of it); a Run resumed with Attempts (a
    crash, recovery) ends by its last recorded turn: ``succeeded`` if it was served, else
    ``failed``.
    """
    if status in ENDED:
        return status
    if served is None:
        return RunStatus.CANCELLED
    return RunStatus.SUCCEEDED if served else RunStatus.FAILED


def closed_refusal(run_id: str, close: dict[str, object], closed_at: float,
                   now: float) -> InvalidState:
    """Why a Run an operator (or recovery past its deadline) closed takes no new lease.

    A close is a decision that nobody resumes the Run: its status, holds and ``close`` event
    stand as the operator left them. A Run a block ended is different (the same id asked again
    continues it); only a recorded ``close`` (``close``: its event data) makes an end final.
    """
    status, by, reason = close.get("status"), close.get("by"), close.get("reason")
    return InvalidState(
        f"run {run_id!r} was closed {status} by {by!r} {when(closed_at, now)}: {reason}; a "
        "closed Run is not resumed and starts no new Attempt: admit the work as a new Run "
        "(another run id)", run_id=run_id, status=status, closed_by=by, reason=reason,
        closed_at=closed_at)


def trimmed_refusal(run_id: str, status: str, admitted_at: float,
                    retentions: Iterable[tuple[dict[str, object], float]], now: float,
                    ) -> InvalidState | None:
    """Why an ended Run whose history retention may have dropped takes no new lease.

    ``None``: no retention reached it. ``retentions``: each ``retention`` event's data and
    time.

    Retention drops the rows older than its cut-off of every ended Run without an open
    Attempt (the caller asks only of such a Run), so a Run admitted before a cut-off may
    have lost Attempts and events. Continued, its next Attempt would be numbered from what is
    left and its counters would no longer be the sum of its rows: its story can no longer be
    told truthfully. The first retention whose cut-off passed its admission is named.
    """
    hits = sorted(((at, data) for data, at in retentions
                   if isinstance(data.get("cutoff"), int | float)
                   and admitted_at < float(data["cutoff"])),  # type: ignore[arg-type]
                  key=lambda hit: hit[0])
    if not hits:
        return None
    at, data = hits[0]
    cutoff = float(data["cutoff"])  # type: ignore[arg-type]
    return InvalidState(
        f"run {run_id!r} ended {status} and its history may be gone: it was admitted "
        f"{when(admitted_at, now)}, before the cut-off {iso(cutoff)} of the retention run by "
        f"{data.get('by')!r} {when(at, now)}, which drops the old Attempts and events of ended "
        "Runs; continued, its Attempts would be numbered and summed from what is left, so it "
        "is not resumed and starts no new Attempt: admit the work as a new Run (another run "
        "id)", run_id=run_id, status=status, cutoff=cutoff, retention_at=at,
        retention_by=data.get("by"))


def missing_refusal(run_id: str, calls_used: int, next_seq: int) -> InvalidState | None:
    """Why a begin of ``run_id`` numbers no Attempt (``None``: it may number one).

    Its counters count more calls than it has Attempts left. Every counted call is an Attempt
    with a ``seq`` of its own, so ``calls_used`` is never above the highest ``seq``
    (``next_seq - 1``) unless Attempts were dropped: the history of a resumed Run that
    retention trimmed although its lease was taken (retention keeps the rows of a Run whose
    lease is live by its own clock, and a lease taken after it is refused by
    :func:`trimmed_refusal`), when the session's clock is behind retention's. Both numbers are
    read by the begin anyway: no statement more.
    """
    if calls_used < next_seq:
        return None
    return InvalidState(
        f"run {run_id!r} counts {calls_used} model call(s) but has {next_seq - 1} Attempt(s) "
        "left: its history was dropped by retention; its next Attempt would be numbered "
        f"{next_seq}, from what is left, so it starts no new Attempt: admit the work as a new "
        "Run (another run id)", run_id=run_id, calls_used=calls_used,
        attempts_left=next_seq - 1)


__all__ = ["ENDED", "POLICY_STOPS", "closed_refusal", "idle_end", "last_turn_served",
           "missing_refusal", "trimmed_refusal", "turn_end"]
