"""A recorded history for the replay tests, written by the ledger itself.

``failover-ledger generate``'s Runs (the goclaw rules: same-route retries, probes, cooldowns,
stops) and, after them, scripted Runs served by the retry owner (``execute``) under each
preset, each a decision the replay must recompute or judge: a 401 that goclaw moves on from and
failure-domain stops at (and the reverse), a trusted 429 on a shared group, a capacity group
that refuses a failover, a begin the call allowance refuses, a new turn that waits for its
group to reopen, a disclosure skip on a later turn, a credential rotation. Scenario Runs are
two hours apart, so no cooldown of one reaches the next.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from decimal import Decimal

from ledger import Budget, Envelope, FailoverExhausted, Grant, Ledger, Part, Policy, Price, Route
from ledger.api.turn import Dispatch, SendResult, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import MODEL_DERIVED, USER_INPUT
from ledger.domain.facts import Observation
from ledger.domain.values import GroupMode, Profile
from ledger.tools.generate import generate

END = 1_700_000_000.0  # the end of the generated part
START = END + 3600.0  # the first scenario Run
GAP = 7200.0
GENERATED = 300

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))


def route(rid: str, group: str, recipient: str = "r", **kw: object) -> Route:
    return Route(id=rid, provider=f"p-{rid}", model=f"m-{rid}", group=group,
                 recipient=recipient, price=PRICE, **kw)  # type: ignore[arg-type]


A, B = route("a", "ga"), route("b", "gb")
A2, B2 = route("a2", "ga2"), route("b2", "gb2")
GO_DS, GO_GLM = route("go-deepseek", "go"), route("go-glm", "go")
OFFICIAL = route("official", "official")
P1, P2 = route("p1", "gp1"), route("p2", "gp2", recipient="vendor")
ROT = route("rot", "grot", profiles=[Profile(id="rot-1"), Profile(id="rot-2")])
GRANT = Grant(recipients={"r": [USER_INPUT, MODEL_DERIVED], "vendor": [USER_INPUT]})
ENV = Envelope(parts=[Part(content="Summarise the filings.")], max_output_tokens=100)
OK = SendResult(ok=True, output="answer", prompt_tokens=10, completion_tokens=5,
                cost=Decimal("0.00002"))


def fail(**kw: object) -> SendResult:
    return SendResult.failed(Observation(**kw))  # type: ignore[arg-type]


class Script:
    """Answers per route (``route id -> result``); the rest succeed. Each call takes 1 s."""

    def __init__(self, clock: ManualClock, by_route: dict[str, SendResult] | None = None
                 ) -> None:
        self.clock = clock
        self.by_route = by_route or {}
        self.sent: list[str] = []

    def __call__(self, d: Dispatch) -> SendResult:
        self.sent.append(d.route.id)
        self.clock.advance(1.0)
        result = self.by_route.get(d.route.id, OK)
        if not result.ok:
            return result
        answer = Part(role="assistant", content=f"answer of {d.attempt_id}",
                      data_class=MODEL_DERIVED, provenance=d.attempt_id)
        return SendResult(ok=True, output=answer.content, prompt_tokens=10,
                          completion_tokens=5, cost=Decimal("0.00002"),
                          output_hash=answer.content_hash, parts=(answer,))


class Recorder:
    """Runs scripted Runs on the ledger, one every two hours."""

    def __init__(self, led: Ledger, clock: ManualClock) -> None:
        self.led = led
        self.clock = clock
        self.at = START
        self.runs: dict[str, list[str]] = {}

    def run(self, tenant: str, plan: list[Route], policy: Policy | str,
            turns: list[dict[str, SendResult]], *, budget: Budget | None = None,
            before: Callable[[], None] | None = None) -> str:
        n = len(self.runs.get(tenant, []))
        run_id = f"{tenant}-{n}"
        self.runs.setdefault(tenant, []).append(run_id)
        self.clock.set(self.at)
        self.at += GAP
        if before is not None:
            before()
        led = self.led
        led.admit_run(run_id, plan=plan, grant=GRANT, policy=policy, tenant=tenant,
                      budget=budget or Budget(max_calls=6, max_retries=4,
                                              max_cost=Decimal(1)))
        lease = led.acquire_lease(run_id, ttl_s=7200)
        conversation: list[Part] = []
        status = "succeeded"
        for i, script in enumerate(turns):
            question = Part(content=f"question {i} of {run_id}")
            env = Envelope(parts=[*conversation, question], max_output_tokens=100)
            try:
                res = execute(led, lease, env, Script(self.clock, script),
                              turn_id=f"turn-{i + 1}", rng=random.Random(i))
            except FailoverExhausted:
                status = "failed"
                break
            conversation += [question, *res.parts]
        led.finish_run(lease, status)
        led.release_lease(lease)
        return run_id


@contextlib.contextmanager
def _held_slot(led: Ledger, plan: list[Route], group_route: Route, run_id: str
               ) -> Iterator[None]:
    """Another Run holds the only slot of ``group_route``'s group for a while."""
    led.configure_group(group_route.group, max_in_flight=1)
    led.admit_run(run_id, plan=plan, grant=GRANT, policy="failure-domain", tenant="holder",
                  budget=Budget(max_calls=2, max_retries=0, max_cost=Decimal(1)))
    lease = led.acquire_lease(run_id, ttl_s=10 * GAP)
    att = led.begin_attempt(lease, route=group_route.id, envelope_hash="sha256:held",
                            reserve="0")
    yield
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)


