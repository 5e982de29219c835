"""Credentials are checked when the Run starts (issue 22, item 5).

Entering a Run session (and ``admit_run`` where the routes name their key source) resolves every
route's key before anything is recorded: a missing one is ``InvalidArgument`` naming the route
and the variable, and not one row is written. ``keyless_ok`` marks a route allowed to lack its
key. A key that disappears mid-run is still a ``not_sent`` skip (the backup serves), and
``failovers`` and ``health`` (the audit API and the command line) name the route and the
variable. Real HTTP over loopback (the shipped fake provider), on both backends.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from ledger import (
    AsyncLedger,
    Budget,
    Envelope,
    Grant,
    InvalidArgument,
    Ledger,
    NotFound,
    Part,
    Profile,
    Route,
    RunStatus,
)
from ledger.adapters import StaticSecretProvider
from ledger.cli.main import main
from ledger.domain.records import AttemptState, DebitState
from ledger.ops.audit import Audit
from ledger.storage import schema as s
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import plan
from tests.storage.helpers import sql_context

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
VAR = "LEDGER_TEST_PRIMARY_KEY"
KEY = "sk-test-primary-0123456789abcdef"
HELLO = Envelope(parts=[Part(content="hello")])
TABLES = ("runs", "attempts", "debits", "events", "group_slots", "health", "provenance",
          "capacity_groups")


def rows(led: Ledger) -> dict[str, int]:
    """Every table's row count: what 'nothing was recorded' is checked against."""
    with sql_context(led).engine.connect() as conn:
        return {t: conn.execute(select(func.count()).select_from(getattr(s, t))).scalar_one()
                for t in TABLES}


def keyed(fake: FakeProvider) -> list[Route]:
    """The primary names its key's variable; the backup is a keyless local endpoint."""
    primary, backup = plan(fake)
    return [primary.model_copy(update={"api_key_env": VAR}), backup]


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (VAR, "OPENAI_API_KEY", "LEDGER_SECRET_P_WORK"):
        monkeypatch.delenv(var, raising=False)


def _enter(db_url: str, routes: list[Route], kind: str, **kw: Any) -> None:
    """Enter (and leave) a Run session of the given kind, sending nothing."""
    if kind == "sync":
        with Ledger.open(db_url) as led, led.run("r", plan=routes, budget=BUDGET, grant=GRANT,
                                                 **kw):
            pass
        return

    async def main_() -> None:
        async with AsyncLedger.open(db_url) as led, led.run("r", plan=routes, budget=BUDGET,
                                                            grant=GRANT, **kw):
            pass

    asyncio.run(main_())


# -- at session entry -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_missing_route_key_refuses_the_session_before_anything_is_recorded(
        db_url: str, fake: FakeProvider, kind: str) -> None:
    with Ledger.open(db_url) as led:
        before = rows(led)
    with pytest.raises(InvalidArgument) as ei:
        _enter(db_url, keyed(fake), kind)
    err = ei.value
    assert err.field == "plan[0].api_key_env"
    assert "route 'primary'" in str(err) and VAR in str(err)
    assert "keyless_ok={'primary'}" in str(err)  # the other fix, named
    assert err.fields["routes"] == ["primary"] and err.fields["variables"] == [VAR]
    assert err.errors[0][0] == "plan[0].api_key_env"
    with Ledger.open(db_url) as led:
        assert rows(led) == before  # no run row, no lease, no event
        with pytest.raises(NotFound):
            led.get_run("r")
    assert fake.requests == []


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_profile_the_sessions_secret_provider_cannot_resolve_refuses_the_session(
        db_url: str, fake: FakeProvider, kind: str) -> None:
    primary, backup = plan(fake)
    routes = [primary.model_copy(update={"profiles": [Profile(id="p:work")]}), backup]
    with Ledger.open(db_url) as led:
        before = rows(led)
    # The default provider is the environment: the variables it would read are named.
    with pytest.raises(InvalidArgument) as ei:
        _enter(db_url, routes, kind)
    assert ei.value.field == "plan[0].profiles[0]"
    assert "'p:work'" in str(ei.value) and "LEDGER_SECRET_P_WORK" in str(ei.value)
    assert ei.value.fields["variables"] == ["LEDGER_SECRET_P_WORK", "OPENAI_API_KEY"]
    # A provider of the host's own: the profile is looked up there.
    with pytest.raises(InvalidArgument) as ei:
        _enter(db_url, routes, kind, secrets=StaticSecretProvider({"other": "x"}))
    assert "add it to the StaticSecretProvider" in str(ei.value)
    with Ledger.open(db_url) as led:
        assert rows(led) == before
    # With the secret there, the session opens.
    _enter(db_url, routes, kind, secrets=StaticSecretProvider({"p:work": "sk-work-123"}))
    with Ledger.open(db_url) as led:
        assert led.get_run("r").status is RunStatus.CANCELLED  # entered, nothing asked


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_route_marked_keyless_ok_is_admitted_and_skipped_when_a_turn_reaches_it(
        db_url: str, fake: FakeProvider, kind: str) -> None:
    async def turn_async() -> Any:
        async with AsyncLedger.open(db_url) as led, led.run(
                "r", plan=keyed(fake), budget=BUDGET, grant=GRANT,
                keyless_ok={"primary"}) as run:
            return await run.turn(HELLO)

    if kind == "sync":
        with Ledger.open(db_url) as led, led.run("r", plan=keyed(fake), budget=BUDGET,
                                                 grant=GRANT, keyless_ok={"primary"}) as run:
            result = run.turn(HELLO)
    else:
        result = asyncio.run(turn_async())
    assert result.route.id == "backup"
    with Ledger.open(db_url) as led:
        first, served = led.timeline("r")
        assert (first.route_id, first.state, first.category) == (
            "primary", AttemptState.NOT_SENT, "unusable")
        assert led.debit(first.debit_id).state is DebitState.VOIDED
        assert served.state is AttemptState.SUCCEEDED
        assert led.get_run("r").status is RunStatus.SUCCEEDED
    assert len(fake.requests) == 1  # only the backup's request left the process


