"""The Run session: a Run you hold in a ``with`` block, and turns on it.

::

    with led.run("task-42", plan=routes, budget=budget, grant=grant) as run:
        result = run.turn(Envelope(parts=[Part(content="Compare the filings.")]),
                          on_text=print)
        for call in result.tool_calls:
            answer = search(call.arguments)           # the host runs its tool
            parts.append(run.tool_result(call, answer))

One session per Run per ledger at a time: a session's turns may run at once, so threads and tasks
share the open session; entering a second session of the Run on the same ledger while one is open
is refused with :class:`~ledger.errors.LeaseHeld` (``problem="session_open"``), recording
nothing (both would hold the executor's one lease, and the first to leave would end the Run under
the other's turns). Leaving the block, or an entry that raised, frees the Run id.

Entering checks that every route's key can be resolved (nothing is recorded when one cannot),
admits the Run (or resumes it: the same id with identical content), takes its lease and keeps it
renewed in the background while the session exists (an entry that raises after that gives the
lease back, whatever it raises, and ends a Child Run no lease had held before, which gives its
carve back to the parent; a Child's admission whose outcome the database could not tell, or
a fresh Child's ending that the database did not take, is written as soon as it answers:
:meth:`_SessionCore.child`); leaving finishes the Run and
releases the lease, on every path, cancellation included, and an interruption of the exit's
own writes (when the database does not answer, as soon as it does:
:mod:`ledger.decide.resolve`). The status says what happened
(:mod:`ledger.decide.ending`): ``succeeded`` only when the last turn was served, ``cancelled``
after a cancelled turn (even one the host caught), ``stopped`` or ``failed`` after a stop,
``failed`` or ``cancelled`` when the block raised. A ledger closed while the session is open
releases its lease instead, the Run left unfinished for the next session to resume
(:func:`give_up_open`); the exit then writes nothing and raises the closed ledger's
``InvalidState``. No session enters a closing ledger: one whose entry was under way when the
close began is waited for, and gives back what it took (:meth:`_SessionCore._opened`).

A turn is one logical turn through the retry owner (:func:`ledger.api.turn.execute`) with the
route's built-in adapter and the Run's frozen streaming limits. Its answer comes back as
conversation parts whose provenance the ledger recorded, so appending them (and the tool
results made here) to the next envelope passes disclosure preflight with nothing more to do.

:class:`RunSession` (blocking) and :class:`AsyncRunSession` (asyncio) share everything that is
not I/O in :class:`_SessionCore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Self, TypeVar, Unpack, cast

from ledger.api.arguments import SessionOptions
from ledger.api.face import AsyncFace, Face, SyncFace
from ledger.api.turn import TurnOptions, outlast
from ledger.decide.admission import Admission, BudgetArg, GrantArg, Role, Terms
from ledger.decide.effects import Dispatch, SendResult
from ledger.decide.ending import idle_end, last_turn_served, turn_end
from ledger.decide.resolve import UnresolvedChildEnd, UnresolvedExit, stays
from ledger.decide.settle import check_lease_ttl
from ledger.decide.turn import RunResult
from ledger.domain.envelope import EXEMPT_CLASSES, Envelope, Part, PartHashes, require_parts
from ledger.domain.records import AttemptRecord, EventRecord, Lease, RunRecord, RunStatus
from ledger.domain.validation import Id, NewId, checked, function, instance
from ledger.domain.values import Route
from ledger.errors import (
    DatabaseUnavailable,
    FencedOut,
    InvalidArgument,
    InvalidState,
    LeaseHeld,
    LedgerError,
    NotFound,
    SettleConflict,
)
from ledger.storage.failure import closed_error
from ledger.storage.runner import Flow

if TYPE_CHECKING:
    from ledger.api.lease import AsyncLeaseKeeper, KeeperCore, LeaseKeeper

# Logger names are part of the interface operators filter on: they stay as they were named.
log = logging.getLogger("ledger.session")

TextCallback = Callable[[str], Any]
EventCallback = Callable[[Any], Any]  # ledger.adapters.StreamEvent -> None | Awaitable

DEFAULT_SESSION_TTL_S = 30.0
_ENDED = ("this Run session has ended (its block was left); open a new one with "
          "ledger.run(...) to continue the Run")


# A turn's callbacks, checked before anything is read or written.
OnText = Annotated[TextCallback, function("a function of the text (str)")]
OnEvent = Annotated[EventCallback, function("a function of a StreamEvent")]
_SENDS = function("a function of a Dispatch returning a SendResult")
Send = Annotated[Callable[[Dispatch], SendResult], _SENDS]
AwaitedSend = Annotated[Callable[[Dispatch], Awaitable[SendResult]], _SENDS]
ToolResult = Annotated[str | Part, instance(
    (str, Part), "text or a file Part",
    "serialise it, e.g. json.dumps(result), or pass the tool's file as "
    "Part(data=..., media_type=...)")]


async def _then(first: Awaitable[Any], then: EventCallback, event: Any) -> None:
    """``first`` awaited, then ``then(event)`` called (and awaited when it returns one).

    In that order, as for plain functions: ``on_event`` hears a text delta after ``on_text``
    did, and not at all when ``on_text`` raised.
    """
    await first
    out = then(event)
    if inspect.isawaitable(out):
        await out


def tool_file(call_id: str, file: Part, data_class: str) -> Part:
    """A tool's file as a user part of the tool's data class, covered by ``call_id``.

    A tool part is text, so the file goes in a user part next to it (sent after all of the
    turn's results, ``contract.wire_order``, or in the result of a call that returned files
    alone where the protocol carries them there, ``carried.files_alone``); left as
    ``user_input`` it would need no provenance and reach recipients the grant approved for the
    user's input only.
    """
    if file.media_type is None or file.role != "user":
        raise InvalidArgument(
            "content is a Part but not an image or document of the user's role; pass the "
            "tool's text as a string, or its file as Part(data=..., media_type=...)",
            field="content")
    if file.link is not None:
        # Refused whatever data_class the host gives it: preflight knows a tool's link only by
        # its class (tool_result), and a tool's link is the tool's choice, or of whatever page
        # or injected prompt the tool read, never the host's.
        raise InvalidArgument(
            "content is a link (url='https://...'): a provider would fetch it, and the link's "
            "host, which no grant names, would receive whatever the URL carries; the ledger "
            "never sends a link a tool returned. Fetch the file yourself, check it, and pass "
            "its bytes as Part(data=..., media_type=...)",
            field="content.url")
    if data_class in EXEMPT_CLASSES:
        # The part is the user's by role only (wires carry no tool file): its class is all
        # that keeps it from recipients approved for the user's own input.
        raise InvalidArgument(
            f"a tool's file is not the user's input nor the host's system text, so its data "
            f"class cannot be {data_class!r} (a class that needs no provenance); pass "
            "data_class='tool_result' (the default), or the class of what the tool read "
            "(e.g. 'private_document')", field="data_class")
    if "data_class" in file.model_fields_set and file.data_class != data_class:
        raise InvalidArgument(
            f"the file's data_class {file.data_class!r} is not the data_class argument "
            f"{data_class!r}; pass the file's class as tool_result(..., data_class=...)",
            field="data_class")
    return Part.model_validate({**file.model_dump(), "data_class": data_class,
                                "provenance": call_id})


def _idle_status(run: RunRecord, attempts: Sequence[AttemptRecord],
                 stops: Sequence[EventRecord]) -> RunStatus:
    """How a block that tried no turn (nor held a Child) ends the Run, from its record."""
    return idle_end(run.status, last_turn_served(attempts, [e.created_at for e in stops]))


def _may_have_taken(error: BaseException | None) -> bool:
    """Whether an acquisition of the lease that raised ``error`` may have taken it.

    The ledger's own refusals (``LeaseHeld``, a closed or unknown Run, a bad ``ttl_s``) took
    nothing, nor did a database that did not answer, unless the acquisition's commit was sent
    and its outcome stayed unknown. Anything else (an interruption, a cancellation, a fault of
    the driver) may have landed after the commit, the lease taken but never returned.
    """
    if isinstance(error, DatabaseUnavailable):
        return error.fields.get("operation") == "acquire" and error.fields.get("resolved") is False
    return not isinstance(error, LedgerError)


def _error_of(future: asyncio.Future[Any]) -> BaseException | None:
    """What a finished ``future`` raised (its cancellation included), else ``None``."""
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception()


_T = TypeVar("_T")


async def _to_its_end(
        write: Awaitable[_T]) -> tuple[_T | None, BaseException | None, BaseException | None]:
    """Run ``write`` to its end, however often the caller is cancelled meanwhile.

    A write may commit although its caller was cancelled (:func:`~ledger.api.turn.outlast`).
    Returns its result (``None`` when it raised), what it raised, and the caller's last
    cancellation; the caller records the outcome, then raises (:func:`_raise_first`).
    """
    task = asyncio.ensure_future(write)
    cancelled = await outlast(task)
    error = _error_of(task)
    return (task.result() if error is None else None), error, cancelled


def _raise_first(*raised: BaseException | None) -> None:
    """Raise the first of ``raised`` that is not ``None``."""
    for e in raised:
        if e is not None:
            raise e


def _note_kept(session: _SessionCore, exc: BaseException, error: BaseException) -> None:
    """An entry that raised ``exc`` could not give its lease back (``error``): it lapses.

    A fresh Child's ending that the database did not take is remembered (``error`` says
    ``deferred``): told on ``exc``, logged at INFO; the ledger's ``close()`` warns of it if it
    is still not written then.
    """
    if isinstance(error, LedgerError) and error.fields.get("deferred"):
        parent = session._parent.run_id if session._parent is not None else "?"
        log.info("run %s: the ending of the Child whose entry raised %r is not written yet "
                 "(%r); it is written before run %s's next write", session.run_id, exc, error,
                 parent)
        exc.add_note(
            f"entering the Run session, ending child run {session.run_id!r} (which gives its "
            f"carve back to run {parent!r}) failed too ({type(error).__name__}: {error}); "
            "this process ends it and gives the carve back as soon as the database answers "
            f"again (before run {parent!r}'s next write, from its lease keeper, or when the "
            "ledger is closed), unless another executor took the Child meanwhile")
        return
    log.warning("run %s: the lease taken by an entry that raised %r was not released; "
                "it lapses in %g s: %r", session.run_id, exc, session.lease_ttl_s, error)
    exc.add_note(f"entering the Run session, giving back run {session.run_id!r}'s lease "
                 f"failed too ({type(error).__name__}: {error}); it lapses in "
                 f"{session.lease_ttl_s:g} s")


@dataclasses.dataclass
class _Entry:
    """How far an entry of a Run session came: what its give-back undoes."""

    #: The lease it holds (taken, or found taken after an interruption).
    lease: Lease | None = None
    #: Whether the acquisition of the lease was started.
    acquiring: bool = False
    #: What the acquisition raised (its cancellation included).
    refused: BaseException | None = None
    #: What the admission raised (its cancellation included).
    unadmitted: BaseException | None = None


def take_open(ledger: Face[Any, Any]) -> list[Any]:
    """The Run sessions open on ``ledger``, which is closing, each taken by the close.

    Their keepers stop, and each one's exit writes nothing from then on
    (:meth:`_SessionCore._closed_under`). Taken before the close wakes the turns queued for a
    capacity slot: a woken turn's block ends at once, and its exit must find its session
    taken, rather than race the close to write under the same lease.
    """
    with ledger._open_sessions_lock:
        return [s for s in list(ledger._open_sessions.values()) if s._give_up()]


def give_up_open(ledger: Face[Any, Any], sessions: list[Any]) -> Flow[None]:
    """Release the leases of the Run ``sessions`` the closing ``ledger`` took (:func:`take_open`).

    Run by :meth:`ledger.Ledger.close` once no begin is under way or can start: from then on
    nothing of these sessions can send, so a lease released now is given up for good, and
    the next session of the Run (any executor) resumes it at once instead of waiting for it
    to lapse. The Runs are not finished (their blocks have not ended). A release settles
    nothing: an Attempt still in flight (sent, its outcome unknown) refuses it, and stays as
    it is for recovery, its lease left to lapse. One try each; what the database does not
    take is logged at WARNING and lapses (a database that is away: the rest are not tried).
    Each session's exit then writes nothing (:meth:`_SessionCore._closed_under`).
    """
    away: LedgerError | None = None
    for session in sessions:
        lease = session._keeper.lease
        error = away
        if error is None:
            try:
                yield from ledger._store.release_lease(lease, ledger.clock.now)
            except LedgerError as e:
                error = e
                if isinstance(e, DatabaseUnavailable):
                    away = e  # the others would wait for a database that is away, in vain
            else:
                session._given_up = ("the ledger's close released its lease: the next session "
                                     "with its id (any executor) resumes it now")
                continue
        session._given_up = (f"the ledger's close could not release its lease "
                             f"({type(error).__name__}: {error}); it lapses at "
                             f"{lease.expires_at}, then any executor may resume it")
        log.warning("closing the ledger with the Run session of run %s open, its lease (fence "
                    "%d) was not released; it lapses at %s: %s", lease.run_id, lease.fence,
                    lease.expires_at, error)


def _key_source(adapter: Any, secrets: Any) -> Any:
    """The secret provider the session's sender resolves credential profiles with."""
    if secrets is not None:
        return secrets
    inner = getattr(adapter, "adapter", adapter)  # a SyncAdapter wraps an HttpAdapter
    found = getattr(inner, "secrets", None)
    if found is not None:
        return found
    from ledger.adapters import EnvSecretProvider

    return EnvSecretProvider()


