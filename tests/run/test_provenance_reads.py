"""A turn reads the provenance its parts need, and no more (on both backends).

A turn's snapshot looks its parts' references up among those its Run and the Run's ancestors
recorded; a reference none of them recorded is looked up in the whole tree by a second read (a
Child's answer that its parent or a sibling carries). The user's own input (class
``user_input``, or the host's ``system`` text) needs no provenance at all: a reference such a
part carries (the host's own id for an upload, say) is never recorded by anyone, and looking it
up cost every turn that carried one that second read for nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import pytest

from ledger import Budget, Envelope, FailoverExhausted, Grant, Ledger, Part
from ledger.api.face import storage_of
from ledger.testing import FakeProvider
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "system", "private_document"]})


class _Counting:
    """The store's driver, counting the transactions it runs by the name of their flow."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()

    def run(self, tx: Any, *, write: bool, again: Any = None) -> Any:
        self.counts[getattr(tx, "__name__", "")] += 1
        return self.inner.run(tx, write=write, again=again)

    async def arun(self, tx: Any, *, write: bool, again: Any = None) -> Any:
        self.counts[getattr(tx, "__name__", "")] += 1
        return await self.inner.arun(tx, write=write, again=again)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextmanager
def _counted(led: Ledger) -> Iterator[Counter[str]]:
    store = storage_of(led)
    counting = _Counting(store.runner.driver)
    store.runner.driver = counting
    try:
        yield counting.counts
    finally:
        store.runner.driver = counting.inner


def test_a_turn_whose_only_unrecorded_refs_are_the_users_own_input_reads_no_tree(
        db_url: str, fake: FakeProvider) -> None:
    parts = [Part(role="system", content="be brief", provenance="host-prompt-3"),
             Part(content="the filing, as uploaded", provenance="upload-7"),
             Part(content="summarize it")]
    with Ledger.open(db_url) as led, led.run("task", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        with _counted(led) as counts:
            run.turn(Envelope(parts=parts))
        assert counts["snapshot_tx"] == 1, counts
        assert counts["tree_provenance_tx"] == 0, counts


def test_a_part_that_needs_provenance_is_still_looked_up_in_the_tree(
        db_url: str, fake: FakeProvider) -> None:
    # The other side: a private document's reference that the Run's own line did not record
    # may be the tree's; it is looked up there (and, recorded by nobody, not covered).
    parts = [Part(content="the filing", data_class="private_document", provenance="doc-10k"),
             Part(content="summarize it")]
    with Ledger.open(db_url) as led, led.run("task", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        with _counted(led) as counts, pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=parts))
        assert "no covering provenance: missing (ref 'doc-10k')" in str(ei.value.skipped)
        assert counts["tree_provenance_tx"] == 1, counts