def test_keyless_ok_true_allows_every_route_and_a_route_without_key_source_needs_none(
        db_url: str, fake: FakeProvider) -> None:
    _enter(db_url, keyed(fake), "sync", keyless_ok=True)
    # The fake plan's routes name no key source at all (local endpoints): nothing to mark.
    with Ledger.open(db_url) as led, led.run("plain", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        assert run.turn(HELLO).route.id == "primary"


def test_keyless_ok_that_names_no_route_of_the_plan_is_refused_and_records_nothing(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        before = rows(led)
        for bad, why in ((["primry"], "'primry'"), ("primary", "set of route ids"),
                         ({"primary": 1}, "set of route ids")):
            with pytest.raises(InvalidArgument) as ei, led.run(
                    "r", plan=keyed(fake), budget=BUDGET, grant=GRANT, keyless_ok=bad):
                pytest.fail("entered")
            assert ei.value.field == "keyless_ok" and why in str(ei.value)
        assert rows(led) == before


def test_a_child_session_checks_its_routes_and_inherits_what_its_parent_may_lack(
        db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led, led.run("p", plan=keyed(fake), budget=BUDGET,
                                             grant=GRANT, keyless_ok={"primary"}) as run:
        small = Budget(max_calls=2, max_retries=1, max_cost=Decimal("0.1"))
        with run.child("c1", budget=small) as child:  # primary keyless_ok, inherited
            assert child.turn(HELLO).route.id == "backup"
        with pytest.raises(InvalidArgument) as ei, run.child("c2", budget=small,
                                                             keyless_ok=()):
            pytest.fail("entered")
        assert VAR in str(ei.value)
        with pytest.raises(NotFound):
            led.get_run("c2")


# -- admit_run: where the routes name their key source --------------------------------------


def test_admit_run_checks_the_variable_a_route_names_and_profiles_only_with_a_provider(
        db_url: str, fake: FakeProvider) -> None:
    primary, backup = plan(fake)
    with Ledger.open(db_url) as led:
        before = rows(led)
        with pytest.raises(InvalidArgument) as ei:
            led.admit_run("a1", plan=keyed(fake), budget=BUDGET, grant=GRANT)
        assert ei.value.field == "plan[0].api_key_env" and VAR in str(ei.value)
        assert rows(led) == before
        led.admit_run("a1", plan=keyed(fake), budget=BUDGET, grant=GRANT,
                      keyless_ok={"primary"})
        # Profiles are resolved by the host's sender: without its provider, not checked here.
        profiled = [primary.model_copy(update={"profiles": [Profile(id="p:work")]}), backup]
        led.admit_run("a2", plan=profiled, budget=BUDGET, grant=GRANT)
        with pytest.raises(InvalidArgument) as ei:
            led.admit_run("a3", plan=profiled, budget=BUDGET, grant=GRANT,
                          secrets=StaticSecretProvider({}))
        assert ei.value.field == "plan[0].profiles[0]"
        with pytest.raises(NotFound):
            led.get_run("a3")


# -- a key that disappears mid-run ----------------------------------------------------------


def test_a_key_removed_mid_run_is_not_sent_the_backup_serves_and_failovers_and_health_say_so(
        db_url: str, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(VAR, KEY)
    with Ledger.open(db_url) as led, led.run("r", plan=keyed(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        assert run.turn(HELLO).route.id == "primary"
        monkeypatch.delenv(VAR)  # rotated away under a running Run
        second = run.turn(Envelope(parts=[Part(content="and then?")]))
        assert second.route.id == "backup"
        [_, skipped, served] = led.timeline("r")
        assert (skipped.route_id, skipped.state, skipped.category) == (
            "primary", AttemptState.NOT_SENT, "unusable")
        assert led.debit(skipped.debit_id).state is DebitState.VOIDED
        assert served.route_id == "backup" and served.state is AttemptState.SUCCEEDED

        audit = Audit(led)
        [fo] = audit.failovers().items
        assert fo.run_id == "r" and fo.served_route == "backup"
        [cause] = [c for c in fo.causes if c.route == "primary"]
        assert (cause.state, cause.category) == ("not_sent", "unusable")
        assert cause.detail is not None and VAR in cause.detail
        [u] = audit.health().unusable
        assert (u.route, u.profile, u.skips, u.last_run) == ("primary", None, 1, "r")
        assert u.why is not None and VAR in u.why and KEY not in u.why
    assert KEY not in json.dumps([c.__dict__ for c in fo.causes])

    assert main(["--db", db_url, "failovers"]) == 0
    out = capsys.readouterr().out
    assert "primary: unusable" in out and "r primary: no API key for route 'primary'" in out
    assert VAR in out
    assert main(["--db", db_url, "health"]) == 0
    out = capsys.readouterr().out
    assert "unusable routes" in out and "primary: no API key for route 'primary'" in out
    assert VAR in out and KEY not in out
    assert main(["--db", db_url, "health", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [u["route"] for u in doc["unusable"]] == ["primary"]

    # The key is back and the route serves again: health no longer lists it.
    monkeypatch.setenv(VAR, KEY)
    with Ledger.open(db_url) as led, led.run("r2", plan=keyed(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        assert run.turn(HELLO).route.id == "primary"
        assert Audit(led).health().unusable == []
