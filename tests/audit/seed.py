"""A small ledger history written through the real write API, with known audit answers.

Six runs, run ``rN`` admitted at ``T0 + 100*(N-1)`` (every write of a run happens within its
100-second slot, so the activity buckets are exact):

- r1 (t1, team=search) plan A,B,C: A fails rate_limit 429 (1 s), ``move`` to B (C skipped as
  cooling), B succeeds 0.002 in 2 s (100/50 tokens, 40 of them cached and 10 reasoning; first
  byte 0.5 s, first token 1.5 s). A failover.
- r2 (t1, team=eval) plan A,B: A succeeds 0.001 (10/5) in 2 s (first byte 1 s, not streamed).
- r3 (t2, team=search) plan B,A: B fails server_error 500 (1 s), same-route ``retry``, B
  succeeds 0.003 (20/10) in 1 s (first byte 0.25 s, first token 0.5 s). Not a failover (served
  by the selected route).
- r4 (t2, no labels) plan C,A: C sent, outcome unknown after 2 s; lease released.
- r5 (no tenant) plan A: A still dispatching under a live lease.
- r6 (no tenant) plan A,C: the host called C directly (no ``move`` event); C succeeds 0.004
  (30/20) in 1 s. A failover by the served-route rule alone.

Group g3 is set unavailable by an operator until ``T0 + 10000``.
"""

from __future__ import annotations

from decimal import Decimal

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.facts import Category, CooldownEffect, FailureFact, Phase, Scope
from ledger.domain.values import Budget, Price, Profile, Route

T0 = 1_700_000_000.0

A = Route(id="A", provider="p1", model="m-a", group="g1", recipient="p1",
          profiles=[Profile(id="pa1"), Profile(id="pa2")],
          price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2)))
B = Route(id="B", provider="p2", model="m-b", group="g2", recipient="p2",
          profiles=[Profile(id="pb1")], price=Price())
C = Route(id="C", provider="p3", model="m-c", group="g3", recipient="p3", price=Price())

RATE_LIMIT = FailureFact(category=Category.RATE_LIMIT, status=429, phase=Phase.AFTER_HEADERS,
                         scope=Scope.GROUP, resubmit=True, moves_on=True,
                         cooldown=CooldownEffect.COOLDOWN, provider="p1")
SERVER_ERROR = FailureFact(category=Category.SERVER_ERROR, status=500,
                           phase=Phase.AFTER_HEADERS, scope=Scope.ROUTE, resubmit=True,
                           moves_on=True, provider="p2")
CAUSE_429 = {"category": "rate_limit", "status": 429, "scope": "group"}
BUDGET = Budget(max_calls=5, max_retries=2, max_cost=Decimal("1"))
ENV = "sha256:" + "e" * 64


def _at(clock: ManualClock, run: int, offset: float) -> None:
    clock.set(T0 + 100 * (run - 1) + offset)


def seed(url: str) -> ManualClock:
    """Write the history above into the ledger at ``url``; returns its clock (left at T0+600)."""
    clock = ManualClock(T0)
    led = Ledger.open(url, clock=clock, executor_id="exec-1")
    try:
        _seed(led, clock)
    finally:
        led.close()
    clock.set(T0 + 600)
    return clock


