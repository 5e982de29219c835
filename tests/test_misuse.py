"""Every misuse of the public API is a typed error naming the field, the same on both backends,
and a refused call writes nothing (issue 12, section 4).

One table of misuses (wrong types, out-of-range numbers, bad ids, bad enums, NaN and infinity,
negative budgets, unknown keywords, a forged lease, calls on an ended session, ...) is driven
through every public entry point: the models, :class:`Ledger` and :class:`AsyncLedger`,
``execute``/``aexecute``, Run sessions (``with``/``async with``), the audit queries, recovery and
the adapters. For each case, on SQLite and on PostgreSQL, through the blocking and the asyncio
face: the error is the case's class (under :class:`LedgerError`), its ``field`` is the case's
field, its message names that field and says what to pass instead, and every table of the
database is row for row what it was before the call.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from ledger import (
    ArgumentMismatch,
    AsyncLedger,
    Budget,
    Capabilities,
    Envelope,
    Grant,
    InvalidArgument,
    InvalidState,
    Ledger,
    LedgerError,
    ManualClock,
    NotFound,
    Observation,
    Part,
    Policy,
    Price,
    Profile,
    Route,
    ToolSpec,
)
from ledger.adapters import HttpAdapter, SyncAdapter, async_sender, sync_sender
from ledger.api.lease import AsyncLeaseKeeper, LeaseKeeper
from ledger.api.turn import SendResult, aexecute, execute
from ledger.decide.classify import classify
from ledger.domain.records import Lease
from ledger.ops.audit import AsyncAudit, Audit
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import arecover, recover
from ledger.policy.load import load_policy, policy_hash, preset
from ledger.policy.model import CooldownCurve, ProfilePolicy
from ledger.storage import schema
from tests.storage.helpers import as_an_earlier_version, sql_context

T0 = 1_000_000.0
NAN, INF = math.nan, math.inf
FREE = Price()
HASH = "sha256:" + "0" * 64


def routes() -> list[Route]:
    return [Route(id="a", provider="p1", model="m1", group="g", recipient="r1", price=FREE),
            Route(id="b", provider="p2", model="m2", group="h", recipient="r1", price=FREE)]


BUDGET = Budget(max_calls=10, max_retries=3, max_cost=Decimal("1"))
GRANT = Grant(recipients={"r1": ["user_input", "model_derived", "tool_result"]})
ENV = Envelope(parts=[Part(content="hi")])
DATED_429 = Observation(status=429, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})


def never_sent(_d: Any) -> SendResult:
    raise AssertionError("a refused call must not send")


async def anever_sent(_d: Any) -> SendResult:
    raise AssertionError("a refused call must not send")


@dataclass
class Face:
    """One backend seen through one face (blocking or asyncio), with a Run in progress: a
    leased Run ``r1`` with one Attempt dispatching, and an open Run session ``s1``."""

    L: Any  # Ledger or AsyncLedger
    sync: Ledger
    lease: Lease
    attempt_id: str
    session: Any
    is_async: bool

    @property
    def execute(self) -> Callable[..., Any]:
        return aexecute if self.is_async else execute

    @property
    def send(self) -> Callable[..., Any]:
        return anever_sent if self.is_async else never_sent

    @property
    def recover(self) -> Callable[..., Any]:
        return arecover if self.is_async else recover

    @property
    def audit(self) -> Any:
        return AsyncAudit(Audit(self.sync)) if self.is_async else Audit(self.sync)

    @property
    def adapter_cls(self) -> type[Any]:
        return HttpAdapter if self.is_async else SyncAdapter

    @property
    def sender(self) -> Callable[..., Any]:
        return async_sender if self.is_async else sync_sender

    @property
    def keeper_cls(self) -> type[Any]:
        return AsyncLeaseKeeper if self.is_async else LeaseKeeper

    def forged(self, **changes: Any) -> Lease:
        return replace(self.lease, **changes)


@dataclass(frozen=True)
class Case:
    """``call(face)`` must raise ``error`` with ``field``; the message must name the field and
    contain ``fix`` (the words that say what to pass instead)."""

    name: str
    call: Callable[[Face], Any]
    field: str
    fix: str
    error: type[LedgerError] = InvalidArgument


def C(name: str, field: str, fix: str, call: Callable[[Face], Any],
      error: type[LedgerError] = InvalidArgument) -> Case:
    return Case(name, call, field, fix, error)


def _enter(session: Any) -> Any:
    """Enter and leave a (sync or async) Run session: admission happens on entering."""
    if hasattr(session, "__aenter__"):
        async def go() -> None:
            async with session:
                pass
        return go()
    with session:
        pass
    return None


def _admit(f: Face, run_id: str = "new", **kw: Any) -> Any:
    args: dict[str, Any] = {"plan": routes(), "budget": BUDGET, "grant": GRANT}
    args.update(kw)
    return f.L.admit_run(run_id, **args)


def _begin(f: Face, **kw: Any) -> Any:
    args: dict[str, Any] = {"route": "a", "envelope_hash": HASH, "reserve": "0.01"}
    args.update(kw)
    return f.L.begin_attempt(f.lease, **args)


def _settle(f: Face, **kw: Any) -> Any:
    args: dict[str, Any] = {"outcome": "succeeded"}
    args.update(kw)
    return f.L.settle_attempt(f.lease, f.attempt_id, **args)


def _execute(f: Face, **kw: Any) -> Any:
    args: dict[str, Any] = {"ledger": f.L, "lease": f.lease, "envelope": ENV, "send": f.send}
    args.update(kw)
    return f.execute(args.pop("ledger"), args.pop("lease"), args.pop("envelope"),
                     args.pop("send"), **args)


def _route(**kw: Any) -> Route:
    args: dict[str, Any] = {"id": "x", "provider": "p", "model": "m", "group": "g",
                            "recipient": "r1", "price": FREE}
    args.update(kw)
    return Route(**args)


ID_TOO_LONG = "x" * 201
DOT_FIX = "choose an id other than '.' or '..'"
CASES: list[Case] = [
    # -- the models ---------------------------------------------------------------------------
    C("budget negative cost", "max_cost", ">= 0",
      lambda f: Budget(max_calls=1, max_retries=0, max_cost=-1)),
    C("budget NaN cost", "max_cost", "finite", lambda f: Budget(max_calls=1, max_retries=0,
                                                                  max_cost=NAN)),
    C("budget inf cost", "max_cost", "finite",
      lambda f: Budget(max_calls=1, max_retries=0, max_cost="inf")),
    C("budget cost not a number", "max_cost", "decimal",
      lambda f: Budget(max_calls=1, max_retries=0, max_cost="abc")),
    C("budget bool calls", "max_calls", "integer",
      lambda f: Budget(max_calls=True, max_retries=0, max_cost=1)),
    C("budget float calls", "max_calls", "integer",
      lambda f: Budget(max_calls=1.5, max_retries=0, max_cost=1)),
    C("budget negative retries", "max_retries", ">= 0",
      lambda f: Budget(max_calls=1, max_retries=-1, max_cost=1)),
    C("budget calls beyond range", "max_calls", "<=",
      lambda f: Budget(max_calls=2**40, max_retries=0, max_cost=1)),
    C("budget unknown field", "max_costs", "max_cost",
      lambda f: Budget(max_calls=1, max_retries=0, max_cost=1, max_costs=2)),
    C("budget missing field", "max_retries", "pass it",
      lambda f: Budget(max_calls=1, max_cost=1)),
    C("route without group", "group", "pass it",
      lambda f: Route(id="x", provider="p", model="m", recipient="r")),
    C("route id too long", "id", "shorter", lambda f: _route(id=ID_TOO_LONG)),
    C("route id with NUL", "id", "printable", lambda f: _route(id="a\x00b")),
    C("route id with a lone surrogate", "id", "lone surrogate", lambda f: _route(id="a\ud800b")),
    C("route id empty", "id", "non-empty", lambda f: _route(id="  ")),
    # Said "is not a string; pass a string" of a string.
    C("route endpoint with a lone surrogate", "endpoint", "no lone surrogates",
      lambda f: _route(endpoint="http://x/\ud800")),
    C("route bad protocol", "protocol", "one of", lambda f: _route(protocol="grpc")),
    C("route api_key_env not a name", "api_key_env", "OPENAI_API_KEY",
      lambda f: _route(api_key_env="MY KEY")),
    C("route negative price", "price.input_per_mtok", ">= 0",
      lambda f: _route(price={"input_per_mtok": "-1"})),
    C("route profile id", "profiles[0].id", "non-empty",
      lambda f: _route(profiles=[{"id": ""}])),
    C("capabilities context window zero", "context_window", ">= 1",
      lambda f: Capabilities(context_window=0)),
    C("grant roles a string", "roles", "list", lambda f: Grant(roles="research")),
    C("grant class id with newline", "recipients['r1'][0]", "printable",
      lambda f: Grant(recipients={"r1": ["a\nb"]})),
    C("price inf", "output_per_mtok", "finite", lambda f: Price(output_per_mtok=INF)),
    C("profile bad type", "type", "one of", lambda f: Profile(id="p", type="password")),
    C("part bad role", "role", "one of", lambda f: Part(role="robot", content="x")),
    C("part content not text", "content", "string", lambda f: Part(content=3)),
    # A model's answer or a tool's result labelled as the user's own would need no provenance.
    C("part assistant labelled user_input", "data_class", "data_class='model_derived'",
      lambda f: Part(role="assistant", content="x", data_class="user_input")),
    C("part tool labelled system", "data_class", "data_class='tool_result'",
      lambda f: Part(role="tool", content="x", data_class="system", tool_call_id="c1")),
    C("envelope params NaN", "params", "finite",
      lambda f: Envelope(parts=[Part(content="x")], params={"temperature": NAN})),
    C("envelope params a set", "params", "JSON",
      lambda f: Envelope(parts=[Part(content="x")], params={"seed": {1, 2}})),
    C("envelope max_output_tokens zero", "max_output_tokens", ">= 1",
      lambda f: Envelope(parts=[Part(content="x")], max_output_tokens=0)),
    C("envelope stream a string", "stream", "True or False",
      lambda f: Envelope(parts=[Part(content="x")], stream="yes")),
    # An envelope with nothing to send is refused before a turn selects a route or begins an
    # Attempt (and before a caller's own send function could send it).
    C("envelope with no parts", "parts", "add at least one user part",
      lambda f: Envelope(parts=[])),
    C("tool spec name empty", "name", "non-empty", lambda f: ToolSpec(name="")),
    C("model assignment", "max_cost", "build a new Budget",
      lambda f: setattr(BUDGET, "max_cost", Decimal(5))),
    C("model_validate json", "max_calls", "integer",
      lambda f: Budget.model_validate_json('{"max_calls": "many", "max_retries": 0, '
                                           '"max_cost": 1}')),
    C("policy name empty", "name", "at least 1", lambda f: Policy(name="")),
    C("policy unknown field", "movs_on", "'moves_on'",
      lambda f: Policy.model_validate({"name": "x", "movs_on": []})),
    C("policy json rule matching nothing", "moves_on[0].categories", "at least one category",
      lambda f: Policy.model_validate_json('{"name": "x", "moves_on": [{"categories": []}]}')),
    C("policy section built in code", "cap_s", "raise cap_s",
      lambda f: CooldownCurve(base_s=100, cap_s=10)),
    C("policy list naming an entry twice", "type_order[1]", "list each profile type once",
      lambda f: ProfilePolicy(type_order=["oauth", "oauth"])),
    C("policy assignment", "name", "build a new Policy",
      lambda f: setattr(preset("fased"), "name", "y")),
    # -- admission ----------------------------------------------------------------------------
    C("admit run id too long", "run_id", "shorter", lambda f: _admit(f, ID_TOO_LONG)),
    C("admit run id with NUL", "run_id", "printable", lambda f: _admit(f, "r\x00")),
    C("admit run id not a string", "run_id", "non-empty string", lambda f: _admit(f, 42)),
    # A browser resolves a "." or ".." path segment: the dashboard's forms could not reach it.
    C("admit run id a dot", "run_id", DOT_FIX, lambda f: _admit(f, ".")),
    C("admit run id two dots", "run_id", DOT_FIX, lambda f: _admit(f, "..")),
    C("admit budget mapping negative cost", "budget.max_cost", ">= 0",
      lambda f: _admit(f, budget={"max_calls": 1, "max_retries": 0, "max_cost": -1})),
    C("admit budget mapping typo", "budget.max_cals", "max_calls",
      lambda f: _admit(f, budget={"max_cals": 1, "max_retries": 0, "max_cost": 1})),
    C("admit budget not a budget", "budget", "Budget", lambda f: _admit(f, budget=7)),
    C("admit plan a string", "plan", "list", lambda f: _admit(f, plan="a,b")),
    C("admit plan entry without group", "plan[0].group", "pass it",
      lambda f: _admit(f, plan=[{"id": "x", "provider": "p", "model": "m",
                                 "recipient": "r1", "price": {}}])),
    C("admit endpoint with user:password", "plan[1].endpoint", "credential profile",
      lambda f: _admit(f, plan=[routes()[0], routes()[1].model_copy(update={
          "endpoint": "https://egress:hunter2-pw@gw.example.com/v1"})])),
    C("admit endpoint with a key parameter", "plan[0].endpoint", "api_key_env",
      lambda f: _admit(f, plan=[routes()[0].model_copy(update={
          "endpoint": "https://generativelanguage.googleapis.com/v1beta?key=AIzaSyA-abcdef"})])),
    C("admit endpoint with a key-shaped token", "plan[0].endpoint", "api_key_env",
      lambda f: _admit(f, plan=[routes()[0].model_copy(update={
          "endpoint": "https://gw.example.com/sk-proj-abcdefghijklmnopqrstuvwx0123/v1"})])),
    C("admit endpoint with a fragment", "plan[0].endpoint", "#fragment",
      lambda f: _admit(f, plan=[routes()[0].model_copy(update={
          "endpoint": "https://gw.example.com/v1#section"})])),
    C("admit endpoint with NUL", "plan[0].endpoint", "percent-encode",
      lambda f: _admit(f, plan=[routes()[0].model_copy(update={
          "endpoint": "http://127.0.0.1:9/v1\x00"})])),
    C("admit endpoint with a bidi override", "plan[0].endpoint", "U+202E",
      lambda f: _admit(f, plan=[routes()[0].model_copy(update={
          "endpoint": "http://127.0.0.1:9/\u202e1v"})])),
    C("admit endpoint with a newline", "plan[0].endpoint", "control or format",
      lambda f: _admit(f, plan=[routes()[0].model_copy(update={
          "endpoint": "http://127.0.0.1:9/v1\nHost: x"})])),
    C("admit grant typo", "grant.recipient", "recipients",
      lambda f: _admit(f, grant={"recipient": {}})),
    C("admit deadline NaN", "deadline", "finite", lambda f: _admit(f, deadline=NAN)),
    C("admit deadline inf", "deadline", "finite", lambda f: _admit(f, deadline=INF)),
    C("admit deadline a string", "deadline", "epoch seconds",
      lambda f: _admit(f, deadline="tomorrow")),
    C("admit deadline negative", "deadline", "epoch seconds", lambda f: _admit(f, deadline=-5)),
    C("admit tenant with newline", "tenant", "printable", lambda f: _admit(f, tenant="t\n")),
    C("admit labels not a mapping", "labels", "mapping", lambda f: _admit(f, labels=["a"])),
    C("admit label value not text", "labels['team']", "string",
      lambda f: _admit(f, labels={"team": 3})),
    # Every Attempt copies the Run's labels: their number is bounded before anything is written.
    C("admit too many labels", "labels", "at most 64",
      lambda f: _admit(f, labels={f"k{i}": "v" * 200 for i in range(65)})),
    C("admit selected route unknown", "selected_route", "plan",
      lambda f: _admit(f, selected_route="zz")),
    C("admit parent not a lease", "parent", "Lease", lambda f: _admit(f, parent="r1")),
    C("admit unknown keyword", "budgett", "'budget'",
      lambda f: f.L.admit_run("new", plan=routes(), budgett=BUDGET), ArgumentMismatch),
    C("admit missing budget", "budget", "pass it",
      lambda f: f.L.admit_run("new", plan=routes()), ArgumentMismatch),
    # -- groups -------------------------------------------------------------------------------
    C("configure group bool", "max_in_flight", "integer",
      lambda f: f.L.configure_group("g", max_in_flight=True)),
    C("configure group float", "max_in_flight", "integer",
      lambda f: f.L.configure_group("g", max_in_flight=1.5)),
    C("configure group negative", "max_in_flight", "between",
      lambda f: f.L.configure_group("g", max_in_flight=-1)),
    C("group state bad mode", "mode", "one of",
      lambda f: f.L.set_group_state("g", "broken", until=None)),
    C("group state until NaN", "until", "finite",
      lambda f: f.L.set_group_state("g", "cooldown", until=NAN)),
    C("group state reason not text", "reason", "string",
      lambda f: f.L.set_group_state("g", "cooldown", until=T0 + 60, reason=5)),
    C("group projections a string", "groups", "list", lambda f: f.L.group_projections("g")),
    # -- leases -------------------------------------------------------------------------------
    C("acquire ttl NaN", "ttl_s", "finite", lambda f: f.L.acquire_lease("r1", ttl_s=NAN)),
    C("acquire ttl negative", "ttl_s", "above 0", lambda f: f.L.acquire_lease("r1", ttl_s=-1)),
    C("acquire ttl huge", "ttl_s", "up to", lambda f: f.L.acquire_lease("r1", ttl_s=1e9)),
    C("acquire ttl below margin", "ttl_s", "longer ttl_s",
      lambda f: f.L.acquire_lease("r1", ttl_s=0.1)),
    C("acquire executor empty", "executor_id", "non-empty",
      lambda f: f.L.acquire_lease("r1", executor_id="")),
    C("acquire unknown keyword", "ttl", "'ttl_s'",
      lambda f: f.L.acquire_lease("r1", ttl=5), ArgumentMismatch),
    C("renew not a lease", "lease", "acquire_lease", lambda f: f.L.renew_lease("r1")),
    C("renew forged fence", "lease", "acquire_lease",
      lambda f: f.L.renew_lease(f.forged(fence=2**70))),
    C("renew forged run id", "lease", "acquire_lease",
      lambda f: f.L.renew_lease(f.forged(run_id="r\x00"))),
    # Renewed to less than the margin, the lease was lost at the next write (LeaseLost), a
    # session's exit then wrote no finish; acquire_lease refuses such a ttl_s already.
    C("renew ttl below margin", "ttl_s", "longer ttl_s",
      lambda f: f.L.renew_lease(f.lease, ttl_s=0.3)),
    C("release a dict", "lease", "acquire_lease",
      lambda f: f.L.release_lease({"run_id": "r1", "fence": 1})),
    C("finish bad status", "status", "one of", lambda f: f.L.finish_run(f.lease, "done")),
    C("finish status not an end", "status", "one of",
      lambda f: f.L.finish_run(f.lease, "running")),
    C("retry data not a mapping", "data", "mapping",
      lambda f: f.L.reserve_retry(f.lease, data=["route"])),
    C("retry data an object", "data.cause", "finite numbers",
      lambda f: f.L.reserve_retry(f.lease, data={"cause": object()})),
    # -- attempts -----------------------------------------------------------------------------
    C("begin reserve NaN", "reserve", "finite", lambda f: _begin(f, reserve=NAN)),
    C("begin reserve inf", "reserve", "finite", lambda f: _begin(f, reserve="inf")),
    C("begin reserve abc", "reserve", "decimal amount", lambda f: _begin(f, reserve="abc")),
    C("begin reserve negative", "reserve", "between 0", lambda f: _begin(f, reserve=-1)),
    C("begin reserve bool", "reserve", "decimal amount", lambda f: _begin(f, reserve=True)),
    C("begin reserve tokens negative", "reserve_tokens", "between",
      lambda f: _begin(f, reserve_tokens=-1)),
    C("begin bad kind", "kind", "one of", lambda f: _begin(f, kind="third")),
    C("begin take_retry not a bool", "take_retry", "True or False",
      lambda f: _begin(f, take_retry=1)),
    C("begin route unknown", "route", "plan", lambda f: _begin(f, route="zz")),
    C("begin route a number", "route", "route id", lambda f: _begin(f, route=3)),
    C("begin attempt id too long", "attempt_id", "shorter",
      lambda f: _begin(f, attempt_id=ID_TOO_LONG)),
    C("begin attempt id a dot", "attempt_id", DOT_FIX, lambda f: _begin(f, attempt_id=".")),
    C("begin attempt id two dots", "attempt_id", DOT_FIX, lambda f: _begin(f, attempt_id="..")),
    C("begin turn id with NUL", "turn_id", "printable", lambda f: _begin(f, turn_id="t\x00")),
    C("begin envelope hash empty", "envelope_hash", "Envelope.hash",
      lambda f: _begin(f, envelope_hash="")),
    C("begin profile not in route", "profile_id", "profile",
      lambda f: _begin(f, profile_id="nobody")),
    C("begin events a string", "events", "pairs", lambda f: _begin(f, events="note")),
    C("begin event data not JSON", "events[0].data.seen", "finite numbers",
      lambda f: _begin(f, events=[("note", {"seen": {1, 2}})])),
    C("begin unknown keyword", "reserv", "'reserve'",
      lambda f: f.L.begin_attempt(f.lease, route="a", envelope_hash=HASH, reserv="1"),
      ArgumentMismatch),
    C("settle outcome ok", "outcome", "one of", lambda f: _settle(f, outcome="ok")),
    C("settle cost NaN", "cost", "finite", lambda f: _settle(f, cost="NaN")),
    C("settle cost overflow", "cost", "between 0", lambda f: _settle(f, cost="1e30")),
    C("settle tokens 2**63", "prompt_tokens", "between",
      lambda f: _settle(f, prompt_tokens=2**63)),
    C("settle tokens bool", "completion_tokens", "integer",
      lambda f: _settle(f, completion_tokens=True)),
    C("settle effective_output a string", "effective_output", "True or False",
      lambda f: _settle(f, effective_output="yes")),
    C("settle output hash with newline", "output_hash", "Envelope.hash",
      lambda f: _settle(f, output_hash="sha\n")),
    C("settle provenance a string", "provenance_hashes", "list",
      lambda f: _settle(f, provenance_hashes=HASH)),
    C("settle provenance not a part's hash", "provenance_hashes[0]", "Part.content_hash",
      lambda f: _settle(f, provenance_hashes=["abc"])),
    # Event data is stored as JSON: an object is refused, not stored as its str().
    C("settle event data an object", "events[0].data.v", "finite numbers",
      lambda f: _settle(f, events=[("x", {"v": object()})])),
    C("settle event data NaN deep inside", "events[1].data.a[1].b", "finite numbers",
      lambda f: _settle(f, events=[("ok", {}), ("x", {"a": [1, {"b": NAN}]})])),
    # A call that never left used nothing: its usage would count in costs and the metrics.
    C("settle not_sent with usage", "prompt_tokens", "used nothing",
      lambda f: _settle(f, outcome="not_sent", prompt_tokens=10, cost=Decimal("0.5"))),
    C("settle not_sent with a cost", "cost", "used nothing",
      lambda f: _settle(f, outcome="not_sent", cost="0.5")),
    C("settle not_sent with cached tokens", "cached_tokens", "used nothing",
      lambda f: _settle(f, outcome="not_sent", cached_tokens=0)),
    C("settle before_send failure with usage", "completion_tokens", "used nothing",
      lambda f: _settle(f, outcome="failed", completion_tokens=5,
                        fact={"category": "network", "phase": "before_send"})),
    C("settle failed without fact", "fact", "observation",
      lambda f: _settle(f, outcome="failed")),
    C("settle fact a mapping with typo", "fact.categry", "category",
      lambda f: _settle(f, outcome="failed", fact={"categry": "timeout"})),
    C("settle model_reported too long", "model_reported", "at most",
      lambda f: _settle(f, model_reported="m" * 500)),
    C("mark unknown reason not text", "reason", "string",
      lambda f: f.L.mark_unknown(f.lease, f.attempt_id, 5)),
    C("record provenance kind empty", "kind", "non-empty",
      lambda f: f.L.record_provenance(f.lease, "call-1", HASH, kind="")),
    C("record provenance hash not text", "content_hash", "Envelope.hash",
      lambda f: f.L.record_provenance(f.lease, "call-1", 5)),
    C("append event data not a mapping", "data", "mapping",
      lambda f: f.L.append_event(f.lease, "note", "text")),
    C("append event data infinite", "data.waited_s", "finite numbers",
      lambda f: f.L.append_event(f.lease, "note", {"waited_s": INF})),
    C("claim probe interval negative", "interval_s", "from 0",
      lambda f: f.L.claim_probe(routes()[0], -1)),
    C("claim probe route id", "route", "Route", lambda f: f.L.claim_probe("a", 1)),
    # -- reads --------------------------------------------------------------------------------
    C("get run id not a string", "run_id", "non-empty string", lambda f: f.L.get_run(None)),
    C("get attempt id too long", "attempt_id", "shorter",
      lambda f: f.L.get_attempt(ID_TOO_LONG)),
    C("get run unknown", "run_id", "admit the run", lambda f: f.L.get_run("nope"), NotFound),
    C("attempts bad state", "state", "one of", lambda f: f.L.attempts(state="fine")),
    C("attempts limit zero", "limit", "1 to 10000", lambda f: f.L.attempts(limit=0)),
    C("attempts since NaN", "since", "finite", lambda f: f.L.attempts(since=NAN)),
    # An empty window is a mistake, refused as by every audit query (not an empty page).
    C("attempts until before since", "until", "since <= until",
      lambda f: f.L.attempts(since=T0, until=T0 - 100)),
    C("attempts unknown filter", "routes", "'route'",
      lambda f: f.L.attempts(routes="a"), ArgumentMismatch),
    C("events kinds a string", "kinds", "list", lambda f: f.L.events("r1", kinds="stop")),
    C("health keys a string", "keys", "list", lambda f: f.L.health("a")),
    C("turn snapshot refs a string", "refs", "list", lambda f: f.L.turn_snapshot("r1", "a")),
    C("open clock not a clock", "clock", "now()",
      lambda f: Ledger.open(":memory:", clock="fast")),
    C("open url not a string", "url", "database URL", lambda f: Ledger.open(5)),
    # SQLite's in-memory name is no file: never a file called ":memory:" in the working folder.
    C("open in memory", "url", "SQLite *file*", lambda f: Ledger.open(":memory:")),
    C("open in memory as a URL", "url", "SQLite *file*",
      lambda f: Ledger.open("sqlite:///:memory:")),
    C("open unknown keyword", "migrate", "'migrate_schema'",
      lambda f: Ledger.open(":memory:", migrate=False), ArgumentMismatch),
    # -- execute / aexecute -------------------------------------------------------------------
    C("execute reserve a word", "reserve", "decimal amount",
      lambda f: _execute(f, reserve="lots")),
    C("execute reserve NaN", "reserve", "finite", lambda f: _execute(f, reserve=NAN)),
    C("execute envelope a string", "envelope", "Envelope", lambda f: _execute(f, envelope="hi")),
    C("execute envelope mapping typo", "envelope.part", "parts",
      lambda f: _execute(f, envelope={"part": []})),
    C("execute envelope with no parts", "envelope.parts", "add at least one user part",
      lambda f: _execute(f, envelope={"parts": []})),
    # Built without validation (which refuses it): refused before the turn begins anything.
    C("execute envelope with no parts, constructed", "envelope.parts",
      "add at least one user part",
      lambda f: _execute(f, envelope=Envelope.model_construct(parts=[]))),
    C("execute envelope with no parts, copied", "envelope.parts", "add at least one user part",
      lambda f: _execute(f, envelope=ENV.model_copy(update={"parts": []}))),
    C("execute lease forged", "lease", "acquire_lease",
      lambda f: _execute(f, lease=f.forged(expires_at="soon"))),
    C("execute send not callable", "send", "function", lambda f: _execute(f, send="http")),
    C("execute pin unknown", "pin", "one of", lambda f: _execute(f, pin="sticky")),
    C("execute rng a seed", "rng", "random.Random", lambda f: _execute(f, rng=7)),
    C("execute wrong ledger kind", "ledger", "execute",
      lambda f: _execute(f, ledger=f.sync if f.is_async else AsyncLedger(f.sync))),
    C("execute unknown keyword", "turn", "'turn_id'",
      lambda f: _execute(f, turn="t1"), ArgumentMismatch),
    # -- Run sessions -------------------------------------------------------------------------
    C("session run id too long", "run_id", "shorter",
      lambda f: f.L.run(ID_TOO_LONG, plan=routes(), budget=BUDGET)),
    C("session run id two dots", "run_id", DOT_FIX,
      lambda f: f.L.run("..", plan=routes(), budget=BUDGET)),
    C("session lease ttl NaN", "lease_ttl_s", "finite",
      lambda f: f.L.run("new", plan=routes(), budget=BUDGET, lease_ttl_s=NAN)),
    C("session lease ttl below margin", "lease_ttl_s", "longer lease_ttl_s",
      lambda f: f.L.run("new", plan=routes(), budget=BUDGET, lease_ttl_s=0.2)),
    C("session adapter of the other kind", "adapter", "adapter",
      lambda f: f.L.run("new", plan=routes(), budget=BUDGET, adapter=object())),
    C("session secrets not a provider", "secrets", "SecretProvider",
      lambda f: f.L.run("new", plan=routes(), budget=BUDGET, secrets={"k": "v"})),
    C("session unknown keyword", "plann", "'plan'",
      lambda f: f.L.run("new", plann=routes(), budget=BUDGET), ArgumentMismatch),
    C("session negative budget on entering", "budget.max_cost", ">= 0",
      lambda f: _enter(f.L.run("new", plan=routes(), budget={
          "max_calls": 1, "max_retries": 0, "max_cost": -1}))),
    C("session plan a string on entering", "plan", "list",
      lambda f: _enter(f.L.run("new", plan="a", budget=BUDGET))),
    C("session turn envelope a string", "envelope", "Envelope",
      lambda f: f.session.turn("hello", send=f.send)),
    C("session turn envelope with no parts", "envelope.parts", "add at least one user part",
      lambda f: f.session.turn({"parts": []})),
    C("session turn envelope with no parts, own send", "envelope.parts",
      "add at least one user part", lambda f: f.session.turn({"parts": []}, send=f.send)),
    C("session turn envelope with no parts, constructed", "envelope.parts",
      "add at least one user part",
      lambda f: f.session.turn(Envelope.model_construct(parts=[]), send=f.send)),
    C("session turn envelope with no parts, copied, own adapter", "envelope.parts",
      "add at least one user part",
      lambda f: f.session.turn(ENV.model_copy(update={"parts": []}))),
    C("session turn on_text not callable", "on_text", "function",
      lambda f: f.session.turn(ENV, on_text="print")),
    C("session turn reserve NaN", "reserve", "finite",
      lambda f: f.session.turn(ENV, send=f.send, reserve=NAN)),
    C("session turn unknown option", "reservee", "'reserve'",
      lambda f: f.session.turn(ENV, send=f.send, reservee=1), ArgumentMismatch),
    C("session turn part_hashes", "part_hashes", "do not pass it",
      lambda f: f.session.turn(ENV, send=f.send, part_hashes=[HASH])),
    C("execute part_hashes a list of hashes", "part_hashes", "ledger.PartHashes",
      lambda f: _execute(f, part_hashes=[HASH])),
    C("session tool result unknown call", "call_id", "tool_call_id",
      lambda f: f.session.tool_result("call-9", "42")),
    C("session tool result call id not text", "call_id", "non-empty string",
      lambda f: f.session.tool_result(None, "42")),
    C("session tool started unknown call", "call_id", "tool_call_id",
      lambda f: f.session.tool_started("call-9")),
    C("session child id bad", "child_id", "printable",
      lambda f: f.session.child("c\x00", budget=BUDGET)),
    C("session child id a dot", "child_id", DOT_FIX,
      lambda f: f.session.child(".", budget=BUDGET)),
    C("session child plan a string", "plan", "list",
      lambda f: f.session.child("c1", budget=BUDGET, plan="a")),
    C("session child role empty", "role", "non-empty",
      lambda f: f.session.child("c1", budget=BUDGET, role="")),
    C("session child unknown admission keyword", "tenants", "'tenant'",
      lambda f: f.session.child("c1", budget=BUDGET, tenants="t"), ArgumentMismatch),
    C("session child parent given", "parent", "do not pass parent",
      lambda f: f.session.child("c1", budget=BUDGET, parent=f.lease)),
    C("session child too many labels", "labels", "at most 64",
      lambda f: f.session.child("c1", budget=BUDGET,
                                labels={f"k{i}": "v" for i in range(65)})),
    C("session child negative budget on entering", "budget.max_cost", ">= 0",
      lambda f: _enter(f.session.child("c1", budget={"max_calls": 1, "max_retries": 0,
                                                     "max_cost": "-0.5"}))),
    # -- audit, recovery, adapters ------------------------------------------------------------
    # The bounds of `failover-ledger rollup --lag` and `--fold-after`, the library's too.
    C("roll up lag past a week", "lag", "(7 days)", lambda f: f.L.roll_up(lag=7 * 86400 + 1)),
    C("roll up fold_after past 366 days", "fold_after", "(366 days)",
      lambda f: f.L.roll_up(fold_after=366 * 86400 + 1)),
    C("audit runs bad status", "status", "one of", lambda f: f.audit.runs(status="done")),
    C("audit runs until before since", "until", "since <= until",
      lambda f: f.audit.runs(since=T0, until=T0 - 1)),
    C("audit costs by unknown key", "by", "one of", lambda f: f.audit.costs(by="colour")),
    C("audit activity zero buckets", "buckets", "1 to", lambda f: f.audit.activity(
        since=T0 - 60, until=T0, buckets=0)),
    C("audit open attempts a string", "states", "list",
      lambda f: f.audit.open_attempts(states="unknown")),
    C("audit days a float", "days", "1 to 366", lambda f: f.audit.costs_by_day(days=1.5)),
    C("audit unknown keyword", "statuss", "'status'",
      lambda f: f.audit.runs(statuss="failed"), ArgumentMismatch),
    C("recover ttl NaN", "lease_ttl_s", "finite", lambda f: f.recover(f.L, lease_ttl_s=NAN)),
    C("recover limit zero", "limit", "at least 1", lambda f: f.recover(f.L, limit=0)),
    C("recover run ids a string", "run_ids", "list of ids",
      lambda f: f.recover(f.L, run_ids="r1")),
    C("recover batch zero", "batch", "pass e.g.", lambda f: f.recover(f.L, batch=0)),
    C("recover release an int", "release", "True or False",
      lambda f: f.recover(f.L, release=1)),
    C("recover unknown keyword", "lease_ttl", "'lease_ttl_s'",
      lambda f: f.recover(f.L, lease_ttl=5), ArgumentMismatch),
    C("adapter body limit zero", "max_body_bytes", "at least 1",
      lambda f: f.adapter_cls(max_body_bytes=0)),
    C("adapter verify a path", "verify", "SSLContext",
      lambda f: f.adapter_cls(verify="/etc/ca.pem")),
    C("adapter unknown keyword", "timeout", "arguments are",
      lambda f: f.adapter_cls(timeout=5), ArgumentMismatch),
    C("sender of the wrong adapter", "adapter", "adapter", lambda f: f.sender(object())),
    C("lease keeper ttl NaN", "ttl_s", "finite",
      lambda f: f.keeper_cls(f.L, f.lease, ttl_s=NAN)),
    C("lease keeper ttl below margin", "ttl_s", "longer ttl_s",
      lambda f: f.keeper_cls(f.L, f.lease, ttl_s=0.2)),
    C("lease keeper interval too long", "interval_s", "smaller interval_s",
      lambda f: f.keeper_cls(f.L, f.lease, ttl_s=30, interval_s=20)),
    C("lease keeper not a lease", "lease", "acquire_lease",
      lambda f: f.keeper_cls(f.L, "r1", ttl_s=30)),
    C("lease keeper of the other ledger kind", "ledger", "Ledger",
      lambda f: f.keeper_cls(f.sync if f.is_async else AsyncLedger(f.sync), f.lease,
                             ttl_s=30)),
    C("manual clock NaN", "start", "finite", lambda f: ManualClock(NAN)),
    C("manual clock advance a string", "seconds", "number of seconds",
      lambda f: ManualClock(T0).advance("1m")),
    C("classify not an observation", "obs", "Observation",
      lambda f: classify({"status": 500}, preset("goclaw"))),
    C("classify a preset name for the policy", "policy", "preset('goclaw')",
      lambda f: classify(Observation(status=503), "goclaw")),
    C("classify unknown keyword", "nwo", "'now'",
      lambda f: classify(Observation(status=503), preset("goclaw"), nwo=1), ArgumentMismatch),
    C("classify now a string", "now", "finite epoch seconds",
      lambda f: classify(DATED_429, preset("goclaw"), now="x")),
    C("classify now NaN", "now", "finite", lambda f: classify(DATED_429, preset("goclaw"),
                                                                now=NAN)),
    C("policy hash of a name", "policy", "preset('goclaw')", lambda f: policy_hash("goclaw")),
    C("policy hash of nothing", "policy", "ledger.Policy", lambda f: policy_hash(None)),
    C("load policy unknown keyword", "path", "path_or_preset",
      lambda f: load_policy(path="goclaw"), ArgumentMismatch),
    C("preset name a list", "name", "goclaw", lambda f: preset(["x"])),
    C("reconcile not a ledger", "ledger", "Ledger", lambda f: reconcile(f.L if f.is_async
                                                                         else "led")),
]


def _dump(led: Ledger) -> dict[str, list[str]]:
    """Every row of every table (as text, sorted): what a refused call must leave alone."""
    with sql_context(led).engine.connect() as conn:
        return {t.name: sorted(repr(tuple(r)) for r in conn.execute(select(t)))
                for t in schema.metadata.sorted_tables}


_RUNNERS: dict[int, asyncio.Runner] = {}  # the async face's event loop, by face


async def _await(aw: Any) -> Any:
    return await aw


def _raise(face: Face, case: Case) -> Exception | None:
    try:
        out = case.call(face)
        if inspect.isawaitable(out):
            _RUNNERS[id(face)].run(_await(out))
    except Exception as e:  # the error is what is being checked
        return e
    return None


def _check(face: Face, case: Case, before: dict[str, list[str]]) -> str | None:
    err = _raise(face, case)
    where = f"{case.name} ({'async' if face.is_async else 'sync'})"
    if err is None:
        return f"{where}: accepted (no error was raised)"
    if type(err) is not case.error:
        return f"{where}: {type(err).__name__}: {err} (expected {case.error.__name__})"
    assert isinstance(err, LedgerError)
    text = str(err)
    if isinstance(err, InvalidArgument):
        if err.field != case.field:
            return f"{where}: field {err.field!r}, expected {case.field!r} ({err})"
        # The message names the field (its last name, as the caller wrote it).
        leaf = case.field.split(".")[-1].split("[")[0]
        if leaf not in text:
            return f"{where}: the message does not name {leaf!r}: {text}"
    elif case.field not in err.fields:
        return f"{where}: no {case.field!r} among the error's fields {err.fields}"
    if case.fix not in text:
        return f"{where}: the message does not say {case.fix!r}: {text}"
    after = _dump(face.sync)
    if after != before:
        changed = [t for t in before if before[t] != after.get(t)]
        before.clear()
        before.update(after)  # so the next case is judged on its own
        return f"{where}: the refused call wrote to {changed}"
    return None


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=ManualClock(T0)) as led:
        yield led


def _prepare(led: Ledger) -> tuple[Lease, str]:
    led.admit_run("r1", plan=routes(), budget=BUDGET, grant=GRANT)
    lease = led.acquire_lease("r1")
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
    return lease, att.attempt_id


def test_every_misuse_is_the_same_typed_error_naming_the_field_and_writes_nothing(
        ledger: Ledger) -> None:
    lease, attempt_id = _prepare(ledger)
    failures: list[str] = []
    with ledger.run("s1", plan=routes(), budget=BUDGET, grant=GRANT) as session:
        face = Face(ledger, ledger, lease, attempt_id, session, is_async=False)
        before = _dump(ledger)
        for case in CASES:
            problem = _check(face, case, before)
            if problem:
                failures.append(problem)
    assert not failures, "\n".join(failures)


def test_a_credential_in_an_endpoint_is_refused_without_being_repeated_or_stored(
        ledger: Ledger) -> None:
    # The frozen plan is stored as given and read by every auditor (docs/auditor-role.md).
    secret = "hunter2-pw-0123"
    for endpoint in (f"https://egress:{secret}@gw.example.com/v1",
                     f"https://gw.example.com/v1?api-version=1&api_key={secret}",
                     # Not URLs Python splits (an unclosed IPv6 bracket): they were admitted,
                     # the secret stored with the plan, for the adapter to refuse at the turn.
                     f"http://egress:{secret}@[::1/v1",
                     f"http://[::1/v1?api_key={secret}"):
        route = routes()[0].model_copy(update={"endpoint": endpoint})
        with pytest.raises(InvalidArgument) as e:
            ledger.admit_run("leaky", plan=[route], budget=BUDGET, grant=GRANT)
        assert secret not in str(e.value) and e.value.field == "plan[0].endpoint"
        assert secret not in repr(_dump(ledger))
    # A query without a credential is no credential (Azure OpenAI's api-version).
    plain = routes()[0].model_copy(update={
        "endpoint": "https://acct.openai.azure.com/openai/deployments/d?api-version=2024-10-21"})
    ledger.admit_run("plain", plan=[plain], budget=BUDGET, grant=GRANT)


def test_a_run_and_attempt_an_earlier_version_admitted_as_dot_ids_stay_readable_and_closable(
        ledger: Ledger) -> None:
    # Only a new Run's or Attempt's id is refused as "." or "..": the rows an earlier version
    # wrote under them are still read, settled and closed through the API.
    as_an_earlier_version(ledger, "admit_run", ".", plan=routes(), budget=BUDGET, grant=GRANT)
    lease = ledger.acquire_lease(".")
    as_an_earlier_version(ledger, "begin_attempt", lease, route="a", envelope_hash=HASH,
                          reserve=Decimal("0.01"), attempt_id="..")
    assert ledger.get_run(".").run_id == "."
    assert [a.attempt_id for a in ledger.timeline(".")] == [".."]
    settled = ledger.settle_attempt(lease, "..", outcome="succeeded")
    assert (settled.run_id, settled.state.value) == (".", "succeeded")
    ledger.release_lease(lease)
    assert ledger.close_run(".", status="failed", by="ops").status.value == "failed"
    with pytest.raises(InvalidArgument) as e:
        ledger.admit_run(".", plan=routes(), budget=BUDGET, grant=GRANT)
    assert e.value.field == "run_id"


def test_every_misuse_is_the_same_on_the_async_face(ledger: Ledger) -> None:
    lease, attempt_id = _prepare(ledger)
    failures: list[str] = []
    with asyncio.Runner() as runner:
        aled = AsyncLedger(ledger)
        session = aled.run("s1", plan=routes(), budget=BUDGET, grant=GRANT)
        runner.run(session.__aenter__())
        face = Face(aled, ledger, lease, attempt_id, session, is_async=True)
        _RUNNERS[id(face)] = runner
        try:
            before = _dump(ledger)
            for case in CASES:
                problem = _check(face, case, before)
                if problem:
                    failures.append(problem)
        finally:
            _RUNNERS.pop(id(face))
            runner.run(session.__aexit__(None, None, None))
    assert not failures, "\n".join(failures)


def test_an_ended_session_refuses_every_call_as_invalid_state(ledger: Ledger) -> None:
    with ledger.run("s1", plan=routes(), budget=BUDGET, grant=GRANT) as session:
        pass
    before = _dump(ledger)
    for call in (lambda: session.turn(ENV, send=never_sent),
                 lambda: session.tool_result("call-1", "x"),
                 lambda: session.tool_started("call-1"),
                 lambda: session.child("c1", budget=BUDGET),
                 lambda: session.lease):
        with pytest.raises(InvalidState, match="ended"):
            call()
    assert _dump(ledger) == before


def test_a_call_that_fits_no_signature_is_also_a_type_error() -> None:
    # Code written against Python's own error for a bad call keeps working; a bad value is a
    # ValueError, as pydantic's error (which InvalidArgument replaces) was.
    with pytest.raises(TypeError) as ei:
        Ledger.open(":memory:", colck=None)
    assert isinstance(ei.value, ArgumentMismatch) and ei.value.field == "colck"
    with pytest.raises(ValueError) as ev:
        Budget.model_validate({"max_calls": 1})
    assert isinstance(ev.value, InvalidArgument) and not isinstance(ev.value, TypeError)


def _validated(fn: Any) -> bool:
    return bool(getattr(fn, "__ledger_checked__", False))


def test_every_public_entry_point_validates_with_the_one_mechanism() -> None:
    # Every public method that takes arguments, and every public function, has its arguments
    # validated by ledger.domain.validation.checked (pydantic.validate_call and the one error
    # mapper), directly or through op/query: none checks them by hand, and a new one cannot
    # skip validation unnoticed.
    from ledger.api.calls import op, query
    from ledger.api.face import storage_of
    from ledger.api.session import AsyncRunSession, RunSession

    exempt = {
        # Made by Ledger.run / AsyncLedger.run, which validated the same arguments.
        "RunSession.__init__", "AsyncRunSession.__init__",
        # A predicate: False for anything that is no proposed call id.
        "RunSession.proposed", "AsyncRunSession.proposed",
    }
    unchecked = []
    for cls in (Ledger, AsyncLedger, RunSession, AsyncRunSession, Audit, AsyncAudit,
                LeaseKeeper, AsyncLeaseKeeper, HttpAdapter, SyncAdapter):
        for name in dir(cls):
            if name.startswith("_") and name != "__init__":
                continue
            raw = inspect.getattr_static(cls, name)
            raw = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
            fn = (raw._builder if isinstance(raw, op) else raw._fn if isinstance(raw, query)
                  else raw if inspect.isfunction(raw) else None)
            if fn is None or f"{cls.__name__}.{name}" in exempt:
                continue
            takes = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
            if takes and not _validated(fn):
                unchecked.append(f"{cls.__name__}.{name}")
    unchecked += [fn.__name__ for fn in (execute, aexecute, recover, arecover, reconcile,
                                         storage_of, sync_sender, async_sender, classify,
                                         load_policy, policy_hash, preset)
                  if not _validated(fn)]
    assert not unchecked, unchecked


# Threads that make their first call of a checked method at the same moment, in a process that
# has made none: the validator is built on the first call, and a build shared by threads raised
# NameError for an annotation's name in all but one of them.
_FIRST_CALLS = """
import sys, threading
from decimal import Decimal
from ledger import Budget, Grant, Ledger, Price, Route

