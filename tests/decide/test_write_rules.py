"""The rules behind the ledger's writes, decided without a database: what an admission freezes,
what a begin may use, what a settle records and does to holds, health and groups.

The facade only checks argument types and hands these functions' specs to the store; the tests
of the store (``tests/storage``) check that the specs are applied.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

import pytest

from ledger.decide.admission import Admission, admission_spec, admission_terms
from ledger.decide.begin import begin_spec
from ledger.decide.settle import group_update, settle_holds, settle_spec
from ledger.domain.facts import (
    Category,
    FailureFact,
    Observation,
    Phase,
    Scope,
    Source,
    Transport,
)
from ledger.domain.records import AttemptKind, DebitState, FrozenRun, Lease, Outcome
from ledger.domain.specs import AdmitSpec, BeginSpec, SettleSpec
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import InvalidArgument
from ledger.policy.load import policy_hash, preset, validate_policy

POLICY = preset("failure-domain")
OTHER = preset("goclaw")
A = Route(id="a", provider="p1", model="m1", group="g1", recipient="r1", price=Price(),
          profiles=[Profile(id="key-1")])
B = Route(id="b", provider="p2", model="m2", group="g2", recipient="r2", price=Price())
BUDGET = Budget(max_calls=4, max_retries=2, max_cost=Decimal("1"))
LEASE = Lease(run_id="run-1", executor="ex-1", fence=3, expires_at=100.0)


def frozen(plan: list[Route], grant: Grant | None = None, run_id: str = "run-1",
           policy_hash_: str | None = None) -> FrozenRun:
    return FrozenRun(
        run_id=run_id, parent_run_id=None, role="research", tenant="t", labels={},
        plan=plan, grant=grant or Grant(recipients={r.recipient: ["user_input"] for r in plan}),
        budget=BUDGET, policy=POLICY.model_dump(mode="json"),
        policy_hash=policy_hash_ or policy_hash(POLICY), selected_route=plan[0].id,
        content_hash="h", deadline=None, created_at=0.0)


# -- admission -------------------------------------------------------------------------------

def spec_of(**kw: Any) -> AdmitSpec:
    terms: dict[str, Any] = dict(plan=[A, B], budget=BUDGET, role="research",
                                 labels={"team": "x"})
    terms.update(kw)
    return admission_spec("run-1", cast(Admission, terms), plan=terms["plan"],
                          grant=Grant(recipients={"r1": ["user_input"]}), policy=POLICY,
                          policy_hash=policy_hash(POLICY))


def test_the_same_admission_content_hashes_the_same_and_any_change_differs() -> None:
    base = spec_of()
    assert spec_of().content_hash == base.content_hash
    for change in ({"labels": {"team": "y"}}, {"selected_route": "b"}, {"deadline": 5.0},
                   {"role": "writer"}, {"plan": [B, A]},
                   {"budget": BUDGET.model_copy(update={"max_calls": 5})}):
        assert spec_of(**change).content_hash != base.content_hash, change


def test_an_admission_selects_the_first_route_unless_told_and_only_from_the_plan() -> None:
    assert spec_of().selected_route == "a"
    assert spec_of(selected_route="b").selected_route == "b"
    with pytest.raises(InvalidArgument) as e:
        spec_of(selected_route="c")
    assert e.value.field == "selected_route"


def test_a_root_run_without_a_grant_may_send_its_own_input_to_its_recipients() -> None:
    pol, grant = admission_terms([A, B], None, "research", POLICY, policy_hash=policy_hash)
    assert pol is POLICY and set(grant.recipients) == {"r1", "r2"}


def test_a_child_inherits_its_parents_policy_and_may_not_name_another() -> None:
    parent = frozen([A, B])
    pol, grant = admission_terms([A], None, "research", None, policy_hash=policy_hash,
                                 parent=parent, parent_policy=POLICY)
    assert pol is POLICY and set(grant.recipients) == {"r1"}
    with pytest.raises(InvalidArgument) as e:
        admission_terms([A], None, "research", OTHER, policy_hash=policy_hash, parent=parent,
                        parent_policy=POLICY)
    assert e.value.field == "policy"


def test_a_child_is_never_broader_than_its_parent() -> None:
    parent = frozen([A])
    with pytest.raises(InvalidArgument) as e:
        admission_terms([A, B], None, "research", None, policy_hash=policy_hash,
                        parent=parent, parent_policy=POLICY)
    assert e.value.field == "plan"
    with pytest.raises(InvalidArgument) as e:
        admission_terms([A], Grant(recipients={"r1": ["private_document"]}), "research", None,
                        policy_hash=policy_hash, parent=parent, parent_policy=POLICY)
    assert e.value.field == "grant"


# -- begin -----------------------------------------------------------------------------------

def begin(**kw: Any) -> BeginSpec:
    args: dict[str, Any] = dict(
        route="a", profile_id=None, envelope_hash="env", reserve_micros=10, reserve_tokens=0,
        turn_id="turn-1", kind=AttemptKind.FIRST, attempt_id="att-1", events=[],
        take_retry=False)
    args.update(kw)
    return begin_spec(frozen([A, B]), LEASE, **args)


def test_a_begin_uses_the_frozen_snapshot_of_a_planned_route_only() -> None:
    spec = begin(route=A)
    assert spec.route == A and spec.fence == LEASE.fence
    for route in ("c", A.model_copy(update={"model": "m9"})):
        with pytest.raises(InvalidArgument) as e:
            begin(route=route)
        assert e.value.field == "route"


def test_a_begin_uses_only_the_routes_own_credential_profiles() -> None:
    assert begin(profile_id="key-1").profile_id == "key-1"
    with pytest.raises(InvalidArgument) as e:
        begin(profile_id="key-2")
    assert e.value.field == "profile_id" and "key-1" in str(e.value)
    with pytest.raises(InvalidArgument, match="has none"):
        begin(route="b", profile_id="key-1")


def test_a_begin_retried_under_a_new_fence_is_the_same_write() -> None:
    again = begin_spec(frozen([A, B]), Lease("run-1", "ex-1", 4, 100.0), route="a",
                       profile_id=None, envelope_hash="env", reserve_micros=10,
                       reserve_tokens=0, turn_id="turn-1", kind=AttemptKind.FIRST,
                       attempt_id="att-1", events=[], take_retry=False)
    assert again.begin_hash == begin().begin_hash
    assert begin(reserve_micros=11).begin_hash != again.begin_hash


# -- settle ----------------------------------------------------------------------------------

FACT_429 = FailureFact(category=Category.RATE_LIMIT, source=Source.PROVIDER,
                       phase=Phase.AFTER_HEADERS, scope=Scope.GROUP, status=429,
                       retry_after_s=7.0)


def settle(outcome: Outcome, **kw: Any) -> SettleSpec:
    args: dict[str, Any] = dict(
        fact=None, observation=None, now=50.0, effective_output=None, tool_started=None,
        prompt_tokens=None, completion_tokens=None, cost_micros=None, model_reported=None,
        output_hash=None, events=[], provenance=(), repeat=False)
    args.update(kw)
    return settle_spec(POLICY, A, None, LEASE, "att-1", outcome=outcome, **args)


def test_a_failed_settle_needs_a_fact_and_a_success_carries_none() -> None:
    with pytest.raises(InvalidArgument) as e:
        settle(Outcome.FAILED)
    assert e.value.field == "fact"
    with pytest.raises(InvalidArgument):
        settle(Outcome.SUCCEEDED, fact=FACT_429)


def test_an_observation_is_classified_under_the_runs_policy() -> None:
    spec = settle(Outcome.FAILED, observation=Observation(status=401))
    assert spec.fact is not None and spec.fact.category is Category.AUTH


def test_a_failure_before_send_is_recorded_as_not_sent() -> None:
    fact = FailureFact(category=Category.NETWORK, source=Source.LOCAL,
                       phase=Phase.BEFORE_SEND)
    assert settle(Outcome.FAILED, fact=fact).outcome is Outcome.NOT_SENT


def test_a_bare_not_sent_says_nothing_about_the_routes_health() -> None:
    assert settle(Outcome.NOT_SENT).health == {}
    assert settle(Outcome.SUCCEEDED).health


def test_a_trusted_group_429_cools_the_group_for_its_hint() -> None:
    spec = settle(Outcome.FAILED, fact=FACT_429)
    assert spec.group_update is not None and spec.group_update.until == 57.0
    assert settle(Outcome.UNKNOWN, fact=FACT_429).group_update is None


def test_a_zero_default_group_cooldown_floors_a_group_only_for_a_hinted_429() -> None:
    """0 is a choice, not a degenerate value: only the provider's own Retry-After sets a floor
    for later requests (``trust_provider_429: false`` would ignore the hinted 429 too)."""
    data = POLICY.model_dump(mode="json")
    data["admission"]["default_group_cooldown_s"] = 0
    policy = validate_policy(data, file=None)
    hinted = group_update(policy, FACT_429, 50.0)
    assert hinted is not None and hinted.until == 57.0
    bare = group_update(policy, FACT_429.model_copy(update={"retry_after_s": None}), 50.0)
    assert bare is not None and bare.until == 50.0  # not after now: the selector's floor is open
    data["admission"]["trust_provider_429"] = False
    assert group_update(validate_policy(data, file=None), FACT_429, 50.0) is None


def test_the_settle_hash_covers_the_receipt() -> None:
    one = settle(Outcome.SUCCEEDED, cost_micros=5).settle_hash
    assert settle(Outcome.SUCCEEDED, cost_micros=5).settle_hash == one
    assert settle(Outcome.SUCCEEDED, cost_micros=6).settle_hash != one
    assert settle(Outcome.SUCCEEDED, cost_micros=5,
                  provenance=("h1",)).settle_hash != one


def test_an_unknown_outcome_keeps_both_holds_and_not_sent_voids_them() -> None:
    kept = settle_holds(Outcome.UNKNOWN, None, cost_micros=None, tokens=None,
                        reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (kept.debit, kept.release_micros, kept.release_tokens) == (DebitState.RESERVED, 0, 0)
    void = settle_holds(Outcome.NOT_SENT, None, cost_micros=None, tokens=None,
                        reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (void.debit, void.posted_micros, void.uncount_call) == (DebitState.VOIDED, 0, True)


def test_a_settle_never_posts_more_than_its_hold_and_posts_all_of_it_when_unreported() -> None:
    over = settle_holds(Outcome.SUCCEEDED, None, cost_micros=500, tokens=80,
                        reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (over.posted_micros, over.tokens_used) == (100, 50)
    silent = settle_holds(Outcome.SUCCEEDED, None, cost_micros=None, tokens=None,
                          reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (silent.posted_micros, silent.tokens_used) == (100, 50)
    answered = settle_holds(Outcome.FAILED, FACT_429, cost_micros=None, tokens=None,
                            reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert answered.posted_micros == 0


def test_a_whole_2xx_body_that_is_not_the_protocols_posts_its_hold_as_an_answer_that_ran(
) -> None:
    # The provider ran the call (a 2xx came back) and may bill it; only its own error verdict
    # (a status or an error body) says nothing was generated.
    unreadable = FailureFact(category=Category.UNKNOWN, status=200, phase=Phase.AFTER_HEADERS,
                             transport=Transport.MALFORMED_EVENT)
    held = settle_holds(Outcome.FAILED, unreadable, cost_micros=None, tokens=None,
                        reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (held.debit, held.posted_micros, held.tokens_used) == (DebitState.POSTED, 100, 50)
    refused = settle_holds(Outcome.FAILED, FACT_429.model_copy(update={"status": 200}),
                           cost_micros=None, tokens=None, reserved_micros=100,
                           reserved_tokens=50, token_budget=True)
    assert (refused.posted_micros, refused.tokens_used) == (0, 0)


def test_a_failure_reported_inside_a_2xx_answer_posts_its_hold_as_an_answer_that_ran() -> None:
    # The provider accepted the request and ran it (an incomplete answer, an error object in a
    # 2xx body): without usage the hold stands in for what it bills, as for the same answer
    # streamed. A 2xx fact that does not say `accepted` (as stored before the field existed)
    # keeps the rule it was posted under.
    accepted = FailureFact(category=Category.UNKNOWN, status=200, phase=Phase.AFTER_HEADERS,
                           accepted=True)
    held = settle_holds(Outcome.FAILED, accepted, cost_micros=None, tokens=None,
                        reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (held.debit, held.posted_micros, held.tokens_used) == (DebitState.POSTED, 100, 50)
    reported = settle_holds(Outcome.FAILED, accepted, cost_micros=30, tokens=20,
                            reserved_micros=100, reserved_tokens=50, token_budget=True)
    assert (reported.posted_micros, reported.tokens_used) == (30, 20)
    before = settle_holds(Outcome.FAILED, accepted.model_copy(update={"accepted": False}),
                          cost_micros=None, tokens=None, reserved_micros=100,
                          reserved_tokens=50, token_budget=True)
    assert (before.posted_micros, before.tokens_used) == (0, 0)
