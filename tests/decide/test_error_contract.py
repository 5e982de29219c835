"""Every ledger error pickles with its typed attributes, and sits in the drawn tree."""

from __future__ import annotations

import inspect
import pickle
import re
from pathlib import Path

import pytest

import ledger.errors as errors_mod
from ledger.domain.facts import Category, FailureFact, Phase
from ledger.errors import (
    AdmissionConflict,
    FailoverExhausted,
    InvalidArgument,
    LedgerError,
    PartialOutput,
    PolicyError,
    ProviderError,
)

ERRORS = sorted((c for _, c in inspect.getmembers(errors_mod, inspect.isclass)
                 if issubclass(c, LedgerError)), key=lambda c: c.__name__)


def _instance(cls: type[LedgerError]) -> LedgerError:
    if cls is FailoverExhausted:
        return FailoverExhausted(
            "run r stopped: no_candidate", [ProviderError("503 from p1", route="a")],
            reason="no_candidate", attempts=["att-1"], detail="every candidate eliminated",
            skipped=[{"route": "b", "reason": "disclosure"}],
            partial=PartialOutput(text="The fil", attempt_id="att-1", route="a"))
    if cls is AdmissionConflict:
        return AdmissionConflict("run r differs", run_id="r", differing=["budget"])
    if cls is PolicyError:
        return PolicyError("bad policy", file="p.yaml", errors=[("a.b", "bad", "fix it")])
    if cls is ProviderError:
        fact = FailureFact(category=Category.OVERLOADED, phase=Phase.AFTER_HEADERS, status=503)
        return ProviderError("p1/m1: overloaded (HTTP 503)", fact=fact, attempt_id="att-1",
                             route="a")
    if issubclass(cls, InvalidArgument):
        return cls("bad value", field="budget.max_cost")
    return cls("it failed; do this instead", run_id="r", attempt_id="att-1")


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_ledger_error_round_trips_through_pickle(cls: type[LedgerError]) -> None:
    err = _instance(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err) and back.fields == err.fields
    assert {k: v for k, v in vars(back).items() if k != "__traceback__"} == {
        k: v for k, v in vars(err).items() if k != "__traceback__"}
    if isinstance(err, FailoverExhausted):
        assert isinstance(back, FailoverExhausted)
        assert [str(e) for e in back.exceptions] == [str(e) for e in err.exceptions]
        assert (back.reason, back.skipped, back.partial) == (err.reason, err.skipped,
                                                             err.partial)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_ledger_error_is_drawn_in_the_tree(cls: type[LedgerError]) -> None:
    tree = (errors_mod.__doc__ or "").split("The tree::", 1)[1]
    assert f" {cls.__name__} " in tree or f" {cls.__name__}\n" in tree
    assert cls.__name__ in errors_mod.__all__


def test_a_provider_error_carries_its_fact_typed() -> None:
    err = _instance(ProviderError)
    assert isinstance(err, ProviderError) and isinstance(err.fact, FailureFact)
    assert err.fact.category is Category.OVERLOADED and err.fields["fact"]["status"] == 503
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, ProviderError) and back.fact == err.fact


def _drawn_parents(tree: str) -> dict[str, str | None]:
    """Each name in a drawn tree with the name it hangs under (box-drawing, 4 columns a level)."""
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in tree.splitlines():
        found = re.match(r"^([ │├└─]*)([A-Z]\w+)", line)
        if not found:
            continue
        depth = len(found.group(1)) // 4
        del stack[depth:]
        parents[found.group(2)] = stack[-1] if stack else None
        stack.append(found.group(2))
    return parents


def _tree_in(text: str, start: str) -> str:
    block = text.split(start, 1)[1]
    lines = [ln.strip("\n") for ln in block.split("\n\n", 1)[0].splitlines()]
    width = min(len(ln) - len(ln.lstrip()) for ln in lines if ln.strip())
    return "\n".join(ln[width:] for ln in lines)


@pytest.mark.parametrize("where", ["ledger/errors.py", "docs/concepts.md"])
def test_the_drawn_error_tree_is_the_class_hierarchy(where: str) -> None:
    text = (Path(__file__).resolve().parents[2] / where).read_text()
    tree = _tree_in(text, "The tree::\n" if where.endswith(".py") else "```\nLedgerError")
    if not tree.startswith("LedgerError"):
        tree = "LedgerError\n" + tree
    drawn = _drawn_parents(tree)
    actual = {c.__name__: next((b.__name__ for b in c.__bases__ if issubclass(b, LedgerError)),
                               None) for c in ERRORS}
    assert drawn == actual
