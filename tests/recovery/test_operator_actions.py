"""Operator actions, deliberately (issue 27, item 6): clearing a cooldown
(``Ledger.clear_cooldown``, ``failover-ledger health clear``), closing a Run and settling an
unknown Attempt with evidence, each recorded as an event with who and why, and listed by
``Audit.actions`` / ``failover-ledger actions``; on both backends.

What each test protects: a cleared key is available to the very next turn and counts from zero,
with a ``clear_cooldown`` event keeping who, why and what was cleared; an action on something
that is not there or has nothing to clear is a typed error that records nothing; who and why
are required on the command line (``--reason``; ``--by`` defaults to ``user@host``) and never
blank in the API; the list of actions holds exactly the operators' actions (not an executor's
refused settle, which is also a ``late_receipt``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation
from ledger.domain.records import Lease, RunStatus
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import FencedOut, InvalidArgument, InvalidState, NotFound
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from ledger.storage import schema as s
from tests.storage.helpers import sql_context

FREE = Price()
A = Route(id="a", provider="pa", model="m-a", group="ga", recipient="r", price=FREE)
B = Route(id="b", provider="pb", model="m-b", group="gb", recipient="r", price=FREE)
GRANT = Grant(recipients={"r": ["user_input"]})
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)
OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal(0))
UNAVAILABLE = SendResult.failed(Observation(status=503))
HASH = "sha256:" + "e" * 64


class Script:
    def __init__(self, by_route: dict[str, SendResult] | None = None) -> None:
        self.by_route = by_route or {}
        self.sent: list[str] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d.route.id)
        return self.by_route.get(d.route.id, OK)


@pytest.fixture
def clock() -> ManualClock:
    # The command line reads the real clock: the story happens in the last hour, so the leases
    # it leaves have expired for it (a test that needs a cooldown the command line still sees
    # moves the clock ahead).
    return ManualClock(time.time() - 3600)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock, executor_id="host-1") as ledger:
        yield ledger


def admit(led: Ledger, run_id: str) -> Lease:
    led.admit_run(run_id, plan=[A, B], grant=GRANT, policy="failure-domain",
                  budget=Budget(max_calls=6, max_retries=3, max_cost=Decimal(1)))
    return led.acquire_lease(run_id, ttl_s=3600)


def cool_route_a(led: Ledger, clock: ManualClock) -> None:
    """Three Runs see route a fail (the failure-domain threshold): a cools fleet-wide."""
    for i in range(3):
        execute(led, admit(led, f"warm-{i}"), ENV, Script({"a": UNAVAILABLE}))
        clock.advance(1)
    assert not led.health(["a"])["a"].available(clock.now())


def state(led: Ledger) -> tuple[Any, ...]:
    """What an action could change: every health row, every group, the event count."""
    with sql_context(led).engine.connect() as conn:
        events = conn.execute(select(func.count()).select_from(s.events)).scalar_one()
    return (led.health(), led.group_projections(), events)


# -- clearing a cooldown -----------------------------------------------------------------------


def test_a_cleared_route_serves_the_very_next_turn_and_the_clear_is_recorded(
        led: Ledger, clock: ManualClock) -> None:
    cool_route_a(led, clock)
    before = led.health(["a"])["a"]
    skipped = Script()
    execute(led, admit(led, "while-cooling"), ENV, skipped)
    assert skipped.sent == ["b"]  # a is skipped while it cools

    ev = led.clear_cooldown("a", reason="provider says the incident is over", by="alice")
    assert (ev.kind, ev.run_id, ev.attempt_id) == ("clear_cooldown", None, None)
    assert ev.data["key"] == "a" and ev.data["kind"] == "route"
    assert (ev.data["by"], ev.data["reason"]) == ("alice", "provider says the incident is over")
    prev = ev.data["previous"]
    assert prev["status"] == "cooling" and prev["cooldown_until"] == before.cooldown_until
    assert prev["error_count"] == before.error_count >= 1
    assert prev["counted_at"] == before.counted_at is not None  # since when it was counted

    after = led.health(["a"])["a"]
    assert after.available(clock.now()) and after.error_count == 0
    assert after.failure_counts == {} and after.recent_failures == ()
    assert after.last_failure_at == before.last_failure_at  # history stays
    served = Script()
    execute(led, admit(led, "after-clear"), ENV, served)
    assert served.sent == ["a"]
    # It counts from zero: one more failure is below the threshold again, not a cooldown.
    execute(led, admit(led, "one-more"), ENV, Script({"a": UNAVAILABLE}))
    again = led.health(["a"])["a"]
    assert again.available(clock.now()) and len(again.recent_failures) == 1
    assert reconcile(led).violations == []  # an event of no Run breaks no invariant


def test_failures_below_the_threshold_can_be_cleared_too(led: Ledger) -> None:
    execute(led, admit(led, "one"), ENV, Script({"a": UNAVAILABLE}))
    assert len(led.health(["a"])["a"].recent_failures) == 1
    ev = led.clear_cooldown("a", reason="a known blip", by="alice")
    assert ev.data["previous"]["status"] == "ok"
    assert ev.data["previous"]["recent_failures"] == 1
    assert led.health(["a"])["a"].recent_failures == ()


def test_a_group_cooldown_is_cleared_as_a_group(led: Ledger, clock: ManualClock) -> None:
    led.set_group_state("ga", "cooldown", until=clock.now() + 60, reason="provider_429")
    with pytest.raises(NotFound) as ei:  # not a health key: the error says how to clear it
        led.clear_cooldown("ga", reason="the 429s stopped")
    assert "capacity group" in str(ei.value) and "group=True" in str(ei.value)
    ev = led.clear_cooldown("ga", reason="the 429s stopped", by="bob", group=True)
    assert ev.data["kind"] == "group"
    assert ev.data["previous"] == {"mode": "cooldown", "until": clock.now() + 60,
                                   "reason": "provider_429"}
    proj = led.group_projections(["ga"])["ga"]
    assert proj.mode.value == "open" and proj.until is None
    served = Script()
    execute(led, admit(led, "after"), ENV, served)
    assert served.sent == ["a"]


def test_nothing_to_clear_or_nothing_there_is_a_typed_error_that_records_nothing(
        led: Ledger, clock: ManualClock) -> None:
    execute(led, admit(led, "ok"), ENV, Script())  # a and ga exist, healthy and open
    led.configure_group("gb", max_in_flight=2)
    before = state(led)
    with pytest.raises(InvalidState) as ei:
        led.clear_cooldown("a", reason="just in case")
    assert "nothing to clear" in str(ei.value) and ei.value.fields["key"] == "a"
    with pytest.raises(InvalidState):
        led.clear_cooldown("gb", reason="just in case", group=True)
    with pytest.raises(NotFound) as ei:
        led.clear_cooldown("no-such-route", reason="typo")
    assert "failover-ledger health" in str(ei.value)
    with pytest.raises(NotFound):
        led.clear_cooldown("no-such-group", reason="typo", group=True)
    assert state(led) == before
    # A group whose waiting floor has passed is open: nothing to clear either.
    led.set_group_state("ga", "cooldown", until=clock.now() + 5, reason="provider_429")
    clock.advance(6)
    before = state(led)
    with pytest.raises(InvalidState):
        led.clear_cooldown("ga", reason="late", group=True)
    assert state(led) == before


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"key": "a", "reason": ""}, "reason"),
    ({"key": "a", "reason": "   "}, "reason"),
    ({"key": "a", "reason": "x" * 201}, "reason"),
    ({"key": "a", "reason": "line\nbreak"}, "reason"),
    ({"key": "a", "reason": 5}, "reason"),
    ({"key": "a", "reason": "ok", "by": ""}, "by"),
    ({"key": "a", "reason": "ok", "by": "  "}, "by"),
    ({"key": "", "reason": "ok"}, "key"),
    ({"key": "a", "reason": "ok", "group": "yes"}, "group"),
], ids=["empty-reason", "blank-reason", "long-reason", "control-reason", "number-reason",
        "empty-by", "blank-by", "empty-key", "group-not-bool"])
def test_bad_input_names_the_field_and_records_nothing(led: Ledger, clock: ManualClock,
                                                       kwargs: dict[str, Any],
                                                       field: str) -> None:
    cool_route_a(led, clock)
    before = state(led)
    with pytest.raises(InvalidArgument) as ei:
        led.clear_cooldown(**kwargs)
    assert ei.value.field == field
    assert state(led) == before


def test_the_async_twin_clears_the_same_way(db_url: str, led: Ledger,
                                            clock: ManualClock) -> None:
    cool_route_a(led, clock)

    async def main_() -> Any:
        async with AsyncLedger.open(db_url, clock=clock) as aled:
            with pytest.raises(NotFound):
                await aled.clear_cooldown("nope", reason="typo")
            return await aled.clear_cooldown("a", reason="incident over", by="carol")

    ev = asyncio.run(main_())
    assert ev.data["by"] == "carol" and led.health(["a"])["a"].available(clock.now())


# -- who and why on the other actions ------------------------------------------------------------


def _crashed(led: Ledger, clock: ManualClock, run_id: str) -> tuple[Lease, str]:
    """A Run whose executor sent an Attempt and died (lease expired): (lease, attempt)."""
    lease = admit(led, run_id)
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.10")
    led.renew_lease(lease, ttl_s=10)
    clock.advance(11)
    return lease, att.attempt_id


def test_close_and_settle_record_who_and_why_and_refuse_a_blank_reason(
        led: Ledger, clock: ManualClock) -> None:
    lease, attempt_id = _crashed(led, clock, "r1")
    run = led.get_run("r1")
    for bad in ("", "  "):
        with pytest.raises(InvalidArgument) as ei:
            led.close_run("r1", status="failed", reason=bad)
        assert ei.value.field == "reason"
    with pytest.raises(InvalidArgument) as ei:
        led.close_run("r1", status="failed", reason="ok", by="")
    assert ei.value.field == "by"
    assert led.get_run("r1") == run and led.events("r1", ["close"]) == []

    led.close_run("r1", status="failed", reason="host died; retried as r2", by="dave")
    [close] = led.events("r1", ["close"])
    assert (close.data["by"], close.data["reason"]) == ("dave", "host died; retried as r2")
    led.close_run("r1", status="failed")  # the same end again: nothing more recorded
    assert len(led.events("r1", ["close"])) == 1
    _, other = _crashed(led, clock, "r3")
    led.close_run("r3", status="cancelled")
    [default] = led.events("r3", ["close"])
    assert default.data["by"] == "host-1"  # the API's default: the ledger's executor_id

    with pytest.raises(InvalidArgument) as ei:
        led.settle_unknown(attempt_id, outcome="failed", note="   ")
    assert ei.value.field == "note"
    assert led.events("r1", ["late_receipt"]) == []
    led.settle_unknown(attempt_id, outcome="failed", note="console: a 500", by="erin")
    [receipt] = led.events("r1", ["late_receipt"])
    assert (receipt.data["by"], receipt.data["note"]) == ("erin", "console: a 500")
    del lease, other


def test_actions_lists_the_operators_actions_only_newest_first(
        led: Ledger, clock: ManualClock) -> None:
    cool_route_a(led, clock)
    clock.advance(1)
    led.clear_cooldown("a", reason="incident over", by="alice")
    # An executor that lost its Run settles late: kept as a late_receipt, but no one's action.
    stale, attempt_id = _crashed(led, clock, "r1")
    recover(led, release=True)
    with pytest.raises(FencedOut):
        led.settle_attempt(stale, attempt_id, outcome="succeeded", cost="0.01")
    assert len(led.events("r1", ["late_receipt"])) == 1
    clock.advance(1)
    led.close_run("r1", status="failed", reason="nobody resumes", by="bob")
    clock.advance(1)
    led.settle_unknown(attempt_id, outcome="not_sent", note="no request in the console",
                       by="carol")

    audit = Audit(led)
    page = audit.actions()
    assert [(a.kind, a.by, a.reason) for a in page.items] == [
        ("late_receipt", "carol", "no request in the console"),
        ("close", "bob", "nobody resumes"),
        ("clear_cooldown", "alice", "incident over")]
    receipt, close, clear = page.items
    assert (receipt.run_id, receipt.attempt_id) == ("r1", attempt_id)
    assert close.run_id == "r1" and close.data["previous_status"] == "running"
    assert clear.key == "a" and clear.run_id is None
    assert [a.kind for a in audit.actions(kinds=["close"]).items] == ["close"]
    assert audit.actions(since=clock.now() + 1).items == []
    # Pages of one cover the same actions once, in the same order.
    seen, cursor = [], None
    while True:
        one = audit.actions(limit=1, cursor=cursor)
        seen += one.items
        cursor = one.next_cursor
        if cursor is None:
            break
    assert seen == page.items
    for bad, field in (({"kinds": ["stop"]}, "kinds[0]"), ({"kinds": []}, "kinds"),
                       ({"kinds": "close"}, "kinds"), ({"cursor": "x|y"}, "cursor")):
        with pytest.raises(InvalidArgument) as ei:
            audit.actions(**bad)
        assert ei.value.field == field


# -- the command line ----------------------------------------------------------------------------


def usage_error(argv: list[str]) -> int:
    """The exit code of a command line argparse refuses (it exits before the command runs)."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    return int(ei.value.code or 0)


