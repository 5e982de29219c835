"""The selector: which route (and credential profile) serves the next Attempt, or why none may.

A pure function of a frozen :class:`SelectionInput`; it reads no clock and no store. It grants
nothing: the Run still reserves the retry permission, admission still acquires capacity, and the
dispatcher still re-checks. What it adds is a decision that can be explained: every candidate it
passed over is listed in :attr:`Decision.skipped` with the reason and a human-readable detail.

Decision order (``docs/selector.md`` walks through it with examples):

1. With a failure, stop reasons in this order: ``failover_disabled``, ``role_excluded``,
   ``output_exists``, ``execution_unknown``, ``not_eligible_failure``, ``retry_allowance``.
   A new turn (no failure) stops only when no model call is left.
2. The walk: candidates in frozen plan order, leaving out the failed route and the routes
   already tried in this turn. With profile rotation, the failed route's other usable profiles
   come first. A new turn starts at the first plan entry, or on the route the Run actually used.
3. Each candidate's checks, in order: group evidence, health (cooldown, probe), capability,
   role qualification, disclosure. The first candidate that passes every check is chosen.
4. Nothing passed: ``no_candidate`` - unless the policy always tries the last candidate, in which
   case the last candidate that failed on health alone is chosen anyway, provided it is still
   ahead of the route that just failed in plan order (the walk never goes back).

A decision acted on after a wait (a full group's queue, a group's waiting floor) is looked at
again with fresh facts by :func:`recheck`: the chosen route must still pass its checks, else the
turn decides again.

Every behaviour above is driven by fields of the failure fact and the policy; nothing here knows
a preset by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ledger.decide.health import probe_eligible, route_key
from ledger.decide.preflight import (
    DEFAULT_TOKEN_COUNTER,
    NO_DENIALS,
    Denials,
    PreflightFailure,
    RequestNeeds,
    TokenCounter,
    envelope_needs,
    preflight,
    with_prompt,
)
from ledger.decide.profiles import (
    Pin,
    auth_order_key,
    available_at,
    first_usable,
    rotation_order,
    sticky_profile,
    usable,
)
from ledger.domain.carried import Uncarried
from ledger.domain.envelope import Envelope
from ledger.domain.facts import FailureFact, Phase, Scope, Source
from ledger.domain.timefmt import duration, iso, relative
from ledger.domain.values import Grant, GroupMode, GroupProjection, Health, Profile, Route
from ledger.errors import InvalidArgument
from ledger.policy.model import FailoverPolicy, Policy, ProfilePolicy


class Reason(StrEnum):
    """Why the selector stopped, or why it passed over a candidate."""

    # stop reasons, tested in this order
    FAILOVER_DISABLED = "failover_disabled"
    ROLE_EXCLUDED = "role_excluded"
    OUTPUT_EXISTS = "output_exists"
    EXECUTION_UNKNOWN = "execution_unknown"
    NOT_ELIGIBLE_FAILURE = "not_eligible_failure"
    RETRY_ALLOWANCE = "retry_allowance"
    CALL_ALLOWANCE = "call_allowance"  # a new turn with no model call left
    NO_CANDIDATE = "no_candidate"
    # skip reasons, in candidate-check order
    ALREADY_TRIED = "already_tried"
    SAME_GROUP_UNAVAILABLE = "same_group_unavailable"
    INDEPENDENT_GROUP_REQUIRED = "independent_group_required"
    ROUTE_COOLDOWN = "route_cooldown"
    PROBE_THROTTLED = "probe_throttled"
    CAPABILITY = "capability"
    NOT_QUALIFIED = "not_qualified"
    DISCLOSURE = "disclosure"


#: Skips by credential that no wait ends: never probed, never "the last candidate tried".
_NO_CREDENTIAL = (Reason.ALREADY_TRIED, Reason.NOT_QUALIFIED)


def _unlisted(route: Route, policy: ProfilePolicy) -> str:
    ids = ", ".join(p.id for p in route.profiles)
    # The key as the policy spells it: auth_order matches the provider case-insensitively.
    key = auth_order_key(policy, route.provider) or route.provider
    return (f"profiles.auth_order[{key!r}] lists none of its profiles ({ids}); "
            "list one of them there, or remove the entry to use them all")


class DecisionKind(StrEnum):
    """What the selector decided: a route to send on, a probe of the primary, or a stop."""

    ROUTE = "route"  # send the next Attempt on this route
    PROBE = "probe"  # send it on the cooling primary to learn whether it is back
    STOP = "stop"  # no further Attempt for this request


@dataclass(frozen=True, slots=True)
class RunPermissions:
    """What the Run still allows, as the Run's ledger sees it now."""

    retries_left: int
    calls_left: int
    tried: frozenset[str] = frozenset()  # route ids that failed in this logical turn
    # Profile ids marked tried for the whole turn: no route uses them again in it.
    tried_profiles: frozenset[str] = frozenset()
    # (route id, profile id) pairs that failed in this turn: a rotation inside that route
    # never returns to them, while the profile stays a candidate on other routes.
    tried_pairs: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True, slots=True)
