"""pydantic-ai agents on a ledger Run: :class:`LedgerModel`.

A pydantic-ai ``Model`` whose every request is one turn of an
:class:`~ledger.api.session.AsyncRunSession`.

::

    async with led.run("task-7", plan=routes, budget=budget, grant=grant) as run:
        agent = Agent(LedgerModel(run), tools=[search])
        result = await agent.run("Compare the two filings.")

The Run's frozen plan, policy, budget and grant decide routes, retries and failover; every
physical call is an Attempt. The agent's message history becomes the turn's envelope with the
data classes the ledger's disclosure preflight checks: system prompts and instructions are
``system``, user prompts ``user_input``, the model's earlier answers (text and tool calls)
``model_derived`` with the Attempt that produced them as provenance (carried in
``ModelResponse.provider_details["ledger"]``), and tool returns ``tool_result``, recorded through
the session the first time they are sent (the ``BinaryContent`` a tool returned as the call's
files, of the same class and covered by the call's provenance; a ``ToolReturn``'s ``content``
is a user prompt to pydantic-ai, and goes as ``user_input``). Images and documents in a user
prompt (``BinaryContent``, ``ImageUrl``, ``DocumentUrl``) become binary parts of class
``user_input`` (or the model's ``document_data_class``); the reasoning a route returns to be
carried back (a Responses-API route's encrypted items, Anthropic's thinking blocks, Gemini's
thought signatures) comes back as a ``ThinkingPart`` (an Anthropic block's thinking as its
content) that carries it to that route on the next request; an image or a document the
model returned comes back as a ``FilePart`` (``BinaryImage`` for an image), ``model_derived``
with its Attempt's provenance, and goes back as that assistant part (a file the provider
returned as a link, which a ``FilePart`` cannot hold, is kept in the provider details). A
history the Run did not produce — an edited answer or image, an invented tool call or result —
has no covering provenance and is refused before anything is sent. A stop raises
:class:`~ledger.errors.FailoverExhausted`.

The Run ends as a Run session ends it (:mod:`ledger.decide.ending`): ``succeeded`` only when
the agent's last model request was served; a streamed request the reader left before its end
(``run_stream`` exited early, a ``break`` out of ``stream_text``) was not, and ends the Run
``cancelled`` (the request in flight is cancelled and settled truthfully); a stop the host
caught ends it ``stopped`` or ``failed`` by its reason.

Needs the ``pydantic-ai`` extra (``pip install 'failover-ledger[pydantic-ai]'``).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar

from pydantic import SkipValidation

from ledger.api.session import AsyncRunSession
from ledger.domain.envelope import MODEL_DERIVED, SYSTEM, TOOL_RESULT, USER_INPUT, Envelope, Part
from ledger.domain.envelope import ToolSpec as _ToolSpec
from ledger.domain.media import REASONING_MEDIA_TYPE, MediaKind
from ledger.domain.records import AttemptRecord, RunStatus
from ledger.domain.validation import checked, instance, text
from ledger.errors import InvalidArgument
from ledger.integrations._run import (
    RunLink,
    carried_reasoning,
    in_message,
    media_type_of,
    spliced,
    wait_out,
)

try:
    from pydantic_ai import RunContext
    from pydantic_ai.messages import (
        BinaryContent,
        DocumentUrl,
        FilePart,
        FinishReason,
        ImageUrl,
        ModelMessage,
        ModelRequest,
        ModelRequestAttempt,
        ModelResponse,
        ModelResponsePart,
        ModelResponseStreamEvent,
        SystemPromptPart,
        TextContent,
        TextPart,
        ThinkingPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import (  # the helper every built-in adapter maps requests with
        Model,
        ModelRequestParameters,
        StreamedResponse,
        _sendable_request_parts,
    )
    from pydantic_ai.settings import ModelSettingName, ModelSettings
    from pydantic_ai.usage import RequestUsage
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/test_extras.py
    raise InvalidArgument(
        "ledger.integrations.pydantic_ai needs pydantic-ai: pip install "
        "'failover-ledger[pydantic-ai]'", field="ledger.integrations.pydantic_ai",
        extra="pydantic-ai") from e

# Where a response says which Run and Attempt produced it (read back as provenance).
DETAILS_KEY = "ledger"

# Provider stop reasons, as the adapters report them, in pydantic-ai's normalised terms.
_FINISH: dict[str, FinishReason] = {
    "stop": "stop", "end_turn": "stop", "stop_sequence": "stop", "STOP": "stop",
    "length": "length", "max_tokens": "length", "MAX_TOKENS": "length",
    "tool_calls": "tool_call", "tool_use": "tool_call", "function_call": "tool_call",
    "content_filter": "content_filter", "SAFETY": "content_filter", "refusal": "content_filter",
    "completed": "stop",  # the Responses API's status of a finished response
}

_DONE = object()  # the end of a streamed turn's events


def _attempt_of(response: ModelResponse) -> str | None:
    """The Attempt a response says produced it (``None``: it does not say)."""
    details = response.provider_details or {}
    ledger = details.get(DETAILS_KEY)
    attempt = ledger.get("attempt_id") if isinstance(ledger, dict) else None
    return attempt if isinstance(attempt, str) else None


def _raw_args(part: ToolCallPart) -> str:
    # The ledger recorded the model's arguments verbatim; pydantic-ai's args_as_json_str()
    # re-serialises them compactly, which would hash differently from what was recorded.
    if isinstance(part.args, str):
        return part.args or "{}"
    return json.dumps(part.args) if part.args is not None else "{}"


def response_parts(response: ModelResponse) -> list[Part]:
    """An earlier answer as the envelope parts the ledger recorded for it.

    Its reasoning, its text, its files (``FilePart``: an image or a document the model
    returned; and the links the ledger keeps in the provider details), then one part per tool
    call, each ``model_derived`` with the Attempt named in its provider details.

    An answer whose content was changed (or that no Attempt of the Run produced) yields parts
    whose hash the ledger never recorded: preflight refuses them.
    """
    attempt = _attempt_of(response)
    texts: list[str] = []
    calls: list[Part] = []
    reasoning: list[Part] = []
    files: list[Part] = []
    for p in response.parts:
        if isinstance(p, TextPart):
            texts.append(p.content)
        elif isinstance(p, FilePart):
            files.append(_file_part(p.content.data, p.content.media_type, attempt))
        elif isinstance(p, ThinkingPart) and _carried(p) is not None:
            reasoning.append(Part(role="assistant", data=_carried(p),
                                  media_type=REASONING_MEDIA_TYPE, data_class=MODEL_DERIVED,
                                  provenance=attempt))
        elif isinstance(p, ToolCallPart):
            calls.append(Part(role="assistant", content=_raw_args(p), data_class=MODEL_DERIVED,
                              provenance=attempt, tool_call_id=p.tool_call_id,
                              name=p.tool_name))
        else:
            raise InvalidArgument(
                f"a model response part of kind {p.part_kind!r} cannot be sent through a ledger "
                "Run (only text, files and tool calls are); drop it from the message history",
                field="messages")
    files += [_file_part(None, link.get("media_type"), attempt, url=link.get("url"))
              for link in _links(response)]
    text: list[Part] = []
    if texts or not (calls or files):
        text = [Part(role="assistant", content="".join(texts), data_class=MODEL_DERIVED,
                     provenance=attempt)]
    return reasoning + text + files + calls


def _file_part(data: bytes | None, media_type: Any, attempt: str | None, *,
               url: Any = None) -> Part:
    """A file of an earlier answer as the assistant part the ledger recorded for it."""
    try:
        return Part(role="assistant", media_type=media_type, data_class=MODEL_DERIVED,
                    provenance=attempt, **({"data": data} if data is not None else {"url": url}))
    except InvalidArgument as e:
        raise InvalidArgument(f"a file of a model response cannot be sent: {e.message}",
                              field="messages", part_field=e.field) from e


def _links(response: ModelResponse) -> list[dict[str, Any]]:
    """The file links an answer returned, kept in its provider details.

    A ``FilePart`` holds bytes only.
    """
    ours = (response.provider_details or {}).get(DETAILS_KEY)
    links = ours.get("links") if isinstance(ours, dict) else None
    return [x for x in links if isinstance(x, dict)] if isinstance(links, list) else []


def _carried(part: ThinkingPart) -> bytes | None:
    """The reasoning item a ``ThinkingPart`` carries for the ledger, as its part's data."""
    ours = (part.provider_details or {}).get(DETAILS_KEY)
    data = ours.get("reasoning") if isinstance(ours, dict) else None
    return carried_reasoning(data) if isinstance(data, str) else None


