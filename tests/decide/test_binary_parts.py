"""Images and documents in the envelope, as values and in the pure core.

A binary part's hash covers its bytes (or its link), so provenance and "an edited copy is
refused" hold for files as for text; bad input is a typed error naming the field and the fix;
preflight skips a route that cannot read the envelope (``capability: image input`` / ``pdf
input``); the token estimate counts images and PDF pages by each protocol's rule; the policy's
size bounds refuse an envelope before anything is recorded.
"""

from __future__ import annotations

import base64
import math
import os
import time
import tracemalloc
import zlib
from typing import Any

import pytest

from ledger.decide.preflight import (
    PDF_PAGE_TOKENS,
    CharEstimator,
    Check,
    Coverage,
    check_envelope_limits,
    image_tokens,
    part_coverage,
    preflight,
)
from ledger.decide.select import DecisionKind, Reason, RunPermissions, SelectionInput, select
from ledger.domain.envelope import PRIVATE_DOCUMENT, USER_INPUT, Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.media import PDF_INFLATE_BYTES, image_size, pdf_pages
from ledger.domain.values import Capabilities, Grant, Route, content_hash
from ledger.errors import InvalidArgument, PolicyError
from ledger.policy.load import preset, validate_policy
from ledger.policy.model import EnvelopePolicy
from tests.media import gif, jpeg, objstm_pdf, opaque_pdf, pdf, png, webp

PNG = png(64, 32)
PDF = pdf(3)


def route(protocol: WireProtocol = WireProtocol.OPENAI, **caps: Any) -> Route:
    return Route(id=f"r-{protocol.value}", provider="p", model="m", group="g", recipient="p",
                 protocol=protocol, capabilities=Capabilities(**caps))


def image(**kw: Any) -> Part:
    return Part(data=PNG, media_type="image/png", **kw)


def document(**kw: Any) -> Part:
    return Part(**{"data": PDF, "media_type": "application/pdf", "name": "10-K.pdf", **kw})


# -- hashing and provenance --------------------------------------------------------------------


def test_a_text_part_hashes_exactly_as_before_binary_parts_existed() -> None:
    # Provenance recorded by earlier versions must still cover the same text parts.
    p = Part(role="assistant", content="Revenue fell.", data_class="model_derived",
             provenance="att-1")
    assert p.content_hash == content_hash({"role": "assistant", "content": "Revenue fell.",
                                           "data_class": "model_derived", "tool_call_id": None,
                                           "name": None})


def test_a_binary_part_hash_covers_its_bytes_media_type_and_name() -> None:
    base = document()
    assert base.content_hash == document().content_hash
    assert base.content_hash != Part(data=pdf(4), media_type="application/pdf",
                                     name="10-K.pdf").content_hash
    assert base.content_hash != document(data_class=PRIVATE_DOCUMENT).content_hash
    assert base.content_hash != Part(data=PDF, media_type="application/pdf",
                                     name="10-Q.pdf").content_hash
    # A data: URL is hashed as the bytes it carries: the same file, the same hash.
    as_url = Part(url="data:application/pdf;base64," + base64.b64encode(PDF).decode(),
                  name="10-K.pdf")
    assert as_url.media_type == "application/pdf" and as_url.payload == PDF
    assert as_url.content_hash == base.content_hash


def test_a_link_part_hash_covers_the_url_text_never_fetched() -> None:
    a = Part(url="https://example.com/10-K.pdf", media_type="application/pdf")
    b = Part(url="https://example.com/10-Q.pdf", media_type="application/pdf")
    assert a.payload is None and a.link == "https://example.com/10-K.pdf"
    assert a.content_hash != b.content_hash
    assert a.content_hash == Part(url="https://example.com/10-K.pdf",
                                  media_type="application/pdf").content_hash


@pytest.mark.parametrize(("written", "canonical"), [
    ("HTTPS://example.com/10-K.pdf", "https://example.com/10-K.pdf"),
    ("Https://example.com/Q/10-K.pdf", "https://example.com/Q/10-K.pdf"),
    ("DATA:application/pdf;base64," + base64.b64encode(PDF).decode(),
     "data:application/pdf;base64," + base64.b64encode(PDF).decode()),
])
def test_a_url_scheme_in_any_case_is_kept_in_lower_case_and_hashes_as_one_link(
        written: str, canonical: str) -> None:
    """A scheme is case-insensitive: one link is one hash and one form on the wire."""
    part = Part(url=written, media_type="application/pdf")
    assert part.url == canonical
    assert part.content_hash == Part(url=canonical, media_type="application/pdf").content_hash


