"""Parsing the package's source for the tests that read it (import rules, storage rules).

Once in CI, ``ast.parse`` of an ordinary file in the middle of the suite raised
``SystemError: AST constructor recursion depth mismatch`` (CPython 3.11 compares the thread's
recursion bookkeeping before and after building the tree; something earlier in the same
thread, or a garbage collection running finalizers during the parse, had moved it). The parse
runs on a thread of its own, with collection paused, so the tests judge the source, not the
state the suite left.
"""

from __future__ import annotations

import ast
import gc
import threading
from pathlib import Path


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)`` on a fresh thread with garbage collection paused."""
    out: list[ast.Module | BaseException] = []

    def parse() -> None:
        try:
            out.append(ast.parse(source, filename))
        except BaseException as e:  # handed to the caller's thread
            out.append(e)

    enabled = gc.isenabled()
    gc.disable()
    try:
        thread = threading.Thread(target=parse, name="ast-parse")
        thread.start()
        thread.join()
    finally:
        if enabled:
            gc.enable()
    [result] = out
    if isinstance(result, BaseException):
        raise result
    return result


def parse_file(path: Path) -> ast.Module:
    """The syntax tree of the source file ``path``."""
    return parse_source(path.read_text(encoding="utf-8"), str(path))
