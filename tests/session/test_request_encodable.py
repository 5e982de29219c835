"""A request no JSON body can carry is refused before any Attempt is begun.

Every request body is sent as UTF-8 JSON. A lone surrogate (U+D800 to U+DFFF) in a part's
text has no UTF-8 encoding; a tool call's arguments holding ``NaN`` or an infinity (Python's
JSON reader takes ``NaN``, ``Infinity``, ``1e400``) or a lone surrogate (escaped, ``\\ud800``)
are not JSON; and params or a tool's definition built without validation
(``model_copy(update=...)``, ``model_construct``) or changed in place may hold either.
Before, these passed preflight: every route of the plan then began an Attempt that the
adapter ended ``not_sent`` (``cannot_build``), each further route taking a retry permission,
or (chat completions, Responses) the arguments went out as text no JSON reader takes. Now they
are the caller's bad input, refused with ``InvalidArgument`` naming the field and the fix
before anything is recorded: no change to the Run's row, no Attempt, no hold, no decision, and
the Run goes on. Real HTTP over loopback, every protocol, both backends, both drivers; every
part is covered for disclosure, so only the encoding decides.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, InvalidArgument, Ledger, Part, ToolSpec
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

PROTOCOLS = ["openai", "openai_responses", "anthropic", "gemini"]
BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "system", "model_derived", "tool_result",
                                    "tool_description"]})
QUESTION = Part(content="what is the weather in Oslo?")


def _call(arguments: str) -> Part:
    return Part(role="assistant", content=arguments, tool_call_id="call_1", name="weather",
                data_class="model_derived")


CALL = _call('{"city": "Oslo"}')
RESULT = Part(role="tool", content="12 C", tool_call_id="call_1", name="weather",
              data_class="tool_result")


def _params(**params: object) -> Callable[[list[Part]], Envelope]:
    # Envelope(params=...) refuses them when built; a copy skips that validation.
    return lambda parts: Envelope(parts=parts).model_copy(update={"params": params})


def _plain(parts: list[Part]) -> Envelope:
    return Envelope(parts=parts)


WEATHER = ToolSpec(name="weather", description="the forecast",
                   parameters={"type": "object", "properties": {"days": {"type": "integer"}}})


def _tools(tool: ToolSpec) -> Callable[[list[Part]], Envelope]:
    # ToolSpec(...) refuses such a definition when built; model_construct and a copy skip that.
    return lambda parts: Envelope(parts=parts, tools=[WEATHER, tool])


def _changed_in_place(parts: list[Part]) -> Envelope:
    tool = WEATHER.model_copy(deep=True)
    tool.parameters["properties"]["days"]["maximum"] = math.inf
    return Envelope(parts=parts, tools=[tool])


# (parts, how the envelope is made of them, the field named, what the message says)
CASES = {
    "surrogate in a user part": (
        [QUESTION, Part(content="and in Z\ud800rich?")], _plain,
        "envelope.parts[1].content", "lone surrogate"),
    "surrogate in a system part": (
        [Part(role="system", content="You answer in \udcc3nglish."), QUESTION], _plain,
        "envelope.parts[0].content", "lone surrogate"),
    "surrogate in a tool result": (
        [QUESTION, CALL, RESULT.model_copy(update={"content": "12 \udcb0C"})], _plain,
        "envelope.parts[2].content", "lone surrogate"),
    "NaN in a call's arguments": (
        [QUESTION, _call('{"city": "Oslo", "days": NaN}'), RESULT], _plain,
        "envelope.parts[1].content", "NaN or an infinity"),
    "Infinity in a call's arguments": (
        [QUESTION, _call('{"days": -Infinity}'), RESULT], _plain,
        "envelope.parts[1].content", "NaN or an infinity"),
    "1e400 in a call's arguments": (
        [QUESTION, _call('{"days": 1e400}'), RESULT], _plain,
        "envelope.parts[1].content", "NaN or an infinity"),
    "escaped surrogate in a call's arguments": (
        [QUESTION, _call('{"city": "Z\\ud800rich"}'), RESULT], _plain,
        "envelope.parts[1].content", "lone surrogate"),
    "NaN in params": (
        [QUESTION], _params(temperature=math.nan), "envelope.params.temperature",
        "not JSON data"),
    "surrogate in params": (
        [QUESTION], _params(stop=["\n", "\ud800"]), "envelope.params.stop", "lone surrogate"),
    # Before, every route's codec built the tool into a body the adapter could not encode: each
    # route began an Attempt ended cannot_build, the caller's bad input paid for per route.
    "NaN in a tool's parameters": (
        [QUESTION], _tools(ToolSpec.model_construct(
            name="forecast", description="", parameters={"type": "object", "x-max": math.nan},
            data_class="tool_description")),
        "envelope.tools[1].parameters.x-max", "not JSON data"),
    "infinity in a tool's parameters changed in place": (
        [QUESTION], _changed_in_place, "envelope.tools[0].parameters.properties",
        "not JSON data"),
    "surrogate in a tool's description": (
        [QUESTION], _tools(WEATHER.model_copy(update={"description": "the \ud800 forecast"})),
        "envelope.tools[1].description", "lone surrogate"),
}


def _covered(part: Part) -> Part:
    """``part`` as the host vouches for it (its ``provenance`` the host records: the hash
    leaves provenance out), so that disclosure preflight passes it on every route."""
    if part.role in ("user", "system") and part.data_class in ("user_input", "system"):
        return part
    return part.model_copy(update={"provenance": f"host-{part.content_hash[7:19]}"})


def _check_refused(ei: pytest.ExceptionInfo[InvalidArgument], field: str, says: str) -> None:
    assert ei.value.field == field, str(ei.value)
    assert says in str(ei.value) and "; fix:" in str(ei.value)
    assert set(ei.value.fields["routes"]) == {"primary", "backup"}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(CASES))
def test_unencodable_body_is_refused_before_any_attempt(
        db_url: str, fake: FakeProvider, protocol: str, case: str) -> None:
    parts, make, field, says = CASES[case]
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            covered = [_covered(p) for p in parts]
            for p in covered:
                if p.provenance:
                    led.record_provenance(run.lease, p.provenance, p.content_hash, "host")
            env = make(covered)
            before, events = led.get_run("t"), led.events("t")
            with pytest.raises(InvalidArgument) as ei:
                run.turn(env)
            _check_refused(ei, field, says)
            assert led.get_run("t") == before and led.events("t") == events
            assert led.timeline("t") == [] and fake.requests == []  # no Attempt, none sent
            run.turn(Envelope(parts=[QUESTION]))  # the Run goes on
        assert len(led.timeline("t")) == 1 and led.get_run("t").retries_used == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(CASES))
def test_unencodable_body_is_refused_before_any_attempt_async(
        tmp_path: Path, fake: FakeProvider, protocol: str, case: str) -> None:
    # A SQLite file: the refusal comes before the database (the blocking twin above runs the
    # same cases on both databases).
    db_url = str(tmp_path / "ledger.db")
    parts, make, field, says = CASES[case]

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "t", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            covered = [_covered(p) for p in parts]
            for p in covered:
                if p.provenance:
                    await led.record_provenance(run.lease, p.provenance, p.content_hash, "host")
            env = make(covered)
            before, events = await led.get_run("t"), await led.events("t")
            with pytest.raises(InvalidArgument) as ei:
                await run.turn(env)
            _check_refused(ei, field, says)
            assert await led.get_run("t") == before and await led.events("t") == events
            assert await led.timeline("t") == [] and fake.requests == []
            await run.turn(Envelope(parts=[QUESTION]))
            assert len(await led.timeline("t")) == 1

    asyncio.run(main())


def test_params_and_tool_descriptions_no_body_can_carry_are_refused_when_built() -> None:
    """``Envelope(params=...)`` and ``ToolSpec`` refuse a lone surrogate as they refuse NaN:
    the typed error names the field when the value is made, before any turn."""
    from ledger import ToolSpec

    with pytest.raises(InvalidArgument) as ei:
        Envelope(parts=[QUESTION], params={"stop": "\ud800"})
    assert ei.value.field == "params" and "lone surrogate" in str(ei.value)
    for bad in ({"description": "reads the \udc80 weather"},
                {"parameters": {"type": "object", "description": "\ud800"}}):
        with pytest.raises(InvalidArgument) as ei:
            ToolSpec(name="weather", **bad)  # type: ignore[arg-type]
        assert ei.value.field == next(iter(bad)) and "lone surrogate" in str(ei.value)
    # Text beyond the BMP (a pair, one character in a str) is text like any other.
    Envelope(parts=[Part(content="sunny \U0001f600")], params={"stop": "\U0001f600"},
             tools=[ToolSpec(name="weather", description="\U0001f326 forecast")])
