"""Every ending of a streamed Attempt is recorded as docs/operations.md's table says.

One test per row of "How a streamed attempt ends" (operations.md): the Attempt's state, its
``effective_output``, what its debit did (posted how much, kept reserved, voided), the money
every report shows (the Run's budget counters, ``Audit.timeline``, ``Audit.costs``,
``Audit.runs``), and whether the turn moved on to the backup under the default preset
(``failure-domain``). Real HTTP over loopback through the fake provider, a Run session as a host
drives it, both backends. The policy is the default preset with short stream time limits, so a
stall ends within a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger import faults
from ledger.adapters import StaticSecretProvider
from ledger.api.facade import AsyncLedger, Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, Phase, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, DebitState
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.policy.load import preset
from ledger.policy.model import Policy, StreamingPolicy
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

SECRETS = StaticSecretProvider({"p:a": "key-a", "p:b": "key-b"})
HOLD = Decimal("0.01")
ZERO = Decimal(0)
RUN = "r"
# The default preset, with stream limits short enough that a stall ends within a second.
POLICY: Policy = preset("failure-domain").model_copy(update={"streaming": StreamingPolicy(
    connect_timeout_s=2, read_timeout_s=2, first_token_timeout_s=2, idle_timeout_s=0.3,
    total_timeout_s=10)})
# For the cancellations: no limit may end the turn before the cancellation lands, however
# loaded the machine (a first-token limit of 2 s did, once, before the request left).
PATIENT: Policy = POLICY.model_copy(update={"streaming": StreamingPolicy(
    connect_timeout_s=30, read_timeout_s=30, first_token_timeout_s=30, idle_timeout_s=30,
    total_timeout_s=60)})


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeProvider, FakeProvider]]:
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b:
        yield a, b


@pytest.fixture(autouse=True)
def _clean(fakes: tuple[FakeProvider, FakeProvider]) -> Iterator[None]:
    for f in fakes:
        f.clear()
    yield
    faults.disarm()


def _plan(fakes: tuple[FakeProvider, FakeProvider], protocol: str = "openai") -> list[Route]:
    a, b = fakes
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
    wire = WireProtocol(protocol)
    return [Route(id="primary", provider="pa", model="m-a", group="ga", recipient="ra",
                  protocol=wire, endpoint=a.endpoint(protocol), profiles=[Profile(id="p:a")],
                  price=price),
            Route(id="backup", provider="pb", model="m-b", group="gb", recipient="rb",
                  protocol=wire, endpoint=b.endpoint(protocol), profiles=[Profile(id="p:b")],
                  price=price)]


def _session_args(fakes: tuple[FakeProvider, FakeProvider],
                  protocol: str = "openai") -> dict[str, Any]:
    return {"plan": _plan(fakes, protocol), "policy": POLICY,
            "budget": Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
            "grant": Grant(recipients={"ra": ["user_input"], "rb": ["user_input"]})}


ENVELOPE = Envelope(parts=[Part(content="Summarise the filing.")], stream=True,
                    max_output_tokens=64)


def _turn(db_url: str, fakes: tuple[FakeProvider, FakeProvider], behavior: Behavior, *,
          watch: bool, protocol: str = "openai"
          ) -> tuple[Ledger, list[str], BaseException | None]:
    """One session turn with ``behavior`` on the primary; (ledger, text shown, what it raised)."""
    fakes[0].enqueue(behavior, model="m-a")
    shown: list[str] = []
    led = Ledger.open(db_url)
    raised: BaseException | None = None
    try:
        with led.run(RUN, secrets=SECRETS, **_session_args(fakes, protocol)) as run:
            run.turn(ENVELOPE, on_text=shown.append if watch else None, reserve=HOLD)
    except FailoverExhausted as e:
        raised = e
    return led, shown, raised


def _async_turn(db_url: str, fakes: tuple[FakeProvider, FakeProvider], behavior: Behavior, *,
                watch: bool, protocol: str = "openai"
                ) -> tuple[Ledger, list[str], BaseException | None]:
    """:func:`_turn` through ``AsyncLedger`` on an event loop."""
    fakes[0].enqueue(behavior, model="m-a")
    shown: list[str] = []

    async def main() -> BaseException | None:
        try:
            async with AsyncLedger.open(db_url) as led, led.run(
                    RUN, secrets=SECRETS, **_session_args(fakes, protocol)) as run:
                await run.turn(ENVELOPE, on_text=shown.append if watch else None, reserve=HOLD)
        except FailoverExhausted as e:
            return e
        return None

    raised = asyncio.run(main())
    return Ledger.open(db_url), shown, raised


TURNS = {"sync": _turn, "async": _async_turn}


def _first(led: Ledger) -> AttemptRecord:
    return led.timeline(RUN)[0]


def assert_books(led: Ledger, *, charged: Decimal, held: Decimal) -> None:
    """The Run's budget counters, and every report of its money, say the same."""
    run = led.get_run(RUN)
    assert (run.posted, run.reserved) == (charged, held)
    audit = Audit(led)
    tl = audit.timeline(RUN)
    assert (tl.total_cost, tl.held) == (charged, held)
    [tot] = [t for t in audit.costs(by="run").items if t.key == RUN]
    assert (tot.cost, tot.held) == (charged, held)
    [summary] = [r for r in audit.runs().items if r.run_id == RUN]
    assert (summary.posted, summary.reserved) == (charged, held)
    books = reconcile(led)
    assert books.ok, books.violations


