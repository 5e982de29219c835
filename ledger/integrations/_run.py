"""What the framework integrations share: a Run session seen the same way, sync or async.

The integrations (LangChain/LangGraph, the OpenAI Agents SDK, pydantic-ai) turn a framework's
model call into one turn of the Run a ``with led.run(...)`` block holds. Around that turn they
need the same few things, written once here:

- the session checked open, with an error that names the fix when it is not (a middleware or
  a model used outside its Run's block);
- a route name the framework asks for (``LedgerChatModel(run, route=...)``, an Agents SDK
  ``Agent(model=...)``) checked against the Run's frozen plan and turned into the turn's
  ``denials`` (the routes before it in the plan are not used for that request);
- tool results recorded through the session the first time they are sent (adopting the calls
  an earlier session proposed, for a host resuming after a crash), with the images and
  documents a tool returned as the call's files (of the tool's data class, covered by the
  call's provenance: never the user's input), and images or documents of a class other than
  ``user_input`` recorded as uploads;
- the media type of a file a framework gives by link or by name only, told from its URL's
  path or its file name, or refused with the fix (never guessed as a PDF);
- stable tool-call ids: an id a provider did not give (the adapters number such calls
  ``call_0``, ``call_1`` ...) or one the Run used already is replaced by one derived from the
  Attempt, whose part the integration records as that Attempt's provenance (and an audit
  event ``tool_call_id`` says which provider id it stands for);
- two guards that keep the Run the only retry owner: a request the Run stopped is not sent
  again in the same session (a retry the framework makes around the ledger, refused naming
  that framework's own retry mechanisms), and a request
  sent without a receipt (``unknown``, or still ``dispatching`` when its executor died) is not
  sent again: not after a resume (LangGraph re-runs an interrupted node), not in the same
  session (a cancelled or timed-out call asked again), and not while it is still in flight in
  another thread or task of the session. Streamed or not, a request is the same one.

A sync :class:`~ledger.RunSession` never suspends, so the shared code is written once as
coroutines and :func:`drive` runs it to completion for the blocking paths.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import mimetypes
import re
import threading
import weakref
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ledger.api.session import AsyncRunSession, RunSession, tool_file
from ledger.decide.preflight import Denials
from ledger.domain.envelope import USER_INPUT, Envelope, Part
from ledger.domain.media import bytes_digest
from ledger.domain.records import AttemptState
from ledger.errors import FailoverExhausted, InvalidArgument, InvalidState, LedgerError
from ledger.forking import in_child

T = TypeVar("T")

# Positional ids for a tool call whose provider sent none (Gemini's functionCall has no id),
# as the built-in adapters gave them before they made random ones and a host's own adapter may
# still: the next answer would reuse them.
_PLACEHOLDER = re.compile(r"call_\d+")


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the shared code over a blocking session)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a blocking Run session's call suspended")  # pragma: no cover


async def wait_out(task: asyncio.Future[Any]) -> bool:
    """Wait until ``task`` has ended, however often the waiting task is cancelled meanwhile.

    Returns whether it was: the caller raises :class:`asyncio.CancelledError` once its
    bookkeeping (:meth:`RunLink.sent`) ran. A second cancellation (the Agents SDK's and
    pydantic-ai's timeouts cancel, then cancel the draining again) would otherwise skip it,
    and the request would stay in flight for the rest of the session. ``task`` is not cancelled
    again: it is settling its Attempt truthfully.
    """
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def turn_ids_of(envelope: Envelope, part_hashes: Sequence[str] | None = None
                ) -> tuple[str, str]:
    """The integrations' turn id of ``envelope``, and the other id the same request has had.

    Streamed or not, it is one request (a LangGraph node's ``invoke`` streams under
    ``stream_mode="messages"``): its id is that of the envelope sent unstreamed, so a graph
    that crashed under one mode and resumes under the other finds its earlier Attempts. The
    second id is the streamed envelope's, which the integrations gave a streamed request
    before they named turns so; the guard looks for unreceipted Attempts under both.
    ``part_hashes``: the parts' hashes when computed already.
    """
    if part_hashes is None:
        part_hashes = [p.content_hash for p in envelope.parts]
    plain, streamed = (envelope.model_copy(update={"stream": s}).hash_with(part_hashes)
                       for s in (False, True))
    return f"turn-{plain[7:19]}", f"turn-{streamed[7:19]}"


def spliced(parts: Sequence[Part], at: dict[int, list[Part]]) -> list[Part]:
    """``parts`` with the part at each index of ``at`` replaced by the parts given there."""
    return [q for i, p in enumerate(parts) for q in at.get(i, [p])]


def in_message(error: InvalidArgument, field: str, at: int, what: str) -> InvalidArgument:
    """``error`` naming the message of the history it is about (``messages[3]``, ``input[3]``).

    A history holds many messages of one kind (a tool result per call), and what the ledger
    refuses in one (an id over 200 characters, a link a tool returned) says nothing of which.

    Args:
        error: The refusal, its ``field`` the history's or a part's (``tool_call_id``, ...).
        field: The framework's name for its history (``messages``, ``input``): the new error's
            field, and how its message names the message (``messages[3]``).
        at: The message's index in that history: the new error's ``message_index``.
        what: The message as the framework calls it (``a ToolMessage``), for the message.

    Returns:
        The refusal with ``message_index``, and ``part_field`` where a part's field was
        refused (``None``: the message itself was).
    """
    inner = error.fields.get("part_field") or (None if error.field == field else error.field)
    return InvalidArgument(f"{field}[{at}] ({what}): {error.message}", field=field,
                           message_index=at, part_field=inner)


def carried_reasoning(text: str) -> bytes:
    """A reasoning item the ledger handed back with an answer (as base64), as its part's data.

    A framework keeps it in the answer's metadata, where a host can change or cut it; what does
    not decode is refused as the reasoning it is, not as a bare ``binascii.Error``.
    """
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(
            "a reasoning item the ledger returned with an earlier answer is not valid base64 "
            "(it was changed or cut): pass the answer as the ledger returned it, or drop its "
            "reasoning", field="reasoning") from None


def media_type_of(url: str | None, filename: str | None = None, *, what: str, fix: str,
                  field: str) -> str | None:
    """The media type of a file a framework gave by link, or as bytes with a file name only.

    A ``data:`` URL says its own (``None``: the part reads it there). Otherwise it is told by
    extension from the URL's path, then from ``filename`` (``.png``, ``.pdf``, ``.txt``, ...):
    the frameworks' links carry no type, and a type assumed instead (every file a PDF) would
    send the provider a text file as a PDF document.

    Args:
        url: The file's URL, if it was given by one.
        filename: The file's name, where the framework gives one.
        what: The file, for the message (``the input_image``, ``the image block``, ...).
        fix: How to give the type in the framework's terms, for the message.
        field: The error's field.

    Raises:
        InvalidArgument: neither the URL nor the file name tells the type.
    """
    if url is not None and url[:5].lower() == "data:":
        return None
    for name in (urlsplit(url).path if url else None, filename):
        guessed = _by_extension(name) if name else None
        if guessed is not None:
            return guessed
    if url:
        shown = f"{what} {url[:80]!r} cannot be told from its URL" + (
            f" nor from its file name {filename!r}" if filename else "")
    else:
        shown = f"{what} cannot be told " + (
            f"from its file name {filename!r}" if filename else "without a file name")
    raise InvalidArgument(f"the media type of {shown}; {fix}", field=field)


# The extensions of the types a part may carry, said here: ``mimetypes`` reads the host's
# /etc/mime.types, so a slim image (no such file) did not know ``.md`` or ``.webp``, and one
# link worked on one host and was refused on another.
_EXTENSIONS = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".gif": "image/gif", ".webp": "image/webp", ".pdf": "application/pdf",
               ".txt": "text/plain", ".md": "text/markdown", ".markdown": "text/markdown",
               ".csv": "text/csv"}


def _by_extension(name: str) -> str | None:
    """The media type ``name``'s extension says: the ledger's own table, then the host's."""
    dot = name.rfind(".")
    own = _EXTENSIONS.get(name[dot:].lower()) if dot > name.rfind("/") else None
    return own or mimetypes.guess_type(name)[0]


@dataclass
class _Memory:
    """What the integrations remember per Run session (shared by every model of it)."""

    results: dict[str, list[Part]] = field(default_factory=dict)  # call id -> its result, files
    documents: set[str] = field(default_factory=set)  # hashes of uploads recorded
    stopped: dict[str, FailoverExhausted] = field(default_factory=dict)  # turn id -> stop
    orphans: dict[str, list[str]] | None = None  # turn id -> attempts sent without a receipt
    mine: set[str] = field(default_factory=set)  # turn ids this session sent
    running: set[str] = field(default_factory=set)  # turn ids in flight (any thread or task)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards ``running``
    # Tool-call ids the Run used: recorded refs (read once), sent, or handed out by this session.
    call_ids: set[str] | None = None


_MEMORY: weakref.WeakKeyDictionary[Any, _Memory] = weakref.WeakKeyDictionary()
_MEMORY_LOCK = threading.Lock()  # a blocking session's calls may start in several threads


@in_child
def _forked_memory_lock() -> None:
    # Held by another thread of the parent as the fork came, it would never be released.
    global _MEMORY_LOCK
    _MEMORY_LOCK = threading.Lock()


class RunLink:
    """A Run session as the integrations use it: checked, awaited alike, remembered.

    Args:
        run: The session (``with led.run(...) as run`` or ``async with``).
        who: The integration's name, for messages (``LedgerMiddleware``, ...).
        route: A route of the Run's plan whose predecessors the requests do not use
            (``None``: every route of the plan).
        tool_data_class: The data class tool results are recorded under.
        document_data_class: The data class of the images and documents of user messages.
        need_async: ``True`` when only an :class:`~ledger.AsyncRunSession` will do.
        retries: The framework's own ways of sending a request again (its retry middleware,
            settings, wrappers), named as the fix when one sends a request the Run stopped.
            ``None``: the framework retries no model call itself, so a stopped request asked
            again is the host's new request, and is sent.

    Raises:
        InvalidArgument: ``run`` is not a Run session (of the kind needed), a data class is
            empty, or ``route`` is not a route of the Run's frozen plan.
        InvalidState: the session is not open (``route`` needs its plan).
    """

    def __init__(self, run: Any, *, who: str, route: str | None = None,
                 tool_data_class: str = "tool_result", document_data_class: str = USER_INPUT,
                 need_async: bool = False, retries: str | None = None) -> None:
        kinds: tuple[type[Any], ...] = (AsyncRunSession,) if need_async else (
            AsyncRunSession, RunSession)
        if not isinstance(run, kinds):
            want = ("the async Run session of `async with led.run(...) as run` (an "
                    "AsyncLedger's)" if need_async else
                    "the Run session of `with led.run(...) as run` (a Ledger's) or of "
                    "`async with` (an AsyncLedger's)")
            raise InvalidArgument(f"{who} takes {want}; got {type(run).__name__}",
                                  field="run")
        for name, value, example in (("tool_data_class", tool_data_class, "tool_result"),
                                     ("document_data_class", document_data_class,
                                      "user_input or private_document")):
            if not isinstance(value, str) or not value:
                raise InvalidArgument(f"{name} is a data class name (e.g. {example})",
                                      field=name)
        self.run = run
        self.who = who
        self.is_async = isinstance(run, AsyncRunSession)
        self.tool_data_class = tool_data_class
        self.document_data_class = document_data_class
        self.route = route
        self.retries = retries
        self.denials: Denials | None = None
        if route is not None:
            self.denials = self._denials(route)

    # -- the session ---------------------------------------------------------------------

    @property
    def memory(self) -> _Memory:
        """What the integrations remember of this session."""
        with _MEMORY_LOCK:
            found = _MEMORY.get(self.run)
            if found is None:
                found = _MEMORY[self.run] = _Memory()
            return found

    def check_open(self) -> None:
        """Refuse a call outside the Run's block, before anything is recorded.

        Raises:
            InvalidState: the session was never entered, or its block was left.
        """
        try:
            self.run.lease  # noqa: B018 - the session's own open check
        except InvalidState as e:
            state = "has not been entered yet" if self.run.record is None else "has ended"
            raise InvalidState(
                f"{self.who} was used outside its Run: the session of Run "
                f"{self.run.run_id!r} {state}. Build and call the agent inside the block "
                "(`with led.run(...) as run:` or `async with`), or open the Run again with "
                "the same id and content to resume it", run_id=self.run.run_id) from e

    def check_async(self) -> None:
        """Refuse a blocking call (``invoke``, ``stream``) on an async session.

        Raises:
            InvalidArgument: the session is an :class:`~ledger.AsyncRunSession`.
        """
        if self.is_async:
            raise InvalidArgument(
                f"{self.who} holds an async Run session (AsyncLedger.run): call it with "
                "ainvoke/astream (agent.ainvoke, graph.astream, ...), or hold the Run with "
                "Ledger.run to call it with invoke/stream", field="run")

    def _denials(self, route: str) -> Denials:
        if not isinstance(route, str) or not route:
            raise InvalidArgument("route is the id of a route of the Run's plan",
                                  field="route")
        self.check_open()
        plan = [r.id for r in self.run.record.plan]
        if route not in plan:
            raise InvalidArgument(
                f"route {route!r} is not in the frozen plan of Run {self.run.run_id!r} "
                f"(its routes: {', '.join(plan)}); ask for one of them, or for none to use "
                "the plan as it is", field="route", route=route, plan=plan)
        return Denials(routes=frozenset(plan[:plan.index(route)]))

    async def _call(self, value: Any) -> Any:
        return await value if self.is_async else value

    # -- before a turn -------------------------------------------------------------------

    async def guard(self, envelope: Envelope) -> str:
        """The turn id of ``envelope``, after checking the Run may send it.

        A turn id the guard lets through is in flight until :meth:`sent` is called for it,
        which every caller does however the call ends.

        Raises:
            InvalidArgument: the Run stopped this very request in this session before (a
                retry made around the ledger, by a framework with ``retries``).
            FailoverExhausted: (reason ``execution_unknown``) this request was sent before
                (by an earlier executor of the Run, or by this session: a cancelled or
                timed-out call) and no receipt came, or it is in flight in another thread or
                task of this session: the ledger never sends it again.
        """
        memory = self.memory
        # Hashed through the session's own memo: the turn that follows finds these parts
        # hashed (a conversation's documents and images were hashed twice a call).
        turn_id, streamed = turn_ids_of(envelope, self.run._hashes.of(envelope))
        stop = memory.stopped.get(turn_id) if self.retries is not None else None
        if stop is not None:
            raise InvalidArgument(
                f"{self.who}: the Run stopped this request ({stop.reason}) and it is being "
                "sent again. The Run is the retry owner and already retried and failed over "
                f"as its policy allows: remove the retry around it ({self.retries}), or "
                "continue the conversation with another request",
                field="retry", reason=stop.reason) from stop
        with memory.lock:
            # Taken before the first await: two tasks asking the same request at once must
            # not both pass the checks below.
            if turn_id in memory.running:
                raise FailoverExhausted(
                    f"{self.who}: this request is in flight in this session of Run "
                    f"{self.run.run_id!r} (another thread or task is sending it, e.g. a call "
                    "a timeout gave up on, which a blocking session cannot cancel) and its "
                    "outcome is not known yet; the ledger never sends a request twice. Wait "
                    "for that call to end, or go on with another request",
                    [LedgerError(f"turn {turn_id}: in flight, outcome not known yet")],
                    reason="execution_unknown", attempts=[],
                    detail="in flight in this session; outcome not known yet")
            memory.running.add(turn_id)
        try:
            sent, by = await self._unreceipted(turn_id, streamed)
        except BaseException:
            self._release(turn_id)
            raise
        if sent:
            self._release(turn_id)
            raise FailoverExhausted(
                f"{self.who}: this request was sent before by {by} of Run "
                f"{self.run.run_id!r} (attempt {', '.join(sent)}) and no receipt came; the "
                "ledger never sends a request whose execution is unknown again. Settle the "
                "attempt with evidence (Ledger.settle_unknown) or go on with another request",
                [LedgerError(f"attempt {a} of turn {turn_id}: sent, outcome unknown")
                 for a in sent],
                reason="execution_unknown", attempts=sent,
                detail=f"sent by {by} of the Run; outcome unknown")
        memory.mine.add(turn_id)
        return turn_id

    async def _unreceipted(self, turn_id: str, streamed: str) -> tuple[list[str], str]:
        """The Attempts of this request sent without a receipt, and who sent them."""
        memory = self.memory
        unsettled = (AttemptState.UNKNOWN, AttemptState.DISPATCHING)
        if turn_id in memory.mine:
            # This session sent it before: read again, its Attempts settled since.
            return [a.attempt_id
                    for a in await self._call(self.run.ledger.timeline(self.run.run_id))
                    if a.turn_id == turn_id and a.state in unsettled], "this session"
        if memory.orphans is None:
            # Read once per session: while it holds the lease no other executor sends, and
            # the Attempts this session makes are of turns in ``mine``, read above.
            orphans: dict[str, list[str]] = {}
            for a in await self._call(self.run.ledger.timeline(self.run.run_id)):
                if a.state in unsettled:
                    orphans.setdefault(a.turn_id, []).append(a.attempt_id)
            memory.orphans = orphans
        return [*memory.orphans.get(turn_id, []),
                *memory.orphans.get(streamed, [])], "an earlier executor"

    def _release(self, turn_id: str) -> None:
        with self.memory.lock:
            self.memory.running.discard(turn_id)

    def sent(self, envelope: Envelope, turn_id: str, error: BaseException | None) -> None:
        """Remember a turn of this session ended (and its stop, which is not retried).

        A stop is remembered only where the framework has retries of its own (``retries``):
        elsewhere the same request asked again is the host's, and is sent.
        """
        self._release(turn_id)
        if isinstance(error, FailoverExhausted) and self.retries is not None:
            self.memory.stopped[turn_id] = error

    # -- parts that need recording --------------------------------------------------------

    async def document(self, part: Part) -> Part:
        """A user's image or document of a class that needs provenance, with it recorded.

        Recorded once, the first time it is sent, as ``upload-<sha256 prefix>``.
        """
        if part.media_type is None or part.data_class == USER_INPUT:
            return part
        payload = part.payload
        ref = "upload-" + bytes_digest(payload if payload is not None
                                       else (part.url or "").encode())[:32]
        made = Part.model_validate({**part.model_dump(), "provenance": ref})
        digest = made.content_hash
        if digest not in self.memory.documents:
            await self._call(self.run.ledger.record_provenance(self.run.lease, ref, digest,
                                                               "document"))
            self.memory.documents.add(digest)
        return made

    async def tool_parts(self, call_id: str, name: str | None, content: str,
                         calls: Sequence[Part], files: Sequence[Part] = (), *,
                         field: str = "messages", bytes_fix: str = "") -> list[Part]:
        """A tool's result as the parts the ledger recorded (recorded now, the first time).

        The text result, then the images and documents the tool returned (``files``, user
        parts of :attr:`tool_data_class`) as the call's files: covered by the call's
        provenance, as ``run.tool_result(call, Part(...))`` makes them. A tool's file is not
        the user's input, which needs no provenance and reaches recipients the grant approved
        for the user's input only. Every codec sends a turn's tool results before its files.

        A result for a call no Attempt of the Run proposed, or with other content (text or
        files) than was first sent for that call, stays unrecorded: preflight refuses it.

        Raises:
            InvalidArgument: (``field``) a file is an ``https://`` link (``bytes_fix`` says
                how the framework's tool returns bytes instead), or a file the session would
                refuse as a tool's.
        """
        memory = self.memory
        unrecorded = [Part(role="tool", content=content, data_class=self.tool_data_class,
                           provenance=call_id, tool_call_id=call_id, name=name or None),
                      *(self._tool_file(call_id, name, f, field, bytes_fix) for f in files)]
        if call_id in memory.results:
            first = memory.results[call_id]
            same = first[0].content == content and [p.content_hash for p in first[1:]] == [
                p.content_hash for p in unrecorded[1:]]
            return list(first) if same else unrecorded
        if not self.run.proposed(call_id):
            # Proposed by an earlier session of the Run (a host resuming with the history it
            # kept): its result counts as that session recorded it, and a call no Attempt of
            # the Run proposed is never adopted.
            recorded = await self._call(self.run.ledger.provenance(self.run.run_id))
            if call_id in recorded:
                return unrecorded
            if call_id not in await self._call(self.run.adopt_tool_calls(list(calls))):
                return unrecorded
        made: Part
        if name:
            # Named as the conversation's call, which the request carries beside it (Gemini
            # pairs a functionResponse with its functionCall by name): the session names a
            # call id by the latest Attempt that proposed it, and a provider that reuses ids
            # (another conversation of the Run got the same one) would make that another tool.
            made = unrecorded[0]
            await self._call(self.run.ledger.record_provenance(
                self.run.lease, call_id, made.content_hash, "tool_result"))
        else:
            made = await self._call(self.run.tool_result(call_id, content,
                                                         data_class=self.tool_data_class))
        parts = [made]
        for file in files:
            parts.append(await self._call(self.run.tool_result(
                call_id, file, data_class=self.tool_data_class)))
        memory.results[call_id] = parts
        return list(parts)

    def _tool_file(self, call_id: str, name: str | None, file: Part, field: str,
                   bytes_fix: str) -> Part:
        """A file a tool returned as the call's file, or the error in the framework's terms."""
        tool = f"tool {name or call_id!r}"
        if file.link is not None:
            raise InvalidArgument(
                f"{self.who}: {tool} returned a link ({file.link[:80]!r}); a provider would "
                "fetch it, and the link's host, which no grant names, would receive whatever "
                "the URL carries, so the ledger never sends a link a tool returned. Have the "
                f"tool fetch the file, check it and return its bytes ({bytes_fix})",
                field=field)
        try:
            return tool_file(call_id, file, self.tool_data_class)
        except InvalidArgument as e:
            raise InvalidArgument(f"{self.who}: a file {tool} returned cannot be sent: "
                                  f"{e.message}", field=field, part_field=e.field) from e

    # -- after a turn ---------------------------------------------------------------------

    async def stable_calls(self, result: Any, used: Iterable[str]) -> list[Part]:
        """The turn's parts, each tool call with an id that is stable and unique in the Run.

        A call with a positional id (``call_<n>``, from an adapter that numbers the calls a
        provider gave no id; the built-in ones make random ids), or one that the Run
        used already (in this conversation, ``used``; in another conversation of the Run, such
        as a subagent's; a ref the ledger recorded; or an earlier call of the same answer),
        gets ``call_<24 hex>`` derived from its Attempt and position; that part is recorded as
        the Attempt's provenance, an event ``tool_call_id`` names the id it stands for, and
        the session adopts it so that its result can be recorded.
        """
        attempt_id: str = result.attempt.attempt_id
        memory = self.memory
        if memory.call_ids is None:
            if not any(p.tool_call_id is not None for p in result.parts):
                return list(result.parts)
            # Read once per session: while it holds the lease no other executor records.
            recorded = await self._call(self.run.ledger.provenance(self.run.run_id))
            with memory.lock:
                if memory.call_ids is None:
                    memory.call_ids = set(recorded)
                else:  # another turn of the session read them meanwhile, and took ids since
                    memory.call_ids.update(recorded)
        # Each id is claimed at once, under the lock: turns of one session run at once (tasks
        # awaiting between the claim and the records, or a blocking session's threads).
        claimed: list[tuple[Part, str | None]] = []
        with memory.lock:
            taken = memory.call_ids
            assert taken is not None
            taken.update(used)
            index = 0
            for part in result.parts:
                call_id = part.tool_call_id
                new_id = None
                if call_id is not None:
                    if _PLACEHOLDER.fullmatch(call_id) or call_id in taken:
                        new_id = "call_" + hashlib.sha256(f"{attempt_id}/{index}".encode()) \
                            .hexdigest()[:24]
                    taken.add(new_id or call_id)
                    index += 1
                claimed.append((part, new_id))
        out: list[Part] = []
        renamed: list[Part] = []
        for part, new_id in claimed:
            if new_id is not None:
                fresh = Part.model_validate({**part.model_dump(), "tool_call_id": new_id})
                # The ledger's own record under the Attempt: a host's may not name one.
                await self._call(self.run.ledger._record_tool_call(
                    self.run.lease, attempt_id, fresh.content_hash))
                await self._call(self.run.ledger.append_event(
                    self.run.lease, "tool_call_id",
                    {"provider_id": part.tool_call_id, "call_id": new_id},
                    attempt_id=attempt_id))
                renamed.append(fresh)
                part = fresh
            out.append(part)
        if renamed:
            await self._call(self.run.adopt_tool_calls(renamed))
        return out


def attempts_detail(result: Any, run_id: str) -> dict[str, Any]:
    """What the ledger recorded for a served turn, as the frameworks' metadata carries it."""
    att = result.attempt
    return {"run_id": run_id, "turn_id": att.turn_id, "attempt_id": att.attempt_id,
            "attempts": [a.attempt_id for a in result.attempts], "route": result.route.id,
            "switched": bool(result.switched),
            "cost": None if att.cost is None else str(att.cost)}


__all__ = ["RunLink", "attempts_detail", "carried_reasoning", "drive", "in_message",
           "media_type_of", "spliced", "turn_ids_of", "wait_out"]