def _media_part(item: Any, data_class: str, whose: str = "user content") -> Part:
    """An image or a document of a user prompt or a tool's return, as a binary part.

    A link stays a link: the ledger never fetches.
    """
    kind = getattr(item, "kind", type(item).__name__)
    if isinstance(item, ImageUrl | DocumentUrl) and item.force_download:
        raise InvalidArgument(
            f"this {kind} with force_download=True asks for the file to be downloaded, and the "
            "ledger never fetches a URL; download it and pass BinaryContent, or leave "
            "force_download False so the provider fetches the link", field="messages")
    try:
        if isinstance(item, BinaryContent):
            return Part(data=item.data, media_type=item.media_type, data_class=data_class)
        try:
            media_type: str | None = item.media_type
        except ValueError:
            # pydantic-ai guesses from the whole URL, which a query string defeats: told from
            # its path as the other integrations do.
            media_type = media_type_of(
                item.url, what=kind, field="messages",
                fix=f"pass {type(item).__name__}(url, media_type='image/png' or "
                    "'application/pdf' ...)")
        return Part(url=item.url, media_type=media_type, data_class=data_class)
    except InvalidArgument as e:
        if e.field == "messages":
            raise
        raise InvalidArgument(f"{whose} of kind {kind!r} cannot be sent: {e.message}",
                              field="messages", part_field=e.field) from e


