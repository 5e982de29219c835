"""The inputs a decision records (``ledger.decide.inputs``): read back from the stored JSON, they
give the selector exactly what it read, so it decides exactly as recorded, under every preset;
the record keeps only what can change a decision; a malformed record is a typed error."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ledger.decide.classify import classify
from ledger.decide.inputs import decided_again, parse_inputs, record_inputs, selection_input
from ledger.decide.preflight import Denials
from ledger.decide.profiles import Pin
from ledger.decide.select import (
    RunPermissions,
    SelectionInput,
    preflight_verdicts,
    select,
)
from ledger.domain.envelope import MODEL_DERIVED, USER_INPUT, Envelope, Part
from ledger.domain.facts import Observation, Transport
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
from ledger.policy.load import PRESETS, preset
from ledger.policy.model import Policy
from ledger.redaction import redact_data
from ledger.storage.encode import event_json

NOW = 1_000_000.0
POLICIES = {n: preset(n) for n in PRESETS}
ROUTES = [
    Route(id="go-deepseek", provider="go", model="deepseek-v4", group="go",
          recipient="go-gateway", capabilities=Capabilities(tools=True, context_window=4000)),
    Route(id="go-glm", provider="go", model="glm-5", group="go", recipient="go-gateway",
          profiles=[Profile(id="go:oauth", type=ProfileType.OAUTH),
                    Profile(id="go:key", type=ProfileType.API_KEY)]),
    Route(id="official", provider="deepseek", model="deepseek-v4", group="official",
          recipient="deepseek", roles=["research"]),
    Route(id="other", provider="other", model="m", group="other", recipient="other",
          capabilities=Capabilities(tools=False),
          profiles=[Profile(id="other:a"), Profile(id="other:b")]),
]
KEYS = ["go-deepseek", "go-glm", "official", "other", "provider:go", "provider:deepseek",
        "provider:other", "go:oauth", "go:key", "other:a", "other:b"]
OBSERVATIONS = [
    Observation(status=503), Observation(status=429, headers={"Retry-After": "20"}),
    Observation(status=401), Observation(status=500), Observation(status=400),
    Observation(transport=Transport.CONNECT_REFUSED),
    Observation(transport=Transport.READ_TIMEOUT), Observation(transport=Transport.DNS_FAILURE),
    Observation(status=503, effective_output=True), Observation(status=402),
]

offsets = st.one_of(st.none(), st.floats(min_value=-900, max_value=900, allow_nan=False))


def _at(off: float | None) -> float | None:
    return None if off is None else NOW + off


@st.composite
def inputs(draw: Any) -> tuple[str, SelectionInput]:
    """A selection input under a preset: a plan of 2-4 routes, cooling and disabled keys, probe
    state, group projections fresh and stale, a failure or a new turn, tried routes and profiles,
    a request some routes cannot serve or may not receive."""
    name = draw(st.sampled_from(sorted(POLICIES)))
    policy = POLICIES[name]
    plan = draw(st.permutations(ROUTES))[:draw(st.integers(2, 4))]
    health = {}
    for key in draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=6)):
        health[key] = Health(key=key, cooldown_until=_at(draw(offsets)),
                             disabled_until=_at(draw(offsets)),
                             last_probe_at=_at(draw(st.one_of(st.none(), st.floats(-900, 0)))),
                             last_used=_at(draw(st.one_of(st.none(), st.floats(-900, 0)))),
                             error_count=draw(st.integers(0, 3)))
    groups = {}
    for g in draw(st.lists(st.sampled_from(["go", "official", "other"]), unique=True)):
        groups[g] = GroupProjection(group=g, mode=draw(st.sampled_from(list(GroupMode))),
                                    until=_at(draw(offsets)),
                                    sampled_at=NOW - draw(st.floats(0, 60)))
    failure = current = profile = None
    if draw(st.booleans()):
        failed = draw(st.sampled_from(plan))
        current = failed.id
        failure = classify(draw(st.sampled_from(OBSERVATIONS)).model_copy(
            update={"provider": failed.provider}), policy, now=NOW)
        profile = draw(st.sampled_from([None, *(p.id for p in failed.profiles)]))
    elif draw(st.booleans()):
        current = draw(st.sampled_from(plan)).id
    ids = [r.id for r in plan]
    tried = frozenset(draw(st.lists(st.sampled_from(ids), unique=True, max_size=1)))
    pids = [p.id for r in plan for p in r.profiles]
    request = Envelope(
        parts=[Part(content="x" * draw(st.sampled_from([10, 10, 10, 20_000]))),
               *([Part(role="assistant", content="an earlier answer", data_class=MODEL_DERIVED,
                       provenance="att-1")] if draw(st.booleans()) else [])],
        tools=[] if draw(st.booleans()) else [{"name": "search", "description": "find"}],
        max_output_tokens=100)
    inp = SelectionInput(
        plan=plan, policy=policy, now=NOW,
        permissions=RunPermissions(
            retries_left=draw(st.sampled_from([0, 2, 2, 3, 3, 3, 3])),
            calls_left=draw(st.sampled_from([0, 2, 3, 3, 3, 3, 3])),
            tried=tried,
            tried_profiles=frozenset(draw(st.lists(st.sampled_from(pids), unique=True))
                                     if pids else []),
            tried_pairs=frozenset((r.id, p.id) for r in plan for p in r.profiles
                                  if r.id in tried)),
        request=request, role=draw(st.sampled_from(["research"] * 5 + ["evaluation"])),
        grant=draw(st.sampled_from([None, Grant(recipients={
            "go-gateway": [USER_INPUT, MODEL_DERIVED, "tool_description"],
            "deepseek": [USER_INPUT], "other": [USER_INPUT, MODEL_DERIVED]})])),
        groups=groups, health=health, current=current, current_profile=profile,
        pin=draw(st.sampled_from([None, Pin.AUTO, Pin.USER])), failure=failure,
        denials=Denials(routes=frozenset(draw(st.lists(st.sampled_from(ids), max_size=1)))),
        provenance={"att-1": frozenset({Part(role="assistant", content="an earlier answer",
                                             data_class=MODEL_DERIVED,
                                             provenance="att-1").content_hash})}
        if draw(st.booleans()) else {},
        no_probe=frozenset(draw(st.lists(st.sampled_from(ids), max_size=1))))
    return name, replace(inp, verdicts=preflight_verdicts(inp))


def _stored(record: dict[str, Any]) -> Any:
    """The record as an event stores it and a reader gets it back: redacted JSON text."""
    return json.loads(event_json({"inputs": record}))["inputs"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs())
def test_a_recorded_decision_is_recomputed_exactly_from_its_stored_inputs(
        case: tuple[str, SelectionInput]) -> None:
    name, inp = case
    decision = select(inp)
    event(f"{decision.kind.value} {decision.reason or ''}; skips "
          + ",".join(sorted({s.reason.value for s in decision.skipped})))
    stored = _stored(record_inputs(inp, by="select",
                                   on="failure" if inp.failure else "new_turn", turn="t1",
                                   failed="att-9" if inp.failure else None))
    rec = parse_inputs(stored, plan=inp.plan, policy=POLICIES[name])
    again = select(selection_input(rec, plan=inp.plan, policy=POLICIES[name], role=inp.role,
                                   grant=inp.grant, failure=inp.failure))
    assert redact_data(again.to_json()) == redact_data(decision.to_json())
    assert again == decision


def test_the_selector_decides_alike_with_its_verdicts_decided_beforehand() -> None:
    # The turn decides with every plan route's preflight verdict computed once; a selection
    # that checks each candidate as it reaches it decides the same.
    inp = SelectionInput(
        plan=ROUTES, policy=POLICIES["failure-domain"], now=NOW,
        permissions=RunPermissions(retries_left=2, calls_left=2),
        request=Envelope(parts=[Part(content="x" * 20_000)],
                         tools=[{"name": "search", "description": "find"}]),
        grant=Grant(recipients={"deepseek": [USER_INPUT, "tool_description"]}))
    verdicts = preflight_verdicts(inp)
    assert verdicts["go-deepseek"] is not None and verdicts["go-deepseek"].check == "capability"
    assert verdicts["go-glm"] is not None and verdicts["go-glm"].check == "disclosure"
    assert verdicts["official"] is None
    assert select(replace(inp, verdicts=verdicts)) == select(inp)


def test_the_record_keeps_only_what_can_change_a_decision() -> None:
    inp = SelectionInput(
        plan=ROUTES[:2], policy=POLICIES["failure-domain"], now=NOW,
        permissions=RunPermissions(retries_left=1, calls_left=2),
        groups={"go": GroupProjection(group="go", mode=GroupMode.OPEN, sampled_at=NOW),
                "official": GroupProjection(group="official", mode=GroupMode.COOLDOWN,
                                            until=NOW + 30, sampled_at=NOW - 2)},
        health={"go-deepseek": Health(key="go-deepseek", error_count=2),
                "go-glm": Health(key="go-glm", cooldown_until=NOW + 60)})
    rec = record_inputs(replace(inp, verdicts=preflight_verdicts(inp)), by="select",
                        on="new_turn", turn="t1")
    assert rec == {"v": 2, "by": "select", "on": "new_turn", "turn": "t1", "at": NOW,
                   "left": [1, 2], "groups": {"official": ["cooldown", NOW + 30, NOW - 2]},
                   "health": {"go-glm": [NOW + 60, None, None, None]}}
    with pytest.raises(InvalidArgument) as e:
        record_inputs(inp, by="select", on="new_turn", turn="t1")
    assert e.value.fields["field"] == "verdicts"


@pytest.mark.parametrize(("record", "field"), [
    ({"v": 3}, "v"),
    ("not a record", "v"),
    ({"v": 1, "by": "guess", "on": "new_turn", "turn": "t", "at": 1.0, "left": [1, 1]}, "by"),
    ({"v": 1, "by": "select", "on": "new_turn", "turn": "t", "at": "soon", "left": [1, 1]},
     "at"),
    ({"v": 1, "by": "select", "on": "new_turn", "turn": "t", "at": 1.0, "left": [1]}, "left"),
    ({"v": 1, "by": "select", "on": "new_turn", "turn": "t", "at": 1.0, "left": [1, 1],
      "groups": {"go": ["shut", None, 1.0]}}, "inputs"),
    ({"v": 1, "by": "select", "on": "new_turn", "turn": "t", "at": 1.0, "left": [1, 1],
      "health": {"go": [1.0]}}, "inputs"),
    ({"v": 1, "by": "select", "on": "new_turn", "turn": "t", "at": 1.0, "left": [1, 1],
      "tried": "go"}, "tried"),
    ({"v": 1, "by": "select", "on": "new_turn", "turn": "t", "at": 1.0, "left": [1, 1],
      "preflight": {"go": ["taste", "", ""]}}, "inputs"),
])
def test_a_malformed_record_is_a_typed_error_naming_the_field(record: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_inputs(record, plan=ROUTES, policy=POLICIES["goclaw"])
    assert e.value.fields["field"] == field


def _spelled(provider: str, rid: str, group: str, **kw: Any) -> Route:
    return Route(id=rid, provider=provider, model="m", group=group, recipient="r", **kw)


def _recorded(plan: list[Route], health: dict[str, Health], version: int = 2,
              policy: str = "goclaw") -> Any:
    """The stored record of a new turn's decision over ``plan`` under preset ``policy``
    reading ``health``, as a record of format ``version`` (whatever its keys)."""
    inp = SelectionInput(plan=plan, policy=POLICIES[policy], now=NOW,
                         permissions=RunPermissions(retries_left=2, calls_left=2),
                         request=Envelope(parts=[Part(content="x")]), health=health)
    return {**_stored(record_inputs(replace(inp, verdicts=preflight_verdicts(inp)),
                                    by="select", on="new_turn", turn="t1")), "v": version}


def _recorded_before_the_fold(plan: list[Route], health: dict[str, Health],
                              version: int = 1) -> Any:
    """A record as the selector wrote it before migration 0020 under goclaw (health keyed by
    provider): provider keys as spelled, in format 1 (``version``: as a record of that format,
    whatever its keys)."""
    return _recorded(plan, health, version)


def _read(record: Any, plan: list[Route], policy: str = "goclaw") -> Any:
    return parse_inputs(record, plan=plan, policy=POLICIES[policy])


def test_a_provider_key_recorded_before_the_fold_is_read_under_the_folded_key() -> None:
    # goclaw keys health by provider. A Run whose routes spell it OpenAI recorded the cooldown
    # under provider:OpenAI; the selector now looks up provider:openai, found nothing, and the
    # replay under the recorded policy sent the turn to the cooling route (40 of 54 decisions
    # "decided differently" in an upgraded ledger).
    plan = [_spelled("OpenAI", "a", "ga"), _spelled("Other", "b", "gb")]
    cooling = Health(key="provider:OpenAI", cooldown_until=NOW + 60)
    rec = _read(_recorded_before_the_fold(plan, {"provider:OpenAI": cooling}), plan)
    assert set(rec.health) == {"provider:openai"} and rec.version == 1
    assert decided_again(rec, plan, POLICIES["goclaw"])  # one spelling: only renamed
    decision = select(selection_input(rec, plan=plan, policy=POLICIES["goclaw"],
                                      role="research", grant=None, failure=None))
    # Read as cooling: goclaw probes its cooling primary (unread, it was a plain first choice).
    assert (decision.kind.value, decision.route.id, decision.detail) == (
        "probe", "a", "probe of the cooling primary")


def test_a_decision_over_two_spellings_of_a_provider_before_the_fold_is_not_decided_again(
        ) -> None:
    # Before the fold the selector read OpenAI's routes under one key and openai's under
    # another: one cooling, one not, which no folded key gives back. Such a decision is taken
    # as recorded (counted as without inputs), not reported as a disagreement.
    goclaw = POLICIES["goclaw"]
    plan = [_spelled("OpenAI", "a", "ga"), _spelled("openai", "b", "gb")]
    rec = _read(_recorded_before_the_fold(plan, {
        "provider:OpenAI": Health(key="provider:OpenAI", cooldown_until=NOW + 60),
        "provider:openai": Health(key="provider:openai", last_used=NOW - 5)}), plan)
    assert not decided_again(rec, plan, goclaw)
    # Merged as migration 0020 merges the stored rows: the later of each time.
    merged = rec.health["provider:openai"]
    assert (merged.cooldown_until, merged.last_used) == (NOW + 60, NOW - 5)
    # Only one spelling's row recorded (the other was healthy, and a healthy key has none):
    # nothing in the keys says the record predates the fold, yet OpenAI's routes never read
    # openai's cooldown then. A record of format 1 is not decided again over such a plan.
    lower_only = {"provider:openai": Health(key="provider:openai", cooldown_until=NOW + 60)}
    assert not decided_again(_read(_recorded_before_the_fold(plan, lower_only), plan), plan,
                             goclaw)
    # Nor is that needed when the record holds no health of the provider spelled two ways.
    assert decided_again(_read(_recorded_before_the_fold(plan, {}), plan), plan, goclaw)
    # A record made since (format 2: folded keys) is decided again over any plan.
    since = _read(_recorded_before_the_fold(plan, lower_only, version=2), plan)
    assert since.version == 2 and decided_again(since, plan, goclaw)



def _decided_again_as_with(rec: Any, plan: list[Route], policy: Policy,
                           health: dict[str, Health]) -> Any:
    """``rec``'s decision made again, asserted to be the selector's over ``health`` as it was
    recorded (the keys read as recorded, none folded)."""
    assert decided_again(rec, plan, policy)
    inp = SelectionInput(plan=plan, policy=policy, now=NOW, role="research",
                         permissions=RunPermissions(retries_left=2, calls_left=2),
                         request=Envelope(parts=[Part(content="x")]), health=health)
    again = select(selection_input(rec, plan=plan, policy=policy, role="research", grant=None,
                                   failure=None))
    assert again == select(replace(inp, verdicts=preflight_verdicts(inp)))
    return again

@pytest.mark.parametrize("version", [1, 2])
def test_a_route_id_spelled_like_a_provider_key_is_read_as_recorded(version: int) -> None:
    # failure-domain keys health by route: the route provider:Foo cooled under its own id, and
    # the selector looks it up by that id, under 0020 as before. Folded to provider:foo, the
    # replay under the recorded policy read it healthy and chose the cooling route.
    plan = [_spelled("Foo", "provider:Foo", "ga"), _spelled("bar", "b", "gb")]
    cooling = {"provider:Foo": Health(key="provider:Foo", cooldown_until=NOW + 60)}
    record = _recorded(plan, cooling, version, policy="failure-domain")
    rec = _read(record, plan, "failure-domain")
    assert set(rec.health) == {"provider:Foo"}
    again = _decided_again_as_with(rec, plan, POLICIES["failure-domain"], cooling)
    assert again.route is not None and again.route.id == "b"


@pytest.mark.parametrize("version", [1, 2])
def test_a_profile_id_spelled_like_a_provider_key_is_read_as_recorded(version: int) -> None:
    # fased keys health by profile: the profile provider:Foo cooled under its own id, and
    # fased rotates to the route's other profile. Folded, the replay read it healthy.
    profiles = [Profile(id="provider:Foo"), Profile(id="foo:key")]
    plan = [_spelled("Foo", "a", "ga", profiles=profiles), _spelled("bar", "b", "gb")]
    cooling = {"provider:Foo": Health(key="provider:Foo", cooldown_until=NOW + 60)}
    rec = _read(_recorded(plan, cooling, version, policy="fased"), plan, "fased")
    assert set(rec.health) == {"provider:Foo"}
    again = _decided_again_as_with(rec, plan, POLICIES["fased"], cooling)
    assert (again.route_id, again.profile) == ("a", "foo:key")


def test_a_record_of_two_spellings_under_a_route_key_is_decided_again() -> None:
    # Spellings of one provider are two keys only where health is keyed by provider; under
    # failure-domain nothing was folded, and a route id provider:openai is that route's.
    policy = POLICIES["failure-domain"]
    plan = [_spelled("OpenAI", "a", "ga"), _spelled("openai", "provider:openai", "gb")]
    cooling = {"provider:openai": Health(key="provider:openai", cooldown_until=NOW + 60)}
    rec = _read(_recorded(plan, cooling, 1, policy="failure-domain"), plan, "failure-domain")
    assert set(rec.health) == {"provider:openai"} and decided_again(rec, plan, policy)


def test_a_profile_id_that_a_providers_spelling_folds_onto_is_not_decided_again() -> None:
    # Before 0020, under goclaw, the route of Foo read provider:Foo and the profile
    # provider:foo its own row; now both read provider:foo, which cannot give back the two.
    goclaw = POLICIES["goclaw"]
    plan = [_spelled("Foo", "a", "ga"),
            _spelled("bar", "b", "gb", profiles=[Profile(id="provider:foo")])]
    held = {"provider:foo": Health(key="provider:foo", cooldown_until=NOW + 60)}
    assert not decided_again(_read(_recorded_before_the_fold(plan, held), plan), plan, goclaw)
    # A profile id that is a spelling itself was read through the route's row then, and is
    # kept under its own key beside the folded one.
    plan = [_spelled("Foo", "a", "ga"),
            _spelled("bar", "b", "gb", profiles=[Profile(id="provider:Foo")])]
    held = {"provider:Foo": Health(key="provider:Foo", cooldown_until=NOW + 60)}
    rec = _read(_recorded_before_the_fold(plan, held), plan)
    assert set(rec.health) == {"provider:Foo", "provider:foo"}
    assert decided_again(rec, plan, goclaw)


def test_a_record_read_without_its_runs_policy_keeps_its_keys() -> None:
    # A Run whose frozen policy does not read (a bulk-loaded marker) is not replayed; its
    # records are still read for their turn and time, their keys as recorded.
    plan = [_spelled("OpenAI", "a", "ga")]
    held = {"provider:OpenAI": Health(key="provider:OpenAI", cooldown_until=NOW + 60)}
    rec = parse_inputs(_recorded_before_the_fold(plan, held), plan=plan, policy=None)
    assert set(rec.health) == {"provider:OpenAI"}