class Skip:
    """One eliminated candidate. ``profile`` is set when one credential profile was skipped.

    ``fix`` says what would make the candidate eligible, where the host can do something
    (approve a recipient for a data class, qualify a route for a role); empty otherwise.
    """

    route: str
    reason: Reason
    detail: str = ""
    profile: str | None = None
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        """The skip as JSON data (stored in the ``select`` and ``stop`` events)."""
        out: dict[str, Any] = {
            "route": self.route,
            "reason": self.reason.value,
            "detail": self.detail,
            "profile": self.profile,
        }
        if self.fix:
            out["fix"] = self.fix
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Skip:
        """The skip :meth:`to_json` wrote."""
        return cls(route=data["route"], reason=Reason(data["reason"]),
                   detail=data.get("detail", ""), profile=data.get("profile"),
                   fix=data.get("fix", ""))


@dataclass(frozen=True, slots=True)
class Decision:
    """The selector's answer: ``kind``, the ``route`` and credential ``profile`` to use.

    A stop carries its ``reason`` and ``detail``; ``skipped`` lists every candidate passed over
    and why, in the order the selector considered them.
    """

    kind: DecisionKind
    route: Route | None = None
    profile: str | None = None
    reason: Reason | None = None  # set for a stop
    detail: str = ""
    skipped: tuple[Skip, ...] = ()

    @property
    def route_id(self) -> str | None:
        """The chosen route's id (``None`` for a stop)."""
        return self.route.id if self.route is not None else None

    def to_json(self) -> dict[str, Any]:
        """The decision as JSON data (the ``select`` audit event of the Attempt it led to)."""
        return {
            "kind": self.kind.value,
            "route": self.route_id,
            "profile": self.profile,
            "reason": self.reason.value if self.reason is not None else None,
            "detail": self.detail,
            "skipped": [s.to_json() for s in self.skipped],
        }


@dataclass(frozen=True, slots=True)
class SelectionInput:
    """Everything the selector reads. Build one per decision.

    ``plan``: the Run's frozen candidate routes, first = the Run's primary. ``request``: the
    prepared :class:`Envelope` (with ``provenance``, the ledger's ``ref -> content hashes``
    record) or a :class:`RequestNeeds`. ``grant`` ``None`` approves every plan recipient for
    every class. ``health`` is keyed by health key (``ledger.decide.health.route_key``: route id or
    ``provider:<name>``) or by profile id. With a ``failure``,
    ``current``/``current_profile`` are what just failed; without one (a new turn), what the Run
    used last (under a user pin, ``current_profile`` is the pinned profile, which a failover to
    another one does not replace). ``denials`` are switch-offs and revocations in the *current*
    configuration.
    ``no_probe``: routes whose probe another process claimed during this turn; they are not
    offered as a probe again (the Run decides without them). ``verdicts``: the first failed
    preflight check of each plan route for this request (absent or ``None``: it passes), decided
    beforehand (:func:`preflight_verdicts`; a replay passes the recorded ones); ``None``
    (the default): each candidate is checked from ``request`` as the walk reaches it.
    ``part_hashes`` and ``uncarried`` (what :func:`~ledger.domain.carried.uncarried` found in
    the request envelope) save computing them again when the caller has them.
    """

    plan: Sequence[Route]
    permissions: RunPermissions
    policy: Policy
    now: float
    request: Envelope | RequestNeeds = field(default_factory=RequestNeeds)
    role: str = "research"
    grant: Grant | None = None
    groups: Mapping[str, GroupProjection] = field(default_factory=dict)
    health: Mapping[str, Health] = field(default_factory=dict)
    current: str | None = None
    current_profile: str | None = None
    pin: Pin | None = None
    failure: FailureFact | None = None
    denials: Denials = NO_DENIALS
    provenance: Mapping[str, Set[str]] = field(default_factory=dict)
    token_counter: TokenCounter = DEFAULT_TOKEN_COUNTER
    part_hashes: Sequence[str] | None = None
    uncarried: Sequence[Uncarried] | None = None
    no_probe: frozenset[str] = frozenset()
    verdicts: Mapping[str, PreflightFailure | None] | None = None


