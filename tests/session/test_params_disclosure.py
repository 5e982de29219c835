"""Invariant 7 through ``Envelope.params`` and ``Envelope.tools``: what a parameter carries to
a recipient (tool definitions) or makes the provider carry on (the conversation, to an MCP
server) is disclosed as the parts and ``Envelope.tools`` are, and a ``ToolSpec``'s own
``data_class`` adds to ``tool_description``, never replaces it. Real HTTP over loopback,
requests counted at the fake provider, on both backends.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    Ledger,
    Part,
    ToolSpec,
)
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
USER_ONLY = Grant(recipients={"fake": ["user_input"]})
MCP_URL = "https://third-party.example/mcp"


@pytest.mark.parametrize(("protocol", "params"), [
    ("openai", {"functions": [{"name": "search", "description": "SECRET legacy description",
                               "parameters": {"type": "object"}}]}),
    ("openai_responses", {"tools": [{"type": "custom", "name": "grep",
                                     "description": "SECRET custom description"}]}),
])
def test_invariant7_tool_definitions_in_params_reach_no_recipient_unapproved_for_them(
        db_url: str, fake: FakeProvider, protocol: str, params: dict[str, Any]) -> None:
    """The legacy ``functions`` (chat) and a ``custom`` tool (Responses) carry the host's tool
    descriptions as ``Envelope.tools`` do: a recipient approved for ``user_input`` only
    receives nothing, and the refusal names the parameter; approved for
    ``tool_description``, the request is sent."""
    env = Envelope(parts=[Part(content="question")], params=params)
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET, grant=USER_ONLY) as run, \
                pytest.raises(FailoverExhausted) as ei:
            run.turn(env)
        skipped = json.dumps(ei.value.skipped)
        assert "not approved for: tool_description" in skipped
        assert next(iter(params)) in skipped  # the fix names the parameter
        assert fake.requests == [] and led.timeline("t") == []
        both = Grant(recipients={"fake": ["user_input", "tool_description"]})
        with led.run("t2", plan=plan(fake, protocol), budget=BUDGET, grant=both) as run:
            run.turn(env)
        assert len(fake.requests) == 1 and "SECRET" in json.dumps(fake.requests[0].json)


@pytest.mark.parametrize(("protocol", "params"), [
    ("openai_responses", {"tools": [{"type": "mcp", "server_label": "x",
                                     "server_url": MCP_URL, "require_approval": "never"}]}),
    ("anthropic", {"mcp_servers": [{"type": "url", "url": MCP_URL, "name": "x"}]}),
])
def test_invariant7_no_request_makes_the_provider_forward_content_to_an_unapproved_server(
        db_url: str, fake: FakeProvider, protocol: str, params: dict[str, Any]) -> None:
    """An MCP server in the parameters receives the conversation from the provider: it is a
    recipient of its own. Unless the grant approves its URL for every class the request
    carries, nothing is sent (not even to the route's recipient, which is approved); once
    approved, the request goes out with it."""
    env = Envelope(parts=[Part(content="summarise my private data")], params=params)
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET, grant=USER_ONLY) as run, \
                pytest.raises(FailoverExhausted) as ei:
            run.turn(env)
        skipped = json.dumps(ei.value.skipped)
        assert MCP_URL in skipped and "does not approve for: user_input" in skipped
        assert fake.requests == [] and led.timeline("t") == []
        approved = Grant(recipients={"fake": ["user_input"], MCP_URL: ["user_input"]})
        with led.run("t2", plan=plan(fake, protocol), budget=BUDGET, grant=approved) as run:
            run.turn(env)
        assert len(fake.requests) == 1 and MCP_URL in json.dumps(fake.requests[0].json)


def test_invariant7_a_tool_spec_data_class_adds_to_tool_description_never_replaces_it(
        db_url: str, fake: FakeProvider) -> None:
    """``ToolSpec(data_class=...)`` marks a definition that carries more than a tool
    description. Labelled ``user_input``, it went to a recipient approved for ``user_input``
    only; it is disclosed under ``tool_description`` and its own class now, so that recipient
    receives nothing. A ``secret`` description needs a recipient approved for both."""
    relabelled = Envelope(parts=[Part(content="question")],
                          tools=[ToolSpec(name="search", description="SECRET relabelled",
                                          data_class="user_input")])
    secret = Envelope(parts=[Part(content="question")],
                      tools=[ToolSpec(name="vault", description="SECRET vault layout",
                                      data_class="secret")])
    tools_ok = Grant(recipients={"fake": ["user_input", "tool_description"]})
    with Ledger.open(db_url) as led:
        for run_id, env, grant, missing in [("t1", relabelled, USER_ONLY, "tool_description"),
                                            ("t2", secret, tools_ok, "secret")]:
            with led.run(run_id, plan=plan(fake), budget=BUDGET, grant=grant) as run, \
                    pytest.raises(FailoverExhausted) as ei:
                run.turn(env)
            assert f"not approved for: {missing}" in json.dumps(ei.value.skipped)
            assert fake.requests == [] and led.timeline(run_id) == []
        with led.run("t3", plan=plan(fake), budget=BUDGET, grant=tools_ok) as run:
            run.turn(relabelled)
        every = Grant(recipients={"fake": ["user_input", "tool_description", "secret"]})
        with led.run("t4", plan=plan(fake), budget=BUDGET, grant=every) as run:
            run.turn(secret)
        assert len(fake.requests) == 2


@pytest.mark.parametrize(("protocol", "entry"), [
    ("openai_responses", lambda url: {"tools": [{"type": "mcp", "server_label": "x",
                                                 "server_url": url,
                                                 "require_approval": "never"}]}),
    ("anthropic", lambda url: {"mcp_servers": [{"type": "url", "url": url, "name": "x"}]}),
])
def test_invariant7_a_long_mcp_server_url_can_be_granted_and_is_refused_unless_it_is(
        db_url: str, fake: FakeProvider, protocol: str, entry: Any) -> None:
    """A server is a recipient named by its URL, and URLs run past 200 characters (a path, a
    signed query): the grant takes one of up to 2,048. Granted explicitly, the request is sent
    with it (the frozen grant stored and read back whole on either backend); not granted, it is
    refused as any unapproved recipient is. Longer than 2,048, the grant itself is refused with
    the bound and the fix."""
    url = "https://mcp.example.com/tenants/acme/servers/" + "s" * 255  # 300 characters
    assert len(url) == 300
    env = Envelope(parts=[Part(content="summarise my private data")], params=entry(url))
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET, grant=USER_ONLY) as run, \
                pytest.raises(FailoverExhausted) as ei:
            run.turn(env)
        assert url in json.dumps(ei.value.skipped)
        assert fake.requests == [] and led.timeline("t") == []
        approved = Grant(recipients={"fake": ["user_input"], url: ["user_input"]})
        with led.run("t2", plan=plan(fake, protocol), budget=BUDGET, grant=approved) as run:
            run.turn(env)
        assert len(fake.requests) == 1 and url in json.dumps(fake.requests[0].json)
        assert led.frozen_run("t2").grant.recipients[url] == ["user_input"]
    with pytest.raises(InvalidArgument) as too_long:
        Grant(recipients={url + "x" * 1749: ["user_input"]})
    assert "at most 2048 characters" in str(too_long.value)
    assert (too_long.value.field or "").startswith("recipients[")
