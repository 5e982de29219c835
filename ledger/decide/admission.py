"""Admission rules (pure): a valid plan, the default grant, what a Child may be, what is frozen.

What an admission freezes is :func:`admission_terms` and :func:`admission_spec`.

A Child Run is never broader than its parent: it uses a subset of the parent's frozen route
snapshots, a grant inside the parent's (recipients, data classes and roles), a role the parent's
grant allows, and the parent's frozen policy itself (``docs/disclosure.md``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from ledger.domain.records import FrozenRun, Lease, to_micros
from ledger.domain.specs import AdmitSpec
from ledger.domain.values import Budget, Grant, Route, content_hash
from ledger.errors import InvalidArgument
from ledger.policy.model import Policy

# Classes a run may send to every recipient of its plan when the caller passes no grant.
DEFAULT_GRANT_CLASSES = ("user_input", "system", "tool_description")


def validate_plan(plan: Sequence[Route]) -> None:
    """A non-empty plan of Routes with unique ids."""
    if not plan:
        raise InvalidArgument("the candidate plan is empty; pass at least one Route", field="plan")
    seen: set[str] = set()
    for i, r in enumerate(plan):
        if not isinstance(r, Route):
            raise InvalidArgument(f"plan[{i}] is not a ledger.Route (got {type(r).__name__})",
                                  field=f"plan[{i}]")
        if r.id in seen:
            raise InvalidArgument(f"route id {r.id!r} appears twice in the plan; ids must be "
                                  "unique", field="plan")
        seen.add(r.id)


def default_grant(plan: Sequence[Route]) -> Grant:
    """The grant of a Run admitted without one: its own recipients, for the caller's own input."""
    return Grant(recipients={r.recipient: list(DEFAULT_GRANT_CLASSES) for r in plan})


def child_grant(parent_plan: Sequence[Route], parent_grant: Grant, plan: Sequence[Route],
                grant: Grant | None, role: str) -> Grant:
    """The grant a Child is admitted with.

    Raises:
        InvalidArgument: the Child would be broader than its parent in any way (a route, a
            recipient, a data class, a role); ``field`` names which.
    """
    parent_routes = {r.id: r for r in parent_plan}
    for r in plan:
        if parent_routes.get(r.id) != r:
            raise InvalidArgument(
                f"child route {r.id!r} is not one of the parent's approved candidates (or differs "
                "from the parent's frozen snapshot); a child may only narrow the parent's plan",
                field="plan",
            )
    if grant is None:
        # Inherit: the parent's approvals for the recipients the child can reach.
        recipients = {r.recipient for r in plan}
        grant = Grant(recipients={k: v for k, v in parent_grant.recipients.items()
                                  if k in recipients}, roles=parent_grant.roles)
    for recipient, classes in grant.recipients.items():
        allowed = set(parent_grant.recipients.get(recipient, []))
        extra = sorted(set(classes) - allowed)
        if extra:
            raise InvalidArgument(
                f"child grant approves {extra} for {recipient!r}, which the parent's grant does "
                "not; a child grant may only narrow the parent's",
                field="grant",
            )
    if parent_grant.roles is not None:
        if grant.roles is None:
            grant = grant.model_copy(update={"roles": list(parent_grant.roles)})
        else:
            extra = sorted(set(grant.roles) - set(parent_grant.roles))
            if extra:
                raise InvalidArgument(
                    f"child grant adds roles {extra} the parent lacks ({parent_grant.roles}); "
                    "list only roles the parent's grant allows, or leave roles out to inherit",
                    field="grant.roles")
    if grant.roles is not None and role not in grant.roles:
        raise InvalidArgument(
            f"child role {role!r} is outside the roles its grant allows ({grant.roles}); "
            "use one of them", field="role")
    return grant


def check_child_policy(parent_policy_hash: str, child_policy_hash: str | None) -> None:
    """Refuse (InvalidArgument) a Child policy other than its parent's frozen one.

    A looser policy (another preset, failover switched on where the parent has it off) would let
    the Child do what the parent may not.
    """
    if child_policy_hash is not None and child_policy_hash != parent_policy_hash:
        raise InvalidArgument(
            f"a child runs under its parent's frozen policy ({parent_policy_hash}); the policy "
            f"given hashes to {child_policy_hash}: pass policy=None to inherit it",
            field="policy")