N = 8
plan = [Route(id="primary", provider="fake", model="m", group="ga", recipient="fake",
              endpoint="http://127.0.0.1:9/v1", price=Price())]
budget = Budget(max_calls=3, max_retries=1, max_cost=Decimal("1"))
grant = Grant(recipients={"fake": ["user_input"]})
failures = []
with Ledger.open("sqlite:///" + sys.argv[1]) as led:
    barrier = threading.Barrier(N)

    def first_calls(i):
        barrier.wait()
        try:
            led.admit_run(f"r{i}", plan=plan, budget=budget, grant=grant)
            led.get_run(f"r{i}")
            led.timeline(f"r{i}")
            led.turn_snapshot(f"r{i}")
            led.health()
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=first_calls, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(sorted(set(failures)) or "ok")
"""


def test_first_calls_of_a_checked_method_from_many_threads_all_validate(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-c", _FIRST_CALLS, str(tmp_path / "first.db")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok", res.stdout


def _store_threads() -> list[str]:
    """The threads a store starts for its connections: SQLite's writer, PostgreSQL's pools."""
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith(("ledger-sqlite", "ledger-postgres")))


def test_a_closed_ledger_refuses_every_call_on_both_faces_and_reopens_nothing(
        db_url: str) -> None:
    def refused(call: Callable[[], Any]) -> None:
        with pytest.raises(InvalidState, match="is closed; open a new one") as e:
            call()
        assert e.value.fields["problem"] == "ledger_closed"

    before = _store_threads()
    led = Ledger.open(db_url, clock=ManualClock(T0))
    lease, _ = _prepare(led)
    led.close()
    refused(lambda: led.get_run("r1"))  # the cold path
    refused(lambda: led.acquire_lease("r1"))  # the hot path
    refused(lambda: led.timeline("r1"))
    refused(lambda: led.renew_lease(lease))
    led.close()  # again: nothing to do

    async def asyncio_side() -> None:
        aled = await AsyncLedger.open(db_url, clock=ManualClock(T0))
        await aled.get_run("r1")
        await aled.close()
        for call in (lambda: aled.get_run("r1"), lambda: aled.acquire_lease("r1"),
                     lambda: aled.timeline("r1"), lambda: aled.renew_lease(lease)):
            with pytest.raises(InvalidState, match="is closed; open a new one") as e:
                await call()
            assert e.value.fields["problem"] == "ledger_closed"
        await aled.close()

    asyncio.run(asyncio_side())
    assert _store_threads() == before
