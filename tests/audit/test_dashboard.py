"""The dashboard: JSON and HTML over the seeded ledger, through a read-only PostgreSQL role, and
the real page in headless chromium (health table, a timeline, a screenshot artifact)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.api import Ledger
from ledger.clock import ManualClock
from ledger.errors import StorageError

from .seed import T0, seed

starlette = pytest.importorskip("starlette", reason="the dashboard extra is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the dashboard extra is not installed")

from starlette.testclient import TestClient  # noqa: E402

from ledger.dashboard.app import create_app  # noqa: E402

NOW = T0 + 600
REQUIRE = os.environ.get("LEDGER_REQUIRE_POSTGRES") == "1"


def _client(url: str) -> TestClient:
    return TestClient(create_app(url, clock=ManualClock(NOW)))


def test_pages_and_json_endpoints(seeded_url: str) -> None:
    with _client(seeded_url) as c:
        page = c.get("/")
        assert page.status_code == 200
        assert "default-src 'none'" in page.headers["content-security-policy"]
        body = page.text
        assert 'id="health-table"' in body and 'id="groups-table"' in body
        assert '<svg id="activity-chart"' in body and "<script" not in body
        assert 'href="/runs/r6"' in body  # recent failovers link to their timelines
        assert "http://" not in body.replace('xmlns="http://www.w3.org/2000/svg"', "")
        run = c.get("/runs/r1")
        assert run.status_code == 200 and 'id="timeline-table"' in run.text
        assert 'id="served-route">B<' in run.text
        assert c.get("/runs?id=r3").status_code == 200
        assert c.get("/runs/nope").status_code == 404
        assert c.get("/api/runs/r1").json()["served_route"] == "B"
        fo = c.get("/api/failovers", params={"since": T0 - 1}).json()
        assert [f["run_id"] for f in fo["items"]] == ["r6", "r1"]
        groups = {g["group"]: g for g in c.get("/api/health").json()["groups"]}
        assert groups["g3"]["mode"] == "unavailable"
        costs = c.get("/api/costs", params={"since": T0 - 1, "by": "tenant"}).json()
        assert [t["key"] for t in costs["items"]] == [None, "t1", "t2"]
        act = c.get("/api/activity", params={"since": T0, "until": NOW, "buckets": 6}).json()
        assert [b["attempts"] for b in act] == [2, 1, 2, 1, 1, 1]
        assert c.get("/api/costs", params={"by": "color"}).status_code == 400
        assert c.post("/api/health").status_code == 405  # nothing can be changed


def test_never_shows_secrets(seeded_url: str) -> None:
    # Profiles appear by id only; the ledger stores no secret, and the page has no place for one.
    with _client(seeded_url) as c:
        text = c.get("/runs/r1").text + c.get("/").text
    assert "pa1" in text
    for word in ("api_key", "secret", "Authorization", "Bearer"):
        assert word not in text


@pytest.mark.postgres
def test_works_with_a_read_only_role(pg_server: Any, pg_url: str) -> None:
    seed(pg_url)
    db = pg_url.rsplit("/", 1)[1]
    pg_server.psql("DO $$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname='auditor') "
                   "THEN CREATE ROLE auditor LOGIN; END IF; END$$")
    pg_server.psql("GRANT USAGE ON SCHEMA public TO auditor; "
                   "GRANT SELECT ON ALL TABLES IN SCHEMA public TO auditor", db)
    ro_url = pg_url.replace("postgres@", "auditor@", 1)
    with _client(ro_url) as c:
        assert c.get("/").status_code == 200
        assert c.get("/runs/r1").status_code == 200
        assert c.get("/api/health").json()["groups"]
    # The role really is read-only: a write through the ledger API is refused by the server.
    led = Ledger.open(ro_url, clock=ManualClock(NOW), migrate_schema=False)
    try:
        with pytest.raises(StorageError, match="permission denied"):
            led.configure_group("g9", max_in_flight=1)
    finally:
        led.close()


# -- a real browser --------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture
def served(seeded_url: str) -> Iterator[str]:
    """The dashboard on a free loopback port in a thread; yields its base URL."""
    from ledger.testing.pgserver import free_port

    port = free_port()
    config = uvicorn.Config(create_app(seeded_url, clock=ManualClock(NOW)), host="127.0.0.1",
                            port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    ready = threading.Event()
    # Poll for readiness (the server binds asynchronously); bounded, no fixed sleep.
    for _ in range(500):
        if not thread.is_alive():
            break
        try:
            with urllib.request.urlopen(base + "/api/health", timeout=2) as r:
                if r.status == 200:
                    ready.set()
                    break
        except OSError:
            ready.wait(0.02)
    assert ready.is_set(), "dashboard did not start"
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _browse(chromium: str, *args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="ledger-chromium-") as profile:
        return subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=90)


@pytest.mark.browser
def test_dashboard_in_headless_chromium(served: str, seeded_url: str) -> None:
    chromium = _chromium()
    if chromium is None:
        msg = "chromium is not installed (apt-get install chromium); browser test cannot run"
        if REQUIRE:
            pytest.fail(msg + " and LEDGER_REQUIRE_POSTGRES=1")
        pytest.skip(msg)
    dom = _browse(chromium, "--dump-dom", served + "/")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'id="health-table"' in html and 'id="groups-table"' in html
    health_rows = html.split('id="health-table"', 1)[1].split("</table>", 1)[0]
    for key in ("A", "B", "C"):
        assert f"<td>{key}</td>" in health_rows
    assert '<span class="unavailable">unavailable</span>' in html  # g3's operator hold
    assert '<svg id="activity-chart"' in html

    dom = _browse(chromium, "--dump-dom", served + "/runs/r1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    timeline = dom.stdout.split('id="timeline-table"', 1)[1].split("</table>", 1)[0]
    rows = timeline.split("<tr>")[2:]
    assert len(rows) == 2
    assert "<td>A</td>" in rows[0] and "rate_limit" in rows[0] and "primary" in rows[0]
    assert "<td>B</td>" in rows[1] and "next_candidate" in rows[1] and "C (cooling)" in rows[1]

    artifacts = Path(os.environ.get("LEDGER_ARTIFACTS", "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    backend = "postgres" if seeded_url.startswith("postgresql") else "sqlite"
    for name, path in ((f"dashboard-{backend}.png", "/"),
                       (f"dashboard-run-{backend}.png", "/runs/r1")):
        shot = artifacts.resolve() / name
        shot.unlink(missing_ok=True)
        res = _browse(chromium, f"--screenshot={shot}", "--window-size=1280,900",
                      served + path)
        assert res.returncode == 0, res.stderr[-2000:]
        assert shot.exists() and shot.stat().st_size > 10_000