def _sharing_key(counter: TokenCounter, route: Route) -> Any:
    """What routes a counter's estimate is shared by (``None``: this route alone)."""
    key = getattr(counter, "sharing_key", None)
    if callable(key):
        return ("key", key(route))
    return ("all",) if getattr(counter, "route_independent", False) else None


# ---------------------------------------------------------------------------------------------
# stop checks


def _article(word: str) -> str:
    # Every category that starts with a vowel letter starts with a vowel sound (auth,
    # overloaded, unknown, unusable).
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"


def _stop(reason: Reason, detail: str, skipped: Sequence[Skip] = ()) -> Decision:
    return Decision(kind=DecisionKind.STOP, reason=reason, detail=detail, skipped=tuple(skipped))


def role_excluded(role: str, fo: FailoverPolicy) -> bool:
    """Whether the Run's role never fails over (``excluded_roles``, case-insensitively)."""
    r = role.casefold()
    return any(r == e.casefold() for e in fo.excluded_roles)


def _failure_stop(inp: SelectionInput, fact: FailureFact) -> Decision | None:
    fo = inp.policy.failover
    if not fo.enabled:
        return _stop(Reason.FAILOVER_DISABLED, "failover is switched off by the policy")
    if role_excluded(inp.role, fo):
        return _stop(Reason.ROLE_EXCLUDED, f"role {inp.role!r} never fails over")
    # A started tool always stops: another route would run the tool again (invariant 9).
    if fact.tool_started:
        return _stop(Reason.OUTPUT_EXISTS, "a tool of this reply already started")
    if fact.effective_output and fo.after_effective_output == "stop":
        return _stop(Reason.OUTPUT_EXISTS, "the attempt already produced effective output")
    # Sent with no answer (or cut mid-stream): not observing success is not proof that nothing
    # executed remotely, so the request is not sent again unless the policy explicitly allows.
    if (
        not fact.resubmit
        and fact.phase in (Phase.AFTER_SEND, Phase.MID_STREAM)
        and not fo.resubmit_unknown_execution
    ):
        return _stop(
            Reason.EXECUTION_UNKNOWN,
            f"the request may have executed (phase {fact.phase}); it is not resubmitted",
        )
    if not fact.moves_on:
        return _stop(
            Reason.NOT_ELIGIBLE_FAILURE,
            f"{_article(fact.category.value)} {fact.category} failure does not allow another "
            "route",
        )
    left = inp.permissions
    if left.retries_left <= 0 or left.calls_left <= 0:
        return _stop(
            Reason.RETRY_ALLOWANCE,
            f"retries left {left.retries_left}, model calls left {left.calls_left}",
        )
    return None


# ---------------------------------------------------------------------------------------------
# candidates and their checks


@dataclass(frozen=True, slots=True)
class _Candidate:
    route: Route
    profile: Profile | None = None  # fixed for a profile rotation on the failed route
    rotation: bool = False


@dataclass(frozen=True, slots=True)
class _Verdict:
    reason: Reason | None = None
    detail: str = ""
    fix: str = ""
    profile: Profile | None = None
    probe: bool = False
    # Failed on health only (everything else passed): eligible for "last candidate always tried".
    health_only: bool = False

    @property
    def ok(self) -> bool:
        return self.reason is None


