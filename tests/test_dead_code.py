"""No dead code: every function, class, method, attribute and constant of ``ledger`` is used.

Runs vulture with the configuration of ``pyproject.toml`` (``[tool.vulture]``) over the library
and the whitelist, more strictly than its command line: a plain module's ``__all__`` does not
count as a use of the names it lists (only a package's ``__init__.py``, the face of a room, and
``ledger/__init__.py``, the face of the library, do), so a function that is exported but called
by nothing is found. A name used only from outside the library's own code (a hook, a framework
override, documented public API that the library itself does not call) is listed with its
reason in ``tests/dead_code_whitelist.py``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any

import pytest

vulture = pytest.importorskip("vulture")
from vulture import core  # noqa: E402  (after the importorskip, like the import it guards)

ROOT = Path(__file__).resolve().parent.parent


class _StrictVulture(vulture.Vulture):  # type: ignore[misc]
    """Vulture that counts ``__all__`` as a use only in a package's ``__init__.py``."""

    def visit_Assign(self, node: ast.Assign) -> None:
        if core._assigns_special_variable__all__(node) and self.filename.name != "__init__.py":
            return
        super().visit_Assign(node)


def _config() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["tool"]["vulture"])


def unused_code(paths: list[Path]) -> list[str]:
    """Vulture's findings over ``paths``, one ``path:line: message`` line each."""
    cfg = _config()
    v = _StrictVulture(ignore_names=cfg["ignore_names"],
                       ignore_decorators=cfg["ignore_decorators"])
    v.scavenge([str(p) for p in paths])
    return [f"{Path(i.filename).relative_to(ROOT)}:{i.first_lineno}: {i.message}"
            for i in v.get_unused_code(min_confidence=cfg["min_confidence"])]


def test_nothing_in_the_library_is_dead_code() -> None:
    found = unused_code([ROOT / p for p in _config()["paths"]])
    assert not found, (
        "code nothing uses (remove it; or, if it is used from outside the library's own code, "
        "list it in tests/dead_code_whitelist.py with the reason):\n" + "\n".join(found))


def test_the_check_finds_a_function_that_only_its_modules_all_exports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('from pkg.mod import used\n__all__ = ["used"]\n')
    (pkg / "mod.py").write_text(
        'def used():\n    return 1\n\n\ndef forgotten():\n    return 2\n\n\n'
        '__all__ = ["forgotten", "used"]\n')
    v = _StrictVulture()
    v.scavenge([str(pkg)])
    names = {i.name for i in v.get_unused_code(min_confidence=60)}
    assert names == {"forgotten"}