@pytest.mark.parametrize("edit", [
    {"data": pdf(4)},
    {"media_type": "text/plain"},
    {"name": "other.pdf"},
    {"authorized": True},
], ids=["bytes", "media-type", "name", "planted-flag"])
def test_an_edited_copy_of_a_document_does_not_inherit_its_provenance(
        edit: dict[str, Any]) -> None:
    doc = document(data_class=PRIVATE_DOCUMENT, provenance="doc-10k")
    recorded = {"doc-10k": {doc.content_hash}}
    assert part_coverage(doc, recorded) is Coverage.OK
    # model_copy skips validation: exactly how a tampered copy is made.
    assert part_coverage(doc.model_copy(update=edit), recorded) is Coverage.MISMATCH


# -- bad input: a typed error naming the field and the fix -------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("role", "system"), ("content", "edited"), ("data_class", PRIVATE_DOCUMENT),
    ("tool_call_id", "call-2"), ("name", "other.txt"), ("media_type", "text/markdown"),
    ("data", b"other bytes"), ("url", "https://files.example/other.pdf"),
])
def test_a_memoised_part_changed_in_place_is_hashed_again(field: str, value: object) -> None:
    """``PartHashes`` reuses a hash only while every field the hash covers holds the very
    value it held when hashed: a part changed in place through ``object.__setattr__`` gets
    the hash of what it carries now, for each of those fields."""
    from ledger.domain.envelope import PartHashes

    part = {"data": Part(data=b"plain text", media_type="text/plain", name="a.txt"),
            "name": Part(data=b"plain text", media_type="text/plain", name="a.txt"),
            "media_type": Part(data=b"plain text", media_type="text/plain"),
            "url": Part(url="https://files.example/10-K.pdf", media_type="application/pdf"),
            }.get(field, Part(content="text", tool_call_id="call-1"))
    memo = PartHashes()
    env = Envelope(parts=[part])
    before = part.content_hash
    assert memo.of(env) == (before,) == memo.of(env)
    object.__setattr__(part, field, value)
    assert part.content_hash != before
    assert memo.of(env) == (part.content_hash,)


def test_a_memoised_part_holding_a_mutable_value_is_hashed_every_time() -> None:
    """A value that can change in place (here a list planted as ``content``) is the same
    object after an edit, so identity proves nothing: such a part is never memoised."""
    from ledger.domain.envelope import PartHashes

    part = Part(content="text")
    planted = ["text"]
    object.__setattr__(part, "content", planted)
    memo = PartHashes()
    env = Envelope(parts=[part])
    before = memo.of(env)
    planted[0] = "edited"
    assert memo.of(env) == (part.content_hash,) != before


