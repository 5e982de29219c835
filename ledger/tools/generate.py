"""A realistic synthetic history for scale tests and the audit benchmark (``failover-ledger
generate``).

Runs over many routes, providers, capacity groups, tenants and labels; failures with classified
facts (rate limits, overloads, timeouts, server errors, auth, context overflow, network before
send); same-route retries and failovers with the selector's ``select``/``retry``/``move``/``stop``
events; a few unknown attempts and, at the recent end, a few still dispatching; current route
health (cooldowns, disables, probes) and group waiting floors. Deterministic for a given seed.

The rows are written with the storage port's ``bulk_insert``, not through the fenced write
path, so generated runs carry a small policy marker instead of the full frozen policy: they are
finished history for reading, not runs to resume.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from ledger.domain.facts import Category, FailureFact, Phase, Scope, Transport
from ledger.domain.values import Price, Profile, Route, content_hash
from ledger.storage.port import StoragePort

Progress = Callable[[int, int], None]

_PROVIDERS = {
    # provider: (models, groups, base failure rate, price in/out per Mtok)
    "openai": (["gpt-4o", "gpt-4o-mini", "o3"], ["openai-east", "openai-west"], 0.08, (2.5, 10)),
    "anthropic": (["claude-sonnet", "claude-haiku"], ["anthropic-main"], 0.10, (3, 15)),
    "gemini": (["gemini-pro", "gemini-flash"], ["gemini-main"], 0.12, (1.25, 5)),
    "mistral": (["mistral-large"], ["mistral-eu"], 0.15, (2, 6)),
    "together": (["llama-70b", "qwen-72b"], ["together-shared"], 0.22, (0.9, 0.9)),
}
_TENANTS = ["acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "wonka"]
_TEAMS = ["search", "research", "support", "eval"]
_ENVS = ["prod", "prod", "prod", "staging"]
# (category, weight, status, transport, phase, scope, movable)
_FAILURES: list[tuple[Category, int, int | None, Transport | None, Phase, Scope]] = [
    (Category.RATE_LIMIT, 34, 429, None, Phase.AFTER_HEADERS, Scope.GROUP),
    (Category.OVERLOADED, 18, 529, None, Phase.AFTER_HEADERS, Scope.ROUTE),
    (Category.SERVER_ERROR, 16, 500, None, Phase.AFTER_HEADERS, Scope.ROUTE),
    (Category.TIMEOUT, 14, None, Transport.READ_TIMEOUT, Phase.AFTER_SEND, Scope.ROUTE),
    (Category.NETWORK, 8, None, Transport.CONNECT_REFUSED, Phase.BEFORE_SEND, Scope.ROUTE),
    (Category.AUTH, 5, 401, None, Phase.AFTER_HEADERS, Scope.ROUTE),
    (Category.CONTEXT_OVERFLOW, 5, 400, None, Phase.AFTER_HEADERS, Scope.REQUEST),
]
_RETRYABLE = {Category.RATE_LIMIT, Category.OVERLOADED, Category.SERVER_ERROR, Category.TIMEOUT,
              Category.NETWORK}
# Generated runs carry this policy hash (and the marker as their policy): how ``generate`` tells
# its own history from real runs.
POLICY_HASH = "generated"
_POLICY_MARKER = json.dumps({"generated": True, "preset": "goclaw"})
_RESERVE = 50_000  # micros held per attempt


@dataclass
class GenStats:
    runs: int = 0
    attempts: int = 0
    failed: int = 0
    unknown: int = 0
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


def generate(store: StoragePort, *, attempts: int, days: float = 7.0, end: float, seed: int = 1,
             batch_attempts: int = 5000, progress: Progress | None = None) -> GenStats:
    """Write about ``attempts`` attempts of history spread over ``days`` days before ``end``."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    rng = random.Random(seed)
    routes = catalog()
    by_id = {r.id: r for r in routes}
    fail_rate = {r.id: _PROVIDERS[r.provider][2] * rng.uniform(0.6, 1.4) for r in routes}
    # A plan is 3 routes from 3 different providers, primary first.
    plans: list[list[Route]] = []
    provs = list(_PROVIDERS)
    for _ in range(24):
        chosen = rng.sample(provs, 3)
        plans.append([rng.choice([r for r in routes if r.provider == p]) for p in chosen])
    plan_json = [json.dumps([r.model_dump(mode="json") for r in p], sort_keys=True)
                 for p in plans]
    stats = GenStats(since=end - days * 86400.0, until=end, routes=[r.id for r in routes])
    span = days * 86400.0
    tag = uuid.UUID(int=rng.getrandbits(128)).hex[:8]
    pending: dict[str, list[dict[str, Any]]] = {k: [] for k in ("runs", "attempts", "debits",
                                                                 "events")}
    written = 0

    def flush() -> None:
        nonlocal written
        if pending["attempts"] or pending["runs"]:
            store.bulk_insert(pending)
            written = stats.attempts
            for v in pending.values():
                v.clear()
            if progress:
                progress(min(written, attempts), attempts)

    weights = [w for _c, w, *_ in _FAILURES]
    i = 0
    while stats.attempts < attempts:
        # Runs arrive in time order, spread evenly over the span by the attempts written so far
        # (so the requested attempt count lands exactly on the span, whatever the retry mix).
        t0 = stats.since + span * min(stats.attempts + rng.random(), attempts - 0.5) / attempts
        t0 = min(t0, end - 15.0)  # leave room for the run's own attempts before ``end``
        i += 1
        pi = rng.randrange(len(plans))
        plan = plans[pi]
        run_id = f"run-{tag}-{i:08d}"
        tenant = rng.choice(_TENANTS)
        labels = {"team": rng.choice(_TEAMS), "env": rng.choice(_ENVS)}
        recent = end - t0 < 600  # the last ten minutes may hold in-flight attempts
        t = t0
        ev = pending["events"]
        ev.append(_event(run_id, None, "admit", {"policy_hash": POLICY_HASH, "parent": None}, t))
        ev.append(_event(run_id, None, "lease", {"executor": "gen", "fence": 1,
                                                 "previous": None}, t))
        idx, seq, retries, calls = 0, 0, 0, 0
        posted = tokens = reserved = 0
        status = "running"
        current: tuple[str, str | None] | None = None
        cause: dict[str, Any] | None = None
        prev_route: str | None = None
        while True:
            route = plan[idx]
            seq += 1
            calls += 1
            stats.attempts += 1
            att_id = f"att-{tag}-{i:08d}-{seq}"
            profile = route.profiles[rng.randrange(len(route.profiles))].id
            kind = "first" if seq == 1 else ("retry" if prev_route == route.id else "failover")
            skipped = []
            if seq == 1 and rng.random() < 0.03:
                skipped = [{"route": plan[-1].id, "reason": "cooling",
                            "detail": "cooldown until a later time"}]
            ev.append(_event(run_id, att_id, "select", {
                "decision": kind, "route": route.id, "from_route": prev_route,
                "profile": profile,
                "reason": {"first": "primary", "retry": "same_route_retry",
                           "failover": "next_candidate"}[kind],
                "skipped": skipped, "cause": cause,
            }, t))
            roll = rng.random()
            created = t
            t += rng.uniform(0.4, 12.0)
            row: dict[str, Any] = {
                "attempt_id": att_id, "run_id": run_id, "tenant": tenant, "turn_id": "turn-1",
                "seq": seq,
                "kind": kind, "route_id": route.id, "provider": route.provider,
                "model": route.model, "group_id": route.group, "profile_id": profile,
                "debit_id": "d-" + att_id, "envelope_hash": "sha256:" + "0" * 64,
                "reject_reason": None, "fact": None, "category": None, "http_status": None,
                "effective_output": False, "tool_started": False, "prompt_tokens": None,
                "completion_tokens": None, "cost_micros": None, "reserved_micros": _RESERVE,
                "model_reported": None, "output_hash": None, "settle_hash": None,
                "begin_hash": "sha256:" + "1" * 64, "fence": 1, "settle_fence": 1,
                "executor": "gen", "created_at": created, "settled_at": t,
            }
            debit = {"debit_id": "d-" + att_id, "run_id": run_id, "attempt_id": att_id,
                     "state": "posted", "reserved_micros": _RESERVE, "posted_micros": 0,
                     "created_at": created, "settled_at": t}
            pending["attempts"].append(row)
            pending["debits"].append(debit)
            if recent and roll < 0.15:
                row.update(state="dispatching", settled_at=None, settle_fence=None)
                debit.update(state="reserved", settled_at=None)
                reserved += _RESERVE
                stats.dispatching += 1
                break
            if roll < 0.003:
                row.update(state="unknown", settle_fence=1)
                debit.update(state="reserved", settled_at=None)
                reserved += _RESERVE
                ev.append(_event(run_id, att_id, "unknown",
                                 {"reason": "sent without receipt"}, t))
                stats.unknown += 1
                status = "stopped"
                ev.append(_event(run_id, None, "stop", {"reason": "unknown_outcome",
                                                        "cause": None}, t))
                break
            if rng.random() < fail_rate[route.id]:
                cat, _w, st, tr, phase, scope = rng.choices(_FAILURES, weights)[0]
                fact = FailureFact(
                    category=cat, status=st, phase=phase, scope=scope, transport=tr,
                    provider=route.provider, resubmit=cat in _RETRYABLE,
                    moves_on=cat is not Category.CONTEXT_OVERFLOW,
                    retry_after_s=float(rng.choice([1, 2, 5, 30])) if st == 429 else None,
                )
                row.update(state="failed", fact=json.dumps(fact.to_json()),
                           category=cat.value, http_status=st)
                if phase is Phase.BEFORE_SEND:
                    debit.update(state="voided")
                stats.failed += 1
                cause = {"category": cat.value, "status": st, "scope": scope.value}
                prev_route = route.id
                if cat in _RETRYABLE and retries < 2 and rng.random() < 0.35:
                    retries += 1
                    ev.append(_event(run_id, None, "retry_permission", {}, t))
                    ev.append(_event(run_id, att_id, "retry", {
                        "route": route.id, "cause": cause, "delay_s": 1.0 * retries,
                        "n": retries}, t))
                    t += retries
                    continue
                if cat is not Category.CONTEXT_OVERFLOW and idx + 1 < len(plan):
                    idx += 1
                    ev.append(_event(run_id, att_id, "move", {
                        "from_route": route.id, "to_route": plan[idx].id, "cause": cause}, t))
                    continue
                reason = "not_movable" if cat is Category.CONTEXT_OVERFLOW else "exhausted"
                ev.append(_event(run_id, None, "stop", {"reason": reason, "cause": cause}, t))
                status = "failed"
                break
            pt, ct = rng.randint(200, 4000), rng.randint(50, 1500)
            cost = min(_RESERVE, _cost(by_id[route.id], pt, ct))
            row.update(state="succeeded", prompt_tokens=pt, completion_tokens=ct,
                       cost_micros=cost, model_reported=route.model,
                       output_hash="sha256:" + uuid.UUID(int=rng.getrandbits(128)).hex * 2)
            debit.update(posted_micros=cost)
            posted += cost
            tokens += pt + ct
            current = (route.id, profile)
            status = "succeeded"
            if idx > 0:
                stats.failovers += 1
            break
        if status in ("succeeded", "failed"):
            ev.append(_event(run_id, None, "finish", {"status": status}, t))
        stats.runs += 1
        pending["runs"].append({
            "run_id": run_id, "parent_run_id": None, "role": "research", "tenant": tenant,
            "labels": json.dumps(labels, sort_keys=True), "status": status,
            "plan": plan_json[pi], "run_grant": json.dumps({"recipients": {}, "roles": None}),
            "budget": json.dumps({"max_calls": 8, "max_cost": "1", "max_retries": 3,
                                  "max_tokens": None}),
            "policy": _POLICY_MARKER, "policy_hash": POLICY_HASH,
            "selected_route": plan[0].id, "content_hash": content_hash(run_id),
            "deadline": None, "max_calls": 8, "max_retries": 3, "max_cost_micros": 1_000_000,
            "max_tokens": None, "calls_used": calls, "retries_used": retries,
            "reserved_micros": reserved, "posted_micros": posted, "tokens_used": tokens,
            "carved_calls": 0, "carved_retries": 0, "carved_micros": 0,
            "current_route": current[0] if current else None,
            "current_profile": current[1] if current else None,
            "lease_holder": "gen" if status == "running" else None,
            "fence": 1, "lease_expires_at": end + 30 if status == "running" else None,
            "created_at": t0, "updated_at": t,
        })
        if len(pending["attempts"]) >= batch_attempts:
            stats.events += len(pending["events"])
            flush()
    stats.events += len(pending["events"])
    pending_health = _health_rows(rng, routes, end)
    flush()
    store.bulk_insert(pending_health)
    store.analyze()
    return stats


def _cost(route: Route, prompt: int, completion: int) -> int:
    return int(route.cost(prompt, completion) * 1_000_000)  # in micros


def _event(run_id: str, attempt_id: str | None, kind: str, data: dict[str, Any],
           at: float) -> dict[str, Any]:
    return {"run_id": run_id, "attempt_id": attempt_id, "kind": kind,
            "data": json.dumps(data, sort_keys=True), "created_at": at}


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


__all__ = ["POLICY_HASH", "GenStats", "catalog", "generate"]
