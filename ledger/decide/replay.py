"""Replay: what another policy would have done on the recorded facts, and at what cost.

Pure: :func:`replay` is a function of a :class:`History` (the records of a window, read once
by :mod:`ledger.ops.replay`) and a :class:`~ledger.policy.model.Policy`; it reads no clock, no
store and no network, and calls no provider.

**Decision points.** Every decision a turn recorded with its inputs
(:mod:`ledger.decide.inputs`): the first route of a turn, each same-route retry, each move after
a failure or an admission refusal, and each stop. At each one the other policy decides on the
recorded facts: the failure fact of the failed Attempt (classified again under the other policy
where the recorded fields allow it, :func:`refact`), the capacity-group projections and health
it would have read, the Run's frozen plan, grant and role, what the Run still allowed, what the
turn had tried, and the preflight verdict of every plan route. The other policy's same-route
retry rule comes first after a failure, then the selector, then (for a turn that finds no
candidate) its wait for a reopening. Where it decides differently, the difference is counted,
grouped (:class:`Finding`), with examples.

**The world the other policy reads.** Health and group projections are kept by a policy's own
rules (cooldown lengths, which key a failure cools, whether a provider 429 closes a group).
Where the other policy's rules for them equal the recorded Run's, it reads what was recorded at
that moment; otherwise what its own rules would have made of the same recorded outcomes: every
settled Attempt of the window (and of a lead-in before it, as long as the policy remembers
failures) folded, in settle order, through the settle rules (:mod:`ledger.decide.settle`) under
the other policy. Operator changes to a group and admission's own refusals stay as recorded.

**Outcomes.** Each turn is followed as recorded while the other policy makes the same choice
(the same route, or the same stop). Where it chooses a route that was not tried at that moment,
the outcome is estimated (:class:`Estimate`) from other Runs' Attempts on that route in the
window, near that time: the share that succeeded, the money they took, how long they took, and
their most common failure, from which the other policy decides again, until the turn is served
or stops. These are expected values, and the report says how much of it rests on them. A turn
the other policy stops ends there; a Run whose turn it stops makes no further turns.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from ledger.decide.classify import reclassify, refile
from ledger.decide.health import as_read, route_key
from ledger.decide.inputs import (
    RecordedInputs,
    decided_again,
    parse_inputs,
    selection_input,
)
from ledger.decide.profiles import marks_profile_tried
from ledger.decide.retry import retry_decision
from ledger.decide.select import (
    Decision,
    DecisionKind,
    Reason,
    SelectionInput,
    reopening_wait,
    select,
)
from ledger.decide.settle import group_update, health_updates
from ledger.domain.facts import Category, FailureFact
from ledger.domain.records import Outcome, from_micros
from ledger.domain.values import Grant, GroupProjection, Health, Price, Route
from ledger.errors import InvalidArgument
from ledger.policy.load import policy_hash
from ledger.policy.model import Policy
from ledger.redaction import redact_data

#: How far from a decision other Runs' Attempts on a route count as "near that time".
NEAR_S = 1800.0
#: Fewer Attempts than this near the time: the whole window's are used.
MIN_NEAR = 5
#: How many examples each finding keeps.
EXAMPLES = 3
#: The longest chain of estimated Attempts one turn is followed for.
MAX_ESTIMATED = 16
#: The longest lead-in folded before the window for health the other policy keeps itself.
MAX_LEAD_IN_S = 86400.0

# States of an Attempt that left the process: a model call.
_CALLS = frozenset({"succeeded", "failed", "unknown", "dispatching"})
_SENT = frozenset({"succeeded", "failed", "unknown"})
_GROUP_SKIPS = frozenset({Reason.SAME_GROUP_UNAVAILABLE.value,
                          Reason.INDEPENDENT_GROUP_REQUIRED.value})
_COOLING_SKIPS = frozenset({Reason.ROUTE_COOLDOWN.value, Reason.PROBE_THROTTLED.value})


# -- the records a replay reads ---------------------------------------------------------------


@dataclass(frozen=True)
class RunFacts:
    """A Run of the window as recorded: what it froze at admission and how it ended.

    ``policy`` is ``None`` when its frozen policy does not read as a policy (a bulk-loaded
    history's marker): its turns are not replayed.
    """

    run_id: str
    tenant: str | None
    role: str
    status: str
    plan: tuple[Route, ...]
    grant: Grant
    policy: Policy | None
    policy_hash: str
    deadline: float | None
    created_at: float


@dataclass(frozen=True)
class AttemptFacts:
    """One recorded Attempt, as a replay reads it.

    ``money_micros`` is what its debit took from the budget (posted, or still held);
    ``fact`` the recorded failure fact's JSON text (``None`` without one); ``retry`` the number
    of the same-route retry it was (0 for none); ``policy_hash`` its Run's.
    """

    attempt_id: str
    run_id: str
    turn_id: str
    seq: int
    kind: str
    route_id: str
    provider: str
    model: str
    group_id: str
    profile_id: str | None
    state: str
    fact: str | None
    money_micros: int
    created_at: float
    settled_at: float | None
    policy_hash: str
    retry: int = 0


@dataclass(frozen=True)
class DecisionRecord:
    """One recorded decision: a ``select`` event (with the Attempt it led to) or a ``stop``."""

    event_id: int
    run_id: str
    kind: str
    attempt_id: str | None
    data: Mapping[str, Any]
    created_at: float


@dataclass(frozen=True)
class History:
    """The records of a window, read once.

    ``runs`` are the window's Runs; ``decisions`` their recorded decisions; ``attempts`` their
    Attempts and every other Attempt begun from ``lead_from`` to the end of the window's (the
    world the other policy's health is folded from, and the evidence estimates read);
    ``policies`` every frozen policy those Attempts' Runs were admitted under, by hash
    (``None``: it does not read as a policy).
    """

    since: float
    until: float
    runs: Mapping[str, RunFacts]
    attempts: Sequence[AttemptFacts]
    decisions: Sequence[DecisionRecord]
    policies: Mapping[str, Policy | None]
    lead_from: float


def lead_in(policy: Policy) -> float:
    """How long before a window the other policy's own health is folded from.

    As long as it remembers a failure: its longest cooldown, disable or failure window, at most
    :data:`MAX_LEAD_IN_S`.
    """
    hp = policy.health
    spans = [hp.cooldown.cap_s, hp.failure_window_s or 0.0, hp.cooldown_window_s or 0.0,
             *(d.cap_s for d in hp.disables)]
    return min(max(spans), MAX_LEAD_IN_S)


# -- the report -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One decision a finding counts, to look at: ``failover-ledger run show RUN``."""

    run_id: str
    turn_id: str
    at: float
    attempt_id: str | None
    recorded: str
    replayed: str

    @property
    def command(self) -> str:
        """The command that shows the Run's timeline."""
        return f"failover-ledger run show {self.run_id}"


@dataclass(frozen=True)
class Finding:
    """A group of decisions the other policy makes differently, in words, with examples.

    ``key`` says what kind (``moved_on``, ``stopped``, ``retried``, ``moved_not_retried``,
    ``retried_not_moved``, ``other_route``, ``other_start``, ``skipped_group``, ``skipped_cooling``,
    ``tried_skipped``, ``waited``, ``other_profile``, ``stopped_runs``, ``served_runs``);
    ``subject`` what it is about (a failure, a group, a route); ``estimated`` whether the count
    rests on estimated outcomes.
    """

    key: str
    subject: str
    count: int
    text: str
    examples: list[Example] = field(default_factory=list)
    estimated: bool = False


@dataclass(frozen=True)
class Totals:
    """What the replayed turns cost under one policy.

    Recorded figures are counts; replayed ones are expected values where they rest on
    estimates. ``attempts`` counts model calls (Attempts that left the process); ``cost`` the
    money they took (charged, or still held); ``latency_s`` the mean time from a turn's first
    decision to its answer or stop; ``served``/``stopped``/``open`` the turns that got an
    answer, stopped, or are neither (in flight, or no evidence to estimate from);
    ``runs_stopped`` the Runs with a stopped turn.
    """

    turns: float
    served: float
    stopped: float
    open: float
    attempts: float
    cost: Decimal
    latency_s: float | None
    runs_stopped: float


@dataclass(frozen=True)
class Estimates:
    """How much of the replayed figures rests on estimated outcomes.

    ``decisions``: differing decisions whose outcome was estimated (one per turn: where it
    left the recorded path); ``runs``: the Runs whose replayed figures include an estimate;
    ``attempts``, ``cost``, ``latency_s``: the estimated part of the replayed totals (``share``
    of the replayed attempts); ``no_evidence``: estimated steps on a route no other Run tried in
    the window (counted as ``open``).
    """

    decisions: int
    runs: int
    attempts: float
    cost: Decimal
    latency_s: float
    share: float
    no_evidence: int


@dataclass(frozen=True)
class Check:
    """The recorded decisions recomputed from their recorded inputs under their own policy.

    Every one should agree (``agree == decisions``); one that does not is listed, with what
    was recorded and what its inputs give (the record or the code changed since).
    """

    decisions: int
    agree: int
    disagree: list[Example] = field(default_factory=list)


@dataclass(frozen=True)
class Coverage:
    """What could not be replayed, and how the other policy's world was taken.

    ``decisions_without_inputs``: recorded decisions with no inputs (recorded before inputs
    were, or by a host deciding itself) or with inputs that cannot decide them again (recorded
    before migration 0020 folded a provider's key, under ``health.key: provider`` over a plan
    that spells that provider two ways), taken as recorded; ``turns_without_inputs``: turns none
    of whose decisions can be replayed (counted alike under both policies);
    ``runs_without_policy``: Runs whose frozen policy does not read; ``malformed``: inputs that
    do not read. ``world`` says, per recorded policy, whether the other policy reads the
    recorded health and groups or its own fold of the recorded outcomes.
    """

    decisions_without_inputs: int
    turns_without_inputs: int
    runs_without_policy: int
    malformed: int
    world: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReplayReport:
    """What another policy would have done over a window of recorded history.

    ``policy`` is the replayed policy's name and ``policy_hash`` its hash; ``recorded`` the
    names of the policies the Runs were admitted under. ``decisions`` counts the decision points
    replayed, ``differing`` those the other policy decides differently. ``findings`` are
    grouped, largest first. ``baseline`` and ``replayed`` are the :class:`Totals` under the
    recorded policies and under the other one; ``estimates`` how much rests on estimates;
    ``check`` the recorded decisions recomputed under their own policy; ``coverage`` what could
    not be replayed.
    """

    policy: str
    policy_hash: str
    recorded: list[str]
    since: float
    until: float
    runs: int
    turns: int
    decisions: int
    differing: int
    baseline: Totals
    replayed: Totals
    findings: list[Finding]
    estimates: Estimates
    check: Check
    coverage: Coverage

    def not_replayed(self) -> str | None:
        """Why this report replayed no decision (``None``: it replayed some).

        So that a report of nothing never reads as a policy that agrees with every decision.
        """
        if self.decisions:
            return None
        cov = self.coverage
        if not self.runs:
            return "no run was admitted in the window (for the tenant or run asked for)"
        why = []
        if cov.runs_without_policy:
            why.append(f"{cov.runs_without_policy} of the {self.runs} runs have no frozen "
                       "policy that reads (a bulk-loaded history's marker, say): their "
                       "decisions cannot be decided again")
        if cov.decisions_without_inputs:
            why.append(f"{cov.decisions_without_inputs} decisions were recorded without their "
                       "inputs")
        if cov.malformed:
            why.append(f"{cov.malformed} recorded inputs do not read")
        return "; ".join(why) or "the runs recorded no decision"


# -- facts under the other policy --------------------------------------------------------------


def _verdict(fact: FailureFact) -> tuple[Any, ...]:
    return (fact.category, fact.scope, fact.resubmit, fact.moves_on, fact.cooldown)


def refact(fact: FailureFact, source: Policy | None, target: Policy) -> FailureFact:
    """The failure fact ``target`` would have recorded for what ``fact`` records.

    The fact's structured evidence (status, provider code, transport kind, phase, source,
    Retry-After, the redacted message) is classified again under ``target`` by the live
    classifier (:func:`ledger.decide.classify.reclassify`: a recorded detail code is read by
    the detail tables, as the live path read it), when that evidence gives ``fact`` again under
    the policy that recorded it (``source``). Otherwise the category stays as recorded and only
    the verdict that is the policy's is ``target``'s (:func:`ledger.decide.classify.refile`).
    """
    if source is not None and _verdict(reclassify(fact, source)) == _verdict(fact):
        return reclassify(fact, target)
    return refile(fact, target)


def _same(a: Policy, b: Policy, *parts: str) -> bool:
    return all(getattr(a, p) == getattr(b, p) for p in parts)


# What a policy's failure facts, health and group facts depend on.
_FACT_PARTS = ("classification", "moves_on", "failover", "health")
_HEALTH_PARTS = ("health",)
_GROUP_PARTS = ("admission", "classification", "moves_on", "failover", "health")
# Everything a decision reads of a policy: two policies equal in these decide alike.
_DECISION_PARTS = ("failover", "probe", "profiles", "health", "classification", "moves_on",
                   "same_route_retry", "admission")


# -- the world the other policy reads -------------------------------------------------------


class _Fold:
    """Health and group projections as a policy's settle rules make them from the outcomes."""

    def __init__(self, policy: Policy, attempts: Iterable[AttemptFacts],
                 fact_of: Callable[[AttemptFacts], FailureFact | None]) -> None:
        self.policy = policy
        self.health: dict[str, tuple[list[float], list[Health]]] = {}
        self.groups: dict[str, tuple[list[float], list[GroupProjection]]] = {}
        self.outcomes = 0
        stubs: dict[tuple[str, str, str, str], Route] = {}
        settled = sorted((a for a in attempts if a.settled_at is not None
                          and a.state in ("succeeded", "failed", "unknown", "not_sent")),
                         key=lambda a: (a.settled_at or 0.0, a.attempt_id))
        current: dict[str, Health] = {}
        for a in settled:
            t = a.settled_at or 0.0
            fact = fact_of(a)
            outcome = Outcome(a.state)
            sk = (a.route_id, a.provider, a.model, a.group_id)
            route = stubs.get(sk)
            if route is None:
                # Health keys and rules read a route's id and provider only.
                route = stubs[sk] = Route(id=a.route_id, provider=a.provider, model=a.model,
                                          group=a.group_id, recipient=a.provider, price=Price())
            self.outcomes += 1
            if not (outcome is Outcome.NOT_SENT and fact is None):
                for key, (_kind, _prov, update) in health_updates(
                        policy, route, a.profile_id, outcome, fact, t,
                        repeat=a.retry > 0, began_at=a.created_at).items():
                    h = current[key] = update(current.get(key) or Health(key=key))
                    times, states = self.health.setdefault(key, ([], []))
                    times.append(t)
                    states.append(h)
            if outcome is Outcome.FAILED:
                upd = group_update(policy, fact, t)
                if upd is not None:
                    times_g, states_g = self.groups.setdefault(a.group_id, ([], []))
                    times_g.append(t)
                    states_g.append(GroupProjection(group=a.group_id, mode=upd.mode,
                                                    until=upd.until, sampled_at=t))
            if a.kind == "probe":
                key = route_key(route, policy)
                h = current[key] = (current.get(key) or Health(key=key)).model_copy(
                    update={"last_probe_at": a.created_at})
                times, states = self.health.setdefault(key, ([], []))
                times.append(t)
                states.append(h)

    def health_at(self, keys: Iterable[str], at: float) -> dict[str, Health]:
        out = {}
        for key in keys:
            series = self.health.get(key)
            if series is None:
                continue
            i = bisect.bisect_right(series[0], at)
            if i:
                out[key] = as_read(series[1][i - 1], at)
        return out

    def groups_at(self, groups: Iterable[str], at: float) -> dict[str, GroupProjection]:
        out = {}
        for g in groups:
            series = self.groups.get(g)
            if series is None:
                continue
            i = bisect.bisect_right(series[0], at)
            if i:
                proj = series[1][i - 1]
                if proj.until is not None and proj.until > at:
                    out[g] = proj
        return out


# -- estimates from other Runs ----------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """What an Attempt on a route, near a time, would have done: from other Runs' Attempts.

    ``p_ok`` is the share that succeeded of those sent; ``money_micros`` and ``latency_s``
    their mean; ``failure`` the most common failure among them (with the policy hash that
    recorded it); ``samples`` how many they were, and ``near`` whether they were near the time
    (else the whole window's).
    """

    p_ok: float
    money_micros: float
    latency_s: float
    failure: tuple[str, str] | None
    samples: int
    near: bool


class _Evidence:
    """Other Runs' sent Attempts on each route in the window, in time order.

    Per route, running sums over time (succeeded, money, latency) answer "near this time,
    without this Run" in two bisections and the Run's own few Attempts.
    """

    def __init__(self, attempts: Iterable[AttemptFacts], since: float, until: float) -> None:
        rows: dict[str, list[AttemptFacts]] = {}
        for a in attempts:
            if a.state in _SENT and since <= a.created_at < until:
                rows.setdefault(a.route_id, []).append(a)
        self.times: dict[str, list[float]] = {}
        # Running sums per route: [n, succeeded, money, latency sum, latencies].
        self.sums: dict[str, list[tuple[int, int, int, float, int]]] = {}
        self.own: dict[tuple[str, str], list[tuple[int, AttemptFacts]]] = {}
        self.failure: dict[str, tuple[str, str] | None] = {}
        for r, v in rows.items():
            v.sort(key=lambda a: (a.created_at, a.attempt_id))
            self.times[r] = [a.created_at for a in v]
            acc = [(0, 0, 0, 0.0, 0)]
            for i, a in enumerate(v):
                n, ok, money, lat, nl = acc[-1]
                done = a.settled_at is not None
                acc.append((n + 1, ok + (a.state == "succeeded"), money + a.money_micros,
                            lat + ((a.settled_at or 0.0) - a.created_at if done else 0.0),
                            nl + done))
                self.own.setdefault((r, a.run_id), []).append((i, a))
            self.sums[r] = acc
            counts = Counter((a.fact, a.policy_hash) for a in v
                             if a.state != "succeeded" and a.fact is not None)
            self.failure[r] = (min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
                               if counts else None)

    def _span(self, route: str, run_id: str, lo: int, hi: int
              ) -> tuple[int, int, int, float, int]:
        """The sums of the route's rows ``lo`` to ``hi`` without the Run's own."""
        acc = self.sums[route]
        n, ok, money, lat, nl = (x - y for x, y in zip(acc[hi], acc[lo], strict=True))
        for i, a in self.own.get((route, run_id), ()):
            if lo <= i < hi:
                done = a.settled_at is not None
                n, ok, money = n - 1, ok - (a.state == "succeeded"), money - a.money_micros
                lat -= (a.settled_at or 0.0) - a.created_at if done else 0.0
                nl -= done
        return int(n), int(ok), int(money), float(lat), int(nl)

    def at(self, route: str, t: float, run_id: str) -> Estimate | None:
        times = self.times.get(route)
        if not times:
            return None
        lo, hi = bisect.bisect_left(times, t - NEAR_S), bisect.bisect_right(times, t + NEAR_S)
        span, near = self._span(route, run_id, lo, hi), True
        if span[0] < MIN_NEAR:
            span, near = self._span(route, run_id, 0, len(times)), False
        n, ok, money, lat, nl = span
        if n <= 0:
            return None
        return Estimate(p_ok=ok / n, money_micros=money / n, latency_s=lat / nl if nl else 0.0,
                        failure=self.failure.get(route), samples=n, near=near)


# -- decision points and turns ----------------------------------------------------------------


@dataclass(frozen=True)
class _Choice:
    """A decision as a replay compares it: what kind, which route and profile, why."""

    kind: str  # route | probe | retry | stop
    route: str | None = None
    profile: str | None = None
    reason: str | None = None
    detail: str = ""
    skipped: tuple[tuple[str, str], ...] = ()  # (route, reason) of each candidate passed over
    wait_s: float = 0.0
    delay_s: float = 0.0
    # The begin of this (recorded) choice was refused: the budget or an allowance ended the
    # turn there, whatever route was chosen.
    refused: bool = False

    @property
    def moves(self) -> bool:
        return self.kind != "stop"

    def text(self) -> str:
        if self.refused:
            return f"{replace(self, refused=False).text()}, refused at begin ({self.reason})"
        if self.kind == "stop":
            return f"stop ({self.reason})"
        if self.kind == "retry":
            return f"retry {self.route}"
        wait = f" after waiting {self.wait_s:.0f} s" if self.wait_s else ""
        return f"{self.kind} {self.route}" + (f" ({self.profile})" if self.profile else "") + wait


@dataclass
class _Point:
    """One recorded decision point of a turn."""

    run: RunFacts
    turn: str
    at: float
    record: DecisionRecord
    rec: RecordedInputs | None
    recorded: _Choice
    attempt: AttemptFacts | None  # the Attempt it led to
    failed: AttemptFacts | None  # the Attempt whose failure it follows
    other: _Choice | None = None
    inp: SelectionInput | None = None  # the other policy's input


@dataclass
class _Turn:
    run: RunFacts
    turn_id: str
    attempts: list[AttemptFacts]
    points: list[_Point]
    start: float
    end: float
    served: bool
    stopped: bool


@dataclass
class _Outcome:
    """A turn's expected figures under one policy."""

    attempts: float = 0.0
    money: float = 0.0
    latency: float = 0.0
    served: float = 0.0
    stopped: float = 0.0
    open: float = 0.0
    est_attempts: float = 0.0
    est_money: float = 0.0
    est_latency: float = 0.0
    estimated: bool = False
    no_evidence: int = 0
    certain_stop: bool = False


def _skips(rows: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(s.get("route")), str(s.get("reason"))) for s in rows or ()
                 if isinstance(s, Mapping))


def _recorded_choice(rec: DecisionRecord) -> _Choice:
    d = rec.data
    if rec.kind == "select":
        kind = "retry" if d.get("attempt_kind") == "retry" and not d.get("skipped") and (
            d.get("inputs") or {}).get("by") == "retry" else str(d.get("kind"))
        return _Choice(kind, d.get("route"), d.get("profile"), d.get("reason"),
                       str(d.get("detail") or ""), _skips(d.get("skipped")))
    made = d.get("decision") or {}
    if made.get("kind") in ("route", "probe"):
        # The decision was made; its begin was refused (the budget or an allowance).
        kind = "retry" if made.get("attempt_kind") == "retry" and (
            d.get("inputs") or {}).get("by") == "retry" else str(made["kind"])
        return _Choice(kind, made.get("route"), made.get("profile"), str(d.get("reason")),
                       str(made.get("detail") or ""), _skips(made.get("skipped")),
                       refused=True)
    return _Choice("stop", None, None, str(d.get("reason")), str(d.get("detail") or ""),
                   _skips(d.get("skipped")))


def _label(fact: FailureFact | None) -> str:
    if fact is None:
        return "new turn"
    if fact.transport is not None:
        return fact.transport.value.replace("_", " ")
    if fact.status is not None:
        return f"{fact.category.value} (HTTP {fact.status})"
    return fact.category.value


class _Replay:
    """One replay of ``history`` under ``policy`` (see :func:`replay`)."""

    def __init__(self, history: History, policy: Policy) -> None:
        self.h = history
        self.policy = policy
        self.facts: dict[tuple[str, str], FailureFact] = {}
        self.other_facts: dict[tuple[str, str], FailureFact] = {}
        self.by_id = {a.attempt_id: a for a in history.attempts}
        self.evidence = _Evidence(history.attempts, history.since, history.until)
        self._fold: _Fold | None = None
        self.malformed = 0
        self.rng = random.Random(0)
        self._same: dict[tuple[int, tuple[str, ...]], bool] = {}
        self._keys: dict[int, tuple[str, ...]] = {}
        self.memo: dict[Any, Any] = {}

    def same(self, recorded: Policy, parts: tuple[str, ...]) -> bool:
        """Whether ``recorded`` and the replayed policy agree in ``parts`` (asked once each)."""
        key = (id(recorded), parts)
        found = self._same.get(key)
        if found is None:
            found = self._same[key] = _same(recorded, self.policy, *parts)
        return found

    # -- facts ------------------------------------------------------------------------------

    def fact(self, a: AttemptFacts | None) -> FailureFact | None:
        if a is None or a.fact is None:
            return None
        key = (a.fact, a.policy_hash)
        f = self.facts.get(key)
        if f is None:
            f = self.facts[key] = FailureFact.model_validate_json(a.fact)
        return f

    def other_fact(self, text: str, source_hash: str) -> FailureFact:
        key = (text, source_hash)
        f = self.other_facts.get(key)
        if f is None:
            recorded = self.facts.get(key) or FailureFact.model_validate_json(text)
            source = self.h.policies.get(source_hash)
            if source is not None and self.same(source, _FACT_PARTS):
                f = recorded
            else:
                f = refact(recorded, source, self.policy)
            self.other_facts[key] = f
        return f

    def fold(self) -> _Fold:
        if self._fold is None:
            def fact_of(a: AttemptFacts) -> FailureFact | None:
                return None if a.fact is None else self.other_fact(a.fact, a.policy_hash)
            self._fold = _Fold(self.policy, self.h.attempts, fact_of)
        return self._fold

    # -- turns ------------------------------------------------------------------------------

    def turns(self) -> tuple[list[_Turn], int]:
        """The window's turns with their decision points; and the decisions without inputs."""
        by_run: dict[str, dict[str, list[AttemptFacts]]] = {}
        for a in self.h.attempts:
            if a.run_id in self.h.runs:
                by_run.setdefault(a.run_id, {}).setdefault(a.turn_id, []).append(a)
        points: dict[tuple[str, str], list[_Point]] = {}
        without = 0
        for rec in self.h.decisions:
            run = self.h.runs.get(rec.run_id)
            if run is None:
                continue
            data = rec.data
            raw = data.get("inputs")
            inputs = None
            if raw is not None:
                try:
                    inputs = parse_inputs(raw, plan=run.plan, policy=run.policy,
                                          memo=self.memo)
                except InvalidArgument:
                    self.malformed += 1
                if (inputs is not None and run.policy is not None
                        and not decided_again(inputs, run.plan, run.policy)):
                    # Decided under one key per spelling of a provider (before migration
                    # 0020), which the folded key cannot give back: taken as recorded.
                    inputs = None
            if inputs is None:
                without += 1
            att = self.by_id.get(rec.attempt_id) if rec.attempt_id else None
            turn = (inputs.turn if inputs is not None else att.turn_id if att is not None
                    else self._stop_turn(data))
            failed = self.by_id.get(inputs.failed) if inputs and inputs.failed else None
            at = inputs.at if inputs is not None else rec.created_at
            points.setdefault((run.run_id, turn), []).append(_Point(
                run, turn, at, rec, inputs, _recorded_choice(rec), att, failed))
        out = []
        keys = {(r, t) for r, ts in by_run.items() for t in ts} | set(points)
        for run_id, turn_id in keys:
            run = self.h.runs[run_id]
            atts = sorted(by_run.get(run_id, {}).get(turn_id, []), key=lambda a: a.seq)
            pts = sorted(points.get((run_id, turn_id), []),
                         key=lambda p: (p.at, p.record.event_id))
            stops = [p for p in pts if p.record.kind == "stop"]
            times = ([a.created_at for a in atts] + [p.at for p in pts])
            ends = ([a.settled_at or a.created_at for a in atts]
                    + [p.record.created_at for p in stops])
            out.append(_Turn(run, turn_id, atts, pts, min(times), max(ends or times),
                             served=bool(atts) and atts[-1].state == "succeeded",
                             stopped=bool(stops)))
        out.sort(key=lambda t: (t.run.run_id, t.start, t.turn_id))
        return out, without

    def _stop_turn(self, data: Mapping[str, Any]) -> str:
        for aid in data.get("attempts") or ():
            a = self.by_id.get(aid)
            if a is not None:
                return a.turn_id
        return "(unknown turn)"

    # -- one decision under the other policy --------------------------------------------------

    def view(self, p: _Point, at: float) -> tuple[Mapping[str, Health] | None,
                                                  Mapping[str, GroupProjection] | None]:
        """The health and groups the other policy reads at ``at`` (``None``: the recorded)."""
        run, rec = p.run, p.rec
        assert run.policy is not None and rec is not None
        health = groups = None
        if not self.same(run.policy, _HEALTH_PARTS):
            keys = self._keys.get(id(run.plan))
            if keys is None:
                keys = self._keys[id(run.plan)] = tuple(
                    {route_key(r, self.policy) for r in run.plan}
                    | {pr.id for r in run.plan for pr in r.profiles})
            health = self.fold().health_at(keys, at)
        if not self.same(run.policy, _GROUP_PARTS):
            groups = self.fold().groups_at({r.group for r in run.plan}, at)
            for g in rec.refused:  # admission's own refusals to this turn stay as recorded
                if g in rec.groups:
                    groups[g] = rec.groups[g]
        return health, groups

    def world(self, p: _Point, inp: SelectionInput, at: float) -> SelectionInput:
        """``inp`` at ``at``, with the health and groups the other policy reads then."""
        health, groups = self.view(p, at)
        return replace(inp, now=at, health=inp.health if health is None else health,
                       groups=inp.groups if groups is None else groups)

    def other_input(self, p: _Point, turn: _Turn) -> SelectionInput:
        run, rec = p.run, p.rec
        assert run.policy is not None and rec is not None
        failure = None
        if p.failed is not None and p.failed.fact is not None:
            failure = self.other_fact(p.failed.fact, p.failed.policy_hash)
        ruled = None
        if not self.same(run.policy, ("profiles",)):
            found = set()
            for r, prof in rec.tried_pairs:
                for a in turn.attempts:
                    if (a.route_id == r and a.profile_id == prof and a.created_at <= p.at
                            and a.fact is not None):
                        f = self.other_fact(a.fact, a.policy_hash)
                        if marks_profile_tried(f, a.provider, self.policy):
                            found.add(prof)
            ruled = frozenset(found)
        health, groups = self.view(p, rec.at)
        return selection_input(rec, plan=run.plan, policy=self.policy, role=run.role,
                               grant=run.grant, failure=failure, health=health, groups=groups,
                               tried_profiles=ruled)

    def decide(self, inp: SelectionInput, run: RunFacts, *, retries_done: int,
               rejection_stop: bool = False) -> _Choice:
        """The other policy's choice from ``inp``: a retry, a route (after a wait?), a stop."""
        pol = self.policy
        if rejection_stop:
            return _Choice("stop", reason="rejected_before_dispatch",
                           detail="the policy stops a turn whose failover admission refused")
        fact = inp.failure
        if fact is not None:
            rd = retry_decision(fact, pol, retries_done, self.rng)
            if rd.retry and rd.delay_s is not None and fact.category is not Category.UNUSABLE:
                return _Choice("retry", inp.current, inp.current_profile,
                               delay_s=rd.delay_s)
        d = select(inp)
        wait = 0.0
        if d.kind is DecisionKind.STOP and d.reason is Reason.NO_CANDIDATE:
            w = reopening_wait(inp, d, max_wait_s=pol.admission.max_capacity_wait_s,
                               deadline=run.deadline)
            if w > 0:
                later = select(replace(inp, now=inp.now + w))
                if later.kind is not DecisionKind.STOP:
                    d, wait = later, w
        return _as_choice(d, wait)

    def other(self, p: _Point, turn: _Turn) -> _Choice:
        inp = p.inp = self.other_input(p, turn)
        rec = p.rec
        assert rec is not None
        # As the retry owner: a refused failover stops the turn when a provider failure came
        # before it (the failure it returns to).
        stop = (rec.on == "rejection" and self.policy.failover.after_rejection == "stop"
                and any(a.fact is not None and a.created_at <= p.at for a in turn.attempts))
        return self.decide(inp, p.run, retries_done=p.failed.retry if p.failed else 0,
                           rejection_stop=stop)

    # -- the recorded decision under its own policy (the check) -------------------------------

    def recompute(self, p: _Point, turn: _Turn) -> bool:
        """Whether ``p``'s recorded inputs give its recorded decision under its own policy."""
        run, rec = p.run, p.rec
        assert run.policy is not None and rec is not None
        pol = run.policy
        failure = self.fact(p.failed)
        if rec.by == "after_rejection":
            return pol.failover.after_rejection == "stop" and p.recorded.kind == "stop"
        if rec.by == "retry":
            if failure is None or p.failed is None:
                return False
            rd = retry_decision(failure, pol, p.failed.retry, self.rng)
            return rd.retry and p.recorded.route == p.failed.route_id
        d = select(selection_input(rec, plan=run.plan, policy=pol, role=run.role,
                                   grant=run.grant, failure=failure))
        got = d.to_json()
        data = p.record.data
        if p.record.kind == "select":
            want = {k: data.get(k) for k in got}
        else:
            made = dict(data.get("decision") or {})
            if made.get("kind") == "stop":
                made["skipped"] = data.get("skipped", [])
                made.setdefault("route", None)
                made.setdefault("profile", None)
            want = {k: made.get(k) for k in got}
        # What is stored was redacted (event data always is); only then can they differ.
        return bool(got == want or redact_data(got) == want)


def _as_choice(d: Decision, wait: float = 0.0) -> _Choice:
    return _Choice(d.kind.value, d.route_id, d.profile,
                   d.reason.value if d.reason is not None else None, d.detail,
                   tuple((s.route, s.reason.value) for s in d.skipped), wait_s=wait)


def _same_path(recorded: _Choice, other: _Choice, failed_route: str | None) -> bool:
    """Whether both choices lead to the same next thing: a stop, or the same route."""
    if not recorded.moves or not other.moves:
        return recorded.moves == other.moves
    a = recorded.route if recorded.kind != "retry" else failed_route
    b = other.route if other.kind != "retry" else failed_route
    return a == b


# -- the findings ---------------------------------------------------------------------------


class _Findings:
    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], tuple[str, list[Example], bool]] = {}
        self.counts: Counter[tuple[str, str]] = Counter()

    def add(self, key: str, subject: str, text: str, example: Example,
            estimated: bool = False) -> None:
        k = (key, subject)
        self.counts[k] += 1
        if k not in self.groups:
            self.groups[k] = (text, [], estimated)
        ex = self.groups[k][1]
        if len(ex) < EXAMPLES:
            ex.append(example)

    def result(self) -> list[Finding]:
        out = []
        for (key, subject), n in self.counts.items():
            text, examples, est = self.groups[(key, subject)]
            words = text.replace("{n}", str(n)).replace("{s}", "" if n == 1 else "s")
            out.append(Finding(key, subject, n, words,
                               sorted(examples, key=lambda e: (e.at, e.run_id)), est))
        out.sort(key=lambda f: (-f.count, f.key, f.subject))
        return out