@pytest.mark.parametrize(("kw", "field", "says"), [
    ({"data": PNG, "url": "https://x.example/a.png", "media_type": "image/png"}, "url",
     "not both"),
    ({"data": PNG, "media_type": "image/tiff"}, "media_type", "pass one of"),
    ({"data": PNG, "media_type": "image/jpg"}, "media_type", "use image/jpeg"),
    ({"data": PNG}, "media_type", "needs media_type="),
    ({"url": "http://x.example/a.png", "media_type": "image/png"}, "url", "scheme 'http'"),
    ({"url": "file:///etc/passwd", "media_type": "image/png"}, "url", "scheme 'file'"),
    ({"url": "x.example/a.png", "media_type": "image/png"}, "url", "no scheme"),
    # The scheme alone is not a link: the provider is given https://host/path or nothing.
    ({"url": "https:x.example/a.png", "media_type": "image/png"}, "url", "https://host/path"),
    ({"url": "https:/x.example/a.png", "media_type": "image/png"}, "url", "https://host/path"),
    ({"url": "https:///a.png", "media_type": "image/png"}, "url", "https://host/path"),
    ({"url": "https://?a.png", "media_type": "image/png"}, "url", "https://host/path"),
    ({"url": "data:image/png;base64,%%%"}, "url", "not valid base64"),
    ({"url": "data:image/png;base64," + base64.b64encode(PNG).decode(),
      "media_type": "image/gif"}, "media_type", "differs"),
    ({"data": b"GIF89a....", "media_type": "image/png"}, "media_type", "not image/png"),
    ({"data": b"hello", "media_type": "application/pdf"}, "media_type", "not a PDF"),
    ({"data": b"\xff\xfe\x00", "media_type": "text/plain"}, "media_type", "not UTF-8"),
    ({"data": b"", "media_type": "image/png"}, "media_type", "empty"),
    ({"data": "not bytes", "media_type": "text/plain"}, "data", "not bytes"),
    ({"data": PNG, "media_type": "image/png", "content": "a caption"}, "content",
     "its own part"),
    ({"data": PNG, "media_type": "image/png", "role": "tool"}, "role", "role='user'"),
    ({"data": PNG, "media_type": "image/png", "role": "system"}, "role", "role='assistant'"),
    # The model's image is model output: its class says so (a user_input one would be exempt
    # from provenance, and pass disclosure as the user's own file).
    ({"data": PNG, "media_type": "image/png", "role": "assistant",
      "data_class": "user_input"}, "data_class", "data_class='model_derived'"),
    ({"data": PNG, "media_type": "image/png", "role": "assistant",
      "data_class": "private_document"}, "data_class", "not 'private_document'"),
    ({"data": PNG, "media_type": "image/png", "tool_call_id": "c1"}, "tool_call_id",
     "leave tool_call_id out"),
    ({"content": "text", "media_type": "image/png"}, "media_type", "neither"),
    ({}, "Part", "carries nothing"),
])
def test_a_bad_binary_part_is_a_typed_error_naming_the_field_and_the_fix(
        kw: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        Part(**kw)
    assert info.value.field == field and says in str(info.value), str(info.value)


def test_a_bad_part_inside_an_envelope_names_its_path() -> None:
    with pytest.raises(InvalidArgument) as info:
        Envelope(parts=[Part(content="Read this."),
                        {"url": "ftp://x.example/a.pdf", "media_type": "application/pdf"}])
    assert info.value.field == "parts[1].url"


def test_every_accepted_image_format_is_read_for_its_size() -> None:
    assert image_size(png(64, 32), "image/png") == (64, 32)
    assert image_size(jpeg(640, 480), "image/jpeg") == (640, 480)
    assert image_size(gif(10, 20), "image/gif") == (10, 20)
    assert image_size(webp(100, 50), "image/webp") == (100, 50)
    for data, mt in ((jpeg(), "image/jpeg"), (gif(), "image/gif"), (webp(), "image/webp")):
        assert Part(data=data, media_type=mt).kind.value == "image"  # type: ignore[union-attr]


def test_a_pdf_page_count_is_read_from_its_page_tree() -> None:
    assert pdf_pages(pdf(1)) == 1 and pdf_pages(pdf(12)) == 12
    assert pdf_pages(opaque_pdf(1000)) is None



def test_a_pdf_page_count_is_read_from_its_compressed_object_streams() -> None:
    # pdfTeX, Word and Chrome put the page tree in /ObjStm streams: unread, a 30-page scan of
    # 15 MiB was taken for 300 pages (903,003 tokens on Anthropic, over a 200k context), and a
    # 200-page text PDF of a few KiB for one page.
    assert pdf_pages(objstm_pdf(12)) == 12 and pdf_pages(objstm_pdf(200)) == 200
    scan = objstm_pdf(30, image_bytes=500 * 1024)
    assert pdf_pages(scan) == 30
    env = Envelope(parts=[Part(content="Sum."), Part(data=scan, media_type="application/pdf")])
    assert CharEstimator().count_tokens(env, route(WireProtocol.ANTHROPIC)) == 30 * 3000 + 1
    assert preflight(route(WireProtocol.ANTHROPIC, context_window=200_000), env, grant=None,
                     role="research").ok
    # Real files: pdfTeX 1.40's (their page trees are only in object streams).
    for path, pages in (("/usr/share/doc/libtasn1-doc/libtasn1.pdf", 36),
                        ("/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf", 17)):
        if os.path.exists(path):
            with open(path, "rb") as f:
                assert pdf_pages(f.read()) == pages


def test_a_deflate_bomb_in_an_object_stream_is_not_inflated_past_its_bound() -> None:
    # 256 MiB of inflated text in 256 KiB: read up to PDF_INFLATE_BYTES, then the object
    # streams are unreadable and the size rule applies (the pages listed first do not count).
    pages = b"<< /Type /Page >>\n" * 100
    packer = zlib.compressobj(9)
    packed = packer.compress(pages) + b"".join(packer.compress(bytes(1024 * 1024))
                                               for _ in range(256)) + packer.flush()
    bomb = objstm_pdf(1, inner=b"")
    at = bomb.index(b"stream\r\n") + len(b"stream\r\n")
    bomb = bomb[:at] + packed + bomb[bomb.index(b"\nendstream", at):]
    tracemalloc.start()
    try:
        assert pdf_pages(bomb) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * PDF_INFLATE_BYTES + 4 * 1024 * 1024, f"{peak >> 20} MiB"
    # Within the bound, the same pages are counted; another filter is not read.
    assert pdf_pages(objstm_pdf(1, inner=pages)) == 100
    assert pdf_pages(objstm_pdf(7, filters="/LZWDecode")) is None
    opaque = Envelope(parts=[Part(data=bomb, media_type="application/pdf")])
    assert CharEstimator().count_tokens(opaque, route(WireProtocol.GEMINI)) == math.ceil(
        len(bomb) / (50 * 1024)) * 258

@pytest.mark.parametrize("filler", [b"/Count 1 ", b"/Type /Pages ", b"/Type /Pages /Count 1 "])
def test_a_pdf_page_count_is_read_in_time_linear_in_the_file(filler: bytes) -> None:
    # A page tree's /Type /Pages and /Count paired by a lazy [^>]*? rescanned to the end of
    # the file from each of them: 75 s for 360 KB of "/Count 1 ", hours for a 20 MiB upload,
    # spent in a turn's preflight. Linear, 4 MiB of it takes well under a second.
    hostile = b"%PDF-1.7\n" + filler * (4 * 1024 * 1024 // len(filler))
    started = time.perf_counter()
    pages = pdf_pages(hostile)
    assert time.perf_counter() - started < 5.0
    assert pages == (1 if b"/Count" in filler and b"/Pages" in filler else None)
    # The /Count of a page tree node, either side of its /Type, within its dictionary only.
    assert pdf_pages(b"%PDF-1.7\n<< /Count 3 /Type /Pages >> << /Count 9 >>") == 3
    assert pdf_pages(b"%PDF-1.7\n<< /Type /Pages /Kids [4 0 R] /Count 2 >>") == 2


def test_a_binary_part_round_trips_through_json() -> None:
    env = Envelope(parts=[Part(content="Compare."), image(), document()])
    assert Envelope.model_validate_json(env.model_dump_json()) == env


# -- token estimates ---------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "protocol", "tokens"), [
    ((1024, 1024), WireProtocol.OPENAI, 765),            # 768x768: 4 tiles
    ((2048, 4096), WireProtocol.OPENAI_RESPONSES, 1105),  # 768x1536: 6 tiles
    ((100, 100), WireProtocol.OPENAI, 255),               # one tile
    ((1000, 1000), WireProtocol.ANTHROPIC, 1334),         # w*h/750
    ((4000, 3000), WireProtocol.ANTHROPIC, 1600),         # capped
    ((300, 300), WireProtocol.GEMINI, 258),               # within 384x384
    ((1000, 1000), WireProtocol.GEMINI, 1032),            # 4 tiles of 768
    ((1000, 1000), WireProtocol.GENERIC, 1334),           # the largest rule
])
def test_image_tokens_follow_each_providers_published_rule(
        size: tuple[int, int], protocol: WireProtocol, tokens: int) -> None:
    assert image_tokens(*size, protocol) == tokens


