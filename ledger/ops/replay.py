"""Replay at the edge: read a window of the ledger once, then replay it purely.

:func:`replay` (and :meth:`ledger.ops.audit.Audit.replay`, ``failover-ledger replay``) reads
the window's Runs, their recorded decisions and the Attempts around them in one read
transaction (:class:`ledger.storage.replay.ReplayQueries`), turns the rows into the values of
:mod:`ledger.decide.replay` (each frozen plan, grant and policy parsed once however many Runs
share it), and hands them to :func:`ledger.decide.replay.replay`, which decides everything with
pure functions. Nothing is written and no provider is called. The report's types are those of
:mod:`ledger.decide.replay`, re-exported here.
"""

from __future__ import annotations

import json
import math

from ledger.api.facade import Ledger
from ledger.api.face import reads_of
from ledger.decide.replay import (
    AttemptFacts,
    Check,
    Coverage,
    DecisionRecord,
    Estimate,
    Estimates,
    Example,
    Finding,
    History,
    ReplayReport,
    RunFacts,
    Totals,
    lead_in,
)
from ledger.decide.replay import replay as replay_history
from ledger.domain.timefmt import iso
from ledger.domain.values import Grant, Route
from ledger.errors import InvalidArgument, LedgerError, NotFound, PolicyError
from ledger.policy.load import load_policy
from ledger.policy.model import FROZEN, Policy
from ledger.storage.encode import fact_member
from ledger.storage.replay import ReplayQueries, ReplayRows

_ANSWERED = fact_member("phase", "after_headers")
_UNREADABLE = fact_member("transport", "malformed_event")
_ACCEPTED = fact_member("accepted", True)


def replay_policy(policy: Policy | str) -> Policy:
    """The policy to replay: a :class:`~ledger.Policy`, a preset name or a policy file.

    Raises:
        InvalidArgument: ``policy`` is none of these, or the file does not load or validate
            (``field="policy"``; the policy error, naming each problem and its fix, is the
            cause).
    """
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or not policy:
        raise InvalidArgument("policy must be a ledger.Policy, a preset name (goclaw, fased, "
                              "failure-domain) or the path of a policy file", field="policy")
    try:
        return load_policy(policy)
    except PolicyError as e:
        raise InvalidArgument(f"policy {policy!r} does not load: {e}", field="policy") from e


def _money(state: str, reserved: int, cost: int | None, fact: str | None) -> int:
    """What an Attempt's debit took: posted, or still held (the settle rule).

    The same rule :func:`ledger.storage.audit.charged_and_held` reads off the row in SQL.
    """
    if state in ("dispatching", "unknown"):
        return reserved
    if state not in ("succeeded", "failed"):
        return 0
    if cost is None:
        answered = (state == "failed" and _ANSWERED in (fact or "")
                    and _UNREADABLE not in (fact or "") and _ACCEPTED not in (fact or ""))
        return 0 if answered else reserved
    return min(cost, reserved)


def history_of(rows: ReplayRows, *, since: float, until: float) -> History:
    """The :class:`~ledger.decide.replay.History` the rows of a window make.

    Each distinct frozen plan, grant and policy is parsed once. A policy that does not read as
    one (a bulk-loaded history's marker) is ``None``: its Runs are counted, not replayed.
    """
    policies: dict[str, Policy | None] = {}
    for h, text in rows.policies.items():
        try:
            policies[h] = Policy.model_validate(json.loads(text), context=FROZEN)
        except (LedgerError, ValueError):
            policies[h] = None
    plans: dict[str, tuple[Route, ...]] = {}
    grants: dict[str, Grant] = {}
    runs = {}
    for (run_id, tenant, role, status, plan_text, grant_text, p_hash, deadline, created,
         _updated) in rows.runs:
        plan = plans.get(plan_text)
        if plan is None:
            plan = plans[plan_text] = tuple(Route.model_validate(x)
                                            for x in json.loads(plan_text))
        grant = grants.get(grant_text)
        if grant is None:
            grant = grants[grant_text] = Grant.model_validate(json.loads(grant_text))
        runs[run_id] = RunFacts(
            run_id=run_id, tenant=tenant, role=role, status=status, plan=plan, grant=grant,
            policy=policies.get(p_hash), policy_hash=p_hash, deadline=deadline,
            created_at=created)
    retries: dict[str, int] = {}
    decisions = []
    for event_id, run_id, attempt_id, kind, text, created in rows.events:
        data = json.loads(text)
        if kind == "retry":
            if attempt_id is not None and isinstance(data.get("n"), int):
                retries[attempt_id] = data["n"]
            continue
        decisions.append(DecisionRecord(event_id=int(event_id), run_id=run_id, kind=kind,
                                        attempt_id=attempt_id, data=data, created_at=created))
    attempts = [AttemptFacts(
        attempt_id=aid, run_id=run_id, turn_id=turn, seq=seq, kind=kind, route_id=route,
        provider=provider, model=model, group_id=group, profile_id=profile, state=state,
        fact=fact, money_micros=_money(state, int(reserved), cost, fact), created_at=created,
        settled_at=settled, policy_hash=p_hash, retry=retries.get(aid, 0))
        for (aid, run_id, turn, seq, kind, route, provider, model, group, profile, state, fact,
             cost, reserved, created, settled, p_hash) in rows.attempts]
    return History(since=since, until=until, runs=runs, attempts=attempts, decisions=decisions,
                   policies=policies, lead_from=rows.lead_from)


def replay(ledger: Ledger, policy: Policy | str, *, since: float | None = None,
           until: float | None = None, run: str | None = None,
           tenant: str | None = None) -> ReplayReport:
    """What ``policy`` would have done over the Runs admitted in [since, until).

    See :meth:`ledger.ops.audit.Audit.replay`, which this is, and which validated the
    arguments (``since``, ``until``, ``run`` and ``tenant`` arrive checked). With ``run``,
    ``since`` and ``until`` default to unbounded, and a ``run`` the ledger does not have is
    :class:`~ledger.errors.NotFound`.
    """
    pol = replay_policy(policy)
    now = ledger.now()
    # One Run is replayed whenever it was admitted: bounding it by this reader's clock left
    # out a Run admitted "after" it (another host's clock ahead), as if it were not there.
    bound = until if until is not None or run is not None else now
    if since is None:
        since = bound - 86400.0 if bound is not None and run is None else 0.0
    if bound is not None and since >= bound:
        # Times as people read them (ISO, UTC), never as epoch seconds.
        raise InvalidArgument(f"since ({iso(since)}) must be before until ({iso(bound)}); "
                              "pass an earlier since or a later until", field="since")
    rows = ReplayQueries(reads_of(ledger).context).window(
        since=since, until=bound, run_id=run, tenant=tenant, lead_s=lead_in(pol),
        attempts_until=now)
    if not rows.run_exists:
        # An empty report would read "0 decisions, all agree": a mistyped id looked fine.
        raise NotFound(f"unknown run id {run!r}; list runs with `failover-ledger runs`",
                       run_id=run)
    if bound is None:
        # The report's window ends after every record read (the evidence is [since, until)).
        bound = now if rows.end < now else math.nextafter(rows.end, math.inf)
    return replay_history(history_of(rows, since=since, until=bound), pol)


__all__ = [
    "Check",
    "Coverage",
    "Estimate",
    "Estimates",
    "Example",
    "Finding",
    "ReplayReport",
    "Totals",
    "history_of",
    "replay",
    "replay_policy",
]
