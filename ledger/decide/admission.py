"""Admission rules (pure): a valid plan, the default grant, what a Child may be, what is frozen.

What an admission freezes is :func:`admission_terms` and :func:`admission_spec`.

A Child Run is never broader than its parent: it uses a subset of the parent's frozen route
snapshots, a grant inside the parent's (recipients, data classes and roles), a role the parent's
grant allows, and the parent's frozen policy itself (``docs/disclosure.md``). It spends its
parent's money by its parent's time: it belongs to the parent's tenant, carries the parent's
labels (its own added or winning) and ends by the parent's deadline (:func:`child_terms`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Annotated, Any, Required, cast
from urllib.parse import parse_qsl, urlsplit

from pydantic import Field, SkipValidation
from typing_extensions import TypedDict

from ledger.domain.bounds import MAX_LABELS
from ledger.domain.records import FrozenRun, LeaseArg, limit_micros
from ledger.domain.specs import AdmitSpec
from ledger.domain.timefmt import iso
from ledger.domain.validation import As, Id, Labels, Problem, Time, rule
from ledger.domain.values import Budget, Grant, Route, content_hash
from ledger.errors import InvalidArgument
from ledger.policy.model import Policy
from ledger.redaction import redact

# Classes a run may send to every recipient of its plan when the caller passes no grant.
DEFAULT_GRANT_CLASSES = ("user_input", "system", "tool_description")
DEFAULT_ROLE = "research"


@rule
def _keyless(value: Any) -> frozenset[str] | bool:
    if isinstance(value, bool):
        return value
    if (isinstance(value, str | bytes | Mapping)
            or not isinstance(value, Sequence | set | frozenset)
            or not all(isinstance(v, str) for v in value)):
        raise Problem("is not a set of route ids (or credential profile ids) of the plan",
                      "pass e.g. {'local-llama'}, or True for every route")
    return frozenset(value)


BudgetArg = Annotated[Budget | Mapping[str, Any], As(Budget)]
"""A :class:`~ledger.Budget`, or a mapping of its fields."""
GrantArg = Annotated[Grant | Mapping[str, Any], As(Grant)]
"""A :class:`~ledger.Grant`, or a mapping of its fields."""
Role = Annotated[Id, Field(max_length=64)]
"""A Run's role: an id of at most 64 characters."""


class Terms(TypedDict, total=False):
    """A Run's terms besides its plan, budget, grant and role (see :class:`Admission`).

    A Child session takes these as they are (``RunSession.child``); the others it derives from
    its parent's. A Child's tenant, labels and deadline come from its parent at admission
    (:func:`child_terms`).
    """

    policy: SkipValidation[Policy | str | Mapping[str, Any] | None]
    parent: LeaseArg | None
    tenant: Id | None
    labels: Labels | None
    deadline: Time | None
    selected_route: Id | None
    keyless_ok: Annotated[Collection[str] | bool, _keyless]


class Admission(Terms, total=False):
    """The terms of a Run's admission: the keyword arguments of :meth:`~ledger.Ledger.admit_run`.

    :meth:`~ledger.Ledger.run` and :meth:`~ledger.Ledger.admit_run` take them as keyword
    arguments (``led.run("task-1", plan=routes, budget=budget)``), validated as typed here;
    ``plan`` and ``budget`` are required.

    Attributes:
        plan: The candidate routes in preference order (:class:`~ledger.Route` or mappings of
            their fields; unique ids). A route without a price gets the price table's, frozen
            with the plan.
        budget: The Run's bounds (a :class:`~ledger.Budget` or a mapping of its fields): model
            calls, retries, cost and optionally tokens.
        grant: Which recipients may receive which data classes, and which roles the Run may
            use (default: every recipient of the plan for the caller's own input, system text
            and tool descriptions; a Child inherits its parent's).
        policy: A :class:`~ledger.Policy`, a preset name (``"goclaw"``, ``"fased"``,
            ``"failure-domain"``), a policy file path, or a mapping of its fields (default:
            ``failure-domain``; a Child inherits its parent's).
        role: The role the Run works in (default ``research``; at most 64 characters); routes
            and grants may restrict roles.
        parent: The parent's live lease, to admit a Child Run: its budget is carved from the
            parent's under that lease, and its plan, grant, role and policy may only narrow
            the parent's. What the Child has not used when it ends (``finish_run``,
            ``close_run``, recovery past its deadline) goes back to the parent.
        tenant: Whose Run it is (for the audit's totals and ``/metrics``). A Child's is its
            parent's: left out, it is inherited; another is refused.
        labels: Free labels, string to string (the audit totals by a label); at most 64. A
            Child carries its parent's too, its own winning on a shared key.
        deadline: When the Run must be done by (epoch seconds); capacity waits stop short of
            it. A Child's is at most its parent's: left out, it is inherited; a later one is
            refused.
        selected_route: The route the first turn starts on (default: the plan's first).
        keyless_ok: Route ids (or credential profile ids) of the plan allowed to lack a key,
            e.g. ``{"local-llama"}``; ``True`` for every route. Their keys are not checked at
            admission; a turn that reaches one without a key skips it as unusable.
    """

    plan: Required[Sequence[Route]]
    budget: Required[BudgetArg]
    grant: GrantArg | None
    role: Role


