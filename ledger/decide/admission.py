"""Admission rules (pure): a valid plan, the default grant, and what a Child may be.

A Child Run is never broader than its parent: it uses a subset of the parent's frozen route
snapshots, a grant inside the parent's (recipients, data classes and roles), a role the parent's
grant allows, and the parent's frozen policy itself (``docs/disclosure.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ledger.domain.values import Grant, Route
from ledger.errors import InvalidArgument

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


__all__ = [
    "DEFAULT_GRANT_CLASSES",
    "check_child_policy",
    "child_grant",
    "default_grant",
    "validate_plan",
]