def _user_parts(part: UserPromptPart, data_class: str) -> list[Part]:
    if isinstance(part.content, str):
        return [Part(content=part.content, data_class=USER_INPUT)]
    out = []
    for item in part.content:
        if isinstance(item, str | TextContent):
            text = item if isinstance(item, str) else item.content
            out.append(Part(content=text, data_class=USER_INPUT))
        elif isinstance(item, BinaryContent | ImageUrl | DocumentUrl):
            out.append(_media_part(item, data_class))
        else:
            raise InvalidArgument(
                f"user content of kind {getattr(item, 'kind', type(item).__name__)!r} cannot be "
                "sent through a ledger Run (its envelopes carry text, images and documents: "
                "BinaryContent, ImageUrl, DocumentUrl)", field="messages")
    return out


def _answer_parts(parts: Sequence[Part]) -> list[ModelResponsePart]:
    """A turn's parts as pydantic-ai response parts (the inverse of :func:`response_parts`)."""
    out: list[ModelResponsePart] = []
    for p in parts:
        if p.kind is MediaKind.REASONING and p.payload is not None:
            out.append(_thinking(p.payload))
    text = "".join(p.content for p in parts if p.tool_call_id is None)
    if text:
        out.append(TextPart(content=text))
    out.extend(FilePart(content=BinaryContent.narrow_type(
        BinaryContent(data=p.payload, media_type=p.media_type or "")))
        for p in parts if _is_file(p) and p.payload is not None)
    out.extend(ToolCallPart(tool_name=p.name or "", args=p.content, tool_call_id=p.tool_call_id)
               for p in parts if p.tool_call_id is not None)
    return out


def _is_file(part: Part) -> bool:
    """Whether ``part`` is an image or a document (not text, not a reasoning item)."""
    return part.kind is not None and part.kind is not MediaKind.REASONING


