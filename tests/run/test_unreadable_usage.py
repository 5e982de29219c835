"""A complete answer whose usage cannot be recorded is still the answer (docs/adapters.md).

A usage that is present but not an object (``"usage": []``, ``"usage": "x"``: Anthropic's
``usage`` in ``message_start`` or ``message_delta``, Gemini's ``usageMetadata``) and a count
too long for Python's ``int()`` (100,000 digits) are reports the ledger cannot record, as a
count of ``-5`` or ``2.0`` is: the Attempt is ``succeeded`` without usage, its debit posts
the whole hold (no figure to post instead, never a made-up one: docs/operations.md), the Run
writes a ``usage_invalid`` event holding what the provider sent, and the turn returns the
answer. An integer too long to parse anywhere else in the answer does not make it
unparseable either. Every protocol, whole and streamed, real HTTP over loopback through the
fake provider, a Run session as a host drives it, both backends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger.adapters import StaticSecretProvider
from ledger.api.facade import Ledger
from ledger.decide.turn import MAX_REPORTED_CHARS
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, DebitState
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.ops.reconcile import reconcile
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

from .rawanswers import http

PROTOCOLS = ["openai", "openai_responses", "anthropic", "gemini"]
SECRETS = StaticSecretProvider({"p:a": "key-a"})
HOLD = Decimal("0.05")
RUN = "r"
PIECES = ("Hello, ", "world.")
TEXT = "".join(PIECES)
# An integer past Python's default limit for int() (4,300 digits).
HUGE = "9" * 100_000
_SLOT = "@usage@"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


def _plan(fake: FakeProvider, protocol: str) -> list[Route]:
    """A primary and a backup route: the backup is never asked when the primary's answer
    stands."""
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
    return [Route(id=rid, provider="p", model=model, group=f"g-{rid}", recipient="ra",
                  protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol),
                  profiles=[Profile(id="p:a")], price=price)
            for rid, model in (("primary", "m-a"), ("backup", "m-b"))]


def _js(obj: Any, **slots: str) -> str:
    """``obj`` as JSON, each ``"@name@"`` string replaced by the raw JSON text ``slots[name]``.

    Raw text, so that a value no encoder writes (an integer of 100,000 digits) goes on the
    wire exactly as a provider would send it.
    """
    text = json.dumps(obj)
    for name, raw in slots.items():
        text = text.replace(json.dumps(f"@{name}@"), raw)
    return text


# What each protocol reports as a usable usage object (3 prompt, 5 completion tokens).
GOOD = {
    "openai": '{"prompt_tokens": 3, "completion_tokens": 5}',
    "openai_responses": '{"input_tokens": 3, "output_tokens": 5}',
    "anthropic": '{"input_tokens": 3, "output_tokens": 5}',
    "gemini": '{"promptTokenCount": 3, "candidatesTokenCount": 5}',
}
# Anthropic's message_delta usage as the API sends it: the cumulative output count alone.
DELTA = '{"output_tokens": 5}'
# The same usage objects with a prompt count of HUGE digits (completion 5).
HUGE_PROMPT = {p: u.replace(": 3,", f": {HUGE},") for p, u in GOOD.items()}


def _whole(protocol: str, usage: str, extra: str = "0", model: str = '"m-a"') -> bytes:
    """A complete answer of ``protocol`` with ``usage`` (raw JSON text) where its usage goes,
    ``extra`` (raw JSON text) in a field no codec reads, ``model`` as the served model."""
    slot = {"usage": _SLOT, "x_extra": "@extra@"}
    if protocol == "openai":
        obj: dict[str, Any] = {"id": "c1", "object": "chat.completion", "model": "@model@",
                               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                   "role": "assistant", "content": TEXT}}], **slot}
    elif protocol == "openai_responses":
        obj = {"id": "resp_1", "object": "response", "status": "completed", "model": "@model@",
               "output": [{"type": "message", "role": "assistant", "content": [
                   {"type": "output_text", "text": TEXT, "annotations": []}]}], **slot}
    elif protocol == "anthropic":
        obj = {"id": "msg_1", "type": "message", "role": "assistant", "model": "@model@",
               "stop_reason": "end_turn", "content": [{"type": "text", "text": TEXT}], **slot}
    else:
        obj = {"candidates": [{"content": {"role": "model", "parts": [{"text": TEXT}]},
                               "finishReason": "STOP", "index": 0}],
               "modelVersion": "@model@", "x_extra": "@extra@", "usageMetadata": _SLOT}
    return http(_js(obj, usage=usage, extra=extra, model=model).encode(), "application/json")


def _stream(protocol: str, usage: str, extra: str = "0", model: str = '"m-a"', *,
            start_usage: str | None = None) -> bytes:
    """A complete stream of ``protocol`` whose final usage is ``usage`` (raw JSON text), with
    ``extra`` in a field no codec reads in every event and ``model`` as the served model.
    Anthropic's ``message_start`` carries ``start_usage`` (default: a usable one) and its
    ``message_delta`` ``usage``."""
    events: list[tuple[str | None, dict[str, Any]]] = []
    if protocol == "openai":
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": "c1", "object": "chat.completion.chunk", "model": "@model@",
                    "x_extra": "@extra@",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        events += [(None, chunk({"role": "assistant", "content": ""}))]
        events += [(None, chunk({"content": p})) for p in PIECES]
        events += [(None, chunk({}, "stop")),
                   (None, {"id": "c1", "choices": [], "model": "@model@", "usage": _SLOT})]
    elif protocol == "openai_responses":
        def resp(status: str, usage: Any) -> dict[str, Any]:
            return {"id": "resp_1", "object": "response", "status": status, "model": "@model@",
                    "x_extra": "@extra@", "output": [], "usage": usage}
        events += [("response.created", {"type": "response.created",
                                          "response": resp("in_progress", None)})]
        events += [("response.output_text.delta", {
            "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
            "content_index": 0, "delta": p, "x_extra": "@extra@"}) for p in PIECES]
        events += [("response.completed", {"type": "response.completed",
                                            "response": resp("completed", _SLOT)})]
    elif protocol == "anthropic":
        events += [("message_start", {"type": "message_start", "x_extra": "@extra@", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "@model@",
            "content": [], "stop_reason": None, "usage": "@start@"}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}})]
        events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "x_extra": "@extra@",
                                            "delta": {"type": "text_delta", "text": p}})
                   for p in PIECES]
        events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   ("message_delta", {"type": "message_delta", "usage": _SLOT,
                                      "delta": {"stop_reason": "end_turn"}}),
                   ("message_stop", {"type": "message_stop"})]
    else:
        for i, p in enumerate(PIECES):
            cand: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": p}]},
                                    "index": 0}
            chunk_: dict[str, Any] = {"candidates": [cand], "modelVersion": "@model@",
                                      "x_extra": "@extra@"}
            if i == len(PIECES) - 1:
                cand["finishReason"] = "STOP"
                chunk_["usageMetadata"] = _SLOT
            events.append((None, chunk_))
    slots = {"usage": usage, "extra": extra, "model": model,
             "start": start_usage if start_usage is not None else '{"input_tokens": 3, '
                                                                  '"output_tokens": 1}'}
    body = "".join((f"event: {name}\n" if name else "") + f"data: {_js(data, **slots)}\n\n"
                   for name, data in events)
    if protocol == "openai":
        body += "data: [DONE]\n\n"
    return http(body.encode(), "text/event-stream")


def _answer(protocol: str, stream: bool, usage: str, extra: str = "0",
            model: str = '"m-a"') -> bytes:
    return (_stream if stream else _whole)(protocol, usage, extra, model)


def _turn(db_url: str, fake: FakeProvider, protocol: str, stream: bool, raw: bytes
          ) -> tuple[Ledger, str, list[str]]:
    """One session turn answered with ``raw``: (ledger, the turn's text, the text shown)."""
    led = Ledger.open(db_url)
    text, shown = _serve(led, RUN, fake, protocol, stream, raw)
    return led, text, shown


def _serve(led: Ledger, run_id: str, fake: FakeProvider, protocol: str, stream: bool,
           raw: bytes) -> tuple[str, list[str]]:
    """A turn of a new Run ``run_id`` answered with ``raw``: (its text, the text shown)."""
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)), model="m-a")
    shown: list[str] = []
    with led.run(run_id, plan=_plan(fake, protocol), secrets=SECRETS,
                 budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
                 grant=Grant(recipients={"ra": ["user_input"]})) as run:
        result = run.turn(Envelope(parts=[Part(content="Say hello.")], stream=stream,
                                   max_output_tokens=16),
                          on_text=shown.append, reserve=HOLD)
    assert [r.model for r in fake.requests] == ["m-a"]  # served: the backup is never asked
    return result.text, shown