def keyless_ids(value: Collection[str] | bool, plan: Sequence[Route]) -> frozenset[str]:
    """``keyless_ok`` as the route and profile ids of ``plan`` allowed to lack a key.

    ``True`` allows every route; ``False`` or an empty collection none. An id that is neither a
    route nor a credential profile of the plan is refused (a typo would silently check the key
    it meant to excuse).
    """
    if isinstance(value, bool):
        return frozenset(r.id for r in plan) if value else frozenset()
    known = {r.id for r in plan} | {p.id for r in plan for p in r.profiles}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidArgument(
            f"keyless_ok names {', '.join(repr(u) for u in unknown)}, which is no route or "
            f"credential profile of the plan ({', '.join(repr(r.id) for r in plan)}); pass ids "
            "of the plan's routes", field="keyless_ok", unknown=unknown)
    return frozenset(value)


#: Query parameters that carry a credential in the URLs of LLM APIs and their gateways.
_CREDENTIAL_PARAMS = frozenset({"key", "api_key", "apikey", "api-key", "access_token", "token",
                                "password", "secret", "client_secret", "sig", "signature"})


def validate_plan(plan: Sequence[Route]) -> None:
    """A non-empty plan of Routes with unique ids, and no credential in an endpoint."""
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
        if r.endpoint and not r.endpoint.isprintable():
            # A NUL, newline or bidi control never makes a request, and the frozen plan is
            # shown to every auditor and on the dashboard, where a bidi control would make the
            # endpoint read as another. Checked at admission, not by Route itself, so the
            # plans of Runs admitted before this rule still load.
            bad = next(c for c in r.endpoint if not c.isprintable())
            raise InvalidArgument(
                f"route {r.id!r} endpoint contains a control or format character "
                f"(U+{ord(bad):04X}), which no URL carries; remove it or percent-encode it",
                field=f"plan[{i}].endpoint")
        if r.endpoint and "#" in r.endpoint:
            # No request carries a fragment; joined to, it would cut off the protocol's path.
            raise InvalidArgument(
                f"route {r.id!r} endpoint has a #fragment, which no request carries; remove it "
                "from the endpoint", field=f"plan[{i}].endpoint")
        where = _credential_in(r.endpoint)
        if where is not None:
            # Refused before anything is written: the frozen plan is stored as given and read
            # by every auditor. The message does not repeat the URL.
            raise InvalidArgument(
                f"route {r.id!r} endpoint carries a credential ({where}); it would be stored "
                "with the Run's frozen plan: remove it from the URL and give the key through a "
                "credential profile or api_key_env", field=f"plan[{i}].endpoint")


def _credential_in(endpoint: str | None) -> str | None:
    """Where ``endpoint`` carries a credential, or ``None``.

    User info, a credential query parameter, or a key-shaped token anywhere in it.
    """
    if not endpoint:
        return None
    try:
        parts = urlsplit(endpoint)
        userinfo = parts.username is not None or parts.password is not None
        query = parts.query
    except ValueError:
        # Not a URL Python splits (an unclosed "[" of an IPv6 host): the adapter refuses it at
        # the turn (cannot_build), but the plan is stored first, so its authority and query
        # are read as text. The delimiters are RFC 3986's.
        authority = endpoint.partition("//")[2]
        for end in "/?#":
            authority = authority.partition(end)[0]
        userinfo = "@" in authority
        query = endpoint.partition("?")[2].partition("#")[0]
    if userinfo:
        return "user:password@ in the URL"
    named = sorted({k for k, _ in parse_qsl(query, keep_blank_values=True)
                    if k.lower() in _CREDENTIAL_PARAMS})
    if named:
        return f"the query parameter {named[0]!r}"
    if redact(endpoint) != endpoint:
        return "a key-shaped token"
    return None


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


