"""The frozen Run and its live state are separate values (invariant 5: a Run's plan, grant,
budget and policy are frozen at admission).

``Ledger.frozen_run`` caches what never changes, so it cannot offer counters that go stale;
``Ledger.get_run`` reads the live state; a ``RunRecord`` is exactly the two together.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from ledger import FailureFact
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.facts import Category, Phase, Source
from ledger.domain.records import FrozenRun, RunRecord, RunState
from ledger.policy.load import load_policy, policy_hash, preset

from .helpers import routes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def led(db_url: str) -> Iterator[Ledger]:
    with Ledger.open(db_url, clock=ManualClock(10_000.0)) as led:
        yield led


def test_a_run_record_is_its_frozen_admission_plus_its_live_state() -> None:
    frozen = {f.name for f in fields(FrozenRun)}
    live = {f.name for f in fields(RunState)}
    assert not frozen & live
    assert {f.name for f in fields(RunRecord)} == frozen | live


def test_invariant5_the_frozen_run_never_carries_counters_that_go_stale(led: Ledger) -> None:
    led.admit_run("r", plan=routes(), budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    before = led.frozen_run("r")
    assert type(before) is FrozenRun and not hasattr(before, "calls_used")
    lease = led.acquire_lease("r")
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1")
    fact = FailureFact(category=Category.SERVER_ERROR, source=Source.PROVIDER,
                       phase=Phase.AFTER_HEADERS, status=500)
    led.settle_attempt(lease, att.attempt_id, outcome="failed", fact=fact)
    live = led.get_run("r")
    assert live.calls_used == 1 and live.fence == lease.fence
    assert led.frozen_run("r") == before == live.frozen
    assert RunRecord.of(before, live.state) == live


def test_invariant5_a_policy_changed_in_place_by_a_caller_changes_no_later_run(
        led: Ledger) -> None:
    # A frozen model still holds lists and dicts: the preset every caller was handed, or the
    # Run's cached policy, changed in place, would change what later Runs freeze and decide by.
    from_file = policy_hash(load_policy(REPO / "policies" / "goclaw.yaml"))
    load_policy("goclaw").moves_on.clear()
    preset("goclaw").classification.status.clear()
    assert policy_hash(load_policy("goclaw")) == from_file
    assert policy_hash(preset("goclaw")) == from_file
    rec = led.admit_run("r", plan=routes(), policy="goclaw",
                        budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    assert rec.policy_hash == from_file
    led.run_policy("r").moves_on.clear()
    assert policy_hash(led.run_policy("r")) == from_file
    assert led.run_policy("r").moves_on


def test_invariant5_a_frozen_run_changed_in_place_by_a_caller_changes_nothing_the_run_reads(
        led: Ledger) -> None:
    # frozen_run hands out what the turns read; before the Run's policy is first parsed, its
    # JSON changed in place would have become the policy the Run decides by.
    rec = led.admit_run("r", plan=routes(), policy="goclaw", labels={"team": "a"},
                        budget={"max_calls": 3, "max_retries": 1, "max_cost": 1})
    mine = led.frozen_run("r")
    mine.policy["moves_on"].clear()
    mine.labels["team"] = "b"
    mine.plan.clear()
    again = led.frozen_run("r")
    assert again.policy["moves_on"] and again.labels == {"team": "a"} and again.plan
    assert policy_hash(led.run_policy("r")) == rec.policy_hash


def test_invariant5_a_snapshots_policy_changed_in_place_changes_nothing_a_run_decides_by(
        led: Ledger) -> None:
    # Runs frozen under one policy share one parse of it: the snapshot a caller is handed
    # carries a copy, or changing it would change every such Run's decisions.
    budget = {"max_calls": 3, "max_retries": 1, "max_cost": 1}
    rec = led.admit_run("r", plan=routes(), policy="goclaw", budget=budget)
    led.admit_run("s", plan=routes(), policy="goclaw", budget=budget)
    led.turn_snapshot("r").policy.moves_on.clear()
    assert policy_hash(led.turn_snapshot("r").policy) == rec.policy_hash
    assert policy_hash(led.turn_snapshot("s").policy) == rec.policy_hash
    assert policy_hash(led.run_policy("s")) == rec.policy_hash