def test_health_clear_on_the_command_line(db_url: str, led: Ledger, clock: ManualClock,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    clock.set(time.time() + 600)  # cooling for the command line's real clock too
    cool_route_a(led, clock)
    led.set_group_state("ga", "unavailable", until=None, reason="operator")
    before = state(led)
    assert usage_error(["--db", db_url, "health", "clear", "a"]) == 2  # no reason
    assert "required: --reason" in capsys.readouterr().err
    assert main(["--db", db_url, "health", "clear", "a", "--reason", " "]) == 2
    assert "--reason is empty" in capsys.readouterr().err
    assert main(["--db", db_url, "health", "clear", "nope", "--reason", "typo"]) == 1
    assert "no health is recorded for key 'nope'" in capsys.readouterr().err
    assert main(["--db", db_url, "health", "clear", "ga", "--reason", "typo"]) == 1
    assert "--group" in capsys.readouterr().err
    assert state(led) == before

    assert main(["--db", db_url, "health", "clear", "a", "--reason", "incident over",
                 "--by", "alice"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cleared route a (was cooling until ") and out.rstrip().endswith(
        "by alice: incident over")
    assert main(["--db", db_url, "health", "clear", "ga", "--group", "--reason", "restored",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "clear_cooldown" and doc["data"]["kind"] == "group"
    assert "@" in doc["data"]["by"]  # who: the operating-system user @ host by default
    assert main(["--db", db_url, "health", "clear", "a", "--reason", "again"]) == 1
    assert "nothing to clear" in capsys.readouterr().err
    assert main(["--db", db_url, "health", "--json"]) == 0  # `health` alone still reports
    health = json.loads(capsys.readouterr().out)
    assert {k["key"]: k["status"] for k in health["routes"]}["a"] == "ok"

    assert main(["--db", db_url, "actions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["AT", "ACTION", "ON", "BY", "WHY"]
    assert "clear_cooldown  group ga" in lines[2] and lines[2].rstrip().endswith("restored")
    assert "clear_cooldown  route a" in lines[3] and "alice" in lines[3]
    assert main(["--db", db_url, "actions", "--kind", "close", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["items"] == []


def test_close_and_settle_need_a_reason_on_the_command_line(
        db_url: str, led: Ledger, clock: ManualClock,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, attempt_id = _crashed(led, clock, "r1")
    assert usage_error(["--db", db_url, "run", "close", "r1", "--status", "failed"]) == 2
    assert "required: --reason" in capsys.readouterr().err
    assert main(["--db", db_url, "run", "close", "r1", "--status", "failed", "--reason",
                 ""]) == 2
    assert led.get_run("r1").status is RunStatus.RUNNING
    assert main(["--db", db_url, "run", "close", "r1", "--status", "failed", "--reason",
                 "crashed", "--by", "ops"]) == 0
    assert "by ops: crashed" in capsys.readouterr().out
    assert main(["--db", db_url, "run", "show", "r1"]) == 0
    assert "by ops: crashed (running -> failed)" in capsys.readouterr().out
    assert usage_error(["--db", db_url, "attempt", "settle", attempt_id, "--outcome",
                        "failed"]) == 2
    assert "required: --reason" in capsys.readouterr().err
    assert main(["--db", db_url, "attempt", "settle", attempt_id, "--outcome", "failed",
                 "--note", "console: a 500"]) == 0  # --note is the same option
    [receipt] = led.events("r1", ["late_receipt"])
    assert receipt.data["note"] == "console: a 500" and "@" in receipt.data["by"]