def _thinking(data: bytes) -> ThinkingPart:
    """A carried reasoning item as a ``ThinkingPart``.

    Its content is what the item shows of the reasoning: a Responses item's summary, an
    Anthropic thinking block's text; nothing for a redacted block or a Gemini thought
    signature (which hold none).
    """
    try:
        item = json.loads(data).get("item", {})
    except (ValueError, AttributeError):
        item = {}
    summary = item.get("summary") if isinstance(item, dict) else None
    text = "".join(s.get("text", "") for s in summary if isinstance(s, dict)) \
        if isinstance(summary, list) else ""
    if isinstance(item, dict) and item.get("type") == "thinking" and isinstance(
            item.get("thinking"), str):
        text = item["thinking"]
    return ThinkingPart(content=text, id=item.get("id") if isinstance(item, dict) else None,
                        provider_name="failover-ledger",
                        provider_details={DETAILS_KEY: {"reasoning": base64.b64encode(data)
                                                        .decode("ascii")}})


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _failed(attempt: AttemptRecord) -> ModelRequestAttempt:
    fact = attempt.fact
    why = [attempt.state.value, attempt.category or (fact.category.value if fact else None)]
    if attempt.http_status is not None:
        why.append(f"HTTP {attempt.http_status}")
    message = f"{' '.join(w for w in why if w)}: {fact.message if fact and fact.message else ''}"
    usage = None
    if attempt.prompt_tokens is not None or attempt.completion_tokens is not None:
        usage = RequestUsage(input_tokens=attempt.prompt_tokens or 0,
                             output_tokens=attempt.completion_tokens or 0)
    return ModelRequestAttempt(
        model_name=attempt.model, provider_name=attempt.provider, outcome="error",
        error=f"attempt {attempt.attempt_id} on route {attempt.route_id}: {message}".strip(": "),
        timestamp=_when(attempt.created_at),
        duration=timedelta(seconds=max(0.0, (attempt.settled_at or attempt.created_at)
                                       - attempt.created_at)),
        usage=usage)


@dataclass(frozen=True)
class _Answer:
    """What a turn's result puts on a pydantic-ai response."""

    parts: list[ModelResponsePart]
    usage: RequestUsage
    model_name: str
    provider_name: str
    provider_response_id: str | None
    finish_reason: FinishReason | None
    details: dict[str, Any]
    failed: list[ModelRequestAttempt] | None
    timestamp: datetime

    @classmethod
    def of(cls, run_id: str, result: Any, parts: Sequence[Part]) -> _Answer:
        """The answer of ``result`` with ``parts``: its parts with stable tool-call ids."""
        att: AttemptRecord = result.attempt
        output = result.output
        raw_finish = getattr(output, "finish_reason", None)
        failed = [_failed(a) for a in result.attempts if a.attempt_id != att.attempt_id]
        details = {DETAILS_KEY: {
            "run_id": run_id, "turn_id": att.turn_id, "attempt_id": att.attempt_id,
            "attempts": [a.attempt_id for a in result.attempts], "route": result.route.id,
            "switched": bool(result.switched),
            "cost": None if att.cost is None else str(att.cost)}}
        notes = list(getattr(output, "notes", ()) or ())
        if notes:  # what the route's codec left out (another route's reasoning), and why
            details[DETAILS_KEY]["notes"] = notes
        links = [{"url": p.link, "media_type": p.media_type} for p in parts
                 if _is_file(p) and p.link is not None]
        if links:  # files the model returned as links: a FilePart holds bytes only
            details[DETAILS_KEY]["links"] = links
        return cls(
            parts=_answer_parts(parts),
            usage=RequestUsage(input_tokens=att.prompt_tokens or 0,
                               output_tokens=att.completion_tokens or 0,
                               cache_read_tokens=att.cached_tokens or 0,
                               output_reasoning_tokens=att.reasoning_tokens or 0),
            model_name=att.model_reported or att.model, provider_name=att.provider,
            provider_response_id=getattr(output, "request_id", None),
            finish_reason=_FINISH.get(raw_finish) if isinstance(raw_finish, str) else None,
            details=details, failed=failed or None,
            timestamp=_when(att.settled_at or att.created_at))

    def response(self) -> ModelResponse:
        return ModelResponse(
            parts=list(self.parts), usage=self.usage, model_name=self.model_name,
            timestamp=self.timestamp, provider_name=self.provider_name,
            provider_response_id=self.provider_response_id, provider_details=self.details,
            finish_reason=self.finish_reason, failed_attempts=self.failed)


# A data class name (e.g. tool_result, user_input or private_document).
_DataClass = Annotated[str, text(empty=False, fix="pass a non-empty data class name such as "
                                  "tool_result")]