class _SessionCore:
    """What both sessions share (everything that is not I/O).

    The admission arguments, the calls a turn proposed, the Part a tool result becomes, and the
    callbacks a turn's stream goes to. The constructor's arguments are those
    :meth:`ledger.Ledger.run` validated (``options``: :class:`SessionOptions`).
    """

    def __init__(self, ledger: Any, run_id: str, options: SessionOptions, *,
                 owns_adapter: bool = False) -> None:
        # Checked here, before the block admits anything: a session refused on entering after
        # admission would leave a Run admitted and nobody holding it. The admission arguments
        # themselves are admit_run's, which checks them all before it writes.
        lease_margin_s, adapter_kind = self._ledger_kind(ledger)
        terms: dict[str, Any] = dict(options)
        ttl: float = terms.pop("lease_ttl_s", DEFAULT_SESSION_TTL_S)
        adapter, secrets = terms.pop("adapter", None), terms.pop("secrets", None)
        check_lease_ttl(ttl, lease_margin_s, field="lease_ttl_s",
                        fix="pass a longer lease_ttl_s (e.g. 30)")
        # The adapters' module is looked up only for an adapter given (its caller imported it
        # already): the first import costs some 0.2 s, which an event loop must not wait.
        if adapter is not None and not isinstance(
                adapter, getattr(importlib.import_module("ledger.adapters"), adapter_kind)):
            other = "AsyncLedger.run" if adapter_kind == "SyncAdapter" else "Ledger.run"
            raise InvalidArgument(f"adapter must be a ledger.adapters.{adapter_kind} "
                                  f"(got {type(adapter).__name__}); the other kind is for "
                                  f"{other}", field="adapter")
        if secrets is not None and adapter is not None:
            raise InvalidArgument("secrets is for the session's own adapter; pass the secret "
                                  "provider to your adapter instead, or pass no adapter",
                                  field="secrets")
        self.ledger = ledger
        self._adapter: Any = adapter
        self._secrets = secrets
        # A session closes the adapter it made itself, never one it was given (or a child's).
        self._owns_adapter = adapter is None or owns_adapter
        self._keeper: Any = None
        self.run_id = run_id
        self.admission = cast(Admission, terms)
        self.lease_ttl_s = ttl
        self.record: RunRecord | None = None
        self._state = "new"  # new -> open -> ended
        self._calls: dict[str, tuple[str, str]] = {}  # tool-call id -> (attempt id, tool name)
        # The Attempts whose requests are on the wire, by id: turns of one session may run at
        # once (threads, tasks), and the exit must find every one.
        self._sending: dict[str, Dispatch] = {}
        # Those the exit settled (unknown, or not sent) under a turn still running elsewhere.
        self._abandoned: set[str] = set()
        self._hashes = PartHashes()  # the conversation's parts, each hashed once
        # How the block's last piece of work ended (a turn, or a Child Run it held): the
        # status the Run ends in when the block is left normally. None: no turn was tried.
        self._outcome: RunStatus | None = None
        self._parent: _SessionCore | None = None  # the session a Child session reports to
        self.ended: RunStatus | None = None  # the status the Run was finished with
        # The status the exit decided on: a second try of an interrupted exit ends the Run
        # with it, not with one read from a record the first try may have finished.
        self._leaving: RunStatus | None = None
        # What the ledger's close did with the lease, when it found the session open
        # (give_up_open): the exit then writes nothing. None: no close came while it was open.
        self._given_up: str | None = None

    def _turn_ended(self, status: RunStatus) -> None:
        """Record how the block's latest turn ended.

        The session records it for its own turns; the pydantic-ai integration also records a
        streamed turn whose reader left before the end (``cancelled``, even when the answer
        had arrived).
        """
        self._outcome = status

    def _left_under(self, error: BaseException, sent: list[str]) -> InvalidState | None:
        """The error a turn's caller sees when the block was left under it.

        The exit settled the Attempt the turn had on the wire, so the turn's own settle was
        refused.

        The refusal (:class:`~ledger.errors.SettleConflict` or
        :class:`~ledger.errors.FencedOut`) names the storage rule, not the cause; this names
        the cause and the fix, the refusal chained. ``None`` for any other error.
        """
        if not isinstance(error, SettleConflict | FencedOut):
            return None
        gone = [i for i in sent if i in self._abandoned]
        if not gone:
            return None
        return InvalidState(
            f"the session of Run {self.run_id!r} was left while this turn's request was in "
            f"flight: its exit recorded Attempt {gone[-1]!r} as never answered (its hold kept, "
            "never sent again) and ended the Run, so the answer that came was kept only as a "
            "late receipt. Leave the block only after every thread's or task's turn has "
            "returned", run_id=self.run_id, attempt_id=gone[-1])

    def _end_status(self, exc: BaseException | None) -> RunStatus | None:
        """How the block ends the Run: by its exception, else by its last turn or Child.

        ``None`` when it tried neither: the Run's record decides (:func:`_idle_status`).
        """
        if exc is not None:
            return turn_end(exc)
        return self._outcome

    def _exit(self, exc: BaseException | None, keeper: KeeperCore, *,
              again: bool = False) -> Flow[None]:
        """Leaving the block, for both sessions: the Run's end, then its lease given up.

        The exit is remembered as an :class:`~ledger.decide.resolve.UnresolvedExit` before it is
        written, behind what the turns left unresolved (a begin never sent, settled
        ``not_sent``, and a settle the database did not take, written, first: a release needs
        nothing in flight). When the database does not answer, it stays remembered and the
        process writes it as soon as the database answers again (from a thread that tries it
        again meanwhile, :meth:`_write_later`; the Run's next write here; or the ledger's
        ``close()``). A keeper that lost the
        Run writes nothing under the lease (a begin of its own that was never sent is still
        settled, under its own fence), and the exit raises what lost it: the Run was not
        finished.

        ``again``: the second try of an exit that an interruption cut short, anywhere (its
        finish or release may have committed): it ends the Run with the status the first try
        decided on, and a finish or release found done is the same write.
        """
        led, run_id = self.ledger, self.run_id
        store, clock = led._store, led.clock.now
        if keeper.error is not None:
            try:
                yield from store.resolve_run(run_id, clock)
            except LedgerError as e:
                log.warning("run %s: leaving a lost Run, its unresolved begin stays for the "
                            "ledger's close() or recovery: %s", run_id, e)
            if exc is not keeper.error:
                # The Run was not finished here: a block that succeeded must not look as if it
                # had (the Run stays running until its new holder or recovery ends it).
                raise keeper.error
            return
        status = self._leaving
        if status is not None:
            # The first try decided it, and settled what was abandoned on the wire.
            yield from self._claimed_exit(UnresolvedExit(keeper.lease, status, tried=True),
                                          status)
            return
        status = self._end_status(exc)
        for abandoned in list(self._sending.values()):
            self._abandoned.add(abandoned.attempt_id)
            # A turn left in the middle of its send: an async generator the host stopped
            # reading and has not closed yet, a thread still waiting on the provider. Its
            # request may have left, so its Attempt is marked unknown (hold kept, never sent
            # again) before the Run ends, cancelled like an interrupted turn; whatever the turn
            # writes later is refused or kept as a late receipt.
            if abandoned.progress.provably_unsent:
                from ledger.api.lease import SHUTDOWN_FACT

                with contextlib.suppress(SettleConflict):  # the turn settled it meanwhile
                    yield from Face.settle_attempt.flow(
                        led, keeper.lease, abandoned.attempt_id, outcome="not_sent",
                        fact=SHUTDOWN_FACT)
            else:
                yield from Face.mark_unknown.flow(
                    led, keeper.lease, abandoned.attempt_id,
                    "the Run session was left while the request was in flight")
            status = status if exc is not None else RunStatus.CANCELLED
        if status is None:
            status = _idle_status((yield from Face.get_run.flow(led, run_id)),
                                  (yield from Face.timeline.flow(led, run_id)),
                                  (yield from Face.events.flow(led, run_id, ["stop"])))
        self._leaving = status
        yield from self._claimed_exit(UnresolvedExit(keeper.lease, status, tried=again),
                                      status)

    def _write_later(self, keeper: KeeperCore) -> None:
        """Leave the exit the database refused, if it stays remembered, to a thread.

        The thread (:class:`~ledger.api.lease.ExitWriter`) tries it again until it is written
        or the lease is about to lapse: nothing else of this process may write for the Run
        again, and the lease would lapse with the Run left running.
        """
        from ledger.api.lease import ExitWriter

        if self.ledger._store.closed or not self._exit_remembered():
            return
        ExitWriter(keeper).start()

    def _exit_remembered(self) -> bool:
        """Whether this process still holds the Run's exit for later (the database refused it)."""
        return any(isinstance(i, UnresolvedExit)
                   for i in self.ledger._store.pending.of(self.run_id))

    def _claimed_exit(self, exit: UnresolvedExit, status: RunStatus) -> Flow[None]:
        """Remember the exit, then write it, the Run's writes claimed meanwhile.

        A ledger closing at the same moment waits for this write instead of writing the same
        exit from its own thread (one of the two then found the lease released, and a session
        whose block succeeded raised ``LeaseLost``).
        """
        pending = self.ledger._store.pending
        with pending.claim(self.run_id):
            pending.add(exit)
            yield from self._write_exit(status)

    def _unwind(self, got: _Entry, exc: BaseException) -> Flow[None]:
        """Undo what an entry that raised ``exc`` after ``got`` left: its lease, a fresh Child.

        A lease the acquisition may have taken though it raised (:func:`_may_have_taken`) is
        acquired again (one's own live lease comes back under its fence), then released. A
        Child Run that no lease had held before this entry's (admitted by it, or by an entry
        interrupted before its lease) is ended first, with the status a block raising ``exc``
        ends in: its block never ran, and a Child left admitted would keep its carve out of
        the parent's budget until someone entered it again. The finish gives the carve back.
        A Root Run stays admitted as it was, for the next session with its id to resume.

        When the database does not answer any of that for a Child that is (or may be) fresh,
        its ending is remembered under the parent
        (:class:`~ledger.decide.resolve.UnresolvedChildEnd`) before the error leaves: the
        parent's next write, its lease keeper or the ledger's ``close()`` writes it.
        """
        led = self.ledger
        # The lease the Child's admission carved under (the parent's fence decides later).
        parent = self.admission.get("parent") if self._parent is not None else None
        # Whether the Child is one no lease had held before; None: it may be, unread yet.
        fresh: bool | None = False
        try:
            if parent is not None:
                rec = self.record
                if (rec is None and got.unadmitted is not None
                        and _may_have_taken(got.unadmitted)):
                    # An interruption of the admission: it may have committed (and carved).
                    fresh = None
                    with contextlib.suppress(NotFound):
                        rec = yield from Face.get_run.flow(led, self.run_id)
                fresh = (rec is not None and rec.fence == 0
                         and rec.parent_run_id == parent.run_id)
            lease = got.lease
            # A fresh Child is ended whatever its acquisition raised (a refusal that took
            # nothing leaves it admitted, its carve out of the parent's budget); otherwise the
            # lease is taken again only when the acquisition may have taken it.
            if lease is None and (fresh or (got.acquiring and _may_have_taken(got.refused))):
                with contextlib.suppress(LeaseHeld, InvalidState, NotFound):
                    lease = yield from Face.acquire_lease.flow(led, self.run_id,
                                                               ttl_s=self.lease_ttl_s)
            if lease is None:
                return
            # Fence 1: the first lease ever taken on it, this entry's (no other session ran it).
            if fresh and lease.fence == 1:
                status = turn_end(exc)
                yield from Face.finish_run.flow(led, lease, status)
                self.ended = status
            yield from Face.release_lease.flow(led, lease)
        except LedgerError as e:
            if parent is not None and fresh is not False and stays(e):
                # Unread (None): the entry never reached its acquisition, so no lease of its
                # own can be on the Child; read fresh, this entry took (or tried) its first.
                led._store.pending.add(UnresolvedChildEnd(
                    parent, self.run_id, turn_end(exc), fence=0 if fresh is None else 1))
                e.fields["deferred"] = True
            raise

    def _write_exit(self, status: RunStatus) -> Flow[None]:
        """Write the Run's remembered exit (and what comes before it), ending it ``status``."""
        try:
            yield from self.ledger._store.resolve_run(self.run_id, self.ledger.clock.now,
                                                      raising=True)
        except LedgerError as e:
            if e.fields.get("finished"):
                self._ended(status)  # finished; only its lease was not given up
            if stays(e):
                e.fields["deferred"] = True  # remembered: written once the database answers
            raise
        self._ended(status)

    def _unfinished(self, exc: BaseException | None, error: LedgerError) -> None:
        """The block's exit could not finish the Run or release its lease (``error``).

        After a block that succeeded that is the news, and ``error`` is raised. After one that
        raised, the block's own exception stays the one the caller sees (``error`` is logged
        and added to it as a note), never replaced by what its exit ran into. Either says when
        the exit stays remembered (``error.fields["deferred"]``: the database did not answer).
        """
        later = ("; this process finishes the Run and releases its lease at its next write "
                 "for the Run (a new session of it), from a thread that tries again meanwhile, "
                 "or at the ledger's close(), if the lease has not lapsed by then "
                 f"({self.lease_ttl_s:g} s after its last renewal); otherwise the Run stays "
                 "running until a session of it ends it"
                 if error.fields.get("deferred") else "")
        if exc is None:
            if later:
                error.add_note(f"leaving the Run session, run {self.run_id!r} was not finished"
                               + later)
            raise error
        log.warning("run %s: could not finish after %r: %s", self.run_id, exc, error)
        exc.add_note(f"leaving the Run session, finishing run {self.run_id!r} or releasing its "
                     f"lease failed too: {type(error).__name__}: {error}{later}")

    def _ended(self, status: RunStatus) -> None:
        self.ended = status
        parent = self._parent
        if parent is not None and parent._state == "open":
            parent._outcome = status  # the parent's last piece of work was this Child Run

    @staticmethod
    def _ledger_kind(ledger: Any) -> tuple[float, str]:
        """The ledger's lease margin and the adapter class a session of this kind sends with.

        The class is named (in :mod:`ledger.adapters`), not imported: see ``__init__``.

        A ledger of the other kind (sync for async) is refused with InvalidArgument.
        """
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._state == "new":
            raise InvalidState("the Run session is not open yet; use it in a with block",
                               run_id=self.run_id)
        if self._state == "ended":
            raise InvalidState(_ENDED, run_id=self.run_id)

    @property
    def lease(self) -> Lease:
        """The Run's lease as the session holds it now (renewed in the background)."""
        self._check_open()
        return self._keeper.lease  # type: ignore[no-any-return]

    def _enter(self) -> None:
        """Claim the Run id on this ledger for this session, or refuse (writing nothing).

        A second session of the Run on this ledger would get the first one's lease back from
        ``acquire_lease`` (this executor's own, under the same fence): its exit would know
        only its own turns, so whichever left first would end the Run, or give up its lease,
        under the other's turns. The claim lasts until the block is left (or its entry
        raised); a session dropped without leaving does not keep it (the registry is weak).
        """
        if self._state != "new":
            raise InvalidState("a Run session is entered once; open a new one with "
                               "ledger.run(...)", run_id=self.run_id)
        led = self.ledger
        with led._open_sessions_lock:
            if led._entries.closing:
                error = closed_error(led._store.where)
                error.fields["run_id"] = self.run_id
                raise error
            other = led._open_sessions.get(self.run_id)
            if other is self:
                # Entered twice at once (two tasks awaiting one session's entry).
                raise InvalidState("a Run session is entered once; share the session the "
                                   "first entry opens", run_id=self.run_id)
            if other is not None:
                keeper = other._keeper
                raise LeaseHeld(
                    f"run {self.run_id!r} already has a Run session open on this ledger "
                    f"(executor {led.executor_id!r}; entered, its block not yet left): a "
                    "second session would share its lease, and the first to leave would end "
                    "the Run under the other's turns. Use the open session: its turns may run "
                    "at once, and threads or tasks can share it; or leave its block first, "
                    "then open a new one",
                    run_id=self.run_id, holder=led.executor_id,
                    expires_at=None if keeper is None else keeper.lease.expires_at,
                    problem="session_open")
            led._open_sessions[self.run_id] = self
            led._entries.begun()

    def _entered(self) -> None:
        """The entry that :meth:`_enter` counted has ended, whichever way."""
        self.ledger._entries.ended_one()

    def _opened(self) -> None:
        """The last step of a successful entry: the session is open, unless the close began.

        The ledger's close waits for entries under way, then gives up the leases of the
        sessions it finds open. An entry that finds the close begun raises the closed
        ledger's :class:`~ledger.errors.InvalidState`, and the entry gives back what it
        took, as any entry that raised does: its lease is released while the database is
        still open (a Child it admitted is ended), so the next session with its id, in any
        executor, resumes the Run at once.
        """
        led = self.ledger
        with led._open_sessions_lock:
            if not led._entries.closing:
                self._state = "open"
                return
        error = closed_error(led._store.where)
        error.fields["run_id"] = self.run_id
        error.add_note(f"the ledger began closing while the Run session of run {self.run_id!r} "
                       "was entering: the entry gave back what it took")
        raise error

    def _leave(self) -> None:
        """The block is left: the session has ended.

        Under the registry's lock, as the ledger's close takes the sessions it finds open
        (:func:`give_up_open`): either the exit comes first and ends the Run as usual, or the
        close does, and the exit writes nothing (:meth:`_closed_under`), so the two never
        write under one lease at once.
        """
        with self.ledger._open_sessions_lock:
            self._state = "ended"

    def _give_up(self) -> bool:
        """Whether the closing ledger releases this open session's lease (its keeper stopped).

        Called under the registry's lock (see :meth:`_leave`). Not a session that is
        entering (the close waited for entries under way, which give back what they took on
        their own; one still entering after that wait holds a lease that lapses), nor left,
        nor one whose keeper lost the Run (the lease is someone else's).
        """
        keeper = self._keeper
        if self._state != "open" or keeper is None or keeper.error is not None:
            return False
        keeper._halt()
        self._given_up = ("the ledger's close gives its lease up (one that the database does "
                          "not take lapses, logged at WARNING)")
        return True

    def _closed_under(self, exc: BaseException | None) -> None:
        """Leave a block whose ledger was closed while it was open (:func:`give_up_open`).

        Nothing is written: the ledger is closed, and its close gave up the lease, or left
        it to lapse. The Run is not finished: it stays resumable. After a block that
        succeeded that is the closed ledger's :class:`~ledger.errors.InvalidState`
        (``problem="ledger_closed"``), raised; after one that raised, its exception stays
        the one raised, noted.
        """
        note = (f"the ledger was closed while the Run session of run {self.run_id!r} was "
                f"open, so the Run was not finished (it stays resumable): {self._given_up}")
        if exc is None:
            error = closed_error(self.ledger._store.where)
            error.fields["run_id"] = self.run_id
            error.add_note(note)
            raise error
        # The close logged what it could not give up; the block's error is the host's news.
        log.info("run %s: left after %r; %s", self.run_id, exc, note)
        exc.add_note(note)

    def _free(self) -> None:
        """The session is over (exited, or its entry raised): give up its claim on its Run id.

        Only if this session holds the claim (see :meth:`_enter`): a second session refused
        at its entry leaves the open one's claim and the Run's cached entries alone. With
        the claim go the Run's entries in the ledger's caches
        (:meth:`~ledger.api.face.Face._drop_cached`).
        """
        led = self.ledger
        with led._open_sessions_lock:
            if led._open_sessions.get(self.run_id) is self:
                del led._open_sessions[self.run_id]
                led._drop_cached(self.run_id)

    @checked
    def child(self, child_id: NewId, *, budget: BudgetArg, plan: Sequence[Route] | None = None,
              grant: GrantArg | None = None, role: Role | None = None,
              **terms: Unpack[Terms]) -> Self:
        """A session for a Child Run, to use in its own ``with`` block inside this one.

        The Child's plan, grant and role may only narrow this Run's; its policy is this Run's;
        its budget is carved from this Run's when it is entered. When its block ends, whatever
        its status, what the Child did not use goes back to this Run (its budget less what it
        posted, what its ``unknown`` Attempts still hold and what it carved for its own
        Children), which may spend it at once; the Child never uses it again. An entry that
        raises once the Child is admitted (a cancellation, ``KeyboardInterrupt``, an error)
        ends a Child that no lease held before (``cancelled``, or ``failed`` for an error) and
        gives its whole carve back before the exception propagates: its id is spent, open the
        next Child under a new one. When the database does not take that ending (it is away:
        the entry's acquisition, the Child's finish or its release raised
        ``DatabaseUnavailable``), the entry's exception still propagates unchanged, with a
        note saying so, and the process remembers the ending under this Run
        (:class:`~ledger.decide.resolve.UnresolvedChildEnd`): as soon as the database answers
        again (this Run's next write, its lease keeper's heartbeat, or the ledger's
        ``close()``, which logs a WARNING only for one still not written then), a Child still
        ``admitted`` whose only lease was the entry's is ended, its lease released and its
        whole carve given back. A Child held before (resumed) stays as it was. It sends
        with this session's adapter (``async with`` for an :class:`AsyncRunSession`'s).

        An admission whose connection was lost after its ``COMMIT`` was sent (PostgreSQL: the
        Child may have landed, its carve taken, or not) is admitted again at once on a new
        connection, and the block runs as if nothing happened. When the database does not
        answer that either, entering raises ``DatabaseUnavailable`` (``operation="admit"``,
        ``resolved=False``, ``deferred=True``) and the process remembers the admission under
        this Run: as soon as the database answers again (this Run's next write, its lease
        keeper's heartbeat, or the ledger's ``close()``), a Child that landed and that no lease
        has held since is ended ``failed`` under this Run's fence and its whole carve given
        back; one that did not land leaves nothing. If this process ends first, or this Run
        was taken over meanwhile, the Child stays admitted with its carve until an operator
        closes it (``failover-ledger run close``) or an entry under its id ends it.

        Args:
            child_id: The Child Run's id.
            budget: Its budget (a :class:`~ledger.Budget` or a mapping of its fields).
            plan: A subset of this Run's frozen routes (default: all of them).
            grant: A grant inside this Run's (default: inherited for the Child's recipients).
            role: Its role (default: this Run's).
            **terms: Other terms of :meth:`Ledger.admit_run`: ``tenant``, ``labels`` and
                ``deadline`` (this Run's by default: its labels under the Child's own, and a
                deadline no later than this Run's), ``selected_route``, ``policy``,
                ``keyless_ok`` (by default what this Run may lack of the Child's routes); not
                ``parent``.

        Raises:
            InvalidArgument: a malformed ``child_id``, ``plan`` or ``role``, or ``parent``
                passed; on entering, a Child broader than this Run (see
                :meth:`Ledger.admit_run`).
            InvalidState: this session is not open.
            BudgetExceeded: (entering) the Child asks for more than this Run has left
                (``AllowanceExhausted`` for calls and retries).
            DatabaseUnavailable: (entering) the database did not answer; after a lost
                acknowledgement of the admission, ``fields["deferred"]`` says the Child is
                ended once it does (above).
        """
        self._check_open()
        if "parent" in terms:
            raise InvalidArgument("a child session's parent is this Run; do not pass parent",
                                  field="parent")
        led = self.ledger.sync if self.ledger.awaiting else self.ledger
        # Cached since the block was entered, and only read (frozen_run hands out a copy).
        frozen = led._runner.run(led._frozen(self.run_id))
        options = cast(SessionOptions, {
            **terms, "budget": budget, "plan": frozen.plan if plan is None else plan,
            "grant": grant, "role": frozen.role if role is None else role,
            "parent": self.lease, "lease_ttl_s": self.lease_ttl_s, "adapter": self._adapter})
        mine = self.admission.get("keyless_ok", ())
        if "keyless_ok" not in terms and mine:
            # The Child sends on routes of this Run: what this Run may lack, it may lack too.
            routes = options["plan"]
            ids = {r.id for r in routes} | {p.id for r in routes for p in r.profiles}
            options["keyless_ok"] = True if mine is True else {k for k in mine if k in ids}
        child = type(self)(self.ledger, child_id, options, owns_adapter=False)
        child._parent = self
        return child

    @contextlib.contextmanager
    def _on_wire(self, d: Dispatch, mine: list[Dispatch]) -> Iterator[None]:
        """While a turn's send runs, its Attempt is in flight.

        ``mine`` holds it for the turn's own stream callback, ``_sending`` for the exit.
        """
        mine[:] = [d]
        self._sending[d.attempt_id] = d
        try:
            yield
        finally:
            self._sending.pop(d.attempt_id, None)
            mine.clear()

    def _watcher(self, on_text: TextCallback | None, on_event: EventCallback | None,
                 mine: list[Dispatch]) -> Callable[[Any], Any] | None:
        """The stream callback of a turn, or ``None`` when the caller watches nothing.

        Text goes to ``on_text``, every event to ``on_event`` (a text delta to ``on_text``
        first, then to ``on_event``), tool-call proposals are remembered. Without a callback
        streamed text stays a buffer, and it is no effective output until the answer
        completes.
        """
        from ledger.adapters.contract import TextDelta, ToolCallProposal

        if on_text is None and on_event is None:
            return None

        def watch(event: Any) -> Any:
            if isinstance(event, ToolCallProposal) and mine:
                # This turn's Attempt: another turn of the session may be sending too.
                self._calls[event.call.id] = (mine[0].attempt_id, event.call.name)
            if on_text is not None and isinstance(event, TextDelta):
                out = on_text(event.text)
                if on_event is None:
                    return out
                if inspect.isawaitable(out):
                    # The driver awaits one result per event: both callbacks' must be in it,
                    # or an async on_text's text never reaches the caller, though the
                    # Attempt records it as shown.
                    return _then(out, on_event, event)
            return on_event(event) if on_event is not None else None

        return watch

    def _remember(self, parts: Sequence[Part], attempt_id: str) -> None:
        for p in parts:
            if p.tool_call_id is not None:
                self._calls[p.tool_call_id] = (attempt_id, p.name or "")

    def proposed(self, call_id: str) -> bool:
        """Whether the tool call ``call_id`` may be answered with :meth:`tool_result`.

        That is when a turn of this session proposed it, or :meth:`adopt_tool_calls` adopted
        it.
        """
        return isinstance(call_id, str) and call_id in self._calls

    def _call_id(self, call: str | Part) -> str:
        """The id of a tool call given by its id or as the call Part itself."""
        if isinstance(call, Part):
            if call.tool_call_id is None:
                raise InvalidArgument(
                    "this Part is not a tool call (it has no tool_call_id); pass one of a "
                    "turn's result.tool_calls, or its tool_call_id", field="call_id")
            return call.tool_call_id
        return call

    def _call(self, call_id: str) -> tuple[str, str]:
        if not isinstance(call_id, str) or call_id not in self._calls:
            raise InvalidArgument(
                f"tool call {call_id!r} was not proposed in this Run session; pass the "
                "tool_call_id of one of a turn's result.tool_calls", field="call_id")
        return self._calls[call_id]

    def _tool_part(self, call_id: str, content: str | Part, data_class: str) -> Part:
        _attempt, name = self._call(call_id)
        if isinstance(content, Part):
            return tool_file(call_id, content, data_class)
        return Part(role="tool", content=content, data_class=data_class, provenance=call_id,
                    tool_call_id=call_id, name=name or None)

    def _adopt(self, parts: Sequence[Part], recorded: Mapping[str, Any]) -> list[str]:
        from ledger.decide.preflight import Coverage, part_coverage

        adopted = []
        for p in parts:
            if p.tool_call_id is None or p.provenance is None or p.tool_call_id in self._calls:
                continue
            # Only a call an Attempt of this Run (or of an ancestor) proposed, exactly as
            # recorded, is adopted: ``recorded`` is not the whole tree's, since a call a child
            # or sibling proposed is that Run's to answer (its tool_started names that Run's
            # Attempt).
            if part_coverage(p, recorded) is Coverage.OK:
                self._calls[p.tool_call_id] = (p.provenance, p.name or "")
                adopted.append(p.tool_call_id)
        return adopted

    def _mark_started(self, call_id: str) -> str:
        attempt_id, _name = self._call(call_id)
        d = self._sending.get(attempt_id)
        if d is not None:
            d.progress.tool_started = True  # a failure of this Attempt may not move on now
        return attempt_id