def _moved_on(fakes: tuple[FakeProvider, FakeProvider]) -> bool:
    return bool(fakes[1].requests)


# -- the rows ---------------------------------------------------------------------------------


def test_cut_after_delivered_output_is_unknown_effective_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, raised = _turn(db_url, fakes, Behavior(fault=Fault.STREAM_CUT), watch=True)
    att = _first(led)
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, True, DebitState.RESERVED)
    assert att.fact is not None and att.fact.transport is not None
    assert att.fact.transport.value == "stream_cut"
    assert_books(led, charged=ZERO, held=HOLD)
    assert isinstance(raised, FailoverExhausted) and raised.reason == "output_exists"
    assert raised.partial is not None and raised.partial.text == "".join(shown) != ""
    assert not _moved_on(fakes)
    led.close()


def test_cut_with_buffered_output_is_unknown_discarded_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, raised = _turn(db_url, fakes, Behavior(fault=Fault.STREAM_CUT), watch=False)
    att = _first(led)
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, False, DebitState.RESERVED)
    assert [e.attempt_id for e in led.events(RUN, ["discarded"])] == [att.attempt_id]
    assert_books(led, charged=ZERO, held=HOLD)
    # Nobody was shown it, but the request ran: the default never resubmits unknown execution.
    assert isinstance(raised, FailoverExhausted) and raised.reason == "execution_unknown"
    assert raised.partial is None and shown == []
    assert not _moved_on(fakes)
    led.close()


def test_cut_before_any_output_is_unknown_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, raised = _turn(db_url, fakes,
                               Behavior(fault=Fault.STREAM_CUT, content_before_fault=0),
                               watch=True)
    att = _first(led)
    assert shown == []
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, False, DebitState.RESERVED)
    assert_books(led, charged=ZERO, held=HOLD)
    assert isinstance(raised, FailoverExhausted) and raised.reason == "execution_unknown"
    assert not _moved_on(fakes)
    led.close()


def test_stall_after_delivered_output_is_unknown_effective_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, raised = _turn(db_url, fakes, Behavior(fault=Fault.STALL), watch=True)
    att = _first(led)
    assert shown != []
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, True, DebitState.RESERVED)
    assert att.fact is not None and att.fact.transport is not None
    assert att.fact.transport.value == "stream_stall"
    assert_books(led, charged=ZERO, held=HOLD)
    assert isinstance(raised, FailoverExhausted) and raised.reason == "output_exists"
    assert not _moved_on(fakes)
    led.close()


