"""Replay over a ledger upgraded through migration 0020, on SQLite and PostgreSQL.

Before 0020 a provider's health key kept its name as each route spelled it, and a decision's
recorded inputs (format 1) kept it so: routes of ``OpenAI`` and of ``openai`` read two keys.
The package now reads one folded key (``provider:openai``). Replaying such a ledger under the
policies its Runs were recorded under must report no disagreement: a decision over one
spelling is read under the folded key and decided as recorded; a decision that read two
spellings apart is taken as recorded; and a route or profile whose id is spelled like a
provider's key (``provider:Foo``, under ``health.key: route`` or ``profile``) keeps its key,
which 0020 never folded.

The pre-0020 ledger is the one the older package wrote: the Runs are recorded by this package,
the plan's second spelling of the provider standing in under a name of its own (the older
package kept each spelling apart, as this one keeps two providers), and the rows are then put
as the older package left them: each recorded decision in format 1 with a provider's key as
its route spelled it, the schema taken back to 0019, a provider's health row under its
spelling, the stand-in named as the plan spells it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Connection, String, Text, create_engine, inspect, text

from ledger import Ledger, Policy, Price, Route
from ledger.clock import ManualClock
from ledger.domain.values import Profile
from ledger.ops.audit import Audit
from ledger.ops.replay import ReplayReport
from ledger.policy.load import preset
from ledger.storage import schema
from ledger.storage.engine import normalize_url
from tests.storage.helpers import downgrade_schema

from .replay_history import GAP, START, Recorder, fail

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
# The second spelling of OpenAI, recorded under a name of its own (see the module docstring).
STAND_IN = "openai-spelt-apart"


def _route(rid: str, provider: str, **kw: Any) -> Route:
    return Route(id=rid, provider=provider, model=f"m-{rid}", group=f"g-{rid}",
                 recipient="r", price=PRICE, **kw)


def _failure_domain_at_once() -> Policy:
    """failure-domain cooling a route at its first failure and starting each turn at the
    plan's first entry: a new turn then skips the route a failure cooled, by its key."""
    doc = preset("failure-domain").model_dump(mode="json")
    doc["name"] = "failure-domain-at-once"
    doc["health"]["cooldown_after"] = 1
    doc["failover"]["new_turn"] = "first_entry"
    return Policy.model_validate(doc)


# health.key: provider. One provider spelled two ways beside an ordinary one; and an ordinary
# one spelled with capitals (its key was provider:Gemini before 0020, provider:gemini since).
SPLIT = [_route("a", "OpenAI"), _route("b", STAND_IN), _route("g", "Gemini")]
ORDINARY = [_route("g", "Gemini"), _route("d", "deepseek")]
# health.key: route and profile: an id spelled like a provider's key is a route's, a profile's.
# The route-keyed plan spells its provider two ways too, which nothing folded under a route key.
ROUTE_KEYED = [_route("provider:Foo", "Foo"), _route("x", "foo")]
PROFILE_KEYED = [_route("p", "Bar", profiles=[Profile(id="provider:Bar"),
                                              Profile(id="bar:key")]),
                 _route("y", "yi")]
PLANS = {"split": SPLIT, "ordinary": ORDINARY, "route-keyed": ROUTE_KEYED,
         "profile-keyed": PROFILE_KEYED}
POLICIES: dict[str, Policy | str] = {
    "split": "goclaw", "ordinary": "goclaw", "route-keyed": _failure_domain_at_once(),
    "profile-keyed": "fased"}
UNAVAILABLE, THROTTLED = fail(status=503), fail(status=429)
TURNS = {"split": [{"a": UNAVAILABLE}, {}, {"a": UNAVAILABLE, "b": UNAVAILABLE}, {}],
         "ordinary": [{"g": UNAVAILABLE}, {}, {}],
         "route-keyed": [{"provider:Foo": UNAVAILABLE}, {}, {}],
         "profile-keyed": [{"p": THROTTLED}, {}, {}]}
# Health keys of the provider spelled two ways; the ids spelled like a provider's key.
SPELT_TWO_WAYS = {"provider:OpenAI", "provider:openai"}
IDS = {"route-keyed": "provider:Foo", "profile-keyed": "provider:Bar"}
SINCE, UNTIL = START - 1, START + 20 * GAP


def _record(url: str) -> dict[str, list[str]]:
    """The scenario Runs, twice each, recorded on the ledger at ``url``; their ids by tenant."""
    clock = ManualClock(START)
    with Ledger.open(url, clock=clock) as led:
        rec = Recorder(led, clock)
        for _ in range(2):
            for tenant, plan in PLANS.items():
                rec.run(tenant, plan, POLICIES[tenant], TURNS[tenant])
    return rec.runs


def _each_text_column(conn: Connection) -> Iterator[tuple[str, str]]:
    tables = set(inspect(conn).get_table_names())
    for table in schema.metadata.tables.values():
        if table.name in tables:
            for column in table.columns:
                if isinstance(column.type, String | Text):
                    yield table.name, column.name