def _compare(p: _Point, fact: FailureFact | None, out: _Findings) -> None:
    """Count how the other policy's choice at ``p`` differs from the recorded one."""
    rec, oth = p.recorded, p.other
    assert oth is not None
    ex = Example(p.run.run_id, p.turn, p.at, p.attempt.attempt_id if p.attempt else None,
                 rec.text(), oth.text())
    label = _label(fact)
    if fact is not None:
        after = f"after {{n}} {label} failure{{s}}"
    elif p.rec is not None and p.rec.on == "rejection":
        label, after = "admission refusal", "after {n} failover{s} admission refused"
    else:
        after = "on {n} new turn{s}"
    if rec.moves and oth.moves and rec.route == oth.route and rec.kind != "retry" and (
            oth.kind != "retry"):
        if rec.profile != oth.profile:
            out.add("other_profile", "profiles",
                    "would have used another credential profile of the same route {n} time{s}",
                    ex)
        return
    if rec.kind == "retry" and oth.kind == "retry":
        return
    if not rec.moves and not oth.moves:
        return
    if not rec.moves:
        key, verb = (("retried", "retried the same route") if oth.kind == "retry"
                     else ("moved_on", "moved on"))
        out.add(key, label, f"would have {verb} {after}", ex)
    elif not oth.moves:
        out.add("stopped", f"{label}: {oth.reason}",
                f"would have stopped ({oth.reason}) {after}", ex)
    elif rec.kind == "retry":
        out.add("moved_not_retried", label,
                f"would have moved on instead of retrying the same route {after}", ex)
    elif oth.kind == "retry":
        out.add("retried_not_moved", label,
                f"would have retried the same route instead of moving on {after}", ex)
    elif fact is None:
        out.add("other_start", label, f"would have chosen another route {after}", ex)
    else:
        out.add("other_route", label, f"would have moved to another route {after}", ex)
    if oth.wait_s:
        out.add("waited", oth.route or "",
                f"would have waited for route `{oth.route}` to reopen {{n}} time{{s}}", ex)
    groups = {r.id: r.group for r in p.run.plan}
    was = set(rec.skipped)
    seen_groups: set[str] = set()
    for route, reason in oth.skipped:
        if (route, reason) in was:
            continue
        if reason in _GROUP_SKIPS and route in groups and groups[route] not in seen_groups:
            g = groups[route]
            seen_groups.add(g)
            out.add("skipped_group", g, f"would have skipped group `{g}` {{n}} time{{s}}", ex)
        elif reason in _COOLING_SKIPS:
            out.add("skipped_cooling", str(route),
                    f"would have passed over route `{route}` as cooling {{n}} time{{s}}", ex)
    chosen = oth.route if oth.kind != "retry" else None
    for route, reason in rec.skipped:
        if route == chosen and reason != Reason.ALREADY_TRIED.value:
            out.add("tried_skipped", f"{chosen}: {reason}",
                    f"would have tried route `{chosen}` where the recorded policy skipped it "
                    f"({reason}) {{n}} time{{s}}", ex)