class _Walk:
    """One selection's context: the input plus the lookups every check needs."""

    def __init__(self, inp: SelectionInput) -> None:
        self.inp = inp
        self.policy = inp.policy
        self.now = inp.now
        self.by_id = {r.id: r for r in inp.plan}
        self.index = {r.id: i for i, r in enumerate(inp.plan)}
        self.primary = inp.plan[0]
        self.failed = self.by_id[inp.current] if inp.failure is not None and inp.current else None
        # Without an explicit pin, a sticky policy keeps the session's profile as an auto pin.
        self.pin = inp.pin if inp.pin is not None else (
            Pin.AUTO if inp.policy.profiles.sticky else None)
        self._base: RequestNeeds | None = None
        # The needs by the counter's sharing key: a counter with ``sharing_key(route)`` (the
        # default's is the protocol) counts once per key, one with ``route_independent`` once.
        self._shared: dict[Any, RequestNeeds] = {}

    def needs(self, route: Route) -> RequestNeeds:
        """The request's needs for ``route``; what holds for every route is computed once."""
        inp = self.inp
        request = inp.request
        if not isinstance(request, Envelope):
            return request
        counter = inp.token_counter
        key = _sharing_key(counter, route)
        if key is not None and key in self._shared:
            return self._shared[key]
        if self._base is None:
            self._base = envelope_needs(request, recorded=inp.provenance,
                                        part_hashes=inp.part_hashes, found=inp.uncarried)
        needs = with_prompt(self._base, request, counter.count_tokens(request, route))
        if key is not None:
            self._shared[key] = needs
        return needs

    # -- group evidence ------------------------------------------------------------------------

    def group(self, route: Route) -> tuple[Reason, str] | None:
        fo = self.policy.failover
        if not fo.group_aware:
            return None
        fact = self.inp.failure
        failed = self.failed
        if (
            fact is not None
            and failed is not None
            and fact.scope is Scope.GROUP
            and fact.source is Source.PROVIDER
            and route.group == failed.group
        ):
            # A group-scoped fact with a provider status (a trusted 429) establishes that the
            # group is unavailable; one without any response (a DNS failure before send) is
            # evidence against the shared endpoint itself, so only another group may serve.
            if fact.status is None:
                what = fact.transport.value if fact.transport is not None else fact.category
                return (
                    Reason.INDEPENDENT_GROUP_REQUIRED,
                    f"{what} before anything was sent on group {failed.group!r}: only another "
                    "group may serve",
                )
            return (
                Reason.SAME_GROUP_UNAVAILABLE,
                f"provider {fact.status} on {failed.id!r} established group "
                f"{failed.group!r} unavailable",
            )
        proj = self.inp.groups.get(route.group)
        if proj is None or proj.sampled_at is None:
            return None  # a missing projection counts as open
        age = self.now - proj.sampled_at
        if age > fo.group_fact_max_age_s:
            return None  # stale: a hint this old says nothing about now
        if proj.mode is GroupMode.UNAVAILABLE:
            return (
                Reason.SAME_GROUP_UNAVAILABLE,
                f"group {route.group!r} unavailable (sampled {duration(age)} ago)",
            )
        # A cooldown with no known end is treated as still running: the projection only ever
        # eliminates candidates, so erring towards "unavailable" grants nothing.
        if proj.mode is GroupMode.COOLDOWN and (proj.until is None or proj.until > self.now):
            return (
                Reason.SAME_GROUP_UNAVAILABLE,
                f"group {route.group!r} cooling until {_until(proj.until, self.now)} "
                f"(sampled {duration(age)} ago)",
            )
        return None

    # -- health --------------------------------------------------------------------------------

    def _probe_allowed(self, route: Route, until: float, why: str) -> tuple[Reason, str] | None:
        """For a cooling or disabled route: ``None`` = probe it now, else the skip reason.

        ``why`` says what keeps it unusable until then (:func:`_unusable`).
        """
        pp = self.policy.probe
        off = f"{why} until {_until(until, self.now)}"
        # Only the Run's own route is probed, and only when there is somewhere else to go.
        if not (pp.enabled and route.id == self.primary.id and len(self.inp.plan) > 1):
            return (Reason.ROUTE_COOLDOWN, off)
        if self.now < until - pp.margin_s:
            return (Reason.ROUTE_COOLDOWN, f"{off}; too early to probe")
        if route.id in self.inp.no_probe:
            return (Reason.PROBE_THROTTLED, f"{off}; another process claimed its probe")
        h = self.inp.health.get(route_key(route, self.policy))
        last = h.last_probe_at if h is not None else None
        if last is not None and self.now - last >= pp.ttl_s:
            last = None  # probe state past its TTL is forgotten
        # The route cools either by its own key or because every profile cools; the probe rule
        # reads one "available again at" time, so it is given exactly that.
        state = Health(key=route.id, cooldown_until=until, last_probe_at=last)
        if probe_eligible(state, self.now, self.policy):
            return None
        assert last is not None  # inside the margin, so only the throttle can refuse
        return (
            Reason.PROBE_THROTTLED,
            f"{off}; last probe {duration(self.now - last)} ago "
            f"(< {duration(pp.interval_s)})",
        )

    def health(self, cand: _Candidate) -> tuple[Profile | None, tuple[Reason, str] | None, bool]:
        """(profile to use, skip reason or None, probe?) for one candidate."""
        route = cand.route
        inp = self.inp
        route_health = inp.health.get(route_key(route, self.policy))
        route_until = available_at(route_health, self.now)
        profile = cand.profile
        profile_until: float | None = None
        profile_health: Health | None = None
        if route.profiles and profile is None:
            tried = inp.permissions.tried_profiles
            pp = self.policy.profiles
            if inp.failure is None:
                profile = sticky_profile(
                    route.profiles,
                    route.provider,
                    inp.health,
                    self.now,
                    pp,
                    current=inp.current_profile,
                    pin=self.pin,
                    exclude=tried,
                )
            else:
                profile = first_usable(
                    route.profiles, route.provider, inp.health, self.now, pp, exclude=tried
                )
            if profile is None:
                order = rotation_order(route.profiles, route.provider, inp.health, self.now, pp)
                if not order:
                    # auth_order names none of this route's profiles: it has no credential the
                    # policy lets it use.
                    return None, (Reason.NOT_QUALIFIED, _unlisted(route, pp)), False
                left = [p for p in order if p.id not in tried]
                if not left:
                    return None, (Reason.ALREADY_TRIED, "every profile already tried"), False
                ends = [(available_at(inp.health.get(p.id), self.now), p.id) for p in left]
                profile_until, soonest = min((e, k) for e, k in ends if e is not None)
                profile_health = inp.health.get(soonest)
        if route_until is None and profile_until is None:
            return profile, None, False
        until = max(t for t in (route_until, profile_until) if t is not None)
        why = _unusable(route_health if until == route_until else profile_health, self.now)
        skip = self._probe_allowed(route, until, why)
        if skip is None:
            return profile or self._forced_profile(route), None, True
        return profile, skip, False

    def _forced_profile(self, route: Route) -> Profile | None:
        """A profile for a cooling route chosen anyway (probe, last candidate): soonest back."""
        tried = self.inp.permissions.tried_profiles
        order = rotation_order(
            route.profiles, route.provider, self.inp.health, self.now, self.policy.profiles
        )
        left = [p for p in order if p.id not in tried]
        return left[0] if left else None

    def ahead(self, cand: _Candidate) -> bool:
        """Whether ``cand`` is still ahead in the walk: after the failed route in plan order.

        A new turn's whole walk is ahead; so is a rotation inside the failed route.
        """
        failed = self.failed
        if failed is None or cand.rotation:
            return True
        return self.index[cand.route.id] > self.index[failed.id]

    # -- one candidate -------------------------------------------------------------------------

    def verdict(self, route: Route) -> PreflightFailure | None:
        """The first failed preflight check of ``route`` for the request (``None``: passes)."""
        inp = self.inp
        if inp.verdicts is not None:
            return inp.verdicts.get(route.id)
        return preflight(
            route, self.needs(route), grant=inp.grant, role=inp.role, denials=inp.denials
        ).first

    def evaluate(self, cand: _Candidate) -> _Verdict:
        route = cand.route
        grp = self.group(route)
        if grp is not None:
            return _Verdict(reason=grp[0], detail=grp[1])
        profile, health_skip, probe = self.health(cand)
        if health_skip is not None and health_skip[0] in _NO_CREDENTIAL:
            return _Verdict(reason=health_skip[0], detail=health_skip[1])
        pf = self.verdict(route)
        if health_skip is not None:
            return _Verdict(
                reason=health_skip[0],
                detail=health_skip[1],
                profile=profile or self._forced_profile(route),
                health_only=pf is None,
            )
        if pf is not None:
            return _Verdict(reason=Reason(pf.check.value), detail=pf.detail, fix=pf.fix)
        return _Verdict(profile=profile, probe=probe)

    # -- the candidate sequence ----------------------------------------------------------------

    def failure_sequence(self, skipped: list[Skip]) -> list[_Candidate]:
        inp = self.inp
        failed = self.failed
        assert failed is not None
        seq: list[_Candidate] = []
        pp = self.policy.profiles
        if pp.rotate_before_model and inp.pin is not Pin.USER and failed.profiles:
            # Rotate credentials inside the failed route before changing the model. The route
            # being in ``tried`` does not exclude it here: another account may well succeed.
            tried = inp.permissions.tried_profiles
            for p in rotation_order(failed.profiles, failed.provider, inp.health, self.now, pp):
                if p.id == inp.current_profile:
                    continue
                if p.id in tried or (failed.id, p.id) in inp.permissions.tried_pairs:
                    skipped.append(
                        Skip(failed.id, Reason.ALREADY_TRIED, "profile already tried", p.id)
                    )
                elif not usable(p.id, inp.health, self.now):
                    h = inp.health.get(p.id)
                    until = available_at(h, self.now)
                    skipped.append(
                        Skip(
                            failed.id,
                            Reason.ROUTE_COOLDOWN,
                            f"profile {_unusable(h, self.now)} until {_until(until, self.now)}",
                            p.id,
                        )
                    )
                else:
                    seq.append(_Candidate(failed, p, rotation=True))
        for r in inp.plan:
            if r.id == failed.id:
                skipped.append(Skip(r.id, Reason.ALREADY_TRIED, "the route that just failed"))
            elif r.id in inp.permissions.tried:
                # Tried is all the selector knows: it failed, ended unknown, or was refused
                # before it was sent; the stop's candidate line says which.
                skipped.append(Skip(r.id, Reason.ALREADY_TRIED, "already tried in this turn"))
            else:
                seq.append(_Candidate(r))
        return seq

    def new_turn_sequence(self, skipped: list[Skip]) -> list[_Candidate]:
        inp = self.inp
        fo = self.policy.failover
        start = self.primary
        if fo.new_turn == "keep_current" and inp.current is not None:
            # Continue on the route the Run actually used; jumping back to the primary because
            # the configuration was consulted again would silently change the model mid-task.
            start = self.by_id[inp.current]
        order = [start, *(r for r in inp.plan if r.id != start.id)]
        # A Run that may not fail over still sends its new turn, but only on its own route.
        if not fo.enabled or role_excluded(inp.role, fo):
            order = [start]
        seq: list[_Candidate] = []
        for r in order:
            if r.id in inp.permissions.tried:
                skipped.append(Skip(r.id, Reason.ALREADY_TRIED, "already tried in this turn"))
            else:
                seq.append(_Candidate(r))
        return seq