def test_the_estimate_counts_images_and_pdf_pages_per_protocol() -> None:
    counter = CharEstimator()
    text = Envelope(parts=[Part(content="x" * 400)])
    assert counter.count_tokens(text, route()) == 100
    ten = Envelope(parts=[Part(content="x" * 400), Part(data=pdf(10),
                                                         media_type="application/pdf")])
    for protocol in (WireProtocol.OPENAI, WireProtocol.OPENAI_RESPONSES, WireProtocol.ANTHROPIC,
                     WireProtocol.GEMINI):
        assert counter.count_tokens(ten, route(protocol)) == 100 + 10 * PDF_PAGE_TOKENS[protocol]
    assert counter.count_tokens(ten, route(WireProtocol.GENERIC)) == 100 + 10 * 3000
    pic = Envelope(parts=[Part(data=png(1024, 1024), media_type="image/png")])
    assert counter.count_tokens(pic, route(WireProtocol.OPENAI)) == 765
    assert counter.count_tokens(pic, route(WireProtocol.GEMINI)) == 1032


def test_documents_whose_pages_are_unknown_are_estimated_conservatively() -> None:
    counter = CharEstimator()
    opaque = Envelope(parts=[Part(data=opaque_pdf(200 * 1024), media_type="application/pdf")])
    assert counter.count_tokens(opaque, route(WireProtocol.GEMINI)) == 4 * 258  # 50 KiB a page
    link = Envelope(parts=[Part(url="https://x.example/a.pdf", media_type="application/pdf")])
    assert counter.count_tokens(link, route(WireProtocol.ANTHROPIC)) == 10 * 3000
    text = Envelope(parts=[Part(data=b"y" * 800, media_type="text/plain")])
    assert counter.count_tokens(text, route()) == 200