# -- following a turn -----------------------------------------------------------------------


def _calls(atts: Iterable[AttemptFacts]) -> tuple[int, int]:
    n = money = 0
    for a in atts:
        if a.state in _CALLS:
            n += 1
        money += a.money_micros
    return n, money


def _recorded_outcome(t: _Turn) -> _Outcome:
    n, money = _calls(t.attempts)
    open_ = not t.served and not t.stopped
    return _Outcome(attempts=n, money=money, latency=t.end - t.start, served=float(t.served),
                    stopped=float(t.stopped and not t.served), open=float(open_))


class _Follow:
    """A turn followed under the other policy (see the module docstring)."""

    def __init__(self, rp: _Replay) -> None:
        self.rp = rp

    def turn(self, t: _Turn) -> _Outcome:
        out = _Outcome()
        before: list[AttemptFacts] = []
        for i, p in enumerate(t.points):
            if p.rec is None or p.other is None:
                continue  # not replayable: taken as recorded
            rec, oth = p.recorded, p.other
            failed_route = p.failed.route_id if p.failed else p.rec.current
            if rec.refused:
                break  # the begin's refusal ends the turn here under any choice
            if _same_path(rec, oth, failed_route):
                if not rec.moves:
                    break
                continue
            # Diverged here: what was recorded up to this point stands.
            before = ([a for a in t.attempts if a.seq < p.attempt.seq]
                      if p.attempt is not None
                      else [a for a in t.attempts if a.created_at <= p.at])
            n, money = _calls(before)
            out.attempts, out.money = float(n), float(money)
            elapsed = max(0.0, p.at - t.start)
            if not oth.moves:
                out.latency, out.stopped = elapsed, 1.0
                out.certain_stop = True
                return out
            self.estimate(t, p, oth, elapsed, out, i)
            return out
        return _recorded_outcome(t)

    def estimate(self, t: _Turn, p: _Point, first: _Choice, elapsed: float, out: _Outcome,
                 index: int) -> None:
        """Expected figures from ``first`` on, each step's outcome estimated."""
        rp = self.rp
        assert p.inp is not None
        out.estimated = True
        inp = p.inp
        choice = first
        reach, now = 1.0, inp.now
        retries = p.failed.retry if p.failed else 0
        latency = elapsed * 1.0
        for _step in range(MAX_ESTIMATED):
            route = choice.route if choice.kind != "retry" else inp.current
            assert route is not None
            now += choice.wait_s + choice.delay_s
            latency += reach * (choice.wait_s + choice.delay_s)
            est = rp.evidence.at(route, now, t.run.run_id)
            if est is None:
                out.no_evidence += 1
                out.attempts += reach
                out.est_attempts += reach
                out.open += reach
                break
            out.attempts += reach
            out.est_attempts += reach
            out.money += reach * est.money_micros
            out.est_money += reach * est.money_micros
            latency += reach * est.latency_s
            out.est_latency += reach * est.latency_s
            out.served += reach * est.p_ok
            reach *= 1.0 - est.p_ok
            now += est.latency_s
            if reach <= 1e-9:
                break
            if est.failure is None:
                out.open += reach
                break
            fact = rp.other_fact(*est.failure)
            profile = choice.profile if choice.kind != "retry" else inp.current_profile
            if choice.kind == "retry":
                retries += 1
            else:
                retries = 0
            perm = inp.permissions
            tried = perm.tried | {route}
            pairs = perm.tried_pairs | ({(route, profile)} if profile else set())
            ruled = perm.tried_profiles
            prov = next((r.provider for r in t.run.plan if r.id == route), "")
            if profile and marks_profile_tried(fact, prov, rp.policy):
                ruled = ruled | {profile}
            nxt = replace(inp, failure=fact, current=route, current_profile=profile,
                          permissions=replace(perm, tried=frozenset(tried),
                                              tried_pairs=frozenset(pairs),
                                              tried_profiles=frozenset(ruled),
                                              retries_left=perm.retries_left - 1,
                                              calls_left=perm.calls_left - 1))
            inp = rp.world(p, nxt, now)
            choice = rp.decide(inp, t.run, retries_done=retries)
            if not choice.moves:
                out.stopped += reach
                break
        else:
            out.open += reach
        out.latency = latency


