"""The documentation's code runs as written: the quickstart's agent and the README's example
are extracted from the Markdown and run in a fresh folder, so neither can rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _first_python_block(path: Path, after: str = "") -> str:
    text = path.read_text()
    if after:
        text = text[text.index(after):]
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match is not None, f"no python block in {path}"
    return match.group(1)


def _run(code: str, folder: Path) -> subprocess.CompletedProcess[str]:
    script = folder / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True,
                          text=True, timeout=120)


def test_the_quickstart_agent_runs_as_written(tmp_path: Path) -> None:
    code = _first_python_block(REPO / "docs" / "quickstart.md")
    loop = code[code.index("# The agent loop."):code.index("asyncio.run(main())")]
    assert len([ln for ln in loop.splitlines() if ln.strip()]) <= 40  # "about 40 lines"
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("[served by backup") == 3  # failed over once, then kept the route used
    assert "2 attempt(s)" in out and "spent" in out


def test_the_quickstart_pdf_agent_runs_as_written(tmp_path: Path) -> None:
    code = _first_python_block(REPO / "docs" / "quickstart.md", after="## An agent that reads")
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 40  # "short"
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "served by reader holding" in out
    assert "skipped: pdf input: the request carries part 1 (application/pdf)" in out


def test_the_readme_example_runs_as_pasted(tmp_path: Path) -> None:
    done = _run(_first_python_block(REPO / "README.md", after="## Using it"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "served by route-b after 2 attempts" in done.stdout
