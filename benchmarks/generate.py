"""A large synthetic history, fast, for the audit and recovery benchmarks (``python -m benchmarks
generate``, and the history of ``python -m benchmarks recover``).

The ledger's own ``failover-ledger generate`` (:mod:`ledger.tools.generate`) runs real Runs
through the ledger's public API, so every record is the ledger's own writing; it costs about
6 ms of CPU per Attempt (``docs/audit.md``). This generator is for the millions of Attempts the
audit benchmarks need: it simulates the same kind of Runs with the ledger's pure rules and
bulk-loads the rows.

Runs over many routes, providers, capacity groups, tenants and labels, of one to three turns
each; failures observed as a provider or the transport reports them (rate limits with
Retry-After, overloads, server errors, read timeouts, refused connections, auth, context
overflow); at the recent end, a few Runs still in flight. Deterministic for a given seed: on
a ledger that already holds a load of the same seed, the same history under Run ids of its own
(derived from the seed's and the loads already there), so that a second load adds Runs and
never meets the first's keys.

The history is what the ledger itself would have written for such Runs under the ``goclaw``
preset, because every decision and every record is made by the ledger's own pure rules: the
classifier turns each observation into a fact (:func:`ledger.decide.classify.classify`), the
same-route retry rule and the selector choose the next Attempt or the stop
(:func:`ledger.decide.retry.retry_decision`, :func:`ledger.decide.select.select`, reading the
health the Run's own failures left, updated by the settle's own health rules), and each
Attempt's begin and settle are specified by :func:`ledger.decide.begin.begin_spec` and
:func:`ledger.decide.settle.settle_spec`, whose holds (:func:`ledger.decide.settle.settle_holds`)
move the Run's counters exactly as the begin and settle transactions do. So a timeout after the
request left is ``unknown`` and keeps its hold, a refused connection is ``not_sent`` (hold
voided, model call given back), every Attempt after a turn's first takes a retry permission
(``retries_used``), and the events are the retry owner's (``select`` with the decision and
the inputs it was made from (:mod:`ledger.decide.inputs`), ``retry`` and ``move`` written with
the Attempt they led to, ``stop`` with its decision and inputs, ``finish``);
``failover-ledger reconcile`` finds nothing to report.

The rows are written with :func:`benchmarks.bulk.bulk_insert`, not through the fenced write
path (a million Attempts in per-Attempt transactions would take hours), so generated Runs carry
a small policy marker instead of the full frozen policy: they are finished history for reading,
not Runs to resume. With ``frozen_policy=True`` (``--frozen-policy``) they carry the preset
itself, still under the marker hash, so that ``failover-ledger replay`` can replay them.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from benchmarks.bulk import analyze, bulk_insert
from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.decide.begin import begin_spec
from ledger.decide.classify import classify
from ledger.decide.health import as_read, route_key
from ledger.decide.inputs import record_inputs
from ledger.decide.profiles import marks_profile_tried
from ledger.decide.retry import retry_decision
from ledger.decide.select import (
    Decision,
    DecisionKind,
    RunPermissions,
    SelectionInput,
    preflight_verdicts,
    select,
)
from ledger.decide.settle import failure_outcome, settle_holds, settle_spec
from ledger.decide.stops import candidate_lines
from ledger.domain.facts import Category, FailureFact, Observation, Transport, WireProtocol
from ledger.domain.records import (
    AttemptKind,
    FrozenRun,
    Lease,
    Outcome,
    limit_micros,
    to_micros,
)
from ledger.domain.specs import BeginSpec, SettleSpec
from ledger.domain.values import Budget, Grant, Health, Price, Profile, Route, content_hash
from ledger.policy.load import preset
from ledger.policy.model import Policy
from ledger.storage.partitions import ensure_partitions
from ledger.tools.generate import free_tag

Progress = Callable[[int, int], None]

_PROVIDERS = {
    # provider: (models, groups, base failure rate, price in/out per Mtok)
    "openai": (["gpt-4o", "gpt-4o-mini", "o3"], ["openai-east", "openai-west"], 0.08, (2.5, 10)),
    "anthropic": (["claude-sonnet", "claude-haiku"], ["anthropic-main"], 0.10, (3, 15)),
    "gemini": (["gemini-pro", "gemini-flash"], ["gemini-main"], 0.12, (1.25, 5)),
    "mistral": (["mistral-large"], ["mistral-eu"], 0.15, (2, 6)),
    "together": (["llama-70b", "qwen-72b"], ["together-shared"], 0.22, (0.9, 0.9)),
}
_PROTOCOL = {"anthropic": WireProtocol.ANTHROPIC, "gemini": WireProtocol.GEMINI}
_TENANTS = ["acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "wonka"]
_TEAMS = ["search", "research", "support", "eval"]
_ENVS = ["prod", "prod", "prod", "staging"]
# What a failed call looks like to the adapter: (weight, observation of it on a route).
_FAILURES: list[tuple[int, Callable[[Route, random.Random], Observation]]] = [
    (34, lambda r, rng: Observation(status=429, provider=r.provider,
                                    headers={"retry-after": str(rng.choice([1, 2, 5, 30]))})),
    (18, lambda r, rng: Observation(status=529 if r.provider == "anthropic" else 503,
                                    provider=r.provider)),
    (16, lambda r, rng: Observation(status=500, provider=r.provider,
                                    protocol=_PROTOCOL.get(r.provider, WireProtocol.OPENAI),
                                    body='{"error": {"type": "api_error", "message": '
                                         '"Internal server error"}}')),
    (14, lambda r, rng: Observation(transport=Transport.READ_TIMEOUT, provider=r.provider)),
    (8, lambda r, rng: Observation(transport=Transport.CONNECT_REFUSED, provider=r.provider)),
    (5, lambda r, rng: Observation(status=401, provider=r.provider)),
    (5, lambda r, rng: Observation(status=400, provider=r.provider,
                                   body="This model's maximum context length is 128000 tokens")),
]
# How long each kind of answer takes (seconds): a refused connection at once, an error status
# quickly, a read timeout after the stream's read timeout.
_LATENCY = {"ok": (0.4, 12.0), "status": (0.1, 2.0), "timeout": (30.0, 120.0),
            "refused": (0.001, 0.05)}
# Generated runs carry this policy hash (and the marker as their policy): how ``generate`` tells
# its own history from real runs.
POLICY_HASH = "generated"
#: The most Attempts one load writes: a hundred million, ten times the largest history measured
#: (``docs/benchmarks.md``: 100 M would take about 350 GB). Past it is a slip of extra zeros that
#: would fill the disk before it ended.
MAX_ATTEMPTS = 100_000_000
_PRESET = "goclaw"
_POLICY_MARKER = json.dumps({"generated": True, "preset": _PRESET})
# With frozen_policy=True: the preset itself, as admission freezes a policy (what a replay reads).
_POLICY_FROZEN = json.dumps(preset(_PRESET).model_dump(mode="json"), sort_keys=True)
_BUDGET = Budget(max_calls=12, max_retries=4, max_cost=Decimal(1))
_GRANT = Grant()
_MAX_COMPLETION = 1500  # the completion tokens a turn reserves for
_LEASE_TTL_S = 30.0
_EXECUTOR = "gen"


@dataclass
class GenStats:
    """What :func:`generate` wrote.

    ``failed``, ``unknown``, ``not_sent`` and ``dispatching`` count Attempts in that state;
    ``failovers`` the Runs that failed over (served elsewhere than their selected route, or
    moved on).
    """

    runs: int = 0
    attempts: int = 0
    failed: int = 0
    unknown: int = 0
    not_sent: int = 0
    dispatching: int = 0
    failovers: int = 0
    events: int = 0
    since: float = 0.0
    until: float = 0.0
    routes: list[str] = field(default_factory=list)


def catalog() -> list[Route]:
    """The generated routes: every model of every provider in each of its groups."""
    out = []
    for prov, (models, groups, _rate, (pin, pout)) in _PROVIDERS.items():
        for model in models:
            for group in groups:
                rid = f"{prov}/{model}@{group.split('-')[-1]}"
                out.append(Route(
                    id=rid, provider=prov, model=model, group=group, recipient=prov,
                    profiles=[Profile(id=f"{prov}-key-{i}") for i in (1, 2)],
                    price=Price(input_per_mtok=Decimal(str(pin)),
                                output_per_mtok=Decimal(str(pout))),
                ))
    return out


@dataclass
class _Counters:
    """A Run's counters as its begin and settle transactions move them."""

    calls: int = 0
    retries: int = 0
    reserved: int = 0
    posted: int = 0
    tokens_reserved: int = 0
    tokens: int = 0
    seq: int = 0
    current: tuple[str, str | None] | None = None