# -- the whole replay -----------------------------------------------------------------------


def replay(history: History, policy: Policy) -> ReplayReport:
    """What ``policy`` would have done over ``history``, against what was recorded.

    Args:
        history: The window's records (:class:`History`).
        policy: The policy to replay.

    Returns:
        The :class:`ReplayReport`.

    Raises:
        InvalidArgument: ``policy`` is not a Policy.
    """
    if not isinstance(policy, Policy):
        raise InvalidArgument("policy must be a ledger.Policy (a preset name or a policy "
                              "file, loaded)", field="policy")
    rp = _Replay(history, policy)
    turns, without = rp.turns()
    findings = _Findings()
    check_n = check_ok = 0
    disagree: list[Example] = []
    decisions = differing = 0
    no_policy = {r.run_id for r in history.runs.values() if r.policy is None}
    for t in turns:
        if t.run.policy is None:
            continue
        for p in t.points:
            if p.rec is None:
                continue
            check_n += 1
            agrees = rp.recompute(p, t)
            if agrees:
                check_ok += 1
            elif len(disagree) < EXAMPLES:
                disagree.append(Example(t.run.run_id, t.turn_id, p.at,
                                        p.attempt.attempt_id if p.attempt else None,
                                        p.recorded.text(), "recomputed differently"))
            # A policy that decides exactly as the recorded one makes the recorded choice.
            p.other = (p.recorded if agrees and rp.same(t.run.policy, _DECISION_PARTS)
                       else rp.other(p, t))
            decisions += 1
            failed_route = p.failed.route_id if p.failed else p.rec.current
            if not _same_path(p.recorded, p.other, failed_route) or (
                    p.recorded.moves and p.recorded.profile != p.other.profile
                    and p.recorded.kind != "retry" and p.other.kind != "retry"):
                differing += 1
                fact = (rp.other_fact(p.failed.fact, p.failed.policy_hash)
                        if p.failed is not None and p.failed.fact is not None else None)
                _compare(p, fact, findings)
    follow = _Follow(rp)
    base = _Sum()
    other = _Sum()
    est_runs: set[str] = set()
    est_turns = no_evidence = 0
    est = _Outcome()
    by_run: dict[str, list[_Turn]] = {}
    for t in turns:
        by_run.setdefault(t.run.run_id, []).append(t)
    turns_without = 0
    stopped_runs: list[Example] = []
    served_runs: list[Example] = []
    for run_id, ts in sorted(by_run.items()):
        reach = 1.0
        run_stop_recorded = run_stop_other = 0.0
        certain = False
        run = ts[0].run
        first_est: Example | None = None
        first_stop: Example | None = None
        for t in sorted(ts, key=lambda x: x.start):
            r = _recorded_outcome(t)
            replayable = run.policy is not None and any(
                p.rec is not None for p in t.points)
            if not replayable:
                turns_without += 1
            o = follow.turn(t) if replayable else _recorded_outcome(t)
            base.add(r, 1.0)
            other.add(o, reach)
            run_stop_recorded = max(run_stop_recorded, r.stopped)
            run_stop_other = run_stop_other + reach * o.stopped
            if o.estimated:
                est_turns += 1
                est_runs.add(run_id)
                no_evidence += o.no_evidence
                est.est_attempts += reach * o.est_attempts
                est.est_money += reach * o.est_money
                est.est_latency += reach * o.est_latency
                if first_est is None:
                    first_est = _turn_example(t, "stopped" if t.stopped else "open",
                                              f"served with p={o.served:.2f} (estimated)")
            if o.certain_stop and not certain and t.served:
                certain = True
                first_stop = _turn_example(t, "served", "stopped")
            if t.served:
                reach *= o.served if not o.certain_stop else 0.0
        base.runs_stopped += run_stop_recorded
        other.runs_stopped += min(1.0, run_stop_other)
        if run.status == "succeeded" and certain and first_stop is not None:
            stopped_runs.append(first_stop)
        if (run_stop_recorded >= 1.0 and run_stop_other < 0.5 and first_est is not None
                and run.status != "succeeded"):
            served_runs.append(first_est)
    for ex in stopped_runs:
        findings.add("stopped_runs", "succeeded",
                     "would have stopped {n} Run{s} that succeeded", ex)
    for ex in served_runs:
        findings.add("served_runs", "stopped",
                     "would likely have served {n} Run{s} that stopped (estimated)", ex,
                     estimated=True)
    replayed = other.totals()
    share = est.est_attempts / replayed.attempts if replayed.attempts else 0.0
    recorded_policies = {h: pol for h in {r.policy_hash for r in history.runs.values()}
                         if (pol := history.policies.get(h)) is not None}
    recorded_names = sorted({pol.name for pol in recorded_policies.values()})
    world = []
    for pol in sorted(recorded_policies.values(), key=lambda x: x.name):
        parts = ["recorded health" if _same(pol, policy, *_HEALTH_PARTS)
                 else "its own health from the recorded outcomes",
                 "recorded group projections" if _same(pol, policy, *_GROUP_PARTS)
                 else "its own group facts from the recorded outcomes"]
        world.append(f"Runs under {pol.name}: {policy.name} reads " + " and ".join(parts))
    if rp._fold is not None:
        world.append(f"{rp._fold.outcomes} recorded outcomes folded through {policy.name}'s "
                     "settle rules")
    return ReplayReport(
        policy=policy.name, policy_hash=policy_hash(policy), recorded=recorded_names,
        since=history.since, until=history.until, runs=len(by_run), turns=len(turns),
        decisions=decisions, differing=differing, baseline=base.totals(), replayed=replayed,
        findings=findings.result(),
        estimates=Estimates(
            decisions=est_turns, runs=len(est_runs),
            attempts=round(est.est_attempts, 3),
            cost=from_micros(round(est.est_money)), latency_s=round(est.est_latency, 3),
            share=round(share, 4), no_evidence=no_evidence),
        check=Check(decisions=check_n, agree=check_ok, disagree=disagree),
        coverage=Coverage(decisions_without_inputs=without, turns_without_inputs=turns_without,
                          runs_without_policy=len(no_policy), malformed=rp.malformed,
                          world=world))


