"""Which envelope parts (and parameter values) a route's wire protocol can build a request of.

A codec maps each part to its protocol's structure. A few parts cannot be mapped, whatever
the route: an assistant tool-call part (``tool_call_id`` set) without the tool's ``name`` or
whose ``content`` is not the call's arguments as a JSON object, a ``tool`` part without the
``tool_call_id`` of the call it answers (chat completions, Responses, Anthropic) or without
the ``name`` of the function (Gemini), an envelope with nothing to send but system parts
(Responses, Anthropic and Gemini, which leave reasoning items out and, Anthropic and Gemini,
empty text parts), and on the Responses API a ``params["tools"]`` that is not a list of the
provider's built-in tools.

The rules live in the pure core so that preflight judges every candidate before an Attempt is
begun: a route whose protocol cannot build the request is ineligible (``capability``), and a
request no route of its plan can carry is refused with :class:`~ledger.errors.InvalidArgument`
naming the field before anything is recorded. Each codec raises the same error through the
same functions when it is called directly. A protocol without a codec here (``generic``, a
codec of your own) refuses none of these.

The per-request judgement (:func:`uncarried`) reads only the tool parts, the tool-call parts
and ``params["tools"]``, and the parts up to the first one that would be sent: a request
without tool calls costs two attribute reads per part.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.media import MediaKind
from ledger.errors import InvalidArgument

_P = WireProtocol
#: The protocols whose codecs these rules are: a route of another protocol is judged by its
#: own codec.
CODEC_PROTOCOLS = frozenset({_P.OPENAI, _P.OPENAI_RESPONSES, _P.ANTHROPIC, _P.GEMINI})
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
    what to do instead.
    """

    protocols: frozenset[WireProtocol]
    field: str
    message: str
    fix: str

    def error(self) -> InvalidArgument:
        """The typed error a codec raises for it (and a turn, when no route can carry it)."""
        return InvalidArgument(f"{self.message}; {self.fix}", field=self.field)


def json_object(content: str) -> dict[str, Any] | None:
    """``content`` as a JSON object (empty text: ``{}``), else ``None``.

    A tool call's arguments, both ways: an answer's proposal whose arguments are not one is
    the provider's malformed answer (``ToolCall.arguments``), a tool-call part whose content
    is not one cannot be sent (:func:`tool_call_refusal`).
    """
    try:
        value = json.loads(content or "{}")
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# Every turn judges the whole history's tool calls (:func:`uncarried`); a conversation's parts
# are the same objects turn after turn, and a str keeps its hash, so their verdicts are
# remembered by their text: the short ones, so that the memo stays small.
_MEMO_CHARS = 16 * 1024


@functools.lru_cache(maxsize=1024)
def _remembered_object(content: str) -> bool:
    return json_object(content) is not None


def _is_object(content: str) -> bool:
    if len(content) <= _MEMO_CHARS:
        return _remembered_object(content)
    return json_object(content) is not None


def _unnamed_call(where: str) -> Uncarried:
    return Uncarried(CODEC_PROTOCOLS, where, "an assistant tool-call part needs name= (the "
                     "tool's name)", "carry the part as a turn's result.parts returned it, or "
                     "set name= to the tool the model called")


def _not_an_object(where: str) -> Uncarried:
    return Uncarried(CODEC_PROTOCOLS, where, "an assistant part with tool_call_id carries the "
                     "call's arguments as a JSON object in its content",
                     "put the arguments as a JSON object (e.g. '{\"city\": \"Oslo\"}', "
                     "'{}' for none) in content")


def tool_call_refusal(part: Part, index: int) -> Uncarried | None:
    """Why an assistant tool-call part (``tool_call_id`` set) cannot be sent, or ``None``."""
    where = f"envelope.parts[{index}]"
    if not part.name:
        return _unnamed_call(where)
    if not _is_object(part.content):
        return _not_an_object(where)
    return None


def tool_arguments(part: Part, index: int) -> dict[str, Any]:
    """The arguments of an assistant tool-call part, which carries them as a JSON object.

    Raises:
        InvalidArgument: the part has no ``name`` or its content is not a JSON object
            (:func:`tool_call_refusal`), naming ``envelope.parts[index]``.
    """
    where = f"envelope.parts[{index}]"
    if not part.name:
        raise _unnamed_call(where).error()
    args = json_object(part.content)  # parsed once: the codec sends what it reads here
    if args is None:
        raise _not_an_object(where).error()
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
    the usual request, which costs two attribute reads per part and a look at the parts up to
    the first one that is sent.
    """
    out: list[Uncarried] = []
    for i, p in enumerate(envelope.parts):
        if not p.tool_call_id and p.role != "tool":
            continue
        if p.role == "tool":
            out.extend(tool_result_refusals(p, i))
        elif p.role == "assistant":
            refusal = tool_call_refusal(p, i)
            if refusal is not None:
                out.append(refusal)
    for protocol in _NEEDS_MESSAGE:
        refusal = message_refusal(protocol, envelope.parts)
        if refusal is not None:
            out.append(refusal)
    # Last, as the Responses codec reads it: the first refusal is the one the codec raises.
    tools = envelope.params.get("tools") if envelope.params else None
    if tools is not None:
        refusal = builtin_tools_refusal(tools)
        if refusal is not None:
            out.append(refusal)
    return tuple(out)


def refusals_for(protocol: WireProtocol, found: Sequence[Uncarried]) -> list[Uncarried]:
    """Those of ``found`` (from :func:`uncarried`) a route of ``protocol`` cannot carry."""
    return [u for u in found if protocol in u.protocols]


__all__ = [
    "CODEC_PROTOCOLS",
    "Uncarried",
    "builtin_tools",
    "builtin_tools_refusal",
    "json_object",
    "message_refusal",
    "refusals_for",
    "require_tool_result",
    "tool_arguments",
    "tool_call_refusal",
    "tool_result_refusals",
    "uncarried",
]
