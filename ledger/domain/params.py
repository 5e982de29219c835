"""Which ``Envelope.params`` a route can carry, by its wire protocol and its capabilities.

A codec builds the request's structure from the envelope (its parts, tools, stream and output
bound) and sends ``Envelope.params`` beside it. A parameter naming a field of that structure
would overwrite it (``messages`` on chat completions, ``contents`` on Gemini), and on the
Responses API three more keep the conversation at the provider, which no failover can follow.
And a route may declare the parameters it takes (``Capabilities.parameters``).

The table lives in the pure core so that preflight can judge every candidate before an
Attempt is begun (a route that cannot carry the request's parameters is ineligible, and a
request no route of its plan can carry is refused with :class:`~ledger.errors.InvalidArgument`
before anything is recorded); each codec refuses the same names when it is called directly.
A name refused on one protocol may be another's own (``tools`` holds the Responses API's
built-in tools, ``max_output_tokens`` is Gemini's output bound), which is why the verdict is
per route, not per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ledger.domain.facts import WireProtocol
from ledger.domain.values import Route
from ledger.errors import InvalidArgument

# Where the request field a reserved parameter would overwrite comes from: the fix to name.
_FROM = {
    "model": "Route.model",
    "messages": "Envelope.parts",
    "input": "Envelope.parts",
    "contents": "Envelope.parts",
    "system": "the envelope's system parts",
    "instructions": "the envelope's system parts",
    "systemInstruction": "the envelope's system parts",
    "tools": "Envelope.tools",
    "stream": "Envelope.stream",
    "stream_options": "Envelope.stream",
    "max_tokens": "Envelope.max_output_tokens",
    "max_completion_tokens": "Envelope.max_output_tokens",
    "max_output_tokens": "Envelope.max_output_tokens",
    "generationConfig": "the other params (temperature, top_p, stop, ... each its own key)",
    "n": "nothing: a call asks for one answer, the one its Attempt records",
}

_STATEFUL = {
    "previous_response_id": "it continues a conversation the provider stored, which no other "
    "route holds; the ledger sends the whole conversation with every request instead (store="
    "false), so a failover can resend it elsewhere",
    "conversation": "it continues a conversation the provider stored, which no other route "
    "holds; the ledger sends the whole conversation with every request instead",
    "background": "a background response is fetched later by polling, which the adapter does "
    "not do; send the request in the foreground (stream=True for a long answer)",
}


def _built(*names: str) -> dict[str, str]:
    return {n: f"the adapter builds it from {_FROM[n]}" for n in names}


#: The parameters each protocol's codec refuses, each with why. Unlisted protocols
#: (``generic``, a codec of your own) reserve none here.
RESERVED_PARAMS: Mapping[WireProtocol, Mapping[str, str]] = {
    WireProtocol.OPENAI: _built("model", "messages", "tools", "stream", "stream_options",
                                "max_tokens", "max_completion_tokens", "n"),
    # ``tools`` is the Responses API's parameter for the provider's built-in tools.
    WireProtocol.OPENAI_RESPONSES: {
        **_built("model", "input", "instructions", "stream", "max_output_tokens"),
        **_STATEFUL},
    WireProtocol.ANTHROPIC: _built("model", "messages", "system", "tools", "stream",
                                   "max_tokens"),
    WireProtocol.GEMINI: _built("contents", "systemInstruction", "tools", "generationConfig",
                                "model"),
}


@dataclass(frozen=True, slots=True)
class ParamRefusal:
    """A parameter a route cannot carry.

    Its ``name``, what is wrong (``message``, the sentence of the typed error) and the
    ``fix``; ``why``: why its protocol builds or refuses it, ``None`` when the route's
    ``Capabilities.parameters`` leaves it out.
    """

    name: str
    message: str
    fix: str
    why: str | None = None

    @property
    def field(self) -> str:
        """The field an :class:`~ledger.errors.InvalidArgument` names."""
        return f"envelope.params.{self.name}"

    def error(self) -> InvalidArgument:
        """The typed error a codec raises for it."""
        return InvalidArgument(f"{self.message}; {self.fix}", field=self.field)


def refused_params(route: Route, names: Iterable[str]) -> list[ParamRefusal]:
    """The parameters among ``names`` (in their order) that ``route`` cannot carry.

    Refused are the names its protocol reserves (:data:`RESERVED_PARAMS`) and, when the route
    declares the parameters it takes (``Capabilities.parameters``), every other name.
    """
    reserved = RESERVED_PARAMS.get(route.protocol, {})
    allowed = route.capabilities.parameters
    out: list[ParamRefusal] = []
    for name in names:
        why = reserved.get(name)
        if why is not None:
            out.append(ParamRefusal(
                name, f"Envelope.params may not set {name!r} for route {route.id!r} "
                f"({route.protocol.value}): {why}", f"leave {name!r} out of Envelope.params", why))
        elif allowed is not None and name not in allowed:
            out.append(ParamRefusal(
                name, f"route {route.id!r} does not support parameter {name!r} (supported: "
                f"{allowed})", f"drop {name!r} or add it to Capabilities.parameters"))
    return out


__all__ = ["RESERVED_PARAMS", "ParamRefusal", "refused_params"]