@checked
class RunSession(_SessionCore):
    """A Run held in a ``with`` block (see the module docstring); made by :meth:`Ledger.run`.

    Entering checks every route's key, admits the Run (or resumes it: the same id and
    content), takes its lease and starts a :class:`~ledger.api.lease.LeaseKeeper`, which renews
    it while the session exists (a session dropped without leaving its block lets it lapse);
    leaving finishes the Run and releases the lease. A session is entered once; its methods
    work only inside the block. An entry that raises once the Run is admitted (an ordinary
    error, such as an adapter that cannot be built, or an interruption such as
    ``KeyboardInterrupt``, even one landing right after the lease's commit) gives back the
    lease it took before the exception propagates unchanged, as the async entry does (a
    cancellation included): a root Run stays admitted, and the next session (any executor)
    enters it at once; a Child Run that no lease had held before is ended (``cancelled``, or
    ``failed`` for an error), which gives its carve back to the parent, or, when the database
    does not answer, as soon as it does, before the parent's next write (:meth:`child`).
    Likewise an exit that an interruption cuts short (a ``KeyboardInterrupt`` landing in its
    finish or release, even right after a commit) completes the finish and release once more
    before the interruption propagates, as the async exit outlasts cancellations: the Run ends as
    its block did, and the next session enters it at once.

    The status the Run ends in: when the block raised, ``cancelled`` for a cancellation
    (``KeyboardInterrupt``, ``asyncio.CancelledError``), else as a stop or an error of a turn
    (below). When the block ends normally, its last turn (or the last Child Run it held)
    decides: ``succeeded`` if it was served; ``cancelled`` if it was cancelled, even if the host
    caught that; after a :class:`~ledger.errors.FailoverExhausted`, ``stopped`` when the policy
    stopped on purpose (:data:`ledger.decide.ending.POLICY_STOPS`: failover off, the budget or
    an allowance spent), else ``failed``; ``failed`` after any other error. A block that tried
    no turn leaves a Run that ended before as it was, ends a Run that never made an Attempt
    ``cancelled``, and a resumed one by its last recorded turn.

    Attributes:
        run_id: The Run's id.
        record: The Run as admitted (``None`` before entering).
        ledger: The :class:`~ledger.Ledger` it runs on.
        ended: The status the block finished the Run with (``None`` until it did).

    Raises:
        InvalidArgument: (building it) an argument of :meth:`Ledger.run` is wrong; (entering)
            a route's key cannot be resolved (the route, the variable, the fix; nothing is
            recorded), or an admission argument is wrong (see :meth:`Ledger.admit_run`).
        AdmissionConflict: (entering) the run id was admitted with other content.
        LeaseHeld: (entering) another live executor holds the Run; or another session of the
            Run is open on this ledger (``fields["problem"] == "session_open"``; entered, its
            block not yet left): share that session between threads or tasks, or leave its
            block first. Nothing is recorded then.
        InvalidState: (entering) the session was entered before, or is being entered at
            once by another thread or task (share the session its first entry opens; that
            entry goes on unaffected), or the Run was closed
            (:meth:`Ledger.close_run`): a closed Run is never resumed (nothing is written).
            (Leaving) the block succeeded but its ledger was closed while it was open
            (``problem="ledger_closed"``): the Run was not finished, and the close gave its
            lease up (a note says whether it was released); nothing is written.
        FencedOut: (leaving) the block succeeded but the Run was taken over, so it could not
            be finished.
        DatabaseUnavailable: (entering or leaving) the database could not be reached; its
            ``fields["operation"]`` names the write. A finish or release whose acknowledgement
            was lost is resolved first (run again under the Run's row lock), so after a block
            that succeeded this is raised only when the database stayed away; then the exit is
            remembered (``fields["deferred"]``) and written as soon as the database answers
            again (the process's next write for the Run, or the ledger's ``close()``), after a
            turn's begin that was never sent is settled ``not_sent`` and a turn's settle the
            database did not take is written (so nothing is in flight). After a block that
            raised, an error of leaving is only logged and added to the block's exception as a
            note: the block's exception is the one raised.

    Example:
        >>> with led.run("task-42", plan=routes, budget={"max_calls": 6, "max_retries": 4,
        ...              "max_cost": "0.50"}) as run:  # doctest: +SKIP
        ...     result = run.turn(Envelope(parts=[Part(content="Compare the filings.")]))
        ...     print(result.text, result.route.id)
    """

    ledger: SyncFace[Any, Any]

    @staticmethod
    def _ledger_kind(ledger: Any) -> tuple[float, str]:
        if not isinstance(ledger, SyncFace):
            raise InvalidArgument("ledger must be a ledger.Ledger (the other kind's sessions "
                                  "come from AsyncLedger.run)", field="ledger")
        return ledger.lease_margin_s, "SyncAdapter"

    # -- the block -------------------------------------------------------------------------

    def __enter__(self) -> RunSession:
        self._enter()
        try:
            return self._open()
        except BaseException:
            self._free()  # after the give-back: the Run's lease is no longer this session's
            raise
        finally:
            self._entered()

    def _open(self) -> RunSession:
        from ledger.api.lease import LeaseKeeper

        # No exit runs for an entry that raised: whatever it took is given back here, or the
        # lease would refuse the Run to every other executor until it lapsed (and a Child's
        # carve would stay out of its parent's budget).
        got = _Entry()
        made = self._adapter is None
        try:
            try:
                # Admission checks every route's key first, with the provider this session
                # sends with.
                self.record = self.ledger.admit_run(
                    self.run_id, **self.admission,
                    secrets=_key_source(self._adapter, self._secrets))
            except BaseException as e:
                got.unadmitted = e
                raise
            got.acquiring = True
            try:
                got.lease = self.ledger.acquire_lease(self.run_id, ttl_s=self.lease_ttl_s)
            except BaseException as e:
                got.refused = e
                raise
            self._keeper = LeaseKeeper(self.ledger, got.lease, ttl_s=self.lease_ttl_s)
            self._keeper._held_by(self)
            self._keeper.start()
            if made:
                from ledger.adapters import SyncAdapter

                self._adapter = SyncAdapter(secrets=self._secrets)
            self._opened()
        except BaseException as e:
            self._give_back(got, e, made)
            raise
        return self

    def _give_back(self, got: _Entry, exc: BaseException, made: bool) -> None:
        """Give back what an entry that raised ``exc`` took (keeper, lease, adapter ``made``).

        ``got`` says how far the entry came (:meth:`_SessionCore._unwind` says what is
        undone). An acquisition that raised anything but the ledger's own refusals
        (``LeaseHeld``, a closed Run, a database that stayed away: they took nothing), such as
        an interruption like ``KeyboardInterrupt`` or an ordinary exception of the driver,
        may land after its commit, the lease taken but never returned: that is resolved as a
        lost acknowledgement is, by acquiring it again (one's own live lease comes back under
        its fence; one that never landed is taken now), then released
        (:func:`_may_have_taken`). Once the lease is taken, whatever raises (starting the
        keeper, building the adapter) finds the keeper, which is stopped, and its lease
        released. A give-back that fails (or is interrupted in its turn) is logged and
        noted on ``exc``, which is raised unchanged: the lease then lapses after its
        ``lease_ttl_s``.
        """
        keeper, self._keeper = self._keeper, None
        adapter = self._adapter if made else None
        self._adapter = None if made else self._adapter
        try:
            if keeper is not None:
                keeper.stop()
                got.lease = keeper.lease
            self.ledger._runner.run(self._unwind(got, exc))
        except BaseException as e:
            _note_kept(self, exc, e)
        finally:
            if adapter is not None:
                adapter.close()

    def __exit__(self, _t: object, exc: BaseException | None, _tb: object) -> None:
        self._leave()
        try:
            self._finish(exc)
        finally:
            # Once the finish and release were written (or remembered): a new session of
            # the Run entering earlier would be handed the lease this exit releases.
            self._free()
            if self._owns_adapter and self._adapter is not None:
                self._adapter.close()

    def _finish(self, exc: BaseException | None) -> None:
        keeper = self._keeper
        if self._given_up is not None:
            keeper.stop()
            self._closed_under(exc)
            return
        try:
            keeper.stop()
            self.ledger._runner.run(self._exit(exc, keeper))
        except LedgerError as e:
            self._write_later(keeper)
            self._unfinished(exc, e)
        except BaseException as stop:
            if isinstance(stop, Exception):
                raise
            self._finish_again(exc, keeper, stop)
            raise

    def _finish_again(self, exc: BaseException | None, keeper: LeaseKeeper,
                      stop: BaseException) -> None:
        """Complete an exit that the interruption ``stop`` cut short, before it propagates.

        ``stop`` is a ``KeyboardInterrupt`` (any exception that is not an ``Exception``) landing
        anywhere in the finish or the release, before or after either committed. The exit
        stays remembered, but it would be written only at the ledger's next write for the Run
        or its ``close()``: meanwhile the Run would stay unfinished and its lease held, refused
        to every other executor (``LeaseHeld``). So it is tried once more here, as the async
        exit outlasts a cancellation: with the status the first try decided on, a write found
        done being the same write. What that try runs into (an error, or a second
        interruption) is logged and noted on ``stop``; the exit then stays remembered, unless
        it was cut short before it was (the lease then lapses after ``lease_ttl_s``).
        """
        try:
            keeper.stop()
            self.ledger._runner.run(self._exit(exc, keeper, again=True))
        except LedgerError as e:
            self._write_later(keeper)
            self._unfinished(stop, e)  # logged, and noted on the interruption
        except BaseException as e:
            self._write_later(keeper)
            later = ("this process writes it at its next write for the Run, from a thread that "
                     "tries again meanwhile, or at the ledger's close()"
                     if self._exit_remembered()
                     else f"its lease lapses in {self.lease_ttl_s:g} s")
            log.warning("run %s: leaving after %r, finishing the Run or releasing its lease "
                        "was interrupted again; %s: %r", self.run_id, stop, later, e)
            stop.add_note(f"leaving the Run session, finishing run {self.run_id!r} or releasing "
                          f"its lease was interrupted again ({type(e).__name__}: {e}); {later}")

    # -- turns -----------------------------------------------------------------------------

    def turn(self, envelope: Envelope, *,
             on_text: OnText | None = None, on_event: OnEvent | None = None,
             turn_id: Id | None = None, send: Send | None = None,
             **options: Unpack[TurnOptions]) -> RunResult:
        """Serve one logical turn of the Run, through the retry owner.

        Args:
            envelope: The whole request (the conversation so far; append the previous turns'
                ``result.parts`` and tool results to it).
            on_text: Receives the answer's text as it streams (this turn only). Text shown
                this way counts as delivered: a failure after it is not silently retried.
            on_event: Receives every stream event (text, tool-call proposals, resets). With
                ``on_text`` too, each text delta goes to ``on_text`` first, then here (not
                when ``on_text`` raised). Either may be a coroutine function: its coroutine
                is awaited before the stream goes on.
            turn_id: Names the logical turn (default: from the envelope's hash).
            send: Replaces the session's adapter: a function of a
                :class:`~ledger.Dispatch` returning a :class:`~ledger.SendResult`.
            **options: The other keyword arguments of :func:`ledger.execute` (``pin``,
                ``denials``, ``reserve``, ``sleeper``, ``on_notice``, ``rng``,
                ``token_counter``); not ``part_hashes``, which the session computes.

        Returns:
            The :class:`~ledger.RunResult`; its ``parts`` are ready to append to the next
            envelope.

        Raises:
            FailoverExhausted: the turn stopped without an answer (every error, the reason).
            InvalidState: the session is not open (before or after its block).
            InvalidArgument: a callback that is not callable, ``part_hashes`` passed, or
                :func:`ledger.execute`'s misuse; an unknown keyword is
                :class:`~ledger.errors.ArgumentMismatch`. Nothing is recorded then, and the
                refused call does not count as the block's last turn.
            FencedOut: the Run was taken over (``LeaseLost``: its lease lapsed).
        """
        from ledger.adapters import sync_sender
        from ledger.api.turn import _turn_sync

        self._check_open()
        # Before the try below: a refused call is not the block's last turn.
        require_parts(envelope)
        mine: list[Dispatch] = []
        sent: list[str] = []  # this turn's Attempts, for _left_under
        led = self.ledger
        inner = send or sync_sender(
            self._adapter, on_event=self._watcher(on_text, on_event, mine),
            # The Run's cached policy, read only (run_policy hands out a copy).
            limits=led._runner.run(led._policy(self.run_id)).streaming)

        def tracked(d: Dispatch) -> SendResult:
            sent.append(d.attempt_id)
            with self._on_wire(d, mine):
                return inner(d)

        try:
            # The arguments were checked as turn()'s. The keeper's lease as it renews it: a
            # turn may outlive the lease it started with.
            result = _turn_sync(self.ledger, self.lease, envelope, tracked,
                                held=lambda: self._keeper.lease, turn_id=turn_id,
                                part_hashes=self._hashes,
                                # turn() refused a part_hashes of the caller's: none in options
                                **cast(dict[str, Any], options))
        except BaseException as e:
            self._turn_ended(turn_end(e))
            left = self._left_under(e, sent)
            if left is not None:
                raise left from e
            raise
        self._turn_ended(RunStatus.SUCCEEDED)
        self._remember(result.parts, result.attempt.attempt_id)
        return result

    def tool_result(self, call_id: Id | Part, content: ToolResult, *,
                    data_class: str = "tool_result") -> Part:
        """Record provenance for a tool's result and return it as a Part for the next turn.

        Args:
            call_id: One of a turn's ``result.tool_calls`` (the Part), or its ``tool_call_id``
                (or that of a call adopted with :meth:`adopt_tool_calls`).
            content: The tool's result, as text (serialise structured results); or a file
                the tool returned, as a user ``Part(data=..., media_type=...)`` (call again
                for each file: a tool part is text). Its bytes, never a link:
                a provider would fetch a link, sending its host what the URL carries.
                Append a turn's results and files call by call, in either order: every
                codec sends all of the turn's tool results first, then the files (the wires
                refuse a file between them). A tool that returned files alone needs no
                text result: its files answer the call (with ``""`` as its text or
                without, no codec sends an empty text; ``docs/adapters.md``). A call
                answered by nothing is refused before the next turn sends anything.
            data_class: The data class of that text or file, which disclosure preflight
                checks (``tool_result``; e.g. ``private_document`` for a tool that reads one);
                never ``user_input`` nor ``system``, the classes that need no provenance.

        Returns:
            A ``tool`` Part whose provenance is ``call_id``, covered by what was just recorded;
            for a file, the file as a ``user`` Part of ``data_class`` with that provenance.

        Raises:
            InvalidArgument: ``call_id`` was not proposed in this session, ``content`` is
                neither text nor an image or document of the user's role, is an ``https://``
                link (``field="content.url"``), ``data_class`` is ``user_input`` or
                ``system``, or the file's own data class differs from
                ``data_class``.
            InvalidState: the session is not open.
            LeaseLost: the Run's lease lapsed (``FencedOut``: the Run was taken over).
        """
        self._check_open()
        call_id = self._call_id(call_id)
        part = self._tool_part(call_id, content, data_class)
        self.ledger.record_provenance(self.lease, call_id, part.content_hash, kind="tool_result")
        return part

    def adopt_tool_calls(self, parts: Sequence[Part]) -> list[str]:
        """Let :meth:`tool_result` answer tool calls an earlier session of this Run proposed.

        For a host resuming a Run after a restart, with the conversation it kept: each tool-call
        part whose provenance the ledger recorded, hash for hash, is adopted; a part the Run did
        not produce is passed over.

        Args:
            parts: The kept conversation's parts (others than tool calls are ignored).

        Returns:
            The call ids adopted.

        Raises:
            InvalidState: the session is not open.
        """
        self._check_open()
        return self._adopt(parts, self.ledger.provenance(self.run_id, tree=False))

    def tool_started(self, call_id: Id | Part) -> None:
        """Record durably that the host started the tool of ``call_id``.

        From now on a failure of its turn never moves to another route (invariant 9). Callable
        from ``on_event`` while the stream that proposed the call still runs.

        Args:
            call_id: The tool call (its Part, or its id), as proposed in this session.

        Raises:
            InvalidArgument: ``call_id`` was not proposed in this session.
            InvalidState: the session is not open.
            LeaseLost: the Run's lease lapsed (``FencedOut``: the Run was taken over).
        """
        self._check_open()
        call_id = self._call_id(call_id)
        attempt_id = self._mark_started(call_id)
        self.ledger.append_event(self.lease, "tool_started", {"call_id": call_id},
                                 attempt_id=attempt_id)

    def compacted(self) -> int:
        """Record that the host compacted this session's context; returns the compaction count.

        Under a sticky profile policy (fased) the next turn chooses its credential profile again
        instead of keeping the session's (a user pin is kept).

        Raises:
            InvalidState: the session is not open.
            LeaseLost: the Run's lease lapsed (``FencedOut``: the Run was taken over).
        """
        self._check_open()
        return self.ledger.record_compaction(self.lease)