# -- preflight: capability and disclosure ------------------------------------------------------


@pytest.mark.parametrize(("caps", "part", "detail"), [
    ({"image_input": False}, image(), "image input"),
    ({"pdf_input": False}, document(), "pdf input"),
    ({"max_image_bytes": 10}, image(), "image input"),
    ({"max_pdf_bytes": 10}, document(), "pdf input"),
    ({"url_input": False}, Part(url="https://x.example/a.png", media_type="image/png"),
     "image input"),
])
def test_a_route_that_cannot_read_the_envelope_fails_capability_naming_the_part(
        caps: dict[str, Any], part: Part, detail: str) -> None:
    env = Envelope(parts=[Part(content="What does it show?"), part])
    result = preflight(route(**caps), env, grant=None, role="research")
    first = result.first
    assert first is not None and first.check is Check.CAPABILITY
    assert first.detail.startswith(detail) and "part 1" in first.detail and first.fix
    # Unknown is no restriction: the same route without the declaration reads it.
    assert preflight(route(), env, grant=None, role="research").ok


def test_a_protocol_that_carries_no_pdf_link_fails_capability_whatever_the_route_says() -> None:
    env = Envelope(parts=[Part(url="https://x.example/a.pdf", media_type="application/pdf")])
    first = preflight(route(WireProtocol.OPENAI), env, grant=None, role="research").first
    assert first is not None and first.check is Check.CAPABILITY
    assert first.detail.startswith("pdf input") and "link" in first.detail
    for protocol in (WireProtocol.OPENAI_RESPONSES, WireProtocol.ANTHROPIC, WireProtocol.GEMINI):
        assert preflight(route(protocol), env, grant=None, role="research").ok


def test_a_gif_fails_capability_on_gemini_only_whatever_the_route_says() -> None:
    for part in (Part(data=gif(), media_type="image/gif"),
                 Part(url="https://x.example/a.gif", media_type="image/gif")):
        env = Envelope(parts=[Part(content="What moves?"), part])
        first = preflight(route(WireProtocol.GEMINI, image_input=True), env, grant=None,
                          role="research").first
        assert first is not None and first.check is Check.CAPABILITY
        assert first.detail.startswith("image input: part 1 is image/gif")
        for protocol in (WireProtocol.OPENAI, WireProtocol.OPENAI_RESPONSES,
                         WireProtocol.ANTHROPIC, WireProtocol.GENERIC):
            assert preflight(route(protocol), env, grant=None, role="research").ok
    for mt, data in (("image/png", png()), ("image/jpeg", jpeg()), ("image/webp", webp())):
        env = Envelope(parts=[Part(data=data, media_type=mt)])
        assert preflight(route(WireProtocol.GEMINI), env, grant=None, role="research").ok


def test_disclosure_applies_to_binary_parts_by_their_data_class() -> None:
    doc = document(data_class=PRIVATE_DOCUMENT, provenance="doc-10k")
    env = Envelope(parts=[Part(content="Summarise."), doc])
    user_only = Grant(recipients={"p": [USER_INPUT]})
    both = Grant(recipients={"p": [USER_INPUT, PRIVATE_DOCUMENT]})
    recorded = {"doc-10k": {doc.content_hash}}
    refused = preflight(route(), env, grant=user_only, role="r", provenance=recorded)
    assert refused.checks == {Check.DISCLOSURE}
    assert "private_document" in (refused.first.detail if refused.first else "")
    assert preflight(route(), env, grant=both, role="r", provenance=recorded).ok
    # Approved, but the ledger never recorded this document: no covering provenance.
    missing = preflight(route(), env, grant=both, role="r", provenance={})
    assert missing.checks == {Check.DISCLOSURE}
    # A user's own upload (user_input, the default) needs the grant only.
    mine = Envelope(parts=[Part(content="Summarise."), document()])
    assert preflight(route(), mine, grant=user_only, role="r").ok