def _validate(inp: SelectionInput) -> None:
    if inp.part_hashes is not None and (
        not isinstance(inp.request, Envelope) or len(inp.part_hashes) != len(inp.request.parts)
    ):
        raise InvalidArgument(
            "part_hashes must give one hash per part of the request envelope, in order; "
            "leave it None to have them computed", field="part_hashes")
    if not inp.plan:
        raise InvalidArgument("the plan is empty; a Run needs at least one route", field="plan")
    ids = [r.id for r in inp.plan]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"duplicate route ids in the plan: {ids}", field="plan")
    if inp.current is not None and inp.current not in ids:
        raise InvalidArgument(
            f"current route {inp.current!r} is not in the Run's frozen plan {ids}",
            field="current",
        )
    if inp.failure is not None and inp.current is None:
        raise InvalidArgument(
            "a failure needs the route it happened on; pass current=<failed route id>",
            field="current",
        )


def preflight_verdicts(inp: SelectionInput) -> dict[str, PreflightFailure | None]:
    """The first failed preflight check of every plan route for ``inp``'s request.

    ``None`` for a route that passes. Preflight reads the request, the grant, the role and the
    current denials, never the policy or the time, so these verdicts hold for any policy the
    same request is decided under: the turn decides with them
    (:attr:`SelectionInput.verdicts`) and records the failed ones with the decision.
    """
    walk = _Walk(inp if inp.verdicts is None else replace(inp, verdicts=None))
    return {r.id: walk.verdict(r) for r in inp.plan}