@checked
class AsyncRunSession(_SessionCore):
    """The asyncio twin of :class:`RunSession` (``async with``); from :meth:`AsyncLedger.run`.

    The same block, methods and errors, awaited; it sends with an
    :class:`~ledger.adapters.HttpAdapter`, and leaving finishes the Run and releases its lease
    even when the block is cancelled. An entry that raises once the Run is admitted (a
    cancellation, or an ordinary error) gives back the lease it took, and ends a Child Run no
    lease had held before (its carve back to the parent; when the database does not answer,
    as soon as it does: :meth:`RunSession.child`), however often it is cancelled
    meanwhile, before the exception propagates unchanged: the entry waits for its admission's
    and its acquisition's outcomes, which may commit although it was cancelled.
    """

    ledger: AsyncFace[Any, Any]

    @staticmethod
    def _ledger_kind(ledger: Any) -> tuple[float, str]:
        if not isinstance(ledger, AsyncFace):
            raise InvalidArgument("ledger must be a ledger.AsyncLedger (the other kind's sessions "
                                  "come from Ledger.run)", field="ledger")
        return ledger.lease_margin_s, "HttpAdapter"

    async def __aenter__(self) -> AsyncRunSession:
        if "ledger.adapters" not in sys.modules:
            # The first import of the adapters (httpx, the protocols) takes some 0.2 s: off the
            # event loop, which the session must never hold up.
            await self.ledger._store.workers.call(importlib.import_module, "ledger.adapters")
        self._enter()
        try:
            return await self._open()
        except BaseException:
            self._free()  # after the give-back (see RunSession.__enter__)
            raise
        finally:
            self._entered()

    async def _open(self) -> AsyncRunSession:
        from ledger.api.lease import AsyncLeaseKeeper

        # No exit runs for an entry that raised: whatever it took is given back here, or the
        # lease would refuse the Run to every other executor until it lapsed (and a Child's
        # carve would stay out of its parent's budget).
        got = _Entry()
        made = self._adapter is None
        try:
            # The admission (a Child's carves its parent's budget) and the acquisition may
            # commit although the entry was cancelled (the database finishes what it was
            # sent): their outcomes decide what is given back.
            self.record, got.unadmitted, cancelled = await _to_its_end(self.ledger.admit_run(
                self.run_id, **self.admission, secrets=_key_source(self._adapter, self._secrets)))
            _raise_first(cancelled, got.unadmitted)
            # Read now, awaited: child() and the turns then find the frozen Run in the cache.
            await self.ledger._runner.arun(self.ledger._frozen(self.run_id))
            got.acquiring = True
            got.lease, got.refused, cancelled = await _to_its_end(
                self.ledger.acquire_lease(self.run_id, ttl_s=self.lease_ttl_s))
            _raise_first(cancelled, got.refused)
            assert got.lease is not None  # taken: the acquisition raised nothing
            self._keeper = AsyncLeaseKeeper(self.ledger, got.lease, ttl_s=self.lease_ttl_s)
            self._keeper.core._held_by(self)
            self._keeper.start()
            if made:
                from ledger.adapters import HttpAdapter

                self._adapter = HttpAdapter(secrets=self._secrets)
            self._opened()
        except BaseException as e:
            await self._give_back(got, e, made)
            raise
        return self

    async def _give_back(self, got: _Entry, exc: BaseException, made: bool) -> None:
        """Give back what an entry that raised ``exc`` took (keeper, lease, adapter ``made``).

        As :meth:`RunSession._give_back`. The give-back outlasts cancellations of the entry
        (the original ``exc`` is what the entry raises).
        """
        keeper, self._keeper = self._keeper, None
        adapter = self._adapter if made else None
        self._adapter = None if made else self._adapter
        giving = asyncio.ensure_future(self._return_lease(got, keeper, exc))
        await outlast(giving)  # cancelled meanwhile: the give-back still ends first
        failed = _error_of(giving)
        if failed is not None:
            _note_kept(self, exc, failed)
        if adapter is not None:
            await adapter.aclose()

    async def _return_lease(self, got: _Entry, keeper: AsyncLeaseKeeper | None,
                            exc: BaseException) -> None:
        if keeper is not None:
            await keeper.stop()
            got.lease = keeper.lease
        await self.ledger._runner.arun(self._unwind(got, exc))

    async def __aexit__(self, _t: object, exc: BaseException | None, _tb: object) -> None:
        self._leave()
        # The Run is finished and its lease released even when the block was cancelled, as
        # often as it is cancelled meanwhile.
        task = asyncio.ensure_future(self._finish(exc))
        try:
            cancelled = await outlast(task)
            failed = None if task.cancelled() else task.exception()
            if cancelled is not None:
                # The cancellation is the news, as an interruption of a sync exit is: what the
                # finish ran into (it raised only after a block that succeeded) is noted on it.
                if isinstance(failed, LedgerError):
                    self._unfinished(cancelled, failed)
                raise cancelled from failed
            if failed is not None:
                raise failed
        finally:
            self._free()  # the finish has ended (outlasted): see RunSession.__exit__
            if self._owns_adapter and self._adapter is not None:
                await self._adapter.aclose()

    async def _finish(self, exc: BaseException | None) -> None:
        keeper = self._keeper
        await keeper.stop()
        if self._given_up is not None:
            self._closed_under(exc)
            return
        try:
            await self.ledger._runner.arun(self._exit(exc, keeper.core))
        except LedgerError as e:
            self._write_later(keeper.core)
            self._unfinished(exc, e)

    async def turn(self, envelope: Envelope, *,
                   on_text: OnText | None = None, on_event: OnEvent | None = None,
                   turn_id: Id | None = None, send: AwaitedSend | None = None,
                   **options: Unpack[TurnOptions]) -> RunResult:
        """Serve one logical turn (see :meth:`RunSession.turn`).

        The same arguments, errors and result, awaited; ``on_text``, ``on_event`` and ``send``
        may be coroutine functions (given both callbacks, a text delta's ``on_text`` is awaited
        before its ``on_event`` runs).
        """
        from ledger.adapters import async_sender
        from ledger.api.turn import _turn_async

        self._check_open()
        # Before the try below: a refused call is not the block's last turn.
        require_parts(envelope)
        mine: list[Dispatch] = []
        sent: list[str] = []  # this turn's Attempts, for _left_under
        led = self.ledger
        inner = send or async_sender(
            self._adapter, on_event=self._watcher(on_text, on_event, mine),
            limits=(await led._runner.arun(led._policy(self.run_id))).streaming)

        async def tracked(d: Dispatch) -> SendResult:
            sent.append(d.attempt_id)
            with self._on_wire(d, mine):
                return await inner(d)

        try:
            # Checked as turn()'s, with the keeper's lease: see RunSession.turn.
            result = await _turn_async(self.ledger, self.lease, envelope, tracked,
                                       held=lambda: self._keeper.lease, turn_id=turn_id,
                                       part_hashes=self._hashes,
                                       # none of the caller's (refused): see RunSession.turn
                                       **cast(dict[str, Any], options))
        except BaseException as e:
            self._turn_ended(turn_end(e))
            left = self._left_under(e, sent)
            if left is not None:
                raise left from e
            raise
        self._turn_ended(RunStatus.SUCCEEDED)
        self._remember(result.parts, result.attempt.attempt_id)
        return result

    async def tool_result(self, call_id: Id | Part, content: ToolResult, *,
                          data_class: str = "tool_result") -> Part:
        """Record provenance for a tool's result (see :meth:`RunSession.tool_result`)."""
        self._check_open()
        call_id = self._call_id(call_id)
        part = self._tool_part(call_id, content, data_class)
        await self.ledger.record_provenance(self.lease, call_id, part.content_hash,
                                            kind="tool_result")
        return part

    async def adopt_tool_calls(self, parts: Sequence[Part]) -> list[str]:
        """Adopt an earlier session's tool calls (see :meth:`RunSession.adopt_tool_calls`)."""
        self._check_open()
        return self._adopt(parts, await self.ledger.provenance(self.run_id, tree=False))

    async def tool_started(self, call_id: Id | Part) -> None:
        """Record durably that the host started a tool (see :meth:`RunSession.tool_started`).

        Await it from an async ``on_event``.
        """
        self._check_open()
        call_id = self._call_id(call_id)
        attempt_id = self._mark_started(call_id)
        await self.ledger.append_event(self.lease, "tool_started", {"call_id": call_id},
                                       attempt_id=attempt_id)

    async def compacted(self) -> int:
        """Record a compaction of the context; the count (see :meth:`RunSession.compacted`)."""
        self._check_open()
        return await self.ledger.record_compaction(self.lease)


__all__ = ["AsyncRunSession", "RunSession"]