def record(led: Ledger, clock: ManualClock) -> dict[str, list[str]]:
    """Write the history; returns the scenario Runs' ids by tenant."""
    generate(led, attempts=GENERATED, days=1, end=END, seed=3)
    rec = Recorder(led, clock)
    denied, unavailable = fail(status=401), fail(status=503)
    for _ in range(3):  # goclaw moves on after a 401; failure-domain stops
        rec.run("auth", [A, B], "goclaw", [{"a": denied}])
    for _ in range(3):  # failure-domain stops after a 401; goclaw moves on
        rec.run("fd-stop", [A2, B2], "failure-domain", [{"a2": denied}])
    for _ in range(5):  # b2 serves: the evidence a replay estimates it from
        rec.run("fd-ok", [A2, B2], "failure-domain", [{"a2": unavailable}])
    throttled = fail(status=429, headers={"Retry-After": "5"})
    for _ in range(3):  # goclaw moves to the same group's go-glm; failure-domain skips it
        rec.run("go", [GO_DS, GO_GLM, OFFICIAL], "goclaw", [{"go-deepseek": throttled}])
    for _ in range(3):
        rec.run("official", [OFFICIAL], "goclaw", [{}])
    # failure-domain: a failover its capacity group refuses stops the turn; fased chooses again.
    with _held_slot(led, [B], B, "holder-0"):
        rec.run("rejected", [A, B, OFFICIAL], "failure-domain", [{"a": unavailable}])
    with _held_slot(led, [B], B, "holder-1"):
        rec.run("rejected", [A, B, OFFICIAL], "fased", [{"a": unavailable}])
    # The call allowance refuses the failover's begin.
    rec.run("allowance", [A, B], "failure-domain", [{"a": unavailable}],
            budget=Budget(max_calls=1, max_retries=3, max_cost=Decimal(1)))
    # A new turn waits for its only group to reopen.
    rec.run("reopen", [A], "failure-domain", [{}],
            before=lambda: led.set_group_state("ga", GroupMode.COOLDOWN,
                                               until=clock.now() + 10, reason="operator"))
    # The second turn carries the first's answer: p2's recipient may not receive it.
    rec.run("disclosure", [P1, P2], "failure-domain", [{}, {"p1": unavailable}])
    # fased rotates the credential before the model.
    rec.run("rotate", [ROT, B], "fased", [{"rot": fail(status=429)}])
    return rec.runs


__all__ = ["END", "GENERATED", "START", "record"]
