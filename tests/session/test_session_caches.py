"""What a ledger caches of a Run is held while a Run session of it is open, no longer.

A long-lived worker serves one Run after another: what it read for a Run it no longer holds
(the frozen Run, the reads its decisions make, the Attempts it began) is dropped when the Run's
last session on the ledger exits, and Runs frozen under one policy share one parse of it. The
caches are looked at through the ledger (white-box): their sizes are what a worker keeps.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    Envelope,
    Grant,
    LeaseHeld,
    Ledger,
    Part,
)
from ledger.api.face import Face
from ledger.policy.load import policy_hash
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
CHILD = Budget(max_calls=2, max_retries=0, max_cost=Decimal("0.1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_result",
                                   "tool_description", "system"]})
RUNS = 6


def _held(led: Face[Any, Any]) -> dict[str, int]:
    """How many entries each of the ledger's per-Run caches holds."""
    return {"frozen_runs": len(led._frozen_runs), "reads": len(led._reads),
            "begun": len(led._begun), "sessions": len(led._open_sessions)}


EMPTY = {"frozen_runs": 0, "reads": 0, "begun": 0, "sessions": 0}


def test_a_run_sessions_cached_entries_go_when_it_exits_and_runs_of_one_preset_share_a_policy(
        tmp_path: Any, fake: FakeProvider) -> None:
    policies: set[int] = set()
    with Ledger.open(str(tmp_path / "l.db")) as led:
        for i in range(RUNS):
            with led.run(f"r{i}", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                run.turn(Envelope(parts=[Part(content="hello")]))
                # An Attempt a host begins itself is remembered for its settle until it is.
                att = led.begin_attempt(run.lease, route="primary", envelope_hash="sha256:e",
                                        reserve="0.01")
                led.mark_unknown(run.lease, att.attempt_id, "the host's own send went away")
                if i % 2 == 0:
                    with run.child(f"c{i}", plan=plan(fake)[1:], budget=CHILD) as child:
                        child.turn(Envelope(parts=[Part(content="sub-task")]))
                        policies.add(id(led._runner.run(led._policy(f"c{i}"))))
                policies.add(id(led._runner.run(led._policy(f"r{i}"))))
                assert _held(led)["frozen_runs"] >= 1 and set(led._open_sessions) == {f"r{i}"}
            assert _held(led) == EMPTY
        # One parse of the default preset for every Run and Child frozen under it.
        assert len(policies) == 1 and len(led._policies) == 1
        # Caches only: a Run resumed reads what it froze again, and so does a read outside a
        # session (which the cache's size bounds).
        with led.run("r1", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            run.turn(Envelope(parts=[Part(content="again")]))
        assert _held(led) == EMPTY
        assert policy_hash(led.run_policy("r0")) == led.get_run("r0").policy_hash
        assert led.frozen_run("c0").parent_run_id == "r0"


def test_an_async_run_sessions_cached_entries_go_when_it_exits(tmp_path: Any,
                                                               fake: FakeProvider) -> None:
    async def main() -> None:
        policies: set[int] = set()
        async with AsyncLedger.open(str(tmp_path / "l.db")) as led:
            for i in range(RUNS):
                async with led.run(f"r{i}", plan=plan(fake), budget=BUDGET,
                                   grant=GRANT) as run:
                    await run.turn(Envelope(parts=[Part(content="hello")]))
                    if i % 2 == 0:
                        async with run.child(f"c{i}", plan=plan(fake)[1:],
                                             budget=CHILD) as child:
                            await child.turn(Envelope(parts=[Part(content="sub-task")]))
                    policies.add(id(await led._runner.arun(led._policy(f"r{i}"))))
                assert _held(led) == EMPTY
            assert len(policies) == 1 and len(led._policies) == 1
            assert (await led.frozen_run("r0")).run_id == "r0"

    asyncio.run(main())


def test_a_run_keeps_its_cached_entries_while_another_of_its_sessions_is_refused(
        tmp_path: Any, fake: FakeProvider) -> None:
    with Ledger.open(str(tmp_path / "l.db")) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            run.turn(Envelope(parts=[Part(content="hello")]))
            held = _held(led)
            # A second session of the Run on this ledger, refused at its entry (one session
            # per Run per ledger, whatever its terms), lets go of nothing of the open one's:
            # its entries stay.
            for terms in ({"plan": plan(fake)[:1]}, {"plan": plan(fake)}):
                with pytest.raises(LeaseHeld), led.run("r", budget=BUDGET, grant=GRANT,
                                                       **terms):
                    pass
            assert _held(led) == held and set(led._open_sessions) == {"r"}
            assert led._frozen_runs.get("r") is not None
        assert _held(led) == EMPTY
