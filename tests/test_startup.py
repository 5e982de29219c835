"""Start-up stays light: ``import ledger`` and the command line's parsing load nothing heavy.

The package root is lazy (PEP 562) and the command modules import SQLAlchemy, httpx and the
pydantic models only inside the commands, so ``--help`` and argument parsing answer in a
fraction of a second. The module checks are exact; the wall-time bound is generous, so that a
busy machine cannot fail it while a regression to eager imports (about 1 s) still would.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ledger

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("sqlalchemy", "alembic", "httpx", "pydantic", "psycopg", "yaml", "genai_prices")


def _py(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60)


def _loaded_after(code: str) -> list[str]:
    res = _py(code + "\nimport json, sys\n"
              f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    assert res.returncode == 0, res.stderr
    loaded: list[str] = json.loads(res.stdout.splitlines()[-1])
    return loaded


def test_import_ledger_loads_no_heavy_module() -> None:
    assert _loaded_after("import ledger") == []


def test_every_public_name_resolves_lazily() -> None:
    res = _py("import ledger\n"
              "for name in ledger.__all__:\n"
              "    from_import = getattr(__import__('ledger', fromlist=[name]), name)\n"
              "    assert from_import is getattr(ledger, name), name\n"
              "print(len(ledger.__all__))")
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) == len(ledger.__all__)
    assert set(ledger.__all__) <= set(dir(ledger))


def test_submodules_load_on_attribute_access() -> None:
    res = _py("import ledger\n"
              "assert ledger.ops.__name__ == 'ledger.ops'\n"
              "assert ledger.storage.__name__ == 'ledger.storage'\n"
              "try:\n"
              "    ledger.no_such_thing\n"
              "except AttributeError as e:\n"
              "    print(e)\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "module 'ledger' has no attribute 'no_such_thing'"


def test_type_checkers_see_every_lazy_name() -> None:
    """The TYPE_CHECKING block imports exactly the names the lazy table serves, from the same
    modules, and __all__ lists exactly those plus __version__."""
    tree = ast.parse((REPO / "ledger" / "__init__.py").read_text())
    seen: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                for alias in imp.names:
                    seen[alias.name] = imp.module
    assert seen == ledger._LAZY
    assert set(ledger.__all__) == set(seen) | {"__version__"}


def test_help_and_parsing_import_nothing_heavy() -> None:
    code = ("from ledger.cli.main import build_parser\n"
            "p = build_parser()\n"
            "for argv in (['runs', '--since', '24h'], ['run', 'show', 'r1'], ['attempts', "
            "'--open'], ['health', '--json'], ['costs', '--by', 'tenant'], ['failovers'], "
            "['recover'], ['generate'], ['policy', 'check', 'goclaw'], ['demo'], "
            "['dashboard'], ['db', 'init', 'x.db']):\n"
            "    p.parse_args(argv)\n")
    assert _loaded_after(code) == []
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "ledger", "--help"],
                         capture_output=True, text=True, env=dict(os.environ,
                                                                  PYTHONPATH=str(REPO)),
                         timeout=60)
    assert res.returncode == 0 and "usage: failover-ledger" in res.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_help_answers_quickly() -> None:
    # Today about 0.07 s; eager imports took about 1 s. The best of three absorbs a busy core.
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "ledger", "--help"], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
        best = min(best, time.perf_counter() - t0)
        assert res.returncode == 0
    assert best < 0.6, f"--help took {best:.2f} s (target < 0.3 s)"


def test_version() -> None:
    res = subprocess.run([sys.executable, "-m", "ledger", "--version"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert res.returncode == 0 and res.stdout == f"failover-ledger {ledger.__version__}\n"


def test_reporting_commands_never_load_the_turn_loop(tmp_path: Path) -> None:
    """A reporting command reads: it opens the ledger and queries it, and never loads the
    turn loop, the sessions, the replay or the policy loader (issue 23: each command under
    0.5 s; these are about a tenth of its start-up).

    Nor what only writes or other databases need: the turn's effects and the telemetry that
    watches them, recovery and retention, PostgreSQL's side (SQLAlchemy's dialect included)
    on a SQLite ledger; and it builds no policy model's validator. Checked on a ledger with
    the demo's history, so that every command reads rows and turns them into records."""
    db = tmp_path / "l.db"
    seeded = _py("import io\n"
                 "from ledger.tools.demo import run_demo\n"
                 f"print(run_demo({str(db)!r}, io.StringIO())[0])\n")
    assert seeded.returncode == 0, seeded.stderr
    run_id = seeded.stdout.split()[-1]
    code = ("import contextlib, io, sys\n"
            "from ledger.cli.main import main\n"
            "for argv in (['runs'], ['run', 'show', %r], ['attempts'], ['failovers'],\n"
            "             ['costs', '--by', 'route'], ['health'], ['actions']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            f"        assert main(argv + ['--db', {str(db)!r}]) == 0, argv\n"
            "    assert out.getvalue().strip(), argv\n"
            "lazy = ('ledger.decide.turn', 'ledger.api.session', 'ledger.ops.replay',\n"
            "        'ledger.decide.replay', 'ledger.policy.load', 'yaml',\n"
            "        'ledger.decide.effects', 'ledger.telemetry', 'ledger.storage.recovery',\n"
            "        'ledger.storage.retention', 'ledger.storage.postgres',\n"
            "        'ledger.storage.pgpool', 'sqlalchemy.dialects.postgresql', 'psycopg',\n"
            "        'alembic')\n"
            "print('LOADED', sorted(m for m in lazy if m in sys.modules))\n"
            "from ledger.policy.model import Policy\n"
            "print('POLICY BUILT', Policy.__pydantic_complete__)\n") % run_id
    res = _py(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-2:] == ["LOADED []", "POLICY BUILT False"]


def test_only_the_program_leaves_its_objects_to_the_exit(tmp_path: Path) -> None:
    """Run as the program (no argv), main() freezes the collector's objects as it returns, so
    the interpreter's exit does not walk and free them one by one (about 0.2 s of a reporting
    command); called with argv (in-process, as tests and hosts do), it leaves the caller's
    collector as it was, though a reporting command freezes what it loads while it runs."""
    db = tmp_path / "l.db"
    code = ("import contextlib, gc, io, sys\n"
            "from ledger import Ledger\n"
            f"Ledger.open({str(db)!r}).close()\n"
            "from ledger.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['--db', {str(db)!r}, 'runs']) == 0\n"
            "print('IN-PROCESS', gc.get_freeze_count(), gc.isenabled())\n"
            f"sys.argv = ['failover-ledger', '--db', {str(db)!r}, 'runs']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main() == 0\n"
            "print('PROGRAM', gc.get_freeze_count() > 0, gc.isenabled())\n")
    res = _py(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-2:] == ["IN-PROCESS 0 True", "PROGRAM True True"]
