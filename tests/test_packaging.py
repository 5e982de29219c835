"""The wheel: its name, its contents (the library, no benchmark tooling), and what a fresh
install can do.

An installed ``failover-ledger`` can migrate a database, and a fresh virtual environment with
the wheel (and no PostgreSQL driver, as a SQLite-only ``pip install failover-ledger`` has) gets
the ``failover-ledger`` command, whose demo runs twice in one folder telling the same story, and
which names the ``postgres`` extra when asked to open a PostgreSQL URL.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("*.whl")
    return whl


def test_distribution_is_failover_ledger_with_extras(wheel: Path) -> None:
    # "ledger" on the package index is another project: the distribution has its own name,
    # the import package stays ledger, and the command does not clash with ledger-cli's.
    assert wheel.name.startswith("failover_ledger-")
    zf = zipfile.ZipFile(wheel)
    meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = zf.read(meta_name).decode()
    assert "\nName: failover-ledger\n" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert not any("psycopg" in r for r in core), "PostgreSQL must be an extra"
    assert any("psycopg[binary]" in r and "extra == 'postgres'" in r for r in requires)
    assert any(r.startswith("Requires-Dist: starlette") and "extra == 'dashboard'" in r
               for r in requires)
    assert not any("prometheus" in r for r in core), "prometheus-client is the dashboard's"
    assert any(r.startswith("Requires-Dist: prometheus-client") and "extra == 'dashboard'" in r
               for r in requires)
    assert not any("opentelemetry" in r for r in core), "OpenTelemetry must be an extra"
    assert any(r.startswith("Requires-Dist: opentelemetry-api") and "extra == 'otel'" in r
               for r in requires)
    assert not any("pydantic-ai" in r for r in core), "pydantic-ai must be an extra"
    assert any(r.startswith("Requires-Dist: pydantic-ai-slim") and "extra == 'pydantic-ai'" in r
               for r in requires)
    # The agent frameworks are extras too, pinned to the tested lines.
    for dist, extra in (("langchain", "langchain"), ("langchain-core", "langchain"),
                        ("langgraph", "langchain"), ("openai-agents", "openai-agents")):
        assert not any(r.startswith(f"Requires-Dist: {dist}") for r in core), dist
        assert any(r.startswith(f"Requires-Dist: {dist}<") or r.startswith(
            f"Requires-Dist: {dist}>") for r in requires if f"extra == '{extra}'" in r), dist
    entry = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    scripts = re.findall(r"^(\S+) = (\S+)$", entry.split("[console_scripts]", 1)[1], re.M)
    assert scripts == [("failover-ledger", "ledger.cli.main:main")]


def test_the_wheel_holds_the_library_and_no_benchmark_tooling(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    files = [n for n in names if ".dist-info/" not in n]
    assert files and all(n.startswith("ledger/") for n in files), [
        n for n in files if not n.startswith("ledger/")]
    # The benchmarks, the raw-driver floor, the bulk loader and the bench commands, wherever.
    tooling = [n for n in files if n.startswith(("benchmarks/", "ledger/tools/bench/"))
               or Path(n).stem in ("baseline", "floor", "bulk", "bench_cmd", "txcount")]
    assert tooling == []
    # What stays: the demo, generate (through the public API) and the test kit.
    assert {"ledger/tools/demo.py", "ledger/tools/generate.py", "ledger/cli/demo_cmd.py",
            "ledger/testing/fakeprovider.py", "ledger/testing/pgserver.py"} <= set(files)


def test_the_wheel_carries_the_apache_licence_its_metadata_names(wheel: Path) -> None:
    zf = zipfile.ZipFile(wheel)
    meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = zf.read(meta_name).decode()
    assert "\nLicense-Expression: Apache-2.0\n" in meta
    assert "\nLicense-File: LICENSE\n" in meta
    shipped = zf.read(meta_name.replace("METADATA", "licenses/LICENSE"))
    assert shipped == (REPO / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0, January 2004" in shipped


def test_the_sdist_carries_the_benchmarks_its_tests_import(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o",
                          str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"benchmarks/__main__.py", "benchmarks/write.py", "benchmarks/floor.py",
            "benchmarks/bulk.py", "tests/bench/test_bench_smoke.py", "ledger/__init__.py",
            "LICENSE"} <= names


def test_wheel_creates_and_migrates_a_database(wheel: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "ledger/py.typed" in names
    assert "ledger/_migrations/env.py" in names
    assert any(n.startswith("ledger/_migrations/versions/0001") for n in names)
    assert {"ledger/_policies/goclaw.yaml", "ledger/_policies/fased.yaml",
            "ledger/_policies/failure-domain.yaml"} <= set(names)
    site_dir = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site_dir)
    # Run from elsewhere with the extracted wheel first on the path: the repository's own
    # migrations/ and policies/ folders cannot be what makes this work.
    code = (
        "import ledger, sys\n"
        "from ledger.storage.migrate import script_location\n"
        f"assert ledger.__file__.startswith({str(site_dir)!r}), ledger.__file__\n"
        "assert script_location().endswith('_migrations'), script_location()\n"
        "from ledger import Ledger, Budget, Price, Route, preset\n"
        "led = Ledger.open('fresh.db')\n"
        "led.admit_run('r', plan=[Route(id='a', provider='p', model='m', group='g',"
        " recipient='x', price=Price())], budget=Budget(max_calls=1, max_retries=0, max_cost=1),"
        " policy='fased')\n"
        "print(led.get_run('r').policy['name'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site_dir))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fased"
    assert (tmp_path / "fresh.db").exists()


def _normalized(story: str) -> str:
    """The demo's output without what differs between two runs (ids, instants)."""
    story = re.sub(r"demo-\d{8}-\d{6}-[0-9a-f]{4}", "RUN", story)
    story = re.sub(r"d-att-\.\.[0-9a-f]{8}", "DEBIT", story)  # a debit id by its tail
    story = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "TIME", story)
    return "\n".join(line for line in story.splitlines()
                     if not line.startswith("(the ledger holds earlier demo runs"))