class LedgerModel(Model):
    """A pydantic-ai model whose every request is one turn of a ledger Run.

    The model is used inside the Run session's block; each response carries the model that
    actually served it.

    Args:
        run: An open :class:`~ledger.api.session.AsyncRunSession` (``async with
            led.run(...) as run``, on an :class:`~ledger.AsyncLedger`).
        model_name: The name pydantic-ai knows the model by (default: the model of the Run's
            selected route).
        tool_data_class: The data class tool returns (their files too) are recorded under
            (``tool_result``; a host registering e.g. ``private_document`` for a tool that
            reads such documents passes that).
        document_data_class: The data class of the images and documents in user prompts
            (``user_input``, which needs the grant only). Any other class (e.g.
            ``private_document``: uploads the grant must approve per recipient) has each file's
            provenance recorded through the session the first time it is sent, as the
            document's content hash under ``upload-<sha256 prefix>``.
        settings: pydantic-ai's default model settings.

    Raises:
        InvalidArgument: ``run`` is not an async Run session, or ``tool_data_class`` or
            ``document_data_class`` is empty.

    The agent runs with ``await agent.run(...)``, ``agent.run_stream(...)`` or
    ``agent.iter(...)``; not ``agent.run_sync(...)``, which refuses to run inside the event loop
    the async session needs (from synchronous code: ``asyncio.run(main())``, with the ``async
    with led.run(...)`` block inside ``main``).

    Supported model settings: ``max_tokens`` (the envelope's ``max_output_tokens``),
    ``temperature`` and ``top_p`` (envelope parameters). The ledger's policy owns retries and
    timeouts, so ``timeout``, ``max_retries`` and the rest are ignored (pydantic-ai warns about
    the ones that change what a request guarantees).
    """

    unsupported_settings: ClassVar[frozenset[ModelSettingName]] = frozenset({
        "top_k", "timeout", "max_retries", "parallel_tool_calls", "seed", "presence_penalty",
        "frequency_penalty", "logit_bias", "stop_sequences", "extra_headers", "citations",
        "service_tier", "extra_body"})
    # No wire of its own to tell what pydantic-ai's frame tags mean: the routes behind it vary.
    _announces_lookalike_notes = False

    @checked
    def __init__(self, run: Annotated[AsyncRunSession, instance(
            AsyncRunSession, "an async Run session", "pass the run of `async with "
            "led.run(...) as run` (an AsyncLedger's)")], *, model_name: str | None = None,
                 tool_data_class: _DataClass = TOOL_RESULT,
                 document_data_class: _DataClass = USER_INPUT,
                 settings: SkipValidation[ModelSettings | None] = None) -> None:
        super().__init__(settings=settings)
        self.run = run
        self.tool_data_class = tool_data_class
        self.document_data_class = document_data_class
        # The check the integrations make before a turn (RunLink.guard): a request sent
        # without a receipt (by an earlier executor, or by this session) is never sent again.
        # A request the Run stopped may be asked again here (pydantic-ai retries no model call
        # by itself), so the link has no ``retries``: the stop is not remembered as LangChain's
        # and the Agents SDK's are.
        self._link = RunLink(run, who="LedgerModel", tool_data_class=tool_data_class,
                             document_data_class=document_data_class, need_async=True)
        self._model_name = model_name

    @property
    def model_name(self) -> str:
        """The name pydantic-ai knows this model by.

        The given one, else the model of the Run's selected route.
        """
        if self._model_name is not None:
            return self._model_name
        record = self.run.record
        if record is None:
            return "ledger-run"
        selected = next((r for r in record.plan if r.id == record.selected_route),
                        record.plan[0] if record.plan else None)
        return selected.model if selected is not None else "ledger-run"

    @property
    def system(self) -> str:
        """The provider name for telemetry: the ledger stands between the agent and them."""
        return "failover-ledger"

    # -- requests --------------------------------------------------------------------------

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        """Serve one request of the agent as one turn of the Run (buffered)."""
        self._link.check_open()
        settings, params = self.prepare_request(model_settings, model_request_parameters)
        envelope = await self.envelope(messages, settings, params, stream=False)
        turn_id = await self._link.guard(envelope)
        try:
            result = await self.run.turn(envelope, turn_id=turn_id)
        finally:
            self._link.sent(envelope, turn_id, None)
        return (await self._served(result, envelope)).response()

    async def _served(self, result: Any, envelope: Envelope) -> _Answer:
        # A provider that reuses a call id (every call of the fake is call_fake_1) would pair
        # the second tool's return with the first's recorded result: the id is made unique.
        used = [p.tool_call_id for p in envelope.parts if p.tool_call_id]
        return _Answer.of(self.run.run_id, result, await self._link.stable_calls(result, used))

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage],
                             model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None,
                             ) -> AsyncGenerator[StreamedResponse]:
        """Serve one request as one streamed turn.

        Text reaches the agent as it arrives (and so counts as delivered output); tool calls
        come once the answer is complete.
        """
        self._link.check_open()
        settings, params = self.prepare_request(model_settings, model_request_parameters)
        envelope = await self.envelope(messages, settings, params, stream=True)
        turn_id = await self._link.guard(envelope)
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def drive() -> _Answer:
            try:
                return await self._served(await self.run.turn(
                    envelope, on_event=events.put_nowait, turn_id=turn_id), envelope)
            finally:
                events.put_nowait(_DONE)

        task = asyncio.ensure_future(drive())
        try:
            response = LedgerStreamedResponse(model_request_parameters=params,
                                              _name=self.model_name,
                                              _events=events, _turn=task)
            yield response
        finally:
            if not task.done():
                # The agent stopped reading: the turn is cancelled, and settles truthfully.
                task.cancel()
            interrupted = await wait_out(task)
            # Here, not in drive(): a task cancelled before it started never runs its body.
            self._link.sent(envelope, turn_id, None)
            served = not task.cancelled() and task.exception() is None  # (retrieved, too)
            if served and not response._complete:
                # The answer arrived but the reader left before the end of it: the turn was not
                # served to the agent, so the Run does not end succeeded by it.
                self.run._turn_ended(RunStatus.CANCELLED)
            if interrupted:
                raise asyncio.CancelledError

    # -- the envelope ----------------------------------------------------------------------

    async def envelope(self, messages: Sequence[ModelMessage], settings: ModelSettings | None,
                       params: ModelRequestParameters, *, stream: bool) -> Envelope:
        """The turn's envelope for ``messages``.

        Every part has its data class and, for model output and tool returns, the provenance the
        ledger recorded (tool returns are recorded through the session the first time they are
        sent).
        """
        parts: list[Part] = []
        calls: list[Part] = []
        returns: list[tuple[int, int, ToolReturnPart]] = []  # (part index, message index, ...)
        for at, message in enumerate(messages):
            try:
                if isinstance(message, ModelResponse):
                    answer = response_parts(message)
                    calls += [p for p in answer if p.tool_call_id is not None]
                    parts += answer
                    continue
                if not isinstance(message, ModelRequest):
                    raise InvalidArgument("it is not a pydantic-ai message (a ModelRequest or a "
                                          "ModelResponse): drop it from the message history",
                                          field="messages")
                for part in _sendable_request_parts(message.parts):
                    if isinstance(part, SystemPromptPart):
                        parts.append(Part(role="system", content=part.content,
                                          data_class=SYSTEM))
                    elif isinstance(part, UserPromptPart):
                        parts += [await self._link.document(p)
                                  for p in _user_parts(part, self.document_data_class)]
                    elif isinstance(part, ToolReturnPart):
                        returns.append((len(parts), at, part))
                        parts.append(Part(content=""))  # replaced below, once recorded
                    else:
                        raise InvalidArgument(
                            f"a request part of kind {part.part_kind!r} cannot be sent through "
                            "a ledger Run", field="messages")
            except InvalidArgument as e:
                raise in_message(e, "messages", at, f"a {type(message).__name__}") from e
        results: dict[int, list[Part]] = {}
        for index, at, part in returns:
            try:
                results[index] = await self._tool_parts(part, calls)
            except InvalidArgument as e:
                raise in_message(e, "messages", at, "a ModelRequest") from e
        parts = spliced(parts, results)
        lead = next((i for i, p in enumerate(parts) if p.role != "system"), len(parts))
        instructions = self._get_instruction_parts(list(messages), params) or []
        parts[lead:lead] = [Part(role="system", content=i.content, data_class=SYSTEM)
                            for i in instructions]
        return Envelope(parts=parts, tools=_tools(params.tool_defs.values()), stream=stream,
                        **_settings(settings))

    async def _tool_parts(self, part: ToolReturnPart, calls: Sequence[Part]) -> list[Part]:
        """A tool's return as the parts the ledger recorded: its text, then its files.

        The files it returned (``BinaryContent``, alone or in a list) are the call's files, of
        the tool data class and covered by the call's provenance (:meth:`RunLink.tool_parts`).
        """
        files = [_media_part(f, self.tool_data_class, f"a file tool {part.tool_name!r} returned")
                 for f in part.files]
        return await self._link.tool_parts(
            part.tool_call_id, part.tool_name, part.model_response_str(), calls, files,
            field="messages", bytes_fix="BinaryContent(data, media_type=...), not an ImageUrl "
                                        "or a DocumentUrl")