def _as_before_0020(url: str, runs: dict[str, list[str]]) -> None:
    """Put the rows of the ledger at ``url`` as the package before migration 0020 left them."""
    tenant_of = {run_id: tenant for tenant, ids in runs.items() for run_id in ids}
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            for event_id, run_id, data in conn.execute(text(
                    "SELECT event_id, run_id, data FROM events "
                    "WHERE kind IN ('select', 'stop')")).all():
                doc = json.loads(data)
                if "inputs" not in doc:
                    continue
                inputs = doc["inputs"]
                inputs["v"] = 1
                tenant = tenant_of[run_id]
                if POLICIES[tenant] == "goclaw":  # health keyed by provider, as spelled
                    spelled = {"provider:" + r.provider.casefold(): "provider:" + r.provider
                               for r in PLANS[tenant]}
                    inputs["health"] = {spelled.get(k, k): row
                                        for k, row in inputs.get("health", {}).items()}
                conn.execute(text("UPDATE events SET data = :data WHERE event_id = :id"),
                             {"data": json.dumps(doc), "id": event_id})
        downgrade_schema(url, "0019", "health")
        with engine.begin() as conn:
            # The downgrade copied each provider's row back to its spelling and kept the
            # folded one: the older package had only the spelling's.
            conn.execute(text("DELETE FROM health WHERE kind = 'provider' "
                              "AND key <> 'provider:' || provider"))
            for table, column in _each_text_column(conn):
                conn.execute(text(f"UPDATE {table} SET {column} = "
                                  f"REPLACE({column}, :stand_in, 'openai') "
                                  f"WHERE {column} LIKE :like"),
                             {"stand_in": STAND_IN, "like": f"%{STAND_IN}%"})
            keys = set(conn.execute(text("SELECT key FROM health")).scalars())
        assert SPELT_TWO_WAYS | {"provider:Gemini"} <= keys  # each spelling its row
    finally:
        engine.dispose()


@pytest.fixture(scope="module", params=[
    "sqlite-upgraded", "sqlite-head",
    pytest.param("postgres-upgraded", marks=pytest.mark.postgres),
    pytest.param("postgres-head", marks=pytest.mark.postgres)])
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[str, bool]]:
    """(url, upgraded): the scenario Runs recorded before 0020 and the ledger upgraded to
    head, or recorded at head; once per backend."""
    backend, era = request.param.split("-")
    if backend == "sqlite":
        url = str(tmp_path_factory.mktemp("upgraded") / "ledger.db")
    else:
        srv = request.getfixturevalue("pg_server")
        name = f"upgraded_{era}_{os.getpid()}"
        url = srv.create_database(name, template="ledger_template")
    runs = _record(url)
    if era == "upgraded":
        _as_before_0020(url, runs)
        with Ledger.open(url, clock=ManualClock(UNTIL)):  # opening upgrades to head
            pass
    yield url, era == "upgraded"


def _report(url: str, policy: Policy | str, **kw: Any) -> ReplayReport:
    with Ledger.open(url, clock=ManualClock(UNTIL), migrate_schema=False) as led:
        return Audit(led).replay(policy, since=SINCE, until=UNTIL, **kw)


def _held_keys(url: str, tenant: str) -> list[set[str]]:
    """The health keys each recorded decision of ``tenant``'s Runs holds."""
    with Ledger.open(url, clock=ManualClock(UNTIL), migrate_schema=False) as led:
        return [set(e.data["inputs"].get("health", {}))
                for run_id in (f"{tenant}-0", f"{tenant}-1")
                for e in led.events(run_id, ["select", "stop"]) if "inputs" in e.data]


def test_every_decision_of_an_upgraded_ledger_is_decided_as_recorded_under_its_policy(
        recorded: tuple[str, bool]) -> None:
    url, upgraded = recorded
    rep = _report(url, "goclaw")  # each decision is recomputed under its own Run's policy
    held = {tenant: _held_keys(url, tenant) for tenant in PLANS}
    # Decisions that read the provider's two spellings apart are taken as recorded, and only
    # they: the first of the Runs' turns held no health, and is decided again; so are the
    # route-keyed Runs', whose plan spells its provider two ways under a route key.
    apart = sum(1 for keys in held["split"] if keys & SPELT_TWO_WAYS) if upgraded else 0
    assert rep.coverage.decisions_without_inputs == apart
    assert rep.check.decisions == sum(map(len, held.values())) - apart
    if upgraded:
        assert 0 < apart < len(held["split"])
    assert rep.check.disagree == [] and rep.check.agree == rep.check.decisions
    assert rep.coverage.malformed == 0
    # Gemini's health, read under the folded key, and the route's and the profile's own keys
    # spelled like a provider's were held by decisions that were decided again.
    gemini = "provider:Gemini" if upgraded else "provider:gemini"
    assert any(gemini in keys for keys in held["ordinary"])
    for tenant, key in IDS.items():
        assert any(key in keys for keys in held[tenant]), tenant


@pytest.mark.parametrize("tenant", list(PLANS))
def test_replay_of_an_upgraded_ledger_under_the_recorded_policy_changes_nothing(
        recorded: tuple[str, bool], tenant: str) -> None:
    rep = _report(recorded[0], POLICIES[tenant], tenant=tenant)
    assert rep.runs == 2 and rep.decisions > 0
    assert rep.differing == 0 and rep.findings == []
    assert rep.replayed == rep.baseline
