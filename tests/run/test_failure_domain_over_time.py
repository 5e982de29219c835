"""The `failure-domain` preset behaves like seed 003 over time, through the public API.

A failover that the target group's admission rejects before dispatch returns to the original
recovery; a short capacity-group floor is waited out when it is all that stands between a new
turn and its only candidates; the seed's role words never fail over.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger.api.facade import Ledger
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation
from ledger.domain.records import AttemptState, Lease
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import CapacityUnavailable, FailoverExhausted, ProviderError
from ledger.ops.audit import Audit

FREE = Price()
A = Route(id="a", provider="pa", model="m-a", group="ga", recipient="r", price=FREE)
B = Route(id="b", provider="pb", model="m-b", group="gb", recipient="r", price=FREE)
C = Route(id="c", provider="pc", model="m-c", group="gc", recipient="r", price=FREE)
GO_DS = Route(id="go-deepseek", provider="go", model="deepseek-v4", group="go", recipient="r",
              price=FREE)
GO_GLM = Route(id="go-glm", provider="go", model="glm-5", group="go", recipient="r", price=FREE)
GRANT = Grant(recipients={"r": ["user_input"]})
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)
OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal(0))
UNAVAILABLE = SendResult.failed(Observation(status=503))


class Script:
    def __init__(self, by_route: dict[str, SendResult] | None = None) -> None:
        self.by_route = by_route or {}
        self.sent: list[str] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d.route.id)
        return self.by_route.get(d.route.id, OK)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(90_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=clock) as ledger:
        yield ledger


def admit(led: Ledger, run_id: str, plan: list[Route], *, policy: Any = "failure-domain",
          role: str = "research", deadline: float | None = None, retries: int = 3) -> Lease:
    led.admit_run(run_id, plan=plan, grant=GRANT, policy=policy, role=role, deadline=deadline,
                  budget=Budget(max_calls=6, max_retries=retries, max_cost=Decimal(1)))
    return led.acquire_lease(run_id, ttl_s=3600)


# -- 9. rejected before dispatch -----------------------------------------------------------------


def _fill_group(led: Ledger, group_route: Route) -> None:
    """Another Run holds the only slot of ``group_route``'s group."""
    led.configure_group(group_route.group, max_in_flight=1)
    other = admit(led, "other", [group_route])
    led.begin_attempt(other, route=group_route.id, envelope_hash="sha256:other", reserve="0")


def test_a_failover_rejected_before_dispatch_returns_to_the_original_failure(
        led: Ledger) -> None:
    _fill_group(led, B)
    send = Script({"a": UNAVAILABLE})
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [A, B, C]), ENV, send)
    err = ei.value
    # "I -- Rejected before dispatch --> X [Return to original recovery]": no third route.
    assert err.reason == "rejected_before_dispatch" and send.sent == ["a"]
    assert isinstance(err.__cause__, ProviderError) and err.__cause__.fields["route"] == "a"
    assert [type(e) for e in err.exceptions] == [ProviderError, CapacityUnavailable]
    # b's group stayed full for the whole wait (admission.max_capacity_wait_s): the switch
    # waited in its queue, wrote no Attempt and took no retry permission.
    assert err.exceptions[1].fields["queued"] and err.exceptions[1].fields["limit"] == 1
    assert [(a.route_id, a.state) for a in led.timeline("r")] == [("a", AttemptState.FAILED)]
    assert led.get_run("r").retries_used == 0
    [wait] = [e.data for e in led.events("r", ["capacity_wait"])]
    assert wait["outcome"] == "timed_out" and wait["group"] == B.group
    assert wait["waited_s"] == pytest.approx(30.0)
    stop = led.events("r", ["stop"])[-1].data
    assert stop["reason"] == "rejected_before_dispatch" and "a" in stop["cause"]


@pytest.mark.parametrize("policy", ["goclaw", "fased"])
def test_other_presets_choose_again_after_a_rejection_and_each_switch_takes_a_permission(
        led: Ledger, policy: str) -> None:
    _fill_group(led, B)
    send = Script({"a": UNAVAILABLE})
    res = execute(led, admit(led, "r", [A, B, C], policy=policy, retries=5), ENV, send)
    assert res.route.id == "c" and "b" not in send.sent
    tl = led.timeline("r")
    # The switch to b waited in its full group's queue, past the bound: no Attempt for it.
    assert "b" not in [a.route_id for a in tl]
    assert [e.data["outcome"] for e in led.events("r", ["capacity_wait"])] == ["timed_out"]
    # Every attempt after the first (goclaw's same-route retries, the switch to c) took a
    # retry permission.
    assert led.get_run("r").retries_used == len(tl) - 1