def _tools(defs: Iterable[Any]) -> list[_ToolSpec]:
    return [_ToolSpec(name=d.name, description=d.description or "",
                      parameters=dict(d.parameters_json_schema)) for d in defs]


def _settings(settings: ModelSettings | None) -> dict[str, Any]:
    s = settings or {}
    out: dict[str, Any] = {}
    if s.get("max_tokens") is not None:
        out["max_output_tokens"] = s["max_tokens"]
    tuning = {k: s[k] for k in ("temperature", "top_p") if s.get(k) is not None}
    if tuning:
        out["params"] = tuning
    return out


@dataclass
class LedgerStreamedResponse(StreamedResponse):
    """The stream of one turn.

    Text deltas as they arrive; the answer's tool calls, usage, the served model and the Attempt
    ids once the turn completes. A stop raises :class:`~ledger.errors.FailoverExhausted` from
    the iteration.
    """

    _name: str = ""
    _events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _turn: asyncio.Future[Any] | None = None
    _timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))
    _answer: _Answer | None = None
    _complete: bool = False  # the reader read to the end: the whole answer reached the agent

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        from ledger.adapters.contract import TextDelta

        while (event := await self._events.get()) is not _DONE:
            if isinstance(event, TextDelta) and event.text:
                for ev in self._parts_manager.handle_text_delta(vendor_part_id="text",
                                                                content=event.text):
                    yield ev
        assert self._turn is not None
        answer: _Answer = await self._turn  # a stop raises here
        self._answer = answer
        self._usage = answer.usage
        self.provider_details = answer.details
        self.provider_response_id = answer.provider_response_id
        self.finish_reason = answer.finish_reason
        self.failed_attempts = answer.failed
        for index, part in enumerate(answer.parts):
            # The answer's files arrive whole, once the turn completed (as its tool calls).
            if isinstance(part, FilePart):
                yield self._parts_manager.handle_part(vendor_part_id=f"file-{index}",
                                                      part=part)
            elif isinstance(part, ToolCallPart):
                yield self._parts_manager.handle_part(vendor_part_id=part.tool_call_id,
                                                      part=part)
        self._complete = True

    def get(self) -> ModelResponse:
        """The response so far.

        Once the turn completed, exactly the answer the ledger recorded (text a policy discarded
        after showing it is not part of it).
        """
        response = super().get()
        if self._answer is None:
            return response
        return replace(response, parts=list(self._answer.parts))

    async def close_stream(self) -> None:
        """Cancel the turn (it settles truthfully: a sent request becomes ``unknown``)."""
        if self._turn is not None and not self._turn.done():
            self._turn.cancel()

    @property
    def model_name(self) -> str:
        """The served model once known, else the name the agent knows the model by."""
        return self._answer.model_name if self._answer is not None else self._name

    @property
    def provider_name(self) -> str | None:
        """The provider of the route that served the answer, once known."""
        return self._answer.provider_name if self._answer is not None else None

    @property
    def provider_url(self) -> None:
        """Not one URL: the routes of the Run's plan have their own."""
        return None

    @property
    def timestamp(self) -> datetime:
        """When the stream was opened."""
        return self._timestamp


__all__ = ["DETAILS_KEY", "LedgerModel", "LedgerStreamedResponse", "response_parts"]
