"""A Run's ``failed_over`` mark (migration 0012), which the failovers page and count read: it is
set exactly for the Runs the audit's rule names, by every write that can make a Run one, and
for the Runs of a ledger written before the mark existed."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import Budget, Envelope, FailoverExhausted, Grant, Ledger, Part, Price, Profile, Route
from ledger.adapters import StaticSecretProvider
from ledger.clock import ManualClock
from ledger.ops.audit import Audit
from ledger.policy.load import preset
from ledger.storage.engine import normalize_url
from ledger.storage.provision import init_database
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault
from tests.audit.generated import generated
from tests.storage.helpers import downgrade_schema
from tests.storage.test_history_scales import FACT

END = 1_700_000_000.0
SPAN = 10 * 3600.0
HASH = "sha256:" + "e" * 64
PLAN = [Route(id="a", provider="p", model="m", group="g", recipient="p", price=Price()),
        Route(id="b", provider="p", model="m2", group="g", recipient="p", price=Price())]

# The rule itself, as the audit read it before the mark: a success on another route than the
# Run's selected one, or a ``move`` event.
RULE = """
SELECT run_id FROM runs r
WHERE EXISTS (SELECT 1 FROM attempts a WHERE a.run_id = r.run_id AND a.state = 'succeeded'
              AND a.route_id <> r.selected_route)
   OR EXISTS (SELECT 1 FROM events e WHERE e.run_id = r.run_id AND e.kind = 'move')
"""
MARKED = "SELECT run_id FROM runs WHERE failed_over = :yes"


def _ids(url: str, sql: str) -> set[str]:
    eng = create_engine(normalize_url(url))
    try:
        with eng.connect() as conn:
            return {str(r[0]) for r in conn.execute(text(sql), {"yes": True})}
    finally:
        eng.dispose()


def _generated(url: str) -> Ledger:
    return generated(url, start=END - SPAN, attempts=300, days=SPAN / 86400, end=END, seed=11)


def _all_failovers(audit: Audit, **window: Any) -> set[str]:
    out: set[str] = set()
    cursor = None
    while True:
        page = audit.failovers(limit=7, cursor=cursor, **window)
        out |= {f.run_id for f in page.items}
        cursor = page.next_cursor
        if cursor is None:
            return out


def test_a_run_is_marked_failed_over_by_every_write_that_makes_it_one(db_url: str) -> None:
    led = _generated(db_url)
    try:
        rule = _ids(db_url, RULE)
        assert rule and _ids(db_url, MARKED) == rule  # moves and successes elsewhere, turns'
        clock = led.clock
        assert isinstance(clock, ManualClock)
        clock.set(END + 60)

        def run(run_id: str) -> Any:
            led.admit_run(run_id, plan=PLAN, budget=Budget(max_calls=5, max_retries=2,
                                                           max_cost=1))
            return led.acquire_lease(run_id, ttl_s=3600)

        def begin(lease: Any, route: str) -> str:
            return led.begin_attempt(lease, route=route, envelope_hash=HASH,
                                     reserve="0.01").attempt_id

        # Served by another route than the selected one, with no move (a host's own sender,
        # or a selected route skipped while it cooled): failed over.
        lease = run("elsewhere")
        led.settle_attempt(lease, begin(lease, "b"), outcome="succeeded")
        # Served by the selected route, after a failure elsewhere: not failed over.
        lease = run("home")
        led.settle_attempt(lease, begin(lease, "b"), outcome="failed", fact=FACT)
        led.settle_attempt(lease, begin(lease, "a"), outcome="succeeded")
        # An unknown Attempt elsewhere, settled by an operator's receipt: as it says.
        receipts = {}
        for run_id, outcome in (("receipt-ok", "succeeded"), ("receipt-failed", "failed")):
            lease = run(run_id)
            att = begin(lease, "b")
            led.mark_unknown(lease, att, reason="shutdown")
            receipts[att] = outcome
        assert "receipt-ok" not in _ids(db_url, MARKED)
        for att, outcome in receipts.items():
            led.settle_unknown(att, outcome=outcome, note="billing export", by="ops")
        # A host's own ``move`` event counts as the turn loop's.
        lease = run("host-move")
        led.append_event(lease, "move", {"from_route": "a", "to_route": "b"})

        marked = _ids(db_url, MARKED)
        assert marked == _ids(db_url, RULE)
        assert {"elsewhere", "receipt-ok", "host-move"} <= marked
        assert not {"home", "receipt-failed"} & marked
        # The page and the count read the mark: every page together is the rule's Runs.
        audit = Audit(led)
        assert _all_failovers(audit) == marked
        assert audit.count_failovers() == len(marked)
        window = {"since": END - 4 * 3600, "until": END}
        inside = _all_failovers(audit, **window)
        assert inside and inside < marked
        assert audit.count_failovers(**window) == len(inside)
    finally:
        led.close()


def test_migration_0012_marks_the_runs_that_failed_over_before_it(db_url: str) -> None:
    _generated(db_url).close()
    rule = _ids(db_url, RULE)
    assert rule
    downgrade_schema(db_url, "0011")  # the column and its index are gone
    init_database(db_url)  # and back: the migration marks the history by the rule
    assert _ids(db_url, MARKED) == rule
    with Ledger.open(db_url, clock=ManualClock(END)) as led:
        assert Audit(led).count_failovers() == len(rule)


def test_a_turn_that_moves_and_fails_everywhere_is_marked_by_its_move(db_url: str) -> None:
    # No success anywhere: only the move, written with the next route's begin, marks it.
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b:
        for fake in (a, b):
            for _ in range(6):
                fake.enqueue(Behavior(fault=Fault.SERVER_ERROR))
        plan = [Route(id=r, provider=f"p{r}", model="m", group=f"g{r}", recipient="r",
                      endpoint=f.endpoint("openai"), profiles=[Profile(id=f"p:{r}")],
                      price=Price()) for r, f in (("a", a), ("b", b))]
        with Ledger.open(db_url) as led:
            with pytest.raises(FailoverExhausted), led.run(
                    "everywhere", plan=plan, policy=preset("failure-domain"),
                    budget=Budget(max_calls=4, max_retries=2, max_cost=1),
                    grant=Grant(recipients={"r": ["user_input"]}),
                    secrets=StaticSecretProvider({"p:a": "ka", "p:b": "kb"})) as run:
                run.turn(Envelope(parts=[Part(content="hi")]), reserve="0.01")
            assert a.requests and b.requests
            assert not any(t.state == "succeeded" for t in led.timeline("everywhere"))
    assert "everywhere" in _ids(db_url, RULE)
    assert _ids(db_url, MARKED) == _ids(db_url, RULE)
