"""Every ledger error pickles with its typed attributes, cause and notes, and sits in the drawn
tree."""

from __future__ import annotations

import functools
import inspect
import pickle
import re
import socket
import sqlite3
from collections.abc import Callable
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


def _sqlite_error() -> Exception:
    try:
        sqlite3.connect(":memory:").execute("select * from no_such_table")
    except sqlite3.Error as e:
        return e
    raise AssertionError("sqlite3 raised nothing")


@functools.cache
def _psycopg_error() -> Exception:
    import psycopg

    with socket.socket() as s:  # a loopback port nobody listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        psycopg.connect(f"host=127.0.0.1 port={port} user=u dbname=d connect_timeout=5")
    except psycopg.OperationalError as e:
        return e
    raise AssertionError("psycopg connected to a closed port")


def _http_status_error() -> Exception:
    # Dumps fine, but its class requires request= and response=, which its pickle omits.
    import httpx

    request = httpx.Request("GET", "http://127.0.0.1:1/v1/chat")
    return httpx.HTTPStatusError("Server error '503 Service Unavailable'", request=request,
                                 response=httpx.Response(503, request=request))


CAUSES: dict[str, Callable[[], Exception]] = {
    "ValueError": lambda: ValueError("root cause"),
    "sqlite3": _sqlite_error,
    "psycopg": _psycopg_error,
}


def _raised(err: LedgerError, cause: BaseException | None) -> LedgerError:
    try:
        raise err from cause
    except LedgerError as e:
        e.add_note("leaving the Run session, finishing run r failed too")
        return e


@pytest.mark.parametrize("cause_of", CAUSES.values(), ids=list(CAUSES))
@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_ledger_error_pickles_with_its_cause_and_notes(
        cls: type[LedgerError], cause_of: Callable[[], Exception]) -> None:
    cause = cause_of()
    err = _raised(_instance(cls), cause)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and back.__notes__ == err.__notes__
    assert type(back.__cause__) is type(cause) and str(back.__cause__) == str(cause)
    assert back.__suppress_context__


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_a_cause_that_does_not_pickle_crosses_as_a_stand_in_with_its_name_and_text(
        cls: type[LedgerError]) -> None:
    cause = _http_status_error()
    err = _raised(_instance(cls), cause)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and back.__notes__ == err.__notes__
    stand_in = back.__cause__
    assert stand_in is not None and not isinstance(stand_in, type(cause))
    assert (type(stand_in).__module__, type(stand_in).__name__) == ("httpx", "HTTPStatusError")
    assert str(stand_in) == str(cause)
    again = pickle.loads(pickle.dumps(back))  # the stand-in pickles in its turn
    assert str(again.__cause__) == str(cause)
    assert type(again.__cause__).__name__ == "HTTPStatusError"


def test_a_stop_pickles_its_members_causes_and_what_it_hid() -> None:
    member = _raised(ProviderError("503 from p1", route="a"), _http_status_error())
    stop = _raised(FailoverExhausted("run r stopped", [member], reason="no_candidate"), None)
    back = pickle.loads(pickle.dumps(stop))
    assert back.__cause__ is None and back.__suppress_context__  # raised "from None"
    (got,) = back.exceptions
    assert type(got) is ProviderError and got.__notes__ == member.__notes__
    assert type(got.__cause__).__name__ == "HTTPStatusError"


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
