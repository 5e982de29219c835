"""Optional extras: without them, the features that need them fail with a typed error that
names the extra to install (never a bare ImportError from deep inside a driver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where ``modules`` cannot be imported."""
    block = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LEDGER_URL", None)
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("missing", ["psycopg", "psycopg_pool"])
def test_postgres_url_without_psycopg_names_the_extra(missing: str) -> None:
    res = _without([missing], (
        "import json\n"
        "from ledger import InvalidArgument, Ledger\n"
        "try:\n"
        "    Ledger.open('postgresql://auditor:hunter2@127.0.0.1:9/ledger')\n"
        "except InvalidArgument as e:\n"
        "    print(json.dumps({'field': e.field, 'extra': e.fields['extra'], 'msg': str(e),\n"
        "                      'cause': type(e.__cause__).__name__}))\n"))
    assert res.returncode == 0, res.stderr
    err = json.loads(res.stdout)
    assert err["field"] == "url" and err["extra"] == "postgres"
    assert "pip install 'failover-ledger[postgres]'" in err["msg"]
    assert "hunter2" not in err["msg"]  # the password never reaches a message
    assert err["cause"] in ("ImportError", "ModuleNotFoundError")


def test_postgres_url_without_psycopg_on_the_command_line() -> None:
    res = _without(["psycopg"], (
        "from ledger.cli.main import main\n"
        "raise SystemExit(main(['--db', 'postgresql+psycopg://u@127.0.0.1:9/x', 'health']))\n"))
    assert res.returncode == 2
    assert res.stderr.startswith("failover-ledger: error: ")
    assert "failover-ledger[postgres]" in res.stderr and len(res.stderr.splitlines()) == 1


def test_sqlite_needs_no_postgres_driver(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    res = _without(["psycopg"], (
        "from ledger import Budget, Ledger, Price, Route\n"
        f"with Ledger.open({str(db)!r}) as led:\n"
        "    led.admit_run('r', plan=[Route(id='a', provider='p', model='m', group='g',\n"
        "                  recipient='x', price=Price())], budget=Budget(max_calls=1,\n"
        "                  max_retries=0, max_cost=0))\n"
        "    print(led.get_run('r').status.value)\n"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "admitted"


def test_dashboard_without_its_extra_names_it(tmp_path: Path) -> None:
    # prometheus-client writes its /metrics: it comes with the dashboard extra.
    for missing in (["starlette", "uvicorn"], ["prometheus_client"]):
        res = _without(missing, (
            "from ledger.cli.main import main\n"
            f"raise SystemExit(main(['--db', {str(tmp_path / 'l.db')!r}, 'dashboard']))\n"))
        assert res.returncode == 2, missing
        assert "pip install 'failover-ledger[dashboard]'" in res.stderr, missing


def test_the_pydantic_ai_integration_without_its_extra_names_it() -> None:
    res = _without(["pydantic_ai"], (
        "import json\n"
        "from ledger import InvalidArgument\n"
        "try:\n"
        "    import ledger.integrations.pydantic_ai\n"
        "except InvalidArgument as e:\n"
        "    print(json.dumps({'extra': e.fields['extra'], 'msg': str(e),\n"
        "                      'cause': type(e.__cause__).__name__}))\n"))
    assert res.returncode == 0, res.stderr
    err = json.loads(res.stdout)
    assert err["extra"] == "pydantic-ai"
    assert "pip install 'failover-ledger[pydantic-ai]'" in err["msg"]
    assert err["cause"] in ("ImportError", "ModuleNotFoundError")


@pytest.mark.parametrize(("module", "blocked", "extra"), [
    ("langchain", ["langchain"], "langchain"),
    ("langchain", ["langgraph"], "langchain"),
    ("langchain", ["langchain_core"], "langchain"),
    ("openai_agents", ["agents"], "openai-agents"),
])
def test_a_framework_integration_without_its_extra_names_it(
        module: str, blocked: list[str], extra: str) -> None:
    res = _without(blocked, (
        "import json\n"
        "from ledger import InvalidArgument\n"
        "try:\n"
        f"    import ledger.integrations.{module}\n"
        "except InvalidArgument as e:\n"
        "    print(json.dumps({'extra': e.fields['extra'], 'field': e.field, 'msg': str(e),\n"
        "                      'cause': type(e.__cause__).__name__}))\n"))
    assert res.returncode == 0, res.stderr
    err = json.loads(res.stdout)
    assert err["extra"] == extra and err["field"] == f"ledger.integrations.{module}"
    assert f"pip install 'failover-ledger[{extra}]'" in err["msg"]
    assert err["cause"] in ("ImportError", "ModuleNotFoundError")