def child_terms(parent: FrozenRun, terms: Admission) -> Admission:
    """``terms`` of a Child of ``parent`` with the tenant, labels and deadline it runs under.

    A Child spends what was carved out of its parent's budget, so its spend is its parent's
    tenant's: no ``tenant`` inherits the parent's, and another one is refused (the audit would
    count the parent's money under a tenant that never had it). Labels are merged, the
    Child's own winning on a shared key, so a total by one of the parent's labels includes the
    Child's spend. A deadline is carved like the budget: no ``deadline`` takes the parent's,
    one at or before it is kept, and a later one is refused as a Child asking for more money
    than its parent has left is (a clamp would silently change what the caller froze).

    Raises:
        InvalidArgument: another ``tenant``, a later ``deadline``, or more than
            :data:`~ledger.domain.bounds.MAX_LABELS` labels once merged; ``field`` names which.
    """
    tenant = terms.get("tenant")
    if tenant is None:
        tenant = parent.tenant
    elif tenant != parent.tenant:
        fix = ("leave tenant out to inherit it" if parent.tenant is not None
               else "admit the parent with that tenant, or leave the child's out")
        raise InvalidArgument(
            f"a child spends its parent's budget, so it belongs to the parent's tenant "
            f"({parent.tenant!r}), not {tenant!r}: {fix}", field="tenant",
            tenant=tenant, parent_tenant=parent.tenant)
    deadline = terms.get("deadline")
    if deadline is None:
        deadline = parent.deadline
    elif parent.deadline is not None and deadline > parent.deadline:
        raise InvalidArgument(
            f"a child cannot outlive its parent: its deadline {iso(deadline)} ({deadline}) is "
            f"after the parent {parent.run_id!r}'s, {iso(parent.deadline)} "
            f"({parent.deadline}); pass one at or before it, or leave deadline out to inherit "
            "it", field="deadline",
            deadline=deadline, parent_deadline=parent.deadline)
    labels = {**parent.labels, **(terms.get("labels") or {})}
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(
            f"the child's labels with its parent's (which it carries) are {len(labels)}, over "
            f"the limit of {MAX_LABELS}: pass fewer labels of its own (a key the parent has "
            "already is inherited)", field="labels")
    return cast(Admission, {**terms, "tenant": tenant, "labels": labels, "deadline": deadline})


def continued_child_terms(frozen: FrozenRun, parent: FrozenRun,
                          terms: Admission) -> Admission | None:
    """``terms`` with the tenant, labels and deadline the Child ``frozen`` was frozen with.

    A Child admitted before Children took these from their parent froze the caller's own,
    which may be another tenant or a later deadline than :func:`child_terms` now allows.
    Entered again under its id, it is the same Run and is continued as it was frozen
    (invariant 5), so long as the caller names none of the three otherwise: a tenant or a
    deadline left out, or the one it holds; labels left out, or the ones it holds (as frozen
    before, or with its parent's under them, as :func:`child_terms` merges them now).

    Returns:
        The terms to admit it again with (the store still compares every other frozen
        term), or ``None``: ``frozen`` is not a Child of ``parent``, or the caller asks for
        another tenant, deadline or labels.
    """
    if frozen.parent_run_id != parent.run_id:
        return None
    for key, held in (("tenant", frozen.tenant), ("deadline", frozen.deadline)):
        given = terms.get(key)
        if given is not None and given != held:
            return None
    labels = terms.get("labels")
    if labels is not None and frozen.labels not in (dict(labels), {**parent.labels, **labels}):
        return None
    return cast(Admission, {**terms, "tenant": frozen.tenant, "labels": frozen.labels,
                            "deadline": frozen.deadline})


def admission_spec(run_id: str, terms: Admission, *, plan: Sequence[Route], grant: Grant,
                   policy: Policy, policy_hash: str) -> AdmitSpec:
    """What admitting ``run_id`` on ``terms`` (validated) writes.

    ``plan``, ``grant`` and ``policy`` are the terms' own as resolved (prices, the default or
    inherited grant, the policy the Run runs under). The frozen plan, grant, budget and policy
    become canonical JSON, beside the content hash that makes a repeated admission of the same
    content idempotent (and a different content under the same id an
    :class:`~ledger.errors.AdmissionConflict`).

    ``selected_route`` (default: the plan's first) must be one of the plan's routes, else
    :class:`~ledger.errors.InvalidArgument`.
    """
    selected = terms.get("selected_route") or plan[0].id
    if selected not in {r.id for r in plan}:
        raise InvalidArgument(f"selected_route {selected!r} is not in the plan; pass "
                              "the id of one of the plan's routes (or None for the first)",
                              field="selected_route")
    budget = cast(Budget, terms["budget"])
    parent, tenant = terms.get("parent"), terms.get("tenant")
    label_map = dict(terms.get("labels") or {})
    role, deadline = terms.get("role", DEFAULT_ROLE), terms.get("deadline")
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
        max_cost_micros=limit_micros(budget.max_cost),
        max_tokens=budget.max_tokens,
    )


__all__ = [
    "DEFAULT_GRANT_CLASSES",
    "DEFAULT_ROLE",
    "Admission",
    "BudgetArg",
    "GrantArg",
    "Role",
    "Terms",
    "admission_spec",
    "admission_terms",
    "check_child_policy",
    "child_grant",
    "child_terms",
    "continued_child_terms",
    "default_grant",
    "keyless_ids",
    "validate_plan",
]
