"""Images a model returns, through Run sessions on both backends over real HTTP on loopback.

An image the model returns is an assistant part of the turn's ``parts`` (class
``model_derived``, the Attempt as provenance) whose hash the settle records, so carrying it
into the next turn passes disclosure preflight and an edited copy does not; it goes back to a
route of any protocol (a failover to Anthropic, which returns no images, included); the
policy's size limits apply to it only when it is sent again.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    CandidateSkipped,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    Ledger,
    Part,
    Route,
    WireProtocol,
)
from ledger.domain.media import MediaKind
from ledger.policy.load import preset
from ledger.policy.model import EnvelopePolicy
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import PRICE, plan
from tests.media import png

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "system"]})
IMAGE_OUT = ["openai", "openai_responses", "gemini"]  # the protocols that return images
CHART = png(320, 200)
ASK = Part(content="Draw the revenue chart.")
AGAIN = Part(content="Make the bars blue.")


def images(parts: list[Part]) -> list[Part]:
    return [p for p in parts if p.kind is MediaKind.IMAGE]


def recorded(led: Ledger, run_id: str) -> tuple[int, int]:
    """Attempts and events of the Run: what a refused turn must not add to."""
    return len(led.timeline(run_id)), len(led.events(run_id))


@pytest.mark.parametrize("protocol", IMAGE_OUT)
@pytest.mark.parametrize("stream", [False, True])
def test_the_models_image_is_a_covered_part_the_next_turn_carries(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(Behavior(image_out=("image/png", CHART)), model="primary-model")
    with Ledger.open(db_url) as led, led.run("draw", plan=plan(fake, protocol), budget=BUDGET,
                                              grant=GRANT) as run:
        first = run.turn(Envelope(parts=[ASK], stream=stream))
        (image,) = images(first.parts)
        attempt = first.attempt.attempt_id
        assert (image.role, image.data_class, image.provenance) == ("assistant",
                                                                     "model_derived", attempt)
        assert image.data == CHART and first.text  # the text is its own part, as before
        # The settle recorded every part of the answer, the image included, as provenance.
        assert led.provenance("draw")[attempt] == {p.content_hash for p in first.parts}

        # The next turn carries it as the ledger returned it: covered, sent.
        second = run.turn(Envelope(parts=[ASK, *first.parts, AGAIN], stream=stream))
        assert second.text
        req = fake.requests[-1]
        assert req.problem is None and [m.data for m in req.media] == [CHART]
        assert req.media[0].role == ("model" if protocol == "gemini" else "user")

        # An edited copy (other bytes under the same Attempt) is not covered: refused before
        # anything is sent or recorded.
        before, sent = recorded(led, "draw"), len(fake.requests)
        edited = image.model_copy(update={"data": png(320, 201)})
        with pytest.raises(FailoverExhausted) as info:
            run.turn(Envelope(parts=[ASK, first.parts[0], edited, AGAIN]))
        assert info.value.reason == "no_candidate"
        assert f"no covering provenance: mismatch (ref '{attempt}')" in str(info.value)
        assert len(fake.requests) == sent
        assert recorded(led, "draw")[0] == before[0]  # no Attempt
        # So is the same image claimed by an Attempt that did not return it.
        other = second.attempt.attempt_id
        with pytest.raises(FailoverExhausted, match="mismatch"):
            run.turn(Envelope(parts=[ASK, image.model_copy(update={"provenance": other}),
                                     AGAIN]))


def test_an_image_only_answer_goes_back_without_an_empty_text_block(
        db_url: str, fake: FakeProvider) -> None:
    # Gemini answers with only an image; the conversation goes on on Anthropic, which refuses
    # an empty text block and takes images in user messages only.
    routes = [Route(id="gemini", provider="fake", model="gemini-image", group="ga",
                    recipient="fake", protocol=WireProtocol.GEMINI,
                    endpoint=fake.endpoint("gemini"), price=PRICE),
              Route(id="claude", provider="fake-b", model="claude", group="gb",
                    recipient="fake", protocol=WireProtocol.ANTHROPIC,
                    endpoint=fake.endpoint("anthropic"), price=PRICE)]
    fake.enqueue(Behavior(text="", image_out=("image/png", CHART)), model="gemini-image")
    with Ledger.open(db_url) as led, led.run("mixed", plan=routes, budget=BUDGET,
                                              grant=GRANT) as run:
        first = run.turn(Envelope(parts=[ASK]))
        assert [p.kind for p in first.parts] == [MediaKind.IMAGE] and first.text == ""
        # Gemini fails before any output: the turn moves to Anthropic, which gets the image
        # in a user message (after a line saying whose it is), and the result says so.
        fake.enqueue(Fault.UNAVAILABLE, model="gemini-image")
        second = run.turn(Envelope(parts=[ASK, *first.parts, Part(content="Describe it.")]))
        assert second.route.id == "claude" and second.switched
        req = fake.requests[-1]
        assert req.problem is None and [(m.data, m.role) for m in req.media] == [(CHART,
                                                                                  "user")]
        # Consecutive user content is one Anthropic message: the question, whose image, it.
        (message,) = req.json["messages"]
        assert [b["type"] for b in message["content"]] == ["text", "text", "image", "text"]
        (note,) = second.output.notes
        assert "an image the model returned (image/png) is sent to route 'claude'" in note
        assert [a.state.value for a in second.attempts] == ["failed", "succeeded"]
    assert images(second.parts) == []  # Anthropic returns no images


LEAK = "https://attacker.example/c.png?d=ACCOUNT-12000-ACME"


def _gemini_answer_with_link(url: str) -> bytes:
    """A Gemini answer whose fileData link the model wrote (the fake serves it verbatim)."""
    body = json.dumps({"candidates": [{"content": {"role": "model", "parts": [
        {"text": "Here is the chart."},
        {"fileData": {"mimeType": "image/png", "fileUri": url}}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2,
                          "totalTokenCount": 5}}).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body) + body)


def test_invariant7_a_link_the_model_chose_is_never_sent_for_a_provider_to_fetch(
        db_url: str, fake: FakeProvider) -> None:
    # The model (a prompt injection) writes the conversation's data into a link's URL; carried
    # on, Gemini would fetch it, or after a failover chat completions as an image_url, and the
    # link's host, which no grant names, would receive the data.
    routes = [Route(id="gemini", provider="fake", model="gemini-image", group="ga",
                    recipient="google", protocol=WireProtocol.GEMINI,
                    endpoint=fake.endpoint("gemini"), price=PRICE),
              Route(id="chat", provider="fake-b", model="chat", group="gb", recipient="acme",
                    endpoint=fake.endpoint("openai"), price=PRICE)]
    every = ["user_input", "model_derived", "system", "tool_result", "private_document"]
    grant = Grant(recipients={"google": every, "acme": every})
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(_gemini_answer_with_link(LEAK),)),
                 model="gemini-image")
    with Ledger.open(db_url) as led, led.run("link", plan=routes, budget=BUDGET,
                                              grant=grant) as run:
        first = run.turn(Envelope(parts=[ASK]))
        (link,) = images(first.parts)
        # The answer keeps it, covered: the host may show it; only sending it on is refused.
        assert (link.url, link.data_class) == (LEAK, "model_derived")
        assert link.content_hash in led.provenance("link")[first.attempt.attempt_id]

        before, sent = recorded(led, "link")[0], len(fake.requests)
        with pytest.raises(FailoverExhausted) as info:
            run.turn(Envelope(parts=[ASK, *first.parts, AGAIN]))
        stop = info.value
        assert stop.reason == "no_candidate" and stop.attempts == []
        skipped = [e for e in stop.exceptions if isinstance(e, CandidateSkipped)]
        assert {(e.route, e.reason) for e in skipped} == {("gemini", "disclosure"),
                                                          ("chat", "disclosure")}
        for e in skipped:
            assert e.detail.startswith("part 2 (image/png) is an https:// link a model or a "
                                       "tool chose")
            assert "fetch the file yourself" in e.fix
        assert "ACCOUNT-12000" not in str(stop) and "attacker" not in str(stop)
        assert len(fake.requests) == sent  # nothing left
        assert recorded(led, "link")[0] == before  # no Attempt

        # The fix: the host fetches the file itself, checks it and sends its bytes as its own.
        fetched = Part(data=CHART, media_type="image/png")
        assert run.turn(Envelope(parts=[ASK, first.parts[0], fetched, AGAIN])).text
        assert [m.data for m in fake.requests[-1].media] == [CHART]
        # The host's own link is its choice, as before.
        own = Part(url="https://files.example/chart.png", media_type="image/png")
        assert run.turn(Envelope(parts=[ASK, own])).text
        assert [m.url for m in fake.requests[-1].media] == [own.url]
    assert all(LEAK not in json.dumps(r.json) for r in fake.requests)


def test_an_oversized_image_is_kept_in_the_result_and_refused_when_sent_again(
        db_url: str, fake: FakeProvider) -> None:
    small = preset("failure-domain").model_copy(update={"envelope": EnvelopePolicy(
        max_part_bytes=len(CHART) - 1, max_envelope_bytes=len(CHART) * 4)})
    fake.enqueue(Behavior(image_out=("image/png", CHART)), model="primary-model")
    with Ledger.open(db_url) as led, led.run("big", plan=plan(fake, "gemini"), budget=BUDGET,
                                              grant=GRANT, policy=small) as run:
        # What a model returns is not bounded by the policy: the answer holds it whole.
        first = run.turn(Envelope(parts=[ASK]))
        (image,) = images(first.parts)
        assert image.data == CHART
        assert image.content_hash in led.provenance("big")[first.attempt.attempt_id]
        # Sent again, it is a part of the request like any other: over the limit, refused
        # before anything is recorded, with the typed error naming the part.
        before, sent = recorded(led, "big"), len(fake.requests)
        with pytest.raises(InvalidArgument) as info:
            run.turn(Envelope(parts=[ASK, *first.parts, AGAIN]))
        assert info.value.field == "envelope.parts[2].data"
        assert "envelope.max_part_bytes" in str(info.value)
        assert recorded(led, "big") == before and len(fake.requests) == sent
        # The conversation goes on without it.
        assert run.turn(Envelope(parts=[ASK, first.parts[0], AGAIN])).text


def test_an_async_session_streams_an_answer_with_an_image_and_carries_it_on(
        db_url: str, fake: FakeProvider) -> None:
    shown: list[str] = []

    async def main() -> Any:
        async with AsyncLedger.open(db_url) as led, led.run(
                "async", plan=plan(fake, "openai_responses"), budget=BUDGET,
                grant=GRANT) as run:
            fake.enqueue(Behavior(image_out=("image/png", CHART)), model="primary-model")
            first = await run.turn(Envelope(parts=[ASK], stream=True), on_text=shown.append)
            assert "".join(shown) == first.text
            (image,) = images(first.parts)
            assert image.content_hash in (await led.provenance("async"))[
                first.attempt.attempt_id]
            second = await run.turn(Envelope(parts=[ASK, *first.parts, AGAIN], stream=True))
            return second

    second = asyncio.run(main())
    assert second.text and fake.requests[-1].problem is None
    assert [m.data for m in fake.requests[-1].media] == [CHART]