def admission_terms(plan: Sequence[Route], grant: Grant | None, role: str,
                    policy: Policy | None, *, policy_hash: Callable[[Policy], str],
                    parent: FrozenRun | None = None, parent_policy: Policy | None = None,
                    ) -> tuple[Policy, Grant]:
    """The policy and grant a Run is admitted under.

    A root Run gets ``policy`` (the caller resolves ``None`` to the default preset first) and
    ``grant``, or :func:`default_grant` of its plan. A Child (``parent`` given, with the policy
    the parent froze) inherits the parent's policy when ``policy`` is ``None`` and may not name
    another (:func:`check_child_policy`); its grant is :func:`child_grant`.
    ``policy_hash`` hashes a policy (:func:`ledger.policy.load.policy_hash`).

    Raises :class:`~ledger.errors.InvalidArgument` when a Child would be broader than its parent.
    """
    if parent is None:
        if policy is None:
            raise InvalidArgument("a root Run needs a policy; pass a preset name or a Policy",
                                  field="policy")
        return policy, grant if grant is not None else default_grant(plan)
    if parent_policy is None:
        raise InvalidArgument("a Child's terms need its parent's frozen policy", field="parent")
    if policy is None:
        policy = parent_policy
    else:
        check_child_policy(parent.policy_hash, policy_hash(policy))
    return policy, child_grant(parent.plan, parent.grant, plan, grant, role)


def admission_spec(run_id: str, *, plan: Sequence[Route], budget: Budget, grant: Grant,
                   policy: Policy, policy_hash: str, role: str, parent: Lease | None,
                   tenant: str | None, labels: Mapping[str, str], selected_route: str | None,
                   deadline: float | None) -> AdmitSpec:
    """What admitting ``run_id`` writes.

    The frozen plan, grant, budget and policy as canonical JSON, and the content hash that makes
    a repeated admission of the same content idempotent (and a different content under the same
    id an :class:`~ledger.errors.AdmissionConflict`).

    ``selected_route`` (default: the plan's first) must be one of the plan's routes, else
    :class:`~ledger.errors.InvalidArgument`.
    """
    selected = selected_route or plan[0].id
    if selected not in {r.id for r in plan}:
        raise InvalidArgument(f"selected_route {selected!r} is not in the plan; pass "
                              "the id of one of the plan's routes (or None for the first)",
                              field="selected_route")
    label_map = dict(labels)
    frozen = {
        "plan": [r.model_dump(mode="json") for r in plan],
        "grant": grant.model_dump(mode="json"),
        "budget": budget.model_dump(mode="json"),
        "policy_hash": policy_hash,
        "role": role,
        "parent": parent.run_id if parent else None,
        "tenant": tenant,
        "labels": label_map,
        "selected_route": selected,
        "deadline": deadline,
    }
    return AdmitSpec(
        run_id=run_id,
        parent_run_id=parent.run_id if parent else None,
        parent_lease=parent,
        role=role,
        tenant=tenant,
        labels=json.dumps(label_map, sort_keys=True),
        plan=json.dumps(frozen["plan"], sort_keys=True),
        run_grant=json.dumps(frozen["grant"], sort_keys=True),
        budget=json.dumps(frozen["budget"], sort_keys=True),
        policy=json.dumps(policy.model_dump(mode="json"), sort_keys=True),
        policy_hash=policy_hash,
        selected_route=selected,
        content_hash=content_hash(frozen),
        deadline=deadline,
        max_calls=budget.max_calls,
        max_retries=budget.max_retries,
        max_cost_micros=to_micros(budget.max_cost),
        max_tokens=budget.max_tokens,
    )


__all__ = [
    "DEFAULT_GRANT_CLASSES",
    "admission_spec",
    "admission_terms",
    "check_child_policy",
    "child_grant",
    "default_grant",
    "validate_plan",
]