def _seed(led: Ledger, clock: ManualClock) -> None:
    # r1: rate limit on A, move to B, success.
    _at(clock, 1, 0)
    led.admit_run("r1", plan=[A, B, C], budget=BUDGET, tenant="t1", labels={"team": "search"})
    lease = led.acquire_lease("r1", ttl_s=1000)
    _at(clock, 1, 1)
    a1 = led.begin_attempt(lease, route="A", envelope_hash=ENV, reserve="0.01", profile_id="pa1",
                           attempt_id="r1-a1", events=[("select", {
                               "decision": "first", "route": "A", "from_route": None,
                               "profile": "pa1", "reason": "primary", "skipped": [],
                               "cause": None})])
    _at(clock, 1, 2)
    led.settle_attempt(lease, a1.attempt_id, outcome="failed", fact=RATE_LIMIT, events=[
        ("move", {"from_route": "A", "to_route": "B", "cause": CAUSE_429})])
    _at(clock, 1, 10)
    a2 = led.begin_attempt(lease, route="B", envelope_hash=ENV, reserve="0.01",
                           profile_id="pb1", kind="failover", attempt_id="r1-a2", events=[
                               ("select", {"decision": "failover", "route": "B",
                                           "from_route": "A", "profile": "pb1",
                                           "reason": "next_candidate",
                                           "skipped": [{"route": "C", "reason": "cooling",
                                                        "detail": "cooldown for 30s"}],
                                           "cause": CAUSE_429})])
    _at(clock, 1, 12)
    led.settle_attempt(lease, a2.attempt_id, outcome="succeeded", prompt_tokens=100,
                       completion_tokens=50, cost="0.002", cached_tokens=40,
                       reasoning_tokens=10, first_byte_s=0.5, first_token_s=1.5)
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)

    # r2: plain success on A.
    _at(clock, 2, 0)
    led.admit_run("r2", plan=[A, B], budget=BUDGET, tenant="t1", labels={"team": "eval"})
    lease = led.acquire_lease("r2", ttl_s=1000)
    _at(clock, 2, 1)
    att = led.begin_attempt(lease, route="A", envelope_hash=ENV, reserve="0.01",
                            profile_id="pa2", attempt_id="r2-a1")
    _at(clock, 2, 3)
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=10,
                       completion_tokens=5, cost="0.001", first_byte_s=1.0)
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)

    # r3: server error on B, same-route retry, success on B.
    _at(clock, 3, 0)
    led.admit_run("r3", plan=[B, A], budget=BUDGET, tenant="t2", labels={"team": "search"})
    lease = led.acquire_lease("r3", ttl_s=1000)
    _at(clock, 3, 1)
    att = led.begin_attempt(lease, route="B", envelope_hash=ENV, reserve="0.01",
                            attempt_id="r3-a1")
    _at(clock, 3, 2)
    led.reserve_retry(lease, {"route": "B"})
    led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=SERVER_ERROR, events=[
        ("retry", {"route": "B", "cause": {"category": "server_error", "status": 500,
                                           "scope": "route"}, "delay_s": 1.0, "n": 1})])
    _at(clock, 3, 5)
    att = led.begin_attempt(lease, route="B", envelope_hash=ENV, reserve="0.01", kind="retry",
                            attempt_id="r3-a2")
    _at(clock, 3, 6)
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=20,
                       completion_tokens=10, cost="0.003", first_byte_s=0.25, first_token_s=0.5)
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)

    # r4: sent on C, no receipt: unknown.
    _at(clock, 4, 0)
    led.admit_run("r4", plan=[C, A], budget=BUDGET, tenant="t2")
    lease = led.acquire_lease("r4", ttl_s=1000)
    _at(clock, 4, 1)
    att = led.begin_attempt(lease, route="C", envelope_hash=ENV, reserve="0.02",
                            attempt_id="r4-a1")
    _at(clock, 4, 3)
    led.settle_attempt(lease, att.attempt_id, outcome="unknown")
    led.release_lease(lease)

    # r5: still dispatching under a live lease.
    _at(clock, 5, 0)
    led.admit_run("r5", plan=[A], budget=BUDGET)
    lease = led.acquire_lease("r5", ttl_s=86_400)
    _at(clock, 5, 1)
    led.begin_attempt(lease, route="A", envelope_hash=ENV, reserve="0.03", profile_id="pa1",
                      attempt_id="r5-a1")

    # r6: served by C although A was selected, without a move event.
    _at(clock, 6, 0)
    led.admit_run("r6", plan=[A, C], budget=BUDGET)
    lease = led.acquire_lease("r6", ttl_s=1000)
    _at(clock, 6, 1)
    att = led.begin_attempt(lease, route="C", envelope_hash=ENV, reserve="0.01",
                            kind="failover", attempt_id="r6-a1")
    _at(clock, 6, 2)
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=30,
                       completion_tokens=20, cost="0.004")
    led.finish_run(lease, "succeeded")
    led.release_lease(lease)

    _at(clock, 6, 50)
    led.set_group_state("g3", "unavailable", until=T0 + 10_000, reason="operator")