def test_the_selector_skips_an_image_blind_route_with_capability_image_input() -> None:
    blind = route(image_input=False).model_copy(update={"id": "blind"})
    seeing = route().model_copy(update={"id": "seeing", "group": "g2"})
    env = Envelope(parts=[Part(content="What is this chart?"), image()])
    decision = select(SelectionInput(plan=[blind, seeing], permissions=RunPermissions(
        retries_left=3, calls_left=3), policy=preset("failure-domain"), now=0.0, request=env))
    assert decision.kind is DecisionKind.ROUTE and decision.route_id == "seeing"
    (skip,) = decision.skipped
    assert skip.route == "blind" and skip.reason is Reason.CAPABILITY
    assert skip.detail.startswith("image input")
    alone = select(SelectionInput(plan=[blind], permissions=RunPermissions(
        retries_left=3, calls_left=3), policy=preset("failure-domain"), now=0.0, request=env))
    assert alone.kind is DecisionKind.STOP and alone.reason is Reason.NO_CANDIDATE
    assert alone.skipped[0].fix.startswith("plan a route that reads images")


def test_the_selector_estimates_each_protocol_by_its_own_rule() -> None:
    # Ten pages: ~30,000 tokens to Anthropic, ~2,580 to Gemini; both windows are 20,000.
    claude = route(WireProtocol.ANTHROPIC, context_window=20_000)
    gemini = route(WireProtocol.GEMINI, context_window=20_000).model_copy(update={"group": "g2"})
    env = Envelope(parts=[Part(content="Summarise."), Part(data=pdf(10),
                                                           media_type="application/pdf")])
    decision = select(SelectionInput(plan=[claude, gemini], permissions=RunPermissions(
        retries_left=3, calls_left=3), policy=preset("failure-domain"), now=0.0, request=env))
    assert decision.route_id == gemini.id
    assert decision.skipped[0].reason is Reason.CAPABILITY
    assert "30003 tokens" in decision.skipped[0].detail  # 10 pages and the question


# -- the policy's size bounds ------------------------------------------------------------------


def test_a_part_over_the_policy_bound_is_refused_naming_the_part() -> None:
    limits = EnvelopePolicy(max_part_bytes=len(PDF) - 1, max_envelope_bytes=10 * len(PDF))
    env = Envelope(parts=[Part(content="Read it."), document()])
    with pytest.raises(InvalidArgument) as info:
        check_envelope_limits(env, limits)
    err = info.value
    assert err.field == "envelope.parts[1].data"
    assert "'10-K.pdf'" in str(err) and "envelope.max_part_bytes" in str(err)
    assert "url='https://...'" in str(err)  # the fix
    check_envelope_limits(env, EnvelopePolicy())  # the defaults hold it


def test_parts_together_over_the_envelope_bound_are_refused() -> None:
    limits = EnvelopePolicy(max_part_bytes=len(PDF), max_envelope_bytes=len(PDF) + 10)
    env = Envelope(parts=[document(), Part(content="and"), document(name="copy.pdf")])
    with pytest.raises(InvalidArgument) as info:
        check_envelope_limits(env, limits)
    assert info.value.field == "envelope.parts" and "max_envelope_bytes" in str(info.value)
    # A link is fetched by the provider: it weighs nothing here.
    links = Envelope(parts=[Part(url="https://x.example/big.pdf", media_type="application/pdf")
                            for _ in range(3)])
    check_envelope_limits(links, EnvelopePolicy(max_part_bytes=1, max_envelope_bytes=1))


@pytest.mark.parametrize(("envelope", "field"), [
    ({"max_part_bytes": 0}, "envelope.max_part_bytes"),
    ({"max_part_bytes": -5}, "envelope.max_part_bytes"),
    ({"max_envelope_bytes": 1.5}, "envelope.max_envelope_bytes"),
    ({"max_envelope_bytes": True}, "envelope.max_envelope_bytes"),
    ({"max_part_bytes": 2**40}, "envelope.max_part_bytes"),
    ({"max_part_bytes": 100, "max_envelope_bytes": 10}, "envelope.max_part_bytes"),
    ({"max_bytes": 10}, "envelope.max_bytes"),
])
def test_degenerate_envelope_bounds_are_a_policy_error_with_the_fix(
        envelope: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError) as info:
        validate_policy({"name": "x", "envelope": envelope})
    rows = [e for e in info.value.errors if e[0] == field]
    assert rows and rows[0][2], info.value.errors
