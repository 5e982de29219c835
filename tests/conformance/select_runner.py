"""Runs one ``select`` conformance case against :func:`ledger.decide.select.select`.

The harness (``test_conformance.py``) calls :func:`run_select_case` for every case of every
``select-*.json`` file. This module only maps the language-neutral vector fields onto the
library's own types; every decision is the library's.
"""

from __future__ import annotations

from typing import Any

from ledger.decide.classify import classify
from ledger.decide.health import route_key
from ledger.decide.preflight import Coverage, PartNeed, RequestNeeds
from ledger.decide.profiles import Pin
from ledger.decide.select import Decision, RunPermissions, SelectionInput, select
from ledger.domain.facts import Observation
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
from ledger.policy.load import apply_overrides, preset
from ledger.policy.model import Policy


def _route(d: dict[str, Any]) -> Route:
    return Route(
        id=d["id"],
        provider=d["provider"],
        model=d["model"],
        group=d["group"],
        recipient=d["recipient"],
        capabilities=Capabilities(**d.get("capabilities", {})),
        roles=d.get("roles"),
        profiles=[Profile(id=p["id"], type=ProfileType(p["type"])) for p in d.get("profiles", [])],
    )


def _request(d: dict[str, Any] | None) -> RequestNeeds:
    if not d:
        return RequestNeeds()
    needs = d.get("needs", {})
    parts = tuple(
        PartNeed(
            data_class=p["class"],
            coverage=Coverage(p["provenance"]) if "provenance" in p else None,
        )
        for p in d.get("parts", [])
    )
    return RequestNeeds(
        tools=bool(needs.get("tools", False)),
        context_tokens=needs.get("context_tokens"),
        prefill=bool(needs.get("prefill", False)),
        parts=parts,
    )


def _groups(d: dict[str, Any] | None) -> dict[str, GroupProjection]:
    return {
        g: GroupProjection(
            group=g,
            mode=GroupMode(v.get("mode", "open")),
            until=v.get("until"),
            sampled_at=v.get("sampled_at"),
        )
        for g, v in (d or {}).items()
    }


def _health(d: dict[str, Any] | None, routes: dict[str, Route], policy: Policy
            ) -> dict[str, Health]:
    """The vector's health (by route or profile id) under the keys the policy keeps it by: a
    route's row is its provider's where the policy keys health by provider."""
    out: dict[str, Health] = {}
    for k, v in (d or {}).items():
        key = route_key(routes[k], policy) if k in routes else k
        if key in out:
            raise AssertionError(f"health of {k!r} and another route share the key {key!r}")
        out[key] = Health(key=key, **v)
    return out


def _policy(case: dict[str, Any], file_policy: dict[str, Any], preset_name: str) -> Policy:
    return apply_overrides(preset(preset_name), {**file_policy, **case.get("policy", {})})


def build_input(
    case: dict[str, Any], file_policy: dict[str, Any], preset_name: str
) -> SelectionInput:
    """The :class:`SelectionInput` a vector describes (exposed for debugging failed cases)."""
    policy = _policy(case, file_policy, preset_name)
    now = float(case["now"])
    routes = {r["id"]: _route(r) for r in case["routes"]}
    plan = [routes[i] for i in case["plan"]]
    current = case.get("current")
    fact = None
    if case.get("failure") is not None:
        obs = dict(case["failure"])
        # The observation happened on the current route: it names the provider when the vector
        # leaves it implicit (provider-specific rules, e.g. routers, read it).
        if current is not None and "provider" not in obs:
            obs["provider"] = routes[current].provider
        fact = classify(Observation.model_validate(obs), policy, now)
    run = case.get("run", {})
    grant = case.get("grant")
    pin = case.get("pin")
    return SelectionInput(
        plan=plan,
        permissions=RunPermissions(
            retries_left=int(run.get("retries_left", 0)),
            calls_left=int(run.get("calls_left", 0)),
            tried=frozenset(run.get("tried", [])),
            tried_profiles=frozenset(run.get("tried_profiles", [])),
        ),
        policy=policy,
        now=now,
        request=_request(case.get("request")),
        role=case.get("role", "research"),
        grant=Grant(recipients=grant.get("recipients", {})) if grant is not None else None,
        groups=_groups(case.get("groups")),
        health=_health(case.get("health"), routes, policy),
        current=current,
        current_profile=case.get("current_profile"),
        pin=Pin(pin) if pin is not None else None,
        failure=fact,
    )


def _describe(case: dict[str, Any], d: Decision, inp: SelectionInput) -> str:
    fact = inp.failure.to_json() if inp.failure is not None else None
    return f"case {case['id']}: decision {d.to_json()}; failure fact {fact}"


def run_select_case(case: dict[str, Any], file_policy: dict[str, Any], preset: str) -> None:
    """Run one case; raise ``AssertionError`` naming every field that differs."""
    inp = build_input(case, file_policy, preset)
    d = select(inp)
    expect = case["expect"]
    problems: list[str] = []
    if "decision" in expect and d.kind.value != expect["decision"]:
        problems.append(f"decision {d.kind.value!r} != expected {expect['decision']!r}")
    if "route" in expect and d.route_id != expect["route"]:
        problems.append(f"route {d.route_id!r} != expected {expect['route']!r}")
    if "profile" in expect and d.profile != expect["profile"]:
        problems.append(f"profile {d.profile!r} != expected {expect['profile']!r}")
    if "reason" in expect:
        got = d.reason.value if d.reason is not None else None
        if got != expect["reason"]:
            problems.append(f"reason {got!r} != expected {expect['reason']!r}")
    for route_id, reason in expect.get("skipped", {}).items():
        reported = [s.reason.value for s in d.skipped if s.route == route_id]
        if reason not in reported:
            problems.append(
                f"skipped[{route_id!r}] expected {reason!r}, reported {reported or 'nothing'}"
            )
    assert not problems, "; ".join(problems) + "\n" + _describe(case, d, inp)


__all__ = ["build_input", "run_select_case"]