@dataclass
class _Rows:
    """Rows waiting for the next bulk insert, per table."""

    tables: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {
        k: [] for k in ("runs", "debits", "attempts", "events", "group_slots", "provenance")})

    def add(self, table: str, row: dict[str, Any]) -> dict[str, Any]:
        self.tables[table].append(row)
        return row


def _run_id(tag: str, i: int) -> str:
    return f"run-{tag}-{i:08d}"


class _Generator:
    """Simulates Runs, one at a time, with the ledger's own rules (see the module docstring)."""

    def __init__(self, rng: random.Random, end: float, tag: str,
                 frozen_policy: bool = False) -> None:
        self.rng = rng
        self.end = end
        self.tag = tag
        self.policy_text = _POLICY_FROZEN if frozen_policy else _POLICY_MARKER
        self.policy: Policy = preset(_PRESET)
        self.routes = catalog()
        self.fail_rate = {r.id: _PROVIDERS[r.provider][2] * rng.uniform(0.6, 1.4)
                          for r in self.routes}
        # A plan is 3 routes from 3 different providers, primary first.
        self.plans: list[list[Route]] = []
        for _ in range(24):
            chosen = rng.sample(list(_PROVIDERS), 3)
            self.plans.append([rng.choice([r for r in self.routes if r.provider == p])
                               for p in chosen])
        self.plan_json = [json.dumps([r.model_dump(mode="json") for r in p], sort_keys=True)
                          for p in self.plans]
        self.failure_weights = [w for w, _ in _FAILURES]
        self.stats = GenStats()
        self.rows = _Rows()
        self.labels_json = "{}"  # the labels of the Run being simulated, as stored

    # -- one Run ---------------------------------------------------------------------------

    def run(self, i: int, t0: float, left: int) -> None:
        """Simulate Run number ``i`` admitted at ``t0``, making at most ``left`` Attempts."""
        rng = self.rng
        pi = rng.randrange(len(self.plans))
        plan = self.plans[pi]
        run_id = _run_id(self.tag, i)
        tenant = rng.choice(_TENANTS)
        labels = {"team": rng.choice(_TEAMS), "env": rng.choice(_ENVS)}
        self.labels_json = json.dumps(labels, sort_keys=True)  # the Run's and its attempts'
        frozen = FrozenRun(
            run_id=run_id, parent_run_id=None, role="research", tenant=tenant, labels=labels,
            plan=plan, grant=_GRANT, budget=_BUDGET, policy={"generated": True},
            policy_hash=POLICY_HASH, selected_route=plan[0].id, content_hash=content_hash(run_id),
            deadline=None, created_at=t0)
        lease = Lease(run_id, _EXECUTOR, 1, t0 + _LEASE_TTL_S)
        first_row = len(self.rows.tables["events"]), len(self.rows.tables["attempts"])
        self._event(run_id, None, "admit", {"policy_hash": POLICY_HASH, "parent": None}, t0)
        self._event(run_id, None, "lease", {"executor": _EXECUTOR, "fence": 1, "previous": None,
                                            "expires_at": t0 + _LEASE_TTL_S}, t0)
        # What other Runs left behind: now and then the primary's provider is cooling.
        health: dict[str, Health] = {}
        if rng.random() < 0.03:
            key = route_key(plan[0], self.policy)
            health[key] = Health(key=key, cooldown_until=t0 + rng.uniform(30, 600),
                                 error_count=1, last_failure_at=t0 - 1)
        in_flight = self.end - t0 < 600 and rng.random() < 0.15  # a Run still going at ``end``
        c = _Counters()
        t = t0
        status = "succeeded"
        turns = rng.choices([1, 2, 3], [6, 3, 1])[0]
        for n in range(1, turns + 1):
            ended, t = self._turn(frozen, lease, f"turn-{n}", health, c, t, left,
                                  in_flight and n == turns)
            if ended != "served":
                status = ended
                break
            if left - c.seq < 1:
                break  # the requested number of Attempts is written
            t += rng.uniform(0.5, 30.0)  # the agent reads the answer, runs its tools
        running = status == "running"
        if not running:
            self._event(run_id, None, "finish", {"status": status}, t)
        # The audit's rule, as the ledger's writes mark it: a move, or a success elsewhere.
        failed_over = (
            any(e["kind"] == "move" for e in self.rows.tables["events"][first_row[0]:])
            or any(a["state"] == "succeeded" and a["route_id"] != plan[0].id
                   for a in self.rows.tables["attempts"][first_row[1]:]))
        self.rows.add("runs", {
            "run_id": run_id, "parent_run_id": None, "role": "research", "tenant": tenant,
            "labels": self.labels_json, "status": status,
            "plan": self.plan_json[pi], "run_grant": json.dumps({"recipients": {}, "roles": None}),
            "budget": json.dumps({"max_calls": _BUDGET.max_calls, "max_cost": "1",
                                  "max_retries": _BUDGET.max_retries, "max_tokens": None}),
            "policy": self.policy_text, "policy_hash": POLICY_HASH,
            "selected_route": plan[0].id, "content_hash": frozen.content_hash,
            "deadline": None, "max_calls": _BUDGET.max_calls, "max_retries": _BUDGET.max_retries,
            "max_cost_micros": limit_micros(_BUDGET.max_cost), "max_tokens": None,
            "calls_used": c.calls, "retries_used": c.retries, "reserved_micros": c.reserved,
            "posted_micros": c.posted, "tokens_used": c.tokens,
            "tokens_reserved": c.tokens_reserved,
            "carved_calls": 0, "carved_retries": 0, "carved_micros": 0, "carved_tokens": 0,
            "current_route": c.current[0] if c.current else None,
            "current_profile": c.current[1] if c.current else None,
            # A finished Run's lease was released; one in flight is kept renewed.
            "lease_holder": _EXECUTOR if running else None, "fence": 1,
            "lease_expires_at": self.end + _LEASE_TTL_S if running else None,
            "failed_over": failed_over, "created_at": t0, "updated_at": t,
        })
        if t > self.end - 1:
            # The Run ran past the end of the history: it happened that much earlier.
            self._shift(first_row, t - (self.end - 1))
        self.stats.runs += 1
        if failed_over:
            self.stats.failovers += 1

    def _turn(self, run: FrozenRun, lease: Lease, turn_id: str, health: dict[str, Health],
              c: _Counters, t: float, left: int, in_flight: bool) -> tuple[str, float]:
        """One turn through the retry owner's loop (``ledger.decide.turn``); returns how it
        ended (``served``, ``failed`` or ``running``) and the time after it. The Run may make
        ``left`` Attempts in all: the last one it may make succeeds."""
        rng, policy = self.rng, self.policy
        plan = run.plan
        envelope_hash = content_hash(f"{run.run_id}/{turn_id}")
        prompt = rng.randint(200, 4000)
        tried: set[str] = set()
        tried_profiles: set[str] = set()
        tried_pairs: set[tuple[str, str]] = set()
        attempts: list[str] = []
        errors: list[str] = []
        failures: dict[str, list[str]] = {}  # by route, for the stop's candidate lines
        pending: list[tuple[str, dict[str, Any]]] = []

        # The inputs of the current decision, recorded with it as the retry owner records them.
        inputs: dict[str, Any] = {}

        def selection(failure: FailureFact | None, current: str | None,
                      current_profile: str | None) -> SelectionInput:
            inp = SelectionInput(
                plan=plan, policy=policy, now=t,
                permissions=RunPermissions(
                    retries_left=_BUDGET.max_retries - c.retries,
                    calls_left=_BUDGET.max_calls - c.calls, tried=frozenset(tried),
                    tried_profiles=frozenset(tried_profiles), tried_pairs=frozenset(tried_pairs)),
                health={k: as_read(h, t) for k, h in health.items()}, current=current,
                current_profile=current_profile, failure=failure)
            return replace(inp, verdicts=preflight_verdicts(inp))

        def decide(failure: FailureFact | None, current: str | None,
                   current_profile: str | None, failed: str | None) -> Decision:
            inp = selection(failure, current, current_profile)
            inputs.clear()
            inputs.update(record_inputs(inp, by="select",
                                        on="failure" if failure else "new_turn",
                                        turn=turn_id, failed=failed))
            return select(inp)

        decision = decide(None, c.current[0] if c.current else None, None, None)
        kind = AttemptKind.FIRST
        same_route_retries = 0
        while True:
            if decision.kind is DecisionKind.STOP or decision.route is None:
                reason = decision.reason.value if decision.reason else "no_candidate"
                return self._stop(run.run_id, reason, decision, attempts, errors, t,
                                  plan, failures, inputs), t
            route, profile = decision.route, decision.profile
            attempt_kind = AttemptKind.PROBE if decision.kind is DecisionKind.PROBE else kind
            if attempt_kind is AttemptKind.PROBE:
                key = route_key(route, policy)  # the probe's claim, as claim_probe records it
                health[key] = health.get(key, Health(key=key)).model_copy(
                    update={"last_probe_at": t})
            reserve = to_micros(route.cost(prompt, _MAX_COMPLETION))
            reserve_tokens = prompt + _MAX_COMPLETION
            take_retry = kind is not AttemptKind.FIRST
            refusal = self._allowance(c, take_retry, reserve)
            if refusal is not None:  # begin refuses: nothing is recorded but the stop
                errors.append(refusal[1])
                failures.setdefault(route.id, []).append(refusal[1])
                return self._stop(run.run_id, refusal[0], None, attempts, errors, t,
                                  plan, failures, inputs,
                                  begun={**decision.to_json(), "attempt_kind": kind.value}), t
            c.seq += 1
            attempt_id = f"att-{self.tag}-{run.run_id[-8:]}-{c.seq}"
            events = [*pending, ("select", {**decision.to_json(),
                                            "attempt_kind": attempt_kind.value,
                                            "inputs": dict(inputs)})]
            pending = []
            spec = begin_spec(run, lease, route=route.id, profile_id=profile,
                              envelope_hash=envelope_hash, reserve_micros=reserve,
                              reserve_tokens=reserve_tokens, turn_id=turn_id,
                              kind=attempt_kind, attempt_id=attempt_id, events=events,
                              take_retry=take_retry)
            row, debit = self._begin(spec, c, t)
            attempts.append(attempt_id)
            if in_flight and rng.random() < 0.5:
                self._in_flight(spec, t)
                return "running", t
            # The last Attempt the caller asked for succeeds: the history ends on a served turn.
            last = left - c.seq <= 0
            if last or rng.random() >= self.fail_rate[route.id]:
                t += rng.uniform(*_LATENCY["ok"])
                completion = rng.randint(50, _MAX_COMPLETION)
                cost = to_micros(route.cost(prompt, completion))
                output = "sha256:" + uuid.UUID(int=rng.getrandbits(128)).hex * 2
                settle = settle_spec(
                    policy, route, profile, lease, attempt_id, outcome=Outcome.SUCCEEDED,
                    fact=None, observation=None, now=t, effective_output=None,
                    tool_started=None, prompt_tokens=prompt, completion_tokens=completion,
                    cost_micros=cost, model_reported=route.model, output_hash=output,
                    events=(), provenance=(), repeat=False)
                self._settle(settle, spec, row, debit, c, health, t)
                self.rows.add("provenance", {"run_id": run.run_id, "ref": attempt_id,
                                             "content_hash": output, "kind": "model_output",
                                             "created_at": t})
                c.current = (route.id, profile)
                return "served", t
            obs = rng.choices(_FAILURES, self.failure_weights)[0][1](route, rng)
            t += rng.uniform(*_LATENCY["timeout" if obs.transport is Transport.READ_TIMEOUT
                                       else "refused" if obs.transport else "status"])
            fact = classify(obs, policy, now=t)
            # The retry owner's reading of the outcome: never sent, or sent without a verdict
            # (unknown: the hold stays), or failed.
            outcome = failure_outcome(fact, sent=True)
            settle = settle_spec(
                policy, route, profile, lease, attempt_id, outcome=outcome, fact=fact,
                observation=None, now=t, effective_output=None, tool_started=None,
                prompt_tokens=None, completion_tokens=None, cost_micros=None,
                model_reported=None, output_hash=None, events=(), provenance=(),
                repeat=same_route_retries > 0)
            self._settle(settle, spec, row, debit, c, health, t)
            errors.append(f"{route.provider}/{route.model}: {fact.category.value}"
                          + (f" (HTTP {fact.status})" if fact.status else ""))
            failures.setdefault(route.id, []).append(f"{errors[-1]} [attempt {attempt_id}]")
            cause = {"category": fact.category.value, "status": fact.status,
                     "scope": fact.scope.value, "phase": fact.phase.value}
            rd = retry_decision(fact, policy, same_route_retries, rng)
            if rd.retry and rd.delay_s is not None and fact.category is not Category.UNUSABLE:
                same_route_retries += 1
                pending.append(("retry", {"route": route.id, "cause": cause,
                                          "delay_s": rd.delay_s, "n": same_route_retries,
                                          "from_attempt": attempt_id}))
                t += rd.delay_s
                kind = AttemptKind.RETRY
                decision = Decision(DecisionKind.ROUTE, route, profile)
                # What the selector would have read, had the route not been retried.
                inp = selection(fact, route.id, profile)
                perm = inp.permissions
                pairs, ruled = set(perm.tried_pairs), set(perm.tried_profiles)
                if profile:
                    pairs.add((route.id, profile))
                    if marks_profile_tried(fact, route.provider, policy):
                        ruled.add(profile)
                inp = replace(inp, permissions=replace(
                    perm, tried=perm.tried | {route.id}, tried_pairs=frozenset(pairs),
                    tried_profiles=frozenset(ruled)))
                inputs.clear()
                inputs.update(record_inputs(inp, by="retry", on="failure", turn=turn_id,
                                            failed=attempt_id))
                continue
            tried.add(route.id)
            if profile:
                tried_pairs.add((route.id, profile))
                if marks_profile_tried(fact, route.provider, policy):
                    tried_profiles.add(profile)
            decision = decide(fact, route.id, profile, attempt_id)
            if decision.kind is DecisionKind.STOP or decision.route is None:
                continue  # the stop is recorded at the top of the loop
            nxt = decision.route
            pending.append(("move", {"from_route": route.id, "to_route": nxt.id,
                                     "profile": decision.profile, "cause": cause,
                                     "from_attempt": attempt_id}))
            kind = AttemptKind.RETRY if nxt.id == route.id else AttemptKind.FAILOVER
            same_route_retries = 0

    # -- the records -----------------------------------------------------------------------

    @staticmethod
    def _allowance(c: _Counters, take_retry: bool, reserve: int) -> tuple[str, str] | None:
        """Why the begin transaction would refuse this Attempt (stop reason, error), or
        ``None``: the same checks, in the same order."""
        if _BUDGET.max_calls - c.calls <= 0:
            return "retry_allowance", "the run has used its model-call allowance"
        if take_retry and _BUDGET.max_retries - c.retries <= 0:
            return "retry_allowance", "the run has no retry permission left"
        if reserve > limit_micros(_BUDGET.max_cost) - c.reserved - c.posted:
            return "budget", "a hold would overdraw the run's cost budget"
        return None

    def _begin(self, spec: BeginSpec, c: _Counters, t: float
               ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The rows one begin writes, and the Run's counters after it."""
        route = spec.route
        row = self.rows.add("attempts", {
            "attempt_id": spec.attempt_id, "run_id": spec.run_id, "tenant": spec.tenant,
            "labels": self.labels_json, "turn_id": spec.turn_id, "seq": c.seq,
            "kind": spec.kind.value, "route_id": route.id, "provider": route.provider,
            "model": route.model,
            "group_id": route.group, "profile_id": spec.profile_id,
            "debit_id": "d-" + spec.attempt_id, "envelope_hash": spec.envelope_hash,
            "state": "dispatching", "reject_reason": None, "fact": None, "category": None,
            "http_status": None, "effective_output": False, "tool_started": False,
            "prompt_tokens": None, "completion_tokens": None, "cost_micros": None,
            "reserved_micros": spec.reserve_micros, "reserved_tokens": spec.reserve_tokens,
            "model_reported": None, "output_hash": None, "settle_hash": None,
            "begin_hash": spec.begin_hash, "fence": spec.fence, "settle_fence": None,
            "executor": spec.executor, "created_at": t, "settled_at": None,
            "latency_s": None, "first_byte_s": None, "first_token_s": None,
            "cached_tokens": None, "reasoning_tokens": None,
        })
        debit = self.rows.add("debits", {
            "debit_id": "d-" + spec.attempt_id, "run_id": spec.run_id,
            "attempt_id": spec.attempt_id, "state": "reserved",
            "reserved_micros": spec.reserve_micros, "posted_micros": 0, "created_at": t,
            "settled_at": None})
        for k, d in spec.events:
            self._event(spec.run_id, spec.attempt_id, k, d, t)
        c.calls += 1
        c.retries += 1 if spec.take_retry else 0
        c.reserved += spec.reserve_micros
        c.tokens_reserved += spec.reserve_tokens
        self.stats.attempts += 1
        return row, debit

    def _in_flight(self, spec: BeginSpec, t: float) -> None:
        """The Attempt is still dispatching at the end of the history: it holds its slot."""
        self.rows.add("group_slots", {"attempt_id": spec.attempt_id,
                                      "group_id": spec.route.group, "run_id": spec.run_id,
                                      "fence": spec.fence, "acquired_at": t})
        self.stats.dispatching += 1

    def _settle(self, spec: SettleSpec, begun: BeginSpec, row: dict[str, Any],
                debit: dict[str, Any],
                c: _Counters, health: dict[str, Health], t: float) -> None:
        """What one settle writes, as the settle transaction applies ``spec``."""
        fact = spec.fact
        tokens = (None if spec.prompt_tokens is None and spec.completion_tokens is None
                  else (spec.prompt_tokens or 0) + (spec.completion_tokens or 0))
        holds = settle_holds(spec.outcome, fact, cost_micros=spec.cost_micros, tokens=tokens,
                             reserved_micros=begun.reserve_micros,
                             reserved_tokens=begun.reserve_tokens, token_budget=False)
        row.update(state=spec.outcome.value,
                   fact=json.dumps(fact.to_json()) if fact is not None else None,
                   category=fact.category.value if fact else None,
                   http_status=fact.status if fact else None,
                   effective_output=spec.effective_output, tool_started=spec.tool_started,
                   prompt_tokens=spec.prompt_tokens, completion_tokens=spec.completion_tokens,
                   cost_micros=spec.cost_micros, model_reported=spec.model_reported,
                   output_hash=spec.output_hash, settle_hash=spec.settle_hash,
                   settle_fence=spec.fence, settled_at=t,
                   latency_s=max(0.0, t - row["created_at"]),
                   cached_tokens=spec.cached_tokens, reasoning_tokens=spec.reasoning_tokens)
        if holds.debit.value != "reserved":
            debit.update(state=holds.debit.value, posted_micros=holds.posted_micros,
                         settled_at=t)
            c.reserved -= holds.release_micros
            c.posted += holds.posted_micros
            c.tokens_reserved -= holds.release_tokens
        c.tokens += holds.tokens_used
        c.calls -= 1 if holds.uncount_call else 0
        for key, (_kind, _provider, update) in spec.health.items():
            health[key] = update(health.get(key, Health(key=key)))
        counted = {"failed": "failed", "unknown": "unknown", "not_sent": "not_sent"}
        if spec.outcome.value in counted:
            setattr(self.stats, counted[spec.outcome.value],
                    getattr(self.stats, counted[spec.outcome.value]) + 1)

    def _stop(self, run_id: str, reason: str, decision: Decision | None,
              attempts: list[str], errors: list[str], t: float, plan: Sequence[Route],
              failures: Mapping[str, Sequence[str]], inputs: Mapping[str, Any],
              begun: Mapping[str, Any] | None = None) -> str:
        """The retry owner's ``stop`` event, with the decision it stopped on and its inputs
        (the selector's stop, or the decision whose begin was refused); the Run then ends
        ``failed``."""
        skips = {s.route: s for s in decision.skipped} if decision is not None else {}
        made = ({"kind": decision.kind.value,
                 "reason": decision.reason.value if decision.reason else None,
                 "detail": decision.detail} if decision is not None else dict(begun or {}))
        self._event(run_id, None, "stop", {
            "reason": reason, "detail": decision.detail if decision is not None else "",
            "skipped": [s.to_json() for s in decision.skipped] if decision is not None else [],
            "attempts": list(attempts), "errors": list(errors),
            "candidates": candidate_lines(plan, failures, skips),
            **({"decision": made, "inputs": dict(inputs)} if made else {})}, t)
        return "failed"

    def _event(self, run_id: str, attempt_id: str | None, kind: str, data: dict[str, Any],
               at: float) -> None:
        self.rows.add("events", {"run_id": run_id, "attempt_id": attempt_id, "kind": kind,
                                 "data": json.dumps(data, sort_keys=True), "created_at": at})
        self.stats.events += 1

    def _shift(self, first: tuple[int, int], by: float) -> None:
        """Move the newest Run (whose rows start at ``first``) ``by`` seconds earlier."""
        tables = self.rows.tables
        times = ("created_at", "settled_at", "updated_at", "acquired_at")
        ev, att = first
        rows = [*tables["events"][ev:], *tables["attempts"][att:], tables["runs"][-1]]
        ids = {r["attempt_id"] for r in tables["attempts"][att:]}
        rows += [r for name in ("debits", "group_slots", "provenance")
                 for r in tables[name] if r.get("attempt_id", r.get("ref")) in ids]
        for r in rows:
            for k in times:
                if r.get(k) is not None:
                    r[k] -= by
        for e in tables["events"][ev:]:
            if e["kind"] == "lease":
                data = json.loads(e["data"])
                data["expires_at"] -= by
                e["data"] = json.dumps(data, sort_keys=True)


def generate(led: Ledger, *, attempts: int, days: float = 7.0, end: float, seed: int = 1,
             batch_attempts: int = 5000, progress: Progress | None = None,
             frozen_policy: bool = False) -> GenStats:
    """Write ``attempts`` attempts of history spread over ``days`` days before ``end``.

    With ``frozen_policy`` each Run carries the ``goclaw`` preset as its frozen policy (still
    under the marker hash), as admission freezes one, so ``failover-ledger replay`` can replay
    the history; without it (the default) a small marker, which keeps a million Runs' rows small.
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    rng = random.Random(seed)
    # The seed's history loaded again takes a tag of its own (its Run ids met the first's).
    tag = free_tag(led, uuid.UUID(int=rng.getrandbits(128)).hex[:8], _run_id)
    gen = _Generator(rng, end, tag, frozen_policy)
    stats = gen.stats
    stats.since, stats.until = end - days * 86400.0, end
    stats.routes = [r.id for r in gen.routes]
    span = days * 86400.0

    def flush() -> None:
        tables = gen.rows.tables
        if tables["attempts"] or tables["runs"]:
            bulk_insert(led, tables)
            for v in tables.values():
                v.clear()
            if progress:
                progress(min(stats.attempts, attempts), attempts)

    # On PostgreSQL, the months of the history get their partitions before the load (the
    # ledger makes only the coming months'), as a ledger that lived through them has.
    ensure_partitions(storage_of(led).context, end, since=stats.since)
    i = 0
    while stats.attempts < attempts:
        # Runs arrive in time order, spread evenly over the span by the attempts written so far
        # (so the requested attempt count lands exactly on the span, whatever the retry mix).
        t0 = stats.since + span * min(stats.attempts + rng.random(), attempts - 0.5) / attempts
        i += 1
        gen.run(i, t0, attempts - stats.attempts)
        if len(gen.rows.tables["attempts"]) >= batch_attempts:
            flush()
    flush()
    bulk_insert(led, _health_rows(rng, gen.routes, end))
    analyze(led)
    return stats


def _health_rows(rng: random.Random, routes: list[Route], end: float
                 ) -> dict[str, list[dict[str, Any]]]:
    """Current health: a few routes cooling, one disabled, probes, groups with waiting floors."""
    health: list[dict[str, Any]] = []
    for i, r in enumerate(routes):
        cooling = i % 5 == 1
        disabled = i % 11 == 3
        health.append({
            "key": r.id, "kind": "route", "provider": r.provider,
            "cooldown_until": end + rng.uniform(30, 600) if cooling else None,
            "disabled_until": end + 3600 if disabled else None,
            "disabled_reason": "auth" if disabled else None,
            "error_count": rng.randint(1, 9) if cooling or disabled else 0,
            "failure_counts": json.dumps({"rate_limit": rng.randint(1, 40)} if cooling else {}),
            "last_failure_at": end - rng.uniform(1, 300) if cooling or disabled else None,
            "last_used": end - rng.uniform(0, 60),
            "last_probe_at": end - rng.uniform(5, 120) if cooling else None,
            "updated_at": end,
        })
        for p in r.profiles:
            health.append({
                "key": p.id, "kind": "profile", "provider": r.provider, "cooldown_until": None,
                "disabled_until": None, "disabled_reason": None, "error_count": 0,
                "failure_counts": "{}", "last_failure_at": None,
                "last_used": end - rng.uniform(0, 60), "last_probe_at": None, "updated_at": end,
            })
    seen: dict[str, dict[str, Any]] = {}
    for row in health:
        seen.setdefault(row["key"], row)  # profiles are shared by a provider's routes
    groups = []
    for j, g in enumerate(sorted({r.group for r in routes})):
        cooling = j % 3 == 0
        groups.append({
            "group_id": g, "max_in_flight": 64 if j % 2 == 0 else None,
            "mode": "cooldown" if cooling else "open",
            "until": end + rng.uniform(5, 90) if cooling else None,
            "reason": "rate_limit" if cooling else None,
            "sampled_at": end - rng.uniform(0, 30), "updated_at": end,
        })
    return {"health": list(seen.values()), "capacity_groups": groups}


__all__ = ["MAX_ATTEMPTS", "POLICY_HASH", "GenStats", "catalog", "generate"]
