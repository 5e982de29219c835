"""The OpenAI Agents SDK on a ledger Run: :class:`LedgerModelProvider`, :class:`LedgerAgentModel`.

A ``ModelProvider`` whose models serve every model call of the SDK's runner as one turn of an
:class:`~ledger.AsyncRunSession`::

    set_tracing_disabled(True)                       # or export traces where you choose
    async with led.run("task-7", plan=routes, budget=budget, grant=grant) as run:
        config = RunConfig(model_provider=LedgerModelProvider(run))
        result = await Runner.run(agent, "Compare the two filings.", run_config=config)

The Run's frozen plan, policy, budget and grant decide routes, retries and failover (across
protocols: the Responses API, chat completions, Anthropic, Gemini); every physical call is an
Attempt. An agent's ``model`` names a route of the Run's plan whose predecessors its requests
do not use (``None``: every route); where a request starts among the routes left is the
policy's ``failover.new_turn`` (by default the route the Run used last).

Items both ways (the Responses format the SDK speaks): the instructions and ``system`` /
``developer`` messages are ``system`` parts, user messages ``user_input`` (``input_text``,
``input_image`` and ``input_file`` as text, image and document parts; the SDK's items carry no
media type, so a file's is a ``data:`` URL's own, else the one its URL's path or its
``filename`` says by extension, else it is refused), the model's earlier
output ``model_derived`` with the Attempt that produced it as provenance (its item ids name the
Attempt: ``msg_<attempt>``, ``fc_<attempt>_<n>``, ``rs_<attempt>_<n>``), and
``function_call_output`` items ``tool_result``, recorded through the session the first time
they are sent (their ``input_image`` and ``input_file`` parts, a tool's images and documents,
as the call's files: of the same class, covered by the call's provenance). A route's
reasoning to carry back (a Responses-API route's encrypted items, Anthropic's thinking blocks,
Gemini's thought signatures) comes back as a ``reasoning`` item
whose ``encrypted_content`` carries the ledger's opaque reasoning part, and goes back to that
route only. Tool calls keep their ids across failover between protocols; a provider that gives none
(Gemini) gets one made from the Attempt, recorded.

The SDK's runner and the ledger never both retry: ``ModelSettings(retry=...)`` with retries is
refused, a request the Run stopped is not sent again, and :meth:`LedgerAgentModel.get_retry_advice`
tells the SDK what the ledger knows (a stop is no retry; an Attempt whose outcome is unknown is
``replay_safety="unsafe"``). ``previous_response_id``, ``conversation_id`` and stored prompts are
refused: a failover must resend the whole input. ``auto_previous_response_id=True`` is refused at
the run's second model call, the first the SDK tells a model of it (the first call is served and
its tools run).

Needs the ``openai-agents`` extra (``pip install 'failover-ledger[openai-agents]'``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ledger.api.session import AsyncRunSession
from ledger.domain.envelope import (
    MODEL_DERIVED,
    SYSTEM,
    USER_INPUT,
    Envelope,
    Part,
    ToolSpec,
    tool_link_problem,
)
from ledger.domain.facts import Category, Phase
from ledger.domain.media import REASONING_MEDIA_TYPE, MediaKind
from ledger.errors import FailoverExhausted, InvalidArgument, LedgerError, ProviderError
from ledger.integrations._run import (
    RunLink,
    attempts_detail,
    carried_reasoning,
    in_message,
    media_type_of,
    spliced,
    wait_out,
)

try:
    from agents import FunctionTool, Handoff, Model, ModelProvider, ModelSettings, ModelTracing
    from agents.agent_output import AgentOutputSchemaBase
    from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
    from agents.retry import ModelRetryAdvice, ModelRetryAdviceRequest, ModelRetryNormalizedError
    from agents.usage import Usage
    from openai.types.responses import (
        Response,
        ResponseCompletedEvent,
        ResponseContentPartAddedEvent,
        ResponseContentPartDoneEvent,
        ResponseCreatedEvent,
        ResponseFunctionCallArgumentsDeltaEvent,
        ResponseFunctionCallArgumentsDoneEvent,
        ResponseFunctionToolCall,
        ResponseOutputItemAddedEvent,
        ResponseOutputItemDoneEvent,
        ResponseOutputMessage,
        ResponseOutputText,
        ResponseReasoningItem,
        ResponseTextDeltaEvent,
        ResponseTextDoneEvent,
        ResponseUsage,
    )
    from openai.types.responses.response_reasoning_item import Summary
    from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/test_extras.py
    raise InvalidArgument(
        "ledger.integrations.openai_agents needs the OpenAI Agents SDK: pip install "
        "'failover-ledger[openai-agents]'", field="ledger.integrations.openai_agents",
        extra="openai-agents") from e

_STATE_FIX = ("a ledger Run sends the whole input on every request, so that a failover can "
              "send it to another route; keep the conversation in the input (or an SDK "
              "Session) instead")
# The SDK's ways of sending a model request again, for the refusal of a request the Run
# stopped (its runner's own retries are ModelSettings.retry's, refused as soon as asked).
_RETRIES = ("a loop or retry decorator, such as tenacity's @retry, that calls Runner.run again "
            "with the same input; ModelSettings(retry=...)")
_DONE = object()  # the end of a streamed turn's events


def _chained(previous_response_id: str, input: Any) -> InvalidArgument:
    """The refusal of a request chained to an earlier response, naming the host's setting.

    ``Runner.run(..., previous_response_id=...)`` reaches the run's first model call, with the
    host's input. ``auto_previous_response_id=True`` reaches no model before the run's second
    call (the SDK's runner keeps it to itself until then), which carries the first response's
    id and only the items since it (tool outputs, never a message).
    """
    def kind(item: Any) -> Any:
        return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) \
            or "message"

    if isinstance(input, str) or any(kind(i) == "message" for i in input):
        return InvalidArgument(
            "Runner.run(..., previous_response_id=...) asks the provider to hold the "
            f"conversation. Remove previous_response_id: {_STATE_FIX}",
            field="previous_response_id")
    # Only tool outputs after a response id: what auto_previous_response_id sends, and also
    # what previous_response_id= with such an input sends; the model cannot tell which, so the
    # refusal names both (auto first: the SDK's own way of chaining a run).
    return InvalidArgument(
        f"this model call is chained to response {previous_response_id!r} and carries only the "
        "items since it (tool outputs), which the provider would have to hold. Either "
        "Runner.run(..., auto_previous_response_id=True) chained it (the SDK tells a model "
        "nothing of that before the run's second call, so the run's first model call was "
        "served and its tools ran), or Runner.run(..., previous_response_id=...) was given "
        "an input of only tool outputs. Remove auto_previous_response_id and "
        f"previous_response_id from Runner.run: {_STATE_FIX}",
        field="auto_previous_response_id")


def _plain(item: Any) -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        return dict(dump(exclude_unset=True))
    raise InvalidArgument(f"an input item of type {type(item).__name__} is not a Responses "
                          "item", field="input")


def _attempt_of(item_id: Any) -> str | None:
    """The Attempt an output item's id names (``msg_<att>``, ``fc_<att>_<n>``, ...)."""
    if not isinstance(item_id, str):
        return None
    for prefix, numbered in (("msg_", False), ("fc_", True), ("rs_", True)):
        if item_id.startswith(prefix):
            rest = item_id[len(prefix):]
            if numbered:
                rest, _sep, n = rest.rpartition("_")
                if not n.isdigit():
                    return None
            return rest or None
    return None


def _content_text(content: Any, what: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for c in content or []:
        c = _plain(c)
        if c.get("type") in ("input_text", "output_text", "text"):
            out.append(str(c.get("text", "")))
        elif c.get("type") == "refusal":
            out.append(str(c.get("refusal", "")))
        else:
            raise InvalidArgument(f"{what} holds a {c.get('type')!r} part; a ledger Run sends "
                                  "text there (images and files go in a user message, or in a "
                                  "function_call_output when a tool returned them)",
                                  field="input")
    return "".join(out)


def _described(item: Any) -> str:
    """An input item as the SDK calls it (``a user message``, ``a function_call item``)."""
    try:
        plain = _plain(item)
    except InvalidArgument:
        return f"a {type(item).__name__}"
    kind = plain.get("type", "message")
    return f"a {plain.get('role')} message" if kind == "message" else f"a {kind} item"


def _check_call_id(call_id: Any) -> None:
    """Refuse a ``function_call_output`` whose ``call_id`` no part can carry.

    Said as the SDK's field: the parts it would become carry the id twice (``tool_call_id``
    and ``provenance``), and the part's refusal would name the second.
    """
    problem = "is missing" if not isinstance(call_id, str) else tool_link_problem(
        "tool_call_id", call_id)
    if problem is not None:
        raise InvalidArgument(
            f"invalid call_id: {problem}; a function_call_output answers a function_call by its "
            "call_id: pass the call_id of the function_call it answers", field="input",
            part_field="tool_call_id")


def _tool_output(output: Any, call_id: str, data_class: str) -> tuple[str, list[Part]]:
    """A ``function_call_output``'s text, and the files the tool returned.

    Its ``input_image`` and ``input_file`` parts become user parts of ``data_class``.
    """
    if isinstance(output, str):
        return output, []
    texts: list[Any] = []
    files: list[Part] = []
    for c in output or []:
        c = _plain(c)
        if c.get("type") in ("input_image", "input_file"):
            files += _user_parts([c], data_class, whose=f"call {call_id!r}'s")
        else:
            texts.append(c)
    return _content_text(texts, f"the output of call {call_id!r}"), files


def _user_parts(content: Any, data_class: str, whose: str = "a user") -> list[Part]:
    if isinstance(content, str):
        return [Part(content=content, data_class=USER_INPUT)]
    out = []
    for c in content or []:
        c = _plain(c)
        kind = c.get("type")
        try:
            if kind == "input_text":
                out.append(Part(content=str(c.get("text", "")), data_class=USER_INPUT))
            elif kind == "input_image" and isinstance(c.get("image_url"), str):
                # The SDK's input_image has no field for the type: told from the URL.
                url = c["image_url"]
                out.append(Part(url=url, data_class=data_class, media_type=media_type_of(
                    url, what="the input_image", field="input",
                    fix="send the image as a data: URL with its type "
                        "(image_url='data:image/png;base64,...')")))
            elif kind == "input_file" and isinstance(c.get("file_data"), str):
                data, name = c["file_data"], c.get("filename")
                if data[:5].lower() != "data:":
                    # Bare base64: only the file name can say what the bytes are.
                    data = "data:{};base64,{}".format(media_type_of(
                        None, name, what="the input_file's file_data", field="input",
                        fix="give file_data as a data: URL with its type "
                            "('data:application/pdf;base64,...'), or a filename with the "
                            "file's extension (.pdf, .txt, .md, .csv, .png, ...)"), data)
                out.append(Part(url=data, data_class=data_class, name=name))
            elif kind == "input_file" and isinstance(c.get("file_url"), str):
                url, name = c["file_url"], c.get("filename")
                out.append(Part(url=url, data_class=data_class, name=name,
                                media_type=media_type_of(
                                    url, name, what="the input_file", field="input",
                                    fix="send the file as file_data, a data: URL with its "
                                        "type ('data:application/pdf;base64,...')")))
            else:
                raise InvalidArgument(
                    f"{whose} content part of type {kind!r} cannot be sent through a ledger Run "
                    "(text, and images and files given as data: or https:// URLs, can; a "
                    "provider file_id is one provider's)", field="input")
        except InvalidArgument as e:
            if e.field == "input":
                raise
            raise InvalidArgument(f"{whose} {kind} cannot be sent: {e.message}", field="input",
                                  part_field=e.field) from e
    return out


def _tool_specs(tools: Sequence[Any], handoffs: Sequence[Any]) -> list[ToolSpec]:
    specs = []
    for t in tools:
        if not isinstance(t, FunctionTool):
            raise InvalidArgument(
                f"tool {getattr(t, 'name', type(t).__name__)!r} is a provider's hosted tool; a "
                "ledger Run sends function tools (the routes of a Run are other providers too)",
                field="tools")
        specs.append(ToolSpec(name=t.name, description=t.description or "",
                              parameters=dict(t.params_json_schema)))
    specs += [ToolSpec(name=h.tool_name, description=h.tool_description or "",
                       parameters=dict(h.input_json_schema)) for h in handoffs]
    return specs


def _unknown(stop: FailoverExhausted) -> bool:
    """Whether an Attempt of the stopped turn may have executed without a receipt."""
    if stop.reason == "execution_unknown":
        return True
    for e in stop.exceptions:
        fact = getattr(e, "fact", None)
        if fact is None:
            continue
        if fact.phase is Phase.AFTER_SEND or fact.category is Category.CANCELLED:
            return True
        # After the headers, a transport failure (no first token in time, a cut or stalled
        # stream, a body that is no answer) is no receipt: the provider took the request.
        # An error status or error body is an answer, and a refusal.
        if fact.phase in (Phase.AFTER_HEADERS, Phase.MID_STREAM) and fact.transport is not None:
            return True
    return False


def retry_advice(error: Exception) -> ModelRetryAdvice | None:
    """What the ledger knows of a failed model call, in the Agents SDK's retry vocabulary.

    - a stop (:class:`~ledger.errors.FailoverExhausted`): ``suggested=False`` (the Run already
      retried and failed over as its policy allows); ``replay_safety="unsafe"`` when an Attempt
      may have executed without a receipt, output was shown or a tool started, else
      ``"safe"``; ``response_started`` when output was shown; the last Attempt's status,
      provider code, Retry-After, network and timeout facts in ``normalized``;
    - any other ledger error (a refusal before anything was sent: bad input, a lease lost, a
      session used outside its block): ``suggested=False``, ``replay_safety="safe"``;
    - anything else: no advice (``None``).
    """
    if isinstance(error, FailoverExhausted):
        facts = [e.fact for e in error.exceptions
                 if isinstance(e, ProviderError) and e.fact is not None]
        last = facts[-1] if facts else None
        started = error.partial is not None or any(f.effective_output for f in facts)
        unsafe = _unknown(error) or started or any(f.tool_started for f in facts)
        normalized = ModelRetryNormalizedError(
            status_code=int(last.status) if last is not None and last.status else None,
            error_code=last.provider_code if last is not None else None,
            retry_after=last.retry_after_s if last is not None else None,
            is_network_error=last is not None and last.transport is not None,
            is_timeout=last is not None and last.category is Category.TIMEOUT)
        return ModelRetryAdvice(
            suggested=False, retry_after=normalized.retry_after,
            replay_safety="unsafe" if unsafe else "safe", response_started=started,
            reason=f"the ledger's Run stopped ({error.reason}): {error.detail}".strip(": "),
            normalized=normalized)
    if isinstance(error, LedgerError):
        return ModelRetryAdvice(suggested=False, replay_safety="safe",
                                reason=f"refused by the ledger before anything was sent: "
                                       f"{type(error).__name__}")
    return None


@dataclass
class LedgerModelResponse(ModelResponse):
    """A ``ModelResponse`` that also says which model served and what the ledger recorded.

    ``response_id`` is the Attempt that served; ``model`` the model it reported;
    ``ledger`` the Run, turn, Attempt, every Attempt of the turn, route, cost.
    """

    model: str = ""
    ledger: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Answer:
    """A served turn in the Responses format."""

    items: list[Any]
    usage: Usage
    response: Response
    detail: dict[str, Any]


def _answer(result: Any, parts: Sequence[Part], run_id: str) -> _Answer:
    att = result.attempt
    attempt_id = att.attempt_id
    items: list[Any] = []
    n = 0
    for p in parts:
        if p.kind is MediaKind.REASONING and p.payload is not None:
            summary = _summary(p.payload)
            items.append(ResponseReasoningItem(
                id=f"rs_{attempt_id}_{n}", type="reasoning",
                summary=[Summary(text=summary, type="summary_text")] if summary else [],
                encrypted_content=base64.b64encode(p.payload).decode("ascii")))
            n += 1
    texts = [p for p in parts if p.role == "assistant" and p.tool_call_id is None
             and p.media_type is None]
    if texts:
        items.append(ResponseOutputMessage(
            id=f"msg_{attempt_id}", type="message", role="assistant", status="completed",
            content=[ResponseOutputText(type="output_text", text="".join(
                p.content for p in texts), annotations=[])]))
    for p in parts:
        if p.tool_call_id is not None:
            items.append(ResponseFunctionToolCall(
                id=f"fc_{attempt_id}_{n}", type="function_call", call_id=p.tool_call_id,
                name=p.name or "", arguments=p.content or "{}", status="completed"))
            n += 1
    detail = attempts_detail(result, run_id)
    # The usage as the Attempt recorded it (the cached and reasoning parts are None where the
    # provider did not report them).
    cached, reasoning = att.cached_tokens or 0, att.reasoning_tokens or 0
    prompt, completion = att.prompt_tokens or 0, att.completion_tokens or 0
    usage = Usage(requests=1, input_tokens=prompt, output_tokens=completion,
                  total_tokens=prompt + completion,
                  input_tokens_details=_input_details(cached),
                  output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))
    metadata = {"ledger_" + k: (",".join(v) if isinstance(v, list) else str(v))
                for k, v in detail.items() if v is not None}
    response = Response(
        id=attempt_id, created_at=att.settled_at or att.created_at,
        model=att.model_reported or att.model, object="response", output=items,
        parallel_tool_calls=False, tool_choice="auto", tools=[], status="completed",
        metadata=metadata,
        usage=ResponseUsage(input_tokens=prompt, output_tokens=completion,
                            total_tokens=prompt + completion,
                            input_tokens_details=_input_details(cached),
                            output_tokens_details=OutputTokensDetails(
                                reasoning_tokens=reasoning)))
    return _Answer(items=items, usage=usage, response=response, detail=detail)


def _input_details(cached: int) -> InputTokensDetails:
    # openai's later models added cache_write_tokens; validating a mapping suits both.
    return InputTokensDetails.model_validate({"cached_tokens": cached, "cache_write_tokens": 0})


def _summary(data: bytes) -> str:
    try:
        item = json.loads(data).get("item", {})
    except (ValueError, AttributeError):
        return ""
    if isinstance(item, dict) and item.get("type") == "thinking" and isinstance(
            item.get("thinking"), str):
        return str(item["thinking"])  # an Anthropic thinking block shows its text
    summary = item.get("summary") if isinstance(item, dict) else None
    return "".join(s.get("text", "") for s in summary if isinstance(s, dict)) \
        if isinstance(summary, list) else ""


class LedgerAgentModel(Model):
    """An Agents SDK ``Model`` whose every call is one turn of a ledger Run.

    Made by :meth:`LedgerModelProvider.get_model`; use it inside the Run session's block.

    Args:
        run: The :class:`~ledger.AsyncRunSession` (``async with led.run(...) as run``).
        route: A route of the Run's plan whose predecessors the requests do not use (failover
            goes on down the plan from it; where a request starts among the routes left is
            the policy's ``failover.new_turn``, by default the route the Run used last).
            ``None``: every route of the plan.
        tool_data_class: The data class tool outputs (and the files tools returned) are
            recorded under (``tool_result``).
        document_data_class: The data class of the images and files of user messages
            (``user_input``; another class has each file's provenance recorded).

    Raises:
        InvalidArgument: ``run`` is not an async Run session, a data class is empty, or
            ``route`` is not a route of the Run's plan.
        InvalidState: ``route`` was given and the session is not open.

    Model settings: ``max_tokens`` (the envelope's ``max_output_tokens``), ``temperature``
    and ``top_p``. ``retry`` with retries, ``store=True``, ``previous_response_id``,
    ``conversation_id`` and stored prompts are refused; the other settings are not sent (the
    routes of a Run speak different protocols). ``timeout`` is the SDK's own: it cancels the
    turn, which settles truthfully.
    """

    def __init__(self, run: AsyncRunSession, *, route: str | None = None,
                 tool_data_class: str = "tool_result",
                 document_data_class: str = USER_INPUT) -> None:
        self.link = RunLink(run, who="LedgerAgentModel", route=route,
                            tool_data_class=tool_data_class,
                            document_data_class=document_data_class, need_async=True,
                            retries=_RETRIES)
        self.run = run

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        """The ledger's facts about a failed call, for the runner (see :func:`retry_advice`)."""
        return retry_advice(request.error)

    # -- the envelope ----------------------------------------------------------------------

    async def envelope(self, system_instructions: str | None,
                       input: str | list[TResponseInputItem], model_settings: ModelSettings,
                       tools: Sequence[Any], output_schema: AgentOutputSchemaBase | None,
                       handoffs: Sequence[Handoff], *, stream: bool,
                       previous_response_id: str | None = None,
                       conversation_id: str | None = None, prompt: Any = None) -> Envelope:
        """The turn's envelope for the SDK's request.

        Raises:
            InvalidArgument: a setting the ledger cannot honour (provider-side conversation
                state, SDK retries), or input it cannot send (the field names it).
        """
        link = self.link
        if previous_response_id:
            raise _chained(previous_response_id, input)
        if conversation_id:
            raise InvalidArgument(f"conversation_id asks the provider to hold the conversation; "
                                  f"{_STATE_FIX}", field="conversation_id")
        if prompt is not None:
            stored = prompt.get("id") if isinstance(prompt, dict) else None
            raise InvalidArgument(
                f"a stored prompt (Agent(prompt=...){f', id {stored!r}' if stored else ''}) "
                "lives at one provider, and a ledger Run may fail over to another route: put "
                "the prompt's text in Agent(instructions=...) instead (a string, or a function "
                "of the run context and the agent that returns it, for the prompt's variables)",
                field="prompt")
        retry = model_settings.retry
        if retry is not None and (retry.max_retries or 0) > 0:
            raise InvalidArgument(
                "ModelSettings(retry=...) turns on the SDK runner's retries, and the ledger's "
                "Run is the retry owner: it retries and fails over as its frozen policy says, "
                "within its budget. Remove retry (or set max_retries=0)",
                field="model_settings.retry")
        if model_settings.store:
            raise InvalidArgument(
                "ModelSettings(store=True) asks the provider to keep the response, and a "
                "ledger Run keeps no response at a provider (it sends store: false: the "
                "conversation is the input, which a failover sends to another route). Remove "
                "store=True from the agent's model_settings and the RunConfig's (or set "
                "store=False)", field="model_settings.store")
        parts: list[Part] = []
        if system_instructions:
            parts.append(Part(role="system", content=system_instructions, data_class=SYSTEM))
        if output_schema is not None and not output_schema.is_plain_text():
            # Prompted, not the provider's JSON mode: a Run may fail over to another protocol.
            parts.append(Part(role="system", data_class=SYSTEM, content=(
                "Answer with a JSON value that matches this JSON schema, and nothing else: "
                + json.dumps(output_schema.json_schema(), sort_keys=True))))
        given: list[Any] = [{"role": "user", "content": input}] if isinstance(input, str) \
            else list(input)
        calls: list[Part] = []
        returns: list[tuple[int, int, dict[str, Any]]] = []  # (part index, item index, item)
        for at, given_item in enumerate(given):
            try:
                item = _plain(given_item)
                kind = item.get("type", "message")
                role = item.get("role")
                if kind == "message" and role in ("system", "developer"):
                    parts.append(Part(role="system", data_class=SYSTEM,
                                      content=_content_text(item.get("content"),
                                                            f"a {role} message")))
                elif kind == "message" and role == "user":
                    parts += [await link.document(p) for p in
                              _user_parts(item.get("content"), link.document_data_class)]
                elif kind == "message" and role == "assistant":
                    parts.append(Part(role="assistant", data_class=MODEL_DERIVED,
                                      provenance=_attempt_of(item.get("id")),
                                      content=_content_text(item.get("content"),
                                                            "an assistant message")))
                elif kind == "function_call":
                    call = Part(role="assistant", data_class=MODEL_DERIVED,
                                provenance=_attempt_of(item.get("id")),
                                content=item.get("arguments") or "{}",
                                tool_call_id=item.get("call_id"), name=item.get("name"))
                    calls.append(call)
                    parts.append(call)
                elif kind == "function_call_output":
                    _check_call_id(item.get("call_id"))
                    returns.append((len(parts), at, item))
                    parts.append(Part(content=""))  # replaced below, once recorded
                elif kind == "reasoning":
                    attempt = _attempt_of(item.get("id"))
                    carried = item.get("encrypted_content")
                    if attempt is None or not isinstance(carried, str):
                        continue  # not one the ledger carried: optional, and never sent
                    parts.append(Part(role="assistant", data=carried_reasoning(carried),
                                      media_type=REASONING_MEDIA_TYPE,
                                      data_class=MODEL_DERIVED, provenance=attempt))
                else:
                    raise InvalidArgument(
                        f"an input item of type {kind!r} cannot be sent through a ledger Run "
                        "(messages, function calls and their outputs, and the reasoning items "
                        "it returned can): drop it from the input", field="input")
            except InvalidArgument as e:
                raise in_message(e, "input", at, _described(given_item)) from e
        results: dict[int, list[Part]] = {}
        for index, at, item in returns:
            call_id = item["call_id"]
            try:
                tool_name: str | None = next((c.name for c in calls
                                              if c.tool_call_id == call_id), None)
                output, files = _tool_output(item.get("output"), call_id, link.tool_data_class)
                results[index] = await link.tool_parts(
                    call_id, tool_name, output, calls, files, field="input",
                    bytes_fix="ToolOutputImage or ToolOutputFileContent with a data: URL or "
                              "file_data, not a URL")
            except InvalidArgument as e:
                raise in_message(e, "input", at, "a function_call_output item") from e
        parts = spliced(parts, results)
        out: dict[str, Any] = {}
        if model_settings.max_tokens is not None:
            out["max_output_tokens"] = model_settings.max_tokens
        tuning = {k: getattr(model_settings, k) for k in ("temperature", "top_p")
                  if getattr(model_settings, k) is not None}
        if tuning:
            out["params"] = tuning
        return Envelope(parts=parts, tools=_tool_specs(tools, handoffs), stream=stream, **out)

    def _options(self, turn_id: str) -> dict[str, Any]:
        options: dict[str, Any] = {"turn_id": turn_id}
        if self.link.denials is not None:
            options["denials"] = self.link.denials
        return options

    async def _served(self, result: Any, envelope: Envelope) -> _Answer:
        used = [p.tool_call_id for p in envelope.parts if p.tool_call_id]
        parts = await self.link.stable_calls(result, used)
        return _answer(result, parts, self.run.run_id)

    # -- the SDK's calls -------------------------------------------------------------------

    async def get_response(self, system_instructions: str | None,
                           input: str | list[TResponseInputItem], model_settings: ModelSettings,
                           tools: list[Any], output_schema: AgentOutputSchemaBase | None,
                           handoffs: list[Handoff], tracing: ModelTracing, *,
                           previous_response_id: str | None, conversation_id: str | None,
                           prompt: Any) -> ModelResponse:
        """Serve one model call of the runner as one turn of the Run (buffered)."""
        self.link.check_open()
        envelope = await self.envelope(system_instructions, input, model_settings, tools,
                                       output_schema, handoffs, stream=False,
                                       previous_response_id=previous_response_id,
                                       conversation_id=conversation_id, prompt=prompt)
        turn_id = await self.link.guard(envelope)
        try:
            result = await self.run.turn(envelope, **self._options(turn_id))
        except BaseException as e:
            self.link.sent(envelope, turn_id, e)
            raise
        self.link.sent(envelope, turn_id, None)
        answer = await self._served(result, envelope)
        return LedgerModelResponse(output=answer.items, usage=answer.usage,
                                   response_id=answer.response.id,
                                   request_id=getattr(result.output, "request_id", None),
                                   model=answer.response.model, ledger=answer.detail)

    async def stream_response(self, system_instructions: str | None,
                              input: str | list[TResponseInputItem],
                              model_settings: ModelSettings, tools: list[Any],
                              output_schema: AgentOutputSchemaBase | None,
                              handoffs: list[Handoff], tracing: ModelTracing, *,
                              previous_response_id: str | None, conversation_id: str | None,
                              prompt: Any) -> AsyncIterator[TResponseStreamEvent]:
        """Serve one model call as one streamed turn, in Responses events.

        Text deltas as the provider sends them; the answer's reasoning and tool calls once
        the turn completed (so the SDK never starts a tool of an answer that may still fail);
        then ``response.completed`` with the answer, its usage, the served model and the
        ledger's record in its ``metadata``. A stop raises
        :class:`~ledger.errors.FailoverExhausted` from the iteration.
        """
        from ledger.adapters.contract import Reset, TextDelta

        link = self.link
        link.check_open()
        envelope = await self.envelope(system_instructions, input, model_settings, tools,
                                       output_schema, handoffs, stream=True,
                                       previous_response_id=previous_response_id,
                                       conversation_id=conversation_id, prompt=prompt)
        turn_id = await link.guard(envelope)
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def serve() -> Any:
            try:
                return await self.run.turn(envelope, on_event=events.put_nowait,
                                           **self._options(turn_id))
            finally:
                events.put_nowait(_DONE)

        seq = _Seq()
        live = f"msg_{turn_id}"  # the streamed text's item, until the answer names its Attempt
        first = self.run.record.plan[0].model if self.run.record else ""
        task: asyncio.Future[Any] | None = None
        text: list[str] = []
        at = 0  # the output index of the streamed text's item
        try:
            yield ResponseCreatedEvent(type="response.created", sequence_number=seq(),
                                       response=_pending(turn_id, first))
            task = asyncio.ensure_future(serve())
            while (event := await events.get()) is not _DONE:
                if isinstance(event, Reset) and text:
                    # The text shown so far is no answer (a policy that moves on after it was
                    # delivered, goclaw's): its item ends incomplete, and what follows is a new
                    # item, so that no .done event holds discarded text as the answer's.
                    for done in _text_done(seq, at, live, "".join(text), "incomplete"):
                        yield done
                    at, text = at + 1, []
                    live = f"msg_{turn_id}_{at}"
                    continue
                if not (isinstance(event, TextDelta) and event.text):
                    continue
                if not text:
                    yield ResponseOutputItemAddedEvent(
                        type="response.output_item.added", sequence_number=seq(),
                        output_index=at, item=_message(live, "", "in_progress"))
                    yield ResponseContentPartAddedEvent(
                        type="response.content_part.added", sequence_number=seq(),
                        output_index=at, item_id=live, content_index=0,
                        part=ResponseOutputText(type="output_text", text="", annotations=[]))
                text.append(event.text)
                yield ResponseTextDeltaEvent(type="response.output_text.delta",
                                             sequence_number=seq(), output_index=at,
                                             item_id=live, content_index=0, delta=event.text,
                                             logprobs=[])
        finally:
            error = None
            interrupted = False
            if task is not None:
                if not task.done():
                    task.cancel()  # the reader left: the turn is cancelled, settles truthfully
                interrupted = await wait_out(task)
                error = None if task.cancelled() else task.exception()
            link.sent(envelope, turn_id, error)
            if interrupted:
                raise asyncio.CancelledError
        assert task is not None  # unset only when the reader left at response.created
        answer = await self._served(await task, envelope)
        if text:
            for done in _text_done(seq, at, live, "".join(text), "completed"):
                yield done
            at += 1
        for index, item in enumerate(answer.items, start=at):
            if isinstance(item, ResponseOutputMessage):
                continue
            yield ResponseOutputItemAddedEvent(type="response.output_item.added",
                                               sequence_number=seq(), output_index=index,
                                               item=item)
            if isinstance(item, ResponseFunctionToolCall):
                yield ResponseFunctionCallArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta", sequence_number=seq(),
                    output_index=index, item_id=item.id or "", delta=item.arguments)
                yield ResponseFunctionCallArgumentsDoneEvent(
                    type="response.function_call_arguments.done", sequence_number=seq(),
                    output_index=index, item_id=item.id or "", arguments=item.arguments,
                    name=item.name)
            yield ResponseOutputItemDoneEvent(type="response.output_item.done",
                                              sequence_number=seq(), output_index=index,
                                              item=item)
        yield ResponseCompletedEvent(type="response.completed", sequence_number=seq(),
                                     response=answer.response)