def select(inp: SelectionInput) -> Decision:
    """Choose the next route (or a probe), or stop; always with the skipped candidates."""
    _validate(inp)
    walk = _Walk(inp)
    skipped: list[Skip] = []
    if inp.failure is not None:
        stop = _failure_stop(inp, inp.failure)
        if stop is not None:
            return stop
        seq = walk.failure_sequence(skipped)
    else:
        if inp.permissions.calls_left <= 0:
            return _stop(Reason.CALL_ALLOWANCE,
                         "no model call left in the Run (its budget's max_calls is used up)")
        seq = walk.new_turn_sequence(skipped)

    last_cooling: tuple[_Candidate, _Verdict, int] | None = None
    for cand in seq:
        v = walk.evaluate(cand)
        if v.ok:
            return Decision(
                kind=DecisionKind.PROBE if v.probe else DecisionKind.ROUTE,
                route=cand.route,
                profile=v.profile.id if v.profile is not None else None,
                detail="probe of the cooling primary" if v.probe else "",
                skipped=tuple(skipped),
            )
        assert v.reason is not None
        if v.health_only:
            last_cooling = (cand, v, len(skipped))
        skipped.append(
            Skip(
                cand.route.id,
                v.reason,
                v.detail,
                cand.profile.id if cand.rotation and cand.profile is not None else None,
                v.fix,
            )
        )

    if inp.policy.failover.last_candidate_always_tried and last_cooling is not None:
        cand, v, idx = last_cooling
        if walk.ahead(cand):
            # Every candidate left after the other checks is cooling: rather than failing
            # without trying, send to the last of them (goclaw). Capability, role and
            # disclosure still held.
            return Decision(
                kind=DecisionKind.ROUTE,
                route=cand.route,
                profile=v.profile.id if v.profile is not None else None,
                detail=f"last candidate always tried ({v.detail})",
                skipped=tuple(skipped[:idx] + skipped[idx + 1 :]),
            )
        # GoClaw's chain only moves forward: an entry the walk passed for its cooldown is not
        # "left" once a later entry failed, so the request ends instead of going back to it.
        assert walk.failed is not None  # a new turn's walk is all ahead
        return _stop(
            Reason.NO_CANDIDATE,
            "every remaining candidate was eliminated; the cooling entries left come before "
            f"{walk.failed.id!r} in the plan and the walk has passed them (only an entry still "
            "ahead is the last candidate always tried)",
            skipped,
        )
    return _stop(Reason.NO_CANDIDATE, "every remaining candidate was eliminated", skipped)