# -- 10. a short group floor is waited out -----------------------------------------------------


def _trusted_429(led: Ledger, retry_after: int) -> float:
    """A Run on the `go` group meets a trusted 429: the group cools for Retry-After seconds."""
    send = Script({"go-deepseek": SendResult.failed(Observation(
        status=429, headers={"Retry-After": str(retry_after)}))})
    with pytest.raises(FailoverExhausted):
        execute(led, admit(led, "earlier", [GO_DS, GO_GLM]), ENV, send)
    until = led.group_projections(["go"])["go"].until
    assert until is not None
    return until


@pytest.mark.parametrize("policy", ["failure-domain", "goclaw", "fased"])
def test_a_new_run_waits_out_a_two_second_group_floor_and_dispatches(
        led: Ledger, clock: ManualClock, policy: str) -> None:
    until = _trusted_429(led, 2)
    send = Script()
    res = execute(led, admit(led, "r", [GO_DS, GO_GLM], policy=policy), ENV, send)
    assert res.route.id == "go-deepseek" and send.sent == ["go-deepseek"]
    assert clock.slept == [pytest.approx(2.0)] and clock.now() == pytest.approx(until)


def test_a_floor_beyond_the_wait_bound_stops_at_once_and_sends_nothing(
        led: Ledger, clock: ManualClock) -> None:
    _trusted_429(led, 45)  # admission.max_capacity_wait_s is 30 s
    send = Script()
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [GO_DS, GO_GLM]), ENV, send)
    assert ei.value.reason == "no_candidate" and send.sent == [] and clock.slept == []


def test_a_floor_that_ends_after_the_runs_deadline_is_not_waited(
        led: Ledger, clock: ManualClock) -> None:
    until = _trusted_429(led, 2)
    send = Script()
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [GO_DS, GO_GLM], deadline=until - 1), ENV, send)
    assert ei.value.reason == "no_candidate" and send.sent == [] and clock.slept == []


def test_after_a_trusted_429_the_same_group_is_not_waited_for(
        led: Ledger, clock: ManualClock) -> None:
    # A policy with only same-group routes "should preserve the real failure".
    send = Script({"go-deepseek": SendResult.failed(Observation(
        status=429, headers={"Retry-After": "2"}))})
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [GO_DS, GO_GLM]), ENV, send)
    assert ei.value.reason == "no_candidate" and send.sent == ["go-deepseek"]
    assert clock.slept == []


class _FailureDuringTheWait:
    """Waits through the clock; during the first wait the call another Run (under ``policy``)
    has in flight on ``route`` answers 503, which cools the route for the fleet."""

    def __init__(self, led: Ledger, clock: ManualClock, route: Route, policy: str) -> None:
        self.led, self.clock = led, clock
        self.lease = admit(led, "holder", [route], policy=policy)
        self.held: str | None = led.begin_attempt(self.lease, route=route.id, reserve="0",
                                                  envelope_hash="sha256:held").attempt_id
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        if self.held is not None:
            self.clock.advance(0.1)
            self.led.settle_attempt(self.lease, self.held, outcome="failed",
                                    observation={"status": 503})
            self.held = None
        self.clock.sleep(seconds)

    async def asleep(self, seconds: float) -> None:  # pragma: no cover - sync turns only
        self.sleep(seconds)


def test_a_turn_that_waited_out_a_group_floor_never_sends_to_a_route_that_started_cooling(
        led: Ledger, clock: ManualClock) -> None:
    # fased does not read capacity groups when it selects (failover.group_aware: false): it
    # chooses go-deepseek, and the turn waits out its group's 2 s floor (a trusted 429) before
    # the begin. During the wait another Run's 503 cools go-deepseek. The turn looks at its
    # choice again, as after a wait in a full group's queue: go-deepseek is cooling, so it
    # decides again and serves on b. Sent to go-deepseek on the old choice, its 503 would step
    # the route's cooldown to 5 min for the fleet.
    during = _FailureDuringTheWait(led, clock, GO_DS, "fased")
    _trusted_429(led, 2)
    send = Script()
    res = execute(led, admit(led, "r", [GO_DS, B], policy="fased"), ENV, send, sleeper=during)
    assert res.route.id == "b" and send.sent == ["b"]  # nothing reached go-deepseek
    assert during.waits == [pytest.approx(2.0)]
    assert [(a.route_id, a.kind.value, a.state) for a in led.timeline("r")] == [
        ("b", "first", AttemptState.SUCCEEDED)]
    assert led.get_run("r").retries_used == 0  # no permission taken for the change
    assert led.health([GO_DS.id])[GO_DS.id].error_count == 1  # the other Run's 503 only
    # The wait is recorded at once, with no Attempt, as a queue's redecided wait is.
    [wait] = led.events("r", ["wait"])
    assert wait.attempt_id is None and wait.data["for"] == "group_floor"
    assert wait.data["outcome"] == "redecided" and wait.data["route"] == GO_DS.id
    assert wait.data["group"] == "go" and wait.data["why"]["reason"] == "route_cooldown"
    assert wait.data["waited_s"] == pytest.approx(2.0)
    [select] = led.events("r", ["select"])
    assert select.data["route"] == B.id
    assert (GO_DS.id, "route_cooldown") in [(sk["route"], sk["reason"])
                                            for sk in select.data["skipped"]]
    assert [(w.kind, w.group, w.outcome, w.attempt_id) for w in Audit(led).timeline("r").waits
            ] == [("group_floor", "go", "redecided", None)]


