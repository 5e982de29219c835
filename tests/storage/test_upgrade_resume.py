"""A Run admitted by an earlier version of the library is continued by a later one.

Invariant 5 (the frozen policy is the Run's) and invariant 2 (the same id with the same
content is the same Run): a later version may add a policy field, which changes the default
preset's hash; a Run admitted before, asked again with the same terms and no policy, keeps
the policy it was frozen with instead of being refused as different content."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from sqlalchemy import update

from ledger import Budget, Envelope, Grant, Part
from ledger.api.facade import Ledger
from ledger.domain.values import content_hash
from ledger.errors import AdmissionConflict
from ledger.storage import schema as s
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.storage.helpers import sql_context

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=5, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})


def _as_an_older_version_froze_it(led: Ledger, run_id: str) -> str:
    """The Run's frozen policy without the field a later version added, hashed as then."""
    frozen = dict(led.frozen_run(run_id).policy)
    health = dict(frozen["health"])
    del health["count_overlapping_failures"]
    frozen["health"] = health
    old_hash = content_hash(frozen)
    with sql_context(led).engine.begin() as conn:
        conn.execute(update(s.runs).where(s.runs.c.run_id == run_id).values(
            policy=json.dumps(frozen), policy_hash=old_hash))
    return old_hash


def test_a_run_admitted_by_an_earlier_version_is_continued_without_a_policy(
        db_url: str, fake: FakeProvider) -> None:
    terms = {"plan": fakeplan.plan(fake), "budget": BUDGET, "grant": GRANT}
    with Ledger.open(db_url) as led:
        led.admit_run("r", **terms)  # type: ignore[arg-type]
        old_hash = _as_an_older_version_froze_it(led, "r")
    with Ledger.open(db_url) as led:  # the later version, nothing cached
        assert led.admit_run("r", **terms).policy_hash == old_hash  # type: ignore[arg-type]
        with led.run("r", **terms) as run:  # type: ignore[arg-type]
            assert run.turn(Envelope(parts=[Part(content="hello")])).text
        # Its frozen policy, read under today's model: the field as that version meant it.
        assert led.run_policy("r").health.count_overlapping_failures is True
        # Asked for by name, or with other terms, it is still other content.
        with pytest.raises(AdmissionConflict) as ei:
            led.admit_run("r", policy="failure-domain", **terms)  # type: ignore[arg-type]
        assert ei.value.differing == ["policy_hash"]
        with pytest.raises(AdmissionConflict) as ei:
            led.admit_run("r", **{**terms, "budget": Budget(  # type: ignore[arg-type]
                max_calls=6, max_retries=2, max_cost=Decimal("1"))})
        assert ei.value.differing == ["budget", "policy_hash"]
