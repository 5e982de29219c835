"""The write-path benchmark at tiny size: the report's structure, never its timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledger.bench import BenchReport, bench_database, measure
from ledger.cli.bench_cmd import parse_workers
from ledger.cli.main import build_parser, main
from ledger.errors import InvalidArgument
from ledger.storage import baseline
from ledger.storage.engine import create, normalize_url


def _check_rows(report: BenchReport, backend: str, workers: list[int]) -> None:
    assert [(r.backend, r.workers) for r in report.rows] == [(backend, w) for w in workers]
    for r in report.rows:
        assert r.attempts == 4
        assert r.ledger_per_s > 0 and r.baseline_per_s > 0
        assert r.ratio == pytest.approx(r.ledger_per_s / r.baseline_per_s, rel=0.01)
        assert r.meets_target == (r.ratio >= report.target)
    data = json.loads(report.to_json())
    assert set(data) == {"target_ratio", "meets_target", "cpus", "rows", "skipped"}
    assert set(data["rows"][0]) == {
        "backend", "workers", "attempts", "ledger_per_s", "baseline_per_s", "ratio",
        "meets_target", "ledger_s", "baseline_s",
    }
    table = report.format_table().splitlines()
    assert table[0].split()[:3] == ["backend", "workers", "attempts"]
    assert len(table) == 1 + len(workers) + 1
    assert table[-1].startswith("target: ledger >= 0.5 x baseline")


def _no_baseline_table(url: str) -> bool:
    from sqlalchemy import inspect

    eng = create(normalize_url(url))
    try:
        return baseline.baseline.name not in inspect(eng).get_table_names()
    finally:
        eng.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_bench_database_report_structure(backend: str, tmp_path: Path,
                                         request: pytest.FixtureRequest) -> None:
    url = (str(tmp_path / "bench.db") if backend == "sqlite"
           else str(request.getfixturevalue("pg_url")))
    report = BenchReport(rows=bench_database(url, workers=[1, 2], attempts=4, warmup=1))
    _check_rows(report, "sqlite" if backend == "sqlite" else "postgresql", [1, 2])
    assert _no_baseline_table(url)  # the baseline's table is dropped afterwards
    # The ledger's attempts were really recorded, settled, by separate runs (one per worker).
    from ledger.api import Ledger

    with Ledger.open(url) as led:
        page = led.attempts(route="bench-route", limit=1000)
        assert len(page.items) == (4 + 1) + (4 + 2)  # per worker count: measured + warm-ups
        assert {a.state.value for a in page.items} == {"succeeded"}
        assert len({a.run_id for a in page.items}) == 3


def test_measure_counts_every_attempt(tmp_path: Path) -> None:
    url = str(tmp_path / "m.db")
    from ledger.bench import prepared

    with prepared(url):
        m = measure(url, "baseline", 2, 5, warmup=0)
    assert (m.mode, m.workers, m.attempts) == ("baseline", 2, 5)
    assert m.seconds > 0 and m.per_second > 0


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "cli.db")
    assert main(["bench", "write", "--db", db, "--attempts", "2", "--workers", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["backend"], r["workers"], r["attempts"]) for r in data["rows"]] == [
        ("sqlite", 1, 2)]
    assert data["target_ratio"] == 0.5 and data["skipped"] == []


def test_cli_table_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "cli.db")
    assert main(["bench", "write", "--db", db, "--attempts", "2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["backend", "workers"]
    assert "sqlite" in out and "target:" in out
    with pytest.raises(InvalidArgument, match="workers"):
        parse_workers("1,x")
    with pytest.raises(InvalidArgument, match="workers"):
        parse_workers("0")
    assert main(["bench", "write", "--db", db, "--attempts", "1", "--workers", "2"]) == 2
    assert "--attempts" in capsys.readouterr().err


def test_parser_has_bench_write() -> None:
    args = build_parser().parse_args(["bench", "write", "--workers", "1,8", "--postgres"])
    assert args.workers == "1,8" and args.postgres and args.bench_db is None
