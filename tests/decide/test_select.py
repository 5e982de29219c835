"""The selector: stop reasons, the walk, candidate checks, probes, profile rotation, new turns.

Failure facts are built directly (the classifier has its own tests), so these tests pin the
selector's reading of fact + policy fields, not classification.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.decide.preflight import Coverage, Denials, PartNeed, RequestNeeds
from ledger.decide.profiles import Pin
from ledger.decide.select import (
    Decision,
    DecisionKind,
    Reason,
    RunPermissions,
    SelectionInput,
    recheck,
    select,
)
from ledger.domain.envelope import MODEL_DERIVED, USER_INPUT, Envelope, Part
from ledger.domain.facts import Category, FailureFact, Phase, Scope, Source, Transport
from ledger.domain.values import (
    Capabilities,
    Grant,
    GroupMode,
    GroupProjection,
    Health,
    Profile,
    ProfileType,
    Route,
)
from ledger.errors import InvalidArgument
from ledger.policy.load import preset
from ledger.policy.model import Policy

NOW = 1000.0

GO_DEEPSEEK = Route(
    id="go-deepseek",
    provider="go",
    model="deepseek-v4",
    group="go",
    recipient="go-gateway",
    capabilities=Capabilities(tools=True, context_window=128_000),
)
GO_GLM = Route(
    id="go-glm",
    provider="go",
    model="glm-5",
    group="go",
    recipient="go-gateway",
    capabilities=Capabilities(tools=True, context_window=200_000),
)
OFFICIAL = Route(
    id="official-deepseek",
    provider="deepseek",
    model="deepseek-v4",
    group="deepseek-official",
    recipient="deepseek",
    capabilities=Capabilities(tools=True, context_window=64_000),
)
PLAN = (GO_DEEPSEEK, GO_GLM, OFFICIAL)
FD = preset("failure-domain")
GOCLAW = preset("goclaw")
FASED = preset("fased")


def tune(policy: Policy, section: str = "failover", **kw: Any) -> Policy:
    """A copy of ``policy`` with fields of one section changed."""
    sec = getattr(policy, section).model_copy(update=kw)
    return policy.model_copy(update={section: sec})


# goclaw's probe and last-candidate rules on the routes' own health rows: goclaw keys health
# by provider, and PLAN's two `go` routes would share one row.
GOCLAW_ROUTES = tune(GOCLAW, "health", key="route")


def fact(
    category: Category = Category.OVERLOADED,
    *,
    status: int | None = 503,
    phase: Phase = Phase.AFTER_HEADERS,
    scope: Scope = Scope.ROUTE,
    moves_on: bool = True,
    resubmit: bool = True,
    **kw: Any,
) -> FailureFact:
    return FailureFact(
        category=category,
        status=status,
        phase=phase,
        scope=scope,
        moves_on=moves_on,
        resubmit=resubmit,
        **kw,
    )


F503 = fact()
F429 = fact(Category.RATE_LIMIT, status=429, scope=Scope.GROUP)
FDNS = fact(
    Category.DNS,
    status=None,
    phase=Phase.BEFORE_SEND,
    scope=Scope.GROUP,
    transport=Transport.DNS_FAILURE,
)

OPEN = {
    "go": GroupProjection(group="go", mode=GroupMode.OPEN, sampled_at=998),
    "deepseek-official": GroupProjection(
        group="deepseek-official", mode=GroupMode.OPEN, sampled_at=998
    ),
}


def inp(**kw: Any) -> SelectionInput:
    """A failure of go-deepseek under failure-domain, everything else open; override by kw."""
    base: dict[str, Any] = {
        "plan": PLAN,
        "permissions": RunPermissions(
            retries_left=3, calls_left=6, tried=frozenset({"go-deepseek"})
        ),
        "policy": FD,
        "now": NOW,
        "groups": OPEN,
        "current": "go-deepseek",
        "failure": F503,
    }
    base.update(kw)
    return SelectionInput(**base)


def run(**kw: Any) -> Decision:
    return select(inp(**kw))


def skipped(d: Decision) -> dict[str, Reason]:
    """Route id -> the first reason it was skipped for (profile skips included)."""
    out: dict[str, Reason] = {}
    for s in d.skipped:
        out.setdefault(s.route, s.reason)
    return out


def chosen(d: Decision) -> str | None:
    assert d.kind is not DecisionKind.STOP, d.to_json()
    return d.route_id


def stopped(d: Decision) -> Reason:
    assert d.kind is DecisionKind.STOP, d.to_json()
    assert d.reason is not None
    return d.reason


# -- stop reasons, in order -----------------------------------------------------------------------


def test_failover_disabled() -> None:
    assert stopped(run(policy=tune(FD, enabled=False))) is Reason.FAILOVER_DISABLED


@pytest.mark.parametrize(
    "role", ["evaluation", "reviewer", "compaction", "diagnostics", "scheduled"]
)
def test_excluded_roles(role: str) -> None:
    assert stopped(run(role=role)) is Reason.ROLE_EXCLUDED


def test_excluded_roles_come_from_policy() -> None:
    policy = tune(FD, excluded_roles=["batch"])
    assert stopped(run(role="batch", policy=policy)) is Reason.ROLE_EXCLUDED
    assert chosen(run(role="evaluation", policy=policy)) == "go-glm"


def test_tool_started_always_stops_even_when_output_is_discarded() -> None:
    f = fact(tool_started=True)
    assert stopped(run(failure=f)) is Reason.OUTPUT_EXISTS
    discard = tune(FD, after_effective_output="discard")
    assert stopped(run(failure=f, policy=discard)) is Reason.OUTPUT_EXISTS


def test_effective_output_stops_unless_the_policy_discards_it() -> None:
    f = fact(effective_output=True, phase=Phase.MID_STREAM, moves_on=True, resubmit=True)
    assert stopped(run(failure=f)) is Reason.OUTPUT_EXISTS
    discard = tune(FD, after_effective_output="discard")
    assert chosen(run(failure=f, policy=discard)) == "go-glm"


@pytest.mark.parametrize("phase", [Phase.AFTER_SEND, Phase.MID_STREAM])
def test_execution_unknown(phase: Phase) -> None:
    f = fact(Category.TIMEOUT, status=None, phase=phase, moves_on=True, resubmit=False)
    assert stopped(run(failure=f)) is Reason.EXECUTION_UNKNOWN
    allowed = tune(FD, resubmit_unknown_execution=True)
    assert chosen(run(failure=f, policy=allowed)) == "go-glm"


def test_resubmit_false_before_send_is_not_execution_unknown() -> None:
    f = fact(Category.TLS, status=None, phase=Phase.BEFORE_SEND, moves_on=False, resubmit=False)
    assert stopped(run(failure=f)) is Reason.NOT_ELIGIBLE_FAILURE


def test_not_eligible_failure() -> None:
    f = fact(Category.AUTH, status=401, moves_on=False)
    assert stopped(run(failure=f)) is Reason.NOT_ELIGIBLE_FAILURE


@pytest.mark.parametrize(("retries", "calls"), [(0, 5), (3, 0), (-1, -1)])
def test_retry_allowance(retries: int, calls: int) -> None:
    perms = RunPermissions(retries_left=retries, calls_left=calls, tried=frozenset({"go-deepseek"}))
    assert stopped(run(permissions=perms)) is Reason.RETRY_ALLOWANCE


def test_stop_reasons_are_tested_in_order() -> None:
    worst = fact(
        Category.TIMEOUT,
        status=None,
        phase=Phase.AFTER_SEND,
        moves_on=False,
        resubmit=False,
        tool_started=True,
        effective_output=True,
    )
    none_left = RunPermissions(retries_left=0, calls_left=0)
    steps: list[tuple[dict[str, Any], Reason]] = [
        ({"policy": tune(FD, enabled=False), "role": "evaluation"}, Reason.FAILOVER_DISABLED),
        ({"role": "evaluation"}, Reason.ROLE_EXCLUDED),
        ({}, Reason.OUTPUT_EXISTS),
        (
            {
                "failure": worst.model_copy(
                    update={"tool_started": False, "effective_output": False}
                )
            },
            Reason.EXECUTION_UNKNOWN,
        ),
        ({"failure": fact(moves_on=False)}, Reason.NOT_ELIGIBLE_FAILURE),
        ({"failure": F503}, Reason.RETRY_ALLOWANCE),
    ]
    for extra, expected in steps:
        kw = {"failure": worst, "permissions": none_left, **extra}
        assert stopped(run(**kw)) is expected


def test_no_candidate_when_everything_is_tried() -> None:
    perms = RunPermissions(retries_left=3, calls_left=6, tried=frozenset(r.id for r in PLAN))
    d = run(permissions=perms, current="official-deepseek")
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d) == {r.id: Reason.ALREADY_TRIED for r in PLAN}


def test_stop_decisions_have_details() -> None:
    d = run(failure=fact(Category.AUTH, status=401, moves_on=False))
    assert "auth" in d.detail
    assert d.to_json()["reason"] == "not_eligible_failure"


@pytest.mark.parametrize(("category", "said"), [
    (Category.UNKNOWN, "an unknown failure"), (Category.AUTH, "an auth failure"),
    (Category.OVERLOADED, "an overloaded failure"), (Category.TIMEOUT, "a timeout failure")])
def test_a_stop_detail_names_its_category_with_its_article(category: Category,
                                                           said: str) -> None:
    d = run(failure=fact(category, moves_on=False))
    assert d.detail.startswith(f"{said} does not allow another route"), d.detail


# -- the seed's three scenarios -------------------------------------------------------------------


def test_scenario_1_503_with_healthy_group_takes_next_model_in_same_group() -> None:
    d = run(failure=F503)
    assert d.kind is DecisionKind.ROUTE and chosen(d) == "go-glm"
    assert skipped(d) == {"go-deepseek": Reason.ALREADY_TRIED}


def test_scenario_2_trusted_429_group_cooldown_skips_same_group() -> None:
    groups = {
        **OPEN,
        "go": GroupProjection(group="go", mode=GroupMode.COOLDOWN, until=1030, sampled_at=999),
    }
    d = run(failure=F429, groups=groups)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE
    # A Go-only plan has no independent group and cannot invent one.
    go_only = run(failure=F429, groups=groups, plan=(GO_DEEPSEEK, GO_GLM))
    assert stopped(go_only) is Reason.NO_CANDIDATE
    assert skipped(go_only)["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE


def test_scenario_3_backup_available_but_context_not_transferable() -> None:
    request = RequestNeeds(
        parts=(PartNeed(USER_INPUT), PartNeed(MODEL_DERIVED, Coverage.OK)),
    )
    grant = Grant(recipients={"go-gateway": [USER_INPUT, MODEL_DERIVED], "deepseek": [USER_INPUT]})
    d = run(failure=F429, request=request, grant=grant)
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d) == {
        "go-deepseek": Reason.ALREADY_TRIED,
        "go-glm": Reason.SAME_GROUP_UNAVAILABLE,
        "official-deepseek": Reason.DISCLOSURE,
    }


# -- group evidence -------------------------------------------------------------------------------


def _cooling_go(sampled_at: float, until: float | None = 2000) -> dict[str, GroupProjection]:
    return {
        **OPEN,
        "go": GroupProjection(
            group="go", mode=GroupMode.COOLDOWN, until=until, sampled_at=sampled_at
        ),
    }


def test_fresh_group_cooldown_eliminates_and_stale_is_ignored() -> None:
    assert skipped(run(groups=_cooling_go(999)))["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE
    # Exactly max age old is still fresh; one second more is stale.
    assert skipped(run(groups=_cooling_go(NOW - 30)))["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE
    assert chosen(run(groups=_cooling_go(NOW - 31))) == "go-glm"
    # The window is the policy's.
    longer = tune(FD, group_fact_max_age_s=600)
    assert chosen(run(groups=_cooling_go(400), policy=longer)) == "official-deepseek"


def test_cooldown_over_or_projection_missing_counts_as_open() -> None:
    assert chosen(run(groups=_cooling_go(999, until=NOW))) == "go-glm"
    assert chosen(run(groups={})) == "go-glm"
    no_sample = {"go": GroupProjection(group="go", mode=GroupMode.UNAVAILABLE)}
    assert chosen(run(groups=no_sample)) == "go-glm"


def test_cooldown_without_known_end_is_unavailable() -> None:
    d = run(groups=_cooling_go(999, until=None))
    assert skipped(d)["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE


def test_fresh_unavailable_group() -> None:
    groups = {**OPEN, "go": GroupProjection(group="go", mode=GroupMode.UNAVAILABLE, sampled_at=999)}
    d = run(groups=groups)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE


def test_provider_429_establishes_unavailability_whatever_the_projection_says() -> None:
    d = run(failure=F429, groups=OPEN)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE


def test_local_429_is_no_group_evidence() -> None:
    local = fact(Category.LOCAL_RATE_LIMIT, status=429, scope=Scope.GROUP, source=Source.LOCAL)
    # Moving on is the classifier's call; were it to move on, a local limiter is still no
    # evidence about the provider's group.
    assert chosen(run(failure=local)) == "go-glm"


def test_dns_before_send_requires_an_independent_group() -> None:
    d = run(failure=FDNS)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.INDEPENDENT_GROUP_REQUIRED


def test_group_evidence_is_ignored_when_policy_is_not_group_aware() -> None:
    blind = tune(FD, group_aware=False)
    assert chosen(run(failure=F429, policy=blind)) == "go-glm"
    assert chosen(run(failure=FDNS, policy=blind)) == "go-glm"
    assert chosen(run(groups=_cooling_go(999), policy=blind)) == "go-glm"


# -- health ---------------------------------------------------------------------------------------


def test_route_cooldown_and_expiry_at_exactly_until() -> None:
    health = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 60)}
    d = run(health=health)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.ROUTE_COOLDOWN
    back = {"go-glm": Health(key="go-glm", cooldown_until=NOW)}
    assert chosen(run(health=back)) == "go-glm"
    disabled = {"go-glm": Health(key="go-glm", disabled_until=NOW + 1)}
    assert skipped(run(health=disabled))["go-glm"] is Reason.ROUTE_COOLDOWN


def _new_request(
    policy: Policy, health: dict[str, Health], plan: tuple[Route, ...] = PLAN
) -> Decision:
    return run(
        policy=policy,
        health=health,
        plan=plan,
        failure=None,
        current=None,
        permissions=RunPermissions(retries_left=3, calls_left=6),
    )


def test_probe_of_cooling_primary_near_expiry() -> None:
    h = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 90, last_probe_at=NOW - 60)}
    d = _new_request(GOCLAW_ROUTES, h)
    assert d.kind is DecisionKind.PROBE and d.route_id == "go-deepseek"
    never = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 120)}
    # The margin boundary, never probed.
    assert _new_request(GOCLAW_ROUTES, never).kind is DecisionKind.PROBE


def test_probe_throttled_and_too_early() -> None:
    recent = {
        "go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 90, last_probe_at=NOW - 10)
    }
    d = _new_request(GOCLAW_ROUTES, recent)
    assert chosen(d) == "go-glm" and d.kind is DecisionKind.ROUTE
    assert skipped(d)["go-deepseek"] is Reason.PROBE_THROTTLED
    far = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 121)}
    assert skipped(_new_request(GOCLAW_ROUTES, far))["go-deepseek"] is Reason.ROUTE_COOLDOWN


def test_probe_state_older_than_ttl_is_forgotten() -> None:
    old = NOW - GOCLAW_ROUTES.probe.ttl_s - 1
    h = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 60, last_probe_at=old)}
    assert _new_request(GOCLAW_ROUTES, h).kind is DecisionKind.PROBE


def test_fallbacks_and_lone_primaries_are_never_probed() -> None:
    h = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 30)}
    d = run(policy=GOCLAW_ROUTES, health=h)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.ROUTE_COOLDOWN
    lone = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 30)}
    d = _new_request(GOCLAW_ROUTES, lone, plan=(GO_DEEPSEEK,))
    # No probe (nowhere else to go), but the last candidate is always tried.
    assert d.kind is DecisionKind.ROUTE and d.route_id == "go-deepseek"


def test_no_probe_when_policy_disables_probes() -> None:
    h = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 60)}
    d = _new_request(tune(GOCLAW_ROUTES, "probe", enabled=False), h)
    assert chosen(d) == "go-glm"
    assert skipped(d)["go-deepseek"] is Reason.ROUTE_COOLDOWN


def test_last_candidate_always_tried() -> None:
    h = {r.id: Health(key=r.id, cooldown_until=NOW + 3600) for r in PLAN}
    d = _new_request(GOCLAW_ROUTES, h)
    assert d.kind is DecisionKind.ROUTE and d.route_id == "official-deepseek"
    assert "official-deepseek" not in skipped(d)
    assert skipped(d) == {"go-deepseek": Reason.ROUTE_COOLDOWN, "go-glm": Reason.ROUTE_COOLDOWN}
    # Without the rule the same input stops.
    strict = tune(GOCLAW_ROUTES, last_candidate_always_tried=False)
    assert stopped(_new_request(strict, h)) is Reason.NO_CANDIDATE


def test_last_candidate_rule_never_overrides_the_other_checks() -> None:
    # The last plan entry cannot serve the request: the last *cooling but otherwise fine*
    # candidate is tried instead.
    h = {r.id: Health(key=r.id, cooldown_until=NOW + 3600) for r in PLAN}
    needs = RequestNeeds(context_tokens=100_000)  # official-deepseek's window is 64k
    d = run(
        policy=GOCLAW_ROUTES,
        health=h,
        failure=None,
        current=None,
        request=needs,
        permissions=RunPermissions(retries_left=3, calls_left=6),
    )
    assert d.route_id == "go-glm"
    # Nothing passes the other checks: stop.
    h2 = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 3600)}
    d = run(policy=GOCLAW_ROUTES, health=h2, request=RequestNeeds(context_tokens=300_000))
    assert stopped(d) is Reason.NO_CANDIDATE


def test_a_cooling_entry_the_walk_passed_is_not_the_last_candidate_once_a_later_entry_failed(
) -> None:
    # Seeds 000/001: the chain only moves forward. go-glm was skipped as cooling on the way to
    # official-deepseek; once official-deepseek (the chain's last entry) failed, the request
    # ends instead of going back to the cooling go-glm.
    h = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 30, error_count=1)}
    tried = frozenset({"go-deepseek", "official-deepseek"})
    d = run(policy=GOCLAW_ROUTES, health=h, current="official-deepseek",
            permissions=RunPermissions(retries_left=3, calls_left=6, tried=tried))
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d)["go-glm"] is Reason.ROUTE_COOLDOWN
    assert "'official-deepseek'" in d.detail and "walk has passed them" in d.detail
    # A cooling entry still ahead of the failure is tried as the last candidate.
    ahead = {"official-deepseek": Health(key="official-deepseek", cooldown_until=NOW + 30)}
    d = run(policy=GOCLAW_ROUTES, health={**h, **ahead})
    assert d.kind is DecisionKind.ROUTE and d.route_id == "official-deepseek"
    assert "last candidate always tried" in d.detail


def test_a_cooling_primary_outside_the_probe_margin_is_not_sent_after_its_backup_failed() -> None:
    # The primary cools far past the probe margin, so the new request went to its backup; when
    # the backup fails, the primary is not sent as a failover either (it would be a probe that
    # never claimed the probe slot, by every worker of the fleet).
    plan = (GO_DEEPSEEK, OFFICIAL)
    h = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 290, error_count=2,
                               last_probe_at=NOW - 10)}
    first = _new_request(GOCLAW_ROUTES, h, plan=plan)
    assert chosen(first) == "official-deepseek"
    d = run(policy=GOCLAW_ROUTES, health=h, plan=plan, current="official-deepseek",
            permissions=RunPermissions(retries_left=3, calls_left=6,
                                       tried=frozenset({"official-deepseek"})))
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d)["go-deepseek"] is Reason.ROUTE_COOLDOWN


# -- capability, qualification, disclosure ------------------------------------------------------


def test_capability_skip() -> None:
    no_tools = GO_GLM.model_copy(
        update={"capabilities": GO_GLM.capabilities.model_copy(update={"tools": False})}
    )
    d = run(plan=(GO_DEEPSEEK, no_tools, OFFICIAL), request=RequestNeeds(tools=True))
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.CAPABILITY


def test_not_qualified_skip() -> None:
    chat_only = GO_GLM.model_copy(update={"roles": ["chat"]})
    d = run(plan=(GO_DEEPSEEK, chat_only, OFFICIAL))
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.NOT_QUALIFIED


def test_disclosure_skip_for_missing_provenance() -> None:
    request = RequestNeeds(parts=(PartNeed(USER_INPUT), PartNeed(MODEL_DERIVED, Coverage.MISSING)))
    d = run(request=request)
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d)["go-glm"] is Reason.DISCLOSURE
    assert skipped(d)["official-deepseek"] is Reason.DISCLOSURE


def test_checks_apply_in_order_group_before_health_before_preflight() -> None:
    h = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 60)}
    chat_only = GO_GLM.model_copy(update={"roles": ["chat"]})
    d = run(plan=(GO_DEEPSEEK, chat_only, OFFICIAL), health=h, groups=_cooling_go(999))
    assert skipped(d)["go-glm"] is Reason.SAME_GROUP_UNAVAILABLE
    d = run(plan=(GO_DEEPSEEK, chat_only, OFFICIAL), health=h)
    assert skipped(d)["go-glm"] is Reason.ROUTE_COOLDOWN


def test_current_denials_override_the_frozen_grant() -> None:
    d = run(denials=Denials(routes=frozenset({"go-glm"})))
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.NOT_QUALIFIED
    grant = Grant(recipients={"go-gateway": [USER_INPUT], "deepseek": [USER_INPUT]})
    d = run(denials=Denials(recipients=frozenset({"go-gateway"})), grant=grant)
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.DISCLOSURE


def test_envelope_with_tampered_provenance_is_not_sent_anywhere() -> None:
    derived = Part(
        role="assistant",
        content="interim analysis",
        data_class=MODEL_DERIVED,
        provenance="attempt-1",
    )
    recorded = {"attempt-1": {derived.content_hash}}
    grant = Grant(
        recipients={
            "go-gateway": [USER_INPUT, MODEL_DERIVED],
            "deepseek": [USER_INPUT, MODEL_DERIVED],
        }
    )
    good = Envelope(parts=[Part(content="continue"), derived])
    assert chosen(run(request=good, provenance=recorded, grant=grant)) == "go-glm"
    tampered = Envelope(
        parts=[
            Part(content="continue"),
            derived.model_copy(update={"content": "interim analysis (ok)"}),
        ]
    )
    d = run(request=tampered, provenance=recorded, grant=grant)
    assert stopped(d) is Reason.NO_CANDIDATE
    assert set(skipped(d).values()) == {Reason.ALREADY_TRIED, Reason.DISCLOSURE}


def test_precomputed_part_hashes_decide_coverage_and_must_match_the_parts() -> None:
    """The retry owner hashes a turn's parts once; the selector then judges coverage by those
    hashes, so they must be one per part (a wrong count is refused, not guessed at)."""
    derived = Part(role="assistant", content="interim analysis", data_class=MODEL_DERIVED,
                   provenance="attempt-1")
    recorded = {"attempt-1": {derived.content_hash}}
    grant = Grant(recipients={"go-gateway": [USER_INPUT, MODEL_DERIVED],
                              "deepseek": [USER_INPUT, MODEL_DERIVED]})
    env = Envelope(parts=[Part(content="continue"), derived])
    hashes = [p.content_hash for p in env.parts]
    d = run(request=env, provenance=recorded, grant=grant, part_hashes=hashes)
    assert chosen(d) == "go-glm"
    d = run(request=env, provenance=recorded, grant=grant,
            part_hashes=[hashes[0], "sha256:" + "0" * 64])
    assert stopped(d) is Reason.NO_CANDIDATE
    assert Reason.DISCLOSURE in set(skipped(d).values())
    with pytest.raises(InvalidArgument) as err:
        run(request=env, provenance=recorded, grant=grant, part_hashes=hashes[:1])
    assert err.value.field == "part_hashes"


class ModelCounter:
    def count_tokens(self, envelope: Envelope, route: Route) -> int:
        return 150_000 if route.model == "glm-5" else 10


def test_pluggable_token_counter_in_selection() -> None:
    env = Envelope(parts=[Part(content="hello")])
    d = run(request=env, token_counter=ModelCounter())
    # The counter says glm-5 needs 150k tokens; its 200k window holds that.
    assert chosen(d) == "go-glm"
    # With a 100k window the same estimate no longer fits.
    small = GO_GLM.model_copy(
        update={"capabilities": GO_GLM.capabilities.model_copy(update={"context_window": 100_000})}
    )
    d = run(plan=(GO_DEEPSEEK, small, OFFICIAL), request=env, token_counter=ModelCounter())
    assert chosen(d) == "official-deepseek"
    assert skipped(d)["go-glm"] is Reason.CAPABILITY


# -- new turns ------------------------------------------------------------------------------------


def _turn(**kw: Any) -> Decision:
    base: dict[str, Any] = {
        "failure": None,
        "permissions": RunPermissions(retries_left=0, calls_left=1),
    }
    base.update(kw)
    return run(**base)


def test_new_turn_keeps_the_route_actually_used() -> None:
    assert chosen(_turn(current="go-glm")) == "go-glm"
    assert chosen(_turn(current=None)) == "go-deepseek"
    # Under first_entry the walk starts at the primary again.
    assert chosen(_turn(current="go-glm", policy=GOCLAW)) == "go-deepseek"


def test_new_turn_needs_a_call_but_no_retry() -> None:
    assert chosen(_turn()) == "go-deepseek"
    assert stopped(_turn(permissions=RunPermissions(retries_left=9, calls_left=0))) is (
        Reason.CALL_ALLOWANCE
    )


def test_new_turn_moves_past_an_unusable_current_route() -> None:
    h = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 60)}
    d = _turn(current="go-glm", health=h)
    assert chosen(d) == "go-deepseek"
    assert skipped(d)["go-glm"] is Reason.ROUTE_COOLDOWN


def test_new_turn_without_failover_stays_on_its_own_route() -> None:
    h = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 60)}
    off = tune(FD, enabled=False)
    d = _turn(current="go-glm", health=h, policy=off)
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d) == {"go-glm": Reason.ROUTE_COOLDOWN}
    assert chosen(_turn(current="go-glm", policy=off)) == "go-glm"
    assert chosen(_turn(role="evaluation")) == "go-deepseek"


# -- fased profile rotation -----------------------------------------------------------------------

OAUTH = Profile(id="anthropic:me@example.com", type=ProfileType.OAUTH)
TOKEN = Profile(id="anthropic:ci", type=ProfileType.TOKEN)
KEY = Profile(id="anthropic:default", type=ProfileType.API_KEY)
CLAUDE = Route(
    id="claude",
    provider="anthropic",
    model="claude-sonnet-4-5",
    group="anthropic",
    recipient="anthropic",
    profiles=[OAUTH, TOKEN, KEY],
)
MINI = Route(
    id="mini",
    provider="openai",
    model="gpt-4o-mini",
    group="openai",
    recipient="openai",
    profiles=[Profile(id="openai:default")],
)
FPLAN = (CLAUDE, MINI)
F429_ROUTE = fact(Category.RATE_LIMIT, status=429)


def _fased(**kw: Any) -> Decision:
    base: dict[str, Any] = {
        "plan": FPLAN,
        "policy": FASED,
        "groups": {},
        "current": "claude",
        "current_profile": OAUTH.id,
        "pin": Pin.AUTO,
        "failure": F429_ROUTE,
        "permissions": RunPermissions(
            retries_left=4,
            calls_left=6,
            tried=frozenset({"claude"}),
            tried_profiles=frozenset({OAUTH.id}),
        ),
    }
    base.update(kw)
    return run(**base)


def test_rotation_inside_the_failed_route_first() -> None:
    d = _fased()
    assert (d.route_id, d.profile) == ("claude", TOKEN.id)


def test_rotation_skips_tried_and_unusable_profiles() -> None:
    h = {TOKEN.id: Health(key=TOKEN.id, cooldown_until=NOW + 60)}
    d = _fased(health=h)
    assert (d.route_id, d.profile) == ("claude", KEY.id)
    cooled = [s for s in d.skipped if s.profile == TOKEN.id]
    assert cooled and cooled[0].reason is Reason.ROUTE_COOLDOWN


def test_user_pin_moves_to_the_next_model() -> None:
    d = _fased(pin=Pin.USER)
    assert (d.route_id, d.profile) == ("mini", "openai:default")


def test_no_usable_profile_left_moves_to_the_next_model() -> None:
    h = {p.id: Health(key=p.id, cooldown_until=NOW + 300) for p in (OAUTH, TOKEN, KEY)}
    assert _fased(health=h).route_id == "mini"
    all_tried = RunPermissions(
        retries_left=4,
        calls_left=6,
        tried=frozenset({"claude"}),
        tried_profiles=frozenset({OAUTH.id, TOKEN.id, KEY.id}),
    )
    assert _fased(permissions=all_tried).route_id == "mini"


def test_next_model_whose_profiles_all_cool_is_route_cooldown() -> None:
    h = {p.id: Health(key=p.id, cooldown_until=NOW + 300) for p in (OAUTH, TOKEN, KEY)}
    h["openai:default"] = Health(key="openai:default", disabled_until=NOW + 5 * 3600)
    d = _fased(health=h)
    assert stopped(d) is Reason.NO_CANDIDATE
    assert skipped(d)["mini"] is Reason.ROUTE_COOLDOWN


def test_a_disabled_key_is_reported_as_disabled_not_cooling() -> None:
    # Billing under fased disables a profile for hours; the skip must not call that a cooldown.
    billed = Health(key=TOKEN.id, disabled_until=NOW + 5 * 3600, disabled_reason="billing",
                    error_count=1)
    d = _fased(health={TOKEN.id: billed})
    [rot] = [s for s in d.skipped if s.profile == TOKEN.id]
    assert rot.reason is Reason.ROUTE_COOLDOWN
    assert rot.detail.startswith("profile disabled (billing) until ") and "in 5 h" in rot.detail
    # Every profile of the next model disabled: the route skip says so too.
    h = {p.id: Health(key=p.id, cooldown_until=NOW + 300) for p in (OAUTH, TOKEN, KEY)}
    h["openai:default"] = Health(key="openai:default", disabled_until=NOW + 5 * 3600,
                                 disabled_reason="billing")
    [mini] = [s for s in _fased(health=h).skipped if s.route == "mini"]
    assert mini.detail.startswith("disabled (billing) until ")
    # A route key disabled by any rule; one still cooling past its disable reads as cooling.
    off = {"go-glm": Health(key="go-glm", disabled_until=NOW + 60)}
    [glm] = [s for s in run(health=off).skipped if s.route == "go-glm"]
    assert glm.detail.startswith("disabled until ")
    both = {"go-glm": Health(key="go-glm", disabled_until=NOW + 60, disabled_reason="auth",
                             cooldown_until=NOW + 120)}
    [glm] = [s for s in run(health=both).skipped if s.route == "go-glm"]
    assert glm.detail.startswith("cooling until ")


def test_explicit_auth_order_drives_rotation() -> None:
    policy = tune(FASED, "profiles", auth_order={"anthropic": [OAUTH.id, KEY.id]})
    d = _fased(policy=policy)
    assert (d.route_id, d.profile) == ("claude", KEY.id)  # TOKEN is not listed


def test_a_route_whose_profiles_auth_order_leaves_out_is_skipped_not_a_crash() -> None:
    """An ``auth_order`` that names none of a route's profiles (a typo) leaves that route no
    credential: it is skipped as not qualified, saying how to fix it, and the next model serves;
    a new request is not sent on it either."""
    policy = tune(FASED, "profiles", auth_order={"anthropic": ["anthropic:typo"]})
    fresh = _fased(policy=policy, failure=None, current_profile=None, pin=None,
                   permissions=RunPermissions(retries_left=4, calls_left=6))
    assert fresh.route_id == "mini"
    assert skipped(fresh)["claude"] is Reason.NOT_QUALIFIED
    [skip] = [x for x in fresh.skipped if x.route == "claude"]
    assert "auth_order['anthropic']" in skip.detail and "list one of them" in skip.detail
    assert _fased(policy=policy).route_id == "mini"  # after a failure too


def test_a_not_qualified_skip_names_the_auth_order_key_as_the_policy_spells_it() -> None:
    """``auth_order`` matches the provider case-insensitively, so the skip's fix must name the
    key the user wrote (``Anthropic``), not the route's spelling (``anthropic``): the user
    would look for an entry that is not there."""
    policy = tune(FASED, "profiles", auth_order={"Anthropic": ["anthropic:typo"]})
    fresh = _fased(policy=policy, failure=None, current_profile=None, pin=None,
                   permissions=RunPermissions(retries_left=4, calls_left=6))
    [skip] = [x for x in fresh.skipped if x.route == "claude"]
    assert skip.reason is Reason.NOT_QUALIFIED
    assert "profiles.auth_order['Anthropic'] lists none of its profiles" in skip.detail


def test_rotation_is_off_unless_the_policy_rotates() -> None:
    no_rotation = tune(FASED, "profiles", rotate_before_model=False)
    assert _fased(policy=no_rotation).route_id == "mini"


def test_new_request_profile_stickiness() -> None:
    perms = RunPermissions(retries_left=4, calls_left=6)
    h = {OAUTH.id: Health(key=OAUTH.id, last_used=100), KEY.id: Health(key=KEY.id, last_used=9999)}
    auto = _fased(failure=None, permissions=perms, current_profile=KEY.id, pin=Pin.AUTO, health=h)
    assert (auto.route_id, auto.profile) == ("claude", KEY.id)
    # fased is sticky: without a pin the session's profile is kept as if auto-pinned...
    sticky = _fased(failure=None, permissions=perms, current_profile=KEY.id, pin=None, health=h)
    assert sticky.profile == KEY.id
    # ...and a policy that is not rotates to the best profile in rotation order.
    none = _fased(failure=None, permissions=perms, current_profile=KEY.id, pin=None, health=h,
                  policy=tune(FASED, "profiles", sticky=False))
    assert none.profile == OAUTH.id
    h_cool = {**h, KEY.id: Health(key=KEY.id, cooldown_until=NOW + 60)}
    moved = _fased(
        failure=None, permissions=perms, current_profile=KEY.id, pin=Pin.AUTO, health=h_cool
    )
    assert moved.profile == OAUTH.id
    user = _fased(
        failure=None, permissions=perms, current_profile=KEY.id, pin=Pin.USER, health=h_cool
    )
    assert (user.route_id, user.profile) == ("claude", KEY.id)


# -- input validation -----------------------------------------------------------------------------


def test_invalid_inputs_are_refused_with_the_field() -> None:
    with pytest.raises(InvalidArgument, match="current"):
        run(current=None)
    with pytest.raises(InvalidArgument, match="not in the Run's frozen plan"):
        run(current="elsewhere")
    with pytest.raises(InvalidArgument, match="empty"):
        run(plan=())
    with pytest.raises(InvalidArgument, match="duplicate"):
        run(plan=(GO_DEEPSEEK, GO_DEEPSEEK))


# -- properties -----------------------------------------------------------------------------------

_GROUPS = ["g1", "g2", "g3"]


@st.composite
def _scenarios(draw: st.DrawFn) -> SelectionInput:
    n = draw(st.integers(min_value=1, max_value=5))
    plan = tuple(
        Route(
            id=f"r{i}",
            provider=f"p{i}",
            model=f"m{i}",
            group=draw(st.sampled_from(_GROUPS)),
            recipient=draw(st.sampled_from(["a", "b"])),
            capabilities=Capabilities(context_window=draw(st.sampled_from([None, 1000, 10_000]))),
            roles=draw(st.sampled_from([None, ["research"], ["chat"]])),
        )
        for i in range(n)
    )
    ids = [r.id for r in plan]
    new_turn = draw(st.booleans())
    current = draw(st.sampled_from(ids))
    tried = frozenset(draw(st.lists(st.sampled_from(ids), max_size=n)))
    failure = None
    if not new_turn:
        tried = tried | {current}
        failure = fact(
            draw(st.sampled_from([Category.OVERLOADED, Category.RATE_LIMIT, Category.DNS])),
            status=draw(st.sampled_from([None, 429, 503])),
            scope=draw(st.sampled_from(list(Scope))),
        )
    health = {
        rid: Health(
            key=rid,
            cooldown_until=draw(st.sampled_from([None, NOW - 1, NOW + 60, NOW + 3600])),
            last_probe_at=draw(st.sampled_from([None, NOW - 5, NOW - 100])),
        )
        for rid in ids
    }
    groups = {
        g: GroupProjection(
            group=g,
            mode=draw(st.sampled_from(list(GroupMode))),
            until=draw(st.sampled_from([None, NOW + 30])),
            sampled_at=draw(st.sampled_from([None, NOW - 1, NOW - 100])),
        )
        for g in _GROUPS
    }
    grant = draw(st.sampled_from([None, Grant(recipients={"a": [USER_INPUT]})]))
    return SelectionInput(
        plan=plan,
        permissions=RunPermissions(retries_left=1, calls_left=1, tried=tried),
        policy=draw(st.sampled_from([FD, GOCLAW])),
        now=NOW,
        request=RequestNeeds(
            context_tokens=draw(st.sampled_from([None, 5000])),
            parts=(PartNeed(USER_INPUT),),
        ),
        grant=grant,
        groups=groups,
        health=health,
        current=current,
        failure=failure,
    )


@settings(max_examples=300, deadline=None)
@given(_scenarios())
def test_choice_is_in_plan_never_failed_or_tried_and_everything_before_is_skipped(
    s: SelectionInput,
) -> None:
    d = select(s)
    ids = [r.id for r in s.plan]
    reported = {sk.route for sk in d.skipped}
    if d.kind is DecisionKind.STOP:
        return
    assert d.route is not None and d.route_id in ids
    assert d.route in s.plan  # the frozen snapshot itself, not a lookalike
    assert d.route_id not in s.permissions.tried
    if s.failure is not None:
        assert d.route_id != s.current
    assert d.route_id not in reported
    # The walk order: plan order, except that a keep_current new turn starts on `current`.
    walk = ids
    if s.failure is None and s.policy.failover.new_turn == "keep_current" and s.current:
        walk = [s.current, *(i for i in ids if i != s.current)]
    before = walk[: walk.index(d.route_id)]
    assert set(before) <= reported, (before, d.to_json())


@settings(max_examples=300, deadline=None)
@given(_scenarios())
def test_no_candidate_reports_every_plan_entry_after_a_failure(s: SelectionInput) -> None:
    d = select(s)
    if s.failure is not None and d.reason is Reason.NO_CANDIDATE:
        assert {sk.route for sk in d.skipped} == {r.id for r in s.plan}
    # A decision is a pure function of its input.
    assert select(s) == d


# -- a decision looked at again after a wait ------------------------------------------------------


def test_a_route_that_started_cooling_after_the_decision_no_longer_serves_it() -> None:
    d = run()
    assert chosen(d) == "go-glm"
    assert recheck(inp(now=NOW + 5), d) is None  # nothing changed: it still serves
    cooling = {"go-glm": Health(key="go-glm", cooldown_until=NOW + 65, error_count=1)}
    skip = recheck(inp(now=NOW + 5, health=cooling), d)
    assert skip is not None and skip.route == "go-glm"
    assert skip.reason is Reason.ROUTE_COOLDOWN and "cooling until" in skip.detail
    # So does a group that became unavailable meanwhile.
    closed = {**OPEN, "go": GroupProjection(group="go", mode=GroupMode.UNAVAILABLE,
                                            sampled_at=NOW + 4)}
    skip = recheck(inp(now=NOW + 5, groups=closed), d)
    assert skip is not None and skip.reason is Reason.SAME_GROUP_UNAVAILABLE


def test_a_decision_still_eligible_keeps_its_place_when_an_earlier_route_reopens() -> None:
    h = {"go-deepseek": Health(key="go-deepseek", cooldown_until=NOW + 3600)}
    d = _new_request(FD, h)
    assert chosen(d) == "go-glm"
    fresh = inp(now=NOW + 5, failure=None, current=None,
                permissions=RunPermissions(retries_left=3, calls_left=6))
    assert chosen(select(fresh)) == "go-deepseek"  # the primary would be chosen now ...
    assert recheck(fresh, d) is None  # ... but the route waited for still serves


def test_the_last_candidate_always_tried_and_a_probe_are_not_ruled_out_by_their_cooldown(
) -> None:
    h = {r.id: Health(key=r.id, cooldown_until=NOW + 3600) for r in PLAN}
    d = _new_request(GOCLAW_ROUTES, h)
    assert d.route_id == "official-deepseek" and "last candidate" in d.detail
    later = inp(policy=GOCLAW_ROUTES, health=h, now=NOW + 5, failure=None, current=None,
                permissions=RunPermissions(retries_left=3, calls_left=6))
    assert recheck(later, d) is None
    probe = Decision(kind=DecisionKind.PROBE, route=GO_DEEPSEEK)
    assert recheck(later, probe) is None

