"""Migration 0017: rows settled under the old rule for an unreadable whole 2xx body.

Before 0017 such a settle posted nothing; it now posts the whole hold, and every report and
reconcile read each settled row by the new rule. A row settled the old way (nothing posted on
its debit or its Run) must keep reading as what it posted, or every report would charge it
and reconcile would flag it. Both backends.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest
from sqlalchemy import create_engine, text

from ledger.api.facade import Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.values import Budget, Grant
from ledger.errors import FailoverExhausted
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.storage.engine import normalize_url
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault
from tests.fakeplan import plan

from .helpers import downgrade_schema

HOLD = Decimal("0.02")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


def _settled_the_old_way(url: str, fake: FakeProvider) -> str:
    """A Run whose one Attempt got an unreadable 200, with its money as the old rule left it:
    nothing posted on the debit or the Run (the package of 0016 did exactly that)."""
    with Ledger.open(url) as led:
        fake.enqueue(Behavior(fault=Fault.MALFORMED_EVENT))
        with pytest.raises(FailoverExhausted), led.run(
                "old", plan=plan(fake)[:1],
                budget=Budget(max_calls=1, max_retries=0, max_cost=Decimal("1")),
                grant=Grant(recipients={"fake": ["user_input"]})) as run:
            run.turn(Envelope(parts=[Part(content="Summarise.")], max_output_tokens=64),
                     reserve=HOLD)
        [att] = led.timeline("old")
        assert att.cost is None
    micros = int(HOLD * 1_000_000)
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE debits SET posted_micros = 0 WHERE attempt_id = :a"),
                         {"a": att.attempt_id})
            conn.execute(text("UPDATE runs SET posted_micros = posted_micros - :m "
                              "WHERE run_id = 'old'"), {"m": micros})
    finally:
        engine.dispose()
    return att.attempt_id


def test_rows_settled_before_0017_keep_reading_as_what_they_posted(
        db_url: str, fake: FakeProvider) -> None:
    attempt_id = _settled_the_old_way(db_url, fake)
    downgrade_schema(db_url, "0016")
    with Ledger.open(db_url) as led:  # opening upgrades to head
        [att] = led.timeline("old")
        assert att.attempt_id == attempt_id and att.cost == 0
        assert (led.get_run("old").posted, led.get_run("old").reserved) == (0, 0)
        books = reconcile(led)
        assert books.ok, books.violations
        audit = Audit(led)
        [total] = audit.costs(by="run").items
        assert (total.cost, total.held) == (0, 0)
        assert audit.replay("failure-domain", run="old").baseline.cost == 0
