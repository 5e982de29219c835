"""Which envelope parts (and parameter values) a route's wire protocol can build a request of.

A codec maps each part to its protocol's structure, and the adapter sends the body as UTF-8
JSON. A few parts cannot be mapped, whatever the route: an assistant tool-call part
(``tool_call_id`` set) without the tool's ``name`` or whose ``content`` is not the call's
arguments as a JSON object a body can carry (none holding ``NaN``, an infinity or a lone
surrogate), a part whose text holds a lone surrogate, and params or a tool's parameters
(or its description) that are no JSON data (these on every protocol, a codec of your own
included: no UTF-8 body can carry them), a
``tool`` part without the ``tool_call_id`` of the call it answers (chat completions,
Responses, Anthropic) or without the ``name`` of the function (Gemini), an envelope with
nothing to send but system parts (Responses, Anthropic and Gemini, which leave reasoning items
out and, Anthropic and Gemini, empty text parts), a tool call that nothing answers (no ``tool``
part of its id, nor files its tool returned alone) while the conversation goes on after it
(every protocol of these codecs) or at the request's end (chat completions), a tool call whose
result is sent where the protocol reads none (chat completions, Anthropic, Gemini: something
sent between the call and its result, on Gemini the empty text a route sends back with its
thought signature too, on that route only; the Responses API pairs them by id), a tool result that
answers no call before it (every protocol of these codecs; on Gemini, a result without an id
that no call of its name before it is left for) or repeats the result of a call answered
already (every protocol of these codecs), a tool call whose id another call of its turn has
(chat completions, Responses, Anthropic) or any earlier call (Responses, Anthropic), and on the
Responses API a ``params["tools"]`` that is not a list of the provider's built-in tools.

The rules live in the pure core so that preflight judges every candidate before an Attempt is
begun: a route whose protocol cannot build the request is ineligible (``capability``), and a
request no route of its plan can carry is refused with :class:`~ledger.errors.InvalidArgument`
naming the field before anything is recorded. Each codec raises the same error through the
same functions when it is called directly, and the adapter the unencodable text and params
(:func:`require_encodable`) before any codec builds a body. A protocol without a codec here
(``generic``, a codec of your own) refuses none of the others.

The per-request judgement (:func:`uncarried`) reads the tool parts, the tool-call parts and
``params``, each part's text only when it is not ASCII (a flag in CPython), and the parts up
to the first one that would be sent: a request of ASCII text without tool calls costs a few
attribute reads per part. The verdicts on tool calls' arguments and non-ASCII text are
remembered by the text (up to 16 KiB each, 1,024 of each), so a conversation's history is
not read again every turn.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ledger.domain.envelope import (
    SURROGATE_FIX,
    SURROGATE_PROBLEM,
    Envelope,
    Part,
    ToolSpec,
    json_data_problem,
    lone_surrogate,
)
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind
from ledger.errors import InvalidArgument

_P = WireProtocol
#: The protocols whose codecs these rules are: a route of another protocol is judged by its
#: own codec.
CODEC_PROTOCOLS = frozenset({_P.OPENAI, _P.OPENAI_RESPONSES, _P.ANTHROPIC, _P.GEMINI})
#: The protocols that refuse what no JSON body can carry: all of them, a codec of your own
#: included, since the adapter sends every codec's body as UTF-8 JSON.
EVERY_PROTOCOL = frozenset(WireProtocol)
# A tool result names its call by id on these; Gemini names the function instead.
_RESULT_BY_ID = frozenset({_P.OPENAI, _P.OPENAI_RESPONSES, _P.ANTHROPIC})
_RESULT_BY_NAME = frozenset({_P.GEMINI})
# Chat completions takes a conversation of system messages alone; these need one more.
_NEEDS_MESSAGE = (_P.OPENAI_RESPONSES, _P.ANTHROPIC, _P.GEMINI)
# An empty text part is left out of the request (the API refuses an empty text block).
_DROPS_EMPTY_TEXT = frozenset({_P.ANTHROPIC, _P.GEMINI})
_ONLY_RESPONSES = frozenset({_P.OPENAI_RESPONSES})


@dataclass(frozen=True, slots=True)
class Uncarried:
    """Something of a request the codecs of ``protocols`` cannot build a request of.

    ``field`` is the path an :class:`~ledger.errors.InvalidArgument` names
    (``envelope.parts[3]``, ``envelope.params.tools[0]``), ``message`` what is wrong, ``fix``
    what to do instead. ``route``: only the route of that id cannot build it, when what its
    codec sends depends on reasoning that route wrote (a Gemini thought signature goes back to
    its own route only); ``None``: every route of ``protocols``.
    """

    protocols: frozenset[WireProtocol]
    field: str
    message: str
    fix: str
    route: str | None = None

    def refuses(self, protocol: WireProtocol, route: str | None = None) -> bool:
        """Whether a route of ``protocol`` (of id ``route``, when known) cannot build it."""
        return protocol in self.protocols and (self.route is None or self.route == route)

    def error(self) -> InvalidArgument:
        """The typed error a codec raises for it (and a turn, when no route can carry it)."""
        return InvalidArgument(f"{self.message}; {self.fix}", field=self.field)


class _NotFinite(ValueError):
    """A number the JSON text spells that no JSON body can carry (NaN, an infinity)."""


def _no_constant(name: str) -> NoReturn:
    raise _NotFinite(name)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)  # 1e400 reads as inf
    return value


# What is wrong with a tool call's arguments, as :func:`_read_arguments` says it.
_NOT_OBJECT = "not an object"
_NOT_FINITE = "not finite"
_SURROGATE = "a lone surrogate"


def _holds_surrogate(value: Any) -> bool:
    """Whether a key or a string anywhere in the parsed ``value`` holds a lone surrogate."""
    todo = [value]  # a loop, not recursion: the parser took nesting as deep as the stack
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if lone_surrogate(v) is not None:
                return True
        elif isinstance(v, dict):
            todo.extend(v)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


def _read_arguments(content: str) -> dict[str, Any] | str:
    """``content`` as a JSON object a request body can carry, else what is wrong with it."""
    try:
        value = json.loads(content or "{}", parse_float=_finite, parse_constant=_no_constant)
    except _NotFinite:
        return _NOT_FINITE
    except (ValueError, RecursionError):
        return _NOT_OBJECT
    if not isinstance(value, dict):
        return _NOT_OBJECT
    # A parsed string holds a surrogate only if the text holds one, or escapes one (\ud800).
    if (not content.isascii() or "\\u" in content) and _holds_surrogate(value):
        return _SURROGATE
    return value


def json_object(content: str) -> dict[str, Any] | None:
    """``content`` as a JSON object a request can carry (empty text: ``{}``), else ``None``.

    Not one: text that is not JSON or not an object, and an object holding ``NaN`` or an
    infinity (Python's reader takes ``NaN``, ``Infinity`` and ``1e400``; JSON has none) or a
    string or key with a lone surrogate (no UTF-8 body carries one). A tool call's arguments,
    both ways: an answer's proposal whose arguments are not one is the provider's malformed
    answer (``ToolCall.arguments``), a tool-call part whose content is not one cannot be sent
    (:func:`tool_call_refusal`).
    """
    value = _read_arguments(content)
    return value if isinstance(value, dict) else None


# Every turn judges the whole history's tool calls (:func:`uncarried`) and texts; a
# conversation's parts are the same objects turn after turn, and a str keeps its hash, so their
# verdicts are remembered by their text: the short ones, so that the memo stays small.
_MEMO_CHARS = 16 * 1024


def _problem_of(content: str) -> str | None:
    """What is wrong with a tool call's arguments (:func:`_read_arguments`), or ``None``."""
    value = _read_arguments(content)
    return value if isinstance(value, str) else None


_remembered_arguments = functools.lru_cache(maxsize=1024)(_problem_of)


def _arguments_problem(content: str) -> str | None:
    return (_remembered_arguments(content) if len(content) <= _MEMO_CHARS
            else _problem_of(content))


_remembered_surrogate = functools.lru_cache(maxsize=1024)(lone_surrogate)


def _unnamed_call(where: str) -> Uncarried:
    return Uncarried(CODEC_PROTOCOLS, where, "an assistant tool-call part needs name= (the "
                     "tool's name)", "carry the part as a turn's result.parts returned it, or "
                     "set name= to the tool the model called")


def _arguments_refusal(problem: str, index: int) -> Uncarried:
    if problem == _NOT_OBJECT:
        return Uncarried(CODEC_PROTOCOLS, f"envelope.parts[{index}]", "an assistant part with "
                         "tool_call_id carries the call's arguments as a JSON object in its "
                         "content", "put the arguments as a JSON object (e.g. "
                         "'{\"city\": \"Oslo\"}', '{}' for none) in content")
    where = f"envelope.parts[{index}].content"
    if problem == _NOT_FINITE:
        return Uncarried(CODEC_PROTOCOLS, where, "the tool call's arguments hold NaN or an "
                         "infinity (NaN, Infinity, a number such as 1e400), which JSON does not "
                         "have and no request body can carry", "write the value as a finite "
                         "number, a string or null (json.dumps(args, allow_nan=False) finds "
                         "them)")
    return Uncarried(CODEC_PROTOCOLS, where, f"a string of the tool call's arguments "
                     f"{SURROGATE_PROBLEM}", SURROGATE_FIX)


def tool_call_refusal(part: Part, index: int) -> Uncarried | None:
    """Why an assistant tool-call part (``tool_call_id`` set) cannot be sent, or ``None``.

    It needs a ``name`` and its content must be the arguments as a JSON object a body can
    carry (:func:`json_object`); the field is ``envelope.parts[index]``, or
    ``envelope.parts[index].content`` for an object no body can carry.
    """
    if not part.name:
        return _unnamed_call(f"envelope.parts[{index}]")
    problem = _arguments_problem(part.content)
    return None if problem is None else _arguments_refusal(problem, index)


def text_refusal(part: Part, index: int) -> Uncarried | None:
    """Why ``part``'s text can go in no request body (a lone surrogate), or ``None``.

    Every protocol refuses it (:data:`EVERY_PROTOCOL`). An assistant tool-call part's content
    is its arguments, judged by :func:`tool_call_refusal` instead. The usual (ASCII) text costs
    a flag read; other text is read once and its verdict remembered.
    """
    content = part.content
    if content.isascii():
        return None  # the usual text: a flag read, no memo entry
    at = (_remembered_surrogate(content) if len(content) <= _MEMO_CHARS
          else lone_surrogate(content))
    if at is None:
        return None
    return Uncarried(EVERY_PROTOCOL, f"envelope.parts[{index}].content",
                     f"the part's content, at character {at}, {SURROGATE_PROBLEM}", SURROGATE_FIX)


def _json_refusal(values: Mapping[str, Any], field: str, shown: str) -> Uncarried | None:
    """Why ``values`` (at ``field``, shown as ``shown``) can go in no request body, or ``None``.

    The refusal names the first entry that holds the problem.
    """
    problem = json_data_problem(values)
    if problem is None:
        return None
    what = f"a key of {shown}"
    if isinstance(values, Mapping):
        for name, value in values.items():
            found = json_data_problem(value)
            if found is not None:
                problem, field, what = found, f"{field}.{name}", f"{shown}[{name!r}]"
                break
    message, fix = problem
    return Uncarried(EVERY_PROTOCOL, field, f"{what} {message}", fix)


def params_refusal(params: Mapping[str, Any]) -> Uncarried | None:
    """Why ``params`` can go in no request body, or ``None`` (:func:`json_data_problem`).

    ``Envelope`` refuses such params when it is built; this finds them in one built without
    validation (``model_copy(update=...)``, ``model_construct``) or changed in place. Every
    protocol refuses them; the field names the first parameter that holds the problem.
    """
    if not params:
        return None
    return _json_refusal(params, "envelope.params", "Envelope.params")


def tool_refusals(tools: Sequence[ToolSpec]) -> list[Uncarried]:
    """Why tools' definitions can go in no request body, in order (none: every one can).

    ``ToolSpec`` refuses parameters that are no JSON data (``NaN``, an infinity, a set, a lone
    surrogate) and a description with a lone surrogate when it is built; this finds them in
    one built without validation (``model_construct``, ``model_copy(update=...)``) or changed
    in place, which every route's codec would otherwise put in a body the adapter cannot
    encode. Every protocol refuses them; the field is ``envelope.tools[i].description`` or
    ``envelope.tools[i].parameters.<first key that holds the problem>``.
    """
    out: list[Uncarried] = []
    for i, tool in enumerate(tools):
        description = tool.description
        if (isinstance(description, str) and not description.isascii()
                and lone_surrogate(description) is not None):
            out.append(Uncarried(EVERY_PROTOCOL, f"envelope.tools[{i}].description",
                                 f"Envelope.tools[{i}].description {SURROGATE_PROBLEM}",
                                 SURROGATE_FIX))
        refusal = _json_refusal(tool.parameters, f"envelope.tools[{i}].parameters",
                                f"Envelope.tools[{i}].parameters")
        if refusal is not None:
            out.append(refusal)
    return out


def unencodable(envelope: Envelope) -> list[Uncarried]:
    """What of ``envelope`` no protocol's request body can carry, in the order found.

    The parts' text (:func:`text_refusal`; a tool call's arguments are its codec's, through
    :func:`tool_arguments`), the tools' definitions (:func:`tool_refusals`) and the parameters
    (:func:`params_refusal`). The adapter refuses them for every route
    (:func:`require_encodable`); a turn finds them in :func:`uncarried`.
    """
    out = [r for i, p in enumerate(envelope.parts)
           if not (p.tool_call_id and p.role == "assistant")
           and (r := text_refusal(p, i)) is not None]
    out.extend(tool_refusals(envelope.tools))
    refusal = params_refusal(envelope.params)
    if refusal is not None:
        out.append(refusal)
    return out


def require_encodable(envelope: Envelope) -> None:
    """Refuse an envelope no request body can carry (:func:`unencodable`).

    Raises:
        InvalidArgument: naming the first such field (``envelope.parts[<i>].content``,
            ``envelope.tools[<i>].parameters.<name>``, ``envelope.params.<name>``) and the
            fix.
    """
    found = unencodable(envelope)
    if found:
        raise found[0].error()


def tool_arguments(part: Part, index: int) -> dict[str, Any]:
    """The arguments of an assistant tool-call part, which carries them as a JSON object.

    Raises:
        InvalidArgument: the part has no ``name`` or its content is not a JSON object a body
            can carry (:func:`tool_call_refusal`), naming ``envelope.parts[index]`` (or its
            ``.content``: NaN, an infinity, a lone surrogate).
    """
    if not part.name:
        raise _unnamed_call(f"envelope.parts[{index}]").error()
    args = _read_arguments(part.content)  # parsed once: the codec sends what it reads here
    if isinstance(args, str):
        raise _arguments_refusal(args, index).error()
    return args


def tool_result_refusals(part: Part, index: int) -> list[Uncarried]:
    """Why a ``tool`` part cannot be sent, per protocol (none: it can be, everywhere)."""
    where = f"envelope.parts[{index}]"
    out = []
    if not part.tool_call_id:
        out.append(Uncarried(_RESULT_BY_ID, where, "a tool part needs tool_call_id= (the id "
                             "of the call it answers)", "set tool_call_id= to the call's id "
                             "(run.tool_result(call, ...) sets it)"))
    if not part.name:
        out.append(Uncarried(_RESULT_BY_NAME, where, "a tool part for Gemini needs name= (the "
                             "function it answers)", "set name= to the called function's "
                             "name (run.tool_result(call, ...) sets it)"))
    return out


def require_tool_result(protocol: WireProtocol, part: Part, index: int) -> None:
    """Refuse a ``tool`` part ``protocol`` cannot send (:func:`tool_result_refusals`).

    Raises:
        InvalidArgument: naming ``envelope.parts[index]``.
    """
    for refusal in tool_result_refusals(part, index):
        if protocol in refusal.protocols:
            raise refusal.error()


def _in_tool_results(part: Part) -> bool:
    """A part a turn's tool results may hold: a ``tool`` part, or a user file (a tool's)."""
    return part.role == "tool" or (part.role == "user" and part.media_type is not None)


def _turn_calls(parts: Sequence[Part], start: int) -> dict[str, int]:
    """The tool calls of the assistant parts right before ``parts[start]``: id -> index."""
    first = start
    while first > 0 and parts[first - 1].role == "assistant":
        first -= 1
    out: dict[str, int] = {}
    for k in range(first, start):
        call_id = parts[k].tool_call_id
        if call_id and call_id not in out:
            out[call_id] = k
    return out


def result_runs(parts: Sequence[Part]) -> list[range]:
    """The runs of a turn's tool results in ``parts``, in order.

    A run is consecutive ``tool`` parts and user files that opens with a ``tool`` part or
    right after the assistant's tool calls, and answers a call: it holds a ``tool`` part, or a
    file whose ``provenance`` is a call of the assistant parts right before it (a tool that
    returned a file alone, :func:`files_alone`). Every codec sends a run's ``tool`` parts
    first, then its files (:func:`ledger.adapters.contract.wire_order`).
    """
    runs: list[range] = []
    i = 0
    while i < len(parts):
        end = i
        while end < len(parts) and _in_tool_results(parts[end]):
            end += 1
        opens = parts[i].role == "tool" or (
            i > 0 and parts[i - 1].role == "assistant" and parts[i - 1].tool_call_id is not None)
        run = range(i, end)
        answers = any(parts[k].role == "tool" for k in run)
        if opens and not answers and run:
            calls = _turn_calls(parts, i)
            answers = any(parts[k].provenance in calls for k in run)
        if not opens or not answers:
            i += 1
            continue
        runs.append(run)
        i = end
    return runs


def files_alone(parts: Sequence[Part]) -> dict[int, tuple[int, ...]]:
    """The tool results that are files alone: each one's index, with its files' indices.

    A tool that returned only an image or a document leaves its file, a user part whose
    ``provenance`` is the call's id, in the turn's tool results (:func:`result_runs`), and
    either an empty ``tool`` part beside it (``run.tool_result(call, "")``, or a framework's
    tool message without text) or no ``tool`` part at all (``run.tool_result(call,
    Part(...))`` alone). The index is the empty ``tool`` part's; for a call with no ``tool``
    part, it is the index of the call itself (the assistant part), whose result the codecs
    send as an empty one (:func:`ledger.adapters.contract.wire_order`): a call needs a result
    on every wire (:func:`unanswered_refusals`).

    Sent as they stand, the result would be an empty text, which Anthropic refuses, and the
    model would read that the tool returned nothing. A codec whose protocol carries files in a
    tool result puts them there instead (Anthropic's ``tool_result`` content, the Responses
    API's ``function_call_output``); the others send
    :data:`~ledger.adapters.contract.TOOL_FILES_TEXT` as the result.

    A file goes with the first empty result of its call; files of a call whose result has
    text, and a run's files of no call, are sent after the turn's results.
    """
    return _files_alone(parts, result_runs(parts))


def _files_alone(parts: Sequence[Part], runs: Sequence[range]) -> dict[int, tuple[int, ...]]:
    """:func:`files_alone` of ``parts`` whose :func:`result_runs` are ``runs``."""
    out: dict[int, tuple[int, ...]] = {}
    for run in runs:
        results = [k for k in run if parts[k].role == "tool" and parts[k].tool_call_id]
        answered = {parts[k].tool_call_id for k in results}
        # The empty results first, in order, then the calls no tool part answers.
        empty = [(k, parts[k].tool_call_id) for k in results if not parts[k].content]
        lacking = [(k, c) for c, k in _turn_calls(parts, run.start).items() if c not in answered]
        claimed: set[int] = set()
        for k, call_id in empty + lacking:
            files = tuple(j for j in run if j not in claimed and parts[j].role != "tool"
                          and parts[j].provenance == call_id)
            if files:
                out[k] = files
                claimed.update(files)
    return out


def lacking_results(parts: Sequence[Part],
                    alone: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
    """The calls of ``alone`` (:func:`files_alone`) that no ``tool`` part answers: file -> call.

    Each is keyed by the index of its first file, where the codecs send the empty result it
    gets.
    """
    return {files[0]: k for k, files in alone.items() if parts[k].role == "assistant"}


def sent_order(parts: Sequence[Part], alone: Mapping[int, tuple[int, ...]],
               runs: Sequence[range] | None = None) -> list[tuple[int, int | None]]:
    """The parts in the order every codec sends them, as ``(index, call)`` pairs.

    The order is the envelope's except within a turn's tool results (:func:`result_runs`):
    there the ``tool`` parts come first, in their order, then the files, in theirs. ``call``
    is ``None`` for a part sent as it stands; for the empty result a call answered by its files
    alone gets (:func:`lacking_results`), it is the call's index, and ``index`` its first
    file's, where that result goes among the results. ``alone``: the parts'
    :func:`files_alone`; ``runs``: their :func:`result_runs`, when the caller has them.
    """
    lacking = lacking_results(parts, alone)
    out: list[tuple[int, int | None]] = []
    starts = {r.start: r for r in (result_runs(parts) if runs is None else runs)}
    i = 0
    while i < len(parts):
        run = starts.get(i)
        if run is None:
            out.append((i, None))
            i += 1
            continue
        for k in run:
            if parts[k].role == "tool":
                out.append((k, None))
            elif k in lacking:
                out.append((k, lacking[k]))
        out.extend((k, None) for k in run if parts[k].role != "tool")
        i = run.stop
    return out


def unanswered_refusals(parts: Sequence[Part]) -> list[Uncarried]:
    """The refusals of ``parts``' tool calls without their result and results without a call.

    They come in the order of the parts they name.

    A call (an assistant part with ``tool_call_id``) is answered by a later ``tool`` part of
    its id, or by the files its tool returned alone (:func:`files_alone`). Chat completions,
    the Responses API, Anthropic and Gemini all refuse, with a 400, a request whose
    conversation goes on after a call without its result ("An assistant message with
    'tool_calls' must be followed by tool messages responding to each 'tool_call_id'", "No
    tool output found for function call", "`tool_use` ids were found without `tool_result`
    blocks immediately after", "the number of function response parts is equal to the number
    of function call parts"). A call among the request's last assistant parts (nothing but
    assistant and system parts after it) is refused on chat completions only, whose message
    says it must be followed by its results; the others' prefill is theirs to judge.

    A later result must also be where the protocol reads it (:func:`_misplaced`): chat
    completions takes a call's ``tool`` message only among those right after the assistant
    message, Anthropic a ``tool_result`` only among the blocks that open the next user
    message, Gemini a ``functionResponse`` only in the turn right after the call's. A result
    with the user's text, a file or another message sent before it is refused there, as the
    provider would; the Responses API pairs a ``function_call_output`` with its call by
    ``call_id`` wherever it stands, and takes it. On Gemini an empty assistant text is sent
    only by the route whose thought signature it carries back (:func:`_signed_empty_texts`):
    a model turn of its own there, refused for that route alone (:attr:`Uncarried.route`).

    A result that answers no call before it (:func:`_orphans`: a typo'd id, a call trimmed out
    of a truncated conversation, a result put before its call) is refused on every protocol
    ("messages with role 'tool' must be a response to a preceeding message with
    'tool_calls'", "No tool call found for function call output with call_id ...", "unexpected
    `tool_use_id` found in `tool_result` blocks", "function response turn comes immediately
    after a function call turn"); on Gemini, which pairs a result without an id with a call of
    its function's name, one that no call of its name before it is left for. So is a second
    result of a call a result answers already ("Duplicate value for 'tool_call_id'",
    "Duplicate function_call_output for call_id", "each tool_use must have a single result",
    Gemini's count): a result answers the latest call of its id before it that none answers
    yet, so an id reused for a new call in a later turn is that call's (:func:`_pair`). The
    reused id itself is refused where the provider refuses it (:func:`_reused_call_ids`): in
    one turn on chat completions, the Responses API and Anthropic, in a later turn on the
    Responses API and Anthropic.
    """
    if not any(p.role == "tool" or (p.role == "assistant" and p.tool_call_id) for p in parts):
        return []
    runs = result_runs(parts)
    alone = _files_alone(parts, runs)
    pairing = _pair(parts, alone)
    found: dict[int, list[Uncarried]] = {}
    _refuse_unanswered(parts, runs, alone, pairing, found)
    for k, refusal in _orphans(parts, pairing):
        found.setdefault(k, []).append(refusal)
    for k, refusal in _reused_call_ids(parts):
        # Before the call's other refusals: a reused id is why its result is taken for another.
        found.setdefault(k, []).insert(0, refusal)
    return [u for j in sorted(found) for u in found[j]]


@dataclass(frozen=True, slots=True)
class _Pairing:
    """Which result answers each call of a conversation (:func:`_pair`).

    ``by_id``: call index -> the index of its result (a ``tool`` part of its id; for a call
    answered by the files its tool returned alone, the first file's, where its codec sends the
    empty result it gets). ``by_name``: call index -> a result without an id that answers it on
    Gemini. ``repeated``: result index -> ``(j, r)``, a result of the id of call ``j``, which
    result ``r`` before it answers already. ``uncalled``: the results with an id that no call
    of their id comes before. ``unnamed``: function name -> the results without an id that no
    call of their name before them is left for.
    """

    by_id: dict[int, int]
    by_name: dict[int, int]
    repeated: dict[int, tuple[int, int]]
    uncalled: list[int]
    unnamed: dict[str, list[int]]


def _take(open_calls: list[int], turn: Mapping[int, int]) -> int:
    """The call of ``open_calls`` a result answers, removed from them.

    A provider reads a result as the answer to a call of the turn right before it, in the
    order the calls stand there: the first call of the latest turn among them.
    """
    j = max(open_calls, key=lambda c: (turn[c], -c))
    open_calls.remove(j)
    return j


def _pair(parts: Sequence[Part], alone: Mapping[int, tuple[int, ...]]) -> _Pairing:
    """Pair each call with the result that answers it, and find the results no call is left for.

    A result with an id answers the latest call of its id before it that no result answers
    yet (an id reused in a later turn is a new call there; one its call's result answered
    already is ``repeated``). Then, for Gemini, each result without an id answers the latest
    call of its function's name before it that nothing answers: the one its turn reads.
    """
    turn: dict[int, int] = {}  # call -> the index of the first assistant part of its turn
    open_ids: dict[str, list[int]] = {}
    last: dict[str, tuple[int, int]] = {}  # id -> (the call, its result) paired last
    # A call its files alone answer has its (empty) result where its first file stands.
    by_files = lacking_results(parts, alone)
    by_id: dict[int, int] = {}
    repeated: dict[int, tuple[int, int]] = {}
    uncalled: list[int] = []
    named: list[int] = []
    start = 0
    for k, p in enumerate(parts):
        if p.role == "assistant":
            if k == 0 or parts[k - 1].role != "assistant":
                start = k
            if p.tool_call_id:
                turn[k] = start
                open_ids.setdefault(p.tool_call_id, []).append(k)
            continue
        lacking = by_files.get(k)
        if lacking is not None:
            lacking_id = parts[lacking].tool_call_id or ""
            if lacking in open_ids.get(lacking_id, ()):
                open_ids[lacking_id].remove(lacking)
            by_id[lacking] = k
            last[lacking_id] = (lacking, k)
        if p.role != "tool":
            continue
        call_id = p.tool_call_id
        if not call_id:
            if p.name:
                named.append(k)
            continue
        waiting = open_ids.get(call_id)
        if waiting:
            j = _take(waiting, turn)
            by_id[j] = k
            last[call_id] = (j, k)
        elif call_id in last:
            repeated[k] = last[call_id]
        else:
            uncalled.append(k)
    by_name: dict[int, int] = {}
    unnamed: dict[str, list[int]] = {}
    if named:
        # Gemini matches a functionResponse to its call by the function's name: a result
        # without the call's id that names it answers it there (docs/adapters.md).
        waiting_named: dict[str, list[int]] = {}
        for j in turn:
            if j not in by_id:
                waiting_named.setdefault(parts[j].name or "", []).append(j)
        for k in named:
            name = parts[k].name or ""
            before = [j for j in waiting_named.get(name, ()) if j < k]
            if before:
                j = _take(before, turn)
                waiting_named[name].remove(j)
                by_name[j] = k
            else:
                unnamed.setdefault(name, []).append(k)
    return _Pairing(by_id, by_name, repeated, uncalled, unnamed)


def _refuse_unanswered(parts: Sequence[Part], runs: Sequence[range],
                       alone: Mapping[int, tuple[int, ...]], pairing: _Pairing,
                       found: dict[int, list[Uncarried]]) -> None:
    """The refusals of the calls without their result where it must be, into ``found``."""
    # The last part that is neither the assistant's nor a system part.
    last_other = max((k for k, p in enumerate(parts) if p.role not in ("assistant", "system")),
                     default=-1)
    # The calls a later part answers, with the protocols it answers them on.
    answered: dict[int, frozenset[WireProtocol]] = {}
    calls = [k for k, p in enumerate(parts) if p.role == "assistant" and p.tool_call_id]
    for j in calls:
        call = parts[j]
        if j in pairing.by_id:
            answered[j] = CODEC_PROTOCOLS
            continue
        protocols = CODEC_PROTOCOLS
        if j in pairing.by_name:
            protocols = CODEC_PROTOCOLS - _RESULT_BY_NAME
            answered[j] = _RESULT_BY_NAME
        fix = ("record the call's result with run.tool_result(call, ...) and put the part it "
               "returns after the call's part (a tool that returned only a file answers with "
               "run.tool_result(call, Part(data=..., media_type=...))), or leave the call's "
               "part out")
        if j > last_other:
            found[j] = [Uncarried(frozenset({_P.OPENAI}), f"envelope.parts[{j}]",
                                  f"{_shown(call)} has no result and ends the request: chat "
                                  "completions refuses an assistant message with tool_calls "
                                  "that no tool message for each follows", fix)]
        else:
            found[j] = [Uncarried(protocols, f"envelope.parts[{j}]",
                                  f"{_shown(call)} has no result, and the conversation goes "
                                  f"on after it: no tool part with tool_call_id="
                                  f"{call.tool_call_id!r} answers it (chat completions, the "
                                  "Responses API, Anthropic and Gemini refuse a tool call "
                                  "without its result)", fix)]
    if answered:
        order = sent_order(parts, alone, runs)
        items = _wire_items(parts, order)
        results = {**pairing.by_id, **pairing.by_name}
        for protocol in _PLACED:
            misplaced = _misplaced(protocol, results, items)
            for j, (k, m) in misplaced.items():
                if protocol in answered.get(j, ()):
                    found.setdefault(j, []).append(_misplaced_refusal(protocol, parts, j, k, m))
            if protocol is not _P.GEMINI:
                continue
            # The route that wrote a thought signature for an empty answer text sends that text
            # back, a model turn of its own; another route leaves it out (its empty text).
            for route, signed in _signed_empty_texts(parts, order).items():
                for j, (k, m) in _misplaced(protocol, results, items, signed).items():
                    if j not in misplaced and protocol in answered.get(j, ()):
                        found.setdefault(j, []).append(_misplaced_refusal(
                            protocol, parts, j, k, m, (route, signed)))


_ORPHAN_FIX = ("drop the result, or keep its call's part (the assistant part with that "
               "tool_call_id) before it in the conversation: when trimming a conversation, "
               "trim a call and its results together")
_REPEATED_FIX = ("drop the repeated result: a call has one result (a call made again with the "
                 "same id is a new assistant part of that id before its own result)")


def _orphans(parts: Sequence[Part], pairing: _Pairing) -> list[tuple[int, Uncarried]]:
    """The tool results that answer no call before them, each with its index.

    A tool part with an id needs an assistant part of its id before it that no other result
    answers (:func:`_pair`), on every protocol of these codecs, each provider matching a
    result to a call it has read already: chat completions a ``tool`` message to the
    ``tool_calls`` of the assistant message before it, Anthropic a ``tool_result`` to a
    ``tool_use`` of the message before, the Responses API a ``function_call_output`` to a
    ``function_call`` by ``call_id``, Gemini a ``functionResponse`` to a function call turn
    right before its own (the count of its responses the count of the calls). A second result
    of a call is refused too ("Duplicate value for 'tool_call_id'", "Duplicate
    function_call_output for call_id", "each tool_use must have a single result", Gemini's
    count; in a later turn, the rules above). The results without an id that no call of their
    name is left for are refused on Gemini (the others refuse a result without an id already,
    :func:`tool_result_refusals`).
    """
    out: list[tuple[int, Uncarried]] = []
    first_call: dict[str, int] = {}
    for j, p in enumerate(parts):
        if p.role == "assistant" and p.tool_call_id:
            first_call.setdefault(p.tool_call_id, j)
    for k in pairing.uncalled:
        call_id = parts[k].tool_call_id
        after = first_call.get(call_id or "")
        where = (f"its call, envelope.parts[{after}], comes after it" if after is not None
                 else f"no assistant part with tool_call_id={call_id!r} is in the request")
        out.append((k, Uncarried(
            CODEC_PROTOCOLS, f"envelope.parts[{k}]",
            f"the tool result for tool_call_id={call_id!r} answers no tool call before it: "
            f"{where} (chat completions, the Responses API, Anthropic and Gemini refuse a "
            f"tool result without its call before it)", _ORPHAN_FIX)))
    for k, (j, r) in pairing.repeated.items():
        out.append((k, Uncarried(
            CODEC_PROTOCOLS, f"envelope.parts[{k}]",
            f"the tool result for tool_call_id={parts[k].tool_call_id!r} repeats a result: "
            f"its call, envelope.parts[{j}], has its result already, envelope.parts[{r}], and "
            f"no later call of that id comes before it (chat completions, the Responses API, "
            f"Anthropic and Gemini refuse a second result of a call)", _REPEATED_FIX)))
    for name, ks in pairing.unnamed.items():
        for k in ks:
            earlier = any(parts[j].role == "assistant" and parts[j].tool_call_id
                          and parts[j].name == name for j in range(k))
            why = ("each call of that name before it has its result already" if earlier
                   else "no tool call of that name comes before it")
            out.append((k, Uncarried(
                _RESULT_BY_NAME, f"envelope.parts[{k}]",
                f"the tool result of {name!r} without tool_call_id answers no tool call "
                f"before it: Gemini pairs it with a call of its name, and {why} (Gemini "
                "refuses a functionResponse that no function call of the turn before it "
                "asks for)", _ORPHAN_FIX)))
    return out


def _shown(call: Part) -> str:
    return f"tool call {call.tool_call_id!r}" + (f" ({call.name})" if call.name else "")


# Which protocols refuse a tool call whose id another call of the request has. Gemini's codec
# sends no id (its functionCall names the function), so none of these reaches it. Anthropic
# answers "messages.N.content.M: `tool_use` ids must be unique" for two tool_use blocks of one
# id in one message or in two (reported by its users, e.g. anthropics/claude-code#20700,
# HKUDS/nanobot#4442, openclaw/openclaw#4700; the Messages API reference says nothing of it).
# The Responses API answers a call_id reused in a later turn with "Duplicate function_call_output
# for call_id ... Each function_call must have exactly one matching function_call_output"
# (NousResearch/hermes-agent#111231). Chat completions reads a turn's tool messages against the
# assistant message before them, and answers two of one id there with "Duplicate value for
# 'tool_call_id' of ... in messages[i] and messages[j]" (agno-agi/agno#5116); an id reused in a
# later turn it takes (hermes-agent#111231 again: its chat transport carried such ids).
_IDS_UNIQUE_IN_TURN = frozenset({_P.OPENAI, _P.OPENAI_RESPONSES, _P.ANTHROPIC})
_IDS_UNIQUE_IN_REQUEST = frozenset({_P.OPENAI_RESPONSES, _P.ANTHROPIC})
_REUSED_ID_FIX = ("give each tool call an id of its own (a framework that numbers its calls in "
                  "every answer, call_0, call_1, ..., must make them unique in the conversation, "
                  "as the ledger's integrations do), or leave the repeated call out with its "
                  "result")


def _reused_call_ids(parts: Sequence[Part]) -> list[tuple[int, Uncarried]]:
    """The tool calls whose id an earlier call of the request has, each with its index.

    Two calls of one id in one turn (the assistant parts between two other parts) are refused
    on chat completions, the Responses API and Anthropic; an id used again in a later turn, on
    the Responses API and Anthropic (:data:`_IDS_UNIQUE_IN_REQUEST`, whose comment gives the
    evidence). The refusal names the call's part and the latest earlier call of its id.
    """
    out: list[tuple[int, Uncarried]] = []
    latest: dict[str, int] = {}
    start = 0  # the first assistant part of the current turn
    for k, p in enumerate(parts):
        if p.role != "assistant":
            continue
        if k == 0 or parts[k - 1].role != "assistant":
            start = k
        call_id = p.tool_call_id
        if not call_id:
            continue
        j = latest.get(call_id)
        latest[call_id] = k
        if j is None:
            continue
        if j >= start:
            protocols, where, why = (
                _IDS_UNIQUE_IN_TURN, "in the same turn",
                "chat completions, the Responses API and Anthropic refuse two tool calls of one "
                "id in a turn; Gemini, whose calls carry no id, takes it")
        else:
            protocols, where, why = (
                _IDS_UNIQUE_IN_REQUEST, "in an earlier turn",
                "the Responses API and Anthropic refuse a tool call id used again anywhere in "
                "the request; chat completions and Gemini take it")
        out.append((k, Uncarried(
            protocols, f"envelope.parts[{k}]",
            f"{_shown(p)} has the id of another tool call {where}, envelope.parts[{j}] ({why})",
            _REUSED_ID_FIX)))
    return out


# The protocols that take a call's result only right after the call (the Responses API pairs
# a function_call_output with its call by call_id wherever it stands), and why.
_PLACED = (_P.OPENAI, _P.ANTHROPIC, _P.GEMINI)
_PLACE_RULES = {
    _P.OPENAI: "chat completions refuses an assistant message with tool_calls that the tool "
               "messages answering each call do not follow at once",
    _P.ANTHROPIC: "Anthropic refuses a tool_use whose tool_result is not among the blocks that "
                  "open the next user message, before any text or file",
    _P.GEMINI: "Gemini refuses a functionCall turn whose functionResponse is not in the turn "
               "right after it",
}

# A part as the codecs send it (:func:`_wire_items`): its index, whether it is a result, and
# the part (``None``: the empty result a call answered by its files alone gets; its index is its
# first file's).
_Item = tuple[int, bool, "Part | None"]


def _wire_items(parts: Sequence[Part], order: Sequence[tuple[int, int | None]]) -> list[_Item]:
    """The parts in the order every codec sends them (``order``, :func:`sent_order`'s)."""
    return [(k, True, None) if call is not None else (k, parts[k].role == "tool", parts[k])
            for k, call in order]


def reasoning_item(part: Part) -> tuple[str, str, dict[str, Any]] | None:
    """``(route id, protocol, item)`` of a reasoning part, or ``None`` for any other part.

    What :func:`ledger.adapters.contract.reasoning_data` wrote: the codecs read it to carry an
    item back to its route, and the rules here to see what a route's codec sends.
    """
    if part.kind is not MediaKind.REASONING or part.payload is None:
        return None
    try:
        doc = json.loads(part.payload)
    except (ValueError, RecursionError):
        return None
    if (not isinstance(doc, dict) or not isinstance(doc.get("route"), str)
            or not isinstance(doc.get("protocol"), str) or not isinstance(doc.get("item"), dict)):
        return None
    return doc["route"], doc["protocol"], doc["item"]


def _gemini_signature(part: Part) -> tuple[str, str] | None:
    """``(route id, the answer's part it names)`` of a Gemini thought-signature part, else None.

    What the Gemini codec puts back on a part of its route's turn: a reasoning item of protocol
    ``gemini`` whose item has a ``thoughtSignature`` and names a ``functionCall``, ``text`` or
    ``media`` part.
    """
    found = reasoning_item(part)
    if found is None:
        return None
    route, protocol, item = found
    if (protocol != _P.GEMINI.value or not isinstance(item.get("thoughtSignature"), str)
            or item.get("part") not in ("functionCall", "text", "media")):
        return None
    return route, item["part"]


def _signed_empty_texts(parts: Sequence[Part],
                        order: Sequence[tuple[int, int | None]]) -> dict[str, frozenset[int]]:
    """The empty assistant texts the Gemini codec sends, per route: route id -> indices.

    Gemini returns an empty text part to carry a thought signature, and takes it back; the
    codec sends an empty text only when its route's signature goes on it, and leaves it out
    otherwise (``ledger.adapters.gemini``'s ``_Turn``, read here in ``order``): a text takes the
    first pending text signature of its model turn, a turn's signatures come before its other
    parts, and a signature after them, or any part of the user's, starts the turn anew.
    """
    signers = {k: s for k, p in enumerate(parts)
               if p.kind is MediaKind.REASONING and (s := _gemini_signature(p)) is not None}
    out: dict[str, frozenset[int]] = {}
    for route in {r for r, what in signers.values() if what == "text"}:
        pending: list[str] = []
        started = False
        signed: list[int] = []
        for k, call in order:
            p = parts[k]
            if p.role == "system":
                continue
            if call is not None or p.role == "tool":
                pending, started = [], False  # a user turn: the model turn has ended
            elif p.role == "assistant" and p.tool_call_id:
                started = True
            elif p.kind is MediaKind.REASONING:
                signer = signers.get(k)
                if signer is None or signer[0] != route:
                    continue  # another route's: left out, it changes nothing
                if started:
                    pending, started = [], False
                pending.append(signer[1])
            elif p.role == "assistant":
                started = True
                if p.media_type is None and "text" in pending:
                    pending.remove("text")
                    if not p.content:
                        signed.append(k)
            elif p.content or p.media_type is not None:
                pending, started = [], False  # the user's text or file (an empty text is not sent)
        if signed:
            out[route] = frozenset(signed)
    return out


def _sent_in(protocol: WireProtocol, part: Part | None) -> str | None:
    """The role of the message (Gemini: the turn) ``protocol``'s codec sends ``part`` in.

    ``None``: in no message of its own (a system part goes in the top-level system text but on
    chat completions, a reasoning item is left out or joins its turn's assistant message, an
    empty text is left out on Anthropic and Gemini). ``tool`` is chat completions' tool
    message; the others carry a result in the user's.
    """
    role = "tool" if part is None else part.role
    if role == "tool":
        return "tool" if protocol is _P.OPENAI else "user"
    assert part is not None
    if part.kind is MediaKind.REASONING:
        return None
    if role == "system":
        return "system" if protocol is _P.OPENAI else None
    if part.media_type is not None:
        # A file the model returned goes back in a user message (a model turn on Gemini).
        return "assistant" if role == "assistant" and protocol is _P.GEMINI else "user"
    if not part.content and not part.tool_call_id and protocol in _DROPS_EMPTY_TEXT:
        return None
    return role


def _misplaced(protocol: WireProtocol, results: Mapping[int, int], items: Sequence[_Item],
               signed: frozenset[int] = frozenset()) -> dict[int, tuple[int, int]]:
    """The calls whose results ``protocol`` does not read where they are sent.

    ``signed``: the empty assistant texts sent all the same (on Gemini, those that carry a
    thought signature back to the route that wrote it, :func:`_signed_empty_texts`).

    The parts go in ``items``' order, grouped as ``protocol`` groups them into messages:
    consecutive parts of one role (on chat completions an assistant's text opens a message of
    its own, and its tool calls join the assistant message before them). A call's result is
    in its place in the group right after the call's: among the ``tool`` messages there (chat
    completions), among the results that open that user message (Anthropic), anywhere in that
    user turn (Gemini, which matches a result without an id by the function's name). Which
    result is a call's is ``results`` (call index -> result index, :func:`_pair`): the one the
    refusals of unanswered calls read, so that both name the same result.

    Returns:
        call index -> ``(k, m)``: ``k`` the first result of the call sent later (a file's
        index for a call answered by its files alone), ``m`` the first part sent before it
        past that place. A call no later part answers is not here.
    """
    sent: list[_Item] = []  # the items sent, in order
    groups: list[tuple[str, int, int]] = []  # (role, start, stop) in ``sent``
    for item in items:
        role = _sent_in(protocol, item[2])
        if role is None and item[0] in signed and item[2] is not None:
            role = item[2].role
        if role is None:
            continue
        part = item[2]
        opens = (protocol is _P.OPENAI and role == "assistant" and part is not None
                 and not part.tool_call_id)
        sent.append(item)
        if groups and groups[-1][0] == role and not opens:
            groups[-1] = (role, groups[-1][1], len(sent))
        else:
            groups.append((role, len(sent) - 1, len(sent)))
    # Where each result is sent (a call's empty result shares its index with its first file).
    at_result = {item[0]: n for n, item in enumerate(sent) if item[1]}
    out: dict[int, tuple[int, int]] = {}
    for g, (role, start, stop) in enumerate(groups):
        if role != "assistant":
            continue
        calls = [(k, p) for k, _, p in sent[start:stop] if p is not None and p.tool_call_id]
        if not calls:
            continue
        nxt_role, _, nxt_stop = groups[g + 1] if g + 1 < len(groups) else ("", stop, stop)
        # sent[stop:place] is where the results of these calls are read.
        if protocol is _P.ANTHROPIC:
            place = stop
            while nxt_role == "user" and place < nxt_stop and sent[place][1]:
                place += 1
        else:
            place = nxt_stop if nxt_role == ("tool" if protocol is _P.OPENAI else "user") \
                else stop
        for j, _ in calls:
            k = results.get(j)
            if k is not None and at_result.get(k, -1) >= place:
                out[j] = (k, sent[place][0])
    return out


def _misplaced_refusal(protocol: WireProtocol, parts: Sequence[Part], j: int, k: int, m: int,
                       signer: tuple[str, frozenset[int]] | None = None) -> Uncarried:
    """The refusal of call ``j``, whose result ``k`` ``protocol`` reads nowhere after ``m``.

    ``signer``: the route whose signed empty texts (their indices) put a model turn between,
    which alone refuses it.
    """
    fix = (f"put the call's result right after the call's part (a turn's tool results before "
           f"anything else of the conversation): move envelope.parts[{m}] after the results, or "
           f"the result before it; a route of the Responses API, which pairs a result with its "
           f"call wherever it stands, takes it as it is")
    if signer is None:
        return Uncarried(frozenset({protocol}), f"envelope.parts[{j}]",
                         f"{_shown(parts[j])} has its result, envelope.parts[{k}], sent after "
                         f"envelope.parts[{m}]: {_PLACE_RULES[protocol]}", fix)
    route, signed = signer
    texts = ", ".join(f"envelope.parts[{e}]" for e in sorted(signed) if j < e < k)
    return Uncarried(
        frozenset({protocol}), f"envelope.parts[{j}]",
        f"{_shown(parts[j])} has its result, envelope.parts[{k}], sent after "
        f"envelope.parts[{m}] on route {route!r}, which sends the empty answer text {texts} "
        f"back with the thought signature it wrote, a model turn of its own: "
        f"{_PLACE_RULES[protocol]}",
        f"{fix}; or leave out the empty text and the reasoning part before it (another route "
        f"leaves them out)", route=route)


def require_answered(protocol: WireProtocol, parts: Sequence[Part],
                     route: str | None = None) -> None:
    """Refuse a call without its result or a result without its call, on ``protocol``.

    The refusals are :func:`unanswered_refusals`' (``route``: the id of the route the request
    is built for, whose own reasoning may change what is sent).

    Raises:
        InvalidArgument: naming ``envelope.parts[index]`` of the call (or of the result).
    """
    for refusal in unanswered_refusals(parts):
        if refusal.refuses(protocol, route):
            raise refusal.error()


def _sends_something(protocol: WireProtocol, part: Part) -> bool:
    """Whether ``protocol``'s codec makes something of ``part`` that a request may hold alone."""
    role = part.role
    if role == "system":
        return False
    if role == "tool" or (role == "assistant" and bool(part.tool_call_id)):
        return True
    if part.media_type is not None:
        # A reasoning item is sent only beside what it reasoned about.
        return part.kind is not MediaKind.REASONING
    return bool(part.content) or protocol not in _DROPS_EMPTY_TEXT


def message_refusal(protocol: WireProtocol, parts: Sequence[Part]) -> Uncarried | None:
    """The refusal of an envelope ``protocol`` has nothing to send of, or ``None``.

    Nothing is a request of system parts only (chat completions takes one), reasoning items
    only beside them, or (Anthropic, Gemini) empty text parts, which those protocols leave out.
    """
    if protocol not in _NEEDS_MESSAGE or any(_sends_something(protocol, p) for p in parts):
        return None
    left_out = ("reasoning items are not sent alone, and empty text parts are left out"
                if protocol in _DROPS_EMPTY_TEXT else "reasoning items are not sent alone")
    return Uncarried(frozenset({protocol}), "envelope.parts",
                     f"a {protocol.value} request needs at least one user or assistant part "
                     f"besides system ({left_out})",
                     "add the user's question (Part(content=...))")


_BUILTIN_FIX = ("pass the provider's built-in tools as a list of objects, e.g. "
                "params={'tools': [{'type': 'image_generation'}]}; function tools go in "
                "Envelope.tools")


def builtin_tools_refusal(value: Any) -> Uncarried | None:
    """Why ``params["tools"]`` is not the Responses API's built-in tools, or ``None``.

    The host's own function tools are ``Envelope.tools`` (their descriptions are data the
    grant discloses), never a parameter; every entry is an object of a non-empty ``type``.
    """
    if not isinstance(value, list):
        return Uncarried(_ONLY_RESPONSES, "envelope.params.tools",
                         "Envelope.params['tools'] is not a list", _BUILTIN_FIX)
    for k, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if not isinstance(kind, str) or not kind or kind == "function":
            return Uncarried(_ONLY_RESPONSES, f"envelope.params.tools[{k}]",
                             f"Envelope.params['tools'][{k}] is not a built-in tool "
                             f"(type {kind!r})", _BUILTIN_FIX)
    return None


def builtin_tools(value: Any) -> list[dict[str, Any]]:
    """``Envelope.params["tools"]`` of a Responses request: the provider's built-in tools.

    Raises:
        InvalidArgument: it is not a list of built-in tools (:func:`builtin_tools_refusal`).
    """
    if value is None:
        return []
    refusal = builtin_tools_refusal(value)
    if refusal is not None:
        raise refusal.error()
    return [dict(t) for t in value]


def uncarried(envelope: Envelope) -> tuple[Uncarried, ...]:
    """Everything of ``envelope`` some protocol's codec cannot build a request of.

    Judged once per request: a route is ineligible for the refusals whose ``protocols`` hold
    its protocol, in the order its codec finds them (the first is the one it raises). Empty for
    the usual request, which costs three attribute reads and a flag per part (its text's
    verdict, :func:`text_refusal`), a look at the parts up to the first one that is sent, and
    one encoding of the parameters and of each tool's (:func:`tool_refusals`); one that holds
    tool calls or results, a few more looks at each part for the calls' results, where each
    protocol reads them, and the results' calls (:func:`unanswered_refusals`).
    """
    out: list[Uncarried] = []
    paired = False  # a tool call or a tool result: each needs the other
    for i, p in enumerate(envelope.parts):
        if p.tool_call_id and p.role == "assistant":
            paired = True
            refusal = tool_call_refusal(p, i)
        else:
            # ASCII text (the usual part) holds no surrogate: one flag read, no call.
            refusal = None if p.content.isascii() else text_refusal(p, i)
            if p.role == "tool":
                paired = True
                out.extend(tool_result_refusals(p, i))
        if refusal is not None:
            out.append(refusal)
    if paired:
        out.extend(unanswered_refusals(envelope.parts))
    for protocol in _NEEDS_MESSAGE:
        refusal = message_refusal(protocol, envelope.parts)
        if refusal is not None:
            out.append(refusal)
    out.extend(tool_refusals(envelope.tools))
    # Last, as the Responses codec reads it: the first refusal is the one the codec raises.
    params = envelope.params
    tools = params.get("tools") if params else None
    if tools is not None:
        refusal = builtin_tools_refusal(tools)
        if refusal is not None:
            out.append(refusal)
    refusal = params_refusal(params)
    if refusal is not None:
        out.append(refusal)
    return tuple(out)


def refusals_for(protocol: WireProtocol, found: Sequence[Uncarried],
                 route: str | None = None) -> list[Uncarried]:
    """Those of ``found`` (from :func:`uncarried`) a route of ``protocol`` cannot carry.

    ``route``: that route's id, for the refusals of one route only (:attr:`Uncarried.route`).
    """
    return [u for u in found if u.refuses(protocol, route)]


__all__ = [
    "CODEC_PROTOCOLS",
    "EVERY_PROTOCOL",
    "Uncarried",
    "builtin_tools",
    "builtin_tools_refusal",
    "files_alone",
    "json_object",
    "lacking_results",
    "message_refusal",
    "params_refusal",
    "reasoning_item",
    "refusals_for",
    "require_answered",
    "require_encodable",
    "require_tool_result",
    "result_runs",
    "sent_order",
    "text_refusal",
    "tool_arguments",
    "tool_call_refusal",
    "tool_refusals",
    "tool_result_refusals",
    "unanswered_refusals",
    "uncarried",
    "unencodable",
]