def test_first_token_timeout_after_the_provider_accepted_is_unknown_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    """A 200 and then nothing before first_token_timeout_s: the provider accepted the call and
    may be running it (and billing it), so its outcome is unknown, its hold kept."""
    led, shown, raised = _turn(db_url, fakes, Behavior(fault=Fault.SLOW_FIRST_TOKEN,
                                                       delay_s=6.0), watch=True)
    att = _first(led)
    assert shown == []
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, False, DebitState.RESERVED)
    assert att.fact is not None and att.fact.transport is not None
    assert att.fact.transport.value == "first_token_timeout"
    assert_books(led, charged=ZERO, held=HOLD)
    assert isinstance(raised, FailoverExhausted) and raised.reason == "not_eligible_failure"
    assert not _moved_on(fakes)
    led.close()


def test_provider_error_event_after_delivered_output_is_failed_and_posts_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    """The contrast: the provider itself said the call failed (an error event), so it is
    ``failed``; it ran and reported no usage, so the whole hold is posted."""
    led, shown, raised = _turn(db_url, fakes, Behavior(fault=Fault.ERROR_EVENT), watch=True)
    att = _first(led)
    assert shown != []
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.FAILED, True, DebitState.POSTED)
    assert_books(led, charged=HOLD, held=ZERO)
    assert isinstance(raised, FailoverExhausted) and raised.reason == "output_exists"
    assert not _moved_on(fakes)
    led.close()


# An error event before any content is the provider refusing the request once the stream opened
# (Anthropic's overloaded_error right after message_start, Gemini's UNAVAILABLE chunk): the
# verdict its 529 or 503 would be, so the default moves on, as it does for that status.
ERROR_FIRST = ["anthropic", "gemini"]


@pytest.mark.parametrize("driver", sorted(TURNS))
@pytest.mark.parametrize("protocol", ERROR_FIRST)
def test_provider_error_event_before_any_content_is_a_verdict_and_moves_on(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], protocol: str,
        driver: str) -> None:
    led, shown, raised = TURNS[driver](
        db_url, fakes, Behavior(fault=Fault.ERROR_EVENT, content_before_fault=0),
        watch=True, protocol=protocol)
    assert raised is None
    first, second = led.timeline(RUN)
    assert (first.state, first.effective_output, first.debit_state) == (
        AttemptState.FAILED, False, DebitState.POSTED)
    assert first.fact is not None
    assert (first.fact.category, first.fact.phase, first.fact.moves_on) == (
        Category.OVERLOADED, Phase.AFTER_HEADERS, True)
    assert (second.route_id, second.state) == ("backup", AttemptState.SUCCEEDED)
    assert "".join(shown) == "Hello from the fake provider, streaming in pieces."
    assert _moved_on(fakes)
    led.close()


@pytest.mark.parametrize("driver", sorted(TURNS))
@pytest.mark.parametrize("protocol", ERROR_FIRST)
@pytest.mark.parametrize("watch", [True, False], ids=["shown", "buffered"])
def test_provider_error_event_after_some_text_stays_mid_stream_and_stops(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], protocol: str, driver: str,
        watch: bool) -> None:
    """The contrast: once an answer had begun, the same error broke it off (``mid_stream``),
    and the default neither resubmits it nor moves on, shown or only buffered."""
    led, shown, raised = TURNS[driver](
        db_url, fakes, Behavior(fault=Fault.ERROR_EVENT, content_before_fault=1),
        watch=watch, protocol=protocol)
    [att] = led.timeline(RUN)
    assert (att.state, att.effective_output) == (AttemptState.FAILED, watch)
    assert att.fact is not None
    assert (att.fact.category, att.fact.phase) == (Category.OVERLOADED, Phase.MID_STREAM)
    assert isinstance(raised, FailoverExhausted)
    assert raised.reason == ("output_exists" if watch else "execution_unknown")
    assert (shown != []) is watch
    assert not _moved_on(fakes)
    led.close()