def _served_without_usage(led: Ledger) -> AttemptRecord:
    """The Run's one Attempt: succeeded, no usage, its debit posted at the whole hold."""
    [att] = led.timeline(RUN)
    assert (att.state, att.debit_state) == (AttemptState.SUCCEEDED, DebitState.POSTED)
    assert (att.prompt_tokens, att.completion_tokens, att.cost) == (None, None, None)
    assert att.debit_id is not None and led.debit(att.debit_id).posted == HOLD
    run = led.get_run(RUN)
    assert (run.posted, run.reserved) == (HOLD, 0)
    books = reconcile(led)
    assert books.ok, books.violations
    return att


def _usage_invalid(led: Ledger, att: AttemptRecord) -> dict[str, Any]:
    [ev] = led.events(RUN, ["usage_invalid"])
    assert ev.attempt_id == att.attempt_id
    return dict(ev.data)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("usage", "kept"), [("[]", "[]"), ('"x"', '"x"'), ("7", "7")])
def test_a_usage_that_is_not_an_object_never_turns_the_answer_into_a_failure(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool, usage: str,
        kept: str) -> None:
    led, text, shown = _turn(db_url, fake, protocol, stream, _answer(protocol, stream, usage))
    assert text == TEXT and "".join(shown) == (TEXT if stream else "")
    att = _served_without_usage(led)
    data = _usage_invalid(led, att)
    # No count can be read from it, a number neither: both totals hold its JSON text.
    assert (data["prompt_tokens"], data["completion_tokens"]) == (kept, kept)
    led.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_count_too_long_to_parse_is_out_of_range_and_the_answer_stands(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    raw = (_stream(protocol, DELTA, start_usage=HUGE_PROMPT["anthropic"])
           if stream and protocol == "anthropic" else _answer(protocol, stream,
                                                               HUGE_PROMPT[protocol]))
    led, text, shown = _turn(db_url, fake, protocol, stream, raw)
    assert text == TEXT and "".join(shown) == (TEXT if stream else "")
    att = _served_without_usage(led)
    data = _usage_invalid(led, att)
    # A count past every range: what the event keeps of it is short.
    assert (data["prompt_tokens"], data["completion_tokens"]) == ("inf", "5")
    led.close()


@pytest.mark.parametrize("where", ["message_start", "message_delta"])
def test_an_anthropic_stream_usage_that_is_not_an_object_anywhere_is_not_recorded(
        db_url: str, fake: FakeProvider, where: str) -> None:
    raw = (_stream("anthropic", DELTA, start_usage="[]") if where == "message_start"
           else _stream("anthropic", "[]", start_usage=GOOD["anthropic"]))
    led, text, _ = _turn(db_url, fake, "anthropic", True, raw)
    assert text == TEXT
    att = _served_without_usage(led)
    data = _usage_invalid(led, att)
    # message_start's prompt count is unknown, and message_delta's output count (cumulative)
    # is too: message_start's would under-report the answer.
    assert (data["prompt_tokens"], data["completion_tokens"]) == (
        ("[]", "5") if where == "message_start" else ("[]", "[]"))
    led.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_integer_too_long_to_parse_where_no_codec_reads_leaves_the_answer_and_its_usage(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    led, text, _ = _turn(db_url, fake, protocol, stream,
                         _answer(protocol, stream, GOOD[protocol], extra=HUGE))
    assert text == TEXT
    [att] = led.timeline(RUN)
    assert (att.state, att.prompt_tokens, att.completion_tokens) == (
        AttemptState.SUCCEEDED, 3, 5)
    assert led.events(RUN, ["usage_invalid"]) == []
    led.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("number", ["5", HUGE], ids=["short", "too_long_to_parse"])
def test_an_integer_too_long_to_parse_is_judged_by_its_fields_rules_as_a_short_one(
        db_url: str, fake: FakeProvider, stream: bool, number: str) -> None:
    """A served model that is a number is malformed, however many digits it has: the same
    Attempt, the same fact."""
    led = Ledger.open(db_url)
    with pytest.raises(FailoverExhausted) as ei:
        _serve(led, RUN, fake, "openai", stream,
               _answer("openai", stream, GOOD["openai"], model=number))
    # A stream's malformed event breaks the answer off (mid_stream): its execution is unknown.
    assert ei.value.reason == ("execution_unknown" if stream else "not_eligible_failure")
    [att] = led.timeline(RUN)
    assert att.fact is not None and att.fact.transport is not None
    assert (att.state, att.fact.category, att.fact.transport.value) == (
        AttemptState.FAILED, Category.FORMAT, "malformed_event")
    assert "model is not a string" in att.fact.message
    led.close()


def test_the_usage_invalid_event_keeps_a_bounded_excerpt_of_a_long_report(
        db_url: str, fake: FakeProvider) -> None:
    sent = "x" * 100_000
    led, text, _ = _turn(db_url, fake, "openai", False, _whole("openai", json.dumps(sent)))
    assert text == TEXT
    data = _usage_invalid(led, _served_without_usage(led))
    assert data["prompt_tokens"].startswith('"' + "x" * (MAX_REPORTED_CHARS - 1) + "...")
    assert len(data["prompt_tokens"]) < MAX_REPORTED_CHARS + 32
    led.close()