class _Seq:
    def __init__(self) -> None:
        self.n = -1

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _text_done(seq: _Seq, at: int, item_id: str, text: str, status: Any) -> list[Any]:
    """The events that end a streamed text's item ``item_id`` (at output index ``at``)."""
    return [
        ResponseTextDoneEvent(type="response.output_text.done", sequence_number=seq(),
                              output_index=at, item_id=item_id, content_index=0, text=text,
                              logprobs=[]),
        ResponseContentPartDoneEvent(
            type="response.content_part.done", sequence_number=seq(), output_index=at,
            item_id=item_id, content_index=0,
            part=ResponseOutputText(type="output_text", text=text, annotations=[])),
        ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=seq(),
                                    output_index=at, item=_message(item_id, text, status))]


def _message(item_id: str, text: str, status: Any) -> ResponseOutputMessage:
    return ResponseOutputMessage(id=item_id, type="message", role="assistant", status=status,
                                 content=[ResponseOutputText(type="output_text", text=text,
                                                             annotations=[])])


def _pending(turn_id: str, model: str) -> Response:
    return Response(id=f"resp_{turn_id}", created_at=time.time(), model=model,
                    object="response", output=[], parallel_tool_calls=False,
                    tool_choice="auto", tools=[], status="in_progress")


class LedgerModelProvider(ModelProvider):
    """The Agents SDK's ``ModelProvider`` for a ledger Run: ``RunConfig(model_provider=...)``.

    ``get_model(None)`` (an agent without a ``model``) may use every route of the Run's plan;
    ``get_model("backup")`` not the routes before ``backup``. Where a request starts among
    those is the policy's ``failover.new_turn`` (by default the route the Run used last, which
    may be one an earlier agent's ``model`` led to). Every agent of the run
    (handoffs included) draws on the one Run: its budget, its grant, its Attempts.

    The agents run with ``await Runner.run(...)`` or ``Runner.run_streamed(...)``; not
    ``Runner.run_sync(...)``, which refuses to run inside the event loop the async session
    needs (from synchronous code: ``asyncio.run(main())``, with the ``async with led.run(...)``
    block inside ``main``).

    Args:
        run: The :class:`~ledger.AsyncRunSession` (``async with led.run(...) as run``).
        tool_data_class: As :class:`LedgerAgentModel`.
        document_data_class: As :class:`LedgerAgentModel`.

    Raises:
        InvalidArgument: ``run`` is not an async Run session, or a data class is empty; from
            ``get_model``, a name that is not a route of the Run's plan.
    """

    def __init__(self, run: AsyncRunSession, *, tool_data_class: str = "tool_result",
                 document_data_class: str = USER_INPUT) -> None:
        RunLink(run, who="LedgerModelProvider", tool_data_class=tool_data_class,
                document_data_class=document_data_class, need_async=True)
        self.run = run
        self.tool_data_class = tool_data_class
        self.document_data_class = document_data_class
        self._models: dict[str | None, LedgerAgentModel] = {}

    def get_model(self, model_name: str | None) -> Model:
        """The model for an agent's ``model`` name: ``None``, or a route of the Run's plan."""
        found = self._models.get(model_name or None)
        if found is None:
            try:
                found = LedgerAgentModel(self.run, route=model_name or None,
                                         tool_data_class=self.tool_data_class,
                                         document_data_class=self.document_data_class)
            except InvalidArgument as e:
                if e.field != "route":
                    raise
                raise InvalidArgument(f"agent model {model_name!r}: {e.message}; an agent's "
                                      "model names a route of the Run's plan (or leave it None)",
                                      field="model", **{k: v for k, v in e.fields.items()
                                                        if k != "field"}) from e
            self._models[model_name or None] = found
        return found


__all__ = ["LedgerAgentModel", "LedgerModelProvider", "LedgerModelResponse", "retry_advice"]
