"""A Responses ``custom_tool_call`` (a ``custom`` tool's call, free-text input) is never passed
off as a plain answer.

The ledger hands a tool call on as an assistant part holding its arguments as a JSON object,
sent back as a ``function_call``: a custom tool's free-text call cannot be carried faithfully.
Dropping the item made the answer look like text, and the agent never ran the tool; the answer
is refused instead, a ``malformed_event`` failure (category ``format``) whose message names the
item and the fix, decided on the whole answer (a stream's on its ``response.completed``), so the
Attempt failed (it is not unknown) with the usage the provider reported. Real HTTP over
loopback, whole and streamed, on both backends.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from ledger import Budget, Envelope, FailoverExhausted, Ledger, Part
from ledger.domain.facts import Transport
from ledger.domain.records import AttemptState
from ledger.testing import Behavior, FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GREP = {"type": "custom", "name": "grep", "description": "search the code"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_custom_tool_call_is_refused_not_passed_off_as_a_plain_answer(
        db_url: str, fake: FakeProvider, stream: bool) -> None:
    fake.enqueue(Behavior(custom_tool_call=("grep", "TODO in src/")))
    env = Envelope(parts=[Part(content="find the TODOs")], params={"tools": [GREP]},
                   stream=stream)
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, "openai_responses"), budget=BUDGET) as run, \
                pytest.raises(FailoverExhausted) as ei:
            run.turn(env)
        assert ei.value.reason == "not_eligible_failure"
        [attempt] = led.timeline("t")
        # Streamed or not, the whole answer was seen: failed (not unknown), its usage posted.
        assert attempt.state is AttemptState.FAILED and attempt.prompt_tokens == 11
        assert attempt.fact is not None and attempt.category == "format"
        assert attempt.fact.transport is Transport.MALFORMED_EVENT
        # The recorded fact says what the answer held and the fix.
        assert "custom_tool_call to tool 'grep'" in (attempt.fact.message or "")
        assert "Envelope.tools" in (attempt.fact.message or "")
        assert len(fake.requests) == 1  # the default policy does not resend a format failure