def recheck(inp: SelectionInput, decision: Decision) -> Skip | None:
    """Why the route ``decision`` chose no longer serves on fresher facts, or ``None``.

    ``inp`` is the decision's input with a fresh read (health, groups, the time) after the
    turn waited to act on it (a full group's queue, a group's waiting floor): the chosen route
    (and its credential profile) must still pass the checks the walk made of it (group
    evidence, health, capability, role, disclosure). A route the selector would choose again
    as it stands (the last candidate always tried) still serves. A probe is not looked at
    again: it was chosen because the route cools. ``None`` also for a still eligible route
    that is no longer the first choice (an earlier one reopened): the decision keeps the place
    it waited for.
    """
    route = decision.route
    if decision.kind is not DecisionKind.ROUTE or route is None:
        return None
    _validate(inp)
    walk = _Walk(inp)
    # A profile rotation inside the failed route is checked with its profile, as the walk did.
    rotation = inp.failure is not None and route.id == inp.current
    fixed = next((p for p in route.profiles if p.id == decision.profile), None)
    v = walk.evaluate(_Candidate(route, fixed if rotation else None, rotation=rotation))
    skip: Skip | None = None
    if not v.ok:
        assert v.reason is not None
        skip = Skip(route.id, v.reason, v.detail, decision.profile if rotation else None, v.fix)
    elif decision.profile is not None and not usable(decision.profile, inp.health, inp.now):
        h = inp.health.get(decision.profile)
        skip = Skip(route.id, Reason.ROUTE_COOLDOWN,
                    f"profile {_unusable(h, inp.now)} until "
                    f"{_until(available_at(h, inp.now), inp.now)}", decision.profile)
    if skip is None:
        return None
    again = select(inp)
    if (again.kind is DecisionKind.ROUTE and again.route_id == route.id
            and again.profile == decision.profile):
        return None
    return skip


