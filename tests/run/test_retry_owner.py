"""The retry owner end to end on both backends, with scripted send functions and a manual clock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import Dispatch, Notice, SendResult, aexecute, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Observation, Transport, WireProtocol
from ledger.domain.records import AttemptKind, AttemptState, DebitState, Lease
from ledger.domain.values import Budget, Grant, GroupMode, Price, Route
from ledger.errors import FailoverExhausted, ProviderError

GO_DS = Route(id="go-deepseek", provider="go", model="deepseek-v4", group="go",
              recipient="go-gateway", price=Price(input_per_mtok=Decimal(1),
                                                  output_per_mtok=Decimal(2)))
GO_GLM = Route(id="go-glm", provider="go", model="glm-5", group="go", recipient="go-gateway",
               price=Price())
OFFICIAL = Route(id="official-deepseek", provider="deepseek", model="deepseek-v4",
                 group="deepseek-official", recipient="deepseek", price=Price())
PLAN = [GO_DS, GO_GLM, OFFICIAL]
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=200)


class Script:
    """A send function that answers per route from a queue; records every dispatch."""

    def __init__(self, **by_route: list[SendResult]) -> None:
        self.queues = {k.replace("_", "-"): list(v) for k, v in by_route.items()}
        self.sent: list[Dispatch] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d)
        q = self.queues.get(d.route.id) or [OK]
        return q.pop(0) if len(q) > 1 else q[0]


OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal("0.001"), model_reported="served-model")


def fail(**kw: object) -> SendResult:
    return SendResult.failed(Observation(**kw))  # type: ignore[arg-type]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(50_000.0)


@pytest.fixture
def led(db_url: str, clock: ManualClock) -> Iterator[Ledger]:
    ledger = Ledger.open(db_url, clock=clock)
    yield ledger
    ledger.close()


def admit(led: Ledger, run_id: str = "r", policy: str = "failure-domain",
          retries: int = 3, calls: int = 6, grant: Grant | None = None,
          role: str = "research", plan: list[Route] | None = None) -> Lease:
    led.admit_run(run_id, plan=plan or PLAN,
                  budget=Budget(max_calls=calls, max_retries=retries, max_cost=Decimal("1")),
                  grant=grant or Grant(recipients={"go-gateway": ["user_input"],
                                                   "deepseek": ["user_input"]}),
                  policy=policy, role=role)
    return led.acquire_lease(run_id)


def test_503_with_healthy_group_moves_to_next_model(led: Ledger) -> None:
    lease = admit(led)
    send = Script(go_deepseek=[fail(status=503, body="Service Unavailable")])
    res = execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert res.route.id == "go-glm" and res.output == "answer" and res.switched
    tl = led.timeline("r")
    assert [(a.route_id, a.state, a.kind) for a in tl] == [
        ("go-deepseek", AttemptState.FAILED, AttemptKind.FIRST),
        ("go-glm", AttemptState.SUCCEEDED, AttemptKind.FAILOVER),
    ]
    assert tl[0].debit_id != tl[1].debit_id and tl[0].category == "overloaded"
    assert [d.route.id for d in send.sent] == ["go-deepseek", "go-glm"]
    run = led.get_run("r")
    assert run.retries_used == 1 and run.calls_used == 2 and run.selected_route == "go-deepseek"
    assert run.current_route == "go-glm"
    kinds = [e.kind for e in led.events("r")]
    assert kinds.count("select") == 2 and "move" in kinds


def test_trusted_429_cools_group_and_skips_same_group(led: Ledger, clock: ManualClock) -> None:
    lease = admit(led)
    send = Script(go_deepseek=[fail(status=429, headers={"Retry-After": "30"},
                                    body="rate limited")])
    res = execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert res.route.id == "official-deepseek"
    g = led.group_projections(["go"])["go"]
    assert g.mode is GroupMode.COOLDOWN and g.until == clock.now() + 30
    select_events = [e for e in led.events("r", ["select"])]
    skipped = {s["route"]: s["reason"] for s in select_events[-1].data["skipped"]}
    assert skipped["go-glm"] == "same_group_unavailable"
    assert clock.slept == []  # crossing groups does not inherit the old Retry-After


def test_goclaw_retries_overload_on_same_route_then_moves(led: Ledger, clock: ManualClock
                                                          ) -> None:
    lease = admit(led, policy="goclaw", retries=5, calls=8)
    send = Script(go_deepseek=[fail(status=503, body="overloaded")])
    res = execute(led, lease, ENV, send, rng=random.Random(7))  # type: ignore[arg-type]
    # The cooldown belongs to the provider: go-glm (provider `go` too) cools with go-deepseek.
    assert res.route.id == "official-deepseek"
    tl = led.timeline("r")
    assert [a.route_id for a in tl] == ["go-deepseek"] * 3 + ["official-deepseek"]
    assert [a.kind for a in tl[:3]] == [AttemptKind.FIRST, AttemptKind.RETRY, AttemptKind.RETRY]
    assert len({a.debit_id for a in tl}) == 4
    assert len(clock.slept) == 2
    assert 1.6 <= clock.slept[0] <= 2.4 and 4.8 <= clock.slept[1] <= 7.2
    assert led.get_run("r").retries_used == 3
    go = led.health(["provider:go"])["provider:go"]
    assert go.cooldown_until is not None and go.error_count == 1


def test_401_stops_with_every_error(led: Ledger) -> None:
    lease = admit(led)
    send = Script(go_deepseek=[fail(status=401, body="Unauthorized")])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    err = ei.value
    assert err.reason == "not_eligible_failure" and len(err.exceptions) == 1
    assert isinstance(err.exceptions[0], ProviderError)
    assert err.exceptions[0].fields["fact"]["category"] == "auth"
    assert len(send.sent) == 1 and led.get_run("r").retries_used == 0


def test_no_retry_permission_stops(led: Ledger) -> None:
    lease = admit(led, retries=0)
    send = Script(go_deepseek=[fail(status=503)])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "retry_allowance" and len(send.sent) == 1


def test_call_allowance_bounds_the_loop(led: Ledger) -> None:
    lease = admit(led, calls=2, retries=9)
    send = Script(go_deepseek=[fail(status=503)], go_glm=[fail(status=502)])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "retry_allowance" and len(send.sent) == 2
    assert led.get_run("r").calls_used == 2


def test_every_route_failing_raises_group_of_all_errors(led: Ledger) -> None:
    lease = admit(led)
    send = Script(go_deepseek=[fail(status=503)], go_glm=[fail(status=500)],
                  official_deepseek=[fail(status=502)])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    err = ei.value
    assert err.reason == "no_candidate" and len(err.exceptions) == 3
    assert len(err.attempts) == 3 and "go/deepseek-v4" in str(err)


def test_read_timeout_is_unknown_and_never_resubmitted_by_default(led: Ledger) -> None:
    lease = admit(led)
    send = Script(go_deepseek=[fail(transport=Transport.READ_TIMEOUT)])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "execution_unknown"
    (att,) = led.timeline("r")
    assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
    assert led.get_run("r").reserved == att.reserved and len(send.sent) == 1


def test_goclaw_resubmits_after_timeout_as_new_attempt(led: Ledger, clock: ManualClock) -> None:
    lease = admit(led, policy="goclaw")
    send = Script(go_deepseek=[fail(transport=Transport.READ_TIMEOUT), OK])
    res = execute(led, lease, ENV, send)  # type: ignore[arg-type]
    tl = led.timeline("r")
    assert res.route.id == "go-deepseek" and clock.slept == [0.5]
    assert [a.state for a in tl] == [AttemptState.UNKNOWN, AttemptState.SUCCEEDED]
    assert tl[0].debit_state is DebitState.RESERVED  # the unknown one keeps its hold


def test_goclaw_discards_streamed_text_and_tells_the_caller(led: Ledger) -> None:
    lease = admit(led, policy="goclaw")
    notices: list[Notice] = []
    send = Script(go_deepseek=[fail(transport=Transport.STREAM_CUT, effective_output=True)])
    res = execute(led, lease, ENV, send, on_notice=notices.append)  # type: ignore[arg-type]
    assert res.route.id == "official-deepseek"
    assert [d.route.id for d in send.sent] == ["go-deepseek", "official-deepseek"]
    assert notices and notices[0].kind == "reset" and res.resets == 1


def test_default_never_moves_after_effective_output(led: Ledger) -> None:
    lease = admit(led)
    send = Script(go_deepseek=[fail(status=503, phase="mid_stream", effective_output=True)])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "output_exists" and len(send.sent) == 1


def test_disclosure_skips_unapproved_recipient(led: Ledger) -> None:
    lease = admit(led, grant=Grant(recipients={"go-gateway": ["user_input"]}))
    send = Script(go_deepseek=[fail(status=429, headers={"Retry-After": "5"})])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "no_candidate"
    skipped = {s["route"]: s["reason"] for s in ei.value.fields["skipped"]}
    assert skipped == {**skipped, "go-glm": "same_group_unavailable",
                       "official-deepseek": "disclosure"}
    assert [d.route.id for d in send.sent] == ["go-deepseek"]


def test_next_turn_keeps_the_route_actually_used(led: Ledger) -> None:
    lease = admit(led)
    execute(led, lease, ENV, Script(go_deepseek=[fail(status=503)]),  # type: ignore[arg-type]
            turn_id="t1")
    send = Script()
    res = execute(led, lease, ENV, send, turn_id="t2")  # type: ignore[arg-type]
    assert res.route.id == "go-glm" and [d.route.id for d in send.sent] == ["go-glm"]


def test_evaluation_role_never_fails_over(led: Ledger) -> None:
    lease = admit(led, role="evaluation")
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, Script(go_deepseek=[fail(status=503)]))  # type: ignore[arg-type]
    assert ei.value.reason == "role_excluded"


def test_async_twin(db_url: str) -> None:
    async def go() -> None:
        aled = await AsyncLedger.open(db_url, clock=ManualClock(1000.0))
        await aled.admit_run("ar", plan=PLAN, budget=Budget(max_calls=4, max_retries=2,
                                                            max_cost=Decimal(1)))
        lease = await aled.acquire_lease("ar")

        async def send(d: Dispatch) -> SendResult:
            if d.route.id == "go-deepseek":
                return fail(status=503, protocol=WireProtocol.OPENAI)
            return OK

        res = await aexecute(aled, lease, ENV, send)
        assert res.route.id == "go-glm"
        assert [a.route_id for a in await aled.timeline("ar")] == ["go-deepseek", "go-glm"]
        await aled.close()

    asyncio.run(go())


def test_a_group_full_past_the_wait_bound_writes_no_attempt_and_the_next_group_serves(
        led: Ledger, clock: ManualClock) -> None:
    led.configure_group("go", max_in_flight=1)
    led.admit_run("other", plan=PLAN, budget=Budget(max_calls=2, max_retries=0,
                                                    max_cost=Decimal("1")))
    other = led.acquire_lease("other", ttl_s=3600)
    led.begin_attempt(other, route="go-glm", envelope_hash="sha256:x", reserve="0")  # holds go
    admit(led)
    lease = led.acquire_lease("r", ttl_s=3600)
    send = Script()
    res = execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert res.route.id == "official-deepseek"
    # The turn waited in go's queue for the policy's whole bound, then moved on; the wait left
    # no rejected Attempt behind, only its record.
    assert clock.slept == [pytest.approx(30.0)]
    assert [(a.route_id, a.state) for a in led.timeline("r")] == [
        ("official-deepseek", AttemptState.SUCCEEDED)]
    [wait] = led.events("r", ["capacity_wait"])
    assert wait.data["outcome"] == "timed_out" and wait.data["group"] == "go"
    assert [d.route.id for d in send.sent] == ["official-deepseek"]  # nothing sent on "go"
    assert led.get_run("r").calls_used == 1


def test_waiting_floor_inside_deadline_is_waited_beyond_it_rejected(
        led: Ledger, clock: ManualClock) -> None:
    # goclaw is not group-aware: it picks the cooling group's route, so admission's own
    # waiting floor applies at dispatch.
    lease = admit(led, policy="goclaw")
    led.set_group_state("go", "cooldown", until=clock.now() + 12, reason="test")
    res = execute(led, lease, ENV, Script())  # type: ignore[arg-type]
    assert res.route.id == "go-deepseek" and clock.slept == [12]
    led.admit_run("late", plan=PLAN, budget=Budget(max_calls=4, max_retries=2,
                                                   max_cost=Decimal(1)),
                  policy="goclaw", deadline=clock.now() + 5)
    late = led.acquire_lease("late")
    led.set_group_state("go", "cooldown", until=clock.now() + 60, reason="test")
    res = execute(led, late, ENV, Script())  # type: ignore[arg-type]
    assert res.route.id == "official-deepseek" and clock.slept == [12]  # no wait past deadline
    assert [a.state for a in led.timeline("late")] == [
        AttemptState.REJECTED, AttemptState.REJECTED, AttemptState.SUCCEEDED]


def test_group_aware_new_turn_avoids_a_cooling_group(led: Ledger, clock: ManualClock) -> None:
    lease = admit(led)
    led.set_group_state("go", "cooldown", until=clock.now() + 12, reason="test")
    res = execute(led, lease, ENV, Script())  # type: ignore[arg-type]
    assert res.route.id == "official-deepseek" and clock.slept == []


def test_current_denial_applies_to_new_attempts(led: Ledger) -> None:
    from ledger.decide.preflight import Denials

    lease = admit(led)
    send = Script(go_deepseek=[fail(status=503)])
    res = execute(led, lease, ENV, send,  # type: ignore[arg-type]
                  denials=Denials(routes=frozenset({"go-glm"})))
    assert res.route.id == "official-deepseek"
    sel = led.events("r", ["select"])[-1].data
    assert {s["route"]: s["reason"] for s in sel["skipped"]}["go-glm"] == "not_qualified"


def test_model_derived_context_needs_recorded_provenance(led: Ledger) -> None:
    from ledger.domain.envelope import MODEL_DERIVED

    lease = admit(led, grant=Grant(recipients={"go-gateway": ["user_input", MODEL_DERIVED],
                                               "deepseek": ["user_input", MODEL_DERIVED]}))
    answer = Part(role="assistant", content="answer", data_class=MODEL_DERIVED)
    answered = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                          cost=Decimal("0.001"), parts=(answer,))
    # The settle records the answer's parts as the Attempt's provenance.
    first = execute(led, lease, ENV, lambda d: answered, turn_id="t1")  # type: ignore[arg-type]
    good = answer.model_copy(update={"provenance": first.attempt.attempt_id})
    assert good.content_hash in led.provenance("r")[first.attempt.attempt_id]
    env = Envelope(parts=[*ENV.parts, good, Part(content="go on")])
    send = Script(go_deepseek=[fail(status=503)])
    res = execute(led, lease, env, send, turn_id="t2")  # type: ignore[arg-type]
    assert res.route.id == "go-glm"
    # A tampered copy (edited content, same provenance ref) is not covered: no switch.
    bad = good.model_copy(update={"content": "answer, edited"})
    env = Envelope(parts=[*ENV.parts, bad, Part(content="go on")])
    send = Script(go_glm=[fail(status=503)])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, env, send, turn_id="t3")  # type: ignore[arg-type]
    reasons = {s["route"]: s["reason"] for s in ei.value.fields["skipped"]}
    assert "disclosure" in reasons.values()


def test_a_tampered_part_is_never_covered_by_hashes_the_caller_supplies(led: Ledger) -> None:
    """Invariant 7 through ``execute``: coverage is judged by hashes the ledger computes. A
    list of hashes from the caller (a stale cache, say) is refused before anything is written,
    and a memo kept across turns hashes an edited copy afresh, so nothing is sent."""
    from ledger.domain.envelope import MEMORY, PartHashes
    from ledger.errors import InvalidArgument

    lease = admit(led, grant=Grant(recipients={"go-gateway": ["user_input", MEMORY],
                                               "deepseek": ["user_input", MEMORY]}))
    mem = Part(content="Client holds 12,000 ACME.", data_class=MEMORY, provenance="mem-42")
    led.record_provenance(lease, "mem-42", mem.content_hash, "memory")
    hashes = PartHashes()
    send = Script()
    res = execute(led, lease, Envelope(parts=[*ENV.parts, mem]), send,  # type: ignore[arg-type]
                  turn_id="t1", part_hashes=hashes)
    assert res.route.id == "go-deepseek" and len(send.sent) == 1
    tampered = mem.model_copy(update={"content": "Client holds 999,999 ACME."})
    env = Envelope(parts=[*ENV.parts, tampered])
    with pytest.raises(InvalidArgument) as bad:
        execute(led, lease, env, send, turn_id="t2",  # type: ignore[arg-type]
                part_hashes=[p.content_hash for p in ENV.parts] + [mem.content_hash])
    assert bad.value.field == "part_hashes"
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, env, send, turn_id="t3", part_hashes=hashes)  # type: ignore[arg-type]
    assert set(s["reason"] for s in ei.value.fields["skipped"]) == {"disclosure"}
    assert len(send.sent) == 1  # the tampered request never left
    assert [a.turn_id for a in led.timeline(lease.run_id)] == ["t1"]


def test_a_send_that_says_it_sent_is_never_recorded_not_sent(led: Ledger) -> None:
    """A host's failure evidence that says nothing of how far the request got (no status,
    phase or transport) defaulted to "never left", though the send said it left: the call was
    voided and given back. It is unknown now, its hold kept, never sent again."""
    lease = admit(led)
    send = Script(go_deepseek=[SendResult.failed(Observation(message="the gateway said no"))])
    with pytest.raises(FailoverExhausted) as ei:
        execute(led, lease, ENV, send)  # type: ignore[arg-type]
    assert ei.value.reason == "execution_unknown" and len(send.sent) == 1
    [att] = led.timeline(lease.run_id)
    assert att.state is AttemptState.UNKNOWN and att.debit_state is DebitState.RESERVED
    assert led.get_run(lease.run_id).calls_used == 1


def test_child_keeps_its_actual_route_and_siblings_are_not_rerun(led: Ledger) -> None:
    parent = admit(led, run_id="p", calls=12, retries=6)
    led.admit_run("c1", plan=PLAN, budget=Budget(max_calls=3, max_retries=2,
                                                 max_cost=Decimal("0.2")),
                  grant=Grant(recipients={"go-gateway": ["user_input"],
                                          "deepseek": ["user_input"]}),
                  parent=parent)
    led.admit_run("c2", plan=PLAN[1:], budget=Budget(max_calls=3, max_retries=2,
                                                     max_cost=Decimal("0.2")),
                  grant=Grant(recipients={"deepseek": ["user_input"]}),
                  parent=parent)
    l1, l2 = led.acquire_lease("c1"), led.acquire_lease("c2")
    done = execute(led, l2, ENV, Script(go_glm=[fail(status=503)]))  # type: ignore[arg-type]
    assert done.route.id == "official-deepseek"  # go-glm is not approved for c2's grant
    sibling_before = led.timeline("c2")
    r1 = execute(led, l1, ENV, Script(go_deepseek=[fail(status=503)]))  # type: ignore[arg-type]
    assert r1.route.id == "go-glm"
    send = Script()
    again = execute(led, l1, ENV, send, turn_id="t2")  # type: ignore[arg-type]
    assert again.route.id == "go-glm" and [d.route.id for d in send.sent] == ["go-glm"]
    assert led.timeline("c2") == sibling_before  # the sibling's completed work is untouched
    p = led.get_run("p")
    assert p.carved == Decimal("0.4") and p.calls_left == 6


def test_one_log_line_per_retry_and_per_move(led: Ledger, caplog: pytest.LogCaptureFixture
                                              ) -> None:
    lease = admit(led, policy="goclaw", retries=5, calls=8)
    caplog.set_level("INFO", logger="ledger.run")
    execute(led, lease, ENV, Script(go_deepseek=[fail(status=503, body="overloaded")]),  # type: ignore[arg-type]
            rng=random.Random(1))
    lines = [r.getMessage() for r in caplog.records if r.name == "ledger.run"]
    retries = [m for m in lines if m.startswith("[LLM] go:deepseek-v4: overloaded; retry")]
    moves = [m for m in lines if m.startswith("[fallback] serving the request with "
                                              "deepseek/deepseek-v4 (go/deepseek-v4: 503 "
                                              "overloaded)")]
    assert len(retries) == 2 and len(moves) == 1 and len(lines) == 3


def test_floor_longer_than_the_policy_wait_is_not_waited(led: Ledger, clock: ManualClock) -> None:
    # goclaw's admission waits at most max_capacity_wait_s (30 s) for a group's floor.
    lease = admit(led, policy="goclaw")
    led.set_group_state("go", "cooldown", until=clock.now() + 45, reason="test")
    res = execute(led, lease, ENV, Script())  # type: ignore[arg-type]
    assert res.route.id == "official-deepseek" and clock.slept == []
    assert [a.state for a in led.timeline("r")] == [
        AttemptState.REJECTED, AttemptState.REJECTED, AttemptState.SUCCEEDED]