# -- 11. the seed's role words ----------------------------------------------------------------


@pytest.mark.parametrize("role", ["diagnostic", "Diagnostics", "reviewers", "evaluation",
                                  "evals", "scheduled_task", "compaction", "context_compaction"])
def test_the_seeds_roles_never_fail_over(led: Ledger, role: str) -> None:
    send = Script({"a": UNAVAILABLE})
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, admit(led, "r", [A, B], role=role), ENV, send)
    assert ei.value.reason == "role_excluded" and send.sent == ["a"]


def test_a_research_role_fails_over(led: Ledger) -> None:
    send = Script({"a": UNAVAILABLE})
    assert execute(led, admit(led, "r", [A, B]), ENV, send).route.id == "b"


# -- decided by the brief: the selection is recorded, the route used is continued ---------------


def test_selected_route_is_the_original_choice_and_later_turns_continue_on_the_route_used(
        led: Ledger, clock: ManualClock) -> None:
    lease = admit(led, "r", [A, B])
    assert execute(led, lease, ENV, Script({"a": UNAVAILABLE}), turn_id="t1").route.id == "b"
    clock.advance(600)  # a's cooldown is long over: a default consulted again would pick it
    send = Script()
    assert execute(led, lease, ENV, send, turn_id="t2").route.id == "b" and send.sent == ["b"]
    run = led.get_run("r")
    assert (run.selected_route, run.current_route) == ("a", "b")


# -- one outage: a request in flight when the route went dark is evidence from before it -------


@pytest.mark.parametrize(("policy", "key", "reopened"), [
    ("failure-domain", "a", False),  # count_overlapping_failures: false
    ("goclaw", "provider:pa", True),  # every outcome counts, as the seed's do
])
def test_a_success_begun_before_the_route_started_cooling_does_not_reopen_it(
        led: Ledger, clock: ManualClock, policy: str, key: str, reopened: bool) -> None:
    # Run "long" sends a long request (a stream) to a. While it runs, other Runs' requests to
    # a answer 503 and a starts cooling for the fleet; then the stream completes. Under
    # failure-domain that answer is from before the outage: a keeps cooling, and the next Run
    # goes to b. Under goclaw the success clears the provider's cooldown, as its seed does.
    began: list[float] = []

    def long_stream(d: Dispatch) -> SendResult:
        began.append(clock.now())
        for n in range(3):  # three failures within 60 s: failure-domain's threshold
            clock.advance(1)
            with pytest.raises(FailoverExhausted):
                execute(led, admit(led, f"b{n}", [A], policy=policy), ENV,
                        Script({"a": UNAVAILABLE}))
        assert led.health([key])[key].error_count > 0  # a cools for the fleet
        clock.advance(5)  # the stream ends inside the cooldown
        return OK

    assert execute(led, admit(led, "long", [A], policy=policy), ENV,
                   long_stream).route.id == "a"
    health = led.health([key])[key]
    if reopened:
        assert (health.error_count, health.cooldown_until) == (0, None)
    else:
        assert health.last_failure_at is not None and began[0] < health.last_failure_at
        assert health.error_count == 1
        assert health.cooldown_until == pytest.approx(health.last_failure_at + 60)
        assert clock.now() < health.cooldown_until
    send = Script()
    assert execute(led, admit(led, "next", [A, B], policy=policy), ENV, send).route.id == (
        "a" if reopened else "b")
    assert send.sent == (["a"] if reopened else ["b"])