def reopenings(inp: SelectionInput) -> list[float]:
    """When the things that can eliminate a candidate of ``inp`` end, soonest first.

    The future ends of fresh capacity-group floors (a cooldown projection, e.g. from a trusted
    429's Retry-After) and, where the policy waits for routes to reopen
    (``failover.wait_for_reopening``), of the plan's route and profile cooldowns and disables.
    """
    fo = inp.policy.failover
    now = inp.now
    times: set[float] = set()
    for proj in inp.groups.values():
        if (proj.mode is GroupMode.COOLDOWN and proj.until is not None
                and proj.sampled_at is not None
                and now - proj.sampled_at <= fo.group_fact_max_age_s and proj.until > now):
            times.add(proj.until)
    if fo.wait_for_reopening:
        keys = {route_key(r, inp.policy) for r in inp.plan} | {
            p.id for r in inp.plan for p in r.profiles}
        for key in keys:
            until = available_at(inp.health.get(key), now)
            if until is not None:
                times.add(until)
    return sorted(times)


def first_reopening(inp: SelectionInput, decision: Decision) -> float | None:
    """The soonest time at which the selector, on the same facts, would no longer stop.

    ``None`` when ``decision`` is no ``no_candidate`` stop or nothing that eliminated a
    candidate ever ends by itself (a disclosure refusal, a failure's own group evidence).
    """
    if decision.kind is not DecisionKind.STOP or decision.reason is not Reason.NO_CANDIDATE:
        return None
    for until in reopenings(inp):
        if select(replace(inp, now=until)).kind is not DecisionKind.STOP:
            return until
    return None


def reopening_wait(inp: SelectionInput, decision: Decision, *, max_wait_s: float,
                   deadline: float | None) -> float:
    """How long a turn that found no candidate waits before it decides again, or 0.

    When the only candidates that could serve are cooling - in capacity groups whose waiting
    floor ends soon (every policy, for a new turn) or, where the policy waits for routes to
    reopen (``failover.wait_for_reopening``), routes or profiles whose cooldown ends soon (also
    after a failure) - and the soonest time at which the selector would then choose a route is
    within ``max_wait_s`` and not after the Run's ``deadline``, the turn waits until then. It
    never waits for a reopening it could not then use: a failure's own group evidence
    (``same_group_unavailable``, ``independent_group_required``) holds whatever the time, so a
    group-scoped failure keeps its real result (seed 003: no same-group escape).
    """
    if inp.failure is not None and not inp.policy.failover.wait_for_reopening:
        return 0.0
    until = first_reopening(inp, decision)
    if until is None or until - inp.now > max_wait_s:
        return 0.0
    if deadline is not None and until > deadline:
        return 0.0
    return until - inp.now


def _unusable(health: Health | None, now: float) -> str:
    """What keeps a key unusable until it is available again: ``cooling`` or ``disabled (…)``.

    A disable (billing under fased, any disable rule) is not a cooldown: an operator reading
    the skip needs to know which, so the state whose end is the later one names it.
    """
    d = health.disabled_until if health is not None else None
    if health is None or d is None or now >= d:
        return "cooling"
    if health.cooldown_until is not None and health.cooldown_until > d:
        return "cooling"
    return f"disabled ({health.disabled_reason})" if health.disabled_reason else "disabled"


def _until(ts: float | None, now: float) -> str:
    """An end time in a reason a person reads: ``2026-01-31T18:00:30Z (in 25 s)``."""
    if ts is None:
        return "an unknown time"
    return f"{iso(ts)} ({relative(ts, now)})"

__all__ = [
    "Decision",
    "DecisionKind",
    "Reason",
    "RunPermissions",
    "SelectionInput",
    "Skip",
    "first_reopening",
    "preflight_verdicts",
    "recheck",
    "reopening_wait",
    "reopenings",
    "role_excluded",
    "select",
]
