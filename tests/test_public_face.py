"""The public face documents itself: ``ledger.__all__`` is exactly the names docs/reference.md
lists, and every public name of the public modules has a docstring.

Ruff's pydocstyle rules hold the docstrings in CI too; these tests hold them whatever ruff's
configuration says, and they read what a user reads (``inspect.getdoc``, as ``help()`` does),
so a method made at run time (``Ledger.finish_run``, every ``AsyncLedger`` method) counts.
Examples in docstrings that are not marked ``# doctest: +SKIP`` run here as doctests.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import ledger

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"

# The rooms whose names are the library's public face (pyproject's per-file-ignores exempt the
# internal ones: storage, tools, cli, dashboard).
PUBLIC_PACKAGES = ("ledger.domain", "ledger.policy", "ledger.decide", "ledger.api", "ledger.ops",
                   "ledger.adapters", "ledger.integrations", "ledger.testing")
PUBLIC_MODULES = ("ledger", "ledger.errors", "ledger.redaction", "ledger.clock",
                  "ledger.telemetry")

# A reference row: | `Name` | what it is |
_ROW = re.compile(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|", re.MULTILINE)


def page_names(text: str) -> list[str]:
    """The names a reference page documents: the first cell of each of its table rows."""
    return _ROW.findall(text)


def face_problems(documented: Iterable[str], exported: Iterable[str]) -> list[str]:
    """How the documented names and the exported ones differ, one problem per line."""
    documented, exported = list(documented), set(exported)
    problems = [f"{n} is in ledger.__all__ but not on docs/reference.md"
                for n in sorted(exported - set(documented))]
    problems += [f"{n} is on docs/reference.md but not in ledger.__all__"
                 for n in sorted(set(documented) - exported)]
    problems += [f"{n} is listed twice on docs/reference.md"
                 for n in sorted({n for n in documented if documented.count(n) > 1})]
    return problems


def public_modules() -> Iterator[ModuleType]:
    """Every module of the public face (private ones, ``_name``, left out)."""
    for name in PUBLIC_MODULES:
        yield importlib.import_module(name)
    for pkg_name in PUBLIC_PACKAGES:
        pkg = importlib.import_module(pkg_name)
        yield pkg
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg_name}."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                yield importlib.import_module(info.name)


def _own_names(module: ModuleType) -> list[tuple[str, Any]]:
    """The public functions and classes ``module`` defines (re-exports are their own module's)."""
    return [(n, obj) for n, obj in vars(module).items()
            if not n.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == module.__name__]


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties a class of the library defines or inherits from one."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("ledger"):
            continue  # pydantic's, Exception's, Enum's own members document themselves
        for n, attr in vars(klass).items():
            if n.startswith("_"):
                continue
            if isinstance(attr, staticmethod | classmethod):
                attr = attr.__func__
            if inspect.isfunction(attr) or isinstance(attr, property):
                out[n] = getattr(cls, n) if not isinstance(attr, property) else attr
    return sorted(out.items())


def undocumented(objects: Iterable[tuple[str, Any]]) -> list[str]:
    """The names among ``objects`` whose docstring (as ``help()`` shows it) is empty."""
    return [name for name, obj in objects if not (inspect.getdoc(obj) or "").strip()]


# -- the tests -------------------------------------------------------------------------------


def test_reference_page_documents_exactly_the_names_of_ledger_all() -> None:
    problems = face_problems(page_names(REFERENCE.read_text(encoding="utf-8")),
                             set(ledger.__all__) - {"__version__"})
    assert not problems, "\n".join(problems)


def test_a_name_missing_from_the_page_is_reported_by_name() -> None:
    page = "| `Ledger` | the facade |\n| `Ledger` | again |\n| `Gone` | removed |\n"
    problems = face_problems(page_names(page), {"Ledger", "execute"})
    assert problems == ["execute is in ledger.__all__ but not on docs/reference.md",
                        "Gone is on docs/reference.md but not in ledger.__all__",
                        "Ledger is listed twice on docs/reference.md"]


def test_every_name_of_ledger_all_has_a_docstring() -> None:
    names = [(n, getattr(ledger, n)) for n in ledger.__all__ if n != "__version__"]
    assert not undocumented(names)


def test_every_public_method_and_property_of_the_public_classes_has_a_docstring() -> None:
    missing = []
    for module in public_modules():
        for name, obj in _own_names(module):
            if inspect.isclass(obj):
                missing += [f"{module.__name__}.{name}.{m}"
                            for m in undocumented(_members(obj))]
    assert not missing, "methods or properties without a docstring:\n" + "\n".join(missing)


def test_every_public_module_function_and_class_has_a_docstring() -> None:
    missing = []
    for module in public_modules():
        if not (module.__doc__ or "").strip():
            missing.append(module.__name__)
        missing += [f"{module.__name__}.{n}" for n in undocumented(_own_names(module))]
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_the_check_finds_a_method_without_a_docstring() -> None:
    class Documented:
        """A class whose method is not."""

        def method(self) -> None:
            pass

    Documented.__module__ = "ledger.example"
    assert undocumented(_members(Documented)) == ["method"]


def test_every_async_ledger_method_says_it_is_the_async_form_of_the_sync_one() -> None:
    for name, attr in _members(ledger.AsyncLedger):
        sync = getattr(ledger.Ledger, name, None)
        if inspect.iscoroutinefunction(attr) and sync is not None and name != "close":
            doc = inspect.getdoc(attr) or ""
            assert doc.startswith(inspect.getdoc(sync) or "?"), name
            assert "On :class:`AsyncLedger` a coroutine" in doc, name


def test_every_public_method_read_on_its_class_has_its_signature_and_public_return_type(
        ) -> None:
    # help(Ledger) and inspect.signature(Ledger.admit_run) read the class attribute, which for
    # an operation is a descriptor (ledger.api.calls.op): it showed admit_run(...) and raised.
    from ledger.api.calls import op, query
    from ledger.ops.audit import Audit

    bad = []
    for cls in (ledger.Ledger, ledger.AsyncLedger, Audit):
        for name in dir(cls):
            raw = inspect.getattr_static(cls, name)
            if name.startswith("_") or not isinstance(raw, op | query):
                continue
            attr = getattr(cls, name)
            try:
                sig = inspect.signature(attr)
            except (TypeError, ValueError) as e:
                bad.append(f"{cls.__name__}.{name}: {e}")
                continue
            if str(sig.return_annotation).startswith("Flow["):
                bad.append(f"{cls.__name__}.{name}: returns {sig.return_annotation}")
    assert not bad, "\n".join(bad)
    assert "-> 'RunRecord'" in str(inspect.signature(ledger.Ledger.admit_run))


# ``:class:`~ledger.x.Y``` and ````ledger.x.y```` in a docstring: a path a reader will follow.
_REFERENCE = re.compile(r"(?::[a-z]+:`~?|``)(ledger(?:\.\w+)+)`")


def resolves(path: str) -> bool:
    """Whether a dotted ``ledger...`` path names a module, or an attribute or field of one."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            fields = {**getattr(obj, "__dataclass_fields__", {}),
                      **getattr(obj, "model_fields", {})}
            if name in fields and not hasattr(obj, name):
                return True  # a field without a class default: documented, not an attribute
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_ledger_path_a_docstring_names_exists() -> None:
    root = Path(ledger.__file__).parent
    stale = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                stale += [f"{path.relative_to(root.parent)}:{node.lineno}: {m}"
                          for m in _REFERENCE.findall(node.value) if not resolves(m)]
    assert not stale, "docstrings naming what does not exist (moved or removed?):\n" + "\n".join(
        stale)


def test_a_moved_name_is_found_stale() -> None:
    assert resolves("ledger.decide.retry.retry_decision")
    assert not resolves("ledger.decide.retry.retry_plan")
    assert not resolves("ledger.run.execute")


@pytest.mark.parametrize("module", [m.__name__ for m in public_modules()])
def test_docstring_examples_run(module: str) -> None:
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    mod = importlib.import_module(module)
    for test in finder.find(mod, mod.__name__):
        if test.examples and test.name.startswith(module):
            runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {module}"