def test_fresh_venv_gets_the_command_and_runs_the_demo_twice(wheel: Path,
                                                             tmp_path: Path) -> None:
    """The README's first set-up command, offline: a fresh venv, the wheel, its command."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                          "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    purelib = subprocess.run([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
    # The dependencies come from this test's environment (no network here); psycopg is made
    # unimportable, as it is after a plain `pip install failover-ledger` (no postgres extra).
    deps = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "zz_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    Path(purelib, "zz_no_psycopg.pth").write_text(
        "import sys; sys.modules['psycopg'] = None\n")
    cmd = venv / "bin" / "failover-ledger"
    assert cmd.exists(), "the wheel installs the failover-ledger command"
    assert not (venv / "bin" / "ledger").exists(), "no command named ledger (ledger-cli's)"
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LEDGER_URL", "PYTHONPATH")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(cmd), *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=180)

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == "failover-ledger 0.1.0"
    # The benchmarks are no command of the installed ledger (they run from a checkout).
    usage = run("--help")
    assert usage.returncode == 0 and "demo" in usage.stdout and "generate" in usage.stdout
    assert "bench" not in usage.stdout
    assert run("bench", "write").returncode == 2
    probe = subprocess.run([str(py), "-c", "import ledger; print(ledger.__file__)"],
                           capture_output=True, text=True, env=env, cwd=work, check=True)
    assert probe.stdout.startswith(purelib), probe.stdout  # the installed wheel, not the repo
    first = run("demo")
    assert first.returncode == 0, first.stderr
    second = run("demo")
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("(the ledger holds earlier demo runs: they stay")
    assert _normalized(second.stdout) == _normalized(first.stdout)
    assert "answered by go-glm" in second.stdout and "stopped: no_candidate" in second.stdout
    runs = run("runs", "--json")
    assert runs.returncode == 0, runs.stderr
    assert '"next_cursor": null' in runs.stdout and runs.stdout.count('"run_id"') == 6

    pg = run("--db", "postgresql+psycopg://u:secret@127.0.0.1:9/none", "runs")
    assert pg.returncode == 2
    assert "pip install 'failover-ledger[postgres]'" in pg.stderr
    assert "secret" not in pg.stderr and len(pg.stderr.splitlines()) == 1