def test_complete_answer_with_out_of_range_usage_succeeds_and_posts_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, raised = _turn(db_url, fakes, Behavior(usage=(2**63, 7)), watch=True)
    assert raised is None and "".join(shown) != ""
    att = _first(led)
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.SUCCEEDED, False, DebitState.POSTED)
    assert (att.prompt_tokens, att.completion_tokens, att.cost) == (None, None, None)
    [ev] = led.events(RUN, ["usage_invalid"])
    assert ev.attempt_id == att.attempt_id and ev.data["prompt_tokens"] == str(2**63)
    assert_books(led, charged=HOLD, held=ZERO)
    assert not _moved_on(fakes)
    led.close()


# -- cancellations (asyncio: the caller's task is cancelled) -----------------------------------


def _cancelled_turn(db_url: str, fakes: tuple[FakeProvider, FakeProvider], behavior: Behavior,
                    *, when: str) -> tuple[Ledger, list[str], BaseException]:
    """A session turn whose task is cancelled ``when``: ``text`` (from on_text, at the first
    text), ``sent`` (once the fake received the whole request, before any output) or
    ``before_send`` (after the begin committed, before the request left)."""
    fakes[0].enqueue(behavior, model="m-a")
    shown: list[str] = []

    async def main() -> BaseException:
        async with AsyncLedger.open(db_url) as led, led.run(
                RUN, secrets=SECRETS, **{**_session_args(fakes), "policy": PATIENT}) as run:
            holder: dict[str, asyncio.Task[Any]] = {}

            def on_text(text: str) -> None:
                shown.append(text)
                if when == "text":
                    holder["task"].cancel()

            task = asyncio.create_task(run.turn(ENVELOPE, on_text=on_text, reserve=HOLD))
            holder["task"] = task
            if when == "sent":
                assert await asyncio.to_thread(fakes[0].wait_for_requests, 1)
                task.cancel()
            elif when == "before_send":
                faults.arm("dispatch.before_send", lambda _n: task.cancel())
            try:
                await task
            except BaseException as e:
                return e
        raise AssertionError("the turn was not interrupted")

    try:
        err = asyncio.run(main())
    except asyncio.CancelledError as e:  # the block re-raises the cancellation
        err = e
    return Ledger.open(db_url), shown, err


def test_cancel_after_delivered_output_is_unknown_effective_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, err = _cancelled_turn(
        db_url, fakes, Behavior(fault=Fault.TRICKLE, delay_s=0.05), when="text")
    assert isinstance(err, asyncio.CancelledError) and shown != []
    att = _first(led)
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, True, DebitState.RESERVED)
    assert att.fact is not None and att.fact.category.value == "cancelled"
    assert_books(led, charged=ZERO, held=HOLD)
    assert not _moved_on(fakes)
    led.close()


def test_cancel_after_send_before_any_output_is_unknown_and_keeps_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, err = _cancelled_turn(db_url, fakes, Behavior(fault=Fault.NO_RESPONSE),
                                      when="sent")
    assert isinstance(err, asyncio.CancelledError) and shown == []
    att = _first(led)
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.UNKNOWN, False, DebitState.RESERVED)
    assert_books(led, charged=ZERO, held=HOLD)
    assert not _moved_on(fakes)
    led.close()


def test_cancel_before_send_is_not_sent_and_voids_its_hold(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    led, shown, err = _cancelled_turn(db_url, fakes, Behavior(), when="before_send")
    assert isinstance(err, asyncio.CancelledError) and shown == []
    att = _first(led)
    assert (att.state, att.effective_output, att.debit_state) == (
        AttemptState.NOT_SENT, False, DebitState.VOIDED)
    assert fakes[0].requests == []
    assert_books(led, charged=ZERO, held=ZERO)
    assert led.get_run(RUN).calls_used == 0  # the call is given back
    assert not _moved_on(fakes)
    led.close()