def _turn_example(t: _Turn, recorded: str, replayed: str) -> Example:
    last = t.attempts[-1].attempt_id if t.attempts else None
    return Example(t.run.run_id, t.turn_id, t.start, last, recorded, replayed)


class _Sum:
    def __init__(self) -> None:
        self.turns = self.served = self.stopped = self.open = 0.0
        self.attempts = self.money = self.latency = self.weight = 0.0
        self.runs_stopped = 0.0

    def add(self, o: _Outcome, w: float) -> None:
        self.turns += w
        self.served += w * o.served
        self.stopped += w * o.stopped
        self.open += w * o.open
        self.attempts += w * o.attempts
        self.money += w * o.money
        self.latency += w * o.latency
        self.weight += w

    def totals(self) -> Totals:
        return Totals(
            turns=round(self.turns, 3), served=round(self.served, 3),
            stopped=round(self.stopped, 3), open=round(self.open, 3),
            attempts=round(self.attempts, 3), cost=from_micros(round(self.money)),
            latency_s=round(self.latency / self.weight, 3) if self.weight else None,
            runs_stopped=round(self.runs_stopped, 3))


__all__ = [
    "AttemptFacts",
    "Check",
    "Coverage",
    "DecisionRecord",
    "Estimate",
    "Estimates",
    "Example",
    "Finding",
    "History",
    "ReplayReport",
    "RunFacts",
    "Totals",
    "lead_in",
    "refact",
    "replay",
]
