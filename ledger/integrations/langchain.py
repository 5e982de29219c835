"""LangChain v1 and LangGraph on a ledger Run: :class:`LedgerMiddleware`, :class:`LedgerChatModel`.

``create_agent`` (and the agents built on it, Deep Agents included) gets the ledger with one
middleware; a plain LangGraph node with a chat model::

    with led.run("task-7", plan=routes, budget=budget, grant=grant) as run:
        agent = create_agent(LedgerChatModel(run), tools=[search],
                             middleware=[LedgerMiddleware(run)])
        agent.invoke({"messages": [("user", "Compare the two filings.")]})

        model = LedgerChatModel(run)          # in a LangGraph node: model.invoke(messages)

Each model call is one turn of the Run (``async with`` and ``ainvoke``/``astream`` on an
:class:`~ledger.AsyncLedger`): the Run's frozen plan, policy, budget and grant decide routes,
retries and failover, and every physical call is an Attempt. ``create_agent`` binds the tools
per call, so they stay bound whichever route serves (``with_fallbacks`` loses them). The
answer is an ``AIMessage`` with the served model (``response_metadata["model_name"]``), its
usage (``usage_metadata``), and in ``response_metadata["ledger"]`` the Run, the turn, the
Attempt that produced it and every Attempt of the turn: that Attempt is the provenance the next
request carries, so a history the Run produced (a checkpoint included) passes disclosure
preflight, and an edited or invented ``AIMessage`` does not.

Messages become envelope parts: system messages ``system``, human text ``user_input``, human
images and documents (LangChain's content blocks: ``image``, ``file``, ``text-plain``) binary
parts of class ``user_input`` (or ``document_data_class``), the model's answers (text, tool
calls with their arguments as the model wrote them, the reasoning a route returned to be
carried back — a Responses-API route's items, Anthropic's thinking blocks, Gemini's thought
signatures, kept in ``response_metadata["ledger"]["reasoning"]`` — and images a model
returned) ``model_derived`` with their Attempt, and tool messages ``tool_result``, recorded
through the session the first time they are sent: their text, and their image and file blocks
(a tool that returned an image or a document) as the call's files, of the same class and
covered by the call's provenance, never the user's input.

A stop raises :class:`~ledger.errors.FailoverExhausted` out of the model call (and out of
``invoke``), or, with ``LedgerMiddleware(run, exit_behavior="end")``, ends the agent with an
``AIMessage`` saying why, as ``ModelCallLimitMiddleware`` does.

Needs the ``langchain`` extra (``pip install 'failover-ledger[langchain]'``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from typing import Any, Literal

from ledger.api.session import AsyncRunSession, RunSession
from ledger.domain.envelope import (
    MODEL_DERIVED,
    SYSTEM,
    USER_INPUT,
    Envelope,
    Part,
    ToolSpec,
    tool_link_problem,
)
from ledger.domain.media import REASONING_MEDIA_TYPE, MediaKind
from ledger.errors import FailoverExhausted, InvalidArgument
from ledger.integrations._run import (
    RunLink,
    attempts_detail,
    carried_reasoning,
    drive,
    in_message,
    media_type_of,
    spliced,
    wait_out,
)

try:
    from langchain.agents.middleware import AgentMiddleware
    from langchain.agents.middleware.types import (
        ExtendedModelResponse,
        ModelRequest,
        ModelResponse,
    )
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
    )
    from langchain_core.exceptions import ModelError
    from langchain_core.language_models import BaseChatModel, LanguageModelInput
    from langchain_core.messages import (
        AIMessage,
        AIMessageChunk,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable
    from langchain_core.runnables.config import run_in_executor
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from pydantic import ConfigDict, PrivateAttr
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/test_extras.py
    raise InvalidArgument(
        "ledger.integrations.langchain needs langchain and langgraph: pip install "
        "'failover-ledger[langchain]'", field="ledger.integrations.langchain",
        extra="langchain") from e

# Where an AIMessage says what the ledger recorded for it (read back as provenance).
DETAILS_KEY = "ledger"

# Keyword arguments a call may carry (bind, create_agent's model settings) and what they become.
_SETTINGS = {"max_tokens": "max_output_tokens", "max_output_tokens": "max_output_tokens",
             "temperature": "params", "top_p": "params"}
# Set by LangChain itself: tool_choice (not carried across protocols: see the docs), the
# structured-output trace hint, the streaming switch, parallel tool calls (a route's default).
_IGNORED = frozenset({"tool_choice", "ls_structured_output_format", "stream",
                      "parallel_tool_calls"})
# Provider-side conversation state: a failover must resend the whole conversation.
_STATEFUL = frozenset({"previous_response_id", "use_previous_response_id", "conversation",
                       "conversation_id", "store"})
# What other chat models take that a Run owns, and where it is instead.
_RUN_OWNS = {
    "max_retries": "the Run is the retry owner: its policy retries and fails over, within the "
                   "Budget's max_retries",
    "timeout": "timeouts belong to the Run's policy (streaming.read_timeout_s, "
               "total_timeout_s, ...)",
    "streaming": "call stream/astream to stream (or run the graph with "
                 "stream_mode=\"messages\")",
    "stop": "stop sequences are not carried across the protocols of a Run's routes",
    "model": "each route of the Run's plan names its model: pick a route with route=",
    "api_key": "each route of the Run's plan has its credentials: Route.profiles or "
               "Route.api_key_env",
    "base_url": "each route of the Run's plan has its endpoint (Route.endpoint)",
}
_RUN_OWNS.update(request_timeout=_RUN_OWNS["timeout"], stop_sequences=_RUN_OWNS["stop"],
                 model_name=_RUN_OWNS["model"])

# LangChain's and LangGraph's ways of sending a model request again, for the refusal of a
# request the Run stopped.
_RETRIES = ("ModelRetryMiddleware, ModelFallbackMiddleware, .with_retry(), a LangGraph "
            "RetryPolicy")


def _stateful(name: str) -> InvalidArgument:
    return InvalidArgument(
        f"{name} asks the provider to hold the conversation; a ledger Run sends the whole "
        "conversation on every request, so that a failover can send it to another route: "
        "leave it out", field=name)


def _not_taken(name: str, takes: str) -> InvalidArgument:
    why = _RUN_OWNS.get(name, "a ledger Run sends only the settings every route's protocol "
                              "carries alike")
    return InvalidArgument(f"LedgerChatModel does not take {name!r} ({why}): leave it out; it "
                           f"takes {takes}", field=name)


def _details(message: BaseMessage) -> dict[str, Any]:
    found = (getattr(message, "response_metadata", None) or {}).get(DETAILS_KEY)
    return found if isinstance(found, dict) else {}


def _text_and_files(message: BaseMessage, what: str, data_class: str | None
                    ) -> tuple[str, list[Part]]:
    """A message's text, and its files (``None`` for ``data_class``: text only).

    Its ``image``, ``file`` and ``text-plain`` blocks become user parts of ``data_class``.
    """
    out: list[str] = []
    files: list[Part] = []
    for block in message.content_blocks:
        kind = block.get("type")
        if kind == "text":
            out.append(str(block.get("text", "")))
        elif kind in ("image", "file", "text-plain") and data_class is not None:
            files.append(_media_part(dict(block), "user", data_class))
        elif kind not in ("reasoning", "tool_call", "tool_call_chunk", "invalid_tool_call"):
            raise InvalidArgument(
                f"{what} holds a {kind!r} block; a ledger Run sends text there (images and "
                "documents go in a human message, or in a tool message when a tool returned "
                "them)", field="messages")
    return "".join(out), files


def _media_part(block: dict[str, Any], role: str, data_class: str) -> Part:
    """An ``image``, ``file`` or ``text-plain`` content block as a binary part."""
    kind = block.get("type")
    mime = block.get("mime_type")
    try:
        if block.get("base64") is not None:
            return Part(role=role, data=base64.b64decode(block["base64"]), media_type=mime,
                        data_class=data_class, name=block.get("filename"))
        if kind == "text-plain" and block.get("text") is not None:
            return Part(role=role, data=str(block["text"]).encode(),
                        media_type=mime or "text/plain", data_class=data_class,
                        name=block.get("filename"))
        url = block.get("url")
        if isinstance(url, str):
            if mime is None:
                mime = media_type_of(url, block.get("filename"), what=f"the {kind} block",
                                     fix="give the block a mime_type ('image/png', "
                                         "'application/pdf', ...)", field="messages")
            return Part(role=role, url=url, media_type=mime, data_class=data_class)
    except InvalidArgument as e:
        if e.field == "messages":
            raise
        raise InvalidArgument(f"the {kind} content block cannot be sent: {e.message}",
                              field="messages", part_field=e.field) from e
    except ValueError as e:
        raise InvalidArgument(f"the {kind} content block's base64 is not valid: {e}",
                              field="messages") from e
    raise InvalidArgument(
        f"the {kind} content block without base64 or url cannot be sent (a provider file id is "
        "one provider's; the ledger never fetches): pass the bytes as base64 or an https:// "
        "url", field="messages")


def ai_parts(message: AIMessage) -> list[Part]:
    """An earlier answer as the envelope parts the ledger recorded for it.

    Its reasoning, its text, its images and documents, then its tool calls (with the arguments
    as the model wrote them, kept in ``response_metadata["ledger"]["arguments"]``), each
    ``model_derived`` with the Attempt named in its ``response_metadata["ledger"]``. An answer
    whose content was changed (or that no Attempt of the Run produced) yields parts whose hash
    the ledger never recorded: preflight refuses them.
    """
    ours = _details(message)
    attempt = ours.get("attempt_id") if isinstance(ours.get("attempt_id"), str) else None
    found = ours.get("arguments")
    raw: dict[str, Any] = found if isinstance(found, dict) else {}
    parts: list[Part] = [
        Part(role="assistant", data=carried_reasoning(r), media_type=REASONING_MEDIA_TYPE,
             data_class=MODEL_DERIVED, provenance=attempt)
        for r in ours.get("reasoning", []) if isinstance(r, str)]
    texts: list[str] = []
    files: list[Part] = []
    for block in message.content_blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind in ("image", "file", "text-plain"):
            part = _media_part(dict(block), "assistant", MODEL_DERIVED)
            files.append(Part.model_validate({**part.model_dump(), "provenance": attempt}))
        elif kind not in ("tool_call", "reasoning", "invalid_tool_call"):
            raise InvalidArgument(
                f"an AIMessage block of type {kind!r} cannot be sent through a ledger Run "
                "(only text, images, documents and tool calls are); drop it from the messages",
                field="messages")
    calls = []
    for call in message.tool_calls:
        given = raw.get(call["id"] or "")
        args = given if isinstance(given, str) and _same_args(given, call["args"]) \
            else json.dumps(call["args"])
        calls.append(Part(role="assistant", content=args, data_class=MODEL_DERIVED,
                          provenance=attempt, tool_call_id=call["id"], name=call["name"]))
    for bad in message.invalid_tool_calls:
        calls.append(Part(role="assistant", content=bad.get("args") or "{}",
                          data_class=MODEL_DERIVED, provenance=attempt,
                          tool_call_id=bad.get("id"), name=bad.get("name")))
    text = "".join(texts)
    if text or not (calls or files):
        parts.append(Part(role="assistant", content=text, data_class=MODEL_DERIVED,
                          provenance=attempt))
    return parts + files + calls


def _same_args(raw: str, args: Any) -> bool:
    try:
        return bool(json.loads(raw) == args)
    except ValueError:
        return False


def _usage(result: Any) -> UsageMetadata:
    att = result.attempt
    prompt, completion = att.prompt_tokens or 0, att.completion_tokens or 0
    usage = UsageMetadata(input_tokens=prompt, output_tokens=completion,
                          total_tokens=prompt + completion)
    # The parts the Attempt recorded, where the provider reported them.
    if att.cached_tokens:
        usage["input_token_details"] = {"cache_read": att.cached_tokens}
    if att.reasoning_tokens:
        usage["output_token_details"] = {"reasoning": att.reasoning_tokens}
    return usage


def _answer(result: Any, parts: Sequence[Part], run_id: str) -> dict[str, Any]:
    """What a served turn puts on an ``AIMessage`` (its content aside)."""
    output = result.output
    detail = attempts_detail(result, run_id)
    detail["arguments"] = {p.tool_call_id: p.content for p in parts if p.tool_call_id}
    reasoning = [base64.b64encode(p.payload).decode("ascii") for p in parts
                 if p.kind is MediaKind.REASONING and p.payload is not None]
    if reasoning:
        detail["reasoning"] = reasoning
    notes = list(getattr(output, "notes", ()) or ())
    if notes:
        detail["notes"] = notes
    att = result.attempt
    metadata: dict[str, Any] = {
        "model_name": att.model_reported or att.model, "model_provider": att.provider,
        DETAILS_KEY: detail}
    if getattr(output, "finish_reason", None):
        metadata["finish_reason"] = output.finish_reason
    if getattr(output, "request_id", None):
        metadata["id"] = output.request_id
    calls, invalid = [], []
    for p in parts:
        if p.tool_call_id is None:
            continue
        try:
            args = json.loads(p.content or "{}")
        except ValueError:
            args = None
        if isinstance(args, dict):
            calls.append({"name": p.name or "", "args": args, "id": p.tool_call_id,
                          "type": "tool_call"})
        else:
            invalid.append({"name": p.name, "args": p.content, "id": p.tool_call_id,
                            "error": "the arguments are not a JSON object",
                            "type": "invalid_tool_call"})
    return {"response_metadata": metadata, "tool_calls": calls,
            "invalid_tool_calls": invalid, "usage_metadata": _usage(result)}


def _content(parts: Sequence[Part]) -> str | list[str | dict[str, Any]]:
    """The answer's text, or its text and files as content blocks when it has files."""
    text = "".join(p.content for p in parts if p.role == "assistant" and p.tool_call_id is None
                   and p.media_type is None)
    files = [p for p in parts if p.kind is not None and p.kind is not MediaKind.REASONING]
    if not files:
        return text
    blocks: list[str | dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for p in files:
        kind = "image" if p.kind is MediaKind.IMAGE else "file"
        payload = p.payload
        where = {"base64": base64.b64encode(payload).decode("ascii")} if payload is not None \
            else {"url": p.url}
        blocks.append({"type": kind, "mime_type": p.media_type, **where})
    return blocks


class LedgerStop(FailoverExhausted, ModelError):
    """A stop of the Run, as LangChain knows a model error that retrying cannot fix.

    It is the :class:`~ledger.errors.FailoverExhausted` the turn raised (``reason``,
    ``attempts``, ``detail``, ``skipped``, ``partial``, ``exceptions``), and a
    ``langchain_core.exceptions.ModelError`` with ``is_retryable = False``: LangChain's
    ``ModelRetryMiddleware`` (with its default ``retry_on``) does not retry it, because the Run
    already retried and failed over as its policy allows.
    """

    is_retryable = False

    @classmethod
    def of(cls, stop: FailoverExhausted) -> LedgerStop:
        """The same stop, with every fact of it."""
        extra = {k: v for k, v in stop.fields.items()
                 if k not in ("reason", "attempts", "detail", "skipped", "partial")}
        return cls(stop.message, list(stop.exceptions), reason=stop.reason,
                   attempts=stop.attempts, detail=stop.detail, skipped=stop.skipped,
                   partial=stop.partial, **extra)



def _stop_message(stop: FailoverExhausted) -> AIMessage:
    """How a stop ends an agent with ``exit_behavior="end"`` (never sent to a model)."""
    shown = stop.partial.text if stop.partial is not None else ""
    detail = stop.detail[:1].upper() + stop.detail[1:]  # a sentence of its own here
    return AIMessage(
        content=f"The ledger stopped this model request ({stop.reason}). {detail}".strip(),
        response_metadata={DETAILS_KEY: {"stop": stop.reason, "attempts": list(stop.attempts),
                                         "partial": shown}})


class LedgerChatModel(BaseChatModel):
    """A LangChain chat model whose every call is one turn of a ledger Run.

    Use it inside the Run session's block: in a LangGraph node (``model.invoke(messages)``,
    ``await model.ainvoke(...)``, ``stream``/``astream``), as ``create_agent``'s model, or
    through :class:`LedgerMiddleware`. ``bind_tools`` and ``with_structured_output`` work as
    for any chat model.

    Args:
        run: The Run session: a :class:`~ledger.RunSession` (``with led.run(...) as run``,
            for ``invoke``/``stream``; ``ainvoke``/``astream`` run its blocking turn in a
            worker thread, as LangChain does for any blocking model) or an
            :class:`~ledger.AsyncRunSession` (``async with``, for ``ainvoke``/``astream``).
        route: A route of the Run's plan whose predecessors its requests do not use (failover
            goes on down the plan from it; where a request starts among the routes left is
            the policy's ``failover.new_turn``, by default the route the Run used last).
            ``None``: every route of the plan.
        max_tokens: The most output tokens of an answer (the envelope's ``max_output_tokens``,
            which also sizes each Attempt's hold); a call's own ``max_tokens`` wins.
        temperature: Sent with every request (a call's own wins).
        top_p: Sent with every request (a call's own wins).
        tool_data_class: The data class tool results (and the files tools returned) are
            recorded under (``tool_result``).
        document_data_class: The data class of the images and documents of human messages
            (``user_input``; any other class, e.g. ``private_document``, has each file's
            provenance recorded the first time it is sent).

    Raises:
        InvalidArgument: ``run`` is not a Run session, a data class is empty, ``route`` is
            not a route of the Run's plan, or a keyword is none of the above nor LangChain's
            own (``max_retries``, ``timeout``, ``streaming``: the Run owns them).
        InvalidState: ``route`` was given and the session is not open.

    A call takes ``max_tokens`` (the envelope's ``max_output_tokens``), ``temperature`` and
    ``top_p``. ``tool_choice`` is not sent (the routes of a Run speak different protocols);
    stop sequences, provider-side conversation state (``previous_response_id``, ``store``,
    ...) and any other keyword are refused with ``InvalidArgument``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    run: Any
    route: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_data_class: str = "tool_result"
    document_data_class: str = USER_INPUT
    _link: RunLink = PrivateAttr()

    def __init__(self, run: RunSession | AsyncRunSession, **kwargs: Any) -> None:
        for name in kwargs:
            # Refused here as in a call: LangChain's models ignore a keyword they do not know,
            # and a max_retries or timeout that did nothing would look obeyed.
            if name in _STATEFUL:
                raise _stateful(name)
            if name not in type(self).model_fields:
                raise _not_taken(name, "route, max_tokens, temperature, top_p, "
                                       "tool_data_class, document_data_class and LangChain's "
                                       "own fields (callbacks, tags, rate_limiter, ...)")
        super().__init__(run=run, **kwargs)
        self._link = RunLink(run, who="LedgerChatModel", route=self.route,
                             tool_data_class=self.tool_data_class,
                             document_data_class=self.document_data_class, retries=_RETRIES)
        if self.profile is None:
            # Tools yes; provider-native structured output no (each protocol asks for it its
            # own way, and a Run may fail over to another): create_agent uses ToolStrategy.
            self.profile = {"tool_calling": True, "structured_output": False,
                            "image_inputs": True, "pdf_inputs": True}

    @property
    def _llm_type(self) -> str:
        return "failover-ledger"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"run_id": self.run.run_id, "route": self.route}

    # -- tools and structured output ---------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with ``tools`` (LangChain tools, functions, pydantic models or schemas).

        ``tool_choice`` is accepted and not sent: the ledger carries no tool choice across
        protocols.
        """
        specs = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=specs, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: Any, *, include_raw: bool = False,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """The model answering as ``schema``, through a tool call (``function_calling``).

        Raises:
            InvalidArgument: another ``method`` (``json_schema``, ``json_mode``: each protocol
                asks for those its own way, and a Run may fail over to another).
        """
        method = kwargs.pop("method", None)
        if method not in (None, "function_calling"):
            raise InvalidArgument(
                f"with_structured_output(method={method!r}) asks for a provider's own "
                "structured output, and a ledger Run may fail over to another protocol; use "
                "method='function_calling' (the default)", field="method")
        return super().with_structured_output(schema, include_raw=include_raw, **kwargs)

    # -- the envelope ----------------------------------------------------------------------

    async def envelope(self, messages: Sequence[BaseMessage], *, stop: Sequence[str] | None,
                       stream: bool, **kwargs: Any) -> Envelope:
        """The turn's envelope for ``messages`` and a call's keyword arguments.

        Tool results and uploads of classes that need provenance are recorded through the
        session the first time they are sent.
        """
        link = self._link
        if stop:
            raise InvalidArgument("stop sequences are not carried across the protocols of a "
                                  "Run's routes; leave stop out", field="stop")
        tools = _tool_specs(kwargs.pop("tools", None) or [])
        kwargs = {**{k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p")},
                  **kwargs}
        out: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in _IGNORED or value is None:
                continue
            if name in _STATEFUL:
                raise _stateful(name)
            target = _SETTINGS.get(name)
            if target is None:
                raise _not_taken(name, "max_tokens, temperature and top_p")
            if target == "params":
                out.setdefault("params", {})[name] = value
            else:
                out[target] = value
        parts: list[Part] = []
        calls: list[Part] = []
        returns: list[tuple[int, int, ToolMessage]] = []  # (part index, message index, ...)
        for at, message in enumerate(messages):
            try:
                if isinstance(message, AIMessage):
                    if _details(message).get("stop") and not message.tool_calls:
                        continue  # a stop's notice (exit_behavior="end"), never model output
                    answer = ai_parts(message)
                    calls += [p for p in answer if p.tool_call_id is not None]
                    parts += answer
                elif isinstance(message, SystemMessage):
                    text, _none = _text_and_files(message, "a system message", None)
                    parts.append(Part(role="system", content=text, data_class=SYSTEM))
                elif isinstance(message, HumanMessage):
                    for block in message.content_blocks:
                        if block.get("type") == "text":
                            parts.append(Part(content=str(block.get("text", "")),
                                              data_class=USER_INPUT))
                        elif block.get("type") in ("image", "file", "text-plain"):
                            parts.append(await link.document(_media_part(
                                dict(block), "user", link.document_data_class)))
                        else:
                            raise InvalidArgument(
                                f"a human message block of type {block.get('type')!r} cannot be "
                                "sent through a ledger Run (its envelopes carry text, images and "
                                "documents)", field="messages")
                elif isinstance(message, ToolMessage):
                    problem = tool_link_problem("tool_call_id", message.tool_call_id)
                    if problem is not None:
                        # Said here as the framework's field: the parts it would become
                        # carry the id twice (tool_call_id and provenance).
                        raise InvalidArgument(
                            f"invalid tool_call_id: {problem}; a tool message answers a call "
                            "by its id: pass the id of the AIMessage's tool call it answers",
                            field="messages", part_field="tool_call_id")
                    returns.append((len(parts), at, message))
                    parts.append(Part(content=""))  # replaced below, once recorded
                else:
                    raise InvalidArgument(
                        f"a {type(message).__name__} cannot be sent through a ledger Run (system, "
                        "human, AI and tool messages can)", field="messages")
            except InvalidArgument as e:
                raise in_message(e, "messages", at, f"a {type(message).__name__}") from e
        results: dict[int, list[Part]] = {}
        for index, at, tool in returns:
            try:
                tool_name: str | None = next((c.name for c in calls
                                              if c.tool_call_id == tool.tool_call_id), tool.name)
                text, files = _text_and_files(tool, f"tool message {tool.tool_call_id!r}",
                                              link.tool_data_class)
                results[index] = await link.tool_parts(
                    tool.tool_call_id, tool_name, text, calls, files, field="messages",
                    bytes_fix="an image or file block with base64 and mime_type")
            except InvalidArgument as e:
                raise in_message(e, "messages", at, f"a {type(tool).__name__}") from e
        try:
            return Envelope(parts=spliced(parts, results), tools=tools, stream=stream, **out)
        except InvalidArgument as e:
            raise InvalidArgument(f"the call's settings cannot be sent: {e.message}",
                                  field=e.field) from e

    # -- calls -----------------------------------------------------------------------------

    async def _prepare(self, messages: Sequence[BaseMessage], stop: Sequence[str] | None,
                       stream: bool, kwargs: dict[str, Any]) -> tuple[Envelope, str]:
        envelope = await self.envelope(messages, stop=stop, stream=stream, **kwargs)
        try:
            return envelope, await self._link.guard(envelope)
        except FailoverExhausted as stop_:
            _raise_stop(stop_)
            raise

    def _options(self, turn_id: str) -> dict[str, Any]:
        options: dict[str, Any] = {"turn_id": turn_id}
        if self._link.denials is not None:
            options["denials"] = self._link.denials
        return options

    async def _served(self, result: Any, envelope: Envelope) -> AIMessage:
        used = [p.tool_call_id for p in envelope.parts if p.tool_call_id]
        parts = await self._link.stable_calls(result, used)
        return AIMessage(content=_content(parts), **_answer(result, parts, self.run.run_id))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        link = self._link
        link.check_async()
        link.check_open()
        envelope, turn_id = drive(self._prepare(messages, stop, False, kwargs))
        try:
            result = self.run.turn(envelope, **self._options(turn_id))
        except BaseException as e:
            link.sent(envelope, turn_id, e)
            _raise_stop(e)
            raise
        link.sent(envelope, turn_id, None)
        return ChatResult(generations=[ChatGeneration(message=drive(self._served(result,
                                                                                 envelope)))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        link = self._link
        if not link.is_async:
            return await run_in_executor(None, self._generate, messages, stop, None, **kwargs)
        link.check_open()
        envelope, turn_id = await self._prepare(messages, stop, False, kwargs)
        try:
            result = await self.run.turn(envelope, **self._options(turn_id))
        except BaseException as e:
            link.sent(envelope, turn_id, e)
            _raise_stop(e)
            raise
        link.sent(envelope, turn_id, None)
        return ChatResult(generations=[ChatGeneration(message=await self._served(result,
                                                                                 envelope))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        link = self._link
        link.check_async()
        link.check_open()
        envelope, turn_id = drive(self._prepare(messages, stop, True, kwargs))
        events: queue.Queue[Any] = queue.Queue()
        done: list[Any] = []

        def serve() -> None:
            try:
                done.append(self.run.turn(envelope, on_event=events.put,
                                          **self._options(turn_id)))
            except BaseException as e:  # handed to the reader below
                done.append(e)
            finally:
                events.put(_DONE)

        worker = threading.Thread(target=serve, name="ledger-langchain-turn", daemon=True)
        try:
            worker.start()
            while (event := events.get()) is not _DONE:
                piece = _text_chunk(event)
                if piece is not None:
                    if run_manager is not None:
                        run_manager.on_llm_new_token(piece.text, chunk=piece)
                    yield piece
        finally:
            # Also when the reader left early: the turn has ended only once its thread has.
            if worker.ident is not None:
                worker.join()
            outcome = done[0] if done else None
            link.sent(envelope, turn_id,
                      outcome if isinstance(outcome, BaseException) else None)
        if isinstance(outcome, BaseException):
            _raise_stop(outcome)
            raise outcome
        yield _last_chunk(drive(self._served(outcome, envelope)))

    async def _astream_blocking(self, messages: list[BaseMessage], stop: list[str] | None,
                                run_manager: AsyncCallbackManagerForLLMRun | None,
                                **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """A blocking session's :meth:`_stream`, each step in a worker thread.

        LangChain's default does the same but lets the event loop close the stream when the
        reader leaves early, and closing it waits for the turn's thread (the turn runs to its
        end): every task of the loop stalled until then. Here the close runs in a worker
        thread too, after any step still running there (a cancelled reader's).
        """
        sync_manager = run_manager.get_sync() if run_manager is not None else None
        chunks = await run_in_executor(None, self._stream, messages, stop, sync_manager,
                                       **kwargs)
        lock = threading.Lock()  # a generator runs in one thread at a time
        done = object()

        def step() -> Any:
            with lock:
                return next(chunks, done)

        def close() -> None:
            with lock:
                if isinstance(chunks, Generator):
                    chunks.close()  # its finally waits for the turn's thread

        try:
            while (chunk := await run_in_executor(None, step)) is not done:
                yield chunk
        finally:
            await run_in_executor(None, close)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        link = self._link
        if not link.is_async:
            async for chunk in self._astream_blocking(messages, stop, run_manager, **kwargs):
                yield chunk
            return
        link.check_open()
        envelope, turn_id = await self._prepare(messages, stop, True, kwargs)
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def serve() -> Any:
            try:
                return await self.run.turn(envelope, on_event=events.put_nowait,
                                           **self._options(turn_id))
            finally:
                events.put_nowait(_DONE)

        task = asyncio.ensure_future(serve())
        try:
            while (event := await events.get()) is not _DONE:
                piece = _text_chunk(event)
                if piece is not None:
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(piece.text, chunk=piece)
                    yield piece
        finally:
            if not task.done():
                # The reader left: the turn is cancelled, and settles truthfully.
                task.cancel()
            interrupted = await wait_out(task)
            error = None if task.cancelled() else task.exception()
            link.sent(envelope, turn_id, error)
            if interrupted:
                raise asyncio.CancelledError
        if error is not None:
            _raise_stop(error)
        result = await task  # the cancellation raises here
        yield _last_chunk(await self._served(result, envelope))


_DONE = object()  # the end of a streamed turn's events


def _raise_stop(error: BaseException) -> None:
    """Raise a stop as :class:`LedgerStop` (other errors are left to propagate)."""
    if isinstance(error, FailoverExhausted) and not isinstance(error, LedgerStop):
        raise LedgerStop.of(error) from error


def _text_chunk(event: Any) -> ChatGenerationChunk | None:
    from ledger.adapters.contract import TextDelta

    if isinstance(event, TextDelta) and event.text:
        return ChatGenerationChunk(message=AIMessageChunk(content=event.text))
    return None


def _last_chunk(message: AIMessage) -> ChatGenerationChunk:
    """The streamed answer's end: tool calls, usage and the ledger's record, once complete.

    Its text reached the reader already; its files arrive here, whole.
    """
    content = message.content
    rest: str | list[str | dict[str, Any]] = "" if isinstance(content, str) else [
        b for b in content if not (isinstance(b, dict) and b.get("type") == "text")]
    arguments = message.response_metadata[DETAILS_KEY]["arguments"]
    chunks = [{"name": c["name"], "args": arguments.get(c["id"], json.dumps(c["args"])),
               "id": c["id"], "index": i, "type": "tool_call_chunk"}
              for i, c in enumerate(message.tool_calls)]
    chunks += [{"name": c.get("name"), "args": c.get("args"), "id": c.get("id"),
                "index": len(chunks) + i, "type": "tool_call_chunk"}
               for i, c in enumerate(message.invalid_tool_calls)]
    return ChatGenerationChunk(message=AIMessageChunk(
        content=rest, tool_call_chunks=chunks, usage_metadata=message.usage_metadata,
        response_metadata=message.response_metadata, chunk_position="last"))


def _tool_specs(tools: Sequence[Any]) -> list[ToolSpec]:
    specs = []
    for t in tools:
        tool = t if isinstance(t, dict) and t.get("type") == "function" \
            else convert_to_openai_tool(t)
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise InvalidArgument(
                f"tool {str(t)[:80]!r} is not a function tool; a ledger Run sends the tools the "
                "agent runs (a provider's built-in tools are one provider's)", field="tools")
        specs.append(ToolSpec(name=fn["name"], description=fn.get("description") or "",
                              parameters=dict(fn.get("parameters") or {})))
    return specs


class LedgerMiddleware(AgentMiddleware):
    """``create_agent`` middleware: every model call of the agent is a turn of a ledger Run.

    It replaces the agent's model, for each call, by a :class:`LedgerChatModel` of the Run (the
    agent's own model when it is a ``LedgerChatModel`` of this Run, with its settings);
    ``create_agent`` then binds the call's tools and structured-output tools to it, so they
    stay bound whichever route serves. Other middleware compose as usual; a retry around it
    (``ModelRetryMiddleware``, ``ModelFallbackMiddleware``) is refused when it repeats a
    request the Run stopped.

    Args:
        run: The Run session (``with led.run(...) as run`` for ``invoke``/``stream``, ``async
            with`` for ``ainvoke``/``astream``).
        route: As :class:`LedgerChatModel`.
        exit_behavior: What a stop does: ``"error"`` raises
            :class:`~ledger.errors.FailoverExhausted` out of the agent; ``"end"`` ends the
            agent with an ``AIMessage`` saying why (its ``response_metadata["ledger"]`` has
            ``stop``, the reason; ``attempts``, the Attempt ids; ``partial``, any text shown),
            as ``ModelCallLimitMiddleware`` does.
            Either way the Run ends ``stopped`` or ``failed`` by the stop's reason.
        tool_data_class: As :class:`LedgerChatModel`.
        document_data_class: As :class:`LedgerChatModel`.

    Raises:
        InvalidArgument: as :class:`LedgerChatModel`, or an unknown ``exit_behavior``.
        InvalidState: (on a call) the Run's block was left, or not entered yet.
    """

    def __init__(self, run: RunSession | AsyncRunSession, *, route: str | None = None,
                 exit_behavior: Literal["error", "end"] = "error",
                 tool_data_class: str = "tool_result",
                 document_data_class: str = USER_INPUT) -> None:
        super().__init__()
        if exit_behavior not in ("error", "end"):
            raise InvalidArgument(f"exit_behavior is 'error' or 'end' (got {exit_behavior!r})",
                                  field="exit_behavior")
        self.model = LedgerChatModel(run, route=route, tool_data_class=tool_data_class,
                                     document_data_class=document_data_class)
        self.exit_behavior = exit_behavior

    def _model(self, request: ModelRequest) -> LedgerChatModel:
        given = request.model
        if isinstance(given, LedgerChatModel) and given.run is self.model.run:
            return given
        return self.model

    def wrap_model_call(self, request: ModelRequest,
                        handler: Callable[[ModelRequest], ModelResponse],
                        ) -> ModelResponse | AIMessage | ExtendedModelResponse:
        """Serve the agent's model call as one turn of the Run."""
        link = self.model._link
        link.check_open()
        link.check_async()
        try:
            return handler(request.override(model=self._model(request)))
        except FailoverExhausted as stop:
            if self.exit_behavior == "end":
                return _stop_message(stop)
            raise

    async def awrap_model_call(
            self, request: ModelRequest,
            handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse | AIMessage | ExtendedModelResponse:
        """Serve the agent's model call as one turn of the Run (awaited)."""
        self.model._link.check_open()
        try:
            return await handler(request.override(model=self._model(request)))
        except FailoverExhausted as stop:
            if self.exit_behavior == "end":
                return _stop_message(stop)
            raise


__all__ = ["DETAILS_KEY", "LedgerChatModel", "LedgerMiddleware", "LedgerStop", "ai_parts"]
